//! `deeppart._planner`: a thin PyO3 layer over the `deeppart-planner` crate.
//! It converts values, maps Rust errors to Python exception classes, and
//! releases the GIL around planning.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

mod erasure;
mod replica;

create_exception!(
    _planner,
    DeepPartError,
    PyException,
    "Base class of DeepPart's errors."
);
create_exception!(
    _planner,
    ManifestError,
    DeepPartError,
    "A manifest is malformed or invalid."
);
create_exception!(
    _planner,
    PlanError,
    DeepPartError,
    "A plan cannot be computed or accepted."
);
create_exception!(
    _planner,
    CacheError,
    DeepPartError,
    "The plan cache cannot be read or written."
);
create_exception!(
    _planner,
    CacheWarning,
    pyo3::exceptions::PyUserWarning,
    "The plan cache was bypassed, rebuilt or had an entry discarded; planning went on."
);

fn manifest_err(e: core::ManifestError) -> PyErr {
    ManifestError::new_err(e.to_string())
}

fn plan_err(e: core::PlanError) -> PyErr {
    PlanError::new_err(e.to_string())
}

/// Converts plain Python data (dict, list, tuple, str, int, float, bool, None)
/// to JSON, so that Python leaves are validated exactly like JSON ones.
fn to_json(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
    if depth > 64 {
        return Err(ManifestError::new_err(
            "leaf description is nested too deeply",
        ));
    }
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.cast::<PyInt>().is_ok() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(Value::Number(v.into()));
        }
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::Number(v.into()));
        }
        return Err(ManifestError::new_err(format!(
            "integer {obj} is out of the 64-bit range"
        )));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Number::from_f64(f.value())
            .map(Value::Number)
            .ok_or_else(|| ManifestError::new_err(format!("{f} is not a finite number")));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Value::String(s.to_str()?.to_owned()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut m = Map::new();
        for (k, v) in d.iter() {
            let key: String = k
                .extract()
                .map_err(|_| ManifestError::new_err(format!("dict key {k} is not a string")))?;
            m.insert(key, to_json(&v, depth + 1)?);
        }
        return Ok(Value::Object(m));
    }
    if obj.cast::<PyList>().is_ok() || obj.cast::<PyTuple>().is_ok() {
        let mut out = Vec::new();
        for item in obj.try_iter()? {
            out.push(to_json(&item?, depth + 1)?);
        }
        return Ok(Value::Array(out));
    }
    Err(ManifestError::new_err(format!(
        "cannot describe a leaf with a value of type {}",
        obj.get_type().name()?
    )))
}

fn path_to_py<'py>(py: Python<'py>, path: &[core::PathKey]) -> PyResult<Bound<'py, PyTuple>> {
    let items: Vec<Bound<'py, PyAny>> = path
        .iter()
        .map(|k| match k {
            core::PathKey::Str(s) => Ok(PyString::new(py, s).into_any()),
            core::PathKey::Int(i) => Ok(i.into_pyobject(py)?.into_any()),
        })
        .collect::<PyResult<_>>()?;
    PyTuple::new(py, items)
}

/// An ordered list of the leaves of a state tree: paths, dtypes, shapes,
/// sizes and owners. Immutable.
#[pyclass(frozen, module = "deeppart._planner")]
struct Manifest {
    inner: Arc<core::Manifest>,
    /// The structure hash, computed on first use: it is asked for often.
    fingerprint: std::sync::OnceLock<String>,
}

impl Manifest {
    fn wrap(inner: Arc<core::Manifest>) -> Manifest {
        Manifest {
            inner,
            fingerprint: std::sync::OnceLock::new(),
        }
    }
}

#[pymethods]
impl Manifest {
    /// Parses the JSON interchange form.
    #[staticmethod]
    fn from_json(py: Python<'_>, text: &str) -> PyResult<Manifest> {
        let text = text.to_owned();
        let m = py
            .detach(move || core::Manifest::from_json(&text))
            .map_err(manifest_err)?;
        Ok(Manifest::wrap(Arc::new(m)))
    }

