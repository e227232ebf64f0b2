//! `balanced` for manifests whose leaves are held by groups of ranks
//! (HSDP, TP × DP, EP × DP, PP × DP): every piece goes to a holder of its
//! leaf, the load is spread as evenly as the holder sets allow, and the
//! writers are chosen by the modelled time.
//!
//! 1. **The network** ([`crate::planning::holders`]): leaves aggregated by holder set
//!    into flow groups, ranks with the same memberships into classes.
//! 2. **Candidate writer sets.** The fractional optimum over the whole
//!    world says how much each class carries. A candidate with `k` writers
//!    gives the classes their writers one at a time, each to the class whose
//!    load per writer is highest (Jefferson's apportionment: it minimises
//!    the largest load per writer); ranks that own leaves always write.
//!    Within a class, writers are taken in the spread order of the nodes
//!    (local rank 0 of every node first), each class starting at another
//!    node. `k` runs over the ladder of [`super::balanced`].
//! 3. **The search.** Candidates are taken in the order of their lower
//!    bound ([`crate::planning::bound`], bound 6 included); each gets its fractional
//!    level over its own writers (a bisection on the max-flow), hence an
//!    estimate of its modelled time; the search stops when no remaining
//!    bound is below the best estimate. The best few estimates are filled
//!    and timed with [`crate::planning::plan::model_time`]; the fastest wins.
//! 4. **The fill of a candidate** at its level `t`: the max-flow's routing
//!    says how much of each flow group each class takes; a class shares it
//!    among its writers in turn, up to `t - o_r` each, so each writer gets a
//!    quota of a few groups. Each flow group's leaves, largest first, form
//!    a stream laid over its writers' quotas, end to end: a leaf that
//!    crosses a quota's end is cut at the legal cut (on its grain, pieces of
//!    at least `min_piece_bytes`) nearest to it, and a leaf that cannot be
//!    cut goes to the side its middle falls on; when that is the next
//!    writer, the room left is topped up with the smallest leaves that fit
//!    whole. Cuts are placed against the absolute ends, so errors do not
//!    accumulate: each writer is within about one grain (or half an
//!    uncuttable leaf) of its quota, plus one piece overhead per cut.
//! 5. **Small states** (up to [`REFINE_MOST_LEAVES`] leaves): each filled
//!    candidate is improved by the local search of [`super::refine`]. When
//!    the winner is still more than [`WIDEN_ABOVE`] above the bound, the
//!    best few candidates are also filled *packed* (a group's uncuttable
//!    leaves first, whole, largest first, each to the quota with the most
//!    room; the cuttable ones streamed over what room is left), and the
//!    winner is searched again with wider trades. When it is still above,
//!    they are also filled *fitted* ([`fit_then_stream`]: the leaves of at
//!    most two pieces whole, each writer's share of them chosen so that its
//!    quota ends where the stream of the other leaves can be cut), and that
//!    fill's winner is searched wider too.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::balanced::ladder;
use super::Key;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{Holders, Leaf, Manifest};
use crate::planning::bound::{Levels, LoadSummary};
use crate::planning::holders::HolderFlow;
use crate::planning::plan::{model_time, Piece};

/// Relative precision of a candidate's fractional level.
const LEVEL_PRECISION: f64 = 1e-7;
/// How many of the best-estimated candidates are filled and timed: at
/// least `FILLED`, more while their fills read at most `FILL_WORK` leaves.
const FILLED: usize = 4;
const FILL_WORK: usize = 4_000_000;
/// Most candidates whose level is computed (each a bisection of max-flows).
const MOST_EVALUATED: usize = 256;
/// The local search's budget per filled candidate ([`super::refine`]), and
/// the most leaves it runs for: it helps where a writer's share of a group
/// is a few leaves or minimum pieces (states of up to some 10^4 leaves);
/// with hundreds of thousands of leaves each writer gets hundreds of them,
/// the stream's overshoot is a negligible part of its cost, and building
/// the search's index of every piece would cost more than it gains.
const REFINE_WORK: usize = 2_000_000;
const REFINE_MOST_LEAVES: usize = 200_000;
/// The winner's gap over the bound above which it gets a wider search.
const WIDEN_ABOVE: f64 = 1.002;

