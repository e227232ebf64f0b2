"""Multi-level storage scenarios, run by tests/levels/test_levels.py as
``mpiexec -n K python tests/levels/levels_worker.py ROOT NODE_SIZE GROUP_SIZE SCENARIO[:G]...``
(``:G``: that scenario with group_size G).

Every scenario saves a real model + AdamW state (tests/support/mpi_checkpoint.py)
through the built-in engine with fake nodes (local_test = 1), damages the
node-local files as a lost node, a corrupt or a truncated file would, then
restores with a fresh backend and checks the result is bitwise identical.
Rank 0 appends ``{"scenario", "step", "levels"}`` of every restore to
``ROOT/levels.jsonl``; every rank creates ``ROOT/ok/<scenario>.<rank>`` when
its checks pass (files: mpiexec may interleave the ranks' stdout lines). A
failed check raises, so mpiexec exits non-zero.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

import mpi_checkpoint as mc
import numpy as np

from deeppart.async_save import AsyncSave
from deeppart.checkpointer import Checkpointer
from deeppart.comm import Comm, resolve
from deeppart.errors import CheckpointError, LevelConfigError
from deeppart.format import HEADER_SIZE, PIECE_FIELDS, data_file_name
from deeppart.levels import LevelConfig, LevelSaveStats, RecoveryReport, partner
from deeppart.levels.engine import BuiltinBackend
from deeppart.levels.layout import partner_file, step_name
from deeppart.saving import writer


class Ctx:
    def __init__(self, root: Path, node_size: int, group_size: int, comm: Comm) -> None:
        self.root = root
        self.node_size = node_size
        self.group_size = group_size
        self.comm = comm
        self.nodes = comm.size // node_size
        #: Where results go (files, not stdout: mpiexec may interleave lines).
        self.results = root

    def config(self, name: str, **kw: Any) -> LevelConfig:
        return LevelConfig.from_dict(
            {
                "ckpt_dir": str(self.root / "local"),
                "meta_dir": str(self.root / "meta"),
                "glbl_dir": str(self.root / "global"),
                "node_size": self.node_size,
                "group_size": self.group_size,
                "ckpt_l1": 1,
                "ckpt_l2": 2,
                "ckpt_l3": 3,
                "ckpt_l4": 4,
                "local_test": 1,
                "exec_id": name,
                **kw,
            }
        )

    def backend(self, name: str, **kw: Any) -> BuiltinBackend:
        # Small stripes, so L3 codes several stripes and rounds.
        return BuiltinBackend(self.config(name), self.comm, stripe_bytes=8192, **kw)

    def on_root(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` (the damage) on rank 0 only, between barriers: no rank
        may still be inspecting the files it changes."""
        self.comm.barrier()
        if self.comm.rank == 0:
            fn()
        self.comm.barrier()

    def node_dir(self, name: str, node: int) -> Path:
        return self.root / "local" / f"node{node}" / name

    def lose_nodes(self, name: str, *nodes: int) -> None:
        def lose() -> None:
            for k in nodes:
                shutil.rmtree(self.node_dir(name, k), ignore_errors=True)

        self.on_root(lose)

    def layout_node_of_pred(self, node: int) -> int:
        """The node whose ranks' files ``node``'s ranks hold copies of (the
        previous node of its group's ring)."""
        sector = node // self.group_size * self.group_size
        return sector + (node - sector - 1) % self.group_size

    def file(self, name: str, step: int, rank: int) -> Path:
        node = rank // self.node_size
        return self.node_dir(name, node) / step_name(step) / data_file_name(rank)

    def restore(
        self, name: str, seed: int, step: int | None = None, into: bool = False
    ) -> RecoveryReport:
        be = self.backend(name)
        target = mc.make_state(seed + 100) if into else None
        state, report = be.load(step, into=target)
        mc.assert_bitwise_equal(mc.make_state(seed), state, name)
        if target is not None:
            assert state["model"] is target["model"] or all(
                state["model"][k] is target["model"][k] for k in target["model"]
            ), "into= did not fill the given tensors"
        if self.comm.rank == 0:
            row = {"scenario": name, "step": report.step, "levels": report.levels}
            with open(self.results / "levels.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        return report


def flip_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE)
        b = f.read(1)
        f.seek(HEADER_SIZE)
        f.write(bytes([b[0] ^ 0xFF]))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


# ----------------------------------------------------------------------------
# Scenarios. Each returns nothing; raising fails it.


def s_none(x: Ctx) -> None:
    """Nothing lost, every level: each served by L1; the latest of several."""
    be = x.backend("none")
    for step, lv in ((1, 1), (2, 2), (3, 3), (4, 4)):
        be.save(step, mc.make_state(step), level=lv)
        r = x.restore("none", step, step)
        assert r.levels == [1] * x.comm.size, r
    assert be.latest() == 4
    r = x.restore("none", 4, into=True)
    assert r.step == 4


