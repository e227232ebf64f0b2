"""Every rank's own state (issue 32): multi-rank acceptance tests on real
FSDP2 ``fully_shard``, DeviceMesh sub-meshes, ``get_state_dict``, AdamW and
LR schedulers, gloo CPU ranks under torchrun (tests/state/own_state_worker.py).

One 4-rank job runs every 4-rank scenario in sequence and reports each
(``RESULT <name> PASS|FAIL ...``); one 2-rank job then reshards the
torchtitan-style checkpoint. Each scenario is its own test below, reading
the jobs' output. Each case either restores each rank's own values
bitwise or is refused naming the leaf; none may silently restore another
rank's or group's data.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_in_session, worker_cmd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "state" / "own_state_worker.py"
TIMEOUT_S = 600


def launch(n: int, job: str, d: Path) -> str:
    """The worker's ``job`` on ``n`` torchrun ranks; its output (the exit
    status is judged per scenario, from the RESULT lines)."""
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rc, out = run_in_session(worker_cmd(WORKER, n, job, str(d)), env, ROOT, TIMEOUT_S)
    return f"{out}\n(exit status {rc})"


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("own_state")
    return d, launch(4, "four", d)


@pytest.fixture(scope="module")
def two(four: tuple[Path, str]) -> str:
    d, _ = four
    return launch(2, "reshard", d)


def verdict(out: str, name: str) -> None:
    """Fails unless the job reported ``name`` as passed."""
    lines = re.findall(rf"^RESULT {name} (PASS|FAIL)(.*)$", out, re.M)
    assert lines, f"scenario {name} not reported (the job stopped before it):\n{out[-6000:]}"
    assert len(lines) == 1, lines
    status, detail = lines[0]
    assert status == "PASS", f"{name}:{detail}"


@pytest.mark.multirank
@pytest.mark.slow
def test_pp_fsdp_torchtitan_layout_restores_every_rank(four: tuple[Path, str]) -> None:
    """PP(2) x FSDP2(2) on a (pp, dp) mesh, stage 0 on ranks {0,1} and
    stage 1 on {2,3}, each stage's blocks fully_shard-ed on mesh["dp"] with
    FQNs of its own; AdamW moments (flattened optimizer state dict), a
    LambdaLR, a per-rank loader position and RNG state bytes. Saved without
    group=, everything perturbed, load(into=): every rank bitwise what it
    saved, and set_state_dict / load_state_dict take it; load() without a
    target gives each rank its own stage's full tensors and values. A
    second save of the same layout (other values) reuses the first's union
    and plan (no exchange) and loads back bitwise too."""
    verdict(four[1], "pp_fsdp")


@pytest.mark.multirank
@pytest.mark.slow
def test_pp_fsdp_reshards_to_two_ranks(two: str) -> None:
    """The PP(2) x FSDP2(2) checkpoint loaded at PP(2) x FSDP(1) on 2
    ranks: without per_rank= every rank raises PerRankStateError naming
    loader (a plain subtree is one leaf), rng and per_rank=; with
    per_rank="drop" (the target keeps its loader position and RNG, listed
    as missing) and per_rank=0
    (rank 0's), each stage gets its own model, optimizer and scheduler
    state bitwise (against the full tensors the 4-rank job wrote)."""
    verdict(two, "reshard")


@pytest.mark.multirank
@pytest.mark.slow
def test_per_rank_plain_values(four: tuple[Path, str]) -> None:
    """{"loader": {"epoch": 3, "batches_seen": 100 + rank}}, f"host-{rank}",
    [rank] * 3, RNG state bytes, and values whose encodings have different
    lengths per rank: each rank loads its own at the same world size,
    with and without into=."""
    verdict(four[1], "per_rank_values")


@pytest.mark.multirank
@pytest.mark.slow
def test_pipeline_stages_that_reuse_module_names(four: tuple[Path, str]) -> None:
    """Both stages name their blocks layers.0, layers.1 (same shapes, other
    values), FSDP2 on each stage's dp sub-mesh: each rank restores its own
    stage bitwise (into= and full tensors without it), or every rank
    refuses naming the leaf; never half of each stage."""
    verdict(four[1], "reused_names")


@pytest.mark.multirank
@pytest.mark.slow
def test_dp_groups_whose_embeddings_differ_in_unsampled_rows(four: tuple[Path, str]) -> None:
    """Two DP groups whose embeddings share path, dtype and shape and differ
    only in rows the sampled replica check does not read, each with a head
    of its own name and shape: with group="auto" and without group=, each group
    restores its own embedding bitwise, or every rank refuses naming it."""
    verdict(four[1], "auto_swap")


@pytest.mark.multirank
@pytest.mark.slow
def test_differing_hsdp_replica_is_refused_naming_its_ranks(four: tuple[Path, str]) -> None:
    """HSDP (2,2) with rank 2's copy of 2.weight's shard changed: the
    default save and verify_replicas=True raise ReplicaMismatchError on
    every rank, naming 2.weight and ranks [0] and [2] as holding different
    versions, and commit nothing; equal replicas save and load bitwise."""
    verdict(four[1], "hsdp_replica")
