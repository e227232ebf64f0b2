"""The O(runs) region arithmetic of sharded tensors (deeppart.regions
``placement_region``, ``select_positions``, ``runs_of``, ``_positions``)
against torch's own per-row shard arithmetic (``_get_shard_size_and_offsets``,
as ``deeppart.state.dtensor._region_at`` used it before) over many global shapes,
mesh sizes and placements: uneven and empty shards, ``_StridedShard`` and
chains of placements on one dimension. One process, no DeviceMesh."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from deeppart.regions import Region, _positions, placement_region, runs_of, select_positions

torch = pytest.importorskip("torch")
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _get_shard_size_and_offsets  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from deeppart.state.dtensor import _placement_specs, _region_at  # noqa: E402


def _loop_runs(index: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for i in index:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def reference(shape: Sequence[int], mesh: Sequence[int], coord: Sequence[int], pls: Any) -> Region:
    """torch's per-row indices of the shard at ``coord`` (every global index
    listed), as runs: the definition the fast arithmetic must match."""
    local = list(shape)
    index: dict[int, Any] = {}
    for m, p in enumerate(pls):
        if not isinstance(p, Shard | _StridedShard):
            continue
        size, offsets = _get_shard_size_and_offsets(
            local[p.dim], mesh[m], coord[m], p, index.get(p.dim), shape[p.dim], False
        )
        local[p.dim] = size
        index[p.dim] = offsets
    runs = []
    for d, n in enumerate(shape):
        if d in index:
            runs.append(_loop_runs([int(x) for x in index[d]][: local[d]]) if local[d] else ())
        else:
            runs.append(((0, int(n)),) if n else ())
    return Region(tuple(runs))


def _cases() -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]]:
    rng = random.Random(32)
    cases: list[tuple[tuple[int, ...], tuple[int, ...], tuple[Any, ...]]] = []
    # Hand-picked: FSDP2 over TP (_StridedShard then Shard on dim 0), uneven
    # rows, fewer rows than ranks (empty shards), empty tensors.
    cases += [
        ((8,), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
        ((7, 3), (2, 2), (_StridedShard(0, split_factor=2), Shard(0))),
        ((5, 4), (2, 4), (Replicate(), Shard(0))),
        ((3, 5), (4,), (Shard(0),)),
        ((0, 5), (2, 2), (Replicate(), Shard(0))),
        ((6, 0), (2, 2), (Shard(0), Shard(1))),
        ((1,), (8,), (Shard(0),)),
        ((770, 5), (2, 2), (Shard(0), Shard(0))),
        ((11, 13), (3, 2), (_StridedShard(1, split_factor=3), Shard(1))),
        ((10,), (2, 3), (Shard(0), _StridedShard(0, split_factor=2))),
    ]
    kinds = ("R", "S", "SS")
    for _ in range(600):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 12, 17, 31, 64]) for _ in range(ndim))
        mdim = rng.randint(1, 3)
        mesh = tuple(rng.choice([1, 2, 3, 4]) for _ in range(mdim))
        pls: list[Any] = []
        for _m in range(mdim):
            kind = rng.choice(kinds)
            d = rng.randrange(ndim)
            if kind == "R":
                pls.append(Replicate())
            elif kind == "S":
                pls.append(Shard(d))
            else:
                pls.append(_StridedShard(d, split_factor=rng.choice([1, 2, 3, 4])))
        cases.append((shape, mesh, tuple(pls)))
    return cases


CASES = _cases()


@pytest.mark.parametrize("chunk", range(6))
def test_placement_region_matches_torch(chunk: int) -> None:
    """Every coordinate of every case: the same region as torch's rows, and
    the regions of a Shard-only layout tile the tensor exactly."""
    checked = 0
    for shape, mesh, pls in CASES[chunk::6]:
        for coord in itertools.product(*(range(n) for n in mesh)):
            want = reference(shape, mesh, coord, pls)
            got = _region_at(shape, mesh, coord, pls)
            assert got == want, (shape, mesh, coord, pls, got, want)
            assert got.shape == want.shape
            checked += 1
    assert checked > 100


def test_strided_shard_interleaves_rows() -> None:
    """torch's own example (``_compute_local_shape_and_global_offset``):
    S(0), SS(0, split_factor=2) on (2,2) of 8 rows: coordinate (0,1) holds
    rows 1 and 3."""
    pls = (Shard(0), _StridedShard(0, split_factor=2))
    got = placement_region((8,), (2, 2), (0, 1), _placement_specs(pls))
    assert got.runs == (((1, 2), (3, 4)),)
    assert got == reference((8,), (2, 2), (0, 1), pls)


def test_uneven_and_empty_shards() -> None:
    """3 rows on 4 ranks: ranks 0..2 one row each, rank 3 none."""
    got = [placement_region((3, 2), (4,), (i,), ((0, 1),)).runs for i in range(4)]
    assert got == [
        (((0, 1),), ((0, 2),)),
        (((1, 2),), ((0, 2),)),
        (((2, 3),), ((0, 2),)),
        ((), ((0, 2),)),
    ]


def test_runs_of_is_the_loop() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        idx = np.unique(rng.integers(0, 60, rng.integers(0, 40)))
        assert runs_of(idx) == _loop_runs(idx.tolist())
        assert runs_of(idx.tolist()) == _loop_runs(idx.tolist())
    assert runs_of([0, 1, 2, 5, 6, 9]) == ((0, 3), (5, 7), (9, 10))
    assert runs_of([]) == ()


def test_select_positions_and_positions_are_the_per_row_ones() -> None:
    """select_positions picks the indices at given positions, and
    _positions is its inverse, against per-row lists."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        within_idx = np.unique(rng.integers(0, 80, rng.integers(1, 50)))
        within = runs_of(within_idx)
        pos = np.unique(rng.integers(0, len(within_idx), rng.integers(0, len(within_idx) + 1)))
        got = select_positions(within, runs_of(pos))
        assert got == runs_of(within_idx[pos])
        assert _positions(got, within).tolist() == pos.tolist()
        region = Region((within,))
        sub = Region((got,))
        span = region.spans(sub)[0]
        contiguous = len(pos) == 0 or int(pos[-1]) - int(pos[0]) + 1 == len(pos)
        assert (span is not None) == contiguous
        if span is not None and len(pos):
            assert span == (int(pos[0]), int(pos[-1]) + 1)


