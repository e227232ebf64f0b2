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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
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

RANKS, NODE_SIZE = 4, 2


def build_state(mb: float) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(0)
    n = int(mb * 1e6 / 4 / 16)
    return {f"t{i}": torch.randn(n, generator=gen) for i in range(16)}


def read_all(paths: list[Path], buf: np.ndarray[Any, Any]) -> None:
    for p in paths:
        _raw_read(buf, p)


def worker(args: argparse.Namespace) -> None:
    import torch

    from deeppart.comm import resolve
    from deeppart.levels import LevelConfig
    from deeppart.levels.engine import BuiltinBackend

    torch.set_num_threads(1)
    comm = resolve(None)
    work = Path(args.dir)
    cfg = LevelConfig.from_dict(
        {
            "ckpt_dir": work / "local",
            "meta_dir": work / "meta",
            "glbl_dir": work / "global",
            "node_size": NODE_SIZE,
            "group_size": 2,
            "local_test": 1,
            "keep": 1000,
        }
    )
    be = BuiltinBackend(cfg, comm, stripe_bytes=args.stripe_mb << 20)
    state = build_state(args.mb)
    share = np.random.default_rng(comm.rank).integers(
        0, 255, int(args.mb * 1e6) // comm.size, dtype=np.uint8
    )

    def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
        """(slowest rank's seconds, fn's result)."""
        comm.barrier()
        t = time.perf_counter()
        out = fn()
        local = time.perf_counter() - t
        return float(comm.allgather_f64(np.array([local]))[:, 0].max()), out

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="state size in MB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stripe-mb", type=int, default=16)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    work = Path(tempfile.mkdtemp(prefix="deeppart-levels-", dir=args.dir))
    try:
        cmd = [
            str(Path(sys.executable).parent / "mpiexec"), "-n", str(RANKS), sys.executable,
            str(Path(__file__).resolve()), "--worker", "--mb", str(args.mb), "--repeat",
            str(args.repeat), "--stripe-mb", str(args.stripe_mb), "--dir", str(work),
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}")
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                report(json.loads(line[len("RESULT ") :]))
                return
        raise SystemExit(f"no result:\n{proc.stdout}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
