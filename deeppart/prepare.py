"""Stage 2 of a save: prepare. Each rank flattens its state into leaves,
describes them as a :class:`~deeppart.Manifest`, gets the plan
(:mod:`deeppart.planning`), and digests everything the ranks must agree on.
:func:`agree_prepared` then checks, in one collective, that no rank failed
and that all ranks prepared the same save; :func:`verify_replicas`
(optional) checks that their copies of the state hold the same bytes.
Nothing is written before both pass.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deeppart._planner import Manifest, Plan
from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.compression import check_codec
from deeppart.errors import ReplicaMismatchError, StateMismatchError
from deeppart.state import FlatLeaf, check_has_data, describe_leaf, flatten
from deeppart.tensors import U8, readable, u8_view

__all__ = [
    "Prepared",
    "StagedPiece",
    "agree_prepared",
    "agree_prepared_flags",
    "prepare",
    "verify_replicas",
]


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
    staged: list[StagedPiece] | None = None


def prepare(
    state: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Path,
) -> Prepared:
    """Flattens ``state``, plans it with ``plan_for`` and digests what the
    ranks must agree on (plan, manifest, skeleton, codec, ``directory``)."""
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
    return Prepared(leaves, skeleton, manifest, plan, codec, h.digest())


def agree_prepared(c: Comm, err: BaseException | None, prep: Prepared | None) -> Prepared:
    """Every rank raises if any failed to prepare, or if ranks disagree on
    the state's structure, plan, codec or directory (nothing written yet)."""
    return agree_prepared_flags(c, err, prep)[0]


def agree_prepared_flags(
    c: Comm, err: BaseException | None, prep: Prepared | None, flag: int | None = None
) -> tuple[Prepared, list[int]]:
    """:func:`agree_prepared`, in the same collective sharing one byte
    ``flag`` of each rank (when given; an empty list otherwise)."""
    extra = b"" if flag is None else bytes([flag])
    rows = agree(c, err, (prep.digest if prep else b"\0" * 32) + extra, width=32 + len(extra))
    digests = [row[:32] for row in rows]
    flags = [row[32] for row in rows] if flag is not None else []
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
    return prep, flags


def _leaf_buffer(leaf: FlatLeaf) -> U8 | memoryview:
    if leaf.tensor is None:
        assert leaf.encoded is not None
        return memoryview(leaf.encoded)
    return u8_view(readable(leaf.tensor))


def verify_replicas(c: Comm, prep: Prepared) -> None:
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
    rows = agree(c, err, summary, width=16)
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
