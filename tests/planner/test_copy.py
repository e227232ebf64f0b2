"""deeppart._planner.copy_into: the asynchronous snapshot's streaming copy
(non-temporal stores from STREAMING_MIN_BYTES on, io/src/copy.rs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deeppart._planner import STREAMING_MIN_BYTES, copy_into


@pytest.mark.parametrize(
    "n", [0, 1, 63, 64, 1000, STREAMING_MIN_BYTES - 1, STREAMING_MIN_BYTES, 3 << 20]
)
@pytest.mark.parametrize("dst_offset", [0, 1, 7, 16])
def test_copies_every_byte_and_nothing_around_it(n: int, dst_offset: int) -> None:
    rng = np.random.default_rng(n + dst_offset)
    src = rng.integers(0, 256, n + 3, dtype=np.uint8)[3:]  # an unaligned source
    out = np.full(n + dst_offset + 32, 0xAA, dtype=np.uint8)
    copy_into(out[dst_offset : dst_offset + n].data, src.data)
    assert np.array_equal(out[dst_offset : dst_offset + n], src)
    assert (out[:dst_offset] == 0xAA).all() and (out[dst_offset + n :] == 0xAA).all()


def test_copies_a_tensor_numpy_has_no_dtype_for() -> None:
    """The snapshot's case: a bfloat16 tensor's bytes, through a uint8 view."""
    t = torch.randn(1 << 19).to(torch.bfloat16)
    dst = torch.empty_like(t)
    copy_into(dst.view(torch.uint8).numpy().data, t.view(torch.uint8).numpy().data)
    assert torch.equal(dst, t)


def test_bad_buffers_are_refused() -> None:
    buf = np.zeros(1 << 20, dtype=np.uint8)
    # (numpy's stubs make ndarray a Buffer only from Python 3.12: .data, a
    # memoryview of the same memory, for mypy under 3.11.)
    with pytest.raises(ValueError, match="holds 10 bytes, src 11"):
        copy_into(buf[:10].data, buf[100:111].data)
    with pytest.raises(ValueError, match="overlap"):
        copy_into(buf[:4096].data, buf[2048:6144].data)
    with pytest.raises(TypeError, match="writable"):
        copy_into(b"x" * 8, buf[:8].data)
    readonly = buf[:8].copy()
    readonly.flags.writeable = False
    with pytest.raises(TypeError, match="writable"):
        copy_into(readonly.data, buf[:8].data)
    with pytest.raises(ValueError, match="C-contiguous"):
        copy_into(buf[:16:2].data, buf[100:108].data)
    with pytest.raises(TypeError, match="buffer protocol"):
        copy_into(buf[:8].data, "not a buffer")  # type: ignore[arg-type]
    assert (buf == 0).all()
