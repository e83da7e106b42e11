"""Byte planes: the one transform every dtype split is built from.

What it is: ``Planes``, the description of a split (element width, one named field per byte
plane, each field's optional context, the sign move), and the two Numba kernels that turn an
array of elements into its planes and back. What it is not: the choice of split for a dtype
(floats.py, integers.py, packed4.py) or input validation (registry.py).

Plane p of a W-byte little-endian element holds its byte W-1-p: most significant first, so a
field's context (always a more significant field) precedes it. With ``sign_move`` (floats with
a sign and an 8-bit exponent: BF16, F32) the sign bit moves from the top of plane 0 to the top
of plane 1, which makes the exponent a whole byte:

    top 16 bits    s eeeeeeee mmmmmmm
    plane 0        eeeeeeee              "exponent"
    plane 1        s mmmmmmm             "sign_mantissa"

Both directions are bijections on every bit pattern (NaN payloads, -0.0, subnormals).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass(frozen=True)
class Planes:
    """How a dtype splits: ``word``-byte elements into one field per byte plane."""

    word: int  # bytes per element of the planes (1 = the bytes themselves are the field)
    names: tuple[str, ...]  # one per plane, most significant byte first
    contexts: tuple[str | None, ...]  # per plane: a more significant field's name, or None
    sign_move: bool = False  # planes 0, 1 are exponent, sign_mantissa (see module docstring)

    def __post_init__(self) -> None:
        assert len(self.names) == len(self.contexts) == self.word
        assert not self.sign_move or self.word >= 2
        for i, ctx in enumerate(self.contexts):
            assert ctx is None or ctx in self.names[:i], (self.names[i], ctx)


def int_view(data: np.ndarray, word: int) -> np.ndarray:
    """``data`` (1-D uint8, size a multiple of ``word``) as little-endian signed integers.

    Signed so that the kernels compute in int64 without mixing signedness: the fields never
    read a bit at or above 8 * word, so sign extension cannot reach them. The kernels assume a
    little-endian host (numba arrays are native-endian), as do numpy views of safetensors.
    """
    return data.view(np.dtype(f"<i{word}"))


@njit(nogil=True, cache=True)
def split_planes(words, sign_move, planes):
    """Fill ``planes`` (a tuple of W uint8 arrays) from ``words`` (W-byte integers)."""
    # Invariant, checked by the caller: len(planes) == words.itemsize == W >= 2 and every
    # plane holds words.size bytes, so every index below is in bounds.
    top = 8 * (len(planes) - 1)  # shift of the most significant byte
    hi, lo = planes[0], planes[1]
    n = words.size
    if sign_move:
        for i in range(n):
            w = np.int64(words[i])
            hi[i] = (w >> (top - 1)) & 0xFF
            lo[i] = ((w >> top) & 0x80) | ((w >> (top - 8)) & 0x7F)
    else:
        for i in range(n):
            w = np.int64(words[i])
            hi[i] = (w >> top) & 0xFF
            lo[i] = (w >> (top - 8)) & 0xFF
    # One pass per remaining plane: a loop-invariant shift lets LLVM vectorize it.
    for p in range(2, len(planes)):
        plane = planes[p]
        shift = top - 8 * p
        for i in range(n):
            plane[i] = (np.int64(words[i]) >> shift) & 0xFF


@njit(nogil=True, cache=True)
def join_planes(planes, sign_move, words):
    """Fill ``words`` (W-byte integers) from ``planes``; the exact inverse of split_planes."""
    # Same invariant as split_planes. Shifts wrap in int64 and stores truncate to W bytes,
    # which is exactly the bit pattern wanted.
    top = 8 * (len(planes) - 1)
    hi, lo = planes[0], planes[1]
    n = words.size
    if sign_move:
        for i in range(n):
            e = np.int64(hi[i])
            sm = np.int64(lo[i])
            top_byte = (sm & 0x80) | (e >> 1)
            next_byte = ((e & 1) << 7) | (sm & 0x7F)
            words[i] = (top_byte << top) | (next_byte << (top - 8))
    else:
        for i in range(n):
            words[i] = (np.int64(hi[i]) << top) | (np.int64(lo[i]) << (top - 8))
    for p in range(2, len(planes)):
        plane = planes[p]
        shift = top - 8 * p
        for i in range(n):
            words[i] |= np.int64(plane[i]) << shift


# Below this many elements the planes are computed with numpy: the same bytes, without
# compiling a kernel for the element width (a small tensor of another dtype in a file, or
# the empty split that only names the fields, would otherwise compile one).
SMALL = 1 << 14


def split_words(words: np.ndarray, sign_move: bool, planes: tuple[np.ndarray, ...]) -> None:
    """``split_planes``, in numpy for fewer than ``SMALL`` elements."""
    if words.size >= SMALL:
        split_planes(words, sign_move, planes)
        return
    w = words.astype(np.int64)
    top = 8 * (len(planes) - 1)
    if sign_move:
        planes[0][:] = (w >> (top - 1)) & 0xFF
        planes[1][:] = ((w >> top) & 0x80) | ((w >> (top - 8)) & 0x7F)
    else:
        planes[0][:] = (w >> top) & 0xFF
        planes[1][:] = (w >> (top - 8)) & 0xFF
    for p in range(2, len(planes)):
        planes[p][:] = (w >> (top - 8 * p)) & 0xFF


def join_words(planes: tuple[np.ndarray, ...], sign_move: bool, words: np.ndarray) -> None:
    """``join_planes``, in numpy for fewer than ``SMALL`` elements."""
    if words.size >= SMALL:
        join_planes(planes, sign_move, words)
        return
    top = 8 * (len(planes) - 1)
    hi, lo = planes[0].astype(np.int64), planes[1].astype(np.int64)
    if sign_move:
        w = ((((lo & 0x80) | (hi >> 1)) << top)
             | ((((hi & 1) << 7) | (lo & 0x7F)) << (top - 8)))
    else:
        w = (hi << top) | (lo << (top - 8))
    for p in range(2, len(planes)):
        w |= planes[p].astype(np.int64) << (top - 8 * p)
    words[:] = w.astype(words.dtype)  # wraps to the word's width, as the kernel's stores
