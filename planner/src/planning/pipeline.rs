//! The plan pipeline: check the inputs, run an algorithm, then validate,
//! score and fingerprint the assignment. Every plan goes through here,
//! whether it is computed ([`plan`]), built by hand, decoded from the plan
//! codec or JSON, or served by the cache ([`assemble_plan`]), so a plan from
//! disk or the network is checked like a new one.
//!
//! The order of the stages:
//! 1. [`validate_inputs`] ([`crate::planning::inputs`]): world size, topology, cost
//!    model, owners and holder groups within the world.
//! 2. [`crate::planning::algorithms::run`]: the assignment (computed plans only).
//! 3. [`crate::planning::plan::validate_assignment`]: every unit written exactly once,
//!    every piece by a holder of its leaf.
//! 4. [`score_plan`]: the modelled time ([`crate::planning::plan::evaluate`]), the
//!    lower bound ([`crate::planning::bound::lower_bound`]), the gap and the fingerprint.

use std::sync::Arc;
use std::time::Instant;

use crate::error::PlanError;
use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::Manifest;
use crate::planning::inputs::validate_inputs;
use crate::planning::plan::{Algorithm, Piece, Plan, PlanSource, PlanStats};

/// Computes a plan. Deterministic: the same inputs give the same plan on
/// every run and machine.
pub fn plan(
    manifest: Arc<Manifest>,
    world_size: u64,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
) -> Result<Plan, PlanError> {
    let started = Instant::now();
    let world_size = validate_inputs(&manifest, world_size, &topology, &cost)?;
    let ranks =
        crate::planning::algorithms::run(algorithm, &manifest, world_size, &topology, &cost)?;
    let plan_ms = started.elapsed().as_secs_f64() * 1e3;
    assemble_plan(
        manifest,
        world_size,
        topology,
        cost,
        algorithm,
        ranks,
        plan_ms,
        PlanSource::Computed,
    )
}

/// Builds a [`Plan`] from an assignment: validates it, scores it against the
/// lower bound and fingerprints the inputs. Used by the algorithms and by
/// every decoder, so a plan from disk or the network is checked like a new one.
#[allow(clippy::too_many_arguments)]
pub fn assemble_plan(
    manifest: Arc<Manifest>,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
    ranks: Vec<Vec<Piece>>,
    plan_ms: f64,
    source: PlanSource,
) -> Result<Plan, PlanError> {
    assemble_plan_with_fingerprint(
        manifest, world_size, topology, cost, algorithm, ranks, plan_ms, source, None,
    )
}

/// [`assemble_plan`] with the inputs' fingerprint already known (the plan
/// cache computes it for its key): skips hashing the manifest again. The
/// caller guarantees that `fingerprint` is [`fingerprint::plan_fingerprint`]
/// of exactly these inputs; `None` computes it.
#[allow(clippy::too_many_arguments)]
pub fn assemble_plan_with_fingerprint(
    manifest: Arc<Manifest>,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
    mut ranks: Vec<Vec<Piece>>,
    plan_ms: f64,
    source: PlanSource,
    fingerprint: Option<String>,
) -> Result<Plan, PlanError> {
    validate_inputs(&manifest, world_size as u64, &topology, &cost)?;
    for list in &mut ranks {
        list.sort_unstable();
    }
    crate::planning::plan::validate_assignment(&manifest, world_size, &ranks)?;
    Ok(score_plan(
        manifest,
        world_size,
        topology,
        cost,
        algorithm,
        ranks,
        plan_ms,
        source,
        fingerprint,
    ))
}

/// The second half of [`assemble_plan_with_fingerprint`]: scores and
/// fingerprints an assignment that is already known to be valid (inputs
/// checked by [`validate_inputs`], pieces by [`crate::planning::plan::validate_assignment`]
/// or a check at least as strict, like the plan codec's).
#[allow(clippy::too_many_arguments)]
pub(crate) fn score_plan(
    manifest: Arc<Manifest>,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
    ranks: Vec<Vec<Piece>>,
    plan_ms: f64,
    source: PlanSource,
    fingerprint: Option<String>,
) -> Plan {
    let eval = crate::planning::plan::evaluate(&manifest, &topology, &cost, &ranks);
    let summary = crate::planning::bound::LoadSummary::new(&manifest, world_size, &topology, &cost);
    let lb = crate::planning::bound::lower_bound(&summary, &cost, world_size);
    let gap = if lb.makespan_s > 0.0 {
        eval.makespan_s / lb.makespan_s
    } else if eval.makespan_s == 0.0 {
        1.0
    } else {
        f64::INFINITY
    };
    let stats = PlanStats {
        makespan_s: eval.makespan_s,
        lower_bound_s: lb.makespan_s,
        gap,
        pieces: eval.pieces,
        splits: eval.pieces - manifest.len() as u64,
        writers: eval.writers,
        max_rank_bytes: eval.rank_bytes.iter().copied().max().unwrap_or(0),
        plan_ms,
        source,
    };
    let fingerprint = fingerprint.unwrap_or_else(|| {
        crate::planning::fingerprint::plan_fingerprint(
            &manifest, world_size, &topology, &cost, algorithm,
        )
    });
    Plan {
        manifest,
        world_size,
        topology,
        cost,
        algorithm,
        fingerprint,
        ranks,
        stats,
    }
}
