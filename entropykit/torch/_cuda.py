"""The CUDA backend of resident mode: coded weights on the device, decodes as bound launches.

What it is: ``CudaDecoder``, a block's coded tensors uploaded once (``rans.cuda``'s
planner and ``DeviceBatch``: payload, decode tables, descriptors) with one bound launch
per kernel mode and scratch buffer, fixed at compress time, so a decode only enqueues
kernels on torch's current stream: no allocation, no copy, no host synchronisation, and
it can be captured in a CUDA graph. ``CudaStreams`` orders decodes with the forward: a
prefetch runs on a side stream (one of ``ahead``, in turn) after an event recorded on
the compute stream, and the compute stream waits for its own event before the block runs.
``GatherDecoder`` is an embedding whose lookup decodes only the chunks holding the rows
it reads: its chunks' descriptor pairs are kept compact in chunk order on the device,
torch ops expand the pairs of the chunks asked for into a descriptor buffer of its own (each
writing its slot of the region), and the decoder runs over that buffer's first pairs,
their count fixed by the input's shape: no host synchronisation, capturable.
What it is not: the coding (``_coded.py``) or the hooks (``_resident.py``). Imported only
for a model on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..rans import cuda as rans_cuda
from ..rans.cuda._layout import D_N, D_OUT, N_COLS
from ..rans.cuda.plan import Batch, Place, Planner, Stream
from ._coded import CodedTensor


def _streams(c: CodedTensor, k: int) -> list[Stream]:
    return [Stream.frame(f.data, f"tensor {k} {f.name}") if f.coded
            else Stream.plain(f.data, f"tensor {k} {f.name}") for f in c.fields]


def plan(coded: Sequence[CodedTensor]) -> list[tuple[list[CodedTensor], Batch]]:
    """The launches of ``coded`` (host side): the bf16 tensors' batch, then the others'."""
    out = []
    for bf16 in (True, False):
        group = [c for c in coded if c.pair == bf16]
        if not group:
            continue
        p = Planner(bf16)
        for k, c in enumerate(group):
            s = _streams(c, k)
            if bf16:
                p.add_pair(s[0], s[1], Place(k))
            else:
                for f, st in zip(c.fields, s, strict=True):
                    p.add(st, Place(k, f.byte, c.itemsize))
        out.append((group, p.finish([c.nbytes // (2 if bf16 else 1) for c in group])))
    return out


# Descriptor columns that vary from chunk to chunk (the first four: payload offset and
# length, output place, symbols); the others are shared by the chunks of a stream.
_VARY = 4


def compact(desc: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A bound descriptor array (int64[2 n, N_COLS]) kept small: the distinct pairs of
    shared columns (int64[k, 2, N_COLS], varying columns zero), each pair's index into
    them (int32[n]) and its varying columns (int32[n, 2, 4], int64 where a value does not
    fit)."""
    pairs = desc.reshape(-1, 2, N_COLS)
    shared = pairs.copy()
    shared[:, :, :_VARY] = 0
    kinds, index = np.unique(shared.reshape(len(pairs), -1), axis=0, return_inverse=True)
    vary = np.ascontiguousarray(pairs[:, :, :_VARY])
    small = vary.size == 0 or (vary.min() >= -(1 << 31) and vary.max() < 1 << 31)
    return (kinds.reshape(-1, 2, N_COLS), index.reshape(-1).astype(np.int32),
            vary.astype(np.int32) if small else vary)


def _compact_bytes(desc: np.ndarray) -> int:
    return sum(a.nbytes for a in compact(desc))


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tables(db: object) -> list[torch.Tensor]:
    """A device batch's buffers its launches read besides descriptors: payload, decode
    tables, context maps, statuses."""
    return [db.payload, db.sym_tables, db.info_tables, db.cmaps, db.status]


def planned_bytes(coded: Sequence[CodedTensor]) -> int:
    """Device bytes ``CudaDecoder(coded, ...)`` holds, computed on the host: payload,
    decode tables, context maps, statuses and compact descriptors of each launch (the
    descriptor rows a launch reads are expanded into a buffer of its stream's)."""
    return sum(b.payload_size + b.sym_tables.nbytes + b.info_tables.nbytes + b.cmaps.nbytes
               + 4 * max(1, len(b.desc)) + _compact_bytes(b.desc) for _, b in plan(coded))


