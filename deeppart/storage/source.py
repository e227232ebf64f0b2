"""Where a checkpoint is read from: one seam, two backends, chosen once.

:func:`checkpoint_source` parses a location once
(:func:`deeppart.storage.url.parse_location`) and gives its
:class:`CheckpointSource`: a :class:`LocalSource` for a directory, an
:class:`ObjectSource` for ``s3://bucket/prefix``. Whatever reads a
checkpoint (the load, the tools, the levels' recovery, the step listings)
asks the source, never the type of the location: this module and the rest
of :mod:`deeppart.storage` are the only places that tell a path from a
URL (the save side's counterpart is :func:`deeppart.storage.target.save_target`).

What a source answers:

- :meth:`~CheckpointSource.open_committed`: the committed checkpoint (its
  files, :data:`~deeppart.storage.files.CheckpointDir`, and its metadata
  text checked against the ``COMMITTED`` marker);
- :meth:`~CheckpointSource.open_for_load`: the same, but on a file system
  the copy that an interrupted ``overwrite=True`` save moved aside when the
  directory itself is not committed (with a warning);
- :meth:`~CheckpointSource.open_written`: what was written, committed or
  not (``deeppart inspect``), and whether it is committed;
- :meth:`~CheckpointSource.is_committed`,
  :meth:`~CheckpointSource.committed_file` (one data file of a committed
  checkpoint: present with its size, and its bytes);
- :meth:`~CheckpointSource.local_dir` (the directory, or None),
  :meth:`~CheckpointSource.object_store` (the store, or None) and
  :attr:`~CheckpointSource.rereads_cached` (whether a second read of the
  same bytes is served by a cache: the page cache, not a store).
"""

from __future__ import annotations

import abc
import os
import warnings
from functools import cached_property
from pathlib import Path

import numpy as np
import numpy.typing as npt

from deeppart.errors import CheckpointError
from deeppart.format import (
    MARKER,
    MAX_METADATA_BYTES,
    METADATA,
    is_committed,
    read_checked_metadata,
    read_regular,
)
from deeppart.storage import open_store
from deeppart.storage.base import ObjectStore
from deeppart.storage.files import CheckpointDir, read_all, size_is
from deeppart.storage.objects import open_committed
from deeppart.storage.ownership import old_copies
from deeppart.storage.url import S3URL, Location, parse_location

#: A data file's bytes.
U8 = npt.NDArray[np.uint8]

__all__ = [
    "CheckpointSource",
    "LocalSource",
    "ObjectSource",
    "checkpoint_source",
    "committed_or_replaced",
]


class CheckpointSource(abc.ABC):
    """A checkpoint's location as the readers use it (see the module's
    docstring). ``str(source)`` is the location as messages show it: the
    path, or the URL."""

    #: The parsed location: a directory or an ``s3://`` URL.
    location: Location

    def __str__(self) -> str:
        return str(self.location)

    @abc.abstractmethod
    def local_dir(self) -> Path | None:
        """The checkpoint's directory on a file system; None in an object store."""

    @abc.abstractmethod
    def object_store(self) -> ObjectStore | None:
        """The object store rooted at the checkpoint's prefix; None for a
        directory (read as files)."""

    @property
    @abc.abstractmethod
    def rereads_cached(self) -> bool:
        """Whether bytes read twice are served the second time by a cache
        (a file system's page cache); an object store fetches them again."""

    @abc.abstractmethod
    def open_committed(self) -> tuple[CheckpointDir, bytes]:
        """The committed checkpoint's files and its metadata text, checked
        against the commit marker; :class:`CheckpointError` if nothing is
        committed there, :class:`~deeppart.errors.CorruptCheckpointError` if
        the metadata does not match the marker."""

    def committed_metadata(self) -> bytes:
        """The committed checkpoint's metadata text, checked against its marker."""
        return self.open_committed()[1]

    def open_for_load(self) -> tuple[CheckpointDir, bytes]:
        """What a load reads: :meth:`open_committed`, by default."""
        return self.open_committed()

    @abc.abstractmethod
    def open_written(self) -> tuple[CheckpointDir, bytes, bool]:
        """What was written, committed or not: its files, its metadata text
        and whether the commit marker matches it. In an object store only a
        committed checkpoint can be found (the marker names its objects)."""

    @abc.abstractmethod
    def is_committed(self) -> bool:
        """Whether a committed checkpoint is here (its marker and its
        metadata match); False when it cannot be read."""

    @abc.abstractmethod
    def committed_file(self, name: str, size: int, *, deep: bool) -> tuple[bool, U8 | None]:
        """The data file ``name`` of the committed checkpoint here: whether
        it is there with ``size`` bytes and, when ``deep``, its bytes as
        ``uint8`` (None when they cannot be read; the caller verifies
        them). ``(False, None)`` when nothing is committed here."""


