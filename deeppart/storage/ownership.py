"""What DeepPart owns on disk, and so may replace or remove.

A save replaces, and a cleanup removes, only directories that DeepPart
wrote: every entry in them is a regular file that DeepPart writes there,
recognised by its name *and its content* (:func:`owned_file`): a
``COMMITTED`` marker begins with the format's tag, a ``metadata.json`` is
DeepPart's metadata (``"format": "deeppart-checkpoint"``), a
``rank-NNNNN.bin`` (or ``partner-NNNNN.bin``) begins with the data files'
magic, and, where the save's id is known, carries that id. In the
multi-level engine's node-local directories the parity shards and the
``.tmp`` names of its files, whose bytes have no header, are recognised by
name inside those DeepPart-made directories. Anything else at a save's
target (a regular file, a symbolic link, a directory holding other files,
a ``metadata.json`` that is not DeepPart's) is the user's: the save is
refused with :class:`~deeppart.errors.ForeignPathError`, on every rank,
before anything is written, and cleanups leave it where it is.
An empty directory is a fine target.

Removal (:func:`remove_owned`) never recurses: it unlinks DeepPart's own
files one by one (the marker first) and removes the directory only if it
is then empty; what is not DeepPart's stays and is reported.

:func:`local_path` refuses a URL (``s3://...``) where a path is expected:
every public entry point that takes a checkpoint path calls it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from deeppart.errors import ForeignPathError, UnsupportedURLError
from deeppart.format import (
    FORMAT_NAME,
    HEADER_SIZE,
    MAGIC,
    MARKER,
    MARKER_PREFIX,
    MAX_MARKER_BYTES,
    MAX_METADATA_BYTES,
    METADATA,
    header_save_id,
)

__all__ = [
    "check_target",
    "checkpoint_file",
    "foreign_entries",
    "head_save_id",
    "level_file",
    "local_path",
    "metadata_save_id",
    "old_copies",
    "owned_dir",
    "owned_file",
    "remove_owned",
    "side_name",
]

_RANK_FILE = re.compile(r"rank-\d{5,}\.bin")
_LEVEL_FILE = re.compile(r"(rank|partner|parity)-\d{5,}\.bin(\.tmp)?")
_SIDE = re.compile(r"\.(tmp|old)-(.+)-[0-9a-f]{12}")
#: Files whose content starts with the data files' header.
_DATA_FILE = re.compile(r"(rank|partner)-\d{5,}\.bin")
#: How DeepPart's metadata.json begins (its first key, as metadata_head
#: writes it; other spellings are parsed).
_META_HEAD = re.compile(rb'\{\s*"format"\s*:\s*"' + FORMAT_NAME.encode() + rb'"')
_SAVE_ID_KEY = re.compile(rb'"save_id"\s*:\s*"([0-9a-f]{32})"')
#: A URL: ``scheme://``, or ``scheme:/`` as ``Path`` normalises one (a
#: scheme has two letters or more, so no Windows drive matches).
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")
#: How many foreign entries an error names.
_SHOWN = 5


def checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file that :func:`deeppart.save` writes in a
    checkpoint directory."""
    return name in (MARKER, METADATA) or _RANK_FILE.fullmatch(name) is not None


