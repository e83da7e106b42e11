"""A field's order-0 codec choice and its static frame, in a few calls that let the GIL go.

What it is: ``code``, for the policies whose entropy coder is order-0 (``codecs.FAST``,
``GPU``, ``GPU_FAST``): what ``codecs.choose`` works out for a field before the zstd
trial, in one Numba kernel call: the spread-sample screen, the histogram, the entropy and
frame estimate, whether entropy coding pays, rANS or tANS and its table size (and a field
stored raw, its CRC-32). ``encode``: the frame ``coding.frame.encode`` writes for rANS
(one table, or one per context class) or tANS, in one call for the model (context
classes, quantized tables, the coder's tables) and one per group of chunks (each coded,
its CRC-32 and directory entry), not a few Python calls a chunk. The
arithmetic is the Python layers', operation for operation, so the choices and bytes are
the same; the thin caller compares the bid with zstd's and raw's.
What it is not: the policy's numbers (``codecs`` passes them as ``Knobs``), the choice
of a context-conditioned field (``CONDITIONED``: the caller makes it), or a decoder.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numba import njit

from ..coding import contexts, frame, tables
from ..coding.contexts import _choose, _class_counts
from ..coding.crc32 import _TABLE, _crc
from ..coding.parallel import run, spread
from ..coding.tables import _histogram, _quantize, _serialize, entropy_bits_exact
from ..formats._planes import split_planes
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


def code_planes(words: np.ndarray, sign_move: bool, rows: np.ndarray, k: Knobs
                ) -> tuple[np.ndarray, ...]:
    """``formats``' byte planes of ``words`` (W-byte integers, W >= 2, not empty) into
    ``rows`` (uint8[W, words.size]), and ``code`` of each plane without its context, in
    one call: ``code``'s six results as arrays with a row per plane (the histograms
    int64[W, 256])."""
    return _code_planes(words, sign_move, rows, k, _TABLE)


@njit(nogil=True, cache=True)
def _code_planes(words, sign_move, rows, k, crc_table):
    split_planes(words, sign_move, rows)
    m = rows.shape[0]
    found = np.empty(m, np.int64)
    bits = np.empty(m, np.float64)
    bid = np.empty(m, np.int64)
    param = np.empty(m, np.int64)
    crc = np.empty(m, np.uint64)
    counts = np.empty((m, 256), np.int64)
    for p in range(m):
        f, b, d, q, c, h = _code(rows[p], False, k, crc_table)
        found[p], bits[p], bid[p], param[p], crc[p] = f, b, d, q, c
        counts[p] = h[0]
    return found, bits, bid, param, crc, counts


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


def encode(symbols: np.ndarray, context: np.ndarray | Callable[[int, int], np.ndarray] | None,
           counts: np.ndarray, param: int, chunk_size: int, tans: bool,
           max_tables: int = contexts.DEFAULT_MAX_TABLES, prefix: bytes = b"") -> bytes:
    """``frame.encode`` of ``symbols`` (uint8, 1-D, contiguous, not empty) with the rANS
    coder (``tans``: the tANS coder, which takes no context), after ``prefix``: the same
    bytes, from one call for the tables and one for the chunks, or one per group of
    ``GROUP`` chunks where the pool's threads share them (or ``context`` is a function).
    ``counts``: the histogram, or with ``context`` the joint histogram; exact.
    ``context``: a value per symbol, or a function of (lo, hi) giving those of symbols
    lo..hi-1 (asked group by group)."""
    sym, n = _read_only(symbols), symbols.size
    rows = np.ascontiguousarray(counts, np.int64)
    shape = (256,) if context is None else (256, 256)
    if rows.shape != shape or int(rows.sum()) != n:  # as frame.encode checks them
        raise ValueError(f"counts must be int64{list(shape)} summing to the {n} symbols")
    rows = rows.reshape(-1, 256)
    if not rows.flags.writeable:  # one compile: as the kernel's own counts
        rows = rows.copy()
    section, cmap, rans_tab, symbol_tt, states = _tables(
        rows, context is not None, param, tans, max_tables, tables._log2f())
    n_chunks = -(-n // chunk_size)
    directory = np.empty(9 * n_chunks, np.uint8)
    groups = -(-n_chunks // GROUP)

    def chunks(first: int, last: int) -> np.ndarray:
        lo, hi = first * chunk_size, min(n, last * chunk_size)
        part = _NO_CTX  # contexts only where the frame has classes
        if cmap.size:
            part = context(lo, hi) if callable(context) else context[lo:hi]
            if part.size != hi - lo:
                raise ValueError(f"context has {part.size} values for {hi - lo} symbols")
            part = _read_only(np.ascontiguousarray(part, np.uint8))
        return _chunks(sym[lo:hi], part, cmap, rans_tab, symbol_tt, states, param,
                       chunk_size, tans, first, directory, _TABLE)

    def group(g: int) -> np.ndarray:
        return chunks(g * GROUP, min(n_chunks, (g + 1) * GROUP))

    if groups > 1 and spread(None) > 1:
        parts = run(group, groups, None)
    elif callable(context):  # its contexts made group by group, each in cache
        parts = [group(g) for g in range(groups)]
    else:  # on this thread alone: one call, one hand-off of the GIL
        parts = [chunks(0, n_chunks)]
    coder = tans_static.CODER if tans else rans_static.CODER
    head = frame.HEADER.pack(coder.magic, frame.VERSION, param, coder.lanes,
                             int(cmap.size > 0), n, chunk_size, n_chunks, section.size)
    return b"".join([prefix, head, section, directory, *parts])


GROUP = 8  # chunks coded in one call (2 Mi symbols of the default chunk)


def _read_only(a: np.ndarray) -> np.ndarray:
    # One compile: the kernels always get read-only arrays.
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@njit(nogil=True, cache=True)
def _tables(counts, conditional, param, use_tans, max_tables, log2f):
    # A static frame's model: its table section (``table_section``'s bytes), context map
    # (int64[256]; empty for one table) and the coder's tables, from the histogram (one
    # row), or where ``conditional`` the (context, symbol) joint, whose classes
    # ``contexts.choose`` gives (one table where it finds none).
    cmap = np.zeros(0, np.int64)
    rows = counts
    if conditional:
        classes = _choose(counts, max_tables)
        n_tables = 1 + classes.max()
        if n_tables > 1:
            cmap = classes.astype(np.int64)
        rows = _class_counts(counts, classes, n_tables)
    n_tables = rows.shape[0]
    head = 1 + 256 if cmap.size else 0
    section = np.empty(head + n_tables * _SECTION_MAX, np.uint8)
    if head:
        section[0] = n_tables - 1
        for c in range(256):
            section[1 + c] = cmap[c]
    end = head
    freqs = np.empty((n_tables, 256), np.int64)
    for r in range(n_tables):
        freqs[r] = _quantize(rows[r], param, log2f)
        end += _serialize(freqs[r], section[end:])
    rans_tab = np.empty((0 if use_tans else n_tables, 256, 2), np.uint64)
    symbol_tt = np.empty(256, np.int64)
    states = np.empty(1 << param if use_tans else 0, np.uint16)
    if use_tans:
        tans_table._encode_tables(freqs[0], param, symbol_tt, states)
    else:
        _encode_tables(freqs, param, rans_tab)
    return section[:end], cmap, rans_tab, symbol_tt, states


@njit(nogil=True, cache=True)
def _chunks(sym, ctx, cmap, rans_tab, symbol_tt, states, param, size, use_tans, first,
            directory, crc_table):
    # Chunks ``first``, ``first + 1``, .. of a frame, ``sym`` (and ``ctx``, where ``cmap``
    # has classes) holding their symbols: each coded, or stored where coding is not
    # smaller, its length, CRC-32 and mode written to its place in ``directory``; the
    # payloads back to back.
    n = sym.size
    n_chunks = directory.size // 9
    if (directory.size % 9 or first < 0 or first + -(-n // size) > n_chunks
            or ctx.size not in (0, n)):
        raise ValueError("chunks or contexts outside the frame's directory")
    out = np.empty(n + 8, np.uint8)  # 8 bytes of scratch a tANS chunk writes below it
    pos = 0
    for c in range(-(-n // size)):
        lo, hi = c * size, min(n, (c + 1) * size)
        part = sym[lo:hi]
        if use_tans:
            start = tans_kernels.encode_chunk(part, symbol_tt, states, param,
                                              out[pos : pos + hi - lo + 8])
        else:  # a context only where there are classes
            conditional = cmap.size > 0
            start = _encode_chunk(part, rans_tab, param, out[pos : pos + hi - lo],
                                  ctx[lo:hi] if conditional else ctx[0:0], cmap, conditional)
        if start < 0:  # not smaller than raw: the chunk is stored
            length, mode = hi - lo, frame.MODE_RAW
            out[pos : pos + length] = part
        else:  # the payload ends its scratch: moved down to its place
            length, mode = hi - lo + (8 if use_tans else 0) - start, frame.MODE_CODED
            for i in range(length):
                out[pos + i] = out[pos + start + i]
        at = first + c
        _put(directory, 4 * at, length, 4)
        _put(directory, 4 * (n_chunks + at), _crc(part, np.int64(0), crc_table), 4)
        directory[8 * n_chunks + at] = mode
        pos += length
    return out[:pos]


@njit(nogil=True, cache=True)
def _put(out, at, value, width):
    # ``value`` little-endian in ``width`` bytes at ``out[at]``.
    v = np.uint64(value)
    for i in range(width):
        out[at + i] = (v >> np.uint64(8 * i)) & np.uint64(0xFF)
