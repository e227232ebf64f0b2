"""Multi-rank scenarios of checkpoints in S3 (issue 34) against moto's
server (tests/support/s3_server.py), run by tests/storage/test_s3_mpi.py as one job:
``mpiexec -n 4 python tests/storage/s3_worker.py s3://BUCKET`` (the ``AWS_*``
variables in the environment; ``MOTO_PID``: the server's process id).

- ``replicated``: 4 ranks save a replicated state (each rank's share
  above one multipart part) and load it, bitwise, each stored byte read
  from the store once in all (the load's stored bytes = the save's);
- ``race``: two 2-rank jobs (``COMM_WORLD.Split``) save one step at once,
  both past their start before either commits: exactly one commits, every
  rank of the other raises CommitConflictError; all 4 ranks load the
  winner's state bitwise, and only the winner's objects remain;
- ``foreign``: objects DeepPart did not write under the prefix survive
  saves, overwrites and the cleanups;
- ``hung``: the server stops (SIGSTOP) mid-save: every rank raises, nothing
  is committed; resumed, the previous checkpoint loads bitwise, and the
  next save removes what the interrupted one left;
- ``levels``: the built-in multi-level engine with ``glbl_dir`` in S3
  (2 fake nodes of 2 ranks, every save at L4, keep 1): the retired step's
  objects go; with one node's local files lost its ranks recover from L4
  (levels [1, 1, 4, 4]), with every node's from L4 alone, and with
  ``meta_dir`` gone too from the L4 checkpoint, bitwise;
- ``truncated``: a data object is cut short after its reader checked its
  size (the read-ahead then finds it short): every rank raises
  CorruptCheckpointError naming the object (the load's agreement), no rank
  waits; restored, the checkpoint loads bitwise;
- ``killed`` (last): the server is killed (SIGKILL) mid-save: every rank
  raises within the job's time (the test restarts the server).

Each rank prints ``RESULT <scenario> <case> rank <r> <outcome>`` lines and
``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI

import deeppart
from deeppart.comm import Comm, resolve
from deeppart.errors import CommitConflictError, CorruptCheckpointError
from deeppart.format import data_file_name
from deeppart.loading import reader
from deeppart.progress import last_stats
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import open_store
from deeppart.storage.objects import read_marker, save_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from mpi_checkpoint import abort_on_failure, assert_bitwise_equal, make_state
from rank_output import print_line


def ok(c: Comm, name: str) -> None:
    print_line(f"OK {name} rank {c.rank}/{c.size}")


def state(seed: int) -> dict[str, Any]:
    """A model + AdamW state and a 24 MB tensor (6 MB a rank at 4 ranks:
    above the 5 MiB part the test sets), the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return {**make_state(seed), "big": torch.randn(6_000_000, generator=gen)}


def outcome(c: Comm, scenario: str, case: str, run: Callable[[], object]) -> list[str]:
    """Runs ``run`` on this rank; every rank's outcome ("ok" or the
    exception's type name), after one collective."""
    try:
        run()
        got = "ok"
    except Exception as e:
        got = type(e).__name__
    print_line(f"RESULT {scenario} {case} rank {c.rank} {got}")
    return [row.decode() for row in c.allgather_varbytes(got.encode())]


def scenario_replicated(c: Comm, base: str) -> None:
    url = f"{base}/replicated/step-1"
    st = state(1)
    saved = deeppart.save(st, url)
    out = deeppart.load(url)
    assert_bitwise_equal(out, st, "replicated")
    loaded = last_stats("load")
    assert loaded is not None and loaded.world_size == c.size
    assert loaded.stored_bytes == saved.stored_bytes, (loaded, saved)
    if c.rank == 0:
        store = open_store(url)
        marker = read_marker(store)
        assert marker is not None
        tags = [store.head(f"{marker.save_id}/rank-{r:05d}.bin").tag or "" for r in range(c.size)]
        assert any(t.strip('"').rsplit("-", 1)[-1].isdigit() and "-" in t for t in tags), tags
    ok(c, "replicated")


def scenario_race(c: Comm, base: str) -> None:
    url = f"{base}/race/step-1"
    world = MPI.COMM_WORLD
    job = c.rank % 2
    sub = world.Split(job, c.rank)
    mine = state(10 + job)

    def both_started(ev: WriteEvent) -> None:
        world.Barrier()  # every rank of both jobs is writing: both began

    with fault_hook("after-write", both_started):
        got = outcome(c, "race", "commit", lambda: deeppart.save(mine, url, comm=sub))
    jobs = {j: {got[r] for r in range(c.size) if r % 2 == j} for j in (0, 1)}
    winners = [j for j in (0, 1) if jobs[j] == {"ok"}]
    assert len(winners) == 1, got
    assert jobs[1 - winners[0]] == {CommitConflictError.__name__}, got
    out = deeppart.load(url)
    assert_bitwise_equal(out, state(10 + winners[0]), "race winner")
    if c.rank == 0:
        store = open_store(url)
        marker = read_marker(store)
        assert marker is not None and save_groups(store) == [marker.save_id], save_groups(store)
    sub.Free()
    ok(c, "race")


FOREIGN = {
    "config.json": b"{}",
    "notes/readme.txt": b"mine",
    f"{'cd' * 16}/rank-00000.bin": b"not DeepPart's",
    "COMMITTED.bak": b"x",
}


def scenario_foreign(c: Comm, base: str) -> None:
    url = f"{base}/foreign/step-1"
    store = open_store(url)
    if c.rank == 0:
        for key, data in FOREIGN.items():
            store.put(key, data)
    c.barrier()
    for seed in (20, 21):
        deeppart.save(state(seed), url, overwrite=True)
    assert_bitwise_equal(deeppart.load(url), state(21), "foreign")
    if c.rank == 0:
        for key, data in FOREIGN.items():
            assert store.get(key) == data, key
    ok(c, "foreign")


