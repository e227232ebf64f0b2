"""deeppart.integrity: where the ranks run (one host name: the shared-window
exchange of a one-host load). Who verifies which bytes is exercised by
tests/saving/test_checkpoint_mpi.py (shared_check) and tests/base/test_trust_mpi.py."""

from __future__ import annotations

import socket

from deeppart import integrity


def test_one_host_is_one_host_name() -> None:
    here = integrity.host_id()
    assert len(here) == integrity.HOST_ID_BYTES
    assert here == integrity.host_id()
    assert integrity.one_host([here, here, here])
    assert integrity.one_host([here])
    # Simulated nodes (tests/support/cluster.py): different host names.
    assert not integrity.one_host([here, here, b"dpnode1\0"])
    assert socket.gethostname()