    /// Builds a manifest from leaf descriptions: dicts with the keys of the
    /// JSON form (`path`, `dtype`, `shape`, or `kind="object"` and `nbytes`, `owner`).
    #[staticmethod]
    fn from_leaves(leaves: &Bound<'_, PyAny>) -> PyResult<Manifest> {
        let mut parsed = Vec::new();
        for (index, item) in leaves.try_iter()?.enumerate() {
            let value = to_json(&item?, 0)?;
            parsed.push(core::manifest::leaf_from_json(index, &value).map_err(manifest_err)?);
        }
        let m = core::Manifest::new(parsed).map_err(manifest_err)?;
        Ok(Manifest::wrap(Arc::new(m)))
    }

    /// Walks nested dicts, lists and tuples of torch tensors and plain values
    /// (e.g. a model and an optimizer state_dict) without copying tensor data.
    ///
    /// This is how to make a manifest for `deeppart plan` / `deeppart simulate`:
    /// `Path("m.json").write_text(Manifest.from_state_dict(state).to_json())`,
    /// or on the command line `deeppart manifest CHECKPOINT|FILE.safetensors|MODEL`.
    #[staticmethod]
    fn from_state_dict(py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<Manifest> {
        let walker = py.import("deeppart.state")?;
        let leaves = walker.call_method1("describe_leaves", (state,))?;
        Manifest::from_leaves(&leaves)
    }

    /// The JSON interchange form (docs/PLANNER.md): `{"version": 1, "leaves":
    /// [{"path": [...], "dtype": ..., "shape": [...]}, ...]}`, what `deeppart
    /// plan` and `deeppart simulate --model FILE` read and `Manifest.from_json`
    /// parses. E.g. `Manifest.from_state_dict(state).to_json()`.
    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Leaf descriptions as dicts, in manifest order.
    fn leaves<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for leaf in self.inner.leaves() {
            let d = PyDict::new(py);
            d.set_item("path", path_to_py(py, &leaf.path)?)?;
            match &leaf.kind {
                core::LeafKind::Tensor { dtype, shape } => {
                    d.set_item("kind", "tensor")?;
                    d.set_item("dtype", dtype.name())?;
                    d.set_item("shape", PyTuple::new(py, shape)?)?;
                }
                core::LeafKind::Object => d.set_item("kind", "object")?,
            }
            d.set_item("nbytes", leaf.nbytes)?;
            d.set_item("owner", leaf.owner)?;
            list.append(d)?;
        }
        Ok(list)
    }

    /// Leaf paths as tuples, in manifest order.
    fn paths<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.inner
            .leaves()
            .iter()
            .map(|l| path_to_py(py, &l.path))
            .collect()
    }

    #[getter]
    fn total_bytes(&self) -> u64 {
        self.inner.total_bytes()
    }

    /// Hex blake3 hash of the structure (paths, kinds, dtypes, shapes, sizes, owners).
    #[getter]
    fn fingerprint(&self) -> String {
        self.fingerprint
            .get_or_init(|| self.inner.fingerprint())
            .clone()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        other
            .cast::<Manifest>()
            .is_ok_and(|o| *o.get().inner == *self.inner)
    }

    fn __hash__(&self) -> u64 {
        let fp = self.fingerprint();
        u64::from_str_radix(&fp[..16], 16).unwrap_or(0)
    }

    fn __repr__(&self) -> String {
        format!(
            "Manifest(leaves={}, total_bytes={})",
            self.inner.len(),
            self.inner.total_bytes()
        )
    }
}

/// Parameters of the write-time model; all times in seconds.
#[pyclass(frozen, eq, module = "deeppart._planner")]
#[derive(Clone, PartialEq)]
struct CostModel {
    inner: core::CostModel,
}

