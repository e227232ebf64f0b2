"""Steps as a line: the record a :class:`~deeppart.Checkpointer` (and the
multi-level engine) writes into every step it saves, and the *live line*
that any process computes from what is committed on disk.

Every step saved through a ``Checkpointer`` carries, in its
``metadata.json`` (the ``user`` value, under the marker's hash, so it is
part of the committed checkpoint), a line record::

    {"step": N, "user": ..., "line": {"run": "<16 hex>", "seq": S, "id": "<16 hex>",
                                     "parent": [P, PS, PID] | null}}

- ``seq``: one more than the largest ``seq`` of any committed step in the
  root when the save began, and than the parent's (:func:`next_seq`): the
  commit order, whatever the step numbers;
- ``id``: drawn afresh for every save: two jobs that save independently
  (a requeued job and its zombie) can commit the same step number with
  the same ``seq`` once the step both numbered from has left the root, and
  only the ``id`` tells those commits apart;
- ``parent``: the step (its ``seq`` and its ``id``) that this
  Checkpointer last loaded or saved, null for the first save of a fresh
  one (a record written before ids has ``[P, PS]``, and so names the
  parent by step and ``seq`` alone);
- ``run``: the line's family: a fresh Checkpointer's first save draws one,
  and a save after a load inherits the loaded step's.

The *head* is the committed step with the largest ``(seq, step)``; the
*live line* is the head and its ancestors, following each ``parent`` link
while the step it names is committed with that ``seq`` and ``id`` (a replaced or
removed parent ends the line). ``latest()`` is the head, a restart resumes
from it, and ``keep_last`` counts the live line only. A step of the line's
``run`` that is not on it but was committed after the parent of the line's
oldest step belongs to a line abandoned by a rollback: it is retired, if
it was committed when the Checkpointer loaded the step it went back to (a
step of the run committed after that is another job's, resumed from the
same step: a requeued job beside its zombie; it stays).
A save of the very step it came from (``overwrite=True``) takes that
step's place: its parent is the replaced step's parent (or, if that had
none, the replaced step itself, which ends the line there).

Only directories named exactly as DeepPart names steps (``step-`` and eight
or more digits, :func:`deeppart.format.step_dir_name`) whose committed
metadata holds a well-formed record for that very step count; anything else
(``step-500``, a checkpoint written by :func:`deeppart.save`, one written by
an earlier DeepPart without records, a user's directory) is never part of a
line, never counted, never retired. A root without any record-bearing step
falls back to the steps an earlier ``Checkpointer`` wrote (user value
``{"step": N, ...}``) for ``latest()``, so an upgrade resumes; those are
never pruned.

Reading a step's record reads its ``COMMITTED`` and ``metadata.json`` (as
:func:`deeppart.format.is_committed` does); parsed records are cached by
the files' identity (inode, size, mtime, ctime) once they are a few
seconds old (a rewrite within one timestamp tick is never served stale).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deeppart.errors import CheckpointError, CorruptCheckpointError
from deeppart.format import (
    MARKER,
    MAX_MARKER_BYTES,
    MAX_METADATA_BYTES,
    METADATA,
    damaged,
    marker_text,
    read_regular,
    step_dir_name,
    step_number,
)

__all__ = [
    "LINE_KEY",
    "Lines",
    "Link",
    "Node",
    "damaged",
    "new_run",
    "next_seq",
    "node_of",
    "read_node",
    "record",
    "scan",
]

#: The key of the line record in a Checkpointer's ``user`` value.
LINE_KEY = "line"
_RUN = re.compile(r"[0-9a-f]{16}")
#: A moved-aside committed copy of an interrupted overwrite: ``.old-NAME-<12 hex>``.
_OLD = re.compile(r"\.old-(.+)-[0-9a-f]{12}")


@dataclass(frozen=True)
class Link:
    """A step as a parent: its number, its ``seq`` and its record's ``id``
    (None for a record written before ids: it names the step by number
    and ``seq`` alone)."""

    step: int
    seq: int
    ident: str | None = None

    def names(self, node: Node) -> bool:
        """Whether ``node`` is the very commit this link names."""
        return (
            node.step == self.step
            and node.seq == self.seq
            and (self.ident is None or node.ident == self.ident)
        )


@dataclass(frozen=True)
class Node:
    """A committed step with a line record, and the directory holding it."""

    step: int
    seq: int
    run: str
    parent: Link | None
    path: Path
    #: The user value the Checkpointer stored with the step.
    user: Any = None
    #: The record's own id (None for a record written before ids).
    ident: str | None = None

    @property
    def link(self) -> Link:
        return Link(self.step, self.seq, self.ident)


@dataclass(frozen=True)
class Legacy:
    """A committed step that an earlier Checkpointer wrote, without a record."""

    step: int
    path: Path


def new_run() -> str:
    """A fresh line family id (16 hex digits); also a record's own ``id``."""
    return os.urandom(8).hex()


