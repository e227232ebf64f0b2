"""A :class:`~deeppart.Checkpointer`'s steps in an object store
(``Checkpointer("s3://bucket/run")``): the lines of the committed steps
under the root, and the removal of what DeepPart wrote there.

Each step is a checkpoint at ``ROOT/step-NNNNNNNN`` as the storage layer
writes one (:mod:`deeppart.storage.objects`: the ``COMMITTED`` marker,
put last and conditionally, names the save whose ``<save id>/`` objects
it commits). A step counts only while committed (the marker is
DeepPart's and matches the metadata it names,
:func:`~deeppart.storage.objects.open_committed`); its line record is
read from that metadata as on a file system
(:func:`deeppart.steps.lineage.node_of`).

Object storage has no rename: nothing is moved aside. Without
``keep_last`` the steps of a line left by a rollback stay where they are
(never ``latest()``, never resumed; a save of the same step number on the
new line replaces one, as ``overwrite=True`` does). Removal (a step pruned
by ``keep_last``, or left by a rollback with ``keep_last``) deletes the
marker first (the step is then no longer committed), then only that
save's objects, recognised by the save id in their key *and* their
content (:func:`~deeppart.storage.objects.remove_save`). Other save
groups under that step (an interrupted save of it) are then leftovers.

Leftovers of interrupted saves (save groups under a step without a
marker, below the step being saved) are listed by rank 0 when a save
begins and removed after it commits, by save id and content, unless their
step got committed meanwhile; as in the storage layer, no clock is
compared. Every other object under the root (a user's notes beside a
step, anything not named or written as DeepPart writes it) stays.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from deeppart.errors import CheckpointError, CorruptCheckpointError, ForeignPathError
from deeppart.format import MARKER, step_dir_name, step_number
from deeppart.steps.lineage import Legacy, Lines, Node, node_of
from deeppart.storage import ObjectStore
from deeppart.storage.objects import open_committed, read_marker, remove_save

__all__ = ["ObjectSteps", "StoredStep"]

_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_CACHE_MAX = 4096


@dataclass
class StoredStep:
    """A step's prefix under the root, as listed: whether it has an
    object named ``COMMITTED``, and the save ids of its ``<save id>/``
    groups."""

    step: int
    has_marker: bool = False
    #: The marker's version tag (ETag), if the store gives one.
    marker_tag: str | None = None
    saves: set[str] = field(default_factory=set)


class ObjectSteps:
    """The steps under one object store root (``store``)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        #: (step, marker tag) -> (save id, line node) of a committed step
        #: read before: a marker's tag changes whenever it is replaced, and
        #: a save's metadata (under its save id) is written once.
        self._read: dict[tuple[int, str], tuple[str, Node | Legacy | None]] = {}

    def url(self, step: int) -> str:
        """Where step ``step`` is (``s3://bucket/run/step-NNNNNNNN``)."""
        return self.store.describe(step_dir_name(step))

    def listing(self) -> dict[int, StoredStep]:
        """Per step named as DeepPart names steps (``step-`` and eight or
        more digits), what is under its prefix; other names are never
        looked at."""
        found: dict[int, StoredStep] = {}
        for info in self.store.list():
            top, sep, rest = info.name.partition("/")
            n = step_number(top)
            if not sep or n is None or top != step_dir_name(n):
                continue
            entry = found.setdefault(n, StoredStep(n))
            group, sep2, _ = rest.partition("/")
            if rest == MARKER:
                entry.has_marker = True
                entry.marker_tag = info.tag
            elif sep2 and _SAVE_ID.fullmatch(group):
                entry.saves.add(group)
        return found

    def lines(self) -> tuple[Lines, dict[int, StoredStep], dict[int, str]]:
        """The lines of the committed steps (as :func:`deeppart.steps.lineage.scan`;
        a node's ``path`` is the step's name under the root), what each
        step prefix holds, and the save id each committed step's marker
        names."""
        lines = Lines()
        listing = self.listing()
        committed: dict[int, str] = {}
        for n, entry in sorted(listing.items()):
            if not entry.has_marker:
                continue
            known = self._read.get((n, entry.marker_tag)) if entry.marker_tag else None
            if known is None:
                try:
                    at, meta = open_committed(self.store.child(step_dir_name(n)))
                except CorruptCheckpointError as e:
                    # DeepPart's marker, but the metadata it names is missing
                    # or does not match: damaged, never skipped in silence.
                    lines.damaged[n] = (self.url(n), str(e))
                    continue
                except CheckpointError:  # not committed (any more), or not DeepPart's marker
                    continue
                known = (at.save_id, node_of(meta, n, Path(step_dir_name(n))))
                if entry.marker_tag:
                    if len(self._read) >= _CACHE_MAX:
                        self._read.clear()
                    self._read[(n, entry.marker_tag)] = known
            committed[n], node = known
            if isinstance(node, Node):
                lines.nodes[n] = node
            elif isinstance(node, Legacy):
                lines.legacy[n] = node
        return lines, listing, committed

    def leftovers(self, below: int) -> dict[int, set[str]]:
        """Per step below ``below`` that has no ``COMMITTED`` object, the
        save groups under it: what interrupted saves left, as a save of
        step ``below`` sees them when it begins (it removes them after its
        commit, :meth:`remove_leftovers`)."""
        return {
            n: entry.saves
            for n, entry in self.listing().items()
            if n < below and not entry.has_marker and entry.saves
        }

    def remove_leftovers(self, seen: dict[int, set[str]]) -> None:
        """Removes the save groups ``seen`` (:meth:`leftovers`, listed
        before this save began) of each step that is still uncommitted,
        DeepPart's objects only, by save id and content; a step committed
        meanwhile (a save that was still running) is left alone. Other
        objects there are the user's and stay, unreported (they would be
        reported after every save)."""
        for n, saves in sorted(seen.items()):
            step_store = self.store.child(step_dir_name(n))
            try:
                if read_marker(step_store) is not None:
                    continue
            except ForeignPathError:
                continue
            for save_id in sorted(saves):
                remove_save(step_store, save_id)

    def remove_step(self, step: int, save_id: str) -> list[str]:
        """Removes the committed step ``step`` of the save ``save_id``: its
        marker (only if it still names that save), then that save's
        objects, each recognised as DeepPart's by content. Returns what
        failed or stayed (one line each; foreign objects stay)."""
        step_store = self.store.child(step_dir_name(step))
        try:
            marker = read_marker(step_store)
        except ForeignPathError as e:
            return [str(e)]
        if marker is not None and marker.save_id != save_id:
            # Committed again (another save replaced it) since it was listed.
            return [f"{self.url(step)}: replaced by another save meanwhile; kept"]
        if marker is not None:
            step_store.delete(MARKER)  # first: the step is no longer committed
        left = remove_save(step_store, save_id)
        return [f"{step_store.describe(name)}: kept, DeepPart did not write it" for name in left]
