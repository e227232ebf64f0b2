"""Stage 2 of a save: prepare. Each rank flattens its state into leaves,
describes them as a :class:`~deeppart.Manifest`, gets the plan
(:mod:`deeppart.saving.planning`), and digests everything the ranks must agree on.
:func:`prepare_save`, the prepare of ``deeppart.save`` and of the
multi-level backends (:mod:`deeppart.levels`), takes each rank's own tree:
every tensor that several ranks hold is digested whole
(:func:`~deeppart.saving.digests.tensor_digest`; issue 49, replicas are
proved), and copies that differ, like plain values that differ, become each
rank's own version (:mod:`deeppart.state.union`; issue 48).
:func:`verify_replicas` (optional) checks that the ranks' copies of the
state hold the same bytes. Nothing is written before both pass.

DTensors become shard leaves held by a subset of the ranks
(:mod:`deeppart.state.dtensor`). :func:`replica_sample` hashes a few bytes of
each leaf that every rank holds (what the benchmarks compare the proof with).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from deeppart._planner import Manifest, Plan
from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.compression import check_codec
from deeppart.errors import CheckpointError, StateMismatchError
from deeppart.regions import SHARD_KEY, DTensorRecord, Region, ShardRecord
from deeppart.saving.digests import digest_all, digest_threads
from deeppart.saving.own_structure import describe, holders_of, records_text, structure_digest
from deeppart.saving.planning import in_process_options
from deeppart.saving.union_cache import (
    COLUMN_WIDTH,
    FINGERPRINT_BYTES,
    TAG_BYTES,
    EmptyLeaves,
    OverlaidLeaves,
    UnionCache,
    cached,
    check_of,
    check_value,
    remember,
    reuse_agreed,
    reuse_terms,
)
from deeppart.state.dtensor import HolderGroups
from deeppart.state.state import FlatLeaf, check_has_data, flatten
from deeppart.state.tensors import U8, readable, u8_view
from deeppart.state.union import (
    Described,
    Digests,
    ShardBlock,
    Union,
    build_union,
    decode_described,
    encode_described,
    units_of,
    whole_digests_needed,
)
from deeppart.storage.identity import IDENTITY_BYTES, identity_digest, identity_error
from deeppart.storage.url import Location, location_key

__all__ = [
    "Prepared",
    "StagedPiece",
    "located_digest",
    "prepare_save",
    "replan",
    "replica_classes",
    "replica_sample",
    "sample_bytes",
    "save_digest",
    "verify_replicas",
]

#: Bytes of each sampled block, and the blocks per leaf (start, middle, end).
SAMPLE_BYTES = 64
SAMPLE_BLOCKS = 3


@dataclass(frozen=True)
class StagedPiece:
    """The raw bytes of one of this rank's planned pieces, held apart from
    the live state (an asynchronous save's snapshot, :mod:`deeppart.saving.snapshot`)."""

    data: memoryview
    itemsize: int
    #: Whether the piece is of a tensor (else of a plain value).
    tensor: bool


@dataclass
class Prepared:
    """One rank's prepared save: its leaves, the skeleton that rebuilds the
    tree, manifest, plan, codec, and the digest the ranks compare.

    ``staged``: when not None, the bytes of this rank's pieces
    (``plan.rank_pieces(rank)``, in that order), which the writer writes
    instead of reading ``leaves`` (an asynchronous save's snapshot)."""

    #: One per manifest leaf (a list, or a reused union's
    #: :class:`~deeppart.saving.union_cache.OverlaidLeaves`); read only.
    leaves: Sequence[FlatLeaf]
    skeleton: Any
    manifest: Manifest
    plan: Plan
    codec: str
    digest: bytes
    #: The sharded tensors (DTensors) among the leaves.
    dtensors: list[DTensorRecord] = field(default_factory=list)
    #: Per leaf held by every rank: 8 bytes of the hash of its sampled bytes.
    samples: dict[int, bytes] = field(default_factory=dict)
    #: An asynchronous save's snapshot of this rank's pieces (:mod:`deeppart.saving.snapshot`).
    staged: list[StagedPiece] | None = None
    #: Waits until ``staged`` holds its bytes (copies from a device still in
    #: flight), raising if they may be torn; the writer calls it first.
    staged_ready: Callable[[], None] | None = None
    #: A union save whose items are not all held by every rank, or have
    #: versions (:mod:`deeppart.state.union`): metadata.json's version 3 keys
    #: (``dtensors`` with each record's ranks, ``versions``).
    union: dict[str, Any] | None = None
    #: The large shared tensors whose replica proof is left to the caller
    #: (``defer_proof``: beside a synchronous save's write, on an asynchronous
    #: save's writer thread; :mod:`deeppart.saving.deferred_proof`), by local
    #: leaf; empty when proved in the prepare.
    unproved: dict[int, Any] = field(default_factory=dict)
    #: With ``unproved``: the save's prepare again, should their proof find
    #: copies that differ (:func:`replan`).
    replan: Callable[..., tuple[Prepared, bool]] | None = None
    #: A save that reuses a cached union (:mod:`deeppart.saving.union_cache`)
    #: and left part of its check to the deferred proof: this rank's check
    #: value of the digests it takes (by leaf of ``leaves``), which that
    #: proof's agreement sums; set on every rank of such a save, whether or
    #: not it has ``unproved`` tensors itself (all of them join that agreement).
    proof_check: Callable[[dict[int, bytes]], bytes] | None = None


def sample_bytes(t: Any) -> bytes:
    """A few blocks of a tensor's bytes in row-major order (its start, middle
    and end), whatever its memory layout or device: replicas that hold the
    same values sample the same bytes."""
    n = t.numel()
    if n == 0:
        return b""
    isz = int(t.element_size())
    size = n * isz
    step = max(1, (size - SAMPLE_BYTES) // max(1, SAMPLE_BLOCKS - 1))
    last = max(0, size - SAMPLE_BYTES)
    starts = sorted({min(k * step, last) for k in range(SAMPLE_BLOCKS)})
    width = min(SAMPLE_BYTES, size)
    if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg():
        # Straight from memory: a contiguous CPU tensor of n elements spans
        # n * element_size bytes from data_ptr().
        base = t.data_ptr()
        return b"".join(ctypes.string_at(base + a, width) for a in starts)
    # Any other layout: the elements that cover each block, gathered by
    # row-major index (torch.take; no copy of the whole tensor).
    import torch

    spans = [(a // isz, -(-(a + width) // isz)) for a in starts]
    index = torch.cat([torch.arange(e0, e1) for e0, e1 in spans]).to(t.device)
    raw = u8_view(readable(torch.take(t.detach(), index))).tobytes()
    out, at = [], 0
    for a, (e0, e1) in zip(starts, spans, strict=True):
        skip = a - e0 * isz
        out.append(raw[at + skip : at + skip + width])
        at += (e1 - e0) * isz
    return b"".join(out)


def replica_sample(leaves: list[FlatLeaf], descs: list[dict[str, Any]]) -> dict[int, bytes]:
    """Per tensor leaf that every rank holds (no owner, no holders): an
    8-byte hash of a few of its bytes. Costs a few small copies per leaf, not
    a pass over the data; :func:`verify_replicas` is the full check."""
    out: dict[int, bytes] = {}
    for i, (leaf, desc) in enumerate(zip(leaves, descs, strict=True)):
        if leaf.tensor is None or "owner" in desc or "holders" in desc:
            continue
        out[i] = hashlib.blake2b(sample_bytes(leaf.tensor), digest_size=8).digest()
    return out


def save_digest(
    plan: Plan,
    manifest: Manifest,
    skeleton: Any,
    codec: str,
    directory: Location,
    records: list[DTensorRecord],
    records_json: list[dict[str, Any]] | None = None,
    records_text: bytes | None = None,
) -> bytes:
    """The digest of what all ranks of one save must agree on
    (``records_json``: ``records``' JSON, or ``records_text``: their
    :func:`~deeppart.saving.own_structure.records_text`, when the caller
    has it)."""
    if records_json is None and records_text is None:
        records_json = [r.to_json() for r in records]
    part = structure_digest(plan, manifest, skeleton, codec, records_json, records_text)
    return located_digest(part, directory)


def located_digest(part: bytes, directory: Location) -> bytes:
    """A save's digest from its :func:`structure_digest` and its directory."""
    return hashlib.sha256(part + location_key(directory).encode()).digest()


def _differing(
    per_rank: list[bytes], holders: list[list[int]]
) -> list[tuple[int, list[list[int]]]]:
    """Per leaf whose holders' digests differ: the groups of holders that
    agree (each group sorted, the groups by their lowest rank)."""
    from deeppart._planner import REPLICA_DIGEST_LEN as width

    out: list[tuple[int, list[list[int]]]] = []
    for i, h in enumerate(holders):
        by: dict[bytes, list[int]] = {}
        for r in h:
            by.setdefault(per_rank[r][i * width : (i + 1) * width], []).append(r)
        if len(by) > 1:
            out.append((i, sorted(by.values(), key=lambda g: g[0])))
    return out


def _leaf_buffer(leaf: FlatLeaf) -> U8 | memoryview:
    if leaf.tensor is None and leaf.encoded is None:
        # A DTensor shard this rank does not hold.
        return memoryview(b"")
    if leaf.tensor is None:
        assert leaf.encoded is not None
        return memoryview(leaf.encoded)
    return u8_view(readable(leaf.tensor))


def verify_replicas(c: Comm, prep: Prepared) -> None:
    """Hashes every leaf this rank holds (BLAKE3 in the Rust core, GIL
    released; nothing for a leaf it does not hold) and compares one digest
    of them all across the ranks in one collective. If ranks that hold the
    same leaves differ, or the ranks hold different leaves (shards, each
    rank's own state), the per-leaf digests are exchanged (16 bytes a leaf)
    and compared among each leaf's holders: every rank raises
    :class:`ReplicaMismatchError` naming the leaves whose copies differ and
    which ranks hold which version."""
    from deeppart._planner import replica_digests
    from deeppart.state.union import replica_error

    err: BaseException | None = None
    digests = b""
    try:
        views = [_leaf_buffer(leaf) for leaf in prep.leaves]
        buffers = [v.data if isinstance(v, np.ndarray) else v for v in views]
        digests = replica_digests(buffers, digest_threads(c.size))
    except BaseException as e:
        err = e
    summary = hashlib.blake2b(digests, digest_size=16).digest()
    rows = agree(c, err, summary, width=16)
    leaves = prep.manifest.leaves()
    groups = prep.manifest.groups
    partial = any(lf.get("owner") is not None or lf.get("holders") is not None for lf in leaves)
    if not partial and len(set(rows)) == 1:
        return
    per_rank = c.allgather_varbytes(digests)
    holders = [holders_of(lf, groups, c.size) for lf in leaves]
    differ = _differing(per_rank, holders)
    if not differ:
        return
    raise replica_error(
        [(prep.leaves[i].path, g) for i, g in differ], "verify_replicas: whole-leaf digests"
    )


# ----------------------------------------------------------------------------
# The one prepare of deeppart.save: every rank passes its own tree.

#: Bytes of each rank's row in the save's prepare agreement: the digest of
#: its structure and plan (32), of its sampled shared tensors (16), of its
#: plain values (16). The row goes on with the ``local`` step's byte and
#: the digest of the store the rank addresses (:data:`IDENTITY_BYTES`).
ROW_WIDTH = 64


@dataclass
class _Own:
    """This rank's own prepare: its plan as if every rank held the same
    (the fast path), its description and digests (the exchange)."""

    prep: Prepared
    described: Described
    digests: Digests
    sample: bytes
    values: bytes
    plan_for: Callable[[Manifest], Plan]
    directory: Location
    #: Shared tensors not digested yet (``defer_from``), by local leaf.
    deferred: dict[int, Any] = field(default_factory=dict)
    #: Per DTensor record: the layout its shards come from (the exchange
    #: sends the layout, :func:`~deeppart.state.union.encode_described`).
    layouts: list[Any] = field(default_factory=list)
    #: :func:`~deeppart.saving.union_cache.structure_fingerprint` of this rank.
    structure: bytes = b""


def _hex8(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _own_prepare(
    state: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Location,
    group: Any,
    replica_dims: Sequence[str],
    rank: int,
    world: int,
    defer_from: int | None = None,
) -> _Own:
    from deeppart.loading.groups import AUTO, group_ranks, namespace

    codec = check_codec(compression)
    kind = "none" if group is None else "auto" if group == AUTO else "explicit"
    if kind == "explicit":
        state = {namespace(group_ranks(group, rank, world)): state}
    flat, skeleton = flatten(state)
    check_has_data(flat)
    struct, leaves = describe(flat, skeleton, replica_dims, codec, kind, rank, world)
    ex = struct.expanded
    plan = plan_for(struct.manifest)
    digest = located_digest(struct.digest_part(plan, codec), directory)
    # Ranks that pass different kinds of group= never agree (nor hang).
    digest = hashlib.sha256(digest + kind.encode()).digest()
    prep = Prepared(leaves, ex.skeleton, struct.manifest, plan, codec, digest, ex.records)
    where = location_key(directory)
    common = hashlib.sha256(f"{codec}\0{where}\0{kind}".encode()).hexdigest()
    described = Described(struct.descs, ex.skeleton, struct.records, common)
    held = [(e, leaves[e], holders) for e, _, holders in struct.held]
    digests, sample, values, deferred = digest_held(held, digest_threads(world), defer_from)
    prep.samples = {i: bytes.fromhex(v) for i, v in digests.samples.items()}
    return _Own(
        prep, described, digests, sample, values, plan_for, directory, deferred, ex.layouts,
        struct.structure,
    )  # fmt: skip


@dataclass
class ProofCost:
    """What this rank's last proof of its shared tensors cost
    (:func:`digest_held`, in :func:`prepare_save`): the seconds spent
    digesting and the bytes digested. Read by the benchmarks."""

    seconds: float = 0.0
    nbytes: int = 0
    tensors: int = 0
    #: A synchronous save's large shared tensors, digested on a thread
    #: beside its write (:class:`deeppart.saving.deferred_proof.ProofBesideWrite`):
    #: the digests' seconds and bytes, and the seconds the save waited for
    #: them once its own write was done (what the proof added to the save).
    beside_seconds: float = 0.0
    beside_nbytes: int = 0
    waited_seconds: float = 0.0


#: This rank's last proof (:class:`ProofCost`), replaced by every save.
last_proof = ProofCost()


def digest_held(
    held: Sequence[tuple[int, FlatLeaf, int]], threads: int = 1, defer_from: int | None = None
) -> tuple[Digests, bytes, bytes, dict[int, Any]]:
    """The digests a rank sends in the exchange, of the leaves it holds
    (``(local leaf, leaf, number of holders)``, in leaf order): a hash of
    each plain value, a digest of the *whole* bytes of each tensor that
    other ranks hold too (:func:`~deeppart.saving.digests.tensor_digest`: replicas are proved, not
    sampled, issue 49); and the 16-byte digests of each kind that the first
    agreement compares (shared tensors, plain values). The time and bytes
    the tensor digests took are kept in :data:`last_proof`. With
    ``defer_from``, shared tensors of at least that many bytes are not
    digested: they are returned, by local leaf (the save proves them later,
    :mod:`deeppart.saving.deferred_proof`)."""
    import time

    digests = Digests()
    h_sample = hashlib.blake2b(digest_size=16)
    h_values = hashlib.blake2b(digest_size=16)
    shared = [(i, leaf.tensor) for i, leaf, holders in held
              if leaf.encoded is None and leaf.tensor is not None and holders > 1]  # fmt: skip
    deferred: dict[int, Any] = {}
    if defer_from is not None:
        deferred = {i: t for i, t in shared if t.numel() * t.element_size() >= defer_from}
        shared = [(i, t) for i, t in shared if i not in deferred]
    t0 = time.perf_counter()
    done = digest_all([t for _, t in shared], threads)
    full = dict(zip([i for i, _ in shared], done, strict=True))
    last_proof.seconds = time.perf_counter() - t0
    last_proof.nbytes = sum(t.numel() * t.element_size() for _, t in shared)
    last_proof.tensors = len(shared)
    last_proof.beside_seconds = last_proof.waited_seconds = 0.0
    last_proof.beside_nbytes = 0
    for i, leaf, _holders in held:
        if leaf.encoded is not None:
            digests.values[i] = _hex8(leaf.encoded)
            h_values.update(i.to_bytes(8, "little") + leaf.encoded)
        elif i in full:
            digests.samples[i] = full[i].hex()
            h_sample.update(i.to_bytes(8, "little") + full[i])
    return digests, h_sample.digest(), h_values.digest(), deferred


def replica_classes(manifest: Manifest, world: int) -> list[tuple[int, ...]]:
    """Per rank: the holder groups (of tensor leaves) it is in. Ranks with
    the same groups hold the same shared tensors, whose samples must agree."""
    groups = manifest.groups
    if not groups:
        return [()] * world
    used = sorted({lf["holders"] for lf in manifest.leaves() if lf.get("holders") is not None})
    out: list[list[int]] = [[] for _ in range(world)]
    for g in used:
        for r in groups[g]:
            out[r].append(g)
    return [tuple(x) for x in out]


def prepare_save(
    c: Comm,
    failed: BaseException | None,
    state: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Location,
    *,
    group: Any = None,
    replica_dims: str | Sequence[str] | None = None,
    local: Callable[[Prepared], int] | None = None,
    store: bytes = b"",
    declared: bool = False,
    defer_proof: bool = False,
) -> tuple[Prepared, bool]:
    """The prepare stage of :func:`deeppart.save` and its agreement
    (collective over ``c``): each rank passes its own tree (see
    :mod:`deeppart.state.union`). Fast path: one agreement of a 122-byte row per
    rank (structure and plan digest, sampled tensors, plain values, the
    ``local`` byte, the digest of ``store``: the identity of the store this
    rank addresses, :func:`deeppart.storage.identity.identity_text`; ranks
    whose stores differ raise StoreConfigError naming the settings that
    differ, after one more collective; the union cache's column:
    :mod:`deeppart.saving.union_cache`), after one sum over the ranks of
    a fixed size that decides alone when every rank's structure is the
    one of the last union save in this process and every copy that union
    stores once is still equal among its holders: that union and its plan
    are then this save's (no row gathered, no exchange, no merge; not with
    ``group="auto"``). When
    all ranks hold the same structure, the whole-byte digests of their
    shared tensors agree within each replica class and their plain values
    agree, the plan every rank made of its own tree is the job's. Otherwise the ranks exchange
    their descriptions (one per distinct structure) and digests, every
    rank builds the union manifest alike, and a second agreement checks
    the plan. ``failed``: this rank's error in an earlier step;
    ``local``: run on this rank's final :class:`Prepared` (an asynchronous
    save's snapshot); returned: whether its byte is set on any rank.
    ``declared``: plain tensors that every rank holds are declared
    replicas (``verify_replicas=True``): a difference is refused with
    ReplicaMismatchError instead of stored per rank. ``defer_proof``: on
    the fast path, the shared tensors of at least
    :data:`~deeppart.saving.deferred_proof.DEFER_FROM` bytes are left
    unproved (``Prepared.unproved``) for the caller to prove; off it, they
    are proved here like the others."""
    from deeppart.loading.groups import AUTO
    from deeppart.saving.deferred_proof import DEFER_FROM

    defer_from = DEFER_FROM if defer_proof and not declared else None
    dims = [replica_dims] if isinstance(replica_dims, str) else list(replica_dims or ())
    auto = group == AUTO
    err: BaseException | None = failed
    own: _Own | None = None
    reuse: _Reuse | None = None
    column = b"\0" * COLUMN_WIDTH
    flag = 0
    try:
        if failed is not None:
            raise failed
        own = _own_prepare(
            state, compression, plan_for, directory, group, dims, c.rank, c.size, defer_from
        )
        fingerprint = _fingerprint(own, auto, declared)
        reuse = None if auto else _try_cache(own, c.rank, c.size, fingerprint)
        blank = b"\0" * (COLUMN_WIDTH - FINGERPRINT_BYTES)
        column = fingerprint + (reuse.column if reuse else blank)
        if local is not None and reuse is not None:
            flag = local(reuse.prep)
        elif local is not None and not auto:
            flag = local(own.prep)
    except BaseException as e:
        err = e
    identity = identity_digest(store)
    # Whether every rank reuses its cached union: one sum of a fixed size.
    total = c.allreduce_sum_i64(reuse_terms(err is not None, column, flag, identity))
    reused, late, flagged = reuse_agreed(total, c.size)
    if reused and reuse is not None:
        # The union and plan of the last save: no exchange, no merge. Copies
        # whose proof is deferred are proved by its caller, on every rank.
        assert own is not None
        if late:
            reuse.prep.unproved = reuse.unproved
            reuse.prep.proof_check = functools.partial(check_of, reuse.late)
            reuse.prep.replan = functools.partial(_replan_reused, own, fingerprint, reuse.local_of)
        return reuse.prep, flagged
    row = own.prep.digest + own.sample + own.values if own is not None else b"\0" * ROW_WIDTH
    row += bytes([flag]) + identity + column
    rows = agree(c, err, row, width=ROW_WIDTH + 1 + IDENTITY_BYTES + COLUMN_WIDTH)
    assert own is not None
    if len({r[ROW_WIDTH + 1 : ROW_WIDTH + 1 + IDENTITY_BYTES] for r in rows}) != 1:
        raise identity_error(c.allgather_varbytes(store))
    flags = [r[ROW_WIDTH] for r in rows]
    columns = [r[ROW_WIDTH + 1 + IDENTITY_BYTES :] for r in rows]
    fingerprints = [col[:FINGERPRINT_BYTES] for col in columns]
    # (A cached union every rank can reuse was decided by the sum above:
    # here some rank cannot, and a rank that could takes the full path.)
    tried = any(
        col[FINGERPRINT_BYTES : FINGERPRINT_BYTES + TAG_BYTES].strip(b"\0") for col in columns
    )
    same = len({r[:32] for r in rows}) == 1 and len({r[48:64] for r in rows}) == 1
    if same and not auto and not tried:
        classes = replica_classes(own.prep.manifest, c.size)
        first: dict[tuple[int, ...], bytes] = {}
        pairs = zip(classes, rows, strict=True)
        if all(first.setdefault(k, r[32:48]) == r[32:48] for k, r in pairs):
            # The fast path: every rank planned the job's save.
            own.prep.unproved = own.deferred
            if own.deferred:
                own.prep.replan = functools.partial(_replan, own, rows, fingerprints, None)
            return own.prep, any(flags)
    if own.prep.staged is not None:
        own.prep.staged = None  # the optimistic snapshot: taken again of the union's plan
    _prove_deferred(own, c.size)
    rows = [r[:ROW_WIDTH] for r in rows]
    return _union_prepare(c, own, rows, auto, local, declared, None if auto else fingerprints)


def _fingerprint(own: _Own, auto: bool, declared: bool) -> bytes:
    """This rank's structure fingerprint for this save (the own tree's, the
    kind of replica proof)."""
    extra = bytes([auto, declared])
    return hashlib.blake2b(own.structure + extra, digest_size=FINGERPRINT_BYTES).digest()


@dataclass
class _Reuse:
    """This rank's candidate for reusing its cached union in this save."""

    entry: UnionCache
    #: The save prepared from the cache (this save's leaves, directory, plan).
    prep: Prepared
    #: Tag, check value and late byte (the row's cache column after the
    #: fingerprint).
    column: bytes
    #: This rank's deferred shared tensors, by union item (``prep.leaves``):
    #: proved by the save's caller (:mod:`deeppart.saving.deferred_proof`).
    unproved: dict[int, Any]
    #: The check terms of ``unproved`` tensors, by union item.
    late: list[tuple[int, int]]
    #: Per union item this rank holds: its local leaf.
    local_of: dict[int, int]


def _try_cache(own: _Own, rank: int, world: int, fingerprint: bytes) -> _Reuse | None:
    """This rank's save prepared from its cached union
    (:mod:`deeppart.saving.union_cache`), when its structure is the cached
    one; None otherwise. The deferred shared tensors (``own.deferred``)
    stay deferred: the row's check covers the other copies, the rest of it
    is the deferred proof's (every deferred tensor is digested there, so
    that copies found to differ are each rank's own in the save prepared
    again)."""
    entry = cached(rank, world, fingerprint)
    if entry is None:
        return None
    item_of = {i: k for k, i in entry.held}
    if any(i not in item_of for i in own.deferred):
        return None  # a deferred tensor the cached union does not hold here
    check = check_value([t for t in entry.terms if t[0] not in own.deferred], own.digests)
    if check is None:
        return None
    late = [(item_of[i], coeff) for i, coeff in entry.terms if i in own.deferred]
    template = entry.template
    mine = own.prep.leaves
    leaves = OverlaidLeaves(
        template,
        {k: FlatLeaf(template[k].path, mine[i].tensor, mine[i].encoded) for k, i in entry.held},
    )
    options = in_process_options(own.plan_for)
    if options is not None and options == entry.planned_with:
        plan = entry.plan  # planned in process from equal options: the same plan
    else:
        plan = own.plan_for(entry.manifest)
    h = hashlib.sha256(b"deeppart union cache\0" + entry.ident)
    h.update(plan.fingerprint.encode() + b"\0" + own.prep.codec.encode() + b"\0")
    h.update(own.described.common.encode())
    digest = h.digest()
    prep = Prepared(
        leaves, entry.skeleton, entry.manifest, plan, own.prep.codec, digest,
        entry.records, union=entry.union_meta,
    )  # fmt: skip
    tag = hashlib.blake2b(digest, digest_size=TAG_BYTES).digest()
    unproved = {item_of[i]: t for i, t in own.deferred.items()}
    column = tag + check + bytes([bool(late)])
    return _Reuse(entry, prep, column, unproved, late, {k: i for k, i in entry.held})


def _replan(
    own: _Own,
    rows: list[bytes],
    fingerprints: list[bytes],
    local_of: dict[int, int] | None,
    c: Comm,
    proved: dict[int, bytes],
    local: Callable[[Prepared], int] | None,
) -> tuple[Prepared, bool]:
    """The prepare of a save whose deferred proof found shared tensors that
    differ between their holders (``proved``: this rank's digests of the
    tensors it left unproved, by leaf of the save's ``leaves``; ``local_of``
    maps those to local leaves when that save reused a cached union): the
    exchange, the union and its agreement, as a save whose copies differ
    takes in its call, so that each rank's copy is stored as its own
    (collective over ``c``)."""
    if local_of is not None:
        proved = {local_of[k]: d for k, d in proved.items()}
    _record_proved(own, proved)
    return _union_prepare(c, own, [r[:ROW_WIDTH] for r in rows], False, local, False, fingerprints)


def _replan_reused(
    own: _Own,
    fingerprint: bytes,
    local_of: dict[int, int],
    c: Comm,
    proved: dict[int, bytes],
    local: Callable[[Prepared], int] | None,
) -> tuple[Prepared, bool]:
    """:func:`_replan` of a save that reused its cached union on the sum
    alone (no rank's row was gathered): the rows and fingerprints it needs
    are gathered first (collective over ``c``)."""
    row = own.prep.digest + own.sample + own.values + fingerprint
    got = agree(c, None, row, width=ROW_WIDTH + FINGERPRINT_BYTES)
    rows, fingerprints = [g[:ROW_WIDTH] for g in got], [g[ROW_WIDTH:] for g in got]
    return _replan(own, rows, fingerprints, local_of, c, proved, local)


def replan(
    prep: Prepared,
    c: Comm,
    proved: dict[int, bytes],
    local: Callable[[Prepared], int] | None = None,
) -> tuple[Prepared, bool]:
    """``prep``'s save prepared again over ``c`` once the proof of its
    ``unproved`` tensors found copies that differ (``proved``: this rank's
    digests of them): the job's union plan, in which those copies are each
    rank's own, and the ``local`` flags; every rank calls it alike."""
    if prep.replan is None:
        raise RuntimeError("this save left no proof to its caller")
    return prep.replan(c, proved, local)


def _prove_deferred(own: _Own, world: int) -> None:
    """Digests the shared tensors ``own`` left unproved (the exchange
    compares every digest); their digests were not in its agreement row."""
    if not own.deferred:
        return
    order = sorted(own.deferred)
    done = digest_all([own.deferred[i] for i in order], digest_threads(world))
    _record_proved(own, dict(zip(order, done, strict=True)))


def _record_proved(own: _Own, proved: dict[int, bytes]) -> None:
    """Adds the digests of shared tensors proved after the prepare's first
    agreement (by local leaf) to what the exchange sends."""
    for i, d in proved.items():
        own.digests.samples[i] = d.hex()
        own.prep.samples[i] = d


def _classes_of(rows: list[bytes]) -> list[int]:
    """Per rank: the lowest rank whose structure digest is its own (its class)."""
    reps: dict[bytes, int] = {}
    return [reps.setdefault(r[:32], i) for i, r in enumerate(rows)]


def _reference(holders: list[int] | None, cls: int, classes: Sequence[int]) -> int:
    """The rank whose digest of a leaf (held by ``holders``, None: every
    rank) the other holders of class ``cls`` are compared with: its lowest
    holder of that class (that class's lowest rank for a plain tensor)."""
    if holders is None:
        return cls
    return min(h for h in holders if classes[h] == cls)


def _pairs(items: Sequence[tuple[int, bytes]]) -> bytes:
    """``(local leaf, digest)`` pairs as bytes: a count, the digests' width,
    then per pair the leaf (4 bytes) and the digest."""
    width = len(items[0][1]) if items else 0
    out = bytearray(struct.pack("<IB", len(items), width))
    for i, d in items:
        if len(d) != width:
            raise ValueError("digests of one kind differ in width")
        out += struct.pack("<I", i) + d
    return bytes(out)


def _read_pairs(data: bytes, at: int) -> tuple[dict[int, bytes], int]:
    n, width = struct.unpack_from("<IB", data, at)
    at += 5
    out: dict[int, bytes] = {}
    for _ in range(n):
        (i,) = struct.unpack_from("<I", data, at)
        out[i] = data[at + 4 : at + 4 + width]
        at += 4 + width
    return out, at


def _combined(items: Sequence[tuple[int, bytes]]) -> bytes:
    """One 16-byte digest of ``(local leaf, digest)`` pairs."""
    return hashlib.blake2b(
        b"".join([i.to_bytes(4, "little") + d for i, d in items]), digest_size=16
    ).digest()


def _own_holders(own: _Own) -> list[list[int] | None]:
    return [d.get("holders") for d in own.described.descs]


def _payload(own: _Own, rows: list[bytes], rank: int, rep: int) -> bytes:
    """What this rank sends in the exchange: its description (by layout,
    :func:`~deeppart.state.union.encode_described`) and the digests of its
    plain values if it is the lowest rank of its structure; the digests of
    the shared tensors of which it is the reference holder
    (:func:`_reference`), and one digest of its digests of the others,
    which every rank checks against their reference holders' (a copy
    that differs is sent leaf by leaf in a second round)."""
    classes = _classes_of(rows)
    header = b""
    if rep == rank:
        header = json.dumps(
            encode_described(own.described, own.layouts), separators=(",", ":")
        ).encode()
    holders = _own_holders(own)
    mine: list[tuple[int, bytes]] = []
    others: list[tuple[int, bytes]] = []
    for i in sorted(own.digests.samples):
        d = bytes.fromhex(own.digests.samples[i])
        ref = _reference(holders[i], rep, classes)
        (mine if ref == rank else others).append((i, d))
    values: list[tuple[int, bytes]] = []
    if rep == rank:
        values = [(i, bytes.fromhex(v)) for i, v in sorted(own.digests.values.items())]
    return (
        struct.pack("<I", len(header)) + header + _pairs(mine) + _combined(others) + _pairs(values)
    )


@dataclass
class _Exchanged:
    """What every rank knows alike after the exchange's first round."""

    classes: list[int]
    states: dict[int, Described]
    digests: list[Digests]
    #: Ranks whose digests of shared tensors differ from their reference
    #: holders' (or could not be checked): sent leaf by leaf in round two.
    unmatched: list[int]
    #: Ranks whose plain values differ from their class's lowest rank's.
    values_differ: list[int]
    #: The (rank, local leaf) pairs of :func:`whole_digests_needed`.
    need: list[tuple[int, int]]
    #: What each class holds under each path (:func:`~deeppart.state.union.units_of`).
    units: dict[str, list[Any]]

    @property
    def second_round(self) -> bool:
        return bool(self.unmatched or self.values_differ or self.need)


def _read_exchange(got: list[bytes], rows: list[bytes], auto: bool) -> _Exchanged:
    """Decodes the first round of the exchange (``got``: every rank's
    :func:`_payload`), alike on every rank."""
    world = len(rows)
    classes = _classes_of(rows)
    states: dict[int, Described] = {}
    refs: list[dict[int, bytes]] = []
    combined: list[bytes] = []
    values: dict[int, dict[int, str]] = {}
    for r, data in enumerate(got):
        (n,) = struct.unpack_from("<I", data, 0)
        if n:
            states[r] = decode_described(json.loads(data[4 : 4 + n].decode()))
        mine, at = _read_pairs(data, 4 + n)
        refs.append(mine)
        combined.append(data[at : at + 16])
        vals, _ = _read_pairs(data, at + 16)
        if r == classes[r]:
            values[r] = {i: v.hex() for i, v in vals.items()}
    if set(states) != set(classes):
        raise StateMismatchError("a class of ranks sent no description (a bug)")
    digests = [Digests() for _ in range(world)]
    members: dict[int, list[int]] = {}
    for r, c in enumerate(classes):
        members.setdefault(c, []).append(r)
    unmatched: list[int] = []
    for c, ranks in members.items():
        plain: list[int] = []
        held: dict[int, list[int]] = {r: [] for r in ranks}
        ref_of: dict[int, int] = {}
        # Per holders list (by identity: a decoded layout's shards share
        # theirs, kept alive by the description): its reference and its
        # holders of this class.
        by_holders: dict[int, tuple[int, list[int]]] = {}
        # One pass over the class's leaves: its plain tensors, and the
        # shards that several of its ranks hold (most shards have one).
        for i, d in enumerate(states[c].descs):
            hs = d.get("holders")
            if hs is None:
                if d.get("kind") != "object":
                    plain.append(i)
                continue
            if len(hs) < 2:
                continue
            known = by_holders.get(id(hs))
            if known is None:
                in_class = [h for h in hs if classes[h] == c]
                known = by_holders[id(hs)] = (_reference(hs, c, classes), in_class)
            ref_of[i] = known[0]
            for h in known[1]:
                held[h].append(i)
        plain = plain if world > 1 else []
        for i in plain:
            ref_of[i] = c
        for r in ranks:
            others = sorted([i for i in held[r] if ref_of[i] != r] + (plain if r != c else []))
            expected = [(i, refs[ref_of[i]].get(i)) for i in others]
            samples = {i: d.hex() for i, d in refs[r].items()}
            if (
                all(d is not None for _, d in expected)
                and _combined(cast("list[tuple[int, bytes]]", expected)) == combined[r]
            ):
                samples.update({i: cast("bytes", d).hex() for i, d in expected})
            else:
                unmatched.append(r)
            digests[r].samples = samples
    values_differ: list[int] = []
    for r, c in enumerate(classes):
        # Ranks whose values are their class's lowest rank's share its
        # dict (build_union takes them together); the others get a copy
        # that the second round updates.
        digests[r].values = values[c]
        if rows[r][48:64] != rows[c][48:64]:
            values_differ.append(r)
            digests[r].values = dict(values[c])
    units = units_of(states)
    need = whole_digests_needed(states, classes, auto, units)
    return _Exchanged(classes, states, digests, unmatched, values_differ, need, units)


def _second_payload(own: _Own, rank: int, ex: _Exchanged) -> bytes:
    """This rank's part of the exchange's second round: the whole digests
    of :func:`whole_digests_needed` that fall to it, its plain values that
    differ from its class's lowest rank's, and (when its first-round digest
    of them did not match) its digests of the shared tensors it does not
    hold as their reference."""
    from deeppart._planner import replica_digests

    mine = [leaf for r, leaf in ex.need if r == rank]
    views = [_leaf_buffer(own.prep.leaves[i]) for i in mine]
    buffers = [v.data if isinstance(v, np.ndarray) else v for v in views]
    whole = replica_digests(buffers, digest_threads(len(ex.classes))) if mine else b""
    values: list[tuple[int, bytes]] = []
    if rank in ex.values_differ:
        rep = ex.digests[ex.classes[rank]].values
        values = [
            (i, bytes.fromhex(v)) for i, v in sorted(own.digests.values.items()) if rep.get(i) != v
        ]
    samples: list[tuple[int, bytes]] = []
    if rank in ex.unmatched:
        holders = _own_holders(own)
        cls = ex.classes[rank]
        samples = [
            (i, bytes.fromhex(v))
            for i, v in sorted(own.digests.samples.items())
            if _reference(holders[i], cls, ex.classes) != rank
        ]
    return whole + _pairs(values) + _pairs(samples)


def _read_second(per_rank: list[bytes], ex: _Exchanged) -> dict[tuple[int, int], str]:
    """Applies the second round to ``ex.digests``; returns the whole digests."""
    from deeppart._planner import REPLICA_DIGEST_LEN as width

    count = [0] * len(per_rank)
    for r, _leaf in ex.need:
        count[r] += 1
    whole: dict[tuple[int, int], str] = {}
    at = [0] * len(per_rank)
    for r, leaf in ex.need:
        whole[(r, leaf)] = per_rank[r][at[r] * width : (at[r] + 1) * width].hex()
        at[r] += 1
    differ = set(ex.values_differ)
    for r, data in enumerate(per_rank):
        vals, pos = _read_pairs(data, count[r] * width)
        samples, _ = _read_pairs(data, pos)
        if r in differ:
            # Its values are a copy of its class's lowest rank's: the ones it
            # sent are the leaves that differ (build_union's versions).
            rep = ex.digests[ex.classes[r]].values
            sent = {i: v.hex() for i, v in vals.items()}
            ex.digests[r].values.update(sent)
            ex.digests[r].differs = {i for i, v in sent.items() if rep.get(i) != v}
        elif vals:
            raise StateMismatchError(f"rank {r} sent plain values it was not asked for (a bug)")
        ex.digests[r].samples.update({i: v.hex() for i, v in samples.items()})
    return whole


def _exchange_round(c: Comm, build: Callable[[], bytes]) -> list[bytes]:
    """One round of the exchange (collective over ``c``): every rank's
    ``build()``. A rank whose ``build`` raises still takes part (a byte
    saying so, and its error), and then every rank raises: the failing one
    its own error, the others a CheckpointError naming it."""
    err: BaseException | None = None
    try:
        data = b"\0" + build()
    except BaseException as e:
        err = e
        data = b"\1" + f"{type(e).__name__}: {e}".encode()[:2000]
    got = c.allgather_varbytes(data)
    if err is not None:
        raise err
    failed = [r for r, g in enumerate(got) if g[:1] != b"\0"]
    if failed:
        first = got[failed[0]][1:].decode(errors="replace")
        raise CheckpointError(
            f"ranks {failed} failed in the save's exchange (rank {failed[0]}: {first}); "
            "nothing was written"
        )
    return [g[1:] for g in got]


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's cyclic garbage collector paused: building the union makes
    hundreds of thousands of small containers (no cycles), and each
    collection of the young generations triggered on the way would walk
    them all again. On the way out, what the union keeps (a million
    objects at 4,096 ranks) goes to the oldest generation without being
    walked there (``gc.freeze`` then ``gc.unfreeze``), where long-lived
    objects are walked only by the rare full collections: otherwise the
    next young collection walks them all once more (0.3 s at 512 ranks).
    Not when the process keeps frozen objects of its own (``unfreeze``
    would release them). The young generations are collected first (they
    hold only the caller's recent objects then: cheap), so that no garbage
    of the caller's (a cycle holding tensors) is moved out of their reach
    with what the union keeps."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if enabled:
            gc.enable()


def _union_prepare(
    c: Comm,
    own: _Own,
    rows: list[bytes],
    auto: bool,
    local: Callable[[Prepared], int] | None,
    declared: bool = False,
    fingerprints: list[bytes] | None = None,
) -> tuple[Prepared, bool]:
    """The exchange, the union manifest and its agreement (every rank
    raises alike on replicas that differ, or on trees that do not merge).
    With ``fingerprints`` (every rank's structure fingerprint), the union
    is kept for the next save (:mod:`deeppart.saving.union_cache`)."""
    classes = _classes_of(rows)
    got = _exchange_round(c, lambda: _payload(own, rows, c.rank, classes[c.rank]))
    err: BaseException | None = None
    prep: Prepared | None = None
    flag = 0
    # One pause of the collector from the descriptions to the union's
    # cache, and the intermediates (descriptions, units, the union's
    # items: most of the objects made here) freed before it runs again,
    # so that its next collections meet only what the save keeps.
    with _no_gc():
        ex = _read_exchange(got, rows, auto)
        del got
        whole: dict[tuple[int, int], str] = {}
        if ex.second_round:
            second = functools.partial(_second_payload, own, c.rank, ex)
            whole = _read_second(_exchange_round(c, second), ex)
            del second
        u: Union | None = None
        try:
            u = build_union(ex.states, classes, ex.digests, whole, auto, declared, ex.units)
            prep = _union_prepared(u, own, c.rank)
        except BaseException as e:
            err = e
        del ex, whole
        if err is None and local is not None:
            try:
                flag = local(cast("Prepared", prep))
            except BaseException as e:
                err = e
        out = agree(c, err, (prep.digest if prep else b"\0" * 32) + bytes([flag]), width=33)
        assert prep is not None
        if len({r[:32] for r in out}) != 1:
            raise StateMismatchError(
                "ranks built different union manifests (a bug, or ranks running different "
                "DeepPart versions); nothing was written"
            )
        if fingerprints is not None and u is not None:
            remember(
                c.rank, fingerprints, u, prep.manifest, prep.plan, prep.skeleton, prep.dtensors,
                prep.union, prep.leaves, in_process_options(own.plan_for),
            )  # fmt: skip
        del u
    return prep, any(r[32] for r in out)


def _union_prepared(u: Union, own: _Own, rank: int) -> Prepared:
    """This rank's :class:`Prepared` of the union: the job's manifest and
    plan, this rank's leaves where it holds them (nothing elsewhere)."""
    hg = HolderGroups(u.world)
    # The manifest's leaves: a plain item's description, a block of
    # DTensor shards as its path, dtype and table (each distinct table of
    # shard shapes and holders once: the shards of one layout and dtype).
    # The holder groups are met in item order, as each leaf's would be.
    items: list[dict[str, Any]] = []
    tables: list[list[list[Any]]] = []
    table_of: dict[Any, int] = {}
    for e in u.entries:
        if isinstance(e, ShardBlock):
            # A table per decoded layout, else per distinct list of shard
            # descriptions (by identity: alive in u, the class's).
            if e.layout is not None:
                key: Any = id(e.layout)
                t = table_of.get(key)
                if t is None:
                    t = table_of[key] = len(tables)
                    tables.append([_table_row(shape, hg.field(h)) for _, shape, h in e.layout])
            else:
                shard_descs = [e.descs[s[2]] for s in e.shards]
                key = tuple(map(id, shard_descs))
                t = table_of.get(key)
                if t is None:
                    t = table_of[key] = len(tables)
                    tables.append(
                        [_table_row(d["shape"], hg.field(d["holders"])) for d in shard_descs]
                    )
            items.append({"path": e.path, "dtype": e.dtype, "table": t})
        else:
            items.append({"path": e.path, **e.desc, **hg.field(e.holders)})
    manifest = Manifest.from_leaves(items, hg.groups or None, tables, SHARD_KEY)
    del items, tables, table_of
    plan = own.plan_for(manifest)
    mine = own.prep.leaves
    template = EmptyLeaves(u.entries)
    own_leaves = {
        k: FlatLeaf(template[k].path, mine[i].tensor, mine[i].encoded) for k, i, _ in u.held(rank)
    }
    leaves = OverlaidLeaves(template, own_leaves)
    records, text = _union_records(u)
    digest = save_digest(
        plan, manifest, u.skeleton, own.prep.codec, own.directory, records, records_text=text
    )
    union = {"dtensors": u.records, "versions": u.versions} if u.per_rank else None
    return Prepared(
        leaves, u.skeleton, manifest, plan, own.prep.codec, digest, records, union=union
    )


def _union_records(u: Union) -> tuple[list[DTensorRecord], bytes]:
    """The union's DTensor records and their text for the save's digest
    (:func:`~deeppart.saving.own_structure.records_text`'s, byte for byte).
    A record whose shards are a decoded layout's (``u.layouts``) takes that
    layout's regions and texts, converted once per layout; any other, each
    distinct region object once."""
    converted: dict[int, tuple[Any, Region]] = {}

    def region(raw: Any) -> Region:
        hit = converted.get(id(raw))
        if hit is None or hit[0] is not raw:
            hit = (raw, _region(raw))
            converted[id(raw)] = hit
        return hit[1]

    # Per layout (kept alive by u): its regions and their texts.
    by_layout: dict[int, tuple[list[Region], list[str]]] = {}
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    records: list[DTensorRecord] = []
    parts: list[str] = []
    layouts = u.layouts or [None] * len(u.records)
    for i, (r, layout) in enumerate(zip(u.records, layouts, strict=True)):
        if layout is None:
            rec = u.record(i)
            records.append(DTensorRecord(
                r["path"], r["dtype"], r["shape"],
                [ShardRecord(s["leaf"], region(s["index"])) for s in rec["shards"]],
            ))  # fmt: skip
            parts.append(records_text([rec]).decode())
            continue
        hit = by_layout.get(id(layout))
        if hit is None:
            hit = ([region(s[0]) for s in layout], [dumps(s[0]) for s in layout])
            by_layout[id(layout)] = hit
        first, regions = u.record_shards[i]
        leaves = range(first, first + len(regions))
        records.append(DTensorRecord(
            r["path"], r["dtype"], r["shape"], list(map(ShardRecord, leaves, hit[0]))
        ))  # fmt: skip
        parts.append(dumps([r["path"], r["dtype"], r["shape"], len(regions)]))
        parts.append("".join(map("{}={}".format, leaves, hit[1])))
    return records, "".join(parts).encode()


def _table_row(shape: list[int], field: dict[str, Any]) -> list[Any]:
    """A shard's row of a manifest's shard table: shape, owner, holder group."""
    return [shape, field.get("owner"), field.get("holders")]


def _region(raw: Any) -> Region:
    return Region(tuple(tuple((int(a), int(b)) for a, b in runs) for runs in raw))
