//! Longest processing time first: whole leaves, largest first, each to the
//! rank whose cost would be lowest. Never splits.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{replicated_by_size, whole, Key};
use crate::cost::CostModel;
use crate::manifest::Manifest;
use crate::plan::Piece;

pub(super) fn plan(manifest: &Manifest, cost: &CostModel, ranks: &mut [Vec<Piece>]) {
    let leaves = manifest.leaves();
    // A rank's load counts the fixed cost it pays once it writes anything.
    let mut heap: BinaryHeap<Reverse<(Key, u32)>> = ranks
        .iter()
        .enumerate()
        .map(|(r, list)| {
            let owned: f64 = list
                .iter()
                .map(|p| cost.piece_cost(leaves[p.leaf as usize].nbytes))
                .sum();
            Reverse((Key(cost.fixed_s + owned), r as u32))
        })
        .collect();
    for s in replicated_by_size(manifest) {
        let Reverse((Key(load), r)) = heap.pop().expect("at least one rank");
        ranks[r as usize].push(whole(s.leaf as usize, s.units));
        heap.push(Reverse((Key(load + cost.piece_cost(s.nbytes)), r)));
    }
}
