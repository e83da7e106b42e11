"""KV caches of every layout transformers makes, coded exactly: sliding-window layers with
fewer tokens, keys and values of different heads or dims, layers without KV; tiny random
models of each family (no downloads), with and without a predictor; blobs and calibration
files of version 1 still decode; the offload hook on a sliding-window model."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _kvcheck import check_torch_is_numpy, device_path  # noqa: F401 - a fixture

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.predictive import codec
from entropykit.predictive.predictors import decoder_layers, output_cache

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, WINDOW = 64, 24, 8  # a sliding layer holds WINDOW - 1 of the SEQ tokens
FULL, SLIDE = (1, 2, SEQ, 16), (1, 2, WINDOW - 1, 16)


def _decoder(cfg_cls, model_cls, **kw):
    cfg = cfg_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, **kw)
    torch.manual_seed(0)
    return model_cls(cfg).to(torch.bfloat16).eval()


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()


def _deepseek():
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        first_k_dense_replace=1, n_group=1, topk_group=1)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()


ALTERNATING = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
# family -> (builder, the cache layout of a SEQ-token prompt: None for a layer without KV)
FAMILIES = {
    "llama": (lambda: _decoder(transformers.LlamaConfig, transformers.LlamaForCausalLM),
              [FULL] * 4),
    "qwen2": (lambda: _decoder(transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
              [FULL] * 4),
    "qwen3": (lambda: _decoder(transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                               head_dim=16), [FULL] * 4),
    "gemma2": (lambda: _decoder(transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
                                head_dim=16, **ALTERNATING), [SLIDE] * 2 + [FULL] * 2),
    "gemma3": (lambda: _decoder(transformers.Gemma3TextConfig,
                                transformers.Gemma3ForCausalLM, head_dim=16, **ALTERNATING),
               [SLIDE] * 2 + [FULL] * 2),
    "mistral-sliding": (lambda: _decoder(transformers.MistralConfig,
                                         transformers.MistralForCausalLM,
                                         sliding_window=WINDOW), [SLIDE] * 4),
    "gpt2": (_gpt2, [(1, 4, SEQ, 16)] * 4),
    "gpt-oss": (lambda: _decoder(transformers.GptOssConfig, transformers.GptOssForCausalLM,
                                 head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                 **ALTERNATING), [SLIDE] * 2 + [FULL] * 2),
    "qwen3-next": (lambda: _decoder(
        transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, head_dim=16,
        layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32), [None, None, FULL, FULL]),
    "deepseek-v3": (_deepseek, [(1, 1, SEQ, 16), (1, 1, SEQ, 8)] * 2),  # K and V differ
}
GEN = torch.Generator().manual_seed(11)
IDS = torch.randint(0, VOCAB, (1, SEQ), generator=GEN)
PROMPTS = [torch.randint(0, VOCAB, (32,), generator=GEN) for _ in range(2)]


def _cache(model, ids=IDS) -> P.KVCache:
    with torch.inference_mode():
        return P.from_transformers(output_cache(model(ids, use_cache=True)))


def _assert_exact(out: P.KVCache, cache: P.KVCache) -> None:
    assert out.shapes == cache.shapes and out.dtype == cache.dtype
    for a, b in zip(out.keys + out.values, cache.keys + cache.values, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert out.equal(cache)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_round_trips(family):
    build, layout = FAMILIES[family]
    model = build()
    cache = _cache(model)
    assert cache.shapes == layout
    predictors = [P.NoPredictor(), P.FP8Predictor(model), P.EarlyExitPredictor(model, 1)]
    for pred in predictors:
        cal = P.calibrate(model, pred, PROMPTS, formats=("bf16",))
        assert cal.dims == [None if s is None else (s[1], s[3]) for s in layout]
        for kind in ("conditional", "mixture"):
            blob = P.compress_kv(cache, IDS, pred, cal, model=kind, threads=1)
            _assert_exact(P.decompress_kv(blob, pred, cal, threads=1), cache)
    assert 0 < predictors[2].flops_fraction() < 1


def test_early_exit_layer_k_is_exact_on_gpt2_and_gemma3():
    # The deeper layers run on the early hidden state; layer k's input is the true one.
    for build in (_gpt2, FAMILIES["gemma3"][0]):
        model = build()
        guess = P.EarlyExitPredictor(model, 1).predict(IDS)
        cache = _cache(model)
        for layer in range(2):
            assert torch.equal(guess[layer][0], cache.keys[layer].float())
            assert torch.equal(guess[layer][1], cache.values[layer].float())


def test_fp8_predictor_rounds_gpt2_conv1d_weights():
    model = _gpt2()
    pred = P.FP8Predictor(model)
    w = pred.model.transformer.h[0].attn.c_attn.weight  # Conv1D: [in, out]
    assert not torch.equal(w, model.transformer.h[0].attn.c_attn.weight)
    assert torch.equal(w, P.predictors.quantize_fp8_rows(
        model.transformer.h[0].attn.c_attn.weight.T).T)
    guess = pred.predict(IDS)
    assert [tuple(k.shape) for k, _ in guess] == [(1, 4, SEQ, 16)] * 2


class _NoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=3)
        self.proj = torch.nn.Linear(4, 4)


def test_unsupported_model_names_class_and_what_is_missing():
    with pytest.raises(ValueError, match="_NoLayers: unsupported model: its decoder _NoLayers "
                                         "has 0 ModuleLists of 3 layers"):
        P.EarlyExitPredictor(_NoLayers(), 1)
    with pytest.raises(ValueError, match="_NoLayers: unsupported"):
        P.FP8Predictor(_NoLayers())
    model = _NoLayers()
    model.config = SimpleNamespace()
    with pytest.raises(ValueError, match="_NoLayers: unsupported model: its config has no "
                                         "num_hidden_layers"):
        decoder_layers(model)


# ---- a synthetic target: every layout at once, with enough tokens to fit the maps ------

# per layer: None (no KV) or ((key heads, key dim), (value heads, value dim), window)
LAYOUT = [((2, 16), (1, 8), None), None, ((2, 16), (2, 16), 20), ((1, 8), (1, 8), None)]


class _Synthetic(torch.nn.Module):
    """A 'model' whose cache has ``LAYOUT``: values linear in one per-token vector plus
    noise, so the groups predict each other and the conditional maps are fitted."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        gen = torch.Generator().manual_seed(3)
        self.maps = [None if spec is None else
                     [torch.randn(8, h * d, generator=gen) for h, d in spec[:2]]
                     for spec in LAYOUT]

    def forward(self, ids, use_cache=True):
        gen = torch.Generator().manual_seed(int(ids.sum()) + ids.shape[1])
        b, s = ids.shape
        z = torch.randn(b, s, 8, generator=gen)
        layers = []
        for spec, maps in zip(LAYOUT, self.maps, strict=True):
            if spec is None:
                layers.append(SimpleNamespace(keys=None, values=None))
                continue
            kv = []
            for (h, d), w in zip(spec[:2], maps, strict=True):
                x = z @ w + 0.05 * torch.randn(b, s, h * d, generator=gen)
                x = x.reshape(b, s, h, d).transpose(1, 2).to(torch.bfloat16)
                kv.append(x[:, :, -spec[2] + 1 :] if spec[2] else x)
            layers.append(SimpleNamespace(keys=kv[0], values=kv[1]))
        return {"cache": SimpleNamespace(layers=layers)}


