"""KV caches of every dtype the coder takes: fp16, fp32, fp8 e5m2 beside bf16 and e4m3.

Exact round trips of a tiny random Llama's caches cast to each dtype and of adversarial
values (NaN payloads, +-0, +-inf, subnormals, every 8-bit pattern and a shuffled sample
of the 16-bit ones), the fp32 split's properties (on the host and in torch), and the GPU
coder's path of every dtype (run on the CPU with stand-ins for its kernels).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - the kv extra; .ci/run installs it
from _kvcheck import device_path  # noqa: F401 - a fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.predictive import calibration, codec, kvcache, residual
from entropykit.rans import distribution as D
from entropykit.rans import static
from entropykit.warmup import tiny_llama

MODEL = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=2, vocab=64, positions=128)
GEN = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(0, 64, (96,), generator=GEN) for _ in range(4)]  # 5 folds of 64+
IDS = torch.randint(0, 64, (2, 24), generator=GEN)
NONE = P.NoPredictor()
FP8P = P.FP8Predictor(MODEL)
CALS = {p.describe(): P.calibrate(MODEL, p, PROMPTS, calibration.FORMATS, progress=False)
        for p in (NONE, FP8P)}
with torch.inference_mode():
    CACHE = P.from_transformers(MODEL(IDS, use_cache=True).past_key_values)
NEW = {torch.float16: "fp16", torch.float32: "fp32", torch.float8_e5m2: "fp8_e5m2"}


def _cast(cache: P.KVCache, dtype: torch.dtype) -> P.KVCache:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return P.to_fp8(cache, dtype)
    return P.KVCache([k.to(dtype) for k in cache.keys], [v.to(dtype) for v in cache.values])


def _with(cache: P.KVCache, fill: np.ndarray) -> P.KVCache:
    """``cache`` with its values' bit patterns replaced, cyclically, by ``fill``."""
    t = cache.keys[0]
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]
    out = []
    for i, x in enumerate(cache.keys + cache.values):
        bits = np.resize(np.roll(fill, 7 * i), x.numel()).view(
            {4: np.int32, 2: np.int16, 1: np.uint8}[t.element_size()])
        out.append(torch.from_numpy(bits.copy()).view(view).view(t.dtype).reshape(x.shape))
    n = len(cache.keys)
    return P.KVCache(out[:n], out[n:], cache.scales)


@pytest.mark.parametrize("dtype", [*NEW, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("pred", [NONE, FP8P], ids=["none", "fp8"])
def test_roundtrip_every_dtype(dtype, kind, pred):
    cache = _cast(CACHE, dtype)
    cal = CALS[pred.describe()]
    blob = P.compress_kv(cache, IDS, pred, cal, model=kind)
    out = P.decompress_kv(blob, pred, cal)
    assert out.dtype == dtype and out.equal(cache)
    assert blob[5] == codec._CODES[cache.format]
    # A model makes each cheaper than raw (fp32: the high halves, as bf16 would be).
    values = 2 * len(cache.keys) * cache.keys[0].numel()
    assert len(blob) * 8 / values < 8 * dtype.itemsize


def _adversarial(fmt: str) -> np.ndarray:
    """Bit patterns: NaN payloads of both signs, +-inf, +-0, subnormals, the extremes, then
    (8- and 16-bit formats) every pattern in a shuffled order."""
    if fmt == "fp32":
        return np.array([0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFFFFFFF,
                         0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x007FFFFF, 0x80000001,
                         0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000, 0x7FFF8000,
                         0xFFFF8000, 0x7FFF7FFF, 0x00008000, 0x3F800000],
                        np.uint32).view(np.int32)
    f = D.FORMATS[fmt]
    sign = 1 << (f.bits - 1)
    edge = [f.nonfinite, f.nonfinite + 1, sign - 1, f.nonfinite - 1, 0, 1,
            (1 << f.mantissa) - 1, 1 << f.mantissa]
    special = edge + [b | sign for b in edge]
    every = np.random.default_rng(f.bits).permutation(1 << f.bits)
    dtype = np.int16 if f.bits == 16 else np.uint8
    return np.concatenate([special, every]).astype(np.int64).astype(
        np.uint16 if f.bits == 16 else np.uint8).view(dtype)


@pytest.mark.parametrize("dtype", [*NEW, torch.bfloat16, torch.float8_e4m3fn])
def test_adversarial_values_roundtrip(dtype):
    cache = _with(_cast(CACHE, dtype), _adversarial(kvcache.DTYPES[dtype]))
    for pred in (NONE, FP8P):
        cal = CALS[pred.describe()]
        for kind in ("gaussian", "conditional"):
            blob = P.compress_kv(cache, IDS, pred, cal, model=kind)
            assert P.decompress_kv(blob, pred, cal).equal(cache), (pred.describe(), kind)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bits=st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=300),
       mu=st.floats(-2.0**20, 2.0**20, width=32), sigma=st.floats(2.0**-20, 2.0**20, width=32))
