"""Multi-level checkpoints through the real FTI library (github leobago/fti,
v1.5/1.6): :class:`FTIBackend`, its config file and index (docs/FTI.md).

FTI is a C library that must be built by the user, against the same MPI
library as mpi4py; finding it, loading it with ctypes and its C signatures
are :mod:`deeppart.levels.libfti`'s (``find_libfti`` and ``load_libfti``
are re-exported here). :class:`FTIBackend` implements
:class:`deeppart.levels.backend.LevelBackend` on top of it; in order:

- the config is validated against the job (levels against the topology)
  before FTI is called, because FTI hangs on some invalid ones (L2 on one
  node);
- each job gets its own copy of FTI's INI file (FTI rewrites it), in
  ``meta_dir/<exec_id>/fti.cfg``, seen by every rank and reused on restart;
  ``head = 0`` and inline L2/L3/L4 are required, ``verbosity = 3``;
- every rank's planned pieces (DeepPart's plan, as in :func:`deeppart.save`)
  are registered with ``FTI_Protect``, large ones straight from tensor
  memory, small ones packed into one buffer; ``FTI_Checkpoint(id, level)``
  writes them; rank 0 then writes a small index (pieces, FTI ids, sizes,
  xxh3 checksums) next to the config;
- on restart ``FTI_Init`` rebuilds lost files (L2 partner copies, L3
  Reed-Solomon, L4), ``FTI_Recover`` reads each rank's own pieces back,
  the checksums are verified, and the ranks exchange their pieces with
  buffer broadcasts so every rank holds the full state.

Nothing is pickled: the index is JSON, the data raw bytes.
"""

from __future__ import annotations

import bisect
import configparser
import ctypes
import hashlib
import json
import math
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from deeppart.agreement import agree
from deeppart.comm import Comm, MPIComm, SingleComm
from deeppart.errors import (
    CheckpointError,
    CorruptCheckpointError,
    FTIError,
    LevelConfigError,
    StateMismatchError,
)
from deeppart.format import (
    HEADER_SIZE,
    Metadata,
    Piece,
    checksum,
    fsync_dir,
    parse_metadata,
    write_durable,
)
from deeppart.levels.backend import LevelSaveStats, RecoveryReport
from deeppart.levels.config import LevelConfig
from deeppart.levels.libfti import (
    FTI_DONE,
    FTI_NREC,
    FTI_SCES,
    Lib,
    check_same_mpi,
    find_libfti,
    load_libfti,
)
from deeppart.loading.reader import assemble, leaf_infos, leaf_targets, meta_leaf_paths
from deeppart.loading.reshard import (
    ShardReads,
    fill_shards,
    local_shard_reads,
    shard_slot,
    shard_targets,
)
from deeppart.saving.metadata import metadata_head
from deeppart.saving.planning import PlanProvider
from deeppart.saving.prepare import Prepared, prepare_save
from deeppart.state.own_view import OwnView, own_view
from deeppart.state.tensors import dtype_sizes, readable, u8_view

#: ``find_libfti``, ``load_libfti`` and ``check_same_mpi`` are
#: :mod:`deeppart.levels.libfti`'s, re-exported here (docs/FTI.md names them
#: as this module's).
__all__ = [
    "FTIBackend",
    "FTIError",
    "check_same_mpi",
    "find_libfti",
    "fti_config_text",
    "load_libfti",
]

U8 = npt.NDArray[np.uint8]

#: Settings DeepPart requires in FTI's config, and why.
REQUIRED = {
    ("basic", "head"): ("0", "dedicated FTI head processes never return from FTI_Init"),
    ("basic", "inline_l2"): ("1", "DeepPart needs L2 finished when FTI_Checkpoint returns"),
    ("basic", "inline_l3"): ("1", "DeepPart needs L3 finished when FTI_Checkpoint returns"),
    ("basic", "inline_l4"): ("1", "DeepPart needs L4 finished when FTI_Checkpoint returns"),
    ("basic", "ckpt_io"): ("1", "the backend is tested with POSIX I/O only"),
    ("basic", "enable_dcp"): ("0", "differential checkpoints are not supported"),
    ("basic", "enable_icp"): ("0", "incremental checkpoints are not supported"),
    ("basic", "enable_staging"): ("0", "staging is not supported"),
}

#: FTI's console verbosity: 3 prints errors only.
FTI_VERBOSITY = 3

#: A piece at least this large is protected straight from tensor memory;
#: smaller ones are packed into one buffer (a copy), which keeps the number
#: of FTI datasets small.
ZERO_COPY_MIN = 4 << 20

#: At most this many zero-copy datasets per rank (the rest are packed), so
#: a rank protects about 2 * MAX_ZERO_COPY + 2 datasets (more only for
#: shares over MAX_BLOB).
MAX_ZERO_COPY = 60

#: Largest FTI dataset, in bytes. FTI 1.5 declares FTI_Protect's count and
#: FTI_GetStoredSize as int32_t (1.6: int64_t), so datasets stay well under
#: 2 GiB; a larger piece becomes several datasets (still zero-copy).
MAX_BLOB = 1 << 30

