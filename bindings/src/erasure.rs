//! Reed–Solomon erasure coding for Python: `rs_encode`, `rs_reconstruct`
//! and `ErasureError`, over `deeppart_io::erasure`.
//!
//! Inputs are any C-contiguous buffers (bytes, bytearray, memoryview, numpy
//! arrays...), read in place as raw bytes: no copy on the way in. Outputs
//! are `bytes` objects allocated up front and written once, with the GIL
//! released, by the coder itself: one copy on the way out, none extra.
//! While the GIL is released the input buffers stay exported (bytearrays
//! cannot be resized), but a thread writing to one at the same time gets
//! undefined parity, as with any buffer-consuming C extension.

use deeppart_io::erasure::{self, ErasureCode};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMapping};

use crate::errors::DeepPartError;

create_exception!(
    _planner,
    ErasureError,
    DeepPartError,
    "Reed-Solomon parity cannot be computed, or the surviving shards cannot restore the data."
);

fn erasure_err(e: erasure::ErasureError) -> PyErr {
    ErasureError::new_err(e.to_string())
}

/// A Python buffer held open and read as bytes.
pub(crate) struct ByteView(PyUntypedBuffer);

impl ByteView {
    pub(crate) fn get(obj: &Bound<'_, PyAny>, what: &dyn Fn() -> String) -> PyResult<ByteView> {
        let buf = PyUntypedBuffer::get(obj).map_err(|_| {
            let type_name = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            PyTypeError::new_err(format!(
                "{} must be a bytes-like object (buffer protocol), not {type_name}",
                what()
            ))
        })?;
        if !buf.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{} must be a C-contiguous buffer",
                what()
            )));
        }
        Ok(ByteView(buf))
    }

    /// [`ByteView::get`] of a buffer that must also be writable.
    pub(crate) fn get_writable(
        obj: &Bound<'_, PyAny>,
        what: &dyn Fn() -> String,
    ) -> PyResult<ByteView> {
        let view = ByteView::get(obj, what)?;
        if view.0.readonly() {
            return Err(PyTypeError::new_err(format!(
                "{} must be a writable buffer",
                what()
            )));
        }
        Ok(view)
    }

    /// The buffer's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.0.len_bytes()
    }

    /// The buffer's first byte, for a writer that checked the view is
    /// writable ([`ByteView::get_writable`]) and that no other live slice
    /// overlaps the bytes it writes.
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.0.buf_ptr() as *mut u8
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        let len = self.0.len_bytes();
        if len == 0 {
            return &[];
        }
        // SAFETY: the buffer is C-contiguous, `len_bytes` long and stays
        // exported (so alive and not resized) for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, len) }
    }
}

/// A new `bytes` object of `len` bytes, not yet written, and its buffer's
/// address (as usize, to travel into a GIL-free closure). The caller writes
/// all `len` bytes before the object is seen by Python, as CPython's
/// `PyBytes_FromStringAndSize(NULL, n)` idiom requires.
fn new_bytes(py: Python<'_>, len: usize) -> PyResult<(Bound<'_, PyBytes>, usize)> {
    let size = ffi::Py_ssize_t::try_from(len)
        .map_err(|_| PyValueError::new_err(format!("shard of {len} bytes is too large")))?;
    // SAFETY: a NULL source asks CPython for an uninitialized bytes object;
    // a NULL result is turned into the pending Python error.
    let obj = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PyBytes_FromStringAndSize(std::ptr::null(), size))?
    };
    // SAFETY: `obj` is a bytes object, just created.
    let ptr = unsafe { ffi::PyBytes_AsString(obj.as_ptr()) } as usize;
    Ok((obj.cast_into::<PyBytes>()?, ptr))
}

/// Writes `src` to an output buffer from [`new_bytes`], at an address with
/// `src.len()` bytes left in it.
fn fill(ptr: usize, src: &[u8]) {
    if !src.is_empty() {
        // SAFETY: `ptr` addresses a buffer of `src.len()` bytes that nothing
        // else reads or writes until the call returns.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), ptr as *mut u8, src.len()) }
    }
}

fn count(value: i64, what: &str) -> PyResult<usize> {
    usize::try_from(value)
        .map_err(|_| ErasureError::new_err(format!("{what} must be at least 1, got {value}")))
}

/// Parity of `shards` (data shards of any lengths, each a C-contiguous
/// buffer) with `parity` parity shards. Every parity shard has the longest
/// data length rounded up to even; keep the data lengths to reconstruct.
#[pyfunction]
fn rs_encode<'py>(
    py: Python<'py>,
    shards: &Bound<'py, PyAny>,
    parity: i64,
) -> PyResult<Bound<'py, PyList>> {
    let mut views = Vec::new();
    for (i, item) in shards.try_iter()?.enumerate() {
        views.push(ByteView::get(&item?, &|| format!("data shard {i}"))?);
    }
    let code =
        ErasureCode::new(views.len(), count(parity, "the parity count")?).map_err(erasure_err)?;
    let lengths: Vec<usize> = views.iter().map(|v| v.0.len_bytes()).collect();
    let len = erasure::shard_len(&lengths);
    let mut outputs = Vec::with_capacity(code.parity_count());
    let mut ptrs = Vec::with_capacity(code.parity_count());
    for _ in 0..code.parity_count() {
        let (obj, ptr) = new_bytes(py, len)?;
        outputs.push(obj);
        ptrs.push(ptr);
    }
    let data: Vec<&[u8]> = views.iter().map(ByteView::bytes).collect();
    py.detach(|| {
        code.encode_with(&data, |index, offset, piece| {
            fill(ptrs[index] + offset, piece)
        })
    })
    .map_err(erasure_err)?;
    PyList::new(py, outputs)
}

