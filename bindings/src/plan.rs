//! `Plan` and `PlanStats`: who writes what, and how good it is, over
//! `deeppart_planner::plan`.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::convert::path_to_py;
use crate::cost::{CostModel, Topology};
use crate::errors::{plan_err, PlanError};
use crate::manifest::Manifest;
use crate::pipeline::planning_inputs;

/// Quality figures of a plan.
#[pyclass(frozen, module = "deeppart._planner")]
pub(crate) struct PlanStats {
    pub(crate) inner: core::PlanStats,
}

#[pymethods]
impl PlanStats {
    /// Modelled save time in seconds: the slowest rank plus the serialised per-writer cost.
    #[getter]
    fn makespan(&self) -> f64 {
        self.inner.makespan_s
    }
    /// Proven lower bound on the makespan of any plan for the same inputs.
    #[getter]
    fn lower_bound(&self) -> f64 {
        self.inner.lower_bound_s
    }
    /// makespan / lower_bound.
    #[getter]
    fn gap(&self) -> f64 {
        self.inner.gap
    }
    #[getter]
    fn pieces(&self) -> u64 {
        self.inner.pieces
    }
    #[getter]
    fn splits(&self) -> u64 {
        self.inner.splits
    }
    #[getter]
    fn writers(&self) -> u32 {
        self.inner.writers
    }
    #[getter]
    fn max_rank_bytes(&self) -> u64 {
        self.inner.max_rank_bytes
    }
    #[getter]
    fn plan_ms(&self) -> f64 {
        self.inner.plan_ms
    }
    /// "computed", "memory" or "disk"; through the planner service client
    /// "service", "service-cache" or "local-fallback".
    #[getter]
    fn source(&self) -> &'static str {
        self.inner.source.name()
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = &self.inner;
        let d = PyDict::new(py);
        d.set_item("makespan", s.makespan_s)?;
        d.set_item("lower_bound", s.lower_bound_s)?;
        d.set_item("gap", s.gap)?;
        d.set_item("pieces", s.pieces)?;
        d.set_item("splits", s.splits)?;
        d.set_item("writers", s.writers)?;
        d.set_item("max_rank_bytes", s.max_rank_bytes)?;
        d.set_item("plan_ms", s.plan_ms)?;
        d.set_item("source", s.source.name())?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let s = &self.inner;
        format!(
            "PlanStats(makespan={:.6}, lower_bound={:.6}, gap={:.4}, pieces={}, splits={}, writers={}, plan_ms={:.3}, source={:?})",
            s.makespan_s, s.lower_bound_s, s.gap, s.pieces, s.splits, s.writers, s.plan_ms, s.source.name()
        )
    }
}

/// Which rank writes which pieces of which leaves. Immutable.
#[pyclass(frozen, module = "deeppart._planner")]
pub(crate) struct Plan {
    pub(crate) inner: Arc<core::Plan>,
}

impl Plan {
    pub(crate) fn check_rank(&self, rank: i64) -> PyResult<usize> {
        if rank < 0 || rank >= self.inner.world_size as i64 {
            return Err(PlanError::new_err(format!(
                "rank {rank} is out of range for world size {}",
                self.inner.world_size
            )));
        }
        Ok(rank as usize)
    }
}

#[pymethods]
impl Plan {
    /// The same plan with `stats.source` set to `source` ("computed",
    /// "memory", "disk", "service", "service-cache" or "local-fallback"):
    /// how the planner service client says where a plan came from.
    fn with_source(&self, source: &str) -> PyResult<Plan> {
        let src = core::PlanSource::from_name(source).ok_or_else(|| {
            PyValueError::new_err(format!(
                "unknown plan source {source:?}; expected one of {}",
                core::PlanSource::ALL.map(|s| s.name()).join(", ")
            ))
        })?;
        let mut p = (*self.inner).clone();
        p.stats.source = src;
        Ok(Plan { inner: Arc::new(p) })
    }

