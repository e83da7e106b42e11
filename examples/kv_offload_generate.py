"""Offload a long prompt's KV cache as compressed bytes, keep generating, get the same tokens.

Runs ``model.generate`` twice with greedy decoding: once with transformers' plain
``DynamicCache``, once with ``PredictiveOffloadedCache``, whose layers code the prompt's keys
and values against a predictor's guess into host memory after every update and decode them
back before the next one. It checks that the generated tokens and every step's logits are
identical and prints what the offloaded prompt cache costs: the frames, and the guess the
codec keeps to decode them (none with ``--predictor none``, whose layers are coded with
static tables of their own values: no calibration, and the GPU weight decoder's speed).

    python examples/kv_offload_generate.py                     # a tiny random Llama
    python examples/kv_offload_generate.py --gguf PATH.gguf    # e.g. SmolLM2-135M (bench/data.py)
    python examples/kv_offload_generate.py --predictor none --device cuda

On a CUDA device, ``transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i) ...],
offloading=True)`` works the same way with transformers' own prefetch stream, and the
layers are coded on the GPU where CuPy is installed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import transformers

from entropykit import predictive as P
from entropykit.predictive.hook import KVOffloadCodec, PredictiveOffloadedCache

# Prose for the prompts: the calibration and the evaluated prompt come from different text.
_TEXT = Path(transformers.__file__).read_text(encoding="utf-8")


def _tiny_model() -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(0)
    calib = [torch.randint(0, 512, (256,), generator=gen) for _ in range(8)]
    return model, calib, torch.randint(0, 512, (1, 1024), generator=gen)


def _gguf_model(path: Path) -> tuple[torch.nn.Module, list[torch.Tensor], torch.Tensor]:
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    ids = tok(_TEXT, return_tensors="pt").input_ids[0]
    calib = [ids[i * 512 : (i + 1) * 512] for i in range(8)]
    return model, calib, ids[8 * 512 : 8 * 512 + 1024][None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a Llama-family GGUF file (default: tiny model)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--predictor", choices=("fp8", "none"), default="fp8",
                    help="FP8-of-target (fewer bits, keeps a guess as large as the cache) "
                         "or none (static tables per channel class, keeps nothing per value)")
    ap.add_argument("--device", default="cpu", help="where the model runs, e.g. cuda")
    args = ap.parse_args()
    model, calib, prompt = _gguf_model(args.gguf) if args.gguf else _tiny_model()
    model, prompt = model.to(args.device), prompt.to(args.device)
    predictor = P.FP8Predictor(model) if args.predictor == "fp8" else P.NoPredictor()
    # No predictor: the static-table coder needs no calibration (the tables are the data's).
    calibration = (P.calibrate(model, predictor, calib, formats=("bf16",))
                   if args.predictor == "fp8" else None)

    def generate(cache):
        t = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=args.new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             past_key_values=cache)
        return out, time.perf_counter() - t

    ref, t_ref = generate(transformers.DynamicCache())
    codec = KVOffloadCodec(predictor, calibration, model="mixture")
    codec.set_prompt(prompt)
    cache = PredictiveOffloadedCache(codec, model.config.num_hidden_layers)
    out, t_off = generate(cache)

    same_tokens = torch.equal(out.sequences, ref.sequences)
    same_logits = all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    layers = model.config.num_hidden_layers
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    raw = 2 * layers * prompt.shape[1] * cfg.num_key_value_heads * head_dim * 2
    packed = cache.compressed_bytes()
    print(f"prompt {prompt.shape[1]} tokens, {args.new_tokens} generated, {layers} layers")
    print(f"identical tokens: {same_tokens}; identical logits at every step: {same_logits}")
    print(f"offloaded prompt cache: {packed:,} bytes vs {raw:,} bf16 "
          f"({8 * packed / (raw / 2):.2f} bits/value); the codec also keeps the "
          f"{args.predictor} predictor's guess: {codec.guess_bytes():,} bytes")
    print(f"generate: {t_ref:.2f} s plain, {t_off:.2f} s with compressed offloading")
    if not (same_tokens and same_logits):
        raise SystemExit("MISMATCH")


if __name__ == "__main__":
    main()
