"""The CPU work of a replicated one-host load, against its ceiling: the
processor seconds (user + system, every thread) that all ranks together
spend in ``deeppart.load(..., into=state)`` (default ``exchange="auto"``)
and in "raw read all" (every rank reads every rank's raw file, unchecked:
bench/checkpoint.py's ceiling), per load.

    .venv/bin/python bench/load_work.py --ranks 4 --scale 0.05 --loads 12

On a machine shared with other work, wall-clock times say more about the
neighbours than about the load; the processor time a load spends is what
it costs whatever runs beside it (on fewer cores than ranks, as here, the
wall-clock time of a load is about its summed processor time over the
cores). Each contender runs ``--loads`` times, alternating; the report gives
the median over the loads of the ranks' summed seconds, and the page faults
(minor) per load. ``--stages`` adds where DeepPart's seconds go, per stage
of :func:`deeppart.load` (process time around each stage on each rank,
summed over the ranks; a collective's waiting counts where it waits).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.jobs import build_state, mpi_env  # noqa: E402

#: The stages of deeppart.loading.load.load timed with ``--stages``: the
#: names it calls, as imported there.
STAGES = (
    "hosts",  # before the host check went into the first agreement
    "open_checkpoint",
    "plan_reads",
    "agree",
    "shared_buffers",
    "read_share",
    "exchange_share",
    "assemble",
    "_load_stats",
)


def _cpu() -> tuple[float, int]:
    """Processor seconds (user + system) of this process so far, and its
    minor page faults."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _timed_stages(spent: dict[str, float]) -> None:
    """Wraps the stages of deeppart.loading.load.load to add their process
    time to ``spent``."""
    import contextlib

    import deeppart.loading.load as ck

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.process_time() - t0

        return timed

    def wrap_context(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @contextlib.contextmanager
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.process_time()
            cm = fn(*args, **kwargs)
            value = cm.__enter__()
            spent[name] = spent.get(name, 0.0) + time.process_time() - t0
            try:
                yield value
            finally:
                t1 = time.process_time()
                cm.__exit__(None, None, None)
                spent[name] += time.process_time() - t1

        return timed

    for name in STAGES:
        fn = getattr(ck, name, None)
        if fn is None:  # not a stage of this version
            continue
        setattr(ck, name, (wrap_context if name == "shared_buffers" else wrap)(name, fn))


def worker(args: argparse.Namespace) -> None:
    import torch
    from mpi4py import MPI

    import deeppart

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    state = build_state(args.scale)
    total = deeppart.Manifest.from_state_dict(state).total_bytes
    base = Path(args.dir)
    deeppart.save(state, base / "dp", comm=comm)
    n = total // size
    with open(base / f"raw-{rank}.bin", "wb") as f:
        f.write(np.ones(n, dtype=np.uint8).data)
    full = np.empty(n * size, dtype=np.uint8)
    comm.Barrier()

    def raw_read_all() -> None:
        for r in range(size):
            with open(base / f"raw-{r}.bin", "rb", buffering=0) as f:
                got = f.readinto(full[r * n : (r + 1) * n].data)
            assert got == n

    spent: dict[str, float] = {}
    contenders: list[tuple[str, Callable[[], Any]]] = [
        ("deeppart", lambda: deeppart.load(base / "dp", comm=comm, into=state)),
        ("raw read all", raw_read_all),
    ]
    for _, fn in contenders:  # warm-up: the kept window, the page cache
        fn()
    if args.stages:
        _timed_stages(spent)
    cpu: dict[str, list[float]] = {name: [] for name, _ in contenders}
    faults: dict[str, list[int]] = {name: [] for name, _ in contenders}
    wall: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for i in range(args.loads):
        for name, fn in contenders if i % 2 == 0 else contenders[::-1]:
            comm.Barrier()
            t0 = time.perf_counter()
            c0, f0 = _cpu()
            fn()
            c1, f1 = _cpu()
            comm.Barrier()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(comm.allreduce(c1 - c0))
            faults[name].append(comm.allreduce(f1 - f0))
    stages = {k: comm.allreduce(v) / args.loads for k, v in sorted(spent.items())}
    if rank == 0:
        out = {
            "ranks": size,
            "bytes": total,
            "cpu": {k: statistics.median(v) for k, v in cpu.items()},
            "faults": {k: statistics.median(v) for k, v in faults.items()},
            "wall": {k: statistics.median(v) for k, v in wall.items()},
            "stages": stages,
        }
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--scale", type=float, default=0.05)
    ap.add_argument("--loads", type=int, default=12)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--dir", default="")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="deeppart-loadwork-") as work:
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [
            str(mpiexec), "-n", str(args.ranks), sys.executable, str(Path(__file__).resolve()),
            "--worker", "--scale", str(args.scale), "--loads", str(args.loads), "--dir", work,
        ] + (["--stages"] if args.stages else [])  # fmt: skip
        proc = subprocess.run(cmd, env=mpi_env(), stdout=subprocess.PIPE, text=True, check=True)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    res = json.loads(line[len("RESULT ") :])
    dp, raw = res["cpu"]["deeppart"], res["cpu"]["raw read all"]
    print(
        f"{res['ranks']} ranks, {res['bytes'] / 1e6:.0f} MB, medians of {args.loads} loads, "
        f"processor seconds summed over the ranks:"
    )
    for name, secs in res["cpu"].items():
        print(
            f"  {name:<14} {secs:7.4f} s   {res['faults'][name]:8.0f} minor faults   "
            f"(wall-clock {res['wall'][name]:.4f} s)"
        )
    print(f"  raw read all / deeppart: {raw / dp:.2f}")
    for name, secs in res["stages"].items():
        print(f"    {name:<16} {secs:7.4f} s")


if __name__ == "__main__":
    main()
