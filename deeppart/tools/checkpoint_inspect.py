"""``deeppart inspect CHECKPOINT [--verify] [--json]``: what a checkpoint
holds, who wrote what, and (with ``--verify``) whether every piece is intact.

Named ``checkpoint_inspect`` so as not to shadow the standard ``inspect``.
Reads the format of docs/FORMAT.md through :mod:`deeppart.format`'s parser;
needs neither torch nor MPI.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deeppart import _planner
from deeppart.errors import CheckpointError, CorruptCheckpointError
from deeppart.format import (
    HEADER_SIZE,
    Metadata,
    Piece,
    check_header,
    checksum,
    data_file_name,
    decode_metadata,
    parse_metadata,
    step_dir_name,
)
from deeppart.levels.fti import INDEX_PREFIX
from deeppart.progress import Progress, human_bytes
from deeppart.regions import Region
from deeppart.storage.files import CheckpointDir, LocalFile, StoredFile, data_file, local_dir
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import S3URL, parse_location
from deeppart.tools.checkpoint_source import source_location


def _parse_metadata(text: bytes) -> Metadata:
    """Metadata text parsed (with the element sizes from its manifest)."""
    raw = decode_metadata(text)
    try:
        manifest = _planner.Manifest.from_json(json.dumps(raw.get("manifest")))
    except (_planner.ManifestError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"metadata: bad manifest: {e}") from e
    leaves = manifest.leaves()
    # Element sizes from the manifest itself (nbytes / numel), so that no
    # torch import is needed; a zero-element tensor falls back to a table.
    sizes: dict[str, int] = dict(_FALLBACK_SIZES)
    for lf in leaves:
        if lf["kind"] == "tensor":
            numel = 1
            for d in lf["shape"]:
                numel *= int(d)
            if numel:
                sizes[str(lf["dtype"])] = int(lf["nbytes"]) // numel
    raw["leaves"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in lf.items() if v is not None}
        for lf in leaves
    ]
    return parse_metadata(raw, sizes)


_FALLBACK_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
    "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


@dataclass
class VerifyReport:
    pieces_checked: int = 0
    bytes_read: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: Multi-level checkpoints on real nodes: the nodes whose files were
    #: checked, those that were not (not visible from here), and the ranks
    #: of a collective verify (0: not collective).
    nodes_checked: list[int] | None = None
    nodes_unseen: list[int] = field(default_factory=list)
    collective: int = 0

    @property
    def ok(self) -> bool:
        return not self.failures


def _path_str(path: list[Any]) -> str:
    return ".".join(str(k) for k in path)


_LEVEL_NAMES = {
    1: "node-local files",
    2: "node-local files + a copy on the partner node",
    3: "node-local files + Reed-Solomon parity over each group",
    4: "node-local files + a global copy",
}


@dataclass
class LevelFiles:
    """Where a multi-level checkpoint's files are (docs/LEVELS.md): every
    rank's data file under ``ckpt_dir/<node>/<exec_id>/step-N/`` (``<node>``:
    the node's host name, or ``node<k>`` with fake nodes), its L2 partner
    copy, its L3 parity shard. Built from the metadata's ``levels`` section
    (and ``ckpt_dir``, recorded there, or given)."""

    level: int
    root: Path  # ckpt_dir
    node_dirs: list[str]  # per node: its directory under root
    step_dir: list[Path]  # per node
    nodes: list[int]  # per rank
    group_size: int
    parity_sizes: list[int]
    parity_xxh3: list[int]
    glbl_step: Path | S3URL | None  # the L4 copy: a directory or an s3:// URL
    #: Fake nodes (local_test): every node's files are in one shared
    #: ckpt_dir, so any of them missing is a failure. Real nodes keep them
    #: on private storage: one node sees only its own.
    shared: bool = True

    @staticmethod
    def from_metadata(raw: dict[str, Any], ckpt_dir: str | None) -> LevelFiles | None:
        """None for a plain checkpoint (no ``levels`` section). Raises
        CheckpointError when the node-local root is neither recorded nor given."""
        lv = raw.get("levels")
        if not isinstance(lv, dict):
            return None
        root = ckpt_dir or lv.get("ckpt_dir")
        if not isinstance(root, str) or not root:
            raise CheckpointError(
                "this multi-level checkpoint's data files are on node-local storage that its "
                "metadata does not name (written before ckpt_dir was recorded): pass "
                "--ckpt-dir (the config's ckpt_dir)"
            )
        try:
            nodes = [int(n) for n in lv["nodes"]]
            name = step_dir_name(int(lv["step"]))
            exec_id = str(lv["exec_id"])
            glbl = lv.get("glbl_dir")
            count = max(nodes) + 1
            dirs = [str(d) for d in lv.get("node_dirs", [f"node{k}" for k in range(count)])]
            if len(dirs) != count or any(not d or "/" in d or d in (".", "..") for d in dirs):
                raise ValueError(f"node_dirs {dirs!r}")
            return LevelFiles(
                level=int(lv["level"]),
                root=Path(root),
                node_dirs=dirs,
                step_dir=[Path(root) / d / exec_id / name for d in dirs],
                nodes=nodes,
                group_size=int(lv.get("group_size", 1)),
                parity_sizes=[int(x) for x in lv.get("parity_sizes", [])],
                parity_xxh3=[int(x) for x in lv.get("parity_xxh3", [])],
                glbl_step=(
                    parse_location(glbl) / exec_id / name
                    if isinstance(glbl, str) and glbl
                    else None
                ),
                shared=bool(lv.get("local_test", 1)),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"metadata: bad levels section: {e!r}") from e

    def data_file(self, rank: int) -> Path:
        return self.step_dir[self.nodes[rank]] / data_file_name(rank)

    def _group(self, rank: int) -> list[int]:
        """The ranks at ``rank``'s position on the nodes of its sector."""
        node = self.nodes[rank]
        pos = [r for r in range(len(self.nodes)) if self.nodes[r] == node].index(rank)
        first = node // self.group_size * self.group_size
        out = []
        for k in range(first, first + self.group_size):
            on = [r for r in range(len(self.nodes)) if self.nodes[r] == k]
            out.append(on[pos])
        return out

    def copy_node(self, rank: int) -> int:
        """The node that holds rank's L2 copy: its partner's (next of its group)."""
        g = self._group(rank)
        return self.nodes[g[(g.index(rank) + 1) % len(g)]]

    def copy_file(self, rank: int) -> Path:
        """Where rank's L2 copy is: on its partner's node."""
        return self.step_dir[self.copy_node(rank)] / f"partner-{rank:05d}.bin"

    def parity_file(self, rank: int) -> Path:
        return self.step_dir[self.nodes[rank]] / f"parity-{rank:05d}.bin"

    def node_index(self, name: str) -> int:
        """A node by its directory name (host name, ``node<k>``) or index."""
        if name in self.node_dirs:
            return self.node_dirs.index(name)
        if name.isdigit() and int(name) < len(self.node_dirs):
            return int(name)
        raise CheckpointError(
            f"node {name!r} holds no part of this checkpoint (its nodes: "
            f"{', '.join(self.node_dirs)}): pass --node with one of them"
        )

    def visible(self) -> list[int]:
        """The nodes whose directory this process can see."""
        return [k for k, d in enumerate(self.node_dirs) if (self.root / d).is_dir()]

    def describe(self) -> str:
        return f"L{self.level} ({_LEVEL_NAMES.get(self.level, 'unknown level')})"


