"""Frequency tables: histograms, quantization to 2**precision, and their serialized form.

What it is: the statistics half of a static entropy coder, shared by rANS and tANS.
What it is not: a coder; nothing here touches a payload.

Quantization minimizes the coding loss ``sum_s c_s * log2(total / (f_s / 2**p))`` subject to
``sum f_s == 2**p`` and ``f_s >= 1`` for every present symbol. The objective is separable
and convex in each ``f_s``, so greedy unit moves by marginal cost, then exchanges until
no exchange helps, reach the optimum. The logarithm used for the marginal costs is our own
(IEEE basic operations only), so the chosen table is the same on every machine.

Serialized table (little-endian, see docs/format.md):

    u8   n_present - 1
    n_present <= 32:  n_present symbol bytes, strictly increasing
    n_present >  32:  32-byte presence bitmap (bit s of byte s // 8 set <=> s present)
    n_present LEB128 varints: f_s for each present symbol in increasing order
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from .._errors import CorruptDataError

ALPHABET = 256
_LIST_MAX = 32


@njit(nogil=True, cache=True)
def _histogram(symbols: np.ndarray) -> np.ndarray:
    # Four sub-histograms break the store-to-load dependency on repeated symbols.
    h = np.zeros((4, ALPHABET), np.int64)
    n = symbols.size
    i = 0
    while i + 4 <= n:
        h[0, symbols[i]] += 1
        h[1, symbols[i + 1]] += 1
        h[2, symbols[i + 2]] += 1
        h[3, symbols[i + 3]] += 1
        i += 4
    while i < n:
        h[0, symbols[i]] += 1
        i += 1
    out = np.zeros(ALPHABET, np.int64)
    for s in range(ALPHABET):
        out[s] = h[0, s] + h[1, s] + h[2, s] + h[3, s]
    return out


def _flat(a: np.ndarray, dtype: type) -> np.ndarray:
    """``a`` as a contiguous 1-D array of ``dtype``; itself, with no numpy call, where it
    is one already (the codec policy's case: its calls are a segment's held time)."""
    if type(a) is np.ndarray and a.dtype == dtype and a.ndim == 1 and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype).reshape(-1)


def histogram(symbols: np.ndarray) -> np.ndarray:
    """Counts of each byte value in ``symbols`` (uint8), as int64[256]."""
    return _histogram(_flat(symbols, np.uint8))


@njit(nogil=True, cache=True)
def _log2(x: float) -> float:
    # log2 from frexp and the atanh series: only IEEE +,-,*,/ so results are bit-identical
    # on every machine (libm's log2 is not guaranteed to be). |s| <= 0.172, so 14 terms
    # leave an error below 1e-15 relative.
    m, e = math.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    m *= 2.0
    e -= 1
    if m > 1.4142135623730951:
        m *= 0.5
        e += 1
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    term = s
    acc = 0.0
    k = 1.0
    for _ in range(14):
        acc += term / k
        term *= s2
        k += 2.0
    return e + acc * 2.8853900817779268  # 2 / ln 2


@njit(nogil=True, cache=True)
def _log2_table(n: int) -> np.ndarray:
    t = np.zeros(n, np.float64)
    for i in range(1, n):
        t[i] = _log2(float(i))
    return t


@functools.cache
def _log2f() -> np.ndarray:
    # log2 f for every frequency a table can hold; built at first use, not at import (a
    # first Numba call loads its whole target registry: ~0.3 s of `import entropykit`).
    return _log2_table((1 << 15) + 2)


@njit(nogil=True, cache=True)
def _gain(c: float, f: int, log2f: np.ndarray) -> float:
    # Bits saved by raising f to f + 1 for a symbol seen c times.
    return c * (log2f[f + 1] - log2f[f])


@njit(cache=True)  # keeps the GIL: 256 counts (a few microseconds) cost less than a hand-off
def entropy_bits_exact(counts: np.ndarray) -> float:
    """Order-0 entropy of ``counts`` in bits, computed identically on every machine."""
    total = 0
    for c in counts:
        total += c
    if total == 0:
        return 0.0
    acc = 0.0
    for c in counts:
        if c > 0:
            acc += c * _log2(float(c))
    return total * _log2(float(total)) - acc


@njit(nogil=True, cache=True)
def _quantize(counts: np.ndarray, precision: int, log2f: np.ndarray) -> np.ndarray:
    total_f = 1 << precision
    total_c = 0
    for s in range(ALPHABET):
        total_c += counts[s]
    f = np.zeros(ALPHABET, np.int64)
    used = 0
    for s in range(ALPHABET):
        if counts[s] > 0:
            # Nearest integer of the exact share (few unit moves remain), at least 1.
            q = (2 * counts[s] * total_f + total_c) // (2 * total_c)
            f[s] = q if q > 0 else 1
            used += f[s]
    # Greedy unit moves toward the exact total. Ties go to the lower symbol.
    while used != total_f:
        best = -1
        best_v = 0.0
        for s in range(ALPHABET):
            if counts[s] == 0:
                continue
            if used < total_f:
                v = _gain(float(counts[s]), f[s], log2f)
                if best < 0 or v > best_v:
                    best, best_v = s, v
            elif f[s] > 1:
                v = _gain(float(counts[s]), f[s] - 1, log2f)  # bits lost by lowering f[s]
                if best < 0 or v < best_v:
                    best, best_v = s, v
        if used < total_f:
            f[best] += 1
            used += 1
        else:
            f[best] -= 1
            used -= 1
    # Exchanges: move one unit from the cheapest donor to the best receiver while it pays.
    for _ in range(4 * ALPHABET * ALPHABET):
        up = -1
        up_v = 0.0
        down = -1
        down_v = 0.0
        for s in range(ALPHABET):
            if counts[s] == 0:
                continue
            g = _gain(float(counts[s]), f[s], log2f)
            if up < 0 or g > up_v:
                up, up_v = s, g
            if f[s] > 1:
                d = _gain(float(counts[s]), f[s] - 1, log2f)
                if down < 0 or d < down_v:
                    down, down_v = s, d
        if down < 0 or up == down or up_v <= down_v * (1.0 + 1e-12):
            break
        f[up] += 1
        f[down] -= 1
    return f


def quantize(counts: np.ndarray, precision: int) -> np.ndarray:
    """Frequencies summing to ``2**precision``, >= 1 for every symbol with a count.

    ``counts`` is int[256]. Raises ``ValueError`` if no symbol is present or more symbols
    are present than ``2**precision`` slots.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if counts.shape != (ALPHABET,) or (counts < 0).any():
        raise ValueError("counts must be 256 non-negative integers")
    present = int(np.count_nonzero(counts))
    if present == 0:
        raise ValueError("cannot build a table for an empty input")
    if present > (1 << precision):
        raise ValueError(
            f"{present} distinct symbols do not fit precision {precision} "
            f"({1 << precision} slots); use a higher precision"
        )
    return _quantize(counts, precision, _log2f())


