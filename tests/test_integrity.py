"""deeppart.integrity: when ranks may share the checks of the files they all
read (one kernel), and what a rank records of a file it read. The
multi-rank behaviour is tests/test_checkpoint_mpi.py's shared_check."""

from __future__ import annotations

from pathlib import Path

import pytest

from deeppart import integrity
from deeppart.comm import SingleComm


class _Rows:
    """A communicator stand-in for :func:`integrity.hosts`: every rank's
    host identity, as its one allgather would return them."""

    def __init__(self, rows: list[bytes]) -> None:
        self.rows = rows

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        return self.rows


def test_one_kernel_needs_the_same_host_name_and_boot_id() -> None:
    same = integrity.hosts(_Rows([b"a\0boot1", b"a\0boot1"]))  # type: ignore[arg-type]
    assert same == integrity.Hosts(one_host=True, one_kernel=True)
    # Two machines with one host name: still different kernels.
    twins = integrity.hosts(_Rows([b"a\0boot1", b"a\0boot2"]))  # type: ignore[arg-type]
    assert twins == integrity.Hosts(one_host=True, one_kernel=False)
    # Simulated nodes on one kernel (tests/cluster.py): different host names.
    nodes = integrity.hosts(_Rows([b"dpnode0\0boot1", b"dpnode1\0boot1"]))  # type: ignore[arg-type]
    assert nodes == integrity.Hosts(one_host=False, one_kernel=False)


def test_no_boot_id_means_no_shared_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(integrity, "BOOT_ID", tmp_path / "missing")
    assert integrity.host_identity().endswith(b"\0")
    assert integrity.hosts(SingleComm()) == integrity.Hosts(one_host=True, one_kernel=False)


def test_a_replaced_file_changes_the_view(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    with open(path, "rb") as f:
        before = integrity.file_view(f.fileno())
    (tmp_path / "g.bin").write_bytes(b"x" * 100)
    (tmp_path / "g.bin").replace(path)
    with open(path, "rb") as f:
        replaced = integrity.file_view(f.fileno())
    assert replaced[1] != before[1]  # a new inode
    digests = {integrity.views_digest({0: v}) for v in (before, replaced)}
    assert len(digests) == 2
    # A view that changed during a read matches no other rank's.
    assert integrity.views_digest({0: integrity.unstable_view()}) not in digests