def s_l2_node(x: Ctx) -> None:
    """L2: the last node's local dir deleted; its ranks served by their
    partners' copies, the lost files rewritten (a second restore is L1)."""
    x.backend("l2node").save(7, mc.make_state(7), level=2)
    x.lose_nodes("l2node", x.nodes - 1)
    r = x.restore("l2node", 7)
    lost = set(range((x.nodes - 1) * x.node_size, x.comm.size))
    assert r.levels == [2 if q in lost else 1 for q in range(x.comm.size)], r
    # Rewritten: the lost ranks' own files, and the partner copies the lost
    # node held for its neighbours (full L2 redundancy again).
    names = sorted(Path(p).name for p in r.rewritten)
    assert [n for n in names if n.startswith("rank-")] == [data_file_name(q) for q in sorted(lost)]
    assert len([n for n in names if n.startswith("partner-")]) == len(lost), r
    r = x.restore("l2node", 7)
    assert r.levels == [1] * x.comm.size, r


def s_l3_node(x: Ctx) -> None:
    """L3: node 1's local dir deleted; served by Reed-Solomon decoding."""
    x.backend("l3node").save(8, mc.make_state(8), level=3)
    x.lose_nodes("l3node", 1)
    r = x.restore("l3node", 8)
    lost = set(range(x.node_size, 2 * x.node_size))
    assert r.levels == [3 if q in lost else 1 for q in range(x.comm.size)], r
    r = x.restore("l3node", 8)
    assert r.levels == [1] * x.comm.size, r


def s_l3_half(x: Ctx) -> None:
    """L3 with a group of 4 nodes: two of them lost (half the group)."""
    x.backend("l3half").save(9, mc.make_state(9), level=3)
    x.lose_nodes("l3half", 1, 2)
    r = x.restore("l3half", 9)
    lost = set(range(x.node_size, 3 * x.node_size))
    assert r.levels == [3 if q in lost else 1 for q in range(x.comm.size)], r


def s_lose_twice(x: Ctx, name: str, level: int) -> None:
    """Lose the last node, recover, then lose the node whose copies (L2) or
    parity (L3) served it: recovery must have rebuilt the partner copies
    and parity shards the first lost node held, so the second loss is
    survivable too (full redundancy restored, not just the lost L1 files)."""
    x.backend(name).save(13, mc.make_state(13), level=level)
    last = x.nodes - 1
    x.lose_nodes(name, last)
    first = x.restore(name, 13)
    assert first.levels.count(level) == x.node_size, first
    # What recovery rewrote on the lost node: L1 files and the redundancy.
    kind = "partner-" if level == 2 else "parity-"
    again = [p for p in first.rewritten if Path(p).name.startswith(kind)]
    assert len(again) == x.node_size, first.rewritten
    other = x.layout_node_of_pred(last) if level == 2 else 0
    x.lose_nodes(name, other)
    second = x.restore(name, 13)
    lost = set(range(other * x.node_size, (other + 1) * x.node_size))
    assert second.levels == [level if q in lost else 1 for q in range(x.comm.size)], second


def s_l2_twice(x: Ctx) -> None:
    s_lose_twice(x, "l2twice", 2)


def s_l3_twice(x: Ctx) -> None:
    s_lose_twice(x, "l3twice", 3)


def s_l4_all(x: Ctx) -> None:
    """L4: all node-local storage deleted; every rank served by the global copy."""
    x.backend("l4all").save(10, mc.make_state(10), level=4)
    x.lose_nodes("l4all", *range(x.nodes))
    r = x.restore("l4all", 10)
    assert r.levels == [4] * x.comm.size, r
    r = x.restore("l4all", 10)  # the L1 files were rewritten
    assert r.levels == [1] * x.comm.size, r


def s_corrupt(x: Ctx) -> None:
    """A flipped byte in a piece (L2 step) and a truncated file (L3 step):
    the next level serves those ranks."""
    be = x.backend("corrupt")
    be.save(11, mc.make_state(11), level=2)
    be.save(12, mc.make_state(12), level=3)
    x.on_root(lambda: flip_byte(x.file("corrupt", 11, 1)))
    x.on_root(lambda: truncate(x.file("corrupt", 12, 2)))
    r = x.restore("corrupt", 11, 11)
    assert r.levels == [2 if q == 1 else 1 for q in range(x.comm.size)], r
    r = x.restore("corrupt", 12, 12)
    assert r.levels == [3 if q == 2 else 1 for q in range(x.comm.size)], r