#: FTI dataset id of each rank's header; data blobs follow.
HEADER_ID = 0
_HEADER = struct.Struct("<8sqii32s")
#: The header dataset's size before padding (the whole header of
#: checkpoints written before FILE_ALIGN, whose indexes have no
#: ``header_bytes``).
_HEADER_BYTES = 64
_MAGIC = b"DPFTI001"

#: Every rank's FTI checkpoint file is a multiple of this many bytes: the
#: header dataset is padded with zeros to make it so. FTI's L3 encodes
#: with Reed-Solomon on 16-bit words (FTI_WORD, jerasure w = 16) but
#: writes and reads the encoded file's last block byte by byte, so when the
#: largest file of an L3 group has an odd size the other half of its last
#: word is lost, and the file FTI rebuilds for a lost node comes back with
#: its last byte wrong (docs/FTI.md).
FILE_ALIGN = 8

INDEX_PREFIX = "fti-step-"
CONFIG_NAME = "fti.cfg"


# ----------------------------------------------------------------------------
# FTI's config file.


def _fti_dirs(config: LevelConfig) -> tuple[str, str, str]:
    glbl = config.glbl_dir.strip() or str(config.meta_root() / "fti-global")
    return (
        os.path.abspath(config.ckpt_dir),
        os.path.abspath(glbl),
        os.path.abspath(config.meta_dir),
    )


def check_fti_options(config: LevelConfig) -> None:
    """Raises :class:`LevelConfigError` when the config asks for something
    the backend does not support (an ``s3://`` glbl_dir; in its FTI-only
    keys: heads, offline levels...)."""
    config.check_fti_global()
    config.check_fti_memory()
    if config.l2_rate:
        raise LevelConfigError(
            f"l2_rate = {config.l2_rate}: the paced partner copy is the built-in engine's "
            "(libfti sends its own); use backend='builtin', or l2_rate = 0"
        )
    for sec, key, value in config.fti_options:
        want = REQUIRED.get((sec, key))
        if want is not None and value.strip() != want[0]:
            raise LevelConfigError(
                f"{key} = {value.strip()}: the FTI backend needs {want[0]} ({want[1]})"
            )
    if config.head != 0:
        raise LevelConfigError(f"head = {config.head}: the FTI backend needs head = 0")


def fti_config_text(config: LevelConfig, *, failure: int = 0, exec_id: str | None = None) -> str:
    """FTI's INI file for ``config``: DeepPart's keys, the FTI-only keys it
    accepts (``config.fti_options``), and the settings the backend requires
    (:data:`REQUIRED`; ``verbosity = 3``). ``failure`` and ``exec_id``
    (section ``[restart]``) are FTI's own, carried over from the file FTI
    rewrote so that a restart finds its checkpoint."""
    check_fti_options(config)
    ckpt_dir, glbl_dir, meta_dir = _fti_dirs(config)
    basic: dict[str, str] = {
        "head": "0",
        "node_size": str(config.node_size),
        "ckpt_dir": ckpt_dir,
        "glbl_dir": glbl_dir,
        "meta_dir": meta_dir,
        # FTI's intervals are minutes for FTI_Snapshot, which DeepPart does
        # not call; it passes the level to FTI_Checkpoint itself.
        "ckpt_l1": str(config.ckpt_l1),
        "ckpt_l2": str(config.ckpt_l2),
        "ckpt_l3": str(config.ckpt_l3),
        "ckpt_l4": str(config.ckpt_l4),
        "dcp_l4": "0",
        "inline_l2": "1",
        "inline_l3": "1",
        "inline_l4": "1",
        "keep_last_ckpt": str(config.keep_last_ckpt),
        "keep_l4_ckpt": "0",
        "group_size": str(config.group_size),
        "max_sync_intv": "0",
        "ckpt_io": "1",
        "enable_staging": "0",
        "enable_dcp": "0",
        "enable_icp": "0",
        "dcp_mode": "0",
        "dcp_block_size": "16384",
        "verbosity": str(FTI_VERBOSITY),
    }
    restart: dict[str, str] = {"failure": str(int(failure))}
    if exec_id:
        restart["exec_id"] = exec_id
    injection = {"rank": "0", "number": "0", "position": "0", "frequency": "0"}
    advanced: dict[str, str] = {
        "block_size": "1024",
        "transfer_size": "16",
        "general_tag": "2612",
        "ckpt_tag": "711",
        "stage_tag": "406",
        "final_tag": "3107",
        "local_test": str(config.local_test),
        "lustre_striping_unit": "4194304",
        "lustre_striping_factor": "-1",
        "lustre_striping_offset": "-1",
    }
    sections = {"basic": basic, "restart": restart, "injection": injection, "advanced": advanced}
    fixed = {("basic", k) for k in ("node_size", "ckpt_dir", "glbl_dir", "meta_dir", "verbosity")}
    for sec, key, value in config.fti_options:
        if sec in sections and (sec, key) not in fixed and sec != "restart":
            sections[sec][key] = value.strip()
    out: list[str] = ["; written by deeppart.levels.fti (FTI rewrites [restart])"]
    for name, values in sections.items():
        out.append(f"[{name}]")
        out += [f"{k:<30} = {v}" for k, v in values.items()]
        out.append("")
    return "\n".join(out)


