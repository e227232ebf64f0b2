"""The type stubs of the Rust extension match the compiled module, checked
by mypy's stubtest against the binary (as pydantic-core does)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ALLOWLIST = Path(__file__).with_name("stubtest_allowlist.txt")


def test_stubtest_passes() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "deeppart._planner",
            "--allowlist",
            str(ALLOWLIST),
            # An entry of the allowlist that matches nothing is an error too.
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"stubtest found mismatches:\n{proc.stdout}\n{proc.stderr}"


def test_allowlist_names_only_stub_only_aliases() -> None:
    import deeppart._planner as runtime

    for line in ALLOWLIST.read_text().splitlines():
        name = line.strip()
        if not name or name.startswith("#"):
            continue
        assert name.startswith("deeppart._planner.")
        assert not hasattr(runtime, name.rsplit(".", 1)[1]), f"{name} exists at runtime now"
