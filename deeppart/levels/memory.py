"""The memory tier of the built-in level engine (``[deeppart] memory = 1``,
docs/LEVELS.md "Memory tier"): L1-L3 kept in node-local memory that
outlives the training process, a memory file system (tmpfs such as
``/dev/shm/deeppart-<job>``) as ``ckpt_dir``.

- :func:`check_memory_fs`: when the engine is made, every node's
  ``ckpt_dir`` is on a memory file system (tmpfs, ramfs), else every rank
  raises naming the nodes and what they are on.
- :func:`check_budget`: before a save writes anything, the bytes the
  step puts on each node (its ranks' own files, the partner copies it
  keeps for L2, its parity shards for L3; bounds from the plan, which
  every rank holds alike), beside the bytes of the steps the node already
  holds, against ``memory_budget``, and the step's bytes against the file
  system's free space: a step that does not fit raises
  :class:`~deeppart.errors.NoSpaceError` on every rank, naming each node,
  what does not fit and by how much; nothing is written or removed (but
  a delta base kept beyond ``memory_keep``, dropped where the step fits
  only without it).
- :func:`evict`: after a save commits, the node-local files of steps older
  than the newest ``memory_keep`` committed ones go (never the newest),
  but the partner copies' delta base (``l2_delta = 1``: the newest L2
  step) stays while the node has room for another step of its size
  beside what it keeps.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from deeppart.comm import Comm
from deeppart.errors import LevelConfigError, NoSpaceError
from deeppart.levels.erasure import chunk_len, shard_len
from deeppart.levels.layout import Layout, step_name, steps_in
from deeppart.storage.ownership import level_file, remove_owned

#: File systems whose files live in memory.
MEMORY_FS = ("tmpfs", "ramfs")


def fs_type(path: Path) -> tuple[str, str]:
    """The file system type and mount point of ``path`` (or of its nearest
    existing parent), from ``/proc/self/mountinfo``; ("unknown", "") if it
    cannot be told."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    real = os.path.realpath(p)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].replace("\\040", " ")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
    except (OSError, IndexError):
        return "unknown", ""
    return kind, best


def check_memory_fs(comm: Comm, layout: Layout) -> None:
    """Every node's ``ckpt_dir`` is on a memory file system (collective:
    every rank raises :class:`~deeppart.errors.LevelConfigError` naming
    the nodes that are not, and what they are on)."""
    kind, point = fs_type(layout.local_root(comm.rank))
    rows = comm.allgather_varbytes(f"{kind}\0{point}".encode())
    names = layout.node_dirs()
    bad: dict[str, str] = {}
    for r, row in enumerate(rows):
        k, _, at = row.decode("utf-8", "replace").partition("\0")
        if k not in MEMORY_FS:
            bad.setdefault(names[layout.node(r)], f"{k} at {at or '?'}")
    if bad:
        where = "; ".join(f"node {n}: {what}" for n, what in sorted(bad.items()))
        raise LevelConfigError(
            f"memory = 1, but ckpt_dir = {layout.config.ckpt_dir} is not on a memory file "
            f"system ({', '.join(MEMORY_FS)}) on every node ({where}): point ckpt_dir at a "
            "tmpfs such as /dev/shm/deeppart-<job>, or set memory = 0"
        )


