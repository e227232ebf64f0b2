"""Property-based fuzzing of the two parsers that read untrusted input: the
checkpoint metadata (through a real :func:`deeppart.load` of a rewritten
checkpoint) and the planner service's wire manifest. Whatever the input,
they return or raise a DeepPart error, never anything else.

Every example is also bounded: it must cost less than ``MAX_EXAMPLE_S`` of
CPU time (all threads; a loaded machine stretches the wall clock, not the
work) and add less than ``MAX_EXAMPLE_RSS_MB`` to the process's peak RSS (the peak is
reset before each example), the bounds issue 13 sets for any checkpoint or
request of at most 1 MB; one still running after ``HANG_S`` fails as hung.

The suite runs a few dozen examples each; a long run (issue 13) gives each
test a time budget in seconds, ``DEEPPART_FUZZ_SECONDS``: the test generates
examples until the budget is spent, then passes and prints how many it ran
(``DEEPPART_FUZZ_EXAMPLES`` caps the count instead, or as well)::

    DEEPPART_FUZZ_SECONDS=300 timeout 900 \\
        .venv/bin/python -m pytest tests/base/test_hostile_fuzz.py -k metadata -x -q
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deeppart
from deeppart._planner import DeepPartError
from deeppart.errors import CheckpointError, StateError, WireError
from deeppart.format import MARKER, METADATA, marker_text
from deeppart.proto import planner_pb2 as pb
from deeppart.service import wire
from deeppart.tools.cli import main as cli_main

BUDGET_S = float(os.environ.get("DEEPPART_FUZZ_SECONDS", "0"))
EXAMPLES = int(os.environ.get("DEEPPART_FUZZ_EXAMPLES", "1000000000" if BUDGET_S else "20"))
LONG_RUN = "DEEPPART_FUZZ_EXAMPLES" in os.environ or BUDGET_S > 0
MAX_EXAMPLE_S = 10.0
MAX_EXAMPLE_RSS_MB = 512
HANG_S = 120
#: Examples run per test; a long run prints the counts as it goes and at the end.
RUNS: collections.Counter[str] = collections.Counter()
#: The largest time (s) and added peak RSS (MB) one example took, per test.
WORST: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])


class _BudgetSpent(KeyboardInterrupt):
    """Stops Hypothesis at once (it re-raises KeyboardInterrupt without
    shrinking or replaying); caught by :func:`_fuzz`, so the test passes."""


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> bool:
    """Resets the process's peak RSS (Linux 4.0+); False where that fails."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _hung(signum: int, frame: Any) -> None:
    raise AssertionError(f"example still running after {HANG_S} s: hung")


@contextlib.contextmanager
def _bounded(test: str) -> Iterator[None]:
    """One example: counted, timed, its added peak RSS measured."""
    if BUDGET_S and time.monotonic() > _STARTED[test] + BUDGET_S:
        raise _BudgetSpent
    RUNS[test] += 1
    if LONG_RUN and RUNS[test] % 1000 == 0:
        _report(test)
    reset = _reset_peak()
    before = _rss_kib("VmRSS") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    old = signal.signal(signal.SIGALRM, _hung)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    t0 = time.process_time()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    # CPU time of the process (all threads): the example's work, which a
    # loaded machine does not stretch; a hang is the timer's to catch.
    seconds = time.process_time() - t0
    peak = _rss_kib("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    added_mb = max(0, peak - before) / 1024
    worst = WORST[test]
    worst[0], worst[1] = max(worst[0], seconds), max(worst[1], added_mb)
    assert seconds < MAX_EXAMPLE_S, f"one example took {seconds:.1f} s of CPU"
    assert added_mb < MAX_EXAMPLE_RSS_MB, f"one example added {added_mb:.0f} MB of peak RSS"


_STARTED: dict[str, float] = {}
#: The running test's capfd fixture: progress lines get past pytest's capture.
_CAPFD: list[pytest.CaptureFixture[str]] = []


def _report(test: str, end: str = "") -> None:
    worst = WORST[test]
    line = (
        f"fuzz examples run: {test} {RUNS[test]} in {time.monotonic() - _STARTED[test]:.0f} s; "
        f"slowest example {worst[0]:.3f} s, largest added peak RSS {worst[1]:.1f} MB{end}"
    )
    with _CAPFD[0].disabled() if _CAPFD else contextlib.nullcontext():
        print(line, file=sys.stderr, flush=True)


def _fuzz(capfd: pytest.CaptureFixture[str], test: Callable[..., None], *args: Any) -> None:
    """Runs a Hypothesis test until its examples or its time budget are spent."""
    name = test.__name__
    _STARTED[name] = time.monotonic()
    _CAPFD[:] = [capfd]
    with contextlib.suppress(_BudgetSpent):
        test(*args)
    if LONG_RUN:
        _report(name, ": no failure")
    _CAPFD.clear()


FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)

# ----------------------------------------------------------------------------
# Metadata.

_STATE = {
    "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "z": torch.zeros(4096),
    "opt": {"lr": 0.1, "betas": (0.9, 0.99), True: None},
    "ids": [torch.arange(3), "x"],
}

