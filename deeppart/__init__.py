"""DeepPart: partitioned parallel checkpointing of replicated training state.

Every data-parallel rank holds the same model and optimizer state. DeepPart
plans which rank writes which bytes, so that all ranks write one balanced
part in parallel instead of rank 0 writing everything.
"""

from deeppart._planner import (
    ALGORITHMS,
    PLANNER_VERSION,
    CostModel,
    DeepPartError,
    Manifest,
    ManifestError,
    Plan,
    PlanError,
    PlanStats,
    Topology,
    plan,
    plan_fingerprint,
)
from deeppart.state import StateError

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "PLANNER_VERSION",
    "CostModel",
    "DeepPartError",
    "Manifest",
    "ManifestError",
    "Plan",
    "PlanError",
    "PlanStats",
    "StateError",
    "Topology",
    "__version__",
    "plan",
    "plan_fingerprint",
]
