"""The built-in multi-level engine's L4 level in an object store (issue 34:
``glbl_dir = s3://bucket/prefix``) against moto's S3 server
(tests/support/s3_server.py), in one process: the L4 save, recovery from it once
every node-local directory is gone (with and without ``meta_dir``), the
removal of old steps' and interrupted saves' objects and the abort of
an interrupted save's multipart upload (never a foreign object or
upload), and the config errors (other schemes, the FTI backend). The
multi-rank case is the ``levels`` scenario of tests/storage/s3_worker.py."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from s3_server import DIE_MID_UPLOAD, uploads
from thread_comm import run_ranks, thread_comms

import deeppart
from deeppart.errors import LevelConfigError, UnsupportedURLError
from deeppart.format import MARKER
from deeppart.levels import LevelConfig, open_backend
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels.layout import Layout
from deeppart.steps import lineage
from deeppart.storage import S3URL, open_store
from deeppart.storage.objects import read_marker, save_groups

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0
STEP = "step-{:08d}"


def state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(20_000, generator=gen),
        "b": torch.randn(7, generator=gen).to(torch.bfloat16),
        "n": seed,
    }


def assert_bitwise(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert set(got) == set(want)
    for k in ("w", "b"):
        assert got[k].dtype == want[k].dtype
        assert got[k].view(torch.uint8).tolist() == want[k].view(torch.uint8).tolist(), k
    assert got["n"] == want["n"]


def config(tmp_path: Path, glbl: str, **kw: Any) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(tmp_path / "local"),
            "meta_dir": str(tmp_path / "meta"),
            "glbl_dir": glbl,
            **kw,
        }
    )


def parent_of(lines: lineage.Lines, step: int) -> tuple[int, int] | None:
    """Step ``step``'s parent, as its step and seq."""
    p = lines.nodes[step].parent
    return None if p is None else (p.step, p.seq)


def names(url: str) -> list[str]:
    return sorted(o.name for o in open_store(url).list())


def test_l4_in_s3_recovers_without_local_files(s3_url: str, tmp_path: Path) -> None:
    """An L4 save writes a normal checkpoint under glbl_dir's prefix; with
    every node-local directory deleted, recovery reads this rank's file
    from the object store (RecoveryReport: L4) and rewrites it; with
    ``meta_dir`` gone too, the L4 checkpoint alone serves the load."""
    glbl = f"{s3_url}/glbl"
    c = config(tmp_path, glbl, ckpt_l4=2, keep=2)
    be = BuiltinBackend(c)
    assert be.global_step(2) == S3URL(s3_url[len("s3://") :], f"glbl/deeppart/{STEP.format(2)}")
    assert be.save(1, state(1)).level == 1
    assert be.save(2, state(2)).level == 4
    step2 = f"{glbl}/deeppart/{STEP.format(2)}"
    marker = read_marker(open_store(step2))
    assert marker is not None and save_groups(open_store(step2)) == [marker.save_id]
    assert names(f"{glbl}/deeppart") == sorted(
        [
            f"{STEP.format(2)}/{MARKER}",
            f"{STEP.format(2)}/{marker.save_id}/metadata.json",
            f"{STEP.format(2)}/{marker.save_id}/rank-00000.bin",
        ]
    )
    meta = json.loads(
        (tmp_path / "meta" / "deeppart" / STEP.format(2) / "metadata.json").read_text()
    )
    assert meta["levels"]["glbl_dir"] == glbl  # the URL, not a local path made of it
    assert meta["levels"]["level"] == 4
    assert_bitwise(deeppart.load(step2), state(2))  # any job can load it

    shutil.rmtree(tmp_path / "local")
    fresh = BuiltinBackend(c)
    assert fresh.latest() == 2 and fresh.committed_steps() == [1, 2]
    got, report = fresh.load()
    assert report.step == 2 and report.levels == [4]
    assert report.rewritten == [str(fresh.local_step(2) / "rank-00000.bin")]
    assert_bitwise(got, state(2))
    got, report = BuiltinBackend(c).load()  # the rewritten L1 file now serves
    assert report.levels == [1]
    assert_bitwise(got, state(2))

    # Node-local storage and meta_dir gone: the object store alone.
    shutil.rmtree(tmp_path / "local")
    shutil.rmtree(tmp_path / "meta")
    fresh = BuiltinBackend(c)
    assert fresh.latest() == 2 and fresh.committed_steps() == [2]
    got, report = fresh.load()
    assert report.step == 2 and report.levels == [4]
    assert_bitwise(got, state(2))
    # Step 1 was L1 only: lost with the node-local directories.
    with pytest.raises(deeppart.CheckpointError, match="step 1"):
        fresh.load(1)


