"""Device benchmark of KV offloading: plain copies against static-table and per-value coding.

What it is: a script for a GPU machine. A random Llama built from a config (no download:
``--layers`` layers, 32 heads, 8 kv heads x 128, hidden 4096, bf16) generates
``--new-tokens`` greedy tokens after a ``--batch`` x ``--prompt`` prompt with (0) a cache
that stays on the GPU (the reference), then through ``transformers.Cache(layers=...,
offloading=True)`` (transformers' prefetch stream) with (1) plain ``DynamicLayer``s as
the installed transformers runs them (some releases queue the prefetch without waiting
for the default stream: a race, whose tokens may differ from run to run), (2) plain
``DynamicLayer``s with only that wait added (``SyncedLayer``: the same wait
``PredictiveOffloadedLayer.prefetch`` makes; the correct plain offloading, the one to
compare with), (3) ``PredictiveOffloadedLayer``s coding with static tables
(``KVOffloadCodec(method="static")``: encoded and decoded on the device, decoded by the
weight decoder's kernel) and (4) with the per-value coder and no predictor
(``method="distribution"``, GPU coder). For each it prints the generate() time (best of
``--reps``), the decode-phase tokens/s (from the times of ``--new-tokens`` and one new
token, so the prompt's one-off encode is left out) and the host bytes the offloaded
prompt holds; it checks that every run of every row but (1) generates the reference's
tokens and exits non-zero if not (row (1)'s result is printed). Random weights give
random-like KV: the bytes held are an upper bound of what a trained model's cache takes
(bench/bench_kv_static.py measures bits on SmolLM2's).
What it is not: a correctness suite (gpu/tests/test_cuda_kv_static.py).

    python3 gpu/kv_offload_bench.py                      # 4 x 8192 tokens, 4 layers
    python3 gpu/kv_offload_bench.py --prompt 1024 --batch 1 --new-tokens 4   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import transformers
from transformers.cache_utils import DynamicLayer

from entropykit import predictive as P
from entropykit.predictive.hook import KVOffloadCodec, PredictiveOffloadedLayer

DEV = "cuda:0"
RACY = "plain offloading, as transformers runs it (racy where its prefetch does not wait)"


class SyncedLayer(DynamicLayer):
    """transformers' offloaded layer with the one wait its prefetch lacks in some
    releases: the prefetch stream waits for the default stream before the copies' new
    tensors can take memory the default stream still reads."""

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            torch.cuda.current_stream(self.device).wait_stream(
                torch.cuda.default_stream(self.device))
        super().prefetch()


def model_of(layers: int) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768)
    torch.manual_seed(0)
    with torch.device(DEV):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    model = model_of(args.layers)
    layers = args.layers
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32000, (args.batch, args.prompt), generator=gen).to(DEV)
    none = P.NoPredictor()
    cal = P.calibrate(model, none, [torch.randint(0, 32000, (256,), generator=gen)],
                      formats=("bf16",))
    held: dict[str, int] = {}

    def plain(cls=DynamicLayer):
        def make() -> transformers.Cache:
            return transformers.Cache(layers=[cls() for _ in range(layers)], offloading=True)
        return make

    def coded(**kw):
        def make() -> transformers.Cache:
            codec = KVOffloadCodec(**kw)
            codec.set_prompt(ids)
            return transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i)
                                              for i in range(layers)], offloading=True)
        return make

    def resident() -> transformers.Cache:
        return transformers.Cache(layers=[DynamicLayer() for _ in range(layers)])

    rows = [("no offloading (reference)", resident),
            (RACY, plain()),
            ("plain offloading, synchronized", plain(SyncedLayer)),
            ("static tables", coded(coder="gpu", method="static")),
            ("per-value coder, no predictor",
             coded(predictor=none, calibration=cal, coder="gpu", method="distribution"))]
    raw = 2 * layers * args.batch * args.prompt * 8 * 128 * 2
    print(f"random Llama, {layers} layers, 8 kv heads x 128, prompt {args.batch} x "
          f"{args.prompt}, {args.new_tokens} new tokens, best of {args.reps}; "
          f"{torch.cuda.get_device_name(0)}; transformers {transformers.__version__}")
    print("| offloading | generate s | 1 token s | decode tokens/s | of synchronized plain's "
          "| host MiB held | of plain's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rates: dict[str, float] = {}
    outs: dict[str, list[torch.Tensor]] = {}
    for label, make in rows:
        best = {}
        for n in (1, args.new_tokens):
            best[n] = float("inf")
            for _ in range(args.reps):
                cache = make()
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=n, do_sample=False, past_key_values=cache)
                torch.cuda.synchronize()
                best[n] = min(best[n], time.perf_counter() - t)
                if n == args.new_tokens:
                    outs.setdefault(label, []).append(out.cpu())
            if n == args.new_tokens:
                coded = label.startswith(("static", "per-value"))
                held[label] = (sum(layer.compressed_bytes() for layer in cache.layers)
                               if coded else raw)
        rate = args.batch * (args.new_tokens - 1) / max(1e-9, best[args.new_tokens] - best[1])
        rates[label] = rate
        synced = rates.get("plain offloading, synchronized")
        vs = "—" if synced is None else f"{rate / synced:.2f}x"
        print(f"| {label} | {best[args.new_tokens]:.3f} | {best[1]:.3f} | {rate:.1f} | {vs} | "
              f"{held[label] / 2**20:.1f} | {held[label] / raw:.3f} |", flush=True)
    # each row against its own repeats and against the cache that never leaves the GPU
    first = outs["no offloading (reference)"][0]
    same = True
    for label, runs in outs.items():
        stable = all(torch.equal(runs[0], o) for o in runs)
        diff = (runs[0] != first).nonzero()
        where = "identical" if not len(diff) else f"first differs at {tuple(diff[0].tolist())}"
        print(f"{label}: repeats identical {stable}; against no offloading: {where}")
        if label != RACY:
            same = same and stable and not len(diff)
    print(f"identical tokens in every run (the racy row aside): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
