"""Model-shaped manifests, built from layer shapes (nothing is downloaded).

Each model is described by its parameters' names and shapes, in the order of
``model.named_parameters()`` of the Hugging Face implementation; the manifest
then lays them out as ``{"model": model.state_dict(), "optim":
AdamW(...).state_dict()}`` after one optimizer step would be walked by
:meth:`deeppart.Manifest.from_state_dict`:

- ``("model", name)``: every parameter;
- ``("optim", "state", i, "step" | "exp_avg" | "exp_avg_sq")``: per parameter
  ``i``, a 0-D float32 ``step`` and two moments of the parameter's shape;
- ``("optim", "param_groups")``: one object leaf, sized by DeepPart's own
  plain encoding of torch's AdamW ``param_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import deeppart
from deeppart.tools.models import (
    Named,
    Shape,
    adamw_leaves,
    adamw_manifest,
    adamw_param_groups,
    bert_params,
    gpt2_params,
)

__all__ = [
    "Named",
    "Shape",
    "adamw_leaves",
    "adamw_manifest",
    "adamw_param_groups",
    "bert_params",
    "gpt2_params",
]


def bert_base() -> deeppart.Manifest:
    """BERT-base (110M parameters) with AdamW: 1.3 GB."""
    return adamw_manifest(bert_params(vocab=30522, hidden=768, layers=12, intermediate=3072))


def bert_large() -> deeppart.Manifest:
    """BERT-large (335M parameters) with AdamW: 4.0 GB."""
    return adamw_manifest(bert_params(vocab=30522, hidden=1024, layers=24, intermediate=4096))


def gpt2_small() -> deeppart.Manifest:
    """GPT-2 (124M parameters, 12 layers) with AdamW."""
    return adamw_manifest(gpt2_params(hidden=768, layers=12))


def gpt2_medium() -> deeppart.Manifest:
    """GPT-2 medium (355M parameters, 24 layers) with AdamW."""
    return adamw_manifest(gpt2_params(hidden=1024, layers=24))


def xlmr_large() -> deeppart.Manifest:
    """XLM-R large (560M parameters, vocabulary 250002) with AdamW: 6.7 GB,
    of which one embedding (and its two moments) is 1 GB each."""
    return adamw_manifest(
        bert_params(
            vocab=250002,
            hidden=1024,
            layers=24,
            intermediate=4096,
            positions=514,
            type_vocab=1,
            prefix="roberta.",
        )
    )


MODELS: dict[str, Callable[[], deeppart.Manifest]] = {
    "bert-base+adamw": bert_base,
    "bert-large+adamw": bert_large,
    "gpt2+adamw": gpt2_small,
    "gpt2-medium+adamw": gpt2_medium,
    "xlmr-large+adamw": xlmr_large,
}


# ----------------------------------------------------------------------------
# A synthetic manifest with many leaves.


def synthetic_leaves(
    n: int = 1_000_000, *, seed: int = 0, median_bytes: float = 16 * 1024, sigma: float = 2.0
) -> list[dict[str, Any]]:
    """``n`` leaves with log-normal byte sizes (median ``median_bytes``):
    about 1 in 50 an object, the other tensors of float32/bfloat16, 1-D when
    small and 2-D (rows of 256 to 4096 elements) when large. Seeded."""
    rng = np.random.default_rng(seed)
    sizes = np.maximum(rng.lognormal(math.log(median_bytes), sigma, n), 1.0).astype(np.int64)
    sizes = np.minimum(sizes, 1 << 32)
    is_object = rng.random(n) < 0.02
    half = rng.random(n) < 0.3
    row_exp = rng.integers(8, 13, n)
    leaves: list[dict[str, Any]] = []
    append = leaves.append
    for i, (size, obj, h, re) in enumerate(
        zip(sizes.tolist(), is_object.tolist(), half.tolist(), row_exp.tolist(), strict=True)
    ):
        path = ["layers", i // 1000, f"p{i % 1000}"]
        if obj:
            append({"path": path, "kind": "object", "nbytes": size})
            continue
        itemsize = 2 if h else 4
        numel = max(size // itemsize, 1)
        row = 1 << re
        shape = [numel // row, row] if numel >= 4 * row else [numel]
        append({"path": path, "dtype": "bfloat16" if h else "float32", "shape": shape})
    return leaves


def synthetic(n: int = 1_000_000, *, seed: int = 0) -> deeppart.Manifest:
    """The synthetic manifest. Built with :meth:`deeppart.Manifest.from_leaves`:
    for a million leaves it takes about 3 s, against about 5 s for
    ``json.dumps`` plus :meth:`deeppart.Manifest.from_json`."""
    return deeppart.Manifest.from_leaves(synthetic_leaves(n, seed=seed))


def named_shapes_of(manifest: deeppart.Manifest) -> Sequence[tuple[str, Shape]]:
    """The ``("model", name)`` tensors of a model manifest, in order."""
    out: list[tuple[str, Shape]] = []
    for leaf in manifest.leaves():
        path = leaf["path"]
        if len(path) == 2 and path[0] == "model":
            out.append((str(path[1]), tuple(leaf["shape"])))
    return out
