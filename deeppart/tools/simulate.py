"""``deeppart simulate``: predicted save time versus world size, for every
planning algorithm, rank-0 ``torch.save``, DCP-style dedup and DeepPart's
storage levels. The model and its assumptions: docs/SIMULATOR.md.

The prediction for one plan is the planner's own modelled time of it
(``Plan.modelled_time``, the one model in ``planner/src/planning/plan.rs``), under
this machine's cost model for the level written to (``StorageModel.cost_model``):
a *fluid bottleneck* model in which every resource (a rank's own write
stream, a node's local storage or network link, the parallel file system)
moves bytes at its bandwidth, shared perfectly among its users::

    T = max( fixed_s + max_r (pieces_r * piece_s + bytes_r / rank_bw),  # one stream
             fixed_s + max_n  bytes_n / node_bw(level),                  # one node
             fixed_s + bytes  / shared_bw(level) )                       # all nodes
      + writers * writer_s
      + level extra (partner copy, parity: phases after the write)

Nothing here restates that formula: the simulator and the planner cannot
disagree.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deeppart import _planner

ALGORITHMS = ("balanced", "lpt", "greedy", "deeppart")
LEVELS = ("L1", "L2", "L3", "L4")
BASELINES = ("torch.save", "dcp-dedup")


@dataclass(frozen=True)
class StorageModel:
    """The machine, per node and shared. Bandwidths in bytes per second."""

    ranks_per_node: int = 4
    rank_bw: float = 1.0e9  # one process's write stream (serialise + write)
    local_bw: float = 2.0e9  # a node's local SSD (L1, L2, L3)
    pfs_bw: float = 20.0e9  # the parallel file system, shared by all nodes (L4)
    net_bw: float = 12.5e9  # a node's network link (to the PFS, and L2/L3 copies)
    fixed_s: float = 2e-3  # per writing rank: open, fsync, close
    piece_s: float = 20e-6  # per piece
    writer_s: float = 200e-6  # per writer, serialised by the shared storage
    tensor_s: float = 5e-6  # torch.save per tensor (pickling, record headers)
    rs_group: int = 8  # L3: nodes per Reed-Solomon group, parity included
    rs_parity: int = 2  # L3: parity blocks per group
    encode_bw: float = 2.0e9  # L3: parity encoding per node

    def cost_model(
        self, bandwidth: float | None = None, level: str | None = None
    ) -> _planner.CostModel:
        """The planner's cost model of this machine; with ``level``, the
        shared bandwidths of the storage that level writes to (a node's
        storage or link, and the parallel file system) are in it too, so the
        planner chooses its writers under the same limits as the prediction."""
        node_bw = shared_bw = math.inf
        if level is not None:
            node_bw, shared_bw = _level_limits(self, level, 1)
        return _planner.CostModel(
            fixed_s=self.fixed_s,
            piece_s=self.piece_s,
            bandwidth=bandwidth if bandwidth is not None else self.rank_bw,
            writer_s=self.writer_s,
            node_bandwidth=node_bw if math.isfinite(node_bw) else None,
            aggregate_bandwidth=shared_bw if math.isfinite(shared_bw) else None,
        )

    @staticmethod
    def from_profile(profile: dict[str, Any], **overrides: Any) -> StorageModel:
        """A model from a calibration profile (``deeppart calibrate``): its
        measured per-rank write bandwidth, fixed, piece and per-tensor costs
        replace the defaults; other fields keep theirs.

        The profile measured one storage, the one the checkpoints go to: its
        parallel-stream bandwidth (``node_bw``) is both the node-local
        storage (L1-L3) and the shared storage of L4 (``pfs_bw``), not an
        assumed parallel file system. For a file system whose bandwidth over
        many nodes exceeds what one node measured, give ``pfs_bw``."""
        params = profile.get("params", profile)
        base = StorageModel()
        kw: dict[str, Any] = {}
        mapping = {"write_bw": "rank_bw", "fixed_s": "fixed_s", "piece_s": "piece_s",
                   "tensor_s": "tensor_s", "writer_s": "writer_s",
                   "node_bw": "local_bw"}  # fmt: skip
        for src, dst in mapping.items():
            if isinstance(params.get(src), int | float) and math.isfinite(params[src]):
                kw[dst] = float(params[src])
        if "local_bw" in kw:
            kw["pfs_bw"] = kw["local_bw"]
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return replace(base, **kw)


def ranks_per_node(model: StorageModel, world_size: int) -> int:
    """The ranks per node at ``world_size``: all ranks on one node when there
    are fewer than ``model.ranks_per_node``; one per node when the world size
    is not a multiple of it."""
    rpn = min(model.ranks_per_node, world_size)
    return rpn if world_size % rpn == 0 else 1


@dataclass
class Prediction:
    """One predicted save."""

    method: str  # "balanced", ..., "torch.save", "dcp-dedup", "deeppart-L2", ...
    world_size: int
    seconds: float
    writers: int
    max_rank_bytes: int
    bound: str  # the binding resource: "rank", "node", "shared", "fixed"
    plan_ms: float = 0.0
    extra_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _level_limits(model: StorageModel, level: str, nodes: int) -> tuple[float, float]:
    """(per-node bandwidth, shared bandwidth) of the storage a level writes to."""
    if level == "L4":
        return model.net_bw, model.pfs_bw
    return model.local_bw, math.inf  # L1-L3 write node-local storage


def planning_bandwidth(
    model: StorageModel, world_size: int, level: str, writers: int | None = None
) -> float:
    """The per-rank bandwidth the planner plans with: the least of a rank's
    stream, its share of its node's storage (or link) and its share of the
    shared storage, when ``writers`` ranks (default: all) write, spread over
    the nodes."""
    rpn = ranks_per_node(model, world_size)
    nodes = world_size // rpn
    k = world_size if writers is None else max(1, min(writers, world_size))
    per_node = math.ceil(k / nodes)
    node_bw, shared_bw = _level_limits(model, level, nodes)
    return min(model.rank_bw, node_bw / per_node, shared_bw / k)


def _binding(model: StorageModel, t: _planner._ModelledTime, cost: _planner.CostModel) -> str:
    """The resource that decides a modelled time: "rank", "node", "shared",
    or "fixed" when the fixed and per-writer costs outweigh it."""
    terms = {
        "rank": max(t["rank_costs"], default=0.0) - cost.fixed_s,
        "node": t["node_s"] - cost.fixed_s,
        "shared": t["aggregate_s"] - cost.fixed_s,
    }
    bound = max(terms, key=lambda k: terms[k])
    if terms[bound] < cost.fixed_s + t["writers"] * cost.writer_s:
        bound = "fixed"
    return bound


def _level_extra(model: StorageModel, level: str, nodes: int, big: int) -> float:
    """Seconds a level adds after the write, for the busiest node's ``big``
    bytes: L2's partner copy, L3's parity (NaN where the level needs more
    nodes than there are). Not part of the planner's model: these phases
    come after the planned write and do not depend on the plan's choices."""
    if level == "L2":
        # Partner copy: every node sends its part to a partner node, which
        # writes it to its own local storage, after the local write.
        return big / min(model.net_bw, model.local_bw) if nodes > 1 else math.nan
    if level == "L3":
        g = min(model.rs_group, nodes)
        m = model.rs_parity
        if g <= m:
            return math.nan
        # Encoding a group's parity moves each node's data over the network
        # once per parity block (reduce-scatter), encodes it, and writes the
        # node's share of parity, m/(g-m) of its data.
        parity = big * m / (g - m)
        return big * m / model.net_bw + big * m / model.encode_bw + parity / model.local_bw
    return 0.0


