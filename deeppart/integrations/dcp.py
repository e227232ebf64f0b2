"""``BalancedSavePlanner``: DeepPart's plan inside ``torch.distributed.checkpoint``.

The one-line change for DCP users::

    import torch.distributed.checkpoint as dcp
    from deeppart.integrations.dcp import BalancedSavePlanner

    dcp.save(state, checkpoint_id=path, planner=BalancedSavePlanner())

What it changes against ``DefaultSavePlanner``:

- **Who writes what.** DCP gives every replicated item whole to the rank with
  the fewest bytes so far (``dedup_save_plans``). Here every replicated tensor
  and object becomes a leaf of a DeepPart :class:`~deeppart.Manifest`, and
  :func:`deeppart.plan` balances them; a tensor larger than a rank's share is
  cut into flat ranges, each written as a few rectangular chunks
  (``ChunkStorageMetadata(offsets, sizes)``, see below) by a different rank.
  Items a rank already owns alone (``DTensor``, ``ShardedTensor`` shards)
  are counted as owned leaves (``owner=rank``), so the replicated load goes
  to the ranks with less of their own.
- **Less plan traffic.** All ranks hold the same replicated state, so each
  rank plans deterministically in ``create_local_plan`` and sends the
  coordinator only its own shards, a fingerprint of its replicated state
  and a compressed list of its replicated items (not one WriteItem per
  tensor). The coordinator rebuilds the same plan when the fingerprints
  agree (else it balances each group's items over the ranks that list
  them), validates it as DCP's default planner does, and writes the global
  ``Metadata``; when no rank owns anything, it scatters an empty "use your
  own plan" marker (with the rank's place) instead of the per-rank plans.
- **No collective of its own.** Like the default planner, it leaves every
  collective to DCP: a rank that fails before or while planning reaches
  DCP's gather as the others do (``CheckpointException`` on every rank),
  and ``no_dist=True`` saves while a process group is up.
- **Plan cache.** Plans go through DeepPart's plan cache (memory and disk by
  default), so repeated saves and restarts skip planning.

The checkpoint is a standard DCP checkpoint: stock
``torch.distributed.checkpoint.load`` reads it at any world size.

Cutting on the finest box-aligned boundary: each replicated tensor is
described to the planner as ``uint8[units, unit_bytes]``, where a *unit* is
the largest block of trailing dimensions (never dimension 0) of at most 64 KiB
(one element when even the last dimension is larger), and the planner cuts
whole units only.
A piece is then a C-order flat range of the tensor, which
:func:`flat_range_boxes` maps to at most ``2 * ndim - 1`` boxes (hyper-
rectangles): a partial run at each end, recursively, and whole slabs of
dimension 0 in between. Each box is one DCP chunk. So a tensor whose
dimension-0 rows are coarse (Mixture-of-Experts weights stacked as
``[experts, rows, cols]``) is still balanced to within a unit.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import pickle
import time
import zlib
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_global_save_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from deeppart._planner import CostModel, Manifest, Plan, Topology
from deeppart.errors import DcpPlanError
from deeppart.saving.plan_cache import CacheArg
from deeppart.saving.plan_cache import plan as deeppart_plan

__all__ = ["BalancedSavePlanner", "DcpPlanError", "split_shard"]

# The key of DeepPart's entry in a SavePlan's ``planner_data``.
_KEY = "deeppart"


@dataclass(frozen=True)
class _Leaf:
    """One leaf of the manifest: a replicated state-dict entry or an owned shard."""

    fqn: str
    units: int  # what the planner cuts between; 1 for objects and 0-D tensors
    unit_bytes: int
    item: WriteItem  # the whole-tensor (or bytes, or shard) WriteItem
    owner: int | None
    unit_elems: int = 0  # elements per unit of a replicated tensor (0: never cut)


def _plain_tensor(obj: object) -> bool:
    # A DTensor, ShardedTensor or other checkpointable tensor subclass knows
    # its own chunks; only plain tensors are replicated values.
    return type(obj) in (torch.Tensor, torch.nn.Parameter)


def _is_dtensor(obj: object) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(obj, DTensor)


def _strided(obj: object) -> bool:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(obj, DTensor) and any(isinstance(p, _StridedShard) for p in obj.placements)


def _object_nbytes(obj: object) -> int:
    """Deterministic size estimate of a non-tensor value (only used to plan)."""
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return 1024


def _tensor_item(fqn: str, tensor: torch.Tensor) -> WriteItem:
    offsets = torch.Size([0] * tensor.dim())
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=tensor.size()),
            properties=TensorProperties.create_from_tensor(tensor),
            size=tensor.size(),
        ),
    )


# A unit (what the planner cuts between) is the largest block of trailing
# dimensions of at most this many bytes.
UNIT_MAX_BYTES = 64 * 1024


def _itemsize(item: WriteItem) -> int:
    td = item.tensor_data
    assert td is not None
    return torch.empty((), dtype=td.properties.dtype).element_size()


def _row_split(item: WriteItem) -> tuple[int, int]:
    """(rows, bytes per row) of a tensor WriteItem's chunk (an owned shard,
    written whole)."""
    td = item.tensor_data
    assert td is not None
    sizes = list(td.chunk.sizes)
    itemsize = _itemsize(item)
    if not sizes:
        return 1, itemsize
    return sizes[0], math.prod(sizes[1:]) * itemsize


def unit_elements(shape: tuple[int, ...] | list[int], itemsize: int) -> int:
    """Elements per unit of a tensor: the product of the most trailing
    dimensions, never dimension 0, whose block stays within
    ``UNIT_MAX_BYTES`` (1 when even one row of the last dimension is larger),
    so a tensor can always be cut at least between its dimension-0 rows."""
    elems = 1
    for d in reversed(shape[1:]):
        if elems * d * itemsize > UNIT_MAX_BYTES:
            break
        elems *= d
    return max(elems, 1)


Box = tuple[list[int], list[int]]


def flat_range_boxes(shape: tuple[int, ...] | list[int], start: int, stop: int) -> list[Box]:
    """The elements ``[start, stop)`` of a tensor of ``shape``, in C order, as
    boxes ``(offsets, sizes)``: at most ``2 * len(shape) - 1``, in order. A
    range of whole dimension-0 slabs is one box; otherwise a partial slab at
    either end is split the same way, one dimension down."""
    if start >= stop:
        return []
    if not shape:
        return [([], [])]
    if len(shape) == 1:
        return [([start], [stop - start])]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = list(shape[1:])

    def within(row: int, lo: int, hi: int) -> list[Box]:
        return [([row, *o], [1, *z]) for o, z in flat_range_boxes(rest, lo, hi)]

    if first == last:
        return within(first, head, tail)
    out: list[Box] = []
    if head:
        out += within(first, head, inner)
        first += 1
    if last > first:
        out.append(([first] + [0] * len(rest), [last - first, *rest]))
    if tail:
        out += within(last, 0, tail)
    return out


def _piece_items(leaf: _Leaf, start: int, stop: int) -> list[WriteItem]:
    """The WriteItems (one per box) of units ``[start, stop)`` of a
    replicated tensor; the whole-tensor item when the piece is all of it."""
    if start == 0 and stop == leaf.units:
        return [leaf.item]
    td = leaf.item.tensor_data
    assert td is not None
    items = []
    for offsets, sizes in flat_range_boxes(
        list(td.size), start * leaf.unit_elems, stop * leaf.unit_elems
    ):
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items.append(
            WriteItem(
                index=MetadataIndex(leaf.fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=td.properties, size=td.size),
            )
        )
    return items


def _manifest(leaves: list[_Leaf]) -> Manifest:
    descs: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves):
        path: list[str | int] = ["r", leaf.fqn] if leaf.owner is None else ["o", i, leaf.fqn]
        if leaf.item.type == WriteItemType.BYTE_IO:
            descs.append({"path": path, "kind": "object", "nbytes": leaf.unit_bytes})
        else:
            d: dict[str, Any] = {
                "path": path,
                "dtype": "uint8",
                "shape": [leaf.units, leaf.unit_bytes],
            }
            if leaf.owner is not None:
                d["owner"] = leaf.owner
            descs.append(d)
    return Manifest.from_leaves(descs)


def _assign(plan: Plan, leaves: list[_Leaf]) -> list[list[WriteItem]]:
    """Per rank, the WriteItems of a DeepPart plan."""
    out: list[list[WriteItem]] = []
    for r in range(plan.world_size):
        items: list[WriteItem] = []
        for leaf_index, start, stop in plan.rank_pieces(r):
            leaf = leaves[leaf_index]
            if leaf.owner is not None or leaf.item.type == WriteItemType.BYTE_IO:
                # Written whole by its owner, once (even if planned in pieces).
                if start == 0:
                    items.append(leaf.item)
                continue
            ub = leaf.unit_bytes
            if ub == 0 or leaf.units <= 1:
                items.append(leaf.item)
                continue
            if start % ub or stop % ub:
                raise DcpPlanError(f"piece {start}:{stop} of {leaf.fqn!r} cuts a unit")
            items += _piece_items(leaf, start // ub, stop // ub)
        out.append(items)
    return out


def _owned_leaf(item: WriteItem, owner: int) -> _Leaf:
    if item.type == WriteItemType.BYTE_IO:
        return _Leaf(item.index.fqn, 1, 1, item, owner)
    rows, rb = _row_split(item)
    return _Leaf(item.index.fqn, rows, rb, item, owner)


def _item_shape(item: WriteItem) -> list[int] | None:
    td = item.tensor_data
    return None if td is None else [*td.size, *td.chunk.offsets, *td.chunk.sizes]


def _item_bytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 1
    return math.prod(item.tensor_data.chunk.sizes) * _itemsize(item)


def split_shard(item: WriteItem, parts: int) -> list[list[WriteItem]]:
    """A shard's WriteItem cut into up to ``parts`` parts of about equal size,
    on unit boundaries (:func:`unit_elements`), each part the WriteItems of
    its boxes (:func:`flat_range_boxes`) in global coordinates. One part,
    the item itself, when it cannot be cut."""
    td = item.tensor_data
    if item.type == WriteItemType.BYTE_IO or td is None or parts < 2:
        return [[item]]
    sizes = list(td.chunk.sizes)
    offsets = list(td.chunk.offsets)
    unit = unit_elements(sizes, _itemsize(item))
    units = math.prod(sizes) // unit if sizes else 0
    if units < 2:
        return [[item]]
    out: list[list[WriteItem]] = []
    for k in range(parts):
        a, b = k * units // parts, (k + 1) * units // parts
        if a == b:
            continue
        part = []
        for off, size in flat_range_boxes(sizes, a * unit, b * unit):
            at = torch.Size([o + base for o, base in zip(off, offsets, strict=True)])
            chunk = ChunkStorageMetadata(offsets=at, sizes=torch.Size(size))
            part.append(
                WriteItem(
                    index=MetadataIndex(item.index.fqn, at),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=chunk, properties=td.properties, size=td.size
                    ),
                )
            )
        out.append(part)
    return out


# The torch values a TensorProperties field may hold, named as ``str()``
# names them ("torch.float32", "torch.strided", "torch.contiguous_format").
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


def _plain(value: object) -> object:
    if isinstance(value, _TORCH_VALUES):
        return str(value)
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _torch_value(text: str) -> object:
    value = getattr(torch, text.removeprefix("torch."), None)
    if not text.startswith("torch.") or not isinstance(value, _TORCH_VALUES):
        raise ValueError(f"not a torch dtype, layout or memory format: {text!r}")
    return value


def _path_code(fqn: str, path: tuple[str | int, ...] | None) -> int | list[Any] | None:
    """A flattening mapping's path, short: DCP's flattening joins the path
    with dots, so mostly the path is the key split at its dots, and a bit
    mask of which parts are ints says it all; else the path itself."""
    if path is None:
        return None
    if ".".join(map(str, path)) == fqn and all(
        isinstance(k, int) or (isinstance(k, str) and "." not in k) for k in path
    ):
        return sum(1 << i for i, k in enumerate(path) if isinstance(k, int))
    return list(path)


def _path_of(fqn: str, code: int | list[Any]) -> tuple[str | int, ...]:
    """The path that :func:`_path_code` made ``code`` of."""
    if isinstance(code, list):
        return tuple(code)
    return tuple(int(k) if code >> i & 1 else k for i, k in enumerate(fqn.split(".")))


def _describe(leaves: list[_Leaf], mappings: dict[str, Any]) -> bytes:
    """A rank's replicated items (and their flattening mappings) for a
    coordinator that does not hold them: one JSON row per item (its key,
    path, and a tensor's size and ``TensorProperties`` fields in their
    order: every rank of a job runs the same torch), compressed. Only read when
    the ranks' replicated states differ (:func:`_undescribe`)."""
    rows: list[list[Any]] = []
    fields = [f.name for f in dataclasses.fields(TensorProperties)]
    for leaf in leaves:
        path = _path_code(leaf.fqn, mappings.get(leaf.fqn))
        td = leaf.item.tensor_data
        if td is None:
            rows.append([leaf.fqn, path])
            continue
        props = [_plain(getattr(td.properties, name)) for name in fields]
        rows.append([leaf.fqn, path, list(td.size), props])
    return zlib.compress(json.dumps(rows, separators=(",", ":")).encode(), 6)


