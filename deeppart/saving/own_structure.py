"""A rank's own structure, described once while it is unchanged (issue 46).

Every save's prepare turns the rank's tree into its manifest
(:func:`deeppart.state.dtensor.expand`: each DTensor into the shard leaves
of its layout, with their holders), its description for the exchange
(:class:`~deeppart.state.union.Described`) and its structure fingerprint
(:func:`~deeppart.saving.union_cache.structure_fingerprint`). None of that
depends on the values: it is a function of what :func:`structure_key`
names (each leaf's path and kind, a tensor's dtype and shape, a plain
value's encoded length, a DTensor's global shape, placements and mesh:
:func:`~deeppart.state.dtensor.mesh_identity`), of the skeleton, of
``replica_dims``, the codec, the kind of ``group=`` and the world size.

:func:`describe` keeps this rank's last description and reuses it when
the key and the skeleton are equal to its own (compared whole, not by a
hash), so that a training loop's saves after the first do not expand its
DTensors again (rank 0 of a 512-rank PP x FSDP x TP job holds 273
DTensors described by 15,298 shard leaves: 0.17 s of a cached save's 0.23 s
was their expansion). The values, this save's leaves, are put in afresh
(:meth:`OwnStructure.leaves_of`); a DTensor whose local tensor's shape is
not the one described sends the save down the full description, which
names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deeppart._planner import Manifest, Plan
from deeppart.regions import DTensorRecord, Region
from deeppart.state.dtensor import Expanded, expand, local_tensor, mesh_identity
from deeppart.state.state import FlatLeaf, is_dtensor

__all__ = [
    "OwnStructure",
    "describe",
    "dtensor_records_text",
    "forget",
    "holders_of",
    "records_text",
    "structure_digest",
    "structure_key",
]


def structure_key(
    leaves: Sequence[FlatLeaf], dims: Sequence[str], codec: str, kind: str, world: int
) -> tuple[Any, ...]:
    """What a rank's description depends on apart from its skeleton: per
    leaf its path and, for a plain value, its encoded length; for a tensor
    its dtype and shape; for a DTensor its global shape, placements and
    mesh. Compared whole (the tuples of one mesh are one object, so
    comparing them is O(1))."""
    parts: list[Any] = [tuple(dims), codec, kind, world]
    for lf in leaves:
        t = lf.tensor
        if t is None:
            parts.append((lf.path, len(lf.encoded or b"")))
        elif is_dtensor(t):
            parts.append((lf.path, t.dtype, t.shape, t.placements, mesh_identity(t.device_mesh)))
        else:
            parts.append((lf.path, t.dtype, t.shape))
    return tuple(parts)


@dataclass
class OwnStructure:
    """One rank's description of its tree, apart from the values."""

    key: tuple[Any, ...]
    #: The skeleton :func:`~deeppart.state.state.flatten` gave (compared).
    skeleton_in: Any
    #: The expansion, without its leaves (this structure's saves hold
    #: their own; a description keeps no tensor alive).
    expanded: Expanded
    manifest: Manifest
    #: Per leaf of ``expanded``: the leaf with nothing in it (a shard this
    #: rank does not hold keeps it).
    empty: list[FlatLeaf]
    #: ``(expanded leaf, flattened leaf, number of holders)`` of each leaf
    #: this rank holds data of, in leaf order.
    held: list[tuple[int, int, int]]
    #: Per flattened DTensor leaf this rank holds a shard of: that shard's shape.
    local_shapes: dict[int, tuple[int, ...]]
    #: The description's ``descs`` and ``records``
    #: (:class:`~deeppart.state.union.Described`).
    descs: list[dict[str, Any]]
    records: list[dict[str, Any]]
    #: :func:`~deeppart.saving.union_cache.structure_fingerprint`.
    structure: bytes
    #: Per plan (fingerprint and assignment digest): the part of the save
    #: digest that does not name the save's directory.
    _digests: dict[tuple[str, str, str], bytes] = field(default_factory=dict)

    def leaves_of(self, flat: Sequence[FlatLeaf]) -> list[FlatLeaf] | None:
        """This save's leaves, from its flattened ``flat`` (whose
        :func:`structure_key` is :attr:`key`); None when a DTensor's local
        tensor does not have the shape described."""
        out = list(self.empty)
        for e, i, _ in self.held:
            lf = flat[i]
            if i in self.local_shapes:
                assert lf.tensor is not None  # a DTensor's leaf, by the key
                local = local_tensor(lf.tensor)
                if tuple(local.shape) != self.local_shapes[i]:
                    return None
                out[e] = FlatLeaf(self.empty[e].path, local, None)
            else:
                out[e] = lf
        return out

    def digest_part(self, plan: Plan, codec: str) -> bytes:
        """The save digest's part that is the same for every save of this
        structure, ``plan`` and ``codec`` (:func:`structure_digest`)."""
        key = (plan.fingerprint, plan.assignment_digest(), codec)
        hit = self._digests.get(key)
        if hit is None:
            ex = self.expanded
            text = dtensor_records_text(ex.records)
            hit = structure_digest(plan, self.manifest, ex.skeleton, codec, None, text)
            self._digests = {key: hit}
        return hit


