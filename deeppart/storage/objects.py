"""Checkpoints in an object store: the commit without a rename.

A checkpoint at ``s3://bucket/run/step-1`` is the store rooted there
(:class:`~deeppart.storage.base.ObjectStore`), holding::

    COMMITTED                      the commit marker, written last
    <save id>/metadata.json        the save's metadata
    <save id>/rank-00000.bin ...   each rank's data file
    <save id>/SAVING               while the save runs (removed after its commit)

The save id (:func:`deeppart.format.new_save_id`, 32 hex digits) is in the
key of every object a save writes, in its metadata (``save_id``) and in
the header of its data files. A save:

1. (rank 0, :func:`begin_save`) reads the marker: a committed checkpoint
   is refused unless ``overwrite``; an object named ``COMMITTED`` that is
   not DeepPart's marker is refused with
   :class:`~deeppart.errors.ForeignPathError`. It remembers the marker's
   version (ETag) it saw, and puts ``<save id>/SAVING``
   (:func:`~deeppart.format.saving_text`) before any rank uploads: the
   save id is then DeepPart's by content even while every object of the
   save is an upload in progress.
2. (every rank) uploads its data file ``<save id>/rank-NNNNN.bin``
   (multipart above a part's size, parts in parallel, memory bounded).
3. (rank 0, :func:`check_uploaded`) lists ``<save id>/`` once: every data
   file the metadata names must be there with the size its rank wrote
   (else :class:`~deeppart.errors.StoreConfigError`: a rank wrote to
   another store; or :class:`~deeppart.errors.CommitConflictError` if
   another save committed meanwhile, whose cleanup removed this one's
   objects); then (:func:`commit_save`) puts ``<save id>/metadata.json``,
   then the marker, with a conditional put: ``If-None-Match: *`` when there was no
   marker, ``If-Match: <the ETag it saw>`` when it replaces a committed
   checkpoint. Of two jobs committing one step only one put succeeds; the
   other raises :class:`~deeppart.errors.CommitConflictError` and removes
   its own objects (:func:`remove_save`). The marker names the save id and
   the SHA-256 of its metadata.
4. After its commit, rank 0 removes the objects of the saves it found
   under the prefix when it began (step 1): the checkpoint it replaced and
   interrupted saves, found by their save id and recognised as DeepPart's
   by content (the data files' header and the metadata's ``save_id``),
   never by a name pattern alone (:func:`remove_save`), and aborts their
   incomplete multipart uploads of data files (a killed writer's), then
   removes its own ``SAVING``. A save that was
   still running then began before this commit, so its own conditional
   put can no longer succeed: it fails, and removes its objects itself.
   Saves that began later are left to the next save. No clock is
   compared. Nothing else under the prefix is ever deleted.

A load (:func:`open_committed`) reads the marker, then the metadata it
names, and checks it against the marker's hash: it sees only committed
checkpoints. The data files are read by ranges (:class:`ObjectDir`).

Multipart uploads that a killed process leaves incomplete are invisible
to listing, and ``obstore`` (``object_store``) has no call to list or abort
them: :meth:`~deeppart.storage.base.ObjectStore.abort_uploads` does it
through boto3 where it is installed (else a bucket lifecycle rule,
``AbortIncompleteMultipartUpload``, removes them: docs/ARCHITECTURE.md),
for the saves that never committed (their ``SAVING`` object is there and
DeepPart's), and only for the keys of data files under them. A writer
that fails in-process completes its upload and deletes the object, so
nothing stays behind.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from deeppart.errors import (
    CheckpointError,
    CommitConflictError,
    CorruptCheckpointError,
    ForeignPathError,
    StoreConfigError,
)
from deeppart.format import (
    HEADER_SIZE,
    MARKER,
    MARKER_PREFIX,
    MAX_MARKER_BYTES,
    MAX_METADATA_BYTES,
    METADATA,
    SAVING,
    data_file_name,
    header_save_id,
    marker_text,
    saving_text,
)
from deeppart.storage.base import ObjectExistsError, ObjectStore, RangeReader
from deeppart.storage.identity import check_written
from deeppart.storage.ownership import checkpoint_file, head_save_id

__all__ = [
    "Begun",
    "Marker",
    "ObjectDir",
    "abandon_save",
    "begin_save",
    "check_uploaded",
    "commit_save",
    "data_key",
    "marker_bytes",
    "open_committed",
    "owned_object",
    "read_marker",
    "remove_save",
    "save_groups",
]

_SAVE_ID = re.compile(r"[0-9a-f]{32}")
_MARKER_SAVE = re.compile(rb"save ([0-9a-f]{32})\n")
_MARKER_SHA = re.compile(rb"sha256 ([0-9a-f]{64})\n")


def marker_bytes(meta: bytes, save_id: str) -> bytes:
    """The marker of a checkpoint in an object store: the file system's
    marker text (format, version, SHA-256 of the metadata) and the save id."""
    return marker_text(meta) + f"save {save_id}\n".encode()


@dataclass(frozen=True)
class Marker:
    """A DeepPart commit marker as read: the save it commits, the SHA-256
    of that save's metadata, and the marker's version tag (ETag)."""

    save_id: str
    sha256: str
    tag: str | None


def read_marker(store: ObjectStore) -> Marker | None:
    """The marker at ``store``'s root; None if there is none;
    :class:`ForeignPathError` if an object named ``COMMITTED`` is there
    that is not DeepPart's."""
    try:
        info = store.head(MARKER)
    except FileNotFoundError:
        return None
    data = b""
    if info.size <= MAX_MARKER_BYTES:
        try:
            data = store.get(MARKER)
        except FileNotFoundError:
            return None
    save = _MARKER_SAVE.search(data)
    sha = _MARKER_SHA.search(data)
    if not data.startswith(MARKER_PREFIX) or save is None or sha is None:
        raise ForeignPathError(
            f"{store.describe(MARKER)}: an object DeepPart did not write; DeepPart replaces "
            "only its own checkpoints: remove it or save to another prefix"
        )
    return Marker(save.group(1).decode(), sha.group(1).decode(), info.tag)


