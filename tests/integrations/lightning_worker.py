"""One rank of the Lightning test (tests/integrations/test_integrations.py launches it
under ``python -m torch.distributed.run --nproc-per-node 2 --standalone``):

    python tests/integrations/lightning_worker.py RUN DIR [--kill-at-step K] [--resume CKPT]

A real ``LightningModule`` (an MLP, AdamW and a StepLR schedule) trains for
3 epochs under :class:`DeepPartDDPStrategy` (gloo, CPU) with
``ModelCheckpoint`` saving every epoch into ``DIR/RUN-ckpts``.
``--kill-at-step K`` SIGKILLs every rank after optimizer step K;
``--resume CKPT`` continues from a checkpoint with ``ckpt_path=``. Each rank
records its losses, the epoch and step it resumed at and its final model
and optimizer tensors (tests/integrations/framework_runs.py), and prints ``OK
lightning-RUN rank r/n``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
from framework_runs import (
    RunRecord,
    kill_self,
    mlp,
    model_tensors,
    optimizer_tensors,
    regression_data,
    worker_args,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from mpi_checkpoint import ok, run_then_exit
from torch.utils.data import DataLoader

from deeppart.integrations.lightning import DeepPartDDPStrategy

EPOCHS = 3
SAMPLES = 64  # 2 ranks x batch 8: 4 steps per epoch


class Regressor(pl.LightningModule):
    def __init__(self, record: RunRecord) -> None:
        super().__init__()
        self.net = mlp()
        self.record = record

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        # The step this loss trains (global_step counts finished steps).
        self.record.loss(self.trainer.global_step + 1, loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self) -> None:
        self.record.fact("start", [self.trainer.current_epoch, self.trainer.global_step])
        opt = self.trainer.optimizers[0]
        steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
        self.record.fact("start_optimizer_steps", steps)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(regression_data(SAMPLES), batch_size=8, shuffle=True)


class KillAtStep(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            kill_self()


def start(args: Any) -> tuple[int, RunRecord, list[pl.Callback]]:
    """Seeds, joins the gloo group; the world size, this rank's record and
    the callbacks (a checkpoint every epoch, the kill if asked)."""
    pl.seed_everything(1234, verbose=False)
    dist.init_process_group("gloo")
    record = RunRecord(args.dir, args.run, dist.get_rank())
    callbacks: list[pl.Callback] = [
        ModelCheckpoint(dirpath=args.dir / f"{args.run}-ckpts", save_top_k=-1, every_n_epochs=1)
    ]
    if args.kill_at_step:
        callbacks.append(KillAtStep(args.kill_at_step))
    return dist.get_world_size(), record, callbacks


def trainer_for(size: int, strategy: Any, callbacks: list[pl.Callback]) -> pl.Trainer:
    """The runs' Trainer: CPU ranks, deterministic, no logger or progress bar."""
    return pl.Trainer(
        accelerator="cpu",
        devices=size,
        strategy=strategy,
        max_epochs=EPOCHS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )


def main() -> None:
    args = worker_args()
    size, record, callbacks = start(args)
    trainer = trainer_for(size, DeepPartDDPStrategy(process_group_backend="gloo"), callbacks)
    model = Regressor(record)
    trainer.fit(model, ckpt_path=args.resume)
    record.fact("end", [trainer.current_epoch, trainer.global_step])
    record.final({**model_tensors(model), **optimizer_tensors(trainer.optimizers[0])})
    dist.barrier()
    ok(f"lightning-{args.run}")


if __name__ == "__main__":
    run_then_exit(main)
