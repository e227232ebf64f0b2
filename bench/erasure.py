"""Reed-Solomon erasure coding benchmark: ``.venv/bin/python bench/erasure.py``.

A group of g = 4 ranks, one 64 MiB data shard each, g parity shards (the
FTI-style L3 layout). Single-threaded (the coder uses one core), so the
figures are per core. Prints, in GB/s (1e9 bytes/s) of data (g x shard
bytes):

- encode: ``rs_encode`` of the g data shards into g parity shards;
- decode, 1 lost: ``rs_reconstruct`` with one data shard lost;
- decode, g lost: all g data shards lost, restored from the g parity shards
  (the worst case the code tolerates);
- memcpy: a numpy copy of the same g x shard bytes, into a new array (as
  the coder writes new ``bytes``) and into an existing one.

Target: encode and decode >= 1 GB/s per core. Medians of several runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from deeppart._planner import rs_encode, rs_reconstruct

MiB = 1 << 20


def median_s(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up: page in, pick the SIMD kernel
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--group", type=int, default=4, help="g: data shards = parity shards")
    ap.add_argument("--shard-mib", type=int, default=64, help="bytes per data shard, in MiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    g, shard = args.group, args.shard_mib * MiB

    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 256, size=shard, dtype=np.uint8) for _ in range(g)]
    data = [a.data for a in arrays]  # memoryviews, no copies
    lengths = [shard] * g
    total = g * shard
    parity = rs_encode(data, g)

    # Correctness first: the benchmark must not time a broken path.
    restored = rs_reconstruct(g, g, {}, dict(enumerate(parity)), lengths)
    for r, a in zip(restored, arrays, strict=True):
        assert np.array_equal(np.frombuffer(r, dtype=np.uint8), a)
    del restored

    one_lost = {i: data[i] for i in range(1, g)}
    src = np.concatenate(arrays)
    dst = np.empty_like(src)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("encode", lambda: rs_encode(data, g)),
        ("decode, 1 lost", lambda: rs_reconstruct(g, g, one_lost, {0: parity[0]}, lengths)),
        (
            f"decode, {g} lost",
            lambda: rs_reconstruct(g, g, {}, dict(enumerate(parity)), lengths),
        ),
        ("memcpy, new array", lambda: src.copy()),
        ("memcpy, into existing", lambda: np.copyto(dst, src)),
    ]
    print(f"group g={g}: {g} x {args.shard_mib} MiB data shards + {g} parity, single thread")
    print(f"{'operation':<24}{'median s':>10}{'GB/s':>8}")
    for name, fn in cases:
        t = median_s(fn, args.repeats)
        print(f"{name:<24}{t:>10.4f}{total / t / 1e9:>8.2f}")


if __name__ == "__main__":
    main()
