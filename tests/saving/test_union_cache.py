"""A save whose structure is unchanged since the last union save in this
process reuses the union and its plan (deeppart.saving.union_cache, issue
46): ranks as threads (tests/support/thread_comm.py) holding two pipeline
stages' trees, saved with deeppart.save and loaded back per rank."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from thread_comm import run_ranks, thread_comms  # noqa: E402

import deeppart  # noqa: E402
from deeppart.saving import deferred_proof, union_cache  # noqa: E402
from deeppart.saving import prepare as prepare_mod  # noqa: E402
from deeppart.saving.deferred_proof import DEFER_FROM  # noqa: E402
from deeppart.state.union import Described  # noqa: E402


@pytest.fixture(autouse=True)
def _no_cached_union() -> Iterator[None]:
    union_cache.forget()
    yield
    union_cache.forget()


@pytest.fixture
def exchanges(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ranks that took the full union path (the exchange), one entry a call."""
    calls: list[int] = []
    inner = prepare_mod._union_prepare

    def counted(c: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(c.rank)
        return inner(c, *args, **kwargs)

    monkeypatch.setattr(prepare_mod, "_union_prepare", counted)
    return calls


def stage_state(rank: int, step: int, *, extra: bool = False, dtype: Any = None) -> dict[str, Any]:
    """Rank ``rank``'s tree at ``step``: its stage's weights (ranks 0-1:
    stage 0, the others stage 1; equal within a stage), a step counter every
    rank holds alike, the rank's loader position and RNG state."""
    stage = 0 if rank < 2 else 1
    g = torch.Generator().manual_seed(100 * step + stage)
    w = torch.randn(3, 4, generator=g).to(dtype or torch.float32)
    model: dict[str, Any] = {f"layer{stage}": {"w": w}}
    if extra:
        model[f"layer{stage}"]["b"] = torch.full((4,), float(step))
    return {
        "model": model,
        "step": torch.tensor(float(step)),
        "loader": {"pos": 10 * step + rank},
        "rng": torch.full((5,), rank * 1000 + step, dtype=torch.int64),
    }


#: float32 elements of a large shared tensor: 1 MiB, whose proof a save
#: leaves to be done beside its write (deeppart.saving.deferred_proof.DEFER_FROM).
BIG = DEFER_FROM // 4


def big_state(rank: int, step: int, *, odd: bool = False, stage1: bool = True) -> dict[str, Any]:
    """:func:`stage_state` with a large tensor in its stage's weights (equal
    within a stage; on rank 1 one element off with ``odd``; none in stage
    1 without ``stage1``)."""
    state = stage_state(rank, step)
    stage = 0 if rank < 2 else 1
    if stage == 0 or stage1:
        big = torch.randn(BIG, generator=torch.Generator().manual_seed(7 * step + stage))
        if odd and rank == 1:
            big[BIG - 1] += 1.0
        state["model"][f"layer{stage}"]["big"] = big
    return state


@pytest.fixture
def proofs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """The deferred proofs' digests: per call, the thread and the bytes proved."""
    calls: list[tuple[str, int]] = []
    inner = deferred_proof._digest

    def recorded(p: Any, threads: int) -> Any:
        out = inner(p, threads)
        calls.append((threading.current_thread().name, p.nbytes))
        return out

    monkeypatch.setattr(deferred_proof, "_digest", recorded)
    return calls


def save_all(
    tmp_path: Path,
    name: str,
    states: list[dict[str, Any]],
    comms: Any = None,
    writing: deeppart.WriteOptions | None = None,
) -> list[Any]:
    comms = comms or thread_comms(len(states))

    def save_rank(r: int) -> Any:
        return deeppart.save(states[r], tmp_path / name, comm=comms[r], writing=writing)

    out = run_ranks([functools.partial(save_rank, r) for r in range(len(states))])
    errors = [e for _, e in out if e is not None]
    if errors:
        raise errors[0]
    return list(comms)


def load_all(tmp_path: Path, name: str, comms: list[Any]) -> list[Any]:
    def load_rank(r: int) -> Any:
        return deeppart.load(tmp_path / name, comm=comms[r])

    out = run_ranks([functools.partial(load_rank, r) for r in range(len(comms))])
    errors = [e for _, e in out if e is not None]
    if errors:
        raise errors[0]
    return [got for got, _ in out]


def assert_bitwise(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_bitwise(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert bytes(got.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
            want.contiguous().reshape(-1).view(torch.uint8).numpy()
        )
    else:
        assert got == want


def test_a_second_save_of_the_same_structure_reuses_the_union_and_loads_bitwise(
    tmp_path: Path, exchanges: list[int]
) -> None:
    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    assert sorted(exchanges) == [0, 1, 2, 3]  # the first save: the full path on every rank
    states = [stage_state(r, 2) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 1, 2, 3]  # the second: no exchange on any rank
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)
    # The first checkpoint is still its own step's.
    for r, got in enumerate(load_all(tmp_path, "a", comms)):
        assert_bitwise(got, stage_state(r, 1))


def test_a_copy_that_starts_to_differ_takes_the_full_path_and_keeps_each_ranks_own(
    tmp_path: Path, exchanges: list[int]
) -> None:
    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    states = [stage_state(r, 2) for r in range(4)]
    # Rank 3's step counter (every rank's copy was equal, stored once) differs now.
    states[3]["step"] = torch.tensor(7.0)
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3, 3]
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)
    # That union is cached in turn: the next save with that pattern reuses it.
    save_all(tmp_path, "c", states, comms)
    assert len(exchanges) == 8


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda r, s: stage_state(r, s, extra=(r == 2)), id="a new leaf"),
        pytest.param(
            lambda r, s: stage_state(r, s, dtype=torch.float64 if r < 2 else None), id="a dtype"
        ),
        pytest.param(
            lambda r, s: {**stage_state(r, s), "rng": torch.zeros(6, dtype=torch.int64)},
            id="a shape",
        ),
    ],
)
def test_a_changed_structure_takes_the_full_path_and_refreshes_the_cache(
    tmp_path: Path, exchanges: list[int], change: Callable[[int, int], dict[str, Any]]
) -> None:
    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    states = [change(r, 2) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3, 3]
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)
    states = [change(r, 3) for r in range(4)]
    save_all(tmp_path, "c", states, comms)
    assert len(exchanges) == 8  # the changed structure is the cached one now
    for got, want in zip(load_all(tmp_path, "c", comms), states, strict=True):
        assert_bitwise(got, want)


