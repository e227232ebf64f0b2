"""One rank of the "every rank's own state" tests (tests/state/test_own_state.py,
issue 32), under ``python -m torch.distributed.run --nproc-per-node N
--standalone`` (gloo, CPU), on real FSDP2 ``fully_shard``, DeviceMesh
sub-meshes, ``get_state_dict``, AdamW and LR schedulers:

    python tests/state/own_state_worker.py four DIR      # 4 ranks, every scenario
    python tests/state/own_state_worker.py reshard DIR   # 2 ranks, after ``four``

``four`` runs, in this order, each scenario on the 4 ranks (``SCENARIOS``):

- ``pp_fsdp``: torchtitan's layout, PP(2) x FSDP2(2) on a ``(pp, dp)`` mesh
  (stage 0 on ranks {0,1}, stage 1 on {2,3}, each stage's blocks
  ``fully_shard``-ed on ``mesh["dp"]``, each stage with its own FQNs), AdamW
  after a step, a LambdaLR scheduler, a per-rank data-loader position and
  RNG state; ``deeppart.save`` without ``group=``, everything perturbed,
  then ``load(into=)`` and ``load()`` (full tensors): every rank bitwise
  what it saved. Also writes each stage's full tensors (``torch.save``)
  for ``reshard``;
- ``per_rank_values``: plain values that differ between ranks (equal and
  different encoded lengths), loaded back with and without ``into=``;
- ``reused_names``: two pipeline stages that both name their blocks
  ``layers.0``, ``layers.1`` (same shapes, other values), FSDP2 on each
  stage's ``dp`` sub-mesh: each rank its own stage, or a refusal naming the
  leaf;
- ``auto_swap``: two DP groups ({0,1}, {2,3}) whose embeddings share path,
  dtype and shape and differ only in rows the sampled replica check does
  not read, plus a head of its own name and shape per group; saved with
  ``group="auto"`` and without ``group=``: each group its own embedding, or
  a refusal naming it;
- ``hsdp_replica``: HSDP (2,2) with rank 2's copy of one shard changed: the
  default save and ``verify_replicas=True`` both refuse on every rank with
  ReplicaMismatchError naming the leaf and the ranks of each version.

``reshard`` (2 ranks): the ``pp_fsdp`` checkpoint loaded at PP(2) x FSDP(1):
without ``per_rank=`` refused (PerRankStateError naming the loader
position, the leaf ``loader``: a plain subtree is one leaf); with
``per_rank="drop"`` and ``per_rank=0`` each stage gets its own tensors
bitwise.

Also in ``reshard``: with a callable ``per_rank`` each stage gets its own
tensors bitwise and the per-rank values the callable picks; with
``per_rank="all"`` and no target, the union of both stages and every
saved rank's ``loader`` and ``rng`` under ``"ranks:<r>"``.

A scenario's checks run on every rank; rank 0 then prints one line per
scenario, ``RESULT <name> PASS [notes]`` or ``RESULT <name> FAIL <what
failed, per rank>``, and finally ``DONE <job>``. A failure in one scenario
does not stop the next (unless the ranks lost step with each other).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from rank_output import print_line

import deeppart

#: The 4-rank scenarios, in the order the ``four`` job runs them.
SCENARIOS = ("pp_fsdp", "per_rank_values", "reused_names", "auto_swap", "hsdp_replica")

#: The transformer-ish stages: vocabulary, width (uneven row shards over 2).
VOCAB, DIM = 67, 24
#: The pp_fsdp stages' blocks: their own FQNs per stage, as torchtitan.
STAGE_LAYERS = ((0, 1), (2, 3))


# ----------------------------------------------------------------------------
# Checks and reports.


class Checks:
    """One scenario's sub-checks on this rank: each failure is recorded and
    the next sub-check still runs (they are collective: every rank runs the
    same ones)."""

    def __init__(self) -> None:
        self.failed: list[str] = []
        self.notes: list[str] = []

    @contextmanager
    def sub(self, name: str) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            if lost_step(e):
                raise
            self.failed.append(f"{name}: {type(e).__name__}: {one_line(e)}")


def one_line(e: BaseException, limit: int = 600) -> str:
    text = re.sub(r"\s+", " ", str(e)).strip()
    return text if len(text) <= limit else text[:limit] + "..."


def lost_step(e: BaseException) -> bool:
    """Whether ``e`` is a failed collective (a timeout, a closed peer):
    the ranks no longer run the same collectives, so the job stops."""
    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or any(
        w in text for w in ("Timed out", "Connection closed by peer", "Connection reset by peer")
    )


def report(name: str, checks: Checks) -> None:
    """Gathers every rank's failures; rank 0 prints the scenario's line."""
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, (checks.failed, checks.notes))
    if dist.get_rank() != 0:
        return
    by_msg: dict[str, list[int]] = {}
    for r, (fs, _) in enumerate(rows):
        for f in fs:
            by_msg.setdefault(f, []).append(r)
    failed = [f"ranks {rs}: {f}" for f, rs in by_msg.items()]
    notes = sorted({n for _, ns in rows for n in ns})
    if failed:
        line = f"RESULT {name} FAIL " + " | ".join(failed)
    else:
        line = f"RESULT {name} PASS" + (" " + "; ".join(notes) if notes else "")
    print_line(
        line if len(line.encode()) < 4000 else line.encode()[:3990].decode(errors="ignore") + "..."
    )


def same(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` bitwise equal (DTensors: the same mesh, placements
    and global shape, and the same local shard), else AssertionError."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        assert isinstance(a, DTensor) and isinstance(b, DTensor), f"{where}: {type(a)} {type(b)}"
        assert a.shape == b.shape and a.placements == b.placements, f"{where}: layout differs"
        ma, mb = a.device_mesh, b.device_mesh
        assert ma.mesh.tolist() == mb.mesh.tolist(), (
            f"{where}: mesh {ma.mesh.tolist()} {mb.mesh.tolist()}"
        )
        same(a.to_local(), b.to_local(), where + " (local shard)")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: {type(b).__name__}, not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{where}: {a.dtype}{tuple(a.shape)} {b.dtype}{tuple(b.shape)}"
        )
        x = a.detach().contiguous().reshape(-1).view(torch.uint8)
        y = b.detach().contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(x, y):
            rows = differing_rows(a, b)
            raise AssertionError(f"{where}: values differ (rows {rows})")
    elif isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: {type(b).__name__}, not a dict"
        assert sorted(map(str, a)) == sorted(map(str, b)), (
            f"{where}: keys {sorted(map(str, a))} {sorted(map(str, b))}"
        )
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), f"{where}: {a!r} != {b!r}"[:300]
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} != {b!r}"[:300]


def differing_rows(a: torch.Tensor, b: torch.Tensor) -> str:
    """The first and last differing row (dim 0) of two equal-shaped tensors."""
    if a.dim() == 0:
        return "scalar"
    d = (a.detach().reshape(a.shape[0], -1) != b.detach().reshape(b.shape[0], -1)).any(dim=1)
    idx = d.nonzero().flatten().tolist()
    return f"{idx[0]}..{idx[-1]} of {a.shape[0]}" if idx else "none (bits only)"


def differs(a: Any, b: Any) -> bool:
    try:
        same(a, b)
    except AssertionError:
        return True
    return False


def clone(tree: Any) -> Any:
    """A copy of ``tree`` whose tensors (and DTensors) are new."""
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, tree)


def refusal(e: BaseException, leaf: str) -> bool:
    """Whether ``e`` is DeepPart refusing the save/load by naming ``leaf``."""
    return isinstance(e, deeppart.DeepPartError) and leaf in str(e)


def committed(d: Path) -> bool:
    return (d / "COMMITTED").exists()


def saved_or_refused(
    checks: Checks, label: str, note: str, state: Any, d: Path, leaf: str, group: Any = None
) -> bool:
    """Saves ``state`` to ``d`` under the check ``label``; a refusal that
    names ``leaf`` is accepted (noted; nothing may be committed) and
    returns True, any other error fails the check."""
    refused = False
    with checks.sub(label):
        try:
            deeppart.save(state, d, group=group)
        except deeppart.DeepPartError as e:
            if not refusal(e, leaf):
                raise
            refused = True
            checks.notes.append(f"{note}: refused: {one_line(e, 200)}")
            assert not committed(d), "refused, yet committed"
    return refused


def rng_bytes(rank: int) -> bytes:
    """A rank's torch CPU RNG state after seeding it per rank, as bytes."""
    g = torch.Generator()
    g.manual_seed(1234 + rank)
    return bytes(g.get_state().numpy())


