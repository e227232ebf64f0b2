"""Multi-level checkpoint benchmark: ``.venv/bin/python bench/levels.py``.

Launches ``mpiexec -n 4`` itself: 4 ranks as 2 fake nodes (``local_test =
1``, ``node_size = 2``, ``group_size = 2``), the built-in engine
(docs/LEVELS.md). The state is float32 tensors of ``--mb`` MB in all
(random values, replicated on every rank). For each level L1..L4:

- checkpoint: ``save(step, state, level=L)``, fsynced and committed;
- recovery: ``load(into=state)`` served by that level: L1 with nothing
  lost; L2 and L3 with node 1's local directory deleted (its ranks served
  by the partner copies / Reed-Solomon decoding); L4 with all node-local
  storage deleted. Loads read what was just written (page cache).

Times are the slowest rank's between barriers, the median of ``--repeat``
rounds, and are printed as ratios: beside L1 and beside a raw ceiling
measured in the same rounds. Raw write: every rank writes its 1/4 of the
state as one new sequential file, fsynced (what L1 must at least do). Raw
read: every rank reads all four of those files (a replicated restore
leaves every byte on every rank). Also the L3 coding speed per core: GB of
group data coded per CPU second of the thread running ``rs_encode`` /
``rs_reconstruct`` (CPU time, so that a shared, oversubscribed machine
does not count waiting as coding). Bare times depend on the machine; the
ratios are the claim. Each round's checkpoints are deleted after the
round, untimed (as in bench/checkpoint.py: housekeeping that a training
loop overlaps with training).

``--backend builtin,fti`` (or ``fti``) instead compares the backends side
by side in one run, each through a real restart: per backend and level,
one ``mpiexec`` job saves ``--repeat`` times at that level (median of the
slowest rank's times, beside a raw write measured in the same job) and
ends without finalizing, as a crash would; the test then deletes what the
level protects against (as above), and a new job restores: opening the
backend (for FTI, ``FTI_Init``, which rebuilds lost files) plus
``load(into=state)``, one measurement per level. FTI comes from
``FTI_LIBRARY`` or ``.fti/lib/libfti.so`` (scripts/build-fti.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.checkpoint import _raw_read, _raw_write  # noqa: E402
from bench.jobs import BUFFERED, job_result  # noqa: E402

RANKS, NODE_SIZE = 4, 2


def build_state(mb: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    n = int(mb * 1e6 / 4 / 16)
    return {f"t{i}": torch.randn(n, generator=gen) for i in range(16)}


def read_all(paths: list[Path], buf: np.ndarray[Any, Any]) -> None:
    for p in paths:
        _raw_read(buf, p)


def level_config(work: Path, **extra: Any) -> Any:
    """The benchmark's levels config: 2 fake nodes of 2 ranks, groups of 2."""
    from deeppart.levels import LevelConfig

    return LevelConfig.from_dict(
        {
            "ckpt_dir": work / "local",
            "meta_dir": work / "meta",
            "glbl_dir": work / "global",
            "node_size": NODE_SIZE,
            "group_size": 2,
            "local_test": 1,
            **extra,
        }
    )


def rank_share(comm: Any, mb: float) -> np.ndarray[Any, Any]:
    """This rank's share of the raw-write ceiling: random bytes."""
    share: np.ndarray[Any, Any] = np.random.default_rng(comm.rank).integers(
        0, 255, int(mb * 1e6) // comm.size, dtype=np.uint8
    )
    return share


def slowest(comm: Any) -> Callable[[Callable[[], Any]], tuple[float, Any]]:
    """``timed(fn)``: (the slowest rank's seconds for ``fn``, its result)."""

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        comm.barrier()
        t = time.perf_counter()
        out = fn()
        local = time.perf_counter() - t
        return float(comm.allgather_f64(np.array([local]))[:, 0].max()), out

    return timed


