"""Real-FTI scenarios, run by tests/levels/test_fti.py as
``mpiexec -n N python tests/levels/fti_worker.py SCENARIO ROOT LEVEL GROUP_SIZE``
(fake nodes of 2 ranks, ``local_test = 1``; groups of GROUP_SIZE nodes).

``save``: a first job checkpoints a model + AdamW state, with each
rank's own loader position and RNG state beside it (issue 48), at LEVEL through
:class:`deeppart.levels.fti.FTIBackend`, restores it in the same job, and
ends without ``FTI_Finalize`` (as a crash would), so its checkpoint stays.
It prints the plan's pieces per rank (``PLAN [..]``).
``restore``: a second, separate job with the same config restarts: FTI_Init
finds the checkpoint (rebuilding lost files), and the state comes back
bitwise on every rank, each rank's own values to it.
``broken``: the last rank protects one FTI dataset more than the others
before the save: the save must fail on every rank with the backend's
clear error, before FTI_Checkpoint, and leave no index behind.
``nothing``: a later job finds no checkpoint to restore, and ``load`` says so.
``odd-save`` / ``odd-restore``: :func:`odd_state`, whose pieces make every
rank's data an odd number of bytes, saved and restored bitwise (FTI's L3
rebuilds a lost node's files on 16-bit words: the backend pads each rank's
file to a multiple of ``FILE_ALIGN`` bytes). ``odd-save-old`` writes it as
before that padding (``FILE_ALIGN = 1``, an index without ``header_bytes``)
so that each rank's FTI file has an odd size; ``odd-restore-old`` restores
such a checkpoint bitwise; ``odd-restore-wrong`` expects the restore to fail
on every rank with the checksum error (after L3 rebuilt a file with its last
byte wrong), and ends without ``FTI_Finalize``.
``fsdp-save``: FSDP2 state (``fully_shard`` over the 4 ranks, torch.distributed
on gloo beside MPI; DTensors) saved at each level 1-4 and restored in the
same job, into DTensors of another model of that layout (local shards
bitwise) and without ``into=`` (whole tensors, bitwise against
``full_tensor()``); then saved at LEVEL and left without ``FTI_Finalize``.
``fsdp-restore``: a new job restores that checkpoint the same two ways.
``fsdp-other``: a job of another world size fails on every rank with the
error naming what FTI cannot do (reshard) and what serves it.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from mpi_checkpoint import assert_bitwise_equal, make_state
from rank_output import print_line

from deeppart.errors import CheckpointError, CorruptCheckpointError, FTIError
from deeppart.levels import fti
from deeppart.levels.config import LevelConfig
from deeppart.levels.fti import FTIBackend

STEP = 7
#: The id of the dataset the broken scenarios protect on one rank only.
EXTRA_ID = 999

# Pieces of at least 256 KiB (not 4 MiB) are protected straight from tensor
# memory, so this small state exercises both zero-copy and packed datasets.
fti.ZERO_COPY_MIN = 256 << 10


def config(root: Path, group_size: int) -> LevelConfig:
    """Fake nodes of 2 ranks (local_test), groups of ``group_size`` nodes."""
    return LevelConfig(
        ckpt_dir=str(root / "local"),
        glbl_dir=str(root / "global"),
        meta_dir=str(root / "meta"),
        node_size=2,
        group_size=group_size,
        ckpt_l1=1,
        local_test=1,
    )


def state(rank: int) -> dict[str, Any]:
    s = make_state(seed=3)
    # Its pieces (over 256 KiB) are protected from tensor memory. On 8
    # ranks the plan leaves the last ranks without any piece.
    s["big"] = torch.arange(1_200_000, dtype=torch.float32)
    # Each rank's own loader position and RNG state (issue 48), alike on
    # ranks r and r + 4: on 8 ranks each version has two holders, one of
    # which writes it, and the plan still leaves ranks without any piece.
    s["loader_pos"] = 100 + rank % 4
    s["rng"] = torch.Generator().manual_seed(1000 + rank % 4).get_state()
    return s


#: Bytes of each of :func:`odd_state`'s tensors: the plan gives one to each
#: of 4 ranks (odd, over 256 KiB: protected from tensor memory; FTI's L3
#: encodes in blocks of 1 MiB, the last one partial).
ODD_BYTES = 1_000_001


def odd_state() -> dict[str, Any]:
    """Four uint8 tensors of :data:`ODD_BYTES` random bytes, alike on every
    rank (one dataset per rank, no placeholders)."""
    gen = torch.Generator().manual_seed(11)
    return {
        k: torch.randint(0, 256, (ODD_BYTES,), dtype=torch.uint8, generator=gen) for k in "abcd"
    }


def scenario_odd_save(backend: FTIBackend, level: int, old: bool) -> None:
    c = backend.comm
    backend.save(STEP, odd_state(), level=level)
    index = backend.config.meta_root() / f"fti-step-{STEP:08d}.json"
    meta = json.loads(index.read_bytes())
    pieces = [sum(p[5] for p in meta["pieces"] if p[3] == r) for r in range(c.size)]
    if c.rank == 0:
        print_line(f"PIECE BYTES {pieces} HEADER {meta['fti'].get('header_bytes')}")
    if old and c.rank == 0:
        # The index as the backend wrote it before FILE_ALIGN.
        assert meta["fti"].pop("header_bytes") == [64] * c.size
        index.write_text(json.dumps(meta, separators=(",", ":")))
    c.barrier()
    backend.close(finalize=False)  # a crash: FTI keeps the checkpoint


def scenario_odd_restore(backend: FTIBackend, wrong: bool) -> None:
    c = backend.comm
    assert backend.status == 1, f"restart, FTI_Status() = {backend.status}"
    try:
        out, report = backend.load()
    except CorruptCheckpointError as e:
        if not wrong:
            raise
        print_line(f"rank {c.rank} ERROR {e}")
        backend.close(finalize=False)
        return
    assert not wrong, "the restore of a file L3 rebuilt wrong succeeded"
    assert report.step == STEP and report.levels == [3] * c.size, report
    assert_bitwise_equal(odd_state(), out)
    backend.close(finalize=False)


#: The FSDP2 scenarios' model: bench/dtensor.py's MLP, uneven shards.
FSDP_SEED = 1


def init_torch_distributed() -> None:
    """torch.distributed on gloo over the MPI job's ranks (rank 0 picks the
    port and tells the others through MPI)."""
    import os
    import socket

    import torch.distributed as dist
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    port = 0
    if comm.Get_rank() == 0:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    port = comm.bcast(port, root=0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=comm.Get_rank(), world_size=comm.Get_size())


def fsdp_state(seed: int) -> dict[str, Any]:
    """FSDP2 model + AdamW state after one step (get_state_dict: DTensors),
    with a plain value beside it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench.dtensor import build, sharded_state

    m, opt = build("fsdp", seed)
    return {**sharded_state(m, opt), "epoch": 3}