def s_fallback(x: Ctx) -> None:
    """The newest checkpoint (L1) lost a node: the previous committed one
    (L2) is recovered instead."""
    be = x.backend("fallback")
    be.save(20, mc.make_state(20), level=2)
    be.save(21, mc.make_state(21), level=1)
    x.lose_nodes("fallback", 0)
    assert be.latest() == 20
    r = x.restore("fallback", 20)
    assert r.step == 20 and r.levels[0] == 2, r


def s_too_much(x: Ctx) -> None:
    """More loss than the levels repair: a clear error on every rank, and
    into= untouched."""
    be = x.backend("toomuch")
    be.save(30, mc.make_state(30), level=1)
    be.save(31, mc.make_state(31), level=3)
    # L1 step: any node lost is fatal; L3: more than half the group.
    lose = [0, 1] if x.group_size == 2 else [0, 1, 2]
    x.lose_nodes("toomuch", *lose)
    assert be.latest() is None
    target = mc.make_state(999)
    try:
        be.load(into=target)
    except CheckpointError as e:
        text = str(e)
        assert "no checkpoint can be recovered" in text, text
        assert "step 31" in text and "step 30" in text and "lost at every level" in text, text
    else:
        raise AssertionError("loss beyond the levels did not raise")
    mc.assert_bitwise_equal(mc.make_state(999), target, "into= after a failed load")


def s_cadence(x: Ctx) -> None:
    """No explicit level: ckpt_l2 = 2, ckpt_l3 = 3, ckpt_l4 = 4 choose the
    levels 1, 2, 3, 4 for checkpoints 1..4; keep = 2 keeps the last two."""
    be = x.backend("cadence", keep=2)
    got = [be.save(s, mc.make_state(s)).level for s in (1, 2, 3, 4)]
    assert got == [1, 2, 3, 4], got
    assert be.committed_steps() == [3, 4], be.committed_steps()
    for k in range(x.nodes):
        steps = sorted(p.name for p in x.node_dir("cadence", k).iterdir())
        assert steps == [step_name(3), step_name(4)], steps
    x.lose_nodes("cadence", *range(x.nodes))
    r = x.restore("cadence", 4)
    assert r.levels == [4] * x.comm.size


def s_checkpointer(x: Ctx) -> None:
    """deeppart.Checkpointer(config=...) delegates to the engine and
    records last_recovery."""
    cfg = x.config("cpr")
    cp = Checkpointer(x.root / "unused", comm=x.comm, config=cfg, backend="builtin")
    cp.save(5, mc.make_state(5))
    cp.save(6, mc.make_state(6))
    assert cp.latest() == 6
    x.lose_nodes("cpr", 1)
    state = cp.load()
    mc.assert_bitwise_equal(mc.make_state(6), state, "checkpointer")
    assert cp.last_recovery is not None and cp.last_recovery.step == 6
    assert cp.last_recovery.levels[x.node_size] == 2, cp.last_recovery
    assert not (x.root / "unused").exists()


def s_crash_save(x: Ctx) -> None:
    """Step 1 committed at L2; the last rank is SIGKILLed while writing step 2."""
    be = x.backend("crash")
    be.save(1, mc.make_state(1), level=2)
    if x.comm.rank == x.comm.size - 1:
        # The writer's named fault hook: after this rank's data file is written.
        writer.add_fault_hook("after-write", lambda _event: os.kill(os.getpid(), signal.SIGKILL))
    be.save(2, mc.make_state(2), level=2)
    raise AssertionError("the save should not have finished")


def s_after_crash(x: Ctx) -> None:
    """After the crash: step 1 is served; a new save cleans step 2's leftovers."""
    r = x.restore("crash", 1)
    assert r.step == 1 and r.levels == [1] * x.comm.size, r
    be = x.backend("crash")
    be.save(3, mc.make_state(3), level=1)
    for k in range(x.nodes):
        assert not (x.node_dir("crash", k) / step_name(2)).exists()


def s_io_error(x: Ctx) -> None:
    """An I/O error on one rank in the middle of the L2 transfer or the L3
    coding: the group finishes its exchanges (no hang), every rank raises,
    nothing is committed, the previous checkpoint is still served."""
    from deeppart.levels import files

    be = x.backend("ioerr")
    be.save(1, mc.make_state(1), level=1)
    real_write, real_read = files.write_file, files.read_own
    victim = x.comm.size - 1

    def bad_write(path: Path, chunks: Any) -> None:
        raise OSError(f"{path}: disk full (injected)")

    def bad_read(path: Path, size: int) -> Any:
        return real_read(path, size)[0], OSError(f"{path}: unreadable (injected)")

    for level, name, fake in ((2, "write_file", bad_write), (3, "read_own", bad_read)):
        if x.comm.rank == victim:
            setattr(files, name, fake)
        try:
            be.save(2, mc.make_state(2), level=level)
        except CheckpointError as e:
            assert "injected" in str(e), e
        except OSError as e:
            assert x.comm.rank == victim and "injected" in str(e), e
        else:
            raise AssertionError(f"L{level}: a failed save did not raise")
        finally:
            files.write_file, files.read_own = real_write, real_read
        assert be.committed_steps() == [1], be.committed_steps()
    r = x.restore("ioerr", 1)
    assert r.step == 1 and r.levels == [1] * x.comm.size, r