@dataclass(frozen=True)
class ObjectDir:
    """The objects of one save (``<save id>/...`` in ``store``), as the
    load's readers use a checkpoint directory: ``dir / name`` is how a
    file is named in messages, :meth:`open` reads it by ranges."""

    store: ObjectStore
    save_id: str

    def key(self, name: str) -> str:
        return f"{self.save_id}/{name}"

    def __truediv__(self, name: str) -> str:
        return self.store.describe(self.key(name))

    def __str__(self) -> str:
        return self.store.url

    @property
    def name(self) -> str:
        return self.store.url.rstrip("/").rsplit("/", 1)[-1]

    def open(self, name: str, expect: Iterable[tuple[int, int]] | None = None) -> RangeReader:
        """``name`` open for ranged reads; ``expect``: the ranges about to be
        read, in order (:meth:`ObjectStore.open`: read ahead)."""
        return self.store.open(self.key(name), expect)

    def size(self, name: str) -> int:
        """The size of ``name``; :class:`CorruptCheckpointError` naming the
        object if it is missing."""
        try:
            return self.store.head(self.key(name)).size
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"{self / name}: missing") from e


def open_committed(store: ObjectStore) -> tuple[ObjectDir, bytes]:
    """The committed checkpoint at ``store``'s root and its metadata text,
    checked against the marker; :class:`CheckpointError` if there is no
    marker (nothing committed there), :class:`CorruptCheckpointError` if
    the metadata it names is missing or does not match it."""
    marker = read_marker(store)
    if marker is None:
        store.probe()  # a missing bucket answers a HEAD as a missing object does
        raise CheckpointError(
            f"{store.url}: no {MARKER} marker; no committed checkpoint there "
            "(nothing saved, or a save was interrupted)"
        )
    at = ObjectDir(store, marker.save_id)
    try:
        info = store.head(at.key(METADATA))
        if info.size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{at / METADATA}: larger than the limit of {MAX_METADATA_BYTES} bytes"
            )
        text = store.get(at.key(METADATA))
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"{at / METADATA}: missing (named by {MARKER})") from e
    if hashlib.sha256(text).hexdigest() != marker.sha256:
        raise CorruptCheckpointError(
            f"{at / METADATA}: does not match the hash in {store.describe(MARKER)}"
        )
    return at, text


