//! The manifest: an ordered list of the leaves of a state tree, with their
//! sizes and holders. It is what the planner partitions.
//!
//! Who holds a leaf: every rank (the default), one rank (`owner`), or the
//! ranks of one of the manifest's holder *groups* (`holders`, an index into
//! [`Manifest::groups`]; version 2 of the JSON form). The holders of a leaf
//! have identical bytes of it, and only they may write it.

use std::collections::HashMap;
use std::fmt;

use serde_json::{json, Map, Value};

use crate::error::ManifestError;
use crate::model::dtype::DType;

/// Version of the JSON interchange form without holder groups; written for
/// every manifest that has none, so that such manifests read and write as before.
pub const MANIFEST_VERSION: u64 = 1;
/// Version of the JSON interchange form with holder groups (`"groups"` and
/// a leaf's `"holders"`).
pub const MANIFEST_VERSION_GROUPS: u64 = 2;
/// Most holder groups a manifest may have.
pub const MAX_GROUPS: usize = 1 << 16;
/// Most rank entries all holder groups of a manifest may have together.
pub const MAX_GROUP_ENTRIES: usize = 1 << 22;
/// Ranks in a holder group are below this (the largest world size).
pub const MAX_GROUP_RANK: u64 = 1 << 20;
/// Largest accepted size of one leaf, and of a whole manifest (1 EiB).
pub const MAX_BYTES: u64 = 1 << 60;
/// Most leaves a manifest may have.
pub const MAX_LEAVES: usize = 50_000_000;
/// Most dimensions a tensor leaf may have.
pub const MAX_DIMS: usize = 64;
/// Most keys a leaf path may have.
pub const MAX_PATH_DEPTH: usize = 256;

/// One key of a leaf path: a dict key or a list/tuple index.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PathKey {
    Str(String),
    Int(i64),
}

impl fmt::Display for PathKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PathKey::Str(s) => f.write_str(s),
            PathKey::Int(i) => write!(f, "{i}"),
        }
    }
}

/// Formats a path as `a/b/0`, for messages.
pub fn display_path(path: &[PathKey]) -> String {
    if path.is_empty() {
        return "<empty path>".to_string();
    }
    path.iter()
        .map(|k| k.to_string())
        .collect::<Vec<_>>()
        .join("/")
}

/// What a leaf holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LeafKind {
    /// A dense tensor; it can be split into contiguous element ranges.
    Tensor { dtype: DType, shape: Vec<u64> },
    /// An opaque object of a known encoded size; it is written whole.
    Object,
}

/// One leaf of the state tree.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Leaf {
    pub path: Vec<PathKey>,
    pub kind: LeafKind,
    /// Size in bytes (derived from dtype and shape for tensors).
    pub nbytes: u64,
    /// The only rank that has this leaf; `None` means replicated on all ranks
    /// (unless `holders` names a group).
    pub owner: Option<u32>,
    /// The holder group of this leaf: an index into [`Manifest::groups`].
    /// `None` (and no `owner`) means held by every rank. A leaf has at most
    /// one of `owner` and `holders`.
    pub holders: Option<u32>,
}

/// The byte size of a tensor of `shape` and `dtype`; an error for too many
/// dimensions, an overflow or more than `MAX_BYTES`.
fn tensor_nbytes(dtype: DType, shape: &[u64]) -> Result<u64, String> {
    if shape.len() > MAX_DIMS {
        return Err(format!(
            "tensor has {} dimensions, more than {MAX_DIMS}",
            shape.len()
        ));
    }
    let mut numel: u64 = 1;
    for &d in shape {
        numel = numel
            .checked_mul(d)
            .ok_or_else(|| format!("shape {shape:?} overflows: its element count exceeds 2^64"))?;
    }
    let nbytes = numel.checked_mul(dtype.itemsize()).ok_or_else(|| {
        format!("shape {shape:?} of {dtype} overflows: its byte size exceeds 2^64")
    })?;
    if nbytes > MAX_BYTES {
        return Err(format!(
            "shape {shape:?} of {dtype} is {nbytes} bytes, more than the limit of {MAX_BYTES}"
        ));
    }
    Ok(nbytes)
}

impl Leaf {
    /// A tensor leaf; checks the shape for overflow and absurd sizes.
    pub fn tensor(
        path: Vec<PathKey>,
        dtype: DType,
        shape: Vec<u64>,
        owner: Option<u32>,
    ) -> Result<Leaf, String> {
        let nbytes = tensor_nbytes(dtype, &shape)?;
        Ok(Leaf {
            path,
            kind: LeafKind::Tensor { dtype, shape },
            nbytes,
            owner,
            holders: None,
        })
    }

