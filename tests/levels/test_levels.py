"""Multi-level storage (docs/LEVELS.md): the config's parsing and checks,
and the built-in engine's failure matrix on 4 ranks (2 fake nodes) and 8
ranks (4 fake nodes, groups of 2 and 4), each launch running several
scenarios of tests/levels/levels_worker.py under a timeout."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import deeppart
from deeppart.errors import (
    CheckpointError,
    LevelConfigError,
    PerRankStateError,
    UnrecoverableError,
)
from deeppart.levels import LevelConfig, open_backend
from deeppart.levels.engine import BuiltinBackend

ROOT = Path(__file__).resolve().parents[2]
import mpi_checkpoint as mc  # noqa: E402

WORKER = ROOT / "tests" / "levels" / "levels_worker.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT_S = 300

BASE = {"ckpt_dir": "/x/local", "meta_dir": "/x/meta", "glbl_dir": "/x/global"}

INI = """
[basic]
ckpt_dir   = {root}/local    ; node-local
glbl_dir   = {root}/global
meta_dir   = {root}/meta
node_size  = 2
group_size = 2
ckpt_l1    = 1
ckpt_l2    = 2
ckpt_l3    = 4
ckpt_l4    = 8
keep_last_ckpt = 0
head       = 0
verbosity  = 2
inline_l2  = 1
[restart]
failure = 0
exec_id = run1
[advanced]
local_test = 1
"""


def cfg(**kw: Any) -> LevelConfig:
    return LevelConfig.from_dict({**BASE, **kw})


# ----------------------------------------------------------------------------
# Config.


def test_ini_parsing_levels_and_groups(tmp_path: Path) -> None:
    path = tmp_path / "config.fti"
    path.write_text(INI.format(root=tmp_path))
    c = LevelConfig.from_file(path)
    assert (c.node_size, c.group_size, c.local_test, c.exec_id) == (2, 2, 1, "run1")
    assert (c.ckpt_l1, c.ckpt_l2, c.ckpt_l3, c.ckpt_l4) == (1, 2, 4, 8)
    assert c.fti_options == (("basic", "inline_l2", "1"), ("restart", "failure", "0"))
    assert [c.level_for(n) for n in range(1, 10)] == [1, 2, 1, 3, 1, 2, 1, 4, 1]
    assert LevelConfig.from_string(c.to_ini()) == c
    c.validate(8)
    g4 = c.replace(group_size=4)
    assert g4.group_members(5) == [1, 3, 5, 7]  # position 1 on nodes 0..3
    assert g4.partner_of(7) == 1 and g4.partner_of(1) == 3
    assert c.group_members(5) == [5, 7] and c.node_of(5) == 2
    assert c.local_dir(5) == tmp_path / "local" / "node2" / "run1"
    # Real hosts: nodes in order of first appearance, positions by rank.
    hosts = ["b", "a", "b", "a"]
    real = cfg(node_size=2, group_size=2, ckpt_l2=1)
    real.validate(4, hosts)
    assert real.node_of(1, hosts) == 1 and real.group_members(0, hosts) == [0, 1]
    assert real.partner_of(2, hosts) == 3
    # Real nodes' directories are named by host, whatever the node's index.
    assert real.local_dir(1, hosts) == Path("/x/local/a/deeppart")
    assert real.local_dir(1, ["a", "b", "a", "b"]) == Path("/x/local/b/deeppart")
    with pytest.raises(LevelConfigError, match="cannot name a node directory"):
        real.validate(4, ["a/b", "a/b", "c", "c"])


def test_survey_finds_files_on_other_nodes() -> None:
    """A restart on reordered nodes: every file a rank needs is on the other
    node; find_moves sends each from a rank of the node that holds it, and
    nothing for files already in place or held nowhere."""
    from types import SimpleNamespace

    from deeppart.levels.layout import Layout
    from deeppart.levels.recovery import find_moves

    layout = Layout(cfg(node_size=2, group_size=2, ckpt_l2=1), 4, ["a", "a", "b", "b"])
    meta = SimpleNamespace(file_sizes=[10, 11, 12, 13])
    st = SimpleNamespace(level=2, meta=meta, parity_sizes=[0] * 4)
    # Saved with ranks 0, 1 on "b": "a" (now ranks 0, 1) holds 2, 3 and their
    # partners' copies (of 0, 1); rank 3's own file is lost.
    held_a = {"rank-00002.bin": 12, "partner-00000.bin": 10, "partner-00001.bin": 11}
    held_b = {"rank-00000.bin": 10, "rank-00001.bin": 11, "partner-00002.bin": 12}
    held_b["partner-00003.bin"] = 13
    moves = find_moves(layout, st, [held_a, held_a, held_b, held_b])  # type: ignore[arg-type]
    got = {(m.src // 2, m.dst, m.name) for m in moves}
    assert got == {
        (1, 0, "rank-00000.bin"),
        (1, 1, "rank-00001.bin"),
        (0, 2, "rank-00002.bin"),
        (1, 0, "partner-00002.bin"),
        (1, 1, "partner-00003.bin"),
        (0, 2, "partner-00000.bin"),
        (0, 3, "partner-00001.bin"),
    }, got
    # Senders are spread over the node's ranks.
    assert len({m.src for m in moves}) == 4


def test_level_intervals_off_and_default() -> None:
    c = cfg(ckpt_l1=0, ckpt_l2=-1, ckpt_l3=3, ckpt_l4=0)
    assert [c.level_for(n) for n in range(1, 7)] == [1, 1, 3, 1, 1, 3]
    with pytest.raises(ValueError, match="start at 1"):
        c.level_for(0)


@pytest.mark.parametrize(
    ("kw", "world", "message"),
    [
        ({"ckpt_l2": 1, "node_size": 4}, 4, "L2 enabled on a single node"),
        ({"ckpt_l3": 1, "node_size": 1}, 1, "L3 enabled on a single node"),
        ({"ckpt_l3": 1, "node_size": 1, "group_size": 4}, 6, "6 nodes .* not a multiple of"),
        ({"node_size": 4}, 6, "world size 6 is not a multiple of node_size = 4"),
        ({"ckpt_l3": 1, "node_size": 1, "group_size": 1}, 4, r"group_size = 1: must be 2\.\.32"),
        ({"ckpt_l3": 1, "node_size": 1, "group_size": 33}, 66, r"group_size = 33: must be 2\.\.32"),
    ],
)
def test_validate_errors(kw: dict[str, Any], world: int, message: str) -> None:
    c = cfg(**kw)
    with pytest.raises(LevelConfigError, match=message):
        c.validate(world)


def test_validate_hosts() -> None:
    c = cfg(node_size=2, ckpt_l2=1)
    with pytest.raises(LevelConfigError, match="host 'b' runs 1 rank"):
        c.validate(4, ["a", "a", "b", "c"])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"head": 1}, "head = 1: dedicated head processes are not supported"),
        ({"node_size": "two"}, "node_size = 'two': not an integer"),
        ({"ckpt_l2": "1.5"}, "ckpt_l2 = '1.5': not an integer"),
        ({"ckpt_l3": -2}, "ckpt_l3 = -2: must be a positive interval, 0 or -1"),
        ({"node_size": 0}, "node_size = 0: must be at least 1"),
        ({"keep_last_ckpt": 2}, "keep_last_ckpt = 2: must be 0 or 1"),
        ({"local_test": 3}, "local_test = 3: must be 0 or 1"),
        ({"bogus_key": 1}, "unknown config key 'bogus_key'"),
        ({"ckpt_l4": 1, "glbl_dir": ""}, "glbl_dir must be set when ckpt_l4 is enabled"),
        ({"exec_id": "a/b"}, "exec_id = 'a/b': must be a plain directory name"),
        ({"keep": 0}, "keep = 0: must be at least 1"),
    ],
)
def test_config_errors(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(LevelConfigError, match=re.escape(message)):
        cfg(**kw)


def test_ini_errors(tmp_path: Path) -> None:
    bad_key = tmp_path / "a.fti"
    bad_key.write_text("[basic]\nckpt_dir=/a\nmeta_dir=/m\nckpt_l5 = 1\n")
    with pytest.raises(
        LevelConfigError, match=r"a\.fti: unknown config key 'ckpt_l5' in \[basic\]"
    ):
        LevelConfig.from_file(bad_key)
    bad_section = tmp_path / "b.fti"
    bad_section.write_text("[basics]\nckpt_dir=/a\n")
    with pytest.raises(LevelConfigError, match=r"unknown section \[basics\]"):
        LevelConfig.from_file(bad_section)
    bad_int = tmp_path / "c.fti"
    bad_int.write_text("[basic]\nckpt_dir=/a\nmeta_dir=/m\ngroup_size = four\n")
    with pytest.raises(LevelConfigError, match=r"c\.fti: group_size = 'four': not an integer"):
        LevelConfig.from_file(bad_int)
    missing = tmp_path / "d.fti"
    missing.write_text("[basic]\nckpt_dir=/a\n")
    with pytest.raises(LevelConfigError, match="missing config key 'meta_dir'"):
        LevelConfig.from_file(missing)
    with pytest.raises(LevelConfigError, match="cannot read the config"):
        LevelConfig.from_file(tmp_path / "nope.fti")
    assert issubclass(LevelConfigError, deeppart.CheckpointError)


def test_validation_fails_before_any_file(tmp_path: Path) -> None:
    c = LevelConfig.from_dict(
        {
            "ckpt_dir": tmp_path / "local",
            "meta_dir": tmp_path / "meta",
            "glbl_dir": tmp_path / "global",
            "ckpt_l2": 1,
            "local_test": 1,
        }
    )
    with pytest.raises(LevelConfigError, match="L2 enabled on a single node"):
        open_backend(c, backend="builtin")
    with pytest.raises(LevelConfigError, match="L2 enabled on a single node"):
        deeppart.Checkpointer(tmp_path / "root", config=c, backend="builtin")
    with pytest.raises(LevelConfigError, match="backend must be one of"):
        open_backend(c, backend="nope")
    # An explicit level the topology cannot take also fails before I/O.
    be = open_backend(c.replace(ckpt_l2=0), backend="builtin")
    with pytest.raises(LevelConfigError, match="L3 enabled on a single node"):
        be.save(1, {"x": 1}, level=3)
    assert list(tmp_path.iterdir()) == []


def test_memory_tier_config_and_refusals(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memory tier's keys (FTI-style INI, ``[deeppart]``), and its
    refusals in one process: ckpt_dir not on a tmpfs (named, with what it
    is on); a step over the file system's free memory (named, by how
    much), nothing written; the FTI backend refusing memory = 1."""
    from deeppart.levels import memory

    text = (
        INI.format(root=tmp_path) + "[deeppart]\nmemory = 1\nmemory_budget = 2G\nmemory_keep = 3\n"
    )
    c = LevelConfig.from_string(text)
    assert (c.memory, c.memory_budget, c.memory_keep) == (1, 2 << 30, 3)
    assert "memory_budget = 2147483648" in c.to_ini()
    with pytest.raises(LevelConfigError, match="memory_budget = 'lots': not a size"):
        cfg(memory=1, memory_budget="lots")
    with pytest.raises(LevelConfigError, match="apply to the memory tier: set memory = 1"):
        cfg(memory_keep=2)
    with pytest.raises(LevelConfigError, match="memory_keep = 0: must be at least 1"):
        cfg(memory=1, memory_keep=0)
    with pytest.raises(LevelConfigError, match=r"memory tier .* is the built-in engine's"):
        open_backend(cfg(memory=1), backend="fti")
    # ckpt_dir on the test's disk, not a tmpfs.
    disk = cfg(
        ckpt_dir=str(tmp_path / "local"),
        meta_dir=str(tmp_path / "meta"),
        local_test=1,
        memory=1,
    )
    kind, _ = memory.fs_type(tmp_path)
    if kind not in memory.MEMORY_FS:
        with pytest.raises(LevelConfigError, match=rf"not on a memory file system .*node0: {kind}"):
            BuiltinBackend(disk)
    # On a tmpfs: a step larger than the free memory is refused, nothing written.
    shm = Path("/dev/shm")
    if memory.fs_type(shm)[0] not in memory.MEMORY_FS:
        pytest.skip("no tmpfs at /dev/shm")
    local = shm / f"deeppart-test-{tmp_path.name}-{id(tmp_path)}"
    try:
        be = BuiltinBackend(disk.replace(ckpt_dir=str(local)))
        be.save(1, {"x": np.arange(1000, dtype=np.int64)})
        monkeypatch.setattr(memory, "free_bytes", lambda path: 100)
        with pytest.raises(
            deeppart.NoSpaceError,
            match=r"node node0: step 2 at L1 needs \d+ bytes \(own files \d+\), "
            r"but .* has 100 bytes free there: \d+ bytes short",
        ):
            be.save(2, {"x": np.arange(1000, dtype=np.int64)})
        assert sorted(p.name for p in (local / "node0" / "deeppart").iterdir()) == ["step-00000001"]
        assert not (tmp_path / "meta" / "deeppart" / "step-00000002").exists()
        monkeypatch.undo()
        state, report = be.load()
        assert report.step == 1 and np.array_equal(state["x"], np.arange(1000))
    finally:
        shutil.rmtree(local, ignore_errors=True)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_single_process_l1_and_l4(tmp_path: Path, codec: str | None) -> None:
    """One process without MPI: L1 and L4 round trips (raw and compressed),
    keep, latest."""
    import torch

    c = cfg(
        ckpt_dir=str(tmp_path / "local"),
        meta_dir=str(tmp_path / "meta"),
        glbl_dir=str(tmp_path / "global"),
        ckpt_l4=2,
        keep=1,
    )
    be = BuiltinBackend(c, compression=codec)
    assert be.latest() is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        be.load()
    state = {"w": torch.zeros(5000), "n": 3}
    assert be.save(1, state).level == 1
    assert be.save(2, {"w": torch.ones(4), "n": 4}).level == 4
    shutil.rmtree(tmp_path / "local")  # L4 serves, and rewrites the L1 file
    _, report = BuiltinBackend(c).load()
    assert report.levels == [4] and len(report.rewritten) == 1
    assert be.committed_steps() == [2]
    got, report = BuiltinBackend(c).load()
    assert report.step == 2 and report.levels == [1] and got["n"] == 4
    assert torch.equal(got["w"], torch.ones(4))
    if codec:
        meta = json.loads(
            (tmp_path / "meta" / "deeppart" / "step-00000002" / "metadata.json").read_text()
        )
        assert meta["compression"] == codec and meta["levels"]["level"] == 4
    assert deeppart.load(tmp_path / "global" / "deeppart" / "step-00000002")["n"] == 4


