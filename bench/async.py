"""Asynchronous saves as a training loop feels them: DeepPart's
``Checkpointer(async_=True)`` against DCP's ``async_save`` (a writer thread,
and a writer process) and Meta's torch_checkpointing (``CheckpointManager``
with its asynchronous saver: a writer subprocess per rank), on 1, 2 and 4
ranks, in one run.

    .venv/bin/python bench/async.py                    # default --scale 0.09 (~0.36 GB)
    .venv/bin/python bench/async.py --ranks 4 --repeat 5
    pip install -r requirements/bench.txt              # torch_checkpointing

For each contender and rank count it measures, per save:

- **overhead**: what one checkpoint costs the training loop: the stall
  plus the extra time of the training steps that follow the call (at least
  ``--steps``, and more until the save is done, so that the whole
  background write overlaps them), against the time per step of
  ``--steps`` steps run right before the call with no save in flight; per
  rank, the mean over the ranks;
- **stall**: the time the call blocks the training loop (from the call to
  its return: DeepPart plans and copies the rank's share to host memory;
  DCP stages the whole state dict; torch_checkpointing returns at once
  and stages in the background, so its stall runs until ``manager.lock()``
  lets the loop change the state again, as its tutorial's loop does
  before ``optimizer.step()``), the slowest rank's;
- **durable**: from the call until the save is done (committed, fsynced),
  the last rank's: seen between steps, or waited for after them;
- **cpu**: the CPU seconds of the rank's process and its child processes
  (a writer process) from the call until the save was waited for, less
  those of the reference steps (per step, times the steps that ran: a save
  that stays in flight longer runs more steps): the save's CPU cost, which on a busy
  machine is taken from training (less noisy than the times when other
  jobs share the machine);
- **extra host memory**: the process's peak resident memory during the
  saves (``VmHWM``, reset after the state is built) minus its resident
  memory before them, the largest over the ranks, as a fraction of the state
  (a writer process's own peak is reported apart: it is not in the rank's
  ``VmHWM``);
- **step during/without**: the median time of a training step run while
  the save is in flight, over the median of the same step with no save in
  flight, measured in the same job.

The training step is a small CPU MLP's forward and backward (one thread
per rank). The state is bench/checkpoint.py's (BERT-large-shaped model +
AdamW moments, random float32, replicated on every rank). Every contender
runs in its own job (``mpiexec -n K``; gloo initialised for DCP and
torch_checkpointing), so that one's allocations do not count against
another's memory; a job makes one untimed save first (it counts for
memory: buffers are allocated then) and then ``--saves`` timed ones,
waiting for each before the next (each measure is their median). Each
contender keeps its staging buffers from one save to the next (DeepPart: a
Checkpointer; DCP: one ``DefaultStager`` for all saves, whose
``StateDictStager`` caches its storages; torch_checkpointing: one
manager). Pinned memory only with CUDA: on a CPU-only host
torch_checkpointing is configured with ``use_pinned_memory`` and
``use_non_blocking_copy`` off, as its docs/troubleshooting.md says ("Save
fails on a CPU-only host"); nothing else of it needs CUDA here (its
metadata all-gather, which makes CUDA tensors, runs only for items with a
resharder, and the bench declares none). DCP's asynchronous staging
(``use_async_staging``) is left off: it returns before the copy is made, so
the training loop must wait for it before the next optimizer step anyway.
With ``--repeat R`` the jobs run in R rounds, each round every contender
once, in a new order; the report gives, per rank count, the median of each
measure over the rounds and the median over the rounds of the ratios
measured within one round (DeepPart's over each other contender's). Saves
fsync. Before the saves every job runs ``gc.collect(); gc.freeze()``
(untimed): a full collection of the objects that importing torch makes
took over a second here under load, and it falls due in whichever call
allocates at that moment (a long-running training job freezes them too).
A contender that cannot run (not installed, or its job fails) is named
with the reason in the report, with no numbers.

The timings are noisy on a shared machine (CPUs and disk shared with other
jobs): read the within-round ratios and the CPU seconds, and rerun on a
quiet machine for absolute numbers; the report states the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
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

CONTENDERS = ("deeppart", "dcp-thread", "dcp-process", "torch-checkpointing")

#: Training steps measured with no save in flight (the step time without).
BASELINE_STEPS = 15
#: Training steps run before each save call without a save (the reference)
#: and at least as many after it, more while the save is in flight (up to
#: MAX_STEPS_FACTOR times as many): their extra time is part of the save's
#: overhead, so all of the background write's interference is counted.
DEFAULT_STEPS = 150
MAX_STEPS_FACTOR = 40


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


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process and of its live child
    processes (DCP's or torch_checkpointing's writer process)."""
    me, total = str(os.getpid()), time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[1] == me:
                total += (int(fields[11]) + int(fields[12])) / tick
    return total