def verify(
    directory: CheckpointDir,
    meta: Metadata,
    *,
    progress: bool | None = None,
    levels: LevelFiles | None = None,
    nodes: set[int] | None = None,
) -> VerifyReport:
    """Reads every piece of every data file and checks its xxh3_64; collects
    every failure (file, piece, leaf path, reason) rather than stopping.
    ``directory``: a checkpoint directory, or the objects of a committed
    checkpoint in an object store (read by ranged requests).
    ``levels``: a multi-level checkpoint's layout; its node-local data files
    are checked, and its L2 partner copies (every piece) or L3 parity shards
    (size and xxh3) too; ``nodes``: only the files those nodes hold (None:
    every node's)."""
    report = VerifyReport()
    by_rank: dict[int, list[tuple[int, Piece]]] = {}
    for i, p in enumerate(meta.pieces):
        by_rank.setdefault(p.rank, []).append((i, p))
    files: list[tuple[int, LocalFile | StoredFile]] = []
    for r in range(meta.world_size):
        if levels is None or local_dir(directory) is None:
            files.append((r, data_file(directory, data_file_name(r))))
        elif nodes is None or levels.nodes[r] in nodes:
            files.append((r, LocalFile(levels.data_file(r))))
    if levels is not None and levels.level == 2:
        files += [
            (r, LocalFile(levels.copy_file(r)))
            for r in range(meta.world_size)
            if nodes is None or levels.copy_node(r) in nodes
        ]
    stored = [0] * meta.world_size
    for p in meta.pieces:
        stored[p.rank] += p.stored
    bar = Progress("verify", sum(stored[r] for r, _ in files), enabled=progress)
    try:
        if levels is not None and levels.level == 3:
            _verify_parity(levels, meta.world_size, report, nodes)
        for rank, file in files:
            pieces = sorted(by_rank.get(rank, []), key=lambda ip: ip[1].offset)

            def fail(
                reason: str,
                piece: Piece | None = None,
                index: int | None = None,
                label: str = file.label,
                rank: int = rank,
            ) -> None:
                entry: dict[str, Any] = {"file": label, "rank": rank, "reason": reason}
                if piece is not None:
                    entry.update(
                        piece=index,
                        leaf=piece.leaf,
                        path=_path_str(meta.leaves[piece.leaf].path),
                        start=piece.start,
                        stop=piece.stop,
                        offset=piece.offset,
                        stored=piece.stored,
                    )
                report.failures.append(entry)

            try:
                size = file.size()
            except OSError as e:
                fail(f"missing ({e.strerror})")
                continue
            if size != meta.file_sizes[rank]:
                # Its pieces are not where the metadata says: not read.
                fail(f"{size} bytes, metadata says {meta.file_sizes[rank]}")
                continue
            try:
                f = file.open([(0, HEADER_SIZE)] + [(p.offset, p.stored) for _, p in pieces])
            except (OSError, CorruptCheckpointError) as e:
                fail(str(e) if isinstance(e, CorruptCheckpointError) else f"cannot open ({e})")
                continue
            with f:
                try:
                    check_header(
                        file.label, f.read(HEADER_SIZE), rank, meta.world_size,
                        meta.plan_fingerprint,
                    )  # fmt: skip
                except CorruptCheckpointError as e:
                    fail(f"bad header: {e}")
                for index, p in pieces:
                    f.seek(p.offset)
                    try:
                        data = f.read(p.stored)
                    except CorruptCheckpointError as e:
                        fail(str(e), p, index)  # cut short while read
                        break
                    report.pieces_checked += 1
                    report.bytes_read += len(data)
                    bar.advance(len(data))
                    if len(data) != p.stored:
                        fail(f"short read ({len(data)} of {p.stored} bytes)", p, index)
                    elif checksum(data) != p.xxh3:
                        fail("checksum mismatch (xxh3_64)", p, index)
    finally:
        bar.close()
    return report