pub(super) fn plan(
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    ranks: &mut [Vec<Piece>],
) {
    let summary = LoadSummary::new(manifest, world_size, topology, cost);
    let Some(flow) = summary.holders.as_ref() else {
        // Every group has one rank: owned leaves, and maybe replicated ones.
        super::balanced::plan_with(&summary, manifest, world_size, topology, cost, ranks);
        return;
    };
    let owned = &summary.owned_load;
    let classes = flow.classes();
    // How much each class carries at the whole world's fractional optimum.
    let everyone: Vec<u32> = (0..world_size).collect();
    let (_, full) = flow.level(&everyone, owned, LEVEL_PRECISION);
    let mut class_load = vec![0.0f64; classes];
    for (g, sent) in flow.routing(&everyone, owned, full).iter().enumerate() {
        for (i, &x) in sent.iter().enumerate() {
            class_load[flow.reach[g][i] as usize] += x;
        }
    }
    let members = class_members(flow, &summary, topology);
    let forced: Vec<u32> = (0..classes)
        .map(|c| {
            flow.class_ranks[c]
                .iter()
                .filter(|&&r| summary.is_owner[r as usize])
                .count() as u32
        })
        .collect();
    // Jefferson's apportionment, one writer at a time, recorded at each
    // writer count of the ladder.
    let mut seats = forced.clone();
    let lo = seats.iter().sum::<u32>().max(1);
    let hi: u32 = (0..classes)
        .map(|c| {
            if class_load[c] > 0.0 {
                flow.class_ranks[c].len() as u32
            } else {
                forced[c]
            }
        })
        .sum();
    let priority = |c: usize, n: u32| {
        if n == 0 {
            f64::INFINITY
        } else {
            class_load[c] / f64::from(n)
        }
    };
    let mut heap: BinaryHeap<(Key, Reverse<u32>)> = (0..classes)
        .filter(|&c| class_load[c] > 0.0 && (seats[c] as usize) < flow.class_ranks[c].len())
        .map(|c| (Key(priority(c, seats[c])), Reverse(c as u32)))
        .collect();
    let mut total: u32 = seats.iter().sum();
    let levels = Levels::new(&summary, cost);
    let mut candidates: Vec<(Key, u32, Vec<u32>)> = Vec::new();
    for k in ladder(lo, hi.max(lo)) {
        while total < k {
            let Some((_, Reverse(c))) = heap.pop() else {
                break;
            };
            let c = c as usize;
            seats[c] += 1;
            total += 1;
            if (seats[c] as usize) < flow.class_ranks[c].len() {
                heap.push((Key(priority(c, seats[c])), Reverse(c as u32)));
            }
        }
        if total < k {
            break;
        }
        let bound = levels.at(k) + f64::from(k) * cost.writer_s;
        candidates.push((Key(bound), k, seats.clone()));
    }
    candidates.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let lower = candidates.first().map_or(0.0, |c| c.0 .0);

    let aggregate = cost
        .aggregate_bandwidth
        .map_or(0.0, |a| cost.fixed_s + summary.total_bytes as f64 / a);
    // (estimate, level, writers), best first.
    let mut evaluated: Vec<(f64, f64, Vec<u32>)> = Vec::new();
    let mut best = f64::INFINITY;
    for (Key(bound), k, seats) in candidates.into_iter().take(MOST_EVALUATED) {
        if bound >= best {
            break;
        }
        let writers: Vec<u32> = (0..classes)
            .flat_map(|c| members[c][..seats[c] as usize].iter().copied())
            .collect();
        let (_, level) = flow.level(&writers, owned, LEVEL_PRECISION);
        if !level.is_finite() {
            continue;
        }
        let top_owned = writers
            .iter()
            .map(|&r| owned[r as usize])
            .fold(0.0, f64::max);
        let estimate =
            (cost.fixed_s + level.max(top_owned)).max(aggregate) + f64::from(k) * cost.writer_s;
        best = best.min(estimate);
        evaluated.push((estimate, level.max(top_owned), writers));
    }
    evaluated.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut chosen: Option<(f64, Vec<Vec<Piece>>)> = None;
    let fills = FILLED.max(FILL_WORK / manifest.len().max(1));
    let sorted = group_members(manifest, flow);
    let writes: Vec<bool> = ranks.iter().map(|l| !l.is_empty()).collect();
    let small = manifest.len() <= REFINE_MOST_LEAVES;
    let filled: Vec<(f64, Vec<u32>)> = evaluated
        .into_iter()
        .take(fills)
        .map(|(_, level, writers)| (level, writers))
        .collect();
    let search = |placed: &mut [Vec<Piece>], widen: bool| {
        super::refine::refine(
            manifest,
            flow,
            cost,
            owned,
            &writes,
            placed,
            REFINE_WORK,
            widen,
        );
    };
    let try_fill = |level: f64, writers: &[u32], how: Fill, chosen: &mut Option<_>| {
        let mut placed = fill(
            manifest, &sorted, flow, cost, owned, writers, level, world_size, how,
        );
        let unrefined = cost.node_bandwidth.is_some().then(|| placed.clone());
        if small {
            search(&mut placed, false);
        }
        keep(manifest, cost, topology, ranks, placed, chosen);
        // A node bandwidth is not in the local search's costs: the fill as
        // it was competes too.
        if let Some(placed) = unrefined {
            keep(manifest, cost, topology, ranks, placed, chosen);
        }
    };
    for (level, writers) in &filled {
        try_fill(*level, writers, Fill::Stream, &mut chosen);
    }
    let above = |chosen: &Option<(f64, Vec<Vec<Piece>>)>| {
        small
            && chosen
                .as_ref()
                .is_some_and(|(t, _)| *t > lower * WIDEN_ABOVE)
    };
    // A winner more than `WIDEN_ABOVE` above the bound gets a wider search
    // (more writers to trade with); the fill's winner competes as it was.
    let widen = |variant: Option<(f64, Vec<Vec<Piece>>)>, chosen: &mut Option<_>| {
        let Some((_, placed)) = variant else {
            return;
        };
        let mut wider = placed.clone();
        keep(manifest, cost, topology, ranks, placed, chosen);
        search(&mut wider, true);
        keep(manifest, cost, topology, ranks, wider, chosen);
    };
    let has = |most: u64| {
        sorted
            .iter()
            .flatten()
            .any(|&i| cost.max_pieces(&manifest.leaves()[i as usize]) <= most)
    };
    // A small state whose winner is more than `WIDEN_ABOVE` above the
    // bound: with uncuttable shared leaves, the packed fill (those first) on
    // the best few candidates competes; the winner, still above, is
    // searched wider.
    if above(&chosen) {
        if has(1) {
            for (level, writers) in filled.iter().take(FILLED) {
                try_fill(*level, writers, Fill::Packed, &mut chosen);
            }
        }
        if above(&chosen) {
            let winner = chosen.take();
            widen(winner, &mut chosen);
        }
    }
    // Still above, with leaves of at most two pieces: the fitted fill on
    // the best few candidates, its winner searched wider (the search's end
    // depends on where it starts: the fitted fill's winner is searched even
    // when it loses to the winner so far).
    if above(&chosen) && has(2) {
        let mut fitted = None;
        for (level, writers) in filled.iter().take(FILLED) {
            try_fill(*level, writers, Fill::Fitted, &mut fitted);
        }
        widen(fitted, &mut chosen);
    }
    let placed = chosen.map(|(_, p)| p).unwrap_or_else(|| {
        // No candidate had a feasible level: cannot happen (every group's
        // ranks are in the world, and the largest candidate holds them all).
        fill(
            manifest,
            &sorted,
            flow,
            cost,
            owned,
            &everyone,
            full,
            world_size,
            Fill::Stream,
        )
    });
    for (list, more) in ranks.iter_mut().zip(placed) {
        list.extend(more);
    }
}

