"""The load stages of sharded tensors: resharding, and a cooperative read.

A checkpoint's sharded tensors (``metadata.json``'s ``dtensors`` records,
:mod:`deeppart.regions`) are loaded apart from its other leaves, into
whatever the caller holds at their path:

- a DTensor of any mesh and placements (another mesh or world size than
  the save's): its local shard is filled, the region of the global tensor
  that its placements give this rank;
- a plain tensor of the global shape (``into=`` a full state dict, or one
  process): the whole tensor;
- nothing (no ``into=``): a new full tensor.

A plain tensor leaf of the checkpoint that ``into=`` holds as a DTensor is
resharded the same way (as one shard covering the tensor).

The stages, which :func:`deeppart.load` runs beside the others:

1. :func:`shard_targets` (local): what this rank needs, as regions;
2. :func:`plan_shard_reads` (two allgathers, O(DTensors) bytes:
   :mod:`deeppart.loading.needs`): every rank's regions; each
   stored piece that some rank needs is read by exactly one of the ranks
   that need it (the least loaded so far), so storage serves each byte once
   per job, not once per replica (cooperative: ``exchange="bcast"``, and
   ``"auto"`` across hosts); or, on one host (``"auto"``, ``"read"``), by
   each rank that needs it, and nothing is exchanged;
3. :func:`read_shards`: each rank reads its pieces (checksums verified,
   decoded), only the pieces whose rows meet a needed region;
4. :func:`exchange_shards`: a piece that other ranks need too is sent
   from its reader to each of them, point to point (only the ranks that
   need a piece receive it: a replica group exchanges among itself), and
   each of them receives only the rows of the piece that its regions take
   (:class:`Part`; the reader verified the whole piece when it read it);
5. :func:`fill_shards`: each rank copies the intersections of the stored
   shards with its regions into its tensors.
"""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deeppart.comm import Comm
from deeppart.errors import CorruptCheckpointError, StateMismatchError
from deeppart.format import (
    HEADER_SIZE,
    Metadata,
    Piece,
    check_header,
    data_file_name,
)
from deeppart.loading.needs import NeedSpec, RegionIndex, exchange_needs
from deeppart.loading.reader import FirstError, decode_piece, read_file
from deeppart.progress import Progress
from deeppart.regions import DTensorRecord, Region, ShardRecord
from deeppart.state.dtensor import Layout
from deeppart.state.restore import describe, refuse_meta, select
from deeppart.state.state import Flat, flatten, is_dtensor
from deeppart.state.tensors import (
    U8,
    on_meta,
    torch_dtypes,
    torch_module,
    u8_view,
    written_in_place,
)
from deeppart.storage.files import CheckpointDir, check_file_sizes, open_data

__all__ = [
    "ShardReads",
    "ShardTargets",
    "exchange_shards",
    "fill_shards",
    "local_shard_reads",
    "plan_shard_reads",
    "read_held_shards",
    "read_shards",
    "shard_slot",
    "shard_targets",
]

#: The most bytes one broadcast of the exchange carries (a longer piece
#: goes alone, chunked by the communicator).
MESSAGE_BYTES = 16 << 20


@dataclass
class Need:
    """A region of one sharded tensor that this rank fills, and where."""

    path: tuple[Any, ...]
    region: Region
    #: A tensor of the region's shape (a DTensor's local tensor, a full tensor).
    dest: Any
    #: The new full tensor when there is no ``into=`` (None otherwise).
    value: Any = None
    #: A DTensor's layout, which the region comes from (the exchange
    #: describes the need by it: :mod:`deeppart.loading.needs`).
    layout: Layout | None = None
    #: The need is the whole tensor.
    full: bool = False


@dataclass
class ShardTargets:
    """What this rank needs of the checkpoint's sharded tensors."""

    needs: list[Need] = field(default_factory=list)
    #: Checkpoint leaves loaded here, not by the plain stages.
    leaves: set[int] = field(default_factory=set)
    #: ``into=`` leaves (indices of ``flatten(into)``) filled here.
    into_leaves: set[int] = field(default_factory=set)
    #: Whether the checkpoint or ``into=`` has sharded tensors at all (all
    #: ranks take the same decision: the collective stages run only then).
    active: bool = False


