"""Conversion between DeepPart objects and the ``deeppart.planner.v1`` messages.

The manifest travels compactly (see ``proto/deeppart/planner/v1/planner.proto``):
a deduplicated key table, front-coded paths and packed per-leaf arrays. Every
decoder validates what it reads and raises :class:`WireError`, a
``ValueError`` naming the problem, so that the service can answer
``INVALID_ARGUMENT`` with a useful message.
"""

from __future__ import annotations

import operator
from typing import Any, Literal

import numpy as np

from deeppart._planner import (
    MAX_GROUP_ENTRIES,
    MAX_GROUP_RANK,
    MAX_GROUPS,
    PLANNER_VERSION,
    CostModel,
    Manifest,
    Plan,
    Topology,
)
from deeppart.errors import PlanError, WireError
from deeppart.proto import planner_pb2 as pb

#: The wire manifest's version without holder groups (what old servers read)
#: and with them (``group_sizes``, ``group_ranks``, ``holders``).
MANIFEST_VERSION = 1
MANIFEST_VERSION_GROUPS = 2

Ranks = list[list[tuple[int, int, int]]]


#: The planner's limit on the keys of one path (``MAX_PATH_DEPTH`` in
#: planner/src/model/manifest.rs), checked here before any path is built.
MAX_PATH_DEPTH = 256
#: Every path is expanded in full (the planner holds each leaf's own path),
#: so front coding lets a small message describe huge paths. Their total
#: size, counted as :data:`KEY_OVERHEAD` per key plus string lengths, may be
#: at most this many times the message's size (or :data:`MIN_PATH_BUDGET`).
PATH_EXPANSION = 64
MIN_PATH_BUDGET = 16 << 20
KEY_OVERHEAD = 16


# ----------------------------------------------------------------------------
# Manifest.


def manifest_to_proto(manifest: Manifest) -> pb.Manifest:
    """The compact wire form of ``manifest``: version 1 without holder
    groups (as old servers read it), version 2 with the groups sent once and
    a group index per leaf."""
    groups = manifest.groups
    holders: list[int] = []
    string_ids: dict[str, int] = {}
    int_ids: dict[int, int] = {}
    dtype_ids: dict[str, int] = {}
    shared: list[int] = []
    suffix_len: list[int] = []
    suffix_keys: list[int] = []
    dtype: list[int] = []
    ndim: list[int] = []
    dims: list[int] = []
    object_nbytes: list[int] = []
    owned_leaves: list[int] = []
    owner_ranks: list[int] = []
    prev: tuple[Any, ...] = ()
    for i, leaf in enumerate(manifest.leaves()):
        path: tuple[Any, ...] = leaf["path"]
        n = 0
        limit = min(len(path), len(prev))
        # Compare with types: the string "0" and the integer 0 are different keys.
        while n < limit and type(path[n]) is type(prev[n]) and path[n] == prev[n]:
            n += 1
        shared.append(n)
        suffix_len.append(len(path) - n)
        for key in path[n:]:
            if isinstance(key, str):
                ref = string_ids.setdefault(key, len(string_ids))
                suffix_keys.append(2 * ref)
            else:
                ref = int_ids.setdefault(int(key), len(int_ids))
                suffix_keys.append(2 * ref + 1)
        prev = path
        if leaf["kind"] == "tensor":
            dtype.append(dtype_ids.setdefault(leaf["dtype"], len(dtype_ids)) + 1)
            shape = leaf["shape"]
            ndim.append(len(shape))
            dims.extend(shape)
        else:
            dtype.append(0)
            object_nbytes.append(leaf["nbytes"])
        if leaf.get("owner") is not None:
            owned_leaves.append(i)
            owner_ranks.append(leaf["owner"])
        if groups:
            g = leaf.get("holders")
            holders.append(0 if g is None else g + 1)
    return pb.Manifest(
        version=MANIFEST_VERSION_GROUPS if groups else MANIFEST_VERSION,
        string_keys=list(string_ids),
        int_keys=list(int_ids),
        shared=shared,
        suffix_len=suffix_len,
        suffix_keys=suffix_keys,
        dtypes=list(dtype_ids),
        dtype=dtype,
        ndim=ndim,
        dims=dims,
        object_nbytes=object_nbytes,
        owned_leaves=owned_leaves,
        owner_ranks=owner_ranks,
        group_sizes=[len(g) for g in groups],
        group_ranks=[r for g in groups for r in g],
        holders=holders,
    )


