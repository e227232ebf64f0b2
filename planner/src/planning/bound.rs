//! A proven lower bound on the makespan of any legal plan, under the cost
//! model (see [`crate::model::cost`] for the model and for what a legal piece is).
//!
//! Let `F = fixed_s`, `s = piece_s`, `β = bandwidth`, `ν = node_bandwidth`,
//! `α = aggregate_bandwidth` (∞ when unset), `w = writer_s`, and for a leaf
//! `l` of `B_l` bytes let `c(l) = s + B_l / β` (its cost as a single piece)
//! and `n_l` the most pieces a legal cutting of it has
//! ([`CostModel::max_pieces`]: 1 for objects and leaves too small to cut).
//! Let `A` be the set of ranks that own a leaf, `o_a` the summed `c(l)` of
//! the leaves rank `a` owns, `W` the summed `c(l)` of the replicated leaves,
//! `O` the summed `o_a`, and `B` the bytes of all leaves. The world has
//! `N` nodes of `R` ranks.
//!
//! Take any legal plan and let `S` be its writers, `k = |S|`, and
//! `T = makespan - k w` (the largest of the three maxima of the model).
//! 1. Every owner is a writer (its leaves must be written by it), so `k >= |A|`;
//!    if `W > 0` at least one rank writes, so `k >= 1`.
//! 2. Every leaf is written as at least one piece and the pieces of a leaf
//!    add up to its bytes, so the writers' costs add up to at least
//!    `k F + W + O`. The largest cost is at least the mean:
//!    `T >= F + (W + O) / k`.
//! 3. An owner pays for all it owns: `T >= F + max_a o_a`.
//! 4. A replicated leaf lies in at most `min(k, n_l)` pieces on distinct
//!    writers, so one writer holds at least `B_l / min(k, n_l)` of its bytes
//!    in at least one piece: `T >= F + s + max_l B_l / (min(k, n_l) β)`.
//! 5. A writer moves at most `(T - F) β` bytes, the writers of a node
//!    together at most `(T - F) ν`, and all of them at most `(T - F) α`. If
//!    node `n` has `k_n` writers, `B <= (T - F) min(α, Σ_n min(ν, k_n β))`.
//!    The sum is concave in each `k_n`, so over the ways to place `k`
//!    writers on `N` nodes it is largest when they are spread evenly
//!    (`k mod N` nodes with `⌈k/N⌉`, the others `⌊k/N⌋`); call that `C(k)`.
//!    So `T >= F + B / C(k)`.
//!
//! 6. With holder groups (docs/PLANNER.md): a leaf held by the ranks `H_l`
//!    (every rank, or a group) is written by ranks of `H_l` only. Bound 4
//!    holds with `min(k, n_l, |H_l|)` pieces on distinct writers. And the
//!    pieces of a plan are a *fractional* assignment: rank `r` carries the
//!    costs of its pieces, at least `c(l)` per leaf in total over the
//!    leaf's holders, on top of `o_r` (leaves with one holder count as
//!    owned). So `T - F` is at least the fractional optimum `Φ`: the least
//!    `t` at which every leaf's `c(l)` can be spread over its holders with
//!    no rank above `t` ([`crate::planning::holders`]: a max-flow over the leaves
//!    aggregated by holder set, Hall's condition over unions of groups).
//!    `T >= F + Φ`, for every `k`.
//!
//! 7. Take groups `g_1..g_p` that are pairwise disjoint (a packing). The
//!    leaves of `g_i` are written by the `n_i` writers inside it, who carry
//!    at least its summed `c(l)`, `D_i`, so one carries `D_i / n_i`:
//!    `T - F >= D_i / n_i`. The `n_i` are integers of at least 1 (at most
//!    `|g_i|`), and the groups' writers are distinct, so `Σ n_i <= k`. So
//!    `T - F >= t_k`, the least over integer `n_i` with `Σ n_i <= k` of
//!    `max_i D_i / n_i` (infinite for `k < p`), which Jefferson's
//!    apportionment computes for every `k` at once.
//!
//! So `makespan = T + k w >= M(k) + k w` with `M(k)` the largest of the
//! bounds 2-7, and the minimum of that over the feasible `k` is a lower bound
//! for every legal plan. `M(k)` is non-increasing in `k` and in the number of
//! nodes, so the bound never rises with the world size. It is cheap:
//! `O(leaves + world_size)`.

use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{Holders, Manifest};
use crate::planning::holders::HolderFlow;

