"""The load's exchange of needed regions by layout (deeppart.loading.needs):
every rank learns every rank's needs from one description per distinct
layout set, and the needers of any span are those a per-rank scan finds."""

from __future__ import annotations

import random
from functools import partial
from typing import Any

import numpy as np
import pytest
from thread_comm import ThreadComm, run_ranks, thread_comms

import deeppart.loading.needs as needs_module
from deeppart.errors import CheckpointError
from deeppart.loading.needs import DIGEST_BYTES, NeedSpec, RegionIndex, exchange_needs
from deeppart.regions import Region, placement_region

#: Per tensor: placements over the stage's (dp, tp) mesh and global shape.
TENSORS: dict[str, tuple[tuple[Any, ...], tuple[int, ...]]] = {
    "fsdp_tp_rows": (((0, 4), (0, 1)), (64, 24)),  # _StridedShard(0, 4), Shard(0)
    "fsdp_tp_cols": (((0, 1), (1, 1)), (40, 32)),  # Shard(0), Shard(1)
    "tp_only": ((None, (0, 1)), (16, 8)),  # replicated over dp
    "uneven": (((0, 1), None), (7, 3)),  # 7 rows over 4 dp ranks
}


def _stage_mesh(stage: int, dp: int, tp: int) -> Any:
    return np.arange(stage * dp * tp, (stage + 1) * dp * tp, dtype=np.int64).reshape(dp, tp)


def _needs(rank: int, pp: int, dp: int, tp: int) -> list[NeedSpec]:
    """Rank ``rank``'s needs in a PP x DP x TP job: its region of every
    DTensor of its stage, and the whole of a plain tensor."""
    stage = rank // (dp * tp)
    mesh = _stage_mesh(stage, dp, tp)
    key = (mesh.shape, tuple(mesh.reshape(-1).tolist()))
    coord = [int(x) for x in np.argwhere(mesh == rank)[0]]
    out = [NeedSpec(("step",), Region.full((1,)), full=True)]
    for name, (specs, shape) in TENSORS.items():
        region = placement_region(shape, mesh.shape, coord, specs)
        out.append(NeedSpec((f"s{stage}", name), region, (key, mesh, [0, 1], specs, shape)))
    return out


def _full(path: tuple[Any, ...]) -> Region:
    if path == ("step",):
        return Region.full((1,))
    return Region.full(TENSORS[path[1]][1])


def _exchange(pp: int, dp: int, tp: int) -> list[tuple[Any, BaseException | None]]:
    comms = thread_comms(pp * dp * tp)
    return run_ranks([partial(exchange_needs, c, _needs(c.rank, pp, dp, tp), _full) for c in comms])


def _scan(needs: dict[int, list[NeedSpec]], path: tuple[Any, ...], span: Region) -> list[int]:
    return sorted(
        r for r, ns in needs.items() for n in ns if n.path == path and n.region.intersect(span)
    )


@pytest.mark.parametrize(("pp", "dp", "tp"), [(1, 1, 1), (2, 4, 2), (2, 8, 4)])
def test_every_rank_learns_every_ranks_needs(pp: int, dp: int, tp: int) -> None:
    out = _exchange(pp, dp, tp)
    assert all(e is None for _, e in out), [e for _, e in out if e]
    needs = {r: _needs(r, pp, dp, tp) for r in range(pp * dp * tp)}
    first = out[0][0][0]
    assert all(res[0] == first for res, _ in out)  # the same on every rank
    rng = random.Random(0)
    for path, entries in first.items():
        index = RegionIndex(entries)
        spans = [region for region, _ in entries]
        for region in list(spans):  # parts of the regions, as pieces are
            rows = region.shape[0] if region.runs else 0
            for _ in range(3):
                if rows > 1:
                    a = rng.randrange(rows - 1)
                    spans.append(region.rows(a, rng.randrange(a + 1, rows + 1)))
        for span in spans:
            assert index.needers(span) == _scan(needs, path, span), (path, span)
        assert index.needers_many(spans) == [_scan(needs, path, s) for s in spans], path