@dataclass(frozen=True)
class Begun:
    """What a save saw when it began: the marker (None if none) and the
    save ids of the object groups under the prefix (earlier saves)."""

    marker: Marker | None
    saves: list[str]
    #: Not empty once the commit's marker put was sent: if it then failed
    #: without an answer, the marker may still have been written.
    sent: list[bool] = field(default_factory=list)


def begin_save(store: ObjectStore, overwrite: bool, save_id: str) -> Begun:
    """Rank 0, before anything is written: the marker now at ``store``
    and the saves found there, after refusing a committed checkpoint unless
    ``overwrite``, a damaged one even with it (its evidence is kept), and
    an object ``COMMITTED`` that is not DeepPart's; then puts ``<save_id>/SAVING``."""
    marker = read_marker(store)
    if marker is not None:
        try:
            open_committed(store)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(
                f"{store.url}: a damaged checkpoint ({e}); it is kept as evidence and never "
                "replaced, even with overwrite=True: inspect it, then remove it to save there"
            ) from e
        except CheckpointError:
            pass  # removed meanwhile: nothing to keep
    if marker is not None and not overwrite:
        raise CheckpointError(
            f"{store.url}: a committed checkpoint exists "
            "(overwrite=False; pass overwrite=True to replace it)"
        )
    begun = Begun(marker, save_groups(store))
    store.put(f"{save_id}/{SAVING}", saving_text(save_id), create=True)
    return begun


def save_groups(store: ObjectStore) -> list[str]:
    """The save ids that name a top-level group ``<save id>/`` of objects
    under ``store`` (sorted)."""
    found = set()
    for o in store.list():
        top, sep, _ = o.name.partition("/")
        if sep and _SAVE_ID.fullmatch(top):
            found.add(top)
    return sorted(found)


def check_uploaded(store: ObjectStore, save_id: str, sizes: Sequence[int], begun: Begun) -> None:
    """Rank 0, before :func:`commit_save`: every rank r's data file of the
    save ``save_id`` is in ``store`` with ``sizes[r]`` bytes, by one
    listing of ``<save_id>/`` (a request per 1,000 objects). Else
    :class:`CommitConflictError` if a save committed there since this one
    began (its cleanup removed this save's objects, as an interrupted
    save's: see the module's docstring), :class:`StoreConfigError` naming
    the missing files otherwise."""
    listed = {o.name: o.size for o in store.list(save_id)}
    seen = [listed.get(data_key(save_id, r)) for r in range(len(sizes))]
    endpoint = store.identity().get("endpoint")
    where = store.describe(save_id) + (f" (endpoint {endpoint})" if endpoint else "")
    try:
        check_written(where, seen, sizes)
    except StoreConfigError as e:
        if _committed_since(store, begun):
            raise CommitConflictError(
                f"{store.url}: another save committed there while this one was writing "
                "(and removed this save's objects); that checkpoint is kept and this save failed"
            ) from e
        raise


def _committed_since(store: ObjectStore, begun: Begun) -> bool:
    """Whether the marker at ``store`` is another than the one the save
    saw when it began (``begun``); False if it cannot be read."""
    try:
        marker = read_marker(store)
    except Exception:
        return False
    seen = begun.marker
    return marker is not None and (seen is None or marker.tag != seen.tag)


def commit_save(
    store: ObjectStore, save_id: str, meta: bytes, begun: Begun, overwrite: bool
) -> None:
    """Rank 0's commit of the save ``save_id`` (every data file uploaded):
    its metadata, then the marker by a conditional put (see the module's
    docstring); then the replaced checkpoint's and interrupted saves'
    objects are removed. A refused put raises :class:`CommitConflictError`
    (the caller removes this save's objects)."""
    store.put(f"{save_id}/{METADATA}", meta)
    marker = marker_bytes(meta, save_id)
    seen = begun.marker
    begun.sent.append(True)
    try:
        if seen is None:
            store.put(MARKER, marker, create=True)
        else:
            store.put(MARKER, marker, if_match=seen.tag)
    except ObjectExistsError as e:
        # A retried put (the first applied, its answer lost) is refused by
        # its own marker: then this save did commit.
        if _names(store, save_id):
            return _tidy(store, save_id, begun)
        raise CommitConflictError(
            f"{store.url}: another save committed there while this one was writing"
            + (" (overwrite=False)" if not overwrite else " (it replaced the checkpoint this save"
               " was to replace)")
            + "; that checkpoint is kept and this save failed"
        ) from e  # fmt: skip
    except Exception as e:
        # No answer (a timeout, the server gone): the put may have been
        # applied; it is this save's commit if the marker now names it.
        if not _names(store, save_id):
            raise e
    _tidy(store, save_id, begun)