# ----------------------------------------------------------------------------
# The models.


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = nn.Linear(DIM, DIM)
        self.ffn = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.ffn(torch.relu(self.attn(self.norm(x))))
        return out


class Stage(nn.Module):
    """One pipeline stage as torchtitan builds it: the embedding on the
    first stage, blocks under ``layers.<id>``, norm and output on the last."""

    def __init__(self, layer_ids: tuple[int, ...], first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM) if first else None
        self.layers = nn.ModuleDict({str(i): Block() for i in layer_ids})
        self.norm = nn.LayerNorm(DIM) if last else None
        self.output = nn.Linear(DIM, VOCAB, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None and self.output is not None:
            h = self.output(self.norm(h))
        return h


def pp_mesh(pp: int, dp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))


def build_stage(
    mesh: Any, stage: int, layer_ids: tuple[int, ...], seed: int, extras: bool = True
) -> tuple[nn.Module, Any, Any]:
    """Stage ``stage``'s model (seeded with ``seed``, the same on the ranks
    of its dp group), each block and then the whole stage ``fully_shard``-ed
    on ``mesh["dp"]``; AdamW after two steps (three from seed 50: the load
    targets) on this rank's own batches and a LambdaLR scheduler stepped
    with it. Without ``extras``: the blocks only."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Stage(layer_ids, first=extras and stage == 0, last=extras and stage == 1)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    for _ in range(2 + seed // 50):  # the targets (seed >= 50) one step further
        train_step(model, opt, g)
        sched.step()
    return model, opt, sched


def train_step(model: Any, opt: Any, g: torch.Generator) -> None:
    """One optimizer step of a :class:`Stage` on a batch drawn from ``g``."""
    if model.tok_embeddings is not None:
        x = torch.randint(VOCAB, (2, 5), generator=g)
    else:
        x = torch.randn(2, 5, DIM, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def model_optim(model: nn.Module, opt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and flattened optimizer state dicts, as torchtitan takes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))


def to_full(tree: Any) -> Any:
    """``tree`` with every DTensor gathered into a plain tensor (collective
    over each DTensor's mesh)."""
    from torch.distributed.tensor import DTensor

    return tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, tree)


