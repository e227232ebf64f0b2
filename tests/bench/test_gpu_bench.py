"""bench/gpu.py: its report, and one run on the CPU (no GPU here: the
contenders run on CPU tensors, without pinned memory), so that the command
the GPU check runs keeps working between the times a GPU is at hand."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench import gpu  # noqa: E402


def _result(name: str, stall: float, overhead: float, load: float) -> dict[str, Any]:
    return {
        "contender": name,
        "ranks": 1,
        "bytes": 10_000_000_000,
        "tensors": 45,
        "step_baseline": 0.05,
        "stalls": [stall, stall],
        "overheads": [overhead, overhead * 3],
        "durables": [5.0, 7.0],
        "step_during": 0.051,
        "steps_during": 100,
        "d2h_gbps": [55.0, 55.2] if name.startswith("deeppart") else [],
        "load_seconds": {"default": load},
        "bitwise": {"default": True},
    }


def test_report_gives_ceilings_rows_and_ratios() -> None:
    info = {
        "device": "NVIDIA H200",
        "torch": "2.11.0",
        "cpus": 16,
        "d2h_gbps": 55.2,
        "h2d_gbps": 55.0,
        "pin_seconds": 7.0,
        "disk_write_gbps": 1.5,
        "page_cache": {"8 threads": 23.8},
        "workdir": "tmpfs",
    }
    results = {
        "deeppart-async": _result("deeppart-async", 0.01, 0.1, 0.5),
        "dcp-process": _result("dcp-process", 4.0, 4.0, 7.5),
    }
    text = gpu.report(info, results, {"dcp-thread": "its job failed (boom)"})
    assert "ceilings: device-to-host pinned copy 55.2 GB/s, host-to-device 55.0 GB/s" in text
    assert "page cache -> pinned memory (a 4 GiB file, 8 MiB preads): 8 threads 23.8 GB/s" in text
    assert "written to a tmpfs" in text
    # Medians: overhead (0.1, 0.3) -> 0.2 s; load 10 GB in 0.5 s -> 20 GB/s, 0.36 of H2D.
    row = next(line for line in text.splitlines() if line.startswith("deeppart-async "))
    assert row.split()[1:4] == ["0.200", "0.010", "6.00"]
    assert "20.00" in row and "0.36" in row and row.endswith("True")
    assert "dcp-thread             not measured: its job failed (boom)" in text
    assert "copies 55.1 GB/s = 1.00 of the ceiling" in text
    # Overhead 0.2 / 8 (the median of 4 and 12), stall 0.01 / 4, load 7.5 / 0.5.
    ratios = "overhead 0.03x  stall 0.00x  load 15.00x faster"
    assert f"deeppart-async vs dcp-process         {ratios}" in text


@pytest.mark.slow
def test_one_run_on_the_cpu(tmp_path: Path) -> None:
    """Every measure of two contenders comes back from their own
    processes, and the loads are bitwise."""
    out = tmp_path / "gpu.json"
    cmd = [
        sys.executable, str(ROOT / "bench" / "gpu.py"), "--cpu", "--gb", "0.002", "--dim", "64",
        "--batch", "8", "--saves", "1", "--steps", "2", "--json", str(out),
        "--contenders", "deeppart-async,dcp-thread", "--dir", str(tmp_path / "work"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"deeppart-async", "dcp-thread"}, data["skipped"]
    for r in data["results"].values():
        assert r["ranks"] == 1 and r["bytes"] > 1_000_000
        assert len(r["stalls"]) == len(r["overheads"]) == len(r["durables"]) == 1
        assert all(r["bitwise"].values())
    loads = data["results"]["deeppart-async"]["load_seconds"]
    assert set(loads) == {"default", *map(str, gpu.LOAD_THREADS)}
    assert "deeppart-async vs dcp-thread" in proc.stdout
