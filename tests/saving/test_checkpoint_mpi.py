"""Multi-rank checkpoint tests: each runs ``mpiexec -n K python
tests/support/mpi_checkpoint.py SCENARIO ...`` with a timeout, so a hang fails the
test instead of blocking the suite."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import deeppart
from deeppart.format import METADATA, data_file_name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "support" / "mpi_checkpoint.py"
BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"
TIMEOUT_S = 180

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed"),
]

import mpi_checkpoint  # noqa: E402


def run(n: int, *args: str, expect_ok: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs the scenario on ``n`` ranks (``n == 0``: one process without
    mpiexec and without MPI)."""
    cmd = [sys.executable, str(SCRIPT), *args]
    if n:
        cmd = [str(MPIEXEC), "-n", str(n), *cmd]
    proc = mpi_checkpoint.launch(cmd, TIMEOUT_S, ROOT)
    if expect_ok:
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        oks = set(re.findall(r"OK [\w-]+ rank \d+/\d+", proc.stdout))
        assert len(oks) >= max(n, 1), proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("n", [2, 3, 4])
def test_roundtrip_bitwise_and_into(tmp_path: Path, n: int) -> None:
    """Model + AdamW state saved and loaded on n ranks is bitwise equal on
    every rank; into= fills the same tensor objects in place."""
    run(n, "roundtrip", str(tmp_path / "ck"))
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["COMMITTED", METADATA, *[data_file_name(r) for r in range(n)]]
    meta = json.loads((tmp_path / "ck" / METADATA).read_text())
    writers = {row[3] for row in meta["pieces"] if row[5] > 0}
    assert len(writers) > 1, "the plan spreads the writes over several ranks"


def test_save_seconds_are_the_slowest_ranks(tmp_path: Path) -> None:
    """A rank that calls save late: Stats.seconds is the slowest rank's time
    (as documented), not rank 0's, and the summary agrees with it."""
    run(3, "latecomer", str(tmp_path / "ck"))


def test_compressed_load_decompresses_each_piece_once(tmp_path: Path) -> None:
    """Compressed load on 3 ranks: each piece decompressed by one rank only."""
    run(3, "decompress_once", str(tmp_path / "ck"))


def test_roundtrip_compressed(tmp_path: Path) -> None:
    run(3, "roundtrip", str(tmp_path / "ck"), "--codec", "shuffle-zstd")


def test_large_messages_are_chunked(tmp_path: Path) -> None:
    """With the message limit lowered to 4 KiB (normally 1 GiB, under MPI's
    2 GiB int limit), every broadcast goes in many chunks and still restores
    bitwise."""
    run(2, "roundtrip", str(tmp_path / "ck"), "--max-message", "4096")


def test_exchange_messages_pack_short_pieces_and_split_long_ones(tmp_path: Path) -> None:
    """With the exchange's broadcasts capped at 8 KiB (pieces of 2 KiB and
    more go straight into their targets, shorter ones packed up to 4 KiB)
    and at most 3 broadcasts or 16 KiB of packed pieces in flight, a load
    by broadcast packs short pieces, splits long ones across many messages,
    waits for the oldest ones mid-exchange, and restores bitwise, on host
    tensors and through the staged device path."""
    d = str(tmp_path / "ck")
    run(3, "save", d)
    run(4, "load", d, "--exchange-message", "8192")
    run(2, "load", d, "--exchange-message", "8192", "--stage", "1024")
    run(3, "roundtrip", str(tmp_path / "ck2"), "--codec", "zstd", "--exchange-message", "8192")


def test_broadcast_load_sends_what_is_verified_while_reading(tmp_path: Path) -> None:
    """A load by broadcast streams: a reader's first message reaches the
    other rank before the reader's last piece is verified; a piece whose
    checksum fails reaches no other rank (it gets zeros; both raise)."""
    run(2, "stream", str(tmp_path / "ck"))


def test_broadcast_load_sends_compressed_pieces_as_stored(tmp_path: Path) -> None:
    """A compressed checkpoint loaded by broadcast: the broadcasts carry the
    stored (compressed) bytes, every rank checks what it received before
    decoding it (a byte flipped in transit fails the load, naming where it
    came from), a piece corrupt on disk fails with its reader's error; with
    tiny message caps, a reader allowed to keep 8 KiB ahead of its
    broadcasts, and on the staged device path."""
    run(3, "stream_compressed", str(tmp_path / "ck"), "--exchange-message", "8192")
    run(2, "stream_compressed", str(tmp_path / "ck2"), "--exchange-message", "8192",
        "--stage", "1024")  # fmt: skip


