"""Restoring a step of the built-in level engine: what survives, which
level serves each rank, getting every rank's data file back, restoring
the lost redundancy, and handing the files to the reader stage.

:meth:`deeppart.levels.engine.BuiltinBackend.load` tries the committed
steps newest first; for one step it calls, in this order (every function
is collective over the job's communicator):

1. :func:`read_step`: the step's metadata, the same on every rank, and
   whether it was written by this layout (else only L4 can serve it,
   through :func:`load_global`);
2. :func:`survey`: which files survive on each node (verified against their
   checksums), and :func:`decide`: the level that serves each rank's data
   (L1 own file, L2 partner copy, L3 parity decoding, L4 global);
3. :func:`recover_own`: every rank gets its own data file back (from the
   partner, :func:`deeppart.levels.partner.hand_back`, or by decoding the
   group, :func:`deeppart.levels.erasure.decode`), verifies it and rewrites
   the lost L1 file;
4. :func:`restore_redundancy`: the partner copies and parity shards lost
   with a node are made again;
5. :func:`distribute`: every rank broadcasts its file and places the pieces
   of its own view (:func:`own_targets`: its versions of per-rank values,
   the items it held) with the reader stage's
   :func:`~deeppart.loading.reader.read_pieces`.

:meth:`~deeppart.levels.engine.BuiltinBackend.latest` uses steps 1 and 2
with sizes only (no reads).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deeppart.agreement import agree, from_root
from deeppart.comm import Comm
from deeppart.errors import CheckpointError, CorruptCheckpointError, UnrecoverableError
from deeppart.format import HEADER_SIZE, Metadata, Piece, checksum, data_file_name
from deeppart.levels import erasure, files, partner
from deeppart.levels.backend import RecoveryReport
from deeppart.levels.files import EMPTY, U8, BufReader, by_rank, file_ok
from deeppart.levels.layout import Layout, parity_file, partner_file
from deeppart.loading.load import load
from deeppart.loading.reader import (
    IntoMatch,
    Target,
    leaf_targets,
    meta_leaf_paths,
    open_checkpoint,
    read_metadata,
    read_pieces,
)
from deeppart.loading.reshard import (
    ShardTargets,
    exchange_shards,
    fill_shards,
    plan_shard_reads,
    read_held_shards,
    shard_targets,
)
from deeppart.options import LoadOptions
from deeppart.progress import Progress
from deeppart.state.own_view import own_view
from deeppart.state.state import flatten
from deeppart.steps import lineage
from deeppart.storage.files import read_all, size_is
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import Location

# Status bits a rank reports for a step during recovery.
OWN, COPY, PARITY, GLOBAL = 1, 2, 4, 8


@dataclass
class Step:
    """A step's metadata as recovery sees it."""

    step: int
    meta: Metadata
    level: int
    layout: dict[str, Any]
    stripe: int
    parity_sizes: list[int]
    parity_xxh3: list[int]
    #: Written by another world size or node layout: served from what the
    #: survivors hold (:mod:`deeppart.levels.peers`), resharded.
    foreign: bool = False


@dataclass
class Survey:
    """What survives of a step, agreed on every rank."""

    #: Per rank, the level serving its data (empty: the step is lost).
    levels: list[int] = field(default_factory=list)
    #: Why the step is lost.
    reason: str = ""
    #: Per rank, the OWN/COPY/PARITY/GLOBAL bits of what its node holds.
    status: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Move:
    """A file one rank sends another during the survey."""

    src: int
    dst: int
    key: str  # "own", "copy" or "parity": what it is to the receiver
    name: str
    size: int


#: The node-local level files' name prefixes.
_KINDS = ("rank-", "partner-", "parity-")


@dataclass
class Recovered:
    """This rank's part of :func:`recover_own`."""

    #: This rank's verified data file (None when ``failure``).
    own: U8 | None
    #: The L1 file this rank rewrote, or "".
    rewritten: str
    #: Why the step cannot be restored (the same on every rank), or "".
    failure: str
    #: CPU seconds and data bytes of Reed-Solomon decoding on this rank.
    decode_seconds: float = 0.0
    decode_bytes: int = 0


def committed_at(where: Location) -> bool:
    """Whether a committed checkpoint is at ``where`` (a directory, or an
    object store URL: its marker and the metadata it names match); False
    if it cannot be read."""
    return checkpoint_source(where).is_committed()


