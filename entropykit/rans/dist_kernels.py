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

Speed. Both kernels work on 32 lanes at a time in passes that LLVM vectorizes (AVX2 /
AVX-512 gathers into the tables; 512-bit vectors where the CPU has them, ``_WideLower``):
parameters, guesses, S evaluations, state updates. So the helpers those passes inline are
branch-free (selects), read the model tables as packed (point, step) pairs, divide in
float64 where the floor is provably exact, and the kernels are compiled with ``noalias``
arguments (``_NoAlias``). Only the search after a missed guess and the word order of the
stream stay serial.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import lowering, typed_passes
from numba.core.compiler import CompilerBase, DefaultPassBuilder
from numba.core.compiler_machinery import register_pass
from numba.extending import intrinsic, overload

from .._status import (
    ERR_FINAL,
    ERR_TRAILING,
    ERR_TRUNCATED,
    OK,
    Status,
    messages,
)
from .lanes import LANES, STATE_BYTES, L, put_states, read_states

# No kernel allocates: callers pass every buffer in. That lets them run without Numba's
# reference counting, whose incref/decref pairs around inlined helpers taking arrays are
# not pruned and would outweigh the arithmetic of a CDF evaluation.
_kernel = njit(nogil=True, cache=True, _nrt=False)


class _WideLower(lowering.Lower):
    """Numba's lowering, with the kernel function asking LLVM for 512-bit vectors.

    On CPUs with AVX-512, LLVM's tuning for recent Intel cores caps the vectorizer at
    256 bits ("prefer-vector-width"="256", a guard against the clock drop that older Xeons
    took on 512-bit code). The lane passes are long chains of integer and float ops over
    32 independent lanes, so twice the lanes per instruction pays. The
    attribute is this function's alone (the process-wide way, NUMBA_CPU_FEATURES, is not
    a library's to set); where 512-bit vectors are not legal it changes nothing. Every
    lane's arithmetic is the same at any width (integers, and IEEE floats without
    contraction), so the bytes are too.
    """

    def post_lower(self):
        super().post_lower()
        # llvmlite's attribute set knows only keyword attributes; a string attribute is
        # written into the IR as given.
        set.add(self.function.attributes, '"prefer-vector-width"="512"')


@register_pass(mutates_CFG=True, analysis_only=False)
class _WideNativeLowering(typed_passes.NativeLowering):
    _name = "entropykit_wide_native_lowering"

    @property
    def lowering_class(self):
        return _WideLower


class _NoAlias(CompilerBase):
    """Numba's nopython pipeline with every array argument marked ``noalias`` (LLVM's
    ``restrict``): the 32-lane passes store lane rows while they gather from the model
    tables, and without the promise that the two never overlap LLVM will not vectorize
    them. Callers keep the promise: a kernel's output and scratch arrays are its own.
    Its lowering is ``_WideLower``'s."""

    def define_pipelines(self):
        self.state.flags.noalias = True
        pm = DefaultPassBuilder.define_nopython_pipeline(self.state)
        pm.passes = [(_WideNativeLowering if p is typed_passes.NativeLowering else p, d)
                     for p, d in pm.passes]
        pm.finalize()
        return [pm]


_lane_kernel = njit(nogil=True, cache=True, _nrt=False, pipeline_class=_NoAlias)
# Helpers: always inlined, by LLVM (its cost model would decline, and a call passes every
# array field by value; the lane passes vectorize only once their bodies are call-free).
# LLVM rather than Numba's own inliner, which retyped every copy: a cold compile of the
# decoder took 55 s that way, 10 s this way.
_inline = njit(nogil=True, cache=True, _nrt=False, forceinline=True)

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

MESSAGES = messages(Status.STATE, Status.TRUNCATED, Status.TRAILING, Status.FINAL,
                    Status.ODD)
