"""Checkpoint save/load benchmark: DeepPart against torch.save, torch.distributed
.checkpoint (DCP, gloo) and a raw write of the same bytes, on 1, 2 and 4 ranks.

    .venv/bin/python bench/checkpoint.py                 # default --scale 0.25
    .venv/bin/python bench/checkpoint.py --scale 1       # full BERT-large + AdamW, 4.0 GB

The state is BERT-large's parameters (layer shapes from bench/models.py) and
AdamW's two moments and step per parameter, with random values; ``--scale s``
keeps BERT-large's hidden sizes and scales the vocabulary and the number of
layers, so the state is about ``s * 4.0 GB``. Every rank holds the whole
state (data parallel), so 4 ranks need 4x the state in memory, plus a
loaded copy for torch.load: the full 4 GB state does not fit 4 ranks in
24 GiB, hence the default 0.25 (about 1 GB).

Method, the same for every contender: ``os.sync()`` and a ``Barrier``
(untimed), time the operation, ``Barrier`` again; the time is the slowest
rank's. With ``--repeat R`` the contenders run in R rounds, each once per
round in a new shuffled order (so the slow phases of a shared machine, and
the cost of what the previous contender left behind, spread over all of
them); the report gives each one's best round and, more robust, the median
over the rounds of the ratios measured within one round. An untimed
warm-up first sets up MPI's and gloo's shared-memory paths. Saves fsync
every file they write (torch.save: ``os.fsync`` of the file; DCP:
``FileSystemWriter(sync_files=True)``, its default; DeepPart: always; raw:
``os.fsync``). Loads read what was just written, so they come from the
page cache (dropping it needs privileges this benchmark does not assume):
load times measure the software path, not the disk. ``torch.save`` writes
on rank 0 only and ``torch.load`` reads the whole file on every rank (what
a data-parallel restart does); DCP and DeepPart load in place into the
existing state (DeepPart: ``into=``). DeepPart loads with its default
exchange (``"auto"``: on one host each file is read and checksummed once,
by one rank, into an MPI shared window that every rank copies from) and,
for comparison, with ``exchange="bcast"`` (each rank reads 1/K of the
files, then MPI broadcasts: what ``"auto"`` picks across nodes). "raw" writes ``1/K`` of
the state's bytes per rank as one sequential write of one file: the ceiling
of this machine for K parallel writers. A replicated restore must put every
byte in every rank's memory, so the load ceilings are "raw read all" (every
rank reads all K raw files, unchecked: what a replicated one-host restore
costs without a checksum or an exchange) and "raw
read+bcast" (each rank reads its file, then every file is broadcast: the
ceiling of ``exchange="bcast"``); "raw share" (each rank reads only its own
file) is shown for reference, it is not a restore. A compressed checkpoint
loads by default with each piece decompressed once, by the rank that read
it, and raw bytes broadcast; "deeppart+CODEC/read" is the other way (every
rank reads and decompresses everything), for comparison. Every save
contender writes a new file or directory each round and then deletes the
previous one, as a training loop saving ``step-N`` with one checkpoint kept
does (overwriting the last checkpoint in place would lose it on a crash);
"raw in place" rewrites the same file each round, shown for reference.
"deeppart+verify" is DeepPart's save with ``verify_replicas=True`` (every
rank hashes its whole replica first): its cost is reported as a ratio
against the plain DeepPart save of the same round. "deeppart+auto" is the
save with ``compression="auto"`` (each piece compressed only where a sample
says it pays in the plan's cost model), timed right after the plain save
in even rounds and right before it in odd ones (:data:`PAIRS`): its time
over the plain save's, a median of within-round ratios, and its
compression ratio are reported. The
random float32 state is the incompressible case; ``--dtype bfloat16``
builds the same state in bfloat16, whose shuffled exponent bytes compress
(a ratio of about 1.3 with shuffle-zstd) as real bf16 weights' do.

The state and the workers' set-up are bench/jobs.py's (shared with
bench/async.py).
"""

from __future__ import annotations

import argparse
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

from bench.jobs import DTYPES, build_state, job_result, mpi_env, start_worker  # noqa: E402
from deeppart.saving.writer import WRITE_CHUNK  # noqa: E402

