//! A compact binary form of a plan's assignment, for the plan cache.
//!
//! The manifest is not stored: whoever looks a plan up holds the manifest
//! (it is part of the key), so decoding rebuilds the [`Plan`] from the
//! caller's manifest and the stored pieces through [`crate::planning::pipeline::assemble_plan_with_fingerprint`],
//! which validates the assignment like a freshly computed one.
//!
//! Layout (integers little-endian, `varint` = unsigned LEB128):
//!
//! ```text
//! magic           4 bytes  "DPPC"
//! codec version   u16
//! flags           u16      (0)
//! fingerprint     32 bytes (the plan fingerprint, raw)
//! world size      u32
//! algorithm       u8       (index in Algorithm::ALL)
//! ranks_per_node  u32
//! cost            4 x f64 bit patterns (fixed_s, piece_s, bandwidth, writer_s), u64 min_piece_bytes,
//!                 u64 align_bytes, u8 grain, 2 x f64 (node_bandwidth, aggregate_bandwidth; +inf: unlimited)
//! leaves          u64      (manifest length)
//! plan_ms         f64      (time the plan took to compute)
//! pieces          u64      (total over all ranks)
//! per rank:       varint count, then per piece
//!                 varint leaf delta (from the previous piece of the rank; the first is absolute),
//!                 varint start, varint (stop - start)
//! checksum        32 bytes blake3 of everything above
//! ```

use std::sync::Arc;

use thiserror::Error;

use crate::model::cost::{CostModel, Grain, Topology};

/// A shared bandwidth as stored: +inf (unlimited) is `None`.
fn finite_or_none(v: f64) -> Option<f64> {
    if v == f64::INFINITY {
        None
    } else {
        Some(v)
    }
}
use crate::error::PlanError;
use crate::model::manifest::Manifest;
use crate::planning::plan::{
    check_coverage, check_piece, check_rank_count, Algorithm, Covering, Piece, Plan, PlanSource,
};

pub const MAGIC: &[u8; 4] = b"DPPC";
pub const CODEC_VERSION: u16 = 2;
const CHECKSUM_LEN: usize = 32;
const HEADER_LEN: usize = 4 + 2 + 2 + 32 + 4 + 1 + 4 + 5 * 8 + 8 + 1 + 2 * 8 + 8 + 8 + 8;

/// Why stored bytes cannot be turned back into a plan.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum CodecError {
    #[error("encoded plan is truncated ({0} bytes)")]
    Truncated(usize),
    #[error("not an encoded plan (bad magic)")]
    BadMagic,
    #[error("unsupported plan codec version {0} (this planner reads {CODEC_VERSION})")]
    Version(u16),
    #[error("encoded plan checksum mismatch")]
    Checksum,
    #[error("encoded plan is malformed: {0}")]
    Malformed(String),
    #[error("encoded plan is for other inputs: {0}")]
    Mismatch(String),
    #[error("decoded plan is invalid: {0}")]
    Invalid(#[from] PlanError),
}

/// The fixed-size head of an encoded plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Header {
    pub fingerprint: [u8; 32],
    pub world_size: u32,
    pub algorithm: Algorithm,
    pub topology: Topology,
    pub cost: CostModel,
    pub leaves: u64,
    pub plan_ms: f64,
    pub pieces: u64,
}

