"""One rank of the Lightning FSDP2 test (tests/integrations/test_integrations.py launches it
under ``python -m torch.distributed.run --nproc-per-node 2 --standalone``):

    python tests/integrations/lightning_fsdp_worker.py RUN DIR [--kill-at-step K] [--resume CKPT]

The MLP of tests/integrations/lightning_worker.py, sharded with FSDP2 ``fully_shard`` in
``configure_model`` over ``ModelParallelStrategy``'s data-parallel mesh
(gloo, CPU), under :class:`DeepPartModelParallelStrategy`: its checkpoints
hold the DTensor shards of the model and of AdamW's state. Each rank
records its losses and its final local shards of the model and optimizer
state, and prints ``OK lightning-fsdp-RUN rank r/n``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from framework_runs import worker_args
from lightning_worker import Regressor, start, trainer_for
from mpi_checkpoint import ok, run_then_exit

from deeppart.integrations.lightning import DeepPartModelParallelStrategy


class ShardedRegressor(Regressor):
    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        assert self.device_mesh is not None
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def on_train_start(self) -> None:
        self.record.fact("start", [self.trainer.current_epoch, self.trainer.global_step])


def local_tensors(model: Any, optimizer: Any) -> dict[str, torch.Tensor]:
    """This rank's shards of the model and optimizer state, by name."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        out[f"model.{key}"] = value.to_local().clone()
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"optim.{index}.{key}"] = local.clone()
    return out


def main() -> None:
    args = worker_args()
    size, record, callbacks = start(args)
    strategy = DeepPartModelParallelStrategy(
        data_parallel_size=size, tensor_parallel_size=1, process_group_backend="gloo"
    )
    trainer = trainer_for(size, strategy, callbacks)
    model = ShardedRegressor(record)
    trainer.fit(model, ckpt_path=args.resume)
    record.fact("end", [trainer.current_epoch, trainer.global_step])
    record.final(local_tensors(model, trainer.optimizers[0]))
    dist.barrier()
    ok(f"lightning-fsdp-{args.run}")


if __name__ == "__main__":
    run_then_exit(main)
