"""``deeppart demo``: data-parallel training with checkpoints, a crash, and a
bitwise-exact restart.

The demo (one process, no MPI) launches ``mpiexec -n RANKS`` three times:

1. *reference*: train a small transformer (AdamW, fixed synthetic data,
   gradients all-reduced with mpi4py) for ``--steps`` steps without a
   crash; record every loss and a digest of the final state; time
   ``torch.save`` / ``torch.load`` against :func:`deeppart.save` /
   :func:`deeppart.load` of the same state.
2. *crash*: the same training, checkpointing every ``--every`` steps with a
   :class:`deeppart.Checkpointer`; during the save at ``--crash-at`` the last
   rank SIGKILLs itself after writing its data file, so the job dies
   mid-save.
3. *resume*: a new job restores the latest committed checkpoint (the
   partial one is ignored), checks it is bitwise identical to the state
   that was saved, and trains to the end.

Finally it checks that the resumed run's losses and final parameters equal
the uninterrupted run's bit for bit, and restores the final checkpoint in
this single process (elastic: RANKS writers, one reader).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from deeppart._planner import Manifest
from deeppart.checkpointer import Checkpointer
from deeppart.loading.load import load
from deeppart.saving.save import save

VOCAB, SEQ, BATCH, D_MODEL, LAYERS, FF, HEADS = 512, 32, 8, 128, 2, 512, 4


def _log(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


# ----------------------------------------------------------------------------
# Training (runs inside mpiexec).


def _build(seed: int = 0) -> tuple[Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
            layer = nn.TransformerEncoderLayer(
                D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True
            )
            self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
            self.head = nn.Linear(D_MODEL, VOCAB)

        def forward(self, tokens: Any) -> Any:
            return self.head(self.encoder(self.embed(tokens) + self.pos))

    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return model, opt


def _batch(step: int, rank: int) -> tuple[Any, Any]:
    """Fixed synthetic data: each rank's batch depends only on (step, rank);
    the target is a fixed function of the input token."""
    import torch

    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    y = (x * 7 + 3) % VOCAB
    return x, y


def _train_step(model: Any, opt: Any, step: int, comm: Any) -> float:
    """One data-parallel step: local loss, gradients all-reduced (one flat
    buffer), identical AdamW update on every rank. Returns the mean loss."""
    import torch
    from mpi4py import MPI

    x, y = _batch(step, comm.Get_rank())
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    opt.zero_grad(set_to_none=False)
    loss.backward()  # type: ignore[no-untyped-call]
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params]).numpy()
    comm.Allreduce(MPI.IN_PLACE, [flat, MPI.FLOAT], op=MPI.SUM)
    flat /= comm.Get_size()
    pos = 0
    for p in params:
        n = p.grad.numel()
        p.grad.copy_(torch.from_numpy(flat[pos : pos + n]).reshape(p.grad.shape))
        pos += n
    opt.step()
    total = np.array([loss.item()], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, [total, MPI.DOUBLE], op=MPI.SUM)
    return float(total[0] / comm.Get_size())


def _state(model: Any, opt: Any, step: int, losses: list[float]) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "losses": losses}


def state_digest(state: Any) -> str:
    """sha256 over every leaf: path, dtype, shape and raw bytes of tensors,
    the plain encoding of values. Equal digests mean bitwise-equal states."""
    from deeppart.state.state import flatten

    h = hashlib.sha256()
    leaves, skeleton = flatten(state)
    h.update(json.dumps(skeleton).encode())
    for leaf in leaves:
        h.update(repr(leaf.path).encode())
        if leaf.tensor is not None:
            import torch

            t = leaf.tensor.detach().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            assert leaf.encoded is not None
            h.update(leaf.encoded)
    return h.hexdigest()


def _fsynced_torch_save(state: Any, path: Path) -> None:
    import torch

    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _arm_crash(rank: int, step: int) -> None:
    """Fault injection for the demo only, through the writer's named hook
    (:func:`deeppart.saving.writer.add_fault_hook`): this rank's next data-file
    write completes, then the process SIGKILLs itself, mid-save."""
    from deeppart.saving.writer import WriteEvent, add_fault_hook

    def dying(event: WriteEvent) -> None:
        print(
            f"[demo] crash: rank {rank} wrote its part of step {step} ({event.path.name}), "
            "then SIGKILLs itself (simulated node failure)",
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)

    add_fault_hook("after-write", dying)


def _worker(args: argparse.Namespace) -> int:
    import torch
    from mpi4py import MPI

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    out = Path(args.dir)
    say = _log if rank == 0 else (lambda _msg: None)
    model, opt = _build()
    losses: list[float] = []
    start = 0
    cp = Checkpointer(out / "ckpt", comm=comm, keep_last=2)

    if args.worker == "resume":
        step = cp.latest()
        if step is None:
            raise SystemExit("no committed checkpoint to resume from")
        t0 = time.perf_counter()
        restored = cp.load(step)
        dt = time.perf_counter() - t0
        saved = json.loads((out / "digests" / f"{step}.txt").read_text())
        got = state_digest(restored)
        if got != saved:
            raise SystemExit(f"restored state differs from the saved one: {got} != {saved}")
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optim"])
        # The live objects now hold exactly the saved state.
        if state_digest(_state(model, opt, restored["step"], restored["losses"])) != saved:
            raise SystemExit("model/optimizer after load_state_dict differ from the checkpoint")
        start, losses = int(restored["step"]), list(restored["losses"])
        say(
            f"resume: restored step {step} on {size} ranks in {dt:.3f} s; "
            f"state digest {got[:16]}... equals the digest taken at save time: BITWISE IDENTICAL"
        )

    for step in range(start, args.steps):
        losses.append(_train_step(model, opt, step, comm))
        done = step + 1
        if rank == 0 and (done % 5 == 0 or done == args.steps):
            _log(f"{args.worker}: step {done:3d}  loss {losses[-1]:.6f}")
        if args.worker == "reference":
            continue
        if done % args.every == 0 or done == args.steps:
            state = _state(model, opt, done, losses)
            if args.worker == "crash" and done == args.crash_at and rank == size - 1:
                _arm_crash(rank, done)
            digest = state_digest(state)
            stats = cp.save(done, state).wait()
            if rank == 0:
                (out / "digests").mkdir(exist_ok=True)
                (out / "digests" / f"{done}.txt").write_text(json.dumps(digest))
                _log(f"{args.worker}: checkpoint step {done}: {stats.summary()[11:]}")

    if rank == 0:
        result = {"losses": losses, "digest": state_digest(_state(model, opt, args.steps, losses))}
        (out / f"{args.worker}.json").write_text(json.dumps(result))

    if args.worker == "reference":
        _compare_timings(_state(model, opt, args.steps, losses), out / "timing", comm)
    return 0


def _compare_timings(state: Any, d: Path, comm: Any) -> None:
    """torch.save on rank 0 vs deeppart.save on all ranks, and torch.load on
    every rank vs deeppart.load, of the same state, each fsynced/fresh."""
    import torch

    rank = comm.Get_rank()
    d.mkdir(parents=True, exist_ok=True)
    comm.Barrier()
    t0 = time.perf_counter()
    if rank == 0:
        _fsynced_torch_save(state, d / "state.pt")
    comm.Barrier()
    t_tsave = time.perf_counter() - t0
    t0 = time.perf_counter()
    save(state, d / "deeppart", comm=comm, overwrite=True)
    t_dsave = time.perf_counter() - t0
    comm.Barrier()
    t0 = time.perf_counter()
    loaded_t = torch.load(d / "state.pt", weights_only=True)
    comm.Barrier()
    t_tload = time.perf_counter() - t0
    t0 = time.perf_counter()
    loaded_d = load(d / "deeppart", comm=comm)
    comm.Barrier()
    t_dload = time.perf_counter() - t0
    same = state_digest(loaded_d) == state_digest(state) == state_digest(loaded_t)
    if rank == 0:
        mb = Manifest.from_state_dict(state).total_bytes / 1e6
        _log(f"timing, same {mb:.1f} MB state, {comm.Get_size()} ranks, fsync on both sides:")
        _log(f"  torch.save (rank 0 writes all)   {t_tsave * 1e3:8.1f} ms")
        _log(f"  deeppart.save (every rank)       {t_dsave * 1e3:8.1f} ms")
        _log(f"  torch.load (every rank)          {t_tload * 1e3:8.1f} ms")
        _log(f"  deeppart.load (every rank)       {t_dload * 1e3:8.1f} ms")
        _log(f"  both loads bitwise equal to the live state: {same}")
        _log("  (a state this small is dominated by fixed costs; see bench/checkpoint.py)")
    if not same:
        raise SystemExit("a loaded state differs from the saved one")


# ----------------------------------------------------------------------------
# Orchestration (one process, no MPI).


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise SystemExit("deeppart demo: mpiexec not found (pip install mpich)")
    return found


def _launch(args: argparse.Namespace, phase: str) -> int:
    cmd = [
        _mpiexec(),
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "deeppart",
        "demo",
        "--worker",
        phase,
        "--dir",
        str(args.dir),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--crash-at",
        str(args.crash_at),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env).returncode


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    from deeppart.comm import launched_by_mpiexec

    if launched_by_mpiexec():
        raise SystemExit(
            "deeppart demo launches mpiexec itself (it has to survive the crash it simulates): "
            "run `deeppart demo --ranks 4`, not under mpiexec"
        )
    if not (0 < args.every <= args.crash_at < args.steps and args.crash_at % args.every == 0):
        raise SystemExit(
            "need 0 < --every <= --crash-at < --steps, and --crash-at a multiple of --every"
        )

    owned = args.dir is None
    args.dir = Path(args.dir or tempfile.mkdtemp(prefix="deeppart-demo-"))
    if args.dir.exists():
        shutil.rmtree(args.dir)
    args.dir.mkdir(parents=True)
    t_start = time.perf_counter()
    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        _log(f"{'PASS' if cond else 'FAIL'}: {what}")
        ok = ok and cond

    _log(f"1/3 reference: {args.steps} uninterrupted steps on {args.ranks} ranks")
    if _launch(args, "reference") != 0:
        raise SystemExit("the reference run failed")
    _log(
        f"2/3 crash: checkpoints every {args.every} steps; a rank dies during the save at "
        f"step {args.crash_at}"
    )
    _log(f"    a crash is coming, on purpose: rank {args.ranks - 1} will SIGKILL itself during "
         f"that save, and MPICH will then print a \"BAD TERMINATION OF ONE OF YOUR APPLICATION "
         f"PROCESSES ... EXIT CODE: 9\" banner. That banner is expected; the demo goes on "
         f"after it.")  # fmt: skip
    rc = _launch(args, "crash")
    check(rc != 0, f"the training job died as planned (mpiexec exit status {rc}: the "
                   f"SIGKILL above, expected)")  # fmt: skip
    cp = Checkpointer(args.dir / "ckpt")
    partial = [p.name for p in (args.dir / "ckpt").iterdir() if p.name.startswith(".tmp-")]
    latest = cp.latest()
    check(
        latest == args.crash_at - args.every,
        f"latest committed checkpoint is step {latest}; the interrupted save of step "
        f"{args.crash_at} ({', '.join(partial) or 'no directory'}) is ignored",
    )
    _log("3/3 resume: a new job restores the latest checkpoint and trains on")
    if _launch(args, "resume") != 0:
        raise SystemExit("the resumed run failed")

    ref = json.loads((args.dir / "reference.json").read_text())
    res = json.loads((args.dir / "resume.json").read_text())
    check(len(ref["losses"]) == len(res["losses"]) == args.steps, "both runs have every loss")
    diff = [i for i, (a, b) in enumerate(zip(ref["losses"], res["losses"], strict=True)) if a != b]
    check(
        not diff,
        f"all {args.steps} losses are exactly equal (first differing step: "
        f"{diff[0] if diff else 'none'}); last loss {res['losses'][-1]!r}",
    )
    check(
        ref["digest"] == res["digest"],
        f"final model + optimizer state bitwise equal (sha256 {res['digest'][:16]}...)",
    )
    final = load(cp.path(args.steps))  # elastic: RANKS writers, 1 reader, no MPI
    check(
        state_digest(final) == ref["digest"],
        f"the final checkpoint, written by {args.ranks} ranks, loads in 1 process without MPI "
        "and matches bitwise",
    )
    _log(
        f"{'ALL CHECKS PASSED' if ok else 'SOME CHECKS FAILED'} in "
        f"{time.perf_counter() - t_start:.1f} s (files in {args.dir})"
    )
    if owned and ok and not args.keep:
        shutil.rmtree(args.dir)
    return 0 if ok else 1


def plain_text(doc: str) -> str:
    """A reST docstring as ``--help`` prints it: without its markup
    (````code````, ``:role:`target```, ``*emphasis*``)."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", doc)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="train on several MPI ranks, checkpoint, crash, restore, verify bitwise",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--ranks", "-n", type=int, default=4, help="MPI ranks (default 4)")
    p.add_argument("--steps", type=int, default=30, help="training steps (default 30)")
    p.add_argument("--every", type=int, default=10, help="checkpoint interval (default 10)")
    p.add_argument("--crash-at", type=int, default=20, help="step whose save is interrupted")
    p.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the temp directory")
    p.add_argument("--worker", choices=["reference", "crash", "resume"], help=argparse.SUPPRESS)
    p.set_defaults(func=run)
