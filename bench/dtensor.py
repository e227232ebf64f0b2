"""Sharded state (FSDP2, HSDP, TP): DCP's default, ``BalancedSavePlanner`` and
``deeppart.save`` on the same DTensor state, in one run.

    .venv/bin/python bench/dtensor.py              # reshard: HSDP (2,2) -> FSDP (1,4), 350 MB
    .venv/bin/python bench/dtensor.py --reps 5 --profile
    .venv/bin/python bench/dtensor.py --reps 1 --layouts hsdp ddp2d fsdp tp groups
    .venv/bin/python bench/dtensor.py --model transformer --layouts hsdp ddp2d fsdp

``--model transformer``: a small real transformer instead of the MLP (an
embedding, 3 ``nn.TransformerEncoderLayer`` and an output layer, 20 MB
with AdamW: many small leaves, biases and norms, beside a few larger ones),
FSDP2 layouts only.

It launches 4 torchrun ranks (gloo, CPU) of itself. The default layout,
``reshard``: a 29 M-parameter MLP + AdamW (350 MB) with FSDP2 on HSDP
(2,2), saved by ``dcp.save`` and ``deeppart.save``, each loaded into the
same model on FSDP (1,4) (``dcp.load``; ``deeppart.load(into=)``), checked
bitwise against the saved state; the contenders interleaved within each
round (the order rotated per round; one untimed warm-up round), and
reported as the median over rounds of each round's ratio to DCP;
``--profile`` prints rank 0's cProfile of DeepPart's saves and loads.

The other layouts (23 MB). For each layout (HSDP
(2,2), DDP in a 2-D mesh (4,1), FSDP (1,4), TP x DP (2,2) through
``parallelize_module``) it builds the model with real FSDP2 ``fully_shard``
or ``parallelize_module``, takes one AdamW step and saves
``get_state_dict(model, opt)`` (DTensors) ``--reps`` times (the ``groups`` layout: two
data-parallel groups, model A + AdamW on ranks {0,1} and B on {2,3}, plain
tensors, saved with ``group="auto"``) with each of:
``dcp.save`` (``DefaultSavePlanner``), ``dcp.save`` with
``deeppart.integrations.dcp.BalancedSavePlanner``, and ``deeppart.save``; then loads each
back into the same layout (``dcp.load``; ``deeppart.load(into=)``).
Reported per layout and method:

- slowest / ideal: the largest rank's data bytes over the state's unique
  bytes / ranks (DCP: the ``__R_*.distcp`` files; DeepPart: the pieces of
  each ``rank-R.bin``);
- save s, load s: the median wall time from a barrier to the last rank's
  return.

All ranks share one local disk through the page cache and 2 shared cores on
the development machine: the times are noisy and say little about a
parallel file system; the ratios are exact.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import jobs

LAYOUTS = ("hsdp", "ddp2d", "fsdp", "tp", "groups", "reshard")
#: The contenders of the ``reshard`` layout, in the order of round 0 (each
#: round rotates it by one). Meta's torch_checkpointing (PyPI
#: ``torch-checkpointing`` 0.1.1) cannot join on CPU: the save of a state
#: whose items have its DTensor resharder (needed to load at another mesh)
#: all-gathers its metadata sizes through a tensor it creates on
#: ``device="cuda"`` (metadata_manager.py), which fails without a GPU.
RESHARD_METHODS = ("dcp", "deeppart")
#: The MLP of the ``reshard`` layout: 29.2 M parameters, 350 MB with AdamW.
RESHARD_DIMS = (3000, 4860, 3000)
#: The MLP of the other layouts: 7.7 MB of parameters, 23 MB with AdamW.
DEFAULT_DIMS = (1000, 966, 1000)
#: Mesh shape of each FSDP2 layout, for ``n`` ranks.
MESHES: dict[str, Callable[[int], tuple[int, int]]] = {
    "hsdp": lambda n: (n // 2, 2),
    "hsdp24": lambda n: (2, n // 2),
    "ddp2d": lambda n: (n, 1),
    "fsdp": lambda n: (1, n),
}


def make_model(seed: int, dims: tuple[int, int, int] = (5, 30, 7)) -> Any:
    import torch

    torch.manual_seed(seed)
    a, b, c = dims
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c))


class TinyTransformer:
    """``--model transformer``: vocabulary 2000, width 160, 3 encoder layers
    (4 heads, feed-forward 640), an output layer: 1.6 M parameters in 39
    tensors; 20 MB and 157 leaves with AdamW's two moments."""

    @staticmethod
    def make(seed: int) -> Any:
        import torch

        torch.manual_seed(seed)
        layers: list[Any] = [torch.nn.Embedding(2000, 160)]
        layers += [
            torch.nn.TransformerEncoderLayer(160, 4, 640, dropout=0.0, batch_first=True)
            for _ in range(3)
        ]
        layers.append(torch.nn.Linear(160, 2000))
        return torch.nn.Sequential(*layers)

    @staticmethod
    def batch(seed: int) -> Any:
        import torch

        return torch.randint(0, 2000, (4, 16), generator=torch.Generator().manual_seed(seed))


