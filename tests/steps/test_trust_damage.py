"""Issue 49, items 2, 3 and 9, on a file system (the S3 side of item 2 is
in tests/checkpointer/test_checkpointer_s3.py; item 10 in tests/base/test_trust_mpi.py).

- Item 2: a damaged newest step (one bit flipped in its ``metadata.json``)
  is reported, never skipped: ``latest()``, ``steps()`` and ``load()``
  raise CorruptCheckpointError naming it (before: ``latest()`` was None
  and the job restarted from step 0), and it is kept as evidence: no save
  replaces it, even with ``overwrite=True`` (before: the next save of
  that step replaced it), and no cleanup removes it.
- Item 3: the ``.old-`` copy left by an overwrite killed after moving the
  checkpoint aside goes once the step commits again, and is never served
  in place of a newer commit (before: once the newer one was damaged or
  deleted, load served the old copy).
- Item 9: no space left while the commit writes ``metadata.json`` or
  ``COMMITTED``: NoSpaceError naming it, the save's temporary directory
  removed (before: kept for good, with a warning that it held entries
  "this save did not write"), the committed steps intact; a user's file
  in that directory stays.
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart
from deeppart.errors import CorruptCheckpointError, NoSpaceError
from deeppart.format import MARKER, METADATA, step_dir_name, write_durable
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import commit


def state(v: int) -> dict[str, Any]:
    return {"w": torch.arange(32, dtype=torch.float32) + v, "v": v}


def flip_bit(path: Path, at: int = -10) -> bytes:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    return bytes(data)


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


# ----------------------------------------------------------------------------
# Item 2: a damaged step.


@pytest.mark.parametrize("what", [METADATA, MARKER])
def test_a_damaged_newest_step_is_reported_and_kept(tmp_path: Path, what: str) -> None:
    root = tmp_path / "run"
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(1, state(1))
    ck.save(2, state(2))  # step 1 pruned
    step2 = root / step_dir_name(2)
    flip_bit(step2 / what)
    evidence = files(step2)
    ck = deeppart.Checkpointer(root, keep_last=1)  # the restart
    for call in (ck.latest, ck.steps, ck.load):
        with pytest.raises(CorruptCheckpointError, match=r"step 2 at .*step-00000002"):
            call()
    with pytest.raises(CorruptCheckpointError, match="damaged"):
        ck.load(2)
    for overwrite in (False, True):
        with pytest.raises(CorruptCheckpointError, match="kept as evidence"):
            ck.save(2, state(3), overwrite=overwrite)
        with pytest.raises(CorruptCheckpointError, match="kept as evidence"):
            deeppart.save(state(3), step2, overwrite=overwrite)
    # A save of a newer step commits, and its cleanup leaves the damaged one.
    ck.save(3, state(3))
    assert files(step2) == evidence
    assert not [p.name for p in root.iterdir() if p.name.startswith((".tmp-", ".old-"))]
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        ck.latest()
    assert ck.load(3)["v"] == 3
    # Moved out of the root by the user: the steps that remain resume.
    step2.rename(tmp_path / "evidence")
    assert ck.latest() == 3 and ck.steps() == [3]


def test_a_damaged_older_step_is_reported_too(tmp_path: Path) -> None:
    """Which step is newest is unknown once one is damaged (its commit
    order is in the damaged metadata): also an older number is reported."""
    root = tmp_path / "run"
    ck = deeppart.Checkpointer(root)
    for s in (1, 2, 3):
        ck.save(s, state(s))
    flip_bit(root / step_dir_name(2) / METADATA)
    with pytest.raises(CorruptCheckpointError, match="step 2"):
        deeppart.Checkpointer(root).latest()
    assert ck.load(3)["v"] == 3 and ck.load(1)["v"] == 1


def test_an_uncommitted_step_is_not_damage(tmp_path: Path) -> None:
    """A step directory without a marker (what an earlier version's
    interrupted save left) is not reported: nothing was committed there."""
    root = tmp_path / "run"
    ck = deeppart.Checkpointer(root)
    ck.save(1, state(1))
    ck.save(2, state(2))
    (root / step_dir_name(2) / MARKER).unlink()
    assert deeppart.Checkpointer(root).latest() == 1


# ----------------------------------------------------------------------------
# Item 3: a stale .old- copy.


class Killed(Exception):
    pass


def kill_overwrite_after_move_aside(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """The next commit dies after moving the checkpoint aside, before its
    own rename (as a kill there would leave it)."""
    real = commit.rename_noreplace

    def rename(src: Path, dst: Path) -> None:
        if src.name.startswith(".tmp-"):
            raise Killed("killed before the commit's rename")
        real(src, dst)

    monkeypatch.setattr(commit, "rename_noreplace", rename)
    return lambda: monkeypatch.setattr(commit, "rename_noreplace", real)


@pytest.mark.parametrize("then", ["damaged", "deleted"])
def test_a_stale_old_copy_is_removed_and_never_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    target = tmp_path / "ck"
    deeppart.save(state(1), target)
    undo = kill_overwrite_after_move_aside(monkeypatch)
    with pytest.raises(Killed):
        deeppart.save(state(2), target, overwrite=True)
    undo()
    olds = [p for p in tmp_path.iterdir() if p.name.startswith(".old-ck-")]
    assert len(olds) == 1
    with pytest.warns(UserWarning, match="interrupted"):
        assert deeppart.load(target)["v"] == 1  # the only committed copy: served
    deeppart.save(state(3), target, overwrite=True)
    deeppart.save(state(4), target, overwrite=True)
    assert not olds[0].exists(), "the stale copy outlived the commits after it"
    if then == "damaged":
        flip_bit(target / METADATA)
        with pytest.raises(CorruptCheckpointError):
            deeppart.load(target)
    else:
        for p in target.iterdir():
            p.unlink()
        target.rmdir()
        with pytest.raises(deeppart.CheckpointError):
            deeppart.load(target)


def test_an_old_copy_is_never_served_for_a_damaged_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even while the ``.old-`` copy is there (a step committed by another
    writer beside it, which no commit of ours followed), a damaged commit
    at the name is reported, not replaced by the older copy."""
    target = tmp_path / "ck"
    deeppart.save(state(1), target)
    undo = kill_overwrite_after_move_aside(monkeypatch)
    with pytest.raises(Killed):
        deeppart.save(state(2), target, overwrite=True)
    undo()
    old = next(p for p in tmp_path.iterdir() if p.name.startswith(".old-ck-"))
    # Committed again without this library's cleanup (as by a copy).
    (target).mkdir()
    for p in old.iterdir():
        (target / p.name).write_bytes(p.read_bytes())
    flip_bit(target / METADATA)
    with pytest.raises(CorruptCheckpointError):
        deeppart.load(target)


