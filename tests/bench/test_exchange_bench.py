"""bench/exchange.py's computed path (the save's description exchange run by
the real prepare code on synthetic DTensors of a fake process group) at a
small scale, so that the bench keeps running: PP 2 x FSDP 2 x TP 2 of a
4-layer Llama-like model."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench.exchange import Llama, computed, stage_params
from deeppart.saving.prepare import ROW_WIDTH
from deeppart.saving.union_cache import COLUMN_WIDTH, REUSE_TERMS
from deeppart.storage.identity import IDENTITY_BYTES

#: The first agreement's row as it travels: the failure byte, the digests,
#: the local byte, the store's identity, the union cache's column.
ROW = 1 + ROW_WIDTH + 1 + IDENTITY_BYTES + COLUMN_WIDTH
#: The sum that decides whether the cached union is reused: int64 terms.
SUM = 8 * REUSE_TERMS
#: What a rank receives of that sum in a ring allreduce over 8 ranks.
SUM_RECEIVED = 2 * SUM * 7 // 8


def test_computed_exchange_at_eight_ranks() -> None:
    cfg = Llama(layers=4, dim=64, ffn=128, vocab=128, heads=4, kv_heads=2)
    res = computed(cfg, pp=2, dp=2, tp=2, check_reps=True)

    # Every stage's lowest rank builds the same union manifest as rank 0.
    assert res["same_union_on_reps"] == {"4": True}
    # The union holds every stage's parameters and both AdamW moments.
    params = sum(len(stage_params(cfg, 2, s)) for s in range(2))
    assert res["union_dtensors"] == 3 * params
    # Rank 0: the sum (no cached union to reuse), the first agreement, the
    # exchange's two rounds (the second: each rank's plain values that
    # differ from its stage's lowest rank's, its loader position and RNG
    # state), the union's agreement.
    total_ops = res["rank0"]["ops"]
    assert total_ops[0] == ["prepare_save", "allreduce_sum_i64", SUM, SUM_RECEIVED]
    ops = total_ops[1:]
    assert [op[1] for op in ops] == [
        "allgather_bytes",
        "allgather_varbytes",
        "allgather_varbytes",
        "allgather_bytes",
    ]
    assert [op[0] for op in ops] == [
        "prepare_save",
        "_exchange_round",
        "_exchange_round",
        "_union_prepare",
    ]
    pb = res["payload_bytes"]
    assert pb["exchange rounds"] == 2
    descriptions = pb["description (each stage's lowest rank)"]
    lo, _, hi = pb["other ranks: min, median, max"]
    # Only one rank per stage sends a description; the others send a few
    # digests (their per-rank values, the shards they hold first), far less.
    assert len(descriptions) == 2 and 0 < lo <= hi < min(descriptions) / 10
    total = pb["total (what every rank gathers)"]
    mine = (ops[1][2] - 8) + (ops[2][2] - 8)  # rank 0's own payloads, both rounds
    assert ops[1][3] + ops[2][3] == total - mine + 2 * 8 * 7  # what rank 0 gathers
    assert ops[1][2] == descriptions[0] + 8
    assert res["rank0"]["sent"] == SUM + ROW + ops[1][2] + ops[2][2] + 34
    assert ops[0][2] == ROW and ops[0][3] == ROW * 7

    # A second save of the same structure: the sum only (it proves the
    # cached union still fits), no row gathered, no exchange, no merge.
    cached = res["cached"]["rank0"]
    assert cached["ops"] == [["prepare_save", "allreduce_sum_i64", SUM, SUM_RECEIVED]]
    assert cached["gathered"] < ops[1][3] / 10


def test_dcp_planning_at_eight_ranks() -> None:
    """DCP's planning of the same save (``--dcp``): every rank's real
    SavePlan from its DTensors, the coordinator's dedup, and DCP's plan
    cache on a second save of the same state."""
    import pickle

    from torch.distributed.checkpoint.planner import SavePlan

    from bench.exchange import dcp_planning

    cfg = Llama(layers=4, dim=64, ffn=128, vocab=128, heads=4, kv_heads=2)
    res = dcp_planning(cfg, pp=2, dp=2, tp=2)

    lo, _, hi = res["items per rank: min, median, max"]
    # Every rank lists its shards and every replicated value; the
    # coordinator keeps one write of each: fewer than the ranks listed,
    # more than any one rank holds.
    assert 0 < lo <= hi < res["write items after dedup"] < 8 * lo
    first, second = res["first"], res["second"]
    # Rank 0 gathers the 7 other ranks' pickled plans, each listing its
    # items; on the second save each sends an empty plan (DCP's cache).
    empty = len(pickle.dumps(SavePlan([], usable=False)))
    assert second["gathered by rank 0"] == 7 * empty
    assert first["gathered by rank 0"] > 7 * lo * 50
    assert first["metadata bytes (pickled)"] > 0
    cpu = first["cpu_seconds"]
    assert cpu["rank 0 in all"] == pytest.approx(
        sum(v for k, v in cpu.items() if k != "rank 0 in all" and "garbage" not in k)
    )
    assert cpu["create_global_plan (dedup, metadata, validation)"] > 0
