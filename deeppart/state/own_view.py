"""Each rank's own view of a checkpoint of the union model (metadata
version 3, :mod:`deeppart.state.union`).

At the world size of the save, a rank loads exactly what it saved: the
items it held (another pipeline stage's are left out) and, at a path with
several versions (per-rank values, stages that reuse names), its own
version. Where a load cannot give each rank its own (another world size,
one process), ``per_rank=`` says what to do with the paths that have
versions: None raises :class:`PerRankStateError` naming them, an int takes
the version that rank saved, ``"drop"`` leaves them out, ``"all"`` gives a
dict ``{"ranks:0,2": value, ...}`` at the path, a callable gets the path
and ``{saved ranks: value}`` and returns the value.

The view is the checkpoint's :class:`~deeppart.format.Metadata` with a
rewritten skeleton and leaf paths, the leaves not to read in ``skip``, and
each versioned DTensor record under its own key (``path + ("<version>",
k)``, the same on every rank, so that the ranks' shard reads agree).
Nothing is read here; the same metadata gives the same view on every rank
of one world size, so errors are raised alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deeppart.errors import PerRankStateError, StateError
from deeppart.format import Metadata, VersionRecord
from deeppart.state.restore import key_prefixes, under
from deeppart.state.state import Flat, flatten, path_key
from deeppart.state.union import VERSION_KEY

__all__ = ["OwnView", "by_ranks", "own_view", "resolve_versions", "set_at", "value_at"]


@dataclass
class OwnView:
    """What a load of a version-3 checkpoint reads on this rank."""

    meta: Metadata
    #: ``into=`` paths left out by ``per_rank="drop"`` (reported missing).
    dropped: list[tuple[Any, ...]] = field(default_factory=list)
    #: Paths whose versions are read as a dict, to be passed to a callable.
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    #: Whether leaves were left out (the returned tree is pruned).
    pruned: bool = False
    #: ``into=`` paths whose versions a callable ``per_rank`` resolves after
    #: the load (read by a second load of those paths, ``per_rank="all"``).
    deferred: list[tuple[Any, ...]] = field(default_factory=list)


def _ns(ranks: list[int]) -> str:
    return "ranks:" + ",".join(map(str, ranks))


def _where(path: Any) -> str:
    return "/".join(map(str, path)) or "<root>"


def _refuse(vs: list[VersionRecord], why: str) -> PerRankStateError:
    shown = "; ".join(
        f"{_where(v.path)} (versions saved by ranks {', '.join(str(r) for r in v.ranks)})"
        for v in vs[:5]
    )
    more = f" and {len(vs) - 5} more" if len(vs) > 5 else ""
    return PerRankStateError(
        f"{why}: {len(vs)} paths hold one version per group of saved ranks (per-rank values, "
        f"or pipeline stages that reuse names): {shown}{more}. Pass per_rank=<saved rank> to "
        'take the version that rank saved, per_rank="drop" to leave them out, per_rank="all" '
        "for a dict of every version, or per_rank=<function(path, {ranks: value})>"
    )


def _relabel(node: Any, old: dict[int, Any]) -> Any:
    """``node`` with each leaf node whose index is in ``old`` replaced."""
    if isinstance(node, dict) and len(node) == 1:
        ((kind, body),) = node.items()
        if kind in ("leaf", "ndarray") and isinstance(body, int):
            return old.get(body, node)
        if kind in ("dict", "odict") and isinstance(body, list):
            return {kind: [[k, _relabel(v, old)] for k, v in body]}
        if kind in ("list", "tuple") and isinstance(body, list):
            return {kind: [_relabel(v, old) for v in body]}
    return node


def own_view(
    meta: Metadata,
    rank: int,
    world: int,
    per_rank: Any = None,
    into: Any = None,
    held_only: bool = True,
    flat: Flat | None = None,
    keys: Any = None,
) -> OwnView:
    """This rank's view of ``meta`` (unchanged for metadata before version
    3). ``held_only``: at the save's world size, leave out the items this
    rank did not hold (False for ``load(group=...)``, which names what to
    read). ``keys``: ``load(keys=...)``; the paths with versions outside
    them are not read, so ``per_rank=`` has nothing to say about them."""
    if not meta.union:
        return OwnView(meta)
    prefixes = key_prefixes(keys)
    if per_rank is not None and not (
        (isinstance(per_rank, int) and not isinstance(per_rank, bool))
        or per_rank in ("drop", "all")
        or callable(per_rank)
    ):  # fmt: skip
        raise StateError(
            f'per_rank= must be None, a saved rank, "drop", "all" or a function, not {per_rank!r}'
        )
    same = world == meta.world_size
    leaves = list(meta.leaves)
    records = list(meta.dtensors)
    skip: set[int] = set()
    relabel: dict[int, Any] = {}
    aliases: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    if into is not None and flat is None:
        flat = flatten(into)
    into_paths = {tuple(lf.path) for lf in flat[0]} if flat is not None else None
    view = OwnView(meta)
    shard_leaf = {s.leaf: k for k, r in enumerate(records) for s in r.shards}

    def drop_leaf(i: int) -> None:
        k = shard_leaf.get(i)
        if k is None:
            skip.add(i)
        else:
            skip.update(s.leaf for s in records[k].shards)

    def wanted(path: list[Any]) -> bool:
        return into_paths is None or tuple(path) in into_paths

    # Items not held by this rank (the same world), or not in into= (another).
    holders = _leaf_holders(meta)
    for i, info in enumerate(meta.leaves):
        if i in shard_leaf:
            continue
        h = holders[i]
        if h is None:
            continue
        if (same and held_only and rank not in h) or (not same and not wanted(info.path)):
            skip.add(i)
    for k, rec in enumerate(records):
        ranks = meta.record_ranks[k]
        if ranks == list(range(meta.world_size)):
            continue
        if (same and held_only and rank not in ranks) or (not same and not wanted(rec.path)):
            skip.update(s.leaf for s in rec.shards)
    # Paths with versions.
    refused: list[VersionRecord] = []
    for v in meta.versions:
        firsts = v.leaves
        for k, i in enumerate(v.records):  # versioned DTensors: each under its own key
            records[i] = dataclasses.replace(records[i], path=[*v.path, VERSION_KEY, k])
        for i in firsts:
            drop_leaf(i)
        if (not same and not wanted(v.path)) or not under(v.path, prefixes):
            continue
        mine = next((k for k, r in enumerate(v.ranks) if rank in r), None)
        if same:
            if mine is None:
                continue
            choose: Any = mine
        elif per_rank is None:
            refused.append(v)
            continue
        elif per_rank == "drop":
            view.dropped.append(tuple(v.path))
            continue
        elif callable(per_rank) and into is not None:
            view.deferred.append(tuple(v.path))
            continue
        elif isinstance(per_rank, int):
            choose = next((k for k, r in enumerate(v.ranks) if per_rank in r), None)
            if choose is None:
                raise PerRankStateError(
                    f"per_rank={per_rank}: saved rank {per_rank} holds no version of "
                    f"{_where(v.path)} (its versions were saved by ranks "
                    f"{', '.join(str(r) for r in v.ranks)})"
                )
        else:
            choose = "all"
            if callable(per_rank):
                view.calls.append(tuple(v.path))
        picks = range(len(firsts)) if choose == "all" else [choose]
        for k in picks:
            i = firsts[k]
            k_rec = shard_leaf.get(i)
            if k_rec is None:
                skip.discard(i)
                sub = [path_key(_ns(v.ranks[k]))] if choose == "all" else []
                leaves[i] = dataclasses.replace(leaves[i], path=[*v.path, *sub])
            else:
                skip.difference_update(s.leaf for s in records[k_rec].shards)
                if choose != "all":
                    aliases[tuple(records[k_rec].path)] = tuple(v.path)
        if choose == "all":
            relabel[firsts[0]] = {
                "dict": [[_ns(v.ranks[k]), {"leaf": firsts[k]}] for k in range(len(firsts))]
            }
        else:
            relabel[firsts[0]] = {"leaf": firsts[choose]}
    if refused:
        raise _refuse(
            refused,
            f"this load runs on {world} rank(s), the checkpoint was saved by "
            f"{meta.world_size}: no rank can be given its own version",
        )
    skeleton = _relabel(meta.skeleton, relabel) if relabel else meta.skeleton
    view.meta = dataclasses.replace(
        meta,
        leaves=leaves,
        dtensors=records,
        skeleton=skeleton,
        skip=frozenset(skip),
        aliases=aliases,
    )
    view.pruned = bool(skip)
    return view


def _leaf_holders(meta: Metadata) -> list[list[int] | None]:
    """Per leaf of a version-3 manifest: its saved holders (None: every rank)."""
    manifest = meta.raw.get("manifest")
    out: list[list[int] | None] = [None] * len(meta.leaves)
    if not isinstance(manifest, dict):
        return out
    groups = manifest.get("groups") or []
    raw = manifest.get("leaves")
    if not isinstance(raw, list) or len(raw) != len(meta.leaves):
        return out
    for i, lf in enumerate(raw):
        if not isinstance(lf, dict):
            continue
        owner, h = lf.get("owner"), lf.get("holders")
        if isinstance(owner, int):
            out[i] = [owner]
        elif isinstance(h, int) and 0 <= h < len(groups) and isinstance(groups[h], list):
            out[i] = [int(r) for r in groups[h] if isinstance(r, int)]
    return out


def value_at(tree: Any, path: tuple[Any, ...]) -> Any:
    """The value at leaf path ``path`` of a loaded tree."""
    for k in path:
        tree = tree[_step(tree, k)]
    return tree


def set_at(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """``tree`` with the value at ``path`` replaced by ``value`` (the root
    when ``path`` is empty: returns ``value``)."""
    if not path:
        return value
    parent = value_at(tree, path[:-1])
    parent[_step(parent, path[-1])] = value
    return tree


def by_ranks(versions: dict[Any, Any]) -> dict[tuple[int, ...], Any]:
    """``{"ranks:0,2": v, ...}`` as ``{(0, 2): v, ...}``."""
    return {
        tuple(int(r) for r in str(name).removeprefix("ranks:").split(",")): value
        for name, value in versions.items()
    }


def resolve_versions(
    tree: Any, calls: list[tuple[Any, ...]], fn: Callable[[tuple[Any, ...], dict[Any, Any]], Any]
) -> Any:
    """``tree`` with the dict of versions at each of ``calls`` replaced by
    ``fn(path, {saved ranks tuple: value})``."""
    for path in calls:
        tree = set_at(tree, path, fn(path, by_ranks(value_at(tree, path))))
    return tree


def _step(node: Any, k: Any) -> Any:
    """The container key at path key ``k`` (ints index lists; dict keys are
    matched as leaf paths spell them)."""
    if isinstance(node, dict):
        for key in node:
            if path_key(key) == k:
                return key
        raise KeyError(k)
    return k