def as_local(tree: Any) -> Any:
    """``tree`` with each DTensor replaced by its local shard (what this rank
    holds; asserts there is at least one DTensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: as_local(v) for k, v in tree.items()}
    return tree


def as_full(tree: Any) -> Any:
    """``tree`` with each DTensor gathered whole (collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: as_full(v) for k, v in tree.items()}
    return tree


def check_fsdp(backend: FTIBackend, ref: dict[str, Any], level: int, step: int) -> None:
    """Restores into another FSDP2 state (local shards, in place) and without
    ``into=`` (whole tensors), both bitwise."""
    from torch.distributed.tensor import DTensor

    into = fsdp_state(FSDP_SEED + 1)
    w = into["model"]["0.weight"]
    assert isinstance(w, DTensor), type(w)
    ptr = w.to_local().data_ptr()
    assert not torch.equal(w.to_local(), ref["model"]["0.weight"].to_local())
    out, report = backend.load(into=into)
    assert report.step == step and report.levels == [level] * backend.comm.size, report
    assert out["model"]["0.weight"] is w and w.to_local().data_ptr() == ptr
    assert_bitwise_equal(as_local(ref), as_local(out), f"L{level} into=")
    whole, _ = backend.load()
    assert not isinstance(whole["model"]["0.weight"], DTensor)
    assert_bitwise_equal(as_full(ref), whole, f"L{level} whole")


def scenario_fsdp_save(backend: FTIBackend, level: int) -> None:
    ref = fsdp_state(FSDP_SEED)
    for lv in (1, 2, 3, 4):
        backend.save(lv, ref, level=lv)
        check_fsdp(backend, ref, lv, lv)
    backend.save(STEP, ref, level=level)
    check_fsdp(backend, ref, level, STEP)
    backend.close(finalize=False)


def scenario_fsdp_restore(backend: FTIBackend, level: int) -> None:
    assert backend.status == 1, f"restart, FTI_Status() = {backend.status}"
    check_fsdp(backend, fsdp_state(FSDP_SEED), level, STEP)
    backend.close(finalize=False)


def scenario_fsdp_other(backend: FTIBackend) -> None:
    c = backend.comm
    try:
        backend.load(into=fsdp_state(FSDP_SEED))
    except CheckpointError as e:
        print_line(f"rank {c.rank} ERROR {e}")
    else:
        raise AssertionError("a restart on another world size loaded")
    backend.close(finalize=False)


def ok(name: str, backend: FTIBackend) -> None:
    print_line(f"OK {name} rank {backend.comm.rank}/{backend.comm.size}")


