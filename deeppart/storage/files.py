"""A committed checkpoint's files as the load's readers see them, on a
file system or in an object store.

:data:`CheckpointDir` is what :func:`deeppart.loading.reader.open_checkpoint`
returns: a directory (:class:`~pathlib.Path`) or the objects of one save
(:class:`~deeppart.storage.objects.ObjectDir`). Both name a file as
``directory / name`` in messages; :func:`open_data` opens one for
``seek``/``readinto`` (a regular file, or ranged reads of an object), and
:func:`check_file_sizes` checks the data files' sizes against the
metadata, naming a missing or truncated file or object.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from deeppart.errors import CorruptCheckpointError
from deeppart.format import Metadata, data_file_name, open_regular
from deeppart.format import check_file_sizes as check_local_sizes
from deeppart.storage.objects import ObjectDir, open_committed
from deeppart.storage.s3 import s3_store
from deeppart.storage.url import S3URL

__all__ = ["CheckpointDir", "check_file_sizes", "committed_metadata", "open_data"]

CheckpointDir = Path | ObjectDir


def open_data(
    directory: CheckpointDir, rank: int, expect: Iterable[tuple[int, int]] | None = None
) -> Any:
    """Rank ``rank``'s data file, open for reading;
    :class:`CorruptCheckpointError` naming it if it cannot be opened.
    ``expect``: the ``(offset, length)`` ranges the caller is about to read,
    in ascending order; an object store reads them ahead in large chunks
    (:mod:`deeppart.storage.readahead`), a file system ignores them (its
    page cache and readahead do that job)."""
    if isinstance(directory, ObjectDir):
        return directory.open(data_file_name(rank), expect)
    path = directory / data_file_name(rank)
    try:
        return open_regular(path)
    except OSError as e:
        raise CorruptCheckpointError(f"{path}: cannot open ({e.strerror})") from e


def check_file_sizes(directory: CheckpointDir, meta: Metadata, ranks: list[int]) -> None:
    """Every data file of ``ranks`` exists and has its declared size."""
    if not isinstance(directory, ObjectDir):
        check_local_sizes(directory, meta, ranks)
        return
    for r in ranks:
        name = data_file_name(r)
        size = directory.size(name)
        if size != meta.file_sizes[r]:
            raise CorruptCheckpointError(
                f"{directory / name}: {size} bytes, metadata says {meta.file_sizes[r]} "
                "(truncated or extended)"
            )


def committed_metadata(location: S3URL) -> tuple[ObjectDir, bytes, bytes]:
    """The committed checkpoint at an object store URL: its objects, its
    metadata text (checked against the marker) and that text's SHA-256."""
    at, text = open_committed(s3_store(location))
    return at, text, hashlib.sha256(text).digest()
