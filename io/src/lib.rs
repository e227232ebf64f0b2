//! DeepPart's I/O kernels, the hot loops of a checkpoint's bytes, apart
//! from the planner: they know nothing of manifests or plans.
//!
//! - [`erasure`]: Reed-Solomon coding of a group's pieces (level 3);
//! - [`filewrite`]: a piece written at its offset, checksummed (xxh3) as it
//!   goes, with write-back pacing;
//! - [`copy`]: large copies between buffers (non-temporal stores);
//! - [`replica`]: digests that prove ranks hold the same bytes.

pub mod copy;
pub mod erasure;
pub mod filewrite;
pub mod replica;