_SERIAL_MAX = 1 + _LIST_MAX + 3 * ALPHABET  # count, bitmap (32 bytes) or list, 3-byte varints


@njit(cache=True)  # keeps the GIL: a microsecond or two costs less than a hand-off of it
def _serialize(freqs: np.ndarray, out: np.ndarray) -> int:
    # Frequencies are < 2**21 (precision <= 15), so every varint fits in 3 bytes and the
    # whole table in _SERIAL_MAX bytes.
    present = 0
    for s in range(ALPHABET):
        present += freqs[s] > 0
    out[0] = present - 1
    pos = 1
    if present <= _LIST_MAX:
        for s in range(ALPHABET):
            if freqs[s] > 0:
                out[pos] = s
                pos += 1
    else:
        for k in range(32):
            byte = 0
            for b in range(8):
                if freqs[8 * k + b] > 0:
                    byte |= 1 << b
            out[pos + k] = byte
        pos += 32
    for s in range(ALPHABET):
        v = freqs[s]
        if v <= 0:
            continue
        while v >= 0x80:
            out[pos] = (v & 0x7F) | 0x80
            pos += 1
            v >>= 7
        out[pos] = v
        pos += 1
    return pos


def serialize(freqs: np.ndarray) -> bytes:
    """The compact byte form of a table (module docstring); ``freqs`` as ``quantize`` gives.
    """
    f = np.ascontiguousarray(freqs, dtype=np.int64)
    if f.shape != (ALPHABET,) or not 0 < f.max() < 1 << 21 or f.min() < 0:
        raise ValueError("freqs must be 256 counts in [0, 2**21), at least one nonzero")
    out = np.empty(_SERIAL_MAX, np.uint8)
    return out[: _serialize(f, out)].tobytes()