def tc_manager(cuda: bool) -> Any:
    """torch_checkpointing's asynchronous CheckpointManager. On a host
    without CUDA its staging must not pin memory nor copy non-blocking (its
    docs/troubleshooting.md, "Save fails on a CPU-only host"); its writer
    is a subprocess started with spawn; every rank writes its whole state
    dict (no deduplication without a resharder)."""
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.checkpoint_process import CheckpointProcessConfig
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    staging = CheckpointStagerConfig(use_pinned_memory=cuda, use_non_blocking_copy=cuda)
    # Its writer subprocess (spawn, importing torch) may take over its 30 s
    # default to start when the machine is busy.
    process = CheckpointProcessConfig(subprocess_init_timeout_secs=300)
    config = CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(staging_config=staging, process_config=process),
        # Its default opens data files with O_DIRECT and torch.save()s into
        # them through a buffered file: the last, unaligned flush fails with
        # EINVAL on this ext4 (v0.1.1, filesystem.py's WriteStream.close).
        # Without O_DIRECT it writes through the page cache and never
        # fsyncs: its "durable" is then "in the page cache".
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
    )
    return CheckpointManager(config)


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
    from deeppart.saving.prepare import last_proof

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
    manager = tc_manager(cuda) if kind == "torch-checkpointing" else None

    def start(i: int) -> Any:
        if kind == "deeppart":
            return cp.save(i, state)
        if manager is not None:
            future = manager.save(str(base / f"tc-{i}"), state)
            # Its staging runs on after save() returns: the training loop
            # may not change the state (optimizer.step) until it is done,
            # which manager.lock() waits for (its tutorial's loop). That
            # wait is part of the stall.
            with manager.lock():
                pass
            return future
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

    def run_steps(
        n: int, handle: Any = None, t0: float = 0.0
    ) -> tuple[float, int, list[float], float]:
        """At least ``n`` training steps, and with ``handle`` as many more
        as its save stays in flight (at most ``MAX_STEPS_FACTOR * n``):
        their total seconds, their count, the times of those that ran while
        the save was in flight, and the seconds from ``t0`` until it was
        seen done (nan if not within the steps)."""
        during: list[float] = []
        durable = float("nan")
        count = 0
        begin = time.perf_counter()
        while count < n or (handle is not None and durable != durable):
            if count >= MAX_STEPS_FACTOR * n:
                break
            dt = step()
            count += 1
            if handle is not None and durable != durable:
                if done(handle):
                    durable = time.perf_counter() - t0
                else:
                    during.append(dt)
        return time.perf_counter() - begin, count, during, durable

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
    overheads: list[float] = []
    durables: list[float] = []
    during: list[float] = []
    cpu_writer: list[float] = []
    # Per timed save: the seconds of the replica proof (whole-tensor digests
    # of the shared tensors) inside the stall (deeppart.saving.prepare.last_proof:
    # the small tensors), on the writer thread (the large ones,
    # deeppart.saving.deferred_proof), and the seconds the loop's optimizer
    # steps waited for the latter (part of the overhead).
    proofs: list[float] = []
    deferred: list[float] = []
    held: list[float] = []
    staged = 0
    for i in range(args.saves + 1):
        # The same steps without a save, right before: the reference.
        comm.Barrier()
        cpu_ref = _cpu_seconds()
        reference, _, _, _ = run_steps(args.steps)
        cpu_ref = _cpu_seconds() - cpu_ref
        comm.Barrier()
        cpu0 = _cpu_seconds()
        t0 = time.perf_counter()
        handle = start(i)
        stall = time.perf_counter() - t0
        with_save, count, in_flight, durable = run_steps(args.steps, handle, t0)
        wait(handle)
        if durable != durable:  # still in flight after the steps
            durable = time.perf_counter() - t0
        # Less the reference's CPU per step for as many steps as ran with
        # the save (more than the reference's while it stayed in flight).
        cpu = _cpu_seconds() - cpu0 - cpu_ref * count / args.steps
        proof = last_proof.seconds if kind == "deeppart" else 0.0
        pending = handle.proof if kind == "deeppart" else None
        proof_later = pending.seconds if pending is not None else 0.0
        proof_held = pending.held_seconds if pending is not None else 0.0
        if kind == "deeppart":
            staged = handle.staged_bytes
        comm.Barrier()
        if i:
            stalls.append(stall)
            # The reference per step, for as many steps as ran with the save.
            overheads.append(stall + with_save - reference * count / args.steps)
            durables.append(durable)
            during.extend(in_flight)
            cpu_writer.append(cpu)
            proofs.append(proof)
            deferred.append(proof_later)
            held.append(proof_held)
        if rank == 0 and kind != "deeppart" and i >= 1:
            prefix = "tc" if manager is not None else "dcp"
            shutil.rmtree(base / f"{prefix}-{i - 1}", ignore_errors=True)
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
    if manager is not None:
        manager.close()
    k = len(stalls)
    row = np.array(
        [
            *stalls,
            *overheads,
            *durables,
            *cpu_writer,
            *proofs,
            *deferred,
            *held,
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
        tail = 7 * k
        result = {
            "contender": kind,
            "ranks": size,
            "bytes": total,
            "steps": args.steps,
            # The slowest rank's stall, per timed save.
            "stalls": [float(x) for x in rows[:, :k].max(axis=0)],
            # Per timed save, the mean over the ranks of a rank's overhead.
            "overheads": [float(x) for x in rows[:, k : 2 * k].mean(axis=0)],
            # Per timed save, the last rank's time until the save was done.
            "durables": [float(x) for x in rows[:, 2 * k : 3 * k].max(axis=0)],
            # Per timed save, the CPU seconds of a rank's process and its
            # children (a writer process) from the call until the save was
            # waited for, less those of the reference steps (mean over the
            # ranks): the save's CPU cost.
            "cpu": [float(x) for x in rows[:, 3 * k : 4 * k].mean(axis=0)],
            # Per timed save, the slowest rank's replica proof (in its stall).
            "proofs": [float(x) for x in rows[:, 4 * k : 5 * k].max(axis=0)],
            # Per timed save, the slowest rank's proof on its writer thread,
            # and the longest an optimizer step waited for it.
            "proofs_later": [float(x) for x in rows[:, 5 * k : 6 * k].max(axis=0)],
            "proofs_held": [float(x) for x in rows[:, 6 * k : 7 * k].max(axis=0)],
            "extra_bytes": float(rows[:, tail].max()),
            "child_peak_bytes": float(rows[:, tail + 1].max()),
            "step_during": float(np.nanmedian(rows[:, tail + 2])),
            "step_baseline": float(np.median(rows[:, tail + 3])),
            "steps_during": int(rows[:, tail + 4].min()),
            "staged_bytes": float(rows[:, tail + 5].max()),
            "verified": bool(rows[:, tail + 6].min() > 0),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def _run(contender: str, n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [
        str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker",
        "--contender", contender, "--scale", str(args.scale), "--dir", str(work),
        "--saves", str(args.saves), "--steps", str(args.steps),
    ]  # fmt: skip
    result = job_result(cmd, mpi_env())
    subprocess.run(["rm", "-rf", str(work / f"{contender}-n{n}")], check=False)
    return result


def _summary(r: dict[str, Any]) -> dict[str, float]:
    """One job's measures: median stall, overhead, time until durable and
    CPU seconds per save; extra memory as a fraction of the state; step
    time during the save over without."""
    return {
        "stall": float(np.median(r["stalls"])),
        "overhead": float(np.median(r["overheads"])),
        "durable": float(np.median(r["durables"])),
        "cpu": float(np.median(r["cpu"])),
        "memory": r["extra_bytes"] / r["bytes"],
        "child": r["child_peak_bytes"] / r["bytes"],
        "steps": r["step_during"] / r["step_baseline"],
    }


def _median(rounds: list[dict[tuple[str, int], dict[str, Any]]], c: str, n: int, key: str) -> float:
    return float(np.median([_summary(rd[(c, n)])[key] for rd in rounds]))


def report(
    rounds: list[dict[tuple[str, int], dict[str, Any]]],
    contenders: list[str],
    skipped: dict[str, str],
) -> None:
    any_job = next(iter(rounds[0].values()))
    gb = any_job["bytes"] / 1e9
    ranks = sorted({n for _, n in rounds[0]})
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(
        f"\nstate: BERT-large-shaped model + AdamW, {gb:.2f} GB float32, replicated; "
        f"{os.cpu_count()} CPUs; load average now {' '.join(load)}; {len(rounds)} round(s), "
        f"{any_job['steps']} training steps per save; medians over the rounds"
    )
    print(
        f"\n{'ranks':>5}  {'contender':<19} {'overhead s':>10} {'stall s':>8} {'durable s':>9} "
        f"{'cpu s':>6} {'extra mem':>9} {'writer proc':>11} {'step during/without':>19}"
    )
    for n in ranks:
        for c in contenders:
            child = _median(rounds, c, n, "child")
            print(
                f"{n:>5}  {c:<19} {_median(rounds, c, n, 'overhead'):10.3f} "
                f"{_median(rounds, c, n, 'stall'):8.3f} {_median(rounds, c, n, 'durable'):9.3f} "
                f"{_median(rounds, c, n, 'cpu'):6.2f} {_median(rounds, c, n, 'memory'):8.2f}x "
                f"{(f'{child:10.2f}x' if child else '-'):>11} "
                f"{_median(rounds, c, n, 'steps'):18.2f}x"
            )
    for c, why in skipped.items():
        print(f"  {c}: not measured: {why}")
    if "deeppart" not in contenders:
        return
    print(
        "\nDeepPart over each other contender, within-round ratios (median over the rounds; "
        "<1: DeepPart costs the training loop less)"
    )
    for n in ranks:
        for c in contenders:
            if c == "deeppart":
                continue
            cells = []
            for key in ("overhead", "stall"):
                ratios = [
                    _summary(rd[("deeppart", n)])[key] / _summary(rd[(c, n)])[key] for rd in rounds
                ]
                worst = max(ratios)
                cells.append(f"{key} {np.median(ratios):5.2f} (worst round {worst:.2f})")
            print(f"  {n} rank(s) vs {c:<19} " + "  ".join(cells))
        mem = _median(rounds, "deeppart", n, "memory")
        staged = rounds[0][("deeppart", n)]["staged_bytes"] / any_job["bytes"]
        ok = all(rd[("deeppart", n)]["verified"] for rd in rounds)
        jobs = [rd[("deeppart", n)] for rd in rounds]
        proof = [float(np.median(j["proofs"])) for j in jobs]
        share = [float(np.median(np.array(j["proofs"]) / np.array(j["stalls"]))) for j in jobs]
        later = [float(np.median(j["proofs_later"])) for j in jobs]
        waited = [float(np.median(j["proofs_held"])) for j in jobs]
        print(
            f"  {n} rank(s): deeppart replica proof (whole-tensor digests): in the stall "
            f"{np.median(proof):.4f} s = {100 * np.median(share):.1f} % of the stall; "
            f"on the writer thread {np.median(later):.4f} s, optimizer steps waited "
            f"{np.median(waited):.4f} s"
        )
        print(
            f"  {n} rank(s): deeppart extra memory {mem:.2f}x state (staged share "
            f"{staged:.2f}x), step during/without "
            f"{_median(rounds, 'deeppart', n, 'steps'):.2f}x, loads back equal: {ok}"
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
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"training steps after each save call, in its overhead (default {DEFAULT_STEPS})",
    )
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
    # A contender that cannot run here is named with the reason, never given
    # numbers: not installed, or its job failed (its error is on stderr).
    skipped: dict[str, str] = {}
    if (
        "torch-checkpointing" in contenders
        and importlib.util.find_spec("torch_checkpointing") is None
    ):
        skipped["torch-checkpointing"] = (
            "torch_checkpointing is not installed (pip install -r requirements/bench.txt)"
        )
    work = Path(args.dir or tempfile.mkdtemp(prefix="deeppart-async-"))
    rounds: list[dict[tuple[str, int], dict[str, Any]]] = []
    try:
        for round_ in range(args.repeat):
            jobs: dict[tuple[str, int], dict[str, Any]] = {}
            for n in (int(x) for x in args.ranks.split(",")):
                order = np.random.default_rng(round_ * 7 + n).permutation(len(contenders))
                for c in (contenders[i] for i in order):
                    if c in skipped:
                        continue
                    try:
                        jobs[(c, n)] = r = _run(c, n, args, work)
                    except SystemExit as e:
                        if c == "deeppart":
                            raise
                        skipped[c] = f"its job failed ({e})"
                        continue
                    print(
                        f"[bench] round {round_} n={n} {c:<19} overhead "
                        f"{np.median(r['overheads']):.3f} s, stall {np.median(r['stalls']):.3f} s, "
                        f"durable {np.median(r['durables']):.3f} s, extra memory "
                        f"{r['extra_bytes'] / r['bytes']:.2f}x",
                        file=sys.stderr,
                        flush=True,
                    )
            rounds.append(jobs)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    measured = [c for c in contenders if c not in skipped]
    for rd in rounds:  # a contender that failed in a later round: dropped
        for key in [k for k in rd if k[0] not in measured]:
            del rd[key]
    report(rounds, measured, skipped)
    if args.json:
        out = [{f"{c} n{n}": r for (c, n), r in rd.items()} for rd in rounds]
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
