"""The GPU distribution-rANS path's logic on the CPU: host half, warp algorithm, CRC, errors.

The kernels (entropykit/rans/cuda/_dist_kernel.cu) run only on the device machine, where
gpu/tests/test_cuda_kv.py checks them bit for bit against the CPU coder. Their per-value
arithmetic is the CPU kernels' (dist_kernels), ported line for line; what the port adds is
the warp's structure, which the twin here replays in numpy from the kernels' own buffers (model
arrays, per-chunk result rows, gather offsets, decode descriptors, status codes): the
encoder's backwards ballot word placement and room check into a raw-sized scratch, the
gather into the frame and its directory, the decoder's forwards ballot word reads with
its bounds checks, the per-lane CRC-32 slices combined by x^(8 n) shifts, and how per-chunk
status becomes the CPU's exceptions; and the decoder's own arithmetic where it departs from
the CPU's: S's key offset in 32-bit words, both searches of a missed guess (the lane's,
the neighbour then the warp's two ballots) from any guess, and the direct answer of a low
stage of no mass; and gpu/guess_emulator.py, the float guess's CPU replay. Each lane's
symbol arithmetic comes from dist_kernels itself (an njit helper below), so a frame from
the twin equals ``distribution.encode``'s only if the warp structure is right.
"""

from __future__ import annotations

import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from numba import njit

from entropykit import CorruptDataError
from entropykit._status import Status
from entropykit.rans import dist_kernels as K
from entropykit.rans import distribution as D
from entropykit.rans.cuda import dist as G

LANES = 32
L = 1 << 16


def _model() -> D.CoderModel:
    counts = np.ones(65536, np.int64)
    counts[0x8000 + 0x3F00 : 0x8000 + 0x4000] = 1000
    mix = D.gaussian_shape((1.0, 3.0), (0.95, 0.03))
    emp = D.empirical_table(counts)
    return D.CoderModel(np.stack([mix, D.gaussian_shape()]), np.stack([emp, emp]), [1311, 0])


MODEL = _model()
ARR = G.model_arrays(MODEL)
DTYPES = {"bf16": ml_dtypes.bfloat16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
          "fp16": np.float16, "fp8_e5m2": ml_dtypes.float8_e5m2}


# ---- the per-lane arithmetic, from dist_kernels (what each lane of the warp computes) ----


@njit(cache=True)
def _value_cdfs(vals, mu, sg, midx, fp, shapes, emps, ws, rtab, p, out):
    """out[i] = (t0, t1, l0, l1, ok) of value i: its stage CDFs, or ok = 0 (bad mu/sigma)."""
    f = K._fmt(fp)
    for i in range(vals.size):
        ok, v = K._params(mu[i], sg[i], midx[i], ws, rtab, f)
        out[i, 4] = ok
        if ok:
            out[i, 0], out[i, 1], out[i, 2], out[i, 3] = K._value_cdfs(
                K._key(np.int64(vals[i]), f.nkeys), v, f, shapes, emps, (1 << p) - 256)


@njit(cache=True)
def _lane_symbols(xs, low, b, sb, t, mu, mu_f, sg, midx, fp, shapes, zinv, emps, ws, rtab, p, out):
    """Each live lane's step: out[q] = (j, S_j, S_j+1, new state before renormalization),
    found as the kernel does (CPU float guess, two exact CDFs, search on a miss)."""
    f = K._fmt(fp)
    spread = (1 << p) - 256
    for q in range(xs.size):
        ok, v = K._params(mu[q], sg[q], midx[q], ws, rtab, f)
        sh = 0 if low else f.es
        bq, sbq, tq = (b[q], sb[q], t[q]) if low else (0, 0, K.ONE)
        x = xs[q]
        slot = x & ((1 << p) - 1)
        j = K._stage_guess(x, bq, sh, sbq, tq, np.float64(mu_f[q]), K._grid_sigma(sg[q]), v.m,
                           f, zinv, p)
        sj = K._smooth_cdf(bq + (j << sh), v, f, shapes, emps)
        sn = K._smooth_cdf(bq + ((j + 1) << sh), v, f, shapes, emps)
        c0 = K._stage_cdf(j, sj, sbq, tq, spread)
        c1 = K._stage_cdf(j + 1, sn, sbq, tq, spread)
        if not c0 <= slot < c1:
            j, sj, sn, c0, c1 = K._search_from(slot, j, sj, c0, bq, sh, sbq, tq, spread, v, f,
                                               shapes, emps)
        out[q, 0], out[q, 1], out[q, 2] = j, sj, sn
        out[q, 3] = (c1 - c0) * (x >> p) + slot - c0


# ---- the warp twin -------------------------------------------------------------------------


def _ballot_above(emit: np.ndarray) -> np.ndarray:
    """popc(ballot & lanes above q), per lane q."""
    c = np.cumsum(emit[::-1])[::-1]
    return c - emit


def _ballot_below(need: np.ndarray) -> np.ndarray:
    """popc(ballot & lanes below q), per lane q."""
    return np.cumsum(need) - need


