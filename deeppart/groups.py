"""Plain state held by a subset of the ranks: one checkpoint of a job whose
groups of ranks hold different states (two data-parallel groups training
different models; tensor parallelism with plain ``to_local()`` shards, each
replicated over its data-parallel group).

The user says so with ``group=`` on :func:`deeppart.save` and
:func:`deeppart.load` (by default every rank holds the same state, and a
rank whose state differs fails the save: that is far more often a bug than
a layout):

- ``group=<ProcessGroup | list of global ranks>`` (explicit): this rank's
  replica group. Its members hold the same state, other groups may hold
  another one at the same paths (TP shards of one weight: same path, same
  shape, different values). Each group's tree is stored under its own
  top-level key, :func:`namespace` (``"ranks:0,1"``).
- ``group="auto"``: leaves are matched across ranks by (path, dtype, shape);
  the ranks that list a leaf are its holders, the stored tree is the union
  of the ranks' trees. Right when the groups' keys differ (``{"model_a":
  ...}`` on some ranks, ``{"model_b": ...}`` on others). A path whose
  descriptions differ between ranks, or whose sampled bytes differ between
  its holders, fails the save on every rank, naming ``group=`` as the fix.

:func:`grouped_prepare` is the prepare stage of such a save: each rank
flattens its state, samples each leaf (:func:`deeppart.prepare.sample_bytes`,
no pass over the data), and one allgather shares every rank's leaf
descriptions, samples and skeleton. From them, on every rank alike: the
job's leaves with their holder groups (``Manifest.from_leaves(...,
groups=)``, issue 22's planner balances each leaf within its holders), the
merged skeleton, the plan and the digest that the usual agreement compares.

On load, :func:`load_view` maps ``group=`` to a selection: this rank reads
only its own leaves (``into=``'s, or its group's tree). Ranks that select
different leaves each read their own pieces (:func:`read_own`), with no
exchange.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deeppart._planner import Manifest, Plan
from deeppart.agreement import agree
from deeppart.comm import Comm
from deeppart.compression import check_codec
from deeppart.dtensor import HolderGroups, renumber_skeleton
from deeppart.errors import ReplicaMismatchError, StateError, StateMismatchError
from deeppart.prepare import AGREE_WIDTH, Prepared, sample_bytes, save_digest
from deeppart.reader import ReadPlan
from deeppart.state import FlatLeaf, check_has_data, describe_leaf, flatten, is_dtensor

__all__ = [
    "AUTO",
    "LoadView",
    "group_ranks",
    "grouped_prepare",
    "load_view",
    "namespace",
    "read_own",
    "selection_digest",
]

#: ``group="auto"``: holders from the ranks' leaf descriptions.
AUTO = "auto"

_FIX = (
    "pass deeppart.save(..., group=<this rank's replica group: a ProcessGroup or a list of "
    "ranks>) on every rank, or give each group's state its own key prefix"
)


def namespace(ranks: list[int]) -> str:
    """The top-level key under which an explicit group's tree is stored."""
    return "ranks:" + ",".join(map(str, ranks))


def group_ranks(group: Any, rank: int | None = None, world: int | None = None) -> list[int]:
    """The sorted global ranks of ``group`` (a torch ProcessGroup, or a list
    of ranks); checks that ``rank`` is among them when given."""
    if isinstance(group, list | tuple | range):
        ranks = sorted({int(r) for r in group})
    else:
        try:
            import torch.distributed as dist

            ranks = sorted(dist.get_process_group_ranks(group))
        except Exception as e:
            raise StateError(
                f'group= must be a torch ProcessGroup, a list of ranks or "auto", not {group!r}'
            ) from e
    if not ranks or (world is not None and not all(0 <= r < world for r in ranks)):
        raise StateError(f"group={ranks}: ranks must be a non-empty list below the world size")
    if rank is not None and rank not in ranks:
        raise StateError(f"group={ranks} does not hold this rank ({rank}); pass its own group")
    return ranks


# ----------------------------------------------------------------------------
# Save.


def _sample(leaf: FlatLeaf) -> str:
    data = sample_bytes(leaf.tensor) if leaf.tensor is not None else (leaf.encoded or b"")
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _key(path: Any) -> str:
    return json.dumps(list(path), separators=(",", ":"))


def _what(desc: dict[str, Any]) -> str:
    if desc.get("kind") == "object":
        return f"a value of {desc['nbytes']} bytes"
    return f"{desc['dtype']} {desc['shape']}"


