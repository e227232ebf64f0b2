"""Where the tools (``inspect``, ``export``, ``manifest``) read a
checkpoint: a directory, or an object store URL (``s3://bucket/run/step-1``),
each through its source (:mod:`deeppart.storage.source`).

A checkpoint in an object store is read only when committed: its
``COMMITTED`` marker names the save whose metadata it hashes
(:func:`deeppart.storage.objects.open_committed`); its data files are read
by ranged requests, read ahead (:class:`~deeppart.storage.files.StoredFile`).
"""

from __future__ import annotations

import os
from pathlib import Path

from deeppart.format import METADATA
from deeppart.storage.files import CheckpointDir, LocalFile, StoredFile
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import S3URL, parse_location

__all__ = ["LocalFile", "StoredFile", "committed_metadata", "open_source", "source_location"]


def source_location(text: str | os.PathLike[str]) -> Path | S3URL:
    """A checkpoint given on the command line: a directory (or the
    ``metadata.json`` in it, meaning its directory), or an ``s3://`` URL;
    other URLs raise :class:`~deeppart.errors.UnsupportedURLError`."""
    source = checkpoint_source(parse_location(text))
    local = source.local_dir()
    if local is not None and local.name == METADATA:
        return local.parent
    return source.location


def open_source(where: Path | S3URL) -> tuple[CheckpointDir, bytes]:
    """The committed checkpoint at ``where`` (its files) and its metadata,
    checked against the marker (:class:`CheckpointError` if nothing is
    committed there, :class:`CorruptCheckpointError` if the metadata does
    not match)."""
    return checkpoint_source(where).open_committed()


def committed_metadata(where: Path | S3URL) -> bytes:
    """The metadata of the committed checkpoint at ``where``, checked
    against its marker."""
    return checkpoint_source(where).committed_metadata()
