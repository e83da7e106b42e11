"""The CUDA backend of resident mode: coded weights on the device, decodes as bound launches.

What it is: ``CudaDecoder``, a block's coded tensors uploaded once (``rans.cuda``'s
planner and ``DeviceBatch``: payload, decode tables, descriptors) with one bound launch
per kernel mode and scratch buffer, fixed at compress time, so a decode only enqueues
kernels (its compact descriptors' expansion, ``Expand``, then the decoder, each one
driver call with bound arguments) on a stream given by its handle: no allocation, no
copy, no host synchronisation, and it can be captured in a CUDA graph. ``CudaStreams``
orders decodes with the forward: a prefetch runs on a side stream (one of ``ahead``, in
turn) after an event recorded on the compute stream, and the compute stream waits for
its own event before the block runs. ``GatherDecoder`` is an embedding whose lookup
decodes only the chunks holding the rows it reads: its chunks' descriptor pairs are kept
compact in chunk order on the device, expanded for the chunks asked for into a
descriptor buffer of its own (each writing its slot of the region), and the decoder runs
over that buffer's first pairs, their count fixed by the input's shape: no host
synchronisation, capturable. A tied embedding's head decodes ranges of the same chunks
(``CudaDecoder.chunk_range``).
What it is not: the coding (``_coded.py``) or the hooks (``_resident.py``). Imported only
for a model on a CUDA device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np
import torch

from ..coding.frame import MODE_CODED
from ..rans import cuda as rans_cuda
from ..rans.cuda._layout import D_LEN, D_MODE, D_N, D_OUT, D_SYM, N_COLS
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


# One thread a descriptor cell: pair i of the launch is chunk c = chunks[i] (or first + i)
# of a compact table, its shared columns kinds[index[c]], its varying ones vary[c], and
# with chunk > 0 its output at symbol i * chunk (slot i). The emulation in
# tests/test_resident_gather.py follows this arithmetic.
_EXPAND_SOURCE = r"""
extern "C" __global__ void expand_pairs(
    long long* __restrict__ rows, const long long* __restrict__ kinds,
    const int* __restrict__ index, const void* __restrict__ vary, int wide,
    const long long* __restrict__ chunks, long long first, long long chunk, int n)
{
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (long long)n * 2 * N_COLS) return;
    int col = (int)(t % N_COLS);
    long long row = t / N_COLS;  /* pair * 2 + half */
    long long i = row >> 1;
    long long c = chunks ? chunks[i] : first + i;
    long long cell = c * 2 + (row & 1);
    long long v;
    if (chunk > 0 && col == D_OUT) {
        v = i * chunk;
    } else if (col < VARY) {
        v = wide ? ((const long long*)vary)[cell * VARY + col]
                 : (long long)((const int*)vary)[cell * VARY + col];
    } else {
        v = kinds[((long long)index[c] * 2 + (row & 1)) * N_COLS + col];
    }
    rows[t] = v;
}
"""
_EXPAND_THREADS = 256


def _expand_kernel() -> object:
    from .._cuda import nvrtc

    return nvrtc.kernel("expand_pairs", lambda: _EXPAND_SOURCE,
                        (f"-DN_COLS={N_COLS}", f"-DD_OUT={D_OUT}", f"-DVARY={_VARY}"))


class Expand:
    """Writes the first ``n`` descriptor pairs of ``rows`` from a compact table (``compact``:
    ``kinds``, ``index``, ``vary``): pair i is chunk ``chunks[i]`` (a device tensor read
    when the expansion runs) or ``first + i``, with its output at symbol ``i * chunk``
    where ``chunk`` is given (slot i), else its own. On a CUDA device one small kernel
    with its arguments bound; on the CPU (the kernel's emulation) torch ops."""

    def __init__(self, rows: torch.Tensor, kinds: torch.Tensor, index: torch.Tensor,
                 vary: torch.Tensor, n: int, chunks: torch.Tensor | None = None,
                 first: int = 0, chunk: int = 0) -> None:
        self.rows, self.kinds, self.index, self.vary = rows, kinds, index, vary
        self.n, self.chunks, self.first, self.chunk = n, chunks, first, chunk
        self.cuda = rows.device.type == "cuda"
        self._fn = None
        if self.cuda and n:
            from .._cuda import nvrtc

            self.device = rows.device
            self.grid = (-(-n * 2 * N_COLS // _EXPAND_THREADS),)
            self.block = (_EXPAND_THREADS,)
            self.args = nvrtc.args(rows, kinds, index, vary,
                                   np.int32(vary.dtype == torch.int64), chunks, first,
                                   chunk, np.int32(n))

    def __call__(self) -> None:
        """Expand on torch's current stream."""
        if not self.cuda:
            self.on(None)
            return
        import cupy as cp

        from .._cuda import nvrtc

        with cp.cuda.Device(self.device.index):
            self.on(nvrtc.stream())

    def on(self, stream: object) -> None:
        """Expand on ``stream`` (CuPy's view of a stream of the current device; the CPU's
        ignore it)."""
        n = self.n
        if not n:
            return
        if self.cuda:
            fn = self._fn
            if fn is None:
                fn = self._fn = _expand_kernel().kernel
            fn(self.grid, self.block, self.args, stream=stream)
            return
        sel = (self.chunks[:n] if self.chunks is not None
               else torch.arange(self.first, self.first + n))
        rows = self.rows[:n]
        torch.index_select(self.kinds, 0, self.index[sel], out=rows)
        rows[:, :, :_VARY] = self.vary[sel]
        if self.chunk:
            rows[:, :, D_OUT] = (torch.arange(n) * self.chunk)[:, None]


def _on(step: object, stream: object) -> None:
    """Run a bound launch or expansion on ``stream`` (None: torch's current stream, or the
    emulation's launches, which take none)."""
    if stream is None:
        step()
    else:
        step.on(stream)


def _compact_bytes(desc: np.ndarray) -> int:
    return sum(a.nbytes for a in compact(desc))


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tables(db: object) -> list[torch.Tensor]:
    """A device batch's buffers its launches read besides descriptors: payload, decode
    tables, context maps, statuses."""
    return [db.payload, db.sym_tables, db.info_tables, db.cmaps, db.status]


# Bytes of a coded chunk's start states (32 lanes of 32 bits: docs/format.md).
STATE_BYTES = 128
PARTS = ("payload", "states", "padding", "tables", "statuses", "descriptors")


def planned_parts(coded: Sequence[CodedTensor]) -> dict[str, int]:
    """``planned_bytes`` of ``coded`` by part: coded symbols and plain fields
    (``payload``), the coded chunks' start states, the payload's alignment and spare
    bytes (``padding``), decode tables and context maps, statuses, compact
    descriptors."""
    parts = dict.fromkeys(PARTS, 0)
    for _, b in plan(coded):
        live = b.desc[:, D_N] > 0
        size = int(b.desc[live, D_LEN].sum())
        coded = live & (b.desc[:, D_SYM] >= 0) & (b.desc[:, D_MODE] == MODE_CODED)
        states = STATE_BYTES * int(coded.sum())
        parts["payload"] += size - states
        parts["states"] += states
        parts["padding"] += b.payload_size - size
        parts["tables"] += b.sym_tables.nbytes + b.info_tables.nbytes + b.cmaps.nbytes
        parts["statuses"] += 4 * max(1, len(b.desc))
        parts["descriptors"] += _compact_bytes(b.desc)
    return parts


def planned_bytes(coded: Sequence[CodedTensor]) -> int:
    """Device bytes ``CudaDecoder(coded, ...)`` holds, computed on the host: payload,
    decode tables, context maps, statuses and compact descriptors of each launch (the
    descriptor rows a launch reads are expanded into a buffer of its stream's)."""
    return sum(planned_parts(coded).values())


class CudaDecoder:
    """Coded tensors on one CUDA device, decoding into ``region`` (uint8) in one launch
    per kernel mode. Each launch's descriptors stay compact on the device (``compact``):
    a run expands them into ``rows`` (a stream's buffer, ``CudaStreams.rows``; its own
    when not given) with one small kernel, then launches the decoder over them."""

    reads_fields = False  # uploaded at construction; the host copies may go

    def __init__(self, coded: Sequence[CodedTensor], region: torch.Tensor,
                 device: torch.device) -> None:
        rt = rans_cuda.load_runtime(device)
        self.device = device
        self.held: list[torch.Tensor] = []  # every device buffer the launches read
        self._checks = []  # per launch: what check() calls, the error or None
        self._batches = []  # (DeviceBatch, kinds, index, vary, output base) of each launch
        self._spans = []  # per launch: (first chunk, slot symbols, pairs) it expands
        self._statuses = []  # per launch: the status rows it writes
        self._bound: dict[int, tuple[torch.Tensor, list]] = {}  # per rows buffer: its steps
        self._own: torch.Tensor | None = None
        up = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
        for group, batch in plan(coded):
            db = rt.DeviceBatch(batch, device)
            outs = [self._out(c, region, batch.bf16) for c in group]
            rans_cuda.check_outputs(batch, outs)
            desc, base = rans_cuda.bound_desc(batch, outs)
            kinds, index, vary = (up(a) for a in compact(desc))
            self.held += [*_tables(db), kinds, index, vary]
            status = db.status[: len(batch.desc)]
            self._checks.append(lambda o=batch.origins, s=status: o.error(s.cpu().numpy()))
            self._batches.append((db, kinds, index, vary,
                                  db.status if base is None else base))
            self._spans.append((0, 0, len(index)))
            self._statuses.append(db.status)
        self.pairs = max([n for _, _, n in self._spans] + [0])

    @classmethod
    def chunk_range(cls, source: GatherDecoder, first: int, n: int, region: torch.Tensor
                    ) -> CudaDecoder:
        """Chunks ``[first, first + n)`` of ``source``'s tensor decoding into ``region``
        (chunk ``first + i`` at symbol ``i * chunk``), in one launch: ``source``'s coded
        bytes, tables and compact descriptors, so it holds no device buffer of its own
        (its statuses are the batch's rows of those chunks)."""
        self = cls.__new__(cls)
        self.device = source.device
        self.held = []
        self._bound, self._own = {}, None
        db = source._db
        status = db.status[2 * first : 2 * (first + n)]
        self._batches = [(db, source.kinds, source.index, source.vary,
                          region.view(torch.bfloat16))]
        self._spans = [(first, source.chunk, n)]
        self._statuses = [status]
        chunks = np.arange(first, first + n)
        self._checks = [lambda: source.error(chunks, status.cpu().numpy())]
        self.pairs = n
        return self

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

    def run(self, rows: torch.Tensor | None = None, stream: object = None) -> None:
        """Enqueue the decode on ``stream`` (CuPy's view of a stream of the current
        device; None: torch's current stream), its descriptors expanded into ``rows``
        (int64, at least ``self.pairs`` x 2 x N_COLS) first."""
        if rows is None:
            if self._own is None:
                self._own = torch.empty((max(1, self.pairs), 2, N_COLS), dtype=torch.int64,
                                        device=self.device)
            rows = self._own
        steps = self._bound.get(id(rows))
        if steps is None or steps[0] is not rows:
            steps = self._bound[id(rows)] = (rows, self._bind(rows))
        for step in steps[1]:
            _on(step, stream)

    def _bind(self, rows: torch.Tensor) -> list:
        """Each launch's expansion into ``rows`` and its decode over them, in order."""
        steps = []
        for (db, kinds, index, vary, out), (first, chunk, n), status in zip(
                self._batches, self._spans, self._statuses, strict=True):
            steps.append(Expand(rows, kinds, index, vary, n, None, first, chunk))
            steps.append(db.bind_rows(rows, status, out, n))
        return steps

    def release(self) -> None:
        """Free the descriptor buffer of runs without one given (after a check run)."""
        if self._own is not None:
            self._bound.pop(id(self._own), None)
        self._own = None

    def check(self) -> None:
        """Raise ``CorruptDataError`` if a decode met corrupt data (synchronizes)."""
        for error in self._checks:
            err = error()
            if err is not None:
                raise err


def chunk_order(batch: Batch, chunk: int) -> np.ndarray:
    """A one-tensor bf16 batch's pairs in chunk order: entry k is the index of the pair
    decoding symbols [k * chunk, (k + 1) * chunk)."""
    pairs = batch.desc.reshape(-1, 2, N_COLS)
    live = np.flatnonzero(pairs[:, 0, D_N] > 0)
    chunks = -(-batch.sizes[0] // chunk)
    k = pairs[live, 0, D_OUT] // chunk
    if len(k) != chunks or not np.array_equal(np.sort(k), np.arange(chunks)):
        # both fields kept plain: the planner cuts them in its own chunks
        raise ValueError(f"entropykit: the tensor's chunks are not of {chunk} symbols")
    order = np.empty(chunks, np.int64)
    order[k] = live
    return order


def chunk_pairs(batch: Batch, chunk: int) -> np.ndarray:
    """A one-tensor bf16 batch's descriptor pairs in chunk order (int64[chunks, 2,
    N_COLS]): the pair decoding symbols [k * chunk, (k + 1) * chunk) is row k."""
    return batch.desc.reshape(-1, 2, N_COLS)[chunk_order(batch, chunk)]


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
        self._order = chunk_order(batch, chunk)
        self.kinds, self.index, self.vary = (up(a) for a in compact(
            batch.desc.reshape(-1, 2, N_COLS)[self._order].reshape(-1, N_COLS)))
        self.chunks = torch.zeros(slots, dtype=torch.int64, device=device)  # wanted
        self.desc = torch.zeros((slots, 2, N_COLS), dtype=torch.int64, device=device)
        self.status = torch.zeros(2 * slots, dtype=torch.int32, device=device)
        self.out = region[: slots * chunk * 2].view(torch.bfloat16)
        self.held = [*_tables(db), self.kinds, self.index, self.vary, self.chunks,
                     self.desc, self.status]
        self._db, self._batch = db, batch
        self._steps: dict[int, tuple] = {}  # per count of chunks: expansion and launch
        self.count = 0  # chunks the next run decodes

    @property
    def nbytes(self) -> int:
        return _bytes(self.held)

    def want(self, chunks: torch.Tensor) -> None:
        """Make the next run decode ``chunks`` (int64, on the device; at most ``slots``),
        chunk ``chunks[i]`` into slot i: their descriptor pairs are gathered on the device
        when it runs."""
        n = chunks.numel()
        self.chunks[:n].copy_(chunks)
        self.count = n

    def run(self, rows: torch.Tensor | None = None, stream: object = None) -> None:
        """Enqueue the decode of the chunks last wanted on ``stream`` (None: torch's
        current stream); ``rows`` unused (its descriptors are its own)."""
        n = self.count
        steps = self._steps.get(n)
        if steps is None:
            steps = self._steps[n] = (
                Expand(self.desc, self.kinds, self.index, self.vary, n, self.chunks,
                       chunk=self.chunk),
                self._db.bind_rows(self.desc, self.status, self.out, n))
        for step in steps:
            _on(step, stream)

    def check(self) -> None:
        """Raise ``CorruptDataError`` if the last run met corrupt data (synchronizes)."""
        n = self.count
        err = self.error(self.chunks[:n].cpu().numpy(), self.status[: 2 * n].cpu().numpy())
        if err is not None:
            raise err

    def error(self, chunks: np.ndarray, status: np.ndarray) -> Exception | None:
        """The error of a run over ``chunks`` (pair i: chunk ``chunks[i]``) that wrote
        ``status`` (two rows a pair), as the batch names it, or None."""
        bad = np.flatnonzero(status)
        if not bad.size:
            return None
        i = int(bad[0])
        full = np.zeros(len(self._batch.desc), np.int32)
        full[2 * int(self._order[int(chunks[i // 2])]) + i % 2] = status[i]
        return self._batch.error(full)

    def range(self, first: int, n: int, region: torch.Tensor) -> CudaDecoder:
        """A decoder of chunks ``[first, first + n)`` into ``region`` from this tensor's
        coded bytes (``CudaDecoder.chunk_range``)."""
        return CudaDecoder.chunk_range(self, first, n, region)


def _raw_stream() -> object:
    """The raw handle of torch's current stream of a device index: one call into torch."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw if raw is not None else (lambda i: torch.cuda.current_stream(i).cuda_stream)


class CudaStreams:
    """Decodes ordered with the compute stream: now, or prefetched on one of ``sides``
    side streams, taken in turn, so that up to ``sides`` prefetched decodes (each into a
    place apart from the others') run at once, more warps than one small decode fills.
    The compute stream is torch's current one, looked up by its raw handle at each call
    (one call into torch) and its torch and CuPy objects kept while it stays the same;
    launches go to streams by handle, with no stream or device context entered where
    the device is current."""

    def __init__(self, device: torch.device, units: int, sides: int = 1) -> None:
        from .._cuda import nvrtc

        self.device = device
        self.index = device.index
        self.sides = [torch.cuda.Stream(device) for _ in range(sides)]
        with torch.cuda.device(device):
            self._views = [nvrtc.view(s.cuda_stream) for s in self.sides]
        self.turn = 0
        self.free = [torch.cuda.Event() for _ in range(units)]
        self._rows: list[torch.Tensor] = []
        self.ready = [torch.cuda.Event() for _ in range(units)]
        self._raw = _raw_stream()
        self._handle: object = None  # the compute stream's raw handle last seen
        self._compute: tuple = ()  # its torch stream and CuPy view

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

    def compute(self) -> tuple:
        """Torch's current stream of the device and CuPy's view of it."""
        handle = self._raw(self.index)
        if handle != self._handle:
            from .._cuda import nvrtc

            with torch.cuda.device(self.device):
                self._compute = (torch.cuda.current_stream(self.device), nvrtc.view(handle))
            self._handle = handle
        return self._compute

    def _here(self) -> contextlib.AbstractContextManager:
        """Nothing where the device is current (CuPy's launches need it), else its
        context."""
        if torch._C._cuda_getDevice() == self.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self.device)

    def now(self, decoder: CudaDecoder) -> None:
        with self._here():
            decoder.run(self.rows(0), self.compute()[1])

    def prefetch(self, u: int, decoder: CudaDecoder) -> None:
        # The side stream starts once the compute stream has done everything enqueued so
        # far: every block before the one about to run, which may share unit u's place.
        turn = self.turn
        self.turn = (turn + 1) % len(self.sides)
        side = self.sides[turn]
        free = self.free[u]
        with self._here():
            free.record(self.compute()[0])
            side.wait_event(free)
            decoder.run(self.rows(turn + 1), self._views[turn])
            self.ready[u].record(side)

    def join(self, u: int) -> None:
        self.compute()[0].wait_event(self.ready[u])

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
