"""The storage interface: a flat namespace of named objects under one root.

An :class:`ObjectStore` is what a save writes into and a load reads from,
whatever holds the bytes: a directory on a file system
(:class:`deeppart.storage.local.LocalStore`) or a prefix of an S3 bucket
(:class:`deeppart.storage.s3.S3Store`). Names are relative, ``/``-separated
(``"0123abcd.../rank-00000.bin"``); a store never interprets them beyond
that. The operations are the ones object stores share: whole and ranged
reads, a put that can refuse to replace (``create=True``, S3's
``If-None-Match: *``) or replace only a known version (``if_match``, S3's
``If-Match``), a streaming writer (multipart on S3), listing and deletion.
There is no rename: commits on object stores are conditional puts
(:mod:`deeppart.storage.objects`).

A missing object raises :class:`FileNotFoundError` (naming it); a refused
conditional put raises :class:`ObjectExistsError`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from deeppart.errors import ObjectExistsError
from deeppart.storage.identity import Identity
from deeppart.storage.readahead import ReadAhead

__all__ = [
    "ObjectExistsError",
    "ObjectInfo",
    "ObjectStore",
    "ObjectWriter",
    "RangeReader",
]


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its name (relative to the store's root), size,
    modification time (seconds since the epoch, as the store reports it:
    whole seconds on S3) and version tag (S3's ETag; None where the store
    has none)."""

    name: str
    size: int
    modified: float
    tag: str | None = None


class ObjectWriter(Protocol):
    """A streaming upload of one object: ``write`` appends, ``close``
    makes the object appear whole (never partly written), ``abort``
    gives it up (the object does not appear, or is removed)."""

    def write(self, data: Any, /) -> int: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


class RangeReader:
    """A read-only, seekable file over one object of ``store``: each
    ``readinto``/``read`` is one ranged read (a ranged GET on S3), so a
    reader that seeks to a piece reads only that piece's bytes. Enough of
    :class:`io.RawIOBase` for the load's readers (``seek``, ``tell``,
    ``read``, ``readinto``).

    ``ahead``: a :class:`~deeppart.storage.readahead.ReadAhead` of the
    ranges the caller said it will read (:meth:`ObjectStore.open`); reads
    are served from its chunks where they hold the bytes, by ranged reads
    where not."""

    def __init__(self, store: ObjectStore, name: str, ahead: ReadAhead | None = None) -> None:
        self.store = store
        self.name = name
        self.pos = 0
        self.ahead = ahead

    def seek(self, pos: int, whence: int = 0) -> int:
        if whence != 0:
            raise ValueError("RangeReader seeks from the start only")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        n = self.ahead.readinto(self.pos, view) if self.ahead is not None else 0
        if n < len(view):
            n += self.store.read_into(self.name, self.pos + n, view[n:])
        self.pos += n
        return n

    def read(self, size: int) -> bytes:
        out = bytearray(size)
        n = self.readinto(out)
        return bytes(out[:n])

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
            self.ahead = None

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ObjectStore(abc.ABC):
    """Named objects under one root (see the module's docstring)."""

    #: How the root is shown in messages (a path, or ``s3://bucket/prefix``).
    url: str

    def describe(self, name: str) -> str:
        """``name`` as shown in messages: the root's URL and the name."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def identity(self) -> Identity:
        """The store as this process resolved it, which every rank of a
        save must share (:mod:`deeppart.storage.identity`); by default its
        root as shown."""
        return {"store": self.url}

    def probe(self) -> None:
        """Raises :class:`~deeppart.errors.StoreConfigError` if the store
        itself cannot be used (S3: a bucket that does not exist, an
        endpoint that cannot be reached), which a missing object's error
        does not tell apart; by default nothing."""
        return None

    @abc.abstractmethod
    def child(self, prefix: str) -> ObjectStore:
        """The store rooted at ``prefix`` under this one's root."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes:
        """The whole object ``name``."""

    @abc.abstractmethod
    def read_into(self, name: str, offset: int, buf: memoryview) -> int:
        """Reads bytes ``offset .. offset + len(buf)`` of ``name`` into
        ``buf``; returns how many there were (fewer at the object's end,
        0 at or past it)."""

    def read_range(self, name: str, offset: int, length: int) -> Any:
        """Bytes ``offset .. offset + length`` of ``name`` as a buffer
        (fewer at the object's end, none at or past it)."""
        buf = bytearray(length)
        n = self.read_into(name, offset, memoryview(buf))
        return memoryview(buf)[:n]

    @abc.abstractmethod
    def head(self, name: str) -> ObjectInfo:
        """The size, time and version of ``name``."""

    @abc.abstractmethod
    def put(
        self, name: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str | None:
        """Writes ``name`` whole (atomically: readers see the old object or
        the new one); returns its new version tag. ``create``: only if no
        object ``name`` exists; ``if_match``: only if its version tag is
        still ``if_match``. Else :class:`ObjectExistsError`, and nothing
        changes."""

    @abc.abstractmethod
    def writer(self, name: str) -> ObjectWriter:
        """A streaming writer of the object ``name`` (replaces it on
        ``close``)."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose name starts with ``prefix`` (a directory-like
        prefix: ``"a"`` lists ``a/...``, never ``ab``), at any depth."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Removes the object ``name`` (nothing if it is already gone)."""

    def abort_uploads(self, prefix: str, accept: Callable[[str], bool]) -> tuple[str, ...]:
        """Aborts the incomplete uploads (S3 multipart uploads that a killed
        writer left, invisible to :meth:`list`) of the objects under
        ``prefix`` whose name (relative to ``prefix``) ``accept`` admits;
        returns those names. A store without such uploads, or without a way
        to list them, aborts nothing."""
        return ()

    #: Read-ahead (:mod:`deeppart.storage.readahead`) for readers that
    #: declare their ranges: the chunk size, the most chunks held at once
    #: (0: none, every read is a ranged read) and the fetches in parallel.
    read_chunk_bytes = 8 << 20
    read_ahead = 0
    read_threads = 1

    def open(self, name: str, expect: Iterable[tuple[int, int]] | None = None) -> RangeReader:
        """A seekable reader of ``name`` by ranged reads. ``expect``: the
        ``(offset, length)`` ranges the caller is about to read, in
        ascending order; where the store has a read-ahead
        (:attr:`read_ahead`), they are fetched in large chunks in the
        background and the reads served from them."""
        ahead = None
        if expect is not None and self.read_ahead > 0:
            ahead = ReadAhead(
                lambda offset, length: self.read_range(name, offset, length),
                expect,
                self.describe(name),
                chunk_bytes=self.read_chunk_bytes,
                ahead=self.read_ahead,
                threads=self.read_threads,
            )
        return RangeReader(self, name, ahead)
