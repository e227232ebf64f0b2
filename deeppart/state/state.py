"""Walking a state tree: nested dicts, lists and tuples of tensors and plain values.

A state tree is split into *leaves*:

- every ``torch.Tensor`` is a tensor leaf, described by dtype and shape
  (its data is never copied here);
- every subtree that holds no tensor (a number, a string, an optimizer's
  ``param_groups`` list, ...) is one *object* leaf, stored in a safe encoding
  (tagged JSON, see :func:`encode_plain`), never with pickle.

The *skeleton* records the containers around the leaves, so that
:func:`unflatten` rebuilds the same tree, with dicts, lists and tuples and
their key types intact.
"""

from __future__ import annotations

import base64
import json
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from deeppart.errors import StateError, ValueEncodeError
from deeppart.state import values as _values

PathKey = str | int
Path = tuple[PathKey, ...]

# Tags of the plain encoding. A JSON object is only ever a tag, never a dict.
# Typed values (numpy, torch dtypes, ordered dicts, sets) have the tags of
# deeppart.state.values.
_DICT, _TUPLE, _BYTES, _FLOAT = "d", "t", "b", "f"
_MAX_DEPTH = 200
#: Types encoded here directly; any other type is first offered to
#: deeppart.state.values (numpy scalars subclass float, torch.Size tuple, ...).
_BUILTIN = frozenset({type(None), bool, int, float, str, bytes, bytearray, list, tuple, dict})


def _describe_path(path: Path) -> str:
    return "/".join(str(k) for k in path) if path else "<root>"


#: Marks a path key that stands for a dict key other than a string or an
#: integer (``!True``, ``!None``, ``!1.5``, ``!(1, 2)``); a string key that
#: starts with it is escaped by doubling it (``"!x"`` -> ``"!!x"``), so keys
#: ``True`` and ``"True"`` of one dict are different paths.
_TYPED_KEY = "!"
_I64 = 1 << 63


def _path_key(key: Any, path: Path) -> PathKey:
    if isinstance(key, str):
        return _TYPED_KEY + key if key.startswith(_TYPED_KEY) else key
    if isinstance(key, int) and not isinstance(key, bool) and -_I64 <= key < _I64:
        return int(key)
    if isinstance(key, bool | int | float | tuple) or key is None:
        try:
            return _TYPED_KEY + repr(key)
        except ValueError as e:  # an integer over sys.get_int_max_str_digits() digits
            raise StateError(f"{_describe_path(path)}: dict key: {e}") from e
    raise StateError(
        f"{_describe_path(path)}: dict key {key!r} of type {type(key).__name__} "
        "is not a plain value"
    )


def path_key(key: Any) -> PathKey:
    """How a dict key appears in a leaf's path (see :data:`_TYPED_KEY`)."""
    return _path_key(key, ())


def legacy_path(path: Any) -> list[Any]:
    """A path as checkpoints written before typed keys recorded it (a
    non-string key as its bare ``repr``, strings unescaped): what a leaf of
    such a checkpoint matches."""
    return [k[1:] if isinstance(k, str) and k.startswith(_TYPED_KEY) else k for k in path]


def _is_tensor(value: Any) -> bool:
    torch = _torch_if_loaded()
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_if_loaded() -> Any:
    return sys.modules.get("torch")


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if depth > _MAX_DEPTH:
        raise StateError("state tree is nested more than 200 levels deep")
    if _is_tensor(value) or _values.is_array_leaf(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensor(v, depth + 1) for v in value)
    return False


# ----------------------------------------------------------------------------
# Plain values: a safe, self-describing encoding (no pickle).


