//! Reed–Solomon erasure coding: the building block of multi-level storage
//! (FTI-style L3), where a group of `g` ranks adds `g` parity shards to its
//! `g` data shards, so that any `g` of the `2g` files can be lost.
//!
//! A thin layer over the `reed-solomon-simd` crate (Leopard-RS, GF(2^16),
//! `O(n log n)`, SIMD chosen at run time). It adds what a checkpoint needs and
//! the crate leaves out:
//!
//! * data shards of unequal length: each is zero-padded to [`shard_len`] of
//!   the data lengths, the longest rounded up to an even size (the crate
//!   codes 16-bit symbols and needs a non-zero, even shard size). The
//!   caller records the data lengths beside the parity (they are needed to
//!   reconstruct) and gets every shard back trimmed to its own length;
//! * empty data: all shards empty gives empty parity shards, no coding;
//! * errors that name what is wrong, checked before any coding: counts out
//!   of range, indices out of range or given twice, lengths that disagree
//!   with the recorded ones, and fewer than `original_count` surviving
//!   shards. Too few shards is always an error, never wrong data.
//!
//! Like the crate, this detects lost shards, not corrupt ones: a caller
//! that may read damaged files must verify each shard (e.g. with its
//! checksum) and leave out those that fail, as if lost.
//!
//! Data shards are given at their own (unpadded) length, parity shards at
//! [`shard_len`]: exactly what [`ErasureCode::encode`] takes and returns.

use reed_solomon_simd::{ReedSolomonDecoder, ReedSolomonEncoder};
use thiserror::Error;

/// Most data shards, and most parity shards, of one code. The crate allows
/// up to 32768 of each in every combination (and some larger, lopsided
/// ones, which a checkpoint group has no use for).
pub const MAX_SHARDS: usize = 32768;

/// Which side of the code a shard belongs to, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardKind {
    Data,
    Parity,
}

impl std::fmt::Display for ShardKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ShardKind::Data => "data",
            ShardKind::Parity => "parity",
        })
    }
}

/// Inputs that cannot be encoded or reconstructed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ErasureError {
    #[error(
        "unsupported Reed-Solomon code: {original_count} data and {parity_count} parity shards; \
         each count must be between 1 and {MAX_SHARDS}"
    )]
    Counts {
        original_count: usize,
        parity_count: usize,
    },
    #[error("expected {expected} data shards, got {got}")]
    DataCount { expected: usize, got: usize },
    #[error("expected {expected} data shard lengths, got {got}")]
    LengthCount { expected: usize, got: usize },
    #[error("{kind} shard index {index} is out of range: the code has {count} {kind} shards")]
    Index {
        kind: ShardKind,
        index: usize,
        count: usize,
    },
    #[error("{kind} shard {index} is given twice")]
    Duplicate { kind: ShardKind, index: usize },
    #[error("{kind} shard {index} has {got} bytes, expected {expected}")]
    ShardLength {
        kind: ShardKind,
        index: usize,
        got: usize,
        expected: usize,
    },
    #[error(
        "too few shards survive to reconstruct: {data_present} data and {parity_present} parity \
         shards, but {original_count} are needed"
    )]
    NotEnoughShards {
        original_count: usize,
        data_present: usize,
        parity_present: usize,
    },
    /// An error of the underlying crate that the checks above should have
    /// caught first; reported rather than unwrapped.
    #[error("Reed-Solomon coding failed: {0}")]
    Codec(String),
}

fn codec_err(e: reed_solomon_simd::Error) -> ErasureError {
    ErasureError::Codec(e.to_string())
}

/// The length every shard is coded at: the longest data length rounded up
/// to an even number of bytes (0 when all data shards are empty). Parity
/// shards have this length.
pub fn shard_len(lengths: &[usize]) -> usize {
    let longest = lengths.iter().copied().max().unwrap_or(0);
    longest + (longest & 1)
}

/// A Reed–Solomon code with `original_count` data shards and
/// `parity_count` parity shards: any `original_count` of the
/// `original_count + parity_count` shards restore all data shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErasureCode {
    original_count: usize,
    parity_count: usize,
}

impl ErasureCode {
    /// Checks the counts: each between 1 and [`MAX_SHARDS`].
    pub fn new(original_count: usize, parity_count: usize) -> Result<Self, ErasureError> {
        let ok = (1..=MAX_SHARDS).contains(&original_count)
            && (1..=MAX_SHARDS).contains(&parity_count)
            && ReedSolomonEncoder::supports(original_count, parity_count);
        if !ok {
            return Err(ErasureError::Counts {
                original_count,
                parity_count,
            });
        }
        Ok(ErasureCode {
            original_count,
            parity_count,
        })
    }