/// Makes `placed` the `chosen` plan if it is faster.
fn keep(
    manifest: &Manifest,
    cost: &CostModel,
    topology: &Topology,
    ranks: &[Vec<Piece>],
    placed: Vec<Vec<Piece>>,
    chosen: &mut Option<(f64, Vec<Vec<Piece>>)>,
) {
    let t = time_of(manifest, cost, topology, ranks, &placed);
    if chosen.as_ref().is_none_or(|(b, _)| t < *b) {
        *chosen = Some((t, placed));
    }
}

/// The modelled makespan of the owned pieces `ranks` with `placed` added.
fn time_of(
    manifest: &Manifest,
    cost: &CostModel,
    topology: &Topology,
    ranks: &[Vec<Piece>],
    placed: &[Vec<Piece>],
) -> f64 {
    let leaves = manifest.leaves();
    let pieces: Vec<u64> = ranks
        .iter()
        .zip(placed)
        .map(|(a, b)| (a.len() + b.len()) as u64)
        .collect();
    let bytes: Vec<u64> = ranks
        .iter()
        .zip(placed)
        .map(|(a, b)| {
            a.iter()
                .chain(b)
                .map(|p| leaves[p.leaf as usize].range_bytes(p.start, p.stop))
                .sum()
        })
        .collect();
    model_time(cost, topology, &pieces, bytes).makespan_s
}

