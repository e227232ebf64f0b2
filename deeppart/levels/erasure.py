"""L3 of the built-in level engine: Reed-Solomon over a group, in stripes.

The group's ``g`` data files are coded with ``k = m = g``: each member
stores one parity shard (``parity-RRRRR.bin``); any ``g`` of the group's
``2 * g`` files restore the rest. The files are coded ``stripe`` bytes of
each member at a time; stripe ``first + j`` of a round is coded by member
j, which gathers the members' chunks of it and scatters the parity shards
back (all-to-all inside the group, :func:`exchange`). Memory per rank: its
own file plus about ``3 * g * stripe`` bytes.

In the save order (:meth:`deeppart.levels.engine.BuiltinBackend.save`)
:func:`encode` runs after the L1 write and before the files are renamed and
the step is committed; recovery (:mod:`deeppart.levels.recovery`) calls
:func:`decode` for a group that lost files, and :func:`encode` again to
restore lost parity shards.

Every function here is collective over the group: a rank whose read, write
or coding fails still takes its part in every exchange (so the group does
not hang) and raises, or returns zeros that fail their checksums, after
the last one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from deeppart._planner import DeepPartError, rs_encode, rs_reconstruct
from deeppart.comm import Comm
from deeppart.format import data_file_name, fsync_dir
from deeppart.levels import files
from deeppart.levels.files import EMPTY, U8, Writer
from deeppart.levels.layout import parity_file

#: Default Reed-Solomon stripe: bytes of each member's file coded at once.
STRIPE_BYTES = 16 << 20


def exchange(comm: Comm, group: list[int], out: list[U8], in_lengths: list[int]) -> list[U8]:
    """All-to-all inside ``group``: ``out[j]`` goes to member j; returns
    what every member sent this one (``in_lengths[j]`` bytes from j),
    in ``g - 1`` ring-safe shifts."""
    g = len(group)
    me = group.index(comm.rank)
    got: list[U8] = [EMPTY] * g
    got[me] = out[me]
    for d in range(1, g):
        dest, src = (me + d) % g, (me - d) % g
        recv = np.empty(in_lengths[src], dtype=np.uint8)
        comm.sendrecv_u8(np.ascontiguousarray(out[dest]), group[dest], recv, group[src])
        got[src] = recv
    return got


def chunk_len(size: int, t: int, stripe: int) -> int:
    """Bytes of a ``size``-byte file in stripe ``t``."""
    return max(0, min(size - t * stripe, stripe))


def shard_len(lengths: Sequence[int]) -> int:
    """Bytes of a parity shard over chunks of ``lengths`` (even)."""
    m = max(lengths, default=0)
    return m + (m % 2)


def encode(
    comm: Comm,
    group: list[int],
    local: Path,
    own: Path,
    sizes: list[int],
    stripe: int,
    renames: list[tuple[Path, Path]],
    phases: dict[str, float],
    *,
    data: U8 | None = None,
) -> tuple[int, int]:
    """Codes the group's parity (collective over ``group``) into this
    rank's temporary parity file in ``local``, appended to ``renames``
    (temporary, final); returns its size and xxh3. ``sizes``: every rank's
    data file size; ``data``: this rank's file already in memory (else read
    from ``own``). Records the coding CPU seconds as
    ``phases["l3_encode_cpu"]``."""
    import xxhash

    rank = comm.rank
    g = len(group)
    me = group.index(rank)
    gsizes = [sizes[r] for r in group]
    nstripes = -(-max(gsizes) // stripe)
    # A failure here must not stop this rank's part of the exchanges
    # (the group would hang): it is raised after the last one.
    read_err: OSError | None = None
    if data is None:
        data, read_err = files.read_own(own, gsizes[me])
    err: BaseException | None = read_err
    tmp = local / (parity_file(rank) + ".tmp")
    h = xxhash.xxh3_64()
    written = 0
    coding = 0.0
    with Writer(tmp) as f:
        for first in range(0, nstripes, g):
            # Stripe first + j is coded by member j.
            out = [
                data[(first + j) * stripe : (first + j) * stripe + stripe]
                if first + j < nstripes
                else EMPTY
                for j in range(g)
            ]
            t_mine = first + me
            lens = [chunk_len(s, t_mine, stripe) for s in gsizes]
            chunks = exchange(comm, group, out, lens if t_mine < nstripes else [0] * g)
            parity: list[U8] = [EMPTY] * g
            if t_mine < nstripes:
                t = time.thread_time()  # the coder runs on this thread
                try:
                    coded = rs_encode([x.data for x in chunks], g)
                    parity = [np.frombuffer(p, dtype=np.uint8) for p in coded]
                except BaseException as e:  # an interruption too: raised after the exchanges
                    err = err or e
                    parity = [np.zeros(shard_len(lens), dtype=np.uint8)] * g
                coding += time.thread_time() - t
            # My parity shard of stripe first + j comes from member j.
            plens = [
                shard_len([chunk_len(s, first + j, stripe) for s in gsizes])
                if first + j < nstripes
                else 0
                for j in range(g)
            ]
            mine = exchange(comm, group, parity, plens)
            for j in range(g):
                if plens[j]:
                    f.write(mine[j])
                    h.update(mine[j].data)
                    written += plens[j]
    if err is not None:
        raise err
    if f.err is not None:
        raise f.err
    renames.append((tmp, local / parity_file(rank)))
    phases["l3_encode_cpu"] = coding
    return written, int(h.intdigest())


def decode(
    comm: Comm,
    group: list[int],
    file_sizes: list[int],
    stripe: int,
    own: U8 | None,
    parity: U8 | None,
    alive: list[bool],
    parity_alive: list[bool],
    lost: list[bool],
) -> tuple[U8 | None, float, int]:
    """Restores the lost members' files of ``group`` (collective over
    the group). ``file_sizes``: every rank's data file size; ``stripe``:
    the step's; ``own``/``parity``: this rank's data file and parity shard
    (None if lost); ``alive``, ``parity_alive``, ``lost``: per member of
    the group. Returns this rank's file if it was lost (else None), the CPU
    seconds spent decoding and the bytes of data decoded."""
    g = len(group)
    me = group.index(comm.rank)
    gsizes = [file_sizes[r] for r in group]
    nstripes = -(-max(gsizes) // stripe)
    result = np.empty(gsizes[me], dtype=np.uint8) if lost[me] else None
    seconds = 0.0
    decoded = 0
    poff = 0  # offset of the current stripe's shard in my parity file
    for first in range(0, nstripes, g):
        out: list[U8] = []
        for j in range(g):
            t = first + j
            if t >= nstripes:
                out.append(EMPTY)
                continue
            lens = [chunk_len(s, t, stripe) for s in gsizes]
            slen = shard_len(lens)
            parts: list[U8] = []
            if alive[me] and own is not None:
                parts.append(own[t * stripe : t * stripe + lens[me]])
            if parity_alive[me] and parity is not None:
                parts.append(parity[poff : poff + slen])
            poff += slen
            out.append(np.concatenate(parts) if parts else EMPTY)
        t_mine = first + me
        lens_mine = [chunk_len(s, t_mine, stripe) for s in gsizes]
        slen_mine = shard_len(lens_mine)
        in_lengths = [
            (lens_mine[j] if alive[j] else 0) + (slen_mine if parity_alive[j] else 0)
            if t_mine < nstripes
            else 0
            for j in range(g)
        ]
        got = exchange(comm, group, out, in_lengths)
        restored_out: list[U8] = [EMPTY] * g
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
            seconds += time.thread_time() - t0
            decoded += sum(lens_mine)
            for j in range(g):
                if lost[j]:
                    restored_out[j] = np.frombuffer(restored[j], dtype=np.uint8)
        back_lengths = [
            chunk_len(gsizes[me], first + j, stripe) if lost[me] and first + j < nstripes else 0
            for j in range(g)
        ]
        back = exchange(comm, group, restored_out, back_lengths)
        if result is not None:
            for j in range(g):
                t = first + j
                if back_lengths[j]:
                    result[t * stripe : t * stripe + back_lengths[j]] = back[j]
    return result, seconds, decoded


def restore_parity(
    comm: Comm,
    group: list[int],
    local: Path,
    own: U8,
    file_sizes: list[int],
    stripe: int,
    *,
    have: bool,
    expected: tuple[int, int],
) -> list[str]:
    """After recovery: codes the group's parity again from the members'
    verified files (``own``: this rank's) and keeps this rank's shard when
    it had lost it (not ``have``) and the new shard matches the step's
    size and xxh3 (``expected``). Returns the path written, if any; a
    failure leaves the shard missing. Collective over ``group``."""
    done: list[str] = []
    renames: list[tuple[Path, Path]] = []
    with contextlib.suppress(OSError):
        local.mkdir(parents=True, exist_ok=True)
    try:
        size, xxh = encode(
            comm, group, local, local / data_file_name(comm.rank), file_sizes, stripe, renames, {},
            data=own,
        )  # fmt: skip
    except Exception:
        size, xxh = -1, -1  # the group's exchanges finished; this shard stays lost
    for tmp, final in renames:
        try:
            if have or (size, xxh) != expected:
                tmp.unlink(missing_ok=True)
            else:
                tmp.replace(final)
                fsync_dir(local)
                done.append(str(final))
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # e.g. ``final`` is a directory
    return done


def decode_whole(
    sizes: Sequence[int],
    stripe: int,
    data: dict[int, U8],
    parity: dict[int, U8],
) -> tuple[dict[int, U8], float]:
    """Restores, in one process, the data files of a group's members that
    ``data`` lacks, from at least ``len(sizes)`` of the group's files:
    ``data`` and ``parity`` by member index, ``sizes`` every member's data
    file size, ``stripe`` the step's (the parity shards as :func:`encode`
    wrote them: stripe by stripe, member ``j``'s shard of each). A
    recovery at another world size, where the members' ranks are gone
    (:mod:`deeppart.levels.peers`). Returns the restored files and the CPU
    seconds spent; raises :class:`~deeppart._planner.DeepPartError` if the
    shards cannot restore them."""
    g = len(sizes)
    nstripes = -(-max(sizes, default=0) // stripe)
    lost = [j for j in range(g) if j not in data]
    out = {j: np.empty(sizes[j], dtype=np.uint8) for j in lost}
    seconds = 0.0
    poff = 0
    for t in range(nstripes):
        lens = [chunk_len(s, t, stripe) for s in sizes]
        slen = shard_len(lens)
        originals = {j: d[t * stripe : t * stripe + lens[j]].data for j, d in data.items()}
        recovery = {j: p[poff : poff + slen].data for j, p in parity.items()}
        poff += slen
        t0 = time.thread_time()
        restored = rs_reconstruct(g, g, originals, recovery, lens)
        seconds += time.thread_time() - t0
        for j in lost:
            out[j][t * stripe : t * stripe + lens[j]] = np.frombuffer(restored[j], dtype=np.uint8)
    return out, seconds
