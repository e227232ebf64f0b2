"""The job's checkpoint as the union of what every rank holds (issue 32).

Each rank passes its own tree. A rank describes what it holds (a
:class:`Described`: its leaves' paths, dtypes and shapes or plain sizes,
each DTensor shard with the global ranks that hold it, its skeleton) and
digests what it holds (:class:`Digests`: a hash of each plain value, a
digest of the whole bytes of each tensor it shares with other ranks). Ranks with the
same structure form one *class*, and only the lowest rank of a class sends
its description (:mod:`deeppart.saving.prepare` does the exchange); from the
descriptions and digests :func:`build_union` computes, alike on every rank,
the job's manifest: each distinct item with the ranks that hold it.

Under one path the ranks may hold several *versions*:

- a plain value: ranks whose encodings differ (a data loader's position,
  an RNG state) each keep their own; ranks with equal values share one;
- a plain tensor: every holder's copy is compared by the digest of its
  whole bytes, whatever the ranks' structures (issue 49: replicas are
  proved, not sampled): ranks with equal copies share one item, a copy
  that differs anywhere is kept as its ranks' own version (an RNG state,
  each rank's own tensor). With ``declared`` (``verify_replicas=True``) a
  difference is refused instead (:class:`ReplicaMismatchError`);
- a DTensor: its holders come from its own mesh (plus the declared
  ``replica_dims``). Classes holding it with the same holders hold the same
  item; holders from disjoint meshes with the same regions are compared by
  whole-shard digests (equal: one item with merged holders; different:
  distinct versions, e.g. pipeline stages that reuse module names).

A path with several versions is stored as one leaf (or one DTensor record)
per version, under ``path + ("<version>", k)``, and ``metadata.json``'s
``versions`` records name each version's saved ranks (docs/FORMAT.md).
Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deeppart.errors import ReplicaMismatchError, StateMismatchError
from deeppart.regions import SHARD_KEY
from deeppart.state.dtensor import Layout, layout_regions, renumber_skeleton

__all__ = [
    "VERSION_KEY",
    "Described",
    "Digests",
    "GroupLeaf",
    "ShardBlock",
    "Union",
    "UnionEntry",
    "UnionItem",
    "build_union",
    "decode_described",
    "describe_versions",
    "encode_described",
    "forget_decoded",
    "merge_skeletons",
    "units_of",
    "whole_digests_needed",
]

#: The path key under which the versions of one path are stored:
#: ``("loader", "pos", "<version>", 1)``.
VERSION_KEY = "<version>"


@dataclass
class Described:
    """One rank's description of what it holds (the same on every rank of
    its class; JSON-able)."""

    #: Per local leaf: ``path`` and ``dtype``/``shape`` (a tensor) or
    #: ``kind="object"``/``nbytes``; a DTensor shard also ``holders``: the
    #: sorted global ranks that hold it.
    descs: list[dict[str, Any]]
    #: The rank's skeleton (local leaf indices).
    skeleton: Any
    #: Its DTensors: ``path``, ``dtype``, ``shape``, ``ranks`` (the ranks of
    #: the mesh that holds it) and ``shards``: ``[local leaf, region]``.
    records: list[dict[str, Any]] = field(default_factory=list)
    #: Digest of the codec, the directory and the kind of ``group=`` (all
    #: ranks must agree).
    common: str = ""


def encode_described(described: Described, layouts: Sequence[Layout | None]) -> dict[str, Any]:
    """``described`` as it travels in the exchange: its DTensors by what
    determines their shards (global shape, dtype, the mesh's ranks, which
    mesh dimensions the placements run over, the placements: ``layouts``,
    one per record), not by their shards, so that its size grows with the
    DTensors, not with the ranks. :func:`decode_described` gives back the
    same description (the shards, their regions and holders derived from
    each layout, cached per layout)."""
    meshes: dict[tuple[Any, ...], int] = {}
    kinds: dict[tuple[Any, ...], int] = {}
    records: list[list[Any]] = []
    shard_leaves: set[int] = set()
    for rec, layout in zip(described.records, layouts, strict=True):
        if layout is None:
            raise ValueError("a record without its layout cannot be sent by layout")
        key_ranks, _ranks, dims, specs, _shape = layout
        mesh = meshes.setdefault(key_ranks, len(meshes))
        kind = kinds.setdefault((mesh, tuple(dims), specs), len(kinds))
        leaves = [leaf for leaf, _ in rec["shards"]]
        first = leaves[0]
        if leaves != list(range(first, first + len(leaves))):
            raise ValueError("a DTensor's shard leaves are not consecutive")
        shard_leaves.update(leaves)
        records.append([rec["path"], rec["dtype"], rec["shape"], first, kind])
    return {
        "descs": [d for i, d in enumerate(described.descs) if i not in shard_leaves],
        "skeleton": described.skeleton,
        "records": records,
        "layouts": [[m, list(dims), [list(p) if p else None for p in specs]]
                    for (m, dims, specs) in kinds],
        "meshes": [[list(shape), list(flat)] for shape, flat in meshes],
        "common": described.common,
    }  # fmt: skip


#: Per layout: its shards as a description lists them (region JSON, region
#: shape, holders), shared by every class and save that decodes it.
_SHARDS: OrderedDict[tuple[Any, ...], list[tuple[Any, list[int], list[int]]]] = OrderedDict()
_SHARDS_CACHE = 4096


def forget_decoded() -> None:
    """Drops the decoded layouts' shards (the next decode derives them
    afresh, as a new process does)."""
    _SHARDS.clear()


def _layout_shards(layout: Layout) -> list[tuple[Any, list[int], list[int]]]:
    key_ranks, _ranks, dims, specs, shape = layout
    key = (key_ranks, tuple(dims), specs, shape)
    hit = _SHARDS.get(key)
    if hit is not None:
        _SHARDS.move_to_end(key)
        return hit
    out = [(r.to_json(), list(r.shape), h) for r, h in layout_regions(*layout)]
    _SHARDS[key] = out
    if len(_SHARDS) > _SHARDS_CACHE:
        _SHARDS.popitem(last=False)
    return out


def decode_described(wire: dict[str, Any]) -> Described:
    """The :class:`Described` that :func:`encode_described` sent, except
    that a DTensor shard's description has no ``path`` (its record names
    the DTensor's; shard ``k``'s is that path and ``"<shard>", k``) and is
    shared by the shards of equal layout and dtype: read it, never change
    it."""
    import numpy as np

    meshes: list[tuple[tuple[Any, ...], Any, list[int]]] = []
    for shape, flat in wire["meshes"]:
        key = (tuple(int(n) for n in shape), tuple(int(r) for r in flat))
        arr = np.asarray(key[1], dtype=np.int64).reshape(key[0])
        meshes.append((key, arr, sorted(key[1])))
    kinds = [
        (int(m), [int(d) for d in dims], tuple((int(p[0]), int(p[1])) if p else None for p in sp))
        for m, dims, sp in wire["layouts"]
    ]
    plain: list[dict[str, Any]] = wire["descs"]
    order = sorted(wire["records"], key=lambda r: int(r[3]))
    descs: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    by_first: dict[int, dict[str, Any]] = {}
    # Per layout's shards and dtype: the shards' descriptions, shared by
    # every DTensor of that layout and dtype (with the shards, kept alive).
    shared: dict[tuple[int, str], tuple[Any, list[dict[str, Any]]]] = {}
    at = 0
    for path, dtype, shape, first, kind in order:
        mesh, dims, specs = kinds[int(kind)]
        key_ranks, arr, members = meshes[mesh]
        gshape = tuple(int(n) for n in shape)
        shards = _layout_shards((key_ranks, arr, dims, specs, gshape))
        first = int(first)
        before = first - len(descs)  # plain leaves before this record's shards
        if before < 0 or at + before > len(plain):
            raise StateMismatchError("a description's DTensor records overlap (a bug)")
        descs.extend(plain[at : at + before])
        at += before
        hit = shared.get((id(shards), dtype))
        if hit is None:
            made = [{"dtype": dtype, "shape": rshape, "holders": h} for _, rshape, h in shards]
            hit = shared[(id(shards), dtype)] = (shards, made)
        n = len(descs)
        leaves = [[n + k, s[0]] for k, s in enumerate(shards)]
        descs.extend(hit[1])
        rec = {
            "path": path, "dtype": dtype, "shape": shape, "ranks": members, "shards": leaves,
            # The layout's shards (region JSON, shape, holders), shared by
            # every DTensor of that layout: the records and the save's
            # digest convert each region once per layout, not per shard.
            "layout": shards,
        }  # fmt: skip
        records.append(rec)
        by_first[first] = rec
    descs.extend(plain[at:])
    # Records in the order the rank described them.
    ordered = [by_first[int(r[3])] for r in wire["records"]]
    return Described(descs, wire["skeleton"], ordered, wire["common"])


@dataclass
class Digests:
    """One rank's digests of what it holds, by local leaf (hex strings)."""

    #: Plain values: a hash of the encoding.
    values: dict[int, str] = field(default_factory=dict)
    #: Tensors (and shards) that other ranks hold too: the xxh3_128 digest
    #: of their whole bytes (``deeppart.saving.digests.tensor_digest``; the name
    #: is kept from when they were sampled).
    samples: dict[int, str] = field(default_factory=dict)
    #: The leaves whose plain values differ from this rank's class's lowest
    #: rank's, when the exchange says so (the ones it sent again); None:
    #: found by comparing ``values`` with that rank's.
    differs: set[int] | None = None


