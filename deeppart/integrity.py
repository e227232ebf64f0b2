"""Who verifies which bytes on a load where every rank reads everything.

With ``exchange="read"`` (the default on one host) every rank reads every
data file from the same page cache. Checksumming all of it on every rank
doubles the CPU work of the load for nothing: the bytes each rank copies
are the bytes of one cached file. So when the ranks run on one kernel,
each data file is verified (xxh3 of every raw piece) by one rank only, its
*verifier* (the files spread over the ranks as
:func:`deeppart.reader.assign_readers` spreads a broadcast's reads), and
the other ranks read it without a checksum. The read's agreement then

- spreads any checksum failure to every rank (the same
  :class:`~deeppart.errors.CorruptCheckpointError`, naming the file and the
  piece): nothing is returned half-verified;
- compares what every rank saw of every file: :func:`file_view`, taken on
  the open descriptor before and after the read (device, inode, size,
  mtime, ctime). When any rank's views differ from the others' (a file
  replaced or rewritten between the ranks' reads, or during one), or a
  rank's view changed during its read, every rank checksums the pieces it
  skipped in its own memory (:func:`check_in_memory`) before anything is
  returned.

The shortcut needs one kernel, not only one host name
(:func:`host_identity`: the host name and the kernel's boot id): device and
inode numbers are unique on one kernel (across mount namespaces too), not
across hosts, and ranks on different nodes may see private node-local
storage under the same path. Otherwise, and for compressed pieces and
device targets, every rank verifies everything it reads, as with
``exchange="bcast"``.
"""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from deeppart.comm import Comm
from deeppart.errors import CorruptCheckpointError
from deeppart.format import Piece, checksum
from deeppart.tensors import U8

__all__ = [
    "BOOT_ID",
    "FileView",
    "Hosts",
    "check_in_memory",
    "file_view",
    "host_identity",
    "hosts",
    "unstable_view",
    "views_digest",
]

#: The kernel's boot id: the same for every process of one running kernel.
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

#: What a rank saw of a data file: (st_dev, st_ino, st_size, st_mtime_ns,
#: st_ctime_ns) of its open descriptor.
FileView = tuple[int, int, int, int, int]


def host_identity() -> bytes:
    """This process's host name and kernel boot id (empty where the kernel
    does not expose one), NUL-separated."""
    try:
        boot = BOOT_ID.read_bytes().strip()
    except OSError:
        boot = b""
    return socket.gethostname().encode() + b"\0" + boot


@dataclass(frozen=True)
class Hosts:
    """Where the ranks of a communicator run."""

    #: Every rank reports the same host name.
    one_host: bool
    #: Every rank runs on the same kernel (same host name and boot id).
    one_kernel: bool


def hosts(comm: Comm) -> Hosts:
    """Where the ranks of ``comm`` run (collective: one small allgather)."""
    rows = comm.allgather_varbytes(host_identity())
    names = {row.split(b"\0", 1)[0] for row in rows}
    same = len(set(rows)) == 1 and not rows[0].endswith(b"\0")
    return Hosts(len(names) == 1, same)


def file_view(fd: int) -> FileView:
    """What this rank sees of the open file ``fd``."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def unstable_view() -> FileView:
    """The view a rank records for a file that changed while it read it:
    unlike any real one and any other process's on this kernel, so the
    agreement falls back to every rank verifying its own bytes."""
    return (-1, -1, -1, -1, -os.getpid())


def views_digest(views: dict[int, FileView]) -> bytes:
    """32 bytes naming what this rank saw of the data files it read (by
    data file index)."""
    h = hashlib.sha256()
    for f in sorted(views):
        h.update(repr((f, views[f])).encode())
    return h.digest()


def check_in_memory(pieces: Iterable[Piece], data: Callable[[Piece], U8], directory: Path) -> None:
    """Checksums each of ``pieces`` as it lies in this rank's memory
    (``data(piece)``: its raw bytes); CorruptCheckpointError for the first
    that differs."""
    for p in pieces:
        if checksum(data(p).data) != p.xxh3:
            raise CorruptCheckpointError(
                f"{p.describe(directory)}: checksum mismatch (xxh3_64) in this rank's "
                "copy (the file changed between the ranks' reads: load again once "
                "nothing writes to the checkpoint)"
            )
