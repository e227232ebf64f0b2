"""What the multi-rank benchmarks share: the benchmark state, a worker's
set-up (MPI, gloo, the state, its work directory, the warm-up) and running
a job under mpiexec for its result.

bench/checkpoint.py and bench/async.py run their workers through
:func:`start_worker`, and their jobs through :func:`mpi_env` and
:func:`job_result`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import adamw_param_groups, bert_params

#: Environment that makes a job's ranks buffer their output again when the
#: caller runs unbuffered (``PYTHONUNBUFFERED=1``): unbuffered, ``print``
#: writes a line and its newline in two calls, and the lines that ranks
#: print concurrently (each rank's ``RESULT``) interleave on the pipe.
BUFFERED = {"PYTHONUNBUFFERED": ""}

#: The float dtypes ``build_state`` makes (``--dtype`` of the benchmarks).
DTYPES = ("float32", "bfloat16")


def build_state(
    scale: float, seed: int = 0, dtype: str = "float32", hidden: int = 1024
) -> dict[str, Any]:
    """BERT-large's parameters (layer shapes from bench/models.py, the
    vocabulary and the number of layers scaled by ``scale``) and AdamW's two
    moments and step per parameter, random, in ``dtype``: about ``scale *
    4.0 GB`` in float32 (bfloat16: half). A smaller ``hidden`` (the
    feed-forward width is 4x it) shrinks every layer for a smaller state."""
    import torch

    dt = getattr(torch, dtype)
    layers = max(1, round(24 * scale))
    vocab = max(64, round(30522 * scale))
    named = bert_params(vocab=vocab, hidden=hidden, layers=layers, intermediate=4 * hidden)
    gen = torch.Generator().manual_seed(seed)
    model = {name: (torch.randn(shape, generator=gen) * 0.02).to(dt) for name, shape in named}
    state: dict[int, dict[str, Any]] = {}
    for i, (_, shape) in enumerate(named):
        state[i] = {
            "step": torch.tensor(1000.0),
            "exp_avg": (torch.randn(shape, generator=gen) * 1e-3).to(dt),
            "exp_avg_sq": (torch.rand(shape, generator=gen) * 1e-6).to(dt),
        }
    return {
        "model": model,
        "optim": {"state": state, "param_groups": adamw_param_groups(len(named))},
    }


@dataclass
class Worker:
    """One rank of a benchmark job, set up by :func:`start_worker`."""

    comm: Any
    rank: int
    size: int
    state: dict[str, Any]
    #: The state's bytes.
    total: int
    #: This job's work directory (made).
    base: Path


def start_worker(
    scale: float,
    directory: str | Path,
    name: str,
    *,
    bcast_bytes: int,
    reduce_floats: int,
    dtype: str = "float32",
) -> Worker:
    """A benchmark rank: one torch thread, MPI and gloo initialised, the
    state built, ``directory/name`` made, and an untimed warm-up (MPI's and
    gloo's first large messages set up shared memory, over a second here,
    which would otherwise land on whichever contender runs first): a
    broadcast of ``bcast_bytes`` and an all-reduce of ``reduce_floats``."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import deeppart

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    dist.init_process_group("gloo", rank=rank, world_size=size)
    state = build_state(scale, dtype=dtype)
    total = deeppart.Manifest.from_state_dict(state).total_bytes
    base = Path(directory) / name
    base.mkdir(parents=True, exist_ok=True)
    comm.Bcast(np.zeros(bcast_bytes, dtype=np.uint8), root=0)
    dist.all_reduce(torch.zeros(reduce_floats))
    return Worker(comm, rank, size, state, total, base)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def mpi_env() -> dict[str, str]:
    """The environment of a job: gloo's rendezvous on a free local port,
    one OpenMP thread per rank, and buffered output (:data:`BUFFERED`)."""
    return dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
        **BUFFERED,
    )


def job_result(cmd: list[str], env: dict[str, str], timeout: float | None = None) -> dict[str, Any]:
    """Runs a benchmark job (``cmd``, usually under mpiexec) and returns the
    JSON its rank 0 printed after ``RESULT``; exits on failure. With
    ``timeout`` (seconds) the job runs in its own session, whose processes
    are all killed when it runs longer."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, text=True, start_new_session=timeout is not None
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SystemExit(f"{' '.join(cmd)} hung (over {timeout} s)") from None
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with status {proc.returncode}")
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise SystemExit(f"no result from {' '.join(cmd)}:\n{stdout}")