def _encode(value: Any, path: Path, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise StateError(f"{_describe_path(path)}: value is nested more than 200 levels deep")
    if type(value) not in _BUILTIN:
        try:
            typed = _values.encode_typed(value, lambda v, i: _encode(v, (*path, i), depth + 1))
        except ValueEncodeError as e:
            raise StateError(f"{_describe_path(path)}: {e}") from e
        if typed is not None:
            return typed
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        f = float(value)
        return f if math.isfinite(f) else {_FLOAT: repr(f)}
    if isinstance(value, bytes | bytearray):
        return {_BYTES: base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return [_encode(v, (*path, i), depth + 1) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, (*path, i), depth + 1) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        return {
            _DICT: [
                [_encode(k, path, depth + 1), _encode(v, (*path, _path_key(k, path)), depth + 1)]
                for k, v in value.items()
            ]
        }
    raise StateError(
        f"{_describe_path(path)}: cannot save a value of type {type(value).__module__}."
        f"{type(value).__qualname__}; only tensors and plain values (numbers, strings, bools, "
        "None, bytes, numpy arrays and scalars, torch dtypes, sizes and devices, and lists, "
        "tuples, dicts, ordered dicts and sets of those) are supported"
    )


def _decode(value: Any, depth: int = 0) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError("encoded value is nested more than 200 levels deep")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [_decode(v, depth + 1) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        ((tag, body),) = value.items()
        if tag == _TUPLE and isinstance(body, list):
            return tuple(_decode(v, depth + 1) for v in body)
        if tag == _DICT and isinstance(body, list):
            out: dict[Any, Any] = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError("malformed dict entry in encoded value")
                key = _decode(pair[0], depth + 1)
                try:
                    out[key] = _decode(pair[1], depth + 1)
                except TypeError as e:
                    raise ValueError(f"unhashable dict key in encoded value: {e}") from e
            return out
        if tag == _BYTES and isinstance(body, str):
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag == _FLOAT and body in ("nan", "inf", "-inf"):
            return float(body)
        if tag in _values.TAGS:
            return _values.decode_typed(tag, body, lambda v: _decode(v, depth + 1))
    raise ValueError(f"malformed encoded value: {str(value)[:80]}")


def encode_plain(value: Any, path: Path = ()) -> bytes:
    """Encodes a plain value as UTF-8 tagged JSON. Raises StateError, naming
    the path, for anything that is not plain."""
    try:
        text = json.dumps(_encode(value, path, 0), separators=(",", ":"), allow_nan=False)
    except ValueError as e:  # an integer over sys.get_int_max_str_digits() digits
        raise StateError(f"{_describe_path(path)}: cannot encode: {e}") from e
    return text.encode()


def decode_plain(data: bytes) -> Any:
    """Inverse of :func:`encode_plain`. Raises ValueError on malformed input."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # also over-long integers
        raise ValueError(f"malformed encoded value: {e}") from e
    return _decode(raw)


# ----------------------------------------------------------------------------
# Flattening a state tree.


@dataclass(frozen=True, slots=True)
class FlatLeaf:
    """One leaf of a state tree: a tensor, or an encoded plain value."""

    path: Path
    tensor: Any | None  # torch.Tensor when a tensor leaf
    encoded: bytes | None  # the plain encoding when an object leaf


def _check_tensor(t: Any, path: Path) -> None:
    if t.layout is not _torch_if_loaded().strided:
        raise StateError(
            f"{_describe_path(path)}: only dense (strided) tensors are supported, got {t.layout}"
        )
    if t.is_quantized:
        raise StateError(f"{_describe_path(path)}: quantized tensors are not supported")
    if t.is_nested:
        raise StateError(f"{_describe_path(path)}: nested tensors are not supported")


def check_has_data(leaves: list[FlatLeaf]) -> None:
    """Raises StateError for a meta tensor among ``leaves``: it describes a
    shape (a manifest may be built from it) but holds no data to save."""
    for leaf in leaves:
        if leaf.tensor is not None and leaf.tensor.device.type == "meta":
            raise StateError(f"{_describe_path(leaf.path)}: a meta tensor holds no data to save")


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a torch ``DTensor`` (False while torch's DTensor
    module is not loaded)."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(value, cls)


def _alias_key(t: Any) -> tuple[Any, ...] | None:
    """What makes two tensors the same data: the same memory, viewed the same
    way (tied weights: ``state_dict()`` returns two tensor objects over one
    storage). None for empty tensors, which share no data. A DTensor is
    its local shard's memory with its global shape and placements."""
    if is_dtensor(t):
        local = _alias_key(t._local_tensor)
        return None if local is None else ("dtensor", tuple(t.shape), str(t.placements), local)
    if t.numel() == 0:
        return None
    storage = t.untyped_storage()
    return (
        t.device.type,
        t.device.index,
        # Meta tensors have no memory (every data pointer is 0): their
        # storage object tells the tied ones apart from the others.
        storage._cdata if t.device.type == "meta" else storage.data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        tuple(t.stride()),
        t.dtype,
        # Lazy conjugation and negation change the values a view shows.
        t.is_conj(),
        t.is_neg(),
    )


def _walk(value: Any, path: Path, depth: int, leaves: list[FlatLeaf], seen: dict[Any, int]) -> Any:
    """Appends the leaves under ``value`` and returns its skeleton. A tensor
    that aliases an earlier one (tied weights) becomes a second reference to
    that leaf, so it is stored once and restored as one shared tensor."""
    if depth > _MAX_DEPTH:
        raise StateError(f"{_describe_path(path)}: state tree is nested more than 200 levels deep")
    if _is_tensor(value):
        _check_tensor(value, path)
        alias = _alias_key(value)
        if alias is not None and alias in seen:
            return {"leaf": seen[alias]}
        leaves.append(FlatLeaf(path, value, None))
        if alias is not None:
            seen[alias] = len(leaves) - 1
        return {"leaf": len(leaves) - 1}
    if _values.is_array_leaf(value):
        node = _walk(_values.array_as_tensor(value), path, depth, leaves, seen)
        return {"ndarray": node["leaf"]}
    if not _holds_tensor(value):
        leaves.append(FlatLeaf(path, None, encode_plain(value, path)))
        return {"leaf": len(leaves) - 1}
    if isinstance(value, Mapping):
        entries = []
        for k, v in value.items():
            key = _path_key(k, path)
            entries.append([_encode(k, path, 0), _walk(v, (*path, key), depth + 1, leaves, seen)])
        return {"odict" if isinstance(value, OrderedDict) else "dict": entries}
    kind = "list" if isinstance(value, list) else "tuple"
    return {kind: [_walk(v, (*path, i), depth + 1, leaves, seen) for i, v in enumerate(value)]}


#: A state tree's :func:`flatten`: its leaves and its skeleton.
Flat = tuple[list[FlatLeaf], Any]


def flatten(state: Any) -> Flat:
    """Splits a state tree into its leaves, in a deterministic order, and a
    JSON-able skeleton for :func:`unflatten`. Tensors that alias one
    another (the same memory viewed the same way, e.g. tied weights) are one
    leaf, referenced from every path that holds them."""
    leaves: list[FlatLeaf] = []
    skeleton = _walk(state, (), 0, leaves, {})
    if leaves and leaves[0].path == ():
        # A bare tensor or value at the root: give it a non-empty path.
        leaves[0] = FlatLeaf(("<root>",), leaves[0].tensor, leaves[0].encoded)
    return leaves, skeleton


def unflatten(skeleton: Any, values: list[Any], absent: Any = None) -> Any:
    """Rebuilds a state tree from a skeleton and its leaf values (tensors, or
    decoded plain values). ``absent`` (when not None) marks a leaf that was
    not read: it is placed as it is, whatever the leaf's kind."""

    def build(node: Any, depth: int) -> Any:
        if depth > _MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise ValueError("malformed state skeleton")
        ((kind, body),) = node.items()
        if kind in ("leaf", "ndarray"):
            if not isinstance(body, int) or not 0 <= body < len(values):
                raise ValueError(f"state skeleton names leaf {body!r} of {len(values)}")
            if kind == "ndarray" and values[body] is not absent:
                if not _is_tensor(values[body]):
                    raise ValueError(f"state skeleton: leaf {body} is not an array")
                return _values.tensor_as_array(values[body])
            return values[body]
        if kind in ("dict", "odict") and isinstance(body, list):
            out: dict[Any, Any] = {} if kind == "dict" else OrderedDict()
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError("malformed dict entry in state skeleton")
                try:
                    out[_decode(pair[0])] = build(pair[1], depth + 1)
                except TypeError as e:  # an unhashable key, e.g. a list
                    raise ValueError(f"unhashable dict key in state skeleton: {e}") from e
            return out
        if kind in ("list", "tuple") and isinstance(body, list):
            items = [build(v, depth + 1) for v in body]
            return items if kind == "list" else tuple(items)
        raise ValueError(f"malformed state skeleton node {kind!r}")

    return build(skeleton, 0)


def describe_leaf(leaf: FlatLeaf, owner: int | None = None) -> dict[str, Any]:
    """The manifest description of a leaf (the keys of the JSON form)."""
    desc: dict[str, Any] = {"path": list(leaf.path)}
    if leaf.tensor is not None:
        desc["dtype"] = str(leaf.tensor.dtype).removeprefix("torch.")
        desc["shape"] = list(leaf.tensor.shape)
    else:
        assert leaf.encoded is not None
        desc["kind"] = "object"
        desc["nbytes"] = len(leaf.encoded)
    if owner is not None:
        desc["owner"] = owner
    return desc


def describe_leaves(state: Any) -> list[dict[str, Any]]:
    """Manifest descriptions of every leaf of a state tree."""
    leaves, _ = flatten(state)
    return [describe_leaf(leaf) for leaf in leaves]


def iter_paths(state: Any) -> Iterator[Path]:
    """The leaf paths of a state tree, in order."""
    leaves, _ = flatten(state)
    return (leaf.path for leaf in leaves)


def map_skeleton(skeleton: Any, leaf: Callable[[Path, Any], Any]) -> Any:
    """A copy of ``skeleton`` whose leaf nodes are ``leaf(path, node)``
    (``path``: the leaf path the node stands at; a root leaf's is
    ``("<root>",)``). Raises ValueError on a malformed skeleton."""

    def walk(node: Any, path: Path, depth: int) -> Any:
        if depth > _MAX_DEPTH or not isinstance(node, dict) or len(node) != 1:
            raise ValueError("malformed state skeleton")
        ((kind, body),) = node.items()
        if kind in ("leaf", "ndarray") and isinstance(body, int):
            return leaf(path or ("<root>",), node)
        if kind in ("dict", "odict") and isinstance(body, list):
            entries = []
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError("malformed dict entry in state skeleton")
                try:
                    key = _path_key(_decode(pair[0]), path)
                except StateError as e:  # a key that is no plain value, e.g. a list
                    raise ValueError(f"state skeleton: {e}") from e
                entries.append([pair[0], walk(pair[1], (*path, key), depth + 1)])
            return {kind: entries}
        if kind in ("list", "tuple") and isinstance(body, list):
            return {kind: [walk(v, (*path, i), depth + 1) for i, v in enumerate(body)]}
        raise ValueError(f"malformed state skeleton node {kind!r}")

    return walk(skeleton, (), 0)


def held_twice(skeleton: Any) -> bool:
    """Whether some leaf of ``skeleton`` is held at two paths (tied
    weights); cheaper than :func:`skeleton_paths` (no key is decoded).
    A malformed node is passed over: the skeleton's readers refuse it."""
    seen: set[int] = set()
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if not (isinstance(node, dict) and len(node) == 1):
            continue
        ((kind, body),) = node.items()
        if kind in ("leaf", "ndarray") and isinstance(body, int):
            if body in seen:
                return True
            seen.add(body)
        elif kind in ("dict", "odict") and isinstance(body, list):
            stack.extend(pair[1] for pair in body if isinstance(pair, list) and len(pair) == 2)
        elif kind in ("list", "tuple") and isinstance(body, list):
            stack.extend(body)
    return False


def skeleton_paths(skeleton: Any) -> list[tuple[Path, int]]:
    """Every path of a skeleton that holds a leaf, with the leaf's index, in
    order; a leaf held at several paths (tied weights) appears at each.
    Raises ValueError on a malformed skeleton."""
    out: list[tuple[Path, int]] = []

    def visit(path: Path, node: Any) -> Any:
        ((_, index),) = node.items()
        out.append((path, index))
        return node

    map_skeleton(skeleton, visit)
    return out


def skeleton_without(skeleton: Any, paths: Collection[Path], index: int) -> Any:
    """``skeleton`` with the leaf nodes at ``paths`` pointing to leaf
    ``index`` instead (a slot the caller fills with an absent marker: a
    tied leaf read for one of its paths only, ``load(keys=...)``)."""
    return map_skeleton(skeleton, lambda p, node: {"leaf": index} if p in paths else node)