/// Per class, its ranks in the order writers are taken: owners first, then
/// the others by local rank on the node, then by node, each class starting
/// at another node so that the classes' first writers spread over the nodes.
fn class_members(flow: &HolderFlow, summary: &LoadSummary, topology: &Topology) -> Vec<Vec<u32>> {
    let classes = flow.classes() as u64;
    let nodes = u64::from(summary.nodes.max(1));
    let rpn = u64::from(topology.ranks_per_node.max(1));
    flow.class_ranks
        .iter()
        .enumerate()
        .map(|(c, ranks)| {
            let offset = (c as u64 * nodes / classes.max(1)) % nodes;
            let mut order = ranks.clone();
            order.sort_by_key(|&r| {
                let (node, local) = (u64::from(r) / rpn, u64::from(r) % rpn);
                (
                    !summary.is_owner[r as usize],
                    local,
                    (node + nodes - offset) % nodes,
                )
            });
            order
        })
        .collect()
}

/// Per flow group, its leaves, largest first (ties by manifest order).
fn group_members(manifest: &Manifest, flow: &HolderFlow) -> Vec<Vec<u32>> {
    let leaves = manifest.leaves();
    // Sorted as (size, index) pairs: no leaf is read while sorting.
    let mut members: Vec<Vec<(Reverse<u64>, u32)>> = vec![Vec::new(); flow.demand.len()];
    for (i, leaf) in leaves.iter().enumerate() {
        let g = match manifest.holders(leaf) {
            Holders::All => flow.all,
            Holders::Ranks(rs) if rs.len() > 1 => {
                flow.flow_of_group[leaf.holders.expect("a group") as usize]
            }
            Holders::Ranks(_) => None,
        };
        if let Some(g) = g {
            members[g as usize].push((Reverse(leaf.nbytes), i as u32));
        }
    }
    members
        .into_iter()
        .map(|mut order| {
            order.sort_unstable();
            order.into_iter().map(|(_, i)| i).collect()
        })
        .collect()
}

