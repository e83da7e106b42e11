"""Magnitudes of float tensors: the histogram of log2|w|, read off the field counts.

What it is: ``log2_histogram(counts)`` for a float tensor, in quarter-octave bins
(bin k holds the values with k <= 4 * log2|w| < k + 1), plus the number of zeros and of
non-finite values. No pass over the data: the joint histogram of the two most significant
fields (counts.py) is the histogram of each value's top 16 bits (all of them for BF16,
F16), and one-byte floats have their whole value in their one field. The top bits are
turned back into values through ``formats.join``, so this module knows nothing of where a
split puts the sign. What it is not: a statistic of integer or packed 4-bit tensors (None
for those). F32/F64 values are binned from their top 16 bits, i.e. rounded toward zero to
bf16 (F32) precision first, which can move a value just above a quarter-octave boundary
into the bin below.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import formats
from ._source import ITEMSIZE, NUMPY_DTYPES
from .counts import Counts

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "F8_E8M0"})
BINS_PER_OCTAVE = 4


@dataclass(frozen=True)
class Log2Histogram:
    """Counts of floor(4 * log2|w|) over the non-zero finite values, plus the rest."""

    bins: tuple[tuple[int, int], ...]  # (k, count), k increasing, count > 0
    zeros: int
    nonfinite: int

    def octaves(self) -> dict[int, int]:
        """Counts per whole octave, floor(log2|w|) (the unbiased exponent of normals)."""
        out: dict[int, int] = {}
        for k, c in self.bins:
            out[k // BINS_PER_OCTAVE] = out.get(k // BINS_PER_OCTAVE, 0) + c
        return out


@functools.cache
def _key_bins(dtype: str, names: tuple[str, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """Per top-bits pattern (field 0 byte * 256 + field 1 byte, or the one byte) the index
    of its class, and the classes: the quarter-octave bins present, ascending, then zero,
    then non-finite (indices len(bins) and len(bins) + 1)."""
    word = ITEMSIZE[dtype]
    if word == 1:
        fields = {names[0]: np.arange(256, dtype=np.uint8)}
        nbytes = 256
    else:
        zero = np.zeros(65536, np.uint8)
        fields = {n: zero for n in names}
        fields[names[0]] = np.repeat(np.arange(256, dtype=np.uint8), 256)
        fields[names[1]] = np.tile(np.arange(256, dtype=np.uint8), 256)
        nbytes = 65536 * word
    with np.errstate(invalid="ignore"):  # NaN patterns stay NaN
        mag = np.abs(formats.join(dtype, fields, nbytes).view(NUMPY_DTYPES[dtype])
                     .astype(np.float64))
    finite = np.isfinite(mag)
    real = finite & (mag > 0)
    k = np.floor(BINS_PER_OCTAVE * np.log2(mag[real])).astype(np.int64)
    bins, where = np.unique(k, return_inverse=True)
    index = np.full(mag.size, bins.size + 1, np.int64)
    index[finite & (mag == 0)] = bins.size
    index[real] = where.reshape(-1)
    index.flags.writeable = False
    return index, tuple(bins.tolist())


@njit(nogil=True, cache=True)
def _sum_by(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    # out[j] = sum of weights[i] over i with index[i] == j. Invariant (from _key_bins):
    # 0 <= index[i] < n and len(index) == len(weights).
    out = np.zeros(n, np.int64)
    for i in range(index.size):
        out[index[i]] += weights[i]
    return out


def log2_histogram(counts: Counts) -> Log2Histogram | None:
    """The log2|w| histogram of a float tensor's counts, or None for other tensors."""
    if counts.dtype not in FLOAT_DTYPES or counts.layout is not None:
        return None
    weights = counts.hists[0] if ITEMSIZE[counts.dtype] == 1 else counts.top.reshape(-1)
    index, bins = _key_bins(counts.dtype, counts.names)
    sums = _sum_by(index, np.ascontiguousarray(weights), len(bins) + 2).tolist()
    present = tuple((b, c) for b, c in zip(bins, sums, strict=False) if c)
    return Log2Histogram(present, sums[-2], sums[-1])