    /// An opaque object leaf of `nbytes` bytes.
    pub fn object(path: Vec<PathKey>, nbytes: u64, owner: Option<u32>) -> Result<Leaf, String> {
        if nbytes > MAX_BYTES {
            return Err(format!(
                "object of {nbytes} bytes is larger than the limit of {MAX_BYTES}"
            ));
        }
        Ok(Leaf {
            path,
            kind: LeafKind::Object,
            nbytes,
            owner,
            holders: None,
        })
    }

    /// The same leaf, held by the ranks of group `holders` (an index into
    /// the groups of the manifest it goes into).
    pub fn with_holders(mut self, holders: Option<u32>) -> Leaf {
        self.holders = holders;
        self
    }

    /// Whether every rank holds this leaf (no owner, no holder group).
    pub fn is_replicated(&self) -> bool {
        self.owner.is_none() && self.holders.is_none()
    }

    /// Number of plan units: elements for a tensor, 1 for an object.
    pub fn units(&self) -> u64 {
        match &self.kind {
            LeafKind::Tensor { dtype, .. } => self.nbytes / dtype.itemsize(),
            LeafKind::Object => 1,
        }
    }

    /// Bytes per plan unit.
    pub fn unit_bytes(&self) -> u64 {
        match &self.kind {
            LeafKind::Tensor { dtype, .. } => dtype.itemsize(),
            LeafKind::Object => self.nbytes,
        }
    }

    /// Units per row: a split of a tensor with 2 or more dimensions falls on
    /// a multiple of this. 1 for 0-D and 1-D tensors; the whole leaf for objects.
    /// A tensor with no elements can have a row size that overflows `u64`
    /// (shape `[0, 2^40, 2^40]`); it has no rows to split, and gets 1.
    pub fn row_units(&self) -> u64 {
        match &self.kind {
            LeafKind::Tensor { shape, .. } if shape.len() >= 2 => shape[1..]
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .unwrap_or(1)
                .max(1),
            LeafKind::Tensor { .. } => 1,
            LeafKind::Object => 1,
        }
    }

    /// Bytes of the unit range `[start, stop)`.
    pub fn range_bytes(&self, start: u64, stop: u64) -> u64 {
        match &self.kind {
            LeafKind::Object => {
                if stop > start {
                    self.nbytes
                } else {
                    0
                }
            }
            LeafKind::Tensor { dtype, .. } => (stop - start) * dtype.itemsize(),
        }
    }

    pub fn is_tensor(&self) -> bool {
        matches!(self.kind, LeafKind::Tensor { .. })
    }

    pub fn display_path(&self) -> String {
        display_path(&self.path)
    }
}

/// An ordered, validated list of leaves.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Manifest {
    leaves: Vec<Leaf>,
    /// Holder groups: each a sorted list of distinct ranks, not empty.
    groups: Vec<Vec<u32>>,
    total_bytes: u64,
}

/// The ranks that hold a leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holders<'a> {
    /// Every rank of the world.
    All,
    /// These ranks (sorted, distinct, not empty): the owner, or a group.
    Ranks(&'a [u32]),
}

impl Holders<'_> {
    /// Whether `rank` holds the leaf.
    pub fn contains(&self, rank: u32) -> bool {
        match self {
            Holders::All => true,
            Holders::Ranks(ranks) => ranks.binary_search(&rank).is_ok(),
        }
    }
}

impl Manifest {
    /// Validates and builds a manifest without holder groups: no duplicate or
    /// empty paths, sizes in range, total size without overflow.
    pub fn new(leaves: Vec<Leaf>) -> Result<Manifest, ManifestError> {
        Manifest::with_groups(leaves, Vec::new())
    }

