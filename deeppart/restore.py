"""Flexible restore: which leaves of a checkpoint to read (``keys=``), and
how they match an ``into=`` state by path (``strict=``), the way
``torch.nn.Module.load_state_dict`` matches keys.

Leaves are matched by their path (``"model/layer.weight"``), never by their
position, so a subset, a superset or a reordered state can be filled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import Any, NamedTuple

from deeppart.errors import StateMismatchError
from deeppart.state import legacy_path, path_key

PathLike = tuple[Any, ...]

#: A leaf that was not read (``keys=``): dropped from dicts when the tree is
#: pruned, ``None`` in lists and tuples.
ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "<absent>"})()


class IncompatibleKeys(NamedTuple):
    """What ``load(into=..., strict=False)`` could not match, as "/"-joined
    leaf paths: ``missing_keys`` are in ``into=`` but not in the checkpoint
    (left as they were), ``unexpected_keys`` in the checkpoint (within
    ``keys=``) but not in ``into=`` (not read)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def describe(path: Iterable[Any]) -> str:
    return "/".join(str(k) for k in path)


def _as_path(key: Any) -> PathLike:
    """A key or a tuple of keys as a path prefix, each key as leaf paths
    spell it (``True`` -> ``"!True"``; integer keys stay integers)."""
    keys = tuple(key) if isinstance(key, tuple | list) else (key,)
    return tuple(path_key(k) for k in keys)


def select(paths: Sequence[Sequence[Any]], keys: Sequence[Any] | None) -> list[bool]:
    """Which leaves (given by path) ``keys`` selects: each key is a
    top-level key (``"model"``) or a path prefix as a tuple
    (``("optim", "state")``). Raises StateMismatchError for a key that
    selects nothing, naming the top-level keys there are."""
    if keys is None:
        return [True] * len(paths)
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise TypeError("keys= must be a list of keys or path tuples, e.g. keys=['model']")
    prefixes = [_as_path(k) for k in keys]
    chosen = [False] * len(paths)
    for prefix in prefixes:
        n = len(prefix)
        hits = [i for i, p in enumerate(paths) if tuple(p[:n]) == prefix]
        if not hits:
            tops = sorted({str(p[0]) for p in paths if p})
            raise StateMismatchError(
                f"keys=: the checkpoint has no {describe(prefix)!r} "
                f"(its top-level keys: {', '.join(tops[:20])})"
            )
        for i in hits:
            chosen[i] = True
    return chosen


def match(
    saved: Sequence[Sequence[Any]],
    selected: Sequence[bool],
    wanted: Sequence[Sequence[Any]],
    strict: bool,
    elsewhere: Collection[int] = (),
) -> tuple[dict[int, int], IncompatibleKeys]:
    """Matches the selected checkpoint leaves (``saved`` paths) with the
    ``into=`` leaves (``wanted`` paths) by path: returns checkpoint index ->
    into index, and what did not match (``into=`` leaves in ``elsewhere``
    are filled by another stage: neither matched nor missing). With
    ``strict``, any difference raises StateMismatchError naming the first
    differing leaves and the fix."""
    where = {tuple(p): j for j, p in enumerate(wanted)}
    # A checkpoint written before typed keys spells non-string keys bare.
    legacy = {tuple(legacy_path(p)): j for j, p in enumerate(wanted)}
    pairs: dict[int, int] = {}
    used: set[int] = set(elsewhere)
    unexpected: list[str] = []
    for i, p in enumerate(saved):
        if not selected[i]:
            continue
        j = where.get(tuple(p))
        if j is None or j in used:
            j = legacy.get(tuple(p))
        if j is None or j in used:
            unexpected.append(describe(p))
        else:
            pairs[i] = j
            used.add(j)
    missing = [describe(wanted[j]) for j in range(len(wanted)) if j not in used]
    keys = IncompatibleKeys(missing, unexpected)
    if strict and (missing or unexpected):
        raise StateMismatchError(
            "into= and the checkpoint have different leaves: "
            + "; ".join(
                f"{len(names)} {what} (first: {', '.join(names[:5])})"
                for what, names in (
                    ("missing from the checkpoint", missing),
                    ("in the checkpoint but not in into=", unexpected),
                )
                if names
            )
            + ". Pass strict=False to fill the leaves both have (the others are reported "
            "by deeppart.last_incompatible_keys()), or keys=[...] to read a part"
        )
    return pairs, keys


def prune(tree: Any) -> Any:
    """``tree`` without its :data:`ABSENT` leaves: dict entries that hold
    only absent leaves are dropped; in lists and tuples they become None."""

    def walk(node: Any) -> Any:
        if node is ABSENT:
            return ABSENT
        if type(node) in (dict, OrderedDict):
            out = type(node)()
            for k, v in node.items():
                kept = walk(v)
                if kept is not ABSENT:
                    out[k] = kept
            return out if out or not node else ABSENT
        if type(node) in (list, tuple):
            items = [walk(v) for v in node]
            if node and all(v is ABSENT for v in items):
                return ABSENT
            kept_items = [None if v is ABSENT else v for v in items]
            return kept_items if isinstance(node, list) else tuple(kept_items)
        return node

    out = walk(tree)
    return {} if out is ABSENT else out
