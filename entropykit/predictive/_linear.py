"""out += feats @ weights in a fixed summation order: the same bits on every machine.

What it is: the one matrix product of the conditional residual model, as a Numba loop
whose every output is summed over the features in index order with separate multiply and
add (Numba does not contract them into FMAs), so encoder and decoder agree bit for bit
whatever their BLAS, thread count or SIMD width. Rows are split over threads (each output
is still one thread's sum in index order). What it is not: fast linear algebra.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..coding.parallel import resolve, run

_MIN_ROWS = 64  # rows a thread: below this, threads cost more than they save


@njit(nogil=True, cache=True)
def _accumulate(feats, weights, out):
    for t in range(feats.shape[0]):
        for f in range(feats.shape[1]):
            a = feats[t, f]
            for c in range(weights.shape[1]):  # independent sums: vectorizes, same order
                out[t, c] += a * weights[f, c]


def affine(base: np.ndarray, feats: np.ndarray, weights: np.ndarray,
           threads: int | None = None) -> np.ndarray:
    """``base + feats @ weights`` (float32 [T, C]) with a fixed summation order, on
    ``threads`` threads (None: every core); the result does not depend on them."""
    out = np.array(base, dtype=np.float32, copy=True, order="C")
    f = np.ascontiguousarray(feats, np.float32)
    w = np.ascontiguousarray(weights, np.float32)
    if f.shape != (out.shape[0], w.shape[0]) or w.shape[1] != out.shape[1]:
        raise ValueError(f"shapes {f.shape} @ {w.shape} do not give {out.shape}")
    rows = out.shape[0]
    blocks = max(1, min(resolve(threads), rows // _MIN_ROWS))
    cuts = [rows * i // blocks for i in range(blocks + 1)]
    run(lambda i: _accumulate(f[cuts[i] : cuts[i + 1]], w, out[cuts[i] : cuts[i + 1]]),
        blocks, threads)
    return out
