"""Multi-rank scenarios of issue 31 (verified bytes; every failure reaches
every rank), run by tests/base/test_trust_mpi.py as one job:
``mpiexec -n K python tests/base/mpi_trust.py DIR``.

- ``verified``: a process (here the rank that reads and verifies a data
  file) holds a shared mapping of that file and flips a byte right after
  its read, before the others' read and the exchange; no rank may return
  the flipped byte (a tensor byte, then a plain value's digit): every rank
  returns the saved bytes, or every rank raises CorruptCheckpointError.
- ``stages``: each stage of a save and of a load, made to raise on one
  rank only; every rank must raise the same error type (a hang is the
  job's timeout).
- ``directories`` (issue 49, item 1): one path that is a different
  directory on each rank (``/proc/self/cwd/...`` with each rank in its
  own working directory: a node-local disk at a shared path). The save
  raises StoreConfigError on every rank, naming the ranks that do not see
  rank 0's temporary directory, before any rank began writing its data
  file; nothing is left in either directory.
- ``interrupts``: the same stages (and a Checkpointer's rank-0 steps: its
  line record before the save, its cleanup after), made to raise
  ``KeyboardInterrupt`` (or ``SystemExit``) on one rank: that rank
  re-raises its own, every other rank raises a DeepPartError naming the
  rank and the interruption (a hang is the job's timeout).

- ``loadstep`` (issue 49, item 10; run alone, ``--scenario loadstep``):
  an evaluator's ``Checkpointer.load()`` at 2 ranks while a training job
  (rank 1 alone, in a single-process Checkpointer) commits a newer step
  after rank 0 looked for the latest and before rank 1 did: both ranks
  load the step rank 0 picked (before: rank 1 picked the newer one and the
  load failed, "ranks read different metadata.json files"); then ranks
  that ask for different steps explicitly get StateMismatchError on every
  rank, and a load of the latest after that reads the newer step.

Each rank prints ``RESULT <scenario> <case> rank <r> <outcome>`` lines,
then ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import deeppart
import deeppart.loading.load as load_module
import deeppart.saving.save as save_module
from deeppart.comm import Comm, resolve
from deeppart.errors import ERROR_TYPES, CorruptCheckpointError, DeepPartError, StateError
from deeppart.format import data_file_name
from deeppart.loading import reader
from deeppart.saving import prepare
from deeppart.saving.writer import add_fault_hook
from deeppart.storage import target as storage_target

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from mpi_checkpoint import abort_on_failure, assert_bitwise_equal, make_state
from rank_output import print_line


def _outcome(
    c: Comm, scenario: str, case: str, run: Callable[[], str], names: str = ""
) -> list[str]:
    """Runs ``run`` (its outcome: a word) on every rank; an exception's
    outcome is its type's name (any BaseException: an interruption too),
    followed by ``-unnamed`` when ``names`` is given and its message does
    not hold it. Every rank's outcome, after one collective."""
    try:
        got = run()
    except BaseException as e:
        got = type(e).__name__
        if names and names not in str(e):
            got += "-unnamed"
    print_line(f"RESULT {scenario} {case} rank {c.rank} {got}")
    return [row.decode() for row in c.allgather_varbytes(got.encode())]


# ----------------------------------------------------------------------------
# Verified bytes.

#: The read stage of deeppart.load, wrapped to flip a byte after it.
READ_STAGE = "read_share"