def global_ok(comm: Comm, layout: Layout, step: int) -> bool:
    """Whether ``step`` has a committed L4 checkpoint (collective: rank 0
    looks, in ``glbl_dir`` or its object store, and every rank gets its
    answer, so that every rank takes the same way)."""
    ok = comm.rank == 0 and layout.has_global() and committed_at(layout.global_step(step))
    return comm.allgather_varbytes(b"\1" if ok else b"")[0] == b"\1"


def global_file(where: Location, rank: int, size: int, deep: bool) -> tuple[bool, U8 | None]:
    """Rank ``rank``'s data file in the committed L4 checkpoint at
    ``where`` (a directory or an object store URL): whether it is there
    with ``size`` bytes, and when ``deep`` its bytes (None if they cannot
    be read; the caller verifies them)."""
    return checkpoint_source(where).committed_file(data_file_name(rank), size, deep=deep)


def candidates(comm: Comm, layout: Layout, step: int | None) -> list[int]:
    """The steps to try, newest first: ``step``, else the live line's
    committed steps (:mod:`deeppart.steps.lineage`; the same list on every rank,
    else every rank raises)."""
    if step is not None:
        return [step]
    # Every rank must try the same steps: each checks that ``meta_dir``
    # shows it the same line (a ``meta_dir`` that is not shared would
    # not), and rank 0 alone reads both roots' line records, so that an
    # object store in ``glbl_dir`` is listed once per load, not once per
    # rank; its error (a store that does not answer) reaches every rank.
    meta_line = json.dumps(lineage.scan(layout.config.meta_root()).steps()).encode()
    seen = comm.allgather_bytes(hashlib.sha256(meta_line).digest(), 32)
    if len(set(seen)) != 1:
        raise CheckpointError(f"{layout.config.meta_root()}: ranks see different checkpoints")
    steps = json.loads(from_root(comm, lambda: json.dumps(layout.lines().steps()).encode()))
    return [int(s) for s in steps[::-1]]