    /// Validates and builds a manifest with holder groups: as [`Manifest::new`],
    /// and every group is a non-empty, sorted list of distinct ranks below
    /// [`MAX_GROUP_RANK`], there are at most [`MAX_GROUPS`] groups of at most
    /// [`MAX_GROUP_ENTRIES`] entries together, and every leaf's `holders`
    /// names a group (and the leaf has no `owner` too). Whether the ranks
    /// are below the world size is checked when planning.
    pub fn with_groups(
        leaves: Vec<Leaf>,
        groups: Vec<Vec<u32>>,
    ) -> Result<Manifest, ManifestError> {
        check_groups(&groups)?;
        if leaves.len() > MAX_LEAVES {
            return Err(ManifestError::TooManyLeaves {
                count: leaves.len(),
                limit: MAX_LEAVES,
            });
        }
        let mut seen: HashMap<&[PathKey], usize> = HashMap::with_capacity(leaves.len());
        let mut total: u64 = 0;
        for (index, leaf) in leaves.iter().enumerate() {
            let bad = |reason: String| ManifestError::Leaf {
                index,
                path: leaf.display_path(),
                reason,
            };
            if leaf.path.is_empty() {
                return Err(bad("path is empty".into()));
            }
            if leaf.path.len() > MAX_PATH_DEPTH {
                return Err(bad(format!("path has more than {MAX_PATH_DEPTH} keys")));
            }
            if leaf.nbytes > MAX_BYTES {
                return Err(bad(format!(
                    "{} bytes is more than the limit of {MAX_BYTES}",
                    leaf.nbytes
                )));
            }
            if let LeafKind::Tensor { dtype, shape } = &leaf.kind {
                let nbytes = tensor_nbytes(*dtype, shape).map_err(&bad)?;
                if nbytes != leaf.nbytes {
                    return Err(bad(format!(
                        "nbytes {} does not match shape {shape:?} of {dtype} ({nbytes} bytes)",
                        leaf.nbytes
                    )));
                }
            }
            if let Some(g) = leaf.holders {
                if leaf.owner.is_some() {
                    return Err(bad(
                        "a leaf takes \"owner\" or \"holders\", not both; drop one".into(),
                    ));
                }
                if g as usize >= groups.len() {
                    return Err(bad(format!(
                        "holders {g} names no group: the manifest has {} groups (0..{})",
                        groups.len(),
                        groups.len()
                    )));
                }
            }
            if let Some(first) = seen.insert(&leaf.path, index) {
                return Err(ManifestError::DuplicatePath {
                    index,
                    path: leaf.display_path(),
                    first,
                });
            }
            total = total
                .checked_add(leaf.nbytes)
                .filter(|t| *t <= MAX_BYTES)
                .ok_or(ManifestError::TotalTooLarge { limit: MAX_BYTES })?;
        }
        Ok(Manifest {
            leaves,
            groups,
            total_bytes: total,
        })
    }

    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }

    /// The holder groups, as given (each sorted, distinct, not empty).
    pub fn groups(&self) -> &[Vec<u32>] {
        &self.groups
    }

    /// Whether the manifest has holder groups (its JSON form is version 2).
    pub fn has_groups(&self) -> bool {
        !self.groups.is_empty()
    }

    /// The ranks that hold `leaf` (a leaf of this manifest).
    pub fn holders<'a>(&'a self, leaf: &'a Leaf) -> Holders<'a> {
        match (leaf.owner.as_ref(), leaf.holders) {
            (Some(o), _) => Holders::Ranks(std::slice::from_ref(o)),
            (None, Some(g)) => Holders::Ranks(&self.groups[g as usize]),
            (None, None) => Holders::All,
        }
    }

    /// Whether some leaf is held by a group (not by every rank nor one owner).
    pub fn uses_groups(&self) -> bool {
        self.leaves.iter().any(|l| l.holders.is_some())
    }

    /// The highest rank of any group, with the group's index and the first
    /// leaf it holds (for messages), if there are groups.
    pub fn max_group_rank(&self) -> Option<(usize, u32)> {
        self.groups
            .iter()
            .enumerate()
            .filter_map(|(g, ranks)| ranks.last().map(|&r| (g, r)))
            .max_by_key(|&(g, r)| (r, std::cmp::Reverse(g)))
    }

    pub fn len(&self) -> usize {
        self.leaves.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leaves.is_empty()
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// Bytes held by all ranks (leaves without an owner or a holder group).
    pub fn replicated_bytes(&self) -> u64 {
        self.leaves
            .iter()
            .filter(|l| l.is_replicated())
            .map(|l| l.nbytes)
            .sum()
    }

    /// Highest owner rank, if any leaf has an owner.
    pub fn max_owner(&self) -> Option<(usize, u32)> {
        self.leaves
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.owner.map(|o| (i, o)))
            .max_by_key(|&(i, o)| (o, std::cmp::Reverse(i)))
    }

    /// Parses the JSON interchange form.
    pub fn from_json(text: &str) -> Result<Manifest, ManifestError> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| ManifestError::Json(e.to_string()))?;
        Manifest::from_json_value(&value)
    }

    /// Builds a manifest from an already-parsed JSON value.
    pub fn from_json_value(value: &Value) -> Result<Manifest, ManifestError> {
        let obj = value
            .as_object()
            .ok_or_else(|| ManifestError::Json("the top level must be an object".into()))?;
        for key in obj.keys() {
            if key != "version" && key != "leaves" && key != "groups" {
                return Err(ManifestError::Json(format!(
                    "unknown top-level key {key:?}"
                )));
            }
        }
        let version = obj
            .get("version")
            .ok_or_else(|| ManifestError::Json("missing \"version\"".into()))?
            .as_u64()
            .ok_or_else(|| {
                ManifestError::Json("\"version\" must be a non-negative integer".into())
            })?;
        if version != MANIFEST_VERSION && version != MANIFEST_VERSION_GROUPS {
            return Err(ManifestError::Version {
                found: version,
                supported: MANIFEST_VERSION_GROUPS,
            });
        }
        let groups = match obj.get("groups") {
            None => Vec::new(),
            Some(_) if version == MANIFEST_VERSION => {
                return Err(ManifestError::Json(
                    "\"groups\" needs \"version\": 2".into(),
                ))
            }
            Some(raw) => groups_from_json(raw)?,
        };
        let raw_leaves = obj
            .get("leaves")
            .ok_or_else(|| ManifestError::Json("missing \"leaves\"".into()))?
            .as_array()
            .ok_or_else(|| ManifestError::Json("\"leaves\" must be an array".into()))?;
        if raw_leaves.len() > MAX_LEAVES {
            return Err(ManifestError::TooManyLeaves {
                count: raw_leaves.len(),
                limit: MAX_LEAVES,
            });
        }
        let mut leaves = Vec::with_capacity(raw_leaves.len());
        for (index, raw) in raw_leaves.iter().enumerate() {
            let leaf = leaf_from_json(index, raw)?;
            if leaf.holders.is_some() && version == MANIFEST_VERSION {
                return Err(ManifestError::Leaf {
                    index,
                    path: leaf.display_path(),
                    reason: "\"holders\" needs \"version\": 2 and \"groups\"".into(),
                });
            }
            leaves.push(leaf);
        }
        Manifest::with_groups(leaves, groups)
    }

    /// The JSON interchange form, as a value.
    pub fn to_json_value(&self) -> Value {
        let leaves: Vec<Value> = self
            .leaves
            .iter()
            .map(|leaf| {
                let mut m = Map::new();
                m.insert("path".into(), path_to_json(&leaf.path));
                match &leaf.kind {
                    LeafKind::Tensor { dtype, shape } => {
                        m.insert("dtype".into(), json!(dtype.name()));
                        m.insert("shape".into(), json!(shape));
                    }
                    LeafKind::Object => {
                        m.insert("kind".into(), json!("object"));
                        m.insert("nbytes".into(), json!(leaf.nbytes));
                    }
                }
                if let Some(owner) = leaf.owner {
                    m.insert("owner".into(), json!(owner));
                }
                if let Some(g) = leaf.holders {
                    m.insert("holders".into(), json!(g));
                }
                Value::Object(m)
            })
            .collect();
        if self.has_groups() {
            json!({"version": MANIFEST_VERSION_GROUPS, "groups": self.groups, "leaves": leaves})
        } else {
            json!({"version": MANIFEST_VERSION, "leaves": leaves})
        }
    }

    /// The JSON interchange form, as text.
    pub fn to_json(&self) -> String {
        self.to_json_value().to_string()
    }

    /// Appends a canonical binary encoding of the structure, used by
    /// fingerprints: the leaf count, every leaf ([`encode_leaf`]), then the
    /// groups ([`encode_groups`], nothing for a manifest without groups, so
    /// that such a manifest encodes as it did before groups existed).
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.leaves.len() as u64).to_le_bytes());
        for leaf in &self.leaves {
            encode_leaf(leaf, out);
        }
        encode_groups(&self.groups, out);
    }

    /// A content hash of the manifest structure (hex blake3).
    pub fn fingerprint(&self) -> String {
        let mut buf = Vec::with_capacity(64 * self.leaves.len() + 16);
        buf.extend_from_slice(b"deeppart-manifest-v1\0");
        self.encode_canonical(&mut buf);
        blake3::hash(&buf).to_hex().to_string()
    }
}