def _record_of_leaf(meta: Metadata, i: int) -> DTensorRecord:
    info = meta.leaves[i]
    whole = ShardRecord(i, Region.full(info.shape))
    return DTensorRecord(list(info.path), str(info.dtype), list(info.shape), [whole])


def _records(meta: Metadata) -> dict[tuple[Any, ...], DTensorRecord]:
    return {tuple(r.path): r for r in meta.dtensors}


def shard_targets(
    meta: Metadata, into: Any, keys: Any, strict: bool, flat: Flat | None = None
) -> ShardTargets:
    """This rank's needs (local; raises StateMismatchError when ``into=``
    does not fit the checkpoint's sharded tensors). ``flat``:
    ``flatten(into)``, when the caller has it already."""
    out = ShardTargets()
    for r in meta.dtensors:
        out.leaves.update(s.leaf for s in r.shards)
    into_leaves = [] if into is None else (flat if flat is not None else flatten(into))[0]
    dtensor_into = [j for j, lf in enumerate(into_leaves) if is_dtensor(lf.tensor)]
    out.active = bool(meta.dtensors) or bool(dtensor_into)
    if not out.active:
        return out
    selected = select([lf.path for lf in meta.leaves], keys)
    by_path = {tuple(lf.path): i for i, lf in enumerate(meta.leaves)}
    records = _records(meta)
    chosen: list[DTensorRecord] = [
        r
        for r in meta.dtensors
        if any(selected[s.leaf] and s.leaf not in meta.skip for s in r.shards)
    ]
    # Plain tensors of the checkpoint that into= holds as DTensors.
    for j in dtensor_into:
        i = by_path.get(tuple(into_leaves[j].path))
        wanted = i is not None and selected[i] and i not in meta.skip
        if wanted and tuple(into_leaves[j].path) not in records:
            assert i is not None
            if meta.leaves[i].kind != "tensor":
                raise StateMismatchError(
                    f"{describe(into_leaves[j].path)}: into= has a DTensor, the checkpoint a value"
                )
            chosen.append(_record_of_leaf(meta, i))
            out.leaves.add(i)
    where = {tuple(lf.path): j for j, lf in enumerate(into_leaves)}
    meta_paths: list[str] = []
    dtypes = torch_dtypes()
    torch = torch_module()
    for rec in chosen:
        path = tuple(rec.path)
        if into is None:
            t = torch.empty(rec.shape, dtype=dtypes[rec.dtype])
            out.needs.append(Need(path, Region.full(rec.shape), t, t, full=True))
            continue
        found = where.get(meta.aliases.get(path, path))
        if found is None:
            if strict:
                raise StateMismatchError(
                    f"into= has no {describe(path)!r}, which the checkpoint holds (a sharded "
                    "tensor); pass strict=False to skip it, or keys=[...] to read a part"
                )
            continue
        j = found
        t = into_leaves[j].tensor
        if t is None:
            raise StateMismatchError(
                f"{describe(path)}: into= has a value, the checkpoint a tensor"
            )
        if list(t.shape) != rec.shape or str(t.dtype).removeprefix("torch.") != rec.dtype:
            raise StateMismatchError(
                f"{describe(path)}: into= has {t.dtype} {list(t.shape)}, the checkpoint "
                f"{rec.dtype} {rec.shape} (global shapes); load into a model of the same "
                "architecture"
            )
        out.into_leaves.add(j)
        if on_meta(into_leaves[j]):
            meta_paths.append(describe(path))
        if is_dtensor(t):
            from deeppart.state.dtensor import holder_layout, local_region

            region = local_region(t, path)
            out.needs.append(Need(path, region, t._local_tensor, layout=holder_layout(t, path)))
        else:
            out.needs.append(Need(path, Region.full(rec.shape), t, full=True))
    refuse_meta(meta_paths)
    return out


