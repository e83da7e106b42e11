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
SLAB = 4 << 20  # bytes a thread copies or reads at a time, at most
MIN_SLAB = 256 << 10  # ... and at least, where a group is cut finer to give every thread work
SPARE = 8  # bytes after the streams: the relayout kernel may read one word past a row
GAP = 64 << 10  # file bytes between staged streams read (and dropped) to join two reads


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _reads(jobs: list[tuple[int, np.ndarray]], slab: int = SLAB
           ) -> list[tuple[int, list[np.ndarray]]]:
    """File reads (offset, buffers filled one after another) of ``jobs`` (file offset,
    buffer): adjacent ones joined (bytes up to ``GAP`` between them read into a buffer
    that is dropped), each read at most about ``slab`` bytes."""
    reads: list[tuple[int, list[np.ndarray]]] = []
    end = size = -1
    junk = np.empty(GAP, np.uint8)
    for at, dst in sorted(jobs, key=lambda j: j[0]):
        for a in range(0, dst.size, slab):
            piece = dst[a : a + slab]
            if reads and 0 <= at + a - end <= GAP and size + piece.size <= slab:
                bufs = reads[-1][1]
                if at + a > end:
                    bufs.append(junk[: at + a - end])
                bufs.append(piece)
                size += at + a - end + piece.size
            else:
                reads.append((at + a, [piece]))
                size = piece.size
            end = at + a + piece.size
    return reads


def _slab(jobs: list[tuple[np.ndarray, np.ndarray]], files: list[tuple[int, np.ndarray]],
          threads: int) -> int:
    """The bytes a task copies or reads: about an equal share of the group for each
    thread (a group of a few slabs would leave most threads idle), between ``MIN_SLAB``
    (a task's hand-off costs more than reading less) and ``SLAB``."""
    total = sum(s.size for s, _ in jobs) + sum(d.size for _, d in files)
    return max(MIN_SLAB, min(SLAB, -(-total // max(threads, 1))))


class Filler:
    """Threads that fill staging buffers, started once and kept for every group of a
    load (a context manager that stops them): a group's fill hands each thread its
    share of reads and copies and waits for them, where threads started per group would
    cost a start and a join each, every one a hand-off of the GIL, which the planning
    thread and the caller's other threads hold much of the time. The calling thread
    does the first share itself."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._inbox: list[queue.SimpleQueue] = []  # per started thread: its shares
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (share, failure or None)
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> Filler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads (after the share each is running)."""
        for inbox in self._inbox:
            inbox.put(None)
        for t in self._workers:
            t.join()
        self._inbox.clear()
        self._workers.clear()

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while (share := inbox.get()) is not None:
            tasks, k, n = share
            self._done.put((k, _do_share(tasks, k, n)))

    def run(self, tasks: list) -> None:
        """Every task (``_do``'s) on up to ``threads`` threads: task i on share i mod n,
        each share in order; the first failing task's error raised, as one thread would
        raise it (each share stops at its first failure, and the lowest of those is the
        first of all)."""
        n = min(self.threads, len(tasks))
        while len(self._workers) < n - 1:
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._serve, args=(inbox,), daemon=True,
                                 name=f"entropykit-fill-{len(self._workers)}")
            self._inbox.append(inbox)
            self._workers.append(t)
            t.start()
        for k in range(1, n):
            self._inbox[k - 1].put((tasks, k, n))
        failed = [_do_share(tasks, 0, max(n, 1))]
        failed += [self._done.get()[1] for _ in range(n - 1)]
        failures = [f for f in failed if f is not None]
        if failures:
            raise min(failures, key=lambda f: f[0])[1]


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


def _copy_all(jobs: list[tuple[np.ndarray, np.ndarray]], files: list[tuple[int, np.ndarray]],
              src: Bytes | None, threads: int | Filler) -> None:
    """``dst[:] = src`` for every job, large ones cut into slabs, and the file reads of
    ``files`` (file offset, buffer) from ``src``, on ``threads`` threads (a count: started
    for this call; or a ``Filler``'s; numpy and ``preadv`` release the GIL)."""
    filler = threads if isinstance(threads, Filler) else None
    slab = _slab(jobs, files, filler.threads if filler is not None else threads)
    tasks: list[Task] = []
    for s, dst in jobs:
        for a in range(0, s.size, slab):
            tasks.append((s[a : a + slab], dst[a : a + slab]))
    if files:
        if src is None:
            raise ValueError("streams staged from the file need its bytes")
        tasks += [(at, bufs, src) for at, bufs in _reads(files, slab)]
    if filler is not None:
        filler.run(tasks)
        return
    with Filler(threads) as own:
        own.run(tasks)


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
             threads: int | Filler, src: Bytes | None = None) -> None:
        """Write the group into ``host`` (>= ``size`` bytes); ``descs[k]``: batch k's
        descriptors with its outputs bound (``rans.cuda._runtime.bound_desc``); ``threads``:
        a count, or the ``Filler`` of a load; ``src``: the file, for the streams staged
        from it."""
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
        _copy_all(jobs, files, src, threads)