def _merge(a: Any, b: Any, where: str) -> Any:
    """The union of two skeletons (global leaf indices)."""
    if a == b:
        return a
    ((ka, va),), ((kb, vb),) = a.items(), b.items()
    if ka == kb and ka in ("dict", "odict"):
        out = [list(e) for e in va]
        at = {json.dumps(e[0]): i for i, e in enumerate(out)}
        for k, v in vb:
            i = at.get(json.dumps(k))
            if i is None:
                out.append([k, v])
            else:
                out[i][1] = _merge(out[i][1], v, f"{where}/{k}")
        return {ka: out}
    if ka == kb and ka in ("list", "tuple") and len(va) == len(vb):
        pairs = enumerate(zip(va, vb, strict=True))
        return {ka: [_merge(x, y, f"{where}/{i}") for i, (x, y) in pairs]}
    raise StateMismatchError(
        f"{where or '<root>'}: the ranks' state trees differ in structure there; " + _FIX
    )


@dataclass
class _Rank:
    group: list[int] | None
    descs: list[dict[str, Any]]
    samples: list[str]
    skeleton: Any
    common: str


#: A grouped rank's row in the first agreement, where a rank without
#: ``group=`` sends its prepare digest (the same width: no rank hangs).
_MARK = b"deeppart.groups\0"


def _layout(c: Comm, mine: _Rank | None, err: BaseException | None, width: int) -> list[_Rank]:
    """Every rank's leaf descriptions, samples and skeleton (one agreement
    of the prepare's shape, then one allgather of small JSON; parsed as
    JSON, never unpickled)."""
    rows = agree(c, err, _MARK, width=width)
    lone = [r for r, row in enumerate(rows) if row.rstrip(b"\0") != _MARK.rstrip(b"\0")]
    if lone:
        raise StateMismatchError(
            f"group= was not passed on ranks {lone}; pass it on every rank (each rank its "
            "own replica group) or on none; nothing was written"
        )
    assert mine is not None
    rows = c.allgather_varbytes(json.dumps(mine.__dict__, separators=(",", ":")).encode())
    return [_Rank(**json.loads(row)) for row in rows]


def _check_groups(ranks: list[_Rank]) -> None:
    explicit = [r.group is not None for r in ranks]
    if any(explicit) and not all(explicit):
        raise StateMismatchError(
            f"ranks {[r for r, e in enumerate(explicit) if e]} passed a group, the others "
            'group="auto": pass the same kind on every rank (each rank its own replica group)'
        )
    for r, row in enumerate(ranks):
        for m in row.group or []:
            if ranks[m].group != row.group:
                raise StateMismatchError(
                    f"rank {r} passed group={row.group}, rank {m} group={ranks[m].group}: the "
                    "members of a group must pass the same group (groups must not overlap)"
                )


def _mismatched(paths: list[str]) -> ReplicaMismatchError:
    return ReplicaMismatchError(
        f"{len(paths)} tensor leaves differ between the ranks that hold them (sampled bytes; "
        f"first: {'; '.join(paths[:5])}); nothing was written. If groups of ranks hold "
        "different tensors at the same path (e.g. to_local() shards of tensor parallelism, or "
        "two models under one key), " + _FIX
    )


