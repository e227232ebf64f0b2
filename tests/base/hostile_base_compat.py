"""Rewrites a copy of tests/base/test_hostile.py to run against issue 13's base
commit (cae1853), for the regression evidence in docs/SECURITY.md::

    python tests/base/hostile_base_compat.py BASE_TREE/tests/base/test_hostile.py

Only what did not exist there changes: the fix's new names
(``MAX_EXPANSION``, used to size a bomb, becomes the constant 256;
``open_regular``/``read_regular`` are not imported, so the one unit test of
them fails by name, which the evidence does not count) and
``Checkpointer.save(overwrite=True)`` (the base always overwrote). Every
child process gets an 8 GiB address-space limit, so that the unfixed code's
runaway allocations fail inside the child (its RSS still measured) instead
of taking a shared machine down, and a hang is caught after 60 s, not 300.
"""

from __future__ import annotations

import sys
from pathlib import Path

EDITS = [
    # Issue 14 moved these names (deeppart.errors, deeppart.checkpointer,
    # deeppart.commit); the base had them in their old modules.
    (
        "from deeppart.checkpointer import Checkpointer",
        "from deeppart.checkpoint import Checkpointer",
    ),
    (
        "from deeppart.errors import "
        "CheckpointError, CodecError, CorruptCheckpointError, StateError",
        "from deeppart.format import CheckpointError, CorruptCheckpointError\n"
        "from deeppart.state import StateError",
    ),
    (
        "import deeppart, deeppart.storage.commit as ck",
        "import deeppart, deeppart.checkpoint as ck",
    ),
    (
        "from deeppart.compression import MAX_EXPANSION, decompress",
        "from deeppart.compression import CodecError, decompress\nMAX_EXPANSION = 256",
    ),
    ("    open_regular,\n    read_regular,\n", ""),
    (", overwrite=True)", ")"),
    ("HANG_S = 300", "HANG_S = 60"),
    (
        "def measure(action: str, *args: str) -> dict[str, Any]:",
        "def _limit() -> None:\n    import resource\n\n"
        "    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n\n\n"
        "def measure(action: str, *args: str) -> dict[str, Any]:",
    ),
    (
        "            cwd=ROOT,\n        )\n",
        "            cwd=ROOT,\n            preexec_fn=_limit,\n        )\n",
    ),
    (
        "timeout=HANG_S, env=dict(os.environ, PYTHONPATH=str(ROOT)),\n"
        "                          **kw)",
        "timeout=HANG_S, env=dict(os.environ, PYTHONPATH=str(ROOT)),\n"
        "                          preexec_fn=_limit, **kw)",
    ),
]


def main() -> None:
    path = Path(sys.argv[1])
    text = path.read_text()
    for old, new in EDITS:
        if old not in text:
            raise SystemExit(f"{path}: not found: {old!r}")
        text = text.replace(old, new)
    path.write_text(text)


if __name__ == "__main__":
    main()
