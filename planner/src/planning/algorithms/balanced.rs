//! The default algorithm: near-optimal, with as few splits as it can.
//!
//! **Which ranks write.** Candidate writer sets are tried in the order of
//! their lower bound, and the plan with the least modelled time
//! ([`crate::planning::plan::model_time`]) wins:
//!
//! - A candidate is `k` writers placed over `n` nodes: every owner, then the
//!   first `k - owners` other ranks in the spread order of the first `n`
//!   nodes (node 0 local 0, node 1 local 0, ..., node 0 local 1, ...).
//!   Where placement cannot change the modelled time (one rank per node, or
//!   no `node_bandwidth`) each `k` has one candidate; otherwise every `n`
//!   from the fewest nodes that hold `k` writers to `min(k, nodes)`.
//! - `k` runs over a fixed ladder, the same for every world size: every count
//!   up to 128, then steps of `2^(1/128)` (0.54%), plus the fewest feasible
//!   writers; at most the world size.
//! - Each candidate's bound is the bound of [`crate::planning::bound`] with its own
//!   writer count and the capacity of its nodes. Candidates are filled in
//!   increasing bound order until the next bound is no lower than the best
//!   time found, so the winner is the best candidate of the whole family (up
//!   to [`SEARCH_WORK`], which only pathological inputs reach). A
//!   candidate whose fill leaves one of its writers empty is not a plan with
//!   its writer count, so it is dropped (its bound would not cover it).
//!
//! Why: a candidate's plan, and its modelled time, depend only on its
//! writer set, never on the world size; and every candidate of a smaller
//! world (with the same ranks per node) is a candidate of a larger one. So
//! a larger world never gets a slower plan, when the search completes: the
//! modelled time is non-increasing in the world size
//! (`planner/tests/properties.rs`). The
//! earlier rule, `k` from the bound's minimum, let a larger world pick a
//! writer count whose fill was worse.
//!
//! **The fill of one candidate.**
//! 1. The level `M` that no rank's cost can stay under, for its `k` writers
//!    and their nodes' capacity.
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
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{Leaf, Manifest};
use crate::planning::bound::{writer_capacity, writer_range, Levels, LoadSummary};
use crate::planning::plan::{model_time, Piece};

/// Relative raises of the level tried after the absolute ones (one and two
/// piece overheads); beyond the last one the level doubles until everything
/// fits (it always does eventually: a large enough level takes every leaf
/// whole on one writer).
const LEVEL_STEPS: [f64; 15] = [
    1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
];

/// Every writer count up to this is a candidate; above it, the ladder steps
/// by `2^(1/LADDER_STEPS)`.
const LADDER_DENSE: u32 = 128;
const LADDER_STEPS: f64 = 128.0;

/// The search stops when its fills have read this many leaves, writer slots
/// and nodes (over all their attempts), the best plan so far winning: about
/// 0.5 s of work. Only inputs whose fills miss their bounds over many
/// candidates reach it (no per-file cost, so that every writer count has
/// the same bound, and leaves that the grain keeps from balancing).
const SEARCH_WORK: u64 = 50_000_000;

/// The candidate writer counts in `lo..=hi`: the ladder's, and `lo`. The
/// ladder does not depend on the world size.
pub(super) fn ladder(lo: u32, hi: u32) -> Vec<u32> {
    let mut out = Vec::new();
    if lo > hi {
        return out;
    }
    out.push(lo);
    for k in (lo + 1)..=hi.min(LADDER_DENSE) {
        out.push(k);
    }
    let mut i = 1u32;
    loop {
        let k = (f64::from(LADDER_DENSE) * (f64::from(i) / LADDER_STEPS).exp2()).floor();
        if k > f64::from(hi) {
            break;
        }
        let k = k as u32;
        if k > lo && out.last().is_some_and(|&last| k > last) {
            out.push(k);
        }
        i += 1;
    }
    out
}

/// The ranks and nodes that candidate writer sets are built from.
struct Slots<'a> {
    summary: &'a LoadSummary,
    topology: &'a Topology,
    cost: &'a CostModel,
    world_size: u32,
    nodes: u32,
    /// The owners, ascending.
    owners: Vec<u32>,
    /// Index `n`: owners on nodes `0..n`.
    owners_below: Vec<u32>,
    /// Whether the nodes the writers sit on can change the modelled time.
    placement_matters: bool,
}