class LocalSource(CheckpointSource):
    """A checkpoint directory on a file system."""

    def __init__(self, directory: Path) -> None:
        self.location: Path = directory

    def local_dir(self) -> Path:
        return self.location

    def object_store(self) -> ObjectStore | None:
        return None

    @property
    def rereads_cached(self) -> bool:
        return True

    def open_committed(self) -> tuple[CheckpointDir, bytes]:
        return self.location, read_checked_metadata(self.location)

    def open_for_load(self) -> tuple[CheckpointDir, bytes]:
        """The committed checkpoint, or the copy that an interrupted
        overwrite moved aside (:func:`committed_or_replaced`)."""
        path = self.location
        try:
            return path, read_checked_metadata(path)
        except CheckpointError:
            # Only on failure: the common path reads metadata.json once.
            previous = committed_or_replaced(path, stacklevel=4)
            if previous == path:
                raise
            return previous, read_checked_metadata(previous)

    def open_written(self) -> tuple[CheckpointDir, bytes, bool]:
        directory = self.location
        committed = is_committed(directory)
        if committed:
            return directory, read_checked_metadata(directory), True
        try:
            text = read_regular(directory / METADATA, MAX_METADATA_BYTES)
        except OSError as e:
            raise CheckpointError(f"{directory / METADATA}: cannot read ({e.strerror})") from e
        return directory, text, False

    def is_committed(self) -> bool:
        return is_committed(self.location)

    def committed_file(self, name: str, size: int, *, deep: bool) -> tuple[bool, U8 | None]:
        if not is_committed(self.location):
            return False, None
        if not deep:
            return size_is(self.location / name, size), None
        return True, read_all(self.location / name, size)


class ObjectSource(CheckpointSource):
    """A checkpoint under an object store prefix (``s3://bucket/prefix``):
    only a committed one is read, the save its ``COMMITTED`` marker names
    (:func:`deeppart.storage.objects.open_committed`). The store is made
    on first use, so that choosing the source reads no configuration."""

    def __init__(self, url: S3URL) -> None:
        self.location: S3URL = url

    @cached_property
    def _store(self) -> ObjectStore:
        return open_store(self.location)

    def local_dir(self) -> Path | None:
        return None

    def object_store(self) -> ObjectStore:
        return self._store

    @property
    def rereads_cached(self) -> bool:
        return False

    def open_committed(self) -> tuple[CheckpointDir, bytes]:
        return open_committed(self._store)

    def open_written(self) -> tuple[CheckpointDir, bytes, bool]:
        at, text = open_committed(self._store)
        return at, text, True

    def is_committed(self) -> bool:
        try:
            open_committed(self._store)
        except Exception:  # not committed, or the store does not answer
            return False
        return True

    def committed_file(self, name: str, size: int, *, deep: bool) -> tuple[bool, U8 | None]:
        try:
            at, _ = open_committed(self._store)
            if at.size(name) != size:
                return False, None
            if not deep:
                return True, None
            buf = np.empty(size, dtype=np.uint8)
            with at.open(name) as f:
                got = f.readinto(buf)
        except Exception:  # not committed, missing, or the store does not answer
            return False, None
        return True, (buf if got == size else None)


def checkpoint_source(
    location: str | os.PathLike[str] | S3URL | CheckpointSource,
) -> CheckpointSource:
    """The :class:`CheckpointSource` of ``location``: an :class:`ObjectSource`
    for ``s3://bucket/prefix``, a :class:`LocalSource` for a path; other
    URLs raise :class:`~deeppart.errors.UnsupportedURLError` naming the
    schemes served (:func:`~deeppart.storage.url.parse_location`). A
    location already parsed (a :class:`~pathlib.Path` or an :class:`S3URL`)
    is taken as it is, and a source is returned as it is."""
    if isinstance(location, CheckpointSource):
        return location
    where = location if isinstance(location, Path | S3URL) else parse_location(location)
    if isinstance(where, S3URL):
        return ObjectSource(where)
    return LocalSource(where)


def committed_or_replaced(path: Path, *, stacklevel: int = 3) -> Path:
    """``path`` itself, unless it is not committed and a save with
    ``overwrite=True`` that was replacing it died before its commit marker:
    then the previous checkpoint, which that save had moved aside still
    committed (``.old-NAME-*``), with a warning (``stacklevel``: its
    caller's frame, as :func:`warnings.warn` counts). Never when ``path``
    holds a ``COMMITTED`` marker that no longer matches (a damaged commit,
    newer than any copy moved aside): then its own error is raised."""
    if is_committed(path) or not path.parent.is_dir() or os.path.lexists(path / MARKER):
        # A marker at ``path`` (a damaged commit): the copy moved aside is
        # older than that commit and never served in its place.
        return path
    olds = [p for p in old_copies(path) if is_committed(p)]
    if not olds:
        return path
    previous = max(olds, key=lambda p: (p / MARKER).stat().st_mtime)
    warnings.warn(
        f"{path}: not committed (a save replacing it was interrupted); "
        f"loading the checkpoint it replaced, {previous}",
        stacklevel=stacklevel,
    )
    return previous
