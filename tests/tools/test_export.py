"""Export to safetensors (loaded by safetensors and by transformers'
from_pretrained) and to one torch.save file; import of both; round trips."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import deeppart
from deeppart.errors import ExportError
from deeppart.format import data_file_name
from deeppart.loading.reader import read_metadata
from deeppart.tools.export import (
    SAFETENSORS_INDEX,
    SAFETENSORS_SINGLE,
    export_safetensors,
    export_torch,
    import_checkpoint,
)

ROOT = Path(__file__).resolve().parents[2]


def _tiny_gpt2() -> Any:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=2, tie_word_embeddings=True
    )
    return transformers.GPT2LMHeadModel(config)


def _load_dir(d: Path) -> dict[str, torch.Tensor]:
    index = d / SAFETENSORS_INDEX
    if not index.exists():
        return load_file(d / SAFETENSORS_SINGLE)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(d / f))
    return out


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(
            a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)
        ), k


def test_safetensors_export_loads_with_safetensors_and_from_pretrained(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    sd = {k: v for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    deeppart.save(
        {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, tmp_path / "ck"
    )

    out = tmp_path / "hf"
    model.save_pretrained(out)  # for its config.json
    for f in out.glob("*.safetensors*"):
        f.unlink()
    files = export_safetensors(tmp_path / "ck", out, max_shard_bytes=20_000)
    assert (out / SAFETENSORS_INDEX).exists() and len(files) > 3, "sharded, with an index"
    index = json.loads((out / SAFETENSORS_INDEX).read_text())
    assert set(index["weight_map"]) == set(sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    _bitwise(sd, _load_dir(out))

    import transformers

    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    _bitwise(sd, loaded.state_dict())


def test_export_one_shard_without_index(tmp_path: Path) -> None:
    state = {"w": torch.randn(4, 4).to(torch.bfloat16), "b": torch.arange(3)}
    deeppart.save(state, tmp_path / "ck")
    files = export_safetensors(tmp_path / "ck", tmp_path / "out")
    assert [f.name for f in files] == [SAFETENSORS_SINGLE]
    _bitwise(state, load_file(files[0]))


def test_import_then_export_round_trips(tmp_path: Path) -> None:
    model = _tiny_gpt2()
    deeppart.save({"model": model.state_dict()}, tmp_path / "ck")
    export_safetensors(tmp_path / "ck", tmp_path / "a", max_shard_bytes=50_000)
    import_checkpoint(tmp_path / "a", tmp_path / "ck2")
    export_safetensors(tmp_path / "ck2", tmp_path / "b", max_shard_bytes=50_000)
    first, second = _load_dir(tmp_path / "a"), _load_dir(tmp_path / "b")
    _bitwise(first, second)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(
        p.name for p in (tmp_path / "b").iterdir()
    )


def test_torch_export_and_import(tmp_path: Path) -> None:
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 3,
        "t": (1, 2.5),
    }
    deeppart.save(state, tmp_path / "ck")
    export_torch(tmp_path / "ck", tmp_path / "out.pt")
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    assert got["step"] == 3 and got["t"] == (1, 2.5)
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v)
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])

    import_checkpoint(tmp_path / "out.pt", tmp_path / "ck2")
    again = deeppart.load(tmp_path / "ck2")
    assert again["t"] == (1, 2.5)
    assert torch.equal(
        again["optim"]["state"][0]["exp_avg_sq"], state["optim"]["state"][0]["exp_avg_sq"]
    )


def test_import_refuses_pickled_objects(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (print, ("unpickled!",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ExportError, match="weights_only"):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_export_errors(tmp_path: Path) -> None:
    deeppart.save({"step": 1}, tmp_path / "ck")
    with pytest.raises(ExportError, match="no tensors"):
        export_safetensors(tmp_path / "ck", tmp_path / "out")
    with pytest.raises(deeppart.CheckpointError):
        export_safetensors(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "bad").mkdir()
    with pytest.raises(ExportError, match=r"no model\.safetensors\.index\.json"):
        import_checkpoint(tmp_path / "bad", tmp_path / "ck3")


def test_cli(tmp_path: Path) -> None:
    deeppart.save({"model": {"w": torch.randn(5)}}, tmp_path / "ck")
    run = [sys.executable, "-m", "deeppart"]
    r = subprocess.run(
        [*run, "export", str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "st")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [*run, "import", str(tmp_path / "st"), str(tmp_path / "ck2")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert torch.equal(
        deeppart.load(tmp_path / "ck2")["model"]["w"], deeppart.load(tmp_path / "ck")["model"]["w"]
    )
    r = subprocess.run(
        [*run, "export", str(tmp_path / "nope"), "--to", "torch", str(tmp_path / "x.pt")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "deeppart export: error" in r.stderr


def test_cli_torch_export_honours_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--to torch --key model`` writes the model's part only (its own keys
    at the top, as ``model.load_state_dict`` takes them); without ``--key``
    the whole state; an absent key is an error naming the checkpoint's keys."""
    from deeppart.tools.cli import main

    w = torch.randn(5)
    deeppart.save({"model": {"w": w}, "optim": {"m": torch.ones(2)}, "step": 4}, tmp_path / "ck")
    ck = str(tmp_path / "ck")
    assert main(["export", ck, "--to", "torch", str(tmp_path / "m.pt"), "--key", "model"]) == 0
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert set(got) == {"w"} and torch.equal(got["w"], w)
    assert main(["export", ck, "--to", "torch", str(tmp_path / "all.pt")]) == 0
    assert set(torch.load(tmp_path / "all.pt", weights_only=True)) == {"model", "optim", "step"}
    capsys.readouterr()
    assert main(["export", ck, "--to", "torch", str(tmp_path / "x.pt"), "--key", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "model" in err, err
    assert not (tmp_path / "x.pt").exists()


def test_cli_safetensors_shards_only_over_max_shard_bytes(tmp_path: Path) -> None:
    """What docs/CLI.md says of ``--to safetensors``: one model.safetensors
    while the model fits ``--max-shard-bytes`` (5 GB by default), shards and
    model.safetensors.index.json above it."""
    from deeppart.tools.cli import main

    deeppart.save({"model": {"a": torch.randn(1000), "b": torch.randn(1000)}}, tmp_path / "ck")
    ck = str(tmp_path / "ck")
    assert main(["export", ck, "--to", "safetensors", str(tmp_path / "one")]) == 0
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [SAFETENSORS_SINGLE]
    out = str(tmp_path / "many")
    assert main(["export", ck, "--to", "safetensors", out, "--max-shard-bytes", "4000"]) == 0
    names = sorted(p.name for p in (tmp_path / "many").iterdir())
    assert SAFETENSORS_INDEX in names and len(names) == 3, names
    page = (ROOT / "docs" / "CLI.md").read_text()
    line = next(ln for ln in page.splitlines() if "--to safetensors hf-model/" in ln)
    assert "--max-shard-bytes" in line, line


def test_a_failed_export_removes_only_what_it_made(tmp_path: Path) -> None:
    """The second shard's load fails (a byte of its tensor flipped on disk):
    the first shard, already written, is removed, and so are the output
    directory and its parents where the export made them; a directory that
    was there keeps itself and its other files (a model's config.json)."""
    deeppart.save({"model": {"a": torch.randn(1000), "b": torch.randn(1000)}}, tmp_path / "ck")
    meta, _ = read_metadata(tmp_path / "ck")
    b = next(i for i, lf in enumerate(meta.leaves) if lf.path == ["model", "b"])
    piece = next(p for p in meta.pieces if p.leaf == b)
    data = tmp_path / "ck" / data_file_name(piece.rank)
    raw = bytearray(data.read_bytes())
    raw[piece.offset + piece.length // 2] ^= 0x40
    data.write_bytes(bytes(raw))
    made = tmp_path / "new" / "hf"
    with pytest.raises(deeppart.CorruptCheckpointError):
        export_safetensors(tmp_path / "ck", made, max_shard_bytes=4000)
    assert not (tmp_path / "new").exists()
    there = tmp_path / "there"
    there.mkdir()
    (there / "config.json").write_text("{}")
    with pytest.raises(deeppart.CorruptCheckpointError):
        export_safetensors(tmp_path / "ck", there, max_shard_bytes=4000)
    assert sorted(p.name for p in there.iterdir()) == ["config.json"]
    assert (there / "config.json").read_text() == "{}"


MPIEXEC = Path(sys.executable).parent / "mpiexec"


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec (the mpich wheel) is not installed")
def test_export_under_mpiexec_is_written_once_by_rank_zero(tmp_path: Path) -> None:
    """Every rank writing the same export would race on one file; rank 0
    writes it alone, every rank exits with its result, and the files are
    whole (no temporary name left behind)."""
    w = torch.randn(3000)
    deeppart.save({"model": {"w": w, "b": torch.arange(7)}}, tmp_path / "ck")
    export = [str(MPIEXEC), "-n", "3", sys.executable, "-m", "deeppart", "export"]
    r = subprocess.run(
        [*export, str(tmp_path / "ck"), "--to", "safetensors", str(tmp_path / "st"),
         "--max-shard-bytes", "4000"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    printed = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(printed) == 3 and len(set(printed)) == 3, printed  # 2 shards and the index, once
    assert sorted(p.name for p in (tmp_path / "st").iterdir()) == sorted(
        Path(p).name for p in printed
    )
    got = _load_dir(tmp_path / "st")
    assert torch.equal(got["w"], w) and torch.equal(got["b"], torch.arange(7))
    r = subprocess.run(
        [*export, str(tmp_path / "missing"), "--to", "torch", str(tmp_path / "x.pt")],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("deeppart export: error") == 1, r.stderr
    assert not (tmp_path / "x.pt").exists()
