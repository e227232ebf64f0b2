"""The few collectives a checkpoint needs, over mpi4py or a single process.

Everything here moves raw ``numpy.uint8`` / ``float64`` / ``uint64``
buffers with mpi4py's upper-case (buffer) methods: nothing is pickled.
Messages larger than :data:`MAX_MESSAGE` bytes are sent in chunks, so no
count overflows MPI's 32-bit ``int``.

With no MPI (mpi4py absent or not initialised, and not started by
``mpiexec``) a :class:`SingleComm` stands in: rank 0 of 1, every collective
a local copy.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

#: Largest single MPI message, in bytes (well under 2 GiB).
MAX_MESSAGE = 1 << 30

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]


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
    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        """Rank ``root`` gets the concatenation of every rank's ``values``
        (``counts[r]`` elements from rank r); other ranks get None."""
        ...
    def bcast_u8(self, buf: U8, root: int) -> None:
        """Broadcasts ``buf`` (a contiguous uint8 array, the same length on
        every rank) in place from ``root``, in chunks."""
        ...
    def barrier(self) -> None: ...


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

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        return np.ascontiguousarray(values, dtype=np.uint64).copy()

    def bcast_u8(self, buf: U8, root: int) -> None:
        return None

    def barrier(self) -> None:
        return None


class MPIComm:
    """An mpi4py communicator, used only through buffer collectives."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self._rank: int = comm.Get_rank()
        self._size: int = comm.Get_size()

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if len(data) > width:
            raise ValueError(f"{len(data)} bytes do not fit in {width}")
        send = np.zeros(width, dtype=np.uint8)
        send[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        recv = np.empty(width * self._size, dtype=np.uint8)
        self.comm.Allgather([send, self._MPI.BYTE], [recv, self._MPI.BYTE])
        return [recv[r * width : (r + 1) * width].tobytes() for r in range(self._size)]

    def allgather_f64(self, values: F64) -> F64:
        send = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
        recv = np.empty((self._size, send.size), dtype=np.float64)
        self.comm.Allgather([send, self._MPI.DOUBLE], [recv, self._MPI.DOUBLE])
        return recv

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        lengths = self.allgather_f64(np.array([len(data)], dtype=np.float64))[:, 0]
        counts = [int(n) for n in lengths]  # small: error messages
        displs = [sum(counts[:r]) for r in range(self._size)]
        recv = np.empty(max(1, sum(counts)), dtype=np.uint8)
        send = np.frombuffer(data, dtype=np.uint8) if data else np.empty(0, dtype=np.uint8)
        self.comm.Allgatherv([send, self._MPI.BYTE], [recv, counts, displs, self._MPI.BYTE])
        return [recv[displs[r] : displs[r] + counts[r]].tobytes() for r in range(self._size)]

    def gatherv_u64(self, values: U64, counts: list[int], root: int = 0) -> U64 | None:
        send = np.ascontiguousarray(values, dtype=np.uint64)
        if send.size != counts[self._rank]:
            raise ValueError("gatherv_u64: local count differs from counts[rank]")
        if max(counts, default=0) * 8 > MAX_MESSAGE:
            raise ValueError("gatherv_u64 is for index records, not bulk data")
        if self._rank == root:
            displs = [sum(counts[:r]) for r in range(self._size)]
            recv = np.empty(max(1, sum(counts)), dtype=np.uint64)
            self.comm.Gatherv(
                [send, self._MPI.UINT64_T], [recv, counts, displs, self._MPI.UINT64_T], root=root
            )
            return recv[: sum(counts)]
        self.comm.Gatherv([send, self._MPI.UINT64_T], None, root=root)
        return None

    def bcast_u8(self, buf: U8, root: int) -> None:
        if not buf.flags.c_contiguous or buf.dtype != np.uint8:
            raise ValueError("bcast_u8 needs a contiguous uint8 array")
        flat = buf.reshape(-1)
        for start in range(0, flat.size, MAX_MESSAGE):
            chunk = flat[start : start + MAX_MESSAGE]
            self.comm.Bcast([chunk, self._MPI.BYTE], root=root)

    def barrier(self) -> None:
        self.comm.Barrier()


_LAUNCHER_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS", "PMIX_SIZE")


def _launched_by_mpiexec() -> bool:
    for var in _LAUNCHER_SIZE_VARS:
        try:
            if int(os.environ.get(var, "1")) > 1:
                return True
        except ValueError:
            continue
    return False


def resolve(comm: Any = None) -> Comm:
    """The communicator to use.

    - an explicit mpi4py communicator is wrapped;
    - a :class:`SingleComm` or :class:`MPIComm` is used as is;
    - None: ``MPI.COMM_WORLD`` when mpi4py is already imported and MPI
      initialised, or when this process was started by ``mpiexec`` with more
      than one rank (then mpi4py is imported); otherwise a single process.
    """
    if isinstance(comm, SingleComm | MPIComm):
        return comm
    if comm is not None:
        return MPIComm(comm)
    mpi_mod = sys.modules.get("mpi4py.MPI")
    if mpi_mod is None and _launched_by_mpiexec():
        try:
            from mpi4py import MPI

            mpi_mod = MPI
        except ImportError:
            mpi_mod = None
    if mpi_mod is not None and mpi_mod.Is_initialized() and not mpi_mod.Is_finalized():
        return MPIComm(mpi_mod.COMM_WORLD)
    return SingleComm()
