//! Property tests of the planner on random manifests, world sizes,
//! topologies and cost models, for every algorithm.
//!
//! The checks here are written independently of the crate's own validation
//! (`validate_assignment`, `evaluate`): coverage is checked leaf by leaf from
//! the raw pieces, and costs are recomputed from the cost model's definition.

use std::collections::HashSet;
use std::sync::Arc;

use deeppart_planner::planning::bound::{lower_bound, LoadSummary};
use deeppart_planner::planning::fingerprint::plan_fingerprint;
use deeppart_planner::{
    plan, Algorithm, CostModel, DType, Grain, Leaf, LeafKind, Manifest, PathKey, Plan, Topology,
};
use proptest::prelude::*;

// ---------------------------------------------------------------------------
// Generators

/// What a leaf is, before a world size fixes its owner.
#[derive(Debug, Clone)]
enum Kind {
    Tensor { dtype: usize, shape: Vec<u64> },
    Object { nbytes: u64 },
}

#[derive(Debug, Clone)]
struct LeafSpec {
    path: Vec<PathKey>,
    kind: Kind,
    /// Reduced modulo the world size when the manifest is built.
    owner: Option<u32>,
}

#[derive(Debug, Clone)]
struct Instance {
    world_size: u32,
    ranks_per_node: u32,
    cost: CostModel,
    leaves: Vec<LeafSpec>,
}

impl Instance {
    /// The manifest; leaves whose path repeats an earlier one are dropped.
    fn manifest(&self) -> Manifest {
        build_manifest(&self.leaves, self.world_size)
    }

    fn topology(&self) -> Topology {
        Topology {
            ranks_per_node: self.ranks_per_node,
        }
    }
}

fn build_manifest(specs: &[LeafSpec], world_size: u32) -> Manifest {
    let mut seen = HashSet::new();
    let mut leaves = Vec::new();
    for spec in specs {
        if !seen.insert(spec.path.clone()) {
            continue;
        }
        let owner = spec.owner.map(|o| o % world_size);
        let leaf = match &spec.kind {
            Kind::Tensor { dtype, shape } => Leaf::tensor(
                spec.path.clone(),
                DType::all()[*dtype],
                shape.clone(),
                owner,
            ),
            Kind::Object { nbytes } => Leaf::object(spec.path.clone(), *nbytes, owner),
        };
        leaves.push(leaf.expect("generated leaves are valid"));
    }
    Manifest::new(leaves).expect("generated manifests are valid")
}

fn path_key() -> impl Strategy<Value = PathKey> {
    prop_oneof![
        prop::sample::select(vec!["model", "optim", "state", "w", "b", "param_groups"])
            .prop_map(|s| PathKey::Str(s.to_string())),
        (-1i64..6).prop_map(PathKey::Int),
    ]
}

/// Paths of 1-4 keys from a small alphabet: they share prefixes, and one
/// path can be a prefix of another (a leaf beside a subtree).
fn path() -> impl Strategy<Value = Vec<PathKey>> {
    prop::collection::vec(path_key(), 1..=4)
}

fn dim() -> impl Strategy<Value = u64> {
    prop_oneof![1 => Just(0u64), 2 => Just(1u64), 4 => 2u64..64, 3 => 64u64..5000]
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        // 0-D to 3-D tensors of any dtype, zero-size ones included.
        4 => (0..DType::all().len(), prop::collection::vec(dim(), 0..=3))
            .prop_map(|(dtype, shape)| Kind::Tensor { dtype, shape }),
        1 => prop_oneof![Just(0u64), 1u64..100, 100u64..10_000_000]
            .prop_map(|nbytes| Kind::Object { nbytes }),
    ]
}

fn leaf_spec() -> impl Strategy<Value = LeafSpec> {
    (path(), kind(), prop::option::weighted(0.15, any::<u32>()))
        .prop_map(|(path, kind, owner)| LeafSpec { path, kind, owner })
}

/// Valid cost models, with the edge values (no fixed, piece or writer cost;
/// `min_piece_bytes` of 1 and of more than any leaf; alignment of 1 byte)
/// well represented, both grains, and shared bandwidths limited or not.
fn cost_model() -> impl Strategy<Value = CostModel> {
    (
        (
            prop_oneof![Just(0.0), 1e-6..1e-2],
            prop_oneof![Just(0.0), 1e-7..1e-3],
            1e6..1e11,
            prop_oneof![Just(0.0), 1e-6..1e-2],
            prop_oneof![
                Just(1u64),
                2u64..(1 << 20),
                Just(1u64 << 20),
                (1u64 << 20)..(1u64 << 42),
                Just(u64::MAX),
            ],
        ),
        shared_storage(),
    )
        .prop_map(
            |(
                (fixed_s, piece_s, bandwidth, writer_s, min_piece_bytes),
                (align_bytes, grain, node_bandwidth, aggregate_bandwidth),
            )| CostModel {
                fixed_s,
                piece_s,
                bandwidth,
                writer_s,
                min_piece_bytes,
                align_bytes,
                grain,
                node_bandwidth,
                aggregate_bandwidth,
            },
        )
}

/// Alignment, grain, and the shared bandwidths (unlimited or not).
fn shared_storage() -> impl Strategy<Value = (u64, Grain, Option<f64>, Option<f64>)> {
    (
        prop_oneof![Just(1u64), Just(4096u64), 1u64..100, Just(1u64 << 20)],
        prop::sample::select(Grain::ALL.to_vec()),
        prop::option::of(1e6..1e11),
        prop::option::of(1e6..1e12),
    )
}

/// A world size of 1 to 64 and a `ranks_per_node` that divides it.
fn world() -> impl Strategy<Value = (u32, u32)> {
    (1u32..=64).prop_flat_map(|ws| {
        let divisors: Vec<u32> = (1..=ws).filter(|d| ws % d == 0).collect();
        (Just(ws), prop::sample::select(divisors))
    })
}

