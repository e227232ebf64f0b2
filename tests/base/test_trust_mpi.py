"""Issue 31, items 1 and 2, in one mpiexec job (tests/base/mpi_trust.py): no
rank returns bytes that were not checksummed where they lie or copied from
memory where they were (a data file changed under the load through a
shared mapping: a tensor byte, a plain value); and a failure injected into
each stage of a save and of a load on one rank raises the same error type
on every rank, within the job's timeout (no rank left waiting); a
KeyboardInterrupt or SystemExit raised in each of those stages on one rank
(issue 49, item 8) is re-raised there while every other rank raises a
DeepPartError naming the rank and the interruption, within the timeout
(before: the other ranks hung in their next collective). Issue 49,
item 1: a save to a path that is another directory on each rank fails on
every rank before anything is written. Item 10 (its own, short job:
``--scenario loadstep``): all ranks of a ``Checkpointer.load()`` read
the step rank 0 picked, though a newer one was committed between the
ranks' calls; different explicit steps are a StateMismatchError on every
rank."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "base" / "mpi_trust.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT_S = 300
RANKS = 2

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed"),
]

import mpi_checkpoint  # noqa: E402


def test_verified_bytes_and_failures_reach_every_rank(tmp_path: Path) -> None:
    cmd = [str(MPIEXEC), "-n", str(RANKS), sys.executable, str(SCRIPT), str(tmp_path)]
    proc = mpi_checkpoint.launch(cmd, TIMEOUT_S, ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-8000:]}"
    for scenario in ("verified", "stages", "directories", "interrupts"):
        oks = set(re.findall(rf"OK {scenario} rank \d+/{RANKS}", proc.stdout))
        assert len(oks) == RANKS, out[-8000:]
    results = re.findall(r"RESULT (\w+) ([\w-]+) rank (\d+) (\S+)", proc.stdout)
    cases = {(s, case) for s, case, _, _ in results}
    assert len(cases) == 2 + 14 + 1 + 14 + 2, cases  # every case reported ...
    assert len(results) == len(cases) * RANKS  # ... by every rank


def test_all_ranks_of_a_load_read_the_step_rank_0_picked(tmp_path: Path) -> None:
    cmd = [str(MPIEXEC), "-n", str(RANKS), sys.executable, str(SCRIPT), str(tmp_path)]
    proc = mpi_checkpoint.launch([*cmd, "--scenario", "loadstep"], TIMEOUT_S, ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-8000:]}"
    oks = set(re.findall(rf"OK loadstep rank \d+/{RANKS}", proc.stdout))
    assert len(oks) == RANKS, out[-8000:]
