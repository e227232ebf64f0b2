"""One rank of the holder-group tests (tests/loading/test_groups.py), under
``python -m torch.distributed.run --nproc-per-node N --standalone`` (gloo,
CPU), or alone as one process without a process group:

    python tests/loading/groups_worker.py SCENARIO DIR [DIMS]

Two data-parallel groups in one job: model A (an MLP + AdamW after one step)
on ranks {0,1}, model B (another seed) on {2,3}; and TP x DP with plain
tensors (``to_local()`` shards of ``parallelize_module``). Scenarios:

- ``save`` (4 ranks): ``deeppart.save`` with ``group="auto"`` (A under
  ``net0``, B under ``net1``), with ``group=<dp ProcessGroup>`` (both under
  the same keys), the TP x DP ``to_local()`` shards with ``group=`` the dp
  group, and ``dcp.save`` with ``BalancedSavePlanner`` and with the default
  planner; each loaded back at the same layout, bitwise; prints each
  checkpoint's slowest rank over the ideal (``BALANCE name ratio``);
  ``async_save`` with ``group=``, the state changed right after the call;
  the refusals (no ``group=``; ``group="auto"`` over equal paths that differ),
  nothing committed;
- ``load2`` (2 ranks): rank 0 loads A's state, rank 1 B's, bitwise;
- ``load1`` (one process): without a target, everything; ``into=`` one
  group's state; a key not in the checkpoint fails clearly.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))  # dtensor_worker

from dtensor_worker import equal, ok  # the DTensor tests' bitwise comparison and report
from rank_output import print_line

import deeppart
from bench.dtensor import build, dcp_balance, deeppart_balance, group_state
from deeppart.integrations.dcp import BalancedSavePlanner


def flat(g: int, dims: tuple[int, int, int]) -> dict[str, torch.Tensor]:
    """Model ``g``'s parameters and AdamW moments under keys of their own
    (DCP's flat form)."""
    st = group_state(g, dims)
    out = {f"net{g}.{k}": v for k, v in st["model"].items()}
    for (name, _), i in zip(
        st["model"].items(), st["optim"]["param_groups"][0]["params"], strict=True
    ):
        for k, v in st["optim"]["state"][i].items():
            out[f"net{g}.optim.{name}.{k}"] = v
    return out


def zeros(tree: Any) -> Any:
    """``tree`` with every tensor replaced by zeros of its kind."""
    return tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, tree)


def report(name: str, ratio: float) -> None:
    """Rank 0 prints a checkpoint's slowest rank over the ideal."""
    if dist.get_rank() == 0:
        print_line(f"BALANCE {name} {ratio:.4f}")


def refused(fn: Any, cls: type[Exception], *words: str) -> None:
    try:
        fn()
    except cls as e:
        assert all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError(f"no {cls.__name__}")


