"""Typed plain values (numpy, torch dtypes/sizes/devices, ordered dicts,
sets) round-trip through a checkpoint with their types; random generator
states restore the same stream."""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deeppart
from deeppart.format import METADATA
from deeppart.state import values
from deeppart.state.state import decode_plain, encode_plain, flatten


def _same(a: Any, b: Any) -> None:
    """Equal values of exactly the same types, recursively (numpy arrays:
    dtype, shape and bytes)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple) and not isinstance(a, torch.Size):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def _typed_values() -> dict[str, Any]:
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "big_endian": np.arange(4, dtype=">i8"),
        "bools": np.array([True, False]),
        "strs": np.array(["a", "bcd"]),
        "bytes": np.array([b"x", b"yz"]),
        "dates": np.array(["2024-01-02"], dtype="datetime64[D]"),
        "zero_d": np.array(3.5),
        "noncontig": np.arange(20, dtype=np.int16).reshape(4, 5)[:, ::2],
        "empty": np.zeros((0, 3), dtype=np.uint32),
        "scalars": [
            np.float64(1.5),
            np.float32(np.nan),
            np.int64(-7),
            np.bool_(True),
            np.uint8(255),
            np.str_("s"),
            np.complex64(1 + 2j),
        ],
        "dtype": torch.bfloat16,
        "dtypes": (torch.float32, torch.int8, torch.bool),
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "cuda": torch.device("cuda", 1),
        "ordered": OrderedDict([("b", 1), ("a", (2, 3))]),
        "set": {3, 1, 2},
        "frozen": frozenset({"x", "y"}),
        "tuple_vs_list": ((1, [2, 3]), [4, (5,)]),
    }


def test_plain_encoding_keeps_types() -> None:
    v = _typed_values()
    _same(v, decode_plain(encode_plain(v)))


def test_checkpoint_with_numpy_and_dtypes_round_trips(tmp_path: Path) -> None:
    v = _typed_values()
    state = {"model": {"w": torch.randn(3, 4)}, "values": v, "n": np.int32(4)}
    deeppart.save(state, tmp_path / "ck")
    got = deeppart.load(tmp_path / "ck")
    _same(state, got)
    text = (tmp_path / "ck" / METADATA).read_text()
    assert "pickle" not in text


def test_large_arrays_are_tensor_leaves(tmp_path: Path) -> None:
    big = np.random.default_rng(0).standard_normal((300, 200)).astype(np.float32)
    small = np.arange(10, dtype=np.float64)
    state: dict[str, Any] = {"big": big, "pair": (big[:, ::2], small), "n": 1}
    leaves, skeleton = flatten(state)
    assert [lf.tensor is not None for lf in leaves] == [True, True, False, False]
    assert skeleton["dict"][0][1] == {"ndarray": 0}
    deeppart.save(state, tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / METADATA).read_text())
    assert meta["manifest"]["leaves"][0]["dtype"] == "float32"
    got = deeppart.load(tmp_path / "ck")
    _same(state, got)
    # A part without the arrays, and one with them.
    assert deeppart.load(tmp_path / "ck", keys=["n"]) == {"n": 1}
    _same({"big": big}, deeppart.load(tmp_path / "ck", keys=["big"]))
    # into= fills the arrays in place.
    big_into, half_into = np.zeros_like(big), np.zeros((300, 100), np.float32)
    deeppart.load(tmp_path / "ck", into={"big": big_into, "pair": (half_into, small), "n": 0})
    assert np.array_equal(big_into, big) and np.array_equal(half_into, big[:, ::2])


def test_random_states_reproduce_the_same_stream(tmp_path: Path) -> None:
    random.seed(1234)
    np.random.seed(99)
    np.random.standard_normal(3)  # leaves a cached gaussian in the state
    torch.manual_seed(5)
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "generator": np.random.default_rng(7).bit_generator.state,
        "cpu": torch.get_rng_state(),
    }
    expect_py = [random.random() for _ in range(5)]
    expect_np = np.random.standard_normal(5)
    expect_torch = torch.rand(5)
    deeppart.save(state, tmp_path / "ck")
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    got = deeppart.load(tmp_path / "ck")
    _same(state, got)
    random.setstate(got["python"])
    np.random.set_state(got["numpy"])
    torch.set_rng_state(got["cpu"])
    assert [random.random() for _ in range(5)] == expect_py
    assert np.array_equal(np.random.standard_normal(5), expect_np)
    assert torch.equal(torch.rand(5), expect_torch)
    gen = np.random.default_rng()
    gen.bit_generator.state = got["generator"]
    assert np.array_equal(gen.random(4), np.random.default_rng(7).random(4))


def test_ordered_dict_with_tensors_stays_ordered(tmp_path: Path) -> None:
    sd = torch.nn.Linear(2, 2).state_dict()
    deeppart.save({"model": sd}, tmp_path / "ck")
    got = deeppart.load(tmp_path / "ck")
    assert type(got["model"]) is OrderedDict
    assert list(got["model"]) == list(sd)


def test_sets_encode_the_same_whatever_the_order() -> None:
    a = {f"k{i}" for i in range(50)}
    b = set(sorted(a, reverse=True))
    assert encode_plain(a) == encode_plain(b)


@pytest.mark.parametrize(
    "bad",
    [np.array([object()], dtype=object), np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])],
)
def test_object_and_structured_arrays_rejected(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(deeppart.StateError, match="rng/x: numpy dtype"):
        deeppart.save({"rng": {"x": bad}}, tmp_path / "ck")


@pytest.mark.parametrize(
    "encoded",
    [
        {"np": ["|O", [1], ""]},
        {"np": ["<f4", [2], "AAAA"]},
        {"np": ["<f4", [-1], ""]},
        {"np": ["f4,i4", [1], "AAAAAAAAAAA="]},
        {"ng": ["<f8"]},
        {"tdt": "Tensor"},
        {"tdt": "__class__"},
        {"tdv": "nonsense:9"},
        {"tsz": [1, "2"]},
        {"set": [[1]]},
        {"od": [[1]]},
    ],
)
def test_malformed_typed_values_are_value_errors(encoded: Any) -> None:
    with pytest.raises(ValueError):
        decode_plain(json.dumps(encoded).encode())


def test_array_leaf_threshold() -> None:
    n = values.ARRAY_LEAF_BYTES // 4
    assert values.is_array_leaf(np.zeros(n, np.float32))
    assert not values.is_array_leaf(np.zeros(n - 1, np.float32))
    assert not values.is_array_leaf(np.zeros(n, ">f4")), "non-native order stays inline"