def rank_state(rank: int, seed: int) -> dict[str, Any]:
    """Rank ``rank``'s own state (per-rank tensors and values)."""
    return {**state(seed * 10 + rank), "n": seed * 10 + rank}


def store_requests(server: Any, bucket: str) -> int:
    """The requests for ``bucket`` that the server has logged, counted
    once a request made now has been logged (each request's line is
    written after its answer; one made after the others is logged after
    theirs)."""
    probe = f"probe-{os.urandom(6).hex()}"
    assert server.get_raw(bucket, probe) is None
    for _ in range(200):
        lines = server.log.read_text(errors="replace").splitlines()
        if any(probe in line for line in lines):
            return sum(1 for line in lines if f"/{bucket}" in line and "probe-" not in line)
        time.sleep(0.05)
    raise AssertionError(f"{server.log}: the probe request was never logged")


def test_memory_served_load_reads_nothing_from_the_store(
    s3_url: str, s3_server: Any, tmp_path: Path
) -> None:
    """4 ranks (threads, one per node, groups of 4), L4 in the store, L2
    steps beside it: with node 3's node-local files gone, a load served
    by the survivors' files and partner copies sends no request to the
    store (counted in the server's log), and the next saves still
    continue the line from the store's steps too: an L4 save after it
    numbers its step above every committed one with the loaded step as
    parent, older steps intact; after a rollback, a step only the store
    holds (newer than every step in ``meta_dir``) is outnumbered, not
    retired, while the step of the line left behind is."""
    glbl = f"{s3_url}/glbl"
    bucket = s3_url[len("s3://") :]
    c = config(tmp_path, glbl, local_test=1, node_size=1, group_size=4, ckpt_l2=1, keep=10)
    world = 4

    def backends() -> list[BuiltinBackend]:
        comms = thread_comms(world)
        return [BuiltinBackend(c, comms[r]) for r in range(world)]

    def on_ranks(job: list[BuiltinBackend], fn: Any) -> list[Any]:
        out = run_ranks([functools.partial(fn, job[r], r) for r in range(world)])
        for _, err in out:
            if err is not None:
                raise err
        return [got for got, _ in out]

    def save(job: list[BuiltinBackend], step: int, level: int) -> Any:
        return on_ranks(job, lambda be, r: be.save(step, rank_state(r, step), level=level))

    def load_and_save(
        step: int, then: int, level: int
    ) -> tuple[list[Any], int, list[BuiltinBackend]]:
        """Loads ``step`` on fresh backends, then saves ``then`` at
        ``level`` with them; the store's requests during the load."""
        job = backends()
        before = store_requests(s3_server, bucket)
        out = run_ranks([functools.partial(be.load, step) for be in job])
        during = store_requests(s3_server, bucket) - before
        loaded = []
        for r, (got, err) in enumerate(out):
            assert err is None, err
            assert_bitwise(got[0], rank_state(r, step))
            loaded.append(got[1])
        save(job, then, level)
        return loaded, during, job

    first = backends()
    save(first, 10, 4)
    save(first, 20, 2)
    save(first, 30, 2)
    layout = Layout(c, world, None)  # rank 0's view of the roots
    # The steps to try are read from the store by rank 0 alone: a load's
    # candidates cost one rank's listing and line records, not every
    # rank's (before, each of the 4 ranks listed the store).
    before = store_requests(s3_server, bucket)
    assert layout.lines().steps() == [10, 20, 30]
    one = store_requests(s3_server, bucket) - before
    assert one > 0, "the store's lines were read without a request"
    before = store_requests(s3_server, bucket)
    assert on_ranks(backends(), lambda be, r: be.latest()) == [30] * world
    assert store_requests(s3_server, bucket) - before == one
    step10 = open_store(f"{glbl}/deeppart/{STEP.format(10)}")
    marker10, names10 = read_marker(step10), names(f"{glbl}/deeppart/{STEP.format(10)}")
    shutil.rmtree(tmp_path / "local" / "node3")

    reports, during, job = load_and_save(30, 40, 4)
    assert [r.levels for r in reports] == [[1, 1, 1, 2]] * world
    assert during == 0, "a load from the node-local levels sent requests to the store"
    lines = layout.lines()
    seq = {n: lines.nodes[n].seq for n in (10, 20, 30, 40)}
    assert parent_of(lines, 40) == (30, seq[30])
    assert seq[40] == max(seq.values()) and seq[10] < seq[20] < seq[30] < seq[40]
    assert lines.steps() == [10, 20, 30, 40]
    assert read_marker(step10) == marker10  # step 10's L4 copy untouched
    assert names(f"{glbl}/deeppart/{STEP.format(10)}") == names10
    store_lines = layout.global_objects()
    assert store_lines is not None
    assert sorted(store_lines.lines()[0].nodes) == [10, 40]

    # Step 50 at L4 on the same line, then gone from meta_dir: only the
    # store holds it, and its seq is the largest. A rollback to 30 from
    # memory.
    save(job, 50, 4)
    shutil.rmtree(tmp_path / "meta" / "deeppart" / STEP.format(50))
    seq50 = store_lines.lines()[0].nodes[50].seq
    reports, during, _ = load_and_save(30, 60, 2)
    assert [r.levels for r in reports] == [[1, 1, 1, 1]] * world
    assert during == 0, "a load from the node-local levels sent requests to the store"
    lines = layout.lines()
    assert parent_of(lines, 60) == (30, seq[30])
    assert lines.nodes[60].seq == seq50 + 1, "numbered above the step only the store held"
    assert lines.steps() == [10, 20, 30, 60]
    # Step 40 (the line left behind, committed before the load) retired;
    # step 50 (perhaps another job's, committed after it) kept.
    assert parent_of(lines, 50) == (40, seq[40])
    assert 40 not in lines.nodes and 50 in lines.nodes
    assert sorted(store_lines.lines()[0].nodes) == [10, 50]
    got, report = on_ranks(backends(), lambda be, r: be.load(60))[0]
    assert report.levels == [1, 1, 1, 1]
    assert_bitwise(got, rank_state(0, 60))


