"""Numba kernels of the static 32-lane interleaved rANS coder (chunk by chunk).

Invariants (ryg_rans with 16-bit words):
    state x in [L, 2**32), L = 2**16; probabilities f_s / 2**p, p = precision (8..15).
    encode s:  if x >= f_s << (32 - p): emit x & 0xffff, x >>= 16      (at most once)
               x = (x // f_s) << p | (x % f_s) + c_s
    decode:    slot = x & (2**p - 1); s = sym[slot]
               x = f_s * (x >> p) + slot - c_s
               if x < L: x = x << 16 | next word                        (at most once)
Symbol i of a chunk belongs to lane i % 32. The encoder runs backwards and writes words
from the end of its buffer down, so the payload reads forwards in the exact order a
32-lane decoder consumes it: step by step, lanes 0..31, each lane that needs a word takes
the next one. Payload = 32 u32 decoder start states, then the u16 words.

Encoding divides through a per-symbol reciprocal (Granlund-Montgomery, as ryg_rans'
RansEncSymbol): with shift = ceil(log2 f) and m = ceil(2**(32+shift) / f) = 2**32 + rcp,
0 <= rcp < 2**32, the quotient x // f = (x + (x * rcp >> 32)) >> shift exactly for every
x < 2**32, in 64-bit arithmetic. Whole steps are encoded as vector code too.
Decoding looks up one packed u64 per slot: bias | freq << 16 | sym << 32, bias = slot - c_s;
whole steps run as vector code (``simd.decode_step``), the chunk's last words in scalar code.
Every buffer access is checked against the buffer's end; errors come back as codes.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .._status import (
    ERR_BOUNDS,
    ERR_CONTEXT,
    ERR_FINAL,
    ERR_TABLE,
    ERR_TRAILING,
    ERR_TRUNCATED,
    OK,
    Status,
    messages,
)
from .lanes import LANES, STATE_BYTES, L, put_states, read_states
from .simd import byte_lut, decode_step, encode_step

MESSAGES = messages(Status.STATE, Status.TRUNCATED, Status.TRAILING, Status.FINAL, Status.ODD,
                    Status.CONTEXT, Status.BOUNDS, Status.TABLE)


@njit(nogil=True, cache=True)
def _encode_tables(f, precision, t):
    # One pass per table; shift = ceil(log2 f) is the bit length of f - 1 (0 for f = 1).
    for k in range(f.shape[0]):
        start = 0
        for s in range(256):
            fs = f[k, s]
            if fs == 0:
                t[k, s, 0] = 0
                t[k, s, 1] = 0
                continue
            shift = 0
            while (fs - 1) >> shift:
                shift += 1
            rcp = ((np.int64(1) << (32 + shift)) + fs - 1) // fs - (np.int64(1) << 32)
            xmax_m1 = (fs << (32 - precision)) - 1
            t[k, s, 0] = np.uint64(rcp) | (np.uint64(xmax_m1) << np.uint64(32))
            t[k, s, 1] = np.uint64(fs | (start << 16) | (shift << 32))
            start += fs


def encode_tables(freqs: np.ndarray, precision: int) -> np.ndarray:
    """Packed encoder records, uint64[n_tables, 256, 2].

    [..., 0] = rcp | (xmax - 1) << 32 and [..., 1] = freq | start << 16 | shift << 32, with
    xmax = freq << (32 - precision) the renormalization bound. Absent symbols are all 0.
    ``freqs`` (int[256] or int[n_tables, 256]) each sum to ``2**precision``.
    """
    f = _rows(freqs)
    _check_tables(f, precision)
    t = np.empty(f.shape + (2,), np.uint64)
    _encode_tables(f, precision, t)
    return t


@njit(nogil=True, cache=True)
def _decode_table(f, entries):
    # Slots c_s .. c_s + f_s - 1 hold s; the row sums are the table size (checked).
    for k in range(f.shape[0]):
        slot = 0
        for s in range(256):
            packed = (np.int64(s) << 32) | (f[k, s] << 16)
            for bias in range(f[k, s]):
                entries[k, slot] = np.uint64(packed | bias)
                slot += 1


def decode_table(freqs: np.ndarray, precision: int) -> np.ndarray:
    """Packed decode entries, uint64[n_tables, 2**precision]: bias | freq << 16 | sym << 32.

    ``freqs`` as for ``encode_tables``.
    """
    f = _rows(freqs)
    _check_tables(f, precision)
    entries = np.empty((f.shape[0], 1 << precision), np.uint64)
    _decode_table(f, entries)
    return entries


def _rows(freqs: np.ndarray) -> np.ndarray:
    # np.atleast_2d, without its three Python-level calls.
    f = np.ascontiguousarray(freqs, dtype=np.int64)
    return f[None] if f.ndim < 2 else f


def _check_tables(f: np.ndarray, precision: int) -> None:
    # The kernels index and size their output by these facts; ValueError, never a bad write.
    if (f.ndim != 2 or f.shape[1] != 256 or not 8 <= precision <= 15
            or not _rows_sum_to(f, 1 << precision)):
        raise ValueError(f"freqs must be rows of 256 non-negative counts summing to "
                         f"2**{precision} (precision 8..15)")


@njit(cache=True)
def _rows_sum_to(f, total):
    # One call where numpy took four. It keeps the GIL: a check this small costs less than
    # letting the GIL go and waiting for it again while other threads hold it.
    for k in range(f.shape[0]):
        row = 0
        for s in range(f.shape[1]):
            if not 0 <= f[k, s] <= total - row:  # no sum can wrap
                return False
            row += f[k, s]
        if row != total:
            return False
    return True


@njit(nogil=True, cache=True)
def _encode_symbol(x, lane, s, k, tab, precision, out, pos):
    """Scalar encode of one symbol into lane ``lane``; return the new pos, or -1 if full."""
    r0 = tab[k, s, 0]
    r1 = tab[k, s, 1]
    xs = np.uint64(x[lane])
    if xs > (r0 >> np.uint64(32)):
        if pos - 2 < STATE_BYTES:
            return -1
        pos -= 2
        out[pos] = xs & np.uint64(0xFF)
        out[pos + 1] = (xs >> np.uint64(8)) & np.uint64(0xFF)
        xs >>= np.uint64(16)
    f = r1 & np.uint64(0xFFFF)
    q = (xs + ((xs * (r0 & np.uint64(0xFFFFFFFF))) >> np.uint64(32))) >> (r1 >> np.uint64(32))
    start = (r1 >> np.uint64(16)) & np.uint64(0xFFFF)
    x[lane] = np.uint32((q << np.uint64(precision)) + (xs - q * f) + start)
    return pos


def read_only(a: np.ndarray | None) -> np.ndarray | None:
    """``a`` as a read-only array (a view where it is writable; None stays None): Numba
    compiles a kernel apart for read-only and writable arguments, so callers pass one."""
    if a is not None and a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


_NO_CTX = read_only(np.zeros(0, np.uint8))
_NO_CMAP = read_only(np.zeros(0, np.int64))


def encode_chunk(sym, tab, precision, out, ctx, cmap):
    """Encode ``sym`` into ``out``; return the payload's start offset in ``out``, or -1.

    ``tab`` is ``encode_tables``' uint64[n_tables, 256, 2]. ``ctx`` is None (table 0 for
    every symbol) or the context value of each symbol (uint8, same size), and then symbol
    i uses table ``cmap[ctx[i]]`` (``cmap`` int64[256], checked against the tables). The
    payload is ``out[start:]``: 128 bytes of states then the words. -1 means it did not
    fit in ``out`` (the caller stores raw) or the context does not fit.
    """
    if ctx is None:  # one argument type for both cases: the kernel compiles once
        return _encode_chunk(sym, tab, precision, out, _NO_CTX, _NO_CMAP, False)
    if cmap is None:
        raise ValueError("a context needs its context map (cmap)")
    return _encode_chunk(sym, tab, precision, out, read_only(ctx), read_only(cmap), True)


@njit(nogil=True, cache=True)
def _encode_chunk(sym, tab, precision, out, ctx, cmap, conditional):
    """``encode_chunk``, with ``ctx`` and ``cmap`` used only when ``conditional``."""
    n = sym.size
    if conditional:
        if (ctx.size != n or cmap.size != 256 or cmap.min() < 0
                or cmap.max() >= tab.shape[0]):
            return -1
    x = np.full(LANES, L, np.uint32)
    pos = out.size  # words are written downward, ending at out.size
    full = n - n % LANES
    k = 0
    for i in range(n - 1, full - 1, -1):  # the last, partial step
        if conditional:
            k = cmap[ctx[i]]
        pos = _encode_symbol(x, i - full, sym[i], k, tab, precision, out, pos)
        if pos < 0:
            return -1
    for base in range(full - LANES, -1, -LANES):
        if pos - 2 * LANES >= STATE_BYTES:
            # The vector step is built for one case: both are here, chosen per step.
            if conditional:
                pos = encode_step(x, tab, precision, ctx, cmap, base, sym, out, pos)
            else:
                pos = encode_step(x, tab, precision, None, None, base, sym, out, pos)
            continue
        for lane in range(LANES - 1, -1, -1):
            if conditional:
                k = cmap[ctx[base + lane]]
            pos = _encode_symbol(x, lane, sym[base + lane], k, tab, precision, out, pos)
            if pos < 0:
                return -1
    if pos < STATE_BYTES:
        return -1
    pos -= STATE_BYTES
    put_states(x, out, pos)
    return pos


@njit(nogil=True, cache=True)
def _finish(x, buf, ptr, end, base, hi, table, precision, out, ctx, cmap):
    """Decode ``out[base:hi]`` from states ``x`` and the words at ``buf[ptr:end]``, then check
    that the stream and the states end exactly as the encoder began; an error code."""
    mask = (1 << precision) - 1
    k = 0
    while base < hi:
        step = min(LANES, hi - base)
        if step == LANES and end - ptr >= 2 * LANES:
            # Fast path: a whole step reads at most 32 words, all inside the payload.
            ptr = decode_step(x, table, precision, ctx, cmap, base, out, buf, ptr)
        else:
            for lane in range(step):
                if ctx is not None:
                    k = ctx[base + lane] if cmap is None else cmap[ctx[base + lane]]
                xs = x[lane]
                e = table[k, xs & mask]
                out[base + lane] = np.uint8(e >> 32)
                xs = np.uint32((e >> 16) & 0xFFFF) * (xs >> precision) + np.uint32(e & 0xFFFF)
                if xs < L:
                    if ptr + 2 > end:
                        return ERR_TRUNCATED
                    xs = (xs << 16) | np.uint32(buf[ptr]) | (np.uint32(buf[ptr + 1]) << 8)
                    ptr += 2
                x[lane] = xs
        base += step
    if ptr != end:
        return ERR_TRAILING
    for lane in range(LANES):
        if x[lane] != L:
            return ERR_FINAL
    return OK


@njit(nogil=True, cache=True)
def _steps(x, table, precision, ctx, cmap, out, buf, ptr, base, live, safe):
    # ``safe`` whole steps of each chunk of ``live``, in turn (decode_chunks' invariant).
    for _ in range(safe):
        for j in live:
            ptr[j] = decode_step(x[j], table, precision, ctx, cmap, base[j], out, buf, ptr[j])
            base[j] += LANES


@njit(nogil=True, cache=True)
def _runs(x, table, precision, ctx, cmap, out, buf, ptr, base, starts, lengths, hi, errors,
          bad_context):
    # decode_chunks' steps where the AVX-512 step runs (``byte_lut``). A step reads at most
    # 64 bytes, so each live chunk can take ``safe`` steps in a row without a check: the
    # checks are made once per run of steps, not once per step (the AVX2 step is faster
    # with them per step, and keeps them so). A context map is looked up as 256 bytes (every
    # value a table index, < 256 tables: checked by the caller and here).
    g = starts.size
    lut = np.zeros(256, np.uint8)
    use_lut = False
    if ctx is not None and cmap is not None:
        use_lut = not bad_context and table.shape[0] <= 256
        if use_lut:
            for v in range(256):
                lut[v] = cmap[v]
    live = np.empty(g, np.int64)
    while g > 1:  # one chunk: _finish has the same fast path, without the arrays
        safe = np.int64(0)
        n_live = 0
        for j in range(g):
            if errors[j] == OK:
                s = min((hi[j] - base[j]) // LANES,
                        (starts[j] + lengths[j] - ptr[j]) // (2 * LANES))
                if s > 0:
                    live[n_live] = j
                    n_live += 1
                    safe = s if n_live == 1 else min(safe, s)
        if n_live == 0:
            break
        if cmap is None:  # pruned by type: no byte-map step for a case without a map
            _steps(x, table, precision, ctx, cmap, out, buf, ptr, base, live[:n_live], safe)
        elif use_lut:
            _steps(x, table, precision, ctx, lut, out, buf, ptr, base, live[:n_live], safe)
        else:
            _steps(x, table, precision, ctx, cmap, out, buf, ptr, base, live[:n_live], safe)


@njit(nogil=True, cache=True)
def decode_chunks(buf, starts, lengths, table, precision, out, ctx, cmap, lo, hi, errors):
    """Decode chunk j's payload ``buf[starts[j]:starts[j]+lengths[j]]`` into
    ``out[lo[j]:hi[j]]`` for every j together; its error code goes to ``errors[j]``.

    ``table`` is uint64[n_tables, 2**precision]. ``ctx`` is None (table 0 for every
    symbol) or the context value of each symbol of ``out`` (uint8, same size), and then
    symbol i uses table ``cmap[ctx[i]]`` (``cmap`` int64[256], checked against the
    tables), or with ``cmap`` None table ``ctx[i]`` itself (every value checked). The
    chunks' whole steps are taken in turn, so their independent dependency chains
    (gather, multiply, refill) overlap in the CPU.
    """
    g = starts.size
    x = np.empty((g, LANES), np.uint32)
    ptr = np.empty(g, np.int64)
    base = np.empty(g, np.int64)
    bad_context = False
    if ctx is not None:
        if cmap is None:
            bad_context = ctx.size != out.size or (ctx.size and ctx.max() >= table.shape[0])
        else:
            bad_context = (ctx.size != out.size or cmap.size != 256 or cmap.min() < 0
                           or cmap.max() >= table.shape[0])
    for j in range(g):
        if not 0 <= lo[j] <= hi[j] <= out.size:
            errors[j] = ERR_BOUNDS
            continue
        if table.shape[1] != 1 << precision:
            errors[j] = ERR_TABLE
            continue
        if bad_context:
            errors[j] = ERR_CONTEXT
            continue
        errors[j] = read_states(buf, starts[j], lengths[j], x[j])
        ptr[j] = starts[j] + STATE_BYTES
        base[j] = lo[j]
    # Invariant of a step taken here: 32 symbols left in the chunk and 64 bytes of payload
    # left at ptr, so the unchecked vector step stays inside out, ctx and the payload.
    if byte_lut():  # a constant of the target: LLVM keeps one of the two loops
        _runs(x, table, precision, ctx, cmap, out, buf, ptr, base, starts, lengths, hi,
              errors, bad_context)
    else:
        busy = g > 1  # one chunk: _finish has the same fast path, without the arrays
        while busy:
            busy = False
            for j in range(g):
                if (errors[j] == OK and hi[j] - base[j] >= LANES
                        and starts[j] + lengths[j] - ptr[j] >= 2 * LANES):
                    ptr[j] = decode_step(x[j], table, precision, ctx, cmap, base[j], out, buf,
                                         ptr[j])
                    base[j] += LANES
                    busy = True
    for j in range(g):
        if errors[j] == OK:
            errors[j] = _finish(x[j], buf, ptr[j], starts[j] + lengths[j], base[j], hi[j],
                                table, precision, out, ctx, cmap)


def decode_chunk(buf, start, length, table, precision, out, ctx, cmap):
    """Decode ``out.size`` symbols from ``buf[start:start+length]``; return an error code.

    ``table`` is uint64[n_tables, 2**precision]; ``ctx`` and ``cmap`` as in
    ``encode_chunk``. One chunk of ``decode_chunks``.
    """
    errors = np.empty(1, np.int64)
    decode_chunks(buf, np.array([start], np.int64), np.array([length], np.int64), table,
                  precision, out, ctx, cmap, np.zeros(1, np.int64),
                  np.array([out.size], np.int64), errors)
    return int(errors[0])
