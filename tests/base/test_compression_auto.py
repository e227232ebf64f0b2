"""``compression="auto"`` (a per-piece decision in the save's cost model)
and the byte shuffle of ``shuffle-zstd``: what each piece records, bitwise
round trips and corruption."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deeppart
from deeppart import compression
from deeppart.compression import AUTO_MIN_PIECE, AutoPolicy, compress, decompress, rank_bandwidth
from deeppart.errors import CorruptCheckpointError
from deeppart.format import data_file_name
from deeppart.state import staging

#: Storage so slow (10 MB/s) that any real compression pays, and so fast
#: (1 TB/s) that none does.
SLOW = deeppart.CostModel(bandwidth=1e7)
FAST = deeppart.CostModel(bandwidth=1e12)

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


def _codecs(d: Path) -> dict[str, set[str]]:
    """The codecs recorded for each leaf's pieces, by leaf path."""
    meta = json.loads((d / "metadata.json").read_text())
    paths = ["/".join(map(str, lf["path"])) for lf in meta["manifest"]["leaves"]]
    out: dict[str, set[str]] = {}
    for row in meta["pieces"]:
        out.setdefault(paths[row[0]], set()).add(row[7])
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        assert v.dtype == b[k].dtype and torch.equal(v.view(torch.uint8), b[k].view(torch.uint8))


def test_auto_on_random_floats_writes_plain_pieces(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(1 << 18, generator=gen),  # 1 MiB of float32
        "h": torch.randn(1 << 18, generator=gen).to(torch.float16),
        "u": torch.randint(0, 256, (1 << 18,), generator=gen, dtype=torch.uint8),
    }
    d = tmp_path / "ck"
    stats = deeppart.save(state, d, writing=deeppart.WriteOptions(compression="auto"))
    assert _codecs(d) == {"w": {"none"}, "h": {"none"}, "u": {"none"}}
    assert json.loads((d / "metadata.json").read_text())["compression"] == "auto"
    assert stats.ratio == 1.0
    _equal(state, deeppart.load(d))