class GroupLeaf(Mapping[int, int]):
    """A union item's source where one group of ranks holds it at one
    local leaf (a plain value alike on all of a class's ranks: its
    thousands of ranks are not made into a dict per item): read-only,
    equal to ``dict.fromkeys(ranks, leaf)``."""

    __slots__ = ("_ranks", "_set", "leaf")

    def __init__(self, ranks: list[int], leaf: int) -> None:
        self._ranks = ranks
        self._set: frozenset[int] | None = None
        self.leaf = leaf

    def _members(self) -> frozenset[int]:
        if self._set is None:
            self._set = frozenset(self._ranks)
        return self._set

    def __getitem__(self, rank: int) -> int:
        if rank in self._members():
            return self.leaf
        raise KeyError(rank)

    def get(self, rank: int, default: Any = None) -> Any:
        return self.leaf if rank in self._members() else default

    def __contains__(self, rank: object) -> bool:
        return rank in self._members()

    def __iter__(self) -> Iterator[int]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def __repr__(self) -> str:
        return f"GroupLeaf({self._ranks!r}, {self.leaf})"


@dataclass(slots=True)
class UnionItem:
    """One leaf of the job's manifest (slotted: a union makes one per
    stored shard, hundreds of thousands at scale)."""

    #: The stored path (with ``"<version>", k`` when its path has several).
    path: list[Any]
    #: The manifest description without holders (``dtype``/``shape`` or
    #: ``kind``/``nbytes``); a shard's is shared with the shards of equal
    #: dtype and region: read it, never change it.
    desc: dict[str, Any]
    holders: list[int]
    #: Per holder: its local leaf index (read only).
    source: Mapping[int, int]