def manifest_leaves_from_proto(msg: pb.Manifest) -> list[dict[str, Any]]:
    """The leaf descriptions of a wire manifest, for ``Manifest.from_leaves``
    (the groups come from :func:`manifest_groups_from_proto`)."""
    if msg.version not in (MANIFEST_VERSION, MANIFEST_VERSION_GROUPS):
        raise WireError(
            f"manifest: unsupported version {msg.version} (this service reads "
            f"{MANIFEST_VERSION} and {MANIFEST_VERSION_GROUPS})"
        )
    # Read the packed arrays at C speed (numpy), then walk plain lists.
    shared = _ints(msg.shared)
    suffix_len = _ints(msg.suffix_len)
    refs = np.array(msg.suffix_keys, dtype=np.int64)
    dtype = _ints(msg.dtype)
    ndim = _ints(msg.ndim)
    dims = _ints(msg.dims)
    nbytes = _ints(msg.object_nbytes)
    n = len(shared)
    if len(suffix_len) != n or len(dtype) != n:
        raise WireError(
            f"manifest: per-leaf arrays disagree: shared has {n} entries, suffix_len "
            f"{len(suffix_len)}, dtype {len(dtype)}"
        )
    if sum(suffix_len) != len(refs):
        raise WireError(
            f"manifest: suffix_len adds up to {sum(suffix_len)} keys "
            f"but suffix_keys has {len(refs)}"
        )
    n_tensors = n - dtype.count(0)
    if len(ndim) != n_tensors:
        raise WireError(f"manifest: {n_tensors} tensor leaves but {len(ndim)} ndim entries")
    if sum(ndim) != len(dims):
        raise WireError(f"manifest: ndim adds up to {sum(ndim)} but dims has {len(dims)}")
    if len(nbytes) != n - n_tensors:
        raise WireError(
            f"manifest: {n - n_tensors} object leaves but {len(nbytes)} object_nbytes entries"
        )
    if len(msg.owned_leaves) != len(msg.owner_ranks):
        raise WireError(
            f"manifest: {len(msg.owned_leaves)} owned_leaves but {len(msg.owner_ranks)} owner_ranks"
        )
    holders = _leaf_holders(msg, n)
    strings = list(msg.string_keys)
    ints = list(msg.int_keys)
    dtypes = list(msg.dtypes)
    # Every key reference and dtype in range, checked at once; errors name the leaf.
    ends = np.cumsum(np.array(suffix_len, dtype=np.int64))
    for is_int, table, what in ((0, strings, "string"), (1, ints, "integer")):
        bad = np.flatnonzero(((refs & 1) == is_int) & ((refs >> 1) >= len(table)))
        if bad.size:
            leaf = int(np.searchsorted(ends, bad[0], side="right"))
            raise WireError(
                f"manifest: leaf {leaf}: {what} key {int(refs[bad[0]]) >> 1} out of range"
            )
    for i, dt in enumerate(dtype):
        if dt > len(dtypes):
            raise WireError(f"manifest: leaf {i}: dtype {dt} out of range")
    _check_path_sizes(msg, shared, suffix_len, refs, strings)
    key_table: list[str | int] = []
    for j in range(max(len(strings), len(ints))):
        key_table.append(strings[j] if j < len(strings) else "")
        key_table.append(ints[j] if j < len(ints) else 0)
    keys = [key_table[r] for r in refs.tolist()]
    owners: dict[int, int] = {}
    for leaf, rank in zip(msg.owned_leaves, msg.owner_ranks, strict=True):
        if leaf >= n:
            raise WireError(f"manifest: owned leaf {leaf} does not exist ({n} leaves)")
        if leaf in owners:
            raise WireError(f"manifest: leaf {leaf} is listed as owned twice")
        owners[leaf] = rank

    leaves: list[dict[str, Any]] = []
    prev: list[str | int] = []
    k = t = d = o = 0
    for i in range(n):
        share = shared[i]
        if share > len(prev):
            raise WireError(
                f"manifest: leaf {i} shares {share} keys with a previous path of {len(prev)}"
            )
        k2 = k + suffix_len[i]
        path = prev[:share] + keys[k:k2] if share else keys[k:k2]
        k = k2
        dt = dtype[i]
        if dt:
            nd = ndim[t]
            desc: dict[str, Any] = {
                "path": path,
                "dtype": dtypes[dt - 1],
                "shape": dims[d : d + nd],
            }
            t += 1
            d += nd
        else:
            desc = {"path": path, "kind": "object", "nbytes": nbytes[o]}
            o += 1
        if owners and i in owners:
            desc["owner"] = owners[i]
        if holders and holders[i]:
            desc["holders"] = holders[i] - 1
        leaves.append(desc)
        prev = path
    return leaves


