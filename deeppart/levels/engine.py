"""DeepPart's built-in multi-level checkpoint engine (FTI semantics; see
docs/LEVELS.md): :class:`BuiltinBackend`, the orchestrator of a save and a
restore.

Every level starts from L1: each rank writes its planned pieces (the same
data file as :func:`deeppart.save`) into its node's local directory.

- L2 also sends each rank's file to its partner (the same position on the
  next node of its group), which stores it as ``partner-RRRRR.bin``
  (:mod:`deeppart.levels.partner`).
- L3 also codes the group's files with Reed-Solomon (``k = m =
  group_size``): each member stores one parity shard ``parity-RRRRR.bin``;
  any ``group_size`` of the group's ``2 * group_size`` files restore the rest
  (:mod:`deeppart.levels.erasure`).
- L4 also writes a normal DeepPart checkpoint to ``glbl_dir`` (readable by
  any world size with :func:`deeppart.load`): a directory, or an object
  store URL (``s3://bucket/prefix``, through the storage layer,
  :mod:`deeppart.storage`).

A save (:meth:`BuiltinBackend.save`) runs the package's stages: prepare
(:mod:`deeppart.saving.prepare`), the L1 write (:mod:`deeppart.saving.writer`), the
level's extra step (L2 partner copy, L3 parity, or L4 global save), the
renames, the commit of the metadata with a ``levels`` section
(:mod:`deeppart.storage.commit`), then the removal of old steps. A restore
(:meth:`BuiltinBackend.load`) runs the steps of
:mod:`deeppart.levels.recovery`. Where the files are:
:mod:`deeppart.levels.layout`; file helpers: :mod:`deeppart.levels.files`.

Data crosses nodes only through the :class:`~deeppart.comm.Comm`: a rank
reads and writes only its own node's local directory, plus the shared
``meta_dir`` (metadata and commit markers) and ``glbl_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from deeppart.agreement import agree, from_root
from deeppart.async_save import (
    AsyncSave,
    ShareTaker,
    background_priority,
    hold_proof,
    prove_or_replan,
    released_on_error,
    retake_share,
    run_writer,
    writer_for,
)
from deeppart.comm import Comm, resolve
from deeppart.errors import (
    AsyncSaveWarning,
    CheckpointError,
    LevelConfigError,
    OlderStepWarning,
    UnrecoverableError,
)
from deeppart.format import HEADER_SIZE, MARKER, data_file_name, fsync_dir, new_save_id
from deeppart.levels import erasure, memory, partner, peers, recovery
from deeppart.levels.backend import LevelSaveStats, RecoveryReport
from deeppart.levels.config import LevelConfig
from deeppart.levels.erasure import STRIPE_BYTES
from deeppart.levels.layout import Layout, step_name, steps_in
from deeppart.loading.reader import assemble
from deeppart.options import AsyncOptions, PlanOptions, fold, reject_unknown
from deeppart.progress import Progress
from deeppart.saving.deferred_proof import PendingProof
from deeppart.saving.metadata import metadata_json
from deeppart.saving.planning import PlanProvider
from deeppart.saving.prepare import Prepared, prepare_save
from deeppart.saving.save import PlannedSave
from deeppart.saving.snapshot import ShareSnapshot
from deeppart.saving.writer import RECORD_FIELDS, write_pieces
from deeppart.state.state import encode_plain
from deeppart.steps import lineage
from deeppart.storage.commit import commit_dir, remove_temp_dir
from deeppart.storage.identity import identity_text
from deeppart.storage.ownership import (
    check_target,
    checkpoint_file,
    level_file,
    remove_owned,
    side_name,
)
from deeppart.storage.target import save_target
from deeppart.storage.url import Location, location_key

_T = TypeVar("_T")


@dataclass
class _Begun:
    """A save past :meth:`BuiltinBackend._begin` on every rank."""

    step: int
    level: int
    #: The user value (rank 0's is written, with its line record).
    user: Any
    #: The prepared save: the live state's, or its snapshot's (``staged``).
    prep: Prepared
    #: When the save began (its stats count from here).
    t0: float
    #: Seconds of the caller's stages: ``prepare`` (with the snapshot, if
    #: any), ``budget`` (the memory tier's check).
    phases: dict[str, float]


def _remove_owned(path: Path, ours: Callable[[str], bool] = checkpoint_file) -> None:
    """Removes ``path`` if it holds only DeepPart's files (by name and
    content, :func:`deeppart.storage.ownership.remove_owned`); else leaves it."""
    remove_owned(path, ours)


class BuiltinBackend:
    """The built-in :class:`~deeppart.levels.backend.LevelBackend`.

    ``compression``/``zstd_level``: as :class:`deeppart.WriteOptions`'s
    ``compression``/``compression_level``; ``planning``: a
    :class:`deeppart.PlanOptions` (the old ``planner=``, ``algorithm=``,
    ``cost=``, ``topology=`` work for one release, with a DeprecationWarning).
    ``stripe_bytes``: the L3 coding stripe per member (memory per rank during coding: its own file
    plus about ``3 * group_size * stripe_bytes``). ``keep``: committed checkpoints kept
    (default: the config's ``[deeppart] keep``).
    """

    name = "builtin"

    def __init__(
        self,
        config: LevelConfig | str | os.PathLike[str],
        comm: Any = None,
        *,
        compression: str | None = None,
        zstd_level: int = 1,
        planning: PlanOptions | None = None,
        stripe_bytes: int = STRIPE_BYTES,
        keep: int | None = None,
        exchange: str = "auto",
        verbose: bool = False,
        **deprecated: Any,
    ) -> None:
        planning = fold("open_backend", "planning", PlanOptions, planning, deprecated, stacklevel=3)
        reject_unknown("BuiltinBackend()", deprecated)
        self.config = LevelConfig.coerce(config)
        self.comm: Comm = resolve(comm)
        hosts: list[str] | None = None
        if not self.config.local_test:
            rows = self.comm.allgather_varbytes(socket.gethostname().encode())
            hosts = [r.decode("utf-8", "replace") for r in rows]
        # Before any I/O: the same inputs on every rank, so every rank raises.
        self.config.validate(self.comm.size, hosts)
        if stripe_bytes < 2 or stripe_bytes % 2:
            raise LevelConfigError("stripe_bytes must be a positive even number")
        if keep is not None and keep < 1:
            raise LevelConfigError("keep must be at least 1")
        self.layout = Layout(self.config, self.comm.size, hosts)
        if self.config.memory:
            # The memory tier: every node's ckpt_dir on a tmpfs (collective).
            memory.check_memory_fs(self.comm, self.layout)
        self.compression = compression
        self.zstd_level = zstd_level
        self.stripe = stripe_bytes
        self.keep = keep if keep is not None else self.config.keep
        self.exchange = exchange
        self.verbose = verbose
        self.count = 0
        self.plans = PlanProvider.of(planning, self.comm.size, reuse=True)
        self.last_recovery: RecoveryReport | None = None
        #: The line the next save continues (rank 0 writes the records,
        #: :mod:`deeppart.steps.lineage`): the step last loaded or saved, its run.
        self._parent: lineage.Link | None = None
        self._run: str | None = None
        #: The step this engine last committed at L2: its node-local files
        #: are the next partner copies' base (``l2_delta``), while they last.
        self._l2_base: int | None = None
        #: Rank 0: the largest ``seq`` committed when this engine last
        #: loaded a step (0 before): a save retires only steps of a line it
        #: left that were committed by then, never those of another job
        #: beside it (a requeued job and its zombie resumed from one step).
        self._seen = 0
        #: CPU seconds in Reed-Solomon decoding on this rank, and the bytes of
        #: data (all members' stripe chunks) it decoded, since creation.
        self.decode_seconds = 0.0
        self.decode_bytes = 0
        #: The asynchronous save in flight (:meth:`save_async`), and the
        #: host buffer its snapshots reuse.
        self._pending: AsyncSave | None = None
        self._snapshot = ShareSnapshot()

    # ------------------------------------------------------------------
    # Paths.

    @property
    def rank(self) -> int:
        return self.comm.rank

    def local_step(self, step: int, rank: int | None = None) -> Path:
        return self.layout.local_step(step, self.rank if rank is None else rank)

    def meta_step(self, step: int) -> Path:
        return self.layout.meta_step(step)

    def global_step(self, step: int) -> Location:
        return self.layout.global_step(step)

    @property
    def _delta_base(self) -> int | None:
        """The step the next partner copies are deltas against (``l2_delta
        = 1``), which the memory tier keeps while there is room."""
        return self._l2_base if self.config.l2_delta else None

    def _check_level(self, level: int) -> None:
        if level not in (1, 2, 3, 4):
            raise LevelConfigError(f"level {level}: must be 1, 2, 3 or 4")
        if level == 4 and not self.config.glbl_dir.strip():
            raise LevelConfigError("level 4 needs glbl_dir")
        if level in (2, 3) and not self.config.enabled(level):
            self.config.replace(**{f"ckpt_l{level}": 1}).validate(self.comm.size, self.layout.hosts)

    # ------------------------------------------------------------------
    # Save.

    def save(
        self, step: int, state: Any, *, level: int | None = None, user: Any = None
    ) -> LevelSaveStats:
        """Checkpoints ``state`` as ``step`` at ``level`` (collective), once
        the save in flight (:meth:`save_async`) is done. In order:
        prepare (:meth:`_begin`: each rank's own tree, every rank agrees; the
        memory tier's budget), then :meth:`_finish`: the L1 write of this
        rank's data file, the level's extra step (L2
        :func:`~deeppart.levels.partner.send_copy`, L3
        :func:`~deeppart.levels.erasure.encode`, L4 the same pieces as a
        :func:`deeppart.save` checkpoint in ``glbl_dir``), the renames to
        final names, rank 0's commit of the metadata, and the removal of
        old steps (:meth:`_cleanup`)."""
        self.wait()
        begun, _ = self._begin(step, state, level, user)
        return self._finish(self.comm, begun)

    def save_async(
        self,
        step: int,
        state: Any,
        *,
        level: int | None = None,
        user: Any = None,
        background: AsyncOptions | None = None,
    ) -> AsyncSave:
        """:meth:`save` in the background (collective): once the save in
        flight is done (its unseen error raised here), the caller's thread
        prepares the save, checks the memory tier's budget (a refusal is
        raised here, on every rank, before anything is written) and copies
        this rank's planned pieces into a reused host buffer
        (:class:`~deeppart.saving.snapshot.ShareSnapshot`, as
        :func:`deeppart.async_save`); a writer thread then writes the L1
        file from that snapshot, runs the level's step and commits, over
        the writer's own communicator (:func:`deeppart.comm.writer_comm`).
        Returns its :class:`deeppart.AsyncSave`, whose ``wait()`` gives the
        :class:`LevelSaveStats` or raises the save's error on every rank.
        The state may change as soon as it returns. The next save, load,
        :meth:`latest`, :meth:`steps`, :meth:`wait` or :meth:`close`
        waits for it first. ``background``: as :func:`deeppart.async_save`'s
        (a share over ``max_staging_bytes``, or no writer communicator: the
        save runs synchronously, with an :class:`AsyncSaveWarning`)."""
        options = background if background is not None else AsyncOptions()
        self.wait()
        c = self.comm
        writer, why = writer_for(c)
        t0 = time.perf_counter()
        snap = self._snapshot
        take = ShareTaker(c.rank, snap, options, writer is not None, why)
        try:
            begun, flagged = self._begin(step, state, level, user, local=take, defer_proof=True)
        except BaseException:
            snap.discard()
            raise
        handle = AsyncSave(self.meta_step(step), step)
        # The large shared tensors' replica proof, left to the writer thread
        # as deeppart.async_save leaves it.
        proof = hold_proof(c, begun.prep)
        handle.proof = proof
        with released_on_error(proof):
            return self._go(c, begun, handle, proof, snap, take, writer, flagged, options, t0)

    def _go(
        self,
        c: Comm,
        begun: _Begun,
        handle: AsyncSave,
        proof: PendingProof | None,
        snap: ShareSnapshot,
        take: ShareTaker,
        writer: Comm | None,
        flagged: bool,
        options: AsyncOptions,
        t0: float,
    ) -> AsyncSave:
        """The rest of :meth:`save_async` once every rank prepared and took
        its snapshot: the synchronous road if any rank must take it, else
        the writer thread, which proves ``proof`` first. Copies found to
        differ make the save prepared again there, each rank's copy its
        own (its snapshot taken again while optimizer steps still wait,
        the memory tier's budget checked again for the new plan)."""
        live = begun.prep
        if flagged:
            snap.discard()
            warnings.warn(
                f"deeppart levels: step {begun.step} saved synchronously: "
                f"{take.why or 'another rank cannot save in the background'}",
                AsyncSaveWarning,
                stacklevel=3,
            )
            handle.synchronous = True
            if proof is not None:
                again = prove_or_replan(c, proof, live, None)
                if again is not None:
                    begun = dataclasses.replace(begun, prep=again[0])
                    self._check_budget(c, begun)
            handle._finish(self._finish(c, begun), None)
            return handle
        assert writer is not None and take.staged is not None
        snap.issue()  # the copies from CUDA devices, now that the agreement is past
        # The snapshot's seconds apart from the prepare's that held them.
        begun.phases["snapshot"] = take.seconds
        begun.phases["prepare"] -= take.seconds
        handle.snapshot_seconds = time.perf_counter() - t0
        handle.staged_bytes, handle.staging_capacity = snap.staged_bytes, snap.capacity
        # The writer thread sees the snapshot only, never the live state
        # (but the tensors it proves, which optimizer steps leave alone
        # until then).
        staged = dataclasses.replace(begun, prep=take.staged)
        del begun

        def take_again(prep: Prepared) -> int:
            nonlocal staged
            assert proof is not None
            again = retake_share(snap, prep, c.rank, options.snapshot_on_device, proof)
            staged = dataclasses.replace(staged, prep=again)
            return 0

        def work() -> LevelSaveStats:
            # At the loop's priority: its next optimizer step waits for it.
            if proof is not None and prove_or_replan(writer, proof, live, take_again) is not None:
                snap.issue()
                self._check_budget(writer, staged)
            background_priority()
            return self._finish(writer, staged)

        self._pending = handle
        run_writer(c, handle, snap, work)
        return handle

    def wait(self) -> LevelSaveStats | None:
        """Waits for the save in flight (:meth:`save_async`), if any;
        returns its stats, or raises its error if nobody has seen it yet."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.settle()
        stats = pending.stats
        assert stats is None or isinstance(stats, LevelSaveStats)
        return stats

    def _begin(
        self,
        step: int,
        state: Any,
        level: int | None,
        user: Any,
        local: Callable[[Prepared], int] | None = None,
        defer_proof: bool = False,
    ) -> tuple[_Begun, bool]:
        """The part of a save that sees the live state, on the caller's
        thread (collective over the engine's communicator): the level, the
        targets' checks (only DeepPart's files may be replaced; an L4
        target's store the same on every rank), the prepare (its plan,
        cached while the structure stays the same; ``local``: the
        snapshot, :func:`~deeppart.saving.prepare.prepare_save`) and the
        memory tier's budget. Raises on every rank; nothing is written.
        Also whether any rank's ``local`` byte is set."""
        c = self.comm
        t0 = time.perf_counter()
        self.count += 1
        lv = self.config.level_for(self.count) if level is None else level
        self._check_level(lv)  # the same on every rank: raises everywhere
        err: BaseException | None = None
        store = b""
        try:
            if step < 0:
                raise CheckpointError(f"step {step}: must be >= 0")
            if user is not None:
                encode_plain(user, ("<user>",))
            # Every rank checks its node's directory: only DeepPart's files
            # may be replaced (the decision is agreed below).
            check_target(self.local_step(step), level_file)
            check_target(self.meta_step(step))
            if lv == 4:
                # A directory: only DeepPart's files; an object store: the
                # save refuses a foreign marker and touches nothing else.
                target = save_target(self.global_step(step))
                target.check()
                store = identity_text(target.identity())  # agreed in the prepare
        except BaseException as e:
            err = e
        # deeppart.save's prepare: each rank passes its own tree; values and
        # tensors that differ between the ranks are kept per rank (each
        # rank's own version, deeppart.state.union), and every rank raises
        # if any failed above.
        t = time.perf_counter()
        prep, flagged = prepare_save(
            c, err, state, self.compression, self.plans, self.meta_step(step),
            local=local, store=store, defer_proof=defer_proof,
        )  # fmt: skip
        phases = {"prepare": time.perf_counter() - t}
        begun = _Begun(step, lv, user, prep, t0, phases)
        self._check_budget(c, begun)
        return begun, flagged

    def _check_budget(self, c: Comm, begun: _Begun) -> None:
        """The memory tier: every node's share of the step against its
        budget and free memory, before anything is written (collective over
        ``c``; every rank raises alike). Nothing without the memory tier."""
        if not self.config.memory:
            return
        t = time.perf_counter()
        bounds = [b + HEADER_SIZE for b in begun.prep.plan.rank_bytes()]
        memory.check_budget(
            c, self.layout, begun.step, begun.level, bounds, self.stripe, self._delta_base
        )
        begun.phases["budget"] = begun.phases.get("budget", 0.0) + time.perf_counter() - t

    def _finish(self, c: Comm, begun: _Begun) -> LevelSaveStats:
        """The rest of a save once :meth:`_begin` is past on every rank
        (collective over ``c``: the engine's communicator, or an
        asynchronous save's writer communicator, on its writer thread):
        the line record, the writes of every level from ``begun.prep``
        (the live state's leaves, or the snapshot's ``staged`` pieces), the
        commit, the removal of old steps. Every stage that can fail on some
        ranks is agreed: a failure raises on every rank, and nothing is
        committed."""
        step, lv, prep = begun.step, begun.level, begun.prep
        phases = dict(begun.phases)
        err: BaseException | None = None
        value: Any = {"step": step, "user": begun.user}
        link, run = lineage.Link(step, 0), self._run or ""
        leftovers: dict[int, set[str]] = {}
        try:
            if c.rank == 0:  # only rank 0's user value is written
                value, link, run = self._line_record(step, begun.user)
                objects = self.layout.global_objects()
                if objects is not None:
                    # What interrupted L4 saves left in the object store,
                    # removed after this save commits (see _cleanup).
                    leftovers = objects.leftovers(below=step)
                if self.meta_step(step).exists():
                    # Re-saving a step: uncommit it first, so a crash never
                    # leaves a marker over mixed files.
                    (self.meta_step(step) / MARKER).unlink(missing_ok=True)
        except BaseException as e:
            err = e
        agree(c, err)

        # L1: every rank writes its own file (temporary name).
        local = self.local_step(step)
        own_tmp = local / (data_file_name(c.rank) + ".tmp")
        renames: list[tuple[Path, Path]] = [(own_tmp, local / data_file_name(c.rank))]
        records = np.zeros(0, dtype=np.uint64)
        size = 0
        t = time.perf_counter()
        try:
            local.mkdir(parents=True, exist_ok=True)
            prog = Progress("save", 0, enabled=False)
            recs, size = write_pieces(own_tmp, c.rank, prep, self.zstd_level, prog)
            records = recs.reshape(-1)
        except BaseException as e:
            err = e
        agree(c, err)
        phases["l1"] = time.perf_counter() - t

        sizes_f = c.allgather_f64(np.array([float(size)], dtype=np.float64))[:, 0]
        sizes = [int(x) for x in sizes_f]
        parity_size, parity_xxh = 0, 0
        partner_sent = -1
        if lv == 2:
            base = self._l2_base
            partner_sent = self._phase(
                c,
                phases,
                "l2",
                lambda: partner.send_copy(
                    c,
                    self.layout,
                    local,
                    own_tmp,
                    sizes,
                    renames,
                    self.config.l2_rate,
                    bool(self.config.l2_delta),
                    None if base in (None, step) else self.local_step(base),
                ),
            )  # fmt: skip
        elif lv == 3:
            parity_size, parity_xxh = self._phase(
                c,
                phases,
                "l3",
                lambda: erasure.encode(
                    c,
                    self.layout.group(c.rank),
                    local,
                    own_tmp,
                    sizes,
                    self.stripe,
                    renames,
                    phases,
                ),
            )
        elif lv == 4:
            # The same pieces as a deeppart.save checkpoint in glbl_dir
            # (the prepare above is its prepare: its target checked, its
            # store agreed).
            t = time.perf_counter()
            PlannedSave(
                prep, self.global_step(step), self.zstd_level, overwrite=True, user=value,
                progress=False, verbose=False, staging_bytes=None,
            ).finish(c)  # fmt: skip
            phases["l4"] = time.perf_counter() - t

        # Every rank's files get their final names; then rank 0 commits.
        t = time.perf_counter()
        try:
            for src, dst in renames:
                src.replace(dst)
            fsync_dir(local)
        except BaseException as e:
            err = e
        agree(c, err)
        mine = np.concatenate([records, np.array([size, parity_size, parity_xxh], dtype=np.uint64)])
        counts = [len(prep.plan.rank_pieces(r)) * RECORD_FIELDS + 3 for r in range(c.size)]
        gathered = c.gatherv_u64(mine, counts, root=0)
        if c.rank == 0:
            assert gathered is not None
            try:
                self._commit_meta(step, lv, prep, gathered, counts, value)
            except BaseException as e:
                err = e
        agree(c, err)
        self._parent, self._run = link, run
        self._l2_base = step if lv == 2 else self._l2_base
        phases["commit"] = time.perf_counter() - t
        t = time.perf_counter()
        self._cleanup(c, step, link, leftovers)
        phases["cleanup"] = time.perf_counter() - t
        # Every rank's time, so that the stats are the same on every rank.
        mine_row = np.array([time.perf_counter() - begun.t0, partner_sent], dtype=np.float64)
        rows = c.allgather_f64(mine_row)
        rank_seconds = [float(x) for x in rows[:, 0]]
        stats = LevelSaveStats(
            op="save",
            directory=str(self.meta_step(step)),
            world_size=c.size,
            raw_bytes=prep.manifest.total_bytes,
            stored_bytes=sum(sizes),
            seconds=max(rank_seconds),
            rank_seconds=rank_seconds,
            codec=prep.codec,
            step=step,
            level=lv,
            phases=phases,
            rank_partner_sent=[int(x) for x in rows[:, 1]] if lv == 2 else [],
        )
        if self.verbose and c.rank == 0:
            print(
                f"deeppart levels: step {step} at L{lv} in {stats.seconds:.2f} s {phases}",
                flush=True,
            )
        return stats

    def _line_record(self, step: int, user: Any) -> tuple[Any, lineage.Link, str]:
        """Rank 0: the user value of a save of ``step`` with its line record
        (:mod:`deeppart.steps.lineage`), the new step as a parent, and its run."""
        lines = self.layout.lines()
        parent, run = self._parent, self._run or lineage.new_run()
        at = lines.nodes.get(step)
        if at is not None and parent == at.link and at.parent is not None:
            # Saving again the step it came from: the new one takes its place.
            parent = at.parent
        seq = lineage.next_seq(lines, parent)
        value, link = lineage.record(step, user, run, seq, parent)
        return value, link, run

    def _phase(self, c: Comm, phases: dict[str, float], name: str, fn: Callable[[], _T]) -> _T:
        """Runs ``fn`` on every rank of ``c``, then agrees (every rank raises
        if one failed); records its seconds as ``phases[name]``."""
        t = time.perf_counter()
        err: BaseException | None = None
        out: _T | None = None
        try:
            out = fn()
        except BaseException as e:
            err = e
        agree(c, err)
        phases[name] = time.perf_counter() - t
        return out  # type: ignore[return-value]  # set: no rank failed

    def _commit_meta(
        self,
        step: int,
        level: int,
        prep: Prepared,
        gathered: npt.NDArray[np.uint64],
        counts: list[int],
        user: Any,
    ) -> None:
        """Rank 0: commits ``step``'s metadata (``user``: the user value
        with its line record) in ``meta_dir``."""
        # Split each rank's block into the piece records + size (the format
        # v1 layout _metadata_json reads) and the parity size and checksum.
        blocks: list[npt.NDArray[np.uint64]] = []
        parity_sizes: list[int] = []
        parity_xxh3: list[int] = []
        pos = 0
        for n in counts:
            block = gathered[pos : pos + n]
            pos += n
            blocks.append(block[:-2])
            parity_sizes.append(int(block[-2]))
            parity_xxh3.append(int(block[-1]))
        levels = {
            "level": level,
            "step": step,
            "exec_id": self.config.exec_id,
            # Where the files are, for tools (deeppart inspect); recovery
            # uses the config's directories.
            "ckpt_dir": os.path.abspath(self.config.ckpt_dir),
            "glbl_dir": (
                location_key(self.config.global_location()) if self.config.glbl_dir.strip() else ""
            ),
            **self.layout.describe(),
            # Per node, its directory under ckpt_dir (host names on real
            # nodes), and whether nodes were fake (one shared ckpt_dir).
            "node_dirs": self.layout.node_dirs(),
            "local_test": self.config.local_test,
            "stripe_bytes": self.stripe,
            "parity_sizes": parity_sizes,
            "parity_xxh3": parity_xxh3,
        }
        save_id = new_save_id()
        meta = metadata_json(
            prep, np.concatenate(blocks), user, {"levels": levels}, save_id=save_id
        )
        final = self.meta_step(step)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.urandom(6).hex()}"
        tmp.mkdir()
        try:
            # Re-saving a step replaces its (uncommitted: see save) metadata.
            commit_dir(tmp, final, meta, overwrite=True, save_id=save_id)
        except BaseException:
            remove_temp_dir(tmp, save_id)
            raise

    # ------------------------------------------------------------------
    # Cleanup (after a commit).

    def committed_steps(self) -> list[int]:
        """Committed steps (node-local or global), oldest first."""
        return self.layout.committed_steps()

    def _cleanup(
        self, c: Comm, newest: int, link: lineage.Link, leftovers: dict[int, set[str]] | None = None
    ) -> None:
        """After step ``newest`` committed as the commit ``link`` names (collective over
        ``c``, the save's communicator): removes, in every
        root, the steps of its line beyond ``keep`` and the steps of the
        lines it left (:meth:`deeppart.steps.lineage.Lines.abandoned`), uncommitted
        older ones, and leftovers of interrupted commits: only step
        directories named as DeepPart names them, holding nothing but
        DeepPart's files (a user's directory of such a name stays); a
        committed step without a line record (an earlier run's) is never
        pruned.

        With ``glbl_dir`` in an object store, a retired step's L4 copy goes
        if it is that very save (its marker first, then that save's objects
        recognised by save id and content,
        :meth:`deeppart.steps.object_steps.ObjectSteps.remove_step`), and the
        ``leftovers`` of interrupted L4 saves that rank 0 listed when this
        save began (:meth:`~deeppart.steps.object_steps.ObjectSteps.leftovers`)
        are removed the same way; nothing else under the prefix is touched.
        The save has committed: a failure here is a warning."""

        def roots() -> bytes:
            try:
                return self._cleanup_roots(newest, link, leftovers or {})
            except Exception as e:
                warnings.warn(
                    f"deeppart levels: step {newest} committed, but removing old steps "
                    f"failed: {type(e).__name__}: {e}",
                    stacklevel=5,  # the caller of save(), as before
                )
                return b""

        doomed_steps = set(json.loads(from_root(c, roots) or b"[]"))
        # One rank per node removes that node's local leftovers.
        hosts = self.layout
        if all(hosts.node(r) != hosts.node(c.rank) for r in range(c.rank)):
            kept: set[int] | None
            try:
                kept = set(self.committed_steps())
            except Exception:  # an object store that does not answer
                kept = None
            root = self.layout.local_root(c.rank)
            for s in steps_in(root, False):
                if s in doomed_steps or (kept is not None and s < newest and s not in kept):
                    with contextlib.suppress(OSError):
                        _remove_owned(root / step_name(s), level_file)
            if self.config.memory and kept is not None:
                # Only the newest memory_keep committed steps stay in memory.
                # The partner copies' delta base stays while there is room.
                memory.evict(
                    root, newest, sorted(kept), self.config.memory_keep,
                    self._delta_base, self.config.memory_budget,
                )  # fmt: skip
        c.barrier()

    def _cleanup_roots(
        self, newest: int, link: lineage.Link, leftovers: dict[int, set[str]]
    ) -> bytes:
        """Rank 0's part of :meth:`_cleanup`, in ``meta_dir`` and
        ``glbl_dir``; returns the steps whose node-local files go (JSON)."""
        lines = self.layout.lines()
        line = lines.line_of(link)
        retired = line[self.keep :] + lines.abandoned(line, self._seen)
        doomed = {n.step for n in retired}
        committed = self.committed_steps()
        meta_root = self.config.meta_root()
        for s in steps_in(meta_root, False):
            if s < newest and s not in committed:
                doomed.add(s)
        payload = json.dumps(sorted(doomed)).encode()
        objects = self.layout.global_objects()
        for node in retired:
            # Each root's copy of the step goes if it is that very save.
            roots = [self.meta_step(node.step)]
            copy_at = self.layout.global_dir(node.step)
            if copy_at is not None:
                roots.append(copy_at)
            for d in roots:
                _, got = lineage.read_node(d, node.step)
                if isinstance(got, lineage.Node) and node.link.names(got):
                    _remove_owned(d)
        if objects is not None:
            stored, _, save_ids = objects.lines()
            for node in retired:
                copy = stored.nodes.get(node.step)
                if copy is not None and node.link.names(copy):
                    objects.remove_step(node.step, save_ids[node.step])
        for s in sorted(doomed - {n.step for n in retired}):
            # Uncommitted everywhere: what an interrupted save left.
            _remove_owned(self.meta_step(s))
            copy_at = self.layout.global_dir(s)
            if copy_at is not None:
                _remove_owned(copy_at)
        if objects is not None:
            # Interrupted L4 saves (no marker) seen when this save began.
            objects.remove_leftovers(leftovers)
        if meta_root.is_dir():
            for child in meta_root.iterdir():
                if side_name(child.name) is not None:
                    _remove_owned(child)
        return payload

    # ------------------------------------------------------------------
    # Restore (the steps of deeppart.levels.recovery).

    def _recoverable(self, step: int) -> bool:
        """Whether ``step``'s files (checked by size, not read) suffice to
        recover it (collective)."""
        c, layout = self.comm, self.layout
        st, _ = recovery.read_step(c, layout, step)
        if st is None:
            return recovery.global_ok(c, layout, step)
        if st.foreign:
            return peers.recoverable(c, layout, st)
        survey, _, _ = recovery.survey(c, layout, st, deep=False)
        return bool(survey.levels)

    def latest(self) -> int | None:
        """The newest committed step whose files (checked by size, not
        read) suffice to recover it, or None (once the save in flight is
        done)."""
        self.wait()
        for s in recovery.candidates(self.comm, self.layout, None):
            if self._recoverable(s):
                return s
        return None

    def steps(self) -> list[int]:
        """Every committed step that :meth:`latest` would accept, oldest
        first (its last is :meth:`latest`)."""
        self.wait()
        candidates = recovery.candidates(self.comm, self.layout, None)
        return sorted(s for s in candidates if self._recoverable(s))

    def load(
        self, step: int | None = None, *, into: Any = None, per_rank: Any = None
    ) -> tuple[Any, RecoveryReport]:
        """Restores ``step`` (None: the newest committed step that can be
        recovered; collective): each candidate, newest first, through
        :meth:`_try_load`; raises with every candidate's reason if none can.
        A newer step skipped is reported (:class:`~deeppart.errors.OlderStepWarning`
        naming it and why, and ``RecoveryReport.skipped``). ``per_rank``: as
        for :func:`deeppart.load`, where a step is loaded from its L4 copy at
        another world size (the only level that serves one). The save in
        flight (:meth:`save_async`) is done first."""
        self.wait()
        t0 = time.perf_counter()
        reasons: list[str] = []
        for s in recovery.candidates(self.comm, self.layout, step):
            result = self._try_load(s, into, t0, per_rank)
            if isinstance(result, str):
                reasons.append(f"step {s}: {result}")
                continue
            if reasons:
                result = result[0], dataclasses.replace(result[1], skipped=reasons)
                warnings.warn(
                    f"deeppart levels: loaded step {s}, not the newer committed "
                    f"step(s) that cannot be recovered here: {'; '.join(reasons)}",
                    OlderStepWarning,
                    stacklevel=2,
                )
            self.last_recovery = result[1]
            if self.rank == 0:
                self._continue_from(s)
            if self.verbose and self.rank == 0:
                print(f"deeppart levels: {result[1].summary()}", flush=True)
            return result
        if not reasons:
            raise CheckpointError(
                f"{self.config.meta_root()}: no committed checkpoint"
                if step is None
                else f"step {step}: no such committed checkpoint"
            )
        raise UnrecoverableError("no checkpoint can be recovered: " + "; ".join(reasons))

    def _continue_from(self, step: int) -> None:
        """Rank 0, after loading ``step``: the line the next save continues
        (a new line if it is not the newest; a step without a record starts
        a fresh one). Learnt from ``meta_dir`` alone when it holds the
        step, so that a load served by the node-local levels reads nothing
        from ``glbl_dir`` (an object store's listing and line records); the
        next save reads every root before it numbers its step
        (:meth:`_line_record`), so its ``seq`` is still above every
        committed step's. Only a step that ``meta_dir`` does not hold (one
        served by its L4 copy alone) needs ``glbl_dir``'s lines here.

        ``_seen`` is then ``meta_dir``'s largest ``seq``: a step only
        ``glbl_dir`` holds with a larger ``seq`` may have been committed
        after this load (another job's, beside this one), so a rollback
        never retires it."""
        lines = lineage.scan(self.config.meta_root())
        if step not in lines.nodes and step not in lines.legacy:
            lines = self.layout.lines()
        node = lines.nodes.get(step)
        self._parent = node.link if node is not None else None
        self._run = node.run if node is not None else None
        self._seen = lines.max_seq()

    def _try_load(
        self, step: int, into: Any, t0: float, per_rank: Any = None
    ) -> tuple[Any, RecoveryReport] | str:
        """Restores ``step`` (collective) through the steps of
        :mod:`deeppart.levels.recovery`: the state and report, or why not."""
        c, layout = self.comm, self.layout
        st, why = recovery.read_step(c, layout, step)
        if st is None:
            if recovery.global_ok(c, layout, step):
                return recovery.load_global(c, layout, step, into, self.exchange, t0, per_rank)
            return why
        err: BaseException | None = None
        mine: recovery.OwnTargets | None = None
        try:
            # This rank's own view (its versions of per-rank values, the
            # items it held; at another world size as deeppart.load's
            # rules and per_rank= say); checks into= before any I/O.
            mine = recovery.own_targets(st.meta, c.rank, c.size, into, True, per_rank)
        except BaseException as e:
            err = e
        agree(c, err)
        assert mine is not None
        if st.foreign:
            # Another world size or node layout: from what the survivors
            # hold, resharded (deeppart.levels.peers).
            got_peers = peers.recover(c, layout, st, mine, t0)
            if got_peers is None:  # only the global copy: loaded whole
                return recovery.load_global(c, layout, step, into, self.exchange, t0, per_rank)
            return got_peers
        survey, held, moved = recovery.survey(c, layout, st, deep=True)
        if not survey.levels:
            if st.level == 4 and recovery.global_ok(c, layout, step):
                return recovery.load_global(c, layout, step, into, self.exchange, t0, per_rank)
            return survey.reason
        got = recovery.recover_own(c, layout, st, survey.levels, held)
        self.decode_seconds += got.decode_seconds
        self.decode_bytes += got.decode_bytes
        if got.failure:
            return got.failure
        own = got.own
        assert own is not None
        rebuilt = recovery.restore_redundancy(c, layout, st, own, survey.status)
        if got.rewritten:
            rebuilt.insert(0, got.rewritten)
        rows = c.allgather_varbytes(json.dumps([rebuilt, moved]).encode())
        all_rewritten = [path for row in rows for path in json.loads(row)[0]]
        all_moved = [path for row in rows for path in json.loads(row)[1]]
        # Every rank now holds its own file: the plain leaves' pieces of
        # each broadcast and placed, the DTensor shards sent to the ranks
        # whose regions need them.
        where = self.meta_step(step)
        recovery.distribute(c, mine.meta, where, own, mine.targets, mine.shards.leaves)
        filled = recovery.distribute_shards(c, mine.meta, where, own, mine.shards)
        state = assemble(mine.meta, mine.targets, where, mine.matched, mine.pruned, filled)
        report = RecoveryReport(
            step, survey.levels, all_rewritten, time.perf_counter() - t0, all_moved
        )
        return state, report

    def close(self) -> None:
        """Waits for the save in flight (:meth:`wait`)."""
        self.wait()
