"""Report lines of concurrent ranks stay whole (tests/support/rank_output.py), even
when Python runs unbuffered, as CI runners set it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^OK \d+ \d+ x{200}$")


def _concurrent_output(procs: int = 4, lines: int = 400) -> list[str]:
    code = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(HERE)!r})\n"
        "from rank_output import print_line\n"
        f"for i in range({lines}):\n"
        f"    print_line(f'OK {{os.getpid()}} {{i}} ' + 'x' * 200)\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    shell = " & ".join([f'{sys.executable} -c "$CODE"'] * procs) + " & wait"
    out = subprocess.run(
        ["bash", "-c", shell], env=dict(env, CODE=code), capture_output=True, text=True, check=True
    ).stdout
    return out.splitlines()


def test_print_line_keeps_concurrent_lines_whole() -> None:
    """4 processes print 400 lines each at once, unbuffered; every line
    arrives whole (with ``print`` about half of them break here)."""
    out = _concurrent_output()
    assert len(out) == 4 * 400
    assert all(LINE.match(line) for line in out)