SYN = _Synthetic()
SYN_IDS = torch.randint(0, VOCAB, (2, 40), generator=GEN)  # batch 2
SYN_CAL = P.calibrate(SYN, P.NoPredictor(),
                      [torch.randint(0, VOCAB, (64,), generator=GEN) for _ in range(6)])
SYN_CACHE = _cache(SYN, SYN_IDS)


def test_synthetic_layout_and_fitted_maps():
    assert SYN_CACHE.shapes == [(2, 2, 40, 16), (2, 1, 40, 8), None, None,
                                (2, 2, 19, 16), (2, 2, 19, 16), (2, 1, 40, 8), (2, 1, 40, 8)]
    assert SYN_CAL.version == 2 and SYN_CAL.layers == 4
    for layer, kv in ((0, 1), (3, 1)):  # full layers: enough tokens for a map
        q, scale = SYN_CAL.cond(layer, kv, "bf16")
        t = SYN_CACHE.tensor(layer, kv)
        assert q.any() and q.shape[1] == scale.shape[1] == t.shape[1] * t.shape[3]
    q, _ = SYN_CAL.cond(3, 0, "bf16")  # sources: layer 2's (sliding) K and V, layer 3's guesses
    assert q.shape == (32 + 32 + 8 + 8, 8)


@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_synthetic_round_trip_and_device_distribution(kind, fp8):
    cache = P.to_fp8(SYN_CACHE) if fp8 else SYN_CACHE
    blob = P.compress_kv(cache, SYN_IDS, P.NoPredictor(), SYN_CAL, model=kind, threads=1)
    _assert_exact(P.decompress_kv(blob, P.NoPredictor(), SYN_CAL, threads=1), cache)
    check_torch_is_numpy(cache, SYN_IDS, P.NoPredictor(), SYN_CAL, kind)