def _verify_parity(
    levels: LevelFiles, world: int, report: VerifyReport, nodes: set[int] | None
) -> None:
    for rank in range(world):
        if nodes is not None and levels.nodes[rank] not in nodes:
            continue
        path = levels.parity_file(rank)
        entry: dict[str, Any] = {"file": str(path), "rank": rank}
        try:
            data = path.read_bytes()
        except OSError as e:
            report.failures.append({**entry, "reason": f"missing parity shard ({e.strerror})"})
            continue
        report.bytes_read += len(data)
        want = levels.parity_sizes[rank] if rank < len(levels.parity_sizes) else -1
        if len(data) != want:
            reason = f"parity shard: {len(data)} bytes, metadata says {want}"
            report.failures.append({**entry, "reason": reason})
        elif checksum(data) != levels.parity_xxh3[rank]:
            report.failures.append({**entry, "reason": "parity shard: checksum mismatch (xxh3_64)"})


def describe(
    directory: Path | str, meta: Metadata, committed: bool, levels: LevelFiles | None = None
) -> dict[str, Any]:
    """Everything ``inspect`` shows, as one JSON-able dict."""
    raw = meta.raw
    world = meta.world_size
    rank_raw = [0] * world
    rank_stored = [0] * world
    rank_pieces = [0] * world
    leaf_stored = [0] * len(meta.leaves)
    leaf_pieces = [0] * len(meta.leaves)
    leaf_ranks: list[set[int]] = [set() for _ in meta.leaves]
    codecs: dict[str, int] = {}
    for p in meta.pieces:
        rank_raw[p.rank] += p.length
        rank_stored[p.rank] += p.stored
        rank_pieces[p.rank] += 1
        leaf_stored[p.leaf] += p.stored
        leaf_pieces[p.leaf] += 1
        leaf_ranks[p.leaf].add(p.rank)
        codecs[p.codec] = codecs.get(p.codec, 0) + 1
    raw_bytes = sum(lf.nbytes for lf in meta.leaves)
    stored_bytes = sum(p.stored for p in meta.pieces)
    leaves = [
        {
            "index": i,
            "path": _path_str(lf.path),
            "kind": lf.kind,
            "dtype": lf.dtype,
            "shape": lf.shape,
            "bytes": lf.nbytes,
            "stored": leaf_stored[i],
            "pieces": leaf_pieces[i],
            "ranks": sorted(leaf_ranks[i]),
        }
        for i, lf in enumerate(meta.leaves)
    ]
    # The tree, summed at the first two levels of the paths.
    tree: dict[str, dict[str, int]] = {}
    for i, lf in enumerate(meta.leaves):
        for depth in (1, 2):
            if len(lf.path) < depth:
                continue
            key = _path_str(lf.path[:depth])
            node = tree.setdefault(key, {"depth": depth, "leaves": 0, "bytes": 0, "stored": 0})
            node["leaves"] += 1
            node["bytes"] += lf.nbytes
            node["stored"] += leaf_stored[i]
    return {
        "directory": str(directory),
        "committed": committed,
        "format": raw.get("format"),
        "version": raw.get("version"),
        "level": levels.describe() if levels else "none (a plain deeppart.save checkpoint)",
        "world_size": world,
        "algorithm": raw.get("algorithm"),
        "plan_fingerprint": meta.plan_fingerprint,
        "compression": raw.get("compression"),
        "checksum": raw.get("checksum"),
        "leaves": len(meta.leaves),
        "pieces": len(meta.pieces),
        "raw_bytes": raw_bytes,
        "stored_bytes": stored_bytes,
        "compression_ratio": raw_bytes / stored_bytes if stored_bytes else 1.0,
        "piece_codecs": codecs,
        "file_bytes": sum(meta.file_sizes),
        "created_unix": raw.get("created_unix"),
        "user": raw.get("user"),
        "ranks": [
            {
                "rank": r,
                "file": (
                    f"{levels.node_dirs[levels.nodes[r]]}/{data_file_name(r)}"
                    if levels
                    else data_file_name(r)
                ),
                "file_bytes": meta.file_sizes[r],
                "raw_bytes": rank_raw[r],
                "stored_bytes": rank_stored[r],
                "pieces": rank_pieces[r],
            }
            for r in range(world)
        ],
        "tree": [{"path": k, **v} for k, v in tree.items()],
        # Only L4 writes a global copy (glbl_dir may be set for every level).
        **(
            {"global_copy": str(levels.glbl_step)}
            if levels and levels.glbl_step and levels.level == 4
            else {}
        ),
        "leaf_table": leaves,
        "dtensors": [
            {
                "path": _path_str(r.path),
                "dtype": r.dtype,
                "shape": r.shape,
                "shards": [{"leaf": sh.leaf, "region": region_str(sh.region)} for sh in r.shards],
                **({"ranks": meta.record_ranks[k]} if meta.record_ranks else {}),
            }
            for k, r in enumerate(meta.dtensors)
        ],
        # Paths with one version per group of saved ranks (metadata version 3).
        "versions": [
            {"path": _path_str(v.path), "ranks": v.ranks, "leaves": v.leaves} for v in meta.versions
        ],
    }


