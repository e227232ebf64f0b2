"""``Checkpointer``: numbered checkpoints of a training loop in one root
directory, saved synchronously, in the background (``async_=True``), or
through multi-level storage (``config=``, :mod:`deeppart.levels`)."""

from __future__ import annotations

import operator
import os
import struct
import time
import warnings
from pathlib import Path
from typing import Any

from deeppart.agreement import agree, from_root
from deeppart.async_save import AsyncCheckpointer, SaveHandle
from deeppart.comm import resolve
from deeppart.errors import CheckpointError, StateMismatchError
from deeppart.format import STEP_PREFIX, damaged, is_committed, step_dir_name, step_number
from deeppart.levels import open_backend
from deeppart.levels.backend import LevelBackend, RecoveryReport
from deeppart.levels.engine import BuiltinBackend
from deeppart.loading.load import load
from deeppart.options import (
    AsyncOptions,
    LoadOptions,
    PlanOptions,
    WriteOptions,
    fold,
    reject_unknown,
)
from deeppart.progress import Stats
from deeppart.saving.planning import PlanProvider
from deeppart.saving.save import SaveOptions, plan_save, save_options
from deeppart.steps import lineage
from deeppart.steps.object_steps import ObjectSteps
from deeppart.storage.commit import KeepAside, temp_dir_in_use
from deeppart.storage.ownership import foreign_entries, owned_dir, remove_owned, side_name
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import parse_location

__all__ = ["Checkpointer"]


def _step_index(step: Any, state: Any) -> int:
    """``step`` as an int >= 0 (numpy integers too), else a CheckpointError
    that says how to call ``save``."""
    try:
        n = operator.index(step) if not isinstance(step, bool) else -1
    except TypeError:
        n = -1
    if n < 0:
        got = repr(step) if isinstance(step, int) else type(step).__name__
        hint = " (the arguments are swapped?)" if isinstance(state, int) else ""
        raise CheckpointError(
            f"Checkpointer.save(step, state): step must be an int >= 0, got {got}{hint}; "
            "call it as ckpt.save(100, state)"
        )
    return n


def _async_backend(backend: str) -> str:
    """The level backend of a ``Checkpointer(config=..., async_=True)``:
    the built-in engine (``"auto"`` picks it); FTI is refused, naming why."""
    if backend == "fti":
        raise ValueError(
            "async_=True with the FTI backend (backend='fti') is not supported: libfti's "
            "FTI_Checkpoint is a collective call over FTI's own communicator that reads the "
            "protected (live) buffers and is not thread-safe, so it cannot run on a writer "
            "thread beside training; use backend='builtin' (or 'auto'), whose engine saves "
            "the levels asynchronously, or async_=False"
        )
    return "builtin" if backend == "auto" else backend


