"""Real-FTI scenarios, run by tests/test_fti.py as
``mpiexec -n 4 python tests/fti_worker.py SCENARIO ROOT LEVEL``.

``save``: a first job checkpoints a model + AdamW state at LEVEL through
:class:`deeppart.levels.fti.FTIBackend`, restores it in the same job, and
ends without ``FTI_Finalize`` (as a crash would), so its checkpoint stays.
``restore``: a second job with the same config restarts: FTI_Init finds the
checkpoint (rebuilding lost files), and the state comes back bitwise on
every rank.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi_checkpoint import assert_bitwise_equal, make_state

from deeppart.levels import fti
from deeppart.levels.config import LevelConfig
from deeppart.levels.fti import FTIBackend

STEP = 7

# Pieces of at least 256 KiB (not 4 MiB) are protected straight from tensor
# memory, so this small state exercises both zero-copy and packed datasets.
fti.ZERO_COPY_MIN = 256 << 10


def config(root: Path) -> LevelConfig:
    """4 ranks as 2 fake nodes of 2 (local_test), groups of 2 nodes."""
    return LevelConfig(
        ckpt_dir=str(root / "local"),
        glbl_dir=str(root / "global"),
        meta_dir=str(root / "meta"),
        node_size=2,
        group_size=2,
        ckpt_l1=1,
        local_test=1,
    )


def state() -> dict[str, Any]:
    s = make_state(seed=3)
    # Its pieces (over 256 KiB on every rank) are protected from tensor memory.
    s["big"] = torch.arange(1_200_000, dtype=torch.float32)
    return s


def ok(name: str, backend: FTIBackend) -> None:
    print(f"OK {name} rank {backend.comm.rank}/{backend.comm.size}", flush=True)


def scenario_save(root: Path, level: int) -> None:
    backend = FTIBackend(config(root))
    assert backend.status == 0, f"fresh job, FTI_Status() = {backend.status}"
    assert backend.latest() is None
    s = state()
    stats = backend.save(STEP, s, level=level)
    assert stats.level == level and stats.raw_bytes > 0
    assert backend.latest() == STEP
    # Restore in the same job (FTI_Recover online).
    out, report = backend.load()
    assert report.step == STEP and report.levels == [level] * backend.comm.size
    assert_bitwise_equal(s, out)
    backend.close(finalize=False)  # a crash: FTI keeps the checkpoint
    ok("save", backend)


def scenario_restore(root: Path, level: int) -> None:
    backend = FTIBackend(config(root))
    assert backend.status in (1, 2), f"restart, FTI_Status() = {backend.status}"
    assert backend.latest() == STEP
    out, report = backend.load()
    assert report.step == STEP, report
    assert_bitwise_equal(state(), out)
    # into=: in place, the same tensor objects.
    into = make_state(seed=4)
    into["big"] = torch.zeros(1_200_000, dtype=torch.float32)
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    res, _ = backend.load(into=into)
    for k, ptr in ptrs.items():
        assert res["model"][k] is into["model"][k] and res["model"][k].data_ptr() == ptr, k
    assert_bitwise_equal(state(), res)
    backend.close()
    ok("restore", backend)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=["save", "restore"])
    p.add_argument("root", type=Path)
    p.add_argument("level", type=int)
    a = p.parse_args()
    if a.scenario == "save":
        scenario_save(a.root, a.level)
    else:
        scenario_restore(a.root, a.level)


if __name__ == "__main__":
    main()
