"""Multi-level scenarios on simulated nodes (tests/support/cluster.py), run by
tests/levels/test_cluster.py as
``mpiexec -n K ENTER python tests/levels/cluster_worker.py SHARED LOCAL NODE_SIZE SCENARIO[:G]...``
(every rank inside its node's namespaces: a private tmpfs at LOCAL, the
node-local ``ckpt_dir``, and its own host name; ``:G`` runs that scenario
with groups of G nodes).

Nodes are real hosts here (``local_test = 0``): a rank's node is its host.
A node "lost" inside a launch is one whose ranks delete the scenario's
files from their own storage (no other node could reach them); a node
*replaced* between launches, nodes reordered on a restart and ranks
SIGKILLed are done by the test. Every restore must be bitwise identical to
what was saved. Rank 0 appends ``{"scenario", "step", "levels", "moved"}``
per restore to ``SHARED/results.jsonl``; every rank creates
``SHARED/ok/<scenario>.<rank>`` when its checks pass. A failed check
raises and aborts the job.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import mpi_checkpoint as mc

from deeppart.checkpointer import Checkpointer
from deeppart.comm import Comm, resolve
from deeppart.errors import UnrecoverableError
from deeppart.levels import LevelConfig, RecoveryReport
from deeppart.levels.engine import BuiltinBackend
from deeppart.saving import writer


class Ctx:
    def __init__(self, shared: Path, local: Path, node_size: int, group: int, comm: Comm) -> None:
        self.shared = shared
        self.local = local
        self.node_size = node_size
        self.group = group
        self.comm = comm
        self.nodes = comm.size // node_size
        #: This rank's node in the job (its slot): nodes are numbered in
        #: order of their lowest rank, and the launch gives each node
        #: node_size consecutive ranks.
        self.node = comm.rank // node_size

    def config(self, name: str, **kw: Any) -> LevelConfig:
        return LevelConfig.from_dict(
            {
                "ckpt_dir": str(self.local),
                "meta_dir": str(self.shared / "meta"),
                "glbl_dir": str(self.shared / "global"),
                "node_size": self.node_size,
                "group_size": self.group,
                "ckpt_l1": 1,
                "ckpt_l2": 2,
                "ckpt_l3": 0,
                "ckpt_l4": 0,
                "local_test": 0,
                "exec_id": name,
                **kw,
            }
        )

    def backend(self, name: str) -> BuiltinBackend:
        # Small stripes, so L3 codes several stripes and rounds.
        return BuiltinBackend(self.config(name), self.comm, stripe_bytes=8192)

    def lose(self, name: str, *nodes: int) -> None:
        """Nodes ``nodes`` (of this job) lose every file of scenario
        ``name``: their own ranks delete them, from their own storage."""
        self.comm.barrier()
        if self.node in nodes and self.comm.rank % self.node_size == 0:
            for d in glob.glob(str(self.local / "*" / name)):
                shutil.rmtree(d)
        self.comm.barrier()

    def record(self, name: str, report: RecoveryReport) -> None:
        if self.comm.rank == 0:
            row = {
                "scenario": name,
                "step": report.step,
                "levels": report.levels,
                "moved": len(getattr(report, "moved", [])),
            }
            with open(self.shared / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")

    def restore(self, name: str, seed: int, step: int | None = None) -> RecoveryReport:
        state, report = self.backend(name).load(step)
        mc.assert_bitwise_equal(mc.make_state(seed), state, name)
        self.record(name, report)
        return report

    def expected(self, level: int, lost: set[int]) -> list[int] | None:
        """The level that must serve each rank after losing ``lost`` nodes
        (None: the step is lost), from the engine's rules (docs/LEVELS.md)."""
        out: list[int] = []
        g = self.group
        for r in range(self.comm.size):
            node = r // self.node_size
            first = node // g * g
            if node not in lost:
                out.append(1)
            elif level == 2 and first + (node - first + 1) % g not in lost:
                out.append(2)
            elif level == 3 and sum(1 for k in range(first, first + g) if k in lost) * 2 <= g:
                out.append(3)
            elif level == 4:
                out.append(4)
            else:
                return None
        return out

    def lose_and_restore(self, name: str, level: int, *lost: int) -> None:
        """Saves at ``level``, loses ``lost``, restores (or checks that the
        loss is beyond repair), then restores again: all L1 (rewritten)."""
        seed = 40 + level
        self.backend(name).save(seed, mc.make_state(seed), level=level)
        self.lose(name, *lost)
        want = self.expected(level, set(lost))
        if want is None:
            try:
                self.backend(name).load()
            except UnrecoverableError as e:
                assert "lost at every level" in str(e), e
                return
            raise AssertionError(f"{name}: losing nodes {lost} at L{level} did not raise")
        report = self.restore(name, seed)
        assert report.levels == want, (report, want)
        again = self.restore(name, seed)
        assert again.levels == [1] * self.comm.size, again