@dataclass(slots=True)
class ShardBlock:
    """Consecutive union items: the shards of one DTensor version that one
    class describes whole (every holder of every shard is of that class, as
    a pipeline stage's own mesh holds its DTensors), which are most of a
    union's items at scale. Its items are made only when asked for
    (:meth:`item`); the save reads the block itself."""

    #: The version's stored path (shard ``k``'s: ``path + [SHARD_KEY, k]``).
    path: list[Any]
    dtype: str
    #: Per shard, as the class describes it: (region, sorted holders,
    #: the class's local leaf); the regions and holders lists are shared
    #: by the DTensors of one layout (read them, never change them).
    shards: list[tuple[Any, list[int], int]]
    #: The class's leaf descriptions, by local leaf (a shard's: ``dtype``,
    #: ``shape``, ``holders``; shared likewise).
    descs: list[dict[str, Any]]
    #: The class's ranks (every holder is one of them).
    ranks: frozenset[int]
    #: The decoded layout's shards (region JSON, shape, holders) that
    #: ``shards`` are, in order, when the class's description was decoded
    #: (:func:`decode_described`), else None.
    layout: Any = None

    def __len__(self) -> int:
        return len(self.shards)

    def item(self, k: int) -> UnionItem:
        """Shard ``k`` as the :class:`UnionItem` it stands for."""
        _region, holders, leaf = self.shards[k]
        d = self.descs[leaf]
        return UnionItem(
            [*self.path, SHARD_KEY, k],
            {"dtype": d["dtype"], "shape": d["shape"]},
            holders,
            dict.fromkeys(holders, leaf),
        )

    def held_by(self, rank: int) -> Iterator[tuple[int, int]]:
        """(shard, local leaf) of each shard that ``rank`` holds."""
        if rank not in self.ranks:
            return
        for k, (_region, holders, leaf) in enumerate(self.shards):
            if rank in holders:
                yield k, leaf


#: One entry of a union: an item, or a block of DTensor shards.
UnionEntry = UnionItem | ShardBlock


@dataclass
class Union:
    """The job's manifest items (as entries: items and blocks of shards),
    skeleton, DTensor records and versions."""

    entries: Sequence[UnionEntry]
    skeleton: Any
    #: DTensor records without their shards (``path``, ``dtype``,
    #: ``shape``, ``ranks``): :meth:`record` adds them, and so does the
    #: metadata (:func:`deeppart.saving.metadata.dtensor_keys`, from the
    #: save's DTensor records).
    records: list[dict[str, Any]]
    #: Per path with several versions: ``{"path", "ranks": [[...], ...],
    #: "leaves": [...]}`` or ``"records": [...]`` (one per version).
    versions: list[dict[str, Any]]
    world: int
    #: Per record: the decoded layout's shards its shards are, in order
    #: (a block's DTensor), else None.
    layouts: list[Any] = field(default_factory=list)
    #: Per record: its first union leaf (its shards' leaves follow it) and
    #: its shards' regions as JSON (shared by the records of one layout:
    #: read them, never change them).
    record_shards: list[tuple[int, list[Any]]] = field(default_factory=list)

    def record(self, i: int) -> dict[str, Any]:
        """DTensor record ``i`` as metadata.json's ``dtensors`` holds it,
        with its ``shards``: ``{"leaf": union leaf, "index": region}``."""
        first, regions = self.record_shards[i]
        shards = [{"leaf": first + j, "index": region} for j, region in enumerate(regions)]
        return {**self.records[i], "shards": shards}

    @property
    def items(self) -> list[UnionItem]:
        """Every item, the blocks' made one by one (for tests and small
        unions: the save reads :attr:`entries`)."""
        out: list[UnionItem] = []
        for e in self.entries:
            if isinstance(e, ShardBlock):
                out.extend(e.item(k) for k in range(len(e)))
            else:
                out.append(e)
        return out

    def __len__(self) -> int:
        """The number of union items (manifest leaves)."""
        return sum(len(e) if isinstance(e, ShardBlock) else 1 for e in self.entries)

    def held(self, rank: int) -> Iterator[tuple[int, int, list[int]]]:
        """(union item, ``rank``'s local leaf, the item's holders) of each
        item that ``rank`` holds, in item order."""
        k = 0
        for e in self.entries:
            if isinstance(e, ShardBlock):
                for j, leaf in e.held_by(rank):
                    yield k + j, leaf, e.shards[j][1]
                k += len(e)
                continue
            own = e.source.get(rank)
            if own is not None:
                yield k, own, e.holders
            k += 1

    @property
    def per_rank(self) -> bool:
        """Whether some item is not held by every rank, or some path has
        versions (the checkpoint needs metadata version 3)."""
        return (
            bool(self.versions)
            or any(r.get("ranks") != list(range(self.world)) for r in self.records)
            or any(
                isinstance(e, UnionItem) and len(e.holders) != self.world
                and SHARD_KEY not in e.path
                for e in self.entries
            )
        )  # fmt: skip


