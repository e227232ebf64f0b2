"""``deeppart cache stats | clear | verify``: upkeep of the plan cache."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from deeppart._planner import CacheError, PlanCache, default_cache_dir


def add_parser(sub: Any) -> None:
    """Adds the ``cache`` command to the ``deeppart`` sub-parsers."""
    p = sub.add_parser("cache", help="inspect, verify or clear the plan cache")
    p.add_argument(
        "action",
        choices=("stats", "clear", "verify"),
        help="stats: entries and size; clear: delete every plan; "
        "verify: check every stored plan, deleting damaged ones",
    )
    p.add_argument(
        "--dir",
        dest="cache_dir",
        help="cache directory (default: $DEEPPART_CACHE_DIR, else $XDG_CACHE_HOME/deeppart, "
        "else ~/.cache/deeppart)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _print(args: argparse.Namespace, data: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(data))
        return
    width = max(len(k) for k in data)
    for k, v in data.items():
        print(f"{k:<{width}}  {v}")


def run(args: argparse.Namespace) -> int:
    directory = args.cache_dir or default_cache_dir()
    if directory is None:
        print("deeppart: error: no cache directory (set DEEPPART_CACHE_DIR)", file=sys.stderr)
        return 2
    cache = PlanCache(directory, memory_entries=0)
    try:
        if args.action == "stats":
            s: dict[str, Any] = dict(cache.stats())
            for key in ("hits_memory", "hits_disk", "misses", "evictions", "memory_evictions"):
                s.pop(key, None)  # per-process counters: always 0 here
            _print(args, {"path": cache.path, **s})
            return 0 if s["disk"] == "ok" else 1
        if args.action == "clear":
            removed = cache.clear()
            _print(args, {"path": cache.path, "removed": removed})
            return 0
        report: dict[str, Any] = dict(cache.verify())
        _print(args, {"path": cache.path, **report})
        return 1 if report["discarded"] else 0
    except CacheError as e:
        print(f"deeppart: error: CacheError: {e}", file=sys.stderr)
        return 2
