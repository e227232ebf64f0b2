"""The stages of a load, in their order:

1. :func:`open_checkpoint`: read and check ``metadata.json`` (or, when a
   save that replaced the directory died before its commit, the committed
   copy it had moved aside);
2. :func:`plan_reads`: where each leaf's bytes go (:func:`targets`, also
   matching an ``into=`` state by path), which leaves ``keys=`` selects,
   which rank reads which data file (:func:`assign_readers`) and how the
   bytes reach the other ranks (``exchange``);
3. :func:`read_share`: each rank reads, verifies and decodes its files;
4. :func:`exchange_share`: the bytes read reach every rank (broadcast, or a
   node-shared window);
5. :func:`assemble`: the state tree rebuilt from the filled targets.

:func:`deeppart.load` runs them with an agreement collective after each
step that can fail on some ranks only.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from deeppart._planner import Manifest, ManifestError, copy_into
from deeppart.comm import Comm, InFlight, release_node_shared, reused_node_shared
from deeppart.compression import decompress_into
from deeppart.errors import CheckpointError, CodecError, CorruptCheckpointError, StateMismatchError
from deeppart.format import (
    HEADER_SIZE,
    OVERLAP_CHECKSUM_BYTES,
    LeafInfo,
    Metadata,
    Piece,
    check_header,
    checksum,
    checksum_stream,
    data_file_name,
    decode_metadata,
    max_expansion,
    parse_metadata,
    read_checked_metadata,
)
from deeppart.progress import Progress
from deeppart.state import staging as _staging
from deeppart.state.restore import (
    ABSENT,
    IncompatibleKeys,
    describe,
    leaf_paths,
    match,
    prune,
    refuse_meta,
    select_paths,
    write_back_plain,
)
from deeppart.state.state import Flat, FlatLeaf, decode_plain, flatten, skeleton_without, unflatten
from deeppart.state.tensors import (
    U8,
    dtype_sizes,
    on_meta,
    same_bytes,
    torch_dtypes,
    torch_module,
    u8_view,
    written_in_place,
)
from deeppart.storage.files import CheckpointDir, check_file_sizes, open_data
from deeppart.storage.source import CheckpointSource, checkpoint_source, committed_or_replaced
from deeppart.storage.url import Location

__all__ = [
    "EXCHANGES",
    "IntoMatch",
    "ReadBuffers",
    "ReadPlan",
    "Target",
    "all_leaf_targets",
    "assemble",
    "assign_readers",
    "committed_or_replaced",
    "exchange_share",
    "leaf_infos",
    "leaf_targets",
    "open_checkpoint",
    "plan_reads",
    "read_file",
    "read_metadata",
    "read_pieces",
    "read_share",
    "shared_buffers",
    "window_bytes",
]

#: The ways the bytes read reach the other ranks (see :func:`deeppart.load`).
EXCHANGES = ("auto", "bcast", "read")


# ----------------------------------------------------------------------------
# 1. Open.


def leaf_infos(meta_raw: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        manifest = Manifest.from_json(json.dumps(meta_raw.get("manifest")))
    except (ManifestError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"metadata: bad manifest: {e}") from e
    return manifest.leaves()


def read_metadata(directory: Path) -> tuple[Metadata, bytes]:
    text = read_checked_metadata(directory)
    return parsed_metadata(text), hashlib.sha256(text).digest()


def parsed_metadata(text: bytes) -> Metadata:
    """A checked metadata.json's text, parsed."""
    raw = decode_metadata(text)
    # The leaves come from the manifest, checked by the planner's parser.
    raw["leaves"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in lf.items() if v is not None}
        for lf in leaf_infos(raw)
    ]
    return parse_metadata(raw, dtype_sizes(raw["leaves"]))


def open_checkpoint(where: Location | CheckpointSource) -> tuple[CheckpointDir, Metadata, bytes]:
    """The committed checkpoint at ``where`` (a location, or its source:
    :mod:`deeppart.storage.source`): its files, its checked metadata and
    the digest of ``metadata.json`` that the ranks compare. In a directory
    that is not committed, the copy an interrupted overwrite moved aside
    (:func:`~deeppart.storage.source.committed_or_replaced`); at an object
    store URL the objects of the save its commit marker names
    (:func:`deeppart.storage.objects.open_committed`)."""
    at, text = checkpoint_source(where).open_for_load()
    return at, parsed_metadata(text), hashlib.sha256(text).digest()


# ----------------------------------------------------------------------------
# 2. Plan the reads.


@dataclass
class Target:
    """Where a leaf's bytes go: a flat uint8 view of the tensor to return
    (``tensor``), possibly a staging tensor copied into ``into`` at the end."""

    buf: U8
    tensor: Any | None
    copy_into: Any | None
    #: A device tensor's flat uint8 view, filled through the staging buffer
    #: (then ``buf`` is empty).
    sink: Any | None = None


@dataclass
class IntoMatch:
    """How the checkpoint's leaves map onto an ``into=`` state."""

    leaves: list[FlatLeaf]
    skeleton: Any
    #: checkpoint leaf index -> into leaf index
    pairs: dict[int, int]
    keys: IncompatibleKeys
    #: The caller's ``into=`` object, whose plain values are set in place.
    root: Any = None
    #: (checkpoint leaf, into leaf): also copied there (weights tied in
    #: the checkpoint, not in into=).
    copies: list[tuple[int, int]] = field(default_factory=list)
    #: (checkpoint leaf, into leaf, its path, the path that filled it):
    #: must equal what filled it (weights tied in into=, not in the
    #: checkpoint).
    checks: list[tuple[int, int, str, str]] = field(default_factory=list)


def meta_leaf_paths(meta: Metadata) -> list[list[tuple[Any, ...]]]:
    """Per checkpoint leaf, every path that holds it (its own first; tied
    weights: more, from the skeleton)."""
    try:
        return leaf_paths([lf.path for lf in meta.leaves], meta.skeleton)
    except ValueError as e:
        raise CorruptCheckpointError(f"metadata: {e}") from e


def all_leaf_targets(meta: Metadata, into: Any) -> tuple[list[Target], IntoMatch | None]:
    """Targets of every leaf, ``into`` (if any) matching the checkpoint exactly."""
    targets, matched = leaf_targets(meta, into)
    full = [t for t in targets if t is not None]
    assert len(full) == len(targets)
    return full, matched


