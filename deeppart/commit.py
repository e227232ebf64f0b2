"""Stages 4 and 6 of a save: the temporary directory, and the commit.

Before anything is written, rank 0 makes the save's temporary directory
(:func:`make_temp_dir`, ``.tmp-NAME-<hex>`` next to the final one); after
every rank has written its data file, rank 0 builds ``metadata.json`` from
everyone's piece records (:func:`metadata_json`) and commits
(:func:`commit_dir`): metadata, fsyncs, rename, and the ``COMMITTED``
marker last. A directory without the marker is never loaded; a replaced
checkpoint stays committed (moved aside) until the new marker exists.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.compression import CODECS
from deeppart.errors import CheckpointError
from deeppart.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_SIZE,
    MARKER,
    METADATA,
    METADATA_VERSION_SHARDED,
    METADATA_VERSION_UNION,
    PIECE_FIELDS,
    fsync_dir,
    is_committed,
    marker_text,
    remove_tree,
    write_durable,
)
from deeppart.ownership import check_target
from deeppart.prepare import Prepared
from deeppart.writer import RECORD_FIELDS

__all__ = ["TEMP_NAME_MAX", "commit_dir", "make_temp_dir", "metadata_head", "metadata_json"]

#: The longest temporary directory name (``.tmp-`` NAME ``-`` 12 hex digits).
TEMP_NAME_MAX = len(".tmp--") + 12 + 255


def make_temp_dir(final: Path, overwrite: bool) -> str:
    """Rank 0: refuses a ``final`` that holds something DeepPart did not
    write (:func:`deeppart.ownership.check_target`, again: the ranks checked
    it before they agreed), and a committed ``final`` unless ``overwrite``;
    makes and returns the name of the temporary directory next to it, in
    which the ranks write."""
    check_target(final)
    if final.exists() and not overwrite and is_committed(final):
        raise CheckpointError(
            f"{final}: a committed checkpoint exists "
            "(overwrite=False; pass overwrite=True to replace it)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    name = f".tmp-{final.name}-{os.urandom(6).hex()}"
    (final.parent / name).mkdir()
    return name


def metadata_head(prep: Prepared, codec: str) -> dict[str, Any]:
    """The keys of ``metadata.json`` that describe the state and its plan."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "created_unix": time.time(),
        "world_size": prep.plan.world_size,
        "algorithm": prep.plan.algorithm,
        "plan_fingerprint": prep.plan.fingerprint,
        "manifest_fingerprint": prep.manifest.fingerprint,
        "manifest": json.loads(prep.manifest.to_json()),
        "skeleton": prep.skeleton,
        "compression": codec,
        "checksum": "xxh3_64",
        **dtensor_keys(prep),
    }


def dtensor_keys(prep: Prepared) -> dict[str, Any]:
    """The ``dtensors`` records of a state with sharded tensors, which
    version 2 of the metadata adds (docs/FORMAT.md); version 3 (items not
    held by every rank, per-rank values, versions: :mod:`deeppart.union`)
    adds each record's ``ranks`` and the ``versions`` records; nothing
    otherwise."""
    if prep.union is not None:
        return {"version": METADATA_VERSION_UNION, **prep.union}
    if not prep.dtensors:
        return {}
    return {"version": METADATA_VERSION_SHARDED, "dtensors": [r.to_json() for r in prep.dtensors]}


def metadata_json(
    prep: Prepared,
    records: npt.NDArray[np.uint64],
    user: Any,
    extra: dict[str, Any] | None = None,
) -> bytes:
    world = prep.plan.world_size
    counts = [len(prep.plan.rank_pieces(r)) for r in range(world)]
    rows: list[list[Any]] = []
    file_sizes: list[int] = []
    pos = 0
    raw_total = stored_total = 0
    for r in range(world):
        block = records[pos : pos + counts[r] * RECORD_FIELDS + 1]
        pos += counts[r] * RECORD_FIELDS + 1
        recs = block[:-1].reshape(-1, RECORD_FIELDS)
        file_sizes.append(int(block[-1]))
        for (li, start, stop), rec in zip(prep.plan.rank_pieces(r), recs, strict=True):
            off, length, stored, xxh, ci = (int(x) for x in rec)
            rows.append([li, start, stop, r, off, length, stored, CODECS[ci], xxh])
            raw_total += length
            stored_total += stored
    meta = {
        **metadata_head(prep, prep.codec),
        "alignment": HEADER_SIZE,
        "raw_bytes": raw_total,
        "stored_bytes": stored_total,
        "file_sizes": file_sizes,
        "piece_fields": list(PIECE_FIELDS),
        "pieces": rows,
        "user": user,
        **(extra or {}),
    }
    return json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()


def commit_dir(tmp: Path, final: Path, meta: bytes) -> None:
    """Rank 0's commit of a written temporary directory ``tmp`` as ``final``:
    metadata.json, fsyncs, rename (a replaced ``final`` is moved aside,
    still committed, and removed only after the new marker), then the
    COMMITTED marker, written last."""
    write_durable(tmp / METADATA, meta)
    fsync_dir(tmp)
    old: Path | None = None
    if final.exists():
        # Moved aside still committed: if this save dies before its marker,
        # load() serves the previous checkpoint from there.
        old = final.parent / f".old-{final.name}-{os.urandom(6).hex()}"
        final.rename(old)
    tmp.rename(final)
    fsync_dir(final.parent)
    write_durable(final / MARKER, marker_text(meta))
    fsync_dir(final)
    if old is not None:
        remove_tree(old)
