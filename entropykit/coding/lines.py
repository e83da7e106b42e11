"""Line classes: a 2-D field's rows and columns grouped into a few classes by statistics.

What it is: for a field holding one symbol per element of a row-major 2-D array (BF16
exponents, fp8 bytes, F16 high bytes of a weight matrix), the assignment of its rows and
of its columns to at most 16 classes each, the class of every symbol (row class * column
classes + column class: the context a context-conditioned rANS frame codes it with), the
estimated coded size of a choice, and the bit-packed class maps. What it is not: a coder
or a payload layout (``container/classed.py`` stores a choice next to its frame).

Geometry: a field of ``n`` symbols is part of an array with rows of ``cols`` symbols, its
first symbol at column ``phase`` (a segment of a tensor starts anywhere in a row). Its rows
are the ``ceil((phase + n) / cols)`` rows it touches; its columns are all ``cols``.

Assignment (deterministic: integer counts, IEEE-exact float operations in a fixed order,
the machine-independent log2 of ``tables``): lines (rows or columns) are sorted by their
mean magnitude (symbol & 0x7F: the exponent bits of a float's top byte; ties by index) and
cut into ``k`` classes of equal symbol counts, then refined by Lloyd iterations on coded
size: each line moves to the class whose current distribution codes it in fewest bits.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import contexts, tables
from .tables import _log2

MAX_CLASSES = 16  # per axis; a symbol's context (row class * kc + column class) fits a byte
_ITERS = 4  # Lloyd iterations: measured on MiniLM, later ones change < 0.05% of the size
_MAGNITUDE = 0x7F
_FIT_LINES = 1024  # lines the classes are fitted on (spread evenly); all are then assigned


def n_rows(n: int, cols: int, phase: int) -> int:
    """Rows touched by ``n`` symbols that start at column ``phase`` of rows of ``cols``."""
    return (phase + n + cols - 1) // cols if n else 0


@njit(nogil=True, cache=True)
def _line_hist(sym, dense, n_dense, cols, phase, by_column, n_lines):
    # Invariant: 0 <= phase < cols, n_lines = cols (columns) or n_rows (rows), so the
    # line index (column j < cols, row r < n_rows) is in bounds; dense[s] < n_dense.
    h = np.zeros((n_lines, n_dense), np.int32)
    j = phase
    r = 0
    for i in range(sym.size):
        line = j if by_column else r
        h[line, dense[sym[i]]] += 1
        j += 1
        if j == cols:
            j = 0
            r += 1
    return h


@njit(nogil=True, cache=True)
def _group(h, cls, k):
    # Sum of the lines of each class; invariant: cls[line] < k.
    tot = np.zeros((k, h.shape[1]), np.int64)
    for line in range(h.shape[0]):
        c = cls[line]
        for s in range(h.shape[1]):
            tot[c, s] += h[line, s]
    return tot


@njit(nogil=True, cache=True)
def _costs(tot):
    # Cost of a symbol in class c: -log2 of its add-1/2 smoothed frequency there.
    k, n_dense = tot.shape
    cost = np.empty((k, n_dense), np.float64)
    for c in range(k):
        total = 0
        for s in range(n_dense):
            total += tot[c, s]
        lt = _log2(total + 0.5 * n_dense)
        for s in range(n_dense):
            cost[c, s] = lt - _log2(tot[c, s] + 0.5)
    return cost


@njit(nogil=True, cache=True)
def _reassign(h, lines, cls, cost):
    # Move each of ``lines`` to the class that codes it in fewest bits (ties: lowest class);
    # the sum runs over the symbols a line holds, in a fixed order. Returns lines moved.
    k, n_dense = cost.shape
    held = np.empty(n_dense, np.int64)  # the symbols the line holds
    moved = 0
    for line in lines:
        m = 0
        for s in range(n_dense):
            if h[line, s]:
                held[m] = s
                m += 1
        best = cls[line]
        best_bits = np.inf
        for c in range(k):
            bits = 0.0
            for i in range(m):
                bits += h[line, held[i]] * cost[c, held[i]]
            if bits < best_bits:
                best_bits = bits
                best = c
        if best != cls[line]:
            moved += 1
            cls[line] = best
    return moved


@njit(nogil=True, cache=True)
def _lloyd(h, cls, k, iters, fit):
    # Lloyd iterations on the lines ``fit`` (a spread sample of at most _FIT_LINES), then
    # every line assigned once against the classes they fitted: the cost of a pass is
    # lines x k x symbols, so fitting on all lines of a large tensor would dominate.
    for _ in range(iters):
        cost = _costs(_group(h[fit], cls[fit], k))
        if _reassign(h, fit, cls, cost) == 0:
            break
    _reassign(h, np.arange(h.shape[0]), cls, _costs(_group(h[fit], cls[fit], k)))
    return cls


def dense(sym: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64[256]: symbol -> its index among the present symbols, the present symbols)."""
    present = np.flatnonzero(tables.histogram(sym)).astype(np.uint8)
    index = np.zeros(256, np.int64)
    index[present] = np.arange(present.size)
    return index, present


