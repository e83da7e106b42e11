"""The predictive KV path with a model on the device (kv_hook_check.py's checks).

What it is: with a tiny random Llama in bf16 on the GPU: ``compress_kv`` of a CUDA cache
on the GPU coder writes the CPU coder's blob byte for byte (bf16 and fp8, every residual
model) and each blob decodes on the other coder, a damaged blob raises
``CorruptDataError`` on both; ``generate`` through ``transformers.Cache(offloading=True)``
of ``PredictiveOffloadedLayer`` and through ``PredictiveOffloadedCache`` gives the tokens
and logits of a ``DynamicCache``; the offload codec's GPU (mu, sigma) are the CPU's bit for
bit, its frames decode across coders, generate is identical with it (FP8-of-target
predictor and none), and a corrupt offloaded frame raises at every read. What it is not:
the hook's timings (kv_hook_check.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("transformers")

import kv_hook_check as kh  # noqa: E402 - needs transformers


@pytest.fixture(scope="module")
def setup() -> SimpleNamespace:
    model = kh.tiny_model()
    gen = torch.Generator().manual_seed(1)
    pred, cal, prompts = kh.calibrated(model, gen)
    none, none_cal = kh.no_predictor(model, prompts)
    return SimpleNamespace(model=model, gen=gen, pred=pred, cal=cal, none=none,
                           none_cal=none_cal)


def test_compress_kv_gpu_blob_is_the_cpu_blob(setup):
    s = setup
    assert kh.compress_kv_checks(s.model, s.pred, s.cal, s.gen) == []


def test_generate_through_offloaded_caches_is_unchanged(setup):
    s = setup
    assert kh.generate_checks(s.model, s.pred, s.cal, s.gen) == []


def test_offload_codec_gpu_coder_matches_the_cpu_coder(setup):
    s = setup
    assert kh.offload_codec_checks(s.model, s.pred, s.cal, s.none, s.none_cal, s.gen) == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e5m2])
@pytest.mark.parametrize("kind", ["mixture", "conditional"])
def test_compress_kv_new_dtypes_on_the_gpu_coder(setup, dtype, kind):
    """fp16, fp32 and fp8 e5m2 caches on the GPU coder: the CPU coder's blob byte for
    byte, each blob decoded exactly on either coder."""
    from entropykit import predictive as P
    from entropykit.predictive import calibration

    s = setup
    if not hasattr(s, "all_formats"):
        s.all_formats = P.calibrate(s.model, s.none, [torch.randint(0, 512, (128,),
                                                                    generator=s.gen)
                                                      for _ in range(4)],
                                    formats=calibration.FORMATS)
    ids = torch.randint(0, 512, (2, 200), generator=s.gen).to(kh.DEV)
    with torch.inference_mode():
        cache = P.from_transformers(s.model(ids, use_cache=True).past_key_values)
    if dtype == torch.float8_e5m2:
        cache = P.to_fp8(cache, dtype)
    else:
        cache = P.KVCache([k.to(dtype) for k in cache.keys],
                          [v.to(dtype) for v in cache.values])
    host = P.KVCache([k.cpu() for k in cache.keys], [v.cpu() for v in cache.values],
                     None if cache.scales is None else cache.scales.cpu())
    want = P.compress_kv(host, ids.cpu(), s.none, s.all_formats, model=kind, coder="cpu")
    got = P.compress_kv(cache, ids, s.none, s.all_formats, model=kind, coder="gpu")
    assert got == want
    on_gpu = P.decompress_kv(want, s.none, s.all_formats, device=kh.DEV, coder="gpu")
    on_cpu = P.decompress_kv(got, s.none, s.all_formats, coder="cpu")
    for out in (on_gpu, on_cpu):
        assert out.dtype == cache.dtype
        assert P.KVCache([k.cpu() for k in out.keys], [v.cpu() for v in out.values],
                         None if out.scales is None else out.scales.cpu()).equal(host)