def _read_restart(path: Path) -> tuple[int, str | None]:
    """(failure, exec_id) of FTI's rewritten config file, (0, None) if none."""
    if not path.exists():
        return 0, None
    parser = configparser.ConfigParser(
        interpolation=None, inline_comment_prefixes=(";", "#"), strict=False
    )
    try:
        parser.read_string(path.read_text(errors="replace"), source=str(path))
    except (OSError, configparser.Error) as e:
        raise FTIError(f"{path}: cannot read FTI's config file: {e}") from e
    sec = next((s for s in parser.sections() if s.strip().lower() == "restart"), None)
    if sec is None:
        return 0, None
    raw = parser.get(sec, "failure", fallback="0").strip()
    try:
        failure = int(raw)
    except ValueError:
        failure = 0
    exec_id = parser.get(sec, "exec_id", fallback="").strip() or None
    return failure, exec_id


# ----------------------------------------------------------------------------
# The backend.


@dataclass
class _Blob:
    """One FTI dataset of a rank: ``nbytes`` of the rank's piece stream from
    ``start``."""

    fti_id: int
    start: int
    nbytes: int


def _blobs(lengths: list[int]) -> list[_Blob]:
    """Splits a rank's stream of pieces (``lengths``, in plan order) into FTI
    datasets of at most :data:`MAX_BLOB` bytes: a piece of at least
    :data:`ZERO_COPY_MIN` bytes alone (up to :data:`MAX_ZERO_COPY` of them),
    runs of the others together. Empty pieces take no dataset.
    Deterministic: save and restore agree."""
    out: list[_Blob] = []

    def emit(start: int, stop: int) -> None:
        for a in range(start, stop, MAX_BLOB):
            out.append(_Blob(HEADER_ID + 1 + len(out), a, min(MAX_BLOB, stop - a)))

    run_start = pos = 0
    big = 0
    for n in lengths:
        if n >= ZERO_COPY_MIN and big < MAX_ZERO_COPY:
            emit(run_start, pos)
            emit(pos, pos + n)
            big += 1
            run_start = pos + n
        pos += n
    emit(run_start, pos)
    return out


def _fill(blob: _Blob, views: list[U8], starts: list[int]) -> U8:
    """The bytes of ``blob``: a view of one piece when it lies inside one
    (no copy), else a copy of its range of the stream (``starts``: each
    piece's offset in the stream)."""
    end = blob.start + blob.nbytes
    k = bisect.bisect_right(starts, blob.start) - 1
    while views[k].size == 0 or starts[k] + views[k].size <= blob.start:
        k += 1  # skip empty pieces at this offset
    if end <= starts[k] + views[k].size:
        return views[k][blob.start - starts[k] : end - starts[k]]
    buf = np.empty(blob.nbytes, dtype=np.uint8)
    pos = blob.start
    while pos < end:
        v, v0 = views[k], starts[k]
        n = min(end, v0 + v.size) - pos
        if n > 0:
            buf[pos - blob.start : pos - blob.start + n] = v[pos - v0 : pos - v0 + n]
            pos += n
        k += 1
    return buf


def header_bytes(blob_bytes: int, nblobs: int, nids: int) -> int:
    """The size of a rank's header dataset: :data:`_HEADER_BYTES` and zeros
    up to a file size that is a multiple of :data:`FILE_ALIGN`. The rank's
    FTI file holds the header, its ``nblobs`` blobs (``blob_bytes`` in all)
    and a 1-byte placeholder for each other id below ``nids``. Save and the
    index compute it alike."""
    size = _HEADER_BYTES + blob_bytes + (nids - 1 - nblobs)
    return _HEADER_BYTES + (-size) % FILE_ALIGN


def _reshard_hint(meta: Metadata) -> str:
    """What serves a DTensor state on another world size, for the error of
    a restart on another number of ranks."""
    if not meta.dtensors:
        return ""
    return (
        f"; its DTensor state ({len(meta.dtensors)} sharded tensors) cannot be resharded "
        "through FTI, whose files are per rank: to restore it on another number of ranks, "
        'save it with the built-in engine (backend="builtin", whose L4 copy deeppart.load '
        "reshards) or with deeppart.save"
    )


def _pointer(arr: U8) -> int:
    return int(arr.ctypes.data) if arr.size else 0