def _tidy(store: ObjectStore, save_id: str, begun: Begun) -> None:
    """After the commit of ``save_id``: removes the saves found when it
    began (see the module's docstring)."""
    left: list[str] = []
    for earlier in begun.saves:
        if earlier != save_id:
            left += remove_save(store, earlier)
    store.delete(f"{save_id}/{SAVING}")
    if left:
        warnings.warn(
            f"{store.url}: kept objects DeepPart did not write: {', '.join(left[:5])}",
            stacklevel=4,
        )


def _names(store: ObjectStore, save_id: str) -> bool:
    """Whether the marker at ``store`` can be read and names ``save_id``."""
    try:
        marker = read_marker(store)
    except Exception:
        return False
    return marker is not None and marker.save_id == save_id


def owned_object(store: ObjectStore, name: str, save_id: str) -> bool:
    """Whether the object ``<save_id>/name`` is DeepPart's, of that save,
    by its name and content: a data file whose header carries ``save_id``,
    a metadata.json of DeepPart's format recording ``save_id``, or the
    save's ``SAVING`` object."""
    key = f"{save_id}/{name}"
    if name == SAVING:
        try:
            return store.get(key) == saving_text(save_id)
        except FileNotFoundError:
            return False
    if "/" in name or not checkpoint_file(name) or name == MARKER:
        return False
    head = bytearray(HEADER_SIZE)
    try:
        n = store.read_into(key, 0, memoryview(head))
    except FileNotFoundError:
        return False
    data = bytes(head[:n])
    if name == METADATA:
        return head_save_id(data) == save_id
    return header_save_id(data) == save_id


def abandon_save(store: ObjectStore, save_id: str, begun: Begun) -> list[str]:
    """Removes a failed save's objects (:func:`remove_save`), unless its
    marker put was sent and the marker may name it (it does, or it cannot
    be read): a put that failed without an answer may still have been
    applied, and a committed checkpoint's objects are never removed. Then
    nothing is removed and ``["(commit outcome unknown)"]`` is returned;
    the next save of the prefix tidies (it reads the marker first)."""
    if begun.sent:
        try:
            marker = read_marker(store)
        except Exception:
            return ["(commit outcome unknown)"]
        if marker is not None and marker.save_id == save_id:
            return ["(committed after all)"]
    return remove_save(store, save_id)


def remove_save(store: ObjectStore, save_id: str, names: Iterable[str] | None = None) -> list[str]:
    """Removes the objects of the save ``save_id`` (all of them under
    ``<save_id>/``, or only ``names``) that are DeepPart's by content
    (:func:`owned_object`); returns the names of the others, which stay.
    A save that never committed (its ``SAVING`` object is there and
    DeepPart's) may have left incomplete multipart uploads of its data
    files: they are aborted first
    (:meth:`~deeppart.storage.base.ObjectStore.abort_uploads`; a committed
    save's uploads all completed before its commit, so pruning asks the
    store nothing more); ``SAVING`` goes last, so that a removal cut short
    is still recognised by the next save."""
    if names is None:
        names = [o.name[len(save_id) + 1 :] for o in store.list(save_id)]
    owned = [name for name in names if owned_object(store, name, save_id)]
    if SAVING in owned:
        store.abort_uploads(save_id, _data_file)
    for name in sorted(owned, key=lambda name: name == SAVING):
        store.delete(f"{save_id}/{name}")
    return [f"{save_id}/{name}" for name in names if name not in owned]


def _data_file(name: str) -> bool:
    """Whether ``name`` (under a save id) is a data file's."""
    return "/" not in name and checkpoint_file(name) and name not in (MARKER, METADATA)


def data_key(save_id: str, rank: int) -> str:
    """The key of rank ``rank``'s data file of the save ``save_id``."""
    return f"{save_id}/{data_file_name(rank)}"
