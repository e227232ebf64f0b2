"""Where a save writes and how it commits: the save's side of the storage
layer.

:func:`save_target` gives the :class:`SaveTarget` of a location: a
:class:`LocalTarget` for a file system path (the temporary directory, its
lock, the rename that cannot replace, ownership by content:
:mod:`deeppart.storage.commit`, unchanged) or an :class:`ObjectTarget` for an
object store (the conditional marker: :mod:`deeppart.storage.objects`).
The save's stages call the same methods on either
(:meth:`SaveTarget.check` and :meth:`~SaveTarget.identity` on every rank,
:meth:`~SaveTarget.begin` on rank 0, :meth:`~SaveTarget.sees` and
:meth:`~SaveTarget.data_file` on every rank,
:meth:`~SaveTarget.check_written` then :meth:`~SaveTarget.commit`, or
:meth:`~SaveTarget.abandon`, on rank 0).

Every rank must write into the one store that rank 0 commits to
(:mod:`deeppart.storage.identity`). In an object store the ranks compare
the identity of the store each resolved (endpoint, region, bucket, prefix,
addressing) in the save's prepare agreement, before anything is written.
On a file system one path can be a different directory on each node (a
node-local disk): once rank 0 has made the save's temporary directory
(its name ends in 48 random bits, made for this save), every rank checks
that it sees it, in one more small agreement before anything is written.
And before the commit rank 0 checks that every data file is in its store
with the size its rank wrote (one listing of the save's prefix in an
object store, one ``stat`` per data file on a file system).
"""

from __future__ import annotations

import abc
import contextlib
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from deeppart.errors import StoreConfigError
from deeppart.format import data_file_name
from deeppart.storage.base import ObjectStore
from deeppart.storage.commit import KeepAside, commit_dir, make_temp_dir, remove_temp_dir
from deeppart.storage.identity import Identity, check_written, ranks_text
from deeppart.storage.objects import (
    Begun,
    abandon_save,
    begin_save,
    check_uploaded,
    commit_save,
    data_key,
)
from deeppart.storage.ownership import check_target
from deeppart.storage.s3 import s3_store
from deeppart.storage.url import S3URL

__all__ = ["LocalTarget", "ObjectTarget", "SaveTarget", "location_name", "save_target"]

#: Opens a data file for writing: a context manager over a binary file
#: (``write``, ``seek`` forward, ``tell``, ``truncate`` at the end).
Opener = Callable[[], contextlib.AbstractContextManager[Any]]


class SaveTarget(abc.ABC):
    """A save's location (see the module's docstring)."""

    #: How the location is shown in messages and Stats.
    shown: str

    @abc.abstractmethod
    def check(self) -> None:
        """Every rank, before the save's first agreement: refuses a
        location that holds something DeepPart may not replace."""

    @abc.abstractmethod
    def identity(self) -> Identity:
        """Every rank, before the save's prepare agreement: the store as
        this rank resolved it (:mod:`deeppart.storage.identity`)."""

    #: Whether every rank checks, once rank 0 has begun the save, that it
    #: sees what rank 0 made (:meth:`sees`: one more agreement).
    check_seen = False

    def sees(self, token: str) -> bool:
        """Every rank, after :meth:`begin` on rank 0, when
        :attr:`check_seen`: whether it sees where rank 0 began the save."""
        return True

    def unseen_error(self, token: str, blind: list[int]) -> StoreConfigError:
        """The error every rank raises when the ranks ``blind`` do not see
        where rank 0 began the save."""
        return StoreConfigError(f"{self.shown}: {ranks_text(blind)} cannot see this save")

    @abc.abstractmethod
    def check_written(self, token: str, save_id: str, sizes: Sequence[int]) -> None:
        """Rank 0, before :meth:`commit`: raises StoreConfigError unless
        every rank r's data file is in the store with ``sizes[r]`` bytes."""

    @abc.abstractmethod
    def begin(self, save_id: str, overwrite: bool) -> str:
        """Rank 0, before anything is written: prepares the save (refusing
        a committed checkpoint unless ``overwrite``); returns what the
        other ranks need to find where to write (sent to them), at most
        :data:`deeppart.storage.commit.TEMP_NAME_MAX` bytes."""

    @abc.abstractmethod
    def data_file(self, token: str, save_id: str, rank: int) -> tuple[Path, Opener | None]:
        """Where rank ``rank`` writes its data file: a path (named in
        messages and fault hooks) and how to open it (None: the path on
        the file system, written and fsynced)."""

    @abc.abstractmethod
    def commit(
        self, token: str, save_id: str, meta: bytes, overwrite: bool, keep: KeepAside | None = None
    ) -> None:
        """Rank 0, once every data file is written: commits the save;
        ``keep``: a replaced checkpoint to keep under another name
        (:class:`deeppart.storage.commit.KeepAside`; a file system only)."""

    @abc.abstractmethod
    def abandon(self, token: str, save_id: str) -> None:
        """Rank 0, after a failure: removes what this save wrote."""


