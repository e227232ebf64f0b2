"""The load's exchange of needed regions, by layout (issue 46).

Before a cooperative load of sharded tensors every rank must know which
regions every other rank needs (:func:`deeppart.loading.reshard.plan_shard_reads`
assigns each stored piece to one of the ranks that need it). Sending each
rank's regions costs ranks x DTensors bytes on every rank; but a DTensor's
regions are determined by its layout (the ranks of its mesh, the mesh
dimensions, its placements and global shape), the same on every rank of
its mesh. So:

1. each rank describes its needs by layout (a plain tensor it needs whole:
   ``"f"``; a DTensor: its mesh, once per description, and its layout; a
   region its layout does not explain: the region itself) and every rank
   gathers a 16-byte digest of every rank's description;
2. the lowest rank of each distinct description sends it; the others
   send nothing. Ranks of a pipeline stage (or of a whole data-parallel
   job) share one description, so every rank gathers O(stages x DTensors)
   bytes, whatever the number of ranks;
3. every rank derives the needed regions and their needers from the
   layouts (:func:`deeppart.state.dtensor.layout_regions`, cached per
   layout): one entry per distinct region, not per rank.

:class:`RegionIndex` then finds the needers of a stored piece among a
tensor's regions without scanning them all.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from deeppart.comm import Comm
from deeppart.errors import CheckpointError
from deeppart.regions import I64, Region, concat_ranges
from deeppart.state.dtensor import Layout, layout_regions

__all__ = [
    "DIGEST_BYTES",
    "NeedSpec",
    "RegionIndex",
    "describe_needs",
    "exchange_needs",
    "needs_digest",
]

#: Bytes of a description's digest (the first round's row).
DIGEST_BYTES = 16


@dataclass
class NeedSpec:
    """One need as the exchange sees it: a tensor's path, the region this
    rank fills and, for a DTensor, the layout that region comes from."""

    path: tuple[Any, ...]
    region: Region
    layout: Layout | None = None
    #: The need is the whole tensor (its record's full region).
    full: bool = False


def _my_region(layout: Layout, rank: int) -> Region | None:
    for region, holders in layout_regions(*layout):
        if rank in holders:
            return region
    return None


def describe_needs(needs: Sequence[NeedSpec], rank: int) -> bytes:
    """This rank's needs, described so that every rank of a mesh that
    needs the same tensors alike describes them with the same bytes
    (canonical JSON). A layout whose region for ``rank`` is not the
    need's region (never for DTensors as torch lays them out) is
    described by the region itself."""
    meshes: list[list[Any]] = []
    mesh_index: dict[tuple[Any, ...], int] = {}
    entries: list[list[Any]] = []
    for n in needs:
        path = list(n.path)
        if n.full:
            entries.append([path, "f"])
            continue
        # A layout lists no empty region: a rank whose shard is empty (more
        # ranks than rows) needs nothing, as its layout says.
        if n.layout is not None and _my_region(n.layout, rank) in (
            n.region,
            None if n.region.numel == 0 else n.region,
        ):
            key_ranks, _, dims, specs, shape = n.layout
            m = mesh_index.get(key_ranks)
            if m is None:
                m = mesh_index[key_ranks] = len(meshes)
                meshes.append([list(key_ranks[0]), list(key_ranks[1])])
            spec_json = [None if s is None else list(s) for s in specs]
            entries.append([path, "l", m, list(dims), spec_json, list(shape)])
            continue
        entries.append([path, "r", n.region.to_json()])
    return json.dumps({"meshes": meshes, "needs": entries}, separators=(",", ":")).encode()


def needs_digest(description: bytes) -> bytes:
    """The first round's row: a digest of a description."""
    return hashlib.blake2b(description, digest_size=DIGEST_BYTES).digest()


#: Per tensor path: its needed regions, each with the ranks that need it
#: (sorted).
Wants = dict[tuple[Any, ...], list[tuple[Region, list[int]]]]


