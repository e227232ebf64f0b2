"""Lossless per-piece codecs.

A checkpoint picks one codec; each piece is then stored either compressed
with it or, when compressing does not make the piece smaller, raw (codec
``"none"`` for that piece). Decoding streams, bounded: it stops at the declared length, whatever a
frame claims, and refuses pieces that expand more than :data:`MAX_EXPANSION`.

- ``none``: the raw bytes;
- ``zstd``: Zstandard (level 1 by default);
- ``lz4``: LZ4 frame;
- ``shuffle-zstd``: byte shuffle by the element size (all first bytes, then
  all second bytes, ...), then Zstandard; helps floating-point data, whose
  exponent bytes compress better when grouped.

``compression="auto"`` is not a codec but a per-piece policy
(:class:`AutoPolicy`): each piece is stored with ``shuffle-zstd`` (a tensor
of elements of 2 bytes or more: bf16, fp16, fp32, fp64, wide integers) or
``zstd`` (bytes, object leaves) only when a sample of it says compressing
pays in the save's cost model, else raw.
"""

from __future__ import annotations

import struct
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.errors import CodecError

#: The codecs a piece is stored with (``codec`` in the piece records).
CODECS = ("none", "zstd", "lz4", "shuffle-zstd")
#: The per-piece policy ``compression="auto"`` (:class:`AutoPolicy`).
AUTO = "auto"
#: What ``compression=`` accepts: a codec for every piece, or ``"auto"``.
COMPRESSIONS = (*CODECS, AUTO)


def check_codec(name: str | None) -> str:
    codec = "none" if name is None else name
    if codec not in COMPRESSIONS:
        raise CodecError(f"unknown compression {name!r}; choose one of {', '.join(COMPRESSIONS)}")
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


#: The most bytes one stored byte of a tensor piece may decode to. Bounds
#: what a small (hostile) file can make a load allocate: ``length`` is
#: refused unless ``length <= MAX_EXPANSION * stored``. :func:`compress`
#: pads a frame that compresses better (all-zero data reaches ~32000:1 with
#: zstd) with a skippable frame, so a DeepPart writer always stays within it.
MAX_EXPANSION = 256
#: The same for object (plain value) pieces, whose JSON decodes to Python
#: objects up to ~20 times its size.
MAX_OBJECT_EXPANSION = 4

#: Skippable frame (the same format in zstd and LZ4 frames): magic, length.
_SKIPPABLE = struct.Struct("<II")
_SKIPPABLE_MAGIC = 0x184D2A50


