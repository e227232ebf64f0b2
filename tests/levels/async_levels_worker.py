"""One rank of the asynchronous level saves' tests
(tests/levels/test_async_levels.py, issue 48), under ``python -m
torch.distributed.run --nproc-per-node 2 --standalone`` (gloo, CPU), on
real FSDP2 ``fully_shard`` state with per-rank values (a loader position
100 + rank, a per-rank RNG state), through the built-in engine with the
memory tier on (``ckpt_dir`` on ``/dev/shm``, fake nodes: ``local_test =
1``, one rank a node, one group of 2 nodes):

    python tests/levels/async_levels_worker.py DIR SHM

- ``levels``: ``BuiltinBackend.save_async`` at L1, L2, L3 and L4, the live
  tensors overwritten and the loader position changed as soon as it
  returns (its writer held back until then): each step loads back
  bitwise what was saved, each rank its own loader position and RNG
  state; L2 and L3 again after node 1's files are lost (its partner copy,
  Reed-Solomon decoding: written by the writer threads).
- ``load_waits``: ``Checkpointer(config=..., async_=True)``: ``load()``
  while the save is in flight returns that step (it waited for it).
- ``failure``: rank 1's step directory replaced by a file on its writer
  thread: ``wait()`` raises on both ranks (and again), the previous step
  stays the latest and loads bitwise; a failed save nobody waited for is
  raised by the next save, on both ranks; then a save succeeds.
- ``budget``: a step over ``memory_budget`` refused by ``save_async`` on
  both ranks, nothing written.

Each rank prints ``OK async rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))

from dtensor_worker import ok
from own_state_worker import clone, rng_bytes, same

import deeppart
from bench.dtensor import build, sharded_state
from deeppart.checkpointer import Checkpointer
from deeppart.format import MARKER
from deeppart.levels import LevelConfig, LevelSaveStats, partner
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels.layout import step_name
from deeppart.saving.writer import WriteEvent, fault_hook


def config(d: Path, shm: Path, name: str, **extra: Any) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(shm),
            "meta_dir": str(d / "meta"),
            "glbl_dir": str(d / "global"),
            "node_size": 1,
            "group_size": 2,
            "ckpt_l1": 1,
            "ckpt_l2": 2,
            "local_test": 1,
            "exec_id": name,
            "keep": 4,
            "memory": 1,
            "memory_keep": 2,
            **extra,
        }
    )


def make_state(seed: int) -> dict[str, Any]:
    """FSDP2 model and optimizer state, and this rank's own loader
    position and RNG state."""
    rank = dist.get_rank()
    m, opt = build("fsdp", seed=seed)
    state = sharded_state(m, opt)
    state["loader"] = {"pos": 100 + rank}
    state["rng"] = torch.frombuffer(bytearray(rng_bytes(rank + seed)), dtype=torch.uint8)
    return state


def target() -> dict[str, Any]:
    """A state to load into: other values everywhere."""
    t = make_state(7)
    t["loader"] = {"pos": -1}
    t["rng"].zero_()
    return t


def tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor's local memory in ``tree`` (a DTensor's local shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return [tree.to_local()]
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors(v)]
    return []


def trample(state: dict[str, Any]) -> None:
    """The training loop's next steps: every live tensor changed in place,
    the loader moved on."""
    with torch.no_grad():
        for t in tensors(state):
            t.fill_(7) if t.dtype.is_floating_point else t.fill_(3)
    state["loader"]["pos"] = -5


class Gate:
    """Holds every data-file write (any thread) until :meth:`open`."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, event: WriteEvent) -> None:
        assert self.event.wait(60), "the gate was never opened"

    def open(self) -> None:
        self.event.set()


def expect_raise(
    fn: Any, cls: type[BaseException] | tuple[type[BaseException], ...], *parts: str
) -> BaseException:
    try:
        fn()
    except cls as e:
        assert all(p in str(e) for p in parts), (parts, str(e))
        return e
    raise AssertionError(f"no {cls} ({parts})")


def lose_node(shm: Path, name: str, node: int) -> None:
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(shm / f"node{node}" / name, ignore_errors=True)
    dist.barrier()


def scenario_levels(d: Path, shm: Path) -> None:
    rank = dist.get_rank()
    be = BuiltinBackend(config(d, shm, "levels", ckpt_l3=4), stripe_bytes=4096)
    for lv in (1, 2, 3, 4):
        state = make_state(lv)
        saved = clone(state)
        gate = Gate()
        with fault_hook("before-write", gate):
            handle = be.save_async(lv, state, level=lv)
            assert not handle.done(), handle  # its writer is held at its first write
            trample(state)
            gate.open()
            stats = handle.wait()
        assert isinstance(stats, LevelSaveStats) and stats.level == lv and stats.step == lv, stats
        assert handle.staged_bytes > 0 and handle.snapshot_seconds > 0, handle
        out, report = be.load(lv, into=target())
        assert report.levels == [1, 1], report
        same(out, saved, f"L{lv} async, state trampled after save_async returned")
        assert out["loader"]["pos"] == 100 + rank, out["loader"]
        if lv in (2, 3):
            # Node 1's memory lost: its partner copy (L2) or the parity
            # (L3) the writer threads wrote serves rank 1.
            lose_node(shm, "levels", 1)
            out, report = be.load(lv, into=target())
            assert report.levels == [1, lv], report
            same(out, saved, f"L{lv} async after node 1 was lost")
    # L4's global copy: a deeppart checkpoint of the snapshot's bytes.
    full = deeppart.load(d / "global" / "levels" / step_name(4))
    assert full["loader"]["pos"] == 100 + rank, full["loader"]
    assert torch.equal(full["model"]["0.weight"], make_full_weight(4)), "L4 copy"
    be.close()


