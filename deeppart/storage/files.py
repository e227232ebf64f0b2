"""A committed checkpoint's files as the load's readers see them, on a
file system or in an object store.

:data:`CheckpointDir` is what :func:`deeppart.loading.reader.open_checkpoint`
returns: a directory (:class:`~pathlib.Path`) or the objects of one save
(:class:`~deeppart.storage.objects.ObjectDir`). Both name a file as
``directory / name`` in messages; :func:`open_data` opens one for
``seek``/``readinto`` (a regular file, or ranged reads of an object), and
:func:`check_file_sizes` checks the data files' sizes against the
metadata, naming a missing or truncated file or object;
:func:`data_file` gives one file to check and read (:class:`LocalFile`,
:class:`StoredFile`), :func:`local_dir` the directory (None for objects).
The checkpoint itself is opened through its source
(:mod:`deeppart.storage.source`).
"""

from __future__ import annotations

import errno
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.errors import CorruptCheckpointError
from deeppart.format import Metadata, data_file_name, open_regular
from deeppart.format import check_file_sizes as check_local_sizes
from deeppart.storage.objects import ObjectDir

__all__ = [
    "CheckpointDir",
    "LocalFile",
    "StoredFile",
    "check_file_sizes",
    "data_file",
    "local_dir",
    "open_data",
    "read_all",
    "size_is",
]

CheckpointDir = Path | ObjectDir


def read_all(path: Path, size: int) -> npt.NDArray[np.uint8] | None:
    """The whole file if it exists with exactly ``size`` bytes, else None."""
    try:
        if path.stat().st_size != size:
            return None
        data: npt.NDArray[np.uint8] = np.fromfile(path, dtype=np.uint8)
    except (OSError, ValueError):
        return None
    return data if data.size == size else None


def size_is(path: Path, size: int) -> bool:
    """Whether ``path`` exists with exactly ``size`` bytes."""
    try:
        return path.stat().st_size == size
    except OSError:
        return False


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


def local_dir(directory: CheckpointDir) -> Path | None:
    """The directory of a checkpoint on a file system; None for the
    objects of a checkpoint in an object store."""
    return None if isinstance(directory, ObjectDir) else directory


def data_file(directory: CheckpointDir, name: str) -> LocalFile | StoredFile:
    """The data file ``name`` of a checkpoint, to check its size and read it
    (``deeppart inspect --verify``)."""
    if isinstance(directory, ObjectDir):
        return StoredFile(directory, name)
    return LocalFile(directory / name)


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
