//! The rule of torch.distributed.checkpoint's `dedup_save_plans`, as a
//! baseline: items in the order the ranks' local plans list them (rank 0's
//! first), each replicated item whole to the rank with the fewest planned
//! bytes so far (lowest rank on ties). Objects count as 1 byte, as in DCP.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::whole;
use crate::manifest::{Leaf, Manifest};
use crate::plan::Piece;

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
    // Owned leaves are already placed; DCP counts them as it meets them.
    // Rank 0's local plan holds every replicated leaf and its own leaves, in
    // manifest order; other ranks' own leaves come after.
    let mut heap: BinaryHeap<Reverse<(u64, u32)>> =
        (0..ranks.len() as u32).map(|r| Reverse((0, r))).collect();
    for (i, leaf) in leaves.iter().enumerate() {
        match leaf.owner {
            Some(0) => size[0] += dcp_size(leaf),
            Some(_) => {}
            None => loop {
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
