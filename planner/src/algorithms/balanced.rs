//! The default algorithm: near-optimal, with as few splits as it can.
//!
//! 1. The lower bound fixes the writer count `k` and the level `M(k)` that no
//!    rank's cost can stay under (see [`crate::bound`]). Owners always write;
//!    the other writers are spread over nodes.
//! 2. Each writer gets a capacity: the level minus its fixed cost and owned load.
//! 3. Replicated leaves go largest first to the writer with the most capacity
//!    left. A leaf that fits goes whole (longest-processing-time order, so most
//!    leaves are never cut). A leaf that does not fit fills that writer up to
//!    the level with a row-aligned piece no smaller than `min_piece_bytes`, and
//!    its remainder goes on to the next writer, as in McNaughton's wrap-around
//!    rule for preemptive scheduling.
//! 4. If the leaves do not fit (every cut adds a piece overhead, and some
//!    leaves cannot be cut), the level is raised a little and step 3 repeats.

use std::collections::BinaryHeap;

use super::{replicated_by_size, Key};
use crate::bound::{lower_bound, LoadSummary};
use crate::cost::{CostModel, Topology};
use crate::manifest::Manifest;
use crate::plan::Piece;

/// Relative raises of the level tried in turn; beyond the last one the
/// level doubles until everything fits (it always does eventually: a large
/// enough level takes every leaf whole).
const LEVEL_STEPS: [f64; 12] =
    [0.0, 1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5];

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
    let order = replicated_by_size(manifest);
    let mut step = 0;
    let mut level = lb.level_s;
    loop {
        let target = if step < LEVEL_STEPS.len() {
            lb.level_s * (1.0 + LEVEL_STEPS[step])
        } else {
            level * 2.0
        };
        level = target;
        if let Some(extra) = fill(manifest, cost, &summary, &writers, &order, target) {
            for (r, pieces) in extra {
                ranks[r as usize].extend(pieces);
            }
            return;
        }
        step += 1;
    }
}

/// The `k` writers: every owner, then non-owners in the topology's spread order.
fn choose_writers(summary: &LoadSummary, topology: &Topology, world_size: u32, k: u32) -> Vec<u32> {
    let mut writers: Vec<u32> =
        (0..world_size).filter(|&r| summary.is_owner[r as usize]).collect();
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

/// One attempt at a level. Returns the replicated pieces per writer, or
/// `None` when the leaves do not fit under it.
fn fill(
    manifest: &Manifest,
    cost: &CostModel,
    summary: &LoadSummary,
    writers: &[u32],
    order: &[u32],
    level: f64,
) -> Option<Vec<(u32, Vec<Piece>)>> {
    let leaves = manifest.leaves();
    let tolerance = level * 1e-12;
    let mut out: Vec<(u32, Vec<Piece>)> = writers.iter().map(|&r| (r, Vec::new())).collect();
    // Max-heap on remaining capacity; ties go to the earlier writer.
    let mut heap: BinaryHeap<(Key, std::cmp::Reverse<u32>)> = writers
        .iter()
        .enumerate()
        .map(|(slot, &r)| {
            let cap = level - cost.fixed_s - summary.owned_load[r as usize];
            (Key(cap), std::cmp::Reverse(slot as u32))
        })
        .collect();
    for &i in order {
        let leaf = &leaves[i as usize];
        let units = leaf.units();
        let row_units = leaf.row_units();
        let unit_bytes = leaf.unit_bytes();
        let row_bytes = row_units * unit_bytes;
        let min_rows = cost.min_piece_bytes.div_ceil(row_bytes.max(1)).max(1);
        let mut start = 0u64;
        loop {
            let (Key(cap), std::cmp::Reverse(slot)) = heap.pop()?;
            let rest_bytes = leaf.range_bytes(start, units);
            let whole_cost = cost.piece_cost(rest_bytes);
            if whole_cost <= cap + tolerance {
                out[slot as usize].1.push(Piece { leaf: i, start, stop: units });
                heap.push((Key(cap - whole_cost), std::cmp::Reverse(slot)));
                break;
            }
            if !leaf.is_tensor() || row_bytes == 0 {
                return None;
            }
            let rows_left = (units - start) / row_units;
            let room = ((cap - cost.piece_s) * cost.bandwidth).max(0.0);
            let mut rows = (room / row_bytes as f64).floor() as u64;
            rows = rows.min(rows_left);
            if rows_left - rows < min_rows {
                // Leave a remainder that is itself a worthwhile piece.
                rows = rows_left.saturating_sub(min_rows);
            }
            if rows < min_rows || rows == 0 {
                // The emptiest writer cannot take a worthwhile piece: no one can.
                return None;
            }
            let stop = start + rows * row_units;
            let piece_cost = cost.piece_cost(leaf.range_bytes(start, stop));
            out[slot as usize].1.push(Piece { leaf: i, start, stop });
            heap.push((Key(cap - piece_cost), std::cmp::Reverse(slot)));
            start = stop;
        }
    }
    Some(out)
}
