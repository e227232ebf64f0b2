"""DCP benchmark: stock ``torch.distributed.checkpoint.save`` against the same
call with ``planner=BalancedSavePlanner()``, on the same state and ranks.

    .venv/bin/python bench/dcp.py                       # BERT-base + AdamW, 4 ranks
    .venv/bin/python bench/dcp.py --model xlmr-large+adamw --ranks 4 --reps 1

It launches ``--ranks`` gloo ranks (CPU) on this machine. Each builds the same
state with random values: the model parameters of bench/models.py (layer
shapes of the Hugging Face model) and AdamW's ``exp_avg`` / ``exp_avg_sq`` /
``step`` plus its ``param_groups``, as ``{"model": ..., "optim": ...}``. The
ranks then save it alternately with the stock ``DefaultSavePlanner`` and with
``BalancedSavePlanner`` (``--reps`` times each, each to a fresh directory;
DeepPart's plan cache is emptied first, so the first balanced save plans and
the later ones hit the cache). Reported per save:

- max rank MB: the bytes of the slowest rank's files (``__{rank}_*.distcp``);
- save s: wall time of ``dcp.save`` from a barrier to the last rank's return;
- write s: of that, the time from ``finish_plan`` (the end of planning and
  of DCP's gather and scatter of plans) to the return;
- plan ms / cpu ms: the largest, over ranks, of the wall time and of the
  thread CPU time spent in the planner's ``create_local_plan`` +
  ``create_global_plan`` (the coordinator's global step included; DCP's
  gather and scatter are in "save s", not here). With 4 ranks on 2 shared
  cores the wall time includes waiting for a core; CPU time does not;
- gathered / scattered kB: the pickled local plans all ranks send to the
  coordinator, and the pickled plan the coordinator sends to rank 0.

All ranks write to one local disk through the page cache, and share 2 cores
on the development machine, so "save s" measures this machine, not a
parallel file system.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import jobs, models


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ----------------------------------------------------------------------------
# One rank.


def embedding_model() -> list[tuple[str, tuple[int, ...]]]:
    """A large-embedding model (recommender-like): a 1M x 128 float32 table
    (512 MB, with AdamW 1.5 GB of the 1.6 GB state) and a small MLP."""
    return [
        ("embedding.weight", (1_000_000, 128)),
        ("mlp.0.weight", (1024, 128)),
        ("mlp.0.bias", (1024,)),
        ("mlp.1.weight", (1024, 1024)),
        ("mlp.1.bias", (1024,)),
        ("mlp.2.weight", (1, 1024)),
        ("mlp.2.bias", (1,)),
    ]


def named_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    if model == EMBEDDING:
        return embedding_model()
    return list(models.named_shapes_of(models.MODELS[model]()))


EMBEDDING = "embedding+adamw"
CHOICES = [EMBEDDING, *models.MODELS]


def build_state(model: str) -> dict[str, Any]:
    """The model's state dict and its AdamW state after one step, random values."""
    import torch

    from bench.models import adamw_param_groups

    named = named_shapes(model)
    g = torch.Generator().manual_seed(0)
    params = {name: torch.rand(shape, generator=g) for name, shape in named}
    state: dict[int, dict[str, Any]] = {}
    for i, (_, shape) in enumerate(named):
        state[i] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.rand(shape, generator=g),
            "exp_avg_sq": torch.rand(shape, generator=g),
        }
    return {
        "model": params,
        "optim": {"state": state, "param_groups": adamw_param_groups(len(named))},
    }


