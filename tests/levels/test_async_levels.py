"""Asynchronous saves through the built-in multi-level engine (issue 48):
``Checkpointer(config=..., async_=True)`` and ``BuiltinBackend.save_async``
on real FSDP2 state with per-rank values, memory tier on, 2 torchrun ranks
on gloo (the checks are in tests/levels/async_levels_worker.py): the live
state trampled as soon as the save returns still loads bitwise at every
level (and after a node's memory is lost, from the partner copy and the
parity the writer threads wrote); a load while a save is in flight waits
for it; a failure on one rank's writer thread raised by ``wait()`` on every
rank, the step before it intact; the budget refused before anything is
written; a compressed L2 save's partner copy paced (``l2_rate``) on the
writer's gloo communicator, at most that rate, serving a lost node
bitwise. And in one process: the save's snapshot, the sync fallback over
``max_staging_bytes``, the FTI backend's refusal."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

import deeppart
from deeppart.levels import LevelConfig, LevelSaveStats
from deeppart.levels.memory import MEMORY_FS, fs_type

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from launching import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "levels" / "async_levels_worker.py"
SHM = Path("/dev/shm")

pytestmark = pytest.mark.skipif(
    fs_type(SHM)[0] not in MEMORY_FS, reason="no tmpfs at /dev/shm for the memory tier"
)


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on /dev/shm (the memory tier's ckpt_dir), removed after."""
    d = SHM / f"deeppart-async-{tmp_path.name}-{id(tmp_path)}"
    d.mkdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.multirank
def test_async_level_saves_on_two_ranks(tmp_path: Path, shm: Path) -> None:
    """The 2-rank job's scenarios (see the module docstring); here, what
    the committed metadata says of the per-rank values and levels."""
    if not dist.is_available():
        pytest.skip("no torch.distributed")
    run_ranks(WORKER, 2, str(tmp_path), str(shm), timeout_s=300)
    meta_file = tmp_path / "meta" / "levels" / "step-00000003" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    assert meta["levels"]["level"] == 3 and meta["levels"]["parity_sizes"][1] > 0
    # Each rank's own loader position and RNG state, stored as versions.
    assert meta["version"] == 3 and [v["path"] for v in meta["versions"]] == [["loader"], ["rng"]]


def config(tmp_path: Path, shm: Path, **extra: object) -> LevelConfig:
    return LevelConfig.from_dict(
        {
            "ckpt_dir": str(shm),
            "meta_dir": str(tmp_path / "meta"),
            "glbl_dir": str(tmp_path / "global"),
            "ckpt_l1": 1,
            "ckpt_l4": 2,
            "local_test": 1,
            "memory": 1,
            "memory_keep": 1,
            **extra,
        }
    )


def test_async_level_saves_in_one_process(tmp_path: Path, shm: Path) -> None:
    """One process: L1 then L4 (the intervals), the tensor trampled right
    after save() returns, each step loaded back as it was; the oldest
    evicted from memory after the next commit (memory_keep = 1) but served
    by its L4 copy; a share over max_staging_bytes saved synchronously with
    a warning; backend='fti' refused with async_=True, naming why."""
    ck = deeppart.Checkpointer(
        "unused", config=config(tmp_path, shm), async_=deeppart.AsyncOptions()
    )
    x = torch.arange(50_000, dtype=torch.float32)
    expected = {}
    for step in (1, 2, 3):
        handle = ck.save(step, {"x": x, "pos": 100 + step})
        expected[step] = x.clone()
        x.add_(1000)  # the next training step, right away
        assert isinstance(handle, deeppart.AsyncSave) and not handle.synchronous
        stats = handle.wait()
        assert isinstance(stats, LevelSaveStats)
        assert stats.level == (4 if step == 2 else 1) and stats.step == step, stats
        # The caller's stages and the writer's, each timed.
        caller = {"prepare", "budget", "snapshot"}
        assert caller | {"l1", "commit"} <= set(stats.phases), stats.phases
        assert sum(stats.phases[k] for k in caller) <= handle.snapshot_seconds
    assert ck.steps() == [2, 3]  # step 1: L1 only, evicted from memory
    assert [p.name for p in (shm / "node0" / "deeppart").iterdir()] == ["step-00000003"]
    for step in (2, 3):
        out = ck.load(step)
        assert torch.equal(out["x"], expected[step]) and out["pos"] == 100 + step
    assert ck.last_recovery is not None and ck.last_recovery.levels == [1]
    ck.close()

    small = deeppart.Checkpointer(
        "unused",
        config=config(tmp_path, shm, exec_id="small"),
        async_=deeppart.AsyncOptions(max_staging_bytes=1000),
    )
    with pytest.warns(deeppart.AsyncSaveWarning, match=r"saved synchronously: .*max_staging_bytes"):
        handle = small.save(1, {"x": torch.arange(1000, dtype=torch.int64)})
    assert isinstance(handle, deeppart.AsyncSave) and handle.synchronous and handle.done()
    stats = handle.wait()
    assert isinstance(stats, LevelSaveStats) and stats.level == 1
    assert torch.equal(small.load(1)["x"], torch.arange(1000))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=r"async_=True with the FTI backend .* thread-safe"):
            deeppart.Checkpointer(
                "unused", config=config(tmp_path, shm), async_=True, backend="fti"
            )
