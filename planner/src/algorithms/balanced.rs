//! The default algorithm: near-optimal, with as few splits as it can.
//!
//! 1. The lower bound fixes the writer count `k` and the level `M(k)` that no
//!    rank's cost can stay under (see [`crate::bound`]). Owners always write;
//!    the other writers are spread over nodes.
//! 2. Each writer gets a capacity: the level minus its fixed cost and owned load.
//! 3. Replicated leaves, largest first, fill the writers one after the other
//!    (McNaughton's wrap-around rule for preemptive scheduling). A leaf that
//!    fits the current writer goes whole. One that does not is cut: a
//!    row-aligned piece of at least `min_piece_bytes` fills the writer up to
//!    the level, and the rest goes on to the next writer. So each writer gets
//!    at most one cut leaf from each neighbour, and most leaves stay whole.
//!    When no worthwhile piece fits the room left on a writer, that room is
//!    filled with the largest of the smallest leaves that fit whole, and the
//!    next writer takes over.
//! 4. Should that not place everything, the same leaves are tried largest
//!    first on whichever writer has the most room left (LPT, with the same
//!    cutting rule), which packs better when few leaves may be cut.
//! 5. If neither fits (every cut adds a piece overhead, and some leaves cannot
//!    be cut), the level is raised a little and steps 3-4 repeat.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::{replicated_by_size, Key, SizedLeaf};
use crate::bound::{lower_bound, LoadSummary};
use crate::cost::{CostModel, Topology};
use crate::manifest::{Leaf, Manifest};
use crate::plan::Piece;

/// Relative raises of the level tried after the absolute ones (one and two
/// piece overheads); beyond the last one the level doubles until everything
/// fits (it always does eventually: a large enough level takes every leaf
/// whole on one writer).
const LEVEL_STEPS: [f64; 15] = [
    1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
];

pub(super) fn plan(
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    ranks: &mut [Vec<Piece>],
) {
    let summary = LoadSummary::new(manifest, world_size, cost);
    if summary.replicated_leaves == 0 {
        return;
    }
    let lb = lower_bound(&summary, cost, world_size);
    let writers = choose_writers(&summary, topology, world_size, lb.writers);
    let leaves = manifest.leaves();
    let order = replicated_by_size(manifest);
    // Whole-leaf costs in `order`: non-increasing, as the cost grows with the size.
    let costs: Vec<f64> = order.iter().map(|s| cost.piece_cost(s.nbytes)).collect();
    let fill = Fill {
        leaves,
        cost,
        order: &order,
        costs: &costs,
    };

    let base = lb.level_s;
    let mut levels = vec![base, base + cost.piece_s, base + 2.0 * cost.piece_s];
    levels.extend(LEVEL_STEPS.iter().map(|r| base * (1.0 + r)));
    levels.sort_by(f64::total_cmp);
    levels.dedup();
    let mut attempt = 0;
    let mut level = base;
    loop {
        if attempt < levels.len() {
            level = levels[attempt];
        } else {
            level = if level > 0.0 {
                level * 2.0
            } else {
                f64::MIN_POSITIVE
            };
        }
        attempt += 1;
        let caps: Vec<f64> = writers
            .iter()
            .map(|&r| level - cost.fixed_s - summary.owned_load[r as usize])
            .collect();
        let tolerance = level * 1e-12;
        // Sequential filling needs the fewest writers and copes best with
        // many cuts; spreading packs better when few leaves may be cut. The
        // first that fits wins. Spreading starts from the second level, at
        // most one piece overhead above the bound: at the bound itself
        // little fits once a leaf must be cut, and skipping it saves a pass.
        let placed = fill.sequential(&caps, tolerance).or_else(|| {
            if attempt > 1 {
                fill.spread(&caps, tolerance)
            } else {
                None
            }
        });
        if let Some(per_writer) = placed {
            for (&r, pieces) in writers.iter().zip(per_writer) {
                ranks[r as usize].extend(pieces);
            }
            return;
        }
    }
}

/// The `k` writers: every owner, then non-owners in the topology's spread order.
fn choose_writers(summary: &LoadSummary, topology: &Topology, world_size: u32, k: u32) -> Vec<u32> {
    let mut writers: Vec<u32> = (0..world_size)
        .filter(|&r| summary.is_owner[r as usize])
        .collect();
    for r in topology.spread_order(world_size) {
        if writers.len() >= k as usize {
            break;
        }
        if !summary.is_owner[r as usize] {
            writers.push(r);
        }
    }
    writers
}

/// Where a piece of `leaf` from unit `start` should end to fill `cap`
/// seconds: a row-aligned cut that leaves both the piece and the rest at
/// least `min_piece_bytes` (or one row). `None` when there is no such cut.
fn cut(leaf: &Leaf, start: u64, cap: f64, cost: &CostModel) -> Option<u64> {
    if !leaf.is_tensor() {
        return None;
    }
    let units = leaf.units();
    let row_units = leaf.row_units();
    // Saturating: a tensor with no elements can have rows wider than 2^64 bytes.
    let row_bytes = row_units.saturating_mul(leaf.unit_bytes());
    if row_bytes == 0 || start >= units {
        return None;
    }
    let min_rows = cost.min_piece_bytes.div_ceil(row_bytes).max(1);
    let rows_left = (units - start) / row_units;
    let room = ((cap - cost.piece_s) * cost.bandwidth).max(0.0);
    let mut rows = ((room / row_bytes as f64).floor() as u64).min(rows_left);
    if rows_left - rows < min_rows {
        // Leave a remainder that is itself a worthwhile piece.
        rows = rows_left.saturating_sub(min_rows);
    }
    if rows < min_rows || rows == 0 {
        return None;
    }
    Some(start + rows * row_units)
}

