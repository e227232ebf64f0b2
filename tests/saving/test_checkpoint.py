"""Single-process tests of the checkpoint format, codecs and checks."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from mpi_checkpoint import assert_bitwise_equal, make_state

import deeppart
from deeppart import progress as ck
from deeppart.comm import resolve
from deeppart.compression import CODECS, check_codec, compress, decompress
from deeppart.errors import CodecError
from deeppart.format import (
    ALIGN,
    MARKER,
    METADATA,
    PIECE_FIELDS,
    data_file_name,
    is_committed,
    marker_text,
)
from deeppart.loading.reader import assign_readers
from deeppart.progress import Progress, Stats
from deeppart.storage import commit


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return make_state()


def _rewrite_metadata(d: Path, edit: Any) -> None:
    """Edits metadata.json and re-signs the marker (a consistent but lying
    metadata file, as a bug or an attacker could produce)."""
    meta = json.loads((d / METADATA).read_text())
    edit(meta)
    text = json.dumps(meta).encode()
    (d / METADATA).write_bytes(text)
    (d / MARKER).write_bytes(marker_text(text))


# ----------------------------------------------------------------------------
# Codecs.


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "none"])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_codec_roundtrip(codec: str, itemsize: int) -> None:
    rng = np.random.default_rng(0)
    raw = (rng.standard_normal(3000).astype(np.float32) * 0.01).tobytes()[: 1000 * itemsize]
    packed = compress(codec, memoryview(raw), itemsize)
    assert decompress(codec, packed, len(raw), itemsize) == raw


def test_codec_errors() -> None:
    with pytest.raises(CodecError, match="unknown compression"):
        check_codec("gzip")
    packed = compress("zstd", memoryview(b"abc" * 100))
    with pytest.raises(CodecError, match="expected 301"):
        decompress("zstd", packed, 301)
    with pytest.raises(CodecError):
        decompress("lz4", b"not lz4 at all", 10)


def test_shuffle_zstd_helps_floats() -> None:
    t = torch.randn(1 << 16).to(torch.bfloat16).float()  # low mantissa bytes are zero
    raw = memoryview(t.numpy().tobytes())
    assert len(compress("shuffle-zstd", raw, 4)) < len(compress("zstd", raw, 4))


# ----------------------------------------------------------------------------
# Save and load in one process.


@pytest.mark.parametrize("codec", [None, "zstd", "lz4", "shuffle-zstd"])
def test_roundtrip_single_process(tmp_path: Path, state: dict[str, Any], codec: str | None) -> None:
    stats = deeppart.save(state, tmp_path / "ck", writing=deeppart.WriteOptions(compression=codec))
    assert resolve().size == 1  # SingleComm, or MPI a test before initialised
    assert (
        stats.world_size == 1
        and stats.raw_bytes == deeppart.Manifest.from_state_dict(state).total_bytes
    )
    if codec is not None:
        assert stats.ratio > 1.0
    out = deeppart.load(tmp_path / "ck")
    assert_bitwise_equal(state, out)
    load_stats = ck.last_stats("load")
    assert load_stats is not None and load_stats.raw_bytes == stats.raw_bytes


def test_format_layout(tmp_path: Path, state: dict[str, Any]) -> None:
    d = tmp_path / "ck"
    deeppart.save(state, d)
    assert sorted(p.name for p in d.iterdir()) == [MARKER, METADATA, data_file_name(0)]
    assert is_committed(d)
    meta = json.loads((d / METADATA).read_text())
    assert meta["format"] == "deeppart-checkpoint" and meta["version"] == 1
    assert meta["checksum"] == "xxh3_64" and meta["world_size"] == 1
    assert meta["piece_fields"] == list(PIECE_FIELDS)
    assert len(meta["plan_fingerprint"]) == 64
    size = (d / data_file_name(0)).stat().st_size
    assert meta["file_sizes"] == [size]
    for _leaf, start, stop, rank, offset, length, stored, codec, xxh in meta["pieces"]:
        assert offset % ALIGN == 0 and offset + stored <= size and codec == "none"
        assert length == stored and 0 <= xxh < 2**64 and rank == 0 and start <= stop
    data = (d / data_file_name(0)).read_bytes()
    assert data[:8] == b"DPCKPT01"
    # Tensor bytes are stored raw, little-endian, in the tensor's element order.
    leaves = deeppart.Manifest.from_json(json.dumps(meta["manifest"])).leaves()
    i = next(k for k, lf in enumerate(leaves) if lf["path"] == ("extras", "ids"))
    row = next(r for r in meta["pieces"] if r[0] == i)
    ids = np.frombuffer(data[row[4] : row[4] + row[5]], dtype=np.int64)
    assert (ids == np.arange(row[1], row[2])).all()
    assert b"pickle" not in (d / METADATA).read_bytes()


def test_into_restores_in_place(tmp_path: Path, state: dict[str, Any]) -> None:
    deeppart.save(state, tmp_path / "ck")
    into = make_state(seed=5)
    into["extras"]["strided"] = into["extras"]["strided"].clone()  # contiguous now
    before = {k: (v, v.data_ptr()) for k, v in into["model"].items()}
    opt_t = into["optim"]["state"][0]["exp_avg"]
    out = deeppart.load(tmp_path / "ck", into=into)
    for k, (t, ptr) in before.items():
        assert out["model"][k] is t and t.data_ptr() == ptr
    assert out["optim"]["state"][0]["exp_avg"] is opt_t
    assert_bitwise_equal(state["model"], into["model"])
    assert out["step"] == state["step"]


def test_into_non_contiguous_target(tmp_path: Path) -> None:
    src = {"w": torch.arange(12.0).reshape(3, 4)}
    deeppart.save(src, tmp_path / "ck")
    base = torch.zeros(4, 3)
    target = base.t()  # a non-contiguous view
    out = deeppart.load(tmp_path / "ck", into={"w": target})
    assert out["w"] is target and torch.equal(target, src["w"])
    assert torch.equal(base, src["w"].t())


def test_into_mismatch(tmp_path: Path) -> None:
    deeppart.save({"w": torch.zeros(3), "n": 1}, tmp_path / "ck")
    with pytest.raises(deeppart.StateMismatchError, match=r"w: into= has torch\.float32 \[4\]"):
        deeppart.load(tmp_path / "ck", into={"w": torch.zeros(4), "n": 1})
    with pytest.raises(deeppart.StateMismatchError, match="leaves"):
        deeppart.load(tmp_path / "ck", into={"w": torch.zeros(3)})


def test_non_plain_object_rejected(tmp_path: Path) -> None:
    class Thing:
        pass

    with pytest.raises(deeppart.StateError, match="optim/sched/thing"):
        deeppart.save({"w": torch.zeros(2), "optim": {"sched": {"thing": Thing()}}}, tmp_path / "c")
    assert not any(tmp_path.iterdir()), "nothing is written"


def test_overwrite(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    deeppart.save({"a": torch.ones(2)}, d)
    with pytest.raises(deeppart.CheckpointError, match="overwrite=False"):
        deeppart.save({"a": torch.zeros(2)}, d)
    deeppart.save({"a": torch.zeros(2)}, d, overwrite=True)
    assert torch.equal(deeppart.load(d)["a"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_given_plan_must_match(tmp_path: Path) -> None:
    state = {"a": torch.ones(10)}
    other = deeppart.plan(deeppart.Manifest.from_state_dict({"b": torch.ones(10)}), 1)
    with pytest.raises(deeppart.StateMismatchError, match="another state"):
        deeppart.save(state, tmp_path / "ck", planning=deeppart.PlanOptions(plan=other))
    good = deeppart.plan(deeppart.Manifest.from_state_dict(state), 1)
    deeppart.save(state, tmp_path / "ck", planning=deeppart.PlanOptions(plan=good))


# ----------------------------------------------------------------------------
# Commit marker and corruption.


def test_uncommitted_checkpoint_is_never_loaded(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    deeppart.save({"a": torch.ones(2)}, d)
    (d / MARKER).unlink()
    with pytest.raises(deeppart.CheckpointError, match="never committed"):
        deeppart.load(d)


def test_edited_metadata_fails_marker(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    deeppart.save({"a": torch.ones(2)}, d)
    (d / METADATA).write_bytes((d / METADATA).read_bytes().replace(b'"step"', b'"stop"'))
    (d / METADATA).write_bytes((d / METADATA).read_bytes() + b" ")
    with pytest.raises(deeppart.CorruptCheckpointError, match="does not match the hash"):
        deeppart.load(d)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_flipped_byte_names_file_and_piece(
    tmp_path: Path, state: dict[str, Any], codec: str | None
) -> None:
    d = tmp_path / "ck"
    deeppart.save(state, d, writing=deeppart.WriteOptions(compression=codec))
    meta = json.loads((d / METADATA).read_text())
    row = max(meta["pieces"], key=lambda r: r[6])
    path = d / data_file_name(0)
    data = bytearray(path.read_bytes())
    data[row[4] + 7] ^= 0x01
    path.write_bytes(bytes(data))
    msg = f"{data_file_name(0)}: piece of leaf {row[0]} \\[{row[1]}:{row[2]}\\].*checksum"
    with pytest.raises(deeppart.CorruptCheckpointError, match=msg):
        deeppart.load(d)


def test_truncated_and_missing_files(tmp_path: Path, state: dict[str, Any]) -> None:
    d = tmp_path / "ck"
    deeppart.save(state, d)
    path = d / data_file_name(0)
    data = path.read_bytes()
    path.write_bytes(data[:-1])
    with pytest.raises(deeppart.CorruptCheckpointError, match=r"rank-00000\.bin: .*truncated"):
        deeppart.load(d)
    path.unlink()
    with pytest.raises(deeppart.CorruptCheckpointError, match=r"rank-00000\.bin: missing"):
        deeppart.load(d)


def test_bad_header(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    deeppart.save({"a": torch.ones(2)}, d)
    path = d / data_file_name(0)
    data = bytearray(path.read_bytes())
    data[0:8] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(deeppart.CorruptCheckpointError, match="not a DeepPart"):
        deeppart.load(d)


def _bump_offset(meta: dict[str, Any]) -> None:
    meta["pieces"][0][4] = meta["file_sizes"][0] + ALIGN


def _overlap(meta: dict[str, Any]) -> None:
    meta["pieces"][1][4] = meta["pieces"][0][4]


def _bad_length(meta: dict[str, Any]) -> None:
    meta["pieces"][0][5] += 4
    meta["pieces"][0][6] += 4


def _drop_piece(meta: dict[str, Any]) -> None:
    del meta["pieces"][0]


def _huge_object(meta: dict[str, Any]) -> None:
    meta["manifest"]["leaves"][-1]["nbytes"] = 1 << 40


def _negative(meta: dict[str, Any]) -> None:
    meta["pieces"][0][1] = -1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_bump_offset, "smaller than its pieces"),
        (_overlap, "overlap"),
        (_bad_length, "inconsistent lengths"),
        (_drop_piece, "not covered exactly once"),
        (_huge_object, "nbytes"),
        (_negative, "start"),
    ],
)
def test_metadata_bounds_checked(tmp_path: Path, edit: Any, message: str) -> None:
    """Signed but lying metadata is rejected before any read or allocation."""
    d = tmp_path / "ck"
    deeppart.save({"a": torch.ones(1000), "b": torch.ones(1000), "n": "x"}, d)
    _rewrite_metadata(d, edit)
    with pytest.raises(deeppart.CorruptCheckpointError, match=message):
        deeppart.load(d)


# ----------------------------------------------------------------------------
# Checkpointer.


def test_checkpointer_keep_last_and_latest(tmp_path: Path) -> None:
    cp = deeppart.Checkpointer(
        tmp_path / "run", keep_last=2, writing=deeppart.WriteOptions(compression="lz4")
    )
    assert cp.latest() is None
    with pytest.raises(deeppart.CheckpointError, match="no committed"):
        cp.load()
    for step in (10, 20, 30):
        cp.save(step, {"w": torch.full((100,), float(step)), "step": step})
    assert cp.steps() == [20, 30] and cp.latest() == 30
    # An uncommitted newer directory (an older version's crash after the
    # rename: DeepPart's metadata by content, no marker) is ignored.
    partial = cp.path(40)
    partial.mkdir()
    (partial / METADATA).write_text('{"format": "deeppart-checkpoint"}')
    assert cp.latest() == 30
    assert cp.load()["step"] == 30
    assert torch.equal(cp.load(20)["w"], torch.full((100,), 20.0))
    first_plan = cp.plans.last
    cp.save(50, {"w": torch.zeros(100), "step": 50})
    assert cp.plans.last is first_plan, "the plan is reused while the structure is the same"
    # load(20) was a rollback: 50 continues from 20, and the abandoned 30
    # is retired (tests/steps/test_lineage.py).
    assert cp.steps() == [20, 50] and not cp.path(30).exists()
    assert not partial.exists(), "older uncommitted leftovers are removed after a commit"


def test_checkpointer_refuses_an_existing_step(tmp_path: Path) -> None:
    """Checkpointer.save on a committed step refuses, as deeppart.save does,
    and leaves that step as it was; overwrite=True replaces it."""
    cp = deeppart.Checkpointer(tmp_path / "run")
    cp.save(5, {"w": torch.zeros(10), "step": 5})
    with pytest.raises(deeppart.CheckpointError, match=r"step-00000005: a committed checkpoint"):
        cp.save(5, {"w": torch.ones(10), "step": 5})
    assert torch.equal(cp.load(5)["w"], torch.zeros(10))
    cp.save(5, {"w": torch.ones(10), "step": 5}, overwrite=True)
    assert torch.equal(cp.load(5)["w"], torch.ones(10))
    assert cp.steps() == [5]


# ----------------------------------------------------------------------------
# Readers, progress, summary.


def test_assign_readers_balanced() -> None:
    owner = assign_readers([100, 10, 90, 20, 0], 2)
    sizes = [100, 10, 90, 20, 0]
    loads = [sum(b for b, o in zip(sizes, owner, strict=True) if o == r) for r in (0, 1)]
    assert sorted(loads) == [110, 110]
    assert assign_readers([5, 5], 4) == [0, 1]
    assert assign_readers([5, 5, 5], 1) == [0, 0, 0]


def test_progress_quiet_without_tty() -> None:
    out = io.StringIO()
    p = Progress("save", 100, enabled=True, stream=out, delay=0.0)
    p.advance(50)
    p.close()
    assert out.getvalue() == ""


def test_stats_summary() -> None:
    s = Stats("save", "/x", 4, 2_000_000_000, 1_000_000_000, 2.0, [1.0, 2.0, 1.5, 0.5], "zstd")
    line = s.summary()
    assert "1.00 GB/s" in line and "ratio 2.00x" in line
    # The time said is the slowest rank's, named as such: no second figure
    # above it (the issue: "in 1.496 s ... slowest rank 1 (6.965 s)").
    assert "in 2.000 s (slowest rank 1; fastest 0.500 s)" in line, line


def test_load_exchange_argument(tmp_path: Path) -> None:
    deeppart.save({"a": torch.arange(5)}, tmp_path / "ck")
    assert torch.equal(
        deeppart.load(tmp_path / "ck", loading=deeppart.LoadOptions(exchange="read"))["a"],
        torch.arange(5),
    )
    with pytest.raises(ValueError, match="exchange"):
        deeppart.load(tmp_path / "ck", loading=deeppart.LoadOptions(exchange="carrier-pigeon"))


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    """A model with tied weights: state_dict() gives two tensor objects over
    one storage. They are one leaf (stored once), restored as one tensor, and
    an in-place load into a tied model keeps the tie."""
    torch.manual_seed(0)

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 8)
            self.head = torch.nn.Linear(8, 50, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    sd = model.state_dict()
    assert sd["embed.weight"] is not sd["head.weight"]
    assert len(deeppart.Manifest.from_state_dict(sd)) == 1
    deeppart.save({"model": sd, "step": 3}, tmp_path / "c")
    back = deeppart.load(tmp_path / "c")
    assert back["model"]["embed.weight"] is back["model"]["head.weight"]
    assert torch.equal(back["model"]["embed.weight"], sd["embed.weight"])
    # Views that differ (a slice, a transpose) are not the same data.
    w = torch.arange(12.0).reshape(3, 4)
    views = {"w": w, "t": w.t(), "row": w[1], "empty_a": torch.zeros(0), "empty_b": torch.zeros(0)}
    assert len(deeppart.Manifest.from_state_dict(views)) == 5
    fresh = Tied()
    with torch.no_grad():
        fresh.embed.weight.zero_()
    deeppart.load(tmp_path / "c", into={"model": fresh.state_dict(), "step": 0})
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.head.weight, model.embed.weight)


def test_interrupted_overwrite_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """overwrite=True over a committed checkpoint, dying after the old one was
    moved aside but before the new one was renamed in (its marker is
    written before that rename, which is the commit): load() serves the old
    one (with a warning), never nothing; a Checkpointer's cleanup keeps that
    only copy until the step commits again."""
    d = tmp_path / "step-00000005"
    old_state = {"w": torch.arange(10.0), "step": 5}
    deeppart.save(old_state, d)
    real = commit.rename_noreplace

    def die_at_commit(src: Path, dst: Path) -> None:
        if src.name.startswith(".tmp-"):
            raise KeyboardInterrupt("killed before the commit's rename")
        real(src, dst)

    monkeypatch.setattr(commit, "rename_noreplace", die_at_commit)
    with pytest.raises(KeyboardInterrupt):
        deeppart.save({"w": torch.zeros(10), "step": 6}, d, overwrite=True)
    monkeypatch.setattr(commit, "rename_noreplace", real)
    assert not d.exists()
    olds = [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]
    assert len(olds) == 1 and is_committed(olds[0])
    with pytest.warns(UserWarning, match="a save replacing it was interrupted"):
        back = deeppart.load(d)
    assert_bitwise_equal(old_state, back, "previous checkpoint")

    # A later step commits: the cleanup must not delete step 5's only copy.
    cp = deeppart.Checkpointer(tmp_path)
    cp.save(7, {"w": torch.ones(10), "step": 7})
    assert olds[0].exists()
    with pytest.warns(UserWarning):
        assert deeppart.load(d)["step"] == 5
    # Step 5 committed again: now the moved-aside copy goes.
    cp.save(5, {"w": torch.ones(10), "step": 5})
    cp.save(8, {"w": torch.ones(10), "step": 8})
    assert not any(p.name.startswith(".old-") for p in tmp_path.iterdir())


# ----------------------------------------------------------------------------
# The writer's named fault hooks, and the renamed compression level.


def test_fault_hooks_fire_around_every_data_file_write(tmp_path: Path) -> None:
    from deeppart.saving.writer import WriteEvent, fault_hook

    seen: list[tuple[str, int, str, bool]] = []

    def record(event: WriteEvent) -> None:
        seen.append((event.point, event.rank, event.path.name, event.path.exists()))

    with fault_hook("before-write", record), fault_hook("after-write", record):
        deeppart.save({"w": torch.arange(100.0), "step": 1}, tmp_path / "a")
    assert seen == [
        ("before-write", 0, "rank-00000.bin", False),
        ("after-write", 0, "rank-00000.bin", True),
    ]
    # Removed on leaving the block: the next save fires nothing.
    deeppart.save({"w": torch.arange(100.0)}, tmp_path / "b")
    assert len(seen) == 2


def test_a_failing_fault_hook_fails_the_save_and_commits_nothing(tmp_path: Path) -> None:
    from deeppart.saving.writer import WriteEvent, fault_hook

    def disk_full(event: WriteEvent) -> None:
        raise OSError(28, "No space left on device (injected)", str(event.path))

    deeppart.save({"w": torch.arange(10.0)}, tmp_path / "ck")
    with fault_hook("after-write", disk_full), pytest.raises(OSError, match="injected"):
        deeppart.save({"w": torch.zeros(10)}, tmp_path / "ck", overwrite=True)
    assert torch.equal(deeppart.load(tmp_path / "ck")["w"], torch.arange(10.0))
    assert [p.name for p in tmp_path.iterdir()] == ["ck"], "the temporary directory is gone"
    bad_point = "during-write"
    with pytest.raises(ValueError, match="fault point"), fault_hook(bad_point, disk_full):  # type: ignore[arg-type]
        pass


def test_compression_level_and_its_deprecated_old_name(tmp_path: Path) -> None:
    state = {"w": torch.zeros(1 << 16)}
    deeppart.save(
        state,
        tmp_path / "new",
        writing=deeppart.WriteOptions(compression="zstd", compression_level=3),
    )
    with pytest.warns(DeprecationWarning, match="compression_level"):
        deeppart.save(state, tmp_path / "old", compression="zstd", level=3)
    a = (tmp_path / "new" / "rank-00000.bin").read_bytes()
    b = (tmp_path / "old" / "rank-00000.bin").read_bytes()
    # Past the header (which carries each save's own id): the pieces.
    assert a[4096:] == b[4096:], "the same level, the same compressed bytes"
    with pytest.warns(DeprecationWarning, match="compression_level"):
        cp = deeppart.Checkpointer(tmp_path / "cp", compression="zstd", level=5)
    assert cp.compression_level == 5
    assert (
        deeppart.Checkpointer(
            tmp_path / "cp2", writing=deeppart.WriteOptions(compression_level=7)
        ).compression_level
        == 7
    )


#: Tensors of several dtypes and layouts, and their ids.
LAYOUTS = (
    [
        torch.arange(1, dtype=torch.float32),
        torch.arange(5, dtype=torch.int16),
        torch.arange(1000, dtype=torch.float64),
        torch.arange(4096, dtype=torch.bfloat16).reshape(64, 64),
        torch.arange(600, dtype=torch.float32).reshape(20, 30)[:, 5:],  # a strided view
    ],
    ["one", "short", "f64", "bf16-2d", "strided"],
)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
@pytest.mark.parametrize(
    "tensor",
    [
        *LAYOUTS[0],
        torch.randn(33, dtype=torch.complex64).conj(),  # a conjugate view
        torch.tensor([True, False, True]),
    ],
    ids=[*LAYOUTS[1], "conj", "bool"],
)
def test_streamed_digest_is_the_whole_tensor_digest(tensor: torch.Tensor, chunk: int) -> None:
    """A device tensor's replica proof streams it through two host buffers
    (deeppart.saving.digests.streamed_digest, for CUDA) instead of copying it
    to the host whole; at any chunk size its digest is the one-shot digest
    of the tensor's row-major bytes (so ranks holding one tensor on
    different devices agree), and a byte changed in any chunk changes it."""
    import xxhash

    from deeppart.saving.digests import streamed_digest, tensor_digest

    whole = tensor.resolve_conj().contiguous().reshape(-1).view(torch.uint8).numpy()
    expected = bytes(xxhash.xxh3_128_digest(whole.tobytes()))
    assert streamed_digest(tensor, chunk) == expected == tensor_digest(tensor)
    for at in sorted({0, whole.size // 2, whole.size - 1}):
        changed = tensor.resolve_conj().contiguous().clone()
        view = changed.reshape(-1).view(torch.uint8)
        view[at] = int(view[at]) ^ 0x01
        assert streamed_digest(changed, chunk) != expected, at


@pytest.mark.parametrize("leaf", [64, 100, 4096])
def test_a_large_tensors_digest_is_a_tree_of_its_leaves(
    monkeypatch: pytest.MonkeyPatch, leaf: int
) -> None:
    """A tensor larger than one leaf (DIGEST_LEAF, made small here) is
    digested leaf by leaf, on threads when there are: the xxh3_128 of a
    tag, its byte count and its leaves' xxh3_128 digests. Serial, threaded
    and streamed (any chunk size) digests agree; a byte changed in any leaf
    changes it; a tensor of one leaf is the plain xxh3_128 of its bytes."""
    from concurrent.futures import ThreadPoolExecutor

    import xxhash

    from deeppart.saving import digests

    monkeypatch.setattr(digests, "DIGEST_LEAF", leaf)
    t = torch.arange(3000, dtype=torch.float32).reshape(60, 50)[:, 3:]  # strided
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    leaves = [xxhash.xxh3_128_digest(raw[a : a + leaf]) for a in range(0, len(raw), leaf)]
    tag = b"deeppart-tree" + len(raw).to_bytes(8, "little")
    expected = xxhash.xxh3_128_digest(tag + b"".join(leaves))
    with ThreadPoolExecutor(2) as pool:
        assert digests.tensor_digest(t, pool) == expected
    assert digests.tensor_digest(t) == expected
    assert digests.digest_all([t, t[:1, :2]], threads=2)[0] == expected
    for chunk in (1, 7, leaf, 3 * leaf + 5, 1 << 20):
        assert digests.streamed_digest(t, chunk) == expected, chunk
    for at in (0, leaf - 1, leaf, len(raw) - 1):
        changed = t.contiguous().clone()
        view = changed.reshape(-1).view(torch.uint8)
        view[at] = int(view[at]) ^ 0x80
        assert digests.tensor_digest(changed) != expected, at
    small = t.reshape(-1)[: leaf // 4]
    assert digests.tensor_digest(small) == xxhash.xxh3_128_digest(
        small.contiguous().numpy().tobytes()
    )


@pytest.mark.parametrize("tensor", LAYOUTS[0], ids=LAYOUTS[1])
def test_replica_sample_reads_the_start_middle_and_end(tensor: torch.Tensor) -> None:
    """The sampled replica check's blocks are the bytes at the tensor's
    start, middle and end in row-major order, whatever its layout (read
    straight from memory when contiguous); a changed byte in any block
    changes the sample, and replicas with other strides sample the same."""
    from deeppart.saving.prepare import SAMPLE_BLOCKS, SAMPLE_BYTES, sample_bytes

    got = sample_bytes(tensor)
    u8 = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    step = max(1, (u8.size - SAMPLE_BYTES) // max(1, SAMPLE_BLOCKS - 1))
    last = max(0, u8.size - SAMPLE_BYTES)
    starts = sorted({min(k * step, last) for k in range(SAMPLE_BLOCKS)})
    assert got == b"".join(u8[a : a + SAMPLE_BYTES].tobytes() for a in starts)
    for a in starts:
        changed = tensor.contiguous().clone()
        view = changed.reshape(-1).view(torch.uint8)
        view[a] = int(view[a]) ^ 0xFF
        assert sample_bytes(changed) != got
    assert sample_bytes(tensor.clone()) == got  # the same values, other memory
    assert sample_bytes(tensor.t().contiguous().t()) == got  # other strides
