"""Stage 2 of a save: prepare. Each rank flattens its state into leaves,
describes them as a :class:`~deeppart.Manifest`, gets the plan
(:mod:`deeppart.planning`), and digests everything the ranks must agree on.
:func:`agree_prepared` then checks, in one collective, that no rank failed
and that all ranks prepared the same save; :func:`verify_replicas`
(optional) checks that their copies of the state hold the same bytes.
Nothing is written before both pass.

DTensors become shard leaves held by a subset of the ranks
(:mod:`deeppart.dtensor`). Leaves that every rank holds are also sampled
(:func:`replica_sample`: a few bytes of each, hashed) and the samples
compared in the same collective: ranks that pass different tensors at one
path, e.g. DTensor shards converted with ``to_local()``, fail by default.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deeppart._planner import Manifest, Plan
from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.compression import check_codec
from deeppart.dtensor import expand
from deeppart.errors import CheckpointError, ReplicaMismatchError, StateMismatchError
from deeppart.regions import DTensorRecord
from deeppart.state import FlatLeaf, check_has_data, flatten
from deeppart.tensors import U8, readable, u8_view

__all__ = [
    "AGREE_WIDTH",
    "Prepared",
    "StagedPiece",
    "agree_prepared",
    "agree_prepared_flags",
    "prepare",
    "refuse_sharded",
    "replica_sample",
    "sample_bytes",
    "save_digest",
    "verify_replicas",
]

#: Bytes of each rank's row in the prepare agreement (digest, sample digest).
AGREE_WIDTH = 48

#: Bytes of each sampled block, and the blocks per leaf (start, middle, end).
SAMPLE_BYTES = 64
SAMPLE_BLOCKS = 3


@dataclass(frozen=True)
class StagedPiece:
    """The raw bytes of one of this rank's planned pieces, held apart from
    the live state (an asynchronous save's snapshot, :mod:`deeppart.snapshot`)."""

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

    leaves: list[FlatLeaf]
    skeleton: Any
    manifest: Manifest
    plan: Plan
    codec: str
    digest: bytes
    #: The sharded tensors (DTensors) among the leaves.
    dtensors: list[DTensorRecord] = field(default_factory=list)
    #: Per leaf held by every rank: 8 bytes of the hash of its sampled bytes.
    samples: dict[int, bytes] = field(default_factory=dict)
    #: An asynchronous save's snapshot of this rank's pieces (:mod:`deeppart.snapshot`).
    staged: list[StagedPiece] | None = None

    @property
    def sample(self) -> bytes:
        """One 16-byte digest of :attr:`samples`, compared across the ranks."""
        h = hashlib.blake2b(digest_size=16)
        for i in sorted(self.samples):
            h.update(self.samples[i])
        return h.digest()


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


def prepare(
    state: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Path,
) -> Prepared:
    """Flattens ``state``, plans it with ``plan_for`` and digests what the
    ranks must agree on (plan, manifest, skeleton, codec, ``directory``)."""
    codec = check_codec(compression)
    flat, skeleton = flatten(state)
    check_has_data(flat)
    ex = expand(flat, skeleton)
    leaves, skeleton = ex.leaves, ex.skeleton
    manifest = Manifest.from_leaves(ex.descs, ex.groups or None)
    plan = plan_for(manifest)
    digest = save_digest(plan, manifest, skeleton, codec, directory, ex.records)
    samples = replica_sample(leaves, ex.descs)
    return Prepared(leaves, skeleton, manifest, plan, codec, digest, ex.records, samples)


def save_digest(
    plan: Plan,
    manifest: Manifest,
    skeleton: Any,
    codec: str,
    directory: Path,
    records: list[DTensorRecord],
) -> bytes:
    """The digest of what all ranks of one save must agree on."""
    h = hashlib.sha256()
    h.update(plan.fingerprint.encode())
    h.update(plan.assignment_digest().encode())
    h.update(manifest.fingerprint.encode())
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    h.update(codec.encode())
    h.update(os.path.abspath(directory).encode())
    h.update(json.dumps([r.to_json() for r in records], separators=(",", ":")).encode())
    return h.digest()


def refuse_sharded(prep: Prepared, where: str) -> None:
    """Raises for a state holding DTensors in a path that does not store
    their global regions yet (the multi-level backends)."""
    if prep.dtensors:
        names = ", ".join("/".join(map(str, r.path)) for r in prep.dtensors[:3])
        raise CheckpointError(
            f"{where} cannot save DTensor state yet ({names}); nothing was written. "
            "Save it with deeppart.save or deeppart.Checkpointer without config= (they "
            "store each shard's global region and reshard on load), or pass "
            "get_state_dict(..., options=StateDictOptions(full_state_dict=True))"
        )


def agree_prepared(
    c: Comm, err: BaseException | None, prep: Prepared | None, samples: bool = True
) -> Prepared:
    """Every rank raises if any failed to prepare, or if ranks disagree on
    the state's structure, plan, codec or directory (nothing written yet);
    with ``samples``, also if the sampled bytes of the leaves every rank
    holds differ (:class:`ReplicaMismatchError`)."""
    return agree_prepared_flags(c, err, prep, samples=samples)[0]


def agree_prepared_flags(
    c: Comm,
    err: BaseException | None,
    prep: Prepared | None,
    flag: int | None = None,
    samples: bool = True,
) -> tuple[Prepared, list[int]]:
    """:func:`agree_prepared`, in the same collective sharing one byte
    ``flag`` of each rank (when given; an empty list otherwise)."""
    extra = b"" if flag is None else bytes([flag])
    mine = (prep.digest + prep.sample if prep else b"\0" * AGREE_WIDTH) + extra
    rows = agree(c, err, mine, width=AGREE_WIDTH + len(extra))
    flags = [row[AGREE_WIDTH] for row in rows] if flag is not None else []
    assert prep is not None
    digests = [row[:32] for row in rows]
    if len(set(digests)) != 1:
        groups: dict[bytes, list[int]] = {}
        for r, d in enumerate(digests):
            groups.setdefault(d, []).append(r)
        desc = "; ".join(f"ranks {v}" for v in groups.values())
        raise StateMismatchError(
            "ranks disagree on the state's structure, its plan, the codec or the directory "
            f"(groups of agreeing ranks: {desc}); nothing was written. If the state holds "
            "shards of DTensors converted with to_local(), pass the DTensors themselves "
            "(get_state_dict(model, optimizer) returns them). With get_state_dict(..., "
            "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) only rank 0 "
            "holds the values: save the sharded state (the default options; every rank writes "
            "its part), or pass full_state_dict=True without cpu_offload. If groups of ranks "
            "hold different states on purpose (two data-parallel groups, plain tensor-parallel "
            "shards), pass group=<this rank's replica group> or group=\"auto\" (deeppart.groups)"
        )
    if samples and len({row[32:48] for row in rows}) != 1:
        _replicas_differ(c, prep)
    return prep, flags


def _replicas_differ(c: Comm, prep: Prepared) -> None:
    """The sampled bytes of leaves every rank holds differ: every rank
    raises ReplicaMismatchError naming the leaves (one more collective)."""
    mine = b"".join(prep.samples[i] for i in sorted(prep.samples))
    per_rank = c.allgather_varbytes(mine)
    order = sorted(prep.samples)
    differ: list[str] = []
    for k, i in enumerate(order):
        seen = [row[8 * k : 8 * k + 8] for row in per_rank]
        if len(set(seen)) > 1:
            common = max(set(seen), key=seen.count)
            ranks = [r for r, x in enumerate(seen) if x != common]
            where = "/".join(map(str, prep.leaves[i].path))
            differ.append(f"{where} on rank(s) {', '.join(map(str, ranks))}")
    raise ReplicaMismatchError(
        f"{len(differ)} tensor leaves that every rank passes differ between the ranks "
        f"(sampled bytes; first: {', '.join(differ[:5])}); nothing was written. If these are "
        "shards of DTensors (to_local() or ._local_tensor), pass the DTensors themselves "
        "(get_state_dict(model, optimizer) returns them) and each rank saves its shard, or pass "
        "them with group=<this rank's data-parallel replica group> (deeppart.groups); if groups "
        "of ranks hold their own values, pass group= or give each group's leaves their own key "
        "prefix"
    )


def _differing_shards(
    per_rank: list[bytes], n: int, shards: set[int]
) -> list[tuple[int, list[int]]]:
    """Like ``differing_leaves``, but a shard leaf's digests are compared
    among the ranks that hold it (a non-holder's digest is that of no
    bytes; an empty shard has nothing to compare)."""
    from deeppart._planner import REPLICA_DIGEST_LEN as width
    from deeppart._planner import replica_digests

    empty = replica_digests([memoryview(b"")])
    out: list[tuple[int, list[int]]] = []
    for i in range(n):
        seen = [row[i * width : (i + 1) * width] for row in per_rank]
        ranks = [r for r, d in enumerate(seen) if i not in shards or d != empty]
        kinds = [seen[r] for r in ranks]
        if len(set(kinds)) > 1:
            common = max(set(kinds), key=kinds.count)
            out.append((i, [r for r in ranks if seen[r] != common]))
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
    """Hashes every leaf on every rank (BLAKE3 in the Rust core, GIL
    released) and compares one digest of them all across the ranks in one
    collective. If they differ, the per-leaf digests are exchanged and
    every rank raises :class:`ReplicaMismatchError` naming the leaves whose
    copies differ and the ranks that differ from the majority.

    A DTensor shard is compared across its holders (the ranks that hold
    it; the others hash nothing for it): with sharded state the per-leaf
    digests are always exchanged (16 bytes a leaf)."""
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
    rows = agree(c, err, summary, width=16)
    if not prep.dtensors and len(set(rows)) == 1:
        return
    per_rank = c.allgather_varbytes(digests)
    if prep.dtensors:
        shards = {s.leaf for r in prep.dtensors for s in r.shards}
        differ = _differing_shards(per_rank, len(prep.leaves), shards)
        if not differ:
            return
    else:
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