fn instance(max_leaves: usize) -> impl Strategy<Value = Instance> {
    (
        world(),
        cost_model(),
        prop::collection::vec(leaf_spec(), 0..=max_leaves),
    )
        .prop_map(|((world_size, ranks_per_node), cost, leaves)| Instance {
            world_size,
            ranks_per_node,
            cost,
            leaves,
        })
}

// ---------------------------------------------------------------------------
// Independent checks

/// Units per row computed from the shape (not `Leaf::row_units`).
fn row_units_of(leaf: &Leaf) -> u64 {
    match &leaf.kind {
        LeafKind::Tensor { shape, .. } if shape.len() >= 2 => shape[1..]
            .iter()
            .map(|&d| d as u128)
            .product::<u128>()
            .clamp(1, u64::MAX as u128)
            as u64,
        _ => 1,
    }
}

/// Whether unit `u` of `leaf` is a legal cut position, from the cost
/// model's definition (not `CostModel::grain_units`).
fn legal_cut(leaf: &Leaf, cost: &CostModel, u: u64) -> bool {
    match &leaf.kind {
        LeafKind::Object => false,
        LeafKind::Tensor { dtype, .. } => match cost.grain {
            Grain::Row => u % row_units_of(leaf) == 0,
            Grain::Element => {
                (u as u128 * dtype.itemsize() as u128) % cost.align_bytes as u128 == 0
            }
        },
    }
}

fn units_of(leaf: &Leaf) -> u64 {
    match &leaf.kind {
        LeafKind::Tensor { shape, .. } => shape.iter().product(),
        LeafKind::Object => 1,
    }
}

fn bytes_of(leaf: &Leaf, start: u64, stop: u64) -> u64 {
    match &leaf.kind {
        LeafKind::Tensor { dtype, .. } => (stop - start) * dtype.itemsize(),
        LeafKind::Object => leaf.nbytes,
    }
}

/// Checks that `ranks` writes every unit of every leaf exactly once, owned
/// leaves on their owner, in-bounds, non-empty legal pieces (cut on the
/// grain, at least `min_piece_bytes` unless whole); returns the makespan
/// recomputed from the cost model's definition.
fn check_assignment(
    m: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    ranks: &[Vec<deeppart_planner::Piece>],
) -> Result<f64, String> {
    if ranks.len() != world_size as usize {
        return Err(format!(
            "{} rank lists for world size {world_size}",
            ranks.len()
        ));
    }
    let leaves = m.leaves();
    let mut by_leaf: Vec<Vec<(u64, u64, usize)>> = vec![Vec::new(); leaves.len()];
    let mut slowest: f64 = 0.0;
    let mut writers = 0u32;
    let mut node_bytes = vec![0u64; (world_size / topology.ranks_per_node) as usize];
    for (r, list) in ranks.iter().enumerate() {
        let mut c = cost.fixed_s;
        for p in list {
            let leaf = leaves
                .get(p.leaf as usize)
                .ok_or(format!("rank {r}: no leaf {}", p.leaf))?;
            let units = units_of(leaf);
            if p.start > p.stop || p.stop > units {
                return Err(format!(
                    "rank {r}: piece {p:?} out of bounds of {units} units"
                ));
            }
            if p.start == p.stop && units > 0 {
                return Err(format!("rank {r}: empty piece {p:?}"));
            }
            if !m.holders(leaf).contains(r as u32) {
                return Err(format!(
                    "leaf {} ({}) planned on rank {r}, which does not hold it",
                    p.leaf,
                    leaf.display_path()
                ));
            }
            if let Some(owner) = leaf.owner {
                if owner as usize != r {
                    return Err(format!(
                        "leaf {} owned by {owner} planned on rank {r}",
                        p.leaf
                    ));
                }
            }
            let whole = p.start == 0 && p.stop == units;
            if !whole {
                for u in [p.start, p.stop] {
                    if u != 0 && u != units && !legal_cut(leaf, cost, u) {
                        return Err(format!(
                            "piece {p:?} of leaf {} ({:?}) cut off the {:?} grain at {u}",
                            p.leaf, leaf.kind, cost.grain
                        ));
                    }
                }
                if bytes_of(leaf, p.start, p.stop) < cost.min_piece_bytes {
                    return Err(format!(
                        "piece {p:?} of leaf {} is smaller than min_piece_bytes {}",
                        p.leaf, cost.min_piece_bytes
                    ));
                }
            }
            by_leaf[p.leaf as usize].push((p.start, p.stop, r));
            let bytes = bytes_of(leaf, p.start, p.stop);
            node_bytes[r / topology.ranks_per_node as usize] += bytes;
            c += cost.piece_s + bytes as f64 / cost.bandwidth;
        }
        if !list.is_empty() {
            writers += 1;
            slowest = slowest.max(c);
        }
    }
    for (i, pieces) in by_leaf.iter_mut().enumerate() {
        let units = units_of(&leaves[i]);
        pieces.sort_unstable();
        if pieces.is_empty() {
            return Err(format!("leaf {i} is not written"));
        }
        if units == 0 {
            if pieces.len() != 1 {
                return Err(format!("empty leaf {i} written {} times", pieces.len()));
            }
            continue;
        }
        let mut at = 0;
        for &(start, stop, r) in pieces.iter() {
            if start != at {
                return Err(format!(
                    "leaf {i}: rank {r} writes [{start}, {stop}) but unit {at} is next"
                ));
            }
            at = stop;
        }
        if at != units {
            return Err(format!("leaf {i}: written up to {at} of {units} units"));
        }
    }
    Ok(shared_makespan(cost, slowest, &node_bytes, writers))
}

