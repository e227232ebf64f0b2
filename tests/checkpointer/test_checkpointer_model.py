"""A model-based randomized test of ``deeppart.Checkpointer`` (issue 31).

A hypothesis ``RuleBasedStateMachine`` drives one Checkpointer (one
process, ``comm=None``; ``keep_last`` and ``async_`` drawn per example)
through random saves (also ``overwrite=True`` and back-to-back
asynchronous ones), loads of the newest and of earlier steps (rollbacks),
restarts, foreign files and directories dropped under the root and inside
step directories, checkpoints of other writers under the same root (a
second Checkpointer, ``deeppart.save`` under the Checkpointer's naming, an
earlier version's step without a line record; with exclusive commits, one
that takes a step while the Checkpointer's save of it is writing), and
crashes injected at
each stage of a save: the writer's fault hooks (``before-write``,
``after-write``) and the commit's (before the rename: ``metadata.json``;
after it: the ``COMMITTED`` marker). A crash is followed by a restart (a
new Checkpointer on the same root), as a real one would be.

The faults of issue 49, each checked by the oracle too: a split store (one
rank of a two-rank job addressing another store, or a data file the store
does not hold at commit time: every rank fails, nothing committed or
pruned); a damaged newest step (a bit flipped in its ``metadata.json`` or
its data file: reported by ``latest()``/``load()`` as
CorruptCheckpointError, never replaced, never an older step served in its
place; then moved out of the root as evidence); a ``KeyboardInterrupt``
on one rank of a two-rank save (every rank gets an error); ENOSPC half
through a data file, at ``metadata.json`` and at ``COMMITTED`` (the
temporary directory goes without a word, older commits stay); a commit by
the training job while the two ranks of an evaluator load the latest step
(both read the same one); and a requeued job beside its zombie, both
resumed from one step (neither retires the other's steps). Several ranks
are threads of this process (tests/support/thread_comm.py).

The oracle keeps every step the Checkpointer committed (its value, its
commit order, its parent, its line family) and computes the live line as
docs/FORMAT.md states it. After every rule: ``latest()`` is the newest
committed step of the live line and ``steps()`` the live line; every
committed step the oracle holds is on disk; no foreign file or other
writer's checkpoint was removed or changed. Every load returns exactly
what was saved.

CI runs 50 examples (about 10 s); ``DEEPPART_MODEL_EXAMPLES``
(and ``DEEPPART_MODEL_STEPS``, the rules per example) ask for more.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from thread_comm import run_ranks, thread_comms

import deeppart
from deeppart.format import (
    MARKER,
    METADATA,
    data_file_name,
    is_committed,
    step_dir_name,
    write_durable,
)
from deeppart.saving import writer
from deeppart.saving.writer import WriteEvent, fault_hook
from deeppart.storage import commit
from deeppart.storage.target import LocalTarget

EXAMPLES = int(os.environ.get("DEEPPART_MODEL_EXAMPLES", "50"))
STEPS = int(os.environ.get("DEEPPART_MODEL_STEPS", "30"))
#: Whether a commit can never replace what another writer committed (or
#: put) at its target meanwhile (issue 31, "Commits are exclusive"): the
#: racing-writer rule asserts that, so it runs only where commits are.
EXCLUSIVE_COMMITS = hasattr(deeppart, "CommitConflictError")
#: Step numbers the rules draw from (small, so that they collide).
STEP = st.integers(0, 9)
#: Where the examples' roots go: tmpfs when there is one (the test is about
#: what is committed and removed, not durability; fsyncs on a busy disk
#: would take most of its time).
BASE = os.environ.get("DEEPPART_MODEL_DIR") or (
    "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
)


class Crash(Exception):
    """An injected failure (a crash at a stage of a save)."""


class Interrupt(KeyboardInterrupt):
    """An injected interruption of one rank (not an Exception)."""


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def make_state(v: int) -> dict[str, Any]:
    return {"w": torch.arange(24, dtype=torch.float32) * 0.5 + v, "v": v, "tag": f"value {v}"}


def assert_state(got: Any, v: int) -> None:
    assert got["v"] == v and got["tag"] == f"value {v}", (got["v"], v)
    assert torch.equal(got["w"], make_state(v)["w"])


@dataclass
class Node:
    """A committed step of a line, as the oracle knows it."""

    step: int
    seq: int
    run: int
    #: The parent: its step, its seq and its value (each save's value is
    #: new, so it names that very commit, as the record's id does).
    parent: tuple[int, int, int] | None
    value: int


@contextlib.contextmanager
def commit_crash(
    name: str, error: Callable[[], BaseException] = lambda: Crash("crash writing")
) -> Iterator[None]:
    """Fails the commit with ``error()`` when it writes ``name``
    (``metadata.json`` or the ``COMMITTED`` marker, into the save's
    temporary directory before the rename)."""

    def failing(path: Path, data: bytes) -> None:
        if path.name == name:
            raise error()
        write_durable(path, data)

    setattr(commit, "write_durable", failing)  # noqa: B010  (commit_dir's name for it)
    try:
        yield
    finally:
        setattr(commit, "write_durable", write_durable)  # noqa: B010


@contextlib.contextmanager
def crash_at(point: str) -> Iterator[None]:
    if point in ("before-write", "after-write"):

        def hook(event: WriteEvent) -> None:
            raise Crash(f"crash at {event.point}")

        with fault_hook(point, hook):  # type: ignore[arg-type]
            yield
    else:
        with commit_crash(METADATA if point == "commit-metadata" else MARKER):
            yield


@contextlib.contextmanager
def data_write_fails(error: Callable[[], BaseException]) -> Iterator[None]:
    """Fails the writes of the data files with ``error()`` once half of a
    piece is written (a device that fills up: the file is left partly
    written), on the synchronous path and the asynchronous one."""
    sync_write = getattr(writer, "_write_chunked")  # noqa: B009  (writer's name for it)
    hashed_write = getattr(writer, "write_hashed")  # noqa: B009

    def half_then_fail(f: Any, data: bytes | memoryview) -> None:
        view = memoryview(data)
        f.write(view[: len(view) // 2])
        f.flush()
        raise error()

    def hashed_half_then_fail(fd: int, pos: int, data: Any, chunk: int, pace: bool) -> int:
        view = memoryview(data)
        os.pwrite(fd, view[: len(view) // 2], pos)
        raise error()

    setattr(writer, "_write_chunked", half_then_fail)  # noqa: B010
    setattr(writer, "write_hashed", hashed_half_then_fail)  # noqa: B010
    try:
        yield
    finally:
        setattr(writer, "_write_chunked", sync_write)  # noqa: B010
        setattr(writer, "write_hashed", hashed_write)  # noqa: B010


@contextlib.contextmanager
def another_store(thread_name: str) -> Iterator[None]:
    """The rank running on thread ``thread_name`` addresses another store
    than the others (a node with another configuration): its save
    target's identity names another directory."""
    original = LocalTarget.identity

    def identity(self: LocalTarget) -> Any:
        got = original(self)
        if threading.current_thread().name == thread_name:
            return {"directory": f"{got['directory']}-on-another-node"}
        return got

    setattr(LocalTarget, "identity", identity)  # noqa: B010
    try:
        yield
    finally:
        setattr(LocalTarget, "identity", original)  # noqa: B010


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def saving(ck: deeppart.Checkpointer, step: int, v: int) -> Callable[[], Any]:
    """One rank's part of a save of ``step`` (value ``v``) by ``ck``."""
    return lambda: ck.save(step, make_state(v))


