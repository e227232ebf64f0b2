"""CUDA state: save, load(into=...) and async_save of GPU tensors through the
host staging buffer, and torch.distributed with NCCL (every collective staged
through CUDA tensors) and with gloo. Skipped where no GPU is visible; the
CPU-only tests of the same code paths are in tests/test_staging.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deeppart  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_worker import cuda_state, tensors  # noqa: E402
from launching import run_in_session  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "cuda_worker.py"
TIMEOUT_S = 300

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def _bitwise(a: Any, b: Any) -> bool:
    return bool(
        torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_save_load_cuda_state_in_place(tmp_path: Path, codec: str | None) -> None:
    """A CUDA model + AdamW state saved through a 64 KiB staging buffer loads
    bitwise: as CPU tensors, and in place into CUDA tensors (same objects)."""
    state = cuda_state(seed=1)
    d = tmp_path / "ck"
    deeppart.save(state, d, compression=codec, staging_bytes=1 << 16)
    plain = deeppart.load(d)
    assert all(_bitwise(a, b) for a, b in zip(tensors(state), tensors(plain), strict=True))
    target = cuda_state(seed=2)
    ptrs = [t.data_ptr() for t in tensors(target)]
    devices = [t.device for t in tensors(target)]  # AdamW's step counters stay on the CPU
    assert any(d.type == "cuda" for d in devices)
    for t in tensors(target):
        t.zero_()
    deeppart.load(d, into=target, staging_bytes=1 << 16)
    assert [t.data_ptr() for t in tensors(target)] == ptrs
    assert [t.device for t in tensors(target)] == devices
    assert all(_bitwise(a, b) for a, b in zip(tensors(state), tensors(target), strict=True))


def test_noncontiguous_and_conjugate_cuda_tensors(tmp_path: Path) -> None:
    """Transposed, sliced and conjugated CUDA tensors are saved with their
    values (contiguous on the device first), not their raw storage."""
    base = torch.randn(64, 48, device="cuda")
    c = torch.randn(16, dtype=torch.complex64, device="cuda")
    state = {"t": base.t(), "s": base[::3, 5:], "conj": c.conj(), "neg": c.neg()}
    deeppart.save(state, tmp_path / "ck", staging_bytes=4096)
    out = deeppart.load(tmp_path / "ck")
    for k, v in state.items():
        assert torch.equal(out[k], v.resolve_conj().resolve_neg().cpu()), k


def test_async_save_cuda_snapshot(tmp_path: Path) -> None:
    """async_save returns once the GPU state is on the host; later in-place
    changes on the GPU do not reach the checkpoint."""
    state = cuda_state(seed=3)
    snapshot = [t.clone() for t in tensors(state)]
    handle = deeppart.async_save(state, tmp_path / "ck")
    for t in tensors(state):
        if t.is_floating_point():
            t.add_(1.0)
    handle.wait()
    out = deeppart.load(tmp_path / "ck")
    assert all(_bitwise(a, b) for a, b in zip(snapshot, tensors(out), strict=True))


def _torchrun(n: int, scenario: str, directory: Path) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(n),
        "--standalone",
        str(WORKER),
        scenario,
        str(directory),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rc, out = run_in_session(cmd, env, ROOT, TIMEOUT_S)
    assert rc == 0, out
    assert len(set(re.findall(rf"OK {scenario} rank \d+/{n}", out))) == n, out
    return out


def test_nccl_group(tmp_path: Path) -> None:
    """NCCL (one rank per GPU): every collective goes through CUDA tensors."""
    _torchrun(min(torch.cuda.device_count(), 2), "nccl", tmp_path / "ck")


def test_gloo_group_with_cuda_state(tmp_path: Path) -> None:
    """Three gloo ranks sharing one GPU save and load CUDA state bitwise."""
    _torchrun(3, "gloo-cuda", tmp_path / "ck")