def next_seq(lines: Lines, parent: Link | None) -> int:
    """The ``seq`` of a new step whose record names ``parent``: one more
    than the largest ``seq`` committed in the root, and than the parent's.
    The parent may be gone from the root (moved out as a damaged step's
    evidence, removed by hand) or unreadable; a ``seq`` not above its
    parent's is no well-formed record (:func:`parse`), and the step
    committed with it would be no step of any line."""
    return max(lines.max_seq(), parent.seq if parent is not None else 0) + 1


def record(
    step: int, user: Any, run: str, seq: int, parent: Link | None
) -> tuple[dict[str, Any], Link]:
    """The ``user`` value of a Checkpointer's step (the step, the caller's
    value, and the line record, with a fresh ``id``) and the new step as
    a parent."""
    ident = new_run()
    link: list[Any] | None = None
    if parent is not None:
        link = [parent.step, parent.seq] + ([parent.ident] if parent.ident is not None else [])
    value = {
        "step": step,
        "user": user,
        LINE_KEY: {"run": run, "seq": seq, "id": ident, "parent": link},
    }
    return value, Link(step, seq, ident)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def parse(user: Any, step: int, path: Path) -> Node | Legacy | None:
    """The node a step's ``user`` value describes: a :class:`Node` for a
    well-formed record of ``step``, a :class:`Legacy` for an earlier
    Checkpointer's ``{"step": step, "user": ...}``, else None."""
    if not isinstance(user, dict) or user.get("step") != step or _int(user.get("step")) is None:
        return None
    line = user.get(LINE_KEY)
    if line is None:
        return Legacy(step, path) if set(user) == {"step", "user"} else None
    if not isinstance(line, dict):
        return None
    run, seq, parent = line.get("run"), _int(line.get("seq")), line.get("parent")
    if not isinstance(run, str) or not _RUN.fullmatch(run) or seq is None:
        return None
    ident = line.get("id")
    if ident is not None and not (isinstance(ident, str) and _RUN.fullmatch(ident)):
        return None
    link: Link | None = None
    if parent is not None:
        if not isinstance(parent, list) or len(parent) not in (2, 3):
            return None
        ps, pq = _int(parent[0]), _int(parent[1])
        pid = parent[2] if len(parent) == 3 else None
        if ps is None or pq is None or pq >= seq:
            return None
        if len(parent) == 3 and not (isinstance(pid, str) and _RUN.fullmatch(pid)):
            return None
        link = Link(ps, pq, pid)
    return Node(step, seq, run, link, path, user.get("user"), ident)


def node_of(metadata: bytes, step: int, where: Path) -> Node | Legacy | None:
    """The step that a committed step's ``metadata.json`` bytes describe
    (:func:`parse` of its user value; None if it is not a Checkpointer's
    step ``step``). ``where``: its directory, or for a step in an object
    store its name under the root (:mod:`deeppart.steps.object_steps`)."""
    try:
        raw = json.loads(metadata)
    except (ValueError, RecursionError):
        return None
    return parse(raw.get("user"), step, where) if isinstance(raw, dict) else None


