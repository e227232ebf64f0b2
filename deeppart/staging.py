"""Device <-> host staging in bounded chunks.

A checkpoint's bytes pass through host memory. For tensors that are not in
host memory (CUDA, ...), :func:`deeppart.save` copies each planned piece to
the host one chunk at a time, through one reusable host buffer of at most
``budget`` bytes (pinned when CUDA is available), and writes it from there;
:func:`deeppart.load` with ``into=`` device tensors reads each raw piece
into that buffer, chunk by chunk, and copies it to the device. No host copy
of a whole tensor or of the whole state is made.

Compressed pieces are the exception: a codec works on a whole piece, so a
compressed piece of a device tensor is staged whole (bounded by the piece,
not by the budget). Non-contiguous device tensors are made contiguous on
their device first.

:func:`needs_staging` decides which tensors go this way (every tensor not on
the CPU); the tests replace it to run the same code on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

#: Default host staging budget, in bytes.
DEFAULT_STAGING_BYTES = 64 << 20

#: Smallest buffer allocated (unless the budget is smaller), so that a run
#: of small pieces does not reallocate.
_MIN_ALLOC = 1 << 20

U8 = npt.NDArray[np.uint8]


def needs_staging(t: Any) -> bool:
    """Whether tensor ``t``'s bytes must be staged through host memory."""
    return bool(t.device.type != "cpu")


def device_bytes(t: Any) -> Any:
    """A flat ``uint8`` tensor of ``t``'s elements in row-major order, on
    ``t``'s device (a view when ``t`` is contiguous; otherwise a copy on the
    device, with conjugation and negation resolved)."""
    import torch

    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


@dataclass
class DeviceSink:
    """Bytes ``[offset, offset + length)`` of a flat ``uint8`` device tensor."""

    tensor: Any
    offset: int
    length: int


class Staging:
    """One reusable host buffer of at most ``budget`` bytes, allocated on
    first use and grown (never past the budget) as pieces need.

    ``peak`` is the largest buffer held, ``copies`` the chunks moved.
    """

    def __init__(self, budget: int | None = None) -> None:
        budget = DEFAULT_STAGING_BYTES if budget is None else int(budget)
        if budget < 1:
            raise ValueError(f"the staging budget must be at least 1 byte, not {budget}")
        self.budget = budget
        self.peak = 0
        self.copies = 0
        self._host: Any = None

    def host(self, n: int) -> Any:
        """A host ``uint8`` tensor of ``n <= budget`` bytes (the buffer's head)."""
        if n > self.budget:
            raise ValueError(f"{n} bytes exceed the staging budget of {self.budget}")
        if self._host is None or self._host.numel() < n:
            import torch

            size = min(self.budget, max(n, _MIN_ALLOC))
            self._host = None  # free the smaller buffer first
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=_pin())
            self.peak = max(self.peak, size)
        return self._host[:n]

    def read(self, src: Any, start: int, stop: int) -> Iterator[U8]:
        """Bytes ``[start, stop)`` of flat ``uint8`` tensor ``src``, chunk by
        chunk, each a numpy view of the host buffer (valid until the next)."""
        for lo in range(start, stop, self.budget):
            n = min(self.budget, stop - lo)
            h = self.host(n)
            h.copy_(src[lo : lo + n])
            self.copies += 1
            arr: U8 = h.numpy()
            yield arr

    def put(self, sink: DeviceSink, data: U8, at: int = 0) -> None:
        """Copies host bytes ``data`` to ``sink`` at byte ``at`` of its range,
        through the host buffer in chunks."""
        if at + data.size > sink.length:
            raise ValueError("data overruns the destination")
        for lo in range(0, data.size, self.budget):
            n = min(self.budget, data.size - lo)
            h = self.host(n)
            h.numpy()[:] = data[lo : lo + n]
            self.to_device(sink, at + lo, h)

    def to_device(self, sink: DeviceSink, at: int, host: Any) -> None:
        """Copies host tensor ``host`` (a view of the buffer) into ``sink`` at ``at``."""
        lo = sink.offset + at
        sink.tensor[lo : lo + host.numel()].copy_(host)
        self.copies += 1


def _pin() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def write_stream(f: BinaryIO, chunks: Iterator[U8]) -> tuple[int, int]:
    """Writes ``chunks`` at ``f``'s position; returns (bytes, xxh3_64 of them)."""
    import xxhash

    h = xxhash.xxh3_64()
    n = 0
    for chunk in chunks:
        f.write(chunk.data)
        h.update(chunk.data)
        n += chunk.size
    return n, int(h.intdigest())


def read_stream(f: Any, length: int, sink: DeviceSink, staging: Staging) -> int | None:
    """Reads ``length`` raw bytes at ``f``'s position into ``sink``, chunk by
    chunk; returns their xxh3_64, or None on a short read."""
    import xxhash

    h = xxhash.xxh3_64()
    pos = 0
    while pos < length:
        n = min(staging.budget, length - pos)
        host = staging.host(n)
        arr = host.numpy()
        if f.readinto(arr.data) != n:
            return None
        h.update(arr.data)
        staging.to_device(sink, pos, host)
        pos += n
    return int(h.intdigest())