def manifest_groups_from_proto(msg: pb.Manifest) -> list[list[int]]:
    """The holder groups of a wire manifest, their count, total size and
    ranks checked against the JSON form's limits before any list is built."""
    if msg.version != MANIFEST_VERSION_GROUPS:
        if len(msg.group_sizes) or len(msg.group_ranks) or len(msg.holders):
            raise WireError(
                f"manifest: holder groups need version {MANIFEST_VERSION_GROUPS}, "
                f"the message says {msg.version}"
            )
        return []
    if len(msg.group_sizes) > MAX_GROUPS:
        raise WireError(f"manifest: {len(msg.group_sizes)} holder groups, more than {MAX_GROUPS}")
    if len(msg.group_ranks) > MAX_GROUP_ENTRIES:
        raise WireError(
            f"manifest: {len(msg.group_ranks)} ranks in holder groups, "
            f"more than {MAX_GROUP_ENTRIES}"
        )
    sizes = np.array(msg.group_sizes, dtype=np.int64)
    if int(sizes.sum()) != len(msg.group_ranks):
        raise WireError(
            f"manifest: group_sizes add up to {int(sizes.sum())} ranks "
            f"but group_ranks has {len(msg.group_ranks)}"
        )
    ranks = np.array(msg.group_ranks, dtype=np.int64)
    too_big = np.flatnonzero(ranks >= MAX_GROUP_RANK)
    if too_big.size:
        group = int(np.searchsorted(np.cumsum(sizes), too_big[0], side="right"))
        raise WireError(
            f"manifest: holder group {group} lists rank {int(ranks[too_big[0]])}, "
            f"not below {MAX_GROUP_RANK}"
        )
    # Empty, unsorted or duplicate groups are the planner's to name (ManifestError).
    flat = ranks.tolist()
    groups: list[list[int]] = []
    i = 0
    for size in sizes.tolist():
        groups.append(flat[i : i + size])
        i += size
    return groups


def _leaf_holders(msg: pb.Manifest, n: int) -> list[int]:
    """Per leaf, 0 or its group index plus one (empty without groups)."""
    if not len(msg.holders):
        return []
    if len(msg.holders) != n:
        raise WireError(f"manifest: {n} leaves but {len(msg.holders)} holders entries")
    holders = _ints(msg.holders)
    worst = max(holders)
    if worst > len(msg.group_sizes):
        leaf = holders.index(worst)
        raise WireError(
            f"manifest: leaf {leaf}: holder group {worst - 1} out of range "
            f"({len(msg.group_sizes)} groups)"
        )
    return holders


