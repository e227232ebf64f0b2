//! Replica digests for Python: `replica_digests` and `differing_leaves`,
//! over `deeppart_io::replica`. The buffers are read in place, with the
//! GIL released while hashing.

use deeppart_io::replica;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::erasure::ByteView;

/// The digests (16 bytes each, concatenated) of `buffers`, each a
/// C-contiguous buffer, hashed on at most `threads` threads.
#[pyfunction]
#[pyo3(signature = (buffers, threads = 1))]
fn replica_digests<'py>(
    py: Python<'py>,
    buffers: &Bound<'py, PyAny>,
    threads: i64,
) -> PyResult<Bound<'py, PyBytes>> {
    let threads = usize::try_from(threads)
        .ok()
        .filter(|&t| t >= 1)
        .ok_or_else(|| {
            PyValueError::new_err(format!("threads must be at least 1, got {threads}"))
        })?;
    let mut views = Vec::new();
    for (i, item) in buffers.try_iter()?.enumerate() {
        views.push(ByteView::get(&item?, &|| format!("leaf buffer {i}"))?);
    }
    let leaves: Vec<&[u8]> = views.iter().map(ByteView::bytes).collect();
    let digests = py.detach(|| replica::leaf_digests(&leaves, threads));
    Ok(PyBytes::new(py, &digests))
}

/// The leaves on which ranks' digests (`per_rank[r]` from
/// `replica_digests` on rank `r`) differ, each with the ranks that differ
/// from the majority.
#[pyfunction]
fn differing_leaves(per_rank: Vec<Vec<u8>>, leaves: usize) -> Vec<(usize, Vec<usize>)> {
    let views: Vec<&[u8]> = per_rank.iter().map(Vec::as_slice).collect();
    replica::differing_leaves(&views, leaves)
}

/// Adds the replica digest API to the `_planner` module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("REPLICA_DIGEST_LEN", replica::DIGEST_LEN)?;
    m.add_function(wrap_pyfunction!(replica_digests, m)?)?;
    m.add_function(wrap_pyfunction!(differing_leaves, m)?)?;
    Ok(())
}