/// The pieces of the shared leaves for `writers` at the feasible level
/// `level`, per rank.
#[allow(clippy::too_many_arguments)]
fn fill(
    manifest: &Manifest,
    members: &[Vec<u32>],
    flow: &HolderFlow,
    cost: &CostModel,
    owned: &[f64],
    writers: &[u32],
    level: f64,
    world_size: u32,
    how: Fill,
) -> Vec<Vec<Piece>> {
    let routing = flow.routing(writers, owned, level);
    let classes = flow.classes();
    // Per class, its writers in the order given, and what it receives.
    let mut class_writers: Vec<Vec<u32>> = vec![Vec::new(); classes];
    for &r in writers {
        class_writers[flow.class_of[r as usize] as usize].push(r);
    }
    let mut incoming: Vec<Vec<(usize, f64)>> = vec![Vec::new(); classes];
    for (g, sent) in routing.iter().enumerate() {
        for (i, &x) in sent.iter().enumerate() {
            if x > 0.0 {
                incoming[flow.reach[g][i] as usize].push((g, x));
            }
        }
    }
    let tiny = level * 1e-12;
    let mut quotas: Vec<Vec<(u32, f64)>> = vec![Vec::new(); flow.demand.len()];
    for c in 0..classes {
        let ws = &class_writers[c];
        let mut w = 0usize;
        let mut room = ws
            .first()
            .map_or(0.0, |&r| (level - owned[r as usize]).max(0.0));
        for &(g, mut x) in &incoming[c] {
            while x > tiny && !ws.is_empty() {
                let last = w + 1 == ws.len();
                let take = if last { x } else { x.min(room) };
                if take > tiny {
                    quotas[g].push((ws[w], take));
                }
                x -= take;
                room -= take;
                if room <= tiny && !last {
                    w += 1;
                    room = (level - owned[ws[w] as usize]).max(0.0);
                }
            }
        }
    }
    let leaves = manifest.leaves();
    let mut out = vec![Vec::new(); world_size as usize];
    for (g, order) in members.iter().enumerate() {
        if quotas[g].is_empty() {
            // Nothing to balance (leaves of no cost at all): one holder
            // writes them, a writer if one holds them.
            let reached = |&r: &u32| flow.reach[g].contains(&flow.class_of[r as usize]);
            let r = writers
                .iter()
                .copied()
                .find(reached)
                .unwrap_or_else(|| flow.class_ranks[flow.reach[g][0] as usize][0]);
            quotas[g].push((r, 0.0));
        }
        match how {
            Fill::Stream => stream(leaves, order, &quotas[g], cost, &mut out),
            Fill::Packed => pack_then_stream(leaves, order, &quotas[g], cost, &mut out),
            Fill::Fitted => fit_then_stream(leaves, order, &quotas[g], cost, &mut out),
        }
    }
    out
}

/// How a candidate's quotas are filled with a flow group's leaves.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fill {
    /// [`stream`]: every leaf, largest first, end to end.
    Stream,
    /// [`pack_then_stream`]: the uncuttable leaves first, whole.
    Packed,
    /// [`fit_then_stream`]: the leaves of at most two pieces whole, so many
    /// to each writer that its quota ends where the stream can be cut.
    Fitted,
}

/// The leaves `order` of at most `most` pieces, and the others, each in
/// the order given.
fn split_by_pieces(
    leaves: &[Leaf],
    order: &[u32],
    cost: &CostModel,
    most: u64,
) -> (Vec<u32>, Vec<u32>) {
    order
        .iter()
        .partition(|&&i| cost.max_pieces(&leaves[i as usize]) <= most)
}

/// The packed variant of [`stream`]: the leaves that cannot be cut go
/// first, whole, largest first, each to the quota with the most room left
/// (LPT); the cuttable leaves are then streamed over what room is left, so
/// that quotas end on cuts at the grain instead of on a whole leaf.
fn pack_then_stream(
    leaves: &[Leaf],
    order: &[u32],
    quotas: &[(u32, f64)],
    cost: &CostModel,
    out: &mut [Vec<Piece>],
) {
    let (whole, cuttable) = split_by_pieces(leaves, order, cost, 1);
    let mut room: Vec<f64> = quotas.iter().map(|&(_, q)| q).collect();
    let mut heap: BinaryHeap<(Key, Reverse<usize>)> = room
        .iter()
        .enumerate()
        .map(|(j, &q)| (Key(q), Reverse(j)))
        .collect();
    for i in whole {
        let Some((_, Reverse(j))) = heap.pop() else {
            break;
        };
        let leaf = &leaves[i as usize];
        out[quotas[j].0 as usize].push(Piece {
            leaf: i,
            start: 0,
            stop: leaf.units(),
        });
        room[j] -= cost.piece_cost(leaf.nbytes);
        heap.push((Key(room[j]), Reverse(j)));
    }
    let rest: Vec<(u32, f64)> = quotas
        .iter()
        .zip(&room)
        .map(|(&(r, _), &left)| (r, left.max(0.0)))
        .collect();
    stream(leaves, &cuttable, &rest, cost, out);
}

