"""The exchange of ``deeppart.save``'s prepare stage: what the ranks send each
other to learn what every rank holds (issue 32), measured on 8 ranks and
computed for a 70B model on 4,096 ranks.

    .venv/bin/python bench/exchange.py                   # both parts
    .venv/bin/python bench/exchange.py --part measured   # 8 MPI ranks only (a minute)
    .venv/bin/python bench/exchange.py --part computed --bytes-only   # 4,096 ranks' payloads
    .venv/bin/python bench/exchange.py --part computed --dp 8         # 512 ranks, with the merge
                                                                      # and DCP's planning

At the default 4,096 ranks the computed part takes minutes of CPU and
several GB of memory (over 7 GB once rank 0 merges); ``--bytes-only``
makes every rank's payload (about 2 CPU minutes, 3 GB) without rank 0's
merge.

The exchange (:func:`deeppart.saving.prepare.prepare_save`): one sum over
the ranks of 288 bytes (whether every rank reuses its cached union,
:func:`deeppart.saving.union_cache.reuse_agreed`), then one agreement of a
122-byte row per rank (structure digest, sampled-tensor and plain-value
digests, a flag, the digest of the store the rank addresses, the union
cache's column: :mod:`deeppart.saving.union_cache`); when the
ranks' structures differ (pipeline stages) one ``allgather_varbytes`` in
which the lowest rank of each distinct structure sends its description
(:func:`deeppart.state.union.encode_described`: each DTensor by its layout,
JSON) and the digests of its plain values, and every rank the digests of
the shared tensors it is the reference holder of and one digest of the
others; a second ``allgather_varbytes`` (when some rank's plain values
differ from its structure's lowest rank's, or some digest did not match)
carries those leaf by leaf; every rank then builds the same union
manifest and plans it, and a last agreement of a 33-byte row checks that.
A load with DTensor targets exchanges too
(:func:`deeppart.loading.reshard.plan_shard_reads`: every rank's needed regions).
A second save of the same structure reuses the first's union and plan
(the sum only: a ring allreduce receives about twice its 288 bytes,
whatever the ranks; reported after the first), and its rank's own
description (:mod:`deeppart.saving.own_structure`: no DTensor expanded again).

**measured** (``--part measured``): ``mpiexec -n 8`` ranks of this file,
gloo initialised beside MPI, a torchtitan-like Llama stage per pipeline
stage on a ``(pp, dp, tp) = (2, 2, 2)`` mesh: ``parallelize_module``
(colwise / rowwise / sequence-parallel norms) on ``mesh["tp"]``, then
FSDP2 ``fully_shard`` on ``mesh["dp"]``, AdamW after one step, a LambdaLR
scheduler, a per-rank data-loader position and RNG state (as
tests/state/own_state_worker.py). Tiny tensors: the point is the descriptions.
``deeppart.save`` and ``deeppart.load(into=)`` run on a communicator that
counts each collective (bytes this rank contributes, bytes it gathers from
the others, seconds), labelled by the DeepPart function that called it.

**computed** (``--part computed``): the same code
(:func:`~deeppart.saving.prepare.prepare_save` and everything it calls) on one
process for rank 0 of a 4,096-rank job, a Llama-3-70B-like model (80
layers, hidden 8192, FFN 28672, vocabulary 128256, 64 heads, 8 KV heads;
fp32 parameters and AdamW's two moments, as torchtitan keeps them) laid
out PP 8 x FSDP 64 x TP 8 with torchtitan's placements, as real DTensors
on a ``fake`` process group (no data: each local shard is a zero-stride
view). Only the transport is simulated: the other ranks' contributions
are made by the same code (each stage's lowest rank runs the whole prepare
of its own tree; every other rank's digests come from
:func:`deeppart.saving.prepare.digest_held` over the leaves it holds, and its
payload from the same ``_payload``). Reported: the bytes each rank sends
and gathers, the CPU seconds of each local phase on one process (every
rank does the same work in parallel), and the collectives' time under a
ring-allgather model, ``(p - 1) * latency + gathered bytes / bandwidth`` (defaults: 5 us,
25 GB/s per rank, one 200 Gb/s NIC; ``--latency-us``, ``--bandwidth-gbs``).

**DCP beside it** (``--dcp``; on by default at up to 512 ranks, ``--no-dcp``
to leave it out): ``torch.distributed.checkpoint``'s planning of the same
save, on the same states (each rank's real DTensors, on its own ``fake``
process group): every rank's local step of DCP's ``_save_state_dict``
(``DefaultSavePlanner(enable_plan_caching=True)`` and ``FileSystemWriter``:
``set_up_planner``, ``create_local_plan``, ``prepare_local_plan``), its
``SavePlan`` pickled as ``gather_object`` sends it, then rank 0's global step
on them all (unpickle, ``create_global_plan``: dedup, global plans, metadata,
validation; ``prepare_global_plan``; the global plans pickled for
``scatter_object_list``), and a second save of the same state through DCP's
plan cache (:func:`dcp_planning`). Printed beside DeepPart's first and
cached ``prepare_save``, with the ratios of rank 0's CPU seconds. DeepPart's
``prepare_save`` also digests every shared value (the replicas' proof),
which DCP does not do at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deeppart.comm import MPIComm

if TYPE_CHECKING:
    from deeppart.comm import Comm

#: The function names of the save's exchange (prepare stage) and the load's.
SAVE_EXCHANGE = ("prepare_save", "_exchange_round", "_union_prepare")
LOAD_EXCHANGE = ("plan_shard_reads", "exchange_needs")


# ----------------------------------------------------------------------------
# Counting collectives.


def _caller() -> str:
    """The DeepPart function (outside the communicator and the agreement)
    that called the current collective."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("deeppart") and mod not in ("deeppart.comm", "deeppart.agreement"):
            return f.f_code.co_name
        f = f.f_back  # type: ignore[assignment]
    return "?"