def s_real_hosts(x: Ctx) -> None:
    """Without local_test the node is the host: all ranks here share one,
    so node_size must be the world size (else every rank raises before any
    I/O); L1 and L4 work on that one node."""
    bad = x.config("hosts", local_test=0, ckpt_l2=0, ckpt_l3=0)
    try:
        BuiltinBackend(bad, x.comm)
    except LevelConfigError as e:
        assert f"runs {x.comm.size} rank(s)" in str(e), e
    else:
        raise AssertionError("node_size below the ranks per host was accepted")
    # Real nodes: the node directory is named by the host.
    node_dir = x.root / "local" / socket.gethostname()
    assert not (node_dir / "hosts").exists()
    cfg = bad.replace(node_size=x.comm.size)
    be = BuiltinBackend(cfg, x.comm)
    be.save(1, mc.make_state(1), level=1)
    be.save(2, mc.make_state(2), level=4)
    state, report = BuiltinBackend(cfg, x.comm).load(1)
    mc.assert_bitwise_equal(mc.make_state(1), state, "hosts")
    assert report.levels == [1] * x.comm.size, report
    assert (node_dir / "hosts").is_dir()
    x.on_root(lambda: shutil.rmtree(node_dir / "hosts", ignore_errors=True))
    _, report = BuiltinBackend(cfg, x.comm).load()
    assert report.step == 2 and report.levels == [4] * x.comm.size, report


def s_per_rank(x: Ctx) -> None:
    """Ranks holding different plain values (a loader position), per-rank
    tensors (each rank's RNG state) and items only some ranks hold, beside
    a shared model: saved at L1, L2, L3 and L4 (issue 48: before, every rank
    got rank 0's loader position back, silently, then the levels refused
    them). Each rank gets back exactly its own values, from a fresh backend,
    after its node is lost (L2 partner copy, L3 decoding, L4 from glbl_dir
    alone), and through Checkpointer(config=...)."""
    import torch

    r = x.comm.rank
    base = mc.make_state(1)
    gen = torch.Generator().manual_seed(1000 + r)
    torch.rand(3, generator=gen)

    def own(step: int) -> dict[str, Any]:
        extra: Any = torch.full((4,), float(r)) if r % 2 == 0 else {"odd": r}
        return {
            **base,
            "loader_pos": 100 + r + step,
            "rng": gen.get_state(),
            "epoch": step,  # the same on every rank
            "extra": extra,
        }

    def check(state: dict[str, Any], step: int, where: str) -> None:
        want = own(step)
        assert state["loader_pos"] == want["loader_pos"], (where, r, state["loader_pos"])
        assert state["epoch"] == step, (where, state["epoch"])
        assert torch.equal(state["rng"], want["rng"]), (where, r, "rng")
        if r % 2 == 0:
            assert torch.equal(state["extra"], want["extra"]), (where, r, state["extra"])
        else:
            assert state["extra"] == {"odd": r}, (where, r, state["extra"])
        mc.assert_bitwise_equal(base["model"], state["model"], where)

    # Each level, then (L2, L3) the last node lost: its ranks get their own
    # values from their partners' copies (L2) and the group's parity (L3);
    # then every node's local storage lost: L4 (deeppart.save's checkpoint).
    lost = set(range((x.nodes - 1) * x.node_size, x.comm.size))
    be = x.backend("perrank")
    for step, lv in ((1, 1), (2, 2), (3, 3), (4, 4)):
        be.save(step, own(step), level=lv)
        state, report = x.backend("perrank").load(step)
        assert report.levels == [1] * x.comm.size, report
        check(state, step, f"L{lv}")
        if lv == 1:
            continue
        x.lose_nodes("perrank", *(range(x.nodes) if lv == 4 else [x.nodes - 1]))
        state, report = x.backend("perrank").load(step)
        want = [lv if q in lost or lv == 4 else 1 for q in range(x.comm.size)]
        assert report.levels == want, report
        check(state, step, f"L{lv} after a node loss")
    # Through Checkpointer(config=...), into= a state of the same structure.
    ck = Checkpointer(x.root / "perrank-ck", comm=x.comm, config=x.config("perrank-ck"))
    ck.save(5, own(5))
    target = own(5)
    target["loader_pos"], target["rng"] = -1, torch.zeros_like(target["rng"])
    state = ck.load(5, into=target)
    check(state, 5, "Checkpointer")
    assert state["rng"] is target["rng"], "into= did not fill the given tensor"


