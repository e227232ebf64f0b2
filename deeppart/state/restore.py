"""Flexible restore: which leaves of a checkpoint to read (``keys=``), and
how they match an ``into=`` state by path (``strict=``), the way
``torch.nn.Module.load_state_dict`` matches keys.

Leaves are matched by their path (``"model/layer.weight"``), never by their
position, so a subset, a superset or a reordered state can be filled.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from deeppart.errors import NotInPlaceWarning, StateMismatchError
from deeppart.state.state import held_twice, legacy_path, path_key, skeleton_paths

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


def key_prefixes(keys: Any) -> list[PathLike] | None:
    """``keys=`` as path prefixes (None: everything). Raises TypeError for
    a string or anything else that is not a list of keys."""
    if keys is None:
        return None
    if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
        raise TypeError("keys= must be a list of keys or path tuples, e.g. keys=['model']")
    return [_as_path(k) for k in keys]


def under(path: Sequence[Any], prefixes: Sequence[PathLike] | None) -> bool:
    """Whether ``path`` is under one of ``prefixes`` (None: everything)."""
    return prefixes is None or any(tuple(path[: len(p)]) == p for p in prefixes)


def leaf_paths(paths: Sequence[Sequence[Any]], skeleton: Any) -> list[list[PathLike]]:
    """Per leaf (``paths``: each leaf's own path): its path, then every
    other path at which ``skeleton`` holds it (tied weights: a tensor saved
    once, held at several paths). Raises ValueError on a malformed skeleton."""
    out: list[list[PathLike]] = [[tuple(p)] for p in paths]
    if not held_twice(skeleton):
        return out
    held: dict[int, list[PathLike]] = {}
    for p, i in skeleton_paths(skeleton):
        held.setdefault(i, []).append(p)
    for i, ps in held.items():
        if len(ps) > 1 and 0 <= i < len(out):
            own = out[i][0]
            out[i] += [p for p in ps if p != own and tuple(legacy_path(p)) != own]
    return out


def select_paths(paths: Sequence[Sequence[PathLike]], keys: Any) -> list[list[PathLike]]:
    """Per leaf (``paths``: every path that holds it, see :func:`leaf_paths`),
    those that ``keys`` selects (empty: the leaf is not selected). Each key
    is a top-level key (``"model"``) or a path prefix as a tuple
    (``("optim", "state")``). Raises StateMismatchError for a key that
    selects nothing, naming the top-level keys there are."""
    prefixes = key_prefixes(keys)
    if prefixes is None:
        return [list(ps) for ps in paths]
    for prefix in prefixes:
        if not any(under(p, [prefix]) for ps in paths for p in ps):
            tops = sorted({str(p[0]) for ps in paths for p in ps if p})
            raise StateMismatchError(
                f"keys=: the checkpoint has no {describe(prefix)!r} "
                f"(its top-level keys: {', '.join(tops[:20])})"
            )
    return [[p for p in ps if under(p, prefixes)] for ps in paths]


def select(paths: Sequence[Sequence[Any]], keys: Sequence[Any] | None) -> list[bool]:
    """Which leaves (given by their one path) ``keys`` selects, as
    :func:`select_paths`."""
    return [bool(ps) for ps in select_paths([[tuple(p)] for p in paths], keys)]


@dataclass
class Matching:
    """How the checkpoint's leaves fill ``into=``'s (by leaf index)."""

    #: checkpoint leaf -> the into= leaf it is read into
    pairs: dict[int, int]
    keys: IncompatibleKeys
    #: (checkpoint leaf, into= leaf): a tied leaf of the checkpoint held by
    #: another into= leaf too (weights not tied there), copied into it.
    copies: list[tuple[int, int]] = field(default_factory=list)
    #: (checkpoint leaf, into= leaf, its path, the path that filled the
    #: into= leaf): a tied into= leaf held at a path where the checkpoint
    #: has a leaf of its own, which must equal what filled it.
    checks: list[tuple[int, int, str, str]] = field(default_factory=list)


def match(
    saved: Sequence[Sequence[Sequence[Any]]],
    wanted: Sequence[Sequence[Sequence[Any]]],
    strict: bool,
    elsewhere: Collection[int] = (),
) -> Matching:
    """Matches the checkpoint leaves (``saved``: per leaf, its selected
    paths, empty when not selected) with the ``into=`` leaves (``wanted``:
    per leaf, every path that holds it) by path; tied weights on either
    side hold one leaf at several paths (:func:`leaf_paths`). ``into=``
    leaves in ``elsewhere`` are filled by another stage: neither matched
    nor missing. A checkpoint leaf is unexpected when none of its paths
    fills an ``into=`` leaf, an ``into=`` leaf missing when none of its
    paths is filled. With ``strict``, any difference raises
    StateMismatchError naming the first differing leaves and the fix."""
    where: dict[PathLike, int] = {}
    # A checkpoint written before typed keys spells non-string keys bare.
    legacy: dict[PathLike, int] = {}
    for k, ps in enumerate(wanted):
        for p in ps:
            where[tuple(p)] = k
            legacy[tuple(legacy_path(p))] = k
    out = Matching({}, IncompatibleKeys([], []))
    blocked = set(elsewhere)
    filled: dict[int, int] = {}  # into= leaf -> the checkpoint leaf that fills it
    via: dict[int, str] = {}  # into= leaf -> the path it is filled through
    linked: set[int] = set()

    def free(j: int | None) -> bool:
        return j is not None and j not in blocked and j not in filled

    def at(p: Sequence[Any], i: int) -> int | None:
        """The into= leaf at the checkpoint path ``p`` (of leaf ``i``)."""
        j = where.get(tuple(p))
        if free(j) or (j is not None and filled.get(j) == i):
            return j
        alt = legacy.get(tuple(p))
        return alt if free(alt) else j

    for i, ps in enumerate(saved):
        for p in ps:
            j = at(p, i)
            if j is None or j in blocked:
                continue
            if filled.get(j, i) != i:
                if len(wanted[j]) > 1:  # tied in into=, not in the checkpoint
                    out.checks.append((i, j, describe(p), via[j]))
                    linked.add(i)
                continue
            linked.add(i)
            if j in filled:
                continue
            filled[j], via[j] = i, describe(p)
            if i in out.pairs:
                out.copies.append((i, j))
            else:
                out.pairs[i] = j
    missing = [describe(wanted[j][0]) for j in range(len(wanted)) if free(j)]
    unexpected = [describe(ps[0]) for i, ps in enumerate(saved) if ps and i not in linked]
    out.keys = IncompatibleKeys(missing, unexpected)
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
            + ". "
            + _value_over_subtree(saved, linked, wanted, set(filled) | blocked)
            + "Pass strict=False to fill the leaves both have (the others are reported "
            "by deeppart.last_incompatible_keys()), or keys=[...] to read a part"
        )
    return out


def _value_over_subtree(
    saved: Sequence[Sequence[Sequence[Any]]],
    linked: Collection[int],
    wanted: Sequence[Sequence[Sequence[Any]]],
    used: Collection[int],
) -> str:
    """The fix when an ``into=`` leaf stands where the checkpoint has a
    subtree: ``into=`` holds one plain value (a tree without tensors, stored
    whole) where the checkpoint has tensors, typically a fresh optimizer's
    ``state_dict()`` (no moments before its first step). Empty if none."""
    for j in range(len(wanted)):
        if j in used:
            continue
        w = tuple(wanted[j][0])
        below = [
            i
            for i, ps in enumerate(saved)
            if ps and i not in linked and len(ps[0]) > len(w) and tuple(ps[0][: len(w)]) == w
        ]
        if not below:
            continue
        key = repr(w[0]) if len(w) == 1 else repr(w)
        index = "".join(f"[{k!r}]" for k in w)
        return (
            f"into= holds {describe(w)!r} as one value without tensors, where the checkpoint "
            f"has {len(below)} leaves under it: a fresh optimizer's state_dict() has no moments "
            "before its first step. Read that part without into= and hand it over, e.g. "
            f"opt.load_state_dict(deeppart.load(PATH, keys=[{key}]){index}) (strict=False "
            "would leave it as it is, its lr too). "
        )
    return ""


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


def _same(a: Any, b: Any) -> bool:
    """Whether two plain values are equal (arrays element-wise), never raising."""
    try:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return bool(
                isinstance(a, np.ndarray)
                and isinstance(b, np.ndarray)
                and a.dtype == b.dtype
                and np.array_equal(a, b)
            )
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _merge(old: Any, new: Any) -> bool:
    """Makes ``old`` equal ``new`` in its own memory where both are the same
    kind of container (dict, list) or numpy arrays of one dtype and shape;
    False (``old`` untouched) where it must be replaced instead."""
    if isinstance(old, np.ndarray) and isinstance(new, np.ndarray):
        same = old.dtype == new.dtype and old.shape == new.shape and old.flags.writeable
        if same:
            np.copyto(old, new)
        return bool(same)
    if type(old) is not type(new):
        return False
    if isinstance(old, dict):
        for k in [k for k in old if k not in new]:
            del old[k]
        for k, v in new.items():
            if not (k in old and _merge(old[k], v)):
                old[k] = v
        return list(old) == list(new) or not isinstance(old, OrderedDict)
    if isinstance(old, list):
        if len(old) != len(new):
            old[:] = new
            return True
        for i, v in enumerate(new):
            if not _merge(old[i], v):
                old[i] = v
        return True
    return False


def _set(parent: Any, key: Any, value: Any) -> bool:
    """Sets ``parent[key]`` if ``parent`` is a mutable dict or a list."""
    if isinstance(parent, MutableMapping):
        parent[key] = value
        return True
    if isinstance(parent, list) and isinstance(key, int):
        parent[key] = value
        return True
    return False


def _child(node: Any, step: Any) -> tuple[bool, Any]:
    """(found, the key or index of ``node`` whose path key is ``step``)."""
    if isinstance(node, Mapping):
        for k in node:
            if path_key(k) == step:
                return True, k
        return False, None
    if isinstance(node, list | tuple) and isinstance(step, int) and 0 <= step < len(node):
        return True, step
    return False, None


def write_back(into: Any, paths: Sequence[Sequence[Any]], values: dict[int, Any]) -> list[str]:
    """Sets the plain values ``values`` (into= leaf index -> the checkpoint's
    value) at their ``paths`` in the caller's ``into`` tree, in place: a
    dict entry or a list item is replaced, as DCP's ``load`` writes
    non-tensor values back into the state dict. Returns the paths of
    values that differ but cannot be set in place (an item of a tuple, or a
    value at the root): those are only in the returned state. Dicts, lists
    and numpy arrays the caller holds are updated in their own objects."""
    stuck: list[str] = []
    for j, new in values.items():
        path = tuple(paths[j])
        if path == ("<root>",) and _merge(into, new):
            continue  # a state without tensors: one value, merged into the caller's dict
        node, parent, key = into, None, None
        ok = True
        for step in path:
            found, k = _child(node, step)
            if not found:
                ok = False
                break
            parent, key, node = node, k, node[k]
        if ok and _merge(node, new):
            continue
        if ok and _set(parent, key, new):
            continue
        if not _same(node, new):
            stuck.append(describe(path))
    return stuck


def write_back_plain(
    root: Any, leaves: Sequence[Any], pairs: Iterable[tuple[int, int]], values: Sequence[Any]
) -> None:
    """``load(into=root)``'s last step: the checkpoint's plain values
    (``values``, by checkpoint leaf; ``pairs``: (checkpoint leaf, into
    leaf among ``leaves``, FlatLeafs of ``root``)) set in ``root`` in place
    (:func:`write_back`); a :class:`NotInPlaceWarning` names those that
    cannot be."""
    plain = {j: values[i] for i, j in pairs if leaves[j].tensor is None}
    if root is None or not plain:
        return
    stuck = write_back(root, [lf.path for lf in leaves], plain)
    if stuck:
        warnings.warn(
            f"load(into=...): {len(stuck)} plain value(s) differ from the checkpoint's but sit "
            f"where they cannot be set in place (in a tuple, or at the root): "
            f"{', '.join(stuck[:5])}; use the state that load() returns, or hold them in a "
            "dict or a list",
            NotInPlaceWarning,
            stacklevel=2,
        )


def refuse_meta(paths: Sequence[str]) -> None:
    """Raises StateMismatchError when ``into=`` would be filled at ``paths``
    (of tensors on the meta device): a meta tensor has no memory to load
    into, and returning it unfilled would hand back no data at all."""
    if not paths:
        return
    more = f" and {len(paths) - 5} more" if len(paths) > 5 else ""
    raise StateMismatchError(
        f"into= holds {len(paths)} meta tensor(s), which have no memory to load into: "
        f"{', '.join(paths[:5])}{more}. Materialize the model first (e.g. "
        "model.to_empty(device='cpu'), then load into model.state_dict()), or load without "
        "into= and pass the result to model.load_state_dict(..., assign=True)"
    )
