"""Small file I/O helpers of the built-in level engine, and the check that
a rank's data file is intact.

Used by every step of :mod:`deeppart.levels.engine`: the L1 write and the
L2/L3 steps of a save (:mod:`deeppart.levels.partner`,
:mod:`deeppart.levels.erasure`) read this rank's just-written file with
:func:`read_own` and write the partner copy or parity shard with
:func:`write_file` / :class:`Writer`; recovery
(:mod:`deeppart.levels.recovery`) reads what survives with
:func:`~deeppart.storage.files.read_all` /
:func:`~deeppart.storage.files.size_is`, verifies it with :func:`file_ok`
and hands the restored files to the reader stage through :class:`BufReader`.

The I/O helpers record errors instead of raising where a collective protocol
must carry on (every rank takes its part in the exchanges, then all agree).
Tests inject I/O faults by replacing :func:`write_file` and :func:`read_own`
on this module, so callers look them up here (``files.write_file``) at call
time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.errors import CorruptCheckpointError
from deeppart.format import (
    HEADER_SIZE,
    Metadata,
    Piece,
    check_header,
    checksum,
    data_file_name,
    fsync_dir,
)

U8 = npt.NDArray[np.uint8]
#: An empty byte array (what a rank sends when it has nothing to send).
EMPTY: U8 = np.empty(0, dtype=np.uint8)


def write_file(path: Path, chunks: Sequence[U8 | bytes]) -> None:
    """Writes ``chunks`` to ``path`` and fsyncs it (raises on error)."""
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c if isinstance(c, bytes) else c.data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: Path, chunks: Sequence[U8 | bytes]) -> None:
    """Writes ``chunks`` as ``path`` through the temporary name
    ``path.tmp`` (written, fsynced, renamed, the directory fsynced). On any
    failure (a full disk, ``path`` being a directory) the temporary file is
    removed and the error raised: a failed write leaves nothing behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write_file(tmp, chunks)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
        raise
    fsync_dir(path.parent)


def read_own(path: Path, size: int) -> tuple[U8, OSError | None]:
    """This rank's just-written file, or zeros of its announced ``size`` and
    the error (so that it still takes its part in the exchanges)."""
    try:
        data: U8 = np.fromfile(path, dtype=np.uint8)
        if data.size == size:
            return data, None
        err = OSError(f"{path}: {data.size} bytes, {size} expected")
    except OSError as e:
        err = e
    return np.zeros(size, dtype=np.uint8), err


class Writer:
    """A file written and fsynced as a context manager, recording (not
    raising) the first I/O error, so a collective protocol can carry on."""

    def __init__(self, path: Path) -> None:
        self.err: OSError | None = None
        self.f: Any = None
        try:
            self.f = open(path, "wb")  # noqa: SIM115
        except OSError as e:
            self.err = e

    def write(self, data: U8) -> None:
        if self.f is not None and self.err is None:
            try:
                self.f.write(data.data)
            except OSError as e:
                self.err = e

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.f is None:
            return
        try:
            if self.err is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        except OSError as e:
            self.err = e
        finally:
            self.f.close()


class BufReader:
    """``seek``/``read``/``readinto`` over an in-memory file (no copy)."""

    def __init__(self, buf: U8) -> None:
        self.mv = buf.data.cast("B")
        self.pos = 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        out = bytes(self.mv[self.pos : self.pos + n])
        self.pos += len(out)
        return out

    def readinto(self, out: memoryview) -> int:
        n = min(len(out), len(self.mv) - self.pos)
        out[:n] = self.mv[self.pos : self.pos + n]
        self.pos += n
        return n


def by_rank(meta: Metadata) -> list[list[Piece]]:
    """The step's pieces grouped by the rank whose data file holds them."""
    out: list[list[Piece]] = [[] for _ in range(meta.world_size)]
    for p in meta.pieces:
        out[p.rank].append(p)
    return out


def file_ok(buf: U8 | None, meta: Metadata, rank: int, pieces: list[Piece]) -> bool:
    """Whether ``buf`` is rank ``rank``'s intact data file: size, header and
    every piece's xxh3 (a corrupt or truncated file counts as lost)."""
    if buf is None or buf.size != meta.file_sizes[rank]:
        return False
    try:
        check_header(
            Path(data_file_name(rank)),
            buf[:HEADER_SIZE].tobytes(),
            rank,
            meta.world_size,
            meta.plan_fingerprint,
        )
    except CorruptCheckpointError:
        return False
    return all(checksum(buf[p.offset : p.offset + p.stored].data) == p.xxh3 for p in pieces)