_INTS = st.one_of(
    st.integers(-3, 5000),
    st.sampled_from([0, 1, 4096, 1 << 31, 1 << 62, 1 << 63, 1 << 64, -(1 << 63)]),
    st.integers(),
)
_JSON = st.recursive(
    st.none() | st.booleans() | _INTS | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    copy = list(value)
    copy[head] = _replace(copy[head], rest, new)
    return copy


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two real checkpoints (raw, zstd) and their files."""
    out: dict[str, Any] = {}
    for codec in (None, "zstd"):
        d = tmp_path_factory.mktemp(f"ck-{codec}")
        deeppart.save(_STATE, d, writing=deeppart.WriteOptions(compression=codec))
        out[str(codec)] = {p.name: p.read_bytes() for p in d.iterdir()}
    return out


def _load_or_deeppart_error(d: Path) -> None:
    """A load returns or raises a DeepPart error; ``deeppart inspect
    --verify`` (in process) exits 0, 1 or 2, printing no traceback."""
    with contextlib.suppress(DeepPartError, CheckpointError, StateError):
        deeppart.load(d)
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        rc = cli_main(["inspect", str(d), "--verify"])
    assert rc in (0, 1, 2), sink.getvalue()


@FUZZ
@given(data=st.data(), codec=st.sampled_from(["None", "zstd"]))
def fuzz_metadata_fields(
    saved: dict[str, Any], tmp_path: Path, data: st.DataObject, codec: str
) -> None:
    """Random subtrees of a real metadata.json replaced by random JSON."""
    meta = json.loads(saved[codec][METADATA])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(meta)))
        meta = _replace(meta, path, data.draw(_JSON))
    _write_and_load("fuzz_metadata_fields", tmp_path, saved[codec], json.dumps(meta).encode())


def test_fuzz_metadata_fields(
    saved: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _fuzz(capfd, fuzz_metadata_fields, saved, tmp_path)


@FUZZ
@given(data=st.data(), codec=st.sampled_from(["None", "zstd"]))
def fuzz_metadata_bytes(
    saved: dict[str, Any], tmp_path: Path, data: st.DataObject, codec: str
) -> None:
    """Random byte edits of a real metadata.json (the marker re-signed)."""
    text = bytearray(saved[codec][METADATA])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        edit = data.draw(st.binary(max_size=6) | st.sampled_from([b"9" * 4400, b"[" * 3000]))
        cut = data.draw(st.integers(0, 6))
        text[at : at + cut] = edit
    _write_and_load("fuzz_metadata_bytes", tmp_path, saved[codec], bytes(text))


def test_fuzz_metadata_bytes(
    saved: dict[str, Any], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    _fuzz(capfd, fuzz_metadata_bytes, saved, tmp_path)


def _write_and_load(test: str, d: Path, files: dict[str, bytes], metadata: bytes) -> None:
    """Writes a checkpoint with this metadata (the marker re-signed) and
    loads it, bounded."""
    for name, content in files.items():
        (d / name).write_bytes(content)
    (d / METADATA).write_bytes(metadata)
    (d / MARKER).write_bytes(marker_text(metadata))
    with _bounded(test):
        _load_or_deeppart_error(d)


# ----------------------------------------------------------------------------
# Wire manifests.

_U32 = st.lists(st.integers(0, 12) | st.sampled_from([256, 257, (1 << 32) - 1]), max_size=12)
_U64 = st.lists(st.integers(0, 12) | st.sampled_from([1 << 32, 1 << 62, 2**64 - 1]), max_size=12)


@FUZZ
@given(
    shared=_U32,
    suffix_len=_U32,
    suffix_keys=_U32,
    dtype=_U32,
    ndim=_U32,
    dims=_U64,
    nbytes=_U64,
    owned=_U32,
    owners=_U32,
    strings=st.lists(st.text(max_size=4), max_size=4),
    ints=st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=4),
    dtypes=st.lists(st.sampled_from(["float32", "int8", "bogus", ""]), max_size=3),
)
def fuzz_wire_manifest(
    shared: list[int],
    suffix_len: list[int],
    suffix_keys: list[int],
    dtype: list[int],
    ndim: list[int],
    dims: list[int],
    nbytes: list[int],
    owned: list[int],
    owners: list[int],
    strings: list[str],
    ints: list[int],
    dtypes: list[str],
) -> None:
    msg = pb.Manifest(
        version=1,
        string_keys=strings,
        int_keys=ints,
        shared=shared,
        suffix_len=suffix_len,
        suffix_keys=suffix_keys,
        dtypes=dtypes,
        dtype=dtype,
        ndim=ndim,
        dims=dims,
        object_nbytes=nbytes,
        owned_leaves=owned,
        owner_ranks=owners,
    )
    with _bounded("fuzz_wire_manifest"):
        try:
            m = wire.manifest_from_proto(msg)
        except (WireError, DeepPartError):
            return
        assert wire.manifest_from_proto(wire.manifest_to_proto(m)) == m


def test_fuzz_wire_manifest(capfd: pytest.CaptureFixture[str]) -> None:
    _fuzz(capfd, fuzz_wire_manifest)


@FUZZ
@given(data=st.data())
def fuzz_wire_manifest_bytes(data: st.DataObject) -> None:
    """Byte edits of a real serialized manifest."""
    leaves: list[dict[str, Any]] = [
        {"path": ["m", i % 3, f"p{i}"], "dtype": "float32", "shape": [i + 1, 2]} for i in range(6)
    ]
    leaves.append({"path": ["m", "opt"], "kind": "object", "nbytes": 10, "owner": 1})
    raw = bytearray(
        wire.manifest_to_proto(deeppart.Manifest.from_leaves(leaves)).SerializeToString()
    )
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(raw)))
        raw[at : at + data.draw(st.integers(0, 3))] = data.draw(st.binary(max_size=4))
    with _bounded("fuzz_wire_manifest_bytes"):
        try:
            msg = pb.Manifest.FromString(bytes(raw))
        except Exception:  # protobuf's DecodeError: the server's gRPC layer answers that
            return
        with contextlib.suppress(WireError, DeepPartError):
            wire.manifest_from_proto(msg)


def test_fuzz_wire_manifest_bytes(capfd: pytest.CaptureFixture[str]) -> None:
    _fuzz(capfd, fuzz_wire_manifest_bytes)