    pub fn original_count(&self) -> usize {
        self.original_count
    }

    pub fn parity_count(&self) -> usize {
        self.parity_count
    }

    /// Encodes `data` (exactly `original_count` shards, of any lengths) and
    /// returns the `parity_count` parity shards, each [`shard_len`] bytes.
    pub fn encode(&self, data: &[&[u8]]) -> Result<Vec<Vec<u8>>, ErasureError> {
        let len = shard_len(&data.iter().map(|d| d.len()).collect::<Vec<_>>());
        let mut parity = vec![vec![0u8; len]; self.parity_count];
        self.encode_with(data, |index, offset, piece| {
            parity[index][offset..offset + piece.len()].copy_from_slice(piece)
        })?;
        Ok(parity)
    }

    /// [`encode`](Self::encode) that hands the parity to `sink` as
    /// `(index, offset, bytes)` pieces instead of allocating it, e.g. to
    /// write it straight into a caller's buffers. The pieces of each parity
    /// shard cover `0..shard_len` exactly once, in order. Returns the shard
    /// length.
    pub fn encode_with(
        &self,
        data: &[&[u8]],
        sink: impl FnMut(usize, usize, &[u8]),
    ) -> Result<usize, ErasureError> {
        self.encode_chunked(data, CHUNK, sink)
    }

    fn encode_chunked(
        &self,
        data: &[&[u8]],
        chunk: usize,
        mut sink: impl FnMut(usize, usize, &[u8]),
    ) -> Result<usize, ErasureError> {
        if data.len() != self.original_count {
            return Err(ErasureError::DataCount {
                expected: self.original_count,
                got: data.len(),
            });
        }
        let lengths: Vec<usize> = data.iter().map(|d| d.len()).collect();
        let len = shard_len(&lengths);
        if len == 0 {
            for index in 0..self.parity_count {
                sink(index, 0, &[]);
            }
            return Ok(0);
        }
        let mut encoder: Option<ReedSolomonEncoder> = None;
        let mut scratch = Vec::new();
        for offset in (0..len).step_by(chunk) {
            let n = chunk.min(len - offset);
            let encoder = match encoder.as_mut() {
                Some(e) => {
                    e.reset(self.original_count, self.parity_count, n)
                        .map_err(codec_err)?;
                    e
                }
                None => encoder.insert(
                    ReedSolomonEncoder::new(self.original_count, self.parity_count, n)
                        .map_err(codec_err)?,
                ),
            };
            for shard in data {
                encoder
                    .add_original_shard(window(shard, offset, n, &mut scratch))
                    .map_err(codec_err)?;
            }
            let result = encoder.encode().map_err(codec_err)?;
            for (index, piece) in result.recovery_iter().enumerate() {
                sink(index, offset, piece);
            }
        }
        Ok(len)
    }

    /// Restores all data shards from the survivors: `originals` are
    /// `(index, bytes)` of the data shards still present, each exactly its
    /// recorded length; `parity` are `(index, bytes)` of the parity shards
    /// present, each [`shard_len`] bytes; `lengths` are the recorded lengths
    /// of all `original_count` data shards. Needs at least `original_count`
    /// shards in all. Returns every data shard, trimmed to its length.
    pub fn reconstruct(
        &self,
        originals: &[(usize, &[u8])],
        parity: &[(usize, &[u8])],
        lengths: &[usize],
    ) -> Result<Vec<Vec<u8>>, ErasureError> {
        let mut out = vec![Vec::new(); self.original_count];
        if lengths.len() == self.original_count {
            for &index in &self.check(originals, parity, lengths)? {
                out[index] = vec![0u8; lengths[index]];
            }
        }
        self.reconstruct_with(originals, parity, lengths, |index, offset, piece| {
            out[index][offset..offset + piece.len()].copy_from_slice(piece)
        })?;
        for &(index, shard) in originals {
            out[index] = shard.to_vec();
        }
        Ok(out)
    }