class Counter:
    """A log of collectives: ``(label, op, contributed, gathered, t0, t1)``
    (bytes this rank contributes, bytes it gets from the other ranks)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.log: list[tuple[str, str, int, int, float, float]] = []
        self._depth = 0
        self.clock = clock

    def counted(self, op: str, fn: Callable[[], Any], sent: int, got: Callable[[Any], int]) -> Any:
        if self._depth:
            return fn()
        label = _caller()
        self._depth += 1
        t0 = self.clock()
        try:
            out = fn()
        finally:
            self._depth -= 1
        self.log.append((label, op, sent, got(out), t0, self.clock()))
        return out

    def totals(self, labels: tuple[str, ...]) -> dict[str, Any]:
        rows = [x for x in self.log if x[0] in labels]
        return {
            "collectives": len(rows),
            "sent": sum(x[2] for x in rows),
            "gathered": sum(x[3] for x in rows),
            "seconds": sum(x[5] - x[4] for x in rows),
            "ops": [[x[0], x[1], x[2], x[3]] for x in rows],
        }


def _others(rows: list[bytes], rank: int) -> int:
    return sum(len(r) for i, r in enumerate(rows) if i != rank)


class CountingComm(MPIComm):
    """An :class:`~deeppart.comm.MPIComm` that counts its gathers (the
    collectives of the exchange); other collectives run uncounted."""

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self.counter = Counter()

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_bytes",
            lambda: super(CountingComm, self).allgather_bytes(data, width),
            width,
            lambda rows: width * (self.size - 1),
        )

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_varbytes",
            lambda: super(CountingComm, self).allgather_varbytes(data),
            len(data) + 8,  # and its length (one float64)
            lambda rows: _others(rows, self.rank) + 8 * (self.size - 1),
        )

    def allreduce_sum_i64(self, values: Any) -> Any:
        n = 8 * len(values)
        return self.counter.counted(
            "allreduce_sum_i64",
            lambda: super(CountingComm, self).allreduce_sum_i64(values),
            n,
            lambda _: _allreduce_received(n, self.size),
        )


def _allreduce_received(nbytes: int, world: int) -> int:
    """What a rank receives in a ring allreduce of ``nbytes``: the
    reduce-scatter's and the allgather's ``(world - 1) / world`` each."""
    return 2 * nbytes * (world - 1) // world


# ----------------------------------------------------------------------------
# The torchtitan-like Llama (names, shapes and placements).


@dataclasses.dataclass(frozen=True)
class Llama:
    layers: int = 80
    dim: int = 8192
    ffn: int = 28672
    vocab: int = 128256
    heads: int = 64
    kv_heads: int = 8

    @property
    def kv_dim(self) -> int:
        return self.dim // self.heads * self.kv_heads


#: Per tensor-parallel style: the placements on the (dp, tp) mesh that FSDP2
#: over parallelize_module gives (checked against the measured run's).
def placements_of(style: str, tp: int) -> tuple[Any, ...]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if style == "colwise":  # Shard(0) on tp, then FSDP's Shard(0) on dp
        return (_StridedShard(0, split_factor=tp), Shard(0))
    if style == "rowwise":
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())  # sequence-parallel norms


def stage_layers(cfg: Llama, pp: int, stage: int) -> range:
    per = -(-cfg.layers // pp)
    return range(stage * per, min(cfg.layers, (stage + 1) * per))


def stage_params(cfg: Llama, pp: int, stage: int) -> list[tuple[str, tuple[int, ...], str]]:
    """Stage ``stage``'s parameters as torchtitan names them (global layer
    ids): ``(fqn, shape, style)``."""
    out: list[tuple[str, tuple[int, ...], str]] = []
    if stage == 0:
        out.append(("tok_embeddings.weight", (cfg.vocab, cfg.dim), "colwise"))
    for i in stage_layers(cfg, pp, stage):
        p = f"layers.{i}"
        out += [
            (f"{p}.attention.wq.weight", (cfg.dim, cfg.dim), "colwise"),
            (f"{p}.attention.wk.weight", (cfg.kv_dim, cfg.dim), "colwise"),
            (f"{p}.attention.wv.weight", (cfg.kv_dim, cfg.dim), "colwise"),
            (f"{p}.attention.wo.weight", (cfg.dim, cfg.dim), "rowwise"),
            (f"{p}.attention_norm.weight", (cfg.dim,), "norm"),
            (f"{p}.feed_forward.w1.weight", (cfg.ffn, cfg.dim), "colwise"),
            (f"{p}.feed_forward.w2.weight", (cfg.dim, cfg.ffn), "rowwise"),
            (f"{p}.feed_forward.w3.weight", (cfg.ffn, cfg.dim), "colwise"),
            (f"{p}.ffn_norm.weight", (cfg.dim,), "norm"),
        ]
    if stage == pp - 1:
        out.append(("norm.weight", (cfg.dim,), "norm"))
        out.append(("output.weight", (cfg.vocab, cfg.dim), "colwise"))
    return out


def rng_bytes(rank: int) -> bytes:
    """A rank's torch CPU RNG state after seeding it per rank, as bytes."""
    import torch

    g = torch.Generator()
    g.manual_seed(1234 + rank)
    return bytes(g.get_state().numpy())


def loader_of(rank: int) -> dict[str, int]:
    return {"epoch": 3, "batches_seen": 100 + rank}


# ----------------------------------------------------------------------------
# measured: one MPI rank.


def measured_rank(out: Path, reps: int) -> None:
    import torch.distributed as dist
    from mpi4py import MPI

    import deeppart

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    port = np.zeros(1, dtype=np.int64)
    if rank == 0:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    world.Bcast(port, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}", rank=rank, world_size=size
    )
    cfg = Llama(layers=4, dim=32, ffn=64, vocab=64, heads=4, kv_heads=2)
    state, model, placements = tiny_stage(cfg)
    c = CountingComm(world)
    d = out / "ckpt"
    prepare_seconds = _time_prepare_save()
    saves, loads = [], []
    for k in range(reps + 1):  # one warm-up
        c.counter.log.clear()
        world.Barrier()
        t0 = time.perf_counter()
        deeppart.save(state, d, comm=c, overwrite=True)
        t_save = time.perf_counter() - t0
        save = c.counter.totals(SAVE_EXCHANGE)
        c.counter.log.clear()
        target = tiny_target(state)
        world.Barrier()
        t0 = time.perf_counter()
        deeppart.load(d, into=target, comm=c)
        t_load = time.perf_counter() - t0
        load = c.counter.totals(LOAD_EXCHANGE)
        if k:
            save["prepare_seconds"] = prepare_seconds.pop()
            saves.append({**save, "save_seconds": t_save})
            loads.append({**load, "load_seconds": t_load})
    check_restored(state, target)
    result = {
        "rank": rank,
        "stage": model,
        "placements": placements,
        "save": _median_of(saves),
        "load": _median_of(loads),
    }
    (out / f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _time_prepare_save() -> list[float]:
    """Times each call of the save's prepare stage (with its exchange):
    the returned list gets each call's seconds."""
    import deeppart.saving.save as checkpoint

    times: list[float] = []
    inner: Any = checkpoint.__dict__["prepare_save"]

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - t0)

    checkpoint.__dict__["prepare_save"] = timed
    return times


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(runs[0])
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    return out