# What the encoder reports besides OK (not decoding codes): the payload would not be
# smaller than raw; an invalid (mu, sigma).
ENC_RAW = 1
ENC_PARAM = 2


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
    """Quantize one (mu, sigma) pair given as float32 bits: (ok, Val); Val is all zeros
    when not ok. Every case a select (see ``_offset``), so that 32 lanes vectorize."""
    ok = not _invalid(mu_bits, sg_bits)
    sb = np.int64(sg_bits)
    e0 = (sb >> 23) & 0xFF
    mb = np.int64(mu_bits)
    em = (mb >> 23) & 0xFF
    r = ((sb & 0x7FFFFF) + (1 << 14)) >> 15  # 8 mantissa bits, rounded: may carry to 256
    e = e0 + (r >> SIGMA_BITS)
    r &= (1 << SIGMA_BITS) - 1
    top = e == 0xFF  # rounded up past the largest finite sigma: take the largest grid one
    e, r = (0xFE if top else e), ((1 << SIGMA_BITS) - 1 if top else r)
    e, r = (1 if e0 == 0 else e), (0 if e0 == 0 else r)  # subnormal: smallest normal sigma
    ue = e - 127 - MU_BITS
    mm = (mb & 0x7FFFFF) | ((em > 0) << 23)
    sh = max(em, 1) - 150 - ue
    up = mm << min(max(sh, 0), 36)  # |mu| < 2**35 sigma here (``_invalid``)
    down = min(max(-sh, 1), 40)
    mu_u = up if sh >= 0 else (0 if sh < -40 else (mm + (1 << (down - 1))) >> down)
    mu_u = -mu_u if mb >> 31 else mu_u
    z = np.int64(0) if ok else np.int64(-1)  # keeps every field of a refused pair at 0
    return ok, Val(mu_u & ~z, ue & ~z, rtab[0, r] & ~z, np.int64(m) & ~z, ws[m] & ~z,
                   rtab[1, r] & ~z, (f.bias + f.mant + 1 + ue) & ~z)


@_inline
def _offset(k, v, f):
    """D(k) = floor(B(k) / u) - mu_u for 0 < k < nkeys (not yet clamped).

    Selects, not branches: the decoder evaluates 32 lanes' S in one vectorized loop, and
    a branch that follows the data (a value's sign, the key at 0, a non-finite boundary)
    would stop the vectorizer or, in scalar code, mispredict.
    """
    y = k - (f.nkeys >> 1)
    a = abs(y) - 1  # the smaller magnitude of keys k-1 and k (-1 at y = 0: replaced below)
    neg = (y >> 63) & 1
    e1 = max(a >> f.mant, 1)  # exponent field, subnormals read as 1
    # B = +-mid * 2**(e1 - cb) with mid = 2 * (implicit bit | mantissa) + 1, odd.
    mid = 2 * a + 1 - ((e1 - 1) << (f.mant + 1))
    sh = min(max(e1 - v.cb, -62), 50)
    # floor(mid * 2**sh) for B > 0; floor(-mid * 2**sh) = ~floor((mid * 2**sh - 1)) for
    # B < 0 (mid is odd, so a right shift always drops a non-zero remainder).
    t = ((mid << max(sh, 0)) - neg) >> max(-sh, 0)
    d = (t ^ -neg) - v.mu_u
    d = -v.mu_u if y == 0 else d  # B = 0 between -0 and +0
    big = D_BIG - 2 * D_BIG * neg
    return big if a + 1 >= f.nonfinite else d


def _interp(table, m, i, frac, bits):
    """Row m of a CDF table at point i + frac / 2**bits, interpolated in integers.

    ``table`` is either the CDF points (uint32; a shape row padded with one more ONE, so
    that the clamped end i = Z_POINTS reads a zero step) or the kernels' packed copy,
    int64 point | step << 32 per point (``pairs``): one gather instead of two.
    """


@overload(_interp, inline="always", jit_options={"cache": True, "_nrt": False})
def _interp_impl(table, m, i, frac, bits):
    if isinstance(table, types.NoneType):  # no table (a helper's default): never read
        return lambda table, m, i, frac, bits: 0
    if table.dtype.bitwidth == 64:
        def packed(table, m, i, frac, bits):
            # Both words unsigned: a step of 2**31 (all of a row's mass in one interval)
            # sets the sign bit, which an arithmetic shift would carry down. As 32-bit
            # operands (frac < 2**16), the product is also one 32x32 -> 64 multiply.
            pr = table[m, i]
            return (pr & 0xFFFFFFFF) + ((((pr >> 32) & 0xFFFFFFFF) * (frac & 0xFFFF)) >> bits)
        return packed

    def points(table, m, i, frac, bits):
        t0 = np.int64(table[m, i])
        return t0 + (((np.int64(table[m, i + 1]) - t0) * frac) >> bits)
    return points


