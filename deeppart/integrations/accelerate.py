"""Hugging Face Accelerate: ``save_state`` / ``load_state`` with every rank
writing its part.

``Accelerator.save_state`` has the main process write the models, the
optimizers and the schedulers (pickled, for all but the models), and every
process its own pickled RNG file. Its save/load hooks can take the models
over but not the optimizers, so DeepPart offers the two calls instead::

    from deeppart.integrations.accelerate import load_state, save_state

    save_state(accelerator, "ckpt/epoch-3")     # collective: every process calls it
    load_state(accelerator, "ckpt/epoch-3")     # collective too

One DeepPart checkpoint holds what ``Accelerator.save_state`` would: the
prepared models (unwrapped), optimizers and schedulers, the gradient
scaler, ``accelerator.step``, the objects given to
``register_for_checkpointing``, the epoch of each seedable sampler, and every
process's RNG states (:mod:`deeppart.integrations.rng`); nothing is pickled.
The save/load pre-hooks registered on the accelerator are called as
``save_state`` calls them (a hook may remove models it saves itself).
With ``ProjectConfiguration(automatic_checkpoint_naming=True)`` and no
directory, checkpoints go to ``project_dir/checkpoints/checkpoint_<i>``,
``total_limit`` is honoured, and ``load_state`` picks the newest committed one.

As with ``accelerator.save_state``, the position inside an epoch is not
saved: resume at an epoch boundary, or skip the batches already seen with
``accelerator.skip_first_batches``.

Plain data parallelism (DDP, multi-CPU, one process) is supported; FSDP,
DeepSpeed, Megatron-LM and XLA shard or save their state themselves:
use ``accelerator.save_state`` there.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import DistributedType

from deeppart.comm import resolve
from deeppart.errors import CheckpointError, StateMismatchError
from deeppart.format import is_committed, remove_tree
from deeppart.integrations.rng import gather_rng_states, restore_rng_states
from deeppart.loading.load import load
from deeppart.options import LoadOptions, PlanOptions, WriteOptions
from deeppart.saving.save import save
from deeppart.storage.ownership import owned_dir

__all__ = ["load_state", "save_state"]

#: The ``format`` entry of the checkpoints written here.
FORMAT = "deeppart-accelerate/1"

_SUPPORTED = {
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_HPU,
}

_CHECKPOINT_NUMBER = re.compile(r"checkpoint_(\d+)$")


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind not in _SUPPORTED:
        raise ValueError(
            f"deeppart.integrations.accelerate supports data parallelism (DDP), not {kind}: "
            "FSDP, DeepSpeed, Megatron-LM and XLA save their own state; use "
            "accelerator.save_state / load_state there"
        )
    for i, dl in enumerate(accelerator._dataloaders):
        if getattr(dl, "use_stateful_dataloader", False):
            raise ValueError(
                f"dataloader {i} is a stateful dataloader, whose per-process state "
                "deeppart.integrations.accelerate does not save; use accelerator.save_state"
            )


def _comm(comm: Any) -> Any:
    if comm is not None:
        return resolve(comm)
    return resolve("torch" if dist.is_available() and dist.is_initialized() else None)


def _numbered(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _CHECKPOINT_NUMBER.search(child.name)
        if m is not None:
            found.append((int(m.group(1)), child))
    return sorted(found)


def _samplers(accelerator: Accelerator) -> list[SeedableRandomSampler | None]:
    out: list[SeedableRandomSampler | None] = []
    for dl in accelerator._dataloaders:
        sampler = dl.get_sampler() if hasattr(dl, "get_sampler") else None
        out.append(sampler if isinstance(sampler, SeedableRandomSampler) else None)
    return out


def save_state(
    accelerator: Accelerator,
    output_dir: str | os.PathLike[str] | None = None,
    *,
    comm: Any = None,
    compression: str | None = None,
    algorithm: str | None = None,
    planner: Any = None,
    progress: bool | None = None,
) -> Path:
    """Saves what ``accelerator.save_state`` saves as one DeepPart
    checkpoint at ``output_dir``, every process writing its planned part.
    Collective: call it on every process. ``comm``: the communicator
    (default: torch.distributed's default group when initialised);
    ``compression``, ``algorithm``, ``planner``, ``progress``: as for
    :func:`deeppart.save`. An existing checkpoint there is replaced
    atomically. Returns the checkpoint's path."""
    _check_supported(accelerator)
    c = _comm(comm)
    config = accelerator.project_configuration
    automatic = output_dir is None and config.automatic_checkpoint_naming
    if automatic:
        root = Path(accelerator.project_dir) / "checkpoints"
        path = root / f"checkpoint_{accelerator.save_iteration}"
        if path.exists():
            # As accelerate: never replace a numbered checkpoint silently.
            raise ValueError(
                f"checkpoint directory {path} exists: set "
                "accelerator.project_configuration.iteration to the number to save next"
            )
    elif output_dir is None:
        raise ValueError("no output_dir given and automatic checkpoint naming is off")
    else:
        path = Path(output_dir)

    weights = [accelerator.unwrap_model(m).state_dict() for m in accelerator._models]
    for hook in accelerator._save_model_state_pre_hook.values():
        hook(accelerator._models, weights, str(path))
    state: dict[str, Any] = {
        "format": FORMAT,
        "models": weights,
        "optimizers": [opt.state_dict() for opt in accelerator._optimizers],
        "schedulers": [sched.state_dict() for sched in accelerator._schedulers],
        "samplers": [None if s is None else {"epoch": s.epoch} for s in _samplers(accelerator)],
        "scaler": None if accelerator.scaler is None else accelerator.scaler.state_dict(),
        "step": accelerator.step,
        "custom": [obj.state_dict() for obj in accelerator._custom_objects],
        "rng": gather_rng_states(c),
    }
    save(
        state,
        path,
        comm=c,
        overwrite=True,
        progress=progress,
        planning=PlanOptions(planner, algorithm),
        writing=WriteOptions(compression),
    )
    if automatic:
        if config.total_limit is not None and c.rank == 0:
            for _, old in _numbered(root)[: -config.total_limit]:
                if owned_dir(old):  # a directory of the user's of that name stays
                    remove_tree(old)
        c.barrier()
    config.iteration += 1
    return path


def _checked(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a checkpoint of deeppart.integrations.accelerate.save_state"
        )
    return state


def _count(what: str, saved: list[Any], have: list[Any], path: Path) -> None:
    if len(saved) != len(have):
        raise StateMismatchError(
            f"{path}: holds {len(saved)} {what}, the accelerator has {len(have)} "
            f"(prepare the same {what} as the run that saved it)"
        )


def load_state(
    accelerator: Accelerator,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    comm: Any = None,
    exchange: str = "auto",
    strict: bool = True,
    progress: bool | None = None,
) -> Path:
    """Restores a checkpoint of :func:`save_state` into the accelerator's
    prepared objects, on every process (collective). With no ``input_dir``
    and automatic checkpoint naming, the newest committed checkpoint.
    ``strict``: passed to the models' ``load_state_dict``. Each process
    restores its own RNG states (a checkpoint of another number of
    processes restores none, with a warning). Returns the path loaded."""
    _check_supported(accelerator)
    c = _comm(comm)
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("no input_dir given and automatic checkpoint naming is off")
        root = Path(accelerator.project_dir) / "checkpoints"
        committed = [p for _, p in _numbered(root) if is_committed(p)]
        if not committed:
            raise CheckpointError(f"{root}: no committed checkpoint")
        path = committed[-1]
    else:
        path = Path(input_dir)
    state = _checked(load(path, comm=c, progress=progress, loading=LoadOptions(exchange)), path)

    models = list(accelerator._models)
    for hook in accelerator._load_model_state_pre_hook.values():
        hook(models, str(path))
    _count("models", state["models"], models, path)
    _count("optimizers", state["optimizers"], accelerator._optimizers, path)
    _count("schedulers", state["schedulers"], accelerator._schedulers, path)
    _count("registered objects", state["custom"], accelerator._custom_objects, path)
    for model, weights in zip(models, state["models"], strict=True):
        accelerator.unwrap_model(model).load_state_dict(weights, strict=strict)
    for opt, opt_state in zip(accelerator._optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(opt_state)
    for sched, sched_state in zip(accelerator._schedulers, state["schedulers"], strict=True):
        sched.load_state_dict(sched_state)
    for sampler, saved in zip(_samplers(accelerator), state["samplers"], strict=False):
        if sampler is not None and isinstance(saved, dict):
            sampler.set_epoch(int(saved["epoch"]))
    if accelerator.scaler is not None and state["scaler"] is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    for obj, obj_state in zip(accelerator._custom_objects, state["custom"], strict=True):
        obj.load_state_dict(obj_state)
    accelerator.step = int(state["step"])
    restore_rng_states(state["rng"], c.rank, c.size)
    return path
