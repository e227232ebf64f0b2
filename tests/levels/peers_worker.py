"""One rank of the reshard-from-peers tests on the multi-node harness
(tests/levels/test_peers.py, issue 48): real FSDP2 ``fully_shard`` state
over gloo (CPU), each rank inside its node's namespaces (a private tmpfs
at LOCAL, the node-local ``ckpt_dir``; its own host name), started as

    mpiexec -n K ENTER python tests/levels/peers_worker.py SHARED LOCAL PORT PHASE

(gloo's rendezvous at 127.0.0.1:PORT; the rank and size from hydra's
``PMI_RANK``/``PMI_SIZE``; no mpi4py, so the engine's communicator is
torch.distributed's). Phases:

- ``save`` (4 ranks, one a node): FSDP2 over 4 ranks saved as the CASEs of
  ``p2`` (L2), ``p3`` (L3, one group of 4), ``p2c`` (L4 step 1, L2 step
  2), ``p3c`` (L3), ``g2`` (groups of 2: L4 step 1, L3 step 2); the full
  tensors saved once with :func:`deeppart.save` (``SHARED/ref``).
- ``three`` (3 ranks on nodes 0-2, node 3's storage gone): first the damage
  (a flipped byte in node 0's partner copy of rank 3 in ``p2c``, and in
  node 1's own file of rank 1 in ``p3c``), then every case loaded into
  FSDP2 over 3 ranks, bitwise against ``SHARED/ref``; ``pr`` (each rank's
  own loader position and bytes beside FSDP2, at L2) refused without
  ``per_rank=`` and, with ``per_rank=3``, old rank 3's versions (from its
  partner copy) on every rank.
- ``two`` (2 ranks on nodes 2 and 3, nodes 0 and 1 gone): ``g2``'s L3 step
  lost with its group: ``load(2)`` names it, ``load()`` falls back to the
  L4 step with an ``OlderStepWarning``.
- ``mem_save`` / ``mem_restart`` (4 ranks): the memory tier's eviction and
  budget refusal, then new processes served from the tmpfs copies.

Every case runs with the memory tier on (``memory = 1``, ``memory_keep =
2``): ``ckpt_dir`` is each node's private tmpfs.

Rank 0 appends ``{"case", "step", "levels", "rejected", "skipped"}`` per
load to ``SHARED/results.jsonl``; every rank touches
``SHARED/ok/<phase>.<rank>`` when its checks pass.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "state"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import torch.distributed as dist
from dtensor_worker import equal, exchanges, read_by, received_bytes, to_full
from levels_worker import flip_byte as flip

import deeppart
from bench.dtensor import build, sharded_state
from deeppart.comm import SingleComm
from deeppart.errors import OlderStepWarning, PerRankStateError, UnrecoverableError
from deeppart.format import data_file_name
from deeppart.levels import LevelConfig, RecoveryReport, recovery
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels.layout import partner_file, step_name

#: case -> (group_size, ((step, level), ...)).
CASES: dict[str, tuple[int, tuple[tuple[int, int], ...]]] = {
    "p2": (4, ((1, 2),)),
    "p3": (4, ((1, 3),)),
    "p2c": (4, ((1, 4), (2, 2))),
    "p3c": (4, ((1, 3),)),
    "g2": (2, ((1, 4), (2, 3))),
    "mem": (4, ((1, 2), (2, 3), (3, 2))),
    "pr": (4, ((1, 2),)),
}


def per_rank_items(rank: int) -> dict[str, Any]:
    """What each rank of the ``pr`` case saves beside its FSDP2 state: its
    own loader position and RNG-like bytes (kept per rank)."""
    import torch

    return {"loader_pos": 100 + rank, "rng": torch.full((8,), rank, dtype=torch.uint8)}


def backend(shared: Path, local: Path, case: str, **kw: Any) -> BuiltinBackend:
    """The case's engine, with the memory tier on: ``ckpt_dir`` is each
    node's private tmpfs."""
    cfg = LevelConfig.from_dict(
        {
            "ckpt_dir": str(local),
            "meta_dir": str(shared / "meta"),
            "glbl_dir": str(shared / "global"),
            "node_size": 1,
            "group_size": CASES[case][0],
            "ckpt_l1": 1,
            "local_test": 0,
            "exec_id": case,
            "keep": 5,
            "memory": 1,
            "memory_keep": 2,
            **kw,
        }
    )
    # Small stripes: L3 codes several stripes.
    return BuiltinBackend(cfg, "torch", stripe_bytes=2048)


