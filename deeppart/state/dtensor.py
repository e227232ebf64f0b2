"""DTensors in a saved state: each one becomes shard leaves with holders.

A ``torch.distributed.tensor.DTensor`` (FSDP2, HSDP, tensor or expert
parallelism; any ``DeviceMesh`` and any ``Shard``/``_StridedShard``/
``Replicate`` placements, uneven shards included) is one leaf of the user's
tree but is held as a different local shard on each rank. :func:`expand`
turns it into one planner leaf per *distinct* region of the global tensor
(``path + ("<shard>", k)``), held by the ranks whose local shards cover that
region: the *holders*, derived from the mesh and the placements alone (no
data is hashed). Every rank derives the same leaves and regions, so the
manifest and the plan stay identical on all ranks; a rank contributes the
bytes of the shards it holds, and the plan gives each shard's bytes to its
holders only. The regions go into ``metadata.json``'s ``dtensors`` records
(:mod:`deeppart.regions`), which :mod:`deeppart.loading.reshard` reads on load.

torch is only imported when a state holds a DTensor.
"""

from __future__ import annotations

import itertools
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from deeppart.errors import StateError
from deeppart.regions import SHARD_KEY, DTensorRecord, Region, ShardRecord, placement_region
from deeppart.state.state import FlatLeaf, describe_leaf, is_dtensor

__all__ = [
    "Expanded",
    "HolderGroups",
    "Layout",
    "expand",
    "forget_layouts",
    "holder_layout",
    "holder_regions",
    "is_dtensor",
    "layout_regions",
    "local_region",
    "local_tensor",
    "mesh_identity",
    "mesh_regions",
    "renumber_skeleton",
]


def _where(path: Sequence[Any]) -> str:
    return "/".join(map(str, path))


