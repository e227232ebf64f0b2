"""Multi-rank tests of typed values, flexible restore and the replica
check (workers: tests/mpi_values.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "mpi_values.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed"),
]

sys.path.insert(0, str(ROOT / "tests"))
from mpi_checkpoint import launch  # noqa: E402


def _run(n: int, *args: str) -> str:
    proc = launch([str(MPIEXEC), "-n", str(n), sys.executable, str(SCRIPT), *args], 180, ROOT)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_replica_check_names_the_changed_leaf_on_every_rank(tmp_path: Path, n: int) -> None:
    out = _run(n, "replicas", str(tmp_path))
    assert out.count("OK replicas") == n, out


def test_values_keys_and_strict_on_three_ranks(tmp_path: Path) -> None:
    out = _run(3, "values", str(tmp_path / "ck"))
    assert out.count("OK values") == 3, out
