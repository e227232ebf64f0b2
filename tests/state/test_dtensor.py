"""DTensor state (FSDP2, HSDP, TP) through deeppart.save / load, resharded on
load, on real torch FSDP2 ``fully_shard`` / ``parallelize_module`` with gloo
under torchrun (tests/state/dtensor_worker.py), plus the regions' checks on
hostile metadata in one process.

Layouts on 4 ranks: HSDP (2,2), DDP in a 2-D mesh (4,1), FSDP (1,4),
TP x DP (2,2), and FSDP2 over TP on (2,2) (``tpfsdp``: ``_StridedShard``).
Each checkpoint is loaded into DTensors of the same layout, of (1,4) and
(4,1), on 2 ranks, and in one process (full tensors, and into a plain
model), bitwise against the same state saved with ``full_state_dict=True``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_in_session, worker_cmd  # noqa: E402

import deeppart  # noqa: E402
from deeppart.errors import CorruptCheckpointError  # noqa: E402
from deeppart.format import MARKER, METADATA, marker_text  # noqa: E402
from deeppart.regions import Region, parse_records, runs_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "state" / "dtensor_worker.py"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMEOUT_S = 400


def run(n: int, *args: str) -> str:
    """The worker on ``n`` torchrun ranks (0: one plain process); checks
    that every rank printed OK."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rc, out = run_in_session(worker_cmd(WORKER, n, *args), env, ROOT, TIMEOUT_S)
    assert rc == 0, f"rc={rc}\n{out[-6000:]}"
    assert len(set(re.findall(r"OK \w+ rank \d+/\d+", out))) >= max(n, 1), out[-6000:]
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout saved on 4 ranks with deeppart.save, each loaded back
    into the same layout, (1,4) and (4,1), bitwise (the worker's ``save``
    scenario); then the same through dcp.save with BalancedSavePlanner and
    stock dcp.load (``dcp``)."""
    d = tmp_path_factory.mktemp("dtensor")
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    out = run(4, "save", str(d)) + run(4, "dcp", str(d), "hsdp", "ddp2d", "fsdp", "tp")
    (d / "output.txt").write_text(out)
    return d


def _figures(saved: Path, tag: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for line in (saved / "output.txt").read_text().splitlines():
        if line.startswith(tag + " "):
            fields = line.split()
            out[fields[1]] = [float(x) for x in fields[2:] if x[0].isdigit()]
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_save_and_reshard_on_four_ranks(saved: Path) -> None:
    """Each layout's checkpoint holds its DTensors as shard records whose
    shards tile the global tensors (checked on parse), at metadata version 2."""
    for layout in ("hsdp", "ddp2d", "fsdp", "tp", "tpfsdp"):
        meta = json.loads((saved / layout / METADATA).read_text())
        assert meta["version"] == 2 and meta["dtensors"], layout
        paths = {tuple(r["path"]) for r in meta["dtensors"]}
        assert ("model", "0.weight") in paths and ("optim", "state", "0.weight", "exp_avg") in paths
    # HSDP (2,2): two distinct shards per tensor (30 rows: 15 + 15; 7: 4 + 3).
    hsdp = json.loads((saved / "hsdp" / METADATA).read_text())
    rec = next(r for r in hsdp["dtensors"] if r["path"] == ["model", "2.weight"])
    assert [s["index"][0] for s in rec["shards"]] == [[[0, 4]], [[4, 7]]]
    # FSDP2 over TP (2,2): 0.weight's placements are (_StridedShard(0, sf=2),
    # Shard(0)) (checked by the worker): tp splits the rows first, then dp
    # splits each tp half; torch's own offsets give the regions.
    strided = json.loads((saved / "tpfsdp" / METADATA).read_text())
    rec = next(r for r in strided["dtensors"] if r["path"] == ["model", "0.weight"])
    assert [s["index"][0] for s in rec["shards"]] == [[[0, 8]], [[15, 23]], [[8, 15]], [[23, 30]]]
    # Each shard's pieces are written by its holders only (ranks 0, 2 hold
    # shard 0; 1, 3 shard 1), checked again by the planner on load.
    for r in hsdp["dtensors"]:
        for k, s in enumerate(r["shards"]):
            writers = {row[3] for row in hsdp["pieces"] if row[0] == s["leaf"]}
            assert writers <= {k, k + 2}, (r["path"], k, writers)


@pytest.mark.multirank
@pytest.mark.slow
def test_balanced_save_planner_on_the_layouts(saved: Path) -> None:
    """BalancedSavePlanner's largest DCP file over the mean, on each layout:
    within 5% of the ideal (the tiny test state's torch.save framing
    included), and never above DCP's default planner."""
    figures = _figures(saved, "DCPBALANCE")
    assert sorted(figures) == ["ddp2d", "fsdp", "hsdp", "tp"], figures
    for layout, (balanced, default) in figures.items():
        assert balanced <= 1.05 and balanced <= default, (layout, balanced, default)


