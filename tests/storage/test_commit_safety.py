"""Commits are exclusive and touch only their own files (issue 31, items
3, 4, 5, 7, 8, 10, 11): the final rename never replaces anything, a save
that finds its target taken at commit time fails and leaves it as it is,
DeepPart tells its files from a user's by content, a failed asynchronous
save is reported at exit, the planner service answers an overflowing cost
model with INVALID_ARGUMENT, no temporary file outlives its writer, and a
URL is not taken for a local path. Every test compares the user's files
before and after."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deeppart
from deeppart.errors import CommitConflictError, ForeignPathError, UnsupportedURLError
from deeppart.format import MAGIC, is_committed, step_dir_name
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import commit
from deeppart.storage.ownership import foreign_entries, local_path, owned_dir, remove_owned

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def state(v: float = 1.0) -> dict[str, Any]:
    return {"w": np.full(5000, v, dtype=np.float32), "step": int(v)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(np.array_equal(a["w"], b["w"])) and a["step"] == b["step"]


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]


@pytest.fixture(params=["renameat2", "fallback"])
def rename_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each commit test with libc's renameat2 and with the check + rename
    fallback of file systems (or systems) that lack it."""
    if request.param == "renameat2" and not commit.has_renameat2():
        pytest.skip("no renameat2 in this libc")
    if request.param == "fallback":
        monkeypatch.setattr(commit, "_renameat2", None)
    yield request.param


# ----------------------------------------------------------------------------
# The rename itself.


