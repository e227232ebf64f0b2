"""The on-disk checkpoint format (see docs/FORMAT.md), its checks and errors.

A committed checkpoint is a directory::

    metadata.json        manifest, skeleton, plan fingerprint, piece index
    rank-00000.bin       one data file per writing rank: a 4 KiB header,
    rank-00001.bin       then pieces, each at a 4 KiB-aligned offset
    ...
    COMMITTED            written last: format tag and sha256 of metadata.json

Nothing here unpickles; every size and offset read from disk is checked
against the metadata's own invariants and the real file sizes before use.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import secrets
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from deeppart._planner import MAX_GROUP_ENTRIES, MAX_GROUPS
from deeppart.compression import CODECS, MAX_EXPANSION, MAX_OBJECT_EXPANSION
from deeppart.errors import CheckpointError, CorruptCheckpointError
from deeppart.regions import DTensorRecord, parse_records

FORMAT_NAME = "deeppart-checkpoint"
FORMAT_VERSION = 1
#: metadata.json's version when the state holds sharded tensors (its
#: ``dtensors`` records); the data files keep FORMAT_VERSION.
METADATA_VERSION_SHARDED = 2
#: metadata.json's version when the state's items are not all held by every
#: rank (each rank's own state, :mod:`deeppart.state.union`): ``dtensors`` records
#: with each one's ``ranks``, and ``versions`` records (docs/FORMAT.md).
METADATA_VERSION_UNION = 3
#: The most ranks listed in all ``versions`` and record ``ranks`` together.
MAX_VERSION_ENTRIES = 1 << 24
METADATA = "metadata.json"
MARKER = "COMMITTED"
#: In an object store: ``<save id>/SAVING``, put by a save's rank 0 before
#: any rank uploads (:func:`saving_text`), removed after its commit. It
#: marks the save id as DeepPart's while the save's own objects may still
#: be invisible (multipart uploads in progress), so that the next save of
#: the prefix can abort the uploads that a killed save left.
SAVING = "SAVING"
#: Numbered checkpoints (Checkpointer, the level backends) live in
#: directories STEP_PREFIX + the step as 8 digits: ``step-00000100``.
STEP_PREFIX = "step-"
ALIGN = 4096
HEADER_SIZE = ALIGN
MAGIC = b"DPCKPT01"
#: Header: magic, format version, rank, world size, plan fingerprint (hex).
_HEADER = struct.Struct("<8sIII64s")
#: Then (in the header's former padding, so older readers ignore it) the
#: id of the save that wrote the file: 16 bytes, all zero in files written
#: before save ids existed.
_SAVE_ID = struct.Struct("<16s")
#: The length in hex digits of a save's id (:func:`new_save_id`).
SAVE_ID_HEX = 32
#: Largest object (plain value) leaf accepted on load.
MAX_OBJECT_BYTES = 1 << 30
#: Largest metadata.json accepted on load. Its parse takes memory and time
#: proportional to its size (up to ~20 times it in Python objects); real
#: metadata takes ~100-300 bytes per leaf and piece, so 64 MiB is several
#: hundred thousand of them.
MAX_METADATA_BYTES = 64 << 20
#: Largest COMMITTED marker (a real one is ~100 bytes).
MAX_MARKER_BYTES = 4096
#: Largest world size accepted on load: every rank writes one data file.
MAX_WORLD_SIZE = 1 << 20

#: Fields of one piece record, in metadata.json's "pieces" rows.
PIECE_FIELDS = ("leaf", "start", "stop", "rank", "offset", "length", "stored", "codec", "xxh3")


def data_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


def step_dir_name(step: int) -> str:
    """The directory name of a numbered checkpoint: ``step-00000100``."""
    return f"{STEP_PREFIX}{step:08d}"


def step_number(name: str, prefix: str = STEP_PREFIX) -> int | None:
    """N for a directory name ``prefix + N`` of ASCII digits, else None
    (also for names such as ``step-²``, whose ``isdigit()`` is true but
    which ``int()`` refuses)."""
    digits = name[len(prefix) :]
    if name.startswith(prefix) and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


#: Pieces at least this long are checksummed in a background thread while
#: the next ones are read or written (xxhash and file I/O both release the
#: GIL); shorter ones at once.
OVERLAP_CHECKSUM_BYTES = 1 << 20


def checksum(data: bytes | memoryview) -> int:
    """xxh3_64 of ``data``. Through the hasher object, whose update
    releases the GIL (the one-shot function holds it): a checksum in one
    thread runs beside reads and writes in another."""
    import xxhash

    return int(xxhash.xxh3_64(data).intdigest())


def checksum_stream() -> Any:
    """A hasher for bytes that arrive in parts: ``update(part)`` for each,
    in order, then ``intdigest()`` is :func:`checksum` of them all."""
    import xxhash

    return xxhash.xxh3_64()


def new_save_id() -> str:
    """A fresh random id for one save (32 hex digits): stored in its
    ``metadata.json`` (``save_id``) and in its data files' headers, so that
    DeepPart tells its own files from others by content
    (:mod:`deeppart.storage.ownership`)."""
    return secrets.token_hex(SAVE_ID_HEX // 2)


def header_bytes(rank: int, world_size: int, plan_fingerprint: str, save_id: str = "") -> bytes:
    fp = plan_fingerprint.encode("ascii")[:64].ljust(64, b"\0")
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, rank, world_size, fp)
    head += _SAVE_ID.pack(bytes.fromhex(save_id) if save_id else b"")
    return head.ljust(HEADER_SIZE, b"\0")


def header_save_id(data: bytes) -> str | None:
    """The save id in a data file's first bytes ``data``: its hex digits,
    ``""`` for a DeepPart file written before save ids, None if ``data`` is
    not the start of a DeepPart data file (no magic)."""
    if len(data) < _HEADER.size + _SAVE_ID.size or not data.startswith(MAGIC):
        return None if not data.startswith(MAGIC) else ""
    raw: bytes = _SAVE_ID.unpack_from(data, _HEADER.size)[0]
    return "" if not any(raw) else raw.hex()


def check_header(
    path: Path | str, data: bytes, rank: int, world_size: int, fingerprint: str
) -> None:
    if len(data) < _HEADER.size:
        raise CorruptCheckpointError(f"{path}: truncated header")
    magic, version, hrank, hworld, fp = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: not a DeepPart v{FORMAT_VERSION} data file")
    if (hrank, hworld) != (rank, world_size):
        raise CorruptCheckpointError(
            f"{path}: header says rank {hrank} of {hworld}, expected {rank} of {world_size}"
        )
    if fp.rstrip(b"\0").decode("ascii", "replace") != fingerprint:
        raise CorruptCheckpointError(f"{path}: written for another plan")


def max_expansion(kind: str) -> int:
    """How many bytes one stored byte of a compressed piece of a leaf of
    ``kind`` ("tensor" or "object") may decode to."""
    return MAX_OBJECT_EXPANSION if kind == "object" else MAX_EXPANSION


# ----------------------------------------------------------------------------
# Reading files that anyone could have replaced: regular files only, capped.


def open_regular(path: Path) -> Any:
    """``path`` opened for unbuffered binary reading, after checking (on the
    open descriptor) that it is a regular file: a FIFO, a device (e.g. a
    symlink to /dev/zero), a socket or a directory raises
    :class:`CorruptCheckpointError` at once instead of hanging or reading
    without end. Opened non-blocking, so that opening a FIFO cannot block.
    ``OSError`` (e.g. a missing file) propagates."""
    mode = os.stat(path).st_mode  # a socket cannot even be opened: say what it is
    if not stat.S_ISREG(mode):
        raise CorruptCheckpointError(f"{path}: not a regular file ({_file_kind(mode)})")
    # Checked again on the descriptor: the file may have been replaced since.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptCheckpointError(f"{path}: not a regular file ({_file_kind(mode)})")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return "a special file"


def read_regular(path: Path, limit: int) -> bytes:
    """The contents of the regular file ``path`` (see :func:`open_regular`),
    :class:`CorruptCheckpointError` if it holds more than ``limit`` bytes
    (never reads more than ``limit + 1``)."""
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise CorruptCheckpointError(f"{path}: larger than the limit of {limit} bytes")
        data: bytes = f.read(limit + 1)
        if len(data) > limit:
            raise CorruptCheckpointError(f"{path}: larger than the limit of {limit} bytes")
        return data


# ----------------------------------------------------------------------------
# Durability.


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` and fsyncs it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def saving_text(save_id: str) -> bytes:
    """The content of a save's :data:`SAVING` object."""
    return f"{FORMAT_NAME} save {save_id} began\n".encode()