def s_async(x: Ctx) -> None:
    """Asynchronous level saves over MPI (issue 48):
    ``Checkpointer(config=..., async_=True)`` on 4 MPI ranks, each level's
    step written by the writer threads over the writer's own communicator
    (a duplicate of the job's, MPI_THREAD_MULTIPLE) while the main thread
    runs collectives of its own on the job's communicator and tramples the
    live state. Each rank's own loader position and RNG tensor beside the
    shared model. Every step loads bitwise with each rank's own values,
    and after the last node is lost the L2 and L3 steps from the partner
    copies and the parity the writer threads wrote."""
    import numpy as np
    import torch

    r = x.comm.rank

    def own(step: int) -> dict[str, Any]:
        return {
            **mc.make_state(step),
            "loader_pos": 100 + r + step,
            "rng": torch.full((8,), float(10 * r + step)),
        }

    def live_tensors(tree: Any) -> list[torch.Tensor]:
        if isinstance(tree, torch.Tensor):
            return [tree]
        if isinstance(tree, dict):
            return [t for v in tree.values() for t in live_tensors(v)]
        if isinstance(tree, list | tuple):
            return [t for v in tree for t in live_tensors(v)]
        return []

    def check(state: dict[str, Any], step: int, where: str) -> None:
        want = own(step)
        assert state["loader_pos"] == want["loader_pos"], (where, r, state["loader_pos"])
        assert torch.equal(state["rng"], want["rng"]), (where, r, state["rng"])
        shared = mc.make_state(step)
        mc.assert_bitwise_equal(shared, {k: state[k] for k in shared}, where)

    ck = Checkpointer(
        x.root / "async-ck", comm=x.comm, config=x.config("async", keep=4), async_=True
    )
    levels = []
    for step in (1, 2, 3, 4):
        live = own(step)
        handle = ck.save(step, live)
        assert isinstance(handle, AsyncSave) and not handle.synchronous, (
            "the level save ran on the caller's thread"
        )
        with torch.no_grad():
            for t in live_tensors(live):
                t.fill_(7) if t.dtype.is_floating_point else t.fill_(3)
        # The training loop's own collectives, on the job's communicator,
        # while the writer threads use theirs.
        for k in range(20):
            got = x.comm.allgather_f64(np.array([float(r + k)]))
            assert [float(v) for v in got[:, 0]] == [float(q + k) for q in range(x.comm.size)]
        stats = handle.wait()
        assert isinstance(stats, LevelSaveStats), stats
        levels.append(stats.level)
    assert levels == [1, 2, 3, 4], levels
    for step in (1, 2, 3, 4):
        state = ck.load(step)
        check(state, step, f"async L{levels[step - 1]}")
    x.lose_nodes("async", x.nodes - 1)
    lost = set(range((x.nodes - 1) * x.node_size, x.comm.size))
    for step, lv in ((2, 2), (3, 3)):
        fresh = Checkpointer(x.root / "async-ck", comm=x.comm, config=x.config("async", keep=4))
        state = fresh.load(step)
        assert fresh.last_recovery is not None
        want = [lv if q in lost else 1 for q in range(x.comm.size)]
        assert fresh.last_recovery.levels == want, fresh.last_recovery
        check(state, step, f"async L{lv} after a node loss")
    ck.close()


def compressed_pieces(meta_dir: Path, codec: str) -> int:
    """The pieces of the step whose metadata is in ``meta_dir`` stored with
    ``codec`` (its metadata names ``codec`` as the save's)."""
    meta = json.loads((meta_dir / "metadata.json").read_text())
    assert meta["compression"] == codec, (meta_dir, meta["compression"])
    col = PIECE_FIELDS.index("codec")
    return sum(1 for row in meta["pieces"] if row[col] == codec)


COMPRESSED = "shuffle-zstd"


def s_compressed(x: Ctx) -> None:
    """Compressed level saves (issue 48: fewer bytes over the links): the
    L1 files hold compressed pieces, the L2 partner copy is the compressed
    file byte for byte, the L3 parity codes it, the L4 copy's pieces are
    compressed too; each loads bitwise from L1, from L2 and L3 after the
    last node's files are lost, and from L4 with all node-local files lost."""
    name = "compressed"
    be = x.backend(name, compression=COMPRESSED, keep=3)
    for step, lv in ((50, 4), (51, 2), (52, 3)):
        be.save(step, mc.make_state(step), level=lv)
        meta = x.root / "meta" / name / step_name(step)
        assert compressed_pieces(meta, COMPRESSED) > 0, (step, "no piece compressed")
    glbl = x.root / "global" / name / step_name(50)
    assert compressed_pieces(glbl, COMPRESSED) > 0, "the L4 copy's pieces are raw"
    # Every rank's partner copy of step 51 is its compressed own file.
    r = x.comm.rank
    holder = be.layout.partner(r) // x.node_size
    copy = x.node_dir(name, holder) / step_name(51) / partner_file(r)
    assert copy.read_bytes() == x.file(name, 51, r).read_bytes(), "the copy is not the file"
    for step in (50, 51, 52):
        assert x.restore(name, step, step).levels == [1] * x.comm.size
    last = x.nodes - 1
    lost = set(range(last * x.node_size, x.comm.size))
    x.lose_nodes(name, last)
    for step, lv in ((51, 2), (52, 3)):
        got = x.restore(name, step, step, into=True)
        assert got.levels == [lv if q in lost else 1 for q in range(x.comm.size)], got
    x.lose_nodes(name, *range(x.nodes))
    got = x.restore(name, 50, 50)
    assert got.levels == [4] * x.comm.size, got


