"""State on the GPU: what a checkpoint costs a GPU training loop, the copy
rates, and loads into device tensors, for DeepPart and the real
alternatives, in one run on one GPU (one NCCL rank).

    python bench/gpu.py                          # ~10 GB of state; a few minutes on an H200
    python bench/gpu.py --gb 2 --contenders deeppart-async,dcp-process
    python bench/gpu.py --cpu --gb 0.05          # no GPU: checks that every contender runs

The state: a stack of square bfloat16 weight matrices (``--dim``, 8192 by
default) and AdamW's two moments for each in float32, as mixed-precision
training keeps them: 10 bytes per parameter, ``--gb`` GB in all (10 by
default: about a billion parameters). The training step is real work on
the same tensors: a forward and backward pass of a batch through the
matrices (bfloat16 matmuls) and an AdamW update of weights and moments
(an ``torch.optim.Optimizer``), the device synchronised at its end.

Every contender runs in its own process (a world of one rank: NCCL for
CUDA tensors, gloo for the CPU, ``cpu:gloo,cuda:nccl`` as DCP's async
save asks), in this order, each with its staging buffers kept from one
save to the next, one untimed save first:

- ``deeppart-async``: ``Checkpointer(async_=True)``: the copies to pinned
  memory run on DeepPart's side stream and the training stream waits for
  them on the device, not the host (docs/GPU.md);
- ``deeppart-async-device``: the same with ``snapshot_on_device=True``
  (a copy within the device first, then to the host while training runs);
- ``dcp-process``: DCP's ``async_save`` with its writer process and
  pinned shared memory (``DefaultStager``: pinned, shared, non-blocking
  copies);
- ``torch-checkpointing``: Meta's ``CheckpointManager`` with its
  asynchronous saver (pinned staging on CUDA, a writer subprocess); as its
  tutorial's loop does, ``optimizer.step()`` runs inside
  ``manager.lock()``, which waits for its staging;
- ``dcp-zero-overhead``: DCP's writer process with asynchronous staging
  (``use_async_staging``): the call returns at once and the loop waits
  for ``staging_completion`` before ``optimizer.step()``;
- ``dcp-thread``: DCP's ``async_save`` with its writer thread (pinned
  memory);
- ``deeppart-sync``, ``dcp-sync``: the synchronous saves.

Per contender, the medians over ``--saves`` timed saves:

- **overhead**: what one checkpoint costs the training loop: the call's
  time plus the extra time of the ``--steps`` steps after it (and of any
  more that run while the save is in flight), against the same number of
  steps run just before it with no save in flight. A GPU-side wait (the
  training stream waiting for copies) is in the steps' time, not the
  call's;
- **stall**: the time the call blocks the host, plus any wait the loop
  makes before ``optimizer.step()`` for the contender's staging;
- **durable**: from the call until the save is done (files written and,
  for DeepPart and DCP, fsynced);
- **step during/without**: a step's median time while the save is in
  flight, over its median with none;
- **D2H**: DeepPart's device-to-host copies of its snapshot, bytes over
  their time on the device (CUDA events), against the ceiling;
- **load**: the checkpoint loaded back into zeroed device tensors of the
  same structure, from the page cache (just written), timed to the last
  byte on the device; GB/s against the host-to-device ceiling; every
  load compared bitwise with a device copy of the state taken at the
  timed save's call. DeepPart's load is also run with 4, 8 and 16 reader
  threads (``DEEPPART_LOAD_THREADS``).

The ceilings, measured in the same run by a process of their own: a plain
copy of one device buffer of the state's size into pinned host memory and
back (the best of three each way), and a 1 GB file written with fsync
into the work directory (the disk).

A contender that cannot run (not installed, failed, or out of the time
budget ``--budget-s``) is named with the reason, with no numbers. When the
work directory is a temporary one and the disk writes under
:data:`SLOW_DISK_GBPS` with fsync, the checkpoints go to /dev/shm instead
(every contender alike), and the report says so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.jobs import free_port  # noqa: E402

CONTENDERS = (
    "deeppart-async",
    "deeppart-async-device",
    "dcp-process",
    "torch-checkpointing",
    "dcp-zero-overhead",
    "dcp-thread",
    "deeppart-sync",
    "dcp-sync",
)

#: Bytes per parameter: a bfloat16 weight and two float32 moments.
BYTES_PER_PARAM = 10

#: Reader threads DeepPart's load is also timed with.
LOAD_THREADS = (4, 8, 12, 16)

#: Below this write rate (GB/s, with fsync) the checkpoints go to a tmpfs
#: (/dev/shm) when it has room: the report says so.
SLOW_DISK_GBPS = 1.0

#: The longest one contender's process may run, in seconds.
CONTENDER_TIMEOUT_S = 180.0


# ----------------------------------------------------------------------------
# The model, its optimizer and the training step.


def _adamw32() -> type:
    """AdamW with float32 moments for bfloat16 weights (a real
    ``torch.optim.Optimizer``: its step runs the optimizers' hooks)."""
    import torch

    class AdamW32(torch.optim.Optimizer):
        def __init__(self, params: Any, lr: float = 1e-4) -> None:
            super().__init__(params, {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "wd": 0.01})
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                b1, b2 = group["betas"]
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    s = self.state[p]
                    grad = p.grad.float()
                    s["exp_avg"].lerp_(grad, 1 - b1)
                    s["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                    update = s["exp_avg"] / (s["exp_avg_sq"].sqrt() + group["eps"])
                    p.mul_(1 - group["lr"] * group["wd"]).add_(
                        update.to(p.dtype), alpha=-group["lr"]
                    )

    return AdamW32


class Training:
    """The state (weights and moments on ``device``) and its training step."""

    def __init__(self, gb: float, dim: int, batch: int, device: Any) -> None:
        import torch

        self.torch = torch
        self.device = device
        params = max(1, round(gb * 1e9 / BYTES_PER_PARAM))
        layers = max(2, round(params / (dim * dim)))
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = [
            torch.nn.Parameter(
                (torch.randn(dim, dim, generator=gen, device=device) / dim**0.5).to(torch.bfloat16)
            )
            for _ in range(layers)
        ]
        self.optimizer = _adamw32()(self.weights)
        self.x = torch.randn(batch, dim, generator=gen, device=device).to(torch.bfloat16)
        self.steps = 0

    def state(self) -> dict[str, Any]:
        """The checkpointed state: weights, moments, the step count."""
        moments = self.optimizer.state
        return {
            # Detached, as model.state_dict() gives them (the same storage).
            "model": {f"layer{i}.weight": w.detach() for i, w in enumerate(self.weights)},
            "optim": {
                f"layer{i}": {
                    "exp_avg": moments[w]["exp_avg"],
                    "exp_avg_sq": moments[w]["exp_avg_sq"],
                }
                for i, w in enumerate(self.weights)
            },
            "step": self.steps,
        }

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def step(self, before_optimizer: Callable[[], None] | None = None) -> tuple[float, float]:
        """One training step; returns its seconds and the seconds spent in
        ``before_optimizer`` (a contender's wait for its staging)."""
        t0 = time.perf_counter()
        h = self.x
        for w in self.weights:
            h = self.torch.tanh(h @ w)
        self.torch.autograd.backward(h.float().pow(2).mean())
        waited = 0.0
        if before_optimizer is not None:
            t1 = time.perf_counter()
            before_optimizer()
            waited = time.perf_counter() - t1
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.sync()
        return time.perf_counter() - t0, waited


def tensors(tree: Any) -> list[Any]:
    """Every tensor of a state tree, in a fixed order."""
    import torch

    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in tensors(tree[k])]
    return []


def _zeros_like(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return torch.zeros_like(tree)
    if isinstance(tree, dict):
        return {k: _zeros_like(v) for k, v in tree.items()}
    return tree


def _clone(tree: Any) -> Any:
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    return tree


def bitwise_equal(a: Any, b: Any) -> bool:
    """Whether two state trees hold the same tensors, bit for bit (on their device)."""
    import torch

    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and bool(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        for x, y in zip(ta, tb, strict=True)
    )


# ----------------------------------------------------------------------------
# The contenders.


class Contender:
    """How one contender saves and loads (one process, one rank)."""

    #: Whether its save returns before the checkpoint is written.
    background = True

    def __init__(self, name: str, base: Path, cuda: bool) -> None:
        self.name, self.base, self.cuda = name, base, cuda
        self.pending: Any = None

    def save(self, i: int, state: dict[str, Any]) -> Any:
        """Starts (or makes) save ``i``; returns its handle."""
        raise NotImplementedError

    def before_optimizer(self) -> Callable[[], None] | None:
        """What the training loop waits for before ``optimizer.step()``."""
        return None

    def done(self, handle: Any) -> bool:
        return bool(handle.done())

    def wait(self, handle: Any) -> None:
        handle.result()

    def load(self, i: int, into: dict[str, Any]) -> None:
        raise NotImplementedError

    def cleanup(self, i: int) -> None:
        """Removes save ``i`` (the work directory is not the disk's to keep)."""
        shutil.rmtree(self.base / str(i), ignore_errors=True)

    def close(self) -> None:
        pass


class DeepPart(Contender):
    def __init__(self, name: str, base: Path, cuda: bool) -> None:
        super().__init__(name, base, cuda)
        import deeppart

        self.deeppart = deeppart
        self.background = name != "deeppart-sync"
        on_device = name == "deeppart-async-device"
        background = deeppart.AsyncOptions(snapshot_on_device=on_device)
        self.checkpointer = deeppart.Checkpointer(
            base / "dp", keep_last=1, async_=background if self.background else False
        )

    def save(self, i: int, state: dict[str, Any]) -> Any:
        # A SaveHandle (already done for the synchronous save): Contender's
        # done() and wait() serve both.
        return self.checkpointer.save(i, state)

    def load(self, i: int, into: dict[str, Any]) -> None:
        self.checkpointer.load(i, into=into)

    def cleanup(self, i: int) -> None:
        pass  # keep_last=1

    def close(self) -> None:
        self.checkpointer.close()


class DCP(Contender):
    def __init__(self, name: str, base: Path, cuda: bool) -> None:
        super().__init__(name, base, cuda)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        self.background = name != "dcp-sync"
        process = name in ("dcp-process", "dcp-zero-overhead")
        self.kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
        self.async_staging = name == "dcp-zero-overhead"
        # Pinned memory and non-blocking copies need CUDA; shared memory
        # for the writer process.
        self.options = StagingOptions(cuda, process, self.async_staging and cuda, cuda)
        self.new_stager = DefaultStager
        self.stager = DefaultStager(self.options)
        self.staging: Any = None

    def _stager(self) -> Any:
        """The stager for the next save: the same one (it keeps its staging
        storages), unless it closed its copier after its last stage, as
        torch 2.11's does after every one (reused, it then fails with
        ``KeyError: <class 'type'>``): then a new one."""
        inner = getattr(self.stager, "_state_dict_stager", None)
        if inner is not None and not getattr(inner, "_deepcopy_dispatch", True):
            self.stager.close()
            self.stager = self.new_stager(self.options)
        return self.stager

    def save(self, i: int, state: dict[str, Any]) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        writer = FileSystemWriter(str(self.base / str(i)), sync_files=True)
        if not self.background:
            save(state, storage_writer=writer)
            return None
        response = async_save(
            state,
            storage_writer=writer,
            async_checkpointer_type=self.kind,
            async_stager=self._stager(),
        )
        staging = getattr(response, "staging_completion", None)
        if staging is not None:
            # Asynchronous staging: the upload's future, and the staging's
            # for the loop to wait on before optimizer.step().
            self.staging = staging
            return cast(Any, response).upload_completion
        return response

    def before_optimizer(self) -> Callable[[], None] | None:
        staging = self.staging
        if staging is None:
            return None

        def wait() -> None:
            staging.result()
            self.staging = None

        return wait

    def done(self, handle: Any) -> bool:
        return handle is None or bool(handle.done())

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.result()

    def load(self, i: int, into: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.filesystem import FileSystemReader
        from torch.distributed.checkpoint.state_dict_loader import load

        load(into, storage_reader=FileSystemReader(str(self.base / str(i))))

    def close(self) -> None:
        self.stager.close()


class TorchCheckpointing(Contender):
    def __init__(self, name: str, base: Path, cuda: bool) -> None:
        super().__init__(name, base, cuda)
        async_bench = importlib.import_module("bench.async")
        self.manager = async_bench.tc_manager(cuda)

    def save(self, i: int, state: dict[str, Any]) -> Any:
        return self.manager.save(str(self.base / str(i)), state)

    def before_optimizer(self) -> Callable[[], None] | None:
        def wait() -> None:
            with self.manager.lock():
                pass

        return wait

    def load(self, i: int, into: dict[str, Any]) -> None:
        self.manager.load(str(self.base / str(i)), into=into)

    def close(self) -> None:
        self.manager.close()


def make_contender(name: str, base: Path, cuda: bool) -> Contender:
    if name.startswith("deeppart"):
        return DeepPart(name, base, cuda)
    if name.startswith("dcp"):
        return DCP(name, base, cuda)
    if name == "torch-checkpointing":
        return TorchCheckpointing(name, base, cuda)
    raise ValueError(f"unknown contender {name!r}")


# ----------------------------------------------------------------------------
# One contender's job.


def _median(xs: list[float]) -> float:
    import statistics

    return float(statistics.median(xs)) if xs else float("nan")


def _init_group(cuda: bool) -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=0, world_size=1)


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    cuda = not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _init_group(cuda)
    base = Path(args.dir) / args.contender
    base.mkdir(parents=True, exist_ok=True)
    train = Training(args.gb, args.dim, args.batch, device)
    contender = make_contender(args.contender, base, cuda)
    total = sum(t.numel() * t.element_size() for t in tensors(train.state()))
    for _ in range(3):
        train.step()
    baseline = _median([train.step()[0] for _ in range(args.steps)])

    stalls: list[float] = []
    overheads: list[float] = []
    durables: list[float] = []
    during: list[float] = []
    d2h: list[float] = []
    reference: Any = None
    last = -1
    for i in range(args.saves + 1):
        before = contender.before_optimizer
        reference_steps = sum(train.step()[0] for _ in range(args.steps))
        if i == args.saves:  # the timed save whose checkpoint is loaded back
            reference = _clone(train.state())
            train.sync()
        t0 = time.perf_counter()
        handle = contender.save(i, train.state())
        stall = time.perf_counter() - t0
        seconds, count, durable, flying = 0.0, 0, float("nan"), []
        while count < args.steps or (durable != durable and count < 40 * args.steps):
            dt, waited = train.step(before())
            seconds += dt
            stall += waited
            count += 1
            if durable != durable:
                if contender.done(handle):
                    durable = time.perf_counter() - t0
                else:
                    flying.append(dt)
        contender.wait(handle)
        if durable != durable:
            durable = time.perf_counter() - t0
        if not contender.background:
            durable = stall
        if i:
            stalls.append(stall)
            overheads.append(stall + seconds - reference_steps * count / args.steps)
            durables.append(durable)
            during.extend(flying)
            copied = getattr(handle, "device_copy_seconds", None)
            if copied:
                d2h.append(handle.staged_bytes / copied / 1e9)
        if i and last >= 0:
            contender.cleanup(last)
        last = i
        train.sync()

    # Load the last timed save back into zeroed tensors on the device.
    target = _zeros_like(reference)
    loads: dict[str, float] = {}
    bitwise: dict[str, bool] = {}
    runs: list[tuple[str, int | None]] = [("default", None)]
    if args.contender == "deeppart-async":
        runs += [(str(n), n) for n in LOAD_THREADS]
    for label, threads in runs:
        for t in tensors(target):
            t.zero_()
        train.sync()
        env = os.environ.get("DEEPPART_LOAD_THREADS")
        if threads is not None:
            os.environ["DEEPPART_LOAD_THREADS"] = str(threads)
        try:
            t0 = time.perf_counter()
            contender.load(last, target)
            train.sync()
            loads[label] = time.perf_counter() - t0
        finally:
            if env is None:
                os.environ.pop("DEEPPART_LOAD_THREADS", None)
            else:
                os.environ["DEEPPART_LOAD_THREADS"] = env
        bitwise[label] = bitwise_equal(reference, target)
    contender.cleanup(last)
    contender.close()
    dist.destroy_process_group()
    return {
        "contender": args.contender,
        "ranks": 1,
        "bytes": total,
        "tensors": len(tensors(reference)),
        "step_baseline": baseline,
        "stalls": stalls,
        "overheads": overheads,
        "durables": durables,
        "step_during": _median(during),
        "steps_during": len(during),
        "d2h_gbps": d2h,
        "load_seconds": loads,
        "bitwise": bitwise,
    }


def ceilings(args: argparse.Namespace) -> dict[str, Any]:
    """Plain pinned copies of one buffer of the state's size, each way (the
    best of three), and the disk's write rate with fsync (1 GB)."""
    import torch

    out: dict[str, Any] = {}
    nbytes = int(args.gb * 1e9)
    if not args.cpu:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dev.random_(0, 255)
        t0 = time.perf_counter()
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out["pin_seconds"] = time.perf_counter() - t0
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            best = float("inf")
            for _ in range(3):
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                torch.cuda.synchronize()
                with torch.cuda.stream(stream):
                    start.record(stream)
                    dst.copy_(src, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1000)
            out[f"{name}_gbps"] = nbytes / best / 1e9
        out["device"] = torch.cuda.get_device_name(0)
        del dev, host
    path = Path(args.dir) / "disk-probe"
    block = os.urandom(8 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(1000 * 1000 * 1000 // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    out["disk_write_gbps"] = path.stat().st_size / (time.perf_counter() - t0) / 1e9
    path.unlink()
    if not args.cpu:
        out["page_cache"] = _page_cache_reads(Path(args.dir) / "cache-probe", 4 << 30)
    out["torch"] = torch.__version__
    out["cpus"] = os.cpu_count()
    return out


def _read_share(fd: int, offsets: list[int], slots: Any, k: int, dev: Any, to_device: bool) -> None:
    """One thread of :func:`_page_cache_reads`: 8 MiB at each of ``offsets``
    into its two pinned slots (slots ``2k`` and ``2k+1``), each then copied
    to ``dev`` at the same offset when ``to_device``."""
    import torch

    chunk = 8 << 20
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    events: list[Any] = [None, None]
    for j, at in enumerate(offsets):
        lo = (2 * k + j % 2) * chunk
        if events[j % 2] is not None:
            events[j % 2].synchronize()
        os.preadv(fd, [memoryview(slots[lo : lo + chunk].numpy())], at)
        if to_device:
            with torch.cuda.stream(stream):
                dev[at : at + chunk].copy_(slots[lo : lo + chunk], non_blocking=True)
            events[j % 2] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            events[j % 2].record(stream)
    stream.synchronize()


def _page_cache_reads(path: Path, nbytes: int) -> dict[str, float]:
    """GB/s of reading a file of ``nbytes`` from the page cache into pinned
    memory with several threads (8 MiB ``pread``s into two pinned slots per
    thread), without and with each chunk then copied to the device: the
    host's own ceiling for a load from the page cache."""
    import threading

    import torch

    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
    chunk = 8 << 20
    out: dict[str, float] = {}
    fd = os.open(path, os.O_RDONLY)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    try:
        for threads, to_device in ((8, False), (16, False), (8, True), (16, True)):
            slots = torch.empty(threads * 2 * chunk, dtype=torch.uint8, pin_memory=True)
            offsets = list(range(0, nbytes, chunk))

            workers = [
                threading.Thread(
                    target=_read_share, args=(fd, offsets[k::threads], slots, k, dev, to_device)
                )
                for k in range(threads)
            ]
            t0 = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            label = f"{threads} threads" + (" + copy to device" if to_device else "")
            out[label] = nbytes / (time.perf_counter() - t0) / 1e9
            del slots
    finally:
        os.close(fd)
        path.unlink()
    return out


# ----------------------------------------------------------------------------
# The run and its report.


def _run(role: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Runs one process of the benchmark (a contender, or the ceilings);
    returns its result or raises RuntimeError with the reason."""
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--role", role, "--dir", args.dir,
        "--gb", str(args.gb), "--dim", str(args.dim), "--batch", str(args.batch),
        "--saves", str(args.saves), "--steps", str(args.steps),
    ] + (["--cpu"] if args.cpu else [])  # fmt: skip
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"timed out after {timeout:.0f} s") from e
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    lines = proc.stderr.strip().splitlines() or ["no output"]
    print(f"[bench] {role} failed; the end of its stderr:", file=sys.stderr)
    print("\n".join(lines[-25:]), file=sys.stderr, flush=True)
    errors = [line for line in lines if "Error" in line or "Exception" in line]
    raise RuntimeError(f"exit status {proc.returncode}: {(errors or lines)[-1].strip()}")


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    """Our median overhead and stall over theirs."""
    return "  ".join(
        f"{key} {_median(ours[key + 's']) / _median(theirs[key + 's']):.2f}x"
        for key in ("overhead", "stall")
    )


def report(
    info: dict[str, Any], results: dict[str, dict[str, Any]], skipped: dict[str, str]
) -> str:
    """The report: the ceilings, one row per contender, DeepPart's ratios."""
    lines = []
    any_result = next(iter(results.values()), None)
    gb = any_result["bytes"] / 1e9 if any_result else float("nan")
    where = info.get("device", "CPU (no GPU: a check that every contender runs)")
    lines.append(
        f"{where}; torch {info.get('torch')}; {info.get('cpus')} CPUs; state {gb:.2f} GB "
        f"({any_result['tensors'] if any_result else '?'} tensors: bfloat16 weights + float32 "
        "AdamW moments); every contender one rank"
    )
    if "d2h_gbps" in info:
        lines.append(
            f"ceilings: device-to-host pinned copy {info['d2h_gbps']:.1f} GB/s, host-to-device "
            f"{info['h2d_gbps']:.1f} GB/s (one buffer of the state's size, best of 3; pinning "
            f"it took {info['pin_seconds']:.1f} s); disk write with fsync "
            f"{info['disk_write_gbps']:.2f} GB/s"
        )
    else:
        lines.append(f"disk write with fsync {info.get('disk_write_gbps', float('nan')):.2f} GB/s")
    if info.get("page_cache"):
        rates = ", ".join(f"{k} {v:.1f} GB/s" for k, v in info["page_cache"].items())
        lines.append(f"page cache -> pinned memory (a 4 GiB file, 8 MiB preads): {rates}")
    if info.get("workdir") == "tmpfs":
        lines.append(
            "the disk being slow, the checkpoints were written to a tmpfs (/dev/shm): "
            "'durable' there is 'written to memory', for every contender alike"
        )
    lines.append("")
    lines.append(
        f"{'contender':<22} {'overhead s':>10} {'stall s':>8} {'durable s':>9} "
        f"{'step during/without':>19} {'save GB/s':>9} {'load s':>7} {'load GB/s':>9} "
        f"{'load/H2D':>8} {'bitwise':>7}"
    )
    h2d = info.get("h2d_gbps")
    for name, r in results.items():
        durable = _median(r["durables"])
        load = r["load_seconds"]["default"]
        load_gbps = r["bytes"] / load / 1e9
        ratio = f"{load_gbps / h2d:8.2f}" if h2d else f"{'-':>8}"
        steps = r["step_during"] / r["step_baseline"] if r["steps_during"] else float("nan")
        lines.append(
            f"{name:<22} {_median(r['overheads']):10.3f} {_median(r['stalls']):8.3f} "
            f"{durable:9.2f} {steps:18.2f}x {r['bytes'] / durable / 1e9:9.2f} {load:7.2f} "
            f"{load_gbps:9.2f} {ratio} {all(r['bitwise'].values())!s:>7}"
        )
    for name, why in skipped.items():
        lines.append(f"{name:<22} not measured: {why}")
    dp = results.get("deeppart-async")
    if dp is not None:
        lines.append("")
        if dp["d2h_gbps"]:
            d2h = _median(dp["d2h_gbps"])
            ceiling = info.get("d2h_gbps")
            share = f" = {d2h / ceiling:.2f} of the ceiling" if ceiling else ""
            lines.append(
                f"deeppart-async: its snapshot's device-to-host copies {d2h:.1f} GB/s{share}"
            )
        sweep = ", ".join(
            f"{k} threads {dp['bytes'] / v / 1e9:.1f} GB/s"
            for k, v in dp["load_seconds"].items()
            if k != "default"
        )
        if sweep:
            lines.append(f"deeppart load into device tensors by reader threads: {sweep}")
        others = {n: r for n, r in results.items() if not n.startswith("deeppart")}
        for name, r in others.items():
            load = r["load_seconds"]["default"] / dp["load_seconds"]["default"]
            lines.append(f"deeppart-async vs {name:<19} {_ratios(dp, r)}  load {load:.2f}x faster")
        dev = results.get("deeppart-async-device")
        if dev is not None:
            for name, r in others.items():
                lines.append(f"deeppart-async-device vs {name:<12} {_ratios(dev, r)}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--gb", type=float, default=10.0, help="state size in GB (default 10)")
    p.add_argument("--dim", type=int, default=8192, help="weight matrices' side (default 8192)")
    p.add_argument("--batch", type=int, default=4096, help="rows of the batch (default 4096)")
    p.add_argument("--saves", type=int, default=2, help="timed saves per contender (default 2)")
    p.add_argument(
        "--steps", type=int, default=10, help="training steps before and after a save (10)"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help="default: all, in order")
    p.add_argument("--cpu", action="store_true", help="no GPU: CPU tensors, no pinned memory")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--out", default=None, help="also write the report to this file")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="wall-clock budget: contenders that would start too late are skipped (420)",
    )
    p.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role is not None:
        result = ceilings(args) if args.role == "ceilings" else None
        if result is None:
            args.contender = args.role
            result = worker(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise SystemExit(f"unknown contenders {sorted(unknown)}; choose from {CONTENDERS}")
    if not args.cpu:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --cpu to check the script on the CPU")
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="deeppart-gpu-")
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    skipped: dict[str, str] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        info = _run("ceilings", args, args.budget_s)
        print(f"[bench] ceilings: {json.dumps(info)}", file=sys.stderr, flush=True)
        info["workdir"] = "disk"
        shm = Path("/dev/shm")
        if (
            made
            and info["disk_write_gbps"] < SLOW_DISK_GBPS
            and shm.is_dir()
            and shutil.disk_usage(shm).free > 3.5 * args.gb * 1e9
        ):
            # A slow disk would take most of the budget in fsyncs: the
            # checkpoints go to memory, and the report says so.
            shutil.rmtree(args.dir, ignore_errors=True)
            args.dir = tempfile.mkdtemp(prefix="deeppart-gpu-", dir=shm)
            info["workdir"] = "tmpfs"
        longest = 0.0
        for name in contenders:
            if name == "torch-checkpointing" and not importlib.util.find_spec(
                "torch_checkpointing"
            ):
                skipped[name] = "torch_checkpointing is not installed (requirements/bench.txt)"
                continue
            left = args.budget_s - (time.perf_counter() - start)
            if left < 1.2 * longest or left <= 0:
                skipped[name] = f"the time budget (--budget-s {args.budget_s:.0f}) ran out"
                continue
            t0 = time.perf_counter()
            try:
                results[name] = r = _run(name, args, min(left, CONTENDER_TIMEOUT_S))
            except RuntimeError as e:
                skipped[name] = f"its job failed ({e})"
                continue
            finally:
                longest = max(longest, time.perf_counter() - t0)
                with contextlib.suppress(OSError):
                    shutil.rmtree(Path(args.dir) / name)
            print(
                f"[bench] {name}: overhead {_median(r['overheads']):.3f} s, stall "
                f"{_median(r['stalls']):.3f} s, durable {_median(r['durables']):.2f} s, load "
                f"{r['load_seconds']['default']:.2f} s, bitwise {all(r['bitwise'].values())} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    text = report(info, results, skipped)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        data = {"info": info, "results": results, "skipped": skipped}
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
