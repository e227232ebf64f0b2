"""Asynchronous saves: DeepPart's ``Checkpointer(async_=True)`` against
DCP's ``async_save`` (a writer thread, and a writer process), on 1, 2 and 4
ranks, in one run.

    .venv/bin/python bench/async.py                    # default --scale 0.09 (~0.36 GB)
    .venv/bin/python bench/async.py --ranks 4 --repeat 5

For each contender and rank count it measures, per rank:

- **stall**: the time the call blocks the training loop (from the call to
  its return: DeepPart plans and copies the rank's share to host memory;
  DCP stages the whole state dict), the slowest rank's;
- **extra host memory**: the process's peak resident memory during the
  saves (``VmHWM``, reset after the state is built) minus its resident
  memory before them, the largest over the ranks, as a fraction of the state
  (for DCP's process-based writer, the writer process's own peak is
  reported apart: it is not in the rank's ``VmHWM``);
- **step time during the save**: the median time of a small CPU training
  step (an MLP's forward and backward) run while the save is in flight,
  over the median of the same step with no save in flight, measured in the
  same job.

The state is bench/checkpoint.py's (BERT-large-shaped model + AdamW moments,
random float32, replicated on every rank). Every contender runs in its own
job (``mpiexec -n K``; gloo initialised for DCP), so that one's allocations
do not count against another's memory; a job makes one untimed save first
(it counts for memory: buffers are allocated then) and then ``--saves``
timed ones, waiting for each before the next (the stall is their median).
Each contender keeps its staging buffers from one save to the next
(DeepPart: a Checkpointer; DCP: one ``DefaultStager`` for all saves, whose
``StateDictStager`` caches its storages; pinned memory only with CUDA, shared
memory for the writer process). DCP's asynchronous staging
(``use_async_staging``) is left off: it returns before the copy is made, so
the training loop must wait for it before the next optimizer step anyway.
With ``--repeat R`` the jobs run in R rounds, each round every contender
once, in a new order; the report gives, per rank count, the median of each
measure over the rounds and the median over the rounds of the ratios
measured within one round (DeepPart's stall over DCP's). Saves fsync.
Before the saves every job runs ``gc.collect(); gc.freeze()`` (untimed): a
full collection of the objects that importing torch makes took over a
second here under load, and it falls due in whichever call allocates at
that moment (a long-running training job freezes them too).

The timings are noisy on a shared machine (CPUs and disk shared with other
jobs): read the within-round ratios, and rerun on a quiet machine for
absolute numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
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

from bench.jobs import job_result, mpi_env, start_worker  # noqa: E402

CONTENDERS = ("deeppart", "dcp-thread", "dcp-process")

#: Training steps measured with no save in flight, and at most per save.
BASELINE_STEPS = 15
MAX_STEPS = 400


def _status_kb(field: str, pid: str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Resets this process's peak resident memory (VmHWM) to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _children_peak_bytes() -> int:
    """The peak resident memory of this process's child processes (DCP's
    writer process), summed."""
    me, total = str(os.getpid()), 0
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            # Fields after the command name (in parentheses): state, ppid, ...
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[1] == me:
                total += _status_kb("VmHWM", proc.name) * 1024
    return total


def _training_step() -> Callable[[], float]:
    """A small CPU training step (an MLP's forward and backward, one
    thread); returns a function that runs one and returns its seconds."""
    import torch

    gen = torch.Generator().manual_seed(1)
    w1 = torch.randn(512, 512, generator=gen, requires_grad=True)
    w2 = torch.randn(512, 64, generator=gen, requires_grad=True)
    x = torch.randn(256, 512, generator=gen)

    def step() -> float:
        t0 = time.perf_counter()
        loss = (torch.tanh(x @ w1) @ w2).pow(2).mean()
        torch.autograd.backward(loss)
        with torch.no_grad():
            w1.sub_(1e-6 * w1.grad)  # type: ignore[operator]
            w2.sub_(1e-6 * w2.grad)  # type: ignore[operator]
        w1.grad = w2.grad = None
        return time.perf_counter() - t0

    return step


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    import deeppart

    size = MPI.COMM_WORLD.Get_size()
    job = start_worker(
        args.scale,
        args.dir,
        f"{args.contender}-n{size}",
        bcast_bytes=16 << 20,
        reduce_floats=4 << 20,
    )
    comm, rank, state, total, base = job.comm, job.rank, job.state, job.total, job.base
    step = _training_step()
    for _ in range(3):
        step()
    baseline = float(np.median([step() for _ in range(BASELINE_STEPS)]))

    kind = args.contender
    cp = deeppart.Checkpointer(base, comm=comm, async_=True, keep_last=1)
    process = kind == "dcp-process"
    writer_type = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    # One stager for all saves: it keeps its staging storages (as a
    # Checkpointer keeps its buffers); shared memory for the writer process.
    cuda = torch.cuda.is_available()
    stager = DefaultStager(StagingOptions(cuda, process, False, False))

    def start(i: int) -> Any:
        if kind == "deeppart":
            return cp.save(i, state)
        writer = FileSystemWriter(str(base / f"dcp-{i}"), sync_files=True)
        return async_save(
            state, storage_writer=writer, async_checkpointer_type=writer_type, async_stager=stager
        )

    def done(handle: Any) -> bool:
        return bool(handle.done())

    def wait(handle: Any) -> None:
        if kind == "deeppart":
            handle.wait()
        else:
            handle.result()

    # Python's cyclic collector: the hundreds of thousands of objects that
    # importing torch (and DCP) makes would be traversed by every full
    # collection (over a second here under load), which falls due inside
    # whichever call happens to allocate at that moment, for any contender.
    # A long-running training job freezes them, as done here for all.
    gc.collect()
    gc.freeze()
    comm.Barrier()
    rss0 = _status_kb("VmRSS") * 1024
    _reset_peak()
    stalls: list[float] = []
    during: list[float] = []
    staged = 0
    for i in range(args.saves + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        handle = start(i)
        stall = time.perf_counter() - t0
        steps = 0
        while not done(handle) and steps < MAX_STEPS:
            dt = step()
            if i:
                during.append(dt)
            steps += 1
        wait(handle)
        if kind == "deeppart":
            staged = handle.staged_bytes
        comm.Barrier()
        if i:
            stalls.append(stall)
        if rank == 0 and kind != "deeppart" and i >= 1:
            shutil.rmtree(base / f"dcp-{i - 1}", ignore_errors=True)
    peak = _status_kb("VmHWM") * 1024
    child_peak = _children_peak_bytes()
    verified = True
    if kind == "deeppart":
        latest = cp.latest()
        assert latest is not None
        out = deeppart.load(cp.path(latest), comm=comm)
        verified = all(torch.equal(out["model"][k], v) for k, v in state["model"].items())
    cp.close()
    stager.close()
    row = np.array(
        [
            *stalls,
            float(peak - rss0),
            float(child_peak),
            float(np.median(during)) if during else float("nan"),
            baseline,
            float(len(during)),
            float(staged),
            float(verified),
        ],
        dtype=np.float64,
    )
    rows = np.array(comm.allgather(row))
    if rank == 0:
        k = len(stalls)
        result = {
            "contender": kind,
            "ranks": size,
            "bytes": total,
            # The slowest rank's stall, per timed save.
            "stalls": [float(x) for x in rows[:, :k].max(axis=0)],
            "extra_bytes": float(rows[:, k].max()),
            "child_peak_bytes": float(rows[:, k + 1].max()),
            "step_during": float(np.nanmedian(rows[:, k + 2])),
            "step_baseline": float(np.median(rows[:, k + 3])),
            "steps_during": int(rows[:, k + 4].min()),
            "staged_bytes": float(rows[:, k + 5].max()),
            "verified": bool(rows[:, k + 6].min() > 0),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _run(contender: str, n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [
        str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker",
        "--contender", contender, "--scale", str(args.scale), "--dir", str(work),
        "--saves", str(args.saves),
    ]  # fmt: skip
    result = job_result(cmd, mpi_env())
    subprocess.run(["rm", "-rf", str(work / f"{contender}-n{n}")], check=False)
    return result


def _summary(r: dict[str, Any]) -> dict[str, float]:
    """One job's measures: median stall, extra memory as a fraction of the
    state, step time during the save over without."""
    return {
        "stall": float(np.median(r["stalls"])),
        "memory": r["extra_bytes"] / r["bytes"],
        "child": r["child_peak_bytes"] / r["bytes"],
        "steps": r["step_during"] / r["step_baseline"],
    }


def report(rounds: list[dict[tuple[str, int], dict[str, Any]]], contenders: list[str]) -> None:
    any_job = next(iter(rounds[0].values()))
    gb = any_job["bytes"] / 1e9
    ranks = sorted({n for _, n in rounds[0]})
    print(
        f"\nstate: BERT-large-shaped model + AdamW, {gb:.2f} GB float32, replicated; "
        f"{os.cpu_count()} CPUs; {len(rounds)} round(s); medians over the rounds; "
        "timings on a shared machine are noisy"
    )
    print(
        f"\n{'ranks':>5}  {'contender':<12} {'stall s':>8} {'extra mem':>10} "
        f"{'writer proc':>11} {'step during/without':>20}"
    )
    for n in ranks:
        for c in contenders:
            s = [_summary(rd[(c, n)]) for rd in rounds]
            child = float(np.median([x["child"] for x in s]))
            print(
                f"{n:>5}  {c:<12} {np.median([x['stall'] for x in s]):8.3f} "
                f"{np.median([x['memory'] for x in s]):9.2f}x "
                f"{(f'{child:10.2f}x' if child else '          -'):>11} "
                f"{np.median([x['steps'] for x in s]):19.2f}x"
            )
    if "deeppart" not in contenders:
        return
    print(
        "\nDeepPart's stall over DCP's (within-round ratio, median over the rounds; "
        "<1: DeepPart stalls less)"
    )
    for n in ranks:
        cells = []
        for c in contenders:
            if c == "deeppart":
                continue
            ratios = [
                _summary(rd[("deeppart", n)])["stall"] / _summary(rd[(c, n)])["stall"]
                for rd in rounds
            ]
            cells.append(f"deeppart/{c} {np.median(ratios):5.2f}")
        mem = np.median([_summary(rd[("deeppart", n)])["memory"] for rd in rounds])
        staged = rounds[0][("deeppart", n)]["staged_bytes"] / any_job["bytes"]
        ok = all(rd[("deeppart", n)]["verified"] for rd in rounds)
        print(
            f"  {n} rank(s): " + "  ".join(cells) + f"  deeppart extra memory {mem:.2f}x state "
            f"(staged share {staged:.2f}x)  loads back equal: {ok}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scale", type=float, default=0.09, help="fraction of BERT-large (0.09)")
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    p.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"default {','.join(CONTENDERS)}"
    )
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--saves", type=int, default=3, help="timed saves per job (default 3)")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--contender", default="deeppart", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    work = Path(args.dir or tempfile.mkdtemp(prefix="deeppart-async-"))
    rounds: list[dict[tuple[str, int], dict[str, Any]]] = []
    try:
        for round_ in range(args.repeat):
            jobs: dict[tuple[str, int], dict[str, Any]] = {}
            for n in (int(x) for x in args.ranks.split(",")):
                order = np.random.default_rng(round_ * 7 + n).permutation(len(contenders))
                for c in (contenders[i] for i in order):
                    jobs[(c, n)] = r = _run(c, n, args, work)
                    print(
                        f"[bench] round {round_} n={n} {c:<12} stall "
                        f"{np.median(r['stalls']):.3f} s, extra memory "
                        f"{r['extra_bytes'] / r['bytes']:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
            rounds.append(jobs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(rounds, contenders)
    if args.json:
        out = [{f"{c} n{n}": r for (c, n), r in rd.items()} for rd in rounds]
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