@pytest.mark.parametrize("kind", P.KINDS)
def test_synthetic_device_path_writes_the_host_blob(device_path, kind):  # noqa: F811
    host = P.compress_kv(SYN_CACHE, SYN_IDS, P.NoPredictor(), SYN_CAL, model=kind,
                         coder="cpu")
    assert P.compress_kv(SYN_CACHE, SYN_IDS, P.NoPredictor(), SYN_CAL, model=kind,
                         coder="gpu") == host
    _assert_exact(P.decompress_kv(host, P.NoPredictor(), SYN_CAL, coder="gpu"), SYN_CACHE)


def test_calibration_file_of_a_mixed_layout(tmp_path):
    path = tmp_path / "cal.safetensors"
    SYN_CAL.save(path)
    back = P.Calibration.load(path)
    assert back.fingerprint == SYN_CAL.fingerprint and back.dims == SYN_CAL.dims


def test_layout_mismatches_are_refused():
    other = P.KVCache(list(SYN_CACHE.keys), list(SYN_CACHE.values))
    other.keys[3] = other.keys[3][:, :, :, :4].contiguous()
    with pytest.raises(ValueError, match="another model shape"):
        P.compress_kv(other, SYN_IDS, P.NoPredictor(), SYN_CAL)
    with pytest.raises(ValueError, match="up to 40 tokens"):
        P.compress_kv(SYN_CACHE, SYN_IDS[:, :39], P.NoPredictor(), SYN_CAL)
    with pytest.raises(ValueError, match="differ in shape"):
        _ = SYN_CACHE.shape  # one shape only where there is one
    with pytest.raises(ValueError, match="layer 1 has keys or values but not both"):
        P.KVCache([SYN_CACHE.keys[0], SYN_CACHE.keys[0]], [SYN_CACHE.values[0], None])


# ---- version 1 files ---------------------------------------------------------------------

V1 = np.load(Path(__file__).parent / "data" / "kv_v1.npz")


@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_version_1_blobs_and_calibration_still_decode(name, tmp_path):
    path = tmp_path / "cal.safetensors"
    path.write_bytes(V1["calibration"].tobytes())
    cal = P.Calibration.load(path)
    assert cal.version == 1 and cal.dims == [(1, 16)] * 4
    blob = V1[f"blob_{name}"].tobytes()
    assert blob[4] == 1  # the blob's version byte
    out = P.decompress_kv(blob, P.NoPredictor(), cal, threads=1)
    assert torch.equal(P.token_ids(blob), torch.from_numpy(V1["ids"]))
    for i in range(2):
        for kv, t in enumerate((out.keys[i], out.values[i])):
            view = torch.int16 if t.element_size() == 2 else torch.uint8
            want = V1[f"{name}_{'kv'[kv]}{i}"]
            assert np.array_equal(t.contiguous().view(view).numpy(), want)
    if name == "fp8":
        assert np.array_equal(out.scales.numpy(), V1["fp8_scales"])
    cal.save(tmp_path / "again.safetensors")  # saved as version 1: the same fingerprint
    assert P.Calibration.load(tmp_path / "again.safetensors").fingerprint == cal.fingerprint


