"""The DeepPart planner service: ``deeppart serve --listen HOST:PORT --cache-dir DIR``.

A gRPC server (Python grpcio, thread pool) of ``deeppart.planner.v1.Planner``,
with standard health checking and server reflection. Requests are fingerprint
first: a Plan request names its structure by fingerprints; the service answers
``PLAN_STATUS_NEED_MANIFEST`` when it does not know the manifest, and the client
resends it once. Known manifests are persisted in the cache directory (atomic
writes), plans go through the planner's plan cache where the binding has one,
and recently used responses are kept in memory as serialized bytes.

The handlers take and return raw bytes, so that malformed requests become
``INVALID_ARGUMENT`` (grpcio's own deserializer would answer ``INTERNAL``) and
cached responses are sent without serializing them again.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deeppart._planner import (
    ALGORITHMS,
    PLANNER_VERSION,
    CostModel,
    Manifest,
    Plan,
    PlanCache,
    Topology,
    plan_fingerprint,
)
from deeppart.errors import DeepPartError, ServiceError
from deeppart.proto import planner_pb2 as pb
from deeppart.saving.plan_cache import plan as plan_in_process
from deeppart.service import wire
from deeppart.service.options import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_RESPONSE_CACHE_BYTES,
    DEFAULT_STORE_BYTES,
    JOB_METADATA_KEY,
    SERVICE_NAME,
    TOKEN_ENV,
)

MAX_JOBS_TRACKED = 1024
MAX_JOB_ID_CHARS = 128
MAX_DETAIL_CHARS = 2000
_FINGERPRINT_CHARS = frozenset("0123456789abcdef")


# ----------------------------------------------------------------------------
# Structured logs.


class JsonLog:
    """One JSON object per line: ``{"ts": ..., "level": ..., "event": ..., ...}``.

    Per-RPC lines are flushed at most every ``flush_s`` (and by a background
    thread), every other line at once: a busy server does not pay one flush
    per request.
    """

    def __init__(self, stream: IO[str] | None = None, flush_s: float = 0.2) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._lock = threading.Lock()
        self._flush_s = flush_s
        self._last_flush = time.monotonic()
        self._dirty = False
        threading.Thread(target=self._flusher, name="log-flush", daemon=True).start()

    def __call__(self, event: str, level: str = "info", **fields: Any) -> None:
        record = {"ts": round(time.time(), 6), "level": level, "event": event, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            try:
                self._stream.write(line + "\n")
                now = time.monotonic()
                if event != "rpc" or level != "info" or now - self._last_flush > self._flush_s:
                    self._stream.flush()
                    self._last_flush = now
                    self._dirty = False
                else:
                    self._dirty = True
            except (OSError, ValueError):
                pass  # a closed log stream must not fail a request

    def flush(self) -> None:
        with self._lock:
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()
            self._dirty = False
            self._last_flush = time.monotonic()

    def _flusher(self) -> None:
        while True:
            time.sleep(self._flush_s)
            if self._dirty:
                self.flush()


# ----------------------------------------------------------------------------
# Persistence.


#: The temporary name :func:`atomic_write` writes under:
#: ``.NAME.<pid>.<thread id>.tmp``.
_TEMP_NAME = re.compile(r"\.(.+)\.(\d+)\.(\d+)\.tmp")


def _temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # someone else's live process (or no such pid at all)
    return True


def remove_stale_temps(directory: Path) -> list[Path]:
    """Removes the temporary files that :func:`atomic_write` left in
    ``directory`` when its process was killed (SIGKILL, power loss) between
    creating and renaming them: those named ``.NAME.<pid>.<tid>.tmp`` whose
    process no longer runs. Returns what it removed. Run when a store opens,
    so such files never outlive the next start of the service."""
    removed: list[Path] = []
    try:
        children = list(directory.iterdir())
    except OSError:
        return removed
    for child in children:
        m = _TEMP_NAME.fullmatch(child.name)
        if m is None or _pid_alive(int(m.group(2))):
            continue  # this process's own (another store may write here), or a live one's
        try:
            if child.is_file() and not child.is_symlink():
                child.unlink()
                removed.append(child)
        except OSError:
            continue
    return removed


def atomic_write(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that a reader (or a restart after SIGKILL)
    sees either the old file or the whole new one: tmp file, fsync, rename, fsync dir.
    A temporary file a SIGKILL leaves is removed when the store opens next
    (:func:`remove_stale_temps`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


#: What a file is charged on disk: its size rounded up to whole blocks.
_BLOCK = 4096


def _charge(size: int) -> int:
    return max(1, -(-size // _BLOCK)) * _BLOCK


class DiskBudget:
    """Bounds the disk that the ``*.pb`` files of one directory take. After a
    new file pushes the total over ``max_bytes``, the least recently used
    files (by modification time, which :meth:`touch` renews on use) are
    removed until the total is below nine tenths of it. Removing a file
    costs a re-upload, never a wrong answer: a client whose manifest is gone
    is answered ``NEED_MANIFEST`` and sends it again, and ``GetPlan`` of a
    forgotten plan is ``NOT_FOUND``, after which the client plans anew."""

    def __init__(self, directory: Path, max_bytes: int, log: JsonLog, what: str) -> None:
        if max_bytes < 0:
            raise ValueError(f"a disk budget cannot be negative ({max_bytes})")
        self.directory = directory
        self.max_bytes = max_bytes
        self._log = log
        self._what = what
        self._lock = threading.Lock()
        for gone in remove_stale_temps(directory):
            log("stale_temp_removed", path=str(gone))
        with self._lock:
            self.bytes = sum(c for _, _, c in self._files())
            if self.bytes > self.max_bytes:  # the budget was lowered since the last run
                self._evict(keep=None)

    def _files(self) -> list[tuple[int, Path, int]]:
        """(modification time, path, charge) of each file, oldest first."""
        out = []
        for path in self.directory.glob("*.pb"):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((st.st_mtime_ns, path, _charge(st.st_size)))
        out.sort()
        return out

    def persist(self, path: Path, data: bytes) -> None:
        """Writes ``data`` as the new file ``path`` (atomically) and counts
        it, making room if the total is then over. A file larger than the
        whole budget is not written; a failed write is logged (the caller
        still serves from memory)."""
        if _charge(len(data)) > self.max_bytes:
            self._log("not_persisted", "warning", path=str(path), bytes=len(data),
                      reason=f"larger than the {self._what} store")  # fmt: skip
            return
        try:
            atomic_write(path, data)
        except OSError as e:
            self._log("persist_failed", "warning", path=str(path), error=str(e))
            return
        with self._lock:
            self.bytes += _charge(len(data))
            if self.bytes > self.max_bytes:
                self._evict(keep=path)

    def touch(self, path: Path) -> None:
        """Marks ``path`` as just used."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def _evict(self, keep: Path | None) -> None:
        files = self._files()
        self.bytes = sum(c for _, _, c in files)  # what is on disk now
        target = self.max_bytes * 9 // 10
        removed = freed = 0
        for _, path, charge in files:
            if self.bytes <= target:
                break
            if path == keep:
                continue
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                self._log("evict_failed", "warning", path=str(path), error=str(e))
                continue
            self.bytes -= charge
            removed += 1
            freed += charge
        self._log("store_evicted", store=self._what, files=removed, bytes=freed,
                  kept_bytes=self.bytes, max_bytes=self.max_bytes)  # fmt: skip