class CudaDecoder:
    """Coded tensors on one CUDA device, decoding into ``region`` (uint8) in one launch
    per kernel mode. Each launch's descriptors stay compact on the device (``compact``):
    a run expands them into ``rows`` (a stream's buffer, ``CudaStreams.rows``; its own
    when not given) with two torch ops, then launches the decoder over them."""

    reads_fields = False  # uploaded at construction; the host copies may go

    def __init__(self, coded: Sequence[CodedTensor], region: torch.Tensor,
                 device: torch.device) -> None:
        rt = rans_cuda.load_runtime(device)
        self.device = device
        self.held: list[torch.Tensor] = []  # every device buffer the launches read
        self._checks = []  # (origins, status) of each batch, for check()
        self._batches = []  # (DeviceBatch, kinds, index, vary, output base) of each launch
        self._bound: dict[int, tuple[int, list]] = {}  # per rows buffer: its launches
        self._own: torch.Tensor | None = None
        up = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        for group, batch in plan(coded):
            db = rt.DeviceBatch(batch, device)
            outs = [self._out(c, region, batch.bf16) for c in group]
            rans_cuda.check_outputs(batch, outs)
            desc, base = rans_cuda.bound_desc(batch, outs)
            kinds, index, vary = (up(a) for a in compact(desc))
            self.held += [*_tables(db), kinds, index, vary]
            self._checks.append((batch.origins, db.status[: len(batch.desc)]))
            self._batches.append((db, kinds, index, vary,
                                  db.status if base is None else base))
        self.pairs = max([len(i) for _, _, i, _, _ in self._batches] + [0])

    @staticmethod
    def _out(c: CodedTensor, region: torch.Tensor, bf16: bool) -> torch.Tensor:
        return c.view(region).reshape(-1) if bf16 else c.bytes_in(region)

    @property
    def launches(self) -> list:
        """One launch per kernel mode (bf16, bytes)."""
        return self._batches

    @property
    def nbytes(self) -> int:
        return _bytes(self.held)

    def run(self, rows: torch.Tensor | None = None) -> None:
        """Enqueue the decode on the current stream, its descriptors expanded into
        ``rows`` (int64, at least ``self.pairs`` x 2 x N_COLS) first."""
        if rows is None:
            if self._own is None:
                self._own = torch.empty((max(1, self.pairs), 2, N_COLS), dtype=torch.int64,
                                        device=self.device)
            rows = self._own
        key = "own" if rows is self._own else id(rows)
        if self._bound.get(key, (None,))[0] is not rows:
            self._bound[key] = (rows, [db.bind_rows(rows, db.status, out, len(index))
                                       for db, _, index, _, out in self._batches])
        for (_, kinds, index, vary, _), launch in zip(self._batches, self._bound[key][1],
                                                      strict=True):
            n = len(index)
            torch.index_select(kinds, 0, index, out=rows[:n])
            rows[:n, :, :_VARY].copy_(vary)
            launch()

    def release(self) -> None:
        """Free the descriptor buffer of runs without one given (after a check run)."""
        self._bound.pop("own", None)
        self._own = None

    def check(self) -> None:
        """Raise ``CorruptDataError`` if a decode met corrupt data (synchronizes)."""
        for origins, status in self._checks:
            err = origins.error(status.cpu().numpy())
            if err is not None:
                raise err