def pairs(table: np.ndarray) -> np.ndarray:
    """The packed copy of CDF rows (``_interp``): int64 point | (next point - point) << 32,
    one per point but the last of each row (a step of 2**31 wraps to the sign bit; the
    kernels read the high word unsigned)."""
    t = np.asarray(table, np.int64)
    return np.ascontiguousarray(t[:, :-1] | ((t[:, 1:] - t[:, :-1]) << 32))


@_inline
def _emp_cdf(k, m, f, emps):
    """E(k) of model m, k clamped into 1..nkeys-1 (``_smooth_cdf``'s empirical term)."""
    kc = min(max(k, 1), f.nkeys - 1)
    return _interp(emps, m, np.uint64(kc >> f.es), kc & ((1 << f.es) - 1), f.es)


@_inline
def _smooth_cdf(k, v, f, shapes, emps, mix=True):
    """S(k): mass of all keys below k, in units of 2**-31 (module docstring).

    ``shapes`` and ``emps`` are CDF tables as ``_interp`` takes them. Branch-free (see
    ``_offset``): k is clamped into 1..nkeys-1 for the table reads and the ends
    S(k <= 0) = 0, S(k >= nkeys) = ONE selected at the end; the empirical term is
    always computed (weight 0 leaves s unchanged: (s * 2**16) >> 16 = s) unless ``mix`` is
    False, which the kernels pass (a constant) when every model's weight is 0.
    """
    e = _emp_cdf(k, v.m, f, emps) if mix else 0
    return _smooth_with(k, e, v, f, shapes, mix)


@_inline
def _smooth_with(k, e, v, f, shapes, mix):
    """``_smooth_cdf`` given E(k) = ``e`` (read by the caller; any value where k <= 0 or
    k >= nkeys, whose S is selected)."""
    kc = min(max(k, 1), f.nkeys - 1)
    d = min(max(_offset(kc, v, f), -v.dl), v.dl)  # so |z| <= Z_MAX, and no overflow
    zf = (d * v.rr) >> R_SHIFT
    ix = np.uint64((zf >> Z_FRAC) + (Z_MAX << Z_GRID_BITS))  # >= 0: unsigned skips wraparound
    s = _interp(shapes, v.m, ix, zf & ((1 << Z_FRAC) - 1), Z_FRAC)
    if mix:
        # s, e <= ONE and w < 2**16: masks that change no value and let LLVM multiply in
        # 32 x 32 -> 64 bits (one instruction per vector instead of three).
        s = ((s & 0xFFFFFFFF) * ((WEIGHT_ONE - v.w) & 0x1FFFF)
             + (e & 0xFFFFFFFF) * (v.w & 0xFFFF)) >> 16
    s = 0 if k <= 0 else s
    return ONE if k >= f.nkeys else s


@_inline
def _stage_cdf(j, sj, sb, t, spread):
    """cdf(j) of a stage (module docstring), S_j = ``sj``; spread = 2**p - 256.

    The floor of the quotient comes from a float64 division, which vectorizes where an
    integer one does not, and is exact here: num < 2**47 and t < 2**32 are exact floats,
    and num / t = N + 1 - delta with N + 1 <= 2**16 has delta >= 1/t > 2**-32, more than
    half an ulp (2**-37) of N + 1, so rounding never reaches the next integer.
    """
    num = spread * (sj - sb)  # >= 0: S is non-decreasing and j lies in the stage
    q = np.int64(np.float64(num) / np.float64(max(t, 1)))
    return j * ((spread + 256) >> 8) if t == 0 else j + q


@_inline
def _key(bits, nkeys):
    half = nkeys >> 1
    return bits ^ (nkeys - 1) if bits & half else bits ^ half


@_inline
def _bits(key, nkeys):
    half = nkeys >> 1
    return key ^ half if key >= half else key ^ (nkeys - 1)


