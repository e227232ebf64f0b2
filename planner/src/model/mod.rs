//! What there is and what writing it costs: dtypes, the manifest (leaves,
//! owners, holder groups) and the cost model with its topology.

pub mod cost;
pub mod dtype;
pub mod manifest;
