"""Multi-rank checkpoint scenarios, run by tests/saving/test_checkpoint_mpi.py as
``mpiexec -n K python tests/support/mpi_checkpoint.py SCENARIO DIR [ARGS]``.

Each rank prints ``OK <scenario> rank <r>/<size>`` when its checks pass;
the test counts those lines. A failed check raises, so mpiexec exits
non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rank_output import print_line

import deeppart
import deeppart.state.state
from deeppart.comm import MPIComm, resolve
from deeppart.format import data_file_name
from deeppart.loading import reader
from deeppart.saving import writer
from deeppart.storage import files as storage_files


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


def scenario_done(results: Path, name: str, comm: Any) -> None:
    """After scenario ``name`` passed on this rank: a barrier, then the
    marker ``results/ok/<name>.<rank>`` and an ``OK`` line (the markers
    are what tests count: mpiexec may interleave the ranks' lines)."""
    comm.barrier()
    (results / "ok" / f"{name}.{comm.rank}").touch()
    print_line(f"OK {name} rank {comm.rank}/{comm.size}")


def abort_on_failure(main: Callable[[], None]) -> None:
    """Runs a worker's ``main``; on any failure prints the traceback and
    aborts the whole MPI job (fail fast: without this the other ranks wait
    in their next collective until the test's timeout)."""
    try:
        main()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)


def flip_middle_byte(d: Path, p: Any) -> None:
    """Rank 0 flips a bit of the middle byte of piece ``p`` in its data
    file, between two barriers."""
    c = resolve()
    c.barrier()
    if c.rank == 0:
        path = d / data_file_name(p.rank)
        data = bytearray(path.read_bytes())
        data[p.offset + p.stored // 2] ^= 0x10
        path.write_bytes(bytes(data))
    c.barrier()


def ok(name: str) -> None:
    c = resolve()
    print_line(f"OK {name} rank {c.rank}/{c.size}")


def scenario_roundtrip(d: Path, codec: str | None) -> None:
    state = make_state()
    stats = deeppart.save(state, d, writing=deeppart.WriteOptions(compression=codec))
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


# A Mixtral-style stacked-experts tensor ([experts, 2 x intermediate, hidden])
# with its AdamW moments, and a cost model under which the plan must cut it
# inside rows: rows are 24,000 bytes, cuts fall on 4 KiB.
EXPERTS_SHAPE = (4, 2 * 3, 1000)


def experts_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {"experts.gate_up_proj": torch.randn(EXPERTS_SHAPE, generator=g)},
        "optim": {
            "exp_avg": torch.randn(EXPERTS_SHAPE, generator=g),
            "exp_avg_sq": torch.rand(EXPERTS_SHAPE, generator=g, dtype=torch.float64),
            "step": torch.tensor(3.0),
        },
    }


def scenario_experts_save(d: Path) -> None:
    cost = deeppart.CostModel(
        fixed_s=0.0, piece_s=0.0, writer_s=0.0, bandwidth=1e6, min_piece_bytes=4096
    )
    deeppart.save(experts_state(), d, planning=deeppart.PlanOptions(cost=cost))
    ok("experts-save")


def scenario_experts_load(d: Path) -> None:
    for exchange in ("bcast", "read"):
        assert_bitwise_equal(
            experts_state(), deeppart.load(d, loading=deeppart.LoadOptions(exchange=exchange))
        )
    ok("experts-load")


def scenario_save(d: Path, codec: str | None) -> None:
    deeppart.save(make_state(), d, writing=deeppart.WriteOptions(compression=codec))
    ok("save")


def scenario_latecomer(d: Path) -> None:
    """Rank 0 calls save 1 s after the others: Stats.seconds is the slowest
    rank's time in the call (theirs, waiting included), every rank's time is
    in rank_seconds, and the summary names no second, larger figure."""
    import time

    c = resolve()
    state = make_state()
    c.barrier()  # the others enter save together, rank 0 a second after them
    if c.rank == 0:
        time.sleep(1.0)
    stats = deeppart.save(state, d)
    assert stats.seconds == max(stats.rank_seconds), stats
    # The waiting ranks left the barrier at most a scheduling slice apart.
    assert stats.seconds >= 0.9, stats
    assert stats.slowest_rank != 0 and stats.rank_seconds[0] < stats.seconds - 0.5, stats
    line = stats.summary()
    assert f"in {stats.seconds:.3f} s (slowest rank {stats.slowest_rank};" in line, line
    ok("latecomer")


