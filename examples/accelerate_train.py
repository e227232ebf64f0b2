"""A small Accelerate training run whose checkpoint every process writes
its part of (deeppart.integrations.accelerate), restored and checked:

    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py [DIR]

``Accelerator(cpu=True)`` makes the processes gloo CPU processes; on a
machine without GPUs ``--multi_gpu`` only asks ``accelerate launch`` to
start ``--num_processes`` of them (through torchrun), while ``--cpu``
starts one. Prints one line per process.
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator

from deeppart.integrations.accelerate import load_state, save_state


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "ckpt/accelerate"
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(64, 64), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    save_state(accelerator, out)  # every process writes its part
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    lr = sched.get_last_lr()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_state(accelerator, out)
    same = all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    same = same and sched.get_last_lr() == lr
    print(
        f"rank {accelerator.process_index}/{accelerator.num_processes}: restored {out}: "
        + ("bitwise equal" if same else "DIFFERENT"),
        flush=True,
    )
    # As docs/INTEGRATIONS.md says for any torchrun script: a gloo group left to the
    # interpreter's teardown can abort a rank after its work is done.
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
