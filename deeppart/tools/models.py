"""Built-in model-shaped manifests for the simulator (nothing is downloaded).

The same builders as ``bench/models.py`` (BERT, GPT-2, XLM-R with AdamW), plus
Llama-style decoder shapes at several sizes. A manifest lays a model out as
``{"model": model.state_dict(), "optim": AdamW(...).state_dict()}`` after one
step: every parameter, and per parameter a 0-D ``step`` and two moments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deeppart._planner import Manifest
from deeppart.state.state import encode_plain

Shape = tuple[int, ...]
Named = list[tuple[str, Shape]]


def adamw_param_groups(n_params: int) -> list[dict[str, Any]]:
    """torch's AdamW ``param_groups`` with default hyper-parameters (torch 2.15)."""
    return [
        {
            "lr": 0.001,
            "betas": (0.9, 0.999),
            "eps": 1e-08,
            "weight_decay": 0.01,
            "amsgrad": False,
            "maximize": False,
            "foreach": None,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "params": list(range(n_params)),
        }
    ]


def adamw_leaves(named: Named, dtype: str = "float32") -> list[dict[str, Any]]:
    """Leaf descriptions of a model and its AdamW state after one step."""
    leaves: list[dict[str, Any]] = [
        {"path": ["model", name], "dtype": dtype, "shape": list(shape)} for name, shape in named
    ]
    for i, (_, shape) in enumerate(named):
        leaves.append({"path": ["optim", "state", i, "step"], "dtype": "float32", "shape": []})
        for moment in ("exp_avg", "exp_avg_sq"):
            leaves.append(
                {"path": ["optim", "state", i, moment], "dtype": dtype, "shape": list(shape)}
            )
    groups = encode_plain(adamw_param_groups(len(named)), ("optim", "param_groups"))
    leaves.append({"path": ["optim", "param_groups"], "kind": "object", "nbytes": len(groups)})
    return leaves


def adamw_manifest(named: Named, dtype: str = "float32") -> Manifest:
    """A model and its AdamW state after one step."""
    return Manifest.from_leaves(adamw_leaves(named, dtype))


# ----------------------------------------------------------------------------
# Parameter shapes.


def bert_params(
    *,
    vocab: int,
    hidden: int,
    layers: int,
    intermediate: int,
    positions: int = 512,
    type_vocab: int = 2,
    prefix: str = "bert.",
) -> Named:
    """BertModel / XLMRobertaModel parameters (embeddings, encoder, pooler)."""
    h, f = hidden, intermediate
    p = prefix
    out: Named = [
        (f"{p}embeddings.word_embeddings.weight", (vocab, h)),
        (f"{p}embeddings.position_embeddings.weight", (positions, h)),
        (f"{p}embeddings.token_type_embeddings.weight", (type_vocab, h)),
        (f"{p}embeddings.LayerNorm.weight", (h,)),
        (f"{p}embeddings.LayerNorm.bias", (h,)),
    ]
    for i in range(layers):
        q = f"{p}encoder.layer.{i}."
        for name in ("query", "key", "value"):
            out += [
                (f"{q}attention.self.{name}.weight", (h, h)),
                (f"{q}attention.self.{name}.bias", (h,)),
            ]
        out += [
            (f"{q}attention.output.dense.weight", (h, h)),
            (f"{q}attention.output.dense.bias", (h,)),
            (f"{q}attention.output.LayerNorm.weight", (h,)),
            (f"{q}attention.output.LayerNorm.bias", (h,)),
            (f"{q}intermediate.dense.weight", (f, h)),
            (f"{q}intermediate.dense.bias", (f,)),
            (f"{q}output.dense.weight", (h, f)),
            (f"{q}output.dense.bias", (h,)),
            (f"{q}output.LayerNorm.weight", (h,)),
            (f"{q}output.LayerNorm.bias", (h,)),
        ]
    out += [(f"{p}pooler.dense.weight", (h, h)), (f"{p}pooler.dense.bias", (h,))]
    return out


