"""Multi-rank checkpoint scenarios, run by tests/test_checkpoint_mpi.py as
``mpiexec -n K python tests/mpi_checkpoint.py SCENARIO DIR [ARGS]``.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass;
the test counts those lines. A failed check raises, so mpiexec exits
non-zero.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import deeppart
from deeppart import checkpoint as ck
from deeppart.comm import resolve


def make_state(seed: int = 0, steps: int = 2) -> dict[str, Any]:
    """A real model + AdamW state (identical on every rank for one seed),
    with a bfloat16 buffer, an int64 buffer, a non-contiguous tensor and
    plain values. Single-threaded, so the values do not depend on the
    number of threads of the calling process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _make_state(seed, steps)
    finally:
        torch.set_num_threads(threads)


def _make_state(seed: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0),
        num_layers=2,
        enable_nested_tensor=False,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 3, 32, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    extra = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extras": {
            "half": torch.randn(257, generator=gen).to(torch.bfloat16),
            "ids": torch.arange(1000, dtype=torch.int64),
            "strided": extra.t(),  # non-contiguous
            "empty": torch.empty(0, 3),
            "flags": torch.tensor([True, False, True]),
        },
        "step": steps,
        "meta": {"name": "test", "tuple": (1, 2.5, None), 3: b"\x00\x01"},
    }


def assert_bitwise_equal(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        same = a.dtype == b.dtype and a.shape == b.shape
        assert same, f"{where}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{where}: values differ"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), where
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}/{i}")
    else:
        assert type(a) is type(b) and (a == b or (a != a and b != b)), f"{where}: {a!r} != {b!r}"


def ok(name: str) -> None:
    c = resolve()
    print(f"OK {name} rank {c.rank}/{c.size}", flush=True)


def scenario_roundtrip(d: Path, codec: str | None) -> None:
    state = make_state()
    stats = deeppart.save(state, d, compression=codec)
    assert stats.raw_bytes > 0
    out = deeppart.load(d)
    assert_bitwise_equal(state, out)
    # into=: in place, same tensor objects.
    into = make_state(seed=1)
    tensors = [(k, v, v.data_ptr()) for k, v in into["model"].items()]
    res = deeppart.load(d, into=into)
    for k, v, ptr in tensors:
        assert res["model"][k] is v and v.data_ptr() == ptr, k
        assert torch.equal(v, state["model"][k]), k
    assert_bitwise_equal(state, res)
    ok("roundtrip")


def scenario_save(d: Path, codec: str | None) -> None:
    deeppart.save(make_state(), d, compression=codec)
    ok("save")


def scenario_load(d: Path) -> None:
    out = deeppart.load(d, exchange="bcast")
    assert_bitwise_equal(make_state(), out)
    out = deeppart.load(d, exchange="read")
    assert_bitwise_equal(make_state(), out)
    ok("load")


def scenario_corrupt(d: Path, expect: str) -> None:
    """Loading a damaged checkpoint raises on every rank, naming ``expect``."""
    try:
        deeppart.load(d)
    except deeppart.CorruptCheckpointError as e:
        assert expect in str(e), e
        ok("corrupt")
        return
    raise AssertionError("no error raised")


def scenario_mismatch(d: Path) -> None:
    c = resolve()
    state = make_state()
    if c.rank == c.size - 1:
        state["extras"]["surprise"] = torch.zeros(3)
    try:
        deeppart.save(state, d)
    except deeppart.StateMismatchError as e:
        assert "disagree" in str(e), e
        assert not d.exists(), "nothing may be written"
        ok("mismatch")
        return
    raise AssertionError("no error raised")


def scenario_nonplain(d: Path) -> None:
    c = resolve()
    state = make_state()
    if c.rank == 0:  # only one rank holds the bad object: still no hang
        state["meta"]["bad"] = object()
    try:
        deeppart.save(state, d)
    except deeppart.StateError as e:
        assert "meta/bad" in str(e), e
        ok("nonplain")
        return
    raise AssertionError("no error raised")


def scenario_crash(root: Path) -> None:
    """Step 1 commits; during step 2 the last rank SIGKILLs itself after
    writing part of its data."""
    c = resolve()
    cp = deeppart.Checkpointer(root, keep_last=2)
    cp.save(1, make_state())
    ok("crash-step1")
    if c.rank == c.size - 1:
        real = ck._write_pieces

        def dying(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        ck._write_pieces = dying
    cp.save(2, make_state(steps=3))
    raise AssertionError("unreachable: a rank was killed")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("dir", type=Path)
    p.add_argument("--codec", default=None)
    p.add_argument("--expect", default="")
    p.add_argument("--max-message", type=int, default=0, help="chunk size of broadcasts")
    args = p.parse_args()
    scenarios: dict[str, Callable[[], None]] = {
        "roundtrip": lambda: scenario_roundtrip(args.dir, args.codec),
        "save": lambda: scenario_save(args.dir, args.codec),
        "load": lambda: scenario_load(args.dir),
        "corrupt": lambda: scenario_corrupt(args.dir, args.expect),
        "mismatch": lambda: scenario_mismatch(args.dir),
        "nonplain": lambda: scenario_nonplain(args.dir),
        "crash": lambda: scenario_crash(args.dir),
    }
    torch.set_num_threads(1)
    if args.max_message:
        import deeppart.comm

        deeppart.comm.MAX_MESSAGE = args.max_message
    scenarios[args.scenario]()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
