"""The examples in examples/ run as their docstrings say (the Accelerate
one runs from docs/INTEGRATIONS.md's block in test_readme.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_plan_state_dict_example_plans_a_model_for_every_rank() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plan_state_dict.py"), "4"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert re.search(r"^\d+ leaves, [\d.]+ MiB, 4 ranks$", out, re.M), out
    gap = float(re.search(r"gap=([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert 1.0 <= gap <= 1.01, out
    assert [int(m) for m in re.findall(r"^rank\s+(\d+):", out, re.M)] == [0, 1, 2, 3], out