# ----------------------------------------------------------------------------
# Scenario 1: torchtitan's PP(2) x FSDP2(2).


def pp_state(
    mesh: Any, seed: int, loader: dict[str, int], rng: bytes
) -> tuple[dict[str, Any], Any]:
    stage = mesh.get_local_rank("pp")
    model, opt, sched = build_stage(mesh, stage, STAGE_LAYERS[stage], seed + stage)
    msd, osd = model_optim(model, opt)
    state = {
        "model": msd,
        "optim": osd,
        "lr_scheduler": sched.state_dict(),
        "loader": loader,
        "rng": rng,
    }
    return state, (model, opt, sched)


def scenario_pp_fsdp(d: Path, checks: Checks) -> None:
    """torchtitan's PP(2) x FSDP2(2) state, saved without ``group=``, loaded
    with ``into=`` a perturbed state of the same layout: bitwise."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    rank = dist.get_rank()
    mesh = pp_mesh(2, 2)
    stage = mesh.get_local_rank("pp")
    state, _ = pp_state(mesh, 10, {"epoch": 3, "batches_seen": 100 + rank}, rng_bytes(rank))
    assert any(k.startswith(f"layers.{STAGE_LAYERS[stage][0]}.") for k in state["model"])
    expected = clone(state)
    # Each stage's full tensors for the 2-rank reshard (collective on dp).
    full = {
        "model": to_full(state["model"]),
        "optim": to_full(state["optim"]),
        "lr_scheduler": state["lr_scheduler"],
    }
    if mesh.get_local_rank("dp") == 0:
        torch.save(full, d.parent / f"pp_fsdp-stage{stage}-full.pt")

    with checks.sub("save without group="):
        deeppart.save(state, d)
    saved = committed(d)
    dist.barrier()

    with checks.sub("load(into=) at the same layout"):
        assert saved, "nothing committed"
        target, (model, opt, sched) = pp_state(
            pp_mesh(2, 2), 70, {"epoch": 0, "batches_seen": -1}, rng_bytes(rank + 40)
        )
        # A scheduler's state does not depend on the seed: one step makes it differ.
        opt.step()
        sched.step()
        target["lr_scheduler"] = sched.state_dict()
        for key in ("model", "optim", "lr_scheduler", "loader", "rng"):
            assert differs(target[key], expected[key]), f"the target's {key} equals the saved one"
        out = deeppart.load(d, into=target)
        same(out, expected, "out")
        same(target["loader"], expected["loader"], "into['loader'] (in place)")
        set_state_dict(model, opt, model_state_dict=out["model"], optim_state_dict=out["optim"])
        sched.load_state_dict(out["lr_scheduler"])
        msd, osd = model_optim(model, opt)
        same(
            {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict()},
            {k: expected[k] for k in ("model", "optim", "lr_scheduler")},
            "after set_state_dict",
        )
    with checks.sub("load without into="):
        assert saved, "nothing committed"
        own = {**full, "loader": expected["loader"], "rng": expected["rng"]}
        same(deeppart.load(d), own, "full")
    with checks.sub("a second save of the same layout reuses the union (issue 46)"):
        from deeppart.saving import prepare

        again, _ = pp_state(mesh, 30, {"epoch": 4, "batches_seen": 200 + rank}, rng_bytes(rank + 8))
        again_expected = clone(again)
        full_paths: list[int] = []
        inner = prepare._union_prepare

        def counted(*args: Any, **kwargs: Any) -> Any:
            full_paths.append(1)
            return inner(*args, **kwargs)

        prepare._union_prepare = counted
        try:
            deeppart.save(again, d.with_name(d.name + "-again"))
        finally:
            prepare._union_prepare = inner
        assert not full_paths, "the second save exchanged descriptions again"
        target, _ = pp_state(
            pp_mesh(2, 2), 71, {"epoch": 0, "batches_seen": -1}, rng_bytes(rank + 50)
        )
        target["lr_scheduler"] = again_expected["lr_scheduler"]
        out = deeppart.load(d.with_name(d.name + "-again"), into=target)
        same(out, again_expected, "out")
    with checks.sub("a new param group on one stage, a changed mesh: the full path (issue 46)"):
        cache_invalidations(mesh, d.with_name(d.name + "-cache"))


def blocks_then_all(mesh: Any, stage: int, seed: int, grow: bool) -> dict[str, Any]:
    """Stage ``stage`` (seeded with ``seed``) ``fully_shard``-ed on
    ``mesh["dp"]``, AdamW over its blocks only, two steps; with ``grow``,
    its other parameters (embedding, norm, output) unfrozen as a second
    param group and one more step: optimizer state leaves added. The model
    and flattened optimizer state dicts."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Stage(STAGE_LAYERS[stage], first=stage == 0, last=stage == 1)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    named = list(model.named_parameters())
    opt = torch.optim.AdamW([p for n, p in named if n.startswith("layers.")], lr=1e-2)
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    train_step(model, opt, g)
    train_step(model, opt, g)
    if grow:
        opt.add_param_group({"params": [p for n, p in named if not n.startswith("layers.")]})
        train_step(model, opt, g)
    msd, osd = model_optim(model, opt)
    return {"model": msd, "optim": osd}


