"""Read-ahead of one object's byte ranges, for readers that know what
they will read.

A load reads the pieces of a data file one after another, many of them
small; through an object store each read would be one request, and the
time would go to request latency, not to the link. When a reader declares
the ranges it is about to read (:meth:`ObjectStore.open`'s ``expect``),
:class:`ReadAhead` coalesces them into spans (ranges that touch, or lie
within :data:`MERGE_GAP_BYTES` of each other), cuts the spans into chunks
of ``chunk_bytes``, and fetches the chunks in the background,
``threads`` at a time, in file order (the store's ranged reads release the
GIL). At most ``ahead`` chunks are held at once, fetched or in flight but
not yet consumed (:attr:`ReadAhead.outstanding`), so memory stays below
``ahead x chunk_bytes`` whatever the object's size. A read is served from
the chunks; a chunk is dropped once reads have passed its end, which
starts the next fetch.

Reads are expected in ascending order; any other read is still answered
(the reader falls back to a direct ranged read of what the chunks do not
hold), only without the read-ahead's help. A fetch's error (a missing
object, a server that stopped answering) is raised by the read that needs
that chunk, as the direct read would have raised it; an object that ends
inside a declared range raises :class:`CorruptCheckpointError` naming it.
The read-ahead moves bytes only: the load verifies every piece's checksum
in the memory the bytes were copied into, as for any read.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from deeppart.errors import CorruptCheckpointError

__all__ = ["MERGE_GAP_BYTES", "ReadAhead", "spans"]

#: Declared ranges this close to each other are fetched together, the gap
#: with them (a request costs about as much as this many bytes of link).
MERGE_GAP_BYTES = 256 << 10


def spans(ranges: Iterable[tuple[int, int]], gap: int = MERGE_GAP_BYTES) -> list[tuple[int, int]]:
    """``(offset, length)`` ranges as sorted, disjoint ``(start, end)``
    spans: overlapping ranges, and ranges at most ``gap`` bytes apart,
    merged. Empty ranges are left out."""
    out: list[tuple[int, int]] = []
    for off, length in sorted((o, n) for o, n in ranges if n > 0):
        if off < 0:
            raise ValueError(f"range at {off}: negative offset")
        if out and off <= out[-1][1] + gap:
            out[-1] = (out[-1][0], max(out[-1][1], off + length))
        else:
            out.append((off, off + length))
    return out


@dataclass
class _Chunk:
    start: int
    end: int
    fetch: Future[Any]


class ReadAhead:
    """The background fetches of one object's declared ranges (see the
    module's docstring). ``fetch(offset, length)`` returns a buffer of the
    object's bytes from ``offset``: ``length`` of them, fewer only where
    the object ends. ``name`` is how the object is named in errors."""

    def __init__(
        self,
        fetch: Callable[[int, int], Any],
        ranges: Iterable[tuple[int, int]],
        name: str,
        *,
        chunk_bytes: int,
        ahead: int,
        threads: int,
    ) -> None:
        if chunk_bytes < 1 or ahead < 1 or threads < 1:
            raise ValueError(f"read-ahead: chunk {chunk_bytes}, ahead {ahead}, threads {threads}")
        self.fetch = fetch
        self.name = name
        self.ahead = ahead
        #: The chunks to fetch, in order: (start, end).
        self.plan = [
            (s, min(s + chunk_bytes, end))
            for start, end in spans(ranges)
            for s in range(start, end, chunk_bytes)
        ]
        self.next = 0  # the first chunk of ``plan`` not fetched yet
        self.window: collections.deque[_Chunk] = collections.deque()
        #: Dropped before their fetch finished: still holding a thread and,
        #: soon, a chunk's memory.
        self.draining: list[Future[Any]] = []
        self.pool = ThreadPoolExecutor(min(threads, ahead), thread_name_prefix="deeppart-read")
        #: The most chunks ever outstanding (the tests' view of the bound).
        self.peak = 0
        self.fetched = 0
        self._fill()

    @property
    def outstanding(self) -> int:
        """Chunks fetched or in flight and not yet released: at most
        ``ahead``."""
        self.draining = [f for f in self.draining if not f.done()]
        return len(self.window) + len(self.draining)

    def _fill(self) -> None:
        while self.next < len(self.plan) and self.outstanding < self.ahead:
            start, end = self.plan[self.next]
            self.next += 1
            self.window.append(_Chunk(start, end, self.pool.submit(self.fetch, start, end - start)))
            self.fetched += 1
            self.peak = max(self.peak, self.outstanding)

    def _drop(self) -> None:
        chunk = self.window.popleft()
        if not chunk.fetch.cancel() and not chunk.fetch.done():
            self.draining.append(chunk.fetch)

    def readinto(self, pos: int, view: memoryview) -> int:
        """Copies the object's bytes from ``pos`` into ``view`` as far as the
        fetched chunks run without a gap; returns how many (0 where ``pos``
        is not in the next chunk: the caller reads those bytes directly)."""
        while self.window and self.window[0].end <= pos:
            self._drop()
        if not self.window:
            while self.next < len(self.plan) and self.plan[self.next][1] <= pos:
                self.next += 1
        self._fill()
        done = 0
        while done < len(view) and self.window:
            chunk = self.window[0]
            at = pos + done
            if not chunk.start <= at < chunk.end:
                break
            data = memoryview(chunk.fetch.result()).cast("B")
            have = chunk.start + len(data)
            if at >= have:
                raise CorruptCheckpointError(
                    f"{self.name}: truncated: the object ends at byte {have}, "
                    f"a read wants bytes up to {min(pos + len(view), chunk.end)}"
                )
            n = min(len(view) - done, have - at)
            view[done : done + n] = data[at - chunk.start : at - chunk.start + n]
            done += n
            if at + n >= chunk.end:
                self._drop()
                self._fill()
            elif at + n >= have:
                continue  # a short chunk: the check above raises
        return done

    def close(self) -> None:
        """Stops fetching: chunks not started are cancelled, those in flight
        finish in the background and are dropped."""
        self.window.clear()
        self.next = len(self.plan)
        self.pool.shutdown(wait=False, cancel_futures=True)
