"""``Checkpointer("s3://bucket/run")`` and the tools on an S3 server
(issue 34; deeppart/steps/object_steps.py, deeppart/tools/checkpoint_source.py),
against moto's S3 server (the ``s3_url`` fixture, tests/support/s3_server.py):
``keep_last`` and a rollback following the live line (2 ranks, with
background saves, in one mpiexec job: tests/checkpointer/checkpointer_s3_worker.py),
foreign objects under the prefix never deleted, a save killed before its
commit and the next save removing only that save's objects, a rollback
without ``keep_last``, and ``inspect``/``export``/``manifest`` on an
``s3://`` checkpoint. Issue 49: ranks that address different stores
(the same job: one rank on a second server) and a data file missing at
commit time never commit nor prune; a missing bucket, an unreachable
endpoint and refused credentials are one line."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart
from deeppart.errors import StoreConfigError
from deeppart.format import HEADER_SIZE, MARKER, step_dir_name
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import open_store

ROOT = Path(__file__).resolve().parents[2]
import mpi_checkpoint  # noqa: E402
from s3_server import DIE_MID_UPLOAD, S3Server, free_port, uploads  # noqa: E402

MPIEXEC = Path(sys.executable).parent / "mpiexec"
WORKER = ROOT / "tests" / "checkpointer" / "checkpointer_s3_worker.py"
RANKS = 2
TIMEOUT_S = 300
#: Neither a DeepPart save id nor DeepPart content: a user's objects.
FOREIGN_GROUP = "0123456789abcdef0123456789abcdef"


def state(v: int) -> dict[str, Any]:
    return {"w": torch.arange(256, dtype=torch.float32) + v, "step": v}


def check(ck: deeppart.Checkpointer, v: int, step: int | None = None) -> None:
    got = ck.load(step)
    assert got["step"] == v and torch.equal(got["w"], state(v)["w"])


def keys(url: str, prefix: str) -> set[str]:
    """The object keys under ``url/prefix`` (relative to ``url``)."""
    store = open_store(url)
    return {o.name for o in store.list(prefix)}


def put_foreign(url: str, names: list[str]) -> dict[str, bytes]:
    """Objects a user put under the checkpoints' prefix (not DeepPart's
    content, some under DeepPart's names), by a plain put."""
    store = open_store(url)
    out = {}
    for i, name in enumerate(names):
        data = f"the user's object {i}\n".encode()
        store.put(name, data)
        out[name] = data
    return out


def assert_untouched(url: str, foreign: dict[str, bytes]) -> None:
    store = open_store(url)
    for name, data in foreign.items():
        assert store.get(name) == data, f"{name} was changed"


# ----------------------------------------------------------------------------
# keep_last and a rollback at 2 ranks (sync and background saves).


@contextlib.contextmanager
def another_server(log: Path, checks_credentials: bool = False) -> Iterator[S3Server]:
    """A second moto server beside the session's, for one test."""
    server = S3Server(log, checks_credentials=checks_credentials)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_keep_last_rollback_and_one_store_at_two_ranks(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's scenarios ``line``, ``async`` and ``stores`` (its
    docstring); for ``stores`` a second server that has the bucket too, so
    that rank 1's upload there succeeds (before issue 49 the save then
    committed on every rank and pruned step 1)."""
    foreign = put_foreign(
        s3_url,
        [
            "line/notes.txt",
            f"line/{step_dir_name(30)}/notes.txt",
            f"line/{step_dir_name(20)}/{FOREIGN_GROUP}/rank-00000.bin",
            f"line/{step_dir_name(10)}/{FOREIGN_GROUP}/metadata.json",
            "async/README",
        ],
    )
    cmd = [str(MPIEXEC), "-n", str(RANKS), sys.executable, str(WORKER), s3_url]
    with another_server(tmp_path / "other.log") as other:
        other.make_bucket(s3_url[len("s3://") :])
        monkeypatch.setenv("DEEPPART_TEST_OTHER_ENDPOINT", other.endpoint)
        proc = mpi_checkpoint.launch(cmd, TIMEOUT_S, ROOT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-8000:]}"
    for scenario in ("line", "async", "stores"):
        oks = set(re.findall(rf"OK {scenario} rank \d+/{RANKS}", proc.stdout))
        assert len(oks) == RANKS, out[-8000:]
    assert_untouched(s3_url, foreign)
    # The pruned (10, 20) and abandoned (30) steps: only the user's objects stay.
    for step in (10, 20, 30):
        left = keys(s3_url, f"line/{step_dir_name(step)}")
        assert left == {n for n in foreign if n.startswith(f"line/{step_dir_name(step)}/")}, left
    for step in (21, 22):
        assert f"line/{step_dir_name(step)}/{MARKER}" in keys(s3_url, f"line/{step_dir_name(step)}")
    assert {n.split("/")[1] for n in keys(s3_url, "async")} == {"README", step_dir_name(3)}


# ----------------------------------------------------------------------------
# A save killed before its commit.

KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, torch
    import deeppart
    from deeppart.saving.writer import fault_hook

    def die(event):
        os._exit(17)  # killed once its data file is uploaded, before the metadata

    with fault_hook("after-write", die):
        deeppart.Checkpointer(sys.argv[1]).save(
            20, {"w": torch.arange(256, dtype=torch.float32) + 20, "step": 20}
        )
    """
)