def leaf_targets(
    meta: Metadata,
    into: Any,
    chosen: Sequence[Sequence[tuple[Any, ...]]] | None = None,
    strict: bool = True,
    into_elsewhere: Collection[int] = (),
    flat: Flat | None = None,
) -> tuple[list[Target | None], IntoMatch | None]:
    """Where each selected leaf's bytes go (None: not read). ``chosen``:
    per leaf, its selected paths (empty: not read; default: every path of
    every leaf, :func:`meta_leaf_paths`). With ``into``, its leaves are
    matched with the checkpoint's by path (except ``into_elsewhere``, which
    the sharded stages of :mod:`deeppart.loading.reshard` fill). ``flat``:
    ``flatten(into)``, when the caller has it already."""
    if chosen is None:
        chosen = meta_leaf_paths(meta)
    dtypes = torch_dtypes() if any(lf.kind == "tensor" for lf in meta.leaves) else {}
    targets: list[Target | None] = [None] * len(meta.leaves)
    matched: IntoMatch | None = None
    compared: set[int] = set()
    if into is not None:
        into_leaves, skeleton = flat if flat is not None else flatten(into)
        m = match(
            chosen, leaf_paths([lf.path for lf in into_leaves], skeleton), strict, into_elsewhere
        )
        matched = IntoMatch(into_leaves, skeleton, m.pairs, m.keys, into, m.copies, m.checks)
        filled = [*m.pairs.items(), *m.copies]
        refuse_meta([describe(into_leaves[j].path) for _, j in filled if on_meta(into_leaves[j])])
        for i, j in m.copies:
            _fits(meta.leaves[i], into_leaves[j].tensor, dtypes, describe(into_leaves[j].path))
        for i, j, at, by in m.checks:
            if meta.leaves[i].kind != "tensor" or not _fits(
                meta.leaves[i], into_leaves[j].tensor, dtypes, at, strict_kind=False
            ):
                raise StateMismatchError(
                    f"{by} and {at}: into= holds one tensor at both (tied weights), the "
                    "checkpoint two of different kinds, dtypes or shapes"
                )
        compared = {i for i, *_ in m.checks if i not in m.pairs}
    for i, info in enumerate(meta.leaves):
        if not chosen[i] or (matched is not None and i not in matched.pairs and i not in compared):
            continue
        if info.kind == "object":
            if matched is not None and i in matched.pairs:
                _fits(info, matched.leaves[matched.pairs[i]].tensor, dtypes)
            targets[i] = Target(np.empty(info.nbytes, dtype=np.uint8), None, None)
            continue
        dtype = dtypes[str(info.dtype)]
        if matched is None or i in compared:
            t = torch_module().empty(info.shape, dtype=dtype)
            targets[i] = Target(u8_view(t), t, None)
            continue
        t = matched.leaves[matched.pairs[i]].tensor
        _fits(info, t, dtypes)
        assert t is not None
        plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
        if plain and _staging.needs_staging(t):
            sink = _staging.device_bytes(t)
            targets[i] = Target(np.empty(0, dtype=np.uint8), t, None, sink)
        elif t.device.type == "cpu" and plain:
            targets[i] = Target(u8_view(t), t, None)
        else:
            stage = torch_module().empty(info.shape, dtype=dtype)
            targets[i] = Target(u8_view(stage), t, stage)
    return targets, matched


def _fits(
    info: LeafInfo, t: Any, dtypes: dict[str, Any], where: str = "", strict_kind: bool = True
) -> bool:
    """Whether ``into=``'s leaf ``t`` (a tensor, or None for a plain value)
    takes the checkpoint leaf ``info``: the same kind, and for a tensor the
    same dtype and shape. Raises StateMismatchError naming the leaf (at
    ``where``, default its own path) when not (False instead with
    ``strict_kind=False``)."""
    where = where or describe(info.path)
    if info.kind == "object" or t is None:
        if (info.kind == "object") == (t is None):
            return True
        if not strict_kind:
            return False
        have, want = ("a tensor", "a value") if t is not None else ("a value", "a tensor")
        raise StateMismatchError(f"into= has {have} at {where}, the checkpoint {want}")
    if t.dtype == dtypes[str(info.dtype)] and list(t.shape) == list(info.shape):
        return True
    if not strict_kind:
        return False
    raise StateMismatchError(
        f"{where}: into= has {t.dtype} {list(t.shape)}, the checkpoint {info.dtype} {info.shape}"
    )


def assign_readers(file_bytes: list[int], readers: int) -> list[int]:
    """Reader rank of every data file: largest files first, each to the
    least-loaded reader (ties: the lowest rank). Deterministic."""
    load = [0] * readers
    owner = [0] * len(file_bytes)
    for f in sorted(range(len(file_bytes)), key=lambda i: (-file_bytes[i], i)):
        r = min(range(readers), key=lambda k: (load[k], k))
        owner[f] = r
        load[r] += file_bytes[f]
    return owner


@dataclass
class ReadPlan:
    """Who reads what, and where it goes."""

    path: CheckpointDir
    meta: Metadata
    #: Per leaf: where its bytes go (None: not read).
    targets: list[Target | None]
    #: How the checkpoint's leaves map onto ``into=`` (None without it).
    matched: IntoMatch | None
    #: Per data file: the rank that reads it.
    owner: list[int]
    #: Every rank reads every piece itself (no exchange).
    read_all: bool
    #: The readers decompress into memory that every rank of the host maps
    #: (an MPI shared window), not a broadcast.
    via_shared: bool
    #: Per data file: its pieces that are read.
    by_file: list[list[Piece]] = field(default_factory=list)
    #: Per data file: the raw bytes of those pieces.
    file_raw: list[int] = field(default_factory=list)
    #: The data files this rank reads.
    mine: list[int] = field(default_factory=list)
    #: This rank.
    rank: int = 0
    #: Paths of the leaves read that ``keys=`` did not select (another
    #: path of a tied leaf): left out of the returned tree.
    hidden: frozenset[tuple[Any, ...]] = frozenset()


