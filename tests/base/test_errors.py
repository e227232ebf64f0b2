"""The exception hierarchy (deeppart.errors), and every exception arriving
on every rank with its own type (one multi-rank job, tests/base/errors_worker.py)."""

from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

import pytest
from launching import run_in_session

import deeppart
from deeppart import errors

ROOT = Path(__file__).resolve().parents[2]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
WORKER = Path(__file__).with_name("errors_worker.py")


def exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and not issubclass(obj, Warning)
    ]


def test_every_exception_is_a_deeppart_error() -> None:
    classes = exception_classes()
    assert len(classes) >= 20, classes
    for cls in classes:
        assert issubclass(cls, deeppart.DeepPartError), cls


def test_every_package_exception_lives_in_errors() -> None:
    """No module of the package defines an exception of its own."""
    for path in sorted((ROOT / "deeppart").rglob("*.py")):
        if "proto" in path.parts or path.name == "errors.py":
            continue
        text = path.read_text()
        for line in text.splitlines():
            if line.startswith("class ") and ("Error(" in line or "Exception(" in line):
                raise AssertionError(f"{path}: {line}")


def test_the_table_knows_every_exception_most_derived_first() -> None:
    table = errors.ERROR_TYPES
    server_only = {errors.ServiceError}
    assert set(exception_classes()) - server_only == set(table)
    for i, cls in enumerate(table):
        for later in table[i + 1 :]:
            assert not issubclass(later, cls), f"{later} comes after its base {cls}"
        assert errors.type_of_code(errors.code_of(cls("x"))) is cls
    assert errors.code_of(OSError("disk")) == errors.code_of(errors.CheckpointError("x"))
    assert errors.type_of_code(0) is errors.CheckpointError
    assert errors.type_of_code(len(table) + 1) is errors.CheckpointError
    assert len(table) < 255  # one byte on the wire


def test_every_kept_error_is_any_exit() -> None:
    """A stage that keeps its exception for an agreement (``err = e``)
    keeps any BaseException: an ``except Exception`` there lets a
    KeyboardInterrupt or SystemExit leave this rank alone while the others
    wait in the agreement (issue 49, item 8; the multi-rank check is
    tests/base/test_trust_mpi.py)."""
    import ast

    narrow: list[str] = []
    for path in sorted((ROOT / "deeppart").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ExceptHandler) and node.name and node.type is not None):
                continue
            if ast.unparse(node.type) != "Exception":
                continue
            for stmt in node.body:
                if not isinstance(stmt, ast.Assign):
                    continue
                names = {n.id for n in ast.walk(stmt.value) if isinstance(n, ast.Name)}
                if isinstance(stmt.value, ast.Name | ast.BoolOp) and node.name in names:
                    narrow.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not narrow, narrow


def test_old_builtin_bases_still_catch() -> None:
    assert issubclass(errors.StateError, TypeError)
    assert issubclass(errors.ValueEncodeError, TypeError)
    assert issubclass(errors.CodecError, ValueError)
    assert issubclass(errors.WireError, ValueError)
    assert issubclass(errors.DcpPlanError, RuntimeError)
    assert issubclass(errors.ServiceUnavailable, RuntimeError)


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_every_error_arrives_on_every_rank_with_its_type(tmp_path: Path) -> None:
    """Rank 1 fails with each exception type, in a bare agreement, in a real
    save (the writer's fault hook) and in a real L2 multi-level save; ranks
    0 and 2 raise the same type (before: the level backends' errors arrived
    as a plain CheckpointError)."""
    n = 3
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(WORKER), str(tmp_path)]
    support = ROOT / "tests" / "support"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(support)])}
    rc, out = run_in_session(cmd, env, ROOT, 600)
    assert rc == 0, out[-8000:]
    expected = {
        f"{case} {cls.__name__}"
        for cls in errors.ERROR_TYPES
        for case in ("agree", "save", "levels")
    }
    for r in range(n):
        got = set((tmp_path / f"ok.{r}").read_text().split("\n")) - {""}
        assert got == expected, (r, expected - got)