/// The fitted variant of [`stream`]. The leaves of at most two pieces
/// (uncuttable, or cuttable only within a window narrower than a minimum
/// piece) are placed whole, the rest (*wide* leaves) streamed. Writers are
/// taken in order; each gets about its share of the whole leaves (their
/// cost in proportion to its quota, largest first), adjusted by up to two
/// leaves so that its quota's end in the stream of wide leaves falls where
/// a wide leaf can be cut (both sides at least `min_piece_bytes`) or on a
/// leaf's edge. Where [`stream`] lays the narrow leaves last and the quotas
/// that end among them are off by up to a minimum piece, which the local
/// search cannot trade away (a slowest writer of whole leaves and pieces at
/// the minimum: BERT-base under PP = 4 x DP, issue 46), here every quota
/// ends on a cut at the grain.
fn fit_then_stream(
    leaves: &[Leaf],
    order: &[u32],
    quotas: &[(u32, f64)],
    cost: &CostModel,
    out: &mut [Vec<Piece>],
) {
    let (whole, wide) = split_by_pieces(leaves, order, cost, 2);
    if whole.is_empty() || wide.is_empty() || quotas.len() < 2 {
        return stream(leaves, order, quotas, cost, out);
    }
    // The wide leaves' ends along the stream (seconds).
    let mut edges = Vec::with_capacity(wide.len());
    let mut length = 0.0;
    for &i in &wide {
        length += cost.piece_cost(leaves[i as usize].nbytes);
        edges.push(length);
    }
    let total: f64 = quotas.iter().map(|&(_, q)| q).sum();
    let tolerance = total * 1e-12;
    let least = cost.min_piece_bytes as f64 / cost.bandwidth;
    // Whether the stream can end a writer's part at `e`.
    let cuttable = |e: f64| {
        if e <= tolerance || e >= length - tolerance {
            return true;
        }
        let k = edges.partition_point(|&x| x <= e);
        let from = if k == 0 { 0.0 } else { edges[k - 1] };
        let (into, left) = (e - from - cost.piece_s, edges[k] - e);
        e - from <= tolerance || left <= tolerance || (into >= least && left >= least)
    };
    let costs: Vec<f64> = whole
        .iter()
        .map(|&i| cost.piece_cost(leaves[i as usize].nbytes))
        .collect();
    let mut taken = vec![false; whole.len()];
    let mut whole_left: f64 = costs.iter().sum();
    let mut quota_left = total;
    let mut pos = 0.0;
    let mut rest = Vec::with_capacity(quotas.len());
    for (j, &(r, q)) in quotas.iter().enumerate() {
        let mut pick: Vec<usize> = Vec::new();
        if j + 1 == quotas.len() {
            pick.extend((0..whole.len()).filter(|&k| !taken[k]));
        } else {
            let target = if quota_left > 0.0 {
                whole_left * q / quota_left
            } else {
                0.0
            };
            let mut sum = 0.0;
            for k in (0..whole.len()).filter(|&k| !taken[k]) {
                if sum + costs[k] <= target + tolerance {
                    sum += costs[k];
                    pick.push(k);
                }
            }
            // Adjust by up to two leaves: the smallest unpicked added, or
            // the smallest picked removed, nearest to the target first.
            let spare: Vec<usize> = (0..whole.len())
                .rev()
                .filter(|&k| !taken[k] && !pick.contains(&k))
                .take(2)
                .collect();
            let mut options: Vec<(f64, Vec<usize>)> = vec![(sum, pick.clone())];
            let mut more = pick.clone();
            let mut more_sum = sum;
            for &k in &spare {
                more.push(k);
                more_sum += costs[k];
                options.push((more_sum, more.clone()));
            }
            let mut less = pick.clone();
            let mut less_sum = sum;
            for _ in 0..2 {
                let Some(k) = less.pop() else {
                    break;
                };
                less_sum -= costs[k];
                options.push((less_sum, less.clone()));
            }
            options.sort_by(|a, b| (a.0 - target).abs().total_cmp(&(b.0 - target).abs()));
            if let Some((_, best)) = options
                .iter()
                .find(|(s, _)| *s <= q + tolerance && cuttable(pos + q - s))
            {
                pick.clone_from(best);
            }
        }
        let sum: f64 = pick.iter().map(|&k| costs[k]).sum();
        for &k in &pick {
            taken[k] = true;
            let i = whole[k];
            out[r as usize].push(Piece {
                leaf: i,
                start: 0,
                stop: leaves[i as usize].units(),
            });
        }
        whole_left -= sum;
        quota_left -= q;
        let room = (q - sum).max(0.0);
        pos += room;
        rest.push((r, room));
    }
    stream(leaves, &wide, &rest, cost, out);
}

