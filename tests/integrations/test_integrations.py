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
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from framework_runs import facts, final_tensors, losses  # noqa: E402
from launching import run_in_session  # noqa: E402

from deeppart.format import METADATA, data_file_name, is_committed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 420
RANKS = 2


def launch(worker: str, *args: str) -> tuple[int, str]:
    """Runs ``tests/integrations/<worker>`` on RANKS torchrun ranks in its own session;
    kills the whole group and fails the test if it has not finished after
    TIMEOUT_S. Returns the exit status and the output."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(RANKS),
        "--standalone",
        str(ROOT / "tests" / "integrations" / worker),
        *args,
    ]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
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
    pytest.importorskip("lightning")
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


@pytest.mark.slow
def test_lightning_fsdp2_model_parallel_resumes_exactly(tmp_path: Path) -> None:
    """Lightning's ModelParallelStrategy with FSDP2 ``fully_shard`` in
    ``configure_model`` (gloo, CPU), as DeepPartModelParallelStrategy:
    its checkpoints hold the model's and AdamW's DTensor shards, written by
    both ranks; killed at step 6 and resumed from the epoch-0 checkpoint,
    every later loss and each rank's final shards of the weights and the
    optimizer state are bitwise those of the uninterrupted run."""
    pytest.importorskip("lightning")
    d = tmp_path
    worker = "lightning_fsdp_worker.py"
    train_and_interrupt(worker, "lightning-fsdp", d, kill_at=6)
    ckpt = d / "cut-ckpts" / "epoch=0-step=4.ckpt"
    assert_written_by_every_rank(ckpt)
    meta = json.loads((ckpt / METADATA).read_text())
    assert meta["version"] == 2 and meta["dtensors"], "the checkpoint holds no DTensor records"
    resume_and_compare(worker, "lightning-fsdp", d, ckpt, kill_at=6, ckpt_step=4)
    for r in range(RANKS):
        assert facts(d, "resumed", r)["start"] == [1, 4]


def test_accelerate_save_state_resumes_exactly(tmp_path: Path) -> None:
    """Accelerate with deeppart's save_state/load_state: a checkpoint after
    every epoch of 4 steps, written by both ranks; killed at step 6, the
    run resumes from epoch 0's checkpoint with its model, optimizer,
    scheduler, registered object, sampler epoch and both ranks' RNG states
    (the model has dropout), and every loss and final tensor is the
    uninterrupted run's."""
    pytest.importorskip("accelerate")
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
    pytest.importorskip("transformers")
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


# ----------------------------------------------------------------------------
# In one process: the pieces, and their errors.


def test_rng_states_round_trip_and_refuse_another_world_size(tmp_path: Path) -> None:
    """Every generator (random, numpy, torch) continues after a restore as
    it did after the capture; states of 2 ranks are not applied on 1, with
    an RngStateWarning, and leave the generators alone."""
    import random

    import numpy as np

    import deeppart
    from deeppart.comm import SingleComm
    from deeppart.errors import RngStateWarning
    from deeppart.integrations.rng import gather_rng_states, restore_rng_states

    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    np.random.standard_normal()  # a cached Gaussian is part of numpy's state
    states = gather_rng_states(SingleComm())
    deeppart.save({"rng": states}, tmp_path / "ck", comm=SingleComm())

    def draws() -> list[float]:
        return [random.random(), float(np.random.standard_normal()), float(torch.rand(()))]

    want = draws()
    loaded = deeppart.load(tmp_path / "ck", comm=SingleComm())["rng"]
    assert restore_rng_states(loaded, 0, 1)
    assert draws() == want
    after = draws()
    with pytest.warns(RngStateWarning, match="2 rank"):
        assert not restore_rng_states(loaded * 2, 0, 1)
    with pytest.warns(RngStateWarning, match="unusable"):
        assert not restore_rng_states([{"python": "junk"}], 0, 1)
    assert draws() != after  # the generators went on, not back


