"""Multi-level (FTI-style) checkpoint storage: L1 node-local, L2 partner
copy, L3 Reed-Solomon across a group of nodes, L4 global (docs/LEVELS.md).

:func:`open_backend` picks a backend for a :class:`LevelConfig`: the
built-in engine (:mod:`deeppart.levels.engine`) or the real FTI library
(:mod:`deeppart.levels.fti`, when it and libfti are available).

The modules, in the order a save or a restore meets them:

- :mod:`~deeppart.levels.config`: the INI config, validated against the
  job before any I/O, and the level of each save;
- :mod:`~deeppart.levels.backend`: the interface both backends implement;
- :mod:`~deeppart.levels.engine`: the built-in backend, which orchestrates
  the steps below around the package's save and load stages;
- :mod:`~deeppart.levels.layout`: nodes, groups and file names;
- :mod:`~deeppart.levels.files`: small file I/O helpers and the data file
  check;
- :mod:`~deeppart.levels.partner`: L2 partner copies;
- :mod:`~deeppart.levels.erasure`: L3 Reed-Solomon coding in stripes;
- :mod:`~deeppart.levels.recovery`: what survives, which level serves each
  rank, restoring the files and the lost redundancy;
- :mod:`~deeppart.levels.fti`: the FTI backend, over
  :mod:`~deeppart.levels.libfti` (finding and loading libfti with ctypes).
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


def _mpi_job(comm: Any) -> bool:
    """Whether ``comm`` is MPI (mpi4py or deeppart's MPIComm) or None (the
    job's MPI world, when one is running)."""
    from deeppart.comm import MPIComm, SingleComm

    if comm is None or isinstance(comm, MPIComm | SingleComm):
        return True
    return callable(getattr(comm, "Get_rank", None))


def open_backend(
    config: LevelConfig | str | os.PathLike[str] | Mapping[str, Any],
    comm: Any = None,
    backend: str = "auto",
    **options: Any,
) -> LevelBackend:
    """A :class:`LevelBackend` for ``config`` (a :class:`LevelConfig`, an
    INI path or a dict) over ``comm``. ``backend``: ``"builtin"`` (DeepPart's
    engine), ``"fti"`` (libfti through ctypes; an error if unavailable) or
    ``"auto"`` (FTI when it imports, libfti is found and the job runs on
    MPI, else built-in;
    always built-in for an ``s3://`` glbl_dir, which FTI cannot write, for
    the memory tier, ``memory = 1``, and for a paced partner copy, ``l2_rate``).
    ``options`` go to the built-in engine (e.g. ``compression``)."""
    if backend not in BACKENDS:
        raise LevelConfigError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    cfg = LevelConfig.coerce(config)
    if backend == "auto" and (cfg.global_in_object_store or cfg.memory or cfg.l2_rate):
        backend = "builtin"
    if backend == "fti":
        cfg.check_fti_global()  # before libfti is looked for
        cfg.check_fti_memory()
    if backend == "auto" and not _mpi_job(comm):
        backend = "builtin"  # libfti runs on MPI: torch.distributed gets the built-in engine
    if backend == "fti" or (backend == "auto" and fti_available()):
        mod = _fti_module()
        if mod is None:
            raise LevelConfigError("backend='fti': deeppart.levels.fti is not available")
        fti: LevelBackend = mod.FTIBackend(cfg, comm)
        return fti
    from deeppart.levels.engine import BuiltinBackend

    return BuiltinBackend(cfg, comm, **options)
