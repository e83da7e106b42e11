"""Host side of the batched GPU decoder: symbol streams -> payload layout, tables, descriptors.

What it is: everything the kernel needs, built with numpy. A ``Stream`` is one field's
symbols as the kernel reads them: an rANS frame, or plain bytes (a raw field, or one
decoded on the host); a ``Place`` says where its symbols land (output, first element,
element stride, so a byte plane lands straight in a multi-byte tensor). A ``Planner``
collects streams and lays them out: each chunk's payload 16-byte aligned in one buffer (so
the kernel copies it in 8-byte pieces and reads start states as u32), every distinct
frequency table once as decode tables (``split_table``), one descriptor row per chunk.
All structural checks happen here (``entropykit.coding.frame.parse`` plus payload sizes),
so the kernel only has to check what depends on the coded data.

Rows come in pairs, one pair per warp: two chunks of one stream (u8 mode) or the
exponent and sign+mantissa chunks of one position (bf16 mode: the warp writes 16-bit
values). Pairs come in blocks of ``warps`` pairs whose streams use the same tables, so a
block stages one table set in shared memory for all its warps; a block is filled up with
empty pairs where a table set runs out. Within a table set pairs are ordered longest
first, blocks by their longest pair, so short chunks fill the launch's tail.
What it is not: a launcher (``_runtime.py``) or a kernel (``_kernel.cu``); no torch here.

Descriptor row (int64, columns named in ``_layout.py``):
    D_OFF  payload byte offset in the batch buffer     D_LEN  payload bytes
    D_OUT  output element of the chunk's first symbol (relative to its output; the
           launcher adds the output's position)        D_N    symbols (0: padding row)
    D_SYM  offset of table 0's slot->symbol table     D_INFO offset of its symbol info
           (both -1 for plain streams: no tables)
    D_PREC probability precision p                      D_MODE 0 coded, 1 raw
    D_CMAP offset of the frame's context map in ``cmaps`` (-1: one table); the tables of
           class c are at D_SYM + c << p and D_INFO + 256 c (a frame's tables are adjacent)
    D_STEP output elements from one symbol to the next
    D_GRID classed streams (``Grid``): offset in ``cmaps`` of the frame's context map,
           whose context for a symbol is its row class * kc + its column class (-1: not
           classed; then D_RMAP, D_KMAP are -1, D_WIDTH 1, D_COL 0)
    D_RMAP offset in ``cmaps`` of the row class (times kc) of the chunk's first symbol's
           row, the next rows' after it (-1: rows not classed, class 0)
    D_KMAP offset in ``cmaps`` of the column classes, one per column (-1: not classed)
    D_WIDTH columns of a row                            D_COL column of the first symbol
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..._errors import CorruptDataError
from ..._status import Status, by_status
from ...coding import frame as _frame
from ...coding import parallel
from .. import kernels as _rk
from ..static import CODER
from ._layout import (
    D_CMAP,
    D_COL,
    D_GRID,
    D_INFO,
    D_KMAP,
    D_LEN,
    D_MODE,
    D_N,
    D_OFF,
    D_OUT,
    D_PREC,
    D_RMAP,
    D_STEP,
    D_SYM,
    D_WIDTH,
    N_COLS,
)

ALIGN = 16
RAW_CHUNK = 1 << 16  # plain streams are cut into chunks of this many symbols
WARPS = 16  # chunk pairs (warps) per block: one staged table set serves them (docs/gpu.md)
# the kernel's per-stream statuses, worded as the CPU decoder words them
_MESSAGES = by_status(_rk.MESSAGES)
SMEM_MAX_PRECISION = 12  # a shared-memory table set holds 2**12 slots per stream
# Bookkeeping columns appended to descriptor rows while building (never uploaded).
_SRC, _C, _AT, _OUTPUT = range(N_COLS, N_COLS + 4)
_WIDTH = N_COLS + 4
# Columns of a registered stream (Planner.specs): stream index, symbols, chunk size,
# chunks, table offsets, precision, context map offset, output place, grid (classed
# frame's context map, row and column maps, columns, phase).
(_S_SRC, _S_N, _S_CHUNK, _S_COUNT, _S_SYM, _S_INFO, _S_PREC, _S_CMAP, _S_OUT, _S_AT,
 _S_STEP, _S_GRID, _S_RMAP, _S_KMAP, _S_WIDTH, _S_PHASE) = range(16)
_SPEC = 16
# Grid coordinates are 32-bit in the kernel: wider rows are decoded on the host.
GRID_MAX_WIDTH = (1 << 31) - 1

FrameBytes = bytes | memoryview | np.ndarray


def split_table(freqs: np.ndarray, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode tables of one validated frequency table (sums to 2**p, as ``tables.parse``
    guarantees): ``sym`` uint8[2**p], the symbol of each slot, and ``info`` uint32[256],
    f | start << 16 for each symbol (f <= 2**15 and start < 2**15 since p <= 15).
    """
    sym, info = split_tables(np.asarray(freqs, np.int64).reshape(1, -1), precision)
    return sym, info.reshape(-1)


