"""Multi-rank cases of tests/storage/test_ownership.py, run as
``mpiexec -n 2 python tests/storage/ownership_worker.py SCENARIO DIR``.

Every rank works in its own directory ``DIR/rank<r>`` (its working
directory, and a relative target), as ranks on node-local storage each see
their own file system; only one rank finds the user's file there. Every
rank must raise :class:`ForeignPathError`, and every rank's directory must
be unchanged afterwards. Prints ``OK SCENARIO rank r/n``.

- ``save-rank0`` / ``save-rank1``: :func:`deeppart.save` to ``ckpt``, whose
  copy on rank 0 (or 1) holds ``notes.txt``.
- ``levels``: the built-in multi-level engine (2 fake nodes), whose node 0
  local step directory holds the user's file.
- ``prune``: :class:`deeppart.Checkpointer` with a foreign ``step-7`` in a
  shared root: it stays through ``keep_last`` pruning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from rank_output import print_line
from test_ownership import snapshot

import deeppart
from deeppart.comm import resolve
from deeppart.errors import ForeignPathError
from deeppart.format import step_dir_name
from deeppart.levels import LevelConfig
from deeppart.levels.engine import BuiltinBackend

STATE = {"w": np.arange(300_000, dtype=np.float32), "step": 100, "opt": {"lr": 0.001}}


def expect_refusal(fn: object, what: str) -> None:
    try:
        fn()  # type: ignore[operator]
    except ForeignPathError as e:
        assert what in str(e), e
        return
    raise AssertionError("the save was not refused")


def save_case(root: Path, rank: int, seer: int) -> None:
    comm = resolve()
    mine = root / f"rank{rank}"
    (mine / "ckpt").mkdir(parents=True)
    if rank == seer:
        (mine / "ckpt" / "notes.txt").write_text("the user's")
    comm.barrier()
    before = snapshot(mine)
    os.chdir(mine)
    expect_refusal(lambda: deeppart.save(STATE, "ckpt", comm=comm), "notes.txt")
    comm.barrier()
    assert snapshot(mine) == before, (sorted(before), sorted(snapshot(mine)))


def levels_case(root: Path, rank: int) -> None:
    comm = resolve()
    cfg = LevelConfig.from_dict(
        {
            "ckpt_dir": str(root / "local"),
            "meta_dir": str(root / "meta"),
            "glbl_dir": str(root / "global"),
            "node_size": 1,
            "group_size": 2,
            "ckpt_l1": 1,
            "local_test": 1,
            "exec_id": "run",
        }
    )
    backend = BuiltinBackend(cfg, comm)
    node0 = cfg.local_root(0) / step_dir_name(1)
    if rank == 0:
        node0.mkdir(parents=True)
        (node0 / "scratch.dat").write_bytes(b"\x07" * 10)
    comm.barrier()
    before = snapshot(root)
    expect_refusal(lambda: backend.save(1, STATE, level=1), "scratch.dat")
    comm.barrier()
    assert snapshot(root) == before, (sorted(before), sorted(snapshot(root)))
    assert backend.latest() is None
    backend.close()


def prune_case(root: Path, rank: int) -> None:
    comm = resolve()
    ck_root = root / "shared"
    foreign = ck_root / step_dir_name(7)
    if rank == 0:
        foreign.mkdir(parents=True)
        (foreign / "notes.txt").write_text("not a checkpoint")
    comm.barrier()
    ck = deeppart.Checkpointer(ck_root, comm=comm, keep_last=1)
    for step in (8, 9):
        ck.save(step, STATE)
    comm.barrier()
    assert (foreign / "notes.txt").read_text() == "not a checkpoint"
    assert sorted(p.name for p in ck_root.iterdir()) == [step_dir_name(7), step_dir_name(9)]
    assert ck.steps() == [9]


def main() -> None:
    scenario, root = sys.argv[1], Path(sys.argv[2])
    comm = resolve()
    if scenario.startswith("save-rank"):
        save_case(root, comm.rank, int(scenario[-1]))
    elif scenario == "levels":
        levels_case(root, comm.rank)
    elif scenario == "prune":
        prune_case(root, comm.rank)
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    print_line(f"OK {scenario} rank {comm.rank}/{comm.size}")


if __name__ == "__main__":
    main()
