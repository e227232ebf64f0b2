"""Benchmark of the planner service (``deeppart serve``).

Starts ``python -m deeppart serve`` on a loopback port, uploads one structure
(``--leaves`` leaves) and drives the server from ``--clients`` concurrent
client processes:

- **hits**: ``--requests`` fingerprint-only Plan RPCs for the known structure
  and parameters, answered from the service's response cache;
- **misses**: ``--misses`` Plan RPCs with world sizes never asked before, so
  the service plans each one (the manifest is known: no upload);
- **end-to-end hits**: ``PlannerClient.plan`` calls, which also rebuild and
  verify the plan in the client (``Plan.from_pieces``);

and, in the same run, in-process ``deeppart.plan`` of the same structure.
Throughput is requests per second over the whole phase; latencies are per RPC
(with ``--rate``, measured from each request's scheduled start, so that a
stalled server is not hidden). The server's RSS is sampled from /proc.

    .venv/bin/python bench/service.py                      # a short run
    .venv/bin/python bench/service.py --requests 100000    # the long run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import deeppart  # noqa: E402

PLAN = "/deeppart.planner.v1.Planner/Plan"


def make_manifest(n: int) -> deeppart.Manifest:
    """A transformer-like structure of ``n`` leaves (weights, biases, norms)."""
    leaves: list[dict[str, Any]] = []
    kinds = [("weight", [1024, 1024]), ("bias", [1024]), ("norm", [1024]), ("proj", [4096, 1024])]
    for i in range(n - 1):
        name, shape = kinds[i % len(kinds)]
        leaves.append(
            {"path": ["model", "layers", i // len(kinds), name], "dtype": "bfloat16",
             "shape": shape}
        )
    leaves.append({"path": ["optim", "param_groups"], "kind": "object", "nbytes": 4096})
    return deeppart.Manifest.from_leaves(leaves)


def request_bytes(manifest: deeppart.Manifest, world_size: int) -> bytes:
    from deeppart.proto import planner_pb2 as pb

    req = pb.PlanRequest(
        plan_fingerprint=deeppart.plan_fingerprint(manifest, world_size),
        manifest_fingerprint=manifest.fingerprint,
        world_size=world_size,
        algorithm="balanced",
        planner_version=deeppart.PLANNER_VERSION,
        job_id=f"bench-{os.getpid()}",
    )
    data: bytes = req.SerializeToString()
    return data


def _worker(
    target: str,
    leaves: int,
    world_sizes: list[int],
    mode: str,
    rate: float,
    barrier: Any,
    out: Any,
) -> None:
    """One client process: its requests, then its latencies (seconds) on ``out``."""
    import grpc

    from deeppart.proto import planner_pb2 as pb
    from deeppart.service.client import PlannerClient

    manifest = make_manifest(leaves)

    def paced(send: Callable[[int], bool]) -> tuple[list[float], int]:
        """Sends every request at its due time (``rate`` per second, or
        back to back); latencies are measured from the due time."""
        latencies: list[float] = []
        errors = 0
        barrier.wait()
        start = time.perf_counter()
        for i, ws in enumerate(world_sizes):
            due = start + i / rate if rate else time.perf_counter()
            if rate:
                time.sleep(max(0.0, due - time.perf_counter()))
            if not send(ws):
                errors += 1
            latencies.append(time.perf_counter() - due)
        return latencies, errors

    if mode == "e2e":
        client = PlannerClient(target, timeout_s=30, fallback=False)
        client.plan(manifest, world_sizes[0])  # connect

        def send_e2e(ws: int) -> bool:
            try:
                client.plan(manifest, ws)
            except Exception:
                return False
            return True

        latencies, errors = paced(send_e2e)
        client.close()
    else:
        channel = grpc.insecure_channel(
            target.removeprefix("grpc://"), options=[("grpc.max_receive_message_length", -1)]
        )
        call = channel.unary_unary(PLAN)
        requests = {ws: request_bytes(manifest, ws) for ws in set(world_sizes)}
        grpc.channel_ready_future(channel).result(timeout=30)

        def send_raw(ws: int) -> bool:
            try:
                resp = pb.PlanResponse.FromString(call(requests[ws], timeout=30))
            except grpc.RpcError:
                return False
            return bool(resp.status == pb.PLAN_STATUS_OK)

        latencies, errors = paced(send_raw)
        channel.close()
    out.put((latencies, errors))


def rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def run_phase(
    name: str,
    target: str,
    args: argparse.Namespace,
    per_client: list[list[int]],
    mode: str,
    server_pid: int,
    rate: float,
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")  # grpc and fork do not mix
    barrier = ctx.Barrier(len(per_client) + 1)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(target, args.leaves, ws, mode, rate / len(per_client), barrier, out),
        )
        for ws in per_client
    ]
    for p in procs:
        p.start()
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            samples.append(rss_of(server_pid))

    barrier.wait(timeout=300)
    sampler = threading.Thread(target=sample, daemon=True)
    start = time.perf_counter()
    sampler.start()
    results = [out.get(timeout=3600) for _ in procs]
    elapsed = time.perf_counter() - start
    done.set()
    for p in procs:
        p.join(60)
    lat = sorted(x for r in results for x in r[0])
    n = len(lat)
    return {
        "phase": name,
        "requests": n,
        "errors": sum(r[1] for r in results),
        "seconds": round(elapsed, 3),
        "per_s": round(n / elapsed, 1),
        "p50_ms": round(quantile(lat, 0.50) * 1e3, 3),
        "p99_ms": round(quantile(lat, 0.99) * 1e3, 3),
        "max_ms": round(lat[-1] * 1e3, 3) if lat else float("nan"),
        "rss_mib_first": round(samples[0] / 2**20, 1) if samples else None,
        "rss_mib_last": round(samples[-1] / 2**20, 1) if samples else None,
        "rss_mib_max": round(max(samples) / 2**20, 1) if samples else None,
    }


def in_process(
    manifest: deeppart.Manifest, world_sizes: list[int], cache: deeppart.PlanCache | bool
) -> dict[str, Any]:
    """deeppart.plan in this process, one call at a time."""
    lat: list[float] = []
    start = time.perf_counter()
    for ws in world_sizes:
        t = time.perf_counter()
        deeppart.plan(manifest, ws, cache=cache)
        lat.append(time.perf_counter() - t)
    elapsed = time.perf_counter() - start
    lat.sort()
    return {
        "phase": "in-process " + ("plan" if cache is False else "cache hit"),
        "requests": len(lat),
        "errors": 0,
        "seconds": round(elapsed, 3),
        "per_s": round(len(lat) / elapsed, 1),
        "p50_ms": round(quantile(lat, 0.5) * 1e3, 3),
        "p99_ms": round(quantile(lat, 0.99) * 1e3, 3),
        "max_ms": round(lat[-1] * 1e3, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--leaves", type=int, default=10_000)
    ap.add_argument("--world-size", type=int, default=64)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=20_000, help="cache-hit Plan RPCs")
    ap.add_argument("--misses", type=int, default=320, help="Plan RPCs that the service plans")
    ap.add_argument("--e2e", type=int, default=1600, help="PlannerClient.plan calls (hits)")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="offered load, RPC/s in all (0: closed loop)"
    )
    ap.add_argument("--workers", type=int, default=32, help="the server's RPC threads")
    ap.add_argument("--json", action="store_true", help="print one JSON object per phase")
    args = ap.parse_args(argv)

    manifest = make_manifest(args.leaves)
    tmp = Path(tempfile.mkdtemp(prefix="deeppart-bench-"))
    port_file = tmp / "port"
    server = subprocess.Popen(
        [sys.executable, "-m", "deeppart", "serve", "--listen", "127.0.0.1:0",
         "--cache-dir", str(tmp / "cache"), "--port-file", str(port_file),
         "--log-file", str(tmp / "serve.log"), "--workers", str(args.workers)],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("deeppart serve did not start")
            time.sleep(0.05)
        target = f"grpc://127.0.0.1:{int(port_file.read_text())}"

        from deeppart.service.client import PlannerClient

        with PlannerClient(target, timeout_s=60, fallback=False) as client:
            t = time.perf_counter()
            client.plan(manifest, args.world_size)  # NEED_MANIFEST, upload, plan
            upload_ms = (time.perf_counter() - t) * 1e3
            wire_bytes = len(client._wire_manifest(manifest).SerializeToString())

        c = args.clients
        hits = [[args.world_size] * (args.requests // c) for _ in range(c)]
        rows.append(run_phase("service hits", target, args, hits, "raw", server.pid, args.rate))
        # Misses: world sizes nobody asked for yet, all different.
        first = args.world_size + 1
        miss_ws = list(range(first, first + args.misses))
        misses = [miss_ws[i::c] for i in range(c)]
        rows.append(run_phase("service misses", target, args, misses, "raw", server.pid, 0.0))
        e2e = [[args.world_size] * (args.e2e // c) for _ in range(c)]
        rows.append(run_phase("client.plan hits", target, args, e2e, "e2e", server.pid, 0.0))
        local_ws = miss_ws[: max(1, min(len(miss_ws), 200))]
        rows.append(in_process(manifest, local_ws, False))
        memory_cache = deeppart.PlanCache(disk=False)
        deeppart.plan(manifest, args.world_size, cache=memory_cache)
        rows.append(in_process(manifest, [args.world_size] * 1000, memory_cache))
        with PlannerClient(target, timeout_s=60, fallback=False) as client:
            stats = client.stats()
    finally:
        server.terminate()
        server.wait(60)

    header = {
        "leaves": len(manifest),
        "manifest_wire_bytes": wire_bytes,
        "manifest_json_bytes": len(manifest.to_json()),
        "first_request_with_upload_ms": round(upload_ms, 1),
        "clients": args.clients,
        "rate": args.rate or "closed loop",
        "server_manifest_uploads": stats.manifest_uploads,
        "server_plans_computed": stats.plans_computed,
        "server_rss_mib_end": round(stats.rss_bytes / 2**20, 1),
    }
    if args.json:
        print(json.dumps(header))
        for row in rows:
            print(json.dumps(row))
        return 0
    for k, v in header.items():
        print(f"{k:>30}: {v}")
    cols = ["phase", "requests", "errors", "per_s", "p50_ms", "p99_ms", "max_ms",
            "rss_mib_first", "rss_mib_max", "rss_mib_last"]
    print()
    print("  ".join(f"{col:>14}" for col in cols))
    for row in rows:
        print("  ".join(f"{row.get(col, '')!s:>14}" for col in cols))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