@_inline
def _value_cdfs(key, v, f, shapes, emps, spread, mix=True):
    """[cdf(j), cdf(j+1)) of the key's top byte, then of its low byte (16-bit formats)."""
    j = key >> f.es  # the top byte: keys j * 2**es .. (j+1) * 2**es - 1
    b = j << f.es
    s0 = _smooth_cdf(b, v, f, shapes, emps, mix)
    s1 = _smooth_cdf(b + (1 << f.es), v, f, shapes, emps, mix)
    t0 = _stage_cdf(j, s0, 0, ONE, spread)
    t1 = _stage_cdf(j + 1, s1, 0, ONE, spread)
    if f.es == 0:
        return t0, t1, 0, 0
    lo = key - b
    l0 = _stage_cdf(lo, _smooth_cdf(key, v, f, shapes, emps, mix), s0, s1 - s0, spread)
    l1 = _stage_cdf(lo + 1, _smooth_cdf(key + 1, v, f, shapes, emps, mix), s0, s1 - s0, spread)
    return t0, t1, l0, l1


# Rows of the encoder's per-lane scratch ``st`` (int64[ENC_ROWS, 32]): the lane state; the
# top byte's [cdf0, cdf1), the low byte's; the step's word and whether it is emitted.
_EX, _ET0, _ET1, _EL0, _EL1, _EW, _EE = range(7)
ENC_ROWS = 7


@_inline
def _enc_lanes(st, r0, m, precision):
    """Push each lane's symbol [st[r0], st[r0 + 1]) onto its state, lanes 0..m-1 at once
    (vectorized): the new state, and the word each lane emits before it (``_put_words``).

    The quotient by the frequency is a float64 division (vectorizes; exact: x < 2**32 and
    fr <= 2**16, so x / fr is never within half an ulp below the next integer).
    """
    for q in range(m):
        xs, c0 = st[_EX, q], st[r0, q]
        fr = st[r0 + 1, q] - c0
        emit = xs >= fr << (32 - precision)
        st[_EW, q], st[_EE, q] = xs & 0xFFFF, emit
        xs = xs >> 16 if emit else xs
        d = np.int64(np.float64(xs) / np.float64(max(fr, 1)))  # fr >= 1; see _guess_symbol
        st[_EX, q] = (d << precision) + (xs - d * fr) + c0


@_inline
def _put_words(st, m, out, pos):
    """Write the emitted words of lanes m-1..0 downward from ``out[pos]``; new pos.
    ``out[pos - 2 m:pos]`` must exist: each word is stored whether or not it is emitted
    (an unused store lies below the payload and is overwritten or dropped), so the loop
    has no branch."""
    for q in range(m - 1, -1, -1):
        w = st[_EW, q]
        out[pos - 2] = w & 0xFF
        out[pos - 1] = w >> 8
        pos -= 2 * st[_EE, q]
    return pos


@_inline
def _mixed(ws):
    """Whether any model has an empirical term (weight > 0)."""
    w = 0
    for m in range(ws.size):
        w |= ws[m]
    return w != 0


@_inline
def _encode_groups(vals, mu_bits, sg_bits, midx, f, shapes, emps, ws, rtab, precision, st, out,
                   mix):
    """The groups of 32 values, last first, onto the lane states: (OK, pos), (ENC_RAW, 0)
    or (ENC_PARAM, index of an invalid mu/sigma)."""
    n = vals.size
    spread = (1 << precision) - 256
    pv = -1 if midx.size > 1 else 0  # index mask: per-value model indices, or one for all
    pos = out.size
    for g0 in range((n - 1) & -LANES, -1, -LANES):
        m = min(LANES, n - g0)
        if pos - 4 * m < STATE_BYTES:  # room for the group's words, written branch-free
            return ENC_RAW, 0
        bad = False
        for q in range(m):  # vectorized: an invalid pair is found afterwards
            i = np.uint64(g0 + q)  # unsigned: see _decode_step
            ok, v = _params(mu_bits[i], sg_bits[i], midx[np.uint64((g0 + q) & pv)], ws, rtab, f)
            bad |= not ok
            st[_ET0, q], st[_ET1, q], st[_EL0, q], st[_EL1, q] = _value_cdfs(
                _key(np.int64(vals[i]), f.nkeys), v, f, shapes, emps, spread, mix)
        if bad:
            for q in range(m):
                if _invalid(mu_bits[g0 + q], sg_bits[g0 + q]):
                    return ENC_PARAM, g0 + q
        if f.es:  # the low-byte step last: the decoder reads it after the top-byte step
            _enc_lanes(st, _EL0, m, precision)
            pos = _put_words(st, m, out, pos)
        _enc_lanes(st, _ET0, m, precision)
        pos = _put_words(st, m, out, pos)
    return OK, pos