def region_str(region: Region) -> str:
    """A region as index ranges per dimension, e.g. ``[0:15, 0:5]`` (a
    dimension of several runs joins them with ``+``)."""
    dims = ["+".join(f"{a}:{b}" for a, b in runs) or "-" for runs in region.runs]
    return "[" + ", ".join(dims) + "]"


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in
              enumerate(headers)]  # fmt: skip

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def format_text(info: dict[str, Any], *, max_leaves: int, max_ranks: int) -> str:
    hb = human_bytes
    parts: list[str] = []
    codecs = ", ".join(f"{k} {v}" for k, v in info["piece_codecs"].items())
    summary = [
        ("checkpoint", info["directory"]),
        ("committed", "yes" if info["committed"] else "NO (no matching COMMITTED marker)"),
        ("format", f"{info['format']} v{info['version']}"),
        ("level", str(info["level"])),
        *([("global copy", info["global_copy"])] if "global_copy" in info else []),
        ("world size", str(info["world_size"])),
        ("algorithm", str(info["algorithm"])),
        ("leaves", str(info["leaves"])),
        ("pieces", str(info["pieces"])),
        ("state bytes", hb(info["raw_bytes"])),
        ("stored bytes", hb(info["stored_bytes"])),
        ("compression", f"{info['compression']}, ratio {info['compression_ratio']:.3f}x "
                        f"(pieces: {codecs})"),
        ("checksum", str(info["checksum"])),
        ("plan", str(info["plan_fingerprint"])[:16]),
    ]  # fmt: skip
    w = max(len(k) for k, _ in summary)
    parts.append("\n".join(f"{k:<{w}}  {v}" for k, v in summary))

    tree_rows = [
        [("  " * (n["depth"] - 1)) + n["path"], str(n["leaves"]), hb(n["bytes"]), hb(n["stored"])]
        for n in info["tree"]
    ]
    parts.append("structure\n" + _table(["path", "leaves", "bytes", "stored"], tree_rows))

    leaves = sorted(info["leaf_table"], key=lambda lf: -lf["bytes"])
    shown = leaves[:max_leaves] if max_leaves >= 0 else leaves
    leaf_rows = [
        [
            lf["path"],
            lf["dtype"] or "object",
            "x".join(map(str, lf["shape"])) if lf["kind"] == "tensor" else "-",
            hb(lf["bytes"]),
            str(lf["pieces"]),
            _ranks_str(lf["ranks"]),
        ]
        for lf in shown
    ]
    title = f"leaves (largest {len(shown)} of {len(leaves)}; --leaves N shows more)"
    parts.append(
        title + "\n" + _table(["path", "dtype", "shape", "bytes", "pieces", "ranks"], leaf_rows)
    )

    records = info.get("dtensors", [])
    if records:
        rshown_d = records[:max_leaves] if max_leaves >= 0 else records
        rows = [
            [
                r["path"] + (f" (ranks {_ranks_str(r['ranks'])})" if "ranks" in r else ""),
                r["dtype"],
                "x".join(map(str, r["shape"])),
                str(len(r["shards"])),
                " ".join(sh["region"] for sh in r["shards"]),
            ]
            for r in rshown_d
        ]
        title = (
            f"sharded tensors ({len(rshown_d)} of {len(records)}; global shapes, each "
            "stored shard's region)"
        )
        parts.append(
            title + "\n" + _table(["path", "dtype", "shape", "shards", "regions"], rows, right={3})
        )

    versions = info.get("versions", [])
    if versions:
        vshown = versions[:max_leaves] if max_leaves >= 0 else versions
        rows = [
            [v["path"], str(len(v["ranks"])), "; ".join(_ranks_str(r) for r in v["ranks"])]
            for v in vshown
        ]
        title = (
            f"per-rank items ({len(vshown)} of {len(versions)} paths with one version per "
            "group of saved ranks; load elsewhere with per_rank=)"
        )
        parts.append(title + "\n" + _table(["path", "versions", "saved ranks"], rows, right={1}))

    ranks = info["ranks"]
    rshown = ranks[:max_ranks] if max_ranks >= 0 else ranks
    rank_rows = [
        [str(r["rank"]), r["file"], hb(r["raw_bytes"]), hb(r["stored_bytes"]), str(r["pieces"])]
        for r in rshown
    ]
    loads = [r["raw_bytes"] for r in ranks]
    mean = sum(loads) / len(loads) if loads else 0.0
    imbalance = max(loads) / mean if mean else 1.0
    title = f"who wrote what ({len(rshown)} of {len(ranks)} ranks; max/mean {imbalance:.3f})"
    parts.append(title + "\n" + _table(["rank", "file", "bytes", "stored", "pieces"], rank_rows))
    return "\n\n".join(parts)