def scenario_decompress_once(d: Path) -> None:
    """A compressed checkpoint loads (exchange="auto", one host) with every
    compressed piece decompressed exactly once over all ranks, by the rank
    that read it, and raw bytes exchanged; exchange="read" still has every
    rank decompress everything. Bitwise equal either way."""

    c = resolve()
    state = make_state()
    deeppart.save(state, d, writing=deeppart.WriteOptions(compression="zstd"))
    meta = json.loads((d / "metadata.json").read_text())
    codec_at = meta["piece_fields"].index("codec")
    compressed = sum(1 for row in meta["pieces"] if row[codec_at] != "none")
    assert compressed > 1, "the state has compressible pieces"
    calls = [0]

    def counting(real: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            return real(*a, **kw)

        return call

    # Every piece the reader decodes goes through decompress_into (streamed
    # into its destination, or into a buffer staged on to a device).
    reader.decompress_into = counting(reader.decompress_into)  # type: ignore[attr-defined]
    for exchange, per_rank in (("auto", None), ("read", compressed)):
        calls[0] = 0
        assert_bitwise_equal(
            state, deeppart.load(d, loading=deeppart.LoadOptions(exchange=exchange)), exchange
        )
        counts = c.allgather_f64(np.array([float(calls[0])]))[:, 0].tolist()
        if per_rank is None:
            assert sum(counts) == compressed and max(counts) < compressed, counts
        else:
            assert counts == [per_rank] * c.size, counts
    ok("decompress_once")


def scenario_load(d: Path) -> None:
    out = deeppart.load(d, loading=deeppart.LoadOptions(exchange="bcast"))
    assert_bitwise_equal(make_state(), out)
    out = deeppart.load(d, loading=deeppart.LoadOptions(exchange="read"))
    assert_bitwise_equal(make_state(), out)
    for exchange in ("bcast", "read"):
        into = make_state(seed=1)
        assert_bitwise_equal(
            make_state(),
            deeppart.load(d, into=into, loading=deeppart.LoadOptions(exchange=exchange)),
        )
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


def _verifiers(d: Path, size: int) -> tuple[list[int], list[list[Any]]]:
    """Which rank checksums each data file of ``d`` on a one-host load by
    ``size`` ranks (:func:`reader.assign_readers` of the raw bytes per
    file), and the pieces of each file."""
    meta, _ = reader.read_metadata(d)
    raw = [0] * meta.world_size
    by_file: list[list[Any]] = [[] for _ in range(meta.world_size)]
    for p in meta.pieces:
        raw[p.rank] += p.length
        by_file[p.rank].append(p)
    return reader.assign_readers(raw, size), by_file


def _expect_corrupt(d: Path, expect: str, phase: str) -> None:
    try:
        deeppart.load(d, into=make_state(seed=1))
    except deeppart.CorruptCheckpointError as e:
        assert expect in str(e), (phase, e)
        return
    raise AssertionError(f"{phase}: no error raised")


def scenario_shared_check(d: Path) -> None:
    """A one-host load (exchange="auto": each file read and verified by one
    rank into a node-shared window, copied out by every rank) checksums
    each raw byte on one rank only; a rank that is not a file's reader
    never reads that file (here it would see a corrupted copy: storage
    returning other bytes on a re-read) and returns the verified bytes; a
    corrupt piece in a file that rank 0 does not read fails every rank."""
    c = resolve()
    state = make_state()
    deeppart.save(state, d)
    verifier, by_file = _verifiers(d, c.size)
    # 1. Each raw byte checksummed once over the ranks (whole, or in parts
    #    as a reader reads it through to its own tensors).
    counted = [0]
    real = reader.checksum  # type: ignore[attr-defined]
    real_stream = reader.checksum_stream  # type: ignore[attr-defined]

    def counting(data: Any) -> int:
        counted[0] += len(data)
        return real(data)

    class CountingStream:
        def __init__(self) -> None:
            self.h = real_stream()

        def update(self, part: Any) -> None:
            counted[0] += len(part)
            self.h.update(part)

        def intdigest(self) -> int:
            return int(self.h.intdigest())

    reader.checksum = counting  # type: ignore[attr-defined]
    reader.checksum_stream = CountingStream  # type: ignore[attr-defined]
    assert_bitwise_equal(state, deeppart.load(d, into=make_state(seed=1)), "shared")
    reader.checksum = real  # type: ignore[attr-defined]
    reader.checksum_stream = real_stream  # type: ignore[attr-defined]
    counts = c.allgather_f64(np.array([float(counted[0])]))[:, 0]
    total = sum(p.length for ps in by_file for p in ps)
    assert counts.sum() == total and counts.max() < total, (counts, total)
    # 2. The last rank would read a replaced (corrupted) copy of a file
    #    that another rank reads: it takes that rank's verified bytes.
    seen_by = c.size - 1
    f = next(f for f, v in enumerate(verifier) if v != seen_by and by_file[f])
    p = max(by_file[f], key=lambda p: p.length)
    if c.rank == seen_by:
        copy = d.parent / f"replaced-{c.rank}.bin"
        data = bytearray((d / data_file_name(f)).read_bytes())
        data[p.offset + p.stored // 2] ^= 0x10
        copy.write_bytes(bytes(data))
        # Data files are opened through storage.files.open_data (a file
        # system checkpoint: its open_regular).
        real_open = storage_files.open_regular  # type: ignore[attr-defined]
        opened: list[str] = []

        def replaced(path: Path) -> Any:
            opened.append(path.name)
            return real_open(copy if path.name == data_file_name(f) else path)

        storage_files.open_regular = replaced  # type: ignore[attr-defined]
        out = deeppart.load(d, into=make_state(seed=1))
        storage_files.open_regular = real_open  # type: ignore[attr-defined]
        assert data_file_name(f) not in opened, opened
    else:
        out = deeppart.load(d, into=make_state(seed=1))
    assert_bitwise_equal(state, out, "replaced")
    # 3. A flipped byte in a file that rank 0 does not check.
    f = next(f for f, v in enumerate(verifier) if v != 0 and by_file[f])
    p = max(by_file[f], key=lambda p: p.length)
    flip_middle_byte(d, p)
    expect = f"{data_file_name(f)}: piece of leaf {p.leaf} [{p.start}:{p.stop}]"
    _expect_corrupt(d, expect, "flipped")
    ok("shared_check")


def _stream_state(fill: float | None = None) -> dict[str, Any]:
    """Four 2 MiB tensors (each its own message in an exchange), two in
    each data file of a 2-rank save; ``fill``: every value that one."""
    gen = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {}
    for k in range(4):
        t = torch.rand(512, 1024, generator=gen) + 1.0
        out[f"w{k}"] = t if fill is None else torch.full_like(t, fill)
    return out


def _piece_bytes(state: dict[str, Any], meta: Any, p: Any) -> Any:
    """The bytes of piece ``p`` in ``state`` (a live view of its tensor)."""
    leaf = meta.leaves[p.leaf]
    flat = state[leaf.path[0]].reshape(-1).view(torch.uint8).numpy()
    isz = leaf.itemsize
    return flat[p.start * isz : p.stop * isz]


def _hold_last_piece(f: int, until: Callable[[], bool], wait_s: float) -> Callable[[], None]:
    """Makes this rank's read of data file ``f`` (by the load's reader
    thread) wait, once its last piece is verified, until ``until()`` (at
    most ``wait_s``; then it raises). Returns the undo."""
    real = reader.read_file

    def held(*args: Any, **kwargs: Any) -> int:
        done = kwargs.get("done")
        if args[2] != f or done is None:
            got: int = real(*args, **kwargs)
            return got
        last = max(args[3], key=lambda p: p.offset)

        def hold(p: Any) -> None:
            if p is last:
                deadline = time.monotonic() + wait_s
                while not until():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the other rank never got this file's first message")
                    time.sleep(0.01)
            done(p)

        n: int = real(*args, **{**kwargs, "done": hold})
        return n

    reader.read_file = held
    return lambda: setattr(reader, "read_file", real)


def scenario_stream(d: Path) -> None:
    """A load by broadcast (2 ranks) sends each message once its reader has
    verified it, while the read goes on: rank 0's read of its file waits,
    before its last piece counts as verified, until rank 1 has received the
    file's first piece (a load that read before exchanging would time out).
    Then a corrupt piece: its reader's checksum fails, and what the other
    rank's tensor gets for it is zeros, never the bytes read (both raise)."""
    c = resolve()
    assert c.size == 2
    saved = _stream_state()
    deeppart.save(saved, d)
    meta, _ = reader.read_metadata(d)
    raw = [sum(p.length for p in meta.pieces if p.rank == f) for f in range(2)]
    mine = reader.assign_readers(raw, 2).index(0)  # the file rank 0 reads
    first, second = sorted((p for p in meta.pieces if p.rank == mine), key=lambda p: p.offset)
    flag = d / "first-message-received"
    into = _stream_state(fill=0.5)
    undo = None
    watcher = None
    if c.rank == 0:
        undo = _hold_last_piece(mine, flag.exists, 60.0)
    else:
        want = _piece_bytes(saved, meta, first).copy()
        got = _piece_bytes(into, meta, first)

        def watch() -> None:
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline:
                if np.array_equal(got, want):
                    flag.touch()
                    return
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
    try:
        out = deeppart.load(d, into=into, loading=deeppart.LoadOptions(exchange="bcast"))
    finally:
        if undo is not None:
            undo()
    if watcher is not None:
        watcher.join()
    assert_bitwise_equal(saved, out, "streamed")
    # The second piece of rank 0's file corrupted on disk.
    flip_middle_byte(d, second)
    into = _stream_state(fill=0.5)
    try:
        deeppart.load(d, into=into, loading=deeppart.LoadOptions(exchange="bcast"))
    except deeppart.CorruptCheckpointError as e:
        assert f"{data_file_name(mine)}: piece of leaf {second.leaf}" in str(e), e
    else:
        raise AssertionError("a corrupt piece loaded")
    if c.rank == 1:
        got = _piece_bytes(into, meta, second)
        before = _piece_bytes(_stream_state(fill=0.5), meta, second)
        assert np.all(got == 0) or np.array_equal(got, before), (
            "the other rank got bytes its reader did not verify"
        )
    ok("stream")


def _compressible_state() -> dict[str, Any]:
    """Tensors of small integers in float32 (and bfloat16): every piece
    compresses, to about a sixth of its bytes."""
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            f"w{i}": torch.randint(0, 4, (n,), generator=g).float()
            for i, n in enumerate((700, 9000, 30000, 2500))
        },
        "buf": torch.randint(0, 4, (6000,), generator=g).to(torch.bfloat16),
    }