/// The loads that the bound, and the algorithms, start from.
#[derive(Debug, Clone)]
pub struct LoadSummary {
    /// Summed single-piece cost of the replicated leaves (`W`).
    pub replicated_work: f64,
    /// Number of replicated leaves.
    pub replicated_leaves: usize,
    /// The most pieces the replicated leaves can be cut into, together
    /// (the sum of their [`CostModel::max_pieces`], saturating).
    pub replicated_max_pieces: u64,
    /// Per rank: the summed cost of the leaves it owns (`o_r`), fixed cost excluded.
    pub owned_load: Vec<f64>,
    /// Per rank: the bytes of the leaves it owns.
    pub owned_bytes: Vec<u64>,
    /// Per rank: whether it owns any leaf.
    pub is_owner: Vec<bool>,
    /// Bytes of all leaves, owned and replicated (`B`).
    pub total_bytes: u64,
    /// Summed single-piece cost of the leaves held by a group of several
    /// ranks (part of `W` in the proof), and how many there are.
    pub grouped_work: f64,
    pub grouped_leaves: usize,
    /// The network of the shared leaves, when some leaf is held by a group
    /// of several ranks; with it, the fractional optimum `Φ` (bound 6; 0
    /// without groups).
    pub holders: Option<HolderFlow>,
    pub fractional_level: f64,
    /// Bound 7, by writer count (empty without groups).
    pub packing_levels: Vec<f64>,
    /// Index `n` in `1..=world_size`: the largest `B_l / n` over replicated
    /// leaves with `n_l == n`.
    per_piece_bytes: Vec<f64>,
    /// Index `n` in `1..=world_size + 1`: the largest `B_l` over replicated
    /// leaves with `min(n_l, world_size + 1) == n`.
    leaf_bytes_by_pieces: Vec<f64>,
    /// Nodes and ranks per node.
    pub nodes: u32,
    pub ranks_per_node: u32,
}

impl LoadSummary {
    pub fn new(
        manifest: &Manifest,
        world_size: u32,
        topology: &Topology,
        cost: &CostModel,
    ) -> LoadSummary {
        let ws = world_size as usize;
        let mut owned_load = vec![0.0; ws];
        let mut owned_bytes = vec![0u64; ws];
        let mut is_owner = vec![false; ws];
        let mut replicated_work = 0.0;
        let mut replicated_leaves = 0;
        let mut replicated_max_pieces = 0u64;
        let mut per_piece_bytes = vec![0.0f64; ws + 1];
        let mut leaf_bytes_by_pieces = vec![0.0f64; ws + 2];
        let mut grouped_work = 0.0;
        let mut grouped_leaves = 0;
        for leaf in manifest.leaves() {
            let c = cost.piece_cost(leaf.nbytes);
            let holders = manifest.holders(leaf);
            let sole = match holders {
                Holders::Ranks(&[o]) => Some(o),
                _ => None,
            };
            match sole {
                Some(o) => {
                    owned_load[o as usize] += c;
                    owned_bytes[o as usize] += leaf.nbytes;
                    is_owner[o as usize] = true;
                }
                None => {
                    let mut n = cost.max_pieces(leaf);
                    if let Holders::Ranks(rs) = holders {
                        grouped_work += c;
                        grouped_leaves += 1;
                        n = n.min(rs.len() as u64);
                    } else {
                        replicated_work += c;
                        replicated_leaves += 1;
                        replicated_max_pieces = replicated_max_pieces.saturating_add(n);
                    }
                    let bytes = leaf.nbytes as f64;
                    if n <= world_size as u64 {
                        let slot = &mut per_piece_bytes[n as usize];
                        *slot = slot.max(bytes / n as f64);
                    }
                    let slot = &mut leaf_bytes_by_pieces[n.min(ws as u64 + 1) as usize];
                    *slot = slot.max(bytes);
                }
            }
        }
        let ranks_per_node = topology.ranks_per_node.max(1);
        let holders = HolderFlow::new(manifest, world_size, cost);
        let fractional_level = holders.as_ref().map_or(0.0, |f| {
            let everyone: Vec<u32> = (0..world_size).collect();
            // The infeasible end of the bisection: below the optimum.
            f.level(&everyone, &owned_load, 1e-9).0
        });
        let packing_levels = holders
            .as_ref()
            .map_or_else(Vec::new, |f| f.packing_levels(manifest, world_size));
        LoadSummary {
            packing_levels,
            grouped_work,
            grouped_leaves,
            holders,
            fractional_level,
            replicated_work,
            replicated_leaves,
            replicated_max_pieces,
            owned_load,
            owned_bytes,
            is_owner,
            total_bytes: manifest.total_bytes(),
            per_piece_bytes,
            leaf_bytes_by_pieces,
            nodes: world_size.div_ceil(ranks_per_node),
            ranks_per_node,
        }
    }

