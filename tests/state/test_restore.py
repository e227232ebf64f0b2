"""Flexible restore: reading a part of a checkpoint (keys=), filling an
into= state that differs (strict=False), the mismatch error, and an
optimizer state restored into a fresh optimizer."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import deeppart
from deeppart.format import HEADER_SIZE
from deeppart.loading import reader
from deeppart.storage import files as storage_files


def _trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        _step(model, opt, i)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> float:
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(seed))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


class _CountingFile:
    def __init__(self, f: Any, counter: list[int]) -> None:
        self._f, self._counter = f, counter

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        self._counter[0] += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        got: int = self._f.readinto(buf)
        self._counter[0] += got or 0
        return got

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._f.close()


@pytest.fixture
def read_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the bytes load() reads from data files."""
    counter = [0]

    real = storage_files.open_regular  # type: ignore[attr-defined]

    def counting_open(path: Any) -> Any:
        return _CountingFile(real(path), counter)

    # Data files are opened only through the regular-file check
    # (storage.files.open_data, for a checkpoint on a file system).
    monkeypatch.setattr(storage_files, "open_regular", counting_open)
    return counter


def test_keys_reads_only_the_model_bytes(tmp_path: Path, read_bytes: list[int]) -> None:
    model, opt = _trained()
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}
    deeppart.save(state, tmp_path / "ck")
    read_bytes[0] = 0
    full = deeppart.load(tmp_path / "ck")
    all_bytes = read_bytes[0]
    model_bytes = sum(t.numel() * t.element_size() for t in state["model"].values())

    read_bytes[0] = 0
    got = deeppart.load(tmp_path / "ck", keys=["model"])
    assert list(got) == ["model"]
    assert type(got["model"]) is OrderedDict
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v)
    # The model's bytes and the file's header, nothing of the optimizer.
    assert model_bytes <= read_bytes[0] <= model_bytes + HEADER_SIZE
    assert all_bytes > 3 * model_bytes, "the optimizer holds twice the model again"
    assert torch.equal(full["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])

    read_bytes[0] = 0
    part = deeppart.load(tmp_path / "ck", keys=[("optim", "param_groups"), "step"])
    assert part == {"optim": {"param_groups": state["optim"]["param_groups"]}, "step": 3}
    assert read_bytes[0] < HEADER_SIZE + 4096


def test_keys_naming_nothing_lists_the_top_level_keys(tmp_path: Path) -> None:
    deeppart.save({"model": {"w": torch.zeros(2)}, "step": 1}, tmp_path / "ck")
    with pytest.raises(deeppart.StateMismatchError, match=r"no 'modle'.*model, step"):
        deeppart.load(tmp_path / "ck", keys=["modle"])
    with pytest.raises(TypeError, match="list of keys"):
        deeppart.load(tmp_path / "ck", keys="model")


def test_strict_mismatch_names_the_leaves_and_the_fix(tmp_path: Path) -> None:
    model, opt = _trained(1)
    deeppart.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    with pytest.raises(deeppart.StateMismatchError) as e:
        deeppart.load(tmp_path / "ck", into={"model": fresh.state_dict()})
    msg = str(e.value)
    assert "in the checkpoint but not in into= (first: optim/state/0/step" in msg
    assert "strict=False" in msg and "keys=" in msg


def test_strict_false_reports_missing_and_unexpected(tmp_path: Path) -> None:
    saved: dict[str, Any] = {"model": {"a": torch.arange(4.0), "b": torch.ones(2)}, "step": 7}
    deeppart.save(saved, tmp_path / "ck")
    into: dict[str, Any] = {"model": {"a": torch.zeros(4), "new": torch.full((3,), 5.0)}, "step": 0}
    got = deeppart.load(tmp_path / "ck", into=into, strict=False)
    keys = deeppart.last_incompatible_keys()
    assert keys == deeppart.IncompatibleKeys(["model/new"], ["model/b"])
    assert got["model"]["a"] is into["model"]["a"] and torch.equal(
        into["model"]["a"], torch.arange(4.0)
    )
    assert torch.equal(got["model"]["new"], torch.full((3,), 5.0)), (
        "missing leaves keep their value"
    )
    assert got["step"] == 7 and "b" not in got["model"]
    # A shape mismatch is an error even with strict=False, as in load_state_dict.
    with pytest.raises(
        deeppart.StateMismatchError, match=r"model/a: into= has torch\.float32 \[5\]"
    ):
        deeppart.load(tmp_path / "ck", into={"model": {"a": torch.zeros(5)}}, strict=False)
    # Matching everything reports empty lists.
    deeppart.load(
        tmp_path / "ck", into={"model": {"b": torch.zeros(2), "a": torch.zeros(4)}, "step": 1}
    )
    assert deeppart.last_incompatible_keys() == deeppart.IncompatibleKeys([], [])


def test_keys_with_into(tmp_path: Path, read_bytes: list[int]) -> None:
    model, opt = _trained(1)
    deeppart.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    read_bytes[0] = 0
    deeppart.load(tmp_path / "ck", keys=["model"], into={"model": fresh.state_dict()})
    for a, b in zip(fresh.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert read_bytes[0] <= model_bytes + HEADER_SIZE


def test_optimizer_state_into_a_fresh_optimizer(tmp_path: Path) -> None:
    """The recipe: load the optimizer's part (no into=, its state is empty)
    and hand it to the fresh optimizer's load_state_dict."""
    model, opt = _trained(3)
    deeppart.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")

    torch.manual_seed(123)
    model2 = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    assert opt2.state_dict()["state"] == {}
    deeppart.load(tmp_path / "ck", keys=["model"], into={"model": model2.state_dict()})
    opt2.load_state_dict(deeppart.load(tmp_path / "ck", keys=["optim"])["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-2

    # Both continue identically, bit for bit.
    for i in range(10, 13):
        assert _step(model, opt, i) == _step(model2, opt2, i)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpointer_load_passes_keys_and_strict(tmp_path: Path) -> None:
    cp = deeppart.Checkpointer(tmp_path / "root")
    cp.save(5, {"model": {"w": torch.ones(3)}, "step": 5})
    assert cp.load(keys=["step"]) == {"step": 5}
    into = {"model": {"w": torch.zeros(3), "extra": torch.zeros(1)}}
    cp.load(into=into, strict=False)
    assert torch.equal(into["model"]["w"], torch.ones(3))
    assert deeppart.last_incompatible_keys() == deeppart.IncompatibleKeys(["model/extra"], ["step"])


def _piece(length: int, leaf: int = 0) -> Any:
    from deeppart.format import Piece

    return Piece(leaf=leaf, start=0, stop=length, rank=0, offset=0, length=length,
                 stored=length, codec="none", xxh3=0)  # fmt: skip


@pytest.mark.parametrize(
    "lengths",
    [
        [],
        [0],
        [10, 20, 30],
        [100, 5000, 7, 0, 4096, 12000, 1, 1, 8192, 8191, 3000, 3000, 3000],
        [8192 * 3 + 5],
        [2047, 2048, 2049],
    ],
)
def test_exchange_messages_cover_each_byte_once_in_order(
    lengths: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broadcasts of a load's exchange: every byte of every piece once,
    in file order; none over the caps; short pieces whole and together (up
    to the packed cap); long pieces alone (split at the cap)."""
    monkeypatch.setattr(reader, "EXCHANGE_MESSAGE_BYTES", 8192)
    monkeypatch.setattr(reader, "PACKED_MESSAGE_BYTES", 4096)
    monkeypatch.setattr(reader, "DIRECT_PIECE_BYTES", 2048)
    pieces = [_piece(n, i) for i, n in enumerate(lengths)]
    messages = list(reader.exchange_messages(pieces))
    covered = [(p.leaf, off, n) for m in messages for p, off, n in m]
    expected = []
    for i, n in enumerate(lengths):
        if n < 2048:
            expected.append((i, 0, n))
        else:
            expected += [(i, off, min(8192, n - off)) for off in range(0, n, 8192)]
    assert covered == expected
    for m in messages:
        assert sum(n for *_, n in m) <= 8192
        if m[0][0].length < 2048:
            assert sum(n for *_, n in m) <= 4096
            assert all(p.length < 2048 and off == 0 and n == p.length for p, off, n in m)
        else:
            assert len(m) == 1
    # Short pieces are batched: no two consecutive batches could have been one.
    for a, b in itertools.pairwise(messages):
        if a[0][0].length < 2048 and b[0][0].length < 2048:
            assert sum(n for *_, n in a) + b[0][2] > 4096


def test_last_stats_is_exported_as_the_readme_writes_it(tmp_path: Path) -> None:
    """docs/SHARDED.md: ``deeppart.last_stats("load").rank_received``."""
    assert "last_stats" in deeppart.__all__
    deeppart.save({"w": torch.ones(4)}, tmp_path / "ck")
    assert deeppart.last_stats("save") is not None
    deeppart.load(tmp_path / "ck")
    stats = deeppart.last_stats("load")
    assert stats is not None and stats.op == "load"
    assert stats.rank_received == []  # no sharded state: nothing exchanged point to point


def test_resume_in_place_needs_the_optimizers_load_state_dict(tmp_path: Path) -> None:
    """The README's first example: ``load(into=state)`` restores the model's
    and the optimizer's tensors in place but the optimizer's lr only in
    ``state``; ``opt.load_state_dict(state["optim"])`` hands it over, and
    the README says so in that example."""
    model, opt = _trained(2)
    state: dict[str, Any] = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}
    deeppart.save(state, tmp_path / "ck")
    weight = next(model.parameters())
    saved_w = weight.detach().clone()
    for g in opt.param_groups:
        g["lr"] = 0.5  # a scheduler moved it on
    _step(model, opt, 99)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 0}
    deeppart.load(tmp_path / "ck", into=state)
    assert torch.equal(weight, saved_w)  # in place
    assert state["optim"]["param_groups"][0]["lr"] == 1e-2
    assert opt.param_groups[0]["lr"] == 0.5  # stale until handed over
    opt.load_state_dict(state["optim"])
    assert opt.param_groups[0]["lr"] == 1e-2
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    first = readme.split("```python", 1)[1].split("```", 1)[0]
    assert 'deeppart.load("ckpt/step-100", into=state)' in first
    assert 'opt.load_state_dict(state["optim"])' in first


def test_a_fresh_optimizer_as_into_says_what_to_do(tmp_path: Path) -> None:
    """A fresh optimizer's state_dict() (no moments yet) as into=: the
    error says why and gives the call that works; with strict=False the lr
    stays as it was and last_incompatible_keys() names it."""
    model, opt = _trained(2)
    deeppart.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "ck")
    fresh = torch.optim.AdamW(model.parameters(), lr=0.5)
    into = {"model": model.state_dict(), "optim": fresh.state_dict()}
    with pytest.raises(deeppart.StateMismatchError) as e:
        deeppart.load(tmp_path / "ck", into=into)
    msg = str(e.value)
    assert "fresh optimizer" in msg and "first step" in msg, msg
    assert "opt.load_state_dict(deeppart.load(PATH, keys=['optim'])['optim'])" in msg, msg
    deeppart.load(tmp_path / "ck", into=into, strict=False)
    keys = deeppart.last_incompatible_keys()
    assert keys is not None and keys.missing_keys == ["optim"]
    assert into["optim"]["param_groups"][0]["lr"] == 0.5
    # The call the message gives works.
    fresh.load_state_dict(deeppart.load(tmp_path / "ck", keys=["optim"])["optim"])
    assert fresh.param_groups[0]["lr"] == 1e-2


# ----------------------------------------------------------------------------
# Tied weights across into= (issue 49, item 7).


class _LM(torch.nn.Module):
    """An embedding and an output head, tied (``head.weight is
    embed.weight``, as language models tie them) or not."""

    def __init__(self, tied: bool, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def test_a_tied_checkpoint_fills_an_untied_model(tmp_path: Path) -> None:
    """The checkpoint stores the tied weight once; an untied model gets it at
    both its keys (strict, and strict=False), with nothing reported missing."""
    tied = _LM(tied=True, seed=0)
    deeppart.save({"model": tied.state_dict()}, tmp_path / "ck")
    w = tied.embed.weight.detach()
    for strict in (True, False):
        untied = _LM(tied=False, seed=1)
        assert not torch.equal(untied.head.weight, w)
        deeppart.load(tmp_path / "ck", into={"model": untied.state_dict()}, strict=strict)
        assert deeppart.last_incompatible_keys() == deeppart.IncompatibleKeys([], [])
        assert torch.equal(untied.embed.weight, w) and torch.equal(untied.head.weight, w)
        assert untied.head.weight is not untied.embed.weight, "it stays untied"
        assert torch.equal(untied.mid.weight, tied.mid.weight)


def test_keys_selects_a_tied_weight_by_either_key(tmp_path: Path) -> None:
    """keys= on the alias reads the shared leaf and returns it under the
    key asked for only; into= gets only that key filled."""
    tied = _LM(tied=True, seed=0)
    deeppart.save({"model": tied.state_dict(), "step": 3}, tmp_path / "ck")
    w = tied.embed.weight.detach()
    for key, other in (("head.weight", "embed.weight"), ("embed.weight", "head.weight")):
        got = deeppart.load(tmp_path / "ck", keys=[("model", key)])
        assert list(got["model"]) == [key], (key, list(got["model"]))
        assert torch.equal(got["model"][key], w)
        untied = _LM(tied=False, seed=1)
        before = untied.state_dict()[other].clone()
        deeppart.load(tmp_path / "ck", keys=[("model", key)], into={"model": untied.state_dict()},
                      strict=False)  # fmt: skip
        assert torch.equal(untied.state_dict()[key], w)
        assert torch.equal(untied.state_dict()[other], before), "not asked for"


def test_an_untied_checkpoint_fills_a_tied_model_only_if_both_agree(tmp_path: Path) -> None:
    """An untied checkpoint into a tied model: where both stored weights are
    equal the tie is filled; where they differ, an error names both keys
    (neither is reported absent: the checkpoint holds both)."""
    untied = _LM(tied=False, seed=0)
    with torch.no_grad():
        untied.head.weight.copy_(untied.embed.weight)
    deeppart.save({"model": untied.state_dict()}, tmp_path / "same")
    tied = _LM(tied=True, seed=1)
    deeppart.load(tmp_path / "same", into={"model": tied.state_dict()})
    assert deeppart.last_incompatible_keys() == deeppart.IncompatibleKeys([], [])
    assert tied.head.weight is tied.embed.weight
    assert torch.equal(tied.embed.weight, untied.embed.weight)
    assert torch.equal(tied.mid.bias, untied.mid.bias)

    deeppart.save({"model": _LM(tied=False, seed=2).state_dict()}, tmp_path / "differ")
    for strict in (True, False):
        with pytest.raises(deeppart.StateMismatchError) as e:
            deeppart.load(tmp_path / "differ", into={"model": tied.state_dict()}, strict=strict)
        msg = str(e.value)
        assert "model/embed.weight and model/head.weight" in msg and "tied" in msg, msg
        assert "missing" not in msg and "not in into=" not in msg, msg


def test_a_tied_transformers_model_loads_into_an_untied_one(tmp_path: Path) -> None:
    """A real GPT-2 with tie_word_embeddings=True, saved, loaded into one
    without the tie: every key of its state_dict bitwise, lm_head too."""
    transformers = pytest.importorskip("transformers")

    def gpt2(tie: bool, seed: int) -> Any:
        torch.manual_seed(seed)
        config = transformers.GPT2Config(
            vocab_size=97, n_positions=16, n_embd=32, n_layer=1, n_head=2, tie_word_embeddings=tie
        )
        return transformers.GPT2LMHeadModel(config)

    tied = gpt2(True, 0)
    sd = tied.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    deeppart.save({"model": sd}, tmp_path / "ck")
    untied = gpt2(False, 1)
    deeppart.load(tmp_path / "ck", into={"model": untied.state_dict()})
    got = untied.state_dict()
    assert got["lm_head.weight"].data_ptr() != got["transformer.wte.weight"].data_ptr()
    assert sorted(got) == sorted(sd)
    for k, v in sd.items():
        assert torch.equal(got[k], v), k


# ----------------------------------------------------------------------------
# into= on the meta device (issue 49, item 6).


def test_load_into_meta_tensors_names_them(tmp_path: Path) -> None:
    """A model built under torch.device("meta") has no memory to fill: the
    load raises naming every meta leaf it would fill (two Linear layers of
    one shape are two tensors, not one), and says what to do; the
    materialized model then loads."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    deeppart.save({"model": model.state_dict(), "step": 2}, tmp_path / "ck")
    with torch.device("meta"):
        empty = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert len(deeppart.Manifest.from_state_dict(empty.state_dict())) == 4
    with pytest.raises(deeppart.StateMismatchError) as e:
        deeppart.load(tmp_path / "ck", into={"model": empty.state_dict(), "step": 0})
    msg = str(e.value)
    assert "4 meta tensor(s)" in msg, msg
    for k in ("model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias"):
        assert k in msg, msg
    assert "to_empty" in msg and "assign=True" in msg, msg
    # A part that holds no meta tensor loads.
    with torch.device("meta"):
        head = torch.nn.Linear(8, 8)
    part = {"model": {"0.weight": torch.zeros(8, 8), "0.bias": torch.zeros(8)}}
    deeppart.load(tmp_path / "ck", keys=[("model", "0.weight"), ("model", "0.bias")], into=part)
    assert torch.equal(part["model"]["0.weight"], model.state_dict()["0.weight"])
    with pytest.raises(deeppart.StateMismatchError, match="1 meta tensor"):
        deeppart.load(tmp_path / "ck", keys=[("model", "1.weight")],
                      into={"model": {"1.weight": head.weight.detach()}})  # fmt: skip
    # What the message says works.
    empty.to_empty(device="cpu")
    deeppart.load(tmp_path / "ck", into={"model": empty.state_dict(), "step": 0})
    for a, b in zip(empty.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_into_fsdp2_meta_dtensors_names_them(tmp_path: Path) -> None:
    """FSDP2 fully_shard on a model built on the meta device (one gloo
    rank): its DTensors' shards are meta; a load into them raises naming
    them instead of returning them unfilled."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.fsdp import fully_shard

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("no torch.distributed, or a process group is already initialised")
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    deeppart.save({"model": model.state_dict()}, tmp_path / "ck")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        with torch.device("meta"):
            sharded = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        fully_shard(sharded)
        into = {"model": sharded.state_dict()}
        assert into["model"]["0.weight"].to_local().device.type == "meta"
        with pytest.raises(deeppart.StateMismatchError) as e:
            deeppart.load(tmp_path / "ck", into=into)
        assert "4 meta tensor(s)" in str(e.value) and "model/1.bias" in str(e.value), e.value
    finally:
        dist.destroy_process_group()
