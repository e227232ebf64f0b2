//! A proven lower bound on the makespan of any plan, under the cost model.
//!
//! Let `F = fixed_s`, `w = writer_s`, and for a leaf `l` let
//! `c(l) = piece_s + bytes(l) / bandwidth` (its cost as a single piece).
//! Let `A` be the set of ranks that own a leaf, `o_a` the summed `c(l)` of
//! the leaves rank `a` owns, `W` the summed `c(l)` of the replicated leaves,
//! and `O` the summed `o_a`.
//!
//! Take any valid plan and let `S` be its writers, `k = |S|`.
//! 1. Every owner is a writer (its leaves must be written by it), so `k >= |A|`;
//!    if `W > 0` at least one rank writes, so `k >= 1`.
//! 2. Every leaf is written as at least one piece and the pieces of a leaf
//!    add up to its bytes, so the writers' costs add up to at least
//!    `k F + W + O`. The largest cost is at least the mean:
//!    `max cost >= F + (W + O) / k`.
//! 3. An owner pays for all it owns: `max cost >= F + max_a o_a`.
//! 4. A leaf that cannot be split (an object, or a tensor of one element) is
//!    one piece on one writer: `max cost >= F + max c(u)` over those leaves.
//!
//! So `makespan = max cost + k w >= M(k) + k w` with `M(k)` the largest of
//! the three bounds above, and the minimum of that over the feasible `k` is a
//! lower bound for every plan. It is cheap: `O(leaves + world_size)`.

use crate::cost::CostModel;
use crate::manifest::Manifest;

/// The loads that the bound, and the algorithms, start from.
#[derive(Debug, Clone)]
pub struct LoadSummary {
    /// Summed single-piece cost of the replicated leaves (`W`).
    pub replicated_work: f64,
    /// Number of replicated leaves.
    pub replicated_leaves: usize,
    /// Per rank: the summed cost of the leaves it owns (`o_r`), fixed cost excluded.
    pub owned_load: Vec<f64>,
    /// Per rank: whether it owns any leaf.
    pub is_owner: Vec<bool>,
    /// Largest single-piece cost of a replicated leaf that cannot be split.
    pub max_unsplittable: f64,
}

impl LoadSummary {
    pub fn new(manifest: &Manifest, world_size: u32, cost: &CostModel) -> LoadSummary {
        let mut owned_load = vec![0.0; world_size as usize];
        let mut is_owner = vec![false; world_size as usize];
        let mut replicated_work = 0.0;
        let mut replicated_leaves = 0;
        let mut max_unsplittable: f64 = 0.0;
        for leaf in manifest.leaves() {
            let c = cost.piece_cost(leaf.nbytes);
            match leaf.owner {
                Some(o) => {
                    owned_load[o as usize] += c;
                    is_owner[o as usize] = true;
                }
                None => {
                    replicated_work += c;
                    replicated_leaves += 1;
                    if !leaf.is_tensor() || leaf.units() <= 1 {
                        max_unsplittable = max_unsplittable.max(c);
                    }
                }
            }
        }
        LoadSummary {
            replicated_work,
            replicated_leaves,
            owned_load,
            is_owner,
            max_unsplittable,
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

/// `M(k)` with the sums over ranks done once, for evaluating many `k`.
struct Levels {
    /// `F` and `W + O`: the mean bound is `F + (W + O) / k`.
    fixed_s: f64,
    work: f64,
    /// The part that does not depend on `k`: `F + max_a o_a`, and
    /// `F + max c(u)` when anything replicated is written.
    floor: f64,
}

impl Levels {
    fn new(summary: &LoadSummary, cost: &CostModel) -> Levels {
        let mut floor = cost.fixed_s + summary.max_owned();
        if summary.replicated_leaves > 0 {
            floor = floor.max(cost.fixed_s + summary.max_unsplittable);
        }
        Levels {
            fixed_s: cost.fixed_s,
            work: summary.replicated_work + summary.total_owned(),
            floor,
        }
    }

    fn at(&self, k: u32) -> f64 {
        if k == 0 {
            return 0.0;
        }
        (self.fixed_s + self.work / k as f64).max(self.floor)
    }
}

/// The feasible writer counts: from the owners (at least one when anything
/// replicated must be written) to the world size.
pub fn writer_range(summary: &LoadSummary, world_size: u32) -> (u32, u32) {
    let owners = summary.owners() as u32;
    let lo = if summary.replicated_leaves > 0 {
        owners.max(1)
    } else {
        owners
    };
    let hi = if summary.replicated_leaves > 0 {
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
    use crate::manifest::{Leaf, PathKey};

    fn obj(name: &str, bytes: u64, owner: Option<u32>) -> Leaf {
        Leaf::object(vec![PathKey::Str(name.into())], bytes, owner).unwrap()
    }

    #[test]
    fn small_states_choose_fewer_writers() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![obj("a", 1000, None)]).unwrap();
        let s = LoadSummary::new(&m, 64, &cost);
        let lb = lower_bound(&s, &cost, 64);
        assert_eq!(lb.writers, 1);
        let expected = cost.fixed_s + cost.piece_cost(1000) + cost.writer_s;
        assert!((lb.makespan_s - expected).abs() < 1e-15);
    }

    #[test]
    fn large_states_use_many_writers() {
        let cost = CostModel::default();
        let dtype = crate::DType::Float32;
        let m = Manifest::new(vec![Leaf::tensor(
            vec![PathKey::Str("w".into())],
            dtype,
            vec![1 << 30],
            None,
        )
        .unwrap()])
        .unwrap();
        let s = LoadSummary::new(&m, 4096, &cost);
        let lb = lower_bound(&s, &cost, 4096);
        // 4 GiB at 1 GB/s: the optimum balances 4.29 s / k against k * 0.2 ms.
        assert!(lb.writers > 100 && lb.writers < 200, "{lb:?}");
    }

    #[test]
    fn owners_are_forced_writers_and_bound_their_load() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![obj("a", 1 << 30, Some(2)), obj("b", 10, Some(3))]).unwrap();
        let s = LoadSummary::new(&m, 4, &cost);
        let lb = lower_bound(&s, &cost, 4);
        assert_eq!(lb.writers, 2);
        let expected = cost.fixed_s + cost.piece_cost(1 << 30) + 2.0 * cost.writer_s;
        assert!((lb.makespan_s - expected).abs() < 1e-12);
    }

    #[test]
    fn empty_manifest_has_zero_bound() {
        let cost = CostModel::default();
        let m = Manifest::new(vec![]).unwrap();
        let lb = lower_bound(&LoadSummary::new(&m, 8, &cost), &cost, 8);
        assert_eq!(lb.makespan_s, 0.0);
        assert_eq!(lb.writers, 0);
    }
}
