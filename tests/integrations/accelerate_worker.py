"""One rank of the Accelerate test (tests/integrations/test_integrations.py launches it
under ``python -m torch.distributed.run --nproc-per-node 2 --standalone``):

    python tests/integrations/accelerate_worker.py RUN DIR [--kill-at-step K] [--resume CKPT]

An ``accelerate.Accelerator`` (CPU, gloo) trains an MLP with dropout
(AdamW, StepLR, a seedable sampler, a registered custom object) for 3
epochs of 4 steps, saving with :func:`deeppart.integrations.accelerate.save_state`
after every epoch into ``DIR/RUN-ckpts/epoch-E``. ``--kill-at-step K``
SIGKILLs every rank after step K; ``--resume CKPT`` restores with
:func:`load_state` and continues. Records as tests/integrations/framework_runs.py says;
prints ``OK accelerate-RUN rank r/n``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from framework_runs import (
    RunRecord,
    kill_self,
    mlp,
    model_tensors,
    optimizer_tensors,
    regression_data,
    worker_args,
)
from mpi_checkpoint import ok, run_then_exit
from torch.utils.data import DataLoader

from deeppart.integrations.accelerate import load_state, save_state

EPOCHS = 3
SAMPLES = 64  # 2 ranks x batch 8: 4 steps per epoch


class Progress:
    """Where the loop is: a custom object, registered for checkpointing."""

    def __init__(self) -> None:
        self.steps = 0
        self.epochs = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "epochs": self.epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.epochs = int(state["steps"]), int(state["epochs"])


def main() -> None:
    args = worker_args()
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True)
    )
    set_seed(99)
    rank = accelerator.process_index
    record = RunRecord(args.dir, args.run, rank)
    model = mlp(dropout=0.2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    dl = DataLoader(regression_data(SAMPLES), batch_size=8, shuffle=True)
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        load_state(accelerator, args.resume)
        record.fact("start", [progress.epochs, progress.steps, accelerator.step])
    for epoch in range(progress.epochs, EPOCHS):
        dl.set_epoch(epoch)
        model.train()
        for xb, yb in dl:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.steps += 1
            record.loss(progress.steps, loss.item())
            if progress.steps == args.kill_at_step:
                kill_self()
        progress.epochs = epoch + 1
        save_state(accelerator, args.dir / f"{args.run}-ckpts" / f"epoch-{epoch}")
    record.fact("end", [progress.epochs, progress.steps])
    record.final(
        {**model_tensors(accelerator.unwrap_model(model)), **optimizer_tensors(opt.optimizer)}
    )
    accelerator.wait_for_everyone()
    ok(f"accelerate-{args.run}")


if __name__ == "__main__":
    run_then_exit(main)