@pytest.mark.multirank
@pytest.mark.slow
def test_deeppart_save_balances_each_layout(tmp_path: Path) -> None:
    """A 23 MB model + AdamW on each layout: the slowest rank's data bytes
    are <= 1.02 x the ideal (unique bytes / ranks): each shard's bytes are
    spread over its holders (issue 22's holder groups)."""
    out = run(4, "balance", str(tmp_path), "hsdp", "ddp2d", "fsdp", "tp")
    figures = {
        line.split()[1]: float(line.split()[2])
        for line in out.splitlines()
        if line.startswith("BALANCE ")
    }
    assert sorted(figures) == ["ddp2d", "fsdp", "hsdp", "tp"], out[-3000:]
    assert all(v <= 1.02 for v in figures.values()), figures


@pytest.mark.multirank
@pytest.mark.slow
def test_eight_ranks_reshard_reads_each_byte_once(tmp_path: Path) -> None:
    """8 ranks: HSDP (2,4) -> (4,2) and back, bitwise; the job's bytes read
    from storage (the reader's counters) are <= 1.05 x the checkpoint, where
    stock dcp.load reads every byte once per replica."""
    out = run(8, "eight", str(tmp_path))
    reads = [line.split() for line in out.splitlines() if line.startswith("READ ")]
    assert len(reads) == 2, out[-3000:]
    for _, case, _, ours, _, theirs in reads:
        assert float(ours) <= 1.05, (case, ours)
        assert float(theirs) > 1.5, (case, theirs)


@pytest.mark.multirank
@pytest.mark.slow
def test_load_on_two_ranks(saved: Path) -> None:
    run(2, "load2", str(saved))


@pytest.mark.multirank
@pytest.mark.slow
def test_load_on_three_ranks_moves_only_the_rows_taken(saved: Path) -> None:
    """4 ranks' FSDP (1,4) and HSDP (2,2) checkpoints into FSDP over 3
    ranks, exchanged between the readers (``exchange="bcast"``): bitwise,
    and each rank received exactly the rows its new shards take of the
    pieces it did not read (the worker's ``load3``), fewer bytes than
    those pieces whole."""
    out = run(3, "load3", str(saved), "fsdp", "hsdp")
    assert re.search(r"PARTS fsdp not sent [1-9]\d* bytes", out), out[-3000:]