def s_compressed_corrupt(x: Ctx) -> None:
    """A corrupted compressed copy is detected and the load falls back: a
    flipped byte in rank 1's compressed L1 file (its partner's copy serves
    it); then the last node lost with a flipped byte in the partner copy
    of its first rank: the newest step (L2) cannot be recovered, and the
    load falls back to the previous one, whose L4 copy serves the lost ranks."""
    name = "compcorrupt"
    be = x.backend(name, compression=COMPRESSED)
    be.save(60, mc.make_state(60), level=4)
    be.save(61, mc.make_state(61), level=2)
    x.on_root(lambda: flip_byte(x.file(name, 61, 1)))
    got = x.restore(name, 61, 61)
    assert got.levels == [2 if q == 1 else 1 for q in range(x.comm.size)], got
    last = x.nodes - 1
    first = last * x.node_size
    holder = be.layout.partner(first) // x.node_size
    copy = x.node_dir(name, holder) / step_name(61) / partner_file(first)
    x.lose_nodes(name, last)
    x.on_root(lambda: flip_byte(copy))
    got = x.restore(name, 60)
    lost = set(range(first, x.comm.size))
    assert got.step == 60, got
    assert got.levels == [4 if q in lost else 1 for q in range(x.comm.size)], got


def s_paced(x: Ctx) -> None:
    """A paced partner copy (``l2_rate``), compressed: the exchange in 1 KiB
    slices (the ranks' files differ in size, so a rank's last slices are
    empty while its partner's are not), at most ``l2_rate`` bytes per
    second (the L2 phase takes at least the file's size over the rate);
    then the last node lost: its ranks served bitwise by the paced copies."""
    name, rate = "paced", 100_000
    partner.PACE_CHUNK = 1024
    be = BuiltinBackend(x.config(name, l2_rate=rate), x.comm, compression=COMPRESSED)
    stats = be.save(70, mc.make_state(70), level=2)
    own = x.file(name, 70, x.comm.rank).stat().st_size
    sizes = x.comm.allgather_f64(np.array([float(own)]))[:, 0]
    assert len(set(sizes.tolist())) > 1, sizes  # uneven files: uneven slices
    assert max(sizes) > 4 * partner.PACE_CHUNK, sizes
    assert stats.phases["l2"] >= own / rate, (stats.phases, own, rate)
    x.lose_nodes(name, x.nodes - 1)
    lost = set(range((x.nodes - 1) * x.node_size, x.comm.size))
    got = x.restore(name, 70)
    assert got.levels == [2 if q in lost else 1 for q in range(x.comm.size)], got


def trained_weights(version: int) -> dict[str, Any]:
    """A 1 MB fp32 tensor (the same on every rank) as training leaves it
    after ``version`` more steps: every value changed by about 0.1% a step
    (what a delta against the version before carries) and a step count."""
    import torch

    gen = torch.Generator().manual_seed(81)
    w = torch.randn(1 << 18, generator=gen)
    drift = torch.randn(1 << 18, generator=gen)
    return {"w": w * (1 + 1e-3 * version * drift), "step": version}


