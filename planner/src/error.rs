//! Error types of the planner core. The binding layer maps each variant family
//! to one Python exception class (`ManifestError`, `PlanError`, ...).

use thiserror::Error;

/// A manifest that cannot be accepted. The message names the offending leaf.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ManifestError {
    #[error("malformed manifest JSON: {0}")]
    Json(String),
    #[error("unsupported manifest version {found}; this planner reads version {supported}")]
    Version { found: u64, supported: u64 },
    #[error("leaf {index} ({path}): {reason}")]
    Leaf {
        index: usize,
        path: String,
        reason: String,
    },
    #[error("leaf {index} ({path}): duplicate path, first seen at leaf {first}")]
    DuplicatePath {
        index: usize,
        path: String,
        first: usize,
    },
    #[error("manifest has {count} leaves, more than the limit of {limit}")]
    TooManyLeaves { count: usize, limit: usize },
    #[error("manifest total size overflows: the leaves add up to more than {limit} bytes")]
    TotalTooLarge { limit: u64 },
    #[error("holder group {index}: {reason}")]
    Group { index: usize, reason: String },
    #[error("manifest has {count} holder groups, more than the limit of {limit}; merge leaves with the same holders into one group")]
    TooManyGroups { count: usize, limit: usize },
    #[error("manifest's holder groups list {count} ranks together, more than the limit of {limit}; list each distinct rank set once")]
    TooManyGroupEntries { count: usize, limit: usize },
}

/// Inputs that a plan cannot be computed or accepted for.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum PlanError {
    #[error("world size must be at least 1, got {0}")]
    WorldSize(u64),
    #[error("world size {world_size} is larger than the supported maximum {limit}")]
    WorldSizeTooLarge { world_size: u64, limit: u64 },
    #[error("leaf {index} ({path}) is owned by rank {owner}, but the world size is {world_size}")]
    OwnerOutOfRange {
        index: usize,
        path: String,
        owner: u32,
        world_size: u32,
    },
    #[error("holder group {group} lists rank {rank}, but the world size is {world_size} (first leaf it holds: {leaf}); plan for the world the groups were made for")]
    HolderOutOfRange {
        group: usize,
        rank: u32,
        world_size: u32,
        leaf: String,
    },
    #[error("algorithm {algorithm} does not plan leaves held by a group of ranks (leaf {index} ({path})); use \"balanced\", \"lpt\" or \"greedy\"")]
    HoldersUnsupported {
        algorithm: &'static str,
        index: usize,
        path: String,
    },
    #[error("invalid topology: {0}")]
    Topology(String),
    #[error("invalid cost model: {0}")]
    Cost(String),
    #[error("unknown algorithm {0:?}; expected one of balanced, lpt, greedy, deeppart")]
    UnknownAlgorithm(String),
    #[error("malformed plan: {0}")]
    Malformed(String),
    #[error("plan fingerprint mismatch: expected {expected}, got {actual}")]
    FingerprintMismatch { expected: String, actual: String },
}
