"""Multi-rank scenarios of typed values, flexible restore, the replica
check and each rank's own values (``per_rank``), run as ``mpiexec -n K
python tests/state/mpi_values.py SCENARIO DIR`` (by tests/state/test_values_mpi.py);
each rank prints ``OK SCENARIO rank r/n``."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import deeppart
from deeppart.comm import resolve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from mpi_checkpoint import assert_bitwise_equal, make_state, ok


def scenario_replicas(d: Path) -> None:
    """The last rank changes one element of one leaf: every rank names that
    leaf and which ranks hold which version, and nothing is written; a
    plain value that differs is each rank's own (issue 32: stored per
    rank, each rank loads its own); the same state unchanged saves with
    the check."""
    c = resolve()
    state = make_state()
    name = next(iter(state["model"]))
    if c.rank == c.size - 1:
        state["model"][name].view(-1)[3] += 1.0
    try:
        deeppart.save(state, d / "bad", writing=deeppart.WriteOptions(verify_replicas=True))
    except deeppart.ReplicaMismatchError as e:
        msg = str(e)
        others = list(range(c.size - 1))
        want = f"model/{name}: ranks {others} hold one version, ranks [{c.size - 1}] another"
        assert want in msg, msg
        assert "1 tensor leaves differ" in msg and "majority" not in msg, msg
    else:
        raise AssertionError("no error raised")
    assert not (d / "bad").exists(), "nothing may be written"
    # A plain value that differs is this rank's own: stored per rank.
    state = make_state()
    state["step"] = 10 + (c.rank == 0)
    deeppart.save(state, d / "own", writing=deeppart.WriteOptions(verify_replicas=True))
    assert deeppart.load(d / "own")["step"] == 10 + (c.rank == 0)
    state = make_state()
    deeppart.save(state, d / "good", writing=deeppart.WriteOptions(verify_replicas=True))
    assert_bitwise_equal(state, deeppart.load(d / "good"))
    ok("replicas")


def scenario_values(d: Path) -> None:
    """numpy/torch values and random states across ranks; a subset read
    with keys=, and into= with strict=False, on every rank."""
    random.seed(5)
    np.random.seed(5)
    state = make_state()
    state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state()}
    state["values"] = {
        "dtype": torch.float16,
        "size": torch.Size([3, 4]),
        "big": np.arange(100_000, dtype=np.float32),
    }
    deeppart.save(state, d)
    for exchange in ("bcast", "read"):
        got = deeppart.load(d, loading=deeppart.LoadOptions(exchange=exchange))
        assert got["values"]["dtype"] is torch.float16
        assert type(got["values"]["size"]) is torch.Size
        assert np.array_equal(got["values"]["big"], state["values"]["big"])
        np.random.set_state(got["rng"]["numpy"])
        random.setstate(got["rng"]["python"])
        expect_np, expect_py = np.random.rand(3), random.random()
        np.random.set_state(state["rng"]["numpy"])
        random.setstate(state["rng"]["python"])
        assert np.array_equal(np.random.rand(3), expect_np) and random.random() == expect_py
        part = deeppart.load(d, keys=["model"], loading=deeppart.LoadOptions(exchange=exchange))
        assert list(part) == ["model"]
        assert_bitwise_equal(state["model"], part["model"])
        into = {"model": make_state(seed=1)["model"], "extra": torch.zeros(2)}
        deeppart.load(d, into=into, strict=False, loading=deeppart.LoadOptions(exchange=exchange))
        keys = deeppart.last_incompatible_keys()
        assert keys is not None and keys.missing_keys == ["extra"], keys
        assert_bitwise_equal(state["model"], into["model"])
    ok("values")


def per_rank_state(rank: int, own_tensor: bool = False) -> dict[str, Any]:
    """A model (the same on every rank) beside each rank's own data-loader
    position and RNG state bytes; ``own_tensor``: also a buffer of the
    model's that differs per rank (``model/own``: saved with
    ``group="auto"``)."""
    torch.manual_seed(0)
    model: dict[str, Any] = dict(torch.nn.Linear(5, 3).state_dict())
    if own_tensor:
        model["own"] = torch.full((4,), float(rank))
    return {
        "model": model,
        "loader": {"epoch": 2, "batches_seen": 100 + rank},
        "rng": bytes([rank + 1] * 16),
    }


def scenario_per_rank(d: Path) -> None:
    """Checkpoints of each rank's own values, for tests/state/test_values_mpi.py
    to use model-only at another world size: ``root`` through a
    Checkpointer (step 5), ``own`` with a per-rank model buffer
    (``group="auto"``). Each rank loads its own back here."""
    c = resolve()
    cp = deeppart.Checkpointer(d / "root")
    cp.save(5, per_rank_state(c.rank))
    assert_bitwise_equal(per_rank_state(c.rank), cp.load())
    deeppart.save(per_rank_state(c.rank, own_tensor=True), d / "own", group="auto")
    assert_bitwise_equal(per_rank_state(c.rank, own_tensor=True), deeppart.load(d / "own"))
    ok("per_rank")


#: Elements of the large tensor of ``own_tensors``: 4 MiB of float32.
BIG = 1 << 20


def own_tensor_state(rank: int, loader: int | None, where: str, rng: bool) -> dict[str, Any]:
    """A model every rank holds alike, a large tensor that differs between
    the ranks in one element only (``where``: ``"inside"``, an element
    that no sample reads, a quarter into it; ``"last"``: its last byte),
    with ``rng`` the CPU RNG state of a per-rank seed (5,056 bytes: small)
    and, unless ``loader`` is None, a loader position ``loader + rank``."""
    g = torch.Generator().manual_seed(7)
    big = torch.randn(BIG, generator=g)
    if rank == 1:
        if where == "inside":
            big[BIG // 4 + 3] += 1.0
        else:
            big.view(torch.uint8)[-1] ^= 0x01
    state: dict[str, Any] = {
        "model": {"w": torch.randn(256, 64, generator=g), "b": torch.zeros(64)},
        "big": big,
    }
    if rng:
        torch.manual_seed(1000 + rank)
        state["rng"] = torch.get_rng_state()
    if loader is not None:
        state["loader"] = {"pos": loader + rank}
    return state


def _own_roundtrip(d: Path, cases: list[tuple[int | None, str]], rng: bool) -> None:
    """Each case saved by deeppart.save and by a Checkpointer (without
    config=, synchronous and async_=True): every rank gets exactly its own
    state back, bitwise; only the paths that differ have versions (the
    model every rank holds alike stays one item)."""
    import json

    c = resolve()
    for k, (loader, where) in enumerate(cases):
        state = own_tensor_state(c.rank, loader, where, rng)
        name = f"{loader}-{where}"
        stats = deeppart.save(state, d / name)
        # The large tensors were proved beside the write: copies that differ
        # made the save abandon what it wrote and save the union; nothing of
        # the abandoned try is left.
        assert not [p.name for p in d.iterdir() if p.name.startswith(".")], list(d.iterdir())
        assert stats.raw_bytes >= 2 * state["big"].numel() * 4, (name, stats.raw_bytes)
        back = deeppart.load(d / name)
        assert_bitwise_equal(state, back, name)
        assert torch.equal(back["big"], state["big"]), name
        if c.rank == 0:
            meta = json.loads((d / name / "metadata.json").read_text())
            kept = sorted(v["path"][0] for v in meta.get("versions", []))
            want = ["big"] + ["rng"] * rng + ["loader"] * (loader is not None)
            assert kept == sorted(want), (name, kept)
        if rng:
            torch.set_rng_state(back["rng"])
            got = torch.rand(4)
            torch.set_rng_state(state["rng"])
            assert torch.equal(got, torch.rand(4)), name
        for async_ in (False, True):
            cp = deeppart.Checkpointer(d / f"cp-{name}-{async_}", async_=async_)
            h = cp.save(k, state)
            if async_:
                assert isinstance(h, deeppart.AsyncSave), h
                h.wait()
            assert_bitwise_equal(state, cp.load(), f"{name} Checkpointer(async_={async_})")
            cp.close()
        c.barrier()


def scenario_own_tensors(d: Path) -> None:
    """Issue 49, item 4, on 2 ranks: a large tensor that differs in one
    element that no sample reads is each rank's own, whatever the loader
    positions (100/101: one structure; 99/100: the encodings' sizes differ;
    none at all). Declared replicas (verify_replicas=True) refuse the
    difference instead, naming it."""
    c = resolve()
    assert c.size == 2
    _own_roundtrip(d, [(100, "inside"), (99, "inside"), (None, "inside")], rng=False)
    state = own_tensor_state(c.rank, 100, "inside", rng=False)
    try:
        deeppart.save(state, d / "declared", writing=deeppart.WriteOptions(verify_replicas=True))
    except deeppart.ReplicaMismatchError as e:
        msg = str(e)
        assert "big: ranks [0] hold one version, ranks [1] another" in msg, msg
        assert "nothing was written" in msg, msg
    else:
        raise AssertionError("verify_replicas=True saved replicas that differ")
    assert not (d / "declared").exists()
    ok("own_tensors")


def scenario_own_rng(d: Path) -> None:
    """Issue 49, item 5, on 2 ranks: torch.get_rng_state() of a per-rank
    seed, beside a large tensor that differs in its last byte, with and
    without per-rank loader positions: each rank gets its own RNG state and
    tensor back, and torch.set_rng_state takes it."""
    assert resolve().size == 2
    _own_roundtrip(d, [(None, "last"), (100, "last"), (99, "last")], rng=True)
    ok("own_rng")


def scenario_deferred_proof(d: Path, levels: bool = False) -> None:
    """Issue 49, the async stall: an asynchronous save proves its large
    shared tensors on its writer thread, not in its call. ``levels``: the
    same through the multi-level engine (issue 48:
    ``Checkpointer(config=..., async_=True)``, 2 fake nodes, a partner
    copy each save), whose asynchronous saves proved them in the call.

    1. Replicas alike: the proof ran after the call returned (held by a
       patched digest until the main thread let it go); the optimizer step
       taken right after the save waited for it (the proof was done when
       the step returned), and the checkpoint holds the state before that
       step, bitwise.
    2. A large tensor that differs on rank 1 (one element): the proof finds
       it and the save is prepared again on the writer thread: each rank
       gets its own copy back.
    3. An in-place change outside an optimizer step while the proof runs:
       every rank's wait() raises StateMismatchError naming the tensor, and
       the step is not committed."""
    import threading

    from mpi_checkpoint import host_copy

    from deeppart.saving import digests

    c = resolve()
    assert c.size == 2
    proceed = threading.Event()
    proving = threading.Event()
    real = digests.digest_all

    def held_digest(tensors: Any, threads: int) -> list[bytes]:
        proving.set()
        assert proceed.wait(120), "the main thread never let the proof go"
        return real(tensors, threads)

    digests.digest_all = held_digest
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight: proved on the writer thread
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 1024)).sum().backward()
    if levels:
        from deeppart.levels import LevelConfig

        config = LevelConfig.from_dict(
            {
                "ckpt_dir": str(d / "local"),
                "meta_dir": str(d / "meta"),
                "glbl_dir": str(d / "global"),
                "node_size": 1,
                "group_size": 2,
                "ckpt_l1": 1,
                "ckpt_l2": 1,
                "local_test": 1,
                "keep": 10,
            }
        )
        cp = deeppart.Checkpointer(d / "unused", async_=True, config=config)
    else:
        cp = deeppart.Checkpointer(d / "cp", async_=True)

    # 1. The proof runs after the call; the next optimizer step waits for it.
    state = {"model": model.state_dict()}
    before = host_copy(state)
    h = cp.save(1, state)
    assert isinstance(h, deeppart.AsyncSave) and h.proof is not None, h
    assert proving.wait(120), "no proof on the writer thread"
    assert not h.proof.done.is_set()
    releaser = threading.Timer(0.3, proceed.set)
    releaser.start()
    opt.step()  # waits for the proof (the hook), which waits for the timer
    assert h.proof.done.is_set(), "the optimizer step did not wait for the proof"
    h.wait()
    assert h.proof.nbytes == 1024 * 512 * 4, h.proof.nbytes
    assert_bitwise_equal(before, cp.load(1), "the state at the save call")

    # 2. Copies that differ: each rank's own, prepared again in the background.
    big = torch.randn(1 << 19, generator=torch.Generator().manual_seed(3))
    if c.rank == 1:
        big[12345] += 1.0
    state2 = {"model": model.state_dict(), "big": big}
    expected = host_copy(state2)
    h = cp.save(2, state2)
    assert isinstance(h, deeppart.AsyncSave) and h.proof is not None
    h.wait()
    back = cp.load(2)
    assert_bitwise_equal(expected, back, "each rank's own big")

    # 3. Changed in place outside an optimizer step while proved: refused.
    proceed.clear()
    proving.clear()
    h = cp.save(3, state2)
    assert isinstance(h, deeppart.AsyncSave)
    assert proving.wait(120)
    big.add_(1.0)  # no optimizer step: nothing waits for the proof
    proceed.set()
    try:
        h.wait()
    except deeppart.StateMismatchError as e:
        assert "changed in place" in str(e) and "big" in str(e), e
    else:
        raise AssertionError("a tensor changed under the proof was saved")
    cp.close()
    assert cp.steps() == [1, 2], cp.steps()
    digests.digest_all = real
    ok("deferred_proof_levels" if levels else "deferred_proof")


def scenario_deferred_proofs(d: Path) -> None:
    """One job: the plain Checkpointer's deferred proof, then the
    multi-level engine's."""
    scenario_deferred_proof(d / "plain")
    scenario_deferred_proof(d / "levels", levels=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "scenario",
        choices=["replicas", "values", "per_rank", "own_tensors", "own_rng", "deferred_proof"],
    )
    p.add_argument("dir", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    scenarios = {
        "replicas": scenario_replicas,
        "values": scenario_values,
        "per_rank": scenario_per_rank,
        "own_tensors": scenario_own_tensors,
        "own_rng": scenario_own_rng,
        "deferred_proof": scenario_deferred_proofs,
    }
    scenarios[args.scenario](args.dir)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