/// The model's makespan from the slowest rank's cost, the bytes per node
/// and the writer count.
fn shared_makespan(cost: &CostModel, slowest: f64, node_bytes: &[u64], writers: u32) -> f64 {
    let mut t = slowest;
    let busiest = node_bytes.iter().copied().max().unwrap_or(0);
    let total: u64 = node_bytes.iter().sum();
    if let Some(nu) = cost.node_bandwidth {
        if busiest > 0 {
            t = t.max(cost.fixed_s + busiest as f64 / nu);
        }
    }
    if let Some(alpha) = cost.aggregate_bandwidth {
        if total > 0 {
            t = t.max(cost.fixed_s + total as f64 / alpha);
        }
    }
    t + writers as f64 * cost.writer_s
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-15
}

fn check_plan(
    inst: &Instance,
    manifest: &Arc<Manifest>,
    algorithm: Algorithm,
) -> Result<Plan, TestCaseError> {
    let p = plan(
        manifest.clone(),
        inst.world_size as u64,
        inst.topology(),
        inst.cost,
        algorithm,
    )
    .map_err(|e| TestCaseError::fail(format!("{algorithm}: {e}")))?;
    let makespan = check_assignment(
        manifest,
        inst.world_size,
        &inst.topology(),
        &inst.cost,
        &p.ranks,
    )
    .map_err(|e| TestCaseError::fail(format!("{algorithm}: {e}")))?;
    let s = &p.stats;
    prop_assert!(
        close(makespan, s.makespan_s),
        "{algorithm}: makespan {makespan} vs stats {s:?}"
    );
    prop_assert!(
        s.makespan_s >= s.lower_bound_s * (1.0 - 1e-9),
        "{algorithm}: makespan below the lower bound: {s:?}"
    );
    let pieces: usize = p.ranks.iter().map(Vec::len).sum();
    prop_assert_eq!(s.pieces, pieces as u64);
    prop_assert_eq!(s.splits, pieces as u64 - manifest.len() as u64);
    prop_assert_eq!(
        s.writers as usize,
        p.ranks.iter().filter(|l| !l.is_empty()).count()
    );
    for list in &p.ranks {
        prop_assert!(
            list.windows(2).all(|w| w[0] < w[1]),
            "{algorithm}: rank pieces not sorted"
        );
    }
    Ok(p)
}

// ---------------------------------------------------------------------------
// Properties

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Every algorithm gives a valid, deterministic plan that never beats
    /// the lower bound, and the plan survives a JSON round trip.
    #[test]
    fn every_algorithm_gives_a_valid_deterministic_plan(inst in instance(40)) {
        let manifest = Arc::new(inst.manifest());
        // An equal manifest built separately: determinism may not hinge on
        // sharing the same allocation.
        let twin = Arc::new(inst.manifest());
        for algorithm in Algorithm::ALL {
            let p = check_plan(&inst, &manifest, algorithm)?;
            let again = plan(twin.clone(), inst.world_size as u64, inst.topology(), inst.cost, algorithm).unwrap();
            prop_assert_eq!(&again.ranks, &p.ranks, "{} is not deterministic", algorithm);
            prop_assert_eq!(&again.fingerprint, &p.fingerprint);
            prop_assert_eq!(again.assignment_digest(), p.assignment_digest());
            prop_assert_eq!(again.stats.makespan_s, p.stats.makespan_s);
            // Moving one piece to another rank keeps the fingerprint (same
            // inputs) but must change the assignment digest.
            if let Some(from) = p.ranks.iter().position(|r| !r.is_empty()) {
                if p.ranks.len() > 1 {
                    let mut moved = p.clone();
                    let piece = moved.ranks[from].pop().unwrap();
                    let to = (from + 1) % moved.ranks.len();
                    moved.ranks[to].push(piece);
                    prop_assert_ne!(moved.assignment_digest(), p.assignment_digest());
                }
            }

            let back = Plan::from_json(&p.to_json())
                .map_err(|e| TestCaseError::fail(format!("{algorithm}: JSON round trip: {e}")))?;
            prop_assert_eq!(&back.ranks, &p.ranks);
            prop_assert_eq!(&back.fingerprint, &p.fingerprint);
            prop_assert_eq!(&*back.manifest, &*p.manifest);
            prop_assert_eq!(back.world_size, p.world_size);
            prop_assert_eq!(back.topology, p.topology);
            prop_assert_eq!(back.cost, p.cost);
            prop_assert_eq!(back.algorithm, p.algorithm);
            prop_assert_eq!(back.stats.makespan_s, p.stats.makespan_s);
            prop_assert_eq!(back.stats.lower_bound_s, p.stats.lower_bound_s);
        }
    }

    /// Same, on few leaves over many ranks, where most ranks write nothing.
    #[test]
    fn few_leaves_on_many_ranks(inst in instance(3)) {
        let manifest = Arc::new(inst.manifest());
        for algorithm in Algorithm::ALL {
            check_plan(&inst, &manifest, algorithm)?;
        }
    }

    /// The fingerprint changes with the world size, every cost parameter
    /// (down to the last bit), the topology, the algorithm and every leaf.
    #[test]
    fn fingerprint_changes_with_every_input(
        inst in instance(12),
        algorithm in prop::sample::select(Algorithm::ALL.to_vec()),
    ) {
        let m = inst.manifest();
        let ws = inst.world_size;
        let topo = inst.topology();
        let cost = inst.cost;
        let base = plan_fingerprint(&m, ws, &topo, &cost, algorithm);
        let planned = plan(Arc::new(m.clone()), ws as u64, topo, cost, algorithm).unwrap();
        prop_assert_eq!(&planned.fingerprint, &base);
        prop_assert_eq!(&plan_fingerprint(&inst.manifest(), ws, &topo, &cost, algorithm), &base);

        let next_up = |v: f64| f64::from_bits(v.to_bits() + 1);
        let mut variants: Vec<(String, String)> = vec![
            ("world size".into(), plan_fingerprint(&m, ws + 1, &topo, &cost, algorithm)),
            ("topology".into(), plan_fingerprint(&m, ws, &Topology { ranks_per_node: topo.ranks_per_node + 1 }, &cost, algorithm)),
        ];
        let costs = [
            ("fixed_s", CostModel { fixed_s: next_up(cost.fixed_s), ..cost }),
            ("piece_s", CostModel { piece_s: next_up(cost.piece_s), ..cost }),
            ("bandwidth", CostModel { bandwidth: next_up(cost.bandwidth), ..cost }),
            ("writer_s", CostModel { writer_s: next_up(cost.writer_s), ..cost }),
            ("min_piece_bytes", CostModel { min_piece_bytes: cost.min_piece_bytes ^ 1, ..cost }),
            ("align_bytes", CostModel { align_bytes: cost.align_bytes ^ 1, ..cost }),
            ("grain", CostModel { grain: if cost.grain == Grain::Row { Grain::Element } else { Grain::Row }, ..cost }),
            ("node_bandwidth", CostModel { node_bandwidth: Some(cost.node_bandwidth.map_or(1e9, next_up)), ..cost }),
            ("aggregate_bandwidth", CostModel { aggregate_bandwidth: Some(cost.aggregate_bandwidth.map_or(1e9, next_up)), ..cost }),
        ];
        for (name, c) in costs {
            variants.push((name.into(), plan_fingerprint(&m, ws, &topo, &c, algorithm)));
        }
        for other in Algorithm::ALL.into_iter().filter(|&a| a != algorithm) {
            variants.push((format!("algorithm {other}"), plan_fingerprint(&m, ws, &topo, &cost, other)));
        }
        for (i, leaf) in m.leaves().iter().enumerate() {
            for (what, changed) in leaf_variants(leaf) {
                let mut leaves = m.leaves().to_vec();
                leaves[i] = changed;
                let changed = Manifest::new(leaves).expect("variant manifest is valid");
                variants.push((format!("leaf {i}: {what}"), plan_fingerprint(&changed, ws, &topo, &cost, algorithm)));
            }
        }
        let mut seen = HashSet::new();
        for (what, fp) in &variants {
            prop_assert_ne!(fp, &base, "fingerprint unchanged by {}", what);
            prop_assert!(seen.insert(fp.clone()), "two variants share a fingerprint ({})", what);
        }
    }
}

