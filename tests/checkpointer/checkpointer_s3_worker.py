"""Multi-rank ``Checkpointer`` scenarios on an S3 server (issue 34), run
by tests/checkpointer/test_checkpointer_s3.py as one job:
``mpiexec -n K python tests/checkpointer/checkpointer_s3_worker.py s3://BUCKET``
(the ``AWS_*`` variables in the environment reach the server).

- ``line``: ``keep_last=2`` at ``s3://BUCKET/line``: saves 10, 20, 30;
  loads 20 (a rollback); saves 21, 22: the live line is 20 -> 21 -> 22,
  so 21 and 22 stay and 30 (abandoned) and 20 (pruned) go; a fresh
  Checkpointer (a restart) resumes at 22 and loads it bitwise.
- ``async``: ``async_=True, keep_last=1`` at ``s3://BUCKET/async``:
  saves 1, 2, 3 in the background; after ``close`` only 3 is a step, and
  it loads bitwise.
- ``stores`` (issue 49, items 1 and 13): ``keep_last=1`` at
  ``s3://BUCKET/stores``, step 1 saved; then rank 1 addresses another
  server (``DEEPPART_TEST_OTHER_ENDPOINT``, which has the bucket too): the
  save of step 2 raises StoreConfigError on every rank, naming both
  endpoints, before anything is written; with ``DEEPPART_S3_STORE_ID``
  set alike on every rank (the endpoints then compare equal) the commit's
  check finds rank 1's data file missing: StoreConfigError on every rank,
  nothing committed. Step 1 stays the only step and loads bitwise; rank 0's
  store holds nothing of step 2. A bucket that does not exist: a save and
  a load raise StoreConfigError on every rank, one line naming it.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import deeppart
from deeppart.comm import resolve
from deeppart.errors import StoreConfigError
from deeppart.format import step_dir_name
from deeppart.storage import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from mpi_checkpoint import abort_on_failure, assert_bitwise_equal
from rank_output import print_line


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


def refused(run: Callable[[], Any]) -> str:
    """The message of the StoreConfigError that ``run`` raises on this rank
    (an AssertionError if it returns or raises anything else)."""
    try:
        run()
    except StoreConfigError as e:
        return str(e)
    raise AssertionError("no StoreConfigError")


def stores(root: str) -> None:
    comm = resolve(None)
    own = os.environ["AWS_ENDPOINT_URL"]
    other = os.environ["DEEPPART_TEST_OTHER_ENDPOINT"]
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(1, state(1, comm.size))
    if comm.rank == 1:
        os.environ["AWS_ENDPOINT_URL"] = other  # one misconfigured node
    try:
        said = refused(lambda: ck.save(2, state(2, comm.size)))
        assert "do not address one store" in said and "nothing was written" in said, said
        assert f"rank 0 {own}" in said and f"rank 1 {other}" in said, said
        os.environ["DEEPPART_S3_STORE_ID"] = "one-store"  # the same name on every rank
        said = refused(lambda: ck.save(2, state(2, comm.size)))
        assert "rank-00001.bin missing" in said and "nothing was committed" in said, said
    finally:
        os.environ["AWS_ENDPOINT_URL"] = own
        os.environ.pop("DEEPPART_S3_STORE_ID", None)
    comm.barrier()
    assert ck.steps() == [1] and ck.latest() == 1, ck.steps()
    check(ck, 1, comm.size)
    left = list(open_store(root).list(step_dir_name(2)))
    assert not left, left
    missing = root.replace("s3://", "s3://deeppart-no-such-bucket-", 1)
    for run in (
        lambda: deeppart.save(state(3, comm.size), missing),
        lambda: deeppart.load(missing),
    ):
        said = refused(run)
        assert "does not exist" in said and "'deeppart-no-such-bucket-" in said, said
        assert own in said and "\n" not in said, said


SCENARIOS = {"line": line, "async": in_background, "stores": stores}


def main() -> None:
    bucket = sys.argv[1]
    comm = resolve(None)
    for name in sys.argv[2:] or SCENARIOS:
        SCENARIOS[name](f"{bucket}/{name}")
        comm.barrier()
        print_line(f"OK {name} rank {comm.rank}/{comm.size}")


if __name__ == "__main__":
    abort_on_failure(main)
