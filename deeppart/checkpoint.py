"""Parallel checkpoint save and restore of replicated state across MPI ranks.

Every rank holds the same state. :func:`save` plans (deterministically, on
every rank) which rank writes which slice of which leaf; each rank writes
its pieces straight from tensor memory into its own data file, and rank 0
commits the checkpoint atomically. :func:`load` lets each rank read a
balanced share of the data files (any number of ranks, whatever number
wrote them), verifies every piece's checksum, and broadcasts the raw bytes
with buffer collectives.

Every step that can fail on some ranks only is followed by one small
agreement collective, so a failure anywhere raises on every rank instead of
leaving the others blocked in a collective.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from deeppart import staging as _staging
from deeppart._planner import DeepPartError, Manifest, ManifestError, Plan
from deeppart.comm import Comm, node_shared, resolve
from deeppart.compression import (
    CODECS,
    CodecError,
    check_codec,
    compress,
    decompress,
    decompress_into,
)
from deeppart.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_SIZE,
    MARKER,
    METADATA,
    PIECE_FIELDS,
    CheckpointError,
    CorruptCheckpointError,
    Metadata,
    Piece,
    StateMismatchError,
    align_up,
    check_file_sizes,
    check_header,
    checksum,
    data_file_name,
    decode_metadata,
    fsync_dir,
    header_bytes,
    is_committed,
    marker_text,
    max_expansion,
    open_regular,
    parse_metadata,
    read_checked_metadata,
    remove_tree,
    step_number,
    write_durable,
)
from deeppart.progress import Progress, Stats
from deeppart.restore import ABSENT, IncompatibleKeys, match, prune, select
from deeppart.state import (
    FlatLeaf,
    StateError,
    check_has_data,
    decode_plain,
    describe_leaf,
    flatten,
    unflatten,
)

if TYPE_CHECKING:
    from deeppart.async_save import AsyncCheckpointer, AsyncSave
    from deeppart.levels.backend import LevelBackend, LevelSaveStats, RecoveryReport

U8 = npt.NDArray[np.uint8]

_last_stats: dict[str, Stats] = {}
_last_keys: list[IncompatibleKeys] = []


def last_stats(op: str = "save") -> Stats | None:
    """The :class:`Stats` of this process's latest ``"save"`` or ``"load"``."""
    return _last_stats.get(op)


def last_incompatible_keys() -> IncompatibleKeys | None:
    """The missing and unexpected keys of this process's latest
    ``load(into=...)`` (empty lists when everything matched), like the
    value of ``torch.nn.Module.load_state_dict``; None before any."""
    return _last_keys[-1] if _last_keys else None


# ----------------------------------------------------------------------------
# torch dtypes.


def _torch() -> Any:
    import torch

    return torch


_DTYPE_CACHE: dict[str, Any] = {}


def _dtypes() -> dict[str, Any]:
    """torch dtypes by their manifest name ("float32", "bfloat16", ...)."""
    if not _DTYPE_CACHE:
        torch = _torch()
        for name in dir(torch):
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                key = str(value).removeprefix("torch.")
                _DTYPE_CACHE.setdefault(key, value)
    return _DTYPE_CACHE


def _dtype_sizes(leaves: list[dict[str, Any]]) -> dict[str, int]:
    """Element sizes of torch's dtypes by name, for metadata ``leaves``; empty
    when no leaf is a tensor, so that a state of plain values and small
    numpy arrays loads where torch is not installed."""
    if all(lf.get("kind") == "object" for lf in leaves):
        return {}
    return {name: int(dt.itemsize) for name, dt in _dtypes().items()}


def _u8_view(t: Any) -> U8:
    """A flat uint8 numpy view of a CPU, contiguous tensor's memory (no copy)."""
    torch = _torch()
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    arr: U8 = flat.numpy()
    return arr


