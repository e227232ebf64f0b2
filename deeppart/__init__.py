"""DeepPart: partitioned parallel checkpointing of training state.

Each rank passes its own state: what several ranks hold alike (proved, not
assumed) is written once, split so that every rank writes one balanced
part in parallel instead of rank 0 writing everything; shards (DTensors)
and per-rank values are stored with their holders, and each rank gets back
exactly what it saved.
"""

from typing import TYPE_CHECKING, Any

from deeppart._planner import (
    ALGORITHMS,
    PLANNER_VERSION,
    CacheError,
    CacheWarning,
    CostModel,
    DeepPartError,
    ErasureError,
    Manifest,
    ManifestError,
    Plan,
    PlanCache,
    PlanError,
    PlanStats,
    Topology,
    default_cache_dir,
    plan_fingerprint,
)
from deeppart.async_save import AsyncSave, SaveHandle, async_save
from deeppart.checkpointer import Checkpointer
from deeppart.errors import (
    AsyncSaveWarning,
    CheckpointError,
    CodecError,
    CommitConflictError,
    CorruptCheckpointError,
    ForeignPathError,
    FTIError,
    LevelConfigError,
    NoSpaceError,
    NotInPlaceWarning,
    OlderStepWarning,
    PerRankStateError,
    PlannerServiceError,
    ReplicaMismatchError,
    StateError,
    StateMismatchError,
    TopologyMismatchError,
    UnrecoverableError,
    UnsupportedURLError,
)
from deeppart.levels import LevelConfig, LevelSaveStats, RecoveryReport, open_backend
from deeppart.loading.load import last_incompatible_keys, load
from deeppart.moved import install as _install_moved
from deeppart.progress import Stats as CheckpointStats
from deeppart.progress import last_stats
from deeppart.saving.plan_cache import plan
from deeppart.saving.save import save
from deeppart.state.restore import IncompatibleKeys

if TYPE_CHECKING:
    from deeppart.service import plan_with, resolve_planner
    from deeppart.service.client import PlannerClient

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "PLANNER_VERSION",
    "AsyncSave",
    "AsyncSaveWarning",
    "CacheError",
    "CacheWarning",
    "CheckpointError",
    "CheckpointStats",
    "Checkpointer",
    "CodecError",
    "CommitConflictError",
    "CorruptCheckpointError",
    "CostModel",
    "DeepPartError",
    "ErasureError",
    "FTIError",
    "ForeignPathError",
    "IncompatibleKeys",
    "LevelConfig",
    "LevelConfigError",
    "LevelSaveStats",
    "Manifest",
    "ManifestError",
    "NoSpaceError",
    "NotInPlaceWarning",
    "OlderStepWarning",
    "PerRankStateError",
    "Plan",
    "PlanCache",
    "PlanError",
    "PlanStats",
    "PlannerClient",
    "PlannerServiceError",
    "RecoveryReport",
    "ReplicaMismatchError",
    "SaveHandle",
    "StateError",
    "StateMismatchError",
    "Topology",
    "TopologyMismatchError",
    "UnrecoverableError",
    "UnsupportedURLError",
    "__version__",
    "async_save",
    "default_cache_dir",
    "last_incompatible_keys",
    "last_stats",
    "load",
    "open_backend",
    "plan",
    "plan_fingerprint",
    "plan_with",
    "resolve_planner",
    "save",
]


_install_moved()  # the old names of moved modules (deeppart.moved), for one release


def __getattr__(name: str) -> Any:
    # The planner service's client needs grpcio, an optional dependency: import
    # it only when asked for (deeppart.PlannerClient, deeppart.plan_with, ...).
    if name == "PlannerClient":
        try:
            from deeppart.service.client import PlannerClient
        except ImportError as e:
            # Without grpcio, the name exists (``from deeppart import *`` works)
            # and using it explains what is missing.
            from deeppart.service import missing_client

            return missing_client(e)
        return PlannerClient
    if name in ("plan_with", "resolve_planner"):
        import deeppart.service

        return getattr(deeppart.service, name)
    raise AttributeError(f"module 'deeppart' has no attribute {name!r}")
