"""The typed plain values of a state tree beyond JSON's own: numpy arrays and
scalars, ``torch.dtype``, ``torch.Size``, ``torch.device``,
``collections.OrderedDict``, ``set`` and ``frozenset``.

Training frameworks put these in their checkpoints (``np.random.get_state()``
in Hugging Face ``Trainer``'s and Accelerate's random states, dtypes and
sizes in configs, ordered dicts everywhere). Each is stored as one tagged
JSON object ``{TAG: BODY}`` of :func:`deeppart.state.state.encode_plain` and
restored with its type; nothing is pickled, and decoding never imports or
calls anything named by the data.

A large numpy array (:data:`ARRAY_LEAF_BYTES` or more, of a dtype torch
shares memory with) is not inlined: it becomes a tensor leaf, written and
read like any tensor (split across ranks, no base64), and restored as a
numpy array (see :func:`is_array_leaf`).
"""

from __future__ import annotations

import base64
import math
import sys
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from deeppart.errors import ValueEncodeError

#: Tags of the typed values (single-key JSON objects).
NDARRAY, NUMPY_SCALAR, TORCH_DTYPE, TORCH_SIZE, TORCH_DEVICE = "np", "ng", "tdt", "tsz", "tdv"
ORDERED_DICT, SET, FROZENSET = "od", "set", "fset"
TAGS = (NDARRAY, NUMPY_SCALAR, TORCH_DTYPE, TORCH_SIZE, TORCH_DEVICE, ORDERED_DICT, SET, FROZENSET)

#: numpy dtype kinds that are stored: bool, integers, floats, complex,
#: fixed-width bytes and unicode strings, datetimes and timedeltas. Object
#: arrays (``O``) would need pickle, and structured/void ones (``V``) are
#: not supported: both are rejected with a StateError.
NUMPY_KINDS = "biufcSUmM"

#: Numpy arrays of at least this many bytes are tensor leaves (when torch is
#: loaded and shares memory with their dtype); smaller ones are inlined.
ARRAY_LEAF_BYTES = 64 << 10

#: Decoded arrays hold at most this many bytes (the object leaf limit).
_MAX_INLINE_BYTES = 1 << 30

_LEAF_DTYPES = frozenset(
    {
        *("bool", "uint8", "uint16", "uint32", "uint64"),
        *("int8", "int16", "int32", "int64"),
        *("float16", "float32", "float64", "complex64", "complex128"),
    }
)


def _torch() -> Any:
    return sys.modules.get("torch")


def _dtype_of(value: np.ndarray[Any, Any] | np.generic) -> str:
    dt = value.dtype
    if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ValueEncodeError(
            f"numpy dtype {dt} is not supported (object and structured dtypes are not: "
            "they cannot be stored without pickle); convert it to a numeric array"
        )
    return str(dt.str)


def _array_body(arr: np.ndarray[Any, Any]) -> list[Any]:
    dtype = _dtype_of(arr)
    data = np.ascontiguousarray(arr).tobytes()
    return [dtype, list(arr.shape), base64.b64encode(data).decode("ascii")]


def encode_typed(value: Any, encode: Callable[[Any, int], Any]) -> Any | None:
    """The tagged encoding of ``value`` if it is one of this module's types,
    else None. ``encode(item, index)`` encodes a contained value. Raises
    :class:`ValueEncodeError` for an unsupported numpy dtype."""
    if isinstance(value, np.ndarray):
        return {NDARRAY: _array_body(value)}
    if isinstance(value, np.generic):
        dtype = _dtype_of(value)
        raw = np.asarray(value).tobytes()
        return {NUMPY_SCALAR: [dtype, base64.b64encode(raw).decode("ascii")]}
    torch = _torch()
    if torch is not None:
        if isinstance(value, torch.dtype):
            return {TORCH_DTYPE: str(value).removeprefix("torch.")}
        if isinstance(value, torch.Size):
            return {TORCH_SIZE: [int(n) for n in value]}
        if isinstance(value, torch.device):
            return {TORCH_DEVICE: str(value)}
    if isinstance(value, OrderedDict):
        return {
            ORDERED_DICT: [[encode(k, i), encode(v, i)] for i, (k, v) in enumerate(value.items())]
        }
    if isinstance(value, set | frozenset):
        # Sorted by encoding: the same bytes on every rank whatever the
        # process's hash seed.
        items = sorted((encode(v, i) for i, v in enumerate(value)), key=_sort_key)
        return {SET if isinstance(value, set) else FROZENSET: items}
    return None


def _sort_key(encoded: Any) -> str:
    import json

    return json.dumps(encoded, separators=(",", ":"), sort_keys=True)


