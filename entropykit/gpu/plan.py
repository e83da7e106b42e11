"""Host side of the batched GPU decoder: frames -> one payload buffer, tables, descriptors.

What it is: everything the kernel needs, built with numpy from rANS frames: every chunk's
payload copied into one buffer (each chunk 16-byte aligned, so the kernel copies it in
8-byte pieces and reads start states as u32), every distinct frequency table once as decode
tables (``split_table``), and one descriptor row per chunk stream. All structural checks
happen here (``entropykit.coding.frame.parse`` plus payload sizes), so the kernel only has
to check what depends on the coded data. Rows come in pairs, one pair per warp: two
independent chunks (u8 output) or the exponent and sign+mantissa chunks of one position
(bf16 output). Pairs are ordered longest first so that short chunks fill the launch's tail.
What it is not: a launcher (``_runtime.py``) or a kernel (``_kernel.cu``); no torch here.

Descriptor row (int64, columns named in ``_layout.py``):
    D_OFF  payload byte offset in the batch buffer     D_LEN  payload bytes
    D_OUT  first output element of the chunk (relative to its output; the launcher adds
           the output's position)                      D_N    symbols (0: padding row)
    D_SYM  offset of table 0's slot->symbol table     D_INFO offset of its symbol info
    D_PREC probability precision p                      D_MODE 0 coded, 1 raw
    D_CMAP offset of the frame's context map in ``cmaps`` (-1: one table); the tables of
           class c are at D_SYM + c << p and D_INFO + 256 c (a frame's tables are adjacent)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import CorruptDataError
from ..coding import frame as _frame
from ..rans import kernels as _rk
from ..rans.static import CODER
from ._layout import D_CMAP, D_INFO, D_LEN, D_MODE, D_N, D_OFF, D_OUT, D_PREC, D_SYM, N_COLS

ALIGN = 16
# Bookkeeping columns appended to descriptor rows while building (never uploaded).
_K, _C, _AT, _SRC, _OUTPUT = range(N_COLS, N_COLS + 5)
_WIDTH = N_COLS + 5


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


@dataclass(frozen=True)
class Batch:
    """A decode job, host side: upload it once (``_runtime.DeviceBatch``), run it often."""

    bf16: bool
    payload: np.ndarray  # uint8, size a multiple of ALIGN
    sym_tables: np.ndarray  # uint8: slot -> symbol tables back to back (never empty)
    info_tables: np.ndarray  # uint32: 256 symbol infos per table (never empty)
    cmaps: np.ndarray  # uint8, 256 per context-conditioned frame (never empty)
    desc: np.ndarray  # int64[n_rows, N_COLS], n_rows even
    out_index: np.ndarray  # int64[n_rows]: output each row writes, -1 for padding
    origin: np.ndarray  # int64[n_rows, 3]: frame, chunk, payload byte offset in its frame
    sizes: tuple[int, ...]  # elements of each output
    roles: tuple[str, str]  # how messages name the frames of rows 2k and 2k + 1

    @property
    def context(self) -> bool:
        return bool((self.desc[:, D_CMAP] >= 0).any())

    def error(self, status: np.ndarray) -> CorruptDataError | None:
        """The error for the first failing row of a kernel's status array, or None."""
        bad = np.flatnonzero(status)
        if bad.size == 0:
            return None
        row = int(bad[0])
        k, c, at = (int(v) for v in self.origin[row])
        code = int(status[row])
        what = _rk.MESSAGES.get(code, f"unknown status {code}")
        return CorruptDataError(
            f"{self.roles[row % 2]} {k} chunk {c} (payload at byte {at}): {what}"
        )


def _parse(fb: bytes | memoryview | np.ndarray, role: str, k: int) -> _frame.FrameInfo:
    try:
        return _frame.parse(CODER, fb)
    except CorruptDataError as e:
        raise CorruptDataError(f"{role} {k}: {e}") from None


