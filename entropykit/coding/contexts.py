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

DEFAULT_MAX_TABLES = 16


@njit(nogil=True, cache=True)
def _joint_histogram(context: np.ndarray, symbols: np.ndarray) -> np.ndarray:
    h = np.zeros((256, 256), np.int64)
    for i in range(symbols.size):
        h[context[i], symbols[i]] += 1
    return h


def joint_histogram(context: np.ndarray, symbols: np.ndarray) -> np.ndarray:
    """int64[256, 256]: counts of (context value, symbol) pairs."""
    return _joint_histogram(context, symbols)


def _bits(counts: np.ndarray) -> float:
    return tables.entropy_bits(counts)


def _table_bits(counts: np.ndarray) -> float:
    present = int(np.count_nonzero(counts))
    # Serialized size estimate: count byte, symbol list or bitmap, ~2-byte varints.
    return 8.0 * (1 + min(present, 32) + 2 * present)


def choose(joint: np.ndarray, max_tables: int = DEFAULT_MAX_TABLES) -> np.ndarray | None:
    """Context value -> table index (uint8[256]), or None when one table is as cheap."""
    if not 1 <= max_tables <= 256:
        raise ValueError(f"max_tables must be in 1..256, got {max_tables}")
    per_ctx = joint.sum(axis=1)
    order = sorted(np.flatnonzero(per_ctx), key=lambda c: (-int(per_ctx[c]), int(c)))
    rest = joint.sum(axis=0)
    own: list[int] = []
    for c in order:
        if len(own) + 1 >= max_tables:
            break
        row = joint[c]
        remain = rest - row
        if not remain.any():
            break  # c is the last context in the shared class; nothing to split
        saved = _bits(rest) - _bits(remain) - _bits(row) - _table_bits(row)
        if saved > 0:
            own.append(int(c))
            rest = remain
    if not own:
        return None
    cmap = np.zeros(256, np.uint8)
    for t, c in enumerate(own, start=1):
        cmap[c] = t
    return cmap