#[pymethods]
impl CostModel {
    #[new]
    #[pyo3(signature = (*, fixed_s=None, piece_s=None, bandwidth=None, writer_s=None, min_piece_bytes=None, align_bytes=None, grain=None, node_bandwidth=None, aggregate_bandwidth=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        fixed_s: Option<f64>,
        piece_s: Option<f64>,
        bandwidth: Option<f64>,
        writer_s: Option<f64>,
        min_piece_bytes: Option<i64>,
        align_bytes: Option<i64>,
        grain: Option<&str>,
        node_bandwidth: Option<f64>,
        aggregate_bandwidth: Option<f64>,
    ) -> PyResult<CostModel> {
        let d = core::CostModel::default();
        let bytes = |name: &str, v: Option<i64>, default: u64| -> PyResult<u64> {
            match v {
                None => Ok(default),
                Some(v) => u64::try_from(v).map_err(|_| {
                    PlanError::new_err(format!(
                        "invalid cost model: {name} must be at least 1, got {v}"
                    ))
                }),
            }
        };
        let inner = core::CostModel {
            fixed_s: fixed_s.unwrap_or(d.fixed_s),
            piece_s: piece_s.unwrap_or(d.piece_s),
            bandwidth: bandwidth.unwrap_or(d.bandwidth),
            writer_s: writer_s.unwrap_or(d.writer_s),
            min_piece_bytes: bytes("min_piece_bytes", min_piece_bytes, d.min_piece_bytes)?,
            align_bytes: bytes("align_bytes", align_bytes, d.align_bytes)?,
            grain: match grain {
                None => d.grain,
                Some(name) => core::Grain::from_name(name).map_err(plan_err)?,
            },
            node_bandwidth,
            aggregate_bandwidth,
        };
        inner.validate().map_err(plan_err)?;
        Ok(CostModel { inner })
    }

    #[getter]
    fn fixed_s(&self) -> f64 {
        self.inner.fixed_s
    }
    #[getter]
    fn piece_s(&self) -> f64 {
        self.inner.piece_s
    }
    #[getter]
    fn bandwidth(&self) -> f64 {
        self.inner.bandwidth
    }
    #[getter]
    fn writer_s(&self) -> f64 {
        self.inner.writer_s
    }
    #[getter]
    fn min_piece_bytes(&self) -> u64 {
        self.inner.min_piece_bytes
    }
    #[getter]
    fn align_bytes(&self) -> u64 {
        self.inner.align_bytes
    }
    #[getter]
    fn grain(&self) -> &'static str {
        self.inner.grain.name()
    }
    #[getter]
    fn node_bandwidth(&self) -> Option<f64> {
        self.inner.node_bandwidth
    }
    #[getter]
    fn aggregate_bandwidth(&self) -> Option<f64> {
        self.inner.aggregate_bandwidth
    }

    fn to_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = &self.inner;
        let d = PyDict::new(py);
        d.set_item("fixed_s", c.fixed_s)?;
        d.set_item("piece_s", c.piece_s)?;
        d.set_item("bandwidth", c.bandwidth)?;
        d.set_item("writer_s", c.writer_s)?;
        d.set_item("min_piece_bytes", c.min_piece_bytes)?;
        d.set_item("align_bytes", c.align_bytes)?;
        d.set_item("grain", c.grain.name())?;
        d.set_item("node_bandwidth", c.node_bandwidth)?;
        d.set_item("aggregate_bandwidth", c.aggregate_bandwidth)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let c = &self.inner;
        let opt = |v: Option<f64>| v.map_or("None".to_string(), |v| format!("{v:?}"));
        format!(
            "CostModel(fixed_s={:?}, piece_s={:?}, bandwidth={:?}, writer_s={:?}, min_piece_bytes={}, \
             align_bytes={}, grain={:?}, node_bandwidth={}, aggregate_bandwidth={})",
            c.fixed_s,
            c.piece_s,
            c.bandwidth,
            c.writer_s,
            c.min_piece_bytes,
            c.align_bytes,
            c.grain.name(),
            opt(c.node_bandwidth),
            opt(c.aggregate_bandwidth)
        )
    }
}

/// How ranks sit on nodes: ranks `[n*ranks_per_node, (n+1)*ranks_per_node)` share node `n`.
#[pyclass(frozen, eq, module = "deeppart._planner")]
#[derive(Clone, PartialEq)]
struct Topology {
    inner: core::Topology,
}

#[pymethods]
impl Topology {
    #[new]
    #[pyo3(signature = (ranks_per_node=1))]
    fn new(ranks_per_node: i64) -> PyResult<Topology> {
        let ranks_per_node = u32::try_from(ranks_per_node)
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| {
                PlanError::new_err(format!(
                    "invalid topology: ranks_per_node must be between 1 and {}, got {ranks_per_node}",
                    u32::MAX
                ))
            })?;
        Ok(Topology {
            inner: core::Topology { ranks_per_node },
        })
    }

    #[getter]
    fn ranks_per_node(&self) -> u32 {
        self.inner.ranks_per_node
    }

    fn __repr__(&self) -> String {
        format!("Topology(ranks_per_node={})", self.inner.ranks_per_node)
    }
}

