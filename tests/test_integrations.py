"""DeepPart inside PyTorch Lightning, the Hugging Face Trainer and
Accelerate (deeppart/integrations/), with the real packages, on 2 torchrun
ranks (gloo, CPU).

Each test trains three times: uninterrupted; interrupted (every rank
SIGKILLed some steps after a checkpoint); resumed from that checkpoint.
The resumed run must continue exactly as the uninterrupted one: every
recorded loss and the final model and optimizer tensors are bitwise equal,
per rank. The checkpoint must have been written by both ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from framework_runs import facts, final_tensors, losses  # noqa: E402
from launching import run_in_session  # noqa: E402

from deeppart.format import METADATA, data_file_name, is_committed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 420
RANKS = 2


def launch(worker: str, *args: str) -> tuple[int, str]:
    """Runs ``tests/<worker>`` on RANKS torchrun ranks in its own session;
    kills the whole group and fails the test if it has not finished after
    TIMEOUT_S. Returns the exit status and the output."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
        "--standalone", str(ROOT / "tests" / worker), *args,
    ]
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
    )
    return run_in_session(cmd, env, ROOT, TIMEOUT_S)


def run_ok(worker: str, name: str, *args: str) -> None:
    rc, out = launch(worker, *args)
    assert rc == 0, f"rc={rc}\n{out[-8000:]}"
    for r in range(RANKS):
        assert f"OK {name} rank {r}/{RANKS}" in out, out[-8000:]


def run_killed(worker: str, *args: str) -> None:
    rc, out = launch(worker, *args)
    assert rc != 0, f"the run was to be killed, but it finished:\n{out[-8000:]}"
    assert "OK " not in out, out[-8000:]


def assert_written_by_every_rank(ckpt: Path) -> None:
    assert is_committed(ckpt), ckpt
    meta = json.loads((ckpt / METADATA).read_text())
    assert meta["world_size"] == RANKS
    writers = {row[3] for row in meta["pieces"] if row[5] > 0}
    assert writers == set(range(RANKS)), f"pieces written by ranks {writers} only"
    for r in range(RANKS):
        assert (ckpt / data_file_name(r)).stat().st_size > 0


def assert_resumed_exactly(d: Path, cut_steps: int, ckpt_step: int) -> None:
    """Per rank: the interrupted run's losses are the uninterrupted run's
    first ``cut_steps``; the resumed run's are all of the uninterrupted
    run's after ``ckpt_step``; the final tensors are bitwise equal."""
    for r in range(RANKS):
        full = losses(d, "full", r)
        assert [s for s, _ in full] == list(range(1, len(full) + 1)), full
        cut = losses(d, "cut", r)
        assert cut == full[:cut_steps], (r, cut, full)
        resumed = losses(d, "resumed", r)
        assert resumed == full[ckpt_step:], (r, resumed, full[ckpt_step:])
        want, got = final_tensors(d, "full", r), final_tensors(d, "resumed", r)
        assert sorted(want) == sorted(got)
        assert any(k.startswith("optim.") for k in want), sorted(want)
        for key in want:
            assert torch.equal(want[key], got[key]), f"rank {r}: {key} differs"


def train_and_interrupt(worker: str, label: str, d: Path, kill_at: int) -> None:
    """The uninterrupted run ("full"), then one killed after step
    ``kill_at`` ("cut")."""
    run_ok(worker, f"{label}-full", "full", str(d))
    run_killed(worker, "cut", str(d), "--kill-at-step", str(kill_at))


def resume_and_compare(
    worker: str, label: str, d: Path, ckpt: Path, kill_at: int, ckpt_step: int
) -> None:
    """Resumes from ``ckpt`` (saved after step ``ckpt_step``) as run
    "resumed" and checks it against the uninterrupted run."""
    run_ok(worker, f"{label}-resumed", "resumed", str(d), "--resume", str(ckpt))
    assert_resumed_exactly(d, cut_steps=kill_at, ckpt_step=ckpt_step)


