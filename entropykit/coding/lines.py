"""Line classes: a 2-D field's rows and columns grouped into a few classes by statistics.

What it is: for a field holding one symbol per element of a row-major 2-D array (BF16
exponents, fp8 bytes, F16 high bytes of a weight matrix), the assignment of its rows and
of its columns to at most 16 classes each, the class of every symbol (row class * column
classes + column class: the context a context-conditioned rANS frame codes it with), the
estimated coded size of a choice, and the bit-packed class maps: a context model, like
``contexts.py``, of the symbols alone. What it is not: a coder, a payload layout or the
decision to use it (``container/classed.py``, the "rans2d" codec, stores a choice next to
its frame and bids for fields where it pays).

Geometry: a field of ``n`` symbols is part of an array with rows of ``cols`` symbols, its
first symbol at column ``phase`` (a segment of a tensor starts anywhere in a row). Its rows
are the ``ceil((phase + n) / cols)`` rows it touches; its columns are all ``cols``.

Assignment (deterministic: integer counts, IEEE-exact float operations in a fixed order,
the machine-independent log2 of ``tables``): lines (rows or columns) are histogrammed over
``buckets`` of symbols, sorted by their mean magnitude (symbol & 0x7F: the exponent bits of
a float's top byte; ties by index) and cut into ``k`` classes of equal symbol counts, then
refined by Lloyd iterations on coded size (each line moves to the class whose current
distribution codes it in fewest bits), fitted on a spread sample of lines; then every line
takes its cheapest class.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
from numba import njit

from . import contexts
from .parallel import run, spread
from .tables import _log2

MAX_CLASSES = 16  # per axis; a symbol's context (row class * kc + column class) fits a byte
_ITERS = 4  # Lloyd iterations: fewer leave measurably larger fields
_MAGNITUDE = 0x7F
_BUCKETS = 64  # most buckets a line histogram has
_SHIFT = 2  # coarse buckets: symbol >> _SHIFT
_FIT_LINES = 256  # lines the classes are fitted on (spread evenly); all are then assigned


def n_rows(n: int, cols: int, phase: int) -> int:
    """Rows touched by ``n`` symbols that start at column ``phase`` of rows of ``cols``."""
    return (phase + n + cols - 1) // cols if n else 0


@njit(nogil=True, cache=True)
def _line_hists(sym, dense, hr, hc, cols, phase):
    # Invariant: 0 <= phase < cols; hr has n_rows lines or none (rows not asked), hc has
    # cols lines or none, both C-contiguous; dense[s] < their width. Row by row, so no
    # index leaves its line. A row's counts go to four interleaved copies (acc): runs of
    # one symbol would otherwise stall each increment on the previous one's store. hc is
    # indexed flat: column j's bucket d is hcf[j * width + d].
    n = sym.size
    width = hr.shape[1]
    rows = hr.shape[0] > 0
    columns = hc.shape[0] > 0
    acc = np.zeros(4 * width, np.int64)
    hcf = hc.reshape(-1)
    i = 0
    r = 0
    j0 = phase
    while i < n:
        end = min(n, i + cols - j0)
        off = (j0 - i) * width  # column j0 + t - i of symbol t starts at off + t * width
        for t in range(i, end):
            d = dense[sym[t]]
            if rows:
                acc[(t & 3) * width + d] += 1
            if columns:
                hcf[off + t * width + d] += 1
        if rows:
            for d in range(width):
                hr[r, d] = acc[d] + acc[width + d] + acc[2 * width + d] + acc[3 * width + d]
            acc[:] = 0
        i = end
        r += 1
        j0 = 0


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
    # cost[s, c]: -log2 of symbol s's add-1/2 smoothed frequency in class c.
    k, n_dense = tot.shape
    cost = np.empty((n_dense, k), np.float64)
    for c in range(k):
        total = 0
        for s in range(n_dense):
            total += tot[c, s]
        lt = _log2(total + 0.5 * n_dense)
        for s in range(n_dense):
            cost[s, c] = lt - _log2(tot[c, s] + 0.5)
    return cost


_TILE = 64  # lines whose bits are summed together, as one vector per class


@njit(nogil=True, cache=True)
def _add_scaled(acc, v, w, m):
    # acc[:m] += v[:m] * w, element by element (a loop of its own: LLVM vectorizes it).
    for q in range(m):
        acc[q] += v[q] * w


@njit(nogil=True, cache=True)
def _reassign(h, lines, cls, cost):
    # Move each of ``lines`` to the class that codes it in fewest bits (ties: lowest class).
    # A line's bits for class c: sum over buckets s, in increasing s, of h[line, s] *
    # cost[s, c]; zero counts add +0.0, which leaves a sum of non-negative terms unchanged,
    # so this equals the sum over the line's nonzero buckets only. Lines go in tiles,
    # transposed (ht[s, q]), so the sums of a tile's lines advance together as vectors:
    # each line's own sum still runs in increasing s.
    k = cost.shape[1]
    width = h.shape[1]
    ht = np.empty((width, _TILE), np.float64)
    bits = np.empty((k, _TILE), np.float64)
    moved = 0
    for t0 in range(0, lines.size, _TILE):
        m = min(_TILE, lines.size - t0)
        for q in range(m):
            line = lines[t0 + q]
            for s in range(width):
                ht[s, q] = h[line, s]
        bits[:, :m] = 0.0
        for s in range(width):
            for c in range(k):
                _add_scaled(bits[c], ht[s], cost[s, c], m)
        for q in range(m):
            best = 0
            for c in range(1, k):
                if bits[c, q] < bits[best, q]:
                    best = c
            line = lines[t0 + q]
            if best != cls[line]:
                moved += 1
                cls[line] = best
    return moved


@njit(nogil=True, cache=True)
def _lloyd(h, cls, k, iters, fit):
    # Lloyd iterations on the lines ``fit`` (a spread sample of at most _FIT_LINES), then
    # every line assigned once against the classes they fitted: a pass costs the lines'
    # buckets x k, so fitting on every line of a large tensor would dominate.
    n_lines = h.shape[0]
    for _ in range(iters):
        cost = _costs(_group(h[fit], cls[fit], k))
        if _reassign(h, fit, cls, cost) == 0:
            break
    if fit.size < n_lines:
        cost = _costs(_group(h[fit], cls[fit], k))
        _reassign(h, np.arange(n_lines), cls, cost)
    return cls


def buckets(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the line histograms count: (int64[256] symbol -> bucket, each bucket's
    magnitude). The present symbols themselves, or where more than ``_BUCKETS`` are present
    (fp8 bytes) their top 6 bits: classes follow a line's scale and sign balance, which
    the top bits carry (as well as whole bytes do, while the magnitude alone, without the
    sign, does not), and the histograms and Lloyd passes shrink 4x."""
    present = np.flatnonzero(counts)
    coarse = present.size > _BUCKETS
    key = present >> _SHIFT if coarse else present
    keys = np.unique(key)
    index = np.zeros(256, np.int64)
    index[present] = np.searchsorted(keys, key)
    return index, keys & (_MAGNITUDE >> _SHIFT if coarse else _MAGNITUDE)