def gpt2_params(
    *, vocab: int = 50257, hidden: int = 768, layers: int = 12, positions: int = 1024
) -> Named:
    """GPT2Model parameters (Conv1D weights are ``(in, out)``; lm_head is tied)."""
    h = hidden
    out: Named = [
        ("transformer.wte.weight", (vocab, h)),
        ("transformer.wpe.weight", (positions, h)),
    ]
    for i in range(layers):
        q = f"transformer.h.{i}."
        out += [
            (f"{q}ln_1.weight", (h,)),
            (f"{q}ln_1.bias", (h,)),
            (f"{q}attn.c_attn.weight", (h, 3 * h)),
            (f"{q}attn.c_attn.bias", (3 * h,)),
            (f"{q}attn.c_proj.weight", (h, h)),
            (f"{q}attn.c_proj.bias", (h,)),
            (f"{q}ln_2.weight", (h,)),
            (f"{q}ln_2.bias", (h,)),
            (f"{q}mlp.c_fc.weight", (h, 4 * h)),
            (f"{q}mlp.c_fc.bias", (4 * h,)),
            (f"{q}mlp.c_proj.weight", (4 * h, h)),
            (f"{q}mlp.c_proj.bias", (h,)),
        ]
    out += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
    return out


def llama_params(
    *, vocab: int, hidden: int, layers: int, intermediate: int, kv_hidden: int, tied: bool = False
) -> Named:
    """LlamaForCausalLM parameters (grouped-query attention when
    ``kv_hidden < hidden``; RMSNorm weights only, no biases)."""
    h, f, kv = hidden, intermediate, kv_hidden
    out: Named = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        q = f"model.layers.{i}."
        out += [
            (f"{q}self_attn.q_proj.weight", (h, h)),
            (f"{q}self_attn.k_proj.weight", (kv, h)),
            (f"{q}self_attn.v_proj.weight", (kv, h)),
            (f"{q}self_attn.o_proj.weight", (h, h)),
            (f"{q}mlp.gate_proj.weight", (f, h)),
            (f"{q}mlp.up_proj.weight", (f, h)),
            (f"{q}mlp.down_proj.weight", (h, f)),
            (f"{q}input_layernorm.weight", (h,)),
            (f"{q}post_attention_layernorm.weight", (h,)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not tied:
        out.append(("lm_head.weight", (vocab, h)))
    return out


MODELS: dict[str, Callable[[], Manifest]] = {
    "bert-base": lambda: adamw_manifest(
        bert_params(vocab=30522, hidden=768, layers=12, intermediate=3072)),
    "bert-large": lambda: adamw_manifest(
        bert_params(vocab=30522, hidden=1024, layers=24, intermediate=4096)),
    "gpt2": lambda: adamw_manifest(gpt2_params(hidden=768, layers=12)),
    "gpt2-medium": lambda: adamw_manifest(gpt2_params(hidden=1024, layers=24)),
    "gpt2-xl": lambda: adamw_manifest(gpt2_params(hidden=1600, layers=48)),
    # Llama 3.2 1B (tied embeddings), Llama 3.2 3B, Llama 2 7B, Llama 2 13B shapes.
    "llama-1b": lambda: adamw_manifest(llama_params(
        vocab=128256, hidden=2048, layers=16, intermediate=8192, kv_hidden=512, tied=True)),
    "llama-3b": lambda: adamw_manifest(llama_params(
        vocab=128256, hidden=3072, layers=28, intermediate=8192, kv_hidden=1024, tied=True)),
    "llama-7b": lambda: adamw_manifest(llama_params(
        vocab=32000, hidden=4096, layers=32, intermediate=11008, kv_hidden=4096)),
    "llama-13b": lambda: adamw_manifest(llama_params(
        vocab=32000, hidden=5120, layers=40, intermediate=13824, kv_hidden=5120)),
}  # fmt: skip
"""Built-in models with AdamW state, by name (``--model``)."""
