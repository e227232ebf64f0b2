"""Manifests from what a user has at hand, for ``deeppart plan``,
``deeppart simulate`` and ``deeppart manifest``:

- a manifest JSON file (``Manifest.to_json``'s form, docs/PLANNER.md);
- a DeepPart checkpoint: its directory or its ``metadata.json`` (a
  multi-level one's ``meta_dir/<exec_id>/step-N`` too), whose manifest is
  recorded there;
- a ``.safetensors`` file: only its JSON header is read (names, dtypes,
  shapes; no tensor data), optionally with the AdamW state a training
  checkpoint of that model holds;
- a built-in model name (``deeppart.tools.models.MODELS``).

From Python: ``Manifest.from_state_dict(state).to_json()``.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from pathlib import Path
from typing import Any

from deeppart._planner import DeepPartError, Manifest, ManifestError
from deeppart.errors import CheckpointError
from deeppart.format import (
    MAX_METADATA_BYTES,
    METADATA,
    decode_metadata,
    open_regular,
    read_regular,
)

#: safetensors' dtype names -> DeepPart's (torch's) names.
_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip

#: Largest manifest JSON file read.
MAX_MANIFEST_FILE_BYTES = 1 << 30

#: A safetensors header larger than this is refused (the format's own limit).
MAX_SAFETENSORS_HEADER = 100_000_000


def from_checkpoint(path: Path) -> Manifest:
    """The manifest recorded in a checkpoint's metadata.json (``path``: the
    checkpoint directory or that file)."""
    meta = path / METADATA if path.is_dir() else path
    try:
        text = read_regular(meta, MAX_METADATA_BYTES)  # no FIFOs, devices or huge files
    except OSError as e:
        raise CheckpointError(f"{meta}: cannot read ({e.strerror})") from e
    return _recorded_manifest(text, str(meta))


def _recorded_manifest(text: bytes, shown: str) -> Manifest:
    """The manifest in metadata ``text`` (``shown``: where it was read)."""
    raw = decode_metadata(text)
    try:
        return Manifest.from_json(json.dumps(raw.get("manifest")))
    except ManifestError as e:
        raise ManifestError(f"{shown}: the recorded manifest is invalid: {e}") from e


def safetensors_leaves(path: Path) -> list[tuple[str, str, list[int]]]:
    """(name, dtype, shape) of every tensor in a .safetensors file, from its
    header only, in the file's order (a state_dict's own order is not
    recorded there, so a manifest from it may order leaves differently)."""
    try:
        with open_regular(path) as f:  # no FIFOs or devices
            head = f.read(8)
            if len(head) != 8:
                raise ManifestError(f"{path}: not a safetensors file (shorter than 8 bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER:
                raise ManifestError(f"{path}: safetensors header of {n} bytes is too large")
            header = f.read(n)
    except OSError as e:
        raise ManifestError(f"{path}: cannot read ({e.strerror})") from e
    if len(header) != n:
        raise ManifestError(f"{path}: bad safetensors header: {len(header)} of {n} bytes")
    try:
        table = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ManifestError(f"{path}: bad safetensors header: {e}") from e
    if not isinstance(table, dict):
        raise ManifestError(f"{path}: bad safetensors header (not an object)")
    out: list[tuple[Any, str, str, list[int]]] = []
    for name, info in table.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in _SAFETENSORS_DTYPES:
            raise ManifestError(f"{path}: tensor {name!r}: unsupported entry {info!r:.80}")
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ManifestError(f"{path}: tensor {name!r}: bad shape {shape!r:.80}")
        offsets = info.get("data_offsets")
        start = offsets[0] if isinstance(offsets, list) and offsets else 0
        out.append((start, name, _SAFETENSORS_DTYPES[info["dtype"]], shape))
    # In file order (the order the writer stored them), not the header's.
    out.sort(key=lambda t: (t[0] if isinstance(t[0], int) else 0, t[1]))
    return [(name, dt, shape) for _, name, dt, shape in out]


def from_safetensors(path: Path, *, adamw: bool = False) -> Manifest:
    """A model's manifest from a .safetensors file's header; with ``adamw``,
    laid out as ``{"model": ..., "optim": AdamW state after one step}`` for
    the floating-point tensors (what a training checkpoint holds)."""
    leaves = safetensors_leaves(path)
    if not adamw:
        return Manifest.from_leaves(
            [{"path": ["model", name], "dtype": dt, "shape": shape} for name, dt, shape in leaves]
        )
    from deeppart.tools.models import adamw_leaves

    def floating(dtype: str) -> bool:
        return dtype.startswith(("float", "bfloat"))

    others = [
        {"path": ["model", name], "dtype": dt, "shape": shape}
        for name, dt, shape in leaves
        if not floating(dt)
    ]
    floats = [(name, tuple(shape)) for name, dt, shape in leaves if floating(dt)]
    dtypes = sorted({dt for _, dt, _ in leaves if floating(dt)})
    if len(dtypes) > 1:
        raise ManifestError(f"{path}: --adamw needs one floating-point dtype, found {dtypes}")
    return Manifest.from_leaves(others + adamw_leaves(floats, dtypes[0] if dtypes else "float32"))


def read_manifest(source: str, *, adamw: bool = False) -> Manifest:
    """The manifest ``source`` names: a built-in model, a checkpoint (directory
    or metadata.json, or a committed one at an ``s3://`` URL), a .safetensors
    file or a manifest JSON file."""
    from deeppart.storage.source import checkpoint_source
    from deeppart.storage.url import is_url
    from deeppart.tools.models import MODELS

    if is_url(source):
        # A committed checkpoint in an object store (other URLs:
        # UnsupportedURLError).
        at = checkpoint_source(source)
        return _recorded_manifest(at.committed_metadata(), str(at))

    key = source.removesuffix("+adamw")
    path = Path(source)
    if key in MODELS and not path.exists():
        return MODELS[key]()
    looks_like_a_name = os.sep not in source and "." not in source
    if looks_like_a_name and not path.exists() and not path.is_symlink():
        names = ", ".join(sorted(MODELS))
        raise ManifestError(
            f"{source}: no such file or directory, and not a built-in model name "
            f"(those are: {names}; add +adamw for the optimizer state); give a checkpoint "
            "directory, its metadata.json, a .safetensors file, a manifest JSON file or "
            "one of those names"
        )
    if path.is_dir():
        return from_checkpoint(path)
    if path.suffix == ".safetensors":
        return from_safetensors(path, adamw=adamw)
    try:
        # OSError and CheckpointError (not a regular file, too large)
        # propagate: the caller names the file.
        text = read_regular(path, MAX_MANIFEST_FILE_BYTES).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{source}: not a JSON file ({e.reason})") from e
    try:
        head = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        head = None  # the planner's parser names what is wrong
    if isinstance(head, dict) and "format" in head and "manifest" in head:
        return from_checkpoint(path)
    return Manifest.from_json(text)


def run(args: argparse.Namespace) -> int:
    try:
        manifest = read_manifest(args.source, adamw=args.adamw)
    except OSError as e:
        print(f"deeppart: error: cannot read {args.source}: {e.strerror}", file=sys.stderr)
        return 2
    except (DeepPartError, ValueError) as e:
        print(f"deeppart: error: {e}", file=sys.stderr)
        return 2
    text = manifest.to_json()
    if args.output:
        Path(args.output).write_text(text)
        print(
            f"{len(manifest)} leaves, {manifest.total_bytes} bytes -> {args.output}",
            file=sys.stderr,
        )
    else:
        print(text)
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "manifest",
        help="write the manifest (the state's structure) that plan and simulate read",
        description="Writes a manifest JSON from a checkpoint (its directory or metadata.json), "
        "a .safetensors file (header only) or a built-in model name. From Python: "
        "deeppart.Manifest.from_state_dict(state).to_json().",
    )
    p.add_argument(
        "source", help="checkpoint directory or metadata.json, FILE.safetensors, or a model name"
    )
    p.add_argument("--output", "-o", help="write the JSON here (default: stdout)")
    p.add_argument(
        "--adamw", action="store_true",
        help=".safetensors: add the AdamW state of a training checkpoint (model + 2 moments)",
    )  # fmt: skip
    p.set_defaults(func=run)
