"""The zoo: manifests of real transformers architectures with their AdamW state.

    .venv/bin/python bench/zoo.py            # regenerate planner/tests/fixtures/zoo/
    .venv/bin/python bench/zoo.py --check    # fail if a committed fixture is stale

Every model is the real ``transformers`` class, built from a published
configuration written here in code and instantiated on the meta device: no
weights are downloaded or allocated, only shapes exist. Its state is laid out
as a training loop saves it, ``{"model": model.state_dict(), "optim":
torch.optim.AdamW(model.parameters()).state_dict()}`` after one step:

- ``model``: every entry of ``state_dict()`` (parameters and persistent
  buffers, e.g. BatchNorm statistics), except a tied weight's second name
  (tied tensors are one leaf, as ``deeppart.save`` stores them);
- ``optim.state.<i>``: per trainable parameter, in ``model.parameters()``
  order, a 0-D float32 ``step`` and the moments ``exp_avg``, ``exp_avg_sq``;
- ``optim.param_groups``: one object leaf (its size is that of DeepPart's
  encoding of AdamW's default ``param_groups``);
- mixed precision (``precision="bf16-mixed"``): the model's floating-point
  entries are bfloat16, the moments float32, and ``optim.master_params.<i>``
  holds the float32 master copy of each trainable parameter.

Mixture-of-Experts models keep their experts stacked in 3-D tensors, as
transformers 5 stores them (``mlp.experts.gate_up_proj`` of shape
``[experts, 2 x intermediate, hidden]``).

Each fixture is an ordinary DeepPart manifest JSON (``deeppart plan FILE``,
``deeppart simulate --model FILE`` read it), one leaf per line;
``index.json`` lists the models with their source configuration and counts.
The Rust tests (planner/tests/zoo.rs) read the fixtures without Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deeppart._planner import Manifest
from deeppart.state.state import encode_plain
from deeppart.tools.models import adamw_param_groups

FIXTURES = Path(__file__).resolve().parent.parent / "planner" / "tests" / "fixtures" / "zoo"
INDEX = "index.json"


@dataclass(frozen=True)
class Architecture:
    """One zoo model: a transformers class and its published configuration."""

    name: str
    family: str
    source: str  # the Hugging Face model whose configuration this is
    model_class: str  # a class exported by transformers
    config_class: str
    config: dict[str, Any]
    precision: str = "fp32"  # or "bf16-mixed"

    def build(self, device: str = "meta") -> Any:
        """The model, by default on the meta device (no memory for weights)."""
        import torch
        import transformers

        config = getattr(transformers, self.config_class)(**self.config)
        with torch.device(device):
            return getattr(transformers, self.model_class)(config)

    def scaled(self, **config: Any) -> Architecture:
        """The same architecture with some configuration values replaced."""
        return dataclasses.replace(
            self, name=f"{self.name}-scaled", config={**self.config, **config}
        )


_LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    tie_word_embeddings=False,
)

ARCHITECTURES: list[Architecture] = [
    Architecture("bert-large", "encoder", "google-bert/bert-large-uncased",
                 "BertForMaskedLM", "BertConfig",
                 dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096)),
    Architecture("xlm-roberta-large", "encoder", "FacebookAI/xlm-roberta-large",
                 "XLMRobertaForMaskedLM", "XLMRobertaConfig",
                 dict(vocab_size=250002, hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096,
                      max_position_embeddings=514, type_vocab_size=1)),
    Architecture("gpt2-xl", "decoder", "openai-community/gpt2-xl",
                 "GPT2LMHeadModel", "GPT2Config",
                 dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25)),
    Architecture("llama-3-8b", "decoder", "meta-llama/Meta-Llama-3-8B",
                 "LlamaForCausalLM", "LlamaConfig", _LLAMA3_8B),
    Architecture("mistral-7b", "decoder", "mistralai/Mistral-7B-v0.1",
                 "MistralForCausalLM", "MistralConfig",
                 dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      tie_word_embeddings=False)),
    Architecture("t5-large", "encoder-decoder", "google-t5/t5-large",
                 "T5ForConditionalGeneration", "T5Config",
                 dict(vocab_size=32128, d_model=1024, d_kv=64, d_ff=4096, num_layers=24,
                      num_heads=16)),
    Architecture("mixtral-8x7b", "moe", "mistralai/Mixtral-8x7B-v0.1",
                 "MixtralForCausalLM", "MixtralConfig",
                 dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)),
    Architecture("qwen1.5-moe-a2.7b", "moe", "Qwen/Qwen1.5-MoE-A2.7B",
                 "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632,
                      num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                      num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, tie_word_embeddings=False)),
    Architecture("olmoe-1b-7b", "moe", "allenai/OLMoE-1B-7B-0924",
                 "OlmoeForCausalLM", "OlmoeConfig",
                 dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024,
                      num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                      num_experts=64, num_experts_per_tok=8, tie_word_embeddings=False)),
    Architecture("deepseek-v3", "moe", "deepseek-ai/DeepSeek-V3",
                 "DeepseekV3ForCausalLM", "DeepseekV3Config",
                 dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                      moe_intermediate_size=2048, num_hidden_layers=61,
                      num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
                      n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
                      q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
                      qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
                      tie_word_embeddings=False)),
    Architecture("vit-large", "vision", "google/vit-large-patch16-224",
                 "ViTForImageClassification", "ViTConfig",
                 dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                      intermediate_size=4096, image_size=224, patch_size=16, num_labels=1000)),
    Architecture("convnext-large", "vision", "facebook/convnext-large-224",
                 "ConvNextForImageClassification", "ConvNextConfig",
                 dict(depths=[3, 3, 27, 3], hidden_sizes=[192, 384, 768, 1536],
                      num_labels=1000)),
    Architecture("resnet-50", "vision", "microsoft/resnet-50",
                 "ResNetForImageClassification", "ResNetConfig",
                 dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048],
                      depths=[3, 4, 6, 3], layer_type="bottleneck", num_labels=1000)),
    Architecture("llama-3-8b-bf16", "mixed precision", "meta-llama/Meta-Llama-3-8B",
                 "LlamaForCausalLM", "LlamaConfig", _LLAMA3_8B, precision="bf16-mixed"),
]  # fmt: skip
"""The zoo, in fixture order."""

BY_NAME = {a.name: a for a in ARCHITECTURES}


def mixtral_scaled(
    *, hidden: int = 64, intermediate: int = 2048, experts: int = 2, layers: int = 1,
    vocab: int = 256,
) -> Architecture:  # fmt: skip
    """A scaled-down Mixtral for tests that need real values: 10 MB of state
    with AdamW, but with Mixtral's structure, dominated by stacked expert
    tensors (``[2, 4096, 64]``, ``[2, 64, 2048]``) whose dim-0 rows (1 MiB,
    0.5 MiB) are coarse against a rank's share: cutting on rows alone leaves
    the slowest of 4 ranks 6% above the ideal share."""
    return Architecture(
        f"mixtral-scaled-{experts}x{hidden}",
        "moe",
        "mistralai/Mixtral-8x7B-v0.1 (scaled down)",
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=experts, num_experts_per_tok=min(2, experts),
            max_position_embeddings=128, tie_word_embeddings=False,
        ),
    )  # fmt: skip


# ----------------------------------------------------------------------------
# State layout.


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def state_leaves(model: Any, precision: str = "fp32") -> list[dict[str, Any]]:
    """Leaf descriptions (manifest JSON form) of ``{"model": state_dict,
    "optim": AdamW state_dict}`` after one step; see the module docstring."""
    if precision not in ("fp32", "bf16-mixed"):
        raise ValueError(f"unknown precision {precision!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    seen: set[int] = set()
    leaves: list[dict[str, Any]] = []
    for key, value in model.state_dict(keep_vars=True).items():
        tensor = params.get(key, buffers.get(key, value))
        if id(tensor) in seen:
            continue  # a tied weight's second name: the same tensor
        seen.add(id(tensor))
        dtype = _dtype_name(tensor.dtype)
        if precision == "bf16-mixed" and tensor.is_floating_point():
            dtype = "bfloat16"
        leaves.append({"path": ["model", key], "dtype": dtype, "shape": list(tensor.shape)})
    trainable = [p for p in model.parameters() if p.requires_grad]
    for i, p in enumerate(trainable):
        shape = list(p.shape)
        leaves.append({"path": ["optim", "state", i, "step"], "dtype": "float32", "shape": []})
        for moment in ("exp_avg", "exp_avg_sq"):
            path = ["optim", "state", i, moment]
            leaves.append({"path": path, "dtype": "float32", "shape": shape})
    groups = encode_plain(adamw_param_groups(len(trainable)), ("optim", "param_groups"))
    leaves.append({"path": ["optim", "param_groups"], "kind": "object", "nbytes": len(groups)})
    if precision == "bf16-mixed":
        for i, p in enumerate(trainable):
            leaves.append(
                {"path": ["optim", "master_params", i], "dtype": "float32", "shape": list(p.shape)}
            )
    return leaves


def manifest_text(leaves: Sequence[dict[str, Any]]) -> str:
    """The manifest JSON, compact, one leaf per line (diffs stay readable)."""
    lines = [json.dumps(leaf, separators=(",", ":")) for leaf in leaves]
    return '{"version":1,"leaves":[\n' + ",\n".join(lines) + "\n]}\n"


def describe(arch: Architecture, model: Any, leaves: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The index entry of one fixture."""
    manifest = Manifest.from_leaves(list(leaves))
    n_params = sum(p.numel() for p in model.parameters())
    largest = max(
        (leaf for leaf in leaves if "shape" in leaf),
        key=lambda leaf: _numel(leaf["shape"]),
    )
    return {
        "name": arch.name,
        "family": arch.family,
        "file": f"{arch.name}.json",
        "source": arch.source,
        "model_class": f"transformers.{arch.model_class}",
        "config_class": f"transformers.{arch.config_class}",
        "config": arch.config,
        "precision": arch.precision,
        "parameters": n_params,
        "leaves": len(manifest),
        "total_bytes": manifest.total_bytes,
        "largest_leaf": {"path": largest["path"], "shape": largest["shape"]},
        "fingerprint": manifest.fingerprint,
    }


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def generate(arch: Architecture) -> tuple[str, dict[str, Any]]:
    """One architecture's fixture text and index entry."""
    model = arch.build()
    leaves = state_leaves(model, arch.precision)
    return manifest_text(leaves), describe(arch, model, leaves)