def _flip_during_load(
    c: Comm, d: Path, state: Any, case: str, f: int, pos: int, flip: int, verifier: int
) -> list[str]:
    """Rank ``verifier`` (which reads and checksums data file ``f``) maps
    the file shared and dirties it before the load, then flips byte ``pos``
    (xor ``flip``) right after its read; the other ranks read after that.
    Returns every rank's outcome."""
    mm: mmap.mmap | None = None
    if c.rank == verifier:
        fd = os.open(d / data_file_name(f), os.O_RDWR)
        mm = mmap.mmap(fd, 0, mmap.MAP_SHARED)
        os.close(fd)
        mm[pos] = mm[pos]  # the page dirtied once, before the load
    c.barrier()
    real = getattr(load_module, READ_STAGE)

    def hooked(*args: Any, **kwargs: Any) -> int:
        if mm is None:
            c.barrier()  # the verifier has read its files
            got: int = real(*args, **kwargs)
            return got
        n: int = real(*args, **kwargs)
        mm[pos] ^= flip
        c.barrier()
        return n

    def run() -> str:
        setattr(load_module, READ_STAGE, hooked)
        try:
            out = deeppart.load(d)
        finally:
            setattr(load_module, READ_STAGE, real)
        try:
            assert_bitwise_equal(state, out, case)
        except AssertionError:
            return f"wrong-bytes(step={out.get('step')!r})"
        return "ok"

    outcomes = _outcome(c, "verified", case, run)
    if mm is not None:
        mm[pos] ^= flip
        mm.flush()
        mm.close()
    c.barrier()
    return outcomes


def scenario_verified(d: Path) -> None:
    c = resolve()
    state = make_state()
    state["step"] = 7
    deeppart.save(state, d)
    meta, _ = reader.read_metadata(d)
    raw = [0] * meta.world_size
    for p in meta.pieces:
        raw[p.rank] += p.length
    readers = reader.assign_readers(raw, c.size)
    tensor = max(meta.pieces, key=lambda p: p.length)
    tensor_outcomes = _flip_during_load(
        c, d, state, "tensor-byte", tensor.rank, tensor.offset + tensor.length // 2, 0x10,
        readers[tensor.rank],
    )  # fmt: skip
    step_leaf = next(i for i, lf in enumerate(meta.leaves) if lf.path == ["step"])
    step = next(p for p in meta.pieces if p.leaf == step_leaf)
    data = (d / data_file_name(step.rank)).read_bytes()[step.offset : step.offset + step.length]
    at = step.offset + data.rindex(b"7")
    # "7" xor 0x0e is "9": a valid value, step = 9, if it is returned.
    plain_outcomes = _flip_during_load(
        c, d, state, "plain-value", step.rank, at, 0x0E, readers[step.rank]
    )
    # Every rank the saved bytes, or every rank the same error.
    ok = ({"ok"}, {"CorruptCheckpointError"})
    assert set(tensor_outcomes) in ok and set(plain_outcomes) in ok, (
        tensor_outcomes,
        plain_outcomes,
    )
    # Nothing on disk changed: the same load succeeds.
    assert_bitwise_equal(state, deeppart.load(d), "after")
    print_line(f"OK verified rank {c.rank}/{c.size}")


# ----------------------------------------------------------------------------
# Every failure reaches every rank.


def _failing(module: Any, name: str, exc: type[BaseException]) -> Callable[[], None]:
    """Makes ``module.name`` raise ``exc`` (on the rank that calls this);
    returns the undo."""
    real = getattr(module, name)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise exc(f"injected failure in {name}")

    setattr(module, name, fail)
    return lambda: setattr(module, name, real)


#: (case, the stage's function: module and name, the rank it fails on,
#: the injected type, the operation: "save" or a load's exchange).
LOAD_STAGES: list[tuple[str, Any, str, int, str]] = [
    ("load-open", load_module, "open_checkpoint", 1, "auto"),
    ("load-plan", load_module, "plan_reads", 1, "auto"),
    ("load-read", reader, "read_file", 1, "auto"),
    ("load-read-all", reader, "read_file", 1, "read"),
    ("load-exchange-shared", reader, "_copy_to", 1, "auto"),
    ("load-exchange-bcast", reader, "_copy_to", 1, "bcast"),
    ("load-decode-plain", reader, "decode_plain", 1, "auto"),
    ("load-assemble", load_module, "assemble", 1, "auto"),
]
SAVE_STAGES: list[tuple[str, Any, str, int]] = [
    ("save-target", storage_target, "check_target", 1),
    ("save-prepare", prepare, "_own_prepare", 1),
    ("save-temp-dir", storage_target, "make_temp_dir", 0),
    ("save-write", save_module, "write_pieces", 1),
    ("save-metadata", save_module, "metadata_json", 0),
    ("save-commit", storage_target, "commit_dir", 0),
]


