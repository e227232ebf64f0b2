"""Lossless per-piece codecs.

A checkpoint picks one codec; each piece is then stored either compressed
with it or, when compressing does not make the piece smaller, raw (codec
``"none"`` for that piece). Decoding always checks the decoded length.

- ``none``: the raw bytes;
- ``zstd``: Zstandard (level 1 by default);
- ``lz4``: LZ4 frame;
- ``shuffle-zstd``: byte shuffle by the element size (all first bytes, then
  all second bytes, ...), then Zstandard; helps floating-point data, whose
  exponent bytes compress better when grouped.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CODECS = ("none", "zstd", "lz4", "shuffle-zstd")


class CodecError(ValueError):
    """Unknown codec, or data that does not decode."""


def check_codec(name: str | None) -> str:
    codec = "none" if name is None else name
    if codec not in CODECS:
        raise CodecError(f"unknown compression {name!r}; choose one of {', '.join(CODECS)}")
    return codec


def _zstd() -> Any:
    import zstandard

    return zstandard


def _lz4() -> Any:
    import lz4.frame

    return lz4.frame


def _shuffle(data: memoryview, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize <= 1 or arr.size % itemsize:
        return arr.tobytes()
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T).tobytes()


def _unshuffle(data: bytes, itemsize: int) -> bytes:
    arr = np.frombuffer(data, dtype=np.uint8)
    if itemsize <= 1 or arr.size % itemsize:
        return arr.tobytes()
    return np.ascontiguousarray(arr.reshape(itemsize, -1).T).tobytes()


def compress(codec: str, data: memoryview, itemsize: int = 1, level: int = 1) -> bytes:
    """``data`` encoded with ``codec`` (not ``"none"``)."""
    if codec == "zstd":
        return bytes(_zstd().ZstdCompressor(level=level).compress(data))
    if codec == "lz4":
        return bytes(_lz4().compress(data))
    if codec == "shuffle-zstd":
        return bytes(_zstd().ZstdCompressor(level=level).compress(_shuffle(data, itemsize)))
    raise CodecError(f"cannot compress with {codec!r}")


def decompress(codec: str, data: bytes | memoryview, length: int, itemsize: int = 1) -> bytes:
    """The ``length`` bytes that ``data`` encodes; CodecError when it does
    not decode to exactly that many."""
    try:
        if codec == "zstd":
            out = _zstd().ZstdDecompressor().decompress(data, max_output_size=length)
        elif codec == "lz4":
            out = _lz4().decompress(data)
        elif codec == "shuffle-zstd":
            raw = _zstd().ZstdDecompressor().decompress(data, max_output_size=length)
            out = _unshuffle(raw, itemsize)
        else:
            raise CodecError(f"cannot decompress {codec!r}")
    except CodecError:
        raise
    except Exception as e:  # the codecs' own error types
        raise CodecError(f"{codec} data does not decode: {e}") from e
    if len(out) != length:
        raise CodecError(f"{codec} data decodes to {len(out)} bytes, expected {length}")
    return bytes(out)
