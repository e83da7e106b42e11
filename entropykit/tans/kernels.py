"""Numba kernels of the FSE-style 4-state tANS coder (one chunk per call).

Tables and state conventions are in ``tans/table.py``: ``R`` = table log (9..12),
``size = 2**R``, decoder state ``u`` in ``[0, size)``, encoder state ``X = size + u``.

Interleaving: symbol ``i`` of a chunk belongs to state (lane) ``i % 4``. The decoder works
in steps of 4 symbols (lanes 0, 1, 2, 3); a chunk whose length is not a multiple of 4 ends
with a short step of lanes ``0 .. n % 4 - 1``. The encoder runs the exact reverse.

Payload layout (one chunk; normative copy in docs/format.md). The payload is one
bit-stream ``B`` of ``8 * length`` bits, read forward, least significant bit first: bit
``j`` of ``B`` is bit ``j % 8`` of payload byte ``j // 8``. A field of ``w`` bits read at
position ``j`` has bit ``j`` as its least significant bit. In reading order ``B`` holds:

    1. 0..7 zero padding bits, then one 1 bit (the marker): the decoder starts after the
       lowest set bit of byte 0, so byte 0 must not be 0.
    2. The four initial decoder states ``u_0 .. u_3``, ``R`` bits each, lane 0 first.
    3. For every symbol in decoding order (steps in order, lanes 0..3 within a step): the
       ``nb`` bits that complete the lane's next state, ``u = base + bits`` (``base`` and
       ``nb`` from the decode entry of the symbol just emitted; ``nb`` may be 0).
    4. Nothing else: the stream ends exactly at the end of the last byte (its most
       significant bit is the last bit of item 3, or of item 2 if item 3 has no bits).

The encoder starts every lane at ``X = size`` (``u = 0``), so a correct decode ends with
all four states at 0; unused lanes of a chunk shorter than 4 symbols stay 0 throughout.
Per symbol, in reverse order: emit the low ``nb`` bits of ``X``, ``X = next state``
(``table.py``). It builds ``B`` backwards, prepending each field: a 64-bit accumulator
holds the not yet written low end of ``B`` (< 8 bits between steps); after every step its
whole bytes go to the output below those already written. At the end it prepends the four
states (lane 3 first, so lane 0 is read first), the marker bit and the padding. A
payload that would not be shorter than the chunk is not produced (the frame stores the
chunk raw).

Decoding reads one unaligned little-endian u64 per step (at most 7 + 4 * 12 = 55 bits of it
are used); within 8 bytes of the payload's end the missing bytes read as 0 and the bit
position is checked against the end after every step, so reads never leave the payload.
Every state the decoder can reach is a valid table index (``table.py``), so the only
checks are: marker present, stream not exhausted, no trailing bits, final states all 0.
"""

from __future__ import annotations

import sys

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .._status import (
    ERR_BOUNDS,
    ERR_EMPTY,
    ERR_FINAL,
    ERR_MARKER,
    ERR_TABLE,
    ERR_TRAILING,
    ERR_TRUNCATED,
    OK,
    Status,
    messages,
)

LANES = 4

MESSAGES = messages(Status.EMPTY, Status.MARKER, Status.TRUNCATED, Status.TRAILING,
                    Status.FINAL, Status.BOUNDS, Status.TABLE)


def _le64_ptr(context, builder, ary_type, ary, p, p_type):
    data = context.make_array(ary_type)(context, builder, ary).data
    idx = context.cast(builder, p, p_type, types.intp)
    return builder.bitcast(builder.gep(data, [idx]), ir.IntType(64).as_pointer())


def _to_le(builder, v):
    return builder.bswap(v) if sys.byteorder == "big" else v


@intrinsic
def _load64(typingctx, buf, p):
    """Little-endian u64 (as int64) at byte p of a uint8 array; the caller checks bounds.

    One unaligned load: Numba's byte-by-byte form keeps per-byte index checks in the loop.
    """

    def codegen(context, builder, sig, args):
        ptr = _le64_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _to_le(builder, builder.load(ptr, align=1))

    return types.int64(buf, p), codegen