impl<'a> Slots<'a> {
    fn new(
        summary: &'a LoadSummary,
        topology: &'a Topology,
        cost: &'a CostModel,
        world_size: u32,
    ) -> Slots<'a> {
        let nodes = summary.nodes;
        let owners: Vec<u32> = (0..world_size)
            .filter(|&r| summary.is_owner[r as usize])
            .collect();
        let mut owners_below = vec![0u32; nodes as usize + 1];
        for &o in &owners {
            owners_below[topology.node_of(o) as usize + 1] += 1;
        }
        for n in 1..owners_below.len() {
            owners_below[n] += owners_below[n - 1];
        }
        Slots {
            summary,
            topology,
            cost,
            world_size,
            nodes,
            owners,
            owners_below,
            placement_matters: cost.node_bandwidth.is_some() && topology.ranks_per_node > 1,
        }
    }

    /// The node counts of `k` writers' candidates, most first: `(most,
    /// fewest)`; `None` when `k` writers do not fit the world.
    fn node_range(&self, k: u32) -> Option<(u32, u32)> {
        let owners = self.owners.len() as u32;
        let others = k.checked_sub(owners)?;
        if others == 0 {
            // Only the owners write: no other nodes.
            return Some((0, 0));
        }
        if !self.placement_matters {
            // One candidate: placement changes nothing.
            return (others <= self.world_size - owners).then_some((self.nodes, self.nodes));
        }
        let rpn = self.topology.ranks_per_node;
        let free = |n: u32| n * rpn - self.owners_below[n as usize];
        if free(self.nodes) < others {
            return None;
        }
        // The fewest nodes whose non-owners number at least `others`.
        let (mut lo, mut hi) = (1u32, self.nodes);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if free(mid) >= others {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        // Beyond `k` nodes the first writers of the spread order are the same.
        Some((self.nodes.min(k).max(lo), lo))
    }

    /// The writers of candidate `(k, n)`: the owners, then the first
    /// `k - owners` non-owners in the spread order of nodes `0..n`.
    fn writers(&self, k: u32, n: u32) -> Vec<u32> {
        let mut writers = self.owners.clone();
        let rpn = self.topology.ranks_per_node;
        'fill: for local in 0..rpn {
            for node in 0..n {
                if writers.len() >= k as usize {
                    break 'fill;
                }
                let r = node * rpn + local;
                if r < self.world_size && !self.summary.is_owner[r as usize] {
                    writers.push(r);
                }
            }
        }
        writers
    }

    /// The most bytes per second `k` writers of candidate `(k, n)` can move:
    /// spread evenly over the nodes they may sit on (nodes `0..n` and the
    /// owners' nodes). Independent of the world size except through `n`
    /// (where placement matters; otherwise the world's node count changes
    /// nothing: with one rank per node `k` writers span `k` nodes in any
    /// world, and without a node bandwidth nodes do not count).
    fn capacity(&self, k: u32, n: u32) -> f64 {
        let span = if self.placement_matters || n == 0 {
            let beyond = self
                .owners
                .iter()
                .rev()
                .take_while(|&&o| self.topology.node_of(o) >= n);
            let mut nodes: Vec<u32> = beyond.map(|&o| self.topology.node_of(o)).collect();
            nodes.dedup();
            n + nodes.len() as u32
        } else {
            self.nodes
        };
        writer_capacity(self.cost, span, k)
    }
}

/// Where a fill puts its pieces. The search only counts them: pieces and
/// bytes per writer slot are all the model needs to time a candidate. The
/// winner's fill is then run again, with the same decisions, to record them.
trait Sink {
    fn with_slots(slots: usize) -> Self;
    fn push(&mut self, slot: usize, piece: Piece);
    fn is_empty(&self, slot: usize) -> bool;
}

/// Pieces per writer slot, counted.
struct Counts(Vec<u64>);

impl Sink for Counts {
    fn with_slots(slots: usize) -> Self {
        Counts(vec![0; slots])
    }
    fn push(&mut self, slot: usize, _piece: Piece) {
        self.0[slot] += 1;
    }
    fn is_empty(&self, slot: usize) -> bool {
        self.0[slot] == 0
    }
}