@_lane_kernel
def encode_chunk(vals, mu_bits, sg_bits, midx, fp, shapes, emps, ws, rtab, precision, st, out):
    """Encode ``vals`` (format bits) into ``out``; return (status, start).

    ``st`` is int64[ENC_ROWS, 32] scratch. status 0: the payload is ``out[start:]``.
    status 1: it did not fit (store raw). status 2: mu/sigma at index ``start`` are invalid
    (NaN, inf, sigma <= 0). No argument may overlap another that the kernel writes.
    """
    f = _fmt(fp)
    st[_EX, :] = L
    # Two compiled copies: with the empirical term, and without it when no model uses one.
    if _mixed(ws):
        status, pos = _encode_groups(vals, mu_bits, sg_bits, midx, f, shapes, emps, ws, rtab,
                                     precision, st, out, True)
    else:
        status, pos = _encode_groups(vals, mu_bits, sg_bits, midx, f, shapes, emps, ws, rtab,
                                     precision, st, out, False)
    if status:
        return status, pos
    pos -= STATE_BYTES
    put_states(st[_EX], out, pos)
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


@intrinsic
def _f32_bits(typingctx, x):
    """The bits of float ``x`` rounded to float32, as an int64 (a bit cast in registers,
    where a store and reload through a scratch array would stop the vectorizer)."""
    if not isinstance(x, types.Float):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.zext(builder.bitcast(v, ir.IntType(32)), ir.IntType(64))

    return types.int64(x), codegen


@intrinsic
def _bits_f32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int64)
        return builder.bitcast(builder.trunc(v, ir.IntType(32)), ir.FloatType())

    return types.float32(bits), codegen


@_inline
def _nearest_key(x, f):
    """The key of the format value nearest to float ``x`` (a search start only)."""
    b = _f32_bits(x)
    a = b & 0x7FFFFFFF
    # Round |value| to the nearest format value: key k's bin is centred on its value.
    # Normal, subnormal and underflowing results all computed, one selected (no branch).
    ex = (a >> 23) - 127 + f.bias
    # Normal: the float32 exponent and top mantissa bits, rounded, read as one integer,
    # rebased from float32's exponent bias to the format's.
    normal = min(((a + (1 << (22 - f.mant))) >> (23 - f.mant)) - ((127 - f.bias) << f.mant),
                 f.nonfinite - 1)
    sh = min(max(24 - f.mant - ex, 1), 40)  # 24 - mant - ex where subnormal is selected
    sub = (((a & 0x7FFFFF) | (1 << 23)) + (1 << (sh - 1))) >> sh
    mag = normal if ex >= 1 else (sub if ex > -f.mant - 1 else 0)
    half = f.nkeys >> 1
    return half - 1 - mag if b >> 31 else half + mag


@_inline
def _guess_key(g, mu_f, sg_f, zinv, m, f):
    """A key near the one holding CDF fraction ``g`` (floats: a search start only)."""
    # The nearest table point, not interpolated: that would lengthen every guess's chain
    # to save a search step in the far tails only. >= 0, so unsigned skips wraparound.
    z = zinv[m, np.uint64(min(max(g, 0.0), 1.0) * INV_POINTS + 0.5)]
    return _nearest_key(mu_f + sg_f * z, f)


@_inline
def _grid_sigma(bits):
    """sigma (float32 bits) on the coder's 8-bit-mantissa grid, as a float: for guesses."""
    return np.float64(_bits_f32((np.int64(bits) + (1 << 14)) & ~0x7FFF))


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
# low-byte step's range (first key b, S_b, T: symbol j is keys b + j 2**sh) and the
# empirical table's (point, step) over it; its guessed symbol, S and cdf at the symbol's two
# ends; the key nearest to mu (for guesses); the state after the step if the guess is
# right; the lane's quantized parameters (a Val). One row per quantity, so that a pass
# over the lanes reads each as one vector.
_X, _B, _SB, _TS, _EB, _ED, _G, _SJ, _SN, _C0, _C1, _KM, _XN, _V = range(14)
LANE_ROWS = _V + len(Val._fields)
# Rows of the decoder's float scratch ``fl`` (float64[FLOAT_ROWS, 32]): mu, grid sigma, and
# ``_unmix``'s (a, c).
FLOAT_ROWS = 4


