"""The storage layer (deeppart/storage/, issue 34) against a real S3 server
(moto's server mode, tests/support/s3_server.py) and the file system: the
interface's operations on both stores, URL parsing, and single-process
saves and loads through s3:// (commit marker, overwrite, foreign objects,
interrupted saves, missing and truncated objects). Multi-rank scenarios:
tests/storage/test_s3_mpi.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deeppart
from deeppart.errors import (
    CheckpointError,
    CommitConflictError,
    CorruptCheckpointError,
    ForeignPathError,
    StoreConfigError,
    UnsupportedURLError,
)
from deeppart.format import HEADER_SIZE, MARKER, METADATA, data_file_name
from deeppart.loading import reader
from deeppart.progress import Progress
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import S3URL, ObjectExistsError, ObjectStore, open_store, parse_location, s3
from deeppart.storage.objects import read_marker, save_groups
from deeppart.storage.s3 import S3Store

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 120.0


def state(v: float = 1.0, n: int = 5000) -> dict[str, Any]:
    """Tensors (written as pieces of the data files) and a plain value."""
    return {"w": torch.arange(n, dtype=torch.float32) * v, "b": torch.full((7,), v), "step": int(v)}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        bool(torch.equal(a["w"], b["w"]))
        and bool(torch.equal(a["b"], b["b"]))
        and a["step"] == b["step"]
    )


def names(store: ObjectStore) -> list[str]:
    return sorted(o.name for o in store.list())


# ----------------------------------------------------------------------------
# URLs.


def test_parse_location() -> None:
    assert parse_location("s3://my-bucket/run/step-1") == S3URL("my-bucket", "run/step-1")
    assert parse_location("s3://my-bucket/run/") == S3URL("my-bucket", "run")
    assert parse_location("s3://my-bucket") == S3URL("my-bucket", "")
    assert str(S3URL("b12", "x/y")) == "s3://b12/x/y"
    assert parse_location("runs/s3-step:1") == Path("runs/s3-step:1")
    assert parse_location(Path("/tmp/x")) == Path("/tmp/x")
    for url in ("gs://b/x", "file:///tmp/x", "hdfs://nn:8020/x", "s3:/b/x"):
        with pytest.raises(UnsupportedURLError, match=r"s3:// URLs only"):
            parse_location(url)
    for bad in ("s3://Bad_Bucket/x", "s3://ab/x", "s3://bucket/a//b", "s3://bucket/a/../b"):
        with pytest.raises(UnsupportedURLError):
            parse_location(bad)


def test_other_schemes_refused_by_save_load_async_save(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    for call in (
        lambda: deeppart.save(state(), "gs://bucket/run"),
        lambda: deeppart.load("gs://bucket/run"),
        lambda: deeppart.async_save(state(), "gs://bucket/run").wait(),
    ):
        with pytest.raises(UnsupportedURLError, match="gs:// URL"):
            call()
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------
# The interface, on both stores.


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "local":
        return open_store(tmp_path / "root")
    url = request.getfixturevalue("s3_url")
    return open_store(f"{url}/root")


def test_store_operations(store: ObjectStore) -> None:
    with pytest.raises(FileNotFoundError):
        store.get("a/x")
    with pytest.raises(FileNotFoundError):
        store.head("a/x")
    tag = store.put("a/x", b"hello")
    assert store.get("a/x") == b"hello"
    info = store.head("a/x")
    assert info.size == 5 and info.tag == tag
    with pytest.raises(ObjectExistsError):
        store.put("a/x", b"other", create=True)
    assert store.get("a/x") == b"hello"
    assert store.put("a/y", b"new", create=True)
    tag2 = store.put("a/x", b"second", if_match=tag)
    with pytest.raises(ObjectExistsError):
        store.put("a/x", b"third", if_match=tag)  # stale version
    assert store.get("a/x") == b"second"
    assert store.head("a/x").tag == tag2
    buf = bytearray(4)
    assert store.read_into("a/x", 2, memoryview(buf)) == 4 and bytes(buf) == b"cond"
    assert store.read_into("a/x", 4, memoryview(buf)) == 2 and bytes(buf[:2]) == b"nd"
    assert store.read_into("a/x", 6, memoryview(buf)) == 0
    store.put("ab", b"beside")
    assert names(store) == ["a/x", "a/y", "ab"]
    assert [o.name for o in store.list("a")] == ["a/x", "a/y"]  # a directory-like prefix
    child = store.child("a")
    assert child.get("y") == b"new" and child.describe("y") == store.describe("a/y")
    store.delete("a/x")
    store.delete("a/x")  # already gone: no error
    assert names(store) == ["a/y", "ab"]


def test_writer_multipart_and_ranged_reader(store: ObjectStore) -> None:
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (14 << 20) + 12345, dtype=np.uint8).tobytes()
    w = store.writer("big.bin")
    for i in range(0, len(data), 3 << 20):
        w.write(data[i : i + (3 << 20)])
    with pytest.raises(FileNotFoundError):
        store.head("big.bin")  # not there before close: objects appear whole
    w.close()
    assert store.head("big.bin").size == len(data)
    with store.open("big.bin") as f:
        f.seek((6 << 20) - 3)
        out = bytearray(7 << 20)
        assert f.readinto(out) == len(out)
        assert bytes(out) == data[(6 << 20) - 3 : (13 << 20) - 3]
        assert f.tell() == (13 << 20) - 3
        assert f.read(2 << 20) == data[(13 << 20) - 3 :]
    w = store.writer("gone.bin")
    w.write(b"x" * 100)
    w.abort()
    with pytest.raises(FileNotFoundError):
        store.head("gone.bin")


def test_s3_store_multipart_above_a_part(s3_url: str) -> None:
    """Above one part the writer uploads in parts (an S3 multipart ETag
    ends in -<parts>); below, one PUT."""
    store = S3Store(parse_location(f"{s3_url}/mp"), part_bytes=5 << 20, concurrency=2)  # type: ignore[arg-type]
    w = store.writer("big")
    w.write(bytes(11 << 20))
    w.close()
    w = store.writer("small")
    w.write(bytes(100))
    w.close()
    assert (store.head("big").tag or "").strip('"').endswith("-3")
    assert "-" not in (store.head("small").tag or "")


def test_s3_settings_from_env(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The endpoint comes from the standard variables (AWS_ENDPOINT_URL_S3
    first); a wrong endpoint fails, naming nothing DeepPart invented."""
    store = open_store(f"{s3_url}/env")
    store.put("x", b"1")
    good = os.environ["AWS_ENDPOINT_URL"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", good)
    assert open_store(f"{s3_url}/env").get("x") == b"1"
    monkeypatch.setenv("DEEPPART_S3_PART_BYTES", str(1 << 20))
    with pytest.raises(ValueError, match="minimum"):
        open_store(f"{s3_url}/env")


# ----------------------------------------------------------------------------
# Read-ahead (deeppart/storage/readahead.py).

#: Small chunks, so that a few MiB make many of them.
RA_CHUNK = 64 << 10
RA_AHEAD = 3


def ra_store(s3_url: str, ahead: int = RA_AHEAD) -> S3Store:
    return S3Store(
        parse_location(f"{s3_url}/ra"),  # type: ignore[arg-type]
        concurrency=2,
        read_chunk_bytes=RA_CHUNK,
        read_ahead=ahead,
    )


def random_ranges(rng: np.random.Generator, size: int) -> list[tuple[int, int]]:
    """Ascending ranges within ``size`` bytes: some adjacent, some with small
    gaps (merged into one span), some with large ones (separate spans),
    lengths from 1 byte to a few chunks."""
    out: list[tuple[int, int]] = []
    at = 0
    while True:
        gap = int(rng.choice([0, 0, 0, int(rng.integers(1, 4096)), int(rng.integers(1, 1 << 20))]))
        length = int(rng.choice([int(rng.integers(1, 300)), int(rng.integers(1, 3 * RA_CHUNK))]))
        if at + gap + length > size:
            return out
        out.append((at + gap, length))
        at += gap + length


def test_read_ahead_returns_the_objects_bytes(s3_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random ascending range lists (adjacent, small and large gaps, pieces
    across chunk boundaries), each read in order through a reader that
    declared them: exactly the object's bytes, every byte from the
    read-ahead's chunks (no direct ranged read), never more than the cap of
    chunks outstanding. Reads off the declared sequence (backwards, into a
    gap, past the last range) are still right, by ranged reads."""
    store = ra_store(s3_url)
    rng = np.random.default_rng(7)
    size = (4 << 20) + 4321
    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    store.put("obj", data)
    direct: list[tuple[int, int]] = []
    plain_read = S3Store.read_into

    def counting(self: S3Store, name: str, offset: int, buf: memoryview) -> int:
        direct.append((offset, len(buf)))
        return plain_read(self, name, offset, buf)

    monkeypatch.setattr(S3Store, "read_into", counting)
    for trial in range(4):
        ranges = random_ranges(rng, size)
        assert len(ranges) > 5
        with store.open("obj", ranges) as f:
            assert f.ahead is not None
            assert f.ahead.outstanding == RA_AHEAD  # fetching ahead from the start
            for off, length in ranges:
                f.seek(off)
                if trial % 2:
                    got = f.read(length)
                else:
                    buf = bytearray(length)
                    assert f.readinto(buf) == length
                    got = bytes(buf)
                assert got == data[off : off + length], (off, length)
                assert f.tell() == off + length
                assert f.ahead.outstanding <= RA_AHEAD
            assert f.ahead.peak == RA_AHEAD
            assert f.ahead.fetched >= len(f.ahead.plan) // 2
        assert direct == []
    ranges = [(100, 1000), (300_000, 5000), (1_000_000, 200_000)]
    with store.open("obj", ranges) as f:
        f.seek(300_000)
        assert f.read(5000) == data[300_000:305_000]
        f.seek(100)  # backwards: a ranged read
        assert f.read(1000) == data[100:1100]
        f.seek(200_000)  # in a gap
        assert f.read(10) == data[200_000:200_010]
        f.seek(1_150_000)  # runs past the last declared range
        assert f.read(100_000) == data[1_150_000:1_250_000]
        f.seek(size - 5)  # at the object's end: a short read, as without read-ahead
        assert f.read(10) == data[size - 5 :]
    assert direct and all(off != 300_000 for off, _ in direct)


def test_read_ahead_range_past_the_end_and_missing_object(s3_url: str) -> None:
    """A declared range past the object's end (the object is shorter than
    the reader was told): CorruptCheckpointError naming the object where
    the read reaches the end; the bytes before it still arrive. A missing
    object: the same FileNotFoundError as a ranged read."""
    store = ra_store(s3_url)
    data = bytes(range(256)) * 1000  # 256000 bytes: 4 chunks
    store.put("short", data)
    with store.open("short", [(0, 1000), (200_000, 100_000)]) as f:
        assert f.read(1000) == data[:1000]
        f.seek(200_000)
        buf = bytearray(100_000)
        with pytest.raises(CorruptCheckpointError, match=r"ra/short: truncated.*256000"):
            f.readinto(buf)
    with store.open("missing", [(0, 10)]) as f, pytest.raises(FileNotFoundError):
        f.read(10)


def test_read_ahead_off_is_ranged_reads(s3_url: str) -> None:
    """``DEEPPART_S3_READ_AHEAD=0`` (here read_ahead=0): no read-ahead, the
    reads are ranged reads as before."""
    store = ra_store(s3_url, ahead=0)
    store.put("obj", b"abcdef")
    with store.open("obj", [(0, 6)]) as f:
        assert f.ahead is None and f.read(6) == b"abcdef"


# ----------------------------------------------------------------------------
# Checkpoints in S3, one process.


def test_save_load_bitwise_and_marker_last(s3_url: str) -> None:
    url = f"{s3_url}/run/step-1"
    big = {"big": torch.from_numpy(np.random.default_rng(0).standard_normal(3_000_000)).float()}
    for codec in (None, "zstd"):
        deeppart.save(
            {**state(2.0), **big},
            url,
            overwrite=True,
            writing=deeppart.WriteOptions(compression=codec),
        )
        got = deeppart.load(url)
        assert same(got, state(2.0)) and torch.equal(got["big"], big["big"])
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None
    assert names(store) == sorted(
        [MARKER, f"{marker.save_id}/{METADATA}", f"{marker.save_id}/{data_file_name(0)}"]
    )
    part = deeppart.load(url, keys=["big"])
    assert list(part) == ["big"] and torch.equal(part["big"], big["big"])


def test_overwrite_semantics(s3_url: str) -> None:
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0), url)
    first = read_marker(open_store(url))
    with pytest.raises(CheckpointError, match="overwrite=False"):
        deeppart.save(state(2.0), url)
    assert same(deeppart.load(url), state(1.0))
    deeppart.save(state(3.0), url, overwrite=True)
    assert same(deeppart.load(url), state(3.0))
    store = open_store(url)
    second = read_marker(store)
    assert first is not None and second is not None and first.save_id != second.save_id
    assert save_groups(store) == [second.save_id]  # the replaced one removed


def test_async_save_to_s3(s3_url: str) -> None:
    url = f"{s3_url}/run/async"
    h = deeppart.async_save(state(4.0), url)
    h.wait()
    assert same(deeppart.load(url), state(4.0))


def test_foreign_objects_survive(s3_url: str, s3_server: Any) -> None:
    """Objects DeepPart did not write under the prefix (beside the
    checkpoint, inside a save-id-named group, a data-file name with other
    bytes) survive saves, overwrites and cleanups."""
    url = f"{s3_url}/run/step-1"
    bucket = s3_url[len("s3://") :]
    fake_id = "ab" * 16
    foreign = {
        "run/step-1/config.json": b"{}",
        "run/step-1/notes/readme.txt": b"mine",
        f"run/step-1/{fake_id}/rank-00000.bin": b"not a data file",
        f"run/step-1/{fake_id}/metadata.json": b'{"format": "other"}',
        "run/step-10/x": b"neighbour",
    }
    for key, data in foreign.items():
        s3_server.put_raw(bucket, key, data)
    for v in (1.0, 2.0):
        with pytest.warns(UserWarning, match=f"kept objects DeepPart did not write: {fake_id}"):
            deeppart.save(state(v), url, overwrite=True)
    assert same(deeppart.load(url), state(2.0))
    for key, data in foreign.items():
        assert s3_server.get_raw(bucket, key) == data, key


def test_foreign_marker_refused(s3_url: str, s3_server: Any) -> None:
    bucket = s3_url[len("s3://") :]
    s3_server.put_raw(bucket, f"run/{MARKER}", b"user's file")
    with pytest.raises(ForeignPathError, match="did not write"):
        deeppart.save(state(), f"{s3_url}/run", overwrite=True)
    assert s3_server.get_raw(bucket, f"run/{MARKER}") == b"user's file"
    with pytest.raises(ForeignPathError):
        deeppart.load(f"{s3_url}/run")


def test_failed_save_removes_its_objects(s3_url: str) -> None:
    """A save that fails after writing (a fault hook raising after the
    data file is uploaded) commits nothing and leaves no object."""
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0), url)

    def fail(ev: WriteEvent) -> None:
        raise OSError("injected")

    with fault_hook("after-write", fail), pytest.raises(OSError, match="injected"):
        deeppart.save(state(2.0), url, overwrite=True)
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None and save_groups(store) == [marker.save_id]
    assert same(deeppart.load(url), state(1.0))


_KILLED_SAVE = """
import os, sys, torch, deeppart
from deeppart.saving.writer import fault_hook
with fault_hook("after-write", lambda ev: os._exit(17)):
    deeppart.save({"w": torch.ones(100)}, sys.argv[1], overwrite=True)
"""


def test_interrupted_save_cleaned_by_next_save(s3_url: str) -> None:
    """A process killed after uploading its data file leaves objects under
    its save id and no marker: a load still sees the previous checkpoint,
    and the next save of the prefix removes them (by save id and
    content)."""
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0), url)
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, url],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 17, proc.stderr.decode()[-2000:]
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None
    left = [g for g in save_groups(store) if g != marker.save_id]
    assert len(left) == 1  # the killed save's data file is there
    assert same(deeppart.load(url), state(1.0))
    deeppart.save(state(3.0), url, overwrite=True)
    final = read_marker(store)
    assert final is not None and save_groups(store) == [final.save_id]
    assert same(deeppart.load(url), state(3.0))


def test_commit_conflict_loser_removes_its_objects(s3_url: str) -> None:
    """A save whose marker put finds another commit (made while it was
    writing) fails with CommitConflictError, keeps the winner, and removes
    its own objects."""
    url = f"{s3_url}/run/step-1"

    def commit_meanwhile(ev: WriteEvent) -> None:
        with fault_hook("after-write", lambda e: None):
            pass
        deeppart.save(state(5.0), url)  # the other job, committing first

    done: list[bool] = []

    def once(ev: WriteEvent) -> None:
        if not done:
            done.append(True)
            commit_meanwhile(ev)

    with fault_hook("after-write", once), pytest.raises(CommitConflictError):
        deeppart.save(state(6.0), url)
    assert same(deeppart.load(url), state(5.0))
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None and save_groups(store) == [marker.save_id]


def test_load_errors(s3_url: str, s3_server: Any) -> None:
    bucket = s3_url[len("s3://") :]
    with pytest.raises(CheckpointError, match=f"no {MARKER} marker"):
        deeppart.load(f"{s3_url}/nothing")
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0, n=100_000), url)
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None
    key = f"run/step-1/{marker.save_id}/{data_file_name(0)}"
    data = s3_server.get_raw(bucket, key)
    # Truncated: the error names the object.
    s3_server.put_raw(bucket, key, data[: len(data) // 2])
    with pytest.raises(
        CorruptCheckpointError, match=rf"{marker.save_id}/rank-00000.bin.*truncated"
    ):
        deeppart.load(url)
    # A flipped byte of the first piece (just past the header): the checksum.
    flipped = bytearray(data)
    flipped[HEADER_SIZE + 10] ^= 0xFF
    s3_server.put_raw(bucket, key, bytes(flipped))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        deeppart.load(url)
    # Missing data file, then missing metadata.
    store.delete(f"{marker.save_id}/{data_file_name(0)}")
    with pytest.raises(CorruptCheckpointError, match=rf"{marker.save_id}/rank-00000.bin: missing"):
        deeppart.load(url)
    store.delete(f"{marker.save_id}/{METADATA}")
    with pytest.raises(CorruptCheckpointError, match=rf"{marker.save_id}/metadata.json: missing"):
        deeppart.load(url)


def test_object_truncated_during_the_read(
    s3_url: str, s3_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data object cut short after the load checked its size (another job
    replaced it): the read-ahead of the file's pieces raises
    CorruptCheckpointError naming the object, in small chunks and large."""
    bucket = s3_url[len("s3://") :]
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0, n=200_000), url)
    at, meta, _ = reader.open_checkpoint(parse_location(url))
    marker = read_marker(open_store(url))
    assert marker is not None
    key = f"run/step-1/{marker.save_id}/{data_file_name(0)}"
    data = s3_server.get_raw(bucket, key)
    pieces = sorted((p for p in meta.pieces if p.rank == 0), key=lambda p: p.offset)
    assert max(p.length for p in pieces) == 800_000
    out = {id(p): np.zeros(p.length, dtype=np.uint8) for p in pieces}
    for chunk in ("65536", str(8 << 20)):
        monkeypatch.setenv("DEEPPART_S3_READ_CHUNK_BYTES", chunk)
        at, meta, _ = reader.open_checkpoint(parse_location(url))
        s3_server.put_raw(bucket, key, data[: len(data) // 2])
        with pytest.raises(
            CorruptCheckpointError, match=rf"{marker.save_id}/rank-00000.bin: truncated"
        ):
            reader.read_file(
                at, meta, 0, pieces, lambda p: out[id(p)], Progress("load", 1, enabled=False)
            )
        s3_server.put_raw(bucket, key, data)
        assert same(deeppart.load(url), state(1.0, n=200_000))


def test_addressing_styles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Path-style by default (``http://endpoint/bucket/key``); virtual-hosted
    (``http://bucket.endpoint/key``, the endpoint naming the bucket) with
    AWS_VIRTUAL_HOSTED_STYLE_REQUEST=true. Seen in the request that fails
    against a port where nothing listens (moto cannot serve bucket host
    names here: they do not resolve)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("DEEPPART_S3_MAX_RETRIES", "0")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(Exception, match=r"http://127\.0\.0\.1:9/bkt1/run/x"):
        open_store("s3://bkt1/run").get("x")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://bkt1.localhost:9")
    # obstore's reading of the flag (object_store's booleans) and the boto3
    # client's that lists and aborts incomplete uploads agree.
    for flag, virtual in [("true", True), ("On", True), ("y", True), ("YES", True), ("1", True),
                          ("false", False), ("off", False), ("0", False)]:  # fmt: skip
        monkeypatch.setenv("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", flag)
        store = open_store("s3://bkt1/run")
        seen = r"http://bkt1\.localhost:9/run/x" if virtual else r"localhost:9/bkt1/run/x"
        with pytest.raises(Exception, match=seen):
            store.get("x")
        boto = s3._boto3_client(store)  # type: ignore[arg-type]
        assert boto.meta.config.s3["addressing_style"] == ("virtual" if virtual else "path"), flag


def test_the_store_each_rank_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49, item 1: the identity of the store that the ranks of a save
    compare (deeppart/storage/identity.py): spellings of one endpoint agree,
    other endpoints, regions, addressing styles and prefixes differ,
    DEEPPART_S3_STORE_ID stands for the endpoint; the error names each
    setting that differs and which ranks have which value."""
    from deeppart.storage.identity import identity_error, identity_text, normalise_endpoint

    assert normalise_endpoint("HTTPS://S3.Example.com:443/") == "https://s3.example.com"
    assert normalise_endpoint("http://127.0.0.1:80") == "http://127.0.0.1"
    assert normalise_endpoint("http://[::1]:9000/") == "http://[::1]:9000"
    assert normalise_endpoint("http://minio:9000/s3/") == "http://minio:9000/s3"
    for var, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                       "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                       "AWS_ENDPOINT_URL": "http://Minio:9000/"}.items():  # fmt: skip
        monkeypatch.setenv(var, value)
    for var in ("AWS_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL_S3",
                "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "DEEPPART_S3_STORE_ID"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)

    def seen(url: str = "s3://bkt/run/step-1") -> dict[str, str]:
        return S3Store(parse_location(url)).identity()  # type: ignore[arg-type]

    base = seen()
    assert base == {"endpoint": "http://minio:9000", "region": "us-east-1", "bucket": "bkt",
                    "prefix": "run/step-1", "addressing": "path"}  # fmt: skip
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")
    monkeypatch.setenv("AWS_REGION", "us-east-1")  # obstore's default, now set
    assert seen() == base
    changes = {"AWS_ENDPOINT_URL": "http://minio-2:9000", "AWS_REGION": "eu-west-1",
               "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "true"}  # fmt: skip
    for var, value in changes.items():
        with monkeypatch.context() as m:
            m.setenv(var, value)
            assert seen() != base, var
    assert seen("s3://bkt/run/step-2") != base
    monkeypatch.setenv("DEEPPART_S3_STORE_ID", "lab")
    named = seen()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio-2:9000")
    assert seen() == named and named["endpoint"] == "DEEPPART_S3_STORE_ID=lab"

    texts = [identity_text(base), identity_text({**base, "endpoint": "http://b"})] * 2
    texts.append(identity_text({**base, "region": "eu-west-1"}))
    said = str(identity_error(texts))
    assert ("endpoint: ranks [0, 2, 4] http://minio:9000, ranks [1, 3] http://b; "
            "region: ranks [0, 1, 2, 3] us-east-1, rank 4 eu-west-1") in said, said  # fmt: skip
    assert "nothing was written" in said and "DEEPPART_S3_STORE_ID" in said


def test_settings_from_an_aws_profile_reach_the_server(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AWS_* credentials, region or endpoint in the environment, the
    profile named by AWS_PROFILE gives them (its keys from the credentials
    file; its region and endpoint from the config file): a save and a load
    through s3:// reach the server, and the client signs with the profile's
    keys. A profile that neither file has is a StoreConfigError."""
    from s3_server import ACCESS_KEY, REGION, SECRET_KEY

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    (tmp_path / "credentials").write_text(
        f"[train]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    (tmp_path / "config").write_text(
        f"[profile train]\nregion = {REGION}\nendpoint_url = {endpoint}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_PROFILE", "train")
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(3.0), url)
    assert same(deeppart.load(url), state(3.0))
    store = open_store(url)
    assert isinstance(store, S3Store)
    config = store.obstore.config
    assert (config["access_key_id"], config["region"]) == (ACCESS_KEY, REGION)
    monkeypatch.setenv("AWS_PROFILE", "nobody")
    with pytest.raises(StoreConfigError, match="AWS profile 'nobody'"):
        deeppart.load(url)


def test_virtual_addressing_from_an_aws_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile's ``s3 = addressing_style = virtual`` and ``endpoint_url``
    (the environment has neither): requests go to bucket.endpoint/key, as
    with AWS_VIRTUAL_HOSTED_STYLE_REQUEST (test_addressing_styles)."""
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT",
                "AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "AWS_PROFILE"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("DEEPPART_S3_MAX_RETRIES", "0")
    (tmp_path / "config").write_text(
        "[default]\nendpoint_url = http://bkt1.localhost:9\ns3 =\n  addressing_style = virtual\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    with pytest.raises(Exception, match=r"http://bkt1\.localhost:9/run/x"):
        open_store("s3://bkt1/run").get("x")


def test_credentials_from_a_profiles_credential_process(
    s3_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A profile whose keys come from credential_process: the client runs it
    when it first signs a request (a save and a load through s3:// reach
    the server), and a process that fails fails the load with its message."""
    import json

    from s3_server import ACCESS_KEY, SECRET_KEY

    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(var)
    answer = {"Version": 1, "AccessKeyId": ACCESS_KEY, "SecretAccessKey": SECRET_KEY}
    script = tmp_path / "creds.py"
    script.write_text(
        f"open({str(tmp_path / 'runs')!r}, 'a').write('x')\nprint({json.dumps(answer)!r})\n"
    )
    (tmp_path / "config").write_text(
        f"[default]\nendpoint_url = {endpoint}\ncredential_process = {sys.executable} {script}\n"
    )
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(4.0), url)
    assert same(deeppart.load(url), state(4.0))
    assert (tmp_path / "runs").read_text().count("x") >= 1
    script.write_text("import sys\nprint('token expired', file=sys.stderr)\nsys.exit(1)\n")
    # (A new store runs it again: its answer is kept per store.) obstore
    # reports the provider's StoreConfigError as UnauthenticatedError.
    from obstore.exceptions import UnauthenticatedError

    failed = "credential_process exited with 1: token expired"
    with pytest.raises(UnauthenticatedError, match=failed):
        deeppart.load(url)


def test_without_obstore_an_s3_url_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "obstore.store", None)  # import fails
    named = r"S3 needs obstore \(pip install 'deeppart\[s3\]'\)"
    with pytest.raises(StoreConfigError, match=named):
        deeppart.load("s3://bkt/run")


def test_only_a_save_that_never_committed_has_its_uploads_aborted(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing a committed save (pruning, replacing) asks the store for no
    incomplete uploads (all of them completed before its commit); removing
    one whose SAVING object is still there (interrupted) does."""
    from deeppart.format import SAVING, new_save_id, saving_text
    from deeppart.storage.objects import remove_save

    asked: list[str] = []

    def abort_uploads(self: S3Store, prefix: str, accept: Any) -> tuple[str, ...]:
        asked.append(prefix)
        return ()

    monkeypatch.setattr(S3Store, "abort_uploads", abort_uploads)
    url = f"{s3_url}/run/step-1"
    deeppart.save(state(1.0), url)
    store = open_store(url)
    marker = read_marker(store)
    assert marker is not None and f"{marker.save_id}/{SAVING}" not in names(store)
    assert remove_save(store, marker.save_id) == [] and asked == []
    killed = new_save_id()
    store.put(f"{killed}/{SAVING}", saving_text(killed))
    store.put(f"{killed}/notes.txt", b"the user's")
    assert remove_save(store, killed) == [f"{killed}/notes.txt"] and asked == [killed]
    assert names(store) == sorted([MARKER, f"{killed}/notes.txt"])
