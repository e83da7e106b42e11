"""The "rans2d" field codec: rows and columns in classes, and an rANS frame conditioned on them.

What it is: the whole codec as ``codecs.CODECS`` registers it (``CODEC``): its bid for a
field of one symbol per element of a row-major 2-D tensor (BF16 exponents, F16 high bytes,
fp8 bytes), the choice of row and column classes expected to code it smallest (``plan``),
and the payload that stores the class maps next to an rANS frame whose context is each
symbol's class (``encode`` / ``decode`` / ``count``). What it is not: the line-class model
itself, ``coding/lines.py``: assigning lines to classes, each symbol's context and the
estimate of a classed frame are statistics of symbols, beside the frame layer's other
models, and know nothing of this payload; this module owns the payload and when it pays.

Payload (little-endian):

    offset  size  field
    0       4     magic b"EK2D"
    4       1     version = 1
    5       1     kr: row classes, 1..16 (1: rows not classed, no row map)
    6       1     kc: column classes, 1..16 (1: columns not classed, no column map)
    7       1     reserved, 0
    8       8     n: symbols
    16      8     cols: symbols per row, >= 1
    24      8     phase: column of the first symbol, < cols
    32      ...   row map: lines.n_rows(n, cols, phase) classes, lines.pack(kr);
                  column map: cols classes, lines.pack(kc)
    then an rANS frame of the n symbols whose context is row class * kc + column class.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._errors import CorruptDataError
from ..coding import crc32, frame, lines, tables
from ..rans import static as rans_static
from . import order0

if TYPE_CHECKING:
    from .codecs import Bid, Field

MAGIC = b"EK2D"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBQQQ")
HEADER_SIZE = _HEAD.size  # 32
K = 4  # classes per classed axis: more gain little and cost larger maps and tables
MAX_TABLES = K * K  # tables a frame may use: one per (row class, column class)
MIN_SYMBOLS = 1 << 12  # smaller fields cannot pay for maps and tables
_MAX_BITS = 7.5  # near-uniform fields (mantissa bytes) gain nothing from classes: no plan


@dataclass(frozen=True)
class Plan:
    """A chosen classing: classes per axis, the maps and the estimated payload bytes."""

    kr: int
    kc: int
    rows: np.ndarray | None  # uint8 class per row touched; None when kr == 1
    columns: np.ndarray | None  # uint8 class per column; None when kc == 1
    joint: np.ndarray  # int64[256, 256] (context, symbol) counts, for the frame
    estimate: int


def _estimate(joint: np.ndarray, n: int, cols: int, phase: int, kr: int, kc: int) -> int:
    chunks = -(-n // frame.DEFAULT_CHUNK)
    maps = lines.map_bytes(lines.n_rows(n, cols, phase), kr) + lines.map_bytes(cols, kc)
    return (int(lines.estimate_bits(joint, MAX_TABLES) / 8) + HEADER_SIZE + maps
            + frame.HEADER_SIZE + (9 + 4 * rans_static.CODER.lanes) * chunks)


def plan(symbols: np.ndarray, cols: int, phase: int, counts: np.ndarray | None = None
         ) -> Plan | None:
    """The classing with the smallest estimated payload among rows in ``K`` classes,
    columns in ``K`` classes, and both; None where the field is too small or its lines
    too many. ``counts``: the symbols' histogram, when the caller has it.

    Two passes over the field: the line histograms (of ``lines.buckets``), then the
    joint histogram of the symbols and their contexts with both axes classed, from which
    the one-axis joints are sums."""
    n = symbols.size
    if n < MIN_SYMBOLS or not 0 <= phase < cols or cols < 2:
        return None
    index, magnitude = lines.buckets(tables.histogram(symbols) if counts is None else counts)
    width = max(1, magnitude.size)
    rows = lines.n_rows(n, cols, phase)
    # An axis is classed where its lines hold at least as many symbols as their histograms
    # have buckets: shorter lines say little about their class, and the histograms and
    # Lloyd passes stay within the field's size (a last dimension of 2 would not).
    by_rows = rows >= 2 and rows * width <= n
    by_cols = cols * width <= n
    if not (by_rows or by_cols):
        return None
    hr, hc = lines.line_histograms(symbols, index, width, cols, phase, by_rows, by_cols)
    rcls = lines.assign(hr, magnitude, K) if by_rows else None
    ccls = lines.assign(hc, magnitude, K) if by_cols else None
    kr, kc = (K if by_rows else 1), (K if by_cols else 1)
    joint = lines.context_counts(symbols, cols, phase, rcls, ccls, kc)
    best = Plan(kr, kc, rcls, ccls, joint, _estimate(joint, n, cols, phase, kr, kc))
    if by_rows and by_cols:
        per = joint[: K * K].reshape(K, K, 256)
        for one_kr, one_kc, part in ((K, 1, per.sum(axis=1)), (1, K, per.sum(axis=0))):
            one = np.zeros((256, 256), np.int64)
            one[:K] = part
            size = _estimate(one, n, cols, phase, one_kr, one_kc)
            if size < best.estimate:
                best = Plan(one_kr, one_kc, rcls if one_kr > 1 else None,
                            ccls if one_kc > 1 else None, one, size)
    return best


def encode(symbols: np.ndarray, cols: int, phase: int, p: Plan, precision: int,
           chunk_size: int = frame.DEFAULT_CHUNK) -> bytes:
    """The payload of ``symbols`` classed as ``p`` says (its frame in chunks of
    ``chunk_size``)."""
    # The contexts are made chunk by chunk as the frame codes them (in cache).
    ctx = lines.context_source(symbols.size, cols, phase, p.rows, p.columns, p.kc)
    head = _HEAD.pack(MAGIC, VERSION, p.kr, p.kc, 0, symbols.size, cols, phase)
    maps = (b"" if p.rows is None else lines.pack(p.rows, p.kr)) + (
        b"" if p.columns is None else lines.pack(p.columns, p.kc))
    # The frame is joined after the head and maps: the payload is copied once, not twice.
    if crc32.ACCELERATED and symbols.size:  # a call per group of chunks
        return order0.encode(symbols, ctx, p.joint, precision, chunk_size, False, MAX_TABLES,
                             head + maps)
    return frame.encode(rans_static.CODER, symbols, precision, chunk_size, None, ctx,
                        max_tables=MAX_TABLES, counts=p.joint, prefix=head + maps)


class _Rans2d:
    name = "rans2d"
    states = 4 * rans_static.CODER.lanes

    def estimate(self, f: Field, rival: int) -> Bid | None:
        """A plan's estimate where it saves the policy's ``classed_min_saving`` of the
        plain entropy coder's; None for a field without a grid, with a context, that
        entropy coding does not pay on, or near-uniform."""
        if (f.grid is None or f.context is not None or not f.pays
                or f.bits >= _MAX_BITS * f.n):
            return None
        from .codecs import Bid  # codecs imports this module
        p = plan(f.symbols, *f.grid, f.counts)
        if p is None or p.estimate > (1 - f.policy.classed_min_saving) * f.plain:
            return None
        grid, precision = f.grid, f.policy.wide_precision if f.wide else f.policy.precision
        return Bid(p.estimate, lambda: encode(f.symbols, *grid, p, precision))

    def encode(self, symbols: np.ndarray, context: np.ndarray | None, precision: int,
               chunk_size: int, counts: np.ndarray | None) -> bytes:
        raise ValueError("rans2d payloads are made by its bid (they need the tensor's grid)")

    def count(self, data: np.ndarray) -> int:
        return count(data)

    def decode(self, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
        return decode(data, n)  # self-contained: its contexts are in its own payload


CODEC = _Rans2d()


def count(data: np.ndarray) -> int:
    """Symbols the payload says it holds; CorruptDataError if its header is unreadable."""
    if data.size < HEADER_SIZE:
        raise CorruptDataError(f"rans2d payload truncated: {data.size} bytes")
    return int(data[8:16].view("<u8")[0])


@dataclass(frozen=True)
class Parsed:
    """A checked payload's classing: its rANS frame is ``data[body:]``; symbol i of the
    field sits at row ``(phase + i) // cols``, column ``(phase + i) % cols`` and is coded
    with context ``rows[row] * kc + columns[column]`` (a None map: class 0)."""

    kr: int
    kc: int
    cols: int
    phase: int
    rows: np.ndarray | None
    columns: np.ndarray | None
    body: int


def parse(data: np.ndarray, n: int) -> Parsed:
    """The header and class maps of a payload of ``n`` symbols, checked (the frame after
    them is not parsed); CorruptDataError saying what is wrong."""
    if data.size < HEADER_SIZE:
        raise CorruptDataError(f"rans2d payload truncated: {data.size} bytes")
    magic, version, kr, kc, reserved, got, cols, phase = _HEAD.unpack(
        data[:HEADER_SIZE].tobytes())
    if magic != MAGIC or version != VERSION or reserved:
        raise CorruptDataError(f"rans2d payload header: magic {magic!r} version {version}")
    if got != n:
        raise CorruptDataError(f"rans2d payload holds {got} symbols (byte 8), field has {n}")
    if not (1 <= kr <= lines.MAX_CLASSES and 1 <= kc <= lines.MAX_CLASSES and kr * kc >= 2):
        raise CorruptDataError(f"rans2d payload: {kr} row and {kc} column classes (byte 5)")
    if not 0 <= phase < cols < 1 << 62:
        raise CorruptDataError(f"rans2d payload: phase {phase} not below {cols} columns")
    # Python integers: a hostile cols or n must not overflow into a plausible size.
    rows = lines.n_rows(n, cols, phase)
    row_bytes = lines.map_bytes(rows, kr)
    col_bytes = lines.map_bytes(cols, kc)
    start = HEADER_SIZE + row_bytes + col_bytes
    if start > data.size:
        raise CorruptDataError(f"rans2d payload truncated in its class maps: {start} bytes "
                               f"needed, {data.size} present")
    rcls = ccls = None
    if kr > 1:
        rcls = lines.unpack(data[HEADER_SIZE : HEADER_SIZE + row_bytes], rows, kr)
        if rcls is None:
            raise CorruptDataError(f"rans2d payload: row class map at byte {HEADER_SIZE} "
                                   f"names a class >= {kr} or sets padding bits")
    if kc > 1:
        ccls = lines.unpack(data[HEADER_SIZE + row_bytes : start], cols, kc)
        if ccls is None:
            raise CorruptDataError(f"rans2d payload: column class map at byte "
                                   f"{HEADER_SIZE + row_bytes} names a class >= {kc} or "
                                   "sets padding bits")
    return Parsed(kr, kc, cols, phase, rcls, ccls, start)


def decode(data: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` symbols of a payload; CorruptDataError saying what is wrong."""
    p = parse(data, n)
    body = data[p.body:]
    try:
        info = frame.parse(rans_static.CODER, body, max_output=n)
        # Each symbol's table index straight from the maps (cmap folded into the row
        # patterns): the kernel skips its cmap lookup; made group by group as the chunks
        # decode (in cache). A one-table frame needs no context.
        ctx = None if info.cmap is None else lines.context_source(
            n, p.cols, p.phase, p.rows, p.columns, p.kc, info.cmap)
        return frame.decode(rans_static.CODER, body, None, np.empty(n, np.uint8), ctx,
                            info=info, mapped=True)
    except CorruptDataError as e:
        raise CorruptDataError(f"rans2d frame: {e}") from None
    except ValueError as e:
        raise CorruptDataError(f"rans2d frame: {e}") from None
