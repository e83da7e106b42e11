"""Where a group's bytes go on their way to the GPU: the staging layout, and filling it.

What it is: ``Staging``, computed from a ``fileplan.Group`` with numpy alone (so the CPU
tests check it): the pinned host buffer (mirrored byte for byte on the device) holds every
stream's bytes as the file or the host decoder holds them, back to back, then per batch
its tables and descriptors, then the relayout rows that ``_relayout.cu`` follows to move
each chunk payload into the batch's 16-byte aligned payload layout (``rans.cuda.plan``'s) in a
second device buffer. Copying whole streams, not chunks, keeps the host's part to a few
large memory copies, run on threads.
What it is not: the device side (``load.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...coding import parallel
from . import fileplan

ALIGN = 256  # section alignment (the kernels read tables as u32, descriptors as i64)
SLAB = 4 << 20  # bytes a thread copies at a time
SPARE = 8  # bytes after the streams: the relayout kernel may read one word past a row


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _copy_all(jobs: list[tuple[np.ndarray, np.ndarray]], threads: int) -> None:
    """``dst[:] = src`` for every job, large ones cut into slabs, on ``threads`` threads
    (numpy releases the GIL for large copies)."""
    slabs = []
    for src, dst in jobs:
        for a in range(0, src.size, SLAB):
            slabs.append((src[a : a + SLAB], dst[a : a + SLAB]))
    if threads <= 1 or len(slabs) <= 1:
        for src, dst in slabs:
            dst[:] = src
        return

    def run(k: int) -> None:
        for src, dst in slabs[k::threads]:  # round robin: sizes mix evenly
            dst[:] = src

    parallel.run(run, threads, threads)


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

    @staticmethod
    def of(group: fileplan.Group) -> Staging:
        pos, pay, streams, sections, moves = 0, 0, [], [], []
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
            sections.append(sec)
        rows = np.concatenate(moves) if moves else np.zeros((0, 3), np.int64)
        moves_at = _up(pos)
        size = max(moves_at + rows.nbytes, ALIGN)
        return Staging(size, max(pay, ALIGN), tuple(streams), tuple(sections), rows,
                       moves_at)

    def fill(self, group: fileplan.Group, host: np.ndarray, descs: list[np.ndarray],
             threads: int) -> None:
        """Write the group into ``host`` (>= ``size`` bytes); ``descs[k]``: batch k's
        descriptors with its outputs bound (``rans.cuda._runtime.bound_desc``)."""
        jobs = []
        for part, at, sec, desc in zip(group.parts, self.streams, self.sections, descs,
                                       strict=True):
            b = part.batch
            for st, a in zip(b.streams, at.tolist(), strict=True):
                jobs.append((st.data, host[a : a + st.data.size]))
            for name, arr in (("sym", b.sym_tables), ("info", b.info_tables),
                              ("cmaps", b.cmaps), ("desc", desc)):
                host[sec[name] : sec[name] + arr.nbytes] = arr.reshape(-1).view(np.uint8)
        host[self.moves_at : self.moves_at + self.moves.nbytes] = (
            self.moves.reshape(-1).view(np.uint8))
        _copy_all(jobs, threads)
