"""The old names of modules moved into the role folders (issue 45) keep
working for one release, with a DeprecationWarning naming the new place
(deeppart/moved.py)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest

import deeppart
from deeppart.moved import MOVED

PACKAGE = Path(deeppart.__file__).resolve().parent


def fresh_import(name: str) -> Any:
    sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=rf"{name} moved to {MOVED[name][0]}"):
        return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(n for n, homes in MOVED.items() if len(homes) == 1))
def test_a_moved_module_is_the_new_one(old: str) -> None:
    """``import deeppart.<old>`` warns and gives the new module itself (so
    patching it patches the new one), whose own spec is left alone; no file
    of the package shadows the old name."""
    new = importlib.import_module(MOVED[old][0])
    assert fresh_import(old) is new
    assert new.__spec__ is not None and new.__spec__.name == MOVED[old][0]
    assert not (PACKAGE / (old.split(".", 1)[1].replace(".", "/") + ".py")).exists()


def test_the_split_checkpoint_module_finds_each_name_in_its_new_home() -> None:
    """``deeppart.checkpoint`` held save and load: its names come from
    saving/save.py, loading/load.py, progress.py and compression.py; an
    unknown name is an AttributeError naming the new modules."""
    from deeppart.compression import compression_level_of
    from deeppart.loading.load import last_incompatible_keys, load
    from deeppart.progress import last_stats
    from deeppart.saving.save import plan_save, save

    old = fresh_import("deeppart.checkpoint")
    assert old.save is save and old.plan_save is plan_save
    assert old.load is load
    assert old.last_incompatible_keys is last_incompatible_keys
    assert old.last_stats is last_stats
    assert old.compression_level_of is compression_level_of
    with pytest.raises(AttributeError, match=r"deeppart\.saving\.save, deeppart\.loading\.load"):
        old.no_such_name  # noqa: B018
    assert not (PACKAGE / "checkpoint.py").exists()


def test_every_new_home_exists() -> None:
    for homes in MOVED.values():
        for home in homes:
            assert importlib.import_module(home).__name__ == home
