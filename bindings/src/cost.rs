//! `CostModel` and `Topology`: what writing costs and how ranks sit on
//! nodes, over `deeppart_planner::model::cost`.

use deeppart_planner as core;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::{plan_err, PlanError};

/// Parameters of the write-time model; all times in seconds.
#[pyclass(frozen, eq, module = "deeppart._planner")]
#[derive(Clone, PartialEq)]
pub(crate) struct CostModel {
    pub(crate) inner: core::CostModel,
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
pub(crate) struct Topology {
    pub(crate) inner: core::Topology,
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

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CostModel>()?;
    m.add_class::<Topology>()?;
    Ok(())
}
