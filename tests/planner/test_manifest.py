"""Manifests: walking real state dicts, the JSON form, and every bad input
with its exception type and message."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

import deeppart
from deeppart.state.state import encode_plain

# ----------------------------------------------------------------------------
# A real model and AdamW state after one step.


def _model_and_adamw() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16),
        torch.nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True),
        torch.nn.Linear(16, 5),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(torch.randint(0, 50, (2, 7)))
    out.sum().backward()
    opt.step()
    return model, opt


def _leaf_of(t: torch.Tensor) -> tuple[str, tuple[int, ...], int]:
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()


def test_from_state_dict_on_a_model_and_adamw() -> None:
    model, opt = _model_and_adamw()
    model_sd = model.state_dict()
    optim_sd = opt.state_dict()
    state = {"model": model_sd, "optim": optim_sd}

    m = deeppart.Manifest.from_state_dict(state)
    leaves = {leaf["path"]: leaf for leaf in m.leaves()}
    assert len(leaves) == len(m)

    expected: dict[tuple[Any, ...], torch.Tensor] = {("model", k): v for k, v in model_sd.items()}
    for i, per_param in optim_sd["state"].items():
        assert set(per_param) == {"step", "exp_avg", "exp_avg_sq"}
        for name, t in per_param.items():
            expected[("optim", "state", i, name)] = t
    for path, t in expected.items():
        leaf = leaves[path]
        assert leaf["kind"] == "tensor"
        assert (leaf["dtype"], leaf["shape"], leaf["nbytes"]) == _leaf_of(t), path
        assert leaf["owner"] is None

    # AdamW's step is a 0-D float32 tensor, a leaf of 4 bytes.
    step = leaves[("optim", "state", 0, "step")]
    assert (step["dtype"], step["shape"], step["nbytes"]) == ("float32", (), 4)
    # The exact path of a moment, integer key included.
    assert ("optim", "state", 0, "exp_avg") in leaves

    # param_groups (no tensors) is one object leaf, sized by the safe encoding.
    groups = leaves[("optim", "param_groups")]
    assert groups["kind"] == "object"
    assert groups["nbytes"] == len(encode_plain(optim_sd["param_groups"]))
    assert not any(p[:2] == ("optim", "param_groups") and len(p) > 2 for p in leaves)

    assert set(leaves) == {*expected, ("optim", "param_groups")}
    assert m.total_bytes == sum(leaf["nbytes"] for leaf in leaves.values())
    # Model parameters first, in state_dict order; then the optimizer.
    assert m.paths()[: len(model_sd)] == [("model", k) for k in model_sd]


def test_bench_adamw_layout_matches_torch() -> None:
    """bench/models.py lays out model + AdamW exactly like a real state dict."""
    from bench.models import adamw_manifest

    model, opt = _model_and_adamw()
    real = deeppart.Manifest.from_state_dict(
        {"model": model.state_dict(), "optim": opt.state_dict()}
    )
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert len(named) == len(model.state_dict())  # no buffers in this model
    built = adamw_manifest(named)
    assert built.leaves() == real.leaves()
    assert built == real
    assert built.fingerprint == real.fingerprint


def test_walk_nested_containers_paths_and_kinds() -> None:
    state = {
        "a": [torch.zeros(2), (torch.zeros(3, dtype=torch.int64), {"b": torch.zeros(())})],
        "c": 5,
        "d": {"e": "text", 7: torch.ones(2, 2, dtype=torch.bfloat16)},
    }
    m = deeppart.Manifest.from_state_dict(state)
    got = [(leaf["path"], leaf["kind"], leaf["nbytes"]) for leaf in m.leaves()]
    assert got == [
        (("a", 0), "tensor", 8),
        (("a", 1, 0), "tensor", 24),
        (("a", 1, 1, "b"), "tensor", 4),
        (("c",), "object", len(encode_plain(5))),
        (("d", "e"), "object", len(encode_plain("text"))),
        (("d", 7), "tensor", 8),
    ]
    assert m.leaves()[5]["dtype"] == "bfloat16"


def test_walk_does_not_touch_tensor_data() -> None:
    # Meta tensors have no data at all: 4 TiB described without allocating.
    huge = torch.empty(1 << 20, 1 << 20, device="meta")
    view = torch.zeros(4, 6)[:, ::2]  # non-contiguous: described by its shape
    m = deeppart.Manifest.from_state_dict({"huge": huge, "view": view})
    huge_leaf, view_leaf = m.leaves()
    assert huge_leaf["nbytes"] == 4 << 40
    assert huge_leaf["shape"] == (1 << 20, 1 << 20)
    assert (view_leaf["shape"], view_leaf["nbytes"]) == ((4, 3), 48)


def test_bare_tensor_at_the_root_gets_a_path() -> None:
    m = deeppart.Manifest.from_state_dict(torch.zeros(3))
    assert m.paths() == [("<root>",)]


def test_json_round_trip(example_manifest: deeppart.Manifest) -> None:
    model, opt = _model_and_adamw()
    for m in (
        example_manifest,
        deeppart.Manifest.from_state_dict({"model": model.state_dict(), "optim": opt.state_dict()}),
    ):
        again = deeppart.Manifest.from_json(m.to_json())
        assert again == m
        assert again.fingerprint == m.fingerprint
        assert hash(again) == hash(m)
        assert again.leaves() == m.leaves()
        assert again.to_json() == m.to_json()
    owned = [leaf for leaf in example_manifest.leaves() if leaf["owner"] is not None]
    assert [(leaf["path"], leaf["owner"]) for leaf in owned] == [(("rng",), 3)]


def test_equality_and_fingerprint_track_content() -> None:
    a = deeppart.Manifest.from_leaves([{"path": ["w"], "dtype": "float32", "shape": [4]}])
    b = deeppart.Manifest.from_leaves([{"path": ["w"], "dtype": "float32", "shape": [2, 2]}])
    assert a != b and a.fingerprint != b.fingerprint
    assert a != "not a manifest"
    assert len({a, deeppart.Manifest.from_json(a.to_json())}) == 1


def test_dtype_aliases_are_accepted() -> None:
    m = deeppart.Manifest.from_leaves(
        [
            {"path": ["a"], "dtype": "torch.half", "shape": [2]},
            {"path": ["b"], "dtype": "long", "shape": [2]},
        ]
    )
    assert [(leaf["dtype"], leaf["nbytes"]) for leaf in m.leaves()] == [
        ("float16", 4),
        ("int64", 16),
    ]


# ----------------------------------------------------------------------------
# Bad manifests: the type and message of every error.


def _text(*leaves: Any, **top: Any) -> str:
    return json.dumps({"version": 1, "leaves": list(leaves), **top})


BIG = 1 << 60  # the per-leaf and total limit (1 EiB)

BAD_JSON: list[tuple[str, str, str]] = [
    (
        "unknown dtype",
        _text({"path": ["a"], "dtype": "float33", "shape": [1]}),
        'leaf 0 (a): unknown dtype "float33"',
    ),
    (
        "element count overflows u64",
        _text({"path": ["a"], "dtype": "float32", "shape": [1 << 32, 1 << 32]}),
        "leaf 0 (a): shape [4294967296, 4294967296] overflows: its element count exceeds 2^64",
    ),
    (
        "byte size overflows u64",
        _text({"path": ["a"], "dtype": "float64", "shape": [1 << 32, 1 << 29]}),
        "of float64 overflows: its byte size exceeds 2^64",
    ),
    (
        "absurd tensor size",
        _text({"path": ["a"], "dtype": "float32", "shape": [1 << 40, 1 << 20]}),
        "more than the limit of 1152921504606846976",
    ),
    (
        "absurd object size",
        _text({"path": ["a"], "kind": "object", "nbytes": BIG * 2}),
        "leaf 0 (a): object of 2305843009213693952 bytes is larger than the limit",
    ),
    (
        "object size beyond u64",
        _text({"path": ["a"], "kind": "object", "nbytes": 1 << 64}),
        "is not a non-negative integer",
    ),
    (
        "total size overflows",
        _text(
            {"path": ["a"], "kind": "object", "nbytes": BIG},
            {"path": ["b"], "kind": "object", "nbytes": BIG},
        ),
        "manifest total size overflows",
    ),
    (
        "negative dimension",
        _text({"path": ["a"], "dtype": "float32", "shape": [3, -1]}),
        "leaf 0 (a): shape dimension -1 is not a non-negative integer",
    ),
    (
        "negative nbytes",
        _text({"path": ["a"], "kind": "object", "nbytes": -5}),
        "leaf 0 (a): nbytes -5 is not a non-negative integer",
    ),
    (
        "fractional nbytes",
        _text({"path": ["a"], "kind": "object", "nbytes": 1.5}),
        "nbytes 1.5 is not a non-negative integer",
    ),
    (
        "negative owner",
        _text({"path": ["a"], "kind": "object", "nbytes": 1, "owner": -1}),
        "owner -1 is not a non-negative integer",
    ),
    (
        "duplicate path",
        _text(
            {"path": ["a", "b"], "kind": "object", "nbytes": 1},
            {"path": ["a", "b"], "dtype": "int8", "shape": [2]},
        ),
        "leaf 1 (a/b): duplicate path, first seen at leaf 0",
    ),
    (
        "empty path",
        _text({"path": [], "kind": "object", "nbytes": 1}),
        "leaf 0 (<no valid path>): path is empty",
    ),
    (
        "path key of another type",
        _text({"path": ["a", None], "kind": "object", "nbytes": 1}),
        "path key null is neither a string nor an integer",
    ),
    (
        "bad path key",
        _text({"path": ["a", 1.5], "kind": "object", "nbytes": 1}),
        "path key 1.5 is not a 64-bit integer",
    ),
    ("malformed JSON", "{", "malformed manifest JSON"),
    ("not an object", "[1, 2]", "malformed manifest JSON: the top level must be an object"),
    (
        "truncated",
        _text({"path": ["a"], "kind": "object", "nbytes": 1})[:-3],
        "malformed manifest JSON",
    ),
    ("wrong version", json.dumps({"version": 3, "leaves": []}), "unsupported manifest version 3"),
    ("missing version", json.dumps({"leaves": []}), 'malformed manifest JSON: missing "version"'),
    ("missing leaves", json.dumps({"version": 1}), 'missing "leaves"'),
    ("unknown top-level key", _text(extra=1), 'unknown top-level key "extra"'),
    (
        "unknown leaf key",
        _text({"path": ["a"], "dtype": "float32", "shape": [1], "sahpe": [2]}),
        'leaf 0 (a): unknown key "sahpe"',
    ),
    ("unknown kind", _text({"path": ["a"], "kind": "blob", "nbytes": 1}), 'unknown kind "blob"'),
    (
        "tensor with a wrong nbytes",
        _text({"path": ["a"], "dtype": "float32", "shape": [1], "nbytes": 5}),
        "leaf 0 (a): nbytes 5 does not match the dtype and shape (4 bytes)",
    ),
    (
        "object with a shape",
        _text({"path": ["a"], "kind": "object", "nbytes": 4, "shape": [1]}),
        "an object leaf takes nbytes, not dtype or shape",
    ),
    ("missing dtype", _text({"path": ["a"], "shape": [1]}), 'leaf 0 (a): missing "dtype"'),
    ("leaf not an object", _text(5), "leaf 0 (<no valid path>): a leaf must be an object"),
    (
        "too many dimensions",
        _text({"path": ["a"], "dtype": "int8", "shape": [1] * 65}),
        "tensor has 65 dimensions, more than 64",
    ),
]


@pytest.mark.parametrize(
    ("text", "message"), [c[1:] for c in BAD_JSON], ids=[c[0] for c in BAD_JSON]
)
def test_bad_manifest_json(text: str, message: str) -> None:
    with pytest.raises(deeppart.ManifestError) as info:
        deeppart.Manifest.from_json(text)
    assert message in str(info.value)
    assert isinstance(info.value, deeppart.DeepPartError)


BAD_LEAVES: list[tuple[str, list[Any], str]] = [
    (
        "dimension beyond u64",
        [{"path": ["a"], "dtype": "float32", "shape": [1 << 64]}],
        "out of the 64-bit range",
    ),
    (
        "negative dimension",
        [{"path": ["a"], "dtype": "float32", "shape": [-1]}],
        "shape dimension -1",
    ),
    (
        "negative nbytes",
        [{"path": ["a"], "kind": "object", "nbytes": -1}],
        "nbytes -1 is not a non-negative",
    ),
    (
        "NaN nbytes",
        [{"path": ["a"], "kind": "object", "nbytes": math.nan}],
        "nan is not a finite number",
    ),
    (
        "non-plain value",
        [{"path": ["a"], "kind": "object", "nbytes": object()}],
        "value of type object",
    ),
    (
        "non-string key",
        [{"path": ["a"], "kind": "object", "nbytes": 1, 3: 4}],
        "dict key 3 is not a string",
    ),
    (
        "duplicate path",
        [
            {"path": ("a", 0), "kind": "object", "nbytes": 1},
            {"path": ["a", 0], "kind": "object", "nbytes": 1},
        ],
        "leaf 1 (a/0): duplicate path, first seen at leaf 0",
    ),
    (
        "unknown dtype",
        [{"path": ["a"], "dtype": "float33", "shape": []}],
        'unknown dtype "float33"',
    ),
]


@pytest.mark.parametrize(
    ("leaves", "message"), [c[1:] for c in BAD_LEAVES], ids=[c[0] for c in BAD_LEAVES]
)
def test_bad_manifest_leaves(leaves: list[Any], message: str) -> None:
    with pytest.raises(deeppart.ManifestError) as info:
        deeppart.Manifest.from_leaves(leaves)
    assert message in str(info.value)


def test_shard_tables_stand_for_the_leaves_they_list() -> None:
    """A block item (path, dtype, table) gives the manifest the leaves its
    table's rows describe, at path + [shard_key, k], in place: equal to the
    manifest of those leaves described one by one (fingerprint included)."""
    groups = [[0, 1], [2, 3]]
    tables: list[Any] = [[[[2, 4], None, 0], [[2, 4], None, 1]], [[[3], 2, None], [[1], None, None]]]
    block = deeppart.Manifest.from_leaves(
        [
            {"path": ["a"], "kind": "object", "nbytes": 7},
            {"path": ["w", 1], "dtype": "bfloat16", "table": 0},
            {"path": ["b"], "dtype": "float32", "shape": [5], "owner": 3},
            {"path": ["v"], "dtype": "int64", "table": 1},
            {"path": ["u"], "dtype": "float32", "table": 0},
        ],
        groups,
        tables,
        "<shard>",
    )
    one_by_one = deeppart.Manifest.from_leaves(
        [
            {"path": ["a"], "kind": "object", "nbytes": 7},
            {"path": ["w", 1, "<shard>", 0], "dtype": "bfloat16", "shape": [2, 4], "holders": 0},
            {"path": ["w", 1, "<shard>", 1], "dtype": "bfloat16", "shape": [2, 4], "holders": 1},
            {"path": ["b"], "dtype": "float32", "shape": [5], "owner": 3},
            {"path": ["v", "<shard>", 0], "dtype": "int64", "shape": [3], "owner": 2},
            {"path": ["v", "<shard>", 1], "dtype": "int64", "shape": [1]},
            {"path": ["u", "<shard>", 0], "dtype": "float32", "shape": [2, 4], "holders": 0},
            {"path": ["u", "<shard>", 1], "dtype": "float32", "shape": [2, 4], "holders": 1},
        ],
        groups,
    )
    assert block == one_by_one and block.fingerprint == one_by_one.fingerprint
    assert len(block) == 8 and block.leaves()[4]["path"] == ("v", "<shard>", 0)


@pytest.mark.parametrize(
    ("item", "tables", "shard_key", "message"),
    [
        ({"path": ["w"], "dtype": "float32", "table": 1}, [[[[2], None, None]]], "<s>", "table 1 of 1"),
        ({"path": ["w"], "dtype": "float32", "table": 0}, [[[[2], None, None]]], None, "shard_key"),
        ({"path": ["w"], "dtype": "nope", "table": 0}, [[[[2], None, None]]], "<s>", "dtype"),
        ({"path": [], "dtype": "float32", "table": 0}, [[[[2], None, None]]], "<s>", "path"),
        ({"path": ["w"], "dtype": "float32", "table": "x"}, [[[[2], None, None]]], "<s>", "index"),
        (
            {"path": ["w"], "dtype": "float32", "table": 0, "shape": [2]},
            [[[[2], None, None]]], "<s>", "keys other than",
        ),
        ({"path": ["w"], "dtype": "float32", "table": 0}, [[[[-2], None, None]]], "<s>", "negative"),
        ({"path": ["w"], "dtype": "float32", "table": 0}, [[[[2], None]]], "<s>", "shard 0: not"),
        ({"path": ["w"], "dtype": "float32", "table": 0}, [[[[2], -1, None]]], "<s>", "owner"),
        (
            {"path": ["w"], "dtype": "float32", "table": 0},
            [[[[2**40, 2**40], None, None]]], "<s>", "shard 0",
        ),
    ],
)  # fmt: skip
def test_bad_shard_tables_are_named(
    item: dict[str, Any], tables: list[Any], shard_key: str | None, message: str
) -> None:
    with pytest.raises(deeppart.ManifestError) as info:
        deeppart.Manifest.from_leaves([item], None, tables, shard_key)
    assert message in str(info.value)


def test_from_leaves_rejects_a_non_iterable() -> None:
    with pytest.raises(TypeError):
        deeppart.Manifest.from_leaves(5)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------
# State dicts that hold something that is not plain.


class _Custom:
    pass


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (
            {"model": {"w": torch.zeros(2)}, "extra": {"cfg": [1, _Custom()]}},
            "extra/cfg/1: cannot save a value of type test_manifest._Custom",
        ),
        (
            {"model": {"w": torch.zeros(2), "fn": len}},
            "model/fn: cannot save a value of type builtins.",
        ),
        (
            {"model": {"w": torch.zeros(2)}, "s": range(3)},
            "s: cannot save a value of type builtins.range",
        ),
        ({"model": {"w": torch.zeros(2), _Custom(): 1}}, "model: dict key"),
        (
            {"w": torch.zeros(2).to_sparse()},
            "w: only dense (strided) tensors are supported",
        ),
    ],
    ids=["object-in-list", "function", "range", "object-key", "sparse"],
)
def test_non_plain_state_raises_state_error_naming_the_path(state: Any, message: str) -> None:
    with pytest.raises(deeppart.StateError) as info:
        deeppart.Manifest.from_state_dict(state)
    assert message in str(info.value)
    assert isinstance(info.value, TypeError)


def test_too_deep_state_is_rejected() -> None:
    deep: Any = torch.zeros(1)
    for _ in range(300):
        deep = [deep]
    with pytest.raises(deeppart.StateError, match="nested more than 200 levels deep"):
        deeppart.Manifest.from_state_dict(deep)


# ----------------------------------------------------------------------------
# Plan-time errors: inputs that are only wrong together with a plan's arguments.


def _one_object(owner: int | None = None) -> deeppart.Manifest:
    leaf: dict[str, Any] = {"path": ["a"], "kind": "object", "nbytes": 10}
    if owner is not None:
        leaf["owner"] = owner
    return deeppart.Manifest.from_leaves([leaf])


def test_owner_beyond_world_size_fails_at_plan_time(example_manifest: deeppart.Manifest) -> None:
    # The manifest is fine on its own: rank 3 owns "rng".
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.plan(example_manifest, 3)
    assert "leaf 8 (rng) is owned by rank 3, but the world size is 3" in str(info.value)
    deeppart.plan(example_manifest, 4)
    with pytest.raises(deeppart.PlanError, match="owned by rank 4, but the world size is 4"):
        deeppart.plan(_one_object(owner=4), 4)


@pytest.mark.parametrize(
    ("world_size", "message"),
    [
        (0, "world size must be at least 1, got 0"),
        (-3, "world size must be at least 1, got -3"),
        (1 << 21, "world size 2097152 is larger than the supported maximum 1048576"),
    ],
)
def test_bad_world_size(world_size: int, message: str) -> None:
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.plan(_one_object(), world_size)
    assert message in str(info.value)


def test_ranks_per_node_must_divide_world_size() -> None:
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.plan(_one_object(), 6, topology=deeppart.Topology(4))
    assert "invalid topology: world size 6 is not a multiple of ranks_per_node 4" in str(info.value)
    assert (
        deeppart.plan(_one_object(), 8, topology=deeppart.Topology(4)).topology.ranks_per_node == 4
    )


def test_ranks_per_node_must_be_positive() -> None:
    with pytest.raises(deeppart.PlanError, match="between 1 and 4294967295, got 0"):
        deeppart.Topology(0)
    with pytest.raises(deeppart.PlanError, match="got -1"):
        deeppart.Topology(-1)
    with pytest.raises(deeppart.PlanError, match="min_piece_bytes must be at least 1, got -1"):
        deeppart.CostModel(min_piece_bytes=-1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"bandwidth": math.nan},
            "invalid cost model: bandwidth must be a finite number > 0, got NaN",
        ),
        ({"bandwidth": 0.0}, "bandwidth must be a finite number > 0, got 0"),
        ({"bandwidth": -1e9}, "bandwidth must be a finite number > 0"),
        ({"bandwidth": math.inf}, "bandwidth must be a finite number > 0, got inf"),
        ({"fixed_s": -1.0}, "fixed_s must be a finite number >= 0, got -1"),
        ({"piece_s": math.inf}, "piece_s must be a finite number >= 0, got inf"),
        ({"writer_s": math.nan}, "writer_s must be a finite number >= 0, got NaN"),
        ({"min_piece_bytes": 0}, "min_piece_bytes must be at least 1"),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else ",".join(f"{k}={w}" for k, w in v.items()),
)
def test_bad_cost_model(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.CostModel(**kwargs)
    assert message in str(info.value)


def test_cost_model_defaults_and_overrides() -> None:
    d = deeppart.CostModel()
    assert d.to_dict() == {
        "fixed_s": 2e-3,
        "piece_s": 20e-6,
        "bandwidth": 1e9,
        "writer_s": 200e-6,
        "min_piece_bytes": 1 << 20,
        "align_bytes": 4096,
        "grain": "element",
        "node_bandwidth": None,
        "aggregate_bandwidth": None,
    }
    c = deeppart.CostModel(bandwidth=5e8, min_piece_bytes=1)
    assert (c.bandwidth, c.min_piece_bytes, c.fixed_s) == (5e8, 1, d.fixed_s)
    assert c == deeppart.CostModel(bandwidth=5e8, min_piece_bytes=1) and c != d
    # The storage model's fields: keywords, a round trip through to_dict, clear errors.
    s = deeppart.CostModel(
        grain="row", align_bytes=512, node_bandwidth=2e9, aggregate_bandwidth=8e9
    )
    assert (s.grain, s.align_bytes, s.node_bandwidth, s.aggregate_bandwidth) == (
        "row",
        512,
        2e9,
        8e9,
    )
    assert deeppart.CostModel(**s.to_dict()) == s
    assert "node_bandwidth=2000000000.0" in repr(s)
    for bad, message in [
        ({"grain": "box"}, "grain must be"),
        ({"node_bandwidth": 0.0}, "node_bandwidth must be"),
        ({"aggregate_bandwidth": -1.0}, "aggregate_bandwidth must be"),
        ({"align_bytes": 0}, "align_bytes must be at least 1"),
    ]:
        with pytest.raises(deeppart.PlanError, match=message):
            deeppart.CostModel(**bad)  # type: ignore[arg-type]


def test_unknown_algorithm() -> None:
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.plan(_one_object(), 4, algorithm="fastest")
    assert 'unknown algorithm "fastest"; expected one of balanced, lpt, greedy, deeppart' in str(
        info.value
    )


def test_error_hierarchy() -> None:
    assert issubclass(deeppart.ManifestError, deeppart.DeepPartError)
    assert issubclass(deeppart.PlanError, deeppart.DeepPartError)
    assert issubclass(deeppart.DeepPartError, Exception)
    assert not issubclass(deeppart.ManifestError, deeppart.PlanError)


def test_leaves_round_trip_through_from_leaves() -> None:
    manifest = deeppart.Manifest.from_json(
        json.dumps(
            {
                "version": 1,
                "leaves": [
                    {"path": ["w"], "dtype": "bfloat16", "shape": [3, 4]},
                    {"path": ["cfg", 0], "kind": "object", "nbytes": 9, "owner": 1},
                ],
            }
        )
    )
    assert deeppart.Manifest.from_leaves(manifest.leaves()) == manifest


# ----------------------------------------------------------------------------
# Holder groups (manifest version 2): leaves held by a subset of the ranks.


def _grouped() -> deeppart.Manifest:
    return deeppart.Manifest.from_leaves(
        [
            {"path": ["shard0"], "dtype": "float32", "shape": [4096, 64], "holders": 0},
            {"path": ["shard1"], "dtype": "float32", "shape": [4096, 64], "holders": 1},
            {"path": ["norm"], "dtype": "float32", "shape": [64]},
            {"path": ["rng"], "kind": "object", "nbytes": 16, "owner": 3},
        ],
        groups=[[0, 2], [1, 3]],
    )


def test_groups_round_trip_through_json_and_leaves() -> None:
    m = _grouped()
    assert m.groups == [[0, 2], [1, 3]]
    leaves = m.leaves()
    assert [leaf["holders"] for leaf in leaves] == [0, 1, None, None]
    assert leaves[3]["owner"] == 3
    doc = json.loads(m.to_json())
    assert doc["version"] == 2 and doc["groups"] == [[0, 2], [1, 3]]
    assert deeppart.Manifest.from_json(m.to_json()) == m
    assert deeppart.Manifest.from_leaves(leaves, groups=m.groups) == m
    # A manifest without groups stays version 1, with an empty group list.
    plain = deeppart.Manifest.from_leaves([{"path": ["a"], "kind": "object", "nbytes": 1}])
    assert plain.groups == [] and json.loads(plain.to_json())["version"] == 1
    assert plain.leaves()[0]["holders"] is None


def test_holders_are_part_of_the_fingerprint() -> None:
    m = _grouped()
    leaves = m.leaves()
    other = deeppart.Manifest.from_leaves(leaves, groups=[[0, 2], [1, 2]])
    assert other != m and other.fingerprint != m.fingerprint
    leaves[0]["holders"] = 1
    moved = deeppart.Manifest.from_leaves(leaves, groups=m.groups)
    assert moved != m and moved.fingerprint != m.fingerprint


@pytest.mark.parametrize(
    ("groups", "holders", "message"),
    [
        ([[0, 1], []], 0, "holder group 1: is empty"),
        ([[0, 1, 1]], 0, "holder group 0: lists rank 1 twice"),
        ([[3, 1]], 0, "holder group 0: is not sorted"),
        ([[0, -1]], 0, "holder group 0: rank -1"),
        ([[0, True]], 0, "holder group 0: rank true"),
        ([[0, 1]], 1, "leaf 0 (a): holders 1 names no group"),
        ([[0, 1]], -1, "leaf 0 (a): holders -1 is not a group index"),
        ([[0, 1]], "0", 'leaf 0 (a): holders "0" is not a group index'),
        ([[0] for _ in range(65537)], 0, "holder groups, more than the limit of 65536"),
        ([list(range(1024))] * 4097, 0, "ranks together, more than the limit of 4194304"),
    ],
)
def test_bad_groups_are_named(groups: Any, holders: Any, message: str) -> None:
    leaf = {"path": ["a"], "kind": "object", "nbytes": 1, "holders": holders}
    with pytest.raises(deeppart.ManifestError) as info:
        deeppart.Manifest.from_leaves([leaf], groups=groups)
    assert message in str(info.value)


def test_bad_grouped_json() -> None:
    leaf = {"path": ["a"], "kind": "object", "nbytes": 1, "holders": 0}
    for doc, message in [
        ({"version": 1, "groups": [[0]], "leaves": []}, 'needs "version": 2'),
        ({"version": 1, "leaves": [leaf]}, 'needs "version": 2'),
        ({"version": 2, "groups": {"a": 1}, "leaves": []}, '"groups" must be an array'),
        ({"version": 2, "groups": [[0, 1]], "leaves": [dict(leaf, owner=1)]}, "not both"),
    ]:
        with pytest.raises(deeppart.ManifestError, match=message):
            deeppart.Manifest.from_json(json.dumps(doc))


def test_group_rank_beyond_world_size_fails_at_plan_time() -> None:
    leaves = _grouped().leaves()[:3]
    m = deeppart.Manifest.from_leaves(leaves, groups=[[0, 2], [1, 3]])
    with pytest.raises(deeppart.PlanError) as info:
        deeppart.plan(m, 3)
    assert "holder group 1 lists rank 3, but the world size is 3" in str(info.value)
    assert "leaf 1 (shard1)" in str(info.value)
    deeppart.plan(m, 4)


# ----------------------------------------------------------------------------
# from_leaves reads the usual description dicts directly (a union of a
# million shard leaves is described in them); anything else goes through
# the JSON form's parser. Both must give the same manifest, or the same error.

_SAME_AS_JSON: list[dict[str, Any]] = [
    {"path": ["w", 0, "<shard>", 3], "dtype": "float32", "shape": [4, 5]},
    {"path": ("t",), "dtype": "bfloat16", "shape": (2, 0, 7), "owner": 1},
    {"path": ["n"], "dtype": "int64", "shape": [], "nbytes": 8, "owner": None, "holders": None},
    {"path": ["g", -2], "dtype": "uint8", "shape": [9], "holders": 0},
    {"path": ["cfg"], "kind": "object", "nbytes": 17},
    {"path": ["pos"], "kind": "object", "nbytes": 3, "owner": 2},
    {"path": ["big"], "dtype": "float64", "shape": [1 << 20, 1 << 10]},
]


def test_from_leaves_equals_the_json_form() -> None:
    groups = [[0, 1]]
    direct = deeppart.Manifest.from_leaves(_SAME_AS_JSON, groups)
    text = json.dumps({"version": 2, "leaves": _SAME_AS_JSON, "groups": groups})
    assert direct == deeppart.Manifest.from_json(text)
    assert direct.fingerprint == deeppart.Manifest.from_json(text).fingerprint


@pytest.mark.parametrize(
    ("leaf", "message"),
    [
        (
            {"path": ["a", True], "dtype": "float32", "shape": [1]},
            "neither a string nor an integer",
        ),
        ({"path": ["a"], "dtype": "float32", "shape": [True]}, "shape dimension true"),
        ({"path": ["a"], "dtype": "float32", "shape": [-1]}, "shape dimension -1"),
        ({"path": ["a"], "dtype": "float32", "shape": [2], "nbytes": 7}, "nbytes 7 does not match"),
        ({"path": ["a"], "kind": "object", "nbytes": 3, "dtype": "float32"}, "takes nbytes"),
        ({"path": ["a"], "dtype": "float32", "shape": [1] * 65}, "more than 64"),
        ({"path": "a", "dtype": "float32", "shape": [1]}, "array of strings and integers"),
        ({"path": [], "dtype": "float32", "shape": [1]}, "path is empty"),
        ({"path": ["a"], "dtype": "float32", "shape": [1], "extra": 1}, 'unknown key "extra"'),
        ({"path": ["a"], "dtype": "float32", "shape": [1], "owner": -1}, "owner -1"),
        ({"path": ["a"], "dtype": "float32", "shape": [1], "owner": 1 << 40}, "out of range"),
        ({"path": ["a"], "kind": "thing", "nbytes": 3}, 'unknown kind "thing"'),
        ({"path": ["a"], "dtype": "float32", "shape": [1 << 62, 1 << 62]}, "a"),
    ],
)
def test_from_leaves_names_what_is_wrong_as_the_json_form_does(
    leaf: dict[str, Any], message: str
) -> None:
    with pytest.raises(deeppart.ManifestError) as direct:
        deeppart.Manifest.from_leaves([leaf])
    with pytest.raises(deeppart.ManifestError) as parsed:
        deeppart.Manifest.from_json(json.dumps({"version": 1, "leaves": [leaf]}))
    assert message in str(direct.value)
    assert str(direct.value) == str(parsed.value)
