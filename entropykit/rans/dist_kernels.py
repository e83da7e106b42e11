"""Numba kernels of per-symbol-distribution rANS (one chunk per call).

What it is: the integer CDF of one value under its own (mu, sigma, model) and the 32-lane
encode/decode loops over it. What it is not: the frame, model building or validation
(``distribution.py``); every input array here is assumed to have passed those checks,
except the payload, which is untrusted and bounds-checked on every read.

Value space. A float format of W = 8 or 16 bits maps onto keys 0..2**W - 1 in numeric
order: key = bits ^ 0x80..0 for a positive sign, bits ^ 0xff..f for a negative one. So
-NaN payloads < -inf < ... < -0 < +0 < ... < +inf < +NaN payloads, every bit pattern its own
key. Key k's bin is [B(k), B(k+1)) with B(k) the midpoint between the values of keys k-1
and k (B(half) = 0 splits -0 | +0). A boundary next to a non-finite key is +-inf, so inf
and NaN keys get no smooth mass and the largest finite value takes the tail.

Smooth CDF at a key boundary, in fixed point ONE = 2**31 (integers only from here on):
    sigma -> (e, r): sigma ~ (1 + r/2**8) * 2**e          (8 mantissa bits, rounded)
    u = 2**(e - 16);  mu_u = round(mu / u)                  (mu grid: sigma/65536)
    D(k) = floor(B(k) / u) - mu_u, clamped where |z| = 32 (exact dyadic shifts)
    z(k) = (D * R[r]) >> 32 = D * 2**-16 / (1 + r/2**8) in units of 2**-22
    F(k) = shape table interpolated at z (64 points per unit, z in [-32, 32])
    S(k) = (F * (2**16 - w) + E(k) * w) >> 16              (E: empirical table over keys)
S is non-decreasing in k with S(0) = 0 and S(2**W) = ONE.

Stages. A value is coded as its key's top byte, then (16-bit formats) its low byte given
the top byte, each a 256-symbol rANS step with precision p <= 16 (32-bit state, 16-bit
words). A stage over keys b + j*st, j in 0..256, with S_b = S(b), T = S(b + 256 st) - S_b:
    cdf(j) = j + floor((2**p - 256) * (S(b + j st) - S_b) / T)     (T > 0)
    cdf(j) = j * 2**(p - 8)                                          (T = 0)
so every symbol has frequency >= 1: no value is ever unencodable.

Stream: the static coder's (kernels.py) with each stage a step: state x in [2**16, 2**32),
value i on lane i % 32; the decoder reads words forwards step by step, lanes 0..31 in each
step, where a group of 32 values is one step for the top bytes then (16-bit formats) one
step for the low bytes; each lane that needs a word takes the next one. The encoder runs
the same order backwards, writing words downward. Payload = 32 u32 start states, then the
u16 words. Decoding guesses each symbol from a float inverse of the shape
(any guess is fine: it only sets where the exact integer search starts).
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

# No kernel allocates: callers pass every buffer in. That lets them run without Numba's
# reference counting, whose incref/decref pairs around inlined helpers taking arrays were
# not pruned and cost ~4x the arithmetic of a CDF evaluation.
_kernel = njit(nogil=True, cache=True, _nrt=False)
# Helpers called several times per value: inlined by Numba itself (LLVM's cost model
# declines, and a call passes every array field by value).
_inline = njit(nogil=True, cache=True, _nrt=False, inline="always")

LANES = 32
L = 1 << 16
STATE_BYTES = 4 * LANES
ONE_BITS = 31
ONE = 1 << ONE_BITS
Z_GRID_BITS = 6  # shape table points per unit of z: 2**6
Z_MAX = 32
Z_POINTS = (2 * Z_MAX) << Z_GRID_BITS  # intervals of the shape table (4097 entries)
Z_FRAC = 16  # interpolation bits between shape table points
Z_SHIFT = Z_GRID_BITS + Z_FRAC  # z in fixed point: units of 2**-22
MU_RANGE = 34  # refused: mu's exponent field >= sigma's + MU_RANGE (``_invalid``)
MU_BITS = 16  # mu grid step: sigma's power of two / 2**16
SIGMA_BITS = 8  # mantissa bits of the quantized sigma
R_SHIFT = 32
D_BIG = 1 << 40  # D of a boundary next to inf / NaN: beyond any clamp
EMP_POINTS = 256  # intervals of the empirical table (one per top-byte value)
INV_POINTS = 4096  # intervals of the float inverse-shape table (guesses only)
WEIGHT_ONE = 1 << 16

OK = 0
ERR_STATE = 1
ERR_TRUNCATED = 2
ERR_TRAILING = 3
ERR_FINAL = 4
ERR_ODD = 5
MESSAGES = {
    ERR_STATE: "a lane's start state is below 2**16",
    ERR_TRUNCATED: "payload ends before the last value",
    ERR_TRAILING: "payload has words after the last value",
    ERR_FINAL: "a lane did not end in the initial state (corrupt payload, or mu/sigma/model "
    "differ from the encoder's)",
    ERR_ODD: "payload is not 128 state bytes plus whole 16-bit words",
}


# The value format and one value's quantized parameters, as the helpers see them.
Fmt = namedtuple("Fmt", "nkeys mant bias nonfinite es")
Val = namedtuple("Val", "mu_u ue rr m w dl cb")


def reciprocals() -> np.ndarray:
    """int64[2, 256] by sigma mantissa r: R = round(2**(R_SHIFT + 22 - MU_BITS) / (1 + r/256))
    and the clamp dl = floor(Z_MAX * 2**(22 + R_SHIFT) / R) that keeps |z| <= Z_MAX."""
    num = 1 << (R_SHIFT + Z_SHIFT - MU_BITS + SIGMA_BITS)
    den = range(1 << SIGMA_BITS, 2 << SIGMA_BITS)
    rr = [(num + d // 2) // d for d in den]
    return np.array([rr, [(Z_MAX << (Z_SHIFT + R_SHIFT)) // r for r in rr]], np.int64)


@_inline
def _fmt(fp):
    return Fmt(fp[0], fp[1], fp[2], fp[3], fp[4])


@_inline
def _invalid(mu_bits, sg_bits):
    """Non-zero unless mu is finite, sigma is finite and > 0, and mu's exponent field is
    below sigma's + MU_RANGE (|mu| < 2**35 sigma; both as float32 bits). Beyond ~2**(mant
    + 33) sigma (2**35 for e5m2) the fixed-point shifts saturate inside the clamp and S
    need not be monotone (bf16 frames at 2**42 did not decode): such pairs are refused."""
    sb = np.int64(sg_bits)
    em = (np.int64(mu_bits) >> 23) & 0xFF
    return ((sb >> 31) | (sb == 0) | ((sb >> 23) & 0xFF == 0xFF) | (em == 0xFF)
            | (em - max((sb >> 23) & 0xFF, 1) >= MU_RANGE))


@_kernel
def first_invalid(mu_bits, sg_bits):
    """Index of the first (mu, sigma) pair ``_params`` refuses, or -1."""
    n = mu_bits.size
    bad = 0
    for i in range(n):  # no early exit: a vectorizable OR over the valid common case
        bad |= _invalid(mu_bits[i], sg_bits[i])
    if bad:
        for i in range(n):
            if _invalid(mu_bits[i], sg_bits[i]):
                return i
    return -1


@_inline
def _params(mu_bits, sg_bits, m, ws, rtab, f):
    """Quantize one (mu, sigma) pair given as float32 bits: (ok, Val)."""
    if _invalid(mu_bits, sg_bits):
        return False, Val(0, 0, 0, 0, 0, 0, 0)
    sb = np.int64(sg_bits)
    e = (sb >> 23) & 0xFF
    mb = np.int64(mu_bits)
    em = (mb >> 23) & 0xFF
    if e == 0:  # subnormal sigma: use the smallest normal one
        e, r = 1, 0
    else:
        r = ((sb & 0x7FFFFF) + (1 << 14)) >> 15
        if r == 1 << SIGMA_BITS:
            r = 0
            e += 1
            if e == 0xFF:
                e, r = 0xFE, (1 << SIGMA_BITS) - 1
    ue = e - 127 - MU_BITS
    mm = mb & 0x7FFFFF
    if em > 0:
        mm |= 1 << 23
    sh = max(em, 1) - 150 - ue
    if sh >= 0:
        mu_u = mm << min(sh, 36)  # |mu| < 2**35 sigma here (``_invalid``)
    elif sh < -40:
        mu_u = 0
    else:
        mu_u = (mm + (1 << (-sh - 1))) >> -sh
    if mb >> 31:
        mu_u = -mu_u
    return True, Val(mu_u, ue, rtab[0, r], np.int64(m), ws[m], rtab[1, r],
                     f.bias + f.mant + 1 + ue)


@_inline
def _offset(k, v, f):
    """D(k) = floor(B(k) / u) - mu_u for 0 < k < nkeys (not yet clamped).

    Arithmetic rather than branches wherever a branch would follow the data (the sign of
    a value, how far it is from u), so that it never mispredicts.
    """
    y = k - (f.nkeys >> 1)
    if y == 0:
        return -v.mu_u
    a = abs(y) - 1  # the smaller magnitude of keys k-1 and k
    if a + 1 >= f.nonfinite:
        return D_BIG if y > 0 else -D_BIG
    neg = (y >> 63) & 1
    e1 = max(a >> f.mant, 1)  # exponent field, subnormals read as 1
    # B = +-mid * 2**(e1 - cb) with mid = 2 * (implicit bit | mantissa) + 1, odd.
    mid = 2 * a + 1 - ((e1 - 1) << (f.mant + 1))
    sh = min(max(e1 - v.cb, -62), 50)
    # floor(mid * 2**sh) for B > 0; floor(-mid * 2**sh) = ~floor((mid * 2**sh - 1)) for
    # B < 0 (mid is odd, so a right shift always drops a non-zero remainder).
    t = ((mid << max(sh, 0)) - neg) >> max(-sh, 0)
    return (t ^ -neg) - v.mu_u


@_inline
def _smooth_cdf(k, v, f, shapes, emps):
    """S(k): mass of all keys below k, in units of 2**-31 (module docstring).

    ``shapes`` rows carry one padding entry (= ONE) so that z clamped to +Z_MAX reads
    T[Z_POINTS] + 0 * (T[Z_POINTS+1] - T[Z_POINTS]) without a branch.
    """
    if k <= 0:
        return 0
    if k >= f.nkeys:
        return ONE
    d = min(max(_offset(k, v, f), -v.dl), v.dl)  # so |z| <= Z_MAX, and no overflow
    zf = (d * v.rr) >> R_SHIFT
    ix = np.uint64((zf >> Z_FRAC) + (Z_MAX << Z_GRID_BITS))  # >= 0: unsigned skips wraparound
    t0 = np.int64(shapes[v.m, ix])
    s = t0 + (((np.int64(shapes[v.m, ix + 1]) - t0) * (zf & ((1 << Z_FRAC) - 1))) >> Z_FRAC)
    if v.w:
        b = np.uint64(k >> f.es)
        e0 = np.int64(emps[v.m, b])
        e = e0 + (((np.int64(emps[v.m, b + 1]) - e0) * (k & ((1 << f.es) - 1))) >> f.es)
        s = (s * (WEIGHT_ONE - v.w) + e * v.w) >> 16
    return s


@_inline
def _stage_cdf(j, sj, sb, t, spread):
    # spread = 2**p - 256: the mass left after every symbol's floor of 1.
    if t == ONE:
        return j + ((spread * (sj - sb)) >> ONE_BITS)
    if t == 0:
        return j * ((spread + 256) >> 8)
    return j + np.int64(np.uint64(spread * (sj - sb)) // np.uint64(t))


@_inline
def _key(bits, nkeys):
    half = nkeys >> 1
    return bits ^ (nkeys - 1) if bits & half else bits ^ half


@_inline
def _bits(key, nkeys):
    half = nkeys >> 1
    return key ^ half if key >= half else key ^ (nkeys - 1)


@_inline
def _value_cdfs(key, v, f, shapes, emps, spread):
    """[cdf(j), cdf(j+1)) of the key's top byte, then of its low byte (16-bit formats)."""
    j = key >> f.es  # the top byte: keys j * 2**es .. (j+1) * 2**es - 1
    b = j << f.es
    s0 = _smooth_cdf(b, v, f, shapes, emps)
    s1 = _smooth_cdf(b + (1 << f.es), v, f, shapes, emps)
    t0 = _stage_cdf(j, s0, 0, ONE, spread)
    t1 = _stage_cdf(j + 1, s1, 0, ONE, spread)
    if f.es == 0:
        return t0, t1, 0, 0
    lo = key - b
    l0 = _stage_cdf(lo, _smooth_cdf(key, v, f, shapes, emps), s0, s1 - s0, spread)
    l1 = _stage_cdf(lo + 1, _smooth_cdf(key + 1, v, f, shapes, emps), s0, s1 - s0, spread)
    return t0, t1, l0, l1


