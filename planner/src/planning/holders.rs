//! Holder groups as a flow network, and the fractional optimum over them.
//!
//! The leaves held by several ranks (a multi-rank group, or every rank) are
//! aggregated by holder set into *flow groups*: group `g` demands `D_g`, the
//! summed single-piece cost `c(l) = piece_s + B_l / bandwidth` of its leaves.
//! Ranks that belong to exactly the same flow groups form a *class*; a class
//! is one node of the network, with the summed capacity of its ranks (a flow
//! into a class can be shared among its ranks in any proportion, so merging
//! them loses nothing). Leaves with one holder (an owner, or a group of one
//! rank) are not flow groups: they are the rank's fixed load `o_r`.
//!
//! At a level `T` (seconds on top of `fixed_s`), rank `r` can take
//! `max(0, T - o_r)` more; the network is source → group `g` (capacity
//! `D_g`) → every class inside `g` (unbounded) → sink (the class's capacity).
//! `T` is *feasible* when the maximum flow saturates every group: by the
//! max-flow/min-cut theorem that is Hall's condition, for every set `U` of
//! groups `Σ_{g∈U} D_g <= Σ_{r ∈ ∪U} max(0, T - o_r)`. The least feasible
//! `T` is the fractional optimum: the least level at which each group's cost
//! can be spread over its holders with no rank above it (docs/PLANNER.md).
//! The network has (flow groups + classes) nodes whatever the leaf count: at
//! a million leaves and 4096 ranks it is built in one pass over the leaves
//! and the group entries, and each feasibility test is a small max-flow.

use std::collections::HashMap;

use crate::model::cost::CostModel;
use crate::model::manifest::{Holders, Manifest};

/// The flow network of a manifest's shared leaves over a world.
#[derive(Debug, Clone)]
pub struct HolderFlow {
    /// Demand of each flow group: summed single-piece cost, seconds.
    pub demand: Vec<f64>,
    /// The manifest group of each flow group; `None`: the leaves every rank holds.
    pub source: Vec<Option<u32>>,
    /// The flow group of each manifest group, if it has one (more than one
    /// rank and at least one leaf).
    pub flow_of_group: Vec<Option<u32>>,
    /// The flow group of the leaves every rank holds, if there are any.
    pub all: Option<u32>,
    /// Per flow group, the classes it reaches, ascending.
    pub reach: Vec<Vec<u32>>,
    /// Per class, its ranks, ascending.
    pub class_ranks: Vec<Vec<u32>>,
    /// Per rank, its class.
    pub class_of: Vec<u32>,
}

/// How much each flow group sends to each class it reaches, at one level:
/// `sent[g][i]` goes to class `reach[g][i]`.
pub type Routing = Vec<Vec<f64>>;

impl HolderFlow {
    /// The network of `manifest`'s shared leaves over `world_size` ranks;
    /// `None` when no leaf is held by a group of more than one rank (then
    /// the existing bound terms are exact and nothing here is needed).
    /// Group ranks must be below `world_size` (checked by planning).
    pub fn new(manifest: &Manifest, world_size: u32, cost: &CostModel) -> Option<HolderFlow> {
        let groups = manifest.groups();
        let mut group_demand = vec![0.0f64; groups.len()];
        let mut all_demand = 0.0f64;
        let mut any_group = false;
        for leaf in manifest.leaves() {
            match manifest.holders(leaf) {
                Holders::All => all_demand += cost.piece_cost(leaf.nbytes),
                Holders::Ranks(rs) if rs.len() > 1 => {
                    any_group = true;
                    let g = leaf.holders.expect("several holders are a group") as usize;
                    group_demand[g] += cost.piece_cost(leaf.nbytes);
                }
                Holders::Ranks(_) => {}
            }
        }
        if !any_group {
            return None;
        }
        let mut demand = Vec::new();
        let mut source = Vec::new();
        let mut flow_of_group = vec![None; groups.len()];
        let mut has_leaves = vec![false; groups.len()];
        for leaf in manifest.leaves() {
            if let Some(g) = leaf.holders {
                has_leaves[g as usize] = true;
            }
        }
        for (g, ranks) in groups.iter().enumerate() {
            if ranks.len() > 1 && has_leaves[g] {
                flow_of_group[g] = Some(demand.len() as u32);
                demand.push(group_demand[g]);
                source.push(Some(g as u32));
            }
        }
        let all = manifest
            .leaves()
            .iter()
            .any(|l| l.is_replicated())
            .then(|| {
                demand.push(all_demand);
                source.push(None);
                (demand.len() - 1) as u32
            });
        // Each rank's flow groups (without `all`), ascending: its signature.
        let ws = world_size as usize;
        let mut member: Vec<Vec<u32>> = vec![Vec::new(); ws];
        for (fg, src) in source.iter().enumerate() {
            if let Some(g) = src {
                for &r in groups[*g as usize].iter().filter(|&&r| (r as usize) < ws) {
                    member[r as usize].push(fg as u32);
                }
            }
        }
        let mut classes: HashMap<Vec<u32>, u32> = HashMap::new();
        let mut class_ranks: Vec<Vec<u32>> = Vec::new();
        let mut class_sig: Vec<Vec<u32>> = Vec::new();
        let mut class_of = vec![0u32; ws];
        for (r, sig) in member.into_iter().enumerate() {
            let next = class_ranks.len() as u32;
            let c = *classes.entry(sig.clone()).or_insert(next);
            if c == next {
                class_ranks.push(Vec::new());
                class_sig.push(sig);
            }
            class_ranks[c as usize].push(r as u32);
            class_of[r] = c;
        }
        let mut reach: Vec<Vec<u32>> = vec![Vec::new(); demand.len()];
        for (c, sig) in class_sig.iter().enumerate() {
            for &fg in sig {
                reach[fg as usize].push(c as u32);
            }
            if let Some(a) = all {
                reach[a as usize].push(c as u32);
            }
        }
        Some(HolderFlow {
            demand,
            source,
            flow_of_group,
            all,
            reach,
            class_ranks,
            class_of,
        })
    }