/// Pieces per writer slot, recorded.
struct Recorded(Vec<Vec<Piece>>);

impl Sink for Recorded {
    fn with_slots(slots: usize) -> Self {
        Recorded(vec![Vec::new(); slots])
    }
    fn push(&mut self, slot: usize, piece: Piece) {
        self.0[slot].push(piece);
    }
    fn is_empty(&self, slot: usize) -> bool {
        self.0[slot].is_empty()
    }
}

/// Per writer slot, its pieces (counted or recorded) and their bytes.
type Filled<S> = (S, Vec<u64>);

/// Which pass of a fill attempt placed everything (step 3 or step 4).
#[derive(Clone, Copy)]
enum Pass {
    Sequential,
    Spread,
}

/// How a candidate's fill succeeded: enough to run it again and record it.
#[derive(Clone, Copy)]
struct Outcome {
    level: f64,
    pass: Pass,
}

/// A candidate on the heap: its bound, then fewer writers first, then more nodes.
type Candidate = Reverse<(Key, u32, Reverse<u32>)>;

pub(super) fn plan(
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    ranks: &mut [Vec<Piece>],
) {
    let summary = LoadSummary::new(manifest, world_size, topology, cost);
    plan_with(&summary, manifest, world_size, topology, cost, ranks);
}

/// [`plan`] with the manifest's [`LoadSummary`] already made (the grouped
/// path makes it first to see whether any group has several ranks).
pub(super) fn plan_with(
    summary: &LoadSummary,
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    ranks: &mut [Vec<Piece>],
) {
    if summary.replicated_leaves == 0 {
        return;
    }
    let leaves = manifest.leaves();
    let order = replicated_by_size(manifest);
    // Whole-leaf costs in `order`: non-increasing, as the cost grows with the size.
    let costs: Vec<f64> = order.iter().map(|s| cost.piece_cost(s.nbytes)).collect();
    let levels = Levels::new(summary, cost);
    let slots = Slots::new(summary, topology, cost, world_size);
    let owned_pieces: Vec<u64> = ranks.iter().map(|l| l.len() as u64).collect();
    let owned_nodes = owned_node_bytes(summary, topology, world_size);
    let (lo, hi) = writer_range(summary, world_size);
    // A plan with exactly `k` writers gives each non-owner writer at least
    // one piece of a replicated leaf: `k` is at most the owners plus the
    // most pieces the replicated leaves can be cut into.
    let most_writers = (slots.owners.len() as u64).saturating_add(summary.replicated_max_pieces);
    let hi = hi.min(u32::try_from(most_writers).unwrap_or(u32::MAX));

    let bound_of = |k: u32, n: u32| {
        let level = levels.at_capacity(k, slots.capacity(k, n));
        (level, level + f64::from(k) * cost.writer_s)
    };
    // The fill of the replicated leaves on one writer set.
    let fill_on = |writers: &[u32]| Fill {
        leaves,
        cost,
        order: &order,
        costs: &costs,
        node_of: writers
            .iter()
            .map(|&r| topology.node_of(r) as usize)
            .collect(),
    };
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::new();
    for k in ladder(lo, hi) {
        if let Some((most, _)) = slots.node_range(k) {
            heap.push(Reverse((Key(bound_of(k, most).1), k, Reverse(most))));
        }
    }
    let mut work = 0u64;
    let mut best: Option<(f64, Vec<u32>, Outcome)> = None;
    while let Some(Reverse((Key(lb), k, Reverse(n)))) = heap.pop() {
        if best.as_ref().is_some_and(|(t, _, _)| lb >= *t) {
            break;
        }
        if work >= SEARCH_WORK {
            // Out of budget: the best so far wins. With none (every fill so
            // far left a writer empty), the most spread placement of each
            // writer count, fewest writers first, until one fills (the
            // fewest writers always do).
            if best.is_none() {
                heap.clear();
                for k in ladder(lo, hi) {
                    if let Some((most, _)) = slots.node_range(k) {
                        heap.push(Reverse((Key(0.0), k, Reverse(most))));
                    }
                }
                work = 0;
                continue;
            }
            break;
        }
        if slots.node_range(k).is_some_and(|(_, fewest)| n > fewest) {
            heap.push(Reverse((Key(bound_of(k, n - 1).1), k, Reverse(n - 1))));
        }
        let writers = slots.writers(k, n);
        let fill = fill_on(&writers);
        let (level, _) = bound_of(k, n);
        let (attempts, filled) =
            fill.at_best_level(summary, &owned_nodes, &writers, slots.owners.len(), level);
        // An attempt reads every leaf, writer slot and node once.
        work += attempts * (order.len() + writers.len() + summary.nodes as usize) as u64
            + u64::from(world_size);
        let Some((outcome, (counts, slot_bytes))) = filled else {
            continue;
        };
        let mut pieces = owned_pieces.clone();
        let mut bytes = summary.owned_bytes.clone();
        for ((&r, count), b) in writers.iter().zip(&counts.0).zip(slot_bytes) {
            pieces[r as usize] += count;
            bytes[r as usize] += b;
        }
        let t = model_time(cost, topology, &pieces, bytes).makespan_s;
        if best.as_ref().is_none_or(|(b, _, _)| t < *b) {
            best = Some((t, writers, outcome));
        }
    }
    if let Some((_, writers, outcome)) = best {
        let fill = fill_on(&writers);
        let (recorded, _) = fill
            .attempt::<Recorded>(summary, &owned_nodes, &writers, outcome.level, outcome.pass)
            .expect("a fill is deterministic: the winner's fill places everything again");
        for (&r, list) in writers.iter().zip(recorded.0) {
            ranks[r as usize].extend(list);
        }
    }
}

