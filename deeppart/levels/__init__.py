"""Multi-level (FTI-style) checkpoint storage: L1 node-local, L2 partner
copy, L3 Reed-Solomon across a group of nodes, L4 global (docs/LEVELS.md).

:func:`open_backend` picks a backend for a :class:`LevelConfig`: the
built-in engine (:mod:`deeppart.levels.engine`) or the real FTI library
(:mod:`deeppart.levels.fti`, when it and libfti are available).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from deeppart.errors import LevelConfigError
from deeppart.levels.backend import LevelBackend, LevelSaveStats, RecoveryReport
from deeppart.levels.config import LevelConfig

__all__ = [
    "LevelBackend",
    "LevelConfig",
    "LevelConfigError",
    "LevelSaveStats",
    "RecoveryReport",
    "fti_available",
    "open_backend",
]

BACKENDS = ("auto", "builtin", "fti")


def _fti_module() -> Any | None:
    try:
        return importlib.import_module("deeppart.levels.fti")
    except ImportError:
        return None


def fti_available() -> bool:
    """Whether the FTI backend imports and finds libfti."""
    mod = _fti_module()
    if mod is None:
        return False
    try:
        return mod.find_libfti() is not None
    except Exception:
        return False


def open_backend(
    config: LevelConfig | str | os.PathLike[str] | Mapping[str, Any],
    comm: Any = None,
    backend: str = "auto",
    **options: Any,
) -> LevelBackend:
    """A :class:`LevelBackend` for ``config`` (a :class:`LevelConfig`, an
    INI path or a dict) over ``comm``. ``backend``: ``"builtin"`` (DeepPart's
    engine), ``"fti"`` (libfti through ctypes; an error if unavailable) or
    ``"auto"`` (FTI when it imports and libfti is found, else built-in).
    ``options`` go to the built-in engine (e.g. ``compression``)."""
    if backend not in BACKENDS:
        raise LevelConfigError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    cfg = LevelConfig.coerce(config)
    if backend == "fti" or (backend == "auto" and fti_available()):
        mod = _fti_module()
        if mod is None:
            raise LevelConfigError("backend='fti': deeppart.levels.fti is not available")
        fti: LevelBackend = mod.FTIBackend(cfg, comm)
        return fti
    from deeppart.levels.engine import BuiltinBackend

    return BuiltinBackend(cfg, comm, **options)
