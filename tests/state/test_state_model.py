"""The union model's building (deeppart.state.union), single process: synthetic
descriptions of several ranks, as the save's exchange delivers them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest

from deeppart.errors import ReplicaMismatchError, StateMismatchError
from deeppart.state.union import (
    VERSION_KEY,
    Described,
    Digests,
    build_union,
    whole_digests_needed,
)


def _skeleton(paths: list[list[Any]]) -> Any:
    """A dict skeleton of leaves at one-level or two-level paths."""
    tree: dict[str, Any] = {}
    for i, p in enumerate(paths):
        node = tree
        for k in p[:-1]:
            node = node.setdefault(k, {})
        node[p[-1]] = {"leaf": i}

    def to_skel(node: Any) -> Any:
        if "leaf" in node and isinstance(node["leaf"], int):
            return node
        return {"dict": [[k, to_skel(v)] for k, v in node.items()]}

    return to_skel(tree)


def plain(paths: list[tuple[list[Any], Any]]) -> Described:
    """A rank holding plain leaves: (path, "object" | (dtype, shape))."""
    descs = []
    for p, what in paths:
        if what == "object":
            descs.append({"path": p, "kind": "object", "nbytes": 3})
        else:
            descs.append({"path": p, "dtype": what[0], "shape": list(what[1])})
    return Described(descs, _skeleton([p for p, _ in paths]), [], "c")


def sharded(
    path: list[Any], rows: int, holders: list[list[int]], extra: Sequence[list[Any]] = ()
) -> Described:
    """A rank holding one DTensor of ``rows`` float32 rows, sharded by rows
    over ``len(holders)`` shards (shard k held by ``holders[k]``), plus
    plain values at ``extra`` paths."""
    n = len(holders)
    step = rows // n
    descs: list[dict[str, Any]] = []
    shards = []
    for k, h in enumerate(holders):
        region = [[[k * step, (k + 1) * step]], [[0, 4]]]
        descs.append(
            {"path": [*path, "<shard>", k], "dtype": "float32", "shape": [step, 4], "holders": h}
        )
        shards.append([k, region])
    ranks = sorted({r for h in holders for r in h})
    rec = {"path": path, "dtype": "float32", "shape": [rows, 4], "ranks": ranks, "shards": shards}
    paths = [path]
    for e in extra:
        descs.append({"path": e, "kind": "object", "nbytes": 3})
        paths.append(e)
    skel = _skeleton(paths)
    # The DTensor's node names its first shard leaf; extras follow the shards.
    skel = _renumber(skel, {0: 0, **{i: n - 1 + i for i in range(1, len(paths))}})
    return Described(descs, skel, [rec], "c")


def _renumber(node: Any, new: dict[int, int]) -> Any:
    ((kind, body),) = node.items()
    if kind == "leaf":
        return {"leaf": new[body]}
    return {kind: [[k, _renumber(v, new)] for k, v in body]}


def test_per_rank_values_are_versions_and_equal_values_share_one() -> None:
    st = plain([(["loader", "pos"], "object"), (["w"], ("float32", [2]))])
    classes = [0, 0, 0, 0]
    digests = [Digests({0: v}, {1: "s"}) for v in ("a", "b", "a", "c")]
    u = build_union({0: st}, classes, digests)
    paths = [it.path for it in u.items]
    assert paths == [
        ["loader", "pos", VERSION_KEY, 0],
        ["loader", "pos", VERSION_KEY, 1],
        ["loader", "pos", VERSION_KEY, 2],
        ["w"],
    ]
    assert [it.holders for it in u.items] == [[0, 2], [1], [3], [0, 1, 2, 3]]
    assert u.versions == [
        {"path": ["loader", "pos"], "ranks": [[0, 2], [1], [3]], "leaves": [0, 1, 2]}
    ]
    assert u.per_rank
    # Each holder's bytes come from its own local leaf.
    assert u.items[1].source == {1: 0}


def test_equal_values_make_no_versions() -> None:
    st = plain([(["x"], "object"), (["w"], ("float32", [2]))])
    u = build_union({0: st}, [0, 0, 0], [Digests({0: "a"}, {1: "s"})] * 3)
    assert [it.path for it in u.items] == [["x"], ["w"]]
    assert not u.versions and not u.per_rank


def test_pipeline_stages_with_their_own_names_are_the_union() -> None:
    a = sharded(["s0", "w"], 8, [[0], [1]])
    b = sharded(["s1", "w"], 8, [[2], [3]])
    classes = [0, 0, 2, 2]
    assert whole_digests_needed({0: a, 2: b}, classes) == []
    u = build_union({0: a, 2: b}, classes, [Digests() for _ in range(4)])
    assert [it.holders for it in u.items] == [[0], [1], [2], [3]]
    assert [r["ranks"] for r in u.records] == [[0, 1], [2, 3]]
    assert not u.versions and u.per_rank
    keys = [k for k, _ in u.skeleton["dict"]]
    assert keys == ["s0", "s1"]


def test_stages_that_reuse_names_and_differ_are_two_versions() -> None:
    a = sharded(["layers", "w"], 8, [[0], [1]])
    b = sharded(["layers", "w"], 8, [[2], [3]])
    states, classes = {0: a, 2: b}, [0, 0, 2, 2]
    need = whole_digests_needed(states, classes)
    assert need == [(0, 0), (1, 1), (2, 0), (3, 1)]
    whole = {(0, 0): "x0", (1, 1): "x1", (2, 0): "y0", (3, 1): "x1"}
    u = build_union(states, classes, [Digests() for _ in range(4)], whole)
    assert [it.path for it in u.items] == [
        ["layers", "w", VERSION_KEY, 0, "<shard>", 0],
        ["layers", "w", VERSION_KEY, 0, "<shard>", 1],
        ["layers", "w", VERSION_KEY, 1, "<shard>", 0],
        ["layers", "w", VERSION_KEY, 1, "<shard>", 1],
    ]
    assert u.versions == [
        {"path": ["layers", "w"], "ranks": [[0, 1], [2, 3]], "records": [0, 1], "leaves": [0, 2]}
    ]
    assert u.items[2].source == {2: 0}


def test_replicas_on_disjoint_meshes_with_equal_bytes_merge() -> None:
    a = sharded(["w"], 8, [[0], [1]])
    b = sharded(["w"], 8, [[2], [3]])
    whole = {(0, 0): "x0", (1, 1): "x1", (2, 0): "x0", (3, 1): "x1"}
    u = build_union({0: a, 2: b}, [0, 0, 2, 2], [Digests() for _ in range(4)], whole)
    assert [it.holders for it in u.items] == [[0, 2], [1, 3]]
    assert u.records[0]["ranks"] == [0, 1, 2, 3]
    assert not u.versions and not u.per_rank


def test_differing_declared_replicas_name_each_version() -> None:
    # HSDP: shard k held by ranks [k, k + 2] on one mesh; rank 3 differs.
    st = sharded(["w"], 8, [[0, 2], [1, 3]])
    digests = [Digests({}, {0: "p"}), Digests({}, {1: "q"}), Digests({}, {0: "p"}),
               Digests({}, {1: "other"})]  # fmt: skip
    with pytest.raises(ReplicaMismatchError) as e:
        build_union({0: st}, [0, 0, 0, 0], digests)
    assert "w: ranks [1] hold one version, ranks [3] another" in str(e.value)
    assert "majority" not in str(e.value) and "minority" not in str(e.value)


def test_plain_tensors_that_differ_are_each_ranks_own_or_refused_when_declared() -> None:
    """Issue 49: a plain tensor's holders are compared by the digests of
    their whole bytes (Digests.samples), whatever else the tree holds: equal
    copies share one item, differing ones are each their ranks' version;
    declared replicas (verify_replicas=True) are refused instead."""
    st = plain([(["emb"], ("float32", [4, 2]))])
    digests = [Digests({}, {0: s}) for s in ("a", "b", "a", "b")]
    u = build_union({0: st}, [0, 0, 0, 0], digests)
    assert [it.path for it in u.items] == [["emb", VERSION_KEY, 0], ["emb", VERSION_KEY, 1]]
    assert [it.holders for it in u.items] == [[0, 2], [1, 3]]
    assert u.versions[0]["ranks"] == [[0, 2], [1, 3]]
    with pytest.raises(
        ReplicaMismatchError, match=r"ranks \[0, 2\] hold one version, ranks \[1, 3\] another"
    ):
        build_union({0: st}, [0, 0, 0, 0], digests, declared=True)
    same = build_union({0: st}, [0, 0, 0, 0], [Digests({}, {0: "a"}) for _ in range(4)])
    assert [it.holders for it in same.items] == [[0, 1, 2, 3]] and not same.versions


def test_a_differing_tensor_is_kept_whatever_the_plain_values() -> None:
    """Issue 49, item 4: loader positions 100/101 (one structure) or 99/100
    (two: the encodings' sizes differ) give the same outcome for a tensor
    that differs: each rank's own version."""
    one = plain([(["w"], ("float32", [1024])), (["pos"], "object")])
    two = plain([(["w"], ("float32", [1024])), (["pos"], "object")])
    two.descs[1]["nbytes"] = 4
    tensors = [Digests({1: "p0"}, {0: "t0"}), Digests({1: "p1"}, {0: "t1"})]
    for states, classes in (({0: one}, [0, 0]), ({0: one, 1: two}, [0, 1])):
        assert whole_digests_needed(states, classes) == []
        u = build_union(states, classes, tensors)
        by_path = {json_path(it.path): it.holders for it in u.items}
        assert by_path["w/<version>/0"] == [0] and by_path["w/<version>/1"] == [1], by_path


def json_path(path: list[Any]) -> str:
    return "/".join(map(str, path))


def test_auto_keeps_each_groups_version() -> None:
    st = plain([(["emb"], ("float32", [4, 2]))])
    classes = [0, 0, 0, 0]
    assert whole_digests_needed({0: st}, classes, auto=True) == []
    digests = [Digests({}, {0: g}) for g in ("g0", "g0", "g1", "g1")]
    u = build_union({0: st}, classes, digests, auto=True)
    assert [it.holders for it in u.items] == [[0, 1], [2, 3]]
    assert u.versions[0]["ranks"] == [[0, 1], [2, 3]]


def test_plain_tensors_of_two_structures_compared_whole() -> None:
    a = plain([(["emb"], ("float32", [4, 2])), (["a"], "object")])
    b = plain([(["emb"], ("float32", [4, 2])), (["b"], "object")])
    states, classes = {0: a, 1: b}, [0, 1]
    assert whole_digests_needed(states, classes) == []
    digests = [Digests({1: "v"}, {0: "e"}), Digests({1: "v"}, {0: "e"})]
    same = build_union(states, classes, digests)
    assert [it.path for it in same.items] == [["emb"], ["a"], ["b"]]
    assert [it.holders for it in same.items] == [[0, 1], [0], [1]]
    digests[1] = Digests({1: "v"}, {0: "f"})
    differ = build_union(states, classes, digests)
    assert [it.path for it in differ.items][:2] == [
        ["emb", VERSION_KEY, 0],
        ["emb", VERSION_KEY, 1],
    ]


def test_trees_that_do_not_merge_are_refused_naming_the_path() -> None:
    a = plain([(["x"], "object")])
    b = Described(
        [{"path": ["x", "y"], "dtype": "float32", "shape": [1]}],
        {"dict": [["x", {"dict": [["y", {"leaf": 0}]]}]]},
        [],
        "c",
    )
    with pytest.raises(StateMismatchError, match="x: the ranks' state trees differ"):
        build_union({0: a, 1: b}, [0, 1], [Digests({0: "v"}), Digests()])


def test_codec_or_directory_disagreement_is_refused() -> None:
    a = plain([(["x"], "object")])
    b = plain([(["x"], "object")])
    b.common = "other"
    with pytest.raises(StateMismatchError, match="the codec, the directory or the kind of group="):
        build_union({0: a, 1: b}, [0, 1], [Digests({0: "v"}), Digests({0: "v"})])


def test_version_3_metadata_is_checked(tmp_path: Any) -> None:
    """parse_metadata accepts version 3 with its records and refuses
    malformed ones (CorruptCheckpointError), like every record it reads."""
    import json

    import deeppart
    from deeppart.errors import CorruptCheckpointError
    from deeppart.format import parse_metadata
    from deeppart.loading.reader import leaf_infos

    torch = pytest.importorskip("torch")
    deeppart.save({"w": torch.ones(2), "x": 1}, tmp_path / "c")
    raw = json.loads((tmp_path / "c" / "metadata.json").read_text())
    raw["leaves"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in lf.items() if v is not None}
        for lf in leaf_infos(raw)
    ]
    sizes = {"float32": 4}
    base = {**raw, "version": 3, "dtensors": [], "versions": []}
    assert parse_metadata(base, sizes).union
    bad = [
        {"path": ["x"], "ranks": [[0], [0]], "leaves": [1, 1]},  # 2 versions on 1 rank
        {"path": ["x"], "ranks": [[0]], "leaves": [9]},
        "nope",
    ]
    for rec in bad:
        with pytest.raises(CorruptCheckpointError):
            parse_metadata({**base, "versions": [rec]}, sizes)
    with pytest.raises(CorruptCheckpointError, match="version 3 goes with versions"):
        parse_metadata({**raw, "version": 3, "dtensors": []}, sizes)