@dataclass
class Direct:
    """Bytes ``[lo, hi)`` of a stored shard leaf (row-major), read from the
    file straight into ``dest`` (a tensor's memory, ``hi - lo`` bytes)."""

    lo: int
    hi: int
    dest: U8


def _direct_ranges(meta: Metadata, shard: ShardRecord, needs: list[Need]) -> list[Direct] | None:
    """Where each of ``needs`` takes whole rows of ``shard`` (the common
    box spans every index of the other dimensions, in the shard and in the
    need's contiguous CPU tensor): the byte ranges, disjoint and sorted;
    None when some need takes anything else (then the shard is read into a
    buffer and its intersections copied, :func:`fill_shards`)."""
    info = meta.leaves[shard.leaf]
    isz = info.itemsize
    out: list[Direct] = []
    for need in needs:
        common = shard.region.intersect(need.region)
        if common is None:
            continue
        dest = need.dest
        if (
            dest.device.type != "cpu"
            or not dest.is_contiguous()
            or dest.is_conj()
            or (dest.is_neg())
        ):
            return None
        if not shard.region.runs:  # a 0-d tensor
            out.append(Direct(0, isz, u8_view(dest)))
            continue
        ss, ds = shard.region.spans(common), need.region.spans(common)
        sshape, dshape = shard.region.shape, need.region.shape
        if (
            ss[0] is None
            or ds[0] is None
            or any(
                ss[d] != (0, sshape[d]) or ds[d] != (0, dshape[d]) for d in range(1, len(sshape))
            )
        ):
            return None
        row = isz
        for n in sshape[1:]:
            row *= n
        (s0, s1), (d0, d1) = ss[0], ds[0]
        out.append(Direct(s0 * row, s1 * row, u8_view(dest)[d0 * row : d1 * row]))
    out.sort(key=lambda d: d.lo)
    if any(a.hi > b.lo for a, b in itertools.pairwise(out)):
        return None
    return out


@dataclass(frozen=True)
class Part:
    """The bytes ``[lo, hi)`` of a stored piece's raw bytes that one rank
    receives from the piece's reader: the piece's rows that its needed
    regions meet (where a region cuts a row's columns, the whole row goes,
    and so do the rows between two regions that meet the piece)."""

    piece: Piece
    lo: int
    hi: int

    @property
    def length(self) -> int:
        return self.hi - self.lo


def _part(
    meta: Metadata, shard: ShardRecord, p: Piece, span: Region, regions: list[Region]
) -> Part:
    """What a needer whose regions of the tensor are ``regions`` takes of
    piece ``p`` of ``shard`` (``span``: the rows it spans): the element
    range of the rows that the regions meet, within the piece; the whole
    piece where those rows are not consecutive in the shard
    (``_StridedShard``) or the tensor has no rows."""
    whole = Part(p, 0, p.length)
    shape = shard.region.shape
    row = 1
    for n in shape[1:]:
        row *= n
    if not shape or row == 0:
        return whole
    lo, hi = p.stop, p.start
    for region in regions:
        common = region.intersect(span)
        if common is None:
            continue
        rows = shard.region.spans(common)[0]
        if rows is None:
            return whole
        lo, hi = min(lo, max(rows[0] * row, p.start)), max(hi, min(rows[1] * row, p.stop))
    if lo >= hi:
        return whole
    isz = meta.leaves[p.leaf].itemsize
    return Part(p, (lo - p.start) * isz, (hi - p.start) * isz)


