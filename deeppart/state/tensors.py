"""Tensors as bytes: torch's dtypes by name, and flat ``uint8`` views of a
tensor's memory that the writer and the reader work on (no copies).

torch is imported only when a function here is called, so that a state of
plain values and numpy arrays saves and loads where torch is not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "U8",
    "dtype_sizes",
    "readable",
    "resolved",
    "torch_dtypes",
    "torch_module",
    "u8_view",
    "written_in_place",
]

U8 = npt.NDArray[np.uint8]


def torch_module() -> Any:
    """The torch module (imported on first use)."""
    import torch

    return torch


_DTYPE_CACHE: dict[str, Any] = {}


def torch_dtypes() -> dict[str, Any]:
    """torch dtypes by their manifest name ("float32", "bfloat16", ...)."""
    if not _DTYPE_CACHE:
        torch = torch_module()
        for name in dir(torch):
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                key = str(value).removeprefix("torch.")
                _DTYPE_CACHE.setdefault(key, value)
    return _DTYPE_CACHE


def dtype_sizes(leaves: list[dict[str, Any]]) -> dict[str, int]:
    """Element sizes of torch's dtypes by name, for metadata ``leaves``; empty
    when no leaf is a tensor, so that a state of plain values and small
    numpy arrays loads where torch is not installed."""
    if all(lf.get("kind") == "object" for lf in leaves):
        return {}
    return {name: int(dt.itemsize) for name, dt in torch_dtypes().items()}


def u8_view(t: Any) -> U8:
    """A flat uint8 numpy view of a CPU, contiguous tensor's memory (no copy)."""
    torch = torch_module()
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    arr: U8 = flat.numpy()
    return arr


def written_in_place(t: Any) -> None:
    """Tells autograd that ``t`` was modified in place behind its back
    (through :func:`u8_view`'s numpy view, which torch does not see): its
    version counter goes up, so a backward that saved ``t`` before the
    load raises instead of computing with the new values. Inference
    tensors have no version counter."""
    if not t.is_inference():
        torch_module().autograd.graph.increment_version(t)


def readable(t: Any) -> Any:
    """``t`` on the CPU, contiguous, conjugation resolved (copies only when needed)."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    return resolved(t)


def resolved(t: Any) -> Any:
    """``t`` where it lies, detached, contiguous, conjugation and negation
    resolved (copies only when needed)."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t


def same_bytes(a: Any, b: Any) -> bool:
    """Whether tensors ``a`` and ``b`` hold the same data: dtype, shape and
    every element's bytes (NaNs compare by their bits, wherever each lies)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    u8 = torch_module().uint8
    x, y = readable(a).reshape(-1).view(u8), readable(b).reshape(-1).view(u8)
    return bool(torch_module().equal(x, y))


def on_meta(leaf: Any) -> bool:
    """Whether ``leaf`` (a FlatLeaf) is a tensor on the meta device, or a
    DTensor whose local shard is: a shape without memory."""
    return leaf.tensor is not None and leaf.tensor.device.type == "meta"
