"""Multi-rank tests of typed values, flexible restore and the replica
check (workers: tests/state/mpi_values.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "state" / "mpi_values.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed"),
]

from mpi_checkpoint import launch  # noqa: E402


def _run(n: int, *args: str) -> str:
    proc = launch([str(MPIEXEC), "-n", str(n), sys.executable, str(SCRIPT), *args], 180, ROOT)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_replica_check_names_the_changed_leaf_on_every_rank(tmp_path: Path, n: int) -> None:
    out = _run(n, "replicas", str(tmp_path))
    assert out.count("OK replicas") == n, out


def test_a_differing_tensor_is_each_ranks_own_whatever_the_loader(tmp_path: Path) -> None:
    """Issue 49, item 4: a large tensor that differs in one element no
    sample reads comes back to each rank as its own, bitwise, with loader
    positions 100/101, 99/100 or none (deeppart.save, Checkpointer sync and
    async); declared replicas (verify_replicas=True) refuse it."""
    out = _run(2, "own_tensors", str(tmp_path))
    assert out.count("OK own_tensors") == 2, out


def test_per_rank_rng_states_are_each_ranks_own(tmp_path: Path) -> None:
    """Issue 49, item 5: torch.get_rng_state() per rank, beside a large
    tensor that differs in its last byte, comes back to each rank as its
    own, bitwise (deeppart.save, Checkpointer sync and async)."""
    out = _run(2, "own_rng", str(tmp_path))
    assert out.count("OK own_rng") == 2, out


def test_async_saves_prove_replicas_on_the_writer_thread(tmp_path: Path) -> None:
    """Issue 49 (the async stall): large shared tensors are proved after
    the call returns; the next optimizer step waits for the proof; copies
    that differ are each rank's own; a tensor changed in place under the
    proof fails the save on every rank (tests/state/mpi_values.py). The
    same through the multi-level engine's asynchronous saves
    (``Checkpointer(config=..., async_=True)``, issue 48), which proved
    them in the call before."""
    out = _run(2, "deferred_proof", str(tmp_path))
    assert out.count("OK deferred_proof rank") == 2, out
    assert out.count("OK deferred_proof_levels") == 2, out


def test_values_keys_and_strict_on_three_ranks(tmp_path: Path) -> None:
    out = _run(3, "values", str(tmp_path / "ck"))
    assert out.count("OK values") == 3, out


def test_model_only_use_of_a_checkpoint_with_per_rank_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checkpoints saved by 2 ranks, each with its own loader position and
    RNG bytes (and in ``own`` a model buffer of its own), used model-only in
    this one process (another world size): ``load(keys=["model"])``,
    ``Checkpointer.load`` with ``keys=`` and ``per_rank=``, and ``deeppart
    export --key model`` (with ``--per-rank`` where the model itself has
    per-rank paths; a refused export leaves no directory behind)."""
    from mpi_checkpoint import assert_bitwise_equal
    from mpi_values import per_rank_state
    from safetensors.torch import load_file

    from deeppart.tools.cli import main

    def same(want: dict[str, Any], file: Path) -> None:
        got = load_file(file)
        assert_bitwise_equal(dict(sorted(want.items())), dict(sorted(got.items())))

    out = _run(2, "per_rank", str(tmp_path))
    assert out.count("OK per_rank") == 2, out
    model = per_rank_state(0)["model"]
    cp = deeppart.Checkpointer(tmp_path / "root")
    ck = str(cp.path(5))

    # The per-rank paths lie outside keys=: no per_rank= needed.
    got = deeppart.load(ck, keys=["model"])
    assert list(got) == ["model"]
    assert_bitwise_equal(model, got["model"])
    assert_bitwise_equal(model, cp.load(keys=["model"])["model"])
    # A key that selects one still needs it, and the error names only that one.
    with pytest.raises(deeppart.PerRankStateError) as e:
        deeppart.load(ck, keys=["model", "loader"])
    assert "loader" in str(e.value) and "rng" not in str(e.value), e.value
    # Checkpointer.load takes per_rank=, as that error says.
    for r in (0, 1):
        state = cp.load(per_rank=r)
        assert state["loader"] == {"epoch": 2, "batches_seen": 100 + r}, state["loader"]
        assert state["rng"] == bytes([r + 1] * 16)
        assert_bitwise_equal(model, state["model"])
    assert sorted(cp.load(per_rank="drop")) == ["model"]

    # deeppart export --key model: the loader and RNG states do not matter.
    assert main(["export", ck, "--to", "safetensors", str(tmp_path / "st"), "--key", "model"]) == 0
    same(model, tmp_path / "st" / "model.safetensors")

    # model/own has one version per rank: refused without --per-rank,
    # naming it, and nothing is left behind.
    own = str(tmp_path / "own")
    dest = tmp_path / "new" / "st"
    capsys.readouterr()
    assert main(["export", own, "--to", "safetensors", str(dest), "--key", "model"]) == 2
    err = capsys.readouterr().err
    assert "model/own" in err and "--per-rank" in err, err
    assert not (tmp_path / "new").exists()
    for r in (0, 1):
        args = ["export", own, "--to", "safetensors", str(dest / str(r)), "--key", "model"]
        assert main([*args, "--per-rank", str(r)]) == 0
        want = per_rank_state(r, own_tensor=True)["model"]
        same(want, dest / str(r) / "model.safetensors")
    assert main(["export", own, "--to", "safetensors", str(dest / "drop"), "--key", "model",
                 "--per-rank", "drop"]) == 0  # fmt: skip
    same(model, dest / "drop" / "model.safetensors")
    # --to torch takes it too (its default: every version).
    pt = tmp_path / "loader.pt"
    assert (
        main(["export", own, "--to", "torch", str(pt), "--key", "loader", "--per-rank", "1"]) == 0
    )
    assert torch.load(pt, weights_only=True) == {"epoch": 2, "batches_seen": 101}