def test_lightning_ddp_strategy_resumes_exactly(tmp_path: Path) -> None:
    """Lightning's Trainer with DeepPartDDPStrategy: ModelCheckpoint's
    checkpoints are DeepPart directories written by both ranks;
    ``fit(ckpt_path=...)`` resumes at the saved epoch and step, with the
    optimizer's state, and the loss curve and final weights equal the
    uninterrupted run's (4 steps per epoch, 3 epochs; killed at step 6,
    after the epoch-0 checkpoint at step 4)."""
    d = tmp_path
    train_and_interrupt("lightning_worker.py", "lightning", d, kill_at=6)
    ckpts = sorted(p.name for p in (d / "cut-ckpts").iterdir())
    assert ckpts == ["epoch=0-step=4.ckpt"], ckpts
    ckpt = d / "cut-ckpts" / "epoch=0-step=4.ckpt"
    assert_written_by_every_rank(ckpt)
    resume_and_compare("lightning_worker.py", "lightning", d, ckpt, kill_at=6, ckpt_step=4)
    for r in range(RANKS):
        got = facts(d, "resumed", r)
        assert got["start"] == [1, 4], got
        assert set(got["start_optimizer_steps"]) == {4.0}, got
        assert got["end"] == facts(d, "full", r)["end"] == [3, 12]
        assert facts(d, "full", r)["start"] == [0, 0]


def test_accelerate_save_state_resumes_exactly(tmp_path: Path) -> None:
    """Accelerate with deeppart's save_state/load_state: a checkpoint after
    every epoch of 4 steps, written by both ranks; killed at step 6, the
    run resumes from epoch 0's checkpoint with its model, optimizer,
    scheduler, registered object, sampler epoch and both ranks' RNG states
    (the model has dropout), and every loss and final tensor is the
    uninterrupted run's."""
    d = tmp_path
    train_and_interrupt("accelerate_worker.py", "accelerate", d, kill_at=6)
    ckpts = sorted(p.name for p in (d / "cut-ckpts").iterdir())
    assert ckpts == ["epoch-0"], ckpts
    ckpt = d / "cut-ckpts" / "epoch-0"
    assert_written_by_every_rank(ckpt)
    # Only DeepPart's files: no pickled optimizer, scheduler or RNG file.
    want = {"COMMITTED", METADATA, *(data_file_name(r) for r in range(RANKS))}
    assert {p.name for p in ckpt.iterdir()} == want
    resume_and_compare("accelerate_worker.py", "accelerate", d, ckpt, kill_at=6, ckpt_step=4)
    for r in range(RANKS):
        assert facts(d, "resumed", r)["start"][:2] == [1, 4]
        assert facts(d, "resumed", r)["end"] == facts(d, "full", r)["end"] == [3, 12]


def test_hf_trainer_resumes_exactly(tmp_path: Path) -> None:
    """transformers.Trainer (DeepPartTrainer, DDP under torchrun) on a small
    GPT-2 with dropout: checkpoint-5 (mid-epoch) holds one DeepPart
    checkpoint written by both ranks and no optimizer.pt, scheduler.pt or
    rng_state files; killed at step 7, ``resume_from_checkpoint`` continues
    at step 5 and every loss and final tensor equals the uninterrupted
    run's."""
    d = tmp_path
    train_and_interrupt("hf_trainer_worker.py", "trainer", d, kill_at=7)
    ckpt = d / "cut-out" / "checkpoint-5"
    assert sorted(p.name for p in (d / "cut-out").iterdir() if p.is_dir()) == ["checkpoint-5"]
    names = {p.name for p in ckpt.iterdir()}
    assert {"deeppart", "trainer_state.json", "config.json"} <= names, names
    assert not {n for n in names if n.endswith((".pt", ".pth", ".bin", ".safetensors"))}, names
    assert_written_by_every_rank(ckpt / "deeppart")
    resume_and_compare("hf_trainer_worker.py", "trainer", d, ckpt, kill_at=7, ckpt_step=5)
    for r in range(RANKS):
        assert facts(d, "resumed", r)["start"][0] == 5
        assert facts(d, "resumed", r)["end"] == facts(d, "full", r)["end"]
