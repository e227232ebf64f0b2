"""Plain state held by a subset of the ranks (deeppart.loading.groups): two
data-parallel groups in one job (model A on ranks {0,1}, B on {2,3}) and
TP x DP with plain ``to_local()`` shards, on 4 gloo ranks under torchrun
(tests/loading/groups_worker.py); loaded back at the same layout, on 2 ranks and in
one process, bitwise; the same through BalancedSavePlanner and stock
dcp.load. One 4-rank job runs every save scenario.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_ranks  # noqa: E402

import deeppart  # noqa: E402
from deeppart.loading.groups import group_ranks, load_view, namespace  # noqa: E402

WORKER = Path(__file__).resolve().parent / "groups_worker.py"
#: The MLP of each group (in, hidden, out): 3.8 MB of float32 parameters,
#: 11.4 MB with AdamW's two moments; 23 MB for the two groups.
DIMS = "700,680,700"


def run(n: int, *args: str) -> str:
    return run_ranks(WORKER, n, *args)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("groups")
    return d, run(4, "save", str(d), DIMS)


@pytest.mark.multirank
@pytest.mark.slow
def test_two_dp_groups_save_balanced_within_each_group(saved: tuple[Path, str]) -> None:
    """4 ranks, A on {0,1} and B on {2,3} (23 MB with AdamW): group="auto"
    and group=<ProcessGroup> each write one checkpoint of the whole job with
    the slowest rank's data <= 1.02 x the ideal (unique bytes / ranks), and
    load back bitwise at the same layout; TP x DP to_local() shards with
    group=<dp group> too; async_save with group= holds the values at the
    call, balanced as well. BalancedSavePlanner balances the items only a
    group lists (no DcpPlanError), never worse than DCP's default, and stock
    dcp.load reads it back bitwise. Without group= (issue 32: the union of
    the groups' trees) and with "auto" over equal paths that differ (two
    versions) the save commits and each rank loads its own group's tree
    (checked in the worker); group= on some ranks only is refused."""
    d, out = saved
    figures = {
        line.split()[1]: float(line.split()[2])
        for line in out.splitlines()
        if line.startswith("BALANCE ")
    }
    assert sorted(figures) == ["async", "auto", "dcp-balanced", "dcp-default", "explicit", "tp"]
    for name in ("async", "auto", "explicit", "tp", "dcp-balanced"):
        assert figures[name] <= 1.02, figures
    assert figures["dcp-balanced"] <= figures["dcp-default"], figures
    for name in ("async", "auto", "explicit", "tp", "none", "same"):
        assert (d / name / "COMMITTED").exists()
    assert not (d / "some").exists()


@pytest.mark.multirank
@pytest.mark.slow
def test_two_dp_groups_load_on_two_ranks(saved: tuple[Path, str]) -> None:
    """Rank 0 loads A's state, rank 1 B's (deeppart.load with group= "auto"
    and with the saved group's ranks; stock dcp.load), bitwise."""
    run(2, "load2", str(saved[0]), DIMS)


def test_two_dp_groups_load_in_one_process(saved: tuple[Path, str]) -> None:
    """One process: without a target, the whole job's state; into= one
    group's state; a key not in the checkpoint fails clearly; dcp.load."""
    from groups_worker import scenario_load1

    a, b, c = (int(x) for x in DIMS.split(","))
    scenario_load1(saved[0], (a, b, c))  # in this process


def test_group_arguments() -> None:
    assert group_ranks([3, 1, 1]) == [1, 3]
    assert namespace([0, 1]) == "ranks:0,1"
    with pytest.raises(deeppart.StateError, match="does not hold this rank"):
        group_ranks([0, 1], rank=2)
    with pytest.raises(deeppart.StateError, match="ProcessGroup, a list of ranks"):
        group_ranks("dp")
    view = load_view([2, 3], {"w": torch.zeros(2)}, None, 0)
    assert view.keys == [("ranks:2,3", "w")] and view.unwrap == "ranks:2,3"
    with pytest.raises(deeppart.StateError, match="needs into="):
        load_view("auto", None, None, 0)