def plan_reads(
    comm: Comm,
    path: CheckpointDir,
    meta: Metadata,
    *,
    into: Any,
    keys: Any,
    strict: bool,
    exchange: str,
    same_host: bool,
    elsewhere: Collection[int] = (),
    into_elsewhere: Collection[int] = (),
    flat: Flat | None = None,
) -> ReadPlan:
    """The reads of this rank: the same decisions on every rank (they
    depend only on the metadata, the arguments and ``same_host``: whether
    every rank runs on this host). The checkpoint leaves in ``elsewhere``
    and the ``into=`` leaves in ``into_elsewhere`` are left to
    :mod:`deeppart.loading.reshard` (sharded tensors). ``flat``: ``flatten(into)``,
    when the caller has it already.

    Every rank checksums every byte it reads from storage; a rank that does
    not read a file gets its bytes copied from the memory in which its
    reader verified them (:mod:`deeppart.integrity`)."""
    every = meta_leaf_paths(meta)
    chosen = [
        ps if i not in elsewhere and i not in meta.skip else []
        for i, ps in enumerate(select_paths(every, keys))
    ]
    tgts, matched = leaf_targets(meta, into, chosen, strict, into_elsewhere, flat)
    hidden: set[tuple[Any, ...]] = set()
    for i, ps in enumerate(chosen):
        if keys is not None and tgts[i] is not None and len(ps) < len(every[i]):
            hidden.update(set(every[i]) - set(ps))
    raw_per_file = [0] * meta.world_size
    for p in meta.pieces:
        if tgts[p.leaf] is not None:
            raw_per_file[p.rank] += p.length
    via_shared = False
    if exchange == "auto":
        # Each file is read and verified once, by one rank; on one host the
        # readers read into memory that every rank of the host maps (an MPI
        # shared window, else a broadcast), and the others copy from there.
        exchange = "bcast"
        via_shared = same_host
    if exchange not in ("bcast", "read"):
        raise ValueError(f"exchange must be 'auto', 'bcast' or 'read', not {exchange!r}")
    read_all = exchange == "read" or comm.size == 1
    owner = [comm.rank] * meta.world_size if read_all else assign_readers(raw_per_file, comm.size)
    check_file_sizes(path, meta, [f for f in range(meta.world_size) if owner[f] == comm.rank])
    by_file: list[list[Piece]] = [[] for _ in range(meta.world_size)]
    for p in meta.pieces:
        if tgts[p.leaf] is not None:
            by_file[p.rank].append(p)
    file_raw = [sum(p.length for p in ps) for ps in by_file]
    # A partial load opens only the files holding what it reads.
    partial = (
        keys is not None
        or bool(elsewhere)
        or bool(meta.skip)
        or (matched is not None and len(matched.pairs) < len(meta.leaves))
    )
    mine = [
        f for f in range(meta.world_size) if owner[f] == comm.rank and (by_file[f] or not partial)
    ]
    return ReadPlan(
        path, meta, tgts, matched, owner, read_all, via_shared, by_file, file_raw, mine,
        comm.rank, frozenset(hidden),
    )  # fmt: skip


# ----------------------------------------------------------------------------
# 3. Read.


def read_file(
    directory: CheckpointDir,
    meta: Metadata,
    rank: int,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging | None = None,
    through: Callable[[Piece], U8 | _staging.DeviceSink] | None = None,
    hot: bool = False,
    done: Callable[[Piece], None] | None = None,
    stored_into: Callable[[Piece], U8] | None = None,
) -> int:
    """Reads, verifies and decodes the pieces of one data file into
    ``dest(piece)``; returns the bytes read. A raw piece is checksummed in
    the memory it was read into (``dest(piece)``, or the staging buffer of
    a device target), after the read. ``through``: a second place for each
    piece (where it is a host array), filled from ``dest(piece)`` as the
    read goes (:func:`_read_through`). ``hot``: a long raw piece is
    checksummed chunk by chunk as it is read, while each chunk is still in
    the cache (:func:`_read_through`, no second place), rather than whole
    in a background thread afterwards. ``done``: called with each piece
    once it is in place and verified (implies ``hot``). ``stored_into``:
    where a compressed piece's stored bytes are read to (and kept, e.g. to
    be sent on), instead of a temporary buffer.

    The pieces are read in file order; the file is opened with their
    ranges declared, so that an object store reads them ahead in large
    chunks (:func:`~deeppart.storage.files.open_data`)."""
    path = directory / data_file_name(rank)
    pieces = sorted(pieces, key=lambda p: p.offset)
    expect = [(0, HEADER_SIZE)] + [(p.offset, p.stored) for p in pieces]
    with open_data(directory, rank, expect) as f:
        return read_pieces(
            f, path, directory, meta, rank, pieces, dest, progress, staging, through, hot, done,
            stored_into,
        )  # fmt: skip


class _Checksums:
    """The checksums of the raw pieces a file's read puts straight into
    their targets: each long one computed in one background thread (xxhash
    releases the GIL) while the next piece is read, all compared by
    :meth:`check` before the read returns."""

    def __init__(self, directory: CheckpointDir) -> None:
        self.directory = directory
        self.pool: ThreadPoolExecutor | None = None
        self.pending: list[tuple[Piece, Future[int]]] = []

    def add(self, p: Piece, data: memoryview) -> None:
        if len(data) < OVERLAP_CHECKSUM_BYTES:
            self._compare(p, checksum(data))
            return
        if self.pool is None:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="deeppart-xxh3")
        self.pending.append((p, self.pool.submit(checksum, data)))

    def _compare(self, p: Piece, got: int) -> None:
        if got != p.xxh3:
            raise CorruptCheckpointError(
                f"{p.describe(self.directory)}: checksum mismatch (xxh3_64)"
            )

    def check(self) -> None:
        """CorruptCheckpointError for the first piece whose checksum differs."""
        pending, self.pending = self.pending, []
        for p, fut in pending:
            self._compare(p, fut.result())

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