def structure_digest(
    plan: Plan,
    manifest: Manifest,
    skeleton: Any,
    codec: str,
    records_json: Any,
    text: bytes | None = None,
) -> bytes:
    """The part of a save's digest (:func:`deeppart.saving.prepare.save_digest`)
    that names its plan, manifest, skeleton, codec and DTensor records: all
    but the save's directory (``text``: the records' :func:`records_text`,
    when the caller made it; ``records_json`` is then not read)."""
    h = hashlib.sha256()
    h.update(plan.fingerprint.encode())
    h.update(plan.assignment_digest().encode())
    h.update(manifest.fingerprint.encode())
    h.update(json.dumps(skeleton, separators=(",", ":")).encode())
    h.update(codec.encode())
    h.update(text if text is not None else records_text(records_json))
    return h.digest()


def records_text(records_json: Any) -> bytes:
    """DTensor records (their JSON form) as one text for the digest: per
    record its path, dtype, shape and number of shards, then each shard's
    leaf and region; each distinct region object's JSON made once (the
    regions of one layout are shared by its records)."""
    texts: dict[int, tuple[Any, str]] = {}
    parts: list[str] = []
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    for r in records_json:
        shards = r["shards"]
        parts.append(dumps([r["path"], r["dtype"], r["shape"], len(shards)]))
        for s in shards:
            index = s["index"]
            hit = texts.get(id(index))
            if hit is None or hit[0] is not index:
                hit = (index, dumps(index))
                texts[id(index)] = hit
            parts.append(f"{s['leaf']}={hit[1]}")
    return "".join(parts).encode()


def dtensor_records_text(records: Sequence[DTensorRecord]) -> bytes:
    """:func:`records_text` of ``records``' JSON (``DTensorRecord.to_json``),
    made from the records themselves: each distinct region object's JSON
    once (a layout's regions are shared by its records)."""
    texts: dict[int, tuple[Region, str]] = {}
    parts: list[str] = []
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    for r in records:
        parts.append(dumps([r.path, r.dtype, r.shape, len(r.shards)]))
        for s in r.shards:
            region = s.region
            hit = texts.get(id(region))
            if hit is None or hit[0] is not region:
                hit = (region, dumps(region.to_json()))
                texts[id(region)] = hit
            parts.append(f"{s.leaf}={hit[1]}")
    return "".join(parts).encode()


#: Per ``(rank, world size)``: this process's last :class:`OwnStructure`.
_LAST: dict[tuple[int, int], OwnStructure] = {}
_LOCK = threading.Lock()


def forget() -> None:
    """Drops every kept description (the next save describes afresh)."""
    with _LOCK:
        _LAST.clear()


def describe(
    flat: list[FlatLeaf],
    skeleton: Any,
    dims: Sequence[str],
    codec: str,
    kind: str,
    rank: int,
    world: int,
) -> tuple[OwnStructure, list[FlatLeaf]]:
    """This rank's description of its flattened tree and the save's leaves:
    the last one when its key and skeleton are this tree's, else made."""
    from deeppart.saving.union_cache import structure_fingerprint
    from deeppart.state.union import Described

    key = structure_key(flat, dims, codec, kind, world)
    with _LOCK:
        last = _LAST.get((rank, world))
    if last is not None and last.key == key and last.skeleton_in == skeleton:
        leaves = last.leaves_of(flat)
        if leaves is not None:
            return last, leaves
    ex = expand(flat, skeleton, dims)
    manifest = Manifest.from_leaves(ex.descs, ex.groups or None)
    descs: list[dict[str, Any]] = []
    held: list[tuple[int, int, int]] = []
    local_shapes: dict[int, tuple[int, ...]] = {}
    empty: list[FlatLeaf] = []
    # Per owner or holder group: its holders list, shared by its leaves
    # (read only).
    holders_by: dict[tuple[Any, Any], list[int]] = {}
    for e, (leaf, desc) in enumerate(zip(ex.leaves, ex.descs, strict=True)):
        d = dict(desc)
        d.pop("owner", None)
        d.pop("holders", None)
        by = (desc.get("owner"), desc.get("holders"))
        holders = holders_by.get(by)
        if holders is None:
            holders = holders_by[by] = holders_of(desc, ex.groups, world)
        i = ex.origin[e]
        if leaf.encoded is not None or leaf.tensor is not None:
            held.append((e, i, len(holders)))
            if leaf is not flat[i] and leaf.tensor is not None:
                local_shapes[i] = tuple(leaf.tensor.shape)
        if "owner" in desc or "holders" in desc:
            d["holders"] = holders
        descs.append(d)
        empty.append(FlatLeaf(leaf.path, None, None))
    records = [
        {
            "path": rec.path,
            "dtype": rec.dtype,
            "shape": rec.shape,
            "ranks": ranks,
            "shards": [[s.leaf, s.region.to_json()] for s in rec.shards],
        }
        for rec, ranks in zip(ex.records, ex.ranks, strict=True)
    ]
    described = Described(descs, ex.skeleton, records, "")
    out = OwnStructure(
        key=key,
        skeleton_in=skeleton,
        expanded=dataclasses.replace(ex, leaves=[]),
        manifest=manifest,
        empty=empty,
        held=held,
        local_shapes=local_shapes,
        descs=descs,
        records=records,
        structure=structure_fingerprint(described, ex.layouts, codec, kind, world),
    )
    with _LOCK:
        _LAST[(rank, world)] = out
    return out, list(ex.leaves)


def holders_of(desc: dict[str, Any], groups: list[list[int]], world: int) -> list[int]:
    """A leaf's holders from its manifest description."""
    if desc.get("owner") is not None:
        return [int(desc["owner"])]
    if desc.get("holders") is not None:
        return list(groups[desc["holders"]])
    return list(range(world))