class LocalTarget(SaveTarget):
    """A checkpoint directory on a file system (:mod:`deeppart.storage.commit`)."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.shown = str(final)

    #: One path can be a different directory on each node.
    check_seen = True

    def check(self) -> None:
        check_target(self.final)

    def identity(self) -> Identity:
        return {"directory": os.path.abspath(self.final)}

    def begin(self, save_id: str, overwrite: bool) -> str:
        return make_temp_dir(self.final, overwrite)

    def _tmp(self, token: str) -> Path:
        return self.final.parent / token

    def sees(self, token: str) -> bool:
        # Its name ends in 48 random bits, made by rank 0 for this save.
        tmp = self._tmp(token)
        return tmp.is_dir() and not tmp.is_symlink()

    def unseen_error(self, token: str, blind: list[int]) -> StoreConfigError:
        return StoreConfigError(
            f"{self._tmp(token)}: {ranks_text(blind)} {'does' if len(blind) == 1 else 'do'} not "
            "see this save's temporary directory, "
            f"which rank 0 has just made: the ranks do not share one file system at "
            f"{self.final.parent} (a node-local disk?). A save's directory must be on a file "
            "system every rank sees (node-local copies: Checkpointer(config=...), "
            "docs/LEVELS.md); nothing was written"
        )

    def check_written(self, token: str, save_id: str, sizes: Sequence[int]) -> None:
        tmp = self._tmp(token)
        paths = [tmp / data_file_name(r) for r in range(len(sizes))]
        if len(paths) <= _STAT_THREADS:
            seen = [_file_size(p) for p in paths]
        else:  # a parallel file system answers each stat in a round trip
            with ThreadPoolExecutor(_STAT_THREADS, thread_name_prefix="deeppart-stat") as pool:
                seen = list(pool.map(_file_size, paths))
        check_written(str(tmp), seen, sizes)

    def data_file(self, token: str, save_id: str, rank: int) -> tuple[Path, Opener | None]:
        return self._tmp(token) / data_file_name(rank), None

    def commit(
        self, token: str, save_id: str, meta: bytes, overwrite: bool, keep: KeepAside | None = None
    ) -> None:
        commit_dir(
            self._tmp(token), self.final, meta, overwrite=overwrite, save_id=save_id, keep=keep
        )

    def abandon(self, token: str, save_id: str) -> None:
        remove_temp_dir(self._tmp(token), save_id)


#: The stats of data files that rank 0 runs at once before a commit.
_STAT_THREADS = 16


def _file_size(path: Path) -> int | None:
    """The size of the regular file ``path`` (None: missing, or not one)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


class _Upload:
    """A data file uploaded as it is written: the file interface the
    writer uses (forward seeks fill with zeros when the next bytes are
    written, so the object is exactly the file the file system would
    hold)."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.writer = store.writer(key)
        self.written = 0
        self.pos = 0

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int) -> int:
        if pos < self.written:
            raise ValueError(f"an upload cannot seek back (to {pos}, {self.written} written)")
        self.pos = pos
        return pos

    def write(self, data: Any) -> int:
        if self.pos > self.written:
            self.writer.write(bytes(self.pos - self.written))
            self.written = self.pos
        n = self.writer.write(data)
        self.written += n
        self.pos = self.written
        return n

    def truncate(self, size: int) -> int:
        if size != self.written:
            raise ValueError(f"an upload ends where it was written ({self.written}), not {size}")
        return size

    def flush(self) -> None:
        pass


@contextlib.contextmanager
def _upload(store: ObjectStore, key: str) -> Iterator[_Upload]:
    up = _Upload(store, key)
    try:
        yield up
    except BaseException:
        up.writer.abort()
        raise
    up.writer.close()


class ObjectTarget(SaveTarget):
    """A checkpoint in an object store (:mod:`deeppart.storage.objects`)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.shown = store.url
        #: What rank 0 saw in :meth:`begin`.
        self.begun = Begun(None, [])

    def check(self) -> None:
        pass  # rank 0's begin reads the marker; objects beside ours are never touched

    def identity(self) -> Identity:
        return self.store.identity()

    def check_written(self, token: str, save_id: str, sizes: Sequence[int]) -> None:
        check_uploaded(self.store, save_id, sizes, self.begun)

    def begin(self, save_id: str, overwrite: bool) -> str:
        self.begun = begin_save(self.store, overwrite, save_id)
        return save_id

    def data_file(self, token: str, save_id: str, rank: int) -> tuple[Path, Opener | None]:
        key = data_key(save_id, rank)
        return Path(self.store.describe(key)), lambda: _upload(self.store, key)

    def commit(
        self, token: str, save_id: str, meta: bytes, overwrite: bool, keep: KeepAside | None = None
    ) -> None:
        if keep is not None:
            raise ValueError(f"{self.shown}: an object store has no rename to keep a step aside")
        commit_save(self.store, save_id, meta, self.begun, overwrite)

    def abandon(self, token: str, save_id: str) -> None:
        # Never raises: rank 0 runs it before the agreement that reports
        # the save's own failure to every rank (a store that stopped
        # answering fails here too; the next save of the prefix removes
        # what is left).
        try:
            left = abandon_save(self.store, save_id, self.begun)
        except Exception as e:
            left = [f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"]
        if left:
            warnings.warn(
                f"{self.store.url}: the failed save {save_id} left objects "
                f"({', '.join(left[:5])}); the next save of this prefix removes DeepPart's",
                stacklevel=2,
            )


def save_target(location: Path | S3URL) -> SaveTarget:
    """The :class:`SaveTarget` of a parsed location
    (:func:`deeppart.storage.url.parse_location`)."""
    if isinstance(location, S3URL):
        return ObjectTarget(s3_store(location))
    return LocalTarget(location)


def location_name(location: Path | S3URL | str | os.PathLike[str]) -> str:
    """The last component of a location, for thread names and messages."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]