def _key(path: Sequence[Any]) -> str:
    return json.dumps(list(path), separators=(",", ":"))


def _where(path: Sequence[Any]) -> str:
    return "/".join(map(str, path)) or "<root>"


def _versions_text(groups: Sequence[Sequence[int]]) -> str:
    """``ranks [0, 2] hold one version, ranks [1, 3] another`` (more:
    ``..., ranks [4] a third version``)."""
    words = ["one version", "another", "a third version", "a fourth version"]
    parts = []
    for i, g in enumerate(groups):
        w = words[i] if i < len(words) else f"version {i + 1}"
        parts.append(f"ranks {list(g)} hold {w}" if i == 0 else f"ranks {list(g)} {w}")
    return ", ".join(parts)


def replica_error(
    differ: list[tuple[Sequence[Any], list[list[int]]]],
    how: str,
    advice: str | None = None,
    kind: str = "tensor leaves",
) -> ReplicaMismatchError:
    """The error for replicas that differ: each leaf (of ``kind``) with
    which ranks hold which version, and what to do (``advice``, else the
    advice of ``deeppart.save``)."""
    shown = "; ".join(f"{_where(p)}: {_versions_text(g)}" for p, g in differ[:5])
    more = f" (and {len(differ) - 5} more)" if len(differ) > 5 else ""
    if advice is None:
        advice = (
            "If these ranks hold different tensors on "
            "purpose (to_local() shards, two models under one key), pass DTensors, or "
            'group="auto" (each distinct tensor stored as its own version), or give each '
            "group's leaves their own key prefix"
        )
    return ReplicaMismatchError(
        f"{len(differ)} {kind} differ between ranks that hold them as replicas ({how}): "
        f"{shown}{more}; nothing was written. {advice}"
    )


# ----------------------------------------------------------------------------
# Units: what one class holds under one user path.


