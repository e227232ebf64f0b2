"""The metadata of a commit: ``metadata.json`` built from the prepared
state and every rank's piece records (docs/FORMAT.md). The commit itself,
the rename that cannot replace anything, is :mod:`deeppart.storage.commit`."""

from __future__ import annotations

import json
import time
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.compression import CODECS
from deeppart.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_SIZE,
    METADATA_VERSION_SHARDED,
    METADATA_VERSION_UNION,
    PIECE_FIELDS,
    new_save_id,
)
from deeppart.saving.prepare import Prepared
from deeppart.saving.writer import RECORD_FIELDS

__all__ = ["dtensor_keys", "metadata_head", "metadata_json"]


def metadata_head(prep: Prepared, codec: str, save_id: str | None = None) -> dict[str, Any]:
    """The keys of ``metadata.json`` that describe the state and its plan;
    ``save_id``: the save's id (default: a new one), kept near the start,
    where :func:`deeppart.storage.ownership.metadata_save_id` reads it."""
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "save_id": save_id or new_save_id(),
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
    held by every rank, per-rank values, versions: :mod:`deeppart.state.union`)
    adds each record's ``ranks`` and the ``versions`` records; nothing
    otherwise."""
    if prep.union is not None:
        # The union's records name their ranks, the save's DTensor records
        # (in the same order) their shards.
        heads = prep.union["dtensors"]
        dtensors = [
            {**head, "shards": [{"leaf": s.leaf, "index": s.region.to_json()} for s in r.shards]}
            for head, r in zip(heads, prep.dtensors, strict=True)
        ]
        return {"version": METADATA_VERSION_UNION, **prep.union, "dtensors": dtensors}
    if not prep.dtensors:
        return {}
    return {"version": METADATA_VERSION_SHARDED, "dtensors": [r.to_json() for r in prep.dtensors]}


def metadata_json(
    prep: Prepared,
    records: npt.NDArray[np.uint64],
    user: Any,
    extra: dict[str, Any] | None = None,
    save_id: str | None = None,
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
        **metadata_head(prep, prep.codec, save_id),
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
