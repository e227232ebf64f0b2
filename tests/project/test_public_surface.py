"""The front door is small (issue 45): ``deeppart.__all__`` holds what a
user imports, and every name the package exported before still resolves
(``deeppart.X`` and ``from deeppart import X``), the errors also listed by
``deeppart.errors``."""

from __future__ import annotations

import importlib
import inspect

import pytest

import deeppart
import deeppart.errors

#: deeppart.__all__ before issue 45 (53 names).
FORMER = [
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


def test_all_is_small_and_holds_the_front_doors() -> None:
    assert len(FORMER) == 53  # with __version__
    names = set(deeppart.__all__)
    assert len(names) == len(deeppart.__all__) <= 22, sorted(names)
    front = {"save", "load", "async_save", "Checkpointer"}
    options = {"PlanOptions", "WriteOptions", "LoadOptions", "AsyncOptions"}
    assert front | options | {"DeepPartError", "SaveHandle"} <= names
    errors = [n for n in names if n.endswith(("Error", "Warning"))]
    assert sorted(errors) == ["CheckpointError", "DeepPartError"], errors
    assert all(hasattr(deeppart, n) for n in names)


@pytest.mark.parametrize("name", FORMER)
def test_every_former_name_still_resolves(name: str) -> None:
    value = getattr(deeppart, name)
    assert value is not None
    ns: dict[str, object] = {}
    exec(f"from deeppart import {name}", ns)
    assert ns[name] is value


def test_every_error_is_listed_by_deeppart_errors() -> None:
    former_errors = [
        n for n in FORMER if inspect.isclass(getattr(deeppart, n))
        and issubclass(getattr(deeppart, n), Exception | Warning)
    ]  # fmt: skip
    assert len(former_errors) >= 20
    for n in former_errors:
        assert n in deeppart.errors.__all__, n
        assert getattr(deeppart.errors, n) is getattr(deeppart, n)


def test_star_import_gives_all() -> None:
    ns: dict[str, object] = {}
    exec("from deeppart import *", ns)
    assert set(deeppart.__all__) <= ns.keys()
    assert "PlanCache" not in ns  # importable by name only
    assert importlib.import_module("deeppart.options").PlanOptions is deeppart.PlanOptions