def build(
    layout: str, seed: int, dims: tuple[int, int, int] = (5, 30, 7), model: str = "mlp"
) -> tuple[Any, Any]:
    """A two-layer MLP (or ``model="transformer"``: :class:`TinyTransformer`)
    on ``layout`` after one AdamW step (the same input on every rank, so
    replicas stay equal): FSDP2 ``fully_shard`` on a (replicate, shard) mesh,
    or ``parallelize_module`` (colwise, rowwise) on the tp dimension of a
    (dp, tp) mesh (the MLP only)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    transformer = model == "transformer"
    if transformer and layout not in MESHES:
        raise SystemExit(f"--model transformer: FSDP2 layouts only ({', '.join(MESHES)})")
    m = TinyTransformer.make(seed) if transformer else make_model(seed, dims)
    n = dist.get_world_size()
    if layout in ("tp", "tpfsdp"):
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        if layout == "tpfsdp":
            # FSDP2 over TP (2-D): the colwise weights' rows are sharded
            # twice, which torch describes with _StridedShard.
            for layer in list(m.children())[::2]:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(m, mesh=mesh["dp"])
    else:
        shape = MESHES[layout](n)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        for layer in list(m.children()) if transformer else list(m.children())[::2]:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    torch.manual_seed(100 + seed)
    x = TinyTransformer.batch(100 + seed) if transformer else torch.randn(4, dims[0])
    m(x).square().sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def group_state(g: int, dims: tuple[int, int, int]) -> dict[str, Any]:
    """Model ``g`` of the "two DP groups" layout (0: A, 1: B, another seed)
    and its AdamW state after one step: plain tensors, the same on every
    rank of its group. Computed on one thread, so the values do not
    depend on the calling process's thread count (a job's ranks and a
    test's process compare them bitwise)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = make_model(10 + g, dims)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        torch.manual_seed(200 + g)
        m(torch.randn(4, dims[0])).square().sum().backward()
        opt.step()
    finally:
        torch.set_num_threads(threads)
    return {"model": m.state_dict(), "optim": opt.state_dict()}


def sharded_state(m: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd}


def deeppart_balance(path: Path) -> float:
    """The slowest rank's data bytes over the ideal (all data / ranks)."""
    meta = json.loads((path / "metadata.json").read_text())
    data = [0] * meta["world_size"]
    for row in meta["pieces"]:
        data[row[3]] += row[5]
    return float(max(data) / (meta["raw_bytes"] / len(data)))


def dcp_balance(path: Path, world: int) -> float:
    """The largest rank's DCP data (``__R_*.distcp``) over the mean."""
    per = [0] * world
    for p in path.glob("*.distcp"):
        per[int(p.name.split("_")[2])] += p.stat().st_size
    return max(per) / (sum(per) / world)