def test_one_description_per_stage_whatever_the_ranks() -> None:
    """Every rank of a stage describes its needs with the same bytes: one
    row a stage is sent, and what every rank gathers grows with the ranks
    only by its 16-byte digests and the stage meshes' rank lists."""
    sizes = {}
    for dp in (2, 16):
        out = _exchange(2, dp, 2)
        sent = [res[1]["sent"] for res, _ in out]
        assert sum(s > DIGEST_BYTES for s in sent) == 2  # the lowest rank of each stage
        world = 2 * dp * 2
        sizes[dp] = out[0][0][1]["gathered"] - DIGEST_BYTES * world
        old = sum(
            len(str([list(n.path), n.region.to_json()]))
            for r in range(world)
            for n in _needs(r, 2, dp, 2)
        )
        assert out[0][0][1]["gathered"] < old
    mesh_ints = 2 * (2 * 16 * 2 - 2 * 2 * 2)  # two stages' meshes list 28 more ranks each
    assert sizes[16] - sizes[2] <= 4 * mesh_ints


def test_a_region_its_layout_does_not_explain_is_sent_as_it_is() -> None:
    comms = thread_comms(2)
    mesh = np.arange(2, dtype=np.int64).reshape(2)
    key = (mesh.shape, (0, 1))
    layout = (key, mesh, [0], ((0, 1),), (8,))

    def needs(rank: int) -> list[NeedSpec]:
        # Rank 1 fills rows 0-2 (not its Shard(0) half, rows 4-8).
        region = Region((((0, 4),),)) if rank == 0 else Region((((0, 2),),))
        return [NeedSpec(("t",), region, layout)]

    out = run_ranks([partial(exchange_needs, c, needs(c.rank), _full) for c in comms])
    wants = out[0][0][0][("t",)]
    assert RegionIndex(wants).needers(Region((((1, 2),),))) == [0, 1]
    assert RegionIndex(wants).needers(Region((((5, 6),),))) == []


class _Damaging(ThreadComm):
    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        rows = list(super().allgather_varbytes(data))
        rows[0] = rows[0].replace(b'"step"', b'"stop"')  # one byte, in transit
        return rows


def test_a_damaged_description_is_an_error_on_every_rank() -> None:
    shared = thread_comms(2)[0]._shared
    comms = [_Damaging(shared, r) for r in range(2)]
    out = run_ranks([partial(exchange_needs, c, _needs(c.rank, 1, 2, 1), _full) for c in comms])
    for _, e in out:
        assert isinstance(e, CheckpointError) and "digest" in str(e)


def test_region_index_matches_a_scan_on_random_regions() -> None:
    rng = random.Random(1)
    for _ in range(50):
        entries = []
        for r in range(rng.randrange(1, 60)):
            a = rng.randrange(100)
            rows = ((a, rng.randrange(a + 1, 101)),)
            c = rng.randrange(10)
            entries.append((Region((rows, ((c, rng.randrange(c + 1, 11)),))), [r]))
        index = RegionIndex(entries)
        for _ in range(20):
            a, c = rng.randrange(100), rng.randrange(10)
            span = Region((((a, rng.randrange(a + 1, 101)),), ((c, c + 1),)))
            want = sorted(r for reg, rs in entries for r in rs if reg.intersect(span))
            assert index.needers(span) == want


def _random_region(rng: random.Random, box: bool) -> Region:
    dims = []
    for n in (100, 10):
        a = rng.randrange(n)
        runs = [(a, rng.randrange(a + 1, n + 1))]
        if not box and runs[0][1] + 1 < n:  # a second run: not a box
            b = rng.randrange(runs[0][1] + 1, n)
            runs.append((b, rng.randrange(b + 1, n + 1)))
        dims.append(tuple(runs))
    return Region(tuple(dims))


@pytest.mark.parametrize(("boxes", "chunk"), [(True, None), (True, 7), (False, None)])
def test_needers_many_matches_a_scan(
    boxes: bool, chunk: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch form, vectorised when every region and span is a box (and
    split into chunks), the same answers as a scan; regions held by several
    ranks, by none, and regions that are not boxes (the one-at-a-time path)."""
    if chunk is not None:  # a few spans at a time
        monkeypatch.setattr(needs_module, "_BOX_CHUNK", chunk)
    rng = random.Random(2)
    for trial in range(40):
        entries = [
            (
                _random_region(rng, boxes or rng.random() < 0.5),
                rng.sample(range(64), rng.randrange(4)),
            )
            for _ in range(rng.randrange(1, 80))
        ]
        index = RegionIndex(entries)
        spans = [_random_region(rng, boxes or rng.random() < 0.5) for _ in range(rng.randrange(60))]
        want = [
            sorted({r for reg, rs in entries for r in rs if reg.intersect(span)}) for span in spans
        ]
        assert index.needers_many(spans) == want, trial
        assert [index.needers(s) for s in spans] == want
