"""Plans: validity checked from Python for every algorithm, determinism, the
JSON form, the quality figures, and the GIL."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import deeppart
from bench import models
from bench.planner import modelled_makespan, plan_piece_bytes

ALGORITHMS: list[str] = list(deeppart.ALGORITHMS)
MiB = 1 << 20


def make_plan(manifest: deeppart.Manifest, world_size: int, **kwargs: Any) -> deeppart.Plan:
    """``deeppart.plan`` without the plan cache: these tests test the planner."""
    return deeppart.plan(manifest, world_size, cache=False, **kwargs)


def _units(leaf: dict[str, Any]) -> int:
    if leaf["kind"] == "object":
        return 1
    return math.prod(leaf["shape"])


def _mixed() -> deeppart.Manifest:
    """Large and small tensors, 0-D and empty ones, objects, owned leaves."""
    return deeppart.Manifest.from_leaves(
        [
            {"path": ["big"], "dtype": "float32", "shape": [4096, 4096]},  # 64 MiB
            {"path": ["vec"], "dtype": "bfloat16", "shape": [3 * MiB]},
            {"path": ["mid", 0], "dtype": "float16", "shape": [1000, 1000]},
            {"path": ["mid", 1], "dtype": "int64", "shape": [7, 11, 13]},
            {"path": ["scalar"], "dtype": "float32", "shape": []},
            {"path": ["empty"], "dtype": "float32", "shape": [0, 5]},
            {"path": ["cfg"], "kind": "object", "nbytes": 300},
            {"path": ["blob"], "kind": "object", "nbytes": 5 * MiB},
            {"path": ["rng", 0], "dtype": "uint8", "shape": [5056], "owner": 0},
            {"path": ["rng", 1], "dtype": "uint8", "shape": [5056], "owner": 1},
            {"path": ["local"], "kind": "object", "nbytes": 10 * MiB, "owner": 2},
        ]
    )


MANIFESTS: dict[str, Callable[[], deeppart.Manifest]] = {
    "mixed": _mixed,
    "one-object": lambda: deeppart.Manifest.from_leaves(
        [{"path": ["a"], "kind": "object", "nbytes": 1000}]
    ),
    "empty": lambda: deeppart.Manifest.from_leaves([]),
    "bert-base": models.bert_base,
    "synthetic-5k": lambda: models.synthetic(5000, seed=1),
}


@pytest.fixture(scope="module", params=list(MANIFESTS))
def manifest(request: pytest.FixtureRequest) -> deeppart.Manifest:
    return MANIFESTS[request.param]()


def check_plan(plan: deeppart.Plan) -> None:
    """Every unit of every leaf is written exactly once; owned leaves by their
    owner, whole; pieces ordered; the stats agree with the pieces."""
    m = plan.manifest
    leaves = m.leaves()
    covering: list[list[tuple[int, int, int]]] = [[] for _ in leaves]
    n_pieces = 0
    for r in range(plan.world_size):
        pieces = plan.rank_pieces(r)
        assert pieces == sorted(pieces), f"rank {r} pieces not ordered"
        assert len(set(pieces)) == len(pieces)
        assert [p[1:] for p in plan.pieces(r)] == [p[1:] for p in pieces]
        assert [p[0] for p in plan.pieces(r)] == [leaves[p[0]]["path"] for p in pieces]
        n_pieces += len(pieces)
        for index, start, stop in pieces:
            covering[index].append((start, stop, r))
    for i, leaf in enumerate(leaves):
        units = _units(leaf)
        spans = sorted(covering[i])
        assert spans, f"leaf {i} {leaf['path']} not written"
        if units == 0:
            assert [s[:2] for s in spans] == [(0, 0)]
        else:
            pos = 0
            for start, stop, _ in spans:
                assert start == pos and stop > start, f"leaf {i}: gap or overlap at {pos}: {spans}"
                pos = stop
            assert pos == units, f"leaf {i} covered to {pos} of {units}"
        if leaf["owner"] is not None:
            assert [(s[0], s[1], s[2]) for s in spans] == [(0, units, leaf["owner"])]
        if leaf["kind"] == "object":
            assert len(spans) == 1
        elif len(spans) > 1:
            # Cuts fall on the cost model's grain; cut pieces hold min_piece_bytes.
            cost = plan.cost
            itemsize = leaf["nbytes"] // units
            for start, stop, _ in spans:
                if cost.grain == "row" and len(leaf["shape"]) >= 2:
                    row = math.prod(leaf["shape"][1:])
                    assert start % row == 0, f"leaf {i}: cut off a row boundary at {start}"
                else:
                    assert start * itemsize % cost.align_bytes == 0, f"leaf {i}: unaligned cut"
                assert (stop - start) * itemsize >= cost.min_piece_bytes, f"leaf {i}: small piece"

    rank_bytes = plan.rank_bytes()
    assert len(rank_bytes) == plan.world_size
    assert sum(rank_bytes) == m.total_bytes
    piece_bytes = plan_piece_bytes(plan)
    assert [sum(b) for b in piece_bytes] == rank_bytes
    st = plan.stats
    assert st.pieces == n_pieces
    assert st.splits == n_pieces - len(m)
    assert st.writers == sum(1 for r in range(plan.world_size) if plan.rank_pieces(r))
    assert st.max_rank_bytes == max(rank_bytes)
    # One model: the bench's scoring of an assignment (by pieces and bytes
    # per rank) and the plan's own modelled time are the planner's stats,
    # exactly.
    makespan, costs = modelled_makespan(piece_bytes, plan.cost, plan.topology)
    assert makespan == st.makespan
    assert costs == plan.rank_costs()
    assert plan.modelled_time()["makespan"] == st.makespan
    assert st.makespan >= st.lower_bound * (1 - 1e-12)
    if st.lower_bound > 0:
        assert st.gap == pytest.approx(st.makespan / st.lower_bound)
    else:
        assert st.gap == 1.0


@pytest.mark.parametrize("world_size", [1, 3, 8, 64])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_plans_are_valid(manifest: deeppart.Manifest, algorithm: str, world_size: int) -> None:
    owners = [leaf["owner"] for leaf in manifest.leaves() if leaf["owner"] is not None]
    if max(owners, default=-1) >= world_size:
        with pytest.raises(deeppart.PlanError, match="is owned by rank"):
            make_plan(manifest, world_size, algorithm=algorithm)
        return
    plan = make_plan(manifest, world_size, algorithm=algorithm)
    assert plan.algorithm == algorithm
    assert plan.world_size == world_size
    assert plan.manifest == manifest
    check_plan(plan)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_plans_are_valid_with_a_topology_and_cost(algorithm: str) -> None:
    m = _mixed()
    cost = deeppart.CostModel(bandwidth=2e8, min_piece_bytes=4096, writer_s=0.0)
    plan = make_plan(m, 12, algorithm=algorithm, cost=cost, topology=deeppart.Topology(4))
    assert plan.cost == cost and plan.topology.ranks_per_node == 4
    check_plan(plan)


def test_min_piece_bytes_is_respected() -> None:
    m = _mixed()
    for min_piece in (1, 4096, MiB, 8 * MiB):
        plan = make_plan(m, 64, cost=deeppart.CostModel(min_piece_bytes=min_piece))
        check_plan(plan)
        sizes = [b for per_rank in plan_piece_bytes(plan) for b in per_rank]
        leaves = m.leaves()
        for r in range(plan.world_size):
            for (leaf, start, stop), b in zip(
                plan.rank_pieces(r), plan_piece_bytes(plan)[r], strict=True
            ):
                if (start, stop) != (0, _units(leaves[leaf])):
                    assert b >= min_piece, (leaf, start, stop, b)
        assert sum(sizes) == m.total_bytes


# ----------------------------------------------------------------------------
# Determinism.


def _pieces_digest(plan: deeppart.Plan) -> str:
    h = hashlib.sha256()
    for r in range(plan.world_size):
        h.update(repr(plan.rank_pieces(r)).encode())
    return h.hexdigest()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic_in_process(algorithm: str) -> None:
    m = models.synthetic(5000, seed=1)
    a = make_plan(m, 48, algorithm=algorithm)
    b = make_plan(models.synthetic(5000, seed=1), 48, algorithm=algorithm)
    assert a.fingerprint == b.fingerprint
    assert _pieces_digest(a) == _pieces_digest(b)
    assert a.stats.makespan == b.stats.makespan
    assert deeppart.plan_fingerprint(m, 48, algorithm=algorithm) == a.fingerprint


_SUBPROCESS = """
import hashlib, json, sys
import deeppart
from bench import models
m = models.synthetic(5000, seed=1)
out = {}
for a in deeppart.ALGORITHMS:
    p = deeppart.plan(m, 48, algorithm=a, cache=False)
    h = hashlib.sha256()
    for r in range(p.world_size):
        h.update(repr(p.rank_pieces(r)).encode())
    out[a] = [p.fingerprint, h.hexdigest()]
