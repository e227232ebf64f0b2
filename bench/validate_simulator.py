"""Predicted versus measured save time at 1, 2 and 4 ranks on this machine
(docs/SIMULATOR.md, "Validation").

    .venv/bin/python bench/validate_simulator.py [--dir DIR] [--repeats 3] [--runs 1]

Calibrates this machine into a throw-away profile (``deeppart.tools.calibrate``:
whole single-process saves of files up to 128 MiB, ``--sizes``), then for K
in 1, 2, 4 runs ``mpiexec -n K`` saves of a Llama-shaped model with AdamW
(about 350 MB) with ``deeppart.save``, each into a new checkpoint directory,
and compares the median measured time with the simulator's prediction for
the plan ``deeppart.save`` used (one node, K ranks per node, node-local
storage). ``--overwrite`` times saves that replace an earlier checkpoint
instead, its removal included. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.jobs import BUFFERED  # noqa: E402


def manifest() -> Any:
    from deeppart.tools.models import adamw_manifest, llama_params

    return adamw_manifest(
        llama_params(vocab=16000, hidden=512, layers=4, intermediate=1408, kv_hidden=512)
    )


def worker(directory: str, repeats: int, overwrite: bool) -> None:
    import torch
    from mpi4py import MPI

    import deeppart
    from deeppart.format import remove_tree

    comm = MPI.COMM_WORLD
    state: dict[str, Any] = {}
    for lf in manifest().leaves():
        node = state
        path = lf["path"]
        for k in path[:-1]:
            node = node.setdefault(k, {})
        if lf["kind"] == "object":
            node[path[-1]] = {"lr": 0.001}
        else:
            node[path[-1]] = torch.full(tuple(lf["shape"]), 0.5)
    times: list[float] = []
    writes: list[float] = []
    for i in range(repeats + 1):
        # Each save is a new checkpoint, the previous one removed outside the
        # timing; with --overwrite, two checkpoints are overwritten in turn,
        # and a save's time includes removing the one it replaces (which the
        # model does not predict).
        target = Path(directory) / (f"ck{i % 2}" if overwrite else f"ck{comm.size}-{i}")
        comm.Barrier()
        t0 = time.perf_counter()
        st = deeppart.save(state, target, progress=False, overwrite=overwrite)
        comm.Barrier()
        if i:  # the first save warms up
            times.append(time.perf_counter() - t0)
            writes.append(max(st.rank_seconds))
        if comm.rank == 0 and not overwrite:
            remove_tree(target)
        comm.Barrier()
    if comm.rank == 0:
        print("RESULT " + json.dumps({"world": comm.size, "seconds": times, "writes": writes}))


def predict(world: int, profile: dict[str, Any]) -> float:
    import deeppart
    from deeppart.tools.simulate import StorageModel, predict_plan

    m = manifest()
    # The plan deeppart.save makes (its default cost model, one rank per node).
    plan = deeppart.plan(m, world, cache=False)
    # One node: the ranks share the disk (its calibrated parallel bandwidth).
    # The prediction is the planner's own modelled time of that plan under
    # the calibrated cost model of this node (Plan.modelled_time).
    model = StorageModel.from_profile(profile, ranks_per_node=world)
    return predict_plan(model, plan, "L1", "balanced").seconds


def one_run(
    base: Path,
    ranks: list[int],
    repeats: int,
    sizes_mib: list[int],
    overwrite: bool = False,
    raw_writes: bool = False,
) -> dict[str, Any] | None:
    """Calibrates, then measures and predicts a save at each rank count."""
    from deeppart.tools.calibrate import calibrate

    with tempfile.TemporaryDirectory(prefix=".validate-", dir=base) as tmp:
        sizes = [x << 20 for x in sizes_mib]
        profile = calibrate(
            Path(tmp), sizes=sizes, repeats=3, serialization=False, save_path=not raw_writes
        )
        mpiexec = Path(sys.executable).parent / "mpiexec"
        rows = []
        for k in ranks:
            cmd = [str(mpiexec), "-n", str(k), sys.executable, __file__, "--worker", tmp,
                   "--repeats", str(repeats)] + (["--overwrite"] if overwrite else [])  # fmt: skip
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **BUFFERED)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
            if proc.returncode != 0:
                print(proc.stdout, proc.stderr, file=sys.stderr)
                return None
            line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
            result = json.loads(line[7:])
            measured = statistics.median(result["seconds"])
            write = statistics.median(result["writes"])
            predicted = predict(k, profile)
            rows.append({"ranks": k, "measured_s": measured, "write_phase_s": write,
                         "predicted_s": predicted, "error": predicted / measured - 1})  # fmt: skip
    p = profile["params"]
    print(f"calibrated: write {p['write_bw'] / 1e9:.3f} GB/s, "
          f"node {p['node_bw'] / 1e9:.3f} GB/s, fixed {p['fixed_s'] * 1e3:.2f} ms, "
          f"piece {p['piece_s'] * 1e6:.1f} us, R2 {profile['fit']['write']['r2']:.3f}")  # fmt: skip
    print("ranks  measured_s  write_phase_s  predicted_s   error")
    for r in rows:
        print(f"{r['ranks']:5d}  {r['measured_s']:10.3f}  {r['write_phase_s']:13.3f}  "
              f"{r['predicted_s']:11.3f}  {r['error']:+6.1%}")  # fmt: skip
    return {"profile": p, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="target directory [a temporary one under .]")
    ap.add_argument("--repeats", type=int, default=3, help="timed saves per rank count [3]")
    ap.add_argument("--runs", type=int, default=1,
                    help="calibrate-and-measure runs, the error over all [1]")  # fmt: skip
    ap.add_argument("--ranks", default="1,2,4")
    # The files calibrated. Files up to 512 MiB (the largest a measured save
    # writes is 351 MB) did not close the gap: docs/SIMULATOR.md.
    ap.add_argument("--sizes", default="1,4,16,64,128",
                    help="calibration file sizes, MiB [1,4,16,64,128]")  # fmt: skip
    ap.add_argument("--overwrite", action="store_true",
                    help="time saves that overwrite an earlier checkpoint, its removal "
                         "included (not in the model)")  # fmt: skip
    ap.add_argument("--raw-writes", action="store_true",
                    help="calibrate with raw pwrite+fsync, not whole saves "
                         "(deeppart calibrate --raw-writes)")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.repeats, args.overwrite)
        return 0
    base = Path(args.dir) if args.dir else ROOT
    ranks = [int(x) for x in args.ranks.split(",")]
    print(f"model: {manifest().total_bytes / 1e6:.0f} MB")
    runs = []
    for i in range(args.runs):
        print(f"run {i + 1} of {args.runs}")
        sizes = [int(x) for x in args.sizes.split(",")]
        run = one_run(base, ranks, args.repeats, sizes, args.overwrite, args.raw_writes)
        if run is None:
            return 1
        runs.append(run)
    errors = sorted(abs(r["error"]) for run in runs for r in run["rows"])
    signed = ", ".join(f"{r['error']:+.0%}" for run in runs for r in run["rows"])
    print(f"absolute error over {len(errors)} points: median {statistics.median(errors):.1%}, "
          f"min {errors[0]:.1%}, max {errors[-1]:.1%}; signed: {signed}")  # fmt: skip
    print(json.dumps({"runs": runs, "median_abs_error": statistics.median(errors)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