/// The canonical encoding of one leaf: path, kind, size and holders (a tag
/// 0 for every rank, 1 and the owner, 2 and the group index).
pub(crate) fn encode_leaf(leaf: &Leaf, out: &mut Vec<u8>) {
    encode_path(&leaf.path, out);
    match &leaf.kind {
        LeafKind::Tensor { dtype, shape } => {
            out.push(b'T');
            out.push(dtype.code());
            out.extend_from_slice(&(shape.len() as u32).to_le_bytes());
            for d in shape {
                out.extend_from_slice(&d.to_le_bytes());
            }
        }
        LeafKind::Object => out.push(b'O'),
    }
    out.extend_from_slice(&leaf.nbytes.to_le_bytes());
    match (leaf.owner, leaf.holders) {
        (Some(o), _) => {
            out.push(1);
            out.extend_from_slice(&o.to_le_bytes());
        }
        (None, Some(g)) => {
            out.push(2);
            out.extend_from_slice(&g.to_le_bytes());
        }
        (None, None) => out.push(0),
    }
}

/// The canonical encoding of the groups, after the leaves: nothing when
/// there are none; else `'G'`, the group count, and each group's length and
/// ranks. The leaf count comes first, so these bytes cannot be read as a leaf.
pub(crate) fn encode_groups(groups: &[Vec<u32>], out: &mut Vec<u8>) {
    if groups.is_empty() {
        return;
    }
    out.push(b'G');
    out.extend_from_slice(&(groups.len() as u64).to_le_bytes());
    for g in groups {
        out.extend_from_slice(&(g.len() as u32).to_le_bytes());
        for r in g {
            out.extend_from_slice(&r.to_le_bytes());
        }
    }
}

