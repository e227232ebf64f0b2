"""Stages 4 and 6 of a save: the temporary directory, and the commit.

Before anything is written, rank 0 makes the save's temporary directory
(:func:`make_temp_dir`, ``.tmp-NAME-<hex>`` next to the final one); after
every rank has written its data file, rank 0 builds ``metadata.json`` from
everyone's piece records (:func:`metadata_json`) and commits
(:func:`commit_dir`): metadata and the ``COMMITTED`` marker into the
temporary directory, fsyncs, then one rename that cannot replace anything
(:func:`rename_noreplace`): the rename is the commit. A directory without
the marker is never loaded; a replaced checkpoint (``overwrite=True``, and
only a committed DeepPart checkpoint, checked again at commit time) is
moved aside first, stays committed there until the new one is in place,
and is then removed file by file (:func:`deeppart.storage.ownership.remove_owned`).

What a commit may replace (docs/SECURITY.md, "What DeepPart may replace or
delete"): nothing, if the target is absent or an empty directory (removed
with ``rmdir``, which cannot remove anything else); with ``overwrite=True``
a committed DeepPart checkpoint; and an uncommitted directory holding only
DeepPart's files (what an older version's interrupted save left). Anything
else at the target when the commit runs (another save's committed
checkpoint with ``overwrite=False``, a user's file put there while the save
was writing) fails the save with :class:`CommitConflictError` and stays as
it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deeppart.errors import (
    CheckpointError,
    CommitConflictError,
    CorruptCheckpointError,
    NoSpaceError,
)
from deeppart.format import (
    MARKER,
    METADATA,
    damaged,
    fsync_dir,
    is_committed,
    marker_text,
    write_durable,
)
from deeppart.storage.ownership import (
    check_target,
    checkpoint_file,
    foreign_entries,
    metadata_save_id,
    old_copies,
    owned_dir,
    remove_owned,
)

__all__ = [
    "TEMP_NAME_MAX",
    "KeepAside",
    "commit_dir",
    "has_renameat2",
    "make_temp_dir",
    "remove_temp_dir",
    "rename_noreplace",
]

#: The longest temporary directory name (``.tmp-`` NAME ``-`` 12 hex digits).
TEMP_NAME_MAX = len(".tmp--") + 12 + 255

# ----------------------------------------------------------------------------
# A rename that never replaces.

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
#: errno values by which renameat2 says it cannot do RENAME_NOREPLACE here
#: (an old kernel, a file system without it): then the fallback runs.
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def _load_renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (glibc 2.28 and later), or None."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2: Callable[..., int] | None = _load_renameat2()


def has_renameat2() -> bool:
    """Whether this process has ``renameat2`` (whether a file system also
    supports its RENAME_NOREPLACE is known only when a rename is tried)."""
    return _renameat2 is not None


def rename_noreplace(src: Path, dst: Path) -> None:
    """Renames ``src`` to ``dst`` only if nothing is at ``dst``; else
    :class:`FileExistsError`, and nothing changes. Atomic through
    ``renameat2(RENAME_NOREPLACE)`` (Linux 3.15+, on local file systems,
    and NFS or FUSE servers that support it). Where that is missing (another
    OS, an old libc, a file system that answers EINVAL), it checks that
    ``dst`` is absent and then renames: in the window between the two, the
    only thing ``rename(2)`` of a directory can replace is an *empty*
    directory made there meanwhile (POSIX refuses a non-empty directory and
    a file), so no file is ever lost; docs/SECURITY.md says the same."""
    fn = _renameat2
    if fn is not None:
        if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in _UNSUPPORTED:
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(src), None, str(dst))
    try:
        os.rename(src, dst)
    except OSError as e:
        # Something appeared at ``dst`` after the check: rename(2) refused
        # to replace it (a non-empty directory, or a file for a directory).
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise FileExistsError(e.errno, e.strerror, str(src), None, str(dst)) from e
        raise


# ----------------------------------------------------------------------------
# The temporary directory.


def make_temp_dir(final: Path, overwrite: bool) -> str:
    """Rank 0: refuses a ``final`` that holds something DeepPart did not
    write (:func:`deeppart.storage.ownership.check_target`, again: the ranks checked
    it before they agreed), and a committed ``final`` unless ``overwrite``;
    makes and returns the name of the temporary directory next to it, in
    which the ranks write."""
    check_target(final)
    refuse_damaged(final)
    if final.exists() and not overwrite and is_committed(final):
        raise CheckpointError(
            f"{final}: a committed checkpoint exists "
            "(overwrite=False; pass overwrite=True to replace it)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    name = f".tmp-{final.name}-{os.urandom(6).hex()}"
    (final.parent / name).mkdir()
    hold_temp_dir(final.parent / name)
    return name


def refuse_damaged(final: Path) -> None:
    """:class:`CorruptCheckpointError` if ``final`` is a damaged commit
    (:func:`deeppart.format.damaged`: its marker no longer matches its
    metadata): it is the evidence of the damage, and no save replaces it,
    even with ``overwrite=True``."""
    why = damaged(final)
    if why is not None:
        raise CorruptCheckpointError(
            f"{final}: a damaged checkpoint ({why}); it is kept as evidence and never "
            "replaced, even with overwrite=True: inspect it, then move it away (or remove "
            "it) to save there"
        )


#: The temporary directories of this process's saves in flight, each with
#: the descriptor that holds its lock (:func:`hold_temp_dir`).
_held: dict[Path, int] = {}


def hold_temp_dir(tmp: Path) -> None:
    """Marks ``tmp`` as a save in flight: an exclusive ``flock`` on the
    directory, held by this process until :func:`release_temp_dir` (or its
    death, when the kernel drops the lock). A cleanup of another job or
    Checkpointer (:func:`temp_dir_in_use`) leaves such a directory alone."""
    fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    _held[tmp] = fd


def release_temp_dir(tmp: Path) -> None:
    """Drops this process's lock on ``tmp`` (committed or given up)."""
    fd = _held.pop(tmp, None)
    if fd is not None:
        os.close(fd)