def read_pieces(
    f: Any,
    path: Path | str,
    directory: CheckpointDir,
    meta: Metadata,
    rank: int,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging | None = None,
    through: Callable[[Piece], U8 | _staging.DeviceSink] | None = None,
    hot: bool = False,
    done: Callable[[Piece], None] | None = None,
    stored_into: Callable[[Piece], U8] | None = None,
) -> int:
    """:func:`read_file` from ``f`` (an open file, or anything with
    ``seek``/``read``/``readinto``, e.g. :class:`io.BytesIO`)."""
    check_header(path, f.read(HEADER_SIZE), rank, meta.world_size, meta.plan_fingerprint)
    to_device: list[Piece] = []
    fd = _staging.descriptor_of(f)
    if fd is not None and through is None and done is None and stored_into is None:
        # Raw pieces for device tensors from a local file: several readers
        # at once (deeppart.state.staging.read_to_device).
        to_device = [
            p for p in pieces
            if p.codec == "none" and p.length and isinstance(dest(p), _staging.DeviceSink)
        ]  # fmt: skip
    if to_device:
        chosen = {id(p) for p in to_device}
        pieces = [p for p in pieces if id(p) not in chosen]
    sums = _Checksums(directory)
    try:
        n = _read_each(
            f, directory, meta, pieces, dest, progress, staging, sums, through,
            hot or done is not None, done, stored_into,
        )  # fmt: skip
        sums.check()
    finally:
        sums.close()
    if to_device:
        assert fd is not None
        n += _read_to_devices(
            fd, to_device, dest, progress, staging or _staging.Staging(), directory
        )
    return n


def _read_to_devices(
    fd: int,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging,
    directory: CheckpointDir,
) -> int:
    """Reads raw ``pieces`` of the open file ``fd`` into their device sinks
    (:func:`deeppart.state.staging.read_to_device`, one device at a time), each
    verified on its host copy; returns the bytes read."""
    by_device: dict[Any, list[_staging.DeviceRead]] = {}
    for p in pieces:
        sink = dest(p)
        assert isinstance(sink, _staging.DeviceSink)
        read = _staging.DeviceRead(p.offset, p.length, sink, p.xxh3, p)
        by_device.setdefault(sink.tensor.device, []).append(read)

    def error(p: Piece, what: str) -> BaseException:
        return CorruptCheckpointError(f"{p.describe(directory)}: {what}")

    for reads in by_device.values():
        _staging.read_to_device(fd, reads, staging, error, lambda r: progress.advance(r.length))
    return sum(p.stored for p in pieces)


def _read_each(
    f: Any,
    directory: CheckpointDir,
    meta: Metadata,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging | None,
    sums: _Checksums,
    through: Callable[[Piece], U8 | _staging.DeviceSink] | None = None,
    hot: bool = False,
    done: Callable[[Piece], None] | None = None,
    stored_into: Callable[[Piece], U8] | None = None,
) -> int:
    """The loop of :func:`read_pieces`: the raw pieces' checksums are left
    to ``sums``, except those read through to a second place (and with
    ``hot``, the long ones: checksummed as they are read). With ``hot``
    every piece is verified before the next one is read (the short raw
    ones by ``sums.add`` at once): ``done(piece)`` then."""
    n = 0
    at = -1  # the file's position after a raw piece (no seek to get there)
    for p in pieces:
        out = dest(p)
        also = through(p) if through is not None else None
        if p.offset != at:
            f.seek(p.offset)
        at = -1
        if isinstance(out, _staging.DeviceSink):
            _read_staged(f, p, out, staging or _staging.Staging(), meta, directory)
            n += p.stored
            progress.advance(p.length)
            if done is not None:
                done(p)
            continue
        if p.codec == "none":
            if isinstance(also, np.ndarray) or (hot and p.length >= OVERLAP_CHECKSUM_BYTES):
                _read_through(f, p, out, also if isinstance(also, np.ndarray) else None, directory)
            else:
                got = f.readinto(out.data)
                if got != p.length:
                    raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
                sums.add(p, out.data)
            at = p.offset + p.length
            n += p.stored
            progress.advance(p.length)
            if done is not None:
                done(p)
            continue
        if stored_into is not None:
            keep = stored_into(p)
            if f.readinto(keep.data) != p.stored:
                raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
            stored: bytes | memoryview = keep.data
        else:
            stored = f.read(p.stored)
            if len(stored) != p.stored:
                raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
        decode_piece(p, stored, out, meta, directory)
        if isinstance(also, np.ndarray):
            # Decoded from stored bytes verified in this process's memory.
            copy_into(also.data, out.data)
        n += p.stored
        progress.advance(p.length)
        if done is not None:
            done(p)
    return n


def decode_piece(
    p: Piece,
    stored: bytes | memoryview,
    out: U8,
    meta: Metadata,
    directory: CheckpointDir,
    received_from: int | None = None,
) -> None:
    """Verifies compressed piece ``p``'s stored bytes (their xxh3) where they
    lie, then decodes them into ``out``; CorruptCheckpointError naming the
    piece when either fails (and ``received_from``, the rank the bytes came
    from, when they were received rather than read)."""
    if checksum(stored) != p.xxh3:
        where = "" if received_from is None else f" in the bytes received from rank {received_from}"
        raise CorruptCheckpointError(f"{p.describe(directory)}: checksum mismatch (xxh3_64){where}")
    info = meta.leaves[p.leaf]
    try:
        decompress_into(p.codec, stored, out, info.itemsize, max_expansion(info.kind))
    except CodecError as e:
        raise CorruptCheckpointError(f"{p.describe(directory)}: {e}") from e


#: A raw piece read through to a second place (:func:`_read_through`) goes
#: in chunks of this many bytes: each is checksummed and copied on while it
#: is still in this core's cache.
THROUGH_CHUNK_BYTES = 512 << 10


def _read_through(f: Any, p: Piece, out: U8, also: U8 | None, directory: CheckpointDir) -> None:
    """Reads raw piece ``p`` (at ``f``'s position) into ``out``, one chunk of
    :data:`THROUGH_CHUNK_BYTES` at a time: each chunk is added to the
    piece's xxh3 in ``out`` right after its read, then copied from ``out``
    to ``also`` (when given), so the bytes pass through memory once for all
    three.
    ``also`` holds only bytes of ``out`` that were checksummed; nothing else
    writes ``out`` meanwhile. CorruptCheckpointError for a short read or a
    checksum that differs (the load then fails on every rank)."""
    h = checksum_stream()
    for at in range(0, p.length, THROUGH_CHUNK_BYTES):
        part = out[at : at + THROUGH_CHUNK_BYTES]
        if f.readinto(part.data) != part.size:
            raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
        h.update(part.data)
        if also is not None:
            copy_into(also[at : at + part.size].data, part.data)
    if h.intdigest() != p.xxh3:
        raise CorruptCheckpointError(f"{p.describe(directory)}: checksum mismatch (xxh3_64)")


