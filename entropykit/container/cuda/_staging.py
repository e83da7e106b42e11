"""Where a group's bytes go on their way to the GPU: the staging layout, and filling it.

What it is: ``Staging``, computed from a ``fileplan.Group`` with numpy alone (so the CPU
tests check it): the pinned host buffer (mirrored byte for byte on the device) holds every
stream's bytes as the file or the host decoder holds them, back to back, then per batch
its tables and descriptors, then the relayout rows that ``_relayout.cu`` follows to move
each chunk payload into the batch's 16-byte aligned payload layout (``rans.cuda.plan``'s) in a
second device buffer, then the rows of the CRCs the device checks (``_crc``). Streams
staged from the file are read straight into the buffer (adjacent ones in one ``preadv``),
the others copied whole from host memory: the host touches each byte once, on threads
(a ``Filler``'s, kept for every group of a load).
What it is not: the device side (``load.py``).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import numpy as np

from ..._errors import CorruptDataError
from ..source import Bytes
from . import _crc, fileplan

ALIGN = 256  # section alignment (the kernels read tables as u32, descriptors as i64)
# Bytes a task copies or reads, at most: a group's share for each thread is one task (each
# read is a hand-off of the GIL, which may wait for the other threads' Python).
SLAB = 64 << 20
MIN_SLAB = 256 << 10  # ... and at least, where a group is cut finer to give every thread work
SPARE = 8  # bytes after the streams: the relayout kernel may read one word past a row
GAP = 64 << 10  # file bytes between staged streams read (and dropped) to join two reads


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _reads(jobs: list[tuple[int, np.ndarray]], slab: int = SLAB
           ) -> list[tuple[int, list[np.ndarray]]]:
    """File reads (offset, buffers filled one after another) of ``jobs`` (file offset,
    buffer): adjacent ones joined (bytes up to ``GAP`` between them read into a buffer
    that is dropped), the file's bytes cut into reads of ``slab`` bytes but where jobs
    are further apart (a buffer may end one read and begin the next)."""
    reads: list[tuple[int, list[np.ndarray]]] = []
    end = size = -1
    junk = np.empty(GAP, np.uint8)
    for at, dst in sorted(jobs, key=lambda j: j[0]):
        a = 0
        while a < dst.size:
            gap = at + a - end
            if reads and 0 <= gap <= GAP and size + gap < slab:
                take = min(dst.size - a, slab - size - gap)
                bufs = reads[-1][1]
                if gap:
                    bufs.append(junk[:gap])
                bufs.append(dst[a : a + take])
                size += gap + take
            else:
                take = min(dst.size - a, slab)
                reads.append((at + a, [dst[a : a + take]]))
                size = take
            a += take
            end = at + a
    return reads


def _slab(jobs: list[tuple[np.ndarray, np.ndarray]], files: list[tuple[int, np.ndarray]],
          threads: int) -> int:
    """The bytes a task copies or reads: an equal share of the group for each thread,
    between ``MIN_SLAB`` (a task's hand-off costs more than reading less) and ``SLAB``."""
    total = sum(s.size for s, _ in jobs) + sum(d.size for _, d in files)
    return max(MIN_SLAB, min(SLAB, -(-total // max(threads, 1))))


class Filler:
    """Threads that fill staging buffers, started once and kept for every group of a
    load (a context manager that stops them): a group's fill hands each thread one share
    of reads and copies (``submit``) and is waited for once (``Fill.wait``), where
    threads started per group cost a start and a join each, every one a hand-off of the
    GIL, which the planning thread and the caller's other threads hold much of the
    time. Shares run in the order submitted, so the next group's fill may be submitted
    before the last one is waited for."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._inbox: list[queue.SimpleQueue] = []  # per started thread: its shares
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> Filler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads (after the shares submitted to them)."""
        for inbox in self._inbox:
            inbox.put(None)
        for t in self._workers:
            t.join()
        self._inbox.clear()
        self._workers.clear()

    @staticmethod
    def _serve(inbox: queue.SimpleQueue) -> None:
        while (share := inbox.get()) is not None:
            share[0].share(share[1])

    def submit(self, tasks: list[Task]) -> Fill:
        """Start every task (``_do``'s), task i in share i mod n of n = up to ``threads``
        threads' (one share: run here, now)."""
        fill = Fill(tasks, min(self.threads, len(tasks)))
        if fill.n <= 1:
            fill.share(0)
            return fill
        while len(self._workers) < fill.n:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                                 name=f"entropykit-fill-{len(self._workers)}")
            self._inbox.append(inbox)
            self._workers.append(t)
            t.start()
        for k in range(fill.n):
            self._inbox[k].put((fill, k))
        return fill

    def run(self, tasks: list[Task]) -> None:
        """``submit`` and wait."""
        self.submit(tasks).wait()


class Fill:
    """A submitted fill: ``n`` shares of ``tasks``, counted down as threads finish them."""

    def __init__(self, tasks: list[Task], n: int) -> None:
        self.tasks, self.n = tasks, max(n, 1)
        self._left = self.n
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failures: list[tuple[int, BaseException]] = []

    def share(self, k: int) -> None:
        failed = _do_share(self.tasks, k, self.n)
        with self._lock:
            if failed is not None:
                self._failures.append(failed)
            self._left -= 1
            if not self._left:
                self._done.set()  # the waiting thread is woken once, by the last share

    def wait(self) -> None:
        """Wait for every share; raise the first failing task's error, as one thread
        would raise it (each share stops at its first failure, and the lowest of those is
        the first of all)."""
        self._done.wait()
        if self._failures:
            raise min(self._failures, key=lambda f: f[0])[1]


Task = tuple[np.ndarray, np.ndarray] | tuple[int, list[np.ndarray], Bytes]


def _do(task: Task) -> None:
    """A copy (source array, destination) or a file read (offset, buffers, file)."""
    if len(task) == 2:
        a, b = task
        b[:] = a
    else:
        at, bufs, src = task
        src.readinto(at, bufs)


def _do_share(tasks: list[Task], k: int, n: int) -> tuple[int, BaseException] | None:
    """Tasks k, k + n, ... in order, up to the first that fails: (its index, its error)."""
    for i in range(k, len(tasks), n):
        try:
            _do(tasks[i])
        except BaseException as e:  # noqa: BLE001 -- raised by ``Filler.run``, in task order
            return i, e
    return None


def _tasks(jobs: list[tuple[np.ndarray, np.ndarray]], files: list[tuple[int, np.ndarray]],
           src: Bytes | None, threads: int) -> list[Task]:
    """The tasks of ``dst[:] = src`` for every job, large ones cut into slabs, and of the
    file reads of ``files`` (file offset, buffer) from ``src``, for ``threads`` threads
    (numpy and ``preadv`` release the GIL)."""
    slab = _slab(jobs, files, threads)
    tasks: list[Task] = []
    for s, dst in jobs:
        for a in range(0, s.size, slab):
            tasks.append((s[a : a + slab], dst[a : a + slab]))
    if files:
        if src is None:
            raise ValueError("streams staged from the file need its bytes")
        tasks += [(at, bufs, src) for at, bufs in _reads(files, slab)]
    return tasks


@dataclass(frozen=True)
class Staging:
    """Where a group's bytes go. Staged (host buffer = its device twin): every stream's
    bytes back to back (8-byte aligned), then per batch its tables and descriptors, last
    the relayout rows; ``payload``: the device buffer of the batches' aligned payloads."""

    size: int  # staged bytes
    payload: int  # bytes of the device payload buffer
    streams: tuple[np.ndarray, ...]  # per batch: staged offset of each of its streams
    sections: tuple[dict[str, int], ...]  # per batch: payload, sym, info, cmaps, desc
    moves: np.ndarray  # int64[k, 3]: staged offset, payload offset, length
    moves_at: int  # staged offset of ``moves``
    crcs: np.ndarray  # int64[k, 4]: staged offset, length, seed, wanted CRC (``_crc``)
    crcs_at: int  # staged offset of ``crcs``, then of their first pieces (``first``)
    first: np.ndarray  # int64[k + 1]: ``_crc.first_pieces`` of ``crcs``
    ranks: np.ndarray  # int64[k]: each check's rank (``fileplan.POSITION`` first)
    messages: tuple[str, ...]  # each check's error

    @staticmethod
    def of(group: fileplan.Group) -> Staging:
        pos, pay, streams, sections, moves, checks = 0, 0, [], [], [], []
        for part in group.parts:
            sizes = np.array([st.data.size for st in part.batch.streams], np.int64)
            padded = -(-sizes // 8) * 8
            streams.append(pos + np.cumsum(padded) - padded)
            pos += int(padded.sum())
        pos += SPARE
        for part, at in zip(group.parts, streams, strict=True):
            b = part.batch
            sec = {"payload": pay}
            pay += _up(b.payload_size)
            for name, arr in (("sym", b.sym_tables), ("info", b.info_tables),
                              ("cmaps", b.cmaps), ("desc", b.desc)):
                pos = _up(pos)
                sec[name] = pos
                pos += arr.nbytes
            cp = b.copies
            moves.append(np.stack([at[cp[:, 0]] + cp[:, 1], sec["payload"] + cp[:, 2],
                                   cp[:, 3]], axis=1))
            ch = part.checks
            checks.append(np.stack([at[ch[:, 0]] + ch[:, 1], ch[:, 2], ch[:, 3], ch[:, 4]],
                                   axis=1))
            sections.append(sec)
        rows = np.concatenate(moves) if moves else np.zeros((0, 3), np.int64)
        crcs = np.concatenate(checks) if checks else np.zeros((0, 4), np.int64)
        first = _crc.first_pieces(crcs[:, 1])
        moves_at = _up(pos)
        crcs_at = _up(moves_at + rows.nbytes)
        size = max(crcs_at + crcs.nbytes + first.nbytes, ALIGN)
        ranks = np.concatenate([p.checks[:, 5] for p in group.parts]) if group.parts \
            else np.zeros(0, np.int64)
        return Staging(size, max(pay, ALIGN), tuple(streams), tuple(sections), rows,
                       moves_at, crcs, crcs_at, first, ranks,
                       tuple(m for p in group.parts for m in p.messages))

    def crc_error(self, status: np.ndarray) -> tuple[int, CorruptDataError] | None:
        """(rank, error) of the first failing check of the lowest rank in the device's
        ``status`` of ``crcs`` (nonzero: failed), or None."""
        bad = np.flatnonzero(status)
        if bad.size == 0:
            return None
        k = int(bad[np.argmin(self.ranks[bad])])  # argmin: the first of the lowest rank
        return int(self.ranks[k]), CorruptDataError(self.messages[k])

    def fill(self, group: fileplan.Group, host: np.ndarray, descs: list[np.ndarray],
             threads: int | Filler, src: Bytes | None = None) -> Fill:
        """Write the group into ``host`` (>= ``size`` bytes); ``descs[k]``: batch k's
        descriptors with its outputs bound (``rans.cuda._runtime.bound_desc``); ``src``:
        the file, for the streams staged from it. ``threads``: a count (threads started
        for this fill, done on return), or a load's ``Filler``, whose threads read and
        copy the streams after this returns: until its ``wait()`` (which raises what
        they failed on)."""
        jobs, files = [], []
        for part, at, sec, desc in zip(group.parts, self.streams, self.sections, descs,
                                       strict=True):
            b = part.batch
            from_file = dict(part.files.tolist())
            for k, (st, a) in enumerate(zip(b.streams, at.tolist(), strict=True)):
                if k in from_file:
                    files.append((from_file[k], host[a : a + st.data.size]))
                else:
                    jobs.append((st.data, host[a : a + st.data.size]))
            for name, arr in (("sym", b.sym_tables), ("info", b.info_tables),
                              ("cmaps", b.cmaps), ("desc", desc)):
                host[sec[name] : sec[name] + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        for at, arr in ((self.moves_at, self.moves), (self.crcs_at, self.crcs),
                        (self.crcs_at + self.crcs.nbytes, self.first)):
            host[at : at + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        if isinstance(threads, Filler):
            return threads.submit(_tasks(jobs, files, src, threads.threads))
        with Filler(threads) as own:
            fill = own.submit(_tasks(jobs, files, src, threads))
            fill.wait()
        return fill
