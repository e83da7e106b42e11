"""Context classes: which values of a context field get a frequency table of their own.

What it is: for a field coded conditionally on another (BF16 sign+mantissa given the
exponent), the choice of a map ``context value -> table index`` that minimizes estimated
coded size (order-0 entropy of each class plus the bytes of its table), and the joint
histogram it is computed from. What it is not: a coder; the frame stores the map and the
tables, the kernels look a table up per symbol.

The choice is greedy and deterministic: every context value starts in one shared class;
values are considered by decreasing count (ties: lower value first) and split out into a
class of their own when that saves more bits than their table costs, up to ``max_tables``.
If one table is as good, the map is None and the frame is an ordinary one-table frame.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import tables
from .parallel import run, spread

DEFAULT_MAX_TABLES = 16
# Symbols per part of a histogram counted on several threads: large enough that a part's
# own 256 x 256 counts cost little beside it.
PART = 1 << 21


@njit(nogil=True, cache=True)
def _joint_histogram(context: np.ndarray, symbols: np.ndarray) -> np.ndarray:
    h = np.zeros((256, 256), np.int64)
    for i in range(symbols.size):
        h[context[i], symbols[i]] += 1
    return h


def joint_histogram(context: np.ndarray, symbols: np.ndarray, threads: int | None = 1
                    ) -> np.ndarray:
    """int64[256, 256]: counts of (context value, symbol) pairs; a large field is counted
    in parts on ``threads`` threads (``parallel.run``: inside a running call, on its
    threads) and the parts summed, which is exact."""
    n = symbols.size
    if n <= PART or spread(threads) == 1:
        return _joint_histogram(context, symbols)
    cuts = list(range(0, n, PART)) + [n]
    return sum(run(lambda k: _joint_histogram(context[cuts[k] : cuts[k + 1]],
                                              symbols[cuts[k] : cuts[k + 1]]),
                   len(cuts) - 1, threads))


@njit(cache=True)  # keeps the GIL: 256 counts cost less than a hand-off of the GIL
def table_bits(row: np.ndarray) -> float:
    """Estimated bits of the serialized table of a histogram row."""
    present = 0
    for c in row:
        present += c > 0
    # Serialized size estimate: count byte, symbol list or bitmap, ~2-byte varints.
    return 8.0 * (1 + min(present, 32) + 2 * present)


@njit(cache=True)  # keeps the GIL: a few rows of 256 counts cost less than a hand-off of it
def rows_bits(rows: np.ndarray, start: float) -> float:
    """``start`` plus, row by row, the order-0 entropy of each histogram row of ``rows``
    (int64[k, 256]) and its table's ``table_bits``: a frame's estimate in one call."""
    bits = start
    for r in range(rows.shape[0]):
        bits += tables.entropy_bits_exact(rows[r]) + table_bits(rows[r])
    return bits


@njit(nogil=True, cache=True)
def _choose(joint: np.ndarray, max_tables: int) -> np.ndarray:
    # Greedy split (module docstring) over the present context values, by decreasing count
    # (a stable sort: ties to the lower value); only present rows are ever read, and one
    # buffer holds each candidate's remainder.
    per = np.zeros(256, np.int64)
    for c in range(256):
        t = 0
        for s in range(256):
            t += joint[c, s]
        per[c] = t
    present = np.flatnonzero(per)
    order = present.copy()
    for i in range(1, order.size):  # stable insertion sort by decreasing count
        c = order[i]
        j = i - 1
        while j >= 0 and per[order[j]] < per[c]:
            order[j + 1] = order[j]
            j -= 1
        order[j + 1] = c
    rest = np.zeros(256, np.int64)
    for c in present:
        for s in range(256):
            rest[s] += joint[c, s]
    rest_total = per.sum()
    cmap = np.zeros(256, np.uint8)
    remain = np.empty(256, np.int64)
    n_own = 0
    rest_bits = tables.entropy_bits_exact(rest)
    for c in order:
        if n_own + 1 >= max_tables:
            break
        if rest_total == per[c]:
            break  # c is the last context in the shared class; nothing to split
        for s in range(256):
            remain[s] = rest[s] - joint[c, s]
        remain_bits = tables.entropy_bits_exact(remain)
        saved = (rest_bits - remain_bits - tables.entropy_bits_exact(joint[c])
                 - table_bits(joint[c]))
        if saved > 0:
            n_own += 1
            cmap[c] = n_own
            for s in range(256):
                rest[s] = remain[s]
            rest_total -= per[c]
            rest_bits = remain_bits
    return cmap


def choose(joint: np.ndarray, max_tables: int = DEFAULT_MAX_TABLES) -> np.ndarray | None:
    """Context value -> table index (uint8[256]), or None when one table is as cheap."""
    if not 1 <= max_tables <= 256:
        raise ValueError(f"max_tables must be in 1..256, got {max_tables}")
    cmap = _choose(np.ascontiguousarray(joint, np.int64), max_tables)
    return cmap if cmap.any() else None


@njit(nogil=True, cache=True)
def _lookup(cmap: np.ndarray, context: np.ndarray) -> np.ndarray:
    out = np.empty(context.size, np.uint8)
    for i in range(context.size):
        out[i] = cmap[context[i]]
    return out


def classes(cmap: np.ndarray, context: np.ndarray) -> np.ndarray:
    """The class (table index) of each context value: ``cmap[context]``, uint8."""
    return _lookup(cmap, context)


@njit(nogil=True, cache=True)
def _class_counts(joint: np.ndarray, cmap: np.ndarray, n_tables: int) -> np.ndarray:
    out = np.zeros((n_tables, 256), np.int64)
    for c in range(256):
        for s in range(256):
            out[cmap[c], s] += joint[c, s]
    return out


def class_counts(joint: np.ndarray, cmap: np.ndarray) -> np.ndarray:
    """int64[n_tables, 256]: symbol counts of each context class."""
    return _class_counts(np.ascontiguousarray(joint, np.int64), cmap, int(cmap.max()) + 1)
