"""Every rank's random number generator states, inside a replicated
checkpoint.

The frameworks save one RNG file per rank (the states differ between
ranks), pickled. Here every rank's states (Python's ``random``, numpy's
global generator, torch's CPU generator and, where CUDA is initialised,
every CUDA device's) are turned into plain values (bytes, ints, floats),
gathered to every rank with one byte collective, and stored as one plain
leaf of the checkpoint: a list with one entry per rank. On restore, rank
``r`` sets its generators from entry ``r``; a checkpoint written by another
number of ranks cannot say which state belongs to which rank, so nothing is
restored then, with a warning.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np

from deeppart.comm import Comm
from deeppart.errors import RngStateWarning
from deeppart.state.state import decode_plain, encode_plain

__all__ = ["RngStateWarning", "gather_rng_states", "restore_rng_states"]


def _torch() -> Any:
    import torch

    return torch


def _capture() -> dict[str, Any]:
    torch = _torch()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [
            kind,
            np.asarray(keys, dtype=np.uint32).tobytes(),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
        "torch": bytes(torch.get_rng_state().numpy()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [bytes(s.numpy()) for s in torch.cuda.get_rng_state_all()]
    return state


def gather_rng_states(comm: Comm) -> list[dict[str, Any]]:
    """Every rank's RNG states, in rank order (collective over ``comm``)."""
    mine = encode_plain(_capture(), ("rng",))
    return [decode_plain(row) for row in comm.allgather_varbytes(mine)]


def _restore(state: dict[str, Any]) -> None:
    torch = _torch()
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (
            str(kind),
            np.frombuffer(keys, dtype=np.uint32).copy(),
            int(pos),
            int(has_gauss),
            float(cached),
        )
    )
    torch.set_rng_state(torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        for device, s in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(
                torch.frombuffer(bytearray(s), dtype=torch.uint8), device=device
            )


def restore_rng_states(states: Any, rank: int, world_size: int) -> bool:
    """Sets this rank's generators from ``states`` (as gathered by
    :func:`gather_rng_states`). Returns False, with a
    :class:`RngStateWarning`, when the checkpoint was written by another
    number of ranks or holds no usable states."""
    if not isinstance(states, list) or len(states) != world_size:
        count = len(states) if isinstance(states, list) else 0
        warnings.warn(
            f"the checkpoint holds RNG states of {count} rank(s), this job has {world_size}: "
            "random generators are not restored, so the resumed run is not reproducible",
            RngStateWarning,
            stacklevel=2,
        )
        return False
    try:
        _restore(states[rank])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        warnings.warn(
            f"rank {rank}: the checkpoint's RNG state is unusable ({e}); not restored",
            RngStateWarning,
            stacklevel=2,
        )
        return False
    return True
