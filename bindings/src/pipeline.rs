//! The planning entry points, over `deeppart_planner::planning::pipeline`: `plan`
//! (with the GIL released, optionally through a `PlanCache`) and
//! `plan_fingerprint`, and the argument checks they share.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::prelude::*;

use crate::cache::PlanCache;
use crate::cost::{CostModel, Topology};
use crate::errors::{plan_err, PlanError};
use crate::manifest::Manifest;
use crate::plan::Plan;

pub(crate) fn check_world_size(world_size: i64) -> PyResult<u32> {
    if world_size < 1 {
        return Err(PlanError::new_err(format!(
            "world size must be at least 1, got {world_size}"
        )));
    }
    core::check_world_size(world_size as u64).map_err(plan_err)
}

/// Checks and converts the arguments every planning entry point takes.
pub(crate) fn planning_inputs(
    world_size: i64,
    algorithm: &str,
    cost: Option<&CostModel>,
    topology: Option<&Topology>,
) -> PyResult<(u32, core::Algorithm, core::CostModel, core::Topology)> {
    Ok((
        check_world_size(world_size)?,
        algorithm.parse().map_err(plan_err)?,
        cost.map(|c| c.inner).unwrap_or_default(),
        topology.map(|t| t.inner).unwrap_or_default(),
    ))
}

/// The fingerprint a plan for these inputs would have, without planning.
#[pyfunction]
#[pyo3(signature = (manifest, world_size, *, algorithm="balanced", cost=None, topology=None))]
pub(crate) fn plan_fingerprint(
    py: Python<'_>,
    manifest: &Manifest,
    world_size: i64,
    algorithm: &str,
    cost: Option<&CostModel>,
    topology: Option<&Topology>,
) -> PyResult<String> {
    let (world_size, algorithm, cost, topology) =
        planning_inputs(world_size, algorithm, cost, topology)?;
    let manifest = manifest.inner.clone();
    Ok(py.detach(move || {
        core::planning::fingerprint::plan_fingerprint(
            &manifest, world_size, &topology, &cost, algorithm,
        )
    }))
}

/// Computes a plan with the GIL released.
#[pyfunction]
#[pyo3(signature = (manifest, world_size, *, algorithm="balanced", cost=None, topology=None, cache=None))]
pub(crate) fn plan(
    py: Python<'_>,
    manifest: &Manifest,
    world_size: i64,
    algorithm: &str,
    cost: Option<&CostModel>,
    topology: Option<&Topology>,
    cache: Option<&PlanCache>,
) -> PyResult<Plan> {
    let (world_size, algorithm, cost, topology) =
        planning_inputs(world_size, algorithm, cost, topology)?;
    let manifest = manifest.inner.clone();
    if let Some(cache) = cache {
        let inner = cache.inner.clone();
        let p =
            py.detach(move || inner.plan(manifest, world_size as u64, topology, cost, algorithm));
        cache.emit_warnings(py);
        return Ok(Plan {
            inner: p.map_err(plan_err)?,
        });
    }
    let p = py
        .detach(move || core::plan(manifest, world_size as u64, topology, cost, algorithm))
        .map_err(plan_err)?;
    Ok(Plan { inner: Arc::new(p) })
}

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(plan_fingerprint, m)?)?;
    m.add("PLANNER_VERSION", core::PLANNER_VERSION)?;
    m.add(
        "ALGORITHMS",
        core::Algorithm::ALL
            .iter()
            .map(|a| a.name())
            .collect::<Vec<_>>(),
    )?;
    Ok(())
}
