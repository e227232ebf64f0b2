"""``deeppart inspect``: structure, writers, compression, and --verify
catching a corrupted piece in a real checkpoint written by deeppart.save."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import deeppart  # noqa: E402
from deeppart.options import WriteOptions  # noqa: E402
from deeppart.tools.cli import main  # noqa: E402


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(256, 512, generator=g), "b": torch.zeros(512)},
        "optim": {"state": {0: {"exp_avg": torch.ones(300, 100)}}, "lr": 0.1},
        "step": 7,
    }


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    deeppart.save(_state(), d)
    return d


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    rc = main(["inspect", *argv])
    return rc, capsys.readouterr().out


def test_text_shows_structure_writers_and_level(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out = _run(capsys, str(ckpt))
    assert rc == 0
    for needle in ("model.w", "float32", "256x512", "structure", "who wrote what",
                   "rank-00000.bin", "none (a plain deeppart.save checkpoint)",
                   "ratio 1.000x"):  # fmt: skip
        assert needle in out, needle


def test_json_matches_metadata(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, str(ckpt), "--json", "--leaves-in-json")
    assert rc == 0
    info = json.loads(out)
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert info["committed"] is True
    assert info["world_size"] == 1
    assert info["raw_bytes"] == meta["raw_bytes"]
    assert info["stored_bytes"] == meta["stored_bytes"]
    assert sum(r["raw_bytes"] for r in info["ranks"]) == info["raw_bytes"]
    assert sum(r["pieces"] for r in info["ranks"]) == len(meta["pieces"])
    paths = {lf["path"]: lf for lf in info["leaf_table"]}
    assert paths["model.w"]["bytes"] == 256 * 512 * 4
    assert "verify" not in info


def test_verify_ok(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run(capsys, str(ckpt), "--verify", "--json")
    assert rc == 0
    v = json.loads(out)["verify"]
    assert v["ok"] and not v["failures"]
    assert v["pieces_checked"] == len(json.loads((ckpt / "metadata.json").read_text())["pieces"])


def _flip_in_leaf(ckpt: Path, path: list[Any]) -> int:
    """Flips one byte inside the (first) piece of the leaf at ``path``; returns
    the piece's index."""
    meta = json.loads((ckpt / "metadata.json").read_text())
    leaves = [lf["path"] for lf in meta["manifest"]["leaves"]]
    leaf = leaves.index(path)
    for j, row in enumerate(meta["pieces"]):
        if row[0] == leaf and row[6] > 0:
            rank, offset, stored = row[3], row[4], row[6]
            f = ckpt / f"rank-{rank:05d}.bin"
            data = bytearray(f.read_bytes())
            data[offset + stored // 2] ^= 0xFF
            f.write_bytes(bytes(data))
            return j
    raise AssertionError("leaf has no stored piece")


def test_verify_catches_a_flipped_byte(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    j = _flip_in_leaf(ckpt, ["model", "w"])
    rc, out = _run(capsys, str(ckpt), "--verify")
    assert rc == 1
    assert "FAILURE" in out
    assert "rank-00000.bin" in out and f"piece {j}" in out and "model.w" in out
    assert "checksum mismatch" in out

    rc, out = _run(capsys, str(ckpt), "--verify", "--json")
    assert rc == 1
    failures = json.loads(out)["verify"]["failures"]
    assert len(failures) == 1
    assert failures[0]["piece"] == j and failures[0]["path"] == "model.w"
    assert failures[0]["file"].endswith("rank-00000.bin")


def test_compressed_checkpoint_ratio_and_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "z"
    state = {"zeros": torch.zeros(1 << 18), "noise": torch.randn(1000)}
    deeppart.save(state, d, writing=WriteOptions(compression="zstd"))
    rc, out = _run(capsys, str(d), "--verify", "--json")
    assert rc == 0
    info = json.loads(out)
    assert info["compression"] == "zstd"
    assert info["compression_ratio"] > 10
    _flip_in_leaf(d, ["zeros"])
    rc, out = _run(capsys, str(d), "--verify")
    assert rc == 1 and "zeros" in out


def test_truncated_file_and_uncommitted(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = ckpt / "rank-00000.bin"
    f.write_bytes(f.read_bytes()[:-10])
    rc, out = _run(capsys, str(ckpt), "--verify")
    assert rc == 1 and "metadata says" in out
    (ckpt / "COMMITTED").unlink()
    rc, out = _run(capsys, str(ckpt))
    assert rc == 1 and "committed     NO" in out


def test_not_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope")]) == 2


def test_fti_backend_step_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A multi-level step the FTI backend wrote has no metadata.json (libfti
    keeps its own files, indexed by fti-step-N.json): the error says so and
    what to do, instead of only 'cannot read metadata.json'."""
    meta = tmp_path / "meta" / "deeppart"
    meta.mkdir(parents=True)
    assert main(["inspect", str(meta / "step-00000040")]) == 2
    assert "FTI backend" not in capsys.readouterr().err
    (meta / "fti-step-00000040.json").write_text("{}")
    assert main(["inspect", str(meta / "step-00000040")]) == 2
    err = capsys.readouterr().err
    assert "fti-step-00000040.json is there" in err and "backend='builtin'" in err