def _timed(fn: Any) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _save(method: str, state: Any, d: Path, group: str | None = None) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import deeppart
    from deeppart.integrations.dcp import BalancedSavePlanner

    if method == "deeppart":
        deeppart.save(state, d, group=group)
    elif method == "dcp-balanced":
        dcp_save(state, checkpoint_id=str(d), planner=BalancedSavePlanner())
    else:
        dcp_save(state, checkpoint_id=str(d))


def _load(method: str, state: Any, d: Path, group: str | None = None) -> None:
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    import deeppart

    if method == "deeppart":
        deeppart.load(d, into=state, group=group)
    else:
        dcp_load(state, checkpoint_id=str(d))


def _dtensors(state: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    import torch

    out: list[tuple[tuple[Any, ...], Any]] = []
    if isinstance(state, dict):
        for k, v in state.items():
            out += _dtensors(v, (*prefix, k))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out += _dtensors(v, (*prefix, i))
    elif isinstance(state, torch.Tensor):
        out.append((prefix, state))
    return out


def _clear(state: Any) -> None:
    """Every tensor of ``state`` (its local shards) set to NaN / -1, so a
    load that skips one is caught by :func:`_equal`."""
    import torch

    with torch.no_grad():
        for _, t in _dtensors(state):
            local = t.to_local() if hasattr(t, "to_local") else t
            local.fill_(float("nan") if local.is_floating_point() else -1)


def _equal(source: Any, target: Any) -> bool:
    """Whether every tensor of ``target`` (another mesh) holds, bitwise, the
    same global tensor as ``source`` (compared one tensor at a time)."""
    import torch

    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    src, dst = dict(_dtensors(source)), dict(_dtensors(target))
    if src.keys() != dst.keys():
        return False
    ok = True
    for path in sorted(src, key=str):
        a, b = full(src[path]), full(dst[path])
        ok = ok and a.shape == b.shape and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )
    return ok


_METHOD = {"dcp": "dcp-default", "deeppart": "deeppart"}