def _read_staged(
    f: Any,
    p: Piece,
    sink: _staging.DeviceSink,
    staging: _staging.Staging,
    meta: Metadata,
    directory: CheckpointDir,
) -> None:
    """Reads piece ``p`` (at ``f``'s position) into a device tensor: a raw
    piece chunk by chunk through ``staging``, a compressed one decoded whole
    (:func:`decode_piece`) and then copied in chunks."""
    if p.codec == "none":
        xxh = _staging.read_stream(f, p.length, sink, staging)
        if xxh is None:
            raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
        if xxh != p.xxh3:
            raise CorruptCheckpointError(f"{p.describe(directory)}: checksum mismatch (xxh3_64)")
        return
    stored = f.read(p.stored)
    if len(stored) != p.stored:
        raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
    raw = np.empty(p.length, dtype=np.uint8)
    decode_piece(p, stored, raw, meta, directory)
    staging.put(sink, raw)


def _place(buf: U8, pieces: list[Piece]) -> Callable[[Piece], U8]:
    """Where each of ``pieces`` sits in ``buf``, a file's read bytes (in
    the order of ``pieces``)."""
    offsets: dict[int, int] = {}
    pos = 0
    for p in pieces:
        offsets[id(p)] = pos
        pos += p.length
    return lambda p: buf[offsets[id(p)] : offsets[id(p)] + p.length]


def _direct(rp: ReadPlan) -> Callable[[Piece], U8 | _staging.DeviceSink]:
    """The final place of a piece's bytes: its slice of the target."""

    def dest(p: Piece) -> U8 | _staging.DeviceSink:
        info = rp.meta.leaves[p.leaf]
        isz = info.itemsize if info.kind == "tensor" else 0
        tgt = rp.targets[p.leaf]
        assert tgt is not None
        if isz == 0:
            return tgt.buf
        if tgt.sink is not None:
            return _staging.DeviceSink(tgt.sink, p.start * isz, p.length)
        return tgt.buf[p.start * isz : p.stop * isz]

    return dest


@dataclass
class ReadBuffers:
    """Where the data files' raw bytes are read to, before the exchange."""

    #: By data file.
    files: dict[int, U8] = field(default_factory=dict)
    #: The buffers are slices of a node-shared window: the exchange is a copy.
    shared: bool = False


def window_bytes(rp: ReadPlan) -> int:
    """The bytes of this rank's segment of the node-shared window: the raw
    bytes of the files it reads."""
    return sum(rp.file_raw[f] for f in rp.mine)


@contextmanager
def shared_buffers(comm: Comm, rp: ReadPlan, reuse: bool) -> Iterator[ReadBuffers]:
    """The buffers that the data files' raw bytes are read into: with
    ``via_shared`` (and an MPI communicator on one host), slices of a
    node-shared window (file f in its reader's segment, after that reader's
    earlier files), which every rank of the host maps; else filled in as the
    files are read. ``reuse``: every rank's segment of the window kept after
    the last load holds its share (:func:`deeppart.comm.kept_fits`, agreed
    by the caller); else a new window is made (collective). A small window
    is kept for the next load (:func:`deeppart.comm.release_node_shared`).

    No collective on exit: the caller's agreement after the exchange is
    what tells a rank that nobody still copies out of its segment, and a
    reader writes its segment again only after the next load's first
    agreement (a window that is freed stays mapped in every rank that has
    not freed it yet)."""
    out = ReadBuffers()
    shared = None
    if rp.via_shared and not rp.read_all:
        shared = reused_node_shared(comm, window_bytes(rp), reuse)
    if shared is not None:
        out.shared = True
        ends = [0] * comm.size
        for f in range(rp.meta.world_size):
            seg = shared.segments[rp.owner[f]]
            out.files[f] = seg[ends[rp.owner[f]] : ends[rp.owner[f]] + rp.file_raw[f]]
            ends[rp.owner[f]] += rp.file_raw[f]
    try:
        yield out
    finally:
        if shared is not None:
            out.files.clear()
            release_node_shared(comm, shared)


def read_share(
    rp: ReadPlan,
    buffers: ReadBuffers,
    progress: Progress,
    stage: _staging.Staging,
) -> int:
    """Reads this rank's data files, verifying every piece, when every rank
    reads everything (straight into the targets) or into a node-shared
    window (``buffers.shared``; the reader's own host targets filled as it
    reads, each chunk checksummed in the window first), for
    :func:`exchange_share`. A broadcast reads and exchanges at once
    instead: :func:`stream_share`. Returns the bytes read."""
    nread = 0
    direct = _direct(rp)
    for f in rp.mine:
        pieces = rp.by_file[f]
        if rp.read_all:
            # Each long piece checksummed as it is read: on one host the
            # ranks read at once, and the checksum of a chunk still in the
            # cache costs a fraction of a second pass over memory
            # (bench/load_work.py).
            nread += read_file(rp.path, rp.meta, f, pieces, direct, progress, stage, hot=True)
        else:
            buf = buffers.files[f]
            nread += read_file(
                rp.path, rp.meta, f, pieces, _place(buf, pieces), progress, through=direct
            )
    return nread


#: Pieces shorter than this travel together in one broadcast; longer ones
#: go straight into their targets.
DIRECT_PIECE_BYTES = 1 << 20
#: The most bytes of short pieces packed into one broadcast: a reader
#: starts a broadcast once every piece in it is verified, so a small
#: message leaves its read soon after its last piece does.
PACKED_MESSAGE_BYTES = 1 << 20
#: The most bytes one broadcast of a long piece carries. Over TCP between
#: shaped links (bench/object_store.py), broadcasts of 1 MiB kept the links
#: busier than those of 4 or 16 MiB.
EXCHANGE_MESSAGE_BYTES = 1 << 20