    /// Checks the inputs of [`reconstruct`](Self::reconstruct) without
    /// coding anything, and returns the indices of the missing data shards
    /// that reconstruction would restore (ascending). Cheap: a caller can
    /// run it before allocating outputs.
    pub fn check(
        &self,
        originals: &[(usize, &[u8])],
        parity: &[(usize, &[u8])],
        lengths: &[usize],
    ) -> Result<Vec<usize>, ErasureError> {
        if lengths.len() != self.original_count {
            return Err(ErasureError::LengthCount {
                expected: self.original_count,
                got: lengths.len(),
            });
        }
        let len = shard_len(lengths);
        let mut have_data = vec![false; self.original_count];
        for &(index, shard) in originals {
            if index >= self.original_count {
                return Err(ErasureError::Index {
                    kind: ShardKind::Data,
                    index,
                    count: self.original_count,
                });
            }
            if std::mem::replace(&mut have_data[index], true) {
                return Err(ErasureError::Duplicate {
                    kind: ShardKind::Data,
                    index,
                });
            }
            if shard.len() != lengths[index] {
                return Err(ErasureError::ShardLength {
                    kind: ShardKind::Data,
                    index,
                    got: shard.len(),
                    expected: lengths[index],
                });
            }
        }
        let mut have_parity = vec![false; self.parity_count];
        for &(index, shard) in parity {
            if index >= self.parity_count {
                return Err(ErasureError::Index {
                    kind: ShardKind::Parity,
                    index,
                    count: self.parity_count,
                });
            }
            if std::mem::replace(&mut have_parity[index], true) {
                return Err(ErasureError::Duplicate {
                    kind: ShardKind::Parity,
                    index,
                });
            }
            if shard.len() != len {
                return Err(ErasureError::ShardLength {
                    kind: ShardKind::Parity,
                    index,
                    got: shard.len(),
                    expected: len,
                });
            }
        }
        if originals.len() + parity.len() < self.original_count {
            return Err(ErasureError::NotEnoughShards {
                original_count: self.original_count,
                data_present: originals.len(),
                parity_present: parity.len(),
            });
        }
        Ok((0..self.original_count)
            .filter(|&i| !have_data[i])
            .collect())
    }

    /// [`reconstruct`](Self::reconstruct) that hands only the restored
    /// (missing) data shards to `sink`, as `(index, offset, bytes)` pieces
    /// that cover `0..lengths[index]` of each exactly once, in order, and
    /// copies nothing else. Everything is checked first (see
    /// [`check`](Self::check)): an input error calls `sink` never.
    pub fn reconstruct_with(
        &self,
        originals: &[(usize, &[u8])],
        parity: &[(usize, &[u8])],
        lengths: &[usize],
        sink: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), ErasureError> {
        self.reconstruct_chunked(originals, parity, lengths, CHUNK, sink)
    }

    fn reconstruct_chunked(
        &self,
        originals: &[(usize, &[u8])],
        parity: &[(usize, &[u8])],
        lengths: &[usize],
        chunk: usize,
        mut sink: impl FnMut(usize, usize, &[u8]),
    ) -> Result<(), ErasureError> {
        let missing = self.check(originals, parity, lengths)?;
        if missing.is_empty() {
            return Ok(());
        }
        let len = shard_len(lengths);
        if len == 0 {
            for index in missing {
                sink(index, 0, &[]);
            }
            return Ok(());
        }
        // Exactly as many parity shards as are missing: more add work, not
        // information.
        let parity = &parity[..missing.len()];
        let mut decoder: Option<ReedSolomonDecoder> = None;
        let mut scratch = Vec::new();
        for offset in (0..len).step_by(chunk) {
            let n = chunk.min(len - offset);
            let decoder = match decoder.as_mut() {
                Some(d) => {
                    d.reset(self.original_count, self.parity_count, n)
                        .map_err(codec_err)?;
                    d
                }
                None => decoder.insert(
                    ReedSolomonDecoder::new(self.original_count, self.parity_count, n)
                        .map_err(codec_err)?,
                ),
            };
            for &(index, shard) in originals {
                decoder
                    .add_original_shard(index, window(shard, offset, n, &mut scratch))
                    .map_err(codec_err)?;
            }
            for &(index, shard) in parity {
                decoder
                    .add_recovery_shard(index, &shard[offset..offset + n])
                    .map_err(codec_err)?;
            }
            let result = decoder.decode().map_err(codec_err)?;
            for &index in &missing {
                let piece = result.restored_original(index).ok_or_else(|| {
                    ErasureError::Codec(format!("data shard {index} was not restored"))
                })?;
                let keep = lengths[index].saturating_sub(offset).min(n);
                if keep > 0 || offset == 0 {
                    sink(index, offset, &piece[..keep]);
                }
            }
        }
        Ok(())
    }
}