@pytest.mark.parametrize(("n", "m"), [(4, 2), (2, 3), (4, 1)])
def test_elastic_restore(tmp_path: Path, n: int, m: int) -> None:
    """Written by n ranks, loaded on m (m == 1: one process, no MPI)."""
    d = str(tmp_path / "ck")
    run(n, "save", d, "--codec", "zstd" if n == 2 else "none")
    run(m if m > 1 else 0, "load", d)


def test_stacked_experts_split_inside_rows(tmp_path: Path) -> None:
    """A coarse 3-D tensor (a Mixtral-style expert stack) is cut at the
    finest legal grain, inside its rows, on 4 KiB boundaries; the checkpoint
    written by 4 ranks loads bitwise on 3 and on one process."""
    d = str(tmp_path / "ck")
    run(4, "experts-save", d)
    meta = json.loads((tmp_path / "ck" / METADATA).read_text())
    manifest = meta["manifest"]
    leaves = (json.loads(manifest) if isinstance(manifest, str) else manifest)["leaves"]
    row_units = {i: int(np.prod(lf["shape"][1:])) for i, lf in enumerate(leaves)
                 if lf.get("kind", "tensor") == "tensor" and len(lf["shape"]) == 3}  # fmt: skip
    itemsize = {i: 8 if leaves[i]["dtype"] == "float64" else 4 for i in row_units}
    cuts = [(row[0], row[1]) for row in meta["pieces"] if row[0] in row_units and row[1] > 0]
    assert cuts, "the expert stacks are split"
    assert all(start * itemsize[leaf] % 4096 == 0 for leaf, start in cuts)
    assert any(start % row_units[leaf] for leaf, start in cuts), "some cut falls inside a row"
    assert len({row[3] for row in meta["pieces"]}) == 4, "all four ranks write"
    run(3, "experts-load", d)
    run(0, "experts-load", d)


def test_staged_device_path_on_three_ranks(tmp_path: Path) -> None:
    """Every tensor taken for a device tensor (staged through a 1 KiB host
    buffer): saved on 3 ranks, loaded on 2 with and without into=, through
    the broadcast and the read exchanges, bitwise."""
    d = str(tmp_path / "ck")
    run(3, "save", d, "--stage", "1024")
    run(2, "load", d, "--stage", "1024")


def test_ranks_disagreeing_on_structure_all_fail(tmp_path: Path) -> None:
    """Issue 32: ranks whose trees differ save the union of them (no longer
    refused), and each rank loads its own tree back bitwise."""
    proc = run(3, "mismatch", str(tmp_path / "ck"))
    assert proc.stdout.count("OK mismatch") == 3
    assert (tmp_path / "ck" / "COMMITTED").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_non_plain_object_rejected_on_every_rank(tmp_path: Path) -> None:
    proc = run(2, "nonplain", str(tmp_path / "ck"))
    assert proc.stdout.count("OK nonplain") == 2


def test_crash_during_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = run(3, "crash", str(root), expect_ok=False)
    assert proc.returncode != 0, "a rank was SIGKILLed: the job must fail"
    assert proc.stdout.count("OK crash-step1") == 3
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the interrupted save left its temporary directory"
    cp = deeppart.Checkpointer(root)
    assert cp.latest() == 1, "the partial step 2 is ignored"
    mpi_checkpoint.assert_bitwise_equal(mpi_checkpoint.make_state(), cp.load())
    # The next committed save cleans the leftovers up.
    cp.save(3, mpi_checkpoint.make_state(steps=1))
    assert cp.steps() == [1, 3]
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]


def test_the_writers_collectives_sleep_while_they_wait(tmp_path: Path) -> None:
    """An asynchronous save's writer communicator waits for a late rank
    between sleeps: its thread costs a fraction of the CPU time that a
    blocking MPI wait (MPICH polls) costs for the same wait (issue 35)."""
    proc = run(2, "writer_sleeps", str(tmp_path))
    assert proc.stdout.count("OK writer_sleeps") == 2


