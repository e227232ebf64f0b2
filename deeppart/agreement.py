"""The agreement collective: how a failure on some ranks becomes an error
on every rank, instead of leaving the others blocked in the next collective.

Every stage of :func:`deeppart.save` and :func:`deeppart.load` that can
fail on some ranks only (preparing, writing, committing, reading) runs in a
``try`` that keeps its exception, and is followed by one :func:`agree`: a
small allgather of an error code (and a short payload the stage wants to
share). When no rank failed, every rank gets every rank's payload. When any
did, every rank raises: the failed ranks their own exception, the others an
exception of the same type (:data:`deeppart.errors.ERROR_TYPES`) naming the
first failed rank and its message.

The stages keep any :class:`BaseException`, not only :class:`Exception`: a
``KeyboardInterrupt`` or ``SystemExit`` raised on one rank inside a stage
goes through the same agreement (the other ranks raise a
:class:`~deeppart.errors.CheckpointError` naming the rank and the
interruption), and the interrupted rank re-raises its own exception after
it, instead of leaving the others blocked in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable

from deeppart.comm import Comm
from deeppart.errors import CheckpointError, code_of, type_of_code

__all__ = ["MAX_MESSAGE_BYTES", "agree", "describe", "from_root"]

#: The longest message of a failed rank that the other ranks see.
MAX_MESSAGE_BYTES = 8000


def agree(
    comm: Comm, err: BaseException | None, payload: bytes = b"", width: int = 32
) -> list[bytes]:
    """One collective: returns every rank's ``payload`` (at most ``width``
    bytes, padded with zeros) when no rank failed; otherwise every rank
    raises (its own ``err``, or one naming the failed rank and its message,
    of the same type)."""
    code = 0 if err is None else code_of(err)
    if len(payload) > width:
        raise ValueError("payload too long")
    rows = comm.allgather_bytes(bytes([code]) + payload, width + 1)
    failed = [r for r, row in enumerate(rows) if row[0] != 0]
    if not failed:
        return [row[1:] for row in rows]
    msg = b"" if err is None else describe(err).encode()[:MAX_MESSAGE_BYTES]
    messages = comm.allgather_varbytes(msg)
    if err is not None:
        raise err
    first = failed[0]
    cls = type_of_code(rows[first][0])
    text = messages[first].decode("utf-8", "replace")
    others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise cls(f"rank {first}{others}: {text}")


def describe(err: BaseException) -> str:
    """What the other ranks read of ``err``: its message; for an exit that
    is no :class:`Exception` (``KeyboardInterrupt``, ``SystemExit``), its
    type too, which its message (often empty) does not say."""
    if isinstance(err, Exception):
        return str(err)
    text = str(err)
    return f"interrupted by {type(err).__name__}" + (f" ({text})" if text else "")


def from_root(comm: Comm, step: Callable[[], bytes]) -> bytes:
    """Rank 0 runs ``step`` (which handles its own errors: a warning, a
    message in its bytes) and every rank gets its bytes, in one collective.
    If ``step`` raises on rank 0 all the same (an interruption), rank 0
    re-raises that after the collective and the other ranks raise
    :class:`CheckpointError` naming rank 0."""
    out = b"\0"
    stop: BaseException | None = None
    if comm.rank == 0:
        try:
            out = b"\0" + step()
        except BaseException as e:  # reaches every rank, then re-raised
            stop = e
            out = b"\1" + describe(e).encode()[:MAX_MESSAGE_BYTES]
    got = comm.allgather_varbytes(out)[0]
    if stop is not None:
        raise stop
    if got[:1] == b"\1":
        raise CheckpointError(f"rank 0: {got[1:].decode('utf-8', 'replace')}")
    return got[1:]