impl Fill<'_> {
    /// Places every replicated leaf on `writers` (the slots of this fill)
    /// at the lowest level it finds, starting from `base`, the bound's level
    /// for these writers: the bound, a piece overhead or two above it, small
    /// relative raises, then doublings, and a bisection between the last
    /// level that failed and the first that fits.
    ///
    /// `None` when the first level that fits leaves one of the writers from
    /// `owners` on empty: that is a plan with fewer writers, which this
    /// candidate's bound does not cover (and lower levels, which need more
    /// writers, are not worth the passes for it).
    fn at_best_level(
        &self,
        summary: &LoadSummary,
        owned_node_bytes: &[f64],
        writers: &[u32],
        owners: usize,
        base: f64,
    ) -> (u64, Option<(Outcome, Filled<Counts>)>) {
        let attempts = std::cell::Cell::new(0u64);
        let cost = self.cost;
        let mut levels = vec![base, base + cost.piece_s, base + 2.0 * cost.piece_s];
        levels.extend(LEVEL_STEPS.iter().map(|r| base * (1.0 + r)));
        levels.sort_by(f64::total_cmp);
        levels.dedup();
        // Sequential filling needs the fewest writers and copes best with
        // many cuts; spreading packs better when few leaves may be cut. The
        // first that fits wins. Spreading starts from the second level, at
        // most one piece overhead above the bound: at the bound itself
        // little fits once a leaf must be cut, and skipping it saves a pass.
        let attempt = |level: f64, spread: bool| -> Option<(Outcome, Filled<Counts>)> {
            attempts.set(attempts.get() + 1);
            let passes: &[Pass] = if spread {
                &[Pass::Sequential, Pass::Spread]
            } else {
                &[Pass::Sequential]
            };
            passes.iter().find_map(|&pass| {
                self.attempt::<Counts>(summary, owned_node_bytes, writers, level, pass)
                    .map(|filled| (Outcome { level, pass }, filled))
            })
        };
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
        let leaves_one_empty =
            |counts: &Counts| (owners..writers.len()).any(|j| counts.is_empty(j));
        let empty = |filled: &Option<(Outcome, Filled<Counts>)>| {
            filled
                .as_ref()
                .is_some_and(|(_, (counts, _))| leaves_one_empty(counts))
        };
        if empty(&placed) {
            return (attempts.get(), None);
        }
        // Bisection between the last level that failed and the first that
        // fits, when they are more than 0.1% apart, down to a relative 1e-6:
        // a coarse step would otherwise decide the plan's time (a level that
        // overshoots lets one writer take what two could share). Within 0.1%
        // (a large state, whose level fits a piece overhead or a small raise
        // above the bound) it is not worth the extra passes.
        if let Some(mut lo) = failed.filter(|&lo| level > lo * (1.0 + 1e-3)) {
            let mut hi = level;
            while hi - lo > hi * 1e-6 {
                let mid = lo + (hi - lo) / 2.0;
                if mid <= lo || mid >= hi {
                    break;
                }
                match attempt(mid, true).filter(|(_, (counts, _))| !leaves_one_empty(counts)) {
                    Some(better) => {
                        hi = mid;
                        placed = Some(better);
                    }
                    None => lo = mid,
                }
            }
        }
        (attempts.get(), placed)
    }
}

