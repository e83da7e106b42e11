"""Per-symbol-distribution rANS: exact round trips, the probability model, hostile input."""

from __future__ import annotations

import math
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entropykit import CorruptDataError
from entropykit.rans import distribution as D

FMTS = ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]
DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
          "fp8_e5m2": ml_dtypes.float8_e5m2}
GAUSS = D.gaussian_model()


def _mixture_model() -> D.CoderModel:
    # Two models: a heavy-tailed mixture with an empirical component, and a plain Gaussian.
    counts = np.ones(65536, np.int64)
    counts[0x8000 + 0x3F00 : 0x8000 + 0x4000] = 1000  # mass on [0.5, 2)
    mix = D.gaussian_shape((1.0, 3.0), (0.95, 0.03))
    return D.CoderModel(np.stack([mix, D.gaussian_shape()]),
                        np.stack([D.empirical_table(counts), D.empirical_table(counts)]),
                        [1311, 0])


MIXED = _mixture_model()


def _roundtrip(bits, mu, sigma, fmt, model=GAUSS, **kw) -> bytes:
    blob = D.encode(bits, mu, sigma, model, fmt=fmt, **kw)
    idx = kw.get("model_index")
    out = D.decode(blob, mu, sigma, model, model_index=idx)
    assert out.dtype == D.FORMATS[fmt].storage
    np.testing.assert_array_equal(out, np.asarray(bits).reshape(-1))
    return blob