/// Checks holder groups: at most [`MAX_GROUPS`] groups and
/// [`MAX_GROUP_ENTRIES`] entries, each non-empty, sorted and distinct, with
/// ranks below [`MAX_GROUP_RANK`].
pub fn check_groups(groups: &[Vec<u32>]) -> Result<(), ManifestError> {
    if groups.len() > MAX_GROUPS {
        return Err(ManifestError::TooManyGroups {
            count: groups.len(),
            limit: MAX_GROUPS,
        });
    }
    let entries: usize = groups.iter().map(Vec::len).sum();
    if entries > MAX_GROUP_ENTRIES {
        return Err(ManifestError::TooManyGroupEntries {
            count: entries,
            limit: MAX_GROUP_ENTRIES,
        });
    }
    for (index, g) in groups.iter().enumerate() {
        let bad = |reason: String| Err(ManifestError::Group { index, reason });
        if g.is_empty() {
            return bad("is empty; a group holds at least one rank".into());
        }
        for w in g.windows(2) {
            if w[0] == w[1] {
                return bad(format!("lists rank {} twice; list each rank once", w[0]));
            }
            if w[0] > w[1] {
                return bad(format!(
                    "is not sorted (rank {} before {}); list the ranks in increasing order",
                    w[0], w[1]
                ));
            }
        }
        if let Some(&last) = g.last() {
            if u64::from(last) >= MAX_GROUP_RANK {
                return bad(format!(
                    "rank {last} is not below the largest world size {MAX_GROUP_RANK}"
                ));
            }
        }
    }
    Ok(())
}

/// Parses the `"groups"` of the JSON form: an array of arrays of ranks,
/// checked for size before anything is built from it.
pub fn groups_from_json(raw: &Value) -> Result<Vec<Vec<u32>>, ManifestError> {
    let arr = raw.as_array().ok_or_else(|| {
        ManifestError::Json("\"groups\" must be an array of arrays of ranks".into())
    })?;
    if arr.len() > MAX_GROUPS {
        return Err(ManifestError::TooManyGroups {
            count: arr.len(),
            limit: MAX_GROUPS,
        });
    }
    let mut entries = 0usize;
    let mut groups = Vec::with_capacity(arr.len());
    for (index, g) in arr.iter().enumerate() {
        let bad = |reason: String| ManifestError::Group { index, reason };
        let ranks = g
            .as_array()
            .ok_or_else(|| bad(format!("{g} is not an array of ranks")))?;
        entries = entries.saturating_add(ranks.len());
        if entries > MAX_GROUP_ENTRIES {
            return Err(ManifestError::TooManyGroupEntries {
                count: entries,
                limit: MAX_GROUP_ENTRIES,
            });
        }
        let ranks = ranks
            .iter()
            .map(|r| {
                r.as_u64()
                    .filter(|&r| r < MAX_GROUP_RANK)
                    .map(|r| r as u32)
                    .ok_or_else(|| {
                        bad(format!("rank {r} is not an integer in 0..{MAX_GROUP_RANK}"))
                    })
            })
            .collect::<Result<Vec<u32>, _>>()?;
        groups.push(ranks);
    }
    check_groups(&groups)?;
    Ok(groups)
}

