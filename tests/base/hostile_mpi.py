"""Multi-rank hostile scenarios (run by tests/base/test_hostile.py under mpiexec).

``cleanup ROOT``: a Checkpointer save whose cleanup fails on rank 0 (its
removal of old checkpoints raises, as an undeletable file does): every rank
returns the save's Stats and warns, none raises.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from mpi4py import MPI

import deeppart
import deeppart.checkpointer as ck

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from rank_output import print_line


def scenario_cleanup(root: Path) -> None:
    comm = MPI.COMM_WORLD
    cp = deeppart.Checkpointer(root, comm=comm, keep_last=1)
    state = {"w": torch.arange(64, dtype=torch.float32), "step": 1}
    cp.save(1, state)

    def undeletable(path: Path, *args: object, **kwargs: object) -> list[str]:
        raise PermissionError(13, "Operation not permitted", str(path))

    setattr(ck, "remove_owned", undeletable)  # noqa: B010  (rank 0 is the one that removes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = cp.save(2, state).wait()
    assert isinstance(stats, deeppart.CheckpointStats) and stats.op == "save", stats
    messages = [str(w.message) for w in caught]
    assert messages, f"rank {comm.rank}: no warning"
    print_line(f"WARNED rank {comm.rank}: {messages[0]}")
    assert cp.steps() == [1, 2]  # nothing pruned, both still committed


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"cleanup": scenario_cleanup}[sys.argv[1]](Path(sys.argv[2]))