# ---- the offload hook on a sliding-window model -------------------------------------------


def assert_offload_exact(model, codec, ids, cache, ref, new_tokens: int) -> None:
    """Each offloaded layer of ``cache`` prefetches back to ``ref``'s tensors bit for bit,
    and generate() through a fresh offloaded cache equals generate() through a plain one."""
    import transformers

    from entropykit.predictive.hook import PredictiveOffloadedCache

    for layer, want in zip(cache.layers, ref.layers, strict=True):
        if hasattr(layer, "offloaded"):
            layer.prefetch()
            assert torch.equal(layer.keys, want.keys) and torch.equal(layer.values, want.values)
    codec.set_prompt(ids)
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=PredictiveOffloadedCache(codec, config=model.config))
    plain = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                           past_key_values=transformers.DynamicCache(config=model.config))
    assert torch.equal(out, plain)


def test_offload_hook_sliding_window_round_trip():
    from entropykit.predictive.hook import (
        KVOffloadCodec,
        PredictiveOffloadedCache,
        PredictiveOffloadedSlidingLayer,
    )

    model = FAMILIES["gemma2"][0]()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=GEN)
    for pred in (P.NoPredictor(), P.FP8Predictor(model)):
        cal = P.calibrate(model, pred, PROMPTS, formats=("bf16",))
        codec = KVOffloadCodec(pred, cal, model="mixture")
        codec.set_prompt(ids)
        cache = PredictiveOffloadedCache(codec, config=model.config)
        assert isinstance(cache.layers[0], PredictiveOffloadedSlidingLayer)
        ref = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            model(ids, past_key_values=cache, use_cache=True)
            model(ids, past_key_values=ref, use_cache=True)
        assert all(layer.offloaded for layer in cache.layers) and cache.compressed_bytes() > 0
        assert_offload_exact(model, codec, ids, cache, ref, 12)
        assert cache.layers[0].keys.shape[-2] == WINDOW - 1  # the window, prefetched


def test_offload_hook_keeps_layers_without_kv():
    from entropykit.predictive.hook import KVOffloadCodec, PredictiveOffloadedCache

    model = FAMILIES["qwen3-next"][0]()
    cal = P.calibrate(model, P.NoPredictor(), PROMPTS, formats=("bf16",))
    codec = KVOffloadCodec(P.NoPredictor(), cal, model="gaussian")
    codec.set_prompt(IDS)
    out = model.generate(IDS, max_new_tokens=6, do_sample=False,
                         past_key_values=PredictiveOffloadedCache(codec, config=model.config))
    plain = model.generate(IDS, max_new_tokens=6, do_sample=False)
    assert torch.equal(out, plain)


def test_corrupt_shape_table_is_refused():
    blob = bytearray(P.compress_kv(SYN_CACHE, SYN_IDS, P.NoPredictor(), SYN_CAL))
    dlen = struct.unpack_from("<H", blob, 32)[0]
    table = 34 + dlen
    end = table + 24 * 4 + 4 * 2 * 40 + 8 * 4
    for group, field, value, match in ((0, 1, 41, "group 0"), (2, 0, 1, "group 2"),
                                       (1, 0, 2, "does not match")):
        b = bytearray(blob)
        struct.pack_into("<I", b, table + 12 * group + 4 * field, value)
        struct.pack_into("<I", b, end, zlib.crc32(b[:end]))
        with pytest.raises(CorruptDataError, match=match):
            P.decompress_kv(bytes(b), P.NoPredictor(), SYN_CAL)