class FTIBackend:
    """:class:`~deeppart.levels.backend.LevelBackend` over the real FTI
    library. Collective: construct and call it on every rank of ``comm``
    (an mpi4py communicator, a :class:`deeppart.comm.MPIComm`, or None for
    ``MPI.COMM_WORLD``). ``library``: the libfti to load (default:
    :func:`find_libfti`)."""

    name = "fti"

    def __init__(
        self, config: LevelConfig, comm: Any = None, *, library: str | None = None
    ) -> None:
        self.config = config
        self._lib: Lib | None = None
        self._initialised = False
        self._closed = False
        self._keep: list[Any] = []  # buffers FTI holds raw pointers to
        self._nids = 0  # datasets protected so far (ids 0 .. _nids-1)
        self._protected: set[int] = set()  # every id this rank gave FTI_Protect
        self._fti_comm: Any = None  # the duplicate communicator FTI was given
        self._count = 0  # saves through this backend
        self._last_step: int | None = None
        self._last_level = 0
        self._recovered_status = 0
        self._recover_failed = False
        self._hosts: list[str] | None = None

        # The communicator of the job. A SingleComm (one process) needs no
        # MPI until the library is loaded: the checks below come first.
        mpi_comm: Any = None
        user: Comm
        if isinstance(comm, SingleComm):
            user = comm
        elif isinstance(comm, MPIComm):
            user, mpi_comm = comm, comm.comm
        else:
            if comm is None:
                from mpi4py import MPI

                comm = MPI.COMM_WORLD
            if not callable(getattr(comm, "Get_rank", None)):
                raise LevelConfigError(
                    f"the FTI backend needs an MPI communicator (libfti runs on MPI), not "
                    f"{type(comm).__name__}; use backend='builtin' with torch.distributed"
                )
            user, mpi_comm = MPIComm(comm), comm

        # 1. The config against the job, before FTI (it hangs on some).
        err: BaseException | None = None
        try:
            check_fti_options(config)
            hosts = None
            if not config.local_test:
                hosts = [h.decode() for h in user.allgather_varbytes(socket.gethostname().encode())]
            config.validate(user.size, hosts)
            self._hosts = hosts
        except BaseException as e:
            err = e
        agree(user, err)

        # 2. The library, on every rank.
        try:
            self._lib = load_libfti(library)
        except BaseException as e:
            err = e
        agree(user, err)
        lib = self._lib
        assert lib is not None

        from mpi4py import MPI

        if mpi_comm is None:
            mpi_comm = MPI.COMM_SELF

        # 3. The per-job config file, written by rank 0, reused on restart.
        self._dir = config.meta_root()
        self.config_path = self._dir / CONFIG_NAME
        if user.rank == 0:
            try:
                self._dir.mkdir(parents=True, exist_ok=True)
                failure, exec_id = _read_restart(self.config_path)
                text = fti_config_text(config, failure=failure, exec_id=exec_id)
                tmp = self.config_path.with_name(f".{CONFIG_NAME}.{os.getpid()}")
                tmp.write_text(text)
                os.replace(tmp, self.config_path)
                fsync_dir(self._dir)
            except BaseException as e:
                err = e
        agree(user, err)

        # 4. FTI_Init (collective; rebuilds lost files on a restart). FTI
        # gets its own duplicate of the communicator with MPI errors fatal:
        # FTI does not check the return codes of its metadata gathers, and
        # mpi4py's MPI_ERRORS_RETURN (inherited by every communicator FTI
        # derives) would let a truncated gather commit unreadable metadata.
        self._fti_comm = mpi_comm.Dup()
        self._fti_comm.Set_errhandler(MPI.ERRORS_ARE_FATAL)
        handle = lib.comm_type(MPI._handleof(self._fti_comm))
        rc = lib.cdll.FTI_Init(str(self.config_path).encode(), handle)
        if rc not in (FTI_SCES, FTI_NREC):
            raise FTIError(f"FTI_Init({self.config_path}) failed with {rc}")
        self._initialised = True
        self._recover_failed = rc == FTI_NREC
        # From here on: FTI's communicator (without heads, the same ranks).
        self._mpi_comm = MPI.Intracomm.fromhandle(lib.comm_world())
        self.comm: Comm = MPIComm(self._mpi_comm)
        self._char = lib.char_type()
        self._recovered_status = int(lib.cdll.FTI_Status())
        if self.comm.size != user.size:
            raise FTIError(f"FTI_COMM_WORLD has {self.comm.size} ranks, the job {user.size}")
        if self._recovered_status and not self._recover_failed:
            # FTI knows the stored datasets; a save before any load must
            # protect them all again (placeholders), as FTI checkpoints every
            # dataset it knows.
            self._nids = self._stored_ids()

    def _stored_ids(self) -> int:
        """This rank's number of FTI datasets in the newest index (0 if none
        or unreadable)."""
        steps = self._indexed_steps()
        if not steps:
            return 0
        try:
            fti = json.loads(self._index_path(steps[-1]).read_bytes())["fti"]
            return int(fti["ids"][self.comm.rank])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return 0

    # ------------------------------------------------------------------

    @property
    def library(self) -> str:
        assert self._lib is not None
        return self._lib.path

    @property
    def status(self) -> int:
        """``FTI_Status()`` right after ``FTI_Init``: 0 fresh start, 1
        restart from the best level, 2 restart from the last L4."""
        return self._recovered_status

    def _fti(self) -> ctypes.CDLL:
        if self._closed or self._lib is None:
            raise CheckpointError("the FTI backend is closed")
        return self._lib.cdll

    def _protect(self, fti_id: int, buf: U8) -> None:
        rc = self._fti().FTI_Protect(fti_id, _pointer(buf), int(buf.size), self._char)
        if rc != FTI_SCES:
            raise FTIError(f"FTI_Protect(id {fti_id}, {buf.size} bytes) failed with {rc}")
        self._protected.add(fti_id)

    def _protect_all(
        self, head: bytes, blobs: list[tuple[_Blob, U8]], keep: list[Any], total: int
    ) -> int:
        """Protects the header (``head`` padded to :func:`header_bytes`)
        and the blobs, then 1-byte placeholders for
        ids ``1 + len(blobs) .. total - 1``: ``total`` is the same on every
        rank (the largest count across ranks, and never less than before,
        since FTI checkpoints and recovers every id it knows), because FTI
        1.6's metadata assumes every rank protects the same number of
        datasets. Returns the number of ids."""
        size = header_bytes(sum(int(buf.size) for _, buf in blobs), len(blobs), total)
        header = np.zeros(size, dtype=np.uint8)
        header[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        keep.append(header)
        self._protect(HEADER_ID, header)
        for blob, buf in blobs:
            self._protect(blob.fti_id, buf)
        for fti_id in range(1 + len(blobs), total):
            pad = np.zeros(1, dtype=np.uint8)
            keep.append(pad)
            self._protect(fti_id, pad)
        self._keep = keep
        self._nids = max(self._nids, total)
        return self._nids

    def _check_protected(self, err: BaseException | None, what: str) -> None:
        """Collective: raises on every rank unless every rank has protected
        the same set of FTI ids (FTI 1.6 gathers the group root's count of
        variables from every member: a rank with more loses its extra
        datasets from the metadata, one with fewer records garbage, and the
        checkpoint still reports success). ``what``: the FTI call it
        guards, for the message."""
        ids = sorted(self._protected)
        payload = struct.pack("<I", len(ids)) + hashlib.sha256(repr(ids).encode()).digest()[:28]
        rows = agree(self.comm, err, payload)
        if len(set(rows)) != 1:
            counts = [struct.unpack("<I", row[:4])[0] for row in rows]
            raise FTIError(
                f"ranks protect different FTI datasets (ids per rank: {counts}); FTI needs the "
                f"same ids on every rank, so {what} was not called"
            )

    def _level_checked(self, level: int) -> None:
        if level not in (1, 2, 3, 4):
            raise LevelConfigError(f"level {level}: must be 1, 2, 3 or 4")
        # The level must fit the topology even if the config does not
        # enable it (FTI hangs, e.g., on L2 with one node).
        probe = self.config.replace(**{f"ckpt_l{level}": max(1, self.config.interval(level))})
        probe.validate(self.comm.size, self._hosts)

    def _index_path(self, step: int) -> Path:
        return self._dir / f"{INDEX_PREFIX}{step:08d}.json"

    # ------------------------------------------------------------------

    def save(self, step: int, state: Any, *, level: int | None = None) -> LevelSaveStats:
        """Checkpoints ``state`` (each rank's own tree, as for
        :func:`deeppart.save`: values that differ between the ranks are kept
        per rank) as ``step`` through ``FTI_Checkpoint(step + 1, level)``."""
        t0 = time.perf_counter()
        c = self.comm
        err: BaseException | None = None
        prep: Prepared | None = None
        lv = level if level is not None else self.config.level_for(self._count + 1)
        try:
            self._fti()
            if not 0 <= step < (1 << 31) - 1:
                raise CheckpointError(f"step {step}: FTI needs 0 <= step < 2**31 - 1")
            self._level_checked(lv)

        except BaseException as e:
            err = e
        # deeppart.save's prepare: each rank passes its own tree; values and
        # tensors that differ between the ranks are kept per rank (each
        # rank's own version, deeppart.state.union); every rank raises if
        # any failed above.
        # DTensors become shard leaves held by their holders (each rank's
        # local shards), as in deeppart.save.
        prep, _ = prepare_save(
            c, err, state, None, PlanProvider(c.size), self._dir / f"step-{step}"
        )

        # This rank's pieces: views of tensor memory (or encoded values),
        # checksummed, cut into FTI datasets.
        t1 = time.perf_counter()
        keep: list[Any] = []
        local = np.zeros(len(prep.plan.rank_pieces(c.rank)) + 1, dtype=np.uint64)
        head = b""
        blobs: list[tuple[_Blob, U8]] = []
        sums: list[int] = []
        piece_bytes = 0  # this rank's bytes of the state, stored by FTI
        try:
            pieces = prep.plan.rank_pieces(c.rank)
            views: list[U8] = []
            cache: dict[int, tuple[U8, int]] = {}
            for li, start, stop in pieces:
                leaf = prep.leaves[li]
                if leaf.tensor is not None:
                    if li not in cache:
                        t = readable(leaf.tensor)
                        keep.append(t)
                        cache[li] = (u8_view(t), t.element_size())
                    arr, isz = cache[li]
                    views.append(arr[start * isz : stop * isz])
                else:
                    assert leaf.encoded is not None
                    views.append(np.frombuffer(leaf.encoded, dtype=np.uint8))
            sums = [checksum(v.data) for v in views]
            starts = [0]
            for v in views:
                starts.append(starts[-1] + int(v.size))
            piece_bytes = starts[-1]
            for blob in _blobs([int(v.size) for v in views]):
                buf = _fill(blob, views, starts)
                keep.append(buf)
                blobs.append((blob, buf))
            head = _HEADER.pack(_MAGIC, step, c.rank, c.size, self._digest(prep, step))
        except BaseException as e:
            err = e
        # Every rank protects as many ids as the rank with the most.
        wants = agree(c, err, struct.pack("<q", max(self._nids, 1 + len(blobs))))
        total = max(struct.unpack("<q", w[:8])[0] for w in wants)
        try:
            nids = self._protect_all(head, blobs, keep, total)
            local = np.array([*sums, nids], dtype=np.uint64)
        except BaseException as e:
            err = e
        self._check_protected(err, f"FTI_Checkpoint(id {step + 1})")
        t2 = time.perf_counter()

        rc = self._fti().FTI_Checkpoint(step + 1, lv)
        if rc not in (FTI_DONE, FTI_SCES):
            err = FTIError(f"FTI_Checkpoint(id {step + 1}, level {lv}) failed with {rc}")
        agree(c, err)
        t3 = time.perf_counter()

        # Rank 0 writes the index: the checkpoint's metadata, FTI ids, checksums.
        counts = [len(prep.plan.rank_pieces(r)) + 1 for r in range(c.size)]
        gathered = c.gatherv_u64(local, counts, root=0)
        if c.rank == 0:
            assert gathered is not None
            try:
                meta = self._index(prep, step, lv, gathered)
                write_durable(self._index_path(step), meta)
                fsync_dir(self._dir)
                # FTI keeps one checkpoint: the other indexes go (only
                # files named as this backend names them).
                for old in self._indexed_steps():
                    if old != step:
                        self._index_path(old).unlink(missing_ok=True)
            except BaseException as e:
                err = e
        agree(c, err)
        self._count += 1
        self._last_step = step
        self._last_level = lv
        t4 = time.perf_counter()
        # Every rank's time and bytes, so that the stats are the same on every rank.
        rows = c.allgather_f64(np.array([t4 - t0, float(piece_bytes)], dtype=np.float64))
        rank_seconds = [float(x) for x in rows[:, 0]]
        return LevelSaveStats(
            op="save",
            directory=str(self._dir),
            world_size=c.size,
            raw_bytes=prep.manifest.total_bytes,
            stored_bytes=int(rows[:, 1].sum()),
            seconds=max(rank_seconds),
            rank_seconds=rank_seconds,
            codec=prep.codec,
            step=step,
            level=lv,
            phases={
                "plan": t1 - t0,
                "protect": t2 - t1,
                f"fti_l{lv}": t3 - t2,
                "index": t4 - t3,
            },
        )

    @staticmethod
    def _digest(prep: Prepared, step: int) -> bytes:
        return hashlib.sha256(prep.digest + struct.pack("<q", step)).digest()

    def _index(
        self, prep: Prepared, step: int, level: int, gathered: npt.NDArray[np.uint64]
    ) -> bytes:
        """The index (``gathered``: per rank, its pieces' xxh3 and its
        number of FTI datasets)."""
        world = prep.plan.world_size
        infos = prep.manifest.leaves()

        def piece_bytes(li: int, start: int, stop: int) -> int:
            # From the manifest, not from rank 0's leaves: another rank's
            # pieces may be of its own version of a per-rank value.
            info = infos[li]
            if info["kind"] != "tensor":
                return int(info["nbytes"])  # a plain value: one whole piece
            numel = math.prod(info["shape"])
            return (stop - start) * (int(info["nbytes"]) // numel) if numel else 0

        rows: list[list[Any]] = []
        blobs: list[list[int]] = []
        stream: list[int] = []
        nids: list[int] = []
        heads: list[int] = []
        k = 0
        for r in range(world):
            pos = HEADER_SIZE  # offsets in the rank's piece stream, as in a data file
            lengths: list[int] = []
            for li, start, stop in prep.plan.rank_pieces(r):
                n = piece_bytes(li, start, stop)
                rows.append([li, start, stop, r, pos, n, n, "none", int(gathered[k])])
                lengths.append(n)
                pos += n
                k += 1
            nids.append(int(gathered[k]))
            k += 1
            stream.append(pos)
            mine = _blobs(lengths)
            blobs += [[r, b.fti_id, b.start, b.nbytes] for b in mine]
            heads.append(header_bytes(sum(lengths), len(mine), nids[-1]))
        meta = {
            **metadata_head(prep, "none"),
            "alignment": 1,
            "raw_bytes": prep.manifest.total_bytes,
            "stored_bytes": prep.manifest.total_bytes,
            "file_sizes": stream,
            "pieces": rows,
            "user": None,
            "fti": {
                "step": step,
                "level": level,
                "checkpoint_id": step + 1,
                "digest": self._digest(prep, step).hex(),
                "ids": nids,
                "blobs": blobs,
                "header_bytes": heads,
                "library": self.library,
            },
        }
        return json.dumps(meta, separators=(",", ":"), allow_nan=False).encode()

    # ------------------------------------------------------------------

    def _indexed_steps(self) -> list[int]:
        steps: list[int] = []
        for p in self._dir.glob(f"{INDEX_PREFIX}*.json"):
            digits = p.stem[len(INDEX_PREFIX) :]
            if digits.isascii() and digits.isdigit() and p == self._index_path(int(digits)):
                steps.append(int(digits))
        return sorted(steps)

    def latest(self) -> int | None:
        """The step FTI can recover: the last one saved by this backend, or
        on a restart the newest indexed one (FTI keeps one checkpoint)."""
        self._fti()
        if self._last_step is not None:
            return self._last_step
        if self._recovered_status == 0 or self._recover_failed:
            return None
        steps = self._indexed_steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        """FTI keeps one checkpoint: [:meth:`latest`], or []."""
        have = self.latest()
        return [] if have is None else [have]

    def load(self, step: int | None = None, *, into: Any = None) -> tuple[Any, RecoveryReport]:
        """Restores the checkpoint FTI holds (``step``: None or that step)
        on every rank, verifying every piece's xxh3 checksum."""
        t0 = time.perf_counter()
        c = self.comm
        lib = self._fti()
        err: BaseException | None = None
        have = self.latest()
        meta_raw: dict[str, Any] = {}
        digest = b""
        try:
            if have is None:
                if self._recover_failed:
                    raise CheckpointError(
                        "FTI could not recover the checkpoint files at FTI_Init (too many lost)"
                    )
                raise CheckpointError(f"no FTI checkpoint to recover in {self._dir}")
            if step is not None and step != have:
                raise CheckpointError(
                    f"step {step}: FTI keeps only its newest checkpoint, step {have}"
                )
            text = self._index_path(have).read_bytes()
            digest = hashlib.sha256(text).digest()
            meta_raw = json.loads(text)
            if not isinstance(meta_raw, dict) or not isinstance(meta_raw.get("fti"), dict):
                raise CorruptCheckpointError(f"{self._index_path(have)}: not an FTI index")
        except (OSError, ValueError) as e:
            err = CorruptCheckpointError(f"{self._index_path(have or 0)}: {e}")
        except BaseException as e:
            err = e
        digests = agree(c, err, digest)
        if len(set(digests)) != 1:
            raise StateMismatchError(f"{self._dir}: ranks read different index files")
        assert have is not None

        # Parse and check the index, allocate this rank's stream.
        fti = meta_raw["fti"]
        stream = np.zeros(0, dtype=np.uint8)
        header = np.zeros(_HEADER_BYTES, dtype=np.uint8)
        blobs: list[_Blob] = []
        try:
            meta_raw["leaves"] = [
                {
                    k: (list(v) if isinstance(v, tuple) else v)
                    for k, v in lf.items()
                    if v is not None
                }
                for lf in leaf_infos(meta_raw)
            ]
            meta = parse_metadata(meta_raw, dtype_sizes(meta_raw["leaves"]))
            if meta.world_size != c.size:
                raise CheckpointError(
                    f"the FTI checkpoint was written by {meta.world_size} ranks, this job has "
                    f"{c.size} (FTI restarts on the same number of ranks){_reshard_hint(meta)}"
                )
            nids = int(fti["ids"][c.rank])
            blobs = [_Blob(int(i), int(s), int(n)) for r, i, s, n in fti["blobs"] if r == c.rank]
            size = int(meta.file_sizes[c.rank]) - HEADER_SIZE
            stream = np.empty(size, dtype=np.uint8)
            # An index without header_bytes: the unpadded 64-byte header
            # of a checkpoint written before FILE_ALIGN.
            hsize = int(fti.get("header_bytes", [_HEADER_BYTES] * c.size)[c.rank])
            if not _HEADER_BYTES <= hsize < _HEADER_BYTES + 4096:
                raise CorruptCheckpointError(f"FTI index: header of {hsize} bytes")
            header = np.zeros(hsize, dtype=np.uint8)
            sizes = {HEADER_ID: hsize} | {b.fti_id: b.nbytes for b in blobs}
            keep: list[Any] = [stream, header]
            bufs: dict[int, U8] = {HEADER_ID: header}
            for b in blobs:
                if b.start < 0 or b.start + b.nbytes > size:
                    raise CorruptCheckpointError(f"FTI index: dataset {b.fti_id} out of bounds")
                bufs[b.fti_id] = stream[b.start : b.start + b.nbytes]
            for fti_id in range(nids):
                stored = int(lib.FTI_GetStoredSize(fti_id))
                expect = sizes.get(fti_id, 1)
                # FTI 1.5 returns an int32_t: only its low 32 bits are defined.
                if stored != expect and stored & 0xFFFFFFFF != expect:
                    raise CorruptCheckpointError(
                        f"FTI dataset {fti_id} of rank {c.rank}: FTI stored {stored} bytes, "
                        f"the index says {expect}"
                    )
                if fti_id not in bufs:
                    bufs[fti_id] = np.zeros(1, dtype=np.uint8)
                    keep.append(bufs[fti_id])
                self._protect(fti_id, bufs[fti_id])
            self._keep = keep
            self._nids = max(self._nids, nids)
        except CheckpointError as e:
            err = e
        except (KeyError, TypeError, ValueError) as e:
            err = CorruptCheckpointError(f"{self._index_path(have)}: malformed FTI index ({e})")
        except BaseException as e:
            err = e
        self._check_protected(err, "FTI_Recover")

        rc = lib.FTI_Recover()
        if rc != FTI_SCES:
            err = FTIError(f"FTI_Recover failed with {rc}")
        agree(c, err)
        t1 = time.perf_counter()

        # Verify: this rank's header, then every piece of its stream.
        mine: OwnView | None = None
        sr: ShardReads | None = None
        try:
            magic, hstep, hrank, hworld, hdigest = _HEADER.unpack(header[: _HEADER.size].tobytes())
            if (magic, hstep, hrank, hworld) != (_MAGIC, have, c.rank, c.size) or (
                hdigest.hex() != fti["digest"]
            ):
                raise CorruptCheckpointError(
                    f"rank {c.rank}: FTI recovered a checkpoint of another step or job "
                    f"(step {hstep}, rank {hrank}/{hworld}), the index is for step {have}"
                )
            for p in meta.pieces:
                if p.rank != c.rank:
                    continue
                got = stream[p.offset - HEADER_SIZE : p.offset - HEADER_SIZE + p.length]
                if checksum(got.data) != p.xxh3:
                    raise CorruptCheckpointError(
                        f"rank {c.rank}: piece of leaf {p.leaf} [{p.start}:{p.stop}] "
                        "recovered by FTI fails its xxh3 checksum"
                    )
            # This rank's own view (its versions of per-rank values, the
            # items it held), as deeppart.load gives it.
            # As deeppart.load at the save's world size: the DTensors'
            # regions this rank needs (into='s local shards, else whole
            # tensors) come from the stored shards that meet them.
            mine = own_view(meta, c.rank, c.size, None, into)
            st = shard_targets(mine.meta, into, None, True)
            chosen = [
                [] if i in mine.meta.skip or i in st.leaves else ps
                for i, ps in enumerate(meta_leaf_paths(mine.meta))
            ]
            targets, matched = leaf_targets(mine.meta, into, chosen, into_elsewhere=st.into_leaves)
            sr = local_shard_reads(mine.meta, st) if st.active else None
        except BaseException as e:
            err = e
        agree(c, err)
        assert mine is not None

        # Exchange: every rank broadcasts its own pieces.
        def direct(leaf: int, start: int, stop: int) -> U8 | None:
            info = meta.leaves[leaf]
            target = targets[leaf]
            if target is None:  # not read by this rank
                return None
            if info.kind != "tensor":
                return target.buf
            return target.buf[start * info.itemsize : stop * info.itemsize]

        def dest(p: Piece) -> U8 | None:
            if sr is not None and p.leaf in sr.buffers:
                return shard_slot(meta, sr, p)
            return direct(p.leaf, p.start, p.stop)

        for r in range(c.size):
            size = int(meta.file_sizes[r]) - HEADER_SIZE
            if size == 0:
                continue
            buf = stream if r == c.rank else np.empty(size, dtype=np.uint8)
            c.bcast_u8(buf, root=r)
            for p in meta.pieces:
                if p.rank == r and p.length:
                    out = dest(p)
                    if out is not None:
                        out[:] = buf[p.offset - HEADER_SIZE : p.offset - HEADER_SIZE + p.length]

        try:
            filled = fill_shards(mine.meta, sr) if sr is not None else None
            state = assemble(
                mine.meta, targets, self._index_path(have), matched, mine.pruned, filled
            )
        except BaseException as e:
            err = e
        agree(c, err)
        level = 4 if self._recovered_status == 2 and self._last_step is None else int(fti["level"])
        report = RecoveryReport(
            step=have,
            levels=[level] * meta.world_size,
            rewritten=[],
            seconds=time.perf_counter() - t0,
        )
        del t1
        return state, report

    # ------------------------------------------------------------------

    def close(self, *, finalize: bool = True) -> None:
        """``FTI_Finalize`` (collective). FTI then removes its checkpoints
        unless ``keep_last_ckpt = 1`` (which moves the last one to L4).
        ``finalize=False`` skips it, as a crash would, so that the next job
        restarts from the checkpoint (for tests)."""
        if self._closed:
            return
        self._closed = True
        if self._initialised and finalize and self._lib is not None:
            rc = self._lib.cdll.FTI_Finalize()
            if rc != FTI_SCES:
                raise FTIError(f"FTI_Finalize failed with {rc}")
            self._fti_comm.Free()  # FTI's communicators are gone with it
        self._fti_comm = None
        self._keep = []

    def __enter__(self) -> FTIBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
