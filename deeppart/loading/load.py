"""``load``: each rank's own state back from a checkpoint, at any world size.

:func:`load` lets each rank read a balanced share of the data files (any
number of ranks, whatever number wrote them), verifies every piece's
checksum, and exchanges the raw bytes with buffer collectives.

It reads top-down as a sequence of stages, each a function here driving
its module (docs/ARCHITECTURE.md): open, select this rank's view and plan
the reads (:func:`_open`) -> agree (:func:`_agree_opened`) -> read
(:func:`_read`) -> exchange (:func:`_exchange`) -> assemble
(:func:`_assemble`, :func:`_pick_deferred`) -> report (:func:`_report`);
:class:`_Load` carries what they share. Every stage that can fail on
some ranks only is followed by one agreement collective
(:mod:`deeppart.agreement`), so a failure anywhere raises on every rank
instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from deeppart.agreement import agree
from deeppart.comm import Comm, kept_fits, resolve
from deeppart.errors import StateMismatchError
from deeppart.format import Metadata
from deeppart.integrity import HOST_ID_BYTES, host_id, one_host
from deeppart.loading.groups import LoadView, load_view, read_own, selection_digest
from deeppart.loading.reader import (
    ReadBuffers,
    ReadPlan,
    assemble,
    exchange_share,
    open_checkpoint,
    plan_reads,
    read_share,
    shared_buffers,
    stream_share,
    window_bytes,
)
from deeppart.loading.reshard import (
    ShardReads,
    ShardTargets,
    exchange_shards,
    fill_shards,
    plan_shard_reads,
    read_shards,
    shard_targets,
)
from deeppart.options import LoadOptions, fold, reject_unknown
from deeppart.progress import Progress, Stats, record_stats
from deeppart.state import staging as _staging
from deeppart.state.own_view import OwnView, by_ranks, own_view, resolve_versions, set_at, value_at
from deeppart.state.restore import IncompatibleKeys, describe
from deeppart.state.state import Flat, flatten
from deeppart.storage.source import CheckpointSource, checkpoint_source
from deeppart.storage.url import parse_location

__all__ = ["last_incompatible_keys", "load"]

_last_keys: list[IncompatibleKeys] = []


def last_incompatible_keys() -> IncompatibleKeys | None:
    """The missing and unexpected keys of this process's latest
    ``load(into=...)`` (empty lists when everything matched), like the
    value of ``torch.nn.Module.load_state_dict``; None before any."""
    return _last_keys[-1] if _last_keys else None


def load(
    directory: str | os.PathLike[str],
    *,
    comm: Any = None,
    into: Any = None,
    keys: Any = None,
    strict: bool = True,
    group: Any = None,
    per_rank: Any = None,
    progress: bool | None = None,
    verbose: bool = False,
    loading: LoadOptions | None = None,
    **deprecated: Any,
) -> Any:
    """Loads a committed checkpoint on every rank of ``comm`` (any number of
    ranks, whatever number saved it; also one process without MPI) and
    returns this rank's tree. Collective.

    ``into``: a state of the same structure (e.g. ``model.state_dict()``):
    its tensors filled in place, its plain values written back where they
    can be (else a :class:`NotInPlaceWarning`); a load that raises may have
    filled part of it. ``keys``: only these parts (top-level keys or path
    prefixes) are read and returned. ``strict``: an ``into`` leaf missing
    on either side raises, else :func:`last_incompatible_keys` lists it
    (docs/FORMAT.md "Partial restore"). ``group``: a group's tree of a
    checkpoint saved with ``group=``; ``"auto"``: ``into``'s leaves only.
    ``per_rank``: the paths saved in one version per group of ranks, where
    a rank cannot get its own (another world size): None raises
    :class:`PerRankStateError`, a saved rank ``r`` takes its version,
    ``"drop"`` leaves them out, ``"all"`` returns every version, a function
    ``(path, {saved ranks: value})`` picks (docs/SHARDED.md). ``loading``:
    a :class:`deeppart.LoadOptions` (how the bytes are read and shared, the
    staging buffer of device tensors; the old ``exchange=`` and
    ``staging_bytes=`` work for one release, with a DeprecationWarning).
    Raises :class:`CheckpointError` (no commit marker),
    :class:`CorruptCheckpointError` (naming the file and piece) or
    :class:`StateMismatchError` (``into`` differs) on every rank.
    ``verbose``: rank 0 prints the load's :class:`Stats`.
    """
    loading = fold("deeppart.load", "loading", LoadOptions, loading, deprecated)
    reject_unknown("deeppart.load()", deprecated)
    exchange = loading.exchange
    c = resolve(comm)
    t0 = time.perf_counter()
    # Open, select this rank's view, plan the reads; then the first agreement.
    opened: _Load | None = None
    err: BaseException | None = None
    try:
        opened = _open(c, directory, into, keys, strict, exchange, group, per_rank)
    except BaseException as e:
        err = e
    run = _agree_opened(c, opened, err, exchange)
    prog = Progress("load", run.share_bytes(), enabled=progress if c.rank == 0 else False)
    stage = _staging.Staging(loading.staging_bytes)
    with shared_buffers(c, run.rp, run.reuse) as buffers:
        # A broadcast (between hosts, or exchange="bcast") reads and
        # exchanges at once (stream_share).
        streamed = not run.rp.read_all and not buffers.shared
        nread, err = _read(run, buffers, streamed, prog, stage)
        # Also: every reader has filled (and verified) its shared segment.
        agree(c, err)
        err = _exchange(run, buffers, streamed, stage)
        state: Any = None
        if err is None:
            state, err = _assemble(run, per_rank)
        # One agreement after the exchange and the assembly (which also tells
        # every reader that nobody still copies out of its segment), with
        # what the load's statistics need from every rank.
        shared_stats = agree(c, err, _stats_row(time.perf_counter() - t0, nread, run.sr), width=32)
    if run.picks_deferred(per_rank):
        state = _pick_deferred(run, directory, state, per_rank, exchange)
    return _report(run, state, shared_stats, verbose)


@dataclass
class _Load:
    """What the stages of one :func:`load` share on this rank, from the
    open stage on (``sr`` and ``reuse`` set by the first agreement)."""

    c: Comm
    #: ``group=`` as a selection: the ``into=`` and ``keys=`` the load uses.
    view: LoadView
    source: CheckpointSource
    #: The metadata's digest, compared between the ranks.
    digest: bytes
    own: OwnView
    st: ShardTargets
    rp: ReadPlan
    sr: ShardReads | None = None
    #: Every rank's segment of the window kept by the last load holds its share.
    reuse: bool = False

    def picks_deferred(self, per_rank: Any) -> bool:
        """Whether a callable ``per_rank`` picks the versions of this rank's
        deferred paths (with ``into=``, at another world size than the
        save's): what follows is collective, so every rank must agree."""
        return (
            callable(per_rank)
            and self.view.into is not None
            and bool(self.rp.meta.versions)
            and self.c.size != self.rp.meta.world_size
        )

    def share_bytes(self) -> int:
        """The raw bytes of the data files this rank reads."""
        return sum(self.rp.file_raw[f] for f in self.rp.mine)


def _open(
    c: Comm,
    directory: str | os.PathLike[str],
    into: Any,
    keys: Any,
    strict: bool,
    exchange: str,
    group: Any,
    per_rank: Any,
) -> _Load:
    """Open -> select/view -> plan reads, on this rank alone (no
    collective): ``group=`` as a selection, the checked metadata, this
    rank's own view of it, the shard targets and the read plan."""
    view = load_view(group, into, keys, c.rank)
    into, keys = view.into, view.keys
    source = checkpoint_source(parse_location(directory))
    path, meta, digest = open_checkpoint(source)
    # into='s leaves, once for every stage that matches them.
    flat = flatten(into) if into is not None else None
    own = own_view(
        meta, c.rank, c.size, per_rank, into, held_only=group is None, flat=flat, keys=keys
    )
    meta = own.meta
    st = shard_targets(meta, into, keys, strict, flat)
    rp = plan_reads(
        c,
        path,
        meta,
        into=into,
        keys=keys,
        strict=strict,
        exchange=exchange,
        # Narrowed after the first agreement, which compares the hosts.
        same_host=True,
        elsewhere=st.leaves,
        into_elsewhere=st.into_leaves | dropped_into(into, own.dropped + own.deferred, flat),
        flat=flat,
    )
    return _Load(c, view, source, digest, own, st, rp)


def _agree_opened(c: Comm, opened: _Load | None, err: BaseException | None, exchange: str) -> _Load:
    """The first agreement (every rank): a failure to open anywhere raises
    on every rank, and every rank checks that all read the same metadata.
    It also carries what the exchange needs from every rank (no collective
    of its own): its host (one host: a shared window) and whether the
    window kept by the last load holds its share. Then the shard reads are
    planned (a collective, on every rank alike)."""
    fits = opened is not None and kept_fits(c, window_bytes(opened.rp))
    vote = host_id() + bytes([fits])
    if opened is not None:
        vote += opened.digest + selection_digest(opened.rp)
    rows = agree(c, err, vote, width=HOST_ID_BYTES + 1 + 48)
    assert opened is not None
    run = opened
    at = HOST_ID_BYTES + 1
    if len({row[at : at + 32] for row in rows}) != 1:
        raise StateMismatchError(f"{run.rp.path}: ranks read different metadata.json files")
    if len({row[at + 32 :] for row in rows}) != 1:
        run.rp = read_own(run.rp, c.rank)  # the ranks load different leaves
    same_host = exchange == "bcast" or one_host([row[:HOST_ID_BYTES] for row in rows])
    run.rp.via_shared = run.rp.via_shared and same_host
    run.reuse = all(row[HOST_ID_BYTES] == 1 for row in rows)
    if run.st.active:
        # From an object store each byte is fetched once per job: the
        # cooperative read (no page cache shares a re-read).
        own_reads = shard_exchange(exchange, run.rp.meta, same_host and run.source.rereads_cached)
        run.sr = plan_shard_reads(c, run.rp.meta, run.st, read_own=own_reads)
    return run


def _read(
    run: _Load, buffers: ReadBuffers, streamed: bool, prog: Progress, stage: _staging.Staging
) -> tuple[int, BaseException | None]:
    """This rank's share of the data files, then the stored shard pieces
    it reads: the bytes read from storage, and the stage's error (kept for
    the agreement that follows). A streamed read broadcasts as it goes and
    runs every broadcast even after a local failure (reader.FirstError), so
    it runs on every rank."""
    nread = 0
    err: BaseException | None = None
    try:
        if streamed:
            nread = stream_share(run.c, run.rp, prog, stage)
        else:
            nread = read_share(run.rp, buffers, prog, stage)
    except BaseException as e:
        err = e
    try:
        if run.sr is not None and err is None:
            nread += read_shards(run.rp.path, run.rp.meta, run.sr, prog)
    except BaseException as e:
        err = e
    finally:
        prog.close()
    return nread, err


def _exchange(
    run: _Load, buffers: ReadBuffers, streamed: bool, stage: _staging.Staging
) -> BaseException | None:
    """The plain leaves' exchange (unless the read streamed it), then the
    shards'; both run all their collectives even after a local failure
    (reader.FirstError), so both run on every rank. The first error."""
    err: BaseException | None = None
    try:
        if not streamed:
            exchange_share(run.c, run.rp, buffers, stage)
    except BaseException as e:
        err = e
    if run.sr is not None:
        try:
            exchange_shards(run.c, run.sr, run.rp.meta)
        except BaseException as e:
            err = err or e
    return err


def _assemble(run: _Load, per_rank: Any) -> tuple[Any, BaseException | None]:
    """The shards copied into their targets, the plain values decoded, the
    tree rebuilt and this rank's versions resolved, from this rank's own
    filled targets only (no collective): the tree, or the error (a value
    that does not decode), agreed together with the exchange's."""
    try:
        filled = fill_shards(run.rp.meta, run.sr) if run.sr is not None else None
        pruned = run.view.keys is not None or run.own.pruned
        rp = run.rp
        state = assemble(rp.meta, rp.targets, rp.path, rp.matched, pruned, filled, rp.hidden)
        if run.own.calls:
            state = resolve_versions(state, run.own.calls, per_rank)
    except BaseException as e:
        return None, e
    return state, None


def _pick_deferred(
    run: _Load, directory: str | os.PathLike[str], state: Any, per_rank: Any, exchange: str
) -> Any:
    """A callable ``per_rank`` at another world size, every rank alike: the
    versions of this rank's deferred paths (a collective load, agreed in
    itself), then the callable's picks set in ``state`` and written back
    into ``into=``, then one agreement."""
    err: BaseException | None = None
    deferred = run.own.deferred
    versions = load(
        directory, comm=run.c, keys=list(deferred), per_rank="all", loading=LoadOptions(exchange)
    )
    try:
        for p in deferred:
            state = set_at(state, p, per_rank(p, by_ranks(value_at(versions, p))))
        write_back(run.rp.matched.root if run.rp.matched else None, deferred, state)
    except BaseException as e:
        err = e
    agree(run.c, err)
    return state


def _report(run: _Load, state: Any, shared_stats: list[bytes], verbose: bool) -> Any:
    """The tree unwrapped from its group, the incompatible keys kept for
    :func:`last_incompatible_keys`, the load's :class:`Stats` recorded (and
    printed by rank 0 when ``verbose``); returns the tree."""
    if run.view.unwrap is not None:
        state = state[run.view.unwrap]
    if run.rp.matched is not None:
        run.rp.matched.keys.missing_keys.extend(describe(p) for p in run.own.dropped)
        _last_keys[:] = [run.rp.matched.keys]
    stats = _load_stats(run.c, run.rp, shared_stats, run.sr)
    record_stats("load", stats)
    if verbose and run.c.rank == 0:
        print(stats.summary(), flush=True)
    return state


def shard_exchange(exchange: str, meta: Metadata, one_host: bool) -> bool:
    """Whether each rank reads the stored shard pieces it needs itself (no
    exchange): with ``"read"``, and with ``"auto"`` when every rank runs on
    one host and no piece is compressed (the rule of the plain leaves: the
    page cache serves a piece to each of its readers faster than a send
    between processes; measured in bench/dtensor.py). Otherwise each needed
    piece is read by one of the ranks that need it and sent to the others."""
    if exchange == "auto":
        return one_host and all(p.codec == "none" for p in meta.pieces)
    return exchange == "read"


def write_back(root: Any, paths: list[tuple[Any, ...]], state: Any) -> None:
    """The values at ``paths`` of ``state`` set in ``root`` (the caller's
    ``into=``) in place where they can be."""
    from deeppart.state.restore import write_back as set_values

    if root is not None and paths:
        set_values(root, paths, {j: value_at(state, p) for j, p in enumerate(paths)})


def dropped_into(into: Any, dropped: list[tuple[Any, ...]], flat: Flat | None = None) -> set[int]:
    """The ``into=`` leaves (indices of its flattened leaves) under the
    paths that ``per_rank="drop"`` leaves out: neither read nor missing.
    ``flat``: ``flatten(into)``, when the caller has it already."""
    if into is None or not dropped:
        return set()
    gone = set(dropped)
    leaves = (flat if flat is not None else flatten(into))[0]
    return {
        j for j, lf in enumerate(leaves)
        if any(tuple(lf.path[:n]) in gone for n in range(1, len(lf.path) + 1))
    }  # fmt: skip


def _stats_row(seconds: float, nread: int, sr: ShardReads | None) -> bytes:
    """What each rank contributes to the load's :class:`Stats` (32 bytes)."""
    shard = [float(sr.read_raw), float(sr.received)] if sr is not None else [0.0, 0.0]
    return np.array([seconds, float(nread), *shard], dtype=np.float64).tobytes()


def _load_stats(c: Comm, rp: ReadPlan, rows: list[bytes], sr: ShardReads | None = None) -> Stats:
    """The load's Stats from every rank's :func:`_stats_row` (the same on
    every rank); ``stored_bytes`` is what all ranks read from storage
    together, ``seconds`` each rank's time up to the load's last agreement."""
    table = np.frombuffer(b"".join(rows), dtype=np.float64).reshape(len(rows), 4)
    meta: Metadata = rp.meta
    return Stats(
        op="load",
        directory=str(rp.path),
        world_size=c.size,
        raw_bytes=sum(rp.file_raw) + (sr.raw_bytes(rp.meta) if sr is not None else 0),
        stored_bytes=int(table[:, 1].sum()),
        seconds=float(table[:, 0].max()),
        rank_seconds=[float(x) for x in table[:, 0]],
        codec=str(meta.raw.get("compression", "none")),
        rank_shard_read=[int(x) for x in table[:, 2]] if sr is not None else [],
        rank_received=[int(x) for x in table[:, 3]] if sr is not None else [],
    )
