"""Stage 3 of a save: write. Every rank writes its planned pieces into its
own data file (``rank-NNNNN.bin`` in the save's temporary directory),
straight from tensor memory, compressing each piece when that makes it
smaller, and returns the piece records (offset, raw length, stored length,
xxh3_64, codec) that :mod:`deeppart.storage.commit` puts into ``metadata.json``.

Fault injection: :func:`add_fault_hook` (or :func:`fault_hook`) registers a function that runs on a
named point of every data-file write (``"before-write"``: the file is not
open yet; ``"after-write"``: the file is written and fsynced). The demo
and the failure tests kill or stall a rank there, as FTI's ``FTI_FI_WRITE``
does, instead of patching this module's functions.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from deeppart._planner import write_hashed
from deeppart.compression import AUTO, CODECS, AutoPolicy, compress, rank_bandwidth
from deeppart.errors import StateError
from deeppart.format import (
    HEADER_SIZE,
    OVERLAP_CHECKSUM_BYTES,
    align_up,
    checksum,
    header_bytes,
    max_expansion,
)
from deeppart.progress import Progress
from deeppart.saving.prepare import Prepared
from deeppart.state import staging as _staging
from deeppart.state.tensors import U8, readable, u8_view

__all__ = [
    "RECORD_FIELDS",
    "WRITE_CHUNK",
    "FaultPoint",
    "WriteEvent",
    "add_fault_hook",
    "fault_hook",
    "write_pieces",
]

#: Columns of a rank's piece records: offset, raw length, stored length,
#: xxh3_64, codec index.
RECORD_FIELDS = 5


#: Bytes per write() call. One huge write() of a large tensor was measured
#: slower here than the same bytes in chunks (bench/checkpoint.py's raw
#: ceiling writes in the same chunks).
WRITE_CHUNK = 8 << 20

# ----------------------------------------------------------------------------
# Fault injection.

FaultPoint = Literal["before-write", "after-write"]
FAULT_POINTS: tuple[FaultPoint, ...] = ("before-write", "after-write")


@dataclass(frozen=True)
class WriteEvent:
    """What a fault hook is told: the point, the writing rank and its data file."""

    point: FaultPoint
    rank: int
    path: Path


_fault_hooks: dict[FaultPoint, list[Callable[[WriteEvent], None]]] = {p: [] for p in FAULT_POINTS}


def add_fault_hook(point: FaultPoint, hook: Callable[[WriteEvent], None]) -> Callable[[], None]:
    """Runs ``hook(event)`` at ``point`` of every data-file write in this
    process (from any thread: asynchronous saves write in a background
    thread), until the returned function is called. An exception from the
    hook fails that rank's write as an I/O error would; a hook may also kill
    the process (a simulated node failure)."""
    if point not in FAULT_POINTS:
        raise ValueError(f"fault point must be one of {FAULT_POINTS}, not {point!r}")
    hooks = _fault_hooks[point]
    hooks.append(hook)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            hooks.remove(hook)

    return remove


@contextlib.contextmanager
def fault_hook(point: FaultPoint, hook: Callable[[WriteEvent], None]) -> Iterator[None]:
    """:func:`add_fault_hook` for the duration of a ``with`` block."""
    remove = add_fault_hook(point, hook)
    try:
        yield
    finally:
        remove()


def _fire(point: FaultPoint, rank: int, path: Path) -> None:
    for hook in list(_fault_hooks[point]):
        hook(WriteEvent(point, rank, path))


# ----------------------------------------------------------------------------
# Writing.


def _write_chunked(f: Any, data: bytes | memoryview) -> None:
    view = memoryview(data)
    for start in range(0, len(view), WRITE_CHUNK):
        f.write(view[start : start + WRITE_CHUNK])


def write_pieces(
    path: Path,
    rank: int,
    prep: Prepared,
    level: int,
    progress: Progress,
    staging: _staging.Staging | None = None,
    save_id: str = "",
    opener: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
) -> tuple[npt.NDArray[np.uint64], int]:
    """Writes this rank's data file (its header carrying the save's id
    ``save_id``, if any); returns its piece records and size.
    Pieces of device tensors pass through ``staging`` in bounded chunks.
    ``opener``: opens the file to write instead of ``path`` on the file
    system (an upload to an object store, :mod:`deeppart.storage.target`;
    the object is complete when the context exits)."""
    if prep.staged_ready is not None:
        # An asynchronous snapshot's copies from a device: done, and not torn.
        prep.staged_ready()
    stage = staging if staging is not None else _staging.Staging()
    on_device: dict[int, Any] = {}
    pieces = prep.plan.rank_pieces(rank)
    records = np.zeros((len(pieces), RECORD_FIELDS), dtype=np.uint64)
    views: dict[int, tuple[U8, int]] = {}
    auto = None
    if prep.codec == AUTO:
        plan = prep.plan
        auto = AutoPolicy(rank_bandwidth(plan.cost, plan.topology, plan.world_size), level)
    codec_index = 0 if auto is not None else CODECS.index(prep.codec)
    _fire("before-write", rank, path)
    # Background checksums: (record row, future) of the long pieces.
    sums: list[tuple[int, Future[int]]] = []
    pool: ThreadPoolExecutor | None = None
    with contextlib.ExitStack() as stack, opener() if opener else open(path, "wb") as f:
        f.write(header_bytes(rank, prep.plan.world_size, prep.plan.fingerprint, save_id))
        pos = end = HEADER_SIZE
        flushed = False
        # The Rust one-pass write needs a file descriptor; an object store's
        # upload (deeppart.storage) has none and takes the Python path.
        fd = _staging.descriptor_of(f)
        for k, (li, start, stop) in enumerate(pieces):
            leaf = prep.leaves[li]
            is_tensor = leaf.tensor is not None
            # The piece's codec; None: ``auto`` decides below.
            codec: str | None = None if auto is not None else prep.codec
            if prep.staged is not None:
                # An asynchronous save's snapshot of this rank's pieces.
                piece = prep.staged[k]
                raw, itemsize, is_tensor = piece.data, piece.itemsize, piece.tensor
            elif leaf.tensor is not None and _staging.needs_staging(leaf.tensor):
                if li not in on_device:
                    on_device[li] = _staging.device_bytes(leaf.tensor)
                isz = leaf.tensor.element_size()
                lo, hi = start * isz, stop * isz
                use = codec_index
                if auto is not None:
                    # Decided on a sample copied to the host alone.
                    w = auto.window(hi - lo, isz)
                    sample = None
                    if w is not None:
                        parts = stage.read(on_device[li], lo + w[0], lo + w[0] + w[1])
                        sample = np.concatenate(list(parts)).data
                    use = CODECS.index(auto.judge(sample, isz))
                chunks = stage.read(on_device[li], lo, hi)
                if not use:
                    # Raw: streamed from the host buffer, checksummed on the way.
                    f.seek(pos)
                    n, xxh = _staging.write_stream(f, chunks)
                    end = pos + n if n else end
                    records[k] = (pos, n, n, xxh, 0)
                    pos = align_up(pos + n)
                    progress.advance(n)
                    continue
                # A codec needs the whole piece: staged whole (see deeppart.state.staging).
                whole = np.empty((stop - start) * isz, dtype=np.uint8)
                at = 0
                for chunk in chunks:
                    whole[at : at + chunk.size] = chunk
                    at += chunk.size
                raw, itemsize = whole.data, isz
                if auto is not None:
                    codec = CODECS[use]
            elif leaf.tensor is not None:
                if li not in views:
                    t = readable(leaf.tensor)
                    views[li] = (u8_view(t), t.element_size())
                arr, itemsize = views[li]
                raw = arr[start * itemsize : stop * itemsize].data
            else:
                if leaf.encoded is None:
                    raise StateError(
                        f"{'/'.join(map(str, leaf.path))}: rank {rank} was planned to write a "
                        "DTensor shard it does not hold; save DTensors with the default "
                        "process group (the mesh's ranks must be the communicator's ranks)"
                    )
                itemsize = 1
                raw = memoryview(leaf.encoded)
            data: bytes | memoryview = raw
            used = 0
            if auto is not None and codec is None:
                codec = auto.choose(raw, itemsize, is_tensor)
            assert codec is not None
            if codec != "none" and len(raw):
                limit = max_expansion("tensor" if is_tensor else "object")
                packed = compress(codec, raw, itemsize, level, limit)
                if len(packed) < len(raw):
                    data, used = packed, CODECS.index(codec)
            xxh = 0
            if prep.staged is not None and fd is not None and not used and len(data):
                # An asynchronous save's raw piece: written and checksummed
                # in one pass in Rust, the GIL released for the whole piece
                # (deeppart._planner.write_hashed), write-back paced.
                if not flushed:
                    f.flush()  # the header (buffered) before the raw writes
                    flushed = True
                xxh = write_hashed(fd, pos, data, WRITE_CHUNK, True)
                end = pos + len(data)
                records[k] = (pos, len(raw), len(data), xxh, used)
                pos = align_up(pos + len(data))
                progress.advance(len(raw))
                continue
            if len(data) >= OVERLAP_CHECKSUM_BYTES:
                if pool is None:
                    pool = ThreadPoolExecutor(1, thread_name_prefix="deeppart-xxh3")
                    stack.callback(pool.shutdown, wait=True)
                sums.append((k, pool.submit(checksum, data)))
            else:
                xxh = checksum(data)
            if len(data):
                if f.tell() != pos:
                    f.seek(pos)
                _write_chunked(f, data)
                end = pos + len(data)
            records[k] = (pos, len(raw), len(data), xxh, used)
            pos = align_up(pos + len(data))
            progress.advance(len(raw))
        for k, fut in sums:
            records[k, 3] = fut.result()
        f.truncate(end)
        size = end
        f.flush()
        if opener is None:
            os.fsync(f.fileno())
    _fire("after-write", rank, path)
    return records, size