#: One broadcast of the exchange: (piece, byte offset in it, bytes) parts,
#: consecutive in the reader's buffer.
Message = list[tuple[Piece, int, int]]


def exchange_messages(pieces: Sequence[Piece]) -> Iterator[Message]:
    """A data file's stored bytes (``pieces``, in the order given; a
    compressed piece as stored) as the exchange broadcasts them: runs of
    short pieces together, up to :data:`PACKED_MESSAGE_BYTES`; a long piece
    alone, in chunks of
    :data:`EXCHANGE_MESSAGE_BYTES`. Every rank derives the same messages
    from the metadata, so their broadcasts match."""
    batch: Message = []
    size = 0
    for p in pieces:
        if p.stored < DIRECT_PIECE_BYTES:
            if batch and size + p.stored > PACKED_MESSAGE_BYTES:
                yield batch
                batch, size = [], 0
            batch.append((p, 0, p.stored))
            size += p.stored
            continue
        if batch:
            yield batch
            batch, size = [], 0
        for off in range(0, p.stored, EXCHANGE_MESSAGE_BYTES):
            yield [(p, off, min(EXCHANGE_MESSAGE_BYTES, p.stored - off))]
    if batch:
        yield batch


T = TypeVar("T")


class FirstError:
    """The first exception of a stage's local steps on this rank, kept
    while the stage's collectives go on: a rank that failed still takes
    part in every broadcast, so no rank is left waiting in one, and the
    stage's agreement then raises on every rank."""

    def __init__(self) -> None:
        self.err: BaseException | None = None

    def run(self, step: Callable[[], None]) -> None:
        """Runs ``step`` unless a step failed before; keeps its exception."""
        if self.err is None:
            try:
                step()
            except BaseException as e:
                self.err = e

    def keep(self, err: BaseException) -> None:
        """Keeps ``err`` (one raised elsewhere, e.g. in a thread) unless a
        step failed before."""
        if self.err is None:
            self.err = err

    def attempt(self, step: Callable[[], T], fallback: Callable[[], T]) -> T:
        """``step()``'s result; ``fallback()``'s once a step has failed
        (this one included, whose exception is kept): what a failed rank
        still sends or receives to keep its place in a collective."""
        if self.err is None:
            try:
                return step()
            except BaseException as e:
                self.err = e
        return fallback()

    def raise_first(self) -> None:
        if self.err is not None:
            raise self.err


def exchange_share(comm: Comm, rp: ReadPlan, buffers: ReadBuffers, stage: _staging.Staging) -> None:
    """From a node-shared window, after the read's agreement: every rank
    copies each piece out of the memory in which its reader verified it
    (non-temporal stores); the reader has copied its own pieces with host
    targets as it read them. A rank whose copy fails raises; the caller's
    agreement spreads it."""
    if rp.read_all:
        return
    dest = _direct(rp)
    for f in range(rp.meta.world_size):
        buf = buffers.files.get(f)
        if buf is None or rp.file_raw[f] == 0:
            continue
        pieces = rp.by_file[f]
        if rp.owner[f] == comm.rank:
            # The reader filled its host targets as it read (read_share).
            pieces = [p for p in pieces if not isinstance(dest(p), np.ndarray)]
        _copy_out(pieces, _place(buf, rp.by_file[f]), dest, stage)()


#: The most bytes of packed short pieces that :func:`stream_share` holds
#: in flight (packed messages not yet complete on this rank).
STREAM_PACKED_BYTES = 64 << 20
#: The most broadcasts :func:`stream_share` holds in flight.
STREAM_MESSAGES = 256
#: The longest wait, in seconds, for this rank's reader thread between two
#: polls of the broadcasts in flight.
STREAM_POLL_S = 1e-3
#: The most stored bytes of compressed pieces that :func:`stream_share`'s
#: reader thread keeps read and verified but not yet sent; beyond it the
#: thread waits for the broadcasts, unless the exchange waits for it.
STREAM_HELD_BYTES = 256 << 20