def tiny_stage(cfg: Llama) -> tuple[dict[str, Any], int, dict[str, str]]:
    """This rank's stage of ``cfg`` on the (pp, dp, tp) = (2, 2, 2) mesh:
    tensor parallel, FSDP2, AdamW after one step, a scheduler, per-rank
    loader and RNG. Returns the state, the stage and each style's placements."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp = 2
    stage = mesh.get_local_rank("pp")
    torch.manual_seed(stage)
    root = nn.Module()
    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "norm": SequenceParallel(),
    }
    plan: dict[str, Any] = {}
    built: dict[str, nn.Module] = {}
    for fqn, shape, style in stage_params(cfg, pp, stage):
        name = fqn.removesuffix(".weight")
        if name == "tok_embeddings":
            mod: nn.Module = nn.Embedding(cfg.vocab, cfg.dim)
            plan[name] = RowwiseParallel(input_layouts=Replicate())
        elif style == "norm":
            mod = nn.RMSNorm(cfg.dim)
            plan[name] = styles[style]
        else:
            mod = nn.Linear(shape[1], shape[0], bias=False)
            plan[name] = styles[style]
        built[name] = mod
        parent = root
        parts = name.split(".")
        for part in parts[:-1]:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(parts[-1], mod)
    parallelize_module(root, mesh["tp"], plan)
    layers: Any = getattr(root, "layers", None)
    if layers is not None:
        for layer in layers.children():
            fully_shard(layer, mesh=mesh["dp"])
    fully_shard(root, mesh=mesh["dp"])
    opt = torch.optim.AdamW(root.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for p in root.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    sched.step()
    msd, osd = get_state_dict(
        root, opt, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    state = {
        "model": msd,
        "optim": osd,
        "lr_scheduler": sched.state_dict(),
        "loader": loader_of(rank),
        "rng": rng_bytes(rank),
    }
    placements: dict[str, str] = {}
    for fqn, _shape, style in stage_params(cfg, pp, stage):
        dt: Any = msd[fqn]
        placements.setdefault(style, repr(tuple(dt.placements)))
    return state, stage, placements


def tiny_target(state: dict[str, Any]) -> dict[str, Any]:
    """A state of the same layout with other values to load into."""
    import torch
    from torch.utils._pytree import tree_map

    def other(t: Any) -> Any:
        return t.detach().clone().add_(1) if isinstance(t, torch.Tensor) else t

    out = tree_map(other, {k: state[k] for k in ("model", "optim")})
    return {**out, "lr_scheduler": {}, "loader": {}, "rng": b""}


def check_restored(state: dict[str, Any], target: dict[str, Any]) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    for part in ("model", "optim"):
        for k, v in state[part].items():
            got = target[part][k]
            if isinstance(v, DTensor):
                v, got = v.to_local(), got.to_local()
            if isinstance(v, torch.Tensor) and not torch.equal(v, got):
                raise AssertionError(f"{part}/{k}: not restored")


def run_measured(n: int, reps: int, timeout_s: float) -> dict[str, Any]:
    """Launches ``n`` MPI ranks of this file and collects their results."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory(prefix="deeppart-exchange-") as tmp:
        cmd = [str(mpiexec), "-n", str(n), sys.executable, str(Path(__file__).resolve()),
               "--rank-of", tmp, "--reps", str(reps)]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"mpiexec failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        ranks = [json.loads((Path(tmp) / f"rank-{r}.json").read_text()) for r in range(n)]
    return {"ranks": ranks, "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


# ----------------------------------------------------------------------------
# computed: rank 0 of a large job on one process.


class SimComm:
    """Rank ``rank`` of ``size`` whose gathers return the other ranks'
    contributions made beforehand (``rows``: the first agreement's,
    ``rounds``: each round of the exchange's payloads, in order); later
    agreements return this rank's row for every rank (all ranks build the
    same union: checked with ``--check-reps``). Counts like
    :class:`CountingComm`."""

    def __init__(
        self, rank: int, size: int, rows: list[bytes], rounds: list[list[bytes]], agreed: int = 0
    ) -> None:
        self.rank, self.size = rank, size
        self.rows, self.rounds = rows, rounds
        self.counter = Counter(time.process_time)
        #: Agreements already made (1: start at the exchange).
        self._agreements = agreed
        self._round = 0

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        def gather() -> list[bytes]:
            self._agreements += 1
            if self._agreements == 1:
                rows = [bytes([0]) + r for r in self.rows]
                if rows[self.rank] != data.ljust(width, b"\0"):
                    raise AssertionError("this rank's row differs from the one computed before")
                return rows
            return [data.ljust(width, b"\0")] * self.size

        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_bytes", gather, width, lambda rows: width * (self.size - 1)
        )

    def allreduce_sum_i64(self, values: Any) -> Any:
        """The sum of every rank's :func:`~deeppart.saving.union_cache.reuse_terms`
        (the first collective of a save's prepare), each made from its row."""
        from deeppart.saving.prepare import ROW_WIDTH
        from deeppart.saving.union_cache import reuse_terms
        from deeppart.storage.identity import IDENTITY_BYTES

        def reduce() -> Any:
            at = ROW_WIDTH + 1
            terms = [
                reuse_terms(
                    False, r[at + IDENTITY_BYTES :], r[ROW_WIDTH], r[at : at + IDENTITY_BYTES]
                )
                for r in self.rows
            ]
            if not np.array_equal(terms[self.rank], values):
                raise AssertionError("this rank's terms differ from the ones computed before")
            return np.sum(np.stack(terms), axis=0, dtype=np.int64)

        n = 8 * len(values)
        return self.counter.counted(
            "allreduce_sum_i64", reduce, n, lambda _: _allreduce_received(n, self.size)
        )

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        def gather() -> list[bytes]:
            payloads = self.rounds[self._round]
            self._round += 1
            if data != payloads[self.rank]:
                raise AssertionError("this rank's payload differs from the one computed before")
            return payloads

        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_varbytes",
            gather,
            len(data) + 8,
            lambda rows: _others(rows, self.rank) + 8 * (self.size - 1),
        )


def synthetic_state(cfg: Llama, mesh: Any, pp: int, stage: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state in stage ``stage``: model and flattened AdamW
    state as ``get_state_dict`` gives them (DTensors on ``mesh["dp", "tp"]``
    whose local shards are zero-stride views: no data), an LR scheduler's
    state, the rank's loader position and RNG state."""
    import torch
    from torch.distributed.tensor import DTensor

    from deeppart.regions import placement_region
    from deeppart.state.dtensor import _placement_specs

    sub = mesh["dp", "tp"]
    coord = sub.get_coordinate()
    mesh_shape = list(sub.mesh.shape)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    opt.step()
    sched.step()
    group = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}

    def dtensor(shape: tuple[int, ...], placements: tuple[Any, ...]) -> Any:
        local = placement_region(shape, mesh_shape, coord, _placement_specs(placements)).shape
        base = torch.zeros(1)  # its own storage: no two leaves alias
        view = base.expand(local) if local else base.reshape(())
        stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
        return DTensor.from_local(
            view, sub, placements, run_check=False, shape=torch.Size(shape), stride=stride
        )

    model: dict[str, Any] = {}
    optim: dict[str, Any] = {}
    tp = mesh_shape[1]
    for fqn, shape, style in stage_params(cfg, pp, stage):
        pl = placements_of(style, tp)
        model[fqn] = dtensor(shape, pl)
        optim[f"state.{fqn}.exp_avg"] = dtensor(shape, pl)
        optim[f"state.{fqn}.exp_avg_sq"] = dtensor(shape, pl)
        optim[f"state.{fqn}.step"] = torch.tensor(1.0)
        for k, v in group.items():
            optim[f"param_groups.{fqn}.{k}"] = v
    return {
        "model": model,
        "optim": optim,
        "lr_scheduler": sched.state_dict(),
        "loader": loader_of(rank),
        "rng": rng_bytes(rank),
    }


