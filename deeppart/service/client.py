"""Client of the DeepPart planner service.

:class:`PlannerClient` asks a ``deeppart serve`` service for plans, fingerprint
first: the manifest is uploaded only when the service does not know it. Every
plan received is rebuilt with ``Plan.from_pieces`` (which validates each piece
and recomputes the stats) and its fingerprint compared with the one the
request asked for.

Only an unreachable service (down, restarting, too slow: ``UNAVAILABLE``,
``DEADLINE_EXCEEDED``, ``CANCELLED``, ``ABORTED``) makes the client plan in
process, after one warning; such plans say ``stats.source ==
"local-fallback"`` and :attr:`PlannerClient.sources` counts them. Anything
else is a configuration error that falling back would hide (a wrong token:
``UNAUTHENTICATED``; ``PERMISSION_DENIED``; another planner version; not a
DeepPart service; a plan that does not check out) and raises
:class:`PlannerServiceError`. A plan from the service says ``"service"``, or
``"service-cache"`` when the service served it from its caches.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any, Literal

import grpc

from deeppart._planner import PLANNER_VERSION, CostModel, Manifest, Plan, Topology, plan_fingerprint
from deeppart.errors import DeepPartError, PlannerServiceError, ServiceUnavailable
from deeppart.proto import planner_pb2 as pb
from deeppart.saving.plan_cache import plan as plan_in_process
from deeppart.saving.plan_cache import resolve_cache
from deeppart.service import wire
from deeppart.service.options import JOB_METADATA_KEY, SERVICE_NAME

log = logging.getLogger("deeppart.service")

_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
#: The codes of a service that cannot be reached (or stopped mid-request):
#: the only failures planned around in process.
UNREACHABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
    }
)
_HINTS = {
    grpc.StatusCode.UNAUTHENTICATED: "check the token: $DEEPPART_TOKEN or token=",
    grpc.StatusCode.PERMISSION_DENIED: "check the token's permissions",
    grpc.StatusCode.UNIMPLEMENTED: "is the target a DeepPart planner service?",
    grpc.StatusCode.FAILED_PRECONDITION: "client and service versions differ",
}


def _exact(values: dict[str, float | int]) -> tuple[tuple[str, str], ...]:
    """A key of a cost model's values by exact bit pattern (as the fingerprint)."""
    return tuple(
        (k, v.hex() if isinstance(v, float) else str(v)) for k, v in sorted(values.items())
    )


def parse_target(target: str) -> tuple[str, bool]:
    """``grpc://host:port`` (plain), ``grpcs://host:port`` (TLS) or ``host:port``:
    the gRPC target and whether the scheme asks for TLS."""
    if target.startswith("grpc://"):
        return target[len("grpc://") :], False
    if target.startswith("grpcs://"):
        return target[len("grpcs://") :], True
    if "://" in target:
        raise ValueError(
            f"planner target {target!r}: expected grpc://HOST:PORT or grpcs://HOST:PORT"
        )
    return target, False


