//! `deeppart._planner`: a thin PyO3 layer over the `deeppart-planner` crate.
//! It converts values, maps Rust errors to Python exception classes, and
//! releases the GIL around long work. One module per concern, mirroring
//! `planner/src`; this file only registers them.

use pyo3::prelude::*;

mod cache;
mod convert;
mod copy;
mod cost;
mod erasure;
mod errors;
mod filewrite;
mod manifest;
mod pipeline;
mod plan;
mod replica;

/// The extension module: every concern registers its own names.
#[pymodule]
fn _planner(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    manifest::register(m)?;
    cost::register(m)?;
    plan::register(m)?;
    pipeline::register(m)?;
    cache::register(m)?;
    erasure::register(m)?;
    replica::register(m)?;
    copy::register(m)?;
    filewrite::register(m)?;
    Ok(())
}
