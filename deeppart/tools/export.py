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
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deeppart.comm import SingleComm
from deeppart.errors import CheckpointError, DeepPartError, ExportError
from deeppart.format import decode_metadata
from deeppart.loading.load import load
from deeppart.saving.save import save
from deeppart.state.state import skeleton_paths
from deeppart.storage import S3URL, parse_location
from deeppart.storage.ownership import local_path
from deeppart.tools.checkpoint_source import committed_metadata

#: Hugging Face's names of the files in a safetensors model directory.
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: The safetensors metadata transformers writes (and its loader checks).
PT = {"format": "pt"}
#: Default largest shard (transformers' ``save_pretrained`` uses 5 GB too).
DEFAULT_SHARD_BYTES = 5 * 10**9

_ELEMENT_SIZES = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2,
    "int32": 4, "uint32": 4, "float32": 4, "complex32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "complex64": 8, "complex128": 16,
}  # fmt: skip


def _tensor_leaves(
    directory: Path | S3URL, key: str | None, per_rank: Any = None
) -> tuple[list[tuple[Any, ...]], list[int], dict[int, list[tuple[Any, ...]]]]:
    """The tensor leaves under ``key`` (the whole state when None), from the
    metadata alone: their manifest paths, byte sizes, and every path that
    holds each (tied weights: more than one). A path with one version per
    group of saved ranks under ``key`` is refused unless ``per_rank`` is a
    saved rank (its version is exported) or ``"drop"`` (left out)."""
    meta = decode_metadata(committed_metadata(directory))
    leaves = list(meta.get("manifest", {}).get("leaves", []))
    versioned = [
        v for v in meta.get("versions") or []
        if isinstance(v, dict) and isinstance(v.get("path"), list)
        and (key is None or v["path"][:1] == [key])
    ]  # fmt: skip
    # Per versioned path: the leaf exported there (None: left out).
    chosen: dict[tuple[Any, ...], int | None] = {}
    for v in versioned:
        chosen[tuple(v["path"])] = _version_leaf(directory, v, per_rank, versioned)
    # A sharded tensor (``dtensors`` record) is exported whole: the skeleton
    # names it by its first shard's leaf, which stands here for the record's
    # global tensor (``load`` assembles it from all its shards).
    for rec in meta.get("dtensors") or []:
        shards = rec.get("shards") or []
        first = shards[0].get("leaf") if shards and isinstance(shards[0], dict) else None
        if isinstance(first, int) and 0 <= first < len(leaves):
            whole = {k: rec.get(k) for k in ("path", "dtype", "shape")}
            leaves[first] = {"kind": "tensor", **whole}
    # A version is loaded at its path (load(per_rank=...)).
    for path, i in chosen.items():
        if i is not None and 0 <= i < len(leaves) and isinstance(leaves[i], dict):
            leaves[i] = {**leaves[i], "path": list(path)}
    wanted: dict[int, list[tuple[Any, ...]]] = {}
    try:
        for path, index in skeleton_paths(meta.get("skeleton")):
            i = chosen.get(path, index)
            if i is not None and (key is None or (path and path[0] == key)):
                wanted.setdefault(i, []).append(path)
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


def _version_leaf(
    directory: Path | S3URL, v: dict[str, Any], per_rank: Any, versioned: list[Any]
) -> int | None:
    """The leaf of versioned path ``v`` that ``per_rank`` exports (a saved
    rank: its version; ``"drop"``: None); ExportError otherwise, naming the
    versioned paths (``versioned``) and what to pass."""
    if per_rank is None or per_rank == "all":
        shown = ", ".join("/".join(map(str, u["path"])) for u in versioned[:5])
        why = (
            "--per-rank all is for --to torch"
            if per_rank == "all"
            else "pass --per-rank RANK (Python: per_rank=RANK) to export the version that saved "
            "rank wrote, or --per-rank drop to leave them out"
        )
        raise ExportError(
            f"{directory}: {len(versioned)} paths hold one version per group of saved ranks "
            f"(per-rank values, pipeline stages that reuse names: {shown}); safetensors names "
            f"one tensor per path: {why}; or export with --to torch (every version under "
            '{"ranks:0,1": ...})'
        )
    if per_rank == "drop":
        return None
    where = "/".join(map(str, v["path"]))
    ranks, firsts = v.get("ranks") or [], v.get("leaves") or []
    for k, group in enumerate(ranks):
        if isinstance(group, list) and per_rank in group and k < len(firsts):
            return int(firsts[k])
    raise ExportError(
        f"{directory}: --per-rank {per_rank}: saved rank {per_rank} holds no version of "
        f"{where} (its versions were saved by ranks {', '.join(map(str, ranks))})"
    )


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
    per_rank: Any = None,
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
    before anything is written, unless ``overwrite``. A failed export
    removes what it wrote (the files it created, and ``out_dir`` and its
    parents if it made them), nothing else. ``per_rank``: for paths under
    ``key`` with one version per group of saved ranks (each rank's own
    state), a saved rank (export its version) or ``"drop"`` (leave them
    out); by default they are refused. Paths outside ``key`` never matter.
    Returns the files."""
    src = parse_location(checkpoint)  # a directory or an s3:// URL
    out = local_path(out_dir)
    _check_per_rank(per_rank)
    key = _model_key(src, key)
    paths, sizes, aliases = _tensor_leaves(src, key, per_rank)
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
    existed = {n for n in names if (out / n).exists()}
    made = _missing_dirs(out)
    out.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    try:
        _write_shards(src, out, names, shards, paths, aliases, name, per_rank, files)
    except BaseException:
        # Only what this export made: its files (a file it replaced with
        # overwrite=True is gone either way), then its directories if empty.
        for f in files:
            if f.name not in existed:
                f.unlink(missing_ok=True)
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    return files


def _write_shards(
    src: Path | S3URL,
    out: Path,
    names: list[str],
    shards: list[list[int]],
    paths: list[tuple[Any, ...]],
    aliases: dict[int, list[tuple[Any, ...]]],
    name: Callable[[tuple[Any, ...]], str],
    per_rank: Any,
    files: list[Path],
) -> None:
    """The safetensors shards ``names`` (and the index when there are
    several) in ``out``, each read by one load and renamed into place;
    ``files`` gets each file once it is there."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total = 0
    for fname, shard in zip(names, shards, strict=False):
        keys = [paths[i] for i in shard]
        part = load(str(src), keys=keys, comm=SingleComm(), per_rank=per_rank)
        tensors: dict[str, Any] = {}
        for i in shard:
            t = _get(part, paths[i]).contiguous()
            for k, path in enumerate(aliases[i]):
                # safetensors refuses two names over one storage: a tied
                # weight's other names get their own copy.
                tensors[name(path)] = t if k == 0 else t.clone()
                weight_map[name(path)] = fname
                total += t.numel() * t.element_size()
        _write_file(out / fname, files, functools.partial(save_file, tensors, metadata=PT))
        del part, tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2) + "\n"
        _write_file(out / SAFETENSORS_INDEX, files, lambda tmp: tmp.write_text(text))