/// Bytes per coding step: shards are coded in windows of this many bytes,
/// so that the coder's working set stays small (cache-friendly) whatever
/// the shard size, while each step is large enough to amortize the
/// decoder's fixed cost per call (its error locator). Measured for a group
/// of 4 with 64 MiB shards (bench/erasure.py): 64 KiB windows encode at
/// 1.3 GB/s and decode at 0.6; 1 MiB at 1.45 and 1.0; whole shards at 0.55
/// and 0.2. Coding is independent across windows at multiples of 64 bytes,
/// so the parity is the same as for one whole-shard step (a test checks
/// it): not a format constant.
const CHUNK: usize = 1 << 20;

/// `shard[offset..offset + n]`, zero-padded (in `scratch`) where the shard
/// ends before `offset + n`.
fn window<'a>(shard: &'a [u8], offset: usize, n: usize, scratch: &'a mut Vec<u8>) -> &'a [u8] {
    let start = offset.min(shard.len());
    let end = (offset + n).min(shard.len());
    padded(&shard[start..end], n, scratch)
}

/// `shard` zero-padded to `len` bytes, in `scratch` when it is shorter.
fn padded<'a>(shard: &'a [u8], len: usize, scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if shard.len() == len {
        return shard;
    }
    scratch.clear();
    scratch.extend_from_slice(shard);
    scratch.resize(len, 0);
    scratch
}

/// Encodes `data_shards` with `parity_count` parity shards: see
/// [`ErasureCode::encode`].
pub fn encode(data_shards: &[&[u8]], parity_count: usize) -> Result<Vec<Vec<u8>>, ErasureError> {
    ErasureCode::new(data_shards.len(), parity_count)?.encode(data_shards)
}

