"""Asynchronous save: snapshot this rank's share of the state to host
memory, write it in a background thread while training goes on.

:func:`async_save` (and :class:`deeppart.Checkpointer` with ``async_=True``)

1. waits for this communicator's previous asynchronous save, and raises its
   error if nobody has seen it yet;
2. plans and prepares the save as :func:`deeppart.save` does
   (:func:`deeppart.saving.save.plan_save`, over the caller's communicator);
3. copies only the byte ranges this rank will write into one host buffer
   (:mod:`deeppart.saving.snapshot`: reused by a ``Checkpointer``, sized to the
   share, pinned for CUDA tensors), then agrees with one small collective
   that every rank has its snapshot;
4. returns an :class:`AsyncSave` handle; a background thread writes and
   commits from the snapshot, over a *dedicated* communicator.

The writer's collectives never share a communicator with the training
loop's: with MPI it uses a ``Dup`` of the communicator (made once, cached)
and needs ``MPI_THREAD_MULTIPLE`` (``MPI.Query_thread()``; mpi4py asks for
it by default); with torch.distributed it uses its own process group
(``new_group`` over the same ranks, gloo even under NCCL, made once,
cached). Without a thread
level that allows it, or with a communicator of another kind, or when a
rank's share exceeds ``max_staging_bytes``, the save runs synchronously
instead, after a warning, and the handle returned is already done. See
docs/ASYNC.md.

:class:`AsyncSave` is a :class:`SaveHandle`, the one type
:meth:`deeppart.Checkpointer.save` returns in every mode (a synchronous or
level save's is already done).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import os
import platform
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from deeppart.comm import Comm, TorchDistComm, resolve, writer_comm
from deeppart.errors import AsyncSaveWarning
from deeppart.options import AsyncOptions, PlanOptions, WriteOptions, fold, reject_unknown
from deeppart.progress import Stats
from deeppart.saving.deferred_proof import (
    PendingProof,
    check_unchanged,
    hold,
    prove,
    release,
)
from deeppart.saving.digests import digest_threads
from deeppart.saving.in_flight import add, guard_teardown, settle_pending, take_all
from deeppart.saving.planning import PlanProvider
from deeppart.saving.prepare import Prepared, replan
from deeppart.saving.save import PlannedSave, SaveOptions, plan_save, save_options, take_unproved
from deeppart.saving.snapshot import ShareSnapshot, share_bytes
from deeppart.storage.target import location_name
from deeppart.storage.url import Location, parse_location


class SaveHandle:
    """What :meth:`deeppart.Checkpointer.save` returns, in every mode: the
    handle of one save (the same on every rank).

    ``wait()`` / ``result()`` block until the save is committed and return
    its :class:`Stats` (with ``config=``, a :class:`deeppart.LevelSaveStats`),
    or raise its error (every time they are called); ``done()`` says whether
    it finished; ``stats`` is its Stats once it succeeded (None before, or
    if it failed), without waiting. A synchronous save, and a save through
    the levels, returns a handle that is already done; a save in the
    background (``async_=True``) returns an :class:`AsyncSave`, the handle
    of a save in flight.

    For one release, a finished synchronous or level save's handle also
    answers its Stats' attributes (``ckpt.save(...).seconds``, what
    ``save`` returned before), with a :class:`DeprecationWarning`: use
    ``ckpt.save(...).wait().seconds``.
    """

    def __init__(self, step: int | None = None) -> None:
        #: The step saved (None: a save that is no Checkpointer step, as
        #: :func:`async_save`'s).
        self.step = step
        self._finished = threading.Event()
        self._stats: Stats | None = None
        self._error: BaseException | None = None
        self._seen = False
        #: Whether reading a Stats attribute on the handle gives the Stats'
        #: (deprecated; only handles of saves that returned their Stats).
        self._answers_for_stats = False

    @classmethod
    def finished(cls, step: int | None, stats: Stats) -> SaveHandle:
        """The handle of a save that finished before it was returned."""
        handle = cls(step)
        handle._finish(stats, None)
        handle._answers_for_stats = True
        return handle

    def _finish(self, stats: Stats | None, error: BaseException | None) -> None:
        self._stats, self._error = stats, error
        self._finished.set()

    def done(self) -> bool:
        """Whether the save finished (committed, or failed)."""
        return self._finished.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it succeeded), after waiting for it."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the save of step {self.step} is still running")
        self._seen = True
        return self._error

    def wait(self, timeout: float | None = None) -> Stats:
        """Waits for the save; returns its :class:`Stats` or raises its error."""
        error = self.exception(timeout)
        if error is not None:
            raise error
        assert self._stats is not None
        return self._stats

    def result(self, timeout: float | None = None) -> Stats:
        """:meth:`wait`."""
        return self.wait(timeout)

    @property
    def stats(self) -> Stats | None:
        """The save's :class:`Stats` once it succeeded; None while it runs,
        or if it failed (:meth:`wait` raises its error). Never waits."""
        return self._stats if self.done() else None

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._error else "done"
        return f"<{type(self).__name__} step={self.step} {state}>"

    if not TYPE_CHECKING:  # type checkers point at the new way: .wait()

        def __getattr__(self, name: str) -> Any:
            # Only for attributes the handle lacks: a Stats attribute of a
            # finished synchronous or level save, for one release.
            stats = self.__dict__.get("_stats")
            if (
                name.startswith("_")
                or not self.__dict__.get("_answers_for_stats")
                or not hasattr(stats, name)
            ):
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warnings.warn(
                f"Checkpointer.save returns a SaveHandle: reading .{name} on it is "
                f"deprecated, use ckpt.save(...).wait().{name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(stats, name)


class AsyncSave(SaveHandle):
    """The handle of one asynchronous save in flight (the same on every
    rank): a :class:`SaveHandle`.

    ``wait()`` / ``result()`` block until the save is committed and return
    its :class:`Stats`, or raise its error (every time they are called);
    ``done()`` says whether it finished. An error not yet seen through
    ``wait``, ``result`` or ``exception`` is raised by the next asynchronous
    save on the same communicator (or the ``Checkpointer``'s next save,
    load or close).
    """

    def __init__(self, directory: Location, step: int | None = None) -> None:
        super().__init__(step)
        self.directory = directory
        #: Seconds the main thread spent on the snapshot (the training stall).
        self.snapshot_seconds = 0.0
        #: Whether the save ran synchronously instead (see the warning).
        self.synchronous = False
        #: Bytes this rank copied into its snapshot (its planned share:
        #: tensor pieces, plus the plain values it writes), and the size of
        #: the host buffer holding them; 0 for a synchronous save.
        self.staged_bytes = 0
        self.staging_capacity = 0
        #: Seconds the copies of this rank's share from CUDA devices took on
        #: the device (None: no device copies, or not done yet).
        self.device_copy_seconds: float | None = None
        #: The replica proof of its large shared tensors, taken on the
        #: writer thread (None: none left to it); its ``held_seconds`` are
        #: what optimizer steps waited for it.
        self.proof: PendingProof | None = None
        self._thread: threading.Thread | None = None

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's error (None if it succeeded), after waiting for it."""
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.directory}: the asynchronous save is still running")
        if self._thread is not None:
            self._thread.join()
        self._seen = True
        return self._error

    def join(self) -> None:
        """Waits for the save to finish, leaving its error to whoever asks
        (``wait``, ``exception``, the next save, the report at exit)."""
        self._finished.wait()
        if self._thread is not None:
            self._thread.join()

    def settle(self) -> None:
        """Waits; raises the error only if nobody has seen it yet."""
        seen = self._seen
        error = self.exception()
        if error is not None and not seen:
            raise error


