//! `Manifest`: the leaves of a state tree, over `deeppart_planner::model::manifest`.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{path_to_py, to_json};
use crate::errors::{manifest_err, ManifestError};

/// An ordered list of the leaves of a state tree: paths, dtypes, shapes,
/// sizes and owners. Immutable.
#[pyclass(frozen, module = "deeppart._planner")]
pub(crate) struct Manifest {
    pub(crate) inner: Arc<core::Manifest>,
    /// The structure hash, computed on first use: it is asked for often.
    fingerprint: std::sync::OnceLock<String>,
}

impl Manifest {
    pub(crate) fn wrap(inner: Arc<core::Manifest>) -> Manifest {
        Manifest {
            inner,
            fingerprint: std::sync::OnceLock::new(),
        }
    }
}

/// A leaf read straight from its description dict, when it is a valid
/// one of the usual form (`path` of str and int keys, `dtype`/`shape` or
/// `kind="object"`/`nbytes`, `owner`, `holders`); None for anything else,
/// which the JSON form's parser then reads (and names what is wrong): a
/// union of a million shard leaves is described in these dicts.
fn leaf_from_dict(d: &Bound<'_, PyDict>) -> Option<core::Leaf> {
    use core::model::manifest::{MAX_DIMS, MAX_PATH_DEPTH};
    use pyo3::types::{PyBool, PyInt, PyString};

    fn int(v: &Bound<'_, PyAny>) -> Option<i64> {
        if v.cast::<PyBool>().is_ok() || v.cast::<PyInt>().is_err() {
            return None;
        }
        v.extract::<i64>().ok()
    }
    fn items<'py>(v: &Bound<'py, PyAny>) -> Option<Vec<Bound<'py, PyAny>>> {
        if let Ok(l) = v.cast::<PyList>() {
            return Some(l.iter().collect());
        }
        v.cast::<PyTuple>().ok().map(|t| t.iter().collect())
    }
    fn small(v: &Bound<'_, PyAny>) -> Option<Option<u32>> {
        if v.is_none() {
            return Some(None);
        }
        u32::try_from(int(v)?).ok().map(Some)
    }
    let (mut path, mut dtype, mut shape, mut kind, mut nbytes) = (None, None, None, None, None);
    let (mut owner, mut holders) = (None, None);
    for (k, v) in d.iter() {
        match k.cast::<PyString>().ok()?.to_str().ok()? {
            "path" => {
                let keys = items(&v)?;
                if keys.is_empty() || keys.len() > MAX_PATH_DEPTH {
                    return None;
                }
                let mut out = Vec::with_capacity(keys.len());
                for key in keys {
                    if let Ok(s) = key.cast::<PyString>() {
                        out.push(core::PathKey::Str(s.to_str().ok()?.to_owned()));
                    } else {
                        out.push(core::PathKey::Int(int(&key)?));
                    }
                }
                path = Some(out);
            }
            "dtype" => {
                dtype = Some(core::DType::parse(
                    v.cast::<PyString>().ok()?.to_str().ok()?,
                )?)
            }
            "shape" => {
                let dims = items(&v)?;
                if dims.len() > MAX_DIMS {
                    return None;
                }
                let dims: Option<Vec<u64>> =
                    dims.iter().map(|n| u64::try_from(int(n)?).ok()).collect();
                shape = Some(dims?);
            }
            "kind" => kind = Some(v.cast::<PyString>().ok()?.to_str().ok()?.to_owned()),
            "nbytes" => nbytes = Some(u64::try_from(int(&v)?).ok()?),
            "owner" => owner = small(&v)?,
            "holders" => holders = small(&v)?,
            _ => return None,
        }
    }
    let leaf = match kind.as_deref().unwrap_or("tensor") {
        "tensor" => {
            let leaf = core::Leaf::tensor(path?, dtype?, shape?, owner).ok()?;
            if nbytes.is_some_and(|n| n != leaf.nbytes) {
                return None;
            }
            leaf
        }
        "object" if dtype.is_none() && shape.is_none() => {
            core::Leaf::object(path?, nbytes?, owner).ok()?
        }
        _ => return None,
    };
    Some(leaf.with_holders(holders))
}