@intrinsic
def _store64(typingctx, buf, p, v):
    """Store int64 v little-endian at byte p of a uint8 array; the caller checks bounds."""

    def codegen(context, builder, sig, args):
        ptr = _le64_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        builder.store(_to_le(builder, val), ptr, align=1)
        return context.get_dummy_value()

    return types.void(buf, p, v), codegen


@njit(nogil=True, cache=True)
def _peek(buf, p, end):
    # The 8 bytes at p as a little-endian integer; bytes at or past end read as 0.
    if p + 8 <= end:
        return _load64(buf, p)
    v = np.int64(0)
    for k in range(end - p):
        v |= np.int64(buf[p + k]) << (8 * k)
    return v


@njit(nogil=True, cache=True)
def _put(x, tt, state_table, acc):
    # Encode one symbol: prepend the low nb bits of X to the stream, move to the next state.
    nb = (x + (tt >> 32)) >> 16
    acc = (acc << nb) | (x & ((1 << nb) - 1))
    # The low field is c_s - f_s as int32. The index is >= 0 (X >> nb >= f_s); as uint64
    # Numba adds no negative-index fix-up.
    x = np.int64(state_table[np.uint64((x >> nb) + np.int64(np.int32(tt & 0xFFFFFFFF)))])
    return x, acc, nb


@njit(nogil=True, cache=True)
def _get(x, c, dtable, out, i):
    # Decode one symbol from state x; c holds the stream from this symbol's bits on.
    # x and i are >= 0 (x a table slot): as uint64 indices they need no negative-index fix-up.
    e = np.int64(dtable[np.uint64(x)])
    out[np.uint64(i)] = e & 0xFF
    nb = (e >> 8) & 0xFF
    return (e >> 16) + (c & ((1 << nb) - 1)), c >> nb, nb


@njit(nogil=True, cache=True)
def _flush(acc, nacc, out, pos):
    # Write the accumulator's whole bytes (its high end) just below out[pos]. One 8-byte
    # store ending at pos; the bytes below the new pos it touches are rewritten later.
    nbytes = nacc >> 3
    rem = nacc & 7
    _store64(out, pos - 8, ((acc >> rem) << 1) << (63 - 8 * nbytes))
    return acc & ((1 << rem) - 1), rem, pos - nbytes


@njit(nogil=True, cache=True)
def encode_chunk(sym, symbol_tt, state_table, table_log, out):
    """Encode ``sym`` into the end of ``out``; return the payload's start, or -1.

    The payload is ``out[start:]``. -1 means it would not be shorter than
    ``out.size - 8`` bytes (the caller sizes ``out`` as symbols + 8 and then stores raw).
    Every symbol of ``sym`` must have a nonzero frequency in the tables.
    """
    n = sym.size
    size = np.int64(1) << table_log
    pos = out.size
    x0 = x1 = x2 = x3 = size
    acc = np.int64(0)
    nacc = np.int64(0)
    full = n - (n & 3)
    # The short last step (lanes 0 .. n % 4 - 1), in reverse. At most 36 bits: no flush.
    for i in range(n - 1, full - 1, -1):
        tt = symbol_tt[sym[i]]
        lane = i & 3
        if lane == 2:
            x2, acc, nb = _put(x2, tt, state_table, acc)
        elif lane == 1:
            x1, acc, nb = _put(x1, tt, state_table, acc)
        else:
            x0, acc, nb = _put(x0, tt, state_table, acc)
        nacc += nb
    # Invariant: nacc <= 55 before a flush and < 8 after it, so the <= 48 bits of a step
    # fit in the accumulator.
    i = full - 4
    while i >= 0:
        if pos <= 8:
            return -1
        acc, nacc, pos = _flush(acc, nacc, out, pos)
        x3, acc, nb3 = _put(x3, symbol_tt[sym[i + 3]], state_table, acc)
        x2, acc, nb2 = _put(x2, symbol_tt[sym[i + 2]], state_table, acc)
        x1, acc, nb1 = _put(x1, symbol_tt[sym[i + 1]], state_table, acc)
        x0, acc, nb0 = _put(x0, symbol_tt[sym[i]], state_table, acc)
        nacc += nb0 + nb1 + nb2 + nb3
        i -= 4
    if pos <= 8:
        return -1
    acc, nacc, pos = _flush(acc, nacc, out, pos)
    # Header: states (lane 3 first), marker bit, zero padding to a whole byte.
    acc = (((((acc << table_log | (x3 - size)) << table_log | (x2 - size)) << table_log
             | (x1 - size)) << table_log | (x0 - size)) << 1) | 1
    nacc += 4 * table_log + 1
    pad = (8 - (nacc & 7)) & 7
    if pos <= 8:
        return -1
    acc, nacc, pos = _flush(acc << pad, nacc + pad, out, pos)
    return pos if pos > 8 else -1


