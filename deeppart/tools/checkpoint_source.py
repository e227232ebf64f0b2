"""Where the tools (``inspect``, ``export``, ``manifest``) read a
checkpoint: a directory, or an object store URL (``s3://bucket/run/step-1``)
read through the storage layer (:mod:`deeppart.storage`).

A checkpoint in an object store is read only when committed: its
``COMMITTED`` marker names the save whose metadata it hashes
(:func:`deeppart.storage.objects.open_committed`); its data files are read
by ranged requests, read ahead (:class:`StoredFile`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deeppart.errors import CorruptCheckpointError
from deeppart.format import METADATA, open_regular, read_checked_metadata
from deeppart.storage import S3URL, open_store, parse_location
from deeppart.storage.objects import ObjectDir, open_committed

__all__ = ["LocalFile", "StoredFile", "committed_metadata", "open_source", "source_location"]


def source_location(text: str | os.PathLike[str]) -> Path | S3URL:
    """A checkpoint given on the command line: a directory (or the
    ``metadata.json`` in it, meaning its directory), or an ``s3://`` URL;
    other URLs raise :class:`~deeppart.errors.UnsupportedURLError`."""
    where = parse_location(text)
    if isinstance(where, Path) and where.name == METADATA:
        return where.parent
    return where


def open_source(where: S3URL) -> tuple[ObjectDir, bytes]:
    """The committed checkpoint at ``where`` (its objects) and its
    metadata, checked against the marker (:class:`CheckpointError` if
    nothing is committed there, :class:`CorruptCheckpointError` if the
    metadata does not match)."""
    return open_committed(open_store(where))


def committed_metadata(where: Path | S3URL) -> bytes:
    """The metadata of the committed checkpoint at ``where``, checked
    against its marker."""
    if isinstance(where, S3URL):
        return open_source(where)[1]
    return read_checked_metadata(where)


@dataclass(frozen=True)
class LocalFile:
    """A data file in a checkpoint directory."""

    path: Path

    @property
    def label(self) -> str:
        return str(self.path)

    def size(self) -> int:
        """Its size (:class:`OSError` if it is missing)."""
        return self.path.stat().st_size

    def open(self, expect: Iterable[tuple[int, int]] | None = None) -> Any:
        """A binary file (regular files only, never a FIFO or a link);
        ``expect`` is ignored (the page cache reads ahead)."""
        return open_regular(self.path)


@dataclass(frozen=True)
class StoredFile:
    """A data file of a checkpoint in an object store."""

    at: ObjectDir
    name: str

    @property
    def label(self) -> str:
        return self.at / self.name

    def size(self) -> int:
        """Its size (:class:`FileNotFoundError` if there is no such object)."""
        try:
            return self.at.size(self.name)
        except CorruptCheckpointError as e:
            raise FileNotFoundError(errno.ENOENT, "no such object", self.label) from e

    def open(self, expect: Iterable[tuple[int, int]] | None = None) -> Any:
        """A seekable reader by ranged requests; ``expect``: the ranges about
        to be read, in order, read ahead in large chunks
        (:mod:`deeppart.storage.readahead`)."""
        return self.at.open(self.name, expect)
