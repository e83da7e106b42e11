"""Independent numpy entropies that the analysis tests check entropykit's numbers against."""

from __future__ import annotations

import numpy as np


def h(symbols: np.ndarray) -> float:
    """Order-0 entropy in bits per symbol."""
    c = np.bincount(symbols, minlength=256).astype(np.float64)
    p = c[c > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


def h_given(ctx: np.ndarray, symbols: np.ndarray) -> float:
    """H(symbols | ctx) in bits per symbol: H(ctx, symbols) - H(ctx)."""
    pair = np.bincount(ctx * 256 + symbols, minlength=65536).astype(np.float64)
    p = pair[pair > 0] / symbols.size
    return float(-(p * np.log2(p)).sum()) - h(ctx)