# ----------------------------------------------------------------------------
# Multi-rank failure matrix.

needs_mpi = pytest.mark.skipif(
    not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed"
)


def launch(
    n: int, root: Path, node_size: int, group_size: int, *scenarios: str
) -> dict[str, list[tuple[int, list[int]]]]:
    """Runs the scenarios in one job; returns levels_of(root)."""
    cmd = [str(MPIEXEC), "-n", str(n), sys.executable, str(WORKER), str(root)]
    cmd += [str(node_size), str(group_size), *scenarios]
    proc = mc.launch(cmd, TIMEOUT_S, ROOT)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for s in scenarios:
        name = s.partition(":")[0]
        oks = [r for r in range(n) if (root / "ok" / f"{name}.{r}").exists()]
        assert len(oks) == n, f"{name}: {proc.stdout}{proc.stderr}"
    return levels_of(root)


def levels_of(root: Path) -> dict[str, list[tuple[int, list[int]]]]:
    """Every restore's (step, levels) by scenario, in order, since the last
    call (the worker's ROOT/levels.jsonl, consumed)."""
    got: dict[str, list[tuple[int, list[int]]]] = {}
    path = root / "levels.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            got.setdefault(row["scenario"], []).append((row["step"], row["levels"]))
        path.unlink()
    return got