def reshard_rounds(args: argparse.Namespace, root: Path) -> None:
    """The ``reshard`` layout: HSDP (2,2) state saved by each contender and
    loaded into FSDP (1,4) DTensors; the contenders interleaved within each
    round (order rotated per round), every load checked bitwise; per round
    the ratio of each contender to ``dcp``, and the median of those ratios."""
    import cProfile
    import pstats

    import torch.distributed as dist

    rank = dist.get_rank()
    dims = tuple(args.dims) if tuple(args.dims) != DEFAULT_DIMS else RESHARD_DIMS
    src = sharded_state(*build("hsdp", seed=1, dims=dims))
    dst = sharded_state(*build("fsdp", seed=2, dims=dims))
    mb = sum(t.to_local().numel() * t.element_size() for _, t in _dtensors(src)
             if hasattr(t, "to_local")) * 2  # HSDP: each shard on 2 of the 4 ranks
    methods = list(RESHARD_METHODS)
    times: dict[str, dict[str, list[float]]] = {m: {"save": [], "load": []} for m in methods}
    exact: dict[str, bool] = dict.fromkeys(methods, True)
    prof = cProfile.Profile() if args.profile and rank == 0 else None
    for rnd in range(args.reps + 1):  # round 0 warms up, untimed in the figures
        order = methods[rnd % len(methods):] + methods[: rnd % len(methods)]
        for method in order:
            d = root / f"reshard-{method}-{rnd}"
            if prof is not None and method == "deeppart" and rnd > 0:
                prof.enable()
            ts = _timed(functools.partial(_save, _METHOD[method], src, d))
            if prof is not None:
                prof.disable()
            _clear(dst)
            dist.barrier()
            if prof is not None and method == "deeppart" and rnd > 0:
                prof.enable()
            tl = _timed(functools.partial(_load, _METHOD[method], dst, d))
            if prof is not None:
                prof.disable()
            exact[method] = exact[method] and _equal(src, dst)
            if rnd > 0:
                times[method]["save"].append(ts)
                times[method]["load"].append(tl)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(d, ignore_errors=True)
            dist.barrier()
    if rank != 0:
        return
    print(f"reshard: HSDP (2,2) -> FSDP (1,4), {mb / 1e6:.0f} MB of state, "
          f"{args.reps} rounds (+1 warm-up), load average {os.getloadavg()[0]:.1f}")
    print(f"{'method':22} {'save s':>8} {'load s':>8} {'save/dcp':>9} {'load/dcp':>9} bitwise")
    rows = {}
    for m in methods:
        ratios = {
            k: statistics.median(a / b for a, b in zip(times[m][k], times["dcp"][k], strict=True))
            for k in ("save", "load")
        }
        med = {k: statistics.median(times[m][k]) for k in ("save", "load")}
        rows[m] = {**{f"{k}_s": v for k, v in med.items()},
                   **{f"{k}_ratio": v for k, v in ratios.items()}, "bitwise": exact[m]}
        print(f"{m:22} {med['save']:8.3f} {med['load']:8.3f} {ratios['save']:9.2f} "
              f"{ratios['load']:9.2f} {'yes' if exact[m] else 'NO'}")
    print("JSON " + json.dumps([["reshard", rows]]))
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(args.dir)
    rows = []
    for layout in args.layouts:
        if layout == "reshard":
            reshard_rounds(args, root)
            continue
        group = None
        if layout == "groups":  # model A on ranks {0,1}, B on {2,3}: plain tensors
            g = rank * 2 // world
            state, group = {f"net{g}": group_state(g, tuple(args.dims))}, "auto"
        else:
            m, opt = build(layout, seed=1, dims=tuple(args.dims), model=args.model)
            state = sharded_state(m, opt)
        results: dict[str, dict[str, float]] = {}
        for method in ("dcp-default", "dcp-balanced", "deeppart"):
            saves, loads, balance = [], [], 0.0
            for rep in range(args.reps):
                d = root / f"{layout}-{method}-{rep}"

                saves.append(_timed(functools.partial(_save, method, state, d, group)))
                loads.append(_timed(functools.partial(_load, method, state, d, group)))
                balance = deeppart_balance(d) if method == "deeppart" else dcp_balance(d, world)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(d, ignore_errors=True)
            results[method] = {
                "balance": balance,
                "save_s": statistics.median(saves),
                "load_s": statistics.median(loads),
            }
        rows.append((layout, results))
    if rank == 0 and rows:
        print(f"{'layout':8} {'method':14} {'slowest/ideal':>13} {'save s':>8} {'load s':>8}")
        for layout, results in rows:
            for method, r in results.items():
                print(
                    f"{layout:8} {method:14} {r['balance']:13.3f} "
                    f"{r['save_s']:8.3f} {r['load_s']:8.3f}"
                )
        print("JSON " + json.dumps(rows))
    dist.destroy_process_group()


def sample_cost(scale: float, reps: int) -> None:
    """The sampled replica check's share of a save: one process, the state
    of bench/checkpoint.py (BERT-large + AdamW at ``scale``), the median
    over ``reps`` of ``prepare.replica_sample`` against ``deeppart.save``."""
    import deeppart
    from bench.jobs import build_state
    from deeppart.saving.prepare import replica_sample
    from deeppart.state.dtensor import expand
    from deeppart.state.state import flatten

    state = build_state(scale)
    leaves, skeleton = flatten(state)
    ex = expand(leaves, skeleton)
    samples, saves = [], []
    with tempfile.TemporaryDirectory(prefix="deeppart-bench-sample-") as tmp:
        for rep in range(reps):
            t0 = time.perf_counter()
            replica_sample(ex.leaves, ex.descs)
            samples.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            deeppart.save(state, Path(tmp) / f"c{rep}")
            saves.append(time.perf_counter() - t0)
    mb = sum(lf.tensor.numel() * lf.tensor.element_size() for lf in leaves if lf.tensor is not None)
    print(
        f"sampled replica check: {len(leaves)} leaves, {mb / 1e6:.0f} MB: "
        f"{statistics.median(samples) * 1e3:.2f} ms of a {statistics.median(saves):.3f} s save "
        f"({statistics.median(samples) / statistics.median(saves) * 100:.2f} %)"
    )


