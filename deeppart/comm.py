"""The few collectives a checkpoint needs, over mpi4py, torch.distributed
or a single process.

Everything here moves raw ``numpy.uint8`` / ``float64`` / ``uint64``
buffers, with mpi4py's upper-case (buffer) methods or torch.distributed's
tensor collectives: nothing is pickled. Messages larger than
:data:`MAX_MESSAGE` bytes are sent in chunks, so no count overflows MPI's
32-bit ``int``. :func:`resolve` picks the communicator (its docstring gives
the precedence between MPI and torch.distributed).

With no MPI (mpi4py absent or not initialised, and not started by
``mpiexec``) a :class:`SingleComm` stands in: rank 0 of 1, every collective
a local copy.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

#: Largest single MPI message, in bytes (well under 2 GiB).
MAX_MESSAGE = 1 << 30

#: Longest wait for a torch.distributed backend to drop a finished
#: collective's tensors (:meth:`TorchDistComm._settle`), in seconds.
_SETTLE_S = 2.0

#: First MPI tag of :meth:`MPIComm.sendrecv_u8`'s chunks.
_TAG = 7100

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class InFlight(Protocol):
    """A collective started by :meth:`Comm.start_bcast_u8`."""

    def done(self) -> bool:
        """Whether it is complete. Calling it also moves the communicator's
        transfers on (MPI progresses only inside its calls)."""
        ...

    def wait(self) -> None:
        """Returns once it is complete."""
        ...


class Complete:
    """An :class:`InFlight` that completed when it was started."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class Comm(Protocol):
    """What DeepPart needs from a communicator."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        """Every rank's ``data`` (each at most ``width`` bytes, padded with zeros)."""
        ...

    def allgather_f64(self, values: F64) -> F64:
        """Rows: one per rank, of every rank's equal-length ``values``."""
        ...

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, of any length (two collectives)."""
        ...

    def allreduce_sum_i64(self, values: I64) -> I64:
        """The element-wise sum over the ranks of every rank's equal-length
        int64 ``values`` (one collective of a fixed size: what a rank
        receives does not grow with the ranks)."""
        ...

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        """Rank ``root`` gets the concatenation of every rank's ``values``
        (``counts[r]`` elements from rank r); other ranks get None."""
        ...

    def bcast_u8(self, buf: U8, root: int) -> None:
        """Broadcasts ``buf`` (a contiguous uint8 array, the same length on
        every rank) in place from ``root``, in chunks."""
        ...

    def start_bcast_u8(self, buf: U8, root: int) -> InFlight:
        """Starts broadcasting ``buf`` as :meth:`bcast_u8` does, without
        waiting for it: every rank starts its broadcasts in the same order,
        and ``buf`` is neither read (on ``root``) nor used otherwise until
        the returned :class:`InFlight` is complete."""
        ...

    def sendrecv_u8(self, send: U8, dest: int, recv: U8, source: int) -> None:
        """Sends ``send`` to rank ``dest`` while receiving ``recv`` (whose
        length the caller knows) from rank ``source``, in chunks; both
        contiguous uint8. Every rank of a ring calls it at once, so no
        ordering deadlocks. ``dest``/``source`` may be this rank (a copy)."""
        ...

    def barrier(self) -> None: ...


def _chunks(buf: U8, what: str) -> Iterator[U8]:
    """``buf`` (checked: a contiguous uint8 array) flat, in chunks of at
    most :data:`MAX_MESSAGE` bytes."""
    if not buf.flags.c_contiguous or buf.dtype != np.uint8:
        raise ValueError(f"{what} needs a contiguous uint8 array")
    flat = buf.reshape(-1)
    for start in range(0, flat.size, MAX_MESSAGE):
        yield flat[start : start + MAX_MESSAGE]


class SingleComm:
    """One process, no MPI."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if len(data) > width:
            raise ValueError(f"{len(data)} bytes do not fit in {width}")
        return [data.ljust(width, b"\0")]

    def allgather_f64(self, values: F64) -> F64:
        return np.asarray(values, dtype=np.float64).reshape(1, -1).copy()

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def allreduce_sum_i64(self, values: I64) -> I64:
        return np.array(values, dtype=np.int64).reshape(-1)

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        return np.ascontiguousarray(values, dtype=np.uint64).copy()

    def bcast_u8(self, buf: U8, root: int) -> None:
        return None

    def start_bcast_u8(self, buf: U8, root: int) -> InFlight:
        return Complete()

    def sendrecv_u8(self, send: U8, dest: int, recv: U8, source: int) -> None:
        if dest != 0 or source != 0:
            raise ValueError("a single process has only rank 0")
        if send.size != recv.size:
            raise ValueError("sendrecv_u8 to self needs equal lengths")
        recv.reshape(-1)[:] = send.reshape(-1)

    def barrier(self) -> None:
        return None


