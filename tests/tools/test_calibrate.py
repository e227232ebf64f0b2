"""Calibration: the least-squares fit recovers known parameters from
synthetic timings; the command writes a profile the planner and simulator use."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from deeppart import _planner
from deeppart.tools.calibrate import (
    cost_model_from_profile,
    fit_io,
    fit_linear,
    load_profile,
    measure_node_saves,
    measure_saves,
    median_samples,
    profiles_dir,
)
from deeppart.tools.cli import main
from deeppart.tools.simulate import StorageModel


def _synthetic(
    fixed: float, piece: float, bw: float, noise: float, seed: int = 0
) -> list[tuple[int, int, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for size in (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20):
        for n in (1, 4, 16, 64, 256):
            t = fixed + n * piece + size / bw
            out.append((size, n, t * (1 + noise * rng.standard_normal())))
    return out


@pytest.mark.parametrize(
    ("fixed", "piece", "bw"), [(2e-3, 20e-6, 1e9), (5e-4, 1e-6, 3.5e9), (1e-2, 1e-4, 2e8)]
)
def test_fit_io_recovers_exact_parameters(fixed: float, piece: float, bw: float) -> None:
    params, fit = fit_io(_synthetic(fixed, piece, bw, noise=0.0))
    assert params["fixed_s"] == pytest.approx(fixed, rel=1e-6)
    assert params["piece_s"] == pytest.approx(piece, rel=1e-6)
    assert params["bandwidth"] == pytest.approx(bw, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.rel_rms < 1e-9


def test_fit_io_with_noise_is_close_and_reports_its_error() -> None:
    params, fit = fit_io(_synthetic(2e-3, 20e-6, 1e9, noise=0.02, seed=3))
    assert params["fixed_s"] == pytest.approx(2e-3, rel=0.1)
    assert params["piece_s"] == pytest.approx(20e-6, rel=0.1)
    assert params["bandwidth"] == pytest.approx(1e9, rel=0.05)
    assert 0.99 < fit.r2 < 1.0
    assert 0.005 < fit.rel_rms < 0.05  # about the injected 2 %


def test_negative_coefficients_are_dropped() -> None:
    # y = 3 + 2x, and a column that only fits noise negatively.
    x = [[1.0, float(i), float((-1) ** i)] for i in range(10)]
    y = [3 + 2 * i - 0.1 * (-1) ** i for i in range(10)]
    fit = fit_linear(x, y)
    assert fit.coef[2] == 0.0
    assert all(c >= 0 for c in fit.coef)


def test_fit_rejects_too_few_or_nonpositive() -> None:
    with pytest.raises(ValueError):
        fit_linear([[1.0, 2.0]], [1.0])
    with pytest.raises(ValueError):
        fit_linear([[1.0], [1.0]], [1.0, 0.0])


def test_median_samples() -> None:
    got = median_samples([(1, 1, 1.0), (1, 1, 9.0), (1, 1, 2.0), (2, 1, 5.0)])
    assert sorted(got) == [(1, 1, 2.0), (2, 1, 5.0)]


def test_calibrate_command_writes_a_usable_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["calibrate", "--dir", str(tmp_path), "--name", "t", "--quick",
               "--repeats", "1", "--no-serialization", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    path = Path(out["path"])
    assert path == profiles_dir() / "t.json" and path.is_file()
    for kind in ("write", "read"):
        assert {"r2", "rel_rms", "samples"} <= set(out["fit"][kind])
    assert not list(tmp_path.iterdir()), "the measurement files are removed"
    profile = load_profile("t")
    # torch is installed: the rank stream is fitted to whole saves, and the
    # storage's raw figures are kept beside it.
    assert profile["params"]["write_source"] == "deeppart.save"
    assert {"storage_write", "write"} <= set(out["fit"])
    for key in ("storage_fixed_s", "storage_piece_s", "storage_node_bw"):
        assert profile["params"][key] >= 0
    cost = cost_model_from_profile(profile)
    assert cost.fixed_s == pytest.approx(max(profile["params"]["fixed_s"], 0.0))
    # The storage model's shared parameters are measured and reach the planner;
    # on one machine the aggregate bandwidth is the node's.
    params = profile["params"]
    assert params["writer_s"] > 0 and params["node_bw"] > 0
    assert params["aggregate_bw"] == params["node_bw"]
    assert cost.writer_s == pytest.approx(params["writer_s"])
    assert cost.node_bandwidth == pytest.approx(params["node_bw"])
    assert cost.aggregate_bandwidth == pytest.approx(params["node_bw"])
    model = StorageModel.from_profile(profile)
    assert model.fixed_s == pytest.approx(profile["params"]["fixed_s"])
    assert main(["plan", str(Path(__file__).parents[2] / "examples" / "manifest.json"),
                 "-p", "4", "--profile", "t", "--json"]) == 0  # fmt: skip


def test_raw_writes_calibrate_the_stream_with_pwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["calibrate", "--dir", str(tmp_path), "--name", "raw", "--quick",
               "--repeats", "1", "--no-serialization", "--raw-writes", "--json"])  # fmt: skip
    assert rc == 0
    params = json.loads(capsys.readouterr().out)["params"]
    assert params["write_source"] == "raw pwrite"
    assert params["fixed_s"] == params["storage_fixed_s"]
    assert params["write_bw"] == params["storage_write_bw"]
    assert params["node_bw"] == params["storage_node_bw"]


def test_save_measurements_are_whole_saves_that_leave_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("DEEPPART_CACHE_DIR", str(cache_dir))
    target = tmp_path / "target"
    target.mkdir()
    samples = measure_saves(target, [1 << 20, 64 << 10], [1, 4], repeats=2)
    assert samples is not None
    # (bytes, tensors) of every configuration, twice; 64 KiB in 4 tensors
    # of 16 KiB is measured, nothing below 4 KiB a tensor is.
    assert sorted((b, n) for b, n, _ in samples) == sorted(
        [(1 << 20, 1), (1 << 20, 4), (64 << 10, 1), (64 << 10, 4)] * 2
    )
    assert all(t > 0 for *_, t in samples)
    assert measure_saves(target, [8 << 10], [4], repeats=1) == []
    bw = measure_node_saves(target, streams=3, size=1 << 20, repeats=2)
    assert bw is not None and bw > 0
    assert not list(target.iterdir()), "every checkpoint is removed"
    assert not cache_dir.exists(), "the synthetic plans stay out of the plan cache"


def test_profile_with_unresolved_bandwidth_keeps_defaults(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"params": {"fixed_s": 1e-3, "piece_s": 1e-5, "write_bw": None}}))
    cost = cost_model_from_profile(load_profile(str(f)))
    assert cost.bandwidth == _planner.CostModel().bandwidth
    assert cost.fixed_s == 1e-3
    assert math.isfinite(StorageModel.from_profile(load_profile(str(f))).rank_bw)


def test_unknown_profile() -> None:
    with pytest.raises(ValueError, match="no calibration profile"):
        load_profile("does-not-exist")
