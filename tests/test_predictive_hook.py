"""The transformers cache hook: offloaded layers come back bit for bit; generate() is equal."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from entropykit import predictive as P  # noqa: E402
from entropykit.predictive.hook import (  # noqa: E402
    KVOffloadCodec,
    PredictiveOffloadedCache,
    PredictiveOffloadedLayer,
)

CFG = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
MODEL = transformers.LlamaForCausalLM(CFG).to(torch.bfloat16).eval()
GEN = torch.Generator().manual_seed(3)
PROMPTS = [torch.randint(0, 256, (48,), generator=GEN) for _ in range(3)]
PRED = P.FP8Predictor(MODEL)
CAL = P.calibrate(MODEL, PRED, PROMPTS, formats=("bf16",))


def _generate(ids, cache):
    return MODEL.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, past_key_values=cache)


@pytest.mark.parametrize("model", ["gaussian", "mixture"])
@pytest.mark.parametrize("batch", [1, 2])
def test_generate_equality(model, batch):
    ids = torch.randint(0, 256, (batch, 50), generator=GEN)
    ref = _generate(ids, transformers.DynamicCache())
    codec = KVOffloadCodec(PRED, CAL, model=model)
    codec.set_prompt(ids)
    cache = PredictiveOffloadedCache(codec, CFG.num_hidden_layers)
    out = _generate(ids, cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.logits) == len(ref.logits)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    # Every layer ended offloaded, its prompt part smaller than raw bf16.
    raw = 2 * batch * 2 * 50 * 16 * 2  # k and v, batch, kv heads, seq, head dim, 2 bytes
    assert all(layer.offloaded for layer in cache.layers)
    assert all(0 < layer.compressed_bytes() < raw for layer in cache.layers)


def test_offload_prefetch_roundtrip():
    ids = torch.randint(0, 256, (1, 40), generator=GEN)
    with torch.inference_mode():
        ref = MODEL(ids, use_cache=True).past_key_values
    codec = KVOffloadCodec(PRED, CAL)
    codec.set_prompt(ids)
    layer = PredictiveOffloadedLayer(codec, 1)
    layer.update(ref.layers[1].keys.clone(), ref.layers[1].values.clone())
    layer.offload()
    assert layer.offloaded and layer.keys is None and layer.get_seq_length() == 40
    layer.prefetch()
    assert not layer.offloaded
    assert torch.equal(layer.keys, ref.layers[1].keys)
    assert torch.equal(layer.values, ref.layers[1].values)


def test_codec_arguments():
    with pytest.raises(ValueError, match="one at a time"):
        KVOffloadCodec(PRED, CAL, model="conditional")
    with pytest.raises(ValueError, match="another predictor"):
        KVOffloadCodec(P.NoPredictor(), CAL)
    codec = KVOffloadCodec(PRED, CAL)
    codec.set_prompt(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="expected bf16"):
        codec.encode(0, 0, torch.zeros(1, 2, 9, 16, dtype=torch.bfloat16))