def exchange_needs(
    c: Comm, needs: Sequence[NeedSpec], full_region: Any
) -> tuple[Wants, dict[str, int]]:
    """Collective (two allgathers): every rank's needs. Returns, per tensor
    path, its needed regions with their needers, and the bytes this rank
    sent and gathered (``sent``, ``gathered``). ``full_region(path)``: the
    whole region of a checkpoint tensor (what ``"f"`` stands for)."""
    mine = describe_needs(needs, c.rank)
    digests = c.allgather_bytes(needs_digest(mine), DIGEST_BYTES)
    ranks_of: dict[bytes, list[int]] = {}
    for r, d in enumerate(digests):
        ranks_of.setdefault(bytes(d), []).append(r)
    first = {ranks[0] for ranks in ranks_of.values()}
    payload = mine if c.rank in first else b""
    rows = c.allgather_varbytes(payload)
    wants: Wants = {}
    for d, ranks in ranks_of.items():
        row = bytes(rows[ranks[0]])
        if needs_digest(row) != d:
            raise CheckpointError(
                f"the load's exchange: rank {ranks[0]}'s description of its needs does not "
                "match its digest (a damaged message)"
            )
        _add_wants(wants, json.loads(row.decode()), ranks, full_region)
    gathered = DIGEST_BYTES * c.size + sum(len(r) for r in rows)
    return wants, {"sent": DIGEST_BYTES + len(payload), "gathered": gathered}


def _add_wants(wants: Wants, desc: dict[str, Any], ranks: list[int], full_region: Any) -> None:
    """Adds the needs of ``desc``, which every rank of ``ranks`` made."""
    meshes = []
    for shape, flat in desc["meshes"]:
        key = (tuple(shape), tuple(flat))
        meshes.append((key, np.asarray(flat, dtype=np.int64).reshape(shape), set(flat)))
    members = set(ranks)
    for entry in desc["needs"]:
        path = tuple(entry[0])
        kind = entry[1]
        out = wants.setdefault(path, [])
        if kind == "f":
            out.append((full_region(path), list(ranks)))
        elif kind == "r":
            region = Region(tuple(tuple((a, b) for a, b in d) for d in entry[2]))
            out.append((region, list(ranks)))
        elif kind == "l":
            key, arr, layout_ranks = meshes[entry[2]]
            specs = tuple(None if s is None else (int(s[0]), int(s[1])) for s in entry[4])
            for region, holders in layout_regions(key, arr, entry[3], specs, entry[5]):
                needers = [h for h in holders if h in members]
                if needers:
                    out.append((region, needers))
            if not members <= layout_ranks:
                raise CheckpointError(
                    f"the load's exchange: ranks {sorted(members - layout_ranks)} need "
                    f"{'/'.join(map(str, path))} on a mesh they are not in"
                )
        else:
            raise CheckpointError(f"the load's exchange: unknown kind of need {kind!r}")