print(json.dumps(out))
"""


def test_deterministic_across_processes() -> None:
    from conftest import ROOT

    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    other = json.loads(proc.stdout)
    m = models.synthetic(5000, seed=1)
    for a in ALGORITHMS:
        p = make_plan(m, 48, algorithm=a)
        assert other[a] == [p.fingerprint, _pieces_digest(p)], a


def test_fingerprint_covers_the_inputs() -> None:
    m = _mixed()
    base = make_plan(m, 8).fingerprint
    variants = [
        make_plan(m, 16).fingerprint,
        make_plan(m, 8, algorithm="lpt").fingerprint,
        make_plan(m, 8, cost=deeppart.CostModel(bandwidth=2e9)).fingerprint,
        make_plan(m, 8, topology=deeppart.Topology(2)).fingerprint,
        make_plan(models.bert_base(), 8).fingerprint,
    ]
    assert len({base, *variants}) == 1 + len(variants)


# ----------------------------------------------------------------------------
# The JSON form.


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_plan_json_round_trip(algorithm: str) -> None:
    m = _mixed()
    plan = make_plan(m, 8, algorithm=algorithm, topology=deeppart.Topology(2))
    again = deeppart.Plan.from_json(plan.to_json())
    assert again.fingerprint == plan.fingerprint
    assert again.manifest == plan.manifest
    assert (again.world_size, again.algorithm) == (plan.world_size, plan.algorithm)
    assert again.cost == plan.cost and again.topology == plan.topology
    assert _pieces_digest(again) == _pieces_digest(plan)
    a, b = again.stats.to_dict(), plan.stats.to_dict()
    assert a.pop("plan_ms") == pytest.approx(b.pop("plan_ms"))
    assert a == b
    check_plan(again)


# serde_json parses floats without its "float_roundtrip" feature, so a cost
# model parameter can come back one ulp off, and the recomputed fingerprint
# (over the parameters' bit patterns) no longer matches: about 30% of random
# cost models fail. Reported to the planner's owner; strict, so a fix shows up.
def test_plan_json_round_trip_with_arbitrary_cost_values() -> None:
    cost = deeppart.CostModel(
        fixed_s=0.007104267189017098,
        piece_s=9.751989661364332e-5,
        bandwidth=216646827.28631306,
        writer_s=0.000897305758366094,
    )
    p = make_plan(_mixed(), 8, cost=cost)
    again = deeppart.Plan.from_json(p.to_json())
    assert again.cost == cost


def _tamper(plan: deeppart.Plan, edit: Callable[[dict[str, Any]], None]) -> str:
    doc = json.loads(plan.to_json())
    edit(doc)
    return json.dumps(doc)


def _first_piece(doc: dict[str, Any]) -> dict[str, Any]:
    piece: dict[str, Any] = next(r for r in doc["ranks"] if r)[0]
    return piece


def _drop_first_piece(doc: dict[str, Any]) -> None:
    next(r for r in doc["ranks"] if r).pop(0)


def _duplicate_first_piece(doc: dict[str, Any]) -> None:
    ranks = doc["ranks"]
    src = next(i for i, r in enumerate(ranks) if r)
    ranks[(src + 1) % len(ranks)].append(dict(ranks[src][0]))


def _move_owned_piece(doc: dict[str, Any]) -> None:
    ranks = doc["ranks"]
    for r, pieces in enumerate(ranks):
        for i, p in enumerate(pieces):
            if p["path"] == ["local"]:
                ranks[(r + 1) % len(ranks)].append(pieces.pop(i))
                return
    raise AssertionError("no owned piece")


TAMPERS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    (
        "shortened piece",
        lambda d: _first_piece(d).update(stop=_first_piece(d)["stop"] - 1),
        "malformed plan",
    ),
    ("piece beyond the leaf", lambda d: _first_piece(d).update(stop=1 << 40), "out of bounds"),
    ("dropped piece", _drop_first_piece, "malformed plan"),
    ("piece written twice", _duplicate_first_piece, "not covered exactly once"),
    ("owned leaf moved", _move_owned_piece, "is owned by rank 2 but planned on rank"),
    ("piece path", lambda d: _first_piece(d).update(path=["nope"]), "path does not match leaf"),
    ("fingerprint", lambda d: d.update(fingerprint="0" * 64), "plan fingerprint mismatch"),
    ("world size", lambda d: d.update(world_size=9), "8 rank lists for world size 9"),
    (
        "embedded manifest",
        lambda d: d["manifest"]["leaves"][0].update(shape=[4096, 4095]),
        "malformed plan",
    ),
    ("cost model", lambda d: d["cost"].update(bandwidth=2e9), "plan fingerprint mismatch"),
    ("algorithm", lambda d: d.update(algorithm="lpt"), "plan fingerprint mismatch"),
    ("unknown algorithm", lambda d: d.update(algorithm="magic"), 'unknown algorithm "magic"'),
    ("version", lambda d: d.update(version=2), "unsupported plan version 2"),
]


@pytest.mark.parametrize(("edit", "message"), [t[1:] for t in TAMPERS], ids=[t[0] for t in TAMPERS])
def test_from_json_rejects_a_tampered_plan(
    edit: Callable[[dict[str, Any]], None], message: str
) -> None:
    plan = make_plan(_mixed(), 8)
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.Plan.from_json(_tamper(plan, edit))
    assert message in str(info.value)


def test_from_json_rejects_malformed_text() -> None:
    with pytest.raises(deeppart.PlanError, match="malformed plan: invalid JSON"):
        deeppart.Plan.from_json("{")
    with pytest.raises(deeppart.PlanError, match="missing version"):
        deeppart.Plan.from_json("{}")


def test_from_json_recomputes_stats() -> None:
    plan = make_plan(_mixed(), 8)
    text = _tamper(plan, lambda d: d["stats"].update(makespan=0.0, gap=0.5, writers=1))
    again = deeppart.Plan.from_json(text)
    assert again.stats.makespan == plan.stats.makespan
    assert again.stats.gap == plan.stats.gap
    assert again.stats.writers == plan.stats.writers


# ----------------------------------------------------------------------------
# Quality.


def test_stats_fields() -> None:
    st = make_plan(_mixed(), 8).stats
    d = st.to_dict()
    assert set(d) == {
        "makespan",
        "lower_bound",
        "gap",
        "pieces",
        "splits",
        "writers",
        "max_rank_bytes",
        "plan_ms",
        "source",
    }
    assert d["source"] == "computed"
    assert d["makespan"] == st.makespan and d["lower_bound"] == st.lower_bound
    assert st.plan_ms >= 0
    assert st.makespan >= st.lower_bound > 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world_size", [4, 256])
def test_makespan_is_at_least_the_lower_bound(algorithm: str, world_size: int) -> None:
    for name in ("bert-base+adamw", "xlmr-large+adamw"):
        st = make_plan(models.MODELS[name](), world_size, algorithm=algorithm).stats
        assert st.makespan >= st.lower_bound * (1 - 1e-12), (name, st)
        assert st.gap >= 1 - 1e-12


@pytest.mark.parametrize("world_size", [8, 64, 256, 4096])
@pytest.mark.parametrize("name", list(models.MODELS))
def test_balanced_gap_on_model_manifests(name: str, world_size: int) -> None:
    plan = make_plan(models.MODELS[name](), world_size)
    check_plan(plan)
    assert plan.stats.gap <= 1.01, plan.stats


def test_small_states_get_fewer_writers_than_ranks(example_manifest: deeppart.Manifest) -> None:
    one = deeppart.Manifest.from_leaves([{"path": ["a"], "kind": "object", "nbytes": 1000}])
    assert make_plan(one, 64).stats.writers == 1
    tiny = models.adamw_manifest([("w", (16, 16)), ("b", (16,))])
    assert make_plan(tiny, 64).stats.writers == 1
    st = make_plan(example_manifest, 256).stats
    assert 1 < st.writers < 256
    st = make_plan(models.bert_base(), 4096).stats
    assert st.writers < 4096 and st.gap <= 1.05
    # ... and a large state uses every rank of a small world.
    assert make_plan(models.bert_large(), 8).stats.writers == 8


def test_greedy_is_torch_dedup_save_plans() -> None:
    """DeepPart's greedy baseline assigns exactly what torch's real
    dedup_save_plans does (the benchmark relies on that)."""
    from bench.planner import dcp_dedup, dcp_items, dcp_piece_bytes, dcp_save_plans

    m = models.gpt2_small()
    for p in (3, 16):
        items = dcp_items(m)
        dcp = dcp_piece_bytes(items, dcp_dedup(dcp_save_plans(items, p)))
        ours = plan_piece_bytes(make_plan(m, p, algorithm="greedy"))
        assert [sorted(b) for b in dcp] == [sorted(b) for b in ours]


def test_bench_layouts_keep_every_item_on_its_holders() -> None:
    """bench/planner.py --layouts: the SavePlans list each item in exactly its
    holders' plans, and torch's dedup_save_plans and the Megatron rule give
    each whole leaf to one of its holders; the rule takes the fewest holders
    first, then the largest, each to its least-loaded holder."""
    from bench import layouts, zoo
    from bench.planner import dcp_dedup, dcp_items, dcp_save_plans, megatron_piece_bytes

    m = layouts.laid_out(zoo.MANIFESTS["bert-large"](), "hsdp", 16)
    assert m is not None and len(m.groups) == 8
    leaves = m.leaves()
    holders = [
        set(m.groups[lf["holders"]]) if lf.get("holders") is not None else set(range(16))
        for lf in leaves
    ]
    items = dcp_items(m)
    plans = dcp_save_plans(items, 16)
    listed: list[set[int]] = [set() for _ in leaves]
    for r, plan in enumerate(plans):
        for item in plan.items:
            listed[items.leaf_of_fqn[item.index.fqn]].add(r)
    assert listed == holders
    written: list[list[int]] = [[] for _ in leaves]
    for r, plan in enumerate(dcp_dedup(plans)):
        for item in plan.items:
            written[items.leaf_of_fqn[item.index.fqn]].append(r)
    assert all(len(w) == 1 and w[0] in h for w, h in zip(written, holders, strict=True))
    mg = megatron_piece_bytes(m, 16)
    assert sorted(b for r in mg for b in r) == sorted(lf["nbytes"] for lf in leaves)
    # Hand instance: a 1-holder leaf first, then largest first to the least loaded.
    small = deeppart.Manifest.from_leaves(
        [
            {"path": ["a"], "kind": "object", "nbytes": 5},
            {"path": ["b"], "kind": "object", "nbytes": 9, "holders": 0},
            {"path": ["c"], "kind": "object", "nbytes": 7, "owner": 1},
            {"path": ["d"], "kind": "object", "nbytes": 3, "holders": 0},
        ],
        groups=[[0, 1]],
    )
    assert megatron_piece_bytes(small, 3) == [[9], [7, 3], [5]]


# ----------------------------------------------------------------------------
# The GIL.


def test_plan_releases_the_gil() -> None:
    """Two threads plan a big manifest while a third Python thread counts
    only while a plan is inside the planner. Every thread gives the GIL up
    voluntarily (``time.sleep(0)``) whenever no plan is running, and the switch
    interval is raised to 5 s, far above a plan's length, so the GIL is never
    taken from a thread by force: the counter can only move while a planning
    thread has released the GIL itself. Checked to read 0 with a call that
    holds the GIL (``sorted`` of a long list) in place of the plan. No timing
    assertion: the plans repeat (5 times at most) until the counter moved."""
    m = models.synthetic(200_000, seed=2)
    in_plan = [0, 0]
    observed = 0
    stop = threading.Event()

    def observer() -> None:
        nonlocal observed
        while not stop.is_set():
            if in_plan[0] or in_plan[1]:
                observed += 1
            time.sleep(0)

    def planner(slot: int) -> None:
        for _ in range(5):
            in_plan[slot] = 1
            make_plan(m, 1024)
            in_plan[slot] = 0
            if observed:
                return
            time.sleep(0)

    old = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        watch = threading.Thread(target=observer)
        watch.start()
        workers = [threading.Thread(target=planner, args=(i,)) for i in range(2)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stop.set()
        watch.join()
    finally:
        sys.setswitchinterval(old)
    assert observed > 0


def test_assignment_digest_tells_plans_with_equal_inputs_apart() -> None:
    """Two plans of the same inputs share a fingerprint; if one has its
    pieces reassigned (e.g. by a faulty planner service), ranks comparing
    only fingerprints would write an inconsistent checkpoint. The assignment
    digest, which save's agreement collective compares, differs."""
    manifest = deeppart.Manifest.from_leaves(
        [{"path": [f"w{i}"], "dtype": "float32", "shape": [64, 64]} for i in range(6)]
    )
    planned = deeppart.plan(manifest, 3, cache=False)
    ranks = [list(planned.rank_pieces(r)) for r in range(3)]
    same = deeppart.Plan.from_pieces(manifest, 3, ranks)
    assert same.fingerprint == planned.fingerprint
    assert same.assignment_digest() == planned.assignment_digest()
    donor = next(r for r in range(3) if ranks[r])
    moved = [list(r) for r in ranks]
    moved[(donor + 1) % 3].append(moved[donor].pop())
    other = deeppart.Plan.from_pieces(manifest, 3, moved)
    assert other.fingerprint == planned.fingerprint
    assert other.assignment_digest() != planned.assignment_digest()