class ManifestStore:
    """Manifests by manifest fingerprint: wire bytes on disk (at most
    ``max_bytes`` of them, least recently used out), parsed ones in memory."""

    def __init__(
        self,
        directory: Path,
        log: JsonLog,
        memory_leaves: int = 2_000_000,
        max_bytes: int = DEFAULT_STORE_BYTES,
    ) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.disk = DiskBudget(directory, max_bytes, log, "manifests")
        self._log = log
        self._memory: OrderedDict[str, Manifest] = OrderedDict()
        self._memory_leaves = memory_leaves  # bounds the parsed manifests kept in memory
        self._leaves = 0
        self._lock = threading.Lock()

    def _path(self, fingerprint: str) -> Path:
        return self.directory / f"{fingerprint}.pb"

    def count(self) -> int:
        return sum(1 for _ in self.directory.glob("*.pb"))

    def _remember(self, fingerprint: str, manifest: Manifest) -> None:
        with self._lock:
            old = self._memory.pop(fingerprint, None)
            if old is not None:
                self._leaves -= len(old)
            self._memory[fingerprint] = manifest
            self._leaves += len(manifest)
            while self._leaves > self._memory_leaves and len(self._memory) > 1:
                _, evicted = self._memory.popitem(last=False)
                self._leaves -= len(evicted)

    def put(self, manifest: Manifest, wire_bytes: bytes) -> None:
        fingerprint = manifest.fingerprint
        path = self._path(fingerprint)
        if path.exists():
            self.disk.touch(path)
        else:  # if not written, still served from memory; re-uploaded after a restart
            self.disk.persist(path, wire_bytes)
        self._remember(fingerprint, manifest)

    def get(self, fingerprint: str) -> Manifest | None:
        with self._lock:
            manifest = self._memory.get(fingerprint)
            if manifest is not None:
                self._memory.move_to_end(fingerprint)
        path = self._path(fingerprint)
        if manifest is not None:
            self.disk.touch(path)
            return manifest
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        self.disk.touch(path)
        try:
            manifest = wire.manifest_from_proto(pb.Manifest.FromString(data))
            if manifest.fingerprint != fingerprint:
                raise ValueError(f"its fingerprint is {manifest.fingerprint}")
        except (DecodeError, ValueError, DeepPartError) as e:
            self._log("manifest_corrupt", "warning", fingerprint=fingerprint, error=str(e))
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self._remember(fingerprint, manifest)
        return manifest


