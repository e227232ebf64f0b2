"""One hostile-input action in a fresh process, measured: ``python
tests/base/hostile_child.py ACTION ARG...`` prints one JSON line with the error
the action raised (its class and base classes, or null), its message, the
peak RSS it added beyond the process's baseline (everything imported, before
the action) and how long it took.

Actions: ``load DIR``, ``latest ROOT``, ``inspect DIR [FLAGS...]`` (the CLI,
its exit code as the result), ``wire FILE`` (a serialized ``Manifest``
message decoded as the planner service does), ``serve FILE`` (a serialized
``PlanRequest`` sent to a real in-process planner service; the gRPC status
as the result).
"""

from __future__ import annotations

import json
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import grpc

if sys.argv[1:2] == ["load"]:
    import torch  # noqa: F401  (before the baseline: a load needs it; the others do not)

import deeppart
from deeppart.proto import planner_pb2 as pb
from deeppart.service import wire
from deeppart.service.server import JsonLog, PlannerServer, ServerConfig
from deeppart.tools.cli import main as cli_main

PLAN = "/deeppart.planner.v1.Planner/Plan"


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _serve(request: bytes) -> str:
    import io
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        cfg = ServerConfig(listen="127.0.0.1:0", cache_dir=Path(cache), grace_s=5.0)
        server = PlannerServer(cfg, JsonLog(io.StringIO())).start()
        channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
        try:
            channel.unary_unary(PLAN)(request, timeout=60)
            return "OK"
        except grpc.RpcError as e:
            return str(e.code().name)
        finally:
            channel.close()
            server.stop()


def act(action: str, args: list[str]) -> Any:
    if action == "load":
        return type(deeppart.load(args[0])).__name__
    if action == "latest":
        return deeppart.Checkpointer(args[0]).latest()
    if action == "inspect":
        return cli_main(["inspect", *args])
    if action == "wire":
        msg = pb.Manifest.FromString(Path(args[0]).read_bytes())
        return len(wire.manifest_from_proto(msg))
    if action == "serve":
        return _serve(Path(args[0]).read_bytes())
    raise SystemExit(f"unknown action {action}")


def main() -> None:
    action, args = sys.argv[1], sys.argv[2:]
    if action == "serve":  # the server's own baseline: gRPC's threads started
        _serve(pb.PlanRequest().SerializeToString())
    base = _peak_mb()
    t0 = time.monotonic()
    cpu0 = time.process_time()
    error: list[str] | None = None
    message = ""
    result: Any = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = act(action, args)
        except Exception as e:
            error = [c.__name__ for c in type(e).__mro__]
            message = str(e)[:2000]
    seconds = time.monotonic() - t0
    # The CPU time of every thread of this process: the work an input costs,
    # which other jobs on a loaded machine do not stretch as they stretch
    # the wall clock.
    cpu_seconds = time.process_time() - cpu0
    out = {
        "error": error,
        "message": message,
        "result": result,
        "rss_mb": _peak_mb() - base,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }
    print("HOSTILE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
