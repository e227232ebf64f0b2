"""One rank of the DTensor-through-the-levels tests
(tests/levels/test_dtensor_levels.py, issue 48), under ``python -m
torch.distributed.run --nproc-per-node N --standalone`` (gloo, CPU), on
real FSDP2 ``fully_shard``, HSDP, FSDP2 over TP and PP(2) x FSDP2(2)
state (tests/state/dtensor_worker.py, tests/state/own_state_worker.py),
saved through the built-in multi-level engine with fake nodes
(``local_test = 1``, 2 ranks a node, groups of 2 nodes):

    python tests/levels/dtensor_levels_worker.py four DIR   # 4 ranks
    python tests/levels/dtensor_levels_worker.py two DIR    # 2 ranks, after four

``four``: each layout saved at L1, L2, L3, L4 (FSDP2; the others at the
levels named in ``LEVELS``) and loaded back into a fresh model of the same
layout from a fresh backend: every rank's local shards and optimizer
state bitwise what it saved; then a node's files deleted (L2, L3: node 1;
L4: every node) and loaded again, each lost rank served by the level the
report names. A flipped byte in a rank's L1 file of an L2 step: served by
the partner copy; an L1 step that lost a node: ``load(step)`` names the
lost ranks, ``load()`` falls back to the older step with a warning. PP x
FSDP2: each stage its own tree, restored after its node is lost (L3).

``two``: the 4-rank job's FSDP2 steps loaded on 2 ranks (one a fake node)
into FSDP2 over 2 ranks, resharded from the node-local files (the recovery
from peers, :mod:`deeppart.levels.peers`) through the engine and
``Checkpointer(config=)``, bitwise against the full tensors; after node 1
is gone, the L4 step serves its ranks from the global copy, an L1 step is
refused naming the lost old ranks, and ``load()`` skips the L1 steps with
a warning for the L2 step; the PP x FSDP2 L4 step through
``Checkpointer(config=).load(per_rank=...)``.

Each rank prints ``OK <job> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import shutil
import sys
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))

from dtensor_worker import equal, ok, to_full
from levels_worker import flip_byte
from own_state_worker import clone, pp_mesh, pp_state, rng_bytes, same

import deeppart
from bench.dtensor import build, sharded_state
from deeppart.errors import PerRankStateError, UnrecoverableError
from deeppart.format import data_file_name
from deeppart.levels import LevelConfig
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels.layout import step_name

#: The levels each layout is saved at (each then loses a node, L4 all).
LEVELS = {"fsdp": (1, 2, 3, 4), "hsdp": (2,), "tpfsdp": (3,)}


def config(d: Path, name: str, node_size: int = 2) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(d / "local"),
            "meta_dir": str(d / "meta"),
            "glbl_dir": str(d / "global"),
            "node_size": node_size,
            "group_size": 2,
            "ckpt_l1": 1,
            "local_test": 1,
            "exec_id": name,
            "keep": 10,
        }
    )


def backend(d: Path, name: str, node_size: int = 2) -> BuiltinBackend:
    # Small stripes: L3 codes several stripes.
    return BuiltinBackend(config(d, name, node_size), stripe_bytes=4096)


def on_root(fn: Any) -> None:
    """``fn`` (the damage) on rank 0 only, between barriers."""
    dist.barrier()
    if dist.get_rank() == 0:
        fn()
    dist.barrier()


def node_dir(d: Path, name: str, node: int) -> Path:
    return d / "local" / f"node{node}" / name


def lose_nodes(d: Path, name: str, *nodes: int) -> None:
    def lose() -> None:
        for k in nodes:
            shutil.rmtree(node_dir(d, name, k), ignore_errors=True)

    on_root(lose)


def expect_error(fn: Callable[[], Any], cls: type[Exception], *parts: str) -> None:
    """``fn()`` raises ``cls`` whose message holds every one of ``parts``."""
    try:
        fn()
    except cls as e:
        assert all(p in str(e) for p in parts), (parts, e)
    else:
        raise AssertionError(f"no {cls.__name__} ({parts})")


def check_load(d: Path, layout: str, step: int, saved: Any, ref: Any, levels: list[int]) -> None:
    """``step`` loaded from a fresh backend into a fresh ``layout`` model:
    every rank's shards bitwise ``saved``, the full tensors ``ref``, served
    at ``levels``."""
    m, opt = build(layout, seed=7)
    target = sharded_state(m, opt)
    out, report = backend(d, layout).load(step, into=target)
    assert report.step == step and report.levels == levels, (layout, step, report)
    same(out, saved, f"{layout} step {step}")
    assert out["model"]["0.weight"] is target["model"]["0.weight"], "into= not filled"
    equal(to_full(out), ref, f"{layout} step {step} (full)")


def scenario_layouts(d: Path) -> None:
    for layout, levels in LEVELS.items():
        m, opt = build(layout, seed=1)
        state = sharded_state(m, opt)
        saved, ref = clone(state), to_full(state)
        if layout == "fsdp":
            deeppart.save(ref, d / "fsdp-ref")  # for the 2-rank job
        be = backend(d, layout)
        for lv in levels:
            step = lv
            be.save(step, state, level=lv)
            check_load(d, layout, step, saved, ref, [1] * 4)
            if lv == 1:
                continue  # a lost node is fatal to an L1 step: step 6 below
            lost = list(range(2)) if lv == 4 else [1]
            lose_nodes(d, layout, *lost)
            want = [4] * 4 if lv == 4 else [1, 1, lv, lv]
            check_load(d, layout, step, saved, ref, want)
        if layout == "fsdp":
            fsdp_failures(d, be, state, saved, ref)


def fsdp_failures(d: Path, be: BuiltinBackend, state: Any, saved: Any, ref: Any) -> None:
    """After FSDP2's steps 1-4: without ``into=``; a corrupt L1 file; an
    L1 step that lost a node; then a newer L1 step for the 2-rank job."""
    layout = "fsdp"
    # No into=: full tensors, as deeppart.load gives them (step 4's L1
    # files, which its recovery from L4 rewrote).
    out, report = backend(d, layout).load(4)
    assert report.levels == [1] * 4, report
    equal(out, ref, "fsdp without into=")
    # A flipped byte in rank 1's L1 file of the L2 step: its partner's copy.
    be.save(5, state, level=2)
    on_root(lambda: flip_byte(node_dir(d, layout, 0) / step_name(5) / data_file_name(1)))
    check_load(d, layout, 5, saved, ref, [1, 2, 1, 1])
    # An L1 step whose node 1 is lost: load(6) names the lost ranks;
    # load() falls back to step 5, with a warning naming step 6.
    be.save(6, state, level=1)
    lose_nodes(d, layout, 1)
    expect_error(lambda: backend(d, layout).load(6), UnrecoverableError, "rank(s) [2, 3]", "step 6")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m2, opt2 = build(layout, seed=7)
        out, report = backend(d, layout).load(into=sharded_state(m2, opt2))
    assert report.step == 5 and report.skipped[0].startswith("step 6: "), report
    same(out, saved, "fsdp fallback to step 5")
    text = " ".join(str(w.message) for w in caught)
    assert "step 6" in text and "step 5" in text, (dist.get_rank(), text)
    # A newer L1 step, which the 2-rank job cannot load.
    be.save(7, state, level=1)


def scenario_pp(d: Path) -> None:
    """PP(2) x FSDP2(2): each stage its own tree (its own FQNs, per-rank
    loader position and RNG state), saved at L3, node 1 (stage 1) lost:
    each rank its own state back bitwise."""
    rank = dist.get_rank()
    mesh = pp_mesh(2, 2)
    state, _ = pp_state(mesh, 10, {"epoch": 3, "batches_seen": 100 + rank}, rng_bytes(rank))
    expected = clone(state)
    # Each stage's full model, for the 2-rank job.
    deeppart.save({"model": to_full(state["model"])}, d / "pp-ref")
    be = backend(d, "pp")
    be.save(1, state, level=3)
    be.save(2, state, level=4)
    for levels in ([1] * 4, [1, 1, 3, 3]):
        target, _ = pp_state(pp_mesh(2, 2), 70, {"epoch": 0, "batches_seen": -1}, rng_bytes(50))
        out, report = backend(d, "pp").load(1, into=target)
        assert report.levels == levels, report
        same(out, expected, f"pp {levels}")
        lose_nodes(d, "pp", 1)


def scenario_two(d: Path) -> None:
    """2 ranks (one a fake node): the 4-rank job's steps, resharded."""
    from deeppart.checkpointer import Checkpointer

    ref = deeppart.load(d / "fsdp-ref")

    def into() -> Any:
        m, opt = build("fsdp", seed=7)
        return sharded_state(m, opt)

    # Step 4 (L4): old node 0's files are seen by new node 0 (L1); old
    # node 1's were lost with step 6 (the global copy serves its ranks);
    # resharded onto 2 ranks.
    for how in ("engine", "checkpointer"):
        target = into()
        if how == "engine":
            out, report = backend(d, "fsdp", node_size=1).load(4, into=target)
        else:
            ck = Checkpointer(d / "unused", config=config(d, "fsdp", node_size=1))
            out = ck.load(4, into=target)
            assert ck.last_recovery is not None
            report = ck.last_recovery
        assert report.levels == [1, 1, 4, 4] and report.world_size == 2, report
        assert out["model"]["0.weight"] is target["model"]["0.weight"]
        equal(to_full(out), ref, f"fsdp 4 -> 2 ranks ({how})")
    # Step 7 (L1), saved after: every file seen by one of the new nodes.
    be = backend(d, "fsdp", node_size=1)
    out, report = be.load(7, into=into())
    assert report.levels == [1] * 4, report
    equal(to_full(out), ref, "fsdp L1 step 7 at 2 ranks")
    # Node 1 (old ranks 2 and 3) gone again: step 7 refused naming them;
    # load() skips steps 7 and 6 (L1: lost), naming them, for step 5
    # (L2), whose partner copies of ranks 2 and 3 are on node 0.
    lose_nodes(d, "fsdp", 1)
    expect_error(
        lambda: be.load(7), UnrecoverableError, "step 7: written by 4 ranks", "old rank(s) [2, 3]"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, report = be.load(into=into())
    assert report.step == 5 and report.levels == [1, 1, 2, 2], report
    equal(to_full(out), ref, "fsdp load() at 2 ranks")
    text = " ".join(str(w.message) for w in caught)
    assert "step 7" in text and "step 6" in text and "step 5" in text, text
    # PP x FSDP2's L4 step on 2 ranks: versioned paths (loader, rng) need
    # per_rank=; with per_rank="drop" every stage's model, full.
    ck = Checkpointer(d / "unused", config=config(d, "pp", node_size=1))
    expect_error(lambda: ck.load(2), PerRankStateError, "loader")
    out = ck.load(2, per_rank="drop")
    assert "loader" not in out and "rng" not in out, sorted(out)
    equal(out["model"], deeppart.load(d / "pp-ref")["model"], "pp 4 -> 2 ranks")


def main() -> None:
    job, d = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        if job == "four":
            assert dist.get_world_size() == 4
            scenario_layouts(d)
            scenario_pp(d)
        elif job == "two":
            assert dist.get_world_size() == 2
            scenario_two(d)
        else:
            raise SystemExit(f"unknown job {job}")
        ok(job)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