def _check_path_sizes(
    msg: pb.Manifest,
    shared: list[int],
    suffix_len: list[int],
    refs: np.ndarray[Any, Any],
    strings: list[str],
) -> None:
    """Every path's depth and the total size of all expanded paths, from the
    front-coded arrays alone, before any path is built (time linear in the
    message: each key is added once and dropped at most once)."""
    key_cost = np.full(len(refs), KEY_OVERHEAD, dtype=np.int64)
    if strings and len(refs):
        lengths = np.array([len(k) for k in strings], dtype=np.int64)
        is_str = (refs & 1) == 0
        key_cost[is_str] += lengths[refs[is_str] >> 1]
    cum_suffix = np.concatenate([[0], np.cumsum(key_cost)]).tolist()
    budget = max(MIN_PATH_BUDGET, PATH_EXPANSION * msg.ByteSize())
    prefix = [0]  # prefix[d]: the size of the current path's first d keys
    total = k = 0
    for i, (share, extra) in enumerate(zip(shared, suffix_len, strict=True)):
        if share >= len(prefix):
            raise WireError(
                f"manifest: leaf {i} shares {share} keys with a previous path of {len(prefix) - 1}"
            )
        if share + extra > MAX_PATH_DEPTH:
            raise WireError(
                f"manifest: leaf {i}: path has {share + extra} keys, more than {MAX_PATH_DEPTH}"
            )
        del prefix[share + 1 :]
        base = prefix[share] - cum_suffix[k]
        prefix.extend(base + c for c in cum_suffix[k + 1 : k + extra + 1])
        k += extra
        total += prefix[-1]
        if total > budget:
            raise WireError(
                f"manifest: its paths expand to more than {budget} bytes "
                f"({PATH_EXPANSION} times the message)"
            )


def _ints(field: Any) -> list[int]:
    """A packed repeated integer field as a list (numpy reads it at C speed)."""
    values: list[int] = np.array(field, dtype=np.uint64).tolist()
    return values


def manifest_from_proto(msg: pb.Manifest) -> Manifest:
    """The manifest a wire message describes; ``ManifestError`` if invalid."""
    groups = manifest_groups_from_proto(msg)
    leaves = manifest_leaves_from_proto(msg)
    return Manifest.from_leaves(leaves, groups=groups or None)


# ----------------------------------------------------------------------------
# Cost model and topology.


def cost_to_proto(cost: CostModel | None) -> pb.CostModel:
    if cost is None:
        return pb.CostModel()
    c = cost.to_dict()
    return pb.CostModel(
        fixed_s=float(c["fixed_s"]),
        piece_s=float(c["piece_s"]),
        bandwidth=float(c["bandwidth"]),
        writer_s=float(c["writer_s"]),
        min_piece_bytes=int(c["min_piece_bytes"]),
        align_bytes=int(c["align_bytes"]),
        grain=str(c["grain"]),
        node_bandwidth=c["node_bandwidth"],
        aggregate_bandwidth=c["aggregate_bandwidth"],
    )


def cost_from_proto(msg: pb.CostModel) -> CostModel:
    """The cost model; ``PlanError`` if a value is invalid (also one too
    large for the planner's integers, e.g. ``align_bytes = 2**63``)."""
    try:
        return CostModel(
            fixed_s=msg.fixed_s if msg.HasField("fixed_s") else None,
            piece_s=msg.piece_s if msg.HasField("piece_s") else None,
            bandwidth=msg.bandwidth if msg.HasField("bandwidth") else None,
            writer_s=msg.writer_s if msg.HasField("writer_s") else None,
            min_piece_bytes=msg.min_piece_bytes if msg.HasField("min_piece_bytes") else None,
            align_bytes=msg.align_bytes if msg.HasField("align_bytes") else None,
            grain=_grain_from_proto(msg),
            node_bandwidth=msg.node_bandwidth if msg.HasField("node_bandwidth") else None,
            aggregate_bandwidth=(
                msg.aggregate_bandwidth if msg.HasField("aggregate_bandwidth") else None
            ),
        )
    except OverflowError as e:
        raise PlanError(f"cost model: a value is out of range ({e})") from e


def _grain_from_proto(msg: pb.CostModel) -> Literal["element", "row"] | None:
    """The grain a message names; ``PlanError`` for an unknown one."""
    if not msg.HasField("grain"):
        return None
    if msg.grain == "element":
        return "element"
    if msg.grain == "row":
        return "row"
    raise PlanError(f'invalid cost model: grain must be "element" or "row", got {msg.grain!r}')