# ----------------------------------------------------------------------------
# Saves in flight (deeppart.saving.in_flight, by the writer's communicator).


def _report_at_exit() -> None:
    """At interpreter exit: waits for every asynchronous save still in
    flight (Python has already joined the writer threads by then; this
    also covers one still running) and prints the error of each that
    failed and whose error nobody has seen (through ``wait``, ``result``,
    ``exception``, the next save, or ``Checkpointer.wait``/``close``) to
    stderr. The exit status stays the script's own: Python lets an exit
    handler change it only by skipping the handlers after it (an MPI
    finalize among them). docs/ASYNC.md."""
    for handle in take_all():
        assert isinstance(handle, AsyncSave)
        seen = handle._seen
        try:
            error = handle.exception()
        except BaseException as e:  # never let one handle hide the others
            error = e
        if error is not None and not seen:
            print(
                f"deeppart: the asynchronous save to {handle.directory} FAILED and was never "
                f"waited for (the script ended without wait() or close()): "
                f"{type(error).__name__}: {error}",
                file=sys.stderr,
                flush=True,
            )


atexit.register(_report_at_exit)


# ----------------------------------------------------------------------------
# Starting a save.


def start(
    c: Comm,
    state: Any,
    directory: Location,
    save_kwargs: SaveOptions,
    background: AsyncOptions,
    *,
    snapshot: ShareSnapshot | None = None,
    after: Callable[[], None] | None = None,
    step: int | None = None,
) -> AsyncSave:
    """Plans the save, snapshots this rank's share of ``state`` and starts
    writing it (collective over ``c``); ``after`` runs once the save is
    committed (on the writer thread). ``background``: see
    :func:`async_save`; ``step``: the handle's step."""
    snapshot_on_device = background.snapshot_on_device
    writer, why = writer_for(c)

    t0 = time.perf_counter()
    snap = snapshot if snapshot is not None else ShareSnapshot()
    take = ShareTaker(c.rank, snap, background, writer is not None, why)

    # Planning and prepare as save() does them, then the snapshot; one
    # agreement: every rank prepared the same save and has its snapshot (or
    # every rank raises), and all take one road.
    planned = plan_save(c, state, directory, local=take, defer_proof=True, **save_kwargs)
    handle = AsyncSave(directory, step)
    handle.snapshot_seconds = time.perf_counter() - t0
    proof = hold_proof(c, planned.prep)
    handle.proof = proof
    with released_on_error(proof):
        return _go(c, planned, handle, proof, snap, take.staged, writer, take.why, after, t0,
                   snapshot_on_device)  # fmt: skip