def line_histograms(sym: np.ndarray, index: np.ndarray, n_buckets: int, cols: int,
                    phase: int, rows: bool = True, columns: bool = True
                    ) -> tuple[np.ndarray, np.ndarray]:
    """[lines, n_buckets] counts per row and per column (in one pass) of each bucket
    (``buckets``' index; ``n_buckets`` >= 1); int32 (int64 from 2**31 symbols); an axis
    not asked for has 0 lines."""
    wide = np.int32 if sym.size < 1 << 31 else np.int64  # a line holds <= n symbols
    hr = np.zeros((n_rows(sym.size, cols, phase) if rows else 0, n_buckets), wide)
    hc = np.zeros((cols if columns else 0, n_buckets), wide)
    if not (rows or columns):
        return hr, hc
    dense = index.astype(np.uint8)
    parts = _row_parts(sym.size, cols, phase)
    if len(parts) <= 1:
        _line_hists(sym, dense, hr, hc, cols, phase)
        return hr, hc

    def part(k: int) -> np.ndarray:
        # Rows are disjoint between parts; each part counts its columns apart (summed).
        a, b, r0, r1 = parts[k]
        own = hc if k == 0 else np.zeros_like(hc)
        _line_hists(sym[a:b], dense, hr[r0:r1] if rows else hr, own, cols,
                    phase if a == 0 else 0)
        return own

    for own in run(part, len(parts), 1)[1:]:
        hc += own
    return hr, hc