def _warp_crc(data: np.ndarray) -> int:
    """The kernel's warp_crc: lane slices of ceil(n / 32) rounded up to 4 bytes, each
    crc32'd and shifted over the bytes after it by x^(8 after) (x_powers), XORed."""
    n = data.size
    seg = (-(-n // LANES) + 3) & ~3
    xp = G.x_powers()

    def mult(a: int, b: int) -> int:
        p = 0
        for i in range(31, -1, -1):
            if a >> i & 1:
                p ^= b
            b = (b >> 1) ^ 0xEDB88320 if b & 1 else b >> 1
        return p

    out = 0
    for lane in range(LANES):
        lo = min(lane * seg, n)
        hi = min(lo + seg, n)
        c = zlib.crc32(data[lo:hi].tobytes())
        after, k = n - hi, 3
        while after:
            if after & 1:
                c = mult(int(xp[k & 31]), c)
            after >>= 1
            k += 1
        out ^= c
    return out


def _twin_encode(bits: np.ndarray, mu: np.ndarray, sigma: np.ndarray, fmt: str, midx=None,
                 precision: int = 16, chunk_size: int = 1024) -> bytes:
    """dist.encode's flow with the warp's algorithm in numpy: dist_encode per chunk into the
    scratch and result rows, the host's lengths / cumsum, dist_gather into the frame."""
    f = D.FORMATS[fmt]
    n = bits.size
    nc = G.check_encode_args(f, n, precision, chunk_size)
    width = f.bits // 8
    raw = np.ascontiguousarray(bits).view(np.uint8)
    idx = np.zeros(n, np.uint16) if midx is None else midx.astype(np.uint16)
    cdf = np.zeros((n, 5), np.int64)
    _value_cdfs(bits, mu.view(np.uint32), sigma.view(np.uint32), idx, f.params, MODEL.padded,
                MODEL.emps, MODEL.weights, D._RTAB, precision, cdf)
    scratch = np.full(raw.size, 0xEE, np.uint8)  # poisoned: every kept byte is written
    res = np.zeros((nc, 4), np.int64)
    for c in range(nc):
        first = c * chunk_size
        cn = min(chunk_size, n - first)
        nbytes = cn * width
        out = scratch[first * width : first * width + nbytes]
        x = np.full(LANES, L, np.int64)
        pos, mode, unchecked = nbytes, D.MODE_CODED, cn
        for g0 in range((cn - 1) & -LANES, -1, -LANES):
            m = min(LANES, cn - g0)
            if pos - 4 * m < 4 * LANES:
                mode = D.MODE_RAW
                break
            rows = cdf[first + g0 : first + g0 + m]
            if not rows[:, 4].all():
                mode, unchecked = Status.PARAM, g0 + m
                break
            unchecked = g0
            stages = ((2, 3), (0, 1)) if f.bits == 16 else ((0, 1),)
            for a, b in stages:  # the low-byte step first: the decoder reads it last
                fr = rows[:, b] - rows[:, a]
                emit = x[:m] >= fr << (32 - precision)
                at = pos - 2 * (1 + _ballot_above(emit.astype(np.int64)))
                for q in np.flatnonzero(emit):
                    out[at[q]], out[at[q] + 1] = x[q] & 0xFF, (x[q] >> 8) & 0xFF
                xs = np.where(emit, x[:m] >> 16, x[:m])
                q = xs // fr
                x[:m] = (q << precision) + (xs - q * fr) + rows[:, a]
                pos -= 2 * int(emit.sum())
        bad = np.flatnonzero(~cdf[first : first + unchecked, 4].astype(bool))
        if bad.size:
            mode = Status.PARAM
        if mode == D.MODE_CODED:
            pos -= 4 * LANES
            out[pos : pos + 4 * LANES] = x.astype("<u4").view(np.uint8)
        crc = _warp_crc(raw[first * width : first * width + nbytes])
        assert crc == zlib.crc32(raw[first * width : first * width + nbytes])
        res[c] = (mode, pos if mode == D.MODE_CODED else (bad[0] if bad.size else -1),
                  nbytes - pos if mode == D.MODE_CODED else nbytes, crc)
    if (res[:, 0] == Status.PARAM).any():
        c = int(np.flatnonzero(res[:, 0] == Status.PARAM)[0])
        raise ValueError(f"value {c * chunk_size + int(res[c, 1])}")
    lengths = res[:, 2]
    dst = np.cumsum(lengths) - lengths
    base = G.HEADER_SIZE + 9 * nc
    frame = np.full(base + int(lengths.sum()), 0xCC, np.uint8)
    frame[: G.HEADER_SIZE] = np.frombuffer(G.header(f, n, chunk_size, precision,
                                                    MODEL.fingerprint), np.uint8)
    for c in range(nc):  # dist_gather
        s0 = c * chunk_size * width + (res[c, 1] if res[c, 0] == D.MODE_CODED else 0)
        src = scratch if res[c, 0] == D.MODE_CODED else raw
        frame[base + dst[c] : base + dst[c] + lengths[c]] = src[s0 : s0 + lengths[c]]
        frame[28 + 4 * c : 32 + 4 * c] = np.array([lengths[c]], "<u4").view(np.uint8)
        frame[28 + 4 * nc + 4 * c : 32 + 4 * nc + 4 * c] = np.array([res[c, 3]],
                                                                    "<u4").view(np.uint8)
        frame[28 + 8 * nc + c] = res[c, 0]
    return frame.tobytes()


def _twin_decode(blob: bytes, mu: np.ndarray, sigma: np.ndarray, midx=None) -> np.ndarray:
    """dist.decode's flow with dist_decode's warp algorithm in numpy: descriptors from the
    host parse, per-chunk status codes, then the exceptions the host raises from them."""
    info = D.parse(blob)
    f, n, cs, p = info.fmt, info.n, info.chunk_size, info.precision
    width = f.bits // 8
    frame = np.frombuffer(blob, np.uint8)
    desc = _directory_twin(frame, len(info.lengths))[0]
    nc = desc.shape[0]
    out = np.full(n, 0x7FA5 if width == 2 else 0xA5, f.storage)
    ob = out.view(np.uint8)
    idx = np.zeros(n, np.uint16) if midx is None else midx.astype(np.uint16)
    mub, sgb = mu.view(np.uint32), sigma.view(np.uint32)
    valid = np.isfinite(mu) & np.isfinite(sigma) & (sigma > 0)
    status = np.zeros((nc, 2), np.int32)
    for c in range(nc):
        first = c * cs
        cn = min(cs, n - first)
        off, length, mode, crc = (int(v) for v in desc[c])
        pay = frame[off : off + length]
        code, checked = 0, 0
        if mode == D.MODE_RAW:
            if length != cn * width:
                code = Status.RAW
            else:
                ob[first * width : (first + cn) * width] = pay
        elif length < 4 * LANES or (length - 4 * LANES) & 1:
            code = int(Status.ODD)
        else:
            x = pay[: 4 * LANES].view("<u4").astype(np.int64)
            code = int(Status.STATE) if (x < L).any() else 0
            words = pay[4 * LANES :]
            n_words, wp = (length - 4 * LANES) >> 1, 0
            for g0 in range(0, cn, LANES):
                if code:
                    break
                m = min(LANES, cn - g0)
                sl = slice(first + g0, first + g0 + m)
                if not valid[sl].all():
                    checked, code = g0, Status.PARAM
                    break
                checked = g0 + LANES
                step = np.zeros((m, 4), np.int64)
                top = None
                for low in range(2 if width == 2 else 1):
                    b = np.zeros(m, np.int64) if top is None else top[:, 0] << 8
                    sb = np.zeros(m, np.int64) if top is None else top[:, 1]
                    t = np.zeros(m, np.int64) if top is None else top[:, 2] - top[:, 1]
                    _lane_symbols(x[:m].copy(), low == 1, b, sb, t, mub[sl], mu[sl], sgb[sl],
                                  idx[sl], f.params, MODEL.padded, MODEL.inverse, MODEL.emps,
                                  MODEL.weights, D._RTAB, p, step)
                    xs = step[:, 3].copy()
                    need = (xs < L).astype(np.int64)
                    at = wp + _ballot_below(need)
                    wp += int(need.sum())
                    if wp > n_words:
                        code = K.ERR_TRUNCATED
                        break
                    for q in np.flatnonzero(need):
                        w = int(words[2 * at[q]]) | int(words[2 * at[q] + 1]) << 8
                        xs[q] = (xs[q] << 16) | w
                    x[:m] = xs
                    if top is None and width == 2:
                        top = step.copy()
                if code:
                    break
                key = step[:, 0] if width == 1 else (top[:, 0] << 8) + step[:, 0]
                half = 1 << (f.bits - 1)
                out[sl] = np.where(key >= half, key ^ half, key ^ (2 * half - 1))
            if not code and wp != n_words:
                code = K.ERR_TRAILING
            if not code and (x != L).any():
                code = K.ERR_FINAL
        bad = np.flatnonzero(~valid[first + checked : first + cn])
        where = 0
        if bad.size:
            code, where = Status.PARAM, checked + int(bad[0])
        if not code and _warp_crc(ob[first * width : (first + cn) * width]) != crc:
            code = Status.CRC
        status[c] = code, where
    bad = G.first_bad_param(status[:, 0], status[:, 1], cs)
    if bad >= 0:
        raise ValueError(f"value {bad}: invalid mu/sigma")
    err = G.chunk_error(status[:, 0], info.offsets)
    if err is not None:
        raise CorruptDataError(err[1])
    return out


def _sample(fmt: str, n: int, seed: int):
    f = D.FORMATS[fmt]
    rng = np.random.default_rng(seed)
    mu = (rng.normal(0, 20 if f.bits == 8 else 1, n)).astype(np.float32)
    sigma = np.exp(rng.normal(0.5 if f.bits == 8 else -2, 0.5, n)).astype(np.float32)
    with np.errstate(all="ignore"):
        x = (mu + sigma * rng.standard_t(4, n)).astype(DTYPES[fmt]).view(f.storage).copy()
    special = rng.random(n) < 0.02  # NaN payloads, infinities, -0, subnormals
    x[special] = rng.integers(0, 1 << f.bits, int(special.sum()))
    return x, mu, sigma, rng.integers(0, 2, n)


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
@pytest.mark.parametrize("n", [1, 31, 33, 1024, 1025, 3000])
@pytest.mark.parametrize("precision", [12, 16])
def test_twin_frames_equal_cpu_frames(fmt, n, precision):
    x, mu, sigma, midx = _sample(fmt, n, n + precision)
    cpu = D.encode(x, mu, sigma, MODEL, fmt=fmt, model_index=midx, precision=precision,
                   chunk_size=1024)
    assert _twin_encode(x, mu, sigma, fmt, midx, precision) == cpu
    np.testing.assert_array_equal(_twin_decode(cpu, mu, sigma, midx), x)


@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
def test_twin_raw_chunks_and_whole_value_space(fmt):
    f = D.FORMATS[fmt]
    rng = np.random.default_rng(3)
    x = rng.integers(0, 1 << f.bits, 2100).astype(f.storage)  # far from a narrow model: raw
    mu, sg = np.zeros(2100, np.float32), np.full(2100, 1e-6, np.float32)
    cpu = D.encode(x, mu, sg, MODEL, fmt=fmt, chunk_size=1024)
    assert set(D.parse(cpu).modes.tolist()) == {D.MODE_RAW}
    assert _twin_encode(x, mu, sg, fmt) == cpu
    np.testing.assert_array_equal(_twin_decode(cpu, mu, sg), x)
    keys = np.arange(1 << f.bits).astype(f.storage)  # every bit pattern, narrow and wide
    for m0, s0 in [(1.0, 1e-3), (0.0, 1e4)]:
        mu, sg = np.full(keys.size, m0, np.float32), np.full(keys.size, s0, np.float32)
        cpu = D.encode(keys, mu, sg, MODEL, fmt=fmt, chunk_size=1024)
        assert _twin_encode(keys, mu, sg, fmt) == cpu
        np.testing.assert_array_equal(_twin_decode(cpu, mu, sg), keys)


BITS, MU, SIGMA, _ = _sample("bf16", 3100, 11)
BLOB = D.encode(BITS, MU, SIGMA, MODEL, fmt="bf16", chunk_size=1024)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(D.HEADER_SIZE, len(BLOB) - 1), xor=st.integers(1, 255))
def test_twin_fails_like_the_cpu_on_a_flipped_byte(pos, xor):
    # Same chunk, same message as the CPU decoder, or the same (exact) output.
    b = bytearray(BLOB)
    b[pos] ^= xor
    b = bytes(b)
    try:
        want = D.decode(b, MU, SIGMA, MODEL)
    except CorruptDataError as e:
        with pytest.raises(CorruptDataError) as got:
            _twin_decode(b, MU, SIGMA)
        assert str(got.value) == str(e)
        return
    np.testing.assert_array_equal(_twin_decode(b, MU, SIGMA), want)
    np.testing.assert_array_equal(want, BITS)


@pytest.mark.parametrize("where", [0, 1500, 3099])
def test_invalid_parameter_is_reported_by_index(where):
    # A NaN sigma anywhere (a raw or coded chunk, any group) is the first error reported,
    # even when an earlier chunk is corrupt, as on the CPU (which checks them first).
    sg = SIGMA.copy()
    sg[where] = np.nan
    with pytest.raises(ValueError, match=f"value {where}"):
        _twin_encode(BITS, MU, sg, "bf16")
    b = bytearray(BLOB)
    b[D.HEADER_SIZE + 9 * 4 + 200] ^= 0x55  # garbage in chunk 0
    for blob in (BLOB, bytes(b)):
        with pytest.raises(ValueError, match=f"value {where}"):
            _twin_decode(blob, MU, sg)
        with pytest.raises(ValueError, match=f"value {where}") as e:
            D.decode(blob, MU, sg, MODEL)
        assert not isinstance(e.value, CorruptDataError)


@given(data=st.binary(min_size=0, max_size=700))
@settings(max_examples=60, deadline=None)
def test_warp_crc_is_zlib_crc32(data):
    assert _warp_crc(np.frombuffer(data, np.uint8)) == zlib.crc32(data)


def test_x_powers_are_zlibs():
    xp = G.x_powers()
    # x, x^2, and x^32 = the polynomial's lower terms (bit-reflected, x^0 in bit 31)
    assert xp[0] == 1 << 30 and xp[1] == 1 << 29 and xp[5] == 0xEDB88320
    # crc32_combine: crc(A B) = crc(A) x^(8 |B|) + crc(B), with x^(8 |B|) from the table.
    a, b = b"entropy", b"kit on a GPU, in slices"
    assert _warp_crc(np.frombuffer(a + b, np.uint8)) == zlib.crc32(a + b)


def _directory_twin(frame: np.ndarray, nc: int) -> tuple[np.ndarray, list[int]]:
    """dist_directory in numpy, run by run as its threads go: each of DIR_THREADS threads
    sums a run of lengths, an inclusive scan of the runs gives each run's start; the table
    (zeroed where the directory fails parse's checks) and the facts (end, bad chunk, mode)."""
    threads = G.DIR_THREADS
    per = -(-nc // threads)
    lens = frame[28 : 28 + 4 * nc].view("<u4").astype(np.int64)
    crcs = frame[28 + 4 * nc : 28 + 8 * nc].view("<u4").astype(np.int64)
    modes = frame[28 + 8 * nc : 28 + 9 * nc].astype(np.int64)
    runs = [(min(t * per, nc), min(t * per + per, nc)) for t in range(threads)]
    sums = np.array([lens[lo:hi].sum() for lo, hi in runs], np.int64)
    part = np.cumsum(sums)
    base = 28 + 9 * nc
    end = int(base + part[-1])
    bad = int(np.flatnonzero(modes > D.MODE_RAW)[0]) if (modes > D.MODE_RAW).any() else nc
    ok = end == frame.size and bad == nc
    table = np.zeros((nc, 4), np.int64)
    for t, (lo, hi) in enumerate(runs):
        off = base + part[t] - sums[t]
        for c in range(lo, hi):
            if ok:
                table[c] = (off, lens[c], modes[c], crcs[c])
            off += lens[c]
    return table, [end, bad if bad < nc else -1, int(modes[bad]) if bad < nc else 0]


def _directory_check(facts: list[int], size: int) -> None:
    err = D.directory_error(facts[0], size, facts[1], facts[2])  # PendingDecode.result's
    if err is not None:
        raise CorruptDataError(err)


def test_header_and_directory():
    """The header the encoder writes; dist_directory's algorithm (numpy twin): its table is
    parse's offsets, lengths, modes and CRCs, and a corrupt directory gives parse's error,
    an all-empty table (the decoder reads no payload) and nothing else."""
    info = D.parse(BLOB)
    assert G.header(info.fmt, info.n, info.chunk_size, info.precision,
                    info.fingerprint) == BLOB[: G.HEADER_SIZE]
    assert D.parse_header(BLOB[: G.HEADER_SIZE], len(BLOB)) == info.header
    frame = np.frombuffer(BLOB, np.uint8)
    nc = len(info.lengths)
    table, facts = _directory_twin(frame, nc)
    np.testing.assert_array_equal(table, np.stack(
        [info.offsets, info.lengths, info.modes.astype(np.int64),
         info.crcs.astype(np.int64)], axis=1))
    assert facts == [len(BLOB), -1, 0]
    _directory_check(facts, len(BLOB))  # no error
    cases = {"length": (G.HEADER_SIZE + 1, 0x01), "length high byte": (G.HEADER_SIZE + 7, 0x80),
             "mode": (G.HEADER_SIZE + 8 * nc + 2, 0x02), "mode 255": (G.HEADER_SIZE + 8 * nc, 0xFD)}
    for name, (pos, flip) in cases.items():
        bad = bytearray(BLOB)
        bad[pos] ^= flip
        with pytest.raises(CorruptDataError) as want:
            D.parse(bytes(bad))
        table, facts = _directory_twin(np.frombuffer(bytes(bad), np.uint8), nc)
        assert not table.any(), name
        with pytest.raises(CorruptDataError) as got:
            _directory_check(facts, len(bad))
        assert str(got.value) == str(want.value), name
    for size in (len(BLOB) - 1, len(BLOB) + 1):  # payloads end after / before the frame
        cut = np.frombuffer((BLOB + b"\0")[:size], np.uint8)
        table, facts = _directory_twin(cut, nc)
        assert not table.any()
        with pytest.raises(CorruptDataError, match="truncated|trailing"):
            _directory_check(facts, size)
    with pytest.raises(CorruptDataError, match="truncated"):
        D.parse_header(BLOB[:10], 10)
    with pytest.raises(CorruptDataError, match="chunk directory"):
        D.parse_header(BLOB[: G.HEADER_SIZE], G.HEADER_SIZE + 9 * nc - 1)


@pytest.mark.parametrize("nc", [1, 2, 1023, 1024, 1025, 3000])
def test_directory_runs(nc):
    """Chunk counts around the block's thread count: the runs' scan still gives parse's
    offsets (random lengths, both modes)."""
    rng = np.random.default_rng(nc)
    lens = rng.integers(0, 300, nc).astype("<u4")
    crcs = rng.integers(0, 2**32, nc, dtype=np.uint64).astype("<u4")
    modes = rng.integers(0, 2, nc).astype(np.uint8)
    head = np.zeros(G.HEADER_SIZE, np.uint8)
    frame = np.concatenate([head, lens.view(np.uint8), crcs.view(np.uint8), modes,
                            np.zeros(int(lens.sum()), np.uint8)])
    table, facts = _directory_twin(frame, nc)
    starts = 28 + 9 * nc + np.concatenate(([0], np.cumsum(lens.astype(np.int64))[:-1]))
    np.testing.assert_array_equal(table[:, 0], starts)
    np.testing.assert_array_equal(table[:, 1:], np.stack([lens, modes, crcs], 1).astype(np.int64))
    assert facts == [frame.size, -1, 0]


def test_model_index_checked_once_per_contents():
    """A flat int16 index on the device (here the CPU) is range-checked once; reused
    unchanged it is not checked again (no wait on its stream), changed it is."""
    model = D.CoderModel(np.stack([D.gaussian_shape()] * 3))
    idx = torch.tensor([0, 2, 1, 2], dtype=torch.int16)
    got, m0 = G._index(idx, model, 4, torch.device("cpu"))
    assert got is idx and m0 == 0
    assert G._checked[id(idx)][1:] == (idx._version, 4, 3, "cpu")
    assert G._index(idx, model, 4, torch.device("cpu"))[0] is idx
    idx[1] = 3  # out of range: the version moves, so it is checked again
    with pytest.raises(ValueError, match="out of range"):
        G._index(idx, model, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="out of range"):  # and not remembered as good
        G._index(idx, model, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="out of range"):  # a smaller model: checked again
        G._index(torch.tensor([0, 2], dtype=torch.int16), D.CoderModel(
            np.stack([D.gaussian_shape()] * 2)), 2, torch.device("cpu"))
    other = np.array([1, 0, 2, 2], np.int64)  # not a flat int16 tensor: converted, checked
    conv, _ = G._index(other, model, 4, torch.device("cpu"))
    assert conv.dtype == torch.int16 and conv.tolist() == [1, 0, 2, 2]
    key = id(idx)
    del idx, got
    assert key not in G._checked  # forgotten with the tensor


def test_status_to_errors():
    offsets = np.array([100, 200, 300])
    assert G.chunk_error(np.zeros(3, np.int32), offsets) is None
    c, msg = G.chunk_error(np.array([0, K.ERR_FINAL, Status.CRC]), offsets)
    assert c == 1 and msg == ("distribution-rANS frame chunk 1 (payload at byte 200): "
                              + K.MESSAGES[K.ERR_FINAL])
    codes = np.array([K.ERR_TRUNCATED, Status.PARAM, Status.PARAM])
    assert G.first_bad_param(codes, np.array([0, 7, 3]), 1024) == 1024 + 7
    assert G.first_bad_param(np.zeros(2, np.int32), np.zeros(2, np.int32), 1024) == -1


def test_format_of_torch_dtypes():
    assert G.format_of(torch.bfloat16, None).name == "bf16"
    assert G.format_of(torch.float8_e4m3fn, "fp8_e4m3").name == "fp8_e4m3"
    assert G.format_of(torch.int16, "fp16").name == "fp16"
    assert G.format_of(torch.uint8, "fp8_e5m2").name == "fp8_e5m2"
    with pytest.raises(TypeError, match="pass fmt"):
        G.format_of(torch.int16, None)
    with pytest.raises(TypeError, match="bits must be"):
        G.format_of(torch.int32, "bf16")
    with pytest.raises(ValueError, match="fmt"):
        G.format_of(torch.bfloat16, "fp16")
    with pytest.raises(ValueError, match="precision"):
        G.check_encode_args(D.FORMATS["bf16"], 10, 17, 1024)
    with pytest.raises(ValueError, match="chunk_size"):
        G.check_encode_args(D.FORMATS["bf16"], 10, 16, 1000)
    assert G.check_encode_args(D.FORMATS["bf16"], 2049, 16, 1024) == 3


def test_model_arrays_and_shared_memory_plan():
    a = G.model_arrays(MODEL)
    assert a["shapes"].size == len(MODEL) * (K.Z_POINTS + 2)  # SHAPE_W in the kernel
    assert a["emps"].size == len(MODEL) * (K.EMP_POINTS + 1)
    assert a["zinv"].dtype == np.float32
    assert a["zinv"].size == len(MODEL) * (K.INV_POINTS + 1 + 2 * (G.TAIL_POINTS + 1))
    assert a["rtab"].size == 512
    assert G.smem_bytes(MODEL) == len(MODEL) * (4098 + 257) * 4
    many = D.CoderModel(np.stack([D.gaussian_shape()] * 8))
    assert G.smem_bytes(many) == 0  # over the limit: tables through L1
    assert G.smem_bytes(many, zinv=True) == 0


def test_gpu_calls_need_cuda():
    # Without CUDA the API says so (CPU tensors are not accepted), before any work.
    x = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="CUDA|cuda|torch|cupy"):
        G.encode(x, torch.zeros(8), torch.ones(8), MODEL)


# ---- the decoder's fast path for regular values ---------------------------------------------


@njit(cache=True)
def _all_s(mu_bits, sg_bits, m, fp, shapes, emps, ws, rtab, out):
    """S(k) for every key boundary k = 0..nkeys of one (mu, sigma); returns mu_u."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, m, ws, rtab, f)
    for k in range(f.nkeys + 1):
        out[k] = K._smooth_cdf(k, v, f, shapes, emps)
    return v.mu_u


def _regular(mu_u: int, fmt: str) -> bool:
    """The kernel's regular(): |mu_u| < 2^(MANT + 50)."""
    return abs(mu_u) < 1 << (D.FORMATS[fmt].mantissa + 50)


def _s_of(mu: float, sigma: float, fmt: str, m: int = 0) -> tuple[np.ndarray, int]:
    f = D.FORMATS[fmt]
    out = np.zeros((1 << f.bits) + 1, np.int64)
    mu_u = _all_s(np.float32(mu).view(np.uint32), np.float32(sigma).view(np.uint32), m,
                  f.params, MODEL.padded, MODEL.emps, MODEL.weights, D._RTAB, out)
    return out, int(mu_u)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["bf16", "fp8_e4m3"]), m=st.integers(0, 1),
       mu=st.floats(allow_nan=False, allow_infinity=False, width=32),
       sigma=st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, width=32))
