"""One rank of the torch.distributed checkpoint tests (tests/base/test_torchdist.py
launches it under ``python -m torch.distributed.run --nproc-per-node N
--standalone``, or alone as one process without a process group):

    python tests/base/torchdist_worker.py SCENARIO DIR [--codec C] [--max-message B]

Under torchrun it joins a gloo process group and calls deeppart with no
``comm=``, so :func:`deeppart.comm.resolve` must pick torch.distributed's
default group. The checkpoint scenarios are those of the MPI tests
(tests/support/mpi_checkpoint.py); ``comm`` exercises every collective of
:class:`deeppart.comm.TorchDistComm` directly. Each rank prints ``OK
<scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mpi_checkpoint as sc

import deeppart.comm
from deeppart.comm import SingleComm, TorchDistComm, resolve


def scenario_comm() -> None:
    """Every Comm collective over the default group, checked on every rank."""
    c = resolve()
    assert isinstance(c, TorchDistComm), type(c)
    r, n = c.rank, c.size
    rows = c.allgather_bytes(bytes([r + 1]) * (r + 1), 8)
    assert rows == [bytes([k + 1]) * (k + 1) + b"\0" * (7 - k) for k in range(n)], rows
    f = c.allgather_f64(np.array([r, r * 2.5, -1.0]))
    assert f.shape == (n, 3) and f[:, 1].tolist() == [k * 2.5 for k in range(n)]
    v = c.allgather_varbytes(b"x" * (3 * r))
    assert v == [b"x" * (3 * k) for k in range(n)], v
    # Sums of int64 exact beyond float64's 53 bits, and negative ones.
    big = 2**60 + r
    s = c.allreduce_sum_i64(np.array([big, -r, 1], dtype=np.int64))
    tri = n * (n - 1) // 2
    assert s.dtype == np.int64 and s.tolist() == [n * 2**60 + tri, -tri, n], s
    counts = [k + 1 for k in range(n)]
    mine = np.arange(r + 1, dtype=np.uint64) + np.uint64(2**63 + 100 * r)  # high bit set
    got = c.gatherv_u64(mine, counts, root=n - 1)
    if r == n - 1:
        want = np.concatenate(
            [np.arange(k + 1, dtype=np.uint64) + np.uint64(2**63 + 100 * k) for k in range(n)]
        )
        assert got is not None and np.array_equal(got, want), got
    else:
        assert got is None
    size = 10_000 + 7
    buf = (np.arange(size) % 251).astype(np.uint8) if r == 1 % n else np.zeros(size, np.uint8)
    c.bcast_u8(buf, root=1 % n)
    assert np.array_equal(buf, (np.arange(size) % 251).astype(np.uint8))
    # A ring: each rank sends to the next one a message of its own length.
    nxt, prv = (r + 1) % n, (r - 1) % n
    send = np.full(3000 + 517 * r, r, dtype=np.uint8)
    recv = np.zeros(3000 + 517 * prv, dtype=np.uint8)
    c.sendrecv_u8(send, nxt, recv, prv)
    assert (recv == prv).all(), recv[:8]
    same = np.zeros_like(send)
    c.sendrecv_u8(send, r, same, r)
    assert np.array_equal(same, send)
    c.barrier()
    # Every collective returns only once gloo's workers dropped its tensors:
    # freed by a worker after the job's last collective, a tensor's Python
    # object took the GIL from a C++ thread during the interpreter's exit
    # (an abort after the job finished: tests/test_teardown.py). Without
    # _settle, about one broadcast in 20 returned with the tensor still held.
    handed: list[torch.Tensor] = []
    to_backend = c._dev

    def recording(arr: np.ndarray) -> torch.Tensor:
        handed.append(to_backend(arr))
        return handed[-1]

    c._dev = recording  # type: ignore[method-assign]
    held = 0
    for i in range(600):
        handed.clear()
        small = np.full(16, i % 251 if r == 0 else 0, dtype=np.uint8)
        c.bcast_u8(small, root=0)
        assert (small == i % 251).all()
        c.allgather_bytes(b"x", 4)
        c.start_bcast_u8(small, root=0).wait()
        held += sum(t._use_count() > 1 for t in handed)
    c._dev = to_backend  # type: ignore[method-assign]
    assert held == 0, f"{held} tensors still held by the backend after their collective"
    # resolve() forms: a ProcessGroup, "torch", an existing TorchDistComm.
    assert isinstance(resolve(dist.group.WORLD), TorchDistComm)
    assert resolve("torch").size == n and resolve(c) is c
    sc.ok("comm")


def torch_allreduce(t: torch.Tensor) -> None:
    dist.all_reduce(t.detach())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("dir", type=Path)
    p.add_argument("--codec", default=None)
    p.add_argument("--max-message", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.max_message:
        deeppart.comm.MAX_MESSAGE = args.max_message
    launched = "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
    if launched:
        dist.init_process_group("gloo")
        assert isinstance(resolve(), TorchDistComm), "resolve() must pick torch.distributed"
    else:
        assert isinstance(resolve(), SingleComm)
    scenarios: dict[str, Callable[[], None]] = {
        "roundtrip": lambda: sc.scenario_roundtrip(args.dir, args.codec),
        "save": lambda: sc.scenario_save(args.dir, args.codec),
        "load": lambda: sc.scenario_load(args.dir),
        "mismatch": lambda: sc.scenario_mismatch(args.dir),
        "nonplain": lambda: sc.scenario_nonplain(args.dir),
        "async": lambda: sc.scenario_async(args.dir, torch_allreduce if launched else _noop),
        "comm": scenario_comm,
    }
    try:
        scenarios[args.scenario]()
    finally:
        sys.stdout.flush()
        if launched:
            dist.barrier()  # no rank tears gloo down under another's last collective
            dist.destroy_process_group()


def _noop(t: torch.Tensor) -> None:
    return None


if __name__ == "__main__":
    sc.run_then_exit(main)
