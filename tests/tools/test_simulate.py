"""The simulator: internal consistency of its model, every method at every
world size up to 65,536, plots that are PNGs with labelled axes, the CLI,
and (with mpiexec, slow) predictions against real deeppart.save runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deeppart import _planner
from deeppart.tools.cli import main
from deeppart.tools.manifest_source import read_manifest as load_manifest
from deeppart.tools.models import MODELS
from deeppart.tools.plotting import plot_plan_load, plot_scaling
from deeppart.tools.simulate import (
    BASELINES,
    LEVELS,
    THESIS_SPEEDUPS,
    StorageModel,
    evaluate,
    parse_world_sizes,
    planning_bandwidth,
    predict_plan,
    predict_torch_save,
    ranks_per_node,
    simulate,
)

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def bert_base() -> _planner.Manifest:
    return MODELS["bert-base"]()


def test_builtin_models_match_bench_models() -> None:
    sys.path.insert(0, str(ROOT))
    from bench import models as bm

    assert MODELS["bert-large"]().fingerprint == bm.bert_large().fingerprint
    assert MODELS["gpt2"]().fingerprint == bm.gpt2_small().fingerprint
    assert load_manifest("bert-base+adamw").fingerprint == bm.bert_base().fingerprint
    sizes = {k: MODELS[k]().total_bytes for k in ("llama-1b", "llama-7b", "llama-13b")}
    assert sizes["llama-1b"] < sizes["llama-7b"] < sizes["llama-13b"]
    # Llama 2 7B: 6.74e9 parameters, x3 (weights and two AdamW moments) x 4 B.
    assert sizes["llama-7b"] == pytest.approx(6.74e9 * 12, rel=0.01)


def test_evaluate_one_rank_is_the_cost_model() -> None:
    m = StorageModel(ranks_per_node=1, rank_bw=1e9, local_bw=1e12, pfs_bw=1e12, net_bw=1e12)
    t, bound, extra = evaluate(m, [10**9], [10], "L4")
    assert t == pytest.approx(m.fixed_s + 10 * m.piece_s + 1.0 + m.writer_s)
    assert bound == "rank" and extra == 0.0


def test_evaluate_shared_and_node_limits() -> None:
    m = StorageModel(ranks_per_node=4, rank_bw=1e9, local_bw=1e9, pfs_bw=2e9, net_bw=1e12)
    b = [10**9] * 8  # 2 nodes, 8 GB
    t4, bound4, _ = evaluate(m, b, [1] * 8, "L4")
    assert bound4 == "shared"
    assert t4 == pytest.approx(m.fixed_s + 8e9 / 2e9 + 8 * m.writer_s)
    t1, bound1, _ = evaluate(m, b, [1] * 8, "L1")  # each node's disk: 4 GB at 1 GB/s
    assert bound1 == "node" and t1 == pytest.approx(m.fixed_s + 4.0 + 8 * m.writer_s)
    t2, _, extra2 = evaluate(m, b, [1] * 8, "L2")
    assert extra2 == pytest.approx(4e9 / min(m.net_bw, m.local_bw))
    assert t2 == pytest.approx(t1 + extra2)
    # Levels that need other nodes are not available on one node.
    assert math.isnan(evaluate(m, [1] * 4, [1] * 4, "L2")[0])
    assert math.isnan(evaluate(m, [1] * 4, [1] * 4, "L3")[0])


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("world_size", [1, 8, 64, 512])
def test_prediction_is_the_planners_modelled_time(
    bert_base: _planner.Manifest, level: str, world_size: int
) -> None:
    """One model: the simulator predicts exactly the modelled time the
    planner reports for the plan (plus the level's phases after the write)."""
    model = StorageModel()
    topo = _planner.Topology(ranks_per_node(model, world_size))
    plan = _planner.plan(bert_base, world_size, cost=model.cost_model(level=level), topology=topo)
    pred = predict_plan(model, plan, level, "balanced")
    assert plan.modelled_time()["makespan"] == plan.stats.makespan
    if math.isnan(pred.extra_s):
        assert math.isnan(pred.seconds)
    else:
        assert pred.seconds == plan.stats.makespan + pred.extra_s
        if level in ("L1", "L4"):
            assert pred.seconds == plan.stats.makespan
    assert pred.writers == plan.stats.writers


def test_model_time_checks_its_arguments() -> None:
    cost = _planner.CostModel()
    with pytest.raises(_planner.PlanError):
        _planner.model_time(cost, [1, 2], [3])
    with pytest.raises(_planner.PlanError):
        _planner.model_time(cost, [], [])
    with pytest.raises(_planner.PlanError):
        _planner.model_time(cost, [1, 1, 1], [1, 1, 1], topology=_planner.Topology(2))
    t = _planner.model_time(cost, [2, 0], [10**9, 0])
    assert t["writers"] == 1 and t["rank_costs"][1] == 0.0
    assert t["makespan"] == cost.fixed_s + 2 * cost.piece_s + 1.0 + cost.writer_s


def test_planning_bandwidth_is_the_least_share() -> None:
    m = StorageModel(ranks_per_node=4, rank_bw=1e9, local_bw=2e9, pfs_bw=8e9, net_bw=1e12)
    assert planning_bandwidth(m, 1, "L4") == 1e9
    assert planning_bandwidth(m, 4, "L1") == 0.5e9  # 2 GB/s over 4 ranks of a node
    assert planning_bandwidth(m, 64, "L4") == 8e9 / 64
    assert planning_bandwidth(m, 64, "L4", writers=8) == 1e9


def test_simulate_every_method_and_consistency(bert_base: _planner.Manifest) -> None:
    sizes = [1, 2, 4, 64, 1024]
    preds = simulate(bert_base, sizes, StorageModel())
    methods = {p.method for p in preds}
    assert methods == {"balanced", "lpt", "greedy", "deeppart", *BASELINES,
                       *(f"deeppart-{lv}" for lv in LEVELS)}  # fmt: skip
    by = {(p.method, p.world_size): p for p in preds}
    for p in sizes:
        ts = by[("torch.save", p)]
        assert ts.seconds == pytest.approx(predict_torch_save(StorageModel(), bert_base, p).seconds)
        # DCP-style dedup is the greedy plan, on L4.
        assert by[("dcp-dedup", p)].seconds == pytest.approx(by[("greedy", p)].seconds)
        assert by[("balanced", p)].seconds == pytest.approx(by[("deeppart-L4", p)].seconds)
        for pr in preds:
            if pr.world_size == p and not math.isnan(pr.seconds):
                # Nothing beats the aggregate rank bandwidth.
                assert pr.seconds >= bert_base.total_bytes / (p * StorageModel().rank_bw)
    # One rank: the balanced plan is torch.save plus its per-piece costs.
    one = by[("balanced", 1)].seconds - by[("torch.save", 1)].seconds
    assert 0 <= one < 0.1
    # Parallel writers help, as long as the rank stream is the limit.
    assert by[("balanced", 2)].seconds < 0.6 * by[("balanced", 1)].seconds
    assert by[("balanced", 64)].seconds < by[("torch.save", 64)].seconds / 5
    assert math.isnan(by[("deeppart-L2", 4)].seconds)  # one node: no partner
    assert not math.isnan(by[("deeppart-L2", 64)].seconds)


def test_simulate_65536_ranks(bert_base: _planner.Manifest) -> None:
    preds = simulate(bert_base, [65536], StorageModel(), algorithms=("balanced", "greedy"))
    assert all(p.world_size == 65536 for p in preds)
    bal = next(p for p in preds if p.method == "balanced")
    assert bal.writers <= 65536 and bal.seconds > 0


def test_parse_world_sizes() -> None:
    assert parse_world_sizes("1-16") == [1, 2, 4, 8, 16]
    assert parse_world_sizes("3,1,2-8") == [1, 2, 3, 4, 8]
    with pytest.raises(ValueError):
        parse_world_sizes("0")


def _labels(fig: object) -> list[tuple[str, str]]:
    return [(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes]  # type: ignore[attr-defined]


def test_scaling_plot_is_png_with_labelled_axes(
    bert_base: _planner.Manifest, tmp_path: Path
) -> None:
    preds = simulate(bert_base, [1, 4, 16], StorageModel())
    out = tmp_path / "s.png"
    fig = plot_scaling(preds, out, thesis=THESIS_SPEEDUPS)
    assert out.read_bytes()[:8] == PNG
    labels = _labels(fig)
    assert len(labels) == 2
    for x, y in labels:
        assert x.strip() and y.strip()
    assert all(ax.get_xscale() == "log" and ax.get_yscale() == "log" for ax in fig.axes)
    # Methods with the same prediction everywhere are one labelled curve
    # (at L4, "balanced" is what deeppart-L4 writes), not curves drawn over
    # each other; one legend, below the panels, covers no data.
    texts = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
    assert "balanced = deeppart-L4" in texts and "deeppart-L4" not in texts, texts
    assert all(ax.get_legend() is None for ax in fig.axes)
    lines = [ln for ln in fig.axes[0].get_lines() if not str(ln.get_label()).startswith("_")]
    assert len(lines) == len({ln.get_label() for ln in lines}) == len(texts) - len(THESIS_SPEEDUPS)
    legend_box = fig.legends[0].get_window_extent()
    for ax in fig.axes:
        assert legend_box.y1 <= ax.get_window_extent().y0, "the legend overlaps a panel"


def test_plan_load_plot(tmp_path: Path, bert_base: _planner.Manifest) -> None:
    plan = _planner.plan(bert_base, 8)
    greedy = _planner.plan(bert_base, 8, algorithm="greedy")
    out = tmp_path / "p.png"
    fig = plot_plan_load(plan, greedy, out)
    assert out.read_bytes()[:8] == PNG
    assert all(x or y for x, y in _labels(fig))
    assert fig.axes[0].get_xlabel() == "rank" and fig.axes[0].get_ylabel()
    assert fig.axes[1].get_ylabel()
    # The legend explains why the makespan is above every rank's own cost.
    legend = fig.axes[0].get_legend()
    assert legend is not None
    texts = [t.get_text() for t in legend.get_texts()]
    cost = max(plan.rank_costs()) * 1e3
    want = (f"balanced (this plan): makespan {plan.stats.makespan * 1e3:.1f} ms = slowest rank "
            f"{cost:.1f} ms + {plan.stats.writers} writers x")  # fmt: skip
    assert any(t.startswith(want) for t in texts), texts


def test_plan_cli_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.png"
    assert main(["plan", str(ROOT / "examples" / "manifest.json"), "-p", "4",
                 "--plot", str(out)]) == 0  # fmt: skip
    assert out.read_bytes()[:8] == PNG


def test_simulate_cli_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sim.png"
    rc = main(["simulate", "--model", "gpt2", "--ranks", "1,4,64", "--json", "--plot", str(out),
               "--pfs-bw", "5e9", "--thesis"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["storage"]["pfs_bw"] == 5e9
    assert {p["world_size"] for p in data["predictions"]} == {1, 4, 64}
    assert out.read_bytes()[:8] == PNG
    rc = main(["simulate", "--model", str(ROOT / "examples" / "manifest.json"), "-p", "4-8"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "torch.save" in text and "speed-up" in text
    assert main(["simulate", "--model", "no-such-model"]) == 2
    # Its leaf owned by rank 3 needs at least 4 ranks.
    assert main(["simulate", "--model", str(ROOT / "examples" / "manifest.json"), "-p", "1"]) == 2


MPIEXEC = Path(sys.executable).parent / "mpiexec"

# docs/SIMULATOR.md, "Validation": on a shared, loaded 2-core machine the
# measured times vary by 2x between runs; the documented tolerance is a factor
# of 4 either way.
TOLERANCE = 4.0


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_predictions_match_real_saves(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "validate_simulator.py"), "--dir", str(tmp_path),
         "--repeats", "2", "--ranks", "1,2,4"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["runs"][0]["rows"]
    assert [r["ranks"] for r in rows] == [1, 2, 4]
    for r in rows:
        ratio = r["predicted_s"] / r["measured_s"]
        assert 1 / TOLERANCE < ratio < TOLERANCE, r


def test_profile_sets_the_l4_storage_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A profile of a local disk at 1.33 GB/s (the issue's): L4 is predicted
    on that storage, not on the default 20 GB/s parallel file system, so 4 GB
    on 4 ranks cannot take less than 4 GB / 1.33 GB/s; --pfs-bw still wins."""
    prof = tmp_path / "disk.json"
    prof.write_text(json.dumps({"version": 1, "params": {
        "fixed_s": 1e-3, "piece_s": 1e-6, "write_bw": 1.0e9, "node_bw": 1.33e9}}))  # fmt: skip
    model = StorageModel.from_profile(json.loads(prof.read_text()))
    assert model.pfs_bw == model.local_bw == 1.33e9
    assert StorageModel.from_profile(json.loads(prof.read_text()), pfs_bw=5e9).pfs_bw == 5e9
    rc = main(["simulate", "--model", "bert-large", "--ranks", "4", "--profile", str(prof),
               "--json"])  # fmt: skip
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    assert data["storage"]["pfs_bw"] == 1.33e9
    floor = data["total_bytes"] / 1.33e9
    for p in data["predictions"]:
        if p["method"] in ("balanced", "deeppart-L4"):
            assert p["seconds"] >= floor, p
    assert main(["simulate", "--model", "bert-large", "--ranks", "4", "--profile", str(prof)]) == 0
    assert "shared (L4) 1.33 GB/s" in capsys.readouterr().out