def test_a_killed_save_is_removed_by_the_next_save_and_nothing_else(s3_url: str) -> None:
    root = f"{s3_url}/run"
    ck = deeppart.Checkpointer(root, keep_last=3)
    ck.save(10, state(10))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, root], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stdout + proc.stderr
    killed = keys(s3_url, f"run/{step_dir_name(20)}")
    assert {k.rsplit("/", 1)[1] for k in killed} == {"rank-00000.bin", "SAVING"}, killed
    assert ck.steps() == [10] and ck.latest() == 10, "an uncommitted step is not a step"
    foreign = put_foreign(
        s3_url,
        [
            f"run/{step_dir_name(20)}/notes.txt",
            f"run/{step_dir_name(20)}/{FOREIGN_GROUP}/rank-00000.bin",
        ],
    )
    ck.save(30, state(30))
    assert ck.steps() == [10, 30]
    assert keys(s3_url, f"run/{step_dir_name(20)}") == set(foreign), "only the killed save's go"
    assert_untouched(s3_url, foreign)
    check(ck, 10, 10)
    check(ck, 30)


KILLED_MID_UPLOAD = DIE_MID_UPLOAD + textwrap.dedent(
    """
    import sys, torch
    import deeppart

    deeppart.Checkpointer(sys.argv[1]).save(
        20, {"w": torch.arange(4 << 20, dtype=torch.float32), "step": 20}
    )
    """
)