@njit(nogil=True, cache=True)
def _quantize_rows(counts, precision, log2f, out):
    # Each row quantized (_quantize) and serialized (_serialize) back to back into out:
    # (tables, bytes written), or (tables, -1 - r) where row r is not a table quantize
    # takes (a negative count, no symbol present, more present than slots).
    freqs = np.zeros((counts.shape[0], ALPHABET), np.int64)
    pos = 0
    for r in range(counts.shape[0]):
        present = 0
        for s in range(ALPHABET):
            if counts[r, s] < 0:
                return freqs, -1 - r
            present += counts[r, s] > 0
        if present == 0 or present > (1 << precision):
            return freqs, -1 - r
        freqs[r] = _quantize(counts[r], precision, log2f)
        pos += _serialize(freqs[r], out[pos:])
    return freqs, pos


def quantize_rows(counts: np.ndarray, precision: int) -> tuple[np.ndarray, bytes]:
    """``quantize`` of each row of ``counts`` (int[k, 256]) and the ``serialize``d tables
    back to back, in one call (a frame's table section codes several); ``ValueError`` as
    ``quantize`` for the first row it refuses."""
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    if counts.ndim != 2 or counts.shape[1] != ALPHABET:
        raise ValueError("counts must be rows of 256 non-negative integers")
    out = np.empty(counts.shape[0] * _SERIAL_MAX, np.uint8)
    freqs, end = _quantize_rows(counts, precision, _log2f(), out)
    if end < 0:
        quantize(counts[-1 - end], precision)  # raises the row's error
    return freqs, out[:end].tobytes()


# Parse outcomes: OK, or what is wrong (messages in ``_PARSE_ERRORS``).
_OK = 0
_TRUNC_COUNT, _TRUNC_LIST, _TRUNC_BITMAP, _TRUNC_FREQS = 1, 2, 3, 4
_ORDER, _BITMAP_COUNT, _VARINT, _RANGE, _SUM = 5, 6, 7, 8, 9


@njit(nogil=True, cache=True)
def _parse(buf: np.ndarray, offset: int, end: int, precision: int,
           freqs: np.ndarray) -> tuple[int, int, int, int]:
    # (outcome, offset, a, b): on success the end offset; on failure where, and up to two
    # numbers for the message. Every read is at an index < end <= buf.size (checked).
    for s in range(ALPHABET):
        freqs[s] = 0
    if offset >= end:
        return _TRUNC_COUNT, offset, 0, 0
    n_present = np.int64(buf[offset]) + 1
    offset += 1
    present = np.empty(ALPHABET, np.int64)
    if n_present <= _LIST_MAX:
        if offset + n_present > end:
            return _TRUNC_LIST, offset, 0, 0
        for k in range(n_present):
            present[k] = buf[offset + k]
            if k > 0 and present[k] <= present[k - 1]:
                return _ORDER, offset, 0, 0
        offset += n_present
    else:
        if offset + 32 > end:
            return _TRUNC_BITMAP, offset, 0, 0
        k = 0
        for s in range(ALPHABET):
            if (buf[offset + (s >> 3)] >> (s & 7)) & 1:
                present[k] = s
                k += 1
        if k != n_present:
            return _BITMAP_COUNT, offset, k, n_present
        offset += 32
    limit = np.int64(1) << precision
    total = np.int64(0)
    for k in range(n_present):
        v = np.int64(0)
        shift = 0
        while True:
            if offset >= end:
                return _TRUNC_FREQS, offset, 0, 0
            b = np.int64(buf[offset])
            offset += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
            if shift > 21:
                return _VARINT, offset, 0, 0
        if v == 0 or v > limit:
            return _RANGE, offset, v, present[k]
        freqs[present[k]] = v
        total += v
    if total != limit:
        return _SUM, offset, total, limit
    return _OK, offset, 0, 0


