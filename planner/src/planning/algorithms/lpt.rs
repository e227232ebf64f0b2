//! Longest processing time first: whole leaves, largest first, each to the
//! rank whose cost would be lowest. Never splits. Leaves held by a group go
//! first (largest first, each to its least-loaded holder), then the leaves
//! every rank holds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{replicated_by_size, sole_holder, whole, Key};
use crate::model::cost::CostModel;
use crate::model::manifest::{Holders, Manifest};
use crate::planning::plan::Piece;

pub(super) fn plan(manifest: &Manifest, cost: &CostModel, ranks: &mut [Vec<Piece>]) {
    let leaves = manifest.leaves();
    // A rank's load counts the fixed cost it pays once it writes anything.
    let mut load: Vec<f64> = ranks
        .iter()
        .map(|list| {
            let owned: f64 = list
                .iter()
                .map(|p| cost.piece_cost(leaves[p.leaf as usize].nbytes))
                .sum();
            cost.fixed_s + owned
        })
        .collect();
    let mut grouped: Vec<u32> = (0..leaves.len() as u32)
        .filter(|&i| {
            let l = &leaves[i as usize];
            l.holders.is_some() && sole_holder(manifest, l).is_none()
        })
        .collect();
    grouped.sort_by_key(|&i| (Reverse(leaves[i as usize].nbytes), i));
    for i in grouped {
        let leaf = &leaves[i as usize];
        let Holders::Ranks(holders) = manifest.holders(leaf) else {
            unreachable!("a leaf with a group has ranks")
        };
        let r = *holders
            .iter()
            .min_by(|&&a, &&b| {
                load[a as usize]
                    .total_cmp(&load[b as usize])
                    .then(a.cmp(&b))
            })
            .expect("a group is not empty");
        ranks[r as usize].push(whole(i as usize, leaf.units()));
        load[r as usize] += cost.piece_cost(leaf.nbytes);
    }
    let mut heap: BinaryHeap<Reverse<(Key, u32)>> = load
        .iter()
        .enumerate()
        .map(|(r, &l)| Reverse((Key(l), r as u32)))
        .collect();
    for s in replicated_by_size(manifest) {
        let Reverse((Key(load), r)) = heap.pop().expect("at least one rank");
        ranks[r as usize].push(whole(s.leaf as usize, s.units));
        heap.push(Reverse((Key(load + cost.piece_cost(s.nbytes)), r)));
    }
}
