"""The optional planner service (``deeppart serve``) and its client.

Jobs work without it: :func:`resolve_planner` turns a ``planner=`` argument
into a :class:`~deeppart.service.client.PlannerClient` or ``None`` (plan in
process), and :func:`plan_with` plans through whichever it gets. This module
imports grpc only when a service is actually asked for.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deeppart._planner import CostModel, Manifest, Plan, Topology
from deeppart.errors import PlannerServiceError
from deeppart.saving.plan_cache import plan as plan_in_process

if TYPE_CHECKING:
    from deeppart.service.client import PlannerClient

__all__ = ["PlannerServiceError", "plan_with", "resolve_planner"]


TOKEN_ENV = "DEEPPART_TOKEN"
TOKEN_FILE_ENV = "DEEPPART_TOKEN_FILE"
TLS_CA_ENV = "DEEPPART_TLS_CA"
_LOCAL = {"", "local", "in-process", "inprocess"}

_clients: dict[str, PlannerClient] = {}
_clients_lock = threading.Lock()
log = logging.getLogger("deeppart.service")


def _env_token() -> str | None:
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token.strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as e:
            log.warning("cannot read %s=%s: %s", TOKEN_FILE_ENV, path, e)
    return None


def resolve_planner(planner: Any) -> PlannerClient | None:
    """The client a ``planner=`` argument names, or ``None`` to plan in process.

    ``planner`` is ``None`` or ``"local"`` (in process), a ``PlannerClient``,
    or a URL ``grpc://HOST:PORT`` / ``grpcs://HOST:PORT``. A URL's client is
    made once per URL and reused; its token comes from ``$DEEPPART_TOKEN`` or
    the file ``$DEEPPART_TOKEN_FILE``, and a ``grpcs://`` client trusts the
    root certificate in ``$DEEPPART_TLS_CA`` (else the system's). Without
    grpcio installed, a URL logs a warning and gives ``None``.
    """
    if planner is None or (isinstance(planner, str) and planner.strip().lower() in _LOCAL):
        return None
    if isinstance(planner, str):
        url = planner.strip()
        if not url.startswith(("grpc://", "grpcs://")):
            raise ValueError(
                f"planner={planner!r}: expected None, 'local', grpc://HOST:PORT or grpcs://HOST:PORT"
            )
        with _clients_lock:
            client = _clients.get(url)
            if client is None:
                try:
                    from deeppart.service.client import PlannerClient
                except ImportError as e:
                    log.warning("planner=%s needs grpcio (%s); planning in process", url, e)
                    return None
                ca = os.environ.get(TLS_CA_ENV)
                client = PlannerClient(url, token=_env_token(), tls=ca if ca else None)
                _clients[url] = client
        return client
    try:
        from deeppart.service.client import PlannerClient
    except ImportError:
        PlannerClient = None  # type: ignore[assignment,misc]
    if PlannerClient is not None and isinstance(planner, PlannerClient):
        return planner
    raise TypeError(
        f"planner: expected None, a URL or a PlannerClient, got {type(planner).__name__}"
    )


def missing_client(error: ImportError) -> type:
    """A stand-in for ``PlannerClient`` where grpcio is not installed."""

    class PlannerClient:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                f"deeppart.PlannerClient needs grpcio and protobuf "
                f"(pip install 'deeppart[service]'): {error}"
            )

    return PlannerClient


def plan_with(
    planner: Any,
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
) -> Plan:
    """Plans through the service ``planner`` names (see :func:`resolve_planner`),
    or in process; an unreachable service means a warning and an in-process
    plan, any other failure :class:`PlannerServiceError`."""
    client = resolve_planner(planner)
    if client is None:
        return plan_in_process(
            manifest, world_size, algorithm=algorithm, cost=cost, topology=topology
        )
    return client.plan(manifest, world_size, algorithm=algorithm, cost=cost, topology=topology)