def _go(
    c: Comm,
    planned: PlannedSave,
    handle: AsyncSave,
    proof: PendingProof | None,
    snap: ShareSnapshot,
    staged: Prepared | None,
    writer: Comm | None,
    why: str | None,
    after: Callable[[], None] | None,
    t0: float,
    on_device: bool,
) -> AsyncSave:
    """The rest of :func:`start` once every rank planned and took its
    snapshot: the synchronous road if any rank must take it, else the
    writer thread (which proves ``proof`` first)."""
    directory = handle.directory
    live = planned.prep
    if planned.flagged:
        snap.discard()
        why = why or "another rank cannot save in the background"
        warnings.warn(
            f"{directory}: saving synchronously: {why}",
            AsyncSaveWarning,
            stacklevel=4,
        )
        handle.synchronous = True
        if proof is not None:
            again = prove_or_replan(c, proof, live, None)
            if again is not None:
                planned = dataclasses.replace(planned, prep=again[0])
        stats = planned.finish(c, t0)
        _after(after, directory)
        handle._finish(stats, None)
        return handle

    assert writer is not None and staged is not None
    # The copies from CUDA devices, queued now that the agreement is past
    # (deeppart.saving.snapshot: the training stream waits for them on the device).
    snap.issue()
    handle.snapshot_seconds = time.perf_counter() - t0
    handle.staged_bytes, handle.staging_capacity = snap.staged_bytes, snap.capacity
    # The writer thread sees the snapshot only, never the live state (but
    # the tensors it proves, which optimizer steps leave alone until then).
    background = dataclasses.replace(planned, prep=staged)
    del planned

    def take_again(prep: Prepared) -> int:
        nonlocal background
        assert proof is not None
        background = dataclasses.replace(
            background, prep=retake_share(snap, prep, c.rank, on_device, proof)
        )
        return 0

    def work() -> Stats:
        # At the loop's priority: its next optimizer step waits for it.
        if proof is not None and prove_or_replan(writer, proof, live, take_again) is not None:
            snap.issue()
        background_priority()
        return background.finish(writer)

    run_writer(c, handle, snap, work, after)
    return handle


def writer_for(c: Comm) -> tuple[Comm | None, str]:
    """The background writer's communicator of ``c``
    (:func:`deeppart.comm.writer_comm`: None and why when there is none),
    once the asynchronous save in flight on ``c`` is settled (its unseen
    error raised); ``torch.distributed.destroy_process_group()`` waits for
    the saves in flight from now on."""
    writer, why = writer_comm(c)
    if isinstance(writer, TorchDistComm):
        guard_teardown()  # destroy_process_group() waits for this save
    settle_pending(c)
    return writer, why


