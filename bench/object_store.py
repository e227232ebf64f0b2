"""Checkpoints in object storage: DeepPart against ``torch.save`` on rank 0
and DCP's S3 writer, on 1, 2 and 4 simulated nodes, each with its own shaped
link to one S3 server (run as root; not run in CI).

    .venv/bin/python bench/object_store.py          # 1,2,4 nodes x 1,2 ranks, 100mbit links
    .venv/bin/python bench/object_store.py --nodes 1,2,4,8 --ranks-per-node 1,4 --rate 200mbit

The nodes are the multi-node test harness's (tests/support/cluster.py, ``net=True``):
each node is a network namespace whose ``eth0`` is one end of a veth pair
on a bridge in a head namespace. Each node's link is shaped to ``--rate``
both ways with a token bucket (``tc qdisc ... tbf``: on the node's ``eth0``
for what it sends, on the veth's head end for what it receives), and one S3
server listens in the head namespace (the host side of every link), its data
on a tmpfs, so that every node reaches the store through its own link, as
nodes reach a store through their NICs. MPI (hydra over the harness's ssh
stand-in) and gloo run over the same links.

Every namespace's TCP uses ``--tcp-cc`` (default ``reno``, loss-based like
Linux's default ``cubic``, and allowed in any namespace; ``host`` leaves
the host's). The token bucket queues up to 50 ms of a link's traffic in
one FIFO per direction (the kernel here has no ``fq`` to put behind it).
A node that sends at its link's rate holds the ACKs of what it receives
in that queue; BBR (this host's default) caps what a flow has in flight
at twice its rate times the shortest round trip it has seen (well under
a millisecond here), so behind 50 ms of queued ACKs a flow into a busy
sender runs at a fraction of the link: measured 3-5 MB/s of 12. Only a load
that sends and receives at once (DeepPart's cooperative load at one rank
per node) meets it; a NIC's short queue does not delay ACKs that long.
The report names the TCP in use. ``--trace FILE`` writes, for the last
round of loads, each rank's node link MB/s in and out per 0.25 s (its
counters read every 20 ms), which shows this.

Every node count runs with each ``--ranks-per-node`` (default 1 and 2):
one rank per node is the hardest case for a cooperative load (each node
must receive the whole state through its link whatever the method, so
the gain can only come from using the link better), several ranks per
node are what training jobs run (the thesis: 4 processes per node; GPU
nodes: 4 or 8), where every rank of DCP and of ``torch.load`` reads the
whole checkpoint through its node's one link, and DeepPart brings each
byte to each node once.

The server is ``s3s-fs`` (crates.io; an S3 server over a directory, written
in Rust): when it is not on ``PATH`` nor in ``~/.cache/deeppart/s3s-fs``,
this script installs it there with ``cargo install`` (it says so first; a
few minutes). ``--server moto`` uses moto's server mode instead (``pip
install "moto[server]"``; Python and in memory: measured slower). The
Python packages the contenders need are in requirements/bench.txt; when one
is missing the script installs that file with pip into the running
interpreter (it says so). When something cannot be had (not root, no
network namespaces, no ``tc``, no server, no packages), it prints
``object_store: skipped: <why>`` and exits 0.

Before the contenders, the script measures the server's own throughput
from the head namespace (no shaping; several parallel PUTs, then GETs) and
one node's shaped link (one PUT and one GET through it); the first must be
well above ``nodes x rate`` for the links to be the bottleneck, and both go
into the simulator's model.

The contenders, each in the same job, on the same replicated state
(bench/jobs.py's BERT-large-shaped model + AdamW, ``--scale``; every rank
holds all of it, as in data parallelism):

- ``torch``: rank 0 ``torch.save`` into memory, then uploaded with boto3's
  managed transfer (multipart, parallel parts); its load: every rank
  downloads the object and ``torch.load(weights_only=True)`` (what a
  data-parallel restart does);
- ``dcp``: ``torch.distributed.checkpoint`` ``save`` / ``load`` (in place)
  with the S3 connector for PyTorch's ``S3StorageWriter`` /
  ``S3StorageReader`` (PyPI ``s3torchconnector[dcp]``), or, where that
  cannot reach the server, fsspec's ``FsspecWriter`` / ``FsspecReader``
  over s3fs (``--dcp`` chooses; the report says which ran and why);
- ``deeppart``: ``deeppart.save(state, "s3://BUCKET/...")`` and
  ``deeppart.load(url, into=state)`` (the endpoint and credentials from
  ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... as for any S3 client);
- ``dcp-zstd``: DCP's writer with its own lossless compression
  (``_extensions=[ZStandard()]``, torch's stream extension: each written
  item zstd-compressed; the reader decompresses);
- ``dp-zstd``: DeepPart with ``compression=`` ``--compression`` (default
  ``shuffle-zstd``, lossless): the store holds, and the load's exchange
  between nodes carries, the compressed bytes. ``--compression none``
  leaves these two out.
- ``dp-read`` (loads only): DeepPart's load of ``deeppart``'s checkpoint
  with ``exchange="read"``: every rank fetches and checks every byte
  itself, as DCP's ranks do, and nothing crosses between nodes; the store
  serves each byte once per rank instead of once per job. Beside the
  default cooperative load it shows the choice a job has when its store
  serves every node at its link's full rate: at one rank per node the
  cooperative load sends three quarters of the state over each node's
  link in both directions, the direct one only receives.
  Where this DeepPart cannot save to or load from S3, its column says so
  with the error; no number stands in for it.

Method (bench/checkpoint.py's): an untimed warm-up of every contender on a
small state, then ``--repeat`` rounds, saves first, then loads, every
contender once per round in a new shuffled order (the same on every rank);
each time runs from an MPI barrier to the barrier after the slowest rank
returns. Each save goes to a new prefix and the previous round's prefix is
deleted afterwards (untimed). Before each load every tensor of the state
is overwritten with a sentinel (untimed); after it the loaded state is
compared bitwise with the saved one (untimed); a load that returns other
bytes is reported as failed, not timed. The report gives each contender's
median time, and for DeepPart the median over the rounds of the within-
round ratios torch/deeppart and dcp/deeppart, beside the simulator's
prediction (deeppart/tools/simulate.py, ``deeppart simulate``'s model: the
job's ranks per node, the measured link as ``net_bw``, the measured server as
``pfs_bw`` and the measured unshaped single stream as ``rank_bw``) of the
save ratios torch.save/balanced and dcp-dedup/balanced at level L4. The
simulator models saves only; at one rank per node a replicated load must
bring every byte to every node over its own link whatever the method, so
the load ratios are expected near 1; at k ranks per node DCP's and
torch.load's ranks each read everything, DeepPart's node receives each
byte once: near k.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "tests" / "support"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CONTENDERS = ("torch", "dcp", "deeppart")
#: DCP with its own lossless compression (torch's ZStandard stream
#: extension), and DeepPart saving with ``--compression``: the columns of
#: the compressed comparison (left out with ``--compression none``).
DCP_COMPRESSED = "dcp-zstd"
COMPRESSED = "dp-zstd"
#: DeepPart's load of ``deeppart``'s checkpoint with ``exchange="read"``:
#: every rank fetches every byte from the store itself, as DCP's ranks do
#: (load only; its own column and ratio in the load table).
DIRECT = "dp-read"
BUCKET = "deeppart-bench"
ACCESS_KEY = "deeppartbench"
SECRET_KEY = "deeppartbenchsecret"
REGION = "us-east-1"
#: s3s-fs's last release that builds with this project's Rust (1.95).
S3S_FS_VERSION = "0.14.1"
S3S_FS_ROOT = Path.home() / ".cache" / "deeppart" / "s3s-fs"
PORT = 9077
#: The modules the contenders import, and where requirements/bench.txt has them.
BENCH_MODULES = ("boto3", "s3fs", "s3torchconnector")
#: Bytes of each object of the raw-throughput probes.
PROBE_BYTES = 32 << 20
PROBE_STREAMS = 4


def contenders(compression: str, op: str = "load") -> tuple[str, ...]:
    """The contenders of ``op`` (``"save"`` or ``"load"``), in the order of
    the report's columns."""
    names = CONTENDERS if compression == "none" else (*CONTENDERS, DCP_COMPRESSED, COMPRESSED)
    return names if op == "save" else (*names, DIRECT)