def test_a_rank_without_the_cache_sends_every_rank_down_the_full_path(
    tmp_path: Path, exchanges: list[int]
) -> None:
    """A stale union is never used: one rank that lost its cache (as a
    restarted process would) makes every rank exchange, not only itself."""
    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    del union_cache._CACHES[(2, 4)]
    states = [stage_state(r, 2) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3, 3]
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)


def test_the_cached_save_proves_large_copies_beside_its_write_on_every_rank(
    tmp_path: Path, exchanges: list[int], proofs: list[tuple[str, int]]
) -> None:
    """The large shared tensors of a save that reuses the union are proved
    after its stall (beside the write), as on the fast path: every rank
    joins that proof's agreement, stage 1's ranks too, which hold none."""
    comms = save_all(tmp_path, "a", [big_state(r, 1, stage1=False) for r in range(4)])
    assert sorted(exchanges) == [0, 1, 2, 3]
    assert proofs == []  # the full path proves them in its call
    states = [big_state(r, 2, stage1=False) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 1, 2, 3]  # the union reused
    assert sorted(proofs) == [("deeppart-proof", 0)] * 2 + [("deeppart-proof", 4 * BIG)] * 2
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)


def test_a_large_copy_that_starts_to_differ_is_found_by_the_deferred_proof(
    tmp_path: Path, exchanges: list[int], proofs: list[tuple[str, int]]
) -> None:
    """Replicas proved, not assumed: the row's check cannot see the large
    tensors (their digests are taken after the stall); their part of the
    check, summed by the deferred proof, finds rank 1's copy differs, and
    the save is prepared again by the full path: each rank gets back its
    own copy. That union is cached in turn."""
    comms = save_all(tmp_path, "a", [big_state(r, 1) for r in range(4)])
    states = [big_state(r, 2, odd=True) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert len(proofs) == 4 and all(n == 4 * BIG for _, n in proofs)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3, 3]  # prepared again after the proof
    back = load_all(tmp_path, "b", comms)
    assert not torch.equal(back[0]["model"]["layer0"]["big"], back[1]["model"]["layer0"]["big"])
    for got, want in zip(back, states, strict=True):
        assert_bitwise(got, want)
    states = [big_state(r, 3, odd=True) for r in range(4)]
    save_all(tmp_path, "c", states, comms)
    assert len(exchanges) == 8
    for got, want in zip(load_all(tmp_path, "c", comms), states, strict=True):
        assert_bitwise(got, want)


