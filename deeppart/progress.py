"""A progress line for long saves and loads, and the one-line summary."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Rewrites one stderr line with the bytes done so far; silent unless
    enabled and stderr is a TTY. At most ~10 updates per second, and
    nothing for operations shorter than ``delay`` seconds."""

    def __init__(
        self,
        what: str,
        total: int,
        *,
        enabled: bool | None = None,
        stream: TextIO | None = None,
        delay: float = 1.0,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        tty = bool(isatty and isatty())
        self.enabled = tty if enabled is None else (enabled and tty)
        self.what = what
        self.total = max(1, total)
        self.done = 0
        self.t0 = time.perf_counter()
        self.delay = delay
        self._last = 0.0
        self._shown = False

    def advance(self, n: int) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.delay or now - self._last < 0.1:
            return
        self._last = now
        frac = min(1.0, self.done / self.total)
        rate = self.done / max(now - self.t0, 1e-9) / 1e9
        self.stream.write(
            f"\r[deeppart] {self.what} {frac * 100:5.1f}%  "
            f"{human_bytes(self.done)} / {human_bytes(self.total)}  {rate:.2f} GB/s (rank 0)"
        )
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


@dataclass(frozen=True)
class Stats:
    """What one save or load did, across all ranks."""

    op: str  # "save" | "load"
    directory: str
    world_size: int
    raw_bytes: int  # the state's bytes
    stored_bytes: int  # bytes in the data files
    #: Wall time of the slowest rank: the most any rank spent inside the
    #: call (a rank that called early also counts its wait for the others).
    seconds: float
    #: Every rank's time inside the call; ``seconds`` is their maximum.
    rank_seconds: list[float] = field(default_factory=list)
    codec: str = "none"
    #: Load of sharded state: per rank, the raw bytes of the stored shard
    #: pieces it read, and the bytes it received from their readers (the
    #: cooperative exchange, :mod:`deeppart.loading.reshard`); empty otherwise.
    rank_shard_read: list[int] = field(default_factory=list)
    rank_received: list[int] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.raw_bytes / max(self.seconds, 1e-9) / 1e9

    @property
    def ratio(self) -> float:
        """raw / stored bytes (1.0 without compression)."""
        return self.raw_bytes / max(self.stored_bytes, 1)

    @property
    def slowest_rank(self) -> int:
        if not self.rank_seconds:
            return 0
        return max(range(len(self.rank_seconds)), key=lambda r: self.rank_seconds[r])

    def summary(self) -> str:
        comp = ""
        if self.codec != "none":
            disk = human_bytes(self.stored_bytes)
            comp = f", {self.codec} ratio {self.ratio:.2f}x ({disk} on disk)"
        ranks = ""
        if len(self.rank_seconds) > 1:
            ranks = f" (slowest rank {self.slowest_rank}; fastest {min(self.rank_seconds):.3f} s)"
        return (
            f"[deeppart] {self.op} {human_bytes(self.raw_bytes)} on {self.world_size} rank(s) "
            f"in {self.seconds:.3f} s{ranks}, {self.gbps:.2f} GB/s{comp} -> {self.directory}"
        )


# ----------------------------------------------------------------------------
# The statistics of this process's latest save and load.

_last_stats: dict[str, Stats] = {}


def record_stats(op: str, stats: Stats) -> None:
    """Keeps ``stats`` as this process's latest ``op`` ("save" or "load")."""
    _last_stats[op] = stats


def last_stats(op: str = "save") -> Stats | None:
    """The :class:`Stats` of this process's latest ``"save"`` or ``"load"``."""
    return _last_stats.get(op)