def evaluate(
    model: StorageModel,
    rank_bytes: Sequence[int],
    rank_pieces: Sequence[int],
    level: str,
) -> tuple[float, str, float]:
    """(seconds, binding resource, level extra seconds) of writing
    ``rank_bytes[r]`` in ``rank_pieces[r]`` pieces from every rank r: the
    planner's own model (``_planner.model_time``) with this machine's cost
    model for ``level``, plus the level's extra phases."""
    world = len(rank_bytes)
    rpn = ranks_per_node(model, world)
    cost = model.cost_model(level=level)
    t = _planner.model_time(
        cost, list(rank_pieces), list(rank_bytes), topology=_planner.Topology(rpn)
    )
    return _result(model, t, cost, level, world // rpn, rpn)


def _result(
    model: StorageModel,
    t: _planner._ModelledTime,
    cost: _planner.CostModel,
    level: str,
    nodes: int,
    rpn: int,
) -> tuple[float, str, float]:
    rb = t["rank_bytes"]
    big = max((sum(rb[n * rpn : (n + 1) * rpn]) for n in range(nodes)), default=0)
    extra = _level_extra(model, level, nodes, big)
    return t["makespan"] + extra, _binding(model, t, cost), extra


def predict_plan(model: StorageModel, plan: _planner.Plan, level: str, method: str) -> Prediction:
    """The prediction for one plan: the planner's modelled time of it under
    this machine's cost model for ``level`` and its ranks per node
    (``Plan.modelled_time``; for a plan made with that cost model and
    topology, exactly its ``stats.makespan``), plus the level's extra
    phases. The machine's topology, not the plan's, decides which ranks
    share a node: a plan made for one rank per node still runs on this
    machine's nodes."""
    cost = model.cost_model(level=level)
    rpn = ranks_per_node(model, plan.world_size)
    t = plan.modelled_time(cost, _planner.Topology(rpn))
    seconds, bound, extra = _result(model, t, cost, level, plan.world_size // rpn, rpn)
    rb = t["rank_bytes"]
    return Prediction(
        method=method,
        world_size=plan.world_size,
        seconds=seconds,
        writers=t["writers"],
        max_rank_bytes=max(rb),
        bound=bound,
        plan_ms=plan.stats.plan_ms,
        extra_s=extra,
    )


def predict_torch_save(
    model: StorageModel, manifest: _planner.Manifest, world_size: int
) -> Prediction:
    """Rank 0 pickles and writes everything to the PFS; the others wait."""
    total = manifest.total_bytes
    tensors = sum(1 for lf in manifest.leaves() if lf["kind"] == "tensor")
    bw = min(model.rank_bw, model.net_bw, model.pfs_bw)
    seconds = model.fixed_s + model.writer_s + tensors * model.tensor_s + total / bw
    return Prediction("torch.save", world_size, seconds, 1, total, "rank")


def _best_plan(
    model: StorageModel,
    manifest: _planner.Manifest,
    p: int,
    topo: _planner.Topology,
    alg: str,
    lvl: str,
) -> Prediction:
    """Plans with the level's storage model (per-rank, per-node and shared
    bandwidth in the planner's cost model), and predicts that plan."""
    cost = model.cost_model(level=lvl)
    plan = _planner.plan(manifest, p, algorithm=alg, cost=cost, topology=topo)
    return predict_plan(model, plan, lvl, alg)


def simulate(
    manifest: _planner.Manifest,
    world_sizes: Sequence[int],
    model: StorageModel,
    *,
    algorithms: Sequence[str] = ALGORITHMS,
    levels: Sequence[str] = LEVELS,
    level: str = "L4",
) -> list[Prediction]:
    """Predictions for every world size: each algorithm written to ``level``,
    torch.save, DCP-style dedup (greedy) to L4, and the balanced plan at each
    of ``levels`` (``deeppart-L1`` ...)."""
    out: list[Prediction] = []
    for p in world_sizes:
        topo = _planner.Topology(ranks_per_node(model, p))
        out.append(predict_torch_save(model, manifest, p))
        cache: dict[tuple[str, str], Prediction] = {}
        for alg, lvl in (
            {(a, level) for a in algorithms}
            | {("greedy", "L4")}
            | {("balanced", lv) for lv in levels}
        ):
            cache[(alg, lvl)] = _best_plan(model, manifest, p, topo, alg, lvl)
        out += [replace(cache[(alg, level)], method=alg) for alg in algorithms]
        out.append(replace(cache[("greedy", "L4")], method="dcp-dedup"))
        out += [replace(cache[("balanced", lv)], method=f"deeppart-{lv}") for lv in levels]
    return out


def default_world_sizes(max_ranks: int = 65536) -> list[int]:
    out, p = [], 1
    while p <= max_ranks:
        out.append(p)
        p *= 2
    return out


def parse_world_sizes(text: str) -> list[int]:
    """``"1,2,4"``, ``"1-4096"`` (powers of two) or a mix."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if "-" in part:
            lo, hi = (int(x) for x in part.split("-", 1))
            p = lo
            while p <= hi:
                out.append(p)
                p *= 2
        elif part:
            out.append(int(part))
    if not out or any(p < 1 or p > 1 << 20 for p in out):
        raise ValueError(f"bad world sizes {text!r}")
    return sorted(set(out))


def table(preds: Sequence[Prediction]) -> str:
    """Seconds per method (columns) and world size (rows), and the speed-up of
    the balanced plan over torch.save."""
    methods: list[str] = []
    for pr in preds:
        if pr.method not in methods:
            methods.append(pr.method)
    sizes = sorted({pr.world_size for pr in preds})
    by = {(pr.method, pr.world_size): pr for pr in preds}
    head = ["ranks", *methods, "speed-up"]
    rows: list[list[str]] = []
    for p in sizes:
        row = [str(p)]
        for m in methods:
            got = by.get((m, p))
            row.append("-" if got is None or math.isnan(got.seconds) else f"{got.seconds:.3f}")
        ts, bal = by.get(("torch.save", p)), by.get(("balanced", p))
        row.append(f"{ts.seconds / bal.seconds:.1f}x" if ts and bal else "-")
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# Speed-ups over torch.save that the thesis behind DeepPart reported, on 16
# nodes x 4 processes = 64 ranks.
THESIS_SPEEDUPS: dict[str, tuple[int, float]] = {
    "BERT-large": (64, 2.1),
    "BERT-large, compressed": (64, 2.7),
    "20 GB model": (64, 5.6),
}


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("storage model (docs/SIMULATOR.md; defaults in brackets)")
    d = StorageModel()
    g.add_argument("--profile", help="calibration profile name or JSON file (deeppart calibrate)")
    g.add_argument("--ranks-per-node", type=int, help=f"[{d.ranks_per_node}]")
    g.add_argument("--rank-bw", type=float, help=f"one rank's write stream, B/s [{d.rank_bw:g}]")
    g.add_argument("--local-bw", type=float, help=f"node-local storage, B/s [{d.local_bw:g}]")
    g.add_argument("--pfs-bw", type=float, help=f"PFS, all nodes together, B/s [{d.pfs_bw:g}]")
    g.add_argument("--net-bw", type=float, help=f"network link per node, B/s [{d.net_bw:g}]")
    g.add_argument("--fixed-s", type=float, help=f"[{d.fixed_s:g}]")
    g.add_argument("--piece-s", type=float, help=f"[{d.piece_s:g}]")
    g.add_argument("--writer-s", type=float, help=f"[{d.writer_s:g}]")
    g.add_argument("--rs-group", type=int, help=f"L3 group size in nodes [{d.rs_group}]")
    g.add_argument("--rs-parity", type=int, help=f"L3 parity blocks per group [{d.rs_parity}]")


def storage_from_args(args: argparse.Namespace) -> StorageModel:
    overrides = {
        k: getattr(args, k, None)
        for k in ("ranks_per_node", "rank_bw", "local_bw", "pfs_bw", "net_bw", "fixed_s",
                  "piece_s", "writer_s", "rs_group", "rs_parity")
    }  # fmt: skip
    profile: dict[str, Any] = {}
    if getattr(args, "profile", None):
        from deeppart.tools.calibrate import load_profile

        profile = load_profile(args.profile)
    return StorageModel.from_profile(profile, **overrides)


def run(args: argparse.Namespace) -> int:
    from deeppart.tools.manifest_source import read_manifest as load_manifest

    try:
        manifest = load_manifest(args.model)
        sizes = parse_world_sizes(args.ranks)
        model = storage_from_args(args)
    except (OSError, ValueError, _planner.DeepPartError) as e:
        print(f"deeppart: error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        preds = simulate(manifest, sizes, model, level=args.level)
    except _planner.DeepPartError as e:
        print(f"deeppart: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - t0
    if args.json:
        print(json.dumps({
            "model": args.model, "total_bytes": manifest.total_bytes, "leaves": len(manifest),
            "storage": asdict(model), "level": args.level,
            "predictions": [asdict(p) for p in preds],
        }))  # fmt: skip
    else:
        print(
            f"{args.model}: {len(manifest)} leaves, {manifest.total_bytes / 1e9:.2f} GB; "
            f"algorithms write to {args.level}; predicted seconds (docs/SIMULATOR.md)"
        )
        source = f"profile {args.profile}" if getattr(args, "profile", None) else "defaults"
        print(
            f"storage ({source}): rank stream {model.rank_bw / 1e9:.2f} GB/s, node-local "
            f"{model.local_bw / 1e9:.2f} GB/s per node, shared (L4) {model.pfs_bw / 1e9:.2f} GB/s"
        )
        print(table(preds))
        print(f"simulated in {elapsed:.2f} s")
    if args.plot:
        from deeppart.tools.plotting import plot_scaling

        thesis = THESIS_SPEEDUPS if args.thesis else None
        plot_scaling(preds, args.plot, title=args.title or f"{args.model}: predicted save time",
                     thesis=thesis)  # fmt: skip
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate", help="predict save time vs world size for every algorithm and level"
    )
    p.add_argument(
        "--model", "-m", default="bert-large",
        help="built-in model (bert-base, bert-large, gpt2, gpt2-medium, gpt2-xl, llama-1b, "
        "llama-3b, llama-7b, llama-13b) or a manifest JSON file [bert-large]",
    )  # fmt: skip
    p.add_argument(
        "--ranks", "-p", default="1-4096",
        help="world sizes: '1,2,4', or 'LO-HI' for powers of two (up to 65536) [1-4096]",
    )  # fmt: skip
    p.add_argument("--level", choices=LEVELS, default="L4",
                   help="where the algorithms' plans write [L4]")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the predictions as JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of time and speed-up vs ranks")
    p.add_argument("--title", help="the plot's title")
    p.add_argument("--thesis", action="store_true",
                   help="mark the thesis's reported speed-ups (64 ranks) on the plot")  # fmt: skip
    add_storage_arguments(p)
    p.set_defaults(func=run)