def log(msg: str) -> None:
    print(f"[object_store] {msg}", file=sys.stderr, flush=True)


class Skip(Exception):
    """Something this benchmark needs cannot be had here."""


# ---------------------------------------------------------------------------
# What the host needs: root, namespaces, tc, a server, the packages.


def host_unavailable() -> str | None:
    import cluster

    why = cluster.unavailable() or cluster.net_unavailable()
    if why:
        return f"the multi-node harness cannot run here: {why}"
    if shutil.which("tc") is None:
        return "needs tc (iproute2) to shape the links"
    return None


def ensure_packages() -> None:
    """Imports the contenders' packages, installing requirements/bench.txt
    with pip first when one is missing."""
    missing = [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return
    req = ROOT / "requirements" / "bench.txt"
    log(f"installing {req.relative_to(ROOT)} with pip (missing: {', '.join(missing)})")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "-r", str(req)],
        capture_output=True,
        text=True,
    )
    importlib.invalidate_caches()
    still = [m for m in BENCH_MODULES if importlib.util.find_spec(m) is None]
    if proc.returncode != 0 or still:
        raise Skip(f"cannot install {req}: {proc.stderr.strip()[-800:] or still}")


def s3s_fs_binary() -> Path:
    """The ``s3s-fs`` executable: on PATH, in :data:`S3S_FS_ROOT`, or built
    there by ``cargo install`` now."""
    found = shutil.which("s3s-fs")
    if found:
        return Path(found)
    cached = S3S_FS_ROOT / "bin" / "s3s-fs"
    if cached.exists():
        return cached
    cargo = shutil.which("cargo")
    if cargo is None:
        raise Skip("no s3s-fs and no cargo to build it (or run with --server moto)")
    log(f"installing s3s-fs {S3S_FS_VERSION} into {S3S_FS_ROOT} with cargo (a few minutes)")
    proc = subprocess.run(
        [cargo, "install", "s3s-fs", "--version", S3S_FS_VERSION, "--locked",
         "--features", "binary", "--root", str(S3S_FS_ROOT)],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if proc.returncode != 0 or not cached.exists():
        raise Skip(f"cargo install s3s-fs failed: {proc.stderr.strip()[-800:]}")
    return cached


def _die_with_parent() -> None:
    """In the server's child process: SIGKILL it when this script dies, so
    a killed benchmark leaves no server behind (the harness's sweep removes
    the namespaces and the tmpfs)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Server:
    """The S3 server in the head namespace, at :attr:`endpoint`."""

    proc: subprocess.Popen[bytes]
    endpoint: str
    kind: str

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(kind: str, head_ns: str, host: str, data: Path, logfile: Path) -> Server:
    if kind == "s3s-fs":
        binary = s3s_fs_binary()
        argv = [str(binary), "--host", host, "--port", str(PORT),
                "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, str(data)]  # fmt: skip
        (data / BUCKET).mkdir(exist_ok=True)  # a bucket is a directory
    else:
        moto = Path(sys.executable).parent / "moto_server"
        if not moto.exists():
            raise Skip('--server moto needs moto\'s server mode: pip install "moto[server]"')
        argv = [str(moto), "-H", host, "-p", str(PORT)]
    with open(logfile, "wb") as out:
        proc = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{head_ns}", "--", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
    return Server(proc, f"http://{host}:{PORT}", kind)


def s3_env(endpoint: str) -> dict[str, str]:
    """The S3 ecosystem's variables every client here reads."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def tbf(ns: str, dev: str, rate: str) -> None:
    """What ``dev`` in network namespace ``ns`` sends capped at ``rate``
    (a token bucket queueing up to 50 ms)."""
    subprocess.run(
        ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
         "rate", rate, "burst", "512kb", "latency", "50ms"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip


def shape(c: Any, nodes: int, rate: str) -> None:
    """Every node's link capped at ``rate`` both ways (a token bucket on
    each end of its veth pair)."""
    for k in range(nodes):
        for ns, dev in ((f"{c.tag}n{k}", "eth0"), (f"{c.tag}head", f"v{k}")):
            tbf(ns, dev, rate)


def await_server(server: Server, ns: str, host: str, logfile: Path) -> None:
    """Returns once ``server`` (in network namespace ``ns``) accepts a
    connection at ``host``; :class:`Skip` if it exits first."""
    connect = "import socket,sys; socket.create_connection((sys.argv[1], sys.argv[2]), 1)"
    for _ in range(50):
        time.sleep(0.2)
        if server.proc.poll() is not None:
            text = logfile.read_text(errors="replace")[-800:]
            raise Skip(f"the {server.kind} server exited: {text}")
        ready = subprocess.run(
            ["nsenter", f"--net=/run/netns/{ns}", "--", sys.executable, "-c", connect, host,
             str(PORT)],
            capture_output=True,
        )  # fmt: skip
        if ready.returncode == 0:
            return


def host_tcp_cc() -> str:
    """The host's default TCP congestion control (what a new network
    namespace starts with)."""
    return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()


def set_tcp_cc(c: Any, nodes: int, cc: str) -> None:
    """Every node's namespace and the head's (the server's) use the TCP
    congestion control ``cc`` ("host": leave the host's)."""
    if cc == "host":
        return
    for ns in [f"{c.tag}n{k}" for k in range(nodes)] + [f"{c.tag}head"]:
        done = subprocess.run(
            ["ip", "netns", "exec", ns, "sysctl", "-w", f"net.ipv4.tcp_congestion_control={cc}"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            raise Skip(
                f"cannot use TCP congestion control {cc!r} in namespace {ns}: "
                f"{done.stderr.strip()} (--tcp-cc host keeps the host's, {host_tcp_cc()})"
            )


def rate_bytes(rate: str) -> float:
    """``tc``'s rate syntax (``400mbit``, ``1gbit``, ``50mbps``) in bytes/s."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "kbps": 1e3, "mbps": 1e6,
             "gbps": 1e9, "bit": 1 / 8, "bps": 1.0}  # fmt: skip
    for unit in sorted(units, key=len, reverse=True):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * units[unit]
    raise ValueError(f"bad rate {rate!r} (e.g. 400mbit)")


# ---------------------------------------------------------------------------
# Raw throughput probes (run inside a namespace by `--probe`).


def _client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=32),
    )


def probe(streams: int, nbytes: int) -> None:
    """Prints ``{"put": B/s, "get": B/s}``: ``streams`` parallel PUTs of
    ``nbytes`` each, then GETs of them (single requests, boto3)."""
    from concurrent.futures import ThreadPoolExecutor

    s3 = _client()
    with contextlib.suppress(Exception):
        s3.create_bucket(Bucket=BUCKET)
    blob = os.urandom(nbytes)
    keys = [f"probe/{os.getpid()}-{i}" for i in range(streams)]
    with ThreadPoolExecutor(streams) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda k: s3.put_object(Bucket=BUCKET, Key=k, Body=blob), keys))
        put = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = list(pool.map(lambda k: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read(), keys))
        get = time.perf_counter() - t0
    assert all(g == blob for g in got), "probe: the server returned other bytes"
    for k in keys:
        s3.delete_object(Bucket=BUCKET, Key=k)
    print("PROBE " + json.dumps({"put": streams * nbytes / put, "get": streams * nbytes / get}))


def run_probe(prefix: list[str], env: dict[str, str], streams: int, nbytes: int) -> dict[str, Any]:
    argv = [*prefix, sys.executable, str(Path(__file__).resolve()), "--probe",
            str(streams), str(nbytes)]  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            got: dict[str, Any] = json.loads(line[len("PROBE ") :])
            return got
    raise Skip(f"the throughput probe failed: {proc.stderr.strip()[-1500:]}")


# ---------------------------------------------------------------------------
# The worker: one job of nodes x ranks per node.


#: ``--trace``: seconds between two reads of a node's link counters, and
#: the width of the bins whose rates the trace reports.
TRACE_SAMPLE_S = 0.02
TRACE_BIN_S = 0.25


class LinkSampler:
    """Reads this namespace's link counters every :data:`TRACE_SAMPLE_S`
    in a thread, from :meth:`start` to :meth:`stop`: (seconds since
    ``start``, bytes received, bytes sent)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = 0.0

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter() - self._t0, *link_counters()))
            if self._stop.wait(TRACE_SAMPLE_S):
                break

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread.start()

    def stop(self) -> list[tuple[float, int, int]]:
        self._stop.set()
        self._thread.join()
        self.samples.append((time.perf_counter() - self._t0, *link_counters()))
        return self.samples


def link_rates(
    samples: list[tuple[float, int, int]], bin_s: float = TRACE_BIN_S
) -> list[tuple[float, float]]:
    """MB/s into and out of the link in each ``bin_s`` from the first
    sample: the counters' change between the first and the last sample
    inside the bin over the time between them; (0, 0) for a bin with fewer
    than two samples."""
    if not samples:
        return []
    out: list[tuple[float, float]] = []
    edge = samples[0][0]
    end = samples[-1][0]
    while edge < end:
        inside = [x for x in samples if edge <= x[0] < edge + bin_s]
        dt = inside[-1][0] - inside[0][0] if len(inside) > 1 else 0.0
        if dt > 0:
            (_, rx0, tx0), (_, rx1, tx1) = inside[0], inside[-1]
            out.append(((rx1 - rx0) / dt / 1e6, (tx1 - tx0) / dt / 1e6))
        else:
            out.append((0.0, 0.0))
        edge += bin_s
    return out


def trace_text(results: list[dict[str, Any]], bin_s: float = TRACE_BIN_S) -> str:
    """``--trace``'s file: for each job and contender, one line per rank of
    its last load round: MB/s in/out of the rank's node link per bin."""
    lines = [f"MB/s into / out of each rank's node link, in bins of {bin_s} s, last load round"]
    for r in results:
        for name, rows in sorted(r.get("trace", {}).items()):
            lines.append(f"{r['nodes']}x{r['ranks'] // r['nodes']} {name}:")
            for rank, rates in rows:
                cells = " ".join(f"{a:4.1f}/{b:4.1f}" for a, b in rates)
                lines.append(f"  rank {rank}: {cells}")
    return "\n".join(lines) + "\n"


def link_counters(dev: str = "eth0") -> tuple[int, int]:
    """Bytes received and sent through this network namespace's ``dev`` so
    far (``/proc/self/net/dev``, which is per namespace: a node's link);
    (0, 0) where it has none."""
    with open("/proc/self/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == dev:
                values = fields.split()
                return int(values[0]), int(values[8])
    return 0, 0


def _tensors(state: Any) -> Iterator[Any]:
    import torch

    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, list | tuple):
        for v in state:
            yield from _tensors(v)


def _same(a: Any, b: Any) -> bool:
    """``a`` and ``b`` have the same structure and bitwise equal tensors."""
    import torch

    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _delete_prefix(s3: Any, prefix: str) -> None:
    """Deletes every object under ``prefix`` in the bench's bucket (the
    bench's own objects; untimed housekeeping)."""
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=BUCKET, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})