@pytest.mark.multirank
@pytest.mark.slow
def test_load_in_one_process(saved: Path) -> None:
    run(0, "load1", str(saved))


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_load_over_mpi(saved: Path) -> None:
    """An mpi4py communicator (3 ranks, no torch.distributed): the HSDP
    checkpoint without a target, bitwise; the shard exchange moves the
    pieces point to point (counted on every rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [str(MPIEXEC), "-n", "3", sys.executable, str(WORKER), "mpi", str(saved), "hsdp"]
    rc, out = run_in_session(cmd, env, ROOT, TIMEOUT_S)
    assert rc == 0, out[-6000:]
    assert len(set(re.findall(r"OK mpi rank \d/3", out))) == 3, out[-6000:]


@pytest.mark.multirank
@pytest.mark.slow
def test_async_save_of_dtensors_holds_the_values_at_the_call(tmp_path: Path) -> None:
    """async_save snapshots each rank's share of its shards: the parameters
    overwritten right after the call do not reach the checkpoint, which
    loads back bitwise (HSDP and TP x DP)."""
    out = run(4, "async", str(tmp_path), "hsdp", "tp")
    assert out.count("OK async") == 4, out[-3000:]


@pytest.mark.multirank
@pytest.mark.slow
def test_to_local_shards_fail_on_every_rank(tmp_path: Path) -> None:
    """Shards passed as plain tensors (to_local()): every rank raises a
    StateMismatchError naming to_local() where they are declared replicas
    (equal shapes on ranks of one structure), and nothing is committed;
    shards of other shapes are each rank's own (issue 32) and load back
    bitwise on each rank. Then
    ``verify_replicas=True`` compares each shard across its holders: equal
    replicas save (``verified``); one holder's copy changed raises on every
    rank, and nothing more is committed."""
    out = run(4, "tolocal", str(tmp_path), "hsdp", "fsdp", "tp")
    assert out.count("OK tolocal") == 4
    names = {p.name for p in tmp_path.iterdir()}
    assert "verified" in names and "differs" not in names, names
    assert names <= {"verified", "offload", "hsdp-local", "fsdp-local", "tp-local"}, names


# ----------------------------------------------------------------------------
# Regions and their records (one process).


def test_regions() -> None:
    assert runs_of([0, 1, 2, 5, 6, 9]) == ((0, 3), (5, 7), (9, 10))
    a = Region((((0, 4), (8, 12)), ((0, 6),)))
    b = Region((((2, 10),), ((3, 9),)))
    common = a.intersect(b)
    assert common == Region((((2, 4), (8, 10)), ((3, 6),)))
    assert [p.tolist() for p in a.positions(common)] == [[2, 3, 4, 5], [3, 4, 5]]
    assert a.rows(3, 6) == Region((((3, 4), (8, 10)), ((0, 6),)))
    assert a.intersect(Region((((4, 8),), ((0, 6),)))) is None
    assert Region(()).intersect(Region(())) == Region(())


def _leaf(shape: list[int]) -> object:
    from deeppart.format import LeafInfo

    n = 1
    for d in shape:
        n *= d
    return LeafInfo(["x"], "tensor", "float32", shape, 4, n, 4 * n)


@pytest.mark.parametrize(
    ("shapes", "shards", "fragment"),
    [
        ([[2]], [[[[0, 2]]]], "cover"),  # rows 2-4 of 4 missing
        ([[3], [2]], [[[[0, 3]]], [[[2, 4]]]], "cover"),  # overlap
        ([[4]], [[[[0, 2], [1, 3]]]], "sorted"),
        ([[5]], [[[[0, 5]]]], "within"),
        ([[4]], [[[[0, 4]], [[0, 1]]]], "one list of runs per dimension"),
        ([[3]], [[[[0, 4]]]], "region's shape"),
    ],
)
def test_hostile_records_are_refused(
    shapes: list[list[int]], shards: list[object], fragment: str
) -> None:
    leaves = [_leaf(s) for s in shapes]
    raw = [
        {
            "path": ["x"],
            "dtype": "float32",
            "shape": [4],
            "shards": [{"leaf": k, "index": ix} for k, ix in enumerate(shards)],
        }
    ]
    with pytest.raises(CorruptCheckpointError, match=fragment):
        parse_records(raw, leaves, lambda d: d == "float32")
    raw[0]["shards"] = [{"leaf": 7, "index": [[[0, 4]]]}]
    with pytest.raises(CorruptCheckpointError, match="names no leaf"):
        parse_records(raw, leaves, lambda d: d == "float32")


@pytest.mark.multirank
@pytest.mark.slow
def test_tampered_record_fails_load(saved: Path, tmp_path: Path) -> None:
    """A record whose shards no longer tile the tensor (re-committed, so only
    the record check can catch it) is refused on load, naming the record."""
    import shutil

    d = tmp_path / "c"
    shutil.copytree(saved / "hsdp", d)
    meta = json.loads((d / METADATA).read_text())
    meta["dtensors"][0]["shards"][1]["index"][0] = [[14, 29]]
    text = json.dumps(meta).encode()
    (d / METADATA).write_bytes(text)
    (d / MARKER).write_bytes(marker_text(text))
    with pytest.raises(CorruptCheckpointError, match=r"dtensors\[0\]"):
        deeppart.load(d)


@pytest.mark.multirank
@pytest.mark.slow
def test_inspect_shows_the_sharded_tensors(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``deeppart inspect`` of a DTensor checkpoint lists each sharded
    tensor with its global shape and each stored shard's region."""
    from deeppart.tools.cli import main as cli_main

    assert cli_main(["inspect", "--json", str(saved / "hsdp")]) == 0
    info = json.loads(capsys.readouterr().out)
    rec = next(r for r in info["dtensors"] if r["path"] == "model.0.weight")
    assert rec["shape"] == [30, 5] and rec["dtype"] == "float32"
    assert [s["region"] for s in rec["shards"]] == ["[0:15, 0:5]", "[15:30, 0:5]"]
    assert cli_main(["inspect", str(saved / "tp")]) == 0
    text = capsys.readouterr().out
    assert "sharded tensors" in text and "model.0.weight" in text
    assert "[0:15, 0:5] [15:30, 0:5]" in text  # colwise: rows over tp


