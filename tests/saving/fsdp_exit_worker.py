"""One rank of a finished FSDP2 training job that checkpoints with DeepPart
and ends as such jobs end, with ``dist.destroy_process_group()``
(tests/saving/test_teardown.py launches it under ``python -m torch.distributed.run
--nproc-per-node 2 --standalone``, gloo, CPU):

    python tests/saving/fsdp_exit_worker.py MODE ROOT

A two-block transformer, each block and the whole model ``fully_shard``-ed,
AdamW; three training steps, each saved through a ``Checkpointer`` (the
model's and the optimizer's DTensor state, the step, this rank's RNG state).
MODE:

- ``inflight``: asynchronous saves; the last is still in flight when the
  job calls ``dist.destroy_process_group()`` (no ``wait``): the teardown
  must let it commit (before the fix, DeepPart's writer group was destroyed
  under its thread: "Group ... is not registered", the step lost, exit 0,
  and at times a SIGABRT at exit);
- ``waited``: asynchronous saves, the last waited for before the teardown;
- ``sync``: synchronous saves.

After the teardown each rank checks that step 3 is committed (its marker
and its metadata) and that a ``wait()`` reports the save's success, and
prints ``OK fsdp-exit-MODE rank r/n``; the process must then exit 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deeppart import AsyncSave, Checkpointer


def model_of(width: int) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = [
        torch.nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True
        )
        for _ in range(2)
    ]
    model = torch.nn.Sequential(*blocks)
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    assert mode in ("inflight", "waited", "sync"), mode
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = model_of(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpointer = Checkpointer(root, async_=mode != "sync", keep_last=2)
    torch.manual_seed(100 + rank)
    last = None
    for step in range(1, 4):
        batch = torch.randn(4, 8, 64)
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        state = {
            "model": model.state_dict(),
            "optim": optimizer.state_dict(),
            "step": step,
            "rng": torch.get_rng_state(),
        }
        last = checkpointer.save(step, state)
    if mode == "waited":
        checkpointer.wait()
    dist.destroy_process_group()

    # The teardown settled the save in flight: step 3 is committed, and the
    # handle reports success (it raises the save's error otherwise).
    if mode != "sync":
        assert isinstance(last, AsyncSave), type(last)
        assert last.done(), "the save in flight did not finish"
        last.wait()
    checkpointer.wait()
    step_dir = checkpointer.path(3)
    assert (step_dir / "COMMITTED").is_file(), f"{step_dir} not committed"
    meta = json.loads((step_dir / "metadata.json").read_text())
    assert meta.get("world_size") == size, meta.get("world_size")
    print(f"OK fsdp-exit-{mode} rank {rank}/{size}", flush=True)


if __name__ == "__main__":
    main()