def _loading(d: Path, exchange: str) -> Callable[[], str]:
    def run() -> str:
        deeppart.load(d, loading=deeppart.LoadOptions(exchange=exchange))
        return "ok"

    return run


def _saving(state: Any, d: Path) -> Callable[[], str]:
    def run() -> str:
        deeppart.save(state, d)
        return "ok"

    return run


def _saved(d: Path) -> tuple[Comm, Any, Path]:
    """The job's comm, a state and where it was saved (``d/good``)."""
    c = resolve()
    state = make_state()
    good = d / "good"
    deeppart.save(state, good)
    return c, state, good


def _remove(c: Comm, target: Path) -> None:
    """Rank 0 removes ``target`` while the others wait."""
    c.barrier()
    if c.rank == 0:
        shutil.rmtree(target, ignore_errors=True)
    c.barrier()


def scenario_stages(d: Path) -> None:
    c, state, good = _saved(d)
    failures: list[str] = []
    for case, module, name, bad, exchange in LOAD_STAGES:
        undo = _failing(module, name, CorruptCheckpointError) if c.rank == bad else None
        try:
            outcomes = _outcome(c, "stages", case, _loading(good, exchange))
        finally:
            if undo is not None:
                undo()
        if set(outcomes) != {"CorruptCheckpointError"}:
            failures.append(f"{case}: {outcomes}")
    for k, (case, module, name, bad) in enumerate(SAVE_STAGES):
        target = d / f"save-{k}"
        undo = _failing(module, name, StateError) if c.rank == bad else None
        try:
            outcomes = _outcome(c, "stages", case, _saving(state, target))
        finally:
            if undo is not None:
                undo()
        if set(outcomes) != {"StateError"}:
            failures.append(f"{case}: {outcomes}")
        _remove(c, target)
    # After all that, the job still saves and loads.
    assert_bitwise_equal(state, deeppart.load(good), "after the failures")
    assert not failures, failures
    print_line(f"OK stages rank {c.rank}/{c.size}")


def scenario_directories(d: Path) -> None:
    c = resolve()
    own = d / f"rank-{c.rank}"
    own.mkdir(parents=True)
    began: list[Path] = []
    remove = add_fault_hook("before-write", lambda event: began.append(event.path))
    said: list[str] = []

    def run() -> str:
        try:
            deeppart.save({"w": torch.arange(4096.0)}, Path("/proc/self/cwd/ckpt"))
        except DeepPartError as e:
            said.append(str(e))
            raise
        return "ok"

    home = os.getcwd()
    os.chdir(own)
    try:
        outcomes = _outcome(c, "directories", "private", run)
    finally:
        os.chdir(home)
        remove()
    assert set(outcomes) == {"StoreConfigError"}, outcomes
    assert "rank 1 does not see this save's temporary directory" in said[0], said
    assert "nothing was written" in said[0], said
    assert not began, f"rank {c.rank} began writing {began}"
    assert not list(own.iterdir()), list(own.iterdir())
    print_line(f"OK directories rank {c.rank}/{c.size}")


# ----------------------------------------------------------------------------
# Every kind of exit of one rank reaches every rank.

#: A Checkpointer's steps that run on rank 0 only: its line record (before
#: the save) and its cleanup of old steps (after the commit).
RANK0_STEPS: list[tuple[str, str]] = [
    ("checkpointer-record", "_line_record"),
    ("checkpointer-cleanup", "_cleanup_or_warn"),
]


def _interrupted(
    c: Comm, case: str, module: Any, name: str, bad: int, exc: type[BaseException], run: Any
) -> str:
    """``module.name`` raises ``exc`` on rank ``bad`` during ``run``: rank
    ``bad`` must raise ``exc`` itself, every other rank a DeepPartError
    naming rank ``bad`` and the interruption. Returns "" or what differs."""
    undo = _failing(module, name, exc) if c.rank == bad else None
    try:
        names = f"rank {bad}: interrupted by" if c.rank != bad else ""
        outcomes = _outcome(c, "interrupts", case, run, names=names)
    finally:
        if undo is not None:
            undo()
    deeppart_errors = {cls.__name__ for cls in ERROR_TYPES}
    for r, got in enumerate(outcomes):
        if (got != exc.__name__) if r == bad else (got not in deeppart_errors):
            return f"{case}: {outcomes}"
    return ""