class ResponseCache:
    """Serialized PlanResponse bytes by plan fingerprint, least recently used first out."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def put(self, key: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= len(old)
            self._items[key] = data
            self.bytes += len(data)
            while self.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.bytes -= len(evicted)


# ----------------------------------------------------------------------------
# Statistics.

_HIST_BASE_MS = 0.01
_HIST_RATIO = 1.1
_HIST_BUCKETS = 200  # 0.01 ms * 1.1**200 ~ 1.9e6 ms


def _bucket(ms: float) -> int:
    if ms <= _HIST_BASE_MS:
        return 0
    return min(_HIST_BUCKETS - 1, 1 + int(math.log(ms / _HIST_BASE_MS, _HIST_RATIO)))


def _bucket_ms(i: int) -> float:
    # The geometric middle of bucket i.
    return float(_HIST_BASE_MS * _HIST_RATIO ** (max(i, 1) - 0.5))


@dataclass
class _Job:
    requests: int = 0
    errors: int = 0
    total_ms: float = 0.0
    max_ms: float = 0.0
    hist: list[int] = field(default_factory=lambda: [0] * _HIST_BUCKETS)

    def quantile(self, q: float) -> float:
        n = sum(self.hist)
        if n == 0:
            return 0.0
        need = max(1, math.ceil(q * n))  # nearest rank
        seen = 0
        for i, c in enumerate(self.hist):
            seen += c
            if seen >= need:
                return min(_bucket_ms(i), self.max_ms)
        return self.max_ms


class Stats:
    """Service counters and per-job latency histograms (bounded memory)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {
            "requests": 0,
            "plan_requests": 0,
            "manifest_uploads": 0,
            "need_manifest": 0,
            "plans_computed": 0,
            "response_cache_hits": 0,
            "plan_cache_hits": 0,
        }
        self.errors: dict[str, int] = {}
        self.in_flight = 0
        self._jobs: OrderedDict[str, _Job] = OrderedDict()

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def begin(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.counters["requests"] += 1

    def end(self, job_id: str, ms: float, code: grpc.StatusCode | None) -> None:
        with self._lock:
            self.in_flight -= 1
            if code is not None:
                self.errors[code.name] = self.errors.get(code.name, 0) + 1
            job = self._jobs.get(job_id)
            if job is None:
                if len(self._jobs) >= MAX_JOBS_TRACKED:
                    self._jobs.popitem(last=False)
                job = self._jobs[job_id] = _Job()
            else:
                self._jobs.move_to_end(job_id)
            job.requests += 1
            job.errors += code is not None
            job.total_ms += ms
            job.max_ms = max(job.max_ms, ms)
            job.hist[_bucket(ms)] += 1

    def jobs(self) -> list[pb.JobStats]:
        with self._lock:
            return [
                pb.JobStats(
                    job_id=name,
                    requests=j.requests,
                    errors=j.errors,
                    mean_ms=j.total_ms / j.requests if j.requests else 0.0,
                    p50_ms=j.quantile(0.5),
                    p99_ms=j.quantile(0.99),
                    max_ms=j.max_ms,
                )
                for name, j in self._jobs.items()
            ]


def rss_bytes() -> int:
    """The resident set size of this process, from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# ----------------------------------------------------------------------------
# The service.


def _serialize(msg: Any) -> bytes:
    data: bytes = msg.SerializeToString()
    return data


def _check_fingerprint(value: str, name: str) -> None:
    if len(value) != 64 or not set(value) <= _FINGERPRINT_CHARS:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name} must be 64 lowercase hex digits, got {value[:80]!r}",
        )


class PlannerService:
    """The Planner RPCs. Thread safe; planning runs without the GIL."""

    def __init__(
        self,
        cache_dir: Path,
        *,
        token: str | None = None,
        response_cache_bytes: int = DEFAULT_RESPONSE_CACHE_BYTES,
        store_bytes: int = DEFAULT_STORE_BYTES,
        log: JsonLog | None = None,
        test_delay_s: float = 0.0,
    ) -> None:
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.log = log if log is not None else JsonLog()
        self._token = token.encode() if token else None
        self.manifests = ManifestStore(
            self.cache_dir / "service" / "manifests", self.log, max_bytes=store_bytes
        )
        self._requests_dir = self.cache_dir / "service" / "plans"
        self._requests_dir.mkdir(parents=True, exist_ok=True)
        # A plan's parameters are small, but one per plan fingerprint: a
        # sixteenth of the manifests' budget bounds them too.
        self._requests = DiskBudget(self._requests_dir, store_bytes // 16, self.log, "plans")
        self.responses = ResponseCache(response_cache_bytes)
        self.stats = Stats()
        self.serving = True
        self._test_delay_s = test_delay_s
        self._plan_cache = self._make_plan_cache()
        # One planning run per plan fingerprint at a time; others wait for it.
        self._inflight_lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}

    def _make_plan_cache(self) -> PlanCache | None:
        """The planner's plan cache in the same directory (plans persist there)."""
        try:
            return PlanCache(self.cache_dir)
        except Exception as e:  # a broken plan cache must not stop the service
            self.log("plan_cache_unavailable", "warning", error=str(e))
            return None

    # -- plumbing --------------------------------------------------------------

    def handlers(self) -> grpc.GenericRpcHandler:
        def wrap(name: str, fn: Callable[[bytes, str], bytes]) -> Any:
            def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
                return self._call(name, fn, request, context)

            return grpc.unary_unary_rpc_method_handler(handle)

        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Plan": wrap("Plan", self.plan),
                "GetPlan": wrap("GetPlan", self.get_plan),
                "Stats": wrap("Stats", self.get_stats),
            },
        )

    def _authorize(self, metadata: dict[str, str]) -> None:
        if self._token is None:
            return
        header = metadata.get("authorization", "")
        scheme, _, presented = header.partition(" ")
        if not header:
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            presented.strip().encode(), self._token
        ):
            raise ServiceError(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")

    def _call(
        self,
        name: str,
        fn: Callable[[bytes, str], bytes],
        request: bytes,
        context: grpc.ServicerContext,
    ) -> bytes:
        start = time.perf_counter()
        metadata: dict[str, str] = {}
        for key, value in context.invocation_metadata() or ():
            if isinstance(value, str):
                metadata[key] = value
        job_id = metadata.get(JOB_METADATA_KEY, "")
        self.stats.begin()
        code: grpc.StatusCode | None = None
        message = ""
        try:
            self._authorize(metadata)
            return fn(request, job_id)
        except ServiceError as e:
            code, message = e.code, e.message
        except Exception as e:
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
            self.log("internal_error", "error", method=name, error=message)
        finally:
            ms = (time.perf_counter() - start) * 1e3
            job = (getattr(self._tls, "job", "") or job_id or "-")[:MAX_JOB_ID_CHARS]
            self.stats.end(job, ms, code)
            self.log(
                "rpc",
                method=name,
                job=job,
                ms=round(ms, 3),
                code=code.name if code is not None else "OK",
                served_from=getattr(self._tls, "served_from", ""),
                **({"error": message} if message else {}),
            )
            self._tls.job = ""
            self._tls.served_from = ""
        # Status details travel in HTTP/2 trailers: keep them well under their limit.
        if len(message) > MAX_DETAIL_CHARS:
            message = message[: MAX_DETAIL_CHARS - 3] + "..."
        context.abort(code, message)
        raise AssertionError("unreachable: abort raises")

    _tls = threading.local()

    def _parse(self, cls: Any, data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except DecodeError as e:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"malformed {cls.DESCRIPTOR.name} message ({len(data)} bytes): {e}",
            ) from e

    # -- RPCs -----------------------------------------------------------------

    def plan(self, data: bytes, job_id: str) -> bytes:
        req: pb.PlanRequest = self._parse(pb.PlanRequest, data)
        self._tls.job = req.job_id or job_id
        self.stats.incr("plan_requests")
        if self._test_delay_s:
            time.sleep(self._test_delay_s)
        _check_fingerprint(req.plan_fingerprint, "plan_fingerprint")
        _check_fingerprint(req.manifest_fingerprint, "manifest_fingerprint")
        if req.planner_version and req.planner_version != PLANNER_VERSION:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"planner version mismatch: the client has {req.planner_version}, "
                f"the service {PLANNER_VERSION}",
            )
        algorithm = req.algorithm or "balanced"
        if algorithm not in ALGORITHMS:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}",
            )
        if req.world_size < 1:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"world_size must be at least 1, got {req.world_size}",
            )
        has_manifest = req.HasField("manifest")
        if has_manifest:
            self.stats.incr("manifest_uploads")

        cached = self.responses.get(req.plan_fingerprint)
        if cached is not None:
            self.stats.incr("response_cache_hits")
            return self._served(cached, "response-cache")

        if has_manifest:
            try:
                manifest = wire.manifest_from_proto(req.manifest)
            except (ValueError, DeepPartError) as e:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT, f"invalid manifest: {e}"
                ) from e
            if manifest.fingerprint != req.manifest_fingerprint:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"manifest fingerprint mismatch: the request says {req.manifest_fingerprint}, "
                    f"the manifest sent has {manifest.fingerprint}",
                )
        else:
            found = self.manifests.get(req.manifest_fingerprint)
            if found is None:
                self.stats.incr("need_manifest")
                self._tls.served_from = "need-manifest"
                need = pb.PlanResponse(
                    status=pb.PLAN_STATUS_NEED_MANIFEST,
                    plan_fingerprint=req.plan_fingerprint,
                    manifest_fingerprint=req.manifest_fingerprint,
                    planner_version=PLANNER_VERSION,
                )
                return _serialize(need)
            manifest = found

        for g, ranks in enumerate(manifest.groups):
            if ranks and ranks[-1] >= req.world_size:
                raise ServiceError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"holder group {g} lists rank {ranks[-1]}, but world_size is "
                    f"{req.world_size}; plan for the world the groups were made for",
                )
        try:
            cost = wire.cost_from_proto(req.cost)
            topology = wire.topology_from_proto(req.topology)
            expected = plan_fingerprint(
                manifest, req.world_size, algorithm=algorithm, cost=cost, topology=topology
            )
        except (ValueError, OverflowError, DeepPartError) as e:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        if expected != req.plan_fingerprint:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"plan fingerprint mismatch: the request says {req.plan_fingerprint}, "
                f"its manifest and parameters give {expected}",
            )
        if has_manifest:
            self.manifests.put(manifest, req.manifest.SerializeToString())

        with self._single_flight(req.plan_fingerprint):
            cached = self.responses.get(req.plan_fingerprint)
            if cached is not None:
                self.stats.incr("response_cache_hits")
                return self._served(cached, "response-cache")
            try:
                plan = self._plan(manifest, req.world_size, algorithm, cost, topology)
            except (ValueError, OverflowError, DeepPartError) as e:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
            if plan.fingerprint != req.plan_fingerprint:
                raise ServiceError(
                    grpc.StatusCode.INTERNAL,
                    f"the planner returned a plan with fingerprint {plan.fingerprint}",
                )
            if plan.stats.source == "computed":
                self.stats.incr("plans_computed")
                served_from = "computed"
            else:
                self.stats.incr("plan_cache_hits")
                served_from = "plan-cache"
            body = _serialize(wire.plan_to_response(plan))
            self.responses.put(req.plan_fingerprint, body)
            self._remember_request(req)
            return self._served(body, served_from)

    def _served(self, body: bytes, served_from: str) -> bytes:
        # Serialized messages concatenate as a merge: the tail sets served_from.
        self._tls.served_from = served_from
        return body + _serialize(pb.PlanResponse(served_from=served_from))

    @contextlib.contextmanager
    def _single_flight(self, key: str) -> Iterator[None]:
        with self._inflight_lock:
            lock = self._inflight.setdefault(key, threading.Lock())
        with lock:
            yield
        with self._inflight_lock:
            if self._inflight.get(key) is lock and not lock.locked():
                del self._inflight[key]

    def _plan(
        self,
        manifest: Manifest,
        world_size: int,
        algorithm: str,
        cost: CostModel,
        topology: Topology,
    ) -> Plan:
        return plan_in_process(
            manifest,
            world_size,
            algorithm=algorithm,
            cost=cost,
            topology=topology,
            cache=self._plan_cache if self._plan_cache is not None else False,
        )

    def _remember_request(self, req: pb.PlanRequest) -> None:
        """Persists a plan's parameters (not its manifest) for GetPlan after a restart."""
        path = self._requests_dir / f"{req.plan_fingerprint}.pb"
        if path.exists():
            self._requests.touch(path)
            return
        params = pb.PlanRequest()
        params.CopyFrom(req)
        params.ClearField("manifest")
        params.ClearField("job_id")
        self._requests.persist(path, params.SerializeToString())

    def get_plan(self, data: bytes, job_id: str) -> bytes:
        req: pb.GetPlanRequest = self._parse(pb.GetPlanRequest, data)
        self._tls.job = req.job_id or job_id
        _check_fingerprint(req.plan_fingerprint, "plan_fingerprint")
        cached = self.responses.get(req.plan_fingerprint)
        if cached is not None:
            self.stats.incr("response_cache_hits")
            return self._served(cached, "response-cache")
        try:
            params = pb.PlanRequest.FromString(
                (self._requests_dir / f"{req.plan_fingerprint}.pb").read_bytes()
            )
        except (OSError, DecodeError):
            params = None
        if params is None or self.manifests.get(params.manifest_fingerprint) is None:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND, f"no plan with fingerprint {req.plan_fingerprint}"
            )
        return self.plan(params.SerializeToString(), job_id)

    def get_stats(self, data: bytes, job_id: str) -> bytes:
        self._parse(pb.StatsRequest, data)
        s = self.stats
        with s._lock:
            counters = dict(s.counters)
            errors = dict(s.errors)
            in_flight = s.in_flight
        stats = pb.StatsResponse(
            planner_version=PLANNER_VERSION,
            uptime_s=time.monotonic() - s.started,
            known_manifests=self.manifests.count(),
            response_cache_bytes=self.responses.bytes,
            in_flight=in_flight,
            errors_by_code=errors,
            jobs=s.jobs(),
            rss_bytes=rss_bytes(),
            serving=self.serving,
            **counters,
        )
        return _serialize(stats)


