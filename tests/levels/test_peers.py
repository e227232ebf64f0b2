"""Recovery that reshards from peers (issue 48) on the multi-node harness
(tests/support/cluster.py: each node a private tmpfs for ``ckpt_dir`` and
its own host name; needs root): real FSDP2 state over gloo saved by 4
nodes of one rank, then a node's storage gone and the job restarted on
the 3 survivors (world size 3, FSDP2 over 3 ranks): served from the
survivors' own files, partner copies (L2) and Reed-Solomon decoding
(L3), bitwise; a corrupted partner copy or own file rejected by its
checksums and another level used; with two nodes of one L3 group gone,
the fall back to the L4 step, said. All with the memory tier on (each
node's ckpt_dir its private tmpfs); and the memory tier's eviction, budget
refusal and restart from the tmpfs copies. The checks are in
tests/levels/peers_worker.py; here, what each load reported."""

from __future__ import annotations

import socket
import sys
from pathlib import Path
from typing import Any

import cluster
import pytest
from launching import run_in_session

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "levels" / "peers_worker.py"
TIMEOUT_S = 300

_why = cluster.unavailable()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=f"multi-node harness: {_why}"),
    pytest.mark.mpi,
    pytest.mark.slow,
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(
    c: cluster.Cluster, order: list[int], phase: str, *cases: str
) -> dict[str, list[dict[str, Any]]]:
    """``phase`` of the worker on one rank per node of ``order``; returns
    the loads recorded, by case."""
    n = len(order)
    argv = [sys.executable, str(WORKER), str(c.shared), str(c.local), str(free_port())]
    argv += [phase, *cases]
    rc, out = run_in_session(c.launch_cmd(n, order, argv), c.launch_env(n, order), ROOT, TIMEOUT_S)
    assert rc == 0, f"rc={rc}\n{out[-12000:]}"
    oks = [r for r in range(n) if (c.shared / "ok" / f"{phase}.{r}").exists()]
    assert oks == list(range(n)), f"{phase}: only ranks {oks} passed\n{out[-12000:]}"
    return cluster.take_results(c.shared / "results.jsonl", "case")


def test_restart_on_fewer_nodes_reshards_from_peers() -> None:
    """Saved by 4 nodes (one group of 4); node 3 lost; restarted on nodes
    0-2 (world size 3): L2 and L3 served from the survivors; a flipped
    byte in rank 1's own file rejected and rank 1 decoded; rank 3's only
    partner copy corrupt: that step skipped for the older L4 one; per-rank
    values by per_rank= (old rank 3's, from its partner copy)."""
    cluster.sweep()
    c = cluster.Cluster(4)
    try:
        launch(c, [0, 1, 2, 3], "save", "p2", "p3", "p2c", "p3c", "pr")
        c.replace(3)  # node 3 killed: its storage is gone
        rows = launch(c, [0, 1, 2], "three")
        got = {case: (r[0]["step"], r[0]["levels"], r[0]["world_size"]) for case, r in rows.items()}
        assert got == {
            "p2": (1, [1, 1, 1, 2], 3),
            "p3": (1, [1, 1, 1, 3], 3),
            "p3c": (1, [1, 3, 1, 3], 3),
            "p2c": (1, [1, 1, 1, 4], 3),
            "pr": (1, [1, 1, 1, 2], 3),
        }, rows
        assert rows["p3c"][0]["rejected"] == [
            "L1 own file of old rank 1 (rank-00001.bin) failed verification"
        ], rows
        assert "L2 partner copy of old rank 3" in rows["p2c"][0]["skipped"][0], rows
    finally:
        c.close()
    assert not c.dir.exists()


def test_two_nodes_of_a_group_lost_fall_back_to_l4() -> None:
    """Groups of 2 nodes: nodes 0 and 1 (one whole group) lost after an
    L3 save; restarted on nodes 2 and 3: the L3 step cannot be served
    (named), the L4 step before it is, resharded onto 2 ranks."""
    cluster.sweep()
    c = cluster.Cluster(4)
    try:
        launch(c, [0, 1, 2, 3], "save", "g2")
        c.replace(0)
        c.replace(1)
        rows = launch(c, [2, 3], "two")
        assert [(r["step"], r["levels"]) for r in rows["g2"]] == [(1, [4, 4, 1, 1])], rows
        assert rows["g2"][0]["skipped"][0].startswith("step 2: "), rows
    finally:
        c.close()
    assert not c.dir.exists()


def test_memory_tier_eviction_budget_and_restart() -> None:
    """The memory tier on each node's private tmpfs: the newest 2 steps
    kept, a save over memory_budget refused before anything is written
    (a user's file and directory untouched), then new processes recover
    from the tmpfs copies (the checks are in the worker)."""
    cluster.sweep()
    c = cluster.Cluster(4)
    try:
        launch(c, [0, 1, 2, 3], "mem_save")
        assert sorted(f for f in c.files(1) if "/mem/" in f) == sorted(
            [
                "dpnode1/mem/notes.txt",
                "dpnode1/mem/step-00000000/mine.txt",
                "dpnode1/mem/step-00000002/parity-00001.bin",
                "dpnode1/mem/step-00000002/rank-00001.bin",
                "dpnode1/mem/step-00000003/partner-00000.bin",
                "dpnode1/mem/step-00000003/rank-00001.bin",
            ]
        ), c.files(1)
        rows = launch(c, [0, 1, 2, 3], "mem_restart")
        assert [(r["step"], r["levels"]) for r in rows["mem"]] == [(3, [1] * 4), (2, [1] * 4)]
    finally:
        c.close()
    assert not c.dir.exists()