def chunk_pairs(batch: Batch, chunk: int) -> np.ndarray:
    """A one-tensor bf16 batch's descriptor pairs in chunk order (int64[chunks, 2,
    N_COLS]): the pair decoding symbols [k * chunk, (k + 1) * chunk) is row k."""
    pairs = batch.desc.reshape(-1, 2, N_COLS)
    live = pairs[pairs[:, 0, D_N] > 0]
    table = np.zeros((-(-batch.sizes[0] // chunk), 2, N_COLS), np.int64)
    k = live[:, 0, D_OUT] // chunk
    if len(k) != len(table) or not np.array_equal(np.sort(k), np.arange(len(table))):
        # both fields kept plain: the planner cuts them in its own chunks
        raise ValueError(f"entropykit: the tensor's chunks are not of {chunk} symbols")
    table[k] = live
    return table


class GatherDecoder:
    """A bf16 tensor coded in chunks of ``chunk`` symbols on one CUDA device, decoding
    any ``slots`` of its chunks, chunk list by chunk list, into ``region`` (slot i at
    symbol ``i * chunk``): ``want(chunks)`` (a device tensor of chunk indices) then
    ``run()``."""

    reads_fields = False

    def __init__(self, coded: CodedTensor, chunk: int, slots: int, region: torch.Tensor,
                 device: torch.device) -> None:
        rt = rans_cuda.load_runtime(device)
        ((group, batch),) = plan([coded])
        db = rt.DeviceBatch(batch, device)
        self.device = device
        self.chunk = chunk
        up = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        # chunk k's pair: kinds[index[k]], its varying columns vary[k] (``compact``)
        self.kinds, self.index, self.vary = (up(a) for a in compact(
            chunk_pairs(batch, chunk).reshape(-1, N_COLS)))
        self.kind = torch.zeros(slots, dtype=torch.int32, device=device)
        self.desc = torch.zeros((slots, 2, N_COLS), dtype=torch.int64, device=device)
        self.status = torch.zeros(2 * slots, dtype=torch.int32, device=device)
        self.starts = torch.arange(slots, dtype=torch.int64, device=device) * chunk
        self.out = region[: slots * chunk * 2].view(torch.bfloat16)
        self.held = [*_tables(db), self.kinds, self.index, self.vary, self.kind, self.desc,
                     self.status, self.starts]
        self._db, self._batch = db, batch
        self._launches: dict[int, object] = {}
        self.count = 0  # chunks the next run decodes

    @property
    def nbytes(self) -> int:
        return _bytes(self.held)

    def want(self, chunks: torch.Tensor) -> None:
        """Make the next run decode ``chunks`` (int64, on the device; at most ``slots``),
        chunk ``chunks[i]`` into slot i: descriptor pairs gathered on the device."""
        n = chunks.numel()
        torch.index_select(self.index, 0, chunks, out=self.kind[:n])
        torch.index_select(self.kinds, 0, self.kind[:n], out=self.desc[:n])
        self.desc[:n, :, :_VARY] = self.vary.index_select(0, chunks)
        self.desc[:n, :, D_OUT] = self.starts[:n, None]
        self.count = n

    def run(self) -> None:
        """Enqueue the decode of the chunks last wanted on the current stream."""
        n = self.count
        if n not in self._launches:
            self._launches[n] = self._db.bind_rows(self.desc, self.status, self.out, n)
        self._launches[n]()

    def check(self) -> None:
        """Raise ``CorruptDataError`` if the last run met corrupt data (synchronizes)."""
        status = self.status[: 2 * self.count].cpu().numpy()
        bad = np.flatnonzero(status)
        if bad.size:
            row = self.desc[: self.count].reshape(-1, N_COLS)[int(bad[0])].cpu().numpy()
            same = np.arange(N_COLS) != D_OUT  # the batch's row, but for its output
            at = np.flatnonzero((self._batch.desc[:, same] == row[same]).all(axis=1))
            full = np.zeros(len(self._batch.desc), np.int32)
            full[at[:1]] = status[bad[0]]
            err = self._batch.error(full)
            if err is not None:
                raise err


class CudaStreams:
    """Decodes ordered with the compute stream: now, or prefetched on one of ``sides``
    side streams, taken in turn, so that up to ``sides`` prefetched decodes (each into a
    place apart from the others') run at once, more warps than one small decode fills."""

    def __init__(self, device: torch.device, units: int, sides: int = 1) -> None:
        self.device = device
        self.sides = [torch.cuda.Stream(device) for _ in range(sides)]
        self.turn = 0
        self.free = [torch.cuda.Event() for _ in range(units)]
        self._rows: list[torch.Tensor] = []
        self.ready = [torch.cuda.Event() for _ in range(units)]

    def rows(self, role: int) -> torch.Tensor | None:
        """The descriptor buffer of the compute stream (role 0) or side stream ``role - 1``:
        decodes on one stream run one after another, so they share it."""
        return self._rows[role] if self._rows else None

    def reserve(self, pairs: int) -> None:
        """Descriptor buffers for launches of up to ``pairs`` pairs, one a stream."""
        if self._rows and len(self._rows[0]) >= pairs:
            return
        self._rows = [torch.empty((max(1, pairs), 2, N_COLS), dtype=torch.int64,
                                  device=self.device) for _ in range(len(self.sides) + 1)]

    @property
    def nbytes(self) -> int:
        return _bytes(self._rows)

    def _run(self, decoder: object, role: int) -> None:
        if isinstance(decoder, CudaDecoder):
            self.reserve(decoder.pairs)
            decoder.run(self.rows(role))
        else:
            decoder.run()

    def now(self, decoder: CudaDecoder) -> None:
        with torch.cuda.device(self.device):
            self._run(decoder, 0)

    def prefetch(self, u: int, decoder: CudaDecoder) -> None:
        # The side stream starts once the compute stream has done everything enqueued so
        # far: every block before the one about to run, which may share unit u's place.
        role = self.turn + 1
        side = self.sides[self.turn]
        self.turn = (self.turn + 1) % len(self.sides)
        with torch.cuda.device(self.device):
            self.free[u].record(torch.cuda.current_stream(self.device))
            side.wait_event(self.free[u])
            with torch.cuda.stream(side):
                self._run(decoder, role)
            self.ready[u].record(side)

    def join(self, u: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[u])

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