def local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard (a plain tensor)."""
    from torch.distributed.tensor import DTensor

    return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, tree)


def scenario_save(d: Path, dims: tuple[int, int, int]) -> None:
    rank = dist.get_rank()
    g = rank // 2
    pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = group_state(g, dims)

    # Without group= (issue 32): the checkpoint is the union of the groups'
    # trees, and each rank loads its own group's tree back.
    deeppart.save({f"net{g}": mine}, d / "none")
    equal({f"net{g}": mine}, deeppart.load(d / "none"))
    # group="auto" over the same paths (equal shapes, different values):
    # compared whole, stored as two versions, each group restores its own.
    deeppart.save(mine, d / "same", group="auto")
    equal(mine, deeppart.load(d / "same", into=zeros(mine)))
    # group= on some ranks only: every rank refuses (no rank hangs).
    refused(
        lambda: deeppart.save(mine, d / "some", group=pgs[g] if g else None),
        deeppart.StateMismatchError,
        "group=",
    )
    assert not (d / "some").exists()
    assert not any(p.name.startswith(".tmp-") for p in d.iterdir())

    deeppart.save({f"net{g}": mine}, d / "auto", group="auto")
    report("auto", deeppart_balance(d / "auto"))
    back = deeppart.load(d / "auto", into={f"net{g}": zeros(mine)}, group="auto")
    equal({f"net{g}": mine}, back)

    deeppart.save(mine, d / "explicit", group=pgs[g])
    report("explicit", deeppart_balance(d / "explicit"))
    target = zeros(mine)
    back = deeppart.load(d / "explicit", into=target, group=pgs[g])
    equal(mine, back)
    equal(mine, target)  # filled in place

    # TP x DP with plain tensors: to_local() shards, replicated over dp.
    m, opt = build("tp", seed=1, dims=dims)
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    shards = local({"model": msd, "optim": osd})
    dp = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]  # (dp, tp) mesh
    deeppart.save(shards, d / "tp", group=dp)
    report("tp", deeppart_balance(d / "tp"))
    equal(shards, deeppart.load(d / "tp", into=zeros(shards), group=dp))

    # DCP: each group's parameters under their own keys.
    for name, planner in (("dcp-balanced", BalancedSavePlanner()), ("dcp-default", None)):
        dcp_save(flat(g, dims), checkpoint_id=str(d / name), planner=planner)
        report(name, dcp_balance(d / name, 4))
        target = zeros(flat(g, dims))
        dcp_load(target, checkpoint_id=str(d / name))
        equal(flat(g, dims), target)

    # async_save with group=: each group's share is snapshotted at the call;
    # the state changed right after it does not reach the checkpoint.
    live = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, mine)
    pending = deeppart.async_save(live, d / "async", group=pgs[g])
    tree_map(lambda t: t.add_(1) if isinstance(t, torch.Tensor) else t, live)
    pending.wait()
    report("async", deeppart_balance(d / "async"))
    equal(mine, deeppart.load(d / "async", into=zeros(mine), group=pgs[g]))
    ok("save")


def scenario_load2(d: Path, dims: tuple[int, int, int]) -> None:
    g = dist.get_rank()  # rank 0 loads A's state, rank 1 B's
    mine = group_state(g, dims)
    back = deeppart.load(d / "auto", into={f"net{g}": zeros(mine)}, group="auto")
    equal({f"net{g}": mine}, back)
    # exchange="bcast": the ranks select different leaves, so each reads its own.
    back = deeppart.load(
        d / "explicit",
        into=zeros(mine),
        group=[2 * g, 2 * g + 1],
        loading=deeppart.LoadOptions(exchange="bcast"),
    )
    equal(mine, back)
    target = zeros(flat(g, dims))
    dcp_load(target, checkpoint_id=str(d / "dcp-balanced"))
    equal(flat(g, dims), target)
    ok("load2")


def scenario_load1(d: Path, dims: tuple[int, int, int]) -> None:
    a, b = group_state(0, dims), group_state(1, dims)
    equal({"net0": a, "net1": b}, deeppart.load(d / "auto"))
    equal({"ranks:0,1": a, "ranks:2,3": b}, deeppart.load(d / "explicit"))
    equal(b, deeppart.load(d / "explicit", group=[2, 3]))
    equal({"net1": b}, deeppart.load(d / "auto", into={"net1": zeros(b)}, group="auto"))
    refused(
        lambda: deeppart.load(d / "auto", into={"net2": zeros(b)}, group="auto"),
        deeppart.StateMismatchError,
        "net2",
    )
    target = {**zeros(flat(0, dims)), **zeros(flat(1, dims))}
    dcp_load(target, checkpoint_id=str(d / "dcp-balanced"), no_dist=True)
    equal({**flat(0, dims), **flat(1, dims)}, target)
    ok("load1")


def main() -> None:
    scenario, d, *rest = sys.argv[1:]
    dims = tuple(int(x) for x in rest[0].split(",")) if rest else (5, 30, 7)
    assert len(dims) == 3
    if scenario != "load1":
        dist.init_process_group("gloo")
    try:
        {"save": scenario_save, "load2": scenario_load2, "load1": scenario_load1}[scenario](
            Path(d), dims
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