def test_fp32_halves_code_every_bit_pattern(bits, mu, sigma):
    # The fp32 path's pieces: the split is a bijection, the high halves code as bf16 under
    # any (mu, sigma), the low halves under the static coder with their byte context.
    x = torch.from_numpy(np.array(bits, np.uint32).view(np.float32))
    high, low = codec._split32(x)
    assert np.array_equal(codec._join32(high, low).view(np.uint32), np.array(bits, np.uint32))
    model = CALS[NONE.describe()].coder_model("conditional", "fp32")
    n = high.size
    mus = np.full(n, mu, np.float32)
    sigmas = residual.floor(np.full(n, sigma, np.float32), mus)  # as the codec's
    frame = D.encode(high, mus, sigmas, model, fmt="bf16", model_index=0, chunk_size=1024)
    back = D.decode(frame, mus, sigmas, model, model_index=0)
    ctx = codec._low_context(low.size)
    lo = static.decode(static.encode(low, chunk_size=1024, context=ctx), context=ctx,
                       max_output=low.size)
    assert np.array_equal(back, high) and np.array_equal(lo, low)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(["fp16", "fp8_e5m2"]), data=st.data())
def test_new_formats_code_every_bit_pattern(fmt, data):
    # The per-value coder under the calibrated conditional model of the format: any bits,
    # any valid (mu, sigma), including a mu far from every value.
    width = D.FORMATS[fmt].bits
    bits = np.array(data.draw(st.lists(st.integers(0, (1 << width) - 1), min_size=1,
                                       max_size=400)), D.FORMATS[fmt].storage)
    mu = np.full(bits.size, data.draw(st.floats(-6e4, 6e4, width=32)), np.float32)
    sigma = np.full(bits.size, data.draw(st.floats(2.0**-23, 2.0**13, width=32)), np.float32)
    model = CALS[NONE.describe()].coder_model("conditional", fmt)
    n = bits.size
    args = (mu, residual.floor(sigma, mu), model)
    frame = D.encode(bits, *args, fmt=fmt, model_index=n % (len(model)), chunk_size=1024)
    assert np.array_equal(D.decode(frame, *args, model_index=n % len(model)), bits)


def test_fp32_low_frame_is_checked_before_the_predictor_runs():
    cache = _cast(CACHE, torch.float32)
    cal = CALS[NONE.describe()]
    blob = bytearray(P.compress_kv(cache, IDS, NONE, cal))
    front = codec._front(bytes(blob))
    start, _ = front.frames[1]  # layer 0 keys' low halves: a static frame
    assert bytes(blob[start : start + 4]) == b"EKRA"
    blob[start + 8] ^= 1  # its count of symbols (byte 8)
    with pytest.raises(CorruptDataError, match="frame"):
        P.decompress_kv(bytes(blob), NONE, cal)


def test_format_needs_its_fit():
    cal = P.calibrate(MODEL, NONE, PROMPTS[:1], ("bf16",), progress=False)
    with pytest.raises(ValueError, match="no fp16 fit"):
        P.compress_kv(_cast(CACHE, torch.float16), IDS, NONE, cal)


@pytest.mark.parametrize("dtype", [*NEW, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", ["mixture", "conditional"])
def test_device_path_of_every_dtype_writes_the_host_blob(device_path, dtype, kind):  # noqa: F811
    """The GPU coder's path takes every dtype (fp32: high halves split on the device and
    coded by the per-value coder, low halves by the static GPU encoder, its kernels
    emulated here; the conditional model with the format's own fit): the host's blob
    byte for byte, decoded back exactly on that path."""
    cache = _cast(CACHE, dtype)
    host = P.compress_kv(cache, IDS, FP8P, CALS[FP8P.describe()], model=kind, coder="cpu")
    dev = P.compress_kv(cache, IDS, FP8P, CALS[FP8P.describe()], model=kind, coder="gpu")
    assert dev == host
    out = P.decompress_kv(host, FP8P, CALS[FP8P.describe()], coder="gpu")
    assert out.equal(cache) and out.dtype == cache.dtype


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=300))
def test_fp32_split_in_torch_is_the_hosts(words):
    bits = np.array(words, np.uint32)
    t = torch.from_numpy(bits.view(np.float32).copy())
    high, low, ctx = codec._split32_torch(t)
    want_high, want_low = codec._split32(t)
    assert np.array_equal(high.numpy().view(np.uint16), want_high)
    assert np.array_equal(low.numpy(), want_low)
    assert np.array_equal(ctx.numpy(), codec._low_context(want_low.size))
    back = codec._join32_torch(high, want_low)
    assert np.array_equal(back.numpy().view(np.uint32), bits)


def test_to_fp8_e5m2_scales_to_its_range():
    fp8 = P.to_fp8(CACHE, torch.float8_e5m2)
    assert fp8.dtype == torch.float8_e5m2 and fp8.format == "fp8_e5m2"
    for layer in range(len(CACHE.keys)):
        for kv in (0, 1):
            top = fp8.tensor(layer, kv).float().abs().max()
            assert top == 57344.0
    with pytest.raises(TypeError):
        P.to_fp8(CACHE, torch.float16)