/// The replicated leaves to place, and how.
struct Fill<'a> {
    leaves: &'a [Leaf],
    cost: &'a CostModel,
    /// Replicated leaves, largest first.
    order: &'a [SizedLeaf],
    /// Whole-leaf cost of each entry of `order`.
    costs: &'a [f64],
}

/// Skips placed entries of `order`: `next[p] == p` while entry `p` is
/// unplaced, else it points further on (union-find with path halving).
/// `next[n] == n` is the end.
fn find(next: &mut [u32], mut p: usize) -> usize {
    while next[p] as usize != p {
        let q = next[p] as usize;
        next[p] = next[q];
        p = q;
    }
    p
}

impl Fill<'_> {
    /// Step 3: fills the writers one after the other. `None` when the leaves
    /// do not all fit under the capacities.
    fn sequential(&self, caps: &[f64], tolerance: f64) -> Option<Vec<Vec<Piece>>> {
        let n = self.order.len();
        let mut caps = caps.to_vec();
        let mut out: Vec<Vec<Piece>> = vec![Vec::new(); caps.len()];
        let mut next: Vec<u32> = (0..=n as u32).collect();
        let mut j = 0usize;
        let mut pos = 0usize;
        loop {
            pos = find(&mut next, pos);
            if pos >= n {
                return Some(out);
            }
            next[pos] = pos as u32 + 1;
            let SizedLeaf { leaf: i, units, .. } = self.order[pos];
            let leaf = &self.leaves[i as usize];
            let mut start = 0u64;
            loop {
                let cap = *caps.get(j)?;
                let rest = if start == 0 {
                    self.costs[pos]
                } else {
                    self.cost.piece_cost(leaf.range_bytes(start, units))
                };
                if rest <= cap + tolerance {
                    out[j].push(Piece {
                        leaf: i,
                        start,
                        stop: units,
                    });
                    caps[j] = cap - rest;
                    break;
                }
                if let Some(stop) = cut(leaf, start, cap, self.cost) {
                    out[j].push(Piece {
                        leaf: i,
                        start,
                        stop,
                    });
                    caps[j] = cap - self.cost.piece_cost(leaf.range_bytes(start, stop));
                    start = stop;
                }
                // Writer `j` is full up to less than a worthwhile piece: top
                // it up with small leaves, then move on.
                self.top_up(&mut caps[j], &mut out[j], &mut next, pos + 1, tolerance);
                j += 1;
            }
        }
    }

    /// Places whole the largest unplaced leaves from position `from` on that
    /// fit in `cap`, until none does.
    fn top_up(
        &self,
        cap: &mut f64,
        out: &mut Vec<Piece>,
        next: &mut [u32],
        from: usize,
        tolerance: f64,
    ) {
        let n = self.order.len();
        let mut lo = from.min(n);
        loop {
            // `costs` is non-increasing: the leaves that fit are a suffix.
            let first_fit = lo + self.costs[lo..].partition_point(|&c| c > *cap + tolerance);
            let p = find(next, first_fit);
            if p >= n {
                return;
            }
            next[p] = p as u32 + 1;
            let SizedLeaf { leaf, units, .. } = self.order[p];
            out.push(Piece {
                leaf,
                start: 0,
                stop: units,
            });
            *cap -= self.costs[p];
            lo = p + 1;
        }
    }

    /// Step 4: each leaf, largest first, to the writer with the most room
    /// left, cut where it does not fit. `None` when the leaves do not fit.
    fn spread(&self, caps: &[f64], tolerance: f64) -> Option<Vec<Vec<Piece>>> {
        let mut out: Vec<Vec<Piece>> = vec![Vec::new(); caps.len()];
        // Max-heap on remaining capacity; ties go to the earlier writer.
        let mut heap: BinaryHeap<(Key, Reverse<u32>)> = caps
            .iter()
            .enumerate()
            .map(|(slot, &cap)| (Key(cap), Reverse(slot as u32)))
            .collect();
        for (pos, &SizedLeaf { leaf: i, units, .. }) in self.order.iter().enumerate() {
            let leaf = &self.leaves[i as usize];
            let mut start = 0u64;
            loop {
                let (Key(cap), Reverse(slot)) = heap.pop()?;
                let rest = if start == 0 {
                    self.costs[pos]
                } else {
                    self.cost.piece_cost(leaf.range_bytes(start, units))
                };
                if rest <= cap + tolerance {
                    out[slot as usize].push(Piece {
                        leaf: i,
                        start,
                        stop: units,
                    });
                    heap.push((Key(cap - rest), Reverse(slot)));
                    break;
                }
                // The emptiest writer cannot take a worthwhile piece: no one can.
                let stop = cut(leaf, start, cap, self.cost)?;
                let piece_cost = self.cost.piece_cost(leaf.range_bytes(start, stop));
                out[slot as usize].push(Piece {
                    leaf: i,
                    start,
                    stop,
                });
                heap.push((Key(cap - piece_cost), Reverse(slot)));
                start = stop;
            }
        }
        Some(out)
    }
}
