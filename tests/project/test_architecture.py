"""The package's import structure (docs/ARCHITECTURE.md), checked by
scripts/check_architecture.py: no import cycle, no module importing the
package itself, no module using another module's underscore names; and
the front doors (load, save) within their length budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_architecture  # noqa: E402


def test_deeppart_has_no_cycle_no_self_import_no_private_use() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_architecture.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no import cycle" in proc.stdout


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "deeppart" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_each_kind_of_problem(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from deeppart.a import f\n",
            "a.py": "from deeppart.b import g\n\ndef f() -> int:\n    return g()\n",
            # A lazy import still closes the cycle a -> b -> a.
            "b.py": "def g() -> int:\n    from deeppart import a\n    return 1\n",
            "c.py": "import deeppart\nfrom deeppart import a as m\nx = m._hidden\n",
            "d.py": "from deeppart.a import _private\n",
            "sub/__init__.py": "",
            "sub/e.py": "from ..a import f\n",
        },
    )
    findings = check_architecture.check(root)
    assert any(f.startswith("import cycle: deeppart.a -> deeppart.b") for f in findings), findings
    assert any("deeppart.c:1: imports the package itself" in f for f in findings), findings
    assert any(
        "deeppart.c:3: uses another module's private name deeppart.a._hidden" in f for f in findings
    ), findings
    assert any(
        "deeppart.d:1: uses another module's private name deeppart.a._private" in f
        for f in findings
    ), findings
    assert len(findings) == 4, findings


def test_a_clean_package_passes(tmp_path: Path) -> None:
    root = _package(
        tmp_path,
        {
            "__init__.py": "from deeppart.a import f\nimport deeppart.b\n",
            "a.py": "from deeppart.b import g\n\ndef f() -> int:\n    return g()\n",
            "b.py": "from deeppart._planner import x\n\ndef g() -> int:\n    return 1\n",
        },
    )
    assert check_architecture.check(root) == []


def test_the_library_may_not_import_the_command_line_tools(tmp_path: Path) -> None:
    """The command-line programs live in deeppart/tools/: they import the
    library, the library never imports them (a lazy import counts too);
    only ``python -m deeppart`` (deeppart/__main__.py) runs the CLI."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "from deeppart.a import f\n",
            "__main__.py": "from deeppart.tools.cli import main\n",
            "a.py": "def f() -> int:\n    from deeppart.tools.export import g\n    return g()\n",
            "b.py": "import deeppart.tools.cli\n",
            "c.py": "from deeppart import tools\n",
            "tools/__init__.py": "",
            "tools/cli.py": "from deeppart.a import f\nfrom deeppart.tools.export import g\n",
            "tools/export.py": "from deeppart.a import f\n\ndef g() -> int:\n    return f()\n",
        },
    )
    findings = check_architecture.check(root)
    assert any(
        f.startswith(
            "deeppart.a:2: the library imports the command-line tools (deeppart.tools.export)"
        )
        for f in findings
    ), findings
    assert any(
        f.startswith(
            "deeppart.b:1: the library imports the command-line tools (deeppart.tools.cli)"
        )
        for f in findings
    ), findings
    assert any(
        f.startswith("deeppart.c:1: the library imports the command-line tools (deeppart.tools)")
        for f in findings
    ), findings
    # a -> tools.export -> a is also a cycle; nothing else is wrong.
    assert len([f for f in findings if "command-line tools" in f]) == 3, findings
    assert not any(
        f.startswith(("deeppart.__main__", "deeppart.tools"))
        for f in findings
        if "command-line tools" in f
    ), findings


def test_the_real_package_keeps_the_tools_apart() -> None:
    """What the move to deeppart/tools/ promised: the command-line programs
    are there, none is left at the package's top level, and the checker
    sees the room (the rule above has something to check)."""
    pkg = ROOT / "deeppart"
    tools = [
        "cli",
        "demo",
        "checkpoint_inspect",
        "export",
        "simulate",
        "calibrate",
        "plotting",
        "cache_cli",
    ]
    for name in tools:
        assert (pkg / "tools" / f"{name}.py").is_file(), name
        assert not (pkg / f"{name}.py").exists(), name
    assert "deeppart.tools.cli:main" in (ROOT / "pyproject.toml").read_text()


