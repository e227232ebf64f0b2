"""The ``deeppart`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from deeppart import _planner
from deeppart.service.options import add_serve_arguments


def _fail(message: str) -> int:
    print(f"deeppart: error: {message}", file=sys.stderr)
    return 2


def _cost_from_args(args: argparse.Namespace) -> _planner.CostModel:
    if getattr(args, "profile", None):
        from deeppart.tools.calibrate import cost_model_from_profile, load_profile

        return cost_model_from_profile(
            load_profile(args.profile),
            fixed_s=args.fixed_s,
            piece_s=args.piece_s,
            bandwidth=args.bandwidth,
            writer_s=args.writer_s,
            min_piece_bytes=args.min_piece_bytes,
        )
    return _planner.CostModel(
        fixed_s=args.fixed_s,
        piece_s=args.piece_s,
        bandwidth=args.bandwidth,
        writer_s=args.writer_s,
        min_piece_bytes=args.min_piece_bytes,
    )


#: Largest --world-size / --ranks-per-node (the planner's ranks are u32).
MAX_RANKS = (1 << 32) - 1


def _rank_count(text: str) -> int:
    """An argparse type: an integer of at most :data:`MAX_RANKS` (the
    planner explains a value below 1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value > MAX_RANKS:
        raise argparse.ArgumentTypeError(f"{value} is more than {MAX_RANKS}")
    return value


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _cmd_plan(args: argparse.Namespace) -> int:
    from deeppart.errors import CheckpointError
    from deeppart.tools.manifest_source import read_manifest

    try:
        manifest = read_manifest(args.manifest)
    except OSError as e:
        return _fail(f"cannot read {args.manifest}: {e.strerror}")
    except CheckpointError as e:  # not a regular file, too large, or bad metadata
        return _fail(f"cannot read {args.manifest}: {e}")
    except (_planner.DeepPartError, ValueError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    try:
        plan = _planner.plan(
            manifest,
            args.world_size,
            algorithm=args.algorithm,
            cost=_cost_from_args(args),
            topology=_planner.Topology(args.ranks_per_node),
        )
    except (_planner.DeepPartError, ValueError, OverflowError) as e:
        return _fail(f"{type(e).__name__}: {e}")
    stats = plan.stats.to_dict()
    if args.json:
        out = {
            "fingerprint": plan.fingerprint,
            "algorithm": plan.algorithm,
            "world_size": plan.world_size,
            "leaves": len(manifest),
            "total_bytes": manifest.total_bytes,
            **stats,
        }
        print(json.dumps(out))
    else:
        rows = [
            ("manifest", f"{len(manifest)} leaves, {_human_bytes(manifest.total_bytes)}"),
            ("world size", str(plan.world_size)),
            ("algorithm", plan.algorithm),
            ("makespan", f"{plan.stats.makespan * 1e3:.3f} ms (modelled)"),
            ("lower bound", f"{plan.stats.lower_bound * 1e3:.3f} ms"),
            ("gap", f"{plan.stats.gap:.4f}"),
            ("writers", str(plan.stats.writers)),
            ("pieces", f"{plan.stats.pieces} ({plan.stats.splits} from splits)"),
            ("slowest rank", _human_bytes(plan.stats.max_rank_bytes)),
            ("plan time", f"{plan.stats.plan_ms:.3f} ms"),
            ("fingerprint", plan.fingerprint),
        ]
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            print(f"{k:<{width}}  {v}")
    if args.output:
        Path(args.output).write_text(plan.to_json())
    if args.plot:
        from deeppart.tools.plotting import plot_plan_load

        baseline = _planner.plan(
            manifest,
            args.world_size,
            algorithm="greedy",
            cost=plan.cost,
            topology=plan.topology,
        )
        plot_plan_load(plan, baseline if plan.algorithm != "greedy" else None, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deeppart", description="Partitioned parallel checkpointing of replicated state."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan a manifest and print the plan's quality")
    p.add_argument(
        "manifest", help="manifest JSON file (deeppart manifest makes one), a checkpoint "
        "directory or its metadata.json, a .safetensors file, or a built-in model name"
    )  # fmt: skip
    p.add_argument("--world-size", "-p", type=_rank_count, required=True, help="number of ranks")
    p.add_argument("--algorithm", "-a", default="balanced", choices=_planner.ALGORITHMS)
    p.add_argument("--ranks-per-node", type=_rank_count, default=1)
    p.add_argument("--json", action="store_true", help="print the stats as one JSON object")
    p.add_argument("--output", "-o", help="also write the whole plan as JSON to this file")
    p.add_argument(
        "--plot", help="write a PNG of the per-rank load beside DCP-style dedup (greedy)"
    )
    g = p.add_argument_group("cost model (defaults: the planner's)")
    g.add_argument("--fixed-s", type=float)
    g.add_argument("--piece-s", type=float)
    g.add_argument("--bandwidth", type=float, help="bytes per second per rank")
    g.add_argument("--writer-s", type=float)
    g.add_argument("--min-piece-bytes", type=int)
    g.add_argument("--profile", help="a calibration profile (deeppart calibrate); flags override")
    p.set_defaults(func=_cmd_plan)

    # The plan cache's upkeep (issue 3).
    from deeppart.tools.cache_cli import add_parser as add_cache_parser

    add_cache_parser(sub)

    # Manifests from checkpoints, safetensors files and built-in models (issue 17).
    from deeppart.tools.manifest_source import add_parser as add_manifest_parser

    add_manifest_parser(sub)

    # Checkpoint inspection (issue 8).
    from deeppart.tools.checkpoint_inspect import add_parser as add_inspect_parser

    add_inspect_parser(sub)

    # The scaling simulator and calibration (issue 8); matplotlib only with --plot.
    from deeppart.tools.calibrate import add_parser as add_calibrate_parser
    from deeppart.tools.simulate import add_parser as add_simulate_parser

    add_simulate_parser(sub)
    add_calibrate_parser(sub)

    # The planner service (issue 4); grpcio is imported only when it runs.
    p = sub.add_parser("serve", help="run the gRPC planner service shared by many jobs")
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)

    # The checkpoint demo (issue 5); torch and mpi4py are imported only when it runs.
    from deeppart.tools.demo import add_parser as add_demo_parser

    add_demo_parser(sub)

    # Export to safetensors / torch.save and import (issue 16); torch and
    # safetensors are imported only when they run.
    from deeppart.tools.export import add_parsers as add_export_parsers

    add_export_parsers(sub)
    return parser


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        from deeppart.service.server import serve
    except ImportError as e:
        return _fail(f"deeppart serve needs grpcio (pip install 'deeppart[service]'): {e}")
    return serve(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader went away (``deeppart ... | head``): not an error of
        # ours. Point stdout at /dev/null so the exit flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE, as a shell reports it
    return result


if __name__ == "__main__":
    raise SystemExit(main())
