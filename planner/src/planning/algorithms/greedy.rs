//! The rule of torch.distributed.checkpoint's `dedup_save_plans`, as a
//! baseline: items in the order the ranks' local plans list them (rank 0's
//! first; an item first appears in the plan of its lowest holder), each item
//! held by several ranks whole to the holder with the fewest planned bytes so
//! far (lowest rank on ties). Objects count as 1 byte, as in DCP.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{sole_holder, whole};
use crate::model::manifest::{Holders, Leaf, Manifest};
use crate::planning::plan::Piece;

fn dcp_size(leaf: &Leaf) -> u64 {
    if leaf.is_tensor() {
        leaf.nbytes
    } else {
        1
    }
}

pub(super) fn plan(manifest: &Manifest, ranks: &mut [Vec<Piece>]) {
    let leaves = manifest.leaves();
    let mut size = vec![0u64; ranks.len()];
    // Leaves held by one rank are already placed; DCP counts them as it
    // meets them. Every leaf is met first in its lowest holder's plan, in
    // manifest order there; a stable sort by that holder gives DCP's order.
    let first_seen = |leaf: &Leaf| match manifest.holders(leaf) {
        Holders::All => 0,
        Holders::Ranks(rs) => rs[0],
    };
    let mut order: Vec<u32> = (0..leaves.len() as u32).collect();
    if manifest.has_groups() || leaves.iter().any(|l| l.owner.is_some()) {
        order.sort_by_key(|&i| first_seen(&leaves[i as usize]));
    }
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> =
        (0..ranks.len() as u32).map(|r| Reverse((0, r))).collect();
    for i in order {
        let i = i as usize;
        let leaf = &leaves[i];
        if let Some(r) = sole_holder(manifest, leaf) {
            size[r as usize] += dcp_size(leaf);
            continue;
        }
        match manifest.holders(leaf) {
            Holders::Ranks(holders) => {
                let r = *holders
                    .iter()
                    .min_by_key(|&&r| (size[r as usize], r))
                    .expect("a group is not empty");
                ranks[r as usize].push(whole(i, leaf.units()));
                size[r as usize] += dcp_size(leaf);
            }
            Holders::All => loop {
                let Reverse((s, r)) = heap.pop().expect("at least one rank");
                if s != size[r as usize] {
                    heap.push(Reverse((size[r as usize], r)));
                    continue;
                }
                ranks[r as usize].push(whole(i, leaf.units()));
                size[r as usize] += dcp_size(leaf);
                heap.push(Reverse((size[r as usize], r)));
                break;
            },
        }
    }
}