def test_an_import_up_the_layers_is_found(tmp_path: Path) -> None:
    """A copy of the real package with one deliberate violation: the
    storage layer importing the save (lazily, inside a function) is
    reported with its line; the one allowed upward edge (the save's
    planning asking the planner service) is not; every top-level module
    and folder of the package is in a layer, and a new one is not."""
    import shutil

    shutil.copytree(
        ROOT / "deeppart",
        tmp_path / "deeppart",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    assert check_architecture.check(tmp_path) == []
    assert check_architecture.unplaced(tmp_path) == []
    commit = tmp_path / "deeppart" / "storage" / "commit.py"
    lines = commit.read_text().splitlines()
    lines.append("def _bad() -> None:\n    from deeppart.saving.save import save  # noqa\n")
    commit.write_text("\n".join(lines) + "\n")
    (tmp_path / "deeppart" / "newroom.py").write_text("")
    line = (
        commit.read_text().splitlines().index("    from deeppart.saving.save import save  # noqa")
        + 1
    )
    findings = check_architecture.check(tmp_path)
    assert (
        f"deeppart.storage.commit:{line}: imports deeppart.saving.save, a higher "
        "layer (saving above storage, docs/ARCHITECTURE.md)"
    ) in findings, findings
    # The same edge closes a cycle (the save imports the commit).
    assert len(findings) == 2 and findings[1].startswith("import cycle:"), findings
    assert check_architecture.unplaced(tmp_path) == [
        "deeppart.newroom: in no layer of LAYERS (docs/ARCHITECTURE.md)"
    ]
    assert not check_architecture.upward("deeppart.saving.planning", "deeppart.service.client")
    assert check_architecture.upward("deeppart.saving.prepare", "deeppart.service.client")


def _function(name: str, body_lines: int) -> str:
    """A function ``name`` of ``body_lines + 2`` lines (its def, a
    docstring, then ``body_lines`` statements)."""
    body = "".join(f"    x{i} = {i}\n" for i in range(body_lines))
    return f'def {name}() -> None:\n    """A front door."""\n{body}'


def test_a_long_front_door_is_reported(tmp_path: Path) -> None:
    """The front doors (load and save) read as their stages: in a small
    package tree, a load and a save of exactly the budget pass (a long
    function beside a front door and the lines above it do not count); a
    load one line longer is reported with its module, line and length."""
    budget = check_architecture.FRONT_DOOR_LINES
    assert budget == 79
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "loading/__init__.py": "",
            "loading/load.py": "import os\n\n\n" + _function("load", budget - 2),
            "saving/__init__.py": "",
            "saving/save.py": _function("helper", 200) + "\n\n" + _function("save", budget - 2),
        },
    )
    # Both within the budget: nothing to report.
    assert check_architecture.long_front_doors(root) == []
    (root / "deeppart" / "loading" / "load.py").write_text(
        "import os\n\n\n" + _function("load", budget - 2) + "    y = 0\n"
    )
    assert check_architecture.long_front_doors(root) == [
        f"deeppart.loading.load:4: load is {budget + 1} lines long, over the front doors' "
        f"budget of {budget}: delegate to named stage functions "
        "(as deeppart/saving/save.py does)"
    ]
    # The command reports it too, and fails.
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "check_architecture.py"), str(root)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"deeppart.loading.load:4: load is {budget + 1} lines long" in proc.stdout


def test_a_missing_front_door_is_reported(tmp_path: Path) -> None:
    """A front door renamed or moved would leave its budget unchecked: the
    checker names it."""
    root = _package(
        tmp_path,
        {
            "__init__.py": "",
            "loading/__init__.py": "",
            "loading/load.py": _function("load_checkpoint", 3),
        },
    )
    assert check_architecture.long_front_doors(root) == [
        "deeppart.loading.load: no top-level function load, a front door (FRONT_DOORS)",
        "deeppart.saving.save: missing, the module of the front door save (FRONT_DOORS)",
    ]


def test_the_real_front_doors_are_within_their_budget() -> None:
    assert check_architecture.long_front_doors(ROOT) == []
