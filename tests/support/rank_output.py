"""Lines that several ranks print to one pipe, whole.

``print(text, flush=True)`` writes ``text`` and its newline in two calls
when Python runs unbuffered (``PYTHONUNBUFFERED=1``, as CI runners often
set), so the lines of concurrent ranks interleave: ``OK rank 7/8READ ...``.
:func:`print_line` hands the whole line to one ``write(2)``; a pipe write of at
most ``PIPE_BUF`` (4096) bytes is never interleaved with another.
"""

from __future__ import annotations

import os
import select
import sys


def print_line(line: str) -> None:
    """Writes ``line`` and a newline to stdout in one system call, after
    whatever Python has buffered there."""
    sys.stdout.flush()
    data = (line + "\n").encode()
    if len(data) > select.PIPE_BUF:
        raise ValueError(f"a report line must fit one atomic pipe write ({select.PIPE_BUF} bytes)")
    os.write(sys.stdout.fileno(), data)
