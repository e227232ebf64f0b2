"""One rank of the Hugging Face Trainer test (tests/integrations/test_integrations.py
launches it under ``python -m torch.distributed.run --nproc-per-node 2
--standalone``):

    python tests/integrations/hf_trainer_worker.py RUN DIR [--kill-at-step K] [--resume CKPT]

:class:`DeepPartTrainer` (DDP, gloo, CPU) trains a small GPT-2 built from
a config (no download; dropout on, so the RNG states matter) for 2 epochs
of 8 steps, saving ``checkpoint-5``, ``-10`` and ``-15`` into
``DIR/RUN-out`` (mid-epoch: the resume skips batches as the Trainer does).
``--kill-at-step K`` SIGKILLs every rank after step K; ``--resume CKPT``
passes ``resume_from_checkpoint``. Records as tests/integrations/framework_runs.py says;
prints ``OK trainer-RUN rank r/n``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework_runs import (
    RunRecord,
    kill_self,
    model_tensors,
    optimizer_tensors,
    worker_args,
)
from mpi_checkpoint import ok, run_then_exit
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from deeppart.integrations.transformers import DeepPartTrainer

SAMPLES = 64  # 2 ranks x batch 4: 8 steps per epoch


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 128, (SAMPLES, 16), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class RecordingTrainer(DeepPartTrainer):
    """Records the loss of every training step, and the step it starts at."""

    record: RunRecord

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        step = self.state.global_step
        if not hasattr(self, "_first_step"):
            self._first_step = step
            self.record.fact("start", [step, self.state.epoch])
        loss = super().training_step(*args, **kwargs)
        self.record.loss(step + 1, loss.item())
        return loss


class KillAtStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if state.global_step == self.step:
            kill_self()


def main() -> None:
    args = worker_args()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=128,
        n_positions=32,
        n_embd=128,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=str(args.dir / f"{args.run}-out"),
        per_device_train_batch_size=4,
        num_train_epochs=2,
        learning_rate=1e-3,
        warmup_steps=2,
        save_strategy="steps",
        save_steps=5,
        logging_steps=1,
        report_to=[],
        seed=42,
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callbacks = [KillAtStep(args.kill_at_step)] if args.kill_at_step else []
    trainer = RecordingTrainer(
        model=model, args=training_args, train_dataset=Tokens(), callbacks=callbacks
    )
    trainer.record = RunRecord(args.dir, args.run, training_args.process_index)
    trainer.train(resume_from_checkpoint=args.resume)
    trainer.record.fact("end", [trainer.state.global_step, trainer.state.epoch])
    assert trainer.optimizer is not None and trainer.model is not None
    trainer.record.final({**model_tensors(trainer.model), **optimizer_tensors(trainer.optimizer)})
    dist.barrier()
    ok(f"trainer-{args.run}")


if __name__ == "__main__":
    run_then_exit(main)
