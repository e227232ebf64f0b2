"""PNG plots (matplotlib, Agg backend): the simulator's scaling plot and a
plan's per-rank load. Each function returns the Figure, so tests (and
callers) can check its axes' labels."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from deeppart import _planner


class Point(Protocol):
    """One predicted time (a :class:`deeppart.tools.simulate.Prediction`)."""

    @property
    def method(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def seconds(self) -> float: ...


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


_STYLE: dict[str, dict[str, Any]] = {
    "torch.save": {"color": "black", "linestyle": "--", "marker": "x"},
    "dcp-dedup": {"color": "tab:gray", "linestyle": ":", "marker": "s"},
    "balanced": {"color": "tab:blue", "marker": "o"},
    "lpt": {"color": "tab:orange", "marker": "^", "linestyle": "--"},
    "greedy": {"color": "tab:brown", "marker": "v", "linestyle": ":"},
    "deeppart": {"color": "tab:purple", "marker": "D"},
    "deeppart-L1": {"color": "tab:green", "linestyle": "-."},
    "deeppart-L2": {"color": "tab:olive", "linestyle": "-."},
    "deeppart-L3": {"color": "tab:cyan", "linestyle": "-."},
    "deeppart-L4": {"color": "tab:red", "linestyle": "-."},
}


def plot_scaling(
    preds: Sequence[Point],
    path: str | os.PathLike[str] | None,
    *,
    title: str = "predicted save time",
    methods: Sequence[str] | None = None,
    thesis: Mapping[str, tuple[int, float]] | None = None,
) -> Figure:
    """Two panels over world size (log axes): predicted seconds per method,
    and speed-up over rank-0 torch.save. ``thesis``: reported speed-ups
    ``{label: (ranks, speed-up)}`` drawn as points. Writes ``path`` (PNG)."""
    plt = _pyplot()
    all_methods: list[str] = []
    for pr in preds:
        if pr.method not in all_methods:
            all_methods.append(pr.method)
    shown = [m for m in (methods or all_methods) if m in all_methods]
    base = {pr.world_size: pr.seconds for pr in preds if pr.method == "torch.save"}
    fig: Figure
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 5.6))
    # Methods predicted the same at every world size (e.g. "balanced" and
    # "deeppart-L4" when the algorithms write to L4) are one curve with one
    # label naming them all, not several curves drawn over each other.
    curves: list[tuple[list[str], list[int], list[float]]] = []
    for m in shown:
        pts = sorted(
            (pr.world_size, pr.seconds)
            for pr in preds
            if pr.method == m and not math.isnan(pr.seconds)
        )
        if not pts:
            continue
        xs, ys = [p for p, _ in pts], [t for _, t in pts]
        for names, cx, cy in curves:
            same = all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(cy, ys, strict=True))
            if cx == xs and same:
                names.append(m)
                break
        else:
            curves.append(([m], xs, ys))
    for names, xs, ys in curves:
        style = _STYLE.get(names[0], {})
        label = " = ".join(names)
        ax_t.plot(xs, ys, label=label, markersize=5, linewidth=1.6, alpha=0.9, **style)
        if names[0] != "torch.save" and base:
            sp = [(x, base[x] / y) for x, y in zip(xs, ys, strict=True) if x in base and y > 0]
            # Same colours as the left panel; the legend below names them.
            ax_s.plot([x for x, _ in sp], [s for _, s in sp], markersize=5, linewidth=1.6,
                      alpha=0.9, **style)  # fmt: skip
    if thesis:
        for i, (label, (ranks, speedup)) in enumerate(thesis.items()):
            ax_s.scatter([ranks], [speedup], marker="*", s=160, zorder=5,
                         color=("gold", "orange", "red", "magenta")[i % 4],
                         edgecolors="black", label=f"thesis: {label} ({speedup}x)")  # fmt: skip
    ax_s.axhline(1.0, color="black", linewidth=0.8)
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks (data-parallel processes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("predicted save time (s)")
    ax_s.set_ylabel("speed-up over rank-0 torch.save (x)")
    ax_t.set_title(title)
    ax_s.set_title("speed-up over torch.save")
    # One legend for both panels, below them: it covers no data.
    h1, l1 = ax_t.get_legend_handles_labels()
    h2, l2 = ax_s.get_legend_handles_labels()
    fig.legend(h1 + h2, l1 + l2, loc="lower center", ncol=min(4, len(l1 + l2)), fontsize=8,
               frameon=False)  # fmt: skip
    rows = -(-len(l1 + l2) // 4)
    fig.tight_layout(rect=(0, min(0.06 * rows + 0.02, 0.4), 1, 1))
    if path is not None:
        fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return fig


def plot_plan_load(
    plan: _planner.Plan,
    baseline: _planner.Plan | None,
    path: str | os.PathLike[str] | None,
    *,
    max_bars: int = 256,
) -> Figure:
    """Per-rank bytes of ``plan`` beside ``baseline`` (DCP-style dedup, the
    greedy plan) as bars, with each plan's modelled cost per rank as dashed
    lines on a second axis and its makespan as a dotted line: the slowest
    rank's cost plus the per-writer cost the shared storage serialises
    (``writers x writer_s``), which is why it sits above every rank's own
    cost. More than ``max_bars`` ranks: lines only."""
    plt = _pyplot()
    fig: Figure
    fig, ax = plt.subplots(figsize=(11, 6))
    plans = [(plan, f"{plan.algorithm} (this plan)", "tab:blue")]
    if baseline is not None:
        plans.append((baseline, f"{baseline.algorithm} (DCP-style dedup)", "tab:gray"))
    n = plan.world_size
    ranks = list(range(n))
    width = 0.8 / len(plans)
    ax2 = ax.twinx()
    for i, (pl, label, color) in enumerate(plans):
        mib = [b / 2**20 for b in pl.rank_bytes()]
        ms = [c * 1e3 for c in pl.rank_costs()]
        if n <= max_bars:
            ax.bar([r + (i - (len(plans) - 1) / 2) * width for r in ranks], mib, width,
                   label=f"{label}: bytes", color=color, alpha=0.7)  # fmt: skip
        else:
            ax.plot(ranks, mib, label=f"{label}: bytes", color=color, linewidth=0.8)
        slowest = max(ms, default=0.0)
        ax2.plot(ranks, ms, color=color, linestyle="--", linewidth=1,
                 label=f"{label}: each rank's own cost (max {slowest:.1f} ms)")  # fmt: skip
        # The makespan is more than the slowest rank's own cost: the shared
        # storage serialises each writer's setup (writers x writer_s).
        serial = pl.stats.writers * pl.cost.writer_s * 1e3
        ax2.axhline(pl.stats.makespan * 1e3, color=color, linestyle=":", linewidth=1.2,
                    label=f"{label}: makespan {pl.stats.makespan * 1e3:.1f} ms = slowest rank "
                    f"{slowest:.1f} ms + {pl.stats.writers} writers x "
                    f"{pl.cost.writer_s * 1e3:.2f} ms serialised ({serial:.1f} ms)")  # fmt: skip
    ax.set_xlabel("rank")
    ax.set_ylabel("bytes written (MiB)")
    ax2.set_ylabel("modelled cost per rank (ms)")
    ax2.set_ylim(bottom=0)
    ax.set_title(f"per-rank load, {n} ranks, {plan.manifest.total_bytes / 2**20:.1f} MiB")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14),
              ncol=2 if len(plans) > 1 else 1)  # fmt: skip
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return fig
