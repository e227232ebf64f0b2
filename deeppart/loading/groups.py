"""``group=`` on :func:`deeppart.save` and :func:`deeppart.load`.

By default every rank passes its own tree and the checkpoint is the union
of what the ranks hold (:mod:`deeppart.state.union`): DTensors on any mesh,
pipeline stages, per-rank values and groups with their own keys need no
``group=``. What ``group=`` still adds on save:

- ``group=<ProcessGroup | list of global ranks>`` (explicit): this rank's
  replica group. Its tree is stored under its own top-level key,
  :func:`namespace` (``"ranks:0,1"``): groups whose trees have the same
  paths and shapes but hold different values (plain ``to_local()`` shards
  of tensor parallelism) are kept apart by name, and a load names the
  group to read (``load(group=...)``), also at another world size.
- ``group="auto"``: the union model, but tensors that ranks hold under one
  path with the same dtype and shape are compared by a digest of their
  whole bytes, not a sample: two data-parallel groups whose tensors differ
  anywhere are stored as two versions (each group restores its own).

On load, :func:`load_view` maps ``group=`` to a selection: this rank reads
only its own leaves (``into=``'s, or its group's tree). Ranks that select
different leaves each read their own pieces (:func:`read_own`), with no
exchange.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from deeppart.errors import StateError
from deeppart.loading.reader import ReadPlan
from deeppart.state.state import flatten

__all__ = [
    "AUTO",
    "LoadView",
    "group_ranks",
    "load_view",
    "namespace",
    "read_own",
    "selection_digest",
]

#: ``group="auto"``: holders from the ranks' leaf descriptions.
AUTO = "auto"

_FIX = (
    "pass deeppart.save(..., group=<this rank's replica group: a ProcessGroup or a list of "
    "ranks>) on every rank, or give each group's state its own key prefix"
)


def namespace(ranks: list[int]) -> str:
    """The top-level key under which an explicit group's tree is stored."""
    return "ranks:" + ",".join(map(str, ranks))


def group_ranks(group: Any, rank: int | None = None, world: int | None = None) -> list[int]:
    """The sorted global ranks of ``group`` (a torch ProcessGroup, or a list
    of ranks); checks that ``rank`` is among them when given."""
    if isinstance(group, list | tuple | range):
        ranks = sorted({int(r) for r in group})
    else:
        try:
            import torch.distributed as dist

            ranks = sorted(dist.get_process_group_ranks(group))
        except Exception as e:
            raise StateError(
                f'group= must be a torch ProcessGroup, a list of ranks or "auto", not {group!r}'
            ) from e
    if not ranks or (world is not None and not all(0 <= r < world for r in ranks)):
        raise StateError(f"group={ranks}: ranks must be a non-empty list below the world size")
    if rank is not None and rank not in ranks:
        raise StateError(f"group={ranks} does not hold this rank ({rank}); pass its own group")
    return ranks


# ----------------------------------------------------------------------------
# Save.


# ----------------------------------------------------------------------------
# Load.


@dataclass
class LoadView:
    """What a load with ``group=`` asks of the usual stages."""

    into: Any
    keys: Any
    #: The top-level key to unwrap from the loaded tree (explicit groups).
    unwrap: str | None


def _paths(state: Any) -> list[tuple[Any, ...]]:
    leaves, _ = flatten(state)
    return [lf.path for lf in leaves]


def load_view(group: Any, into: Any, keys: Any, rank: int) -> LoadView:
    """``group=`` on load: ``"auto"`` reads ``into=``'s leaves only (the
    checkpoint may hold other groups' leaves); a group (a ProcessGroup, or
    the saved ranks of one group as a list) reads that group's tree. A key
    the checkpoint lacks raises the usual StateMismatchError."""
    if group is None:
        return LoadView(into, keys, None)
    if group == AUTO:
        if into is None or keys is not None:
            raise StateError('load(group="auto") needs into= (the leaves to load) and no keys=')
        return LoadView(into, _paths(into), None)
    ns = namespace(group_ranks(group))
    if keys is not None:
        keys = [(ns, *(k if isinstance(k, tuple) else (k,))) for k in keys]
    elif into is not None:
        keys = [(ns, *p) for p in _paths(into)]
    else:
        keys = [ns]
    return LoadView(None if into is None else {ns: into}, keys, ns)


def selection_digest(rp: ReadPlan) -> bytes:
    """16 bytes naming the leaves this rank reads (compared across ranks)."""
    return hashlib.blake2b(bytes(t is not None for t in rp.targets), digest_size=16).digest()


def read_own(rp: ReadPlan, rank: int) -> ReadPlan:
    """``rp`` changed so that this rank reads every piece it needs itself:
    for ranks that select different leaves (no broadcast can serve them)."""
    rp.read_all, rp.via_shared = True, False
    rp.owner = [rank] * rp.meta.world_size
    rp.mine = [f for f in range(rp.meta.world_size) if rp.by_file[f]]
    return rp
