"""deeppart.loading.reader.read_file with ``through=``: the reader of a one-host load
reads each raw piece into the shared window chunk by chunk, checksums each
chunk there and copies it on to its own tensor. A piece longer than one
chunk (with a partial last chunk) arrives whole in both places; a byte
changed in any chunk, or a file cut short, raises CorruptCheckpointError.
The multi-rank path (a window, four ranks) is tests/support/mpi_checkpoint.py's
shared_check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deeppart
from deeppart.errors import CorruptCheckpointError
from deeppart.format import Metadata, Piece, data_file_name
from deeppart.loading import reader
from deeppart.progress import Progress

CHUNK = 4096


def _saved(tmp_path: Path) -> tuple[Path, Metadata, list[Piece], dict[str, torch.Tensor]]:
    """One file holding a tensor of several chunks and a partial one, and a
    short one: its directory, metadata and pieces (in file order)."""
    state = {
        "long": torch.arange(5 * CHUNK // 4 * 2 + 3, dtype=torch.float32),  # 2.5 chunks + 12 B
        "short": torch.arange(7, dtype=torch.int64),
    }
    d = tmp_path / "ck"
    deeppart.save(state, d)
    meta, _ = reader.read_metadata(d)
    pieces = sorted((p for p in meta.pieces if p.rank == 0), key=lambda p: p.offset)
    assert max(p.length for p in pieces) > 2 * CHUNK
    assert max(p.length for p in pieces) % CHUNK
    return d, meta, pieces, state


def _read(d: Path, meta: Metadata, pieces: list[Piece]) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """Reads ``pieces`` into one buffer (the window's stand-in), through to
    one array per piece (the tensors' stand-in)."""
    window = np.zeros(sum(p.length for p in pieces), dtype=np.uint8)
    own = {id(p): np.zeros(p.length, dtype=np.uint8) for p in pieces}
    reader.read_file(
        d,
        meta,
        0,
        pieces,
        reader._place(window, pieces),
        Progress("load", window.size, enabled=False),
        through=lambda p: own[id(p)],
    )
    return window, own


def test_a_piece_of_several_chunks_arrives_whole_in_both_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "THROUGH_CHUNK_BYTES", CHUNK)
    d, meta, pieces, _ = _saved(tmp_path)
    window, own = _read(d, meta, pieces)
    data = (d / data_file_name(0)).read_bytes()
    at = 0
    for p in pieces:
        stored = np.frombuffer(data[p.offset : p.offset + p.length], dtype=np.uint8)
        assert np.array_equal(window[at : at + p.length], stored)
        assert np.array_equal(own[id(p)], stored)
        at += p.length


def _flip(d: Path, pieces: list[Piece], where: str) -> Piece:
    """Changes one byte of the longest piece's first, middle or last chunk
    in the data file; returns that piece."""
    p = max(pieces, key=lambda p: p.length)
    pos = {"first": 5, "middle": CHUNK + 17, "last": p.length - 1}[where]
    path = d / data_file_name(0)
    data = bytearray(path.read_bytes())
    data[p.offset + pos] ^= 0x01
    path.write_bytes(bytes(data))
    return p


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_changed_byte_in_any_chunk_fails_the_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.setattr(reader, "THROUGH_CHUNK_BYTES", CHUNK)
    d, meta, pieces, _ = _saved(tmp_path)
    _flip(d, pieces, where)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch"):
        _read(d, meta, pieces)


def test_a_file_cut_in_a_chunk_is_a_short_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reader, "THROUGH_CHUNK_BYTES", CHUNK)
    d, meta, pieces, _ = _saved(tmp_path)
    p = max(pieces, key=lambda p: p.length)
    path = d / data_file_name(0)
    with open(path, "r+b") as f:
        f.truncate(p.offset + CHUNK + 100)
    with pytest.raises(CorruptCheckpointError, match=r"short read"):
        _read(d, meta, [p])


# ----------------------------------------------------------------------------
# ``hot=True`` without ``through``: a long piece read straight into its
# target (every rank reading every file, a broadcast's reader, one process)
# is checksummed chunk by chunk as it is read, not in a second pass.


def _read_hot(d: Path, meta: Metadata, pieces: list[Piece]) -> dict[int, np.ndarray]:
    own = {id(p): np.zeros(p.length, dtype=np.uint8) for p in pieces}
    reader.read_file(
        d,
        meta,
        0,
        pieces,
        lambda p: own[id(p)],
        Progress("load", sum(p.length for p in pieces), enabled=False),
        hot=True,
    )
    return own


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of CHUNK bytes, and every piece of at least 2 chunks read hot."""
    monkeypatch.setattr(reader, "THROUGH_CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(reader, "OVERLAP_CHECKSUM_BYTES", 2 * CHUNK)


def test_a_hot_read_arrives_whole(tmp_path: Path, small_chunks: None) -> None:
    d, meta, pieces, _ = _saved(tmp_path)
    hot: list[Any] = []
    real = reader._read_through

    def spy(*a: Any) -> None:
        hot.append(a[1])
        real(*a)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(reader, "_read_through", spy)
        own = _read_hot(d, meta, pieces)
    assert [p.length for p in hot] == [max(p.length for p in pieces)]  # the long one only
    data = (d / data_file_name(0)).read_bytes()
    for p in pieces:
        assert own[id(p)].tobytes() == data[p.offset : p.offset + p.length]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_changed_byte_in_any_chunk_fails_a_hot_read(
    tmp_path: Path, small_chunks: None, where: str
) -> None:
    d, meta, pieces, _ = _saved(tmp_path)
    p = _flip(d, pieces, where)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch"):
        _read_hot(d, meta, pieces)
    # deeppart.load reads this way in one process: the same error, naming the piece.
    with pytest.raises(CorruptCheckpointError, match=rf"piece of leaf {p.leaf} .*checksum"):
        deeppart.load(d)


def test_a_file_cut_in_a_chunk_is_a_short_hot_read(tmp_path: Path, small_chunks: None) -> None:
    d, meta, pieces, _ = _saved(tmp_path)
    p = max(pieces, key=lambda p: p.length)
    with open(d / data_file_name(0), "r+b") as f:
        f.truncate(p.offset + CHUNK + 100)
    with pytest.raises(CorruptCheckpointError, match=r"short read"):
        _read_hot(d, meta, [p])