def _pad_to_ratio(packed: bytes, raw_len: int, max_expansion: int) -> bytes:
    """``packed`` followed by a skippable frame long enough that
    ``raw_len <= max_expansion * len(result)`` (``packed`` when it already is)."""
    least = -(-raw_len // max_expansion)
    if len(packed) >= least:
        return packed
    body = max(0, least - len(packed) - _SKIPPABLE.size)
    return packed + _SKIPPABLE.pack(_SKIPPABLE_MAGIC, body) + bytes(body)


def compress(
    codec: str,
    data: memoryview,
    itemsize: int = 1,
    level: int = 1,
    max_expansion: int = MAX_EXPANSION,
) -> bytes:
    """``data`` encoded with ``codec`` (not ``"none"``), at most
    ``max_expansion`` times smaller (padded with a skippable frame)."""
    if codec == "zstd":
        packed = bytes(_zstd().ZstdCompressor(level=level).compress(data))
    elif codec == "lz4":
        packed = bytes(_lz4().compress(data))
    elif codec == "shuffle-zstd":
        packed = bytes(_zstd().ZstdCompressor(level=level).compress(_shuffle(data, itemsize)))
    else:
        raise CodecError(f"cannot compress with {codec!r}")
    return _pad_to_ratio(packed, len(data), max_expansion)


#: ``"auto"`` stores pieces shorter than this raw: sampling them would cost
#: more than compressing them could save.
AUTO_MIN_PIECE = 64 << 10
#: The most bytes of a piece that ``"auto"`` compresses to decide.
AUTO_SAMPLE = 64 << 10
#: ... and at least this fraction of it (``length // AUTO_SAMPLE_DIVISOR``,
#: not below 4 KiB): sampling costs at most about 1/512 of compressing.
AUTO_SAMPLE_DIVISOR = 512
#: ``"auto"`` compresses only when the modelled compressed time is below
#: this fraction of the raw one: the sample's timing is noisy, and a piece
#: that would save little is not worth the risk of a slower save.
AUTO_MARGIN = 0.9


class AutoPolicy:
    """The ``compression="auto"`` decision, per piece, on one rank.

    The cost model of a piece of ``n`` bytes written at ``bandwidth`` bytes/s
    (the plan's calibrated cost model: the rank's bandwidth, bounded by its
    share of the node's and the storage's bandwidths) is ``n / bandwidth``
    raw, and ``n / speed + n / (ratio * bandwidth)`` compressed, where the
    codec's ``speed`` and ``ratio`` are measured by compressing a sample of
    the piece (up to :data:`AUTO_SAMPLE` bytes from its middle, whole
    elements). The piece is compressed when the latter is below
    :data:`AUTO_MARGIN` times the former, and stored compressed only if that
    made it smaller; pieces under :data:`AUTO_MIN_PIECE` bytes stay raw.
    On incompressible data (random floats) the cost is the samples alone,
    about 1/512 of the bytes compressed."""

    def __init__(self, bandwidth: float, level: int = 1) -> None:
        if not bandwidth > 0:
            raise CodecError(f"auto compression needs a positive bandwidth, not {bandwidth}")
        self.bandwidth = float(bandwidth)
        self.level = level
        self._zstd: Any = None
        #: Per codec chosen (``"none"`` included): the pieces.
        self.chosen: dict[str, int] = {}

    def codec_for(self, itemsize: int, tensor: bool) -> str:
        """The codec tried on a piece: byte shuffle for multi-byte elements."""
        return "shuffle-zstd" if tensor and itemsize > 1 else "zstd"

    def window(self, n: int, itemsize: int = 1, tensor: bool = True) -> tuple[int, int] | None:
        """The sample of a piece of ``n`` bytes, ``(offset, length)``: whole
        elements from its middle; None for a piece stored raw unsampled."""
        if n < AUTO_MIN_PIECE:
            return None
        step = itemsize if self.codec_for(itemsize, tensor) == "shuffle-zstd" else 1
        size = min(AUTO_SAMPLE, max(4 << 10, n // AUTO_SAMPLE_DIVISOR), n)
        size -= size % step
        at = (n - size) // 2
        return at - at % step, size

    def judge(self, sample: memoryview | None, itemsize: int = 1, tensor: bool = True) -> str:
        """The codec for a piece whose :meth:`window` is ``sample``."""
        codec = "none"
        if sample is not None and len(sample):
            candidate = self.codec_for(itemsize, tensor)
            if self._zstd is None:
                self._zstd = _zstd().ZstdCompressor(level=self.level)
            t0 = time.perf_counter()
            body = _shuffle(sample, itemsize) if candidate == "shuffle-zstd" else sample
            packed = len(self._zstd.compress(body))
            seconds = time.perf_counter() - t0
            size = len(sample)
            ratio = size / max(1, packed)
            raw_s = size / self.bandwidth
            if seconds + size / (ratio * self.bandwidth) < AUTO_MARGIN * raw_s:
                codec = candidate
        self.chosen[codec] = self.chosen.get(codec, 0) + 1
        return codec

    def choose(self, data: memoryview, itemsize: int = 1, tensor: bool = True) -> str:
        """The codec to store ``data`` (a piece) with, one of :data:`CODECS`."""
        w = self.window(len(data), itemsize, tensor)
        return self.judge(None if w is None else data[w[0] : w[0] + w[1]], itemsize, tensor)


def rank_bandwidth(cost: Any, topology: Any, world_size: int) -> float:
    """A rank's write bandwidth in a plan's cost model: ``bandwidth``,
    bounded by its share of ``node_bandwidth`` (the node's ranks) and of
    ``aggregate_bandwidth`` (all ranks), where set."""
    bw = float(cost.bandwidth)
    per_node = max(1, int(getattr(topology, "ranks_per_node", 1) or 1))
    if cost.node_bandwidth is not None:
        bw = min(bw, float(cost.node_bandwidth) / min(per_node, world_size))
    if cost.aggregate_bandwidth is not None:
        bw = min(bw, float(cost.aggregate_bandwidth) / max(1, world_size))
    return bw


def check_expansion(length: int, stored: int, max_expansion: int = MAX_EXPANSION) -> None:
    """CodecError unless ``stored`` bytes may decode to ``length``."""
    if length > max_expansion * stored:
        raise CodecError(
            f"{stored} stored bytes cannot decode to {length} (more than {max_expansion}:1)"
        )


def _zstd_frame(data: bytes | memoryview, length: int) -> Any:
    """A bounded streaming reader of the zstd frame at the start of ``data``,
    after checking the content size its header declares (if any)."""
    zstandard = _zstd()
    declared = zstandard.frame_content_size(data)
    if declared not in (-1, length):
        raise CodecError(f"zstd frame declares {declared} bytes, expected {length}")
    # The window never needs to exceed the content: a frame asking for more
    # is refused instead of allocating it.
    window = max(1 << 10, 1 << max(0, length - 1).bit_length())
    dctx = zstandard.ZstdDecompressor(max_window_size=min(window, 1 << 31))
    return dctx.stream_reader(data, read_across_frames=False)


#: Decoded bytes held at a time beyond the destination (LZ4 output,
#: shuffle-zstd planes): decoding needs the destination plus this much.
DECODE_CHUNK = 8 << 20


def _chunks_lz4(data: bytes | memoryview, length: int) -> Iterator[bytes]:
    """The decoded bytes of the first LZ4 frame of ``data``, in chunks of at
    most :data:`DECODE_CHUNK`, stopping after ``length + 1`` bytes."""
    lz4 = _lz4()
    declared = int(lz4.get_frame_info(data)["content_size"])
    if declared not in (0, length):  # 0: not declared
        raise CodecError(f"lz4 frame declares {declared} bytes, expected {length}")
    dec = lz4.LZ4FrameDecompressor()
    chunk: bytes | memoryview = data
    got = 0
    while got <= length and not dec.eof:
        part = dec.decompress(chunk, max_length=min(DECODE_CHUNK, length + 1 - got))
        chunk = b""
        if part:
            got += len(part)
            yield part
        elif dec.needs_input:
            raise CodecError("lz4 frame is truncated")


def _chunks_zstd(
    data: bytes | memoryview, length: int, into: memoryview | None
) -> Iterator[memoryview]:
    """The decoded bytes of the first zstd frame of ``data``: read straight
    into ``into`` (``length`` bytes) when given, else in chunks of at most
    :data:`DECODE_CHUNK`; at most one byte beyond ``length``."""
    reader = _zstd_frame(data, length)
    got = 0
    scratch = memoryview(bytearray(min(DECODE_CHUNK, length) or 1)) if into is None else None
    while got < length:
        if into is not None:
            buf = into[got:]
        else:
            assert scratch is not None
            buf = scratch[: min(len(scratch), length - got)]
        n = reader.readinto(buf)
        if not n:
            break
        got += n
        yield buf[:n]
    if reader.read(1):
        yield memoryview(b"?")  # one byte too many: the caller's count says so


def decompress_into(
    codec: str,
    data: bytes | memoryview,
    out: npt.NDArray[np.uint8],
    itemsize: int = 1,
    max_expansion: int = MAX_EXPANSION,
) -> None:
    """Decodes ``data`` into ``out`` (a flat, writable uint8 array of the
    declared length), streaming: a zstd frame is read straight into ``out``,
    LZ4 output and shuffle-zstd planes pass through at most
    :data:`DECODE_CHUNK` bytes. CodecError when ``data`` does not decode to
    exactly ``len(out)`` bytes, whatever its frame claims, or when
    ``len(out)`` exceeds ``max_expansion`` times ``len(data)`` (checked
    before decoding anything)."""
    length = int(out.size)
    check_expansion(length, len(data), max_expansion)
    shuffled = codec == "shuffle-zstd" and itemsize > 1 and length % itemsize == 0
    try:
        if codec in ("zstd", "shuffle-zstd"):
            direct = None if shuffled else out.data
            chunks: Iterator[bytes | memoryview] = _chunks_zstd(data, length, direct)
        elif codec == "lz4":
            chunks = _chunks_lz4(data, length)
        else:
            raise CodecError(f"cannot decompress {codec!r}")
        # A shuffled stream holds plane k (byte k of every element) at
        # [k * n, (k + 1) * n): each chunk goes to its column(s) of ``out``.
        planes = out.reshape(-1, itemsize) if shuffled else None
        n = length // itemsize if shuffled else length
        got = 0
        for chunk in chunks:
            if got + len(chunk) > length:
                raise CodecError(f"{codec} data decodes to more than {length} bytes")
            if codec == "lz4":
                out[got : got + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            elif planes is not None:
                src = np.frombuffer(chunk, dtype=np.uint8)
                at = 0
                while at < src.size:
                    k, i = divmod(got + at, n)
                    take = min(src.size - at, n - i)
                    planes[i : i + take, k] = src[at : at + take]
                    at += take
            got += len(chunk)
    except CodecError:
        raise
    except Exception as e:  # the codecs' own error types
        raise CodecError(f"{codec} data does not decode: {e}") from e
    if got != length:
        raise CodecError(f"{codec} data decodes to {got} bytes, expected {length}")


def decompress(
    codec: str,
    data: bytes | memoryview,
    length: int,
    itemsize: int = 1,
    max_expansion: int = MAX_EXPANSION,
) -> bytes:
    """The ``length`` bytes that ``data`` encodes (see :func:`decompress_into`)."""
    check_expansion(length, len(data), max_expansion)
    out = np.empty(length, dtype=np.uint8)
    decompress_into(codec, data, out, itemsize, max_expansion)
    return out.tobytes()


def compression_level_of(compression_level: int, level: int | None, stacklevel: int = 3) -> int:
    """The compression level to use: ``level`` (the old name of
    ``compression_level``, deprecated) when given, with a warning."""
    if level is None:
        return compression_level
    warnings.warn(
        "level= is deprecated and will be removed in the next release: "
        "use compression_level= (level now names the storage levels L1-L4)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return level