class BcastBytes(MPIComm):
    """MPI.COMM_WORLD, counting the bytes of the load's broadcasts and, on
    ``tamper_rank``, flipping one byte of the first message it receives
    (after MPI has delivered it, before the load looks at it)."""

    def __init__(self, comm: Any, tamper_rank: int = -1) -> None:
        super().__init__(comm)
        self.sent = 0
        self.tamper = comm.Get_rank() == tamper_rank

    def start_bcast_u8(self, buf: Any, root: int) -> Any:
        self.sent += buf.size
        handle = super().start_bcast_u8(buf, root)
        if not self.tamper or root == self.rank:
            return handle
        self.tamper = False
        inner = handle

        class Tampered:
            def done(self) -> bool:
                return bool(inner.done())

            def wait(self) -> None:
                inner.wait()
                buf[buf.size // 2] ^= 0x10

        return Tampered()


def scenario_stream_compressed(d: Path) -> None:
    """A compressed checkpoint loads by broadcast with its pieces sent as
    stored: the broadcasts carry the files' stored bytes, not the raw ones,
    and every rank checks each piece it receives before decoding it. A byte
    flipped in transit (on rank 0) fails the load on every rank, naming the
    piece and the rank its bytes came from; a piece corrupt on disk fails it
    with its reader's error (the zeros the reader then sends are not
    reported as a second, misleading corruption)."""
    from mpi4py import MPI

    c = resolve()
    saved = _compressible_state()
    # Every rank writes a part (no fixed costs in the plan's cost model).
    cost = deeppart.CostModel(
        fixed_s=0.0, piece_s=0.0, writer_s=0.0, bandwidth=1e6, min_piece_bytes=4096
    )
    deeppart.save(
        saved,
        d,
        planning=deeppart.PlanOptions(cost=cost),
        writing=deeppart.WriteOptions(compression="shuffle-zstd"),
    )
    meta, _ = reader.read_metadata(d)
    assert all(p.codec != "none" for p in meta.pieces), [p.codec for p in meta.pieces]
    raw = [sum(p.length for p in meta.pieces if p.rank == f) for f in range(meta.world_size)]
    owners = reader.assign_readers(raw, c.size)
    assert {owners[p.rank] for p in meta.pieces} == set(range(c.size)), owners
    stored = sum(p.stored for p in meta.pieces)
    assert stored * 3 < sum(p.length for p in meta.pieces), stored
    counting = BcastBytes(MPI.COMM_WORLD)
    out = deeppart.load(d, comm=counting, loading=deeppart.LoadOptions(exchange="bcast"))
    assert_bitwise_equal(saved, out, "compressed stream")
    assert counting.sent == stored, (counting.sent, stored)
    # One byte flipped in the first message rank 0 receives.
    try:
        deeppart.load(
            d,
            comm=BcastBytes(MPI.COMM_WORLD, tamper_rank=0),
            loading=deeppart.LoadOptions(exchange="bcast"),
        )
    except deeppart.CorruptCheckpointError as e:
        assert "checksum mismatch (xxh3_64) in the bytes received from rank" in str(e), e
        if c.rank != 0:
            assert str(e).startswith("rank 0: "), e
    else:
        raise AssertionError("bytes corrupted in transit loaded")
    # A piece of the file rank 1 reads corrupted on disk.
    victim = max((p for p in meta.pieces if owners[p.rank] == 1), key=lambda p: p.stored)
    flip_middle_byte(d, victim)
    try:
        deeppart.load(d, loading=deeppart.LoadOptions(exchange="bcast"))
    except deeppart.CorruptCheckpointError as e:
        assert f"piece of leaf {victim.leaf} [{victim.start}:{victim.stop}]" in str(e), e
        assert "received" not in str(e), e
        if c.rank != 1:
            assert str(e).startswith("rank 1: "), e
    else:
        raise AssertionError("a corrupt piece loaded")
    ok("stream_compressed")


class CountingComm(MPIComm):
    """MPI.COMM_WORLD, counting each collective DeepPart runs on it."""

    COLLECTIVES = (
        "allgather_bytes", "allgather_f64", "allgather_varbytes", "allreduce_sum_i64",
        "gatherv_u64", "bcast_u8", "start_bcast_u8", "sendrecv_u8", "barrier",
    )  # fmt: skip

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        self.calls: list[str] = []
        for name in self.COLLECTIVES:
            setattr(self, name, self._counted(name, getattr(self, name)))

    def _counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return fn(*args, **kwargs)

        return counted


def scenario_collectives(d: Path) -> None:
    """A one-host load (exchange="auto") with the window the load before it
    kept: three collectives in all, the agreements after the plan, the read,
    and the exchange with the assembly (one agreement for both). Telling one
    host from several, whether the kept window fits, and the statistics
    ride on them; no barrier."""
    from mpi4py import MPI

    c = resolve()
    state = make_state()
    deeppart.save(state, d)
    deeppart.load(d, into=make_state(seed=1))  # makes the window and keeps it
    counting = CountingComm(MPI.COMM_WORLD)
    out = deeppart.load(d, comm=counting, into=make_state(seed=1))
    assert_bitwise_equal(state, out, "collectives")
    assert counting.calls == ["allgather_bytes"] * 3, counting.calls
    stats = deeppart.last_stats("load")
    assert stats is not None and stats.world_size == c.size, stats
    assert len(stats.rank_seconds) == c.size and stats.seconds == max(stats.rank_seconds)
    total = sum((d / data_file_name(f)).stat().st_size for f in range(c.size))
    assert 0 < stats.stored_bytes < total, (stats.stored_bytes, total)  # each piece read once
    # The save's one sum of a fixed size (the union cache's decision):
    # int64, exact beyond float64's 53 bits, negative terms too.
    n, r = c.size, c.rank
    got = counting.allreduce_sum_i64(np.array([2**60 + r, -r, 1], dtype=np.int64))
    assert got.dtype == np.int64, got.dtype
    assert got.tolist() == [n * 2**60 + n * (n - 1) // 2, -n * (n - 1) // 2, n], got
    ok("collectives")


def scenario_agree_wait() -> None:
    """An agreement that waits for a late rank (rank 0 arrives 1 s after the
    others) does not hold the waiting ranks' cores: their processor time in
    it stays a fraction of the wait (MPI's own wait spins through it:
    measured 0.11 s at load average 25, where the spinning ranks share the
    cores with other work, against 0.04 s with the sleeps), and every rank
    gets every rank's payload."""
    import time

    from deeppart.agreement import agree

    c = resolve()
    if c.rank == 0:
        time.sleep(1.0)
    before = time.process_time()
    rows = agree(c, None, bytes([c.rank + 1]), width=1)
    spent = time.process_time() - before
    assert rows == [bytes([r + 1]) for r in range(c.size)], rows
    if c.rank != 0:
        assert spent < 0.2, f"rank {c.rank} spent {spent:.3f} s of processor time waiting"
    ok("agree_wait")


def scenario_mismatch(d: Path) -> None:
    """The last rank holds one more leaf: the checkpoint is the union of
    the ranks' trees (issue 32) and each rank loads back its own tree."""
    c = resolve()
    state = make_state()
    if c.rank == c.size - 1:
        state["extras"]["surprise"] = torch.zeros(3)
    deeppart.save(state, d)
    assert_bitwise_equal(state, deeppart.load(d))
    ok("mismatch")


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
        # The writer's named fault hook: after this rank's data file is written.
        writer.add_fault_hook("after-write", lambda _event: os.kill(os.getpid(), signal.SIGKILL))
    cp.save(2, make_state(steps=3))
    raise AssertionError("unreachable: a rank was killed")


class WriterGate:
    """Holds every background write at its start until the main thread
    opens the gate: proof that the main thread ran while a save was in
    flight, with no timing involved."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.remove: Callable[[], None] | None = None
        #: Called with each write's event once it passes the gate.
        self.on_write: Callable[[writer.WriteEvent], None] | None = None

    def __enter__(self) -> WriterGate:
        def gated(event: writer.WriteEvent) -> None:
            if threading.current_thread() is not threading.main_thread():
                self.started.set()
                if not self.gate.wait(120):
                    raise RuntimeError("the gate was never opened")
            if self.on_write is not None:
                self.on_write(event)

        self.remove = writer.add_fault_hook("before-write", gated)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.remove is not None:
            self.remove()


def host_copy(state: Any) -> Any:
    """A deep copy of ``state``'s values (what a checkpoint of it must hold)."""
    leaves, skeleton = deeppart.state.state.flatten(state)
    values = [
        lf.tensor.detach().clone()
        if lf.tensor is not None
        else deeppart.state.state.decode_plain(lf.encoded or b"")
        for lf in leaves
    ]
    return deeppart.state.state.unflatten(skeleton, values)


def scenario_async(root: Path, allreduce: Callable[[torch.Tensor], None]) -> None:
    """Checkpointer(async_=True) while training goes on: each save returns
    while its background write is still held at the gate; the main thread
    then trains (gradients all-reduced over the training communicator, a
    collective running beside the writer's) and only then opens the gate.
    Each checkpoint holds the state as it was at its save call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(steps: int) -> None:
        for _ in range(steps):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            for prm in model.parameters():
                assert prm.grad is not None
                allreduce(prm.grad)
            opt.step()
            opt.zero_grad()

    def state(step: int) -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    train(1)
    cp = deeppart.Checkpointer(root, async_=True, keep_last=2)
    expected = {}
    for step in (1, 2):
        expected[step] = host_copy(state(step))
        with WriterGate() as gate:
            handle = cp.save(step, state(step))
            assert isinstance(handle, deeppart.AsyncSave)
            assert gate.started.wait(120), "the writer never started"
            assert not handle.done(), "the save finished before the gate opened"
            train(3)  # the live state changes under the snapshot
            gate.gate.set()
            stats = handle.wait()
        assert stats.raw_bytes > 0
    cp.close()
    assert cp.steps() == [1, 2]
    for step in (1, 2):
        assert_bitwise_equal(expected[step], cp.load(step), f"step {step}")
    live = host_copy(state(2))
    assert not torch.equal(live["model"]["0.weight"], expected[2]["model"]["0.weight"])
    ok("async")


def scenario_async_share(d: Path, codec: str | None) -> None:
    """async_save stages only this rank's planned share: the bytes it copied
    are the raw bytes of the pieces it wrote (read back from the committed
    metadata), the ranks' shares add up to the state, each is well under the
    state, and the host buffer is sized to the share. Right after the call
    returns (the writer held at its gate) every tensor is changed in place
    (a non-contiguous view's base too) and a plain value is mutated; the
    checkpoint holds the state as it was at the call, bitwise."""
    c = resolve()
    state = make_state()
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1000, 300, generator=gen)
    state["big"] = [torch.randn(1 << 18, generator=gen) for _ in range(3)] + [base.t()]
    expected = host_copy(state)
    with WriterGate() as gate:
        handle = deeppart.async_save(state, d, writing=deeppart.WriteOptions(compression=codec))
        assert gate.started.wait(120), "the writer never started"
        assert not handle.done() and not handle.synchronous
        leaves, _ = deeppart.state.state.flatten(state)
        for lf in leaves:
            t = lf.tensor
            if t is None or not t.numel():
                continue
            if t.is_contiguous():
                t.reshape(-1).view(torch.uint8).bitwise_not_()
            else:
                t.zero_()
        base.mul_(-3.0)
        state["meta"]["name"] = "changed after the call"
        state["step"] = 99
        gate.gate.set()
        stats = handle.wait()
    total = stats.raw_bytes
    meta = json.loads((d / "metadata.json").read_text())
    written = sum(int(row[5]) for row in meta["pieces"] if int(row[3]) == c.rank)
    assert handle.staged_bytes == written, (handle.staged_bytes, written)
    shares = c.allgather_f64(np.array([handle.staged_bytes], dtype=np.float64))
    assert int(shares.sum()) == total, (shares, total)
    assert handle.staged_bytes <= total // 2, (handle.staged_bytes, total)
    pieces = sum(1 for row in meta["pieces"] if int(row[3]) == c.rank)
    assert handle.staging_capacity <= handle.staged_bytes + 64 * pieces + 64
    assert_bitwise_equal(expected, deeppart.load(d))
    # wait()'s Stats are the same on every rank, as a synchronous save's are
    # (the writers were held at the gate for different times).
    for s in (stats, deeppart.save(state, d.with_name(d.name + "-sync"))):
        mine = np.array([s.seconds, *s.rank_seconds, s.stored_bytes], dtype=np.float64)
        every = c.allgather_f64(mine)
        assert all(np.array_equal(every[r], mine) for r in range(c.size)), every
        assert len(s.rank_seconds) == c.size and s.seconds == max(s.rank_seconds)
    ok("async_share")


def scenario_writer_sleeps(d: Path) -> None:
    """2 ranks: rank 0 enters each barrier 1.5 s late; rank 1 measures the
    CPU time its thread spends waiting there, once on the caller's
    communicator (a blocking MPI wait) and once on the asynchronous
    writer's (deeppart.comm.writer_comm: tested between sleeps). The
    writer's wait must cost a small fraction of the blocking one's (MPICH
    polls a core while it waits); both collectives still complete."""
    from mpi4py import MPI

    from deeppart.comm import MPIComm, SleepingMPIComm, writer_comm

    caller = MPIComm(MPI.COMM_WORLD)
    writer, why = writer_comm(caller)
    assert isinstance(writer, SleepingMPIComm), why
    spent = {}
    for name, c in (("blocking", caller), ("writer", writer)):
        c.barrier()
        if c.rank == 0:
            time.sleep(1.5)
        t0 = time.thread_time()
        c.barrier()
        spent[name] = time.thread_time() - t0
        rows = c.allgather_f64(np.array([c.rank + 0.5]))
        assert [float(x) for x in rows[:, 0]] == [r + 0.5 for r in range(c.size)]
    if caller.rank == 1:
        assert spent["writer"] < 0.2 * spent["blocking"], spent
    print(f"rank {caller.rank}: waiting CPU seconds {spent}")
    ok("writer_sleeps")


def mpi_allreduce(t: torch.Tensor) -> None:
    """Sums ``t`` (a CPU float tensor) over MPI.COMM_WORLD, in place."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() > 1:
        assert MPI.Query_thread() == MPI.THREAD_MULTIPLE
        comm.Allreduce(MPI.IN_PLACE, t.detach().numpy())


def launch(cmd: list[str], timeout: float, root: Path) -> subprocess.CompletedProcess[str]:
    """Runs a test job (e.g. ``mpiexec -n K python WORKER ...``) from
    ``root`` with a timeout, single-threaded; a hang fails the calling test."""
    import pytest

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=root
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} hung (no result after {timeout} s): {e.stdout!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario")
    p.add_argument("dir", type=Path)
    p.add_argument("--codec", default=None)
    p.add_argument("--expect", default="")
    p.add_argument("--max-message", type=int, default=0, help="chunk size of broadcasts")
    p.add_argument(
        "--exchange-message",
        type=int,
        default=0,
        help="largest broadcast of the load's exchange (pieces of a quarter of it go direct)",
    )
    p.add_argument(
        "--stage",
        type=int,
        default=0,
        help="treat every tensor as a device tensor, staged through a buffer of this many bytes",
    )
    args = p.parse_args()
    scenarios: dict[str, Callable[[], None]] = {
        "roundtrip": lambda: scenario_roundtrip(args.dir, args.codec),
        "save": lambda: scenario_save(args.dir, args.codec),
        "load": lambda: scenario_load(args.dir),
        "latecomer": lambda: scenario_latecomer(args.dir),
        "decompress_once": lambda: scenario_decompress_once(args.dir),
        "corrupt": lambda: scenario_corrupt(args.dir, args.expect),
        "shared_check": lambda: scenario_shared_check(args.dir),
        "collectives": lambda: scenario_collectives(args.dir),
        "agree_wait": scenario_agree_wait,
        "mismatch": lambda: scenario_mismatch(args.dir),
        "nonplain": lambda: scenario_nonplain(args.dir),
        "crash": lambda: scenario_crash(args.dir),
        "async": lambda: scenario_async(args.dir, mpi_allreduce),
        "async_share": lambda: scenario_async_share(args.dir, args.codec),
        "writer_sleeps": lambda: scenario_writer_sleeps(args.dir),
        "experts-save": lambda: scenario_experts_save(args.dir),
        "stream": lambda: scenario_stream(args.dir),
        "stream_compressed": lambda: scenario_stream_compressed(args.dir),
        "experts-load": lambda: scenario_experts_load(args.dir),
    }
    torch.set_num_threads(1)
    if args.max_message:
        import deeppart.comm

        deeppart.comm.MAX_MESSAGE = args.max_message
    if args.exchange_message:
        from deeppart.loading import reader

        reader.EXCHANGE_MESSAGE_BYTES = args.exchange_message
        reader.DIRECT_PIECE_BYTES = args.exchange_message // 4
        reader.PACKED_MESSAGE_BYTES = args.exchange_message // 2
        # The broadcasts in flight reach their caps mid-exchange too.
        reader.STREAM_PACKED_BYTES = 2 * args.exchange_message
        reader.STREAM_MESSAGES = 3
        # The reader thread keeps at most this much compressed data ahead.
        reader.STREAM_HELD_BYTES = args.exchange_message
    if args.stage:
        from deeppart.state import staging

        staging.DEFAULT_STAGING_BYTES = args.stage
        staging.needs_staging = lambda t: True
    scenarios[args.scenario]()
    sys.stdout.flush()


if __name__ == "__main__":
    main()


def run_then_exit(main: Callable[[], int | None]) -> None:
    """Runs a gloo worker's ``main`` and leaves without the interpreter's
    teardown (status: 1 after printing the error, else what ``main``
    returned, or 0). Once ``main`` has
    printed its results and destroyed its process group, gloo's worker
    threads were seen to abort the finished rank during teardown
    ("terminate called without an active exception", SIGABRT) about once
    per CI run."""
    try:
        code = main() or 0
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