@njit(nogil=True, cache=True)
def _step(x0, x1, x2, x3, c, dtable, out, i):
    # One step: lanes 0..3 emit out[i..i+3]; returns the new states and the bits consumed.
    x0, c, nb0 = _get(x0, c, dtable, out, i)
    x1, c, nb1 = _get(x1, c, dtable, out, i + 1)
    x2, c, nb2 = _get(x2, c, dtable, out, i + 2)
    x3, c, nb3 = _get(x3, c, dtable, out, i + 3)
    return x0, x1, x2, x3, nb0 + nb1 + nb2 + nb3


@njit(nogil=True, cache=True)
def _start(buf, start, length, table_log, state):
    """Check a payload's extent, find its marker and read the four start states into
    ``state[0:4]`` and the next bit position into ``state[4]``; an error code."""
    end = start + length
    if length < 1 or start < 0 or end > buf.size:
        return ERR_EMPTY
    first = np.int64(buf[start])
    if first == 0:
        return ERR_MARKER
    bit = start * 8 + 1  # absolute position in buf of the next unread bit
    while not first & 1:
        first >>= 1
        bit += 1
    mask = (np.int64(1) << table_log) - 1
    c = _peek(buf, bit >> 3, end) >> (bit & 7)
    for lane in range(LANES):
        state[lane] = (c >> (lane * table_log)) & mask
    bit += 4 * table_log
    if bit > end * 8:
        return ERR_TRUNCATED
    state[LANES] = bit
    return OK


@njit(nogil=True, cache=True)
def _finish(buf, end, state, i, hi, dtable, out):
    """Decode ``out[i:hi]`` from ``state`` (as ``_start`` left it, advanced to symbol i by
    whole steps), then check the stream's end and the final states; an error code."""
    x0, x1, x2, x3, bit = state[0], state[1], state[2], state[3], state[LANES]
    limit = end * 8
    full = hi - ((hi - i) & 3)
    # Fast path: 8 whole bytes at bit >> 3 hold every bit of the step (<= 7 + 48 < 64), so
    # the step cannot pass the payload's end and needs no check.
    while i < full and (bit >> 3) + 8 <= end:
        c = _load64(buf, bit >> 3) >> (bit & 7)
        x0, x1, x2, x3, nb = _step(x0, x1, x2, x3, c, dtable, out, i)
        bit += nb
        i += 4
    # Checked path, the last few steps: bytes past the end read as 0, then bit <= limit
    # is checked (it holds at the top of every step, so _peek starts inside the payload).
    while i < full:
        c = _peek(buf, bit >> 3, end) >> (bit & 7)
        x0, x1, x2, x3, nb = _step(x0, x1, x2, x3, c, dtable, out, i)
        bit += nb
        if bit > limit:
            return ERR_TRUNCATED
        i += 4
    if full < hi:
        c = _peek(buf, bit >> 3, end) >> (bit & 7)
        x0, c, nb = _get(x0, c, dtable, out, full)
        bit += nb
        if full + 1 < hi:
            x1, c, nb = _get(x1, c, dtable, out, full + 1)
            bit += nb
        if full + 2 < hi:
            x2, c, nb = _get(x2, c, dtable, out, full + 2)
            bit += nb
        if bit > limit:
            return ERR_TRUNCATED
    if bit != limit:
        return ERR_TRAILING
    if x0 | x1 | x2 | x3:
        return ERR_FINAL
    return OK


