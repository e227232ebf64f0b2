//! The Python exception classes of `deeppart._planner`, and the conversion of
//! the core's errors to them. Every class derives from `DeepPartError`
//! (`CacheWarning` is a warning, not an error); `ErasureError` lives with the
//! erasure coder (`erasure.rs`).

use deeppart_planner as core;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

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

pub(crate) fn manifest_err(e: core::ManifestError) -> PyErr {
    ManifestError::new_err(e.to_string())
}

pub(crate) fn plan_err(e: core::PlanError) -> PyErr {
    PlanError::new_err(e.to_string())
}

pub(crate) fn cache_err(e: core::cache::CacheError) -> PyErr {
    CacheError::new_err(e.to_string())
}

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DeepPartError", py.get_type::<DeepPartError>())?;
    m.add("ManifestError", py.get_type::<ManifestError>())?;
    m.add("PlanError", py.get_type::<PlanError>())?;
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("CacheWarning", py.get_type::<CacheWarning>())?;
    Ok(())
}
