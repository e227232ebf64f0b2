"""Checks deeppart's import structure (docs/ARCHITECTURE.md).

Run it from the repository root::

    python scripts/check_architecture.py

It parses every module of the package (no import is executed) and reports:

* import cycles between deeppart's modules, counting every import, also
  those inside functions (a lazy import hides a cycle from Python, not from
  the design);
* a module that imports the package itself (``import deeppart`` or
  ``from deeppart import name``) instead of the module that owns the name;
* a module that uses another module's underscore name
  (``from deeppart.x import _name`` or ``x._name`` on an imported module);
* a library module (anything outside ``deeppart/tools/``, the command-line
  programs) that imports from ``deeppart.tools``: the tools use the
  library, never the reverse. ``deeppart/__main__.py`` (``python -m
  deeppart``, the command itself) is the one exception.

* an import that runs up the layers of docs/ARCHITECTURE.md
  (:data:`LAYERS`, lowest first: a module may import its own layer and
  those below it), but for the few edges :data:`UPWARD` names with their
  reason; and, for the package itself, a module or folder placed in no
  layer.

* a front door (:data:`FRONT_DOORS`: ``load`` and ``save``, the functions
  a user calls) longer than :data:`FRONT_DOOR_LINES` lines, from its
  ``def`` to its last line, docstring included: each reads as its stages
  in order, delegating to named stage functions; and a front door that is
  no longer where :data:`FRONT_DOORS` says.

``deeppart/__init__.py`` (the package's face), ``deeppart/__main__.py`` and
generated code (``deeppart/proto/``) are exempt from the last two rules.
The extension module ``deeppart._planner`` is the Rust core: importing it is
allowed (its name is private to the package, not its contents). Exits 1 and
prints one line per finding when anything is wrong.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "deeppart"
#: Modules whose underscore name is the module itself, not a private part.
PUBLIC_UNDERSCORE_MODULES = {"deeppart._planner"}
EXEMPT = {"deeppart", "deeppart.__main__"}
#: The command-line programs' room: the library never imports from it.
TOOLS = "deeppart.tools"
#: The one library-side module that may: ``python -m deeppart`` runs the CLI.
TOOLS_ENTRY = {"deeppart.__main__"}


#: The layers of docs/ARCHITECTURE.md, lowest first: each holds top-level
#: modules and folders (a folder: every module in it).
LAYERS: list[set[str]] = [
    {"_planner", "proto"},  # the Rust core; generated gRPC code
    {
        "errors",
        "regions",
        "compression",
        "comm",
        "agreement",
        "format",
        "integrity",
        "progress",
        "options",  # save's, load's and Checkpointer's option objects
    },
    {"state"},
    {"storage"},
    {"loading"},
    {"saving"},  # prepare reads group selections (loading.groups)
    {"steps"},
    {"checkpointer", "async_save", "levels"},  # the roof
    {"integrations", "service"},  # front ends
    {"tools"},  # the command-line programs
    {"__init__", "__main__", "moved"},  # the package's face
]
#: Edges that run up the layers on purpose (importer -> imported module or
#: folder), each with its reason.
UPWARD = {
    # The planner service, when one is configured (DEEPPART_PLANNER_SERVICE):
    # a lazy import, the save's planning asks the service for its plan.
    ("deeppart.saving.planning", "deeppart.service"),
}

#: The front doors: the module (a path under the repository root) and the
#: top-level function the user calls, which reads as its stages in order
#: (docs/ARCHITECTURE.md, "The save sequence", "The load sequence").
FRONT_DOORS = {
    "deeppart/loading/load.py": "load",
    "deeppart/saving/save.py": "save",
}
#: The most lines a front door may have (under 80), from its ``def`` to its
#: last line, docstring included.
FRONT_DOOR_LINES = 79


def room(module: str) -> str:
    """The top-level module or folder of ``module`` (``__init__`` for the
    package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer(module: str) -> int | None:
    r = room(module)
    return next((i for i, rooms in enumerate(LAYERS) if r in rooms), None)


def upward(importer: str, imported: str) -> bool:
    """Whether ``importer`` -> ``imported`` runs up the layers (not allowed
    by :data:`UPWARD`)."""
    a, b = layer(importer), layer(imported)
    if a is None or b is None or b <= a:
        return False
    return not any(
        importer == i and (imported == t or imported.startswith(t + ".")) for i, t in UPWARD
    )


def unplaced(root: Path) -> list[str]:
    """The package's top-level modules and folders that no layer holds."""
    pkg = root / PACKAGE
    rooms = {p.stem for p in pkg.glob("*.py")} | {
        p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()
    }
    placed = set().union(*LAYERS)
    return [
        f"deeppart.{r}: in no layer of LAYERS (docs/ARCHITECTURE.md)"
        for r in sorted(rooms - placed)
    ]


def long_front_doors(root: Path) -> list[str]:
    """The front doors (:data:`FRONT_DOORS`) of the package under ``root``
    longer than :data:`FRONT_DOOR_LINES` lines, and those missing (a moved
    front door would leave its budget unchecked)."""
    findings = []
    for rel, name in FRONT_DOORS.items():
        path = root / rel
        module = module_name(root, path)
        if not path.is_file():
            findings.append(f"{module}: missing, the module of the front door {name} (FRONT_DOORS)")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        fn = next(
            (
                node
                for node in tree.body
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
            ),
            None,
        )
        if fn is None or fn.end_lineno is None:
            findings.append(f"{module}: no top-level function {name}, a front door (FRONT_DOORS)")
            continue
        lines = fn.end_lineno - fn.lineno + 1
        if lines > FRONT_DOOR_LINES:
            findings.append(
                f"{module}:{fn.lineno}: {name} is {lines} lines long, over the front doors' "
                f"budget of {FRONT_DOOR_LINES}: delegate to named stage functions "
                "(as deeppart/saving/save.py does)"
            )
    return findings


def in_tools(module: str) -> bool:
    return module == TOOLS or module.startswith(TOOLS + ".")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module of a ``from X import ...`` (relative ones too)."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


class ModuleImports:
    def __init__(self, name: str, is_package: bool, tree: ast.Module, known: set[str]) -> None:
        self.name = name
        self.deps: set[str] = set()
        self.findings: list[str] = []
        aliases: dict[str, str] = {}  # local name -> deeppart module
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == PACKAGE or a.name.startswith(PACKAGE + "."):
                        target = self._nearest(a.name, known)
                        self._dep(target, node.lineno)
                        if a.asname:
                            aliases[a.asname] = a.name
                        if a.name == PACKAGE:
                            self._self_import(node.lineno)
            elif isinstance(node, ast.ImportFrom):
                base = resolve_from(name, is_package, node)
                if base != PACKAGE and not base.startswith(PACKAGE + "."):
                    continue
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    if sub in known:
                        self._dep(sub, node.lineno)
                        aliases[a.asname or a.name] = sub
                        continue
                    self._dep(self._nearest(base, known), node.lineno)
                    if base == PACKAGE:
                        self._self_import(node.lineno)
                    if a.name.startswith("_") and base not in PUBLIC_UNDERSCORE_MODULES:
                        self._private(f"{base}.{a.name}", node.lineno)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != name
                and aliases[node.value.id] not in PUBLIC_UNDERSCORE_MODULES
            ):
                self._private(f"{aliases[node.value.id]}.{node.attr}", node.lineno)

    @staticmethod
    def _nearest(dotted: str, known: set[str]) -> str:
        while dotted not in known and "." in dotted:
            dotted = dotted.rsplit(".", 1)[0]
        return dotted

    def _dep(self, target: str, line: int) -> None:
        if target != self.name:
            self.deps.add(target)
            if upward(self.name, target) and self.name not in EXEMPT:
                self.findings.append(
                    f"{self.name}:{line}: imports {target}, a higher layer "
                    f"({room(target)} above {room(self.name)}, docs/ARCHITECTURE.md)"
                )
        if in_tools(target) and not in_tools(self.name) and self.name not in TOOLS_ENTRY:
            self.findings.append(
                f"{self.name}:{line}: the library imports the command-line tools ({target}); "
                f"move what both need out of {TOOLS}"
            )

    def _self_import(self, line: int) -> None:
        if self.name not in EXEMPT:
            self.findings.append(f"{self.name}:{line}: imports the package itself (deeppart)")

    def _private(self, what: str, line: int) -> None:
        if self.name not in EXEMPT:
            self.findings.append(f"{self.name}:{line}: uses another module's private name {what}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def check(root: Path) -> list[str]:
    pkg = root / PACKAGE
    files = [p for p in sorted(pkg.rglob("*.py")) if "proto" not in p.relative_to(pkg).parts]
    known = {module_name(root, p) for p in sorted(pkg.rglob("*.py"))} | {"deeppart._planner"}
    graph: dict[str, set[str]] = {}
    findings: list[str] = []
    for p in files:
        name = module_name(root, p)
        tree = ast.parse(p.read_text(), filename=str(p))
        mod = ModuleImports(name, p.name == "__init__.py", tree, known)
        # The package face re-exports everything: it depends on all, and is
        # left out of the cycle check (nothing else may import it).
        if name != PACKAGE:
            graph[name] = {d for d in mod.deps if d != PACKAGE}
        findings.extend(mod.findings)
    for comp in cycles(graph):
        findings.append("import cycle: " + " -> ".join(comp))
    return findings


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    findings = check(root) + unplaced(root) + long_front_doors(root)
    for line in findings:
        print(line)
    if findings:
        print(f"{len(findings)} finding(s)", file=sys.stderr)
        return 1
    print(
        "deeppart: no import cycle, no import up the layers, no self-import, "
        "no private name used across modules, "
        f"nothing outside {TOOLS} imports from it, "
        f"no front door over {FRONT_DOOR_LINES} lines"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
