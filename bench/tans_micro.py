"""Single-thread tANS kernel timing on skewed bytes (bf16 exponent bytes of Gaussian weights).

What it is: the small timing script behind the speed numbers in the tANS kernel work; it
times the kernels on one chunk and the whole frame path with one thread, and reports the
coded size against the empirical entropy. What it is not: the side-by-side benchmark.

    python bench/tans_micro.py [--mib 4] [--precision 11] [--repeat 7]
"""

from __future__ import annotations

import argparse
import time

import ml_dtypes
import numpy as np

from entropykit import tans
from entropykit.coding import frame, tables
from entropykit.tans import kernels, static
from entropykit.tans import table as ttable


def bf16_exponents(n: int, seed: int = 0) -> np.ndarray:
    """Exponent bytes of n bf16 values drawn like trained weights (N(0, 0.02))."""
    w = np.random.default_rng(seed).normal(0.0, 0.02, n).astype(ml_dtypes.bfloat16)
    return ((w.view(np.uint16) >> 7) & 0xFF).astype(np.uint8)


def fp8_bytes(n: int, seed: int = 0) -> np.ndarray:
    """e4m3 bytes of n Gaussian weights scaled to the format's range (~6.6 bits each)."""
    w = np.random.default_rng(seed).normal(0.0, 30.0, n).astype(ml_dtypes.float8_e4m3fn)
    return w.view(np.uint8)


DATA = {"bf16-exp": bf16_exponents, "fp8": fp8_bytes}


def best(fn, repeat: int) -> float:
    """Least CPU time of this thread over ``repeat`` runs (the machine is shared: wall
    time would count other processes' slices)."""
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=4)
    ap.add_argument("--precision", type=int, default=static.DEFAULT_PRECISION)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--data", choices=sorted(DATA), default="bf16-exp")
    args = ap.parse_args()
    n = int(args.mib * (1 << 20))
    sym = DATA[args.data](n)
    p = args.precision

    counts = tables.histogram(sym)
    freqs = tables.quantize(counts, p)
    tt, st = ttable.encode_tables(freqs, p)
    dt = ttable.decode_table(freqs, p)
    out = np.empty(n + 8, np.uint8)
    start = kernels.encode_chunk(sym, tt, st, p, out)
    dec = np.empty(n, np.uint8)
    assert kernels.decode_chunk(out, start, n + 8 - start, dt, p, dec) == kernels.OK
    assert np.array_equal(dec, sym)
    enc_t = best(lambda: kernels.encode_chunk(sym, tt, st, p, out), args.repeat)
    dec_t = best(lambda: kernels.decode_chunk(out, start, n + 8 - start, dt, p, dec),
                 args.repeat)
    print(f"kernel, one {n}-symbol chunk: encode {n / enc_t / 1e6:.0f} M sym/s, "
          f"decode {n / dec_t / 1e6:.0f} M sym/s")

    blob = tans.encode(sym, precision=p, threads=1)
    fenc_t = best(lambda: tans.encode(sym, precision=p, threads=1), args.repeat)
    fdec_t = best(lambda: tans.decode(blob, threads=1), args.repeat)
    h = tables.entropy_bits(counts) / 8
    print(f"frame ({frame.DEFAULT_CHUNK}-symbol chunks), 1 thread: encode "
          f"{n / fenc_t / 1e6:.0f} M sym/s, decode {n / fdec_t / 1e6:.0f} M sym/s")
    print(f"size {len(blob)} B, entropy {h:.0f} B ({h * 8 / n:.4f} bit/sym), "
          f"overhead {100 * (len(blob) / h - 1):.3f}%")


if __name__ == "__main__":
    main()