def temp_dir_in_use(path: Path) -> bool:
    """Whether a live process holds ``path`` as its save in flight (see
    :func:`hold_temp_dir`); a directory that cannot be opened is treated
    as in use (left alone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # no locks on this file system: nothing tells a live save
    finally:
        os.close(fd)
    return False


def remove_temp_dir(tmp: Path, save_id: str | None) -> None:
    """Removes a failed save's temporary directory ``tmp`` (which this save
    made): only the files this save wrote there (by name and content, its
    ``save_id``; partly written data files too); anything else stays, with
    the directory, and a warning names it."""
    release_temp_dir(tmp)
    try:
        left = remove_owned(tmp, save_id=save_id, partial=True)
    except OSError as e:
        left = [f"({e})"]
    if left:
        warnings.warn(
            f"{tmp}: the failed save's temporary directory is kept: it holds entries this "
            f"save did not write ({', '.join(left[:5])})",
            stacklevel=2,
        )


@dataclass(frozen=True)
class KeepAside:
    """A committed checkpoint that a commit replaces and keeps instead of
    removing it (a Checkpointer's step of a line left behind, without
    ``keep_last``): ``name``, the directory next to the target that holds
    it (the target's own name, or an interrupted overwrite's
    ``.old-NAME-*`` copy), is renamed to ``keep_as`` once the new
    checkpoint is in place, never before (a save that fails keeps it
    where it was)."""

    name: str
    keep_as: str


def commit_dir(
    tmp: Path,
    final: Path,
    meta: bytes,
    *,
    overwrite: bool = False,
    save_id: str | None = None,
    keep: KeepAside | None = None,
) -> None:
    """Rank 0's commit of a written temporary directory ``tmp`` as ``final``:
    metadata.json and the COMMITTED marker into ``tmp``, fsyncs, then
    :func:`rename_noreplace` (the commit itself). What may be at ``final``
    then: nothing, an empty directory (removed with ``rmdir``), an
    uncommitted directory of DeepPart's files only, or with ``overwrite``
    a committed DeepPart checkpoint (all checked again here, by content).
    Those are moved aside (still committed: if this save dies now, load()
    serves them from there) and removed after the rename, file by file.
    Anything else raises :class:`CommitConflictError` and stays; the caller
    removes ``tmp``. ``save_id``: this save's id (recorded in ``meta``).
    ``keep``: the replaced checkpoint to keep under another name (see
    :class:`KeepAside`) instead of removing it."""
    for name, data in ((METADATA, meta), (MARKER, marker_text(meta))):
        try:
            write_durable(tmp / name, data)
        except BaseException as e:
            _unwrite(tmp)
            if isinstance(e, OSError) and e.errno in _NO_SPACE:
                raise NoSpaceError(
                    e.errno,
                    f"{final}: no space left to commit ({tmp / name}: {e.strerror}); "
                    "nothing was committed, this save's files are removed and the "
                    "checkpoints committed before are intact: free space (or raise the "
                    "quota) and save again",
                ) from e
            raise
    fsync_dir(tmp)
    # The .old- copies of interrupted overwrites: older than this commit,
    # they go once it is in place (only directories of DeepPart's files).
    stale = old_copies(final)
    old = _move_aside(final, overwrite)
    try:
        rename_noreplace(tmp, final)
        release_temp_dir(tmp)
    except FileExistsError as e:
        if old is not None:
            # Put back what was moved aside, unless the target was taken.
            with contextlib.suppress(OSError):
                rename_noreplace(old, final)
        raise CommitConflictError(
            f"{final}: something was put there while the save committed; nothing was replaced"
            f"{'' if old is None else f' (the replaced checkpoint is at {old} if not back)'}"
        ) from e
    fsync_dir(final.parent)
    kept = None
    if keep is not None:
        kept = old if keep.name == final.name else final.parent / keep.name
        _keep_aside(kept, final.parent / keep.keep_as)
    if old is not None and old != kept:
        _remove_aside(old)
    for path in stale:
        # Older than this commit: never to be served in its place.
        if path != kept and owned_dir(path):
            with contextlib.suppress(OSError):
                remove_owned(path, save_id=metadata_save_id(path))


#: errno values of a full device or quota.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _unwrite(tmp: Path) -> None:
    """Removes what a failed :func:`commit_dir` wrote into its own
    temporary directory ``tmp`` (the marker, then ``metadata.json``, each
    perhaps partly written: they cannot be recognised by content then, so
    the caller's removal by content would keep them and the directory)."""
    for name in (MARKER, METADATA):
        with contextlib.suppress(OSError):
            (tmp / name).unlink()


def _move_aside(final: Path, overwrite: bool) -> Path | None:
    """What :func:`commit_dir` does with whatever is at ``final`` before its
    rename: None if nothing is there (an empty directory is removed); the
    ``.old-NAME-<hex>`` path it moved a replaceable checkpoint to; else
    :class:`CommitConflictError`."""
    if not os.path.lexists(final):
        return None
    if final.is_dir() and not final.is_symlink():
        try:
            final.rmdir()  # only ever removes an empty directory
            return None
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
    refuse_damaged(final)
    committed = is_committed(final)
    why = _not_replaceable(final, committed, overwrite)
    if why:
        raise CommitConflictError(why)
    old = final.parent / f".old-{final.name}-{os.urandom(6).hex()}"
    rename_noreplace(final, old)
    # Checked again once it can no longer change under its name: if it
    # was swapped between the check and the rename, it goes back.
    why = _not_replaceable(old, committed, overwrite, shown=final)
    if why:
        try:
            rename_noreplace(old, final)
        except OSError:
            why += f" (it is now at {old})"
        raise CommitConflictError(why)
    return old


def _not_replaceable(
    path: Path, committed: bool, overwrite: bool, shown: Path | None = None
) -> str:
    """Why the commit may not replace ``path`` ("" if it may)."""
    shown = shown or path
    if path.is_symlink() or not path.is_dir():
        return (
            f"{shown}: a file or link was put there while the save was writing; DeepPart "
            "replaces only its own checkpoints: nothing was replaced"
        )
    foreign = foreign_entries(path, checkpoint_file, metadata_save_id(path))
    if foreign:
        return (
            f"{shown}: holds entries DeepPart did not write ({', '.join(foreign[:5])}), put "
            "there while the save was writing; DeepPart replaces only its own checkpoints, "
            "even with overwrite=True: nothing was replaced"
        )
    if is_committed(path) != committed:
        return f"{shown}: changed while the save committed; nothing was replaced"
    if committed and not overwrite:
        return (
            f"{shown}: another save committed a checkpoint there while this one was writing "
            "(overwrite=False): that checkpoint is kept and this save failed; pass "
            "overwrite=True to replace it, or save to another directory"
        )
    return ""


def _keep_aside(copy: Path | None, keep_as: Path) -> None:
    """Renames ``copy`` (a replaced committed checkpoint, see
    :class:`KeepAside`) to ``keep_as``; where that fails it stays where it
    is, with a warning (it is never removed instead)."""
    if copy is None or not os.path.lexists(copy):
        return
    try:
        rename_noreplace(copy, keep_as)
        fsync_dir(keep_as.parent)
    except OSError as e:
        warnings.warn(
            f"{copy}: the replaced checkpoint stays here, it could not be moved to "
            f"{keep_as.name} ({e.strerror or e})",
            stacklevel=3,
        )


def _remove_aside(old: Path) -> None:
    """Removes a replaced checkpoint moved aside to ``old`` (only its own
    files, by content and its save id); whatever else is there stays, with
    a warning."""
    try:
        left = remove_owned(old, save_id=metadata_save_id(old))
    except OSError as e:
        left = [f"({e})"]
    if left:
        warnings.warn(
            f"{old}: the replaced checkpoint is kept here: it holds entries DeepPart did not "
            f"write ({', '.join(left[:5])})",
            stacklevel=3,
        )