# ----------------------------------------------------------------------------
# Reading the committed fixtures (needs neither torch nor transformers).


def index(fixtures: Path = FIXTURES) -> list[dict[str, Any]]:
    """The committed index: one entry per zoo model, in zoo order."""
    entries: list[dict[str, Any]] = json.loads((fixtures / INDEX).read_text())
    return entries


def load(name: str, fixtures: Path = FIXTURES) -> Manifest:
    """A committed zoo manifest by name."""
    if name not in BY_NAME:
        raise KeyError(f"no zoo model {name!r}; known: {', '.join(BY_NAME)}")
    return Manifest.from_json((fixtures / f"{name}.json").read_text())


MANIFESTS: dict[str, Callable[[], Manifest]] = {
    a.name: functools.partial(load, a.name) for a in ARCHITECTURES
}
"""Zoo manifests by name, read from the committed fixtures."""


# ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--check", action="store_true", help="compare with the committed fixtures")
    ap.add_argument("--dir", type=Path, default=FIXTURES, help="fixture directory")
    ap.add_argument("names", nargs="*", help="only these models (default: all)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown zoo model(s) {unknown}; known: {', '.join(BY_NAME)}")
    chosen = [a for a in ARCHITECTURES if not args.names or a.name in args.names]
    entries = {e["name"]: e for e in index(args.dir)} if (args.dir / INDEX).exists() else {}
    stale: list[str] = []
    for arch in chosen:
        text, entry = generate(arch)
        path = args.dir / entry["file"]
        print(
            f"{arch.name:<20} {entry['parameters'] / 1e9:8.3f} B params  "
            f"{entry['leaves']:6d} leaves  {entry['total_bytes'] / 1e9:9.2f} GB  "
            f"{len(text) / 1e3:7.1f} kB",
            flush=True,
        )
        if args.check:
            if not path.exists() or path.read_text() != text or entries.get(arch.name) != entry:
                stale.append(arch.name)
            continue
        args.dir.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        entries[arch.name] = entry
    if args.check:
        if stale:
            print(f"stale fixtures: {', '.join(stale)} (regenerate: python bench/zoo.py)")
            return 1
        print("fixtures are up to date")
        return 0
    ordered = [entries[a.name] for a in ARCHITECTURES if a.name in entries]
    (args.dir / INDEX).write_text(json.dumps(ordered, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
