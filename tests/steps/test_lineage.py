"""Steps as a line (issue 31, item 6; deeppart/steps/lineage.py): ``keep_last``
counts only the live line's steps written by a Checkpointer under its own
naming, a rollback starts a new line whose abandoned steps are retired and
never resumed, in ``Checkpointer`` and in the multi-level engine."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart
from deeppart.format import MARKER, METADATA, is_committed, marker_text, step_dir_name
from deeppart.levels import LevelConfig
from deeppart.levels.engine import BuiltinBackend
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.steps import lineage


def state(v: int) -> dict[str, Any]:
    return {"w": torch.arange(16, dtype=torch.float32) + v, "step": v}


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def check(ck: Any, v: int, step: int | None = None) -> None:
    got = ck.load(step)
    assert got["step"] == v and torch.equal(got["w"], state(v)["w"])


# ----------------------------------------------------------------------------
# Checkpointer.


def test_only_deeppart_named_old_copies_are_cleaned_up(tmp_path: Path) -> None:
    """A Checkpointer's cleanup removes a superseded ``.old-NAME-<12 hex>``
    copy (an overwrite's, its step committed again) and keeps a directory
    that only looks like one (``.old-NAME-`` and 12 characters that are not
    hex), even when it holds a checkpoint: DeepPart did not write that name."""
    import shutil

    ck = deeppart.Checkpointer(tmp_path, keep_last=5)
    ck.save(1, state(1))
    step1 = ck.path(1)
    ours = tmp_path / f".old-{step1.name}-0123456789ab"
    lookalike = tmp_path / f".old-{step1.name}-notAhex12chr"
    for d in (ours, lookalike):
        shutil.copytree(step1, d)
    ck.save(2, state(2))
    assert not ours.exists()
    assert lookalike.is_dir() and is_committed(lookalike)
    check(ck, 1, 1)


@pytest.mark.parametrize("name", ["step-500", step_dir_name(500)])
def test_keep_last_ignores_a_deeppart_save_named_like_a_step(tmp_path: Path, name: str) -> None:
    """A committed ``step-500`` (docs/CHECKPOINTER.md's naming for deeppart.save) or a
    ``step-00000500`` written by deeppart.save: the Checkpointer's new
    steps are kept, latest() is a step load() finds, the other checkpoint
    is untouched."""
    root = tmp_path / "ck"
    deeppart.save(state(500), root / name)
    before = tree(root)
    ck = deeppart.Checkpointer(root, keep_last=1)
    ck.save(10, state(10))
    assert ck.latest() == 10 and ck.steps() == [10]
    check(ck, 10)
    ck.save(20, state(20))
    assert ck.steps() == [20] and not ck.path(10).exists()
    check(ck, 20)
    assert {k: v for k, v in tree(root).items() if k.startswith(name + "/")} == before


@pytest.mark.parametrize("legacy", [False, True])
def test_an_earlier_runs_step_is_not_counted(tmp_path: Path, legacy: bool) -> None:
    """An earlier run's ``step-00000500`` (by a Checkpointer of this
    version, or of an earlier one, whose steps carry no line record): a new
    run that does not resume from it keeps its own steps, resumes from its
    own newest one, and never touches step 500."""
    root = tmp_path / "ck"
    if legacy:  # what an earlier Checkpointer wrote: user = {"step": N, "user": ...}
        deeppart.save(state(500), root / step_dir_name(500), user={"step": 500, "user": None})
        assert deeppart.Checkpointer(root).latest() == 500, "an upgrade still resumes"
    else:
        deeppart.Checkpointer(root).save(500, state(500))
    before = tree(root)
    ck = deeppart.Checkpointer(root, keep_last=1)
    for step in (10, 20, 30):
        ck.save(step, state(step))
        assert ck.latest() == step and ck.path(step).is_dir()
    assert ck.steps() == [30]
    restart = deeppart.Checkpointer(root, keep_last=1)
    assert restart.latest() == 30
    check(restart, 30)
    check(restart, 500, 500)
    assert {k: v for k, v in tree(root).items() if k.startswith(step_dir_name(500))} == before


def test_rollback_starts_a_new_line_that_a_restart_resumes(tmp_path: Path) -> None:
    """save 10, 20, 30; load(20); save 21, 22 with keep_last=2: the line is
    20 -> 21 -> 22, so 21 and 22 stay, 30 (abandoned) is removed, and a
    restart resumes at 22."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, keep_last=2)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    check(ck, 20, 20)
    ck.save(21, state(21))
    assert ck.latest() == 21 and ck.steps() == [20, 21]
    assert not ck.path(30).exists(), "the abandoned step is retired"
    ck.save(22, state(22))
    assert ck.steps() == [21, 22]
    assert sorted(p.name for p in root.iterdir()) == [step_dir_name(21), step_dir_name(22)]
    restart = deeppart.Checkpointer(root, keep_last=2)
    assert restart.latest() == 22
    check(restart, 22)


def test_rollback_without_keep_last_moves_the_abandoned_steps_aside(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root)
    for step in (10, 20, 30, 40):
        ck.save(step, state(step))
    ck.load(20)
    ck.save(21, state(21))
    assert ck.steps() == [10, 20, 21] and ck.latest() == 21
    aside = sorted(p.name for p in root.iterdir() if p.name.startswith(".abandoned-"))
    assert [n[: -len("-0123456789ab")] for n in aside] == [
        ".abandoned-" + step_dir_name(30),
        ".abandoned-" + step_dir_name(40),
    ]
    assert all(is_committed(root / n) for n in aside), "moved aside whole, still loadable"
    assert deeppart.load(root / aside[1])["step"] == 40
    ck.save(22, state(22))
    assert deeppart.Checkpointer(root).latest() == 22
    assert deeppart.Checkpointer(root).steps() == [10, 20, 21, 22]


@pytest.mark.parametrize("keep_last", [None, 2])
def test_rollback_saves_again_a_step_of_the_left_line(
    tmp_path: Path, keep_last: int | None
) -> None:
    """Checkpoints every 10 steps, back to 20, train again: the new step 30
    replaces the abandoned one (no 'committed checkpoint exists')."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, keep_last=keep_last)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    ck.load(20)
    ck.save(30, state(31))
    check(ck, 31)
    ck.save(40, state(40))
    assert ck.latest() == 40
    assert ck.steps() == ([10, 20, 30, 40] if keep_last is None else [30, 40])
    check(deeppart.Checkpointer(root), 31, 30)
    # Without a rollback, a committed step is still refused.
    with pytest.raises(deeppart.CheckpointError, match="a committed checkpoint exists"):
        ck.save(40, state(0))


def test_saving_again_the_loaded_step_keeps_its_place(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    ck.load(20)
    ck.save(20, state(25), overwrite=True)
    ck.save(21, state(21))
    assert ck.steps() == [10, 20, 21]
    check(ck, 25, 20)


def test_async_rollback(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, keep_last=2, async_=True)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    check(ck, 20, 20)
    ck.save(21, state(21))
    ck.save(22, state(22))
    ck.wait()
    assert ck.steps() == [21, 22] and not ck.path(30).exists()
    ck.close()
    assert deeppart.Checkpointer(root).latest() == 22


# ----------------------------------------------------------------------------
# The multi-level engine.


def engine_config(tmp_path: Path, keep: int) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(tmp_path / "local"),
            "meta_dir": str(tmp_path / "meta"),
            "glbl_dir": str(tmp_path / "global"),
            "ckpt_l4": 2,
            "local_test": 1,
            "keep": keep,
        }
    )


def test_engine_rollback_starts_a_new_line(tmp_path: Path) -> None:
    c = engine_config(tmp_path, keep=2)
    ck = deeppart.Checkpointer(tmp_path / "unused", config=c, backend="builtin")
    for step in (10, 20, 30):
        ck.save(step, state(step))
    check(ck, 20, 20)
    ck.save(21, state(21))
    ck.save(22, state(22))
    assert ck.latest() == 22 and ck.steps() == [21, 22]
    for root in (tmp_path / "meta" / "deeppart", tmp_path / "local" / "node0" / "deeppart"):
        assert not (root / step_dir_name(30)).exists(), root
    restart = BuiltinBackend(c)
    assert restart.latest() == 22
    got, report = restart.load()
    assert report.step == 22 and got["step"] == 22


def test_engine_keep_ignores_other_checkpoints(tmp_path: Path) -> None:
    """A deeppart.save checkpoint named step-00000500 in the engine's
    metadata root, and a user's step-7: not counted, not touched."""
    c = engine_config(tmp_path, keep=1)
    meta = tmp_path / "meta" / "deeppart"
    deeppart.save(state(500), meta / step_dir_name(500))
    (meta / "step-7").mkdir()
    (meta / "step-7" / "notes.txt").write_text("mine")
    before = tree(meta)
    be = BuiltinBackend(c)
    be.save(10, state(10))
    assert be.latest() == 10
    be.save(11, state(11))
    assert be.latest() == 11 and be.steps() == [11]
    got, _ = BuiltinBackend(c).load()
    assert got["step"] == 11
    after = tree(meta)
    assert {k: v for k, v in after.items() if not k.startswith("step-0000001")} == before


def test_a_cleanup_leaves_a_racing_save_in_flight_alone(tmp_path: Path) -> None:
    """Two Checkpointers on one root (two jobs): while one's save of step 2
    is between its write and its commit, the other commits step 1 and
    cleans up. The in-flight temporary directory holds its lock, so it is
    not taken for a crash's leftover: the paused save then commits."""
    import threading

    from deeppart.saving import writer

    root = tmp_path / "ckpt"
    paused, go = threading.Event(), threading.Event()
    outcome: list[BaseException | None] = []

    def hook(event: Any) -> None:
        if threading.current_thread().name == "racer":
            paused.set()
            assert go.wait(60)

    def racer() -> None:
        try:
            deeppart.Checkpointer(root).save(2, {"w": torch.full((64,), 2.0)})
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    with writer.fault_hook("after-write", hook):
        t = threading.Thread(target=racer, name="racer")
        t.start()
        assert paused.wait(60)
        (tmp_dir,) = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
        deeppart.Checkpointer(root, keep_last=1).save(1, {"w": torch.full((64,), 1.0)})
        assert tmp_dir.is_dir(), "the cleanup removed a save in flight"
        go.set()
        t.join(60)
    assert outcome == [None]
    back = deeppart.load(root / step_dir_name(2))
    assert torch.equal(back["w"], torch.full((64,), 2.0))


def test_a_save_after_its_parent_left_the_root_is_on_the_line(tmp_path: Path) -> None:
    """The step a Checkpointer last saved is moved out of the root (a
    damaged step's evidence, docs/CHECKPOINTER.md): its next save's seq is above its
    parent's, so the step is on the live line and a restart resumes it.
    Before (issue 49), that save's seq equalled the parent's: a record that
    is no line record, the step invisible to latest(), steps(), keep_last."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, keep_last=2)
    ck.save(1, state(1))
    ck.save(2, state(2))
    ck.path(2).rename(tmp_path / "evidence")
    assert ck.latest() == 1
    ck.save(3, state(3))
    assert ck.latest() == 3 and ck.steps() == [3]
    check(deeppart.Checkpointer(root), 3)
    ck.save(4, state(4))
    ck.save(5, state(5))
    assert ck.steps() == [4, 5] and not ck.path(3).exists()


def test_engine_save_after_its_parent_left_the_root_is_on_the_line(tmp_path: Path) -> None:
    c = engine_config(tmp_path, keep=2)
    be = BuiltinBackend(c)
    be.save(10, state(10))
    be.save(11, state(11))
    for i, root in enumerate((tmp_path / "meta", tmp_path / "global")):
        for copy in root.rglob(step_dir_name(11)):
            copy.rename(tmp_path / f"evidence-{i}")
    assert be.latest() == 10
    be.save(12, state(12))
    assert be.latest() == 12 and be.steps() == [12]
    got, _ = BuiltinBackend(c).load()
    assert got["step"] == 12


def _rewrite_in_place(path: Path, data: bytes) -> None:
    """Writes ``data`` over ``path`` (same inode), then puts its old
    timestamps back: a rewrite within one timestamp tick, as a coarse file
    system shows it."""
    st = path.stat()
    with path.open("r+b") as f:
        f.write(data)
        f.truncate()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_record_rewritten_within_one_timestamp_tick_is_not_served_stale(
    tmp_path: Path,
) -> None:
    """A step's metadata.json and COMMITTED rewritten in place with the same
    sizes and mtimes (another job's commit within one tick of a coarse
    clock): the next scan reads the new record. Before, the record cache
    was keyed by inode, size and mtime only and served the old record."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root)
    ck.save(1, state(1))
    before = lineage.scan(root).nodes[1]
    meta_path = ck.path(1) / METADATA
    meta = meta_path.read_bytes()
    other_run = "f" * 16 if before.run != "f" * 16 else "e" * 16
    rewritten = meta.replace(before.run.encode(), other_run.encode())
    assert rewritten != meta and len(rewritten) == len(meta)
    _rewrite_in_place(meta_path, rewritten)
    _rewrite_in_place(ck.path(1) / MARKER, marker_text(rewritten))
    assert lineage.scan(root).nodes[1].run == other_run


@pytest.mark.parametrize("async_", [False, True])
def test_a_failed_rollback_save_keeps_the_left_step_in_place(tmp_path: Path, async_: bool) -> None:
    """Without keep_last, back to 20 and a save of step 30 (a step the left
    line holds) that fails while writing: step 30 of the left line stays
    where it was, still the newest step (nothing new committed); the next
    save of 30 that commits moves it aside. Before (issue 49, model test),
    the left step was moved aside when the save began, so the failed save
    lost it from the root's line: latest() fell back to 20."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, async_=async_)
    for step in (10, 20, 30):
        ck.save(step, state(step))
    ck.wait()
    check(ck, 20, 20)

    def fail(_event: WriteEvent) -> None:
        raise OSError("the write failed")

    with fault_hook("after-write", fail), pytest.raises(OSError, match="the write failed"):
        ck.save(30, state(31))
        ck.wait()
    assert not [p for p in root.iterdir() if p.name.startswith(".abandoned-")]
    assert ck.latest() == 30 and ck.steps() == [10, 20, 30]
    check(deeppart.Checkpointer(root), 30)
    check(ck, 20, 20)
    ck.save(30, state(31))
    ck.wait()
    assert ck.steps() == [10, 20, 30]
    check(ck, 31, 30)
    aside = [p for p in root.iterdir() if p.name.startswith(".abandoned-")]
    assert len(aside) == 1 and deeppart.load(aside[0])["step"] == 30


@pytest.mark.parametrize("keep_last", [None, 3])
def test_a_zombie_beside_its_requeued_job_retires_none_of_its_steps(
    tmp_path: Path, keep_last: int | None
) -> None:
    """A requeued job and its zombie both resume from step 2 in one root
    and save in turns: neither retires the other's steps (each left no
    line: the other's were committed after its load), the head is the
    newest commit, and the live job's line keeps every step it committed.
    Before (issue 49, model test), the zombie's save retired the live job's
    step 3 as a step of a line it left (removed with keep_last), which
    also cut the live job's line at its next save."""
    root = tmp_path / "ck"
    deeppart.Checkpointer(root).save(1, state(1))
    first = deeppart.Checkpointer(root)
    first.load()
    first.save(2, state(2))
    live = deeppart.Checkpointer(root, keep_last=keep_last)
    zombie = deeppart.Checkpointer(root, keep_last=keep_last)
    check(live, 2)
    check(zombie, 2)
    live.save(3, state(3))
    zombie.save(4, state(4))
    assert live.latest() == 4 and live.steps() == [1, 2, 4]
    assert deeppart.load(live.path(3))["step"] == 3  # still there (read off the line)
    live.save(5, state(5))
    assert live.steps() == [1, 2, 3, 5][-(keep_last or 4) :]
    assert live.path(3).is_dir() and live.path(4).is_dir()
    # A step number the other job holds is refused, not replaced.
    with pytest.raises(deeppart.CheckpointError, match="a committed checkpoint exists"):
        zombie.save(5, state(0))
    check(deeppart.Checkpointer(root), 5)
    assert not [p for p in root.iterdir() if p.name.startswith(".abandoned-")]


def test_engine_zombie_beside_its_requeued_job_retires_none_of_its_steps(
    tmp_path: Path,
) -> None:
    """The multi-level engine's line, as the Checkpointer's above: a
    requeued job and its zombie both resume from step 2; the zombie's save
    of step 4 must not retire the live job's step 3 (committed after the
    zombie loaded: another job's step, not one of a line it left), in the
    metadata root, the global copies or the node-local files."""
    c = engine_config(tmp_path, keep=4)
    first = BuiltinBackend(c)
    first.save(1, state(1))
    first.save(2, state(2))
    live, zombie = BuiltinBackend(c), BuiltinBackend(c)
    for job in (live, zombie):
        got, report = job.load()
        assert report.step == 2 and got["step"] == 2
    live.save(3, state(3))
    zombie.save(4, state(4))
    meta, local = tmp_path / "meta" / "deeppart", tmp_path / "local" / "node0" / "deeppart"
    for root in (meta, local):
        assert (root / step_dir_name(3)).is_dir(), f"the zombie's save retired step 3 in {root}"
    got, report = BuiltinBackend(c).load(3)
    assert report.step == 3 and got["step"] == 3
    live.save(5, state(5))
    for root in (meta, local):
        assert (root / step_dir_name(4)).is_dir(), f"the live job's save retired step 4 in {root}"
    got, report = BuiltinBackend(c).load()
    assert report.step == 5 and got["step"] == 5


# ----------------------------------------------------------------------------
# A requeued job and its zombie: two commits with one step number and one seq.


@pytest.mark.parametrize("resumed", [False, True])
def test_a_zombie_never_takes_the_live_jobs_step_for_its_parent(
    tmp_path: Path, resumed: bool
) -> None:
    """A job is requeued while it still runs: the live job and its zombie
    save into one root (``resumed``: both from the step they loaded, one
    run; else each a fresh run). The zombie's step 1 is damaged and moved
    out of the root; the live job then commits its own step 1, with the
    very seq the zombie's had (each numbers from what the root holds).
    The zombie's next save names its step 1 as parent: before records
    carried an id, that link named the live job's step 1, put it on the
    zombie's line, and keep_last=1 removed it (and step 0) — the live
    job's newest step lost. Now the link names only the zombie's own
    commit: both of the live job's steps stay, loadable."""
    root = tmp_path / "ck"
    first = deeppart.Checkpointer(root, keep_last=1)
    first.save(0, state(0))
    live, zombie = deeppart.Checkpointer(root, keep_last=1), first
    if resumed:
        check(live, 0)
        check(zombie, 0)
    zombie.save(1, state(1))
    zombie.path(1).rename(tmp_path / "evidence")  # what an operator does with a damaged step
    live.save(1, state(101))
    seq = {n: node.seq for n, node in lineage.scan(root).nodes.items()}
    zombie.save(2, state(2))
    lines = lineage.scan(root)
    assert lines.nodes[1].seq == seq[1] and 1 in lines.nodes, "the zombie retired the live step 1"
    check(deeppart.Checkpointer(root), 101, 1)
    assert lines.nodes[2].parent is not None and not lines.nodes[2].parent.names(lines.nodes[1])
    # The zombie's step is the newest commit; its line holds only it.
    assert deeppart.Checkpointer(root).steps() == [2]
    assert live.latest() == 2


def test_engine_zombie_never_takes_the_live_jobs_step_for_its_parent(tmp_path: Path) -> None:
    """:func:`test_a_zombie_never_takes_the_live_jobs_step_for_its_parent`
    in the multi-level engine (keep=1): the live job's step 11, committed
    with the seq of the zombie's removed step 11, stays."""
    c = engine_config(tmp_path, keep=1)
    zombie = BuiltinBackend(c)
    zombie.save(10, state(10))
    live = BuiltinBackend(c)
    live.load(10)
    zombie.save(11, state(11))
    for i, root in enumerate((tmp_path / "meta", tmp_path / "global")):
        for copy in root.rglob(step_dir_name(11)):
            copy.rename(tmp_path / f"evidence-{i}")
    live.save(11, state(111))
    zombie.save(12, state(12))
    assert 11 in live.committed_steps(), "the zombie retired the live job's step 11"
    got, _ = BuiltinBackend(c).load(11)
    assert got["step"] == 111 and torch.equal(got["w"], state(111)["w"])


def test_records_written_before_ids_still_form_a_line(tmp_path: Path) -> None:
    """Steps whose records have no ``id`` and name their parent as
    ``[step, seq]`` (DeepPart before this change) stay a line: a new
    Checkpointer resumes the newest, and its next save continues that
    line, naming the old parent by step and seq."""
    root = tmp_path / "ck"
    ck = deeppart.Checkpointer(root, keep_last=3)
    ck.save(1, state(1))
    ck.save(2, state(2))
    for step in (1, 2):
        meta_path = ck.path(step) / METADATA
        raw = json.loads(meta_path.read_bytes())
        line = raw["user"]["line"]
        assert isinstance(line.pop("id"), str)
        if line["parent"] is not None:
            assert len(line["parent"]) == 3
            line["parent"] = line["parent"][:2]
        meta = json.dumps(raw).encode()
        meta_path.write_bytes(meta)
        (ck.path(step) / MARKER).write_bytes(marker_text(meta))
    fresh = deeppart.Checkpointer(root, keep_last=3)
    assert fresh.steps() == [1, 2]
    check(fresh, 2)
    fresh.save(3, state(3))
    lines = lineage.scan(root)
    assert fresh.steps() == [1, 2, 3]
    assert lines.nodes[3].parent == lineage.Link(2, lines.nodes[2].seq)
    assert lines.nodes[2].ident is None and lines.nodes[3].ident is not None


@pytest.mark.parametrize(
    "line",
    [
        {"run": "0" * 16, "seq": 2, "id": "xyz", "parent": None},
        {"run": "0" * 16, "seq": 2, "id": 7, "parent": None},
        {"run": "0" * 16, "seq": 2, "parent": [1, 1, "not hex"]},
        {"run": "0" * 16, "seq": 2, "parent": [1, 1, "0" * 16, 4]},
        {"run": "0" * 16, "seq": 2, "parent": [1, 1, None]},
    ],
)
def test_a_malformed_id_is_no_line_record(line: dict[str, Any], tmp_path: Path) -> None:
    assert lineage.parse({"step": 3, "user": None, "line": line}, 3, tmp_path) is None