/// One shard of a table of `Manifest.from_leaves`: its shape, owner and
/// holder group.
type TableShard = (Vec<u64>, Option<u32>, Option<u32>);

/// The shard tables of `Manifest.from_leaves`: per table, per shard
/// `[shape, owner, holders]`.
fn shard_tables(tables: &Bound<'_, PyAny>) -> PyResult<Vec<Vec<TableShard>>> {
    use core::model::manifest::MAX_DIMS;
    let bad = |t: usize, k: usize, what: &str| {
        ManifestError::new_err(format!("shard table {t}, shard {k}: {what}"))
    };
    let mut out = Vec::new();
    for (t, table) in tables.try_iter()?.enumerate() {
        let mut shards = Vec::new();
        for (k, entry) in table?.try_iter()?.enumerate() {
            let entry = entry?;
            let row = |entry: &Bound<'_, PyAny>| -> PyResult<(Vec<i64>, Option<i64>, Option<i64>)> {
                let fields: Vec<Bound<'_, PyAny>> = entry.try_iter()?.collect::<PyResult<_>>()?;
                let [shape, owner, holders] = <[Bound<'_, PyAny>; 3]>::try_from(fields)
                    .map_err(|_| pyo3::exceptions::PyValueError::new_err("not 3 fields"))?;
                Ok((shape.extract()?, owner.extract()?, holders.extract()?))
            };
            let (shape, owner, holders) =
                row(&entry).map_err(|_| bad(t, k, "not [shape, owner, holders] of ints"))?;
            if shape.len() > MAX_DIMS {
                return Err(bad(t, k, "too many dimensions"));
            }
            let shape: Option<Vec<u64>> = shape.iter().map(|&n| u64::try_from(n).ok()).collect();
            let shape = shape.ok_or_else(|| bad(t, k, "a negative dimension"))?;
            let small = |v: Option<i64>, what: &str| match v {
                None => Ok(None),
                Some(n) => u32::try_from(n).map(Some).map_err(|_| bad(t, k, what)),
            };
            shards.push((
                shape,
                small(owner, "owner out of range")?,
                small(holders, "holder group out of range")?,
            ));
        }
        out.push(shards);
    }
    Ok(out)
}

