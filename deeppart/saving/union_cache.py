"""The union of a save whose structure is unchanged since the last union save
in this process, reused (issue 46).

A save whose ranks hold different structures (pipeline stages) exchanges
descriptions and builds the union manifest and its plan
(:func:`deeppart.saving.prepare.prepare_save`). Once that succeeds every
rank keeps a :class:`UnionCache`: the union's manifest, plan, DTensor
records and skeleton (not the union itself: only what a save needs), the
*structure fingerprint* of every rank
(:func:`structure_fingerprint`: what determines the union apart from the
values: paths, dtypes, shapes, each DTensor's layout, mesh and placements,
the holders, the codec, the kind of ``group=``, the world size) and this
rank's *check terms*.

The next save's cache column holds this rank's fingerprint, a tag
naming the cached union it would reuse (with the save's directory and
plan; zeros when its own fingerprint changed), its check value and a byte
saying whether part of its check is left to a deferred proof. The ranks
reuse the cache only when every tag is the same and not zeros (the tag
names every rank's fingerprint when the union was made: any rank's
change, a world size that differs, sends every rank down the full path)
and the check values sum to zero; they learn it from one sum (below).

What the fingerprint names, and so what invalidates the cache: a changed
mesh (its shape, its ranks, a DTensor's placements), a new leaf (a new
param group: optimizer state leaves added), a changed dtype or shape, a
world-size change, another codec, another kind of ``group=`` or of replica
proof (``verify_replicas``). Values, the save's directory and the step
do not: the same union and plan are reused with this save's leaves.

Large shared tensors whose proof a save leaves to its caller
(``defer_proof``: an asynchronous save's writer thread, beside a
synchronous save's write; :mod:`deeppart.saving.deferred_proof`) are not
digested in the stall: the row's check value covers the other copies, and
those tensors' terms are summed after their digests are taken, in the
deferred proof's agreement (:func:`check_of`, :func:`checks_hold`): both
sums zero prove every copy the union stores once; a non-zero one prepares
the save again by the full path, each rank's copy its own. When any rank
has such terms every rank joins that agreement.

The ranks learn whether to reuse the cache by one sum over the ranks
(:func:`reuse_terms`, :func:`reuse_agreed`: a fixed 288 bytes whatever
the world size, not a row per rank): the number of ranks that failed, of
ranks with a cached union to reuse, of ``local`` flags and of late checks,
and per 16-bit limb of the tag, of the store's identity and of the check
value, their sum (and for the tag and the identity the sum of squares:
``world * sum(x**2) == sum(x)**2`` exactly when every rank's limb is the
same). The ranks reuse the union when none failed, all have it, the tags
and identities are one and the checks sum to zero modulo the prime; any
other sum sends every rank to the prepare's agreement of full rows, which
decides as before (and raises every failure on every rank). Equal tags
name one cached union, which names every rank's fingerprint when it was
made; a rank has a union to reuse only while its own fingerprint is that
one, so equal tags prove every rank's structure unchanged.

The check proves, without exchanging per-leaf digests, that the holders
of every item the cached union stores once still hold equal copies (the
values change every step; the union's grouping of copies must still be
right). For each such item ``k`` with sorted holders ``h_0 .. h_m``, the
holder at position ``j`` adds ``(g(k, j) - g(k, j + 1 mod (m + 1))) * d``
modulo the prime ``2**127 - 1``, where ``d`` is its digest of its copy and
``g`` a hash: the coefficients of one item sum to zero, so equal copies
add nothing, and copies that differ leave a sum of ``g(k, j) * (d_j -
d_{j-1})`` terms that is zero with a probability of about ``2**-127``. A
copy that differs sends the save down the full path, which stores it as
its rank's own version (or refuses it, with ``verify_replicas=True``).
Copies that were different and became equal stay separate versions in a
reused union: each rank still gets back exactly its own.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from deeppart._planner import Manifest, Plan
from deeppart.regions import SHARD_KEY, DTensorRecord
from deeppart.state.state import FlatLeaf
from deeppart.state.union import (
    Described,
    Digests,
    ShardBlock,
    Union,
    UnionEntry,
    encode_described,
)

__all__ = [
    "CHECK_BYTES",
    "COLUMN_WIDTH",
    "FINGERPRINT_BYTES",
    "LATE_BYTES",
    "PRIME",
    "TAG_BYTES",
    "OverlaidLeaves",
    "UnionCache",
    "cached",
    "check_of",
    "check_terms",
    "check_value",
    "checks_hold",
    "fingerprints_digest",
    "forget",
    "remember",
    "reuse_agreed",
    "reuse_terms",
    "structure_fingerprint",
]

#: The check's modulus: the Mersenne prime ``2**127 - 1``.
PRIME = (1 << 127) - 1
FINGERPRINT_BYTES = 16
TAG_BYTES = 8
CHECK_BYTES = 16
#: 1 when part of this rank's check is left to the deferred proof.
LATE_BYTES = 1
#: Bytes of the cache's part of the first agreement row: fingerprint, tag,
#: check, late.
COLUMN_WIDTH = FINGERPRINT_BYTES + TAG_BYTES + CHECK_BYTES + LATE_BYTES


def structure_fingerprint(
    described: Described, layouts: list[Any], codec: str, kind: str, world: int
) -> bytes:
    """16 bytes naming what determines a rank's part of the union apart
    from its values and the save's directory: its description (paths,
    dtypes, shapes, plain sizes, holders, skeleton; each DTensor by its
    layout: global shape, dtype, mesh, placements), the codec, the kind of
    ``group=`` and the world size."""
    try:
        wire = encode_described(Described(described.descs, described.skeleton,
                                          described.records, ""), layouts)  # fmt: skip
    except ValueError:
        # A record without its layout: the description with its shards.
        wire = {"descs": described.descs, "skeleton": described.skeleton,
                "records": described.records}  # fmt: skip
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    h.update(json.dumps(wire, separators=(",", ":")).encode())
    h.update(f"\0{codec}\0{kind}\0{world}".encode())
    return h.digest()


def _g(item: int, position: int) -> int:
    raw = hashlib.blake2b(
        item.to_bytes(8, "little") + position.to_bytes(8, "little"), digest_size=16
    ).digest()
    return int.from_bytes(raw, "little") % PRIME


def check_terms(u: Union, rank: int) -> list[tuple[int, int]]:
    """``rank``'s check terms of union ``u``: per item stored once for
    several holders, ``rank`` among them, its local leaf and coefficient."""
    out: list[tuple[int, int]] = []
    for k, leaf, holders in u.held(rank):
        if len(holders) < 2:
            continue
        holders = sorted(holders)
        j = bisect.bisect_left(holders, rank)
        coeff = (_g(k, j) - _g(k, (j + 1) % len(holders))) % PRIME
        out.append((leaf, coeff))
    return out


def check_value(terms: list[tuple[int, int]], digests: Digests) -> bytes | None:
    """This rank's check value (:data:`CHECK_BYTES` bytes) from its digests
    of the leaves ``terms`` names; None when one of them has no digest (the
    cache cannot prove it: the save takes the full path)."""
    total = 0
    for leaf, coeff in terms:
        d = digests.samples.get(leaf) or digests.values.get(leaf)
        if d is None:
            return None
        total = (total + coeff * int(d, 16)) % PRIME
    return total.to_bytes(CHECK_BYTES, "little")


def check_of(terms: list[tuple[int, int]], digests: dict[int, bytes]) -> bytes:
    """As :func:`check_value`, of whole-tensor digests as bytes (a deferred
    proof's, by the keys ``terms`` names); raises naming a key without one."""
    total = 0
    for key, coeff in terms:
        d = digests.get(key)
        if d is None:
            raise RuntimeError(f"the deferred proof took no digest of leaf {key} (a bug)")
        total = (total + coeff * int.from_bytes(d, "big")) % PRIME
    return total.to_bytes(CHECK_BYTES, "little")


def checks_hold(values: list[bytes]) -> bool:
    """Whether every rank's check value (one each) sums to zero: every copy
    they cover is equal among its holders."""
    return sum(int.from_bytes(v, "little") for v in values) % PRIME == 0


@dataclass
class UnionCache:
    """What one rank keeps of its last union save (see the module docstring)."""

    #: Every rank's structure fingerprint, in rank order, as one digest.
    fingerprints: bytes
    #: This rank's structure fingerprint.
    fingerprint: bytes
    #: Names the cached union (its manifest, plan and the fingerprints).
    ident: bytes
    manifest: Manifest
    plan: Plan
    skeleton: Any
    records: list[DTensorRecord]
    #: ``Prepared.union``: metadata.json's version 3 keys (or None).
    union_meta: dict[str, Any] | None
    #: Per union item: a leaf of its path holding nothing (this rank's
    #: leaves are put in by :attr:`held`).
    template: Sequence[FlatLeaf]
    #: ``(union item, local leaf)`` of every item this rank holds.
    held: list[tuple[int, int]]
    #: :func:`check_terms` of this rank.
    terms: list[tuple[int, int]]
    #: The planning options whose in-process planning made :attr:`plan`
    #: (deterministic: a save planning with equal options reuses it without
    #: looking it up); None when it came from a given plan or a service.
    planned_with: Any = None


class _ReadOnlyLeaves(Sequence[FlatLeaf]):
    """A read-only sequence of leaves made by :meth:`_leaf` (``k`` in
    range, not negative)."""

    __slots__ = ()

    def _leaf(self, k: int) -> FlatLeaf:
        raise NotImplementedError

    @overload
    def __getitem__(self, k: int) -> FlatLeaf: ...
    @overload
    def __getitem__(self, k: slice) -> list[FlatLeaf]: ...
    def __getitem__(self, k: int | slice) -> FlatLeaf | list[FlatLeaf]:
        n = len(self)
        if isinstance(k, slice):
            return [self._leaf(i) for i in range(*k.indices(n))]
        if not -n <= k < n:
            raise IndexError("leaf index out of range")
        return self._leaf(k % n)


class EmptyLeaves(_ReadOnlyLeaves):
    """One leaf holding nothing per item of a union (its path only), made
    as it is read: a union's blocks of DTensor shards
    (:class:`~deeppart.state.union.ShardBlock`, most of its 911,736 items at
    4,096 ranks) are not made into a leaf each unless a reader walks them
    all, which then keeps the list it made. Read-only."""

    __slots__ = ("_all", "_entries", "_starts")

    def __init__(self, entries: Sequence[UnionEntry]) -> None:
        self._entries = entries
        starts: list[int] = []
        n = 0
        for e in entries:
            starts.append(n)
            n += len(e) if isinstance(e, ShardBlock) else 1
        starts.append(n)
        self._starts = starts
        self._all: list[FlatLeaf] | None = None

    def __len__(self) -> int:
        return self._starts[-1]

    def _leaf(self, k: int) -> FlatLeaf:
        if self._all is not None:
            return self._all[k]
        at = bisect.bisect_right(self._starts, k) - 1
        e = self._entries[at]
        if isinstance(e, ShardBlock):
            return FlatLeaf((*e.path, SHARD_KEY, k - self._starts[at]), None, None)
        return FlatLeaf(tuple(e.path), None, None)

    def __iter__(self) -> Iterator[FlatLeaf]:
        if self._all is None:
            out: list[FlatLeaf] = []
            for e in self._entries:
                if isinstance(e, ShardBlock):
                    base = tuple(e.path)
                    out.extend(FlatLeaf((*base, SHARD_KEY, j), None, None) for j in range(len(e)))
                else:
                    out.append(FlatLeaf(tuple(e.path), None, None))
            self._all = out
        return iter(self._all)


class OverlaidLeaves(_ReadOnlyLeaves):
    """The leaves of a union save: a template holding nothing (one leaf
    per union item: :class:`EmptyLeaves`, which a save that reuses the
    cached union shares as :attr:`UnionCache.template`, never changed) with
    this rank's own leaves in their items' places. Reads as the list of
    them would, without a copy of the template (911,736 items at 4,096
    ranks, which each save would copy and the garbage collector then
    walk); read-only."""

    __slots__ = ("_own", "_template")

    def __init__(self, template: Sequence[FlatLeaf], own: dict[int, FlatLeaf]) -> None:
        if any(not 0 <= k < len(template) for k in own):
            raise IndexError("an own leaf outside the template (a bug)")
        self._template = template
        self._own = own

    def __len__(self) -> int:
        return len(self._template)

    def _leaf(self, k: int) -> FlatLeaf:
        own = self._own.get(k)
        return own if own is not None else self._template[k]

    def holding_nothing(self) -> Sequence[FlatLeaf]:
        """These leaves with this rank's own holding nothing: the template
        itself (shared, never changed; not a copy)."""
        return self._template

    def __iter__(self) -> Iterator[FlatLeaf]:
        if not self._own:
            return iter(self._template)
        own = self._own
        return (own.get(k, leaf) for k, leaf in enumerate(self._template))


#: Per ``(rank, world size)``: the last union save's cache in this process.
_CACHES: dict[tuple[int, int], UnionCache] = {}


def fingerprints_digest(fingerprints: list[bytes]) -> bytes:
    """One digest of every rank's structure fingerprint, in rank order."""
    return hashlib.blake2b(b"".join(fingerprints), digest_size=16).digest()


def remember(
    rank: int,
    fingerprints: list[bytes],
    u: Union,
    manifest: Manifest,
    plan: Plan,
    skeleton: Any,
    records: list[DTensorRecord],
    union_meta: dict[str, Any] | None,
    leaves: Sequence[FlatLeaf],
    planned_with: Any = None,
) -> UnionCache:
    """Keeps ``rank``'s cache of a union save that every rank agreed on
    (``leaves``: that save's, one per union item; those holding nothing are
    kept, not made again)."""
    world = len(fingerprints)
    everyone = fingerprints_digest(fingerprints)
    ident = hashlib.blake2b(
        everyone + manifest.fingerprint.encode() + plan.fingerprint.encode(), digest_size=16
    ).digest()
    held = [(k, i) for k, i, _ in u.held(rank)]
    if isinstance(leaves, OverlaidLeaves):
        template = leaves.holding_nothing()
    else:
        template = list(leaves)
        for k, _ in held:
            template[k] = FlatLeaf(template[k].path, None, None)
    entry = UnionCache(
        everyone, fingerprints[rank], ident, manifest, plan, skeleton, records, union_meta,
        template, held, check_terms(u, rank), planned_with,
    )  # fmt: skip
    _CACHES[(rank, world)] = entry
    return entry


def cached(rank: int, world: int, fingerprint: bytes) -> UnionCache | None:
    """``rank``'s cache when its own structure fingerprint is unchanged."""
    entry = _CACHES.get((rank, world))
    if entry is None or entry.fingerprint != fingerprint:
        return None
    return entry


def forget() -> None:
    """Drops every cached union of this process."""
    _CACHES.clear()


#: 16-bit limbs of a tag, of a store identity, of a check value.
_TAG_LIMBS = TAG_BYTES // 2
_IDENTITY_LIMBS = 8
_CHECK_LIMBS = CHECK_BYTES // 2
#: :func:`reuse_terms`' length: four counts; sums and sums of squares of
#: the tag's and the identity's limbs; sums of the check's limbs.
REUSE_TERMS = 4 + 2 * _TAG_LIMBS + 2 * _IDENTITY_LIMBS + _CHECK_LIMBS


def _limbs(data: bytes) -> npt.NDArray[np.int64]:
    return np.frombuffer(data, dtype="<u2").astype(np.int64)


def reuse_terms(failed: bool, column: bytes, flag: int, identity: bytes) -> npt.NDArray[np.int64]:
    """This rank's terms of the sum that decides whether every rank reuses
    its cached union (see the module docstring): ``column`` is this rank's
    cache column (fingerprint, tag, check, late byte), its tag zeros when
    it has no union to reuse; ``identity``: the digest of the store it
    addresses (16 bytes)."""
    out = np.zeros(REUSE_TERMS, dtype=np.int64)
    if failed:
        out[0] = 1
        return out
    tag = column[FINGERPRINT_BYTES : FINGERPRINT_BYTES + TAG_BYTES]
    check = column[FINGERPRINT_BYTES + TAG_BYTES : FINGERPRINT_BYTES + TAG_BYTES + CHECK_BYTES]
    if len(identity) != 2 * _IDENTITY_LIMBS:
        raise ValueError(f"a store identity of {len(identity)} bytes, not {2 * _IDENTITY_LIMBS}")
    out[1] = int(any(tag))
    out[2] = int(flag != 0)
    out[3] = column[-1]
    t, i = _limbs(tag), _limbs(identity)
    at = 4
    for part in (t, t * t, i, i * i, _limbs(check)):
        out[at : at + part.size] = part
        at += part.size
    return out


def reuse_agreed(total: npt.NDArray[np.int64], world: int) -> tuple[bool, bool, bool]:
    """From every rank's :func:`reuse_terms` summed: whether every rank
    reuses its cached union, whether some rank left part of its check to
    the deferred proof, whether some rank's ``local`` flag is set."""
    failed, have, flags, late = (int(x) for x in total[:4])
    at = 4

    def take(n: int) -> list[int]:
        nonlocal at
        out = [int(x) for x in total[at : at + n]]
        at += n
        return out

    tag, tag_sq = take(_TAG_LIMBS), take(_TAG_LIMBS)
    ident, ident_sq = take(_IDENTITY_LIMBS), take(_IDENTITY_LIMBS)
    check = take(_CHECK_LIMBS)
    pairs = [*zip(tag, tag_sq, strict=True), *zip(ident, ident_sq, strict=True)]
    one = all(world * q == s * s for s, q in pairs)
    check_sum = sum(v << (16 * k) for k, v in enumerate(check))
    reuse = not failed and have == world and one and check_sum % PRIME == 0
    return reuse, late > 0, flags > 0
