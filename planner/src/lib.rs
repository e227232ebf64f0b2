//! DeepPart's planner core: it splits the state of a data-parallel job so
//! that every rank writes one balanced part of a checkpoint.
//!
//! Pure Rust, no Python, in three rooms:
//! - [`model`]: what there is ([`Manifest`]) and what writing costs
//!   ([`CostModel`], [`Topology`]);
//! - [`planning`]: who writes what ([`plan`], the [`Plan`]), a proven
//!   [`planning::bound::lower_bound`], content [`planning::fingerprint`]s;
//! - [`cache`]: plans kept by fingerprint, in memory and on disk (SQLite,
//!   the binary [`cache::codec`]).
//!
//! The I/O kernels (Reed–Solomon, file writes, copies, replica digests) are
//! the `deeppart-io` crate; they know nothing of plans.

pub mod cache;
pub mod error;
pub mod model;
pub mod planning;

pub use error::{ManifestError, PlanError};
pub use model::cost::{CostModel, Grain, Topology};
pub use model::dtype::DType;
pub use model::manifest::{Holders, Leaf, LeafKind, Manifest, PathKey};
pub use planning::inputs::{check_world_size, validate_inputs, MAX_WORLD_SIZE, PLANNER_VERSION};
pub use planning::pipeline::{assemble_plan, assemble_plan_with_fingerprint, plan};
pub use planning::plan::{Algorithm, Piece, Plan, PlanSource, PlanStats};