def inspect_multi_level(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`deeppart inspect` on the L2 and L3 steps left by l2twice/l3twice
    (4 ranks, 2 fake nodes): it names the level, --verify finds the files
    under ckpt_dir/node<k>/ (data, partner copies, parity: all rebuilt by
    the recoveries), and exits 1 once a node's files are gone."""
    from deeppart.tools.cli import main

    for name, level, extra in (("l2twice", 2, "partner-"), ("l3twice", 3, "parity-")):
        step = root / "meta" / name / "step-00000013"
        assert main(["inspect", str(step), "--verify", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        assert info["level"].startswith(f"L{level} (")
        assert info["verify"]["ok"], info["verify"]
        assert [r["file"] for r in info["ranks"]] == [
            f"node{r // 2}/rank-{r:05d}.bin" for r in range(4)
        ]
        shutil.rmtree(root / "local" / "node1" / name)
        assert main(["inspect", str(step / "metadata.json"), "--verify"]) == 1
        out = capsys.readouterr().out
        assert f"level         L{level} (" in out
        missing = {line.split(": ")[0].strip() for line in out.splitlines() if "missing" in line}
        node1 = root / "local" / "node1" / name / "step-00000013"
        assert {str(node1 / f"rank-{r:05d}.bin") for r in (2, 3)} <= missing, out
        assert any(Path(m).name.startswith(extra) for m in missing), out


@pytest.mark.mpi
@needs_mpi
def test_matrix_4_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 ranks as 2 fake nodes, groups of 2: nothing lost (every level);
    a node lost under L2 and under L3; all local storage lost under L4; a
    flipped byte (L2) and a truncated file (L3); the newest checkpoint
    unrecoverable -> the previous one; loss beyond repair -> a clear error;
    the ckpt_lN cadence and keep; Checkpointer(config=...); real hosts
    (no local_test) as one node; an injected I/O error in the L2 transfer
    and in the L3 coding (every rank raises, no hang, nothing committed);
    per-rank values and tensors, each rank's own back at every level and
    after a node loss (issue 48: before, every rank got rank 0's value);
    asynchronous level saves over MPI (the writer threads on their own
    communicator beside the main thread's collectives, the live state
    trampled at once; L2 and L3 recover a lost node from what they wrote).
    Bitwise
    identical state every time (checked in the worker). Then one process
    with another layout reads only the L4 checkpoint."""
    names = ["none", "l2node", "l3node", "l4all", "corrupt", "fallback", "toomuch", "cadence"]
    more = ["checkpointer", "hosts", "ioerror", "l2twice", "l3twice", "perrank", "async"]
    lv = launch(4, tmp_path, 2, 2, *names, *more)
    assert lv["none"] == [(s, [1] * 4) for s in (1, 2, 3, 4, 4)]
    assert lv["l2node"] == [(7, [1, 1, 2, 2]), (7, [1, 1, 1, 1])]
    assert lv["l3node"] == [(8, [1, 1, 3, 3]), (8, [1, 1, 1, 1])]
    assert lv["l4all"] == [(10, [4] * 4), (10, [1] * 4)]
    assert lv["corrupt"] == [(11, [1, 2, 1, 1]), (12, [1, 1, 3, 1])]
    assert lv["fallback"] == [(20, [2, 2, 1, 1])]
    assert lv["cadence"] == [(4, [4] * 4)]
    assert lv["ioerr"] == [(1, [1] * 4)]
    # Lose node 1, recover; then lose node 0: the copies and parity node 1
    # held were rebuilt by the first recovery, so the second works too.
    assert lv["l2twice"] == [(13, [1, 1, 2, 2]), (13, [2, 2, 1, 1])]
    assert lv["l3twice"] == [(13, [1, 1, 3, 3]), (13, [3, 3, 1, 1])]
    inspect_multi_level(tmp_path, capsys)

    # Another world size and layout (1 process, no MPI, node 0's files
    # only): recovered from what it holds, the rest from L4 or decoded.
    one = cfg(
        ckpt_dir=str(tmp_path / "local"),
        meta_dir=str(tmp_path / "meta"),
        glbl_dir=str(tmp_path / "global"),
        exec_id="none",
        local_test=1,
        node_size=1,
    )
    be = BuiltinBackend(one)
    assert be.latest() == 4
    state, report = be.load()
    assert report.step == 4 and report.levels == [1, 1, 4, 4] and report.world_size == 1
    mc.assert_bitwise_equal(mc.make_state(4), state)
    # Node 0's files of the L4 step gone too: the global copy, loaded whole.
    shutil.rmtree(tmp_path / "local" / "node0" / "none" / "step-00000004")
    state, report = be.load(4)
    assert report.levels == [4] * 4, report
    mc.assert_bitwise_equal(mc.make_state(4), state)
    # The L3 step: node 0 holds 2 of each group's 4 files (ranks 0 and 1's
    # own files and parity shards): ranks 2 and 3 decoded here.
    state, report = be.load(3)
    assert report.levels == [1, 1, 3, 3], report
    mc.assert_bitwise_equal(mc.make_state(3), state)
    # A flipped byte in rank 1's own file of the L3 step: rejected by its
    # checksums; its group (ranks 1 and 3) keeps only rank 1's parity.
    own1 = tmp_path / "local" / "node0" / "none" / "step-00000003" / "rank-00001.bin"
    data = bytearray(own1.read_bytes())
    data[-1] ^= 0xFF
    own1.write_bytes(bytes(data))
    with pytest.raises(
        UnrecoverableError,
        match=r"step 3: written by 4 ranks, loaded on 1: .*old rank\(s\) \[1, 3\] .*"
        r"L1 \(own files\) and L3 \(Reed-Solomon decoding\).*"
        r"rejected: L1 own file of old rank 1",
    ):
        be.load(3)


@pytest.mark.mpi
@needs_mpi
def test_compressed_level_saves_4_ranks(tmp_path: Path) -> None:
    """Compressed level saves (shuffle-zstd; issue 48: fewer bytes over the
    links), 4 ranks as 2 fake nodes, groups of 2: the L1 files and the L4
    copy hold compressed pieces, each partner copy is its rank's compressed
    file byte for byte; loads bitwise from L1, from L2 and L3 with node 1
    lost, from L4 with every node's files lost; a flipped byte in a
    compressed file is caught (the partner's copy serves), and with node 1
    lost and the copy of rank 2 corrupted the load falls back to the
    previous step, its lost ranks served by its L4 copy. The checks of
    each step are in the worker (s_compressed, s_compressed_corrupt). And
    a paced partner copy (``l2_rate``, s_paced), and partner copies sent as
    deltas against the partners' copies of the step before (``l2_delta``,
    s_delta: fewer bytes, a damaged base sent whole, each copy its owner's
    file byte for byte, a lost node served bitwise by them), and with the
    memory tier the delta base kept past an L4 and an L3 step while the
    node has room (s_delta_memory)."""
    lv = launch(4, tmp_path, 2, 2, "compressed", "compcorrupt", "paced", "delta", "deltamem")
    assert lv["compressed"] == [
        (50, [1] * 4),
        (51, [1] * 4),
        (52, [1] * 4),
        (51, [1, 1, 2, 2]),
        (52, [1, 1, 3, 3]),
        (50, [4] * 4),
    ], lv["compressed"]
    assert lv["compcorrupt"] == [(61, [1, 2, 1, 1]), (60, [1, 1, 4, 4])], lv["compcorrupt"]
    # l2_rate: the paced copy (1 KiB slices, uneven files), then node 1 lost.
    assert lv["paced"] == [(70, [1, 1, 2, 2])], lv["paced"]


def test_l2_rate_key() -> None:
    """``[deeppart] l2_rate``: a size (bytes per second; 0, the default, is
    not paced), written back by to_ini; negative or not a size: refused."""
    c = cfg(l2_rate="2M")
    assert c.l2_rate == 2 << 20 and cfg().l2_rate == 0
    assert LevelConfig.from_string(c.to_ini()) == c
    with pytest.raises(LevelConfigError, match=r"l2_rate = -1: must be >= 0"):
        cfg(l2_rate=-1)
    with pytest.raises(LevelConfigError, match=r"l2_rate = 'fast': not a size"):
        cfg(l2_rate="fast")
    from deeppart.levels.fti import check_fti_options

    check_fti_options(cfg())
    with pytest.raises(LevelConfigError, match=r"l2_rate = 2097152: .*backend='builtin'"):
        check_fti_options(c)


def test_l2_delta_key() -> None:
    """``[deeppart] l2_delta``: 0 (whole copies, the default) or 1 (deltas),
    written back by to_ini, read from an INI file; anything else refused."""
    assert cfg().l2_delta == 0 and cfg(l2_delta="1").l2_delta == 1
    c = cfg(l2_delta=1)
    assert LevelConfig.from_string(c.to_ini()) == c
    assert "l2_delta = 1" in c.to_ini()
    for bad in (2, -1):
        with pytest.raises(LevelConfigError, match=rf"l2_delta = {bad}: must be 0 or 1"):
            cfg(l2_delta=bad)
    with pytest.raises(LevelConfigError, match=r"l2_delta = 'yes': not an integer"):
        cfg(l2_delta="yes")


@pytest.mark.parametrize("slice_bytes", [16 << 20, 4096])
def test_partner_delta_round_trip(slice_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partner copy's delta rebuilds the file exactly against its base,
    longer or shorter than it, in one slice or many (the base ending
    inside a slice); a file of values changed a little (0.1%) goes in well
    under its size; a payload of the wrong length, or cut short, is
    refused."""
    from deeppart.errors import CodecError
    from deeppart.levels import partner
    from deeppart.levels.partner import delta_decode, delta_encode

    monkeypatch.setattr(partner, "DELTA_SLICE", slice_bytes)

    rng = np.random.default_rng(0)
    old = rng.standard_normal(50_000).astype(np.float32)
    new = (old * (1 + 1e-3 * rng.standard_normal(old.size))).astype(np.float32)
    a, b = old.view(np.uint8), new.view(np.uint8)
    for base, file in ((a, b), (a[:10001], b), (a, b[:9999]), (a[:0], b), (a, b[:0])):
        packed = np.frombuffer(delta_encode(file, base), dtype=np.uint8)
        assert np.array_equal(delta_decode(packed, base, file.size), file)
    assert len(delta_encode(b, a)) < 0.7 * b.size
    packed = np.frombuffer(delta_encode(b, a), dtype=np.uint8)
    for bad, size in ((packed, b.size - 4), (packed[:-1], b.size), (packed[:4], b.size)):
        with pytest.raises(CodecError):
            delta_decode(bad, a, size)


@pytest.mark.mpi
@needs_mpi
def test_per_rank_values_2_ranks(tmp_path: Path) -> None:
    """Issue 48's job: 2 ranks (2 fake nodes, one group) save their own
    loader positions, RNG states and items only some hold beside a shared
    model through the built-in engine (L1-L4, Checkpointer(config=...));
    each rank gets back its own, also after its node is lost (the checks
    are in the worker's s_per_rank)."""
    lv = launch(2, tmp_path, 1, 2, "perrank")
    assert lv == {}, lv
    # One process: only the L4 copy serves, and no rank can be given its
    # own version there, so the load names the per-rank paths.
    one = cfg(
        ckpt_dir=str(tmp_path / "local"),
        meta_dir=str(tmp_path / "meta"),
        glbl_dir=str(tmp_path / "global"),
        exec_id="perrank",
    )
    with pytest.raises(
        PerRankStateError, match=r"loader_pos \(versions saved by ranks \[0\], \[1\]\)"
    ):
        BuiltinBackend(one).load(4)
    state = deeppart.load(str(tmp_path / "global" / "perrank" / "step-00000004"), per_rank=1)
    assert state["loader_pos"] == 105 and state["extra"] == {"odd": 1}, state["loader_pos"]


@pytest.mark.mpi
@needs_mpi
def test_matrix_8_ranks(tmp_path: Path) -> None:
    """8 ranks as 4 fake nodes. Groups of 2: the last node lost under L2,
    node 1 under L3, a whole group lost -> error. Groups of 4: two nodes
    of the group lost (half) and one -> L3; three -> error."""
    lv = launch(
        8, tmp_path, 2, 2, "l2node:2", "l3node:2", "toomuch:2", "l3half:4", "l3node:4", "toomuch:4"
    )
    assert lv["l2node"] == [(7, [1] * 6 + [2, 2]), (7, [1] * 8)]
    assert lv["l3node"] == [(8, [1, 1, 3, 3, 1, 1, 1, 1]), (8, [1] * 8)] * 2
    assert lv["l3half"] == [(9, [1, 1, 3, 3, 3, 3, 1, 1])]


@pytest.mark.mpi
@needs_mpi
def test_crash_mid_checkpoint(tmp_path: Path) -> None:
    """A rank SIGKILLed while writing step 2 (after step 1 was committed at
    L2): a new job recovers step 1, and its next save removes step 2's
    leftovers."""
    cmd = [str(MPIEXEC), "-n", "4", sys.executable, str(WORKER), str(tmp_path), "2", "2", "crash"]
    proc = mc.launch(cmd, TIMEOUT_S, ROOT)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert not (tmp_path / "ok" / "crash.0").exists(), proc.stdout
    leftover = tmp_path / "local" / "node1" / "crash" / "step-00000002"
    assert leftover.exists(), proc.stdout + proc.stderr
    lv = launch(4, tmp_path, 2, 2, "aftercrash")
    assert lv["crash"] == [(1, [1] * 4)], lv