/// Restores all `original_count` data shards: see
/// [`ErasureCode::reconstruct`].
pub fn reconstruct(
    original_count: usize,
    parity_count: usize,
    present_originals: &[(usize, &[u8])],
    present_parity: &[(usize, &[u8])],
    lengths: &[usize],
) -> Result<Vec<Vec<u8>>, ErasureError> {
    ErasureCode::new(original_count, parity_count)?.reconstruct(
        present_originals,
        present_parity,
        lengths,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn data(lengths: &[usize], seed: u8) -> Vec<Vec<u8>> {
        lengths
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                (0..n)
                    .map(|j| (j as u8).wrapping_mul(31).wrapping_add(seed ^ i as u8))
                    .collect()
            })
            .collect()
    }

    fn refs(v: &[Vec<u8>]) -> Vec<&[u8]> {
        v.iter().map(|s| s.as_slice()).collect()
    }

    type Present<'a> = Vec<(usize, &'a [u8])>;

    /// The survivors when the shards in `lost` (indices 0..k data, k..2k
    /// parity) are gone.
    fn survivors<'a>(
        d: &'a [Vec<u8>],
        p: &'a [Vec<u8>],
        lost: &[usize],
    ) -> (Present<'a>, Present<'a>) {
        let k = d.len();
        let o = (0..k)
            .filter(|i| !lost.contains(i))
            .map(|i| (i, d[i].as_slice()))
            .collect();
        let q = (0..p.len())
            .filter(|i| !lost.contains(&(k + i)))
            .map(|i| (i, p[i].as_slice()))
            .collect();
        (o, q)
    }

    #[test]
    fn round_trip_with_unequal_odd_lengths() {
        let lengths = [5, 0, 8, 3];
        let d = data(&lengths, 7);
        let p = encode(&refs(&d), 4).unwrap();
        assert_eq!(p.len(), 4);
        assert!(p.iter().all(|s| s.len() == 8));
        // Lose all four data shards: parity alone restores them.
        let (o, q) = survivors(&d, &p, &[0, 1, 2, 3]);
        assert_eq!(reconstruct(4, 4, &o, &q, &lengths).unwrap(), d);
        // Lose a fifth shard: an error, not data.
        let (o, q) = survivors(&d, &p, &[0, 1, 2, 3, 5]);
        let err = reconstruct(4, 4, &o, &q, &lengths).unwrap_err();
        assert!(matches!(err, ErasureError::NotEnoughShards { .. }), "{err}");
        assert!(err.to_string().contains("too few shards"), "{err}");
    }

    #[test]
    fn empty_data() {
        let d = vec![Vec::new(), Vec::new()];
        let p = encode(&refs(&d), 2).unwrap();
        assert_eq!(p, vec![Vec::<u8>::new(), Vec::new()]);
        let (o, q) = survivors(&d, &p, &[0, 1]);
        assert_eq!(reconstruct(2, 2, &o, &q, &[0, 0]).unwrap(), d);
        let (o, q) = survivors(&d, &p, &[0, 1, 2]);
        assert!(reconstruct(2, 2, &o, &q, &[0, 0]).is_err());
    }

    #[test]
    fn one_byte_shards() {
        let d = vec![vec![0xAB], vec![0xCD], vec![0xEF]];
        let p = encode(&refs(&d), 3).unwrap();
        assert!(p.iter().all(|s| s.len() == 2));
        let (o, q) = survivors(&d, &p, &[0, 2, 4]);
        assert_eq!(reconstruct(3, 3, &o, &q, &[1, 1, 1]).unwrap(), d);
    }

    #[test]
    fn counts_out_of_range() {
        for (k, m) in [(0, 1), (1, 0), (MAX_SHARDS + 1, 1), (1, MAX_SHARDS + 1)] {
            let err = ErasureCode::new(k, m).unwrap_err();
            assert_eq!(
                err,
                ErasureError::Counts {
                    original_count: k,
                    parity_count: m
                }
            );
            assert!(err.to_string().contains("between 1 and 32768"), "{err}");
        }
        assert!(encode(&[], 1).is_err());
        assert!(ErasureCode::new(MAX_SHARDS, MAX_SHARDS).is_ok());
    }

    #[test]
    fn inconsistent_inputs() {
        let lengths = [4, 6];
        let d = data(&lengths, 1);
        let p = encode(&refs(&d), 2).unwrap();
        let code = ErasureCode::new(2, 2).unwrap();
        let e = |o: &[(usize, &[u8])], q: &[(usize, &[u8])], l: &[usize]| {
            code.reconstruct(o, q, l).unwrap_err()
        };
        let (d0, d1, p0, p1) = (&d[0][..], &d[1][..], &p[0][..], &p[1][..]);
        assert!(matches!(
            e(&[(0, d0)], &[(0, p0)], &[4]),
            ErasureError::LengthCount { .. }
        ));
        assert!(matches!(
            e(&[(2, d0)], &[(0, p0)], &lengths),
            ErasureError::Index {
                kind: ShardKind::Data,
                index: 2,
                count: 2
            }
        ));
        assert!(matches!(
            e(&[(0, d0)], &[(2, p0)], &lengths),
            ErasureError::Index {
                kind: ShardKind::Parity,
                index: 2,
                count: 2
            }
        ));
        assert!(matches!(
            e(&[(0, d0), (0, d0)], &[], &lengths),
            ErasureError::Duplicate {
                kind: ShardKind::Data,
                index: 0
            }
        ));
        assert!(matches!(
            e(&[], &[(1, p1), (1, p1)], &lengths),
            ErasureError::Duplicate {
                kind: ShardKind::Parity,
                index: 1
            }
        ));
        // A data shard at another length than recorded (here: padded).
        assert!(matches!(
            e(&[(0, &p0[..6])], &[(0, p0)], &lengths),
            ErasureError::ShardLength {
                kind: ShardKind::Data,
                index: 0,
                got: 6,
                expected: 4
            }
        ));
        assert!(matches!(
            e(&[(0, d0)], &[(0, &p0[..4])], &lengths),
            ErasureError::ShardLength {
                kind: ShardKind::Parity,
                index: 0,
                got: 4,
                expected: 6
            }
        ));
        // Wrong number of data shards to encode.
        assert_eq!(
            code.encode(&[d0]).unwrap_err(),
            ErasureError::DataCount {
                expected: 2,
                got: 1
            }
        );
        // All data present: nothing to restore, parity not needed.
        assert_eq!(
            code.reconstruct(&[(1, d1), (0, d0)], &[], &lengths)
                .unwrap(),
            d
        );
    }

    #[test]
    fn sink_sees_only_missing_shards() {
        let lengths = [3, 9, 1];
        let d = data(&lengths, 3);
        let code = ErasureCode::new(3, 3).unwrap();
        let mut p = vec![vec![0; 10]; 3];
        let len = code
            .encode_with(&refs(&d), |i, off, s| {
                p[i][off..off + s.len()].copy_from_slice(s)
            })
            .unwrap();
        assert_eq!(len, 10);
        let (o, q) = survivors(&d, &p, &[0, 2, 3]);
        let mut seen = Vec::new();
        code.reconstruct_with(&o, &q, &lengths, |i, off, s| {
            seen.push((i, off, s.to_vec()))
        })
        .unwrap();
        assert_eq!(seen, vec![(0, 0, d[0].clone()), (2, 0, d[2].clone())]);
    }

    /// Coding in 64-byte-multiple windows gives the same parity as one
    /// whole-shard step, and decodes in any window size.
    #[test]
    fn windows_do_not_change_the_parity() {
        let lengths = [1000, 37, 0, 999, 640];
        let d = data(&lengths, 9);
        let code = ErasureCode::new(5, 5).unwrap();
        let parity_in = |chunk: usize| {
            let mut p = vec![vec![0u8; 1000]; 5];
            code.encode_chunked(&refs(&d), chunk, |i, off, s| {
                p[i][off..off + s.len()].copy_from_slice(s)
            })
            .unwrap();
            p
        };
        let whole = parity_in(usize::MAX);
        assert_eq!(whole, code.encode(&refs(&d)).unwrap());
        for chunk in [64, 128, 192, 640] {
            let p = parity_in(chunk);
            assert_eq!(p, whole, "chunk {chunk}");
            let (o, q) = survivors(&d, &p, &[0, 1, 3, 6, 9]);
            let mut out: Vec<Vec<u8>> = lengths.iter().map(|&n| vec![0xEE; n]).collect();
            let mut seen = [0usize; 5];
            code.reconstruct_chunked(&o, &q, &lengths, chunk, |i, off, s| {
                assert_eq!(off, seen[i], "pieces in order");
                seen[i] += s.len();
                out[i][off..off + s.len()].copy_from_slice(s)
            })
            .unwrap();
            for i in [0, 1, 3] {
                assert_eq!(out[i], d[i], "chunk {chunk} shard {i}");
                assert_eq!(seen[i], lengths[i]);
            }
        }
    }

    /// 1..=8 data shards, as many parity shards, lengths 0..=200 (odd and
    /// zero included), and a random order of the 2k shards to lose.
    fn case() -> impl Strategy<Value = (Vec<Vec<u8>>, Vec<usize>)> {
        (1usize..=8).prop_flat_map(|k| {
            (
                prop::collection::vec(prop::collection::vec(any::<u8>(), 0..=200), k),
                Just((0..2 * k).collect::<Vec<usize>>()).prop_shuffle(),
            )
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn any_k_losses_recover_and_one_more_fails((d, order) in case(), lose in 0usize..=8) {
            let k = d.len();
            let lengths: Vec<usize> = d.iter().map(|s| s.len()).collect();
            let p = encode(&refs(&d), k).unwrap();
            prop_assert!(p.iter().all(|s| s.len() == shard_len(&lengths)));
            let lose = lose.min(k);
            let (o, q) = survivors(&d, &p, &order[..lose]);
            prop_assert_eq!(reconstruct(k, k, &o, &q, &lengths).unwrap(), d.clone());
            // The full k losses, then one more: always an error.
            let (o, q) = survivors(&d, &p, &order[..k]);
            prop_assert_eq!(reconstruct(k, k, &o, &q, &lengths).unwrap(), d.clone());
            let (o, q) = survivors(&d, &p, &order[..k + 1]);
            let err = reconstruct(k, k, &o, &q, &lengths).unwrap_err();
            let is_not_enough = matches!(err, ErasureError::NotEnoughShards { .. });
            prop_assert!(is_not_enough, "{}", err);
            // Several coding windows per shard: the same data back.
            let (o, q) = survivors(&d, &p, &order[..lose]);
            let code = ErasureCode::new(k, k).unwrap();
            let mut out: Vec<Vec<u8>> = d.clone();
            for (i, shard) in out.iter_mut().enumerate() {
                if !o.iter().any(|&(j, _)| j == i) {
                    shard.clear();
                }
            }
            code.reconstruct_chunked(&o, &q, &lengths, 64, |i, off, s| {
                assert_eq!(out[i].len(), off);
                out[i].extend_from_slice(s)
            }).unwrap();
            prop_assert_eq!(out, d.clone());
        }
    }
}