_cache: dict[tuple[str, tuple[int, ...]], tuple[bool, Node | Legacy | None]] = {}
_cache_lock = threading.Lock()
_CACHE_MAX = 4096
#: A record whose files changed less than this long ago is read, never
#: cached: a file system's timestamps are coarse (a tick of several
#: milliseconds, a second on some), so a file rewritten twice within one
#: tick can keep its inode, size and timestamps.
_SETTLE_NS = 3_000_000_000


def _identity(directory: Path) -> tuple[int, ...] | None:
    """The identity of a step's marker and metadata files (inode, size,
    mtime and ctime of each; ctime also changes when a file is renamed
    into place or its bytes are written back with an old mtime), or None
    if either is missing."""
    try:
        a, b = os.stat(directory / MARKER), os.stat(directory / METADATA)
    except OSError:
        return None
    return (
        a.st_ino,
        a.st_size,
        a.st_mtime_ns,
        a.st_ctime_ns,
        b.st_ino,
        b.st_size,
        b.st_mtime_ns,
        b.st_ctime_ns,
    )


def _settled(ident: tuple[int, ...]) -> bool:
    """Whether the files of ``ident`` last changed long enough ago that a
    change now would show in their identity (see :data:`_SETTLE_NS`)."""
    newest = max(ident[2], ident[3], ident[6], ident[7])
    return time.time_ns() - newest > _SETTLE_NS


def read_node(directory: Path, step: int) -> tuple[bool, Node | Legacy | None]:
    """Whether ``directory`` is committed (its marker matches its
    metadata), and if so the step :func:`parse` reads from its user value
    (None: committed, but not a Checkpointer's step ``step``). Cached by
    the files' identity once they have settled (:func:`_settled`)."""
    ident = _identity(directory)
    if ident is None:
        return False, None
    key = (str(directory), ident)
    cacheable = _settled(ident)
    with _cache_lock:
        if cacheable and key in _cache:
            return _cache[key]
    out: tuple[bool, Node | Legacy | None] = (False, None)
    try:
        marker = read_regular(directory / MARKER, MAX_MARKER_BYTES)
        meta = read_regular(directory / METADATA, MAX_METADATA_BYTES)
        if marker == marker_text(meta):
            raw = json.loads(meta)
            out = (True, parse(raw.get("user"), step, directory) if isinstance(raw, dict) else None)
    except (OSError, CheckpointError, ValueError, RecursionError):
        out = (False, None)
    if cacheable:
        with _cache_lock:
            if len(_cache) >= _CACHE_MAX:
                _cache.clear()
            _cache[key] = out
    return out