    #[getter]
    fn world_size(&self) -> u32 {
        self.inner.world_size
    }
    #[getter]
    fn algorithm(&self) -> &'static str {
        self.inner.algorithm.name()
    }
    #[getter]
    fn fingerprint(&self) -> &str {
        &self.inner.fingerprint
    }
    /// Hex blake3 hash of the assignment (world size and every rank's pieces).
    fn assignment_digest(&self, py: Python<'_>) -> String {
        let inner = &self.inner;
        py.detach(|| inner.assignment_digest())
    }
    #[getter]
    fn manifest(&self) -> Manifest {
        Manifest::wrap(self.inner.manifest.clone())
    }
    #[getter]
    fn cost(&self) -> CostModel {
        CostModel {
            inner: self.inner.cost,
        }
    }
    #[getter]
    fn topology(&self) -> Topology {
        Topology {
            inner: self.inner.topology,
        }
    }
    #[getter]
    fn stats(&self) -> PlanStats {
        PlanStats {
            inner: self.inner.stats,
        }
    }

    /// The pieces of one rank as `(leaf_index, start, stop)`, in flat element
    /// units (an object is `(i, 0, 1)`), ordered by leaf then start.
    fn rank_pieces(&self, rank: i64) -> PyResult<Vec<(u32, u64, u64)>> {
        let r = self.check_rank(rank)?;
        Ok(self.inner.ranks[r]
            .iter()
            .map(|p| (p.leaf, p.start, p.stop))
            .collect())
    }

    /// The pieces of one rank as `(leaf_path, start, stop)`: `start` and
    /// `stop` are flat element offsets into the leaf (elements, not bytes;
    /// an object is `(path, 0, 1)`), ordered by leaf then start.
    fn pieces<'py>(
        &self,
        py: Python<'py>,
        rank: i64,
    ) -> PyResult<Vec<(Bound<'py, PyTuple>, u64, u64)>> {
        let r = self.check_rank(rank)?;
        let leaves = self.inner.manifest.leaves();
        self.inner.ranks[r]
            .iter()
            .map(|p| {
                Ok((
                    path_to_py(py, &leaves[p.leaf as usize].path)?,
                    p.start,
                    p.stop,
                ))
            })
            .collect()
    }

    /// Bytes each rank writes.
    fn rank_bytes(&self) -> Vec<u64> {
        let leaves = self.inner.manifest.leaves();
        self.inner
            .ranks
            .iter()
            .map(|list| {
                list.iter()
                    .map(|p| leaves[p.leaf as usize].range_bytes(p.start, p.stop))
                    .sum()
            })
            .collect()
    }

    /// Modelled write time of each rank, in seconds.
    fn rank_costs(&self) -> Vec<f64> {
        core::planning::plan::evaluate(
            &self.inner.manifest,
            &self.inner.topology,
            &self.inner.cost,
            &self.inner.ranks,
        )
        .rank_cost
    }

    /// The planner's modelled time of this plan (the one model,
    /// `deeppart_planner::planning::plan::model_time`), under `cost` and `topology`
    /// (default: the plan's own, so that `makespan` is `stats.makespan`).
    #[pyo3(signature = (cost=None, topology=None))]
    fn modelled_time<'py>(
        &self,
        py: Python<'py>,
        cost: Option<&CostModel>,
        topology: Option<&Topology>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let cost = cost.map_or(self.inner.cost, |c| c.inner);
        let topology = topology.map_or(self.inner.topology, |t| t.inner);
        topology.validate(self.inner.world_size).map_err(plan_err)?;
        let inner = self.inner.clone();
        let eval = py.detach(move || {
            core::planning::plan::evaluate(&inner.manifest, &topology, &cost, &inner.ranks)
        });
        evaluation_dict(py, &eval)
    }

    fn to_json(&self, py: Python<'_>) -> String {
        let inner = self.inner.clone();
        py.detach(move || inner.to_json())
    }

    /// Rebuilds a plan from per-rank `(leaf_index, start, stop)` lists, e.g.
    /// as received from a planner service. The pieces are validated against
    /// the manifest and the stats recomputed, as for a new plan.
    #[staticmethod]
    #[pyo3(signature = (manifest, world_size, ranks, *, algorithm="balanced", cost=None, topology=None, plan_ms=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn from_pieces(
        py: Python<'_>,
        manifest: &Manifest,
        world_size: i64,
        ranks: Vec<Vec<(u32, u64, u64)>>,
        algorithm: &str,
        cost: Option<&CostModel>,
        topology: Option<&Topology>,
        plan_ms: f64,
    ) -> PyResult<Plan> {
        let (world_size, algorithm, cost, topology) =
            planning_inputs(world_size, algorithm, cost, topology)?;
        let manifest = manifest.inner.clone();
        let ranks: Vec<Vec<core::Piece>> = ranks
            .into_iter()
            .map(|list| {
                list.into_iter()
                    .map(|(leaf, start, stop)| core::Piece { leaf, start, stop })
                    .collect()
            })
            .collect();
        let p = py
            .detach(move || {
                core::assemble_plan(
                    manifest,
                    world_size,
                    topology,
                    cost,
                    algorithm,
                    ranks,
                    plan_ms,
                    core::PlanSource::Computed,
                )
            })
            .map_err(plan_err)?;
        Ok(Plan { inner: Arc::new(p) })
    }

    /// Reads a plan written by `to_json`; validates it and checks its fingerprint.
    #[staticmethod]
    fn from_json(py: Python<'_>, text: &str) -> PyResult<Plan> {
        let text = text.to_owned();
        let p = py
            .detach(move || core::Plan::from_json(&text))
            .map_err(plan_err)?;
        Ok(Plan { inner: Arc::new(p) })
    }

    fn __repr__(&self) -> String {
        format!(
            "Plan(world_size={}, algorithm={:?}, leaves={}, gap={:.4}, fingerprint={:?})",
            self.inner.world_size,
            self.inner.algorithm.name(),
            self.inner.manifest.len(),
            self.inner.stats.gap,
            &self.inner.fingerprint[..16]
        )
    }
}