def _readable(t: Any) -> Any:
    """``t`` on the CPU, contiguous, conjugation resolved (copies only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


# ----------------------------------------------------------------------------
# Agreement: every rank learns whether any rank failed, and raises.

_ERROR_CODES: list[type[BaseException]] = [
    CorruptCheckpointError,
    StateMismatchError,
    CheckpointError,
    StateError,
    DeepPartError,
]


def _code_of(err: BaseException) -> int:
    for i, cls in enumerate(_ERROR_CODES):
        if isinstance(err, cls):
            return i + 1
    return len(_ERROR_CODES) + 1


def _agree(
    comm: Comm, err: BaseException | None, payload: bytes = b"", width: int = 32
) -> list[bytes]:
    """One collective: returns every rank's ``payload`` when no rank failed;
    otherwise every rank raises (its own error, or one naming the failed
    rank and its message, of the same type)."""
    code = 0 if err is None else _code_of(err)
    if len(payload) > width:
        raise ValueError("payload too long")
    rows = comm.allgather_bytes(bytes([code]) + payload, width + 1)
    failed = [r for r, row in enumerate(rows) if row[0] != 0]
    if not failed:
        return [row[1:] for row in rows]
    msg = b"" if err is None else f"{err}".encode()[:8000]
    messages = comm.allgather_varbytes(msg)
    if err is not None:
        raise err
    first = failed[0]
    idx = rows[first][0] - 1
    cls = _ERROR_CODES[idx] if idx < len(_ERROR_CODES) else CheckpointError
    text = messages[first].decode("utf-8", "replace")
    others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise cls(f"rank {first}{others}: {text}")


# ----------------------------------------------------------------------------
# Planning.

def _make_plan(
    manifest: Manifest,
    world_size: int,
    *,
    plan: Plan | None = None,
    planner: Any = None,
    algorithm: str | None = None,
    cost: Any = None,
    topology: Any = None,
) -> Plan:
    """The plan to save with: ``plan`` when given (checked against the
    state), else one from ``planner`` (the planner service, see
    :func:`deeppart.resolve_planner`) or in process. Planning is
    deterministic, so every rank computes the same plan itself; the
    fingerprint agreement in :func:`save` catches any rank that did not."""
    import deeppart

    if plan is not None:
        if plan.world_size != world_size or plan.manifest != manifest:
            raise StateMismatchError(
                "the given plan was made for another state or world size "
                f"({plan.world_size} ranks); re-plan"
            )
        return plan
    kwargs: dict[str, Any] = {}
    if algorithm is not None:
        kwargs["algorithm"] = algorithm
    if cost is not None:
        kwargs["cost"] = cost
    if topology is not None:
        kwargs["topology"] = topology
    if planner is not None:
        made: Plan = deeppart.plan_with(planner, manifest, world_size, **kwargs)
        return made
    made = deeppart.plan(manifest, world_size, **kwargs)
    return made


def _reuse_plan(owner: Any, manifest: Manifest) -> Plan:
    """``owner._plan`` while it is for ``manifest``, else a new plan from
    ``owner``'s planning options (``comm``, ``planner``, ``algorithm``,
    ``cost``, ``topology``): what repeated saves of one structure reuse."""
    current: Plan | None = owner._plan
    if current is not None and current.manifest == manifest:
        return current
    return _make_plan(
        manifest,
        owner.comm.size,
        planner=owner.planner,
        algorithm=owner.algorithm,
        cost=owner.cost,
        topology=owner.topology,
    )


@dataclass
class _Prepared:
    leaves: list[FlatLeaf]
    skeleton: Any
    manifest: Manifest
    plan: Plan
    codec: str
    digest: bytes


def _prepare(
    state: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Path,
) -> _Prepared:
    codec = check_codec(compression)
    leaves, skeleton = flatten(state)
    check_has_data(leaves)
    manifest = Manifest.from_leaves([describe_leaf(leaf) for leaf in leaves])
    plan = plan_for(manifest)
    h = hashlib.sha256()
    h.update(plan.fingerprint.encode())
    h.update(plan.assignment_digest().encode())
    h.update(manifest.fingerprint.encode())
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    h.update(codec.encode())
    h.update(os.path.abspath(directory).encode())
    return _Prepared(leaves, skeleton, manifest, plan, codec, h.digest())


def _agree_prepared(c: Comm, err: BaseException | None, prep: _Prepared | None) -> _Prepared:
    """Every rank raises if any failed to prepare, or if ranks disagree on
    the state's structure, plan, codec or directory (nothing written yet)."""
    digests = _agree(c, err, prep.digest if prep else b"")
    assert prep is not None
    if len(set(digests)) != 1:
        groups: dict[bytes, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        desc = "; ".join(f"ranks {v}" for v in groups.values())
        raise StateMismatchError(
            "ranks disagree on the state's structure, its plan, the codec or the directory "
            f"(groups of agreeing ranks: {desc}); nothing was written"
        )
    return prep


# ----------------------------------------------------------------------------
# Replica check.


class ReplicaMismatchError(StateMismatchError):
    """The ranks' copies of the replicated state differ (``verify_replicas``)."""


def _leaf_buffer(leaf: FlatLeaf) -> U8 | memoryview:
    if leaf.tensor is None:
        assert leaf.encoded is not None
        return memoryview(leaf.encoded)
    return _u8_view(_readable(leaf.tensor))


def _verify_replicas(c: Comm, prep: _Prepared) -> None:
    """Hashes every leaf on every rank (BLAKE3 in the Rust core, GIL
    released) and compares one digest of them all across the ranks in one
    collective. If they differ, the per-leaf digests are exchanged and
    every rank raises :class:`ReplicaMismatchError` naming the leaves whose
    copies differ and the ranks that differ from the majority."""
    from deeppart._planner import differing_leaves, replica_digests

    err: BaseException | None = None
    digests = b""
    try:
        views = [_leaf_buffer(leaf) for leaf in prep.leaves]
        buffers = [v.data if isinstance(v, np.ndarray) else v for v in views]
        digests = replica_digests(buffers, max(1, (os.cpu_count() or 1) // c.size))
    except Exception as e:
        err = e
    summary = hashlib.blake2b(digests, digest_size=16).digest()
    rows = _agree(c, err, summary, width=16)
    if len(set(rows)) == 1:
        return
    per_rank = c.allgather_varbytes(digests)
    differ = differing_leaves(per_rank, len(prep.leaves))
    shown = "; ".join(
        f"{'/'.join(map(str, prep.leaves[i].path))}: rank(s) {', '.join(map(str, ranks))}"
        for i, ranks in differ[:10]
    )
    more = f" (and {len(differ) - 10} more leaves)" if len(differ) > 10 else ""
    raise ReplicaMismatchError(
        f"verify_replicas: {len(differ)} leaves differ between the ranks' replicas "
        f"(each with the ranks that differ from the majority): {shown}{more}; "
        "nothing was written"
    )


# ----------------------------------------------------------------------------
# Save.

#: Columns of a rank's piece records: offset, raw length, stored length,
#: xxh3_64, codec index.
_REC = 5


#: Bytes per write() call. One huge write() of a large tensor was measured
#: slower here than the same bytes in chunks (bench/checkpoint.py's raw
#: ceiling writes in the same chunks).
WRITE_CHUNK = 8 << 20


def _write_chunked(f: Any, data: bytes | memoryview) -> None:
    view = memoryview(data)
    for start in range(0, len(view), WRITE_CHUNK):
        f.write(view[start : start + WRITE_CHUNK])


def _write_pieces(
    path: Path,
    rank: int,
    prep: _Prepared,
    level: int,
    progress: Progress,
    staging: _staging.Staging | None = None,
) -> tuple[npt.NDArray[np.uint64], int]:
    """Writes this rank's data file; returns its piece records and size.
    Pieces of device tensors pass through ``staging`` in bounded chunks."""
    stage = staging if staging is not None else _staging.Staging()
    on_device: dict[int, Any] = {}
    pieces = prep.plan.rank_pieces(rank)
    records = np.zeros((len(pieces), _REC), dtype=np.uint64)
    views: dict[int, tuple[U8, int]] = {}
    codec_index = CODECS.index(prep.codec)
    with open(path, "wb") as f:
        f.write(header_bytes(rank, prep.plan.world_size, prep.plan.fingerprint))
        pos = end = HEADER_SIZE
        for k, (li, start, stop) in enumerate(pieces):
            leaf = prep.leaves[li]
            if leaf.tensor is not None and _staging.needs_staging(leaf.tensor):
                if li not in on_device:
                    on_device[li] = _staging.device_bytes(leaf.tensor)
                isz = leaf.tensor.element_size()
                chunks = stage.read(on_device[li], start * isz, stop * isz)
                if not codec_index:
                    # Raw: streamed from the host buffer, checksummed on the way.
                    f.seek(pos)
                    n, xxh = _staging.write_stream(f, chunks)
                    end = pos + n if n else end
                    records[k] = (pos, n, n, xxh, 0)
                    pos = align_up(pos + n)
                    progress.advance(n)
                    continue
                # A codec needs the whole piece: staged whole (see deeppart.staging).
                whole = np.empty((stop - start) * isz, dtype=np.uint8)
                at = 0
                for chunk in chunks:
                    whole[at : at + chunk.size] = chunk
                    at += chunk.size
                raw, itemsize = whole.data, isz
            elif leaf.tensor is not None:
                if li not in views:
                    t = _readable(leaf.tensor)
                    views[li] = (_u8_view(t), t.element_size())
                arr, itemsize = views[li]
                raw = arr[start * itemsize : stop * itemsize].data
            else:
                assert leaf.encoded is not None
                itemsize = 1
                raw = memoryview(leaf.encoded)
            data: bytes | memoryview = raw
            used = 0
            if codec_index and len(raw):
                limit = max_expansion("tensor" if leaf.tensor is not None else "object")
                packed = compress(prep.codec, raw, itemsize, level, limit)
                if len(packed) < len(raw):
                    data, used = packed, codec_index
            if len(data):
                if f.tell() != pos:
                    f.seek(pos)
                _write_chunked(f, data)
                end = pos + len(data)
            records[k] = (pos, len(raw), len(data), checksum(data), used)
            pos = align_up(pos + len(data))
            progress.advance(len(raw))
        f.truncate(end)
        size = end
        f.flush()
        os.fsync(f.fileno())
    return records, size


def _metadata_head(prep: _Prepared, codec: str) -> dict[str, Any]:
    """The keys of ``metadata.json`` that describe the state and its plan."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_unix": time.time(),
        "world_size": prep.plan.world_size,
        "algorithm": prep.plan.algorithm,
        "plan_fingerprint": prep.plan.fingerprint,
        "manifest_fingerprint": prep.manifest.fingerprint,
        "manifest": json.loads(prep.manifest.to_json()),
        "skeleton": prep.skeleton,
        "compression": codec,
        "checksum": "xxh3_64",
    }


def _metadata_json(
    prep: _Prepared,
    records: npt.NDArray[np.uint64],
    user: Any,
    extra: dict[str, Any] | None = None,
) -> bytes:
    world = prep.plan.world_size
    counts = [len(prep.plan.rank_pieces(r)) for r in range(world)]
    rows: list[list[Any]] = []
    file_sizes: list[int] = []
    pos = 0
    raw_total = stored_total = 0
    for r in range(world):
        block = records[pos : pos + counts[r] * _REC + 1]
        pos += counts[r] * _REC + 1
        recs = block[:-1].reshape(-1, _REC)
        file_sizes.append(int(block[-1]))
        for (li, start, stop), rec in zip(prep.plan.rank_pieces(r), recs, strict=True):
            off, length, stored, xxh, ci = (int(x) for x in rec)
            rows.append([li, start, stop, r, off, length, stored, CODECS[ci], xxh])
            raw_total += length
            stored_total += stored
    meta = {
        **_metadata_head(prep, prep.codec),
        "alignment": HEADER_SIZE,
        "raw_bytes": raw_total,
        "stored_bytes": stored_total,
        "file_sizes": file_sizes,
        "piece_fields": list(PIECE_FIELDS),
        "pieces": rows,
        "user": user,
        **(extra or {}),
    }
    return json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()


def _commit_dir(tmp: Path, final: Path, meta: bytes) -> None:
    """Rank 0's commit of a written temporary directory ``tmp`` as ``final``:
    metadata.json, fsyncs, rename (a replaced ``final`` is moved aside,
    still committed, and removed only after the new marker), then the
    COMMITTED marker, written last."""
    write_durable(tmp / METADATA, meta)
    fsync_dir(tmp)
    old: Path | None = None
    if final.exists():
        # Moved aside still committed: if this save dies before its marker,
        # load() serves the previous checkpoint from there.
        old = final.parent / f".old-{final.name}-{os.urandom(6).hex()}"
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    write_durable(final / MARKER, marker_text(meta))
    fsync_dir(final)
    if old is not None:
        remove_tree(old)


def save(
    state: Any,
    directory: str | os.PathLike[str],
    *,
    comm: Any = None,
    planner: Any = None,
    compression: str | None = None,
    algorithm: str | None = None,
    plan: Plan | None = None,
    level: int = 1,
    cost: Any = None,
    topology: Any = None,
    overwrite: bool = False,
    user: Any = None,
    progress: bool | None = None,
    verbose: bool = False,
    staging_bytes: int | None = None,
    verify_replicas: bool = False,
    _plan_for: Callable[[Manifest], Plan] | None = None,
) -> Stats:
    """Saves ``state`` (the same on every rank) to ``directory``, every rank
    writing its planned share. Collective: call it on every rank of ``comm``.

    ``planner``: None (plan in process) or the planner service to ask (see
    :func:`deeppart.resolve_planner`); ``algorithm``, ``cost``, ``topology``:
    the planning options; ``plan``: a ready :class:`deeppart.Plan` of this
    state for this world size instead. ``compression``: None,
    ``"zstd"``, ``"lz4"`` or ``"shuffle-zstd"``; ``level``: the Zstandard
    level (1: fast; ratios on float data barely improve above). ``user``: a plain value
    stored in the metadata. ``staging_bytes``: the host buffer through which
    pieces of device (e.g. CUDA) tensors are copied, in chunks (default
    :data:`deeppart.staging.DEFAULT_STAGING_BYTES`, 64 MiB). Returns the
    save's :class:`Stats` (the same on every rank); rank 0 prints its
    summary when ``verbose``. ``verify_replicas``: first check that every
    rank holds the same state (a hash of each leaf on every rank, compared
    in one collective); if not, raise :class:`ReplicaMismatchError` on every
    rank, naming the differing leaves and ranks, and write nothing.
    """
    c = resolve(comm)
    t0 = time.perf_counter()
    final = Path(directory)
    err: BaseException | None = None
    prep: _Prepared | None = None
    try:
        from deeppart.state import encode_plain

        if user is not None:
            encode_plain(user, ("<user>",))
        if _plan_for is None:

            def _plan_for(m: Manifest) -> Plan:
                return _make_plan(
                    m,
                    c.size,
                    plan=plan,
                    planner=planner,
                    algorithm=algorithm,
                    cost=cost,
                    topology=topology,
                )

        prep = _prepare(state, compression, _plan_for, final)
    except Exception as e:
        err = e
    prep = _agree_prepared(c, err, prep)
    if verify_replicas:
        _verify_replicas(c, prep)

    # Rank 0 makes the temporary directory.
    tmp_name = b""
    if c.rank == 0:
        try:
            if final.exists() and not overwrite and is_committed(final):
                raise CheckpointError(
                    f"{final}: a committed checkpoint exists "
                    "(overwrite=False; pass overwrite=True to replace it)"
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            nonce = os.urandom(6).hex()
            tmp_name = f".tmp-{final.name}-{nonce}".encode()
            (final.parent / tmp_name.decode()).mkdir()
        except Exception as e:
            err = e
    names = _agree(c, err, tmp_name, width=len(".tmp--") + 12 + 255)
    # Every rank leaves that agreement at about the same moment: a rank's
    # time in save() is its time before it plus the common time after it.
    t_sync = time.perf_counter()
    before_sync = t_sync - t0
    tmp = final.parent / names[0].rstrip(b"\0").decode()

    # Every rank writes its pieces.
    mine = prep.plan.rank_bytes()[c.rank]
    prog = Progress("save", mine, enabled=progress if c.rank == 0 else False)
    local = np.zeros(1, dtype=np.uint64)
    try:
        stage = _staging.Staging(staging_bytes)
        records, size = _write_pieces(
            tmp / data_file_name(c.rank), c.rank, prep, level, prog, staging=stage
        )
        local = np.concatenate([records.reshape(-1), np.array([size], dtype=np.uint64)])
    except Exception as e:
        err = e
    finally:
        prog.close()
    try:
        _agree(c, err)
    except BaseException:
        if c.rank == 0:
            remove_tree(tmp)
        raise
    counts = [len(prep.plan.rank_pieces(r)) * _REC + 1 for r in range(c.size)]
    gathered = c.gatherv_u64(local, counts, root=0)

    # Rank 0 commits: metadata, fsyncs, rename, marker.
    stored_total = 0
    if c.rank == 0:
        assert gathered is not None
        try:
            meta = _metadata_json(prep, gathered, user)
            stored_total = int(json.loads(meta)["stored_bytes"])
            _commit_dir(tmp, final, meta)
        except Exception as e:
            err = e
            remove_tree(tmp)
    rows = _agree(c, err, struct.pack("<dQ", before_sync, stored_total), width=16)
    after_sync = time.perf_counter() - t_sync
    rank_seconds = [struct.unpack("<dQ", row[:16])[0] + after_sync for row in rows]
    seconds = max(rank_seconds)
    raw_total = prep.manifest.total_bytes
    stats = Stats(
        op="save",
        directory=str(final),
        world_size=c.size,
        raw_bytes=raw_total,
        stored_bytes=struct.unpack("<dQ", rows[0][:16])[1],
        seconds=seconds,
        rank_seconds=rank_seconds,
        codec=prep.codec,
    )
    _last_stats["save"] = stats
    if verbose and c.rank == 0:
        print(stats.summary(), flush=True)
    return stats


# ----------------------------------------------------------------------------
# Load.


def _assign_readers(file_bytes: list[int], readers: int) -> list[int]:
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
class _Target:
    """Where a leaf's bytes go: a flat uint8 view of the tensor to return
    (``tensor``), possibly a staging tensor copied into ``into`` at the end."""

    buf: U8
    tensor: Any | None
    copy_into: Any | None
    #: A device tensor's flat uint8 view, filled through the staging buffer
    #: (then ``buf`` is empty).
    sink: Any | None = None


def _leaf_infos(meta_raw: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        manifest = Manifest.from_json(json.dumps(meta_raw.get("manifest")))
    except (ManifestError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"metadata: bad manifest: {e}") from e
    return manifest.leaves()


def _read_metadata(directory: Path) -> tuple[Metadata, bytes]:
    text = read_checked_metadata(directory)
    raw = decode_metadata(text)
    # The leaves come from the manifest, checked by the planner's parser.
    raw["leaves"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in lf.items() if v is not None}
        for lf in _leaf_infos(raw)
    ]
    return parse_metadata(raw, _dtype_sizes(raw["leaves"])), hashlib.sha256(text).digest()


@dataclass
class _Into:
    """How the checkpoint's leaves map onto an ``into=`` state."""

    leaves: list[FlatLeaf]
    skeleton: Any
    #: checkpoint leaf index -> into leaf index
    pairs: dict[int, int]
    keys: IncompatibleKeys


def _targets(meta: Metadata, into: Any) -> tuple[list[_Target], _Into | None]:
    """Targets of every leaf, ``into`` (if any) matching the checkpoint exactly."""
    targets, matched = _partial_targets(meta, into)
    full = [t for t in targets if t is not None]
    assert len(full) == len(targets)
    return full, matched


def _partial_targets(
    meta: Metadata, into: Any, selected: list[bool] | None = None, strict: bool = True
) -> tuple[list[_Target | None], _Into | None]:
    """Where each selected leaf's bytes go (None: not read; all leaves are
    selected by default). With ``into``, its leaves are matched with the
    checkpoint's by path."""
    if selected is None:
        selected = [True] * len(meta.leaves)
    dtypes = _dtypes() if any(lf.kind == "tensor" for lf in meta.leaves) else {}
    targets: list[_Target | None] = [None] * len(meta.leaves)
    matched: _Into | None = None
    if into is not None:
        into_leaves, skeleton = flatten(into)
        pairs, keys = match(
            [lf.path for lf in meta.leaves], selected, [lf.path for lf in into_leaves], strict
        )
        matched = _Into(into_leaves, skeleton, pairs, keys)
    for i, info in enumerate(meta.leaves):
        if not selected[i] or (matched is not None and i not in matched.pairs):
            continue
        where = "/".join(map(str, info.path))
        if info.kind == "object":
            if matched is not None and matched.leaves[matched.pairs[i]].tensor is not None:
                raise StateMismatchError(f"into= has a tensor at {where}, the checkpoint a value")
            targets[i] = _Target(np.empty(info.nbytes, dtype=np.uint8), None, None)
            continue
        dtype = dtypes[str(info.dtype)]
        if matched is None:
            t = _torch().empty(info.shape, dtype=dtype)
            targets[i] = _Target(_u8_view(t), t, None)
            continue
        t = matched.leaves[matched.pairs[i]].tensor
        if t is None:
            raise StateMismatchError(f"into= has a value at {where}, the checkpoint a tensor")
        if t.dtype != dtype or list(t.shape) != list(info.shape):
            raise StateMismatchError(
                f"{where}: into= has {t.dtype} {list(t.shape)}, the checkpoint "
                f"{info.dtype} {info.shape}"
            )
        plain = t.is_contiguous() and not t.is_conj() and not t.is_neg()
        if plain and _staging.needs_staging(t):
            sink = _staging.device_bytes(t)
            targets[i] = _Target(np.empty(0, dtype=np.uint8), t, None, sink)
        elif t.device.type == "cpu" and plain:
            targets[i] = _Target(_u8_view(t), t, None)
        else:
            stage = _torch().empty(info.shape, dtype=dtype)
            targets[i] = _Target(_u8_view(stage), t, stage)
    return targets, matched


def _read_file(
    directory: Path,
    meta: Metadata,
    rank: int,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging | None = None,
) -> int:
    """Reads, verifies and decodes the pieces of one data file into
    ``dest(piece)``; returns the bytes read."""
    path = directory / data_file_name(rank)
    try:
        f = open_regular(path)
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot open ({e.strerror})") from e
    with f:
        return _read_pieces(f, path, directory, meta, rank, pieces, dest, progress, staging)


def _read_pieces(
    f: Any,
    path: Path,
    directory: Path,
    meta: Metadata,
    rank: int,
    pieces: list[Piece],
    dest: Callable[[Piece], U8 | _staging.DeviceSink],
    progress: Progress,
    staging: _staging.Staging | None = None,
) -> int:
    """:func:`_read_file` from ``f`` (an open file, or anything with
    ``seek``/``read``/``readinto``, e.g. :class:`io.BytesIO`)."""
    n = 0
    sizes = {i: lf.itemsize for i, lf in enumerate(meta.leaves)}
    check_header(path, f.read(HEADER_SIZE), rank, meta.world_size, meta.plan_fingerprint)
    for p in pieces:
        out = dest(p)
        f.seek(p.offset)
        if isinstance(out, _staging.DeviceSink):
            _read_staged(f, p, out, staging or _staging.Staging(), directory, sizes[p.leaf])
            n += p.stored
            progress.advance(p.length)
            continue
        if p.codec == "none":
            got = f.readinto(out.data)
            if got != p.length:
                raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
            stored: bytes | memoryview = out.data
        else:
            stored = f.read(p.stored)
            if len(stored) != p.stored:
                raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
        if checksum(stored) != p.xxh3:
            raise CorruptCheckpointError(
                f"{p.describe(directory)}: checksum mismatch (xxh3_64)"
            )
        if p.codec != "none":
            try:
                limit = max_expansion(meta.leaves[p.leaf].kind)
                decompress_into(p.codec, stored, out, sizes[p.leaf], limit)
            except CodecError as e:
                raise CorruptCheckpointError(f"{p.describe(directory)}: {e}") from e
        n += p.stored
        progress.advance(p.length)
    return n


def _read_staged(
    f: Any,
    p: Piece,
    sink: _staging.DeviceSink,
    staging: _staging.Staging,
    directory: Path,
    itemsize: int,
) -> None:
    """Reads piece ``p`` (at ``f``'s position) into a device tensor: a raw
    piece chunk by chunk through ``staging``, a compressed one decoded whole
    and then copied in chunks."""
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
    if checksum(stored) != p.xxh3:
        raise CorruptCheckpointError(f"{p.describe(directory)}: checksum mismatch (xxh3_64)")
    try:
        raw = decompress(p.codec, stored, p.length, itemsize)
    except CodecError as e:
        raise CorruptCheckpointError(f"{p.describe(directory)}: {e}") from e
    staging.put(sink, np.frombuffer(raw, dtype=np.uint8))


def _assemble(
    meta: Metadata,
    targets: Sequence[_Target | None],
    path: Path,
    into: _Into | None = None,
    pruned: bool = False,
) -> Any:
    """The state from the filled targets: object leaves decoded, staged
    tensors copied into ``into``'s, the containers rebuilt (``into``'s
    when given, its own values kept at its missing leaves; else the
    checkpoint's, without the leaves not read when ``pruned``)."""
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
                    with _torch().no_grad():
                        tgt.tensor.copy_(tgt.copy_into)
                values.append(tgt.tensor)
        if into is not None:
            mine: list[Any] = [
                lf.tensor if lf.tensor is not None else decode_plain(lf.encoded or b"null")
                for lf in into.leaves
            ]
            for i, j in into.pairs.items():
                mine[j] = values[i]
            return unflatten(into.skeleton, mine)
        state = unflatten(meta.skeleton, values, absent=ABSENT)
        return prune(state) if pruned else state
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: {e}") from e


def _committed_or_replaced(path: Path) -> Path:
    """``path`` itself, unless it is not committed and a save with
    ``overwrite=True`` that was replacing it died before its commit marker:
    then the previous checkpoint, which that save had moved aside still
    committed (``.old-NAME-*``), with a warning."""
    if is_committed(path) or not path.parent.is_dir():
        return path
    prefix = f".old-{path.name}-"
    olds = [
        p for p in path.parent.iterdir() if p.name.startswith(prefix) and is_committed(p)
    ]
    if not olds:
        return path
    previous = max(olds, key=lambda p: (p / MARKER).stat().st_mtime)
    warnings.warn(
        f"{path}: not committed (a save replacing it was interrupted); "
        f"loading the checkpoint it replaced, {previous}",
        stacklevel=3,
    )
    return previous


def load(
    directory: str | os.PathLike[str],
    *,
    comm: Any = None,
    into: Any = None,
    exchange: str = "auto",
    progress: bool | None = None,
    verbose: bool = False,
    staging_bytes: int | None = None,
    keys: Any = None,
    strict: bool = True,
) -> Any:
    """Loads a committed checkpoint on every rank of ``comm`` (any number of
    ranks, also one process without MPI). Collective.

    ``exchange="bcast"``: each rank reads a balanced share of the data files
    and broadcasts it (the file system serves each byte once: right for a
    parallel file system under many nodes).
    ``exchange="read"``: every rank reads every piece itself, with no bulk
    MPI traffic (right when all ranks share one node's page cache, or the
    interconnect or the CPUs are the bottleneck, e.g. oversubscribed ranks).
    ``exchange="auto"`` (default): ``"read"`` when every rank runs on the same
    host and no piece is compressed, else ``"bcast"``; all ranks take the
    same decision. A compressed piece is then decompressed once, by the rank
    that read it, and its raw bytes exchanged: on one host (MPI) through
    memory all its ranks map (a shared window), else by broadcast.

    With ``into`` (a state of the same structure, e.g. ``model.state_dict()``),
    tensors are filled in place (``copy_`` semantics, no second full copy)
    and the returned tree holds those same tensor objects; plain values come
    from the checkpoint. Raises :class:`CheckpointError` (no commit marker,
    missing directory), :class:`CorruptCheckpointError` (bad checksum,
    truncated file, naming the file and piece) or
    :class:`StateMismatchError` (``into`` differs), on every rank.
    ``into`` tensors on a device (e.g. CUDA) are filled through a host
    buffer of ``staging_bytes`` (default 64 MiB), in chunks.

    ``keys``: read only these parts, e.g. ``keys=["model"]`` or
    ``keys=[("optim", "state")]`` (top-level keys or path prefixes): only
    their bytes are read, and the returned tree holds only them.
    ``into`` is matched with the checkpoint by leaf path: with ``strict``
    (default) any missing or extra leaf raises StateMismatchError naming
    them; with ``strict=False`` the common leaves are filled, and
    :func:`last_incompatible_keys` reports the others (as
    ``load_state_dict`` does).
    """
    c = resolve(comm)
    t0 = time.perf_counter()
    path = Path(directory)
    err: BaseException | None = None
    meta: Metadata | None = None
    digest = b""
    owner: list[int] = []
    targets: list[_Target | None] = []
    matched: _Into | None = None
    one_host = True
    if exchange == "auto":
        hosts = c.allgather_varbytes(socket.gethostname().encode())
        one_host = len(set(hosts)) == 1
    read_all = False
    # One host, compressed pieces: the readers decompress into memory that
    # every rank of the host maps (an MPI shared window), not a broadcast.
    via_shared = False
    try:
        try:
            meta, digest = _read_metadata(path)
        except CheckpointError:
            # Only on failure: the common path reads metadata.json once.
            previous = _committed_or_replaced(path)
            if previous == path:
                raise
            path = previous
            meta, digest = _read_metadata(path)
        selected = select([lf.path for lf in meta.leaves], keys)
        targets, matched = _partial_targets(meta, into, selected, strict)
        raw_per_file = [0] * meta.world_size
        for p in meta.pieces:
            if targets[p.leaf] is not None:
                raw_per_file[p.rank] += p.length
        if exchange == "auto":
            # A compressed piece is decompressed once, by the rank that reads
            # it, and its raw bytes broadcast: with "read" every rank would
            # decompress everything.
            compressed = any(p.codec != "none" for p in meta.pieces)
            exchange = "read" if one_host and not compressed else "bcast"
            via_shared = one_host and compressed
        if exchange not in ("bcast", "read"):
            raise ValueError(f"exchange must be 'auto', 'bcast' or 'read', not {exchange!r}")
        read_all = exchange == "read" or c.size == 1
        owner = [c.rank] * meta.world_size if read_all else _assign_readers(raw_per_file, c.size)
        check_file_sizes(path, meta, [f for f in range(meta.world_size) if owner[f] == c.rank])
    except Exception as e:
        err = e
    digests = _agree(c, err, digest)
    assert meta is not None
    if len(set(digests)) != 1:
        raise StateMismatchError(f"{path}: ranks read different metadata.json files")

    by_file: list[list[Piece]] = [[] for _ in range(meta.world_size)]
    for p in meta.pieces:
        if targets[p.leaf] is not None:
            by_file[p.rank].append(p)
    file_raw = [sum(p.length for p in ps) for ps in by_file]
    # A partial load opens only the files holding what it reads.
    partial = keys is not None or (matched is not None and len(matched.pairs) < len(meta.leaves))
    mine = [
        f for f in range(meta.world_size) if owner[f] == c.rank and (by_file[f] or not partial)
    ]
    prog = Progress(
        "load", sum(file_raw[f] for f in mine), enabled=progress if c.rank == 0 else False
    )
    buffers: dict[int, U8] = {}
    nread = 0

    def place(buf: U8, pieces: list[Piece]) -> Callable[[Piece], U8]:
        offsets: dict[int, int] = {}
        pos = 0
        for p in pieces:
            offsets[id(p)] = pos
            pos += p.length
        return lambda p: buf[offsets[id(p)] : offsets[id(p)] + p.length]

    stage = _staging.Staging(staging_bytes)

    def direct(p: Piece) -> U8 | _staging.DeviceSink:
        isz = meta.leaves[p.leaf].itemsize if meta.leaves[p.leaf].kind == "tensor" else 0
        tgt = targets[p.leaf]
        assert tgt is not None
        if isz == 0:
            return tgt.buf
        if tgt.sink is not None:
            return _staging.DeviceSink(tgt.sink, p.start * isz, p.length)
        return tgt.buf[p.start * isz : p.stop * isz]

    shared = None
    if via_shared and not read_all:
        shared = node_shared(c, sum(file_raw[f] for f in mine))
    try:
        if shared is not None:
            # File f's raw bytes: in its reader's segment, after that
            # reader's earlier files.
            ends = [0] * c.size
            for f in range(meta.world_size):
                seg = shared.segments[owner[f]]
                buffers[f] = seg[ends[owner[f]] : ends[owner[f]] + file_raw[f]]
                ends[owner[f]] += file_raw[f]
        try:
            for f in mine:
                if read_all:
                    nread += _read_file(path, meta, f, by_file[f], direct, prog, stage)
                else:
                    buf = buffers.setdefault(f, np.empty(file_raw[f], dtype=np.uint8))
                    nread += _read_file(path, meta, f, by_file[f], place(buf, by_file[f]), prog)
        except Exception as e:
            err = e
        finally:
            prog.close()
        _agree(c, err)  # also: every reader has filled its shared segment

        if not read_all:
            for f in range(meta.world_size):
                if file_raw[f] == 0:
                    continue
                buf = buffers.pop(f) if f in buffers else np.empty(file_raw[f], dtype=np.uint8)
                if shared is None:
                    c.bcast_u8(buf, root=owner[f])
                src = place(buf, by_file[f])
                for p in by_file[f]:
                    out = direct(p)
                    if isinstance(out, _staging.DeviceSink):
                        stage.put(out, src(p))
                    else:
                        out[:] = src(p)
                del buf
    finally:
        if shared is not None:
            buffers.clear()
            c.barrier()  # nobody still copies out of another rank's segment
            shared.close()

    state = _assemble(meta, targets, path, matched, keys is not None)
    if matched is not None:
        _last_keys[:] = [matched.keys]
    t_local = time.perf_counter() - t0
    rows = c.allgather_f64(np.array([t_local, float(nread)], dtype=np.float64))
    raw_total = sum(file_raw)
    stats = Stats(
        op="load",
        directory=str(path),
        world_size=c.size,
        raw_bytes=raw_total,
        stored_bytes=int(rows[:, 1].sum()),
        seconds=float(rows[:, 0].max()),
        rank_seconds=[float(x) for x in rows[:, 0]],
        codec=str(meta.raw.get("compression", "none")),
    )
    _last_stats["load"] = stats
    if verbose and c.rank == 0:
        print(stats.summary(), flush=True)
    return state


# ----------------------------------------------------------------------------
# Repeated saves in a training loop.


class Checkpointer:
    """Numbered checkpoints ``ROOT/step-00000100`` in one root directory.

    ``save(step, state)`` reuses the plan while the state's structure stays
    the same; ``keep_last`` old committed checkpoints are kept (older ones
    and leftovers of interrupted saves are removed only after the new one is
    committed); ``latest()`` is the newest committed step; ``load(step)``.

    With ``async_=True``, ``save`` returns an :class:`deeppart.AsyncSave`
    as soon as the state is copied to host memory (at most
    ``max_staging_bytes`` of tensors, else it saves synchronously with a
    warning) and writes it in a background thread; the next ``save``,
    ``load``, ``wait`` or ``close`` first waits for it and raises its error,
    if nobody has seen it yet (docs/ASYNC.md). ``staging_bytes``: the host
    buffer for device tensors (see :func:`save`).
    """

    PREFIX = "step-"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        comm: Any = None,
        keep_last: int | None = None,
        compression: str | None = None,
        level: int = 1,
        planner: Any = None,
        algorithm: str | None = None,
        cost: Any = None,
        topology: Any = None,
        exchange: str = "auto",
        progress: bool | None = None,
        verbose: bool = False,
        staging_bytes: int | None = None,
        async_: bool = False,
        max_staging_bytes: int | None = None,
        config: Any = None,
        backend: str = "auto",
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if config is not None and async_:
            raise ValueError("async_=True is not supported with config= (multi-level storage)")
        self.root = Path(root)
        self.comm = resolve(comm)
        self.keep_last = keep_last
        self.compression = check_codec(compression)
        self.level = level
        self.planner = planner
        self.algorithm = algorithm
        self.cost = cost
        self.topology = topology
        self.exchange = exchange
        self.progress = progress
        self.verbose = verbose
        self.staging_bytes = staging_bytes
        self._plan: Plan | None = None
        self._async: AsyncCheckpointer | None = None
        if async_:
            from deeppart.async_save import AsyncCheckpointer

            self._async = AsyncCheckpointer(self, max_staging_bytes)
        #: Multi-level storage (docs/LEVELS.md): with ``config=`` (a
        #: LevelConfig or an FTI-style INI path), save/latest/load go through
        #: a LevelBackend and ``root`` is unused; ``last_recovery`` is the
        #: RecoveryReport of the latest load.
        self.levels: LevelBackend | None = None
        self.last_recovery: RecoveryReport | None = None
        if config is not None:
            from deeppart.levels import open_backend

            self.levels = open_backend(
                config,
                self.comm,
                backend,
                compression=compression,
                zstd_level=level,
                planner=planner,
                algorithm=algorithm,
                cost=cost,
                topology=topology,
                keep=keep_last,
                exchange=exchange,
                verbose=verbose,
            )

    def path(self, step: int) -> Path:
        return self.root / f"{self.PREFIX}{step:08d}"

    def _step_of(self, name: str) -> int | None:
        """The step a directory name holds: ``step-N`` or ``.old-step-N-<hex>``
        (a committed checkpoint moved aside by an interrupted overwrite)."""
        if name.startswith(".old-") and len(name) > len(".old--") + 12 and name[-13] == "-":
            name = name[len(".old-") : -13]
        return step_number(name, self.PREFIX)

    def steps(self) -> list[int]:
        """Committed steps, oldest first: also a step whose committed copy
        sits in ``.old-step-N-*`` because a save replacing it was
        interrupted (:meth:`load` serves that copy)."""
        out: set[int] = set()
        if not self.root.is_dir():
            return []
        for child in self.root.iterdir():
            step = self._step_of(child.name)
            if step is not None and step not in out and is_committed(child):
                out.add(step)
        return sorted(out)

    def latest(self) -> int | None:
        if self.levels is not None:
            return self.levels.latest()
        steps = self.steps()
        return steps[-1] if steps else None

    def _plan_for(self, manifest: Manifest) -> Plan:
        self._plan = _reuse_plan(self, manifest)
        return self._plan

    def save(
        self, step: int, state: Any, *, user: Any = None, overwrite: bool = False
    ) -> Stats | AsyncSave | LevelSaveStats:
        """Saves ``state`` as ``step`` (collective). A step that is already
        committed is refused with :class:`CheckpointError`, as
        :func:`deeppart.save` refuses an existing checkpoint, unless
        ``overwrite=True`` (the old one stays loadable until the new one
        commits). With ``config=`` the level backend re-saves a step as FTI
        does."""
        if self.levels is not None:
            return self.levels.save(step, state)
        kwargs: dict[str, Any] = {
            "compression": self.compression,
            "level": self.level,
            "overwrite": overwrite,
            "user": {"step": step, "user": user},
            "progress": self.progress,
            "verbose": self.verbose,
            "staging_bytes": self.staging_bytes,
            "_plan_for": self._plan_for,
        }
        if self._async is not None:
            return self._async.save(step, state, kwargs)
        stats = save(state, self.path(step), comm=self.comm, **kwargs)
        # The save succeeded everywhere: a failed cleanup is a warning on
        # every rank (one small collective), never one rank's exception.
        problem = self._cleanup_or_warn(step, warn=False) if self.comm.rank == 0 else ""
        message = self.comm.allgather_varbytes(problem.encode())[0].decode()
        if message:
            warnings.warn(message, stacklevel=2)
        return stats

    def _cleanup_or_warn(self, newest: int, *, warn: bool = True) -> str:
        """Runs :meth:`_cleanup`; returns what failed ("" if nothing), and
        also warns with it if ``warn``."""
        try:
            failures = self._cleanup(newest)
        except OSError as e:
            failures = [f"{self.root}: cannot list ({e})"]
        if not failures:
            return ""
        message = (
            f"{self.root}: step {newest} is committed, but removing old checkpoints failed: "
            + "; ".join(failures)
        )
        if warn:
            warnings.warn(message, stacklevel=2)
        return message

    def _cleanup(self, newest: int) -> list[str]:
        """Removes the steps beyond ``keep_last`` and leftovers of
        interrupted saves; returns one line per directory it failed to
        remove. A committed ``.old-step-N-*`` stays while it is the only
        committed copy of step N (unless step N itself is pruned)."""
        committed = self.steps()
        pruned = set(committed[: -self.keep_last]) if self.keep_last is not None else set()
        doomed: list[Path] = []
        for child in self.root.iterdir():
            name = child.name
            step = self._step_of(name)
            if name.startswith(".tmp-"):
                doomed.append(child)
            elif name.startswith(".old-"):
                if (step is not None and step in pruned) or self._superseded(child):
                    doomed.append(child)
            elif step is not None and (
                step in pruned or (step < newest and not is_committed(child))
            ):
                doomed.append(child)
        failures: list[str] = []
        for d in doomed:
            try:
                remove_tree(d)
            except OSError as e:
                failures.append(f"{d}: {e.strerror or e}")
        return failures

    def _superseded(self, child: Path) -> bool:
        """Whether ``child`` is a ``.old-NAME-<12 hex>`` directory that may
        go: uncommitted, or NAME is committed again. A committed one whose
        replacement never committed is the only copy of that step
        (:func:`load` serves it) and stays."""
        name = child.name
        if not name.startswith(".old-") or len(name) < len(".old--") + 12:
            return False
        if not is_committed(child):
            return True
        return is_committed(child.parent / name[len(".old-") : -13])

    def wait(self) -> Stats | None:
        """Waits for the asynchronous save in flight, if any; returns its
        Stats, or raises its error if nobody has seen it yet."""
        return self._async.wait() if self._async is not None else None

    def close(self) -> None:
        """Waits for the asynchronous save in flight (see :meth:`wait`)."""
        self.wait()
        if self.levels is not None:
            self.levels.close()

    def load(
        self, step: int | None = None, *, into: Any = None, keys: Any = None, strict: bool = True
    ) -> Any:
        """Loads ``step`` (default: the latest); ``keys``/``strict`` as in :func:`load`."""
        self.wait()
        if self.levels is not None:
            if keys is not None or not strict:
                raise ValueError("keys= and strict=False are not supported with config=")
            state, self.last_recovery = self.levels.load(step, into=into)
            return state
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"{self.root}: no committed checkpoint")
        return load(
            self.path(step),
            comm=self.comm,
            into=into,
            exchange=self.exchange,
            progress=self.progress,
            verbose=self.verbose,
            staging_bytes=self.staging_bytes,
            keys=keys,
            strict=strict,
        )