    /// Bound 7 of [`crate::planning::bound`]: index `k` is the least `t` such that
    /// `k` writers can give every group of a *packing* (pairwise disjoint
    /// flow groups, chosen greedily largest demand first, the leaves of every
    /// rank excepted) enough writers that none of them carries more than
    /// `t`: Jefferson's apportionment of `k` writers over the packing's
    /// demands, no group above its size. Infinite below the packing's size
    /// (each of its groups needs a writer of its own), 0 at index 0.
    pub fn packing_levels(&self, manifest: &Manifest, world_size: u32) -> Vec<f64> {
        let ws = world_size as usize;
        let mut order: Vec<usize> = (0..self.demand.len())
            .filter(|&g| self.source[g].is_some())
            .collect();
        order.sort_by(|&a, &b| self.demand[b].total_cmp(&self.demand[a]).then(a.cmp(&b)));
        let mut taken = vec![false; ws];
        let mut packing: Vec<(f64, u32)> = Vec::new();
        for g in order {
            let ranks = &manifest.groups()[self.source[g].expect("a group") as usize];
            if ranks.iter().any(|&r| taken[r as usize]) {
                continue;
            }
            for &r in ranks {
                taken[r as usize] = true;
            }
            packing.push((self.demand[g], ranks.len() as u32));
        }
        let mut out = vec![f64::INFINITY; ws + 1];
        out[0] = 0.0;
        let p = packing.len();
        if p > ws {
            return out;
        }
        let mut seats = vec![1u32; p];
        let mut heap: std::collections::BinaryHeap<(OrdF64, usize)> = packing
            .iter()
            .enumerate()
            .map(|(g, &(d, _))| (OrdF64(d), g))
            .collect();
        let mut floor = 0.0f64;
        for (k, slot) in out.iter_mut().enumerate().skip(p) {
            if k > p {
                // One more writer, to the group with the largest load per writer.
                if let Some((_, g)) = heap.pop() {
                    seats[g] += 1;
                    let (d, size) = packing[g];
                    let load = d / f64::from(seats[g]);
                    if seats[g] < size {
                        heap.push((OrdF64(load), g));
                    } else {
                        floor = floor.max(load);
                    }
                }
            }
            let top = heap.peek().map_or(0.0, |(OrdF64(t), _)| *t);
            *slot = top.max(floor);
        }
        out
    }

    pub fn classes(&self) -> usize {
        self.class_ranks.len()
    }

    pub fn total_demand(&self) -> f64 {
        self.demand.iter().sum()
    }

    /// The maximum flow with class capacities `caps`, and how it is routed.
    pub fn max_flow(&self, caps: &[f64]) -> (f64, Routing) {
        Dinic::new(self, caps).run()
    }

    /// Whether every group can be served with class capacities `caps`.
    pub fn feasible(&self, caps: &[f64]) -> bool {
        let total = self.total_demand();
        let (flow, _) = self.max_flow(caps);
        flow >= total * (1.0 - 1e-12)
    }