CONTENDERS = ("torch", "dcp", "deeppart", "deeppart+{codec}", "raw")


def _fsynced_torch_save(state: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _raw_write(buf: np.ndarray[Any, Any], path: Path) -> None:
    """A sequential write in the chunks DeepPart writes in (one huge write()
    was measured slower here than chunks of a few MiB)."""
    with open(path, "wb") as f:
        for start in range(0, buf.size, WRITE_CHUNK):
            f.write(buf[start : start + WRITE_CHUNK].data)
        f.flush()
        os.fsync(f.fileno())


class _NewEachRound:
    """Runs ``write(path)`` to a new path each round (``NAME-<round>``), then
    deletes the previous round's path: what a training loop does when it
    saves ``step-N`` and keeps the last checkpoint, and what a crash-safe
    checkpoint must do (overwriting the last one in place would lose both on
    a crash). Every save contender, the raw ceiling included, runs this way,
    so all of them allocate new blocks; on this machine's virtual disk,
    rewriting just-freed blocks in place is measurably faster, so an
    in-place raw rewrite is shown for reference only."""

    def __init__(self, write: Callable[[Path], Any], base: Path, name: str, owner: bool) -> None:
        self.write, self.base, self.name, self.owner = write, base, name, owner
        self.round = 0

    def path(self, round_: int) -> Path:
        return self.base / f"{self.name}-{round_}"

    @property
    def latest(self) -> Path:
        return self.path(self.round - 1)

    def __call__(self) -> None:
        self.write(self.path(self.round))
        self.round += 1

    def cleanup(self) -> None:
        """Deletes the previous round's path (untimed, after every rank
        wrote: housekeeping that a training loop overlaps with training)."""
        old = self.path(self.round - 2)
        if self.owner and self.round > 1 and old.exists():
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()


def _raw_read(buf: np.ndarray[Any, Any], path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(buf.data)
    assert n == buf.nbytes


def _bcast_all(comm: Any, full: np.ndarray[Any, Any], n: int, size: int) -> None:
    """Every rank's ``n``-byte block of ``full`` broadcast from that rank,
    in chunks under MPI's 2 GiB count limit."""
    chunk = 1 << 30
    for r in range(size):
        for start in range(r * n, (r + 1) * n, chunk):
            comm.Bcast(full[start : min(start + chunk, (r + 1) * n)], root=r)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import deeppart
    from deeppart.saving.prepare import last_proof

    size = MPI.COMM_WORLD.Get_size()
    job = start_worker(
        args.scale, args.dir, f"n{size}", bcast_bytes=64 << 20, reduce_floats=16 << 20,
        dtype=args.dtype,
    )  # fmt: skip
    comm, rank, state, total, base = job.comm, job.rank, job.state, job.total, job.base
    codec = args.codec
    times: dict[str, float] = {}

    share = np.ones(total // size, dtype=np.uint8)
    deeppart.save({"w": torch.zeros(4 << 20)}, base / "warm", comm=comm, overwrite=True)
    deeppart.load(base / "warm", comm=comm)

    def torch_write(path: Path) -> None:
        if rank == 0:
            _fsynced_torch_save(state, path)

    def dcp_write(path: Path) -> None:
        dcp_save(state, storage_writer=FileSystemWriter(str(path), sync_files=True))

    def dp_write(path: Path) -> None:
        deeppart.save(state, path, comm=comm)

    def dpz_write(path: Path) -> None:
        deeppart.save(state, path, comm=comm, writing=deeppart.WriteOptions(compression=codec))

    def dpa_write(path: Path) -> None:
        deeppart.save(state, path, comm=comm, writing=deeppart.WriteOptions(compression="auto"))

    def dpv_write(path: Path) -> None:
        deeppart.save(state, path, comm=comm, writing=deeppart.WriteOptions(verify_replicas=True))

    torch_s = _NewEachRound(torch_write, base, "torch.pt", rank == 0)
    dcp_s = _NewEachRound(dcp_write, base, "dcp", rank == 0)
    dp_s = _NewEachRound(dp_write, base, "dp", rank == 0)
    dpz_s = _NewEachRound(dpz_write, base, "dpz", rank == 0)
    dpv_s = _NewEachRound(dpv_write, base, "dpv", rank == 0)
    dpa_s = _NewEachRound(dpa_write, base, "dpa", rank == 0)
    raw_s = _NewEachRound(lambda path: _raw_write(share, path), base, f"raw-{rank}.bin", True)
    # The replicated-restore ceilings: every byte of every rank's raw file
    # in every rank's memory.
    n = share.size
    full = np.empty(n * size, dtype=np.uint8)

    def raw_of(r: int) -> Path:
        return base / f"raw-{r}.bin-{raw_s.round - 1}"

    def raw_read_all() -> None:
        for r in range(size):
            _raw_read(full[r * n : (r + 1) * n], raw_of(r))

    def raw_read_bcast() -> None:
        _raw_read(full[rank * n : (rank + 1) * n], raw_of(rank))
        _bcast_all(comm, full, n, size)

    saves: list[tuple[str, Callable[[], Any]]] = [
        ("save torch", torch_s),
        ("save dcp", dcp_s),
        ("save deeppart", dp_s),
        (f"save deeppart+{codec}", dpz_s),
        ("save deeppart+verify", dpv_s),
        ("save deeppart+auto", dpa_s),
        ("save raw", raw_s),
        ("save raw in place", lambda: _raw_write(share, base / f"raw-inplace-{rank}.bin")),
    ]
    loads: list[tuple[str, Callable[[], Any]]] = [
        ("load torch", lambda: torch.load(torch_s.latest, weights_only=True)),
        (
            "load dcp",
            lambda: dcp_load(state, storage_reader=FileSystemReader(str(dcp_s.latest))),
        ),
        ("load deeppart", lambda: deeppart.load(dp_s.latest, comm=comm, into=state)),
        (f"load deeppart+{codec}", lambda: deeppart.load(dpz_s.latest, comm=comm, into=state)),
        (
            "load deeppart/bcast",
            lambda: deeppart.load(
                dp_s.latest, comm=comm, into=state, loading=deeppart.LoadOptions(exchange="bcast")
            ),
        ),
        (
            f"load deeppart+{codec}/read",
            lambda: deeppart.load(
                dpz_s.latest, comm=comm, into=state, loading=deeppart.LoadOptions(exchange="read")
            ),
        ),
        ("load raw share", lambda: _raw_read(share, raw_s.latest)),
        ("load raw read all", raw_read_all),
        ("load raw read+bcast", raw_read_bcast),
    ]
    # Rounds: every contender once per round, so slow phases of this shared
    # machine spread over all of them; each contender's best round counts.
    ratio = auto_ratio = 1.0
    rounds: dict[str, list[float]] = {}
    # Per round of "save deeppart": the slowest rank's seconds that the proof
    # of its shared tensors (whole-tensor digests, deeppart.saving.prepare.last_proof)
    # added to the save: the small tensors' digests in its prepare, and the
    # wait, after its write, for the large ones' digests taken beside the
    # write; and the slowest rank's seconds of the latter (hidden by the write).
    proof: list[float] = []
    beside: list[float] = []
    for batch in (saves, loads):
        for round_ in range(args.repeat):
            # A new order each round (the same on every rank): on this disk
            # a contender pays for what the one before it left behind (e.g.
            # the discards of deleted files), so no contender may always
            # follow the same one.
            order = _paired(
                np.random.default_rng(round_).permutation(len(batch)).tolist(),
                [name for name, _ in batch],
                round_,
            )
            for name, fn in (batch[i] for i in order):
                # Untimed: flush what earlier contenders left to the disk
                # (deletions, journal), so each starts from a quiet disk.
                os.sync()
                comm.Barrier()
                t0 = time.perf_counter()
                fn()
                comm.Barrier()
                dt = time.perf_counter() - t0
                if isinstance(fn, _NewEachRound):
                    fn.cleanup()
                times[name] = min(times.get(name, float("inf")), dt)
                rounds.setdefault(name, []).append(dt)
                if name == "save deeppart":
                    added = last_proof.seconds + last_proof.waited_seconds
                    proof.append(comm.allreduce(added, op=MPI.MAX))
                    beside.append(comm.allreduce(last_proof.beside_seconds, op=MPI.MAX))
                if name == f"save deeppart+{codec}":
                    stats = deeppart.last_stats("save")
                    ratio = stats.ratio if stats else 1.0
                if name == "save deeppart+auto":
                    stats = deeppart.last_stats("save")
                    auto_ratio = stats.ratio if stats else 1.0
                if rank == 0:
                    print(f"[bench] n={size} {name:<22} {dt:8.3f} s", file=sys.stderr, flush=True)

    # The in-place loads must have restored the same values.
    ref = build_state(args.scale, dtype=args.dtype)
    same = all(torch.equal(ref["model"][k], v) for k, v in state["model"].items()) and torch.equal(
        ref["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"]
    )
    ok = comm.allreduce(int(same), op=MPI.MIN)
    if rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "ranks": size,
                    "bytes": total,
                    "times": times,
                    "rounds": rounds,
                    "ratio": ratio,
                    "auto_ratio": auto_ratio,
                    "proof": proof,
                    "proof_beside": beside,
                    "verified": bool(ok),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


def _run(n: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [
        str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()), "--worker",
        "--scale", str(args.scale), "--codec", args.codec, "--dir", str(work),
        "--repeat", str(args.repeat), "--dtype", args.dtype,
    ]  # fmt: skip
    return job_result(cmd, mpi_env())


OTHERS = {"save": ("torch", "dcp", "raw"), "load": ("torch", "dcp", "raw read all")}


def _median_ratio(rounds: dict[str, list[float]], num: str, den: str) -> float:
    """The median over the rounds of ``num``'s time / ``den``'s time, each
    pair measured in the same round."""
    pairs = zip(rounds[num], rounds[den], strict=True)
    return float(np.median([a / b for a, b in pairs]))


def _proof_share(r: dict[str, Any]) -> str:
    """``2 rank(s) 0.012 s = 1.3 %``: the replica proof's median seconds and
    its median share of the plain save's time within each round."""
    pairs = zip(r["proof"], r["rounds"]["save deeppart"], strict=True)
    share = 100 * float(np.median([p / t for p, t in pairs]))
    beside = float(np.median(r["proof_beside"]))
    return (
        f"{r['ranks']} rank(s) {float(np.median(r['proof'])):.3f} s = {share:.1f} % "
        f"(digests beside the write {beside:.3f} s)"
    )


def report(results: list[dict[str, Any]], codec: str, dtype: str = "float32") -> None:
    gb = results[0]["bytes"] / 1e9
    print(
        f"\nstate: BERT-large-shaped model + AdamW, {gb:.2f} GB, {dtype}; "
        f"{os.cpu_count()} CPUs; saves fsynced, loads from the page cache"
    )
    for op in ("save", "load"):
        columns = (
            ["torch", "dcp", "deeppart", f"deeppart+{codec}", "raw", "raw in place"]
            if op == "save"
            else ["torch", "dcp", "deeppart", "deeppart/bcast", f"deeppart+{codec}",
                  f"deeppart+{codec}/read", "raw read all", "raw read+bcast", "raw share"]
        )  # fmt: skip
        names = [f"{op} {x}" for x in columns]
        print(f"\n{op}: seconds (GB/s)")
        print(f"{'ranks':>5}  " + "  ".join(f"{n[len(op) + 1 :]:>20}" for n in names))
        for r in results:
            cells = [f"{r['times'][n]:8.3f} ({gb / r['times'][n]:6.2f})" for n in names]
            print(f"{r['ranks']:>5}  " + "  ".join(f"{c:>20}" for c in cells))
        print(f"{op} ratios (>1: DeepPart faster; raw/deeppart: fraction of the ceiling)")
        for r in results:
            t = r["times"]
            dp, dpz = t[f"{op} deeppart"], t[f"{op} deeppart+{codec}"]
            line = (
                f"  {r['ranks']} rank(s): torch/deeppart {t[f'{op} torch'] / dp:5.2f}x  "
                f"dcp/deeppart {t[f'{op} dcp'] / dp:5.2f}x  "
            )
            if op == "save":
                line += (
                    f"raw/deeppart {t['save raw'] / dp:5.2f}  "
                    f"deeppart/deeppart+{codec} {dp / dpz:5.2f}x"
                )
            else:
                bc, dpz_read = t["load deeppart/bcast"], t[f"load deeppart+{codec}/read"]
                line += (
                    f"raw-read-all/deeppart {t['load raw read all'] / dp:5.2f}  "
                    f"raw-read+bcast/deeppart-bcast {t['load raw read+bcast'] / bc:5.2f}  "
                    f"deeppart+{codec}: /read over decompress-once {dpz_read / dpz:5.2f}x"
                )
            print(line)
        print(f"{op} ratios within each round, median over the rounds (noise-robust)")
        for r in results:
            med = [_median_ratio(r["rounds"], f"{op} {o}", f"{op} deeppart") for o in OTHERS[op]]
            ceiling = "raw" if op == "save" else "raw-read-all"
            line = (
                f"  {r['ranks']} rank(s): torch/deeppart {med[0]:5.2f}x  "
                f"dcp/deeppart {med[1]:5.2f}x  {ceiling}/deeppart {med[2]:5.2f}"
            )
            if op == "load":
                rr = r["rounds"]
                bcast = _median_ratio(rr, "load raw read+bcast", "load deeppart/bcast")
                once = _median_ratio(rr, f"load deeppart+{codec}/read", f"load deeppart+{codec}")
                line += (
                    f"  raw-read+bcast/deeppart-bcast {bcast:5.2f}"
                    f"  deeppart+{codec} /read over decompress-once {once:5.2f}x"
                )
            print(line)
    print(
        "\nreplica check (save(verify_replicas=True)) cost, deeppart+verify/deeppart "
        "(median within-round ratio): "
        + ", ".join(
            f"{r['ranks']} rank(s) "
            f"{_median_ratio(r['rounds'], 'save deeppart+verify', 'save deeppart'):.3f}x"
            for r in results
        )
    )
    print(
        "\nreplica proof (each rank digests every tensor it shares with others, whole, "
        "xxh3_128: under 1 MiB in the save's prepare, larger ones on a thread beside the "
        "write), the seconds it added to the plain save (the prepare's digests and the wait "
        "for the others after the write; the slowest rank's) and their share of the save "
        "(median within-round): " + ", ".join(_proof_share(r) for r in results if r.get("proof"))
    )
    print(
        f"\n{codec} compression ratio (raw/stored): "
        + ", ".join(f"{r['ratio']:.3f}" for r in results[:1])
    )
    print(
        '\ncompression="auto" save time over the plain save (median within-round ratio; '
        "<= 1.05: within 5 %), and its compression ratio: "
        + ", ".join(
            f"{r['ranks']} rank(s) "
            f"{_median_ratio(r['rounds'], 'save deeppart+auto', 'save deeppart'):.3f}x "
            f"(ratio {r.get('auto_ratio', 1.0):.3f})"
            for r in results
        )
    )
    print(
        "in-place loads verified equal to the saved state: "
        + ", ".join(f"{r['ranks']} ranks {r['verified']}" for r in results)
    )


#: Contenders timed against each other in adjacent pairs (first after
#: second in even rounds, before it in odd ones), so that their within-round
#: ratio does not carry what the contender before each one left on the disk.
PAIRS = (("save deeppart+auto", "save deeppart"),)


def _paired(order: list[int], names: list[str], round_: int) -> list[int]:
    """``order`` (indices into ``names``) with each of :data:`PAIRS` made
    adjacent: its first moved next to its second."""
    for first, second in PAIRS:
        if first not in names or second not in names:
            continue
        a, b = names.index(first), names.index(second)
        order.remove(a)
        at = order.index(b)
        order.insert(at + 1 if round_ % 2 == 0 else at, a)
    return order


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--scale", type=float, default=0.25, help="fraction of BERT-large (default 0.25)"
    )
    p.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    p.add_argument("--codec", default="zstd", help="DeepPart codec to compare (default zstd)")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed)")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds (default 1): each contender's best, and median within-round ratios",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="the state's float dtype (default float32; bfloat16: weights that compress)",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="deeppart-bench-"))
    results = []
    try:
        for n in (int(x) for x in args.ranks.split(",")):
            results.append(_run(n, args, work))
            subprocess.run(["rm", "-rf", str(work / f"n{n}")], check=False)
    finally:
        if args.dir is None:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    report(results, args.codec, args.dtype)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