def scenario_paced(d: Path, shm: Path) -> None:
    """A compressed asynchronous L2 save with its partner copy paced
    (``l2_rate``), on the writer thread's gloo communicator (the path of
    bench/recovery.py): the exchange in 1 KiB slices takes at least the
    file's size over the rate, and after node 1's memory is lost the paced
    copy serves rank 1 bitwise."""
    rate = 200_000
    partner.PACE_CHUNK = 1024
    be = BuiltinBackend(config(d, shm, "paced", l2_rate=rate), compression="shuffle-zstd")
    state = make_state(7)
    saved = clone(state)
    stats = be.save_async(7, state, level=2).wait()
    assert isinstance(stats, LevelSaveStats) and stats.level == 2, stats
    own = (
        shm / f"node{dist.get_rank()}" / "paced" / step_name(7) / f"rank-{dist.get_rank():05d}.bin"
    )
    size = own.stat().st_size
    assert size > 4 * partner.PACE_CHUNK, size
    assert stats.phases["l2"] >= size / rate, (stats.phases, size)
    lose_node(shm, "paced", 1)
    out, report = be.load(7, into=target())
    assert report.levels == [1, 2], report
    same(out, saved, "paced compressed L2 copy after node 1 was lost")
    be.close()


def make_full_weight(seed: int) -> torch.Tensor:
    weight: torch.Tensor = make_state(seed)["model"]["0.weight"].full_tensor()
    return weight


def scenario_load_waits(d: Path, shm: Path) -> None:
    rank = dist.get_rank()
    ck = Checkpointer(d / "unused", config=config(d, shm, "ckpt"), async_=True)
    first = make_state(1)
    ck.save(1, first).wait()
    state = make_state(2)
    saved = clone(state)
    gate = Gate()
    with fault_hook("before-write", gate):
        handle = ck.save(2, state)
        assert not handle.done(), handle
        trample(state)
        # The writer is let go only a while after load() is called: the load
        # must wait for the save in flight, and then find step 2.
        threading.Timer(0.3, gate.open).start()
        t0 = time.perf_counter()
        out = ck.load(into=target())
        waited = time.perf_counter() - t0
    assert handle.done() and waited >= 0.25, (handle, waited)
    assert ck.last_recovery is not None and ck.last_recovery.step == 2, ck.last_recovery
    same(out, saved, "load() while the save was in flight")
    assert out["loader"]["pos"] == 100 + rank
    assert ck.steps() == [1, 2], ck.steps()
    ck.close()


#: A failure on rank 1's writer: its own error there, the agreement's on rank 0.
FAILED = (NotADirectoryError, deeppart.CheckpointError)


def scenario_failure(d: Path, shm: Path) -> None:
    rank = dist.get_rank()
    ck = Checkpointer(d / "unused", config=config(d, shm, "fail"), async_=True)
    state = make_state(3)
    saved = clone(state)
    ck.save(1, state).wait()
    node_step = shm / "node1" / "fail" / step_name(2)

    def damage(event: WriteEvent) -> None:
        """Rank 1's writer thread: its step directory replaced by a file."""
        if rank == 1 and event.path.parent == node_step:
            shutil.rmtree(node_step)
            node_step.write_bytes(b"not a directory")

    with fault_hook("before-write", damage):
        handle = ck.save(2, make_state(4))
        # Rank 1's own error; rank 0 the same failure, naming rank 1.
        expect_raise(handle.wait, FAILED, "Not a directory", str(node_step))
        expect_raise(handle.wait, FAILED, "Not a directory")  # every time it is asked
    # Nothing of step 2 committed; step 1, the latest, loads bitwise.
    assert not (d / "meta" / "fail" / step_name(2) / MARKER).exists()
    assert ck.latest() == 1, ck.latest()
    out = ck.load(into=target())
    same(out, saved, "the step before the failed save")
    assert out["loader"]["pos"] == 100 + rank
    # Once more, nobody waiting: the next save raises it on every rank.
    dist.barrier()
    if rank == 1:
        node_step.unlink()
    dist.barrier()
    with fault_hook("before-write", damage):
        ck.save(2, make_state(4))
        expect_raise(lambda: ck.save(3, make_state(5)), FAILED, "Not a directory")
    dist.barrier()
    if rank == 1:
        node_step.unlink()
    dist.barrier()
    # The damage gone: the next save commits, and loads.
    state = make_state(6)
    saved = clone(state)
    ck.save(3, state)
    out = ck.load(into=target())
    assert ck.last_recovery is not None and ck.last_recovery.step == 3
    same(out, saved, "the save after the failures")
    ck.close()


def scenario_budget(d: Path, shm: Path) -> None:
    be = BuiltinBackend(config(d, shm, "tight", memory_budget="4K"))
    expect_raise(
        lambda: be.save_async(1, make_state(1)),
        deeppart.NoSpaceError,
        "step 1 does not fit node-local memory; nothing was written",
        "memory_budget = 4096, over by",
    )
    assert be.wait() is None  # nothing in flight
    assert not (shm / "node0" / "tight" / step_name(1)).exists()
    assert not (shm / "node1" / "tight" / step_name(1)).exists()
    assert not (d / "meta" / "tight" / step_name(1)).exists()
    assert be.latest() is None


def main() -> None:
    d, shm = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    try:
        assert dist.get_world_size() == 2
        scenario_levels(d, shm)
        scenario_load_waits(d, shm)
        scenario_failure(d, shm)
        scenario_budget(d, shm)
        scenario_paced(d, shm)
        ok("async")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