class ShareTaker:
    """The ``local`` step of an asynchronous save's prepare
    (:func:`deeppart.saving.prepare.prepare_save`): this rank's snapshot,
    between preparing and the agreement, into ``snap``; its byte is 1 if
    this rank must save synchronously (no writer, ``can_write`` False;
    or a share over ``background.max_staging_bytes``), and ``why`` says
    why. ``staged``: the snapshot's :class:`Prepared` (None: not taken);
    ``seconds``: the time its copies took (all of them, when a union's
    prepare takes it again)."""

    def __init__(
        self, rank: int, snap: ShareSnapshot, background: AsyncOptions, can_write: bool, why: str
    ) -> None:
        self.rank, self.snap, self.background = rank, snap, background
        self.can_write, self.why = can_write, why
        self.staged: Prepared | None = None
        self.seconds = 0.0

    def __call__(self, prep: Prepared) -> int:
        need = share_bytes(prep, self.rank)
        limit = self.background.max_staging_bytes
        if limit is not None and need > limit:
            self.why = (
                f"this rank's share of the state ({need} tensor bytes) exceeds "
                f"max_staging_bytes={limit}"
            )
            return 1
        if not self.can_write:
            return 1
        on_device = self.background.snapshot_on_device
        t0 = time.perf_counter()
        self.staged = self.snap.take(prep, self.rank, on_device=on_device)
        self.seconds += time.perf_counter() - t0
        return 0


def run_writer(
    c: Comm,
    handle: AsyncSave,
    snap: ShareSnapshot,
    work: Callable[[], Stats],
    after: Callable[[], None] | None = None,
) -> None:
    """Starts ``handle``'s writer thread, the save in flight on ``c``
    (:mod:`deeppart.saving.in_flight`): it runs ``work`` (the save from the
    snapshot ``snap``, over the writer's communicator), then ``after`` once
    committed; ``work``'s error is the handle's, raised by ``wait()`` (on
    every rank, as ``work`` fails on every rank) or the next save."""
    directory = handle.directory

    def run() -> None:
        try:
            stats = work()
        except BaseException as e:  # surfaced by wait() or the next save
            handle._finish(None, e)
            return
        copies = snap.copies
        if copies is not None:
            handle.device_copy_seconds = copies.seconds()
        _after(after, directory)
        handle._finish(stats, None)

    thread = threading.Thread(target=run, name=f"deeppart-save {location_name(directory)}")
    handle._thread = thread
    add(c, handle)
    thread.start()


def hold_proof(c: Comm, live: Prepared) -> PendingProof | None:
    """The replica proof of the large shared tensors that ``live`` left
    unproved (:func:`deeppart.saving.save.take_unproved`), held for the
    writer thread: optimizer steps wait for it from now on
    (:mod:`deeppart.saving.deferred_proof`); None when there is none."""
    unproved = take_unproved(c, live)
    return None if unproved is None else hold(unproved)


@contextlib.contextmanager
def released_on_error(proof: PendingProof | None) -> Iterator[None]:
    """Lets optimizer steps go when the save fails before its writer
    thread took ``proof`` over: they never wait for a proof that will not
    run."""
    try:
        yield
    except BaseException:
        if proof is not None:
            release(proof)
        raise


def retake_share(
    snap: ShareSnapshot, prep: Prepared, rank: int, on_device: bool, proof: PendingProof
) -> Prepared:
    """The snapshot of this rank's share of ``prep`` (the save prepared
    again after its proof found copies that differ), taken while optimizer
    steps still wait; every proved tensor checked unchanged since the call."""
    staged = snap.take(prep, rank, on_device=on_device)
    check_unchanged(proof)
    return staged


def prove_or_replan(
    comm: Comm,
    proof: PendingProof,
    live: Prepared,
    local: Callable[[Prepared], int] | None,
) -> tuple[Prepared, bool] | None:
    """Proves ``proof`` (collective over ``comm``): None when the copies
    agree; else the save prepared again (``deeppart.saving.prepare.replan``,
    with ``local``: the new snapshot), in which each rank's copy is its own.
    Optimizer steps are let go at the end, either way."""
    try:
        proved = prove(comm, proof, threads=digest_threads(comm.size))
        if proved is None:
            return None
        return replan(live, comm, proved, local)
    finally:
        release(proof)


#: The nice value of a writer thread (Linux: per thread; 0-19, higher is
#: lower priority), unless ``DEEPPART_WRITER_NICE`` says otherwise: the
#: scheduler gives the training loop's threads the CPU first, and the writer
#: the time they leave. Measured in issue 35 (docs/ASYNC.md).
WRITER_NICE = 10

