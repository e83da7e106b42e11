"""Predictive KV coding: exact round trips of real caches of a tiny random Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers  # the kv extra; .ci/run installs it

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.predictive import residual

LAYERS = 3


def _model(seed: int = 0) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


MODEL = _model()
GEN = torch.Generator().manual_seed(1)
# Enough tokens (4 x 96) for the conditional maps' folds: the round trips run real maps.
PROMPTS = [torch.randint(0, 256, (96,), generator=GEN) for _ in range(4)]
IDS = torch.randint(0, 256, (2, 40), generator=GEN)  # batch of 2, disjoint from calibration


def _cache(ids=IDS) -> P.KVCache:
    with torch.inference_mode():
        return P.from_transformers(MODEL(ids, use_cache=True).past_key_values)


CACHE = _cache()
PREDICTORS = {"none": P.NoPredictor(), "fp8": P.FP8Predictor(MODEL),
              "early": P.EarlyExitPredictor(MODEL, 1)}
CALS = {name: P.calibrate(MODEL, pred, PROMPTS) for name, pred in PREDICTORS.items()}


def _values(cache: P.KVCache) -> int:
    return sum(int(np.prod(sh)) for sh in cache.shapes)


@pytest.mark.parametrize("pred", sorted(PREDICTORS))
@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_roundtrip(pred, kind, fp8):
    cache = P.to_fp8(CACHE) if fp8 else CACHE
    blob = P.compress_kv(cache, IDS, PREDICTORS[pred], CALS[pred], model=kind)
    out = P.decompress_kv(blob, PREDICTORS[pred], CALS[pred])
    assert out.equal(cache)
    assert out.dtype == cache.dtype and out.shapes == cache.shapes
    assert torch.equal(P.token_ids(blob), IDS)
    # A predictor makes the cache cheaper than its raw 16 / 8 bits per value.
    assert len(blob) * 8 / _values(cache) < (8 if fp8 else 16)


def test_conditional_maps_are_fitted():
    # The round trips above exercise non-zero maps (not the "too little data" fallback).
    for name in ("none", "fp8"):
        for fmt in ("bf16", "fp8"):
            cond = CALS[name].arrays[f"cond_{fmt}"]
            assert np.count_nonzero(cond[1:]) > 0, (name, fmt)


def test_fit_conditional_recovers_a_linear_map():
    rng = np.random.default_rng(5)
    feats = rng.standard_normal((2000, 12)).astype(np.float32)
    w = rng.standard_normal((12, 3))
    target = (feats @ w + 0.1 * rng.standard_normal((2000, 3))).astype(np.float32)
    weights, oof = residual.fit_conditional(feats, target)
    np.testing.assert_allclose(weights, w, atol=0.02)
    np.testing.assert_allclose((target - oof).std(axis=0), 0.1, rtol=0.1)


def test_fit_conditional_ignores_noise():
    # Unrelated features and few tokens: the map must not do worse than no map on new data.
    rng = np.random.default_rng(6)
    feats = rng.standard_normal((400, 60)).astype(np.float32)
    target = rng.standard_normal((400, 4)).astype(np.float32)
    weights, _ = residual.fit_conditional(feats, target)
    new_f, new_t = rng.standard_normal((20000, 60)), rng.standard_normal((20000, 4))
    assert ((new_t - new_f @ weights) ** 2).mean() < 1.03 * (new_t**2).mean()
    # Below the minimum fold size no map is fitted at all.
    weights, oof = residual.fit_conditional(feats[:100], target[:100])
    assert not weights.any() and not oof.any()


def test_fp8_predictor_beats_no_predictor():
    sizes = {p: len(P.compress_kv(CACHE, IDS, PREDICTORS[p], CALS[p])) for p in ("none", "fp8")}
    assert sizes["fp8"] < 0.8 * sizes["none"]


@pytest.mark.parametrize("k", range(1, LAYERS + 1))
def test_early_exit_reproduces_layers_up_to_k(k):
    # Layers 0..k-1 are run, and layer k's projections see the hidden state that enters it.
    pred = P.EarlyExitPredictor(MODEL, k)
    assert pred.exact_layers == min(k + 1, LAYERS)
    guess = pred.predict(IDS)
    for layer in range(LAYERS):
        same = (torch.equal(guess[layer][0], CACHE.keys[layer].float())
                and torch.equal(guess[layer][1], CACHE.values[layer].float()))
        assert same == (layer < pred.exact_layers), layer


def test_exact_layers_cost_almost_nothing():
    pred = P.EarlyExitPredictor(MODEL, LAYERS - 1)  # layers 0..LAYERS-1 guessed exactly
    cal = P.calibrate(MODEL, pred, PROMPTS[:1])
    blob = P.compress_kv(CACHE, IDS, pred, cal)
    assert (len(blob) - 2000) * 8 / _values(CACHE) < 0.02
    assert P.decompress_kv(blob, pred, cal).equal(CACHE)


def test_transformers_cache_input():
    with torch.inference_mode():
        hf = MODEL(IDS, use_cache=True).past_key_values
    blob = P.compress_kv(hf, IDS, PREDICTORS["fp8"], CALS["fp8"])
    out = P.decompress_kv(blob, PREDICTORS["fp8"], CALS["fp8"])
    assert out.equal(CACHE)
    back = P.to_transformers(out)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
               for a, b in zip(back.layers, hf.layers, strict=True))


@pytest.mark.parametrize("pred", sorted(PREDICTORS))
def test_predictor_is_deterministic(pred):
    a, b = PREDICTORS[pred].predict(IDS), PREDICTORS[pred].predict(IDS)
    if a is None:
        assert b is None
        return
    assert len(a) == LAYERS
    for (ka, va), (kb, vb) in zip(a, b, strict=True):
        assert ka.shape == CACHE.shapes[0] and ka.dtype == torch.float32
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_early_exit_layers_are_exact_and_flops():
    pred = PREDICTORS["early"]
    guess = pred.predict(IDS)
    assert torch.equal(guess[0][0], CACHE.real(0, 0))
    assert torch.equal(guess[0][1], CACHE.real(0, 1))
    assert not torch.equal(guess[2][0], CACHE.real(2, 0))
    assert 0 < pred.flops_fraction() < 1
    assert PREDICTORS["fp8"].flops_fraction() == 1.0
    assert PREDICTORS["none"].flops_fraction() == 0.0


def test_calibration_file_roundtrip(tmp_path):
    cal = CALS["fp8"]
    path = tmp_path / "cal.safetensors"
    cal.save(path)
    loaded = P.Calibration.load(path)
    assert loaded.fingerprint == cal.fingerprint and loaded.predictor == cal.predictor
    assert path.stat().st_size < sum(a.nbytes for a in cal.arrays.values()) + 10_000
    assert cal.arrays["cond_bf16"].dtype == np.int8
    blob = P.compress_kv(CACHE, IDS, PREDICTORS["fp8"], cal)
    assert P.decompress_kv(blob, PREDICTORS["fp8"], loaded).equal(CACHE)
    (tmp_path / "bad.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CorruptDataError):
        P.Calibration.load(tmp_path / "bad.safetensors")


# ---- hostile input and mismatched side information ----------------------------------

BLOB = P.compress_kv(CACHE, IDS, PREDICTORS["fp8"], CALS["fp8"])


def _decode(blob, pred="fp8", cal=None):
    return P.decompress_kv(blob, PREDICTORS[pred], cal or CALS[pred])


@pytest.mark.parametrize("cut", [0, 10, 41, 60, 400, len(BLOB) - 1])
def test_truncated(cut):
    with pytest.raises(CorruptDataError):
        _decode(BLOB[:cut])


@pytest.mark.parametrize("pos", [0, 4, 5, 6, 8, 12, 28, 32, 36, 45, 300, 700, -50, -2])
def test_corrupted_byte(pos):
    b = bytearray(BLOB)
    b[pos] ^= 0x5A
    with pytest.raises(CorruptDataError):
        _decode(bytes(b))
    if 0 <= pos < 60:  # the header and token ids are CRC-checked before anything runs
        with pytest.raises(CorruptDataError):
            P.token_ids(bytes(b))


def test_wrong_predictor_or_calibration():
    with pytest.raises(CorruptDataError, match="predictor"):
        _decode(BLOB, pred="none")
    with pytest.raises(CorruptDataError, match="calibration"):
        _decode(BLOB, cal=P.calibrate(MODEL, PREDICTORS["fp8"], PROMPTS[:1]))


def test_predictor_drift_is_detected():
    drifted = P.FP8Predictor(MODEL)
    with torch.no_grad():
        drifted.model.model.layers[1].self_attn.k_proj.weight.mul_(1.01)
    with pytest.raises(CorruptDataError, match="guess"):
        P.decompress_kv(BLOB, drifted, CALS["fp8"])


def test_bad_arguments():
    with pytest.raises(ValueError, match="input_ids"):
        P.compress_kv(CACHE, IDS[:, :-1], PREDICTORS["fp8"], CALS["fp8"])
    with pytest.raises(ValueError, match="calibration was fitted with"):
        P.compress_kv(CACHE, IDS, PREDICTORS["none"], CALS["fp8"])
    with pytest.raises(ValueError, match="unknown residual"):
        P.compress_kv(CACHE, IDS, PREDICTORS["fp8"], CALS["fp8"], model="laplace")
    with pytest.raises(TypeError):
        P.KVCache([k.double() for k in CACHE.keys], [v.double() for v in CACHE.values])
