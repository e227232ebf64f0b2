//! Local search after a grouped fill ([`super::grouped`]): the slowest
//! writer hands work to another writer that holds the same leaf, while that
//! lowers the larger of the two ranks' costs.
//!
//! The stream fill places each writer within about one grain, half an
//! uncuttable leaf or one minimum piece of its quota. When a holder group's
//! share per writer is only a few leaves or minimum pieces (small states
//! over many writers), that error is a visible part of the makespan. Each
//! step takes the writer `r` with the largest cost and applies the best of:
//!
//! - **move** one of its pieces, whole, to the least-loaded writer `t` that
//!   holds the leaf and has no piece of it yet;
//! - **shift** the boundary between a piece of `r` and the adjacent piece of
//!   the same leaf on another writer `t` by whole grains towards `r`,
//!   keeping `r`'s piece at least `min_piece_bytes` (every cut stays legal:
//!   on the leaf's grain, pieces of at least `min_piece_bytes`);
//! - **absorb** `r`'s piece into that adjacent piece (one piece fewer).
//!
//! - **swap** one of its pieces for one or several smaller pieces of that
//!   writer that `r` may hold;
//! - **chain** boundary shifts along cut leaves to the least-loaded writer
//!   reached.
//!
//! The targets are the least-loaded writers of each group; with `widen`,
//! when the least-loaded one takes no step, the 8 least-loaded are tried
//! before the search stops (a trade with a writer a little above the least
//! is often what frees a slowest writer whose cut piece is at the minimum).
//!
//! A step is taken only when `max(cost_r', cost_t') < cost_r`: the costs'
//! sum of squares then strictly falls (moving `x` from `a` to `b` with
//! `b + x < a` changes it by `2x (b + x - a) < 0`, and absorbing also
//! removes a piece cost), so the search cannot cycle; it stops when no step
//! helps the slowest writer, or at its work budget. Ranks that write
//! nothing are never given work (that would add a writer), and every piece
//! stays on a holder of its leaf.

use std::collections::HashMap;

use crate::model::cost::CostModel;
use crate::model::manifest::{Holders, Manifest};
use crate::planning::holders::HolderFlow;
use crate::planning::plan::Piece;

/// How many of a group's least-loaded writers a piece of the slowest
/// writer is offered to (moved to the first, traded with any) when the two
/// least-loaded ones took no step.
const TARGETS: usize = 8;

/// A piece in the search.
#[derive(Clone, Copy)]
struct Slot {
    leaf: u32,
    start: u64,
    stop: u64,
    bytes: u64,
    rank: u32,
}

#[derive(Clone)]
enum Step {
    /// Slot to rank.
    Move(usize, u32),
    /// Boundary of slot `.0` with its neighbour slot `.1` moved so that the
    /// slot keeps `[.2, .3)`.
    Shift(usize, usize, u64, u64),
    /// Slot into its neighbour slot.
    Absorb(usize, usize),
    /// Slot `.0` of the slowest writer for the slots `.1` of another.
    Swap(usize, Vec<usize>),
    /// Along a chain of cut leaves, each `(slot, neighbour)` link gives
    /// `.1` grains of its slot to its neighbour.
    Chain(Vec<(usize, usize)>, u64),
}