    /// The fractional optimum over the ranks `writers` with fixed loads
    /// `owned` (indexed by rank): `(lo, hi)` with `lo` not feasible (or 0)
    /// and `hi` feasible, `hi - lo <= rel * hi`. `hi` is infinite when some
    /// group has no rank among `writers`.
    pub fn level(&self, writers: &[u32], owned: &[f64], rel: f64) -> (f64, f64) {
        let caps = ClassCaps::new(self, writers, owned);
        if self.total_demand() <= 0.0 {
            return (0.0, 0.0);
        }
        let mut lo = 0.0f64;
        // The mean over the writers is a lower bound; start above it.
        let mut hi = caps.mean_level(self.total_demand()).max(f64::MIN_POSITIVE);
        let mut tries = 0;
        while !self.feasible(&caps.at(hi)) {
            lo = hi;
            hi *= 2.0;
            tries += 1;
            if tries > 200 || !hi.is_finite() {
                return (lo, f64::INFINITY);
            }
        }
        while hi - lo > rel * hi {
            let mid = lo + (hi - lo) / 2.0;
            if mid <= lo || mid >= hi {
                break;
            }
            if self.feasible(&caps.at(mid)) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        (lo, hi)
    }

    /// The routing at a feasible level `t` over `writers`.
    pub fn routing(&self, writers: &[u32], owned: &[f64], t: f64) -> Routing {
        let caps = ClassCaps::new(self, writers, owned);
        self.max_flow(&caps.at(t)).1
    }
}

/// An `f64` with a total order, for the heap. Never NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);

impl Eq for OrdF64 {}

impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Per class, the fixed loads of its ranks among some writers, sorted, with
/// prefix sums: its capacity at level `T` is `Σ max(0, T - o_r)`.
pub struct ClassCaps {
    loads: Vec<Vec<f64>>,
    prefix: Vec<Vec<f64>>,
    writers: usize,
    owned_sum: f64,
}

impl ClassCaps {
    pub fn new(flow: &HolderFlow, writers: &[u32], owned: &[f64]) -> ClassCaps {
        let mut loads: Vec<Vec<f64>> = vec![Vec::new(); flow.classes()];
        let mut owned_sum = 0.0;
        for &r in writers {
            loads[flow.class_of[r as usize] as usize].push(owned[r as usize]);
            owned_sum += owned[r as usize];
        }
        let prefix = loads
            .iter_mut()
            .map(|l| {
                l.sort_by(f64::total_cmp);
                let mut acc = 0.0;
                let mut p = vec![0.0];
                for &x in l.iter() {
                    acc += x;
                    p.push(acc);
                }
                p
            })
            .collect();
        ClassCaps {
            loads,
            prefix,
            writers: writers.len(),
            owned_sum,
        }
    }

    /// Each class's capacity at level `t`.
    pub fn at(&self, t: f64) -> Vec<f64> {
        self.loads
            .iter()
            .zip(&self.prefix)
            .map(|(l, p)| {
                let below = l.partition_point(|&x| x < t);
                (below as f64 * t - p[below]).max(0.0)
            })
            .collect()
    }

    /// The level at which the writers' summed capacity is `demand`, if all
    /// of it could go anywhere.
    fn mean_level(&self, demand: f64) -> f64 {
        if self.writers == 0 {
            return f64::INFINITY;
        }
        (demand + self.owned_sum) / self.writers as f64
    }
}

/// Dinic's maximum flow on the layered network source → groups → classes → sink.
struct Dinic {
    /// Per node, its edges (indices into `to`/`cap`).
    adj: Vec<Vec<usize>>,
    to: Vec<usize>,
    cap: Vec<f64>,
    groups: usize,
    /// Per group, the index of its first group→class edge.
    first_edge: Vec<usize>,
    eps: f64,
}

impl Dinic {
    fn new(flow: &HolderFlow, caps: &[f64]) -> Dinic {
        let groups = flow.demand.len();
        let classes = flow.classes();
        let nodes = groups + classes + 2;
        let (source, sink) = (0, nodes - 1);
        let total = flow.total_demand();
        let mut d = Dinic {
            adj: vec![Vec::new(); nodes],
            to: Vec::new(),
            cap: Vec::new(),
            groups,
            first_edge: Vec::with_capacity(groups),
            eps: total * 1e-15,
        };
        for (g, &dem) in flow.demand.iter().enumerate() {
            d.edge(source, 1 + g, dem);
        }
        for (g, reach) in flow.reach.iter().enumerate() {
            d.first_edge.push(d.to.len());
            for &c in reach {
                d.edge(1 + g, 1 + groups + c as usize, total);
            }
        }
        for (c, &cap) in caps.iter().enumerate() {
            d.edge(1 + groups + c, sink, cap);
        }
        d
    }

    fn edge(&mut self, a: usize, b: usize, cap: f64) {
        self.adj[a].push(self.to.len());
        self.to.push(b);
        self.cap.push(cap);
        self.adj[b].push(self.to.len());
        self.to.push(a);
        self.cap.push(0.0);
    }