def cache_invalidations(mesh: Any, d: Path) -> None:
    """Issue 46, what invalidates a cached union, with FSDP2 state on
    gloo: a save of the same structure reuses it (no exchange), a new
    param group on stage 1 alone sends every rank down the full path (stage
    0's structure is unchanged), and so does a mesh that places the stages
    on other ranks ((pp, dp) = [[0, 2], [1, 3]]: ranks 1 and 2 change
    stage; ranks 0 and 3 keep their stage, shard and tree, only their
    DTensors' mesh changed); each save loads back bitwise."""
    from torch.distributed.device_mesh import DeviceMesh

    from deeppart.saving import prepare

    full_paths: list[str] = []
    inner = prepare._union_prepare

    def counted(*args: Any, **kwargs: Any) -> Any:
        full_paths.append(name)
        return inner(*args, **kwargs)

    moved = DeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]), mesh_dim_names=("pp", "dp"))
    saves = [
        ("blocks", mesh, False),  # AdamW over the blocks only: a new structure
        ("blocks-again", mesh, False),  # the same structure: the cached union
        ("grown", mesh, True),  # stage 1 adds a param group
        ("moved-mesh", moved, True),  # the stages on other ranks
    ]
    prepare._union_prepare = counted
    try:
        for k, (name, m, grown) in enumerate(saves):
            stage = m.get_local_rank("pp")
            state = blocks_then_all(m, stage, 80 + k, grown and stage == 1)
            expected = clone(state)
            deeppart.save(state, d / name)
            target = blocks_then_all(m, stage, 90 + k, grown and stage == 1)
            same(deeppart.load(d / name, into=target), expected, name)
    finally:
        prepare._union_prepare = inner
    assert full_paths == ["blocks", "grown", "moved-mesh"], full_paths


