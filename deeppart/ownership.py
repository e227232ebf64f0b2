"""What DeepPart owns on disk, and so may replace or remove.

A save replaces, and a cleanup removes, only directories that DeepPart
wrote: every entry in them is a file name that DeepPart writes there
(``COMMITTED``, ``metadata.json``, ``rank-NNNNN.bin``; in the multi-level
engine's node-local directories also ``partner-``/``parity-`` files and
their ``.tmp`` names). Anything else at a save's target (a regular file, a
symbolic link, a directory holding other files) is the user's: the save is
refused with :class:`~deeppart.errors.ForeignPathError`, on every rank,
before anything is written, and cleanups leave it where it is.
An empty directory is a fine target.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from deeppart.errors import ForeignPathError
from deeppart.format import MARKER, METADATA

__all__ = [
    "check_target",
    "checkpoint_file",
    "foreign_entries",
    "level_file",
    "owned_dir",
    "side_name",
]

_RANK_FILE = re.compile(r"rank-\d{5,}\.bin")
_LEVEL_FILE = re.compile(r"(rank|partner|parity)-\d{5,}\.bin(\.tmp)?")
_SIDE = re.compile(r"\.(tmp|old)-(.+)-[0-9a-f]{12}")
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


def foreign_entries(directory: Path, ours: Callable[[str], bool] = checkpoint_file) -> list[str]:
    """The entries of ``directory`` that DeepPart did not write (by name and
    kind: only regular files named by ``ours`` are DeepPart's), sorted;
    ``[]`` for an empty directory or one that does not exist."""
    try:
        children = list(directory.iterdir())
    except FileNotFoundError:
        return []
    return sorted(
        c.name for c in children if not (ours(c.name) and c.is_file() and not c.is_symlink())
    )


def owned_dir(
    path: Path, ours: Callable[[str], bool] = checkpoint_file, *, empty: bool = True
) -> bool:
    """Whether ``path`` is a real directory (not a link) that holds only
    files DeepPart writes there (an empty one only if ``empty``): one that a
    cleanup may remove."""
    try:
        if not path.is_dir() or path.is_symlink():
            return False
        return not foreign_entries(path, ours) and (empty or any(path.iterdir()))
    except OSError:
        return False


def side_name(name: str) -> tuple[str, str] | None:
    """``("tmp" | "old", NAME)`` for the name of a save's temporary
    directory ``.tmp-NAME-<12 hex>`` or of a replaced checkpoint moved aside,
    ``.old-NAME-<12 hex>``; else None."""
    m = _SIDE.fullmatch(name)
    return (m.group(1), m.group(2)) if m else None


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
    ``overwrite`` check. Lists one directory; reads no file."""
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
