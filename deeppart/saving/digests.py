"""Digests of a tensor's bytes, the replica proof's (issue 49: replicas are
proved, not sampled): :func:`tensor_digest` (xxh3_128, of 16 MiB leaves for
a large tensor, digested on threads), the same value streamed through two
pinned host buffers for a tensor on a device (:func:`streamed_digest`), and
:func:`digest_all` of many tensors at once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deeppart.state.tensors import readable, resolved, torch_module, u8_view

__all__ = [
    "DEVICE_DIGEST_CHUNK",
    "DIGEST_LEAF",
    "digest_all",
    "streamed_digest",
    "tensor_digest",
    "tree_digest",
]


#: The bytes of a device tensor (CUDA) copied to the host at a time for its
#: digest (:func:`tensor_digest`): two pinned buffers of this size, reused.
DEVICE_DIGEST_CHUNK = 64 << 20
#: A tensor's bytes are digested in leaves of this size, which threads
#: digest at once (:func:`tensor_digest`).
DIGEST_LEAF = 16 << 20


class _TreeDigest:
    """A tensor's digest, fed its row-major bytes in order in pieces of any
    size: the xxh3_128 of its bytes when they fit one leaf
    (:data:`DIGEST_LEAF`); else the xxh3_128 of a tag, the byte count and
    the leaves' xxh3_128 digests in order. Any differing byte changes it."""

    def __init__(self) -> None:
        import xxhash

        self._new = xxhash.xxh3_128
        self._leaf = self._new()
        self._filled = 0
        self.total = 0
        self.leaves: list[bytes] = []

    def update(self, data: memoryview) -> None:
        at = 0
        while at < len(data):
            take = min(DIGEST_LEAF - self._filled, len(data) - at)
            self._leaf.update(data[at : at + take])
            self._filled += take
            at += take
            if self._filled == DIGEST_LEAF:
                self.leaves.append(self._leaf.digest())
                self._leaf, self._filled = self._new(), 0
        self.total += len(data)

    def digest(self) -> bytes:
        leaves = self.leaves + ([self._leaf.digest()] if self._filled or not self.leaves else [])
        return tree_digest(leaves, self.total)


def tree_digest(leaves: Sequence[bytes], total: int) -> bytes:
    """The digest of ``total`` bytes whose leaves (of :data:`DIGEST_LEAF`
    bytes, the last one shorter) have the xxh3_128 digests ``leaves``."""
    import xxhash

    if len(leaves) == 1:
        return bytes(leaves[0])
    return bytes(
        xxhash.xxh3_128_digest(b"deeppart-tree" + total.to_bytes(8, "little") + b"".join(leaves))
    )


def tensor_digest(t: Any, pool: Any = None) -> bytes:
    """The 16-byte digest of a tensor's bytes in row-major order (whatever
    its memory layout or device): copies that hold the same values, bit for
    bit, digest alike; any differing byte differs (:class:`_TreeDigest`:
    xxh3_128, of the leaves of a large tensor). On the CPU the leaves are
    digested on ``pool``'s threads when given (xxhash releases the GIL). A
    tensor on a device is streamed through the host
    (:func:`streamed_digest`), never copied there whole: the same digest,
    with two chunks of host memory."""
    import xxhash

    if t.device.type != "cpu":
        return streamed_digest(t, DEVICE_DIGEST_CHUNK)
    data = u8_view(readable(t)).data
    n = len(data)
    if n <= DIGEST_LEAF:
        return bytes(xxhash.xxh3_128_digest(data))
    starts = range(0, n, DIGEST_LEAF)

    def leaf(start: int) -> bytes:
        return bytes(xxhash.xxh3_128_digest(data[start : start + DIGEST_LEAF]))

    leaves = list(pool.map(leaf, starts)) if pool is not None else [leaf(a) for a in starts]
    return tree_digest(leaves, n)


def streamed_digest(t: Any, chunk_bytes: int) -> bytes:
    """:func:`tensor_digest` of ``t`` (on any device) computed
    ``chunk_bytes`` at a time: its layout resolved where it lies, each chunk
    copied into one of two host buffers (pinned, and copied without
    blocking, for CUDA) while the previous chunk is hashed. The digest does
    not depend on the chunks, so ranks holding one tensor on different
    devices still agree."""
    torch = torch_module()
    flat = resolved(t).reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    n = flat.numel()
    h = _TreeDigest()
    cuda = flat.device.type == "cuda"
    size = max(1, min(chunk_bytes, n))
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    pending: tuple[Any, Any] | None = None  # the chunk copied last, and its event
    for k, start in enumerate(range(0, n, chunk_bytes)):
        part = buffers[k % 2][: min(chunk_bytes, n - start)]
        part.copy_(flat[start : start + part.numel()], non_blocking=cuda)
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record()
        if pending is not None:
            _hash_arrived(h, *pending)
        pending = (part, event)
    if pending is not None:
        _hash_arrived(h, *pending)
    return h.digest()


def _hash_arrived(h: _TreeDigest, part: Any, event: Any) -> None:
    """Adds ``part`` (a host chunk) to ``h`` once its copy (``event``) is done."""
    if event is not None:
        event.synchronize()
    h.update(part.numpy().data)


def digest_threads(world: int) -> int:
    """Threads one rank digests with: its share of this machine's CPUs
    when ``world`` ranks digest at once."""
    import os

    return max(1, (os.cpu_count() or 1) // world)


def digest_all(tensors: Sequence[Any], threads: int) -> list[bytes]:
    """:func:`tensor_digest` of each of ``tensors``, the leaves of large ones
    on up to ``threads`` threads."""
    if threads <= 1:
        return [tensor_digest(t) for t in tensors]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=threads) as pool:
        # Small tensors one per task; a large one's leaves spread over the pool.
        small = [i for i, t in enumerate(tensors) if t.numel() * t.element_size() <= DIGEST_LEAF]
        out: list[bytes] = [b""] * len(tensors)
        for i, digest in zip(
            small, pool.map(lambda i: tensor_digest(tensors[i]), small), strict=True
        ):
            out[i] = digest
        for i, t in enumerate(tensors):
            if not out[i]:
                out[i] = tensor_digest(t, pool)
        return out
