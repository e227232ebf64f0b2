"""Regions of a global tensor, and the ``dtensors`` records of ``metadata.json``.

A sharded tensor (a ``DTensor``) is stored as one planner leaf per distinct
local shard; a record says which region of the global tensor each of those
leaves holds. A :class:`Region` is, per dimension of the global tensor, a
sorted list of disjoint ``[start, stop)`` runs of global indices (one run
for ``Shard``/``Replicate``; several for ``_StridedShard``); the shard is
their Cartesian product, in row-major order.

:func:`parse_records` checks the records read from disk (docs/FORMAT.md,
"Sharded tensors"): every index and size is bounded, each shard leaf has
the record's dtype and its region's shape, and the shards tile the global
tensor exactly once. Nothing here imports torch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from deeppart.errors import CorruptCheckpointError

__all__ = [
    "MAX_RUNS",
    "MAX_SHARDS",
    "SHARD_KEY",
    "DTensorRecord",
    "Region",
    "ShardRecord",
    "concat_ranges",
    "parse_records",
    "placement_region",
    "runs_of",
    "select_positions",
    "tiles_exactly",
]

#: The path key under a sharded tensor's path that names its shard leaves:
#: the shards of ``("model", "w")`` are ``("model", "w", "<shard>", k)``.
#: Nothing of the user's can be there, since ``("model", "w")`` is a leaf.
SHARD_KEY = "<shard>"
#: The most shards one record may list (checked on load, docs/SECURITY.md).
MAX_SHARDS = 1 << 16
#: The most runs one record may list over all its shards and dimensions.
MAX_RUNS = 1 << 20

Runs = tuple[tuple[int, int], ...]
I64 = npt.NDArray[np.int64]


def runs_of(index: Sequence[int] | I64) -> Runs:
    """Sorted global indices as ``[start, stop)`` runs of consecutive ones
    (vectorised: one pass of numpy over the indices)."""
    a = np.asarray(index, dtype=np.int64).reshape(-1)
    if not a.size:
        return ()
    cut = np.flatnonzero(np.diff(a) != 1) + 1
    starts = a[np.concatenate(([0], cut))]
    stops = a[np.concatenate((cut - 1, [a.size - 1]))] + 1
    return tuple(zip(starts.tolist(), stops.tolist(), strict=True))


def chunk_span(n: int, k: int, i: int) -> tuple[int, int]:
    """Chunk ``i`` of ``k`` of ``range(n)`` as ``torch.chunk`` cuts it (the
    first chunks ``ceil(n / k)`` long, the last ones short or empty), the
    arithmetic of torch's ``Shard.local_shard_size_and_offset``."""
    c = -(-n // k) if n > 0 else 0
    return min(c * i, n), min(c * (i + 1), n)


def select_positions(runs: Runs, positions: Sequence[tuple[int, int]]) -> Runs:
    """The global indices at the local positions ``positions`` (sorted,
    disjoint ``[start, stop)`` runs of positions in ``runs``' order) of
    ``runs``, as runs (adjacent ones merged). O(len(runs) + len(positions))."""
    out: list[tuple[int, int]] = []
    j = 0
    base = 0  # local position of runs[j][0]
    for a, b in positions:
        while j < len(runs) and base + runs[j][1] - runs[j][0] <= a:
            base += runs[j][1] - runs[j][0]
            j += 1
        k, kbase = j, base
        while a < b and k < len(runs):
            lo, hi = runs[k]
            s, e = lo + a - kbase, min(hi, lo + b - kbase)
            if out and out[-1][1] == s:
                out[-1] = (out[-1][0], e)
            else:
                out.append((s, e))
            a = kbase + e - lo
            if e == hi:
                kbase += hi - lo
                k += 1
    return tuple(out)


def placement_region(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coord: Sequence[int],
    placements: Sequence[tuple[int, int] | None],
) -> Region:
    """The region of a global tensor of ``shape`` that the mesh coordinate
    ``coord`` holds, from its placements alone in O(runs): per mesh
    dimension ``None`` (replicated) or ``(dim, split_factor)`` (``Shard(dim)``
    is split factor 1, ``_StridedShard(dim, sf)`` is ``sf``), applied left to
    right as torch does (``_compute_local_shape_and_global_offset``): a
    Shard takes one chunk of the current local indices, a _StridedShard
    cuts them into ``sf`` chunks and takes the same chunk of each."""
    runs: list[Runs] = [((0, int(n)),) if n else () for n in shape]
    for m, p in enumerate(placements):
        if p is None:
            continue
        d, sf = p
        size = sum(b - a for a, b in runs[d])
        k, i = int(mesh_shape[m]), int(coord[m])
        pos: list[tuple[int, int]] = []
        for j in range(max(int(sf), 1)):
            f0, f1 = chunk_span(size, sf, j) if sf > 1 else (0, size)
            s0, s1 = chunk_span(f1 - f0, k, i)
            if s0 < s1:
                if pos and pos[-1][1] == f0 + s0:
                    pos[-1] = (pos[-1][0], f0 + s1)
                else:
                    pos.append((f0 + s0, f0 + s1))
        runs[d] = select_positions(runs[d], pos)
    return Region(tuple(runs))


def _intersect_runs(a: Runs, b: Runs) -> Runs:
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def _positions(runs: Runs, within: Runs) -> I64:
    """Where the indices of ``runs`` (a subset of ``within``) sit in ``within``'s order."""
    if not runs:
        return np.zeros(0, dtype=np.int64)
    w = np.asarray(within, dtype=np.int64).reshape(-1, 2)
    r = np.asarray(runs, dtype=np.int64).reshape(-1, 2)
    base = np.concatenate(([0], np.cumsum(w[:, 1] - w[:, 0])[:-1]))
    k = np.searchsorted(w[:, 1], r[:, 0], side="right")  # the run of within holding each start
    first = r[:, 0] - w[k, 0] + base[k]
    lengths = r[:, 1] - r[:, 0]
    if len(r) == 1:
        return np.arange(first[0], first[0] + lengths[0], dtype=np.int64)
    return concat_ranges(first, lengths)


def concat_ranges(first: I64, counts: I64) -> I64:
    """``first[i], first[i] + 1, ..., first[i] + counts[i] - 1`` for every
    ``i``, concatenated, in one pass (no loop over ``i``)."""
    shift = np.repeat(first - np.cumsum(counts) + counts, counts)
    return shift + np.arange(int(counts.sum()), dtype=np.int64)


def _span(runs: Runs, within: Runs) -> tuple[int, int] | None:
    """``[first, stop)`` of the positions of ``runs`` in ``within``'s order
    when they are consecutive (one slice), else None."""
    if not runs:
        return (0, 0)
    base = 0
    first = -1
    for lo, hi in within:
        if first < 0 and lo <= runs[0][0] < hi:
            first = base + runs[0][0] - lo
        base += hi - lo
    n = sum(b - a for a, b in runs)
    pos = _positions(((runs[-1][1] - 1, runs[-1][1]),), within)
    return (first, first + n) if first >= 0 and int(pos[0]) == first + n - 1 else None


@dataclass(frozen=True)
class Region:
    """A box of a global tensor: per dimension, its runs of global indices."""

    runs: tuple[Runs, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Region:
        return Region(tuple(((0, int(n)),) if n else () for n in shape))

    @functools.cached_property
    def shape(self) -> tuple[int, ...]:
        # Cached: a layout's regions are shared by every save that uses it.
        return tuple(sum(b - a for a, b in r) for r in self.runs)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @functools.cached_property
    def _json(self) -> list[list[list[int]]]:
        return [[[a, b] for a, b in r] for r in self.runs]

    def to_json(self) -> list[list[list[int]]]:
        """The runs as JSON lists (made once per region and shared: a
        layout's regions serve every save, and a save writes each region's
        JSON several times; not to be modified)."""
        return self._json

    def intersect(self, other: Region) -> Region | None:
        """The common indices, or None when they share no element."""
        runs = tuple(_intersect_runs(a, b) for a, b in zip(self.runs, other.runs, strict=True))
        if any(not r for r in runs):
            return None if self.runs else Region(())
        return Region(runs)

    def positions(self, sub: Region) -> list[I64]:
        """Per dimension, where ``sub``'s indices (a subset of this region's)
        sit in this region's local order."""
        return [_positions(s, w) for s, w in zip(sub.runs, self.runs, strict=True)]

    def spans(self, sub: Region) -> list[tuple[int, int] | None]:
        """Per dimension, ``[first, stop)`` of ``sub``'s positions in this
        region's local order where they are consecutive (a slice, no index
        array), else None."""
        return [_span(s, w) for s, w in zip(sub.runs, self.runs, strict=True)]

    def rows(self, first: int, stop: int) -> Region:
        """The sub-region of local rows ``[first, stop)`` along dimension 0."""
        if not self.runs:
            return self
        sel: list[tuple[int, int]] = []
        pos = 0
        for a, b in self.runs[0]:
            lo, hi = max(a, a + first - pos), min(b, a + stop - pos)
            if lo < hi:
                sel.append((lo, hi))
            pos += b - a
        return Region((tuple(sel), *self.runs[1:]))


class ShardRecord(NamedTuple):
    """One stored shard: its planner leaf and its region of the global tensor
    (a named tuple: a union makes one per stored shard, hundreds of
    thousands at scale)."""

    leaf: int
    region: Region


@dataclass(frozen=True)
class DTensorRecord:
    """A sharded tensor of the saved state: its path, dtype, global shape and shards."""

    path: list[Any]
    dtype: str
    shape: list[int]
    shards: list[ShardRecord]

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": self.shape,
            "shards": [{"leaf": s.leaf, "index": s.region.to_json()} for s in self.shards],
        }


def _bad(i: int, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"metadata: dtensors[{i}]: {what}")


def _int(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _parse_region(i: int, raw: Any, shape: list[int], budget: list[int]) -> Region:
    if not isinstance(raw, list) or len(raw) != len(shape):
        raise _bad(i, "a shard's index does not have one list of runs per dimension")
    dims: list[Runs] = []
    for d, runs in enumerate(raw):
        if not isinstance(runs, list):
            raise _bad(i, f"dimension {d}: runs are not a list")
        budget[0] -= len(runs)
        if budget[0] < 0:
            raise _bad(i, f"more than {MAX_RUNS} index runs")
        out: list[tuple[int, int]] = []
        end = 0
        for run in runs:
            ok = isinstance(run, list) and len(run) == 2
            if not ok or not _int(run[0], end, shape[d]) or not _int(run[1], run[0] + 1, shape[d]):
                raise _bad(
                    i,
                    f"dimension {d}: runs must be sorted, disjoint, non-empty and "
                    f"within [0, {shape[d]})",
                )
            out.append((run[0], run[1]))
            end = run[1]
        dims.append(tuple(out))
    return Region(tuple(dims))


#: The most cells of the grid that checks a record's cover (the product over
#: dimensions of the distinct run boundaries): 4 Mi, 16 MiB of counters.
MAX_GRID_CELLS = 1 << 22


def tiles_exactly(shape: Sequence[int], regions: Sequence[Region]) -> bool:
    """Whether ``regions`` cover the box ``shape`` exactly once. Exact, in
    time and memory bounded by :data:`MAX_GRID_CELLS` (a finer record is
    refused): the run boundaries cut the box into a grid of cells, each
    region adds one to the cells it covers, and every cell must end at one."""
    cut = [
        np.unique(np.array([0, n, *(x for r in regions for run in r.runs[d] for x in run)]))
        for d, n in enumerate(shape)
    ]
    grid = [len(c) - 1 for c in cut]
    cells = 1
    for g in grid:
        cells *= g
    if cells > MAX_GRID_CELLS:
        raise CorruptCheckpointError(
            f"metadata: a record's shards cut its tensor into more than {MAX_GRID_CELLS} cells"
        )
    counts = np.zeros(grid, dtype=np.int32)
    total = 0
    for r in regions:
        if not r.numel:
            continue
        idx = [
            np.concatenate(
                [np.arange(np.searchsorted(c, a), np.searchsorted(c, b)) for a, b in runs]
            )
            for c, runs in zip(cut, r.runs, strict=True)
        ]
        total += int(np.prod([len(i) for i in idx]))
        if total > cells:
            return False  # more cells covered than there are: an overlap
        counts[np.ix_(*idx)] += 1
    return bool((counts == 1).all())


def _record_ranks(rec: dict[str, Any]) -> frozenset[int]:
    """The saved ranks a version-3 record names (empty when malformed: the
    metadata's own check of ``ranks`` refuses it)."""
    ranks = rec.get("ranks")
    if not isinstance(ranks, list) or not all(type(r) is int for r in ranks):
        return frozenset()
    return frozenset(ranks)


def parse_records(
    raw: Any, leaves: Sequence[Any], dtype_known: Any, versions: bool = False
) -> list[DTensorRecord]:
    """The checked ``dtensors`` records of a checkpoint's metadata (absent:
    none). ``leaves`` are the checked :class:`deeppart.format.LeafInfo` of its
    manifest. Two records of one path are corrupt, except, with
    ``versions`` (metadata version 3: each rank's own state), versions of
    one path saved by disjoint sets of ranks (``ranks``). Raises
    CorruptCheckpointError naming the record."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise CorruptCheckpointError("metadata: dtensors is not a list")
    used: set[int] = set()
    paths: dict[tuple[str | int, ...], list[tuple[int, frozenset[int]]]] = {}
    budget = [MAX_RUNS]
    out: list[DTensorRecord] = []
    for i, rec in enumerate(raw):
        if not isinstance(rec, dict) or not isinstance(rec.get("path"), list):
            raise _bad(i, "malformed record")
        path = tuple(rec["path"])
        if not all(isinstance(k, str) or _int(k, -(1 << 63), (1 << 63) - 1) for k in path):
            raise _bad(i, "a path key is neither a string nor an integer")
        ranks = _record_ranks(rec) if versions else frozenset()
        for j, other in paths.get(path, []):
            if not versions or not ranks or ranks & other:
                raise _bad(i, f"the same path as dtensors[{j}]")
        paths.setdefault(path, []).append((i, ranks))
        dtype, shape, shards = rec.get("dtype"), rec.get("shape"), rec.get("shards")
        if not isinstance(dtype, str) or not dtype_known(dtype):
            raise _bad(i, f"unknown dtype {dtype!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 64
            or not all(_int(n, 0, 1 << 48) for n in shape)
        ):
            raise _bad(i, "bad global shape")
        if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
            raise _bad(i, f"needs 1 to {MAX_SHARDS} shards")
        parsed: list[ShardRecord] = []
        for s in shards:
            if not isinstance(s, dict) or not _int(s.get("leaf"), 0, len(leaves) - 1):
                raise _bad(i, "a shard names no leaf of the manifest")
            li = s["leaf"]
            info = leaves[li]
            if li in used:
                raise _bad(i, f"leaf {li} is a shard of two records")
            used.add(li)
            region = _parse_region(i, s.get("index"), shape, budget)
            if (
                info.kind != "tensor"
                or info.dtype != dtype
                or list(region.shape) != list(info.shape)
            ):
                raise _bad(i, f"leaf {li} is not a {dtype} tensor of its region's shape")
            parsed.append(ShardRecord(li, region))
        total = 1
        for n in shape:
            total *= n
        if sum(s.region.numel for s in parsed) != total or (
            total and not tiles_exactly(shape, [s.region for s in parsed])
        ):
            raise _bad(i, "its shards do not cover the global tensor exactly once")
        out.append(DTensorRecord(list(path), dtype, list(shape), parsed))
    return out
