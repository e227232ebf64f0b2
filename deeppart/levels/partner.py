"""L2 of the built-in level engine: partner copies.

Each rank's data file is also stored by its partner (the same position on
the next node of its group, :meth:`~deeppart.levels.layout.Layout.partner`)
as ``partner-RRRRR.bin``, so the group survives the loss of one node. Every
exchange is a ring ``sendrecv`` inside the group: rank r sends to its
partner and receives from its predecessor.

In the save order (:meth:`deeppart.levels.engine.BuiltinBackend.save`)
:func:`send_copy` runs after the L1 write and before the files are renamed
and the step is committed. On restore (:mod:`deeppart.levels.recovery`)
:func:`hand_back` returns each copy to a rank that lost its own file, and
:func:`restore_copy` makes again the copies lost with a node.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from deeppart.comm import Comm
from deeppart.levels import files
from deeppart.levels.files import EMPTY, U8
from deeppart.levels.layout import Layout, partner_file

#: A paced copy's exchange unit (``l2_rate``): small, so that what it
#: queues on the link ahead of the training's collectives drains quickly
#: (64 KiB: 5 ms at 100 Mbit/s).
PACE_CHUNK = 64 << 10


def send_copy(
    comm: Comm,
    layout: Layout,
    local: Path,
    own: Path,
    sizes: list[int],
    renames: list[tuple[Path, Path]],
    rate: int = 0,
) -> None:
    """Sends this rank's just-written file ``own`` (``sizes[rank]`` bytes)
    to its partner and writes the copy it receives from its predecessor
    under a temporary name in ``local``, appended to ``renames`` (temporary,
    final); ``rate`` > 0: paced to that many bytes per second
    (:func:`paced_sendrecv`). Collective over the group; raises after the
    exchange if this rank's read or write failed."""
    r = comm.rank
    dest, source = layout.partner(r), layout.pred(r)
    data, err = files.read_own(own, sizes[r])
    recv = np.empty(sizes[source], dtype=np.uint8)
    # Always, or the partner hangs.
    if rate > 0:
        paced_sendrecv(comm, data, dest, recv, source, rate, max(sizes))
    else:
        comm.sendrecv_u8(data, dest, recv, source)
    if err is not None:
        raise err
    tmp = local / (partner_file(source) + ".tmp")
    files.write_file(tmp, [recv])
    renames.append((tmp, local / partner_file(source)))


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
