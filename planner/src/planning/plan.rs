//! A plan: which rank writes which pieces of which leaves, and its quality.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{Leaf, Manifest};

/// The partitioning algorithms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Near-optimal: chooses the writer count, splits large leaves.
    Balanced,
    /// Whole leaves, largest first, to the least-loaded rank.
    Lpt,
    /// torch.distributed.checkpoint's dedup rule, as a baseline.
    Greedy,
    /// The 2023 thesis heuristic: recursive proportional partitioning.
    DeepPart,
}

impl Algorithm {
    pub const ALL: [Algorithm; 4] = [
        Algorithm::Balanced,
        Algorithm::Lpt,
        Algorithm::Greedy,
        Algorithm::DeepPart,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Balanced => "balanced",
            Algorithm::Lpt => "lpt",
            Algorithm::Greedy => "greedy",
            Algorithm::DeepPart => "deeppart",
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Algorithm {
    type Err = PlanError;
    fn from_str(s: &str) -> Result<Self, PlanError> {
        Algorithm::ALL
            .iter()
            .copied()
            .find(|a| a.name() == s)
            .ok_or_else(|| PlanError::UnknownAlgorithm(s.to_string()))
    }
}

/// A contiguous range of one leaf, in plan units (elements of a tensor; a
/// whole object is the range `[0, 1)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Piece {
    /// Index of the leaf in the manifest.
    pub leaf: u32,
    pub start: u64,
    pub stop: u64,
}

/// Where a plan came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PlanSource {
    /// Planned in this process.
    Computed,
    /// From the plan cache's memory tier.
    Memory,
    /// From the plan cache's disk tier.
    Disk,
    /// Planned by a planner service for this request.
    Service,
    /// Served by a planner service from its caches.
    ServiceCache,
    /// Planned in this process because the planner service was unreachable.
    LocalFallback,
}

