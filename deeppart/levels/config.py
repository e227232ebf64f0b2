"""Multi-level checkpoint configuration, with FTI's key names (docs/LEVELS.md).

A :class:`LevelConfig` is parsed from an FTI-style INI file::

    [basic]
    ckpt_dir   = /local/scratch/ckpt    ; node-local root (L1, L2, L3 files)
    glbl_dir   = /pfs/run/global        ; shared: L4 checkpoints (or s3://bucket/prefix)
    meta_dir   = /pfs/run/meta          ; shared: metadata and commit markers
    node_size  = 4                      ; ranks per node
    group_size = 4                      ; nodes per L2/L3 group
    ckpt_l1    = 1                      ; every checkpoint at least L1
    ckpt_l2    = 2                      ; every 2nd checkpoint L2
    ckpt_l3    = 4
    ckpt_l4    = 8
    keep_last_ckpt = 0
    head       = 0
    verbosity  = 2

    [advanced]
    local_test = 1                      ; fake nodes: node = rank // node_size

Checkpoint number ``c`` (1-based count of saves) is taken at the highest
level ``L`` with ``ckpt_lL > 0`` and ``c % ckpt_lL == 0``, else at L1.

:meth:`LevelConfig.validate` checks the config against the job's world
size (and hosts) before anything touches the disk, raising
:class:`LevelConfigError`: both backends call it first, when they are
created; :meth:`LevelConfig.level_for` then picks each save's level, and
the node/group/partner methods and roots give
:mod:`deeppart.levels.layout` where every rank's files are.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from deeppart.errors import LevelConfigError, UnsupportedURLError
from deeppart.storage.source import checkpoint_source
from deeppart.storage.url import Location, is_url, parse_location

#: Levels: 1 node-local, 2 partner copy, 3 Reed-Solomon, 4 global.
LEVELS = (1, 2, 3, 4)

#: Largest and smallest group for L2/L3 (FTI's limits).
MIN_GROUP, MAX_GROUP = 2, 32


# Keys DeepPart uses, by section. FTI keys DeepPart accepts but does not use
# (they matter only to the real FTI backend) are in _FTI_ONLY.
_INT_KEYS = {
    "node_size",
    "group_size",
    "ckpt_l1",
    "ckpt_l2",
    "ckpt_l3",
    "ckpt_l4",
    "keep_last_ckpt",
    "head",
    "verbosity",
    "local_test",
    "keep",
    "memory",
    "memory_keep",
    "l2_delta",
}
_STR_KEYS = {"ckpt_dir", "glbl_dir", "meta_dir", "exec_id"}
_SECTION_OF = {
    "ckpt_dir": "basic",
    "glbl_dir": "basic",
    "meta_dir": "basic",
    "node_size": "basic",
    "group_size": "basic",
    "ckpt_l1": "basic",
    "ckpt_l2": "basic",
    "ckpt_l3": "basic",
    "ckpt_l4": "basic",
    "keep_last_ckpt": "basic",
    "head": "basic",
    "verbosity": "basic",
    "local_test": "advanced",
    "exec_id": "restart",
    "keep": "deeppart",
    "memory": "deeppart",
    "memory_budget": "deeppart",
    "memory_keep": "deeppart",
    "l2_rate": "deeppart",
    "l2_delta": "deeppart",
}
_FTI_ONLY = {
    "basic": {
        "ckpt_io",
        "enable_staging",
        "enable_icp",
        "enable_dcp",
        "dcp_mode",
        "dcp_block_size",
        "dcp_stack_size",
        "dcp_l4",
        "inline_l2",
        "inline_l3",
        "inline_l4",
        "keep_l4_ckpt",
        "max_sync_intv",
        "transfer_size",
        "block_size",
        "mpi_tag",
    },
    "restart": {"failure"},
    "advanced": {
        "block_size",
        "transfer_size",
        "general_tag",
        "mpi_tag",
        "lustre_striping_unit",
        "lustre_striping_factor",
        "lustre_striping_offset",
    },
    "deeppart": set(),
}


_SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _parse_size(key: str, value: Any) -> int:
    """Bytes from an integer or ``<n>[K|M|G|T]`` (binary units; ``B``/``iB`` allowed)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
    unit = text[-1:] if text[-1:] in _SIZE_SUFFIX else ""
    number = text[: len(text) - len(unit)].strip()
    try:
        return int(number, 10) * _SIZE_SUFFIX[unit]
    except ValueError:
        raise LevelConfigError(
            f"{key} = {str(value).strip()!r}: not a size (bytes, or a number with K, M, G or T)"
        ) from None


