"""DeepPart's built-in multi-level checkpoint engine (FTI semantics; see
docs/LEVELS.md).

Every level starts from L1: each rank writes its planned pieces (the same
data file as :func:`deeppart.save`) into its node's local directory.

- L2 also sends each rank's file to its partner (the same position on the
  next node of its group), which stores it as ``partner-RRRRR.bin``.
- L3 also codes the group's files with Reed-Solomon (``k = m =
  group_size``): each member stores one parity shard ``parity-RRRRR.bin``;
  any ``group_size`` of the group's ``2 * group_size`` files restore the rest.
- L4 also writes a normal DeepPart checkpoint to ``glbl_dir`` (readable by
  any world size with :func:`deeppart.load`).

Data crosses nodes only through the :class:`~deeppart.comm.Comm`: a rank
reads and writes only its own node's local directory, plus the shared
``meta_dir`` (metadata and commit markers) and ``glbl_dir``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from deeppart._planner import DeepPartError, rs_encode, rs_reconstruct
from deeppart.agreement import agree
from deeppart.checkpoint import load, save
from deeppart.comm import Comm, resolve
from deeppart.commit import commit_dir, metadata_json
from deeppart.errors import (
    CheckpointError,
    CorruptCheckpointError,
    LevelConfigError,
    TopologyMismatchError,
    UnrecoverableError,
)
from deeppart.format import (
    HEADER_SIZE,
    Metadata,
    Piece,
    check_header,
    checksum,
    data_file_name,
    fsync_dir,
    is_committed,
    remove_tree,
)
from deeppart.levels.backend import LevelSaveStats, RecoveryReport
from deeppart.levels.config import LevelConfig
from deeppart.planning import PlanProvider
from deeppart.prepare import Prepared, agree_prepared, prepare
from deeppart.progress import Progress
from deeppart.reader import Target, all_leaf_targets, assemble, read_metadata, read_pieces
from deeppart.writer import RECORD_FIELDS, write_pieces

U8 = npt.NDArray[np.uint8]
_T = TypeVar("_T")
_EMPTY: U8 = np.empty(0, dtype=np.uint8)

PREFIX = "step-"
#: Default Reed-Solomon stripe: bytes of each member's file coded at once.
STRIPE_BYTES = 16 << 20

# Status bits a rank reports for a step during recovery.
_OWN, _COPY, _PARITY, _GLOBAL = 1, 2, 4, 8


_TOPOLOGY = "only L4 checkpoints can be restored on another world size or node layout"


def step_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def partner_file(source: int) -> str:
    return f"partner-{source:05d}.bin"


def parity_file(holder: int) -> str:
    return f"parity-{holder:05d}.bin"


def _steps_in(root: Path, committed: bool) -> list[int]:
    out: list[int] = []
    if not root.is_dir():
        return out
    for child in root.iterdir():
        digits = child.name[len(PREFIX) :]
        if (
            child.name.startswith(PREFIX)
            and digits.isascii()
            and digits.isdigit()
            and (not committed or is_committed(child))
        ):
            out.append(int(digits))
    return sorted(out)


def _write_file(path: Path, chunks: Sequence[U8 | bytes]) -> None:
    with open(path, "wb") as f:
        for c in chunks:
            f.write(c if isinstance(c, bytes) else c.data)
        f.flush()
        os.fsync(f.fileno())


def _read_all(path: Path, size: int) -> U8 | None:
    """The whole file if it exists with exactly ``size`` bytes, else None."""
    try:
        if path.stat().st_size != size:
            return None
        data: U8 = np.fromfile(path, dtype=np.uint8)
    except (OSError, ValueError):
        return None
    return data if data.size == size else None


def _size_is(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def _read_own(path: Path, size: int) -> tuple[U8, OSError | None]:
    """This rank's just-written file, or zeros of its announced ``size`` and
    the error (so that it still takes its part in the exchanges)."""
    try:
        data: U8 = np.fromfile(path, dtype=np.uint8)
        if data.size == size:
            return data, None
        err = OSError(f"{path}: {data.size} bytes, {size} expected")
    except OSError as e:
        err = e
    return np.zeros(size, dtype=np.uint8), err


class _Writer:
    """A file written and fsynced as a context manager, recording (not
    raising) the first I/O error, so a collective protocol can carry on."""

    def __init__(self, path: Path) -> None:
        self.err: OSError | None = None
        self.f: Any = None
        try:
            self.f = open(path, "wb")  # noqa: SIM115
        except OSError as e:
            self.err = e

    def write(self, data: U8) -> None:
        if self.f is not None and self.err is None:
            try:
                self.f.write(data.data)
            except OSError as e:
                self.err = e

    def __enter__(self) -> _Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.f is None:
            return
        try:
            if self.err is None:
                self.f.flush()
                os.fsync(self.f.fileno())
        except OSError as e:
            self.err = e
        finally:
            self.f.close()


class _BufReader:
    """``seek``/``read``/``readinto`` over an in-memory file (no copy)."""

    def __init__(self, buf: U8) -> None:
        self.mv = buf.data.cast("B")
        self.pos = 0

    def seek(self, pos: int) -> None:
        self.pos = pos

    def read(self, n: int) -> bytes:
        out = bytes(self.mv[self.pos : self.pos + n])
        self.pos += len(out)
        return out

    def readinto(self, out: memoryview) -> int:
        n = min(len(out), len(self.mv) - self.pos)
        out[:n] = self.mv[self.pos : self.pos + n]
        self.pos += n
        return n


def _by_rank(meta: Metadata) -> list[list[Piece]]:
    out: list[list[Piece]] = [[] for _ in range(meta.world_size)]
    for p in meta.pieces:
        out[p.rank].append(p)
    return out


def _file_ok(buf: U8 | None, meta: Metadata, rank: int, pieces: list[Piece]) -> bool:
    """Whether ``buf`` is rank ``rank``'s intact data file: size, header and
    every piece's xxh3 (a corrupt or truncated file counts as lost)."""
    if buf is None or buf.size != meta.file_sizes[rank]:
        return False
    try:
        check_header(
            Path(data_file_name(rank)),
            buf[:HEADER_SIZE].tobytes(),
            rank,
            meta.world_size,
            meta.plan_fingerprint,
        )
    except CorruptCheckpointError:
        return False
    return all(checksum(buf[p.offset : p.offset + p.stored].data) == p.xxh3 for p in pieces)