impl PlanSource {
    pub const ALL: [PlanSource; 6] = [
        PlanSource::Computed,
        PlanSource::Memory,
        PlanSource::Disk,
        PlanSource::Service,
        PlanSource::ServiceCache,
        PlanSource::LocalFallback,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PlanSource::Computed => "computed",
            PlanSource::Memory => "memory",
            PlanSource::Disk => "disk",
            PlanSource::Service => "service",
            PlanSource::ServiceCache => "service-cache",
            PlanSource::LocalFallback => "local-fallback",
        }
    }

    /// The source named `name` (as [`PlanSource::name`] gives it).
    pub fn from_name(name: &str) -> Option<PlanSource> {
        PlanSource::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Quality figures of a plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PlanStats {
    /// Modelled time of the save: the slowest rank plus the serialised per-writer cost.
    pub makespan_s: f64,
    /// Proven lower bound on the makespan of any plan for these inputs.
    pub lower_bound_s: f64,
    /// `makespan_s / lower_bound_s` (1.0 when both are 0).
    pub gap: f64,
    pub pieces: u64,
    /// Extra pieces from cutting leaves: `pieces - leaves`.
    pub splits: u64,
    /// Ranks that write anything.
    pub writers: u32,
    /// Bytes written by the most-loaded rank.
    pub max_rank_bytes: u64,
    /// Wall time spent planning, in milliseconds.
    pub plan_ms: f64,
    pub source: PlanSource,
}

/// A complete plan for one manifest, world size, topology, cost model and algorithm.
#[derive(Debug, Clone)]
pub struct Plan {
    pub manifest: Arc<Manifest>,
    pub world_size: u32,
    pub topology: Topology,
    pub cost: CostModel,
    pub algorithm: Algorithm,
    /// Hex blake3 fingerprint of the inputs (see [`crate::planning::fingerprint`]).
    pub fingerprint: String,
    /// Per rank, its pieces ordered by leaf index then start.
    pub ranks: Vec<Vec<Piece>>,
    pub stats: PlanStats,
}

/// Per-rank modelled costs and bytes of an assignment.
#[derive(Debug, Clone)]
pub struct Evaluation {
    pub rank_cost: Vec<f64>,
    pub rank_bytes: Vec<u64>,
    pub writers: u32,
    /// `fixed_s` plus the busiest node's bytes over `node_bandwidth` (0 when
    /// unlimited or nothing is written).
    pub node_s: f64,
    /// `fixed_s` plus all bytes over `aggregate_bandwidth` (0 when unlimited
    /// or nothing is written).
    pub aggregate_s: f64,
    pub makespan_s: f64,
    pub pieces: u64,
}

/// Scores an assignment under the cost model (see [`crate::model::cost`]).
pub fn evaluate(
    manifest: &Manifest,
    topology: &Topology,
    cost: &CostModel,
    ranks: &[Vec<Piece>],
) -> Evaluation {
    let leaves = manifest.leaves();
    let pieces: Vec<u64> = ranks.iter().map(|list| list.len() as u64).collect();
    let bytes: Vec<u64> = ranks
        .iter()
        .map(|list| {
            list.iter()
                .map(|p| leaves[p.leaf as usize].range_bytes(p.start, p.stop))
                .sum()
        })
        .collect();
    model_time(cost, topology, &pieces, bytes)
}

/// The model itself (see [`crate::model::cost`]): the modelled time of a save in
/// which rank `r` writes `rank_bytes[r]` bytes in `rank_pieces[r]` pieces
/// (a rank with no pieces does not write). Every modelled time, a plan's
/// stats, the planner's choice of writers and the simulator's prediction,
/// comes from here. The result does not depend on the order of a rank's
/// pieces: a rank's cost is `fixed_s + pieces * piece_s + bytes / bandwidth`.
pub fn model_time(
    cost: &CostModel,
    topology: &Topology,
    rank_pieces: &[u64],
    rank_bytes: Vec<u64>,
) -> Evaluation {
    debug_assert_eq!(rank_pieces.len(), rank_bytes.len());
    let mut rank_cost = vec![0.0; rank_pieces.len()];
    let mut writers = 0;
    for (r, (&p, &b)) in rank_pieces.iter().zip(&rank_bytes).enumerate() {
        if p > 0 {
            writers += 1;
            rank_cost[r] = cost.fixed_s + p as f64 * cost.piece_s + b as f64 / cost.bandwidth;
        }
    }
    let pieces = rank_pieces.iter().sum();
    let slowest = rank_cost.iter().copied().fold(0.0, f64::max);
    let mut node_s = 0.0;
    if let Some(nu) = cost.node_bandwidth {
        let per = topology.ranks_per_node.max(1) as usize;
        let busiest = rank_bytes
            .chunks(per)
            .map(|node| node.iter().sum::<u64>())
            .max()
            .unwrap_or(0);
        if busiest > 0 {
            node_s = cost.fixed_s + busiest as f64 / nu;
        }
    }
    let mut aggregate_s = 0.0;
    if let Some(alpha) = cost.aggregate_bandwidth {
        let total: u64 = rank_bytes.iter().sum();
        if total > 0 {
            aggregate_s = cost.fixed_s + total as f64 / alpha;
        }
    }
    let makespan_s = slowest.max(node_s).max(aggregate_s) + writers as f64 * cost.writer_s;
    Evaluation {
        rank_cost,
        rank_bytes,
        writers,
        node_s,
        aggregate_s,
        makespan_s,
        pieces,
    }
}

/// The number of rank lists must be the world size.
pub(crate) fn check_rank_count(ranks: &[Vec<Piece>], world_size: u32) -> Result<(), PlanError> {
    if ranks.len() != world_size as usize {
        return Err(PlanError::Malformed(format!(
            "plan has {} ranks, expected {world_size}",
            ranks.len()
        )));
    }
    Ok(())
}

/// The checks of one piece on its own, shared by [`validate_assignment`] and
/// the plan codec's linear check: piece `i` of rank `r`'s `list` names a leaf
/// of the manifest, lies within it, is not empty (unless the leaf is), is
/// planned on one of the leaf's holders (its owner or a rank of its group), and follows the rank's previous
/// piece in strict order. Returns the piece's leaf.
pub(crate) fn check_piece<'m>(
    manifest: &'m Manifest,
    r: usize,
    list: &[Piece],
    i: usize,
) -> Result<&'m Leaf, PlanError> {
    let leaves = manifest.leaves();
    let bad = |m: String| Err(PlanError::Malformed(m));
    let p = &list[i];
    let Some(leaf) = leaves.get(p.leaf as usize) else {
        return bad(format!(
            "rank {r} piece {i} names leaf {} of {}",
            p.leaf,
            leaves.len()
        ));
    };
    let units = leaf.units();
    if p.start > p.stop || p.stop > units {
        return bad(format!(
            "rank {r} piece {i} [{}, {}) is out of bounds for leaf {} ({}) of {units} units",
            p.start,
            p.stop,
            p.leaf,
            leaf.display_path(),
        ));
    }
    if p.start == p.stop && units != 0 {
        return bad(format!("rank {r} piece {i} of leaf {} is empty", p.leaf));
    }
    if let Some(owner) = leaf.owner {
        if owner as usize != r {
            return bad(format!(
                "leaf {} ({}) is owned by rank {owner} but planned on rank {r}",
                p.leaf,
                leaf.display_path()
            ));
        }
    }
    if let Some(g) = leaf.holders {
        if !manifest.holders(leaf).contains(r as u32) {
            return bad(format!(
                "leaf {} ({}) is held by group {g} but planned on rank {r}, which is not in it",
                p.leaf,
                leaf.display_path()
            ));
        }
    }
    if i > 0 && list[i - 1] >= *p {
        return bad(format!(
            "rank {r} pieces are not strictly ordered at piece {i}"
        ));
    }
    Ok(leaf)
}