def record(shared: Path, case: str, report: RecoveryReport) -> None:
    if dist.get_rank() == 0:
        row = {
            "case": case,
            "step": report.step,
            "levels": report.levels,
            "rejected": report.rejected,
            "skipped": report.skipped,
            "world_size": report.world_size,
        }
        with open(shared / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def load_case(
    shared: Path, local: Path, case: str, ref: Any, step: int | None = None
) -> RecoveryReport:
    """``case`` loaded into FSDP2 over this job's ranks: filled in place,
    bitwise the saved full tensors; the shard exchange checked
    (:func:`check_parts`)."""
    m, opt = build("fsdp", seed=7)
    target = sharded_state(m, opt)
    with exchanges(recovery) as calls:
        out, report = backend(shared, local, case).load(step, into=target)
    assert out["model"]["0.weight"] is target["model"]["0.weight"], "into= not filled"
    equal(to_full(out), ref, f"{case} on {dist.get_world_size()} ranks")
    check_parts(case, target, calls)
    record(shared, case, report)
    return report


def check_parts(case: str, target: Any, calls: list[tuple[Any, Any]]) -> None:
    """Each rank received exactly the rows its new shards take of the
    stored pieces in the files it did not hold (the intersections, read
    from torch's own local shards), and at another world size fewer bytes
    than those pieces whole (over the job)."""
    import torch

    [(sr, meta)] = calls
    parts, wholes = received_bytes(meta, target, read_by(sr))
    assert sr.received == parts, (case, dist.get_rank(), sr.received, parts, wholes)
    short = torch.tensor([float(wholes - parts)])
    dist.all_reduce(short)
    if meta.world_size != dist.get_world_size():
        assert short.item() > 0, f"{case}: every piece a rank needed crossed whole"


def phase_save(shared: Path, local: Path, cases: list[str]) -> None:
    m, opt = build("fsdp", seed=1)
    state = sharded_state(m, opt)
    full = to_full(state)
    if dist.get_rank() == 0:
        deeppart.save(full, shared / "ref", comm=SingleComm())
    for case in cases:
        be = backend(shared, local, case)
        mine = {**state, **per_rank_items(dist.get_rank())} if case == "pr" else state
        for step, level in CASES[case][1]:
            be.save(step, mine, level=level)


def phase_three(shared: Path, local: Path, cases: list[str]) -> None:
    ref = deeppart.load(shared / "ref", comm=SingleComm())
    rank = dist.get_rank()
    host = os.uname().nodename
    # Damage, each node its own files: node 0 holds rank 3's partner copy.
    if rank == 0:
        flip(local / host / "p2c" / step_name(2) / partner_file(3))
    if rank == 1:
        flip(local / host / "p3c" / step_name(1) / data_file_name(1))
    dist.barrier()
    r = load_case(shared, local, "p2", ref)
    assert r.levels == [1, 1, 1, 2] and r.world_size == 3, r
    r = load_case(shared, local, "p3", ref)
    assert r.levels == [1, 1, 1, 3], r
    # Rank 1's own file rejected: ranks 1 and 3 decoded from the others.
    r = load_case(shared, local, "p3c", ref)
    assert r.levels == [1, 3, 1, 3], r
    assert any("own file of old rank 1" in x for x in r.rejected), r
    # Per-rank values at another world size: deeppart.load's rules. Without
    # per_rank=, named; with per_rank=3, old rank 3's versions (from its
    # partner copy) on every rank, beside the FSDP2 state resharded.
    m, opt = build("fsdp", seed=7)
    target = {**sharded_state(m, opt), **per_rank_items(50)}
    try:
        backend(shared, local, "pr").load(into=target)
    except PerRankStateError as e:
        assert "loader_pos" in str(e) and "rng" in str(e), e
    else:
        raise AssertionError("per-rank values loaded on 3 ranks without per_rank=")
    out, r = backend(shared, local, "pr").load(into=target, per_rank=3)
    assert r.levels == [1, 1, 1, 2], r
    assert out["loader_pos"] == 103, out["loader_pos"]
    equal(out["rng"], per_rank_items(3)["rng"], "pr rng")
    equal(to_full({"model": out["model"], "optim": out["optim"]}), ref, "pr on 3 ranks")
    record(shared, "pr", r)
    # The L2 step: rank 3's only copy corrupt, no other level: step 2 is
    # skipped with a warning naming it, step 1 (L4) served: rank 3 from
    # the global copy, the others from their own files.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = load_case(shared, local, "p2c", ref)
    assert r.step == 1 and r.levels == [1, 1, 1, 4], r
    assert r.skipped and "partner copy of old rank 3" in r.skipped[0], r
    assert any(issubclass(w.category, OlderStepWarning) for w in caught), caught


def phase_two(shared: Path, local: Path, cases: list[str]) -> None:
    ref = deeppart.load(shared / "ref", comm=SingleComm())
    try:
        backend(shared, local, "g2").load(2)
    except UnrecoverableError as e:
        text = str(e)
        assert "step 2: written by 4 ranks, loaded on 2" in text, text
        assert "old rank(s) [0, 1]" in text and "L3 (Reed-Solomon decoding)" in text, text
    else:
        raise AssertionError("g2: step 2 loaded without its group's two nodes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = load_case(shared, local, "g2", ref)
    assert r.step == 1 and r.levels == [4, 4, 1, 1], r
    assert r.skipped and r.skipped[0].startswith("step 2: "), r
    text = " ".join(str(w.message) for w in caught)
    assert "step 2" in text and "step 1" in text, text


def local_steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def phase_mem_save(shared: Path, local: Path, cases: list[str]) -> None:
    """The memory tier: steps 1-3 saved, the newest 2 kept in each node's
    memory; a user's directory named like a step and a user's file stay;
    a save over memory_budget refused before anything is written."""
    m, opt = build("fsdp", seed=1)
    state = sharded_state(m, opt)
    full = to_full(state)
    if dist.get_rank() == 0:
        deeppart.save(full, shared / "ref", comm=SingleComm())
    root = local / os.uname().nodename / "mem"
    root.mkdir(parents=True)
    (root / "notes.txt").write_text("the user's")
    (root / "step-00000000").mkdir()
    (root / "step-00000000" / "mine.txt").write_text("the user's too")
    be = backend(shared, local, "mem")
    user = ["step-00000000"]
    for (step, level), want in zip(CASES["mem"][1], ([1], [1, 2], [2, 3]), strict=True):
        be.save(step, state, level=level)
        dist.barrier()
        held = local_steps(root)
        assert held == sorted([*user, *(step_name(s) for s in want)]), (step, held)
    # Over budget: refused on every rank, naming each node; nothing written.
    tight = backend(shared, local, "mem", memory_budget="4K")
    try:
        tight.save(4, state, level=3)
    except deeppart.NoSpaceError as e:
        text = str(e)
        assert "step 4 does not fit node-local memory; nothing was written" in text, text
        for k in range(4):
            assert f"node dpnode{k}: step 4 at L3 needs" in text, text
        assert "memory_budget = 4096, over by" in text and "parity" in text, text
    else:
        raise AssertionError("a save over memory_budget was not refused")
    dist.barrier()
    assert local_steps(root) == sorted([*user, step_name(2), step_name(3)]), local_steps(root)
    assert (root / "notes.txt").read_text() == "the user's"
    assert (root / "step-00000000" / "mine.txt").read_text() == "the user's too"
    assert not (shared / "meta" / "mem" / step_name(4)).exists()
    r = load_case(shared, local, "mem", full)
    assert r.step == 3 and r.levels == [1] * 4, r


def phase_mem_restart(shared: Path, local: Path, cases: list[str]) -> None:
    """New processes on the same nodes: served from the tmpfs copies."""
    ref = deeppart.load(shared / "ref", comm=SingleComm())
    for step in (None, 2):
        r = load_case(shared, local, "mem", ref, step)
        assert r.step == (step or 3) and r.levels == [1] * 4 and r.world_size is None, r


def main() -> int:
    shared, local, port, phase = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    cases = sys.argv[5:]
    rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=90))
    try:
        phases = {
            "save": phase_save,
            "three": phase_three,
            "two": phase_two,
            "mem_save": phase_mem_save,
            "mem_restart": phase_mem_restart,
        }
        phases[phase](shared, local, cases)
        dist.barrier()
        (shared / "ok").mkdir(exist_ok=True)
        (shared / "ok" / f"{phase}.{rank}").touch()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