def _undescribe(blob: bytes, rank: int) -> tuple[list[WriteItem], dict[str, Any]]:
    """Rank ``rank``'s replicated items and their mappings, from
    :func:`_describe` (the WriteItems that ``create_default_local_save_plan``
    would list for them)."""
    items: list[WriteItem] = []
    mappings: dict[str, Any] = {}
    try:
        for row in json.loads(zlib.decompress(blob)):
            fqn = str(row[0])
            if row[1] is not None:
                mappings[fqn] = _path_of(fqn, row[1])
            if len(row) == 2:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                continue
            props: list[Any] = [
                _torch_value(v) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v
                for v in row[3]
            ]
            size = torch.Size(int(x) for x in row[2])
            offsets = torch.Size([0] * len(size))
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                        properties=TensorProperties(*props),
                        size=size,
                    ),
                )
            )
    except (zlib.error, ValueError, TypeError, KeyError, IndexError) as e:
        raise DcpPlanError(
            f"rank {rank}: its local plan's replicated items do not decode: {e}"
        ) from e
    return items, mappings


def _validate(global_plan: list[SavePlan], metadata: Metadata) -> None:
    """DCP's own check of a global plan (as ``DefaultSavePlanner`` runs it):
    every chunk within its tensor, no two chunks overlapping, and the
    chunks covering each tensor."""
    from torch.distributed.checkpoint.default_planner import _validate_global_plan

    errors = _validate_global_plan(global_plan, metadata)
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise DcpPlanError(f"Failed to validate global plan: {summary}")