def level_file(name: str) -> bool:
    """Whether ``name`` is a file the multi-level engine writes in a
    node-local step directory (data files, partner copies, parity shards,
    and their temporary names)."""
    return _LEVEL_FILE.fullmatch(name) is not None


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as a :class:`~pathlib.Path`, after refusing a URL
    (``s3://bucket/run``, ``gs://...``, ``file:///...``; also the form that
    ``Path`` makes of one, ``s3:/bucket``) with
    :class:`~deeppart.errors.UnsupportedURLError`: DeepPart reads and writes
    file system paths only, and would otherwise make a local directory named
    ``s3:``. The one check that every entry point taking a checkpoint path
    (save, load, async_save, Checkpointer, inspect, export, the CLI) uses."""
    text = os.fsdecode(os.fspath(path))
    m = _URL.match(text)
    if m is not None:
        scheme = m.group(1)
        raise UnsupportedURLError(
            f"{text}: a {scheme}:// URL; DeepPart reads and writes file system paths only "
            "(local or mounted): mount the storage (e.g. a FUSE mount of the bucket) and "
            "pass the mounted path, or copy the checkpoint"
            + (" (for a file:// URL pass the path itself)" if scheme.lower() == "file" else "")
        )
    return Path(text)


def _head(path: Path, n: int) -> bytes:
    """The first ``n`` bytes of the regular file ``path`` (never follows a
    link, never blocks on a FIFO); b"" if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return b""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.pread(fd, n, 0)
    finally:
        os.close(fd)


def metadata_save_id(directory: Path) -> str | None:
    """The ``save_id`` recorded in ``directory``'s metadata.json, or None
    (no such file, not DeepPart's, or written before save ids)."""
    return head_save_id(_head(directory / METADATA, HEADER_SIZE))


def head_save_id(head: bytes) -> str | None:
    """The ``save_id`` in the first bytes ``head`` of a metadata.json, if
    they begin as DeepPart's metadata does (as :func:`deeppart.storage.commit.
    metadata_head` writes it); else None."""
    if _META_HEAD.match(head) is None:
        return None
    m = _SAVE_ID_KEY.search(head)
    return m.group(1).decode() if m else None


def _is_metadata(path: Path, head: bytes) -> bool:
    """Whether ``path`` (beginning with ``head``) is DeepPart's metadata."""
    if _META_HEAD.match(head) is not None:
        return True
    import json

    try:
        if os.lstat(path).st_size > MAX_METADATA_BYTES:
            return False
        raw = json.loads(_head(path, MAX_METADATA_BYTES))
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT_NAME


def owned_file(path: Path, save_id: str | None = None, *, partial: bool = False) -> bool:
    """Whether ``path`` is a regular file (not a link) that DeepPart wrote,
    by its content: a ``COMMITTED`` marker, DeepPart's ``metadata.json``, a
    data file (``rank-``/``partner-NNNNN.bin``) with the format's magic. With
    ``save_id``, a metadata.json or data file that records another save's id
    is not this save's. ``partial``: also a data file shorter than its header
    (one a failed write of this save left, in its own temporary directory).
    Parity shards and ``.tmp`` files of the multi-level engine have no
    header: their names decide (:func:`level_file`)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode):
        return False
    name = path.name
    if name == MARKER:
        return st.st_size <= MAX_MARKER_BYTES and _head(path, len(MARKER_PREFIX)) == MARKER_PREFIX
    if name == METADATA:
        head = _head(path, HEADER_SIZE)
        if not _is_metadata(path, head):
            return False
        m = _SAVE_ID_KEY.search(head)
        return save_id is None or m is None or m.group(1).decode() == save_id
    if _DATA_FILE.fullmatch(name):
        head = _head(path, HEADER_SIZE)
        found = header_save_id(head)
        if found is None:
            return partial and st.st_size < HEADER_SIZE and MAGIC.startswith(head[: len(MAGIC)])
        return save_id is None or not found or found == save_id
    return level_file(name) or _RANK_FILE.fullmatch(name) is not None


def foreign_entries(
    directory: Path,
    ours: Callable[[str], bool] = checkpoint_file,
    save_id: str | None = None,
    *,
    partial: bool = False,
) -> list[str]:
    """The entries of ``directory`` that DeepPart did not write (by name
    and content: only regular files named by ``ours`` that
    :func:`owned_file` recognises are DeepPart's), sorted; ``[]`` for an
    empty directory or one that does not exist."""
    try:
        children = list(directory.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(
        c.name for c in children if not (ours(c.name) and owned_file(c, save_id, partial=partial))
    )


def remove_owned(
    path: Path,
    ours: Callable[[str], bool] = checkpoint_file,
    *,
    save_id: str | None = None,
    partial: bool = False,
) -> list[str]:
    """Removes the DeepPart directory ``path``: if every entry is
    DeepPart's (:func:`foreign_entries`, with ``save_id``/``partial`` as
    for :func:`owned_file`), unlinks them one by one (the marker first, so
    a half-removed checkpoint is never "committed") and removes the
    directory. Never recurses and never removes anything else: if ``path``
    holds another entry (or is a link or a file) it removes nothing and
    returns the foreign names (sorted); ``[]`` when removed or already
    gone. An entry that appears during the removal stays, with the
    directory, and is returned."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if not stat.S_ISDIR(st.st_mode):
        return [path.name]
    foreign = foreign_entries(path, ours, save_id, partial=partial)
    if foreign:
        return foreign
    names = sorted((c.name for c in path.iterdir()), key=lambda n: n != MARKER)
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (path / name).unlink()
    try:
        path.rmdir()
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        return sorted(c.name for c in path.iterdir())
    return []