/// Quality figures of a plan.
#[pyclass(frozen, module = "deeppart._planner")]
struct PlanStats {
    inner: core::PlanStats,
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
struct Plan {
    inner: Arc<core::Plan>,
}

impl Plan {
    fn check_rank(&self, rank: i64) -> PyResult<usize> {
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

    /// The pieces of one rank as `(leaf_path, start, stop)`.
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
        core::plan::evaluate(
            &self.inner.manifest,
            &self.inner.topology,
            &self.inner.cost,
            &self.inner.ranks,
        )
        .rank_cost
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

fn check_world_size(world_size: i64) -> PyResult<u32> {
    if world_size < 1 {
        return Err(PlanError::new_err(format!(
            "world size must be at least 1, got {world_size}"
        )));
    }
    core::check_world_size(world_size as u64).map_err(plan_err)
}

/// Checks and converts the arguments every planning entry point takes.
fn planning_inputs(
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
fn plan_fingerprint(
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
        core::fingerprint::plan_fingerprint(&manifest, world_size, &topology, &cost, algorithm)
    }))
}

/// Computes a plan with the GIL released.
#[pyfunction]
#[pyo3(signature = (manifest, world_size, *, algorithm="balanced", cost=None, topology=None, cache=None))]
fn plan(
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

fn cache_err(e: core::cache::CacheError) -> PyErr {
    CacheError::new_err(e.to_string())
}

/// A two-tier plan cache: a bounded in-process LRU in front of a SQLite
/// store shared by all processes on the host. `directory=None` uses the
/// default location (`$DEEPPART_CACHE_DIR`, `$XDG_CACHE_HOME/deeppart` or
/// `~/.cache/deeppart`); `disk=False` keeps plans in memory only.
/// `planner_version` overrides the version stored with entries (for tests).
#[pyclass(frozen, module = "deeppart._planner")]
struct PlanCache {
    inner: Arc<core::cache::PlanCache>,
}

impl PlanCache {
    /// Turns the core's pending fault reports into `CacheWarning`s. A
    /// warning filter that raises is ignored: the cache never fails a call.
    fn emit_warnings(&self, py: Python<'_>) {
        for message in self.inner.take_warnings() {
            let category = py.get_type::<CacheWarning>();
            let text = std::ffi::CString::new(message.replace('\0', " ")).unwrap_or_default();
            if let Err(e) = PyErr::warn(py, category.as_any(), &text, 2) {
                e.write_unraisable(py, None);
            }
        }
    }
}

#[pymethods]
impl PlanCache {
    #[new]
    #[pyo3(signature = (directory=None, *, memory_entries=64, max_bytes=536870912, disk=true, planner_version=None))]
    fn new(
        directory: Option<std::path::PathBuf>,
        memory_entries: usize,
        max_bytes: u64,
        disk: bool,
        planner_version: Option<String>,
    ) -> PlanCache {
        let defaults = core::cache::CacheOptions::default();
        let directory = if disk {
            directory.or(defaults.directory)
        } else {
            None
        };
        let opts = core::cache::CacheOptions {
            directory,
            memory_entries,
            max_bytes,
            planner_version: planner_version.unwrap_or(defaults.planner_version),
        };
        PlanCache {
            inner: Arc::new(core::cache::PlanCache::new(opts)),
        }
    }

    /// The cache directory, or None for a memory-only cache.
    #[getter]
    fn directory(&self) -> Option<String> {
        self.inner.directory().map(|d| d.display().to_string())
    }

    /// The SQLite database file, or None for a memory-only cache.
    #[getter]
    fn path(&self) -> Option<String> {
        self.inner
            .directory()
            .map(|d| core::store::db_path(d).display().to_string())
    }

    #[getter]
    fn memory_entries(&self) -> usize {
        self.inner.options().memory_entries
    }

    #[getter]
    fn max_bytes(&self) -> u64 {
        self.inner.options().max_bytes
    }

    /// Low-level: the cached plan for these inputs, or None. Counts a hit or miss.
    #[pyo3(signature = (manifest, world_size, *, algorithm="balanced", cost=None, topology=None))]
    fn get(
        &self,
        py: Python<'_>,
        manifest: &Manifest,
        world_size: i64,
        algorithm: &str,
        cost: Option<&CostModel>,
        topology: Option<&Topology>,
    ) -> PyResult<Option<Plan>> {
        if world_size < 1 {
            return Err(PlanError::new_err(format!(
                "world size must be at least 1, got {world_size}"
            )));
        }
        let algorithm: core::Algorithm = algorithm.parse().map_err(plan_err)?;
        let cost = cost.map(|c| c.inner).unwrap_or_default();
        let topology = topology.map(|t| t.inner).unwrap_or_default();
        let manifest = manifest.inner.clone();
        let inner = self.inner.clone();
        let p =
            py.detach(move || inner.get(manifest, world_size as u64, topology, cost, algorithm));
        self.emit_warnings(py);
        Ok(p.map_err(plan_err)?.map(|inner| Plan { inner }))
    }

    /// Low-level: stores a plan in both tiers; returns whether the disk took it.
    fn put(&self, py: Python<'_>, plan: &Plan) -> bool {
        let inner = self.inner.clone();
        let p = plan.inner.clone();
        let stored = py.detach(move || inner.put(p));
        self.emit_warnings(py);
        stored
    }

    /// Counters of this cache object (hits_memory, hits_disk, misses,
    /// evictions, memory_evictions, discarded, stale), the sizes of the
    /// memory tier and of the shared disk store (entries, bytes), and the
    /// disk store's state.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.inner.clone();
        let s = py.detach(move || inner.stats());
        self.emit_warnings(py);
        let d = PyDict::new(py);
        d.set_item("hits_memory", s.hits_memory)?;
        d.set_item("hits_disk", s.hits_disk)?;
        d.set_item("misses", s.misses)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("memory_evictions", s.memory_evictions)?;
        d.set_item("discarded", s.discarded)?;
        d.set_item("stale", s.stale)?;
        d.set_item("memory_entries", s.memory_entries)?;
        d.set_item("entries", s.entries)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("disk", s.disk)?;
        d.set_item("directory", self.directory())?;
        Ok(d)
    }

    /// Empties both tiers (a damaged database is recreated); returns the
    /// number of disk entries removed. Raises CacheError if the store
    /// cannot be opened or written.
    fn clear(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner.clone();
        py.detach(move || inner.clear()).map_err(cache_err)
    }

    /// Checks the database and every entry; deletes entries that fail.
    /// Returns {entries, valid, discarded, other_version}. Raises CacheError
    /// if the database cannot be read or fails SQLite's integrity check.
    fn verify<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let inner = self.inner.clone();
        let r = py.detach(move || inner.verify()).map_err(cache_err)?;
        let d = PyDict::new(py);
        d.set_item("entries", r.entries)?;
        d.set_item("valid", r.valid)?;
        d.set_item("discarded", r.discarded)?;
        d.set_item("other_version", r.other_version)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        match self.inner.directory() {
            Some(d) => format!("PlanCache(directory={:?})", d.display().to_string()),
            None => "PlanCache(disk=False)".to_string(),
        }
    }
}

/// The default plan cache directory: $DEEPPART_CACHE_DIR, else
/// $XDG_CACHE_HOME/deeppart, else ~/.cache/deeppart (None without a home).
#[pyfunction]
fn default_cache_dir() -> Option<String> {
    core::cache::default_cache_dir().map(|d| d.display().to_string())
}

/// Version of the planner, part of every plan fingerprint.
#[pymodule]
fn _planner(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DeepPartError", py.get_type::<DeepPartError>())?;
    m.add("ManifestError", py.get_type::<ManifestError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("CacheWarning", py.get_type::<CacheWarning>())?;
    m.add_class::<PlanCache>()?;
    m.add_function(wrap_pyfunction!(default_cache_dir, m)?)?;
    m.add_class::<Manifest>()?;
    m.add_class::<CostModel>()?;
    m.add_class::<Topology>()?;
    m.add_class::<Plan>()?;
    m.add_class::<PlanStats>()?;
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
    erasure::register(m)?;
    replica::register(m)?;
    Ok(())
}