@_inline
def _lane_range(ln, q, low):
    """(b, S_b, T) of lane q's step (``low`` a constant): the whole key range in the top
    byte, where the constants spare the low byte's division (``_stage_cdf``)."""
    if low:
        return ln[_B, q], ln[_SB, q], ln[_TS, q]
    return 0, 0, ONE


@_inline
def _lane_emp(ln, q, k, f, emps, low, mix):
    """E(k) of lane q's model for a key k of its step (``low``, ``mix``: constants): in the
    low step from the lane's (E_b, step) (``_top_emp``), else from the table."""
    if not mix:
        return 0
    if low:
        # k - b in 0..256 (masked for a 32-bit multiply, see ``_interp``)
        return ln[_EB, q] + (((ln[_ED, q] & 0xFFFFFFFF) * ((k - ln[_B, q]) & 0x1FF)) >> f.es)
    return _emp_cdf(k, ln[_V + 3, q], f, emps)


@_inline
def _top_emp(ln, q, emps, m, j):
    """Lane q's (E_b, step) rows from model m's empirical interval j, read unsigned (see
    ``_interp``).

    Top byte j's keys are j 2**es .. (j+1) 2**es, the ends of that interval, so its one
    table entry holds E at both ends of the top step's symbol (point, point + step) and,
    once j is decoded, E over the low step's keys: E(b + i) = E_b + ((step i) >> es) for i
    in 0..256, what ``_interp`` computes there (k = 0 and k = nkeys, where the clamp inside
    ``_emp_cdf`` reads elsewhere, have S selected). One table read per value instead of
    one per guess and CDF evaluation."""
    pr = emps[m, np.uint64(j)]
    ln[_EB, q], ln[_ED, q] = pr & 0xFFFFFFFF, (pr >> 32) & 0xFFFFFFFF


@_inline
def _store_val(ln, q, v):
    ln[_V, q], ln[_V + 1, q], ln[_V + 2, q], ln[_V + 3, q] = v[0], v[1], v[2], v[3]
    ln[_V + 4, q], ln[_V + 5, q], ln[_V + 6, q] = v[4], v[5], v[6]


@_inline
def _lane_val(ln, q):
    return Val(ln[_V, q], ln[_V + 1, q], ln[_V + 2, q], ln[_V + 3, q], ln[_V + 4, q],
               ln[_V + 5, q], ln[_V + 6, q])


@_inline
def _guess_symbol(xs, b, sh, sb, t, j, mf, sf, m, f, zinv, precision, e=0, mx=(1.0, 0.0),
                  mix=False):
    """Float guess of the symbol (keys b + j 2**sh) that state ``xs`` decodes to, given a
    stand-in ``j`` for it (a previous guess, or the symbol nearest to mu). With ``mix``,
    the empirical term E = ``e`` at the stand-in's key is taken out (``mx``: ``_unmix``)."""
    spread = (1 << precision) - 256
    slot = xs & ((1 << precision) - 1)
    # slot = j + spread * (S_j - S_b) / T: invert S at (slot - j) / spread for the unknown
    # j, with the stand-in in its place.
    frac = (sb + (slot - j + 0.5) * (1.0 / spread) * t) * (1.0 / ONE)
    if mix:
        # S = ((2**16 - w) F + w E) / 2**16 and only F has an inverse table: even a small
        # empirical weight moves F's inverse by a key or more.
        frac = frac * mx[0] - e * mx[1]
    return min(max((_guess_key(frac, mf, sf, zinv, m, f) - b) >> sh, 0), 255)


@_inline
def _unmix(w):
    """(a, c) with F = a S - c E (E in units of 2**-31) for empirical weight w: one
    division per value, not one per guess. w < 2**16; the max() lets LLVM drop Numba's
    zero-division check, which would keep the lane loop from vectorizing."""
    a = WEIGHT_ONE / max(WEIGHT_ONE - w, 1)
    return a, a * w * (1.0 / (WEIGHT_ONE * ONE))


@_inline
def _stage_guess(xs, b, sh, sb, t, mf, sf, m, f, zinv, precision):
    """The decoder's guess in a low-byte step, from mu (both rounds of ``_decode_step``'s
    pass A), as the GPU twin's test takes it."""
    j = min(max((_nearest_key(mf, f) - b) >> sh, 0), 255)
    for _ in range(2):
        j = _guess_symbol(xs, b, sh, sb, t, j, mf, sf, m, f, zinv, precision)
    return j


