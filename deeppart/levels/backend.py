"""The interface every multi-level storage backend implements.

Two backends implement it: DeepPart's built-in engine
(:mod:`deeppart.levels.engine`) and the real FTI library through ctypes
(:mod:`deeppart.levels.fti`). :class:`deeppart.Checkpointer` with
``config=`` drives one of them, in this order: the backend is created
(which validates the config against the job), then any number of
:meth:`~LevelBackend.save` calls, :meth:`~LevelBackend.latest` and
:meth:`~LevelBackend.load` on a restart, and :meth:`~LevelBackend.close`.
This module also owns what they report: :class:`LevelSaveStats` and
:class:`RecoveryReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from deeppart.progress import Stats


@dataclass(frozen=True, kw_only=True)
class LevelSaveStats(Stats):
    """What one checkpoint through the levels did: a save's :class:`Stats`
    (the same on every rank: ``directory`` holds the step's metadata, the
    built-in engine's step directory under ``meta_dir`` or FTI's meta
    root with its index; ``stored_bytes``: the bytes of the ranks' own
    data files, the engine's L1 files (not the partner copies, parity or
    L4 copy) or the state's bytes handed to FTI; ``seconds``: the slowest
    rank's, ``rank_seconds`` every rank's), and the step, its level and
    this rank's seconds per phase. :meth:`deeppart.Checkpointer.save`'s
    handle gives it from ``wait()``."""

    step: int
    level: int
    #: This rank's seconds per phase, e.g. {"l1": 0.3, "l2": 0.2} or
    #: {"l3_encode": 0.1}; the built-in engine's also ``prepare`` and, with
    #: the memory tier, ``budget`` (and for an asynchronous save
    #: ``snapshot``: the stages on the caller's thread).
    phases: dict[str, float] = field(default_factory=dict)
    #: Per rank, the bytes it sent as its L2 partner copy (the file, or a
    #: smaller delta against the copy its partner held, ``l2_delta``);
    #: empty at other levels and with the FTI backend.
    rank_partner_sent: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RecoveryReport:
    """How a restore was served: the step, and per rank of the writing job
    the level its data came from (1: own node-local file, 2: partner copy,
    3: Reed-Solomon decoding, 4: global directory)."""

    step: int
    levels: list[int]
    #: Files that were lost or corrupt and rewritten: ranks' own files from
    #: another level, and the partner copies (L2) and parity shards (L3)
    #: that the lost node held, so the step is fully redundant again.
    rewritten: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: Files found on another node than the one that needs them (the nodes
    #: were reordered or partly replaced since the save), sent there and
    #: stored: the paths written. Their data counts as L1 (own file), L2
    #: (partner copy) or L3 (parity shard), as if they had been in place.
    moved: list[str] = field(default_factory=list)
    #: The newer committed steps that could not be recovered, each with why
    #: (a restore without a step that fell back to an older one).
    skipped: list[str] = field(default_factory=list)
    #: Copies read and rejected because they failed verification (a
    #: corrupt or truncated own file, partner copy or parity shard), each
    #: with its level and old rank, when another level served instead.
    rejected: list[str] = field(default_factory=list)
    #: The world size that loaded the step, when it differs from the one
    #: that saved it (``levels`` is per rank of the saving job; the state
    #: was resharded into the new layout), else None.
    world_size: int | None = None

    def summary(self) -> str:
        by: dict[int, list[int]] = {}
        for rank, level in enumerate(self.levels):
            by.setdefault(level, []).append(rank)
        parts = ", ".join(f"L{lv}: ranks {rs}" for lv, rs in sorted(by.items()))
        extra = f", {len(self.moved)} file(s) moved between nodes" if self.moved else ""
        if self.world_size is not None:
            extra += f", resharded onto {self.world_size} rank(s)"
        if self.rejected:
            extra += f"; rejected: {'; '.join(self.rejected)}"
        if self.skipped:
            extra += f"; newer step(s) skipped: {'; '.join(self.skipped)}"
        return f"recovered step {self.step} ({parts}{extra}) in {self.seconds:.2f} s"


class LevelBackend(Protocol):
    """Multi-level checkpoint storage. Every method is collective over the
    backend's communicator."""

    name: str

    def save(self, step: int, state: Any, *, level: int | None = None) -> LevelSaveStats:
        """Checkpoints ``state`` as ``step`` at ``level`` (None: the level the
        config's ``ckpt_l1..ckpt_l4`` intervals give this checkpoint). Each
        rank passes its own tree, as for :func:`deeppart.save`: values and
        tensors that differ between the ranks are kept per rank."""
        ...

    def latest(self) -> int | None:
        """The newest committed step that can still be recovered, or None."""
        ...

    def steps(self) -> list[int]:
        """The committed steps that can still be recovered, oldest first
        (the last one is :meth:`latest`)."""
        ...

    def load(self, step: int | None = None, *, into: Any = None) -> tuple[Any, RecoveryReport]:
        """Restores ``step`` (None: :meth:`latest`) on every rank, from the
        cheapest level that has it, rewriting lost files where it can; each
        rank gets back its own version of the per-rank values it saved."""
        ...

    def close(self) -> None:
        """Releases the backend (FTI_Finalize for the FTI backend)."""
        ...
