"""A rank's own structure is described once while it is unchanged
(deeppart.saving.own_structure, issue 46): a save of the same structure
does not expand its DTensors again, puts this save's values in, and every
change that the description depends on describes afresh. Real DTensors on
a one-rank gloo process group."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import deeppart  # noqa: E402
from deeppart.errors import StateError  # noqa: E402
from deeppart.saving import own_structure  # noqa: E402
from deeppart.state.state import flatten  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    own_structure.forget()
    yield
    own_structure.forget()


@pytest.fixture
def expansions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per full description (a call of expand)."""
    from deeppart.state.dtensor import expand as inner

    calls: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(own_structure, "expand", counted)
    return calls


def describe(state: Any) -> tuple[Any, list[Any]]:
    flat, skeleton = flatten(state)
    return own_structure.describe(flat, skeleton, [], "none", "none", 0, 1)


def plain_state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(3, 4, generator=g),
        "layers": [torch.randn(2, generator=g), torch.randn(5, generator=g)],
        "step": 10 + seed % 10,  # an encoded plain value of the same length
    }


def test_the_same_structure_is_described_once_with_this_saves_values(
    expansions: list[int],
) -> None:
    first, _ = describe(plain_state(1))
    state = plain_state(2)
    again, leaves = describe(state)
    assert len(expansions) == 1 and again is first
    by_path = {lf.path: lf for lf in leaves}
    assert set(by_path) == {("w",), ("layers", 0), ("layers", 1), ("step",)}
    # This save's tensors and values, not the first's.
    assert by_path[("w",)].tensor is state["w"]
    assert by_path[("layers", 1)].tensor is state["layers"][1]
    assert by_path[("step",)].encoded == b"12"


@pytest.mark.parametrize(
    "change",
    ["dtype", "shape", "new leaf", "plain length", "container", "dims", "world"],
)
def test_every_change_it_depends_on_describes_afresh(expansions: list[int], change: str) -> None:
    state = plain_state(1)
    describe(state)
    flat_args: dict[str, Any] = {"dims": [], "world": 1}
    if change == "dtype":
        state["w"] = state["w"].double()
    elif change == "shape":
        state["w"] = state["w"].reshape(4, 3)
    elif change == "new leaf":
        state["layers"].append(torch.zeros(1))
    elif change == "plain length":
        state["step"] = 100
    elif change == "container":
        state["layers"] = tuple(state["layers"])  # the same paths, another skeleton
    elif change == "dims":
        flat_args["dims"] = ["dp"]
    else:
        flat_args["world"] = 2
    flat, skeleton = flatten(state)
    struct, _ = own_structure.describe(
        flat, skeleton, flat_args["dims"], "none", "none", 0, flat_args["world"]
    )
    assert len(expansions) == 2, change
    assert struct.skeleton_in == skeleton


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = f"file://{tmp_path_factory.mktemp('pg') / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def sharded(values: Any, placements: Any = None, names: tuple[str, ...] = ("dp",)) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=names)
    return distribute_tensor(values, mesh, placements or [Shard(0)])


def test_a_dtensor_is_expanded_once_and_each_change_of_its_layout_again(
    gloo: None, expansions: list[int], tmp_path: Path
) -> None:
    from torch.distributed.tensor import DTensor, Replicate

    w = sharded(torch.arange(12.0).reshape(3, 4))
    describe({"w": w})
    w2 = DTensor.from_local(torch.full((3, 4), 7.0), w.device_mesh, w.placements)
    _, leaves = describe({"w": w2})
    assert len(expansions) == 1
    assert torch.equal(leaves[0].tensor, torch.full((3, 4), 7.0))  # this save's local shard
    # Other placements, another mesh: described afresh.
    describe({"w": DTensor.from_local(torch.ones(3, 4), w.device_mesh, [Replicate()])})
    assert len(expansions) == 2
    describe({"w": sharded(torch.ones(3, 4), names=("fsdp",))})
    assert len(expansions) == 3
    # Saved twice through deeppart.save and loaded bitwise.
    deeppart.save({"w": w}, tmp_path / "a")
    deeppart.save({"w": w2}, tmp_path / "b")
    for name, want in (("a", w), ("b", w2)):
        got = deeppart.load(tmp_path / name)
        assert torch.equal(got["w"], want.to_local()), name


def test_a_local_shard_of_another_shape_than_described_is_named(
    gloo: None, expansions: list[int]
) -> None:
    from torch.distributed.tensor import DTensor

    w = sharded(torch.arange(12.0).reshape(3, 4))
    describe({"w": w})
    # The same global shape, placements and mesh; a local tensor of 2 rows.
    odd = DTensor.from_local(
        torch.zeros(2, 4), w.device_mesh, w.placements, shape=torch.Size((3, 4)), stride=(4, 1)
    )
    with pytest.raises(StateError, match="w: the DTensor's local tensor has shape"):
        describe({"w": odd})
    assert len(expansions) == 2  # sent down the full description, which names it


def test_a_kept_description_keeps_no_tensor_alive(tmp_path: Path) -> None:
    t = torch.randn(1000)
    deeppart.save({"t": t, "n": 3}, tmp_path / "ck")
    freed = weakref.ref(t)
    del t
    gc.collect()
    assert freed() is None
