"""The GPU decoder's float32 guess (``fast_guess`` in _dist_kernel.cu) replayed in numpy, and
the missed guesses it yields on kv_check's data, so that guess ideas are tried in seconds on
the CPU instead of in device runs.

What it is: a vectorized float32 port of ``guess_key`` and ``fast_guess`` (same tables from
``dist.model_arrays``, same constants, same order of operations; the device's fused
multiply-adds and approximate ``__fdividef`` / ``__log2f`` are plain float32 operations here,
so a guess can differ in rare last-bit cases), and the exact symbols of each value's stages
from dist_kernels (the CPU coder's integer CDF). A value's slot is drawn uniformly in its
symbol's [cdf(j), cdf(j + 1)), as an rANS state's low bits are. What it is not: the decoder
(no states, words or searches) or a proof of anything: it estimates miss rates, which the
device's miss counters (kv_check) confirm.

    python gpu/guess_emulator.py [--n N] [--fmt bf16 fp8_e4m3] [--rounds R] [--fwd F]
                                 [--low-rounds L]      (defaults: the kernel's per format)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from entropykit.rans import dist_kernels as K  # noqa: E402
from entropykit.rans import distribution as D  # noqa: E402
from entropykit.rans.cuda import dist as G  # noqa: E402

F32 = np.float32
INV_POINTS, ONE, WEIGHT_ONE = K.INV_POINTS, K.ONE, K.WEIGHT_ONE
ZTAIL = INV_POINTS + 1  # a zinv row: the uniform points, then the tails


@njit(cache=True)
def _truth(vals, mu, sg, m, fp, shapes, emps, ws, rtab, p, out):
    """out[i] = (key, t0, t1, l0, l1, S_b, S_b+T, ok) of value i (its stages' exact CDFs)."""
    f = K._fmt(fp)
    spread = (1 << p) - 256
    for i in range(vals.size):
        ok, v = K._params(mu[i], sg[i], m, ws, rtab, f)
        key = K._key(np.int64(vals[i]), f.nkeys)
        out[i, 0] = key
        out[i, 7] = ok
        if ok:
            t0, t1, l0, l1 = K._value_cdfs(key, v, f, shapes, emps, spread)
            b = (key >> f.es) << f.es
            out[i, 1], out[i, 2], out[i, 3], out[i, 4] = t0, t1, l0, l1
            out[i, 5] = K._smooth_cdf(b, v, f, shapes, emps)
            out[i, 6] = K._smooth_cdf(b + (1 << f.es), v, f, shapes, emps)


@dataclass
class Fmt:
    nkeys: int
    mant: int
    bias: int
    nonfinite: int
    es: int

    @property
    def half(self) -> int:
        return self.nkeys // 2


def _fmt(f: D.ValueFormat) -> Fmt:
    return Fmt(1 << f.bits, f.mantissa, f.bias, f.nonfinite, f.bits - 8)


@dataclass
class Lin:
    g: np.ndarray
    kf: np.ndarray
    dzdg: np.ndarray
    ulp: np.ndarray


def guess_key(g, mu, sg, zinv, f: Fmt, tail: bool = True):
    """The kernel's guess_key: (key, Lin), zinv the model's row (float32[ZROW])."""
    gc = np.clip(g.astype(F32), F32(0), F32(1))
    t = gc * F32(INV_POINTS)
    i = np.minimum(t.astype(np.int32), INV_POINTS - 1)
    dtdg = np.full(g.shape, F32(INV_POINTS))
    off = np.zeros(g.shape, np.int32)
    if tail:
        tm = (t < 1) | (t > INV_POINTS - 1)
        up = t > 1
        q = np.maximum(np.where(up, F32(1) - gc, gc), F32(1e-12))
        with np.errstate(divide="ignore"):
            tt = np.clip((-np.log2(q) - F32(G.TAIL_FROM)) * F32(G.TAIL_STEPS), F32(0),
                         F32(G.TAIL_POINTS - 0.01))
        ti = np.minimum(tt.astype(np.int32), G.TAIL_POINTS - 1)
        t = np.where(tm, tt, t)
        i = np.where(tm, ti, i)
        off = np.where(tm, ZTAIL + np.where(up, G.TAIL_POINTS + 1, 0), 0)
        sgn = np.where(up, F32(G.TAIL_STEPS / 0.6931472), F32(-G.TAIL_STEPS / 0.6931472))
        dtdg = np.where(tm, sgn / q, dtdg).astype(F32)
    z0, z1 = zinv[off + i], zinv[off + i + 1]
    val = (mu + sg * (z0 + (z1 - z0) * (t - i.astype(F32)))).astype(F32)
    b = val.view(np.uint32).astype(np.int64)
    a = b & 0x7FFFFFFF
    ex = (a >> 23) - 127 + f.bias
    with np.errstate(over="ignore", invalid="ignore"):
        sub = (a.astype(np.uint32).view(F32) * F32(1 << f.mant)
               * F32(2.0 ** (f.bias - 1)))  # format subnormals: linear in |value|
    maghat = np.where(ex >= 1, np.minimum(a.astype(F32) * F32(1.0 / (1 << (23 - f.mant)))
                                          - F32((127 - f.bias) << f.mant), F32(f.nonfinite - 1)),
                      sub).astype(F32)
    mag = np.rint(maghat).astype(np.int64)
    fe = np.where(ex >= 1, (b >> 23) & 0xFF, 127 - f.bias + 1)
    neg = (b >> 31) == 1
    kf = np.where(neg, F32(f.half - 1) - maghat, F32(f.half) + maghat).astype(F32)
    ulp = (np.maximum(fe - f.mant, 1) << 23).astype(np.uint32).view(F32)
    key = np.where(neg, f.half - 1 - mag, f.half + mag)
    return key, Lin(gc, kf, ((z1 - z0) * dtdg).astype(F32), ulp)


def emp_at(k, emps, f: Fmt):
    """E(k) (the kernel's emp_at), emps the model's row (uint32[257])."""
    bb = np.clip(k, 0, f.nkeys - 1) >> f.es
    e = emps[bb].astype(np.int64)
    if f.es:
        low = (k & ((1 << f.es) - 1)).astype(np.int64) << (32 - f.es)
        e = e + (((emps[bb + 1].astype(np.int64) - e) & 0xFFFFFFFF) * low >> 32)
    return e


@dataclass
class Setup:
    """One stage's inputs, per value: slot, stage (b, sh, S_b, T), value (mu, sigma grid)."""

    slot: np.ndarray
    b: np.ndarray
    sh: int
    sb: np.ndarray
    t: np.ndarray
    mu: np.ndarray
    sg: np.ndarray
    w: int
    zinv: np.ndarray
    emps: np.ndarray
    f: Fmt
    p: int
    shape: np.ndarray  # the model's shape CDF points (uint32, padded)


def fast_guess(s: Setup, rounds: int, newton: bool = True, pure_rounds: int = 1,
               fwd: int = 0, low_rounds: int | None = None, low_e_start: bool = False,
               top_ends: bool = False, low_bound: bool = False):
    """The kernel's fast_guess and guess_symbol's answer for a stage of no mass: the
    guessed symbol of each slot (``rounds`` = GUESS_ROUNDS, ``fwd`` = FWD_STEPS,
    ``low_rounds`` = LOW_ROUNDS, ``low_e_start`` = LOW_E_START, ``low_bound`` = LOW_BOUND:
    only in a 16-bit format's low stage; ``top_ends`` = TOP_ENDS: only in a 16-bit format's
    top stage)."""
    f, p, sh = s.f, s.p, s.sh
    low = f.es > 0 and sh == 0
    if low and low_rounds is not None:
        rounds = low_rounds
    ft, fsb = s.t.astype(F32), s.sb.astype(F32)
    slot = s.slot
    gs = (slot.astype(F32) + F32(0.5)) * F32(1.0 / (1 << p))  # the slot's fraction
    g0 = (fsb + gs * ft) * F32(1.0 / ONE)
    if low and low_e_start and s.w:  # E at the slot's linear place in the stage's bucket
        e0 = s.emps[s.b >> f.es].astype(F32)
        de = (s.emps[(s.b >> f.es) + 1].astype(np.int64)
              - s.emps[s.b >> f.es]).astype(np.uint32).astype(F32)
        g0 = ((g0 * F32(WEIGHT_ONE) - F32(s.w) * (e0 + de * gs) * F32(1.0 / ONE))
              * (F32(1) / F32(WEIGHT_ONE - s.w)))
    k, lin = guess_key(g0, s.mu, s.sg, s.zinv, f)
    unit = ft / F32((1 << p) - 256)
    # rounds with an empirical term; without, pure_rounds (at most the low stage's rounds)
    for _ in range(rounds if s.w else pure_rounds if not low else min(rounds, pure_rounds)):
        j0 = np.clip((k - s.b) >> sh, 0, 255)
        target = fsb + ((slot - j0).astype(F32) + F32(0.5)) * unit
        if s.w:
            e = emp_at(k, s.emps, f)
            if low:  # the stage's bucket, at the key clamped into the stage
                e0 = s.emps[s.b >> f.es].astype(np.int64)
                de = s.emps[(s.b >> f.es) + 1].astype(np.int64) - e0
                e = e0 + ((de * np.clip(k - s.b, 0, 1 << f.es)) >> f.es)
            target = ((target * F32(WEIGHT_ONE) - F32(s.w) * e.astype(F32))
                      * F32(1.0 / (WEIGHT_ONE - s.w)))
        k, lin = guess_key(target * F32(1.0 / ONE), s.mu, s.sg, s.zinv, f)
    if newton:
        wf = F32(s.w / WEIGHT_ONE)
        est = (F32(1) - wf) * F32(ONE) * lin.g
        with np.errstate(divide="ignore", invalid="ignore"):
            slope = ((F32(1) - wf) * F32(ONE) * (lin.ulp / (s.sg * lin.dzdg))
                     + unit * F32(1.0 / (1 << sh)))
        if s.w:
            bb = s.b >> f.es if low else np.clip(k, 0, f.nkeys - 1) >> f.es
            de = ((s.emps[bb + 1].astype(np.int64) - s.emps[bb]).astype(F32)
                  * F32(1.0 / (1 << f.es)))
            est = est + wf * (s.emps[bb].astype(F32)
                              + de * (lin.kf + F32(0.5) - (bb << f.es).astype(F32)))
            slope = slope + wf * de
        target = fsb + ((slot.astype(F32) + F32(0.5))
                        - (lin.kf - s.b.astype(F32)) * F32(1.0 / (1 << sh))) * unit
        with np.errstate(divide="ignore", invalid="ignore"):
            kn = lin.kf + (target - est) / slope
        kn = np.clip(np.nan_to_num(kn, nan=-1.0), F32(-1), F32(f.nkeys))
        k = np.rint(kn).astype(np.int64)
    if low and fwd:
        with np.errstate(all="ignore"):
            k = fwd_steps(k, s, fwd, unit)
    j = np.clip((k - s.b) >> sh, 0, 255)
    if low and low_bound:
        j = low_bounds(j, s)
    if f.es and not low and top_ends and s.w:
        j = top_bounds(j, s)
    return np.where(s.t == 0, slot >> (p - 8), j)  # a stage of no mass: exact


def low_bounds(j, s: Setup):
    """The kernel's low_bounds: the low-stage symbol clamped into ((slot - 1 - spread + 255
    a) / (1 + a), (slot + 1/2) / (1 + a)], a = spread we / (256 T) the slots a key that the
    stage's (linear) empirical term alone gives, we = floor(w de / 2^16)."""
    bb = s.b >> s.f.es
    de = (s.emps[bb + 1].astype(np.int64) - s.emps[bb]) & 0xFFFFFFFF
    we = (de * s.w) >> 16
    with np.errstate(all="ignore"):
        rq = F32((1 << s.p) - 256) * (F32(1) / s.t.astype(F32))  # stage_rq
        a = we.astype(F32) * rq * F32(1 / 256)
        r = F32(1) / (F32(1) + a)
        hi = np.floor((s.slot.astype(F32) + F32(0.5)) * r)
        lo = np.floor(((s.slot + 255 - (1 << s.p)).astype(F32) + F32(255) * a) * r) + 1
    hi = np.nan_to_num(hi, nan=255, posinf=255, neginf=0)  # (T = 0 is answered before)
    lo = np.nan_to_num(lo, nan=0, posinf=255, neginf=0)
    return np.clip(np.clip(j, lo, hi), 0, 255).astype(np.int64)


def top_bounds(j, s: Setup):
    """The kernel's top_bounds (a model with an empirical term): the top-stage symbol at most
    (slot + 1/2) / r0 and at least 255 - (2^p - slot - 1/2) / r1, r0 = 1 + spread w E(1) /
    2^47 and r1 = 1 + spread w (1 - E(255)) / 2^47 the slots a symbol of the flat ends."""
    rate = F32((1 << s.p) - 256) * F32(s.w) * F32(1.0 / ONE / WEIGHT_ONE)
    r0 = F32(1) + rate * F32(s.emps[1])
    r1 = F32(1) + rate * F32(ONE - int(s.emps[255]))
    s5 = s.slot.astype(F32) + F32(0.5)
    hi = np.floor(s5 / r0)
    lo = 255 - np.floor((F32(1 << s.p) - s5) / r1)
    return np.minimum(np.maximum(j, lo), hi).astype(np.int64)


def key_value(k, f: Fmt):
    """(value of key k, its value step): the kernel's key_value."""
    y = k - f.half
    a = np.minimum(np.where(y < 0, -y - 1, y), f.nonfinite - 1)
    e1 = a >> f.mant
    normal = (((e1 + 127 - f.bias) << 23) | ((a & ((1 << f.mant) - 1)) << (23 - f.mant)))
    sub = a.astype(F32) * F32(1.0 / (1 << f.mant)) * F32(2.0 ** (1 - f.bias))
    v = np.where(e1 > 0, normal.astype(np.uint32).view(F32), sub)
    ulp = ((np.maximum(e1, 1) + 127 - f.bias) << 23).astype(np.uint32).view(F32)
    return np.where(y < 0, -v, v).astype(F32), ulp * F32(1.0 / (1 << f.mant))


def fwd_steps(k, s: Setup, steps: int, unit):
    """The kernel's fwd_steps (a 16-bit format's low stage, sh = 0; see its comment):
    Newton on c(u) = slot + 1/2, c(u) = u - b + (S(u) - S_b) / unit, S = (1 - w) F + w E
    forwards from the shape's points and the stage's empirical bucket."""
    f = s.f
    x, ulp = key_value(np.clip(k, 0, f.nkeys - 1), f)
    u = k.astype(F32) + F32(0.5)
    wf = F32(s.w / WEIGHT_ONE)
    rs = F32(1) / unit
    zs = F32(64) / s.sg
    sb = s.sb
    bb = s.b >> f.es
    e0 = (s.emps[bb].astype(np.int64) - sb).astype(F32)
    de = (s.emps[bb + 1].astype(np.int64) - s.emps[bb]).astype(F32) * F32(1.0 / (1 << f.es))
    target = s.slot.astype(F32) + F32(0.5)
    for _ in range(steps):
        zf = np.nan_to_num((x - s.mu) * zs + F32(2048), nan=4095.99)
        zf = np.clip(zf, F32(0), F32(4096 - 0.01))
        i = zf.astype(np.int32)
        t0, t1 = s.shape[i].astype(np.int64), s.shape[i + 1].astype(np.int64)
        dt = (t1 - t0).astype(F32)
        rel = (F32(1) - wf) * ((t0 - sb).astype(F32) + dt * (zf - i.astype(F32)))
        dsl = (F32(1) - wf) * dt * zs * ulp
        if s.w:
            rel = rel + wf * (e0 + de * (u - s.b.astype(F32)))
            dsl = dsl + wf * de
        c = u - s.b.astype(F32) + rel * rs
        d = np.clip(np.nan_to_num((target - c) / (F32(1) + dsl * rs), nan=512.0),
                    F32(-512), F32(512))
        u = u + d
        x = x + d * ulp
    return np.floor(u).astype(np.int64)


def stages(fmt: str, n: int, mi: int, seed: int = 11, p: int = D.DEFAULT_PRECISION):
    """kv_check's sample (on the CPU) with each value's exact stages and a slot in each:
    (top Setup, true top symbols, low Setup or None, true low symbols)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import kv_check

    bits, mu, sigma = kv_check.sample(torch, fmt, n, seed, torch.device("cpu"))
    vals = kv_check.host(bits)
    mu, sigma = mu.numpy(), sigma.numpy()
    model = kv_check.model()
    df = D.FORMATS[fmt]
    f = _fmt(df)
    out = np.zeros((n, 8), np.int64)
    _truth(vals, mu.view(np.uint32), sigma.view(np.uint32), mi, df.params, model.padded,
           model.emps, model.weights, D._RTAB, p, out)
    assert out[:, 7].all()
    arr = G.model_arrays(model)
    zrow = arr["zinv"].size // len(model)
    zinv = arr["zinv"][mi * zrow:(mi + 1) * zrow]
    emps = np.asarray(model.emps[mi], np.uint32)
    shape = np.asarray(model.padded[mi], np.uint32)
    w = int(model.weights[mi])
    sgb = sigma.view(np.uint32)
    sgf = ((sgb + (1 << 14)) & ~np.uint32(0x7FFF)).view(F32)
    rng = np.random.default_rng(seed)
    key = out[:, 0]

    def slot(c0, c1):
        return c0 + np.floor(rng.random(n) * (c1 - c0)).astype(np.int64)

    zero = np.zeros(n, np.int64)
    top = Setup(slot(out[:, 1], out[:, 2]), zero, f.es, zero, np.full(n, ONE, np.int64),
                mu.astype(F32), sgf, w, zinv, emps, f, p, shape)
    if not f.es:
        return top, key, None, None
    low = Setup(slot(out[:, 3], out[:, 4]), (key >> f.es) << f.es, 0, out[:, 5],
                out[:, 6] - out[:, 5], mu.astype(F32), sgf, w, zinv, emps, f, p, shape)
    return top, key >> f.es, low, key & ((1 << f.es) - 1)


def misses(guess, true) -> tuple[float, float]:
    """(missed, missed by 2+ symbols) per value."""
    d = np.abs(guess - true)
    return float(np.mean(d > 0)), float(np.mean(d > 1))


# The kernel's choices per format width (_dist_kernel.cu: GUESS_ROUNDS, FWD_STEPS,
# LOW_ROUNDS, LOW_E_START; the flat-stretch bounds always)
BUILT = {16: {"rounds": 0, "fwd": 2, "low_rounds": 0, "low_e_start": True},
         8: {"rounds": 1, "fwd": 0, "low_rounds": 1, "low_e_start": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--fmt", nargs="*", default=["bf16", "fp8_e4m3"])
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--fwd", type=int, default=None, help="FWD_STEPS (default: the kernel's)")
    ap.add_argument("--low-rounds", type=int, default=None,
                    help="LOW_ROUNDS (default: the kernel's)")
    a = ap.parse_args()
    for fmt in a.fmt:
        for mi, name in ((0, "mixture"), (1, "Gaussian")):
            top, jt, low, jl = stages(fmt, a.n, mi)
            b = BUILT[D.FORMATS[fmt].bits]
            r = b["rounds"] if a.rounds is None else a.rounds
            fwd = b["fwd"] if a.fwd is None else a.fwd
            lr = b["low_rounds"] if a.low_rounds is None else a.low_rounds
            mt = misses(fast_guess(top, r, top_ends=True), jt)
            row = f"{fmt:9s} {name:8s} rounds {r}: top {100 * mt[0]:.2f}% (2+ {100 * mt[1]:.2f}%)"
            if low is not None:
                ml = misses(fast_guess(low, r, fwd=fwd, low_rounds=lr,
                                       low_e_start=b["low_e_start"], low_bound=True), jl)
                row += (f", low ({lr} rounds, {fwd} steps) {100 * ml[0]:.2f}% "
                        f"(2+ {100 * ml[1]:.2f}%)")
            print(row, flush=True)


if __name__ == "__main__":
    main()