def _server_signal(sig: int) -> Callable[[WriteEvent], None]:
    pid = int(os.environ["MOTO_PID"])

    def hook(ev: WriteEvent) -> None:
        if ev.rank == 0:
            os.kill(pid, sig)

    return hook


def scenario_hung(c: Comm, base: str) -> None:
    url = f"{base}/hung/step-1"
    deeppart.save(state(30), url)
    store = open_store(url)
    first = read_marker(store) if c.rank == 0 else None
    with fault_hook("after-write", _server_signal(signal.SIGSTOP)):
        got = outcome(c, "hung", "save", lambda: deeppart.save(state(31), url, overwrite=True))
    if c.rank == 0:
        os.kill(int(os.environ["MOTO_PID"]), signal.SIGCONT)
    c.barrier()
    assert "ok" not in got, got
    assert_bitwise_equal(deeppart.load(url), state(30), "hung: the previous checkpoint")
    if c.rank == 0:
        assert first is not None and read_marker(store) == first
        left = set(save_groups(store)) - {first.save_id}
        assert left, "the interrupted save's objects (rank 0's data file) are there"
    deeppart.save(state(32), url, overwrite=True)
    assert_bitwise_equal(deeppart.load(url), state(32), "hung: the next save")
    if c.rank == 0:
        marker = read_marker(store)
        assert marker is not None and save_groups(store) == [marker.save_id]
    ok(c, "hung")


def scenario_levels(c: Comm, base: str) -> None:
    from deeppart.levels import LevelConfig
    from deeppart.levels.engine import BuiltinBackend

    tmp = tempfile.mkdtemp(prefix="deeppart-levels-s3-") if c.rank == 0 else ""
    root = Path(c.allgather_varbytes(tmp.encode())[0].decode())
    glbl = f"{base}/levels"
    cfg = LevelConfig.from_dict(
        {
            "ckpt_dir": str(root / "local"),
            "meta_dir": str(root / "meta"),
            "glbl_dir": glbl,
            "node_size": 2,
            "local_test": 1,
            "ckpt_l4": 1,
            "keep": 1,
        }
    )
    be = BuiltinBackend(cfg, c)
    for step in (1, 2):
        assert be.save(step, make_state(50 + step)).level == 4
    if c.rank == 0:
        assert read_marker(open_store(f"{glbl}/deeppart/step-00000001")) is None  # retired
        assert [o.name for o in open_store(f"{glbl}/deeppart/step-00000001").list()] == []
        shutil.rmtree(root / "local" / "node1")  # node 1 lost
    c.barrier()
    got, report = BuiltinBackend(cfg, c).load()
    assert report.step == 2 and report.levels == [1, 1, 4, 4], report
    assert_bitwise_equal(got, make_state(52), "levels: node 1 from L4")
    c.barrier()
    if c.rank == 0:
        shutil.rmtree(root / "local")  # every node lost
    c.barrier()
    got, report = BuiltinBackend(cfg, c).load()
    assert report.levels == [4] * c.size, report
    assert_bitwise_equal(got, make_state(52), "levels: every node from L4")
    c.barrier()
    if c.rank == 0:
        shutil.rmtree(root / "local")
        shutil.rmtree(root / "meta")  # only the object store is left
    c.barrier()
    got, report = BuiltinBackend(cfg, c).load()
    assert report.step == 2 and report.levels == [4] * c.size, report
    assert_bitwise_equal(got, make_state(52), "levels: the L4 checkpoint alone")
    c.barrier()
    if c.rank == 0:
        shutil.rmtree(root)
    ok(c, "levels")


def scenario_truncated(c: Comm, base: str) -> None:
    url = f"{base}/truncated/step-1"
    deeppart.save(state(50), url)
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None
    plain = reader.check_file_sizes  # type: ignore[attr-defined]
    cut: list[tuple[str, bytes]] = []

    def then_cut(directory: Any, meta: Any, ranks: list[int]) -> None:
        plain(directory, meta, ranks)
        if c.rank == 1 and ranks:
            key = f"{marker.save_id}/{data_file_name(ranks[0])}"
            data = store.get(key)
            store.put(key, data[: len(data) // 2])
            cut.append((key, data))

    reader.check_file_sizes = then_cut  # type: ignore[attr-defined]
    got, kind = "", "ok"
    try:
        deeppart.load(url)
    except CorruptCheckpointError as e:
        got, kind = str(e), type(e).__name__
    finally:
        reader.check_file_sizes = plain  # type: ignore[attr-defined]
    print_line(f"RESULT truncated load rank {c.rank} {kind}")
    assert re.search(r"rank-\d{5}\.bin: truncated", got), got
    if c.rank == 1:
        assert len(cut) == 1
        store.put(*cut[0])
    c.barrier()
    assert_bitwise_equal(deeppart.load(url), state(50), "truncated: restored")
    ok(c, "truncated")


def scenario_killed(c: Comm, base: str) -> None:
    url = f"{base}/killed/step-1"
    with fault_hook("after-write", _server_signal(signal.SIGKILL)):
        got = outcome(c, "killed", "save", lambda: deeppart.save(state(40), url))
    assert "ok" not in got, got
    ok(c, "killed")


SCENARIOS = ["replicated", "race", "foreign", "hung", "levels", "truncated", "killed"]


def main() -> None:
    base = sys.argv[1]
    c = resolve(MPI.COMM_WORLD)
    for scenario in sys.argv[2:] or SCENARIOS:
        globals()[f"scenario_{scenario}"](c, base)


if __name__ == "__main__":
    abort_on_failure(main)