@njit(nogil=True, cache=True)
def _pair(buf, end_a, end_b, sa, sb, ia, ib, hi_a, hi_b, dtable, out):
    """Whole steps of two chunks in turn, from their states ``sa``/``sb`` at symbols
    ``ia``/``ib``, while both have one left (as on _finish's fast path); the states are
    written back and the next symbols of both returned."""
    # The states live in locals (registers): each chunk's bit position is one serial
    # dependency chain, and the CPU overlaps the two independent chains.
    a0, a1, a2, a3, bit_a = sa[0], sa[1], sa[2], sa[3], sa[LANES]
    b0, b1, b2, b3, bit_b = sb[0], sb[1], sb[2], sb[3], sb[LANES]
    while (hi_a - ia >= LANES and hi_b - ib >= LANES and (bit_a >> 3) + 8 <= end_a
           and (bit_b >> 3) + 8 <= end_b):
        c = _load64(buf, bit_a >> 3) >> (bit_a & 7)
        a0, a1, a2, a3, nb = _step(a0, a1, a2, a3, c, dtable, out, ia)
        bit_a += nb
        ia += LANES
        c = _load64(buf, bit_b >> 3) >> (bit_b & 7)
        b0, b1, b2, b3, nb = _step(b0, b1, b2, b3, c, dtable, out, ib)
        bit_b += nb
        ib += LANES
    sa[0], sa[1], sa[2], sa[3], sa[LANES] = a0, a1, a2, a3, bit_a
    sb[0], sb[1], sb[2], sb[3], sb[LANES] = b0, b1, b2, b3, bit_b
    return ia, ib


@njit(nogil=True, cache=True)
def decode_chunks(buf, starts, lengths, dtable, table_log, out, lo, hi, errors):
    """Decode chunk j's payload ``buf[starts[j]:starts[j]+lengths[j]]`` into
    ``out[lo[j]:hi[j]]`` for every j; its error code goes to ``errors[j]``.

    Chunks are decoded in pairs whose whole steps are taken in turn (``_pair``), so
    their independent dependency chains overlap in the CPU.
    """
    g = starts.size
    state = np.zeros((g, LANES + 1), np.int64)  # x0..x3, bit position
    pos = np.empty(g, np.int64)  # next symbol of each chunk
    for j in range(g):
        if not 0 <= lo[j] <= hi[j] <= out.size:
            errors[j] = ERR_BOUNDS
            continue
        if dtable.size != 1 << table_log:  # states index the table: it must hold them all
            errors[j] = ERR_TABLE
            continue
        errors[j] = _start(buf, starts[j], lengths[j], table_log, state[j])
        pos[j] = lo[j]
    for j in range(0, g - 1, 2):
        if errors[j] == OK and errors[j + 1] == OK:
            pos[j], pos[j + 1] = _pair(buf, starts[j] + lengths[j],
                                       starts[j + 1] + lengths[j + 1], state[j], state[j + 1],
                                       pos[j], pos[j + 1], hi[j], hi[j + 1], dtable, out)
    for j in range(g):
        if errors[j] == OK:
            errors[j] = _finish(buf, starts[j] + lengths[j], state[j], pos[j], hi[j], dtable,
                                out)


def decode_chunk(buf, start, length, dtable, table_log, out):
    """Decode ``out.size`` symbols from ``buf[start:start+length]``; return an error code.
    One chunk of ``decode_chunks``."""
    errors = np.empty(1, np.int64)
    decode_chunks(buf, np.array([start], np.int64), np.array([length], np.int64), dtable,
                  table_log, out, np.zeros(1, np.int64), np.array([out.size], np.int64), errors)
    return int(errors[0])
