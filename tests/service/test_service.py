"""The gRPC planner service (``deeppart serve``) and its client.

In-process servers for most tests; ``python -m deeppart serve`` subprocesses
for restart, SIGKILL and SIGTERM. Every wait is bounded; nothing is timed.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("google.protobuf")
pytest.importorskip("grpc_health")
pytest.importorskip("grpc_reflection")

import deeppart  # noqa: E402
from deeppart.errors import WireError  # noqa: E402
from deeppart.proto import planner_pb2 as pb  # noqa: E402
from deeppart.service import plan_with, resolve_planner, wire  # noqa: E402
from deeppart.service.client import PlannerClient  # noqa: E402
from deeppart.service.server import (  # noqa: E402
    JsonLog,
    PlannerServer,
    ServerConfig,
    config_from_args,
)

ROOT = Path(__file__).resolve().parents[2]
PLAN = "/deeppart.planner.v1.Planner/Plan"
GET_PLAN = "/deeppart.planner.v1.Planner/GetPlan"
STATS = "/deeppart.planner.v1.Planner/Stats"
WAIT_S = 30.0  # upper bound of every wait: generous, never a timing assertion


def _manifest(n: int = 40, tag: str = "model") -> deeppart.Manifest:
    leaves: list[dict[str, Any]] = []
    for i in range(n):
        leaves.append(
            {
                "path": [tag, "layers", i // 4, f"w{i % 4}"],
                "dtype": "float32",
                "shape": [256, 64 + i],
            }
        )
    leaves.append({"path": [tag, "layers", "0", "w0"], "kind": "object", "nbytes": 10})
    leaves.append({"path": ["optim", "param_groups"], "kind": "object", "nbytes": 300})
    leaves.append({"path": ["rng", -3], "dtype": "uint8", "shape": [5056], "owner": 1})
    leaves.append({"path": ["step"], "dtype": "int64", "shape": []})
    return deeppart.Manifest.from_leaves(leaves)


def _pieces(plan: deeppart.Plan) -> list[list[tuple[int, int, int]]]:
    return [plan.rank_pieces(r) for r in range(plan.world_size)]


def _request(
    m: deeppart.Manifest,
    world_size: int = 4,
    *,
    algorithm: str = "balanced",
    with_manifest: bool = False,
    **fields: Any,
) -> pb.PlanRequest:
    values: dict[str, Any] = {
        "plan_fingerprint": deeppart.plan_fingerprint(m, world_size, algorithm=algorithm),
        "manifest_fingerprint": m.fingerprint,
        "world_size": world_size,
        "algorithm": algorithm,
        "planner_version": deeppart.PLANNER_VERSION,
    }
    values.update(fields)
    req = pb.PlanRequest(**values)
    if with_manifest:
        req.manifest.CopyFrom(wire.manifest_to_proto(m))
    return req


class Server:
    """An in-process server with its log and a raw channel to it."""

    def __init__(self, cache_dir: Path, **config: Any) -> None:
        self.log = io.StringIO()
        cfg = ServerConfig(listen="127.0.0.1:0", cache_dir=cache_dir, grace_s=5.0, **config)
        self.server = PlannerServer(cfg, JsonLog(self.log)).start()
        self.port = self.server.port
        self.url = f"grpc://127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def raw(self, method: str, data: bytes, metadata: Any = None) -> bytes:
        call = self.channel.unary_unary(method)
        result: bytes = call(data, timeout=WAIT_S, metadata=metadata)
        return result

    def stats(self, metadata: Any = None) -> pb.StatsResponse:
        resp: pb.StatsResponse = pb.StatsResponse.FromString(
            self.raw(STATS, pb.StatsRequest().SerializeToString(), metadata)
        )
        return resp

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(**config: Any) -> Server:
        config.setdefault("cache_dir", tmp_path / f"cache{len(servers)}")
        s = Server(**config)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def _client(server: Server, **kw: Any) -> PlannerClient:
    kw.setdefault("timeout_s", WAIT_S)
    kw.setdefault("fallback", False)
    return PlannerClient(server.url, **kw)


def _code(e: pytest.ExceptionInfo[Any]) -> Any:
    return e.value.code()


# ----------------------------------------------------------------------------
# Wire format.


def test_manifest_wire_round_trip() -> None:
    m = _manifest()
    msg = wire.manifest_to_proto(m)
    back = wire.manifest_from_proto(pb.Manifest.FromString(msg.SerializeToString()))
    assert back.fingerprint == m.fingerprint
    assert back.leaves() == m.leaves()
    # Keys are deduplicated and paths front coded.
    assert sorted(msg.string_keys) == sorted(set(msg.string_keys))
    assert list(msg.string_keys).count("model") == 1
    assert msg.shared[1] == 3  # ("model", "layers", 0, "w1") shares three keys with leaf 0
    assert list(msg.owned_leaves) == [len(m) - 2] and list(msg.owner_ranks) == [1]


def test_manifest_wire_is_compact() -> None:
    leaves = [
        {
            "path": ["model", "encoder", "layer", i // 8, f"param{i % 8}"],
            "dtype": "bfloat16",
            "shape": [1024, 1024],
        }
        for i in range(2000)
    ]
    m = deeppart.Manifest.from_leaves(leaves)
    size = len(wire.manifest_to_proto(m).SerializeToString())
    assert size * 8 < len(m.to_json())


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m.shared.append(0), "per-leaf arrays disagree"),
        (lambda m: m.suffix_keys.append(0), "suffix_len adds up to"),
        (lambda m: m.dims.append(3), "ndim adds up to"),
        (lambda m: m.suffix_keys.__setitem__(0, 998), "string key 499 out of range"),
        (lambda m: m.dtype.__setitem__(0, 77), "dtype 77 out of range"),
        (lambda m: m.owned_leaves.__setitem__(0, 10**6), "owned leaf 1000000 does not exist"),
        (lambda m: setattr(m, "version", 9), "unsupported version 9"),
    ],
)
def test_manifest_wire_rejects_inconsistent_messages(
    mutate: Callable[[pb.Manifest], None], message: str
) -> None:
    msg = wire.manifest_to_proto(_manifest())
    mutate(msg)
    with pytest.raises(WireError, match=message):
        wire.manifest_from_proto(msg)


# ----------------------------------------------------------------------------
# Plans through the service.


@pytest.mark.parametrize("algorithm", deeppart.ALGORITHMS)
def test_plan_round_trip_equals_local_plan(
    make_server: Callable[..., Server], algorithm: str
) -> None:
    server = make_server()
    m = _manifest()
    cost = deeppart.CostModel(bandwidth=2e9, min_piece_bytes=4096)
    topo = deeppart.Topology(2)
    with _client(server) as client:
        remote = client.plan(m, 8, algorithm=algorithm, cost=cost, topology=topo)
    local = deeppart.plan(m, 8, algorithm=algorithm, cost=cost, topology=topo)
    assert remote.fingerprint == local.fingerprint
    assert _pieces(remote) == _pieces(local)
    assert remote.stats.makespan == local.stats.makespan


def test_fingerprint_first_uploads_a_manifest_once(make_server: Callable[..., Server]) -> None:
    server = make_server()
    m = _manifest()
    with _client(server, job_id="job-a") as client:
        client.plan(m, 4)
        s = server.stats()
        assert (s.need_manifest, s.manifest_uploads, s.plans_computed) == (1, 1, 1)
        # The same structure again, and with other parameters: no manifest is sent.
        client.plan(m, 4)
        client.plan(m, 16, algorithm="lpt")
    with _client(server, job_id="job-b") as other:
        assert _pieces(other.plan(m, 4)) == _pieces(deeppart.plan(m, 4))
    s = server.stats()
    assert s.manifest_uploads == 1 and s.need_manifest == 1
    assert s.plan_requests == 5
    assert s.response_cache_hits == 2 and s.plans_computed == 2
    assert s.known_manifests == 1
    jobs = {j.job_id: j for j in s.jobs}
    assert jobs["job-a"].requests >= 4 and jobs["job-b"].requests == 1
    assert jobs["job-b"].p99_ms > 0 and jobs["job-a"].errors == 0
    # Structured logs: one JSON object per line, one per RPC.
    records = [json.loads(line) for line in server.log.getvalue().splitlines()]
    rpcs = [r for r in records if r["event"] == "rpc" and r["method"] == "Plan"]
    assert len(rpcs) == 5
    assert {r["served_from"] for r in rpcs} >= {"need-manifest", "computed", "response-cache"}


def test_request_without_manifest_carries_none_on_the_wire(
    make_server: Callable[..., Server],
) -> None:
    server = make_server()
    m = _manifest()
    first = pb.PlanResponse.FromString(server.raw(PLAN, _request(m).SerializeToString()))
    assert first.status == pb.PLAN_STATUS_NEED_MANIFEST
    full = _request(m, with_manifest=True).SerializeToString()
    assert pb.PlanResponse.FromString(server.raw(PLAN, full)).status == pb.PLAN_STATUS_OK
    bare = _request(m, 6).SerializeToString()
    assert len(bare) < 200 < len(full)
    resp = pb.PlanResponse.FromString(server.raw(PLAN, bare))
    assert resp.status == pb.PLAN_STATUS_OK and resp.served_from == "computed"


def test_concurrent_requests_for_one_structure_plan_it_once(
    make_server: Callable[..., Server],
) -> None:
    server = make_server()
    m = _manifest(200)
    results: list[deeppart.Plan] = []

    def job(i: int) -> None:
        with _client(server, job_id=f"job-{i}") as client:
            results.append(client.plan(m, 8))

    threads = [threading.Thread(target=job, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert len(results) == 8
    assert len({p.fingerprint for p in results}) == 1
    s = server.stats()
    assert s.plans_computed == 1
    assert len(s.jobs) == 8


def test_client_local_cache_is_asked_first(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    server = make_server()
    m = _manifest()
    local = deeppart.PlanCache(tmp_path / "local")
    with _client(server, cache=local) as client:
        first = client.plan(m, 4)
        again = client.plan(m, 4)
    assert first.stats.source == "service" and again.stats.source == "memory"
    assert _pieces(again) == _pieces(first)
    assert server.stats().plan_requests == 2  # NEED_MANIFEST and the upload; not the repeat


def test_get_plan_by_fingerprint(make_server: Callable[..., Server]) -> None:
    server = make_server()
    m = _manifest()
    cost = deeppart.CostModel(piece_s=1e-4)
    with _client(server) as client:
        planned = client.plan(m, 4, cost=cost, topology=deeppart.Topology(2))
        got = client.get_plan(planned.fingerprint, m)
        assert got is not None and _pieces(got) == _pieces(planned)
        assert got.fingerprint == planned.fingerprint
        assert client.get_plan("0" * 64, m) is None


def test_a_corrupt_manifest_file_is_requested_again(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    m = _manifest()
    first = make_server(cache_dir=tmp_path / "shared")
    with _client(first) as client:
        client.plan(m, 4)
    stored = tmp_path / "shared" / "service" / "manifests" / f"{m.fingerprint}.pb"
    stored.write_bytes(stored.read_bytes()[:-7])  # torn by a disk that lied about fsync
    second = make_server(cache_dir=tmp_path / "shared")
    with _client(second) as client:
        assert _pieces(client.plan(m, 5)) == _pieces(deeppart.plan(m, 5))
    s = second.stats()
    assert (s.need_manifest, s.manifest_uploads) == (1, 1)
    assert '"event":"manifest_corrupt"' in second.log.getvalue()


def _disk_bytes(directory: Path) -> int:
    """What the files of ``directory`` take, in whole 4 KiB blocks."""
    return sum(-(-f.stat().st_size // 4096) * 4096 for f in directory.glob("*.pb"))


def test_the_manifest_store_keeps_to_its_disk_budget_least_recently_used_out(
    tmp_path: Path,
) -> None:
    from deeppart.service.server import ManifestStore

    log = io.StringIO()
    manifests = [_manifest(40 + i, tag=f"m{i}") for i in range(12)]
    blobs = [wire.manifest_to_proto(m).SerializeToString() for m in manifests]
    size = -(-max(len(b) for b in blobs) // 4096) * 4096
    budget = 5 * size
    store = ManifestStore(tmp_path / "manifests", JsonLog(log), max_bytes=budget)
    for i, (m, b) in enumerate(zip(manifests, blobs, strict=True)):
        store.put(m, b)
        if i >= 1:
            # Using the first manifest keeps it the most recently used.
            time.sleep(0.002)  # distinct modification times, not a timing assertion
            assert store.get(manifests[0].fingerprint) is not None
        assert _disk_bytes(tmp_path / "manifests") <= budget
    kept = {f.stem for f in (tmp_path / "manifests").glob("*.pb")}
    assert manifests[0].fingerprint in kept, "the one in use survives"
    assert manifests[-1].fingerprint in kept, "the newest survives"
    assert manifests[1].fingerprint not in kept, "an old unused one is gone"
    assert '"event":"store_evicted"' in log.getvalue()
    # In memory they are all still served; after a restart only the kept ones.
    assert all(store.get(m.fingerprint) is not None for m in manifests)
    again = ManifestStore(tmp_path / "manifests", JsonLog(io.StringIO()), max_bytes=budget)
    for m in manifests:
        got = again.get(m.fingerprint)
        assert (got is not None) == (m.fingerprint in kept)
        assert got is None or got.fingerprint == m.fingerprint
    # A lowered budget is applied when the store opens; a manifest larger than
    # the whole store is served but not written.
    small = ManifestStore(tmp_path / "manifests", JsonLog(io.StringIO()), max_bytes=size)
    assert _disk_bytes(tmp_path / "manifests") <= size
    tiny = ManifestStore(tmp_path / "tiny", JsonLog(log), max_bytes=100)
    tiny.put(manifests[3], blobs[3])
    assert not list((tmp_path / "tiny").glob("*.pb"))
    assert tiny.get(manifests[3].fingerprint) is not None
    assert '"event":"not_persisted"' in log.getvalue()
    del small


def test_many_distinct_requests_cannot_grow_the_service_disk_without_bound(
    make_server: Callable[..., Server], tmp_path: Path
) -> None:
    """Distinct valid plans (no token needed by default) fill the service's
    manifests and plans directories only up to the store budget, and a
    client whose manifest was evicted is still answered correctly after a
    restart: the server asks for the manifest again."""
    budget = 64 * 1024
    shared = tmp_path / "shared"
    server = make_server(cache_dir=shared, store_bytes=budget)
    first = _manifest(30, tag="first")
    with _client(server) as client:
        client.plan(first, 4)
        for i in range(60):
            client.plan(_manifest(30 + i % 7, tag=f"job{i}"), 2 + i % 5)
    manifests_dir, plans_dir = shared / "service" / "manifests", shared / "service" / "plans"
    assert _disk_bytes(manifests_dir) <= budget
    assert _disk_bytes(plans_dir) <= budget // 16
    assert not (manifests_dir / f"{first.fingerprint}.pb").exists(), "the first one was evicted"
    server.close()
    again = make_server(cache_dir=shared, store_bytes=budget)
    with _client(again) as client:
        assert _pieces(client.plan(first, 4)) == _pieces(deeppart.plan(first, 4))
    s = again.stats()
    assert (s.need_manifest, s.manifest_uploads) == (1, 1)


def test_health_and_reflection(make_server: Callable[..., Server]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    server = make_server(token="secret")  # neither needs the token
    health = health_pb2_grpc.HealthStub(server.channel)
    for name in ("", "deeppart.planner.v1.Planner"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(server.channel)
    answers = list(
        stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=WAIT_S
        )
    )
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"deeppart.planner.v1.Planner", "grpc.health.v1.Health"} <= names
    # A client generated from the .proto talks to the service as it is.
    from deeppart.proto import planner_pb2_grpc

    planner: Any = planner_pb2_grpc.PlannerStub(server.channel)  # type: ignore[no-untyped-call]
    stats = planner.Stats(
        pb.StatsRequest(), timeout=WAIT_S, metadata=(("authorization", "Bearer secret"),)
    )
    assert stats.serving and stats.planner_version == deeppart.PLANNER_VERSION


# ----------------------------------------------------------------------------
# Authentication and TLS.


def test_token(make_server: Callable[..., Server], caplog: pytest.LogCaptureFixture) -> None:
    server = make_server(token="s3cret-token")
    data = pb.StatsRequest().SerializeToString()
    for metadata, message in [
        (None, "missing bearer token"),
        ((("authorization", "Bearer wrong"),), "invalid bearer token"),
        ((("authorization", "Basic s3cret-token"),), "invalid bearer token"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            server.raw(STATS, data, metadata)
        assert _code(e) == grpc.StatusCode.UNAUTHENTICATED
        assert message in e.value.details()
    assert server.stats((("authorization", "Bearer s3cret-token"),)).requests >= 4
    m = _manifest()
    with _client(server, token="s3cret-token") as client:
        assert _pieces(client.plan(m, 4)) == _pieces(deeppart.plan(m, 4))
    # A wrong token is a configuration error: it raises (planning in process
    # would hide it), even with fallback on; nothing is counted as a fallback.
    with PlannerClient(server.url, token="nope", timeout_s=WAIT_S) as client:
        with pytest.raises(deeppart.PlannerServiceError, match=r"UNAUTHENTICATED.*check the token"):
            client.plan(m, 2)
        assert client.sources["local-fallback"] == 0
    s = server.stats((("authorization", "Bearer s3cret-token"),))
    assert s.errors_by_code["UNAUTHENTICATED"] == 4


def test_token_from_file_or_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from deeppart.tools.cli import build_parser

    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    args = build_parser().parse_args(
        ["serve", "--cache-dir", str(tmp_path), "--token-file", str(token_file)]
    )
    assert config_from_args(args).token == "from-file"
    monkeypatch.setenv("DEEPPART_TOKEN", "from-env")
    args = build_parser().parse_args(["serve", "--cache-dir", str(tmp_path)])
    assert config_from_args(args).token == "from-env"
    monkeypatch.delenv("DEEPPART_TOKEN")
    assert config_from_args(args).token is None


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    try:
        from cryptography import x509  # type: ignore[import-not-found, unused-ignore]

        del x509
    except ImportError:
        pass
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("TLS test needs the openssl CLI (or the cryptography package)")
    subprocess.run(
        [
            openssl,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


def test_tls(make_server: Callable[..., Server], tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    server = make_server(tls_cert=cert, tls_key=key, token="t")
    m = _manifest()
    with PlannerClient(
        f"localhost:{server.port}", tls=cert, token="t", timeout_s=WAIT_S, fallback=False
    ) as client:
        assert _pieces(client.plan(m, 4)) == _pieces(deeppart.plan(m, 4))
        assert client.stats().plans_computed == 1
    # Plain text to a TLS server fails; the client falls back.
    plain = PlannerClient(f"grpc://127.0.0.1:{server.port}", token="t", timeout_s=5, retries=0)
    assert _pieces(plain.plan(m, 4)) == _pieces(deeppart.plan(m, 4))
    plain.close()


# ----------------------------------------------------------------------------
# Bad input.


def test_bad_input_statuses(make_server: Callable[..., Server]) -> None:
    server = make_server(max_message_bytes=256 * 1024)
    m = _manifest()
    other = _manifest(tag="other")
    bad_dtype = wire.manifest_to_proto(m)
    bad_dtype.dtypes[0] = "float33"
    bad_cost = _request(m)
    bad_cost.cost.bandwidth = -1.0
    mismatched = _request(m, with_manifest=True)
    mismatched.manifest.CopyFrom(wire.manifest_to_proto(other))
    wrong_params = _request(m, with_manifest=True)
    wrong_params.world_size = 5
    big = deeppart.Manifest.from_leaves(
        [
            {"path": [f"leaf-with-a-long-unique-name-{i}"], "dtype": "float32", "shape": [i + 1]}
            for i in range(20000)
        ]
    )
    cases: list[tuple[str, bytes, Any, str]] = [
        (
            "malformed",
            b"\xff\xff\xff\xff",
            grpc.StatusCode.INVALID_ARGUMENT,
            "malformed PlanRequest",
        ),
        (
            "oversized",
            _request(big, with_manifest=True).SerializeToString(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        ),
        (
            "invalid manifest",
            _request(m, manifest=bad_dtype).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            'unknown dtype "float33"',
        ),
        (
            "inconsistent manifest",
            _request(m, manifest=pb.Manifest(version=1, shared=[0])).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "invalid manifest: manifest: per-leaf arrays",
        ),
        (
            "manifest fingerprint mismatch",
            mismatched.SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "manifest fingerprint mismatch",
        ),
        (
            "plan fingerprint mismatch",
            wrong_params.SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "plan fingerprint mismatch",
        ),
        (
            "unknown algorithm",
            pb.PlanRequest(
                plan_fingerprint="a" * 64,
                manifest_fingerprint="b" * 64,
                world_size=2,
                algorithm="magic",
            ).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown algorithm 'magic'",
        ),
        (
            "world size 0",
            pb.PlanRequest(
                plan_fingerprint="a" * 64, manifest_fingerprint="b" * 64
            ).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "world_size must be at least 1",
        ),
        (
            "bad fingerprint",
            pb.PlanRequest(plan_fingerprint="xyz", world_size=2).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "plan_fingerprint must be 64 lowercase hex digits",
        ),
        (
            "invalid cost",
            _request(m, with_manifest=True, cost=bad_cost.cost).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "bandwidth must be a finite number > 0",
        ),
        (
            "planner version",
            _request(m, planner_version="0.0.0+old").SerializeToString(),
            grpc.StatusCode.FAILED_PRECONDITION,
            "planner version mismatch",
        ),
    ]
    job = (("x-deeppart-job", "bad-client"),)  # the job id from metadata
    for name, data, code, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            server.raw(PLAN, data, job)
        assert _code(e) == code, name
        assert message in e.value.details(), (name, e.value.details())
    with pytest.raises(grpc.RpcError) as e:
        server.raw(GET_PLAN, pb.GetPlanRequest(plan_fingerprint="c" * 64).SerializeToString())
    assert _code(e) == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        server.raw(STATS, b"\x0a")
    assert _code(e) == grpc.StatusCode.INVALID_ARGUMENT
    # The server keeps serving.
    with _client(server) as client:
        assert _pieces(client.plan(m, 4)) == _pieces(deeppart.plan(m, 4))
    s = server.stats()
    assert s.errors_by_code["INVALID_ARGUMENT"] == 10
    bad = {j.job_id: j for j in s.jobs}["bad-client"]
    assert bad.requests == bad.errors == len(cases) - 1  # the oversized one never arrived
    assert s.known_manifests == 1  # nothing invalid was stored


# ----------------------------------------------------------------------------
# Fallback.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_fallback_when_the_service_is_down(caplog: pytest.LogCaptureFixture) -> None:
    m = _manifest()
    client = PlannerClient(
        f"grpc://127.0.0.1:{_free_port()}", timeout_s=5, retries=2, backoff_s=0.01
    )
    with caplog.at_level(logging.WARNING, "deeppart.service"):
        plan = client.plan(m, 4)
        assert _pieces(plan) == _pieces(deeppart.plan(m, 4))
        assert "planning in process" in caplog.text and "UNAVAILABLE" in caplog.text
        assert plan.stats.source == "local-fallback"
        # Within the cooldown the service is not asked again (no second warning).
        caplog.clear()
        assert client.plan(m, 4).stats.source == "local-fallback"
        assert caplog.text == ""
    assert client.sources["local-fallback"] == 2
    client.close()
    with pytest.raises(Exception, match="UNAVAILABLE"):
        PlannerClient(f"127.0.0.1:{_free_port()}", retries=0, fallback=False).plan(m, 4)


def test_fallback_when_the_service_stops_mid_request(
    make_server: Callable[..., Server], caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server(test_delay_s=3.0)
    m = _manifest()
    result: list[deeppart.Plan] = []
    client = PlannerClient(server.url, timeout_s=WAIT_S, retries=1, backoff_s=0.01)

    def run() -> None:
        result.append(client.plan(m, 4))

    with caplog.at_level(logging.WARNING, "deeppart.service"):
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + WAIT_S
        while server.server.service.stats.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.server.stop()  # cancels the request in flight
        t.join(WAIT_S)
    assert result and _pieces(result[0]) == _pieces(deeppart.plan(m, 4))
    assert result[0].stats.source == "local-fallback"
    assert "planning in process" in caplog.text
    client.close()


def test_a_plan_that_does_not_check_out_raises(make_server: Callable[..., Server]) -> None:
    """A reachable service that sends a wrong plan is broken: the client
    raises rather than hide it behind an in-process plan."""
    server = make_server()
    m = _manifest()
    with _client(server) as client:
        good = client.plan(m, 4)
    cache = server.server.service.responses
    body = cache.get(good.fingerprint)
    assert body is not None
    # A plan whose pieces do not cover the manifest, under the right fingerprint.
    broken = pb.PlanResponse.FromString(body)
    broken.pieces.stops[0] -= 1
    cache.put(good.fingerprint, broken.SerializeToString())
    # A response for another plan.
    other = deeppart.plan(m, 4, algorithm="lpt")
    cache.put(
        deeppart.plan_fingerprint(m, 4, algorithm="greedy"),
        wire.plan_to_response(other).SerializeToString(),
    )
    for algorithm, reason in [
        ("balanced", "the plan received is invalid"),
        ("greedy", "the service answered for plan"),
    ]:
        with (
            PlannerClient(server.url, timeout_s=WAIT_S) as client,
            pytest.raises(deeppart.PlannerServiceError, match=reason),
        ):
            client.plan(m, 4, algorithm=algorithm)


def test_plan_source_says_service_or_service_cache(make_server: Callable[..., Server]) -> None:
    """The first request is planned by the service ("service"); the same
    request again, from a new client, is served from the service's cache
    ("service-cache"), where it used to say "computed"."""
    server = make_server()
    m = _manifest()
    with _client(server) as client:
        first = client.plan(m, 8)
    with _client(server) as client:
        second = client.plan(m, 8)
        again = client.plan(m, 8)
        assert client.sources == {"service-cache": 2}
    assert (first.stats.source, second.stats.source, again.stats.source) == (
        "service", "service-cache", "service-cache"
    )  # fmt: skip
    assert _pieces(first) == _pieces(second) == _pieces(deeppart.plan(m, 8))
    with pytest.raises(ValueError, match="unknown plan source"):
        first.with_source("somewhere")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("code", "hint"),
    [("PERMISSION_DENIED", "permissions"), ("UNIMPLEMENTED", "DeepPart planner service")],
)
def test_configuration_errors_raise(code: str, hint: str) -> None:
    """A real gRPC server that denies permission, or that is not a DeepPart
    service at all (no handlers: UNIMPLEMENTED): the client raises a
    DeepPart error naming the code, and does not plan in process."""
    from concurrent import futures

    from deeppart.service.options import SERVICE_NAME

    def deny(request: bytes, context: Any) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "job not allowed")
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    if code == "PERMISSION_DENIED":
        handler = grpc.unary_unary_rpc_method_handler(deny)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Plan": handler}),)
        )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with PlannerClient(f"grpc://127.0.0.1:{port}", timeout_s=WAIT_S) as client:
            with pytest.raises(deeppart.PlannerServiceError, match=f"{code}.*{hint}"):
                client.plan(_manifest(), 4)
            assert not client.sources
    finally:
        server.stop(None)


def test_invalid_arguments_raise_as_in_process(make_server: Callable[..., Server]) -> None:
    server = make_server()
    with PlannerClient(server.url, timeout_s=WAIT_S) as client:
        with pytest.raises(deeppart.PlanError, match="unknown algorithm"):
            client.plan(_manifest(), 4, algorithm="magic")
        with pytest.raises(deeppart.PlanError, match="world size must be at least 1"):
            client.plan(_manifest(), 0)
    assert server.stats().requests == 1  # this Stats call: the service was not asked


def test_resolve_planner_and_plan_with(make_server: Callable[..., Server]) -> None:
    assert resolve_planner(None) is None and resolve_planner("local") is None
    with pytest.raises(ValueError, match="expected None, 'local', grpc://"):
        resolve_planner("http://x:1")
    server = make_server()
    client = resolve_planner(server.url)
    assert isinstance(client, PlannerClient) and resolve_planner(server.url) is client
    assert resolve_planner(client) is client
    assert deeppart.PlannerClient is PlannerClient
    m = _manifest()
    assert _pieces(plan_with(server.url, m, 4)) == _pieces(plan_with(None, m, 4))
    assert server.stats().plans_computed == 1


# ----------------------------------------------------------------------------
# `deeppart serve` processes: restart, SIGKILL, SIGTERM.


class Process:
    def __init__(self, cache_dir: Path, tmp: Path, *extra: str) -> None:
        self.port_file = tmp / f"port-{time.monotonic_ns()}"
        self.log_file = tmp / "serve.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deeppart",
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--cache-dir",
                str(cache_dir),
                "--port-file",
                str(self.port_file),
                "--log-file",
                str(self.log_file),
                *extra,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + WAIT_S
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"deeppart serve did not start: {err}")
            time.sleep(0.02)
        self.port = int(self.port_file.read_text())
        self.url = f"grpc://127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(WAIT_S)


def test_manifests_survive_restart_and_sigkill(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    m = _manifest(100)
    first = Process(cache, tmp_path)
    try:
        with PlannerClient(first.url, timeout_s=WAIT_S, fallback=False) as client:
            planned = client.plan(m, 8)
            assert client.stats().manifest_uploads == 1
    finally:
        first.kill()  # SIGKILL: no clean shutdown
    assert first.proc.returncode == -signal.SIGKILL
    second = Process(cache, tmp_path)
    try:
        with PlannerClient(second.url, timeout_s=WAIT_S, fallback=False) as client:
            again = client.plan(m, 8)
            other = client.plan(m, 3)  # a new plan of the known structure
            s = client.stats()
            assert (s.manifest_uploads, s.need_manifest) == (0, 0)
            assert s.known_manifests == 1
            # The plan itself came from the plan cache on disk, the new one was planned.
            assert (s.plan_cache_hits, s.plans_computed) == (1, 1)
            got = client.get_plan(planned.fingerprint, m)
        assert _pieces(again) == _pieces(planned) == _pieces(deeppart.plan(m, 8))
        assert _pieces(other) == _pieces(deeppart.plan(m, 3))
        assert got is not None and _pieces(got) == _pieces(planned)
    finally:
        second.kill()
    leftovers = [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_sigterm_drains(tmp_path: Path) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    m = _manifest()
    proc = Process(tmp_path / "cache", tmp_path, "--test-delay-ms", "1000", "--drain-delay-s", "2")
    try:
        client = PlannerClient(proc.url, timeout_s=WAIT_S, fallback=False, job_id="drain")
        client.plan(m, 4)  # uploads the manifest
        result: list[deeppart.Plan] = []
        t = threading.Thread(target=lambda: result.append(client.plan(m, 4)))
        t.start()
        deadline = time.monotonic() + WAIT_S
        while client.stats().in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # in_flight counts the Stats call itself
        proc.proc.send_signal(signal.SIGTERM)
        channel = grpc.insecure_channel(f"127.0.0.1:{proc.port}")
        health = health_pb2_grpc.HealthStub(channel)
        status = None
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError:
                break
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                break
            time.sleep(0.02)
        channel.close()
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        t.join(WAIT_S)
        assert result and _pieces(result[0]) == _pieces(deeppart.plan(m, 4))
        assert proc.proc.wait(WAIT_S) == 0
        client.close()
        events = [json.loads(line)["event"] for line in proc.log_file.read_text().splitlines()]
        assert events.index("signal") < events.index("draining") < events.index("stopped")
    finally:
        proc.kill()


# ----------------------------------------------------------------------------
# Holder groups (manifest version 2) on the wire.


def _grouped(tag: str = "model") -> deeppart.Manifest:
    """HSDP-like: shard s of each weight on the ranks r % 4 == s of 8, an
    expert on ranks {0..3}, a buffer owned by rank 5, the rest on every rank."""
    leaves: list[dict[str, Any]] = []
    for i in range(24):
        leaves.append(
            {
                "path": [tag, i // 4, f"w{i % 4}"],
                "dtype": "float32",
                "shape": [128, 40 + i],
                "holders": i % 4,
            }
        )
    leaves.append({"path": [tag, "expert"], "dtype": "bfloat16", "shape": [512, 64], "holders": 4})
    leaves.append({"path": ["rng"], "dtype": "uint8", "shape": [5056], "owner": 5})
    leaves.append({"path": ["step"], "dtype": "int64", "shape": []})
    groups = [[s, s + 4] for s in range(4)] + [[0, 1, 2, 3]]
    return deeppart.Manifest.from_leaves(leaves, groups=groups)


def test_grouped_manifest_wire_round_trip_and_v1_unchanged() -> None:
    m = _grouped()
    msg = wire.manifest_to_proto(m)
    assert msg.version == 2
    # The groups once, as rank lists; one index per leaf (0: none).
    assert list(msg.group_sizes) == [2, 2, 2, 2, 4]
    assert list(msg.group_ranks) == [0, 4, 1, 5, 2, 6, 3, 7, 0, 1, 2, 3]
    assert list(msg.holders) == [i % 4 + 1 for i in range(24)] + [5, 0, 0]
    back = wire.manifest_from_proto(pb.Manifest.FromString(msg.SerializeToString()))
    assert back.fingerprint == m.fingerprint
    assert back.groups == m.groups and back.leaves() == m.leaves()
    # A manifest without groups is the version 1 message old servers read:
    # none of the new fields is on the wire.
    plain = wire.manifest_to_proto(_manifest())
    assert plain.version == 1
    assert {f.name for f, _ in plain.ListFields()}.isdisjoint(
        {"group_sizes", "group_ranks", "holders"}
    )


@pytest.mark.parametrize("algorithm", ["balanced", "lpt", "greedy"])
def test_grouped_plan_over_the_service_equals_the_local_plan(
    make_server: Callable[..., Server], algorithm: str
) -> None:
    server = make_server()
    m = _grouped()
    topo = deeppart.Topology(2)
    with _client(server) as client:
        remote = client.plan(m, 8, algorithm=algorithm, topology=topo)
    local = deeppart.plan(m, 8, algorithm=algorithm, topology=topo)
    assert remote.fingerprint == local.fingerprint
    assert _pieces(remote) == _pieces(local)
    groups = m.groups
    leaves = m.leaves()
    for r, pieces in enumerate(_pieces(remote)):
        for leaf, _, _ in pieces:
            g = leaves[leaf]["holders"]
            assert g is None or r in groups[g], (r, leaf)


def test_grouped_and_ungrouped_manifests_never_share_a_plan(
    make_server: Callable[..., Server],
) -> None:
    server = make_server()
    grouped = _grouped()
    flat = deeppart.Manifest.from_leaves(
        [{k: v for k, v in leaf.items() if k != "holders"} for leaf in grouped.leaves()]
    )
    assert flat.fingerprint != grouped.fingerprint
    assert deeppart.plan_fingerprint(flat, 8) != deeppart.plan_fingerprint(grouped, 8)
    with _client(server) as client:
        first = client.plan(flat, 8)
        second = client.plan(grouped, 8)
    assert _pieces(first) == _pieces(deeppart.plan(flat, 8))
    assert _pieces(second) == _pieces(deeppart.plan(grouped, 8))
    assert _pieces(first) != _pieces(second)
    s = server.stats()
    assert s.plans_computed == 2 and s.manifest_uploads == 2


@functools.cache
def _hostile_groups() -> list[tuple[str, pb.Manifest, str]]:
    base = wire.manifest_to_proto(_grouped())

    def edit(**fields: list[int]) -> pb.Manifest:
        msg = pb.Manifest()
        msg.CopyFrom(base)
        for name, values in fields.items():
            msg.ClearField(name)
            getattr(msg, name).extend(values)
        return msg

    v1 = edit()
    v1.version = 1
    n = len(base.holders)
    return [
        (
            "too many groups",
            edit(group_sizes=[1] * 65537, group_ranks=[0] * 65537),
            "65537 holder groups, more than 65536",
        ),
        (
            "too many entries",
            edit(group_sizes=[4096] * 1025, group_ranks=[1] * (4096 * 1025)),
            "4198400 ranks in holder groups, more than 4194304",
        ),
        ("sizes disagree", edit(group_sizes=[2, 2, 2, 2, 5]), "group_sizes add up to 13"),
        (
            "rank beyond any world",
            edit(group_ranks=[0, 4, 1, 5, 2, 6, 3, 1 << 30, 0, 1, 2, 3]),
            "holder group 3 lists rank 1073741824, not below 1048576",
        ),
        (
            "index out of range",
            edit(holders=[1] * (n - 1) + [9]),
            f"leaf {n - 1}: holder group 8 out of range (5 groups)",
        ),
        ("holders per leaf", edit(holders=[1] * (n + 1)), f"{n} leaves but {n + 1} holders"),
        ("groups without version 2", v1, "holder groups need version 2"),
        ("unsorted group", edit(group_ranks=[4, 0, 1, 5, 2, 6, 3, 7, 0, 1, 2, 3]), "group 0"),
        ("empty group", edit(group_sizes=[2, 2, 2, 2, 4, 0]), "group 5"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_hostile_grouped_manifests_are_refused_by_the_decoder(case: int) -> None:
    _, msg, message = _hostile_groups()[case]
    with pytest.raises((WireError, deeppart.ManifestError), match=re.escape(message)):
        wire.manifest_from_proto(pb.Manifest.FromString(msg.SerializeToString()))


def test_hostile_grouped_rpcs_get_clear_errors(make_server: Callable[..., Server]) -> None:
    server = make_server(max_message_bytes=8 * 1024 * 1024)
    m = _grouped()
    cases: list[tuple[str, bytes, Any, str]] = [
        (
            name,
            _request(m, 8, manifest=msg).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            message,
        )
        for name, msg, message in _hostile_groups()
        if name != "too many entries"  # 4M ranks: larger than this server's messages
    ]
    huge = wire.manifest_to_proto(m)
    huge.group_ranks.extend([1 << 19] * (3 << 20))  # 3 bytes each: 9 MiB
    cases.append(
        (
            "oversized",
            _request(m, 8, manifest=huge).SerializeToString(),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "larger than max",
        )
    )
    # A valid manifest planned for a world its groups do not fit.
    cases.append(
        (
            "rank at or above the world size",
            _request(m, 6, with_manifest=True).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "holder group 2 lists rank 6, but world_size is 6",
        )
    )
    for name, data, code, message in cases:
        with pytest.raises(grpc.RpcError) as e:
            server.raw(PLAN, data)
        assert _code(e) == code, name
        assert message in e.value.details(), (name, e.value.details())
    assert server.stats().known_manifests == 0  # nothing hostile was stored
    # The server keeps serving grouped plans.
    with _client(server) as client:
        assert _pieces(client.plan(m, 8)) == _pieces(deeppart.plan(m, 8))
