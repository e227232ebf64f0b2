"""Run by tests/base/test_errors.py under ``mpiexec -n 3``: one rank fails with a
DeepPart exception and every rank must raise that exception's own type.

For each exception type of :data:`deeppart.errors.ERROR_TYPES`:

* ``agree``: rank 1 fails one agreement collective with it directly;
* ``save``: rank 1's data-file write fails with it (the writer's named
  fault hook) during a real ``deeppart.save``;
* ``levels``: the same during a real multi-level save (the built-in
  backend at L2, two fake nodes per job).

Every rank writes ``ROOT/ok.RANK`` (one line per checked case) when all
cases held; a failed check raises, so mpiexec exits non-zero.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from deeppart import errors
from deeppart.agreement import agree
from deeppart.comm import Comm, resolve
from deeppart.levels import LevelConfig
from deeppart.levels.engine import BuiltinBackend
from deeppart.saving.save import save
from deeppart.saving.writer import WriteEvent, fault_hook

FAILING_RANK = 1


def make_error(cls: type[BaseException], what: str) -> BaseException:
    if cls is errors.ServiceError:
        return cls(None, what)
    return cls(what)


def expect(comm: Comm, cls: type[BaseException], case: str, run: object, log: list[str]) -> None:
    """Runs ``run()``; every rank must raise exactly ``cls``, the other
    ranks naming the failed rank and its message."""
    try:
        run()  # type: ignore[operator]
    except BaseException as e:
        if type(e) is not cls:
            raise AssertionError(
                f"{case} {cls.__name__}: rank {comm.rank} got {type(e).__name__}: {e}"
            ) from e
        if comm.rank != FAILING_RANK and f"rank {FAILING_RANK}" not in str(e):
            raise AssertionError(f"{case} {cls.__name__}: message {e}") from e
        if "injected" not in str(e):
            raise AssertionError(f"{case} {cls.__name__}: lost the message: {e}") from e
        log.append(f"{case} {cls.__name__}")
        return
    raise AssertionError(f"{case} {cls.__name__}: rank {comm.rank} raised nothing")


def check_type(
    comm: Comm, root: Path, i: int, cls: type[errors.DeepPartError], log: list[str]
) -> None:
    state = {"w": np.arange(4096, dtype=np.float32), "step": 3}
    what = f"{cls.__name__} injected on rank {FAILING_RANK}"
    mine = make_error(cls, what) if comm.rank == FAILING_RANK else None

    def in_agree() -> None:
        agree(comm, mine)

    expect(comm, cls, "agree", in_agree, log)

    def hook(event: WriteEvent) -> None:
        if event.rank == FAILING_RANK:
            raise make_error(cls, what)

    def in_save() -> None:
        with fault_hook("before-write", hook):
            save(state, root / "plain" / f"case-{i}", comm=comm)

    expect(comm, cls, "save", in_save, log)

    config = LevelConfig.from_dict(
        {
            "ckpt_dir": str(root / "local" / f"case-{i}"),
            "meta_dir": str(root / "meta" / f"case-{i}"),
            "glbl_dir": str(root / "global" / f"case-{i}"),
            "node_size": 1,
            "group_size": comm.size,
            "ckpt_l1": 1,
            "local_test": 1,
        }
    )
    backend = BuiltinBackend(config, comm)

    def in_levels() -> None:
        with fault_hook("before-write", hook):
            backend.save(1, state, level=2)

    expect(comm, cls, "levels", in_levels, log)
    backend.close()


def main(root: Path) -> None:
    comm = resolve()
    log: list[str] = []
    for i, cls in enumerate(errors.ERROR_TYPES):
        check_type(comm, root, i, cls, log)
    (root / f"ok.{comm.rank}").write_text("\n".join(log) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
