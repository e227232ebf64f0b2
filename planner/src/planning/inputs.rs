//! A plan's inputs, checked before any work is done: the world size, the
//! topology, the cost model, and owners and holder groups within the world;
//! and the planner's version, which every fingerprint and cache entry names.

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::Manifest;

/// The version string baked into every fingerprint and cache entry: the crate
/// version plus an algorithm revision. Bump the `+algN` suffix whenever any
/// algorithm's output can change, so that no cache ever serves a plan from an
/// older planner.
pub const PLANNER_VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "+alg6");

/// Largest supported world size.
pub const MAX_WORLD_SIZE: u64 = 1 << 20;

/// Checks a world size and narrows it.
pub fn check_world_size(world_size: u64) -> Result<u32, PlanError> {
    if world_size == 0 {
        return Err(PlanError::WorldSize(world_size));
    }
    if world_size > MAX_WORLD_SIZE {
        return Err(PlanError::WorldSizeTooLarge {
            world_size,
            limit: MAX_WORLD_SIZE,
        });
    }
    Ok(world_size as u32)
}

/// Checks everything a plan needs before any work is done.
pub fn validate_inputs(
    manifest: &Manifest,
    world_size: u64,
    topology: &Topology,
    cost: &CostModel,
) -> Result<u32, PlanError> {
    let world_size = check_world_size(world_size)?;
    topology.validate(world_size)?;
    cost.validate()?;
    if let Some((index, owner)) = manifest.max_owner() {
        if owner >= world_size {
            return Err(PlanError::OwnerOutOfRange {
                index,
                path: manifest.leaves()[index].display_path(),
                owner,
                world_size,
            });
        }
    }
    if let Some((group, rank)) = manifest.max_group_rank() {
        if rank >= world_size {
            let leaf = manifest
                .leaves()
                .iter()
                .enumerate()
                .find(|(_, l)| l.holders == Some(group as u32))
                .map(|(i, l)| format!("leaf {i} ({})", l.display_path()))
                .unwrap_or_else(|| "none".to_string());
            return Err(PlanError::HolderOutOfRange {
                group,
                rank,
                world_size,
                leaf,
            });
        }
    }
    Ok(world_size)
}
