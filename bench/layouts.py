"""The zoo's states laid out as large models are trained (holder groups).

The same rules as the planner's zoo layout tests (``laid_out`` in
planner/tests/zoo.rs, which is Rust test code the binding cannot reach; keep
the two in step), so that bench/planner.py's layouts table scores the
manifests the planner's tests check:

- ``hsdp``: FSDP2 on a (replicate P/8, shard 8) mesh: every tensor of at
  least 8 rows in 8 row shards, shard ``s`` held by the ranks ``r % 8 == s``;
- ``tp``: tensor parallel 8 x DP: matrices (2 or more dimensions, 8 or more
  rows) in 8 row shards on the ranks ``r % 8 == t``, the rest on every rank;
- ``ep``: expert parallel 8 x DP (MoE models): stacked expert tensors (3-D)
  in 8 shards of experts on the ranks ``r % 8 == e``, the rest on every rank;
- ``pp``: pipeline 4 x DP: parameter ``i`` of ``n`` (and its optimizer
  state) on stage ``4 i / n``, held by the ranks of block ``s`` of P/4.

Plus :func:`tp_ep_dp`, the at-scale case (DeepSeek-V3-shaped TP=8 x EP=16 x
DP): rank ``r`` has ``tp = r % 8``, ``ep = (r // 8) % 16``; expert tensors
are cut into 16 expert shards and each of those into 8 row shards of its
second dimension, held by the ranks of that (ep, tp); other matrices into 8
TP row shards; the rest on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import deeppart

LAYOUTS = ("hsdp", "tp", "ep", "pp")


def _row_shard(shape: list[int], s: int, parts: int, dim: int = 0) -> list[int] | None:
    rows = -(-shape[dim] // parts)
    have = min(max(shape[dim] - s * rows, 0), rows)
    if have <= 0:
        return None
    out = list(shape)
    out[dim] = have
    return out


def _shards(
    leaf: dict[str, Any],
    shape: list[int],
    parts: int,
    group_of: Callable[[int], int],
    prefix: tuple[int, ...] = (),
    dim: int = 0,
) -> list[dict[str, Any]]:
    """The non-empty ``parts`` row shards of ``leaf`` (of ``shape``) along
    ``dim``, shard ``s`` at path ``leaf path + prefix + (s,)`` held by group
    ``group_of(s)``."""
    out: list[dict[str, Any]] = []
    for s in range(parts):
        part = _row_shard(shape, s, parts, dim)
        if part is not None:
            path = [*leaf["path"], *prefix, s]
            out.append(
                {"path": path, "dtype": leaf["dtype"], "shape": part, "holders": group_of(s)}
            )
    return out


def _ep_group(tp: int, e: int, t: int) -> int:
    """The group index of expert shard ``e``, TP shard ``t`` in :func:`tp_ep_dp`."""
    return tp + e * tp + t


def _param_index(path: tuple[Any, ...], model_index: dict[tuple[Any, ...], int]) -> int | None:
    if len(path) >= 3 and path[0] == "optim" and path[1] == "state" and isinstance(path[2], int):
        return path[2]
    return model_index.get(path)


def _plain(leaf: dict[str, Any]) -> dict[str, Any]:
    """A leaf description as ``Manifest.from_leaves`` takes it."""
    out: dict[str, Any] = {"path": list(leaf["path"])}
    if leaf["kind"] == "object":
        out |= {"kind": "object", "nbytes": leaf["nbytes"]}
    else:
        out |= {"dtype": leaf["dtype"], "shape": list(leaf["shape"])}
    if leaf.get("owner") is not None:
        out["owner"] = leaf["owner"]
    return out


def laid_out(m: deeppart.Manifest, layout: str, world: int) -> deeppart.Manifest | None:
    """``m`` laid out over ``world`` ranks; ``None`` when the layout does not
    apply (expert parallelism on a model without stacked experts)."""
    if layout == "pp":
        parts = 4
        groups = [list(range(s * world // 4, (s + 1) * world // 4)) for s in range(4)]
    else:
        parts = 8
        groups = [list(range(s, world, 8)) for s in range(8)]
    leaves = m.leaves()
    model_index = {
        lf["path"]: i
        for i, lf in enumerate(lf for lf in leaves if lf["path"] and lf["path"][0] == "model")
    }
    params = max(len(model_index), 1)
    out: list[dict[str, Any]] = []
    sharded_any = False
    for leaf in leaves:
        shape = list(leaf["shape"]) if leaf["kind"] == "tensor" else None
        if layout == "pp":
            i = _param_index(leaf["path"], model_index)
            desc = _plain(leaf)
            if i is not None:
                desc["holders"] = min(4 * i // params, 3)
                desc.pop("owner", None)
                sharded_any = True
            out.append(desc)
            continue
        shard = shape is not None and (
            (layout == "hsdp" and len(shape) >= 1 and shape[0] >= 8)
            or (layout == "tp" and len(shape) >= 2 and shape[0] >= 8)
            or (layout == "ep" and len(shape) == 3 and shape[0] >= 8)
        )
        if not shard or shape is None:
            out.append(_plain(leaf))
            continue
        sharded_any = True
        out += _shards(leaf, shape, parts, lambda s: s)
    return deeppart.Manifest.from_leaves(out, groups=groups) if sharded_any else None


def tp_ep_dp(m: deeppart.Manifest, world: int, tp: int = 8, ep: int = 16) -> deeppart.Manifest:
    """The at-scale layout (module docstring); ``world`` a multiple of ``tp * ep``."""
    assert world % (tp * ep) == 0, (world, tp, ep)
    tp_groups = [list(range(t, world, tp)) for t in range(tp)]
    ep_groups = [
        [r for r in range(world) if r % tp == t and (r // tp) % ep == e]
        for e in range(ep)
        for t in range(tp)
    ]
    groups = tp_groups + ep_groups
    out: list[dict[str, Any]] = []
    for leaf in m.leaves():
        shape = list(leaf["shape"]) if leaf["kind"] == "tensor" else None
        if shape is not None and len(shape) == 3 and shape[0] >= ep:
            for e in range(ep):
                experts = _row_shard(shape, e, ep)
                if experts is not None:
                    out += _shards(leaf, experts, tp, functools.partial(_ep_group, tp, e), (e,), 1)
        elif shape is not None and len(shape) >= 2 and shape[0] >= tp:
            out += _shards(leaf, shape, tp, lambda t: t)
        else:
            out.append(_plain(leaf))
    return deeppart.Manifest.from_leaves(out, groups=groups)