def _ranks_str(ranks: list[int]) -> str:
    if len(ranks) <= 4:
        return ",".join(map(str, ranks))
    return f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"


def verify_nodes(
    directory: CheckpointDir,
    meta: Metadata,
    levels: LevelFiles | None,
    node: str | None,
    collective: bool,
) -> VerifyReport:
    """``--verify`` as asked: a plain checkpoint or fake nodes (one shared
    ``ckpt_dir``), every file; ``node``: only the files that node holds
    (``""``: this host's); ``collective``: every rank of an mpiexec job
    checks what its node holds (one rank per node suffices), one report on
    rank 0 (:func:`verify_collective`). Otherwise, on real nodes: the
    nodes whose storage is visible from here, naming the others."""
    local = local_dir(directory)
    if levels is None or local is None:
        return verify(directory, meta)
    if collective:
        return verify_collective(local, meta, levels)
    if node is not None:
        chosen = {levels.node_index(node or socket.gethostname())}
    elif levels.shared:
        return verify(directory, meta, levels=levels)
    else:
        chosen = set(levels.visible())
    report = verify(directory, meta, levels=levels, nodes=chosen)
    report.nodes_checked = sorted(chosen)
    report.nodes_unseen = [k for k in range(len(levels.node_dirs)) if k not in chosen]
    return report


