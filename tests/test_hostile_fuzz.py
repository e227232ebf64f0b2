"""Property-based fuzzing of the two parsers that read untrusted input: the
checkpoint metadata (through a real :func:`deeppart.load` of a rewritten
checkpoint) and the planner service's wire manifest. Whatever the input,
they return or raise a DeepPart error, never anything else.

The suite runs a few dozen examples each; a long run (issue 13) sets
``DEEPPART_FUZZ_EXAMPLES`` (e.g. 10**9) and is bounded by a timeout::

    DEEPPART_FUZZ_EXAMPLES=1000000000 timeout -s INT 600 \\
        .venv/bin/python -m pytest tests/test_hostile_fuzz.py -k metadata -x -q
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deeppart
from deeppart._planner import DeepPartError
from deeppart.cli import main as cli_main
from deeppart.errors import CheckpointError, StateError, WireError
from deeppart.format import MARKER, METADATA, marker_text
from deeppart.proto import planner_pb2 as pb
from deeppart.service import wire

EXAMPLES = int(os.environ.get("DEEPPART_FUZZ_EXAMPLES", "20"))
#: Examples run per test, printed at exit in a long run.
RUNS: collections.Counter[str] = collections.Counter()
LONG_RUN = "DEEPPART_FUZZ_EXAMPLES" in os.environ


def _count(test: str) -> None:
    """Counts an example; a long run prints the count every 200 examples."""
    RUNS[test] += 1
    if LONG_RUN and RUNS[test] % 200 == 0:
        print(f"fuzz examples run: {test} {RUNS[test]}", file=sys.stderr, flush=True)


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
        deeppart.save(_STATE, d, compression=codec)
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
def test_fuzz_metadata_fields(
    saved: dict[str, Any], tmp_path: Path, data: st.DataObject, codec: str
) -> None:
    """Random subtrees of a real metadata.json replaced by random JSON."""
    _count("test_fuzz_metadata_fields")
    meta = json.loads(saved[codec][METADATA])
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(meta)))
        meta = _replace(meta, path, data.draw(_JSON))
    _write(tmp_path, saved[codec], json.dumps(meta).encode())
    _load_or_deeppart_error(tmp_path)


@FUZZ
@given(data=st.data(), codec=st.sampled_from(["None", "zstd"]))
def test_fuzz_metadata_bytes(
    saved: dict[str, Any], tmp_path: Path, data: st.DataObject, codec: str
) -> None:
    """Random byte edits of a real metadata.json (the marker re-signed)."""
    _count("test_fuzz_metadata_bytes")
    text = bytearray(saved[codec][METADATA])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(text)))
        edit = data.draw(st.binary(max_size=6) | st.sampled_from([b"9" * 4400, b"[" * 3000]))
        cut = data.draw(st.integers(0, 6))
        text[at : at + cut] = edit
    _write(tmp_path, saved[codec], bytes(text))
    _load_or_deeppart_error(tmp_path)


def _write(d: Path, files: dict[str, bytes], metadata: bytes) -> None:
    for name, content in files.items():
        (d / name).write_bytes(content)
    (d / METADATA).write_bytes(metadata)
    (d / MARKER).write_bytes(marker_text(metadata))


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
def test_fuzz_wire_manifest(
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
    _count("test_fuzz_wire_manifest")
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
    try:
        m = wire.manifest_from_proto(msg)
    except (WireError, DeepPartError):
        return
    assert wire.manifest_from_proto(wire.manifest_to_proto(m)) == m


@FUZZ
@given(data=st.data())
def test_fuzz_wire_manifest_bytes(data: st.DataObject) -> None:
    """Byte edits of a real serialized manifest."""
    _count("test_fuzz_wire_manifest_bytes")
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
    try:
        msg = pb.Manifest.FromString(bytes(raw))
    except Exception:  # protobuf's DecodeError: the server's gRPC layer answers that
        return
    with contextlib.suppress(WireError, DeepPartError):
        wire.manifest_from_proto(msg)