def _tensors(tree: Any) -> list[Any]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def _tamper(saved: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of the HSDP checkpoint with its metadata edited and re-committed
    (so that only the metadata's own checks can catch the edit)."""
    import shutil

    d = tmp_path / "c"
    shutil.copytree(saved / "hsdp", d)
    meta = json.loads((d / METADATA).read_text())
    edit(meta)
    text = json.dumps(meta).encode()
    (d / METADATA).write_bytes(text)
    (d / MARKER).write_bytes(marker_text(text))
    return d


@pytest.mark.multirank
@pytest.mark.slow
def test_a_piece_written_by_a_non_holder_fails_load(saved: Path, tmp_path: Path) -> None:
    """The HSDP checkpoint (4 real ranks, shards held by {0, 2} and {1, 3})
    with one shard piece moved to a rank outside its holder group, appended
    to that rank's file in the metadata: load refuses it, naming the leaf
    and the rank, and the user's into= state is untouched."""
    hsdp = json.loads((saved / "hsdp" / METADATA).read_text())
    groups = hsdp["manifest"]["groups"]
    leaves = hsdp["manifest"]["leaves"]
    j, row = next((j, row) for j, row in enumerate(hsdp["pieces"]) if "holders" in leaves[row[0]])
    held = groups[leaves[row[0]]["holders"]]
    stranger = next(r for r in range(4) if r not in held)
    path = "/".join(str(k) for k in leaves[row[0]]["path"])

    def move(meta: dict[str, Any]) -> None:
        piece = meta["pieces"][j]
        piece[3] = stranger
        piece[4] = meta["file_sizes"][stranger]
        meta["file_sizes"][stranger] += piece[6]

    d = _tamper(saved, tmp_path, move)
    into = deeppart.load(saved / "hsdp")
    tensors = _tensors(into)
    assert tensors
    for t in tensors:
        t.fill_(7)
    with pytest.raises(
        CorruptCheckpointError,
        match=rf"piece {j} of leaf {row[0]} \({re.escape(path)}\) was written by rank "
        rf"{stranger}, which does not hold that leaf \(its holders: {re.escape(str(held))}\)",
    ):
        deeppart.load(d, into=into)
    assert all(bool((t == 7).all()) for t in tensors)  # nothing of the user's was touched
    # The untampered copy loads.
    assert deeppart.load(_tamper(saved, tmp_path / "ok", lambda m: None))


@pytest.mark.multirank
@pytest.mark.slow
def test_export_writes_full_tensors(saved: Path, tmp_path: Path) -> None:
    """``deeppart export`` of DTensor checkpoints writes the global tensors
    (safetensors and torch.save), bitwise equal to the full_state_dict
    reference; never a shard."""
    from safetensors.torch import load_file

    from deeppart.tools.export import export_safetensors, export_torch

    for layout in ("hsdp", "tp"):
        ref = deeppart.load(saved / f"{layout}-ref")
        files = export_safetensors(saved / layout, tmp_path / layout)
        got = load_file(str(files[0]))
        assert sorted(got) == sorted(ref["model"]), layout
        for k, t in ref["model"].items():
            assert got[k].shape == t.shape and torch.equal(got[k], t), (layout, k)
        pt = export_torch(saved / layout, tmp_path / f"{layout}.pt")
        whole = torch.load(pt, weights_only=True)
        for k, t in ref["optim"]["state"]["0.weight"].items():
            assert torch.equal(whole["optim"]["state"]["0.weight"][k], t), (layout, k)
        assert torch.equal(whole["model"]["2.weight"], ref["model"]["2.weight"])


@pytest.mark.multirank
@pytest.mark.slow
def test_malformed_holder_groups_fail_load(saved: Path, tmp_path: Path) -> None:
    """Recorded groups must be well formed for the checkpoint's world: a rank
    at or above its world size is refused before any data is read."""

    def widen(meta: dict[str, Any]) -> None:
        meta["manifest"]["groups"][0] = meta["manifest"]["groups"][0] + [9]

    with pytest.raises(
        CorruptCheckpointError, match=r"holder group 0 rank is 9, not an integer in \[0, 3\]"
    ):
        deeppart.load(_tamper(saved, tmp_path, widen))


def test_save_and_load_keep_no_device_mesh_alive(tmp_path: Path) -> None:
    """DeepPart keeps no reference to a DTensor's device mesh, which holds
    its process groups: once the user's state and mesh are gone, the mesh
    is freed, so no gloo group outlives the user's destroy_process_group()
    into the interpreter's teardown (where destroying one can abort a
    process that has finished: "terminate called without an active
    exception")."""
    import gc
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        state = {"w": distribute_tensor(w, mesh, [Shard(0)])}
        deeppart.save(state, tmp_path / "ckpt")
        into = {"w": distribute_tensor(torch.zeros(3, 4), mesh, [Shard(0)])}
        out = deeppart.load(tmp_path / "ckpt", into=into)
        assert torch.equal(out["w"].to_local(), w)
        freed = weakref.ref(mesh)
        del mesh, state, into, out
        gc.collect()
        assert freed() is None, [type(r).__name__ for r in gc.get_referrers(freed())]
    finally:
        dist.destroy_process_group()