def owned_dir(
    path: Path,
    ours: Callable[[str], bool] = checkpoint_file,
    *,
    empty: bool = True,
    partial: bool = False,
) -> bool:
    """Whether ``path`` is a real directory (not a link) that holds only
    files DeepPart writes there, recognised by name and content
    (:func:`foreign_entries`; ``partial`` as for :func:`owned_file`, for a
    save's temporary directory) (an empty one only if ``empty``): one that
    a cleanup may remove (with :func:`remove_owned`)."""
    try:
        if not path.is_dir() or path.is_symlink():
            return False
        return not foreign_entries(path, ours, partial=partial) and (empty or any(path.iterdir()))
    except OSError:
        return False


def side_name(name: str) -> tuple[str, str] | None:
    """``("tmp" | "old", NAME)`` for the name of a save's temporary
    directory ``.tmp-NAME-<12 hex>`` or of a replaced checkpoint moved aside,
    ``.old-NAME-<12 hex>``; else None."""
    m = _SIDE.fullmatch(name)
    return (m.group(1), m.group(2)) if m else None


def old_copies(final: Path) -> list[Path]:
    """The ``.old-NAME-<12 hex>`` directories next to ``final``: checkpoints
    that overwrites of it moved aside (:func:`side_name`); none when its
    parent cannot be listed."""
    try:
        names = [e.name for e in os.scandir(final.parent)]
    except OSError:
        return []
    return [final.parent / n for n in names if side_name(n) == ("old", final.name)]


def _listing(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_target(final: Path, ours: Callable[[str], bool] = checkpoint_file) -> None:
    """Refuses a save's target ``final`` that holds something of the user's,
    whatever ``overwrite``: a symbolic link, a file that is not a directory,
    or a directory with entries DeepPart did not write
    (:class:`ForeignPathError`). A missing or empty directory, or one with
    only DeepPart's files (a checkpoint, or what an interrupted save left),
    passes; whether a committed checkpoint may be replaced is the caller's
    ``overwrite`` check. Lists one directory and reads the first bytes of
    each file in it (:func:`owned_file`)."""
    if final.is_symlink():
        raise ForeignPathError(
            f"{final}: is a symbolic link (to {final.readlink()}); DeepPart saves only "
            "into directories it makes: remove the link, or save to the path it points to"
        )
    if not final.exists():
        return
    if not final.is_dir():
        raise ForeignPathError(
            f"{final}: exists and is not a directory; DeepPart replaces only its own "
            "checkpoints: move the file away or save to another path"
        )
    foreign = foreign_entries(final, ours)
    if foreign:
        raise ForeignPathError(
            f"{final}: holds {len(foreign)} entries DeepPart did not write "
            f"({_listing(foreign)}); DeepPart replaces only its own checkpoints, even with "
            "overwrite=True: move them away or save to another (new or empty) directory"
        )
