"""One rank of the DCP tests (tests/integrations/test_dcp.py launches it).

    python tests/integrations/dcp_worker.py save:DIR load:DIR ...

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (gloo, CPU); with
WORLD_SIZE=1 no process group is created (DCP's no_dist mode).

It runs the operations in order. ``save`` builds the reference state (a small
transformer and its AdamW state after one step, seeded) and saves it with
``BalancedSavePlanner``; ``load``
builds the same structure with other values, loads the checkpoint with stock
``torch.distributed.checkpoint.load`` and checks it is bitwise the reference.
``savemoe`` / ``loadmoe`` do the same with a scaled-down Mixtral (stacked
experts) and a cost model without per-piece costs. ``failures`` runs DCP's
failure cases with the default planner and with ``BalancedSavePlanner``
(:func:`failures`).
Each rank prints one line: ``RESULT`` and a JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from rank_output import print_line

from deeppart import CostModel
from deeppart.integrations.dcp import BalancedSavePlanner

VOCAB, DIM = 8000, 64
# Small pieces allowed, so that the small test state is cut.
COST = CostModel(min_piece_bytes=16 * 1024)
# Balanced time is balanced bytes: no per-file or per-piece costs.
BYTES_COST = CostModel(fixed_s=0.0, piece_s=0.0, writer_s=1e-6, min_piece_bytes=16 * 1024)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 128, batch_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.encoder(self.embed(x)))
        return out


def make_state(seed: int) -> dict[str, Any]:
    """Model and AdamW state after one step, all derived from ``seed``."""
    torch.manual_seed(seed)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    x = torch.randint(0, VOCAB, (4, 16))
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), x.reshape(-1))
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"epoch": seed}}


def make_moe_state(seed: int) -> dict[str, Any]:
    """A scaled-down Mixtral (transformers' MixtralForCausalLM, stacked
    experts) and its AdamW state after one step, derived from ``seed``."""
    from bench.zoo import mixtral_scaled

    torch.manual_seed(seed)
    model = mixtral_scaled().build("cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3 * (seed + 1))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def dtensor_value(seed: int) -> torch.Tensor:
    return torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64) * (1 - seed)


def with_dtensor(state: dict[str, Any], world: int, seed: int) -> dict[str, Any]:
    """``state`` plus ``dt``: a 512 x 64 tensor, row-sharded over the ranks
    as a DTensor (a plain tensor in one process)."""
    value = dtensor_value(seed)
    if world == 1:
        return state | {"dt": value}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return state | {"dt": distribute_tensor(value, mesh, [Shard(0)])}


def same(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where ``a`` and ``b`` differ (tensors compared bitwise)."""
    if isinstance(a, torch.Tensor):
        ok = (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(
                torch.equal(
                    a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b
                )
            )
        )
        return [] if ok else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [path]
        return [p for k in a for p in same(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, list | tuple):
        if not isinstance(b, list | tuple) or len(a) != len(b):
            return [path]
        return [
            p for i, (x, y) in enumerate(zip(a, b, strict=True)) for p in same(x, y, f"{path}.{i}")
        ]
    return [] if a == b else [path]


def _outcome(save: Any) -> str:
    """``"ok"``, or the type of what ``save()`` raised (DCP's
    CheckpointException is a BaseException)."""
    try:
        save()
    except BaseException as e:
        return type(e).__name__
    return "ok"


def failures(root: Path, world: int, rank: int) -> dict[str, str]:
    """DCP's failure handling, with the default planner and with
    ``BalancedSavePlanner``: rank 1 fails in ``set_up_storage_writer``
    (before planning) and in ``create_local_plan``; each must raise
    CheckpointException on every rank (no hang, no collective mismatch) and
    commit nothing. Then rank 0 alone saves with ``no_dist=True`` while the
    process group is up (the other ranks wait in a barrier): it must save
    without any collective and load back bitwise. Returns this rank's
    outcome per case."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class FailingWriter(FileSystemWriter):
        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            if rank == 1:
                raise RuntimeError("injected: rank 1 cannot set up its storage writer")
            super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    state = make_state(0)
    out: dict[str, str] = {}
    for name, cls in (("default", None), ("balanced", BalancedSavePlanner)):

        def planner(fail: bool = False, cls: Any = cls) -> Any:
            if cls is None:
                from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

                cls = DefaultSavePlanner
            if not fail or rank != 1:
                return cls()

            def create_local_plan(self: Any) -> Any:
                raise RuntimeError("injected: rank 1 fails in create_local_plan")

            return type("Failing", (cls,), {"create_local_plan": create_local_plan})()

        d = root / f"{name}-writer"
        out[f"{name}-writer"] = _outcome(
            lambda d=d: dcp_save(state, storage_writer=FailingWriter(str(d)), planner=planner())
        )
        d = root / f"{name}-plan"
        out[f"{name}-plan"] = _outcome(
            lambda d=d: dcp_save(state, checkpoint_id=str(d), planner=planner(fail=True))
        )
        for case in ("writer", "plan"):
            if (root / f"{name}-{case}" / ".metadata").exists():
                out[f"{name}-{case}"] += "-committed"
        d = root / f"{name}-alone"
        if rank == 0:
            out[f"{name}-alone"] = _outcome(
                lambda d=d: dcp_save(state, checkpoint_id=str(d), planner=planner(), no_dist=True)
            )
            if out[f"{name}-alone"] == "ok":
                target = make_state(1)
                dcp_load(target, checkpoint_id=str(d), no_dist=True)
                if same(state, target):
                    out[f"{name}-alone"] += "-differs"
        dist.barrier()
    return out


def main() -> int:
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, Any] = {"rank": rank, "world": world}
    for op in sys.argv[1:]:
        mode, path = op.split(":", 1)
        if mode == "save":
            planner = BalancedSavePlanner(cost=COST)
            dcp_save(make_state(0), checkpoint_id=path, planner=planner)
            assert planner.deeppart_plan is not None
            result[f"save:{path}"] = {
                "source": planner.deeppart_plan.stats.source,
                "items": len(planner.plan.items),
            }
        elif mode == "savemoe":
            planner = BalancedSavePlanner(cost=BYTES_COST)
            dcp_save(make_moe_state(0), checkpoint_id=path, planner=planner)
            result[f"save:{path}"] = {"items": len(planner.plan.items)}
        elif mode == "loadmoe":
            target = make_moe_state(1)
            assert same(target, make_moe_state(0)), "the load target must differ"
            dcp_load(target, checkpoint_id=path, no_dist=world == 1)
            result[f"load:{path}"] = same(make_moe_state(0), target)
        elif mode == "savedt":
            # With a DTensor sharded over the ranks: each rank's shard is an
            # owned leaf of the plan.
            planner = BalancedSavePlanner(cost=COST)
            dcp_save(with_dtensor(make_state(0), world, 0), checkpoint_id=path, planner=planner)
            result[f"save:{path}"] = {"items": len(planner.plan.items)}
        elif mode == "loaddt":
            target = with_dtensor(make_state(1), world, 1)
            dcp_load(target, checkpoint_id=path, no_dist=world == 1)
            dt = target.pop("dt")
            full = dt.full_tensor() if world > 1 else dt
            diff = same(make_state(0), target)
            if not torch.equal(full, dtensor_value(0)):
                diff.append(".dt")
            result[f"load:{path}"] = diff
        elif mode == "load":
            target = make_state(1)
            assert same(target, make_state(0)), "the load target must differ from the reference"
            dcp_load(target, checkpoint_id=path, no_dist=world == 1)
            result[f"load:{path}"] = same(make_state(0), target)
        elif mode == "failures":
            result["failures"] = failures(Path(path), world, rank)
        else:
            raise SystemExit(f"unknown op {op!r}")
    print_line("RESULT " + json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