class PlannerClient:
    """A connection to a planner service (connects lazily, on the first request).

    ``tls``: ``None``/``False`` for plain text (unless the target is
    ``grpcs://``), ``True`` for TLS with the system's root certificates, or the
    path of a PEM root certificate. ``token``: the bearer token, sent as
    ``authorization`` metadata. ``timeout_s`` is each RPC's deadline,
    ``retries`` how often an unavailable service is tried again (with
    exponential backoff from ``backoff_s``, jittered, at most
    ``max_backoff_s``). After the service was found unreachable it is not
    asked again for ``cooldown_s``: requests are planned locally at once
    (``fallback=False``: :class:`ServiceUnavailable` instead).
    ``sources`` counts where this client's plans came from (``service``,
    ``service-cache``, ``local-fallback``, and the local cache's ``memory``
    and ``disk``).
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool | str | Path | None = None,
        job_id: str | None = None,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        cooldown_s: float = 5.0,
        max_message_bytes: int = 512 * 1024 * 1024,
        fallback: bool = True,
        cache: Any = False,
    ) -> None:
        self.target, scheme_tls = parse_target(target)
        self.tls: bool | str | Path | None = tls if tls not in (None, False) else scheme_tls
        self.token = token
        self.job_id = job_id or ""
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.cooldown_s = cooldown_s
        self.max_message_bytes = max_message_bytes
        self.fallback = fallback
        # A local plan cache consulted before the service (off by default).
        self.cache = cache
        self._lock = threading.Lock()
        self._channel: Any = None
        self._plan_rpc: Any = None
        self._get_plan_rpc: Any = None
        self._stats_rpc: Any = None
        self._down_until = 0.0
        self.sources: Counter[str] = Counter()
        self._manifest_wire: OrderedDict[str, pb.Manifest] = OrderedDict()
        # Small memos, so that asking again for a plan costs little: manifest
        # fingerprints by manifest object, and the plans already rebuilt and
        # checked, with the exact pieces they were rebuilt from.
        self._memo_lock = threading.Lock()
        self._fingerprints: OrderedDict[int, tuple[Manifest, str]] = OrderedDict()
        self._verified: OrderedDict[str, tuple[bytes, Plan]] = OrderedDict()
        self._plan_fingerprints: OrderedDict[Any, tuple[Manifest, str]] = OrderedDict()

    # -- connection ---------------------------------------------------------------

    def _connect(self) -> None:
        with self._lock:
            if self._channel is not None:
                return
            options = [
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.enable_retries", 0),  # retries are ours, bounded
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ]
            if self.tls:
                root = None if self.tls is True else Path(self.tls).read_bytes()
                creds = grpc.ssl_channel_credentials(root_certificates=root)
                channel = grpc.secure_channel(self.target, creds, options=options)
            else:
                channel = grpc.insecure_channel(self.target, options=options)
            self._plan_rpc = channel.unary_unary(
                f"/{SERVICE_NAME}/Plan",
                request_serializer=pb.PlanRequest.SerializeToString,
                response_deserializer=pb.PlanResponse.FromString,
            )
            self._get_plan_rpc = channel.unary_unary(
                f"/{SERVICE_NAME}/GetPlan",
                request_serializer=pb.GetPlanRequest.SerializeToString,
                response_deserializer=pb.PlanResponse.FromString,
            )
            self._stats_rpc = channel.unary_unary(
                f"/{SERVICE_NAME}/Stats",
                request_serializer=pb.StatsRequest.SerializeToString,
                response_deserializer=pb.StatsResponse.FromString,
            )
            self._channel = channel

    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                self._channel.close()
            self._channel = None

    def __enter__(self) -> PlannerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _metadata(self) -> list[tuple[str, str]]:
        md: list[tuple[str, str]] = []
        if self.token:
            md.append(("authorization", f"Bearer {self.token}"))
        if self.job_id:
            md.append((JOB_METADATA_KEY, self.job_id))
        return md

    def _call(self, rpc_name: str, request: Any) -> Any:
        """One RPC, retried with bounded, jittered exponential backoff while the
        service is unavailable. Raises ``grpc.RpcError`` when it gives up."""
        self._connect()
        rpc = getattr(self, f"_{rpc_name}_rpc")
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return rpc(request, timeout=self.timeout_s, metadata=self._metadata())
            except grpc.RpcError as e:
                if e.code() not in _RETRYABLE or attempt == self.retries:
                    raise
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.max_backoff_s)
        raise AssertionError("unreachable")

    # -- requests -------------------------------------------------------------------

    _MEMO_ITEMS = 8

    def _remember(self, memo: OrderedDict[Any, Any], key: Any, value: Any) -> None:
        with self._memo_lock:
            memo[key] = value
            memo.move_to_end(key)
            while len(memo) > self._MEMO_ITEMS:
                memo.popitem(last=False)

    def _manifest_fingerprint(self, manifest: Manifest) -> str:
        with self._memo_lock:
            entry = self._fingerprints.get(id(manifest))
        if entry is not None and entry[0] is manifest:
            return entry[1]
        fingerprint = manifest.fingerprint
        self._remember(self._fingerprints, id(manifest), (manifest, fingerprint))
        return fingerprint

    def _plan_fingerprint(
        self,
        manifest: Manifest,
        world_size: int,
        algorithm: str,
        cost: CostModel | None,
        topology: Topology | None,
    ) -> str:
        """``deeppart.plan_fingerprint``, memoized by manifest object and parameters
        (it hashes the whole manifest). Invalid arguments raise as in process."""
        key = (
            id(manifest),
            world_size,
            algorithm,
            None if cost is None else _exact(cost.to_dict()),
            None if topology is None else topology.ranks_per_node,
        )
        with self._memo_lock:
            entry = self._plan_fingerprints.get(key)
        if entry is not None and entry[0] is manifest:
            return entry[1]
        fingerprint = plan_fingerprint(
            manifest, world_size, algorithm=algorithm, cost=cost, topology=topology
        )
        self._remember(self._plan_fingerprints, key, (manifest, fingerprint))
        return fingerprint

    def _wire_manifest(self, manifest: Manifest) -> pb.Manifest:
        key = self._manifest_fingerprint(manifest)
        with self._memo_lock:
            msg = self._manifest_wire.get(key)
        if msg is None:
            msg = wire.manifest_to_proto(manifest)
            self._remember(self._manifest_wire, key, msg)
        return msg

    def request_plan(
        self,
        manifest: Manifest,
        world_size: int,
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
    ) -> Plan:
        """A plan from the service, verified; raises :class:`ServiceUnavailable`
        or ``grpc.RpcError`` when there is none (no fallback)."""
        expected = self._plan_fingerprint(manifest, world_size, algorithm, cost, topology)
        return self._request_plan(manifest, world_size, expected, algorithm, cost, topology)

    def _request_plan(
        self,
        manifest: Manifest,
        world_size: int,
        expected: str,
        algorithm: str,
        cost: CostModel | None,
        topology: Topology | None,
    ) -> Plan:
        req = pb.PlanRequest(
            plan_fingerprint=expected,
            manifest_fingerprint=self._manifest_fingerprint(manifest),
            world_size=world_size,
            algorithm=algorithm,
            cost=wire.cost_to_proto(cost),
            topology=wire.topology_to_proto(topology),
            job_id=self.job_id,
            planner_version=PLANNER_VERSION,
        )
        resp: pb.PlanResponse = self._call("plan", req)
        if resp.status == pb.PLAN_STATUS_NEED_MANIFEST:
            req.manifest.CopyFrom(self._wire_manifest(manifest))
            resp = self._call("plan", req)
        if resp.status != pb.PLAN_STATUS_OK:
            raise ServiceUnavailable(f"the service answered status {resp.status}")
        if resp.plan_fingerprint != expected or resp.world_size != world_size:
            raise ServiceUnavailable(
                f"the service answered for plan {resp.plan_fingerprint}, not {expected}"
            )
        source: Literal["service", "service-cache"] = (
            "service" if resp.served_from in ("", "computed") else "service-cache"
        )
        pieces = resp.pieces.SerializeToString()
        with self._memo_lock:
            seen = self._verified.get(expected)
        if seen is not None and seen[0] == pieces:
            # The very pieces already rebuilt and checked for this plan.
            return seen[1].with_source(source)
        try:
            plan = wire.plan_from_response(
                resp, manifest, algorithm=algorithm, cost=cost, topology=topology
            )
        except (ValueError, DeepPartError) as e:
            raise ServiceUnavailable(f"the plan received is invalid: {e}") from e
        if plan.fingerprint != expected:
            raise ServiceUnavailable(
                f"the plan received has fingerprint {plan.fingerprint}, expected {expected}"
            )
        self._remember(self._verified, expected, (pieces, plan))
        return plan.with_source(source)

    def plan(
        self,
        manifest: Manifest,
        world_size: int,
        *,
        algorithm: str = "balanced",
        cost: CostModel | None = None,
        topology: Topology | None = None,
    ) -> Plan:
        """A plan from the service; if the service is unreachable, a warning
        and a local plan (``stats.source == "local-fallback"``). Any other
        failure raises :class:`PlannerServiceError`.

        With ``cache`` (as ``deeppart.plan``'s: ``True``, a directory or a
        ``PlanCache``), that local cache is asked first and keeps what the
        service sends."""
        # Invalid arguments raise here, as they would in process, not in the service.
        expected = self._plan_fingerprint(manifest, world_size, algorithm, cost, topology)
        local = resolve_cache(self.cache) if self.cache is not False else None
        if local is not None:
            with contextlib.suppress(Exception):  # a local cache never fails a plan
                found = local.get(
                    manifest, world_size, algorithm=algorithm, cost=cost, topology=topology
                )
                if found is not None:
                    self.sources[found.stats.source] += 1
                    return found
        if time.monotonic() >= self._down_until:
            try:
                plan = self._request_plan(manifest, world_size, expected, algorithm, cost, topology)
            except grpc.RpcError as e:
                reason = f"{e.code().name}: {e.details()}"
                if e.code() not in UNREACHABLE:
                    hint = _HINTS.get(e.code())
                    raise PlannerServiceError(
                        f"planner service {self.target}: {reason}" + (f" ({hint})" if hint else "")
                    ) from e
            except ServiceUnavailable as e:
                raise PlannerServiceError(f"planner service {self.target}: {e}") from e
            else:
                if local is not None:
                    with contextlib.suppress(Exception):
                        local.put(plan)
                self.sources[plan.stats.source] += 1
                return plan
            if not self.fallback:
                raise ServiceUnavailable(reason)
            self._down_until = time.monotonic() + self.cooldown_s
            log.warning(
                "deeppart planner service %s unreachable (%s); planning in process",
                self.target,
                reason,
            )
        elif not self.fallback:
            raise ServiceUnavailable(f"planner service {self.target}: unreachable (cooling down)")
        plan = plan_in_process(
            manifest,
            world_size,
            algorithm=algorithm,
            cost=cost,
            topology=topology,
            cache=local,
        ).with_source("local-fallback")
        self.sources["local-fallback"] += 1
        return plan

    def get_plan(self, fingerprint: str, manifest: Manifest) -> Plan | None:
        """The plan the service knows by ``fingerprint`` (rebuilt against
        ``manifest`` and checked), or ``None``."""
        try:
            resp: pb.PlanResponse = self._call(
                "get_plan", pb.GetPlanRequest(plan_fingerprint=fingerprint, job_id=self.job_id)
            )
            plan = wire.plan_from_response(
                resp,
                manifest,
                algorithm=resp.algorithm,
                cost=wire.cost_from_proto(resp.cost),
                topology=wire.topology_from_proto(resp.topology),
            )
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.NOT_FOUND:
                log.warning("deeppart planner service %s: GetPlan failed: %s", self.target, e)
            return None
        except (ValueError, DeepPartError) as e:
            log.warning("deeppart planner service %s: GetPlan: invalid plan: %s", self.target, e)
            return None
        return plan if plan.fingerprint == fingerprint else None

    def stats(self) -> pb.StatsResponse:
        """The service's counters (raises ``grpc.RpcError`` if unreachable)."""
        resp: pb.StatsResponse = self._call("stats", pb.StatsRequest())
        return resp