# ----------------------------------------------------------------------------
# Scenario 3: plain values that differ between ranks.


def scenario_per_rank_values(d: Path, checks: Checks) -> None:
    """Per-rank plain values: each rank gets its own back at the same world
    size, with and without ``into=``. The first state's values encode to the
    same length on every rank, the second's to different lengths."""
    rank = dist.get_rank()
    states = {
        "same-length": {
            "loader": {"epoch": 3, "batches_seen": 100 + rank},
            "host": f"host-{rank}",
            "seen": [rank] * 3,
            "rng": rng_bytes(rank),
            "w": torch.arange(6.0),  # a replicated tensor beside them
        },
        "other-length": {
            "loader": {"epoch": 3, "batches_seen": 10**rank},
            "name": "r" * (rank + 1),
            "ids": list(range(rank + 1)),
            "blob": bytes(range(3 * rank + 1)),
        },
    }
    for kind, state in states.items():
        expected = clone(state)
        path = d / kind
        with checks.sub(f"{kind}: save"):
            deeppart.save(state, path)
        ok = committed(path)
        dist.barrier()
        with checks.sub(f"{kind}: load without into="):
            assert ok, "nothing committed"
            same(deeppart.load(path), expected, f"{kind}")
        with checks.sub(f"{kind}: load(into=)"):
            assert ok, "nothing committed"
            target = {k: perturb(v) for k, v in state.items()}
            assert all(differs(target[k], expected[k]) for k in expected)
            out = deeppart.load(path, into=target)
            same(out, expected, f"{kind} into")
            same(target["loader"], expected["loader"], f"{kind} into['loader'] (in place)")


def perturb(v: Any) -> Any:
    """Another value of the same kind (and, for strings and bytes, length)."""
    if isinstance(v, torch.Tensor):
        return torch.zeros_like(v)
    if isinstance(v, dict):
        return {k: perturb(x) for k, x in v.items()}
    if isinstance(v, list):
        return [perturb(x) for x in v]
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return -7 - v
    if isinstance(v, str):
        return "z" * len(v)
    if isinstance(v, bytes):
        return bytes(255 - b for b in v)
    raise TypeError(type(v))


# ----------------------------------------------------------------------------
# Scenario 4: two stages that reuse module names.


