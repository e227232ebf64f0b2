"""L2 of the built-in level engine: partner copies.

Each rank's data file is also stored by its partner (the same position on
the next node of its group, :meth:`~deeppart.levels.layout.Layout.partner`)
as ``partner-RRRRR.bin``, so the group survives the loss of one node. Every
exchange is a ring ``sendrecv`` inside the group: rank r sends to its
partner and receives from its predecessor.

A copy is sent as a *delta* (config ``l2_delta = 1``) when the
partner still holds the copy of this rank's file of the step before (the
base): the partner offers that copy's size and xxh3, the rank compares
them with its own file of that step, and sends the XOR of the two files,
byte-shuffled and zstd-compressed (:func:`delta_encode`), whenever that is
smaller than the file. The partner rebuilds the file from its copy and
checks the file's xxh3 before it writes it. Training changes most bytes of
a state a little between two saves, so the high bytes of each value mostly
cancel: fewer bytes over a link the training's collectives share. With no
base (the first save; the base evicted: the memory tier keeps it beyond
``memory_keep`` only while the node has room, :func:`deeppart.levels.memory.evict`;
removed or damaged), the file goes compressed, or whole when that is not
smaller. Encoding costs the sender CPU (about 2 ms
per MB here, the partner 1 ms to decode) and reading both base files: it
pays where the link is slower than that, or shared with the training's
collectives, so it is off by default.

In the save order (:meth:`deeppart.levels.engine.BuiltinBackend.save`)
:func:`send_copy` runs after the L1 write and before the files are renamed
and the step is committed. On restore (:mod:`deeppart.levels.recovery`)
:func:`hand_back` returns each copy to a rank that lost its own file, and
:func:`restore_copy` makes again the copies lost with a node.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import numpy.typing as npt

from deeppart.comm import Comm
from deeppart.compression import compress, decompress_into
from deeppart.errors import CodecError, CorruptCheckpointError
from deeppart.format import checksum, data_file_name
from deeppart.levels import files
from deeppart.levels.files import EMPTY, U8
from deeppart.levels.layout import Layout, partner_file

#: A paced copy's exchange unit (``l2_rate``): small, so that what it
#: queues on the link ahead of the training's collectives drains quickly
#: (64 KiB: 5 ms at 100 Mbit/s).
PACE_CHUNK = 64 << 10


#: A delta's codec: the XOR of two files of fp32/bf16 values, byte-shuffled
#: by 4 (the planes of high bytes, mostly zero, compress well), then zstd.
DELTA_CODEC = "shuffle-zstd"
DELTA_ITEMSIZE = 4
#: What a copy's header says it carries: the file, its delta against the
#: base, or the file compressed as a delta against nothing.
WHOLE, DELTA, PACKED = 0, 1, 2


#: A delta is coded in slices of this many bytes of the file, each its own
#: frame: the coder's buffers stay this small whatever the file's size.
DELTA_SLICE = 16 << 20


def _slices(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + DELTA_SLICE, size)) for a in range(0, size, DELTA_SLICE)]


def delta_encode(new: U8, base: U8) -> bytes:
    """``new`` as the compressed XOR with ``base`` (the bytes of ``new``
    past ``base``'s end as they are), in :data:`DELTA_SLICE` slices: the
    frames' lengths (uint64 each), then the frames. :func:`delta_decode`
    inverts it."""
    frames: list[bytes] = []
    for start, stop in _slices(new.size):
        common = max(0, min(stop, base.size) - start)
        xor = np.empty(stop - start, dtype=np.uint8)
        np.bitwise_xor(new[start : start + common], base[start : start + common], out=xor[:common])
        xor[common:] = new[start + common : stop]
        frames.append(compress(DELTA_CODEC, xor.data, DELTA_ITEMSIZE))
    lengths = np.array([len(f) for f in frames], dtype=np.uint64)
    return lengths.tobytes() + b"".join(frames)


def delta_decode(payload: U8, base: U8, size: int) -> U8:
    """The ``size`` bytes that :func:`delta_encode` made ``payload`` of
    against ``base``. CodecError if its frames' lengths do not add up to
    the payload or a frame does not decode to its slice's length."""
    out = np.empty(size, dtype=np.uint8)
    slices = _slices(size)
    head = 8 * len(slices)
    if payload.size < head:
        raise CodecError(f"a delta of {payload.size} bytes is too short for {size} bytes")
    lengths = [int(x) for x in payload[:head].view(np.uint64)]
    if head + sum(lengths) != payload.size:
        raise CodecError(f"a delta's frames ({sum(lengths)} bytes) do not fill its payload")
    at = head
    for (start, stop), n in zip(slices, lengths, strict=True):
        decompress_into(DELTA_CODEC, payload[at : at + n].data, out[start:stop], DELTA_ITEMSIZE)
        at += n
        common = max(0, min(stop, base.size) - start)
        part = out[start : start + common]
        np.bitwise_xor(part, base[start : start + common], out=part)
    return out


def _read_base(path: Path | None) -> U8 | None:
    """A base file's bytes, or None when it is not there (removed, a
    directory, unreadable): the copy then goes whole."""
    if path is None:
        return None
    try:
        data: U8 = np.fromfile(path, dtype=np.uint8)
    except OSError:
        return None
    return data


def _encoded(
    data: U8, base: Path | None, offered: npt.NDArray[np.uint64], rank: int
) -> tuple[U8, int]:
    """This rank's file as it goes to its partner: a delta against its own
    base file when that matches the partner's ``offered`` copy, else
    compressed, or whole when neither is smaller."""
    mine = _read_base(None if base is None or not offered[0] else base / data_file_name(rank))
    same = (
        mine is not None and mine.size == int(offered[1]) and checksum(mine.data) == int(offered[2])
    )
    packed = delta_encode(data, mine if same and mine is not None else EMPTY)
    if len(packed) >= data.size:
        return data, WHOLE
    return np.frombuffer(packed, dtype=np.uint8), DELTA if same else PACKED


def _no_delta(rank: int, why: str, e: Exception) -> None:
    warnings.warn(
        f"deeppart levels: the partner copy of rank {rank}'s file goes whole, not as a "
        f"delta: {why} ({type(e).__name__}: {e})",
        stacklevel=3,
    )


def send_copy(
    comm: Comm,
    layout: Layout,
    local: Path,
    own: Path,
    sizes: list[int],
    renames: list[tuple[Path, Path]],
    rate: int = 0,
    delta: bool = False,
    base: Path | None = None,
) -> int:
    """Sends this rank's just-written file ``own`` (``sizes[rank]`` bytes)
    to its partner and writes the copy it receives from its predecessor
    under a temporary name in ``local``, appended to ``renames`` (temporary,
    final); ``rate`` > 0: paced to that many bytes per second
    (:func:`paced_sendrecv`). ``delta``: copies go as deltas against
    ``base``, the node-local directory of the last L2 step, where both
    sides still hold the same file of it, else compressed (see the
    module's text), whichever is smaller than the file. Returns the
    bytes this rank sent. Collective over the group; raises after the
    exchange if this rank's read or write failed, or if the copy it
    received does not rebuild to its file's checksum."""
    r = comm.rank
    dest, source = layout.partner(r), layout.pred(r)
    data, err = files.read_own(own, sizes[r])
    held: U8 | None = None
    offered = np.zeros(3, dtype=np.uint64)
    if delta:
        # The offer, backwards round the ring: the copy of the predecessor's
        # base this rank holds (present, size, xxh3). Every rank has the
        # same ``delta``, so either all make it or none.
        # A failure here only costs the delta: every rank still takes its
        # part in each exchange, or its partner would wait for it forever.
        offer = np.zeros(3, dtype=np.uint64)
        try:
            held = _read_base(None if base is None else base / partner_file(source))
            if held is not None:
                offer[:] = (1, held.size, checksum(held.data))
        except Exception as e:
            held = None
            _no_delta(source, "its base could not be read", e)
        comm.sendrecv_u8(offer.view(np.uint8), source, offered.view(np.uint8), dest)
    payload, kind = data, WHOLE
    if delta and err is None:
        try:
            payload, kind = _encoded(data, base, offered, r)
        except Exception as e:
            payload, kind = data, WHOLE
            _no_delta(r, "it could not be encoded", e)
    header = np.array([kind, payload.size, checksum(data.data)], dtype=np.uint64)
    got = np.zeros(3, dtype=np.uint64)
    comm.sendrecv_u8(header.view(np.uint8), dest, got.view(np.uint8), source)
    recv = np.empty(int(got[1]), dtype=np.uint8)
    # Always, or the partner hangs.
    if rate > 0:
        # Payloads are never longer than their files: the same count of
        # slices on every rank of the ring.
        paced_sendrecv(comm, payload, dest, recv, source, rate, max(sizes))
    else:
        comm.sendrecv_u8(payload, dest, recv, source)
    if err is not None:
        raise err
    copy, came = recv, int(got[0])
    if came == DELTA:
        if held is None:  # an offer was made only with a base held
            raise CorruptCheckpointError(f"rank {source}'s delta copy came with no base here")
        copy = delta_decode(recv, held, sizes[source])
    elif came == PACKED:
        copy = delta_decode(recv, EMPTY, sizes[source])
    if copy.size != sizes[source] or checksum(copy.data) != int(got[2]):
        how = {WHOLE: "whole", DELTA: "a delta", PACKED: "compressed"}.get(came, f"kind {came}")
        raise CorruptCheckpointError(
            f"the partner copy of rank {source}'s file does not match its checksum "
            f"({how}, {copy.size} bytes): not written"
        )
    tmp = local / (partner_file(source) + ".tmp")
    files.write_file(tmp, [copy])
    renames.append((tmp, local / partner_file(source)))
    return int(payload.size)


def paced_sendrecv(
    comm: Comm, send: U8, dest: int, recv: U8, source: int, rate: int, longest: int
) -> None:
    """:meth:`Comm.sendrecv_u8` of ``send`` and ``recv`` in
    :data:`PACE_CHUNK` slices (empty once a side is done), sleeping after
    each so that no more than ``rate`` bytes per second leave this rank.
    Every rank of the ring makes the same ``ceil(longest / PACE_CHUNK)``
    exchanges (``longest``: the largest file of any rank), so the
    exchanges always match."""
    t0 = time.perf_counter()
    for start in range(0, longest, PACE_CHUNK):
        stop = start + PACE_CHUNK
        out, into = send[start:stop], recv[start:stop]
        comm.sendrecv_u8(out if out.size else EMPTY, dest, into if into.size else EMPTY, source)
        ahead = min(stop, send.size) / rate - (time.perf_counter() - t0)
        if ahead > 0:
            time.sleep(ahead)


def hand_back(
    comm: Comm, layout: Layout, levels: list[int], copy: U8 | None, own_size: int
) -> U8 | None:
    """Recovery: every rank hands the copy it holds (``copy``) back to its
    source when the source's data is served from L2 (``levels[source] ==
    2``). Returns this rank's file (``own_size`` bytes) when it is served
    from L2, else None. Collective over the group ring."""
    r = comm.rank
    pred, succ = layout.pred(r), layout.partner(r)
    send = copy if levels[pred] == 2 else None
    recv = np.empty(own_size if levels[r] == 2 else 0, dtype=np.uint8)
    comm.sendrecv_u8(send if send is not None else EMPTY, pred, recv, succ)
    return recv if levels[r] == 2 else None


def restore_copy(
    comm: Comm,
    layout: Layout,
    local: Path,
    own: U8,
    need: list[bool],
    file_sizes: list[int],
) -> list[str]:
    """After recovery: sends this rank's verified file ``own`` to its
    partner when that partner lacks the copy (``need[partner]``), and
    writes the copy of its predecessor's file when it lacks it
    (``need[rank]``). Returns the path written, if any; a failed write
    leaves the copy missing. Collective over the group ring."""
    r = comm.rank
    done: list[str] = []
    dest, source = layout.partner(r), layout.pred(r)
    recv = np.empty(file_sizes[source] if need[r] else 0, dtype=np.uint8)
    comm.sendrecv_u8(own if need[dest] else EMPTY, dest, recv, source)
    if need[r]:
        path = local / partner_file(source)
        try:
            local.mkdir(parents=True, exist_ok=True)
            files.replace_file(path, [recv])
            done.append(str(path))
        except OSError:
            pass
    return done