def read_step(comm: Comm, layout: Layout, step: int) -> tuple[Step | None, str]:
    """The step's node-local metadata (collective), or None and why. A
    step written by another world size or node layout comes back with
    ``foreign`` set, and the difference as the second value."""
    err: BaseException | None = None
    meta: Metadata | None = None
    digest = b""
    where = layout.meta_step(step)
    try:
        meta, digest = read_metadata(where)
    except CheckpointError as e:
        err = e
    bad = comm.allgather_bytes(b"\1" if err else b"\0", 1)
    if any(b != b"\0" for b in bad):
        return None, f"no node-local checkpoint ({err})" if err else "no node-local checkpoint"
    digests = comm.allgather_bytes(digest, 32)
    if len(set(digests)) != 1:
        raise CheckpointError(f"{where}: ranks read different metadata")
    assert meta is not None
    lv = meta.raw.get("levels")
    if not isinstance(lv, dict):
        return None, "metadata has no levels section"
    try:
        st = Step(
            step,
            meta,
            int(lv["level"]),
            {k: lv[k] for k in ("node_size", "group_size", "nodes")},
            int(lv["stripe_bytes"]),
            [int(x) for x in lv["parity_sizes"]],
            [int(x) for x in lv["parity_xxh3"]],
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{where}: bad levels section: {e}") from e
    if st.layout != layout.describe() or meta.world_size != comm.size:
        st.foreign = True
        return st, (
            f"written by {meta.world_size} ranks as nodes {st.layout['nodes']} "
            f"(node_size {st.layout['node_size']}, group_size {st.layout['group_size']}), "
            f"this job is {comm.size} ranks as nodes {layout.describe()['nodes']}"
        )
    return st, ""


def listing(directory: Path) -> dict[str, int]:
    """The level files in a node-local step directory: name -> size."""
    out: dict[str, int] = {}
    try:
        with os.scandir(directory) as it:
            for e in it:
                if e.name.endswith(".bin") and e.name.startswith(_KINDS) and e.is_file():
                    out[e.name] = e.stat().st_size
    except OSError:
        pass
    return out


def wanted(layout: Layout, st: Step, rank: int) -> dict[str, tuple[str, int]]:
    """What ``rank`` must hold for ``st``: key -> (file name, size): its
    own data file, its predecessor's partner copy (L2), its parity shard (L3)."""
    sizes = st.meta.file_sizes
    out = {"own": (data_file_name(rank), sizes[rank])}
    if st.level == 2:
        src = layout.pred(rank)
        out["copy"] = (partner_file(src), sizes[src])
    if st.level == 3:
        out["parity"] = (parity_file(rank), st.parity_sizes[rank])
    return out


def find_moves(layout: Layout, st: Step, rows: list[dict[str, int]]) -> list[Move]:
    """The files a rank needs that its node does not hold but another node
    does (nodes reordered or partly replaced since the save): from which
    rank to which, in one order every rank computes alike. ``rows``: every
    rank's :func:`listing`. Senders are spread (fewest sends first)."""
    moves: list[Move] = []
    sends = [0] * len(rows)
    for q in range(len(rows)):
        for key, (name, size) in wanted(layout, st, q).items():
            if rows[q].get(name) == size:
                continue
            holders = [s for s in range(len(rows)) if rows[s].get(name) == size]
            if holders:
                src = min(holders, key=lambda s: (sends[s], s))
                sends[src] += 1
                moves.append(Move(src, q, key, name, size))
    return moves


def fetch(comm: Comm, local: Path, moves: list[Move]) -> dict[str, U8]:
    """Carries out ``moves`` (collective: each is one transfer between its
    two ranks, in the list's order, so none waits on another): this rank
    sends what it holds, and returns what it received, by key. A file that
    cannot be read is sent as zeros (its checksums then fail)."""
    got: dict[str, U8] = {}
    r = comm.rank
    for m in moves:
        if r == m.src:
            data = read_all(local / m.name, m.size)
            send = data if data is not None else np.zeros(m.size, dtype=np.uint8)
            comm.sendrecv_u8(send, m.dst, EMPTY, m.dst)
        elif r == m.dst:
            buf = np.empty(m.size, dtype=np.uint8)
            comm.sendrecv_u8(EMPTY, m.src, buf, m.src)
            got[m.key] = buf
    return got


def store(path: Path, buf: U8) -> str:
    """Writes a file received from another node where this node keeps it
    (temporary name, fsync, rename); returns the path, or "" on failure
    (recovery does not need the file on disk)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        files.replace_file(path, [buf])
    except OSError:
        return ""
    return str(path)


def survey(
    comm: Comm, layout: Layout, st: Step, deep: bool
) -> tuple[Survey, dict[str, U8 | None], list[str]]:
    """Which files survive, agreed on every rank; and the per-rank level
    serving each rank's data. Every rank lists its node's step directory
    and the lists are exchanged, so a file is found on whichever node holds
    it (the nodes may have been reordered or partly replaced since the
    save): a file a rank needs from another node is sent to it
    (:func:`find_moves`, :func:`fetch`) and stored on its node. When
    ``deep`` every file is read and verified, else only sizes are checked
    (and nothing moves). Also returns the files this rank holds in memory
    (``own``, ``copy``, ``parity``, ``global``) and the paths it stored."""
    r = comm.rank
    meta = st.meta
    local = layout.local_step(st.step, r)
    pieces = by_rank(meta)
    rows = [json.loads(b) for b in comm.allgather_varbytes(json.dumps(listing(local)).encode())]
    moves = find_moves(layout, st, rows)
    incoming = {m.key for m in moves if m.dst == r}
    received = fetch(comm, local, moves) if deep else {}
    bits = 0
    held: dict[str, U8 | None] = {}
    moved: list[str] = []

    def probe(key: str, path: Path, size: int, verify: Callable[[U8 | None], bool]) -> bool:
        if key in incoming:
            if not deep:
                return True
            buf = received[key]
            if not verify(buf):
                return False
            held[key] = buf
            if stored := store(path, buf):
                moved.append(stored)
            return True
        if not deep:
            return size_is(path, size)
        held[key] = read_all(path, size)
        return verify(held[key])

    def data_ok(rank: int) -> Callable[[U8 | None], bool]:
        return lambda buf: file_ok(buf, meta, rank, pieces[rank])

    need = wanted(layout, st, r)
    name, size = need["own"]
    if probe("own", local / name, size, data_ok(r)):
        bits |= OWN
    if st.level == 2:
        name, size = need["copy"]
        if probe("copy", local / name, size, data_ok(layout.pred(r))):
            bits |= COPY
    if st.level == 3:
        name, size = need["parity"]
        if probe(
            "parity",
            local / name,
            size,
            lambda buf: buf is not None and checksum(buf.data) == st.parity_xxh3[r],
        ):
            bits |= PARITY
    if st.level == 4 and not bits & OWN and layout.has_global():
        # The L4 copy of this rank's file, in glbl_dir or its object store.
        found, buf = global_file(layout.global_step(st.step), r, meta.file_sizes[r], deep)
        if deep:
            held["global"] = buf
        if found and (not deep or data_ok(r)(buf)):
            bits |= GLOBAL
    status = [row[0] for row in comm.allgather_bytes(bytes([bits]), 1)]
    return decide(layout, st, status), held, moved


def decide(layout: Layout, st: Step, status: list[int]) -> Survey:
    """The level serving each rank's data, from every rank's status bits:
    its own file (L1), else its partner's copy (L2), else its group's
    decoding when at least ``group_size`` of the group's files survive
    (L3), else the global checkpoint (L4)."""
    n = layout.size
    levels = [0] * n
    for r in range(n):
        if status[r] & OWN:
            levels[r] = 1
        elif st.level == 2 and status[layout.partner(r)] & COPY:
            levels[r] = 2
        elif st.level == 4 and status[r] & GLOBAL:
            levels[r] = 4
    if st.level == 3:
        for r in range(n):
            if levels[r]:
                continue
            group = layout.group(r)
            alive = sum(1 for m in group if status[m] & OWN)
            alive += sum(1 for m in group if status[m] & PARITY)
            if alive >= len(group):
                levels[r] = 3
    lost = [r for r in range(n) if not levels[r]]
    if lost:
        return Survey(
            [],
            f"the data of rank(s) {lost} is lost at every level the step has "
            f"(L{st.level} checkpoint)",
            status,
        )
    return Survey(levels, "", status)


def recover_own(
    comm: Comm, layout: Layout, st: Step, levels: list[int], held: dict[str, U8 | None]
) -> Recovered:
    """Every rank gets its own data file back from the level serving it
    (``levels``, from :func:`decide`; ``held``: the files :func:`survey`
    read), verifies it and rewrites a lost L1 file. A rank whose file fails
    its checksums makes the step fail on every rank (``failure``)."""
    r = comm.rank
    own = held.get("own") if levels[r] == 1 else None
    seconds, decoded = 0.0, 0
    # L2: every rank hands the copy it holds back to its source.
    if st.level == 2 and any(lv == 2 for lv in levels):
        copy = partner.hand_back(comm, layout, levels, held.get("copy"), st.meta.file_sizes[r])
        if levels[r] == 2:
            own = copy
    if st.level == 3 and any(lv == 3 for lv in levels):
        group = layout.group(r)
        if any(levels[m] == 3 for m in group):
            status_own = [levels[m] == 1 for m in group]
            parity = held.get("parity")
            p_ok = parity is not None and checksum(parity.data) == st.parity_xxh3[r]
            rows = comm.allgather_bytes(b"\1" if p_ok else b"\0", 1)
            parity_alive = [rows[m] == b"\1" for m in group]
            lost = [levels[m] == 3 for m in group]
            restored, seconds, decoded = erasure.decode(
                comm,
                group,
                st.meta.file_sizes,
                st.stripe,
                own,
                parity if p_ok else None,
                status_own,
                parity_alive,
                lost,
            )
            if levels[r] == 3:
                own = restored
        else:
            comm.allgather_bytes(b"\0", 1)
    if levels[r] == 4:
        own = held.get("global")
    # Verify what came from another level; rewrite the lost L1 file.
    err: UnrecoverableError | None = None
    rewritten = ""
    try:
        pieces = by_rank(st.meta)
        if not file_ok(own, st.meta, r, pieces[r]):
            raise UnrecoverableError(
                f"rank {r}: the L{levels[r]} copy of its data fails its checksums"
            )
        assert own is not None
        if levels[r] != 1:
            local = layout.local_step(st.step, r)
            local.mkdir(parents=True, exist_ok=True)
            final = local / data_file_name(r)
            files.replace_file(final, [own])
            rewritten = str(final)
    except UnrecoverableError as e:
        err = e
    except OSError:
        pass  # recovery still works; the file stays lost
    failure = ""
    bad = comm.allgather_bytes(b"\1" if err is not None else b"\0", 1)
    if any(b != b"\0" for b in bad):
        msgs = comm.allgather_varbytes(str(err).encode() if err else b"")
        failure = "; ".join(m.decode() for m in msgs if m)
    return Recovered(own, rewritten, failure, seconds, decoded)


def restore_redundancy(
    comm: Comm, layout: Layout, st: Step, own: U8, status: list[int]
) -> list[str]:
    """After recovery every rank holds its verified file (``own``): the
    partner copies (L2) and parity shards (L3) that were lost with a
    node are made again, so the step survives the next loss too.
    Collective (L2: the group ring; L3: each group that lost a shard).
    Returns the paths this rank rewrote. A write that fails leaves that
    redundancy missing; recovery itself still succeeds."""
    r = comm.rank
    local = layout.local_step(st.step, r)
    if st.level == 2:
        need = [not status[q] & COPY for q in range(comm.size)]
        if not any(need):
            return []
        return partner.restore_copy(comm, layout, local, own, need, st.meta.file_sizes)
    if st.level == 3:
        group = layout.group(r)
        if all(status[m] & PARITY for m in group):
            return []
        return erasure.restore_parity(
            comm,
            group,
            local,
            own,
            st.meta.file_sizes,
            st.stripe,
            have=bool(status[r] & PARITY),
            expected=(st.parity_sizes[r], st.parity_xxh3[r]),
        )
    return []


@dataclass
class OwnTargets:
    """What a rank of the saving job reads of a step (:func:`own_targets`)."""

    #: The rank's view of the step's metadata (its own version of each
    #: per-rank path; the items it did not hold left out, ``meta.skip``).
    meta: Metadata
    #: Per leaf of ``meta``: where its bytes go, None where it is not read
    #: (the DTensor shard leaves are ``shards``').
    targets: list[Target | None]
    matched: IntoMatch | None
    #: Whether leaves were left out (the tree is rebuilt without them).
    pruned: bool
    #: The regions of the sharded tensors (DTensors) this rank fills.
    shards: ShardTargets


def own_targets(
    meta: Metadata, rank: int, world: int, into: Any, shards: bool = False, per_rank: Any = None
) -> OwnTargets:
    """This rank's view of a step saved through the levels by ``world``
    ranks, as :func:`deeppart.load` gives it at the save's world size
    (:func:`deeppart.state.own_view.own_view`): each rank gets back its own
    version of the paths whose values differed between the ranks (a loader
    position, a per-rank RNG state), and the items it held; the targets of
    the plain leaves it reads (``into``: matched by path) and the regions of
    the sharded tensors it fills (``into``'s DTensors: their local shards,
    of whatever mesh; without ``into``: full tensors), as
    :func:`deeppart.load` finds them (:func:`~deeppart.loading.reshard.shard_targets`;
    only with ``shards``, for a caller that places them with
    :func:`distribute_shards`: the built-in engine; without, every leaf is a
    plain one, as for the FTI backend, which stores no DTensor). At
    another world size (a recovery from the survivors, resharded),
    ``per_rank`` decides the per-rank values as for :func:`deeppart.load`. Checks
    ``into`` before any I/O; the same metadata gives every rank of one
    world size the same decisions, so errors are raised alike."""
    flat = flatten(into) if into is not None else None
    view = own_view(meta, rank, world, per_rank, into, flat=flat)
    mine = view.meta
    sharded = shard_targets(mine, into, None, True, flat) if shards else ShardTargets()
    chosen = [
        [] if i in mine.skip or i in sharded.leaves else ps
        for i, ps in enumerate(meta_leaf_paths(mine))
    ]
    targets, matched = leaf_targets(
        mine, into, chosen, into_elsewhere=sharded.into_leaves, flat=flat
    )
    return OwnTargets(mine, targets, matched, view.pruned, sharded)


def _plain_pieces(meta: Metadata, shard_leaves: set[int]) -> list[dict[int, Piece]]:
    """Per data file, its pieces of the plain leaves (not DTensor shards),
    by ``id`` of the metadata's piece, each with its offset in the compact
    copy :func:`distribute` broadcasts (the file's header, then these
    pieces' stored bytes in file order): the same on every rank."""
    out: list[dict[int, Piece]] = []
    for ps in by_rank(meta):
        at = HEADER_SIZE
        moved: dict[int, Piece] = {}
        for p in sorted(ps, key=lambda p: p.offset):
            if p.leaf in shard_leaves:
                continue
            moved[id(p)] = dataclasses.replace(p, offset=at)
            at += p.stored
        out.append(moved)
    return out


def _compact(own: U8, plain: dict[int, Piece], originals: list[Piece]) -> U8:
    """This rank's file as :func:`distribute` broadcasts it: its header and
    the stored bytes of its plain pieces (``plain``, from ``originals``)."""
    if len(plain) == len(originals) and all(plain[id(p)].offset == p.offset for p in originals):
        return own  # the file is its plain pieces, packed
    size = HEADER_SIZE + sum(p.stored for p in plain.values())
    buf = np.empty(size, dtype=np.uint8)
    buf[:HEADER_SIZE] = own[:HEADER_SIZE]
    for p in originals:
        q = plain.get(id(p))
        if q is not None:
            buf[q.offset : q.offset + p.stored] = own[p.offset : p.offset + p.stored]
    return buf


def distribute(
    comm: Comm,
    meta: Metadata,
    where: Path,
    own: U8 | dict[int, U8],
    targets: list[Target | None],
    shard_leaves: set[int],
    holders: list[int] | None = None,
) -> None:
    """Every rank holds its own data file (``own``): the plain leaves'
    pieces of each are broadcast in turn (a file of DTensor shards only is
    not: :func:`distribute_shards` sends those to the ranks that need them)
    and every rank places the pieces it needs into ``targets`` (None: a
    leaf this rank does not read; ``where``: the step's metadata
    directory, for messages). ``holders``: per data file, the rank that
    holds it (``own`` then maps data file -> bytes; a recovery at another
    world size); None: rank ``f`` holds file ``f``."""
    plain = _plain_pieces(meta, shard_leaves)
    files = by_rank(meta)
    prog = Progress("load", 0, enabled=False)

    def direct(p: Piece) -> U8:
        info = meta.leaves[p.leaf]
        target = targets[p.leaf]
        assert target is not None  # only the pieces of leaves read
        if info.kind != "tensor":
            return target.buf
        return target.buf[p.start * info.itemsize : p.stop * info.itemsize]

    err: BaseException | None = None
    for f in range(meta.world_size):
        if not plain[f]:
            continue  # the same on every rank
        root = f if holders is None else holders[f]
        if root == comm.rank:
            buf = _compact(own[f] if isinstance(own, dict) else own, plain[f], files[f])
        else:
            buf = np.empty(HEADER_SIZE + sum(p.stored for p in plain[f].values()), np.uint8)
        comm.bcast_u8(buf, root=root)
        mine = [
            plain[f][id(p)] for p in files[f] if id(p) in plain[f] and targets[p.leaf] is not None
        ]
        if err is None:
            try:
                read_pieces(
                    BufReader(buf), where / data_file_name(f), where, meta, f, mine, direct, prog
                )
            except BaseException as e:
                err = e
    agree(comm, err)


def distribute_shards(
    comm: Comm,
    meta: Metadata,
    where: Path,
    own: U8 | dict[int, U8],
    shards: ShardTargets,
    holders: list[int] | None = None,
) -> dict[int, Any]:
    """The DTensor shards (collective, when the step or ``into=`` has
    any): every rank's needed regions are exchanged
    (:func:`~deeppart.loading.reshard.plan_shard_reads` with ``held``), each
    stored piece that some rank needs goes from the rank whose data file
    holds it (``own``) to those ranks only, point to point, and each rank
    copies the intersections into its tensors. Returns the new full tensors
    by leaf (no ``into=``), as :func:`~deeppart.loading.reshard.fill_shards`.
    ``holders``: as for :func:`distribute`."""
    if not shards.active:
        return {}
    err: BaseException | None = None
    filled: dict[int, Any] = {}
    sr = plan_shard_reads(comm, meta, shards, held=True if holders is None else holders)
    try:
        read_held_shards(where, meta, sr, own)
    except BaseException as e:
        err = e
    try:
        exchange_shards(comm, sr, meta)  # every rank runs every round
    except BaseException as e:
        err = err or e
    if err is None:
        try:
            filled = fill_shards(meta, sr)
        except BaseException as e:
            err = e
    agree(comm, err)
    return filled


def load_global(
    comm: Comm,
    layout: Layout,
    step: int,
    into: Any,
    exchange: str,
    t0: float,
    per_rank: Any = None,
) -> tuple[Any, RecoveryReport]:
    """Loads ``step``'s L4 checkpoint (a normal DeepPart checkpoint, any
    world size: DTensor shards resharded into ``into``'s meshes, per-rank
    values as ``per_rank`` says, as :func:`deeppart.load`); ``t0``: when the
    load started, for the report."""
    where = layout.global_step(step)  # a directory or an s3:// URL
    state = load(str(where), comm=comm, into=into, loading=LoadOptions(exchange), per_rank=per_rank)
    _, meta, _ = open_checkpoint(where)
    report = RecoveryReport(step, [4] * meta.world_size, [], time.perf_counter() - t0)
    return state, report