def s_delta(x: Ctx) -> None:
    """Partner copies as deltas (``l2_delta = 1``): the first L2 save sends
    each file compressed (no base yet); the next, of weights trained
    further, sends deltas against the copies the partners hold: under 0.8
    of the compressed files on every rank. A damaged base (the copy of
    rank 0's file flipped) makes rank 0's copy go compressed again, the
    others still deltas. Every partner copy is its owner's file byte for
    byte after each save. A rank whose encoder fails sends its file whole,
    with a warning, and the save commits. ``l2_delta = 0``, the default,
    always sends whole files. Then the last node is lost: its ranks are served bitwise
    by the copies that came as deltas."""
    name, n = "delta", x.comm.size
    be = BuiltinBackend(x.config(name, l2_delta=1), x.comm, stripe_bytes=8192)

    def saved(step: int) -> tuple[list[int], list[int]]:
        stats = be.save(step, trained_weights(step), level=2)
        own = x.file(name, step, x.comm.rank).stat().st_size
        sizes = [int(v) for v in x.comm.allgather_f64(np.array([float(own)]))[:, 0]]
        x.comm.barrier()
        for q in range(n):  # every copy is its owner's file
            holder = be.layout.partner(q) // x.node_size
            copy = x.node_dir(name, holder) / step_name(step) / partner_file(q)
            assert copy.read_bytes() == x.file(name, step, q).read_bytes(), (step, q)
        return stats.rank_partner_sent, sizes

    packed, sizes = saved(81)
    assert all(0 < s < z for s, z in zip(packed, sizes, strict=True)), (packed, sizes)
    sent, _ = saved(82)
    assert all(s < 0.8 * p for s, p in zip(sent, packed, strict=True)), (sent, packed)
    holder = be.layout.partner(0) // x.node_size
    x.on_root(lambda: flip_byte(x.node_dir(name, holder) / step_name(82) / partner_file(0)))
    again, _ = saved(83)
    assert again[0] > 0.9 * packed[0], (again, packed)
    assert all(s < 0.8 * p for s, p in zip(again[1:], packed[1:], strict=True)), (again, packed)

    # Rank 1's encoder fails: its copy goes whole (with a warning), every
    # rank still takes its part in each exchange, the save commits.
    real = partner.delta_encode

    def broken(new: Any, base: Any) -> bytes:
        raise MemoryError("no room for the delta")

    if x.comm.rank == 1:
        partner.delta_encode = broken
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sent, sizes = saved(84)
    finally:
        partner.delta_encode = real
    assert sent[1] == sizes[1] and sent[0] < 0.8 * packed[0], (sent, sizes)
    said = [str(w.message) for w in caught if "goes whole" in str(w.message)]
    assert bool(said) == (x.comm.rank == 1), said

    whole = x.backend("delta0")  # l2_delta = 0, the default
    for step in (85, 86):
        st = whole.save(step, trained_weights(step), level=2)
        assert sum(st.rank_partner_sent) == st.stored_bytes, st

    x.lose_nodes(name, x.nodes - 1)
    state, report = x.backend(name).load(84)  # any config loads it
    mc.assert_bitwise_equal(trained_weights(84), state, name)
    lost = set(range((x.nodes - 1) * x.node_size, n))
    assert report.levels == [2 if q in lost else 1 for q in range(n)], report