# ----------------------------------------------------------------------------
# Holder groups: every piece on a holder of its leaf.


def _hsdp(world_size: int, shard: int) -> deeppart.Manifest:
    """An HSDP-like layout: `shard` shard groups, each replicated over the
    ranks with the same shard index, and small leaves on every rank."""
    groups = [list(range(s, world_size, shard)) for s in range(shard)]
    leaves: list[dict[str, Any]] = []
    for layer in range(6):
        for s in range(shard):
            rows = 1000 + 37 * layer
            leaves.append(
                {"path": [f"l{layer}", s], "dtype": "float32", "shape": [rows, 256], "holders": s}
            )
        leaves.append({"path": [f"l{layer}", "norm"], "dtype": "float32", "shape": [256]})
    leaves.append({"path": ["rng"], "kind": "object", "nbytes": 64, "owner": world_size - 1})
    return deeppart.Manifest.from_leaves(leaves, groups=groups)


@pytest.mark.parametrize("algorithm", ["balanced", "lpt", "greedy"])
def test_grouped_plans_put_every_piece_on_a_holder(algorithm: str) -> None:
    m = _hsdp(16, 4)
    p = deeppart.plan(m, 16, algorithm=algorithm)
    leaves = m.leaves()
    covered = [0] * len(leaves)
    for r in range(16):
        for leaf, start, stop in p.rank_pieces(r):
            g = leaves[leaf]["holders"]
            owner = leaves[leaf]["owner"]
            assert g is None or r in m.groups[g], (algorithm, r, leaf)
            assert owner is None or r == owner
            covered[leaf] += stop - start
    assert covered == [
        math.prod(leaf["shape"]) if leaf["kind"] == "tensor" else 1 for leaf in leaves
    ]
    assert p.stats.makespan >= p.stats.lower_bound * (1 - 1e-9)
    if algorithm == "balanced":
        assert p.stats.gap < 1.05