@dataclass
class ShardReads:
    """Who reads which stored piece of the sharded tensors, and who needs it."""

    targets: ShardTargets
    records: dict[tuple[Any, ...], DTensorRecord]
    #: The pieces this rank reads, by data file.
    mine: dict[int, list[Piece]] = field(default_factory=dict)
    #: Per (reader, needer) pair of distinct ranks: the parts of pieces
    #: the reader sends to that needer, in plan order (the same on every rank).
    sends: dict[tuple[int, int], list[Part]] = field(default_factory=dict)
    #: The pieces this rank needs (read or received).
    needed: set[int] = field(default_factory=set)
    #: This rank's bytes of the needed shard leaves, by leaf.
    buffers: dict[int, U8] = field(default_factory=dict)
    #: Raw bytes of all pieces read by some rank.
    total_raw: int = 0
    #: Raw bytes of the pieces this rank reads.
    read_raw: int = 0
    #: Bytes this rank received in the exchange (set by exchange_shards).
    received: int = 0
    #: Shard leaves read straight into this rank's tensors (``read_own``,
    #: raw pieces, rows that are whole in both): no buffer, no copy after.
    direct: dict[int, list[Direct]] = field(default_factory=dict)
    #: ``held``: the bytes of the pieces this rank sends but does not need
    #: itself, by ``id(piece)`` (:func:`read_held_shards`).
    held: dict[int, U8] = field(default_factory=dict)

    def raw_bytes(self, meta: Metadata) -> int:
        """Raw bytes of the stored pieces that the job read (each once)."""
        return self.total_raw