def test_auto_compresses_where_it_pays(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {
        # bf16 values in float32: the two low bytes of every element are zero.
        "w": torch.randn(1 << 18, generator=gen).to(torch.bfloat16).float(),
        "z": torch.zeros(1 << 18, dtype=torch.uint8),
        "small": torch.zeros(16),  # under AUTO_MIN_PIECE: raw, not sampled
        "noise": torch.randint(0, 256, (1 << 18,), generator=gen, dtype=torch.uint8),
    }
    d = tmp_path / "slow"
    stats = deeppart.save(
        state,
        d,
        planning=deeppart.PlanOptions(cost=SLOW),
        writing=deeppart.WriteOptions(compression="auto"),
    )
    assert _codecs(d) == {
        "w": {"shuffle-zstd"},
        "z": {"zstd"},
        "small": {"none"},
        "noise": {"none"},
    }
    assert stats.ratio > 1.5
    _equal(state, deeppart.load(d))
    # The same state on storage faster than the codec: nothing pays.
    fast = tmp_path / "fast"
    deeppart.save(
        state,
        fast,
        planning=deeppart.PlanOptions(cost=FAST),
        writing=deeppart.WriteOptions(compression="auto"),
    )
    assert set().union(*_codecs(fast).values()) == {"none"}
    _equal(state, deeppart.load(fast))


def test_auto_samples_device_pieces_without_a_whole_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The staged (device) path decides on a sample copied alone; a piece
    that pays is then staged whole, one that does not streams raw."""
    monkeypatch.setattr(staging, "needs_staging", lambda t: True)
    state = {
        "w": torch.randn(1 << 17).to(torch.bfloat16).float(),
        "r": torch.randint(0, 256, (1 << 18,), dtype=torch.uint8),
    }
    d = tmp_path / "ck"
    deeppart.save(
        state,
        d,
        planning=deeppart.PlanOptions(cost=SLOW),
        writing=deeppart.WriteOptions(compression="auto"),
    )
    assert _codecs(d) == {"w": {"shuffle-zstd"}, "r": {"none"}}
    _equal(state, deeppart.load(d))


def test_auto_policy_window_and_bandwidth() -> None:
    policy = AutoPolicy(1e9)
    assert policy.window(AUTO_MIN_PIECE - 1, 4) is None
    for n, isz in [(AUTO_MIN_PIECE, 4), (10**7 + 6, 2), (3 << 30, 8), (AUTO_MIN_PIECE + 1, 1)]:
        w = policy.window(n, isz)
        assert w is not None
        at, size = w
        assert at % isz == 0 and size % isz == 0 and 0 < size <= compression.AUTO_SAMPLE
        assert at + size <= n
    assert policy.choose(memoryview(b"\0" * 100)) == "none"
    assert policy.chosen == {"none": 1}
    cost = deeppart.CostModel(bandwidth=2e9, node_bandwidth=4e9, aggregate_bandwidth=16e9)
    assert rank_bandwidth(cost, deeppart.Topology(ranks_per_node=4), 8) == 1e9
    assert rank_bandwidth(cost, deeppart.Topology(ranks_per_node=1), 2) == 2e9
    assert rank_bandwidth(deeppart.CostModel(), deeppart.Topology(), 4) == 1e9


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, 3, 1001, 65537])
def test_shuffle_roundtrips_bitwise(dtype: torch.dtype, n: int) -> None:
    t = torch.randn(n, dtype=torch.float64).to(dtype)
    raw = t.view(torch.uint8).numpy().tobytes()
    isz = t.element_size()
    packed = compress("shuffle-zstd", memoryview(raw), isz)
    assert decompress("shuffle-zstd", packed, len(raw), isz) == raw


@pytest.mark.parametrize("itemsize", [2, 4, 8])
def test_shuffle_planes_across_decode_chunks(
    itemsize: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoded chunks that end inside a plane and inside an element (a
    chunk size that is no multiple of the element size) still land in the
    right columns; a length that is no multiple of the element size is
    stored unshuffled and round-trips too."""
    monkeypatch.setattr(compression, "DECODE_CHUNK", 1001)
    rng = np.random.default_rng(itemsize)
    for length in (itemsize * 4099, itemsize * 4099 + 1):
        raw = (rng.standard_normal(length).astype(np.float32) * 0.01).tobytes()[:length]
        packed = compress("shuffle-zstd", memoryview(raw), itemsize)
        assert decompress("shuffle-zstd", packed, length, itemsize) == raw


@pytest.mark.parametrize("dtype", FLOATS)
def test_shuffled_checkpoint_roundtrips_each_float_dtype(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    state = {"w": torch.randn(70001, dtype=torch.float64).to(dtype), "b": torch.randn(3).to(dtype)}
    d = tmp_path / "ck"
    deeppart.save(state, d, writing=deeppart.WriteOptions(compression="shuffle-zstd"))
    assert _codecs(d)["w"] == {"shuffle-zstd"}
    _equal(state, deeppart.load(d))


@pytest.mark.parametrize("how", ["shuffle-zstd", "auto"])
def test_corrupt_shuffled_piece_is_caught(tmp_path: Path, how: str) -> None:
    state = {"w": torch.randn(1 << 17).to(torch.bfloat16).float()}
    d = tmp_path / "ck"
    deeppart.save(
        state,
        d,
        planning=deeppart.PlanOptions(cost=SLOW),
        writing=deeppart.WriteOptions(compression=how),
    )
    meta = json.loads((d / "metadata.json").read_text())
    (row,) = meta["pieces"]
    assert row[7] == "shuffle-zstd" and row[6] < row[5]
    f = d / data_file_name(row[3])
    data = bytearray(f.read_bytes())
    data[row[4] + row[6] // 2] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        deeppart.load(d)
    target = {"w": torch.full_like(state["w"], 7.0)}
    with pytest.raises(CorruptCheckpointError):
        deeppart.load(d, into=target)
    # The caller's tensor is not half-overwritten with undecoded bytes.
    assert torch.equal(target["w"], torch.full_like(state["w"], 7.0))


@pytest.mark.parametrize("which", ["first", "last"])
def test_corrupt_long_raw_piece_is_caught_by_the_background_checksum(
    tmp_path: Path, which: str
) -> None:
    """Raw pieces of 1 MiB and more are checksummed beside the next read:
    a flipped byte in one (the first read, or the last) still fails the load,
    naming that piece's leaf."""
    from deeppart.format import OVERLAP_CHECKSUM_BYTES

    n = OVERLAP_CHECKSUM_BYTES // 4 + 3
    state = {"a": torch.randn(n), "b": torch.randn(n), "c": torch.randn(n)}
    d = tmp_path / "ck"
    deeppart.save(state, d)
    meta = json.loads((d / "metadata.json").read_text())
    rows = sorted(meta["pieces"], key=lambda r: r[4])
    row = rows[0] if which == "first" else rows[-1]
    assert row[7] == "none" and row[5] >= OVERLAP_CHECKSUM_BYTES
    f = d / data_file_name(row[3])
    data = bytearray(f.read_bytes())
    data[row[4] + 5] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=f"piece of leaf {row[0]} .*checksum"):
        deeppart.load(d)