def test_rename_noreplace_never_replaces(tmp_path: Path, rename_kind: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("new")
    for existing in ("empty-dir", "full-dir", "file"):
        dst = tmp_path / existing
        if existing == "file":
            dst.write_text("mine")
        else:
            dst.mkdir()
            if existing == "full-dir":
                (dst / "notes.txt").write_text("mine")
        with pytest.raises(FileExistsError):
            commit.rename_noreplace(src, dst)
        assert (src / "a").read_text() == "new"
    assert (tmp_path / "file").read_text() == "mine"
    assert (tmp_path / "full-dir" / "notes.txt").read_text() == "mine"
    commit.rename_noreplace(src, tmp_path / "free")
    assert (tmp_path / "free" / "a").read_text() == "new" and not src.exists()


def test_fallback_race_window_loses_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without renameat2, a target that appears between the check and the
    rename: rename(2) refuses a non-empty directory or a file, and the
    commit sees that as the target taken."""
    monkeypatch.setattr(commit, "_renameat2", None)
    monkeypatch.setattr(os.path, "lexists", lambda p: False)  # the check "passes"
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("new")
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("mine")
    for dst in (full, tmp_path / "file"):
        with pytest.raises(FileExistsError):
            commit.rename_noreplace(src, dst)
    assert (full / "notes.txt").read_text() == "mine"
    assert (tmp_path / "file").read_text() == "mine"
    assert (src / "a").read_text() == "new"


# ----------------------------------------------------------------------------
# Item 4: two saves to one directory, both with overwrite=False.


def test_second_commit_to_one_directory_fails_and_the_first_stays(
    tmp_path: Path, rename_kind: str
) -> None:
    """Save B writes; between its write and its commit, save A commits the
    same directory. B must fail with CommitConflictError and leave A's
    checkpoint as A wrote it."""
    target = tmp_path / "ck"
    first, second = state(1.0), state(2.0)
    done: list[bool] = []

    def other_job_commits(event: WriteEvent) -> None:
        if not done:  # only in B's write (A's own write fires the hook too)
            done.append(True)
            deeppart.save(first, target)

    with (
        fault_hook("after-write", other_job_commits),
        pytest.raises(CommitConflictError, match="another save committed"),
    ):
        deeppart.save(second, target)
    assert is_committed(target)
    assert same(deeppart.load(target), first)
    no_leftovers(tmp_path)


def test_racing_saves_in_processes_one_wins(tmp_path: Path) -> None:
    """Two processes save to one directory (overwrite=False), each paused
    after its write until both have written: exactly one succeeds, the other
    raises CommitConflictError, and the checkpoint is the winner's."""
    target = tmp_path / "ck"
    code = f"""
import sys, time
from pathlib import Path
import numpy as np
import deeppart
from deeppart.errors import CommitConflictError
from deeppart.saving.writer import add_fault_hook
me = int(sys.argv[1])
flags = Path({str(tmp_path)!r})
def pause(event):
    (flags / f"written-{{me}}").touch()
    while not (flags / f"written-{{1 - me}}").exists():
        time.sleep(0.01)
add_fault_hook("after-write", pause)
try:
    deeppart.save({{"w": np.full(1000, me, dtype=np.float32)}}, {str(target)!r})
    print("OK")
except CommitConflictError as e:
    print("CONFLICT", e)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True, env=env
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=WAIT_S)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    winners = [i for i, o in enumerate(outs) if o == "OK"]
    assert len(winners) == 1, outs
    assert outs[1 - winners[0]].startswith("CONFLICT"), outs
    assert np.all(deeppart.load(target)["w"] == winners[0])
    no_leftovers(tmp_path)


# ----------------------------------------------------------------------------
# Item 3: a user's file put into the target while the save writes.


def test_async_save_keeps_a_file_put_into_the_target_meanwhile(tmp_path: Path) -> None:
    target = tmp_path / "ck"

    def user_adds_config(event: WriteEvent) -> None:
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text('{"lr": 0.1}')

    with fault_hook("after-write", user_adds_config):
        handle = deeppart.async_save(state(), target)
        with pytest.raises(CommitConflictError, match=r"config\.json"):
            handle.wait(WAIT_S)
    assert (target / "config.json").read_text() == '{"lr": 0.1}'
    assert sorted(p.name for p in target.iterdir()) == ["config.json"]
    no_leftovers(tmp_path)


def test_overwrite_keeps_a_file_put_into_the_old_checkpoint_meanwhile(
    tmp_path: Path, rename_kind: str
) -> None:
    """overwrite=True replaces only a committed DeepPart checkpoint, checked
    again at commit time: a file the user added in between keeps both."""
    target = tmp_path / "ck"
    deeppart.save(state(1.0), target)

    def user_adds_notes(event: WriteEvent) -> None:
        (target / "notes.txt").write_text("mine")

    with (
        fault_hook("after-write", user_adds_notes),
        pytest.raises(CommitConflictError, match=r"notes\.txt"),
    ):
        deeppart.save(state(2.0), target, overwrite=True)
    assert (target / "notes.txt").read_text() == "mine"
    assert same(deeppart.load(target), state(1.0))
    no_leftovers(tmp_path)


def test_overwrite_replaces_a_committed_checkpoint_and_an_empty_directory(
    tmp_path: Path, rename_kind: str
) -> None:
    target = tmp_path / "ck"
    deeppart.save(state(1.0), target)
    deeppart.save(state(2.0), target, overwrite=True)
    assert same(deeppart.load(target), state(2.0))
    empty = tmp_path / "empty"
    empty.mkdir()
    deeppart.save(state(3.0), empty)
    assert same(deeppart.load(empty), state(3.0))
    no_leftovers(tmp_path)


# ----------------------------------------------------------------------------
# Item 5: recognised by content, not by name.


def test_a_users_metadata_json_is_not_deepparts(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir()
    (target / "metadata.json").write_text('{"dataset": "imagenet"}')
    for overwrite in (False, True):
        with pytest.raises(ForeignPathError, match=r"metadata\.json"):
            deeppart.save(state(), target, overwrite=overwrite)
    assert (target / "metadata.json").read_text() == '{"dataset": "imagenet"}'
    assert foreign_entries(target) == ["metadata.json"]
    assert not owned_dir(target)
    no_leftovers(tmp_path)


def test_checkpointer_keeps_a_users_step_dir_holding_only_metadata_json(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    users = root / step_dir_name(5)
    users.mkdir()
    (users / "metadata.json").write_text('{"note": "eval of step 5"}')
    fake_rank = root / step_dir_name(6)
    fake_rank.mkdir()
    (fake_rank / "rank-00000.bin").write_bytes(b"my own binary, not DeepPart's")
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(10, state())
    ck.save(11, state())
    assert (users / "metadata.json").read_text() == '{"note": "eval of step 5"}'
    assert (fake_rank / "rank-00000.bin").read_bytes() == b"my own binary, not DeepPart's"
    assert ck.steps() == [11]


def test_remove_owned_removes_only_deepparts_files(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    deeppart.save(state(), d)
    (d / "rank-00001.bin").write_bytes(b"not a data file")
    assert remove_owned(d) == ["rank-00001.bin"]
    assert is_committed(d)  # nothing was removed
    (d / "rank-00001.bin").unlink()
    assert remove_owned(d) == [] and not d.exists()


def test_an_old_checkpoint_keeps_files_of_another_save(tmp_path: Path) -> None:
    """A data file whose header names another save is not this
    checkpoint's: removing the checkpoint leaves it."""
    a, b = tmp_path / "a", tmp_path / "b"
    deeppart.save(state(1.0), a)
    deeppart.save(state(2.0), b)
    from deeppart.storage.ownership import metadata_save_id

    id_a, id_b = metadata_save_id(a), metadata_save_id(b)
    assert id_a and id_b and id_a != id_b
    assert (a / "rank-00000.bin").read_bytes()[:8] == MAGIC
    assert foreign_entries(a, save_id=id_b) == ["metadata.json", "rank-00000.bin"]
    assert foreign_entries(a, save_id=id_a) == []


# ----------------------------------------------------------------------------
# Item 7: a failed final asynchronous save is reported at exit.


def test_failed_async_save_at_exit_is_printed_to_stderr(tmp_path: Path) -> None:
    """The script's last async save fails (ENOSPC from a fault hook) and it
    ends without wait() or close(): the error is printed to stderr. The
    exit status stays the script's own (docs/ASYNC.md)."""
    code = f"""
import errno, os
import numpy as np
import deeppart
from deeppart.saving.writer import add_fault_hook
def full(event):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(event.path))
deeppart.async_save({{"w": np.ones(100, dtype=np.float32)}}, {str(tmp_path / "a")!r}).wait()
ck = deeppart.Checkpointer({str(tmp_path / "root")!r}, async_=True)
add_fault_hook("before-write", full)
ck.save(1, {{"w": np.ones(100, dtype=np.float32)}})
print("script done")
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert "script done" in proc.stdout
    assert "step-00000001" in proc.stderr and "FAILED" in proc.stderr, proc.stderr
    assert os.strerror(errno.ENOSPC) in proc.stderr, proc.stderr
    assert proc.stderr.count("FAILED") == 1, proc.stderr  # the first one succeeded, seen
    assert proc.returncode == 0
    assert not (tmp_path / "root" / "step-00000001").exists()


def test_a_failed_async_save_is_raised_by_the_next_save_wait_or_close(tmp_path: Path) -> None:
    def full(event: WriteEvent) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(event.path))

    for then in ("save", "wait", "close"):
        ck = deeppart.Checkpointer(tmp_path / then, async_=True)
        with fault_hook("before-write", full):
            ck.save(1, state())
            assert ck._async is not None and ck._async.pending is not None
            ck._async.pending.exception(WAIT_S)  # finished, error not seen yet
            ck._async.pending._seen = False
        with pytest.raises(OSError, match=os.strerror(errno.ENOSPC)):
            if then == "save":
                ck.save(2, state())
            else:
                getattr(ck, then)()
        ck.close()


# ----------------------------------------------------------------------------
# Item 8: an overflowing cost model is INVALID_ARGUMENT.


def test_service_answers_an_overflowing_cost_model_with_invalid_argument(tmp_path: Path) -> None:
    grpc = pytest.importorskip("grpc")
    from deeppart.proto import planner_pb2 as pb
    from deeppart.service import wire
    from deeppart.service.server import JsonLog, PlannerServer, ServerConfig

    m = deeppart.Manifest.from_leaves([{"path": ["w"], "dtype": "float32", "shape": [1000]}])
    req = pb.PlanRequest(
        plan_fingerprint="a" * 64,
        manifest_fingerprint=m.fingerprint,
        world_size=2,
        algorithm="balanced",
        planner_version=deeppart.PLANNER_VERSION,
        cost=pb.CostModel(align_bytes=2**63),
    )
    req.manifest.CopyFrom(wire.manifest_to_proto(m))
    cfg = ServerConfig(listen="127.0.0.1:0", cache_dir=tmp_path / "cache", grace_s=5.0)
    server = PlannerServer(cfg, JsonLog(io.StringIO())).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = channel.unary_unary("/deeppart.planner.v1.Planner/Plan")
            with pytest.raises(grpc.RpcError) as e:
                call(req.SerializeToString(), timeout=WAIT_S)
    finally:
        server.stop()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "out of range" in e.value.details()


# ----------------------------------------------------------------------------
# Item 10: leftovers.


def test_the_service_removes_temp_files_of_killed_writers(tmp_path: Path) -> None:
    pytest.importorskip("grpc")
    from deeppart.service.server import DiskBudget, JsonLog

    store = tmp_path / "manifests"
    store.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = store / f".{'a' * 64}.pb.{dead.pid}.{threading.get_ident()}.tmp"
    stale.write_bytes(b"half a manifest")
    live = store / f".{'b' * 64}.pb.{os.getpid()}.{threading.get_ident()}.tmp"
    live.write_bytes(b"being written")
    users = store / "README.tmp"
    users.write_text("mine")
    DiskBudget(store, 1 << 20, JsonLog(io.StringIO()), "manifests")
    assert not stale.exists()
    assert live.exists() and users.read_text() == "mine"


def test_the_service_leaves_no_temp_file_after_sigkill_and_restart(tmp_path: Path) -> None:
    """A service killed while writing a manifest (SIGKILL between the temp
    file and its rename): its next start removes the temp file."""
    pytest.importorskip("grpc")
    cache = tmp_path / "cache"
    code = f"""
import io, os, signal
from pathlib import Path
from deeppart.service import server
from deeppart.service.server import JsonLog, ManifestStore
real = os.replace
def killed(src, dst):
    os.kill(os.getpid(), signal.SIGKILL)
store = ManifestStore(Path({str(cache / "manifests")!r}), JsonLog(io.StringIO()))
server.os.replace = killed
server.atomic_write(store.directory / ("c" * 64 + ".pb"), b"x" * 100)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], timeout=WAIT_S, env=dict(os.environ, PYTHONPATH=str(ROOT))
    )
    assert proc.returncode == -9
    temps = [p.name for p in (cache / "manifests").iterdir() if p.name.endswith(".tmp")]
    assert len(temps) == 1
    from deeppart.service.server import JsonLog, ManifestStore

    ManifestStore(cache / "manifests", JsonLog(io.StringIO()))
    assert not [p.name for p in (cache / "manifests").iterdir() if p.name.endswith(".tmp")]


