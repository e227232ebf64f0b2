"""The old names of modules that moved into the package's role folders
(issue 45): importing one still works for one release, with a
:class:`DeprecationWarning` naming the new place. A moved module is the new
module itself (patching it patches the new one); a module that was split
(``deeppart.checkpoint``: ``save`` and ``load``) is a view whose names are
looked up in its new modules. Installed by ``import deeppart``."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["MOVED", "install"]

#: Old module -> its new module(s), in the order a name is looked up.
MOVED: dict[str, tuple[str, ...]] = {
    **{
        f"deeppart.{name}": (f"deeppart.{folder}.{name}",)
        for folder, names in {
            # (deeppart.state, the old module, is now the folder's package.)
            "state": ["values", "tensors", "dtensor", "union", "own_view", "restore", "staging"],
            "saving": ["planning", "plan_cache", "prepare", "writer", "snapshot", "in_flight"],
            "loading": ["reader", "reshard", "groups"],
            "storage": ["commit", "ownership"],
            "steps": ["lineage", "object_steps"],
            "integrations": ["dcp"],
            "tools": ["models", "manifest_source", "checkpoint_source"],
        }.items()
        for name in names
    },
    "deeppart.checkpoint": (
        "deeppart.saving.save",
        "deeppart.loading.load",
        "deeppart.progress",
        "deeppart.compression",
    ),
}  # fmt: skip


class _SplitModule(types.ModuleType):
    """An old module split into several: each name from the first new
    module that has it."""

    def __init__(self, name: str, homes: Sequence[str]) -> None:
        super().__init__(name, f"moved: {', '.join(homes)}")
        self._homes = tuple(homes)

    def __getattr__(self, attr: str) -> Any:
        for home in self._homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(
            f"{self.__name__} moved to {', '.join(self._homes)}: none has {attr!r}"
        )


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        #: The new modules' own specs, which the import machinery replaces
        #: with the old name's between create_module and exec_module.
        self._specs: dict[int, Any] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        homes = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved to {' and '.join(homes)}; the old name works until the "
            "next release",
            DeprecationWarning,
            stacklevel=2,
        )
        if len(homes) == 1:
            module = importlib.import_module(homes[0])
            self._specs[id(module)] = module.__spec__
            return module
        return _SplitModule(spec.name, homes)

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (the module is the new one, or a view of them):
        the new module gets its own spec back."""
        spec = self._specs.pop(id(module), None)
        if spec is not None:
            module.__spec__ = spec


_FINDER = _MovedFinder()


def install() -> None:
    """Puts the finder of the old names on ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