def _piece_region(meta: Metadata, shard: ShardRecord, p: Piece) -> Region:
    """The rows of the shard that piece ``p`` (a flat element range) spans."""
    shape = shard.region.shape
    row = 1
    for n in shape[1:]:
        row *= n
    if not shape or row == 0:
        return shard.region
    return shard.region.rows(p.start // row, -(-p.stop // row))


def _record_finder(
    meta: Metadata,
) -> tuple[dict[tuple[Any, ...], DTensorRecord], Callable[[tuple[Any, ...]], DTensorRecord]]:
    """The step's DTensor records by path, and a lookup that also makes one
    (and keeps it there) for a plain tensor that some rank needs resharded
    (``into=`` holds it as a DTensor)."""
    records = _records(meta)
    by_path = {tuple(lf.path): i for i, lf in enumerate(meta.leaves)}

    def record(key: tuple[Any, ...]) -> DTensorRecord:
        if key not in records:
            records[key] = _record_of_leaf(meta, by_path[key])
        return records[key]

    return records, record


def plan_shard_reads(
    c: Comm,
    meta: Metadata,
    st: ShardTargets,
    read_own: bool = False,
    held: bool | Sequence[int] = False,
) -> ShardReads:
    """Collective: exchanges every rank's needed regions and assigns each
    needed piece to one of the ranks that need it (deterministic), who
    sends it to the others; with ``read_own``, each rank that needs a piece
    reads it itself and nothing is sent (one host: the page cache serves
    each reader, and each reader checksums what it read); with ``held``,
    each needed piece comes from the rank whose data file holds it (the
    multi-level engine's recovery: every rank of the saving job holds its
    own file in memory, :func:`read_held_shards`), sent to the other ranks
    that need it; ``held`` a sequence: per data file, the rank that holds
    it in memory (a recovery at another world size, where a rank may hold
    several files of the saving job, or none)."""
    records, record = _record_finder(meta)
    specs = [NeedSpec(n.path, n.region, n.layout, n.full) for n in st.needs]
    wants, _ = exchange_needs(c, specs, lambda key: Region.full(record(key).shape))
    for key in wants:
        record(key)
    pieces_of: dict[int, list[Piece]] = {}
    for p in meta.pieces:
        pieces_of.setdefault(p.leaf, []).append(p)
    out = ShardReads(st, records)
    load = [0] * c.size
    mine_of: dict[tuple[Any, ...], list[Need]] = {}
    for need in st.needs:
        mine_of.setdefault(need.path, []).append(need)
    for key in sorted(wants, key=lambda k: json.dumps(list(k))):
        index = RegionIndex(wants[key])
        regions_of: dict[int, list[Region]] = {}
        for region, ranks in wants[key]:
            for r in ranks:
                regions_of.setdefault(r, []).append(region)
        for shard in records[key].shards:
            raw = all(p.codec == "none" for p in pieces_of.get(shard.leaf, []))
            if read_own and raw and key in mine_of:
                direct = _direct_ranges(meta, shard, mine_of[key])
                if direct is not None:
                    out.direct[shard.leaf] = direct
        stored = [
            (shard, p) for shard in records[key].shards for p in pieces_of.get(shard.leaf, [])
        ]
        spans = [_piece_region(meta, shard, p) for shard, p in stored]
        found = index.needers_many(spans)
        for (shard, p), span, needers in zip(stored, spans, found, strict=True):
            if not needers:
                continue
            out.total_raw += p.length
            if read_own:
                if c.rank in needers:
                    out.mine.setdefault(p.rank, []).append(p)
                    out.read_raw += p.length
            else:
                if held is True:
                    reader = p.rank
                elif held is not False:
                    reader = held[p.rank]
                else:
                    reader = min(needers, key=lambda r: (load[r], r))
                load[reader] += p.stored
                if reader == c.rank:
                    out.mine.setdefault(p.rank, []).append(p)
                    out.read_raw += p.length
                for r in needers:
                    if r != reader:
                        part = _part(meta, shard, p, span, regions_of[r])
                        out.sends.setdefault((reader, r), []).append(part)
            if c.rank in needers:
                out.needed.add(id(p))
                if shard.leaf not in out.direct and shard.leaf not in out.buffers:
                    out.buffers[shard.leaf] = np.empty(meta.leaves[shard.leaf].nbytes, np.uint8)
    return out


def local_shard_reads(meta: Metadata, st: ShardTargets) -> ShardReads:
    """This rank's shard reads when every stored piece passes through this
    rank anyway (the real-FTI backend broadcasts every rank's stream,
    :mod:`deeppart.levels.fti`): no collective, no file; a buffer for each
    stored shard leaf that meets one of this rank's regions, which the
    caller fills piece by piece (:func:`shard_slot`) before
    :func:`fill_shards`."""
    records, record = _record_finder(meta)
    out = ShardReads(st, records)
    for need in st.needs:
        for shard in record(need.path).shards:
            if shard.leaf not in out.buffers and shard.region.intersect(need.region) is not None:
                out.buffers[shard.leaf] = np.empty(meta.leaves[shard.leaf].nbytes, np.uint8)
    return out


def shard_slot(meta: Metadata, sr: ShardReads, p: Piece) -> U8 | None:
    """Where stored piece ``p``'s bytes go in ``sr``'s buffers (None: no
    region of this rank meets its shard)."""
    return _slot(meta, sr, p) if p.leaf in sr.buffers else None


def _slot(meta: Metadata, sr: ShardReads, p: Piece) -> U8:
    got = sr.held.get(id(p))
    if got is not None:
        return got
    isz = meta.leaves[p.leaf].itemsize
    return sr.buffers[p.leaf][p.start * isz : p.stop * isz]


def read_shards(
    path: CheckpointDir,
    meta: Metadata,
    sr: ShardReads,
    progress: Progress,
) -> int:
    """Reads and checksums this rank's pieces into its shard buffers (or
    straight into its tensors); returns the bytes read."""
    check_file_sizes(path, meta, sorted(sr.mine))
    n = 0
    for f in sorted(sr.mine):
        pieces = sorted(sr.mine[f], key=lambda p: p.offset)
        direct = [p for p in pieces if p.leaf in sr.direct]
        if direct:
            n += _read_direct(path, meta, f, direct, sr, progress)
        part = [p for p in pieces if p.leaf not in sr.direct]
        if part:
            n += read_file(path, meta, f, part, lambda p: _slot(meta, sr, p), progress)
    return n


def read_held_shards(
    directory: CheckpointDir, meta: Metadata, sr: ShardReads, own: U8 | Mapping[int, U8]
) -> int:
    """A ``held`` plan's reads (:func:`plan_shard_reads`): this rank's
    pieces taken from its own data file ``own`` (or, by data file, the
    files it holds), whose every piece was
    verified against its checksum when it was recovered (a compressed
    piece's stored bytes are checked again as they are decoded); each goes
    to its slot, or, when only other ranks need it, to a buffer of its own
    (``sr.held``). Returns the raw bytes taken."""
    n = 0
    for f in sorted(sr.mine):
        for p in sr.mine[f]:
            if id(p) in sr.needed:
                out = _slot(meta, sr, p)
            else:
                out = sr.held[id(p)] = np.empty(p.length, np.uint8)
            src = own[f] if isinstance(own, Mapping) else own
            stored = src[p.offset : p.offset + p.stored]
            if p.codec == "none":
                out[:] = stored
            else:
                decode_piece(p, stored.data, out, meta, directory)
            n += p.length
    return n


#: The most bytes of a piece read at once into the scratch buffer (the
#: bytes no tensor here takes, read to checksum the whole piece).
SCRATCH_BYTES = 8 << 20


def _read_into(f: Any, view: U8, p: Piece, directory: CheckpointDir, hasher: Any) -> None:
    got = f.readinto(view.data)
    if got != view.size:
        raise CorruptCheckpointError(f"{p.describe(directory)}: short read")
    hasher.update(view.data)


def _read_direct(
    directory: CheckpointDir,
    meta: Metadata,
    rank: int,
    pieces: list[Piece],
    sr: ShardReads,
    progress: Progress,
) -> int:
    """Reads raw ``pieces`` of data file ``rank``: the bytes of the rows
    that this rank's tensors take go straight into them, the others through
    a small scratch buffer; each whole piece is checksummed as it is read."""
    import xxhash

    path = directory / data_file_name(rank)
    f = open_data(directory, rank)
    n = 0
    scratch: U8 | None = None
    with f:
        check_header(path, f.read(HEADER_SIZE), rank, meta.world_size, meta.plan_fingerprint)
        for p in pieces:
            isz = meta.leaves[p.leaf].itemsize
            a, b = p.start * isz, p.stop * isz
            f.seek(p.offset)
            hasher = xxhash.xxh3_64()
            at = a
            for d in [*sr.direct[p.leaf], Direct(b, b, _EMPTY)]:
                lo, hi = max(d.lo, a), min(d.hi, b)
                if lo < at or lo > b:
                    continue
                while at < lo:  # bytes no tensor here takes: checksummed only
                    if scratch is None:
                        scratch = np.empty(SCRATCH_BYTES, np.uint8)
                    k = min(lo - at, SCRATCH_BYTES)
                    _read_into(f, scratch[:k], p, directory, hasher)
                    at += k
                if lo < hi:
                    _read_into(f, d.dest[lo - d.lo : hi - d.lo], p, directory, hasher)
                    at = hi
            if int(hasher.intdigest()) != p.xxh3:
                raise CorruptCheckpointError(
                    f"{p.describe(directory)}: checksum mismatch (xxh3_64)"
                )
            n += p.stored
            progress.advance(p.length)
    return n


def exchange_shards(c: Comm, sr: ShardReads, meta: Metadata) -> None:
    """Collective: each reader sends the pieces it read to the other ranks
    that need them, and to no one else (point to point; a replica group
    exchanges only among its members), each needer only the part of the
    piece its regions take (:class:`Part`), which lands at its place in
    the needer's buffer of the stored shard. Rounds of a shifted ring: in round
    ``k`` rank ``r`` sends to ``r + k`` and receives from ``r - k`` (one
    ``sendrecv_u8`` per message, so no ordering deadlocks), packed in
    messages of at most :data:`MESSAGE_BYTES`.

    A rank whose packing or unpacking fails keeps its place in every round
    (it sends zeros of each message's length and drops what it receives),
    then raises its first failure: no peer is left waiting in a
    ``sendrecv``, and the caller's agreement raises on every rank."""
    n, me = c.size, c.rank
    failed = FirstError()
    for k in range(1, n):
        dest, source = (me + k) % n, (me - k) % n
        out = _messages(sr.sends.get((me, dest), []))
        into = _messages(sr.sends.get((source, me), []))
        for m in range(max(len(out), len(into))):
            put = out[m] if m < len(out) else []
            got = into[m] if m < len(into) else []
            # A failed rank sends zeros of the message's length and
            # receives into scratch.
            send = failed.attempt(
                functools.partial(_pack, meta, sr, put), functools.partial(_zeros, put)
            )
            recv = failed.attempt(
                functools.partial(_landing, meta, sr, got), functools.partial(_scratch, got)
            )
            c.sendrecv_u8(send, dest, recv, source)
            if failed.err is None:
                failed.run(functools.partial(_unpack, meta, sr, got, recv))
            sr.received += recv.size
    failed.raise_first()


_EMPTY: U8 = np.empty(0, np.uint8)


def _zeros(batch: list[Part]) -> U8:
    return np.zeros(sum(p.length for p in batch), np.uint8)


def _scratch(batch: list[Part]) -> U8:
    return np.empty(sum(p.length for p in batch), np.uint8)


def _bytes(meta: Metadata, sr: ShardReads, part: Part) -> U8:
    """Where ``part``'s bytes are (the reader) or go (a needer)."""
    return _slot(meta, sr, part.piece)[part.lo : part.hi]


def _messages(parts: list[Part]) -> list[list[Part]]:
    """``parts`` in runs of at most :data:`MESSAGE_BYTES` (a longer part
    alone; the communicator chunks it)."""
    out: list[list[Part]] = []
    size = 0
    for p in parts:
        if out and size + p.length <= MESSAGE_BYTES:
            out[-1].append(p)
            size += p.length
        else:
            out.append([p])
            size = p.length
    return out


def _pack(meta: Metadata, sr: ShardReads, batch: list[Part]) -> U8:
    """A message's bytes (none for no parts)."""
    if not batch:
        return _EMPTY
    if len(batch) == 1:
        return _bytes(meta, sr, batch[0])
    return np.concatenate([_bytes(meta, sr, p) for p in batch])


def _landing(meta: Metadata, sr: ShardReads, batch: list[Part]) -> U8:
    """Where a received message lands: the part's own place when it is one
    part (no copy), else a buffer that :func:`_unpack` spreads."""
    if not batch:
        return _EMPTY
    if len(batch) == 1:
        return _bytes(meta, sr, batch[0])
    return np.empty(sum(p.length for p in batch), np.uint8)


def _unpack(meta: Metadata, sr: ShardReads, batch: list[Part], buf: U8) -> None:
    if len(batch) < 2:
        return
    at = 0
    for p in batch:
        _bytes(meta, sr, p)[:] = buf[at : at + p.length]
        at += p.length


def fill_shards(meta: Metadata, sr: ShardReads) -> dict[int, Any]:
    """Copies what each stored shard shares with each needed region into the
    region's tensor; returns the new full tensors by the index of the leaf
    that the checkpoint's skeleton names for them (no ``into=``)."""
    torch = torch_module()
    dtypes = torch_dtypes()
    values: dict[int, Any] = {}
    with torch.no_grad():
        for need in sr.targets.needs:
            rec = sr.records[need.path]
            dtype = dtypes[rec.dtype]
            for shard in rec.shards:
                common = shard.region.intersect(need.region)
                if common is None or shard.leaf not in sr.buffers:
                    continue
                src = (
                    torch.from_numpy(sr.buffers[shard.leaf]).view(dtype).reshape(shard.region.shape)
                )
                # Where the common box is a slice of the stored shard (every
                # Shard placement), a view; an index array only for the
                # dimensions of interleaved rows (_StridedShard).
                spans = shard.region.spans(common)
                where = shard.region.positions(common) if None in spans else []
                for d, span in enumerate(spans):
                    if span is None:
                        src = src.index_select(d, torch.from_numpy(where[d]))
                    elif span != (0, src.shape[d]):
                        src = src.narrow(d, span[0], span[1] - span[0])
                spans = need.region.spans(common)
                if all(sp is not None for sp in spans):
                    need.dest[tuple(slice(*sp) for sp in spans if sp is not None)].copy_(src)
                else:
                    at = need.region.positions(common)
                    grids = [
                        torch.from_numpy(p).reshape([-1 if k == d else 1 for k in range(len(at))])
                        for d, p in enumerate(at)
                    ]
                    need.dest[tuple(grids)] = src.to(need.dest.device)
            # Shards read straight into need.dest (Direct) went through
            # numpy views, which autograd does not see (a second count where
            # copy_ above made one: harmless).
            written_in_place(need.dest)
            if need.value is not None:
                values[rec.shards[0].leaf] = need.value
    return values
