"""The abi3 wheel: ``maturin build --release`` produces it, and it installs
into a fresh virtualenv with no Rust toolchain on PATH, where a 2-rank
save and restore runs from it (numpy-only state: no torch download).

The fresh environment gets numpy, xxhash, mpi4py and mpich from PyPI, at
the versions pinned in requirements/dev.txt (pip's cache makes reruns cheap).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

pytestmark = [
    pytest.mark.slow,
    pytest.mark.mpi,
]

_WORKER = r"""
import random
import sys
import numpy as np
import deeppart
from deeppart.comm import resolve

assert "torch" not in sys.modules
assert "site-packages" in deeppart.__file__, deeppart.__file__
c = resolve()
np.random.seed(3)
random.seed(3)
state = {
    "weights": np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32),
    "rng": {"numpy": np.random.get_state(), "python": random.getstate()},
    "step": 7,
    "names": ("a", "b"),
}
deeppart.save(state, sys.argv[1], verify_replicas=True)
got = deeppart.load(sys.argv[1])
assert np.array_equal(got["weights"], state["weights"])
assert got["weights"].dtype == np.float32 and got["names"] == ("a", "b") and got["step"] == 7
np.random.set_state(got["rng"]["numpy"])
restored = np.random.rand(4)
np.random.set_state(state["rng"]["numpy"])
assert np.array_equal(restored, np.random.rand(4))
print(f"OK wheel rank {c.rank}/{c.size}", flush=True)
"""


def _pins(*names: str) -> list[str]:
    text = (ROOT / "requirements" / "dev.txt").read_text()
    out = []
    for name in names:
        m = re.search(rf"^{re.escape(name)}==\S+", text, re.M)
        out.append(m.group(0) if m else name)
    return out


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env=env, cwd=cwd or ROOT
    )
    assert proc.returncode == 0, (
        f"{' '.join(cmd)}: rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout + proc.stderr


def test_abi3_wheel_installs_and_runs_two_ranks_without_rust(tmp_path: Path) -> None:
    maturin = BIN / "maturin"
    if not maturin.exists():
        pytest.skip("maturin is not installed")
    wheels = tmp_path / "wheels"
    env = dict(os.environ, VIRTUAL_ENV=str(BIN.parent), PATH=f"{BIN}:{os.environ['PATH']}")
    _run([str(maturin), "build", "--release", "--quiet", "--out", str(wheels)], env=env)
    (wheel,) = wheels.glob("deeppart-*.whl")
    assert "-abi3-" in wheel.name, wheel.name
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert any(re.fullmatch(r"deeppart/_planner\.abi3\.so", n) for n in names), names
    assert "deeppart/_planner.pyi" in names and "deeppart/py.typed" in names

    # A fresh virtualenv, no site packages, no Rust toolchain on PATH.
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    vbin = venv / "bin"
    path = os.pathsep.join([str(vbin), "/usr/bin", "/bin"])
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("VIRTUAL_ENV", "PYTHON", "CARGO", "RUSTUP"))
    }
    fresh = dict(clean, PATH=path, VIRTUAL_ENV=str(venv))
    assert shutil.which("cargo", path=path) is None and shutil.which("rustc", path=path) is None
    _run(
        [str(vbin / "python"), "-m", "pip", "install", "--quiet", str(wheel),
         *_pins("numpy", "xxhash", "mpi4py", "mpich")],
        env=fresh, cwd=tmp_path,
    )  # fmt: skip
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    out = _run(
        [str(vbin / "mpiexec"), "-n", "2", str(vbin / "python"), str(script), str(tmp_path / "ck")],
        env=dict(fresh, OMP_NUM_THREADS="1"), cwd=tmp_path,
    )  # fmt: skip
    assert out.count("OK wheel rank") == 2, out
    # The command line runs from the wheel too.
    out = _run([str(vbin / "deeppart"), "inspect", str(tmp_path / "ck")], env=fresh, cwd=tmp_path)
    assert "step" in out or "leaves" in out, out
