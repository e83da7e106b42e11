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