_PARSE_ERRORS = {
    _TRUNC_COUNT: "frequency table truncated in symbol count at byte {at}",
    _TRUNC_LIST: "frequency table truncated in symbol list at byte {at}",
    _TRUNC_BITMAP: "frequency table truncated in presence bitmap at byte {at}",
    _TRUNC_FREQS: "frequency table truncated in frequencies at byte {at}",
    _ORDER: "frequency table symbols not increasing at byte {at}",
    _BITMAP_COUNT: "frequency table bitmap at byte {at} has {a} symbols, header says {b}",
    _VARINT: "frequency varint too long at byte {at}",
    _RANGE: "frequency {a} of symbol {b} out of range at byte {at}",
    _SUM: "frequencies sum to {a}, expected {b} (table ends at byte {at})",
}


def _parse_error(code: int, at: int, a: int, b: int) -> str:
    return _PARSE_ERRORS[code].format(at=at, a=a, b=b)


def parse_into(buf: np.ndarray, offset: int, end: int, precision: int,
               freqs: np.ndarray) -> int:
    """Read the serialized table at ``buf[offset:end]`` (uint8 array) into ``freqs``
    (int64[256], overwritten); return its end offset.

    Raises ``CorruptDataError`` if it is truncated, lists symbols out of order, has a zero
    frequency, or does not sum to ``2**precision``.
    """
    code, at, a, b = _parse(buf, offset, min(end, buf.size), precision, freqs)
    if code != _OK:
        raise CorruptDataError(_parse_error(code, at, a, b))
    return at


@njit(nogil=True, cache=True)
def _parse_rows(buf: np.ndarray, offset: int, end: int, precision: int,
                freqs: np.ndarray) -> tuple[int, int, int, int]:
    # ``_parse`` of each row of ``freqs`` in turn, one call for a frame's tables.
    for t in range(freqs.shape[0]):
        code, offset, a, b = _parse(buf, offset, end, precision, freqs[t])
        if code != _OK:
            return code, offset, a, b
    return _OK, offset, 0, 0


def parse_rows_into(buf: np.ndarray, offset: int, end: int, precision: int,
                    freqs: np.ndarray) -> int:
    """``parse_into`` of ``freqs.shape[0]`` tables serialized back to back from
    ``offset`` into the rows of ``freqs`` (int64[n, 256]); the end offset of the last."""
    code, at, a, b = _parse_rows(buf, offset, min(end, buf.size), precision, freqs)
    if code != _OK:
        raise CorruptDataError(_parse_error(code, at, a, b))
    return at


def parse(buf: bytes | memoryview | np.ndarray, offset: int,
          precision: int) -> tuple[np.ndarray, int]:
    """Read a serialized table at ``offset``; return ``(freqs int64[256], end offset)``.

    Raises ``CorruptDataError`` as ``parse_into``.
    """
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    freqs = np.zeros(ALPHABET, np.int64)
    return freqs, parse_into(arr, offset, arr.size, precision, freqs)


def entropy_bits(counts: np.ndarray) -> float:
    """Order-0 empirical entropy of the counted data, in bits (total, not per symbol).

    Computed with the machine-independent logarithm, so choices made on it (codec, context
    classes) are the same everywhere.
    """
    return entropy_bits_exact(_flat(counts, np.int64))
