"""An asynchronous save's snapshot: this rank's planned share of the state,
copied to host memory.

Every rank writes only its planned pieces (``plan.rank_pieces(rank)``), so
it needs to hold only those apart from the live state: 1/P of a state
replicated on P ranks, or, when the plan gives a leaf to some holders only,
this rank's part among them. :meth:`ShareSnapshot.take` copies each of
those pieces' byte ranges into one flat host buffer, sized to the share
(pinned when a piece is on a CUDA device: one asynchronous device-to-host
copy per piece, on a side stream, below; for CPU tensors a memcpy
with non-temporal stores, ``deeppart._planner.copy_into``, not
``Tensor.copy_``: see :meth:`ShareSnapshot.take`),
and returns a :class:`~deeppart.saving.prepare.Prepared` whose ``staged`` pieces
point into that buffer and whose leaves no longer reference the live
tensors. Plain values are already immutable bytes (their encoding, made
when the state was flattened); the snapshot keeps only those this rank
writes.

A :class:`ShareSnapshot` reuses its buffer from one save to the next while
the share fits it (and is not much smaller); the caller must not take a new
snapshot while a save still writes from the previous one (asynchronous
saves wait for the previous one first).

Pieces on a CUDA device are copied on DeepPart's side stream
(:class:`deeppart.state.staging.DeviceToHost`), after everything the training
stream had queued, into the pinned buffer, and :meth:`ShareSnapshot.take`
queues them once the save's agreement is past (:meth:`ShareSnapshot.issue`)
and returns: the host does not wait for them. The current stream of each
device is made to wait for them on the device before its next work (an
event), so whatever the training loop queues
after the call (an optimizer step, a graph replay, an in-place change)
runs after the copies have read the state. The training stream thus
pauses on the device for the copies' time (device-to-host bandwidth), not
the host. With ``on_device=True`` the pieces are first copied within the
device memory, on the training stream itself (a device-to-device copy,
many times faster), and the copies to the host then read those copies
while training goes on; it needs free device memory of the share's size
until the host copies are done (docs/GPU.md). The writer waits for the
copies (``prep.staged_ready``) before it reads the buffer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from deeppart._planner import copy_into
from deeppart.saving.prepare import Prepared, StagedPiece
from deeppart.saving.union_cache import OverlaidLeaves
from deeppart.state import staging as _staging
from deeppart.state.state import FlatLeaf

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
        #: The last snapshot's copies from CUDA devices, once issued (None: none).
        self.copies: _staging.CopiesIssued | None = None
        #: Its copies from CUDA devices not issued yet: (host slice, source).
        self._pending: list[tuple[Any, Any]] = []
        self._on_device = False
        self._issue_error: BaseException | None = None

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

    def take(self, prep: Prepared, rank: int, on_device: bool = False) -> Prepared:
        """A copy of ``prep`` that writes ``rank``'s pieces from the snapshot
        (``staged``) and holds no reference to the live tensors, once
        :meth:`issue` has queued the copies of the pieces on CUDA devices
        (the returned ``prep.staged_ready`` waits for them).
        ``on_device``: copy those pieces within the device first, now."""
        import torch

        self.copies, self._pending, self._issue_error = None, [], None
        self._on_device = on_device
        pieces = prep.plan.rank_pieces(rank)
        sizes = _piece_sizes(prep, rank)
        tensors = [prep.leaves[li].tensor for li, _, _ in pieces]
        cuda = any(t is not None and t.device.type == "cuda" for t in tensors)
        total = sum(_align(n) for n in sizes)
        buf = self._host(total, cuda and torch.cuda.is_available())
        view = buf.numpy()  # one numpy view of the buffer, sliced per piece
        # Every source first: a contiguous copy of a strided device tensor
        # (device_bytes) or a copy within the device is queued on the
        # training stream, which the side stream then waits for.
        flat: dict[int, Any] = {}
        sources: list[Any] = []
        for (li, start, stop), n in zip(pieces, sizes, strict=True):
            t = prep.leaves[li].tensor
            if t is None or not n:
                sources.append(None)
                continue
            if li not in flat:
                flat[li] = _staging.device_bytes(t)
            isz = int(t.element_size())
            src = flat[li][start * isz : stop * isz]
            if on_device and src.device.type == "cuda":
                src = src.clone()
            sources.append(src)
        streamed = cuda and bool(buf.is_pinned())
        staged: list[StagedPiece] = []
        at = kept = 0
        for (li, _, _), n, src in zip(pieces, sizes, sources, strict=True):
            leaf = prep.leaves[li]
            if leaf.tensor is None:
                assert leaf.encoded is not None
                staged.append(StagedPiece(memoryview(leaf.encoded), 1, False))
                kept += len(leaf.encoded)
                continue
            isz = int(leaf.tensor.element_size())
            if src is not None:
                if src.device.type == "cpu":
                    # A streaming copy (deeppart._planner.copy_into:
                    # non-temporal stores, the GIL released), not copy_:
                    # with torch's intra-op threads (its default), copy_ of
                    # a rank's 115 pieces took ~6x as long under CPU load.
                    copy_into(view[at : at + n], src.numpy())
                elif streamed and src.device.type == "cuda":
                    self._pending.append((buf[at : at + n], src))
                else:
                    buf[at : at + n].copy_(src)
            staged.append(StagedPiece(view[at : at + n].data, isz, True))
            at += _align(n)
        del sources, flat
        self.staged_bytes = sum(sizes) + kept
        self.capacity = int(buf.numel())
        # The writer reads only ``staged``; the leaves keep their paths
        # (those that hold nothing, most of a union's, shared as they are).
        leaves: Sequence[FlatLeaf]
        if isinstance(prep.leaves, OverlaidLeaves):
            leaves = prep.leaves.holding_nothing()  # a reused union's: its template
        else:
            leaves = [
                lf if lf.tensor is None and lf.encoded is None else FlatLeaf(lf.path, None, None)
                for lf in prep.leaves
            ]
        ready = self._copied if self._pending else None
        return dataclasses.replace(prep, leaves=leaves, staged=staged, staged_ready=ready)

    def issue(self) -> None:
        """Queues the copies of the last snapshot's pieces on CUDA devices
        (:class:`deeppart.state.staging.DeviceToHost`, on DeepPart's side
        stream), then makes the training stream's next work wait for them on
        the device, unless they read copies made within the device: nothing
        the loop queues from then on can change what they read. Called once
        the save's agreement is past: its collectives may copy to the host
        on the current stream, and such a copy queued behind the snapshot's
        would wait for all of it. A failure is kept for the writer to raise
        (:meth:`_copied`), so that every rank learns of it."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        try:
            streamed = _staging.DeviceToHost()
            for dst, src in pending:
                streamed.copy(dst, src)
            self.copies = streamed.issued()
            if not self._on_device:
                self.copies.order_after()
        except BaseException as e:
            self._issue_error = e

    def discard(self) -> None:
        """Forgets the copies not issued yet (the save went another way)."""
        self._pending = []

    def _copied(self) -> None:
        """The writer's wait for the copies (``prep.staged_ready``)."""
        if self._issue_error is not None:
            raise self._issue_error
        if self.copies is None:
            raise RuntimeError("the snapshot's copies from the device were never issued")
        self.copies.wait()