class Checkpointer:
    """Numbered checkpoints ``ROOT/step-00000100`` in one root directory,
    or under an object store prefix (``Checkpointer("s3://bucket/run")``,
    :mod:`deeppart.steps.object_steps`: the same lines and ``keep_last``; nothing
    is moved aside there, as object storage has no rename).

    ``save(step, state)`` reuses the plan while the state's structure stays
    the same. Steps form a line (:mod:`deeppart.steps.lineage`): each records its
    parent, the step this Checkpointer last loaded or saved, and its place
    in the commit order. ``latest()`` is the newest committed step by commit
    order (not by number), and a restart resumes from it; after a
    ``load`` of an earlier step, the next save starts a new line, and the
    newer steps of the line it leaves are retired (removed with
    ``keep_last``, else moved aside to ``.abandoned-step-N-<hex>``).
    ``keep_last`` counts only the live line's steps (older ones, and
    leftovers of interrupted saves, are removed only after the new one is
    committed); nothing that is not a DeepPart checkpoint written by a
    Checkpointer under its own naming is counted or touched. ``load(step)``.

    ``save`` returns a :class:`deeppart.SaveHandle` (``.wait()``: the
    save's Stats). With ``async_=True`` (or a :class:`deeppart.AsyncOptions`:
    the snapshot's limit, a copy within the device first), it returns an
    :class:`deeppart.AsyncSave` as soon as this rank's planned share of the
    state is copied to host memory and writes it in a background thread;
    the next ``save``, ``load``, ``wait`` or ``close`` first waits for it
    and raises its error, if nobody has seen it yet (docs/ASYNC.md).
    ``planning``, ``writing``: its saves' :class:`deeppart.PlanOptions` and
    :class:`deeppart.WriteOptions`; ``loading``: its loads'
    :class:`deeppart.LoadOptions`; ``config``, ``backend``: multi-level
    storage (docs/LEVELS.md; with ``async_=True``, the built-in engine's
    asynchronous level saves; the FTI backend refuses it). The old keywords
    (``compression=``, ...) work for one release, with a DeprecationWarning.
    """

    PREFIX = STEP_PREFIX
    #: The prefix of a retired step moved aside (``keep_last=None``).
    ABANDONED = ".abandoned-"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        comm: Any = None,
        keep_last: int | None = None,
        async_: bool | AsyncOptions = False,
        progress: bool | None = None,
        verbose: bool = False,
        config: Any = None,
        backend: str = "auto",
        planning: PlanOptions | None = None,
        writing: WriteOptions | None = None,
        loading: LoadOptions | None = None,
        **deprecated: Any,
    ) -> None:
        where = "deeppart.Checkpointer"
        # The options objects, or (deprecated) the old keywords; staging_bytes
        # was the saves' and the loads' both.
        plan_options, self.writing = save_options(
            where, planning, writing, deprecated, share=("staging_bytes",)
        )
        self.loading = fold(where, "loading", LoadOptions, loading, deprecated)
        if not isinstance(async_, bool | AsyncOptions):
            raise TypeError(f"{where}: async_= takes True, False or a deeppart.AsyncOptions")
        given = async_ if isinstance(async_, AsyncOptions) else None
        background = fold(where, "async_", AsyncOptions, given, deprecated)
        reject_unknown(f"{where}()", deprecated)
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if config is not None and async_ is not False:
            backend = _async_backend(backend)
        #: Where the steps are read from: a directory or an object store
        #: prefix (a path or s3://; other URLs are refused).
        self.source = checkpoint_source(parse_location(root))
        local = self.source.local_dir()
        if local is None and config is not None:
            raise ValueError(
                "config= (multi-level storage) takes its directories from the config, "
                f"not from the root {self.source}"
            )
        #: The steps in an object store (None: ``root`` is a directory).
        store = self.source.object_store()
        self.objects: ObjectSteps | None = ObjectSteps(store) if store is not None else None
        #: The root directory, or the root's URL (``s3://bucket/run``).
        self.root: Path | str = local if local is not None else str(self.source)
        self.comm = resolve(comm)
        self.keep_last = keep_last
        self.progress = progress
        self.verbose = verbose
        #: Gives each save its plan, reusing the last while the state's
        #: structure stays the same (``plans.last``).
        self.plans = PlanProvider.of(plan_options, self.comm.size, reuse=True)
        #: The line the next save continues (rank 0 writes the records): the
        #: step last loaded or saved, and its run; None before either.
        self._parent: lineage.Link | None = None
        self._run: str | None = None
        #: The largest seq committed in the root when this Checkpointer last
        #: loaded a step (rank 0's; 0 before a load): only steps committed
        #: by then can be steps of a line it left by that load
        #: (:meth:`deeppart.steps.lineage.Lines.left_by`); later ones are
        #: another job's beside it, never retired.
        self._seen = 0
        self._async: AsyncCheckpointer | None = None
        if async_ is not False and config is None:
            self._async = AsyncCheckpointer(self.comm, background)
        #: With ``config=`` and ``async_``: the levels' saves in the
        #: background (:meth:`BuiltinBackend.save_async`), with these options.
        self._levels_async: AsyncOptions | None = None
        #: Multi-level storage (docs/LEVELS.md): with ``config=`` (a
        #: LevelConfig or an FTI-style INI path), save/latest/load go through
        #: a LevelBackend and ``root`` is unused; ``last_recovery`` is the
        #: RecoveryReport of the latest load.
        self.levels: LevelBackend | None = None
        self.last_recovery: RecoveryReport | None = None
        if config is not None:
            self.levels = open_backend(
                config,
                self.comm,
                backend,
                compression=self.writing.compression,
                zstd_level=self.writing.compression_level,
                planning=self.plans.options,
                keep=keep_last,
                exchange=self.loading.exchange,
                verbose=verbose,
            )
            if async_ is not False:
                assert isinstance(self.levels, BuiltinBackend)
                self._levels_async = background

    @property
    def compression(self) -> str:
        """The saves' codec (``"none"`` without compression)."""
        return self.writing.compression or "none"

    @property
    def compression_level(self) -> int:
        """The saves' Zstandard level."""
        return self.writing.compression_level

    @property
    def directory(self) -> Path:
        """The root directory (:class:`CheckpointError` for an object store root)."""
        local = self.source.local_dir()
        if local is None:
            raise CheckpointError(f"{self.root}: an object store root has no directory")
        return local

    def path(self, step: int) -> Path:
        """Step ``step``'s directory (a directory root; else see :meth:`location`)."""
        return self.directory / step_dir_name(step)

    def location(self, step: int) -> Path | str:
        """Where step ``step`` is: its directory, or its URL
        (``s3://bucket/run/step-00000100``); what save and load take."""
        if self.objects is not None:
            return self.objects.url(step)
        return self.path(step)

    def lines(self) -> lineage.Lines:
        """The committed steps of ``root`` with their line records
        (:func:`deeppart.steps.lineage.scan`, or for an object store
        :meth:`deeppart.steps.object_steps.ObjectSteps.lines`)."""
        if self.objects is not None:
            return self.objects.lines()[0]
        return lineage.scan(self.directory)

    def steps(self) -> list[int]:
        """The live line's committed steps, oldest first (in commit
        order); a step whose committed copy sits in ``.old-step-N-*``
        because a save replacing it was interrupted counts (:meth:`load`
        serves that copy). Without any step that carries a line record,
        the steps an earlier Checkpointer wrote. With ``config=``: the level
        backend's committed steps that can still be recovered (the last is
        :meth:`latest`; collective, like :meth:`latest`)."""
        if self.levels is not None:
            return self.levels.steps()
        lines = self.lines()
        lines.check()
        return lines.steps()

    def latest(self) -> int | None:
        """The newest committed step of the live line: the step a restart
        resumes from (None if there is none). A damaged step in the root
        (its ``COMMITTED`` marker no longer matches its ``metadata.json``)
        may be the newest: then :class:`CorruptCheckpointError` naming it
        (as from :meth:`steps` and :meth:`load`), never a silent fallback to
        an older step; the damaged step is kept as evidence, and no save
        replaces it, even with ``overwrite=True``."""
        if self.levels is not None:
            return self.levels.latest()
        lines = self.lines()
        lines.check()
        return lines.latest()

    def save(
        self, step: int, state: Any, *, user: Any = None, overwrite: bool = False
    ) -> SaveHandle:
        """Saves ``state`` as ``step`` (collective); returns its
        :class:`deeppart.SaveHandle`, whose ``wait()`` gives the save's
        :class:`Stats` (with ``config=``, a :class:`deeppart.LevelSaveStats`)
        or raises its error. Synchronous saves return a handle that is
        already done; with ``async_=True`` it is an
        :class:`deeppart.AsyncSave`, done once the background write commits
        (with ``config=``: the built-in engine's
        :meth:`~deeppart.levels.engine.BuiltinBackend.save_async`, every
        level written and committed on its writer thread).
        A step that is already
        committed is refused with :class:`CheckpointError`, as
        :func:`deeppart.save` refuses an existing checkpoint, unless
        ``overwrite=True`` (the old one stays loadable until the new one
        commits). With ``config=`` the level backend re-saves a step as FTI
        does."""
        step = _step_index(step, state)
        if self.levels is not None:
            if self._levels_async is not None:
                assert isinstance(self.levels, BuiltinBackend)
                return self.levels.save_async(step, state, background=self._levels_async)
            return SaveHandle.finished(step, self.levels.save(step, state))
        if self._async is not None:
            self._async.wait()  # the line continues from the save in flight
        value: Any = {"step": step, "user": user}
        link, run = lineage.Link(step, 0), self._run or ""
        keep: KeepAside | None = None
        err: BaseException | None = None
        #: In an object store: what interrupted saves left below this step
        #: when it began (removed after its commit).
        leftovers: dict[int, set[str]] = {}
        if self.comm.rank == 0:  # only rank 0's user value is written
            try:
                if self.objects is not None:
                    leftovers = self.objects.leftovers(below=step)
                value, link, run, replace, keep = self._line_record(step, user)
                overwrite = overwrite or replace
            except BaseException as e:  # one rank's error (an interruption too)
                err = e
        agree(self.comm, err)  # every rank raises rank 0's error
        kwargs: SaveOptions = {
            "overwrite": overwrite,
            "user": value,
            "progress": self.progress,
            "verbose": self.verbose,
            "planning": self.plans,
            "writing": self.writing,
            "keep": keep,
        }
        if self._async is not None:

            def committed() -> None:
                self._parent, self._run = link, run
                if self.comm.rank == 0:
                    self._cleanup_or_warn(step, link, leftovers)

            target = self.location(step)
            where = parse_location(target)
            return self._async.save(where, state, kwargs, after=committed, step=step)
        t0 = time.perf_counter()
        stats = plan_save(self.comm, state, self.location(step), defer_proof=True, **kwargs).finish(
            self.comm, t0
        )
        self._parent, self._run = link, run
        # The save succeeded everywhere: a failed cleanup is a warning on
        # every rank (one small collective), never one rank's exception.
        message = from_root(
            self.comm, lambda: self._cleanup_or_warn(step, link, leftovers, warn=False).encode()
        ).decode()
        if message:
            warnings.warn(message, stacklevel=2)
        return SaveHandle.finished(step, stats)

    def _line_record(
        self, step: int, user: Any
    ) -> tuple[Any, lineage.Link, str, bool, KeepAside | None]:
        """Rank 0: the user value of a save of ``step`` (with its line
        record), the new step as a parent, its run, whether the save
        may replace what is at ``path(step)``: a committed step of a line
        that this save leaves (a rollback that saves again a step number
        the left line has), and, with ``keep_last=None``, that step's
        copy for the commit to move aside to ``.abandoned-step-N-<hex>``
        once the new step is in place (never before: a save that fails
        leaves it where it was, on its line)."""
        lines = self.lines()
        parent, run = self._parent, self._run or lineage.new_run()
        at = lines.nodes.get(step)
        # The line this save continues: the parent and its ancestors.
        base = lines.nodes.get(parent.step) if parent is not None else None
        ours = lines.ancestry(base) if base is not None and parent == base.link else []
        replace = False
        keep: KeepAside | None = None
        if at is not None and lines.left_by(ours, at, self._seen):
            # This save replaces it, as overwrite=True would; without
            # keep_last its commit moves it aside instead of removing it
            # (only a directory of DeepPart's files; in an object store it
            # is replaced).
            replace = self.objects is not None or at.path == self.path(step)
            if self.objects is None and self.keep_last is None and owned_dir(at.path):
                keep = KeepAside(at.path.name, self._abandoned_name(step))
        if at is not None and parent == at.link and at.parent is not None:
            # Saving again the step it came from (overwrite=True): the new
            # step takes its place in the line.
            parent = at.parent
        seq = lineage.next_seq(lines, parent)
        value, link = lineage.record(step, user, run, seq, parent)
        return value, link, run, replace, keep

    def _abandoned_name(self, step: int) -> str:
        """A fresh name for a retired step moved aside:
        ``.abandoned-step-N-<12 hex>``."""
        return f"{self.ABANDONED}{step_dir_name(step)}-{os.urandom(6).hex()}"

    def _retire_aside(self, path: Path, step: int) -> bool:
        """Moves step ``step``'s committed copy ``path`` (``step-N``, or the
        ``.old-step-N-*`` copy of an interrupted overwrite) out of the
        line's way, to ``.abandoned-step-N-<12 hex>`` (``keep_last=None``);
        whether it did (only a directory of DeepPart's files moves)."""
        if not owned_dir(path):
            return False
        try:
            path.rename(path.parent / self._abandoned_name(step))
        except OSError:
            return False
        return True

    def _cleanup_or_warn(
        self, newest: int, link: lineage.Link, leftovers: dict[int, set[str]], *, warn: bool = True
    ) -> str:
        """Runs :meth:`_cleanup` (in an object store
        :meth:`_cleanup_objects`, with the ``leftovers`` the save saw when
        it began); returns what failed ("" if nothing), and also warns with
        it if ``warn``."""
        try:
            if self.objects is not None:
                failures = self._cleanup_objects(self.objects, newest, link, leftovers)
            else:
                failures = self._cleanup(newest, link)
        except OSError as e:
            failures = [f"{self.root}: cannot list or remove ({e})"]
        except Exception as e:  # the object store client's errors: one rank's, never raised
            if self.objects is None:
                raise
            failures = [f"{self.root}: cannot list or remove ({type(e).__name__}: {e})"]
        if not failures:
            return ""
        message = (
            f"{self.root}: step {newest} is committed, but removing old checkpoints failed: "
            + "; ".join(failures)
        )
        if warn:
            warnings.warn(message, stacklevel=2)
        return message

    def _cleanup(self, newest: int, link: lineage.Link) -> list[str]:
        """After step ``newest`` committed as the commit ``link`` names: removes the steps of
        its line beyond ``keep_last``, retires the steps of the lines it
        left (:meth:`deeppart.steps.lineage.Lines.abandoned`: removed with
        ``keep_last``, else moved aside), and removes leftovers of
        interrupted saves; returns one line per directory it failed to
        remove. Only step directories named ``step-NNNNNNNN`` whose
        committed metadata holds a line record are pruned or retired, and
        only when they hold nothing but DeepPart's files
        (:func:`deeppart.storage.ownership.owned_dir`): a pruned step that holds
        other files too is kept and reported. A committed ``.old-step-N-*``
        stays while it is the only committed copy of step N (unless step N
        itself is pruned)."""
        lines = self.lines()
        line = lines.line_of(link)
        pruned = line[self.keep_last :] if self.keep_last is not None else []
        left = lines.abandoned(line, self._seen)
        doomed: list[Path] = []
        failures: list[str] = []
        for node in pruned + (left if self.keep_last is not None else []):
            if owned_dir(node.path):
                doomed.append(node.path)
            else:
                failures.append(
                    f"{node.path}: kept, it holds files DeepPart did not write "
                    f"({', '.join(foreign_entries(node.path)[:5])})"
                )
        if self.keep_last is None:
            for node in left:
                if not self._retire_aside(node.path, node.step):
                    failures.append(
                        f"{node.path}: a step of a line left behind, not moved aside "
                        f"({', '.join(foreign_entries(node.path)[:5]) or 'cannot rename'})"
                    )
        gone = {n.step for n in pruned} | (
            {n.step for n in left} if self.keep_last is not None else set()
        )
        for child in self.directory.iterdir():
            if child in doomed:
                continue
            name = child.name
            side = side_name(name)
            base = side[1] if side is not None else name
            step = step_number(base, self.PREFIX)
            if step is None or base != step_dir_name(step):
                continue  # not DeepPart's naming: never touched
            if side is not None and side[0] == "tmp":
                # A save in flight (another job's, or a racing Checkpointer's)
                # holds its temporary directory's lock: never removed.
                if owned_dir(child, partial=True) and not temp_dir_in_use(child):
                    doomed.append(child)
            elif side is not None:
                if (step in gone or self._superseded(child)) and owned_dir(child):
                    doomed.append(child)
            elif (
                step < newest
                and not is_committed(child)
                and owned_dir(child, empty=False)
                and damaged(child) is None
            ):
                # What a save of an earlier version interrupted between its
                # rename and its marker left; a user's directory of that
                # name, and a damaged commit (evidence), stay.
                doomed.append(child)
        for d in doomed:
            try:
                foreign = remove_owned(d, partial=d.name.startswith(".tmp-"))
            except OSError as e:
                failures.append(f"{d}: {e.strerror or e}")
                continue
            if foreign:
                failures.append(f"{d}: kept, it holds files DeepPart did not write ({foreign[0]})")
        return failures

    def _cleanup_objects(
        self, objects: ObjectSteps, newest: int, link: lineage.Link, leftovers: dict[int, set[str]]
    ) -> list[str]:
        """:meth:`_cleanup` in an object store: removes the steps of the
        line beyond ``keep_last`` and, with ``keep_last``, the steps of the
        lines it left, each by its save id (marker first, then that save's
        objects, :meth:`ObjectSteps.remove_step`); and the ``leftovers``
        of interrupted saves that this save saw when it began
        (:meth:`ObjectSteps.remove_leftovers`). Without ``keep_last`` a
        left line's steps stay in place (no rename: they are never
        ``latest()``). Returns one line per object that failed or stayed."""
        objects.remove_leftovers(leftovers)
        lines, _, committed = objects.lines()
        line = lines.line_of(link)
        if not line:
            return []  # replaced meanwhile: a newer commit's cleanup decides
        pruned = line[self.keep_last :] if self.keep_last is not None else []
        left = lines.abandoned(line, self._seen) if self.keep_last is not None else []
        failures: list[str] = []
        for node in pruned + left:
            failures += objects.remove_step(node.step, committed[node.step])
        return failures

    def _superseded(self, child: Path) -> bool:
        """Whether ``child`` is a ``.old-NAME-<12 hex>`` directory that may
        go: uncommitted, or NAME is committed again. A committed one whose
        replacement never committed is the only copy of that step
        (:func:`load` serves it) and stays."""
        side = side_name(child.name)
        if side is None or side[0] != "old":
            return False
        if not is_committed(child):
            return True
        return is_committed(child.parent / side[1])

    def _agreed_step(self, step: int | None) -> tuple[int, lineage.Lines]:
        """The step every rank of a load reads (one small collective): the
        ranks must ask for the same one (else :class:`StateMismatchError`
        on every rank); ``None`` (the latest) is rank 0's :meth:`latest`,
        so that a step committed between two ranks' calls cannot make them
        read different steps. Also the root's lines as rank 0 read them
        before the load (empty on the other ranks): a step another job
        commits while the load runs is none this Checkpointer saw
        (``_seen``)."""
        asked, pick, err = -1, -1, None
        lines = lineage.Lines()
        try:
            if step is not None:
                asked = _step_index(step, None)
            if self.comm.rank == 0:
                lines = self.lines()
            if step is None and self.comm.rank == 0:
                lines.check()
                latest = lines.latest()
                pick = -2 if latest is None else latest
        except BaseException as e:  # a damaged step, an interruption: every rank raises
            err = e
        rows = [
            struct.unpack("<qq", row[:16])
            for row in agree(self.comm, err, struct.pack("<qq", asked, pick), width=16)
        ]
        if len({a for a, _ in rows}) > 1:
            said = ", ".join(
                f"rank {r}: {'latest' if a < 0 else a}" for r, (a, _) in enumerate(rows)
            )
            raise StateMismatchError(
                f"{self.root}: the ranks of one load ask for different steps ({said}); "
                "every rank must load the same step"
            )
        if asked >= 0:
            return asked, lines
        chosen = int(rows[0][1])
        if chosen < 0:
            raise CheckpointError(f"{self.root}: no committed checkpoint")
        return chosen, lines

    def wait(self) -> Stats | None:
        """Waits for the asynchronous save in flight, if any (with
        ``config=``, the built-in engine's); returns its Stats, or raises
        its error if nobody has seen it yet."""
        if isinstance(self.levels, BuiltinBackend):
            return self.levels.wait()
        return self._async.wait() if self._async is not None else None

    def close(self) -> None:
        """Waits for the asynchronous save in flight (see :meth:`wait`)."""
        self.wait()
        if self.levels is not None:
            self.levels.close()

    def load(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        keys: Any = None,
        strict: bool = True,
        per_rank: Any = None,
    ) -> Any:
        """Loads ``step`` (default: the latest, as rank 0's :meth:`latest`
        finds it, for every rank: all ranks of one load read the same step,
        and ranks that pass different steps get :class:`StateMismatchError`);
        ``keys``, ``strict`` and ``per_rank`` (each rank's own values at
        another world size) as in :func:`load`; with ``config=``, the
        built-in engine takes ``per_rank`` (for a step loaded from its L4
        copy at another world size), the FTI backend none of the three."""
        self.wait()
        if self.levels is not None:
            if keys is not None or not strict:
                raise ValueError("keys= and strict=False are not supported with config=")
            if per_rank is None:
                state, self.last_recovery = self.levels.load(step, into=into)
                return state
            if not isinstance(self.levels, BuiltinBackend):
                raise ValueError(
                    f"per_rank= is not supported by the {self.levels.name} backend; "
                    "backend='builtin' takes it (a step's L4 copy at another world size)"
                )
            state, self.last_recovery = self.levels.load(step, into=into, per_rank=per_rank)
            return state
        step, lines = self._agreed_step(step)
        state = load(
            self.location(step),
            comm=self.comm,
            into=into,
            progress=self.progress,
            verbose=self.verbose,
            loading=self.loading,
            keys=keys,
            strict=strict,
            per_rank=per_rank,
        )
        # The next save continues from this step (a new line if it is not
        # the newest); a step without a line record starts a fresh one.
        node = lines.nodes.get(step)
        self._parent = node.link if node is not None else None
        self._run = node.run if node is not None else None
        self._seen = lines.max_seq()
        return state