impl Fill<'_> {
    /// One fill of the replicated leaves on `writers` under `level`, by one
    /// pass; `None` when they do not all fit.
    fn attempt<S: Sink>(
        &self,
        summary: &LoadSummary,
        owned_node_bytes: &[f64],
        writers: &[u32],
        level: f64,
        pass: Pass,
    ) -> Option<Filled<S>> {
        let cost = self.cost;
        let caps: Vec<f64> = writers
            .iter()
            .map(|&r| level - cost.fixed_s - summary.owned_load[r as usize])
            .collect();
        let rooms = node_rooms(owned_node_bytes, cost, level);
        let tolerance = level * 1e-12;
        match pass {
            Pass::Sequential => self.sequential(&caps, &rooms, tolerance),
            Pass::Spread => self.spread(&caps, &rooms, tolerance),
        }
    }
}

/// Per node, the bytes its writers may still move under `level`: what its
/// link moves in the level less the fixed cost, less what its owners write.
/// Infinite without a `node_bandwidth`.
fn node_rooms(owned_node_bytes: &[f64], cost: &CostModel, level: f64) -> Vec<f64> {
    let Some(nu) = cost.node_bandwidth else {
        return vec![f64::INFINITY; owned_node_bytes.len()];
    };
    let room = ((level - cost.fixed_s) * nu).max(0.0);
    owned_node_bytes.iter().map(|&owned| room - owned).collect()
}

/// Per node, the bytes its owners write.
fn owned_node_bytes(summary: &LoadSummary, topology: &Topology, world_size: u32) -> Vec<f64> {
    let mut bytes = vec![0.0; summary.nodes as usize];
    for r in 0..world_size {
        bytes[topology.node_of(r) as usize] += summary.owned_bytes[r as usize] as f64;
    }
    bytes
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
    node_of: Vec<usize>,
}