def test_declared_replicas_that_differ_are_refused_on_the_cached_path(
    tmp_path: Path, exchanges: list[int]
) -> None:
    """verify_replicas=True: a copy the cached union stores once that now
    differs fails the check, and the full path refuses it on every rank."""
    declared = deeppart.WriteOptions(verify_replicas=True)

    def state(r: int, step: int) -> dict[str, Any]:
        return {k: v for k, v in stage_state(r, step).items() if k != "rng"}  # no own tensor

    comms = save_all(tmp_path, "a", [state(r, 1) for r in range(4)], writing=declared)
    save_all(tmp_path, "b", [state(r, 2) for r in range(4)], comms, writing=declared)
    assert sorted(exchanges) == [0, 1, 2, 3]  # declared replicas reuse the union too
    states = [state(r, 3) for r in range(4)]
    states[1]["model"]["layer0"]["w"][0, 0] += 1.0
    with pytest.raises(deeppart.ReplicaMismatchError, match="layer0"):
        save_all(tmp_path, "c", states, comms, writing=declared)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert not (tmp_path / "c").exists()


def test_a_world_size_change_takes_the_full_path(tmp_path: Path, exchanges: list[int]) -> None:
    save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    # Three ranks: rank 0 and 1 hold the structure they held before.
    states = [stage_state(r, 2) for r in range(3)]
    comms = save_all(tmp_path, "b", states)
    assert sorted(exchanges) == [0, 0, 1, 1, 2, 2, 3]
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)


def _sharded(
    mesh_shape: list[int], mesh_ranks: list[int], dims: list[int]
) -> tuple[Described, list[Any]]:
    """A rank's description of one DTensor of 8 rows sharded over 2 ranks,
    with the layout it is sent by."""
    descs = [
        {"path": ["w", "<shard>", k], "dtype": "float32", "shape": [4, 4], "holders": [k]}
        for k in range(2)
    ]
    shards = [[k, [[[4 * k, 4 * k + 4]], [[0, 4]]]] for k in range(2)]
    rec = {"path": ["w"], "dtype": "float32", "shape": [8, 4], "ranks": [0, 1], "shards": shards}
    key = (tuple(mesh_shape), tuple(mesh_ranks))
    layout = (key, tuple(mesh_ranks), tuple(dims), ((0, "shard"),), (8, 4))
    return Described(descs, {"leaf": 0}, [rec], "c"), [layout]


def test_the_fingerprint_names_the_mesh_the_world_size_the_codec() -> None:
    fp = union_cache.structure_fingerprint
    d, layouts = _sharded([2], [0, 1], [0])
    base = fp(d, layouts, "none", "none", 2)
    assert base == fp(*_sharded([2], [0, 1], [0]), "none", "none", 2)
    assert base != fp(*_sharded([2], [1, 0], [0]), "none", "none", 2)  # another mesh
    assert base != fp(*_sharded([1, 2], [0, 1], [1]), "none", "none", 2)  # another mesh shape
    assert base != fp(d, layouts, "none", "none", 4)  # another world size
    assert base != fp(d, layouts, "zstd", "none", 2)  # another codec
    assert base != fp(d, layouts, "none", "auto", 2)  # another kind of group=
    # A record without its layout: the description with its shards.
    assert fp(d, [None], "none", "none", 2) != base


def test_the_check_sums_to_zero_only_when_every_copy_is_equal() -> None:
    from deeppart.state.union import Digests, Union, UnionItem

    items = [
        UnionItem(["a"], {}, [0, 1, 2], {0: 0, 1: 0, 2: 0}),
        UnionItem(["b"], {}, [1, 2], {1: 1, 2: 1}),
        UnionItem(["c"], {}, [0], {0: 1}),
    ]
    u = Union(items, None, [], [], 3)
    terms = [union_cache.check_terms(u, r) for r in range(3)]
    assert [len(t) for t in terms] == [1, 2, 2]  # "c" is rank 0's own: not checked

    def total(digests: list[Digests]) -> int:
        values = [union_cache.check_value(t, d) for t, d in zip(terms, digests, strict=True)]
        assert all(v is not None for v in values)
        return sum(int.from_bytes(v or b"", "little") for v in values) % union_cache.PRIME

    equal = [
        Digests(samples={0: "ab" * 16, 1: "cd" * 8}),
        Digests(samples={0: "ab" * 16, 1: "ef" * 16}),
        Digests(samples={0: "ab" * 16, 1: "ef" * 16}),
    ]
    assert total(equal) == 0
    equal[2].samples[1] = "ee" * 16
    assert total(equal) != 0
    equal[2].samples[1] = "ef" * 16
    equal[0].samples[0] = "aa" * 16
    assert total(equal) != 0
    # A leaf without a digest cannot be proved.
    assert union_cache.check_value(terms[1], Digests(samples={0: "ab" * 16})) is None