class _Ranked:
    """``rank`` and ``size``, read-only, of a communicator that knows them."""

    _rank: int
    _size: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size


#: How long a rank polls a pending agreement, yielding its core between
#: polls (to any rank that is runnable on it), before it sleeps between
#: polls. A sleep lasts longer than asked (the kernel's timer slack): with
#: more ranks than cores, an agreement that all ranks reach together took
#: 1.1 ms when the ranks slept between polls after 50 us, 0.14 ms when they
#: yield (4 ranks on 2 cores).
WAIT_SPIN_S = 1e-3
#: Its first sleep between two polls after that; each next one is twice as
#: long, up to :data:`WAIT_SLEEP_MAX_S`.
WAIT_SLEEP_S = 25e-6
WAIT_SLEEP_MAX_S = 200e-6

#: ``os.sched_yield`` where the platform has it.
_sched_yield = getattr(os, "sched_yield", lambda: None)


def _wait_yielding(req: Any, spin_s: float = WAIT_SPIN_S, most_s: float = WAIT_SLEEP_MAX_S) -> None:
    """Waits for the MPI request ``req``: polls it for ``spin_s``, yielding
    the core between polls (``sched_yield``: a runnable rank on this core
    runs first), then sleeps between polls (:data:`WAIT_SLEEP_S`, doubling
    up to ``most_s``). MPI's own wait spins, and a rank that waits for
    slower ones (an agreement after a stage that takes longer on some
    ranks) holds a core; with more ranks than cores on a host, that core is
    one the slower ranks need. The yields and then the sleeps hand it to
    them, at the cost of at most one sleep's delay once the others arrive."""
    if req.Test():
        return
    spin_until = time.perf_counter() + spin_s
    nap = WAIT_SLEEP_S
    while not req.Test():
        if time.perf_counter() < spin_until:
            _sched_yield()
        else:
            time.sleep(nap)
            nap = min(2 * nap, most_s)