# ----------------------------------------------------------------------------
# Scenarios.


def s_private(x: Ctx) -> None:
    """Every node has its own host name and storage: a file a node writes
    to its node-local path is invisible from every other node."""
    host = socket.gethostname()
    hosts = [h.decode() for h in x.comm.allgather_varbytes(host.encode())]
    for r, h in enumerate(hosts):
        same = r // x.node_size == x.node
        assert (h == host) == same, f"rank {r} on {h}, rank {x.comm.rank} on {host}"
    probe = x.local / f"probe-{host}"
    if x.comm.rank % x.node_size == 0:
        probe.write_text(host)
    x.comm.barrier()
    seen = sorted(p.name for p in x.local.glob("probe-*"))
    assert seen == [probe.name], f"{host} sees {seen}"
    x.comm.barrier()
    if x.comm.rank % x.node_size == 0:
        probe.unlink()


def s_steps(x: Ctx) -> None:
    """Checkpointer(config=) lists the steps the backend can recover (the
    last one is latest())."""
    cp = Checkpointer(x.shared / "unused", comm=x.comm, config=x.config("steps"), backend="builtin")
    for s in (1, 2, 3):
        cp.save(s, mc.make_state(s))
    assert cp.latest() == 3, cp.latest()
    assert cp.steps() == [2, 3], cp.steps()  # keep = 2
    x.lose("steps", *range(x.nodes))  # L1 step 3 gone; step 2 (L2) too
    assert cp.latest() is None and cp.steps() == [], (cp.latest(), cp.steps())


def s_l1(x: Ctx) -> None:
    x.lose_and_restore("l1", 1)


def s_l2one(x: Ctx) -> None:
    x.lose_and_restore("l2one", 2, x.nodes - 1)


def s_l2adj(x: Ctx) -> None:
    """Two adjacent nodes lost: across two groups, or a whole group of 2."""
    x.lose_and_restore("l2adj", 2, 1, 2 % x.nodes)


def s_l3one(x: Ctx) -> None:
    x.lose_and_restore("l3one", 3, 0)


def s_l3adj(x: Ctx) -> None:
    x.lose_and_restore("l3adj", 3, 1, 2 % x.nodes)


def s_l4all(x: Ctx) -> None:
    """All node-local storage lost: every rank from the global copy."""
    x.lose_and_restore("l4all", 4, *range(x.nodes))


def s_replace_save(x: Ctx) -> None:
    """Before node 1 is replaced: an L2 and an L3 checkpoint."""
    x.backend("replace2").save(52, mc.make_state(52), level=2)
    x.backend("replace3").save(53, mc.make_state(53), level=3)


def s_replace_check(x: Ctx) -> None:
    """Node 1 was replaced (fresh storage): L2/L3 serve its ranks and rebuild
    its files; then a second loss, of the node that served it, is survived."""
    for name, level in (("replace2", 2), ("replace3", 3)):
        seed = 50 + level
        report = x.restore(name, seed)
        assert report.levels == x.expected(level, {1}), report
        # L2: node 1's copies were held by its successor; lose that one now.
        # L3: any other node of the group.
        first = 1 // x.group * x.group
        other = first + (1 - first + 1) % x.group if level == 2 else first + (2 - first) % x.group
        if other == 1:
            other = first
        x.lose(name, other)
        report = x.restore(name, seed)
        assert report.levels == x.expected(level, {other}), (report, other)


def s_crash(x: Ctx) -> None:
    """Step 1 committed at L2; the last node's ranks are SIGKILLed while
    writing step 2 (after their data files are written)."""
    be = x.backend("crash")
    be.save(1, mc.make_state(1), level=2)
    if x.node == x.nodes - 1:
        writer.add_fault_hook("after-write", lambda _event: os.kill(os.getpid(), signal.SIGKILL))
    be.save(2, mc.make_state(2), level=2)
    raise AssertionError("the save should not have finished")


