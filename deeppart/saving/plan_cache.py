"""``deeppart.plan``: planning through the plan cache.

``cache`` selects where plans are looked up and stored:

- ``None`` or ``True``: the process-wide default cache, in memory and on disk
  at :func:`default_cache_dir` (``$DEEPPART_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/deeppart``, else ``~/.cache/deeppart``);
- ``False``: no cache, always plan;
- a path: a cache in that directory (one per directory and process);
- a :class:`PlanCache`: that cache.

The cache never makes planning fail: a cache that cannot be read is rebuilt
or bypassed with one :class:`CacheWarning`, and a stored plan is validated
before it is served. ``Plan.stats.source`` says where the plan came from.
"""

from __future__ import annotations

import os
import threading
from typing import TypeAlias

from deeppart._planner import CostModel, Manifest, Plan, PlanCache, Topology, default_cache_dir
from deeppart._planner import plan as _plan

CacheArg: TypeAlias = PlanCache | bool | str | os.PathLike[str] | None

_lock = threading.Lock()
_caches: dict[str, PlanCache] = {}


def default_cache() -> PlanCache:
    """The process-wide cache at the default location (memory-only when
    there is no home directory). Follows changes of ``DEEPPART_CACHE_DIR``."""
    directory = default_cache_dir()
    key = directory if directory is not None else ""
    with _lock:
        cache = _caches.get(key)
        if cache is None:
            cache = PlanCache(directory) if directory is not None else PlanCache(disk=False)
            _caches[key] = cache
        return cache


def resolve_cache(cache: CacheArg) -> PlanCache | None:
    """The cache that a ``cache=`` argument selects (``None`` for no cache)."""
    if cache is None or cache is True:
        return default_cache()
    if cache is False:
        return None
    if isinstance(cache, PlanCache):
        return cache
    try:
        key = os.fspath(cache)  # a path (str or os.PathLike)
        if not isinstance(key, str):
            raise TypeError
        key = os.path.abspath(key)
    except TypeError:
        raise TypeError(
            f"cache must be None, a bool, a path or a PlanCache, not {type(cache).__name__}"
        ) from None
    with _lock:
        found = _caches.get(key)
        if found is None:
            found = PlanCache(key)
            _caches[key] = found
        return found


def plan(
    manifest: Manifest,
    world_size: int,
    *,
    algorithm: str = "balanced",
    cost: CostModel | None = None,
    topology: Topology | None = None,
    cache: CacheArg = None,
) -> Plan:
    """Plans which rank writes which pieces of ``manifest`` (see the module
    docstring for ``cache``). Deterministic; the GIL is released while
    planning and during cache I/O."""
    return _plan(
        manifest,
        world_size,
        algorithm=algorithm,
        cost=cost,
        topology=topology,
        cache=resolve_cache(cache),
    )
