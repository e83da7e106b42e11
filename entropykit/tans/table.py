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

ALPHABET = 256


def _floor_log2(v: np.ndarray) -> np.ndarray:
    # frexp is exact for integers below 2**53: v = m * 2**e with m in [0.5, 1).
    return np.frexp(v.astype(np.float64))[1].astype(np.int64) - 1


def _check(freqs: np.ndarray, table_log: int) -> np.ndarray:
    f = np.asarray(freqs, dtype=np.int64)
    if f.shape != (ALPHABET,) or (f < 0).any() or int(f.sum()) != 1 << table_log:
        raise ValueError(f"freqs must be 256 non-negative counts summing to 2**{table_log}")
    return f


def spread(freqs: np.ndarray, table_log: int) -> np.ndarray:
    """The symbol of every slot, uint8[2**table_log] (FSE's ``tableSymbol``)."""
    f = _check(freqs, table_log)
    size = 1 << table_log
    step = (size >> 1) + (size >> 3) + 3
    slots = (np.arange(size, dtype=np.int64) * step) & (size - 1)
    out = np.empty(size, np.uint8)
    out[slots] = np.repeat(np.arange(ALPHABET, dtype=np.uint8), f)
    return out


def _slot_order(sym: np.ndarray) -> np.ndarray:
    # Slots grouped by symbol, increasing within a group: entry c_s + k is the k-th slot of s.
    return np.argsort(sym, kind="stable").astype(np.int64)


def decode_table(freqs: np.ndarray, table_log: int) -> np.ndarray:
    """Packed decode entries, uint32[2**table_log] (module docstring)."""
    f = _check(freqs, table_log)
    size = 1 << table_log
    sym = spread(f, table_log)
    order = _slot_order(sym)
    cumul = np.cumsum(f) - f
    k = np.empty(size, np.int64)
    k[order] = np.arange(size, dtype=np.int64) - cumul[sym[order]]
    y = f[sym] + k
    nb = table_log - _floor_log2(y)
    base = (y << nb) - size
    return (sym.astype(np.int64) | (nb << 8) | (base << 16)).astype(np.uint32)


def encode_tables(freqs: np.ndarray, table_log: int) -> tuple[np.ndarray, np.ndarray]:
    """``(symbol_tt int64[256], state_table uint16[2**table_log])`` (module docstring)."""
    f = _check(freqs, table_log)
    size = 1 << table_log
    state_table = (size + _slot_order(spread(f, table_log))).astype(np.uint16)
    cumul = np.cumsum(f) - f
    m = np.full(ALPHABET, table_log, np.int64)
    big = f > 1
    m[big] = table_log - _floor_log2(f[big] - 1)
    dnb = (m << 16) - np.where(big, f << m, size)
    # An absent symbol never reaches the encoder (the table comes from the same data); its
    # entry (nb = 0, low field -size) still keeps every index in range, so misuse cannot
    # write out of bounds: it only codes garbage, which the frame's CRC reports.
    low = np.where(f > 0, cumul - f, -size) & 0xFFFFFFFF
    symbol_tt = np.where(f > 0, dnb << 32, 0) | low
    return symbol_tt.astype(np.int64), state_table