def split_tables(freqs: np.ndarray, precision: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``split_table`` of every row of int64[n_tables, 256] at once (rows of any
    precisions where ``precision`` is None): the ``sym`` tables back to back, ``info``
    uint32[n_tables, 256]."""
    f = np.asarray(freqs, np.int64)
    sym = np.repeat(np.tile(np.arange(f.shape[1], dtype=np.uint8), len(f)), f.reshape(-1))
    # Into the u32 result, in place: a launch's int64 temporaries are large enough that
    # each new one costs a fresh mapping of zeroed pages, several times the arithmetic.
    info = np.cumsum(f, axis=1, dtype=np.uint32)
    np.subtract(info, f, out=info, casting="unsafe")  # start: below 2**15, as f
    info <<= 16
    np.bitwise_or(info, f, out=info, casting="unsafe")
    assert precision is None or sym.size == len(f) << precision
    return sym, info


def _as_u8(data: FrameBytes) -> np.ndarray:
    return data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)


@dataclass(frozen=True)
class Grid:
    """A classed frame's geometry: its symbols are the elements of rows of ``width``
    from column ``phase`` on, and symbol i's context is ``rows[row] * kc +
    columns[column]`` (a None map: class 0 on that axis); the frame's context map turns
    it into a table."""

    width: int
    phase: int
    kc: int
    rows: np.ndarray | None  # uint8, one per row touched
    columns: np.ndarray | None  # uint8, one per column


@dataclass(frozen=True)
class Stream:
    """One field's symbols as the kernel reads them: an rANS frame, or plain symbols."""

    data: np.ndarray  # uint8: the frame's bytes, or the symbols themselves
    info: _frame.FrameInfo | None  # the parsed frame; None for plain symbols
    label: str  # names the field in error messages, e.g. "exponent frame 3"
    grid: Grid | None = None  # a frame conditioned on its symbols' rows and columns

    @staticmethod
    def frame(data: FrameBytes, label: str) -> Stream:
        """An rANS frame, parsed and checked (CorruptDataError prefixed by ``label``)."""
        try:
            info = _frame.parse(CODER, data)
        except CorruptDataError as e:
            raise CorruptDataError(f"{label}: {e}") from None
        return Stream(_as_u8(data), info, label)

    @staticmethod
    def on_grid(data: FrameBytes, grid: Grid, label: str) -> Stream:
        """An rANS frame whose context is each symbol's class on ``grid`` (maps checked
        by the caller: classes below their counts, one per row and column);
        CorruptDataError if the frame is damaged or its contexts leave the grid's."""
        return Stream.frame(data, label).with_grid(grid)

    def with_grid(self, grid: Grid) -> Stream:
        """This frame (``on_grid``'s checks) with its context taken from ``grid``."""
        s, label = self, self.label
        if s.info.cmap is None:  # one table: the classes choose nothing
            return s
        if not 1 <= grid.width <= GRID_MAX_WIDTH or not 0 <= grid.phase < grid.width:
            raise CorruptDataError(f"{label}: rows of {grid.width} from column {grid.phase}")
        rows = -(-(grid.phase + s.n) // grid.width)
        if ((grid.rows is not None and grid.rows.size != rows)
                or (grid.columns is not None and grid.columns.size != grid.width)):
            raise CorruptDataError(f"{label}: class maps do not cover the grid")
        kr = 1 if grid.rows is None else int(grid.rows.max(initial=0)) + 1
        kc = 1 if grid.columns is None else int(grid.columns.max(initial=0)) + 1
        if kc > grid.kc or kr * grid.kc > 256:
            raise CorruptDataError(f"{label}: contexts beyond 256")
        return Stream(s.data, s.info, label, grid)

    @staticmethod
    def plain(symbols: FrameBytes, label: str) -> Stream:
        return Stream(_as_u8(symbols).reshape(-1), None, label)

    @property
    def n(self) -> int:
        return self.info.n if self.info is not None else int(self.data.size)

    @property
    def context(self) -> bool:
        """Conditioned on its partner's symbols (bf16 mode's sign_mantissa)."""
        return self.info is not None and self.info.cmap is not None and self.grid is None

    @property
    def classed(self) -> bool:
        """Conditioned on its own symbols' rows and columns (``grid``)."""
        return self.grid is not None

    @property
    def narrow(self) -> bool:
        """Whether its tables fit a shared-memory table set (or it has none)."""
        return self.info is None or self.info.param <= SMEM_MAX_PRECISION


@dataclass(frozen=True)
class Place:
    """Where a stream's symbol i lands: element ``at + i * step`` of output ``out``."""

    out: int
    at: int = 0
    step: int = 1


@dataclass(frozen=True)
class Batch:
    """A decode job, host side: upload it once (``_runtime.DeviceBatch``), run it often."""

    bf16: bool
    warps: int  # pairs per block the rows are laid out for
    slots: int  # table sets a block stages in shared memory (0..2)
    payload_size: int  # bytes of the payload buffer (a multiple of ALIGN)
    copies: np.ndarray  # int64[k, 4]: stream, byte offset in it, payload offset, length
    streams: tuple[Stream, ...]
    sym_tables: np.ndarray  # uint8: slot -> symbol tables back to back (never empty)
    info_tables: np.ndarray  # uint32: 256 symbol infos per table (never empty)
    cmaps: np.ndarray  # uint8: context maps (256 each) and class maps (never empty)
    desc: np.ndarray  # int64[n_rows, N_COLS], n_rows a multiple of 2 * warps
    out_index: np.ndarray  # int64[n_rows]: output each row writes, -1 for padding
    origin: np.ndarray  # int64[n_rows, 3]: stream, chunk, byte offset in the stream
    sizes: tuple[int, ...]  # elements of each output
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def context(self) -> bool:
        return bool((self.desc[:, D_CMAP] >= 0).any())

    @property
    def classed(self) -> bool:
        """Some stream's tables are chosen by its symbols' rows and columns (D_GRID)."""
        return bool((self.desc[:, D_GRID] >= 0).any())

    @property
    def narrow(self) -> bool:
        """Every table fits a shared-memory table set (precision <= 12)."""
        return int(self.desc[:, D_PREC].max(initial=0)) <= SMEM_MAX_PRECISION

    def fill(self, dst: np.ndarray, threads: int = 1) -> None:
        """Copy every chunk's payload into ``dst`` (uint8, >= ``payload_size`` bytes) at its
        place; ``threads`` share the copies (numpy releases the GIL for them)."""
        if dst.size < self.payload_size:
            raise ValueError(f"payload needs {self.payload_size} bytes, got {dst.size}")
        cp = self.copies
        src = self.streams

        def run(part: np.ndarray) -> None:
            for s, a, d, n in part.tolist():
                dst[d : d + n] = src[s].data[a : a + n]

        parts = np.array_split(cp, max(1, min(threads, len(cp) // 8)))
        if len(parts) == 1:
            run(cp)
            return
        parallel.run(lambda k: run(parts[k]), len(parts), len(parts))

    @property
    def payload(self) -> np.ndarray:
        """The payload buffer (built once, zeros between payloads)."""
        if "payload" not in self._cache:
            buf = np.zeros(self.payload_size, np.uint8)
            self.fill(buf)
            self._cache["payload"] = buf
        return self._cache["payload"]

    @property
    def origins(self) -> Origins:
        return Origins(self.origin, tuple(s.label for s in self.streams))

    def error(self, status: np.ndarray) -> CorruptDataError | None:
        """The error for the first failing row of a kernel's status array, or None."""
        return self.origins.error(status)


@dataclass(frozen=True)
class Origins:
    """What names a batch's rows in errors (kept after the batch's streams are gone)."""

    origin: np.ndarray  # int64[n_rows, 3]: stream, chunk, byte offset in the stream
    labels: tuple[str, ...]  # per stream

    def error(self, status: np.ndarray) -> CorruptDataError | None:
        """The error for the first failing row of a kernel's status array, or None."""
        bad = np.flatnonzero(status)
        if bad.size == 0:
            return None
        row = int(bad[0])
        s, c, at = (int(v) for v in self.origin[row])
        code = int(status[row])
        what = _MESSAGES.get(code, f"unknown status {code}")
        return CorruptDataError(f"{self.labels[s]} chunk {c} (payload at byte {at}): {what}")


def _chunk_rows(streams: Sequence[Stream], specs: np.ndarray) -> np.ndarray:
    """Rows of every registered stream's chunks, in order (D_OFF still relative to the
    stream's bytes); checks the payload sizes of frame chunks.

    ``specs``: one int64 row per stream, ``_SPEC`` columns. Vectorized over all streams at
    once: per-stream numpy calls would make the host plan the limit of loading files with
    many small tensors (docs/gpu.md).
    """
    counts = specs[:, _S_COUNT]
    total = int(counts.sum())
    which = np.repeat(np.arange(len(specs)), counts)  # spec of each row
    c = np.arange(total, dtype=np.int64) - (np.cumsum(counts) - counts)[which]
    chunk = specs[which, _S_CHUNK]
    first = c * chunk
    n = np.minimum(chunk, specs[which, _S_N] - first)
    off, length, mode = first.copy(), n.copy(), np.full(total, _frame.MODE_RAW, np.int64)
    infos = [streams[k].info for k in specs[:, _S_SRC].tolist()]
    framed = np.array([i is not None for i in infos], bool)
    if framed.any():
        on = framed[which]
        off[on] = np.concatenate([i.offsets for i in infos if i is not None])
        length[on] = np.concatenate([i.lengths for i in infos if i is not None])
        mode[on] = np.concatenate([i.modes for i in infos if i is not None])
        raw = mode == _frame.MODE_RAW
        # Raw payloads hold every symbol; coded ones the states and whole 16-bit words.
        bad = on & np.where(raw, length != n, (length < _rk.STATE_BYTES) | (length & 1 == 1))
        if bad.any():
            r = int(np.argmax(bad))
            msg = (f"raw payload is {int(length[r])} bytes, chunk has {int(n[r])} symbols"
                   if raw[r] else _MESSAGES[Status.ODD])
            label = streams[int(specs[which[r], _S_SRC])].label
            raise CorruptDataError(f"{label} chunk {int(c[r])} (payload at byte {int(off[r])}): "
                                   f"{msg}")
    per = specs[which]
    rows = np.empty((total, _WIDTH), np.int64)
    rows[:, D_OFF] = off
    rows[:, D_LEN] = length
    rows[:, D_OUT] = first * per[:, _S_STEP] + per[:, _S_AT]
    rows[:, D_N] = n
    rows[:, D_SYM] = per[:, _S_SYM]
    rows[:, D_INFO] = per[:, _S_INFO]
    rows[:, D_PREC] = per[:, _S_PREC]
    rows[:, D_MODE] = mode
    rows[:, D_CMAP] = per[:, _S_CMAP]
    rows[:, D_STEP] = per[:, _S_STEP]
    # The grid coordinates of each chunk's first symbol (width 1 for streams without).
    row0, col0 = np.divmod(per[:, _S_PHASE] + first, per[:, _S_WIDTH])
    rows[:, D_GRID] = per[:, _S_GRID]
    rows[:, D_RMAP] = np.where(per[:, _S_RMAP] >= 0, per[:, _S_RMAP] + row0, -1)
    rows[:, D_KMAP] = per[:, _S_KMAP]
    rows[:, D_WIDTH] = per[:, _S_WIDTH]
    rows[:, D_COL] = col0
    rows[:, _SRC] = per[:, _S_SRC]
    rows[:, _C] = c
    rows[:, _AT] = off
    rows[:, _OUTPUT] = per[:, _S_OUT]
    return rows


def _row_ids(keys: np.ndarray) -> np.ndarray:
    """Each row's index among the distinct rows of int64[n, k] in sorted order (what
    ``np.unique(keys, axis=0, return_inverse=True)`` gives, without the structured sort
    that costs more than a small batch's whole layout)."""
    order = np.lexsort(keys.T[::-1])
    ordered = keys[order]
    new = np.ones(len(keys), np.int64)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    ids = np.empty(len(keys), np.int64)
    ids[order] = np.cumsum(new) - 1
    return ids


_TABLE_COLS = [D_SYM, D_INFO, D_PREC]  # what a padding row keeps of its row


def _padding_like(rows: np.ndarray) -> np.ndarray:
    """Rows of 0 symbols with the same tables (so they join their block); "raw" so that
    the kernel reads nothing for them."""
    pad = np.zeros_like(rows)
    pad[:, _TABLE_COLS] = rows[:, _TABLE_COLS]
    pad[:, D_MODE] = _frame.MODE_RAW
    pad[:, D_CMAP] = -1
    pad[:, D_STEP] = 1
    pad[:, [D_GRID, D_RMAP, D_KMAP]] = -1
    pad[:, D_WIDTH] = 1
    pad[:, _OUTPUT] = -1
    return pad


_PADDING = _padding_like(np.zeros((1, _WIDTH), np.int64))[0]
_PADDING.flags.writeable = False


class Planner:
    """Collects streams for one launch (u8 or bf16 mode) and lays them out (``finish``)."""

    def __init__(self, bf16: bool, warps: int = WARPS) -> None:
        if warps < 1:
            raise ValueError(f"warps must be >= 1, got {warps}")
        self.bf16 = bf16
        self.warps = warps
        self.freqs: list[np.ndarray] = []  # each distinct frame's tables, split in finish
        self.sym_size = 0
        self.tables = 0
        self.known: dict[tuple[int, bytes, bytes], tuple[int, int]] = {}
        self.cmaps: list[np.ndarray] = []
        self.cmap_size = 0
        self.streams: list[Stream] = []
        self.specs: list[tuple[int, ...]] = []  # per non-empty stream, _SPEC columns
        self.units: list[int] = []  # chunks of each add (u8) / add_pair (bf16), in order

    def _tables(self, info: _frame.FrameInfo) -> tuple[int, int]:
        """Offsets of a frame's tables; equal frames' tables are stored once."""
        key = (info.param, info.freqs.tobytes(),
               b"" if info.cmap is None else info.cmap.tobytes())
        if key not in self.known:
            self.known[key] = (self.sym_size, 256 * self.tables)
            self.freqs.append(info.freqs)  # [n_tables, 256], each summing to 2**param
            self.sym_size += len(info.freqs) << info.param
            self.tables += len(info.freqs)
        return self.known[key]

    def _register(self, s: Stream, place: Place, chunk: int) -> int:
        """Note a stream's chunks (``finish`` builds the rows); returns how many. Plain
        streams are cut into chunks of ``chunk`` symbols, frames as they are."""
        info = s.info
        if info is not None:
            n = info.n
            if n == 0:
                return 0
            chunk = info.chunk_size
            count = len(info.lengths)
            sym_off, info_off = self._tables(info)
            prec = info.param
            cmap_off = self._cmap(info.cmap) if info.cmap is not None and s.grid is None \
                else -1
        else:
            n = int(s.data.size)
            if n == 0:
                return 0
            count = -(-n // chunk)
            sym_off = info_off = cmap_off = -1
            prec = 0
        g = s.grid
        if g is None:
            self.specs.append((len(self.streams), n, chunk, count, sym_off, info_off, prec,
                               cmap_off, place.out, place.at, place.step, -1, -1, -1, 1, 0))
        else:
            rmap = None if g.rows is None else g.rows.astype(np.uint8) * np.uint8(g.kc)
            self.specs.append((len(self.streams), n, chunk, count, sym_off, info_off, prec,
                               cmap_off, place.out, place.at, place.step,
                               self._cmap(info.cmap), self._cmap(rmap), self._cmap(g.columns),
                               g.width, g.phase))
        self.streams.append(s)
        return count

    def _cmap(self, values: np.ndarray | None) -> int:
        """Offset of ``values`` (uint8) appended to ``cmaps``; -1 for None."""
        if values is None:
            return -1
        at = self.cmap_size
        self.cmaps.append(np.asarray(values, np.uint8).reshape(-1))
        self.cmap_size += self.cmaps[-1].size
        return at

    def add(self, s: Stream, place: Place) -> None:
        """u8 mode: decode ``s`` into bytes of output ``place.out``."""
        if self.bf16:
            raise ValueError("a bf16-mode planner takes (exponent, sign_mantissa) pairs")
        if s.context:
            raise ValueError(
                f"{s.label} is context-conditioned: decode it with its context field "
                "(decode_bf16 for a BF16 sign_mantissa field)"
            )
        self.units.append(self._register(s, place, RAW_CHUNK))

    def add_pair(self, exp: Stream, sm: Stream, place: Place) -> None:
        """bf16 mode: write (sm >> 7) << 15 | exp << 7 | (sm & 0x7f) as 16-bit elements.

        The two streams must have the same symbol count, and the same chunk size where both
        are frames (the container codes both fields with identical chunking); a plain
        stream is cut like its partner. ``sm`` may be context-conditioned on ``exp``.
        """
        if not self.bf16:
            raise ValueError("a u8-mode planner takes single streams")
        if exp.context:
            raise ValueError(f"{exp.label} is context-conditioned; it has no context")
        if sm.classed:  # the kernel keeps no class grid for it (its registers)
            raise ValueError(f"{sm.label} is classed: decode it on the host")
        ei, si = exp.info, sm.info
        chunk = ei.chunk_size if ei is not None else si.chunk_size if si is not None \
            else RAW_CHUNK
        if exp.n != sm.n or (ei is not None and si is not None
                             and ei.chunk_size != si.chunk_size):
            def says(s: Stream) -> str:
                cut = f" in chunks of {s.info.chunk_size}" if s.info is not None else ""
                return f"{s.n} symbols{cut}"
            raise ValueError(f"{exp.label} has {says(exp)}, {sm.label} {says(sm)}")
        count = self._register(exp, place, chunk)
        self._register(sm, place, chunk)  # as many chunks: same symbols, same cut
        self.units.append(count)

    def _pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every add's rows as pairs, in the order added: a stream's chunks two by two
        (u8; an odd last chunk with a padding row), or an exponent chunk with the
        sign_mantissa chunk at the same place (bf16). Returned as the rows (int64[r,
        _WIDTH]) and, per pair, the indices of its two rows (int64[k, 2]) and whether
        each is padding made from that row (``_padding_like``): rows are gathered once,
        in ``finish``."""
        if not self.specs:
            return np.zeros((0, _WIDTH), np.int64), np.zeros((0, 2), np.int64), \
                np.zeros((0, 2), bool)
        rows = _chunk_rows(self.streams, np.array(self.specs, np.int64).reshape(-1, _SPEC))
        k = np.array(self.units, np.int64)
        per_add = 2 * k if self.bf16 else k  # rows each add registered
        start = np.cumsum(per_add) - per_add
        pairs_per = k if self.bf16 else (k + 1) // 2
        unit = np.repeat(np.arange(len(k)), pairs_per)
        j = np.arange(int(pairs_per.sum()), dtype=np.int64) - (np.cumsum(pairs_per)
                                                                - pairs_per)[unit]
        pad = np.zeros((len(j), 2), bool)
        if self.bf16:
            a = start[unit] + j
            return rows, np.stack([a, a + k[unit]], axis=1), pad
        a = start[unit] + 2 * j
        odd = a + 1 >= start[unit] + k[unit]  # the stream's last chunk has no partner
        pad[:, 1] = odd
        return rows, np.stack([a, np.where(odd, a, a + 1)], axis=1), pad

    def _blocks(self, rows: np.ndarray, idx: np.ndarray, pad: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray]:
        """Pairs (``_pairs``' indices and padding marks) grouped into blocks of ``warps``
        with one table set each (see module docstring), blocks longest first; padding
        pairs, made from a set's last pair, fill each table set's last block."""
        w = self.warps
        n = np.where(pad, 0, rows[idx, D_N])  # symbols of each row of each pair
        steps = n.max(axis=1)
        group = _row_ids(rows[:, [D_SYM, D_INFO]][idx].reshape(len(idx), 4))
        order = np.lexsort((-steps, group))  # by table set, longest first within one
        size = np.bincount(group)  # pairs of each table set (sets appear in id order)
        padded = -(-size // w) * w
        start = np.cumsum(size) - size
        g = np.repeat(np.arange(len(size)), padded)
        j = np.arange(int(padded.sum())) - (np.cumsum(padded) - padded)[g]
        src = order[start[g] + np.minimum(j, size[g] - 1)]
        filler = j >= size[g]
        # Blocks ordered on their first pair (a block's longest, never padding).
        by = np.argsort(-steps[src[::w]], kind="stable")
        src, filler = src.reshape(-1, w)[by].reshape(-1), filler.reshape(-1, w)[by].reshape(-1)
        return idx[src], pad[src] | filler[:, None]

    def _rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The launch's rows, in blocks, padding and all, as indices: the registered rows
        (int64[r, _WIDTH]), the row each launch row is made from (int64[n_rows]) and the
        launch rows that are padding made from theirs (``_padding_like``)."""
        rows, idx, pad = self._pairs()
        if len(idx):
            idx, pad = self._blocks(rows, idx, pad)
        return rows, idx.reshape(-1), np.flatnonzero(pad.reshape(-1))

    def _slots(self, desc: np.ndarray, ctx: bool) -> int:
        """Table sets a block stages (the kernel's rule): a's tables if it has any; b's in
        a second set if it has its own (not a's, not read through L1 for contexts)."""
        first = desc.reshape(-1, self.warps, 2, N_COLS)[:, 0]
        a = first[:, 0, D_SYM] >= 0
        b = (first[:, 1, D_SYM] >= 0) & (first[:, 1, D_SYM] != first[:, 0, D_SYM]) & (not ctx)
        return int((a.astype(int) + b).max(initial=0))

    def finish(self, sizes: Sequence[int]) -> Batch:
        """The batch; output k has ``sizes[k]`` elements (bytes in u8 mode, 16-bit in bf16)."""
        rows, at, fill = self._rows()
        n_rows = len(at)
        # Gathered once, each part from its own columns: a launch's rows are large
        # enough that every extra array of them costs fresh pages.
        desc = rows[at, :N_COLS]
        origin = rows[:, [_SRC, _C, _AT]][at]
        if fill.size:  # ``_padding_like`` in place: the padding row, the tables kept
            desc[fill] = _PADDING[:N_COLS]
            desc[fill[:, None], _TABLE_COLS] = rows[:, _TABLE_COLS][at[fill]]
            origin[fill] = _PADDING[[_SRC, _C, _AT]]
        live = desc[:, D_N] > 0
        # Lay the payloads out back to back, each aligned, in row order (the launch order).
        size = np.where(live, desc[:, D_LEN], 0)
        padded = (size + ALIGN - 1) // ALIGN * ALIGN
        start = np.cumsum(padded) - padded
        copies = np.stack([origin[:, 0], desc[:, D_OFF], start, size], axis=1)[live]
        desc[:, D_OFF] = np.where(live, start, 0)
        sym, info = np.zeros(1, np.uint8), np.zeros(1, np.uint32)
        if self.freqs:  # every frame's tables split in one pass
            sym, info = split_tables(np.concatenate(self.freqs))
            info = info.reshape(-1)
            assert sym.size == self.sym_size
        cmaps = np.concatenate(self.cmaps) if self.cmaps else np.zeros(1, np.uint8)
        out_index = np.where(live, rows[at, _OUTPUT], -1)  # padding rows are not live
        ctx = bool((desc[:, D_CMAP] >= 0).any())
        slots = self._slots(desc, ctx) if n_rows else 0
        # ALIGN spare bytes at the end: the kernel may read word 0 of a payload without words.
        return Batch(self.bf16, self.warps, slots, int(padded.sum()) + ALIGN, copies,
                     tuple(self.streams), sym, info, cmaps, desc, out_index, origin,
                     tuple(int(s) for s in sizes))


def prepare_u8(frames: Sequence[FrameBytes], warps: int = WARPS) -> Batch:
    """A batch decoding each rANS frame into its own uint8 output (output k = frame k)."""
    p = Planner(False, warps)
    sizes = []
    for k, fb in enumerate(frames):
        s = Stream.frame(fb, f"rANS frame {k}")
        p.add(s, Place(k))
        sizes.append(s.n)
    return p.finish(sizes)


def prepare_bf16(exp_frames: Sequence[FrameBytes], sm_frames: Sequence[FrameBytes],
                 warps: int = WARPS) -> Batch:
    """A batch writing bf16 tensor k from ``exp_frames[k]`` and ``sm_frames[k]``.

    The two frames of a tensor must have the same symbol count and chunk size (the BF16
    format codes both fields with identical chunking); ``sm_frames[k]`` may be
    context-conditioned on the exponent, ``exp_frames[k]`` may not.
    """
    if len(exp_frames) != len(sm_frames):
        raise ValueError(f"{len(exp_frames)} exponent frames but {len(sm_frames)} sign_mantissa")
    p = Planner(True, warps)
    sizes = []
    for k, (ef, sf) in enumerate(zip(exp_frames, sm_frames, strict=True)):
        e = Stream.frame(ef, f"exponent frame {k}")
        s = Stream.frame(sf, f"sign_mantissa frame {k}")
        try:
            p.add_pair(e, s, Place(k))
        except ValueError as err:
            raise ValueError(f"tensor {k}: {err}") from None
        sizes.append(e.n)
    return p.finish(sizes)