def worker(args: argparse.Namespace) -> None:
    import torch

    from deeppart.comm import resolve
    from deeppart.levels.engine import BuiltinBackend

    torch.set_num_threads(1)
    comm = resolve(None)
    work = Path(args.dir)
    cfg = level_config(work, keep=1000)
    be = BuiltinBackend(cfg, comm, stripe_bytes=args.stripe_mb << 20)
    state = build_state(args.mb)
    share = rank_share(comm, args.mb)
    timed = slowest(comm)

    def lose(nodes: list[int]) -> None:
        if comm.rank == 0:
            for k in nodes:
                shutil.rmtree(cfg.local_root(k), ignore_errors=True)
        comm.barrier()

    times: dict[str, list[float]] = {}
    phases: dict[str, list[float]] = {}
    step = 0
    encode = [0.0, 0.0]  # seconds, bytes
    for rnd in range(args.repeat + 1):  # round 0: warm-up, not counted
        raws = [work / f"raw-{r}-{rnd}" for r in range(comm.size)]
        row = {"raw write": timed(partial(_raw_write, share, raws[comm.rank]))[0]}
        # A replicated restore leaves every byte on every rank: each rank
        # reads all ranks' shares.
        row["raw read"] = timed(partial(read_all, raws, np.empty_like(share)))[0]
        comm.barrier()
        raws[comm.rank].unlink()
        for lv in (1, 2, 3, 4):
            step += 1
            row[f"save L{lv}"], stats = timed(partial(be.save, step, state, level=lv))
            if rnd:
                for ph, sec in stats.phases.items():
                    phases.setdefault(f"L{lv} {ph}", []).append(sec)
            if lv == 3 and rnd:
                encode[0] += stats.phases.get("l3_encode_cpu", 0.0)
                encode[1] += sum(t.numel() * 4 for t in state.values()) / comm.size
            lose({1: [], 2: [1], 3: [1], 4: list(range(RANKS // NODE_SIZE))}[lv])
            row[f"load L{lv}"], (_, rep) = timed(partial(be.load, into=state))
            assert max(rep.levels) == lv, rep
        # Untimed housekeeping (as bench/checkpoint.py): drop this round's
        # checkpoints, which a training loop would overlap with training.
        comm.barrier()
        if comm.rank == 0:
            for sub in ("meta", "global", "local"):
                shutil.rmtree(work / sub, ignore_errors=True)
        comm.barrier()
        if rnd:
            for k, v in row.items():
                times.setdefault(k, []).append(v)
    enc = comm.allgather_f64(np.array(encode))
    dec = comm.allgather_f64(np.array([be.decode_seconds, float(be.decode_bytes)]))
    if comm.rank == 0:
        result = {
            "times": times,
            "phases": {k: statistics.median(v) for k, v in phases.items()},
            "bytes": sum(t.numel() * 4 for t in state.values()),
            "encode_gbps": float(enc[:, 1].sum() / max(enc[:, 0].sum(), 1e-9) / 1e9),
            "decode_gbps": float(dec[:, 1].sum() / max(dec[:, 0].sum(), 1e-9) / 1e9),
        }
        print("RESULT " + json.dumps(result), flush=True)


def report(res: dict[str, Any]) -> None:
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    print(
        f"\nstate {res['bytes'] / 1e6:.0f} MB on {RANKS} ranks as {RANKS // NODE_SIZE} fake "
        f"nodes (groups of 2), {os.cpu_count()} CPUs; medians of "
        f"{len(res['times']['raw write'])} rounds; saves fsynced, loads from the page cache"
    )
    print(f"raw ceiling: write {med['raw write']:.3f} s, read {med['raw read']:.3f} s")
    print(f"{'level':6} {'save/L1':>8} {'save/raw':>9} {'load/L1':>8} {'load/raw read':>14}")
    for lv in (1, 2, 3, 4):
        s, ld = med[f"save L{lv}"], med[f"load L{lv}"]
        print(
            f"L{lv:<5} {s / med['save L1']:8.2f} {s / med['raw write']:9.2f} "
            f"{ld / med['load L1']:8.2f} {ld / med['raw read']:14.2f}"
        )
    for lv in (1, 2, 3, 4):
        ph = {k.split()[1]: v for k, v in res["phases"].items() if k.startswith(f"L{lv} ")}
        parts = ", ".join(f"{k} {v / med[f'save L{lv}']:.0%}" for k, v in ph.items())
        print(f"L{lv} save phases (rank 0, share of the save): {parts}")
    print(
        f"L3 Reed-Solomon per core: encode {res['encode_gbps']:.2f} GB/s, "
        f"decode {res['decode_gbps']:.2f} GB/s (target >= 1)"
    )


def _open(name: str, work: Path, comm: Any, stripe_mb: int) -> Any:
    from deeppart.levels.engine import BuiltinBackend
    from deeppart.levels.fti import FTIBackend

    cfg = level_config(work)
    if name == "fti":
        return FTIBackend(cfg, comm)
    return BuiltinBackend(cfg, comm, stripe_bytes=stripe_mb << 20)


def restart_worker(args: argparse.Namespace) -> None:
    """One job of the side-by-side comparison: ``save`` (``--repeat``
    saves at ``--level``, beside raw writes; no finalize) or ``restore``
    (open the backend, then load)."""
    import torch

    from deeppart.comm import MPIComm

    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPIComm(MPI.COMM_WORLD)
    work = Path(args.dir)
    state = build_state(args.mb)
    timed = slowest(comm)
    result: dict[str, list[float]] = {}
    if args.worker == "save":
        share = rank_share(comm, args.mb)
        be = _open(args.backend, work, comm, args.stripe_mb)
        for k in range(args.repeat + 1):  # round 0: warm-up, not counted
            raw = work / f"raw-{comm.rank}"
            t_raw = timed(partial(_raw_write, share, raw))[0]
            raw.unlink()
            t_save = timed(partial(be.save, k, state, level=args.level))[0]
            if k:
                result.setdefault("raw write", []).append(t_raw)
                result.setdefault("save", []).append(t_save)
        if args.backend == "fti":
            be.close(finalize=False)  # a crash: FTI keeps its checkpoint
    else:
        t_open, be = timed(partial(_open, args.backend, work, comm, args.stripe_mb))
        t_load, (_, rep) = timed(partial(be.load, into=state))
        assert rep.step == args.repeat, rep
        result = {"restore": [t_open + t_load], "open": [t_open]}
        if args.backend == "fti":
            be.close(finalize=False)
    if comm.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


def compare(args: argparse.Namespace, backends: list[str]) -> None:
    """The side-by-side restart comparison (see the module docstring)."""
    if "fti" in backends and not os.environ.get("FTI_LIBRARY"):
        built = ROOT / ".fti" / "lib" / "libfti.so"
        if not built.exists():
            raise SystemExit("no libfti: set FTI_LIBRARY or run scripts/build-fti.sh (docs/FTI.md)")
        os.environ["FTI_LIBRARY"] = str(built)
    med: dict[tuple[str, int, str], float] = {}
    for lv in (1, 2, 3, 4):
        for name in backends:
            work = Path(tempfile.mkdtemp(prefix=f"deeppart-levels-{name}-", dir=args.dir))
            try:
                for job in ("save", "restore"):
                    if job == "restore":
                        nodes = {1: [], 2: [1], 3: [1], 4: list(range(RANKS // NODE_SIZE))}[lv]
                        for k in nodes:  # both backends: ckpt_dir/node<k> (local_test)
                            shutil.rmtree(work / "local" / f"node{k}", ignore_errors=True)
                    res = _run_job(
                        args, ["--worker", job, "--backend", name, "--level", str(lv)], work
                    )
                    for key, values in res.items():
                        med[(name, lv, key)] = statistics.median(values)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(
        f"\nstate {args.mb:.0f} MB on {RANKS} ranks as {RANKS // NODE_SIZE} fake nodes "
        f"(groups of 2), {os.cpu_count()} CPUs; save: median of {args.repeat} saves (fsynced) "
        "in one job; restore: a new job (open + load), once, after losing what the level "
        "protects against"
    )
    cols = [f"{b} save/raw" for b in backends] + [f"{b} restore/raw" for b in backends]
    if len(backends) == 2:
        cols += [f"save {backends[1]}/{backends[0]}", f"restore {backends[1]}/{backends[0]}"]
    print("level " + " ".join(f"{c:>18}" for c in cols))
    for lv in (1, 2, 3, 4):
        raw = med[(backends[0], lv, "raw write")]
        cells = [med[(b, lv, "save")] / raw for b in backends]
        cells += [med[(b, lv, "restore")] / raw for b in backends]
        if len(backends) == 2:
            a, b = backends
            cells += [
                med[(b, lv, "save")] / med[(a, lv, "save")],
                med[(b, lv, "restore")] / med[(a, lv, "restore")],
            ]
        print(f"L{lv:<5}" + " ".join(f"{c:18.2f}" for c in cells))
    print("(raw = a raw write of each rank's share, fsynced, measured in the same save job)")


def _run_job(args: argparse.Namespace, extra: list[str], work: Path) -> dict[str, Any]:
    """Runs this script's worker under ``mpiexec -n RANKS`` (``extra``: its
    mode) and returns the JSON it printed after ``RESULT``."""
    cmd = [
        str(Path(sys.executable).parent / "mpiexec"), "-n", str(RANKS), sys.executable,
        str(Path(__file__).resolve()), "--mb", str(args.mb), "--repeat", str(args.repeat),
        "--stripe-mb", str(args.stripe_mb), "--dir", str(work), *extra,
    ]  # fmt: skip
    return job_result(cmd, dict(os.environ, OMP_NUM_THREADS="1", **BUFFERED))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="state size in MB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stripe-mb", type=int, default=16)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument(
        "--backend",
        default=None,
        help="compare backends through restarts, e.g. builtin,fti (default: the built-in "
        "engine's in-process rounds)",
    )
    ap.add_argument("--level", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--worker", nargs="?", const="rounds", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "rounds":
        worker(args)
        return
    if args.worker:
        restart_worker(args)
        return
    if args.backend:
        backends = [b.strip() for b in args.backend.split(",") if b.strip()]
        unknown = set(backends) - {"builtin", "fti"}
        if unknown or not backends:
            raise SystemExit(f"--backend: one or two of builtin, fti (got {args.backend!r})")
        compare(args, backends)
        return
    work = Path(tempfile.mkdtemp(prefix="deeppart-levels-", dir=args.dir))
    try:
        report(_run_job(args, ["--worker"], work))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
