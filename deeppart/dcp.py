"""``BalancedSavePlanner``: DeepPart's plan inside ``torch.distributed.checkpoint``.

The one-line change for DCP users::

    import torch.distributed.checkpoint as dcp
    from deeppart.dcp import BalancedSavePlanner

    dcp.save(state, checkpoint_id=path, planner=BalancedSavePlanner())

What it changes against ``DefaultSavePlanner``:

- **Who writes what.** DCP gives every replicated item whole to the rank with
  the fewest bytes so far (``dedup_save_plans``). Here every replicated tensor
  and object becomes a leaf of a DeepPart :class:`~deeppart.Manifest`, and
  :func:`deeppart.plan` balances them; a tensor larger than a rank's share is
  cut into row ranges, each written as a chunk
  (``ChunkStorageMetadata(offsets=[row0, 0, ...], sizes=[rows, *shape[1:]])``)
  by a different rank. Items a rank already owns alone (``DTensor``,
  ``ShardedTensor`` shards) are counted as owned leaves (``owner=rank``), so
  the replicated load goes to the ranks with less of their own.
- **Less plan traffic.** All ranks hold the same replicated state, so each
  rank plans deterministically in ``create_local_plan`` and sends the
  coordinator only its own shards and a fingerprint of its replicated state
  (not one WriteItem per tensor). The coordinator checks that the
  fingerprints agree, rebuilds the same plan, and writes the global
  ``Metadata``; when no rank owns anything, it scatters an empty "use your
  own plan" marker instead of the per-rank plans.
- **Plan cache.** Plans go through DeepPart's plan cache (memory and disk by
  default), so repeated saves and restarts skip planning.

The checkpoint is a standard DCP checkpoint: stock
``torch.distributed.checkpoint.load`` reads it at any world size.

Leaves are described to the planner as ``uint8[rows, row_bytes]`` (a 0-D
tensor as one row), so every cut falls on a row of the real tensor.
"""

from __future__ import annotations

import dataclasses
import io
import math
import pickle
import time
from collections import ChainMap
from dataclasses import dataclass
from typing import Any

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
from deeppart.planning import CacheArg
from deeppart.planning import plan as deeppart_plan

__all__ = ["BalancedSavePlanner", "DcpPlanError"]

# The key of DeepPart's entry in a SavePlan's ``planner_data``.
_KEY = "deeppart"


class DcpPlanError(RuntimeError):
    """The ranks' replicated states differ, or a plan does not fit the state."""


@dataclass(frozen=True)
class _Leaf:
    """One leaf of the manifest: a replicated state-dict entry or an owned shard."""

    fqn: str
    rows: int  # 1 for objects and 0-D tensors
    row_bytes: int
    item: WriteItem  # the whole-tensor (or bytes, or shard) WriteItem
    owner: int | None


def _plain_tensor(obj: object) -> bool:
    # A DTensor, ShardedTensor or other checkpointable tensor subclass knows
    # its own chunks; only plain tensors are replicated values.
    return type(obj) in (torch.Tensor, torch.nn.Parameter)


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


def _row_split(item: WriteItem) -> tuple[int, int]:
    """(rows, bytes per row) of a tensor WriteItem's chunk."""
    td = item.tensor_data
    assert td is not None
    sizes = list(td.chunk.sizes)
    itemsize = torch.empty((), dtype=td.properties.dtype).element_size()
    if not sizes:
        return 1, itemsize
    return sizes[0], math.prod(sizes[1:]) * itemsize


def _piece_item(leaf: _Leaf, row0: int, rows: int) -> WriteItem:
    """The WriteItem of rows ``[row0, row0 + rows)`` of a replicated tensor."""
    if rows == leaf.rows:
        return leaf.item
    td = leaf.item.tensor_data
    assert td is not None
    offsets = torch.Size([row0] + [0] * (len(td.size) - 1))
    sizes = torch.Size([rows, *td.size[1:]])
    return WriteItem(
        index=MetadataIndex(leaf.fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=td.properties,
            size=td.size,
        ),
    )