def test_a_cached_save_gathers_no_rank_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second save decides on the one sum of a fixed size: its prepare
    runs no agreement of per-rank rows (what grows with the ranks)."""
    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    from deeppart.agreement import agree as inner

    rows: list[int] = []

    def counted(c: Any, *args: Any, **kwargs: Any) -> Any:
        rows.append(c.rank)
        return inner(c, *args, **kwargs)

    monkeypatch.setattr(prepare_mod, "agree", counted)
    states = [stage_state(r, 2) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert rows == []
    for got, want in zip(load_all(tmp_path, "b", comms), states, strict=True):
        assert_bitwise(got, want)


def _column(tag: bytes, check: int = 0, late: int = 0) -> bytes:
    fp = b"\1" * union_cache.FINGERPRINT_BYTES
    return fp + tag + check.to_bytes(union_cache.CHECK_BYTES, "little") + bytes([late])


def test_the_sum_reuses_only_when_every_rank_has_the_same_union_and_the_checks_cancel() -> None:
    import numpy as np

    terms, agreed = union_cache.reuse_terms, union_cache.reuse_agreed
    tag, ident = bytes(range(1, 9)), bytes(range(16))
    p = union_cache.PRIME
    # Checks that cancel modulo the prime (each below it, as check_value makes them).
    checks = [p - 5, 7, p - 2]

    def total(rows: list[Any]) -> Any:
        return np.sum(np.stack(rows), axis=0, dtype=np.int64)

    good = [terms(False, _column(tag, c), 0, ident) for c in checks]
    assert agreed(total(good), 3) == (True, False, False)
    # A rank with another tag (another union, or its own structure changed: zeros).
    for other in (bytes(range(2, 10)), b"\0" * 8, tag[:7] + b"\x09"):
        rows = [*good[:2], terms(False, _column(other, checks[2]), 0, ident)]
        assert agreed(total(rows), 3)[0] is False, other
    # Checks that do not cancel: a copy differs.
    rows = [*good[:2], terms(False, _column(tag, checks[2] - 1), 0, ident)]
    assert agreed(total(rows), 3)[0] is False
    # Another store on one rank; a failed rank; a missing rank.
    rows = [*good[:2], terms(False, _column(tag, checks[2]), 0, bytes(16))]
    assert agreed(total(rows), 3)[0] is False
    rows = [*good[:2], terms(True, b"", 0, ident)]
    assert agreed(total(rows), 3)[0] is False
    assert agreed(total(good), 4)[0] is False
    # Late checks and local flags are reported from any rank.
    rows = [*good[:2], terms(False, _column(tag, checks[2], late=1), 1, ident)]
    assert agreed(total(rows), 3) == (True, True, True)
    # Limbs whose sums agree but whose values differ are told apart.
    a, b = bytes([1, 0] * 4), bytes([3, 0] * 4)
    rows = [terms(False, _column(x, 0), 0, ident) for x in (a, b, bytes([2, 0] * 4))]
    assert agreed(total(rows), 3)[0] is False


def test_the_cached_plan_is_reused_only_with_equal_in_process_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchanges: list[int]
) -> None:
    """The cached union's plan is the one a save planning in process with
    equal options would get (planning is deterministic): it is reused
    without a lookup; other options plan the union again."""
    from deeppart.saving import planning
    from deeppart.saving.plan_cache import plan as inner

    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    union = union_cache._CACHES[(0, 4)].manifest.fingerprint
    planned: list[str] = []

    def counted(manifest: Any, world: int, **kwargs: Any) -> Any:
        planned.append(manifest.fingerprint)
        return inner(manifest, world, **kwargs)

    monkeypatch.setattr(planning, "plan_in_process", counted)

    def save_with(name: str, step: int, options: Any) -> list[Any]:
        states = [stage_state(r, step) for r in range(4)]

        def save_rank(r: int) -> Any:
            return deeppart.save(states[r], tmp_path / name, comm=comms[r], planning=options)

        out = run_ranks([functools.partial(save_rank, r) for r in range(4)])
        assert [e for _, e in out] == [None] * 4
        return states

    states = save_with("b", 2, deeppart.PlanOptions())
    assert len(exchanges) == 4 and union not in planned  # reused, not looked up
    states = save_with("c", 3, deeppart.PlanOptions(algorithm="lpt"))
    assert union in planned  # other options: the union planned with them
    for got, want in zip(load_all(tmp_path, "c", comms), states, strict=True):
        assert_bitwise(got, want)


def test_a_snapshot_of_a_reused_union_keeps_its_template_and_its_own_bytes(
    tmp_path: Path, exchanges: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reused union's leaves are the cache's template with this rank's
    own in place (no copy of the template per save); an asynchronous save's
    snapshot of them (deeppart.saving.snapshot) takes the template itself as
    its leaves and stages this rank's own bytes, which later changes of the
    live tensors do not reach."""
    from deeppart.saving.snapshot import ShareSnapshot

    comms = save_all(tmp_path, "a", [stage_state(r, 1) for r in range(4)])
    reused: dict[int, Any] = {}
    inner = prepare_mod._try_cache

    def kept(own: Any, rank: int, *args: Any) -> Any:
        reused[rank] = inner(own, rank, *args)
        return reused[rank]

    monkeypatch.setattr(prepare_mod, "_try_cache", kept)
    states = [stage_state(r, 2) for r in range(4)]
    save_all(tmp_path, "b", states, comms)
    assert sorted(exchanges) == [0, 1, 2, 3]  # only the first save took the full path
    assert sorted(reused) == [0, 1, 2, 3] and all(r is not None for r in reused.values())
    for rank, reuse in reused.items():
        prep = reuse.prep
        assert isinstance(prep.leaves, union_cache.OverlaidLeaves)
        want = []
        for li, start, stop in prep.plan.rank_pieces(rank):
            leaf = prep.leaves[li]
            if leaf.tensor is None:
                want.append(bytes(leaf.encoded or b""))
            else:
                flat = leaf.tensor.reshape(-1)[start:stop].clone()
                want.append(bytes(flat.view(torch.uint8).numpy()))
        assert any(want), "this rank writes something"
        snap = ShareSnapshot()
        taken = snap.take(prep, rank)
        snap.issue()
        assert taken.leaves is prep.leaves.holding_nothing()
        assert all(lf.tensor is None and lf.encoded is None for lf in taken.leaves)
        for t in (states[rank]["rng"], *(lay["w"] for lay in states[rank]["model"].values())):
            t.fill_(-1)  # the live state changes after the snapshot
        if taken.staged_ready is not None:
            taken.staged_ready()
        assert [bytes(p.data) for p in taken.staged or []] == want
        snap.discard()