fn shard_map(
    shards: &Bound<'_, PyMapping>,
    kind: &str,
    views: &mut Vec<(usize, ByteView, Py<PyAny>)>,
) -> PyResult<()> {
    for item in shards.items()?.iter() {
        let (key, value): (Bound<'_, PyAny>, Bound<'_, PyAny>) = item.extract()?;
        let index: i64 = key.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{kind} shard keys must be int indices, got {key:?}"
            ))
        })?;
        let index = usize::try_from(index).map_err(|_| {
            ErasureError::new_err(format!("{kind} shard index {index} is out of range"))
        })?;
        let view = ByteView::get(&value, &|| format!("{kind} shard {index}"))?;
        views.push((index, view, value.unbind()));
    }
    Ok(())
}

/// All `original_count` data shards, restored from the survivors:
/// `originals` maps data shard index to its bytes (at its recorded length),
/// `parity` maps parity shard index to its bytes, `lengths` are the recorded
/// lengths of all data shards. Surviving data shards given as `bytes` are
/// returned as the same objects; everything else is new `bytes`.
#[pyfunction]
fn rs_reconstruct<'py>(
    py: Python<'py>,
    original_count: i64,
    parity_count: i64,
    originals: &Bound<'py, PyMapping>,
    parity: &Bound<'py, PyMapping>,
    lengths: Vec<i64>,
) -> PyResult<Bound<'py, PyList>> {
    let code = ErasureCode::new(
        count(original_count, "the data shard count")?,
        count(parity_count, "the parity count")?,
    )
    .map_err(erasure_err)?;
    let lengths: Vec<usize> = lengths
        .iter()
        .map(|&n| {
            usize::try_from(n).map_err(|_| {
                PyValueError::new_err(format!("shard lengths must be non-negative, got {n}"))
            })
        })
        .collect::<PyResult<_>>()?;
    let mut data_views = Vec::new();
    shard_map(originals, "data", &mut data_views)?;
    let mut parity_views = Vec::new();
    shard_map(parity, "parity", &mut parity_views)?;
    let present: Vec<(usize, &[u8])> = data_views.iter().map(|(i, v, _)| (*i, v.bytes())).collect();
    let recovery: Vec<(usize, &[u8])> = parity_views
        .iter()
        .map(|(i, v, _)| (*i, v.bytes()))
        .collect();
    // Everything is checked before any output is allocated, so a wrong
    // length cannot ask for a huge allocation.
    let missing = code
        .check(&present, &recovery, &lengths)
        .map_err(erasure_err)?;

    let mut outputs: Vec<Option<Bound<'py, PyAny>>> = vec![None; code.original_count()];
    let mut ptrs = vec![0usize; code.original_count()];
    // Surviving data shards: the same object when it is immutable bytes,
    // otherwise a copy made below without the GIL.
    let mut copies = Vec::new();
    for (index, _, obj) in &data_views {
        let obj = obj.bind(py);
        if obj.is_exact_instance_of::<PyBytes>() {
            outputs[*index] = Some(obj.clone());
        } else {
            let (out, ptr) = new_bytes(py, lengths[*index])?;
            outputs[*index] = Some(out.into_any());
            ptrs[*index] = ptr;
            copies.push(*index);
        }
    }
    for &index in &missing {
        let (out, ptr) = new_bytes(py, lengths[index])?;
        outputs[index] = Some(out.into_any());
        ptrs[index] = ptr;
    }
    let present_at: Vec<Option<&[u8]>> = {
        let mut v = vec![None; code.original_count()];
        for &(i, s) in &present {
            v[i] = Some(s);
        }
        v
    };
    py.detach(|| {
        code.reconstruct_with(&present, &recovery, &lengths, |index, offset, piece| {
            fill(ptrs[index] + offset, piece)
        })?;
        for &index in &copies {
            if let Some(src) = present_at[index] {
                fill(ptrs[index], src);
            }
        }
        Ok::<(), erasure::ErasureError>(())
    })
    .map_err(erasure_err)?;
    let outputs: Vec<Bound<'py, PyAny>> = outputs
        .into_iter()
        .map(|o| o.ok_or_else(|| ErasureError::new_err("a data shard was not restored")))
        .collect::<PyResult<_>>()?;
    PyList::new(py, outputs)
}

/// Adds the erasure coding API to the `_planner` module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("ErasureError", py.get_type::<ErasureError>())?;
    m.add_function(wrap_pyfunction!(rs_encode, m)?)?;
    m.add_function(wrap_pyfunction!(rs_reconstruct, m)?)?;
    Ok(())
}
