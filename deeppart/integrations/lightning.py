"""PyTorch Lightning: every DDP rank writes its part of each checkpoint.

Under DDP, Lightning's ``Strategy.save_checkpoint`` hands the checkpoint
dict to its ``CheckpointIO`` on global rank 0 only, so a ``CheckpointIO``
plugin alone cannot make the other ranks write. :class:`DeepPartDDPStrategy`
is ``DDPStrategy`` with ``save_checkpoint`` run on every rank: each rank
passes the same checkpoint dict (the state is replicated under DDP) to
:class:`DeepPartCheckpointIO`, which calls :func:`deeppart.save`
collectively. ``load_checkpoint`` is already called on every rank, so
``trainer.fit(ckpt_path=...)`` reads the checkpoint with
:func:`deeppart.load`, each rank its share.

::

    from deeppart.integrations.lightning import DeepPartDDPStrategy

    trainer = L.Trainer(strategy=DeepPartDDPStrategy(), devices=4, ...)
    trainer.fit(model, ckpt_path="ckpts/epoch=3-step=400.ckpt")   # a DeepPart directory

A checkpoint path (``epoch=3-step=400.ckpt``) is a DeepPart checkpoint
*directory*; ``ModelCheckpoint`` names, keeps and removes them as it does
files. The strategy is registered as ``strategy="deeppart_ddp"`` too.
Lightning itself stores no RNG state in its checkpoints; seed and order
data the usual way (``seed_everything``, ``DistributedSampler``). As with
Lightning's own files, a mid-epoch checkpoint resumes exactly only with a
resumable dataloader (one with ``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn

from deeppart.errors import CheckpointError
from deeppart.format import remove_tree
from deeppart.loading.load import load
from deeppart.options import LoadOptions, PlanOptions, WriteOptions
from deeppart.saving.save import save
from deeppart.storage.ownership import owned_dir

__all__ = ["DeepPartCheckpointIO", "DeepPartDDPStrategy", "DeepPartModelParallelStrategy"]


def _default_comm(comm: Any) -> Any:
    """``comm`` as given; by default Lightning's own process group (the
    torch.distributed default group) when it is initialised, else DeepPart's
    usual choice (MPI, or one process)."""
    if comm is not None:
        return comm
    return "torch" if dist.is_available() and dist.is_initialized() else None


class DeepPartCheckpointIO(CheckpointIO):
    """Saves and loads Lightning checkpoints as DeepPart checkpoints.

    ``save_checkpoint`` and ``load_checkpoint`` are collective: every rank
    must call them with the same checkpoint (:class:`DeepPartDDPStrategy`
    does). ``comm``: the communicator (default: Lightning's process group);
    ``compression``, ``algorithm``, ``planner``, ``exchange``, ``progress``:
    as for :func:`deeppart.save` / :func:`deeppart.load`. A checkpoint at an
    existing path is replaced atomically (``overwrite=True``), as Lightning
    does with ``last.ckpt``. Tensors are loaded on the CPU; Lightning moves
    them to the model's device when it restores them.
    """

    def __init__(
        self,
        *,
        comm: Any = None,
        compression: str | None = None,
        algorithm: str | None = None,
        planner: Any = None,
        exchange: str = "auto",
        progress: bool | None = None,
    ) -> None:
        self.comm = comm
        self.planning = PlanOptions(planner, algorithm)
        self.writing = WriteOptions(compression)
        self.loading = LoadOptions(exchange)
        self.progress = progress

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        path: _PATH,
        storage_options: Any | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"DeepPartCheckpointIO takes no storage_options (got {storage_options!r}); "
                "set compression= and the other options on the plugin instead"
            )
        save(
            checkpoint,
            path,
            comm=_default_comm(self.comm),
            overwrite=True,
            progress=self.progress,
            planning=self.planning,
            writing=self.writing,
        )

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Any | None = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        # weights_only: DeepPart never unpickles, whatever its value.
        state: Any = load(path, comm=_default_comm(self.comm), loading=self.loading)
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{path}: holds a {type(state).__name__}, not a Lightning checkpoint dict"
            )
        if map_location is not None:
            import torch

            state = _to_location(state, map_location, torch)
        out: dict[str, Any] = state
        return out

    def remove_checkpoint(self, path: _PATH) -> None:
        """Removes a checkpoint directory (Lightning calls this on rank 0);
        one that holds files DeepPart did not write stays, with a warning."""
        p = Path(path)
        if p.is_dir() and not owned_dir(p):
            rank_zero_warn(f"{p}: not removed, it holds files DeepPart did not write")
        elif p.is_dir():
            remove_tree(p)
        elif p.exists():
            p.unlink()


def _to_location(value: Any, location: Any, torch: Any) -> Any:
    """``torch.load``'s ``map_location`` for a device or a device string."""
    if isinstance(value, torch.Tensor):
        return value.to(location)
    if isinstance(value, dict):
        return {k: _to_location(v, location, torch) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_to_location(v, location, torch) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


class DeepPartDDPStrategy(DDPStrategy):
    """``DDPStrategy`` whose checkpoints every rank writes in parallel.

    Takes ``DDPStrategy``'s arguments (by keyword), plus :class:`DeepPartCheckpointIO`'s
    options (``compression=``, ...) when no ``checkpoint_io`` is given. With
    another ``CheckpointIO`` (e.g. one passed in ``plugins=``, which
    replaces this one), saving falls back to Lightning's rank-0 behaviour,
    with a warning. ``trainer.save_checkpoint`` must be called on every
    rank, as Lightning requires anyway.
    """

    strategy_name = "deeppart_ddp"

    def __init__(
        self,
        *,
        checkpoint_io: CheckpointIO | None = None,
        compression: str | None = None,
        algorithm: str | None = None,
        planner: Any = None,
        **kwargs: Any,
    ) -> None:
        if checkpoint_io is None:
            checkpoint_io = DeepPartCheckpointIO(
                compression=compression, algorithm=algorithm, planner=planner
            )
        super().__init__(checkpoint_io=checkpoint_io, **kwargs)
        self._warned_fallback = False

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: _PATH,
        storage_options: Any | None = None,
    ) -> None:
        io = self.checkpoint_io
        if isinstance(io, DeepPartCheckpointIO):
            io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if not self._warned_fallback:
            self._warned_fallback = True
            rank_zero_warn(
                f"DeepPartDDPStrategy: the checkpoint plugin is {type(io).__name__} (e.g. from "
                "plugins=), not DeepPartCheckpointIO: rank 0 saves the checkpoint alone"
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)


#: The checkpoint keys that hold DTensor state under ModelParallelStrategy.
_SHARDED_KEYS = ("state_dict", "optimizer_states")


class DeepPartModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallelism through the
    LightningModule's ``configure_model``) whose checkpoints are DeepPart
    checkpoints: the sharded model and optimizer state (DTensors) and
    Lightning's own values in one directory, each rank writing its shards;
    resumed into the same or another mesh or number of ranks. Takes
    ``ModelParallelStrategy``'s arguments (``save_distributed_checkpoint``
    must stay True: the point is not to gather the state on rank 0)."""

    strategy_name = "deeppart_model_parallel"

    def __init__(self, *, comm: Any = None, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint") is False:
            raise ValueError(
                "DeepPartModelParallelStrategy saves the sharded state; "
                "save_distributed_checkpoint=False gathers it on rank 0 (use ModelParallelStrategy)"
            )
        super().__init__(**kwargs)
        self.comm = comm

    def save_checkpoint(
        self,
        checkpoint: dict[str, Any],
        filepath: _PATH,
        storage_options: Any | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError("DeepPartModelParallelStrategy takes no storage_options")
        path = Path(self.broadcast(filepath))
        save(checkpoint, path, comm=_default_comm(self.comm), overwrite=True)

    def load_checkpoint(
        self, checkpoint_path: _PATH, weights_only: bool | None = None
    ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from deeppart.loading.reader import open_checkpoint

        path = Path(self.broadcast(checkpoint_path))
        comm = _default_comm(self.comm)
        # The model's and optimizers' DTensors are filled in place (resharded
        # if the mesh differs); Lightning's values are read as they are.
        target = {
            "state_dict": self.lightning_module_state_dict(),
            "optimizer_states": [self.optimizer_state(o) for o in self.optimizers],
        }
        sharded = load(path, comm=comm, into=target, keys=list(_SHARDED_KEYS))
        _, meta, _ = open_checkpoint(path)
        rest = sorted({str(lf.path[0]) for lf in meta.leaves} - set(_SHARDED_KEYS))
        out: dict[str, Any] = load(path, comm=comm, keys=rest) if rest else {}
        assert self.model is not None
        set_model_state_dict(self.model, sharded["state_dict"])
        for opt, osd in zip(self.optimizers, sharded["optimizer_states"], strict=True):
            set_optimizer_state_dict(self.model, opt, osd)
        out.update(sharded)
        return out


if DeepPartModelParallelStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        DeepPartModelParallelStrategy.strategy_name,
        DeepPartModelParallelStrategy,
        description="ModelParallelStrategy (FSDP2/TP) with DeepPart checkpoints",
    )

if DeepPartDDPStrategy.strategy_name not in StrategyRegistry:
    StrategyRegistry.register(
        DeepPartDDPStrategy.strategy_name,
        DeepPartDDPStrategy,
        description="DDP whose checkpoints every rank writes in parallel (DeepPart)",
    )
