//! Content fingerprints of planning inputs. Two requests with the same
//! fingerprint must get the same plan; a new planner version never shares one.

use crate::model::cost::{CostModel, Topology};
use crate::model::manifest::{encode_groups, encode_leaf, Manifest};
use crate::planning::plan::Algorithm;

/// Bytes hashed per `blake3` update: the encoding is streamed through a
/// small buffer instead of being built whole (a 100,000-leaf manifest
/// encodes to ~7 MB, and touching that much fresh memory dominates a
/// plan-cache hit in a new process).
const CHUNK: usize = 1 << 16;

/// Hex blake3 hash of everything a plan depends on: the hash of
/// `"deeppart-plan-v1\0" PLANNER_VERSION "\0" algorithm "\0" world_size
/// topology cost manifest`, each in its canonical encoding
/// ([`Manifest::encode_canonical`] for the manifest).
pub fn plan_fingerprint(
    manifest: &Manifest,
    world_size: u32,
    topology: &Topology,
    cost: &CostModel,
    algorithm: Algorithm,
) -> String {
    let mut hasher = blake3::Hasher::new();
    let mut buf = Vec::with_capacity(CHUNK + 1024);
    buf.extend_from_slice(b"deeppart-plan-v1\0");
    buf.extend_from_slice(crate::planning::inputs::PLANNER_VERSION.as_bytes());
    buf.push(0);
    buf.extend_from_slice(algorithm.name().as_bytes());
    buf.push(0);
    buf.extend_from_slice(&world_size.to_le_bytes());
    topology.encode_canonical(&mut buf);
    cost.encode_canonical(&mut buf);
    // The same bytes as Manifest::encode_canonical, a chunk at a time.
    buf.extend_from_slice(&(manifest.len() as u64).to_le_bytes());
    for leaf in manifest.leaves() {
        encode_leaf(leaf, &mut buf);
        if buf.len() >= CHUNK {
            hasher.update(&buf);
            buf.clear();
        }
    }
    encode_groups(manifest.groups(), &mut buf);
    hasher.update(&buf);
    hasher.finalize().to_hex().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::manifest::{Leaf, PathKey};

    /// The definition: one hash over the whole encoding.
    fn reference(
        m: &Manifest,
        world_size: u32,
        t: &Topology,
        c: &CostModel,
        a: Algorithm,
    ) -> String {
        let mut buf = Vec::new();
        buf.extend_from_slice(b"deeppart-plan-v1\0");
        buf.extend_from_slice(crate::planning::inputs::PLANNER_VERSION.as_bytes());
        buf.push(0);
        buf.extend_from_slice(a.name().as_bytes());
        buf.push(0);
        buf.extend_from_slice(&world_size.to_le_bytes());
        t.encode_canonical(&mut buf);
        c.encode_canonical(&mut buf);
        m.encode_canonical(&mut buf);
        blake3::hash(&buf).to_hex().to_string()
    }

    #[test]
    fn streaming_matches_the_whole_encoding() {
        for n in [0usize, 1, 7, 3000, 20_000] {
            let leaves = (0..n)
                .map(|i| {
                    let path = vec![
                        PathKey::Str(format!("layer{}", i % 17)),
                        PathKey::Int(i as i64 - 5),
                        PathKey::Str("w".repeat(i % 40)),
                    ];
                    match i % 3 {
                        0 => Leaf::object(path, i as u64, Some((i % 4) as u32)).unwrap(),
                        1 => Leaf::tensor(
                            path,
                            DType::parse("bfloat16").unwrap(),
                            vec![i as u64, 3],
                            None,
                        )
                        .unwrap(),
                        _ => Leaf::tensor(path, DType::parse("float64").unwrap(), vec![], Some(1))
                            .unwrap(),
                    }
                })
                .collect();
            let leaves: Vec<Leaf> = leaves;
            let groups = if n % 2 == 1 {
                vec![vec![0, 3], vec![1, 2, 5]]
            } else {
                Vec::new()
            };
            let leaves = leaves
                .into_iter()
                .enumerate()
                .map(|(i, l)| {
                    if !groups.is_empty() && l.owner.is_none() && i % 5 == 0 {
                        l.with_holders(Some((i % 2) as u32))
                    } else {
                        l
                    }
                })
                .collect();
            let m = Manifest::with_groups(leaves, groups).unwrap();
            let t = Topology { ranks_per_node: 2 };
            let c = CostModel {
                piece_s: 3e-5,
                ..CostModel::default()
            };
            for a in Algorithm::ALL {
                assert_eq!(
                    plan_fingerprint(&m, 8, &t, &c, a),
                    reference(&m, 8, &t, &c, a),
                    "n={n} {a}"
                );
            }
        }
    }
}