def s_delta_memory(x: Ctx) -> None:
    """The delta base outlives ``memory_keep = 1`` (memory tier on, each
    fake node's ``ckpt_dir`` on /dev/shm): L2, L4, L2, L3, L2 saves keep
    the last L2 step in memory beside the newest while there is room, so
    the copies after an L4 and an L3 step still go as deltas (under 0.8 of
    the first, compressed, ones), and it goes once a newer L2 step commits;
    the last node lost, its ranks are served bitwise by those copies. With
    a ``memory_budget``, a node evicts the base at once where it has no
    room for another L2 step beside it and the L3 step (those ranks'
    next copies go compressed), and no save is refused; with room beside
    the L3 step but not beside a larger next step, the base is dropped
    before that step is written, not refused."""
    n = x.comm.size
    tag = hashlib.sha256(str(x.root).encode()).hexdigest()[:12]
    shm = Path("/dev/shm") / f"deeppart-deltamem-{tag}"
    x.on_root(lambda: shm.mkdir())

    def held(name: str) -> list[list[str]]:
        return [sorted(p.name for p in (shm / f"node{k}" / name).iterdir()) for k in range(x.nodes)]

    def backend(name: str, **kw: Any) -> BuiltinBackend:
        cfg = x.config(name, l2_delta=1, memory=1, memory_keep=1, ckpt_dir=str(shm), **kw)
        return BuiltinBackend(cfg, x.comm, stripe_bytes=8192)

    def node_sizes(name: str, step: int) -> list[int]:
        """Each node's bytes of ``step`` (its own files, copies, parity)."""
        d = shm / f"node{x.comm.rank // x.node_size}" / name / step_name(step)
        mine = float(sum(f.stat().st_size for f in d.iterdir()))
        rows = x.comm.allgather_f64(np.array([mine]))[:, 0]
        return [int(rows[k * x.node_size]) for k in range(x.nodes)]

    try:
        be = backend("deltamem")
        first = be.save(91, trained_weights(91), level=2).rank_partner_sent
        be.save(92, trained_weights(92), level=4)
        x.comm.barrier()
        assert held("deltamem") == [[step_name(91), step_name(92)]] * x.nodes, held("deltamem")
        for step, level in ((93, 2), (94, 3), (95, 2)):
            sent = be.save(step, trained_weights(step), level=level).rank_partner_sent
            if level == 2:
                assert all(s < 0.8 * p for s, p in zip(sent, first, strict=True)), (sent, first)
        x.comm.barrier()
        assert held("deltamem") == [[step_name(95)]] * x.nodes, held("deltamem")
        x.on_root(lambda: shutil.rmtree(shm / f"node{x.nodes - 1}" / "deltamem"))
        state, report = backend("deltamem").load(95)
        mc.assert_bitwise_equal(trained_weights(95), state, "deltamem")
        lost = set(range((x.nodes - 1) * x.node_size, n))
        assert report.levels == [2 if q in lost else 1 for q in range(n)], report

        # The sizes, per node, of an L2 step, an L3 step and a larger L2
        # step (the plan, not this test, decides how they spread; a
        # step's number changes its files by a few bytes).
        probe = backend("deltaprobe")
        larger = {**trained_weights(103), "extra": trained_weights(0)["w"][: 1 << 17].clone()}
        sizes = []
        for step, tree, level in ((96, trained_weights(96), 2), (97, trained_weights(97), 3),
                                  (98, larger, 2)):  # fmt: skip
            probe.save(step, tree, level=level)
            sizes.append(node_sizes("deltaprobe", step))
        s1, s2, s3 = sizes
        # Room for an L2 and an L3 step, not always for the base beside
        # them: a node evicts it exactly when it lacks that room; no save
        # is refused; a copy is a delta only where both nodes kept it.
        budget = max(a + b for a, b in zip(s1, s2, strict=True)) + (64 << 10)
        tight = backend("deltatight", memory_budget=budget)
        packed = tight.save(96, trained_weights(96), level=2).rank_partner_sent
        tight.save(97, trained_weights(97), level=3)
        x.comm.barrier()
        kept = [b + 2 * a <= budget for a, b in zip(s1, s2, strict=True)]
        want = [[step_name(96)] * k + [step_name(97)] for k in kept]
        assert held("deltatight") == want, (held("deltatight"), s1, s2, budget)
        again = tight.save(98, trained_weights(98), level=2).rank_partner_sent
        for q in range(n):
            both = kept[q // x.node_size] and kept[be.layout.partner(q) // x.node_size]
            ok = again[q] < 0.8 * packed[q] if both else again[q] > 0.9 * packed[q]
            assert ok, (q, again, packed, kept)

        # Room for the base beside the L3 step on every node, but not
        # beside the next, larger, step on some: it is dropped there before
        # that step is written, not refused.
        budget = max(b + 2 * a for a, b in zip(s1, s2, strict=True)) + (4 << 10)
        assert any(a + b + c > budget for a, b, c in zip(s1, s2, s3, strict=True))
        grow = backend("deltagrow", memory_budget=budget)
        grow.save(101, trained_weights(101), level=2)
        grow.save(102, trained_weights(102), level=3)
        x.comm.barrier()
        assert held("deltagrow") == [[step_name(101), step_name(102)]] * x.nodes
        grow.save(103, larger, level=2)
        x.comm.barrier()
        assert held("deltagrow") == [[step_name(103)]] * x.nodes, held("deltagrow")
        state, _ = backend("deltagrow").load(103)
        mc.assert_bitwise_equal(larger, state, "deltagrow")
    finally:
        x.on_root(lambda: shutil.rmtree(shm, ignore_errors=True))


SCENARIOS: dict[str, Callable[[Ctx], None]] = {
    "none": s_none,
    "l2node": s_l2_node,
    "l3node": s_l3_node,
    "l3half": s_l3_half,
    "l4all": s_l4_all,
    "l2twice": s_l2_twice,
    "l3twice": s_l3_twice,
    "corrupt": s_corrupt,
    "fallback": s_fallback,
    "toomuch": s_too_much,
    "cadence": s_cadence,
    "checkpointer": s_checkpointer,
    "hosts": s_real_hosts,
    "ioerror": s_io_error,
    "crash": s_crash_save,
    "aftercrash": s_after_crash,
    "perrank": s_per_rank,
    "async": s_async,
    "compressed": s_compressed,
    "compcorrupt": s_compressed_corrupt,
    "paced": s_paced,
    "delta": s_delta,
    "deltamem": s_delta_memory,
}


def main() -> None:
    root, node_size, group_size, *names = sys.argv[1:]
    comm = resolve(None)
    x = Ctx(Path(root), int(node_size), int(group_size), comm)
    (x.results / "ok").mkdir(parents=True, exist_ok=True)
    for item in names:
        # "name:G" runs the scenario with group_size G.
        name, _, group = item.partition(":")
        if group:
            x = Ctx(Path(root) / f"g{group}", int(node_size), int(group), comm)
            x.results = Path(root)
        SCENARIOS[name](x)
        mc.scenario_done(x.results, name, comm)


if __name__ == "__main__":
    mc.abort_on_failure(main)