def scenario_interrupts(d: Path) -> None:
    from deeppart.checkpointer import Checkpointer

    c, state, good = _saved(d)
    failures: list[str] = []
    for case, module, name, bad, exchange in LOAD_STAGES:
        failures.append(
            _interrupted(c, case, module, name, bad, KeyboardInterrupt, _loading(good, exchange))
        )
    for k, (case, module, name, bad) in enumerate(SAVE_STAGES):
        target = d / f"save-{k}"
        exc = SystemExit if case == "save-write" else KeyboardInterrupt
        failures.append(_interrupted(c, case, module, name, bad, exc, _saving(state, target)))
        _remove(c, target)
    ck = Checkpointer(d / "line", keep_last=1)
    ck.save(1, state)
    for k, (case, name) in enumerate(RANK0_STEPS):

        def step(k: int = k) -> str:
            ck.save(2 + k, state)
            return "ok"

        failures.append(_interrupted(c, case, Checkpointer, name, 0, KeyboardInterrupt, step))
    # After all that, the job still saves and loads.
    ck.save(9, state)
    assert_bitwise_equal(state, ck.load(9), "after the interruptions")
    assert_bitwise_equal(state, deeppart.load(good), "after the interruptions")
    failures = [f for f in failures if f]
    assert not failures, failures
    print_line(f"OK interrupts rank {c.rank}/{c.size}")


def scenario_loadstep(d: Path) -> None:
    import time

    from deeppart.checkpointer import Checkpointer
    from deeppart.comm import SingleComm
    from deeppart.errors import StateMismatchError

    c = resolve()
    root = d / "run"
    picked = d / "rank-0-picked"
    ck = Checkpointer(root, comm=c)
    ck.save(1, {"v": torch.full((64,), 1.0), "step": 1})
    latest = Checkpointer.latest

    def rank0_latest(self: Checkpointer) -> int | None:
        got = latest(self)
        picked.write_text(str(got))  # rank 1's training job commits step 2 now
        return got

    if c.rank == 0:
        Checkpointer.latest = rank0_latest  # type: ignore[method-assign]
    else:
        Checkpointer.latest = latest  # type: ignore[method-assign]

    def evaluate() -> str:
        if c.rank == 1:
            deadline = time.monotonic() + 60
            while not picked.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            trainer = Checkpointer(root, comm=SingleComm())
            trainer.load(1)
            trainer.save(2, {"v": torch.full((64,), 2.0), "step": 2})
        got = ck.load()
        return f"step{got['step']}"

    try:
        outcomes = _outcome(c, "loadstep", "latest-raced", evaluate)
    finally:
        Checkpointer.latest = latest  # type: ignore[method-assign]
    assert outcomes == ["step1", "step1"], outcomes
    outcomes = _outcome(c, "loadstep", "different-steps", lambda: str(ck.load(1 + c.rank)["step"]))
    assert outcomes == [StateMismatchError.__name__] * c.size, outcomes
    outcomes = _outcome(c, "loadstep", "latest-after", lambda: f"step{ck.load()['step']}")
    assert outcomes == ["step2"] * c.size, outcomes
    print_line(f"OK loadstep rank {c.rank}/{c.size}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir", type=Path)
    p.add_argument("--scenario", default=None, help="run only this scenario (loadstep)")
    args = p.parse_args()
    torch.set_num_threads(1)
    c = resolve()
    if args.scenario == "loadstep":
        scenario_loadstep(args.dir / "loadstep")
        return
    scenario_verified(args.dir / "verified")
    c.barrier()
    scenario_stages(args.dir / "stages")
    c.barrier()
    scenario_directories(args.dir / "directories")
    scenario_interrupts(args.dir / "interrupts")


if __name__ == "__main__":
    abort_on_failure(main)