# ----------------------------------------------------------------------------
# Item 9: no space left at the commit.


def no_space_at(name: str, partly: bool) -> Callable[[Path, bytes], None]:
    def write(path: Path, data: bytes) -> None:
        if path.name == name:
            if partly:
                path.write_bytes(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write_durable(path, data)

    return write


@pytest.mark.parametrize("partly", [False, True])
@pytest.mark.parametrize("name", [METADATA, MARKER])
def test_no_space_at_the_commit_is_a_clear_error_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, partly: bool
) -> None:
    root = tmp_path / "run"
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(1, state(1))
    before = files(root / step_dir_name(1))
    monkeypatch.setattr(commit, "write_durable", no_space_at(name, partly))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "kept" warning
        with pytest.raises(NoSpaceError, match="no space left") as info:
            ck.save(2, state(2))
    monkeypatch.setattr(commit, "write_durable", write_durable)
    assert isinstance(info.value, OSError) and info.value.errno == errno.ENOSPC
    assert name in str(info.value)
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(1)]
    assert files(root / step_dir_name(1)) == before
    assert ck.latest() == 1 and ck.load()["v"] == 1
    ck.save(2, state(2))
    assert ck.latest() == 2


def test_no_space_keeps_a_users_file_in_the_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "run"
    mine: list[Path] = []

    def put_mine(event: WriteEvent) -> None:
        tmp = next(p for p in root.iterdir() if p.name.startswith(".tmp-"))
        (tmp / "mine.txt").write_bytes(b"the user's")
        mine.append(tmp / "mine.txt")

    monkeypatch.setattr(commit, "write_durable", no_space_at(METADATA, True))
    with (
        fault_hook("after-write", put_mine),
        pytest.warns(UserWarning, match="mine.txt"),
        pytest.raises(NoSpaceError),
    ):
        deeppart.Checkpointer(root).save(1, state(1))
    assert mine and mine[0].read_bytes() == b"the user's"
    # What the commit wrote is gone (the directory, with the user's file
    # and the data file, stays, as for any failed save: remove_temp_dir).
    assert not {METADATA, MARKER} & {p.name for p in mine[0].parent.iterdir()}