def test_overlaid_leaves_read_as_the_list_they_stand_for() -> None:
    from deeppart.state.state import FlatLeaf

    template = [FlatLeaf((f"p{k}",), None, None) for k in range(5)]
    own = {1: FlatLeaf(("p1",), None, b"x"), 4: FlatLeaf(("p4",), None, b"y")}
    leaves = union_cache.OverlaidLeaves(template, own)
    as_list = [own.get(k, lf) for k, lf in enumerate(template)]
    assert len(leaves) == 5 and list(leaves) == as_list
    assert [leaves[k] for k in range(5)] == as_list
    assert leaves[-1] is own[4] and leaves[-5] is template[0]
    assert leaves[1:5:2] == [own[1], template[3]] and leaves[4:] == [own[4]]
    with pytest.raises(IndexError):
        leaves[5]
    with pytest.raises(IndexError):
        leaves[-6]
    assert leaves.holding_nothing() is template  # shared, not copied
    assert list(union_cache.OverlaidLeaves(template, {})) == template
    with pytest.raises(IndexError, match="outside the template"):
        union_cache.OverlaidLeaves(template, {5: own[1]})


def test_an_async_save_over_ranks_in_one_process_saves_synchronously_and_says_why(
    tmp_path: Path,
) -> None:
    """Ranks as threads (a single-process communicator of size 4) have no
    dedicated writer communicator: an asynchronous save of their union
    saves synchronously, with a warning naming why, and loads bitwise
    (before, the writer was given the one-rank communicator, and the
    commit failed on every rank with an IndexError)."""
    comms = thread_comms(4)
    states = [stage_state(r, 1) for r in range(4)]

    def save_rank(r: int) -> Any:
        return deeppart.async_save(states[r], tmp_path / "a", comm=comms[r]).wait()

    with pytest.warns(deeppart.AsyncSaveWarning, match="no dedicated writer communicator"):
        out = run_ranks([functools.partial(save_rank, r) for r in range(4)])
    assert [e for _, e in out] == [None] * 4
    for got, want in zip(load_all(tmp_path, "a", list(comms)), states, strict=True):
        assert_bitwise(got, want)
