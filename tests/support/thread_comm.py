"""Ranks as threads of one process, for tests that need several ranks
without ``mpiexec`` (the model-based test's faults on one rank of a save
or a load).

:class:`ThreadComm` implements DeepPart's :class:`deeppart.comm.Comm` over
shared slots and a barrier; it subclasses :class:`SingleComm` only so that
:func:`deeppart.comm.resolve` takes it as it is. :func:`run_ranks` runs one
function per rank, each on its own thread with its own communicator, and
returns what each returned or raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from deeppart.comm import Complete, InFlight, SingleComm

#: How long a rank waits for the others in one collective before the test
#: fails (a hang is a failure, never a stuck test run).
WAIT_S = 60.0


class _Shared:
    """What the ranks of one :class:`ThreadComm` group share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.slots: list[Any] = [None] * size


class ThreadComm(SingleComm):
    """Rank ``rank`` of a group of threads sharing ``shared``."""

    def __init__(self, shared: _Shared, rank: int) -> None:
        self._shared = shared
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._shared.size

    def _exchange(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a collective)."""
        s = self._shared
        s.slots[self._rank] = value
        s.barrier.wait()
        out = list(s.slots)
        s.barrier.wait()
        return out

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if len(data) > width:
            raise ValueError(f"{len(data)} bytes do not fit in {width}")
        return [bytes(d) for d in self._exchange(bytes(data).ljust(width, b"\0"))]

    def allgather_f64(self, values: Any) -> Any:
        rows = self._exchange(np.asarray(values, dtype=np.float64).reshape(-1).copy())
        return np.stack(rows)

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        return [bytes(d) for d in self._exchange(bytes(data))]

    def allreduce_sum_i64(self, values: Any) -> Any:
        rows = self._exchange(np.array(values, dtype=np.int64).reshape(-1))
        return np.sum(np.stack(rows), axis=0, dtype=np.int64)

    def gatherv_u64(self, values: Any, counts: list[int], root: int = 0) -> Any:
        rows = self._exchange(np.ascontiguousarray(values, dtype=np.uint64).copy())
        if self._rank != root:
            return None
        return np.concatenate(rows) if rows else np.zeros(0, dtype=np.uint64)

    def bcast_u8(self, buf: Any, root: int) -> None:
        rows = self._exchange(buf.copy() if self._rank == root else None)
        if self._rank != root:
            buf.reshape(-1)[:] = rows[root].reshape(-1)

    def start_bcast_u8(self, buf: Any, root: int) -> InFlight:
        self.bcast_u8(buf, root)
        return Complete()

    def sendrecv_u8(self, send: Any, dest: int, recv: Any, source: int) -> None:
        rows = self._exchange((dest, send.copy()))
        to, data = rows[source]
        assert to == self._rank, f"rank {source} sends to {to}, not to rank {self._rank}"
        recv.reshape(-1)[:] = data.reshape(-1)

    def barrier(self) -> None:
        self._shared.barrier.wait()


def thread_comms(size: int) -> list[ThreadComm]:
    """The ``size`` ranks of one group."""
    shared = _Shared(size)
    return [ThreadComm(shared, r) for r in range(size)]


def run_ranks(
    fns: list[Callable[[], Any]], *, names: str = "rank"
) -> list[tuple[Any, BaseException | None]]:
    """Runs ``fns[r]`` on thread ``f"{names}-{r}"`` for every rank r, at
    once; each rank's (result, None) or (None, what it raised). A rank
    still running after :data:`WAIT_S` fails the test."""
    out: list[tuple[Any, BaseException | None]] = [(None, None)] * len(fns)

    def body(r: int) -> None:
        try:
            out[r] = (fns[r](), None)
        except BaseException as e:  # a rank's outcome, whatever it is
            out[r] = (None, e)

    threads = [
        threading.Thread(target=body, args=(r,), name=f"{names}-{r}") for r in range(len(fns))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 2)
        assert not t.is_alive(), f"{t.name} hangs"
    return out