@dataclass
class _Unit:
    cls: int  # the class (its lowest rank)
    kind: str  # "object" | "tensor" | "dtensor"
    leaf: int  # local leaf (a DTensor: its first shard)
    desc: dict[str, Any]
    #: A DTensor: (region json, holders, local leaf) per shard.
    shards: list[tuple[Any, list[int], int]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # a DTensor's mesh ranks
    _signature: str | None = None
    holders_key: tuple[tuple[int, ...], ...] | None = None
    #: A decoded DTensor: its layout's shards, in the order of ``shards``
    #: (:func:`decode_described`'s ``"layout"``), else None.
    layout: Any = None

    def signature(self, memo: dict[tuple[Any, ...], str] | None = None) -> str:
        """What units that may hold the same item have alike: ``"object"``,
        or the dtype, shape (and a DTensor's regions) as JSON. ``memo``:
        signatures by dtype, shape and the identities of the regions, valid
        while those regions live (decoded layouts share their regions)."""
        if self._signature is not None:
            return self._signature
        if self.kind == "object":
            self._signature = "object"
            return self._signature
        key: tuple[Any, ...] | None = None
        if memo is not None:
            try:
                # A decoded layout is its regions (kept alive by the unit);
                # otherwise the regions' identities.
                ids: Any = (
                    ("layout", id(self.layout)) if self.layout is not None
                    else tuple(id(s[0]) for s in self.shards)
                )  # fmt: skip
                key = (self.desc["dtype"], tuple(self.desc["shape"]), ids)
                hit = memo.get(key)
            except TypeError:  # a malformed shape: no memo (the manifest names it)
                hit = key = None
            if hit is not None:
                self._signature = hit
                return hit
        d = {"dtype": self.desc["dtype"], "shape": self.desc["shape"]}
        if self.kind == "dtensor":
            d["regions"] = [s[0] for s in self.shards]
        self._signature = json.dumps(d, sort_keys=True)
        if key is not None and memo is not None:
            memo[key] = self._signature
        return self._signature


def _units(states: dict[int, Described]) -> dict[str, list[_Unit]]:
    """Per user path (JSON key), in the order first met: each class's unit."""
    out: dict[str, list[_Unit]] = {}
    for c in sorted(states):
        st = states[c]
        descs = st.descs
        # A decoded record's shards are consecutive leaves from its first
        # (decode_described makes them so, with its "layout"): skipped as
        # one; any other record's shards are found leaf by leaf.
        at_first: dict[int, int] = {}
        shard_of: dict[int, int] = {}
        for k, rec in enumerate(st.records):
            if rec.get("layout") is not None:
                at_first[rec["shards"][0][0]] = k
            else:
                for leaf, _ in rec["shards"]:
                    shard_of[leaf] = k
        seen_rec: set[int] = set()
        i, n = 0, len(descs)
        while i < n:
            rk = at_first.get(i)
            if rk is not None:
                rec = st.records[rk]
                layout = rec["layout"]
                shards = [(region, h, i + j) for j, (region, _, h) in enumerate(layout)]
                i += len(shards)
            else:
                rk = shard_of.get(i)
                d = descs[i]
                i += 1
                if rk is None:
                    kind = "object" if d.get("kind") == "object" else "tensor"
                    out.setdefault(_key(d["path"]), []).append(_Unit(c, kind, i - 1, d))
                    continue
                if rk in seen_rec:
                    continue
                seen_rec.add(rk)
                rec = st.records[rk]
                layout = None
                shards = [(region, descs[leaf]["holders"], leaf) for leaf, region in rec["shards"]]
            unit = _Unit(
                c, "dtensor", shards[0][2],
                {"path": rec["path"], "dtype": rec["dtype"], "shape": rec["shape"]},
                shards, list(rec["ranks"]), layout=layout,
            )  # fmt: skip
            out.setdefault(_key(rec["path"]), []).append(unit)
    memo: dict[tuple[Any, ...], str] = {}
    for units in out.values():
        for u in units:
            u.signature(memo)  # while every region of the descriptions lives
    return out


def _class_ranks(classes: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, c in enumerate(classes):
        out.setdefault(c, []).append(r)
    return out


def units_of(states: dict[int, Described]) -> dict[str, list[_Unit]]:
    """What each class holds under each user path, for
    :func:`whole_digests_needed` and :func:`build_union` (``units=``) to
    share instead of each finding it again."""
    return _units(states)


def whole_digests_needed(
    states: dict[int, Described],
    classes: Sequence[int],
    auto: bool = False,
    units: dict[str, list[_Unit]] | None = None,
) -> list[tuple[int, int]]:
    """The (rank, local leaf) pairs whose whole bytes must be digested
    before the union can be built (same list on every rank): DTensor shards of
    equal regions held by ranks of disjoint meshes (the lowest holder).
    Plain tensors need none: every holder sends the digest of its whole
    tensor in the exchange (``auto`` changes nothing for them)."""
    need: set[tuple[int, int]] = set()
    for found in (units if units is not None else _units(states)).values():
        by_sig: dict[str, list[_Unit]] = {}
        for u in found:
            if u.kind != "object":
                by_sig.setdefault(u.signature(), []).append(u)
        for group in by_sig.values():
            if group[0].kind == "tensor" or len(group) == 1:
                # A plain tensor: every holder's digest of its whole tensor
                # is in the exchange already (Digests.samples). One unit:
                # no other class to compare with. Nothing more to digest.
                continue
            holder_sets = {tuple(tuple(s[1]) for s in u.shards) for u in group}
            if len(holder_sets) > 1:
                for u in group:
                    for _, holders, leaf in u.shards:
                        h = min(holders)
                        if classes[h] == u.cls:
                            need.add((h, leaf))
    return sorted(need)


# ----------------------------------------------------------------------------
# Building the union.


@dataclass
class _Version:
    kind: str
    desc: dict[str, Any]
    #: DTensor: the ranks of the meshes merged into it (a plain version's
    #: holders are its ``groups``').
    ranks: set[int]
    #: DTensor: per shard, (region, sorted holders, {rank: local leaf}),
    #: from ``units`` (:func:`_merged_shards`).
    shards: list[tuple[Any, list[int], dict[int, int]]] = field(default_factory=list)
    content: Any = None
    #: DTensor: the classes' units merged into this version.
    units: list[_Unit] = field(default_factory=list)
    #: DTensor: its one unit, when every holder is of that unit's class
    #: (its items are then a :class:`ShardBlock`; ``shards`` stays empty).
    block: _Unit | None = None
    #: Non-DTensor: the (sorted ranks, their local leaf) groups that hold
    #: it, each of one class (a class's whole list where all its ranks do:
    #: shared by that class's items).
    groups: list[tuple[list[int], int]] = field(default_factory=list)
    _holders: list[int] | None = None

    def holders(self) -> list[int]:
        """The sorted ranks that hold this version (a group's own list when
        one group holds it: read it, never change it)."""
        if self._holders is None:
            if self.kind == "dtensor":
                self._holders = sorted(self.ranks)
            elif len(self.groups) == 1:
                self._holders = self.groups[0][0]
            else:
                self._holders = sorted(r for g, _ in self.groups for r in g)
        return self._holders

    def source_map(self) -> Mapping[int, int]:
        """Non-DTensor: per holder, its local leaf."""
        if len(self.groups) == 1:
            ((group, leaf),) = self.groups
            return GroupLeaf(group, leaf)
        return {r: leaf for g, leaf in self.groups for r in g}


def _samples_differ(
    path: Sequence[Any], holders: Sequence[int], leaf_of: Callable[[int], int],
    digests: Sequence[Digests],
) -> list[list[int]] | None:  # fmt: skip
    """Groups of ``holders`` by their sampled digest, when they differ."""
    by: dict[str, list[int]] = {}
    for r in holders:
        s = digests[r].samples.get(leaf_of(r))
        if s is not None:
            by.setdefault(s, []).append(r)
    if len(by) <= 1:
        return None
    return sorted((sorted(g) for g in by.values()), key=lambda g: g[0])


def _holders_key(u: _Unit) -> tuple[tuple[int, ...], ...]:
    """A DTensor unit's holders, shard by shard (hashable, made once)."""
    if u.holders_key is None:
        u.holders_key = tuple(tuple(h) for _, h, _ in u.shards)
    return u.holders_key


def _shard_digests(u: _Unit, whole: dict[tuple[int, int], str]) -> list[str | None]:
    """A DTensor unit's whole-byte digest of each shard (by its lowest
    holder), None where none was taken."""
    return [whole.get((min(h), leaf)) for _, h, leaf in u.shards]


def _whole_in_class(
    u: _Unit, classes: Sequence[int], memo: dict[tuple[int, int], bool] | None = None
) -> bool:
    """Whether every holder of every shard of ``u`` is of ``u``'s class
    (its own class described it whole: one stage's mesh). ``memo``: by
    class and decoded layout (kept alive by the units), for one union."""
    if u.layout is None or memo is None:
        return all(classes[r] == u.cls for r in set().union(*(h for _, h, _ in u.shards)))
    key = (u.cls, id(u.layout))
    hit = memo.get(key)
    if hit is None:
        hit = memo[key] = _whole_in_class(u, classes)
    return hit


def _replicated_shards(u: _Unit, memo: dict[int, list[int]]) -> list[int]:
    """The positions of ``u``'s shards that several ranks hold (the
    replicas to compare), by decoded layout in ``memo`` (one union's)."""
    if u.layout is None:
        return [k for k, (_, h, _) in enumerate(u.shards) if len(h) > 1]
    hit = memo.get(id(u.layout))
    if hit is None:
        hit = memo[id(u.layout)] = [k for k, (_, _, h) in enumerate(u.layout) if len(h) > 1]
    return hit


def _merged_shards(
    units: Sequence[_Unit], classes: Sequence[int]
) -> list[tuple[Any, list[int], dict[int, int]]]:
    """Per shard of the DTensor version that ``units`` make: its region,
    its sorted holders (every unit's), and each holder's local leaf where
    its own class described it. (A unit that its own class holds whole
    is a :class:`ShardBlock` instead.)"""
    if len(units) == 1:
        (u,) = units
        return [
            (region, h, {r: leaf for r in h if classes[r] == u.cls}) for region, h, leaf in u.shards
        ]
    shards: list[tuple[Any, set[int], dict[int, int]]] = [
        (s[0], set(), {}) for s in units[0].shards
    ]
    for u in units:
        for k, (_, h, leaf) in enumerate(u.shards):
            shards[k][1].update(h)
            for r in h:
                if classes[r] == u.cls:
                    shards[k][2][r] = leaf
    return [(region, sorted(hs), src) for region, hs, src in shards]


def build_union(
    states: dict[int, Described],
    classes: Sequence[int],
    digests: Sequence[Digests],
    whole: dict[tuple[int, int], str] | None = None,
    auto: bool = False,
    declared: bool = False,
    units: dict[str, list[_Unit]] | None = None,
) -> Union:
    """The job's manifest items from every class's description (``states``,
    by the class's lowest rank), each rank's class (``classes[r]``) and
    digests, and the whole-leaf digests of :func:`whole_digests_needed`.
    Raises :class:`ReplicaMismatchError` when declared replicas differ
    (shards of one DTensor shard that several ranks hold; with
    ``declared``, plain tensors too), naming the leaf and which ranks hold
    which version, StateMismatchError when the ranks' trees cannot be
    merged. Plain tensors that are not declared replicas are grouped by
    their holders' whole-byte digests: one version per distinct copy."""
    world = len(classes)
    whole = whole or {}
    members = _class_ranks(classes)
    class_sets = {c: frozenset(ranks) for c, ranks in members.items()}
    whole_memo: dict[tuple[int, int], bool] = {}
    replicated_memo: dict[int, list[int]] = {}
    if len({st.common for st in states.values()}) > 1:
        raise StateMismatchError(
            "ranks disagree on the codec, the directory or the kind of group= (passed on some "
            "ranks only?); pass the same on every rank; nothing was written"
        )
    differ: list[tuple[Sequence[Any], list[list[int]]]] = []
    entries: list[UnionEntry] = []
    count = 0  # the union items in entries
    layouts: list[Any] = []  # per record: Union.layouts
    record_shards: list[tuple[int, list[Any]]] = []  # per record: Union.record_shards
    # Per decoded layout (kept alive by the units): its regions' JSON.
    layout_regions_of: dict[int, list[Any]] = {}
    records: list[dict[str, Any]] = []
    versions: list[dict[str, Any]] = []
    # (class, local leaf) -> the union leaf that the skeleton names there.
    canon: dict[tuple[int, int], int] = {}
    # By dtype and region (decoded layouts share their regions): the shards'
    # item description, made once and shared by the items of that dtype and
    # region (read only); each kept with its region, so that no other object
    # can take the region's id while it is here.
    shard_descs: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}

    def shard_desc(dtype: str, region: Any) -> dict[str, Any]:
        hit = shard_descs.get((dtype, id(region)))
        if hit is None:
            hit = (region, {"dtype": dtype, "shape": _region_shape(region)})
            shard_descs[(dtype, id(region))] = hit
        return hit[1]

    # Per class, by local leaf: its ranks whose plain value differs from
    # the class's lowest rank's (most ranks hold most values alike).
    value_diffs: dict[int, dict[int, list[int]]] = {}
    for c, class_ranks in members.items():
        lowest = digests[c].values
        per_leaf: dict[int, list[int]] = {}
        for r in class_ranks:
            theirs = digests[r].values
            if theirs is lowest:
                continue
            changed = digests[r].differs
            if changed is None:
                changed = {k for k, _ in theirs.items() - lowest.items()}
                changed |= lowest.keys() - theirs.keys()
            for leaf in changed:
                per_leaf.setdefault(leaf, []).append(r)
        value_diffs[c] = per_leaf
    by_path = units if units is not None else _units(states)
    for path_units in by_path.values():
        path = list(path_units[0].desc["path"])
        found: list[_Version] = []
        # The plain versions by (kind, content), as found holds them.
        index: dict[tuple[str, Any], _Version] = {}
        for u in path_units:
            ranks = members[u.cls]
            if u.kind == "object":
                # The class's ranks whose value is its lowest rank's at
                # once, the others one by one.
                odd = value_diffs[u.cls].get(u.leaf, [])
                if odd:
                    oddset = set(odd)
                    alike = [r for r in ranks if r not in oddset]
                else:
                    alike = ranks
                for group in [alike, *([r] for r in odd)]:
                    if not group:
                        continue
                    v = digests[group[0]].values.get(u.leaf)
                    match = index.get(("object", v))
                    if match is None:
                        match = _Version("object", u.desc, set(), content=v)
                        found.append(match)
                        index[("object", v)] = match
                    match.groups.append((group, u.leaf))
                continue
            if u.kind == "tensor":
                # Each holder's whole-byte digest decides (issue 49): ranks
                # whose copies are equal share one version, a copy that
                # differs anywhere is its rank's own (or refused, when the
                # caller declared the plain tensors replicas), whatever
                # else the tree holds.
                if declared and not auto:
                    same = {r: u.leaf for r in ranks}
                    groups = _samples_differ(path, ranks, same.__getitem__, digests)
                    if groups is not None:
                        differ.append((path, groups))
                # The class's ranks by their copy's digest, in rank order.
                by_copy: dict[str | None, list[int]] = {}
                for r in ranks:
                    full = digests[r].samples.get(u.leaf)
                    held = full if full is not None else whole.get((r, u.leaf))
                    by_copy.setdefault(held, []).append(r)
                sig = u.signature()
                for held, group in by_copy.items():
                    content = (sig, held if held is not None else f"class:{u.cls}")
                    match = index.get(("tensor", content))
                    if match is None:
                        match = _Version("tensor", u.desc, set(), content=content)
                        found.append(match)
                        index[("tensor", content)] = match
                    # The whole class: its list, shared by its items.
                    match.groups.append((ranks if len(group) == len(ranks) else group, u.leaf))
                continue
            # A DTensor: merged with a version of the same signature
            # (dtype, shape, regions) whose shards have the same holders
            # (one mesh) or, shard by shard, the same bytes (disjoint meshes).
            sig = u.signature()
            merged = None
            for x in found:
                if x.kind != "dtensor" or x.content[0] != sig:
                    continue
                first = x.units[0]
                if _holders_key(first) == _holders_key(u):
                    merged = x
                    break
                mine = _shard_digests(u, whole)
                if None not in mine and _shard_digests(first, whole) == mine:
                    merged = x
                    break
            if merged is None:
                merged = _Version("dtensor", u.desc, set(), content=(sig,))
                found.append(merged)
            merged.ranks.update(u.ranks)
            merged.units.append(u)
        for x in found:
            if x.kind != "dtensor":
                continue
            (u, *more) = x.units
            if not more and _whole_in_class(u, classes, whole_memo):
                x.block = u  # its items: a block of the unit's shards
                continue
            x.shards = _merged_shards(x.units, classes)
        # Replicas of DTensor shards (same mesh, or merged): their samples agree.
        for x in found:
            if x.block is not None:
                block_shards = x.block.shards
                for k in _replicated_shards(x.block, replicated_memo):
                    _region, h, leaf = block_shards[k]
                    seen = {digests[r].samples.get(leaf) for r in h}
                    seen.discard(None)
                    if len(seen) < 2:
                        continue  # one version (or none sampled)
                    at = dict.fromkeys(h, leaf).__getitem__
                    groups = _samples_differ(path, sorted(h), at, digests)
                    if groups is not None:
                        differ.append((path, groups))
                continue
            for _region, _h, src in x.shards:
                if len(src) < 2:
                    continue  # one holder: nothing to compare
                groups = _samples_differ(path, sorted(src), src.__getitem__, digests)
                if groups is not None:
                    differ.append((path, groups))
        found.sort(key=lambda x: x.holders()[0])
        first_leaf: list[int] = []
        for k, x in enumerate(found):
            base = [*path, VERSION_KEY, k] if len(found) > 1 else path
            n = count
            first_leaf.append(n)
            if x.kind != "dtensor":
                entries.append(UnionItem(base, _plain_desc(x.desc), x.holders(), x.source_map()))
                count += 1
                continue
            dtype = x.desc["dtype"]
            if x.block is not None:
                u = x.block
                block = ShardBlock(
                    base, dtype, u.shards, states[u.cls].descs, class_sets[u.cls], u.layout
                )
                entries.append(block)
                if u.layout is not None:
                    regions = layout_regions_of.get(id(u.layout))
                    if regions is None:
                        regions = [s[0] for s in u.layout]
                        layout_regions_of[id(u.layout)] = regions
                else:
                    regions = [s[0] for s in u.shards]
                layouts.append(u.layout)
            else:
                entries.extend([
                    UnionItem([*base, SHARD_KEY, j], shard_desc(dtype, region), hs, src)
                    for j, (region, hs, src) in enumerate(x.shards)
                ])  # fmt: skip
                regions = [s[0] for s in x.shards]
                layouts.append(None)
            count += len(regions)
            records.append(
                {"path": path, "dtype": x.desc["dtype"], "shape": x.desc["shape"],
                 "ranks": sorted(x.ranks)}
            )  # fmt: skip
            record_shards.append((n, regions))
        if len(found) > 1:
            kinds = {x.kind for x in found}
            rec = {"path": path, "ranks": [list(x.holders()) for x in found]}
            if "dtensor" in kinds:
                n = len(records)
                dts = [k for k, x in enumerate(found) if x.kind == "dtensor"]
                rec["records"] = list(range(n - len(dts), n)) if len(dts) == len(found) else []
            rec["leaves"] = first_leaf
            versions.append(rec)
        for u in path_units:
            canon[(u.cls, u.leaf)] = first_leaf[0]
    if differ:
        raise replica_error(differ, "whole-tensor digests")
    skeleton: Any = None
    for c in sorted(states):
        st = states[c]
        local = [canon.get((c, i), -1) for i in range(len(st.descs))]
        tree = renumber_skeleton(st.skeleton, local)
        skeleton = tree if skeleton is None else merge_skeletons(skeleton, tree, "")
    return Union(entries, skeleton, records, versions, world, layouts, record_shards)


def _region_shape(region: Any) -> list[int]:
    return [sum(b - a for a, b in runs) for runs in region]


def _plain_desc(desc: dict[str, Any]) -> dict[str, Any]:
    if desc.get("kind") == "object":
        return {"kind": "object", "nbytes": desc["nbytes"]}
    return {"dtype": desc["dtype"], "shape": list(desc["shape"])}


def _skeleton_key(k: Any) -> Any:
    """A skeleton dict key, hashable: a string as itself (most keys), any
    other key by its JSON (an int key and its string stay apart)."""
    return (0, k) if type(k) is str else (1, json.dumps(k))


def merge_skeletons(a: Any, b: Any, where: str) -> Any:
    """The union of two skeletons (union leaf indices)."""
    if a == b:
        return a
    ((ka, va),), ((kb, vb),) = a.items(), b.items()
    if ka == kb and ka in ("dict", "odict"):
        out = [list(e) for e in va]
        at = {_skeleton_key(e[0]): i for i, e in enumerate(out)}
        for k, v in vb:
            i = at.get(_skeleton_key(k))
            if i is None:
                out.append([k, v])
            else:
                out[i][1] = merge_skeletons(out[i][1], v, f"{where}/{k}")
        return {ka: out}
    if ka == kb and ka in ("list", "tuple") and len(va) == len(vb):
        pairs = enumerate(zip(va, vb, strict=True))
        return {ka: [merge_skeletons(x, y, f"{where}/{i}") for i, (x, y) in pairs]}
    raise StateMismatchError(
        f"{where or '<root>'}: the ranks' state trees differ in structure there (a leaf on "
        "some ranks, a container or another container on others); nothing was written. Give "
        "each group's state its own key, or pass group=<this rank's replica group>"
    )


def describe_versions(versions: Sequence[dict[str, Any]], limit: int = 5) -> str:
    """``loader/pos (saved by ranks [0], [1], ...)`` for the first paths."""
    shown = [
        f"{_where(v['path'])} (versions saved by ranks "
        f"{', '.join(str(list(r)) for r in v['ranks'])})"
        for v in versions[:limit]
    ]
    more = f" and {len(versions) - limit} more" if len(versions) > limit else ""
    return "; ".join(shown) + more