def verify_collective(directory: Path, meta: Metadata, levels: LevelFiles) -> VerifyReport:
    """Collective ``--verify`` (under mpiexec): each node's files are
    checked by the lowest rank that sees its directory; every rank gets the
    merged report. A node no rank sees is a failure: its storage is lost,
    or no rank of this job runs there."""
    from deeppart.comm import resolve

    comm = resolve(None)
    rows = [json.loads(b) for b in comm.allgather_varbytes(json.dumps(levels.visible()).encode())]
    count = len(levels.node_dirs)
    owner = {k: next((r for r, row in enumerate(rows) if k in row), -1) for k in range(count)}
    mine = {k for k, r in owner.items() if r == comm.rank}
    part = verify(directory, meta, levels=levels, nodes=mine)
    payload = json.dumps([part.pieces_checked, part.bytes_read, part.failures]).encode()
    report = VerifyReport(nodes_checked=sorted(k for k, r in owner.items() if r >= 0))
    for row in comm.allgather_varbytes(payload):
        pieces, nbytes, failures = json.loads(row)
        report.pieces_checked += pieces
        report.bytes_read += nbytes
        report.failures += failures
    for k, r in owner.items():
        if r < 0:
            report.failures.append(
                {
                    "file": str(levels.root / levels.node_dirs[k]),
                    "rank": -1,
                    "reason": f"node {levels.node_dirs[k]}: not visible from any rank of this "
                    "job (its storage is lost, or no rank runs there: start one per node)",
                }
            )
    report.collective = comm.size
    return report


def _print_verify(report: VerifyReport, levels: LevelFiles | None) -> None:
    if report.ok:
        print(
            f"verify: OK, {report.pieces_checked} pieces, "
            f"{human_bytes(report.bytes_read)} read, every xxh3_64 matches"
        )
    else:
        print(f"verify: {len(report.failures)} FAILURE(S)")
        for fl in report.failures:
            where = fl["file"]
            if "piece" in fl:
                where += (
                    f": piece {fl['piece']} (leaf {fl['leaf']} {fl['path']} "
                    f"[{fl['start']}:{fl['stop']}], offset {fl['offset']}, "
                    f"{fl['stored']} bytes)"
                )
            print(f"  {where}: {fl['reason']}")
    if levels is None or report.nodes_checked is None:
        return
    names = [levels.node_dirs[k] for k in report.nodes_checked]
    total = len(levels.node_dirs)
    if report.collective:
        print(f"verify: collective over {report.collective} rank(s), {len(names)} of {total} nodes")
        return
    shown = ", ".join(names) or "none"
    print(f"verify: checked the files of node(s) {shown} ({len(names)} of {total})")
    if report.nodes_unseen:
        unseen = ", ".join(levels.node_dirs[k] for k in report.nodes_unseen)
        print(
            f"verify: not checked: node(s) {unseen}, whose node-local storage is not visible "
            "from here; to check every node run under mpiexec with one rank per node and "
            "--collective"
        )


