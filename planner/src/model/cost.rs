//! The cost model that plans are scored with, the legal grain of a piece,
//! and the machine topology.
//!
//! A rank that writes `b_r` bytes in `p_r` pieces needs
//!
//! ```text
//! cost(r) = fixed_s + p_r * piece_s + b_r / bandwidth     (only if r writes anything)
//! ```
//!
//! where owned leaves are pieces like any other. What the ranks share adds
//! two more limits: the bytes of a node's writers pass through the node's
//! link (`node_bandwidth`, shared by the ranks of a node), and all bytes pass
//! through the storage (`aggregate_bandwidth`, shared by every writer). The
//! time of a whole save is
//!
//! ```text
//! makespan = max( max over ranks of cost(r),
//!                 fixed_s + max over nodes of node_bytes(n) / node_bandwidth,
//!                 fixed_s + total_bytes / aggregate_bandwidth )
//!          + writers * writer_s
//! ```
//!
//! `writer_s` is the per-file metadata cost: the part of each writer's cost
//! that the shared storage serialises (a file create at a parallel file
//! system's metadata server, one more entry to commit). It is why a small
//! state is best written by fewer ranks: the thesis observed an optimal band
//! of bytes per process. A shared bandwidth left unset (`None`) is unlimited.
//!
//! A piece of a tensor is a flat element range (C order). Its boundaries fall
//! on the leaf's *grain* ([`CostModel::grain_units`]): with
//! [`Grain::Element`] (the default) any element whose byte offset in the
//! tensor is a multiple of `align_bytes`, so that a piece can be written with
//! direct I/O; with [`Grain::Row`] whole rows of dimension 0 (for consumers
//! that need rectangular chunks, like `torch.distributed.checkpoint`). A cut
//! piece holds at least `min_piece_bytes`.

use serde::{Deserialize, Serialize};

use crate::error::PlanError;
use crate::model::manifest::{Leaf, LeafKind};

/// Where the planner may cut a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Grain {
    /// Any element boundary at a multiple of `align_bytes` bytes into the tensor.
    #[default]
    Element,
    /// Whole rows of dimension 0 only.
    Row,
}

impl Grain {
    pub const ALL: [Grain; 2] = [Grain::Element, Grain::Row];

    pub fn name(self) -> &'static str {
        match self {
            Grain::Element => "element",
            Grain::Row => "row",
        }
    }

    /// The grain called `name`; a [`PlanError::Cost`] naming the choices otherwise.
    pub fn from_name(name: &str) -> Result<Grain, PlanError> {
        Grain::ALL
            .iter()
            .copied()
            .find(|g| g.name() == name)
            .ok_or_else(|| {
                PlanError::Cost(format!(
                    "grain must be \"element\" or \"row\", got {name:?}"
                ))
            })
    }

    /// The grain's code in binary encodings (fingerprints, the plan codec).
    pub fn code(self) -> u8 {
        match self {
            Grain::Element => 0,
            Grain::Row => 1,
        }
    }

    /// The grain of a [`Grain::code`]; `None` for an unknown code.
    pub fn from_code(code: u8) -> Option<Grain> {
        Grain::ALL.iter().copied().find(|g| g.code() == code)
    }
}