/// What to do with the rest of a leaf that crosses a quota's end.
enum Snap {
    /// Cut it at this unit: the piece before goes to the current writer.
    Cut(u64),
    /// All of the rest to the current writer.
    Whole,
    /// None of it to the current writer.
    Next,
}

/// The legal cut of `leaf` from `start` nearest to `want` bytes (a real
/// number, possibly negative): on the leaf's grain, both sides at least
/// `min_piece_bytes`; or the whole rest, or none of it, whichever is nearer.
fn snap(leaf: &Leaf, start: u64, want: f64, cost: &CostModel) -> Snap {
    let units = leaf.units();
    let rest = leaf.range_bytes(start, units);
    let half = |w: f64| {
        if w * 2.0 >= rest as f64 {
            Snap::Whole
        } else {
            Snap::Next
        }
    };
    if !leaf.is_tensor() {
        return half(want);
    }
    let grain = cost.grain_units(leaf);
    let grain_bytes = grain.saturating_mul(leaf.unit_bytes());
    if grain_bytes == 0 || rest < cost.min_piece_bytes.saturating_mul(2) {
        return half(want);
    }
    let min_grains = cost.min_piece_bytes.div_ceil(grain_bytes).max(1);
    let most = (rest - cost.min_piece_bytes) / grain_bytes;
    if most < min_grains {
        return half(want);
    }
    let ideal = want / grain_bytes as f64;
    if ideal < min_grains as f64 {
        return if ideal * 2.0 < min_grains as f64 {
            Snap::Next
        } else {
            Snap::Cut(start + min_grains * grain)
        };
    }
    if ideal > most as f64 {
        let cut_bytes = (most * grain_bytes) as f64;
        return if want - cut_bytes > rest as f64 - want {
            Snap::Whole
        } else {
            Snap::Cut(start + most * grain)
        };
    }
    Snap::Cut(start + (ideal.round() as u64).clamp(min_grains, most) * grain)
}

