"""Asynchronous saves in one process (deeppart.async_save and
Checkpointer(async_=True)); the multi-rank runs are in
tests/saving/test_checkpoint_mpi.py (MPI) and tests/base/test_torchdist.py (torchrun).

No assertion depends on timing: the background writer is held at a gate
(an event) inside its write, so "the save is still running" is a fact when
the main thread acts.
"""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mpi_checkpoint import (  # noqa: E402
    WriterGate,
    assert_bitwise_equal,
    host_copy,
    make_state,
)

import deeppart  # noqa: E402

# (deeppart.async_save is the function; the module is imported by name.)
from deeppart.async_save import AsyncSave  # noqa: E402
from deeppart.comm import SingleComm  # noqa: E402
from deeppart.options import AsyncOptions  # noqa: E402
from deeppart.saving.save import plan_save  # noqa: E402
from deeppart.saving.snapshot import ShareSnapshot  # noqa: E402
from deeppart.saving.writer import WriteEvent, fault_hook  # noqa: E402


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model: Any, opt: Any) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def test_training_overlaps_and_the_snapshot_is_written(tmp_path: Path) -> None:
    """async_save returns while the write is held; the main thread then runs
    optimizer steps (changing parameters, optimizer moments and the step
    count in place) before the writer may go on; the checkpoint holds the
    state as it was at the call."""
    model, opt = _model()
    _step(model, opt)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "note": {"lr": 0.01}}
    expected = host_copy(state)
    with WriterGate() as gate:
        handle = deeppart.async_save(state, tmp_path / "ck")
        assert gate.started.wait(60)
        assert not handle.done()
        for _ in range(3):
            _step(model, opt)
        state["note"]["lr"] = 0.5  # plain values are snapshotted too
        gate.gate.set()
        stats = handle.wait()
    assert handle.done() and stats.raw_bytes > 0 and not handle.synchronous
    assert handle.result() is stats
    assert not torch.equal(model.state_dict()["0.weight"], expected["model"]["0.weight"])
    assert_bitwise_equal(expected, deeppart.load(tmp_path / "ck"))


def _broken(failed: threading.Event) -> Callable[[WriteEvent], None]:
    """A fault hook: the write raises, and ``failed`` is set."""

    def broken(_event: WriteEvent) -> None:
        failed.set()
        raise OSError("injected write failure")

    return broken


def test_write_error_surfaces_on_wait(tmp_path: Path) -> None:
    failed = threading.Event()
    cp = deeppart.Checkpointer(tmp_path, async_=True)
    with fault_hook("before-write", _broken(failed)):
        handle = cp.save(1, make_state())
        assert isinstance(handle, deeppart.AsyncSave)
        with pytest.raises(OSError, match="injected"):
            handle.wait()
        with pytest.raises(OSError, match="injected"):  # every time it is asked
            handle.result()
    assert failed.is_set() and cp.latest() is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    # Seen through wait(): the next save goes ahead.
    cp.save(2, make_state())
    cp.close()
    assert cp.steps() == [2]


def test_unseen_write_error_surfaces_on_the_next_save(tmp_path: Path) -> None:
    failed = threading.Event()
    cp = deeppart.Checkpointer(tmp_path, async_=True)
    with fault_hook("before-write", _broken(failed)):
        cp.save(1, make_state())
        assert failed.wait(60)
    with pytest.raises(OSError, match="injected"):
        cp.save(2, make_state())  # raised before step 2 is snapshotted
    assert cp.latest() is None
    cp.save(3, make_state())  # the error was reported once
    assert_bitwise_equal(make_state(), cp.load())  # load waits for step 3
    assert cp.steps() == [3]


def test_unseen_error_of_async_save_surfaces_on_the_next_one(tmp_path: Path) -> None:
    failed = threading.Event()
    with fault_hook("before-write", _broken(failed)):
        deeppart.async_save(make_state(), tmp_path / "a")
        assert failed.wait(60)
    with pytest.raises(OSError, match="injected"):
        deeppart.async_save(make_state(), tmp_path / "b")
    deeppart.async_save(make_state(), tmp_path / "c").wait()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert (tmp_path / "c" / "COMMITTED").exists()


