"""A field's order-0 codec choice, and a static frame, each in one call that lets the GIL go.

What it is: ``code``, for the policies whose entropy coder is order-0 (``codecs.FAST``,
``GPU``, ``GPU_FAST``): what ``codecs.choose`` works out for a field before the zstd
trial, in one Numba kernel call: the spread-sample screen, the histogram, the entropy and
frame estimate, whether entropy coding pays, rANS or tANS and its table size (and a field
stored raw, its CRC-32). ``encode``: the frame ``coding.frame.encode`` writes for rANS
(one table, or one per context class) or tANS, in one call: the context classes, the
quantized tables, every chunk coded with its CRC-32, the directory and header. The
arithmetic is the Python layers', operation for operation, so the choices and bytes are
the same; the thin caller compares the bid with zstd's and raw's.
What it is not: the policy's numbers (``codecs`` passes them as ``Knobs``), the choice
of a context-conditioned field (``CONDITIONED``: the caller makes it), or a decoder.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

from ..coding import contexts, frame, tables
from ..coding.contexts import _choose, _class_counts
from ..coding.crc32 import _TABLE, _crc
from ..coding.tables import _histogram, _quantize, _serialize, entropy_bits_exact
from ..rans import kernels as rans_kernels
from ..rans import static as rans_static
from ..rans.kernels import _encode_chunk, _encode_tables
from ..tans import kernels as tans_kernels
from ..tans import static as tans_static
from ..tans import table as tans_table

# What ``code`` found: stored raw by the sample screen, no bid (entropy coding does not
# pay), a rANS or tANS frame, or a field whose context the caller must code.
RAW, NO_BID, RANS, TANS, CONDITIONED = range(5)


class Knobs(NamedTuple):
    """A policy's numbers as the kernel reads them (``codecs.Policy`` says what each is);
    the products the Python policy computes are computed there, once, the same way."""

    raw_unless_pays: bool  # a field entropy coding does not pay on is stored raw
    screen: bool  # judge a field over ``screen_limit`` symbols on its spread sample first
    screen_limit: int
    block: int  # the spread sample: 4 blocks of this many symbols
    screen_bits: float  # the sample's bits per symbol above which the field is stored raw
    keep: float  # 1 - min_saving: the share of raw's size an estimate must come under
    keep_conditioned: float  # the same, for a field with a context
    tans: bool
    tans_gain: float
    rans_states: int  # bytes of lane states per chunk
    tans_states: int
    wide_symbols: int
    wide_max_bits: float
    priced: float  # 1 - cost: an entropy bid is its estimate over this
    precision: int
    wide_precision: int
    tans_log: int
    raw_overhead: int


_SECTION_MAX = tables._SERIAL_MAX  # one serialized table at most
RANS_MAGIC = np.frombuffer(rans_static.CODER.magic, np.uint8)
TANS_MAGIC = np.frombuffer(tans_static.CODER.magic, np.uint8)
_NO_CTX = rans_kernels._NO_CTX


def code(symbols: np.ndarray, conditioned: bool, k: Knobs
         ) -> tuple[int, float, int, int, int, np.ndarray]:
    """What the policy makes of ``symbols`` (uint8, 1-D, contiguous, not empty): (what it
    found, order-0 bits, bid, the param of its frame, the CRC-32 of the symbols where they
    are to be stored raw (else 0), histogram (int64[1, 256])). ``conditioned``: the policy
    codes the field with its context where entropy coding pays. The frame itself is
    ``encode``'s (a second call: one kernel holding both the choice and the coders
    would compile them twice over)."""
    if symbols.flags.writeable:
        symbols = _read_only(symbols)
    return _code(symbols, conditioned, k, _TABLE)


@njit(nogil=True, cache=True)
def _sample_bits(sym, block):
    # The order-0 bits per symbol of 4 spread blocks (``codecs._sample``).
    step = (sym.size - block) // 3
    counts = np.zeros(256, np.int64)
    for i in range(4):
        counts += _histogram(sym[i * step : i * step + block])
    return entropy_bits_exact(counts) / (4 * block)


@njit(nogil=True, cache=True)
def _code(sym, conditioned, k, crc_table):
    n = sym.size
    if k.screen and n > k.screen_limit:
        h = _sample_bits(sym, k.block)
        if h > k.screen_bits:
            crc = _crc(sym, np.int64(0), crc_table)
            return RAW, h * n, 0, 0, crc, np.zeros((1, 256), np.int64)
    counts = _histogram(sym).reshape(1, 256)
    bits = entropy_bits_exact(counts[0])
    present = 0
    for s in range(256):
        present += counts[0, s] > 0
    # The frame's expected size: entropy, table, header and chunk directory.
    chunks = -(-n // frame.DEFAULT_CHUNK)
    table = 1 + min(present, 32) + 2 * present
    estimate = int(bits / 8) + table + frame.HEADER_SIZE + 9 * chunks
    keep = k.keep_conditioned if conditioned else k.keep
    if not estimate <= keep * (n + k.raw_overhead):
        crc = _crc(sym, np.int64(0), crc_table) if k.raw_unless_pays else np.uint64(0)
        return NO_BID, bits, 0, 0, crc, counts
    if conditioned:
        return CONDITIONED, bits, 0, 0, np.uint64(0), counts
    wide = present > k.wide_symbols and bits < k.wide_max_bits * n
    use_tans = False
    if k.tans and not wide:
        gain = (k.rans_states - k.tans_states) * chunks
        use_tans = gain >= k.tans_gain * (estimate + k.rans_states * chunks)
    found = TANS if use_tans else RANS
    bid = int(estimate / k.priced)
    param = k.tans_log if use_tans else k.wide_precision if wide else k.precision
    return found, bits, bid, param, np.uint64(0), counts


def encode(symbols: np.ndarray, context: np.ndarray | None, counts: np.ndarray, param: int,
           chunk_size: int, tans: bool, max_tables: int = contexts.DEFAULT_MAX_TABLES,
           prefix: bytes = b"") -> np.ndarray:
    """``frame.encode`` of ``symbols`` (uint8, 1-D, contiguous, not empty) with the rANS
    coder (``tans``: the tANS coder, which takes no context), after ``prefix``, its chunks
    coded one after another in this call: the same bytes. ``counts``: the histogram, or
    with ``context`` (as many values as symbols) the joint histogram; exact."""
    sym, ctx = _read_only(symbols), _NO_CTX if context is None else _read_only(context)
    if ctx.size not in (0, sym.size):
        raise ValueError(f"context has {ctx.size} values, symbols have {sym.size}")
    rows = np.ascontiguousarray(counts, np.int64).reshape(-1, 256)
    return _frame(sym, ctx, rows, context is not None, param, chunk_size, tans, max_tables,
                  np.frombuffer(prefix, np.uint8), tables._log2f(), _TABLE)


def _read_only(a: np.ndarray) -> np.ndarray:
    # One compile: the kernels always get read-only arrays.
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@njit(nogil=True, cache=True)
def _frame(sym, ctx, counts, conditional, param, size, use_tans, max_tables, prefix, log2f,
           crc_table):
    # The frame ``frame.encode`` writes after ``prefix``: ``counts`` is the histogram (one
    # row), or where ``conditional`` the (context, symbol) joint, whose classes
    # ``contexts.choose`` gives; one table then where it finds none.
    n = sym.size
    cmap = np.zeros(0, np.int64)
    rows = counts
    if conditional:
        classes = _choose(counts, max_tables)
        n_tables = 1 + classes.max()
        if n_tables > 1:
            cmap = classes.astype(np.int64)
            rows = _class_counts(counts, classes, n_tables)
        else:
            rows = counts.sum(axis=0).reshape(1, 256)
    n_tables = rows.shape[0]
    n_chunks = -(-n // size)
    # Header, tables, directory, payloads (none larger than its chunk), and the 8 bytes
    # of scratch a tANS chunk writes below its payload.
    head = 1 + 256 if cmap.size else 0
    whole = np.empty(prefix.size + frame.HEADER_SIZE + head + n_tables * _SECTION_MAX
                     + 9 * n_chunks + n + 8, np.uint8)
    whole[: prefix.size] = prefix
    out = whole[prefix.size:]
    section = head
    freqs = np.empty((n_tables, 256), np.int64)
    for r in range(n_tables):
        freqs[r] = _quantize(rows[r], param, log2f)
        section += _serialize(freqs[r], out[frame.HEADER_SIZE + section:])
    if head:
        out[frame.HEADER_SIZE] = n_tables - 1
        for c in range(256):
            out[frame.HEADER_SIZE + 1 + c] = cmap[c]
    directory = frame.HEADER_SIZE + section
    pos = directory + 9 * n_chunks
    symbol_tt = np.empty(256, np.int64)
    states = np.empty(1 << param if use_tans else 0, np.uint16)
    tab = np.empty((n_tables, 256, 2), np.uint64)
    if use_tans:
        tans_table._encode_tables(freqs[0], param, symbol_tt, states)
    else:
        _encode_tables(freqs, param, tab)
    for c in range(n_chunks):
        lo, hi = c * size, min(n, (c + 1) * size)
        part = sym[lo:hi]
        if use_tans:
            start = tans_kernels.encode_chunk(part, symbol_tt, states, param,
                                              out[pos : pos + hi - lo + 8])
        else:  # a context only where there are classes
            conditional = cmap.size > 0
            start = _encode_chunk(part, tab, param, out[pos : pos + hi - lo],
                                  ctx[lo:hi] if conditional else ctx[0:0], cmap, conditional)
        if start < 0:  # not smaller than raw: the chunk is stored
            length, mode = hi - lo, frame.MODE_RAW
            out[pos : pos + length] = part
        else:  # the payload ends its scratch: moved down to its place
            length, mode = hi - lo + (8 if use_tans else 0) - start, frame.MODE_CODED
            for i in range(length):
                out[pos + i] = out[pos + start + i]
        _put(out, directory + 4 * c, length, 4)
        _put(out, directory + 4 * (n_chunks + c), _crc(part, np.int64(0), crc_table), 4)
        out[directory + 8 * n_chunks + c] = mode
        pos += length
    magic = TANS_MAGIC if use_tans else RANS_MAGIC
    for i in range(4):
        out[i] = magic[i]
    out[4] = frame.VERSION
    out[5] = param
    out[6] = tans_kernels.LANES if use_tans else rans_kernels.LANES
    out[7] = cmap.size > 0  # the context flag
    _put(out, 8, n, 8)
    _put(out, 16, size, 4)
    _put(out, 20, n_chunks, 4)
    _put(out, 24, section, 4)
    return whole[: prefix.size + pos]


@njit(nogil=True, cache=True)
def _put(out, at, value, width):
    # ``value`` little-endian in ``width`` bytes at ``out[at]``.
    v = np.uint64(value)
    for i in range(width):
        out[at + i] = (v >> np.uint64(8 * i)) & np.uint64(0xFF)
