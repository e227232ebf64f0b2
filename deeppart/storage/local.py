"""The file system behind the storage interface.

:class:`LocalStore` is an :class:`~deeppart.storage.base.ObjectStore` over
a directory: object names are relative paths in it. Objects appear whole
(written to a temporary name, fsynced, then renamed), ``create=True`` puts
never replace (:func:`deeppart.storage.commit.rename_noreplace`), and reads refuse
what is not a regular file (:func:`deeppart.format.open_regular`).

Checkpoints on a file system keep their own commit, with a rename
(:mod:`deeppart.storage.commit`: the temporary directory, its lock, the commit and
ownership by content): :class:`deeppart.storage.target.LocalTarget` runs
it. This store serves the tools that treat a file system directory and an
object store alike, and tests of the interface.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deeppart.format import fsync_dir, open_regular
from deeppart.storage.base import ObjectExistsError, ObjectInfo, ObjectStore, ObjectWriter
from deeppart.storage.commit import rename_noreplace

__all__ = ["LocalStore"]


def _tag(st: os.stat_result) -> str:
    """A version tag of a file: changes when it is replaced or rewritten."""
    return f"{st.st_ino:x}-{st.st_mtime_ns:x}-{st.st_size:x}"


class _Writer:
    """Writes a temporary file next to the object, renamed over it on
    ``close`` (after an fsync)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.part")
        self.file = open(self.tmp, "xb")  # noqa: SIM115 (closed in close/abort)

    def write(self, data: Any, /) -> int:
        return self.file.write(data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            self.tmp.unlink()


class LocalStore(ObjectStore):
    """The objects (files) under the directory ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = str(self.root)

    def _path(self, name: str) -> Path:
        parts = [p for p in name.split("/") if p]
        if any(p in (".", "..") for p in parts):
            raise ValueError(f"{name!r}: '.' and '..' are not object names")
        return self.root.joinpath(*parts)

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self._path(prefix))

    def get(self, name: str) -> bytes:
        with open_regular(self._path(name)) as f:
            data: bytes = f.read()
            return data

    def read_into(self, name: str, offset: int, buf: memoryview) -> int:
        with open_regular(self._path(name)) as f:
            f.seek(offset)
            got = 0
            while got < len(buf):
                n = f.readinto(buf[got:])
                if not n:
                    break
                got += n
            return got

    def head(self, name: str) -> ObjectInfo:
        st = os.stat(self._path(name))
        return ObjectInfo(name, st.st_size, st.st_mtime, _tag(st))

    def put(
        self, name: str, data: bytes, *, create: bool = False, if_match: str | None = None
    ) -> str | None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        w = _Writer(path)
        try:
            w.write(data)
            w.file.flush()
            os.fsync(w.file.fileno())
            w.file.close()
            if create:
                try:
                    rename_noreplace(w.tmp, path)
                except FileExistsError as e:
                    raise ObjectExistsError(f"{path}: exists") from e
            else:
                with _locked(path.parent):
                    if if_match is not None:
                        try:
                            now = _tag(os.stat(path))
                        except FileNotFoundError:
                            now = None
                        if now != if_match:
                            raise ObjectExistsError(f"{path}: changed (version {now})")
                    os.replace(w.tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            w.abort()
            raise
        return _tag(os.stat(path))

    def writer(self, name: str) -> ObjectWriter:
        return _Writer(self._path(name))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        top = self._path(prefix)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for f in sorted(filenames):
                p = Path(dirpath) / f
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                name = p.relative_to(self.root).as_posix()
                yield ObjectInfo(name, st.st_size, st.st_mtime, _tag(st))

    def delete(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(name).unlink()


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive flock on ``directory`` (the compare and the replace of
    an ``if_match`` put run under it)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