def worker(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.state_dict_saver import save

    from deeppart.integrations.dcp import BalancedSavePlanner

    class Measuring(DefaultSavePlanner):
        """Measures a planner's CPU time in its two planning steps, the plans
        it sends (pickled, as DCP's gather and scatter do) and when it
        finished planning. With ``time_wall``, also the wall time of the
        planning steps as ``plan_seconds`` (BalancedSavePlanner keeps that
        itself)."""

        time_wall = False
        plan_seconds = 0.0
        plan_cpu = 0.0
        sent_bytes = 0
        scattered_bytes = 0
        finished_at = 0.0

        def create_local_plan(self) -> SavePlan:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = super().create_local_plan()
            if self.time_wall:
                self.plan_seconds = time.perf_counter() - t0
            self.plan_cpu = time.thread_time() - c0
            self.sent_bytes = len(pickle.dumps(out))
            return out

        def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
            t0, c0 = time.perf_counter(), time.thread_time()
            out = super().create_global_plan(all_plans)
            if self.time_wall:
                self.plan_seconds += time.perf_counter() - t0
            self.plan_cpu += time.thread_time() - c0
            self.scattered_bytes = len(pickle.dumps(out[0]))
            return out

        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            self.finished_at = time.perf_counter()
            return super().finish_plan(new_plan)

    class TimedDefault(Measuring):
        """The stock planner, measured."""

        time_wall = True

    class TimedBalanced(Measuring, BalancedSavePlanner):
        """BalancedSavePlanner, measured (it times its planning itself)."""

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build_state(args.model)
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for kind in ("stock", "balanced"):
            planner: TimedDefault | TimedBalanced = (
                TimedDefault() if kind == "stock" else TimedBalanced()
            )
            path = Path(args.dir) / f"{kind}-{rep}"
            gc.collect()  # no collection of the previous save's garbage in the timed region
            dist.barrier()
            t0 = time.perf_counter()
            save(state, checkpoint_id=str(path), planner=planner)
            end = time.perf_counter()
            dt = end - t0
            source = ""
            if isinstance(planner, BalancedSavePlanner) and planner.deeppart_plan is not None:
                source = planner.deeppart_plan.stats.source
            rows.append(
                {
                    "kind": kind,
                    "rep": rep,
                    "save_s": dt,
                    "write_s": end - planner.finished_at,
                    "plan_s": planner.plan_seconds,
                    "plan_cpu": planner.plan_cpu,
                    "source": source,
                    "path": str(path),
                    "sent": planner.sent_bytes,
                    "scattered": planner.scattered_bytes,
                }
            )
            dist.barrier()
            if rank == 0 and not args.keep:
                # Keep the page cache and disk from filling over the reps
                # (the file sizes are read first by the parent).
                sizes = rank_file_bytes(path, world)
                rows[-1]["rank_bytes"] = sizes
                shutil.rmtree(path)
            dist.barrier()
    print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()
    return 0


def rank_file_bytes(path: Path, world: int) -> list[int]:
    out = [0] * world
    for f in path.glob("__*_*.distcp"):
        out[int(f.name.split("_")[2])] += f.stat().st_size
    return out


# ----------------------------------------------------------------------------
# The launcher.


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=EMBEDDING, choices=CHOICES)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    import torch

    import deeppart

    tmp = tempfile.mkdtemp(prefix="deeppart-bench-dcp-")
    args.dir = args.dir or tmp
    cache_dir = Path(tmp) / "plan-cache"  # empty: the first balanced save plans
    m = models.adamw_manifest(named_shapes(args.model))
    print(
        f"deeppart {deeppart.PLANNER_VERSION}, torch {torch.__version__}; {args.model}: "
        f"{len(m)} leaves, {m.total_bytes / 1e6:.0f} MB; {args.ranks} gloo ranks on "
        f"{os.cpu_count()} CPUs, writing to {args.dir}",
        flush=True,
    )
    port = free_port()
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model]
    cmd += ["--reps", str(args.reps), "--dir", args.dir] + (["--keep"] if args.keep else [])
    procs = []
    t0 = time.perf_counter()
    for r in range(args.ranks):
        env = dict(
            os.environ,
            **jobs.BUFFERED,
            RANK=str(r),
            WORLD_SIZE=str(args.ranks),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DEEPPART_CACHE_DIR=str(cache_dir),
            OMP_NUM_THREADS="1",
        )
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    per_rank: list[list[dict[str, Any]]] = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=1800)
            if p.returncode != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
            line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
            per_rank.append(json.loads(line[len("RESULT ") :]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    wall = time.perf_counter() - t0
    if os.environ.get("DEEPPART_BENCH_DEBUG"):
        for r, pr in enumerate(per_rank):
            print(r, [(x["kind"], round(x["plan_cpu"] * 1e3, 1)) for x in pr])

    rows: list[dict[str, Any]] = []
    for i, row0 in enumerate(per_rank[0]):
        sizes = row0.get("rank_bytes") or rank_file_bytes(Path(row0["path"]), args.ranks)
        rows.append(
            {
                "kind": row0["kind"],
                "rep": row0["rep"],
                "max_mb": max(sizes) / 1e6,
                "total_mb": sum(sizes) / 1e6,
                "writers": sum(1 for s in sizes if s),
                "save_s": max(pr[i]["save_s"] for pr in per_rank),
                "write_s": max(pr[i]["write_s"] for pr in per_rank),
                "plan_ms": max(pr[i]["plan_s"] for pr in per_rank) * 1e3,
                "plan_cpu_ms": max(pr[i]["plan_cpu"] for pr in per_rank) * 1e3,
                # Where each rank's plan came from (rank 0's first).
                "source": "/".join(
                    dict.fromkeys(pr[i]["source"] for pr in per_rank if pr[i]["source"])
                ),
                "gathered_kb": sum(pr[i]["sent"] for pr in per_rank) / 1e3,
                "scattered_kb": row0["scattered"] / 1e3,
            }
        )
    print()
    print(
        f"{'planner':<9} {'rep':>3} | {'max rank MB':>11} {'total MB':>9} {'writers':>7} | "
        f"{'save s':>7} {'write s':>7} | {'plan ms':>8} {'cpu ms':>7} {'plan from':>15} | "
        f"{'gathered kB':>11} {'scattered kB':>12}"
    )
    for row in rows:
        print(
            f"{row['kind']:<9} {row['rep']:>3} | {row['max_mb']:>11.1f} {row['total_mb']:>9.1f} "
            f"{row['writers']:>7} | {row['save_s']:>7.2f} {row['write_s']:>7.2f} | "
            f"{row['plan_ms']:>8.1f} {row['plan_cpu_ms']:>7.1f} "
            f"{row['source'] or '-':>15} | {row['gathered_kb']:>11.1f} {row['scattered_kb']:>12.1f}"
        )
    print()
    for rep in range(args.reps):
        s = next(r for r in rows if r["kind"] == "stock" and r["rep"] == rep)
        b = next(r for r in rows if r["kind"] == "balanced" and r["rep"] == rep)
        print(
            f"rep {rep}: stock / balanced -- max rank bytes {s['max_mb'] / b['max_mb']:.2f}x, "
            f"save time {s['save_s'] / b['save_s']:.2f}x, planning time "
            f"{s['plan_ms'] / b['plan_ms']:.2f}x (CPU {s['plan_cpu_ms'] / b['plan_cpu_ms']:.2f}x; "
            f"plan {b['source']}), plans gathered "
            f"{s['gathered_kb'] / b['gathered_kb']:.0f}x, scattered "
            f"{s['scattered_kb'] / b['scattered_kb']:.0f}x"
        )
    print(f"(all ranks, {len(rows)} saves, {wall:.0f} s in all)")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