def test_a_piece_off_its_holders_is_rejected() -> None:
    m = deeppart.Manifest.from_leaves(
        [{"path": ["a"], "kind": "object", "nbytes": 10, "holders": 0}], groups=[[1, 2]]
    )
    deeppart.Plan.from_pieces(m, 3, [[], [(0, 0, 1)], []])
    with pytest.raises(deeppart.PlanError, match=r"held by group 0 but planned on rank 0"):
        deeppart.Plan.from_pieces(m, 3, [[(0, 0, 1)], [], []])
    # The same check on a plan read back from JSON.
    good = json.loads(deeppart.Plan.from_pieces(m, 3, [[], [], [(0, 0, 1)]]).to_json())
    good["ranks"] = [good["ranks"][2], [], []]
    with pytest.raises(deeppart.PlanError, match="not in it"):
        deeppart.Plan.from_json(json.dumps(good))


def test_deeppart_refuses_holder_groups() -> None:
    with pytest.raises(
        deeppart.PlanError, match=r'does not plan leaves held by a group.*use "balanced"'
    ):
        deeppart.plan(_hsdp(8, 2), 8, algorithm="deeppart")


def test_grouped_bytes_only_plan_is_at_the_fractional_optimum() -> None:
    # Disjoint groups plus leaves on every rank: the fractional optimum is
    # max(max_g B_g / |g|, B / P) (Hall's condition on a partition).
    world = 16
    m = _hsdp(world, 4)
    cost = deeppart.CostModel(
        fixed_s=0.0, piece_s=0.0, writer_s=0.0, min_piece_bytes=1, bandwidth=1e9
    )
    p = deeppart.plan(m, world, cost=cost)
    per_group = [0] * len(m.groups)
    for leaf in m.leaves():
        if leaf["holders"] is not None:
            per_group[leaf["holders"]] += leaf["nbytes"]
    optimum = max(
        max(b / len(g) for b, g in zip(per_group, m.groups, strict=True)), m.total_bytes / world
    )
    assert optimum <= p.stats.max_rank_bytes <= optimum * 1.01 + 4096


def test_the_readme_balance_figures_of_a_small_transformer() -> None:
    """docs/BENCHMARKS.md, "Which state the balance column holds on": on a small real
    transformer's state (20 MB with AdamW, most leaves under 1 MiB) the
    default cost model's plan balances the modelled time, not the bytes
    (1.134 at 4 ranks), and finer pieces give 1.002
    (``python bench/dtensor.py --plan-balance 4``; planning is deterministic)."""
    pytest.importorskip("torch")
    from bench.dtensor import finer_cost, transformer_plan_balance

    default, _, gap = transformer_plan_balance(4)
    finer, _, _ = transformer_plan_balance(4, finer_cost())
    assert f"{default:.3f}" == "1.134" and gap < 1.01, (default, gap)
    assert f"{finer:.3f}" == "1.002", finer
    readme = (Path(__file__).resolve().parents[2] / "docs" / "BENCHMARKS.md").read_text()
    claim = readme[readme.index("**Which state the balance column holds on.**") :]
    claim = claim[: claim.index("\n\n", claim.index("--plan-balance 4"))]
    assert "1.134 with the default cost model" in claim and "1.002" in claim, claim
