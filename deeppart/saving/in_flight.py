"""The asynchronous saves in flight, one per communicator (known by
:func:`deeppart.comm.writer_key`): the next asynchronous save on a
communicator (:mod:`deeppart.async_save`) first settles the one in flight
there, so that its error, if nobody has seen it, is raised by it. (A plain
:func:`deeppart.save` does not: every Checkpointer of one process shares
the single-process communicator, and one must not wait for another's
save.)"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from deeppart.comm import Comm, writer_key

__all__ = ["Pending", "add", "settle_pending", "take_all"]


class Pending(Protocol):
    """What the registry needs of a save in flight."""

    def settle(self) -> None:
        """Waits for it; raises its error only if nobody has seen it yet."""


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