class RegionIndex:
    """A tensor's needed regions, found by the rows they span: which ranks
    need any element of a span. Linear below a few regions; above, each
    region is put in the buckets of dimension 0 that its rows meet."""

    LINEAR = 16

    def __init__(self, entries: list[tuple[Region, list[int]]]) -> None:
        self.entries = entries
        self._box_arrays: tuple[I64, I64, I64, I64] | None = None
        self._not_boxes = False
        self._bucketed = False
        self.buckets: list[list[int]] | None = None
        self.anywhere: list[int] = []

    def _bucket(self) -> None:
        """Puts each region in the buckets of dimension 0 that its rows meet
        (once, at the first :meth:`needers`)."""
        self._bucketed = True
        entries = self.entries
        if len(entries) <= self.LINEAR:
            return
        rows = [e[0].runs[0] if e[0].runs else () for e in entries]
        extent = max((r[-1][1] for r in rows if r), default=0)
        if extent == 0:
            return
        nb = min(len(entries), extent)
        self.width = -(-extent // nb)
        self.buckets = [[] for _ in range(nb)]
        for i, r in enumerate(rows):
            if not r:
                self.anywhere.append(i)
                continue
            for a, b in r:
                for k in range(a // self.width, (b - 1) // self.width + 1):
                    self.buckets[k].append(i)

    def needers(self, span: Region) -> list[int]:
        """The sorted ranks that need some element of ``span``."""
        if not self._bucketed:
            self._bucket()
        if self.buckets is None or not span.runs or not span.runs[0]:
            candidates: Any = range(len(self.entries))
        else:
            found: set[int] = set(self.anywhere)
            for a, b in span.runs[0]:
                hi = min((b - 1) // self.width, len(self.buckets) - 1)
                for k in range(a // self.width, hi + 1):
                    found.update(self.buckets[k])
            candidates = sorted(found)
        out: set[int] = set()
        for i in candidates:
            region, ranks = self.entries[i]
            if region.intersect(span) is not None:
                out.update(ranks)
        return sorted(out)

    def needers_many(self, spans: Sequence[Region]) -> list[list[int]]:
        """:meth:`needers` of each span, at once. When every region and span
        is a box (one run per dimension: what FSDP, TP and their products
        make), in array operations by a sweep (:func:`_box_needers`),
        several times faster than one span at a time for the hundred
        thousand pieces of a large load."""
        boxes = self._boxes()
        span_bounds = _box_bounds(spans) if boxes is not None else None
        if boxes is None or span_bounds is None:
            return [self.needers(s) for s in spans]
        return _box_needers(*boxes, *span_bounds)

    def _boxes(self) -> tuple[I64, I64, I64, I64] | None:
        """The regions as boxes: lower and upper bounds (regions x dims) and
        their ranks as one array with offsets; None when some region is not
        a box, or the tensor has no dimension."""
        if self._not_boxes:
            return None
        if self._box_arrays is None:
            bounds = _box_bounds([e[0] for e in self.entries])
            if bounds is None:
                self._not_boxes = True
                return None
            ranks = [e[1] for e in self.entries]
            offsets = np.zeros(len(ranks) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(r) for r in ranks])
            flat = np.fromiter((x for r in ranks for x in r), np.int64, int(offsets[-1]))
            self._box_arrays = (*bounds, offsets, flat)
        return self._box_arrays


def _box_bounds(regions: Sequence[Region]) -> tuple[I64, I64] | None:
    """Lower and upper bounds (regions x dims) when every region is a box of
    the same dimensions (one run in each), else None."""
    if not regions or not regions[0].runs:
        return None
    runs = [run for r in regions for run in r.runs]
    if len(runs) != len(regions) * len(regions[0].runs) or any(len(r) != 1 for r in runs):
        return None
    b = np.asarray([r[0] for r in runs], dtype=np.int64).reshape(len(regions), -1, 2)
    return b[:, :, 0], b[:, :, 1]


#: At most this many (span, candidate region, dimension) comparisons in one array.
_BOX_CHUNK = 1 << 21


def _box_needers(
    lo: I64, hi: I64, offsets: I64, flat: I64, s_lo: I64, s_hi: I64
) -> list[list[int]]:
    """The sorted needers of each box span ``s_lo``/``s_hi`` among box
    regions ``lo``/``hi`` (their ranks: ``flat[offsets[i]:offsets[i + 1]]``).

    A sweep along the dimension whose region starts differ most: the
    regions sorted by their start there, a span's candidates are the run
    of them that start before it ends and (by the running maximum of their
    ends) do not all end before it starts; only those are met in every
    dimension. On the tilings FSDP and TP make that is a few regions a
    span, not all of them."""
    out: list[list[int]] = []
    if s_lo.shape[1] != lo.shape[1]:
        raise ValueError(f"spans of {s_lo.shape[1]} dimensions, regions of {lo.shape[1]}")
    world = int(flat.max()) + 1 if len(flat) else 1
    dim = max(range(lo.shape[1]), key=lambda d: (len(np.unique(lo[:, d])), -d))
    order = np.argsort(lo[:, dim], kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi[:, dim])  # the furthest end among the first i + 1
    start = np.searchsorted(reach, s_lo[:, dim], side="right")
    stop = np.maximum(np.searchsorted(lo[:, dim], s_hi[:, dim], side="left"), start)
    step = max(1, _BOX_CHUNK // lo.shape[1])  # candidate pairs at once
    cum = np.cumsum(stop - start)
    first = 0
    while first < len(s_lo):
        base = int(cum[first - 1]) if first else 0
        last = max(first + 1, int(np.searchsorted(cum, base + step, side="right")))
        counts = stop[first:last] - start[first:last]
        span_of = np.repeat(np.arange(first, last, dtype=np.int64), counts)
        cand = concat_ranges(start[first:last], counts)
        meet = np.all((lo[cand] < s_hi[span_of]) & (s_lo[span_of] < hi[cand]), axis=1)
        span_of, region_of = span_of[meet] - first, order[cand[meet]]
        per = offsets[region_of + 1] - offsets[region_of]
        ranks = flat[concat_ranges(offsets[region_of], per)]
        keys = np.unique(np.repeat(span_of, per) * world + ranks)
        ends = np.searchsorted(keys // world, np.arange(1, last - first + 1), side="left")
        found = (keys % world).tolist()
        at = 0
        for end in ends.tolist():
            out.append(found[at:end])
            at = end
        first = last
    return out