def _row_parts(n: int, cols: int, phase: int) -> list[tuple[int, int, int, int]]:
    """(first symbol, end, first row, end row) of the parts a pass over ``n`` symbols
    starting at column ``phase`` is split into: whole rows, about ``contexts.PART``
    symbols each. Run with ``run(.., 1)``: serial, or inside a running call on its
    threads; the summed counts are exact whatever the split."""
    rows = n_rows(n, cols, phase)
    if spread(1) == 1:  # one thread: one pass, no partial counts to sum
        return [(0, n, 0, rows)]
    step = max(1, contexts.PART // cols)
    starts = list(range(0, rows, step))
    return [(max(0, r * cols - phase), min(n, (r + step) * cols - phase), r,
             min(rows, r + step)) for r in starts]


@njit(nogil=True, cache=True)
def _line_sums(h, mag):
    # (symbols of each line, sum of their magnitudes), int64; each line summed in registers.
    counts = np.empty(h.shape[0], np.int64)
    sums = np.empty(h.shape[0], np.int64)
    for line in range(h.shape[0]):
        c = 0
        t = 0
        for s in range(h.shape[1]):
            v = np.int64(h[line, s])
            c += v
            t += v * mag[s]
        counts[line] = c
        sums[line] = t
    return counts, sums


def assign(h: np.ndarray, magnitude: np.ndarray, k: int, iters: int | None = None
           ) -> np.ndarray:
    """uint8 class (< ``k``) of every line of ``h`` (from ``line_histograms``);
    ``magnitude``: of each bucket (``buckets``)."""
    n_lines = h.shape[0]
    counts, sums = _line_sums(h, magnitude)
    mean = sums / np.maximum(counts, 1)  # correctly rounded division: same on every machine
    order = np.argsort(mean, kind="stable")
    before = np.cumsum(counts[order]) - counts[order]  # symbols in lines sorted before
    total = max(1, int(counts.sum()))
    cls = np.empty(n_lines, np.int64)
    cls[order] = np.minimum(k - 1, before * k // total)
    return _lloyd(h, cls, k, _ITERS if iters is None else iters, _fit(n_lines)).astype(np.uint8)


@functools.lru_cache(maxsize=64)
def _fit(n_lines: int) -> np.ndarray:
    """The lines the classes are fitted on: at most _FIT_LINES, spread evenly. Cached: a
    tensor's segments have the same few line counts (``_lloyd`` only reads it)."""
    return np.unique(np.linspace(0, n_lines - 1, min(n_lines, _FIT_LINES)).astype(np.int64))


@njit(nogil=True, cache=True)
def _context(lo, hi, cols, phase, rcls, pattern, ccls, out):
    # out[i - lo] = the context of symbol i, lo <= i < hi. Invariant: 0 <= lo <= hi <= n,
    # rcls has n_rows entries, each < pattern.shape[0]; with ``ccls`` empty, pattern[k] is
    # row class k's contexts along a row (cols entries, or one where they do not vary),
    # so each row is a copy or fill; the copy loops over two views of the row's own
    # length, which Numba vectorizes (indexing ``out`` by ``i - lo + q`` kept it
    # scalar); else ccls holds cols classes,
    # each < pattern.shape[1], and the context of row class k, column class c is
    # pattern[k, c].
    along = pattern.shape[1] > 1
    r, j0 = divmod(phase + lo, cols)
    i = lo
    while i < hi:
        m = min(hi - i, cols - j0)
        row = pattern[rcls[r]]
        dst = out[i - lo : i - lo + m]
        if ccls.size:
            cc = ccls[j0 : j0 + m]
            for q in range(m):
                dst[q] = row[cc[q]]
        elif along:
            src = row[j0 : j0 + m]
            for q in range(m):
                dst[q] = src[q]
        else:
            dst[:] = row[0]
        i += m
        r += 1
        j0 = 0


@njit(nogil=True, cache=True)
def _count(sym, cols, phase, rcls, pattern, ccls, kmax):
    # (context, symbol) counts of the contexts _context would make, without making them
    # (same invariant; every context < kmax), in four interleaved copies so that no
    # increment waits on the last.
    parts = np.zeros((4, kmax, 256), np.int64)
    along = pattern.shape[1] > 1
    n = sym.size
    i = 0
    r = 0
    j0 = phase
    while i < n:
        m = min(n - i, cols - j0)
        row = pattern[rcls[r]]
        if ccls.size:
            for q in range(m):
                t = i + q
                parts[t & 3, row[ccls[j0 + q]], sym[t]] += 1
        elif along:
            for q in range(m):
                t = i + q
                parts[t & 3, row[j0 + q], sym[t]] += 1
        else:
            c = row[0]
            for q in range(m):
                t = i + q
                parts[t & 3, c, sym[t]] += 1
        i += m
        r += 1
        j0 = 0
    joint = np.zeros((256, 256), np.int64)
    for q in range(4):
        for c in range(kmax):
            for s in range(256):
                joint[c, s] += parts[q, c, s]
    return joint


# A row class's contexts are laid out along a whole row (a slice copy per row) while all
# of them take at most this many bytes per symbol of the field (plus _PATTERN_SLACK);
# beyond, a symbol's context is looked up through its column's class, so that memory
# follows the field, never a long row (the encoder classes columns only where each holds
# a symbol at least: its patterns are always laid out).
_PATTERN_PER_SYMBOL = 16
_PATTERN_SLACK = 1 << 20


def _context_args(n: int, cols: int, phase: int, rcls: np.ndarray | None,
                  ccls: np.ndarray | None, kc: int, cmap: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row classes, pattern, column classes) for ``_context`` and ``_count``, each
    context mapped through ``cmap`` if given: uint8[kr, cols] contexts along a row of
    each row class and no column classes; uint8[kr, 1] when the columns are not classed
    (a row's contexts are all its row class's, whatever ``cols`` is); or, where the
    former would be large, uint8[kr, kc] by (row class, column class) and the uint8
    column classes."""
    rows = n_rows(n, cols, phase)
    assert (rcls is None or rcls.size == rows) and (kc == 1 or ccls is not None
                                                   and ccls.size == cols)
    rc = (np.zeros(max(1, rows), np.int64) if rcls is None
          else np.ascontiguousarray(rcls, np.int64))
    kr = int(rc.max(initial=0)) + 1
    none = np.zeros(0, np.uint8)
    if ccls is None:
        along, indirect = np.zeros(1, np.uint8), none
    elif kr * cols <= _PATTERN_PER_SYMBOL * n + _PATTERN_SLACK:
        along, indirect = np.asarray(ccls, np.uint8), none
    else:
        along, indirect = np.arange(kc, dtype=np.uint8), np.ascontiguousarray(ccls, np.uint8)
    # Contexts are below 256 (the caller checks), so uint8 arithmetic is exact.
    pattern = np.arange(kr, dtype=np.uint8)[:, None] * np.uint8(kc) + along[None, :]
    return rc, pattern if cmap is None else np.asarray(cmap, np.uint8)[pattern], indirect


def context(n: int, cols: int, phase: int, rcls: np.ndarray | None,
            ccls: np.ndarray | None, kc: int, cmap: np.ndarray | None = None) -> np.ndarray:
    """uint8[n]: each symbol's class, ``rcls[row] * kc + ccls[column]``, or with ``cmap``
    (uint8[256]) its image ``cmap[class]`` (a frame's table index, at no extra cost).

    ``rcls``: one class per row touched (``n_rows``), or None for no row classes;
    ``ccls``: one per column (``cols``), or None (then ``kc`` must be 1). The caller
    checks that the classes make contexts below 256.
    """
    return context_source(n, cols, phase, rcls, ccls, kc, cmap)(0, n)


def context_source(n: int, cols: int, phase: int, rcls: np.ndarray | None,
                   ccls: np.ndarray | None, kc: int, cmap: np.ndarray | None = None
                   ) -> Callable[[int, int], np.ndarray]:
    """``context``'s values on demand: a function of (lo, hi) giving those of symbols
    lo..hi-1 (uint8, new), so a decoder can make them group by group while they are in
    cache instead of n bytes up front. ValueError unless 0 <= lo <= hi <= n."""
    rc, pattern, indirect = _context_args(n, cols, phase, rcls, ccls, kc, cmap)

    def part(lo: int, hi: int) -> np.ndarray:
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"contexts of symbols {lo}..{hi} asked, the field has {n}")
        out = np.empty(hi - lo, np.uint8)
        _context(lo, hi, cols, phase, rc, pattern, indirect, out)
        return out

    return part


def context_counts(sym: np.ndarray, cols: int, phase: int, rcls: np.ndarray | None,
                   ccls: np.ndarray | None, kc: int) -> np.ndarray:
    """The int64[256, 256] (context, symbol) counts of ``sym`` with ``context(...)``'s
    contexts, without making them (one pass over ``sym``)."""
    rc, pattern, indirect = _context_args(sym.size, cols, phase, rcls, ccls, kc)
    kmax = int(pattern.max(initial=0)) + 1
    parts = _row_parts(sym.size, cols, phase)
    if len(parts) <= 1:
        return _count(sym, cols, phase, rc, pattern, indirect, kmax)

    def part(k: int) -> np.ndarray:
        a, b, r0, _ = parts[k]
        return _count(sym[a:b], cols, phase if a == 0 else 0, rc[r0:], pattern, indirect,
                      kmax)

    return sum(run(part, len(parts), 1))


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
    # A byte per class (w <= 8 bits each), assembled a bit position at a time over all
    # classes (packbits along rows of w bits pays its overhead per class).
    per = bits[: count * w].reshape(count, w)
    classes = per[:, 0].copy()
    for i in range(1, w):
        classes |= per[:, i] << np.uint8(i)
    if classes.size and int(classes.max()) >= k:
        return None
    return classes


def estimate_bits(joint: np.ndarray, max_tables: int = contexts.DEFAULT_MAX_TABLES) -> float:
    """Estimated bits of a context frame for this (context, symbol) histogram: the entropy
    of each table class ``contexts.choose`` would make, plus its serialized table."""
    cmap = contexts.choose(joint, max_tables)
    if cmap is None:
        return contexts.rows_bits(joint.sum(axis=0)[None, :], 0.0)
    # 8 * 257: the frame's class count and context map.
    return contexts.rows_bits(contexts.class_counts(joint, cmap), 8.0 * 257)