def _write_file(path: Path, files: list[Path], write: Callable[[Path], Any]) -> None:
    """``write`` to a temporary name, renamed to ``path`` (removed if the
    write fails); ``path`` appended to ``files``."""
    tmp = _temporary(path)
    try:
        write(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.replace(path)
    files.append(path)


def _missing_dirs(out: Path) -> list[Path]:
    """The directories ``out.mkdir(parents=True)`` would make, deepest first."""
    made: list[Path] = []
    d = out
    while not d.exists() and not d.is_symlink() and d != d.parent:
        made.append(d)
        d = d.parent
    return made


def _check_per_rank(per_rank: Any) -> None:
    """ExportError unless ``per_rank`` is None, a saved rank, ``"drop"`` or
    ``"all"``."""
    rank = isinstance(per_rank, int) and not isinstance(per_rank, bool) and per_rank >= 0
    if not (per_rank is None or rank or per_rank in ("drop", "all")):
        raise ExportError(f'per_rank must be a saved rank, "drop" or "all", not {per_rank!r}')


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
    per_rank: Any = "all",
) -> Path:
    """Writes the whole state, or with ``key`` only what is under that
    top-level key (only its bytes are read), to one ``torch.save`` file
    (loadable with ``torch.load(..., weights_only=True)`` when the state
    holds tensors and plain Python values). The state is in memory once. A
    path with one version per group of saved ranks (each rank's own state)
    holds ``{"ranks:0,1": value, ...}`` (``per_rank="all"``, the default;
    or as :func:`deeppart.load` takes it: a saved rank's version, or
    ``"drop"``). An existing ``out_file`` is refused (:class:`ExportError`)
    unless ``overwrite``."""
    import torch

    parse_location(checkpoint)  # a directory or an s3:// URL; other URLs are refused
    out = local_path(out_file)
    _check_per_rank(per_rank)
    _refuse_existing([out], overwrite)

    if key is None:
        state = load(checkpoint, comm=SingleComm(), per_rank=per_rank)
    else:
        state = load(checkpoint, keys=[key], comm=SingleComm(), per_rank=per_rank)[key]
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
                    per_rank=args.per_rank,
                )
            else:
                per_rank = "all" if args.per_rank is None else args.per_rank
                files = [
                    export_torch(
                        args.checkpoint,
                        args.out,
                        key=args.key,
                        overwrite=args.overwrite,
                        per_rank=per_rank,
                    )
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


def per_rank_arg(text: str) -> int | str:
    """An argparse type: ``--per-rank`` as ``load(per_rank=)`` takes it from
    a command line: a saved rank (an integer from 0), ``drop`` or ``all``."""
    if text in ("drop", "all"):
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a saved rank (0, 1, ...), drop or all")


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
    p.add_argument(
        "--per-rank",
        type=per_rank_arg,
        default=None,
        metavar="RANK|drop|all",
        help="paths with one version per group of saved ranks (each rank's own state: per-rank "
        "values, pipeline stages that reuse names), as load(per_rank=): RANK exports the version "
        "that saved rank wrote, drop leaves them out, all gives {'ranks:0,1': ...} at the path "
        "(torch only, its default); safetensors refuses them without it. Paths outside --key "
        "never matter",
    )
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("import", help="save a .pt file or safetensors as a DeepPart checkpoint")
    p.add_argument("source", help="a torch.save file, a .safetensors file or a model directory")
    p.add_argument("checkpoint", help="the checkpoint to write: a directory or s3://bucket/prefix")
    p.add_argument("--key", default="model", help="the top-level key of imported safetensors")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_import)
