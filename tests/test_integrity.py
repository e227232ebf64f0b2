"""deeppart.integrity: where the ranks run (one host name: the shared-window
exchange of a one-host load). Who verifies which bytes is exercised by
tests/test_checkpoint_mpi.py (shared_check) and tests/test_trust_mpi.py."""

from __future__ import annotations

import socket

from deeppart import integrity
from deeppart.comm import SingleComm


class _Rows:
    """A communicator stand-in for :func:`integrity.hosts`: every rank's
    host name, as its one allgather would return them."""

    def __init__(self, rows: list[bytes]) -> None:
        self.rows = rows

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        return self.rows


def test_one_host_is_one_host_name() -> None:
    assert integrity.hosts(_Rows([b"a", b"a"])) == integrity.Hosts(one_host=True)  # type: ignore[arg-type]
    # Simulated nodes (tests/cluster.py): different host names.
    two = integrity.hosts(_Rows([b"dpnode0", b"dpnode1"]))  # type: ignore[arg-type]
    assert two == integrity.Hosts(one_host=False)
    assert integrity.hosts(SingleComm()) == integrity.Hosts(one_host=True)
    assert socket.gethostname()