/// Improves `placed` (the shared leaves' pieces per rank) in place.
/// `base_load` is each rank's cost before them (its owned leaves, fixed
/// cost excluded); `writes` whether the rank writes anything besides
/// `placed`. At most about `budget` slot and writer visits. With `widen`,
/// when no step helps, the slowest writer's pieces are offered to more
/// writers before the search stops.
pub(super) fn refine(
    manifest: &Manifest,
    flow: &HolderFlow,
    cost: &CostModel,
    base_load: &[f64],
    writes: &[bool],
    placed: &mut [Vec<Piece>],
    budget: usize,
    widen: bool,
) {
    let leaves = manifest.leaves();
    let beta = cost.bandwidth;
    let ws = placed.len();
    let mut slots: Vec<Slot> = Vec::new();
    let mut rank_slots: Vec<Vec<usize>> = vec![Vec::new(); ws];
    let mut load: Vec<f64> = base_load.to_vec();
    for (r, list) in placed.iter().enumerate() {
        for p in list {
            let bytes = leaves[p.leaf as usize].range_bytes(p.start, p.stop);
            load[r] += cost.piece_cost(bytes);
            rank_slots[r].push(slots.len());
            slots.push(Slot {
                leaf: p.leaf,
                start: p.start,
                stop: p.stop,
                bytes,
                rank: r as u32,
            });
        }
    }
    let writers: Vec<u32> = (0..ws as u32)
        .filter(|&r| writes[r as usize] || !rank_slots[r as usize].is_empty())
        .collect();
    if writers.len() < 2 {
        return;
    }
    // The slots of each cut leaf, by start.
    let mut cut: HashMap<u32, Vec<usize>> = HashMap::new();
    for (s, slot) in slots.iter().enumerate() {
        if slot.start != 0 || slot.stop != leaves[slot.leaf as usize].units() {
            cut.entry(slot.leaf).or_default().push(s);
        }
    }
    for list in cut.values_mut() {
        list.sort_by_key(|&s| slots[s].start);
    }
    // The writers of each flow group.
    let mut class_groups: Vec<Vec<usize>> = vec![Vec::new(); flow.classes()];
    for (g, reach) in flow.reach.iter().enumerate() {
        for &c in reach {
            class_groups[c as usize].push(g);
        }
    }
    let mut group_writers: Vec<Vec<u32>> = vec![Vec::new(); flow.demand.len()];
    for &r in &writers {
        for &g in &class_groups[flow.class_of[r as usize] as usize] {
            group_writers[g].push(r);
        }
    }
    let group_of = |leaf: u32| -> Option<usize> {
        let l = &leaves[leaf as usize];
        match manifest.holders(l) {
            Holders::All => flow.all.map(|g| g as usize),
            Holders::Ranks(rs) if rs.len() > 1 => l
                .holders
                .and_then(|g| flow.flow_of_group[g as usize])
                .map(|g| g as usize),
            Holders::Ranks(_) => None,
        }
    };
    let mut work = 0usize;
    let mut least: Vec<Vec<u32>> = vec![Vec::with_capacity(TARGETS + 1); flow.demand.len()];
    // Whether this step offers pieces to `TARGETS` writers, not two: with
    // `widen`, when two found no step (a wider search costs more per step).
    let mut wide = false;
    while work < budget {
        let width = if wide { TARGETS } else { 2 };
        let r = *writers
            .iter()
            .max_by(|&&a, &&b| {
                load[a as usize]
                    .total_cmp(&load[b as usize])
                    .then(b.cmp(&a))
            })
            .expect("two writers");
        let lr = load[r as usize];
        let tolerance = lr * 1e-9;
        // The least-loaded writers of each group, ascending.
        for (g, ranks) in group_writers.iter().enumerate() {
            let few = &mut least[g];
            few.clear();
            for &w in ranks {
                let lw = load[w as usize];
                if few.len() == width && lw >= load[few[width - 1] as usize] {
                    continue;
                }
                let at = few.partition_point(|&a| load[a as usize] <= lw);
                few.insert(at, w);
                few.truncate(width);
            }
            work += ranks.len();
        }
        let mut best: Option<(f64, Step)> = None;
        let mut consider = |value: f64, step: Step| {
            if value < lr - tolerance && best.as_ref().is_none_or(|(v, _)| value < *v) {
                best = Some((value, step));
            }
        };
        // Per target, its pieces that could come to `r`, by cost.
        let mut offers: HashMap<u32, Vec<(f64, usize)>> = HashMap::new();
        let holds_none = |rank: u32, leaf: u32, slots: &[Slot]| {
            cut.get(&leaf)
                .is_none_or(|v| v.iter().all(|&x| slots[x].rank != rank))
        };
        for &s in &rank_slots[r as usize] {
            work += 1;
            let slot = slots[s];
            let Some(g) = group_of(slot.leaf) else {
                continue;
            };
            let c = cost.piece_cost(slot.bytes);
            let pieces = cut.get(&slot.leaf);
            let taken = |t: u32| pieces.is_some_and(|v| v.iter().any(|&x| slots[x].rank == t));
            let targets: Vec<u32> = least[g]
                .iter()
                .copied()
                .filter(|&t| t != r && load[t as usize] < lr - tolerance && !taken(t))
                .collect();
            if let Some(&t) = targets.first() {
                let lt = load[t as usize];
                consider((lr - c).max(lt + c), Step::Move(s, t));
            }
            // Trades with the least-loaded target, or with every one in a
            // wide step.
            for &t in targets.iter().take(if wide { TARGETS } else { 1 }) {
                let lt = load[t as usize];
                // A swap with a smaller piece of `t` that `r` may hold:
                // the one nearest to moving half the difference.
                let offer = offers.entry(t).or_insert_with(|| {
                    let mut o: Vec<(f64, usize)> = rank_slots[t as usize]
                        .iter()
                        .filter(|&&b| {
                            let leaf = slots[b].leaf;
                            manifest.holders(&leaves[leaf as usize]).contains(r)
                                && holds_none(r, leaf, &slots)
                        })
                        .map(|&b| (cost.piece_cost(slots[b].bytes), b))
                        .collect();
                    o.sort_by(|a, b| a.0.total_cmp(&b.0));
                    o
                });
                work += offer.len();
                let want = c - (lr - lt) / 2.0;
                let at = offer.partition_point(|&(cb, _)| cb < want);
                for &(cb, b) in &offer[at.saturating_sub(2)..(at + 2).min(offer.len())] {
                    if cb < c {
                        let d = c - cb;
                        consider((lr - d).max(lt + d), Step::Swap(s, vec![b]));
                    }
                }
                // Or for several: the largest that still fit `want`.
                let mut room = want;
                let mut back = Vec::new();
                for &(cb, b) in offer[..at.min(offer.len())].iter().rev() {
                    if cb <= room {
                        room -= cb;
                        back.push(b);
                    }
                }
                if back.len() > 1 {
                    let d = c - (want - room);
                    if d > 0.0 {
                        consider((lr - d).max(lt + d), Step::Swap(s, back));
                    }
                }
            }
            let Some(v) = pieces else {
                continue;
            };
            let i = v
                .iter()
                .position(|&x| x == s)
                .expect("a cut slot is listed");
            let leaf = &leaves[slot.leaf as usize];
            let grain = cost.grain_units(leaf);
            let grain_bytes = grain.saturating_mul(leaf.unit_bytes());
            let neighbours = [
                i.checked_sub(1).map(|j| (v[j], true)),
                v.get(i + 1).map(|&n| (n, false)),
            ];
            for (n, before) in neighbours.into_iter().flatten() {
                let t = slots[n].rank;
                if t == r {
                    continue;
                }
                let lt = load[t as usize];
                consider(
                    (lr - c).max(lt + slot.bytes as f64 / beta),
                    Step::Absorb(s, n),
                );
                if grain_bytes == 0 || slot.bytes < cost.min_piece_bytes + grain_bytes {
                    continue;
                }
                let want = (lr - lt) / 2.0 * beta / grain_bytes as f64;
                let most = (slot.bytes - cost.min_piece_bytes) / grain_bytes;
                let around = want.round().max(1.0) as u64;
                for g in [around.saturating_sub(1), around, around + 1] {
                    let g = g.min(most);
                    if g == 0 {
                        continue;
                    }
                    let (start, stop) = if before {
                        (slot.start + g * grain, slot.stop)
                    } else {
                        (slot.start, slot.stop - g * grain)
                    };
                    if start >= stop {
                        continue;
                    }
                    let keep = leaf.range_bytes(start, stop);
                    if keep < cost.min_piece_bytes {
                        continue;
                    }
                    let moved = (slot.bytes - keep) as f64 / beta;
                    consider((lr - moved).max(lt + moved), Step::Shift(s, n, start, stop));
                }
            }
        }
        if let Some((value, links, grains)) =
            chain(&slots, &rank_slots, &cut, leaves, cost, &load, r)
        {
            consider(value, Step::Chain(links, grains));
        }
        let Some((_, step)) = best else {
            if wide || !widen {
                break;
            }
            wide = true;
            continue;
        };
        wide = false;
        match step {
            Step::Move(s, t) => {
                let c = cost.piece_cost(slots[s].bytes);
                load[r as usize] -= c;
                load[t as usize] += c;
                rank_slots[r as usize].retain(|&x| x != s);
                rank_slots[t as usize].push(s);
                slots[s].rank = t;
            }
            Step::Shift(s, n, start, stop) => {
                let leaf = &leaves[slots[s].leaf as usize];
                let keep = leaf.range_bytes(start, stop);
                let moved = (slots[s].bytes - keep) as f64 / beta;
                let t = slots[n].rank as usize;
                load[r as usize] -= moved;
                load[t] += moved;
                if start > slots[s].start {
                    slots[n].stop = start;
                } else {
                    slots[n].start = stop;
                }
                slots[n].bytes = leaf.range_bytes(slots[n].start, slots[n].stop);
                slots[s].start = start;
                slots[s].stop = stop;
                slots[s].bytes = keep;
            }
            Step::Swap(s, back) => {
                let t = slots[back[0]].rank;
                let d = cost.piece_cost(slots[s].bytes)
                    - back
                        .iter()
                        .map(|&b| cost.piece_cost(slots[b].bytes))
                        .sum::<f64>();
                load[r as usize] -= d;
                load[t as usize] += d;
                rank_slots[r as usize].retain(|&x| x != s);
                rank_slots[t as usize].retain(|x| !back.contains(x));
                rank_slots[r as usize].extend(&back);
                rank_slots[t as usize].push(s);
                slots[s].rank = t;
                for &b in &back {
                    slots[b].rank = r;
                }
            }
            Step::Chain(links, grains) => {
                for (s, n) in links {
                    let leaf = &leaves[slots[s].leaf as usize];
                    let units = grains * cost.grain_units(leaf);
                    if slots[n].stop == slots[s].start {
                        slots[s].start += units;
                        slots[n].stop = slots[s].start;
                    } else {
                        slots[s].stop -= units;
                        slots[n].start = slots[s].stop;
                    }
                    let keep = leaf.range_bytes(slots[s].start, slots[s].stop);
                    let moved = (slots[s].bytes - keep) as f64 / beta;
                    load[slots[s].rank as usize] -= moved;
                    load[slots[n].rank as usize] += moved;
                    slots[s].bytes = keep;
                    slots[n].bytes = leaf.range_bytes(slots[n].start, slots[n].stop);
                }
            }
            Step::Absorb(s, n) => {
                let t = slots[n].rank as usize;
                load[r as usize] -= cost.piece_cost(slots[s].bytes);
                load[t] += slots[s].bytes as f64 / beta;
                let leaf = &leaves[slots[s].leaf as usize];
                slots[n].start = slots[n].start.min(slots[s].start);
                slots[n].stop = slots[n].stop.max(slots[s].stop);
                slots[n].bytes = leaf.range_bytes(slots[n].start, slots[n].stop);
                rank_slots[r as usize].retain(|&x| x != s);
                if let Some(v) = cut.get_mut(&slots[s].leaf) {
                    v.retain(|&x| x != s);
                }
            }
        }
    }
    for (r, list) in placed.iter_mut().enumerate() {
        list.clear();
        list.extend(rank_slots[r].iter().map(|&s| Piece {
            leaf: slots[s].leaf,
            start: slots[s].start,
            stop: slots[s].stop,
        }));
    }
}