def topology_to_proto(topology: Topology | None) -> pb.Topology:
    return pb.Topology(ranks_per_node=1 if topology is None else topology.ranks_per_node)


def topology_from_proto(msg: pb.Topology) -> Topology:
    return Topology(msg.ranks_per_node or 1)


# ----------------------------------------------------------------------------
# Plans.


def pieces_to_proto(plan: Plan) -> pb.Pieces:
    rank_counts: list[int] = []
    leaf_deltas: list[int] = []
    starts: list[int] = []
    stops: list[int] = []
    for r in range(plan.world_size):
        pieces = plan.rank_pieces(r)
        rank_counts.append(len(pieces))
        if not pieces:
            continue
        leaves, rank_starts, rank_stops = zip(*pieces, strict=True)
        leaf_deltas.append(leaves[0])
        leaf_deltas.extend(map(operator.sub, leaves[1:], leaves))
        starts.extend(rank_starts)
        stops.extend(rank_stops)
    return pb.Pieces(rank_counts=rank_counts, leaf_deltas=leaf_deltas, starts=starts, stops=stops)


def pieces_from_proto(msg: pb.Pieces, world_size: int) -> Ranks:
    """Per rank, its ``(leaf, start, stop)`` pieces."""
    if len(msg.rank_counts) != world_size:
        raise WireError(f"pieces: {len(msg.rank_counts)} ranks, expected {world_size}")
    total = sum(msg.rank_counts)
    if not len(msg.leaf_deltas) == len(msg.starts) == len(msg.stops) == total:
        raise WireError(
            f"pieces: rank_counts add up to {total} but there are {len(msg.leaf_deltas)} "
            f"leaves, {len(msg.starts)} starts and {len(msg.stops)} stops"
        )
    # numpy reads packed repeated fields at C speed; list() would not.
    deltas = np.array(msg.leaf_deltas, dtype=np.int64)
    starts = np.array(msg.starts, dtype=np.uint64).tolist()
    stops = np.array(msg.stops, dtype=np.uint64).tolist()
    ranks: Ranks = []
    i = 0
    for count in msg.rank_counts:
        j = i + count
        leaves = np.cumsum(deltas[i:j]).tolist()
        ranks.append(list(zip(leaves, starts[i:j], stops[i:j], strict=True)))
        i = j
    return ranks


def stats_to_proto(plan: Plan) -> pb.PlanStats:
    s = plan.stats
    return pb.PlanStats(
        makespan=s.makespan,
        lower_bound=s.lower_bound,
        gap=s.gap,
        pieces=s.pieces,
        splits=s.splits,
        writers=s.writers,
        max_rank_bytes=s.max_rank_bytes,
        plan_ms=s.plan_ms,
        source=s.source,
    )


def plan_to_response(plan: Plan) -> pb.PlanResponse:
    return pb.PlanResponse(
        status=pb.PLAN_STATUS_OK,
        plan_fingerprint=plan.fingerprint,
        manifest_fingerprint=plan.manifest.fingerprint,
        world_size=plan.world_size,
        algorithm=plan.algorithm,
        pieces=pieces_to_proto(plan),
        stats=stats_to_proto(plan),
        planner_version=PLANNER_VERSION,
        cost=cost_to_proto(plan.cost),
        topology=topology_to_proto(plan.topology),
    )


def plan_from_response(
    msg: pb.PlanResponse,
    manifest: Manifest,
    *,
    algorithm: str,
    cost: CostModel | None,
    topology: Topology | None,
) -> Plan:
    """Rebuilds a received plan with ``Plan.from_pieces``, which validates every piece
    and recomputes the stats and the fingerprint (the caller compares it)."""
    ranks = pieces_from_proto(msg.pieces, msg.world_size)
    return Plan.from_pieces(
        manifest,
        msg.world_size,
        ranks,
        algorithm=algorithm,
        cost=cost,
        topology=topology,
        plan_ms=msg.stats.plan_ms,
    )
