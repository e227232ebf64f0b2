"""Export a checkpoint to the formats the ecosystem loads, and import them.

- :func:`export_safetensors`: the model's tensors as safetensors shards,
  with ``model.safetensors.index.json`` when there are several (the layout
  ``transformers``' ``save_pretrained`` writes and ``from_pretrained``
  reads). One shard is read (``load(keys=...)``: only its bytes) and
  written at a time, so at most one shard is in memory.
- :func:`export_torch`: the whole state as one ``torch.save`` file.
- :func:`import_checkpoint`: a ``.pt`` file (``torch.load(weights_only=True,
  mmap=True)``: nothing unpickled beyond tensors and plain values, tensors
  read from the file on demand) or a safetensors file or directory, saved
  as a DeepPart checkpoint (on every rank when run under mpiexec).

A checkpoint may be an ``s3://bucket/prefix`` URL (read, or written by
``import``, through :mod:`deeppart.storage`); the exported files are
local.

Command line: ``deeppart export CKPT --to safetensors OUT/``,
``deeppart export CKPT --to torch FILE.pt``, ``deeppart import SRC CKPT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from deeppart.checkpoint import load, save
from deeppart.checkpoint_source import committed_metadata
from deeppart.comm import SingleComm
from deeppart.errors import CheckpointError, DeepPartError, ExportError
from deeppart.format import decode_metadata
from deeppart.ownership import local_path
from deeppart.state import skeleton_paths
from deeppart.storage import S3URL, parse_location

#: Hugging Face's names of the files in a safetensors model directory.
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: Default largest shard (transformers' ``save_pretrained`` uses 5 GB too).
DEFAULT_SHARD_BYTES = 5 * 10**9

_ELEMENT_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip


def _tensor_leaves(
    directory: Path | S3URL, key: str | None
) -> tuple[list[tuple[Any, ...]], list[int], dict[int, list[tuple[Any, ...]]]]:
    """The tensor leaves under ``key`` (the whole state when None), from the
    metadata alone: their manifest paths, byte sizes, and every path that
    holds each (tied weights: more than one)."""
    meta = decode_metadata(committed_metadata(directory))
    leaves = list(meta.get("manifest", {}).get("leaves", []))
    versioned = [
        list(v["path"]) for v in meta.get("versions") or []
        if isinstance(v, dict) and isinstance(v.get("path"), list)
        and (key is None or v["path"][:1] == [key])
    ]  # fmt: skip
    if versioned:
        shown = ", ".join("/".join(map(str, p)) for p in versioned[:5])
        raise ExportError(
            f"{directory}: {len(versioned)} paths hold one version per group of saved ranks "
            f"(per-rank values, pipeline stages that reuse names: {shown}); safetensors names "
            "one tensor per path: export with --to torch (every version under "
            '{"ranks:0,1": ...}), or load(..., per_rank=<rank>) and save what you need'
        )
    # A sharded tensor (``dtensors`` record) is exported whole: the skeleton
    # names it by its first shard's leaf, which stands here for the record's
    # global tensor (``load`` assembles it from all its shards).
    for rec in meta.get("dtensors") or []:
        shards = rec.get("shards") or []
        first = shards[0].get("leaf") if shards and isinstance(shards[0], dict) else None
        if isinstance(first, int) and 0 <= first < len(leaves):
            whole = {k: rec.get(k) for k in ("path", "dtype", "shape")}
            leaves[first] = {"kind": "tensor", **whole}
    wanted: dict[int, list[tuple[Any, ...]]] = {}
    try:
        for path, index in skeleton_paths(meta.get("skeleton")):
            if key is None or (path and path[0] == key):
                wanted.setdefault(index, []).append(path)
    except ValueError as e:
        raise ExportError(f"{directory}: bad skeleton: {e}") from e
    paths: list[tuple[Any, ...]] = []
    sizes: list[int] = []
    for i, leaf in enumerate(leaves):
        if i not in wanted or leaf.get("kind", "tensor") != "tensor" or "dtype" not in leaf:
            continue
        numel = 1
        for n in leaf.get("shape", []):
            numel *= int(n)
        paths.append(tuple(leaf.get("path", [])))
        sizes.append(numel * _ELEMENT_SIZES.get(str(leaf["dtype"]), 8))
    by_path = {p: i for i, p in enumerate(paths)}
    aliases = {
        by_path[tuple(leaves[i]["path"])]: ps
        for i, ps in wanted.items()
        if tuple(leaves[i]["path"]) in by_path
    }
    return paths, sizes, aliases


def _model_key(directory: Path | S3URL, key: str | None) -> str | None:
    """``key`` if given; else ``"model"`` when the checkpoint has it, else
    None (the whole state is the model)."""
    if key is not None:
        return key
    meta = decode_metadata(committed_metadata(directory))
    tops = {lf.get("path", [None])[0] for lf in meta.get("manifest", {}).get("leaves", [])}
    return "model" if "model" in tops else None


def _get(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def export_safetensors(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    key: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> list[Path]:
    """Writes the tensors under ``key`` (default ``"model"`` if the
    checkpoint has it, else all) to ``out_dir`` as safetensors: one
    ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
    of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own)
    with ``model.safetensors.index.json``. Tensor names are the paths below
    ``key`` joined with ``"."`` (a state_dict's own keys). Tensors saved as
    one (tied weights) are written under every name. Files already in
    ``out_dir`` (a model's ``config.json`` beside the weights) are kept; an
    existing file of a name it writes is refused with :class:`ExportError`
    before anything is written, unless ``overwrite``. Returns the files."""
    from safetensors.torch import save_file

    src = parse_location(checkpoint)  # a directory or an s3:// URL
    out = local_path(out_dir)
    key = _model_key(src, key)
    paths, sizes, aliases = _tensor_leaves(src, key)
    if not paths:
        raise ExportError(f"{src}: no tensors under {key or 'the root'!r} to export")
    skip = 1 if key is not None else 0

    def name(path: tuple[Any, ...]) -> str:
        return ".".join(str(k) for k in path[skip:]) or str(path[-1])

    all_names = [name(p) for ps in aliases.values() for p in ps]
    if len(set(all_names)) != len(all_names):
        raise ExportError(f"{src}: two tensors have the same name once joined with '.'")
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    count = len(shards)
    names = [
        SAFETENSORS_SINGLE if count == 1 else f"model-{n:05d}-of-{count:05d}.safetensors"
        for n in range(1, count + 1)
    ] + ([SAFETENSORS_INDEX] if count > 1 else [])
    _refuse_existing([out / n for n in names], overwrite)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory: name a directory to export to")
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(names, shards, strict=False):
        part = load(str(src), keys=[paths[i] for i in shard], comm=SingleComm())
        tensors: dict[str, Any] = {}
        for i in shard:
            t = _get(part, paths[i]).contiguous()
            for k, path in enumerate(aliases[i]):
                # safetensors refuses two names over one storage: a tied
                # weight's other names get their own copy.
                tensors[name(path)] = t if k == 0 else t.clone()
                weight_map[name(path)] = fname
                total += t.numel() * t.element_size()
        tmp = _temporary(out / fname)
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / fname)
        files.append(out / fname)
        del part, tensors
    if count > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        tmp = _temporary(out / SAFETENSORS_INDEX)
        tmp.write_text(json.dumps(index, indent=2) + "\n")
        tmp.replace(out / SAFETENSORS_INDEX)
        files.append(out / SAFETENSORS_INDEX)
    return files


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    """Export replaces no file of the user's unless asked: raises
    :class:`ExportError` naming the ``paths`` that exist (unless
    ``overwrite``) or that are not regular files (links, directories)."""
    there = [p for p in paths if p.exists() or p.is_symlink()]
    odd = [p for p in there if p.is_symlink() or not p.is_file()]
    if odd:
        raise ExportError(
            f"{odd[0]}: exists and is not a regular file: remove it or export elsewhere"
        )
    if there and not overwrite:
        shown = ", ".join(str(p) for p in there[:5])
        raise ExportError(
            f"{shown}: already exist(s); pass overwrite=True (--overwrite) to replace, "
            "or export to another path"
        )


def _temporary(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place: a reader,
    or an export that crashed, never leaves a torn file under its name."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def export_torch(
    checkpoint: str | os.PathLike[str],
    out_file: str | os.PathLike[str],
    *,
    key: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes the whole state, or with ``key`` only what is under that
    top-level key (only its bytes are read), to one ``torch.save`` file
    (loadable with ``torch.load(..., weights_only=True)`` when the state
    holds tensors and plain Python values). The state is in memory once. A
    path with one version per group of saved ranks (each rank's own state)
    holds ``{"ranks:0,1": value, ...}``. An existing ``out_file`` is refused
    (:class:`ExportError`) unless ``overwrite``."""
    import torch

    parse_location(checkpoint)  # a directory or an s3:// URL; other URLs are refused
    out = local_path(out_file)
    _refuse_existing([out], overwrite)

    # Per-rank items come as {"ranks:0,1": value, ...} at their path.
    if key is None:
        state = load(checkpoint, comm=SingleComm(), per_rank="all")
    else:
        state = load(checkpoint, keys=[key], comm=SingleComm(), per_rank="all")[key]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary(out)
    torch.save(state, tmp)
    tmp.replace(out)
    return out


def _read_safetensors(src: Path) -> dict[str, Any]:
    from safetensors import safe_open

    if src.is_dir():
        index = src / SAFETENSORS_INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({str(v) for v in weight_map.values()})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ExportError(f"{index}: not a safetensors index: {e}") from e
            if any(Path(f).name != f for f in files):
                raise ExportError(f"{index}: shard names must be plain file names")
        elif (src / SAFETENSORS_SINGLE).exists():
            files = [SAFETENSORS_SINGLE]
        else:
            raise ExportError(f"{src}: no {SAFETENSORS_INDEX} or {SAFETENSORS_SINGLE}")
        paths = [src / f for f in files]
    else:
        paths = [src]
    tensors: dict[str, Any] = {}
    for p in paths:
        try:
            with safe_open(str(p), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    tensors[name] = f.get_tensor(name)
        except (OSError, Exception) as e:
            raise ExportError(f"{p}: cannot read safetensors: {e}") from e
    return tensors


def import_checkpoint(
    source: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    *,
    key: str = "model",
    comm: Any = None,
    overwrite: bool = False,
) -> Any:
    """Saves ``source`` as a DeepPart checkpoint at ``checkpoint`` (every
    rank of ``comm`` writes its part: run it under mpiexec on all ranks).
    A ``.pt``/``.pth``/``.bin`` file is read with ``torch.load(...,
    weights_only=True, mmap=True)`` and saved as it is; safetensors (a
    ``.safetensors`` file or a directory with ``model.safetensors`` or an
    index) are saved as ``{key: {name: tensor}}``, so that
    :func:`export_safetensors` gives the same files back. Returns the
    save's Stats."""
    import torch

    src = local_path(source)
    parse_location(checkpoint)  # a directory or an s3:// URL; other URLs are refused
    if src.is_dir() or src.suffix == ".safetensors":
        state: Any = {key: _read_safetensors(src)}
    else:
        try:
            state = torch.load(src, weights_only=True, mmap=True, map_location="cpu")
        except RuntimeError as e:
            # Files of the legacy (non-zip) format cannot be mapped.
            if "mmap" not in str(e):
                raise ExportError(f"{src}: cannot load with weights_only=True: {e}") from e
            state = torch.load(src, weights_only=True, map_location="cpu")
        except (OSError, Exception) as e:
            raise ExportError(f"{src}: cannot load with weights_only=True: {e}") from e
    return save(state, checkpoint, comm=comm, overwrite=overwrite)


# ----------------------------------------------------------------------------
# Command line.


def _cmd_export(args: argparse.Namespace) -> int:
    """Exports on one process. Under mpiexec rank 0 exports alone (every rank
    writing the same files would race) and every rank returns its result."""
    from deeppart.agreement import agree
    from deeppart.comm import launched_by_mpiexec, resolve

    comm = resolve(None) if launched_by_mpiexec() else SingleComm()
    files: list[Path] = []
    err: BaseException | None = None
    if comm.rank == 0:
        try:
            if args.to == "safetensors":
                files = export_safetensors(
                    args.checkpoint,
                    args.out,
                    key=args.key,
                    max_shard_bytes=args.max_shard_bytes,
                    overwrite=args.overwrite,
                )
            else:
                files = [
                    export_torch(args.checkpoint, args.out, key=args.key, overwrite=args.overwrite)
                ]
        except BaseException as e:  # agreed first, so that no rank is left waiting
            err = e
    try:
        agree(comm, err)
    except (DeepPartError, OSError) as e:
        if comm.rank == 0:
            print(f"deeppart export: error: {e}", file=sys.stderr)
        return 2
    for f in files:
        print(f)
    return 0


def _cmd_import(args: argparse.Namespace) -> int:
    try:
        stats = import_checkpoint(
            args.source, args.checkpoint, key=args.key, overwrite=args.overwrite
        )
    except (CheckpointError, OSError) as e:
        print(f"deeppart import: error: {e}", file=sys.stderr)
        return 2
    print(stats.summary())
    return 0


def add_parsers(sub: Any) -> None:
    """Adds ``export`` and ``import`` to the ``deeppart`` command line."""
    p = sub.add_parser("export", help="write a checkpoint as safetensors or one torch.save file")
    p.add_argument(
        "checkpoint", help="a committed DeepPart checkpoint: a directory or s3://bucket/prefix"
    )
    p.add_argument("--to", required=True, choices=["safetensors", "torch"])
    p.add_argument("out", help="the output directory (safetensors) or file (torch)")
    p.add_argument(
        "--key",
        default=None,
        help="the top-level key to export (safetensors: default 'model' if present, "
        "else all; torch: default the whole state)",
    )
    p.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_SHARD_BYTES,
        help="largest safetensors shard (default 5e9): a smaller model is one "
        "model.safetensors, a larger one shards with model.safetensors.index.json",
    )
    p.add_argument("--overwrite", action="store_true", help="replace files of the same names")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("import", help="save a .pt file or safetensors as a DeepPart checkpoint")
    p.add_argument("source", help="a torch.save file, a .safetensors file or a model directory")
    p.add_argument("checkpoint", help="the checkpoint to write: a directory or s3://bucket/prefix")
    p.add_argument("--key", default="model", help="the top-level key of imported safetensors")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_import)