/// Lays the leaves `order` (indices, largest first) end to end over the
/// writers' `quotas` (seconds each, in order): see step 4 of the module doc.
fn stream(
    leaves: &[Leaf],
    order: &[u32],
    quotas: &[(u32, f64)],
    cost: &CostModel,
    out: &mut [Vec<Piece>],
) {
    if order.is_empty() {
        return;
    }
    let mut ends = Vec::with_capacity(quotas.len());
    let mut acc = 0.0;
    for &(_, q) in quotas {
        acc += q;
        ends.push(acc);
    }
    let tolerance = acc * 1e-12;
    let beta = cost.bandwidth;
    let mut j = 0usize;
    let mut pos = 0.0f64;
    // Leaves are taken from the front (largest first); top-ups take whole
    // leaves from the back (smallest first): `order[h..t]` are unplaced.
    let (mut h, mut t) = (0usize, order.len());
    while h < t {
        let i = order[h];
        h += 1;
        let leaf = &leaves[i as usize];
        let units = leaf.units();
        let mut start = 0u64;
        loop {
            while j + 1 < quotas.len() && ends[j] <= pos + tolerance {
                j += 1;
            }
            let r = quotas[j].0 as usize;
            let head = if start == 0 { cost.piece_s } else { 0.0 };
            let len = head + leaf.range_bytes(start, units) as f64 / beta;
            let stop = if j + 1 == quotas.len() || pos + len <= ends[j] + tolerance {
                units
            } else {
                match snap(leaf, start, (ends[j] - pos - head) * beta, cost) {
                    Snap::Cut(stop) => stop,
                    Snap::Whole => units,
                    Snap::Next => {
                        // Fill the rest of writer `j` with the smallest
                        // leaves that fit whole, then go on to the next.
                        while t > h {
                            let small = &leaves[order[t - 1] as usize];
                            let small_len = cost.piece_cost(small.nbytes);
                            if pos + small_len > ends[j] + tolerance {
                                break;
                            }
                            t -= 1;
                            out[r].push(Piece {
                                leaf: order[t],
                                start: 0,
                                stop: small.units(),
                            });
                            pos += small_len;
                        }
                        j += 1;
                        continue;
                    }
                }
            };
            out[r].push(Piece {
                leaf: i,
                start,
                stop,
            });
            pos += head + leaf.range_bytes(start, stop) as f64 / beta;
            if stop == units {
                break;
            }
            start = stop;
            j += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::manifest::PathKey;

    /// A flow group like a pipeline stage of BERT-base + AdamW: wide
    /// leaves (9 MiB, cuttable anywhere but their first and last MiB) and
    /// narrow ones (2.25 MiB: legal cuts only between 1 and 1.25 MiB), over
    /// writers whose quotas end among the narrow leaves.
    fn stage() -> (Vec<Leaf>, Vec<u32>) {
        let tensor = |i: usize, elements: u64| {
            Leaf::tensor(
                vec![PathKey::Int(i as i64)],
                DType::Float32,
                vec![elements],
                None,
            )
            .unwrap()
        };
        let mut leaves: Vec<Leaf> = (0..6).map(|i| tensor(i, 9 << 18)).collect();
        leaves.extend((6..42).map(|i| tensor(i, 9 << 16)));
        // Largest first, as `group_members` orders a group.
        let order = (0..leaves.len() as u32).collect();
        (leaves, order)
    }

    /// The largest distance of a writer's cost from its quota.
    fn worst_miss(
        leaves: &[Leaf],
        cost: &CostModel,
        quotas: &[(u32, f64)],
        out: &[Vec<Piece>],
    ) -> f64 {
        quotas
            .iter()
            .map(|&(r, q)| {
                let load: f64 = out[r as usize]
                    .iter()
                    .map(|p| cost.piece_cost(leaves[p.leaf as usize].range_bytes(p.start, p.stop)))
                    .sum();
                (load - q).abs()
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn fitted_fill_ends_every_quota_on_a_cut() {
        let cost = CostModel::default();
        let (leaves, order) = stage();
        let total: f64 = leaves.iter().map(|l| cost.piece_cost(l.nbytes)).sum();
        for writers in [7u32, 9, 11, 13] {
            let quotas: Vec<(u32, f64)> = (0..writers)
                .map(|r| (r, total / f64::from(writers)))
                .collect();
            let mut streamed = vec![Vec::new(); writers as usize];
            stream(&leaves, &order, &quotas, &cost, &mut streamed);
            let mut fitted = vec![Vec::new(); writers as usize];
            fit_then_stream(&leaves, &order, &quotas, &cost, &mut fitted);
            // Every unit of every leaf placed exactly once.
            for out in [&streamed, &fitted] {
                let mut covered = vec![0u64; leaves.len()];
                for p in out.iter().flatten() {
                    covered[p.leaf as usize] += p.stop - p.start;
                }
                for (l, c) in leaves.iter().zip(&covered) {
                    assert_eq!(*c, l.units());
                }
            }
            // Within a few pieces' overhead and one grain of each quota
            // (every end on a legal cut), where the plain stream misses by
            // a large part of a minimum piece (1.05 ms).
            let slack = 4.0 * cost.piece_s + 4096.0 / cost.bandwidth;
            let fit = worst_miss(&leaves, &cost, &quotas, &fitted);
            let plain = worst_miss(&leaves, &cost, &quotas, &streamed);
            assert!(fit <= slack, "{writers} writers: fitted misses by {fit} s");
            assert!(
                plain > 4.0 * slack,
                "{writers} writers: the stream misses by {plain} s only"
            );
        }
    }
}
