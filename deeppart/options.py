"""The rarely-used knobs of :func:`deeppart.save`, :func:`deeppart.load`,
:func:`deeppart.async_save` and :class:`deeppart.Checkpointer`, grouped
into four frozen objects, each option declared here once:

- :class:`PlanOptions` (``planning=``): where a save's plan comes from;
- :class:`WriteOptions` (``writing=``): how a save writes its pieces;
- :class:`LoadOptions` (``loading=``): how a load reads and shares them;
- :class:`AsyncOptions` (``async_save(background=...)``,
  ``Checkpointer(async_=...)``): a background save's snapshot.

Each checks its values when it is made (a bad value raises there, naming
the option). The old keywords (``save(compression="zstd")``, ...) still
work for one release, with a :class:`DeprecationWarning` naming the new
spelling (:func:`fold`); an old keyword given with the object that holds
it is a :class:`TypeError`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

from deeppart._planner import ALGORITHMS, CostModel, Plan, Topology
from deeppart.compression import check_codec

__all__ = [
    "AsyncOptions",
    "LoadOptions",
    "PlanOptions",
    "WriteOptions",
    "fold",
    "fold_planning",
    "reject_unknown",
]

#: The ways a load shares what it read (``LoadOptions.exchange``).
EXCHANGES = ("auto", "bcast", "read")
#: Zstandard's levels (``WriteOptions.compression_level``): negative ones are its fast modes.
ZSTD_LEVELS = range(-(1 << 17), 23)


def _bytes_or_none(owner: str, name: str, value: Any, least: int = 1) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}({name}={value!r}): an int >= {least} (bytes) or None")


def _flag(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): True or False")


def _of_type(owner: str, name: str, value: Any, kind: type) -> None:
    if value is not None and not isinstance(value, kind):
        raise TypeError(
            f"{owner}({name}=...): a deeppart.{kind.__name__} or None, not {type(value).__name__}"
        )


@dataclass(frozen=True)
class PlanOptions:
    """Where a save's plan comes from (docs/PLANNING.md).

    ``planner``: None (plan in process, through the plan cache), ``"local"``,
    a planner service URL or a ``PlannerClient`` (:func:`deeppart.resolve_planner`);
    ``algorithm`` (one of :data:`deeppart.ALGORITHMS`; None: ``"balanced"``),
    ``cost`` (a :class:`deeppart.CostModel`), ``topology`` (a
    :class:`deeppart.Topology`): what the planner is given; ``plan``: a ready
    :class:`deeppart.Plan` of this state for this world size, used as it is
    (then the other fields must stay unset).
    """

    planner: Any = None
    algorithm: str | None = None
    cost: CostModel | None = None
    topology: Topology | None = None
    plan: Plan | None = None

    def __post_init__(self) -> None:
        if self.algorithm is not None and self.algorithm not in ALGORITHMS:
            raise ValueError(
                f"PlanOptions(algorithm={self.algorithm!r}): choose one of {', '.join(ALGORITHMS)}"
            )
        _of_type("PlanOptions", "cost", self.cost, CostModel)
        _of_type("PlanOptions", "topology", self.topology, Topology)
        _of_type("PlanOptions", "plan", self.plan, Plan)
        if self.plan is not None:
            unused = [f.name for f in fields(self) if f.name != "plan" and getattr(self, f.name)]
            if unused:
                raise ValueError(
                    f"PlanOptions(plan=...) is used as it is: {', '.join(unused)} would be "
                    "ignored; give either a plan or what to plan with"
                )


@dataclass(frozen=True)
class WriteOptions:
    """How a save writes its pieces (docs/CHECKPOINTING.md).

    ``compression``: None, ``"zstd"``, ``"lz4"``, ``"shuffle-zstd"`` or
    ``"auto"`` (per piece: compressed only when a sample says it pays in
    the plan's cost model, :class:`deeppart.compression.AutoPolicy`);
    ``compression_level``: the Zstandard level (1: fast; ratios on float
    data barely improve above). ``staging_bytes``: the host buffer through
    which pieces of device (CUDA) tensors are copied, in chunks (None:
    256 MiB). ``verify_replicas``: first prove that the ranks holding a
    plain tensor hold the same bytes (else :class:`ReplicaMismatchError` on
    every rank, nothing written). ``replica_dims``: root-mesh dimension
    names (e.g. ``"dp"``) over which DTensors on sub-meshes are declared
    replicas instead of compared whole (docs/SHARDED.md).
    """

    compression: str | None = None
    compression_level: int = 1
    staging_bytes: int | None = None
    verify_replicas: bool = False
    replica_dims: str | Sequence[str] | None = None

    def __post_init__(self) -> None:
        check_codec(self.compression)
        level = self.compression_level
        if isinstance(level, bool) or not isinstance(level, int) or level not in ZSTD_LEVELS:
            raise ValueError(
                f"WriteOptions(compression_level={level!r}): an int from "
                f"{ZSTD_LEVELS.start} to {ZSTD_LEVELS.stop - 1} (Zstandard's levels)"
            )
        _bytes_or_none("WriteOptions", "staging_bytes", self.staging_bytes)
        _flag("WriteOptions", "verify_replicas", self.verify_replicas)
        dims = self.replica_dims
        if dims is not None:
            names = (dims,) if isinstance(dims, str) else tuple(dims)
            if not all(isinstance(n, str) and n for n in names):
                raise TypeError(
                    f"WriteOptions(replica_dims={dims!r}): a mesh dimension name or a "
                    "sequence of names"
                )
            object.__setattr__(self, "replica_dims", names)


@dataclass(frozen=True)
class LoadOptions:
    """How a load reads and shares the checkpoint's bytes (docs/CHECKPOINTING.md).

    ``exchange``: ``"auto"`` (each data file read and checksummed once, by
    one rank, then shared through a node-shared window on one host, else
    broadcast), ``"bcast"`` (each rank reads a balanced share and
    broadcasts it as it is verified: many nodes on one store) or ``"read"``
    (every rank reads and checksums every piece itself); DTensor shards
    follow the same rule (docs/SHARDED.md). ``staging_bytes``: the host
    buffer through which device tensors of ``into=`` are filled (None:
    256 MiB, docs/GPU.md).
    """

    exchange: str = "auto"
    staging_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.exchange not in EXCHANGES:
            raise ValueError(
                f"LoadOptions(exchange={self.exchange!r}): choose one of {', '.join(EXCHANGES)}"
            )
        _bytes_or_none("LoadOptions", "staging_bytes", self.staging_bytes)


@dataclass(frozen=True)
class AsyncOptions:
    """A background save's snapshot (docs/ASYNC.md).

    ``max_staging_bytes``: the most tensor bytes a rank's snapshot (its
    share) may hold in host memory (None: no limit); when a rank's share is
    larger, the save runs synchronously on every rank, with an
    :class:`AsyncSaveWarning`. ``snapshot_on_device``: copy the share
    within the device first, on the training stream, so that it pauses for
    a device-to-device copy only (docs/GPU.md).
    """

    max_staging_bytes: int | None = None
    snapshot_on_device: bool = False

    def __post_init__(self) -> None:
        _bytes_or_none("AsyncOptions", "max_staging_bytes", self.max_staging_bytes, least=0)
        _flag("AsyncOptions", "snapshot_on_device", self.snapshot_on_device)


_O = TypeVar("_O", PlanOptions, WriteOptions, LoadOptions, AsyncOptions)

#: The old names of options, deprecated twice over (``level=`` was
#: ``compression_level=``'s name before it named the storage levels).
ALIASES = {"level": "compression_level"}


def fold(
    where: str,
    keyword: str,
    cls: type[_O],
    given: object,
    old: dict[str, Any],
    *,
    share: Sequence[str] = (),
    stacklevel: int = 2,
    checked: bool = True,
) -> _O:
    """The ``cls`` that ``where`` uses: ``given`` (None: the defaults), or
    one made of the old keywords in ``old`` that ``cls`` holds (removed
    from ``old``, with one DeprecationWarning naming the new spelling:
    ``keyword=deeppart.Cls(...)``). An old keyword given beside ``given``,
    or (``checked``) a ``given`` of another type, is a TypeError.
    ``share``: old keywords that other options objects hold too (left in
    ``old`` for them, e.g. a Checkpointer's ``staging_bytes``, its saves'
    and its loads'). ``stacklevel``: the caller of ``where``, counted from
    the caller of this function."""
    names = {f.name for f in fields(cls)}
    found = {k: old[k] for k in list(old) if ALIASES.get(k, k) in names}
    if not found:
        if given is None:
            return cls()
        if checked and not isinstance(given, cls):
            raise TypeError(f"{where}: {keyword}= takes a deeppart.{cls.__name__}, not {given!r}")
        return cast(_O, given)
    spelled = ", ".join(f"{ALIASES.get(k, k)}=..." for k in found)
    new = f"{keyword}=deeppart.{cls.__name__}({spelled})"
    if given is not None:
        raise TypeError(
            f"{where}: {', '.join(f'{k}=' for k in found)} and {keyword}= both given; "
            f"give only {new}"
        )
    clash = [k for k in found if k in ALIASES and ALIASES[k] in found]
    if clash:
        raise TypeError(f"{where}: {clash[0]}= is the old name of {ALIASES[clash[0]]}=; give one")
    for k in found:
        if k not in share:
            del old[k]
    warnings.warn(
        f"{where}({', '.join(f'{k}=' for k in found)}) is deprecated and will be removed in "
        f"the next release: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return cls(**{ALIASES.get(k, k): v for k, v in found.items()})


def fold_planning(where: str, planning: object, old: dict[str, Any], stacklevel: int = 2) -> Any:
    """A save's ``planning=`` (a :class:`PlanOptions`, or the
    ``PlanProvider`` a Checkpointer or a level backend shares between its
    saves; None: the defaults), or what the old keywords say (``planner=``,
    ``algorithm=``, ``cost=``, ``topology=``, ``plan=``, and
    ``plan_provider=``: ``planning=`` takes the provider itself), with a
    DeprecationWarning; the type is checked by
    :meth:`deeppart.saving.planning.PlanProvider.of`."""
    if "plan_provider" in old:
        provider = old.pop("plan_provider")
        if planning is not None:
            raise TypeError(
                f"{where}: plan_provider= and planning= both given; give only planning="
            )
        warnings.warn(
            f"{where}(plan_provider=) is deprecated and will be removed in the next release: "
            "use planning=<the PlanProvider>",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )
        planning = provider
    # Unchecked here: a PlanProvider passes (PlanProvider.of checks).
    return fold(
        where, "planning", PlanOptions, planning, old, stacklevel=stacklevel + 1, checked=False
    )


def reject_unknown(where: str, old: Mapping[str, Any]) -> None:
    """The TypeError Python raises for keywords ``where`` does not take
    (what :func:`fold` left in ``old``)."""
    if old:
        raise TypeError(f"{where} got an unexpected keyword argument {next(iter(old))!r}")