def test_async_checkpointer_overlaps_training(tmp_path: Path) -> None:
    """Checkpointer(async_=True) on 2 MPI ranks (MPI_THREAD_MULTIPLE, the
    writer on a Dup of COMM_WORLD): each save returns while its write is
    held; the main thread trains, all-reducing gradients over COMM_WORLD,
    before the writer may go on; each checkpoint is its snapshot, bitwise."""
    proc = run(2, "async", str(tmp_path / "root"))
    assert proc.stdout.count("OK async") == 2


@pytest.mark.parametrize("codec", [None, "shuffle-zstd"])
def test_async_save_stages_only_the_share(tmp_path: Path, codec: str | None) -> None:
    """async_save on 3 MPI ranks: each rank copies only the bytes it writes
    (counted, and checked against the committed metadata), the shares add
    up to the state, and the checkpoint is the state at the call although
    every tensor and plain value changed right after it returned."""
    args = ["--codec", codec] if codec else []
    proc = run(3, "async_share", str(tmp_path / "ck"), *args)
    assert proc.stdout.count("OK async_share") == 3


def _piece_in(d: Path, rank: int) -> list[int]:
    """The largest piece that ``rank`` wrote (a metadata row)."""
    meta = json.loads((d / METADATA).read_text())
    rows: list[list[int]] = [r for r in meta["pieces"] if r[3] == rank and r[6] > 0]
    return max(rows, key=lambda r: r[6])


def test_flipped_byte_detected_on_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    run(3, "save", str(d))
    row = _piece_in(d, 1)
    path = d / data_file_name(1)
    data = bytearray(path.read_bytes())
    data[row[4] + row[6] // 2] ^= 0x10
    path.write_bytes(bytes(data))
    expect = f"{data_file_name(1)}: piece of leaf {row[0]} [{row[1]}:{row[2]}]"
    proc = run(2, "corrupt", str(d), "--expect", expect)
    assert proc.stdout.count("OK corrupt") == 2


def test_one_host_load_checks_each_byte_once_and_still_fails_every_rank(tmp_path: Path) -> None:
    """On one host each data file is read and checksummed by one rank, into
    a node-shared window the others copy from: a rank that would have read
    a replaced copy of a file returns the verified bytes, and a corrupt
    piece in a file rank 0 does not read fails every rank with the same
    CorruptCheckpointError (tests/support/mpi_checkpoint.py shared_check)."""
    run(4, "shared_check", str(tmp_path / "ck"))


def test_one_host_load_runs_only_its_three_agreements(tmp_path: Path) -> None:
    """A one-host load's collectives are its three agreements (plan, read,
    exchange with assembly): the host check, the kept window's fit and the
    statistics go in them (tests/support/mpi_checkpoint.py collectives)."""
    proc = run(4, "collectives", str(tmp_path / "ck"))
    assert proc.stdout.count("OK collectives") == 4


def test_ranks_waiting_in_an_agreement_give_up_their_cores(tmp_path: Path) -> None:
    """Ranks that wait in an agreement for a late one sleep between polls
    instead of spinning (their processor time: tests/support/mpi_checkpoint.py
    agree_wait), so on fewer cores than ranks the late ones get the cores."""
    proc = run(4, "agree_wait", str(tmp_path))
    assert proc.stdout.count("OK agree_wait") == 4


def test_truncated_file_detected_on_every_rank(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    run(3, "save", str(d))
    path = d / data_file_name(2)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    proc = run(3, "corrupt", str(d), "--expect", f"{data_file_name(2)}: {size - 100} bytes")
    assert proc.stdout.count("OK corrupt") == 3


@pytest.mark.slow
def test_demo_small(tmp_path: Path) -> None:
    """`deeppart demo` end to end, shortened: 2 ranks, crash during the
    second checkpoint, resume, bitwise checks."""
    cmd = [
        sys.executable, "-m", "deeppart", "demo", "--ranks", "2", "--steps", "6",
        "--every", "2", "--crash-at", "4", "--dir", str(tmp_path / "demo"),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ALL CHECKS PASSED" in proc.stdout
    assert "FAIL" not in proc.stdout
    assert "BITWISE IDENTICAL" in proc.stdout
