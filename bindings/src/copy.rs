//! Streaming copies for Python: `copy_into(dst, src)`, over
//! `deeppart_io::copy`, with the GIL released.

use deeppart_io::copy;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::erasure::ByteView;

/// Copies the bytes of `src` into `dst` (both C-contiguous buffers of the
/// same length; `dst` writable, not overlapping `src`), with non-temporal
/// stores when long (`deeppart_io::copy`), the GIL released.
#[pyfunction]
fn copy_into(py: Python<'_>, dst: &Bound<'_, PyAny>, src: &Bound<'_, PyAny>) -> PyResult<()> {
    let out = ByteView::get_writable(dst, &|| "dst".to_string())?;
    let input = ByteView::get(src, &|| "src".to_string())?;
    let from = input.bytes();
    let len = out.len();
    if len != from.len() {
        return Err(PyValueError::new_err(format!(
            "dst holds {len} bytes, src {}",
            from.len()
        )));
    }
    if len == 0 {
        return Ok(());
    }
    let (d0, s0) = (out.as_mut_ptr() as usize, from.as_ptr() as usize);
    if d0 < s0 + len && s0 < d0 + len {
        return Err(PyValueError::new_err("dst and src overlap"));
    }
    // SAFETY: `out` is a writable, C-contiguous buffer of `len` bytes that
    // stays exported (alive, not resized) until this function returns, and
    // it does not overlap `from` (checked above).
    let to = unsafe { std::slice::from_raw_parts_mut(d0 as *mut u8, len) };
    py.detach(|| copy::copy_streaming(to, from));
    Ok(())
}

/// Adds `copy_into` to the `_planner` module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("STREAMING_MIN_BYTES", copy::STREAMING_MIN_BYTES)?;
    m.add_function(wrap_pyfunction!(copy_into, m)?)?;
    Ok(())
}