def _decode_array(body: Any) -> np.ndarray[Any, Any]:
    if not (isinstance(body, list) and len(body) == 3):
        raise ValueError("malformed numpy array")
    dtype_str, shape, data = body
    if not isinstance(dtype_str, str) or not isinstance(data, str) or not isinstance(shape, list):
        raise ValueError("malformed numpy array")
    dt = _checked_dtype(dtype_str)
    if len(shape) > 64 or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise ValueError(f"bad numpy array shape {str(shape)[:80]}")
    count = math.prod(shape)
    if count * dt.itemsize > _MAX_INLINE_BYTES:
        raise ValueError("numpy array too large")
    raw = base64.b64decode(data.encode("ascii"), validate=True)
    if len(raw) != count * dt.itemsize:
        raise ValueError(
            f"numpy array of {dt} {shape} needs {count * dt.itemsize} bytes, has {len(raw)}"
        )
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


def _checked_dtype(name: str) -> np.dtype[Any]:
    if len(name) > 32:
        raise ValueError("bad numpy dtype")
    try:
        dt = np.dtype(name)
    except TypeError as e:
        raise ValueError(f"bad numpy dtype {name!r}") from e
    if dt.kind not in NUMPY_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(f"numpy dtype {name!r} is not allowed")
    return dt


def decode_typed(tag: str, body: Any, decode: Callable[[Any], Any]) -> Any:
    """Inverse of :func:`encode_typed` for one tag. Raises ValueError on
    malformed input or an unknown tag."""
    if tag == NDARRAY:
        return _decode_array(body)
    if tag == NUMPY_SCALAR:
        if not (isinstance(body, list) and len(body) == 2):
            raise ValueError("malformed numpy scalar")
        return _decode_array([body[0], [], body[1]])[()]
    if tag in (TORCH_DTYPE, TORCH_SIZE, TORCH_DEVICE):
        return _decode_torch(tag, body)
    if tag == ORDERED_DICT and isinstance(body, list):
        out: OrderedDict[Any, Any] = OrderedDict()
        for pair in body:
            if not (isinstance(pair, list) and len(pair) == 2):
                raise ValueError("malformed ordered dict entry")
            try:
                out[decode(pair[0])] = decode(pair[1])
            except TypeError as e:
                raise ValueError(f"unhashable dict key in encoded value: {e}") from e
        return out
    if tag in (SET, FROZENSET) and isinstance(body, list):
        try:
            items = {decode(v) for v in body}
        except TypeError as e:
            raise ValueError(f"unhashable set element in encoded value: {e}") from e
        return items if tag == SET else frozenset(items)
    raise ValueError(f"malformed encoded value: unknown tag {tag[:20]!r}")


def _decode_torch(tag: str, body: Any) -> Any:
    try:
        import torch
    except ImportError as e:
        raise ValueError(f"restoring a torch value ({tag}) needs torch installed") from e
    if tag == TORCH_DTYPE:
        dtype = (
            getattr(torch, body, None) if isinstance(body, str) and body.isidentifier() else None
        )
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {str(body)[:40]!r}")
        return dtype
    if tag == TORCH_SIZE:
        if not (
            isinstance(body, list)
            and all(isinstance(n, int) and not isinstance(n, bool) for n in body)
        ):
            raise ValueError("malformed torch.Size")
        return torch.Size(body)
    if not isinstance(body, str) or len(body) > 64:
        raise ValueError("malformed torch.device")
    try:
        return torch.device(body)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"bad torch.device {body[:40]!r}") from e


# ----------------------------------------------------------------------------
# Large numpy arrays as tensor leaves.


def is_array_leaf(value: Any) -> bool:
    """Whether ``value`` is a numpy array stored as a tensor leaf: at least
    :data:`ARRAY_LEAF_BYTES`, native byte order, a dtype torch shares memory
    with, and torch loaded."""
    return (
        isinstance(value, np.ndarray)
        and value.nbytes >= ARRAY_LEAF_BYTES
        and value.dtype.name in _LEAF_DTYPES
        and value.dtype.isnative
        and _torch() is not None
    )


def array_as_tensor(value: np.ndarray[Any, Any]) -> Any:
    """A CPU tensor over ``value``'s memory (a C-contiguous copy if it is not
    contiguous), for writing it as a leaf, or filling it in place."""
    torch = _torch()
    arr = np.ascontiguousarray(value)
    with warnings.catch_warnings():
        # Read-only arrays: the tensor is only read from when saving.
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def tensor_as_array(tensor: Any) -> np.ndarray[Any, Any]:
    """The numpy array restored from a leaf's tensor (sharing its memory)."""
    arr: np.ndarray[Any, Any] = tensor.detach().cpu().numpy()
    return arr
