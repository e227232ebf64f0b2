"""DTensor state (FSDP2, HSDP, FSDP2 over TP, PP x FSDP2) through the
built-in multi-level engine (issue 48), on real torch FSDP2 with gloo under
torchrun: tests/levels/dtensor_levels_worker.py. One 4-rank job saves at
each level and loads back bitwise, after a node's files are lost or one is
corrupted; one 2-rank job loads its steps resharded, from what the
survivors hold (L1, L2) or the global copy (L4), and is refused an L1 step
that lost a node, naming its old ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "levels" / "dtensor_levels_worker.py"


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 4-rank job (every check of it runs on every rank)."""
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    d = tmp_path_factory.mktemp("dtlevels")
    run_ranks(WORKER, 4, "four", str(d), timeout_s=300)
    return d


@pytest.mark.multirank
def test_dtensor_state_through_every_level(four: Path) -> None:
    """FSDP2 at L1-L4, HSDP at L2, FSDP2 x TP at L3, PP x FSDP2 at L3: each
    rank's shards and optimizer state bitwise after a fresh load, and again
    after node 1's files (L2, L3) or every node's (L4) are deleted, served
    by the level the report names; a flipped byte served by the partner
    copy; a lost node of an L1 step named, and load() falling back with a
    warning (the worker's checks). Here: what the metadata records."""
    meta = json.loads((four / "meta" / "fsdp" / "step-00000001" / "metadata.json").read_text())
    assert meta["version"] == 2 and meta["levels"]["level"] == 1, meta.get("version")
    paths = {tuple(r["path"]) for r in meta["dtensors"]}
    assert ("model", "0.weight") in paths and ("optim", "state", "0.weight", "exp_avg") in paths
    # FSDP2 over 4 ranks: each shard held and written by its own rank only.
    for rec in meta["dtensors"]:
        for k, shard in enumerate(rec["shards"]):
            writers = {row[3] for row in meta["pieces"] if row[0] == shard["leaf"]}
            assert writers <= {k}, (rec["path"], k, writers)
    # PP x FSDP2: each stage's own items (metadata version 3, records by ranks).
    pp = json.loads((four / "meta" / "pp" / "step-00000001" / "metadata.json").read_text())
    assert pp["version"] == 3 and {tuple(r["ranks"]) for r in pp["dtensors"]} == {(0, 1), (2, 3)}


@pytest.mark.multirank
def test_dtensor_levels_on_another_world_size(four: Path) -> None:
    """2 ranks: the 4-rank job's steps loaded resharded from the
    node-local files (FSDP2 over 2, through the engine and
    Checkpointer(config=)), from the global copy for a lost node's ranks
    (L4; PP x FSDP2 with per_rank="drop"), bitwise; an L1 step that lost a
    node refused naming the old ranks; load() skipping those steps with a
    warning naming each (the worker's checks)."""
    run_ranks(WORKER, 2, "two", str(four), timeout_s=300)