# ----------------------------------------------------------------------------
# The exchange's encoding: DTensors by layout (issue 46).


def _by_layout(extra_before: int = 1) -> tuple[Described, list[Any]]:
    """A rank's description as the save makes it: ``extra_before`` plain
    values, a (4, 3) DTensor on the 2 x 2 mesh [[0, 1], [2, 3]], Shard(0)
    over the first mesh dimension and replicated over the second (shard 0
    held by ranks 0 and 1, shard 1 by ranks 2 and 3), a plain tensor after
    it; with the layout of its record."""
    import numpy as np

    from deeppart.state.dtensor import layout_regions

    mesh = np.array([[0, 1], [2, 3]], dtype=np.int64)
    layout = (((2, 2), (0, 1, 2, 3)), mesh, [0, 1], ((0, 1), None), (4, 3))
    descs: list[dict[str, Any]] = [
        {"path": ["v", i], "kind": "object", "nbytes": 3} for i in range(extra_before)
    ]
    shards = []
    for k, (region, holders) in enumerate(layout_regions(*layout)):
        shards.append([len(descs), region.to_json()])
        descs.append(
            {"path": ["w", "<shard>", k], "dtype": "float32", "shape": list(region.shape),
             "holders": holders}
        )  # fmt: skip
    descs.append({"path": ["t"], "dtype": "int64", "shape": []})
    rec = {"path": ["w"], "dtype": "float32", "shape": [4, 3], "ranks": [0, 1, 2, 3],
           "shards": shards}  # fmt: skip
    return Described(descs, {"list": []}, [rec], "c"), [layout]