def row_grain(cost: CostModel | None) -> CostModel:
    """``cost`` (default: the default model) with cuts on whole rows only."""
    fields = {} if cost is None else cost.to_dict()
    fields["grain"] = "row"
    return CostModel(**fields)


class BalancedSavePlanner(DefaultSavePlanner):
    """A ``SavePlanner`` for ``torch.distributed.checkpoint.save`` that splits
    and balances replicated state with DeepPart (see the module docstring).

    ``algorithm``, ``cost`` and ``topology`` go to :func:`deeppart.plan`
    (with the cost model's ``grain`` set to ``"row"``: a DCP chunk must be a
    box, so cuts fall on rows of the manifest's ``uint8[units, unit_bytes]``
    leaves: between units, which :func:`flat_range_boxes` maps to boxes);
    ``cache`` selects
    the plan cache (default: DeepPart's default cache, in memory and on
    disk). ``process_group`` must be the group passed to
    ``dcp.save`` when that is not the default group.

    After a save, ``plan_seconds`` is the time spent in ``create_local_plan``
    and ``create_global_plan`` on this rank, and ``deeppart_plan`` the plan.
    """

    def __init__(
        self,
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
        cache: CacheArg = None,
        process_group: dist.ProcessGroup | None = None,
        flatten_state_dict: bool = True,
        flatten_sharded_tensors: bool = True,
    ) -> None:
        super().__init__(
            flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors
        )
        self.algorithm = algorithm
        self.cost = cost
        self.topology = topology
        self.cache = cache
        self.process_group = process_group
        self.plan_seconds = 0.0
        self.deeppart_plan: Plan | None = None
        self._leaves: list[_Leaf] = []
        self._own_items: list[WriteItem] = []
        self._fingerprint = ""
        #: This rank's speculative plan: its rank, the world size and every
        #: rank's items (create_local_plan).
        self._speculative: tuple[int, int, list[list[WriteItem]]] | None = None
        #: Every rank's items, on the rank that made the global plan.
        self._per_rank: list[list[WriteItem]] | None = None

    # -- planning ----------------------------------------------------------

    def _plan(
        self, leaves: list[_Leaf], world_size: int
    ) -> tuple[Plan | None, list[list[WriteItem]]]:
        # Empty tensors have nothing to balance: their owner (or rank 0)
        # writes their one empty chunk, so that the metadata lists them.
        sized = [leaf for leaf in leaves if leaf.units * leaf.unit_bytes > 0]
        per_rank: list[list[WriteItem]] = [[] for _ in range(world_size)]
        p: Plan | None = None
        if sized:
            p = deeppart_plan(
                _manifest(sized),
                world_size,
                algorithm=self.algorithm,
                cost=row_grain(self.cost),
                topology=self.topology,
                cache=self.cache,
            )
            per_rank = _assign(p, sized)
        for leaf in leaves:
            if leaf.units * leaf.unit_bytes == 0:
                per_rank[leaf.owner or 0].append(leaf.item)
        return p, per_rank

    def create_local_plan(self) -> SavePlan:
        # No collective here (DCP's contract: a rank that failed before
        # planning goes straight to DCP's gather, which must meet the
        # others'): what the coordinator needs travels in the local plan.
        t0 = time.perf_counter()
        replicated: list[_Leaf] = []
        own: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if _plain_tensor(obj):
                item = _tensor_item(fqn, obj)
                unit = unit_elements(tuple(obj.shape), obj.element_size())
                units = obj.numel() // unit if obj.numel() else 0
                leaf = _Leaf(fqn, units, unit * obj.element_size(), item, None, unit)
                replicated.append(leaf)
            elif isinstance(obj, torch.Tensor):
                own += create_default_local_save_plan({fqn: obj}, self.is_coordinator).items
            else:
                item = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                replicated.append(_Leaf(fqn, 1, _object_nbytes(obj), item, None))
        # The replicated manifest's structure identifies the state: ranks
        # that disagree on it do not hold replicas.
        self._fingerprint = _manifest(replicated).fingerprint
        self._leaves = replicated
        self._own_items = own
        # Speculate that every rank holds this replicated state and that no
        # rank owns anything (the common, pure data-parallel case), at this
        # rank's place in the default group (or ``process_group``): the
        # coordinator says whether the speculation holds and where this
        # rank stands (finish_plan).
        self._speculative = None
        self._per_rank = None
        if not own:
            rank, world = self._rank_world()
            p, per_rank = self._plan(replicated, world)
            self.deeppart_plan = p
            self._speculative = (rank, world, per_rank)
        own_fqns = {it.index.fqn for it in own}
        data = {
            _KEY: {
                # Shards whose WriteItem chunk is not a box of the local
                # tensor (_StridedShard): written whole, never cut.
                "whole": sorted(fqn for fqn, obj in self.state_dict.items() if _strided(obj)),
                "fingerprint": self._fingerprint,
                # The replicated items, compressed, for a coordinator whose
                # own replicated state differs (groups of ranks that hold
                # different plain state).
                "replicated": _describe(replicated, self.mappings),
                # Only the mappings of keys that the coordinator may lack.
                "mappings": {k: v for k, v in self.mappings.items() if k in own_fqns},
            }
        }
        self.plan = SavePlan(own, planner_data=data)
        self.plan_seconds = time.perf_counter() - t0
        return self.plan

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        t0 = time.perf_counter()
        world = len(all_plans)
        infos = [p.planner_data[_KEY] for p in all_plans]
        items = [list(p.items) for p in all_plans]
        mappings = [dict(info["mappings"]) for info in infos]
        leaves = list(self._leaves)
        subset = any(info["fingerprint"] != self._fingerprint for info in infos)
        if subset:
            # Groups of ranks hold different plain state (two data-parallel
            # groups): each rank's replicated items are balanced over the
            # ranks that list them, as DTensor replicas.
            for r, info in enumerate(infos):
                listed, paths = _undescribe(info["replicated"], r)
                items[r] += listed
                mappings[r].update(paths)
            leaves = []
        # Owned shards. A shard that several ranks list (a DTensor replicated
        # over part of its mesh: HSDP, DDP in a 2-D mesh, TP x DP) is cut into
        # as many box-aligned parts as it has holders, each part given to its
        # least-loaded holder (largest parts first, after the shards that one
        # rank holds alone).
        base = len(leaves)
        holders: dict[MetadataIndex, list[int]] = {}
        first: dict[MetadataIndex, WriteItem] = {}
        for r, local in enumerate(items):
            for item in local:
                holders.setdefault(item.index, []).append(r)
                seen = first.setdefault(item.index, item)
                if _item_shape(seen) != _item_shape(item):
                    raise DcpPlanError(
                        f"{item.index.fqn!r} is {_item_shape(seen)} on rank "
                        f"{holders[item.index][0]} and {_item_shape(item)} on rank {r}: groups "
                        "of ranks that hold different states must give them different keys "
                        "(e.g. prefix each group's state dict)"
                    )
        whole = {fqn for info in infos for fqn in info.get("whole", [])}
        load = [0] * world
        shared: list[tuple[int, list[WriteItem], list[int]]] = []
        for index, item in first.items():
            ranks = holders[index]
            if len(ranks) == 1:
                leaves.append(_owned_leaf(item, ranks[0]))
                load[ranks[0]] += _item_bytes(item)
                continue
            cut = [[item]] if index.fqn in whole else split_shard(item, len(ranks))
            shared += [(sum(map(_item_bytes, part)), part, ranks) for part in cut]
        for nbytes, part, ranks in sorted(shared, key=lambda x: -x[0]):
            r = min(ranks, key=lambda k: (load[k], k))
            load[r] += nbytes
            leaves += [_owned_leaf(item, r) for item in part]
        # Nothing owned, one replicated state: every rank plans it alike.
        alike = len(leaves) == base and not subset
        spec = self._speculative
        if alike and spec is not None and spec[1] == world:
            per_rank = spec[2]  # the coordinator's own speculation
        else:
            p, per_rank = self._plan(leaves, world)
            self.deeppart_plan = p
        plans = [
            dataclasses.replace(all_plans[r], items=per_rank[r], planner_data=None)
            for r in range(world)
        ]
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:
            merged = dict(ChainMap(*mappings, self.mappings))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        _validate(global_plan, metadata)
        self.global_plan = global_plan
        self.metadata = metadata
        self._per_rank = per_rank
        if alike:
            # Scatter only a marker with the rank's place (finish_plan).
            out = [
                SavePlan([], usable=False, planner_data={_KEY: {"rank": r, "world": world}})
                for r in range(world)
            ]
        else:
            out = global_plan
        self.plan_seconds += time.perf_counter() - t0
        return out, metadata

    def _rank_world(self) -> tuple[int, int]:
        """This rank's place in ``process_group`` (no collective), where the
        speculation plans it; DCP may save without it (``no_dist``)."""
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return 0, 1

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:
            t0 = time.perf_counter()
            info = (new_plan.planner_data or {}).get(_KEY)
            if info is None:
                raise DcpPlanError("the coordinator sent no plan and no place for this rank")
            rank, world = int(info["rank"]), int(info["world"])
            spec = self._speculative
            if self._per_rank is not None and len(self._per_rank) == world:
                mine = self._per_rank[rank]  # this rank planned the save
            elif spec is not None and spec[:2] == (rank, world):
                mine = spec[2][rank]
            else:
                p, per_rank = self._plan(self._leaves, world)
                self.deeppart_plan = p
                mine = per_rank[rank]
            new_plan = dataclasses.replace(new_plan, items=mine, usable=True, planner_data=None)
            self.plan_seconds += time.perf_counter() - t0
        self.plan = new_plan
        return new_plan

    # -- writing -----------------------------------------------------------

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.SHARD and write_item.tensor_data is not None:
            obj = self.state_dict.get(write_item.index.fqn)
            if _is_dtensor(obj) and not _strided(obj):
                # A part of this rank's shard (split_shard): its box of the local tensor.
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                assert isinstance(obj, torch.Tensor)
                mesh, placements = obj.device_mesh, obj.placements  # type: ignore[attr-defined]
                _, base = compute_local_shape_and_global_offset(obj.shape, mesh, placements)
                chunk = write_item.tensor_data.chunk
                part = obj.to_local().detach()  # type: ignore[attr-defined]
                for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                    part = part.narrow(dim, offset - base[dim], size)
                return cast(torch.Tensor, part)
            if _plain_tensor(obj):
                assert isinstance(obj, torch.Tensor)
                chunk = write_item.tensor_data.chunk
                box = obj.detach()
                for dim, (offset, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                    box = box.narrow(dim, offset, size)
                return box
        return super().resolve_data(write_item)