@_inline
def _decode_step(low, g0, m, ln, fl, buf, ptr, end, mu_bits, sg_bits, midx, f, shapes,
                 zinv, emps, ws, rtab, precision, out, mix):
    """One rANS step of lanes 0..m-1 (values g0..g0+m-1): top bytes, or (``low``) low bytes.

    Three passes over the lanes so that the lanes' long dependency chains (float guess,
    CDF evaluations, state update) overlap in the CPU instead of running one after the
    other: (A) parameters and the float guess, (B) the two exact CDF evaluations that
    check it, (C) the state update and, in lane order as the stream requires, the search
    on a missed guess and the word reads. ``fl`` (float64[FLOAT_ROWS, 32]) holds each
    lane's mu, grid sigma and ``_unmix`` factors.
    Returns (OK, new ptr), (ERR_TRUNCATED, 0) or (-1, index of an invalid mu/sigma).
    """
    spread = (1 << precision) - 256
    mask = (1 << precision) - 1
    pv = -1 if midx.size > 1 else 0  # index mask: per-value model indices, or one for all
    sh = 0 if low else f.es
    if not low:
        bad = False
        for q in range(m):  # (A0) parameters, vectorized: an invalid pair found afterwards
            # Unsigned indices: Numba wraps a signed index that may be negative, and the
            # select that does it turns these contiguous loads into gathers.
            i = np.uint64(g0 + q)
            ok, v = _params(mu_bits[i], sg_bits[i], midx[np.uint64((g0 + q) & pv)], ws, rtab, f)
            bad |= not ok
            _store_val(ln, q, v)
            fl[0, q] = mf = np.float64(_bits_f32(mu_bits[i]))
            fl[1, q] = _grid_sigma(sg_bits[i])
            fl[2, q], fl[3, q] = _unmix(v.w)
            ln[_KM, q] = _nearest_key(mf, f)
        if bad:
            for q in range(m):
                if _invalid(mu_bits[g0 + q], sg_bits[g0 + q]):
                    return -1, g0 + q
    for q in range(m):  # (A1) the float guesses, from mu's own symbol
        b, sb, t = _lane_range(ln, q, low)
        j = min(max((ln[_KM, q] - b) >> sh, 0), 255)
        ln[_G, q] = _guess_symbol(ln[_X, q], b, sh, sb, t, j, fl[0, q], fl[1, q],
                                  ln[_V + 3, q], f, zinv, precision,
                                  _lane_emp(ln, q, b + (j << sh), f, emps, low, mix),
                                  (fl[2, q], fl[3, q]), mix)
    if low:
        # (A2) A second round from the first guess. It matters in the low byte, where j's
        # share of the slot is up to a symbol's width; in the top byte misses are rare
        # already and a second round does not pay.
        for q in range(m):
            b, sb, t = _lane_range(ln, q, low)
            j = ln[_G, q]
            ln[_G, q] = _guess_symbol(ln[_X, q], b, sh, sb, t, j, fl[0, q], fl[1, q],
                                      ln[_V + 3, q], f, zinv, precision,
                                      _lane_emp(ln, q, b + j, f, emps, low, mix),
                                      (fl[2, q], fl[3, q]), mix)
    for q in range(m):  # (B): branch-free, so that it vectorizes across the lanes
        v = _lane_val(ln, q)
        b, sb, t = _lane_range(ln, q, low)
        j = ln[_G, q]
        k0, k1 = b + (j << sh), b + ((j + 1) << sh)
        if mix and not low:
            _top_emp(ln, q, emps, v.m, j)
            e0, e1 = ln[_EB, q], ln[_EB, q] + ln[_ED, q]
        else:
            e0 = _lane_emp(ln, q, k0, f, emps, low, mix)
            e1 = _lane_emp(ln, q, k1, f, emps, low, mix)
        ln[_SJ, q] = sj = _smooth_with(k0, e0, v, f, shapes, mix)
        ln[_SN, q] = sn = _smooth_with(k1, e1, v, f, shapes, mix)
        ln[_C0, q] = _stage_cdf(j, sj, sb, t, spread)
        ln[_C1, q] = _stage_cdf(j + 1, sn, sb, t, spread)
    for q in range(m):  # (C1) vectorized: each lane's next state if its guess is right
        xs, c0, c1 = ln[_X, q], ln[_C0, q], ln[_C1, q]
        ln[_XN, q] = (c1 - c0) * (xs >> precision) + (xs & mask) - c0
    # (C2) In lane order, as the stream requires: search where the guess missed, read the
    # words. Only this loop is serial; it is kept short (the state update before it, the
    # step's result after it, vectorized) because in the kernel's one big function its
    # values live on the stack: every row it touches is a load or a store.
    for q in range(m):
        xs, xn = ln[_X, q], ln[_XN, q]
        slot = xs & mask
        if not ln[_C0, q] <= slot < ln[_C1, q]:
            j, sj, sn, c0, c1 = ln[_G, q], ln[_SJ, q], ln[_SN, q], ln[_C0, q], ln[_C1, q]
            b, sb, t = _lane_range(ln, q, low)
            if slot >= c1:  # search up from j + 1 (j < 255 here: cdf(256) = 2**p > slot)
                j, sj, c0 = j + 1, sn, c1
            j, sj, sn, c0, c1 = _search_from(slot, j, sj, c0, b, sh, sb, t, spread,
                                             _lane_val(ln, q), f, shapes, emps)
            ln[_G, q], ln[_SJ, q], ln[_SN, q] = j, sj, sn
            if mix and not low:  # the top byte changed: its empirical interval too
                _top_emp(ln, q, emps, ln[_V + 3, q], j)
            xn = (c1 - c0) * (xs >> precision) + slot - c0
        ln[_X, q], ptr = _read_word(xn, buf, ptr, end)
        if ptr < 0:
            return ERR_TRUNCATED, 0
    for q in range(m):  # (C3) vectorized: the step's result
        j = ln[_G, q]
        if low or f.es == 0:
            out[np.uint64(g0 + q)] = _bits((ln[_B, q] if low else 0) + j, f.nkeys)
        else:  # the low-byte step's range: the top byte's keys
            sj = ln[_SJ, q]
            ln[_B, q], ln[_SB, q], ln[_TS, q] = j << f.es, sj, ln[_SN, q] - sj
    return OK, ptr


