"""KV offload coders' bits per value on SmolLM2-135M: static tables against per-value.

What it is: the prompt caches of ``bench_kv``'s eval prose (SmolLM2-135M-Instruct, bf16,
``--seqs`` sequences of ``--tokens`` tokens), each layer coded as the offload hook codes
it: by the static-table coder (``predictive.static_kv``: exponents classed by rows and
channels, sign+mantissa per exponent) and by the per-value distribution coder with no
predictor (``KVOffloadCodec`` with ``NoPredictor``, calibrated on the calib prose), each
layer decoded back and compared. Prints bits per value (keys, values, all) and the coding
times on this machine's CPU. What it is not: a GPU timing (gpu/kv_offload_bench.py).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--calib", type=int, default=2, help="calibration sequences (dist)")
    ap.add_argument("--chunk", type=int, default=None, help="static coder's chunk size")
    ap.add_argument("--coders", default="static,static-one-table,dist",
                    help="comma-separated: static (exponents classed where it pays), "
                         "static-one-table (as the GPU encoder codes), dist")
    args = ap.parse_args(argv)

    import torch
    from bench_kv import smollm2_prose

    from entropykit.predictive import static_kv

    model, calib_ids, eval_ids = smollm2_prose()
    n = args.tokens
    ids = torch.stack([eval_ids[i * n : (i + 1) * n] for i in range(args.seqs)])
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    chunk = args.chunk or static_kv.CHUNK
    coders = args.coders.split(",")
    bits = {c: [0, 0] for c in coders}
    times = {c: [0.0, 0.0] for c in coders}
    values = [sum(t.numel() for t, _ in layers), sum(t.numel() for _, t in layers)]
    classes = 0
    first = [t.contiguous().view(torch.int16).numpy().view(np.uint16) for t in layers[0]]
    static_kv.decode(static_kv.encode(*first, chunk))  # compiles the kernels: not timed
    for name in [c for c in coders if c.startswith("static")]:
        for k, v in layers:
            kb, vb = (t.contiguous().view(torch.int16).numpy().view(np.uint16) for t in (k, v))
            t = time.perf_counter()
            coded = static_kv.encode(kb, vb, chunk, classes=name == "static")
            times[name][0] += time.perf_counter() - t
            t = time.perf_counter()
            back = static_kv.decode(coded)
            times[name][1] += time.perf_counter() - t
            assert all(np.array_equal(a, b) for a, b in zip(back, (kb, vb), strict=True))
            classes += sum(coded.classes)
            for kv in (0, 1):
                bits[name][kv] += 8 * (len(coded.high[kv]) + len(coded.low[kv]))
    if "dist" in coders:
        _dist(model, layers, calib_ids, ids, args, bits, times)
    print(f"SmolLM2-135M prompt caches: {args.seqs} x {n} tokens, {len(layers)} layers, "
          f"{sum(values)} values; static: {classes} of {2 * len(layers)} exponent fields "
          f"classed, chunk {chunk}")
    print("| coder | keys bits/value | values bits/value | all | encode s | decode s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, b in bits.items():
        kv = (f"{b[0] / values[0]:.3f} | {b[1] / values[1]:.3f}" if name != "dist"
              else "- | -")
        print(f"| {name} | {kv} | {sum(b) / sum(values):.3f} | {times[name][0]:.2f} | "
              f"{times[name][1]:.2f} |")


def _dist(model, layers, calib_ids, ids, args, bits, times) -> None:
    """The per-value coder's bits and times, layer by layer as the hook codes them."""
    import time

    import torch

    from entropykit import predictive as P
    from entropykit.predictive.hook import KVOffloadCodec

    n = args.tokens
    pred = P.NoPredictor()
    t = time.perf_counter()
    cal = P.calibrate(model, pred, [calib_ids[i * n : (i + 1) * n] for i in range(args.calib)])
    print(f"dist: mixture model, NoPredictor calibrated on {args.calib} x {n} tokens in "
          f"{time.perf_counter() - t:.1f} s")
    codec = KVOffloadCodec(pred, cal, model="mixture", method="distribution")
    codec.set_prompt(ids)
    for i, (k, v) in enumerate(layers):
        t = time.perf_counter()
        frame = codec.encode(i, k, v)
        times["dist"][0] += time.perf_counter() - t
        t = time.perf_counter()
        bk, bv = codec.decode(i, frame)
        times["dist"][1] += time.perf_counter() - t
        assert torch.equal(bk, k) and torch.equal(bv, v)
        bits["dist"][0] += 8 * len(frame)  # one frame a layer: keys and values together


if __name__ == "__main__":
    main()