impl Header {
    pub fn fingerprint_hex(&self) -> String {
        hex(&self.fingerprint)
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// Parses a 64-digit hex fingerprint.
pub fn fingerprint_bytes(fingerprint: &str) -> Option<[u8; 32]> {
    let b = fingerprint.as_bytes();
    if b.len() != 64 {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (nibble(b[2 * i])? << 4) | nibble(b[2 * i + 1])?;
    }
    Some(out)
}

fn algorithm_code(a: Algorithm) -> u8 {
    Algorithm::ALL
        .iter()
        .position(|&x| x == a)
        .expect("every algorithm is in ALL") as u8
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// Encodes a plan's assignment with its inputs' parameters (not the manifest).
pub fn encode(plan: &Plan) -> Vec<u8> {
    let pieces: u64 = plan.ranks.iter().map(|r| r.len() as u64).sum();
    let mut out =
        Vec::with_capacity(HEADER_LEN + plan.ranks.len() + 6 * pieces as usize + CHECKSUM_LEN);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CODEC_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    let fp = fingerprint_bytes(&plan.fingerprint).unwrap_or([0; 32]);
    out.extend_from_slice(&fp);
    out.extend_from_slice(&plan.world_size.to_le_bytes());
    out.push(algorithm_code(plan.algorithm));
    out.extend_from_slice(&plan.topology.ranks_per_node.to_le_bytes());
    let c = &plan.cost;
    for v in [c.fixed_s, c.piece_s, c.bandwidth, c.writer_s] {
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    out.extend_from_slice(&c.min_piece_bytes.to_le_bytes());
    out.extend_from_slice(&c.align_bytes.to_le_bytes());
    out.push(c.grain.code());
    for v in [c.node_bandwidth_or_inf(), c.aggregate_bandwidth_or_inf()] {
        out.extend_from_slice(&v.to_bits().to_le_bytes());
    }
    out.extend_from_slice(&(plan.manifest.len() as u64).to_le_bytes());
    out.extend_from_slice(&plan.stats.plan_ms.to_bits().to_le_bytes());
    out.extend_from_slice(&pieces.to_le_bytes());
    debug_assert_eq!(out.len(), HEADER_LEN);
    for list in &plan.ranks {
        put_varint(&mut out, list.len() as u64);
        let mut prev = 0u32;
        for p in list {
            put_varint(&mut out, u64::from(p.leaf.wrapping_sub(prev)));
            put_varint(&mut out, p.start);
            put_varint(&mut out, p.stop.wrapping_sub(p.start));
            prev = p.leaf;
        }
    }
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        if self.buf.len() - self.pos < n {
            return Err(CodecError::Malformed(format!(
                "unexpected end at byte {}",
                self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, CodecError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn f64(&mut self) -> Result<f64, CodecError> {
        Ok(f64::from_bits(self.u64()?))
    }
    fn varint(&mut self) -> Result<u64, CodecError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = self.u8()?;
            let bits = u64::from(b & 0x7f);
            if shift == 63 && bits > 1 {
                return Err(CodecError::Malformed(format!(
                    "varint overflows at byte {}",
                    self.pos
                )));
            }
            v |= bits << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(CodecError::Malformed(format!(
            "varint too long at byte {}",
            self.pos
        )))
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
}

/// Checks magic, version and checksum, and parses the header. Returns the
/// header and the body that holds the pieces (checksum excluded).
pub fn check(bytes: &[u8]) -> Result<(Header, &[u8]), CodecError> {
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        if bytes.len() >= 4 && &bytes[..4] != MAGIC {
            return Err(CodecError::BadMagic);
        }
        return Err(CodecError::Truncated(bytes.len()));
    }
    if &bytes[..4] != MAGIC {
        return Err(CodecError::BadMagic);
    }
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    if version != CODEC_VERSION {
        return Err(CodecError::Version(version));
    }
    if blake3::hash(body).as_bytes() != sum {
        return Err(CodecError::Checksum);
    }
    let mut r = Reader { buf: body, pos: 6 };
    let flags = r.u16()?;
    if flags != 0 {
        return Err(CodecError::Malformed(format!("unknown flags {flags:#x}")));
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(r.take(32)?);
    let world_size = r.u32()?;
    let code = r.u8()?;
    let algorithm = *Algorithm::ALL
        .get(code as usize)
        .ok_or_else(|| CodecError::Malformed(format!("unknown algorithm code {code}")))?;
    let topology = Topology {
        ranks_per_node: r.u32()?,
    };
    let cost = CostModel {
        fixed_s: r.f64()?,
        piece_s: r.f64()?,
        bandwidth: r.f64()?,
        writer_s: r.f64()?,
        min_piece_bytes: r.u64()?,
        align_bytes: r.u64()?,
        grain: {
            let code = r.u8()?;
            Grain::from_code(code)
                .ok_or_else(|| CodecError::Malformed(format!("unknown grain code {code}")))?
        },
        node_bandwidth: finite_or_none(r.f64()?),
        aggregate_bandwidth: finite_or_none(r.f64()?),
    };
    let leaves = r.u64()?;
    let plan_ms = r.f64()?;
    let pieces = r.u64()?;
    let header = Header {
        fingerprint,
        world_size,
        algorithm,
        topology,
        cost,
        leaves,
        plan_ms,
        pieces,
    };
    Ok((header, &body[HEADER_LEN..]))
}

/// Decodes the per-rank piece lists of a checked body.
pub fn decode_pieces(header: &Header, pieces_body: &[u8]) -> Result<Vec<Vec<Piece>>, CodecError> {
    let mut r = Reader {
        buf: pieces_body,
        pos: 0,
    };
    // Every rank takes at least one byte and every piece at least three:
    // bounds the allocations by the input size.
    if header.world_size as usize > r.remaining() || header.pieces > (r.remaining() / 3) as u64 {
        return Err(CodecError::Malformed(
            "counts exceed the encoded size".into(),
        ));
    }
    let mut ranks = Vec::with_capacity(header.world_size as usize);
    let mut total = 0u64;
    for rank in 0..header.world_size {
        let n = r.varint()?;
        if n > (r.remaining() / 3) as u64 {
            return Err(CodecError::Malformed(format!(
                "rank {rank} claims {n} pieces"
            )));
        }
        let mut list = Vec::with_capacity(n as usize);
        let mut leaf = 0u64;
        for _ in 0..n {
            leaf += r.varint()?;
            let leaf32 = u32::try_from(leaf).map_err(|_| {
                CodecError::Malformed(format!("rank {rank}: leaf index {leaf} overflows"))
            })?;
            let start = r.varint()?;
            let len = r.varint()?;
            let stop = start.checked_add(len).ok_or_else(|| {
                CodecError::Malformed(format!("rank {rank}: piece end overflows"))
            })?;
            list.push(Piece {
                leaf: leaf32,
                start,
                stop,
            });
        }
        total += n;
        ranks.push(list);
    }
    if r.remaining() != 0 {
        return Err(CodecError::Malformed(format!(
            "{} trailing bytes",
            r.remaining()
        )));
    }
    if total != header.pieces {
        return Err(CodecError::Malformed(format!(
            "{total} pieces, header says {}",
            header.pieces
        )));
    }
    Ok(ranks)
}

/// Decodes a stored plan for a request and rebuilds it on the caller's
/// manifest. Every parameter in the header must match the request, and the
/// assignment is validated like a new plan (exact coverage, ownership,
/// bounds, order) before it is returned.
#[allow(clippy::too_many_arguments)]
pub fn decode(
    bytes: &[u8],
    manifest: Arc<Manifest>,
    world_size: u32,
    topology: Topology,
    cost: CostModel,
    algorithm: Algorithm,
    fingerprint: &str,
    source: PlanSource,
    plan_ms: Option<f64>,
) -> Result<Plan, CodecError> {
    let (header, body) = check(bytes)?;
    let mismatch = |what: &str| Err(CodecError::Mismatch(what.to_string()));
    if header.fingerprint_hex() != fingerprint {
        return mismatch("fingerprint");
    }
    if header.world_size != world_size {
        return mismatch("world size");
    }
    if header.algorithm != algorithm {
        return mismatch("algorithm");
    }
    if header.topology != topology {
        return mismatch("topology");
    }
    let mut a = Vec::new();
    let mut b = Vec::new();
    header.cost.encode_canonical(&mut a);
    cost.encode_canonical(&mut b);
    if a != b {
        return mismatch("cost model");
    }
    if header.leaves != manifest.len() as u64 {
        return mismatch("manifest length");
    }
    let ranks = decode_pieces(&header, body)?;
    crate::planning::inputs::validate_inputs(&manifest, u64::from(world_size), &topology, &cost)?;
    validate_decoded(&manifest, world_size, &ranks)?;
    Ok(crate::planning::pipeline::score_plan(
        manifest,
        world_size,
        topology,
        cost,
        algorithm,
        ranks,
        plan_ms.unwrap_or(header.plan_ms),
        source,
        Some(fingerprint.to_string()),
    ))
}

/// Checks a decoded assignment: accepts exactly what
/// [`crate::planning::plan::validate_assignment`] accepts (every unit of every leaf
/// written exactly once, every piece on a holder of its leaf, pieces within bounds,
/// each rank's pieces strictly ordered), in linear time: a leaf written as
/// one piece needs no sort, and only the pieces of split leaves are sorted.
pub fn validate_decoded(
    manifest: &Manifest,
    world_size: u32,
    ranks: &[Vec<Piece>],
) -> Result<(), PlanError> {
    check_rank_count(ranks, world_size)?;
    let leaves = manifest.leaves();
    let mut count = vec![0u32; leaves.len()];
    for (r, list) in ranks.iter().enumerate() {
        for (i, p) in list.iter().enumerate() {
            check_piece(manifest, r, list, i)?;
            let c = &mut count[p.leaf as usize];
            *c = c.saturating_add(1);
        }
    }
    if let Some(missing) = count.iter().position(|&c| c == 0) {
        return Err(PlanError::Malformed(format!(
            "leaf {missing} ({}) is not written",
            leaves[missing].display_path()
        )));
    }
    // A leaf written as one piece is checked on the spot; the pieces of the
    // other leaves are collected and checked like validate_assignment does.
    let mut split: Vec<Covering> = Vec::new();
    for (r, list) in ranks.iter().enumerate() {
        for p in list {
            let piece = (p.leaf, p.start, p.stop, r as u32);
            if count[p.leaf as usize] == 1 {
                check_coverage(p.leaf, &leaves[p.leaf as usize], &[piece])?;
            } else {
                split.push(piece);
            }
        }
    }
    split.sort_unstable();
    let mut k = 0;
    while k < split.len() {
        let index = split[k].0;
        let end = k + split[k..].partition_point(|c| c.0 == index);
        check_coverage(index, &leaves[index as usize], &split[k..end])?;
        k = end;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::dtype::DType;
    use crate::model::manifest::{Leaf, PathKey};

    fn manifest(n: usize) -> Arc<Manifest> {
        let mut leaves = Vec::new();
        for i in 0..n {
            let path = vec![
                PathKey::Str("layer".into()),
                PathKey::Int(i as i64),
                PathKey::Str("w".into()),
            ];
            let leaf = if i % 7 == 3 {
                Leaf::object(
                    path,
                    100 + i as u64,
                    if i % 5 == 0 { Some(1) } else { None },
                )
                .unwrap()
            } else {
                Leaf::tensor(
                    path,
                    DType::parse("float32").unwrap(),
                    vec![(i as u64 % 50 + 1) * 40_000, 8],
                    None,
                )
                .unwrap()
            };
            leaves.push(leaf);
        }
        Arc::new(Manifest::new(leaves).unwrap())
    }

    fn sample(n: usize, world: u64) -> Plan {
        crate::planning::pipeline::plan(
            manifest(n),
            world,
            Topology::default(),
            CostModel::default(),
            Algorithm::Balanced,
        )
        .unwrap()
    }

    fn dec(bytes: &[u8], p: &Plan) -> Result<Plan, CodecError> {
        decode(
            bytes,
            p.manifest.clone(),
            p.world_size,
            p.topology,
            p.cost,
            p.algorithm,
            &p.fingerprint,
            PlanSource::Disk,
            None,
        )
    }

    #[test]
    fn round_trips() {
        for (n, world) in [(1, 1), (10, 3), (500, 16), (2000, 64)] {
            let p = sample(n, world);
            let bytes = encode(&p);
            let q = dec(&bytes, &p).unwrap();
            assert_eq!(q.ranks, p.ranks);
            assert_eq!(q.fingerprint, p.fingerprint);
            assert_eq!(q.stats.source, PlanSource::Disk);
            assert_eq!(q.stats.plan_ms, p.stats.plan_ms);
            assert_eq!(q.stats.makespan_s, p.stats.makespan_s);
            let (h, _) = check(&bytes).unwrap();
            assert_eq!(h.pieces, p.stats.pieces);
            assert_eq!(h.fingerprint_hex(), p.fingerprint);
        }
    }

    #[test]
    fn every_single_byte_flip_and_truncation_is_rejected() {
        let p = sample(40, 4);
        let bytes = encode(&p);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x41;
            assert!(dec(&b, &p).is_err(), "flip at {i} accepted");
        }
        for len in 0..bytes.len() {
            assert!(
                dec(&bytes[..len], &p).is_err(),
                "truncation to {len} accepted"
            );
        }
        assert!(matches!(
            dec(b"garbage garbage garbage", &p),
            Err(CodecError::BadMagic)
        ));
    }

    /// A body with a valid checksum but a wrong assignment (a forged or
    /// buggy writer) still fails: decoding validates the assignment.
    #[test]
    fn a_well_checksummed_wrong_assignment_is_rejected() {
        let p = sample(30, 4);
        let mut bad = p.clone();
        // Move one rank's first piece to another rank: still covering, but
        // drop one piece entirely to break coverage.
        let r = bad.ranks.iter().position(|l| !l.is_empty()).unwrap();
        bad.ranks[r].remove(0);
        let bytes = encode(&bad);
        assert!(matches!(
            dec(&bytes, &p),
            Err(CodecError::Invalid(_)) | Err(CodecError::Malformed(_))
        ));
    }

    #[test]
    fn other_inputs_do_not_decode() {
        let p = sample(30, 4);
        let bytes = encode(&p);
        let other_cost = CostModel {
            piece_s: 1e-3,
            ..CostModel::default()
        };
        let r = decode(
            &bytes,
            p.manifest.clone(),
            4,
            p.topology,
            other_cost,
            p.algorithm,
            &p.fingerprint,
            PlanSource::Disk,
            None,
        );
        assert!(matches!(r, Err(CodecError::Mismatch(_))));
        let r = decode(
            &bytes,
            p.manifest.clone(),
            8,
            p.topology,
            p.cost,
            p.algorithm,
            &p.fingerprint,
            PlanSource::Disk,
            None,
        );
        assert!(matches!(r, Err(CodecError::Mismatch(_))));
        let r = decode(
            &bytes,
            manifest(31),
            4,
            p.topology,
            p.cost,
            p.algorithm,
            &p.fingerprint,
            PlanSource::Disk,
            None,
        );
        assert!(matches!(r, Err(CodecError::Mismatch(_))));
        let r = decode(
            &bytes,
            p.manifest.clone(),
            4,
            p.topology,
            p.cost,
            p.algorithm,
            &"0".repeat(64),
            PlanSource::Disk,
            None,
        );
        assert!(matches!(r, Err(CodecError::Mismatch(_))));
    }

    /// The linear check accepts exactly what validate_assignment accepts,
    /// on valid plans and on many small corruptions of them.
    #[test]
    fn linear_validation_agrees_with_validate_assignment() {
        let mut leaves = Vec::new();
        for i in 0..40u64 {
            let path = vec![PathKey::Int(i as i64)];
            leaves.push(match i % 5 {
                0 => Leaf::object(
                    path,
                    10 + i,
                    if i % 10 == 0 {
                        Some((i % 3) as u32)
                    } else {
                        None
                    },
                )
                .unwrap(),
                1 => {
                    Leaf::tensor(path, DType::parse("float32").unwrap(), vec![0, 4], None).unwrap()
                }
                _ => Leaf::tensor(
                    path,
                    DType::parse("float32").unwrap(),
                    vec![(i + 1) * 300_000],
                    None,
                )
                .unwrap(),
            });
        }
        let m = Arc::new(Manifest::new(leaves).unwrap());
        let cost = CostModel {
            min_piece_bytes: 1 << 16,
            ..CostModel::default()
        };
        let mut state = 0x9e3779b97f4a7c15u64;
        let mut next = move |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n.max(1) as u64) as usize
        };
        let mut agreed_bad = 0;
        for world in [3u64, 4, 8] {
            for alg in Algorithm::ALL {
                let p = crate::planning::pipeline::plan(
                    m.clone(),
                    world,
                    Topology::default(),
                    cost,
                    alg,
                )
                .unwrap();
                let w = p.world_size;
                assert!(validate_decoded(&m, w, &p.ranks).is_ok());
                for _ in 0..300 {
                    let mut ranks = p.ranks.clone();
                    let r = next(ranks.len());
                    if ranks[r].is_empty() {
                        continue;
                    }
                    let i = next(ranks[r].len());
                    match next(7) {
                        0 => {
                            ranks[r].remove(i);
                        }
                        1 => {
                            let piece = ranks[r][i];
                            ranks[r].insert(i, piece);
                        }
                        2 => ranks[r][i].start = ranks[r][i].start.wrapping_add(1),
                        3 => ranks[r][i].stop = ranks[r][i].stop.wrapping_sub(1),
                        4 => {
                            let piece = ranks[r].remove(i);
                            let to = next(ranks.len());
                            ranks[to].push(piece);
                            ranks[to].sort_unstable();
                        }
                        5 => ranks[r][i].leaf = ranks[r][i].leaf.wrapping_add(1),
                        _ => {
                            let last = ranks[r].len() - 1;
                            ranks[r].swap(0, last);
                        }
                    }
                    let a = crate::planning::plan::validate_assignment(&m, w, &ranks).is_ok();
                    let b = validate_decoded(&m, w, &ranks).is_ok();
                    assert_eq!(a, b, "disagree on {ranks:?}");
                    agreed_bad += usize::from(!a);
                }
            }
        }
        assert!(agreed_bad > 1000, "{agreed_bad}");
    }

    #[test]
    fn varints() {
        for v in [
            0u64,
            1,
            127,
            128,
            300,
            u32::MAX as u64,
            u64::MAX - 1,
            u64::MAX,
        ] {
            let mut out = Vec::new();
            put_varint(&mut out, v);
            let mut r = Reader { buf: &out, pos: 0 };
            assert_eq!(r.varint().unwrap(), v);
            assert_eq!(r.remaining(), 0);
        }
        let over = [0xffu8; 11];
        assert!(Reader { buf: &over, pos: 0 }.varint().is_err());
    }
}