def test_l4_in_s3_keep_removes_only_deeppart_objects(
    s3_url: str, s3_server: Any, tmp_path: Path
) -> None:
    """keep=1, every save at L4: the retired step's objects in the store
    (its marker, metadata and data file) are removed, a foreign object
    under that step's prefix and one beside the steps stay; a re-save of
    the kept step replaces it."""
    glbl = f"{s3_url}/glbl"
    bucket = s3_url[len("s3://") :]
    foreign = {
        f"glbl/deeppart/{STEP.format(1)}/notes.txt": b"mine",
        f"glbl/deeppart/{STEP.format(1)}/{'ab' * 16}/rank-00000.bin": b"not a data file",
        "glbl/deeppart/README": b"beside",
    }
    for key, data in foreign.items():
        s3_server.put_raw(bucket, key, data)
    be = BuiltinBackend(config(tmp_path, glbl, ckpt_l4=1, keep=1))
    with pytest.warns(UserWarning, match="kept objects DeepPart did not write"):
        be.save(1, state(1))  # the L4 save leaves the foreign save-id group alone
    step1 = f"{glbl}/deeppart/{STEP.format(1)}"
    first = read_marker(open_store(step1))
    assert first is not None
    be.save(2, state(2))
    assert read_marker(open_store(step1)) is None  # step 1 retired
    left = names(step1)
    assert not [n for n in left if n.startswith(first.save_id)], left
    for key, data in foreign.items():
        assert s3_server.get_raw(bucket, key) == data, key
    assert be.committed_steps() == [2]
    assert not (tmp_path / "meta" / "deeppart" / STEP.format(1)).exists()
    got, report = BuiltinBackend(be.config).load()
    assert report.step == 2 and report.levels == [1]
    assert_bitwise(got, state(2))


_KILLED_L4 = """
import os, sys, torch
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels import LevelConfig
from deeppart.saving.writer import fault_hook
c = LevelConfig.from_dict({"ckpt_dir": sys.argv[1] + "/local", "meta_dir": sys.argv[1] + "/meta",
                           "glbl_dir": sys.argv[2], "ckpt_l4": 1, "keep": 1})
# Killed once its data file is in the object store (after the L1 write).
with fault_hook("after-write", lambda ev: os._exit(17) if "s3:" in str(ev.path) else None):
    BuiltinBackend(c).save(int(sys.argv[3]), {"w": torch.ones(1000)})
"""


def test_l4_in_s3_interrupted_save_cleaned(s3_url: str, s3_server: Any, tmp_path: Path) -> None:
    """A process killed during its L4 upload leaves that save's objects
    and no marker: recovery does not see the step, and the next save
    removes them (by save id and content) once it commits; a foreign
    object under that step stays."""
    glbl = f"{s3_url}/glbl"
    bucket = s3_url[len("s3://") :]
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_L4, str(tmp_path), glbl, "1"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    step1 = f"{glbl}/deeppart/{STEP.format(1)}"
    assert read_marker(open_store(step1)) is None
    assert len(save_groups(open_store(step1))) == 1  # the killed save's data file
    s3_server.put_raw(bucket, f"glbl/deeppart/{STEP.format(1)}/notes.txt", b"mine")
    be = BuiltinBackend(config(tmp_path, glbl, ckpt_l4=1, keep=1))
    assert be.latest() is None
    be.save(2, state(2))
    assert names(step1) == ["notes.txt"]
    assert be.committed_steps() == [2]
    got, _ = BuiltinBackend(be.config).load()
    assert_bitwise(got, state(2))


