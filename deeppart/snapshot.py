"""An asynchronous save's snapshot: this rank's planned share of the state,
copied to host memory.

Every rank writes only its planned pieces (``plan.rank_pieces(rank)``), so
it needs to hold only those apart from the live state: 1/P of a state
replicated on P ranks, or, when the plan gives a leaf to some holders only,
this rank's part among them. :meth:`ShareSnapshot.take` copies each of
those pieces' byte ranges into one flat host buffer, sized to the share
(pinned when a piece is on a CUDA device: one asynchronous device-to-host
copy per piece, one synchronisation at the end; for CPU tensors a memcpy
with non-temporal stores, ``deeppart._planner.copy_into``, not
``Tensor.copy_``: see :meth:`ShareSnapshot.take`),
and returns a :class:`~deeppart.prepare.Prepared` whose ``staged`` pieces
point into that buffer and whose leaves no longer reference the live
tensors. Plain values are already immutable bytes (their encoding, made
when the state was flattened); the snapshot keeps only those this rank
writes.

A :class:`ShareSnapshot` reuses its buffer from one save to the next while
the share fits it (and is not much smaller); the caller must not take a new
snapshot while a save still writes from the previous one (asynchronous
saves wait for the previous one first).

Nothing here assumes that every leaf is on every rank: only the leaves of
this rank's pieces are touched.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from deeppart import staging as _staging
from deeppart._planner import copy_into
from deeppart.prepare import Prepared, StagedPiece
from deeppart.state import FlatLeaf

__all__ = ["ShareSnapshot", "share_bytes"]

#: Alignment of each piece in the buffer (cache lines; fast copies).
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _piece_sizes(prep: Prepared, rank: int) -> list[int]:
    """Bytes of each of ``rank``'s pieces that the snapshot copies (0 for a
    plain value: its encoding is kept as it is)."""
    sizes = []
    for li, start, stop in prep.plan.rank_pieces(rank):
        t = prep.leaves[li].tensor
        sizes.append(0 if t is None else (stop - start) * t.element_size())
    return sizes


def share_bytes(prep: Prepared, rank: int) -> int:
    """The tensor bytes of ``rank``'s planned pieces: what its snapshot holds."""
    return sum(_piece_sizes(prep, rank))


class ShareSnapshot:
    """Copies of one rank's planned pieces in a reusable host buffer.

    After :meth:`take`: ``staged_bytes`` is the bytes it copied (tensor
    pieces) plus the plain values it kept, ``capacity`` the host buffer's
    size in bytes.
    """

    def __init__(self) -> None:
        self._buffer: Any = None
        self.staged_bytes = 0
        self.capacity = 0

    def _host(self, nbytes: int, pin: bool) -> Any:
        """The host buffer of at least ``nbytes`` (reused when it fits and is
        at most twice as large; pinned if ``pin``)."""
        import torch

        old = self._buffer
        if (
            old is not None
            and nbytes <= old.numel() <= 2 * nbytes + (1 << 20)
            and (old.is_pinned() or not pin)
        ):
            return old
        self._buffer = None  # free the old one first
        self._buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        return self._buffer

    def take(self, prep: Prepared, rank: int) -> Prepared:
        """A copy of ``prep`` that writes ``rank``'s pieces from the snapshot
        (``staged``) and holds no reference to the live tensors."""
        import torch

        pieces = prep.plan.rank_pieces(rank)
        sizes = _piece_sizes(prep, rank)
        tensors = [prep.leaves[li].tensor for li, _, _ in pieces]
        on_device = any(t is not None and t.device.type == "cuda" for t in tensors)
        total = sum(_align(n) for n in sizes)
        buf = self._host(total, on_device and torch.cuda.is_available())
        view = buf.numpy()  # one numpy view of the buffer, sliced per piece
        flat: dict[int, Any] = {}
        pending: set[Any] = set()
        staged: list[StagedPiece] = []
        at = kept = 0
        for (li, start, stop), n in zip(pieces, sizes, strict=True):
            leaf = prep.leaves[li]
            if leaf.tensor is None:
                assert leaf.encoded is not None
                staged.append(StagedPiece(memoryview(leaf.encoded), 1, False))
                kept += len(leaf.encoded)
                continue
            isz = int(leaf.tensor.element_size())
            if li not in flat:
                flat[li] = _staging.device_bytes(leaf.tensor)
            if n:
                src = flat[li][start * isz : stop * isz]
                if src.device.type == "cpu":
                    # A streaming copy (deeppart._planner.copy_into:
                    # non-temporal stores, the GIL released), not copy_:
                    # with torch's intra-op threads (its default), copy_ of
                    # a rank's 115 pieces took ~6x as long under CPU load.
                    copy_into(view[at : at + n], src.numpy())
                else:
                    non_blocking = src.device.type == "cuda" and buf.is_pinned()
                    buf[at : at + n].copy_(src, non_blocking=non_blocking)
                    if non_blocking:
                        pending.add(src.device)
            staged.append(StagedPiece(view[at : at + n].data, isz, True))
            at += _align(n)
        for device in pending:
            torch.cuda.synchronize(device)
        self.staged_bytes = sum(sizes) + kept
        self.capacity = int(buf.numel())
        # The writer reads only ``staged``; the leaves keep their paths.
        leaves = [FlatLeaf(leaf.path, None, None) for leaf in prep.leaves]
        return dataclasses.replace(prep, leaves=leaves, staged=staged)