/// The first index from `lo` on whose cost is at most `limit` (`costs`
/// is non-increasing), or `costs.len()`: `partition_point` on `costs[lo..]`,
/// but found by galloping from `lo`. A top-up's room only shrinks and its
/// next search starts past the leaf it just placed, so the answer is most
/// often `lo` itself, or close to it.
fn first_at_most(costs: &[f64], lo: usize, limit: f64) -> usize {
    let n = costs.len();
    if lo >= n || costs[lo] <= limit {
        return lo.min(n);
    }
    // costs[above] > limit throughout.
    let (mut above, mut step) = (lo, 1usize);
    loop {
        let probe = lo.saturating_add(step);
        if probe >= n || costs[probe] <= limit {
            let end = probe.min(n);
            return above + 1 + costs[above + 1..end].partition_point(|&c| c > limit);
        }
        above = probe;
        step = step.saturating_mul(2);
    }
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
        out: &mut impl Sink,
        bytes: &mut [u64],
        tolerance: f64,
    ) -> Result<(), Option<u64>> {
        let SizedLeaf {
            leaf: i,
            units,
            nbytes,
        } = self.order[pos];
        let node = self.node_of[j];
        // A whole leaf needs only its size: the leaf itself (a cache miss
        // with a million leaves) is read only to cut it.
        let (rest_bytes, rest) = if start == 0 {
            (nbytes, self.costs[pos])
        } else {
            let rest_bytes = self.leaves[i as usize].range_bytes(start, units);
            (rest_bytes, self.cost.piece_cost(rest_bytes))
        };
        if self.fits(rest, rest_bytes, caps[j], rooms[node], tolerance) {
            out.push(
                j,
                Piece {
                    leaf: i,
                    start,
                    stop: units,
                },
            );
            caps[j] -= rest;
            rooms[node] -= rest_bytes as f64;
            bytes[j] += rest_bytes;
            return Ok(());
        }
        let leaf = &self.leaves[i as usize];
        let most = ((caps[j] - self.cost.piece_s) * self.cost.bandwidth).min(rooms[node]);
        match cut(leaf, start, most, self.cost) {
            Some(stop) => {
                let piece_bytes = leaf.range_bytes(start, stop);
                out.push(
                    j,
                    Piece {
                        leaf: i,
                        start,
                        stop,
                    },
                );
                caps[j] -= self.cost.piece_cost(piece_bytes);
                rooms[node] -= piece_bytes as f64;
                bytes[j] += piece_bytes;
                Err(Some(stop))
            }
            None => Err(None),
        }
    }

    /// Step 3: fills the writers one after the other. `None` when the leaves
    /// do not all fit under the capacities.
    fn sequential<S: Sink>(
        &self,
        caps: &[f64],
        rooms: &[f64],
        tolerance: f64,
    ) -> Option<Filled<S>> {
        let n = self.order.len();
        let mut caps = caps.to_vec();
        let mut rooms = rooms.to_vec();
        let mut out = S::with_slots(caps.len());
        let mut bytes = vec![0u64; caps.len()];
        let mut next: Vec<u32> = (0..=n as u32).collect();
        let mut j = 0usize;
        let mut pos = 0usize;
        loop {
            pos = find(&mut next, pos);
            if pos >= n {
                return Some((out, bytes));
            }
            next[pos] = pos as u32 + 1;
            let mut start = 0u64;
            loop {
                if j >= caps.len() {
                    return None;
                }
                match self.place(
                    pos, start, j, &mut caps, &mut rooms, &mut out, &mut bytes, tolerance,
                ) {
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
                    &mut out,
                    j,
                    &mut bytes[j],
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
    #[allow(clippy::too_many_arguments)]
    fn top_up(
        &self,
        cap: &mut f64,
        node_room: &mut f64,
        out: &mut impl Sink,
        slot: usize,
        bytes: &mut u64,
        next: &mut [u32],
        from: usize,
        tolerance: f64,
    ) {
        let n = self.order.len();
        let mut lo = from.min(n);
        loop {
            // `costs` is non-increasing: the leaves that fit are a suffix.
            let room = self.room(*cap, *node_room);
            let first_fit = first_at_most(self.costs, lo, room + tolerance);
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
            out.push(
                slot,
                Piece {
                    leaf,
                    start: 0,
                    stop: units,
                },
            );
            *cap -= self.costs[p];
            *node_room -= nbytes as f64;
            *bytes += nbytes;
            lo = p + 1;
        }
    }

    /// Step 4: each leaf, largest first, to the writer with the most room
    /// left, cut where it does not fit. `None` when the leaves do not fit.
    fn spread<S: Sink>(&self, caps: &[f64], rooms: &[f64], tolerance: f64) -> Option<Filled<S>> {
        let mut caps = caps.to_vec();
        let mut rooms = rooms.to_vec();
        let mut out = S::with_slots(caps.len());
        let mut bytes = vec![0u64; caps.len()];
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
                let placed = self.place(
                    pos, start, j, &mut caps, &mut rooms, &mut out, &mut bytes, tolerance,
                );
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
        Some((out, bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::first_at_most;

    #[test]
    fn galloping_search_is_partition_point() {
        // Non-increasing costs with runs of equal values, every start and
        // limit around each value.
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for len in 0..40usize {
            let mut costs: Vec<f64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 8) as f64
                })
                .collect();
            costs.sort_by(|a, b| b.total_cmp(a));
            for lo in 0..=len + 1 {
                for limit in [-1.0, 0.0, 0.5, 1.0, 2.5, 3.0, 6.0, 7.0, 9.0] {
                    let start = lo.min(len);
                    let want = start + costs[start..].partition_point(|&c| c > limit);
                    assert_eq!(
                        first_at_most(&costs, lo, limit),
                        want,
                        "{costs:?} {lo} {limit}"
                    );
                }
            }
        }
    }
}