def _manifest(leaves: list[_Leaf]) -> Manifest:
    descs: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves):
        path: list[str | int] = ["r", leaf.fqn] if leaf.owner is None else ["o", i, leaf.fqn]
        if leaf.item.type == WriteItemType.BYTE_IO:
            descs.append({"path": path, "kind": "object", "nbytes": leaf.row_bytes})
        else:
            d: dict[str, Any] = {
                "path": path,
                "dtype": "uint8",
                "shape": [leaf.rows, leaf.row_bytes],
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
            rb = leaf.row_bytes
            if rb == 0 or leaf.rows <= 1:
                items.append(leaf.item)
                continue
            if start % rb or stop % rb:
                raise DcpPlanError(f"piece {start}:{stop} of {leaf.fqn!r} is not row-aligned")
            items.append(_piece_item(leaf, start // rb, (stop - start) // rb))
        out.append(items)
    return out


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
    box, so cuts fall on rows of the manifest's tensors); ``cache`` selects
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

    # -- planning ----------------------------------------------------------

    def _rank_world(self) -> tuple[int, int]:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.process_group), dist.get_world_size(self.process_group)
        return 0, 1

    def _plan(
        self, leaves: list[_Leaf], world_size: int
    ) -> tuple[Plan | None, list[list[WriteItem]]]:
        # Empty tensors have nothing to balance: their owner (or rank 0)
        # writes their one empty chunk, so that the metadata lists them.
        sized = [leaf for leaf in leaves if leaf.rows * leaf.row_bytes > 0]
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
            if leaf.rows * leaf.row_bytes == 0:
                per_rank[leaf.owner or 0].append(leaf.item)
        return p, per_rank

    def create_local_plan(self) -> SavePlan:
        t0 = time.perf_counter()
        rank, world = self._rank_world()
        replicated: list[_Leaf] = []
        own: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if _plain_tensor(obj):
                item = _tensor_item(fqn, obj)
                rows, rb = _row_split(item)
                replicated.append(_Leaf(fqn, rows, rb, item, None))
            elif isinstance(obj, torch.Tensor):
                own += create_default_local_save_plan({fqn: obj}, self.is_coordinator).items
            else:
                item = WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)
                replicated.append(_Leaf(fqn, 1, _object_nbytes(obj), item, None))
        self._leaves = replicated
        self._own_items = own
        self._rank, self._world = rank, world
        # The replicated manifest's structure identifies the state: ranks
        # that disagree on it do not hold replicas.
        self._fingerprint = _manifest(replicated).fingerprint
        # Speculate that no rank owns anything: the common, pure data-parallel
        # case. The coordinator says whether the speculation holds.
        self._speculative: list[WriteItem] | None = None
        self._speculative_all: list[list[WriteItem]] | None = None
        if not own:
            p, per_rank = self._plan(replicated, world)
            self.deeppart_plan = p
            self._speculative = per_rank[rank]
            self._speculative_all = per_rank
        own_fqns = {it.index.fqn for it in own}
        data = {
            _KEY: {
                "fingerprint": self._fingerprint,
                "rank": rank,
                "world": world,
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
        bad = [r for r, info in enumerate(infos) if info["fingerprint"] != self._fingerprint]
        if bad:
            raise DcpPlanError(
                f"ranks {bad} hold a different replicated state than the coordinator "
                "(other keys, shapes or dtypes): BalancedSavePlanner needs every rank to "
                "hold the same plain tensors and objects; keep per-rank values in "
                "DTensor/ShardedTensor or use DefaultSavePlanner"
            )
        # Owned shards, each written once (a replicated DTensor is listed by
        # every rank of its mesh: its lowest rank keeps it).
        leaves = list(self._leaves)
        seen: set[MetadataIndex] = set()
        for r, local in enumerate(all_plans):
            for item in local.items:
                if item.index in seen:
                    continue
                seen.add(item.index)
                if item.type == WriteItemType.BYTE_IO:
                    leaves.append(_Leaf(item.index.fqn, 1, 1, item, r))
                else:
                    rows, rb = _row_split(item)
                    leaves.append(_Leaf(item.index.fqn, rows, rb, item, r))
        owned = len(leaves) > len(self._leaves)
        speculation_holds = not owned and all(
            info["rank"] == r and info["world"] == world for r, info in enumerate(infos)
        )
        if speculation_holds and self._speculative_all is not None:
            per_rank = self._speculative_all  # the coordinator's own speculation
        else:
            p, per_rank = self._plan(leaves, world)
            self.deeppart_plan = p
        plans = [
            dataclasses.replace(all_plans[r], items=per_rank[r], planner_data=None)
            for r in range(world)
        ]
        global_plan, metadata = create_default_global_save_plan(plans)
        if self.flatten_state_dict:
            mappings = dict(ChainMap(*(info["mappings"] for info in infos), self.mappings))
            metadata = dataclasses.replace(metadata, planner_data=mappings)
        self.global_plan = global_plan
        self.metadata = metadata
        if speculation_holds:
            # Every rank already knows its items: scatter only a marker.
            out = [SavePlan([], usable=False) for _ in range(world)]
        else:
            out = global_plan
        self.plan_seconds += time.perf_counter() - t0
        return out, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:
            if self._speculative is None:
                raise DcpPlanError("the coordinator sent no plan and this rank has none")
            new_plan = dataclasses.replace(new_plan, items=self._speculative, usable=True)
        self.plan = new_plan
        return new_plan

    # -- writing -----------------------------------------------------------

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.SHARD and write_item.tensor_data is not None:
            obj = self.state_dict.get(write_item.index.fqn)
            if _plain_tensor(obj):
                assert isinstance(obj, torch.Tensor)
                chunk = write_item.tensor_data.chunk
                return obj.detach().narrow(0, chunk.offsets[0], chunk.sizes[0])
        return super().resolve_data(write_item)