def _chunk_rows(info: _frame.FrameInfo, role: str, k: int) -> np.ndarray:
    """Per chunk: frame offset, length, first symbol, symbols, mode; checks payload sizes."""
    count = len(info.lengths)
    first = np.arange(count, dtype=np.int64) * info.chunk_size
    n = np.minimum(info.chunk_size, info.n - first)
    mode = info.modes.astype(np.int64)
    length = info.lengths.astype(np.int64)
    raw_bad = np.flatnonzero((mode == _frame.MODE_RAW) & (length != n))
    coded_bad = np.flatnonzero(
        (mode == _frame.MODE_CODED)
        & ((length < _rk.STATE_BYTES) | ((length - _rk.STATE_BYTES) & 1 == 1))
    )
    for bad, msg in ((raw_bad, None), (coded_bad, _rk.MESSAGES[_rk.ERR_ODD])):
        if bad.size:
            c = int(bad[0])
            msg = msg or f"raw payload is {int(length[c])} bytes, chunk has {int(n[c])} symbols"
            raise CorruptDataError(
                f"{role} {k} chunk {c} (payload at byte {int(info.offsets[c])}): {msg}"
            )
    return np.stack([info.offsets.astype(np.int64), length, first, n, mode], axis=1)


class _Builder:
    """Accumulates frames' tables and chunk rows, then lays out the payload buffer."""

    def __init__(self) -> None:
        self.sym: list[np.ndarray] = []
        self.info: list[np.ndarray] = []
        self.sym_size = 0
        self.known: dict[tuple[int, bytes, bytes], tuple[int, int]] = {}
        self.cmaps: list[np.ndarray] = []
        self.sources: list[np.ndarray] = []  # per frame: its bytes

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

    def add(self, fb, info: _frame.FrameInfo, role: str, k: int, out: int) -> np.ndarray:
        """Rows of one frame's chunks (D_OFF still relative to the frame)."""
        buf = fb if isinstance(fb, np.ndarray) else np.frombuffer(fb, np.uint8)
        if info.n == 0:
            return np.zeros((0, _WIDTH), np.int64)
        chunks = _chunk_rows(info, role, k)
        sym_off, info_off = self._tables(info)
        cmap_off = -1
        if info.cmap is not None:
            cmap_off = 256 * len(self.cmaps)
            self.cmaps.append(np.asarray(info.cmap, np.uint8))
        rows = np.zeros((len(chunks), N_COLS), np.int64)
        rows[:, D_OFF] = chunks[:, 0]
        rows[:, D_LEN] = chunks[:, 1]
        rows[:, D_OUT] = chunks[:, 2]
        rows[:, D_N] = chunks[:, 3]
        rows[:, D_SYM] = sym_off
        rows[:, D_INFO] = info_off
        rows[:, D_PREC] = info.param
        rows[:, D_MODE] = chunks[:, 4]
        rows[:, D_CMAP] = cmap_off
        book = np.zeros((len(chunks), _WIDTH - N_COLS), np.int64)
        book[:, _K - N_COLS] = k
        book[:, _C - N_COLS] = np.arange(len(chunks))
        book[:, _AT - N_COLS] = chunks[:, 0]
        book[:, _SRC - N_COLS] = len(self.sources)
        book[:, _OUTPUT - N_COLS] = out
        self.sources.append(buf)
        return np.concatenate([rows, book], axis=1)

    def finish(self, pairs: np.ndarray, bf16: bool, sizes: Sequence[int],
               roles: tuple[str, str]) -> Batch:
        """``pairs``: int64[n_pairs, 2, _WIDTH], rows of ``add`` in launch order."""
        n_rows = 2 * len(pairs)
        flat = pairs.reshape(n_rows, _WIDTH)
        desc = flat[:, :N_COLS].copy()
        live = desc[:, D_N] > 0
        # Lay the payloads out back to back, each aligned, in row order (the launch order).
        size = np.where(live, desc[:, D_LEN], 0)
        padded = (size + ALIGN - 1) // ALIGN * ALIGN
        start = np.cumsum(padded) - padded
        # ALIGN spare bytes at the end: the kernel may read word 0 of a payload without words.
        payload = np.zeros(int(padded.sum()) + ALIGN, np.uint8)
        for r in np.flatnonzero(live):
            src = self.sources[int(flat[r, _SRC])]
            a, ln = int(desc[r, D_OFF]), int(desc[r, D_LEN])
            payload[int(start[r]) : int(start[r]) + ln] = src[a : a + ln]
        desc[:, D_OFF] = np.where(live, start, 0)
        sym = np.concatenate(self.sym) if self.sym else np.zeros(1, np.uint8)
        info = np.concatenate(self.info) if self.info else np.zeros(1, np.uint32)
        cmaps = np.concatenate(self.cmaps) if self.cmaps else np.zeros(1, np.uint8)
        out_index = np.where(live, flat[:, _OUTPUT], -1)
        origin = flat[:, [_K, _C, _AT]].copy()
        return Batch(bf16, payload, sym, info, cmaps, desc, out_index, origin, tuple(sizes),
                     roles)