def computed(
    cfg: Llama,
    pp: int,
    dp: int,
    tp: int,
    check_reps: bool = False,
    directory: str = "/ckpt",
    bytes_only: bool = False,
) -> dict[str, Any]:
    """Rank 0's exchange in a ``pp x dp x tp`` job (see the module docstring),
    on a ``fake`` process group that is destroyed again when it returns."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("computed() needs a process without torch.distributed initialised")
    try:
        return _computed(cfg, pp, dp, tp, check_reps, directory, bytes_only)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _computed(
    cfg: Llama, pp: int, dp: int, tp: int, check_reps: bool, directory: str, bytes_only: bool
) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from deeppart.saving import own_structure, union_cache
    from deeppart.saving import prepare as prepare_module
    from deeppart.saving.planning import PlanProvider
    from deeppart.saving.prepare import (
        ROW_WIDTH,
        _fingerprint,
        _Own,
        _own_prepare,
        _payload,
        _read_exchange,
        _second_payload,
        _try_cache,
        _union_prepare,
        digest_held,
        prepare_save,
    )
    from deeppart.state.dtensor import forget_layouts
    from deeppart.state.state import FlatLeaf, encode_plain
    from deeppart.state.union import forget_decoded
    from deeppart.storage.identity import identity_digest

    world = pp * dp * tp
    path = Path(directory)
    plan_for = PlanProvider(world)
    union_cache.forget()  # the first save below finds no cached union
    blank = b"\0" * (union_cache.COLUMN_WIDTH - union_cache.FINGERPRINT_BYTES)
    reps = [s * dp * tp for s in range(pp)]
    owns: dict[int, _Own] = {}
    states: dict[int, Any] = {}
    t_own: dict[int, float] = {}

    def init(rank: int) -> Any:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        return init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))

    # Each stage's lowest rank: its whole own prepare (stage 0 last, whose
    # process group stays for the real prepare_save below).
    for s in reversed(range(pp)):
        _progress(f"stage {s}: rank {reps[s]}'s own prepare")
        mesh = init(reps[s])
        states[s] = synthetic_state(cfg, mesh, pp, s, reps[s])
        t0 = time.process_time()
        owns[s] = _own_prepare(states[s], None, plan_for, path, None, [], reps[s], world)
        t_own[s] = time.process_time() - t0

    _progress("the other ranks' rows and payloads")
    # Every rank's first-agreement row and exchange payload.
    t0 = time.process_time()
    rows: list[bytes] = [b""] * world
    own_of: list[_Own] = [owns[0]] * world
    for s in range(pp):
        own = owns[s]
        per_rank: dict[int, list[tuple[int, FlatLeaf, int]]] = {}
        shared: list[tuple[int, FlatLeaf, int]] = []
        per_rank_paths: dict[tuple[Any, ...], int] = {("loader",): 0, ("rng",): 0}
        for i, (leaf, desc) in enumerate(zip(own.prep.leaves, own.described.descs, strict=True)):
            holders = desc.get("holders")
            if holders is None:
                if tuple(leaf.path) not in per_rank_paths:
                    shared.append((i, leaf, world))
                else:
                    per_rank_paths[tuple(leaf.path)] = i
                continue
            if len(holders) == 1:
                continue  # held by one rank: nothing to digest
            # A replica of a shard: sampled (zeros, as the rank's view holds).
            replica = FlatLeaf(leaf.path, torch.zeros(desc["shape"]), None)
            for r in holders:
                per_rank.setdefault(r, []).append((i, replica, len(holders)))
        for r in range(reps[s], reps[s] + dp * tp):
            mine = [
                (per_rank_paths[(k,)], FlatLeaf((k,), None, encode_plain(v, (k,))), world)
                for k, v in (("loader", loader_of(r)), ("rng", rng_bytes(r)))
            ]
            held = sorted([*shared, *per_rank.get(r, []), *mine], key=lambda x: x[0])
            digests, sample, values, _ = digest_held(held)
            # prepare_save below is given no store: the digest of b"".
            rows[r] = own.prep.digest + sample + values + b"\0" + identity_digest(b"")
            # The union cache's column: the stage's structure fingerprint, no cache yet.
            rows[r] += _fingerprint(own, False, False) + blank
            if r != reps[s]:
                own_of[r] = dataclasses.replace(own, digests=digests, sample=sample, values=values)
            else:
                own_of[r] = own
    rows_plain = [r[:ROW_WIDTH] for r in rows]
    row_bytes = 1 + len(rows[0])  # the agreement's row: a byte saying the rank did not fail
    payloads: list[bytes] = []
    for r in range(world):
        rep = reps[r // (dp * tp)]
        # Each round's payload goes with a byte saying the rank did not fail.
        payloads.append(b"\0" + _payload(own_of[r], rows_plain, r, rep))
    rounds = [payloads]
    # The second round (plain values that differ from their stage's lowest
    # rank's, ...): what every rank knows after the first is the same.
    exchanged = _read_exchange([p[1:] for p in payloads], rows_plain, False)
    if exchanged.second_round:
        rounds.append([b"\0" + _second_payload(own_of[r], r, exchanged) for r in range(world)])
    t_others = time.process_time() - t0
    sizes = sorted(sum(len(p[r]) for p in rounds) for r in range(world) if r not in reps)
    out: dict[str, Any] = {
        "layout": {"pp": pp, "dp": dp, "tp": tp, "world": world},
        "model": dataclasses.asdict(cfg),
        "leaves_per_stage_rep": [len(owns[s].prep.leaves) for s in range(pp)],
        "payload_bytes": {
            "description (each stage's lowest rank)": [len(payloads[r]) for r in reps],
            "other ranks: min, median, max": [sizes[0], sizes[len(sizes) // 2], sizes[-1]],
            "total (what every rank gathers)": sum(len(p) for ps in rounds for p in ps),
            "exchange rounds": len(rounds),
        },
        "cpu_seconds": {
            "each stage rep's own prepare": [t_own[s] for s in range(pp)],
            "making the other ranks' rows and payloads (simulation only)": t_others,
        },
    }
    _progress("the load's exchange")
    out["load"] = _computed_load(states, reps, world, dp * tp)
    if bytes_only:
        # What rank 0's three gathers carry with these rows and payloads.
        terms = 8 * union_cache.REUSE_TERMS
        ops: list[list[Any]] = [
            ["prepare_save", "allreduce_sum_i64", terms, _allreduce_received(terms, world)],
            ["prepare_save", "allgather_bytes", row_bytes, row_bytes * (world - 1)],
            *(["_exchange_round", "allgather_varbytes", len(ps[0]) + 8,
               _others(ps, 0) + 8 * (world - 1)] for ps in rounds),
            ["_union_prepare", "allgather_bytes", 34, 34 * (world - 1)],
        ]  # fmt: skip
        sent, gathered = sum(o[2] for o in ops), sum(o[3] for o in ops)
        out["rank0"] = {"ops": ops, "sent": sent, "gathered": gathered}
        return out

    _progress("rank 0's prepare_save")
    # Rank 0's prepare_save, the code as it runs in a save; the union it
    # builds is kept for the other ranks' check values of a second save.
    c = SimComm(0, world, rows, rounds)
    built: list[Any] = []
    build = prepare_module.build_union  # type: ignore[attr-defined]

    def keeping(*a: Any, **k: Any) -> Any:
        built.append(build(*a, **k))
        return built[-1]

    prepare_module.build_union = keeping  # type: ignore[attr-defined]
    try:
        own_structure.forget()  # rank 0 describes its tree afresh, as a first save does
        # ... and derives every layout's regions afresh: a real rank has not
        # decoded the other stages' layouts before its first save (the
        # simulation above did, for its rows and payloads).
        forget_layouts()
        forget_decoded()
        _age_simulation()
        with GcSeconds() as collector:
            t0 = time.process_time()
            prep, _ = prepare_save(cast("Comm", c), None, states[0], None, plan_for, path)
            t_total = time.process_time() - t0
    finally:
        prepare_module.build_union = build  # type: ignore[attr-defined]
    marks = [(x[1], x[4] - t0, x[5] - t0) for x in c.counter.log]
    agree1, gather, agree2 = marks[0], marks[1], marks[-1]
    phases = {
        "own prepare (describe, digest, plan own tree)": agree1[1],
        "encode the payload": gather[1] - agree1[2],
        "decode, merge, plan the union": agree2[1] - gather[2],
    }
    checked: dict[str, Any] = {}
    if check_reps:
        for s in range(1, pp):
            sc = SimComm(reps[s], world, rows, rounds, agreed=1)
            other, _ = _union_prepare(
                cast("Comm", sc), owns[s], [r[:64] for r in rows], False, None
            )
            checked[str(reps[s])] = other.digest == prep.digest
    out["union_leaves"] = len(prep.manifest.leaves())
    out["union_dtensors"] = len(prep.dtensors)
    # The union's save digest (its plan, manifest, skeleton, codec and
    # DTensor records): equal across code versions that build it alike.
    out["union_digest"] = prep.digest.hex()
    out["rank0"] = c.counter.totals(SAVE_EXCHANGE)
    out["cpu_seconds"] = {
        **phases,
        "rank 0 prepare_save in all": t_total,
        "of which the garbage collector": collector.seconds,
        **out["cpu_seconds"],
    }
    out["full_collections"] = collector.full
    out["same_union_on_reps"] = checked
    out["cached"] = _cached_save(
        world, rows, own_of, states[0], plan_for, path, prep, built[0], union_cache, _try_cache
    )
    return out


def dcp_planning(cfg: Llama, pp: int, dp: int, tp: int) -> dict[str, Any]:
    """DCP's planning of the same save (``--dcp``): every rank's real
    ``SavePlan`` and the coordinator's global plan, as
    ``torch.distributed.checkpoint.save`` makes them with
    ``DefaultSavePlanner`` and ``FileSystemWriter``, on a ``fake`` process
    group that is destroyed again when it returns."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("dcp_planning() needs a process without torch.distributed initialised")
    try:
        return _dcp_planning(cfg, pp, dp, tp)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dcp_planning(cfg: Llama, pp: int, dp: int, tp: int) -> dict[str, Any]:
    """Each rank in turn (its own ``fake`` process group and mesh) builds
    its state of real DTensors (:func:`synthetic_state`, as DeepPart's
    computed part) and runs DCP's ``local_step`` of ``_save_state_dict``:
    ``set_up_planner``, ``set_up_storage_writer``, ``create_local_plan``,
    ``prepare_local_plan``; its plan is pickled as ``gather_object`` sends
    it. Rank 0 (the coordinator) then runs ``global_step`` on the 511
    others' unpickled plans and its own: ``create_global_plan`` (dedup,
    the global plans and ``Metadata``, the plans' validation) and
    ``prepare_global_plan``, and pickles each rank's global plan as
    ``scatter_object_list`` sends it. Only the transport is left out: the
    bytes are counted, not sent. With ``enable_plan_caching`` (DCP's cache
    in one process) a second save of the same state is timed too: rank 0's
    local step finds its plan unchanged and sends an empty one, and so,
    each in its own process, would every other rank (their empty plans are
    made, not planned here); the coordinator reuses its cached global plan
    and metadata."""
    import pickle

    import torch.distributed as dist
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = pp * dp * tp
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_final_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
    ):
        cache.clear()
    with tempfile.TemporaryDirectory(prefix="deeppart-dcp-plan-") as tmp:

        def local_step(state: Any, rank: int) -> tuple[Any, FileSystemWriter, Any, float]:
            planner = DefaultSavePlanner(enable_plan_caching=True)
            writer = FileSystemWriter(tmp)
            t0 = time.process_time()
            planner.set_up_planner(state, writer.storage_meta(), rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            plan = writer.prepare_local_plan(planner.create_local_plan())
            return planner, writer, plan, time.process_time() - t0

        # Every rank's local step, rank 0 last (its process group and
        # state stay for the coordinator's step and the second save).
        blobs: list[bytes] = [b""] * world
        local_cpu: list[float] = [0.0] * world
        items: list[int] = [0] * world
        state0: Any = None
        for r in reversed(range(world)):
            if r % (dp * tp) == 0:
                _progress(f"DCP: stage {r // (dp * tp)}'s {dp * tp} local plans")
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=world)
            mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
            state = synthetic_state(cfg, mesh, pp, r // (dp * tp), r)
            planner, writer, plan, cpu = local_step(state, r)
            t0 = time.process_time()
            blobs[r] = pickle.dumps(plan)
            local_cpu[r] = cpu + time.process_time() - t0
            items[r] = len(plan.items)
            if r == 0:
                state0, planner0, writer0 = state, planner, writer
            del state, planner, writer, plan

        _progress("DCP: the coordinator's global plan")
        _age_simulation()
        with GcSeconds() as collector:
            t0 = time.process_time()
            plans = [pickle.loads(b) for b in blobs]
            t_unpickle = time.process_time() - t0
            t0 = time.process_time()
            delta, metadata = planner0.create_global_plan(plans)
            t_global = time.process_time() - t0
            t0 = time.process_time()
            delta = writer0.prepare_global_plan(delta)
            scattered = [pickle.dumps(p) for p in delta]
            t_scatter = time.process_time() - t0
        planner0.finish_plan(pickle.loads(scattered[0]))
        written = sum(len(p.items) for p in planner0.global_plan)
        metadata_bytes = len(pickle.dumps(metadata))
        del plans, delta

        _progress("DCP: a second save of the same state (plan caching)")
        _age_simulation()
        with GcSeconds() as collector2:
            planner2, writer2, plan2, cpu2 = local_step(state0, 0)
            t0 = time.process_time()
            blob2 = pickle.dumps(plan2)
            cpu2 += time.process_time() - t0
            if plan2.usable:
                raise AssertionError("DCP's cache did not find rank 0's local plan unchanged")
            empty = pickle.dumps(SavePlan([], usable=False))
            blobs2 = [blob2] + [empty] * (world - 1)
            t0 = time.process_time()
            plans2 = [pickle.loads(b) for b in blobs2]
            delta2, _ = planner2.create_global_plan(plans2)
            delta2 = writer2.prepare_global_plan(delta2)
            scattered2 = [pickle.dumps(p) for p in delta2]
            t_coord2 = time.process_time() - t0
        planner2.finish_plan(pickle.loads(scattered2[0]))
        if planner2.plan.items != planner0.plan.items:
            raise AssertionError("DCP's cached plan for rank 0 is not its first save's")
    ordered = sorted(local_cpu)
    first = {
        "rank 0's local step (set up, local plan, pickle)": local_cpu[0],
        "unpickle the gathered plans": t_unpickle,
        "create_global_plan (dedup, metadata, validation)": t_global,
        "prepare_global_plan, pickle the plans to scatter": t_scatter,
    }
    second = {
        "rank 0's local step (plan compared with the cached one)": cpu2,
        "the coordinator (unpickle, cached global plan, pickle)": t_coord2,
    }
    return {
        "items per rank: min, median, max": [min(items), sorted(items)[world // 2], max(items)],
        "write items after dedup": written,
        "metadata chunks": sum(
            len(getattr(md, "chunks", ())) for md in metadata.state_dict_metadata.values()
        ),
        "local step CPU per rank: min, median, max": [ordered[0], ordered[world // 2], ordered[-1]],
        "first": {
            "gathered by rank 0": sum(len(b) for b in blobs[1:]),
            "scattered by rank 0": sum(len(b) for b in scattered[1:]),
            "metadata bytes (pickled)": metadata_bytes,
            "cpu_seconds": {
                **first,
                "rank 0 in all": sum(first.values()),
                "of which the garbage collector (the global step)": collector.seconds,
            },
        },
        "second": {
            "gathered by rank 0": sum(len(b) for b in blobs2[1:]),
            "scattered by rank 0": sum(len(b) for b in scattered2[1:]),
            "cpu_seconds": {
                **second,
                "rank 0 in all": sum(second.values()),
                "of which the garbage collector": collector2.seconds,
            },
        },
    }


def report_dcp(dcp: dict[str, Any], ours: dict[str, Any]) -> None:
    """DCP's planning beside DeepPart's prepare_save (``ours``: the computed
    part's results), with the ratios of rank 0's CPU seconds."""
    first, second = dcp["first"], dcp["second"]
    lo, med, hi = dcp["items per rank: min, median, max"]
    print(
        "  DCP on the same layout (DefaultSavePlanner(enable_plan_caching=True),"
        " FileSystemWriter; real SavePlans from real DTensors on a fake process group):"
    )
    print(
        f"    SavePlan items per rank {lo} / {med} / {hi} (min / median / max); "
        f"{dcp['write items after dedup']} after dedup; metadata {dcp['metadata chunks']} "
        f"chunks, {_mb(first['metadata bytes (pickled)'])} pickled"
    )
    lo_s, med_s, hi_s = dcp["local step CPU per rank: min, median, max"]
    print(f"    each rank's local step: {lo_s:.2f} / {med_s:.2f} / {hi_s:.2f} s CPU")
    ours_merge = ours["cpu_seconds"]["decode, merge, plan the union"]
    runs = (
        ("first save", first, ours["cpu_seconds"]),
        ("second save", second, ours["cached"]["cpu_seconds"]),
    )
    for name, run, mine in runs:
        print(
            f"    {name}: rank 0 gathers {_mb(run['gathered by rank 0'])}, scatters "
            f"{_mb(run['scattered by rank 0'])}"
        )
        cpu = run["cpu_seconds"]
        for k, v in cpu.items():
            print(f"      {k}: {v:.3f}")
        total, collected = cpu["rank 0 in all"], next(v for k, v in cpu.items() if "garbage" in k)
        ours_total = mine["rank 0 prepare_save in all"]
        ours_collected = mine["of which the garbage collector"]
        print(
            f"      ratio, DCP's rank 0 / DeepPart's rank 0 prepare_save ({ours_total:.3f} s): "
            f"{total / ours_total:.2f}x; without either's garbage collector "
            f"({total - collected:.3f} / {ours_total - ours_collected:.3f} s): "
            f"{(total - collected) / (ours_total - ours_collected):.2f}x"
        )
    glob = first["cpu_seconds"]["create_global_plan (dedup, metadata, validation)"]
    print(
        f"    ratio, create_global_plan / DeepPart's decode, merge, plan the union "
        f"({ours_merge:.3f} s): {glob / ours_merge:.2f}x"
    )


class LoadSimComm:
    """Rank ``rank`` of ``size`` in the load's exchange
    (:func:`deeppart.loading.needs.exchange_needs`): its two gathers return
    every rank's digest and payload, made beforehand. Counts like
    :class:`CountingComm`."""

    def __init__(self, rank: int, size: int, digests: list[bytes], payloads: list[bytes]) -> None:
        self.rank, self.size = rank, size
        self.digests, self.payloads = digests, payloads
        self.counter = Counter(time.process_time)

    def allgather_bytes(self, data: bytes, width: int) -> list[bytes]:
        if data != self.digests[self.rank]:
            raise AssertionError("this rank's digest differs from the one computed before")
        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_bytes", lambda: self.digests, width, lambda rows: width * (self.size - 1)
        )

    def allgather_varbytes(self, data: bytes) -> list[bytes]:
        if data != self.payloads[self.rank]:
            raise AssertionError("this rank's payload differs from the one computed before")
        return self.counter.counted(  # type: ignore[no-any-return]
            "allgather_varbytes",
            lambda: self.payloads,
            len(data) + 8,
            lambda rows: _others(rows, self.rank) + 8 * (self.size - 1),
        )


def _computed_load(
    states: dict[int, Any], reps: list[int], world: int, stage_ranks: int
) -> dict[str, Any]:
    """The load's exchange (``load(into=)`` the same layout) on rank 0:
    each stage's description of its needs (its lowest rank's; every rank
    of a stage describes the same DTensors alike), the bytes rank 0 sends
    and gathers, and its CPU seconds to decode every stage's needs
    (:func:`exchange_needs`) and to find the needers of each stored shard
    of a save at the same layout (:class:`RegionIndex`)."""
    from deeppart.loading.needs import (
        NeedSpec,
        RegionIndex,
        describe_needs,
        exchange_needs,
        needs_digest,
    )
    from deeppart.state.dtensor import holder_layout, local_region
    from deeppart.state.state import flatten, is_dtensor

    descriptions: list[bytes] = []
    specs0: list[NeedSpec] = []
    for s, rep in enumerate(reps):
        specs = [
            NeedSpec(tuple(lf.path), local_region(lf.tensor), holder_layout(lf.tensor))
            for lf in flatten(states[s])[0]
            if lf.tensor is not None and is_dtensor(lf.tensor)
        ]
        descriptions.append(describe_needs(specs, rep))
        specs0 = specs if s == 0 else specs0
    digests = [needs_digest(descriptions[r // stage_ranks]) for r in range(world)]
    payloads = [descriptions[reps.index(r)] if r in reps else b"" for r in range(world)]
    c = LoadSimComm(0, world, digests, payloads)

    def unexpected(path: Any) -> Any:
        raise AssertionError(f"{path}: no plain tensor is needed whole here")

    _age_simulation()
    t0 = time.process_time()
    wants, _ = exchange_needs(cast("Comm", c), specs0, unexpected)
    t_decode = time.process_time() - t0
    t0 = time.process_time()
    queries = 0
    for entries in wants.values():
        RegionIndex(entries).needers_many([region for region, _ in entries])
        queries += len(entries)
    t_index = time.process_time() - t0
    totals = c.counter.totals(LOAD_EXCHANGE)
    return {
        "dtensors_per_stage": len(specs0),
        "description bytes per stage": [len(d) for d in descriptions],
        "rank 0 sent": totals["sent"],
        "gathered by every rank": totals["gathered"],
        "needed regions": queries,
        "cpu_seconds": {"decode": t_decode, "needers of each shard": t_index},
    }


def _age_simulation() -> None:
    """Moves every object alive now (the simulated ranks' states, rows and
    payloads: hundreds of ranks' worth, where a real rank holds its own)
    into the garbage collector's oldest generation by one full collection
    before rank 0's timed CPU seconds, as a real rank's long-lived state
    is: the young collections in the timed steps then walk only what those
    steps make. (A full collection there would walk the simulation too,
    which a real rank does not hold; none ran in the runs reported. Not
    ``gc.freeze``: DeepPart moves what a union keeps into the oldest
    generation by freezing and unfreezing, which it does not do in a
    process that keeps frozen objects of its own.)"""
    gc.collect()


class GcSeconds:
    """The CPU seconds the garbage collector runs while this is entered
    (timed from ``gc.callbacks``): how much of a timed step is the
    collector's, as objects made there make its collections due."""

    def __init__(self) -> None:
        self.seconds = 0.0
        #: How many of its collections were full ones (generation 2).
        self.full = 0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.process_time()
        else:
            self.seconds += time.process_time() - self._started
            self.full += info["generation"] == 2

    def __enter__(self) -> GcSeconds:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def _cached_save(
    world: int,
    rows: list[bytes],
    own_of: list[Any],
    state: Any,
    plan_for: Any,
    path: Path,
    first: Any,
    union: Any,
    union_cache: Any,
    try_cache: Callable[..., Any],
) -> dict[str, Any]:
    """Rank 0's second save of the same structure (the same state), which
    reuses the union its first save cached: its CPU seconds and what it
    gathers. Every rank's agreement row is made beforehand: the tag rank 0
    makes (every rank makes the same from the same cache), each rank's
    check value from its own digests and check terms of the cached union
    (``union``: the one rank 0's first save built)."""
    from deeppart.saving.prepare import _fingerprint, _own_prepare, prepare_save

    _progress("the other ranks' rows of a second save (the union cached)")
    own = _own_prepare(state, None, plan_for, path, None, [], 0, world)
    reuse = try_cache(own, 0, world, _fingerprint(own, False, False))
    if reuse is None:
        raise AssertionError("rank 0 finds no cached union of its structure")
    tag = reuse.column[: union_cache.TAG_BYTES]
    head = len(rows[0]) - union_cache.COLUMN_WIDTH
    rows2 = []
    for r in range(world):
        check = union_cache.check_value(union_cache.check_terms(union, r), own_of[r].digests)
        if check is None:
            raise AssertionError(f"rank {r} cannot prove its copies by the cached union")
        fingerprint = rows[r][head : head + union_cache.FINGERPRINT_BYTES]
        rows2.append(rows[r][:head] + fingerprint + tag + check + b"\0")  # nothing deferred
    _progress("rank 0's second prepare_save")
    c = SimComm(0, world, rows2, [])
    _age_simulation()
    with GcSeconds() as collector:
        t0 = time.process_time()
        prep, _ = prepare_save(cast("Comm", c), None, state, None, plan_for, path)
        t_total = time.process_time() - t0
    agree_at = c.counter.log[0][4] - t0
    # The simulated sum (every rank's terms made from its row here) is not
    # rank 0's work: a real rank's CPU in it is its own terms' reduction.
    simulated = sum(x[5] - x[4] for x in c.counter.log)
    t_total -= simulated
    if [x[1] for x in c.counter.log] != ["allreduce_sum_i64"]:
        raise AssertionError(f"the second save gathered more than the sum: {c.counter.log}")
    if PROFILE_CACHED is not None:
        # Once more (the cache still holds), under cProfile, untimed.
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        prepare_save(cast("Comm", SimComm(0, world, rows2, [])), None, state, None, plan_for, path)
        profiler.disable()
        profiler.dump_stats(PROFILE_CACHED)
        _progress(f"the cached save's profile: {PROFILE_CACHED}")
    if prep.manifest.fingerprint != first.manifest.fingerprint:
        raise AssertionError("the cached save's manifest is not the first save's")
    if prep.plan.fingerprint != first.plan.fingerprint:
        raise AssertionError("the cached save's plan is not the first save's")
    totals = c.counter.totals(SAVE_EXCHANGE)
    return {
        "rank0": totals,
        "cpu_seconds": {
            "own prepare and the cache's row": agree_at,
            "after the agreement": t_total - agree_at,
            "(the simulated collective, not counted)": simulated,
            "rank 0 prepare_save in all": t_total,
            "of which the garbage collector": collector.seconds,
        },
        "full_collections": collector.full,
    }


#: ``--profile-cached FILE``: where rank 0's cached save, run once more
#: under cProfile, leaves its stats (None: not profiled).
PROFILE_CACHED: Path | None = None


def _progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def ring_seconds(gathered: int, world: int, latency_us: float, bandwidth_gbs: float) -> float:
    """A ring allgather's time: ``world - 1`` steps of ``latency_us``, and
    the bytes gathered from the others at ``bandwidth_gbs`` GB/s."""
    return (world - 1) * latency_us * 1e-6 + gathered / (bandwidth_gbs * 1e9)


def report_computed(res: dict[str, Any], latency_us: float, bandwidth_gbs: float) -> None:
    lay = res["layout"]
    world = lay["world"]
    t = res["cpu_seconds"]
    pb = res["payload_bytes"]
    model = sum(ring_seconds(op[3], world, latency_us, bandwidth_gbs) for op in res["rank0"]["ops"])
    local = sum(v for k, v in t.items() if k.startswith(("own", "encode", "decode")))
    res["model_seconds"] = {"collectives": model, "local phases": local, "exchange": model + local}
    print(f"computed: PP {lay['pp']} x FSDP {lay['dp']} x TP {lay['tp']} = {world} ranks")
    if "union_leaves" in res:
        print(f"  union: {res['union_leaves']} leaves, {res['union_dtensors']} DTensor records")
        print(f"  union's save digest (plan, manifest, skeleton, records): {res['union_digest']}")
    desc = pb["description (each stage's lowest rank)"]
    print(f"  description per stage (its lowest rank): {_mb(min(desc))} .. {_mb(max(desc))}")
    lo, med, hi = pb["other ranks: min, median, max"]
    print(f"  other ranks' payloads: {lo} / {med} / {hi} B (min / median / max)")
    print(f"  gathered by every rank: {_mb(pb['total (what every rank gathers)'])}")
    print("  CPU seconds on one process:")
    for k, v in t.items():
        vs = ", ".join(f"{x:.2f}" for x in v) if isinstance(v, list) else f"{v:.2f}"
        print(f"    {k}: {vs}")
    if "full_collections" in res:
        print(f"    full collections of the garbage collector in it: {res['full_collections']}")
    print(
        f"  rank 0's gathers at {bandwidth_gbs:g} GB/s, {latency_us:g} us/step (ring): "
        f"{model:.3f} s" + (f"; with its local phases: {model + local:.2f} s" if local else "")
    )
    ld = res.get("load")
    if ld:
        print(
            f"  load's exchange: {ld['dtensors_per_stage']} DTensors a stage, described in "
            f"{_mb(min(ld['description bytes per stage']))} .. "
            f"{_mb(max(ld['description bytes per stage']))} a stage; rank 0 sends "
            f"{ld['rank 0 sent']} B, gathered by every rank: {_mb(ld['gathered by every rank'])}"
        )
        cs = ld["cpu_seconds"]
        print(
            f"    rank 0's CPU: {cs['decode']:.2f} s to decode every "
            f"stage's needs, {cs['needers of each shard']:.2f} s for the needers of "
            f"{ld['needed regions']} regions"
        )
    if res.get("same_union_on_reps"):
        print(f"  same union manifest on each stage's lowest rank: {res['same_union_on_reps']}")
    if "cached" in res:
        cached = res["cached"]
        got = cached["rank0"]
        print("  second save, same structure (the union and plan cached):")
        print(f"    collectives: {[op[1] for op in got['ops']]}")
        print(f"    gathered by every rank: {_mb(got['gathered'])} (sent {got['sent']} B)")
        for k, v in cached["cpu_seconds"].items():
            print(f"    {k}: {v:.3f}")
        print(f"    full collections of the garbage collector in it: {cached['full_collections']}")


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n} B"


def report_measured(res: dict[str, Any]) -> None:
    ranks = res["ranks"]
    print(f"measured: 8 MPI ranks, PP 2 x FSDP 2 x TP 2 (load average {' '.join(res['loadavg'])})")
    print(f"  placements: {ranks[0]['placements']}")
    print(
        "  rank stage | save exchange: sent B, gathered B, collectives s | prepare s | save s"
        " | load exchange: sent B, gathered B, s | load s"
    )
    for r in ranks:
        s, ld = r["save"], r["load"]
        print(
            f"  {r['rank']:4} {r['stage']:5} | {s['sent']:8} {s['gathered']:9} {s['seconds']:.3f} |"
            f" {s['prepare_seconds']:.3f} | {s['save_seconds']:.2f} | {ld['sent']:8}"
            f" {ld['gathered']:9} {ld['seconds']:.3f} | {ld['load_seconds']:.2f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", choices=("both", "measured", "computed"), default="both")
    p.add_argument("--reps", type=int, default=3, help="measured saves/loads (after a warm-up)")
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--dp", type=int, default=64)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--layers", type=int, default=80)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=28672)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--latency-us", type=float, default=5.0)
    p.add_argument("--bandwidth-gbs", type=float, default=25.0)
    p.add_argument("--check-reps", action="store_true", help="every stage builds rank 0's union")
    p.add_argument(
        "--bytes-only", action="store_true", help="computed: the payloads only, not rank 0's merge"
    )
    dcp = p.add_mutually_exclusive_group()
    dcp.add_argument(
        "--dcp",
        action="store_true",
        default=None,
        help="computed: DCP's planning of the same save too (default: at up to 512 ranks)",
    )
    dcp.add_argument("--no-dcp", dest="dcp", action="store_false", help="computed: without DCP")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--profile-cached",
        type=Path,
        help="computed: run rank 0's cached save once more under cProfile, stats to this file",
    )
    p.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    global PROFILE_CACHED
    PROFILE_CACHED = args.profile_cached
    if args.rank_of is not None:
        measured_rank(args.rank_of, args.reps)
        return
    out: dict[str, Any] = {}
    if args.part in ("both", "measured"):
        out["measured"] = run_measured(8, args.reps, timeout_s=900)
        report_measured(out["measured"])
    if args.part in ("both", "computed"):
        cfg = Llama(args.layers, args.dim, args.ffn, args.vocab, args.heads, args.kv_heads)
        res = computed(
            cfg, args.pp, args.dp, args.tp, check_reps=args.check_reps, bytes_only=args.bytes_only
        )
        report_computed(res, args.latency_us, args.bandwidth_gbs)
        world = args.pp * args.dp * args.tp
        if args.dcp or (args.dcp is None and world <= 512 and not args.bytes_only):
            if args.bytes_only:
                p.error("--dcp compares with rank 0's prepare_save, which --bytes-only leaves out")
            res["dcp"] = dcp_planning(cfg, args.pp, args.dp, args.tp)
            report_dcp(res["dcp"], res)
        out["computed"] = res
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
