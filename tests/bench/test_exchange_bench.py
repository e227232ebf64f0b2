"""bench/exchange.py's computed path (the save's description exchange run by
the real prepare code on synthetic DTensors of a fake process group) at a
small scale, so that the bench keeps running: PP 2 x FSDP 2 x TP 2 of a
4-layer Llama-like model."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from bench.exchange import Llama, computed, stage_params


def test_computed_exchange_at_eight_ranks() -> None:
    cfg = Llama(layers=4, dim=64, ffn=128, vocab=128, heads=4, kv_heads=2)
    res = computed(cfg, pp=2, dp=2, tp=2, check_reps=True)

    # Every stage's lowest rank builds the same union manifest as rank 0.
    assert res["same_union_on_reps"] == {"4": True}
    # The union holds every stage's parameters and both AdamW moments.
    params = sum(len(stage_params(cfg, 2, s)) for s in range(2))
    assert res["union_dtensors"] == 3 * params
    # Rank 0: the first agreement, the exchange, the union's agreement.
    ops = res["rank0"]["ops"]
    assert [op[1] for op in ops] == ["allgather_bytes", "allgather_varbytes", "allgather_bytes"]
    assert [op[0] for op in ops] == ["prepare_save", "_union_prepare", "_union_prepare"]
    pb = res["payload_bytes"]
    descriptions = pb["description (each stage's lowest rank)"]
    lo, _, hi = pb["other ranks: min, median, max"]
    # Only one rank per stage sends a description; the others send their
    # per-rank digests (loader position, RNG state), far less.
    assert len(descriptions) == 2 and 0 < lo <= hi < min(descriptions) / 10
    total = pb["total (what every rank gathers)"]
    assert ops[1][3] == total - descriptions[0] + 8 * 7  # what rank 0 gathers
    assert res["rank0"]["sent"] == 82 + descriptions[0] + 8 + 34
