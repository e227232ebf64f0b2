"""``Checkpointer.save`` returns one type in every mode, a
:class:`deeppart.SaveHandle`: already done for a synchronous save and a save
through the levels, an :class:`deeppart.AsyncSave` (a SaveHandle) in flight;
``wait()`` gives the save's Stats or raises its error. The Stats attributes
read on a finished handle (what ``save`` returned before) still work for one
release, with a DeprecationWarning naming ``.wait()``."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from mpi_checkpoint import WriterGate, assert_bitwise_equal, make_state  # noqa: E402

import deeppart  # noqa: E402
from deeppart.levels import LevelConfig  # noqa: E402
from deeppart.saving.writer import WriteEvent, fault_hook  # noqa: E402


def level_config(root: Path, **kw: int) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(root / "local"),
            "meta_dir": str(root / "meta"),
            "glbl_dir": str(root / "global"),
            **kw,
        }
    )


def test_a_synchronous_save_returns_a_finished_handle(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(tmp_path / "ck")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new way warns about nothing
        handle = ck.save(7, make_state())
        assert type(handle) is deeppart.SaveHandle
        assert not isinstance(handle, deeppart.AsyncSave)
        assert handle.done() and handle.step == 7
        stats = handle.wait()
    assert isinstance(stats, deeppart.CheckpointStats)
    assert stats.op == "save" and stats.directory == str(ck.path(7))
    assert stats.raw_bytes > 0 and stats.world_size == 1
    # The same Stats every time, and what last_stats recorded.
    assert handle.result() is stats and handle.stats is stats
    assert handle.wait(timeout=0) is stats and handle.exception() is None
    assert deeppart.last_stats("save") is stats
    assert repr(handle) == "<SaveHandle step=7 done>"
    assert_bitwise_equal(make_state(), ck.load(7))


def test_an_asynchronous_save_returns_an_async_save_handle(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(tmp_path / "ck", async_=True)
    with WriterGate() as gate:
        handle = ck.save(3, make_state())
        assert isinstance(handle, deeppart.SaveHandle)
        assert isinstance(handle, deeppart.AsyncSave)
        assert handle.step == 3
        assert gate.started.wait(60), "the writer never started"
        # In flight: not done, no stats yet, and wait() times out.
        in_flight_stats = handle.stats
        assert not handle.done() and in_flight_stats is None
        assert "running" in repr(handle)
        with pytest.raises(TimeoutError, match="still running"):
            handle.wait(timeout=0.01)
        gate.gate.set()
        stats = handle.wait()
    assert handle.done() and handle.stats is stats
    assert stats.op == "save" and stats.directory == str(ck.path(3))
    assert ck.wait() is stats
    ck.close()
    assert ck.steps() == [3]
    # An AsyncSave never answers for its Stats: that was never its API.
    with pytest.raises(AttributeError, match="seconds"):
        _ = handle.seconds  # type: ignore[attr-defined]
    # deeppart.async_save's handle: no Checkpointer step.
    other = deeppart.async_save(make_state(), tmp_path / "plain")
    assert other.step is None and other.wait().op == "save"


def test_a_level_save_returns_a_finished_handle_with_level_stats(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(
        "unused", config=level_config(tmp_path, ckpt_l4=2), backend="builtin"
    )
    try:
        first = ck.save(1, make_state())
        second = ck.save(2, make_state(steps=2))
        for handle, step, level in ((first, 1, 1), (second, 2, 4)):
            assert type(handle) is deeppart.SaveHandle
            assert handle.done() and handle.step == step
            stats = handle.wait()
            # One result type: a LevelSaveStats is a Stats.
            assert isinstance(stats, deeppart.LevelSaveStats)
            assert isinstance(stats, deeppart.CheckpointStats)
            assert (stats.step, stats.level, stats.op) == (step, level, "save")
            assert stats.world_size == 1 and stats.raw_bytes > 0
            # The data file holds the state's bytes and its records.
            assert stats.stored_bytes > stats.raw_bytes
            assert stats.rank_seconds == [stats.seconds] and stats.seconds > 0
            assert {"l1", "commit", "cleanup"} <= set(stats.phases)
            assert stats.directory.startswith(str(tmp_path / "meta"))
            assert handle.stats is stats
        last = second.wait()
        assert isinstance(last, deeppart.LevelSaveStats) and "l4" in last.phases
        assert last.summary().startswith("[deeppart] save ")  # a Stats' summary
        assert ck.latest() == 2
    finally:
        ck.close()


def test_reading_stats_on_a_finished_handle_warns_and_works(tmp_path: Path) -> None:
    # Type checkers refuse these reads (attr-defined): they point at .wait().
    ck = deeppart.Checkpointer(tmp_path / "ck")
    handle = ck.save(1, make_state())
    stats = handle.wait()
    with pytest.warns(DeprecationWarning, match=r"ckpt\.save\(\.\.\.\)\.wait\(\)\.seconds"):
        seconds = handle.seconds  # type: ignore[attr-defined]
    assert seconds == stats.seconds
    with pytest.warns(DeprecationWarning, match=r"\.wait\(\)\.summary"):
        assert handle.summary() == stats.summary()  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"\.wait\(\)\.directory"):
        assert handle.directory == stats.directory  # type: ignore[attr-defined]
    # What neither the handle nor its Stats has: an AttributeError, no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no_such_thing"):
            _ = handle.no_such_thing  # type: ignore[attr-defined]
        assert handle.step == 1  # the handle's own attributes never warn

    # A level save's handle forwards its LevelSaveStats.
    levels = deeppart.Checkpointer(
        "unused", config=level_config(tmp_path / "lv"), backend="builtin"
    )
    try:
        level_handle = levels.save(5, make_state())
        with pytest.warns(DeprecationWarning, match=r"\.wait\(\)\.level"):
            assert level_handle.level == 1  # type: ignore[attr-defined]
        with pytest.warns(DeprecationWarning, match=r"\.wait\(\)\.phases"):
            phases = level_handle.phases  # type: ignore[attr-defined]
        level_stats = level_handle.wait()
        assert isinstance(level_stats, deeppart.LevelSaveStats)
        assert phases == level_stats.phases
    finally:
        levels.close()


def test_a_failed_save_raises_through_wait(tmp_path: Path) -> None:
    failed = threading.Event()

    def broken(_event: WriteEvent) -> None:
        failed.set()
        raise OSError("injected write failure")

    ck = deeppart.Checkpointer(tmp_path / "ck", async_=True)
    with fault_hook("before-write", broken):
        handle = ck.save(1, make_state())
        assert isinstance(handle, deeppart.SaveHandle)
        with pytest.raises(OSError, match="injected"):
            handle.wait()
    assert failed.is_set()
    assert handle.done() and handle.stats is None
    assert isinstance(handle.exception(), OSError)
    assert repr(handle) == "<AsyncSave step=1 failed>"
    with pytest.raises(OSError, match="injected"):  # every time it is asked
        handle.result()
    assert ck.latest() is None
    # Seen through wait(): the next save goes ahead.
    assert ck.save(2, make_state()).wait().op == "save"
    ck.close()
    assert ck.steps() == [2]
