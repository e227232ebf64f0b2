//! The cost model that plans are scored with, and the machine topology.
//!
//! The time a rank needs to write its part is
//!
//! ```text
//! cost(r) = fixed_s                      (only if r writes anything)
//!         + sum over its pieces of (piece_s + bytes / bandwidth)
//! ```
//!
//! where owned leaves are pieces like any other. The time of a whole save is
//!
//! ```text
//! makespan = max over ranks of cost(r) + writers * writer_s
//! ```
//!
//! `writer_s` is the part of each writer's cost that the shared storage
//! serialises (a file create at a parallel file system's metadata server,
//! one more entry to commit). It is why a small state is best written by
//! fewer ranks: the thesis observed an optimal band of bytes per process.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;

/// Parameters of the per-rank write-time model. All times in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Paid once by every rank that writes anything (open, fsync, close).
    pub fixed_s: f64,
    /// Paid for every piece a rank writes (seek, header entry, checksum setup).
    pub piece_s: f64,
    /// Sustained write bandwidth of one rank, in bytes per second.
    pub bandwidth: f64,
    /// Paid once per writer, serialised across all writers (metadata server).
    pub writer_s: f64,
    /// The planner never cuts a tensor into a piece smaller than this.
    pub min_piece_bytes: u64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            fixed_s: 2e-3,
            piece_s: 20e-6,
            bandwidth: 1e9,
            writer_s: 200e-6,
            min_piece_bytes: 1 << 20,
        }
    }
}

impl CostModel {
    /// Checks that every parameter is finite and in range.
    pub fn validate(&self) -> Result<(), PlanError> {
        let finite_nonneg = |name: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(PlanError::Cost(format!(
                    "{name} must be a finite number >= 0, got {v}"
                )))
            }
        };
        finite_nonneg("fixed_s", self.fixed_s)?;
        finite_nonneg("piece_s", self.piece_s)?;
        finite_nonneg("writer_s", self.writer_s)?;
        if !(self.bandwidth.is_finite() && self.bandwidth > 0.0) {
            return Err(PlanError::Cost(format!(
                "bandwidth must be a finite number > 0, got {}",
                self.bandwidth
            )));
        }
        if self.min_piece_bytes == 0 {
            return Err(PlanError::Cost("min_piece_bytes must be at least 1".into()));
        }
        Ok(())
    }

    /// Time to write one piece of `bytes` bytes, overhead included.
    #[inline]
    pub fn piece_cost(&self, bytes: u64) -> f64 {
        self.piece_s + bytes as f64 / self.bandwidth
    }

    /// Appends the parameters' exact bit patterns, for fingerprints.
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        for v in [self.fixed_s, self.piece_s, self.bandwidth, self.writer_s] {
            out.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        out.extend_from_slice(&self.min_piece_bytes.to_le_bytes());
    }
}

/// How ranks sit on nodes. Ranks `[n * ranks_per_node, (n+1) * ranks_per_node)`
/// share node `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Topology {
    pub ranks_per_node: u32,
}

impl Default for Topology {
    fn default() -> Self {
        Topology { ranks_per_node: 1 }
    }
}

impl Topology {
    /// Checks the topology against a world size.
    pub fn validate(&self, world_size: u32) -> Result<(), PlanError> {
        if self.ranks_per_node == 0 {
            return Err(PlanError::Topology(
                "ranks_per_node must be at least 1".into(),
            ));
        }
        // (Not `is_multiple_of`: that needs Rust 1.87, the workspace supports 1.80.)
        if world_size.checked_rem(self.ranks_per_node) != Some(0) {
            return Err(PlanError::Topology(format!(
                "world size {world_size} is not a multiple of ranks_per_node {}",
                self.ranks_per_node
            )));
        }
        Ok(())
    }

    pub fn node_of(&self, rank: u32) -> u32 {
        rank / self.ranks_per_node
    }

    /// Ranks ordered so that consecutive ranks sit on different nodes: a
    /// prefix of this order spreads writers over as many nodes as it can.
    pub fn spread_order(&self, world_size: u32) -> Vec<u32> {
        let per = self.ranks_per_node.max(1);
        let nodes = world_size.div_ceil(per);
        let mut order = Vec::with_capacity(world_size as usize);
        for local in 0..per {
            for node in 0..nodes {
                let r = node * per + local;
                if r < world_size {
                    order.push(r);
                }
            }
        }
        order
    }

    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.ranks_per_node.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_parameter() {
        let mut c = CostModel::default();
        assert!(c.validate().is_ok());
        c.bandwidth = 0.0;
        assert!(c.validate().unwrap_err().to_string().contains("bandwidth"));
        c = CostModel {
            piece_s: f64::NAN,
            ..CostModel::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("piece_s"));
        c = CostModel {
            fixed_s: -1.0,
            ..CostModel::default()
        };
        assert!(c.validate().unwrap_err().to_string().contains("fixed_s"));
    }

    #[test]
    fn spread_order_alternates_nodes() {
        let t = Topology { ranks_per_node: 2 };
        assert_eq!(t.spread_order(6), vec![0, 2, 4, 1, 3, 5]);
        assert!(t.validate(5).is_err());
        assert!(Topology { ranks_per_node: 0 }.validate(4).is_err());
    }
}
