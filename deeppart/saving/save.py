"""``save``: a parallel checkpoint of each rank's own state.

Each rank passes its own tree; what several ranks hold alike is stored once.
:func:`save` plans (deterministically, on every rank) which rank writes
which slice of which leaf; each rank writes its pieces straight from tensor
memory into its own data file, and rank 0 commits the checkpoint
atomically (:func:`plan_save` is the part an asynchronous save shares).

It reads top-down as a sequence of stages, each in its own module
(docs/ARCHITECTURE.md): planning -> prepare -> (verify replicas) ->
temporary directory -> write -> commit. Every stage that can fail on some
ranks only is followed by one agreement collective
(:mod:`deeppart.agreement`), so a failure anywhere raises on every rank
instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, Unpack

import numpy as np

from deeppart.agreement import agree
from deeppart.comm import Comm, resolve
from deeppart.format import SAVE_ID_HEX, new_save_id
from deeppart.options import PlanOptions, WriteOptions, fold, fold_planning, reject_unknown
from deeppart.progress import Progress, Stats, record_stats
from deeppart.saving.deferred_proof import (
    PendingProof,
    ProofBesideWrite,
    pending,
)
from deeppart.saving.digests import digest_threads
from deeppart.saving.metadata import metadata_json
from deeppart.saving.planning import PlanProvider
from deeppart.saving.prepare import Prepared, last_proof, prepare_save, replan, replica_classes
from deeppart.saving.prepare import verify_replicas as check_replicas
from deeppart.saving.writer import RECORD_FIELDS, write_pieces
from deeppart.state import staging as _staging
from deeppart.state.state import encode_plain
from deeppart.storage.commit import TEMP_NAME_MAX, KeepAside
from deeppart.storage.identity import identity_text
from deeppart.storage.target import SaveTarget, save_target
from deeppart.storage.url import Location, parse_location

__all__ = [
    "PlannedSave",
    "SaveOptions",
    "plan_save",
    "save",
    "save_options",
    "take_unproved",
]


def save(
    state: Any,
    directory: str | os.PathLike[str],
    *,
    comm: Any = None,
    overwrite: bool = False,
    user: Any = None,
    progress: bool | None = None,
    verbose: bool = False,
    group: Any = None,
    planning: PlanOptions | PlanProvider | None = None,
    writing: WriteOptions | None = None,
    **deprecated: Any,
) -> Stats:
    """Saves ``state`` (each rank's own) to ``directory`` (a path or an
    ``s3://`` URL), every rank writing its planned share. Collective: call
    it on every rank of ``comm`` (None: mpi4py's COMM_WORLD if MPI runs,
    else torch.distributed's default group, else one process).

    ``overwrite``: replace a committed checkpoint there (it stays loadable
    until the new one commits). ``user``: a plain value stored in the
    metadata. ``progress``: rank 0 shows a progress line (None: on a
    terminal); ``verbose``: rank 0 prints the save's :class:`Stats`, which
    it returns (the same on every rank). ``group``: ``"auto"`` compares
    every tensor several ranks hold under one path by its whole bytes
    (differing ones become versions, one per group); a ProcessGroup or list
    of global ranks stores this rank's group's tree under ``"ranks:0,1"``...
    (:mod:`deeppart.loading.groups`). ``planning``: a
    :class:`deeppart.PlanOptions` (planner, algorithm, cost model,
    topology, or a ready plan); ``writing``: a :class:`deeppart.WriteOptions`
    (compression, staging buffer, replica checks).

    Every rank passes its own tree (:mod:`deeppart.state.union`): the
    checkpoint is the union of what the ranks hold (DTensors on any mesh,
    pipeline stages, per-rank values; each rank loads its own back at the
    same world size). The old keywords (``compression=``, ``algorithm=``,
    ...) work for one release, with a DeprecationWarning
    (:mod:`deeppart.options`).
    """
    c = resolve(comm)
    t0 = time.perf_counter()
    planning, writing = save_options("deeppart.save", planning, writing, deprecated)
    reject_unknown("deeppart.save()", deprecated)
    planned = plan_save(
        c,
        state,
        directory,
        overwrite=overwrite,
        user=user,
        progress=progress,
        verbose=verbose,
        group=group,
        planning=planning,
        writing=writing,
        defer_proof=True,
    )
    return planned.finish(c, t0)


def save_options(
    where: str,
    planning: object,
    writing: object,
    old: dict[str, Any],
    *,
    share: Sequence[str] = (),
    stacklevel: int = 2,
) -> tuple[PlanOptions | PlanProvider, WriteOptions]:
    """A save's ``planning=`` and ``writing=``, or what the old keywords
    in ``old`` say (removed from it, with a DeprecationWarning at the
    caller of ``where``; :func:`deeppart.options.fold`)."""
    p = fold_planning(where, planning, old, stacklevel + 1)
    w = fold(where, "writing", WriteOptions, writing, old, share=share, stacklevel=stacklevel + 1)
    if not isinstance(p, PlanOptions | PlanProvider):
        raise TypeError(f"{where}: planning= takes a deeppart.PlanOptions, not {p!r}")
    return p, w


@dataclass
class PlannedSave:
    """A save past its planning and prepare stages on every rank (nothing
    written yet); :meth:`finish` runs the rest. An asynchronous save plans
    on the caller's thread and finishes on its writer thread, from a
    snapshot of this rank's pieces (``prep.staged``)."""

    prep: Prepared
    final: Location
    zstd_level: int
    overwrite: bool
    user: Any
    progress: bool | None
    verbose: bool
    staging_bytes: int | None
    #: Whether any rank's byte from ``plan_save(local=...)`` is set.
    flagged: bool = False
    #: Where it writes and how it commits (a file system directory or an
    #: object store: :mod:`deeppart.storage.target`).
    target: SaveTarget | None = None
    #: A replaced checkpoint the commit keeps under another name (rank 0's;
    #: :class:`deeppart.storage.commit.KeepAside`).
    keep: KeepAside | None = None

    def finish(self, c: Comm, t0: float | None = None) -> Stats:
        """Temporary directory, write, commit (collective over ``c``);
        the save's :class:`Stats` count from ``t0`` (default: now)."""
        t0 = time.perf_counter() if t0 is None else t0
        prep, final = self.prep, self.final
        target = self.target if self.target is not None else save_target(final)
        # Rank 0 makes the save's id and begins it (on a file system: the
        # temporary directory).
        err: BaseException | None = None
        payload = b""
        if c.rank == 0:
            try:
                save_id = new_save_id()
                payload = save_id.encode() + target.begin(save_id, self.overwrite).encode()
            except BaseException as e:
                err = e
        names = agree(c, err, payload, width=SAVE_ID_HEX + TEMP_NAME_MAX)
        # Every rank leaves that agreement at about the same moment: a rank's
        # time in save() is its time before it plus the common time after it.
        t_sync = time.perf_counter()
        before_sync = t_sync - t0
        save_id = names[0][:SAVE_ID_HEX].decode()
        token = names[0][SAVE_ID_HEX:].rstrip(b"\0").decode()
        _agree_seen(c, target, token, save_id)

        # The large shared tensors' replica proof, if prepare left it to the
        # save (plan_save(defer_proof=True)): digested beside the write.
        proof = _proof_beside_write(c, prep)
        # Every rank writes its pieces; rank 0 gathers the piece records.
        try:
            gathered = _write(
                c, prep, target, token, self.zstd_level, self.progress, self.staging_bytes,
                save_id,
            )  # fmt: skip
        finally:
            if proof is not None:
                waited = time.perf_counter()
                proof.join()
                last_proof.waited_seconds = time.perf_counter() - waited
        if proof is not None:
            last_proof.beside_seconds = proof.proof.seconds
            last_proof.beside_nbytes = proof.proof.nbytes
            try:
                differ = proof.result(c)
            except BaseException:
                if c.rank == 0:
                    target.abandon(token, save_id)
                raise
            if differ is not None:
                # Copies differ: what was written merged them. Abandoned, and
                # saved again as the union of each rank's own copies.
                if c.rank == 0:
                    target.abandon(token, save_id)
                again, _ = replan(prep, c, differ)
                return dataclasses.replace(self, prep=again).finish(c, t0)

        # Rank 0 commits: metadata, fsyncs, rename, marker.
        stored_total = 0
        if c.rank == 0:
            assert gathered is not None
            try:
                meta = metadata_json(prep, gathered, self.user, save_id=save_id)
                head = json.loads(meta)
                stored_total = int(head["stored_bytes"])
                # Nothing is committed that the store does not hold.
                target.check_written(token, save_id, head["file_sizes"])
                target.commit(token, save_id, meta, self.overwrite, self.keep)
            except BaseException as e:
                err = e
                target.abandon(token, save_id)
        # The time after the first agreement ends in this last one, which
        # every rank leaves together once the last of them (rank 0, after
        # gathering everyone's records and committing) has entered it: the
        # latest entry is that common time. Taken from the agreed rows, it is
        # the same number on every rank, so are the Stats (on the writer
        # thread of an asynchronous save too).
        entered = time.perf_counter() - t_sync
        rows = agree(c, err, struct.pack("<dQd", before_sync, stored_total, entered), width=24)
        fields = [struct.unpack("<dQd", row[:24]) for row in rows]
        after_sync = max(f[2] for f in fields)
        rank_seconds = [f[0] + after_sync for f in fields]
        stats = Stats(
            op="save",
            directory=str(final),
            world_size=c.size,
            raw_bytes=prep.manifest.total_bytes,
            stored_bytes=fields[0][1],
            seconds=max(rank_seconds),
            rank_seconds=rank_seconds,
            codec=prep.codec,
        )
        record_stats("save", stats)
        if self.verbose and c.rank == 0:
            print(stats.summary(), flush=True)
        return stats


class SaveOptions(TypedDict, total=False):
    """The keywords of :func:`save` other than ``comm``, the options
    objects given as objects (their defaults are save's)."""

    overwrite: bool
    user: Any
    progress: bool | None
    verbose: bool
    group: Any
    #: A :class:`deeppart.PlanOptions`, or a provider shared between saves.
    planning: PlanOptions | PlanProvider
    writing: WriteOptions
    #: Not a keyword of :func:`save`: what a Checkpointer's commit keeps
    #: aside (:class:`deeppart.storage.commit.KeepAside`).
    keep: KeepAside | None


def plan_save(
    c: Comm,
    state: Any,
    directory: str | os.PathLike[str] | Location,
    *,
    local: Callable[[Prepared], int] | None = None,
    defer_proof: bool = False,
    **options: Unpack[SaveOptions],
) -> PlannedSave:
    """The planning and prepare stages of :func:`save` (same keywords),
    with their agreement (and ``verify_replicas``'s check): collective over
    ``c``; raises on every rank before anything is written.

    ``local``: a step run on this rank once it is prepared (an asynchronous
    save's snapshot), before the agreement; it returns one byte (0-255)
    that the same collective shares (``PlannedSave.flagged``: set on any rank), and its
    failure fails the agreement on every rank. ``defer_proof``: the
    large shared tensors' replica proof may be left to the caller
    (``PlannedSave.prep.unproved``, :mod:`deeppart.saving.deferred_proof`):
    :meth:`PlannedSave.finish` digests them beside its write; an
    asynchronous save takes them first (:func:`take_unproved`) for its
    writer thread."""
    o = options
    final = parse_location(directory)
    target = save_target(final)
    w = o.get("writing") or WriteOptions()
    plan_provider = PlanProvider.of(o.get("planning"), c.size)

    # Plan and prepare; every rank checks that all prepared the same save.
    err: BaseException | None = None
    user = o.get("user")
    verify_replicas = w.verify_replicas
    store = b""
    try:
        if user is not None:
            encode_plain(user, ("<user>",))
        target.check()  # on every rank: each may see its own file system
        # The store this rank addresses, compared in the agreement below.
        store = identity_text(target.identity())
    except BaseException as e:
        err = e
    prep, flagged = prepare_save(
        c,
        err,
        state,
        w.compression,
        plan_provider,
        final,
        group=o.get("group"),
        replica_dims=w.replica_dims,
        local=local,
        store=store,
        declared=verify_replicas,
        defer_proof=defer_proof,
    )
    if verify_replicas:
        check_replicas(c, prep)
    return PlannedSave(
        prep,
        final,
        w.compression_level,
        o.get("overwrite", False),
        user,
        o.get("progress"),
        o.get("verbose", False),
        w.staging_bytes,
        flagged,
        target,
        o.get("keep"),
    )


def _agree_seen(c: Comm, target: SaveTarget, token: str, save_id: str) -> None:
    """Where one path may be a different directory on each node
    (``target.check_seen``), every rank checks that it sees what rank 0
    began the save in, and all agree (one 1-byte agreement, before anything
    is written); if some do not, rank 0 removes it and every rank raises
    the same StoreConfigError naming them."""
    if c.size == 1 or not target.check_seen:
        return
    err: BaseException | None = None
    seen = False
    try:
        seen = target.sees(token)
    except BaseException as e:
        err = e
    try:
        rows = agree(c, err, bytes([seen]), width=1)
        blind = [r for r, row in enumerate(rows) if not row[0]]
        if blind:
            raise target.unseen_error(token, blind)
    except BaseException:
        if c.rank == 0:
            target.abandon(token, save_id)
        raise


def take_unproved(c: Comm, prep: Prepared) -> PendingProof | None:
    """The proof ``prep`` left to its caller (``prep.unproved``, now
    emptied: taken once), its tensors' versions read now; None when it
    left none (every rank of a save that reuses a cached union and left
    part of its check to this proof takes one, ``prep.proof_check``)."""
    if not prep.unproved and prep.proof_check is None:
        return None
    leaves = prep.leaves
    p = pending(
        prep.unproved,
        {i: leaf.tensor for i, leaf in enumerate(leaves) if leaf.tensor is not None},
        {i: leaf.path for i, leaf in enumerate(leaves)},
        replica_classes(prep.manifest, c.size),
        prep.proof_check,
    )
    prep.unproved = {}
    prep.proof_check = None
    return p


def _proof_beside_write(c: Comm, prep: Prepared) -> ProofBesideWrite | None:
    """Starts digesting ``prep``'s unproved shared tensors on a thread;
    None when it has none."""
    p = take_unproved(c, prep)
    return None if p is None else ProofBesideWrite(p, digest_threads(c.size))


def _write(
    c: Comm,
    prep: Prepared,
    target: SaveTarget,
    token: str,
    zstd_level: int,
    progress: bool | None,
    staging_bytes: int | None,
    save_id: str = "",
) -> Any:
    """The write stage with its agreement: this rank's data file where
    ``target`` puts it (its header carrying ``save_id``); rank 0 returns
    everyone's piece records (flat, each rank's followed by its file size),
    the others None. On any failure every rank raises, and rank 0 removes
    what the save wrote (``target.abandon``)."""
    err: BaseException | None = None
    prog = Progress(
        "save", prep.plan.rank_bytes()[c.rank], enabled=progress if c.rank == 0 else False
    )
    local = np.zeros(1, dtype=np.uint64)
    try:
        path, opener = target.data_file(token, save_id, c.rank)
        records, size = write_pieces(
            path,
            c.rank,
            prep,
            zstd_level,
            prog,
            staging=_staging.Staging(staging_bytes),
            save_id=save_id,
            opener=opener,
        )
        local = np.concatenate([records.reshape(-1), np.array([size], dtype=np.uint64)])
    except BaseException as e:
        err = e
    finally:
        prog.close()
    try:
        agree(c, err)
    except BaseException:
        if c.rank == 0:
            target.abandon(token, save_id)
        raise
    counts = [len(prep.plan.rank_pieces(r)) * RECORD_FIELDS + 1 for r in range(c.size)]
    return c.gatherv_u64(local, counts, root=0)
