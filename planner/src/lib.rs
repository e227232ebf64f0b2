//! DeepPart's planner core: it splits the replicated state of a data-parallel
//! job so that every rank writes one balanced part of a checkpoint.
//!
//! Pure Rust, no Python: [`Manifest`] (what there is), [`CostModel`] and
//! [`Topology`] (what writing costs), [`plan`] (who writes what), a proven
//! [`bound::lower_bound`], and content [`fingerprint`]s.

pub mod algorithms;
pub mod bound;
pub mod cache;
pub mod codec;
pub mod copy;
pub mod cost;
pub mod dtype;
pub mod erasure;
pub mod error;
pub mod filewrite;
pub mod fingerprint;
pub mod holders;
pub mod manifest;
pub mod pipeline;
pub mod plan;
pub mod replica;
pub mod store;

pub use cost::{CostModel, Grain, Topology};
pub use dtype::DType;
pub use error::{ManifestError, PlanError};
pub use manifest::{Holders, Leaf, LeafKind, Manifest, PathKey};
pub use pipeline::{
    assemble_plan, assemble_plan_with_fingerprint, check_world_size, plan, validate_inputs,
    MAX_WORLD_SIZE, PLANNER_VERSION,
};
pub use plan::{Algorithm, Piece, Plan, PlanSource, PlanStats};
