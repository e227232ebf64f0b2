"""``load``: each rank's own state back from a checkpoint, at any world size.

:func:`load` lets each rank read a balanced share of the data files (any
number of ranks, whatever number wrote them), verifies every piece's
checksum, and exchanges the raw bytes with buffer collectives.

It reads top-down as a sequence of stages, each in its own module
(docs/ARCHITECTURE.md): open -> plan reads -> read -> exchange ->
assemble. Every stage that can fail on some ranks only is followed by one
agreement collective (:mod:`deeppart.agreement`), so a failure anywhere
raises on every rank instead of leaving the others blocked in a
collective.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from deeppart.agreement import agree
from deeppart.comm import Comm, kept_fits, resolve
from deeppart.errors import StateMismatchError
from deeppart.format import Metadata
from deeppart.integrity import HOST_ID_BYTES, host_id, one_host
from deeppart.loading.groups import LoadView, load_view, read_own, selection_digest
from deeppart.loading.reader import (
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
    exchange: str = "auto",
    progress: bool | None = None,
    verbose: bool = False,
    staging_bytes: int | None = None,
    keys: Any = None,
    strict: bool = True,
    group: Any = None,
    per_rank: Any = None,
) -> Any:
    """Loads a committed checkpoint on every rank of ``comm`` (any number of
    ranks, also one process without MPI). Collective.

    ``exchange="bcast"``: each rank reads a balanced share of the data files
    and broadcasts it, each message as soon as its pieces are verified,
    while its read goes on (the storage serves each byte once: right for a
    parallel file system or an object store under many nodes). A load that
    raises may have filled part of ``into=``.
    ``exchange="read"``: every rank reads and checksums every piece itself,
    with no bulk MPI traffic (right when the interconnect is the
    bottleneck, e.g. nodes that reach the store through the same link they
    reach each other by: docs/OBJECT_STORAGE.md).
    ``exchange="auto"`` (default): each data file is read and checksummed
    once, by one rank; on one host (MPI) decompressed into memory that all
    its ranks map (a shared window), from which every rank copies, else
    broadcast from the reader's tensors (``"bcast"``: a compressed piece as
    stored, checked and decoded by every rank); all ranks take the same
    decision. Whatever a rank returns was checksummed where it lies or
    copied from memory where it was (docs/FORMAT.md). The shards of sharded
    state (the checkpoint or ``into=`` holds DTensors): with ``"read"``, and
    with ``"auto"`` on one host when no piece is compressed, each rank reads
    and checksums the stored pieces its shards need itself (the page cache
    serves them); otherwise the load is cooperative (each needed piece read
    by one of the ranks that need it, then sent to the others), so storage
    serves each byte about once, not once per replica.

    With ``into`` (a state of the same structure, e.g. ``model.state_dict()``),
    tensors are filled in place (``copy_`` semantics, no second full copy)
    and the returned tree holds those same tensor objects; plain values are
    written back into ``into``'s dicts and lists (as ``dcp.load`` does; one
    that cannot be, in a tuple or at the root, is only in the returned tree,
    with a :class:`NotInPlaceWarning`). Raises :class:`CheckpointError` (no commit marker,
    missing directory), :class:`CorruptCheckpointError` (bad checksum,
    truncated file, naming the file and piece) or
    :class:`StateMismatchError` (``into`` differs), on every rank.
    ``into`` tensors on a device (e.g. CUDA) are filled through a host
    buffer of ``staging_bytes`` (default 256 MiB), in chunks (from a local
    file: by several reader threads, each chunk checksummed on the host
    and copied on the thread's own stream; docs/GPU.md).

    ``keys``: read only these parts, e.g. ``keys=["model"]`` or
    ``keys=[("optim", "state")]`` (top-level keys or path prefixes): only
    their bytes are read, and the returned tree holds only them.
    ``into`` is matched with the checkpoint by leaf path: with ``strict``
    (default) any missing or extra leaf raises StateMismatchError naming
    them; with ``strict=False`` the common leaves are filled, and
    :func:`last_incompatible_keys` reports the others (as
    ``load_state_dict`` does).

    ``group``: a checkpoint saved with ``group=`` (:mod:`deeppart.loading.groups`):
    a group (a ProcessGroup, or the saved ranks of one group as a list)
    loads that group's tree; ``"auto"`` loads ``into=``'s leaves only. Ranks
    that load different leaves each read their own.

    A checkpoint of each rank's own state (:mod:`deeppart.state.union`: per-rank
    values, pipeline stages, sub-meshes) gives each rank, at the world size
    of the save, exactly the tree it saved. ``per_rank``: what to do with
    paths that hold one version per group of saved ranks where a rank
    cannot get its own (another world size, one process): None raises
    :class:`PerRankStateError` naming them; a saved rank ``r`` takes the
    version ``r`` saved; ``"drop"`` leaves them out (``into=`` keeps its
    values; :func:`last_incompatible_keys` lists them as missing);
    ``"all"`` puts ``{"ranks:0,2": value, ...}`` at the path (no ``into=``);
    a function gets ``(path, {saved ranks: value})`` and returns the value.
    """
    c = resolve(comm)
    t0 = time.perf_counter()
    # Open the checkpoint and plan the reads; every rank checks that all
    # read the same metadata.
    err: BaseException | None = None
    view: LoadView | None = None
    rp: ReadPlan | None = None
    st: ShardTargets | None = None
    digest = b""
    own: OwnView | None = None
    source: CheckpointSource | None = None
    try:
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
            # Narrowed after the agreement below, which compares the hosts.
            same_host=True,
            elsewhere=st.leaves,
            into_elsewhere=st.into_leaves | dropped_into(into, own.dropped + own.deferred, flat),
            flat=flat,
        )
    except BaseException as e:
        err = e
    # The agreement also carries what the exchange needs from every rank
    # (no collective of its own): its host (one host: a shared window) and
    # whether the window kept by the last load holds its share.
    fits = rp is not None and kept_fits(c, window_bytes(rp))
    vote = host_id() + bytes([fits])
    if rp is not None:
        vote += digest + selection_digest(rp)
    rows = agree(c, err, vote, width=HOST_ID_BYTES + 1 + 48)
    assert view is not None and rp is not None and st is not None and source is not None
    at = HOST_ID_BYTES + 1
    if len({row[at : at + 32] for row in rows}) != 1:
        raise StateMismatchError(f"{rp.path}: ranks read different metadata.json files")
    if len({row[at + 32 :] for row in rows}) != 1:
        rp = read_own(rp, c.rank)  # the ranks load different leaves
    same_host = exchange == "bcast" or one_host([row[:HOST_ID_BYTES] for row in rows])
    rp.via_shared = rp.via_shared and same_host
    reuse = all(row[HOST_ID_BYTES] == 1 for row in rows)
    sr = None
    if st.active:
        # From an object store each byte is fetched once per job: the
        # cooperative read (no page cache shares a re-read).
        own_reads = shard_exchange(exchange, rp.meta, same_host and source.rereads_cached)
        sr = plan_shard_reads(c, rp.meta, st, read_own=own_reads)

    # Read this rank's share, then exchange it.
    prog = Progress(
        "load", sum(rp.file_raw[f] for f in rp.mine), enabled=progress if c.rank == 0 else False
    )
    stage = _staging.Staging(staging_bytes)
    nread = 0
    with shared_buffers(c, rp, reuse) as buffers:
        # A broadcast (between hosts, or exchange="bcast") reads and
        # exchanges at once: each reader sends what it has verified while
        # its read goes on. It runs every broadcast even after a local
        # failure (reader.FirstError), so it runs on every rank.
        streamed = not rp.read_all and not buffers.shared
        try:
            if streamed:
                nread = stream_share(c, rp, prog, stage)
            else:
                nread = read_share(rp, buffers, prog, stage)
        except BaseException as e:
            err = e
        try:
            if sr is not None and err is None:
                nread += read_shards(rp.path, rp.meta, sr, prog)
        except BaseException as e:
            err = e
        finally:
            prog.close()
        # Also: every reader has filled (and verified) its shared segment.
        agree(c, err)
        # The exchanges run all their collectives even after a local
        # failure (reader.FirstError), so both run on every rank; then one
        # agreement.
        try:
            if not streamed:
                exchange_share(c, rp, buffers, stage)
        except BaseException as e:
            err = e
        if sr is not None:
            try:
                exchange_shards(c, sr, rp.meta)
            except BaseException as e:
                err = err or e
        # Decoding the plain values and rebuilding the tree can fail too (a
        # value that does not decode), from this rank's own filled targets
        # only: agreed together with the exchange (one agreement after both,
        # which also tells every reader that nobody still copies out of its
        # segment of the window).
        state: Any = None
        assert own is not None
        if err is None:
            try:
                filled = fill_shards(rp.meta, sr) if sr is not None else None
                pruned = keys is not None or own.pruned
                state = assemble(
                    rp.meta, rp.targets, rp.path, rp.matched, pruned, filled, rp.hidden
                )
                if own.calls:
                    state = resolve_versions(state, own.calls, per_rank)
            except BaseException as e:
                err = e
        # With what the load's statistics need from every rank (no collective
        # of their own).
        shared_stats = agree(c, err, _stats_row(time.perf_counter() - t0, nread, sr), width=32)
    elsewhere = c.size != rp.meta.world_size
    if callable(per_rank) and into is not None and rp.meta.versions and elsewhere:
        # Every rank alike: the versions of its deferred paths (a collective
        # load, agreed in itself), then the callable's picks.
        versions = load(
            directory, comm=c, keys=list(own.deferred), per_rank="all", exchange=exchange
        )
        try:
            for p in own.deferred:
                state = set_at(state, p, per_rank(p, by_ranks(value_at(versions, p))))
            write_back(rp.matched.root if rp.matched else None, own.deferred, state)
        except BaseException as e:
            err = e
        agree(c, err)
    if view.unwrap is not None:
        state = state[view.unwrap]
    if rp.matched is not None:
        rp.matched.keys.missing_keys.extend(describe(p) for p in own.dropped)
        _last_keys[:] = [rp.matched.keys]
    stats = _load_stats(c, rp, shared_stats, sr)
    record_stats("load", stats)
    if verbose and c.rank == 0:
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