def test_regular_values_have_monotone_cdfs(fmt, m, mu, sigma):
    # The premise of the decoder's fast guess and search: for a regular value S never
    # falls, so each slot has exactly one symbol and any search finds the CPU's.
    assume(not K._invalid(np.float32(mu).view(np.uint32), np.float32(sigma).view(np.uint32)))
    s, mu_u = _s_of(mu, sigma, fmt, m)
    if _regular(mu_u, fmt):
        assert (np.diff(s) >= 0).all() and s[0] == 0 and s[-1] == K.ONE


@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
def test_every_accepted_value_is_regular(fmt):
    # The coder refuses mu at 2**MU_RANGE sigma and beyond (dist_kernels._invalid), before
    # the regular bound of any format: the largest accepted ratio is regular and its S
    # rises everywhere, and one exponent step further is refused on the CPU (the kernel's
    # param_ok is the same test).
    for mu in (3.0, -1.5, 2.0**100, 1e-20):
        far = mu * 2.0 ** -(K.MU_RANGE - 1)
        s, mu_u = _s_of(mu, abs(far), fmt)
        assert _regular(mu_u, fmt) and (np.diff(s) >= 0).all(), mu
        beyond = np.float32(abs(far) / 2)
        assert K._invalid(np.float32(mu).view(np.uint32), beyond.view(np.uint32)), mu
        assert not K._invalid(np.float32(mu).view(np.uint32),
                              np.float32(abs(far)).view(np.uint32)), mu