#: ioprio_set's system call number, per machine (Linux).
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
#: ioprio_set(IOPRIO_WHO_PROCESS, tid, best-effort class, lowest level 7).
_IOPRIO_WHO_PROCESS, _IOPRIO_BEST_EFFORT_LOWEST = 1, (2 << 13) | 7


def background_priority() -> None:
    """Lowers the calling thread's CPU priority (nice :data:`WRITER_NICE`,
    never raising it) and its I/O priority (best effort, lowest level;
    honoured by the mq-deadline and BFQ I/O schedulers). Linux only;
    elsewhere, or where refused, the thread keeps its priority."""
    nice = int(os.environ.get("DEEPPART_WRITER_NICE", WRITER_NICE))
    if not hasattr(os, "setpriority") or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
    number = _IOPRIO_SET.get(platform.machine())
    if number is not None and nice > 0:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(number, _IOPRIO_WHO_PROCESS, tid, _IOPRIO_BEST_EFFORT_LOWEST)


def _after(after: Callable[[], None] | None, directory: Location) -> None:
    """Runs the post-commit step (rank 0's clean-up of old checkpoints). It
    runs on some ranks only, so a failure is a warning, never the save's
    error: that error would be raised on those ranks alone, by the next
    save, and leave the other ranks in its first collective."""
    if after is None:
        return
    try:
        after()
    except Exception as e:
        msg = f"{directory}: cleaning up after the save: {e}"
        warnings.warn(msg, AsyncSaveWarning, stacklevel=1)


def async_save(
    state: Any,
    directory: str | os.PathLike[str],
    *,
    comm: Any = None,
    overwrite: bool = False,
    user: Any = None,
    progress: bool | None = None,
    verbose: bool = False,
    group: Any = None,
    planning: PlanOptions | PlanProvider | None = None,
    writing: WriteOptions | None = None,
    background: AsyncOptions | None = None,
    **deprecated: Any,
) -> AsyncSave:
    """Saves ``state`` like :func:`deeppart.save` (same keyword arguments),
    but returns as soon as this rank's planned share of the state is copied
    to host memory (from CUDA devices: as soon as the copies are queued on
    DeepPart's side stream; the current stream waits for them on the
    device, not the host); a background thread writes and commits it.
    Collective.

    The state may change right after the call returns: the checkpoint holds
    the snapshot (device work queued after the call runs after the copies;
    :mod:`deeppart.saving.snapshot`, docs/GPU.md). A second ``async_save``
    on the same communicator first waits for this one. ``background``: an
    :class:`deeppart.AsyncOptions` (the most bytes a rank's snapshot may
    hold, else the save runs synchronously with an
    :class:`AsyncSaveWarning`; a snapshot within the device first). The old
    keywords (``max_staging_bytes=``, ``compression=``, ...) work for one
    release, with a DeprecationWarning.
    """
    planning, writing = save_options("deeppart.async_save", planning, writing, deprecated)
    bg = fold("deeppart.async_save", "background", AsyncOptions, background, deprecated)
    reject_unknown("deeppart.async_save()", deprecated)
    options: SaveOptions = {
        "overwrite": overwrite,
        "user": user,
        "progress": progress,
        "verbose": verbose,
        "group": group,
        "planning": planning,
        "writing": writing,
    }
    return start(
        resolve(comm),
        state,
        parse_location(directory),
        options,
        bg,
    )


class AsyncCheckpointer:
    """The asynchronous side of a ``Checkpointer(async_=True)``: one save in
    flight at a time, snapshot buffers reused."""

    def __init__(self, comm: Comm, background: AsyncOptions) -> None:
        self.comm = comm
        self.background = background
        self._snapshot = ShareSnapshot()
        self.pending: AsyncSave | None = None

    def wait(self) -> Stats | None:
        """Waits for the save in flight; raises its error if nobody has seen
        it yet. Returns its Stats (None if none, or it failed)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        pending.settle()
        return pending._stats

    def save(
        self,
        directory: Location,
        state: Any,
        kwargs: SaveOptions,
        after: Callable[[], None] | None = None,
        step: int | None = None,
    ) -> AsyncSave:
        """Waits for the save in flight, then starts saving ``state`` to
        ``directory`` (a path or an ``s3://`` location; ``kwargs``:
        :func:`deeppart.save`'s) as ``step``; ``after`` runs
        once it is committed."""
        self.wait()
        self.pending = start(
            self.comm,
            state,
            directory,
            kwargs,
            self.background,
            snapshot=self._snapshot,
            after=after,
            step=step,
        )
        return self.pending