def _sample(fmt: str, n: int, seed: int, mu_scale=1.0, log_sigma=-2.0):
    rng = np.random.default_rng(seed)
    mu = rng.normal(0, mu_scale, n).astype(np.float32)
    sigma = np.exp(rng.normal(log_sigma, 0.5, n)).astype(np.float32)
    x = (mu + sigma * rng.normal(size=n).astype(np.float32)).astype(DTYPES[fmt])
    return x.view(D.FORMATS[fmt].storage), mu, sigma


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 1023, 1024, 1025, 4097])
def test_roundtrip_sizes(fmt, n):
    bits, mu, sigma = _sample(fmt, n, n)
    blob = _roundtrip(bits, mu, sigma, fmt, chunk_size=1024)
    info = D.parse(blob)
    assert (info.n, info.chunk_size, len(info.lengths)) == (n, 1024, -(-n // 1024))


@pytest.mark.parametrize("fmt", FMTS)
def test_every_value_encodable(fmt):
    # The whole value space, NaN payloads, +-inf, +-0 and subnormals included, under a
    # narrow distribution that puts nearly all mass on one value and under a wide one.
    f = D.FORMATS[fmt]
    bits = np.arange(1 << f.bits, dtype=np.int64).astype(f.storage)
    n = bits.size
    for mu, sigma in [(1.0, 1e-3), (0.0, 1e4), (-3.0, 0.5)]:
        _roundtrip(bits, np.full(n, mu, np.float32), np.full(n, sigma, np.float32), fmt,
                   model=MIXED, model_index=np.arange(n) % 2)


@pytest.mark.parametrize("fmt", FMTS)
def test_probabilities_sum_to_one(fmt):
    # Costs of every key under one distribution satisfy Kraft with equality, and every key
    # keeps at least one slot in each 2**16-slot stage.
    f = D.FORMATS[fmt]
    n = 1 << f.bits
    bits = np.arange(n, dtype=np.int64).astype(f.storage)
    for model in (GAUSS, MIXED):
        for mu, sigma in [(0.3, 0.05), (-100.0, 7.0), (0.0, 1e-30)]:
            c = D.value_costs(bits, np.full(n, mu, np.float32), np.full(n, sigma, np.float32),
                              model, fmt=fmt)
            assert math.isclose(math.fsum(2.0 ** -c), 1.0, rel_tol=1e-12)
            assert c.max() <= 16 * (f.bits // 8)


@pytest.mark.parametrize("fmt", FMTS)
def test_all_mass_in_one_table_interval(fmt):
    # A table step of 2**31 (every count in one empirical bucket, a shape with one
    # non-empty bin) fills the sign bit of the kernels' packed (point, step) pair: it must
    # still read as +2**31 (it read as -2**31: NaN costs, frames that did not decode).
    f = D.FORMATS[fmt]
    n = 1 << f.bits
    counts = np.zeros(n, np.int64)
    counts[n // 2 + 3] = 7
    masses = np.zeros(D.Z_POINTS)
    masses[D.Z_POINTS // 2] = 1.0
    model = D.CoderModel(np.stack([D.gaussian_shape(), D.shape_from_masses(masses)]),
                         np.stack([D.empirical_table(counts)] * 2), [30000, 1311])
    assert D.ONE in np.diff(model.emps.astype(np.int64))
    bits = np.arange(n, dtype=np.int64).astype(f.storage)
    for mu, sigma in [(0.0, 0.01), (0.0, 1.0), (-3.0, 0.5)]:
        mus, sigmas = np.full(n, mu, np.float32), np.full(n, sigma, np.float32)
        for m in (0, 1):
            c = D.value_costs(bits, mus, sigmas, model, fmt=fmt, model_index=m)
            assert math.isclose(math.fsum(2.0 ** -c), 1.0, rel_tol=1e-12)
        _roundtrip(bits, mus, sigmas, fmt, model=model, model_index=np.arange(n) % 2)


def test_size_matches_model_and_entropy():
    # bf16 values of N(mu, sigma): coded size ~ the model's own cost, which is within a few
    # hundredths of a bit of -log2 of the exact Gaussian mass of each value's bin.
    bits, mu, sigma = _sample("bf16", 1 << 16, 7)
    blob = _roundtrip(bits, mu, sigma, "bf16")
    ideal = D.value_costs(bits, mu, sigma, GAUSS, fmt="bf16").sum()
    assert len(blob) * 8 < ideal * 1.005 + 8 * 400
    as_f64 = lambda b: b.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)
    x = as_f64(bits)
    step = np.where(bits & 0x8000, -1, 1)  # next bit pattern up in value (no zeros here)
    up, dn = as_f64(bits.astype(np.int64) + step), as_f64(bits.astype(np.int64) - step)
    erf = np.vectorize(math.erf)
    cdf = lambda t: 0.5 * (1 + erf((t - mu) / (sigma * math.sqrt(2))))
    exact = -np.log2(cdf((x + up) / 2) - cdf((x + dn) / 2)).sum()
    assert abs(ideal - exact) / bits.size < 0.03


def test_grid_snapping_makes_decoding_robust_to_float_noise():
    # sigma bits below the 8-bit mantissa grid and mu below sigma/2**17 do not change the
    # distribution: a decoder whose floats differ there still decodes exactly.
    bits, mu, sigma = _sample("bf16", 4096, 3)
    blob = D.encode(bits, mu, sigma, GAUSS, fmt="bf16")
    sg2 = (sigma.view(np.uint32) & ~np.uint32(0x3FFF)) | np.uint32(0x1234)
    sg2 = np.where((sigma.view(np.uint32) & 0x4000) == 0, sg2, sigma.view(np.uint32))
    out = D.decode(blob, mu, sg2.view(np.float32), GAUSS)
    np.testing.assert_array_equal(out, bits)


def test_deterministic_and_thread_independent():
    bits, mu, sigma = _sample("fp8_e4m3", 10_000, 5)
    a = D.encode(bits, mu, sigma, GAUSS, fmt="fp8_e4m3", chunk_size=1024, threads=1)
    b = D.encode(bits, mu, sigma, GAUSS, fmt="fp8_e4m3", chunk_size=1024, threads=2)
    assert a == b
    np.testing.assert_array_equal(D.decode(a, mu, sigma, GAUSS, threads=2), bits)


def test_incompressible_chunks_are_stored_raw():
    # Values far from a narrow distribution cost more than raw: the chunk is stored raw.
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 1 << 16, 2048).astype(np.uint16)
    mu, sigma = np.zeros(2048, np.float32), np.full(2048, 1e-6, np.float32)
    blob = _roundtrip(bits, mu, sigma, "bf16", chunk_size=1024)
    info = D.parse(blob)
    assert list(info.modes) == [D.MODE_RAW, D.MODE_RAW]
    assert len(blob) == D.HEADER_SIZE + 2 * 9 + 2 * 2048


def test_float_dtype_inputs():
    bits, mu, sigma = _sample("bf16", 100, 1)
    blob = D.encode(bits.view(ml_dtypes.bfloat16), mu, sigma, GAUSS)
    assert blob == D.encode(bits, mu, sigma, GAUSS, fmt="bf16")
    with pytest.raises(TypeError):
        D.encode(bits.astype(np.int32), mu, sigma, GAUSS, fmt="bf16")
    with pytest.raises(ValueError, match="fmt"):
        D.encode(bits.view(ml_dtypes.bfloat16), mu, sigma, GAUSS, fmt="fp16")


@pytest.mark.parametrize("bad", [("mu", np.nan), ("mu", np.inf), ("sigma", 0.0),
                                 ("sigma", -1.0), ("sigma", np.nan), ("sigma", np.inf)])
def test_invalid_parameters(bad):
    bits, mu, sigma = _sample("fp8_e4m3", 100, 2)
    blob = D.encode(bits, mu, sigma, GAUSS, fmt="fp8_e4m3")
    name, value = bad
    arr = (mu if name == "mu" else sigma).copy()
    arr[57] = value
    args = (arr, sigma) if name == "mu" else (mu, arr)
    with pytest.raises(ValueError, match="value 57") as e:
        D.encode(bits, *args, GAUSS, fmt="fp8_e4m3")
    assert not isinstance(e.value, CorruptDataError)
    with pytest.raises(ValueError, match="value 57"):
        D.decode(blob, *args, GAUSS)
    with pytest.raises(ValueError, match="model_index"):
        D.encode(bits, mu, sigma, MIXED, fmt="fp8_e4m3", model_index=np.full(100, 2))


def _in_range(mu: np.ndarray, sigma: np.ndarray) -> np.ndarray:
    """mu's float32 exponent field below sigma's (subnormals: 1) + 34: the coder's rule."""
    em = (mu.view(np.uint32) >> 23) & 0xFF
    es = np.maximum((sigma.view(np.uint32) >> 23) & 0xFF, 1)
    return em.astype(np.int64) - es < 34


def test_mu_far_beyond_sigma_is_refused():
    # Far beyond sigma the fixed-point CDF need not be monotone (bf16 frames at 2**42 did not
    # decode): such pairs are refused on both sides; just inside the limit they round trip.
    bits = np.full(64, 0x4248, np.uint16)  # bf16 50.0
    mu = np.full(64, 50.0, np.float32)
    inside = (mu * np.float32(2.0**-33)).astype(np.float32)
    _roundtrip(bits, mu, inside, "bf16")
    for e in (35, 42, 60):
        sigma = (mu * np.float32(2.0**-e)).astype(np.float32)
        with pytest.raises(ValueError, match="2\\*\\*34 sigma"):
            D.encode(bits, mu, sigma, GAUSS, fmt="bf16")


def test_first_invalid_parameter_is_reported():
    # The one-pass check agrees with "finite mu, finite sigma > 0, mu within 2**34 sigma"
    # on every edge float and names the first offender when there are several.
    edges = np.array([0.0, -0.0, 1e-45, -1e-45, 1.0, -2.0, 3e38, -3e38, np.inf, -np.inf,
                      np.nan, -np.nan], np.float32)
    mu, sigma = (a.ravel() for a in np.meshgrid(edges, edges))
    valid = np.isfinite(mu) & np.isfinite(sigma) & (sigma > 0) & _in_range(mu, sigma)
    bits = np.zeros(mu.size, np.uint8)
    for i in range(mu.size):
        if valid[i]:
            D.encode(bits[i : i + 1], mu[i : i + 1], sigma[i : i + 1], GAUSS, fmt="fp8_e4m3")
        else:
            with pytest.raises(ValueError, match="value 0"):
                D.encode(bits[i : i + 1], mu[i : i + 1], sigma[i : i + 1], GAUSS, fmt="fp8_e4m3")
    order = np.argsort(valid, kind="stable")[::-1]  # valid pairs first, then the invalid
    first = int(np.count_nonzero(valid))
    with pytest.raises(ValueError, match=f"value {first}:"):
        D.encode(bits, mu[order], sigma[order], GAUSS, fmt="fp8_e4m3")


def test_model_validation():
    good = D.gaussian_shape()
    with pytest.raises(ValueError, match="entries"):
        D.CoderModel(good[:-1])
    dip = good.copy()
    dip[2100] = dip[2099] - 1
    with pytest.raises(ValueError, match="rise"):
        D.CoderModel(dip)
    with pytest.raises(ValueError, match="weights"):
        D.CoderModel(good, weights=[70000])
    with pytest.raises(ValueError, match="one empirical table"):
        D.CoderModel(np.stack([good, good]), weights=[0])


# ---- hostile input -------------------------------------------------------------------


def _blob():
    bits, mu, sigma = _sample("bf16", 3000, 11)
    return D.encode(bits, mu, sigma, GAUSS, fmt="bf16", chunk_size=1024), bits, mu, sigma


BLOB, BITS, MU, SIGMA = _blob()


def _decode(blob, mu=MU, sigma=SIGMA, model=GAUSS):
    return D.decode(blob, mu, sigma, model)


@pytest.mark.parametrize("cut", [0, 5, 27, 28, 40, len(BLOB) - 1])
def test_truncated(cut):
    with pytest.raises(CorruptDataError):
        _decode(BLOB[:cut])


def test_header_fields():
    def patch(off, fmt, value):
        b = bytearray(BLOB)
        struct.pack_into(fmt, b, off, value)
        return bytes(b)

    for off, fmt, value, msg in [(0, "<4s", b"EKRA", "magic"), (4, "<B", 2, "version"),
                                 (5, "<B", 17, "precision"), (6, "<B", 16, "lanes"),
                                 (7, "<B", 9, "format"), (16, "<I", 1000, "chunk size"),
                                 (20, "<I", 4, "chunks"), (24, "<I", 1, "model")]:
        with pytest.raises(CorruptDataError, match=msg):
            _decode(patch(off, fmt, value))
    with pytest.raises(CorruptDataError, match="trailing"):
        _decode(BLOB + b"\0")
    with pytest.raises(CorruptDataError, match="mode"):
        _decode(patch(D.HEADER_SIZE + 8 * 3, "<B", 7))


def test_out_overlapping_the_frame_is_refused():
    # The decoder reads the frame while it writes out (and is compiled on that promise).
    size = len(BLOB) + len(BLOB) % 2  # out starts at an even offset: an aligned uint16 view
    buf = np.zeros(size + 2 * BITS.size, np.uint8)
    buf[:len(BLOB)] = np.frombuffer(BLOB, np.uint8)
    frame = buf[:len(BLOB)]
    with pytest.raises(ValueError, match="overlap"):
        D.decode(frame, MU, SIGMA, GAUSS, out=buf[size - 2:-2].view(np.uint16))
    out = buf[size:].view(np.uint16)
    np.testing.assert_array_equal(D.decode(frame, MU, SIGMA, GAUSS, out=out), BITS)


def test_wrong_side_information():
    with pytest.raises(CorruptDataError):
        _decode(BLOB, mu=MU + np.float32(0.25))
    with pytest.raises(CorruptDataError, match="model"):
        _decode(BLOB, model=MIXED)
    with pytest.raises(CorruptDataError, match="mu has"):
        _decode(BLOB, mu=MU[:-1])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(D.HEADER_SIZE, len(BLOB) - 1), xor=st.integers(1, 255))
def test_flipped_byte_is_caught_or_harmless(pos, xor):
    b = bytearray(BLOB)
    b[pos] ^= xor
    try:
        out = _decode(bytes(b))
    except CorruptDataError:
        return
    np.testing.assert_array_equal(out, BITS)


# ---- property tests ------------------------------------------------------------------

finite32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
positive32 = st.floats(min_value=0.0, exclude_min=True, allow_infinity=False, width=32)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FMTS), data=st.data(),
       n=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_roundtrip_property(fmt, data, n, seed):
    # Arbitrary bit patterns (NaN payloads, infinities, subnormals, -0) under arbitrary
    # finite mu and positive sigma, including extreme ones, with both models mixed or the
    # Gaussian alone.
    f = D.FORMATS[fmt]
    rng = np.random.default_rng(seed)
    mode = data.draw(st.sampled_from(["any", "near"]))
    mu = rng.choice(np.array(data.draw(st.lists(finite32, min_size=1, max_size=6)),
                             np.float32), n)
    sigma = rng.choice(np.array(data.draw(st.lists(positive32, min_size=1, max_size=6)),
                                np.float32), n)
    if mode == "any":
        bits = rng.integers(0, 1 << f.bits, n).astype(f.storage)
    else:
        with np.errstate(all="ignore"):  # overflow to inf (or NaN in e4m3) is wanted here
            x = mu + sigma * rng.normal(size=n).astype(np.float32)
            bits = x.astype(DTYPES[fmt]).view(f.storage)
    sigma = np.maximum(sigma, np.abs(mu) * np.float32(2.0**-33))  # the coder's range
    if data.draw(st.booleans()):  # the kernels compile a copy without the empirical term
        _roundtrip(bits, mu, sigma, fmt, model=GAUSS)
    else:
        _roundtrip(bits, mu, sigma, fmt, model=MIXED, model_index=rng.integers(0, 2, n))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_value_keys_order_every_pattern_numerically(fmt):
    f = D.FORMATS[fmt]
    bits = np.arange(1 << f.bits).astype(f.storage)
    keys = D.value_keys(bits)
    assert keys.dtype == f.storage
    assert np.array_equal(np.sort(keys), np.arange(1 << f.bits))  # a permutation
    with np.errstate(invalid="ignore"):  # NaN patterns: left out below
        x = bits.view(DTYPES[fmt]).astype(np.float64)
    finite = np.isfinite(x)
    order = np.argsort(keys[finite], kind="stable")
    assert (np.diff(x[finite][order]) >= 0).all()
    assert int(keys[1 << (f.bits - 1)]) + 1 == int(keys[0])  # -0 sits just below +0


@pytest.mark.parametrize("runs", [[(1, 40), (0, 60)], [(0, 0), (1, 100)], [(1, 100)],
                                  [(0, 33), (1, 1), (0, 66)]])
def test_model_runs_code_as_the_per_value_index(runs):
    """Runs [(model, count), ...] are the per-value index they expand to: same frame."""
    rng = np.random.default_rng(7)
    mu = rng.normal(0, 1, 100).astype(np.float32)
    sigma = np.full(100, 0.2, np.float32)
    bits = (mu + sigma * rng.standard_t(4, 100).astype(np.float32)).astype(
        ml_dtypes.bfloat16).view(np.uint16)
    per_value = np.repeat([m for m, _ in runs], [c for _, c in runs])
    blob = D.encode(bits, mu, sigma, MIXED, fmt="bf16", model_index=runs)
    assert blob == D.encode(bits, mu, sigma, MIXED, fmt="bf16", model_index=per_value)
    np.testing.assert_array_equal(D.decode(blob, mu, sigma, MIXED, model_index=runs), bits)


@pytest.mark.parametrize(("runs", "match"), [
    ([(0, 50), (1, 49)], "cover 99 values, not 100"),
    ([(0, 50), (2, 50)], "model_index 2 out of range"),
    ([(0, -1), (1, 101)], "must be .model, count. pairs"),
    ([(0, 50, 1), (1, 50)], "must be .model, count. pairs"),
    ([(0.5, 50), (1, 50)], "must be .model, count. pairs"),
])
def test_bad_model_runs_raise(runs, match):
    bits = np.zeros(100, np.uint16)
    mu, sigma = np.zeros(100, np.float32), np.ones(100, np.float32)
    with pytest.raises(ValueError, match=match):
        D.encode(bits, mu, sigma, MIXED, fmt="bf16", model_index=runs)
