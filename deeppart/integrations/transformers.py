"""Hugging Face ``transformers.Trainer``: every rank writes its part of
each checkpoint.

``Trainer`` saves a checkpoint from the main process (model weights,
``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``) plus one pickled
``rng_state_<rank>.pth`` per process. :class:`DeepPartTrainer` is a
``Trainer`` whose ``checkpoint-<step>`` directories hold, instead, one
DeepPart checkpoint in ``checkpoint-<step>/deeppart/`` with the model, the
optimizer, the scheduler, the gradient scaler and every process's RNG
states (:mod:`deeppart.integrations.rng`), written by all ranks in
parallel. What stays the Trainer's: ``trainer_state.json`` (the step, the
log history, the callbacks' states: small JSON, from the main process), the
model's ``config.json`` and the processing class's files.
``train(resume_from_checkpoint=...)`` restores from it exactly as the
Trainer would from its own files (a checkpoint without ``deeppart/`` is
loaded the Trainer's way)::

    from deeppart.integrations.transformers import DeepPartTrainer

    trainer = DeepPartTrainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint="out/checkpoint-200")   # or True: the newest

Plain data parallelism (DDP under ``torchrun``, or one process) goes
through DeepPart; DeepSpeed, FSDP, SageMaker MP and XLA keep the Trainer's
own saving. ``deeppart_options`` are passed to :func:`deeppart.save`
(e.g. ``{"writing": deeppart.WriteOptions(compression="zstd")}``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import Trainer
from transformers.utils.import_utils import is_torch_xla_available

from deeppart.comm import Comm, resolve
from deeppart.errors import CheckpointError
from deeppart.integrations.rng import gather_rng_states, restore_rng_states
from deeppart.loading.load import load
from deeppart.saving.save import save

__all__ = ["SUBDIR", "DeepPartTrainer"]

#: The DeepPart checkpoint's directory inside ``checkpoint-<step>``.
SUBDIR = "deeppart"

#: The ``format`` entry of the checkpoints written here.
FORMAT = "deeppart-transformers-trainer/1"


class DeepPartTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints every rank writes in
    parallel through DeepPart (see the module's documentation)."""

    def __init__(
        self, *args: Any, deeppart_options: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.deeppart_options = dict(deeppart_options or {})
        self._deeppart_saving = False
        self._deeppart_resumed: dict[str, Any] | None = None

    # -- which path ---------------------------------------------------------

    def _deeppart_applies(self) -> bool:
        return not (
            self.is_deepspeed_enabled
            or self.is_fsdp_enabled
            or is_torch_xla_available()
            or getattr(self, "is_sagemaker_mp_enabled", lambda: False)()
        )

    def _deeppart_comm(self) -> Comm:
        return resolve("torch" if dist.is_available() and dist.is_initialized() else None)

    # -- saving ---------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        self._deeppart_saving = self._deeppart_applies()
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._deeppart_saving = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._deeppart_saving:
            super().save_model(output_dir, _internal_call=_internal_call)
            return
        assert output_dir is not None
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            config = getattr(self.model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
        self._deeppart_save(Path(output_dir) / SUBDIR)

    def _deeppart_save(self, path: Path) -> None:
        """One DeepPart checkpoint of the model and, unless
        ``save_only_model``, the optimizer, scheduler, scaler and RNG states
        (collective)."""
        c = self._deeppart_comm()
        assert self.model is not None
        state: dict[str, Any] = {"format": FORMAT, "model": self.model.state_dict()}
        if not self.args.save_only_model:
            assert self.optimizer is not None and self.lr_scheduler is not None
            scaler = getattr(self.accelerator, "scaler", None)
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.lr_scheduler.state_dict()
            state["scaler"] = None if scaler is None else scaler.state_dict()
            state["rng"] = gather_rng_states(c)
        options = {"overwrite": True, **self.deeppart_options}
        save(state, path, comm=c, **options)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._deeppart_saving:
            super()._save_optimizer_and_scheduler(output_dir)

    def _save_scaler(self, output_dir: str) -> None:
        if not self._deeppart_saving:
            super()._save_scaler(output_dir)

    def _save_rng_state(self, output_dir: str) -> None:
        if not self._deeppart_saving:
            super()._save_rng_state(output_dir)

    # -- resuming -------------------------------------------------------------

    def _deeppart_load(self, path: Path, keys: list[str] | None = None) -> dict[str, Any]:
        """The checkpoint at ``path`` (only ``keys`` and its format entry,
        reading only their bytes, when given), checked to be one of ours."""
        if keys is not None:
            keys = ["format", *keys]
        state = load(path, comm=self._deeppart_comm(), keys=keys)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a checkpoint of DeepPartTrainer")
        return state

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        path = Path(resume_from_checkpoint) / SUBDIR
        if not (self._deeppart_applies() and path.is_dir()):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        state = self._deeppart_load(path)
        target = self.model if model is None else model
        assert target is not None
        target.load_state_dict(state.pop("model"))
        self._deeppart_resumed = state

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the model of the best checkpoint,
        from its DeepPart checkpoint (on every rank; only the model's bytes
        are read)."""
        best = self.state.best_model_checkpoint
        path = Path(best) / SUBDIR if best is not None else None
        if path is None or not (self._deeppart_applies() and path.is_dir()):
            super()._load_best_model()
            return
        assert self.model is not None
        self.model.load_state_dict(self._deeppart_load(path, keys=["model"])["model"])

    def _resumed(self, checkpoint: str | None, key: str) -> tuple[bool, Any]:
        """(True, the entry) when ``checkpoint`` was loaded by DeepPart."""
        if checkpoint is None or self._deeppart_resumed is None:
            return False, None
        if key not in self._deeppart_resumed:
            return True, None
        return True, self._deeppart_resumed[key]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        ours, optimizer = self._resumed(checkpoint, "optimizer")
        if not ours:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self._deeppart_resumed is not None
        if optimizer is not None:
            assert self.optimizer is not None and self.lr_scheduler is not None
            self.optimizer.load_state_dict(optimizer)
            self.lr_scheduler.load_state_dict(self._deeppart_resumed["scheduler"])
        self._deeppart_resumed.pop("optimizer", None)
        self._deeppart_resumed.pop("scheduler", None)

    def _load_scaler(self, checkpoint: str | None) -> None:
        ours, scaler_state = self._resumed(checkpoint, "scaler")
        if not ours:
            super()._load_scaler(checkpoint)
            return
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and scaler_state is not None:
            scaler.load_state_dict(scaler_state)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        ours, states = self._resumed(checkpoint, "rng")
        if not ours:
            super()._load_rng_state(checkpoint)
            return
        if states is not None:
            c = self._deeppart_comm()
            restore_rng_states(states, c.rank, c.size)