@pytest.mark.parametrize("before", [0, 2])
def test_a_description_by_layout_decodes_to_the_same_description(before: int) -> None:
    import json

    from deeppart.state.union import decode_described, encode_described

    st, layouts = _by_layout(before)
    wire = json.loads(json.dumps(encode_described(st, layouts)))
    # The DTensor travels as one record and its layout, not its shards.
    assert len(wire["descs"]) == before + 1 and len(wire["records"]) == 1
    back = decode_described(wire)
    # A decoded shard's description names no path (its record does).
    shard_leaves = {leaf for rec in st.records for leaf, _ in rec["shards"]}
    assert [d for i, d in enumerate(back.descs) if i not in shard_leaves] == [
        d for i, d in enumerate(st.descs) if i not in shard_leaves
    ]
    assert [back.descs[i] for i in sorted(shard_leaves)] == [
        {k: v for k, v in st.descs[i].items() if k != "path"} for i in sorted(shard_leaves)
    ]
    # Each record also names its layout's shards (region, shape, holders), in
    # the order of its shards.
    assert [{k: v for k, v in r.items() if k != "layout"} for r in back.records] == st.records
    for r in back.records:
        assert [region for region, _, _ in r["layout"]] == [region for _, region in r["shards"]]
        assert [holders for _, _, holders in r["layout"]] == [
            back.descs[leaf]["holders"] for leaf, _ in r["shards"]
        ]
    assert (back.skeleton, back.common) == (st.skeleton, st.common)