def test_a_later_save_waits_for_the_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Save 1's writer is held; save 2 (on the main thread) must wait for it:
    the gate opens only once save 2 is waiting, and save 2's write starts
    only after step 1 is committed."""
    events: list[str] = []
    real_exception = AsyncSave.exception

    def exception(self: AsyncSave, timeout: float | None = None) -> BaseException | None:
        if not self.done() and not waiting.is_set():  # the first wait: save 2's
            events.append("save 2 waits")
            waiting.set()
        return real_exception(self, timeout)

    monkeypatch.setattr(AsyncSave, "exception", exception)
    waiting = threading.Event()
    cp = deeppart.Checkpointer(tmp_path, async_=True, keep_last=5)
    with WriterGate() as gate:
        first = cp.save(1, make_state())
        assert gate.started.wait(60)
        events.append("save 1 held")

        def opener() -> None:
            if waiting.wait(60):
                events.append("gate opens")
                gate.gate.set()

        helper = threading.Thread(target=opener)
        helper.start()

        def record(event: WriteEvent) -> None:
            step = 2 if "step-00000002" in event.path.parent.name else 1
            committed = (cp.path(1) / "COMMITTED").exists()
            events.append(f"write {step}, step 1 committed: {committed}")

        gate.on_write = record
        second = cp.save(2, make_state(steps=3))
        helper.join()
        assert isinstance(second, deeppart.AsyncSave)
        second.wait()  # inside: the hook records its write too
    assert isinstance(first, AsyncSave) and first.done()
    assert events[:5] == [
        "save 1 held",
        "save 2 waits",
        "gate opens",
        "write 1, step 1 committed: False",
        "write 2, step 1 committed: True",
    ], events
    assert cp.steps() == [1, 2]
    assert_bitwise_equal(make_state(steps=3), cp.load(2))


def test_over_budget_saves_synchronously_with_a_warning(tmp_path: Path) -> None:
    state = make_state()
    with pytest.warns(deeppart.AsyncSaveWarning, match="max_staging_bytes=1000"):
        handle = deeppart.async_save(
            state, tmp_path / "ck", background=AsyncOptions(max_staging_bytes=1000)
        )
    assert handle.done() and handle.synchronous
    assert_bitwise_equal(state, deeppart.load(tmp_path / "ck"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        big = deeppart.async_save(
            state, tmp_path / "ck2", background=AsyncOptions(max_staging_bytes=1 << 30)
        )
        big.wait()
    assert not big.synchronous


def test_snapshot_buffer_is_reused_and_holds_the_share(tmp_path: Path) -> None:
    """One process writes every piece: the snapshot's buffer holds the
    state's tensor bytes (no more than alignment), is reused from one take
    to the next, and the writer writes from it (the live state changed)."""
    snap = ShareSnapshot()
    state = make_state()
    planned = plan_save(SingleComm(), state, tmp_path / "ck")
    tensor_bytes = sum(
        lf.tensor.numel() * lf.tensor.element_size()
        for lf in planned.prep.leaves
        if lf.tensor is not None
    )
    first = snap.take(planned.prep, 0)
    second = snap.take(planned.prep, 0)
    assert first.staged is not None and second.staged is not None

    def address(piece: Any) -> int:
        return int(np.frombuffer(piece.data, dtype=np.uint8).ctypes.data)

    assert address(first.staged[0]) == address(second.staged[0])  # the same host buffer
    live = planned.prep.leaves[planned.prep.plan.rank_pieces(0)[0][0]].tensor
    assert live is not None and address(first.staged[0]) != live.data_ptr()
    assert snap.staged_bytes == planned.prep.plan.rank_bytes()[0]
    assert tensor_bytes <= snap.capacity < tensor_bytes + 64 * len(first.staged)
    assert all(lf.tensor is None and lf.encoded is None for lf in second.leaves)
    expected = host_copy(state)
    for v in state["model"].values():
        if v.is_floating_point():
            v.add_(1.0)
    planned.prep = second
    planned.finish(SingleComm())
    assert_bitwise_equal(expected, deeppart.load(tmp_path / "ck"))


def test_a_failed_snapshot_raises_at_the_call_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot runs inside the call's one agreement: its failure is
    raised by async_save itself, no thread starts, nothing is written, and
    the next save goes ahead."""

    def broken(self: ShareSnapshot, prep: Any, rank: int, on_device: bool = False) -> Any:
        raise MemoryError("injected: no host memory for the snapshot")

    with monkeypatch.context() as m:
        m.setattr(ShareSnapshot, "take", broken)
        with pytest.raises(MemoryError, match="injected"):
            deeppart.async_save(make_state(), tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []
    deeppart.async_save(make_state(), tmp_path / "ck").wait()
    assert_bitwise_equal(make_state(), deeppart.load(tmp_path / "ck"))


def test_the_snapshot_copies_every_kind_of_cpu_tensor(tmp_path: Path) -> None:
    """The snapshot's CPU copy (a streaming copy of each piece's bytes, copy_into) holds
    the values as of the call for tensors numpy has no dtype for
    (bfloat16), non-contiguous views, parameters that require grad,
    0-dim and empty tensors: all overwritten right after the call."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(6, 5, generator=gen)
    state = {
        "bf16": torch.randn(7, 3, generator=gen).to(torch.bfloat16),
        "transposed": base.t(),
        "param": torch.nn.Parameter(torch.randn(4, 4, generator=gen)),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "ints": torch.arange(10, dtype=torch.int16),
    }
    expected = host_copy(state)
    handle = deeppart.async_save(state, tmp_path / "ck")
    with torch.no_grad():
        for t in state.values():
            t.fill_(-1)
    handle.wait()
    assert not handle.synchronous
    assert handle.staged_bytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert_bitwise_equal(expected, deeppart.load(tmp_path / "ck"))


def test_write_hashed_writes_the_bytes_and_returns_their_checksum(tmp_path: Path) -> None:
    """deeppart._planner.write_hashed (the asynchronous writer's raw pieces):
    the bytes land at the offset, the return value is the format's xxh3_64,
    with and without write-back pacing; an I/O error is an OSError."""
    from deeppart._planner import write_hashed, xxh3_64
    from deeppart.format import checksum

    data = np.random.default_rng(5).integers(0, 256, size=3_000_017, dtype=np.uint8)
    for pace in (False, True):
        path = tmp_path / f"f-{pace}"
        with open(path, "wb") as f:
            f.write(b"head")
            f.flush()
            got = write_hashed(f.fileno(), 100, data.data, 1 << 20, pace)
        back = path.read_bytes()
        assert got == checksum(data.data) == xxh3_64(data.data)
        assert back[:4] == b"head" and back[4:100] == bytes(96) and back[100:] == data.tobytes()
    with open(tmp_path / "f-False", "rb") as f, pytest.raises(OSError):
        write_hashed(f.fileno(), 0, b"x", 1, False)  # opened read-only


def test_the_writer_thread_runs_at_a_lower_priority(tmp_path: Path) -> None:
    """The background writer lowers its own thread's CPU priority
    (deeppart.async_save.WRITER_NICE) and leaves the caller's alone."""
    import os

    from deeppart.async_save import WRITER_NICE

    if not hasattr(os, "getpriority") or sys.platform != "linux":
        pytest.skip("per-thread nice values are Linux's")
    seen: list[int] = []

    def record(_event: WriteEvent) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with fault_hook("before-write", record):
        deeppart.async_save(make_state(), tmp_path / "ck").wait()
    assert seen == [max(mine, WRITER_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine
    assert_bitwise_equal(make_state(), deeppart.load(tmp_path / "ck"))
