"""The asynchronous saves in flight, one per communicator (known by
:func:`deeppart.comm.writer_key`): the next asynchronous save on a
communicator (:mod:`deeppart.async_save`) first settles the one in flight
there, so that its error, if nobody has seen it, is raised by it. (A plain
:func:`deeppart.save` does not: every Checkpointer of one process shares
the single-process communicator, and one must not wait for another's
save.)

A job's teardown waits for them too (:func:`guard_teardown`): a save in
flight writes through its own process group, which
``torch.distributed.destroy_process_group()`` would otherwise destroy under
the writer thread, losing the save (and at times aborting the process)."""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any, Protocol

from deeppart.comm import Comm, destroyed_with, release_writers, writer_key
from deeppart.errors import AsyncSaveWarning

__all__ = ["Pending", "add", "guard_teardown", "settle_pending", "take_all"]


class Pending(Protocol):
    """What the registry needs of a save in flight."""

    def settle(self) -> None:
        """Waits for it; raises its error only if nobody has seen it yet."""

    def join(self) -> None:
        """Waits for it, leaving its error to whoever asks for it."""


_IN_FLIGHT: dict[Any, Pending] = {}
_LOCK = threading.Lock()


def add(c: Comm, handle: Pending) -> None:
    """Records ``handle`` as the save in flight on ``c``."""
    with _LOCK:
        _IN_FLIGHT[writer_key(c)] = handle


def settle_pending(c: Comm) -> None:
    """Waits for the save in flight on ``c`` (if any) and raises its error
    if nobody has seen it yet."""
    with _LOCK:
        prev = _IN_FLIGHT.pop(writer_key(c), None)
    if prev is not None:
        prev.settle()


def take_all() -> list[Pending]:
    """Every save in flight, forgotten here (at interpreter exit)."""
    with _LOCK:
        handles = list(_IN_FLIGHT.values())
        _IN_FLIGHT.clear()
    return handles


# ----------------------------------------------------------------------------
# The job's teardown: torch.distributed.destroy_process_group.

_GUARDED = False


def guard_teardown() -> None:
    """Makes ``torch.distributed.destroy_process_group`` (once per process,
    before the first save in flight on a torch.distributed communicator)
    first wait for DeepPart's saves in flight on the groups it destroys
    (all of them when it destroys the default group), leaving each save's
    error to its handle, ``Checkpointer.wait``/``close`` or the report at
    exit, and then free DeepPart's writer groups of those communicators;
    then it destroys what it was asked to, as before."""
    global _GUARDED
    with _LOCK:
        if _GUARDED:
            return
        _GUARDED = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        before_teardown(group)
        original(group)

    c10d.destroy_process_group = destroy_process_group
    if dist.destroy_process_group is original:
        dist.destroy_process_group = destroy_process_group


def before_teardown(group: Any) -> None:
    """Waits for the saves in flight whose communicator ``group`` is (any
    torch.distributed one when ``group`` is None or the default group) and
    frees DeepPart's writer groups of those communicators. Never raises an
    Exception: the teardown goes on (with a warning)."""
    hit = destroyed_with(group)
    with _LOCK:
        handles = [h for k, h in _IN_FLIGHT.items() if hit(k)]
    try:
        for handle in handles:
            handle.join()
        release_writers(hit)
    except Exception as e:
        warnings.warn(
            f"settling DeepPart's saves in flight before destroy_process_group: {e}",
            AsyncSaveWarning,
            stacklevel=3,
        )
