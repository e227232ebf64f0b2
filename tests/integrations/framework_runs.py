"""What the framework workers (tests/integrations/*_worker.py for Lightning, the
Hugging Face Trainer and Accelerate) share: the record of a training run,
written as it goes so that a killed run leaves what it did, and read back
by tests/integrations/test_integrations.py.

A run in ``DIR`` under the name ``RUN`` writes, per rank ``r``:

- ``RUN-losses-r.jsonl``: one ``[step, loss.hex()]`` line per training
  step, flushed at once (a loss is a Python float, exactly: ``float.hex``);
- ``RUN-final-r.safetensors``: the final tensors (model and optimizer);
- ``RUN-facts-r.json``: named plain facts (epoch and step after a resume).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


class RunRecord:
    """One rank's record of run ``name`` in ``directory``."""

    def __init__(self, directory: Path, name: str, rank: int) -> None:
        self.directory = directory
        self.name = name
        self.rank = rank
        directory.mkdir(parents=True, exist_ok=True)

    def _path(self, what: str, ext: str) -> Path:
        return self.directory / f"{self.name}-{what}-{self.rank}.{ext}"

    def loss(self, step: int, loss: float) -> None:
        with self._path("losses", "jsonl").open("a") as f:
            f.write(json.dumps([step, float(loss).hex()]) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def fact(self, key: str, value: Any) -> None:
        path = self._path("facts", "json")
        facts = json.loads(path.read_text()) if path.exists() else {}
        facts[key] = value
        path.write_text(json.dumps(facts))

    def final(self, tensors: dict[str, torch.Tensor]) -> None:
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            str(self._path("final", "safetensors")),
        )


def worker_args() -> argparse.Namespace:
    """A worker's command line: ``RUN DIR [--kill-at-step K] [--resume CKPT]``."""
    p = argparse.ArgumentParser()
    p.add_argument("run")
    p.add_argument("dir", type=Path)
    p.add_argument("--kill-at-step", type=int, default=0, help="SIGKILL after step K")
    p.add_argument("--resume", default=None, help="the checkpoint to resume from")
    args = p.parse_args()
    torch.set_num_threads(1)
    return args


def mlp(dropout: float = 0.0) -> torch.nn.Sequential:
    """The workers' model: large enough (0.66 MB, 2 MB with AdamW) that
    the planner gives both ranks a part."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(512, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 1),
    )


def regression_data(samples: int) -> torch.utils.data.TensorDataset:
    """A fixed regression data set of ``samples`` rows."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(samples, 64, generator=g)
    y = x[:, :3].sum(dim=1, keepdim=True) + 0.1 * torch.randn(samples, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def losses(directory: Path, name: str, rank: int) -> list[tuple[int, float]]:
    path = directory / f"{name}-losses-{rank}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    return [(int(step), float.fromhex(loss)) for step, loss in rows]


def facts(directory: Path, name: str, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((directory / f"{name}-facts-{rank}.json").read_text())
    return out


def final_tensors(directory: Path, name: str, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(directory / f"{name}-final-{rank}.safetensors"))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The tensors of an optimizer's state (``step``, ``exp_avg``, ...), by name."""
    out: dict[str, torch.Tensor] = {}
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{index}.{key}"] = value
    return out


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state, by name; a tensor that another name already holds
    (tied weights) is kept once, as safetensors requires."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        if value.data_ptr() in seen:
            continue
        seen.add(value.data_ptr())
        out[f"model.{key}"] = value
    return out


def kill_self() -> None:
    """A real crash: SIGKILL, no cleanup, no Python exception handling."""
    os.kill(os.getpid(), signal.SIGKILL)
