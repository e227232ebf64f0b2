"""Issue 31, item 9: two ``dtensors`` records with one path in
metadata.json (re-committed, so only the record check can catch it) are
refused as a corrupt checkpoint by ``load``, ``deeppart export`` and
``deeppart inspect --verify`` alike, naming the records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import deeppart
from deeppart.errors import CorruptCheckpointError
from deeppart.format import MARKER, METADATA, marker_text
from deeppart.regions import parse_records
from deeppart.tools.cli import main as cli_main


def _record(path: list[object], leaf: int) -> dict[str, object]:
    return {
        "path": path,
        "dtype": "float32",
        "shape": [4],
        "shards": [{"leaf": leaf, "index": [[[0, 4]]]}],
    }


class _Leaf:
    kind, dtype, shape = "tensor", "float32", [4]


def test_parse_records_refuses_a_repeated_path() -> None:
    leaves = [_Leaf(), _Leaf()]
    with pytest.raises(
        CorruptCheckpointError, match=r"dtensors\[1\]: the same path as dtensors\[0\]"
    ):
        parse_records([_record(["w"], 0), _record(["w"], 1)], leaves, lambda d: d == "float32")
    with pytest.raises(CorruptCheckpointError, match=r"dtensors\[0\]: a path key"):
        parse_records([_record([["w"]], 0)], leaves, lambda d: d == "float32")
    assert len(parse_records([_record(["w"], 0), _record(["v"], 1)], leaves, lambda d: True)) == 2


def test_versions_of_one_path_need_disjoint_saved_ranks() -> None:
    """Metadata version 3 (each rank's own state): two records of one path
    are versions (pipeline stages that reuse names) when their saved ranks
    are disjoint; overlapping or absent ranks are still a repeated path."""
    leaves = [_Leaf(), _Leaf()]

    def rec(leaf: int, ranks: object) -> dict[str, object]:
        return {**_record(["w"], leaf), "ranks": ranks}

    known = lambda d: d == "float32"  # noqa: E731
    assert len(parse_records([rec(0, [0, 1]), rec(1, [2, 3])], leaves, known, True)) == 2
    for a, b in (([0, 1], [1, 2]), ([0], [0]), ([0, 1], None)):
        with pytest.raises(CorruptCheckpointError, match="the same path as dtensors"):
            parse_records([rec(0, a), rec(1, b)], leaves, known, True)
    with pytest.raises(CorruptCheckpointError, match="the same path as dtensors"):
        parse_records([rec(0, [0]), rec(1, [1])], leaves, known)  # not version 3


@pytest.fixture
def duplicated(tmp_path: Path) -> Path:
    """A committed one-process checkpoint of two DTensors whose second
    record was given the first one's path."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    d = tmp_path / "ck"
    try:
        mesh = init_device_mesh("cpu", (1,))
        state = {
            "a": distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.arange(4.0) + 10, mesh, [Shard(0)]),
        }
        deeppart.save(state, d, comm=deeppart.comm.SingleComm())
    finally:
        dist.destroy_process_group()
    meta = json.loads((d / METADATA).read_text())
    assert [r["path"] for r in meta["dtensors"]] == [["a"], ["b"]]
    meta["dtensors"][1]["path"] = ["a"]
    text = json.dumps(meta).encode()
    (d / METADATA).write_bytes(text)
    (d / MARKER).write_bytes(marker_text(text))
    return d


def test_repeated_record_path_is_corrupt_everywhere(
    duplicated: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expect = r"dtensors\[1\]: the same path as dtensors\[0\]"
    with pytest.raises(CorruptCheckpointError, match=expect):
        deeppart.load(duplicated)
    capsys.readouterr()
    assert cli_main(["export", str(duplicated), "--to", "safetensors", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "the same path as dtensors[0]" in err and "Traceback" not in err, err
    assert cli_main(["inspect", "--verify", str(duplicated)]) != 0
    out = capsys.readouterr()
    assert "the same path as dtensors[0]" in out.out + out.err, out
    assert "verify: OK" not in out.out
