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
weight decoder's kernel), each decode checked before its layer's update returns it (the
default; one wait a layer and step), (4) the same with ``check="deferred"`` (no step
waits for a check; a corrupt frame could feed one step), and (5) with the per-value
coder and no predictor (``method="distribution"``, GPU coder). For each it prints the
generate() time (best of ``--reps``), the decode-phase tokens/s (from the times of
``--new-tokens`` and of one new token, best of ``--one-token-reps``, so the prompt's
one-off encode is left out) and the host bytes the offloaded prompt holds.
Exactness: every run of ``--new-tokens`` of every row, the reference's own repeats
included, is compared with the reference's first run, tokens and each step's logits bit
for bit; for a run that differs it prints where (repeat, batch row, new token), the
largest logit difference at the first step whose logits differ, and the reference's
margin between its two best tokens where the tokens part; a row whose repeats differ
among themselves says where they first do. It exits non-zero if any run but row (1)'s
differs from the reference's first (row (1)'s result is printed), and prints its own
wall time. Random weights give random-like KV: the bytes held are an upper bound of
what a trained model's cache takes (bench/bench_kv_static.py measures bits on SmolLM2's).
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


Run = tuple[torch.Tensor, torch.Tensor]  # a run's new tokens [batch, n], logits [n, batch, vocab]


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """(batch row, new token) of the earliest position where two runs' tokens differ (a
    run that stopped early differs where it stopped)."""
    n = min(a.shape[1], b.shape[1])
    diff = a[:, :n] != b[:, :n]
    if not bool(diff.any()):
        return None if a.shape == b.shape else (0, n)
    at = int(diff.any(0).nonzero()[0])
    return int(diff[:, at].nonzero()[0]), at


def difference(run: Run, base: Run) -> str | None:
    """Where ``run`` first departs from ``base``, tokens and logits (None: bit for bit the
    same): the first step whose logits differ and by how much, and where the tokens
    part, the base's margin between its two best tokens there."""
    n = min(len(run[1]), len(base[1]))
    steps = (run[1][:n] != base[1][:n]).flatten(1).any(1)
    tokens = first_difference(run[0], base[0])
    if tokens is None and not bool(steps.any()):
        return None
    text = "logits identical"
    if bool(steps.any()):
        step = int(steps.nonzero()[0])
        gap = float((run[1][step] - base[1][step]).abs().max())
        text = f"logits first differ at new token {step} (by up to {gap:.3g})"
    if tokens is None:
        return f"tokens identical, {text}"
    row, at = tokens
    if at >= n:
        return f"one run stopped at new token {at}; {text}"
    best = base[1][at, row].topk(2).values
    return (f"tokens first differ at batch row {row}, new token {at} (the base's top-two "
            f"margin there {float(best[0] - best[1]):.3g}); {text}")


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--one-token-reps", type=int, default=None,
                    help="repeats of the one-token runs (default: --reps)")
    args = ap.parse_args(argv)
    reps = {1: args.one_token_reps or args.reps, args.new_tokens: args.reps}
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

    ref_label, synced_label = "no offloading (reference)", "plain offloading, synchronized"
    rows = [(ref_label, resident),
            (RACY, plain()),
            (synced_label, plain(SyncedLayer)),
            ("static tables", coded(coder="gpu", method="static")),
            ("static tables, deferred checks",
             coded(coder="gpu", method="static", check="deferred")),
            ("per-value coder, no predictor",
             coded(predictor=none, calibration=cal, coder="gpu", method="distribution"))]
    raw = 2 * layers * args.batch * args.prompt * 8 * 128 * 2
    print(f"random Llama, {layers} layers, 8 kv heads x 128, prompt {args.batch} x "
          f"{args.prompt}, {args.new_tokens} new tokens, best of {args.reps} (one token: "
          f"best of {reps[1]}); {torch.cuda.get_device_name(0)}; transformers "
          f"{transformers.__version__}")
    print("| offloading | generate s | 1 token s | decode tokens/s | of synchronized plain's "
          "| host MiB held | of plain's |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rates: dict[str, float] = {}
    reference: Run | None = None
    # per row: each repeat's difference from the reference's first run, and from its own first
    against: dict[str, list[str | None]] = {}
    repeats: dict[str, list[str | None]] = {}
    for label, make in rows:
        best = {}
        base: Run | None = None
        for n in (1, args.new_tokens):
            best[n] = float("inf")
            for _ in range(reps[n]):
                cache = make()
                torch.cuda.synchronize()
                t = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=n, do_sample=False, past_key_values=cache,
                                     output_logits=True, return_dict_in_generate=True)
                torch.cuda.synchronize()
                best[n] = min(best[n], time.perf_counter() - t)
                if n != args.new_tokens:
                    continue
                run = (out.sequences[:, args.prompt :].cpu(), torch.stack(out.logits))
                reference = reference or run
                base = base or run
                against.setdefault(label, []).append(difference(run, reference))
                repeats.setdefault(label, []).append(difference(run, base))
                del out, run
            if n == args.new_tokens:
                coded_row = label.startswith(("static", "per-value"))
                held[label] = (sum(layer.compressed_bytes() for layer in cache.layers)
                               if coded_row else raw)
        rate = args.batch * (args.new_tokens - 1) / max(1e-9, best[args.new_tokens] - best[1])
        rates[label] = rate
        synced = rates.get(synced_label)
        vs = "—" if synced is None else f"{rate / synced:.2f}x"
        print(f"| {label} | {best[args.new_tokens]:.3f} | {best[1]:.3f} | {rate:.1f} | {vs} | "
              f"{held[label] / 2**20:.1f} | {held[label] / raw:.3f} |", flush=True)
    print(f"exactness (new tokens counted from 0; the prompt is {args.prompt} tokens):")
    differing = []
    for label, diffs in against.items():
        own = [(r, d) for r, d in enumerate(repeats[label]) if d is not None]
        print(f"{label}: repeats " + ("identical" if not own else "differ: " + "; ".join(
            f"repeat {r} against repeat 0: {d}" for r, d in own)))
        for r, d in enumerate(diffs):
            if d is not None:
                print(f"  repeat {r} against the reference's first run: {d}")
                if label != RACY:
                    differing.append(f"{label} repeat {r}")
        if all(d is None for d in diffs):
            print("  every repeat identical to the reference's first run")
    print("every run but the racy row's identical to the reference's first run, tokens "
          "and logits: " + ("yes" if not differing else "no (" + ", ".join(differing) + ")"))
    print(f"bench wall time {time.perf_counter() - began:.0f} s")
    return 0 if not differing else 1


if __name__ == "__main__":
    sys.exit(main())
