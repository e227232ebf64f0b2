"""Hostile files and requests (issue 13): every case ends with a DeepPart
error, within bounded memory and time.

Each hostile action runs in a fresh process (tests/base/hostile_child.py), which
reports the peak RSS the action added beyond its own baseline (torch,
deeppart and gRPC imported) and how long it took. The bar: a checkpoint
directory or a service request of at most 1 MB (and the bigger bombs here)
costs less than 512 MB and returns within 10 s (the action itself, the
child's imports excluded); the child's time limit only proves that nothing
hung. ``DEEPPART_HOSTILE_LOG=FILE`` appends every measurement to FILE (one
JSON line each), for the maxima in docs/SECURITY.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lz4.frame
import pytest
import torch
import zstandard

import deeppart
from deeppart._planner import MAX_GROUPS, ManifestError
from deeppart.checkpointer import Checkpointer
from deeppart.compression import MAX_EXPANSION, decompress
from deeppart.errors import CheckpointError, CodecError, CorruptCheckpointError, StateError
from deeppart.format import (
    MARKER,
    METADATA,
    checksum,
    data_file_name,
    marker_text,
    open_regular,
    read_regular,
)
from deeppart.proto import planner_pb2 as pb
from deeppart.service import wire

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "base" / "hostile_child.py"
MPI_WORKER = ROOT / "tests" / "base" / "hostile_mpi.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
MAX_RSS_MB = 512
# The most CPU time (all threads) one hostile action may cost. CPU time, not
# wall time: a loaded CI machine stretches the wall clock, not the work.
MAX_CPU_S = 10
HANG_S = 300  # a generous limit that proves nothing hung (machines under load are slow)
GIB = 1 << 30


# ----------------------------------------------------------------------------
# Running a hostile action in a measured child process.


def measure(action: str, *args: str) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run(
            [sys.executable, str(CHILD), action, *args],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env=env,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as e:
        _log(action, {"hung_s": HANG_S})
        pytest.fail(f"{action} {args} hung (no result after {HANG_S} s): {e.stdout!r}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HOSTILE ")]
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("HOSTILE ")) if lines else {}
    _log(action, {**out, "rc": proc.returncode})
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out["stdout"], out["stderr"] = proc.stdout, proc.stderr
    assert out["rss_mb"] < MAX_RSS_MB, f"{action} {args}: peak RSS grew by {out['rss_mb']} MB"
    assert out["cpu_seconds"] < MAX_CPU_S, (
        f"{action} {args}: took {out['cpu_seconds']:.1f} s of CPU ({out['seconds']:.1f} s wall)"
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return out


def _log(action: str, result: dict[str, Any]) -> None:
    if log := os.environ.get("DEEPPART_HOSTILE_LOG"):
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        keep = {
            k: result[k]
            for k in ("error", "rss_mb", "seconds", "cpu_seconds", "hung_s", "rc")
            if k in result
        }
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "action": action, **keep}) + "\n")


def raised(out: dict[str, Any], cls: type[BaseException]) -> None:
    """The measured action raised ``cls`` (by name, with its base classes)."""
    assert out["error"] is not None, f"no error: {out}"
    assert cls.__name__ in out["error"], f"{out['error']}: {out['message']}"


# ----------------------------------------------------------------------------
# Crafting checkpoints: a real save, then its metadata or data rewritten
# consistently (checksums, sizes and the commit marker updated), so that the
# hostile part is the only thing wrong.


def save_small(d: Path, state: Any = None, codec: str | None = None) -> Path:
    state = {"w": torch.arange(4, dtype=torch.float32)} if state is None else state
    deeppart.save(state, d, writing=deeppart.WriteOptions(compression=codec))
    return d


def read_meta(d: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((d / METADATA).read_bytes())
    return meta


def commit_text(d: Path, text: bytes) -> None:
    (d / METADATA).write_bytes(text)
    (d / MARKER).write_bytes(marker_text(text))


def commit(d: Path, meta: dict[str, Any]) -> None:
    commit_text(d, json.dumps(meta).encode())


def test_pieces_without_any_leaf_are_corrupt(tmp_path: Path) -> None:
    """Found by test_fuzz_metadata_fields in CI: a manifest emptied of its
    leaves while pieces remain raised IndexError instead of a DeepPart error."""
    d = tmp_path / "ck"
    deeppart.save({"w": torch.arange(4, dtype=torch.float32)}, d)
    meta = read_meta(d)
    meta["manifest"]["leaves"] = []
    commit(d, meta)
    with pytest.raises(CorruptCheckpointError, match="piece 0 leaf"):
        deeppart.load(d)


def replace_piece(d: Path, payload: bytes, codec: str, shape: list[int]) -> None:
    """The one float32 leaf of ``d`` becomes ``shape``, stored as ``payload``
    with ``codec``, with a matching checksum and file size."""
    meta = read_meta(d)
    leaf = meta["manifest"]["leaves"][0]
    leaf["shape"] = shape
    numel = 1
    for n in shape:
        numel *= n
    ((li, _, _, rank, offset, *_),) = meta["pieces"]
    meta["pieces"] = [[li, 0, numel, rank, offset, numel * 4, len(payload), codec,
                       checksum(payload)]]  # fmt: skip
    data = d / data_file_name(rank)
    data.write_bytes(data.read_bytes()[:offset] + payload)
    meta["file_sizes"][rank] = offset + len(payload)
    commit(d, meta)


def zstd_frame(n: int, *, declare: bool) -> bytes:
    """A zstd frame of ``n`` zero bytes, made in bounded memory."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=declare).compressobj(
        size=n if declare else -1
    )
    chunk = bytes(1 << 20)
    parts = [cobj.compress(chunk) for _ in range(n >> 20)]
    return b"".join(parts) + cobj.flush()