def _exchange_of(
    shard_digests: list[bytes], values: list[bytes]
) -> tuple[Any, list[bytes], list[bytes]]:
    """Four ranks of one structure (:func:`_by_layout`), rank r holding its
    shard with digest ``shard_digests[r]`` and plain value digest
    ``values[r]``: the exchange's first round as every rank reads it, the
    ranks' first-agreement rows and their first-round payloads."""
    from deeppart.saving import prepare as p

    st, layouts = _by_layout(1)
    owns = []
    for r in range(4):
        held = 1 + (r // 2)  # shard 0 on ranks 0, 1; shard 1 on ranks 2, 3
        dig = Digests({0: values[r].hex()}, {held: shard_digests[r].hex(), 3: "ab" * 16})
        owns.append(p._Own(None, st, dig, b"", b"", None, "", {}, layouts))  # type: ignore[arg-type]
    rows = [b"S" * 32 + b"x" * 16 + values[r].ljust(16, b"\0") for r in range(4)]
    got = [p._payload(owns[r], rows, r, 0) for r in range(4)]
    return (p._read_exchange(got, rows, False), owns, rows), got, rows


def test_equal_replicas_of_a_shard_need_no_second_round() -> None:
    (ex, _, _), got, _ = _exchange_of([b"a" * 16] * 2 + [b"b" * 16] * 2, [b"v" * 8] * 4)
    assert not ex.second_round
    # Ranks 1 and 3 sent no digest of their shard: one digest of what they hold.
    assert len(got[1]) < len(got[2])
    assert [d.samples for d in ex.digests] == [
        {1: "61" * 16, 3: "ab" * 16}, {1: "61" * 16, 3: "ab" * 16},
        {2: "62" * 16, 3: "ab" * 16}, {2: "62" * 16, 3: "ab" * 16},
    ]  # fmt: skip
    u = build_union(ex.states, ex.classes, ex.digests)
    assert [it.holders for it in u.items if "<shard>" in it.path] == [[0, 1], [2, 3]]


def test_a_replica_that_differs_is_sent_again_and_refused() -> None:
    from deeppart.saving import prepare as p

    digests = [b"a" * 16, b"c" * 16, b"b" * 16, b"b" * 16]
    (ex, owns, _), _, _ = _exchange_of(digests, [b"v" * 8, b"v" * 8, b"w" * 8, b"v" * 8])
    # Rank 1's copy of shard 0 does not match rank 0's; rank 2's value differs.
    assert ex.unmatched == [1] and ex.values_differ == [2] and ex.second_round
    second = [p._second_payload(owns[r], r, ex) for r in range(4)]
    assert p._read_second(second, ex) == {}
    assert ex.digests[1].samples[1] == "63" * 16 and ex.digests[2].values[0] == "77" * 8
    with pytest.raises(ReplicaMismatchError, match=r"w: ranks \[0\] hold one version, ranks \[1\]"):
        build_union(ex.states, ex.classes, ex.digests)


def test_a_rank_failing_in_the_exchange_fails_every_rank() -> None:
    """A rank whose payload cannot be made still takes part in the round:
    it raises its own error, every other rank a CheckpointError naming it
    (none waits for it forever)."""
    from thread_comm import run_ranks, thread_comms

    from deeppart.errors import CheckpointError
    from deeppart.saving import prepare as p

    comms = thread_comms(3)

    def build(r: int) -> bytes:
        if r == 1:
            raise ValueError("no layout")
        return bytes([r])

    def one(r: int) -> Any:
        return lambda: p._exchange_round(comms[r], lambda: build(r))

    out = run_ranks([one(r) for r in range(3)])
    assert isinstance(out[1][1], ValueError)
    for r in (0, 2):
        err = out[r][1]
        assert isinstance(err, CheckpointError), err
        assert "ranks [1]" in str(err) and "no layout" in str(err)

    def round_of(r: int) -> Any:
        return p._exchange_round(comms[r], lambda: bytes([r]))

    ok = run_ranks([functools.partial(round_of, r) for r in range(3)])
    assert [x for x, _ in ok] == [[b"\0", b"\1", b"\2"]] * 3


def test_a_stage_s_own_dtensor_is_a_block_that_reads_as_its_items() -> None:
    """A DTensor whose holders are all of one class is one ShardBlock entry;
    its items, held leaves and empty leaves read as those of the shards one
    by one (a merged DTensor of two classes stays item by item)."""
    from deeppart.saving.union_cache import EmptyLeaves
    from deeppart.state.union import ShardBlock, UnionItem

    a = sharded(["s0", "w"], 8, [[0, 1], [1]], extra=[["s0", "x"]])
    b = sharded(["s1", "w"], 8, [[2], [3]])
    classes = [0, 0, 2, 2]
    u = build_union({0: a, 2: b}, classes, [Digests() for _ in range(4)])
    assert [type(e) for e in u.entries] == [ShardBlock, UnionItem, ShardBlock]
    assert len(u) == 5
    assert [it.path for it in u.items] == [
        ["s0", "w", "<shard>", 0], ["s0", "w", "<shard>", 1], ["s0", "x"],
        ["s1", "w", "<shard>", 0], ["s1", "w", "<shard>", 1],
    ]  # fmt: skip
    assert [it.holders for it in u.items] == [[0, 1], [1], [0, 1], [2], [3]]
    assert [it.source for it in u.items] == [{0: 0, 1: 0}, {1: 1}, {0: 2, 1: 2}, {2: 0}, {3: 1}]
    assert [it.desc for it in u.items][3] == {"dtype": "float32", "shape": [4, 4]}
    for rank in range(4):
        want = [(k, it.source[rank], it.holders) for k, it in enumerate(u.items)
                if rank in it.source]  # fmt: skip
        assert list(u.held(rank)) == want
    assert [u.record(i)["shards"][1]["leaf"] for i in range(2)] == [1, 4]
    assert [first for first, _ in u.record_shards] == [0, 3] and "shards" not in u.records[0]
    empty = EmptyLeaves(u.entries)
    paths = [tuple(it.path) for it in u.items]
    assert len(empty) == 5 and [empty[k].path for k in range(5)] == paths
    assert empty[-1].path == paths[-1] and [lf.path for lf in empty[1:3]] == paths[1:3]
    assert all(lf.tensor is None and lf.encoded is None for lf in empty)
    assert [lf.path for lf in empty] == paths  # the walked list, kept
    with pytest.raises(IndexError):
        empty[5]


def test_union_records_from_a_layout_are_those_of_its_shards() -> None:
    """The save's DTensor records and digest text made once per decoded
    layout are those made shard by shard, byte for byte (the save digest
    of every rank depends on it), and those of an undecoded union alike."""
    import json

    from deeppart.regions import Region, ShardRecord
    from deeppart.saving.own_structure import records_text
    from deeppart.saving.prepare import _union_records
    from deeppart.state.union import decode_described, encode_described

    st, layouts = _by_layout(2)
    back = decode_described(json.loads(json.dumps(encode_described(st, layouts))))
    # The union of the decoded description (its records by layout) is that
    # of the description it was made from.
    unions = [build_union({0: d}, [0, 0, 0, 0], [Digests() for _ in range(4)]) for d in (st, back)]
    a, b = ([(it.path, it.desc, it.holders, it.source) for it in x.items] for x in unions)
    assert a == b and len(a) == 5 and a[2][0] == ["w", "<shard>", 0]
    assert unions[0].skeleton == unions[1].skeleton and unions[0].records == unions[1].records
    for described in (back, st):
        u = build_union({0: described}, [0, 0, 0, 0], [Digests() for _ in range(4)])
        assert u.layouts == [back.records[0]["layout"] if described is back else None]
        records, text = _union_records(u)
        as_json = [
            {k: u.record(i)[k] for k in ("path", "dtype", "shape", "shards")}
            for i in range(len(u.records))
        ]
        assert text == records_text(as_json)
        assert text.decode().endswith("2=[[[0,2]],[[0,3]]]3=[[[2,4]],[[0,3]]]")
        ((rec,),) = [records]
        assert rec.shards == [
            ShardRecord(2, Region((((0, 2),), ((0, 3),)))),
            ShardRecord(3, Region((((2, 4),), ((0, 3),)))),
        ]


def test_a_value_alike_on_a_class_is_one_group_s_source() -> None:
    """A plain value (or tensor) that all of a class's ranks hold alike is
    sourced by one GroupLeaf, read as the dict of those ranks to its leaf,
    and its holders are the class's list, shared by the class's items."""
    from deeppart.state.union import GroupLeaf

    st = plain([(["lr"], "object"), (["step"], ("float32", [])), (["pos"], "object")])
    digests = [Digests({0: "a", 2: v}, {1: "s"}) for v in ("p", "p", "q", "p")]
    u = build_union({0: st}, [0, 0, 0, 0], digests)
    lr, step, pos0, pos1 = u.items
    assert isinstance(lr.source, GroupLeaf) and lr.source == {0: 0, 1: 0, 2: 0, 3: 0}
    assert lr.holders is step.holders and lr.holders == [0, 1, 2, 3]
    assert step.source == dict.fromkeys(range(4), 1)
    assert (lr.source.get(3), lr.source.get(4), 4 in lr.source, 2 in lr.source) == (
        0,
        None,
        False,
        True,
    )
    with pytest.raises(KeyError):
        lr.source[7]
    assert list(lr.source) == [0, 1, 2, 3] and len(lr.source) == 4
    # Ranks whose values differ: each version its own group.
    assert (pos0.holders, pos0.source, pos1.holders, pos1.source) == (
        [0, 1, 3],
        {0: 2, 1: 2, 3: 2},
        [2],
        {2: 2},
    )
    assert u.versions == [{"path": ["pos"], "ranks": [[0, 1, 3], [2]], "leaves": [2, 3]}]


def test_dtensor_records_text_is_that_of_their_json() -> None:
    """The own description's digest text made from its DTensor records is
    the text of their JSON, byte for byte (shared and distinct regions)."""
    from deeppart.regions import DTensorRecord, Region, ShardRecord
    from deeppart.saving.own_structure import dtensor_records_text, records_text

    a, b = Region((((0, 2),), ((0, 3),))), Region((((2, 4),), ((0, 3),)))
    records = [
        DTensorRecord(["w"], "float32", [4, 3], [ShardRecord(1, a), ShardRecord(2, b)]),
        DTensorRecord(["v", 0], "bfloat16", [4, 3], [ShardRecord(4, a), ShardRecord(5, b)]),
        DTensorRecord(["u"], "int8", [2, 3], [ShardRecord(6, Region((((0, 2),), ((0, 3),))))]),
    ]
    text = dtensor_records_text(records)
    assert text == records_text([r.to_json() for r in records])
    assert text.startswith(b'[["w"],"float32",[4,3],2]1=[[[0,2]],[[0,3]]]2=')