def test_to_transformers_with_config_continues_a_sliding_window_model():
    model = FAMILIES["gemma2"][0]()
    step = torch.randint(0, VOCAB, (1, 3), generator=GEN)
    with torch.inference_mode():
        ref = output_cache(model(IDS, use_cache=True))
        cache = P.from_transformers(ref)
        back = P.to_transformers(P.KVCache([k.clone() for k in cache.keys],
                                           [v.clone() for v in cache.values]),
                                 config=model.config, tokens=SEQ)
        assert back.layers[0].keys.shape[-2] == WINDOW - 1 and back.get_seq_length() == SEQ
        want = model(step, past_key_values=ref, use_cache=True).logits
        got = model(step, past_key_values=back, use_cache=True).logits
    assert torch.equal(got, want)


# ---- cache dtypes beside bf16 and fp8 e4m3 on per-group layouts ----------------------------

NEW_DTYPES = {torch.float16: "fp16", torch.float32: "fp32", torch.float8_e5m2: "fp8_e5m2"}


def _as_dtype(cache: P.KVCache, dtype: torch.dtype) -> P.KVCache:
    """``cache`` in ``dtype``; fp32 values perturbed below bf16's resolution, so that their
    low halves are not all alike."""
    if dtype == torch.float8_e5m2:
        return P.to_fp8(cache, dtype)
    gen = torch.Generator().manual_seed(5)

    def cast(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        x = t.to(dtype)
        if dtype == torch.float32:
            x = x * (1 + 2.0**-10 * torch.randn(x.shape, generator=gen))
        return x

    return P.KVCache([cast(k) for k in cache.keys], [cast(v) for v in cache.values])


def _frames_per_group(blob: bytes, cache: P.KVCache) -> None:
    """The blob is version 2 with one frame length a group (fp32: two), 0 exactly for the
    groups without KV."""
    front = codec._front(blob)
    per = 2 if cache.format == "fp32" else 1
    assert blob[4] == 2 and len(front.frames) == per * len(cache.shapes)
    empty = [n == 0 for _, n in front.frames]
    assert empty == [sh is None for sh in cache.shapes for _ in range(per)]


@pytest.fixture(scope="module")
def syn_new_cal() -> P.Calibration:
    gen = torch.Generator().manual_seed(12)
    return P.calibrate(SYN, P.NoPredictor(),
                       [torch.randint(0, VOCAB, (64,), generator=gen) for _ in range(6)],
                       tuple(NEW_DTYPES.values()), progress=False)


@pytest.mark.parametrize("dtype", list(NEW_DTYPES), ids=list(NEW_DTYPES.values()))
def test_new_dtypes_on_a_mixed_layout(dtype, syn_new_cal):
    # keys and values of other shapes, a layer without KV, a sliding layer
    cache = _as_dtype(SYN_CACHE, dtype)
    for kind in ("conditional", "gaussian"):
        blob = P.compress_kv(cache, SYN_IDS, P.NoPredictor(), syn_new_cal, model=kind,
                             threads=1)
        _frames_per_group(blob, cache)
        _assert_exact(P.decompress_kv(blob, P.NoPredictor(), syn_new_cal, threads=1), cache)
    assert codec._CODES[cache.format] == blob[5]


def test_gemma2_sliding_cache_in_fp16_and_fp32():
    model = FAMILIES["gemma2"][0]()
    pred = P.FP8Predictor(model)
    cal = P.calibrate(model, pred, PROMPTS, formats=("fp16", "fp32"), progress=False)
    for dtype in (torch.float16, torch.float32):
        cache = _as_dtype(_cache(model), dtype)
        assert cache.shapes == FAMILIES["gemma2"][1]
        blob = P.compress_kv(cache, IDS, pred, cal, threads=1)
        _frames_per_group(blob, cache)
        _assert_exact(P.decompress_kv(blob, pred, cal, threads=1), cache)