/// A piece as the coverage check sees it: (leaf, start, stop, rank).
pub(crate) type Covering = (u32, u64, u64, u32);

/// Checks that `pieces`, all of leaf `index` and sorted by start, cover it
/// exactly once: they follow each other without gap or overlap from unit 0
/// to the leaf's end, and only the first may be empty (an empty leaf).
pub(crate) fn check_coverage(
    index: u32,
    leaf: &Leaf,
    pieces: &[Covering],
) -> Result<(), PlanError> {
    let mut pos = 0u64;
    for (n, &(_, start, stop, r)) in pieces.iter().enumerate() {
        if start != pos || (n > 0 && start == stop) {
            return Err(PlanError::Malformed(format!(
                "leaf {index} ({}) is not covered exactly once near unit {pos} (rank {r})",
                leaf.display_path()
            )));
        }
        pos = stop;
    }
    if pieces.is_empty() || pos != leaf.units() {
        return Err(PlanError::Malformed(format!(
            "leaf {index} ({}) is covered up to unit {pos} of {}",
            leaf.display_path(),
            leaf.units()
        )));
    }
    Ok(())
}

/// Checks that an assignment is a valid plan for the manifest: every unit of
/// every leaf is written exactly once, every piece by a holder of its leaf
/// (owned leaves by their owner, grouped leaves by a rank of their group), pieces lie
/// within bounds, and each rank's pieces are sorted.
pub fn validate_assignment(
    manifest: &Manifest,
    world_size: u32,
    ranks: &[Vec<Piece>],
) -> Result<(), PlanError> {
    check_rank_count(ranks, world_size)?;
    let leaves = manifest.leaves();
    let mut covering: Vec<Covering> = Vec::new();
    for (r, list) in ranks.iter().enumerate() {
        for (i, p) in list.iter().enumerate() {
            check_piece(manifest, r, list, i)?;
            covering.push((p.leaf, p.start, p.stop, r as u32));
        }
    }
    covering.sort_unstable();
    let mut k = 0;
    for (index, leaf) in leaves.iter().enumerate() {
        let end = k + covering[k..].partition_point(|c| c.0 as usize == index);
        check_coverage(index as u32, leaf, &covering[k..end])?;
        k = end;
    }
    // Every piece names a leaf of the manifest (check_piece), so none is left.
    debug_assert_eq!(k, covering.len());
    Ok(())
}

impl Plan {
    /// Hex blake3 hash of the assignment itself: the world size and every
    /// rank's pieces, in order. Two plans with the same fingerprint (the same
    /// inputs) but different pieces, e.g. one from a faulty planner service,
    /// differ here; ranks compare it before writing.
    pub fn assignment_digest(&self) -> String {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"deeppart-assignment-v1");
        hasher.update(&u64::from(self.world_size).to_le_bytes());
        let mut buf = Vec::with_capacity(1 << 16);
        for pieces in &self.ranks {
            buf.extend_from_slice(&(pieces.len() as u64).to_le_bytes());
            for p in pieces {
                buf.extend_from_slice(&u64::from(p.leaf).to_le_bytes());
                buf.extend_from_slice(&p.start.to_le_bytes());
                buf.extend_from_slice(&p.stop.to_le_bytes());
                if buf.len() >= 1 << 16 {
                    hasher.update(&buf);
                    buf.clear();
                }
            }
        }
        hasher.update(&buf);
        hasher.finalize().to_hex().to_string()
    }

    /// Pieces of one rank.
    pub fn rank_pieces(&self, rank: u32) -> &[Piece] {
        &self.ranks[rank as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::PlanSource;

    #[test]
    fn plan_source_names_round_trip() {
        for s in PlanSource::ALL {
            assert_eq!(PlanSource::from_name(s.name()), Some(s));
        }
        assert_eq!(
            PlanSource::from_name("service-cache"),
            Some(PlanSource::ServiceCache)
        );
        assert_eq!(PlanSource::from_name("somewhere"), None);
    }
}