def lz4_frame(n: int, *, declare: bool) -> bytes:
    comp = lz4.frame.LZ4FrameCompressor()
    parts = [comp.begin(source_size=n if declare else 0)]
    chunk = bytes(1 << 20)
    parts += [comp.compress(chunk) for _ in range(n >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)


def frame(codec: str, n: int, *, declare: bool) -> bytes:
    return lz4_frame(n, declare=declare) if codec == "lz4" else zstd_frame(n, declare=declare)


CODECS = ["zstd", "lz4", "shuffle-zstd"]


# ----------------------------------------------------------------------------
# 1. Decompression bombs.


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_frame_declaring_more_than_the_piece(tmp_path: Path, codec: str) -> None:
    """A 16-byte tensor stored as a frame that declares (and holds) 1 GiB."""
    d = save_small(tmp_path / "ck")
    replace_piece(d, frame(codec, GIB, declare=True), codec, [4])
    raised(measure("load", str(d)), CorruptCheckpointError)


@pytest.mark.parametrize("codec", CODECS)
def test_bomb_frame_producing_more_than_declared(tmp_path: Path, codec: str) -> None:
    """The frame states no size and decodes to 1 GiB; the piece says 16 bytes."""
    d = save_small(tmp_path / "ck")
    replace_piece(d, frame(codec, GIB, declare=False), codec, [4])
    out = measure("load", str(d))
    raised(out, CorruptCheckpointError)
    assert "piece of leaf 0" in out["message"] and data_file_name(0) in out["message"]


@pytest.mark.parametrize("codec", ["zstd", "shuffle-zstd"])  # LZ4 stays below 256:1
def test_bomb_metadata_claiming_a_huge_tensor(tmp_path: Path, codec: str) -> None:
    """A consistent 1 GiB tensor of zeros in a 32-260 KB frame: beyond the
    expansion limit, refused before anything is allocated."""
    d = save_small(tmp_path / "ck")
    payload = frame(codec, GIB, declare=True)
    assert MAX_EXPANSION * len(payload) < GIB
    replace_piece(d, payload, codec, [GIB // 4])
    out = measure("load", str(d))
    raised(out, CorruptCheckpointError)
    assert "decompression bomb" in out["message"]
    for flags in ([], ["--verify"]):
        assert measure("inspect", str(d), *flags)["result"] == 2


@pytest.mark.parametrize("declare", [True, False])
@pytest.mark.parametrize("codec", CODECS)
def test_bomb_in_a_plain_value_piece(tmp_path: Path, codec: str, declare: bool) -> None:
    """The piece of a plain value (JSON, its own expansion limit) replaced
    by a frame of 1 GiB, declared or not: refused, bounded."""
    d = save_small(tmp_path / "ck", {"o": {"x": list(range(100))}, "w": torch.ones(4)}, codec)
    meta = read_meta(d)
    assert meta["manifest"]["leaves"][0]["kind"] == "object"
    (li, start, end, rank, offset, raw_len, stored, _, _), *rest = meta["pieces"]
    payload = frame(codec, GIB, declare=declare)
    data = d / data_file_name(rank)
    old = data.read_bytes()
    data.write_bytes(old[:offset] + payload + old[offset + stored :])
    shift = len(payload) - stored
    meta["pieces"] = [[li, start, end, rank, offset, raw_len, len(payload), codec,
                       checksum(payload)]] + [
        [*row[:4], row[4] + shift if row[3] == rank and row[4] > offset else row[4], *row[5:]]
        for row in rest
    ]  # fmt: skip
    meta["file_sizes"][rank] += shift
    commit(d, meta)
    raised(measure("load", str(d)), CorruptCheckpointError)


def test_zstd_frame_asking_for_a_huge_window(tmp_path: Path) -> None:
    """A 16-byte piece whose zstd frame (no content size) asks for a 128 MiB
    window, the most zstd's default decoder takes: refused before the
    decoder allocates it (the window may not exceed the piece)."""
    d = save_small(tmp_path / "ck")
    params = zstandard.ZstdCompressionParameters(
        window_log=27, compression_level=1, write_content_size=False
    )
    obj = zstandard.ZstdCompressor(compression_params=params).compressobj()
    payload = obj.compress(bytes(16)) + obj.flush()
    assert zstandard.get_frame_parameters(payload).window_size == 1 << 27
    replace_piece(d, payload, "zstd", [4])
    out = measure("load", str(d))
    raised(out, CorruptCheckpointError)
    assert "piece of leaf 0" in out["message"], out


@pytest.mark.parametrize("codec", CODECS)
def test_truncated_and_undecodable_frames(tmp_path: Path, codec: str) -> None:
    raw = torch.arange(1 << 14, dtype=torch.float32)
    d = save_small(tmp_path / "ck", {"w": raw}, codec)
    good = frame(codec, 1 << 20, declare=True)
    for payload in (good[: len(good) // 2], b"\x00" * 64, good[:4]):
        replace_piece(d, payload, codec, [1 << 14])
        with pytest.raises(CorruptCheckpointError):
            deeppart.load(d)


@pytest.mark.parametrize("codec", CODECS)
def test_writer_stays_within_the_expansion_limit(tmp_path: Path, codec: str) -> None:
    """All-zero tensors compress far beyond the limit; the writer pads them
    (a skippable frame), and they load back bitwise."""
    state: dict[str, Any] = {"z": torch.zeros(1 << 22), "r": torch.randn(1000), "o": {"lr": 0.1}}
    deeppart.save(state, tmp_path / "ck", writing=deeppart.WriteOptions(compression=codec))
    meta = read_meta(tmp_path / "ck")
    for row in meta["pieces"]:
        if row[7] != "none":
            assert row[5] <= MAX_EXPANSION * row[6], row
    assert any(row[7] == codec for row in meta["pieces"])
    back = deeppart.load(tmp_path / "ck")
    assert torch.equal(back["z"], state["z"]) and torch.equal(back["r"], state["r"])
    assert back["o"] == {"lr": 0.1}


def test_decompress_never_holds_more_than_the_declared_length() -> None:
    for codec in CODECS:
        with pytest.raises(CodecError):
            decompress(codec, frame(codec, 1 << 26, declare=False), 1000)
        with pytest.raises(CodecError, match="cannot decode to"):
            decompress(codec, b"x" * 10, 10 * MAX_EXPANSION + 1)


# ----------------------------------------------------------------------------
# 2. The service's wire decoding.


def _deep_manifest(leaves: int) -> pb.Manifest:
    """Every leaf's path extends the previous one by a key: quadratic if built."""
    return pb.Manifest(
        version=1,
        string_keys=["k"],
        shared=list(range(leaves)),
        suffix_len=[1] * leaves,
        suffix_keys=[0] * leaves,
        dtype=[0] * leaves,
        object_nbytes=[1] * leaves,
    )


def _wide_manifest(leaves: int, key_chars: int) -> pb.Manifest:
    """Every leaf repeats a 200-key path of one long string key: ~3 bytes a
    leaf on the wire, 200 * key_chars expanded."""
    depth = 200
    return pb.Manifest(
        version=1,
        string_keys=["x" * key_chars],
        shared=[0] + [depth - 1] * (leaves - 1),
        suffix_len=[depth] + [1] * (leaves - 1),
        suffix_keys=[0] * (depth + leaves - 1),
        dtype=[0] * leaves,
        object_nbytes=[1] * leaves,
    )


def measure_wire(tmp_path: Path, msg: pb.Manifest) -> dict[str, Any]:
    """``msg`` (at most 1 MiB serialized) decoded as the service does, in a
    measured fresh process."""
    data = msg.SerializeToString()
    assert len(data) <= 1 << 20
    f = tmp_path / "manifest.pb"
    f.write_bytes(data)
    return measure("wire", str(f))


@pytest.mark.parametrize(
    "case",
    ["deep", "wide", "shared-beyond-previous", "key-out-of-range", "dims-mismatch", "ndim-huge",
     "dims-overflow", "owned-out-of-range", "suffix-len-huge", "dtype-out-of-range", "many-keys"],
)  # fmt: skip
def test_wire_manifest_decoding_is_bounded(tmp_path: Path, case: str) -> None:
    msg = {
        "deep": lambda: _deep_manifest(100_000),
        "wide": lambda: _wide_manifest(20_000, 20_000),
        "shared-beyond-previous": lambda: pb.Manifest(
            version=1, string_keys=["a"], shared=[0, 5], suffix_len=[1, 1],
            suffix_keys=[0, 0], dtype=[0, 0], object_nbytes=[1, 1]),
        "key-out-of-range": lambda: pb.Manifest(
            version=1, string_keys=["a"], shared=[0], suffix_len=[1], suffix_keys=[8],
            dtype=[0], object_nbytes=[1]),
        "dims-mismatch": lambda: pb.Manifest(
            version=1, string_keys=["a"], dtypes=["float32"], shared=[0], suffix_len=[1],
            suffix_keys=[0], dtype=[1], ndim=[3], dims=[1 << 40]),
        "ndim-huge": lambda: pb.Manifest(
            version=1, string_keys=["a"], dtypes=["float32"], shared=[0], suffix_len=[1],
            suffix_keys=[0], dtype=[1], ndim=[(1 << 32) - 1], dims=[1]),
        "dims-overflow": lambda: pb.Manifest(
            version=1, string_keys=["a"], dtypes=["float32"], shared=[0], suffix_len=[1],
            suffix_keys=[0], dtype=[1], ndim=[3], dims=[1 << 62] * 3),
        "owned-out-of-range": lambda: pb.Manifest(
            version=1, string_keys=["a"], shared=[0], suffix_len=[1], suffix_keys=[0],
            dtype=[0], object_nbytes=[1], owned_leaves=[(1 << 32) - 1], owner_ranks=[0]),
        "suffix-len-huge": lambda: pb.Manifest(
            version=1, string_keys=["a"], shared=[0], suffix_len=[(1 << 32) - 1],
            suffix_keys=[0] * 100, dtype=[0], object_nbytes=[1]),
        "dtype-out-of-range": lambda: pb.Manifest(
            version=1, string_keys=["a"], dtypes=["float32"], shared=[0], suffix_len=[1],
            suffix_keys=[0], dtype=[7], ndim=[1], dims=[1]),
        # valid: 350,000 keys in the tables, one leaf using one of them
        "many-keys": lambda: pb.Manifest(
            version=1, string_keys=[""] * 300_000, int_keys=range(50_000), shared=[0],
            suffix_len=[1], suffix_keys=[0], dtype=[0], object_nbytes=[1]),
    }[case]()  # fmt: skip
    out = measure_wire(tmp_path, msg)
    if case == "many-keys":
        assert out["error"] is None and out["result"] == 1, out
    else:  # the service answers both with INVALID_ARGUMENT
        raised(out, ManifestError if case == "dims-overflow" else ValueError)


@pytest.mark.parametrize("case", ["deep", "wide"])
def test_service_request_memory_is_bounded(tmp_path: Path, case: str) -> None:
    """The same manifests sent to a real planner service: INVALID_ARGUMENT,
    and the server's memory stays bounded (no token configured)."""
    manifest = _deep_manifest(100_000) if case == "deep" else _wide_manifest(20_000, 20_000)
    req = pb.PlanRequest(
        world_size=4,
        algorithm="balanced",
        planner_version=deeppart.PLANNER_VERSION,
        manifest_fingerprint="0" * 64,
        plan_fingerprint="0" * 64,
    )
    req.manifest.CopyFrom(manifest)
    f = tmp_path / "request.pb"
    f.write_bytes(req.SerializeToString())
    assert f.stat().st_size <= 1 << 20
    out = measure("serve", str(f))
    assert out["result"] == "INVALID_ARGUMENT", out


def test_wire_still_reads_real_manifests() -> None:
    leaves: list[dict[str, Any]] = [
        {"path": ["model", "layers", i, "w"], "dtype": "float32", "shape": [8, 8]}
        for i in range(300)
    ]
    leaves.append({"path": ["x" * 5000, *range(250)], "kind": "object", "nbytes": 3})
    m = deeppart.Manifest.from_leaves(leaves)
    assert wire.manifest_from_proto(wire.manifest_to_proto(m)) == m


# ----------------------------------------------------------------------------
# 3. An interrupted overwrite keeps its committed copy visible.


def _killed_overwrite(root: Path, step: int, at: str) -> None:
    """A child process re-saves ``step`` and is SIGKILLed at ``at``:
    "marker" (before COMMITTED is written into the temporary directory) or
    "rename" (between moving the old copy aside and moving the new one in)."""
    code = f"""
import os, signal, torch
from pathlib import Path
import deeppart, deeppart.storage.commit as ck
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
if {at!r} == "marker":
    real = ck.write_durable
    def write_durable(path, data):
        if path.name == "COMMITTED":
            die()
        real(path, data)
    ck.write_durable = write_durable
else:
    real_rename = ck.rename_noreplace
    def rename(src, dst):
        if src.name.startswith(".tmp-"):
            die()
        return real_rename(src, dst)
    ck.rename_noreplace = rename
cp = deeppart.Checkpointer({str(root)!r}, keep_last=2)
cp.save({step}, {{"w": torch.full((8,), 99.0)}}, overwrite=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], timeout=HANG_S, capture_output=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("at", ["marker", "rename"])
def test_interrupted_overwrite_is_still_the_latest_step(tmp_path: Path, at: str) -> None:
    cp = Checkpointer(tmp_path, keep_last=2)
    cp.save(1, {"w": torch.full((8,), 1.0)})
    cp.save(2, {"w": torch.full((8,), 2.0)})
    _killed_overwrite(tmp_path, 2, at)
    # Killed before its marker, the save never touched step 2; killed at
    # its rename, step 2's committed copy sits aside.
    aside = any(p.name.startswith(".old-step-00000002-") for p in tmp_path.iterdir())
    assert aside == (at == "rename")
    assert cp.steps() == [1, 2] and cp.latest() == 2
    with pytest.warns(UserWarning, match="interrupted") if aside else contextlib.nullcontext():
        assert torch.equal(cp.load()["w"], torch.full((8,), 2.0))
    # Saving a newer step prunes step 1, keeps step 2's only committed copy.
    cp.save(3, {"w": torch.full((8,), 3.0)})
    assert cp.steps() == [2, 3]
    with pytest.warns(UserWarning, match="interrupted") if aside else contextlib.nullcontext():
        assert torch.equal(cp.load(2)["w"], torch.full((8,), 2.0))
    # Step 2 committed again (after load(2): a rollback, so step 3 is
    # retired): the moved-aside copy goes.
    cp.save(2, {"w": torch.full((8,), 4.0)}, overwrite=True)
    cp.save(4, {"w": torch.full((8,), 5.0)})
    assert not any(p.name.startswith(".old-") for p in tmp_path.iterdir())
    assert cp.steps() == [2, 4] and not cp.path(3).exists()


# ----------------------------------------------------------------------------
# 4. Special files.


def _make_special(path: Path, kind: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "dev-urandom":
        path.symlink_to("/dev/urandom")
    elif kind == "symlink-loop":
        path.symlink_to(path.name)
    elif kind == "dangling-symlink":
        path.symlink_to("/nonexistent/deeppart")
    elif kind == "socket":
        import socket

        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind(str(path))  # the socket file stays after the close
    else:
        path.mkdir()


SPECIAL = ["fifo", "dev-zero", "directory"]


@pytest.mark.parametrize("kind", SPECIAL)
@pytest.mark.parametrize("name", [MARKER, METADATA, data_file_name(0)])
def test_special_file_in_a_checkpoint(tmp_path: Path, name: str, kind: str) -> None:
    root = tmp_path / "root"
    # A Checkpointer's step (latest() counts only those: issue 31, steps as a line).
    Checkpointer(root).save(1, {"w": torch.arange(4, dtype=torch.float32)})
    d = root / "step-00000001"
    _make_special(d / name, kind)
    raised(measure("load", str(d)), CheckpointError)
    for flags in ([], ["--verify"]):
        out = measure("inspect", str(d), *flags)
        if name == data_file_name(0) and not flags:
            assert out["result"] == 0, out  # describes the metadata only
        elif name == MARKER:  # inspect shows uncommitted checkpoints too
            assert out["result"] == 1 and "NO (no matching COMMITTED" in out["stdout"], out
        else:
            assert out["result"] not in (0, None), out
            assert "error" in out["stderr"] or "FAIL" in out["stdout"], out
    latest = measure("latest", str(root))
    if name == METADATA:
        # A committed step whose metadata is gone is a damaged step: reported
        # loudly and kept as evidence, never skipped (issue 49, item 2).
        assert latest["error"] and latest["error"][0] == "CorruptCheckpointError", latest
    else:
        assert latest["error"] is None
        assert latest["result"] == (1 if name == data_file_name(0) else None)


@pytest.mark.parametrize("kind", ["socket", "symlink-loop", "dangling-symlink", "dev-urandom"])
@pytest.mark.parametrize("name", [MARKER, METADATA, data_file_name(0)])
def test_other_special_files_in_a_checkpoint(tmp_path: Path, name: str, kind: str) -> None:
    """The rest of the family: a load ends at once with a CheckpointError."""
    d = save_small(tmp_path / "ck")
    _make_special(d / name, kind)
    raised(measure("load", str(d)), CheckpointError)


@pytest.mark.parametrize("kind", [*SPECIAL, "socket"])
def test_open_regular_refuses_special_files_at_once(tmp_path: Path, kind: str) -> None:
    """What guards every read: the file type, checked on the open
    descriptor (a FIFO with no writer would block a plain open)."""
    import socket

    path = tmp_path / "f"
    if kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    else:
        _make_special(path, kind)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        open_regular(path)
    with pytest.raises(CorruptCheckpointError, match="not a regular file"):
        read_regular(path, 100)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(CorruptCheckpointError, match="limit of 100 bytes"):
        read_regular(tmp_path / "big", 100)
    assert read_regular(tmp_path / "big", 101) == b"x" * 101
    if kind == "socket":
        sock.close()


# ----------------------------------------------------------------------------
# 5. Asymmetric failure, odd step names.


def test_odd_step_names_are_ignored(tmp_path: Path) -> None:
    cp = Checkpointer(tmp_path, keep_last=1)
    (tmp_path / "step-²").mkdir()
    (tmp_path / "step-٣").mkdir()  # Arabic-Indic three: isdigit() and int() accept it
    (tmp_path / "step-00000007").write_bytes(b"a file, not a directory")
    assert cp.steps() == [] and cp.latest() is None
    cp.save(1, {"w": torch.ones(2)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cp.save(9, {"w": torch.ones(2)})  # removes the stray file step-00000007
    assert cp.steps() == [9]
    assert (tmp_path / "step-²").is_dir() and (tmp_path / "step-٣").is_dir()


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_cleanup_failure_is_a_warning_on_every_rank(tmp_path: Path) -> None:
    import mpi_checkpoint

    proc = mpi_checkpoint.launch(
        [str(MPIEXEC), "-n", "2", sys.executable, str(MPI_WORKER), "cleanup", str(tmp_path)],
        HANG_S,
        ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        assert f"WARNED rank {rank}: " in proc.stdout, proc.stdout + proc.stderr
    assert "removing old checkpoints failed" in proc.stdout


# ----------------------------------------------------------------------------
# 6. Tied-weight alias keys.


def test_views_that_change_values_are_not_aliases(tmp_path: Path) -> None:
    c = torch.randn(6, 4, dtype=torch.complex64)
    r = torch.randn(6, 4)
    state = {
        "a": c,
        "conj": c.conj(),
        "neg": torch._neg_view(r),
        "r": r,
        "t": r.t(),
        "flat": r.view(-1),
        "row": r[1],
        "bits": r.view(torch.int32),
        "tied": r,  # the same tensor: one leaf
    }
    deeppart.save(state, tmp_path / "ck")
    back = deeppart.load(tmp_path / "ck")
    for k, v in state.items():
        assert torch.equal(back[k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg()), k
    assert back["tied"] is back["r"]
    assert len(read_meta(tmp_path / "ck")["manifest"]["leaves"]) == len(state) - 1


# ----------------------------------------------------------------------------
# 7. DeepPart errors everywhere a user can reach.


def test_skeleton_with_a_list_as_dict_key(tmp_path: Path) -> None:
    d = save_small(tmp_path / "ck", {"a": {"b": torch.ones(2)}})
    meta = read_meta(d)
    meta["skeleton"] = {"dict": [[[1, 2], {"leaf": 0}]]}
    commit(d, meta)
    raised(measure("load", str(d)), CorruptCheckpointError)


@pytest.mark.parametrize("where", ["created_unix", "user", "world_size"])
def test_integer_over_4300_digits_in_metadata(tmp_path: Path, where: str) -> None:
    d = save_small(tmp_path / "ck")
    text = (d / METADATA).read_bytes()
    meta = read_meta(d)
    key = f'"{where}":'.encode()
    old = key + json.dumps(meta[where]).encode()
    assert old in text
    commit_text(d, text.replace(old, key + b"9" * 5000))
    raised(measure("load", str(d)), CorruptCheckpointError)
    out = measure("inspect", str(d))
    assert out["result"] == 2 and "error" in out["stderr"]


def test_nested_and_meta_tensors_are_refused(tmp_path: Path) -> None:
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    for bad in (nested, torch.empty(3, device="meta")):
        with pytest.raises(StateError):
            deeppart.save({"x": bad}, tmp_path / "ck")


@pytest.mark.parametrize(
    "a, b", [(True, "True"), (None, "None"), (1.5, "1.5"), ((1, 2), "(1, 2)"), ("!x", "!!x")]
)
def test_keys_of_different_types_are_different_paths(tmp_path: Path, a: Any, b: Any) -> None:
    state = {a: torch.ones(2), b: torch.zeros(2), "plain": {a: 1, b: 2}}
    deeppart.save(state, tmp_path / "ck")
    back = deeppart.load(tmp_path / "ck", into=state)
    assert list(back) == list(state)
    assert torch.equal(back[a], torch.ones(2)) and torch.equal(back[b], torch.zeros(2))
    assert back["plain"] == {a: 1, b: 2}


def test_into_matches_checkpoints_written_before_typed_keys(tmp_path: Path) -> None:
    """Old checkpoints recorded the key True as the path key "True"."""
    state = {True: torch.ones(2), "!x": torch.zeros(2)}
    d = save_small(tmp_path / "ck", state)
    meta = read_meta(d)
    paths = [leaf["path"] for leaf in meta["manifest"]["leaves"]]
    assert paths == [["!True"], ["!!x"]]
    meta["manifest"]["leaves"][0]["path"] = ["True"]
    meta["manifest"]["leaves"][1]["path"] = ["!x"]
    commit(d, meta)
    back = deeppart.load(d, into={True: torch.empty(2), "!x": torch.empty(2)})
    assert torch.equal(back[True], torch.ones(2)) and torch.equal(back["!x"], torch.zeros(2))


def _cli(*args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "deeppart", *args], capture_output=True,
                          text=True, timeout=HANG_S, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          **kw)  # fmt: skip


@pytest.mark.parametrize("world", ["1e20", "100000000000000000000", "0", "-3", str(1 << 64)])
def test_plan_cli_bad_world_size(world: str) -> None:
    proc = _cli("plan", str(ROOT / "examples" / "manifest.json"), "--world-size", world)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "world-size" in proc.stderr or "world size" in proc.stderr, proc.stderr


def test_plan_cli_bad_manifest_files(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.json"
    bad.write_bytes(b'{"leaves": ["\xe9"]}')
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path in (bad, fifo, Path("/dev/zero"), tmp_path):
        proc = _cli("plan", str(path), "--world-size", "4")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert "error" in proc.stderr


def test_cli_piped_into_a_closed_reader(tmp_path: Path) -> None:
    """``deeppart ... | head -c 1``: the reader leaves, the CLI exits quietly."""
    d = save_small(tmp_path / "ck", {f"t{i}": torch.ones(1) for i in range(3000)})
    for args in (["inspect", str(d), "--leaves", "3000"], ["inspect", str(d), "--json"]):
        cmd = " ".join([sys.executable, "-m", "deeppart", *args]) + " | head -c 1"
        proc = subprocess.run(
            ["bash", "-c", f"set -o pipefail; {cmd}"],
            capture_output=True,
            text=True,
            timeout=HANG_S,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
        assert proc.returncode in (0, 141), proc.returncode


# ----------------------------------------------------------------------------
# 8. Parsing cost.


def test_huge_metadata_is_refused_before_parsing(tmp_path: Path) -> None:
    """80 MB of metadata for world size 2^24: refused by its size, at once."""
    d = save_small(tmp_path / "ck")
    meta = read_meta(d)
    world = 1 << 24
    meta["world_size"] = world
    head = json.dumps({k: v for k, v in meta.items() if k != "file_sizes"})[:-1]
    text = (head + ',"file_sizes":[' + "4096," * (world - 1) + "4096]}").encode()
    assert len(text) > 80 << 20
    commit_text(d, text)
    out = measure("load", str(d))
    raised(out, CorruptCheckpointError)
    assert "limit" in out["message"]
    assert measure("latest", str(tmp_path))["error"] is None


def test_world_size_beyond_the_limit(tmp_path: Path) -> None:
    d = save_small(tmp_path / "ck")
    meta = read_meta(d)
    meta["world_size"] = 1 << 24
    commit(d, meta)
    raised(measure("load", str(d)), CorruptCheckpointError)


@pytest.mark.parametrize(
    "mutate",
    [
        "deep-json",
        "many-pieces",
        "many-leaves-objects",
        "huge-object-claim",
        "sparse-file-claim",
    ],
)
def test_small_hostile_metadata(tmp_path: Path, mutate: str) -> None:
    """Metadata of at most 1 MB built to be expensive: bounded and refused."""
    d = save_small(tmp_path / "ck")
    meta = read_meta(d)
    fix: dict[str, Callable[[], None]] = {
        "deep-json": lambda: meta.update(user="[" * 100_000),
        "many-pieces": lambda: meta.update(pieces=[[0, 0, 4, 0, 4096, 16, 16, "none", 0]] * 20_000),
        "many-leaves-objects": lambda: meta.update(skeleton={"list": [{"leaf": 0}] * 60_000}),
        "huge-object-claim": lambda: meta["manifest"]["leaves"].__setitem__(
            0, {"path": ["w"], "kind": "object", "nbytes": 1 << 40}),
        "sparse-file-claim": lambda: meta["file_sizes"].__setitem__(0, 1 << 40),
    }  # fmt: skip
    fix[mutate]()
    if mutate == "deep-json":
        text = json.dumps(meta).replace('"' + "[" * 100_000 + '"', "[" * 100_000).encode()
        commit_text(d, text)
    else:
        commit(d, meta)
    assert (d / METADATA).stat().st_size <= 1 << 20
    out = measure("load", str(d))
    if mutate == "many-leaves-objects":  # valid: 60000 references to one tensor
        assert out["error"] is None, out
    else:
        raised(out, CheckpointError)


def _plan_request(
    m: deeppart.Manifest, world: int, cost: dict[str, Any] | None = None, **fields: Any
) -> pb.PlanRequest:
    """A request with the plan fingerprint a client computes (so the server
    plans instead of refusing a mismatch), or zeros where it cannot be
    computed (parameters the planner refuses)."""
    req = pb.PlanRequest(
        **{
            "world_size": world,
            "algorithm": "balanced",
            "planner_version": deeppart.PLANNER_VERSION,
            "manifest_fingerprint": m.fingerprint,
            "plan_fingerprint": "0" * 64,
            **fields,
        }
    )
    req.manifest.CopyFrom(wire.manifest_to_proto(m))
    if cost is not None:
        req.cost.CopyFrom(pb.CostModel(**cost))
    with contextlib.suppress(ValueError, deeppart.DeepPartError):
        req.plan_fingerprint = deeppart.plan_fingerprint(
            m,
            world,
            algorithm=req.algorithm,
            cost=wire.cost_from_proto(req.cost),
            topology=wire.topology_from_proto(req.topology),
        )
    return req


def _serve_measured(tmp_path: Path, req: pb.PlanRequest) -> dict[str, Any]:
    f = tmp_path / "request.pb"
    f.write_bytes(req.SerializeToString())
    assert f.stat().st_size <= 1 << 20
    return measure("serve", str(f))


@pytest.mark.parametrize("world", [1 << 20, (1 << 20) + 1, (1 << 32) - 1])
def test_service_request_with_the_largest_world_size(tmp_path: Path, world: int) -> None:
    """A valid small manifest planned for the most ranks the planner takes
    (and beyond): the server plans it (or refuses the world size at once)
    in bounded memory."""
    m = deeppart.Manifest.from_leaves(
        [{"path": ["w", i], "dtype": "float32", "shape": [1024, 1024]} for i in range(64)]
    )
    out = _serve_measured(tmp_path, _plan_request(m, world))
    assert out["result"] == ("OK" if world <= 1 << 20 else "INVALID_ARGUMENT"), out


@pytest.mark.parametrize(
    "case",
    ["many-leaves", "row-grain-tiny-pieces", "tiny-bandwidth", "subnormal-bandwidth",
     "tiny-node-bandwidth", "tiny-aggregate-bandwidth", "huge-fixed-s", "long-strings"],
)  # fmt: skip
def test_service_request_parameters_are_bounded(tmp_path: Path, case: str) -> None:
    """Requests of at most 1 MB that make planning expensive: many leaves
    over the largest world, tiny pieces, extreme cost models (a bandwidth of
    1e-305 made balanced double its level forever, holding a server thread
    for good), long strings. Each is planned or refused, within the bounds."""
    small = deeppart.Manifest.from_leaves(
        [{"path": ["w", i], "dtype": "float32", "shape": [1024, 1024]} for i in range(64)]
    )
    world = 1 << 20
    req = {
        "many-leaves": lambda: _plan_request(deeppart.Manifest.from_leaves(
            [{"path": [i], "dtype": "int8", "shape": [1]} for i in range(60_000)]), world),
        "row-grain-tiny-pieces": lambda: _plan_request(deeppart.Manifest.from_leaves(
            [{"path": [i], "dtype": "int8", "shape": [3, 1 << 40]} for i in range(30_000)]),
            world, {"grain": "row", "min_piece_bytes": 1, "align_bytes": 1}),
        "tiny-bandwidth": lambda: _plan_request(small, world, {"bandwidth": 1e-300}),
        "subnormal-bandwidth": lambda: _plan_request(small, world, {"bandwidth": 5e-324}),
        "tiny-node-bandwidth": lambda: _plan_request(small, world, {"node_bandwidth": 1e-305},
                                                     topology=pb.Topology(ranks_per_node=8)),
        "tiny-aggregate-bandwidth": lambda: _plan_request(
            small, world, {"aggregate_bandwidth": 1e-305}),
        "huge-fixed-s": lambda: _plan_request(small, world, {"fixed_s": 1e300, "piece_s": 1e300}),
        "long-strings": lambda: _plan_request(small, 4, algorithm="x" * 300_000,
                                              job_id="j" * 300_000),
    }[case]()  # fmt: skip
    out = _serve_measured(tmp_path, req)
    planned = case in ("many-leaves", "row-grain-tiny-pieces")
    assert out["result"] == ("OK" if planned else "INVALID_ARGUMENT"), out


@pytest.mark.parametrize(
    ("groups", "holders", "error"),
    [
        ([[0, 0]], 0, "holder group 0: lists rank 0 twice"),
        ([[0]], 3, "holders 3 names no group"),
        ([[0] for _ in range(65537)], 0, "holder groups, more than the limit"),
    ],
)
def test_holder_groups_in_metadata_are_checked(
    tmp_path: Path, groups: list[list[int]], holders: int, error: str
) -> None:
    """A committed checkpoint whose manifest is rewritten with malformed
    holder groups never loads: the error names the group or the leaf."""
    d = tmp_path / "ck"
    deeppart.save({"w": torch.arange(4, dtype=torch.float32)}, d)
    meta = read_meta(d)
    meta["manifest"]["version"] = 2
    meta["manifest"]["groups"] = groups
    meta["manifest"]["leaves"][0]["holders"] = holders
    commit(d, meta)
    with pytest.raises(deeppart.DeepPartError) as info:
        deeppart.load(d)
    assert error in str(info.value)


def _grouped_manifest(**groups: Any) -> pb.Manifest:
    """One float32 leaf in a version-2 wire manifest with ``groups``'
    ``group_sizes``, ``group_ranks`` and ``holders``."""
    return pb.Manifest(
        version=2, string_keys=["a"], dtypes=["float32"], shared=[0], suffix_len=[1],
        suffix_keys=[0], dtype=[1], ndim=[1], dims=[4], **groups,
    )  # fmt: skip


@pytest.mark.parametrize(
    "case",
    ["too-many-groups", "sizes-overflow", "rank-huge", "holders-beyond", "unsorted", "most-groups"],
)
def test_wire_holder_groups_are_bounded(tmp_path: Path, case: str) -> None:
    """Holder groups on the wire (fields 14-16), measured in a fresh process:
    each malformed one is a clear error and the decoder's peak memory and CPU
    stay bounded; the most groups the limits allow (65,536 of 4 ranks) decode."""
    most = MAX_GROUPS
    msg = {
        "too-many-groups": lambda: _grouped_manifest(
            group_sizes=[1] * (most + 1), group_ranks=[0] * (most + 1), holders=[1]),
        "sizes-overflow": lambda: _grouped_manifest(
            group_sizes=[(1 << 32) - 1] * 4, group_ranks=[0], holders=[1]),
        "rank-huge": lambda: _grouped_manifest(
            group_sizes=[1], group_ranks=[(1 << 32) - 1], holders=[1]),
        "holders-beyond": lambda: _grouped_manifest(
            group_sizes=[1], group_ranks=[0], holders=[(1 << 32) - 1]),
        "unsorted": lambda: _grouped_manifest(group_sizes=[2], group_ranks=[3, 1], holders=[1]),
        "most-groups": lambda: _grouped_manifest(
            group_sizes=[4] * most, group_ranks=list(range(4 * most)), holders=[most]),
    }[case]()  # fmt: skip
    out = measure_wire(tmp_path, msg)
    if case == "most-groups":
        assert out["error"] is None and out["result"] == 1, out
    else:
        raised(out, ManifestError if case == "unsorted" else ValueError)
        assert "group" in out["message"] or "holders" in out["message"], out


def test_most_holder_groups_in_metadata_load_bounded(tmp_path: Path) -> None:
    """A committed checkpoint whose manifest lists the most holder groups the
    limit allows loads, measured in a fresh process: bounded memory and CPU;
    one more is refused, naming the limit."""
    d = tmp_path / "ck"
    deeppart.save({"w": torch.arange(4, dtype=torch.float32)}, d)
    meta = read_meta(d)
    meta["manifest"]["version"] = 2
    meta["manifest"]["leaves"][0]["holders"] = MAX_GROUPS - 1
    for n, error in ((MAX_GROUPS, None), (MAX_GROUPS + 1, "more than the limit")):
        meta["manifest"]["groups"] = [[0]] * n
        commit(d, meta)
        out = measure("load", str(d))
        if error is None:
            assert out["error"] is None and out["result"] == "dict", out
        else:
            raised(out, deeppart.DeepPartError)
            assert error in out["message"], out