/// One-change variants of a leaf, each still a valid leaf with a path no
/// generated leaf has.
fn leaf_variants(leaf: &Leaf) -> Vec<(&'static str, Leaf)> {
    let mut out = Vec::new();
    let mut longer = leaf.path.clone();
    longer.push(PathKey::Str("~".into()));
    out.push((
        "path extended",
        Leaf {
            path: longer,
            ..leaf.clone()
        },
    ));
    let mut renamed = leaf.path.clone();
    *renamed.last_mut().unwrap() = match renamed.last().unwrap() {
        PathKey::Str(s) => PathKey::Str(format!("{s}~")),
        PathKey::Int(i) => PathKey::Str(i.to_string()),
    };
    out.push((
        "last key",
        Leaf {
            path: renamed,
            ..leaf.clone()
        },
    ));
    let owner = match leaf.owner {
        None => Some(0),
        Some(0) => None,
        Some(o) => Some(o - 1),
    };
    out.push((
        "owner",
        Leaf {
            owner,
            ..leaf.clone()
        },
    ));
    match &leaf.kind {
        LeafKind::Tensor { dtype, shape } => {
            // A dtype of the same size: only the name differs.
            let same_size = DType::all()
                .iter()
                .copied()
                .find(|d| d != dtype && d.itemsize() == dtype.itemsize());
            if let Some(d) = same_size {
                out.push((
                    "dtype",
                    Leaf::tensor(leaf.path.clone(), d, shape.clone(), leaf.owner).unwrap(),
                ));
            }
            // A trailing dimension of 1: same bytes, different shape.
            let mut wider = shape.clone();
            wider.push(1);
            out.push((
                "shape rank",
                Leaf::tensor(leaf.path.clone(), *dtype, wider, leaf.owner).unwrap(),
            ));
            if let Some(first) = shape.first() {
                let mut grown = shape.clone();
                grown[0] = first + 1;
                if let Ok(l) = Leaf::tensor(leaf.path.clone(), *dtype, grown, leaf.owner) {
                    out.push(("first dimension", l));
                }
            }
            out.push((
                "to object",
                Leaf::object(leaf.path.clone(), leaf.nbytes, leaf.owner).unwrap(),
            ));
        }
        LeafKind::Object => {
            out.push((
                "nbytes",
                Leaf::object(leaf.path.clone(), leaf.nbytes + 1, leaf.owner).unwrap(),
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------
// Soundness of the lower bound against brute force

/// A tiny leaf for exhaustive search: bytes per unit and unit count (an
/// object is one unit holding all its bytes), and an owner.
#[derive(Debug, Clone)]
struct Tiny {
    spec: LeafSpec,
}

/// The optimum makespan over every legal plan, by enumerating which rank
/// writes each unit (and each empty tensor). Pieces are the maximal runs of
/// one rank within a leaf: merging legal neighbours gives a legal piece and
/// never costs more, so the optimum is among these; an assignment whose
/// runs are not legal pieces is skipped.
fn brute_force_optimum(
    m: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
) -> f64 {
    // One slot per unit of each leaf; a leaf of no units still needs a writer.
    let mut slots: Vec<(usize, u64)> = Vec::new();
    for (i, leaf) in m.leaves().iter().enumerate() {
        for u in 0..units_of(leaf).max(1) {
            slots.push((i, u));
        }
    }
    let mut choice = vec![0u32; slots.len()];
    let mut best = f64::INFINITY;
    loop {
        if legal_runs(m, cost, &slots, &choice) {
            let mut rank_cost = vec![0.0f64; world_size as usize];
            let mut writes = vec![false; world_size as usize];
            let mut node_bytes = vec![0u64; (world_size / topology.ranks_per_node) as usize];
            for (k, &(i, _)) in slots.iter().enumerate() {
                let leaf = &m.leaves()[i];
                let r = choice[k] as usize;
                writes[r] = true;
                let unit_bytes = if units_of(leaf) == 0 {
                    0
                } else {
                    bytes_of(leaf, 0, 1)
                };
                rank_cost[r] += unit_bytes as f64 / cost.bandwidth;
                node_bytes[r / topology.ranks_per_node as usize] += unit_bytes;
                // A new piece starts unless the previous unit of this leaf is on the same rank.
                let continues = k > 0 && slots[k - 1].0 == i && choice[k - 1] as usize == r;
                if !continues {
                    rank_cost[r] += cost.piece_s;
                }
            }
            let writers = writes.iter().filter(|&&w| w).count();
            let slowest = rank_cost
                .iter()
                .zip(&writes)
                .filter(|(_, &w)| w)
                .map(|(&c, _)| c + cost.fixed_s)
                .fold(0.0, f64::max);
            best = best.min(shared_makespan(cost, slowest, &node_bytes, writers as u32));
        }
        // Next assignment, odometer style.
        let mut k = 0;
        loop {
            if k == choice.len() {
                return if best.is_finite() { best } else { 0.0 };
            }
            choice[k] += 1;
            if choice[k] < world_size {
                break;
            }
            choice[k] = 0;
            k += 1;
        }
    }
}

/// Whether every owned unit is on its owner and every maximal run of one
/// rank within a leaf is a legal piece.
fn legal_runs(m: &Manifest, cost: &CostModel, slots: &[(usize, u64)], choice: &[u32]) -> bool {
    let mut k = 0;
    while k < slots.len() {
        let i = slots[k].0;
        let leaf = &m.leaves()[i];
        if matches!(leaf.owner, Some(o) if o != choice[k]) || !m.holders(leaf).contains(choice[k]) {
            return false;
        }
        let units = units_of(leaf);
        let start = k;
        while k < slots.len() && slots[k].0 == i && choice[k] == choice[start] {
            k += 1;
        }
        let (lo, hi) = (slots[start].1, slots[k - 1].1 + 1);
        let whole = lo == 0 && hi >= units;
        if !whole {
            if (lo != 0 && !legal_cut(leaf, cost, lo))
                || (hi != units && !legal_cut(leaf, cost, hi))
            {
                return false;
            }
            if bytes_of(leaf, lo, hi) < cost.min_piece_bytes {
                return false;
            }
        }
    }
    true
}

fn tiny_object() -> impl Strategy<Value = Tiny> {
    (
        prop_oneof![Just(0u64), 1u64..1000, 1000u64..100_000_000],
        prop::option::weighted(0.2, 0u32..3),
    )
        .prop_map(|(nbytes, owner)| Tiny {
            spec: LeafSpec {
                path: vec![],
                kind: Kind::Object { nbytes },
                owner,
            },
        })
}

/// 0-D, empty and small tensors of up to 3 dimensions (coarse rows
/// included, like `[2, 1, 2]`), and objects.
fn tiny_leaf() -> impl Strategy<Value = Tiny> {
    prop_oneof![
        1 => tiny_object(),
        3 => (
            0..DType::all().len(),
            prop::collection::vec(0u64..=2, 0..=3).prop_filter("at most 4 units", |s| s.iter().product::<u64>() <= 4),
            prop::option::weighted(0.2, 0u32..4),
        )
            .prop_map(|(dtype, shape, owner)| Tiny { spec: LeafSpec { path: vec![], kind: Kind::Tensor { dtype, shape }, owner } }),
    ]
}

/// Cost models for tiny instances: a minimum piece and an alignment of a
/// few bytes, so that both matter at this size.
fn tiny_cost_model() -> impl Strategy<Value = CostModel> {
    (
        cost_model(),
        1u64..=24,
        prop_oneof![Just(1u64), Just(2), Just(4), Just(8), Just(16), 1u64..=12],
    )
        .prop_map(|(c, min_piece_bytes, align_bytes)| CostModel {
            min_piece_bytes,
            align_bytes,
            ..c
        })
}

/// A world of 1 to 4 ranks and a `ranks_per_node` that divides it.
fn tiny_world() -> impl Strategy<Value = (u32, u32)> {
    (1u32..=4).prop_flat_map(|ws| {
        let divisors: Vec<u32> = (1..=ws).filter(|d| ws % d == 0).collect();
        (Just(ws), prop::sample::select(divisors))
    })
}

fn tiny_manifest(leaves: &[Tiny], world_size: u32) -> Manifest {
    let specs: Vec<LeafSpec> = leaves
        .iter()
        .enumerate()
        .map(|(i, t)| LeafSpec {
            path: vec![PathKey::Int(i as i64)],
            ..t.spec.clone()
        })
        .collect();
    build_manifest(&specs, world_size)
}

fn check_bound_against_optimum(
    m: Manifest,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
) -> Result<(), TestCaseError> {
    let slots: u64 = m.leaves().iter().map(|l| units_of(l).max(1)).sum();
    prop_assume!(slots <= 9);
    let optimum = brute_force_optimum(&m, world_size, &topology, &cost);
    let summary = LoadSummary::new(&m, world_size, &topology, &cost);
    let lb = lower_bound(&summary, &cost, world_size);
    prop_assert!(
        lb.makespan_s <= optimum * (1.0 + 1e-9) + 1e-15,
        "lower bound {} above the optimum {optimum}",
        lb.makespan_s
    );
    // Every algorithm's plan is one of the enumerated ones: none beats the optimum.
    let m = Arc::new(m);
    for algorithm in Algorithm::ALL {
        if algorithm == Algorithm::DeepPart && m.uses_groups() {
            // It refuses holder groups (tested in the planner's unit tests).
            continue;
        }
        let p = plan(m.clone(), world_size as u64, topology, cost, algorithm).unwrap();
        check_assignment(&m, world_size, &topology, &cost, &p.ranks)
            .map_err(|e| TestCaseError::fail(format!("{algorithm}: {e}")))?;
        prop_assert!(
            p.stats.makespan_s >= optimum * (1.0 - 1e-9) - 1e-15,
            "{algorithm}: makespan {} below the brute-force optimum {optimum}",
            p.stats.makespan_s
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Objects only (no splitting): the bound is at most the true optimum.
    #[test]
    fn lower_bound_is_at_most_the_optimum_for_objects(
        objects in prop::collection::vec(tiny_object(), 0..=5),
        (world_size, ranks_per_node) in tiny_world(),
        cost in cost_model(),
    ) {
        let topology = Topology { ranks_per_node };
        check_bound_against_optimum(tiny_manifest(&objects, world_size), world_size, topology, cost)?;
    }

    /// With tensors that can be split on their grain (coarse 3-D rows
    /// included), empty tensors and 0-D ones, shared bandwidths and
    /// topologies: still at most the optimum over legal plans.
    #[test]
    fn lower_bound_is_at_most_the_optimum_with_splits(
        leaves in prop::collection::vec(tiny_leaf(), 0..=4),
        (world_size, ranks_per_node) in tiny_world(),
        cost in tiny_cost_model(),
    ) {
        let topology = Topology { ranks_per_node };
        check_bound_against_optimum(tiny_manifest(&leaves, world_size), world_size, topology, cost)?;
    }

    /// The lower bound never rises with the world size: more ranks can
    /// always leave the extra ones idle. (The `balanced` plan's modelled time
    /// is not yet monotone in general: it fixes the writer count the bound
    /// chooses, and with more nodes the bound may choose fewer writers than
    /// the plan needs; see the `more_ranks_never_overshoot_the_level` test
    /// for the case that the level bisection fixed.)
    #[test]
    fn lower_bound_is_non_increasing_in_world_size(
        leaves in prop::collection::vec(leaf_spec(), 0..=30),
        ranks_per_node in prop_oneof![Just(1u32), Just(2), Just(8)],
        nodes in 1u32..=8,
        more_nodes in 1u32..=64,
        cost in cost_model(),
    ) {
        let small = nodes * ranks_per_node;
        let large = (nodes + more_nodes) * ranks_per_node;
        let topology = Topology { ranks_per_node };
        // Owners within the smaller world, so that both worlds hold the same manifest.
        let m = Arc::new(build_manifest(&leaves, small));
        let a = plan(m.clone(), small as u64, topology, cost, Algorithm::Balanced).unwrap();
        let b = plan(m.clone(), large as u64, topology, cost, Algorithm::Balanced).unwrap();
        prop_assert!(
            b.stats.lower_bound_s <= a.stats.lower_bound_s * (1.0 + 1e-12),
            "bound rose from {} at {small} ranks to {} at {large}", a.stats.lower_bound_s, b.stats.lower_bound_s
        );
    }
}

/// Coarse 3-D tensors, like a Mixture-of-Experts layer's stacked experts
/// `[experts, 2 x intermediate, hidden]`: few, large dim-0 rows.
fn coarse_leaf_spec() -> impl Strategy<Value = LeafSpec> {
    (
        path(),
        0..DType::all().len(),
        1u64..=16,
        64u64..5000,
        64u64..5000,
        prop::option::weighted(0.1, any::<u32>()),
    )
        .prop_map(|(path, dtype, e, a, b, owner)| LeafSpec {
            path,
            kind: Kind::Tensor {
                dtype,
                shape: vec![e, a, b],
            },
            owner,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// A planner that chooses its writers is never slower with more ranks:
    /// the ranks of the smaller world are all there, and `balanced` tries
    /// every writer set a smaller world would try. Exact, not within a
    /// tolerance: the same writer set gives the same plan, bit for bit.
    #[test]
    fn modelled_time_is_non_increasing_in_world_size(
        leaves in prop::collection::vec(prop_oneof![3 => leaf_spec(), 1 => coarse_leaf_spec()], 0..=30),
        ranks_per_node in prop_oneof![Just(1u32), Just(8)],
        nodes in 1u32..=8,
        more_nodes in prop::collection::vec(1u32..=40, 1..=2),
        cost in cost_model(),
    ) {
        let topology = Topology { ranks_per_node };
        let mut worlds = vec![nodes * ranks_per_node];
        let mut total = nodes;
        for more in more_nodes {
            total += more;
            worlds.push(total * ranks_per_node);
        }
        // Owners within the smallest world, so that every world holds the same manifest.
        let m = Arc::new(build_manifest(&leaves, worlds[0]));
        let times: Vec<f64> = worlds
            .iter()
            .map(|&p| plan(m.clone(), p as u64, topology, cost, Algorithm::Balanced).unwrap().stats.makespan_s)
            .collect();
        for i in 1..times.len() {
            prop_assert!(
                times[i] <= times[i - 1],
                "modelled time rose from {} at {} ranks to {} at {} ranks ({worlds:?}: {times:?})",
                times[i - 1], worlds[i - 1], times[i], worlds[i]
            );
        }
    }
}

/// Two unsplittable values and a node bandwidth: the level the plan needs
/// (the larger value's time) lies far above the bound. Trying levels in
/// doublings from the bound used to stop above it at 30 nodes, where one
/// writer then took both values (4.36 s), while 5 nodes landed where two
/// writers shared them (2.47 s). The bisection finds the same level for both.
#[test]
fn more_ranks_never_overshoot_the_level() {
    let m = Arc::new(
        Manifest::new(vec![
            Leaf::object(vec![PathKey::Str("state".into())], 1_883_515, None).unwrap(),
            Leaf::object(vec![PathKey::Str("optim".into())], 2_474_120, None).unwrap(),
        ])
        .unwrap(),
    );
    let cost = CostModel {
        fixed_s: 0.0,
        piece_s: 0.0,
        writer_s: 0.0,
        min_piece_bytes: 1,
        align_bytes: 1,
        node_bandwidth: Some(1e6),
        ..CostModel::default()
    };
    let topology = Topology { ranks_per_node: 1 };
    let times: Vec<f64> = [2u64, 5, 30, 64]
        .iter()
        .map(|&p| {
            plan(m.clone(), p, topology, cost, Algorithm::Balanced)
                .unwrap()
                .stats
                .makespan_s
        })
        .collect();
    for t in &times {
        assert!((t - 2.47412).abs() < 1e-3, "{times:?}");
    }
}

// ---------------------------------------------------------------------------
// Regressions

fn path1(s: &str) -> Vec<PathKey> {
    vec![PathKey::Str(s.into())]
}

/// Found by fuzzing: an empty tensor whose rows are wider than 2^64 bytes
/// made `balanced` overflow computing the row size.
#[test]
fn empty_tensor_with_huge_rows_plans() {
    let m = Manifest::new(vec![
        Leaf::tensor(
            path1("e"),
            DType::Float32,
            vec![0, 11529215046068469763],
            None,
        )
        .unwrap(),
        Leaf::tensor(path1("f"), DType::Float64, vec![0, 1 << 40, 1 << 40], None).unwrap(),
        Leaf::tensor(path1("h"), DType::Float16, vec![1_500_000], None).unwrap(),
    ])
    .unwrap();
    let m = Arc::new(m);
    for algorithm in Algorithm::ALL {
        let p = plan(
            m.clone(),
            5,
            Topology::default(),
            CostModel::default(),
            algorithm,
        )
        .unwrap();
        check_assignment(&m, 5, &Topology::default(), &CostModel::default(), &p.ranks).unwrap();
    }
}

/// `deeppart` recursed without end on sibling leaves that are all empty.
#[test]
fn deeppart_handles_all_empty_siblings() {
    let m = Manifest::new(vec![
        Leaf::tensor(path1("a"), DType::Float32, vec![0, 3], None).unwrap(),
        Leaf::object(path1("b"), 0, None).unwrap(),
        Leaf::tensor(
            vec![PathKey::Str("c".into()), PathKey::Int(0)],
            DType::Int8,
            vec![0],
            None,
        )
        .unwrap(),
    ])
    .unwrap();
    let m = Arc::new(m);
    let cost = CostModel::default();
    for ws in [1, 2, 3, 8] {
        let p = plan(
            m.clone(),
            ws,
            Topology::default(),
            cost,
            Algorithm::DeepPart,
        )
        .unwrap();
        check_assignment(&m, ws as u32, &Topology::default(), &cost, &p.ranks).unwrap();
    }
}

/// `deeppart`'s even split of one tensor multiplied rows by the part count
/// in 64 bits, which overflows for huge tensors on many ranks.
#[test]
fn deeppart_splits_a_huge_tensor_over_many_ranks() {
    let m = Arc::new(
        Manifest::new(vec![Leaf::tensor(
            path1("w"),
            DType::UInt8,
            vec![1 << 50],
            None,
        )
        .unwrap()])
        .unwrap(),
    );
    let cost = CostModel::default();
    let p = plan(
        m.clone(),
        1 << 16,
        Topology::default(),
        cost,
        Algorithm::DeepPart,
    )
    .unwrap();
    check_assignment(&m, 1 << 16, &Topology::default(), &cost, &p.ranks).unwrap();
    assert_eq!(p.stats.writers, 1 << 16);
}

/// Found by the JSON round-trip property: without serde_json's
/// `float_roundtrip`, `0.0073255869059962965` read back one bit off, so a
/// plan read from its own JSON failed its fingerprint check.
#[test]
fn plan_json_keeps_cost_parameters_bit_for_bit() {
    let m = Arc::new(Manifest::new(vec![Leaf::object(path1("a"), 10, None).unwrap()]).unwrap());
    let cost = CostModel {
        writer_s: 0.0073255869059962965,
        fixed_s: 0.1 + 0.2,
        ..CostModel::default()
    };
    let p = plan(m, 3, Topology::default(), cost, Algorithm::Balanced).unwrap();
    let back = Plan::from_json(&p.to_json()).unwrap();
    assert_eq!(back.cost.writer_s.to_bits(), cost.writer_s.to_bits());
    assert_eq!(back.cost.fixed_s.to_bits(), cost.fixed_s.to_bits());
    assert_eq!(back.fingerprint, p.fingerprint);
}

/// Found by `modelled_time_is_non_increasing_in_world_size`: two owned
/// scalars on node 0 and one replicated 3-D tensor, eight ranks per node,
/// a node bandwidth below eight ranks' bandwidth.
#[test]
fn a_second_node_never_slows_an_owned_and_replicated_state() {
    let m = Arc::new(
        Manifest::new(vec![
            Leaf::tensor(path1("model"), DType::all()[0], vec![], Some(4)).unwrap(),
            Leaf::tensor(path1("optim"), DType::all()[0], vec![], Some(5)).unwrap(),
            Leaf::tensor(path1("state"), DType::all()[0], vec![1, 1854, 1197], None).unwrap(),
        ])
        .unwrap(),
    );
    let cost = CostModel {
        fixed_s: 0.0,
        piece_s: 0.0,
        bandwidth: 40171896241.52521,
        writer_s: 0.0,
        min_piece_bytes: 1,
        align_bytes: 1,
        grain: Grain::Element,
        node_bandwidth: Some(76256572187.83295),
        aggregate_bandwidth: None,
    };
    let topology = Topology { ranks_per_node: 8 };
    let t8 = plan(m.clone(), 8, topology, cost, Algorithm::Balanced).unwrap();
    let t16 = plan(m.clone(), 16, topology, cost, Algorithm::Balanced).unwrap();
    assert!(
        t16.stats.makespan_s <= t8.stats.makespan_s,
        "{:?} vs {:?}",
        t8.stats,
        t16.stats
    );
}

// ----------------------------------------------------------------------------
// Holder groups: random, overlapping, non-laminar holder sets.

/// `leaves` with holder groups: each of `groups` (rank bitmasks, reduced to
/// the world and made non-empty) becomes a group; leaf `i` without an owner
/// is held by group `pick[i] % (groups + 1)`, the last choice meaning every rank.
fn grouped_manifest(
    leaves: &[LeafSpec],
    world_size: u32,
    groups: &[u32],
    pick: &[usize],
) -> Manifest {
    let plain = build_manifest(leaves, world_size);
    let mut sets: Vec<Vec<u32>> = groups
        .iter()
        .map(|&mask| {
            let set: Vec<u32> = (0..world_size)
                .filter(|r| mask & (1 << (r % 32)) != 0)
                .collect();
            if set.is_empty() {
                vec![mask % world_size]
            } else {
                set
            }
        })
        .collect();
    sets.dedup();
    let n = sets.len() + 1;
    let leaves: Vec<Leaf> = plain
        .leaves()
        .iter()
        .enumerate()
        .map(|(i, l)| {
            let g = pick.get(i).copied().unwrap_or(0) % n;
            if l.owner.is_none() && g < sets.len() {
                l.clone().with_holders(Some(g as u32))
            } else {
                l.clone()
            }
        })
        .collect();
    Manifest::with_groups(leaves, sets).expect("generated groups are valid")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// bound <= exhaustive optimum <= every plan, every piece on a holder,
    /// with random holder sets (overlapping, not laminar) over 1 to 4 ranks.
    #[test]
    fn lower_bound_is_at_most_the_optimum_with_holder_groups(
        leaves in prop::collection::vec(tiny_leaf(), 1..=4),
        (world_size, ranks_per_node) in tiny_world(),
        groups in prop::collection::vec(1u32..16, 1..=4),
        pick in prop::collection::vec(0usize..8, 4),
        cost in tiny_cost_model(),
    ) {
        let specs: Vec<LeafSpec> = leaves
            .iter()
            .enumerate()
            .map(|(i, t)| LeafSpec { path: vec![PathKey::Int(i as i64)], ..t.spec.clone() })
            .collect();
        let m = grouped_manifest(&specs, world_size, &groups, &pick);
        check_bound_against_optimum(m, world_size, Topology { ranks_per_node }, cost)?;
    }

    /// Larger instances: every algorithm's plan is valid (every piece on a
    /// holder) and never below the bound.
    #[test]
    fn grouped_plans_are_valid(
        inst in instance(40),
        groups in prop::collection::vec(1u32..u32::MAX, 1..=6),
        pick in prop::collection::vec(0usize..16, 40),
    ) {
        let m = Arc::new(grouped_manifest(&inst.leaves, inst.world_size, &groups, &pick));
        for algorithm in [Algorithm::Balanced, Algorithm::Lpt, Algorithm::Greedy] {
            let p = plan(m.clone(), inst.world_size as u64, inst.topology(), inst.cost, algorithm).unwrap();
            check_assignment(&m, inst.world_size, &inst.topology(), &inst.cost, &p.ranks)
                .map_err(|e| TestCaseError::fail(format!("{algorithm}: {e}")))?;
            prop_assert!(p.stats.gap >= 1.0 - 1e-9, "{algorithm}: gap {}", p.stats.gap);
        }
        let refused = plan(m.clone(), inst.world_size as u64, inst.topology(), inst.cost, Algorithm::DeepPart);
        prop_assert_eq!(refused.is_err(), m.uses_groups());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// More ranks with holder groups: the same leaves in a world of `P`
    /// ranks and in one of `P' > P`, where each new rank joins some of the
    /// groups (holder sets only grow; leaves on every rank gain the new
    /// ranks too). Every plan of the small world is a legal plan of the
    /// large one, so `balanced` should never be slower there.
    /// Not yet true: the grouped search apportions its candidates over
    /// the holder classes of each world, so a larger world need not try
    /// the smaller one's writer sets. First counterexample: 3 ranks on 3
    /// nodes -> 4 ranks, 0.0541 s -> 0.0586 s (a coarse `[2, 1776, 2322]`
    /// tensor, row grain, node and aggregate bandwidths); run it with
    /// `cargo test --release -p deeppart-planner --test properties -- --ignored`.
    #[test]
    #[ignore = "fails: balanced with holder groups is not yet monotone in the world size"]
    fn modelled_time_is_non_increasing_in_world_size_with_holder_groups(
        leaves in prop::collection::vec(prop_oneof![3 => leaf_spec(), 1 => coarse_leaf_spec()], 0..=30),
        ranks_per_node in prop_oneof![Just(1u32), Just(8)],
        nodes in 1u32..=4,
        more_nodes in 1u32..=8,
        groups in prop::collection::vec(1u32..u32::MAX, 1..=6),
        pick in prop::collection::vec(0usize..16, 30),
        joins in prop::collection::vec(any::<u64>(), 6),
        cost in cost_model(),
    ) {
        let topology = Topology { ranks_per_node };
        let small = nodes * ranks_per_node;
        let large = (nodes + more_nodes) * ranks_per_node;
        let m = grouped_manifest(&leaves, small, &groups, &pick);
        let grown: Vec<Vec<u32>> = m
            .groups()
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let join = joins.get(i).copied().unwrap_or(0);
                let mut g = g.clone();
                g.extend((small..large).filter(|r| join & (1 << ((r - small) % 64)) != 0));
                g
            })
            .collect();
        let m2 = Arc::new(Manifest::with_groups(m.leaves().to_vec(), grown).unwrap());
        let m = Arc::new(m);
        let before = plan(m, small as u64, topology, cost, Algorithm::Balanced).unwrap().stats.makespan_s;
        let after = plan(m2, large as u64, topology, cost, Algorithm::Balanced).unwrap().stats.makespan_s;
        prop_assert!(
            after <= before * (1.0 + 1e-9),
            "modelled time rose from {before} at {small} ranks to {after} at {large} ranks"
        );
    }
}
