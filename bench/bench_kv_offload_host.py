"""Host-side cost of making one offloaded layer's GPU decode batch, without a GPU.

What it is: for a random bf16 layer ([batch, kv heads, tokens, head dim] keys and values,
one-table static frames as the GPU encoder writes them, coded here by the CPU encoder),
the host time of the two ways to a ``static_kv.GpuLayer``: "frames" (the frames made as
bytes, then ``GpuLayer``: plan, payload copied out of the frames, packed into one pinned
buffer) and "direct" (what ``static_kv.encode_gpu_layer`` does on the host: the plan from
each frame's header and directory alone and the packed buffer's small parts; the payload
is gathered on the device and copied in by the device). Best of ``--reps``, one thread.
What it is not: the device's share (kernels, copies: gpu/kv_offload_bench.py).

    python bench/bench_kv_offload_host.py --batch 4 --tokens 8192
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from entropykit.coding import frame
from entropykit.predictive import static_kv
from entropykit.rans import static as rans_static


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    shape = (args.batch, args.heads, args.tokens, args.dim)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(shape, generator=gen).bfloat16().view(torch.int16).numpy()
            .view(np.uint16) for _ in range(2))
    layer = static_kv.encode(k, v, classes=False, threads=1)
    frames = [layer.high[0], layer.low[0], layer.high[1], layer.low[1]]
    heads = [len(f) - int(frame.parse(rans_static.CODER, f).lengths.sum()) for f in frames]

    def of(parts):
        return static_kv._layer("bfloat16", [shape, shape],
                                [(parts[0], False, parts[1]), (parts[2], False, parts[3])])

    def via_frames():
        made = [f[:h] + f[h:] for f, h in zip(frames, heads, strict=True)]  # the join
        return static_kv.GpuLayer(of(made))

    def direct():
        skeletons = []
        for f, h in zip(frames, heads, strict=True):
            s = np.empty(len(f), np.uint8)
            s[:h] = np.frombuffer(f, np.uint8, h)
            skeletons.append(s)
        lay = of(skeletons)
        return static_kv.GpuLayer._of(static_kv.plan(lay), lay.shapes, lay.dtype)

    print(f"layer {shape} x 2 bf16 ({2 * k.nbytes / 2**20:.0f} MiB), coded "
          f"{len(layer) / 2**20:.1f} MiB; ms, best of {args.reps}")
    for name, fn in (("frames", via_frames), ("direct", direct)):
        best = float("inf")
        for _ in range(args.reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        print(f"{name}: {best * 1e3:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