@njit(cache=True)
def _fast_search(slot, j, b, sh, sb, t, spread, mu_bits, sg_bits, m, fp, shapes, emps, ws,
                 rtab):
    """The kernel's fast_search from a guess j (any j in 0..255), as (j, cdf(j), cdf(j+1))."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, m, ws, rtab, f)
    sj = K._smooth_cdf(b + (j << sh), v, f, shapes, emps)
    sn = K._smooth_cdf(b + ((j + 1) << sh), v, f, shapes, emps)
    c0 = K._stage_cdf(j, sj, sb, t, spread)
    c1 = K._stage_cdf(j + 1, sn, sb, t, spread)
    if c0 <= slot < c1:
        return j, c0, c1
    # The kernel's probes are float quotients (any probe in (lo, hi) is as exact).
    rdens = np.float32(1.0) / np.float32(max(c1 - c0, 1))
    if c1 <= slot:
        lo, clo, hi, chi = j + 1, c1, 256, spread + 256
        k = lo + 1 + int(min(np.float32(slot - clo) * rdens, np.float32(256.0)))
    else:
        hi, chi, lo, clo = j, c0, 0, 0
        k = hi - int(min(np.ceil(np.float32(chi - slot) * rdens), np.float32(256.0)))
    interp = False
    while hi - lo > 1:
        k = min(max(k, lo + 1), hi - 1)
        ck = K._stage_cdf(k, K._smooth_cdf(b + (k << sh), v, f, shapes, emps), sb, t, spread)
        if ck <= slot:
            lo, clo = k, ck
        else:
            hi, chi = k, ck
        interp = not interp
        q = np.float32((slot - clo) * (hi - lo)) * (np.float32(1.0) / np.float32(chi - clo))
        k = lo + int(q) if interp else (lo + hi) >> 1
    return lo, clo, chi


@njit(cache=True)
def _cdf_at(k, b, sh, sb, t, spread, v, f, shapes, emps):
    sk = K._smooth_cdf(b + (k << sh), v, f, shapes, emps)
    return sk, K._stage_cdf(k, sk, sb, t, spread)


@njit(cache=True)
def _warp_search(slot, j, b, sh, sb, t, spread, mu_bits, sg_bits, m, fp, shapes, emps, ws,
                 rtab):
    """The kernel's search when a guess j misses (WARP_SEARCH): near_symbol's one probe on
    the slot's side, then warp_search's two ballots (lane i: cdf(8 i); then nine lanes:
    cdf(base .. base + 8)); returns (j, S_j, S_j+1, cdf(j), cdf(j+1), probes)."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, m, ws, rtab, f)
    sj, c0 = _cdf_at(j, b, sh, sb, t, spread, v, f, shapes, emps)
    sn, c1 = _cdf_at(j + 1, b, sh, sb, t, spread, v, f, shapes, emps)
    if c0 <= slot < c1:
        return j, sj, sn, c0, c1, 0
    up = slot >= c1  # near_symbol
    k = j + 2 if up else j - 1
    if not (up and k > 256):
        sk, ck = _cdf_at(k, b, sh, sb, t, spread, v, f, shapes, emps)
        if up and slot < ck:
            return j + 1, sn, sk, c1, ck, 1
        if not up and slot >= ck:
            return j - 1, sk, sj, ck, c0, 1
    ball = 0  # warp_search: bit i = cdf(8 i) <= slot
    for lane in range(32):
        if _cdf_at(8 * lane, b, sh, sb, t, spread, v, f, shapes, emps)[1] <= slot:
            ball |= 1 << lane
    base = 8 * _top_bit(ball)
    s2 = np.zeros(9, np.int64)
    c2 = np.zeros(9, np.int64)
    ball = 0
    for lane in range(9):
        s2[lane], c2[lane] = _cdf_at(base + lane, b, sh, sb, t, spread, v, f, shapes, emps)
        if c2[lane] <= slot:
            ball |= 1 << lane
    r = _top_bit(ball)
    return base + r, s2[r], s2[r + 1], c2[r], c2[r + 1], 3


