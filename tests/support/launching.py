"""Running a multi-process job from a test: in its own session, so that a
hang is ended by killing the whole process group, never left behind."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest


def run_in_session(
    cmd: list[str], env: dict[str, str], cwd: Path, timeout_s: float
) -> tuple[int, str]:
    """Runs ``cmd`` (stdout and stderr together) in a new session; after
    ``timeout_s`` seconds kills its process group and fails the test.
    Returns the exit status and the output."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung (no result after {timeout_s} s):\n{out[-8000:]}")
    return proc.returncode, out


def worker_cmd(worker: Path, ranks: int, *args: str) -> list[str]:
    """The command that runs ``worker`` on ``ranks`` torchrun ranks (gloo,
    ``--standalone``), or as one plain process when ``ranks`` is 0."""
    import sys

    cmd = [sys.executable, str(worker), *args]
    if ranks:
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        cmd = [*launcher, "--nproc-per-node", str(ranks), "--standalone", *cmd[1:]]
    return cmd


def run_ranks(worker: Path, n: int, *args: str, timeout_s: float = 400) -> str:
    """``worker`` on ``n`` torchrun ranks (0: one plain process), from the
    repository root; checks that it exited 0 and that every rank printed
    ``OK <scenario> rank <r>/<size>``. Returns the output."""
    import re

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    rc, out = run_in_session(worker_cmd(worker, n, *args), env, root, timeout_s)
    assert rc == 0, f"rc={rc}\n{out[-6000:]}"
    assert len(set(re.findall(r"OK \w+ rank \d+/\d+", out))) >= max(n, 1), out[-6000:]
    return out