def test_lightning_checkpoint_io_in_one_process(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import StrategyRegistry

    import deeppart
    from deeppart.integrations.lightning import DeepPartCheckpointIO, DeepPartDDPStrategy

    assert "deeppart_ddp" in StrategyRegistry
    assert isinstance(DeepPartDDPStrategy().checkpoint_io, DeepPartCheckpointIO)
    io = DeepPartCheckpointIO()
    ckpt = {"state_dict": {"w": torch.arange(6.0)}, "epoch": 2, "loops": {"fit_loop": {}}}
    path = tmp_path / "epoch=2-step=9.ckpt"
    io.save_checkpoint(ckpt, path)
    io.save_checkpoint(ckpt, path)  # replaced, as Lightning does with last.ckpt
    got = io.load_checkpoint(path, map_location="cpu")
    assert got["epoch"] == 2 and torch.equal(got["state_dict"]["w"], torch.arange(6.0))
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint(ckpt, tmp_path / "other", storage_options={"x": 1})
    deeppart.save([torch.ones(2)], tmp_path / "a-list")
    with pytest.raises(deeppart.CheckpointError, match="not a Lightning checkpoint"):
        io.load_checkpoint(tmp_path / "a-list")
    with pytest.raises(deeppart.CheckpointError):
        io.load_checkpoint(tmp_path / "missing")
    io.remove_checkpoint(path)
    assert not path.exists()
    # Another plugin replaced DeepPart's: Lightning's rank-0 save, with a warning.
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    strategy = DeepPartDDPStrategy()
    strategy.checkpoint_io = TorchCheckpointIO()
    with pytest.warns(UserWarning, match="rank 0 saves the checkpoint alone"):
        strategy.save_checkpoint(ckpt, tmp_path / "stock.ckpt")
    assert (tmp_path / "stock.ckpt").is_file()


def test_accelerate_in_one_process_naming_and_mismatches(tmp_path: Path) -> None:
    """save_state/load_state without torchrun: automatic naming keeps
    total_limit checkpoints and loads the newest; a checkpoint of other
    objects, or not of save_state, is refused with a clear error."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    import deeppart
    from deeppart.integrations.accelerate import load_state, save_state

    config = ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2
    )
    accelerator = Accelerator(cpu=True, project_config=config)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    for i in range(3):
        with torch.no_grad():
            model.weight.fill_(float(i))
        save_state(accelerator)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"], names
    with torch.no_grad():
        model.weight.fill_(-1.0)
    assert load_state(accelerator).name == "checkpoint_2"
    assert torch.equal(model.weight, torch.full((3, 4), 2.0))
    accelerator.project_configuration.iteration = 2
    with pytest.raises(ValueError, match="checkpoint_2 exists"):
        save_state(accelerator)

    extra = Accelerator(cpu=True)
    _model, o2 = extra.prepare(torch.nn.Linear(4, 3), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    extra.register_for_checkpointing(torch.optim.lr_scheduler.StepLR(o2, 1))
    with pytest.raises(deeppart.StateMismatchError, match="registered objects"):
        load_state(extra, tmp_path / "checkpoints" / "checkpoint_2")
    deeppart.save({"state_dict": {}}, tmp_path / "not-accelerate")
    with pytest.raises(deeppart.CheckpointError, match="not a checkpoint of"):
        load_state(accelerator, tmp_path / "not-accelerate")


def test_hf_trainer_in_one_process_loads_the_best_model(tmp_path: Path) -> None:
    """DeepPartTrainer without torchrun: with ``load_best_model_at_end``
    the model ends as the best checkpoint's, read from its DeepPart
    checkpoint as no weights file exists ("best" is the highest eval loss,
    so the first checkpoint, not the final weights); and a checkpoint directory
    without ``deeppart/`` is loaded the Trainer's own way (here: refused,
    as it holds no weights)."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    import deeppart
    from deeppart.integrations.transformers import SUBDIR, DeepPartTrainer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_positions=16,
            n_embd=32,
            n_layer=1,
            n_head=2,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=6,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
        learning_rate=0.05,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = DeepPartTrainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and Path(best).name == "checkpoint-2", best
    saved = deeppart.load(Path(best) / SUBDIR)["model"]
    last = deeppart.load(Path(best).parent / "checkpoint-6" / SUBDIR)["model"]
    assert not torch.equal(saved["lm_head.weight"], last["lm_head.weight"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    empty = tmp_path / "stock" / "checkpoint-1"
    empty.mkdir(parents=True)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        trainer.train(resume_from_checkpoint=str(empty))


def _rng_now() -> tuple[Any, ...]:
    import random

    import numpy as np

    numpy_state: Any = np.random.get_state()
    return (random.getstate(), numpy_state[1].tobytes(), torch.get_rng_state())


def _reseed(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_accelerate_resume_restores_every_plain_value(tmp_path: Path) -> None:
    """load_state puts the scheduler's state, ``accelerator.step``, a
    registered object's counters, the optimizer's learning rates and the RNG
    states back into the caller's own objects (they were changed after
    the save)."""
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from deeppart.integrations.accelerate import load_state, save_state

    class Counter:
        def __init__(self) -> None:
            self.count, self.history = 0, [0.0]

        def state_dict(self) -> dict[str, Any]:
            return {"count": self.count, "history": list(self.history)}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.count, self.history = state["count"], list(state["history"])

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.count += 1
        counter.history.append(opt.param_groups[0]["lr"])
    accelerator.step = 100
    _reseed(11)
    save_state(accelerator, tmp_path / "ck")
    want = (sched.state_dict(), opt.state_dict()["param_groups"], counter.state_dict(), _rng_now())

    for _ in range(2):  # the run goes on, then resumes from the checkpoint
        opt.step()
        sched.step()
    accelerator.step, counter.count, counter.history = 0, 0, []
    _reseed(99)
    load_state(accelerator, tmp_path / "ck")
    assert accelerator.step == 100
    assert sched.state_dict() == want[0] and sched.scheduler.last_epoch == 3
    assert opt.state_dict()["param_groups"] == want[1]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)
    assert counter.state_dict() == want[2]
    got = _rng_now()
    assert got[0] == want[3][0] and got[1] == want[3][1] and torch.equal(got[2], want[3][2])


@pytest.mark.slow
def test_hf_trainer_resume_restores_plain_values_and_exports(tmp_path: Path) -> None:
    """DeepPartTrainer in one process, resumed from ``checkpoint-4`` with a
    fresh model and Trainer: the global step, the scheduler's state and the
    optimizer's step counters are the saved ones. ``deeppart export`` into
    the checkpoint directory makes it loadable by ``from_pretrained``."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    import deeppart
    from deeppart.integrations.transformers import SUBDIR, DeepPartTrainer
    from deeppart.tools.export import export_safetensors

    config = GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]

    def make(max_steps: int) -> DeepPartTrainer:
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=str(tmp_path / "out"),
            per_device_train_batch_size=4,
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=4,
            learning_rate=0.05,
            lr_scheduler_type="linear",
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        return DeepPartTrainer(model=GPT2LMHeadModel(config), args=args, train_dataset=data)

    first = make(6)
    first.train()
    ckpt = tmp_path / "out" / "checkpoint-4"
    saved = deeppart.load(ckpt / SUBDIR)

    seen: dict[str, Any] = {}

    class Peek(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if not seen:
                seen["step"] = state.global_step
                seen["sched"] = kw["lr_scheduler"].state_dict()
                seen["opt_steps"] = [
                    float(s["step"]) for s in kw["optimizer"].state_dict()["state"].values()
                ]

    resumed = make(6)
    resumed.add_callback(Peek())
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert seen["step"] == 4
    assert seen["sched"] == saved["scheduler"] and seen["sched"]["last_epoch"] == 4
    want_steps = [float(s["step"]) for s in saved["optimizer"]["state"].values()]
    assert seen["opt_steps"] == want_steps and set(want_steps) == {4.0}

    assert not (ckpt / "model.safetensors").exists()
    export_safetensors(ckpt / SUBDIR, ckpt)
    back = GPT2LMHeadModel.from_pretrained(str(ckpt))
    for key, value in back.state_dict().items():
        assert torch.equal(value, saved["model"][key]), key


@pytest.mark.slow
def test_lightning_resume_restores_plain_values(tmp_path: Path) -> None:
    """Lightning (one process, DeepPartCheckpointIO): ``fit(ckpt_path=...)``
    from the epoch-0 checkpoint, with a fresh model and Trainer, starts at
    the saved global step with the saved scheduler state and optimizer step
    counters."""
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    import deeppart
    from deeppart.integrations.lightning import DeepPartCheckpointIO

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 8, generator=g), torch.randn(16, 1))
    seen: dict[str, Any] = {}

    class Peek(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, i: int) -> None:
            if not seen:
                seen["step"] = trainer.global_step
                seen["epoch"] = trainer.current_epoch
                seen["sched"] = trainer.lr_scheduler_configs[0].scheduler.state_dict()
                opt_state = trainer.optimizers[0].state_dict()["state"]
                seen["opt_steps"] = {float(s["step"]) for s in opt_state.values()}

    def fit(ckpt_path: str | None, callbacks: list[Any]) -> None:
        torch.manual_seed(0)
        trainer = L.Trainer(
            max_epochs=2,
            accelerator="cpu",
            devices=1,
            plugins=[DeepPartCheckpointIO()],
            callbacks=callbacks,
            default_root_dir=str(tmp_path),
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        trainer.fit(Net(), loader, ckpt_path=ckpt_path)

    keep = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_epochs=1, save_top_k=-1)
    fit(None, [keep])
    ckpt = tmp_path / "ckpts" / "epoch=0-step=4.ckpt"
    saved = deeppart.load(ckpt)
    fit(str(ckpt), [Peek()])
    assert (seen["step"], seen["epoch"]) == (4, 1) == (saved["global_step"], saved["epoch"] + 1)
    assert seen["sched"] == saved["lr_schedulers"][0] and seen["sched"]["last_epoch"] == 4
    assert seen["opt_steps"] == {4.0}