@_inline
def _enc_step(xs, c0, c1, precision, out, pos):
    """Push one symbol of [c0, c1) onto state ``xs``; ``out[pos-2:pos]`` must exist.

    The word is stored whether or not it is emitted: an unused store lies below the
    payload and is overwritten or dropped, and the renormalization stays branch-free.
    """
    fr = c1 - c0
    emit = xs >= fr << (32 - precision)
    out[pos - 2] = xs & 0xFF
    out[pos - 1] = (xs >> 8) & 0xFF
    xs = xs >> 16 if emit else xs
    q = np.int64(np.uint64(xs) // np.uint64(fr))  # both >= 0: unsigned division is cheaper
    return (q << precision) + (xs - q * fr) + c0, pos - 2 * emit


@_kernel
def encode_chunk(vals, mu_bits, sg_bits, midx, fp, shapes, emps, ws, rtab, precision, st, out):
    """Encode ``vals`` (format bits) into ``out``; return (status, start).

    ``st`` is int64[5, 32] scratch (lane states, then each lane's stage CDFs). status 0:
    the payload is ``out[start:]``. status 1: it did not fit (store raw). status 2:
    mu/sigma at index ``start`` are invalid (NaN, inf, sigma <= 0).
    """
    f = _fmt(fp)
    n = vals.size
    spread = (1 << precision) - 256
    per_value = midx.size > 1
    two = f.nkeys > 256
    st[0, :] = L
    pos = out.size
    for g0 in range((n - 1) & -LANES, -1, -LANES):  # groups of 32 values, last first
        m = min(LANES, n - g0)
        if pos - 4 * m < STATE_BYTES:  # room for the group's words, written branch-free
            return 1, 0
        for lane in range(m):
            i = g0 + lane
            ok, v = _params(mu_bits[i], sg_bits[i], midx[i] if per_value else midx[0], ws, rtab, f)
            if not ok:
                return 2, i
            st[1, lane], st[2, lane], st[3, lane], st[4, lane] = _value_cdfs(
                _key(np.int64(vals[i]), f.nkeys), v, f, shapes, emps, spread)
        if two:  # the low-byte step last: the decoder reads it after the top-byte step
            for lane in range(m - 1, -1, -1):
                st[0, lane], pos = _enc_step(st[0, lane], st[3, lane], st[4, lane], precision,
                                             out, pos)
        for lane in range(m - 1, -1, -1):
            st[0, lane], pos = _enc_step(st[0, lane], st[1, lane], st[2, lane], precision,
                                         out, pos)
    pos -= STATE_BYTES
    for lane in range(LANES):
        s = st[0, lane]
        o = pos + 4 * lane
        out[o] = s & 0xFF
        out[o + 1] = (s >> 8) & 0xFF
        out[o + 2] = (s >> 16) & 0xFF
        out[o + 3] = (s >> 24) & 0xFF
    return 0, pos


@_kernel
def cost(vals, mu_bits, sg_bits, midx, fp, shapes, emps, ws, rtab, precision, out):
    """-log2 P(value) of each value into ``out``; the first invalid index, or -1."""
    f = _fmt(fp)
    spread = (1 << precision) - 256
    per_value = midx.size > 1
    for i in range(vals.size):
        ok, v = _params(mu_bits[i], sg_bits[i], midx[i] if per_value else midx[0], ws, rtab, f)
        if not ok:
            return i
        t0, t1, l0, l1 = _value_cdfs(_key(np.int64(vals[i]), f.nkeys), v, f, shapes, emps,
                                     spread)
        out[i] = precision - np.log2(t1 - t0)
        if f.es:
            out[i] += precision - np.log2(l1 - l0)
    return -1


@_inline
def _nearest_key(x, f, scratch, scratch_bits):
    """The key of the format value nearest to float ``x`` (a search start only)."""
    scratch[0] = x
    b = np.int64(scratch_bits[0])
    a = b & 0x7FFFFFFF
    # Round |value| to the nearest format value: key k's bin is centred on its value.
    ex = (a >> 23) - 127 + f.bias
    if ex >= 1:
        a += 1 << (22 - f.mant)
        ex = (a >> 23) - 127 + f.bias
        mag = min((ex << f.mant) | ((a & 0x7FFFFF) >> (23 - f.mant)), f.nonfinite - 1)
    elif ex > -f.mant - 1:
        sh = 24 - f.mant - ex
        mag = (((a & 0x7FFFFF) | (1 << 23)) + (1 << (sh - 1))) >> sh
    else:
        mag = 0
    half = f.nkeys >> 1
    return half - 1 - mag if b >> 31 else half + mag


@_inline
def _guess_key(g, mu_f, sg_f, zinv, m, f, scratch, scratch_bits):
    """A key near the one holding CDF fraction ``g`` (floats: a search start only)."""
    # The nearest table point, not interpolated: that would lengthen every guess's chain
    # to save a search step in the far tails only. >= 0, so unsigned skips wraparound.
    z = zinv[m, np.uint64(min(max(g, 0.0), 1.0) * INV_POINTS + 0.5)]
    return _nearest_key(mu_f + sg_f * z, f, scratch, scratch_bits)


@_inline
def _grid_sigma(bits, scratch, scratch_bits):
    """sigma (float32 bits) on the coder's 8-bit-mantissa grid, as a float: for guesses."""
    scratch_bits[0] = (np.int64(bits) + (1 << 14)) & ~0x7FFF
    return np.float64(scratch[0])


@_kernel
def _search_from(slot, j, sj, c, b, sh, sb, t, spread, v, f, shapes, emps):
    """(j, S_j, S_j+1, cdf(j), cdf(j+1)) with cdf(j) <= slot < cdf(j+1), S_j = S(b + j 2**sh),
    when the guess ``j`` (with its S_j and cdf(j)) missed.

    Gallops away from the guess, then bisects. cdf(0) = 0 <= slot < 2**p = cdf(256) and
    every frequency is >= 1, so it always ends, whatever the payload holds.
    """
    step = 1
    if c <= slot:
        lo, slo, clo = j, sj, c
        while True:
            k = lo + step
            if k >= 256:
                hi, shi, chi = 256, sb + t, spread + 256
                break
            sk = _smooth_cdf(b + (k << sh), v, f, shapes, emps)
            ck = _stage_cdf(k, sk, sb, t, spread)
            if ck > slot:
                hi, shi, chi = k, sk, ck
                break
            lo, slo, clo = k, sk, ck
            step *= 2
    else:
        hi, shi, chi = j, sj, c
        while True:
            k = hi - step
            if k <= 0:
                lo, slo, clo = 0, sb, 0
                break
            sk = _smooth_cdf(b + (k << sh), v, f, shapes, emps)
            ck = _stage_cdf(k, sk, sb, t, spread)
            if ck <= slot:
                lo, slo, clo = k, sk, ck
                break
            hi, shi, chi = k, sk, ck
            step *= 2
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        sm = _smooth_cdf(b + (mid << sh), v, f, shapes, emps)
        cm = _stage_cdf(mid, sm, sb, t, spread)
        if cm <= slot:
            lo, slo, clo = mid, sm, cm
        else:
            hi, shi, chi = mid, sm, cm
    return lo, slo, shi, clo, chi


@_inline
def _read_word(xs, buf, ptr, end):
    """Renormalize after a decode step: (state, new ptr), ptr = -1 if out of words."""
    if ptr + 2 <= end:  # the common case, branch-free: read the word, keep it if needed
        need = xs < L
        w = np.int64(buf[ptr]) | (np.int64(buf[ptr + 1]) << 8)
        return ((xs << 16) | w) if need else xs, ptr + 2 * need
    return xs, ptr if xs >= L else -1


# Rows of the decoder's per-lane scratch ``ln`` (int64[LANE_ROWS, 32]): the lane state; the
# top-byte symbol and S at its two ends (the low-byte step's range); the current step's
# symbol, S and cdf at its two ends; the key nearest to mu (for guesses); the lane's
# quantized parameters (a Val).
_X, _T, _SB, _SE, _G, _SJ, _SN, _C0, _C1, _KM, _V = range(11)
LANE_ROWS = _V + len(Val._fields)


@_inline
def _lane_val(ln, q):
    return Val(ln[_V, q], ln[_V + 1, q], ln[_V + 2, q], ln[_V + 3, q], ln[_V + 4, q],
               ln[_V + 5, q], ln[_V + 6, q])


@_inline
def _lane_range(ln, q, low, f):
    """(b, sh, S_b, T) of lane q's step: symbol j is keys b + j 2**sh, mass S_b .. S_b + T."""
    if low:
        return ln[_T, q] << f.es, 0, ln[_SB, q], ln[_SE, q] - ln[_SB, q]
    return 0, f.es, 0, ONE


@_inline
def _guess_symbol(xs, b, sh, sb, t, km, mf, sf, m, f, zinv, precision, scratch, scratch_bits):
    """Float guess of the symbol (keys b + j 2**sh) that state ``xs`` decodes to; ``km`` is
    the key nearest to mu (``_nearest_key``), the same for both stages of a value."""
    spread = (1 << precision) - 256
    slot = xs & ((1 << precision) - 1)
    # slot = j + spread * (S_j - S_b) / T: invert S at (slot - j) / spread with mu's own j
    # standing in for the unknown j. Near mu that is the decoded j or close to it; where
    # it is not (wide distributions, keys crowding near zero) the search takes a few more
    # steps, which costs less on average than a second guess from the first.
    jm = min(max((km - b) >> sh, 0), 255)
    frac = (sb + (slot - jm + 0.5) * (1.0 / spread) * t) * (1.0 / ONE)
    g = _guess_key(frac, mf, sf, zinv, m, f, scratch, scratch_bits)
    return min(max((g - b) >> sh, 0), 255)


@_inline
def _stage_guess(xs, b, sh, sb, t, mf, sf, m, f, zinv, precision, scratch, scratch_bits):
    """``_guess_symbol`` from mu itself: one lane's guess, as the GPU twin's test takes it."""
    return _guess_symbol(xs, b, sh, sb, t, _nearest_key(mf, f, scratch, scratch_bits), mf, sf,
                         m, f, zinv, precision, scratch, scratch_bits)


@_inline
def _decode_step(low, g0, m, ln, fl, buf, ptr, end, mu_bits, sg_bits, mu_f, midx, f, shapes,
                 zinv, emps, ws, rtab, precision, scratch, out):
    """One rANS step of lanes 0..m-1 (values g0..g0+m-1): top bytes, or (``low``) low bytes.

    Three passes over the lanes so that the lanes' long dependency chains (float guess,
    CDF evaluations, state update) overlap in the CPU instead of running one after the
    other: (A) parameters and the float guess, (B) the two exact CDF evaluations that
    check it, (C) in lane order, as the stream requires: search on a missed guess, update
    the state, read a word. ``fl`` (float64[2, 32]) holds each lane's mu and grid sigma.
    Returns (OK, new ptr), (ERR_TRUNCATED, 0) or (-1, index of an invalid mu/sigma).
    """
    spread = (1 << precision) - 256
    mask = (1 << precision) - 1
    scratch_bits = scratch.view(np.uint32)
    per_value = midx.size > 1
    for q in range(m):  # (A)
        i = g0 + q
        if not low:
            ok, v = _params(mu_bits[i], sg_bits[i], midx[i] if per_value else midx[0], ws,
                            rtab, f)
            if not ok:
                return -1, i
            for r in range(len(v)):
                ln[_V + r, q] = v[r]
            fl[0, q] = mu_f[i]
            fl[1, q] = _grid_sigma(sg_bits[i], scratch, scratch_bits)
            ln[_KM, q] = _nearest_key(fl[0, q], f, scratch, scratch_bits)
        b, sh, sb, t = _lane_range(ln, q, low, f)
        ln[_G, q] = _guess_symbol(ln[_X, q], b, sh, sb, t, ln[_KM, q], fl[0, q], fl[1, q],
                                  ln[_V + 3, q], f, zinv, precision, scratch, scratch_bits)
    for q in range(m):  # (B)
        v = _lane_val(ln, q)
        b, sh, sb, t = _lane_range(ln, q, low, f)
        j = ln[_G, q]
        ln[_SJ, q] = sj = _smooth_cdf(b + (j << sh), v, f, shapes, emps)
        ln[_SN, q] = sn = _smooth_cdf(b + ((j + 1) << sh), v, f, shapes, emps)
        ln[_C0, q] = _stage_cdf(j, sj, sb, t, spread)
        ln[_C1, q] = _stage_cdf(j + 1, sn, sb, t, spread)
    for q in range(m):  # (C)
        xs = ln[_X, q]
        slot = xs & mask
        j, sj, sn, c0, c1 = ln[_G, q], ln[_SJ, q], ln[_SN, q], ln[_C0, q], ln[_C1, q]
        b, sh, sb, t = _lane_range(ln, q, low, f)
        if not c0 <= slot < c1:
            if slot >= c1:  # search up from j + 1 (j < 255 here: cdf(256) = 2**p > slot)
                j, sj, c0 = j + 1, sn, c1
            j, sj, sn, c0, c1 = _search_from(slot, j, sj, c0, b, sh, sb, t, spread,
                                             _lane_val(ln, q), f, shapes, emps)
        ln[_X, q], ptr = _read_word((c1 - c0) * (xs >> precision) + slot - c0, buf, ptr, end)
        if ptr < 0:
            return ERR_TRUNCATED, 0
        if low or f.es == 0:
            out[g0 + q] = _bits(b + j, f.nkeys)
        else:
            ln[_T, q], ln[_SB, q], ln[_SE, q] = j, sj, sn
    return OK, ptr


@_kernel
def decode_chunk(buf, start, length, mu_bits, sg_bits, mu_f, midx, fp, shapes, zinv,
                 emps, ws, rtab, precision, ln, fl, scratch, out):
    """Decode ``out.size`` values from ``buf[start:start+length]``; return an error code.

    ``mu_f`` is a float32 view of ``mu_bits``; ``ln`` (int64[LANE_ROWS, 32]), ``fl``
    (float64[2, 32]) and ``scratch`` (float32[1]) are scratch. An invalid (mu, sigma) pair
    comes back as -(index + 1).
    """
    f = _fmt(fp)
    n = out.size
    end = start + length
    if length < STATE_BYTES or (length - STATE_BYTES) & 1 or end > buf.size or start < 0:
        return ERR_ODD
    for lane in range(LANES):
        o = start + 4 * lane
        s = (np.int64(buf[o]) | (np.int64(buf[o + 1]) << 8) | (np.int64(buf[o + 2]) << 16)
             | (np.int64(buf[o + 3]) << 24))
        if s < L:
            return ERR_STATE
        ln[_X, lane] = s
    ptr = start + STATE_BYTES
    for g0 in range(0, n, LANES):
        m = min(LANES, n - g0)
        for low in range(2 if f.es else 1):
            status, ptr = _decode_step(low == 1, g0, m, ln, fl, buf, ptr, end, mu_bits,
                                       sg_bits, mu_f, midx, f, shapes, zinv, emps, ws, rtab,
                                       precision, scratch, out)
            if status == -1:
                return -(ptr + 1)
            if status != OK:
                return status
    if ptr != end:
        return ERR_TRAILING
    for lane in range(LANES):
        if ln[_X, lane] != L:
            return ERR_FINAL
    return OK