def line_histograms(sym: np.ndarray, index: np.ndarray, n_dense: int, cols: int,
                    phase: int, by_column: bool) -> np.ndarray:
    """int32[lines, n_dense]: counts per row (or column) of each present symbol, indexed
    as ``dense`` gives (``n_dense`` >= the number of present symbols, >= 1)."""
    lines = cols if by_column else n_rows(sym.size, cols, phase)
    return _line_hist(sym, index, n_dense, cols, phase, by_column, lines)


def assign(h: np.ndarray, present: np.ndarray, k: int, iters: int = _ITERS) -> np.ndarray:
    """uint8 class (< ``k``) of every line of ``h`` (from ``line_histograms``)."""
    n_lines = h.shape[0]
    counts = h.sum(axis=1, dtype=np.int64)
    mag = (present.astype(np.int64) & _MAGNITUDE)
    sums = h.astype(np.int64) @ mag
    mean = sums / np.maximum(counts, 1)  # correctly rounded division: same on every machine
    order = np.argsort(mean, kind="stable")
    before = np.cumsum(counts[order]) - counts[order]  # symbols in lines sorted before
    total = max(1, int(counts.sum()))
    cls = np.empty(n_lines, np.int64)
    cls[order] = np.minimum(k - 1, before * k // total)
    fit = np.unique(np.linspace(0, n_lines - 1, min(n_lines, _FIT_LINES)).astype(np.int64))
    return _lloyd(h, cls, k, iters, fit).astype(np.uint8)


@njit(nogil=True, cache=True)
def _context(n, cols, phase, rcls, ccls, kc, out):
    # Invariant: rcls has n_rows entries, ccls has cols entries (or one entry 0 when
    # kc == 1: then j is never used to index it beyond 0).
    j = phase
    r = 0
    for i in range(n):
        out[i] = rcls[r] * kc + ccls[j if kc > 1 else 0]
        j += 1
        if j == cols:
            j = 0
            r += 1
    return out


def context(n: int, cols: int, phase: int, rcls: np.ndarray | None,
            ccls: np.ndarray | None, kc: int) -> np.ndarray:
    """uint8[n]: each symbol's class, ``rcls[row] * kc + ccls[column]``.

    ``rcls``: one class per row touched (``n_rows``), or None for no row classes;
    ``ccls``: one per column (``cols``), or None (then ``kc`` must be 1). The caller
    checks that the classes make contexts below 256.
    """
    rc = (np.zeros(max(1, n_rows(n, cols, phase)), np.int64) if rcls is None
          else np.ascontiguousarray(rcls, np.int64))
    cc = np.zeros(1, np.int64) if ccls is None else np.ascontiguousarray(ccls, np.int64)
    assert (rcls is None or rc.size == n_rows(n, cols, phase)) and (kc == 1 or cc.size == cols)
    return _context(n, cols, phase, rc, cc, kc, np.empty(n, np.uint8))


def map_bytes(count: int, k: int) -> int:
    """Bytes of a packed map of ``count`` classes below ``k`` (0 when ``k == 1``)."""
    return (count * width(k) + 7) // 8


def width(k: int) -> int:
    """Bits per class in a packed map of classes below ``k``."""
    return (k - 1).bit_length()


def pack(classes: np.ndarray, k: int) -> bytes:
    """Classes (each < ``k``) packed ``width(k)`` bits each, least significant bit first."""
    w = width(k)
    if w == 0:
        return b""
    bits = (classes.astype(np.uint8)[:, None] >> np.arange(w, dtype=np.uint8)) & 1
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack(buf: np.ndarray, count: int, k: int) -> np.ndarray | None:
    """Inverse of ``pack`` from exactly ``map_bytes(count, k)`` bytes; None if a class is
    ``>= k`` or a padding bit is set (a damaged map)."""
    w = width(k)
    if w == 0:
        return np.zeros(count, np.uint8)
    bits = np.unpackbits(buf, bitorder="little")
    if bits[count * w:].any():
        return None
    weights = (1 << np.arange(w, dtype=np.uint8)).astype(np.uint8)
    classes = (bits[: count * w].reshape(count, w) * weights).sum(axis=1).astype(np.uint8)
    if classes.size and int(classes.max()) >= k:
        return None
    return classes


def estimate_bits(joint: np.ndarray, max_tables: int = contexts.DEFAULT_MAX_TABLES) -> float:
    """Estimated bits of a context frame for this (context, symbol) histogram: the entropy
    of each table class ``contexts.choose`` would make, plus its serialized table."""
    cmap = contexts.choose(joint, max_tables)
    if cmap is None:
        counts = joint.sum(axis=0)
        return tables.entropy_bits(counts) + contexts._table_bits(counts)
    bits = 8.0 * 257  # the frame's class count and context map
    for counts in contexts.class_counts(joint, cmap):
        bits += tables.entropy_bits(counts) + contexts._table_bits(counts)
    return bits


def joint_from_lines(h: np.ndarray, present: np.ndarray, cls: np.ndarray) -> np.ndarray:
    """int64[256, 256] (class, symbol) counts of lines ``h`` in classes ``cls``."""
    per_class = _group(h, cls.astype(np.int64), 256)
    joint = np.zeros((256, 256), np.int64)
    joint[:, present] = per_class[:, : present.size]
    return joint
