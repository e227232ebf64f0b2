"""DeepPart: partitioned parallel checkpointing of training state.

Each rank passes its own state: what several ranks hold alike (proved, not
assumed) is written once, split so that every rank writes one balanced
part in parallel instead of rank 0 writing everything; shards (DTensors)
and per-rank values are stored with their holders, and each rank gets back
exactly what it saved.
"""

from typing import TYPE_CHECKING, Any

# ``from deeppart import X``: the names of __all__ (what a user needs), and,
# imported ``as`` themselves, the others this package exported before (the
# planner's own API, the multi-level storage's types, the errors, which
# deeppart.errors lists): importable, but not in ``from deeppart import *``.
from deeppart._planner import ALGORITHMS, CostModel, DeepPartError, Topology
from deeppart._planner import PLANNER_VERSION as PLANNER_VERSION
from deeppart._planner import CacheError as CacheError
from deeppart._planner import CacheWarning as CacheWarning
from deeppart._planner import ErasureError as ErasureError
from deeppart._planner import Manifest as Manifest
from deeppart._planner import ManifestError as ManifestError
from deeppart._planner import Plan as Plan
from deeppart._planner import PlanCache as PlanCache
from deeppart._planner import PlanError as PlanError
from deeppart._planner import PlanStats as PlanStats
from deeppart._planner import default_cache_dir as default_cache_dir
from deeppart._planner import plan_fingerprint as plan_fingerprint
from deeppart.async_save import AsyncSave, SaveHandle, async_save
from deeppart.checkpointer import Checkpointer
from deeppart.errors import AsyncSaveWarning as AsyncSaveWarning
from deeppart.errors import CheckpointError
from deeppart.errors import CodecError as CodecError
from deeppart.errors import CommitConflictError as CommitConflictError
from deeppart.errors import CorruptCheckpointError as CorruptCheckpointError
from deeppart.errors import ForeignPathError as ForeignPathError
from deeppart.errors import FTIError as FTIError
from deeppart.errors import LevelConfigError as LevelConfigError
from deeppart.errors import NoSpaceError as NoSpaceError
from deeppart.errors import NotInPlaceWarning as NotInPlaceWarning
from deeppart.errors import OlderStepWarning as OlderStepWarning
from deeppart.errors import PerRankStateError as PerRankStateError
from deeppart.errors import PlannerServiceError as PlannerServiceError
from deeppart.errors import ReplicaMismatchError as ReplicaMismatchError
from deeppart.errors import StateError as StateError
from deeppart.errors import StateMismatchError as StateMismatchError
from deeppart.errors import TopologyMismatchError as TopologyMismatchError
from deeppart.errors import UnrecoverableError as UnrecoverableError
from deeppart.errors import UnsupportedURLError as UnsupportedURLError
from deeppart.levels import LevelConfig
from deeppart.levels import LevelSaveStats as LevelSaveStats
from deeppart.levels import RecoveryReport as RecoveryReport
from deeppart.levels import open_backend as open_backend
from deeppart.loading.load import last_incompatible_keys, load
from deeppart.moved import install as _install_moved
from deeppart.options import AsyncOptions, LoadOptions, PlanOptions, WriteOptions
from deeppart.progress import Stats as CheckpointStats
from deeppart.progress import last_stats
from deeppart.saving.plan_cache import plan as plan
from deeppart.saving.save import save
from deeppart.state.restore import IncompatibleKeys

if TYPE_CHECKING:
    from deeppart.service import plan_with as plan_with
    from deeppart.service import resolve_planner as resolve_planner
    from deeppart.service.client import PlannerClient as PlannerClient

__version__ = "0.1.0"

#: What a user imports: the four front doors, their options, what they
#: return, the errors' base classes and the planner's inputs. Everything
#: that was here before stays an attribute (``deeppart.Plan``, the errors,
#: listed by deeppart.errors).
__all__ = [
    "ALGORITHMS",
    "AsyncOptions",
    "AsyncSave",
    "CheckpointError",
    "CheckpointStats",
    "Checkpointer",
    "CostModel",
    "DeepPartError",
    "IncompatibleKeys",
    "LevelConfig",
    "LoadOptions",
    "PlanOptions",
    "SaveHandle",
    "Topology",
    "WriteOptions",
    "async_save",
    "last_incompatible_keys",
    "last_stats",
    "load",
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