def _parse_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    text = str(value).strip()
    try:
        return int(text, 10)
    except ValueError:
        raise LevelConfigError(f"{key} = {text!r}: not an integer") from None


@dataclass(frozen=True)
class LevelConfig:
    """FTI-style multi-level checkpoint settings (see the module docstring).

    Differences from FTI: ``exec_id`` (section ``[restart]``) names the run's
    subdirectory and defaults to ``"deeppart"`` (FTI generates one per
    execution); ``[deeppart] keep`` is how many committed checkpoints are
    kept (FTI keeps one per level); ``keep_last_ckpt`` is accepted and only
    recorded (DeepPart never deletes the newest checkpoint on close).
    """

    ckpt_dir: str
    glbl_dir: str
    meta_dir: str
    node_size: int = 1
    group_size: int = 4
    ckpt_l1: int = 1
    ckpt_l2: int = 0
    ckpt_l3: int = 0
    ckpt_l4: int = 0
    keep_last_ckpt: int = 0
    head: int = 0
    verbosity: int = 2
    local_test: int = 0
    exec_id: str = "deeppart"
    keep: int = 2
    #: ``[deeppart] memory = 1``: the memory tier. ``ckpt_dir`` must be on a
    #: memory file system (tmpfs, e.g. ``/dev/shm/deeppart-<job>``), which
    #: outlives the training process; each save checks the node's budget
    #: first, and only the newest ``memory_keep`` steps stay there.
    memory: int = 0
    #: Bytes of node-local memory a node may hold (0: only the file system's
    #: free space bounds it); ``2G``, ``512M`` in a file.
    memory_budget: int = 0
    #: Steps whose node-local files stay in memory (the newest committed ones).
    memory_keep: int = 1
    #: Bytes per second each rank sends its L2 partner copy at (0: as fast
    #: as the link takes it); ``2M`` in a file. A paced copy leaves most of
    #: a shared link to the training's collectives (built-in engine).
    l2_rate: int = 0
    #: ``1``: a partner copy goes as a delta against the copy of the step
    #: before that the partner still holds, when that is smaller (verified
    #: against the file's checksum before it is written): fewer bytes over
    #: a slow or shared link for the CPU of compressing the delta (about
    #: 2 ms per MB to encode, 1 to decode); ``0`` (default): always whole
    #: (built-in engine; libfti sends its own whole copies).
    l2_delta: int = 0
    #: FTI-only keys as given, ``(section, key, value)`` (for the FTI backend).
    fti_options: tuple[tuple[str, str, str], ...] = field(default=(), compare=False)
    #: The INI file this came from, if any.
    source: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in _STR_KEYS:
            value = getattr(self, name)
            if not isinstance(value, str):
                raise LevelConfigError(f"{name} must be a string, not {type(value).__name__}")
        for name in _INT_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LevelConfigError(f"{name} = {value!r}: not an integer")
        for name in ("ckpt_dir", "meta_dir"):
            value = getattr(self, name).strip()
            if not value:
                raise LevelConfigError(f"{name} must be set (a directory)")
            if is_url(value):
                raise LevelConfigError(
                    f"{name} = {value}: a URL; {name} must be a file system directory "
                    "(only glbl_dir, the L4 copy, may be an s3:// URL)"
                )
        if is_url(self.glbl_dir.strip()):
            try:
                parse_location(self.glbl_dir.strip())
            except UnsupportedURLError as e:
                raise LevelConfigError(f"glbl_dir: {e}") from e
        if self.l4_enabled and not self.glbl_dir.strip():
            raise LevelConfigError("glbl_dir must be set when ckpt_l4 is enabled")
        if self.node_size < 1:
            raise LevelConfigError(f"node_size = {self.node_size}: must be at least 1")
        if self.group_size < 1:
            raise LevelConfigError(f"group_size = {self.group_size}: must be at least 1")
        for lv in LEVELS:
            v = self.interval(lv)
            if v < -1:
                raise LevelConfigError(f"ckpt_l{lv} = {v}: must be a positive interval, 0 or -1")
        if self.head != 0:
            raise LevelConfigError(
                f"head = {self.head}: dedicated head processes are not supported (use head = 0)"
            )
        if self.keep_last_ckpt not in (0, 1):
            raise LevelConfigError(f"keep_last_ckpt = {self.keep_last_ckpt}: must be 0 or 1")
        if self.local_test not in (0, 1):
            raise LevelConfigError(f"local_test = {self.local_test}: must be 0 or 1")
        if not 0 <= self.verbosity <= 4:
            raise LevelConfigError(f"verbosity = {self.verbosity}: must be 0..4")
        if self.keep < 1:
            raise LevelConfigError(f"keep = {self.keep}: must be at least 1")
        if isinstance(self.memory_budget, bool) or not isinstance(self.memory_budget, int):
            raise LevelConfigError(f"memory_budget = {self.memory_budget!r}: not a size")
        if self.memory not in (0, 1):
            raise LevelConfigError(f"memory = {self.memory}: must be 0 or 1")
        if isinstance(self.l2_rate, bool) or not isinstance(self.l2_rate, int):
            raise LevelConfigError(f"l2_rate = {self.l2_rate!r}: not a size")
        if self.l2_rate < 0:
            raise LevelConfigError(f"l2_rate = {self.l2_rate}: must be >= 0 (0: not paced)")
        if self.l2_delta not in (0, 1):
            raise LevelConfigError(f"l2_delta = {self.l2_delta}: must be 0 or 1")
        if self.memory_budget < 0:
            raise LevelConfigError(f"memory_budget = {self.memory_budget}: must be >= 0")
        if self.memory_keep < 1:
            raise LevelConfigError(f"memory_keep = {self.memory_keep}: must be at least 1")
        if not self.memory and (self.memory_budget or self.memory_keep != 1):
            raise LevelConfigError(
                "memory_budget and memory_keep apply to the memory tier: set memory = 1"
            )
        if not self.exec_id or "/" in self.exec_id or self.exec_id in (".", ".."):
            raise LevelConfigError(f"exec_id = {self.exec_id!r}: must be a plain directory name")

    # ------------------------------------------------------------------
    # Construction.

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], **overrides: Any) -> LevelConfig:
        """From flat ``{key: value}`` (FTI key names; values may be strings
        as in an INI file). Unknown keys raise :class:`LevelConfigError`."""
        merged = {**values, **overrides}
        known = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in merged.items():
            if key not in known:
                raise LevelConfigError(f"unknown config key {key!r}")
            if key in _INT_KEYS:
                kwargs[key] = _parse_int(key, value)
            elif key in ("memory_budget", "l2_rate"):
                kwargs[key] = _parse_size(key, value)
            elif key in _STR_KEYS:
                kwargs[key] = os.fspath(value) if hasattr(value, "__fspath__") else value
            else:
                kwargs[key] = value
        for key in ("ckpt_dir", "glbl_dir", "meta_dir"):
            if key not in kwargs:
                if key == "glbl_dir":
                    kwargs[key] = ""
                else:
                    raise LevelConfigError(f"missing config key {key!r}")
        return cls(**kwargs)

    @classmethod
    def from_kwargs(cls, **values: Any) -> LevelConfig:
        return cls.from_dict(values)

    @classmethod
    def from_string(cls, text: str, *, source: str | None = None) -> LevelConfig:
        """From INI text (sections ``[basic]``, ``[restart]``,
        ``[advanced]``, ``[deeppart]``)."""
        parser = configparser.ConfigParser(
            interpolation=None, inline_comment_prefixes=(";", "#"), strict=True
        )
        where = source or "<config>"
        try:
            parser.read_string(text, source=where)
        except configparser.Error as e:
            raise LevelConfigError(f"{where}: {e}") from e
        values: dict[str, str] = {}
        extra: list[tuple[str, str, str]] = []
        for section in parser.sections():
            sec = section.strip().lower()
            if sec not in _FTI_ONLY:
                raise LevelConfigError(f"{where}: unknown section [{section}]")
            for key, value in parser.items(section):
                key = key.strip().lower()
                if _SECTION_OF.get(key) == sec:
                    values[key] = value
                elif key in _FTI_ONLY[sec]:
                    extra.append((sec, key, value))
                else:
                    raise LevelConfigError(f"{where}: unknown config key {key!r} in [{section}]")
        try:
            cfg = cls.from_dict(values)
        except LevelConfigError as e:
            raise LevelConfigError(f"{where}: {e}") from None
        return cfg.replace(fti_options=tuple(extra), source=source)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> LevelConfig:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise LevelConfigError(f"{p}: cannot read the config ({e.strerror})") from e
        return cls.from_string(text, source=str(p))

    @classmethod
    def coerce(
        cls, config: LevelConfig | str | os.PathLike[str] | Mapping[str, Any]
    ) -> LevelConfig:
        """A :class:`LevelConfig` from itself, an INI path or a dict."""
        if isinstance(config, LevelConfig):
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        return cls.from_file(config)

    def replace(self, **changes: Any) -> LevelConfig:
        import dataclasses

        return dataclasses.replace(self, **changes)

    def to_ini(self) -> str:
        """INI text (FTI key names) for this config, FTI-only keys included."""
        sections: dict[str, list[tuple[str, str]]] = {}
        for f in fields(self):
            if f.name in _SECTION_OF:
                sections.setdefault(_SECTION_OF[f.name], []).append(
                    (f.name, str(getattr(self, f.name)))
                )
        for sec, key, value in self.fti_options:
            sections.setdefault(sec, []).append((key, value))
        out: list[str] = []
        for sec in ("basic", "restart", "advanced", "deeppart"):
            if sec in sections:
                out.append(f"[{sec}]")
                out += [f"{k} = {v}" for k, v in sections[sec]]
                out.append("")
        return "\n".join(out)

    # ------------------------------------------------------------------
    # Levels.

    def interval(self, level: int) -> int:
        if level not in LEVELS:
            raise LevelConfigError(f"level {level}: must be 1, 2, 3 or 4")
        value: int = getattr(self, f"ckpt_l{level}")
        return value

    def enabled(self, level: int) -> bool:
        return self.interval(level) > 0

    @property
    def l4_enabled(self) -> bool:
        return self.ckpt_l4 > 0

    def level_for(self, count: int) -> int:
        """The level of checkpoint number ``count`` (1-based)."""
        if count < 1:
            raise ValueError("checkpoint counts start at 1")
        for lv in (4, 3, 2):
            iv = self.interval(lv)
            if iv > 0 and count % iv == 0:
                return lv
        return 1

    # ------------------------------------------------------------------
    # Topology. ``hosts`` (every rank's hostname, in rank order) is used
    # without local_test; with it, or when None, ranks are placed in blocks:
    # node = rank // node_size.

    def _placement(self, rank: int, hosts: Sequence[str] | None) -> tuple[int, int]:
        """(node index, position on the node) of ``rank``."""
        if self.local_test or hosts is None:
            return rank // self.node_size, rank % self.node_size
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        host = hosts[rank]
        position = sum(1 for r in range(rank) if hosts[r] == host)
        return order.index(host), position

    def _rank_at(self, node: int, position: int, hosts: Sequence[str] | None) -> int:
        if self.local_test or hosts is None:
            return node * self.node_size + position
        order: list[str] = []
        for h in hosts:
            if h not in order:
                order.append(h)
        members = [r for r, h in enumerate(hosts) if h == order[node]]
        return members[position]

    def node_of(self, rank: int, hosts: Sequence[str] | None = None) -> int:
        return self._placement(rank, hosts)[0]

    def group_members(self, rank: int, hosts: Sequence[str] | None = None) -> list[int]:
        """``rank``'s L2/L3 group (FTI's): the ranks at its position on the
        ``group_size`` nodes of its sector (consecutive nodes), in node order."""
        node, pos = self._placement(rank, hosts)
        first = node // self.group_size * self.group_size
        return [self._rank_at(first + j, pos, hosts) for j in range(self.group_size)]

    def partner_of(self, rank: int, hosts: Sequence[str] | None = None) -> int:
        """Where ``rank``'s L2 copy goes: its position on the next node of
        its group's ring."""
        members = self.group_members(rank, hosts)
        return members[(members.index(rank) + 1) % len(members)]

    def local_root(self, node: int) -> Path:
        """The node-local directory of node ``node`` with fake nodes
        (``local_test``): ``ckpt_dir/node<k>/<exec_id>``."""
        return Path(self.ckpt_dir) / f"node{node}" / self.exec_id

    def node_dir_name(self, rank: int, hosts: Sequence[str] | None = None) -> str:
        """The name of ``rank``'s node directory under ``ckpt_dir``: its
        host name on real nodes (so a node's files keep their directory
        whatever the node's index in a later job), ``node<k>`` with fake
        nodes (``local_test``, or no ``hosts``)."""
        if self.local_test or hosts is None:
            return f"node{self.node_of(rank, hosts)}"
        return hosts[rank]

    def local_dir(self, rank: int, hosts: Sequence[str] | None = None) -> Path:
        """``rank``'s node-local directory: ``ckpt_dir/<node dir>/<exec_id>``."""
        return Path(self.ckpt_dir) / self.node_dir_name(rank, hosts) / self.exec_id

    def meta_root(self) -> Path:
        return Path(self.meta_dir) / self.exec_id

    def global_location(self) -> Location:
        """``glbl_dir`` as the storage layer takes it
        (:func:`deeppart.storage.url.parse_location`): a directory, or an
        :class:`~deeppart.storage.url.S3URL` for ``s3://bucket/prefix``."""
        text = self.glbl_dir.strip()
        return parse_location(text) if is_url(text) else Path(self.glbl_dir)

    @property
    def global_in_object_store(self) -> bool:
        """Whether ``glbl_dir`` is an object store URL (``s3://``)."""
        return checkpoint_source(self.global_location()).local_dir() is None

    def check_fti_global(self) -> None:
        """Refuses (:class:`LevelConfigError`) an ``s3://`` glbl_dir for the
        FTI backend: libfti writes L4 to a file system directory only."""
        if self.global_in_object_store:
            raise LevelConfigError(
                f"glbl_dir = {self.glbl_dir.strip()}: the FTI backend cannot write L4 to an "
                "object store (libfti writes a file system directory); use backend='builtin' "
                "for an s3:// glbl_dir"
            )

    def check_fti_memory(self) -> None:
        """Refuses (:class:`LevelConfigError`) the memory tier for the FTI
        backend: libfti keeps its own files and neither checks a budget nor
        evicts steps."""
        if self.memory:
            raise LevelConfigError(
                "memory = 1: the memory tier (budget, eviction) is the built-in engine's; "
                "use backend='builtin', or point the FTI backend's ckpt_dir at a tmpfs "
                "with memory = 0"
            )

    def global_root(self) -> Location:
        """``glbl_dir/<exec_id>``: a directory or an ``s3://`` URL."""
        return self.global_location() / self.exec_id

    # ------------------------------------------------------------------

    def validate(self, world_size: int, hosts: Sequence[str] | None = None) -> None:
        """Checks this config fits a job of ``world_size`` ranks (on
        ``hosts``, every rank's hostname, when not local_test). Raises
        :class:`LevelConfigError`; touches no file."""
        if world_size < 1:
            raise LevelConfigError(f"world size {world_size}: must be at least 1")
        if world_size % self.node_size:
            raise LevelConfigError(
                f"world size {world_size} is not a multiple of node_size = {self.node_size}"
            )
        if not self.local_test and hosts is not None:
            if len(hosts) != world_size:
                raise LevelConfigError(f"{len(hosts)} hostnames for {world_size} ranks")
            for h in hosts:
                if not h or "/" in h or h in (".", "..") or "\0" in h:
                    raise LevelConfigError(
                        f"host name {h!r} cannot name a node directory under ckpt_dir "
                        "(set local_test = 1 to fake nodes)"
                    )
            per: dict[str, int] = {}
            for h in hosts:
                per[h] = per.get(h, 0) + 1
            wrong = {h: n for h, n in per.items() if n != self.node_size}
            if wrong:
                h, n = sorted(wrong.items())[0]
                raise LevelConfigError(
                    f"node_size = {self.node_size}, but host {h!r} runs {n} rank(s) "
                    "(every node must run node_size ranks; set local_test = 1 to fake nodes)"
                )
        nodes = world_size // self.node_size
        multi = [lv for lv in (2, 3) if self.enabled(lv)]
        if multi:
            names = " and ".join(f"L{lv}" for lv in multi)
            if nodes < 2:
                raise LevelConfigError(
                    f"{names} enabled on a single node: they protect against losing a node, "
                    "so they need at least 2 (set ckpt_l2/ckpt_l3 = 0, or local_test = 1 "
                    "with node_size < world size)"
                )
            if not MIN_GROUP <= self.group_size <= MAX_GROUP:
                raise LevelConfigError(
                    f"group_size = {self.group_size}: must be {MIN_GROUP}..{MAX_GROUP} "
                    f"when {names} is enabled"
                )
            if nodes % self.group_size:
                raise LevelConfigError(
                    f"{nodes} nodes ({world_size} ranks / node_size {self.node_size}) is not "
                    f"a multiple of group_size = {self.group_size} (a job restarted on fewer "
                    f"nodes still recovers the steps saved by the old ones with ckpt_l2 = "
                    f"ckpt_l3 = 0, or a group_size that fits: the saved layout comes from "
                    f"each step's metadata)"
                )
