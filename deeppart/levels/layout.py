"""Where the built-in level engine's files are: which node and group each
rank belongs to, and the names of step directories, data files, partner
copies and parity shards.

Every other part of :mod:`deeppart.levels.engine` asks this module where
things are; it does no I/O beyond listing directories. For one step::

    ckpt_dir/<node>/<exec_id>/step-NNNNNNNN/    node-local (L1, L2, L3); <node>:
                                                its host name (node<k> with local_test)
        rank-RRRRR.bin      a rank's own data file (L1)
        partner-RRRRR.bin   the copy of its predecessor's file (L2)
        parity-RRRRR.bin    a rank's Reed-Solomon parity shard (L3)
    meta_dir/<exec_id>/step-NNNNNNNN/           metadata.json and COMMITTED
    glbl_dir/<exec_id>/step-NNNNNNNN/           a normal checkpoint (L4)

``glbl_dir`` may be an object store URL (``s3://bucket/prefix``): then each
step's L4 copy is a checkpoint at ``s3://bucket/prefix/<exec_id>/step-NNNNNNNN``
as :func:`deeppart.save` writes one there (:mod:`deeppart.storage.objects`),
and its steps are listed through :class:`deeppart.steps.object_steps.ObjectSteps`
(:meth:`Layout.global_objects`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deeppart.format import STEP_PREFIX, data_file_name, is_committed, step_dir_name, step_number
from deeppart.levels.config import LevelConfig
from deeppart.steps import lineage
from deeppart.steps.object_steps import ObjectSteps
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import Location

#: The step directories' prefix: ``step-`` and eight digits.
#: The step directories' prefix (format.STEP_PREFIX: one spelling for all).
PREFIX = STEP_PREFIX


def step_name(step: int) -> str:
    """The directory name of ``step`` (in every root): format.step_dir_name."""
    return step_dir_name(step)


def partner_file(source: int) -> str:
    """The L2 copy of rank ``source``'s file, held by its partner."""
    return f"partner-{source:05d}.bin"


def parity_file(holder: int) -> str:
    """The L3 parity shard held by rank ``holder``."""
    return f"parity-{holder:05d}.bin"


def rank_files(step_dir: Path) -> Callable[[int], Path]:
    """The node-local data file of a rank in ``step_dir`` (for tools)."""
    return lambda r: step_dir / data_file_name(r)


def steps_in(root: Path, committed: bool) -> list[int]:
    """The steps with a directory in ``root`` named as DeepPart names them
    (``step-NNNNNNNN``; only committed ones when ``committed``), oldest
    first."""
    out: list[int] = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        n = step_number(child.name, PREFIX)
        if n is not None and child.name == step_name(n) and (not committed or is_committed(child)):
            out.append(n)
    return sorted(out)


@dataclass
class Layout:
    """Where this job's ranks sit: node of every rank, and groups; and the
    step directories of the config's roots."""

    config: LevelConfig
    size: int
    hosts: list[str] | None
    #: The L4 steps in an object store (made on first use, kept for the
    #: records it has read).
    _objects: ObjectSteps | None = field(default=None, init=False, repr=False, compare=False)

    def node(self, rank: int) -> int:
        return self.config.node_of(rank, self.hosts)

    def group(self, rank: int) -> list[int]:
        return self.config.group_members(rank, self.hosts)

    def partner(self, rank: int) -> int:
        """The rank that holds ``rank``'s L2 copy (same position, next node
        of its group)."""
        return self.config.partner_of(rank, self.hosts)

    def pred(self, rank: int) -> int:
        """The rank whose L2 copy ``rank`` holds."""
        g = self.group(rank)
        return g[(g.index(rank) - 1) % len(g)]

    def local_root(self, rank: int) -> Path:
        """The node-local directory of ``rank``'s node (named by its host
        on real nodes, ``node<k>`` with fake ones)."""
        return self.config.local_dir(rank, self.hosts)

    def node_dirs(self) -> list[str]:
        """Per node, the name of its directory under ``ckpt_dir``."""
        first: dict[int, int] = {}
        for r in range(self.size):
            first.setdefault(self.node(r), r)
        return [self.config.node_dir_name(first[k], self.hosts) for k in sorted(first)]

    def describe(self) -> dict[str, Any]:
        """The layout as written into a step's metadata (and compared on
        restore: only L4 survives another layout)."""
        return {
            "node_size": self.config.node_size,
            "group_size": self.config.group_size,
            "nodes": [self.node(r) for r in range(self.size)],
        }

    def local_step(self, step: int, rank: int) -> Path:
        """``step``'s directory on the node of ``rank``."""
        return self.local_root(rank) / step_name(step)

    def meta_step(self, step: int) -> Path:
        """``step``'s metadata directory (shared by all ranks)."""
        return self.config.meta_root() / step_name(step)

    def global_step(self, step: int) -> Location:
        """``step``'s L4 checkpoint in ``glbl_dir``: a directory, or an
        :class:`~deeppart.storage.url.S3URL`."""
        return self.config.global_root() / step_name(step)

    def has_global(self) -> bool:
        """Whether the config has a ``glbl_dir`` (L4)."""
        return bool(self.config.glbl_dir.strip())

    def global_objects(self) -> ObjectSteps | None:
        """The L4 steps when ``glbl_dir`` is an object store URL (None for
        a directory, or without ``glbl_dir``)."""
        if not self.has_global():
            return None
        if self._objects is None:
            store = checkpoint_source(self.config.global_root()).object_store()
            if store is None:
                return None
            self._objects = ObjectSteps(store)
        return self._objects

    def global_dir(self, step: int) -> Path | None:
        """``step``'s L4 copy when ``glbl_dir`` is a directory (None without
        ``glbl_dir``, or when it is an object store URL)."""
        if not self.has_global():
            return None
        return checkpoint_source(self.global_step(step)).local_dir()

    def _global_root_dir(self) -> Path:
        """``glbl_dir`` as a directory (the caller knows it is not a URL)."""
        root = checkpoint_source(self.config.global_root()).local_dir()
        assert root is not None
        return root

    def committed_steps(self) -> list[int]:
        """Committed steps (node-local or global), oldest first."""
        steps = set(steps_in(self.config.meta_root(), True))
        objects = self.global_objects()
        if objects is not None:
            steps |= set(objects.lines()[2])
        elif self.has_global():
            steps |= set(steps_in(self._global_root_dir(), True))
        return sorted(steps)

    def lines(self) -> lineage.Lines:
        """The committed steps' line records (:mod:`deeppart.steps.lineage`):
        ``meta_dir``'s, then ``glbl_dir``'s for steps it alone holds."""
        objects = self.global_objects()
        if objects is None:
            roots = [self.config.meta_root()]
            if self.has_global():
                roots.append(self._global_root_dir())
            return lineage.scan(*roots)
        lines = lineage.scan(self.config.meta_root())
        stored = objects.lines()[0]
        for n, node in stored.nodes.items():
            if n not in lines.nodes and n not in lines.legacy:
                lines.nodes[n] = node
        for n, legacy in stored.legacy.items():
            if n not in lines.nodes and n not in lines.legacy:
                lines.legacy[n] = legacy
        return lines