def _longest_first(pairs: np.ndarray) -> np.ndarray:
    steps = np.maximum(pairs[:, 0, D_N], pairs[:, 1, D_N])
    return pairs[np.argsort(-steps, kind="stable")]


def prepare_u8(frames: Sequence[bytes | memoryview | np.ndarray]) -> Batch:
    """A batch decoding each rANS frame into its own uint8 output (output k = frame k)."""
    b = _Builder()
    parts = []
    sizes = []
    for k, fb in enumerate(frames):
        info = _parse(fb, "rANS frame", k)
        if info.cmap is not None:
            raise ValueError(
                f"rANS frame {k} is context-conditioned: decode it with its context field "
                "(decode_bf16 for a BF16 sign_mantissa field)"
            )
        parts.append(b.add(fb, info, "rANS frame", k, k))
        sizes.append(info.n)
    rows = np.concatenate(parts) if parts else np.zeros((0, _WIDTH), np.int64)
    rows = rows[np.argsort(-rows[:, D_N], kind="stable")]
    if len(rows) % 2:
        rows = np.concatenate([rows, _padding_row()])
    pairs = rows.reshape(-1, 2, rows.shape[1])
    return b.finish(pairs, False, sizes, ("rANS frame", "rANS frame"))


def prepare_bf16(exp_frames: Sequence[bytes | memoryview | np.ndarray],
                 sm_frames: Sequence[bytes | memoryview | np.ndarray]) -> Batch:
    """A batch writing bf16 tensor k from ``exp_frames[k]`` and ``sm_frames[k]``.

    The two frames of a tensor must have the same symbol count and chunk size (the BF16
    format codes both fields with identical chunking); ``sm_frames[k]`` may be
    context-conditioned on the exponent, ``exp_frames[k]`` may not.
    """
    if len(exp_frames) != len(sm_frames):
        raise ValueError(f"{len(exp_frames)} exponent frames but {len(sm_frames)} sign_mantissa")
    b = _Builder()
    parts = []
    sizes = []
    for k, (ef, sf) in enumerate(zip(exp_frames, sm_frames, strict=True)):
        ei = _parse(ef, "exponent frame", k)
        si = _parse(sf, "sign_mantissa frame", k)
        if ei.cmap is not None:
            raise ValueError(f"exponent frame {k} is context-conditioned; it has no context")
        if (ei.n, ei.chunk_size) != (si.n, si.chunk_size):
            raise ValueError(
                f"tensor {k}: exponent frame has {ei.n} symbols in chunks of {ei.chunk_size}, "
                f"sign_mantissa frame {si.n} in chunks of {si.chunk_size}"
            )
        ea = b.add(ef, ei, "exponent frame", k, k)
        sa = b.add(sf, si, "sign_mantissa frame", k, k)
        parts.append(np.stack([ea, sa], axis=1))
        sizes.append(ei.n)
    pairs = np.concatenate(parts) if parts else np.zeros((0, 2, _WIDTH), np.int64)
    return b.finish(_longest_first(pairs), True, sizes,
                    ("exponent frame", "sign_mantissa frame"))


def _padding_row() -> np.ndarray:
    """A stream of 0 symbols; "raw" so that the kernel reads nothing for it."""
    row = np.zeros((1, _WIDTH), np.int64)
    row[0, D_MODE] = _frame.MODE_RAW
    row[0, D_CMAP] = -1
    row[0, _OUTPUT] = -1
    return row
