"""Reed-Solomon erasure coding (deeppart._planner.rs_encode / rs_reconstruct):
a group of g data shards plus g parity shards survives the loss of any g
of its 2g files, and a loss beyond that is an error, never wrong data."""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

import deeppart
from deeppart import DeepPartError, ErasureError
from deeppart._planner import rs_encode, rs_reconstruct


def make_shards(g: int, seed: int, max_len: int = 300) -> list[bytes]:
    rng = random.Random(seed)
    lengths = [rng.randrange(max_len + 1) for _ in range(g)]
    lengths[0] = max_len | 1  # one odd length at least
    return [rng.randbytes(n) for n in lengths]


def survivors(
    data: list[bytes], parity: list[bytes], lost: set[int]
) -> tuple[dict[int, bytes], dict[int, bytes]]:
    g = len(data)
    originals = {i: s for i, s in enumerate(data) if i not in lost}
    recovery = {i: s for i, s in enumerate(parity) if g + i not in lost}
    return originals, recovery


def test_exported_from_package() -> None:
    assert deeppart.ErasureError is ErasureError
    assert issubclass(ErasureError, DeepPartError)


def test_round_trip_without_losses() -> None:
    data = [b"abc", b"", b"0123456789"]
    parity = rs_encode(data, 3)
    assert len(parity) == 3
    assert all(isinstance(p, bytes) and len(p) == 10 for p in parity)
    lengths = [len(d) for d in data]
    originals, recovery = survivors(data, parity, set())
    out = rs_reconstruct(3, 3, originals, recovery, lengths)
    assert out == data
    # Surviving bytes objects come back as themselves, without a copy.
    assert all(o is d for o, d in zip(out, data, strict=True))


def test_encoding_is_deterministic_and_odd_lengths_pad_to_even() -> None:
    data = [b"x" * 7, b"y" * 3]
    assert rs_encode(data, 2) == rs_encode([bytearray(d) for d in data], 2)
    assert [len(p) for p in rs_encode(data, 2)] == [8, 8]


@pytest.mark.parametrize("g", [2, 3, 4])
def test_any_half_of_the_group_can_be_lost(g: int) -> None:
    data = make_shards(g, seed=g)
    lengths = [len(d) for d in data]
    parity = rs_encode(data, g)
    for lost_count in range(g + 1):
        for lost in itertools.combinations(range(2 * g), lost_count):
            originals, recovery = survivors(data, parity, set(lost))
            out = rs_reconstruct(g, g, originals, recovery, lengths)
            assert out == data, f"lost {lost}"


@pytest.mark.parametrize("g", [2, 3, 4])
def test_losing_more_than_half_is_an_error(g: int) -> None:
    data = make_shards(g, seed=10 + g)
    lengths = [len(d) for d in data]
    parity = rs_encode(data, g)
    for lost in itertools.combinations(range(2 * g), g + 1):
        originals, recovery = survivors(data, parity, set(lost))
        with pytest.raises(ErasureError, match="too few shards survive"):
            rs_reconstruct(g, g, originals, recovery, lengths)


def test_buffers_of_any_kind_are_accepted() -> None:
    # numpy arrays are buffers; their stubs say so only for Python >= 3.12,
    # hence their .data (a memoryview, no copy) for mypy.
    floats = np.arange(10, dtype=np.float32)
    ints = np.arange(3, dtype=np.int16)
    data = [floats.tobytes(), ints.tobytes()]
    parity = rs_encode([floats.data, ints.data], 2)
    assert parity == rs_encode(data, 2)
    lengths = [len(d) for d in data]
    out = rs_reconstruct(2, 2, {1: memoryview(data[1])}, {1: bytearray(parity[1])}, lengths)
    assert out == data
    assert np.array_equal(np.frombuffer(out[0], dtype=np.float32), floats)


def test_empty_data() -> None:
    parity = rs_encode([b"", b""], 2)
    assert parity == [b"", b""]
    assert rs_reconstruct(2, 2, {}, {0: b"", 1: b""}, [0, 0]) == [b"", b""]
    with pytest.raises(ErasureError, match="too few"):
        rs_reconstruct(2, 2, {}, {0: b""}, [0, 0])


def test_large_shards_round_trip() -> None:
    rng = np.random.default_rng(0)
    data = [rng.integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes() for _ in range(4)]
    parity = rs_encode(data, 4)
    out = rs_reconstruct(4, 4, {}, dict(enumerate(parity)), [len(d) for d in data])
    assert out == data


def _bad_reconstruct(
    originals: Mapping[Any, object], parity: Mapping[Any, object], lengths: list[int]
) -> None:
    rs_reconstruct(2, 2, originals, parity, lengths)  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    data = [b"abcd", b"efgh"]
    parity = rs_encode(data, 2)
    with pytest.raises(ErasureError, match="between 1 and 32768"):
        rs_encode([], 2)
    with pytest.raises(ErasureError, match="between 1 and 32768"):
        rs_encode(data, 0)
    with pytest.raises(ErasureError, match="at least 1, got -1"):
        rs_encode(data, -1)
    with pytest.raises(ErasureError, match="between 1 and 32768"):
        rs_encode([b"a"] * 40000, 1)
    with pytest.raises(TypeError, match="data shard 1 must be a bytes-like object"):
        rs_encode([b"ab", "cd"], 2)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="C-contiguous"):
        rs_encode([np.zeros((4, 4), dtype=np.uint8)[:, ::2].data], 1)
    with pytest.raises(ErasureError, match="expected 2 data shard lengths, got 1"):
        rs_reconstruct(2, 2, {0: data[0]}, {0: parity[0]}, [4])
    with pytest.raises(ErasureError, match="data shard index 5 is out of range"):
        rs_reconstruct(2, 2, {5: data[0]}, {0: parity[0]}, [4, 4])
    with pytest.raises(ErasureError, match="parity shard index -1 is out of range"):
        rs_reconstruct(2, 2, {0: data[0]}, {-1: parity[0]}, [4, 4])
    with pytest.raises(ErasureError, match="data shard 0 has 3 bytes, expected 4"):
        rs_reconstruct(2, 2, {0: data[0][:3]}, {0: parity[0]}, [4, 4])
    with pytest.raises(ErasureError, match="parity shard 1 has 2 bytes, expected 4"):
        rs_reconstruct(2, 2, {0: data[0]}, {1: parity[1][:2]}, [4, 4])
    with pytest.raises(ValueError, match="non-negative"):
        rs_reconstruct(2, 2, {0: data[0]}, {0: parity[0]}, [4, -4])
    with pytest.raises(ErasureError, match="at least 1"):
        rs_reconstruct(-2, 2, {}, {}, [])
    with pytest.raises(TypeError, match="int indices"):
        _bad_reconstruct({"0": data[0]}, {0: parity[0]}, [4, 4])
    with pytest.raises(TypeError, match="parity shard 0 must be a bytes-like object"):
        _bad_reconstruct({0: data[0]}, {0: 12}, [4, 4])


def test_recorded_lengths_are_needed_and_checked() -> None:
    # Lengths that disagree with the parity's size are refused rather than
    # decoded into wrong data.
    data = [b"a" * 10, b"b" * 6]
    parity = rs_encode(data, 2)
    with pytest.raises(ErasureError, match="parity shard 0 has 10 bytes, expected 12"):
        rs_reconstruct(2, 2, {}, {0: parity[0], 1: parity[1]}, [12, 6])
