"""Multi-rank ``Checkpointer`` scenarios on an S3 server (issue 34), run
by tests/test_checkpointer_s3.py as one job:
``mpiexec -n K python tests/checkpointer_s3_worker.py s3://BUCKET``
(the ``AWS_*`` variables in the environment reach the server).

- ``line``: ``keep_last=2`` at ``s3://BUCKET/line``: saves 10, 20, 30;
  loads 20 (a rollback); saves 21, 22: the live line is 20 -> 21 -> 22,
  so 21 and 22 stay and 30 (abandoned) and 20 (pruned) go; a fresh
  Checkpointer (a restart) resumes at 22 and loads it bitwise.
- ``async``: ``async_=True, keep_last=1`` at ``s3://BUCKET/async``:
  saves 1, 2, 3 in the background; after ``close`` only 3 is a step, and
  it loads bitwise.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from mpi_checkpoint import abort_on_failure, assert_bitwise_equal
from rank_output import print_line

import deeppart
from deeppart.comm import resolve


def state(v: int, world: int) -> dict[str, Any]:
    """Replicated state large enough for the plan to give every rank pieces."""
    return {
        "w": torch.arange(64 * 1024, dtype=torch.float32) + v,
        "b": torch.full((4096, world), float(v), dtype=torch.float64),
        "step": v,
    }


def check(ck: deeppart.Checkpointer, step: int, world: int) -> None:
    got = ck.load(step)
    assert_bitwise_equal(got, state(step, world))


def line(root: str) -> None:
    comm = resolve(None)
    ck = deeppart.Checkpointer(root, keep_last=2)
    for step in (10, 20, 30):
        ck.save(step, state(step, comm.size))
    assert ck.steps() == [20, 30], ck.steps()
    check(ck, 20, comm.size)  # the rollback
    ck.save(21, state(21, comm.size))
    assert ck.steps() == [20, 21] and ck.latest() == 21, ck.steps()
    ck.save(22, state(22, comm.size))
    assert ck.steps() == [21, 22], ck.steps()
    restart = deeppart.Checkpointer(root, keep_last=2)
    assert restart.latest() == 22, restart.latest()
    check(restart, 22, comm.size)
    check(restart, 21, comm.size)


def in_background(root: str) -> None:
    comm = resolve(None)
    ck = deeppart.Checkpointer(root, keep_last=1, async_=True)
    for step in (1, 2, 3):
        handle = ck.save(step, state(step, comm.size))
        assert isinstance(handle, deeppart.AsyncSave)
    ck.close()
    # Rank 0 prunes in its background thread before its save completes;
    # the other ranks' saves may complete first.
    comm.barrier()
    assert ck.steps() == [3], ck.steps()
    check(ck, 3, comm.size)


def main() -> None:
    bucket = sys.argv[1]
    comm = resolve(None)
    for name, run in (("line", line), ("async", in_background)):
        run(f"{bucket}/{name}")
        comm.barrier()
        print_line(f"OK {name} rank {comm.rank}/{comm.size}")


if __name__ == "__main__":
    abort_on_failure(main)