    fn run(mut self) -> (f64, Routing) {
        let n = self.adj.len();
        let (source, sink) = (0, n - 1);
        let original: Vec<f64> = self.cap.clone();
        let mut total = 0.0;
        let mut level = vec![usize::MAX; n];
        let mut iter = vec![0usize; n];
        loop {
            level.fill(usize::MAX);
            level[source] = 0;
            let mut queue = std::collections::VecDeque::from([source]);
            while let Some(v) = queue.pop_front() {
                for &e in &self.adj[v] {
                    let w = self.to[e];
                    if self.cap[e] > self.eps && level[w] == usize::MAX {
                        level[w] = level[v] + 1;
                        queue.push_back(w);
                    }
                }
            }
            if level[sink] == usize::MAX {
                break;
            }
            iter.fill(0);
            loop {
                let pushed = self.push(source, sink, f64::INFINITY, &level, &mut iter);
                if pushed <= self.eps {
                    break;
                }
                total += pushed;
            }
        }
        let routing = (0..self.groups)
            .map(|g| {
                let first = self.first_edge[g];
                let count = self.adj[1 + g].len() - 1; // less the reverse edge from the source
                (0..count)
                    .map(|i| {
                        let e = first + 2 * i;
                        (original[e] - self.cap[e]).max(0.0)
                    })
                    .collect()
            })
            .collect();
        (total, routing)
    }

    fn push(
        &mut self,
        v: usize,
        sink: usize,
        limit: f64,
        level: &[usize],
        iter: &mut [usize],
    ) -> f64 {
        if v == sink {
            return limit;
        }
        while iter[v] < self.adj[v].len() {
            let e = self.adj[v][iter[v]];
            let w = self.to[e];
            if self.cap[e] > self.eps && level[w] == level[v] + 1 {
                let got = self.push(w, sink, limit.min(self.cap[e]), level, iter);
                if got > self.eps {
                    self.cap[e] -= got;
                    self.cap[e ^ 1] += got;
                    return got;
                }
            }
            iter[v] += 1;
        }
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::manifest::{Leaf, PathKey};

    fn obj(name: &str, bytes: u64, holders: Option<u32>) -> Leaf {
        Leaf::object(vec![PathKey::Str(name.into())], bytes, None)
            .unwrap()
            .with_holders(holders)
    }

    fn bytes_only() -> CostModel {
        CostModel {
            fixed_s: 0.0,
            piece_s: 0.0,
            writer_s: 0.0,
            bandwidth: 1.0,
            ..CostModel::default()
        }
    }

    #[test]
    fn partitioned_groups_and_every_rank() {
        // Two disjoint groups of two ranks, 100 and 20 bytes, and `everyone`
        // bytes on all 4: the network and its level over the whole world.
        let flow_of = |everyone: u64| {
            let m = Manifest::with_groups(
                vec![
                    obj("a", 100, Some(0)),
                    obj("b", 20, Some(1)),
                    obj("c", everyone, None),
                ],
                vec![vec![0, 1], vec![2, 3]],
            )
            .unwrap();
            let f = HolderFlow::new(&m, 4, &bytes_only()).unwrap();
            let level = f.level(&[0, 1, 2, 3], &[0.0; 4], 1e-9);
            (f, level)
        };
        let (f, (lo, hi)) = flow_of(40);
        assert_eq!(f.classes(), 2);
        // max(100 / 2, 160 / 4) = 50.
        assert!(lo <= 50.0 && hi >= 50.0 && hi - 50.0 < 1e-6, "{lo} {hi}");
        // Hall's condition over the union: 40 extra bytes on {2, 3} only fit there.
        let (_, (_, hi)) = flow_of(140);
        assert!((hi - 65.0).abs() < 1e-6, "{hi}");
    }

    #[test]
    fn overlapping_groups() {
        // {0,1} 10 bytes, {1,2} 10 bytes, {0,2} 10 bytes, {3} alone has none: 10 each.
        let m = Manifest::with_groups(
            vec![
                obj("a", 10, Some(0)),
                obj("b", 10, Some(1)),
                obj("c", 10, Some(2)),
            ],
            vec![vec![0, 1], vec![1, 2], vec![0, 2]],
        )
        .unwrap();
        let f = HolderFlow::new(&m, 4, &bytes_only()).unwrap();
        let (_, hi) = f.level(&[0, 1, 2, 3], &[0.0; 4], 1e-9);
        assert!((hi - 10.0).abs() < 1e-6, "{hi}");
        // With rank 2 out, {0,1} takes all 30 bytes (group {1,2} only on 1, {0,2} only on 0).
        let (_, hi) = f.level(&[0, 1, 3], &[0.0; 4], 1e-9);
        assert!((hi - 15.0).abs() < 1e-6, "{hi}");
        // A group without a writer has no feasible level.
        let (_, hi) = f.level(&[0, 3], &[0.0; 4], 1e-9);
        assert!(hi.is_infinite());
    }
}