@dataclass
class _Layout:
    """Where this job's ranks sit: node of every rank, and groups."""

    config: LevelConfig
    size: int
    hosts: list[str] | None

    def node(self, rank: int) -> int:
        return self.config.node_of(rank, self.hosts)

    def group(self, rank: int) -> list[int]:
        return self.config.group_members(rank, self.hosts)

    def partner(self, rank: int) -> int:
        return self.config.partner_of(rank, self.hosts)

    def pred(self, rank: int) -> int:
        g = self.group(rank)
        return g[(g.index(rank) - 1) % len(g)]

    def describe(self) -> dict[str, Any]:
        return {
            "node_size": self.config.node_size,
            "group_size": self.config.group_size,
            "nodes": [self.node(r) for r in range(self.size)],
        }


@dataclass
class _Step:
    """A step's metadata as recovery sees it."""

    step: int
    meta: Metadata
    level: int
    layout: dict[str, Any]
    stripe: int
    parity_sizes: list[int]
    parity_xxh3: list[int]


@dataclass
class _Survey:
    levels: list[int] = field(default_factory=list)
    reason: str = ""
    #: Per rank, the _OWN/_COPY/_PARITY/_GLOBAL bits of what its node holds.
    status: list[int] = field(default_factory=list)


class BuiltinBackend:
    """The built-in :class:`~deeppart.levels.backend.LevelBackend`.

    ``compression``/``zstd_level``, ``planner``, ``algorithm``, ``cost``,
    ``topology``: as for :func:`deeppart.save`. ``stripe_bytes``: the L3
    coding stripe per member (memory per rank during coding: its own file
    plus about ``3 * group_size * stripe_bytes``). ``keep``: committed checkpoints kept
    (default: the config's ``[deeppart] keep``).
    """

    name = "builtin"

    def __init__(
        self,
        config: LevelConfig | str | os.PathLike[str],
        comm: Any = None,
        *,
        compression: str | None = None,
        zstd_level: int = 1,
        planner: Any = None,
        algorithm: str | None = None,
        cost: Any = None,
        topology: Any = None,
        stripe_bytes: int = STRIPE_BYTES,
        keep: int | None = None,
        exchange: str = "auto",
        verbose: bool = False,
    ) -> None:
        self.config = LevelConfig.coerce(config)
        self.comm: Comm = resolve(comm)
        hosts: list[str] | None = None
        if not self.config.local_test:
            rows = self.comm.allgather_varbytes(socket.gethostname().encode())
            hosts = [r.decode("utf-8", "replace") for r in rows]
        # Before any I/O: the same inputs on every rank, so every rank raises.
        self.config.validate(self.comm.size, hosts)
        if stripe_bytes < 2 or stripe_bytes % 2:
            raise LevelConfigError("stripe_bytes must be a positive even number")
        if keep is not None and keep < 1:
            raise LevelConfigError("keep must be at least 1")
        self.layout = _Layout(self.config, self.comm.size, hosts)
        self.compression = compression
        self.zstd_level = zstd_level
        self.planner = planner
        self.algorithm = algorithm
        self.cost = cost
        self.topology = topology
        self.stripe = stripe_bytes
        self.keep = keep if keep is not None else self.config.keep
        self.exchange = exchange
        self.verbose = verbose
        self.count = 0
        self.plans = PlanProvider(
            self.comm.size,
            planner=planner,
            algorithm=algorithm,
            cost=cost,
            topology=topology,
            reuse=True,
        )
        self.last_recovery: RecoveryReport | None = None
        #: CPU seconds in Reed-Solomon decoding on this rank, and the bytes of
        #: data (all members' stripe chunks) it decoded, since creation.
        self.decode_seconds = 0.0
        self.decode_bytes = 0

    # ------------------------------------------------------------------
    # Paths.

    @property
    def rank(self) -> int:
        return self.comm.rank

    def local_step(self, step: int, rank: int | None = None) -> Path:
        node = self.layout.node(self.rank if rank is None else rank)
        return self.config.local_root(node) / step_name(step)

    def meta_step(self, step: int) -> Path:
        return self.config.meta_root() / step_name(step)

    def global_step(self, step: int) -> Path:
        return self.config.global_root() / step_name(step)

    def _check_level(self, level: int) -> None:
        if level not in (1, 2, 3, 4):
            raise LevelConfigError(f"level {level}: must be 1, 2, 3 or 4")
        if level == 4 and not self.config.glbl_dir.strip():
            raise LevelConfigError("level 4 needs glbl_dir")
        if level in (2, 3) and not self.config.enabled(level):
            self.config.replace(**{f"ckpt_l{level}": 1}).validate(self.comm.size, self.layout.hosts)

    # ------------------------------------------------------------------
    # Save.

    def save(
        self, step: int, state: Any, *, level: int | None = None, user: Any = None
    ) -> LevelSaveStats:
        c = self.comm
        t0 = time.perf_counter()
        self.count += 1
        lv = self.config.level_for(self.count) if level is None else level
        self._check_level(lv)  # the same on every rank: raises everywhere
        phases: dict[str, float] = {}
        err: BaseException | None = None
        prep: Prepared | None = None
        try:
            if step < 0:
                raise CheckpointError(f"step {step}: must be >= 0")
            if user is not None:
                from deeppart.state import encode_plain

                encode_plain(user, ("<user>",))
            prep = prepare(state, self.compression, self.plans, self.meta_step(step))
            if c.rank == 0 and self.meta_step(step).exists():
                # Re-saving a step: uncommit it first, so a crash never
                # leaves a marker over mixed files.
                (self.meta_step(step) / "COMMITTED").unlink(missing_ok=True)
        except Exception as e:
            err = e
        prep = agree_prepared(c, err, prep)

        # L1: every rank writes its own file (temporary name).
        local = self.local_step(step)
        own_tmp = local / (data_file_name(self.rank) + ".tmp")
        renames: list[tuple[Path, Path]] = [(own_tmp, local / data_file_name(self.rank))]
        records = np.zeros(0, dtype=np.uint64)
        size = 0
        t = time.perf_counter()
        try:
            local.mkdir(parents=True, exist_ok=True)
            prog = Progress("save", 0, enabled=False)
            recs, size = write_pieces(own_tmp, self.rank, prep, self.zstd_level, prog)
            records = recs.reshape(-1)
        except Exception as e:
            err = e
        agree(c, err)
        phases["l1"] = time.perf_counter() - t

        sizes_f = c.allgather_f64(np.array([float(size)], dtype=np.float64))[:, 0]
        sizes = [int(x) for x in sizes_f]
        parity_size, parity_xxh = 0, 0
        if lv == 2:
            self._phase(
                phases, "l2", lambda: self._send_partner_copy(local, own_tmp, sizes, renames)
            )
        elif lv == 3:
            parity_size, parity_xxh = self._phase(
                phases, "l3", lambda: self._encode(local, own_tmp, sizes, renames, phases)
            )
        elif lv == 4:
            t = time.perf_counter()
            save(
                state,
                self.global_step(step),
                comm=c,
                compression=self.compression,
                compression_level=self.zstd_level,
                overwrite=True,
                user={"step": step, "user": user},
                plan_provider=self.plans,
            )
            phases["l4"] = time.perf_counter() - t

        # Every rank's files get their final names; then rank 0 commits.
        t = time.perf_counter()
        try:
            for src, dst in renames:
                src.replace(dst)
            fsync_dir(local)
        except Exception as e:
            err = e
        agree(c, err)
        mine = np.concatenate([records, np.array([size, parity_size, parity_xxh], dtype=np.uint64)])
        counts = [len(prep.plan.rank_pieces(r)) * RECORD_FIELDS + 3 for r in range(c.size)]
        gathered = c.gatherv_u64(mine, counts, root=0)
        if c.rank == 0:
            assert gathered is not None
            try:
                self._commit_meta(step, lv, prep, gathered, counts, user)
            except Exception as e:
                err = e
        agree(c, err)
        phases["commit"] = time.perf_counter() - t
        t = time.perf_counter()
        self._cleanup(step)
        phases["cleanup"] = time.perf_counter() - t
        seconds = time.perf_counter() - t0
        stats = LevelSaveStats(step, lv, prep.manifest.total_bytes, seconds, phases)
        if self.verbose and c.rank == 0:
            print(f"deeppart levels: step {step} at L{lv} in {seconds:.2f} s {phases}", flush=True)
        return stats

    def _phase(self, phases: dict[str, float], name: str, fn: Callable[[], _T]) -> _T:
        """Runs ``fn`` on every rank, then agrees (every rank raises if one
        failed); records its seconds as ``phases[name]``."""
        t = time.perf_counter()
        err: BaseException | None = None
        out: _T | None = None
        try:
            out = fn()
        except Exception as e:
            err = e
        agree(self.comm, err)
        phases[name] = time.perf_counter() - t
        return out  # type: ignore[return-value]  # set: no rank failed

    def _commit_meta(
        self,
        step: int,
        level: int,
        prep: Prepared,
        gathered: npt.NDArray[np.uint64],
        counts: list[int],
        user: Any,
    ) -> None:
        # Split each rank's block into the piece records + size (the format
        # v1 layout _metadata_json reads) and the parity size and checksum.
        blocks: list[npt.NDArray[np.uint64]] = []
        parity_sizes: list[int] = []
        parity_xxh3: list[int] = []
        pos = 0
        for n in counts:
            block = gathered[pos : pos + n]
            pos += n
            blocks.append(block[:-2])
            parity_sizes.append(int(block[-2]))
            parity_xxh3.append(int(block[-1]))
        levels = {
            "level": level,
            "step": step,
            "exec_id": self.config.exec_id,
            # Where the files are, for tools (deeppart inspect); recovery
            # uses the config's directories.
            "ckpt_dir": os.path.abspath(self.config.ckpt_dir),
            "glbl_dir": (
                os.path.abspath(self.config.glbl_dir) if self.config.glbl_dir.strip() else ""
            ),
            **self.layout.describe(),
            "stripe_bytes": self.stripe,
            "parity_sizes": parity_sizes,
            "parity_xxh3": parity_xxh3,
        }
        meta = metadata_json(
            prep, np.concatenate(blocks), {"step": step, "user": user}, {"levels": levels}
        )
        final = self.meta_step(step)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".tmp-{final.name}-{os.urandom(6).hex()}"
        tmp.mkdir()
        try:
            commit_dir(tmp, final, meta)
        except BaseException:
            remove_tree(tmp)
            raise

    # ------------------------------------------------------------------
    # L2: partner copies.

    def _send_partner_copy(
        self, local: Path, own: Path, sizes: list[int], renames: list[tuple[Path, Path]]
    ) -> None:
        r = self.rank
        dest, source = self.layout.partner(r), self.layout.pred(r)
        data, err = _read_own(own, sizes[r])
        recv = np.empty(sizes[source], dtype=np.uint8)
        self.comm.sendrecv_u8(data, dest, recv, source)  # always, or the partner hangs
        if err is not None:
            raise err
        tmp = local / (partner_file(source) + ".tmp")
        _write_file(tmp, [recv])
        renames.append((tmp, local / partner_file(source)))

    # ------------------------------------------------------------------
    # L3: Reed-Solomon over the group, in stripes.

    def _exchange(self, group: list[int], out: list[U8], in_lengths: list[int]) -> list[U8]:
        """All-to-all inside ``group``: ``out[j]`` goes to member j; returns
        what every member sent this one (``in_lengths[j]`` bytes from j),
        in ``g - 1`` ring-safe shifts."""
        g = len(group)
        me = group.index(self.rank)
        got: list[U8] = [_EMPTY] * g
        got[me] = out[me]
        for d in range(1, g):
            dest, src = (me + d) % g, (me - d) % g
            recv = np.empty(in_lengths[src], dtype=np.uint8)
            self.comm.sendrecv_u8(np.ascontiguousarray(out[dest]), group[dest], recv, group[src])
            got[src] = recv
        return got

    @staticmethod
    def _chunk_len(size: int, t: int, stripe: int) -> int:
        return max(0, min(size - t * stripe, stripe))

    @staticmethod
    def _shard_len(lengths: Sequence[int]) -> int:
        m = max(lengths, default=0)
        return m + (m % 2)

    def _encode(
        self,
        local: Path,
        own: Path,
        sizes: list[int],
        renames: list[tuple[Path, Path]],
        phases: dict[str, float],
        *,
        data: U8 | None = None,
        stripe: int | None = None,
    ) -> tuple[int, int]:
        """Codes the group's parity (collective over the group) into this
        rank's temporary parity file, appended to ``renames``; returns its
        size and xxh3. ``data``: this rank's file already in memory (else
        read from ``own``); ``stripe``: the step's (else this backend's)."""
        import xxhash

        group = self.layout.group(self.rank)
        g = len(group)
        me = group.index(self.rank)
        gsizes = [sizes[r] for r in group]
        stripe = self.stripe if stripe is None else stripe
        nstripes = -(-max(gsizes) // stripe)
        # A failure here must not stop this rank's part of the exchanges
        # (the group would hang): it is raised after the last one.
        read_err: OSError | None = None
        if data is None:
            data, read_err = _read_own(own, gsizes[me])
        err: Exception | None = read_err
        tmp = local / (parity_file(self.rank) + ".tmp")
        h = xxhash.xxh3_64()
        written = 0
        coding = 0.0
        with _Writer(tmp) as f:
            for first in range(0, nstripes, g):
                # Stripe first + j is coded by member j.
                out = [
                    data[(first + j) * stripe : (first + j) * stripe + stripe]
                    if first + j < nstripes
                    else _EMPTY
                    for j in range(g)
                ]
                t_mine = first + me
                lens = [self._chunk_len(s, t_mine, stripe) for s in gsizes]
                chunks = self._exchange(group, out, lens if t_mine < nstripes else [0] * g)
                parity: list[U8] = [_EMPTY] * g
                if t_mine < nstripes:
                    t = time.thread_time()  # the coder runs on this thread
                    try:
                        coded = rs_encode([x.data for x in chunks], g)
                        parity = [np.frombuffer(p, dtype=np.uint8) for p in coded]
                    except DeepPartError as e:
                        err = err or e
                        parity = [np.zeros(self._shard_len(lens), dtype=np.uint8)] * g
                    coding += time.thread_time() - t
                # My parity shard of stripe first + j comes from member j.
                plens = [
                    self._shard_len([self._chunk_len(s, first + j, stripe) for s in gsizes])
                    if first + j < nstripes
                    else 0
                    for j in range(g)
                ]
                mine = self._exchange(group, parity, plens)
                for j in range(g):
                    if plens[j]:
                        f.write(mine[j])
                        h.update(mine[j].data)
                        written += plens[j]
        if err is not None:
            raise err
        if f.err is not None:
            raise f.err
        renames.append((tmp, local / parity_file(self.rank)))
        phases["l3_encode_cpu"] = coding
        return written, int(h.intdigest())

    def _decode(
        self,
        st: _Step,
        group: list[int],
        own: U8 | None,
        parity: U8 | None,
        alive: list[bool],
        parity_alive: list[bool],
        lost: list[bool],
    ) -> U8 | None:
        """Restores the lost members' files of ``group`` (collective over
        the group); returns this rank's file if it was lost."""
        g = len(group)
        me = group.index(self.rank)
        gsizes = [st.meta.file_sizes[r] for r in group]
        stripe = st.stripe
        nstripes = -(-max(gsizes) // stripe)
        result = np.empty(gsizes[me], dtype=np.uint8) if lost[me] else None
        poff = 0  # offset of the current stripe's shard in my parity file
        for first in range(0, nstripes, g):
            out: list[U8] = []
            for j in range(g):
                t = first + j
                if t >= nstripes:
                    out.append(_EMPTY)
                    continue
                lens = [self._chunk_len(s, t, stripe) for s in gsizes]
                slen = self._shard_len(lens)
                parts: list[U8] = []
                if alive[me] and own is not None:
                    parts.append(own[t * stripe : t * stripe + lens[me]])
                if parity_alive[me] and parity is not None:
                    parts.append(parity[poff : poff + slen])
                poff += slen
                out.append(np.concatenate(parts) if parts else _EMPTY)
            t_mine = first + me
            lens_mine = [self._chunk_len(s, t_mine, stripe) for s in gsizes]
            slen_mine = self._shard_len(lens_mine)
            in_lengths = [
                (lens_mine[j] if alive[j] else 0) + (slen_mine if parity_alive[j] else 0)
                if t_mine < nstripes
                else 0
                for j in range(g)
            ]
            got = self._exchange(group, out, in_lengths)
            restored_out: list[U8] = [_EMPTY] * g
            if t_mine < nstripes:
                originals: dict[int, U8] = {}
                recovery: dict[int, U8] = {}
                for j in range(g):
                    pos = 0
                    if alive[j]:
                        originals[j] = got[j][: lens_mine[j]]
                        pos = lens_mine[j]
                    if parity_alive[j]:
                        recovery[j] = got[j][pos : pos + slen_mine]
                t0 = time.thread_time()
                try:
                    restored = rs_reconstruct(
                        g,
                        g,
                        {k: v.data for k, v in originals.items()},
                        {k: v.data for k, v in recovery.items()},
                        lens_mine,
                    )
                except DeepPartError:
                    # Keep the group's exchanges going: the zeros fail the
                    # lost ranks' checksums, which every rank then agrees on.
                    restored = [bytes(n) for n in lens_mine]
                self.decode_seconds += time.thread_time() - t0
                self.decode_bytes += sum(lens_mine)
                for j in range(g):
                    if lost[j]:
                        restored_out[j] = np.frombuffer(restored[j], dtype=np.uint8)
            back_lengths = [
                self._chunk_len(gsizes[me], first + j, stripe)
                if lost[me] and first + j < nstripes
                else 0
                for j in range(g)
            ]
            back = self._exchange(group, restored_out, back_lengths)
            if result is not None:
                for j in range(g):
                    t = first + j
                    if back_lengths[j]:
                        result[t * stripe : t * stripe + back_lengths[j]] = back[j]
        return result

    # ------------------------------------------------------------------
    # Cleanup (after a commit).

    def committed_steps(self) -> list[int]:
        """Committed steps (node-local or global), oldest first."""
        steps = set(_steps_in(self.config.meta_root(), True))
        if self.config.glbl_dir.strip():
            steps |= set(_steps_in(self.config.global_root(), True))
        return sorted(steps)

    def _cleanup(self, newest: int) -> None:
        c = self.comm
        payload = b""
        if c.rank == 0:
            committed = self.committed_steps()
            doomed = set(committed[: -self.keep])
            meta_root = self.config.meta_root()
            for s in _steps_in(meta_root, False):
                if s < newest and s not in committed:
                    doomed.add(s)
            payload = json.dumps(sorted(doomed)).encode()
            for s in sorted(doomed):
                remove_tree(self.meta_step(s))
                if self.config.glbl_dir.strip():
                    remove_tree(self.global_step(s))
            if meta_root.is_dir():
                for child in meta_root.iterdir():
                    if child.name.startswith((".tmp-", ".old-")):
                        remove_tree(child)
        doomed_steps = set(json.loads(c.allgather_varbytes(payload)[0] or b"[]"))
        # One rank per node removes that node's local leftovers.
        hosts = self.layout
        if all(hosts.node(r) != hosts.node(self.rank) for r in range(self.rank)):
            kept = set(self.committed_steps())
            root = self.config.local_root(self.layout.node(self.rank))
            for s in _steps_in(root, False):
                if s in doomed_steps or (s < newest and s not in kept):
                    with contextlib.suppress(OSError):
                        remove_tree(root / step_name(s))
        c.barrier()

    # ------------------------------------------------------------------
    # Recovery.

    def _read_step(self, step: int) -> tuple[_Step | None, str]:
        """The step's node-local metadata (collective), or None and why."""
        err: BaseException | None = None
        meta: Metadata | None = None
        digest = b""
        try:
            meta, digest = read_metadata(self.meta_step(step))
        except CheckpointError as e:
            err = e
        bad = self.comm.allgather_bytes(b"\1" if err else b"\0", 1)
        if any(b != b"\0" for b in bad):
            return None, f"no node-local checkpoint ({err})" if err else "no node-local checkpoint"
        digests = self.comm.allgather_bytes(digest, 32)
        if len(set(digests)) != 1:
            raise CheckpointError(f"{self.meta_step(step)}: ranks read different metadata")
        assert meta is not None
        lv = meta.raw.get("levels")
        if not isinstance(lv, dict):
            return None, "metadata has no levels section"
        try:
            st = _Step(
                step,
                meta,
                int(lv["level"]),
                {k: lv[k] for k in ("node_size", "group_size", "nodes")},
                int(lv["stripe_bytes"]),
                [int(x) for x in lv["parity_sizes"]],
                [int(x) for x in lv["parity_xxh3"]],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{self.meta_step(step)}: bad levels section: {e}") from e
        if st.layout != self.layout.describe() or meta.world_size != self.comm.size:
            return None, (
                f"written by {meta.world_size} ranks as nodes {st.layout['nodes']} "
                f"(node_size {st.layout['node_size']}, group_size {st.layout['group_size']}), "
                f"this job is {self.comm.size} ranks as nodes {self.layout.describe()['nodes']}; "
                + _TOPOLOGY
            )
        return st, ""

    def _survey(self, st: _Step, deep: bool) -> tuple[_Survey, dict[str, U8 | None]]:
        """Which files survive on this rank's node (read and verified when
        ``deep``, else only their sizes), agreed on every rank; and the
        per-rank level serving each rank's data."""
        r = self.rank
        meta = st.meta
        local = self.local_step(st.step)
        pieces = _by_rank(meta)
        bits = 0
        held: dict[str, U8 | None] = {}

        def probe(key: str, path: Path, size: int, verify: Callable[[U8 | None], bool]) -> bool:
            if not deep:
                return _size_is(path, size)
            held[key] = _read_all(path, size)
            return verify(held[key])

        def data_ok(rank: int) -> Callable[[U8 | None], bool]:
            return lambda buf: _file_ok(buf, meta, rank, pieces[rank])

        size = meta.file_sizes[r]
        if probe("own", local / data_file_name(r), size, data_ok(r)):
            bits |= _OWN
        if st.level == 2:
            src = self.layout.pred(r)
            if probe("copy", local / partner_file(src), meta.file_sizes[src], data_ok(src)):
                bits |= _COPY
        if st.level == 3 and probe(
            "parity",
            local / parity_file(r),
            st.parity_sizes[r],
            lambda buf: buf is not None and checksum(buf.data) == st.parity_xxh3[r],
        ):
            bits |= _PARITY
        gdir = self.global_step(st.step)
        if (
            st.level == 4
            and not bits & _OWN
            and is_committed(gdir)
            and probe("global", gdir / data_file_name(r), size, data_ok(r))
        ):
            bits |= _GLOBAL
        status = [row[0] for row in self.comm.allgather_bytes(bytes([bits]), 1)]
        return self._decide(st, status), held

    def _decide(self, st: _Step, status: list[int]) -> _Survey:
        n = self.comm.size
        levels = [0] * n
        for r in range(n):
            if status[r] & _OWN:
                levels[r] = 1
            elif st.level == 2 and status[self.layout.partner(r)] & _COPY:
                levels[r] = 2
            elif st.level == 4 and status[r] & _GLOBAL:
                levels[r] = 4
        if st.level == 3:
            for r in range(n):
                if levels[r]:
                    continue
                group = self.layout.group(r)
                alive = sum(1 for m in group if status[m] & _OWN)
                alive += sum(1 for m in group if status[m] & _PARITY)
                if alive >= len(group):
                    levels[r] = 3
        lost = [r for r in range(n) if not levels[r]]
        if lost:
            return _Survey(
                [],
                f"the data of rank(s) {lost} is lost at every level the step has "
                f"(L{st.level} checkpoint)",
                status,
            )
        return _Survey(levels, "", status)

    def _candidates(self, step: int | None) -> list[int]:
        if step is not None:
            return [step]
        steps = self.committed_steps()
        # Every rank must try the same steps.
        rows = self.comm.allgather_varbytes(json.dumps(steps).encode())
        if len(set(rows)) != 1:
            raise CheckpointError(f"{self.config.meta_root()}: ranks see different checkpoints")
        return steps[::-1]

    def _global_ok(self, step: int) -> bool:
        return bool(self.config.glbl_dir.strip()) and is_committed(self.global_step(step))

    def latest(self) -> int | None:
        """The newest committed step whose files (checked by size, not
        read) suffice to recover it, or None."""
        for s in self._candidates(None):
            st, _ = self._read_step(s)
            if st is None:
                if self._global_ok(s):
                    return s
                continue
            survey, _ = self._survey(st, deep=False)
            if survey.levels:
                return s
        return None

    def load(self, step: int | None = None, *, into: Any = None) -> tuple[Any, RecoveryReport]:
        t0 = time.perf_counter()
        reasons: list[str] = []
        for s in self._candidates(step):
            result = self._try_load(s, into, t0)
            if isinstance(result, str):
                reasons.append(f"step {s}: {result}")
                continue
            self.last_recovery = result[1]
            if self.verbose and self.rank == 0:
                print(f"deeppart levels: {result[1].summary()}", flush=True)
            return result
        if not reasons:
            raise CheckpointError(
                f"{self.config.meta_root()}: no committed checkpoint"
                if step is None
                else f"step {step}: no such committed checkpoint"
            )
        cls = TopologyMismatchError if all(_TOPOLOGY in r for r in reasons) else UnrecoverableError
        raise cls("no checkpoint can be recovered: " + "; ".join(reasons))

    def _load_global(self, step: int, into: Any, t0: float) -> tuple[Any, RecoveryReport]:
        path = self.global_step(step)
        state = load(path, comm=self.comm, into=into, exchange=self.exchange)
        meta, _ = read_metadata(path)
        report = RecoveryReport(step, [4] * meta.world_size, [], time.perf_counter() - t0)
        return state, report

    def _try_load(self, step: int, into: Any, t0: float) -> tuple[Any, RecoveryReport] | str:
        c = self.comm
        st, why = self._read_step(step)
        if st is None:
            if self._global_ok(step):
                return self._load_global(step, into, t0)
            return why
        err: BaseException | None = None
        targets: list[Target] = []
        try:
            targets, _ = all_leaf_targets(st.meta, into)  # checks into= before any I/O
        except Exception as e:
            err = e
        agree(c, err)
        survey, held = self._survey(st, deep=True)
        if not survey.levels:
            if self._global_ok(step) and st.level == 4:
                return self._load_global(step, into, t0)
            return survey.reason
        levels = survey.levels
        r = self.rank
        own = held.get("own") if levels[r] == 1 else None
        # L2: every rank hands the copy it holds back to its source.
        if st.level == 2 and any(lv == 2 for lv in levels):
            pred, succ = self.layout.pred(r), self.layout.partner(r)
            send = held.get("copy") if levels[pred] == 2 else None
            recv = np.empty(st.meta.file_sizes[r] if levels[r] == 2 else 0, dtype=np.uint8)
            c.sendrecv_u8(send if send is not None else _EMPTY, pred, recv, succ)
            if levels[r] == 2:
                own = recv
        if st.level == 3 and any(lv == 3 for lv in levels):
            group = self.layout.group(r)
            if any(levels[m] == 3 for m in group):
                status_own = [levels[m] == 1 for m in group]
                parity = held.get("parity")
                p_ok = parity is not None and checksum(parity.data) == st.parity_xxh3[r]
                rows = c.allgather_bytes(b"\1" if p_ok else b"\0", 1)
                parity_alive = [rows[m] == b"\1" for m in group]
                lost = [levels[m] == 3 for m in group]
                restored = self._decode(
                    st, group, own, parity if p_ok else None, status_own, parity_alive, lost
                )
                if levels[r] == 3:
                    own = restored
            else:
                c.allgather_bytes(b"\0", 1)
        if levels[r] == 4:
            own = held.get("global")
        # Verify what came from another level; rewrite the lost L1 file.
        rewritten = b""
        try:
            pieces = _by_rank(st.meta)
            if not _file_ok(own, st.meta, r, pieces[r]):
                raise UnrecoverableError(
                    f"rank {r}: the L{levels[r]} copy of its data fails its checksums"
                )
            assert own is not None
            if levels[r] != 1:
                local = self.local_step(step)
                local.mkdir(parents=True, exist_ok=True)
                final = local / data_file_name(r)
                tmp = local / (data_file_name(r) + ".tmp")
                _write_file(tmp, [own])
                tmp.replace(final)
                fsync_dir(local)
                rewritten = str(final).encode()
        except UnrecoverableError as e:
            err = e
        except OSError:
            pass  # recovery still works; the file stays lost
        bad = c.allgather_bytes(b"\1" if isinstance(err, UnrecoverableError) else b"\0", 1)
        if any(b != b"\0" for b in bad):
            msgs = c.allgather_varbytes(str(err).encode() if err else b"")
            return "; ".join(m.decode() for m in msgs if m)
        assert own is not None
        rebuilt = self._restore_redundancy(st, own, survey.status)
        if rewritten:
            rebuilt.insert(0, rewritten.decode())
        rows = c.allgather_varbytes(json.dumps(rebuilt).encode())
        all_rewritten = [path for row in rows for path in json.loads(row)]
        # Every rank now holds its own file: broadcast each and place it.
        self._distribute(st, own, targets)
        state = assemble(st.meta, targets, self.meta_step(step))
        report = RecoveryReport(step, levels, all_rewritten, time.perf_counter() - t0)
        return state, report

    def _restore_redundancy(self, st: _Step, own: U8, status: list[int]) -> list[str]:
        """After recovery every rank holds its verified file (``own``): the
        partner copies (L2) and parity shards (L3) that were lost with a
        node are made again, so the step survives the next loss too.
        Collective (L2: the group ring; L3: each group that lost a shard).
        Returns the paths this rank rewrote. A write that fails leaves that
        redundancy missing; recovery itself still succeeds."""
        r = self.rank
        local = self.local_step(st.step)
        done: list[str] = []
        if st.level == 2:
            need = [not status[q] & _COPY for q in range(self.comm.size)]
            if not any(need):
                return done
            dest, source = self.layout.partner(r), self.layout.pred(r)
            recv = np.empty(st.meta.file_sizes[source] if need[r] else 0, dtype=np.uint8)
            self.comm.sendrecv_u8(own if need[dest] else _EMPTY, dest, recv, source)
            if need[r]:
                path = local / partner_file(source)
                try:
                    local.mkdir(parents=True, exist_ok=True)
                    _write_file(path.with_name(path.name + ".tmp"), [recv])
                    path.with_name(path.name + ".tmp").replace(path)
                    fsync_dir(local)
                    done.append(str(path))
                except OSError:
                    pass
        elif st.level == 3:
            group = self.layout.group(r)
            if all(status[m] & _PARITY for m in group):
                return done
            renames: list[tuple[Path, Path]] = []
            with contextlib.suppress(OSError):
                local.mkdir(parents=True, exist_ok=True)
            try:
                size, xxh = self._encode(
                    local, local / data_file_name(r), st.meta.file_sizes, renames, {},
                    data=own, stripe=st.stripe,
                )  # fmt: skip
            except Exception:
                size, xxh = -1, -1  # the group's exchanges finished; this shard stays lost
            for tmp, final in renames:
                try:
                    if status[r] & _PARITY or (size, xxh) != (
                        st.parity_sizes[r],
                        st.parity_xxh3[r],
                    ):
                        tmp.unlink(missing_ok=True)
                    else:
                        tmp.replace(final)
                        fsync_dir(local)
                        done.append(str(final))
                except OSError:
                    pass
        return done

    def _distribute(self, st: _Step, own: U8, targets: list[Target]) -> None:
        c = self.comm
        meta = st.meta
        by = _by_rank(meta)
        prog = Progress("load", 0, enabled=False)
        where = self.meta_step(st.step)

        def direct(p: Piece) -> U8:
            info = meta.leaves[p.leaf]
            if info.kind != "tensor":
                return targets[p.leaf].buf
            return targets[p.leaf].buf[p.start * info.itemsize : p.stop * info.itemsize]

        err: BaseException | None = None
        for f in range(meta.world_size):
            buf = own if f == self.rank else np.empty(meta.file_sizes[f], dtype=np.uint8)
            c.bcast_u8(buf, root=f)
            if err is None:
                try:
                    read_pieces(
                        _BufReader(buf),
                        where / data_file_name(f),
                        where,
                        meta,
                        f,
                        by[f],
                        direct,
                        prog,
                    )
                except Exception as e:
                    err = e
        agree(c, err)

    def close(self) -> None:
        return None


def rank_files(step_dir: Path) -> Callable[[int], Path]:
    """The node-local data file of a rank in ``step_dir`` (for tools)."""
    return lambda r: step_dir / data_file_name(r)
