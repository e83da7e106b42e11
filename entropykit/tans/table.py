"""tANS state tables: the FSE symbol spread and the decode/encode tables built from it.

What it is: pure functions from a quantized frequency table (``f_s`` summing to
``2**table_log``, from ``coding/tables.py``) to the arrays the kernels index.
What it is not: a coder; nothing here reads or writes a payload.

Notation: ``R`` = table log, ``size = 2**R``. The decoder's state is a slot ``u`` in
``[0, size)``; the encoder's state is ``X = size + u`` in ``[size, 2*size)``.

Spread (FSE): the symbols, each repeated ``f_s`` times in increasing symbol order, are
placed at slots ``k * step mod size`` for k = 0, 1, ..., with ``step = size/2 + size/8 + 3``
(odd, so it visits every slot exactly once).

Decode table: slot ``u`` holds symbol ``s``; let ``k`` be the number of slots ``< u`` that
hold ``s``, ``y = f_s + k`` (in ``[f_s, 2*f_s)``), ``nb = R - floor(log2 y)`` and
``base = (y << nb) - size``. Decoding from ``u`` emits ``s`` and moves to
``base + (next nb bits)``, which is in ``[0, size)`` because ``y << nb`` is in
``[size, 2*size)``. Packed entry (uint32): ``s | nb << 8 | base << 16``.

Encode tables (FSE's ``stateTable`` and ``symbolTT``): ``state_table[c_s + k] = size + u``
for the k-th slot ``u`` of ``s`` (``c_s`` = cumulative frequency). To encode ``s`` from
``X``: ``nb = (X + dnb_s) >> 16`` (the number of low bits of ``X`` to emit, chosen so that
``X >> nb`` is in ``[f_s, 2*f_s)``), then ``X = state_table[(X >> nb) + c_s - f_s]``.
``dnb_s = (m << 16) - (f_s << m)`` with ``m = R - floor(log2(f_s - 1))`` (``m = R`` and
``dnb_s = (R << 16) - size`` when ``f_s == 1``). Packed per symbol (int64):
``dnb_s << 32 | (c_s - f_s) mod 2**32``: the low field is ``c_s - f_s`` as an int32.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import leading_zeros

ALPHABET = 256


def _check(freqs: np.ndarray, table_log: int) -> np.ndarray:
    f = np.ascontiguousarray(freqs, dtype=np.int64)
    if f.shape != (ALPHABET,) or (f < 0).any() or int(f.sum()) != 1 << table_log:
        raise ValueError(f"freqs must be 256 non-negative counts summing to 2**{table_log}")
    return f


@njit(nogil=True, cache=True)
def _spread(f: np.ndarray, table_log: int, out: np.ndarray) -> None:
    size = 1 << table_log
    step = (size >> 1) + (size >> 3) + 3
    pos = 0
    for s in range(ALPHABET):
        for _ in range(f[s]):
            out[pos] = s
            pos = (pos + step) & (size - 1)


def spread(freqs: np.ndarray, table_log: int) -> np.ndarray:
    """The symbol of every slot, uint8[2**table_log] (FSE's ``tableSymbol``)."""
    f = _check(freqs, table_log)
    out = np.empty(1 << table_log, np.uint8)
    _spread(f, table_log, out)
    return out


@njit(nogil=True, cache=True)
def _floor_log2(v: int) -> int:
    # v >= 1: the index of its highest set bit (one count-leading-zeros instruction).
    return 63 - np.int64(leading_zeros(np.uint64(v)))


@njit(nogil=True, cache=True)
def _decode_table(f: np.ndarray, table_log: int, out: np.ndarray) -> None:
    size = 1 << table_log
    sym = np.empty(size, np.uint8)
    _spread(f, table_log, sym)
    y_next = f.copy()  # f_s + k, k = slots below u holding the same symbol
    for u in range(size):
        s = sym[u]
        y = y_next[s]
        y_next[s] = y + 1
        nb = table_log - _floor_log2(y)
        out[u] = s | (nb << 8) | (((y << nb) - size) << 16)


def decode_table(freqs: np.ndarray, table_log: int) -> np.ndarray:
    """Packed decode entries, uint32[2**table_log] (module docstring)."""
    f = _check(freqs, table_log)
    out = np.empty(1 << table_log, np.uint32)
    _decode_table(f, table_log, out)
    return out


@njit(nogil=True, cache=True)
def _encode_tables(f: np.ndarray, table_log: int, symbol_tt: np.ndarray,
                   state_table: np.ndarray) -> None:
    size = 1 << table_log
    sym = np.empty(size, np.uint8)
    _spread(f, table_log, sym)
    nxt = np.empty(ALPHABET, np.int64)  # next free entry c_s + k of each symbol
    c = 0
    for s in range(ALPHABET):
        nxt[s] = c
        if f[s] == 0:
            # An absent symbol never reaches the encoder (the table comes from the same
            # data); its entry (nb = 0, low field -size) still keeps every index in range,
            # so misuse cannot write out of bounds: it only codes garbage, which the
            # frame's CRC reports.
            symbol_tt[s] = -size & 0xFFFFFFFF
        else:
            m = table_log if f[s] == 1 else table_log - _floor_log2(f[s] - 1)
            dnb = (m << 16) - (size if f[s] == 1 else f[s] << m)
            symbol_tt[s] = (dnb << 32) | ((c - f[s]) & 0xFFFFFFFF)
        c += f[s]
    for u in range(size):
        s = sym[u]
        state_table[nxt[s]] = size + u
        nxt[s] += 1


def encode_tables(freqs: np.ndarray, table_log: int) -> tuple[np.ndarray, np.ndarray]:
    """``(symbol_tt int64[256], state_table uint16[2**table_log])`` (module docstring)."""
    f = _check(freqs, table_log)
    symbol_tt = np.empty(ALPHABET, np.int64)
    state_table = np.empty(1 << table_log, np.uint16)
    _encode_tables(f, table_log, symbol_tt, state_table)
    return symbol_tt, state_table