class MPIComm(_Ranked):
    """An mpi4py communicator, used only through buffer collectives."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self._rank: int = comm.Get_rank()
        self._size: int = comm.Get_size()

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Runs the blocking collective ``name`` (an mpi4py method)."""
        getattr(self.comm, name)(*args, **kwargs)

    def _yielding(self, name: str, *args: Any, **kwargs: Any) -> None:
        """Runs the collective ``name`` non-blocking and waits for it with
        :func:`_wait_yielding` (the agreements: a rank that waits there
        for slower ones leaves them the core)."""
        _wait_yielding(getattr(self.comm, "I" + name.lower())(*args, **kwargs))

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if len(data) > width:
            raise ValueError(f"{len(data)} bytes do not fit in {width}")
        send = np.zeros(width, dtype=np.uint8)
        send[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        recv = np.empty(width * self._size, dtype=np.uint8)
        self._yielding("Allgather", [send, self._MPI.BYTE], [recv, self._MPI.BYTE])
        return [recv[r * width : (r + 1) * width].tobytes() for r in range(self._size)]

    def allgather_f64(self, values: F64) -> F64:
        send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        recv = np.empty((self._size, send.size), dtype=np.float64)
        self._collective("Allgather", [send, self._MPI.DOUBLE], [recv, self._MPI.DOUBLE])
        return recv

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        lengths = self.allgather_f64(np.array([len(data)], dtype=np.float64))[:, 0]
        counts = [int(n) for n in lengths]  # small: error messages
        displs = [sum(counts[:r]) for r in range(self._size)]
        recv = np.empty(max(1, sum(counts)), dtype=np.uint8)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
        self._collective(
            "Allgatherv", [send, self._MPI.BYTE], [recv, counts, displs, self._MPI.BYTE]
        )
        return [recv[displs[r] : displs[r] + counts[r]].tobytes() for r in range(self._size)]

    def allreduce_sum_i64(self, values: I64) -> I64:
        send = np.array(values, dtype=np.int64).reshape(-1)
        recv = np.empty_like(send)
        mpi = self._MPI
        self._yielding("Allreduce", [send, mpi.INT64_T], [recv, mpi.INT64_T], op=mpi.SUM)
        return recv

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        send = np.ascontiguousarray(values, dtype=np.uint64)
        if send.size != counts[self._rank]:
            raise ValueError("gatherv_u64: local count differs from counts[rank]")
        if max(counts, default=0) * 8 > MAX_MESSAGE:
            raise ValueError("gatherv_u64 is for index records, not bulk data")
        if self._rank == root:
            displs = [sum(counts[:r]) for r in range(self._size)]
            recv = np.empty(max(1, sum(counts)), dtype=np.uint64)
            self._collective(
                "Gatherv",
                [send, self._MPI.UINT64_T],
                [recv, counts, displs, self._MPI.UINT64_T],
                root=root,
            )
            return recv[: sum(counts)]
        self._collective("Gatherv", [send, self._MPI.UINT64_T], None, root=root)
        return None

    def bcast_u8(self, buf: U8, root: int) -> None:
        for chunk in _chunks(buf, "bcast_u8"):
            self._collective("Bcast", [chunk, self._MPI.BYTE], root=root)

    def start_bcast_u8(self, buf: U8, root: int) -> InFlight:
        # Non-blocking broadcasts, matched in the order they are started:
        # with more ranks than cores, one blocking Bcast after another was
        # measured 2x slower than the same messages in flight together.
        reqs = [
            self.comm.Ibcast([chunk, self._MPI.BYTE], root=root)
            for chunk in _chunks(buf, "bcast_u8")
        ]
        return _MPIInFlight(self._MPI, reqs)

    def sendrecv_u8(self, send: U8, dest: int, recv: U8, source: int) -> None:
        for buf in (send, recv):
            if not buf.flags.c_contiguous or buf.dtype != np.uint8:
                raise ValueError("sendrecv_u8 needs contiguous uint8 arrays")
        out, into = send.reshape(-1), recv.reshape(-1)
        # Chunk counts follow each side's own length; a receiver's length
        # equals its sender's, so the chunks (tagged by index) match.
        reqs = []
        for k, start in enumerate(range(0, into.size, MAX_MESSAGE)):
            chunk = into[start : start + MAX_MESSAGE]
            reqs.append(self.comm.Irecv([chunk, self._MPI.BYTE], source=source, tag=_TAG + k))
        for k, start in enumerate(range(0, out.size, MAX_MESSAGE)):
            chunk = out[start : start + MAX_MESSAGE]
            reqs.append(self.comm.Isend([chunk, self._MPI.BYTE], dest=dest, tag=_TAG + k))
        self._MPI.Request.Waitall(reqs)

    def barrier(self) -> None:
        self._collective("Barrier")


#: The longest sleep between two tests of a background writer's collective
#: (:class:`SleepingMPIComm`), in seconds.
MAX_POLL_SLEEP = 1e-3


class _MPIInFlight:
    """MPI requests of one broadcast."""

    def __init__(self, mpi: Any, reqs: list[Any]) -> None:
        self._MPI, self.reqs = mpi, reqs

    def done(self) -> bool:
        ok: bool = self._MPI.Request.Testall(self.reqs)
        return ok

    def wait(self) -> None:
        # Yielding, not MPI's spinning wait: on a host with more ranks than
        # cores, the rank still reading needs the core.
        for req in self.reqs:
            _wait_yielding(req)


class SleepingMPIComm(MPIComm):
    """The communicator of an asynchronous save's writer thread: every
    collective is started non-blocking and tested between sleeps (from
    :data:`WAIT_SLEEP_S`, doubling up to :data:`MAX_POLL_SLEEP`), instead
    of waiting in MPI.

    MPICH's blocking wait polls its progress engine on a CPU: a writer
    whose rank finished its data file before the others (or every rank
    but 0 while rank 0 commits) used to spin a core for as long as the
    slowest rank's write and fsync took, on the cores the training loop
    runs on (issue 35; ``bench/async.py``'s ``cpu s``). A sleeping test
    costs at most :data:`MAX_POLL_SLEEP` of latency per collective, and
    the writer's few collectives are not in the training loop's stall.
    """

    def _collective(self, name: str, *args: Any, **kwargs: Any) -> None:
        request = getattr(self.comm, "I" + name.lower())(*args, **kwargs)
        _wait_yielding(request, spin_s=0.0, most_s=MAX_POLL_SLEEP)

    _yielding = _collective


class TorchDistComm(_Ranked):
    """A ``torch.distributed`` process group (gloo, NCCL, ...), used only
    through tensor collectives (never the ``*_object`` ones: nothing is
    pickled). Messages go in chunks of at most :data:`MAX_MESSAGE` bytes.

    NCCL moves only CUDA tensors: with an NCCL group every message is staged
    through a CUDA tensor on ``torch.cuda.current_device()`` (one chunk at a
    time); with gloo (CPU) the collectives work on the numpy buffers' memory
    directly.
    """

    def __init__(self, group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistComm needs an initialised torch.distributed "
                "(torch.distributed.init_process_group)"
            )
        self._torch = torch
        self._dist = dist
        self.group = group
        self._rank: int = dist.get_rank(group)
        self._size: int = dist.get_world_size(group)
        backend = str(dist.get_backend(group)).lower()
        self.backend = backend
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else torch.device("cpu")
        )

    def _global(self, rank: int) -> int:
        """The default group's rank of this group's ``rank``."""
        if self.group is None:
            return rank
        got: int = self._dist.get_global_rank(self.group, rank)
        return got

    def _dev(self, arr: npt.NDArray[Any]) -> Any:
        """``arr`` as a tensor on the collective device (shares memory on the CPU)."""
        t = self._torch.from_numpy(arr)
        return t if self._device.type == "cpu" else t.to(self._device)

    def _settle(self, tensors: Iterable[Any]) -> None:
        """Waits until the backend's threads have dropped their references to
        ``tensors`` (a finished collective's), so that this thread drops the
        last one, with the GIL. A gloo worker keeps a finished work, and its
        tensors, for a moment after ``wait()`` returns (one collective in
        20 here); when it drops them last it takes the GIL to free their
        Python objects, and after the interpreter began its exit that ends
        the worker thread inside C++ and aborts the process ("terminate
        called without an active exception", after the job finished). CPU
        (gloo) only; microseconds when it waits at all; bounded."""
        if self._device.type != "cpu":
            return
        deadline = None
        for t in tensors:
            while t._use_count() > 1:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + _SETTLE_S
                elif now > deadline:
                    return  # a backend that keeps them longer: as before
                time.sleep(0)

    def _back(self, t: Any, arr: npt.NDArray[Any]) -> None:
        """Copies device tensor ``t`` back into ``arr`` (no-op on the CPU)."""
        if self._device.type != "cpu":
            self._torch.from_numpy(arr).copy_(t.cpu())

    def _allgather(self, send: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """Rows: every rank's equal-length 1-D ``send`` (small messages)."""
        recv = np.empty((self._size, send.size), dtype=send.dtype)
        if send.size == 0:
            return recv
        out = [self._dev(recv[r]) for r in range(self._size)]
        mine = self._dev(send)
        self._dist.all_gather(out, mine, group=self.group)
        self._settle([mine, *out])
        for r in range(self._size):
            self._back(out[r], recv[r])
        return recv

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if len(data) > width:
            raise ValueError(f"{len(data)} bytes do not fit in {width}")
        send = np.zeros(width, dtype=np.uint8)
        send[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        recv = self._allgather(send)
        return [recv[r].tobytes() for r in range(self._size)]

    def allgather_f64(self, values: F64) -> F64:
        send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1).copy()
        out: F64 = self._allgather(send)
        return out

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        lengths = self.allgather_f64(np.array([len(data)], dtype=np.float64))[:, 0]
        counts = [int(n) for n in lengths]  # small: error messages
        rows = self.allgather_bytes(data, max(1, max(counts)))
        return [rows[r][: counts[r]] for r in range(self._size)]

    def allreduce_sum_i64(self, values: I64) -> I64:
        arr = np.array(values, dtype=np.int64).reshape(-1)
        t = self._dev(arr)
        self._dist.all_reduce(t, op=self._dist.ReduceOp.SUM, group=self.group)
        self._settle([t])
        self._back(t, arr)
        return arr

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        send = np.ascontiguousarray(values, dtype=np.uint64).reshape(-1)
        if send.size != counts[self._rank]:
            raise ValueError("gatherv_u64: local count differs from counts[rank]")
        if max(counts, default=0) * 8 > MAX_MESSAGE:
            raise ValueError("gatherv_u64 is for index records, not bulk data")
        # Padded to the longest count; moved as int64 (the same bits).
        width = max(1, max(counts, default=0))
        padded = np.zeros(width, dtype=np.uint64)
        padded[: send.size] = send
        as_i64 = padded.view(np.int64)
        if self._rank == root:
            recv = np.empty((self._size, width), dtype=np.int64)
            out = [self._dev(recv[r]) for r in range(self._size)]
            mine = self._dev(as_i64)
            self._dist.gather(mine, out, dst=self._global(root), group=self.group)
            self._settle([mine, *out])
            for r in range(self._size):
                self._back(out[r], recv[r])
            rows = recv.view(np.uint64)
            return np.concatenate([rows[r, : counts[r]] for r in range(self._size)])
        mine = self._dev(as_i64)
        self._dist.gather(mine, None, dst=self._global(root), group=self.group)
        self._settle([mine])
        return None

    def bcast_u8(self, buf: U8, root: int) -> None:
        for chunk in _chunks(buf, "bcast_u8"):
            t = self._dev(chunk)
            self._dist.broadcast(t, src=self._global(root), group=self.group)
            self._settle([t])
            self._back(t, chunk)

    def start_bcast_u8(self, buf: U8, root: int) -> InFlight:
        if self._device.type != "cpu":
            # Staged through the device one chunk at a time: not in flight.
            self.bcast_u8(buf, root)
            return Complete()
        tensors = [self._dev(chunk) for chunk in _chunks(buf, "bcast_u8")]
        works = [
            self._dist.broadcast(t, src=self._global(root), group=self.group, async_op=True)
            for t in tensors
        ]
        return _TorchInFlight(works, tensors, self._settle)

    def sendrecv_u8(self, send: U8, dest: int, recv: U8, source: int) -> None:
        for buf in (send, recv):
            if not buf.flags.c_contiguous or buf.dtype != np.uint8:
                raise ValueError("sendrecv_u8 needs contiguous uint8 arrays")
        out, into = send.reshape(-1), recv.reshape(-1)
        if dest == self._rank and source == self._rank:
            if out.size != into.size:
                raise ValueError("sendrecv_u8 to self needs equal lengths")
            into[:] = out
            return
        dist = self._dist
        # Chunk by chunk, each a batched send and receive (NCCL needs them
        # batched; gloo matches them by tag). A receiver's length equals its
        # sender's, so both sides count the same chunks.
        for k in range(max(-(-out.size // MAX_MESSAGE), -(-into.size // MAX_MESSAGE))):
            lo = k * MAX_MESSAGE
            ops = []
            got = into[lo : lo + MAX_MESSAGE]
            r_t = self._dev(got) if got.size else None
            if r_t is not None:
                ops.append(dist.P2POp(dist.irecv, r_t, self._global(source), self.group, _TAG + k))
            part = out[lo : lo + MAX_MESSAGE]
            if part.size:
                s_t = self._dev(part)
                ops.append(dist.P2POp(dist.isend, s_t, self._global(dest), self.group, _TAG + k))
            reqs = list(dist.batch_isend_irecv(ops))
            while reqs:  # dropped once done: the works hold the tensors
                reqs.pop().wait()
            self._settle(op.tensor for op in ops)
            if r_t is not None:
                self._back(r_t, got)

    def barrier(self) -> None:
        self._dist.barrier(group=self.group)


_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE")


class _TorchInFlight:
    """torch.distributed works of one broadcast (their tensors share the
    numpy buffer's memory; each work keeps its tensor)."""

    def __init__(
        self, works: list[Any], tensors: list[Any], settle: Callable[[Iterable[Any]], None]
    ) -> None:
        self.works, self._tensors, self._settle = works, tensors, settle

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        while self.works:  # dropped once done: the works hold the tensors
            self.works.pop(0).wait()
        self._settle(self._tensors)  # TorchDistComm._settle


class NodeShared:
    """Memory shared by all ranks of one host (an MPI shared window): each
    rank owns one segment and sees every rank's. Collective to make and to
    :meth:`close`."""

    def __init__(self, win: Any, node: Any, segments: list[U8]) -> None:
        self._win, self._node = win, node
        #: Every rank's segment, writable only by its owner by convention.
        self.segments = segments

    def close(self) -> None:
        self.segments = []
        self._win.Free()
        self._node.Free()


def node_shared(c: Comm, nbytes: int) -> NodeShared | None:
    """A :class:`NodeShared` with ``nbytes`` in this rank's segment, when
    ``c`` is an MPI communicator whose ranks all run on one host; else None
    (the caller exchanges another way). Collective over ``c``."""
    if not isinstance(c, MPIComm):
        return None
    MPI = c._MPI
    node = c.comm.Split_type(MPI.COMM_TYPE_SHARED, key=c.rank)
    if node.Get_size() != c.size:
        node.Free()
        return None
    win = MPI.Win.Allocate_shared(max(nbytes, 1), 1, comm=node)
    segments = []
    for r in range(c.size):
        buf, _ = win.Shared_query(r)
        segments.append(np.frombuffer(buf, dtype=np.uint8))
    return NodeShared(win, node, segments)


#: A node-shared window of at most this many bytes per rank is kept after
#: a load for the next one (:func:`reused_node_shared`): its pages stay
#: mapped and faulted in, which a new window pays for on every load (about
#: as much as the copies out of it). Larger windows are freed after use.
KEEP_SHARED_BYTES = 256 << 20

_KEPT: dict[Any, NodeShared] = {}


def _kept_key(c: MPIComm) -> tuple[int, int]:
    return (id(c.comm), c.comm.py2f())


def kept_fits(c: Comm, nbytes: int) -> bool:
    """Whether this rank's segment of the window kept for ``c`` (by
    :func:`release_node_shared`) holds ``nbytes``: this rank's vote for
    :func:`reused_node_shared`, which the ranks exchange in an agreement
    they run anyway (no collective of its own). Local."""
    if not isinstance(c, MPIComm):
        return False
    kept = _KEPT.get(_kept_key(c))
    return kept is not None and kept.segments[c.rank].size >= nbytes


def reused_node_shared(c: Comm, nbytes: int, reuse: bool) -> NodeShared | None:
    """:func:`node_shared`, but the window kept by :func:`release_node_shared`
    after an earlier call when ``reuse``: every rank's :func:`kept_fits`
    was true (the caller gathered them, so every rank takes the same
    branch). Collective over ``c`` when it makes a new window."""
    if not isinstance(c, MPIComm):
        return None
    key = _kept_key(c)
    kept = _KEPT.get(key)
    if reuse:
        assert kept is not None
        return kept
    if kept is not None:
        del _KEPT[key]
        kept.close()
    return node_shared(c, nbytes)


def release_node_shared(c: Comm, shared: NodeShared) -> None:
    """Done with ``shared`` (from :func:`reused_node_shared`): kept for the
    next call when it is at most :data:`KEEP_SHARED_BYTES` per rank, else
    freed. Collective over ``c`` (every rank decides alike: from the sizes
    of all segments)."""
    assert isinstance(c, MPIComm)
    if max(seg.size for seg in shared.segments) <= KEEP_SHARED_BYTES:
        _KEPT[_kept_key(c)] = shared
    else:
        shared.close()


def release_kept_windows() -> None:
    """Frees the windows kept for the next load (at interpreter exit, before
    mpi4py finalizes MPI)."""
    kept = list(_KEPT.values())
    _KEPT.clear()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or mpi.Is_finalized():
        return
    for shared in kept:
        with contextlib.suppress(Exception):
            shared.close()


atexit.register(release_kept_windows)


def launched_by_mpiexec() -> bool:
    for var in _LAUNCHER_SIZE_VARS:
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def _is_process_group(obj: Any) -> bool:
    dist = sys.modules.get("torch.distributed")
    pg = getattr(dist, "ProcessGroup", None) if dist is not None else None
    return pg is not None and isinstance(obj, pg)


def _torch_dist_initialized() -> bool:
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def resolve(comm: Any = None) -> Comm:
    """The communicator to use.

    - a :class:`SingleComm`, :class:`MPIComm` or :class:`TorchDistComm` is
      used as is;
    - a ``torch.distributed`` ``ProcessGroup`` is wrapped in a
      :class:`TorchDistComm`; ``"torch"``: torch.distributed's default group;
    - any other object is taken for an mpi4py communicator and wrapped;
    - None, in this order of precedence:

      1. ``MPI.COMM_WORLD`` when mpi4py is imported and MPI initialised;
      2. torch.distributed's default group when it is initialised
         (``torchrun``, ``init_process_group``);
      3. ``MPI.COMM_WORLD`` when this process was started by ``mpiexec``
         with more than one rank (mpi4py is then imported);
      4. otherwise a single process.
    """
    if isinstance(comm, SingleComm | MPIComm | TorchDistComm):
        return comm
    if isinstance(comm, str):
        if comm != "torch":
            raise ValueError(f"comm must be a communicator or 'torch', not {comm!r}")
        return TorchDistComm()
    if _is_process_group(comm):
        return TorchDistComm(comm)
    if comm is not None:
        return MPIComm(comm)
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        return MPIComm(mpi_mod.COMM_WORLD)
    if _torch_dist_initialized():
        return TorchDistComm()
    if mpi_mod is None and launched_by_mpiexec():
        try:
            from mpi4py import MPI

            mpi_mod = MPI
        except ImportError:
            mpi_mod = None
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        return MPIComm(mpi_mod.COMM_WORLD)
    return SingleComm()


# ----------------------------------------------------------------------------
# The communicators of background writers (deeppart.async_save).

_WRITERS: dict[Any, tuple[Any, Comm]] = {}
_WRITERS_LOCK = threading.Lock()


_SINGLE = SingleComm()


def release_writers(match: Callable[[Any], bool] | None = None) -> None:
    """Frees the cached writer communicators (an MPI ``Dup``, a gloo group),
    or those whose :func:`writer_key` ``match`` accepts. Runs at interpreter
    exit (before mpi4py finalizes MPI): a gloo group left for the
    interpreter's teardown can abort the process ("terminate called without
    an active exception") after the program has finished; and for the groups
    ``torch.distributed.destroy_process_group`` destroys
    (:func:`deeppart.saving.in_flight.guard_teardown`). Call it yourself
    before re-initialising MPI or torch.distributed."""
    with _WRITERS_LOCK:
        keys = [k for k in _WRITERS if match is None or match(k)]
        writers = [_WRITERS.pop(k) for k in keys]
    for _, comm in writers:
        with contextlib.suppress(Exception):
            if isinstance(comm, MPIComm):
                if not comm._MPI.Is_finalized():
                    comm.comm.Free()
            elif isinstance(comm, TorchDistComm):
                import torch.distributed as dist

                if dist.is_initialized() and comm.group is not None:
                    dist.destroy_process_group(comm.group)


atexit.register(release_writers)


def writer_key(c: Comm) -> Any:
    """What identifies ``c``'s background writer (:func:`writer_comm`),
    found without making one: saves in flight are known by it."""
    if isinstance(c, SingleComm):
        return ("single",)  # one process: every SingleComm is the same one
    if isinstance(c, MPIComm):
        return ("mpi", c.comm.py2f())
    if isinstance(c, TorchDistComm):
        import torch.distributed as dist

        # The default group's identity too: a re-initialised
        # torch.distributed gets new writer groups.
        return ("torch", id(c.group), id(dist.group.WORLD))
    return (type(c).__name__, id(c))


def destroyed_with(group: Any) -> Callable[[Any], bool]:
    """Which :func:`writer_key` s belong to torch.distributed communicators
    that ``torch.distributed.destroy_process_group(group)`` takes down: every
    one of the current default group for None (or the default group
    itself), else those over ``group``."""
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_initialized() else None
    everything = group is None or group is world

    def hit(key: Any) -> bool:
        if not (isinstance(key, tuple) and key and key[0] == "torch"):
            return False
        return bool(key[2] == id(world) if everything else key[1] == id(group))

    return hit


def writer_comm(c: Comm) -> tuple[Comm | None, str]:
    """The dedicated communicator of ``c``'s background writer (made once per
    communicator, collectively), or None and the reason why a background
    writer cannot be used."""
    if isinstance(c, SingleComm) and c.size == 1:
        # (Only one rank: a subclass spanning several, e.g. ranks as
        # threads, has no writer here; a single one's would commit alone.)
        return _SINGLE, ""
    if isinstance(c, MPIComm):
        mpi = c._MPI
        level = mpi.Query_thread()
        if level < mpi.THREAD_MULTIPLE:
            return None, (
                f"MPI provides thread level {level}, not MPI_THREAD_MULTIPLE "
                f"({mpi.THREAD_MULTIPLE}), so a background thread may not call MPI"
            )
        key = writer_key(c)
        if key not in _WRITERS:
            _WRITERS[key] = (c.comm, SleepingMPIComm(c.comm.Dup()))
        return _WRITERS[key][1], ""
    if isinstance(c, TorchDistComm):
        import torch.distributed as dist

        world = dist.group.WORLD
        key = writer_key(c)
        if key not in _WRITERS:
            if c.group is None:
                ranks = list(range(dist.get_world_size()))
            else:
                ranks = dist.get_process_group_ranks(c.group)
            # The writer's collectives are small (agreements, piece records):
            # gloo keeps them on the CPU, off the GPU's NCCL streams.
            backend = "gloo" if dist.is_gloo_available() else str(dist.get_backend(c.group))
            group = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
            _WRITERS[key] = ((c.group, world), TorchDistComm(group))
        return _WRITERS[key][1], ""
    return None, f"no dedicated writer communicator for a {type(c).__name__}"
