"""The ``deeppart plan`` command, run as ``python -m deeppart`` in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import EXAMPLE_MANIFEST

import deeppart


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deeppart", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_plan_text_output(tmp_path: Path) -> None:
    proc = run_cli("plan", str(EXAMPLE_MANIFEST), "--world-size", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    rows = dict(_split_row(line) for line in proc.stdout.splitlines())
    assert rows["manifest"] == "9 leaves, 280.27 MiB"
    assert rows["world size"] == "8"
    assert rows["algorithm"] == "balanced"
    assert rows["makespan"].endswith("ms (modelled)")
    assert rows["lower bound"].endswith(" ms")
    expected = deeppart.plan(
        deeppart.Manifest.from_json(EXAMPLE_MANIFEST.read_text()), 8, cache=False
    )
    assert float(rows["gap"]) == pytest.approx(expected.stats.gap, abs=1e-4)
    assert rows["writers"] == str(expected.stats.writers)
    assert rows["pieces"] == f"{expected.stats.pieces} ({expected.stats.splits} from splits)"
    assert rows["fingerprint"] == expected.fingerprint
    assert rows["plan time"].endswith(" ms")
    assert rows["slowest rank"].endswith("MiB")


def _split_row(line: str) -> tuple[str, str]:
    key, value = line.split("  ", 1)
    return key.strip(), value.strip()


@pytest.mark.parametrize("algorithm", list(deeppart.ALGORITHMS))
def test_plan_json_output(algorithm: str) -> None:
    proc = run_cli("plan", str(EXAMPLE_MANIFEST), "-p", "16", "--algorithm", algorithm, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for key in ("makespan", "lower_bound", "gap", "pieces", "splits", "writers", "plan_ms"):
        assert key in out, key
    assert out["algorithm"] == algorithm
    assert out["world_size"] == 16
    assert out["leaves"] == 9
    m = deeppart.Manifest.from_json(EXAMPLE_MANIFEST.read_text())
    assert out["total_bytes"] == m.total_bytes
    expected = deeppart.plan(m, 16, algorithm=algorithm, cache=False)
    assert out["fingerprint"] == expected.fingerprint
    assert out["makespan"] == pytest.approx(expected.stats.makespan)
    assert out["lower_bound"] == pytest.approx(expected.stats.lower_bound)
    assert out["gap"] == pytest.approx(out["makespan"] / out["lower_bound"])
    assert out["makespan"] >= out["lower_bound"]
    assert (out["pieces"], out["splits"], out["writers"]) == (
        expected.stats.pieces,
        expected.stats.splits,
        expected.stats.writers,
    )
    assert out["plan_ms"] >= 0


def test_plan_cost_options_and_output_file(tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    proc = run_cli(
        "plan", str(EXAMPLE_MANIFEST), "-p", "8", "--bandwidth", "2e9", "--ranks-per-node", "4",
        "--min-piece-bytes", "4096", "--json", "-o", str(target),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plan = deeppart.Plan.from_json(target.read_text())
    assert plan.cost.bandwidth == 2e9 and plan.cost.min_piece_bytes == 4096
    assert plan.topology.ranks_per_node == 4
    assert plan.fingerprint == json.loads(proc.stdout)["fingerprint"]


def test_malformed_manifest_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "leaves": [')
    proc = run_cli("plan", str(bad), "-p", "4")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("deeppart: error: ManifestError: malformed manifest JSON")


def test_invalid_leaf_exits_2_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "leaves": [{"path": ["w"], "dtype": "float33", "shape": [1]}]}')
    proc = run_cli("plan", str(bad), "-p", "4")
    assert proc.returncode == 2
    assert 'deeppart: error: ManifestError: leaf 0 (w): unknown dtype "float33"' in proc.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    proc = run_cli("plan", str(missing), "-p", "4")
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == f"deeppart: error: cannot read {missing}: No such file or directory"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-p", "0"], "deeppart: error: PlanError: world size must be at least 1, got 0"),
        (["-p", "2"], "PlanError: leaf 8 (rng) is owned by rank 3, but the world size is 2"),
        (["-p", "6", "--ranks-per-node", "4"], "PlanError: invalid topology"),
        (["-p", "4", "--bandwidth", "nan"], "PlanError: invalid cost model: bandwidth"),
    ],
)
def test_bad_plan_arguments_exit_2(args: list[str], message: str) -> None:
    proc = run_cli("plan", str(EXAMPLE_MANIFEST), *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_usage_errors_exit_2() -> None:
    proc = run_cli("plan", str(EXAMPLE_MANIFEST), "-p", "4", "--algorithm", "magic")
    assert proc.returncode == 2
    assert "invalid choice: 'magic'" in proc.stderr
    proc = run_cli("plan", str(EXAMPLE_MANIFEST))
    assert proc.returncode == 2
    assert "--world-size" in proc.stderr


# ----------------------------------------------------------------------------
# Manifests for plan and simulate (issue 17): from a checkpoint, a
# safetensors file, or Manifest.to_json.


def _small_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return model, opt


def test_manifest_from_a_checkpoint_and_plan_reads_checkpoints(tmp_path: Path) -> None:
    """`deeppart manifest CKPT` writes the manifest recorded in the
    checkpoint; `plan` and `simulate` take the checkpoint, its directory or
    its metadata.json, directly (they refused metadata.json before)."""
    model, opt = _small_model()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    ck = tmp_path / "ck"
    deeppart.save(state, ck)
    out = tmp_path / "m.json"
    proc = run_cli("manifest", str(ck), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert deeppart.Manifest.from_json(out.read_text()) == deeppart.Manifest.from_state_dict(state)
    for source in (ck, ck / "metadata.json", out):
        proc = run_cli("plan", str(source), "-p", "4", "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["leaves"] == len(deeppart.Manifest.from_state_dict(state))
    proc = run_cli("simulate", "--model", str(ck / "metadata.json"), "-p", "1,4")
    assert proc.returncode == 0 and "balanced" in proc.stdout, proc.stderr


def test_manifest_from_safetensors_header(tmp_path: Path) -> None:
    """A .safetensors file: the header alone gives the model's manifest; with
    --adamw the manifest of {model, AdamW state} after one real step."""
    from safetensors.torch import save_file

    model, opt = _small_model()
    f = tmp_path / "model.safetensors"
    save_file(model.state_dict(), str(f))
    proc = run_cli("manifest", str(f))
    assert proc.returncode == 0, proc.stderr

    # safetensors does not keep the state_dict's order: compare as sets.
    def leaves(m: deeppart.Manifest, paths: bool = True) -> list[tuple[Any, ...]]:
        return sorted(
            (tuple(map(str, lf["path"])) if paths else (), lf.get("dtype") or "", lf["nbytes"])
            for lf in m.leaves()
        )

    got = deeppart.Manifest.from_json(proc.stdout)
    assert leaves(got) == leaves(deeppart.Manifest.from_state_dict({"model": model.state_dict()}))
    proc = run_cli("manifest", str(f), "--adamw")
    assert proc.returncode == 0, proc.stderr
    real = deeppart.Manifest.from_state_dict(
        {"model": model.state_dict(), "optim": opt.state_dict()}
    )
    got = deeppart.Manifest.from_json(proc.stdout)
    # The optimizer's indices follow the file's order: compare sizes, not paths.
    assert leaves(got, paths=False) == leaves(real, paths=False)
    assert got.total_bytes == real.total_bytes

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(f.read_bytes()[:20])
    proc = run_cli("manifest", str(bad))
    assert proc.returncode == 2 and "bad safetensors header" in proc.stderr, proc.stderr
    proc = run_cli("manifest", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "cannot read" in proc.stderr, proc.stderr


def test_unknown_model_name_lists_the_built_in_ones() -> None:
    from deeppart.tools.models import MODELS

    proc = run_cli("manifest", "bert-lrge")
    assert proc.returncode == 2
    assert "bert-lrge: no such file or directory, and not a built-in model name" in proc.stderr
    assert all(name in proc.stderr for name in MODELS), proc.stderr


def test_demo_help_is_plain_text() -> None:
    proc = run_cli("demo", "--help")
    assert proc.returncode == 0
    assert "launches mpiexec -n RANKS" in proc.stdout and "deeppart.Checkpointer;" in proc.stdout
    assert "``" not in proc.stdout and ":func:" not in proc.stdout and ":class:" not in proc.stdout


def test_plan_and_manifest_read_and_write_holder_groups(tmp_path: Path) -> None:
    doc = {
        "version": 2,
        "groups": [[0, 2], [1, 3]],
        "leaves": [
            {"path": ["w", 0], "dtype": "float32", "shape": [1 << 18], "holders": 0},
            {"path": ["w", 1], "dtype": "float32", "shape": [1 << 18], "holders": 1},
            {"path": ["norm"], "dtype": "float32", "shape": [64]},
        ],
    }
    src = tmp_path / "grouped.json"
    src.write_text(json.dumps(doc))
    out = tmp_path / "again.json"
    proc = run_cli("manifest", str(src), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    again = json.loads(out.read_text())
    assert again["version"] == 2 and again["groups"] == doc["groups"]
    assert [leaf.get("holders") for leaf in again["leaves"]] == [0, 1, None]
    plan_file = tmp_path / "plan.json"
    proc = run_cli("plan", str(src), "-p", "4", "--json", "-o", str(plan_file))
    assert proc.returncode == 0, proc.stderr
    plan = deeppart.Plan.from_json(plan_file.read_text())
    m = plan.manifest
    for r in range(4):
        for leaf, _, _ in plan.rank_pieces(r):
            g = m.leaves()[leaf]["holders"]
            assert g is None or r in m.groups[g]
    proc = run_cli("plan", str(src), "-p", "3")
    assert proc.returncode == 2
    assert "holder group 1 lists rank 3, but the world size is 3" in proc.stderr
