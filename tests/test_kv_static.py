"""The static-table KV coder: exact on every bf16 pattern, decodable by the GPU weight
decoder (its arithmetic emulated on the plan's own buffers), and the offload hook's
no-predictor path on every cache layout (sliding windows, keys and values of different
shapes, layers without KV) with generate() equal to an uncompressed cache."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_gpu_logic import _emulate, _special_bf16

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.coding import frame
from entropykit.predictive import static_kv
from entropykit.predictive.hook import (
    KVOffloadCodec,
    PredictiveOffloadedCache,
    PredictiveOffloadedSlidingLayer,
)

transformers = pytest.importorskip("transformers")
from test_predictive_layouts import FAMILIES, SEQ, VOCAB, assert_offload_exact  # noqa: E402

CHUNK = frame.MIN_CHUNK  # several chunks per field


def _kv_like(rng, shape, scale):
    """bf16 patterns (uint16) with per-channel scales, as keys have; specials sprinkled."""
    x = torch.from_numpy(rng.normal(size=shape).astype(np.float32)) * torch.as_tensor(
        scale, dtype=torch.float32)
    bits = x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).copy()
    flat = bits.reshape(-1)
    flat[::97] = _special_bf16(rng, flat[::97].size)
    return bits


@pytest.mark.parametrize("shape_k, shape_v", [((2, 3, 700, 64), (2, 3, 700, 32)),
                                              ((1, 1, 5, 8), (1, 2, 5, 4)),
                                              ((1, 2, 1, 16), (1, 2, 1, 16))])
def test_round_trip_and_gpu_plan_are_exact(shape_k, shape_v):
    """CPU decode and the GPU kernel's emulated decode of the plan both give every bit
    back (NaN payloads, +-0, +-inf, subnormals), keys then values in one output."""
    rng = np.random.default_rng(1)
    k = _kv_like(rng, shape_k, np.geomspace(0.05, 8, shape_k[-1]))
    v = _kv_like(rng, shape_v, 1.0)
    layer = static_kv.encode(k, v, CHUNK)
    back = static_kv.decode(layer)
    assert np.array_equal(back[0], k) and np.array_equal(back[1], v)
    assert back[0].shape == shape_k and back[1].shape == shape_v
    b = static_kv.plan(layer, warps=2)
    outs, status = _emulate(b)
    assert not status.any() and b.sizes == (k.size + v.size,)
    assert np.array_equal(outs[0], np.concatenate([k.reshape(-1), v.reshape(-1)]))


def test_exponents_are_classed_where_channels_differ():
    """Channels of very different scales make classed exponents (a rans2d payload the
    kernel's classed build reads), smaller than one table; the layer is smaller than
    its raw bytes."""
    rng = np.random.default_rng(2)
    k = _kv_like(rng, (2, 4, 512, 64), np.geomspace(1e-3, 50, 64))
    v = _kv_like(rng, (2, 4, 512, 64), 1.0)
    layer = static_kv.encode(k, v, CHUNK)
    assert layer.classes[0]
    exp = static_kv.split(k.reshape(-1))[0]
    plain = frame.encode(static_kv.rans_static.CODER, exp, static_kv.PRECISION, CHUNK, 1)
    assert len(layer.high[0]) < len(plain)
    assert len(layer) < k.nbytes + v.nbytes
    b = static_kv.plan(layer, warps=2)
    assert b.classed and b.context
    outs, status = _emulate(b)
    assert not status.any()
    assert np.array_equal(outs[0], np.concatenate([k.reshape(-1), v.reshape(-1)]))


def test_gpu_layer_keeps_only_the_kernels_buffers():
    """``GpuLayer`` drops the frames: its batch (no streams) with the buffers it packs
    for one upload (each at an aligned offset, read back as the plan's own) still decodes
    exactly, and its size counts every buffer it keeps."""
    rng = np.random.default_rng(3)
    k = _kv_like(rng, (1, 2, 300, 32), np.geomspace(0.01, 4, 32))
    v = _kv_like(rng, (1, 2, 300, 16), 0.5)
    layer = static_kv.encode(k, v, CHUNK)
    g = static_kv.GpuLayer(layer, warps=2)
    assert g.batch.streams == () and len(g) >= g.packed.numel() > g.payload.numel() > 0
    plan = static_kv.plan(layer, warps=2)
    want = (plan.desc, plan.payload, plan.sym_tables, plan.info_tables.view(np.int32),
            plan.cmaps)
    for got, a in zip(g.buffers(g.packed), want, strict=True):
        assert got.data_ptr() % 256 == g.packed.data_ptr() % 256
        assert np.array_equal(got.numpy(), a.reshape(-1))
    b = dataclasses.replace(g.batch, _cache={"payload": g.payload.numpy()})
    outs, status = _emulate(b)
    assert not status.any()
    assert np.array_equal(outs[0], np.concatenate([k.reshape(-1), v.reshape(-1)]))


def test_damaged_frames_raise_corrupt_data():
    rng = np.random.default_rng(4)
    k = _kv_like(rng, (1, 2, 200, 32), 1.0)
    layer = static_kv.encode(k, k, CHUNK)
    bad = bytearray(layer.low[1])
    bad[-3] ^= 0x40  # a coded word: the chunk's CRC or final state fails
    hurt = dataclasses.replace(layer, low=(layer.low[0], bytes(bad)))
    with pytest.raises(CorruptDataError):
        static_kv.decode(hurt)
    cut = dataclasses.replace(layer, high=(layer.high[0][:40], layer.high[1]))
    for run in (static_kv.decode, static_kv.plan):
        with pytest.raises(CorruptDataError):
            run(cut)
    if layer.classes[0]:  # a rans2d payload holding another count is refused
        wrong = dataclasses.replace(layer, shapes=((1, 2, 100, 32), layer.shapes[1]))
        with pytest.raises(CorruptDataError):
            static_kv.plan(wrong)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp16_and_fp8_round_trip_on_cpu_and_in_the_gpu_plan(dtype):
    """fp16 (two byte fields, the high one classed where it pays) and fp8 (one field)
    come back bit for bit from the CPU decoder and from the kernel's u8 mode (fp16's
    bytes interleaved into its values), every pattern (NaNs, infinities, -0) included."""
    rng = np.random.default_rng(7)
    scale = torch.from_numpy(np.geomspace(0.01, 8, 32).astype(np.float32))
    k = (torch.randn(2, 2, 400, 32) * scale).to(dtype)
    v = torch.randn(2, 1, 400, 16).to(dtype)
    width = 2 if dtype == torch.float16 else 1
    view = torch.int16 if width == 2 else torch.uint8
    kb, vb = (t.view(view).numpy().view(np.uint16 if width == 2 else np.uint8).copy()
              for t in (k, v))
    kb.reshape(-1)[::41] = rng.integers(0, 1 << (8 * width), kb.reshape(-1)[::41].size)
    name = str(dtype).removeprefix("torch.")
    layer = static_kv.encode(kb, vb, CHUNK, dtype=name)
    assert (layer.low[0] is None) == (width == 1)
    back = static_kv.decode(layer)
    assert np.array_equal(back[0], kb) and np.array_equal(back[1], vb)
    b = static_kv.plan(layer, warps=2)
    outs, status = _emulate(b)
    assert not status.any() and not b.bf16
    flat = np.concatenate([kb.reshape(-1), vb.reshape(-1)])
    assert np.array_equal(outs[0], flat.view(np.uint8))
    with pytest.raises(TypeError, match="static tables code"):
        static_kv.encode(kb, vb, CHUNK, dtype="float32")


def test_method_choice_and_misuse():
    model = FAMILIES["llama"][0]()
    none, fp8 = P.NoPredictor(), P.FP8Predictor(model)
    cal = P.calibrate(model, fp8, [torch.randint(0, VOCAB, (16,))], formats=("bf16",))
    assert KVOffloadCodec().method == "static"
    assert KVOffloadCodec(none).method == "static"
    assert KVOffloadCodec(fp8, cal).method == "distribution"
    with pytest.raises(ValueError, match="method must be one of"):
        KVOffloadCodec(method="fast")
    with pytest.raises(ValueError, match="needs a predictor and its calibration"):
        KVOffloadCodec(none, method="distribution")
    with pytest.raises(ValueError, match="chunk_size must be a multiple of 32"):
        KVOffloadCodec(chunk_size=1000)
    codec = KVOffloadCodec()
    codec.set_prompt(torch.zeros(1, 4, dtype=torch.long))
    k = torch.zeros(1, 2, 4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="of one of"):
        codec.encode(0, k.float(), k.float())
    with pytest.raises(ValueError, match="of one of"):
        codec.encode(0, k, k.half())
    with pytest.raises(ValueError, match="differ in batch or tokens"):
        codec.encode(0, k, k[..., :3, :])


@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek-v3", "qwen3-next",
                                    "llama-fp16"])
def test_hook_static_generate_equality(family):
    """No predictor, no calibration: every layer the config makes is offloaded with
    static tables (sliding windows, keys and values of different shapes; layers without
    KV kept), comes back bit for bit, and generate() is equal to a plain cache."""
    model = FAMILIES[family.removesuffix("-fp16")][0]()
    if family.endswith("-fp16"):
        model = model.to(torch.float16)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    codec = KVOffloadCodec(chunk_size=CHUNK)
    codec.set_prompt(ids)
    cache = PredictiveOffloadedCache(codec, config=model.config)
    ref = transformers.DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        model(ids, past_key_values=ref, use_cache=True)
    offloaded = [layer for layer in cache.layers if hasattr(layer, "offloaded")]
    assert offloaded and all(layer.offloaded for layer in offloaded)
    assert all(isinstance(layer._frame, static_kv.StaticLayer) for layer in offloaded)
    assert cache.compressed_bytes() > 0
    if family == "gemma2":
        assert isinstance(cache.layers[0], PredictiveOffloadedSlidingLayer)
    assert_offload_exact(model, codec, ids, cache, ref, 8)


def test_prefetch_on_a_gpu_waits_for_the_default_stream_before_decoding(monkeypatch):
    """transformers queues ``prefetch()`` on its own stream; the decode's new tensors may
    take memory the default stream still reads, so the layer's stream first waits for the
    default stream (some transformers releases do not make it wait). Streams and the
    decode are stand-ins here: the order of the calls is what is checked."""
    model = FAMILIES["llama"][0]()
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(2))
    codec = KVOffloadCodec(chunk_size=CHUNK)
    codec.set_prompt(ids)
    cache = PredictiveOffloadedCache(codec, config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.offloaded
    calls = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            calls.append(("wait", self.name, other.name))

    decode = codec.start_decode

    def start_decode(i, frame, device, seq):
        calls.append(("decode", str(device)))
        return decode(i, frame, "cpu", seq)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream("prefetch"))
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: Stream("default"))
    monkeypatch.setattr(codec, "start_decode", start_decode)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: self)  # no CUDA here
    layer.device = torch.device("cuda", 0)
    layer.prefetch()
    assert calls == [("wait", "prefetch", "default"), ("decode", "cuda:0")]
