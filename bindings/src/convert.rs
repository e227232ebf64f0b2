//! Conversions between Python values and the core's: plain Python data to
//! JSON (so that leaves given as Python objects are validated exactly like
//! JSON ones) and leaf paths to tuples.

use deeppart_planner as core;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value};

use crate::errors::ManifestError;

/// Converts plain Python data (dict, list, tuple, str, int, float, bool, None)
/// to JSON, so that Python leaves are validated exactly like JSON ones.
pub(crate) fn to_json(obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<Value> {
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

pub(crate) fn path_to_py<'py>(
    py: Python<'py>,
    path: &[core::PathKey],
) -> PyResult<Bound<'py, PyTuple>> {
    let items: Vec<Bound<'py, PyAny>> = path
        .iter()
        .map(|k| match k {
            core::PathKey::Str(s) => Ok(PyString::new(py, s).into_any()),
            core::PathKey::Int(i) => Ok(i.into_pyobject(py)?.into_any()),
        })
        .collect::<PyResult<_>>()?;
    PyTuple::new(py, items)
}