def test_recovery_store_over_a_directory_leaves_no_tmp(tmp_path: Path) -> None:
    """Recovery rewrites a lost file under a temporary name; where the
    final name is a directory the rename fails, and the temporary file
    must not stay."""
    from deeppart.levels import recovery

    local = tmp_path / "node0" / "step-00000001"
    (local / "rank-00000.bin").mkdir(parents=True)
    buf = np.frombuffer(MAGIC + bytes(100), dtype=np.uint8)
    assert recovery.store(local / "rank-00000.bin", buf) == ""
    assert sorted(p.name for p in local.iterdir()) == ["rank-00000.bin"]
    assert recovery.store(local / "partner-00001.bin", buf) == str(local / "partner-00001.bin")
    assert sorted(p.name for p in local.iterdir()) == ["partner-00001.bin", "rank-00000.bin"]


# ----------------------------------------------------------------------------
# Item 11: a URL is not a local path.

URL = "s3://bucket/run/step-1"


def test_local_path_refuses_urls() -> None:
    for url in (URL, "gs://b/x", "file:///tmp/x", "hdfs://nn:8020/x", Path(URL)):
        with pytest.raises(UnsupportedURLError, match="file system paths only"):
            local_path(url)
    assert local_path("runs/s3-step:1") == Path("runs/s3-step:1")
    assert local_path("C:/x") == Path("C:/x")


