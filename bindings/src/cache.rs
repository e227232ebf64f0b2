//! `PlanCache` and `default_cache_dir`, over `deeppart_planner::cache`. The
//! core's fault reports surface as `CacheWarning`s; the cache never fails a
//! planning call.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cost::{CostModel, Topology};
use crate::errors::{cache_err, plan_err, CacheWarning};
use crate::manifest::Manifest;
use crate::pipeline::planning_inputs;
use crate::plan::Plan;

/// A two-tier plan cache: a bounded in-process LRU in front of a SQLite
/// store shared by all processes on the host. `directory=None` uses the
/// default location (`$DEEPPART_CACHE_DIR`, `$XDG_CACHE_HOME/deeppart` or
/// `~/.cache/deeppart`); `disk=False` keeps plans in memory only.
/// `planner_version` overrides the version stored with entries (for tests).
#[pyclass(frozen, module = "deeppart._planner")]
pub(crate) struct PlanCache {
    pub(crate) inner: Arc<core::cache::PlanCache>,
}

impl PlanCache {
    /// Turns the core's pending fault reports into `CacheWarning`s. A
    /// warning filter that raises is ignored: the cache never fails a call.
    pub(crate) fn emit_warnings(&self, py: Python<'_>) {
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
            .map(|d| core::cache::store::db_path(d).display().to_string())
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
        let (world_size, algorithm, cost, topology) =
            planning_inputs(world_size, algorithm, cost, topology)?;
        let manifest = manifest.inner.clone();
        let inner = self.inner.clone();
        let p = py
            .detach(move || inner.get(manifest, u64::from(world_size), topology, cost, algorithm));
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
pub(crate) fn default_cache_dir() -> Option<String> {
    core::cache::default_cache_dir().map(|d| d.display().to_string())
}

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PlanCache>()?;
    m.add_function(wrap_pyfunction!(default_cache_dir, m)?)?;
    Ok(())
}
