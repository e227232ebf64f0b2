"""``Checkpointer``: numbered checkpoints of a training loop in one root
directory, saved synchronously, in the background (``async_=True``), or
through multi-level storage (``config=``, :mod:`deeppart.levels`)."""

from __future__ import annotations

import operator
import os
import warnings
from pathlib import Path
from typing import Any

from deeppart.async_save import AsyncCheckpointer, AsyncSave
from deeppart.checkpoint import compression_level_of, load, save
from deeppart.comm import resolve
from deeppart.compression import check_codec
from deeppart.errors import CheckpointError
from deeppart.format import STEP_PREFIX, is_committed, step_dir_name, step_number
from deeppart.levels import open_backend
from deeppart.levels.backend import LevelBackend, LevelSaveStats, RecoveryReport
from deeppart.ownership import foreign_entries, local_path, owned_dir, remove_owned, side_name
from deeppart.planning import PlanProvider
from deeppart.progress import Stats

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


class Checkpointer:
    """Numbered checkpoints ``ROOT/step-00000100`` in one root directory.

    ``save(step, state)`` reuses the plan while the state's structure stays
    the same; ``keep_last`` old committed checkpoints are kept (older ones
    and leftovers of interrupted saves are removed only after the new one is
    committed); ``latest()`` is the newest committed step; ``load(step)``.

    With ``async_=True``, ``save`` returns an :class:`deeppart.AsyncSave`
    as soon as this rank's planned share of the state is copied to host
    memory (at most ``max_staging_bytes`` of tensors, else it saves
    synchronously with a warning) and writes it in a background thread; the next ``save``,
    ``load``, ``wait`` or ``close`` first waits for it and raises its error,
    if nobody has seen it yet (docs/ASYNC.md). ``staging_bytes``: the host
    buffer for device tensors (see :func:`save`).
    """

    PREFIX = STEP_PREFIX

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        comm: Any = None,
        keep_last: int | None = None,
        compression: str | None = None,
        compression_level: int = 1,
        planner: Any = None,
        algorithm: str | None = None,
        cost: Any = None,
        topology: Any = None,
        exchange: str = "auto",
        progress: bool | None = None,
        verbose: bool = False,
        staging_bytes: int | None = None,
        async_: bool = False,
        max_staging_bytes: int | None = None,
        config: Any = None,
        backend: str = "auto",
        level: int | None = None,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError("keep_last must be at least 1")
        if config is not None and async_:
            raise ValueError("async_=True is not supported with config= (multi-level storage)")
        self.root = local_path(root)
        self.comm = resolve(comm)
        self.keep_last = keep_last
        self.compression = check_codec(compression)
        #: The Zstandard level of ``compression`` (``level=``, its old name,
        #: is deprecated: "level" names the storage levels L1-L4).
        self.compression_level = compression_level_of(compression_level, level)
        self.planner = planner
        self.algorithm = algorithm
        self.cost = cost
        self.topology = topology
        self.exchange = exchange
        self.progress = progress
        self.verbose = verbose
        self.staging_bytes = staging_bytes
        #: Gives each save its plan, reusing the last while the state's
        #: structure stays the same (``plans.last``).
        self.plans = PlanProvider(
            self.comm.size,
            planner=planner,
            algorithm=algorithm,
            cost=cost,
            topology=topology,
            reuse=True,
        )
        self._async: AsyncCheckpointer | None = None
        if async_:
            self._async = AsyncCheckpointer(self.comm, max_staging_bytes)
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
                compression=compression,
                zstd_level=self.compression_level,
                planner=planner,
                algorithm=algorithm,
                cost=cost,
                topology=topology,
                keep=keep_last,
                exchange=exchange,
                verbose=verbose,
            )

    def path(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def _step_of(self, name: str) -> int | None:
        """The step a directory name holds: ``step-N`` or ``.old-step-N-<hex>``
        (a committed checkpoint moved aside by an interrupted overwrite)."""
        if name.startswith(".old-") and len(name) > len(".old--") + 12 and name[-13] == "-":
            name = name[len(".old-") : -13]
        return step_number(name, self.PREFIX)

    def steps(self) -> list[int]:
        """Committed steps, oldest first: also a step whose committed copy
        sits in ``.old-step-N-*`` because a save replacing it was
        interrupted (:meth:`load` serves that copy). With ``config=``: the
        level backend's committed steps that can still be recovered (the
        last is :meth:`latest`; collective, like :meth:`latest`)."""
        if self.levels is not None:
            return self.levels.steps()
        out: set[int] = set()
        if not self.root.is_dir():
            return []
        for child in self.root.iterdir():
            step = self._step_of(child.name)
            if step is not None and step not in out and is_committed(child):
                out.add(step)
        return sorted(out)

    def latest(self) -> int | None:
        if self.levels is not None:
            return self.levels.latest()
        steps = self.steps()
        return steps[-1] if steps else None

    def save(
        self, step: int, state: Any, *, user: Any = None, overwrite: bool = False
    ) -> Stats | AsyncSave | LevelSaveStats:
        """Saves ``state`` as ``step`` (collective). A step that is already
        committed is refused with :class:`CheckpointError`, as
        :func:`deeppart.save` refuses an existing checkpoint, unless
        ``overwrite=True`` (the old one stays loadable until the new one
        commits). With ``config=`` the level backend re-saves a step as FTI
        does."""
        step = _step_index(step, state)
        if self.levels is not None:
            return self.levels.save(step, state)
        kwargs: dict[str, Any] = {
            "compression": self.compression,
            "compression_level": self.compression_level,
            "overwrite": overwrite,
            "user": {"step": step, "user": user},
            "progress": self.progress,
            "verbose": self.verbose,
            "staging_bytes": self.staging_bytes,
            "plan_provider": self.plans,
        }
        if self._async is not None:

            def cleanup() -> None:
                if self.comm.rank == 0:
                    self._cleanup_or_warn(step)

            return self._async.save(self.path(step), state, kwargs, after=cleanup)
        stats = save(state, self.path(step), comm=self.comm, **kwargs)
        # The save succeeded everywhere: a failed cleanup is a warning on
        # every rank (one small collective), never one rank's exception.
        problem = self._cleanup_or_warn(step, warn=False) if self.comm.rank == 0 else ""
        message = self.comm.allgather_varbytes(problem.encode())[0].decode()
        if message:
            warnings.warn(message, stacklevel=2)
        return stats

    def _cleanup_or_warn(self, newest: int, *, warn: bool = True) -> str:
        """Runs :meth:`_cleanup`; returns what failed ("" if nothing), and
        also warns with it if ``warn``."""
        try:
            failures = self._cleanup(newest)
        except OSError as e:
            failures = [f"{self.root}: cannot list ({e})"]
        if not failures:
            return ""
        message = (
            f"{self.root}: step {newest} is committed, but removing old checkpoints failed: "
            + "; ".join(failures)
        )
        if warn:
            warnings.warn(message, stacklevel=2)
        return message

    def _cleanup(self, newest: int) -> list[str]:
        """Removes the steps beyond ``keep_last`` and leftovers of
        interrupted saves; returns one line per directory it failed to
        remove. A committed ``.old-step-N-*`` stays while it is the only
        committed copy of step N (unless step N itself is pruned). Only
        directories that hold nothing but DeepPart's files are removed
        (:func:`deeppart.ownership.owned_dir`): a ``step-N`` of the user's
        stays, and a pruned step that holds other files too is kept and
        reported."""
        committed = self.steps()
        pruned = set(committed[: -self.keep_last]) if self.keep_last is not None else set()
        doomed: list[Path] = []
        failures: list[str] = []
        for child in self.root.iterdir():
            name = child.name
            step = self._step_of(name)
            side = side_name(name)
            if side is not None and side[0] == "tmp":
                if step_number(side[1], self.PREFIX) is not None and owned_dir(
                    child, partial=True
                ):
                    doomed.append(child)
            elif side is not None:
                if ((step is not None and step in pruned) or self._superseded(child)) and (
                    owned_dir(child)
                ):
                    doomed.append(child)
            elif step is not None and step in pruned:
                if owned_dir(child):
                    doomed.append(child)
                else:
                    failures.append(
                        f"{child}: kept, it holds files DeepPart did not write "
                        f"({', '.join(foreign_entries(child)[:5])})"
                    )
            elif (
                step is not None
                and step < newest
                and not is_committed(child)
                and owned_dir(child, empty=False)
            ):
                # What a save interrupted between its rename and its marker
                # left; a user's directory of that name stays.
                doomed.append(child)
        for d in doomed:
            try:
                left = remove_owned(d, partial=d.name.startswith(".tmp-"))
            except OSError as e:
                failures.append(f"{d}: {e.strerror or e}")
                continue
            if left:
                failures.append(f"{d}: kept, it holds files DeepPart did not write ({left[0]})")
        return failures

    def _superseded(self, child: Path) -> bool:
        """Whether ``child`` is a ``.old-NAME-<12 hex>`` directory that may
        go: uncommitted, or NAME is committed again. A committed one whose
        replacement never committed is the only copy of that step
        (:func:`load` serves it) and stays."""
        name = child.name
        if not name.startswith(".old-") or len(name) < len(".old--") + 12:
            return False
        if not is_committed(child):
            return True
        return is_committed(child.parent / name[len(".old-") : -13])

    def wait(self) -> Stats | None:
        """Waits for the asynchronous save in flight, if any; returns its
        Stats, or raises its error if nobody has seen it yet."""
        return self._async.wait() if self._async is not None else None

    def close(self) -> None:
        """Waits for the asynchronous save in flight (see :meth:`wait`)."""
        self.wait()
        if self.levels is not None:
            self.levels.close()

    def load(
        self, step: int | None = None, *, into: Any = None, keys: Any = None, strict: bool = True
    ) -> Any:
        """Loads ``step`` (default: the latest); ``keys``/``strict`` as in :func:`load`."""
        self.wait()
        if self.levels is not None:
            if keys is not None or not strict:
                raise ValueError("keys= and strict=False are not supported with config=")
            state, self.last_recovery = self.levels.load(step, into=into)
            return state
        if step is None:
            step = self.latest()
            if step is None:
                raise CheckpointError(f"{self.root}: no committed checkpoint")
        return load(
            self.path(step),
            comm=self.comm,
            into=into,
            exchange=self.exchange,
            progress=self.progress,
            verbose=self.verbose,
            staging_bytes=self.staging_bytes,
            keys=keys,
            strict=strict,
        )
