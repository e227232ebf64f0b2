"""``load(into=state)`` restores everything into the caller's own object:
tensors in place, and plain values (step counters, learning rates, lists,
small arrays) set in its dicts and lists, as DCP's ``load`` does; where a
value cannot be set (inside a tuple), a NotInPlaceWarning says so."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import deeppart  # noqa: E402
from deeppart.errors import NotInPlaceWarning  # noqa: E402
from deeppart.levels import LevelConfig  # noqa: E402


def saved() -> dict[str, Any]:
    return {
        "w": torch.ones(64, 8),
        "step": 100,
        "opt": {"lr": 0.001, "betas": (0.9, 0.999), "history": [1, 2, 3]},
        "sched": {"last_epoch": 7, "base_lrs": [0.01]},
        "rng": {"python": [3, list(range(5)), None], "seed": np.arange(6, dtype=np.uint32)},
        "items": [torch.full((4,), 2.0), "name", 5],
    }


def stale() -> dict[str, Any]:
    return {
        "w": torch.zeros(64, 8),
        "step": 0,
        "opt": {"lr": 0.5, "betas": (0.0, 0.0), "history": [], "old": True},
        "sched": {"last_epoch": -1, "base_lrs": [0.5]},
        "rng": {"python": None, "seed": np.zeros(6, dtype=np.uint32)},
        "items": [torch.zeros(4), "other", 0],
    }


def assert_restored(state: dict[str, Any], inner: dict[str, Any]) -> None:
    """Every value of ``saved()`` is in ``state``, and the nested dicts,
    lists and arrays the caller held (``inner``) are the same objects."""
    want = saved()
    assert torch.equal(state["w"], want["w"])
    assert state["step"] == 100
    assert state["opt"] == want["opt"]
    assert state["sched"] == want["sched"]
    assert state["rng"]["python"] == want["rng"]["python"]
    assert np.array_equal(state["rng"]["seed"], want["rng"]["seed"])
    assert torch.equal(state["items"][0], want["items"][0])
    assert state["items"][1:] == ["name", 5]
    assert state["opt"] is inner["opt"] and state["sched"]["base_lrs"] is inner["base_lrs"]
    assert state["rng"]["seed"] is inner["seed"] and state["w"] is inner["w"]


def held(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "opt": state["opt"],
        "base_lrs": state["sched"]["base_lrs"],
        "seed": state["rng"]["seed"],
        "w": state["w"],
    }


def test_load_into_sets_plain_values_in_the_callers_object(tmp_path: Path) -> None:
    deeppart.save(saved(), tmp_path / "ck")
    state = stale()
    inner = held(state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deeppart.load(tmp_path / "ck", into=state)  # the return value is not needed
    assert_restored(state, inner)


def test_checkpointer_load_into(tmp_path: Path) -> None:
    ck = deeppart.Checkpointer(tmp_path / "ck", keep_last=2)
    ck.save(100, saved())
    state = stale()
    inner = held(state)
    ck.load(into=state)
    assert_restored(state, inner)


def test_multi_level_load_into(tmp_path: Path) -> None:
    cfg = LevelConfig.from_dict(
        {
            "ckpt_dir": str(tmp_path / "local"),
            "meta_dir": str(tmp_path / "meta"),
            "glbl_dir": str(tmp_path / "global"),
            "node_size": 1,
            "group_size": 1,
            "ckpt_l1": 1,
            "ckpt_l4": 2,
            "local_test": 1,
        }
    )
    ck = deeppart.Checkpointer("unused", config=cfg, backend="builtin")
    ck.save(1, saved())  # L1
    state = stale()
    inner = held(state)
    ck.load(into=state)
    assert_restored(state, inner)
    ck.save(2, saved())  # L4: a normal checkpoint in glbl_dir too
    for p in (tmp_path / "local").rglob("*.bin"):
        p.unlink()  # only the global copy is left
    state = stale()
    inner = held(state)
    ck.load(into=state)
    assert ck.last_recovery is not None
    assert_restored(state, inner)
    ck.close()


def test_strict_false_and_keys_set_only_what_they_read(tmp_path: Path) -> None:
    deeppart.save(saved(), tmp_path / "ck")
    state = stale()
    state["extra"] = {"mine": 1}  # not in the checkpoint
    del state["sched"]
    deeppart.load(tmp_path / "ck", into=state, strict=False)
    assert state["step"] == 100 and state["opt"]["lr"] == 0.001
    assert state["extra"] == {"mine": 1} and "sched" not in state
    missing, unexpected = deeppart.last_incompatible_keys() or ([], [])
    assert missing == ["extra"] and unexpected == ["sched"]

    state = stale()
    deeppart.load(tmp_path / "ck", into=state, keys=["opt"], strict=False)
    assert state["opt"]["lr"] == 0.001
    assert state["step"] == 0 and state["sched"]["last_epoch"] == -1  # not read
    assert torch.equal(state["w"], torch.zeros(64, 8))


def test_a_value_in_a_tuple_is_reported(tmp_path: Path) -> None:
    deeppart.save({"pair": (torch.ones(3), 7), "step": 1}, tmp_path / "ck")
    state: dict[str, Any] = {"pair": (torch.zeros(3), 0), "step": 0}
    with pytest.warns(NotInPlaceWarning, match="pair/1"):
        out = deeppart.load(tmp_path / "ck", into=state)
    assert out["pair"][1] == 7 and state["step"] == 1
    assert torch.equal(state["pair"][0], torch.ones(3))  # the tensor is filled
    # The same value there: nothing to say.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deeppart.load(tmp_path / "ck", into=out)


def test_a_backward_that_saved_a_loaded_tensor_raises(tmp_path: Path) -> None:
    """Tensors are filled through numpy views of their memory, which autograd
    does not see: the load counts the write in their version counters, so a
    backward whose graph saved a tensor before the load fails loudly (as
    after ``copy_``) instead of computing gradients from the new values."""
    model = torch.nn.Linear(8, 8)
    deeppart.save(model.state_dict(), tmp_path / "ckpt")
    x = torch.ones(2, 8, requires_grad=True)
    loss = (model(x) ** 2).sum()  # saves model.weight for x's gradient
    before = model.weight._version
    deeppart.load(tmp_path / "ckpt", into=model.state_dict())
    assert model.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inference_tensors_load_in_place(tmp_path: Path) -> None:
    """Inference tensors have no version counter: loading into them still works."""
    deeppart.save({"w": torch.arange(6.0)}, tmp_path / "ckpt")
    with torch.inference_mode():
        w = torch.zeros(6)
    deeppart.load(tmp_path / "ckpt", into={"w": w})
    assert torch.equal(w, torch.arange(6.0))