@_inline
def _decode_groups(ln, fl, buf, ptr, end, mu_bits, sg_bits, midx, f, shapes, zinv, emps, ws,
                   rtab, precision, out, mix):
    """Every group of 32 values: ``_decode_step``'s (status, ptr) of the first that fails,
    else (OK, ptr after the last word read). ``low`` is a constant at each call, so that
    each step compiles without the other's selects."""
    for g0 in range(0, out.size, LANES):
        m = min(LANES, out.size - g0)
        status, ptr = _decode_step(False, g0, m, ln, fl, buf, ptr, end, mu_bits, sg_bits,
                                   midx, f, shapes, zinv, emps, ws, rtab, precision, out, mix)
        if status == OK and f.es:
            status, ptr = _decode_step(True, g0, m, ln, fl, buf, ptr, end, mu_bits, sg_bits,
                                       midx, f, shapes, zinv, emps, ws, rtab, precision, out,
                                       mix)
        if status != OK:
            return status, ptr
    return OK, ptr


@_lane_kernel
def decode_chunk(buf, start, length, mu_bits, sg_bits, midx, fp, shapes, zinv,
                 emps, ws, rtab, precision, ln, fl, out):
    """Decode ``out.size`` values from ``buf[start:start+length]``; return an error code.

    ``ln`` (int64[LANE_ROWS, 32]) and ``fl`` (float64[FLOAT_ROWS, 32]) are scratch; no
    argument may overlap another that the kernel writes (``_NoAlias``). An invalid
    (mu, sigma) pair comes back as -(index + 1).
    """
    f = _fmt(fp)
    end = start + length
    status = read_states(buf, start, length, ln[_X])
    if status != OK:
        return status
    ptr = start + STATE_BYTES
    # Two compiled copies: with the empirical term, and without it when no model uses one.
    if _mixed(ws):
        status, ptr = _decode_groups(ln, fl, buf, ptr, end, mu_bits, sg_bits, midx, f, shapes,
                                     zinv, emps, ws, rtab, precision, out, True)
    else:
        status, ptr = _decode_groups(ln, fl, buf, ptr, end, mu_bits, sg_bits, midx, f, shapes,
                                     zinv, emps, ws, rtab, precision, out, False)
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
