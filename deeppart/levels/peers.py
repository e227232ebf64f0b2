"""Restoring a node-local step at another world size or node layout (a
job restarted on fewer or other nodes, no spare): every data file of the
saving job is found among what the survivors hold, level by level, each
byte verified, and the state is then loaded resharded into the new
layout by :func:`deeppart.load`'s rules.

:meth:`deeppart.levels.engine.BuiltinBackend.load` calls :func:`recover`
for a step whose metadata names another layout
(:func:`deeppart.levels.recovery.read_step` sets ``foreign``). Collective
over the new job; in order:

1. every rank lists its node's step directory and the lists are exchanged
   (one collective): which node holds which old rank's file (``rank-R``),
   partner copy (``partner-R``, L2) and parity shard (``parity-R``, L3);
2. level by level, for the old ranks not served yet: L1, each old rank's
   own file; L2, the partner copy of it; L3, its group's Reed-Solomon
   decoding from any ``group_size`` of the group's surviving data files
   and verified parity shards, gathered on one rank of the new job and
   decoded there (:func:`deeppart.levels.erasure.decode_whole`); L4, its
   file in the step's global copy. Each file is read and verified (size,
   header, every piece's xxh3; a parity shard by its whole-file xxh3) by
   the one rank chosen to hold it, and one collective per level shares
   what passed: a corrupt or truncated copy is rejected
   (``RecoveryReport.rejected``) and the next level tried;
3. if an old rank's data is lost at every level, the step cannot be
   restored (the reason names the step, the old ranks and the levels
   tried; the engine then tries the older steps);
4. the state is placed as :func:`deeppart.load` places it on this world
   size (:func:`deeppart.levels.recovery.own_targets` with ``per_rank``:
   DTensor shards resharded into ``into=``'s meshes, per-rank values by
   ``per_rank=``), from the files in memory: the plain leaves' pieces
   broadcast by the rank holding each file
   (:func:`~deeppart.levels.recovery.distribute`), the DTensor shards sent
   point to point by it to the ranks whose regions need them
   (:func:`~deeppart.levels.recovery.distribute_shards`).

Nothing is rewritten on the nodes: the files belong to the old layout,
which the next save of the new job replaces with its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from deeppart._planner import DeepPartError
from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.errors import CorruptCheckpointError
from deeppart.format import checksum, data_file_name
from deeppart.levels import erasure, recovery
from deeppart.levels.backend import RecoveryReport
from deeppart.levels.files import EMPTY, U8, by_rank, file_ok
from deeppart.levels.layout import Layout, parity_file, partner_file
from deeppart.loading.reader import assemble
from deeppart.storage.files import read_all

#: What each level recovers from, for messages.
_LEVEL_NAMES = {2: "partner copies", 3: "Reed-Solomon decoding", 4: "the global copy"}

#: The level files' kinds, by level: an old rank's own file, its partner copy.
_DATA_KINDS = {1: data_file_name, 2: partner_file}


@dataclass(frozen=True)
class OldLayout:
    """The saving job's nodes and groups, from the step's metadata."""

    nodes: list[int]
    group_size: int

    @classmethod
    def of(cls, st: recovery.Step) -> OldLayout:
        try:
            nodes = [int(k) for k in st.layout["nodes"]]
            g = int(st.layout["group_size"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"step {st.step}: bad levels layout: {e}") from e
        if len(nodes) != st.meta.world_size or g < 1:
            raise CorruptCheckpointError(f"step {st.step}: levels layout does not fit its ranks")
        return cls(nodes, g)

    def group(self, rank: int) -> list[int]:
        """``rank``'s L2/L3 group in the saving job (FTI's, as
        :meth:`deeppart.levels.config.LevelConfig.group_members`)."""
        ranks_of: dict[int, list[int]] = {}
        for r, k in enumerate(self.nodes):
            ranks_of.setdefault(k, []).append(r)
        node = self.nodes[rank]
        pos = ranks_of[node].index(rank)
        first = node // self.group_size * self.group_size
        try:
            return [ranks_of[first + j][pos] for j in range(self.group_size)]
        except (KeyError, IndexError) as e:
            raise CorruptCheckpointError(f"levels layout: no group for rank {rank}") from e


@dataclass
class _Found:
    """What the survivors hold of a step, as this rank sees it."""

    #: Per old rank: (level, new rank holding its verified data file).
    sources: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: The verified data files this rank holds, by old rank.
    held: dict[int, U8] = field(default_factory=dict)
    #: Copies that failed verification (the same list on every rank).
    rejected: list[str] = field(default_factory=list)
    #: CPU seconds of Reed-Solomon decoding on this rank.
    decode_seconds: float = 0.0
    #: Nothing node-local survives but the step has its global copy: it is
    #: loaded whole by :func:`deeppart.load` (each piece read once, by a
    #: rank that needs it), not file by file.
    whole_global: bool = False


def _expected(st: recovery.Step) -> dict[str, int]:
    """Every level file of the step: name -> size."""
    sizes = st.meta.file_sizes
    out = {data_file_name(r): sizes[r] for r in range(len(sizes))}
    if st.level == 2:
        out.update({partner_file(r): sizes[r] for r in range(len(sizes))})
    if st.level == 3:
        out.update({parity_file(r): st.parity_sizes[r] for r in range(len(sizes))})
    return out


def _listings(comm: Comm, local: Path, st: recovery.Step) -> list[dict[str, int]]:
    """Every rank's level files of the step with their expected sizes
    (one collective)."""
    expected = _expected(st)
    mine = {n: s for n, s in recovery.listing(local).items() if expected.get(n) == s}
    return [json.loads(b) for b in comm.allgather_varbytes(json.dumps(mine).encode())]


def _verify(
    comm: Comm,
    asks: dict[int, tuple[str, int, Any]],
    check: Any,
    found: _Found,
    level: int,
    what: str,
) -> dict[int, U8]:
    """One level's round (collective): ``asks`` maps an old rank to (file,
    the new rank chosen to read it, a function that reads it);
    that rank reads and verifies it (``check(old rank, bytes)``). Returns
    the verified bytes this rank read, by old rank; records every rank's
    rejections in ``found`` (alike on every rank)."""
    ok: dict[int, U8] = {}
    bad: list[str] = []
    for r, (name, q, src) in sorted(asks.items()):
        if q != comm.rank:
            continue
        try:
            buf = src()
            passed = check(r, buf)
        except Exception:  # unreadable: lost (and this rank's part of the exchange goes on)
            buf, passed = None, False
        if passed:
            assert buf is not None
            ok[r] = buf
        else:
            bad.append(f"L{level} {what} of old rank {r} ({name}) failed verification")
    rows = comm.allgather_varbytes(json.dumps([sorted(ok), bad]).encode())
    for row in rows:
        verified, rejected = json.loads(row)
        found.rejected.extend(rejected)
        for r in verified:
            found.sources[r] = (level, asks[r][1])
    return ok


def _reader(path: Path, size: int) -> Any:
    return lambda: read_all(path, size)


def _choose(rows: list[dict[str, int]], name: str, load: list[int]) -> int | None:
    """The new rank that reads ``name`` (the least loaded of those whose
    node holds it), or None."""
    holders = [q for q in range(len(rows)) if name in rows[q]]
    if not holders:
        return None
    q = min(holders, key=lambda h: (load[h], h))
    load[q] += 1
    return q


def _find(comm: Comm, layout: Layout, st: recovery.Step) -> _Found:
    """Steps 1 and 2 of the module docstring (collective)."""
    r_new, world = comm.rank, st.meta.world_size
    local = layout.local_step(st.step, r_new)
    rows = _listings(comm, local, st)
    found = _Found()
    pieces = by_rank(st.meta)
    load = [0] * comm.size

    def data_ok(r: int, buf: U8 | None) -> bool:
        return file_ok(buf, st.meta, r, pieces[r])

    for level, name_of in _DATA_KINDS.items():
        if level == 2 and st.level != 2:
            continue
        asks: dict[int, tuple[str, int, Any]] = {}
        for r in range(world):
            q = None if r in found.sources else _choose(rows, name_of(r), load)
            if q is not None:
                asks[r] = (name_of(r), q, _reader(local / name_of(r), st.meta.file_sizes[r]))
        what = "own file" if level == 1 else "partner copy"
        found.held.update(_verify(comm, asks, data_ok, found, level, what))
    if st.level == 3:
        _decode(comm, st, rows, local, found, load, data_ok)
    missing = [r for r in range(world) if r not in found.sources]
    if (
        missing
        and st.level == 4
        and layout.has_global()
        and recovery.global_ok(comm, layout, st.step)
    ):
        if not found.sources:
            found.whole_global = True
            return found
        where = layout.global_step(st.step)

        def reader(r: int) -> Any:
            size = st.meta.file_sizes[r]
            return lambda: recovery.global_file(where, r, size, True)[1]

        asks = {r: (data_file_name(r), r % comm.size, reader(r)) for r in missing}
        found.held.update(_verify(comm, asks, data_ok, found, 4, "global copy"))
    return found


def _decode(
    comm: Comm,
    st: recovery.Step,
    rows: list[dict[str, int]],
    local: Path,
    found: _Found,
    load: list[int],
    data_ok: Any,
) -> None:
    """L3 at another world size (collective): for each old group that lost
    members, its surviving parity shards are verified; if the group's
    verified data files and parity shards number at least ``group_size``,
    ``group_size`` of them are sent to the new rank that holds most of
    them, which decodes the lost files and verifies them."""
    old = OldLayout.of(st)
    world = st.meta.world_size
    groups: list[list[int]] = []
    for r in range(world):
        g = old.group(r)
        if r not in found.sources and g not in groups:
            groups.append(g)
    if not groups:  # alike on every rank
        return
    asks: dict[int, tuple[str, int, Any]] = {}
    for g in groups:
        for m in g:
            q = _choose(rows, parity_file(m), load)
            if q is not None:
                asks[m] = (parity_file(m), q, _reader(local / parity_file(m), st.parity_sizes[m]))

    def parity_ok(m: int, buf: U8 | None) -> bool:
        return (
            buf is not None
            and buf.size == st.parity_sizes[m]
            and (checksum(buf.data) == st.parity_xxh3[m])
        )

    shards = _Found()
    parity = _verify(comm, asks, parity_ok, shards, 3, "parity shard")
    found.rejected.extend(shards.rejected)
    for g in groups:
        # Chosen shards: (member index, kind, holder), data files first.
        have = [(j, "data", found.sources[m][1]) for j, m in enumerate(g) if m in found.sources]
        have += [
            (j, "parity", shards.sources[m][1]) for j, m in enumerate(g) if m in shards.sources
        ]
        if len(have) < len(g):
            continue  # lost at L3 too: the next level's turn
        have = have[: len(g)]
        counts = [sum(1 for _, _, q in have if q == k) for k in range(comm.size)]
        decoder = max(range(comm.size), key=lambda k: (counts[k], -k))
        data: dict[int, U8] = {}
        par: dict[int, U8] = {}
        for j, kind, q in have:
            m = g[j]
            size = st.meta.file_sizes[m] if kind == "data" else st.parity_sizes[m]
            mine = found.held if kind == "data" else parity
            if q == comm.rank == decoder:
                buf = mine[m]
            elif q == comm.rank:
                comm.sendrecv_u8(mine[m], decoder, EMPTY, decoder)
                continue
            elif comm.rank == decoder:
                buf = np.empty(size, dtype=np.uint8)
                comm.sendrecv_u8(EMPTY, q, buf, q)
            else:
                continue
            (data if kind == "data" else par)[j] = buf
        ok: list[int] = []
        if comm.rank == decoder:
            try:
                sizes = [st.meta.file_sizes[m] for m in g]
                restored, seconds = erasure.decode_whole(sizes, st.stripe, data, par)
                found.decode_seconds += seconds
            except (DeepPartError, ValueError, MemoryError):
                restored = {}  # the group's files cannot restore it: lost at L3
            for j, buf in restored.items():
                if data_ok(g[j], buf):
                    found.held[g[j]] = buf
                    ok.append(g[j])
        got = json.loads(comm.allgather_varbytes(json.dumps(ok).encode())[decoder])
        for m in g:
            if m not in found.sources:
                if m in got:
                    found.sources[m] = (3, decoder)
                else:
                    found.rejected.append(f"L3 decoding of old rank {m} failed verification")


def recover(
    comm: Comm,
    layout: Layout,
    st: recovery.Step,
    mine: recovery.OwnTargets,
    t0: float,
) -> tuple[Any, RecoveryReport] | str | None:
    """Restores ``st`` (written by another world size or node layout) on
    this job from what the survivors hold, resharded (collective; the
    module docstring); ``mine``: this rank's targets on the new layout
    (:func:`~deeppart.levels.recovery.own_targets`). Returns the state and
    the report (``levels[r]``: the level that served old rank ``r``), or,
    when some old rank's data is lost at every level, why; None when
    nothing node-local survives and the step's global copy is to be
    loaded whole (:func:`~deeppart.levels.recovery.load_global`)."""
    world = st.meta.world_size
    err: BaseException | None = None
    found = _Found()
    try:
        found = _find(comm, layout, st)
    except CorruptCheckpointError as e:  # the same metadata: raised alike
        err = e
    agree(comm, err)
    if found.whole_global:
        return None
    missing = [r for r in range(world) if r not in found.sources]
    if missing:
        tried = ["L1 (own files)"]
        if st.level > 1:
            tried.append(f"L{st.level} ({_LEVEL_NAMES[st.level]})")
        why = (
            f"written by {world} ranks, loaded on {comm.size}: the data of old rank(s) "
            f"{missing} is lost at every level tried, {' and '.join(tried)}, on the "
            f"nodes of this job"
        )
        if found.rejected:
            why += "; rejected: " + "; ".join(found.rejected)
        return why
    holders = [found.sources[r][1] for r in range(world)]
    where = layout.meta_step(st.step)
    recovery.distribute(
        comm, mine.meta, where, found.held, mine.targets, mine.shards.leaves, holders
    )
    filled = recovery.distribute_shards(comm, mine.meta, where, found.held, mine.shards, holders)
    state = assemble(mine.meta, mine.targets, where, mine.matched, mine.pruned, filled)
    report = RecoveryReport(
        st.step,
        [found.sources[r][0] for r in range(world)],
        [],
        time.perf_counter() - t0,
        rejected=found.rejected,
        world_size=comm.size,
    )
    return state, report


def recoverable(comm: Comm, layout: Layout, st: recovery.Step) -> bool:
    """Whether the survivors' files (checked by size, not read) suffice to
    restore ``st`` here (collective): every old rank's own file or partner
    copy listed, or enough of its L3 group's files, or its global copy."""
    rows = _listings(comm, layout.local_step(st.step, comm.rank), st)
    listed = set().union(*rows) if rows else set()
    world = st.meta.world_size
    served = {r for r in range(world) if data_file_name(r) in listed}
    if st.level == 2:
        served |= {r for r in range(world) if partner_file(r) in listed}
    if st.level == 3:
        old = OldLayout.of(st)
        for r in range(world):
            g = old.group(r)
            alive = sum(1 for m in g if data_file_name(m) in listed)
            alive += sum(1 for m in g if parity_file(m) in listed)
            if alive >= len(g):
                served.add(r)
    if len(served) == world:
        return True
    return st.level == 4 and recovery.global_ok(comm, layout, st.step)
