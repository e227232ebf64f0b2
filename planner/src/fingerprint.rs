//! Content fingerprints of planning inputs. Two requests with the same
//! fingerprint must get the same plan; a new planner version never shares one.

use crate::cost::{CostModel, Topology};
use crate::manifest::Manifest;
use crate::plan::Algorithm;

/// Hex blake3 hash of everything a plan depends on.
pub fn plan_fingerprint(
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    algorithm: Algorithm,
) -> String {
    let mut buf = Vec::with_capacity(64 * manifest.len() + 128);
    buf.extend_from_slice(b"deeppart-plan-v1\0");
    buf.extend_from_slice(crate::PLANNER_VERSION.as_bytes());
    buf.push(0);
    buf.extend_from_slice(algorithm.name().as_bytes());
    buf.push(0);
    buf.extend_from_slice(&world_size.to_le_bytes());
    topology.encode_canonical(&mut buf);
    cost.encode_canonical(&mut buf);
    manifest.encode_canonical(&mut buf);
    blake3::hash(&buf).to_hex().to_string()
}