def step_bytes(layout: Layout, rank_bytes: list[int], level: int, stripe: int) -> list[list[int]]:
    """Per node, the bytes a step at ``level`` puts on it: [own files,
    partner copies (L2), parity shards (L3)]; ``rank_bytes``: each rank's
    data file bound (its planned raw bytes plus the header: a piece is
    stored compressed only when smaller)."""
    nodes = len(layout.node_dirs())
    out = [[0, 0, 0] for _ in range(nodes)]
    for r in range(layout.size):
        k = layout.node(r)
        out[k][0] += rank_bytes[r]
        if level == 2:
            out[k][1] += rank_bytes[layout.pred(r)]
        if level == 3:
            sizes = [rank_bytes[m] for m in layout.group(r)]
            nstripes = -(-max(sizes) // stripe)
            out[k][2] += sum(
                shard_len([chunk_len(s, t, stripe) for s in sizes]) for t in range(nstripes)
            )
    return out


def step_dir_bytes(root: Path, step: int) -> int:
    """Bytes of the files in step ``step``'s directory under a node's ``root``."""
    total = 0
    for dirpath, _, names in os.walk(root / step_name(step)):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


def held_bytes(root: Path, but: int) -> int:
    """Bytes of the step directories in a node's ``root`` other than step
    ``but`` (which a re-save replaces)."""
    return sum(step_dir_bytes(root, s) for s in steps_in(root, False) if s != but)


def free_bytes(path: Path) -> int:
    """Bytes free to an unprivileged writer on ``path``'s file system (or
    its nearest existing parent's)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize


def spare_step(root: Path, base: int | None, keep: int, but: int) -> int | None:
    """``base`` (the partner copies' delta base) when a node's ``root``
    holds it only as that: beyond the newest ``keep`` steps it holds
    (other than ``but``, which a re-save replaces)."""
    if base is None or base == but:
        return None
    held = [s for s in steps_in(root, False) if s != but]
    return base if base in held and base not in sorted(held)[-keep:] else None


def check_budget(
    comm: Comm,
    layout: Layout,
    step: int,
    level: int,
    rank_bytes: list[int],
    stripe: int,
    base: int | None = None,
) -> None:
    """Before anything of ``step`` is written (collective): each node's
    share of the step against ``memory_budget`` (beside what the node
    holds already) and its file system's free space; raises
    :class:`~deeppart.errors.NoSpaceError` on every rank naming each node
    that cannot hold it, what does not fit and by how much. ``base``: the
    partner copies' delta base, which :func:`evict` may have kept beyond
    ``memory_keep``: a node that has room only without it drops it first
    (its ranks' copies then go compressed), so keeping it never refuses
    a save."""
    root = layout.local_root(comm.rank)
    spare: int | None = None
    try:
        held = held_bytes(root, step)
        free = free_bytes(root)
        spare = spare_step(root, base, layout.config.memory_keep, step)
        spare_bytes = step_dir_bytes(root, spare) if spare is not None else 0
    except OSError:
        held, free, spare_bytes = 0, -1, 0
    row = np.array([float(held), float(free), float(spare_bytes)], dtype=np.float64)
    rows = comm.allgather_f64(row)
    first: dict[int, int] = {}
    for r in range(layout.size):
        first.setdefault(layout.node(r), r)
    budget = layout.config.memory_budget
    need = step_bytes(layout, rank_bytes, level, stripe)
    names = layout.node_dirs()
    problems: list[str] = []
    drop: set[int] = set()
    for k, r in sorted(first.items()):
        own, copies, parity = need[k]
        total = own + copies + parity
        node_held, node_free, node_spare = int(rows[r, 0]), int(rows[r, 1]), int(rows[r, 2])
        over = (budget and total + node_held > budget) or (node_free >= 0 and total > node_free)
        if over and node_spare:
            # Room without the spare base: dropped below, once no node is short.
            drop.add(k)
            node_held -= node_spare
            node_free += node_spare
        parts = f"own files {own}" + (f", partner copies {copies}" if level == 2 else "")
        parts += f", parity {parity}" if level == 3 else ""
        what = f"node {names[k]}: step {step} at L{level} needs {total} bytes ({parts})"
        if budget and total + node_held > budget:
            problems.append(
                f"{what} beside {node_held} bytes of the steps it holds: "
                f"{total + node_held} > memory_budget = {budget}, over by "
                f"{total + node_held - budget} bytes"
            )
        if node_free < 0:
            problems.append(f"{what}, but its free memory cannot be read at {root}")
        elif total > node_free:
            problems.append(
                f"{what}, but {layout.config.ckpt_dir} has {node_free} bytes free there: "
                f"{total - node_free} bytes short"
            )
    if problems:
        raise NoSpaceError(
            f"deeppart levels: step {step} does not fit node-local memory; nothing was "
            f"written: {'; '.join(problems)} (raise memory_budget, lower memory_keep, or "
            "save at L4)"
        )
    if drop:  # the same on every rank: from the gathered rows
        k = layout.node(comm.rank)
        if k in drop and first[k] == comm.rank and spare is not None:
            with contextlib.suppress(OSError):
                remove_owned(root / step_name(spare), level_file)
        comm.barrier()


def evict(
    root: Path,
    newest: int,
    committed: list[int],
    keep: int,
    base: int | None = None,
    budget: int = 0,
) -> list[int]:
    """A node's part of a save's cleanup with the memory tier: removes
    from ``root`` the step directories (DeepPart's files only) older than
    ``newest`` that are not among the newest ``keep`` committed steps
    (``committed``); ``newest``, just committed, always stays. ``base``:
    the committed step the next partner copies are deltas against
    (``l2_delta = 1``), which also stays while the node has room for
    another step of its size beside every step it keeps (within
    ``budget``, 0: unbounded, and the file system's free space), so that
    a step at L3 or L4 between two L2 steps does not cost the next copy
    its base; otherwise it goes too, and the next copies go compressed.
    Returns the steps evicted."""
    kept = set(sorted(committed)[-keep:]) | {newest}
    if base is not None and base in committed and base not in kept:
        with contextlib.suppress(OSError):
            if _room_for_base(root, kept, base, budget):
                kept.add(base)
    gone: list[int] = []
    for s in steps_in(root, False):
        if s < newest and s not in kept:
            with contextlib.suppress(OSError):
                remove_owned(root / step_name(s), level_file)
            if not (root / step_name(s)).exists():
                gone.append(s)
    return gone


def _room_for_base(root: Path, kept: set[int], base: int, budget: int) -> bool:
    """Whether a node holding the ``kept`` steps and ``base`` has room for
    one more step of ``base``'s size: within ``budget`` (0: unbounded) and
    the file system's free space."""
    size = step_dir_bytes(root, base)
    held = size + sum(step_dir_bytes(root, s) for s in kept)
    return (not budget or held + size <= budget) and size <= free_bytes(root)