fn encode_path(path: &[PathKey], out: &mut Vec<u8>) {
    out.extend_from_slice(&(path.len() as u32).to_le_bytes());
    for key in path {
        match key {
            PathKey::Str(s) => {
                out.push(b's');
                out.extend_from_slice(&(s.len() as u64).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            PathKey::Int(i) => {
                out.push(b'i');
                out.extend_from_slice(&i.to_le_bytes());
            }
        }
    }
}

/// A path as a JSON array of strings and integers.
pub fn path_to_json(path: &[PathKey]) -> Value {
    Value::Array(
        path.iter()
            .map(|k| match k {
                PathKey::Str(s) => Value::String(s.clone()),
                PathKey::Int(i) => json!(i),
            })
            .collect(),
    )
}

/// Parses a JSON path array; `what` names the path in errors.
pub fn path_from_json(value: &Value) -> Result<Vec<PathKey>, String> {
    let arr = value
        .as_array()
        .ok_or("\"path\" must be an array of strings and integers")?;
    if arr.is_empty() {
        return Err("path is empty".into());
    }
    if arr.len() > MAX_PATH_DEPTH {
        return Err(format!("path has more than {MAX_PATH_DEPTH} keys"));
    }
    arr.iter()
        .map(|k| match k {
            Value::String(s) => Ok(PathKey::Str(s.clone())),
            Value::Number(n) => n
                .as_i64()
                .map(PathKey::Int)
                .ok_or_else(|| format!("path key {n} is not a 64-bit integer")),
            other => Err(format!(
                "path key {other} is neither a string nor an integer"
            )),
        })
        .collect()
}

/// Parses one leaf of the JSON form; `index` is its position, for messages.
pub fn leaf_from_json(index: usize, raw: &Value) -> Result<Leaf, ManifestError> {
    let partial_path = raw
        .get("path")
        .and_then(|p| path_from_json(p).ok())
        .map(|p| display_path(&p))
        .unwrap_or_else(|| "<no valid path>".to_string());
    let bad = |reason: String| ManifestError::Leaf {
        index,
        path: partial_path.clone(),
        reason,
    };
    let obj = raw
        .as_object()
        .ok_or_else(|| bad("a leaf must be an object".into()))?;
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "path" | "kind" | "dtype" | "shape" | "nbytes" | "owner" | "holders"
        ) {
            return Err(bad(format!("unknown key {key:?}")));
        }
    }
    let path = path_from_json(
        obj.get("path")
            .ok_or_else(|| bad("missing \"path\"".into()))?,
    )
    .map_err(&bad)?;
    let owner = match obj.get("owner") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let o = v
                .as_u64()
                .ok_or_else(|| bad(format!("owner {v} is not a non-negative integer")))?;
            Some(u32::try_from(o).map_err(|_| bad(format!("owner {o} is out of range")))?)
        }
    };
    let holders = match obj.get("holders") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let g = v.as_u64().ok_or_else(|| {
                bad(format!(
                    "holders {v} is not a group index (a non-negative integer)"
                ))
            })?;
            Some(u32::try_from(g).map_err(|_| bad(format!("holders {g} is out of range")))?)
        }
    };
    let nonneg = |field: &str, v: &Value| -> Result<u64, ManifestError> {
        v.as_u64()
            .ok_or_else(|| bad(format!("{field} {v} is not a non-negative integer")))
    };
    let kind = match obj.get("kind") {
        None => "tensor",
        Some(Value::String(s)) => s.as_str(),
        Some(other) => return Err(bad(format!("kind {other} is not a string"))),
    };
    match kind {
        "tensor" => {
            let dtype_name = obj
                .get("dtype")
                .ok_or_else(|| bad("missing \"dtype\"".into()))?
                .as_str()
                .ok_or_else(|| bad("dtype must be a string".into()))?;
            let dtype = DType::parse(dtype_name)
                .ok_or_else(|| bad(format!("unknown dtype {dtype_name:?}")))?;
            let shape_raw = obj
                .get("shape")
                .ok_or_else(|| bad("missing \"shape\"".into()))?
                .as_array()
                .ok_or_else(|| bad("shape must be an array of non-negative integers".into()))?;
            if shape_raw.len() > MAX_DIMS {
                return Err(bad(format!(
                    "tensor has {} dimensions, more than {MAX_DIMS}",
                    shape_raw.len()
                )));
            }
            let shape = shape_raw
                .iter()
                .map(|d| nonneg("shape dimension", d))
                .collect::<Result<Vec<u64>, _>>()?;
            let leaf = Leaf::tensor(path, dtype, shape, owner)
                .map_err(&bad)?
                .with_holders(holders);
            // nbytes is derived for tensors; it may be given only if it agrees.
            if let Some(v) = obj.get("nbytes") {
                let given = nonneg("nbytes", v)?;
                if given != leaf.nbytes {
                    return Err(bad(format!(
                        "nbytes {given} does not match the dtype and shape ({} bytes)",
                        leaf.nbytes
                    )));
                }
            }
            Ok(leaf)
        }
        "object" => {
            if obj.contains_key("dtype") || obj.contains_key("shape") {
                return Err(bad("an object leaf takes nbytes, not dtype or shape".into()));
            }
            let nbytes = nonneg(
                "nbytes",
                obj.get("nbytes")
                    .ok_or_else(|| bad("missing \"nbytes\"".into()))?,
            )?;
            Leaf::object(path, nbytes, owner)
                .map_err(&bad)
                .map(|l| l.with_holders(holders))
        }
        other => Err(bad(format!(
            "unknown kind {other:?}; expected \"tensor\" or \"object\""
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = r#"{"version": 1, "leaves": [
        {"path": ["model", "w"], "dtype": "float32", "shape": [1024, 1024]},
        {"path": ["optim", "param_groups", 0], "kind": "object", "nbytes": 200},
        {"path": ["rng"], "dtype": "uint8", "shape": [5056], "owner": 3}]}"#;

    fn err(text: &str) -> String {
        Manifest::from_json(text).unwrap_err().to_string()
    }

    #[test]
    fn parses_the_documented_example() {
        let m = Manifest::from_json(EXAMPLE).unwrap();
        assert_eq!(m.len(), 3);
        assert_eq!(m.leaves()[0].nbytes, 4 << 20);
        assert_eq!(m.leaves()[0].row_units(), 1024);
        assert_eq!(m.leaves()[1].kind, LeafKind::Object);
        assert_eq!(m.leaves()[1].path[2], PathKey::Int(0));
        assert_eq!(m.leaves()[2].owner, Some(3));
        assert_eq!(m.total_bytes(), (4 << 20) + 200 + 5056);
        let again = Manifest::from_json(&m.to_json()).unwrap();
        assert_eq!(again, m);
        assert_eq!(again.fingerprint(), m.fingerprint());
    }

    #[test]
    fn rejects_bad_input_with_the_leaf_named() {
        assert!(err("{").starts_with("malformed manifest JSON"));
        assert!(err(r#"{"version": 3, "leaves": []}"#).contains("unsupported manifest version 3"));
        let e = err(r#"{"version":1,"leaves":[{"path":["a"],"dtype":"float33","shape":[1]}]}"#);
        assert!(
            e.contains("leaf 0 (a)") && e.contains("unknown dtype \"float33\""),
            "{e}"
        );
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a"],"dtype":"float32","shape":[4294967296,4294967296]}]}"#,
        );
        assert!(e.contains("overflows"), "{e}");
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a"],"dtype":"float64","shape":[4294967296,536870912]}]}"#,
        );
        assert!(e.contains("overflows"), "{e}");
        let e = err(r#"{"version":1,"leaves":[{"path":["a"],"dtype":"float32","shape":[-1]}]}"#);
        assert!(
            e.contains("shape dimension -1 is not a non-negative integer"),
            "{e}"
        );
        let e = err(r#"{"version":1,"leaves":[{"path":["a"],"kind":"object","nbytes":-5}]}"#);
        assert!(e.contains("nbytes -5"), "{e}");
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a"],"kind":"object","nbytes":2305843009213693952}]}"#,
        );
        assert!(e.contains("larger than the limit"), "{e}");
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a","b"],"kind":"object","nbytes":1},{"path":["a","b"],"kind":"object","nbytes":2}]}"#,
        );
        assert!(
            e.contains("leaf 1 (a/b): duplicate path, first seen at leaf 0"),
            "{e}"
        );
        let e = err(r#"{"version":1,"leaves":[{"path":[],"kind":"object","nbytes":1}]}"#);
        assert!(e.contains("path is empty"), "{e}");
        let e =
            err(r#"{"version":1,"leaves":[{"path":["a"],"kind":"object","nbytes":1,"owner":-1}]}"#);
        assert!(e.contains("owner -1"), "{e}");
        let e = err(r#"{"version":1,"leaves":[{"path":["a", 1.5],"kind":"object","nbytes":1}]}"#);
        assert!(e.contains("path key 1.5"), "{e}");
        let e = err(r#"{"version":1,"leaves":[{"path":["a"],"kind":"blob","nbytes":1}]}"#);
        assert!(e.contains("unknown kind \"blob\""), "{e}");
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a"],"dtype":"float32","shape":[1],"sahpe":[2]}]}"#,
        );
        assert!(e.contains("unknown key \"sahpe\""), "{e}");
    }

    const GROUPED: &str = r#"{"version": 2, "groups": [[0, 1], [2, 3], [1, 2, 3]], "leaves": [
        {"path": ["a"], "dtype": "float32", "shape": [1024], "holders": 0},
        {"path": ["b"], "dtype": "float32", "shape": [1024], "holders": 2},
        {"path": ["c"], "kind": "object", "nbytes": 10, "owner": 1},
        {"path": ["d"], "kind": "object", "nbytes": 10}]}"#;

    #[test]
    fn groups_round_trip_and_name_the_holders() {
        let m = Manifest::from_json(GROUPED).unwrap();
        assert_eq!(m.groups(), &[vec![0, 1], vec![2, 3], vec![1, 2, 3]]);
        assert_eq!(m.leaves()[0].holders, Some(0));
        assert_eq!(m.holders(&m.leaves()[1]), Holders::Ranks(&[1, 2, 3]));
        assert_eq!(m.holders(&m.leaves()[2]), Holders::Ranks(&[1]));
        assert_eq!(m.holders(&m.leaves()[3]), Holders::All);
        assert!(m.holders(&m.leaves()[1]).contains(2) && !m.holders(&m.leaves()[1]).contains(0));
        let text = m.to_json();
        assert!(text.contains("\"version\":2"), "{text}");
        let again = Manifest::from_json(&text).unwrap();
        assert_eq!(again, m);
        // The holders are part of the structure's fingerprint.
        let other =
            Manifest::from_json(&GROUPED.replace("\"holders\": 2", "\"holders\": 1")).unwrap();
        assert_ne!(other.fingerprint(), m.fingerprint());
        let regrouped = Manifest::from_json(&GROUPED.replace("[1, 2, 3]]", "[0, 2, 3]]")).unwrap();
        assert_ne!(regrouped.fingerprint(), m.fingerprint());
        // Without groups a manifest is still version 1 (and encodes as
        // before: the zoo fixtures' recorded fingerprints, tests/zoo.rs).
        let v1 = Manifest::from_json(EXAMPLE).unwrap();
        assert!(v1.to_json().contains("\"version\":1"));
    }

    #[test]
    fn bad_groups_are_named() {
        let with = |groups: &str, holders: &str| {
            err(&format!(
                r#"{{"version":2,"groups":{groups},"leaves":[{{"path":["a"],"kind":"object","nbytes":1{holders}}}]}}"#
            ))
        };
        let e = with("[[0,1],[]]", "");
        assert!(e.contains("holder group 1: is empty"), "{e}");
        let e = with("[[0,1,1]]", "");
        assert!(e.contains("holder group 0: lists rank 1 twice"), "{e}");
        let e = with("[[2,1]]", "");
        assert!(e.contains("holder group 0: is not sorted"), "{e}");
        let e = with("[[0,-1]]", "");
        assert!(e.contains("holder group 0: rank -1"), "{e}");
        let e = with("[[0,1048576]]", "");
        assert!(e.contains("holder group 0: rank 1048576"), "{e}");
        let e = with("{}", "");
        assert!(e.contains("\"groups\" must be an array"), "{e}");
        let e = with("[[0,1]]", r#","holders":1"#);
        assert!(e.contains("leaf 0 (a): holders 1 names no group"), "{e}");
        let e = with("[[0,1]]", r#","holders":0,"owner":1"#);
        assert!(e.contains("leaf 0 (a)") && e.contains("not both"), "{e}");
        let e = with("[[0,1]]", r#","holders":"x""#);
        assert!(e.contains("leaf 0 (a): holders \"x\""), "{e}");
        let e = err(r#"{"version":1,"groups":[[0]],"leaves":[]}"#);
        assert!(e.contains("needs \"version\": 2"), "{e}");
        let e = err(
            r#"{"version":1,"leaves":[{"path":["a"],"kind":"object","nbytes":1,"holders":0}]}"#,
        );
        assert!(e.contains("needs \"version\": 2"), "{e}");
        let many = format!("[{}]", vec!["[0]"; MAX_GROUPS + 1].join(","));
        let e = with(&many, "");
        assert!(e.contains("holder groups, more than the limit"), "{e}");
        let wide: Vec<String> = (0..(MAX_GROUP_ENTRIES / 1024 + 1))
            .map(|_| {
                format!(
                    "[{}]",
                    (0..1024)
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                )
            })
            .collect();
        let e = with(&format!("[{}]", wide.join(",")), "");
        assert!(e.contains("ranks together, more than the limit"), "{e}");
    }

    #[test]
    fn total_size_overflow_is_reported() {
        let big = MAX_BYTES;
        let text = format!(
            r#"{{"version":1,"leaves":[{{"path":["a"],"kind":"object","nbytes":{big}}},{{"path":["b"],"kind":"object","nbytes":{big}}}]}}"#
        );
        assert!(err(&text).contains("total size overflows"));
    }

    #[test]
    fn zero_dim_and_empty_tensors() {
        let m = Manifest::from_json(
            r#"{"version":1,"leaves":[{"path":["s"],"dtype":"int64","shape":[]},{"path":["e"],"dtype":"float32","shape":[0,3]}]}"#,
        )
        .unwrap();
        assert_eq!(m.leaves()[0].units(), 1);
        assert_eq!(m.leaves()[0].nbytes, 8);
        assert_eq!(m.leaves()[1].units(), 0);
        assert_eq!(m.leaves()[1].row_units(), 3);
    }
}