def _fti_hint(checkpoint: str) -> str:
    """Why a multi-level step has no metadata.json: the FTI backend wrote
    it (libfti's own files, indexed by ``fti-step-N.json`` beside where the
    built-in engine's step would be), which this tool cannot read."""
    path = Path(checkpoint)
    index = path.parent / f"{INDEX_PREFIX}{path.name.removeprefix('step-')}.json"
    if not path.name.startswith("step-") or not index.is_file():
        return ""
    return (
        f"\n  {index.name} is there: this step was written by the FTI backend (libfti's "
        "own files), which deeppart inspect cannot read; load it through "
        "Checkpointer(config=...), or save with backend='builtin' to inspect the levels"
    )


def run(args: argparse.Namespace) -> int:
    try:
        where = source_location(args.checkpoint)
        # What was written, committed or not (in an object store only a
        # committed checkpoint can be found: the marker names its objects).
        directory, text, committed = checkpoint_source(where).open_written()
        meta = _parse_metadata(text)
        levels = LevelFiles.from_metadata(meta.raw, args.ckpt_dir)
    except CheckpointError as e:
        print(f"deeppart: error: {e}{_fti_hint(args.checkpoint)}", file=sys.stderr)
        return 2
    info = describe(str(where), meta, committed, levels)
    report: VerifyReport | None = None
    if args.verify:
        try:
            report = verify_nodes(directory, meta, levels, args.node, args.collective)
        except CheckpointError as e:
            print(f"deeppart: error: {e}", file=sys.stderr)
            return 2
        info["verify"] = {
            "ok": report.ok,
            "pieces_checked": report.pieces_checked,
            "bytes_read": report.bytes_read,
            "failures": report.failures,
        }
        if levels is not None and report.nodes_checked is not None:
            info["verify"]["nodes_checked"] = [levels.node_dirs[k] for k in report.nodes_checked]
            info["verify"]["nodes_not_checked"] = [levels.node_dirs[k] for k in report.nodes_unseen]
    # Collective: one report, from rank 0.
    quiet = report is not None and report.collective and _rank() != 0
    if not quiet:
        if args.json:
            if not args.leaves_in_json:
                info.pop("leaf_table")
            print(json.dumps(info))
        else:
            print(format_text(info, max_leaves=args.leaves, max_ranks=args.ranks))
            if report is not None:
                print()
                _print_verify(report, levels)
    if report is not None and not report.ok:
        return 1
    if report is not None and report.nodes_checked == []:
        return 1  # nothing here could be checked
    return 0 if committed else 1


def _rank() -> int:
    from deeppart.comm import resolve

    return resolve(None).rank


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "inspect", help="show a checkpoint's structure, sizes and writers; --verify checksums"
    )
    p.add_argument(
        "checkpoint",
        help="checkpoint directory or s3://bucket/prefix URL (multi-level: "
        "meta_dir/<exec_id>/step-N)",
    )
    p.add_argument(
        "--ckpt-dir", help="multi-level checkpoints: the config's node-local ckpt_dir (default: "
        "the one recorded in metadata.json)"
    )  # fmt: skip
    p.add_argument(
        "--verify", action="store_true", help="read every piece and check its checksum (exit 1 "
        "on corruption)"
    )  # fmt: skip
    p.add_argument(
        "--node", nargs="?", const="", default=None, help="multi-level checkpoints on real nodes: "
        "verify only the files this node holds (or node NAME's: its host name or index)"
    )  # fmt: skip
    p.add_argument(
        "--collective", action="store_true", help="under mpiexec, one rank per node or more: "
        "each node verifies the files it holds; rank 0 prints one report"
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--leaves", type=int, default=20, help="leaf rows to show, largest first (-1: all)"
    )
    p.add_argument("--ranks", type=int, default=64, help="rank rows to show (-1: all)")
    p.add_argument(
        "--leaves-in-json", action="store_true", help="include the per-leaf table in --json"
    )
    p.set_defaults(func=run)
