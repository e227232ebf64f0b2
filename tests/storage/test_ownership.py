"""Save owns only what it made (deeppart/storage/ownership.py): a target that holds
something of the user's is refused before anything is written, and
cleanups remove only DeepPart's own directories. Every test compares the
user's files, byte for byte, before and after."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import deeppart
from deeppart.errors import ExportError, ForeignPathError
from deeppart.format import is_committed, step_dir_name

ROOT = Path(__file__).resolve().parents[2]
from launching import run_in_session  # noqa: E402

MPIEXEC = Path(sys.executable).parent / "mpiexec"
WORKER = ROOT / "tests" / "storage" / "ownership_worker.py"


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (not following links): files by content,
    links by target, directories by name."""
    out: dict[str, bytes | str] = {}
    if root.is_symlink():
        return {".": f"-> {os.readlink(root)}"}
    if root.is_file():
        return {".": root.read_bytes()}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = f"-> {os.readlink(p)}"
            elif p.is_dir():
                out[rel] = "<dir>"
            else:
                out[rel] = p.read_bytes()
    return out


def state() -> dict[str, object]:
    return {"w": np.arange(5000, dtype=np.float32), "step": 3}


def no_leftovers(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_save_to_a_regular_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("my notes\n")
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ForeignPathError, match="not a directory"):
            deeppart.save(state(), target, overwrite=overwrite)
    assert snapshot(tmp_path) == before
    no_leftovers(tmp_path)


def test_save_to_a_non_empty_foreign_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "dir"
    (target / "sub").mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    (target / "sub" / "data.csv").write_text("a,b\n1,2\n")
    before = snapshot(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ForeignPathError, match=r"notes\.txt, sub"):
            deeppart.save(state(), target, overwrite=overwrite)
    assert snapshot(tmp_path) == before
    no_leftovers(tmp_path)


def test_a_committed_checkpoint_with_a_foreign_file_is_not_replaced(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    deeppart.save(state(), target)
    (target / "README").write_text("what this run was")
    before = snapshot(tmp_path)
    with pytest.raises(ForeignPathError, match="README"):
        deeppart.save(state(), target, overwrite=True)
    assert snapshot(tmp_path) == before


def test_save_to_a_symlink_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_bytes(b"\x00\x01")
    link = tmp_path / "ck"
    link.symlink_to(elsewhere)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing-here")
    before = snapshot(tmp_path)
    for target in (link, dangling):
        with pytest.raises(ForeignPathError, match="symbolic link"):
            deeppart.save(state(), target, overwrite=True)
    assert snapshot(tmp_path) == before
    no_leftovers(tmp_path)


def test_an_empty_directory_and_an_own_checkpoint_are_fine(tmp_path: Path) -> None:
    target = tmp_path / "empty"
    target.mkdir()
    deeppart.save(state(), target)
    assert is_committed(target)
    with pytest.raises(deeppart.CheckpointError, match="overwrite=True"):
        deeppart.save(state(), target)
    deeppart.save({"w": np.ones(10, dtype=np.float32), "step": 4}, target, overwrite=True)
    assert deeppart.load(target)["step"] == 4
    no_leftovers(tmp_path)


def test_checkpointer_prunes_only_its_own_steps(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    foreign = root / step_dir_name(7)
    (foreign / "sub").mkdir(parents=True)
    (foreign / "notes.txt").write_text("not a checkpoint")
    (foreign / "sub" / "rank-00000.bin").write_bytes(b"mine")
    (root / "step-7").mkdir()  # another spelling of the same step
    (root / "step-7" / "x").write_text("x")
    (root / step_dir_name(2)).write_text("a file named like a step")
    (root / ".tmp-step-00000001-0123456789ab").mkdir()
    (root / ".tmp-step-00000001-0123456789ab" / "mine.txt").write_text("user's")
    (root / ".tmp-unrelated").mkdir()
    before = snapshot(root)
    ck = deeppart.Checkpointer(root, keep_last=1)
    for step in (8, 9, 10):
        ck.save(step, state())
    ours = {step_dir_name(10)}
    after = snapshot(root)
    assert {k: v for k, v in after.items() if k.split("/")[0] not in ours} == before
    assert ck.steps() == [10]
    # A pruned step of ours in which the user put a file is kept, with a warning.
    (root / step_dir_name(10) / "eval.txt").write_text("0.93")
    with pytest.warns(UserWarning, match=r"kept, it holds files DeepPart did not write \(eval"):
        ck.save(11, state())
    assert (root / step_dir_name(10) / "eval.txt").read_text() == "0.93"
    assert ck.steps() == [10, 11]


def test_checkpointer_still_removes_its_interrupted_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ck = deeppart.Checkpointer(root, keep_last=2)
    ck.save(1, state())
    half = root / ".tmp-step-00000002-00112233aabb"
    half.mkdir()
    (half / "rank-00000.bin").write_bytes(b"")  # a write that died before its header
    uncommitted = root / step_dir_name(3)
    uncommitted.mkdir()
    # DeepPart's by content (an older version's save died before its marker).
    (uncommitted / "metadata.json").write_text('{"format": "deeppart-checkpoint"}')
    ck.save(4, state())
    assert not half.exists() and not uncommitted.exists()
    assert ck.steps() == [1, 4]


def test_export_keeps_the_users_files(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    torch = pytest.importorskip("torch")
    deeppart.save({"model": {"w": torch.ones(4, 4)}}, tmp_path / "ck")
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "model.safetensors").write_bytes(b"older weights")
    before = snapshot(out)
    from deeppart.tools.export import export_safetensors, export_torch

    with pytest.raises(ExportError, match="overwrite"):
        export_safetensors(tmp_path / "ck", out)
    (tmp_path / "state.pt").write_bytes(b"keep")
    with pytest.raises(ExportError, match="overwrite"):
        export_torch(tmp_path / "ck", tmp_path / "state.pt")
    assert snapshot(out) == before and (tmp_path / "state.pt").read_bytes() == b"keep"
    export_safetensors(tmp_path / "ck", out, overwrite=True)
    assert (out / "config.json").read_text() == "{}"
    assert (out / "model.safetensors").read_bytes() != b"older weights"


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
@pytest.mark.parametrize("scenario", ["save-rank0", "save-rank1", "levels", "prune"])
def test_multi_rank_refusal_is_agreed(tmp_path: Path, scenario: str) -> None:
    """Each rank sees its own directory (as on node-local storage): only one
    rank sees the user's file, every rank raises the same error, and the
    file, like everything else, is unchanged (tests/storage/ownership_worker.py)."""
    n = 2
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(WORKER), scenario, str(tmp_path)]
    support = ROOT / "tests" / "support"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(support)])}
    rc, out = run_in_session(cmd, env, ROOT, 300)
    assert rc == 0, out[-8000:]
    for r in range(n):
        assert f"OK {scenario} rank {r}/{n}" in out, out[-8000:]


def test_checkpointer_save_with_swapped_arguments_says_so(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(tmp_path / "ck")
    with pytest.raises(deeppart.CheckpointError, match=r"got dict \(the arguments are swapped"):
        ck.save(state(), 5)  # type: ignore[arg-type]
    with pytest.raises(deeppart.CheckpointError, match="int >= 0, got -1"):
        ck.save(-1, state())
    assert not (tmp_path / "ck").exists()