def scenario_reused_names(d: Path, checks: Checks) -> None:
    """Stages 0 and 1 both name their blocks ``layers.0``, ``layers.1``
    (same shapes, other values), each FSDP2 on its dp sub-mesh: each rank
    restores its own stage bitwise, or every rank refuses naming a leaf."""
    mesh = pp_mesh(2, 2)
    stage = mesh.get_local_rank("pp")

    def state(seed: int) -> dict[str, Any]:
        model, opt, _ = build_stage(mesh, stage, (0, 1), seed + stage, extras=False)
        msd, osd = model_optim(model, opt)
        return {"model": msd, "optim": osd}

    mine = state(20)
    expected = clone(mine)
    full = to_full(expected)
    if saved_or_refused(checks, "save", "reused_names", mine, d, "layers.0."):
        return
    dist.barrier()
    with checks.sub("load(into=) at the same layout"):
        assert committed(d), "nothing committed"
        target = state(80)
        assert differs(target, expected)
        same(deeppart.load(d, into=target), expected, "out")
    with checks.sub("load without into="):
        same(deeppart.load(d), full, "full")


# ----------------------------------------------------------------------------
# Scenario 5: group="auto" over two DP groups.


#: The embedding table of scenario 5 (rows, width): 500 rows of 64 bytes.
EMB_ROWS, EMB_DIM = 500, 16