/// The leaves of one block item of `Manifest.from_leaves` (`path`, `dtype`,
/// `table`): one per shard of its table, at `path + [shard_key, k]`.
fn shard_block(
    index: usize,
    item: &Bound<'_, PyDict>,
    table: &Bound<'_, PyAny>,
    tables: &[Vec<TableShard>],
    shard_key: Option<&str>,
    out: &mut Vec<core::Leaf>,
) -> PyResult<()> {
    use core::model::manifest::MAX_PATH_DEPTH;
    let bad = |what: String| ManifestError::new_err(format!("leaf {index}: {what}"));
    let key = shard_key.ok_or_else(|| bad("a shard table item without a shard_key".into()))?;
    if item.len() != 3 {
        return Err(bad(
            "a shard table item has keys other than path, dtype, table".into(),
        ));
    }
    let t: usize = table
        .extract()
        .map_err(|_| bad("its table is not an index".into()))?;
    let shards = tables
        .get(t)
        .ok_or_else(|| bad(format!("table {t} of {}", tables.len())))?;
    let dtype: String = item
        .get_item("dtype")?
        .ok_or_else(|| bad("no dtype".into()))?
        .extract()
        .map_err(|_| bad("its dtype is not a string".into()))?;
    let dtype =
        core::DType::parse(&dtype).ok_or_else(|| bad(format!("unknown dtype {dtype:?}")))?;
    let path_value = item
        .get_item("path")?
        .ok_or_else(|| bad("no path".into()))?;
    let mut path = Vec::new();
    for key in path_value
        .try_iter()
        .map_err(|_| bad("its path is not a list".into()))?
    {
        let key = key?;
        if let Ok(s) = key.cast::<pyo3::types::PyString>() {
            path.push(core::PathKey::Str(s.to_str()?.to_owned()));
        } else if key.cast::<pyo3::types::PyBool>().is_err() {
            let n: i64 = key
                .extract()
                .map_err(|_| bad("a path key is neither a string nor an int".into()))?;
            path.push(core::PathKey::Int(n));
        } else {
            return Err(bad("a path key is a bool".into()));
        }
    }
    if path.is_empty() || path.len() + 2 > MAX_PATH_DEPTH {
        return Err(bad(format!("its path has {} keys", path.len())));
    }
    for (k, (shape, owner, holders)) in shards.iter().enumerate() {
        let mut p = path.clone();
        p.push(core::PathKey::Str(key.to_owned()));
        p.push(core::PathKey::Int(k as i64));
        let leaf = core::Leaf::tensor(p, dtype, shape.clone(), *owner)
            .map_err(|e| bad(format!("shard {k}: {e}")))?;
        out.push(leaf.with_holders(*holders));
    }
    Ok(())
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
    /// JSON form (`path`, `dtype`, `shape`, or `kind="object"` and `nbytes`,
    /// `owner`, `holders`), and the holder groups (lists of ranks) that the
    /// leaves' `holders` index.
    ///
    /// With `tables` (lists of `[shape, owner, holders]`, one per shard: the
    /// shards of one DTensor layout), an item `{"path": P, "dtype": D,
    /// "table": t}` stands for one leaf per entry `k` of table `t`, at path
    /// `P + [shard_key, k]`: a union of a million shard leaves is described
    /// by its DTensors.
    #[staticmethod]
    #[pyo3(signature = (leaves, groups=None, tables=None, shard_key=None))]
    fn from_leaves(
        leaves: &Bound<'_, PyAny>,
        groups: Option<&Bound<'_, PyAny>>,
        tables: Option<&Bound<'_, PyAny>>,
        shard_key: Option<&str>,
    ) -> PyResult<Manifest> {
        // The groups first: their size is checked before the leaves are read.
        let groups = match groups {
            None => Vec::new(),
            Some(g) if g.is_none() => Vec::new(),
            Some(g) => {
                let value = to_json(g, 0)?;
                core::model::manifest::groups_from_json(&value).map_err(manifest_err)?
            }
        };
        let tables = match tables {
            None => Vec::new(),
            Some(t) if t.is_none() => Vec::new(),
            Some(t) => shard_tables(t)?,
        };
        let mut parsed = Vec::new();
        for (index, item) in leaves.try_iter()?.enumerate() {
            let item = item?;
            if let Ok(d) = item.cast::<PyDict>() {
                if let Some(table) = d.get_item("table")? {
                    shard_block(index, d, &table, &tables, shard_key, &mut parsed)?;
                    continue;
                }
            }
            if let Some(leaf) = item.cast::<PyDict>().ok().and_then(|d| leaf_from_dict(d)) {
                parsed.push(leaf);
                continue;
            }
            // Anything else (or anything wrong) through the JSON form, whose
            // parser names what is wrong.
            let value = to_json(&item, 0)?;
            parsed
                .push(core::model::manifest::leaf_from_json(index, &value).map_err(manifest_err)?);
        }
        let m = core::Manifest::with_groups(parsed, groups).map_err(manifest_err)?;
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
        let walker = py.import("deeppart.state.state")?;
        let leaves = walker.call_method1("describe_leaves", (state,))?;
        Manifest::from_leaves(&leaves, None, None, None)
    }

    /// The JSON interchange form (docs/PLANNER.md): `{"version": 1, "leaves":
    /// [{"path": [...], "dtype": ..., "shape": [...]}, ...]}` (version 2 with
    /// `"groups"` when the manifest has holder groups), what `deeppart
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
            d.set_item("holders", leaf.holders)?;
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

    /// The holder groups, each a sorted list of distinct ranks; a leaf's
    /// `holders` is an index into it. Empty for a manifest without groups.
    #[getter]
    fn groups(&self) -> Vec<Vec<u32>> {
        self.inner.groups().to_vec()
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

/// Adds this module's classes and functions to `deeppart._planner`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Manifest>()?;
    // The holder groups' limits, so that the Python readers of other
    // encodings (metadata.json, the wire's packed arrays) check the same.
    m.add("MAX_GROUPS", core::model::manifest::MAX_GROUPS)?;
    m.add(
        "MAX_GROUP_ENTRIES",
        core::model::manifest::MAX_GROUP_ENTRIES,
    )?;
    m.add("MAX_GROUP_RANK", core::model::manifest::MAX_GROUP_RANK)?;
    Ok(())
}
