"""``deeppart calibrate --dir PATH``: measures this machine's cost-model
parameters against a target directory and saves them as a named profile,
usable as ``--profile NAME`` by ``deeppart plan`` and ``deeppart simulate``.

Writes files of several sizes and piece counts (each: open, write the pieces,
fsync, close), reads them back (after asking the kernel to drop them from the
page cache), and fits by least squares

    t = fixed_s + pieces * piece_s + bytes / bandwidth

for raw writes (the storage alone) and for reads. With torch installed, the
model's rank stream is fitted the same way to whole ``deeppart.save`` calls
of synthetic states by this process alone (its planning, checksums, buffered
writes, fsyncs and commit: the save path a raw write does not see; on the
development machine a save wrote at 0.73 GB/s where raw ``pwrite`` reached
1.19 GB/s, alternating in one run), and the node bandwidth to several such
saves at once; ``--raw-writes`` uses the raw figures instead. It also times
``torch.save`` of tensor dicts (to memory) and fits ``t = a + tensors *
tensor_s + bytes / serialize_bw``. Each fit reports R² and its relative RMS
error.

It also measures what writers share (the planner's storage model,
docs/PLANNER.md): ``node_bw``, the bandwidth of several streams writing at
once, and ``writer_s``, the per-file metadata cost (creating, syncing and
closing many files from several threads at once, per file). On one machine the
node and the aggregate bandwidth coincide: every writer shares the same
storage, so ``aggregate_bw`` is ``node_bw``. For a parallel file system,
calibrate on each kind of node and set ``aggregate_bandwidth`` from the file
system's specification or a multi-node run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deeppart import _planner
from deeppart.format import remove_tree


@dataclass(frozen=True)
class Fit:
    """A least-squares fit ``y ≈ X @ coef``."""

    coef: list[float]
    r2: float
    rel_rms: float  # sqrt(mean(((pred - y) / y)^2))
    n: int


def fit_linear(x: Sequence[Sequence[float]], y: Sequence[float]) -> Fit:
    """Least squares of ``y`` on the columns of ``x`` (include a column of ones
    for an intercept). Rows are weighted by ``1/y`` so that small and large
    measurements count alike (a relative-error fit). Negative coefficients
    are refitted without their column (set to 0): costs are not negative."""
    xa = np.asarray(x, dtype=np.float64)
    ya = np.asarray(y, dtype=np.float64)
    if xa.ndim != 2 or xa.shape[0] != ya.shape[0] or xa.shape[0] < xa.shape[1]:
        raise ValueError("need at least as many measurements as parameters")
    if np.any(ya <= 0):
        raise ValueError("measurements must be positive")
    w = 1.0 / ya
    active = list(range(xa.shape[1]))
    coef = np.zeros(xa.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xa[:, active] * w[:, None], ya * w, rcond=None)
        if np.all(sol >= 0):
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    pred = xa @ coef
    ss_res = float(np.sum((ya - pred) ** 2))
    ss_tot = float(np.sum((ya - ya.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    rel = float(np.sqrt(np.mean(((pred - ya) / ya) ** 2)))
    return Fit([float(c) for c in coef], r2, rel, int(ya.shape[0]))


def median_samples(samples: Sequence[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """The median time of the repeats of each ``(bytes, count)``: one slow
    outlier on a shared machine then does not pull the fit."""
    groups: dict[tuple[int, int], list[float]] = {}
    for b, n, t in samples:
        groups.setdefault((b, n), []).append(t)
    return [(b, n, float(np.median(ts))) for (b, n), ts in groups.items()]


def fit_io(samples: Sequence[tuple[int, int, float]]) -> tuple[dict[str, float], Fit]:
    """Fits ``(bytes, pieces, seconds)`` samples to ``fixed_s + pieces * piece_s
    + bytes / bandwidth``; returns the parameters and the fit."""
    fit = fit_linear([[1.0, float(n), float(b)] for b, n, _ in samples], [t for *_, t in samples])
    fixed, piece, per_byte = fit.coef
    bw = 1.0 / per_byte if per_byte > 0 else math.inf
    return {"fixed_s": fixed, "piece_s": piece, "bandwidth": bw}, fit


# ----------------------------------------------------------------------------
# Measuring.


def _drop_cache(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def measure_io(
    directory: Path, sizes: Sequence[int], pieces: Sequence[int], repeats: int
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]]]:
    """(write samples, read samples) of ``(bytes, pieces, seconds)``."""
    writes: list[tuple[int, int, float]] = []
    reads: list[tuple[int, int, float]] = []
    payload = np.random.default_rng(0).integers(0, 256, max(sizes), dtype=np.uint8).tobytes()
    view = memoryview(payload)
    with tempfile.TemporaryDirectory(prefix=".deeppart-calibrate-", dir=directory) as tmp:
        k = 0
        for _ in range(repeats):
            for size in sizes:
                for n in pieces:
                    if size // n < 512:
                        continue
                    path = Path(tmp) / f"f{k}.bin"
                    k += 1
                    step = size // n
                    t0 = time.perf_counter()
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        for i in range(n):
                            os.pwrite(fd, view[i * step : (i + 1) * step], i * step)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    writes.append((step * n, n, time.perf_counter() - t0))
                    fd = os.open(path, os.O_RDONLY)
                    try:
                        _drop_cache(fd)
                        t0 = time.perf_counter()
                        for i in range(n):
                            os.pread(fd, step, i * step)
                        reads.append((step * n, n, time.perf_counter() - t0))
                    finally:
                        os.close(fd)
                    path.unlink()
    return writes, reads


def _time_threads(work: Callable[[int], None], streams: int) -> float:
    """Seconds for ``streams`` threads to run ``work(0)`` ... ``work(streams - 1)`` at once."""
    import threading

    threads = [threading.Thread(target=work, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def measure_node_bw(directory: Path, streams: int, size: int, repeats: int) -> float:
    """Aggregate write bandwidth of ``streams`` threads writing (and fsyncing)
    ``size`` bytes each to their own file at once (os.pwrite releases the
    GIL): the node's storage limit. Median of ``repeats``."""
    payload = memoryview(np.full(size, 7, dtype=np.uint8).tobytes())
    rates: list[float] = []
    with tempfile.TemporaryDirectory(prefix=".deeppart-calibrate-", dir=directory) as tmp:
        for rep in range(repeats):

            def write(i: int, rep: int = rep) -> None:
                fd = os.open(Path(tmp) / f"n{rep}-{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644)
                try:
                    os.pwrite(fd, payload, 0)
                    os.fsync(fd)
                finally:
                    os.close(fd)

            rates.append(streams * size / _time_threads(write, streams))
            for f in Path(tmp).iterdir():
                f.unlink()
    return float(np.median(rates))


def measure_writer_s(directory: Path, streams: int, files: int, repeats: int) -> float:
    """The per-file metadata cost: ``streams`` threads together create,
    fsync and close ``files`` empty files (then the directory is synced);
    the elapsed time per file is what the storage serialises per writer.
    Median of ``repeats``."""
    per_file: list[float] = []
    with tempfile.TemporaryDirectory(prefix=".deeppart-calibrate-", dir=directory) as tmp:
        for rep in range(repeats):
            share = [files // streams + (1 if i < files % streams else 0) for i in range(streams)]

            def create(i: int, rep: int = rep, share: list[int] = share) -> None:
                for j in range(share[i]):
                    fd = os.open(
                        Path(tmp) / f"m{rep}-{i}-{j}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644
                    )
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)

            t0 = time.perf_counter()
            _time_threads(create, streams)
            dfd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            per_file.append((time.perf_counter() - t0) / files)
            for f in Path(tmp).iterdir():
                f.unlink()
    return float(np.median(per_file))


#: The calibration's plans, in memory only.
_MEMORY_PLANS = _planner.PlanCache(disk=False)


def _synthetic_state(nbytes: int, tensors: int) -> dict[str, Any]:
    """``tensors`` float32 tensors of ``nbytes`` in all, their memory touched."""
    import torch

    per = max(1, nbytes // tensors // 4)
    return {f"t{i}": torch.full((per,), i + 0.5) for i in range(tensors)}


def _timed_save(state: dict[str, Any], directory: Path) -> tuple[int, float]:
    """(bytes, seconds) of one ``deeppart.save`` of ``state`` by this process
    alone into the new ``directory``."""
    from deeppart.comm import SingleComm
    from deeppart.saving.planning import PlanProvider
    from deeppart.saving.save import save

    # Repeated saves of a state reuse its plan, as a training run's do; the
    # synthetic plans stay out of the user's on-disk plan cache.
    plans = PlanProvider(1, cache=_MEMORY_PLANS)
    t0 = time.perf_counter()
    stats = save(state, directory, comm=SingleComm(), progress=False, planning=plans)
    return stats.raw_bytes, time.perf_counter() - t0


def measure_saves(
    directory: Path, sizes: Sequence[int], tensors: Sequence[int], repeats: int
) -> list[tuple[int, int, float]] | None:
    """``(bytes, tensors, seconds)`` of whole ``deeppart.save`` calls, by this
    process alone, of ``tensors`` float32 tensors totalling each size, each
    into a new checkpoint directory (removed after its timing): a rank's
    write stream as a save runs it, with its planning, checksums, buffered
    writes, fsyncs and commit, which raw writes do not see. None without
    torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    out: list[tuple[int, int, float]] = []
    with tempfile.TemporaryDirectory(prefix=".deeppart-calibrate-", dir=directory) as tmp:
        k = 0
        for size in sizes:
            for n in tensors:
                if size // n < 4096:
                    continue
                state = _synthetic_state(size, n)
                for _ in range(repeats):
                    target = Path(tmp) / f"s{k}"
                    k += 1
                    nbytes, seconds = _timed_save(state, target)
                    out.append((nbytes, n, seconds))
                    remove_tree(target)
    return out


def measure_node_saves(directory: Path, streams: int, size: int, repeats: int) -> float | None:
    """Aggregate bandwidth of ``streams`` threads each running a whole
    ``deeppart.save`` of ``size`` bytes (8 tensors) at once, each its own
    checkpoint: ranks saving together on this node share its storage and its
    cores. (Checksums, writes and fsyncs release the GIL.) Median of
    ``repeats``; None without torch."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    states = [_synthetic_state(size, 8) for _ in range(streams)]
    rates: list[float] = []
    with tempfile.TemporaryDirectory(prefix=".deeppart-calibrate-", dir=directory) as tmp:
        for rep in range(repeats):
            written = [0] * streams

            def one(i: int, rep: int = rep, written: list[int] = written) -> None:
                written[i] = _timed_save(states[i], Path(tmp) / f"n{rep}-{i}")[0]

            seconds = _time_threads(one, streams)
            rates.append(sum(written) / seconds)
            for d in list(Path(tmp).iterdir()):
                remove_tree(d)
    return float(np.median(rates))


def measure_serialization(
    counts: Sequence[int], sizes: Sequence[int], repeats: int
) -> list[tuple[int, int, float]] | None:
    """``(bytes, tensors, seconds)`` of torch.save of ``count`` float32
    tensors of ``size`` bytes each, to memory; None without torch."""
    try:
        import io

        import torch
    except ImportError:
        return None
    out: list[tuple[int, int, float]] = []
    for _ in range(repeats):
        for c in counts:
            for s in sizes:
                state = {f"t{i}": torch.ones(max(1, s // 4)) for i in range(c)}
                buf = io.BytesIO()
                t0 = time.perf_counter()
                torch.save(state, buf)
                out.append((c * s, c, time.perf_counter() - t0))
    return out


# ----------------------------------------------------------------------------
# Profiles.


def profiles_dir() -> Path:
    """``$DEEPPART_CACHE_DIR/profiles`` (else the planner's default cache
    directory's ``profiles``, else ``~/.cache/deeppart/profiles``)."""
    base = _planner.default_cache_dir()
    return Path(base if base else Path.home() / ".cache" / "deeppart") / "profiles"


def profile_path(name: str) -> Path:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"bad profile name {name!r}")
    return profiles_dir() / f"{name}.json"


def load_profile(name_or_path: str) -> dict[str, Any]:
    """A profile by name, or a profile JSON file."""
    p = Path(name_or_path)
    if not (p.suffix == ".json" and p.is_file()):
        p = profile_path(name_or_path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"no calibration profile {name_or_path!r} ({p}: {e.strerror})") from e
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        raise ValueError(f"{p}: not a DeepPart calibration profile")
    return data


def cost_model_from_profile(profile: dict[str, Any], **overrides: Any) -> _planner.CostModel:
    """The planner's cost model with a profile's measured write parameters
    (explicit ``overrides`` that are not None win)."""
    params = profile["params"]
    kw: dict[str, Any] = {
        "fixed_s": params.get("fixed_s"),
        "piece_s": params.get("piece_s"),
        "bandwidth": params.get("write_bw"),
        "writer_s": params.get("writer_s"),
        "node_bandwidth": params.get("node_bw"),
        "aggregate_bandwidth": params.get("aggregate_bw"),
    }
    kw.update({k: v for k, v in overrides.items() if v is not None})
    kw = {k: v for k, v in kw.items() if v is None or math.isfinite(v)}
    return _planner.CostModel(**{k: v for k, v in kw.items() if v is not None})


def _finite(x: float) -> float | None:
    """None for a bandwidth the fit could not resolve (no measurable per-byte
    cost): users of the profile then keep their default."""
    return x if math.isfinite(x) and x > 0 else None


def _gbps(x: float | None) -> str:
    return f"{x / 1e9:.3f} GB/s" if x else "not resolved (per-byte cost ~0; default kept)"


def _us(x: float | None) -> str:
    return f"{x * 1e6:.1f} us" if x is not None else "not measured (default kept)"


def _fit_dict(fit: Fit) -> dict[str, float | int]:
    return {"r2": fit.r2, "rel_rms": fit.rel_rms, "samples": fit.n}


def calibrate(
    directory: Path,
    *,
    sizes: Sequence[int] = (256 << 10, 1 << 20, 4 << 20, 16 << 20),
    pieces: Sequence[int] = (1, 8, 64),
    repeats: int = 3,
    serialization: bool = True,
    streams: int | None = None,
    save_path: bool = True,
) -> dict[str, Any]:
    """Measures and fits; returns the profile (not yet saved). ``streams``:
    parallel writers for the node bandwidth [the CPU count, at least 2].

    ``save_path`` (with torch installed): the rank stream (``fixed_s``,
    ``piece_s``, ``write_bw``) and the node bandwidth are fitted to whole
    ``deeppart.save`` calls, what the planner's model predicts; the raw
    ``pwrite`` figures stay in the profile as ``storage_*``, the storage's
    own speed. Without it (or without torch) the raw figures are the model's."""
    t0 = time.perf_counter()
    writes, reads = measure_io(directory, sizes, pieces, repeats)
    nstreams = streams or max(2, os.cpu_count() or 2)
    node_bw = measure_node_bw(directory, nstreams, max(sizes), repeats)
    writer_s = measure_writer_s(directory, nstreams, 16 * nstreams, repeats)
    w, wfit = fit_io(median_samples(writes))
    r, rfit = fit_io(median_samples(reads))
    saves = measure_saves(directory, sizes, pieces, repeats) if save_path else None
    node_saves = measure_node_saves(directory, nstreams, max(sizes), repeats) if saves else None
    storage = {
        "storage_fixed_s": w["fixed_s"],
        "storage_piece_s": w["piece_s"],
        "storage_write_bw": _finite(w["bandwidth"]),
        "storage_node_bw": node_bw,
    }
    fits: dict[str, Any] = {"storage_write": _fit_dict(wfit), "read": _fit_dict(rfit)}
    if saves and node_saves:
        sv, sfit_ = fit_io(median_samples(saves))
        stream = {"fixed_s": sv["fixed_s"], "piece_s": sv["piece_s"],
                  "write_bw": _finite(sv["bandwidth"])}  # fmt: skip
        node, source = node_saves, "deeppart.save"
        fits["write"] = _fit_dict(sfit_)
    else:
        stream = {"fixed_s": w["fixed_s"], "piece_s": w["piece_s"],
                  "write_bw": _finite(w["bandwidth"])}  # fmt: skip
        node, source = node_bw, "raw pwrite"
        fits["write"] = fits["storage_write"]
    params: dict[str, Any] = {
        **stream,
        "write_source": source,
        **storage,
        "read_fixed_s": r["fixed_s"],
        "read_piece_s": r["piece_s"],
        "read_bw": _finite(r["bandwidth"]),
        "writer_s": writer_s,
        "node_bw": node,
        # One machine: all writers share one storage, so the aggregate is the node's.
        "aggregate_bw": node,
        "aggregate_source": "node_bw (one machine: node and aggregate coincide)",
        "node_streams": nstreams,
    }
    if serialization:
        ser = measure_serialization((1, 16, 128), (4 << 10, 256 << 10), repeats)
        if ser is not None:
            ser = median_samples(ser)
            sfit = fit_linear([[1.0, float(n), float(b)] for b, n, _ in ser], [t for *_, t in ser])
            params["tensor_s"] = sfit.coef[1]
            params["serialize_bw"] = 1.0 / sfit.coef[2] if sfit.coef[2] > 0 else None
            fits["serialize"] = _fit_dict(sfit)
    return {
        "version": 1,
        "directory": str(directory.resolve()),
        "host": platform.node(),
        "created_unix": time.time(),
        "seconds": time.perf_counter() - t0,
        "params": params,
        "fit": fits,
        "samples": {"write": saves or writes, "storage_write": writes, "read": reads},
    }


def save_profile(profile: dict[str, Any], name: str) -> Path:
    path = profile_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile, indent=1))
    os.replace(tmp, path)
    return path


def run(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"deeppart: error: {directory}: not a directory", file=sys.stderr)
        return 2
    top = args.max_mib << 20
    sizes = tuple(x for x in (256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
                  if x <= top) if not args.quick else (64 << 10, 1 << 20)  # fmt: skip
    pieces = (1, 8, 64) if not args.quick else (1, 16)
    try:
        profile = calibrate(
            directory, sizes=sizes, pieces=pieces, repeats=args.repeats,
            serialization=not args.no_serialization, save_path=not args.raw_writes,
        )  # fmt: skip
        path = save_profile(profile, args.name)
    except (OSError, ValueError) as e:
        print(f"deeppart: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps({k: v for k, v in profile.items() if k != "samples"} | {"path": str(path)})
        )
        return 0
    p, f = profile["params"], profile["fit"]
    rows = [
        ("rank stream measured by", p["write_source"]),
        ("fixed_s (per writing rank)", f"{p['fixed_s'] * 1e3:.3f} ms"),
        ("piece_s (per piece)", f"{p['piece_s'] * 1e6:.1f} us"),
        ("write bandwidth", _gbps(p["write_bw"])),
        ("write fit", f"R2 {f['write']['r2']:.4f}, rel. RMS error {f['write']['rel_rms']:.1%}"),
        ("node bandwidth", f"{_gbps(p['node_bw'])} ({p['node_streams']} parallel streams)"),
        ("storage alone (raw pwrite)",
         f"{_gbps(p['storage_write_bw'])} per stream, {_gbps(p['storage_node_bw'])} "
         f"per node, fixed {p['storage_fixed_s'] * 1e3:.3f} ms, "
         f"piece {p['storage_piece_s'] * 1e6:.1f} us"),
        ("aggregate bandwidth", f"{_gbps(p.get('aggregate_bw'))} (one machine: node and "
                                "aggregate coincide; set it for a parallel file system)"),
        ("writer_s (per-file metadata)", _us(p.get("writer_s"))),
        ("read fixed / piece",
         f"{p['read_fixed_s'] * 1e3:.3f} ms / {p['read_piece_s'] * 1e6:.1f} us"),
        ("read bandwidth", _gbps(p["read_bw"])),
        ("read fit", f"R2 {f['read']['r2']:.4f}, rel. RMS error {f['read']['rel_rms']:.1%}"),
    ]  # fmt: skip
    if "serialize" in f:
        sbw = p.get("serialize_bw")
        rows += [
            ("torch.save per tensor", f"{p['tensor_s'] * 1e6:.1f} us"),
            ("torch.save bandwidth", _gbps(sbw)),
            ("serialize fit", f"R2 {f['serialize']['r2']:.4f}, "
                              f"rel. RMS error {f['serialize']['rel_rms']:.1%}"),
        ]  # fmt: skip
    rows.append(("took", f"{profile['seconds']:.1f} s"))
    rows.append(("profile", f"{args.name} -> {path}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "calibrate", help="measure this machine's cost-model parameters into a named profile"
    )
    p.add_argument("--dir", required=True, help="target directory (where checkpoints go)")
    p.add_argument("--name", default="default", help="profile name [default]")
    p.add_argument("--repeats", type=int, default=3,
                   help="repetitions of each measurement; the median is fitted [3]")  # fmt: skip
    p.add_argument("--max-mib", type=int, default=16,
                   help="largest file in MiB; larger see sustained bandwidth [16]")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="fewer, smaller files (for tests)")
    p.add_argument("--no-serialization", action="store_true", help="skip timing torch.save")
    p.add_argument("--raw-writes", action="store_true",
                   help="fit the rank stream to raw pwrite+fsync, not to whole deeppart.save "
                        "calls (the default with torch installed)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the profile as JSON")
    p.set_defaults(func=run)
