"""Plan who writes what for a real model and its AdamW state.

    .venv/bin/python examples/plan_state_dict.py [WORLD_SIZE]

Walks ``{"model": ..., "optim": ...}`` into a manifest (no tensor data is
copied), plans it with the default algorithm and prints each rank's share.
"""

from __future__ import annotations

import sys

import torch

import deeppart


def main() -> None:
    world_size = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    model = torch.nn.Sequential(
        torch.nn.Embedding(32_000, 512),
        torch.nn.TransformerEncoderLayer(d_model=512, nhead=8, batch_first=True),
        torch.nn.Linear(512, 32_000),
    )
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 32_000, (2, 16))).sum().backward()
    opt.step()

    manifest = deeppart.Manifest.from_state_dict(
        {"model": model.state_dict(), "optim": opt.state_dict()}
    )
    plan = deeppart.plan(manifest, world_size, cache=False)
    print(f"{len(manifest)} leaves, {manifest.total_bytes / 2**20:.1f} MiB, {world_size} ranks")
    print(plan.stats)
    for rank, nbytes in enumerate(plan.rank_bytes()):
        pieces = plan.pieces(rank)
        first = "/".join(map(str, pieces[0][0])) if pieces else "-"
        share = f"{nbytes / 2**20:8.2f} MiB in {len(pieces):>3} pieces"
        print(f"rank {rank:>3}: {share} (first: {first})")


if __name__ == "__main__":
    main()