def test_one_process_load_reads_rows_straight_in_and_checks_them(tmp_path: Any) -> None:
    """A DTensor checkpoint loaded in one process (full tensors, and into=
    DTensors) takes the direct read (rows straight from the file into the
    tensors): bitwise; a flipped byte of a stored shard fails the load with
    the checksum named, not wrong values."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import deeppart
    from deeppart.errors import CorruptCheckpointError
    from deeppart.format import data_file_name

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.arange(60, dtype=torch.float32).reshape(12, 5)
        b = torch.arange(7, dtype=torch.bfloat16)
        state = {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "b": distribute_tensor(b, mesh, [Shard(0)]),
            "step": 3,
        }
        d = tmp_path / "ckpt"
        deeppart.save(state, d)
        full = deeppart.load(d)
        assert torch.equal(full["w"], w) and torch.equal(full["b"], b) and full["step"] == 3
        into = {
            "w": distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)]),
            "b": distribute_tensor(torch.zeros(7, dtype=torch.bfloat16), mesh, [Shard(0)]),
            "step": 0,
        }
        out = deeppart.load(d, into=into)
        assert torch.equal(out["w"].to_local(), w) and torch.equal(out["b"].to_local(), b)
        meta = json.loads((d / "metadata.json").read_text())
        leaf = next(r["shards"][0]["leaf"] for r in meta["dtensors"] if r["path"] == ["w"])
        piece = next(p for p in meta["pieces"] if p[0] == leaf)
        data = d / data_file_name(piece[3])
        raw = bytearray(data.read_bytes())
        raw[piece[4] + 9] ^= 0x40
        data.write_bytes(bytes(raw))
        with pytest.raises(CorruptCheckpointError, match="checksum"):
            deeppart.load(d)
    finally:
        dist.destroy_process_group()
