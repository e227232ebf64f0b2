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

CUDA (docs/GPU.md):

- :class:`DeviceToHost` issues an asynchronous save's device-to-host copies
  on a side stream of each device (one per device, reused), after every
  change the training stream had queued, into pinned memory; the training
  stream is not blocked. :class:`CopiesIssued` is what comes back: the
  host can wait for the copies (the writer thread does), and the training
  stream is ordered after them on the device (:mod:`deeppart.saving.snapshot`).
- :func:`read_to_device` loads raw pieces into device tensors from a local
  file with several threads: each reads a chunk into a pinned slot of the
  staging budget (``pread``, the GIL released), issues its host-to-device
  copy on the thread's own stream, and the piece's checksum is computed on
  the host copy, chunk after chunk in order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

#: Default host staging budget, in bytes (pinned with CUDA). A load into
#: device tensors keeps up to 16 chunks of 8 MiB in flight in it (8
#: readers, two slots each).
DEFAULT_STAGING_BYTES = 256 << 20

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

    def slots(self, threads: int) -> tuple[list[Any], int]:
        """The buffer cut into equal slots for ``threads`` readers (two each
        where the budget allows, each at most :data:`LOAD_CHUNK_BYTES`):
        the slots and their size. Together they fit the budget."""
        size = max(1, min(LOAD_CHUNK_BYTES, self.budget // max(2, 2 * threads)))
        count = max(1, min(2 * threads, self.budget // size))
        whole = self.host(count * size)
        return [whole[k * size : (k + 1) * size] for k in range(count)], size


def _pin() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# ----------------------------------------------------------------------------
# CUDA streams: an asynchronous save's device-to-host copies.


def new_event(timing: bool = False, blocking: bool = True) -> Any:
    """A CUDA event; ``blocking``: a thread waiting for it sleeps (the
    default of torch's events spins a core while it waits)."""
    import torch

    return torch.cuda.Event(enable_timing=timing, blocking=blocking)  # type: ignore[no-untyped-call]


def new_stream(device: Any) -> Any:
    """A new CUDA stream on ``device``."""
    import torch

    return torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]


_STREAMS: dict[Any, Any] = {}
_STREAMS_LOCK = threading.Lock()


def side_stream(device: Any) -> Any:
    """DeepPart's own CUDA stream on ``device`` (made once, reused)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = _STREAMS[index] = new_stream(index)
        return stream


@dataclass
class CopiesIssued:
    """Device-to-host copies issued on side streams: per device, the events
    recorded before and after them on its side stream."""

    events: dict[Any, tuple[Any, Any]] = field(default_factory=dict)
    #: The device tensors the copies read (kept alive until they are done).
    sources: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        """Blocks this thread until every copy is done (the GIL released);
        drops the references to the sources."""
        for _, end in self.events.values():
            end.synchronize()
        self.sources.clear()

    def order_after(self) -> None:
        """Makes the current stream of each device wait for the copies
        before anything queued on it next (no wait on the host)."""
        import torch

        for device, (_, end) in self.events.items():
            torch.cuda.current_stream(device).wait_event(end)

    def seconds(self) -> float:
        """The copies' time on the devices (the longest device's), measured
        by their events; call after :meth:`wait`."""
        return max(
            (start.elapsed_time(end) / 1000 for start, end in self.events.values()), default=0.0
        )


class DeviceToHost:
    """Copies of device bytes into pinned host memory, issued on the side
    stream of each device after everything queued on its current stream
    (the training stream) so far: the copies read the state as it was
    when the save was called, and the training stream runs on.

    Call :meth:`copy` for every piece, then :meth:`issued`. The sources'
    memory is kept from reuse by the caching allocator until the side
    stream is done with it (``record_stream``); a source made by
    :func:`device_bytes` (a contiguous copy) must be made before the first
    :meth:`copy` on its device, so that the side stream waits for it."""

    def __init__(self) -> None:
        self._issued = CopiesIssued()

    def copy(self, dst: Any, src: Any) -> None:
        """Queues ``dst.copy_(src)`` (``dst`` pinned host, ``src`` on a CUDA device)."""
        import torch

        device = src.device
        entry = self._issued.events.get(device)
        if entry is None:
            stream = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            start = new_event(timing=True, blocking=False)
            start.record(stream)
            self._issued.events[device] = (start, stream)
        else:
            stream = entry[1]
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        src.record_stream(stream)
        self._issued.sources.append(src)

    def issued(self) -> CopiesIssued:
        """Records the end of the copies on each side stream."""

        for device, (start, stream) in list(self._issued.events.items()):
            # A thread that waits for the copies sleeps.
            end = new_event(timing=True)
            end.record(stream)
            self._issued.events[device] = (start, end)
        return self._issued


# ----------------------------------------------------------------------------
# Loads into device tensors: several readers, checksummed host copies.

#: The most bytes one slot of a device load holds (a chunk read, checksummed
#: and copied to the device at once).
LOAD_CHUNK_BYTES = 8 << 20


def descriptor_of(f: Any) -> int | None:
    """``f``'s file descriptor, or None for a file object that has none (an
    object store's upload or download)."""
    fileno = getattr(f, "fileno", None)
    if fileno is None:
        return None
    try:
        return int(fileno())
    except (OSError, ValueError):
        return None


def load_threads() -> int:
    """Reader threads of a load into device tensors: ``DEEPPART_LOAD_THREADS``,
    else one per CPU, at most 8 (on an H200 host with 16 CPUs, 8 readers
    loaded faster than 4, 12 or 16: docs/GPU.md)."""
    env = os.environ.get("DEEPPART_LOAD_THREADS")
    if env:
        return max(1, int(env))
    return max(1, min(8, os.cpu_count() or 1))


@dataclass
class DeviceRead:
    """A raw piece to load into a device tensor: ``length`` bytes at
    ``offset`` of the open file, into ``sink``; their xxh3_64 must be
    ``xxh3``. ``key`` names it to the caller."""

    offset: int
    length: int
    sink: DeviceSink
    xxh3: int
    key: Any


def _order(reads: list[DeviceRead], lanes: int, chunk: int) -> list[tuple[int, int]]:
    """The order in which the readers take the chunks, as (read index,
    chunk index): the pieces spread over ``lanes`` lanes of about equal
    bytes (largest first), then the lanes interleaved chunk by chunk, so
    that readers working at once mostly work on different pieces. Each
    piece's chunks come in order, so the first chunk of a piece not yet
    checksummed has always been taken (it holds a slot) before any after it.
    """
    load = [0] * lanes
    queues: list[list[tuple[int, int]]] = [[] for _ in range(lanes)]
    for i in sorted(range(len(reads)), key=lambda i: (-reads[i].length, i)):
        k = min(range(lanes), key=lambda j: (load[j], j))
        load[k] += reads[i].length
        n = max(1, -(-reads[i].length // chunk))
        queues[k].extend((i, c) for c in range(n))
    order: list[tuple[int, int]] = []
    for at in range(max((len(q) for q in queues), default=0)):
        order.extend(q[at] for q in queues if at < len(q))
    return order


class _DeviceLoad:
    """The shared state of one :func:`read_to_device`.

    The readers take the chunks in :func:`_order`, each into a free slot:
    read it (one ``pread``), queue its copy to the device, then checksum
    it, and the chunks after it already read, if it is the next of its
    piece and no other reader is checksumming that piece; otherwise it
    waits in its slot for the reader that is. A slot goes back to the pool
    once its chunk is checksummed, and is reused once its copy to the
    device is done (its event). Measured on an H200 (docs/GPU.md), this
    beat readers that each own a lane and checksum in 1 MiB steps while
    reading (the extra calls cost more in the GIL than the warm cache
    saved)."""

    def __init__(
        self,
        fd: int,
        reads: list[DeviceRead],
        slots: list[Any],
        chunk: int,
        error: Callable[[Any, str], BaseException],
        verified: Callable[[DeviceRead], None],
        threads: int,
    ) -> None:
        import xxhash

        self.fd, self.reads, self.chunk = fd, reads, chunk
        self.error, self.verified = error, verified
        self.order = _order(reads, threads, chunk)
        self.lock = threading.Lock()
        self.claimed = 0
        self.failure: BaseException | None = None
        self.free: list[tuple[Any, Any]] = [(s, None) for s in slots]
        self.slot_ready = threading.Condition(self.lock)
        self.hashers = [xxhash.xxh3_64() for _ in reads]
        self.next = [0] * len(reads)
        self.hashing = [False] * len(reads)
        self.ready: list[dict[int, tuple[Any, Any, int]]] = [{} for _ in reads]
        self.copies = 0
        self.events: list[Any] = []
        cuda = [r.sink.tensor.device for r in reads if r.sink.tensor.device.type == "cuda"]
        self.cuda = bool(cuda)
        self.start_event: Any = None
        if cuda:
            import torch

            self.device = cuda[0]
            self.start_event = new_event(blocking=False)
            self.start_event.record(torch.cuda.current_stream(self.device))

    def fail(self, e: BaseException) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = e
            self.slot_ready.notify_all()

    def take(self) -> tuple[Any, Any, int, int] | None:
        """A free slot and the next chunk to read into it (None: all taken,
        or the load failed)."""
        with self.lock:
            while not self.free and self.failure is None:
                self.slot_ready.wait()
            if self.failure is not None or self.claimed >= len(self.order):
                return None
            slot, event = self.free.pop()
            i, c = self.order[self.claimed]
            self.claimed += 1
        return slot, event, i, c

    def give_back(self, slot: Any, event: Any) -> None:
        with self.lock:
            self.free.append((slot, event))
            self.slot_ready.notify()

    def run(self) -> None:
        """One reader."""
        stream = None
        if self.cuda:
            stream = new_stream(self.device)
            stream.wait_event(self.start_event)
        try:
            while True:
                got = self.take()
                if got is None:
                    break
                slot, event, i, c = got
                if event is not None:
                    event.synchronize()  # its last copy to the device is done
                try:
                    event = self._read_chunk(slot, i, c, stream)
                except BaseException:
                    self.give_back(slot, None)
                    raise
                self._checksum(i, c, slot, event)
        except BaseException as e:
            self.fail(e)
        finally:
            if stream is not None:
                end = new_event()
                end.record(stream)
                with self.lock:
                    self.events.append(end)

    def _read_chunk(self, slot: Any, i: int, c: int, stream: Any) -> Any:
        """Reads chunk ``c`` of read ``i`` into ``slot`` and queues its copy
        to the device; returns the copy's event (None: copied already)."""
        r = self.reads[i]
        lo = c * self.chunk
        n = min(self.chunk, r.length - lo)
        view = memoryview(slot.numpy())[:n]
        got = 0
        while got < n:
            k = os.preadv(self.fd, [view[got:]], r.offset + lo + got)
            if k <= 0:
                raise self.error(r.key, "short read")
            got += k
        dst = r.sink.tensor[r.sink.offset + lo : r.sink.offset + lo + n]
        with self.lock:
            self.copies += 1
        if stream is None or dst.device.type != "cuda":
            dst.copy_(slot[:n])
            return None
        import torch

        with torch.cuda.stream(stream):
            dst.copy_(slot[:n], non_blocking=True)
        event = new_event()
        event.record(stream)
        return event

    def _checksum(self, i: int, c: int, slot: Any, event: Any) -> None:
        """Chunk ``c`` of read ``i`` is in ``slot``: checksums it, and the
        chunks after it that are already read, in order, unless it is not
        the next one or another reader is checksumming this piece (which
        then takes this chunk too)."""
        r = self.reads[i]
        with self.lock:
            self.ready[i][c] = (slot, event, min(self.chunk, r.length - c * self.chunk))
            if self.hashing[i] or self.next[i] != c:
                return
            self.hashing[i] = True
        while True:
            with self.lock:
                entry = self.ready[i].pop(self.next[i], None)
                if entry is None:
                    self.hashing[i] = False
                    return
            held, copied, n = entry
            self.hashers[i].update(memoryview(held.numpy())[:n])
            self.give_back(held, copied)
            with self.lock:
                self.next[i] += 1
                last = self.next[i] * self.chunk >= r.length
            if last:
                if self.hashers[i].intdigest() != r.xxh3:
                    raise self.error(r.key, "checksum mismatch (xxh3_64)")
                with self.lock:
                    self.verified(r)


def read_to_device(
    fd: int,
    reads: list[DeviceRead],
    staging: Staging,
    error: Callable[[Any, str], BaseException],
    verified: Callable[[DeviceRead], None] = lambda r: None,
    threads: int | None = None,
) -> None:
    """Reads ``reads`` (raw pieces of the open file ``fd``) into their device
    sinks with ``threads`` readers (:func:`load_threads` by default), through
    the pinned slots of ``staging``'s budget; each piece's checksum is
    computed on the host copy. ``verified(read)`` runs (under a lock) for
    each piece once its checksum matched. Raises ``error(key, what)`` for
    the first piece that is short or whose checksum differs. When it
    returns (or raises), every copy to the devices is done and the current
    stream of each device is ordered after them."""
    if not reads:
        return
    for r in reads:
        if r.length == 0:
            raise ValueError("a device read of 0 bytes")
    n = threads if threads is not None else load_threads()
    slots, size = staging.slots(n)
    chunks = sum(-(-r.length // size) for r in reads)
    n = max(1, min(n, len(slots), chunks))
    job = _DeviceLoad(fd, reads, slots, size, error, verified, n)
    workers = [threading.Thread(target=job.run, name=f"deeppart-load-{k}") for k in range(1, n)]
    for w in workers:
        w.start()
    try:
        job.run()
    finally:
        for w in workers:
            w.join()
        staging.copies += job.copies
        for end in job.events:
            end.synchronize()
        if job.cuda:
            import torch

            current = torch.cuda.current_stream(job.device)
            for end in job.events:
                current.wait_event(end)
    if job.failure is not None:
        raise job.failure
    missing = [r.key for i, r in enumerate(reads) if job.next[i] * size < r.length]
    if missing:
        raise error(missing[0], "not read")


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
