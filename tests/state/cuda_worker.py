"""One process of the CUDA tests (tests/state/test_cuda.py), run alone or under
``python -m torch.distributed.run --nproc-per-node N --standalone``:

    python tests/state/cuda_worker.py SCENARIO DIR

- ``nccl``: joins an NCCL process group (one GPU per rank, so N is at most
  the GPU count) and saves and loads CUDA state with no ``comm=``: every
  collective of :class:`deeppart.comm.TorchDistComm` is staged through CUDA
  tensors.
- ``gloo-cuda``: joins a gloo group (any N on one GPU) and saves and loads
  CUDA state: the pieces of every rank pass through the host staging buffer.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))

from rank_output import print_line

import deeppart
from deeppart.comm import TorchDistComm, resolve


def cuda_state(seed: int) -> dict[str, object]:
    """A small model + AdamW state on the GPU, after two steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(3000, 64), torch.nn.Linear(64, 257), torch.nn.LayerNorm(257)
    ).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randint(0, 3000, (8, 5), device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2}


def tensors(tree: object) -> list[torch.Tensor]:
    """Every tensor of a state tree, in a fixed order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in tensors(v)]
    return []


def main() -> None:
    scenario, directory = sys.argv[1], Path(sys.argv[2])
    backend = "nccl" if scenario == "nccl" else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(backend)
    comm = resolve()
    assert isinstance(comm, TorchDistComm) and comm.backend == backend, comm
    rank, size = comm.rank, comm.size

    state = cuda_state(seed=7)
    stats = deeppart.save(state, directory, writing=deeppart.WriteOptions(staging_bytes=1 << 16))
    assert stats.raw_bytes > 0 and stats.world_size == size
    # Every rank loads into zeroed CUDA tensors of the same structure, in place.
    target = cuda_state(seed=8)
    for t in tensors(target):
        t.zero_()
    out = deeppart.load(directory, into=target, loading=deeppart.LoadOptions(staging_bytes=1 << 16))
    for want, got, placed in zip(tensors(state), tensors(out), tensors(target), strict=True):
        assert got.device == want.device and got.data_ptr() == placed.data_ptr()
        assert torch.equal(want.reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8))
    plain = deeppart.load(directory)
    for want, got in zip(tensors(state), tensors(plain), strict=True):
        assert torch.equal(
            want.cpu().reshape(-1).view(torch.uint8), got.reshape(-1).view(torch.uint8)
        )
    dist.barrier()
    print_line(f"OK {scenario} rank {rank}/{size}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