@dataclass
class Lines:
    """The record-bearing committed steps of a root (one per step number)
    and what follows from them."""

    nodes: dict[int, Node] = field(default_factory=dict)
    legacy: dict[int, Legacy] = field(default_factory=dict)
    #: Steps whose commit is damaged (:func:`damaged`: a marker that no
    #: longer matches its metadata): where (a directory, or a URL), and why. Never part of a line,
    #: never served, replaced or removed; :meth:`check` reports them.
    damaged: dict[int, tuple[str, str]] = field(default_factory=dict)

    def check(self) -> None:
        """Raises :class:`CorruptCheckpointError` naming every damaged step:
        a damaged step may be the newest, so neither the live line nor the
        step a restart resumes from is known (never skipped in silence).
        The damaged copy stays as evidence; the message says how to go on."""
        if not self.damaged:
            return
        where = "; ".join(f"step {n} at {p}: {why}" for n, (p, why) in sorted(self.damaged.items()))
        raise CorruptCheckpointError(
            f"damaged checkpoint(s) found: {where}. It is kept as evidence and never "
            "replaced; it may be the newest step, so the latest step is unknown. Inspect "
            "it, then move it out of the root (or remove it) to resume from the steps "
            "that remain"
        )

    def max_seq(self) -> int:
        return max((n.seq for n in self.nodes.values()), default=0)

    def head(self) -> Node | None:
        """The newest committed step by commit order (``seq``, then step)."""
        return max(self.nodes.values(), key=lambda n: (n.seq, n.step), default=None)

    def ancestry(self, start: Node | None) -> list[Node]:
        """``start`` and its ancestors, newest first, while each parent is
        committed with the recorded ``seq`` and ``id`` (:meth:`Link.names`)."""
        out: list[Node] = []
        node = start
        while node is not None:
            out.append(node)
            p = node.parent
            nxt = self.nodes.get(p.step) if p is not None else None
            node = nxt if nxt is not None and p is not None and p.names(nxt) else None
        return out

    def live(self) -> list[Node]:
        """The live line, newest first (empty without record-bearing steps)."""
        return self.ancestry(self.head())

    def line_of(self, link: Link) -> list[Node]:
        """The line ending at the commit ``link`` names (the step a save
        just committed), newest first; [] if that commit is gone."""
        node = self.nodes.get(link.step)
        return self.ancestry(node) if node is not None and link.names(node) else []

    def steps(self) -> list[int]:
        """The live line's steps, oldest first; without any record-bearing
        step, an earlier Checkpointer's steps."""
        if self.nodes:
            return [n.step for n in reversed(self.live())]
        return sorted(self.legacy)

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @staticmethod
    def left_by(line: list[Node], node: Node, seen: int | None = None) -> bool:
        """Whether ``node`` is a step of a line that ``line`` (newest first,
        as :meth:`live`) left: of its run, not on it, and committed after
        the parent of its oldest step (after that step itself if it has no
        parent), so that it cannot be one of its ancestors. Older steps
        (beyond a removed or unreadable one) are left alone. ``seen``: the
        largest ``seq`` committed when the line's writer loaded the step
        it continues (None: any): a step committed after that was no step
        the writer left, but another job's beside it (a requeued job and
        its zombie, resumed from the same step), and is never retired."""
        if not line or node.run != line[0].run or node in line:
            return False
        if seen is not None and node.seq > seen:
            return False
        oldest = line[-1]
        return node.seq > (oldest.parent.seq if oldest.parent is not None else oldest.seq)

    def abandoned(self, line: list[Node], seen: int | None = None) -> list[Node]:
        """The steps of the lines that ``line`` left (:meth:`left_by`, with
        ``seen``), by step number: what a rollback retires."""
        return sorted(
            (n for n in self.nodes.values() if self.left_by(line, n, seen)), key=lambda n: n.step
        )


def _effective(root: Path, names: Iterable[str]) -> dict[int, list[Path]]:
    """Per step, the directories that may hold its committed copy, in
    order of preference: ``step-N``, then moved-aside ``.old-step-N-*``
    copies (newest marker first, as load serves them)."""
    found: dict[int, list[Path]] = {}
    olds: dict[int, list[Path]] = {}
    for name in names:
        m = _OLD.fullmatch(name)
        base = m.group(1) if m else name
        n = step_number(base)
        if n is None or base != step_dir_name(n):
            continue
        (olds if m else found).setdefault(n, []).append(root / name)
    for n, paths in olds.items():

        def mtime(p: Path) -> float:
            try:
                return (p / MARKER).stat().st_mtime
            except OSError:
                return 0.0

        found.setdefault(n, []).extend(sorted(paths, key=mtime, reverse=True))
    return found


def scan(*roots: Path) -> Lines:
    """The lines of the committed steps in ``roots`` (a step found in an
    earlier root wins: the multi-level engine passes its metadata root,
    then ``glbl_dir``). Unreadable entries are skipped."""
    lines = Lines()
    for root in roots:
        try:
            names = [e.name for e in os.scandir(root)]
        except OSError:
            continue
        for n, paths in _effective(root, names).items():
            if n in lines.nodes or n in lines.legacy:
                continue
            for p in paths:
                committed, node = read_node(p, n)
                if not committed and p.name == step_dir_name(n):
                    why = damaged(p)
                    if why is not None:
                        lines.damaged[n] = (str(p), why)
                        break  # a moved-aside older copy is never served in its place
                if isinstance(node, Node):
                    lines.nodes[n] = node
                elif isinstance(node, Legacy):
                    lines.legacy[n] = node
                if committed:  # what load serves for this step
                    break
    return lines