class _Verified:
    """The pieces this rank's reader thread has read and verified, how the
    thread ended, and the stored bytes of compressed pieces it keeps for
    their broadcasts."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.ids: set[int] = set()
        self.over = False
        self.err: BaseException | None = None
        self.nread = 0
        #: Set when the exchange has stopped (an exception left it): the
        #: reader thread stops at its next piece instead of reading on.
        self.abandoned = False
        #: Stored bytes kept for broadcasts not yet completed.
        self.held = 0
        #: The exchange waits for a piece the reader has not verified yet:
        #: the reader goes on past :data:`STREAM_HELD_BYTES` until it has.
        self.starved = False

    def add(self, p: Piece) -> None:
        with self.cond:
            if self.abandoned:
                raise CheckpointError("the load's exchange stopped; its read stops too")
            self.ids.add(id(p))
            self.cond.notify_all()

    def hold(self, n: int) -> None:
        """The reader thread keeps ``n`` more stored bytes: waits first while
        that would pass :data:`STREAM_HELD_BYTES` (and it keeps some) and the
        exchange is not waiting for it."""
        with self.cond:
            while (
                self.held
                and self.held + n > STREAM_HELD_BYTES
                and not self.starved
                and not self.abandoned
            ):
                self.cond.wait()
            if self.abandoned:
                raise CheckpointError("the load's exchange stopped; its read stops too")
            self.held += n

    def release(self, n: int) -> None:
        with self.cond:
            self.held -= n
            self.cond.notify_all()

    def finish(self, nread: int, err: BaseException | None) -> None:
        with self.cond:
            self.nread, self.err, self.over = nread, err, True
            self.cond.notify_all()

    def abandon(self) -> None:
        with self.cond:
            self.abandoned = not self.over
            self.cond.notify_all()

    def has(self, message: Message) -> bool | None:
        """Whether every piece of ``message`` is verified (waiting up to
        :data:`STREAM_POLL_S` for it); None when it never will be: the
        thread has ended without it."""
        with self.cond:
            if not self._holds(message) and not self.over:
                if not self.starved:
                    self.starved = True
                    self.cond.notify_all()
                self.cond.wait(STREAM_POLL_S)
            if self._holds(message):
                self.starved = False
                return True
            return None if self.over else False

    def _holds(self, message: Message) -> bool:
        return all(id(p) in self.ids for p, _, _ in message)


def stream_share(comm: Comm, rp: ReadPlan, progress: Progress, stage: _staging.Staging) -> int:
    """Reads this rank's data files and exchanges every file's bytes at the
    same time (a broadcast, e.g. between hosts): a reader thread reads and
    verifies this rank's files (each piece checksummed as it is read,
    straight into the host targets; a file with device targets into one
    host buffer), and the reader of a file broadcasts each message of
    :func:`exchange_messages` as soon as all its pieces are verified, while
    its read goes on. The store's reads and the broadcasts share the link
    instead of taking turns.

    What travels is each file's stored bytes: a compressed piece goes as
    stored (its reader keeps them, at most :data:`STREAM_HELD_BYTES` ahead
    of the broadcasts), and every rank checks its checksum in the bytes it
    received before decoding them into its target, so the link carries the
    compressed size and every rank verifies what it returns.

    Every rank starts the same broadcasts in the same order (the messages
    each derives from the metadata, in file order within a file, the k-th
    of every file before any file's next; at most :data:`STREAM_MESSAGES`
    in flight); a long piece goes from
    its reader's target straight into the others' targets, short pieces
    (and pieces for device targets) through packed buffers, at most
    :data:`STREAM_PACKED_BYTES` of them in flight. A reader sends only
    bytes it has verified: once its read has failed, what it still must
    send is zeros (every rank takes part in every broadcast). A failed
    read or copy raises here after the last broadcast
    (:class:`FirstError`); the caller's agreement spreads it. A received
    compressed piece that does not match its checksum raises too, unless a
    reader failed (its zeros are what did not match: the reader's own error
    is the load's). Returns the bytes read."""
    dest = _direct(rp)
    failed = FirstError()
    # A received compressed piece that failed its check or its decoding.
    received_bad = FirstError()
    verified = _Verified()
    # Every file's pieces in the order they are read (file order).
    order = [sorted(ps, key=lambda p: p.offset) for ps in rp.by_file]
    # This rank's files with device targets: read into a host buffer,
    # broadcast from there, copied to the device at the end.
    held = {
        f: np.empty(rp.file_raw[f], dtype=np.uint8)
        for f in rp.mine
        if _to_device(rp, rp.by_file[f])
    }
    in_held = {f: _place(buf, order[f]) for f, buf in held.items()}
    # The stored bytes of the compressed pieces in transit (by id), and how
    # many of them have not been through their broadcasts yet.
    wire: dict[int, U8] = {}
    left: dict[int, int] = {}

    def keep(p: Piece) -> U8:
        """Reader thread: where compressed piece ``p``'s stored bytes go."""
        verified.hold(p.stored)
        buf = np.empty(p.stored, dtype=np.uint8)
        wire[id(p)] = buf
        return buf

    def source(p: Piece) -> U8 | _staging.DeviceSink:
        """Where piece ``p``'s stored bytes are sent from or received into."""
        if p.codec != "none":
            return wire[id(p)]
        if p.rank in in_held:
            return in_held[p.rank](p)
        return dest(p)

    def read_mine() -> None:
        nread = 0
        try:
            for f in rp.mine:
                place = in_held.get(f, dest)
                nread += read_file(
                    rp.path, rp.meta, f, order[f], place, progress, stage, done=verified.add,
                    stored_into=keep,
                )  # fmt: skip
        except BaseException as e:
            verified.finish(nread, e)
            return
        verified.finish(nread, None)

    inflight: deque[tuple[InFlight, Callable[[], None] | None, int]] = deque()
    packed_bytes = 0

    def settle(wait: bool) -> None:
        """Completes the oldest broadcasts that are done (with ``wait``, the
        oldest one in any case), running what follows each."""
        nonlocal packed_bytes
        while inflight and (wait or inflight[0][0].done()):
            handle, then, n = inflight.popleft()
            handle.wait()
            packed_bytes -= n
            if then is not None:
                then()
            wait = False

    def start(buf: U8, root: int, then: Callable[[], None] | None = None, n: int = 0) -> None:
        inflight.append((comm.start_bcast_u8(buf, root), then, n))

    def decode(p: Piece, stored: U8) -> Callable[[], None]:
        def step() -> None:
            out = dest(p)
            root = rp.owner[p.rank]
            if isinstance(out, np.ndarray):
                decode_piece(p, stored.data, out, rp.meta, rp.path, root)
                return
            raw = np.empty(p.length, dtype=np.uint8)
            decode_piece(p, stored.data, raw, rp.meta, rp.path, root)
            _copy_to(out, 0, raw, stage)

        return step

    def after(message: Message, packed: U8 | None, sending: bool) -> Callable[[], None] | None:
        """What follows a broadcast of ``message``: a receiver unpacks
        ``packed`` and checks and decodes each compressed piece whose last
        bytes it got; the reader lets go of such a piece's stored bytes."""
        ends = [(p, length) for p, _, length in message if p.codec != "none"]
        if not ends and (sending or packed is None):
            return None

        def then() -> None:
            if packed is not None and not sending:
                failed.run(unpack(message, packed))
            for p, length in ends:
                left[id(p)] -= length
                if left[id(p)]:
                    continue
                del left[id(p)]
                stored = wire.pop(id(p), None)
                if sending:
                    if stored is not None:
                        verified.release(p.stored)
                elif stored is not None and failed.err is None:
                    received_bad.run(decode(p, stored))

        return then

    def unpack(message: Message, packed: U8) -> Callable[[], None]:
        def step() -> None:
            at = 0
            for p, off, length in message:
                _copy_to(source(p), off, packed[at : at + length], stage)
                at += length

        return step

    # Message k of every file before message k + 1 of any: each reader's
    # first messages start early, whatever the cap on those in flight.
    messages = [list(exchange_messages(ps)) for ps in order]
    rounds = max((len(m) for m in messages), default=0)
    reader = threading.Thread(target=read_mine, name="deeppart-read", daemon=True)
    reader.start()
    try:
        for k in range(rounds):
            for f in range(rp.meta.world_size):
                if k >= len(messages[f]):
                    continue
                message = messages[f][k]
                root = rp.owner[f]
                sending = comm.rank == root
                n = sum(part[2] for part in message)
                ready: bool | None = True
                if sending:
                    while (ready := verified.has(message)) is False:
                        settle(False)
                while len(inflight) >= STREAM_MESSAGES:
                    settle(True)
                for p, off, _ in message:
                    if p.codec != "none" and off == 0:
                        left[id(p)] = p.stored
                        if not sending:
                            wire[id(p)] = np.empty(p.stored, dtype=np.uint8)
                p, off, _ = message[0]
                out = source(p) if ready else None
                if ready is None:
                    start(np.zeros(n, dtype=np.uint8), root, after(message, None, sending))
                elif len(message) == 1 and isinstance(out, np.ndarray):
                    start(out[off : off + n], root, after(message, None, sending))
                else:
                    while inflight and packed_bytes + n > STREAM_PACKED_BYTES:
                        settle(True)
                    packed = np.empty(n, dtype=np.uint8)
                    if sending:
                        failed.run(_pack(message, packed, source))
                    packed_bytes += n
                    start(packed, root, after(message, packed, sending), n)
                settle(False)
        while inflight:
            settle(True)
    finally:
        verified.abandon()
        reader.join()
    if verified.err is not None:
        failed.keep(verified.err)
    for f, buf in held.items():
        failed.run(_copy_out(order[f], _place(buf, order[f]), dest, stage))
    if any(p.codec != "none" for p in rp.meta.pieces):
        # Whether some rank's own steps failed: then a received piece that
        # did not match is that failure's zeros, not an error of its own.
        rows = comm.allgather_bytes(bytes([failed.err is not None]), 1)
        if received_bad.err is not None and not any(row[0] for row in rows):
            failed.keep(received_bad.err)
    failed.raise_first()
    return verified.nread


def _pack(
    message: Message, packed: U8, dest: Callable[[Piece], U8 | _staging.DeviceSink]
) -> Callable[[], None]:
    """The reader's step that packs ``message`` from its targets."""

    def step() -> None:
        at = 0
        for p, off, length in message:
            mine = dest(p)
            assert isinstance(mine, np.ndarray)
            packed[at : at + length] = mine[off : off + length]
            at += length

    return step


def _copy_out(
    pieces: Sequence[Piece],
    src: Callable[[Piece], U8],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    stage: _staging.Staging,
) -> Callable[[], None]:
    """The step that copies ``pieces`` from a file's read buffer (``src``)
    into their targets."""

    def step() -> None:
        for p in pieces:
            _copy_to(dest(p), 0, src(p), stage)

    return step


def _to_device(rp: ReadPlan, pieces: Sequence[Piece]) -> bool:
    """Whether any of ``pieces`` goes to a device tensor (through staging)."""
    for p in pieces:
        tgt = rp.targets[p.leaf]
        if tgt is not None and tgt.sink is not None:
            return True
    return False


def _copy_to(out: U8 | _staging.DeviceSink, at: int, data: U8, stage: _staging.Staging) -> None:
    """Copies ``data`` to byte ``at`` of a piece's target."""
    if isinstance(out, _staging.DeviceSink):
        stage.put(out, data, at)
    else:
        copy_into(out[at : at + data.size].data, data.data)


# ----------------------------------------------------------------------------
# 5. Assemble.


def assemble(
    meta: Metadata,
    targets: Sequence[Target | None],
    path: CheckpointDir,
    into: IntoMatch | None = None,
    pruned: bool = False,
    filled: dict[int, Any] | None = None,
    hidden: Collection[tuple[Any, ...]] = (),
) -> Any:
    """The state from the filled targets: object leaves decoded, staged
    tensors copied into ``into``'s, the containers rebuilt (``into``'s
    when given, its own values kept at its missing leaves; else the
    checkpoint's, without the leaves not read, nor the paths in ``hidden``,
    when ``pruned``). ``filled``: values loaded by another stage, by leaf
    (the sharded tensors)."""
    values: list[Any] = []
    try:
        for i, info in enumerate(meta.leaves):
            tgt = targets[i]
            if tgt is None:
                values.append(ABSENT)
            elif info.kind == "object":
                try:
                    values.append(decode_plain(tgt.buf.tobytes()))
                except ValueError as e:
                    raise CorruptCheckpointError(
                        f"{path}: object leaf {'/'.join(map(str, info.path))}: {e}"
                    ) from e
            else:
                if tgt.copy_into is not None:
                    assert tgt.tensor is not None
                    with torch_module().no_grad():
                        tgt.tensor.copy_(tgt.copy_into)
                elif into is not None and tgt.tensor is not None:
                    written_in_place(tgt.tensor)
                values.append(tgt.tensor)
        for i, value in (filled or {}).items():
            values[i] = value
        if into is not None:
            mine: list[Any] = [
                lf.tensor if lf.tensor is not None else decode_plain(lf.encoded or b"null")
                for lf in into.leaves
            ]
            for i, j in into.pairs.items():
                mine[j] = values[i]
            for i, j in into.copies:
                mine[j] = _copied(values[i], into.leaves[j].tensor)
            for i, j, at, by in into.checks:
                if not same_bytes(values[i], mine[j]):
                    raise StateMismatchError(
                        f"{by} and {at}: into= holds one tensor at both (tied weights), the "
                        "checkpoint two that differ; load into a state whose weights are not "
                        "tied there, or read one of them (keys=[...])"
                    )
            write_back_plain(into.root, into.leaves, [*into.pairs.items(), *into.copies], values)
            return unflatten(into.skeleton, mine)
        skeleton = meta.skeleton
        if hidden and pruned:
            skeleton = skeleton_without(skeleton, hidden, len(values))
            values.append(ABSENT)
        state = unflatten(skeleton, values, absent=ABSENT)
        return prune(state) if pruned else state
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from e


def _copied(value: Any, dst: Any) -> Any:
    """``value`` (a checkpoint leaf's) copied into ``into=``'s tensor
    ``dst`` in place (``dst`` returned); a plain value as it is."""
    if dst is None:
        return value
    torch = torch_module()
    with torch.inference_mode() if dst.is_inference() else torch.no_grad():
        dst.copy_(value)
    return dst
