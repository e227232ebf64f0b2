"""The zoo of real architectures (bench/zoo.py): its committed fixtures are
current, and its state layout is what a real training step produces."""

from __future__ import annotations

import json
from typing import Any

import pytest

import deeppart
from bench import zoo
from deeppart.state.state import describe_leaves

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_every_fixture_loads_and_matches_its_index() -> None:
    entries = zoo.index()
    assert [e["name"] for e in entries] == [a.name for a in zoo.ARCHITECTURES]
    assert len(entries) >= 12
    for e in entries:
        m = zoo.MANIFESTS[e["name"]]()
        assert (len(m), m.total_bytes, m.fingerprint) == (
            e["leaves"],
            e["total_bytes"],
            e["fingerprint"],
        )
    # Published parameter counts (billions, rounded as their model cards do).
    params = {e["name"]: e["parameters"] / 1e9 for e in entries}
    for name, billions in {
        "bert-large": 0.335, "gpt2-xl": 1.56, "llama-3-8b": 8.03, "mixtral-8x7b": 46.7,
        "deepseek-v3": 671.0, "olmoe-1b-7b": 6.92, "t5-large": 0.738, "resnet-50": 0.0256,
    }.items():  # fmt: skip
        assert params[name] == pytest.approx(billions, rel=0.01), name


def test_moe_experts_are_stacked() -> None:
    leaves = zoo.load("mixtral-8x7b").leaves()
    experts = [x for x in leaves if x["path"][-1] == "model.layers.0.mlp.experts.gate_up_proj"]
    assert [tuple(x["shape"]) for x in experts] == [(8, 2 * 14336, 4096)]


@pytest.mark.slow
def test_committed_fixtures_are_current(tmp_path: Any) -> None:
    """Regenerating from transformers gives the committed files, byte for byte."""
    assert zoo.main(["--check"]) == 0


def _one_adamw_step(model: Any, params: list[Any]) -> Any:
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


@pytest.mark.parametrize(
    "arch",
    [
        zoo.mixtral_scaled(),
        zoo.BY_NAME["t5-large"].scaled(
            vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2
        ),
        zoo.BY_NAME["bert-large"].scaled(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32,
        ),
        zoo.BY_NAME["resnet-50"].scaled(
            embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1]
        ),
        zoo.BY_NAME["deepseek-v3"].scaled(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
            num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, q_lora_rank=16, kv_lora_rank=8, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=8,
        ),
    ],
    ids=lambda a: a.name,
)  # fmt: skip
def test_state_layout_is_a_real_training_state(arch: zoo.Architecture) -> None:
    """The generator's leaves equal those of a real model (real weights, on
    CPU) after one real AdamW step, as deeppart.save describes them: paths,
    dtypes, shapes, tied weights stored once, BatchNorm buffers, the size
    of param_groups."""
    torch.manual_seed(0)
    model = arch.build("cpu")
    opt = _one_adamw_step(model, list(model.parameters()))
    real = describe_leaves({"model": model.state_dict(), "optim": opt.state_dict()})
    assert zoo.state_leaves(model) == real
    meta = zoo.state_leaves(arch.build())
    assert meta == real


def test_mixed_precision_layout_is_a_real_training_state() -> None:
    """bf16 weights, float32 master copies that AdamW updates, float32 moments."""
    arch = zoo.mixtral_scaled(hidden=32, intermediate=64)
    model = arch.build("cpu").to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = _one_adamw_step(model, masters)
    optim_state = {**opt.state_dict(), "master_params": masters}
    real = describe_leaves({"model": model.state_dict(), "optim": optim_state})
    assert zoo.state_leaves(arch.build(), "bf16-mixed") == real
    dtypes = {json.dumps(x["path"][:2]): x.get("dtype") for x in real}
    assert dtypes['["model", "model.embed_tokens.weight"]'] == "bfloat16"
    assert dtypes['["optim", "master_params"]'] == "float32"


def test_a_zoo_manifest_plans() -> None:
    plan = deeppart.plan(zoo.load("olmoe-1b-7b"), 64, cache=False)
    assert plan.stats.gap <= 1.01