@njit(cache=True)
def _top_bit(x):
    """The highest set bit's index of a non-zero ballot (the kernel's 31 - __clz)."""
    i = 31
    while not x >> i & 1:
        i -= 1
    return i


@pytest.mark.parametrize("search", ["lane", "warp"])
@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
def test_search_finds_the_symbol_from_any_guess(fmt, search):
    # Any slot, any guess (near, far, at either end), each stage kind: the lane's own
    # search (fast_search), and the warp's (the neighbour probe, then two ballots), find the
    # one symbol whose [cdf(j), cdf(j+1)) holds the slot, with cdf (and for the warp's, S)
    # at both its ends as the exact evaluations give them.
    f = D.FORMATS[fmt]
    rng = np.random.default_rng(6)
    p = 16
    spread = (1 << p) - 256
    for mu, sigma, m in [(0.3, 0.15, 0), (-2.0, 1e-3, 0), (20.0, 2.0, 1), (0.0, 1e4, 0)]:
        mb, sb_ = np.float32(mu).view(np.uint32), np.float32(sigma).view(np.uint32)
        s, _ = _s_of(mu, sigma, fmt, m)
        stages = [(0, f.bits - 8)]  # the top stage, then (16-bit) a low stage near mu
        if f.bits == 16:
            key = int(np.searchsorted(s, K.ONE // 2))
            stages.append(((key >> 8) << 8, 0))
        for b, sh in stages:
            sb = int(s[b]) if b else 0
            t = int(s[b + (256 << sh)]) - sb if b else K.ONE
            ks = b + (np.arange(257) << sh)
            cdf = np.array([K._stage_cdf(j, s[k], sb, t, spread) for j, k in enumerate(ks)])
            for slot in np.concatenate([rng.integers(0, 1 << p, 150), [0, (1 << p) - 1]]):
                want = int(np.searchsorted(cdf, slot, side="right")) - 1
                for guess in {0, 255, want, max(want - 1, 0), min(want + 1, 255),
                              int(rng.integers(0, 256))}:
                    args = (int(slot), guess, b, sh, sb, t, spread, mb, sb_, m, f.params,
                            MODEL.padded, MODEL.emps, MODEL.weights, D._RTAB)
                    if search == "lane":
                        assert _fast_search(*args) == (want, cdf[want], cdf[want + 1])
                        continue
                    got = _warp_search(*args)
                    assert got[:5] == (want, s[ks[want]], s[ks[want + 1]], cdf[want],
                                       cdf[want + 1])
                    assert got[5] == (0 if guess == want else 1 if abs(guess - want) == 1
                                      else 3)


def test_stage_quotient_from_an_approximate_reciprocal_is_exact():
    # stage_cdf's q = floor(spread d / T) for 0 <= d <= T < 2^31: float(d) times spread
    # times a reciprocal a few ulps off, rounded to the nearest integer, is q or q + 1; the
    # remainder's low 32 bits as int32 (the kernel's wrapping arithmetic) say which.
    rng = np.random.default_rng(2)
    for spread in (65280, 3840):  # precision 16 and 12
        t = rng.integers(1, 1 << 31, 20000, dtype=np.int64)
        t[:4] = [1, 2, (1 << 31) - 1, (1 << 31) - 2]
        t[8:2000] = rng.integers(1, 1 << 12, 1992)  # small stages: d / T far from floats'
        d = (rng.random(t.size) * t).astype(np.int64)
        d[4:8] = [0, t[5], t[6] - 1, t[7] // 7]
        d[2000:2100] = t[2000:2100]  # d = T: the quotient is spread exactly
        for ulps in (-4, 0, 4):
            rq = (np.float32(spread) * ((np.float32(1.0) / t.astype(np.float32))
                                        * np.float32(1 + ulps * 2.0**-23))).astype(np.float32)
            q = np.rint(d.astype(np.float32) * rq).astype(np.int64)
            r = ((spread * d - q * t) & 0xFFFFFFFF).astype(np.uint32).view(np.int32)
            assert np.all(np.abs(spread * d - q * t) < 1 << 31)  # int32 holds it
            q -= (r < 0).astype(np.int64)
            np.testing.assert_array_equal(q, spread * d // t)


@njit(cache=True)
def _emp_all(m, fp, emps, out):
    """out[k] = the CPU's E(k) of model m for every key k = 1..nkeys-1."""
    f = K._fmt(fp)
    for k in range(1, f.nkeys):
        out[k] = K._emp_cdf(k, m, f, emps)


@pytest.mark.parametrize("m", [0, 1])
def test_stage_empirical_term_from_the_bucket(m):
    # The decoder's E in a stage (stage_s): the top stage's keys j 2^8 are bucket starts,
    # E = em[j]; a low stage is bucket j, E(b + i) = em[j] + floor(de i / 2^8) for i = 0..256
    # with de = em[j + 1] - em[j] (i = 256: the next bucket's start, em[j + 1]). Both are the
    # CPU's E on every key 1..65535 of the bf16 space, and at i = 256 too.
    em = MODEL.emps[m].astype(np.int64)
    cpu = np.zeros(1 << 16, np.int64)
    _emp_all(m, D.FORMATS["bf16"].params, MODEL.emps, cpu)
    j, i = np.divmod(np.arange(1 << 16), 256)
    lin = em[j] + (((em[j + 1] - em[j]) * i) >> 8)
    np.testing.assert_array_equal(lin[1:], cpu[1:])
    top = np.arange(1, 256) << 8
    np.testing.assert_array_equal(em[top >> 8], cpu[top])
    nxt = em[:256] + (((em[1:] - em[:256]) * 256) >> 8)  # i = 256 of bucket j: key (j + 1) 2^8
    np.testing.assert_array_equal(nxt[:255], cpu[top])


def test_tail_inverse_continues_the_uniform_inverse_and_inverts_the_shape():
    tails = G.tail_inverse(MODEL)
    assert tails.shape == (len(MODEL), 2, G.TAIL_POINTS + 1) and tails.dtype == np.float32
    z = D.z_grid()
    for m in range(len(MODEL)):
        lo, hi = tails[m]
        # the first tail point is the uniform inverse's end interval's inner point
        np.testing.assert_allclose([lo[0], hi[0]], MODEL.inverse[m][[1, -2]], atol=1e-4)
        assert np.all(np.diff(lo) <= 0) and np.all(np.diff(hi) >= 0)  # outwards
        # each point holds its tail mass (the shape interpolated there), where resolvable
        mass = 2.0 ** -(G.TAIL_FROM + np.arange(G.TAIL_POINTS + 1) / G.TAIL_STEPS)
        shape = MODEL.shapes[m].astype(np.float64) / D.ONE
        fine = mass * D.ONE >= 64
        np.testing.assert_allclose(np.interp(lo[fine], z, shape), mass[fine], rtol=1e-2)
        np.testing.assert_allclose(1 - np.interp(hi[fine], z, shape), mass[fine], rtol=1e-2)


# ---- the kernel's 32-bit offset (clamped_offset) ---------------------------------------------

_MU32, _SAT32 = 1 << 29, 1 << 30


@njit(cache=True)
def _offsets_both(mu_bits, sg_bits, fp, ws, rtab, out):
    """For keys k = 1..nkeys-1 of one value: out[k] = (the CPU's D clamped to +-dl, the
    kernel's clamped_offset, largest |intermediate| of the port); returns whether big."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, 0, ws, rtab, f)
    half = f.nkeys >> 1
    big = v.mu_u >= _MU32 or v.mu_u <= -_MU32
    mu32 = v.mu_u  # read only when not big
    for k in range(1, f.nkeys):
        out[k, 0] = min(max(K._offset(k, v, f), -v.dl), v.dl)
        if big:  # the kernel's 64-bit offset(): the CPU's arithmetic
            out[k, 1], out[k, 2] = out[k, 0], 0
            continue
        y = k - half
        a = abs(y) - 1
        e1 = max(a >> f.mant, 1)
        mid = 2 * a + 1 - ((e1 - 1) << (f.mant + 1))
        sh = min(max(e1 - v.cb, -126), 64)
        # exact, float32; key HALF (+0) multiplies 0
        prod = np.float32(-mid if y < 0 else mid if y > 0 else 0) * np.float32(2.0**sh)
        fl = min(max(np.floor(prod), -2.0**31), 2.0**31 - 1)  # cvt.rmi.s32: saturating
        t = min(max(int(fl), -_SAT32), _SAT32)
        d = t - mu32
        if abs(y) >= f.nonfinite:  # the clamp's end on the key's side
            out[k, 1] = -v.dl if y < 0 else v.dl
        else:
            out[k, 1] = min(max(d, -v.dl), v.dl)
        out[k, 2] = max(abs(t), abs(d))
    return big


_TOP_FMAX = 127 + 29  # the kernel's TOP_FMAX


@njit(cache=True)
def _top_offsets(mu_bits, sg_bits, fp, ws, rtab, out):
    """The kernel's top_offset (bf16: a top-stage key step is two binades) at keys j 2^8,
    j = 1..255, of a value that is not big: out[j]. Its float, built from bits (exponent
    field f clamped to [1, TOP_FMAX], the mantissa's top ES bits set, y's sign), is
    +-(2^(ES + 1) - 1) 2^(f - 127 - ES) (test_top_offset_float_bits), exact in float64."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, 0, ws, rtab, f)
    mid = (1 << (f.es + 1)) - 1
    widest = np.int64(0)
    for j in range(1, 256):
        y = j - (f.nkeys >> (f.es + 1))
        fe = min(max(2 * abs(y) + (f.es + 126) - v.cb, 1), _TOP_FMAX)
        prod = (-mid if y < 0 else mid) * 2.0 ** (fe - 127 - f.es)
        fl = np.int64(np.floor(prod)) if y != 0 else np.int64(0)
        widest = max(widest, abs(fl))
        out[j] = min(max(fl - v.mu_u, -v.dl), v.dl)
    return widest  # |floor(B / u)|, which the kernel subtracts mu_u from in int32


def test_top_offset_float_bits():
    # top_offset's float from bits: exponent field f, the mantissa's top ES bits, the sign
    # is +-(2^(ES + 1) - 1) 2^(f - 127 - ES), a normal float, for every f it can take.
    es = D.FORMATS["bf16"].bits - 8
    fe = np.arange(1, _TOP_FMAX + 1, dtype=np.uint32)
    for sign in (0, 1):
        bits = (np.uint32(sign) << np.uint32(31)) | (fe << np.uint32(23)) \
            | np.uint32(((1 << es) - 1) << (23 - es))
        got = bits.view(np.float32).astype(np.float64)
        want = (-1.0) ** sign * ((1 << (es + 1)) - 1) * 2.0 ** (fe.astype(np.float64) - 127 - es)
        np.testing.assert_array_equal(got, want)
        assert np.all(np.abs(got) >= 2.0**-126) and np.all(np.abs(got) < 2.0**30)


@njit(cache=True)
def _table_offsets(mu_bits, sg_bits, fp, ws, rtab, out):
    """The kernel's clamped_offset with KEY_TABLE (8-bit formats) at keys k = 0..nkeys of a
    value that is not big: out[k]; returns the smallest nonzero |product| floored."""
    f = K._fmt(fp)
    ok, v = K._params(mu_bits, sg_bits, 0, ws, rtab, f)
    half = f.nkeys >> 1
    scale = np.float32(2.0 ** min(max(1 - v.cb, -126), 64))
    smallest = np.inf
    for k in range(f.nkeys + 1):
        y = k - half
        a = abs(y) - 1
        e1 = max(a >> f.mant, 1)
        mid = 2 * a + 1 - ((e1 - 1) << (f.mant + 1))
        if abs(y) >= f.nonfinite:  # key_boundary()
            kb = np.float32(-np.inf if y < 0 else np.inf)
        else:
            kb = np.float32(-mid if y < 0 else mid if y > 0 else 0) * np.float32(2.0 ** (e1 - 1))
        prod = kb * scale  # float32, exact where finite
        if prod != 0 and abs(prod) < smallest:
            smallest = abs(prod)
        fl = min(max(np.floor(prod), -2.0**31), 2.0**31 - 1)  # cvt.rmi.s32: saturating
        t = min(max(int(fl), -_SAT32), _SAT32)
        out[k] = min(max(t - v.mu_u, -v.dl), v.dl)
    return smallest


@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
def test_clamped_offset_in_32_bits_is_the_cpus(fmt):
    # Every key of values from tiny to the coder's largest |mu| / sigma, both signs, and
    # subnormal, tiny and huge sigma: the kernel's 32-bit D equals the CPU's int64 D after
    # the clamp, no intermediate leaves int32, and only |mu| >~ 2^13 sigma takes the 64-bit
    # path (big mu).
    f = D.FORMATS[fmt]
    rng = np.random.default_rng(7)
    sig = np.concatenate([[1e-45, 1e-40, 1e-3, 0.15, 1.0, 3.0e38],
                          10.0 ** rng.uniform(-30, 30, 40)])
    out = np.zeros((1 << f.bits, 3), np.int64)
    top = np.zeros(256, np.int64)
    table = np.zeros((1 << f.bits) + 1, np.int64)
    n_big = n_small = 0
    for s in sig.astype(np.float32):
        ratios = np.concatenate([[0.0, 1.0, 2.0**13, 2.0**14, 2.0**33.9],
                                 2.0 ** rng.uniform(-20, 34, 12)])
        for r in ratios:
            if r * float(s) > np.finfo(np.float32).max:
                continue
            for mu in (np.float32(r * s), np.float32(-r * s)):
                mb, sb = mu.view(np.uint32), s.view(np.uint32)
                if K._invalid(mb, sb):
                    continue
                big = _offsets_both(mb, sb, f.params, MODEL.weights, D._RTAB, out)
                n_big += big
                n_small += not big
                assert not big or r > 2.0**12
                np.testing.assert_array_equal(out[1:, 1], out[1:, 0], err_msg=f"{mu} {s}")
                assert out[1:, 2].max() < 1 << 31
                if fmt == "bf16" and not big:  # the top stage's keys (top_offset)
                    widest = _top_offsets(mb, sb, f.params, MODEL.weights, D._RTAB, top)
                    np.testing.assert_array_equal(top[1:], out[256:65536:256, 0])
                    ok, v = K._params(mb, sb, 0, MODEL.weights, D._RTAB, K._fmt(f.params))
                    assert widest < 1 << 30 and abs(v.mu_u) < 1 << 29  # int32: no overflow
                if f.bits == 8 and not big:  # KEY_TABLE: no float32 subnormal products
                    low = _table_offsets(mb, sb, f.params, MODEL.weights, D._RTAB, table)
                    assert low >= 2.0**-126
                    np.testing.assert_array_equal(table[1:-1], out[1:, 0], err_msg=f"{mu} {s}")
                    ok, v = K._params(mb, sb, 0, MODEL.weights, D._RTAB, K._fmt(f.params))
                    assert table[0] == -v.dl and table[-1] == v.dl
    assert n_small > 0 and n_big > 0


def _grid_exponent(sg_bits: int) -> int:
    """ue: the exponent of mu's grid step (the kernel's params())."""
    e = (sg_bits >> 23) & 0xFF
    if e == 0:  # subnormal sigma: the smallest normal one
        e = 1
    elif ((sg_bits & 0x7FFFFF) + (1 << 14)) >> 15 == 256:
        e = min(e + 1, 0xFE)
    return e - 127 - 16  # MU_BITS


def _params32(mu_bits: int, sg_bits: int) -> tuple[bool, int]:
    """The kernel's params(): (big, mu32), mu_u in 32-bit words (read only when not big)."""
    ue = _grid_exponent(sg_bits)
    em = (mu_bits >> 23) & 0xFF
    mm = (mu_bits & 0x7FFFFF) | ((1 << 23) if em else 0)
    sh = max(em, 1) - 150 - ue
    rs = min(-sh, 25)
    mag = (mm << min(sh, 5)) if sh >= 0 else (mm + (1 << (rs - 1))) >> rs
    assert mag < 1 << 32  # a 32-bit word
    return sh >= 6, -mag if mu_bits >> 31 else mag


def test_params_mu_in_32_bits_is_the_cpus():
    # mu_u (mu on sigma's grid, rounded half up in magnitude) from 32-bit words wherever
    # |mu_u| < MU32, and big exactly where it is not: every sigma exponent (normal, the
    # rounding's carry into the next one, subnormal), mu 0, -0, subnormal, at the big edge
    # (mu_u = 2^29 - 1, 2^29), at each right shift's rounding tie and beyond 25 bits.
    f = K._fmt(D.FORMATS["bf16"].params)
    rng = np.random.default_rng(5)
    sig = [np.uint32(b) for b in (1, 0x7FFFFF, 0x00800000, 0x3F7FC000, 0x3F7FBFFF,
                                  0x7F7FFFFF, 0x7F7FC000)]
    sig += [np.uint32((e << 23) | int(rng.integers(1 << 23))) for e in range(1, 255)]
    n_big = n_small = 0
    for sb in sig:
        s, u = float(sb.view(np.float32)), 2.0 ** _grid_exponent(int(sb))  # u: mu's grid step
        mus = [0.0, -0.0, 1e-45, -3e-39, 1.0, -1.5]
        mus += [u * r for r in (2.0**29 - 64, 2.0**29, -(2.0**29), 2.0**28 + 0.5, 2.0**13 + 0.5,
                                0.5, -2.5, 1.5 * 2.0**-24, 2.0**-25, 2.0**-26, 2.0**-41)]
        mus += list(s * 2.0 ** rng.uniform(-40, 34, 20) * rng.choice([-1, 1], 20))
        for mu in mus:
            if not abs(mu) < 3.4e38:
                continue
            mb = int(np.float32(mu).view(np.uint32))
            if K._invalid(np.uint32(mb), sb):
                continue
            ok, v = K._params(np.uint32(mb), sb, 0, MODEL.weights, D._RTAB, f)
            big, mu32 = _params32(mb, int(sb))
            assert big == (abs(v.mu_u) >= _MU32), (mu, s)
            assert big or mu32 == v.mu_u, (mu, s, mu32, v.mu_u)
            n_big += big
            n_small += not big
    assert n_big > 100 and n_small > 1000


def test_one_build_per_format():
    # A build's options are the format's constants and the table placement, nothing else.
    for f in D.FORMATS.values():
        for smem in (False, True):
            opts = dict(o[2:].split("=") for o in G._build_options(f, smem) if o[:2] == "-D")
            assert opts == {"NKEYS": str(1 << f.bits), "MANT": str(f.mantissa),
                            "BIAS": str(f.bias), "NONFINITE": str(f.nonfinite),
                            "ES": str(f.bits - 8), "SMEM": str(int(smem)),
                            "WARPS": str(G.WARPS), "TAIL_FROM": str(G.TAIL_FROM),
                            "TAIL_STEPS": str(G.TAIL_STEPS),
                            "TAIL_POINTS": str(G.TAIL_POINTS)}


# ---- the low stage's direct answer and the guess emulator (gpu/guess_emulator.py) -----------


@pytest.mark.parametrize("p", [12, 16])
@pytest.mark.parametrize("mu,sigma", [(0.5, 0.01), (-3.0, 0.2), (0.0, 1e-30), (1e30, 1e25)])
def test_stage_of_no_mass_decodes_the_slots_top_byte(p, mu, sigma):
    # guess_symbol's direct answer where T = 0 (S flat over a top-byte symbol): the low
    # byte is slot >> (p - 8) with cdf [j 2^(p - 8), (j + 1) 2^(p - 8)), the CPU's symbol.
    f = D.FORMATS["bf16"]
    s, _ = _s_of(mu, sigma, "bf16", 1)  # the Gaussian model: no empirical floor
    flat = np.nonzero(s[0:65536:256] == s[256:65537:256])[0]
    assert flat.size > 0
    keys = (flat[:, None] * 256 + np.arange(256)).reshape(-1)
    vals = np.where(keys >= 32768, keys ^ 32768, keys ^ 0xFFFF).astype(np.uint16)
    n = vals.size
    out = np.zeros((n, 5), np.int64)
    _value_cdfs(vals, np.full(n, np.float32(mu)).view(np.uint32),
                np.full(n, np.float32(sigma)).view(np.uint32), np.ones(n, np.uint16),
                f.params, MODEL.padded, MODEL.emps, MODEL.weights, D._RTAB, p, out)
    assert out[:, 4].all()
    lo = keys & 255
    np.testing.assert_array_equal(out[:, 2], lo << (p - 8))
    np.testing.assert_array_equal(out[:, 3], (lo + 1) << (p - 8))


def _emulator():
    import importlib.util
    from pathlib import Path

    if "guess_emulator" not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "gpu" / "guess_emulator.py"
        spec = importlib.util.spec_from_file_location("guess_emulator", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # its dataclasses look their module up
        spec.loader.exec_module(mod)
    return sys.modules["guess_emulator"]


@pytest.mark.parametrize("fmt", sorted(D.FORMATS))
def test_key_value_is_the_formats_value(fmt):
    # The kernel's key_value (as the emulator ports it): every finite key's value, and the
    # value step to the next key within its binade (subnormals included).
    E = _emulator()
    df = D.FORMATS[fmt]
    f = E._fmt(df)
    keys = np.arange(f.nkeys, dtype=np.int64)
    bits = np.where(keys >= f.half, keys ^ f.half, keys ^ (f.nkeys - 1)).astype(df.storage)
    ref = bits.view(DTYPES[fmt]).astype(np.float32)
    v, ulp = E.key_value(keys, f)
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(v[fin], ref[fin])
    assert np.all(np.isfinite(v)) and np.all(ulp > 0)
    up = fin & (keys >= f.half) & np.roll(np.isfinite(ref), -1) & (keys < f.nkeys - 1)
    with np.errstate(invalid="ignore"):  # inf - inf at the format's ends
        step = np.roll(ref, -1) - ref
    same = up & ((keys - f.half) >> f.mant == (keys + 1 - f.half) >> f.mant)
    np.testing.assert_array_equal(step[same], ulp[same])


def test_emulated_guesses_and_forward_steps():
    # The emulator on kv_check's data: guesses are symbols, stages of no mass are exact,
    # and the forward steps cut the low byte's misses (H200 counters: 2.06% -> 0.73%).
    E = _emulator()
    for mi in (0, 1):
        top, jt, low, jl = E.stages("bf16", 1 << 15, mi)
        g0, g2 = E.fast_guess(low, 2), E.fast_guess(low, 2, fwd=2)
        for g in (E.fast_guess(top, 2), g0, g2):
            assert g.min() >= 0 and g.max() <= 255
        np.testing.assert_array_equal(g0[low.t == 0], jl[low.t == 0])
        assert E.misses(g2, jl)[0] < 0.7 * E.misses(g0, jl)[0]
        assert E.misses(E.fast_guess(top, 2), jt)[0] < 0.02


def test_emulated_bounds_of_flat_stretches():
    # The guesses' bounds from flat stretches (low_bounds, top_bounds in the kernel, as the
    # emulator ports them) on kv_check's data: guesses stay symbols, and the misses fall
    # where the stretches are (the mixture's NaN / inf / 0 / subnormal keys, the Gaussian's
    # tails beyond F's mass); the Gaussian's top stage (w = 0) is left alone.
    E = _emulator()
    for mi in (0, 1):
        top, jt, low, jl = E.stages("bf16", 1 << 16, mi)
        plain = E.fast_guess(low, 0, fwd=2, low_rounds=0, low_e_start=True)
        bound = E.fast_guess(low, 0, fwd=2, low_rounds=0, low_e_start=True, low_bound=True)
        assert bound.min() >= 0 and bound.max() <= 255
        np.testing.assert_array_equal(bound[low.t == 0], jl[low.t == 0])
        assert E.misses(bound, jl)[0] < 0.85 * E.misses(plain, jl)[0]
        t0, t1 = E.fast_guess(top, 0), E.fast_guess(top, 0, top_ends=True)
        assert t1.min() >= 0 and t1.max() <= 255
        if mi == 0:
            assert E.misses(t1, jt)[1] < 0.75 * E.misses(t0, jt)[1]  # far misses
        else:
            np.testing.assert_array_equal(t1, t0)
    # a flat stage, S linear in the key (T is the empirical term's share alone, a = 255):
    # the bounds leave the slot's symbol, slot >> (p - 8), or (float rounding at a
    # symbol's edge) its neighbour, whatever the float guess
    f = E._fmt(D.FORMATS["bf16"])
    n = 1 << 16
    emps = np.zeros(257, np.uint32)
    emps[0x41:] = 1 << 24  # bucket 0x40: de = 2^24
    we = ((1 << 24) * 1311) >> 16
    s = E.Setup(np.arange(n), np.full(n, 0x4000), 0, np.zeros(n, np.int64),
                np.full(n, we, np.int64), np.zeros(n, np.float32), np.ones(n, np.float32),
                1311, None, emps, f, 16, None)
    rng = np.random.default_rng(5)
    for start in (np.zeros(n, np.int64), np.full(n, 255), rng.integers(0, 256, n)):
        d = E.low_bounds(start, s) - (np.arange(n) >> 8)
        assert np.abs(d).max() <= 1 and np.mean(d == 0) > 0.99