def marker_text(metadata: bytes) -> bytes:
    digest = hashlib.sha256(metadata).hexdigest()
    return f"{FORMAT_NAME} v{FORMAT_VERSION}\nsha256 {digest}\n".encode()


#: How every COMMITTED marker begins.
MARKER_PREFIX = f"{FORMAT_NAME} v".encode()


def is_committed(directory: Path) -> bool:
    """Whether ``directory`` holds a marker matching its metadata (cheap:
    reads two small files, not the data)."""
    try:
        marker = read_regular(directory / MARKER, MAX_MARKER_BYTES)
        meta = read_regular(directory / METADATA, MAX_METADATA_BYTES)
    except (OSError, CheckpointError):
        return False
    return marker == marker_text(meta)


def damaged(directory: Path) -> str | None:
    """Why ``directory`` is a damaged commit, else None: its ``COMMITTED``
    marker is DeepPart's (no save writes a step directory's marker except
    into its temporary directory, before the rename that commits it) but
    does not match its ``metadata.json``, or that cannot be read. A
    directory without a marker (what an interrupted save of an earlier
    version left) or one that vanishes or is replaced while being read
    (a concurrent overwrite or removal; read again, the directory's inode
    changed) is not damaged."""
    for _ in range(3):
        try:
            before = os.stat(directory).st_ino
            marker = read_regular(directory / MARKER, MAX_MARKER_BYTES)
        except (OSError, CheckpointError):
            return None  # no marker (or it went): never committed, or removed
        if not marker.startswith(MARKER_PREFIX):
            return None  # not DeepPart's marker
        why: str | None
        try:
            meta = read_regular(directory / METADATA, MAX_METADATA_BYTES)
            why = None if marker == marker_text(meta) else f"{METADATA} does not match {MARKER}"
        except FileNotFoundError:
            why = f"{METADATA} is missing"
        except (OSError, CheckpointError) as e:
            why = f"{METADATA} cannot be read ({e})"
        try:
            after = os.stat(directory).st_ino
            again = read_regular(directory / MARKER, MAX_MARKER_BYTES)
        except (OSError, CheckpointError):
            return None  # removed meanwhile (a removal unlinks the marker first)
        if after == before and again == marker:
            return why
    return None  # replaced again and again: in use, not damaged


