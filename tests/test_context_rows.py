"""``lines._context`` (the per-symbol contexts of a "rans2d" field, made on every decode):
the row-copy path against a numpy reference, for cuts anywhere in a row."""

import numpy as np
import pytest

from entropykit.coding import lines


def _reference(n, cols, phase, rcls, pattern, ccls):
    i = np.arange(n) + phase
    r, j = i // cols, i % cols
    if ccls.size:
        return pattern[rcls[r], ccls[j]]
    return pattern[rcls[r], j if pattern.shape[1] > 1 else 0]


@pytest.mark.parametrize("cols, phase, kc", [(384, 0, 4), (384, 100, 4), (7, 3, 3),
                                             (1000, 999, 8), (64, 5, 1), (33, 0, 2)])
def test_context_matches_reference_for_any_cut(cols, phase, kc):
    rng = np.random.default_rng(cols + phase + kc)
    n = 5 * cols + 17
    rows = (phase + n + cols - 1) // cols
    kr = 3
    rcls = rng.integers(0, kr, rows).astype(np.int64)
    ccls_of = rng.integers(0, kc, cols)
    along = cols if kc > 1 else 1
    pattern = np.empty((kr, along), np.uint8)
    for r in range(kr):
        pattern[r] = r * kc + (ccls_of if kc > 1 else 0)
    want = _reference(n, cols, phase, rcls, pattern, np.empty(0, np.int64))
    for lo, hi in [(0, n), (1, n - 1), (cols - 1, 2 * cols + 1), (n // 2, n // 2),
                   (3, 4)]:
        out = np.full(hi - lo, 255, np.uint8)
        lines._context(lo, hi, cols, phase, rcls, pattern, np.empty(0, np.int64), out)
        assert np.array_equal(out, want[lo:hi])
    # the column-class path (a wide field): pattern indexed by class
    if kc > 1:
        table = (np.arange(kr)[:, None] * kc + np.arange(kc)[None, :]).astype(np.uint8)
        ccls = ccls_of.astype(np.int64)
        out = np.empty(n, np.uint8)
        lines._context(0, n, cols, phase, rcls, table, ccls, out)
        assert np.array_equal(out, want)