def settle(handle: deeppart.SaveHandle) -> deeppart.CheckpointStats:
    """Waits for a save's handle (raises its error); asynchronous or not."""
    return handle.wait()


class CheckpointerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="deeppart-model-", dir=BASE)) / "ck"
        self.root.mkdir()
        self.keep_last: int | None = None
        self.async_ = False
        self.ck: deeppart.Checkpointer | None = None
        self.value = 0
        # The oracle.
        self.nodes: dict[int, Node] = {}
        #: Steps whose committed copy cannot be removed: a user's file is in it.
        self.pinned: set[int] = set()
        #: Checkpoints without a line record under the Checkpointer's naming:
        #: step -> (value, legacy: an earlier Checkpointer's user value).
        self.others: dict[int, tuple[int, bool]] = {}
        #: The user's files (relative path -> bytes): never removed, never changed.
        self.foreign: dict[str, bytes] = {}
        #: Directory names that are the user's (the Checkpointer must refuse them).
        self.foreign_steps: set[int] = set()
        self.parent: tuple[int, int, int] | None = None
        self.run: int | None = None
        #: The largest seq committed when the Checkpointer last loaded a
        #: step (0 before): only steps committed by then can be left by it.
        self.seen = 0
        self.runs = 0
        self.aside = 0
        #: A job requeued while it still runs: the old Checkpointer (the
        #: zombie) and its line state (parent, run, seen) for the oracle;
        #: the largest seq when it was requeued.
        self.zombie: deeppart.Checkpointer | None = None
        self.zombie_line: tuple[tuple[int, int, int] | None, int | None, int] = (None, None, 0)
        self.requeued_at = 0
        #: Damaged steps moved out of the root (their evidence, kept).
        self.evidence: dict[Path, dict[str, bytes]] = {}

    def teardown(self) -> None:
        for ck in (self.ck, self.zombie):
            if ck is not None:
                with contextlib.suppress(Exception):
                    ck.close()
        shutil.rmtree(self.root.parent, ignore_errors=True)

    # ------------------------------------------------------------------
    # The oracle's line.

    def next_value(self) -> int:
        self.value += 1
        return self.value

    def max_seq(self) -> int:
        return max((n.seq for n in self.nodes.values()), default=0)

    def ancestry(self, node: Node | None) -> list[Node]:
        out: list[Node] = []
        while node is not None:
            out.append(node)
            p = node.parent
            nxt = self.nodes.get(p[0]) if p is not None else None
            node = (
                nxt
                if nxt is not None and p is not None and nxt.seq == p[1] and nxt.value == p[2]
                else None
            )
        return out

    def head(self) -> Node | None:
        return max(self.nodes.values(), key=lambda n: (n.seq, n.step), default=None)

    def expected_steps(self) -> list[int]:
        if self.nodes:
            return [n.step for n in reversed(self.ancestry(self.head()))]
        return sorted(s for s, (_, legacy) in self.others.items() if legacy)

    def resume_from(self, step: int) -> None:
        node = self.nodes.get(step)
        self.parent = (node.step, node.seq, node.value) if node is not None else None
        self.run = node.run if node is not None else None
        self.seen = self.max_seq()

    def restart(self) -> None:
        """A new process: a fresh Checkpointer on the same root."""
        if self.ck is not None:
            with contextlib.suppress(Crash):
                self.ck.close()
        self.ck = deeppart.Checkpointer(self.root, keep_last=self.keep_last, async_=self.async_)
        self.parent, self.run, self.seen = None, None, 0

    def plan_save(self, step: int, overwrite: bool) -> tuple[str, bool]:
        """What a save of ``step`` by the Checkpointer must do: "foreign"
        (refused: the user's), "exists" (refused: committed), or "ok"; and
        whether a step of a left line is retired to make room."""
        if step in self.foreign_steps:
            return "foreign", False
        at = self.nodes.get(step)
        if at is not None and self.parent is not None and at.run == self.run:
            base = self.nodes.get(self.parent[0])
            named = base is not None and (base.seq, base.value) == self.parent[1:]
            ours = self.ancestry(base) if named else []
            since = ours[-1].parent[1] if ours and ours[-1].parent else ours[-1].seq if ours else 0
            if ours and since < at.seq <= self.seen and all(n.step != step for n in ours):
                event("a rollback saves a step of the line it leaves")
                return "ok", True
        if self.taken(step) and not overwrite:
            return "exists", False
        return "ok", False

    def taken(self, step: int) -> bool:
        """Whether a save of ``step`` without ``overwrite`` is refused: a
        committed checkpoint is at its name (not when only the ``.old-``
        copy of an interrupted overwrite is committed: deeppart.save does
        not refuse that either, and the copy goes once the step commits)."""
        assert (step in self.nodes or step in self.others) or not is_committed(
            self.root / step_dir_name(step)
        ), f"step {step} is committed on disk, not in the oracle"
        return is_committed(self.root / step_dir_name(step))

    def committed(self, step: int, value: int) -> None:
        """The oracle's side of a successful save by the Checkpointer."""
        run = self.run if self.run is not None else self.new_run()
        parent = self.parent
        if parent is not None and parent[0] == step:
            at = self.nodes.get(step)
            if at is not None and (at.seq, at.value) == parent[1:] and at.parent is not None:
                parent = at.parent  # takes the replaced step's place
        seq = max(self.max_seq(), parent[1] if parent is not None else 0) + 1
        node = Node(step, seq, run, parent, value)
        self.nodes[step] = node
        self.others.pop(step, None)
        self.parent, self.run = (step, node.seq, value), run
        self.cleanup(node)

    def new_run(self) -> int:
        self.runs += 1
        return self.runs

    def cleanup(self, newest: Node) -> None:
        line = self.ancestry(newest)
        on = {n.step for n in line}
        pruned = line[self.keep_last :] if self.keep_last is not None else []
        oldest = line[-1]
        since = oldest.parent[1] if oldest.parent is not None else oldest.seq
        left = [
            n
            for n in self.nodes.values()
            if n.run == newest.run and n.step not in on and since < n.seq <= self.seen
        ]
        if left:
            event("a rollback retires steps")
        if pruned:
            event("keep_last prunes steps")
        for n in pruned + left:
            if n.step not in self.pinned:
                del self.nodes[n.step]
                if self.keep_last is None:
                    self.aside += 1

    # ------------------------------------------------------------------
    # Rules.

    @initialize(keep_last=st.sampled_from([None, 1, 2, 3]), async_=st.booleans())
    def start(self, keep_last: int | None, async_: bool) -> None:
        self.keep_last, self.async_ = keep_last, async_
        self.restart()

    def do_save(
        self, step: int, overwrite: bool = False, ck: deeppart.Checkpointer | None = None
    ) -> None:
        ck = ck or self.ck
        assert ck is not None
        outcome, retire = self.plan_save(step, overwrite)
        v = self.next_value()
        try:
            settle(ck.save(step, make_state(v), overwrite=overwrite))
        except deeppart.ForeignPathError:
            assert outcome == "foreign", f"save({step}) refused as foreign"
            return
        except deeppart.CheckpointError as e:
            assert outcome == "exists", f"save({step}): {e}"
            return
        assert outcome == "ok", f"save({step}) should have been refused ({outcome})"
        if retire and self.keep_last is None:
            self.aside += 1  # moved aside by the commit
        self.committed(step, v)

    @rule(step=STEP, overwrite=st.sampled_from([False, False, False, True]))
    def save(self, step: int, overwrite: bool) -> None:
        self.do_save(step, overwrite)

    @precondition(lambda self: self.async_)
    @rule(first=STEP, second=STEP)
    def two_async_saves(self, first: int, second: int) -> None:
        """Two saves back to back: the second continues the first's line
        while the first may still be writing."""
        assert self.ck is not None
        if first == second or {first, second} & (
            set(self.nodes) | set(self.others) | self.foreign_steps
        ):
            return
        a, b = self.next_value(), self.next_value()
        h1 = self.ck.save(first, make_state(a))
        h2 = self.ck.save(second, make_state(b))
        assert isinstance(h1, deeppart.AsyncSave) and isinstance(h2, deeppart.AsyncSave)
        settle(h2)
        settle(h1)
        self.committed(first, a)
        self.committed(second, b)

    @rule()
    def load_latest(self) -> None:
        assert self.ck is not None
        steps = self.expected_steps()
        if not steps:
            with pytest.raises(deeppart.CheckpointError, match="no committed checkpoint"):
                self.ck.load()
            return
        got = self.ck.load()
        self.check_value(steps[-1], got)
        self.resume_from(steps[-1])

    @rule(data=st.data())
    def load_earlier(self, data: st.DataObject) -> None:
        """A load of any committed step: of the live line (a rollback when
        it is not the newest), of a left or another line, or another
        writer's checkpoint."""
        assert self.ck is not None
        choices = sorted(set(self.nodes) | set(self.others))
        if not choices:
            return
        step = data.draw(st.sampled_from(choices), label="step")
        got = self.ck.load(step)
        self.check_value(step, got)
        self.resume_from(step)

    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """Back to an earlier step of the live line, then a save (of a
        new step number, or of one the left line holds)."""
        assert self.ck is not None
        line = self.expected_steps() if self.nodes else []
        if len(line) < 2:
            return
        back = data.draw(st.sampled_from(line[:-1]), label="back to")
        self.check_value(back, self.ck.load(back))
        self.resume_from(back)
        self.do_save(data.draw(STEP, label="then save"))

    def check_value(self, step: int, got: Any) -> None:
        if step in self.nodes:
            assert_state(got, self.nodes[step].value)
        else:
            assert_state(got, self.others[step][0])

    @rule(load=st.booleans())
    def restart_process(self, load: bool) -> None:
        self.restart()
        if load:
            self.load_latest()

    @rule(
        step=STEP,
        point=st.sampled_from(["before-write", "after-write", "commit-metadata", "commit-marker"]),
        overwrite=st.booleans(),
    )
    def crash(self, step: int, point: str, overwrite: bool) -> None:
        """A save that dies at ``point``; then a restart."""
        assert self.ck is not None
        outcome, _ = self.plan_save(step, overwrite)  # a left step stays where it was
        with crash_at(point):
            try:
                settle(self.ck.save(step, make_state(self.next_value()), overwrite=overwrite))
            except deeppart.ForeignPathError:
                assert outcome == "foreign"
            except deeppart.CheckpointError as e:
                assert outcome == "exists", f"save({step}): {e}"
            except Crash:
                assert outcome == "ok"
            else:
                raise AssertionError(f"save({step}) survived a crash at {point}")
        self.restart()

    @rule(step=STEP)
    def second_checkpointer(self, step: int) -> None:
        """Another Checkpointer (another process, a fresh line) saves a
        step under the same root: it becomes the newest committed step."""
        other = deeppart.Checkpointer(self.root)
        v = self.next_value()
        if step in self.foreign_steps:
            with pytest.raises(deeppart.ForeignPathError):
                other.save(step, make_state(v))
            return
        if self.taken(step):
            with pytest.raises(deeppart.CheckpointError, match="committed checkpoint exists"):
                other.save(step, make_state(v))
            return
        other.save(step, make_state(v))
        self.others.pop(step, None)
        self.nodes[step] = Node(step, self.max_seq() + 1, self.new_run(), None, v)

    @precondition(lambda self: EXCLUSIVE_COMMITS)
    @rule(step=STEP, other=st.sampled_from(["checkpointer", "deeppart.save", "user"]))
    def racing_writer(self, step: int, other: str) -> None:
        """The Checkpointer's save of a free step is held after its data
        file is written while another writer takes the step (another
        Checkpointer, deeppart.save, or the user's directory with a file);
        then it goes on: its commit must fail, and replace nothing."""
        assert self.ck is not None
        if step in self.nodes or step in self.others or step in self.foreign_steps:
            return
        main = threading.get_ident()
        held, go = threading.Event(), threading.Event()

        def hold(_event: WriteEvent) -> None:
            if threading.get_ident() != main:
                held.set()
                go.wait(60)

        mine, theirs = self.next_value(), self.next_value()
        outcome: list[BaseException | None] = []
        ck = self.ck

        def save_mine() -> None:
            try:
                settle(ck.save(step, make_state(mine)))
                outcome.append(None)
            except BaseException as e:
                outcome.append(e)

        with fault_hook("after-write", hold):
            thread = threading.Thread(target=save_mine)
            thread.start()
            try:
                assert held.wait(60), "the held save never wrote"
                target = self.root / step_dir_name(step)
                if other == "checkpointer":
                    deeppart.Checkpointer(self.root).save(step, make_state(theirs))
                elif other == "deeppart.save":
                    deeppart.save(make_state(theirs), target)
                else:
                    target.mkdir()
                    (target / "tokenizer.json").write_bytes(b"the user's tokenizer")
            finally:
                go.set()
                thread.join(60)
        # A CommitConflictError; or, when the other writer is a Checkpointer,
        # an OSError: its cleanup removed this save's temporary directory
        # as a leftover (it cannot tell an interrupted save from one in
        # flight). Either way this save failed and replaced nothing.
        assert outcome and isinstance(outcome[0], (deeppart.CheckpointError, OSError)), outcome
        if other == "checkpointer":
            self.nodes[step] = Node(step, self.max_seq() + 1, self.new_run(), None, theirs)
        elif other == "deeppart.save":
            self.others[step] = (theirs, False)
        else:
            self.foreign[f"{step_dir_name(step)}/tokenizer.json"] = b"the user's tokenizer"
            self.foreign_steps.add(step)

    @rule(step=STEP, legacy=st.booleans())
    def deeppart_save(self, step: int, legacy: bool) -> None:
        """deeppart.save under the Checkpointer's naming, without a line
        record (``legacy``: with an earlier Checkpointer's user value)."""
        v = self.next_value()
        target = self.root / step_dir_name(step)
        user = {"step": step, "user": None} if legacy else None
        if step in self.foreign_steps:
            with pytest.raises(deeppart.ForeignPathError):
                deeppart.save(make_state(v), target, user=user)
            return
        if self.taken(step):
            with pytest.raises(deeppart.CheckpointError, match="committed checkpoint exists"):
                deeppart.save(make_state(v), target, user=user)
            return
        deeppart.save(make_state(v), target, user=user)
        self.nodes.pop(step, None)
        self.others[step] = (v, legacy)

    @rule(
        kind=st.sampled_from(
            ["file", "step-N", "step dir", "tmp dir", "old dir", "abandoned dir", "named file"]
        ),
        step=STEP,
    )
    def foreign_entry(self, kind: str, step: int) -> None:
        """The user's files and directories under the root."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = step_dir_name(step)
        hexes = "0123456789ab"
        where = {
            "file": "notes.txt",
            "step-N": f"step-{step}/config.json",
            "step dir": f"{name}/tokenizer.json",
            "tmp dir": f".tmp-{name}-{hexes}/mine.txt",
            "old dir": f".old-{name}-{hexes}/mine.txt",
            "abandoned dir": f".abandoned-{name}-{hexes}/mine.txt",
            "named file": f"{name}.txt",
        }[kind]
        if kind == "step dir" and (step in self.nodes or step in self.others):
            return  # inside a committed step: see foreign_in_step
        path = self.root / where
        if path.exists() or any(path.is_relative_to(self.root / f) for f in self.foreign):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        data = f"the user's {where}".encode()
        path.write_bytes(data)
        self.foreign[where] = data
        if kind == "step dir":
            self.foreign_steps.add(step)

    @rule(data=st.data())
    def foreign_in_step(self, data: st.DataObject) -> None:
        """The user puts a file into a committed step: that step can no
        longer be pruned or retired (kept, with a warning)."""
        steps = sorted(set(self.nodes) | set(self.others))
        if not steps:
            return
        step = data.draw(st.sampled_from(steps), label="step")
        where = f"{step_dir_name(step)}/eval.txt"
        if (self.root / step_dir_name(step)).is_dir() and where not in self.foreign:
            payload = f"eval of {step}".encode()
            (self.root / where).write_bytes(payload)
            self.foreign[where] = payload
            self.pinned.add(step)
            self.foreign_steps.add(step)

    # ------------------------------------------------------------------
    # Faults of issue 49: a split store, a damaged step, an interruption
    # of one rank, a full device, a commit during a load, a zombie job.

    def temp_dirs(self) -> set[str]:
        """The temporary directories of saves under the root (not the user's)."""
        theirs = {rel.split("/")[0] for rel in self.foreign}
        names = {p.name for p in self.root.iterdir()}
        return {n for n in names if n.startswith(".tmp-") and n not in theirs}

    def job(self) -> list[deeppart.Checkpointer]:
        """A job of two ranks (threads ``job-0``, ``job-1``) on the root,
        with this example's ``keep_last``, resumed from the latest step
        (if any): its next save would continue the live line (and prune)."""
        cks = [
            deeppart.Checkpointer(self.root, comm=c, keep_last=self.keep_last)
            for c in thread_comms(2)
        ]
        steps = self.expected_steps()
        if steps:
            for got, err in run_ranks([ck.load for ck in cks], names="job"):
                assert err is None, err
                self.check_value(steps[-1], got)
        return cks

    def failed_everywhere(self, outcomes: list[tuple[Any, BaseException | None]]) -> None:
        """Every rank of a save got an error, and it committed nothing (the
        invariants check that no step is gone and none was added)."""
        assert all(err is not None for _, err in outcomes), outcomes

    @rule(step=STEP, kind=st.sampled_from(["a rank on another store", "a data file not stored"]))
    def split_store(self, step: int, kind: str) -> None:
        """A save whose ranks address different stores (one node
        configured otherwise), or whose metadata would name a data file
        that the store does not hold: it fails on every rank, commits
        nothing, prunes nothing, and leaves no temporary directory."""
        before = self.temp_dirs()
        v = self.next_value()
        if kind == "a rank on another store":
            cks = self.job()
            with another_store("job-1"):
                outcomes = run_ranks([saving(ck, step, v) for ck in cks], names="job")
            self.failed_everywhere(outcomes)
            assert all(isinstance(e, deeppart.CheckpointError) for _, e in outcomes), outcomes
            event("a split store fails every rank")
        else:
            assert self.ck is not None

            def lose(event: WriteEvent) -> None:
                event.path.unlink()  # written, but not in the store at commit time

            with fault_hook("after-write", lose), pytest.raises(deeppart.CheckpointError):
                settle(self.ck.save(step, make_state(v)))
            event("a data file not stored fails the save")
        assert self.temp_dirs() <= before

    @rule(
        step=STEP,
        rank=st.integers(0, 1),
        point=st.sampled_from(["before-write", "after-write", "commit"]),
    )
    def interrupt_one_rank(self, step: int, rank: int, point: str) -> None:
        """A BaseException (a KeyboardInterrupt) on one rank of a
        two-rank save, before or after it writes its data file, or on
        rank 0 while it commits: every rank gets an error (none hangs),
        nothing is committed, no temporary directory is left."""
        before = self.temp_dirs()
        cks = self.job()
        v = self.next_value()

        def interrupt(event: WriteEvent) -> None:
            if event.rank == rank:
                raise Interrupt(f"rank {rank} interrupted at {event.point}")

        hook = (
            commit_crash(METADATA, lambda: Interrupt("rank 0 interrupted while committing"))
            if point == "commit"
            else fault_hook(point, interrupt)  # type: ignore[arg-type]
        )
        with hook:
            outcomes = run_ranks([saving(ck, step, v) for ck in cks], names="job")
        self.failed_everywhere(outcomes)
        hit = outcomes[0 if point == "commit" else rank][1]
        refused = isinstance(outcomes[0][1], deeppart.CheckpointError)
        assert refused or isinstance(hit, Interrupt), outcomes
        if not refused:
            event(f"an interrupt of one rank at {point} reaches every rank")
        assert self.temp_dirs() <= before

    @rule(step=STEP, at=st.sampled_from(["data file", METADATA, MARKER]), overwrite=st.booleans())
    def no_space(self, step: int, at: str, overwrite: bool) -> None:
        """ENOSPC at each write of a save (half through a data file, the
        commit's metadata.json, its COMMITTED marker): the save raises it,
        its temporary directory is removed without a word, and every
        checkpoint committed before is intact (the invariants)."""
        assert self.ck is not None
        outcome, _ = self.plan_save(step, overwrite)
        before = self.temp_dirs()
        full = data_write_fails(no_space) if at == "data file" else commit_crash(at, no_space)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with full:
                try:
                    settle(self.ck.save(step, make_state(self.next_value()), overwrite=overwrite))
                except deeppart.ForeignPathError:
                    assert outcome == "foreign"
                except OSError as e:
                    assert outcome == "ok" and e.errno == errno.ENOSPC, (outcome, e)
                    event(f"ENOSPC at {at}")
                except deeppart.CheckpointError as e:
                    assert outcome == "exists", f"save({step}): {e}"
                else:
                    raise AssertionError(f"save({step}) survived ENOSPC at {at}")
        kept = [str(w.message) for w in caught if "temporary directory is kept" in str(w.message)]
        assert not kept, kept
        assert self.temp_dirs() <= before

    @rule(kind=st.sampled_from(["metadata", "data"]), restart=st.booleans())
    def damaged_newest_step(self, kind: str, restart: bool) -> None:
        """One bit flipped in the newest step's metadata.json or data file.
        Metadata: latest(), steps() and load() raise CorruptCheckpointError
        (in a new process too), and no save replaces it, even with
        overwrite=True. Data: load() raises CorruptCheckpointError (never
        an older step served instead) and a save without overwrite is
        refused. Either way the damaged copy stays byte for byte; then the
        operator moves it out of the root, as the error says, and the job
        goes on (restarted, or not: its parent has left the root)."""
        assert self.ck is not None
        self.ck.wait()
        head = self.head()
        if head is None or head.step in self.pinned:
            return
        path = self.root / step_dir_name(head.step)
        if not is_committed(path):
            return  # served from an interrupted overwrite's copy
        damaged = path / (METADATA if kind == "metadata" else data_file_name(0))
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2 if kind == "metadata" else len(data) - 1] ^= 0x01
        damaged.write_bytes(bytes(data))
        evidence = tree(path)
        if kind == "metadata":
            fresh = deeppart.Checkpointer(self.root)
            for ask in (self.ck.latest, self.ck.steps, self.ck.load, fresh.latest, fresh.load):
                with pytest.raises(deeppart.CorruptCheckpointError):
                    ask()
            with pytest.raises(deeppart.CorruptCheckpointError):
                settle(self.ck.save(head.step, make_state(self.next_value()), overwrite=True))
        else:
            assert self.ck.latest() == head.step  # its marker still matches its metadata
            with pytest.raises(deeppart.CorruptCheckpointError):
                self.ck.load()
            if self.plan_save(head.step, False) == ("exists", False):
                with pytest.raises(deeppart.CheckpointError, match="committed checkpoint exists"):
                    settle(self.ck.save(head.step, make_state(self.next_value())))
        assert tree(path) == evidence, "the damaged step changed"
        out = self.root.parent / f"evidence-{len(self.evidence)}"
        path.rename(out)
        self.evidence[out] = evidence
        del self.nodes[head.step]
        event(f"a damaged newest step ({kind})")
        if restart:
            self.restart()

    @rule(step=STEP)
    def load_while_committing(self, step: int) -> None:
        """Two ranks of an evaluator load the latest step while the
        training job commits a newer one between rank 0's choice and rank
        1's call: both read the step rank 0 chose (or, if the commit
        pruned it meanwhile, both fail), never two different steps."""
        steps = self.expected_steps()
        if not steps:
            return
        picked = steps[-1]
        want = self.nodes[picked].value if picked in self.nodes else self.others[picked][0]
        readers = [deeppart.Checkpointer(self.root, comm=c) for c in thread_comms(2)]
        chose, committed = threading.Event(), threading.Event()
        scan = readers[0].lines

        def scan_then_signal() -> Any:
            lines = scan()
            chose.set()
            return lines

        setattr(readers[0], "lines", scan_then_signal)  # noqa: B010

        def second_rank() -> Any:
            assert committed.wait(60)
            return readers[1].load()

        outcomes: list[tuple[Any, BaseException | None]] = []
        loading = threading.Thread(
            target=lambda: outcomes.extend(run_ranks([readers[0].load, second_rank], names="eval"))
        )
        loading.start()
        try:
            assert chose.wait(60), "rank 0 never chose a step"
            self.do_save(step)
        finally:
            committed.set()
            loading.join(180)
        assert len(outcomes) == 2, "the load hangs"
        errors = [err for _, err in outcomes]
        if any(errors):
            assert all(isinstance(e, deeppart.CheckpointError) for e in errors), outcomes
            assert picked not in self.nodes and picked not in self.others, outcomes
            event("the load's step was pruned by the commit")
            return
        # The step rank 0 chose, or, if the commit replaced that step
        # number (a rollback's save of a step of the line it left), the
        # checkpoint now under it: the same for both ranks.
        now = self.nodes.get(picked)
        assert outcomes[0][0]["v"] == outcomes[1][0]["v"], "the ranks read different steps"
        assert outcomes[0][0]["v"] in (want, now.value if now is not None else want)
        for got, _ in outcomes:
            assert_state(got, got["v"])
        event("a load during a commit")

    @contextlib.contextmanager
    def as_zombie(self) -> Iterator[None]:
        """The oracle's line state is the zombie's within the block."""
        mine = (self.parent, self.run, self.seen)
        self.parent, self.run, self.seen = self.zombie_line
        try:
            yield
        finally:
            self.zombie_line = (self.parent, self.run, self.seen)
            self.parent, self.run, self.seen = mine

    @precondition(lambda self: self.zombie is None)
    @rule()
    def requeue(self) -> None:
        """The job is requeued while it still runs: a new Checkpointer
        (the live job) and the old one (its zombie) both resume from the
        latest step, and both go on saving."""
        assert self.ck is not None
        self.ck.wait()
        self.zombie, self.zombie_line = self.ck, (self.parent, self.run, self.seen)
        self.ck = None
        self.restart()
        steps = self.expected_steps()
        if steps:
            self.load_latest()
            with self.as_zombie():
                self.check_value(steps[-1], self.zombie.load())
                self.resume_from(steps[-1])
        self.requeued_at = self.max_seq()

    @precondition(lambda self: self.zombie is not None)
    @rule(mine=STEP, step=STEP, dies=st.booleans())
    def zombie_saves(self, mine: int, step: int, dies: bool) -> None:
        """The live job saves ``mine``, then the zombie saves ``step`` (then
        perhaps dies): the zombie's step becomes the head (the newest
        commit), and it retires none of the steps that the live job
        committed since the requeue; a step number the live job holds is
        refused."""
        assert self.zombie is not None
        before = self.nodes.get(mine)
        self.do_save(mine)
        live = self.nodes.get(mine)
        with self.as_zombie():
            self.do_save(step, ck=self.zombie)
        if live is not None and live is not before:
            # The live job's fresh step: on no line the zombie left.
            assert self.nodes.get(mine) is live, f"the zombie retired the live job's step {mine}"
            event("a zombie saves beside the live job's step")
        if dies:
            with contextlib.suppress(Exception):
                self.zombie.close()
            self.zombie = None

    # ------------------------------------------------------------------
    # Invariants.

    @invariant()
    def line_and_files(self) -> None:
        if self.ck is None:
            return
        self.ck.wait()
        expected = self.expected_steps()
        assert self.ck.steps() == expected, (self.ck.steps(), expected, self.nodes)
        assert self.ck.latest() == (expected[-1] if expected else None)
        for rel, payload in self.foreign.items():
            path = self.root / rel
            assert path.is_file() and path.read_bytes() == payload, f"the user's {rel} is gone"
        # The committed step directories are exactly the oracle's (a step
        # whose replacement died is served from its committed .old- copy).
        held = set(self.nodes) | set(self.others)
        on_disk: set[int] = set()
        for p in self.root.iterdir():
            for step in held | set(range(10)):
                name = step_dir_name(step)
                if (p.name == name or p.name.startswith(f".old-{name}-")) and is_committed(p):
                    on_disk.add(step)
        committed_here = {s for s in on_disk if is_committed(self.root / step_dir_name(s))}
        assert held <= on_disk, f"steps {sorted(held - on_disk)} are gone"
        assert committed_here <= held, f"steps {sorted(committed_here - held)} should be gone"
        aside = [p for p in self.root.iterdir() if p.name.startswith(".abandoned-")]
        assert len(aside) - sum(1 for r in self.foreign if r.startswith(".abandoned-")) == (
            self.aside
        )


CheckpointerModel.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # Loads of a step whose replacement died warn; pruning a step holding a
    # user's file warns; asynchronous saves may warn. None of them matter here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


test_checkpointer_model = CheckpointerModel.TestCase
