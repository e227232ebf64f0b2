"""The replica proof of the large shared tensors, off the critical path
(issue 49: "nothing measurable in the async stall", "no more than 10 % of
a synchronous save").

A synchronous save digests them on a thread while it writes
(:class:`ProofBesideWrite`) and compares the digests before its commit;
copies that differ make it abandon what it wrote and save again as the
union of the ranks' own copies. The rest of this docstring is about
asynchronous saves.

A save proves that the ranks holding one tensor hold the same bytes
(:func:`deeppart.saving.prepare.digest_held`: whole-tensor digests,
compared before anything is committed). A synchronous save digests in its
call. An asynchronous save digests the small shared tensors in its stall
(their bytes are few: biases, norms, buffers, RNG states) and the large
ones (at least :data:`DEFER_FROM` bytes) on its writer thread, before it
writes, while the training loop goes on. The tensors must not change until
their digests are taken, so:

- every ``torch.optim.Optimizer.step`` in the process waits (a global step
  pre-hook) until the proofs in flight are done: the loop's forward and
  backward run beside the proof, and the next step waits only if the proof
  is still running (the seconds it waited are kept in
  :attr:`PendingProof.held_seconds`);
- each tensor's version counter (``t._version``, which every in-place
  operation bumps) is read in the stall and after its digest: a tensor
  changed in between (an in-place update outside an optimizer step) fails
  the save on every rank with :class:`StateMismatchError`; nothing is
  committed. (An update through ``tensor.data`` bumps no counter and is not
  seen: the proof then reads the updated bytes.)

Ranks whose large shared tensors differ do not fail: the save is prepared
again on the writer thread (:func:`deeppart.saving.prepare.replan`: the
exchange and union a synchronous save takes when copies differ), and this
rank's share of that plan snapshotted, before optimizer steps are let go:
each rank's copy is stored as its own, as by a synchronous save. Every
tensor of the save is checked unchanged since the stall (its version
counter) when that second snapshot is taken.

A save that reuses a cached union (:mod:`deeppart.saving.union_cache`)
defers the same tensors: its proof compares no digests by replica class
but sums the union cache's check values of them (:attr:`PendingProof.check`),
and every rank joins that agreement, those without such tensors too.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.errors import StateMismatchError
from deeppart.saving import digests as tree_digests
from deeppart.saving.union_cache import checks_hold

__all__ = [
    "DEFER_FROM",
    "PendingProof",
    "ProofBesideWrite",
    "check_unchanged",
    "hold",
    "pending",
    "prove",
    "release",
]

#: Shared tensors of at least this many bytes are proved on the writer
#: thread of an asynchronous save; smaller ones in its stall.
DEFER_FROM = 1 << 20


@dataclass
class PendingProof:
    """The large shared tensors of one asynchronous save whose digests are
    still to be taken: by local leaf index, the tensor and its version at
    the snapshot."""

    tensors: dict[int, Any]
    versions: dict[int, int]
    #: Every tensor of the save (by local leaf) and its version at the
    #: snapshot: checked again should the save be prepared anew.
    watched: dict[int, tuple[Any, int]]
    #: Per local leaf: its path (for errors).
    paths: dict[int, Sequence[Any]]
    #: This rank's replica class (the holder groups it is in): ranks of one
    #: class hold the same shared tensors.
    classes: list[tuple[int, ...]]
    #: A save reusing a cached union: this rank's check value of its
    #: digests (:func:`deeppart.saving.union_cache.check_of`), summed over
    #: the ranks instead of comparing digests by class.
    check: Callable[[dict[int, bytes]], bytes] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    #: Seconds optimizer steps waited for this proof.
    held_seconds: float = 0.0
    #: Seconds the digests took (on the writer thread).
    seconds: float = 0.0
    nbytes: int = 0


_PENDING: set[int] = set()
_PROOFS: dict[int, PendingProof] = {}
_LOCK = threading.Lock()
_HOOKED = False


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """The global optimizer step pre-hook: waits for the proofs in flight."""
    with _LOCK:
        proofs = list(_PROOFS.values())
    for p in proofs:
        if not p.done.is_set():
            t0 = time.perf_counter()
            p.done.wait()
            p.held_seconds += time.perf_counter() - t0


def _hook() -> None:
    global _HOOKED
    with _LOCK:
        if _HOOKED:
            return
        _HOOKED = True
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_step)


def pending(
    tensors: dict[int, Any],
    every: dict[int, Any],
    paths: dict[int, Sequence[Any]],
    classes: list[tuple[int, ...]],
    check: Callable[[dict[int, bytes]], bytes] | None = None,
) -> PendingProof:
    """A proof of ``tensors`` (``every``: all the save's tensors, by local
    leaf), their versions read now; nothing waits for it (:func:`hold`).
    ``check``: see :attr:`PendingProof.check`."""
    versions = {i: int(t._version) for i, t in tensors.items()}
    watched = {i: (t, int(t._version)) for i, t in every.items()}
    return PendingProof(dict(tensors), versions, watched, dict(paths), classes, check)


def hold(p: PendingProof) -> PendingProof:
    """Registers ``p`` (in the stall): optimizer steps wait for it from now
    on, until :func:`release` ends it."""
    _hook()
    with _LOCK:
        _PROOFS[id(p)] = p
    return p


def release(p: PendingProof) -> None:
    """Ends ``p``: optimizer steps no longer wait for it."""
    p.done.set()
    with _LOCK:
        _PROOFS.pop(id(p), None)


def prove(c: Comm, p: PendingProof, threads: int = 1) -> dict[int, bytes] | None:
    """Digests ``p``'s tensors and compares them across the ranks of one
    replica class (collective over ``c``, the writer's communicator): None
    when every class agrees, else this rank's digests (by local leaf), for
    :func:`deeppart.saving.prepare.replan`; every rank raises alike if any
    rank's tensors changed since the snapshot. The caller releases ``p``."""
    err: BaseException | None = None
    digests: dict[int, bytes] = {}
    try:
        digests = _digest(p, threads)
    except BaseException as e:
        err = e
    return _compare(c, p, digests, err)


class ProofBesideWrite:
    """The proof of a synchronous save, digested on a thread while the save
    writes (digesting reads memory, writing waits on storage), compared
    before the commit (:meth:`result`). The caller's thread is in the save,
    so the tensors stay as they are; their version counters are checked."""

    def __init__(self, p: PendingProof, threads: int) -> None:
        self.proof = p
        self._threads = threads
        self._digests: dict[int, bytes] = {}
        self._err: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="deeppart-proof", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._digests = _digest(self.proof, self._threads)
        except BaseException as e:
            self._err = e

    def join(self) -> None:
        """Waits for the digests (after a failed write too)."""
        self._thread.join()

    def result(self, c: Comm) -> dict[int, bytes] | None:
        """As :func:`prove`'s (collective over ``c``), once the digests are
        taken: None when the copies agree, else this rank's digests."""
        self.join()
        return _compare(c, self.proof, self._digests, self._err)


def _digest(p: PendingProof, threads: int) -> dict[int, bytes]:
    """``p``'s digests by local leaf (its seconds and bytes kept in ``p``);
    raises StateMismatchError if a tensor changed since its version was read."""
    t0 = time.perf_counter()
    order = sorted(p.tensors)
    done = tree_digests.digest_all([p.tensors[i] for i in order], threads)
    p.seconds = time.perf_counter() - t0
    p.nbytes = sum(t.numel() * t.element_size() for t in p.tensors.values())
    check_unchanged(p, {i: (p.tensors[i], p.versions[i]) for i in order})
    return dict(zip(order, done, strict=True))


def _compare(
    c: Comm, p: PendingProof, digests: dict[int, bytes], err: BaseException | None
) -> dict[int, bytes] | None:
    """The proof's agreement: ``err`` raised on every rank if any rank has
    one; None when the ranks of each replica class sent the same digests
    (with :attr:`PendingProof.check`: when the check values sum to zero)."""
    if p.check is not None:
        value = b"\0" * 16
        if err is None:
            try:
                value = p.check(digests)
            except BaseException as e:
                err = e
        return None if checks_hold(agree(c, err, value, width=len(value))) else digests
    h = hashlib.blake2b(digest_size=16)
    for i in sorted(digests):
        h.update(i.to_bytes(8, "little") + digests[i])
    rows = agree(c, err, h.digest(), width=16)
    first: dict[tuple[int, ...], bytes] = {}
    if all(first.setdefault(k, r) == r for k, r in zip(p.classes, rows, strict=True)):
        return None
    return digests


def check_unchanged(p: PendingProof, tensors: dict[int, tuple[Any, int]] | None = None) -> None:
    """Raises StateMismatchError if any of ``tensors`` (by default every
    tensor of the save) changed in place since the stall."""
    seen = p.watched if tensors is None else tensors
    changed = [i for i, (t, v) in seen.items() if int(t._version) != v]
    if changed:
        names = ", ".join(_path_text(p.paths.get(i, (f"<leaf {i}>",))) for i in changed[:5])
        raise StateMismatchError(
            f"{len(changed)} tensor(s) changed in place while the save proved its "
            f"replicas, outside an optimizer step ({names}); nothing was committed. "
            "Change the state once the save returned (an asynchronous one: after wait())"
        )


def _path_text(path: Sequence[Any]) -> str:
    return "/".join(str(k) for k in path) or "<root>"