def s_after_crash(x: Ctx) -> None:
    """After the crash (and node 1 replaced): step 1 is served, step 2 was
    never committed; a new save commits and removes step 2's leftovers."""
    be = x.backend("crash")
    assert be.committed_steps() == [1], be.committed_steps()
    report = x.restore("crash", 1)
    assert report.step == 1 and report.levels == x.expected(2, {1}), report
    be.save(3, mc.make_state(3), level=1)
    assert be.committed_steps() == [1, 3], be.committed_steps()
    assert not glob.glob(str(x.local / "*" / "crash" / "step-00000002")), "step 2 left over"


def s_reorder_save(x: Ctx) -> None:
    """Before a restart on the same hosts in another order: L1, L2 and L3."""
    for level in (1, 2, 3):
        name = f"reorder{level}"
        x.backend(name).save(60 + level, mc.make_state(60 + level), level=level)


def s_reorder_check(x: Ctx) -> None:
    """Restarted with the nodes reordered, nothing deleted: every level is
    recovered from node-local data (never L4), files moved between nodes
    as needed; the moved files are stored, so a second restore is L1 with
    nothing to move."""
    for level in (1, 2, 3):
        name = f"reorder{level}"
        be = x.backend(name)
        assert be.latest() == 60 + level, (name, be.latest())
        report = x.restore(name, 60 + level)
        assert set(report.levels) == {1}, report
        assert report.moved, report
        again = x.restore(name, 60 + level)
        assert again.levels == [1] * x.comm.size and not again.moved, again


def s_inspect_save(x: Ctx) -> None:
    """For `deeppart inspect`: an L2, an L3 and an L4 checkpoint (glbl_dir
    is set for all three)."""
    for level in (2, 3, 4):
        x.backend(f"insp{level}").save(70 + level, mc.make_state(70 + level), level=level)


# Real FTI (tests/levels/test_cluster.py runs these when libfti is found): one
# FTI_Init per process, so each job saves or restores one checkpoint.
# "fti_save:L" saves at level L and ends without FTI_Finalize (a crash:
# FTI keeps its files); "fti_restore:L" is the restart, after the test
# removed what level L protects against.


def fti_backend(x: Ctx, level: int) -> Any:
    from deeppart.levels.fti import FTIBackend

    # FTI's groups: every node of the job (2 or 4).
    cfg = x.config(f"fti{level}", group_size=x.nodes, ckpt_l2=0)
    return FTIBackend(cfg, x.comm)


def s_fti_save(x: Ctx) -> None:
    level = x.group
    be = fti_backend(x, level)
    be.save(80 + level, mc.make_state(80 + level), level=level)
    assert be.latest() == 80 + level
    be.close(finalize=False)


def s_fti_restore(x: Ctx) -> None:
    level = x.group
    be = fti_backend(x, level)
    try:
        assert be.latest() == 80 + level, be.latest()
        state, report = be.load()
        mc.assert_bitwise_equal(mc.make_state(80 + level), state, f"fti L{level}")
        x.record(f"fti{level}", report)
    finally:
        be.close()


SCENARIOS: dict[str, Callable[[Ctx], None]] = {
    "private": s_private,
    "steps": s_steps,
    "l1": s_l1,
    "l2one": s_l2one,
    "l2adj": s_l2adj,
    "l3one": s_l3one,
    "l3adj": s_l3adj,
    "l4all": s_l4all,
    "replace_save": s_replace_save,
    "replace_check": s_replace_check,
    "crash": s_crash,
    "aftercrash": s_after_crash,
    "reorder_save": s_reorder_save,
    "reorder_check": s_reorder_check,
    "inspect_save": s_inspect_save,
    "fti_save": s_fti_save,
    "fti_restore": s_fti_restore,
}


def main() -> None:
    shared, local, node_size, *names = sys.argv[1:]
    comm = resolve(None)
    (Path(shared) / "ok").mkdir(parents=True, exist_ok=True)
    for item in names:
        name, _, group = item.partition(":")
        nodes = comm.size // int(node_size)
        x = Ctx(Path(shared), Path(local), int(node_size), int(group or min(nodes, 2)), comm)
        SCENARIOS[name](x)
        mc.scenario_done(x.shared, name, comm)


if __name__ == "__main__":
    mc.abort_on_failure(main)