def finer_cost() -> Any:
    """``--plan-balance``'s finer cost model: pieces from 64 KiB, 1 µs each."""
    import deeppart

    return deeppart.CostModel(min_piece_bytes=64 << 10, piece_s=1e-6)


def transformer_plan_balance(ranks: int, cost: Any = None) -> tuple[float, list[int], float]:
    """The byte balance of ``deeppart.plan`` for the replicated
    :class:`TinyTransformer` state + AdamW (the DDP layout's state) at
    ``ranks``: slowest rank / ideal, each rank's bytes, the modelled gap."""
    import torch

    import deeppart

    m = TinyTransformer.make(1)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(TinyTransformer.batch(1)).square().sum().backward()
    opt.step()
    state = {"model": m.state_dict(), "optim": opt.state_dict()}
    manifest = deeppart.Manifest.from_state_dict(state)
    leaves = manifest.leaves()

    def element_bytes(leaf: dict[str, Any]) -> int:
        numel = 1
        for d in leaf.get("shape") or ():
            numel *= d
        return int(leaf["nbytes"]) // numel if leaf.get("shape") and numel else 1

    kwargs: dict[str, Any] = {} if cost is None else {"cost": cost}
    plan = deeppart.plan(manifest, world_size=ranks, cache=False, **kwargs)
    per = [
        sum((b - a) * element_bytes(leaves[leaf]) for leaf, a, b in plan.rank_pieces(r))
        for r in range(ranks)
    ]
    return max(per) / (sum(per) / ranks), per, plan.stats.gap


def plan_balance(ranks: int) -> None:
    """``--plan-balance``: :func:`transformer_plan_balance` with the default
    cost model and with :func:`finer_cost`, printed."""
    cases = (("default cost model", None), ("min_piece_bytes=64 KiB, piece_s=1 us", finer_cost()))
    for name, cost in cases:
        balance, per, gap = transformer_plan_balance(ranks, cost)
        print(
            f"{name}: slowest rank / ideal {balance:.3f} (bytes per rank {per}), "
            f"modelled gap {gap:.4f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--layouts", nargs="+", default=["reshard"], choices=LAYOUTS,
                    help="default: reshard (HSDP (2,2) -> FSDP (1,4), 350 MB); the "
                    "23 MB per-layout table: --layouts hsdp ddp2d fsdp tp groups")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--model", choices=["mlp", "transformer"], default="mlp",
        help="the DTensor layouts' model: the MLP of --dims (default) or a small real "
        "transformer (20 MB with AdamW; FSDP2 layouts: hsdp, ddp2d, fsdp)",
    )
    ap.add_argument(
        "--dims", type=int, nargs=3, default=list(DEFAULT_DIMS),
        help="the MLP's in, hidden, out sizes (default: 7.7 MB of float32 "
        "parameters, 23 MB with AdamW's two moments)",
    )
    ap.add_argument(
        "--sample-cost", type=float, metavar="SCALE", default=None,
        help="instead: the sampled replica check's cost against a one-process save of "
        "bench/checkpoint.py's state at SCALE (e.g. 0.1)",
    )
    ap.add_argument("--profile", action="store_true",
                    help="reshard: print rank 0's cProfile of deeppart.save + load")
    ap.add_argument(
        "--plan-balance", type=int, metavar="RANKS", default=None,
        help="instead: the byte balance of deeppart.plan for the replicated small transformer "
        "at RANKS ranks, default and finer cost model (one process, no save)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan_balance is not None:
        plan_balance(args.plan_balance)
        return 0
    if args.sample_cost is not None:
        sample_cost(args.sample_cost, args.reps)
        return 0
    if args.worker:
        worker(args)
        return 0
    with tempfile.TemporaryDirectory(prefix="deeppart-bench-dtensor-") as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
            "--standalone", str(Path(__file__).resolve()), "--worker", "--dir", tmp,
            "--reps", str(args.reps), "--dims", *map(str, args.dims), "--model", args.model,
            "--layouts", *args.layouts, *(["--profile"] if args.profile else []),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", **jobs.BUFFERED)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
        return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