def unsampled_rows() -> list[int]:
    """Rows 100..399 of the table except those that hold bytes the sampled
    replica check reads (deeppart.saving.prepare.sample_bytes: blocks at its start,
    middle and end)."""
    from deeppart.saving.prepare import SAMPLE_BLOCKS, SAMPLE_BYTES

    row = EMB_DIM * 4
    size = EMB_ROWS * row
    step = max(1, (size - SAMPLE_BYTES) // max(1, SAMPLE_BLOCKS - 1))
    hit: set[int] = set()
    for k in range(SAMPLE_BLOCKS):
        a = min(k * step, size - SAMPLE_BYTES)
        hit.update(range(a // row, (a + SAMPLE_BYTES - 1) // row + 1))
    return [r for r in range(100, 400) if r not in hit]


def group_model(g: int) -> dict[str, torch.Tensor]:
    """Group ``g``'s model: the embedding of group 1 differs from group 0's
    only in :func:`unsampled_rows`; each group's head has a name and shape
    of its own (so the groups' trees differ, as two models' do)."""
    gen = torch.Generator().manual_seed(5)
    emb = torch.randn(EMB_ROWS, EMB_DIM, generator=gen)
    if g:
        emb[unsampled_rows()] += 1.0
    gen.manual_seed(50 + g)
    return {
        "emb.weight": emb,
        f"head{g}.weight": torch.randn(8 + 4 * g, EMB_DIM, generator=gen),
        f"head{g}.bias": torch.randn(8 + 4 * g, generator=gen),
    }


def scenario_auto_swap(d: Path, checks: Checks) -> None:
    """Two DP groups ({0,1}, {2,3}) whose embeddings differ only in rows no
    sample reads: with ``group="auto"`` and without ``group=``, each group
    restores its own embedding bitwise, or every rank refuses naming it."""
    from deeppart.saving.prepare import sample_bytes

    g = dist.get_rank() // 2
    a, b = group_model(0)["emb.weight"], group_model(1)["emb.weight"]
    if sample_bytes(a) != sample_bytes(b):  # the precondition of the case
        checks.notes.append("auto_swap: the sampled bytes of the two embeddings differ")
    for variant, group in (("group=auto", "auto"), ("no group=", None)):
        path = d / variant.replace("=", "-").replace(" ", "")
        state = {"model": group_model(g)}
        expected = clone(state)
        note = f"auto_swap {variant}"
        if saved_or_refused(checks, f"{variant}: save", note, state, path, "emb.weight", group):
            continue
        dist.barrier()
        with checks.sub(f"{variant}: load(into=)"):
            assert committed(path), "nothing committed"
            target = clone(state)
            for t in target["model"].values():
                t.zero_()
            out = deeppart.load(path, into=target, group=group)
            same(out, expected, f"group {g}")


# ----------------------------------------------------------------------------
# Scenario 6: a differing HSDP replica.


def version_lists(msg: str) -> list[set[int]]:
    """The rank lists ``[a, b, ...]`` a message names."""
    return [{int(x) for x in m.split(",")} for m in re.findall(r"\[(\d+(?:,\s*\d+)*)\]", msg)]


def check_names_versions(e: BaseException, leaf: str) -> None:
    """``e`` is a ReplicaMismatchError naming ``leaf``, rank 0's version and
    rank 2's as different (never "the minority" of two holders)."""
    assert isinstance(e, deeppart.ReplicaMismatchError), f"{type(e).__name__}: {one_line(e)}"
    msg = str(e)
    assert leaf in msg, f"does not name {leaf}: {one_line(e)}"
    lists = version_lists(msg)
    assert {0} in lists and {2} in lists, (
        f"does not say ranks [0] and [2] hold different versions: {one_line(e)}"
    )
    assert not any({0, 2} <= s for s in lists), f"puts ranks 0 and 2 in one version: {one_line(e)}"
    assert "minority" not in msg, f"speaks of a minority of two holders: {one_line(e)}"


def scenario_hsdp_replica(d: Path, checks: Checks) -> None:
    """HSDP (2,2): equal replicas save and load back; rank 2's copy of
    ``2.weight``'s shard 0 changed: the default save and
    ``verify_replicas=True`` refuse on every rank, naming the leaf and the
    ranks of each version, and commit nothing."""
    from torch.distributed.tensor import DTensor

    from bench.dtensor import build, sharded_state

    m, opt = build("hsdp", seed=1)
    state = sharded_state(m, opt)
    with checks.sub("equal replicas"):
        deeppart.save(state, d / "equal")
        m2, opt2 = build("hsdp", seed=9)
        same(deeppart.load(d / "equal", into=sharded_state(m2, opt2)), state, "equal replicas")
    weight = state["model"]["2.weight"]
    assert isinstance(weight, DTensor)
    if dist.get_rank() == 2:
        with torch.no_grad():
            weight.to_local().add_(1.0)  # every byte of rank 2's copy of shard 0
    for variant, verify in (("default", False), ("verify_replicas=True", True)):
        path = d / variant.split("=")[0]
        with checks.sub(variant):
            try:
                deeppart.save(state, path, writing=deeppart.WriteOptions(verify_replicas=verify))
            except Exception as e:
                if lost_step(e):
                    raise
                check_names_versions(e, "2.weight")
            else:
                raise AssertionError("saved although rank 2's replica of 2.weight differs")
            finally:
                dist.barrier()
            assert not path.exists(), "the refused save left its directory"


# ----------------------------------------------------------------------------
# Scenario 2: the PP(2) x FSDP2(2) checkpoint resharded to PP(2) x FSDP(1).


def reshard_checks(d: Path, checks: Checks) -> None:
    rank = dist.get_rank()  # = the stage
    ckpt = d / "pp_fsdp"
    ref = torch.load(d / f"pp_fsdp-stage{rank}-full.pt", weights_only=True)
    per_rank_error = getattr(deeppart, "PerRankStateError", None)

    def target() -> dict[str, Any]:
        state, _ = pp_state(
            pp_mesh(2, 1), 70, {"epoch": 0, "batches_seen": -1}, rng_bytes(rank + 40)
        )
        assert differs(to_full(state["model"]), ref["model"])
        return state

    def check_tensors(out: dict[str, Any], how: str) -> None:
        same(to_full(out["model"]), ref["model"], f"{how}: model")
        same(to_full(out["optim"]), ref["optim"], f"{how}: optim")
        same(out["lr_scheduler"], ref["lr_scheduler"], f"{how}: lr_scheduler")

    with checks.sub("without per_rank="):
        try:
            out = deeppart.load(ckpt, into=target())
        except Exception as e:
            if lost_step(e):
                raise
            assert per_rank_error is not None and isinstance(e, per_rank_error), (
                f"{type(e).__name__} (not PerRankStateError): {one_line(e)}"
            )
            # A plain subtree without tensors is one leaf (docs/FORMAT.md):
            # the per-rank path is "loader", whose batches_seen differs.
            assert "loader" in str(e) and "rng" in str(e), (
                f"does not name loader and rng: {one_line(e)}"
            )
            assert "per_rank" in str(e), f"does not say which per_rank= to pass: {one_line(e)}"
        else:
            raise AssertionError(
                f"loaded at another world size without per_rank=: loader/batches_seen="
                f"{out['loader']['batches_seen']}"
            )
    with checks.sub('per_rank="drop"'):
        mine = target()
        out = deeppart.load(ckpt, into=mine, per_rank="drop")
        check_tensors(out, "drop")
        assert out["loader"] == {"epoch": 0, "batches_seen": -1}, out["loader"]
        assert out["rng"] == rng_bytes(rank + 40), "rng is not the target's own"
        keys = deeppart.last_incompatible_keys()
        missing = keys.missing_keys if keys is not None else []
        assert "loader" in missing and "rng" in missing, f"missing keys {missing}"
    with checks.sub("per_rank=0"):
        out = deeppart.load(ckpt, into=target(), per_rank=0)
        check_tensors(out, "per_rank=0")
        assert out["loader"] == {"epoch": 3, "batches_seen": 100}, out["loader"]
        assert out["rng"] == rng_bytes(0), "rng is not rank 0's"
    with checks.sub('per_rank="all" without into='):
        out = deeppart.load(ckpt, per_rank="all")
        stages = [torch.load(d / f"pp_fsdp-stage{s}-full.pt", weights_only=True) for s in (0, 1)]
        union = {
            "model": {**stages[0]["model"], **stages[1]["model"]},
            "optim": {**stages[0]["optim"], **stages[1]["optim"]},
            "lr_scheduler": stages[0]["lr_scheduler"],
            # "loader" is one leaf (a plain subtree without tensors).
            "loader": {f"ranks:{r}": {"epoch": 3, "batches_seen": 100 + r} for r in range(4)},
            "rng": {f"ranks:{r}": rng_bytes(r) for r in range(4)},
        }
        same(out, union, "all")
    with checks.sub("per_rank=<callable>"):
        seen: list[tuple[Any, list[Any]]] = []

        def rank3(path: tuple[Any, ...], versions: dict[tuple[int, ...], Any]) -> Any:
            seen.append((path, sorted(versions)))
            return versions[(3,)]

        out = deeppart.load(ckpt, into=target(), per_rank=rank3)
        check_tensors(out, "callable")
        assert out["loader"] == {"epoch": 3, "batches_seen": 103}, out["loader"]
        assert out["rng"] == rng_bytes(3), "rng is not rank 3's"
        calls = {tuple(map(str, p))[-1]: v for p, v in seen}
        every = [(0,), (1,), (2,), (3,)]
        assert calls.get("loader") == every and calls.get("rng") == every, seen


# ----------------------------------------------------------------------------


def run_all(
    job: str, names: list[str], scenario: Callable[[str], Callable[[Path, Checks], None]], d: Path
) -> None:
    for name in names:
        checks = Checks()
        path = d / name
        try:
            scenario(name)(path, checks)
        except Exception as e:
            if lost_step(e):
                print_line(
                    f"RESULT {name} FAIL rank {dist.get_rank()}: the ranks lost step: {one_line(e)}"
                )
                sys.stdout.flush()
                os._exit(3)
            checks.failed.append(f"{type(e).__name__}: {one_line(e)}")
        report(name, checks)
    if dist.get_rank() == 0:
        print_line(f"DONE {job}")


def main() -> None:
    job, d, *only = sys.argv[1:]
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    try:
        if job == "four":
            assert dist.get_world_size() == 4
            run_all(job, only or list(SCENARIOS), lambda n: globals()[f"scenario_{n}"], Path(d))
        elif job == "reshard":
            assert dist.get_world_size() == 2
            run_all(job, ["reshard"], lambda n: lambda p, c: reshard_checks(p.parent, c), Path(d))
        else:
            raise SystemExit(f"unknown job {job}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from mpi_checkpoint import run_then_exit

    run_then_exit(main)
