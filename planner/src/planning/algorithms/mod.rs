//! The partitioning algorithms. Each returns, per rank, the pieces it writes;
//! [`crate::planning::pipeline::assemble_plan`] validates and scores the result.

mod balanced;
mod deeppart;
mod greedy;
mod grouped;
mod lpt;
mod refine;

use std::cmp::Ordering;

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{Leaf, Manifest};
use crate::planning::plan::{Algorithm, Piece};

/// Runs one algorithm. Inputs must already be validated. Fails only for an
/// algorithm that does not plan leaves held by groups (`deeppart`), given one.
pub fn run(
    algorithm: Algorithm,
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
) -> Result<Vec<Vec<Piece>>, PlanError> {
    if algorithm == Algorithm::DeepPart {
        if let Some((index, leaf)) = manifest
            .leaves()
            .iter()
            .enumerate()
            .find(|(_, l)| l.holders.is_some())
        {
            return Err(PlanError::HoldersUnsupported {
                algorithm: algorithm.name(),
                index,
                path: leaf.display_path(),
            });
        }
    }
    let mut ranks = vec![Vec::new(); world_size as usize];
    assign_owned(manifest, &mut ranks);
    match algorithm {
        Algorithm::Balanced if manifest.uses_groups() => {
            grouped::plan(manifest, world_size, topology, cost, &mut ranks)
        }
        Algorithm::Balanced => balanced::plan(manifest, world_size, topology, cost, &mut ranks),
        Algorithm::Lpt => lpt::plan(manifest, cost, &mut ranks),
        Algorithm::Greedy => greedy::plan(manifest, &mut ranks),
        Algorithm::DeepPart => deeppart::plan(manifest, cost, &mut ranks),
    }
    Ok(ranks)
}

/// Every owned leaf goes, whole, to its owner; so does every leaf whose
/// holder group has one rank.
fn assign_owned(manifest: &Manifest, ranks: &mut [Vec<Piece>]) {
    for (i, leaf) in manifest.leaves().iter().enumerate() {
        if let Some(owner) = sole_holder(manifest, leaf) {
            ranks[owner as usize].push(whole(i, leaf.units()));
        }
    }
}

/// The one rank that holds `leaf`: its owner, or the only rank of its group.
pub(crate) fn sole_holder(manifest: &Manifest, leaf: &Leaf) -> Option<u32> {
    match leaf.owner {
        Some(o) => Some(o),
        None => leaf
            .holders
            .map(|g| &manifest.groups()[g as usize])
            .filter(|g| g.len() == 1)
            .map(|g| g[0]),
    }
}

fn whole(leaf: usize, units: u64) -> Piece {
    Piece {
        leaf: leaf as u32,
        start: 0,
        stop: units,
    }
}

/// A replicated leaf with the figures the algorithms sort and place by,
/// gathered in one pass so that placing never chases the manifest.
#[derive(Debug, Clone, Copy)]
struct SizedLeaf {
    nbytes: u64,
    units: u64,
    leaf: u32,
}

/// The leaves held by every rank, largest first (ties by manifest order).
fn replicated_by_size(manifest: &Manifest) -> Vec<SizedLeaf> {
    let mut order: Vec<SizedLeaf> = manifest
        .leaves()
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_replicated())
        .map(|(i, l)| SizedLeaf {
            nbytes: l.nbytes,
            units: l.units(),
            leaf: i as u32,
        })
        .collect();
    // Compares plain fields, not leaves through indices: with a million
    // leaves that is the difference between cache hits and misses.
    order.sort_unstable_by(|a, b| b.nbytes.cmp(&a.nbytes).then(a.leaf.cmp(&b.leaf)));
    order
}

/// An `f64` with a total order, for heaps. Keys are never NaN.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key(f64);

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// Where a piece of `leaf` from unit `start` (a legal cut position) should
/// end to hold at most `max_bytes` bytes: the furthest cut on the leaf's
/// grain ([`CostModel::grain_units`]) that leaves both the piece and the
/// rest at least `min_piece_bytes`. `None` when there is no such cut.
fn cut(leaf: &Leaf, start: u64, max_bytes: f64, cost: &CostModel) -> Option<u64> {
    if !leaf.is_tensor() {
        return None;
    }
    let units = leaf.units();
    let grain = cost.grain_units(leaf);
    // Saturating: a tensor with no elements can have rows wider than 2^64 bytes.
    let grain_bytes = grain.saturating_mul(leaf.unit_bytes());
    if grain_bytes == 0 || start >= units {
        return None;
    }
    let min_grains = cost.min_piece_bytes.div_ceil(grain_bytes).max(1);
    // Leave a remainder that is itself a worthwhile piece.
    let most = leaf
        .range_bytes(start, units)
        .checked_sub(cost.min_piece_bytes)?
        / grain_bytes;
    let grains = ((max_bytes.max(0.0) / grain_bytes as f64).floor() as u64).min(most);
    if grains < min_grains || grains == 0 {
        return None;
    }
    Some(start + grains * grain)
}