/// A modelled time as a dict: `makespan`, `rank_costs`, `rank_bytes`,
/// `node_s`, `aggregate_s`, `writers`, `pieces`.
fn evaluation_dict<'py>(
    py: Python<'py>,
    eval: &core::planning::plan::Evaluation,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("makespan", eval.makespan_s)?;
    d.set_item("rank_costs", eval.rank_cost.clone())?;
    d.set_item("rank_bytes", eval.rank_bytes.clone())?;
    d.set_item("node_s", eval.node_s)?;
    d.set_item("aggregate_s", eval.aggregate_s)?;
    d.set_item("writers", eval.writers)?;
    d.set_item("pieces", eval.pieces)?;
    Ok(d)
}

/// The planner's modelled time of a save in which rank `r` writes
/// `rank_bytes[r]` bytes in `rank_pieces[r]` pieces, under `cost` and
/// `topology`: the model that scores every plan, for assignments that are
/// not DeepPart plans (torch.distributed.checkpoint's, for instance).
#[pyfunction]
#[pyo3(signature = (cost, rank_pieces, rank_bytes, *, topology=None))]
fn model_time<'py>(
    py: Python<'py>,
    cost: &CostModel,
    rank_pieces: Vec<u64>,
    rank_bytes: Vec<u64>,
    topology: Option<&Topology>,
) -> PyResult<Bound<'py, PyDict>> {
    if rank_pieces.len() != rank_bytes.len() {
        return Err(PlanError::new_err(format!(
            "{} piece counts for {} byte counts",
            rank_pieces.len(),
            rank_bytes.len()
        )));
    }
    let world_size = u32::try_from(rank_pieces.len())
        .ok()
        .filter(|&w| w >= 1)
        .ok_or_else(|| PlanError::new_err("model_time needs 1 to 2^20 ranks"))?;
    core::check_world_size(u64::from(world_size)).map_err(plan_err)?;
    let topology = topology.map_or(core::Topology::default(), |t| t.inner);
    topology.validate(world_size).map_err(plan_err)?;
    let cost = cost.inner;
    let eval = py.detach(move || {
        core::planning::plan::model_time(&cost, &topology, &rank_pieces, rank_bytes)
    });
    evaluation_dict(py, &eval)
}

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Plan>()?;
    m.add_class::<PlanStats>()?;
    m.add_function(wrap_pyfunction!(model_time, m)?)?;
    Ok(())
}