# ----------------------------------------------------------------------------
# Metadata.


@dataclass(frozen=True)
class LeafInfo:
    path: list[Any]
    kind: str  # "tensor" | "object"
    dtype: str | None
    shape: list[int]
    itemsize: int
    numel: int  # elements (1 for an object leaf)
    nbytes: int


class Directory(Protocol):
    """What names a checkpoint's files in messages: a directory
    (:class:`~pathlib.Path`) or the objects of one save in an object store
    (:class:`deeppart.storage.objects.ObjectDir`); ``directory / name``."""

    def __truediv__(self, name: str, /) -> Any: ...


@dataclass(frozen=True)
class Piece:
    leaf: int
    start: int
    stop: int
    rank: int
    offset: int
    length: int
    stored: int
    codec: str
    xxh3: int

    def describe(self, directory: Directory) -> str:
        return (
            f"{directory / data_file_name(self.rank)}: piece of leaf {self.leaf} "
            f"[{self.start}:{self.stop}] at offset {self.offset} ({self.stored} bytes)"
        )


@dataclass(frozen=True)
class Metadata:
    raw: dict[str, Any]
    leaves: list[LeafInfo]
    pieces: list[Piece]
    world_size: int
    plan_fingerprint: str
    skeleton: Any
    file_sizes: list[int]
    #: The sharded tensors (DTensors) of the state, checked.
    dtensors: list[DTensorRecord] = field(default_factory=list)
    #: Version 3: per record of ``dtensors``, the saved ranks that held it.
    record_ranks: list[list[int]] = field(default_factory=list)
    #: Version 3: the paths with several versions (:class:`VersionRecord`).
    versions: list[VersionRecord] = field(default_factory=list)
    #: Version 3: each rank's own state is stored (:mod:`deeppart.state.union`).
    union: bool = False
    #: A rank's view (:mod:`deeppart.state.own_view`): leaves it does not read.
    skip: frozenset[int] = frozenset()
    #: A rank's view: a DTensor record's key -> the path it loads at.
    aliases: dict[tuple[Any, ...], tuple[Any, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class VersionRecord:
    """A path whose saved ranks held different values or tensors: per
    version, its saved ranks and its leaf (or DTensor record)."""

    path: list[Any]
    ranks: list[list[int]]
    #: Per version: its first leaf (a plain leaf, or a DTensor's first shard).
    leaves: list[int]
    #: Per version: its DTensor record (empty when the versions are leaves).
    records: list[int]


def _int(value: Any, what: str, lo: int = 0, hi: int = 1 << 62, at: int | None = None) -> int:
    """``value``, checked to be an integer in ``[lo, hi]``; else
    CorruptCheckpointError naming ``what`` (with ``at``: a template whose
    ``{}`` is ``at``, formatted only then: the per-piece checks of a large
    checkpoint's metadata run hundreds of thousands of times)."""
    if type(value) is not int or not lo <= value <= hi:  # bool is not int here
        name = what if at is None else what.format(at)
        raise CorruptCheckpointError(
            f"metadata: {name} is {value!r}, not an integer in [{lo}, {hi}]"
        )
    return value


def decode_metadata(text: bytes) -> dict[str, Any]:
    """metadata.json as a dict (no checks beyond its being a DeepPart one)."""
    try:
        raw = json.loads(text.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # also UnicodeDecodeError, over-long integers
        raise CorruptCheckpointError(f"metadata.json is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError("metadata.json is not DeepPart checkpoint metadata")
    return raw


def parse_metadata(raw: dict[str, Any], dtype_sizes: dict[str, int]) -> Metadata:
    """Checks decoded metadata, whose ``leaves`` are the manifest's leaf
    descriptions: every leaf is covered exactly once by its pieces, pieces of
    one file do not overlap, every length is consistent. File sizes are
    checked separately by :func:`check_file_sizes`."""
    version = raw.get("version")
    known = (FORMAT_VERSION, METADATA_VERSION_SHARDED, METADATA_VERSION_UNION)
    if version not in known or isinstance(version, bool):
        raise CheckpointError(f"unsupported checkpoint format version {raw.get('version')!r}")
    if (version in known[1:]) != ("dtensors" in raw):
        raise CorruptCheckpointError(
            "metadata: versions 2 and 3 go with dtensors records, and only they"
        )
    if (version == METADATA_VERSION_UNION) != ("versions" in raw):
        raise CorruptCheckpointError("metadata: version 3 goes with versions records, and only it")
    world = _int(raw.get("world_size"), "world_size", 1, MAX_WORLD_SIZE)
    fingerprint = raw.get("plan_fingerprint")
    if not isinstance(fingerprint, str) or len(fingerprint) > 64:
        raise CorruptCheckpointError("metadata: bad plan_fingerprint")
    raw_leaves = raw.get("leaves")
    if not isinstance(raw_leaves, list):
        raise CorruptCheckpointError("metadata: leaves is not a list")
    leaves: list[LeafInfo] = []
    for i, lf in enumerate(raw_leaves):
        if not isinstance(lf, dict) or not isinstance(lf.get("path"), list):
            raise CorruptCheckpointError(f"metadata: leaf {i} is malformed")
        if lf.get("kind") == "object":
            nbytes = _int(lf.get("nbytes"), "leaf {} nbytes", 0, MAX_OBJECT_BYTES, at=i)
            leaves.append(LeafInfo(lf["path"], "object", None, [], 1, 1, nbytes))
            continue
        dtype = lf.get("dtype")
        shape = lf.get("shape")
        if dtype not in dtype_sizes or not isinstance(shape, list):
            raise CorruptCheckpointError(f"metadata: leaf {i} has bad dtype or shape")
        numel = 1
        for d in shape:
            numel *= _int(d, "leaf {} shape", 0, 1 << 48, at=i)
        itemsize = dtype_sizes[dtype]
        _int(numel * itemsize, "leaf {} size", at=i)
        nbytes = numel * itemsize
        leaves.append(LeafInfo(lf["path"], "tensor", dtype, shape, itemsize, numel, nbytes))
    rows = raw.get("pieces")
    if not isinstance(rows, list):
        raise CorruptCheckpointError("metadata: pieces is not a list")
    pieces: list[Piece] = []
    for j, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(PIECE_FIELDS):
            raise CorruptCheckpointError(f"metadata: piece {j} is malformed")
        leaf = _int(row[0], "piece {} leaf", 0, len(leaves) - 1, at=j)  # none: always refused
        info = leaves[leaf]
        start = _int(row[1], "piece {} start", 0, info.numel, at=j)
        stop = _int(row[2], "piece {} stop", start, info.numel, at=j)
        rank = _int(row[3], "piece {} rank", 0, world - 1, at=j)
        offset = _int(row[4], "piece {} offset", HEADER_SIZE, at=j)
        length = _int(row[5], "piece {} length", at=j)
        stored = _int(row[6], "piece {} stored length", at=j)
        codec = row[7]
        if codec not in CODECS:
            raise CorruptCheckpointError(f"metadata: piece {j} has unknown codec {codec!r}")
        xxh = _int(row[8], "piece {} checksum", 0, (1 << 64) - 1, at=j)
        expect = info.nbytes if info.kind == "object" else (stop - start) * info.itemsize
        if length != expect or (codec == "none" and stored != length):
            raise CorruptCheckpointError(f"metadata: piece {j} has inconsistent lengths")
        if codec != "none" and length > max_expansion(info.kind) * stored:
            raise CorruptCheckpointError(
                f"metadata: piece {j} claims {stored} stored bytes decode to {length}, "
                f"more than {max_expansion(info.kind)}:1 (a decompression bomb?)"
            )
        pieces.append(Piece(leaf, start, stop, rank, offset, length, stored, codec, xxh))
    check_holders(raw, pieces, world)
    # Coverage: every leaf exactly once.
    by_leaf: list[list[tuple[int, int]]] = [[] for _ in leaves]
    for p in pieces:
        by_leaf[p.leaf].append((p.start, p.stop))
    for i, spans in enumerate(by_leaf):
        spans.sort()
        pos = 0
        for a, b in spans:
            if a != pos:
                raise CorruptCheckpointError(f"metadata: leaf {i} is not covered exactly once")
            pos = b
        if pos != leaves[i].numel and not (leaves[i].numel == 0 and not spans):
            raise CorruptCheckpointError(f"metadata: leaf {i} is not covered exactly once")
    # No overlaps within a file; compute the least size of every file.
    file_sizes = [HEADER_SIZE] * world
    by_file: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for p in pieces:
        if p.stored:  # an empty piece occupies no bytes
            by_file[p.rank].append((p.offset, p.offset + p.stored))
    for r, spans in enumerate(by_file):
        spans.sort()
        end = HEADER_SIZE
        for a, b in spans:
            if a < end:
                raise CorruptCheckpointError(f"metadata: pieces overlap in {data_file_name(r)}")
            end = b
        file_sizes[r] = end
    declared = raw.get("file_sizes")
    if not isinstance(declared, list) or len(declared) != world:
        raise CorruptCheckpointError("metadata: bad file_sizes")
    for r, n in enumerate(declared):
        if _int(n, f"file_sizes[{r}]") < file_sizes[r]:
            raise CorruptCheckpointError(f"metadata: file_sizes[{r}] is smaller than its pieces")
    dtensors = parse_records(
        raw.get("dtensors"),
        leaves,
        dtype_sizes.__contains__,
        versions=version == METADATA_VERSION_UNION,
    )
    record_ranks: list[list[int]] = []
    versions: list[VersionRecord] = []
    if version == METADATA_VERSION_UNION:
        budget = [MAX_VERSION_ENTRIES]
        for i, rec in enumerate(raw["dtensors"]):
            record_ranks.append(_ranks(rec.get("ranks"), world, f"dtensors[{i}] ranks", budget))
        versions = _versions(raw["versions"], world, len(leaves), len(dtensors), budget)
    return Metadata(
        raw=raw,
        leaves=leaves,
        pieces=pieces,
        world_size=world,
        plan_fingerprint=fingerprint,
        skeleton=raw.get("skeleton"),
        file_sizes=[int(n) for n in declared],
        dtensors=dtensors,
        record_ranks=record_ranks,
        versions=versions,
        union=version == METADATA_VERSION_UNION,
    )


def _ranks(raw: Any, world: int, what: str, budget: list[int]) -> list[int]:
    """A sorted list of distinct saved ranks, checked (``budget``: ranks
    left of :data:`MAX_VERSION_ENTRIES`)."""
    if not isinstance(raw, list) or not raw:
        raise CorruptCheckpointError(f"metadata: {what} is not a non-empty list of ranks")
    budget[0] -= len(raw)
    if budget[0] < 0:
        raise CorruptCheckpointError(f"metadata: more than {MAX_VERSION_ENTRIES} version ranks")
    out = [_int(r, what, 0, world - 1) for r in raw]
    if any(a >= b for a, b in itertools.pairwise(out)):
        raise CorruptCheckpointError(f"metadata: {what} are not sorted and distinct")
    return out


def _versions(
    raw: Any, world: int, nleaves: int, nrecords: int, budget: list[int]
) -> list[VersionRecord]:
    """The checked ``versions`` records of version-3 metadata."""
    if not isinstance(raw, list) or len(raw) > nleaves:
        raise CorruptCheckpointError("metadata: versions is not a list of at most one per leaf")
    out: list[VersionRecord] = []
    for i, rec in enumerate(raw):
        what = f"versions[{i}]"
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), list):
            raise CorruptCheckpointError(f"metadata: {what} is malformed")
        ranks_raw, leaves_raw = rec.get("ranks"), rec.get("leaves")
        records_raw = rec.get("records", [])
        if (
            not isinstance(ranks_raw, list)
            or not 2 <= len(ranks_raw) <= world
            or not isinstance(leaves_raw, list)
            or len(leaves_raw) != len(ranks_raw)
            or not isinstance(records_raw, list)
            or len(records_raw) not in (0, len(ranks_raw))
        ):
            raise CorruptCheckpointError(f"metadata: {what} needs 2 to {world} versions")
        ranks = [_ranks(r, world, f"{what} ranks", budget) for r in ranks_raw]
        seen: set[int] = set()
        for r in ranks:
            if seen & set(r):
                raise CorruptCheckpointError(f"metadata: {what}: a rank holds two versions")
            seen |= set(r)
        leaves = [_int(x, f"{what} leaf", 0, nleaves - 1) for x in leaves_raw]
        records = [_int(x, f"{what} record", 0, nrecords - 1) for x in records_raw]
        out.append(VersionRecord(list(rec["path"]), ranks, leaves, records))
    return out


def _holder_groups(raw: dict[str, Any], world: int) -> list[list[int]]:
    """The manifest's holder groups, each checked: a non-empty, strictly
    increasing list of ranks below the checkpoint's world size."""
    manifest = raw.get("manifest")
    groups = manifest.get("groups", []) if isinstance(manifest, dict) else []
    if not isinstance(groups, list) or len(groups) > MAX_GROUPS:
        raise CorruptCheckpointError(
            f"metadata: the manifest's groups are not a list of at most {MAX_GROUPS} groups"
        )
    entries = 0
    for g, ranks in enumerate(groups):
        if not isinstance(ranks, list) or not ranks:
            raise CorruptCheckpointError(f"metadata: holder group {g} is not a non-empty list")
        entries += len(ranks)
        if entries > MAX_GROUP_ENTRIES:
            raise CorruptCheckpointError(
                f"metadata: the holder groups list more than {MAX_GROUP_ENTRIES} ranks"
            )
        prev = -1
        for r in ranks:
            _int(r, f"holder group {g} rank", 0, world - 1)
            if r <= prev:
                raise CorruptCheckpointError(
                    f"metadata: holder group {g} is not sorted and distinct ({ranks})"
                )
            prev = r
    return groups


def check_holders(raw: dict[str, Any], pieces: list[Piece], world: int) -> None:
    """Every piece was written by a holder of its leaf: its owner, or a rank of
    its holder group (``raw["leaves"]`` are the manifest's leaf descriptions).
    Checked before any data is read, so that a checkpoint whose metadata
    breaks the planner's holder rule is refused rather than read."""
    groups = _holder_groups(raw, world)
    leaves: list[dict[str, Any]] = raw["leaves"]
    holders: list[frozenset[int] | None] = []
    sets = [frozenset(g) for g in groups]
    for i, lf in enumerate(leaves):
        owner, g = lf.get("owner"), lf.get("holders")
        if owner is not None:
            holders.append(frozenset([_int(owner, "leaf {} owner", 0, world - 1, at=i)]))
        elif g is not None:
            holders.append(sets[_int(g, "leaf {} holders", 0, len(sets) - 1, at=i)])
        else:
            holders.append(None)
    if not any(h is not None for h in holders):
        return
    for j, p in enumerate(pieces):
        h = holders[p.leaf]
        if h is not None and p.rank not in h:
            path = "/".join(str(k) for k in leaves[p.leaf]["path"])
            raise CorruptCheckpointError(
                f"metadata: piece {j} of leaf {p.leaf} ({path}) was written by rank "
                f"{p.rank}, which does not hold that leaf (its holders: {sorted(h)}); "
                "the metadata breaks the holder rule (edited or corrupt): "
                "load another checkpoint"
            )


def check_file_sizes(directory: Path, meta: Metadata, ranks: list[int]) -> None:
    """Every data file in ``ranks`` exists and has its declared size."""
    for r in ranks:
        path = directory / data_file_name(r)
        try:
            size = path.stat().st_size
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: missing ({e.strerror})") from e
        if size != meta.file_sizes[r]:
            raise CorruptCheckpointError(
                f"{path}: {size} bytes, metadata says {meta.file_sizes[r]} (truncated or extended)"
            )


def read_checked_metadata(directory: Path) -> bytes:
    """Reads metadata.json and checks the commit marker against it."""
    mpath = directory / METADATA
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    try:
        marker = read_regular(directory / MARKER, MAX_MARKER_BYTES)
    except OSError as e:
        raise CheckpointError(
            f"{directory}: no {MARKER} marker; the checkpoint was never committed "
            "(a save was interrupted)"
        ) from e
    try:
        text = read_regular(mpath, MAX_METADATA_BYTES)
    except OSError as e:
        raise CorruptCheckpointError(f"{mpath}: cannot read ({e.strerror})") from e
    if marker != marker_text(text):
        raise CorruptCheckpointError(f"{mpath}: does not match the hash in {directory / MARKER}")
    return text


def remove_tree(path: Path) -> None:
    """Removes a checkpoint directory (files, then the directory), ignoring
    what is already gone."""
    if not path.exists():
        return
    if path.is_symlink() or not path.is_dir():  # a stray file of that name
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    with contextlib.suppress(FileNotFoundError):
        (path / MARKER).unlink()  # first: a half-removed checkpoint is never "committed"
    for child in sorted(path.iterdir(), reverse=True):
        if child.is_dir() and not child.is_symlink():
            remove_tree(child)
        else:
            with contextlib.suppress(FileNotFoundError):
                child.unlink()
    with contextlib.suppress(FileNotFoundError):
        path.rmdir()