# ----------------------------------------------------------------------------
# The server.


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:0"
    cache_dir: Path = Path(".deeppart-cache")
    token: str | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    response_cache_bytes: int = DEFAULT_RESPONSE_CACHE_BYTES
    store_bytes: int = DEFAULT_STORE_BYTES
    workers: int = 32
    grace_s: float = 30.0
    drain_delay_s: float = 0.0
    test_delay_s: float = 0.0


class PlannerServer:
    """A running planner service; ``port`` is the port it listens on."""

    def __init__(self, config: ServerConfig, log: JsonLog | None = None) -> None:
        self.config = config
        self.log = log if log is not None else JsonLog()
        self.service = PlannerService(
            config.cache_dir,
            token=config.token,
            response_cache_bytes=config.response_cache_bytes,
            store_bytes=config.store_bytes,
            log=self.log,
            test_delay_s=config.test_delay_s,
        )
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", max(config.max_message_bytes, 256 * 1024 * 1024)),
            ("grpc.so_reuseport", 0),
        ]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="planner"),
            options=options,
        )
        self._server.add_generic_rpc_handlers((self.service.handlers(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        if config.tls_cert is not None or config.tls_key is not None:
            if config.tls_cert is None or config.tls_key is None:
                raise ValueError("TLS needs both --tls-cert and --tls-key")
            creds = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
            )
            self.port = self._server.add_secure_port(config.listen, creds)
        else:
            self.port = self._server.add_insecure_port(config.listen)
        if not self.port:
            raise OSError(f"cannot listen on {config.listen}")
        self._stopped = threading.Event()

    def start(self) -> PlannerServer:
        self._server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.log(
            "serving",
            listen=self.config.listen,
            port=self.port,
            cache_dir=str(self.config.cache_dir),
            tls=self.config.tls_cert is not None,
            auth=self.config.token is not None,
            plan_cache=self.service._plan_cache is not None,
            planner_version=PLANNER_VERSION,
            pid=os.getpid(),
        )
        return self

    def drain(self, grace_s: float | None = None, drain_delay_s: float | None = None) -> None:
        """Health NOT_SERVING; wait ``drain_delay_s`` (still serving, so that load
        balancers notice); stop taking RPCs; let in-flight ones finish (up to
        ``grace_s``); done."""
        if self._stopped.is_set():
            return
        grace = self.config.grace_s if grace_s is None else grace_s
        delay = self.config.drain_delay_s if drain_delay_s is None else drain_delay_s
        self.service.serving = False
        self.health.enter_graceful_shutdown()
        self.log("draining", in_flight=self.service.stats.in_flight, grace_s=grace, delay_s=delay)
        if delay > 0:
            time.sleep(delay)
        self._server.stop(grace).wait()
        self._stopped.set()
        self.log("stopped", requests=self.service.stats.counters["requests"])

    def stop(self) -> None:
        """Stops at once, cancelling in-flight RPCs."""
        self._server.stop(None).wait()
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)


# ----------------------------------------------------------------------------
# Command line (``deeppart serve``).


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    token: str | None = None
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
        if not token:
            raise ValueError(f"token file {args.token_file} is empty")
    elif os.environ.get(TOKEN_ENV):
        token = os.environ[TOKEN_ENV].strip()
    return ServerConfig(
        listen=args.listen,
        cache_dir=Path(args.cache_dir),
        token=token,
        tls_cert=Path(args.tls_cert) if args.tls_cert else None,
        tls_key=Path(args.tls_key) if args.tls_key else None,
        max_message_bytes=args.max_message_bytes,
        response_cache_bytes=args.response_cache_bytes,
        store_bytes=args.store_bytes,
        workers=args.workers,
        grace_s=args.grace_s,
        drain_delay_s=args.drain_delay_s,
        test_delay_s=args.test_delay_ms / 1e3,
    )


def serve(args: argparse.Namespace) -> int:
    """Runs the service until SIGTERM or SIGINT, then drains and returns 0."""
    log_stream: IO[str] | None = open(args.log_file, "a") if args.log_file else None  # noqa: SIM115
    log = JsonLog(log_stream)
    try:
        config = config_from_args(args)
        server = PlannerServer(config, log)
    except (OSError, ValueError, RuntimeError) as e:
        log("start_failed", "error", error=str(e))
        print(f"deeppart serve: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: Any) -> None:
        log("signal", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.start()
    if args.port_file:
        atomic_write(Path(args.port_file), f"{server.port}\n".encode())
    while not stop.wait(1.0):
        pass
    server.drain()
    if log_stream is not None:
        log_stream.close()
    return 0
