"""One rank of the DTensor tests (tests/state/test_dtensor.py), under
``python -m torch.distributed.run --nproc-per-node N --standalone`` (gloo,
CPU), or alone as one process without a process group:

    python tests/state/dtensor_worker.py SCENARIO DIR [LAYOUT ...]

A tiny MLP with uneven shards (30 and 7 rows over 4 ranks) and AdamW, on a
real FSDP2 / HSDP / tensor-parallel layout (:func:`build`), one training
step, then ``get_state_dict(model, opt)``: DTensors. Scenarios:

- ``save``: per layout, ``deeppart.save`` of that state to ``DIR/LAYOUT``
  and of its full state (``full_state_dict=True``, plain tensors) to
  ``DIR/LAYOUT-ref``; then loads ``DIR/LAYOUT`` into DTensors of the same
  layout and of meshes (1,4) and (4,1), checks every tensor bitwise against
  the reference and that ``set_state_dict`` takes the result; prints each
  checkpoint's slowest data file over the ideal (unique bytes / ranks);
- ``load2``: on 2 ranks, into FSDP over 2 ranks, bitwise;
- ``load3``: on 3 ranks, into FSDP over 3 ranks with the cooperative
  exchange, bitwise, each rank receiving only the rows it takes;
- ``load1``: in one process, ``deeppart.load`` without a target gives the
  reference's full tensors, and ``into=`` a plain model's state too;
- ``async``: ``deeppart.async_save`` of the DTensors, the shards overwritten
  right after the call; the checkpoint holds the values at the call;
- ``tolocal``: the shards passed as plain tensors (``to_local()``) fail on
  every rank with ReplicaMismatchError, nothing committed; then
  ``verify_replicas=True`` with one holder's copy of a shard changed;
- ``eight``: 8 ranks, HSDP (2,4) <-> (4,2), the bytes read and exchanged;
- ``mpi`` (under ``mpiexec``, mpi4py): a DTensor checkpoint loaded whole;
- ``s3``: FSDP2 state saved to and loaded from S3 (tests/storage/test_s3_mpi.py).

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from rank_output import print_line

import deeppart
from bench.dtensor import build, dcp_balance, deeppart_balance, make_model, sharded_state
from deeppart.loading import reshard
from deeppart.progress import last_stats

#: ``tpfsdp``: FSDP2 over a TP-parallelized module on a (2,2) mesh, whose
#: colwise weights torch places as ``_StridedShard`` (saved and loaded by
#: ``save``, ``load2`` and ``load1``; DCP's scenario runs the other four).
LAYOUTS = ("hsdp", "ddp2d", "fsdp", "tp", "tpfsdp")


def full_state(m: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def to_full(tree: Any) -> Any:
    """``tree`` with every DTensor gathered into a plain tensor (collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.full_tensor()
    if isinstance(tree, dict):
        return {k: to_full(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(to_full(v) for v in tree)
    return tree


def equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.shape} {b.shape}"
        assert torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
        ), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in a:
            equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            equal(x, y, f"{where}/{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def ok(name: str) -> None:
    r, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    print_line(f"OK {name} rank {r}/{n}")


def versions(tensors: dict[str, Any]) -> dict[str, int]:
    """Autograd's version counter of each tensor (a DTensor's local one)."""
    return {
        k: int(getattr(t, "_local_tensor", t)._version)
        for k, t in tensors.items()
        if isinstance(t, torch.Tensor)
    }


def check_into(layout: str, d: Path, ref: Any) -> None:
    """Loads ``d`` into a model built on ``layout`` (other values), bitwise."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    m, opt = build(layout, seed=7)
    target = sharded_state(m, opt)
    before = versions(target["model"])
    out = deeppart.load(d, into=target)
    equal(to_full(out), ref, f"{d.name}->{layout}")
    # Shards read straight into the local tensors count as in-place writes.
    after = versions(target["model"])
    assert all(after[k] > before[k] for k in before), f"{d.name}->{layout}: versions {after}"
    set_state_dict(m, opt, model_state_dict=out["model"], optim_state_dict=out["optim"])
    equal(to_full(sharded_state(m, opt)), ref, f"{d.name}->{layout} after set_state_dict")


def scenario_save(d: Path, layouts: list[str]) -> None:
    for layout in layouts:
        m, opt = build(layout, seed=1)
        state = sharded_state(m, opt)
        if layout == "tpfsdp":
            kinds = [type(p).__name__ for p in state["model"]["0.weight"].placements]
            assert kinds == ["_StridedShard", "Shard"], kinds
        deeppart.save(state, d / layout)
        deeppart.save(full_state(m, opt), d / f"{layout}-ref")
        ref = deeppart.load(d / f"{layout}-ref")
        for target in dict.fromkeys([layout, "fsdp", "ddp2d"]):
            check_into(target, d / layout, ref)
        if dist.get_rank() == 0:
            print_line(f"BALANCE {layout} {deeppart_balance(d / layout):.4f}")
    ok("save")


def scenario_s3(d: Path, layouts: list[str]) -> None:
    """FSDP2 (``fully_shard``) DTensors saved to ``$DEEPPART_TEST_S3_URL``
    (moto's S3 server, tests/storage/test_s3_mpi.py) and loaded into FSDP and a
    (2,2) mesh, bitwise; no stored byte read twice by the load."""
    url = f"{os.environ['DEEPPART_TEST_S3_URL']}/fsdp"
    m, opt = build("fsdp", seed=1)
    state = sharded_state(m, opt)
    saved = deeppart.save(state, url)
    ref = to_full(state)
    for layout in ("fsdp", "ddp2d"):
        m2, opt2 = build(layout, seed=7)
        out = deeppart.load(url, into=sharded_state(m2, opt2))
        equal(to_full(out), ref, f"s3 fsdp->{layout}")
        loaded = last_stats("load")
        assert loaded is not None and loaded.stored_bytes <= saved.stored_bytes, (loaded, saved)
    ok("s3")


def scenario_async(d: Path, layouts: list[str]) -> None:
    """``deeppart.async_save`` of DTensor state: each rank snapshots its
    share of its shards; the caller then overwrites every local shard, and
    the checkpoint still holds the values at the call."""
    from torch.distributed.tensor import DTensor

    for layout in layouts:
        m, opt = build(layout, seed=3)
        state = sharded_state(m, opt)
        deeppart.save(full_state(m, opt), d / f"{layout}-ref")
        handle = deeppart.async_save(state, d / f"{layout}-async")
        with torch.no_grad():
            for p in m.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.fill_(-1.0)
        handle.wait()
        ref = deeppart.load(d / f"{layout}-ref")
        check_into(layout, d / f"{layout}-async", ref)
    ok("async")


def dcp_into(layout: str, d: Path, ref: Any) -> None:
    """Stock dcp.load of ``d`` into a model built on ``layout``, bitwise."""
    m, opt = build(layout, seed=7)
    target = sharded_state(m, opt)
    dcp_load(target, checkpoint_id=str(d))
    equal(to_full(target), ref, f"{d.name}->{layout}")


def scenario_dcp(d: Path, layouts: list[str]) -> None:
    """Per layout: dcp.save with BalancedSavePlanner and with
    DefaultSavePlanner; stock dcp.load of the balanced one at the same
    layout, (1,4) and (4,1), bitwise against the reference."""
    from deeppart.integrations.dcp import BalancedSavePlanner

    for layout in layouts:
        m, opt = build(layout, seed=1)
        ref = to_full(sharded_state(m, opt))
        dcp_save(
            sharded_state(m, opt),
            checkpoint_id=str(d / f"{layout}-dcp"),
            planner=BalancedSavePlanner(),
        )
        dcp_save(sharded_state(m, opt), checkpoint_id=str(d / f"{layout}-dcpdefault"))
        for target in dict.fromkeys([layout, "fsdp", "ddp2d"]):
            dcp_into(target, d / f"{layout}-dcp", ref)
        if dist.get_rank() == 0:
            print_line(
                f"DCPBALANCE {layout} balanced {dcp_balance(d / f'{layout}-dcp', 4):.4f} "
                f"default {dcp_balance(d / f'{layout}-dcpdefault', 4):.4f}"
            )
    ok("dcp")


def scenario_balance(d: Path, layouts: list[str]) -> None:
    """The bench's 23 MB model + AdamW on each layout, saved with
    deeppart.save: prints the slowest rank's data bytes over the ideal."""
    for layout in layouts:
        m, opt = build(layout, seed=1, dims=(1000, 966, 1000))
        deeppart.save(sharded_state(m, opt), d / layout)
        if dist.get_rank() == 0:
            print_line(f"BALANCE {layout} {deeppart_balance(d / layout):.4f}")
    ok("balance")


class CountingReader:
    """A DCP FileSystemReader that counts the bytes its load plan reads."""

    @staticmethod
    def make(path: Path) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        class Reader(FileSystemReader):
            nbytes = 0

            def read_data(self, plan: Any, planner: Any) -> Any:
                for req in plan.items:
                    Reader.nbytes += self.storage_data[req.storage_index].length
                return super().read_data(plan, planner)

        return Reader(str(path))


def pieces_meeting(meta: Any, target: Any) -> Iterator[tuple[Any, Any, Any, int]]:
    """The stored shard pieces whose rows meet this rank's local shards of
    ``target`` (their boxes from torch's own
    ``compute_local_shape_and_global_offset``): each with its shard, the
    common box, and the elements in one row of the shard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from deeppart.regions import Region
    from deeppart.state.state import flatten

    records = {tuple(r.path): r for r in meta.dtensors}
    for lf in flatten(target)[0]:
        dt = lf.tensor
        if not isinstance(dt, DTensor):
            continue
        shape, offset = compute_local_shape_and_global_offset(
            dt.shape, dt.device_mesh, dt.placements
        )
        box = Region(tuple(((o, o + n),) for o, n in zip(offset, shape, strict=True)))
        for shard in records[tuple(lf.path)].shards:
            row = max(1, int(torch.Size(shard.region.shape[1:]).numel()))
            for p in meta.pieces:
                if p.leaf != shard.leaf:
                    continue
                common = shard.region.rows(p.start // row, -(-p.stop // row)).intersect(box)
                if common is not None:
                    yield shard, p, common, row


def needed_bytes(d: Path, target: Any) -> int:
    """The raw bytes of the stored shard pieces whose rows meet this rank's
    local shards of ``target`` (:func:`pieces_meeting`)."""
    from deeppart.loading.reader import open_checkpoint

    _, meta, _ = open_checkpoint(d)
    return sum(p.length for _, p, _, _ in pieces_meeting(meta, target))


@contextlib.contextmanager
def exchanges(module: Any = None) -> Iterator[list[tuple[Any, Any]]]:
    """The plan and metadata of each shard exchange in the loads within,
    as ``exchange_shards`` got them (``module``: the caller's module,
    default :mod:`deeppart.loading.load`); the plan's ``received`` is what
    it received."""
    from unittest import mock

    from deeppart.loading import load as load_module

    calls: list[tuple[Any, Any]] = []
    where = load_module if module is None else module
    with mock.patch.object(where, "exchange_shards", wraps=reshard.exchange_shards) as spy:
        yield calls
    calls.extend((call.args[1], call.args[2]) for call in spy.call_args_list)


def read_by(sr: Any) -> set[tuple[int, int]]:
    """The stored pieces (data file, offset) that a plan's rank read (or
    held)."""
    return {(p.rank, p.offset) for pieces in sr.mine.values() for p in pieces}


def received_bytes(meta: Any, target: Any, read: set[tuple[int, int]]) -> tuple[int, int]:
    """What this rank should receive of the stored shard pieces whose rows
    meet its local shards of ``target`` (:func:`pieces_meeting`) and that
    it did not read itself: the bytes of each piece's elements in the rows
    the box takes (the boxes here take whole rows), and the bytes of those
    pieces whole."""
    parts = wholes = 0
    for shard, p, common, row in pieces_meeting(meta, target):
        if (p.rank, p.offset) in read:
            continue
        assert common.shape[1:] == shard.region.shape[1:], "a box cutting rows"
        rows = shard.region.positions(common)[0].tolist() if common.runs else [0]
        taken = sum(max(0, min((k + 1) * row, p.stop) - max(k * row, p.start)) for k in rows)
        parts += taken * meta.leaves[p.leaf].itemsize
        wholes += p.length
    return parts, wholes


def cooperative_load(d: Path, target: Any) -> tuple[Any, Any, list[tuple[Any, Any]]]:
    """``deeppart.load`` of ``d`` into ``target`` with ``exchange="bcast"``:
    the state, the load's stats and its shard exchanges (:func:`exchanges`)."""
    with exchanges() as calls:
        out = deeppart.load(d, into=target, loading=deeppart.LoadOptions(exchange="bcast"))
    stats = last_stats("load")
    assert stats is not None
    return out, stats, calls


def check_exchange(d: Path, target: Any, stats: Any, calls: list[tuple[Any, Any]]) -> int:
    """Each rank received exactly the bytes of the rows its local shards
    take of the stored pieces it did not read itself (not those pieces
    whole), and no rank received every piece that others read (the
    exchange stays within each replica group, not a broadcast). Returns
    the bytes of those pieces whole less what was received."""
    r = dist.get_rank()
    [(sr, meta)] = calls
    parts, wholes = received_bytes(meta, target, read_by(sr))
    assert stats.rank_received[r] == parts, (r, stats.rank_received[r], parts, wholes)
    total = sum(stats.rank_shard_read)
    assert all(
        got < total - mine
        for got, mine in zip(stats.rank_received, stats.rank_shard_read, strict=True)
    ), stats
    if r == 0:
        print_line(
            f"EXCHANGE {d.name} received "
            + " ".join(map(str, stats.rank_received))
            + f" of {total}"
        )
    return wholes - parts


def scenario_eight(d: Path, layouts: list[str]) -> None:
    """8 ranks: HSDP (2,4) saved and loaded at (4,2), and the reverse,
    bitwise; the bytes read from storage (the reader's counters, over all
    ranks) against the checkpoint's size, and what stock dcp.load reads in
    the same case."""
    for src, dst in (("hsdp24", "hsdp"), ("hsdp", "hsdp24")):
        m, opt = build(src, seed=1)
        ref = to_full(sharded_state(m, opt))
        saved = deeppart.save(sharded_state(m, opt), d / src)
        m2, opt2 = build(dst, seed=7)
        # The default on one host: each rank reads the stored pieces its
        # shards need itself, nothing is exchanged.
        out = deeppart.load(d / src, into=sharded_state(m2, opt2))
        equal(to_full(out), ref, f"{src}->{dst} (own reads)")
        own = last_stats("load")
        assert own is not None and not any(own.rank_received), own
        assert own.rank_shard_read[dist.get_rank()] == needed_bytes(
            d / src, sharded_state(m2, opt2)
        ), own
        # Cooperative (exchange="bcast", the default across hosts): each
        # piece read once per job, sent to the other ranks that need it.
        out, stats, calls = cooperative_load(d / src, sharded_state(m2, opt2))
        equal(to_full(out), ref, f"{src}->{dst}")
        ratio = stats.stored_bytes / saved.stored_bytes
        assert ratio <= 1.05, (stats.stored_bytes, saved.stored_bytes)
        check_exchange(d / src, sharded_state(m2, opt2), stats, calls)
        dcp_save(sharded_state(m, opt), checkpoint_id=str(d / f"{src}-dcp"))
        target = sharded_state(m2, opt2)
        reader = CountingReader.make(d / f"{src}-dcp")
        dcp_load(target, storage_reader=reader)
        equal(to_full(target), ref, f"{src}-dcp->{dst}")
        counts = torch.tensor([float(type(reader).nbytes)])
        dist.all_reduce(counts)
        data = sum(p.stat().st_size for p in (d / f"{src}-dcp").glob("*.distcp"))
        if dist.get_rank() == 0:
            print_line(f"READ {src}->{dst} deeppart {ratio:.4f} dcp {float(counts[0]) / data:.4f}")
    ok("eight")


def scenario_load3(d: Path, layouts: list[str]) -> None:
    """On 3 ranks: each 4-rank checkpoint into FSDP2 over 3 ranks with the
    cooperative exchange (``exchange="bcast"``), bitwise; each rank
    received only the rows its new shards take of the pieces others read
    (:func:`check_exchange`), less than those pieces whole on some rank
    (30 rows as 8, 8, 7, 7 saved, 10, 10, 10 loaded)."""
    for layout in layouts:
        ref = deeppart.load(d / f"{layout}-ref")
        m, opt = build("fsdp", seed=7)
        out, stats, calls = cooperative_load(d / layout, sharded_state(m, opt))
        equal(to_full(out), ref, f"{layout}->fsdp on 3 ranks")
        assert stats.world_size == 3, stats
        saved_whole = torch.tensor(
            [float(check_exchange(d / layout, sharded_state(m, opt), stats, calls))]
        )
        dist.all_reduce(saved_whole)
        assert saved_whole.item() > 0, "every piece crossed whole"
        if dist.get_rank() == 0:
            print_line(f"PARTS {layout} not sent {int(saved_whole.item())} bytes")
    ok("load3")


def scenario_load2(d: Path, layouts: list[str]) -> None:
    for layout in layouts:
        ref = deeppart.load(d / f"{layout}-ref")
        check_into("fsdp", d / layout, ref)
        if (d / f"{layout}-dcp").exists():
            dcp_into("fsdp", d / f"{layout}-dcp", ref)
    ok("load2")


def scenario_load1(d: Path, layouts: list[str]) -> None:
    for layout in layouts:
        ref = deeppart.load(d / f"{layout}-ref")
        equal(deeppart.load(d / layout), ref, f"{layout} without into")
        m = make_model(9)
        into = {"model": m.state_dict(), "optim": deeppart.load(d / f"{layout}-ref")["optim"]}
        for t in into["optim"]["state"].values():
            for v in t.values():
                v.zero_()
        out = deeppart.load(d / layout, into=into)
        equal(out, ref, f"{layout} into a plain model")
        assert out["model"]["0.weight"] is into["model"]["0.weight"]
        if (d / f"{layout}-dcp").exists():
            plain = deeppart.load(d / f"{layout}-ref")
            for t in plain["model"].values():
                t.zero_()
            dcp_load(plain, checkpoint_id=str(d / f"{layout}-dcp"), no_dist=True)
            equal(plain, ref, f"{layout}-dcp in one process")
    ok("load1")


def scenario_tolocal(d: Path, layouts: list[str]) -> None:
    from torch.distributed.tensor import DTensor

    for layout in layouts:
        m, opt = build(layout, seed=1)
        state = sharded_state(m, opt)

        def local(t: Any) -> Any:
            if isinstance(t, DTensor):
                return t.to_local()
            if isinstance(t, dict):
                return {k: local(v) for k, v in t.items()}
            if isinstance(t, list):
                return [local(v) for v in t]
            return t

        # Issue 32: shards of equal shapes on ranks of one structure are
        # declared replicas, refused naming to_local(); shards of different
        # shapes are each rank's own state, and each rank loads its own back.
        try:
            deeppart.save(local(state), d / f"{layout}-local")
        except deeppart.StateMismatchError as e:  # or its ReplicaMismatchError
            assert "to_local()" in str(e), str(e)
            assert not (d / f"{layout}-local").exists()
        else:
            equal(local(state), deeppart.load(d / f"{layout}-local"), f"{layout}-local")
        assert not any(p.name.startswith(".tmp-") for p in d.iterdir())
    # full_state_dict + cpu_offload: the values are on rank 0 only.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    m, opt = build(layouts[0], seed=1)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(m, opt, options=opts)
    # Issue 32: rank 0's full values and the others' empty trees are each
    # rank's own state: refused where the trees do not merge (naming the
    # path), else each rank loads back what it passed.
    saved = {"model": msd, "optim": osd}
    try:
        deeppart.save(saved, d / "offload")
    except deeppart.StateMismatchError as e:
        assert "nothing was written" in str(e), str(e)
        assert not (d / "offload").exists()
    else:
        equal(saved, deeppart.load(d / "offload"), "offload")
    scenario_verify(d, layouts[0])
    ok("tolocal")


def scenario_verify(d: Path, layout: str) -> None:
    """``verify_replicas=True`` compares each DTensor shard across its
    holders: equal replicas save; one holder's copy of a shard changed (rank
    2, which holds shard 0 with rank 0 in HSDP (2,2)) raises on every rank,
    naming the shard, and nothing is committed."""
    from torch.distributed.tensor import DTensor

    m, opt = build(layout, seed=1)
    state = sharded_state(m, opt)
    deeppart.save(state, d / "verified", writing=deeppart.WriteOptions(verify_replicas=True))
    assert (d / "verified" / "COMMITTED").exists()
    weight = state["model"]["2.weight"]
    assert isinstance(weight, DTensor)
    if dist.get_rank() == 2:
        with torch.no_grad():
            weight.to_local().view(-1)[-1] += 1.0
    try:
        deeppart.save(state, d / "differs", writing=deeppart.WriteOptions(verify_replicas=True))
    except deeppart.ReplicaMismatchError as e:
        msg = str(e)
        assert "2.weight" in msg and "nothing was written" in msg, msg
        assert "ranks [0] hold one version, ranks [2] another" in msg, msg
    else:
        raise AssertionError("a shard whose replicas differ saved with verify_replicas=True")
    assert not (d / "differs").exists()
    assert not any(p.name.startswith(".tmp-") for p in d.iterdir())


def main() -> None:
    scenario, d, *layouts = sys.argv[1:]
    if scenario == "mpi":
        mpi_main()
        return
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    try:
        globals()[f"scenario_{scenario}"](Path(d), layouts or list(LAYOUTS))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def mpi_main() -> None:
    """Under ``mpiexec -n K`` (mpi4py, no torch.distributed): loads the
    DTensor checkpoint ``DIR/LAYOUT`` without a target on every rank,
    bitwise against ``DIR/LAYOUT-ref``; each stored shard piece is read by
    one rank and sent to the others point to point."""
    from mpi4py import MPI

    d, layout = Path(sys.argv[2]), sys.argv[3]
    ref = deeppart.load(d / f"{layout}-ref")
    out = deeppart.load(
        d / layout, comm=MPI.COMM_WORLD, loading=deeppart.LoadOptions(exchange="bcast")
    )
    equal(out, ref, f"{layout} over MPI")
    stats = last_stats("load")
    assert stats is not None and stats.world_size == MPI.COMM_WORLD.Get_size(), stats
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    total = sum(stats.rank_shard_read)
    # Every rank needs every piece here: what it did not read, it received.
    assert stats.rank_received[rank] == total - stats.rank_shard_read[rank] > 0, stats
    # A failure while one rank packs (rank 1) or unpacks (rank 2) a message
    # of the shard exchange: every rank raises it, none waits for the rest.
    assert stats.rank_shard_read[1] > 0, stats
    for name, bad in (("_pack", 1), ("_unpack", 2)):
        real = getattr(reshard, name)

        def fail(*args: Any, _name: str = name) -> Any:
            raise deeppart.CorruptCheckpointError(f"injected failure in {_name}")

        if rank == bad:
            setattr(reshard, name, fail)
        try:
            deeppart.load(
                d / layout, comm=MPI.COMM_WORLD, loading=deeppart.LoadOptions(exchange="bcast")
            )
        except deeppart.CorruptCheckpointError as e:
            assert f"injected failure in {name}" in str(e), e
        else:
            raise AssertionError(f"a failure in reshard.{name} on rank {bad} was not raised")
        finally:
            setattr(reshard, name, real)
    print_line(f"OK mpi rank {rank}/{size}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["mpi"]:
        main()  # under mpiexec: mpi4py's MPI_Finalize runs at exit
    else:
        from mpi_checkpoint import run_then_exit

        run_then_exit(main)
