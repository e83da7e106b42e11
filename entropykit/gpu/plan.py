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
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .._errors import CorruptDataError
from ..coding import frame as _frame
from ..rans import kernels as _rk
from ..rans.static import CODER
from ._layout import (
    D_CMAP,
    D_INFO,
    D_LEN,
    D_MODE,
    D_N,
    D_OFF,
    D_OUT,
    D_PREC,
    D_STEP,
    D_SYM,
    N_COLS,
)

ALIGN = 16
RAW_CHUNK = 1 << 16  # plain streams are cut into chunks of this many symbols
WARPS = 16  # chunk pairs (warps) per block; gpu/README.md has the measurement
SMEM_MAX_PRECISION = 12  # a shared-memory table set holds 2**12 slots per stream
# Bookkeeping columns appended to descriptor rows while building (never uploaded).
_SRC, _C, _AT, _OUTPUT = range(N_COLS, N_COLS + 4)
_WIDTH = N_COLS + 4

FrameBytes = bytes | memoryview | np.ndarray


def split_table(freqs: np.ndarray, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """Decode tables of one validated frequency table (sums to 2**p, as ``tables.parse``
    guarantees): ``sym`` uint8[2**p], the symbol of each slot, and ``info`` uint32[256],
    f | start << 16 for each symbol (f <= 2**15 and start < 2**15 since p <= 15).
    """
    f = np.asarray(freqs, np.int64)
    sym = np.repeat(np.arange(f.size, dtype=np.uint8), f)
    start = np.cumsum(f) - f
    info = (f | start << 16).astype(np.uint32)
    assert sym.size == 1 << precision
    return sym, info


def _as_u8(data: FrameBytes) -> np.ndarray:
    return data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)


@dataclass(frozen=True)
class Stream:
    """One field's symbols as the kernel reads them: an rANS frame, or plain symbols."""

    data: np.ndarray  # uint8: the frame's bytes, or the symbols themselves
    info: _frame.FrameInfo | None  # the parsed frame; None for plain symbols
    label: str  # names the field in error messages, e.g. "exponent frame 3"

    @staticmethod
    def frame(data: FrameBytes, label: str) -> Stream:
        """An rANS frame, parsed and checked (CorruptDataError prefixed by ``label``)."""
        try:
            info = _frame.parse(CODER, data)
        except CorruptDataError as e:
            raise CorruptDataError(f"{label}: {e}") from None
        return Stream(_as_u8(data), info, label)

    @staticmethod
    def plain(symbols: FrameBytes, label: str) -> Stream:
        return Stream(_as_u8(symbols).reshape(-1), None, label)

    @property
    def n(self) -> int:
        return self.info.n if self.info is not None else int(self.data.size)

    @property
    def context(self) -> bool:
        return self.info is not None and self.info.cmap is not None

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
    cmaps: np.ndarray  # uint8, 256 per context-conditioned frame (never empty)
    desc: np.ndarray  # int64[n_rows, N_COLS], n_rows a multiple of 2 * warps
    out_index: np.ndarray  # int64[n_rows]: output each row writes, -1 for padding
    origin: np.ndarray  # int64[n_rows, 3]: stream, chunk, byte offset in the stream
    sizes: tuple[int, ...]  # elements of each output
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def context(self) -> bool:
        return bool((self.desc[:, D_CMAP] >= 0).any())

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
        with ThreadPoolExecutor(len(parts)) as pool:
            list(pool.map(run, parts))

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
        what = _rk.MESSAGES.get(code, f"unknown status {code}")
        return CorruptDataError(f"{self.labels[s]} chunk {c} (payload at byte {at}): {what}")


def _chunk_rows(info: _frame.FrameInfo, label: str) -> np.ndarray:
    """Per chunk: frame offset, length, first symbol, symbols, mode; checks payload sizes."""
    count = len(info.lengths)
    out = np.empty((count, 5), np.int64)
    out[:, 0] = info.offsets
    length = out[:, 1]
    length[:] = info.lengths
    first = out[:, 2]
    first[:] = np.arange(0, count * info.chunk_size, info.chunk_size)
    n = out[:, 3]
    np.minimum(info.chunk_size, info.n - first, out=n)
    mode = out[:, 4]
    mode[:] = info.modes
    raw = mode == _frame.MODE_RAW
    # Raw payloads hold every symbol; coded ones the states and whole 16-bit words.
    bad = np.where(raw, length != n, (length < _rk.STATE_BYTES) | (length & 1 == 1))
    if bad.any():
        c = int(np.argmax(bad))
        msg = (f"raw payload is {int(length[c])} bytes, chunk has {int(n[c])} symbols"
               if raw[c] else _rk.MESSAGES[_rk.ERR_ODD])
        raise CorruptDataError(
            f"{label} chunk {c} (payload at byte {int(info.offsets[c])}): {msg}"
        )
    return out