    pub fn owners(&self) -> usize {
        self.is_owner.iter().filter(|&&b| b).count()
    }

    pub fn total_owned(&self) -> f64 {
        self.owned_load.iter().sum()
    }

    pub fn max_owned(&self) -> f64 {
        self.owned_load.iter().copied().fold(0.0, f64::max)
    }

    /// Leaves held by more than one rank (every rank, or a group).
    pub fn shared_leaves(&self) -> usize {
        self.replicated_leaves + self.grouped_leaves
    }
}

/// The bound, and the writer count at which it is reached.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LowerBound {
    /// Lower bound on the makespan, in seconds.
    pub makespan_s: f64,
    /// The writer count `k` that minimises the bound.
    pub writers: u32,
    /// `M(k)` at that count: the bound on the largest rank cost.
    pub level_s: f64,
}

/// `M(k)`: the bound on the largest rank cost when `k` ranks write.
pub fn level(summary: &LoadSummary, cost: &CostModel, k: u32) -> f64 {
    Levels::new(summary, cost).at(k)
}

/// `C(k)` of bound 5: the most bytes per second `k` writers spread evenly
/// over `nodes` nodes can move. Infinite when nothing shared limits them
/// and `k` is 0.
pub fn writer_capacity(cost: &CostModel, nodes: u32, k: u32) -> f64 {
    let nodes = nodes.max(1);
    let beta = cost.bandwidth;
    let nu = cost.node_bandwidth_or_inf();
    let q = (k / nodes) as f64;
    let a = (k % nodes) as f64;
    let spread = a * nu.min((q + 1.0) * beta) + (nodes as f64 - a) * nu.min(q * beta);
    spread.min(cost.aggregate_bandwidth_or_inf())
}

/// `M(k)` with the sums over ranks done once, for evaluating many `k`.
pub(crate) struct Levels {
    fixed_s: f64,
    piece_s: f64,
    bandwidth: f64,
    /// `W + O`: the mean bound is `F + (W + O) / k`.
    work: f64,
    /// `F + max_a o_a`.
    floor: f64,
    /// Whether anything replicated is written (bound 4 applies).
    replicated: bool,
    /// Prefix maxima of `per_piece_bytes`: index `k` is the largest
    /// `B_l / n_l` over leaves with `n_l <= k`.
    cut_prefix: Vec<f64>,
    /// Suffix maxima of `leaf_bytes_by_pieces`: index `k` is the largest
    /// `B_l` over leaves with `n_l > k`.
    whole_suffix: Vec<f64>,
    total_bytes: f64,
    nodes: u32,
    cost: CostModel,
    /// Bound 7 by writer count; empty without groups.
    packing: Vec<f64>,
}

impl Levels {
    pub(crate) fn new(summary: &LoadSummary, cost: &CostModel) -> Levels {
        let mut cut_prefix = summary.per_piece_bytes.clone();
        for i in 1..cut_prefix.len() {
            cut_prefix[i] = cut_prefix[i].max(cut_prefix[i - 1]);
        }
        let by_pieces = &summary.leaf_bytes_by_pieces;
        let mut whole_suffix = vec![0.0f64; by_pieces.len()];
        for i in (0..by_pieces.len().saturating_sub(1)).rev() {
            whole_suffix[i] = whole_suffix[i + 1].max(by_pieces[i + 1]);
        }
        Levels {
            fixed_s: cost.fixed_s,
            piece_s: cost.piece_s,
            bandwidth: cost.bandwidth,
            work: summary.replicated_work + summary.grouped_work + summary.total_owned(),
            floor: cost.fixed_s + summary.max_owned().max(summary.fractional_level),
            replicated: summary.shared_leaves() > 0,
            cut_prefix,
            whole_suffix,
            total_bytes: summary.total_bytes as f64,
            nodes: summary.nodes,
            cost: *cost,
            packing: summary.packing_levels.clone(),
        }
    }

    pub(crate) fn at(&self, k: u32) -> f64 {
        self.at_capacity(k, writer_capacity(&self.cost, self.nodes, k))
    }

