"""deeppart.save / load / Checkpointer under ``torchrun`` (gloo, CPU), with
no ``comm=``: :func:`deeppart.comm.resolve` picks torch.distributed's default
group and :class:`deeppart.comm.TorchDistComm` carries every collective.

Each test runs ``python -m torch.distributed.run --nproc-per-node N
--standalone tests/base/torchdist_worker.py SCENARIO ...`` (or the worker alone,
one process without a process group) in its own session, with a timeout
after which the whole process group is killed: a hang fails the test.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_in_session  # noqa: E402

from deeppart.comm import MPIComm, SingleComm, TorchDistComm, resolve  # noqa: E402
from deeppart.format import METADATA, data_file_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "base" / "torchdist_worker.py"
TIMEOUT_S = 240

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed"),
    pytest.mark.multirank,
]


def run(n: int, *args: str) -> str:
    """Runs the worker on ``n`` torchrun ranks (``n == 0``: one plain
    process); returns its output after checking every rank printed OK."""
    cmd = [sys.executable, str(WORKER), *args]
    if n:
        launcher = [sys.executable, "-m", "torch.distributed.run"]
        cmd = [*launcher, "--nproc-per-node", str(n), "--standalone", *cmd[1:]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    returncode, out = run_in_session(cmd, env, ROOT, TIMEOUT_S)
    assert returncode == 0, f"rc={returncode}\n{out}"
    oks = set(re.findall(r"OK [\w-]+ rank \d+/\d+", out))
    assert len(oks) >= max(n, 1), out
    return out


def test_every_collective(tmp_path: Path) -> None:
    """allgather_bytes/f64/varbytes, gatherv_u64 (uint64 high bits intact),
    bcast_u8, a ring of sendrecv_u8 of unequal lengths, barrier, on 3 gloo
    ranks with messages chunked at 1 KiB."""
    out = run(3, "comm", str(tmp_path), "--max-message", "1024")
    assert out.count("OK comm") == 3


def test_roundtrip_bitwise_and_into(tmp_path: Path) -> None:
    """A real model + AdamW state saved and loaded on 4 torchrun ranks is
    bitwise equal on every rank; into= fills the same tensor objects."""
    d = tmp_path / "ck"
    run(4, "roundtrip", str(d))
    files = sorted(p.name for p in d.iterdir())
    assert files == ["COMMITTED", METADATA, *[data_file_name(r) for r in range(4)]]
    meta = json.loads((d / METADATA).read_text())
    assert len({row[3] for row in meta["pieces"] if row[5] > 0}) > 1


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_elastic_restore(tmp_path: Path, codec: str) -> None:
    """Saved on 4 torchrun ranks; loaded (exchange "bcast", chunked at 4 KiB,
    and "read") on 2 torchrun ranks, and in one process without a group."""
    d = str(tmp_path / "ck")
    run(4, "save", d, "--codec", codec)
    run(2, "load", d, "--max-message", "4096")
    run(0, "load", d)


def test_ranks_with_different_trees_save_their_union(tmp_path: Path) -> None:
    """One rank holds one more leaf (issue 32, each rank's own state): the
    checkpoint is the union of the ranks' trees, committed, and every rank
    loads back exactly its own tree (checked bitwise in the worker)."""
    out = run(4, "mismatch", str(tmp_path / "ck"))
    assert out.count("OK mismatch") == 4
    assert (tmp_path / "ck" / "COMMITTED").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_non_plain_value_on_one_rank_fails_everywhere(tmp_path: Path) -> None:
    out = run(2, "nonplain", str(tmp_path / "ck"))
    assert out.count("OK nonplain") == 2


def test_async_checkpointer_under_torchrun(tmp_path: Path) -> None:
    """Checkpointer(async_=True) on 2 ranks: the writer (its own process
    group) is held while the main thread trains with all_reduce on the
    default group; each checkpoint holds its snapshot."""
    out = run(2, "async", str(tmp_path / "root"))
    assert out.count("OK async") == 2


def test_resolve_precedence_in_process(tmp_path: Path) -> None:
    """comm=None: MPI when mpi4py is initialised, else the torch default
    group when initialised, else one process; a ProcessGroup or "torch" is
    wrapped in a TorchDistComm."""
    mpi = sys.modules.get("mpi4py.MPI")
    mpi_up = mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    assert isinstance(resolve(), MPIComm if mpi_up else SingleComm)
    with pytest.raises(ValueError, match="'torch'"):
        resolve("tcp")
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert isinstance(resolve(), MPIComm if mpi_up else TorchDistComm)
        for form in ("torch", dist.group.WORLD):
            c = resolve(form)
            assert isinstance(c, TorchDistComm) and (c.rank, c.size) == (0, 1)
    finally:
        dist.destroy_process_group()
    assert isinstance(resolve(), MPIComm if mpi_up else SingleComm)