def _padding_like(rows: np.ndarray) -> np.ndarray:
    """Rows of 0 symbols with the same tables (so they join their block); "raw" so that
    the kernel reads nothing for them."""
    pad = np.zeros_like(rows)
    for col in (D_SYM, D_INFO, D_PREC):
        pad[:, col] = rows[:, col]
    pad[:, D_MODE] = _frame.MODE_RAW
    pad[:, D_CMAP] = -1
    pad[:, D_STEP] = 1
    pad[:, _OUTPUT] = -1
    return pad


class Planner:
    """Collects streams for one launch (u8 or bf16 mode) and lays them out (``finish``)."""

    def __init__(self, bf16: bool, warps: int = WARPS) -> None:
        if warps < 1:
            raise ValueError(f"warps must be >= 1, got {warps}")
        self.bf16 = bf16
        self.warps = warps
        self.sym: list[np.ndarray] = []
        self.info: list[np.ndarray] = []
        self.sym_size = 0
        self.known: dict[tuple[int, bytes, bytes], tuple[int, int]] = {}
        self.cmaps: list[np.ndarray] = []
        self.streams: list[Stream] = []
        self.pairs: list[np.ndarray] = []  # each int64[k, 2, _WIDTH]

    def _tables(self, info: _frame.FrameInfo) -> tuple[int, int]:
        """Offsets of a frame's tables; equal frames' tables are stored once."""
        key = (info.param, info.freqs.tobytes(),
               b"" if info.cmap is None else info.cmap.tobytes())
        if key not in self.known:
            self.known[key] = (self.sym_size, 256 * len(self.info))
            for row in info.freqs:  # [n_tables, 256]
                sym, inf = split_table(row, info.param)
                self.sym.append(sym)
                self.info.append(inf)
                self.sym_size += sym.size
        return self.known[key]

    def _rows(self, s: Stream, place: Place, chunk: int) -> np.ndarray:
        """Rows of one stream's chunks (D_OFF still relative to the stream's bytes)."""
        if s.n == 0:
            return np.zeros((0, _WIDTH), np.int64)
        if s.info is not None:
            chunks = _chunk_rows(s.info, s.label)
            sym_off, info_off = self._tables(s.info)
            prec = s.info.param
        else:
            first = np.arange(0, s.n, chunk, dtype=np.int64)
            n = np.minimum(chunk, s.n - first)
            chunks = np.stack([first, n, first, n, np.full_like(n, _frame.MODE_RAW)], axis=1)
            sym_off = info_off = -1
            prec = 0
        cmap_off = -1
        if s.context:
            cmap_off = 256 * len(self.cmaps)
            self.cmaps.append(np.asarray(s.info.cmap, np.uint8))
        rows = np.empty((len(chunks), _WIDTH), np.int64)
        rows[:, [D_OFF, D_LEN, D_OUT, D_N, D_MODE]] = chunks
        rows[:, D_OUT] *= place.step
        rows[:, D_OUT] += place.at
        rows[:, [D_SYM, D_INFO, D_PREC, D_CMAP, D_STEP, _SRC, _OUTPUT]] = (
            sym_off, info_off, prec, cmap_off, place.step, len(self.streams), place.out)
        rows[:, _C] = np.arange(len(chunks))
        rows[:, _AT] = chunks[:, 0]
        self.streams.append(s)
        return rows

    def add(self, s: Stream, place: Place) -> None:
        """u8 mode: decode ``s`` into bytes of output ``place.out``."""
        if self.bf16:
            raise ValueError("a bf16-mode planner takes (exponent, sign_mantissa) pairs")
        if s.context:
            raise ValueError(
                f"{s.label} is context-conditioned: decode it with its context field "
                "(decode_bf16 for a BF16 sign_mantissa field)"
            )
        rows = self._rows(s, place, RAW_CHUNK)
        if len(rows) % 2:
            rows = np.concatenate([rows, _padding_like(rows[-1:])])
        self.pairs.append(rows.reshape(-1, 2, _WIDTH))

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
        chunks = {s.info.chunk_size for s in (exp, sm) if s.info is not None}
        if exp.n != sm.n or len(chunks) > 1:
            def says(s: Stream) -> str:
                cut = f" in chunks of {s.info.chunk_size}" if s.info is not None else ""
                return f"{s.n} symbols{cut}"
            raise ValueError(f"{exp.label} has {says(exp)}, {sm.label} {says(sm)}")
        chunk = chunks.pop() if chunks else RAW_CHUNK
        a, b = self._rows(exp, place, chunk), self._rows(sm, place, chunk)
        self.pairs.append(np.stack([a, b], axis=1))

    def _blocks(self, pairs: np.ndarray) -> np.ndarray:
        """Pairs grouped into blocks of ``warps`` with one table set each (see module
        docstring), blocks longest first; padding pairs fill each table set's last block."""
        w = self.warps
        steps = np.maximum(pairs[:, 0, D_N], pairs[:, 1, D_N])
        keys = pairs[:, :, [D_SYM, D_INFO]].reshape(len(pairs), 4)
        _, group = np.unique(keys, axis=0, return_inverse=True)
        group = group.reshape(-1)
        order = np.lexsort((-steps, group))  # by table set, longest first within one
        cuts = np.flatnonzero(np.diff(group[order])) + 1
        blocks = []
        for idx in np.split(order, cuts):
            part = pairs[idx]
            spare = -len(part) % w
            if spare:
                pad = np.stack([_padding_like(part[-1:, 0]), _padding_like(part[-1:, 1])], 1)
                part = np.concatenate([part, np.repeat(pad, spare, axis=0)])
            blocks.append(part.reshape(-1, w, 2, _WIDTH))
        blocks_arr = np.concatenate(blocks)
        longest = np.maximum(blocks_arr[:, 0, 0, D_N], blocks_arr[:, 0, 1, D_N])
        return blocks_arr[np.argsort(-longest, kind="stable")].reshape(-1, 2, _WIDTH)

    def _slots(self, desc: np.ndarray, ctx: bool) -> int:
        """Table sets a block stages (the kernel's rule): a's tables if it has any; b's in
        a second set if it has its own (not a's, not read through L1 for contexts)."""
        first = desc.reshape(-1, self.warps, 2, N_COLS)[:, 0]
        a = first[:, 0, D_SYM] >= 0
        b = (first[:, 1, D_SYM] >= 0) & (first[:, 1, D_SYM] != first[:, 0, D_SYM]) & (not ctx)
        return int((a.astype(int) + b).max(initial=0))

    def finish(self, sizes: Sequence[int]) -> Batch:
        """The batch; output k has ``sizes[k]`` elements (bytes in u8 mode, 16-bit in bf16)."""
        pairs = (np.concatenate(self.pairs) if self.pairs
                 else np.zeros((0, 2, _WIDTH), np.int64))
        if len(pairs):
            pairs = self._blocks(pairs)
        n_rows = 2 * len(pairs)
        flat = pairs.reshape(n_rows, _WIDTH)
        desc = flat[:, :N_COLS].copy()
        live = desc[:, D_N] > 0
        # Lay the payloads out back to back, each aligned, in row order (the launch order).
        size = np.where(live, desc[:, D_LEN], 0)
        padded = (size + ALIGN - 1) // ALIGN * ALIGN
        start = np.cumsum(padded) - padded
        copies = np.stack([flat[:, _SRC], desc[:, D_OFF], start, size], axis=1)[live]
        desc[:, D_OFF] = np.where(live, start, 0)
        sym = np.concatenate(self.sym) if self.sym else np.zeros(1, np.uint8)
        info = np.concatenate(self.info) if self.info else np.zeros(1, np.uint32)
        cmaps = np.concatenate(self.cmaps) if self.cmaps else np.zeros(1, np.uint8)
        out_index = np.where(live, flat[:, _OUTPUT], -1)
        origin = flat[:, [_SRC, _C, _AT]].copy()
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