#: A scheme no entry point serves (s3:// is served: tests/storage/test_storage.py,
#: tests/checkpointer/test_checkpointer_s3.py).
UNSERVED = "gs://bucket/run/step-1"


def test_every_entry_point_refuses_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every entry point that takes a checkpoint refuses a scheme DeepPart
    does not serve; export writes local files only (an s3:// output is
    refused too). None makes a local directory of the URL's name."""
    monkeypatch.chdir(tmp_path)
    calls: list[tuple[str, Any]] = [
        ("save", lambda: deeppart.save(state(), UNSERVED)),
        ("load", lambda: deeppart.load(UNSERVED)),
        ("async_save", lambda: deeppart.async_save(state(), UNSERVED).wait()),
        ("Checkpointer", lambda: deeppart.Checkpointer(UNSERVED).save(1, state())),
    ]
    torch = pytest.importorskip("torch")
    deeppart.save({"model": {"w": torch.ones(4)}}, tmp_path / "ck")
    torch.save({"w": torch.ones(4)}, tmp_path / "x.pt")
    from deeppart.tools import export

    calls += [
        ("export_torch src", lambda: export.export_torch(UNSERVED, tmp_path / "out.pt")),
        ("export_torch out", lambda: export.export_torch(tmp_path / "ck", URL)),
        ("import", lambda: export.import_checkpoint(tmp_path / "x.pt", UNSERVED)),
    ]
    if _has("safetensors"):
        calls.append(
            ("export_safetensors", lambda: export.export_safetensors(tmp_path / "ck", URL))
        )
    for name, call in calls:
        with pytest.raises(UnsupportedURLError, match=r"(gs|s3):// URL"):
            call()
        assert not (tmp_path / "s3:").exists() and not (tmp_path / "gs:").exists(), name
    for args in (
        ["inspect", UNSERVED],
        ["export", UNSERVED, str(tmp_path / "o.pt"), "--to", "torch"],
        ["manifest", UNSERVED],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "deeppart", *args],
            capture_output=True,
            text=True,
            timeout=WAIT_S,
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert proc.returncode == 2 and "gs:// URL" in proc.stderr, (args, proc.stderr)
    assert not (tmp_path / "gs:").exists()


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
