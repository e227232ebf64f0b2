"""Who verifies which bytes on a load.

The rule: whatever a rank returns from a load was checksummed (xxh3 of each
raw piece; of the stored bytes for a compressed piece, whose output is
bounded) in the memory it is returned from, or copied from memory in which
it was checksummed after it was read. No file metadata (size, times, inode)
ever stands in for a checksum.

- ``exchange="read"`` (and a rank that reads its own leaves): every rank
  reads every piece it needs into its own tensors and checksums it there.
- ``exchange="bcast"``: each data file has one reader
  (:func:`deeppart.loading.reader.assign_readers`), which reads it into its own
  tensors, checksums it there and broadcasts from there; the other ranks
  receive copies of those verified bytes.
- ``exchange="auto"`` on one host (every rank reports the same host name,
  :func:`hosts`) with an MPI communicator: each file's reader reads it into
  its segment of a node-shared window (:func:`deeppart.comm.node_shared`)
  and checksums it there (a raw piece chunk by chunk, each chunk copied on
  to the reader's own tensors right after it was checksummed in the
  window); after the read's agreement every other rank copies the
  verified bytes out of the window into its tensors. A
  process outside the job that writes to a data file (a shared mapping, a
  storage device returning other bytes on a re-read) cannot change the
  window. With torch.distributed (no shared window), or ranks on several
  hosts, ``"auto"`` is the broadcast above.

Device (e.g. CUDA) targets are filled through a host staging buffer, in
which each chunk is hashed before it is copied to the device.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Sequence

__all__ = ["HOST_ID_BYTES", "host_id", "one_host"]

#: The length of :func:`host_id`.
HOST_ID_BYTES = 8


def host_id() -> bytes:
    """This host, in :data:`HOST_ID_BYTES` (a digest of its name): what each
    rank contributes to an agreement the load runs anyway, so that telling
    one host from several costs no collective of its own."""
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=HOST_ID_BYTES).digest()


def one_host(ids: Sequence[bytes]) -> bool:
    """Whether the ranks whose :func:`host_id` are ``ids`` run on one host."""
    return len(set(ids)) <= 1