_KILLED_MID_UPLOAD_L4 = (
    DIE_MID_UPLOAD
    + """
import sys, torch
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels import LevelConfig
c = LevelConfig.from_dict({"ckpt_dir": sys.argv[1] + "/local", "meta_dir": sys.argv[1] + "/meta",
                           "glbl_dir": sys.argv[2], "ckpt_l4": 1, "keep": 1})
BuiltinBackend(c).save(1, {"w": torch.arange(4 << 20, dtype=torch.float32)})
"""
)


def test_l4_in_s3_save_killed_mid_upload_has_its_upload_aborted(
    s3_url: str, tmp_path: Path
) -> None:
    """A process killed while its L4 data file is a multipart upload in
    progress (no object of it is listed but the save's SAVING): the next
    save aborts that upload and removes SAVING; the user's incomplete
    upload beside the step stays."""
    import boto3

    glbl = f"{s3_url}/glbl"
    bucket = s3_url[len("s3://") :]
    step1 = f"glbl/deeppart/{STEP.format(1)}"
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_UPLOAD_L4, str(tmp_path), glbl],
        env=dict(os.environ, PYTHONPATH=str(ROOT), DEEPPART_S3_PART_BYTES=str(5 << 20)),
        capture_output=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    client = boto3.client("s3")
    left = names(f"{s3_url}/{step1}")
    assert [n.rsplit("/", 1)[1] for n in left] == ["SAVING"], left
    save_id = left[0].split("/")[0]
    assert uploads(s3_url, step1) == {f"{step1}/{save_id}/rank-00000.bin"}
    theirs = f"{step1}/notes.bin"
    client.create_multipart_upload(Bucket=bucket, Key=theirs)
    be = BuiltinBackend(config(tmp_path, glbl, ckpt_l4=1, keep=1))
    be.save(2, state(2))
    assert uploads(s3_url, step1) == {theirs}, "only the killed save's upload is aborted"
    assert names(f"{s3_url}/{step1}") == [], "its SAVING object is removed"
    assert be.committed_steps() == [2]


def test_glbl_dir_urls_in_the_config(tmp_path: Path) -> None:
    """An s3:// glbl_dir is accepted (and picks the built-in engine under
    backend='auto'); other schemes, a URL for ckpt_dir or meta_dir, and the
    FTI backend with an s3:// glbl_dir are clear errors, before any I/O."""
    c = config(tmp_path, "s3://my-bucket/run/", ckpt_l4=1)
    assert c.global_root() == S3URL("my-bucket", "run/deeppart")
    assert c.global_in_object_store
    assert not config(tmp_path, str(tmp_path / "g")).global_in_object_store
    assert LevelConfig.from_string(c.to_ini()) == c
    for url in ("gs://b/x", "file:///tmp/x", "s3:/my-bucket/x", "s3://Bad_Bucket/x"):
        with pytest.raises(
            LevelConfigError, match=r"glbl_dir: .*(s3:// URLs only|bucket name)"
        ) as e:
            config(tmp_path, url)
        assert isinstance(e.value.__cause__, UnsupportedURLError)
    for key in ("ckpt_dir", "meta_dir"):
        with pytest.raises(LevelConfigError, match=f"{key} = s3://b12/x: a URL; {key} must be a"):
            LevelConfig.from_dict({**{"ckpt_dir": "/a", "meta_dir": "/m"}, key: "s3://b12/x"})
    with pytest.raises(
        LevelConfigError, match="the FTI backend cannot write L4 to an object store"
    ):
        open_backend(c, backend="fti")
    from deeppart.levels.fti import check_fti_options

    with pytest.raises(LevelConfigError, match="backend='builtin'"):
        check_fti_options(c)
    assert isinstance(open_backend(c, backend="auto"), BuiltinBackend)
    with pytest.raises(UnsupportedURLError, match="segments"):
        S3URL("my-bucket", "run") / ".."
    assert S3URL("my-bucket", "") / "a/b" == S3URL("my-bucket", "a/b")
    assert list(tmp_path.iterdir()) == []