/// A chain's value (the larger of its two changed costs), its `(slot,
/// neighbour)` links and the grains each link gives.
type Chain = (f64, Vec<(usize, usize)>, u64);

/// The best chain of boundary shifts from `r`: breadth first over the
/// writers reached by giving whole grains of a cut piece to the adjacent
/// piece of the same leaf (each piece kept at least `min_piece_bytes`,
/// every link with the grain bytes of the first), to the least-loaded
/// writer reached. The writers inside the chain receive what they give, so
/// only `r` and the chain's end change: `(the larger of their new costs,
/// the links, grains per link)`.
fn chain(
    slots: &[Slot],
    rank_slots: &[Vec<usize>],
    cut: &HashMap<u32, Vec<usize>>,
    leaves: &[crate::model::manifest::Leaf],
    cost: &CostModel,
    load: &[f64],
    r: u32,
) -> Option<Chain> {
    // Per reached rank: (the link that reached it, its parent, grains the
    // path can carry).
    let mut reached: HashMap<u32, (usize, usize, u32, u64)> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([(r, u64::MAX)]);
    let mut grain_bytes = 0u64;
    let mut visits = 0usize;
    while let Some((w, carry)) = queue.pop_front() {
        for &s in &rank_slots[w as usize] {
            let Some(v) = cut.get(&slots[s].leaf) else {
                continue;
            };
            visits += v.len();
            if visits > 100_000 {
                break;
            }
            let leaf = &leaves[slots[s].leaf as usize];
            let g = cost.grain_units(leaf).saturating_mul(leaf.unit_bytes());
            if g == 0 || (grain_bytes != 0 && g != grain_bytes) {
                continue;
            }
            let Some(spare) = slots[s].bytes.checked_sub(cost.min_piece_bytes) else {
                continue;
            };
            let grains = carry.min(spare / g);
            if grains == 0 {
                continue;
            }
            let i = v
                .iter()
                .position(|&x| x == s)
                .expect("a cut slot is listed");
            for n in [i.checked_sub(1).map(|j| v[j]), v.get(i + 1).copied()]
                .into_iter()
                .flatten()
            {
                let u = slots[n].rank;
                if u == r || reached.contains_key(&u) {
                    continue;
                }
                grain_bytes = g;
                reached.insert(u, (s, n, w, grains));
                queue.push_back((u, grains));
            }
        }
    }
    let lr = load[r as usize];
    let (&end, &(_, _, _, carry)) = reached.iter().min_by(|a, b| {
        load[*a.0 as usize]
            .total_cmp(&load[*b.0 as usize])
            .then(a.0.cmp(b.0))
    })?;
    let gap = lr - load[end as usize];
    let grains = ((gap / 2.0 * cost.bandwidth / grain_bytes as f64).round() as u64).clamp(1, carry);
    let moved = (grains * grain_bytes) as f64 / cost.bandwidth;
    let mut links = Vec::new();
    let mut at = end;
    while at != r {
        let (s, n, parent, _) = reached[&at];
        links.push((s, n));
        at = parent;
    }
    links.reverse();
    Some(((lr - moved).max(load[end as usize] + moved), links, grains))
}