/// Parameters of the write-time model. All times in seconds, bandwidths in
/// bytes per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModel {
    /// Paid once by every rank that writes anything (open, fsync, close).
    pub fixed_s: f64,
    /// Paid for every piece a rank writes (seek, header entry, checksum setup).
    pub piece_s: f64,
    /// Sustained write bandwidth of one rank.
    pub bandwidth: f64,
    /// Per-file metadata cost: paid once per writer, serialised across all
    /// writers (a metadata server).
    pub writer_s: f64,
    /// The planner never cuts a tensor into a piece smaller than this.
    pub min_piece_bytes: u64,
    /// Cuts fall on multiples of this many bytes into a tensor (with
    /// [`Grain::Element`]); 1 allows any element boundary.
    pub align_bytes: u64,
    /// Where cuts may fall: any aligned element, or whole rows only.
    pub grain: Grain,
    /// Write bandwidth of one node, shared by its ranks; `None`: unlimited.
    pub node_bandwidth: Option<f64>,
    /// Write bandwidth of the whole storage, shared by all writers; `None`: unlimited.
    pub aggregate_bandwidth: Option<f64>,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            fixed_s: 2e-3,
            piece_s: 20e-6,
            bandwidth: 1e9,
            writer_s: 200e-6,
            min_piece_bytes: 1 << 20,
            align_bytes: 4096,
            grain: Grain::Element,
            node_bandwidth: None,
            aggregate_bandwidth: None,
        }
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The slowest bandwidth a cost model may state (bytes per second) and its
/// longest time (seconds, 31 years). No storage is outside them, and within
/// them every time the planner adds up stays finite with room to spare: with
/// a bandwidth of 1e-305 one piece's time overflows to infinity and
/// `balanced` doubled its level forever (a planner service request of a few
/// hundred bytes held a server thread for good; issue 13).
pub const MIN_BANDWIDTH: f64 = 1.0;
pub const MAX_SECONDS: f64 = 1e9;

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
        let finite_pos = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(PlanError::Cost(format!(
                    "{name} must be a finite number > 0, got {v}"
                )))
            }
        };
        finite_nonneg("fixed_s", self.fixed_s)?;
        finite_nonneg("piece_s", self.piece_s)?;
        finite_nonneg("writer_s", self.writer_s)?;
        finite_pos("bandwidth", self.bandwidth)?;
        if let Some(v) = self.node_bandwidth {
            finite_pos("node_bandwidth", v)?;
        }
        if let Some(v) = self.aggregate_bandwidth {
            finite_pos("aggregate_bandwidth", v)?;
        }
        for (name, v) in [
            ("fixed_s", self.fixed_s),
            ("piece_s", self.piece_s),
            ("writer_s", self.writer_s),
        ] {
            if v > MAX_SECONDS {
                return Err(PlanError::Cost(format!(
                    "{name} must be at most {MAX_SECONDS:e} s, got {v}"
                )));
            }
        }
        for (name, v) in [
            ("bandwidth", Some(self.bandwidth)),
            ("node_bandwidth", self.node_bandwidth),
            ("aggregate_bandwidth", self.aggregate_bandwidth),
        ] {
            if v.is_some_and(|v| v < MIN_BANDWIDTH) {
                return Err(PlanError::Cost(format!(
                    "{name} must be at least {MIN_BANDWIDTH} byte/s, got {}",
                    v.unwrap_or_default()
                )));
            }
        }
        if self.min_piece_bytes == 0 {
            return Err(PlanError::Cost("min_piece_bytes must be at least 1".into()));
        }
        if self.align_bytes == 0 {
            return Err(PlanError::Cost("align_bytes must be at least 1".into()));
        }
        Ok(())
    }

    /// Time to write one piece of `bytes` bytes, overhead included.
    #[inline]
    pub fn piece_cost(&self, bytes: u64) -> f64 {
        self.piece_s + bytes as f64 / self.bandwidth
    }

    /// A node's bandwidth, `f64::INFINITY` when unlimited.
    pub fn node_bandwidth_or_inf(&self) -> f64 {
        self.node_bandwidth.unwrap_or(f64::INFINITY)
    }

    /// The storage's bandwidth, `f64::INFINITY` when unlimited.
    pub fn aggregate_bandwidth_or_inf(&self) -> f64 {
        self.aggregate_bandwidth.unwrap_or(f64::INFINITY)
    }

    /// Units between two legal cut positions of `leaf`: a cut at unit `u`
    /// (other than its ends) is legal when `u` is a multiple of this. For
    /// [`Grain::Element`] it is the fewest elements whose bytes are a
    /// multiple of `align_bytes`; for [`Grain::Row`] the units of one row
    /// of dimension 0 (1 for 0-D and 1-D tensors). An object cannot be cut:
    /// its grain is its one unit. Never 0; it may exceed the leaf's units
    /// (then the leaf cannot be cut).
    pub fn grain_units(&self, leaf: &Leaf) -> u64 {
        match &leaf.kind {
            LeafKind::Object => 1,
            LeafKind::Tensor { dtype, .. } => match self.grain {
                Grain::Row => leaf.row_units(),
                Grain::Element => {
                    let align = self.align_bytes.max(1);
                    align / gcd(align, dtype.itemsize())
                }
            },
        }
    }

    /// Whether `leaf` may be cut at all: a tensor with at least two legal
    /// pieces of `min_piece_bytes` each.
    pub fn can_cut(&self, leaf: &Leaf) -> bool {
        self.max_pieces(leaf) > 1
    }

    /// The most pieces a legal cutting of `leaf` has: every piece but the
    /// last spans whole grains and at least `min_piece_bytes`, the last at
    /// least `min_piece_bytes`. 1 for an object, an empty tensor, or a leaf
    /// too small to cut.
    pub fn max_pieces(&self, leaf: &Leaf) -> u64 {
        if !leaf.is_tensor() || leaf.units() <= 1 {
            return 1;
        }
        let grain_bytes = self.grain_units(leaf).saturating_mul(leaf.unit_bytes());
        let m = self.min_piece_bytes;
        if leaf.nbytes <= m || grain_bytes >= leaf.nbytes {
            return 1;
        }
        // Each piece before the last: the fewest whole grains of at least `m` bytes.
        let step = m.div_ceil(grain_bytes).saturating_mul(grain_bytes);
        1 + (leaf.nbytes - m) / step
    }

    /// Appends the parameters' exact bit patterns, for fingerprints. An
    /// unlimited shared bandwidth is encoded as infinity (no valid value is).
    pub fn encode_canonical(&self, out: &mut Vec<u8>) {
        for v in [self.fixed_s, self.piece_s, self.bandwidth, self.writer_s] {
            out.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        out.extend_from_slice(&self.min_piece_bytes.to_le_bytes());
        out.extend_from_slice(&self.align_bytes.to_le_bytes());
        out.push(self.grain.code());
        for v in [
            self.node_bandwidth_or_inf(),
            self.aggregate_bandwidth_or_inf(),
        ] {
            out.extend_from_slice(&v.to_bits().to_le_bytes());
        }
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
    fn validation_keeps_every_time_finite() {
        // Issue 13: a bandwidth of 1e-305 made `balanced` double its level
        // forever (one piece's time is infinite, so no level fits).
        for (c, name) in [
            (
                CostModel {
                    bandwidth: 1e-305,
                    ..CostModel::default()
                },
                "bandwidth",
            ),
            (
                CostModel {
                    bandwidth: 5e-324,
                    ..CostModel::default()
                },
                "bandwidth",
            ),
            (
                CostModel {
                    node_bandwidth: Some(0.5),
                    ..CostModel::default()
                },
                "node_bandwidth",
            ),
            (
                CostModel {
                    aggregate_bandwidth: Some(1e-300),
                    ..CostModel::default()
                },
                "aggregate_bandwidth",
            ),
            (
                CostModel {
                    fixed_s: 1e300,
                    ..CostModel::default()
                },
                "fixed_s",
            ),
            (
                CostModel {
                    piece_s: 2e9,
                    ..CostModel::default()
                },
                "piece_s",
            ),
            (
                CostModel {
                    writer_s: f64::MAX,
                    ..CostModel::default()
                },
                "writer_s",
            ),
        ] {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(name), "{e}");
        }
        let edge = CostModel {
            bandwidth: MIN_BANDWIDTH,
            node_bandwidth: Some(MIN_BANDWIDTH),
            aggregate_bandwidth: Some(f64::MAX),
            fixed_s: MAX_SECONDS,
            piece_s: MAX_SECONDS,
            writer_s: MAX_SECONDS,
            ..CostModel::default()
        };
        assert!(edge.validate().is_ok());
    }

    fn tensor(dtype: crate::model::dtype::DType, shape: Vec<u64>) -> Leaf {
        Leaf::tensor(
            vec![crate::model::manifest::PathKey::Str("t".into())],
            dtype,
            shape,
            None,
        )
        .unwrap()
    }

    #[test]
    fn grain_is_aligned_elements_or_rows() {
        use crate::model::dtype::DType;
        let c = CostModel::default();
        // Mixtral's stacked experts: rows of 2 x 14336 x 4096 float32 (470 MB),
        // elements every 4 KiB.
        let experts = tensor(DType::Float32, vec![8, 2 * 14336, 4096]);
        assert_eq!(c.grain_units(&experts), 1024);
        let rows = CostModel {
            grain: Grain::Row,
            ..c
        };
        assert_eq!(rows.grain_units(&experts), 2 * 14336 * 4096);
        assert_eq!(rows.max_pieces(&experts), 8);
        // 1 MiB minimum piece: 3.76 GB in 1 MiB steps, the last at least 1 MiB.
        assert_eq!(c.max_pieces(&experts), experts.nbytes / (1 << 20));
        // An alignment that is no multiple of the itemsize: cuts fall on
        // lcm(6, 4) = 12 bytes, every 3 float32 elements.
        let odd = CostModel {
            align_bytes: 6,
            ..c
        };
        assert_eq!(odd.grain_units(&tensor(DType::Float32, vec![100])), 3);
        // Too small to cut, objects, empty tensors.
        assert_eq!(c.max_pieces(&tensor(DType::Float32, vec![1 << 18])), 1);
        assert_eq!(
            c.max_pieces(&tensor(DType::Float32, vec![(1 << 19) + 1])),
            2
        );
        let obj = Leaf::object(
            vec![crate::model::manifest::PathKey::Str("o".into())],
            1 << 30,
            None,
        )
        .unwrap();
        assert_eq!(c.max_pieces(&obj), 1);
        assert_eq!(c.max_pieces(&tensor(DType::Float32, vec![0, 4])), 1);
        assert!(!c.can_cut(&obj));
    }

    #[test]
    fn shared_bandwidths_and_alignment_are_validated_and_fingerprinted() {
        let base = CostModel::default();
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = CostModel {
                node_bandwidth: Some(bad),
                ..base
            };
            assert!(c
                .validate()
                .unwrap_err()
                .to_string()
                .contains("node_bandwidth"));
            let c = CostModel {
                aggregate_bandwidth: Some(bad),
                ..base
            };
            assert!(c
                .validate()
                .unwrap_err()
                .to_string()
                .contains("aggregate_bandwidth"));
        }
        let c = CostModel {
            align_bytes: 0,
            ..base
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("align_bytes"));
        assert!(Grain::from_name("box")
            .unwrap_err()
            .to_string()
            .contains("grain"));
        // Old JSON without the new fields reads with their defaults.
        let old: CostModel = serde_json::from_str(
            r#"{"fixed_s":0.002,"piece_s":2e-5,"bandwidth":1e9,"writer_s":2e-4,"min_piece_bytes":1048576}"#,
        )
        .unwrap();
        assert_eq!(old, base);
        let json = serde_json::to_string(&CostModel {
            grain: Grain::Row,
            node_bandwidth: Some(2e9),
            ..base
        })
        .unwrap();
        assert!(
            json.contains(r#""grain":"row""#) && json.contains(r#""node_bandwidth":2000000000.0"#)
        );
        let encode = |c: &CostModel| {
            let mut v = Vec::new();
            c.encode_canonical(&mut v);
            v
        };
        let variants = [
            CostModel {
                align_bytes: 512,
                ..base
            },
            CostModel {
                grain: Grain::Row,
                ..base
            },
            CostModel {
                node_bandwidth: Some(1e9),
                ..base
            },
            CostModel {
                aggregate_bandwidth: Some(1e9),
                ..base
            },
        ];
        for v in &variants {
            assert_ne!(encode(v), encode(&base), "{v:?}");
        }
    }

    #[test]
    fn spread_order_alternates_nodes() {
        let t = Topology { ranks_per_node: 2 };
        assert_eq!(t.spread_order(6), vec![0, 2, 4, 1, 3, 5]);
        assert!(t.validate(5).is_err());
        assert!(Topology { ranks_per_node: 0 }.validate(4).is_err());
    }
}