def scenario_save(backend: FTIBackend, level: int) -> None:
    assert backend.status == 0, f"fresh job, FTI_Status() = {backend.status}"
    assert backend.latest() is None
    s = state(backend.comm.rank)
    stats = backend.save(STEP, s, level=level)
    assert stats.level == level and stats.raw_bytes > 0
    assert backend.latest() == STEP
    if backend.comm.rank == 0:
        index = sorted((backend.config.meta_root()).glob("fti-step-*.json"))
        meta = json.loads(index[-1].read_bytes())
        pieces = [sum(1 for p in meta["pieces"] if p[3] == r) for r in range(backend.comm.size)]
        print_line(f"PLAN {pieces} IDS {meta['fti']['ids']}")
    # Restore in the same job (FTI_Recover online).
    out, report = backend.load()
    assert report.step == STEP and report.levels == [level] * backend.comm.size
    assert_bitwise_equal(s, out)
    backend.close(finalize=False)  # a crash: FTI keeps the checkpoint


def scenario_restore(backend: FTIBackend, level: int) -> None:
    assert backend.status in (1, 2), f"restart, FTI_Status() = {backend.status}"
    r = backend.comm.rank
    if level in (1, 2, 3):
        # FTI_Init found or rebuilt this rank's node-local checkpoint file
        # (L2: from the partner copy, L3: Reed-Solomon).
        node = Path(backend.config.ckpt_dir) / f"node{r // backend.config.node_size}"
        assert list(node.rglob(f"Ckpt{STEP + 1}-Rank{r}.fti")), f"rank {r}: no file in {node}"
        print_line(f"LOCAL FILE rank {r}")
    assert backend.latest() == STEP
    out, report = backend.load()
    assert report.step == STEP and report.levels == [level] * backend.comm.size, report
    assert_bitwise_equal(state(r), out)
    # into=: in place, the same tensor objects.
    into = make_state(seed=4)
    into["big"] = torch.zeros(1_200_000, dtype=torch.float32)
    into["loader_pos"], into["rng"] = -1, torch.zeros_like(out["rng"])
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    res, _ = backend.load(into=into)
    for k, ptr in ptrs.items():
        assert res["model"][k] is into["model"][k] and res["model"][k].data_ptr() == ptr, k
    assert_bitwise_equal(state(r), res)
    backend.close()


def scenario_broken(backend: FTIBackend, level: int) -> None:
    c = backend.comm
    extra = np.zeros(16, dtype=np.uint8)
    if c.rank == c.size - 1:
        backend._protect(EXTRA_ID, extra)
    try:
        backend.save(STEP, state(c.rank), level=level)
    except FTIError as e:
        assert "ranks protect different FTI datasets" in str(e), e
        assert "FTI_Checkpoint(id 8) was not called" in str(e), e
        print_line(f"rank {c.rank} ERROR {e}")
    else:
        raise AssertionError(f"rank {c.rank}: the broken save succeeded")
    assert backend.latest() is None, "no checkpoint may claim to be readable"
    assert not list(backend.config.meta_root().glob("fti-step-*.json"))
    backend.close(finalize=False)  # a crash: whatever FTI has stays


def scenario_nothing(backend: FTIBackend) -> None:
    assert backend.latest() is None, backend.latest()
    try:
        backend.load()
    except CheckpointError as e:
        print_line(f"rank {backend.comm.rank} ERROR {e}")
    else:
        raise AssertionError("load() restored a checkpoint that was never committed")
    backend.close(finalize=False)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "scenario",
        choices=[
            "save",
            "restore",
            "broken",
            "nothing",
            "odd-save",
            "odd-save-old",
            "odd-restore",
            "odd-restore-old",
            "odd-restore-wrong",
            "fsdp-save",
            "fsdp-restore",
            "fsdp-other",
        ],
    )
    p.add_argument("root", type=Path)
    p.add_argument("level", type=int)
    p.add_argument("group_size", type=int)
    a = p.parse_args()
    if a.scenario == "odd-save-old":
        fti.FILE_ALIGN = 1  # the files as the backend wrote them before padding
    if a.scenario.startswith("fsdp"):
        init_torch_distributed()
    backend = FTIBackend(config(a.root, a.group_size))
    if a.scenario == "fsdp-save":
        scenario_fsdp_save(backend, a.level)
    elif a.scenario == "fsdp-other":
        scenario_fsdp_other(backend)
    elif a.scenario == "fsdp-restore":
        scenario_fsdp_restore(backend, a.level)
    elif a.scenario.startswith("odd-save"):
        scenario_odd_save(backend, a.level, old=a.scenario.endswith("-old"))
    elif a.scenario.startswith("odd-restore"):
        scenario_odd_restore(backend, wrong=a.scenario.endswith("-wrong"))
    elif a.scenario == "save":
        scenario_save(backend, a.level)
    elif a.scenario == "restore":
        scenario_restore(backend, a.level)
    elif a.scenario == "nothing":
        scenario_nothing(backend)
    else:
        scenario_broken(backend, a.level)
    ok(a.scenario, backend)
    if a.scenario.startswith("fsdp"):
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
