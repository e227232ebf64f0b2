//! `write_hashed(fd, offset, data, chunk, pace)` and `xxh3_64(data)`, over
//! `deeppart_io::filewrite`, with the GIL released for the whole call.

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::unix::io::FromRawFd;

use deeppart_io::filewrite::{self, Pacing};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::erasure::ByteView;

/// Writes the bytes of `data` (a C-contiguous buffer) into the open file
/// descriptor `fd` at `offset`, `chunk` bytes per write call, and returns
/// their xxh3_64; with `pace`, each chunk's write-back is started at once
/// and waited for one chunk behind (`sync_file_range`). The GIL is released
/// throughout; an I/O error is raised as `OSError`. `fd` stays open.
#[pyfunction]
#[pyo3(signature = (fd, offset, data, chunk, pace))]
fn write_hashed(
    py: Python<'_>,
    fd: i32,
    offset: u64,
    data: &Bound<'_, PyAny>,
    chunk: usize,
    pace: bool,
) -> PyResult<u64> {
    if fd < 0 {
        return Err(PyValueError::new_err(format!("fd must be open, not {fd}")));
    }
    let view = ByteView::get(data, &|| "data".to_string())?;
    let bytes = view.bytes();
    // SAFETY: the caller's descriptor stays open for the call (the Python
    // file object holding it is alive in the caller's frame); ManuallyDrop
    // keeps this File from closing it.
    let file = ManuallyDrop::new(unsafe { File::from_raw_fd(fd) });
    let pacing = if pace {
        Pacing::Writeback
    } else {
        Pacing::Kernel
    };
    let sum = py.detach(|| filewrite::write_hashed(&file, offset, bytes, chunk, pacing))?;
    Ok(sum)
}

/// xxh3_64 of the bytes of `data`, the GIL released.
#[pyfunction]
fn xxh3_64(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u64> {
    let view = ByteView::get(data, &|| "data".to_string())?;
    let bytes = view.bytes();
    Ok(py.detach(|| filewrite::xxh3_64(bytes)))
}

/// Adds `write_hashed` and `xxh3_64` to the `_planner` module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(write_hashed, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    Ok(())
}
