//! Who writes what: the plan and its pipeline (check the inputs, run an
//! algorithm, validate, score against the proven lower bound, fingerprint),
//! the algorithms, the bound and the holder flow it rests on.

pub mod algorithms;
pub mod bound;
pub mod fingerprint;
pub mod holders;
pub mod inputs;
pub mod pipeline;
pub mod plan;
pub mod plan_json;
