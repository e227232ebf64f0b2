"""Device <-> host staging in bounded chunks (deeppart.staging), on the CPU.

There is no GPU here, so the tests declare every tensor a "device" tensor
(``needs_staging`` always true): save and load then take exactly the code
path that CUDA tensors take — pieces copied chunk by chunk through one host
buffer of at most ``staging_bytes`` — with CPU tensors standing in for the
device ones. ``_readable`` (the old whole-tensor host copy) must never run
for a staged tensor.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deeppart  # noqa: E402
from deeppart import staging, writer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_checkpoint import assert_bitwise_equal, make_state  # noqa: E402

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
    deeppart.save(state, d, staging_bytes=BUDGET, compression=codec)
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
    deeppart.save(state, d, compression=codec)
    stagings.clear()
    into = make_state(seed=1)
    ptrs = {k: v.data_ptr() for k, v in into["model"].items()}
    out = deeppart.load(d, into=into, staging_bytes=BUDGET)
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
