"""CUDA state: save, load(into=...) and async_save of GPU tensors through the
host staging buffer, and torch.distributed with NCCL (every collective staged
through CUDA tensors) and with gloo. Skipped where no GPU is visible; the
CPU-only tests of the same code paths are in tests/state/test_staging.py.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from cuda_worker import cuda_state, tensors  # noqa: E402
from launching import run_in_session  # noqa: E402

import deeppart  # noqa: E402
from deeppart.options import AsyncOptions, LoadOptions, WriteOptions  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "state" / "cuda_worker.py"
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
    deeppart.save(state, d, writing=WriteOptions(compression=codec, staging_bytes=1 << 16))
    plain = deeppart.load(d)
    assert all(_bitwise(a, b) for a, b in zip(tensors(state), tensors(plain), strict=True))
    target = cuda_state(seed=2)
    ptrs = [t.data_ptr() for t in tensors(target)]
    devices = [t.device for t in tensors(target)]  # AdamW's step counters stay on the CPU
    assert any(d.type == "cuda" for d in devices)
    for t in tensors(target):
        t.zero_()
    deeppart.load(d, into=target, loading=LoadOptions(staging_bytes=1 << 16))
    assert [t.data_ptr() for t in tensors(target)] == ptrs
    assert [t.device for t in tensors(target)] == devices
    assert all(_bitwise(a, b) for a, b in zip(tensors(state), tensors(target), strict=True))


def test_noncontiguous_and_conjugate_cuda_tensors(tmp_path: Path) -> None:
    """Transposed, sliced and conjugated CUDA tensors are saved with their
    values (contiguous on the device first), not their raw storage."""
    base = torch.randn(64, 48, device="cuda")
    c = torch.randn(16, dtype=torch.complex64, device="cuda")
    state = {"t": base.t(), "s": base[::3, 5:], "conj": c.conj(), "neg": c.neg()}
    deeppart.save(state, tmp_path / "ck", writing=WriteOptions(staging_bytes=4096))
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


def _big_cuda_state(mib: int, seed: int) -> dict[str, Any]:
    """Float32 CUDA tensors of about ``mib`` MiB in all (copies that take
    milliseconds, long enough for work queued after them to overtake them
    if nothing ordered it), one of them transposed (not contiguous)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n = mib * (1 << 20) // 4 // 4
    side = int(n**0.5)
    return {
        "a": torch.randn(n, generator=gen, device="cuda"),
        "b": torch.randn(n, generator=gen, device="cuda"),
        "c": torch.randn(n, generator=gen, device="cuda"),
        "t": torch.randn(side, side, generator=gen, device="cuda").t(),
        "step": 7,
    }


def _cuda_clone(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@pytest.mark.parametrize("on_device", [False, True])
def test_async_save_returns_before_the_copies_and_orders_training_after_them(
    tmp_path: Path, on_device: bool
) -> None:
    """async_save queues the device-to-host copies on DeepPart's side stream
    and returns; work the training loop queues right after (an optimizer's
    in-place steps, on the current stream) runs after the copies have read
    the state (or, with snapshot_on_device, after copies within the
    device): the checkpoint holds the state as of the call, bitwise. The
    copies' own time on the device is reported."""
    state = _big_cuda_state(512, seed=1)
    want = _cuda_clone(state)
    params = [torch.nn.Parameter(state[k]) for k in ("a", "b", "c")]
    state.update(a=params[0], b=params[1], c=params[2])
    opt = torch.optim.SGD(params, lr=1.0)
    torch.cuda.synchronize()
    handle = deeppart.async_save(
        state, tmp_path / "ck", background=AsyncOptions(snapshot_on_device=on_device)
    )
    for p in params:  # queued at once, on the current stream
        p.grad = torch.ones_like(p)
    opt.step()
    state["t"].mul_(-1.0)
    stats = handle.wait()
    assert stats.raw_bytes > 0
    assert handle.device_copy_seconds is not None and handle.device_copy_seconds > 0
    assert handle.staged_bytes >= sum(
        v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
    )
    out = deeppart.load(tmp_path / "ck")
    for k in ("a", "b", "c", "t"):
        assert _bitwise(want[k], out[k]), k
    # The training loop's changes are there, after the copies.
    assert _bitwise(want["a"] - 1.0, state["a"].detach())


def test_async_save_on_device_frees_its_device_copies(tmp_path: Path) -> None:
    """snapshot_on_device holds the share's copies on the device only until
    they are on the host: after wait() the device memory is back."""
    state = _big_cuda_state(256, seed=2)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    handle = deeppart.async_save(
        state, tmp_path / "ck", background=AsyncOptions(snapshot_on_device=True)
    )
    assert torch.cuda.memory_allocated() >= before + 200 * (1 << 20)
    handle.wait()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)
    assert _bitwise(state["a"], deeppart.load(tmp_path / "ck")["a"])


@pytest.mark.parametrize("threads", ["1", "4", "16"])
def test_load_into_cuda_with_several_readers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """load(into=) CUDA tensors: several reader threads, pinned slots,
    copies on their own streams; the tensors are usable on the current
    stream at once (the load orders it after the copies), bitwise, and a
    flipped byte fails the load naming the piece."""
    import json

    from deeppart.errors import CorruptCheckpointError
    from deeppart.format import data_file_name

    monkeypatch.setenv("DEEPPART_LOAD_THREADS", threads)
    state = _big_cuda_state(256, seed=3)
    d = tmp_path / "ck"
    deeppart.save(state, d)
    into: dict[str, Any] = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
    }
    ptrs = {k: v.data_ptr() for k, v in into.items() if isinstance(v, torch.Tensor)}
    out = deeppart.load(d, into=into, loading=LoadOptions(staging_bytes=64 << 20))
    # Read on the current stream right away: no synchronisation by the test.
    sums = {k: float(v.double().sum()) for k, v in into.items() if isinstance(v, torch.Tensor)}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert out[k] is into[k] and into[k].data_ptr() == ptrs[k], k
            assert sums[k] == float(v.double().sum()), k
            assert _bitwise(v, into[k]), k
    assert out["step"] == 7
    meta = json.loads((d / "metadata.json").read_text())
    leaf, _, _, rank, offset, length = max(meta["pieces"], key=lambda row: row[5])[:6]
    path = d / data_file_name(rank)
    with open(path, "r+b") as f:
        f.seek(offset + length - 3)
        byte = f.read(1)
        f.seek(offset + length - 3)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        deeppart.load(d, into=into)
    assert f"piece of leaf {leaf} " in str(info.value)


def test_replica_proof_of_cuda_tensors_streams_through_the_host() -> None:
    """The whole-tensor digest of a CUDA tensor (the replica proof of a
    save's prepare) is computed in chunks through two pinned buffers, and
    equals the digest of the same bytes on the CPU, across chunk borders."""
    from deeppart.saving.digests import streamed_digest, tensor_digest

    t = torch.randn(3 << 20, device="cuda")[::2]  # a strided view, 6 MiB
    on_host = tensor_digest(t.cpu())
    assert tensor_digest(t) == on_host
    assert streamed_digest(t, 1 << 20) == on_host
    u = t.clone()
    u[-1] += 1
    assert streamed_digest(u, 1 << 20) != on_host