    /// `M(k)` with bound 5's `C(k)` replaced by `capacity`: the bound on the
    /// largest rank cost of any plan whose `k` writers together move at most
    /// `capacity` bytes per second (for writers confined to some nodes, the
    /// even spread over those nodes). It depends on the world size only
    /// through `capacity`: the other terms are the same for every world that
    /// holds `k` ranks.
    pub(crate) fn at_capacity(&self, k: u32, capacity: f64) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let mut m = (self.fixed_s + self.work / k as f64).max(self.floor);
        if self.replicated {
            let i = (k as usize).min(self.cut_prefix.len() - 1);
            let largest = self.cut_prefix[i].max(self.whole_suffix[i] / k as f64);
            m = m.max(self.fixed_s + self.piece_s + largest / self.bandwidth);
        }
        if self.total_bytes > 0.0 {
            m = m.max(self.fixed_s + self.total_bytes / capacity);
        }
        if let Some(&t) = self.packing.get(k as usize) {
            m = m.max(self.fixed_s + t);
        }
        m
    }
}

/// The feasible writer counts: from the owners (at least one when anything
/// replicated must be written) to the world size.
pub fn writer_range(summary: &LoadSummary, world_size: u32) -> (u32, u32) {
    let owners = summary.owners() as u32;
    let lo = if summary.shared_leaves() > 0 {
        owners.max(1)
    } else {
        owners
    };
    let hi = if summary.shared_leaves() > 0 {
        world_size
    } else {
        owners
    };
    (lo, hi)
}

/// Computes the lower bound; see the module documentation for the proof.
pub fn lower_bound(summary: &LoadSummary, cost: &CostModel, world_size: u32) -> LowerBound {
    let (lo, hi) = writer_range(summary, world_size);
    let levels = Levels::new(summary, cost);
    let mut best = LowerBound {
        makespan_s: f64::INFINITY,
        writers: lo,
        level_s: 0.0,
    };
    for k in lo..=hi {
        let m = levels.at(k);
        let total = m + k as f64 * cost.writer_s;
        if total < best.makespan_s {
            best = LowerBound {
                makespan_s: total,
                writers: k,
                level_s: m,
            };
        }
    }
    if lo == 0 && hi == 0 {
        best = LowerBound {
            makespan_s: 0.0,
            writers: 0,
            level_s: 0.0,
        };
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::manifest::{Leaf, PathKey};

    fn obj(name: &str, bytes: u64, owner: Option<u32>) -> Leaf {
        Leaf::object(vec![PathKey::Str(name.into())], bytes, owner).unwrap()
    }

    #[test]
    fn small_states_choose_fewer_writers() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![obj("a", 1000, None)]).unwrap();
        let s = LoadSummary::new(&m, 64, &Topology::default(), &cost);
        let lb = lower_bound(&s, &cost, 64);
        assert_eq!(lb.writers, 1);
        let expected = cost.fixed_s + cost.piece_cost(1000) + cost.writer_s;
        assert!((lb.makespan_s - expected).abs() < 1e-15);
    }

    #[test]
    fn large_states_use_many_writers() {
        let cost = CostModel::default();
        let dtype = crate::model::dtype::DType::Float32;
        let m = Manifest::new(vec![Leaf::tensor(
            vec![PathKey::Str("w".into())],
            dtype,
            vec![1 << 30],
            None,
        )
        .unwrap()])
        .unwrap();
        let s = LoadSummary::new(&m, 4096, &Topology::default(), &cost);
        let lb = lower_bound(&s, &cost, 4096);
        // 4 GiB at 1 GB/s: the optimum balances 4.29 s / k against k * 0.2 ms.
        assert!(lb.writers > 100 && lb.writers < 200, "{lb:?}");
    }

    #[test]
    fn owners_are_forced_writers_and_bound_their_load() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![obj("a", 1 << 30, Some(2)), obj("b", 10, Some(3))]).unwrap();
        let s = LoadSummary::new(&m, 4, &Topology::default(), &cost);
        let lb = lower_bound(&s, &cost, 4);
        assert_eq!(lb.writers, 2);
        let expected = cost.fixed_s + cost.piece_cost(1 << 30) + 2.0 * cost.writer_s;
        assert!((lb.makespan_s - expected).abs() < 1e-12);
    }

    #[test]
    fn empty_manifest_has_zero_bound() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![]).unwrap();
        let lb = lower_bound(
            &LoadSummary::new(&m, 8, &Topology::default(), &cost),
            &cost,
            8,
        );
        assert_eq!(lb.makespan_s, 0.0);
        assert_eq!(lb.writers, 0);
    }
}
