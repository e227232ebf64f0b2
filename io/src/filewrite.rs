//! Writing a piece to a data file and checksumming it on the way, in one
//! pass, with no interpreter involved: an asynchronous save's writer thread
//! calls [`write_hashed`] once per piece from Python with the GIL released
//! for the whole piece, so the training loop's thread never waits for the
//! writer to hand the GIL back between chunks (issue 35).
//!
//! Each chunk is hashed (xxh3_64, the format's checksum) right before it is
//! written, while it is in the cache. With [`Pacing::Writeback`], the
//! chunk's write-back to the device is started as soon as it is written
//! (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), and the writer waits for the
//! chunk before the previous one to be on the device before going on: at
//! most two chunks of the file are dirty in the page cache at any time, so
//! the final `fsync` finds little to do and the kernel does not flush a
//! whole file's dirty pages in one burst while training runs.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

use xxhash_rust::xxh3::Xxh3;

/// How the page cache's write-back of the written bytes is driven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pacing {
    /// Left to the kernel (and to the caller's final `fsync`).
    Kernel,
    /// Started per chunk, and waited for one chunk behind (Linux; elsewhere
    /// the same as [`Pacing::Kernel`]).
    Writeback,
}

/// xxh3_64 of `data` (the format's checksum; the same value as Python's
/// `xxhash.xxh3_64(data).intdigest()`).
pub fn xxh3_64(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// Writes `data` into `file` at `offset`, `chunk` bytes per write call
/// (at least one byte), and returns its xxh3_64. Short writes are resumed;
/// any error is returned as it came.
pub fn write_hashed(
    file: &File,
    offset: u64,
    data: &[u8],
    chunk: usize,
    pacing: Pacing,
) -> io::Result<u64> {
    let chunk = chunk.max(1);
    let mut hasher = Xxh3::new();
    let mut at = offset;
    let mut behind: Option<(u64, u64)> = None; // the previous chunk: (offset, length)
    for part in data.chunks(chunk) {
        hasher.update(part);
        file.write_all_at(part, at)?;
        let len = part.len() as u64;
        if pacing == Pacing::Writeback {
            start_writeback(file, at, len)?;
            if let Some((from, n)) = behind {
                wait_writeback(file, from, n)?;
            }
            behind = Some((at, len));
        }
        at += len;
    }
    if let Some((from, n)) = behind {
        wait_writeback(file, from, n)?;
    }
    Ok(hasher.digest())
}

#[cfg(target_os = "linux")]
fn sync_range(file: &File, offset: u64, len: u64, flags: libc::c_uint) -> io::Result<()> {
    // SAFETY: a plain system call on an open descriptor that `file` keeps
    // open for the duration of the call; no memory is passed.
    let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), offset as i64, len as i64, flags) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(target_os = "linux")]
fn start_writeback(file: &File, offset: u64, len: u64) -> io::Result<()> {
    sync_range(file, offset, len, libc::SYNC_FILE_RANGE_WRITE)
}

#[cfg(target_os = "linux")]
fn wait_writeback(file: &File, offset: u64, len: u64) -> io::Result<()> {
    sync_range(
        file,
        offset,
        len,
        libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER,
    )
}

#[cfg(not(target_os = "linux"))]
fn start_writeback(_file: &File, _offset: u64, _len: u64) -> io::Result<()> {
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn wait_writeback(_file: &File, _offset: u64, _len: u64) -> io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// Bytes that differ from chunk to chunk (no period of 4 KiB or 1 MiB).
    fn pattern(n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect()
    }

    #[test]
    fn writes_every_byte_at_the_offset_and_returns_the_checksum() {
        let data = pattern(100_003);
        for pacing in [Pacing::Kernel, Pacing::Writeback] {
            for chunk in [1 << 12, 7_001, 1 << 20] {
                let path = std::env::temp_dir().join(format!(
                    "deeppart-filewrite-{}-{chunk}-{pacing:?}",
                    std::process::id()
                ));
                let file = File::create(&path).unwrap();
                file.write_all_at(b"head", 0).unwrap();
                let sum = write_hashed(&file, 64, &data, chunk, pacing).unwrap();
                assert_eq!(sum, xxh3_64(&data));
                drop(file);
                let mut back = Vec::new();
                File::open(&path).unwrap().read_to_end(&mut back).unwrap();
                std::fs::remove_file(&path).unwrap();
                assert_eq!(&back[..4], b"head");
                assert!(back[4..64].iter().all(|&b| b == 0));
                assert_eq!(&back[64..], &data[..], "chunk={chunk} {pacing:?}");
            }
        }
    }

    #[test]
    fn the_checksum_is_xxh3_64() {
        // Reference values of XXH3_64bits with seed 0.
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        assert_eq!(xxh3_64(b"a"), 0xE6C6_32B6_1E96_4E1F);
    }

    #[test]
    fn an_error_of_the_file_is_returned() {
        let path =
            std::env::temp_dir().join(format!("deeppart-filewrite-ro-{}", std::process::id()));
        File::create(&path).unwrap();
        let read_only = File::open(&path).unwrap();
        let err = write_hashed(&read_only, 0, &[1, 2, 3], 2, Pacing::Kernel).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF));
    }
}