class DcpStore:
    """DCP's writer and reader for an ``s3://`` prefix: the S3 connector's
    (``s3torchconnector``) or fsspec's over s3fs. Both find the server
    through ``AWS_ENDPOINT_URL``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    def writer(self, url: str, compressed: bool = False) -> Any:
        """``compressed``: with DCP's ZStandard stream extension."""
        from torch.distributed.checkpoint._extension import ZStandard

        extensions = [ZStandard()] if compressed else None
        if self.kind == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageWriter

            return S3StorageWriter(
                region=REGION,
                path=url,
                s3client_config=S3ClientConfig(force_path_style=True),
                _extensions=extensions,
            )
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecWriter

        return FsspecWriter(url, sync_files=False, _extensions=extensions)

    def reader(self, url: str) -> Any:
        if self.kind == "s3torchconnector":
            from s3torchconnector import S3ClientConfig
            from s3torchconnector.dcp import S3StorageReader

            return S3StorageReader(
                region=REGION, path=url, s3client_config=S3ClientConfig(force_path_style=True)
            )
        from torch.distributed.checkpoint.fsspec_filesystem import FsspecReader

        return FsspecReader(url)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from boto3.s3.transfer import TransferConfig
    from mpi4py import MPI
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    import deeppart
    from bench.jobs import build_state

    # A DeepPart without S3 support may write a local directory named
    # "s3:": let it land in a scratch directory, where the probe sees it.
    scratch = Path(tempfile.mkdtemp(prefix="deeppart-objstore-"))
    os.chdir(scratch)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    nodes = size // int(args.ranks_per_node)
    job = f"{nodes}x{args.ranks_per_node}"  # as the report labels it (_layout)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    s3 = _client()
    run = f"n{job}"
    state = build_state(args.scale, hidden=args.hidden)
    ref = build_state(args.scale, hidden=args.hidden)
    total = deeppart.Manifest.from_state_dict(state).total_bytes
    small = {"w": torch.arange(1 << 18, dtype=torch.float32)}
    transfer = TransferConfig(multipart_threshold=8 << 20, multipart_chunksize=8 << 20)
    notes: dict[str, str] = {}

    def url(name: str, round_: int | str) -> str:
        return f"s3://{BUCKET}/{run}/{name}-{round_}"

    def key(name: str, round_: int | str) -> str:
        return f"{run}/{name}-{round_}"

    # --- the contenders -----------------------------------------------------

    def torch_save(target: Any, round_: int | str) -> None:
        if rank == 0:
            buf = io.BytesIO()
            torch.save(target, buf)
            buf.seek(0)
            s3.upload_fileobj(buf, BUCKET, key("torch.pt", round_), Config=transfer)

    def torch_load(target: Any, round_: int | str) -> Any:
        buf = io.BytesIO()
        s3.download_fileobj(BUCKET, key("torch.pt", round_), buf, Config=transfer)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    dcp_kinds = ["s3torchconnector", "fsspec"] if args.dcp == "auto" else [args.dcp]
    dcp = DcpStore(dcp_kinds[0])

    def dcp_save_(target: Any, round_: int | str) -> None:
        dcp_save(target, storage_writer=dcp.writer(url("dcp", round_)))

    def dcp_load_(target: Any, round_: int | str) -> Any:
        dcp_load(target, storage_reader=dcp.reader(url("dcp", round_)))
        return target

    def dcpz_save(target: Any, round_: int | str) -> None:
        dcp_save(target, storage_writer=dcp.writer(url("dcpz", round_), compressed=True))

    def dcpz_load(target: Any, round_: int | str) -> Any:
        dcp_load(target, storage_reader=dcp.reader(url("dcpz", round_)))
        return target

    def dp_save(target: Any, round_: int | str) -> None:
        deeppart.save(target, url("dp", round_), comm=comm)

    def dp_load(target: Any, round_: int | str) -> Any:
        deeppart.load(url("dp", round_), comm=comm, into=target)
        return target

    def dpz_save(target: Any, round_: int | str) -> None:
        writing = deeppart.WriteOptions(compression=args.compression)
        deeppart.save(target, url("dpz", round_), comm=comm, writing=writing)

    def dpz_load(target: Any, round_: int | str) -> Any:
        deeppart.load(url("dpz", round_), comm=comm, into=target)
        return target

    def direct_load(target: Any, round_: int | str) -> Any:
        loading = deeppart.LoadOptions(exchange="read")
        deeppart.load(url("dp", round_), comm=comm, into=target, loading=loading)
        return target

    saves: dict[str, Callable[[Any, int | str], None]] = {
        "torch": torch_save, "dcp": dcp_save_, "deeppart": dp_save,
        DCP_COMPRESSED: dcpz_save, COMPRESSED: dpz_save,
    }  # fmt: skip
    loads: dict[str, Callable[[Any, int | str], Any]] = {
        "torch": torch_load, "dcp": dcp_load_, "deeppart": dp_load,
        DCP_COMPRESSED: dcpz_load, COMPRESSED: dpz_load, DIRECT: direct_load,
    }  # fmt: skip
    prefixes = {"torch": "torch.pt", "dcp": "dcp", "deeppart": "dp",
                DCP_COMPRESSED: "dcpz", COMPRESSED: "dpz", DIRECT: "dp"}  # fmt: skip

    def agreed_error(fn: Callable[[], Any]) -> str | None:
        """Runs ``fn`` on every rank; the first error any rank met (the same
        answer on every rank), or None."""
        err: str | None = None
        try:
            fn()
        except Exception as e:  # reported, not hidden
            err = f"{type(e).__name__}: {e}"
        errs = [e for e in comm.allgather(err) if e]
        return errs[0][:600] if errs else None

    def warm(name: str) -> str | None:
        """An untimed save and load of the small state; why ``name``
        cannot run here, or None."""
        copy = {"w": torch.zeros_like(small["w"])}

        def once() -> None:
            if name in saves:  # DIRECT loads deeppart's (warmed before it)
                saves[name](small, "warm")
            comm.Barrier()
            got = loads[name](copy, "warm")
            if not _same(got, small):
                raise RuntimeError("the warm-up load returned other bytes than were saved")
            if name.startswith(("deeppart", "dp-")) and Path("s3:").exists():
                raise RuntimeError("deeppart.save wrote a local directory 's3:', not the store")
            if rank == 0:
                found = s3.list_objects_v2(Bucket=BUCKET, Prefix=key(prefixes[name], "warm"))
                if not found.get("Contents"):
                    raise RuntimeError("nothing was written to the store")

        return agreed_error(once)

    available: dict[str, str | None] = {}
    available["torch"] = warm("torch")
    for kind in dcp_kinds:
        dcp.kind = kind
        why = warm("dcp")
        if why is None:
            break
        notes[f"dcp: {kind}"] = why
    available["dcp"] = why
    notes["dcp writer"] = dcp.kind
    for name in contenders(args.compression)[len(CONTENDERS) - 1 :]:
        available[name] = warm(name)
    if rank == 0:
        for name in prefixes.values():
            _delete_prefix(s3, key(name, "warm"))
        for name, why in available.items():
            log(f"{job} {name}: " + ("ready" if why is None else f"cannot run: {why}"))
    live = {
        op: [n for n in contenders(args.compression, op) if available[n] is None]
        for op in ("save", "load")
    }

    rounds: dict[str, list[float | None]] = {}
    verified: dict[str, bool] = {}
    # Bytes in and out of each node's link during an op's last round.
    link: dict[str, list[float]] = {}
    # --trace: each rank's node link rates during the last round of loads.
    traces: dict[str, list[Any]] = {}
    for op in ("save", "load"):
        for round_ in range(args.repeat):
            order = [live[op][i] for i in np.random.default_rng(round_).permutation(len(live[op]))]
            for name in order:
                if op == "load":
                    for t in _tensors(state):  # a sentinel: a no-op load cannot pass
                        t.fill_(7) if t.dtype.is_floating_point else t.zero_()
                comm.Barrier()
                sampler = None
                if args.trace and op == "load" and round_ == args.repeat - 1:
                    sampler = LinkSampler()
                    sampler.start()
                before = link_counters()
                t0 = time.perf_counter()
                err: str | None = None
                got: Any = None
                try:
                    if op == "save":
                        saves[name](state, round_)
                    else:
                        got = loads[name](state, args.repeat - 1)
                except Exception as e:  # reported in the table
                    err = f"{type(e).__name__}: {e}"
                comm.Barrier()
                dt: float | None = time.perf_counter() - t0
                after = link_counters()
                if sampler is not None:
                    rows = comm.gather([rank, link_rates(sampler.stop())])
                    if rows is not None:  # rank 0
                        traces[name] = rows
                moved = [b - a for a, b in zip(before, after, strict=True)]
                # The ranks of a node read the same counters: the mean over
                # ranks is the mean over nodes.
                total_moved = comm.allreduce(np.array(moved, dtype=np.float64))
                link[f"{op} {name}"] = [float(x) / size for x in total_moved]
                errs = [e for e in comm.allgather(err) if e]
                if errs:
                    notes[f"{op} {name}"] = errs[0][:600]
                    dt = None
                if op == "load":
                    ok = comm.allreduce(int(errs == [] and _same(got, ref)), op=MPI.MIN) == 1
                    verified[name] = verified.get(name, True) and ok
                    if not ok:
                        dt = None
                    for dst, src in zip(_tensors(state), _tensors(ref), strict=True):
                        dst.copy_(src)  # the next save and load start from the state
                    del got
                elif rank == 0 and round_ > 0:
                    _delete_prefix(s3, key(prefixes[name], round_ - 1))  # keep the latest
                rounds.setdefault(f"{op} {name}", []).append(dt)
                if rank == 0:
                    shown = f"{dt:8.3f} s" if dt is not None else "failed"
                    log(f"{job} round {round_} {op} {name:<9} {shown}")
    if rank == 0:
        _delete_prefix(s3, f"{run}/")
        print(
            "RESULT "
            + json.dumps(
                {
                    "nodes": nodes,
                    "ranks": size,
                    "bytes": total,
                    "rounds": rounds,
                    "available": available,
                    "verified": verified,
                    "link": link,
                    "trace": traces,
                    "notes": notes,
                    "dcp": dcp.kind,
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------------------
# The driver.


def run_job(
    c: Any, n: int, per_node: int, args: argparse.Namespace, endpoint: str
) -> dict[str, Any]:
    order = list(range(n))
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker",
            "--scale", str(args.scale), "--hidden", str(args.hidden),
            "--repeat", str(args.repeat), "--dcp", args.dcp,
            "--compression", args.compression,
            "--ranks-per-node", str(per_node)]  # fmt: skip
    if args.trace:
        argv += ["--trace", args.trace]
    ranks = n * per_node
    env = c.launch_env(ranks, order)
    env.update(s3_env(endpoint))
    env.update(
        MASTER_ADDR=c.ip(0), MASTER_PORT="29517", GLOO_SOCKET_IFNAME="eth0",
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="",
    )  # fmt: skip
    proc = subprocess.Popen(
        c.launch_cmd(ranks, order, argv),
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise SystemExit(
            f"object_store: the {n}x{per_node}-rank job hung (over {args.timeout} s)"
        ) from None
    for line in out.splitlines():
        if line.startswith("RESULT "):
            got: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return got
    raise SystemExit(
        f"object_store: no result from the {n}x{per_node}-rank job (status {proc.returncode})"
    )


def predict(
    args: argparse.Namespace,
    nodes: int,
    link: float,
    server: float,
    stream: float,
    per_node: int = 1,
) -> dict[str, float]:
    """The simulator's save times (seconds) of torch.save, DCP-style dedup
    and DeepPart's balanced plan to L4 at ``nodes`` nodes of ``per_node``
    ranks."""
    import deeppart
    from bench.jobs import build_state
    from deeppart.tools.simulate import StorageModel, simulate

    manifest = deeppart.Manifest.from_state_dict(build_state(args.scale, hidden=args.hidden))
    model = StorageModel(ranks_per_node=per_node, net_bw=link, pfs_bw=server, rank_bw=stream)
    preds = simulate(manifest, [nodes * per_node], model, algorithms=("balanced",), levels=("L4",))
    return {p.method: p.seconds for p in preds}


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return statistics.median(got) if len(got) == len(xs) and got else None


def _median_ratio(rounds: dict[str, list[float | None]], num: str, den: str) -> float | None:
    if num not in rounds or den not in rounds:
        return None
    pairs = [(a, b) for a, b in zip(rounds[num], rounds[den], strict=True)]
    if any(a is None or b is None for a, b in pairs):
        return None
    return statistics.median(a / b for a, b in pairs if a is not None and b is not None)


def report(results: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    loaded = contenders(meta["compression"])
    lines = []
    gb = results[0]["bytes"] / 1e9
    lines.append(
        f"state: BERT-shaped model + AdamW (--scale {meta['scale']} --hidden {meta['hidden']}), "
        f"{gb:.3f} GB, "
        f"replicated on every rank; links {meta['rate']} each way, TCP {meta['tcp']} "
        f"(the host's default: {meta['host_tcp']}) "
        f"(measured through one link: PUT {meta['link']['put'] / 1e6:.1f} MB/s, "
        f"GET {meta['link']['get'] / 1e6:.1f} MB/s); server {meta['server']} "
        f"(from the head, {PROBE_STREAMS} streams, no shaping: PUT "
        f"{meta['raw']['put'] / 1e6:.0f} MB/s, GET {meta['raw']['get'] / 1e6:.0f} MB/s); "
        f"DCP writer: {results[0]['dcp']}; {meta['repeat']} rounds; "
        + (f"{COMPRESSED}: compression={meta['compression']}; " if COMPRESSED in loaded else "")
        + f"load average at start {meta['loadavg_start']}, at end {meta['loadavg_end']}"
    )
    for op in ("save", "load"):
        names = contenders(meta["compression"], op)
        lines.append(
            f"\n{op}: median seconds over the rounds; ratios: median of within-round ratios"
            + (" (predicted: the simulator's)" if op == "save" else "")
        )
        head = f"{'nodes x ranks':>13}" + "".join(f"{c:>10}" for c in names)
        head += f"{'torch/deeppart':>16}{'dcp/deeppart':>14}{'torch/dcp':>11}"
        if COMPRESSED in names:
            head += f"{'torch/' + COMPRESSED:>15}{'dcp/' + COMPRESSED:>13}"
            head += f"{DCP_COMPRESSED + '/' + COMPRESSED:>18}"
        if op == "save":
            head += f"{'predicted: deeppart':>21}{'torch/deeppart':>16}{'dcp/deeppart':>14}"
        else:
            head += f"{'dcp/' + DIRECT:>13}"
        lines.append(head)
        for r in results:
            line = f"{_layout(r):>13}"
            for c in names:
                m = _median(r["rounds"].get(f"{op} {c}", [None]))
                line += f"{m:10.2f}" if m is not None else f"{'n/a':>10}"
            rr = r["rounds"]
            line += f"{_fmt(_median_ratio(rr, f'{op} torch', f'{op} deeppart')):>16}"
            line += f"{_fmt(_median_ratio(rr, f'{op} dcp', f'{op} deeppart')):>14}"
            line += f"{_fmt(_median_ratio(rr, f'{op} torch', f'{op} dcp')):>11}"
            if COMPRESSED in names:
                line += f"{_fmt(_median_ratio(rr, f'{op} torch', f'{op} {COMPRESSED}')):>15}"
                line += f"{_fmt(_median_ratio(rr, f'{op} dcp', f'{op} {COMPRESSED}')):>13}"
                both = _median_ratio(rr, f"{op} {DCP_COMPRESSED}", f"{op} {COMPRESSED}")
                line += f"{_fmt(both):>18}"
            if op == "save":
                p = r["predicted"]
                line += f"{p['balanced']:>20.2f}s"
                line += f"{_fmt(p['torch.save'] / p['balanced']):>16}"
                line += f"{_fmt(p['dcp-dedup'] / p['balanced']):>14}"
            else:
                line += f"{_fmt(_median_ratio(rr, 'load dcp', f'load {DIRECT}')):>13}"
            lines.append(line)
    lines.append("\nloads verified bitwise against the saved state:")
    for r in results:
        lines.append(
            f"  {_layout(r)}: "
            + ", ".join(f"{c} {r['verified'].get(c, 'not run')}" for c in loaded)
        )
    lines.append(
        "\nload: MB into / out of each node's link (its interface's counters, mean over nodes, "
        "last round)"
    )
    lines.append(f"{'nodes x ranks':>13}" + "".join(f"{c:>16}" for c in loaded))
    for r in results:
        cells = []
        for c in loaded:
            got = r.get("link", {}).get(f"load {c}")
            cells.append(f"{got[0] / 1e6:.1f} / {got[1] / 1e6:.1f}" if got else "-")
        lines.append(f"{_layout(r):>13}" + "".join(f"{x:>16}" for x in cells))
    notes = [
        (_layout(r), k, v) for r in results for k, v in r["notes"].items() if k != "dcp writer"
    ]
    notes += [(_layout(r), c, f"could not run: {why}")
              for r in results for c, why in r["available"].items() if why]  # fmt: skip
    if notes:
        lines.append("\nnotes:")
        lines += [f"  {n}: {k}: {v}" for n, k, v in notes]
    return "\n".join(lines)


def _layout(result: dict[str, Any]) -> str:
    """``nodes x ranks per node`` of one job's result."""
    nodes = int(result["nodes"])
    return f"{nodes}x{int(result['ranks']) // nodes}"


def _fmt(x: float | None) -> str:
    return f"{x:.2f}x" if x is not None and math.isfinite(x) else "-"


def drive(args: argparse.Namespace) -> None:
    import cluster

    nodes = [int(x) for x in args.nodes.split(",")]
    layouts = [int(x) for x in args.ranks_per_node.split(",")]
    why = host_unavailable()
    if why:
        raise Skip(why)
    ensure_packages()
    removed = cluster.sweep()
    if removed:
        log(f"removed what earlier runs left: {', '.join(removed)}")
    loadavg_start = Path("/proc/loadavg").read_text().split()[:3]
    results: list[dict[str, Any]] = []
    with cluster.Cluster(max(nodes), net=True) as c:
        data = c.dir / "s3"
        data.mkdir()
        # The server's data on a tmpfs under the cluster's directory (the
        # sweep unmounts it): no disk in the path.
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g", "tmpfs", str(data)], check=True)
        shape(c, max(nodes), args.rate)
        set_tcp_cc(c, max(nodes), args.tcp_cc)
        host = f"10.77.{c.id}.254"
        server = start_server(args.server, f"{c.tag}head", host, data, c.dir / "server.log")
        try:
            env = dict(os.environ, **s3_env(server.endpoint))
            head = ["nsenter", f"--net=/run/netns/{c.tag}head", "--"]
            await_server(server, f"{c.tag}head", host, c.dir / "server.log")
            raw = run_probe(head, env, PROBE_STREAMS, PROBE_BYTES)
            link = run_probe(c.nsenter(0), env, 1, PROBE_BYTES)
            log(f"server from the head: PUT {raw['put'] / 1e6:.0f} MB/s, "
                f"GET {raw['get'] / 1e6:.0f} MB/s; one link: PUT {link['put'] / 1e6:.1f} "
                f"MB/s, GET {link['get'] / 1e6:.1f} MB/s")  # fmt: skip
            stream = run_probe(head, env, 1, PROBE_BYTES)
            for n in nodes:
                for per_node in layouts:
                    r = run_job(c, n, per_node, args, server.endpoint)
                    r["predicted"] = predict(
                        args, n, min(link["put"], link["get"]), raw["put"], stream["put"],
                        per_node,
                    )  # fmt: skip
                    results.append(r)
        finally:
            server.stop()
    host_tcp = host_tcp_cc()
    meta = {
        "scale": args.scale, "hidden": args.hidden, "rate": args.rate, "link": link, "raw": raw,
        "server": args.server, "repeat": args.repeat, "loadavg_start": " ".join(loadavg_start),
        "compression": args.compression,
        "tcp": host_tcp if args.tcp_cc == "host" else args.tcp_cc, "host_tcp": host_tcp,
        "loadavg_end": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
    }  # fmt: skip
    print(report(results, meta))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.trace:
        Path(args.trace).write_text(trace_text(results))
        log(f"link trace of the last load round: {args.trace}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", default="1,2,4", help="comma-separated node counts (default 1,2,4)")
    p.add_argument("--rate", default="100mbit", help="each link's rate, tc syntax (100mbit)")
    p.add_argument(
        "--scale",
        type=float,
        default=0.04,
        help="layers and vocabulary: this fraction of BERT-large's (default 0.04)",
    )
    p.add_argument(
        "--hidden",
        type=int,
        default=512,
        help="hidden size (default 512; with --scale 0.04: 52 MB with AdamW)",
    )
    p.add_argument("--ranks-per-node", default="1,2",
                   help="comma-separated ranks per node, each layout at every node count "
                        "(default 1,2); every rank holds the whole state")
    p.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    p.add_argument("--compression", default="shuffle-zstd",
                   choices=("none", "zstd", "lz4", "shuffle-zstd", "auto"),
                   help=f"the codec of {COMPRESSED} (none: leave it out)")  # fmt: skip
    p.add_argument("--tcp-cc", default="reno",
                   help="TCP congestion control in every namespace (default reno, loss-based "
                        "as Linux's default cubic; 'host': the host's own)")  # fmt: skip
    p.add_argument("--server", default="s3s-fs", choices=("s3s-fs", "moto"))
    p.add_argument("--dcp", default="auto", choices=("auto", "s3torchconnector", "fsspec"),
                   help="DCP's S3 storage (auto: the S3 connector's, else fsspec)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=900, help="seconds per job (900)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--trace", default=None,
                   help="write each node link's MB/s in and out during the last round of loads, "
                        f"every {TRACE_BIN_S} s, to this file")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe", nargs=2, type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        probe(*args.probe)
        return
    if args.worker:
        worker(args)
        return
    # A SIGTERM unwinds like ^C: the cluster's teardown and the server's stop
    # run (SIGKILL leaves them to the next run's sweep).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        drive(args)
    except Skip as e:
        print(f"object_store: skipped: {e}")


if __name__ == "__main__":
    main()
