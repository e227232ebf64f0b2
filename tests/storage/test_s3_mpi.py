"""Checkpoints in S3 across ranks (issue 34), against moto's server
(tests/support/s3_server.py): one mpiexec job of 4 ranks for the replicated
scenarios (tests/storage/s3_worker.py: save and load bitwise, two jobs racing for
one step, foreign objects, the server stopped and killed mid-save, the
multi-level engine's L4 level in S3, an object cut short during a load), and
FSDP2 DTensors on 4 torchrun ranks (tests/state/dtensor_worker.py ``s3``)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT_S = 600
RANKS = 4

import mpi_checkpoint  # noqa: E402
from launching import run_in_session, worker_cmd  # noqa: E402

pytestmark = [pytest.mark.slow]


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_s3_on_four_ranks(s3_url: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    assert s3_server.proc is not None
    monkeypatch.setenv("MOTO_PID", str(s3_server.proc.pid))
    monkeypatch.setenv("DEEPPART_S3_PART_BYTES", str(5 << 20))  # S3's smallest part
    monkeypatch.setenv("DEEPPART_S3_TIMEOUT_S", "3")  # the stopped server's requests
    worker = ROOT / "tests" / "storage" / "s3_worker.py"
    cmd = [str(MPIEXEC), "-n", str(RANKS), sys.executable, str(worker)]
    try:
        proc = mpi_checkpoint.launch([*cmd, s3_url], TIMEOUT_S, ROOT)
    finally:
        # The last scenario killed the server: a new one on the same port.
        s3_server.stop()
        s3_server.start(port=s3_server.port)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-8000:]}"
    for scenario in ("replicated", "race", "foreign", "hung", "levels", "truncated", "killed"):
        oks = set(re.findall(rf"OK {scenario} rank \d+/{RANKS}", proc.stdout))
        assert len(oks) == RANKS, (scenario, out[-8000:])
    results = re.findall(r"RESULT (\w+) (\w+) rank (\d+) (\S+)", proc.stdout)
    race = sorted(r[3] for r in results if r[0] == "race")
    assert race == ["CommitConflictError"] * 2 + ["ok"] * 2, race
    for scenario in ("hung", "killed"):
        got = [r[3] for r in results if r[0] == scenario]
        assert len(got) == RANKS and "ok" not in got, (scenario, got)
    truncated = [r[3] for r in results if r[0] == "truncated"]
    assert truncated == ["CorruptCheckpointError"] * RANKS, truncated


@pytest.mark.multirank
def test_s3_fsdp2_dtensors(s3_url: str, tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env["DEEPPART_TEST_S3_URL"] = f"{s3_url}/dtensor"
    worker = ROOT / "tests" / "state" / "dtensor_worker.py"
    rc, out = run_in_session(worker_cmd(worker, RANKS, "s3", str(tmp_path)), env, ROOT, 400)
    assert rc == 0, f"rc={rc}\n{out[-6000:]}"
    assert len(set(re.findall(r"OK s3 rank \d+/\d+", out))) == RANKS, out[-6000:]
