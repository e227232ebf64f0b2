//! The default algorithm: near-optimal, with as few splits as it can.
//!
//! 1. The lower bound fixes the writer count `k` and the level `M(k)` that no
//!    rank's cost can stay under (see [`crate::bound`]). Owners always write;
//!    the other writers are spread over nodes.
//! 2. Each writer gets a capacity: the level minus its fixed cost and owned
//!    load. With a `node_bandwidth`, each node also gets a byte budget: what
//!    its link moves in the level less its fixed cost, less its owned bytes;
//!    its writers share it.
//! 3. Replicated leaves, largest first, fill the writers one after the other
//!    (McNaughton's wrap-around rule for preemptive scheduling). A leaf that
//!    fits the current writer goes whole. One that does not is cut: a piece
//!    on the leaf's grain ([`CostModel::grain_units`]: any 4 KiB-aligned
//!    element by default, whole rows on request) of at least
//!    `min_piece_bytes` fills the writer up to
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

use super::{cut, replicated_by_size, Key, SizedLeaf};
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
    let summary = LoadSummary::new(manifest, world_size, topology, cost);
    if summary.replicated_leaves == 0 {
        return;
    }
    let lb = lower_bound(&summary, cost, world_size);
    let writers = choose_writers(&summary, topology, world_size, lb.writers);
    let leaves = manifest.leaves();
    let order = replicated_by_size(manifest);
    // Whole-leaf costs in `order`: non-increasing, as the cost grows with the size.
    let costs: Vec<f64> = order.iter().map(|s| cost.piece_cost(s.nbytes)).collect();
    let node_of: Vec<usize> = writers
        .iter()
        .map(|&r| topology.node_of(r) as usize)
        .collect();
    let fill = Fill {
        leaves,
        cost,
        order: &order,
        costs: &costs,
        node_of: &node_of,
    };

    let base = lb.level_s;
    let mut levels = vec![base, base + cost.piece_s, base + 2.0 * cost.piece_s];
    levels.extend(LEVEL_STEPS.iter().map(|r| base * (1.0 + r)));
    levels.sort_by(f64::total_cmp);
    levels.dedup();
    let attempt = |level: f64, spread: bool| -> Option<Vec<Vec<Piece>>> {
        let caps: Vec<f64> = writers
            .iter()
            .map(|&r| level - cost.fixed_s - summary.owned_load[r as usize])
            .collect();
        let rooms = node_rooms(&summary, topology, cost, level, world_size);
        let tolerance = level * 1e-12;
        // Sequential filling needs the fewest writers and copes best with
        // many cuts; spreading packs better when few leaves may be cut. The
        // first that fits wins. Spreading starts from the second level, at
        // most one piece overhead above the bound: at the bound itself
        // little fits once a leaf must be cut, and skipping it saves a pass.
        fill.sequential(&caps, &rooms, tolerance).or_else(|| {
            if spread {
                fill.spread(&caps, &rooms, tolerance)
            } else {
                None
            }
        })
    };
    // The first level that fits: the bound, a piece overhead or two above
    // it, small relative raises, then doublings.
    let mut failed = None;
    let mut level = base;
    let mut placed = None;
    for (i, &candidate) in levels.iter().enumerate() {
        level = candidate;
        placed = attempt(level, i > 0);
        if placed.is_some() {
            break;
        }
        failed = Some(level);
    }
    while placed.is_none() {
        failed = Some(level);
        level = if level > 0.0 {
            level * 2.0
        } else {
            f64::MIN_POSITIVE
        };
        placed = attempt(level, true);
    }
    // Bisection between the last level that failed and the first that fits,
    // when they are more than 0.1% apart, down to a relative 1e-6: a coarse
    // step would otherwise decide the plan's time (a level that overshoots
    // lets one writer take what two could share), and the tried levels
    // depend on the bound, which falls as ranks are added, so more ranks
    // could get a worse plan. Within 0.1% (a large state, whose level fits
    // a piece overhead or a small raise above the bound) it is not worth
    // the extra passes.
    if let Some(mut lo) = failed.filter(|&lo| level > lo * (1.0 + 1e-3)) {
        let mut hi = level;
        while hi - lo > hi * 1e-6 {
            let mid = lo + (hi - lo) / 2.0;
            if mid <= lo || mid >= hi {
                break;
            }
            match attempt(mid, true) {
                Some(better) => {
                    hi = mid;
                    placed = Some(better);
                }
                None => lo = mid,
            }
        }
    }
    if let Some(per_writer) = placed {
        for (&r, pieces) in writers.iter().zip(per_writer) {
            ranks[r as usize].extend(pieces);
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

/// Per node, the bytes its writers may still move under `level`: what its
/// link moves in the level less the fixed cost, less what its owners write.
/// Infinite without a `node_bandwidth`.
fn node_rooms(
    summary: &LoadSummary,
    topology: &Topology,
    cost: &CostModel,
    level: f64,
    world_size: u32,
) -> Vec<f64> {
    let nodes = summary.nodes as usize;
    let Some(nu) = cost.node_bandwidth else {
        return vec![f64::INFINITY; nodes];
    };
    let mut rooms = vec![((level - cost.fixed_s) * nu).max(0.0); nodes];
    for r in 0..world_size {
        rooms[topology.node_of(r) as usize] -= summary.owned_bytes[r as usize] as f64;
    }
    rooms
}

/// The replicated leaves to place, and how.
struct Fill<'a> {
    leaves: &'a [Leaf],
    cost: &'a CostModel,
    /// Replicated leaves, largest first.
    order: &'a [SizedLeaf],
    /// Whole-leaf cost of each entry of `order`.
    costs: &'a [f64],
    /// Node of each writer slot.
    node_of: &'a [usize],
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
    /// Whether a piece of `cost_s` seconds and `bytes` bytes fits a writer
    /// with `cap` seconds left whose node has `node_room` bytes left.
    fn fits(&self, cost_s: f64, bytes: u64, cap: f64, node_room: f64, tolerance: f64) -> bool {
        cost_s <= cap + tolerance
            && bytes as f64 / self.cost.bandwidth <= node_room / self.cost.bandwidth + tolerance
    }

    /// The most a single whole piece may cost on a writer with `cap` seconds
    /// left on a node with `node_room` bytes left.
    fn room(&self, cap: f64, node_room: f64) -> f64 {
        cap.min(self.cost.piece_s + node_room / self.cost.bandwidth)
    }

    /// Places `start..units` of entry `pos` on writer `j`: whole (`Ok`),
    /// or cut (`Err(Some(stop))`: the rest starts at `stop`), or not at all
    /// when no worthwhile piece fits (`Err(None)`).
    #[allow(clippy::too_many_arguments)]
    fn place(
        &self,
        pos: usize,
        start: u64,
        j: usize,
        caps: &mut [f64],
        rooms: &mut [f64],
        out: &mut [Vec<Piece>],
        tolerance: f64,
    ) -> Result<(), Option<u64>> {
        let SizedLeaf { leaf: i, units, .. } = self.order[pos];
        let leaf = &self.leaves[i as usize];
        let node = self.node_of[j];
        let rest_bytes = leaf.range_bytes(start, units);
        let rest = if start == 0 {
            self.costs[pos]
        } else {
            self.cost.piece_cost(rest_bytes)
        };
        if self.fits(rest, rest_bytes, caps[j], rooms[node], tolerance) {
            out[j].push(Piece {
                leaf: i,
                start,
                stop: units,
            });
            caps[j] -= rest;
            rooms[node] -= rest_bytes as f64;
            return Ok(());
        }
        let most = ((caps[j] - self.cost.piece_s) * self.cost.bandwidth).min(rooms[node]);
        match cut(leaf, start, most, self.cost) {
            Some(stop) => {
                let bytes = leaf.range_bytes(start, stop);
                out[j].push(Piece {
                    leaf: i,
                    start,
                    stop,
                });
                caps[j] -= self.cost.piece_cost(bytes);
                rooms[node] -= bytes as f64;
                Err(Some(stop))
            }
            None => Err(None),
        }
    }

    /// Step 3: fills the writers one after the other. `None` when the leaves
    /// do not all fit under the capacities.
    fn sequential(&self, caps: &[f64], rooms: &[f64], tolerance: f64) -> Option<Vec<Vec<Piece>>> {
        let n = self.order.len();
        let mut caps = caps.to_vec();
        let mut rooms = rooms.to_vec();
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
            let mut start = 0u64;
            loop {
                if j >= caps.len() {
                    return None;
                }
                match self.place(pos, start, j, &mut caps, &mut rooms, &mut out, tolerance) {
                    Ok(()) => break,
                    Err(Some(stop)) => start = stop,
                    Err(None) => {}
                }
                // Writer `j` is full up to less than a worthwhile piece: top
                // it up with small leaves, then move on.
                let node = self.node_of[j];
                self.top_up(
                    &mut caps[j],
                    &mut rooms[node],
                    &mut out[j],
                    &mut next,
                    pos + 1,
                    tolerance,
                );
                j += 1;
            }
        }
    }

    /// Places whole the largest unplaced leaves from position `from` on that
    /// fit in `cap` seconds and `node_room` bytes, until none does.
    fn top_up(
        &self,
        cap: &mut f64,
        node_room: &mut f64,
        out: &mut Vec<Piece>,
        next: &mut [u32],
        from: usize,
        tolerance: f64,
    ) {
        let n = self.order.len();
        let mut lo = from.min(n);
        loop {
            // `costs` is non-increasing: the leaves that fit are a suffix.
            let room = self.room(*cap, *node_room);
            let first_fit = lo + self.costs[lo..].partition_point(|&c| c > room + tolerance);
            let p = find(next, first_fit);
            if p >= n {
                return;
            }
            next[p] = p as u32 + 1;
            let SizedLeaf {
                leaf,
                units,
                nbytes,
            } = self.order[p];
            out.push(Piece {
                leaf,
                start: 0,
                stop: units,
            });
            *cap -= self.costs[p];
            *node_room -= nbytes as f64;
            lo = p + 1;
        }
    }

    /// Step 4: each leaf, largest first, to the writer with the most room
    /// left, cut where it does not fit. `None` when the leaves do not fit.
    fn spread(&self, caps: &[f64], rooms: &[f64], tolerance: f64) -> Option<Vec<Vec<Piece>>> {
        let mut caps = caps.to_vec();
        let mut rooms = rooms.to_vec();
        let mut out: Vec<Vec<Piece>> = vec![Vec::new(); caps.len()];
        // Max-heap on room left; ties go to the earlier writer. A writer's
        // room also shrinks when another writer of its node writes, so a
        // popped key may be stale: it is then pushed back with its room now.
        let mut heap: BinaryHeap<(Key, Reverse<u32>)> = caps
            .iter()
            .enumerate()
            .map(|(slot, &cap)| {
                (
                    Key(self.room(cap, rooms[self.node_of[slot]])),
                    Reverse(slot as u32),
                )
            })
            .collect();
        for pos in 0..self.order.len() {
            let mut start = 0u64;
            loop {
                let (Key(key), Reverse(slot)) = heap.pop()?;
                let j = slot as usize;
                let now = self.room(caps[j], rooms[self.node_of[j]]);
                if now < key {
                    heap.push((Key(now), Reverse(slot)));
                    continue;
                }
                let placed = self.place(pos, start, j, &mut caps, &mut rooms, &mut out, tolerance);
                heap.push((
                    Key(self.room(caps[j], rooms[self.node_of[j]])),
                    Reverse(slot),
                ));
                match placed {
                    Ok(()) => break,
                    Err(Some(stop)) => start = stop,
                    // The emptiest writer cannot take a worthwhile piece: no one can.
                    Err(None) => return None,
                }
            }
        }
        Some(out)
    }
}
