"""Device check of the predictive KV path with the model on a GPU (issue 6).

What it is: a script for the lent GPU machine. With a tiny random Llama in bf16 on
``cuda:0`` it checks (1) ``compress_kv`` of a CUDA cache and ``decompress_kv(...,
device="cuda")`` give back every bit, bf16 and fp8, every residual model; (2)
``model.generate`` with ``transformers.Cache(layers=[PredictiveOffloadedLayer...],
offloading=True)`` — transformers' own offloading, prefetch stream and all — and with
``PredictiveOffloadedCache`` gives the same tokens and logits at every step as a plain
``DynamicCache``; it prints the transformers version it ran with. It exits non-zero on
any mismatch. What it is not: a benchmark (the coder's GPU speed is ``kv_check.py``'s).

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 gpu/kv_hook_check.py
"""

from __future__ import annotations

import sys
import time

import torch
import transformers

from entropykit import predictive as P
from entropykit.predictive.hook import (
    KVOffloadCodec,
    PredictiveOffloadedCache,
    PredictiveOffloadedLayer,
)

DEV = "cuda:0"


def _model() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).to(DEV).eval()


def main() -> int:
    failures = []
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.cuda.get_device_name(0)}")
    model = _model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (128,), generator=gen) for _ in range(6)]
    pred = P.FP8Predictor(model)
    t = time.perf_counter()
    cal = P.calibrate(model, pred, prompts)
    print(f"calibrate on {DEV}: {time.perf_counter() - t:.1f} s")

    ids = torch.randint(0, 512, (2, 200), generator=gen).to(DEV)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    for name, c in (("bf16", cache), ("fp8", P.to_fp8(cache))):
        for kind in P.KINDS:
            blob = P.compress_kv(c, ids, pred, cal, model=kind)
            back = P.decompress_kv(blob, pred, cal, device=DEV)
            ok = back.equal(c) and back.keys[0].device == c.keys[0].device
            bits = 8 * len(blob) / (2 * len(c.keys) * c.keys[0].numel())
            print(f"compress_kv {name:4s} {kind:11s}: {bits:6.3f} bits/value, exact {ok}")
            if not ok:
                failures.append(f"compress_kv {name} {kind}")

    prompt = torch.randint(0, 512, (1, 300), generator=gen).to(DEV)

    def generate(c):
        return model.generate(prompt, max_new_tokens=12, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, past_key_values=c)

    ref = generate(transformers.DynamicCache())
    layers = model.config.num_hidden_layers
    for label, make in (
        ("transformers.Cache(offloading=True)",
         lambda codec: transformers.Cache(
             layers=[PredictiveOffloadedLayer(codec, i) for i in range(layers)],
             offloading=True)),
        ("PredictiveOffloadedCache", lambda codec: PredictiveOffloadedCache(codec, layers)),
    ):
        for kind in ("gaussian", "mixture"):
            codec = KVOffloadCodec(pred, cal, model=kind)
            codec.set_prompt(prompt)
            c = make(codec)
            out = generate(c)
            same = torch.equal(out.sequences, ref.sequences) and all(
                torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
            packed = sum(layer.compressed_bytes() for layer in c.layers)
            print(f"generate, {label}, {kind}: identical tokens and logits {same}; "
                  f"prompt cache {packed:,} bytes compressed")
            if not same or packed == 0:
                failures.append(f"generate {label} {kind}")
    print("FAILURES: " + ", ".join(failures) if failures else "ALL OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
