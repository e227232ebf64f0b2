//! `Manifest`: the leaves of a state tree, over `deeppart_planner::model::manifest`.

use std::sync::Arc;

use deeppart_planner as core;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use crate::convert::{path_to_py, to_json};
use crate::errors::manifest_err;

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
    #[staticmethod]
    #[pyo3(signature = (leaves, groups=None))]
    fn from_leaves(
        leaves: &Bound<'_, PyAny>,
        groups: Option<&Bound<'_, PyAny>>,
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
        let mut parsed = Vec::new();
        for (index, item) in leaves.try_iter()?.enumerate() {
            let value = to_json(&item?, 0)?;
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
        Manifest::from_leaves(&leaves, None)
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
