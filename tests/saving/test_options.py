"""The options objects (deeppart.options) reach the code that uses them,
through real saves and loads: WriteOptions' compression is in the bytes
and the metadata, PlanOptions' algorithm and plan are the plan used,
LoadOptions reach the load's read plan and staging; the old keywords still
work with a DeprecationWarning naming the new spelling (at the caller's
line); an old keyword given with its options object, a wrong type, an
unknown keyword and bad values raise clear errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart
from deeppart.errors import AsyncSaveWarning, CodecError, StateMismatchError
from deeppart.loading.reader import plan_reads as real_plan
from deeppart.saving.planning import PlanProvider
from deeppart.saving.prepare import verify_replicas as real_check
from deeppart.state import staging


def _state(n: int = 1 << 16) -> dict[str, Any]:
    # Compressible (zeros and a ramp), and large enough to be split.
    return {"zeros": torch.zeros(n), "ramp": torch.arange(n, dtype=torch.float32), "step": 3}


def _meta(d: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((d / "metadata.json").read_text())
    return meta


def _data(d: Path) -> bytes:
    return (d / "rank-00000.bin").read_bytes()[4096:]  # past the header (the save's id)


def test_write_options_compress_the_pieces(tmp_path: Path) -> None:
    state = _state()
    plain = deeppart.save(state, tmp_path / "plain")
    z = deeppart.save(state, tmp_path / "z", writing=deeppart.WriteOptions(compression="zstd"))
    assert _meta(tmp_path / "z")["compression"] == "zstd" and z.codec == "zstd"
    assert _meta(tmp_path / "plain")["compression"] == "none"
    assert z.stored_bytes < plain.stored_bytes / 2, (z.stored_bytes, plain.stored_bytes)
    assert len(_data(tmp_path / "z")) < len(_data(tmp_path / "plain")) / 2
    back = deeppart.load(tmp_path / "z")
    assert torch.equal(back["ramp"], state["ramp"]) and back["step"] == 3


def test_write_options_compression_level_changes_the_bytes(tmp_path: Path) -> None:
    state = {"ramp": torch.arange(1 << 17, dtype=torch.float32) % 977}
    for level in (1, 19):
        w = deeppart.WriteOptions(compression="zstd", compression_level=level)
        deeppart.save(state, tmp_path / f"l{level}", writing=w)
    fast, small = _data(tmp_path / "l1"), _data(tmp_path / "l19")
    assert fast != small and len(small) <= len(fast)


def test_write_options_staging_and_replica_check_reach_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    budgets: list[int | None] = []
    checked: list[bool] = []
    real_staging = staging.Staging

    def spy_staging(budget: int | None = None) -> staging.Staging:
        budgets.append(budget)
        return real_staging(budget)

    def spy_check(c: Any, prep: Any) -> None:
        checked.append(True)
        real_check(c, prep)

    monkeypatch.setattr("deeppart.state.staging.Staging", spy_staging)
    monkeypatch.setattr("deeppart.saving.save.check_replicas", spy_check)
    w = deeppart.WriteOptions(staging_bytes=1 << 20, verify_replicas=True)
    deeppart.save(_state(), tmp_path / "ck", writing=w)
    assert budgets == [1 << 20] and checked == [True]


def test_plan_options_algorithm_is_the_plan_used(tmp_path: Path) -> None:
    state = _state()
    for algorithm in ("lpt", "greedy"):
        p = deeppart.PlanOptions(algorithm=algorithm)
        deeppart.save(state, tmp_path / algorithm, planning=p)
        assert _meta(tmp_path / algorithm)["algorithm"] == algorithm
    deeppart.save(state, tmp_path / "default")
    assert _meta(tmp_path / "default")["algorithm"] == "balanced"


def test_plan_options_given_plan_is_used_or_refused(tmp_path: Path) -> None:
    state = _state()
    ck = deeppart.Checkpointer(tmp_path / "run", planning=deeppart.PlanOptions(algorithm="lpt"))
    ck.save(1, state).wait()
    made = ck.plans.last
    assert made is not None and made.algorithm == "lpt"
    given = deeppart.PlanOptions(plan=made)
    deeppart.save(state, tmp_path / "given", planning=given)
    assert _meta(tmp_path / "given")["plan_fingerprint"] == made.fingerprint
    with pytest.raises(StateMismatchError, match="given plan was made for another state"):
        deeppart.save({"other": torch.ones(3)}, tmp_path / "other", planning=given)
    assert not (tmp_path / "other").exists()


def test_load_options_reach_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state()
    deeppart.save(state, tmp_path / "ck")
    exchanges: list[str] = []
    budgets: list[int | None] = []
    real_staging = staging.Staging

    def spy_plan(*args: Any, **kwargs: Any) -> Any:
        exchanges.append(kwargs["exchange"])
        return real_plan(*args, **kwargs)

    def spy_staging(budget: int | None = None) -> staging.Staging:
        budgets.append(budget)
        return real_staging(budget)

    monkeypatch.setattr("deeppart.loading.load.plan_reads", spy_plan)
    monkeypatch.setattr("deeppart.state.staging.Staging", spy_staging)
    into = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    loading = deeppart.LoadOptions(exchange="read", staging_bytes=4096)
    deeppart.load(tmp_path / "ck", into=into, loading=loading)
    assert exchanges == ["read"] and budgets == [4096]
    assert torch.equal(into["ramp"], state["ramp"])
    deeppart.load(tmp_path / "ck")
    assert exchanges == ["read", "auto"] and budgets == [4096, None]


def test_checkpointer_takes_the_options(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(
        tmp_path / "run",
        writing=deeppart.WriteOptions(compression="lz4"),
        loading=deeppart.LoadOptions(exchange="read"),
    )
    stats = ck.save(5, _state()).wait()
    assert stats.codec == "lz4" and _meta(ck.path(5))["compression"] == "lz4"
    assert ck.compression == "lz4" and ck.loading.exchange == "read"
    assert ck.load()["step"] == 3


def test_async_options_reach_the_background_save(tmp_path: Path) -> None:
    limit = deeppart.AsyncOptions(max_staging_bytes=1)  # every share is larger
    with pytest.warns(AsyncSaveWarning, match="max_staging_bytes=1"):
        h = deeppart.async_save(_state(), tmp_path / "a", background=limit)
    assert h.synchronous and h.wait().raw_bytes > 0
    ck = deeppart.Checkpointer(tmp_path / "run", async_=limit)
    with pytest.warns(AsyncSaveWarning, match="max_staging_bytes=1"):
        handle = ck.save(1, _state())
    assert isinstance(handle, deeppart.AsyncSave) and handle.synchronous
    ck.close()
    free = deeppart.Checkpointer(tmp_path / "free", async_=deeppart.AsyncOptions())
    h2 = free.save(1, _state())
    assert isinstance(h2, deeppart.AsyncSave) and not h2.synchronous
    free.close()
    assert free.latest() == 1


# ----------------------------------------------------------------------------
# The old keywords, for one release.


def _one_deprecation(record: list[warnings.WarningMessage], new: str) -> None:
    messages = [w for w in record if issubclass(w.category, DeprecationWarning)]
    assert any(new in str(w.message) for w in messages), [str(w.message) for w in messages]
    # Pointing at the caller's line, here.
    assert all(w.filename == __file__ for w in messages), [w.filename for w in messages]


def test_old_save_keywords_warn_and_still_work(tmp_path: Path) -> None:
    state = _state()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        deeppart.save(state, tmp_path / "old", compression="zstd", algorithm="lpt")
    _one_deprecation(record, "writing=deeppart.WriteOptions(compression=...)")
    _one_deprecation(record, "planning=deeppart.PlanOptions(algorithm=...)")
    meta = _meta(tmp_path / "old")
    assert meta["compression"] == "zstd" and meta["algorithm"] == "lpt"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        deeppart.save(state, tmp_path / "prov", plan_provider=PlanProvider(1))
    _one_deprecation(record, "use planning=<the PlanProvider>")
    assert _meta(tmp_path / "prov")["algorithm"] == "balanced"


def test_old_load_keywords_warn_and_still_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deeppart.save(_state(), tmp_path / "ck")
    exchanges: list[str] = []

    def spy_plan(*args: Any, **kwargs: Any) -> Any:
        exchanges.append(kwargs["exchange"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr("deeppart.loading.load.plan_reads", spy_plan)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        back = deeppart.load(tmp_path / "ck", exchange="read", staging_bytes=1 << 20)
    _one_deprecation(record, "loading=deeppart.LoadOptions(exchange=..., staging_bytes=...)")
    assert back["step"] == 3 and exchanges == ["read"]


def test_old_checkpointer_and_async_keywords_warn_and_still_work(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ck = deeppart.Checkpointer(
            tmp_path / "run", compression="lz4", exchange="read", staging_bytes=1 << 20
        )
    _one_deprecation(record, "writing=deeppart.WriteOptions(compression=..., staging_bytes=...)")
    _one_deprecation(record, "loading=deeppart.LoadOptions(exchange=..., staging_bytes=...)")
    assert ck.writing == deeppart.WriteOptions(compression="lz4", staging_bytes=1 << 20)
    assert ck.loading == deeppart.LoadOptions(exchange="read", staging_bytes=1 << 20)
    assert ck.save(1, _state()).wait().codec == "lz4"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        h = deeppart.async_save(_state(), tmp_path / "a", max_staging_bytes=1)
    _one_deprecation(record, "background=deeppart.AsyncOptions(max_staging_bytes=...)")
    assert any(issubclass(w.category, AsyncSaveWarning) for w in record)
    assert h.synchronous and h.wait().raw_bytes > 0
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        ack = deeppart.Checkpointer(tmp_path / "arun", async_=True, max_staging_bytes=1)
    _one_deprecation(record, "async_=deeppart.AsyncOptions(max_staging_bytes=...)")
    with pytest.warns(AsyncSaveWarning):
        assert ack.save(1, _state()).synchronous  # type: ignore[attr-defined]
    ack.close()


def test_old_keyword_with_its_options_object_is_a_type_error(tmp_path: Path) -> None:
    state, d = _state(), tmp_path / "ck"
    with pytest.raises(TypeError, match=r"compression= and writing= both given"):
        deeppart.save(state, d, compression="zstd", writing=deeppart.WriteOptions())
    with pytest.raises(TypeError, match=r"algorithm= and planning= both given"):
        deeppart.save(state, d, algorithm="lpt", planning=deeppart.PlanOptions())
    with pytest.raises(TypeError, match=r"plan_provider= and planning= both given"):
        deeppart.save(state, d, plan_provider=PlanProvider(1), planning=deeppart.PlanOptions())
    with pytest.raises(TypeError, match=r"exchange= and loading= both given"):
        deeppart.load(d, exchange="read", loading=deeppart.LoadOptions())
    with pytest.raises(TypeError, match=r"staging_bytes= and writing= both given"):
        deeppart.Checkpointer(d, staging_bytes=1, writing=deeppart.WriteOptions())
    with pytest.raises(TypeError, match=r"max_staging_bytes= and background= both given"):
        deeppart.async_save(state, d, max_staging_bytes=1, background=deeppart.AsyncOptions())
    with pytest.raises(TypeError, match=r"level= is the old name of compression_level="):
        deeppart.save(state, d, level=3, compression_level=3)
    assert not d.exists()  # nothing was written


def test_wrong_types_and_unknown_keywords(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    with pytest.raises(TypeError, match=r"writing= takes a deeppart\.WriteOptions"):
        deeppart.save(_state(), d, writing=deeppart.PlanOptions())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"planning= takes a deeppart\.PlanOptions"):
        deeppart.save(_state(), d, planning={"algorithm": "lpt"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"loading= takes a deeppart\.LoadOptions"):
        deeppart.load(d, loading="read")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"async_= takes True, False or a deeppart\.AsyncOptions"):
        deeppart.Checkpointer(d, async_="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword argument 'compresion'"):
        deeppart.save(_state(), d, compresion="zstd")
    with pytest.raises(TypeError, match="unexpected keyword argument 'into'"):
        deeppart.Checkpointer(d, into={})
    assert not d.exists()


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: deeppart.WriteOptions(compression="gzip"), CodecError, "unknown compression"),
        (lambda: deeppart.WriteOptions(compression_level=99), ValueError, "compression_level=99"),
        (lambda: deeppart.WriteOptions(compression_level=True), ValueError, "compression_level"),
        (lambda: deeppart.WriteOptions(staging_bytes=0), ValueError, "staging_bytes=0"),
        (lambda: deeppart.WriteOptions(verify_replicas=1), TypeError, "verify_replicas"),  # type: ignore[arg-type]
        (lambda: deeppart.WriteOptions(replica_dims=["dp", 3]), TypeError, "replica_dims"),  # type: ignore[list-item]
        (lambda: deeppart.PlanOptions(algorithm="fastest"), ValueError, "balanced, lpt"),
        (lambda: deeppart.PlanOptions(cost=1.5), TypeError, "deeppart.CostModel"),  # type: ignore[arg-type]
        (lambda: deeppart.PlanOptions(topology=4), TypeError, "deeppart.Topology"),  # type: ignore[arg-type]
        (lambda: deeppart.PlanOptions(plan="p"), TypeError, "deeppart.Plan"),  # type: ignore[arg-type]
        (lambda: deeppart.LoadOptions(exchange="carrier-pigeon"), ValueError, "auto, bcast"),
        (lambda: deeppart.LoadOptions(staging_bytes=-1), ValueError, "staging_bytes=-1"),
        (lambda: deeppart.AsyncOptions(max_staging_bytes=-1), ValueError, "max_staging"),
        (lambda: deeppart.AsyncOptions(snapshot_on_device="no"), TypeError, "snapshot_on"),  # type: ignore[arg-type]
    ],
)
def test_bad_values_are_refused_when_made(make: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        make()


def test_a_given_plan_with_what_to_plan_with_is_refused(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(tmp_path / "run")
    ck.save(1, _state()).wait()
    assert ck.plans.last is not None
    with pytest.raises(ValueError, match="algorithm would be ignored"):
        deeppart.PlanOptions(plan=ck.plans.last, algorithm="lpt")


def test_options_are_frozen_and_replica_dims_normalised() -> None:
    w = deeppart.WriteOptions(replica_dims="dp")
    assert w.replica_dims == ("dp",)
    with pytest.raises(AttributeError):
        w.compression = "zstd"  # type: ignore[misc]
