"""Device <-> host staging in bounded chunks (deeppart.state.staging), on the CPU.

There is no GPU here, so the tests declare every tensor a "device" tensor
(``needs_staging`` always true): save and load then take exactly the code
path that CUDA tensors take — pieces copied chunk by chunk through one host
buffer of at most ``staging_bytes`` — with CPU tensors standing in for the
device ones. ``_readable`` (the old whole-tensor host copy) must never run
for a staged tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from mpi_checkpoint import assert_bitwise_equal, make_state  # noqa: E402

import deeppart  # noqa: E402
from deeppart.options import LoadOptions, WriteOptions  # noqa: E402
from deeppart.saving import writer  # noqa: E402
from deeppart.state import staging  # noqa: E402

BUDGET = 1024


def _record_stagings(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every Staging made, and the largest host buffer each asks for."""
    made: list[Any] = []
    real = staging.Staging

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, budget: int | None = None) -> None:
            super().__init__(budget)
            self.largest_request = 0
            made.append(self)

        def host(self, n: int) -> Any:
            self.largest_request = max(self.largest_request, n)
            return super().host(n)

    monkeypatch.setattr(staging, "Staging", Recording)
    return made


@pytest.fixture
def stagings(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every tensor is staged and never copied whole; the Stagings made."""

    def no_whole_copy(t: Any) -> Any:
        raise AssertionError("a staged tensor was copied whole to the host")

    monkeypatch.setattr(staging, "needs_staging", lambda t: True)
    monkeypatch.setattr(writer, "readable", no_whole_copy)
    return _record_stagings(monkeypatch)


def _largest_piece(d: Path) -> int:
    import json

    meta = json.loads((d / "metadata.json").read_text())
    return int(max(row[5] for row in meta["pieces"]))


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_save_stages_in_bounded_chunks(
    tmp_path: Path, stagings: list[Any], codec: str | None
) -> None:
    state = make_state()
    d = tmp_path / "ck"
    deeppart.save(state, d, writing=WriteOptions(compression=codec, staging_bytes=BUDGET))
    (stage,) = stagings
    assert _largest_piece(d) > 4 * BUDGET, "the test state must have pieces above the budget"
    assert 0 < stage.peak <= BUDGET
    assert stage.largest_request <= BUDGET
    assert stage.copies > len(state["model"]), "large pieces went in several chunks"
    stagings.clear()
    assert_bitwise_equal(state, deeppart.load(d))


@pytest.mark.parametrize("codec", [None, "shuffle-zstd"])
def test_load_into_stages_in_bounded_chunks(
    tmp_path: Path, stagings: list[Any], codec: str | None
) -> None:
    """into= "device" tensors are filled chunk by chunk (raw pieces read
    straight into the host buffer, compressed ones decoded then copied),
    in place: the same tensor objects and storage."""
    state = make_state()
    d = tmp_path / "ck"
    deeppart.save(state, d, writing=WriteOptions(compression=codec))
    stagings.clear()
    into = make_state(seed=1)
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    out = deeppart.load(d, into=into, loading=LoadOptions(staging_bytes=BUDGET))
    (stage,) = stagings
    assert 0 < stage.peak <= BUDGET and stage.largest_request <= BUDGET
    assert stage.copies > len(into["model"])
    for k, v in into["model"].items():
        assert out["model"][k] is v and v.data_ptr() == ptrs[k], k
    assert_bitwise_equal(state, out)


def test_cpu_tensors_are_not_staged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made = _record_stagings(monkeypatch)
    state = make_state()
    deeppart.save(state, tmp_path / "ck")
    deeppart.load(tmp_path / "ck", into=make_state(seed=1))
    assert made and all(s.peak == 0 and s.copies == 0 for s in made)


def test_staging_budget_is_checked() -> None:
    with pytest.raises(ValueError, match="at least 1 byte"):
        staging.Staging(0)
    s = staging.Staging(100)
    with pytest.raises(ValueError, match="exceed the staging budget"):
        s.host(101)
    src = torch.arange(1000, dtype=torch.int32)
    chunks = [c.copy() for c in s.read(staging.device_bytes(src), 8, 4000 - 4)]
    assert [len(c) for c in chunks] == [100] * 39 + [88]
    assert bytes(b"".join(c.tobytes() for c in chunks)) == src.numpy().tobytes()[8:3996]
    assert s.peak == 100


@pytest.mark.parametrize("threads", ["1", "3"])
def test_load_into_device_with_several_readers_verifies_each_piece(
    tmp_path: Path, stagings: list[Any], monkeypatch: pytest.MonkeyPatch, threads: str
) -> None:
    """Raw pieces for device tensors are read by several threads, chunk by
    chunk through slots of the budget, each piece's checksum taken on its
    host copy in order: the load is bitwise, fits the budget, and a byte
    flipped in the middle of the largest piece fails it, naming the piece."""
    import json

    from deeppart.errors import CorruptCheckpointError
    from deeppart.format import data_file_name

    monkeypatch.setenv("DEEPPART_LOAD_THREADS", threads)
    state = make_state()
    d = tmp_path / "ck"
    deeppart.save(state, d)
    stagings.clear()
    out = deeppart.load(d, into=make_state(seed=1), loading=LoadOptions(staging_bytes=BUDGET))
    assert_bitwise_equal(state, out)
    (stage,) = stagings
    assert 0 < stage.peak <= BUDGET
    assert stage.copies > 4 * len(state["model"]), "large pieces went in several chunks"

    meta = json.loads((d / "metadata.json").read_text())
    leaf, _, _, rank, offset, length = max(meta["pieces"], key=lambda row: row[5])[:6]
    assert length > 8 * BUDGET, "the piece spans many slots"
    path = d / data_file_name(rank)
    data = bytearray(path.read_bytes())
    data[offset + length // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
        deeppart.load(d, into=make_state(seed=1), loading=LoadOptions(staging_bytes=BUDGET))
    assert f"{data_file_name(rank)}: piece of leaf {leaf} " in str(info.value)


def test_device_read_order_interleaves_pieces_and_keeps_each_in_order() -> None:
    """The readers take every chunk once; each piece's chunks in order;
    pieces spread over the lanes by bytes, the lanes interleaved."""
    sink = staging.DeviceSink(torch.empty(0, dtype=torch.uint8), 0, 0)
    lengths = [100, 35, 60, 10, 1]
    reads = [staging.DeviceRead(0, n, sink, 0, i) for i, n in enumerate(lengths)]
    order = staging._order(reads, 2, 10)
    chunks = [-(-n // 10) for n in lengths]
    assert sorted(order) == sorted((i, c) for i, n in enumerate(chunks) for c in range(n))
    for i in range(len(reads)):
        mine = [c for j, c in order if j == i]
        assert mine == list(range(chunks[i]))
    # Largest first, each to the lighter lane (100 | 60, 35, 10 | then 1),
    # the two lanes taken in turn.
    assert order[:6] == [(0, 0), (2, 0), (0, 1), (2, 1), (0, 2), (2, 2)]


def test_device_read_of_a_short_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"\1" * 100)
    target = torch.zeros(300, dtype=torch.uint8)
    sink = staging.DeviceSink(target, 0, 300)
    reads = [staging.DeviceRead(0, 300, sink, 0, "piece")]

    def error(key: Any, what: str) -> BaseException:
        return RuntimeError(f"{key}: {what}")

    import os

    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(RuntimeError, match="piece: short read"):
            staging.read_to_device(fd, reads, staging.Staging(64), error, threads=2)
    finally:
        os.close(fd)


def test_device_reads_of_many_shapes_finish_and_verify(tmp_path: Path) -> None:
    """Random pieces (one huge, many tiny), more readers than lanes need,
    few slots: every read finishes (no reader waits forever for a slot
    held by a chunk read ahead), each piece lands where it belongs, and a
    wrong checksum is reported for exactly the piece it belongs to."""
    import os
    import random
    import threading

    import xxhash

    rng = random.Random(5)
    data = rng.randbytes(60_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)

    def error(key: Any, what: str) -> BaseException:
        return RuntimeError(f"{key}: {what}")

    try:
        for trial in range(25):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 12)))
            bounds = list(zip([0, *cuts], [*cuts, len(data)], strict=True))
            target = torch.zeros(len(data), dtype=torch.uint8)
            bad = rng.randrange(len(bounds)) if trial % 5 == 4 else None
            reads = [
                staging.DeviceRead(
                    lo,
                    hi - lo,
                    staging.DeviceSink(target, lo, hi - lo),
                    xxhash.xxh3_64(data[lo:hi]).intdigest() ^ (k == bad),
                    k,
                )
                for k, (lo, hi) in enumerate(bounds)
            ]
            seen: list[int] = []
            outcome: list[BaseException | None] = []

            def load(
                reads: list[Any] = reads, seen: list[int] = seen, outcome: list[Any] = outcome
            ) -> None:
                try:
                    staging.read_to_device(
                        fd,
                        reads,
                        staging.Staging(rng.choice([64, 256, 4096])),
                        error,
                        lambda r: seen.append(r.key),
                        threads=rng.randint(1, 6),
                    )
                    outcome.append(None)
                except RuntimeError as e:
                    outcome.append(e)

            t = threading.Thread(target=load, daemon=True)
            t.start()
            t.join(60)
            assert not t.is_alive(), f"trial {trial}: the readers did not finish"
            (result,) = outcome
            if bad is None:
                assert result is None, result
                assert bytes(target.numpy()) == data
                assert sorted(seen) == list(range(len(bounds)))
            else:
                assert result is not None and str(result) == f"{bad}: checksum mismatch (xxh3_64)"
                assert bad not in seen
    finally:
        os.close(fd)