def _placement_specs(placements: Any) -> tuple[tuple[int, int] | None, ...]:
    """``placements`` as :func:`deeppart.regions.placement_region` takes
    them: ``(dim, split_factor)`` per Shard / _StridedShard, else None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[tuple[int, int] | None] = []
    for p in placements:
        if isinstance(p, _StridedShard):
            sf = p._split_factor_int() if hasattr(p, "_split_factor_int") else p.split_factor
            out.append((int(p.dim), int(sf)))
        elif isinstance(p, Shard):
            out.append((int(p.dim), 1))
        else:
            out.append(None)
    return tuple(out)


def _region_at(
    shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int], placements: Any
) -> Region:
    """The region of the global tensor that the rank at mesh coordinate
    ``coord`` holds: torch's per-dimension shard arithmetic
    (``_get_shard_size_and_offsets``) done on runs of indices, in O(runs)
    rather than O(rows), exact for ``_StridedShard``'s interleaved rows
    (tests/base/test_regions_fast.py checks it against torch's)."""
    return placement_region(shape, mesh_shape, coord, _placement_specs(placements))


#: Regions of a layout (mesh ranks, which of its dimensions the DTensor's
#: mesh spans, placements, global shape), unchanged between saves.
_LAYOUTS: OrderedDict[tuple[Any, ...], list[tuple[Region, list[int]]]] = OrderedDict()
_LAYOUT_CACHE = 4096
#: Per (global shape, sharded mesh shape, placements): the regions the
#: placements make, whatever the mesh's ranks (:func:`_placed_regions`).
_REGIONS: OrderedDict[tuple[Any, ...], list[tuple[tuple[int, ...], Region]]] = OrderedDict()
#: Per device mesh object (by id): a weak reference to it, its ranks as
#: nested tuples (a cache key), and numpy; its :func:`mesh_identity` once
#: asked for. Weak: a torch DeviceMesh holds
#: its process groups, and a mesh kept here would keep them past the user's
#: destroy_process_group() into the interpreter's teardown, where a gloo
#: group's destruction can abort the process ("terminate called without an
#: active exception") after the program has finished.
_MESHES: dict[int, list[Any]] = {}


def forget_layouts() -> None:
    """Drops the cached layouts' regions (the next expansion computes them
    afresh, as a new process does: ``bench/exchange.py`` times a first save
    so)."""
    _LAYOUTS.clear()
    _REGIONS.clear()


def _forget_mesh(key: int, ref: weakref.ref[Any]) -> None:
    """A cached mesh was freed: its entry goes (unless replaced since)."""
    hit = _MESHES.get(key)
    if hit is not None and hit[0] is ref:
        _MESHES.pop(key, None)  # another thread may have cleared the cache


def _mesh_entry(mesh: Any) -> list[Any]:
    """``mesh``'s cache entry: ``[weak ref, ranks key, ranks, identity]``
    (cached per live mesh object; meshes live as long as the model, so few
    are held)."""
    hit = _MESHES.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit
    arr = mesh.mesh.cpu().numpy().astype("int64")
    key = (arr.shape, tuple(arr.reshape(-1).tolist()))
    if len(_MESHES) > 256:
        _MESHES.clear()
    mesh_id = id(mesh)
    ref = weakref.ref(mesh, lambda r: _forget_mesh(mesh_id, r))
    entry = [ref, key, arr, None]
    _MESHES[mesh_id] = entry
    return entry


def _mesh_ranks(mesh: Any) -> tuple[tuple[Any, ...], Any]:
    """``mesh``'s ranks as a hashable key and as a numpy array."""
    entry = _mesh_entry(mesh)
    return entry[1], entry[2]


def mesh_identity(mesh: Any) -> tuple[Any, ...]:
    """Everything of ``mesh`` that a DTensor's shards, holders and local
    region depend on, hashable: its ranks and dimension names, its root
    mesh's (the widening by ``replica_dims``), this rank's coordinate.
    Cached per live mesh object, so that a save whose structure is
    unchanged compares meshes in O(1) (:mod:`deeppart.saving.own_structure`)."""
    entry = _mesh_entry(mesh)
    if entry[3] is None:
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        root_part = None if root is mesh else (_mesh_ranks(root)[0], root.mesh_dim_names)
        coord = mesh.get_coordinate()
        at = None if coord is None else tuple(coord)
        entry[3] = (entry[1], mesh.mesh_dim_names, root_part, at)
    return cast("tuple[Any, ...]", entry[3])


def _check_placements(dt: Any, path: Sequence[Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for p in dt.placements:
        # _StridedShard (FSDP2 over TP) is no Shard subclass in torch 2.15.
        if not isinstance(p, Shard | _StridedShard | Replicate):
            raise StateError(
                f"{_where(path)}: a DTensor with placement {p} (a pending reduction) cannot be "
                "saved; call .redistribute(placements=[Replicate()] * mesh.ndim) or "
                ".full_tensor() on it first, or save the state get_state_dict() returns"
            )


def _root_view(dt: Any, path: Sequence[Any]) -> tuple[Any, list[int]]:
    """The mesh of all replicas of ``dt`` (its device mesh's root, e.g. the
    (dp, tp) mesh of a DTensor on ``mesh["tp"]``) and which of its
    dimensions ``dt``'s mesh spans."""
    mesh = dt.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    if root is mesh or root.mesh.numel() == mesh.mesh.numel():
        return mesh, list(range(mesh.ndim))
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        raise StateError(
            f"{_where(path)}: the DTensor's mesh is a flattened or unnamed part of a larger "
            "mesh, whose replicas cannot be told from its placements; save it from a mesh "
            "whose dimensions are named dimensions of the root mesh"
        )
    return root, [root_names.index(n) for n in names]


def mesh_regions(dt: Any, path: Sequence[Any] = ()) -> list[tuple[Region, list[int]]]:
    """Every distinct region of ``dt``'s global tensor held on its mesh (the
    root mesh, for a DTensor on a sub-mesh), with its holders (the sorted
    global ranks whose local shards are exactly that region), in the order
    of their lowest holder. Empty regions are left out (all of them but one
    for an empty tensor). O(shards): one region per coordinate of the
    sharded mesh dimensions, the replicated ones giving the holders; cached
    per layout."""
    _check_placements(dt, path)
    root, dims = _root_view(dt, path)
    key_ranks, ranks = _mesh_ranks(root)
    return layout_regions(key_ranks, ranks, dims, _placement_specs(dt.placements), dt.shape)


def layout_regions(
    key_ranks: tuple[Any, ...], ranks: Any, dims: Sequence[int], specs: Any, shape: Any
) -> list[tuple[Region, list[int]]]:
    """The regions of a tensor of ``shape`` with placements ``specs`` on the
    mesh whose ranks are ``ranks`` (numpy; ``key_ranks`` its cache key), of
    which the DTensor's mesh spans ``dims``, with their holders (see
    :func:`mesh_regions`); cached per layout: the list and its holders
    lists are the cache's, shared by every caller (read them, never change
    them; :meth:`HolderGroups.field` recognises shared holders lists by
    identity)."""
    shape = tuple(int(n) for n in shape)
    key = (key_ranks, tuple(dims), specs, shape)
    hit = _LAYOUTS.get(key)
    if hit is not None:
        _LAYOUTS.move_to_end(key)
        return hit
    sub_shape = tuple(int(ranks.shape[d]) for d in dims)
    sharded = [m for m, p in enumerate(specs) if p is not None]
    found: dict[Region, list[int]] = {}
    for sc, region in _placed_regions(shape, sub_shape, specs):
        sel: list[Any] = [slice(None)] * ranks.ndim
        for m, c in zip(sharded, sc, strict=True):
            sel[dims[m]] = c
        found.setdefault(region, []).extend(ranks[tuple(sel)].reshape(-1).tolist())
    out = [(r, sorted(h)) for r, h in found.items()]
    nonempty = [x for x in out if x[0].numel]
    out = sorted(nonempty or out[:1], key=lambda x: x[1][0])
    _LAYOUTS[key] = out
    if len(_LAYOUTS) > _LAYOUT_CACHE:
        _LAYOUTS.popitem(last=False)
    return out


def _placed_regions(
    shape: tuple[int, ...], sub_shape: tuple[int, ...], specs: Any
) -> list[tuple[tuple[int, ...], Region]]:
    """Per coordinate of the sharded mesh dimensions (in
    :func:`itertools.product` order): the region that ``specs`` place
    there, cached by what determines it, not by the mesh's ranks (the
    stages of a pipeline lay out their tensors alike on meshes of their
    own ranks)."""
    key = (shape, sub_shape, specs)
    hit = _REGIONS.get(key)
    if hit is not None:
        _REGIONS.move_to_end(key)
        return hit
    sharded = [m for m, p in enumerate(specs) if p is not None]
    out: list[tuple[tuple[int, ...], Region]] = []
    for sc in itertools.product(*(range(sub_shape[m]) for m in sharded)):
        coord = [0] * len(sub_shape)
        for m, c in zip(sharded, sc, strict=True):
            coord[m] = c
        out.append((sc, placement_region(shape, list(sub_shape), coord, specs)))
    _REGIONS[key] = out
    if len(_REGIONS) > _LAYOUT_CACHE:
        _REGIONS.popitem(last=False)
    return out


def holder_regions(
    dt: Any, path: Sequence[Any] = (), replica_dims: Sequence[str] = ()
) -> tuple[list[tuple[Region, list[int]]], list[int]]:
    """Like :func:`mesh_regions`, over the DTensor's OWN mesh (a pipeline
    stage's ``dp`` sub-mesh holds only that stage's ranks), widened by the
    root-mesh dimensions named in ``replica_dims`` (declared replicas, e.g.
    ``"dp"`` for tensor-parallel shards replicated over data parallelism);
    also returns the sorted ranks of that mesh."""
    layout = holder_layout(dt, path, replica_dims)
    out = layout_regions(*layout)
    return out, sorted(layout[0][1])


#: What determines a DTensor's shards and their holders: its mesh's ranks
#: (as ``(shape, flat ranks)``, and as numpy), which dimensions of that
#: mesh the DTensor's placements run over, the placements
#: (:func:`_placement_specs`) and the global shape.
Layout = tuple[tuple[Any, ...], Any, list[int], tuple[tuple[int, int] | None, ...], tuple[int, ...]]


def holder_layout(dt: Any, path: Sequence[Any] = (), replica_dims: Sequence[str] = ()) -> Layout:
    """What determines ``dt``'s shards and holders as :func:`holder_regions`
    finds them (its own mesh, widened by ``replica_dims``): their regions
    are :func:`layout_regions` of it."""
    _check_placements(dt, path)
    mesh = dt.device_mesh
    key_ranks, ranks = _mesh_ranks(mesh)
    dims = list(range(mesh.ndim))
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    wide = [n for n in replica_dims if root_names and n in root_names and n not in (names or ())]
    if wide and root is not mesh:
        if not names or any(n not in root_names for n in names):
            raise StateError(
                f"{_where(path)}: replica_dims={list(replica_dims)}: the DTensor's mesh is a "
                "flattened or unnamed part of the root mesh; name its dimensions"
            )
        coord = root.get_coordinate()
        if coord is None:
            raise StateError(f"{_where(path)}: this rank is not in the DTensor's root mesh")
        keep = [d for d, n in enumerate(root_names) if n in names or n in wide]
        _, root_ranks = _mesh_ranks(root)
        ranks = root_ranks[tuple(slice(None) if d in keep else coord[d] for d in range(root.ndim))]
        key_ranks = (ranks.shape, tuple(ranks.reshape(-1).tolist()))
        dims = [keep.index(root_names.index(n)) for n in names]
    shape = tuple(int(n) for n in dt.shape)
    return key_ranks, ranks, dims, _placement_specs(dt.placements), shape


def local_region(dt: Any, path: Sequence[Any] = ()) -> Region:
    """The region of the global tensor this rank's local shard of ``dt`` holds."""
    _check_placements(dt, path)
    mesh = dt.device_mesh
    coord = mesh_identity(mesh)[3]  # this rank's coordinate, cached per mesh
    if coord is None:
        raise StateError(f"{_where(path)}: this rank is not in the DTensor's device mesh")
    _, ranks = _mesh_ranks(mesh)
    return placement_region(
        list(dt.shape), list(ranks.shape), coord, _placement_specs(dt.placements)
    )


@dataclass
class Expanded:
    """A flattened state with its DTensors turned into shard leaves."""

    leaves: list[FlatLeaf]
    #: The manifest descriptions of ``leaves`` (shards with their holders).
    descs: list[dict[str, Any]]
    #: The skeleton, renumbered: a DTensor's node names its first shard leaf.
    skeleton: Any
    records: list[DTensorRecord]
    #: The holder groups that ``descs`` index (``Manifest.from_leaves``).
    groups: list[list[int]] = field(default_factory=list)
    #: Per record: the sorted ranks of the mesh that holds it.
    ranks: list[list[int]] = field(default_factory=list)
    #: Per record: the layout its shards come from (:func:`holder_layout`;
    #: None when the holders come from the root mesh, ``replica_dims=None``).
    layouts: list[Layout | None] = field(default_factory=list)
    #: Per leaf of ``leaves``: the index of the flattened leaf it comes from
    #: (a DTensor's shard leaves all name the DTensor's).
    origin: list[int] = field(default_factory=list)


class HolderGroups:
    """The holder groups of a manifest (issue 22): each distinct set of
    holders once, in the order first met."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.groups: list[list[int]] = []
        self._index: dict[tuple[int, ...], int] = {}
        self._every = list(range(world))
        #: The field of each holders list met, by identity (the shards of
        #: one decoded layout share their lists), with the list kept alive.
        self._seen: dict[int, tuple[list[int], dict[str, Any]]] = {}

    def field(self, holders: list[int]) -> dict[str, Any]:
        """How a leaf held by ``holders`` is described to the planner:
        nothing (every rank), ``owner`` (one rank) or ``holders`` (a group).
        The same dict for the same list object (known by identity: a list
        passed here must not change while this object lives): read it,
        never change it."""
        hit = self._seen.get(id(holders))
        if hit is not None and hit[0] is holders:
            return hit[1]
        out: dict[str, Any]
        if len(holders) == self.world and holders == self._every:
            out = {}
        elif len(holders) == 1:
            out = {"owner": holders[0]}
        else:
            key = tuple(holders)
            if key not in self._index:
                self._index[key] = len(self.groups)
                self.groups.append(list(holders))
            out = {"holders": self._index[key]}
        self._seen[id(holders)] = (holders, out)
        return out


def local_tensor(dt: Any) -> Any:
    """A DTensor's local tensor (its shard's storage): torch's
    ``_local_tensor`` where the DTensor has it, which ``to_local()``
    returns a view of through an autograd function (called per DTensor
    per save), else ``to_local()``."""
    local = getattr(dt, "_local_tensor", None)
    return local if local is not None else dt.to_local()


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def expand(
    leaves: list[FlatLeaf], skeleton: Any, replica_dims: Sequence[str] | None = None
) -> Expanded:
    """``leaves`` and ``skeleton`` (from :func:`deeppart.state.state.flatten`) with
    each DTensor leaf replaced by its shard leaves: on this rank a shard leaf
    holds the local tensor where this rank is a holder, else nothing.

    ``replica_dims``: None: the holders come from the root mesh (every
    rank describes every holder alike; the levels backends' view); a
    sequence (possibly empty): from the DTensor's own mesh, widened by these
    root-mesh dimensions (:func:`holder_regions`; the union model of
    :mod:`deeppart.state.union`)."""
    if not any(lf.tensor is not None and is_dtensor(lf.tensor) for lf in leaves):
        plain = [describe_leaf(lf) for lf in leaves]
        return Expanded(leaves, plain, skeleton, [], origin=list(range(len(leaves))))
    out: list[FlatLeaf] = []
    descs: list[dict[str, Any]] = []
    records: list[DTensorRecord] = []
    groups = HolderGroups(_world())
    renumber: list[int] = []
    mesh_ranks: list[list[int]] = []
    layouts: list[Layout | None] = []
    origin: list[int] = []
    per_layout: dict[int, tuple[Any, dict[Region, int], list[list[int]]]] = {}
    for i, lf in enumerate(leaves):
        renumber.append(len(out))
        dt = lf.tensor
        if dt is None or not is_dtensor(dt):
            origin.append(i)
            out.append(lf)
            descs.append(describe_leaf(lf))
            continue
        if replica_dims is None:
            regions = mesh_regions(dt, lf.path)
            mesh_ranks.append(sorted({r for _, h in regions for r in h}))
            layouts.append(None)
        else:
            layout = holder_layout(dt, lf.path, replica_dims)
            regions = layout_regions(*layout)
            mesh_ranks.append(sorted(layout[0][1]))
            layouts.append(layout)
        mine = local_region(dt, lf.path)
        local = local_tensor(dt)
        if tuple(local.shape) != mine.shape:
            raise StateError(
                f"{_where(lf.path)}: the DTensor's local tensor has shape {list(local.shape)}, "
                f"its placements give {list(mine.shape)}; save DTensors as FSDP2/"
                "parallelize_module/get_state_dict make them"
            )
        dtype = str(dt.dtype).removeprefix("torch.")
        shards: list[ShardRecord] = []
        # Per layout (its regions list, shared by its DTensors): each
        # region's position and shape, found once.
        known = per_layout.get(id(regions))
        if known is None or known[0] is not regions:
            position = {region: k for k, (region, _) in enumerate(regions)}
            known = (regions, position, [list(region.shape) for region, _ in regions])
            per_layout[id(regions)] = known
        own_shard = known[1].get(mine)
        shapes = known[2]
        for k, (region, holders) in enumerate(regions):
            path = (*lf.path, SHARD_KEY, k)
            origin.append(i)
            out.append(FlatLeaf(path, local if k == own_shard else None, None))
            descs.append(
                {
                    "path": list(path),
                    "dtype": dtype,
                    "shape": shapes[k],
                    **groups.field(holders),
                }
            )
            shards.append(ShardRecord(len(out) - 1, region))
        records.append(DTensorRecord(list(lf.path), dtype, list(dt.shape), shards))
    return Expanded(
        out,
        descs,
        renumber_skeleton(skeleton, renumber),
        records,
        groups.groups,
        mesh_ranks,
        layouts,
        origin,
    )


def renumber_skeleton(node: Any, new: list[int]) -> Any:
    """``node`` with every leaf index ``i`` replaced by ``new[i]``."""
    if isinstance(node, dict):
        ((kind, body),) = node.items()
        if kind in ("leaf", "ndarray"):
            return {kind: new[body]}
        if kind in ("dict", "odict"):
            return {kind: [[k, renumber_skeleton(v, new)] for k, v in body]}
        return {kind: [renumber_skeleton(v, new) for v in body]}
    return node