def grouped_prepare(
    c: Comm,
    failed: BaseException | None,
    state: Any,
    group: Any,
    compression: str | None,
    plan_for: Callable[[Manifest], Plan],
    directory: Path,
    width: int = AGREE_WIDTH,
) -> Prepared:
    """The prepare stage of a save with ``group=`` (see the module
    docstring): collective over ``c``; the returned :class:`Prepared` is the
    same on every rank but for this rank's leaves. ``failed``: this rank's
    error in an earlier step (every rank raises)."""
    err: BaseException | None = failed
    # ``width``: that of the agreement the ranks without group= enter.
    mine: _Rank | None = None
    flat: list[FlatLeaf] = []
    codec = "none"
    try:
        if failed is not None:
            raise failed
        codec = check_codec(compression)
        ranks = None if group == AUTO else group_ranks(group, c.rank, c.size)
        flat, tree = flatten(state if ranks is None else {namespace(ranks): state})
        check_has_data(flat)
        if any(lf.tensor is not None and is_dtensor(lf.tensor) for lf in flat):
            raise StateError(
                "group= is for plain tensors held by a subset of the ranks; a DTensor knows "
                "its holders from its mesh: save DTensor state without group="
            )
        common = hashlib.sha256(f"{codec}\0{directory.resolve()}".encode()).hexdigest()
        mine = _Rank(
            ranks, [describe_leaf(lf) for lf in flat], [_sample(lf) for lf in flat], tree, common
        )
    except Exception as e:
        err = err or e
    rows = _layout(c, mine, err, width)
    _check_groups(rows)
    if len({row.common for row in rows}) != 1:
        raise StateMismatchError(
            "ranks disagree on the codec or the directory; nothing was written"
        )
    # The job's leaves, in the order first met (rank 0's first).
    index: dict[str, int] = {}
    descs: list[dict[str, Any]] = []
    holders: list[list[int]] = []
    samples: list[dict[str, list[int]]] = []
    skeleton: Any = None
    for r, row in enumerate(rows):
        local: list[int] = []
        for d, s in zip(row.descs, row.samples, strict=True):
            k = _key(d["path"])
            i = index.get(k)
            if i is None:
                i = index[k] = len(descs)
                descs.append(d)
                holders.append([])
                samples.append({})
            elif _what(descs[i]) != _what(d):
                raise StateMismatchError(
                    f"{'/'.join(map(str, d['path']))}: rank {holders[i][0]} holds "
                    f"{_what(descs[i])}, rank {r} {_what(d)}; nothing was written. " + _FIX
                )
            holders[i].append(r)
            samples[i].setdefault(s, []).append(r)
            local.append(i)
        tree = renumber_skeleton(row.skeleton, local)
        skeleton = tree if skeleton is None else _merge(skeleton, tree, "")
    differ = [
        f"{'/'.join(map(str, descs[i]['path']))} (ranks {' vs '.join(map(str, s.values()))})"
        for i, s in enumerate(samples)
        if len(s) > 1
    ]
    if differ:
        raise _mismatched(differ)
    hg = HolderGroups(c.size)
    full = [
        {k: v for k, v in d.items() if k != "owner"} | hg.field(h)
        for d, h in zip(descs, holders, strict=True)
    ]
    manifest = Manifest.from_leaves(full, hg.groups or None)
    plan = plan_for(manifest)
    by_path = {_key(lf.path): lf for lf in flat}
    leaves = [by_path.get(_key(d["path"])) or FlatLeaf(tuple(d["path"]), None, None) for d in descs]
    digest = save_digest(plan, manifest, skeleton, codec, directory, [])
    return Prepared(leaves, skeleton, manifest, plan, codec, digest)


# ----------------------------------------------------------------------------
# Load.


@dataclass
class LoadView:
    """What a load with ``group=`` asks of the usual stages."""

    into: Any
    keys: Any
    #: The top-level key to unwrap from the loaded tree (explicit groups).
    unwrap: str | None


def _paths(state: Any) -> list[tuple[Any, ...]]:
    leaves, _ = flatten(state)
    return [lf.path for lf in leaves]


def load_view(group: Any, into: Any, keys: Any, rank: int) -> LoadView:
    """``group=`` on load: ``"auto"`` reads ``into=``'s leaves only (the
    checkpoint may hold other groups' leaves); a group (a ProcessGroup, or
    the saved ranks of one group as a list) reads that group's tree. A key
    the checkpoint lacks raises the usual StateMismatchError."""
    if group is None:
        return LoadView(into, keys, None)
    if group == AUTO:
        if into is None or keys is not None:
            raise StateError('load(group="auto") needs into= (the leaves to load) and no keys=')
        return LoadView(into, _paths(into), None)
    ns = namespace(group_ranks(group))
    if keys is not None:
        keys = [(ns, *(k if isinstance(k, tuple) else (k,))) for k in keys]
    elif into is not None:
        keys = [(ns, *p) for p in _paths(into)]
    else:
        keys = [ns]
    return LoadView(None if into is None else {ns: into}, keys, ns)


def selection_digest(rp: ReadPlan) -> bytes:
    """16 bytes naming the leaves this rank reads (compared across ranks)."""
    return hashlib.blake2b(bytes(t is not None for t in rp.targets), digest_size=16).digest()


def read_own(rp: ReadPlan, rank: int) -> ReadPlan:
    """``rp`` changed so that this rank reads every piece it needs itself:
    for ranks that select different leaves (no broadcast can serve them)."""
    rp.read_all, rp.via_shared = True, False
    rp.owner = [rank] * rp.meta.world_size
    rp.mine = [f for f in range(rp.meta.world_size) if rp.by_file[f]]
    return rp