def test_a_save_killed_mid_upload_has_its_uploads_aborted_by_the_next_save(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save killed while its data file is a multipart upload in progress
    (invisible to listing): the next save aborts that upload and removes
    the save's SAVING object, identified by it; the user's uploads under
    the prefix, under another group and under the killed save's own id
    with another name, stay."""
    import boto3

    monkeypatch.setenv("DEEPPART_S3_PART_BYTES", str(5 << 20))
    root = f"{s3_url}/run"
    step = f"run/{step_dir_name(20)}"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_UPLOAD, root], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 17, proc.stdout + proc.stderr
    left = keys(s3_url, step)
    assert {k.rsplit("/", 1)[1] for k in left} == {"SAVING"}, left
    save_id = next(iter(left)).split("/")[2]
    ours = uploads(s3_url, step)
    assert ours == {f"{step}/{save_id}/rank-00000.bin"}, ours
    bucket = s3_url[len("s3://") :]
    client = boto3.client("s3")
    theirs = {f"{step}/{FOREIGN_GROUP}/rank-00000.bin", f"{step}/notes.bin",
              f"{step}/{save_id}/mine.bin"}  # fmt: skip
    for key in theirs:
        client.create_multipart_upload(Bucket=bucket, Key=key)
    ck = deeppart.Checkpointer(root)
    ck.save(30, state(30))
    assert uploads(s3_url, step) == theirs, "only the killed save's upload is aborted"
    assert keys(s3_url, step) == set(), "its SAVING object is removed"
    assert ck.steps() == [30]
    check(ck, 30)


# ----------------------------------------------------------------------------
# A rollback without keep_last: nothing is moved (no rename in S3).


def test_rollback_without_keep_last_leaves_the_left_line_where_it_is(s3_url: str) -> None:
    root = f"{s3_url}/run"
    ck = deeppart.Checkpointer(root)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    check(ck, 20, 20)
    ck.save(21, state(21))
    assert ck.steps() == [10, 20, 21] and ck.latest() == 21
    restart = deeppart.Checkpointer(root)
    assert restart.latest() == 21, "a restart never resumes the left line"
    check(restart, 30, 30)  # still there, loadable by its number
    check(restart, 21)
    restart.save(30, state(1030))  # the new line's step 30 replaces the left one
    assert restart.steps() == [10, 20, 21, 30]
    again = deeppart.Checkpointer(root)
    assert again.latest() == 30
    check(again, 1030, 30)


def test_an_existing_step_is_refused_and_overwrite_replaces_it(s3_url: str) -> None:
    root = f"{s3_url}/run"
    ck = deeppart.Checkpointer(root, keep_last=2)
    ck.save(10, state(10))
    with pytest.raises(deeppart.CheckpointError):
        deeppart.Checkpointer(root).save(10, state(11))
    check(ck, 10)
    ck.save(10, state(12), overwrite=True)
    check(ck, 12)
    assert ck.steps() == [10]
    # Only the replacing save's objects are left.
    groups = {
        k.split("/")[2] for k in keys(s3_url, f"run/{step_dir_name(10)}") if k.count("/") == 3
    }
    assert len(groups) == 1, groups


def test_a_damaged_newest_step_is_reported_and_kept(s3_url: str) -> None:
    """Issue 49, item 2, on S3: one bit flipped in the newest step's
    metadata.json (keep_last=1): latest(), steps() and load() raise
    CorruptCheckpointError naming it (before: latest() was None, then
    "a committed checkpoint exists"), and no save replaces it."""
    root = f"{s3_url}/damaged"
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(1, state(1))
    ck.save(2, state(2))
    store = open_store(root)
    meta = next(k for k in keys(root, step_dir_name(2)) if k.endswith("/metadata.json"))
    data = bytearray(store.get(meta))
    data[-10] ^= 0x01
    store.put(meta, bytes(data))
    evidence = {k: store.get(k) for k in keys(root, step_dir_name(2))}
    ck = deeppart.Checkpointer(root, keep_last=1)
    for call in (ck.latest, ck.steps, ck.load):
        with pytest.raises(deeppart.CorruptCheckpointError, match="step 2"):
            call()
    for overwrite in (False, True):
        with pytest.raises(deeppart.CorruptCheckpointError, match="kept as evidence"):
            ck.save(2, state(3), overwrite=overwrite)
    assert {k: store.get(k) for k in keys(root, step_dir_name(2))} == evidence


# ----------------------------------------------------------------------------
# inspect, export, manifest on an s3:// checkpoint.


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deeppart", *args], capture_output=True, text=True, timeout=120
    )


def tools_state() -> dict[str, Any]:
    return {
        "model": {
            "layer.weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
            "layer.bias": torch.arange(64, dtype=torch.float16),
        },
        "step": 7,
    }


def test_inspect_verifies_an_s3_checkpoint_and_names_a_corrupt_object(s3_url: str) -> None:
    url = f"{s3_url}/ck/step-7"
    deeppart.save(tools_state(), url)
    proc = cli("inspect", url, "--verify", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["directory"] == url and info["committed"] is True
    assert info["verify"]["ok"] and info["verify"]["pieces_checked"] > 0
    (data_key,) = [k for k in keys(s3_url, "ck/step-7") if k.endswith("rank-00000.bin")]
    raw = open_store(s3_url).get(data_key)
    flipped = bytearray(raw)
    flipped[HEADER_SIZE + 5] ^= 0xFF
    open_store(s3_url).put(data_key, bytes(flipped))
    proc = cli("inspect", url, "--verify", "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = json.loads(proc.stdout)["verify"]["failures"]
    assert failures and failures[0]["file"] == f"{s3_url}/{data_key}"
    assert "checksum" in failures[0]["reason"]
    proc = cli("inspect", f"{s3_url}/ck/nothing-here")
    assert proc.returncode == 2 and "no committed checkpoint" in proc.stderr, proc.stderr


def test_export_and_manifest_read_an_s3_checkpoint(s3_url: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    url = f"{s3_url}/ck/step-7"
    saved = tools_state()
    deeppart.save(saved, url)
    proc = cli("export", url, "--to", "safetensors", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert got.keys() == saved["model"].keys()
    for name, tensor in saved["model"].items():
        assert torch.equal(got[name], tensor)
    proc = cli("export", url, "--to", "torch", str(tmp_path / "all.pt"))
    assert proc.returncode == 0, proc.stderr
    whole = torch.load(tmp_path / "all.pt", weights_only=True)
    assert whole["step"] == 7 and torch.equal(
        whole["model"]["layer.bias"], saved["model"]["layer.bias"]
    )
    proc = cli("import", str(tmp_path / "all.pt"), f"{s3_url}/imported")
    assert proc.returncode == 0, proc.stderr
    back = deeppart.load(f"{s3_url}/imported")
    assert back["step"] == 7 and torch.equal(
        back["model"]["layer.weight"], saved["model"]["layer.weight"]
    )
    proc = cli("manifest", url)
    assert proc.returncode == 0, proc.stderr
    manifest = deeppart.Manifest.from_json(proc.stdout)
    assert len(manifest.leaves()) == 3
    proc = cli("export", f"{s3_url}/ck/absent", "--to", "torch", str(tmp_path / "x.pt"))
    assert proc.returncode != 0 and "no committed checkpoint" in proc.stderr, proc.stderr
    assert not (tmp_path / "x.pt").exists()


# ----------------------------------------------------------------------------
# Issue 49: a commit names only what the store holds; a store that cannot be
# used is one line.


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_commit_never_names_a_data_file_the_store_does_not_hold(
    where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A data file gone from the store (an object removed) or cut short (a
    file truncated) between its write and the commit: the save raises
    StoreConfigError naming it, nothing is committed, and ``keep_last``
    prunes nothing: step 1 stays and loads. (Before issue 49 step 2
    committed, step 1 was pruned, and step 2 could not be loaded.)"""
    s3 = where == "s3"
    root = f"{request.getfixturevalue('s3_url')}/run" if s3 else tmp_path / "run"
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(1, state(1))

    def damage(event: WriteEvent) -> None:
        if s3:
            store = open_store(str(ck.location(2)))
            for o in store.list():
                if o.name.endswith("/rank-00000.bin"):
                    store.delete(o.name)
        else:
            os.truncate(event.path, event.path.stat().st_size - 1)

    said = r"rank-00000\.bin missing" if s3 else r"rank-00000\.bin has (\d+) bytes, (\d+) written"
    with (
        fault_hook("after-write", damage),
        pytest.raises(StoreConfigError, match=said + ".*nothing was committed") as got,
    ):
        ck.save(2, state(2))
    if not s3:
        short, written = (int(x) for x in re.findall(said, str(got.value))[0])
        assert short == written - 1
    assert ck.steps() == [1] and ck.latest() == 1
    check(ck, 1, 1)
    if s3:
        assert keys(request.getfixturevalue("s3_url"), f"run/{step_dir_name(2)}") == set()
    else:
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [step_dir_name(1)]


def refusals(*runs: Callable[[], object]) -> list[str]:
    """The message of the StoreConfigError each of ``runs`` raises, checked
    to be one line of at most 400 characters (the client's error is its
    cause, not its text)."""
    said = []
    for run in runs:
        with pytest.raises(StoreConfigError) as got:
            run()
        text = str(got.value)
        assert "\n" not in text and len(text) <= 400, text
        assert got.value.__cause__ is not None
        said.append(text)
    return said


def save_and_load(url: str) -> tuple[Callable[[], object], Callable[[], object]]:
    return lambda: deeppart.save(state(1), url), lambda: deeppart.load(url)


def test_a_missing_bucket_is_one_line_on_save_and_load(s3_url: str) -> None:
    """Issue 49, item 13: a save (plain, and a Checkpointer's) and a load at
    a bucket that does not exist raise StoreConfigError, one line naming
    the bucket and the endpoint (before: a 27-line NoSuchBucket dump on
    save, "no COMMITTED marker" on load)."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    url = s3_url.replace("s3://", "s3://deeppart-no-such-", 1) + "/run"
    bucket = url[len("s3://") :].split("/")[0]
    runs = (*save_and_load(f"{url}/step-1"), lambda: deeppart.Checkpointer(url).save(1, state(1)))
    for said in refusals(*runs, lambda: deeppart.Checkpointer(url).load()):
        assert f"the bucket '{bucket}' does not exist at {endpoint}" in said, said


def test_an_unreachable_endpoint_and_refused_credentials_are_one_line(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An endpoint where nothing listens, and a server that refuses the
    credentials (moto checking keys against its IAM): StoreConfigError on
    save and load, one line naming the endpoint (and the bucket)."""
    bucket = s3_url[len("s3://") :]
    nobody = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", nobody)
    monkeypatch.setenv("DEEPPART_S3_MAX_RETRIES", "0")
    for said in refusals(*save_and_load(f"{s3_url}/a")):
        assert f"cannot reach the endpoint {nobody}" in said and "connection refused" in said
    with another_server(tmp_path / "auth.log", checks_credentials=True) as strict:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        for said in refusals(*save_and_load(f"{s3_url}/a")):
            assert f"{strict.endpoint} refused access to the bucket '{bucket}'" in said, said
