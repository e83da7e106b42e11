"""Measure line (row / column) classes on real weights: coded bytes saved per field, net.

What it is: for each 2-D tensor of the MiniLM casts (BF16 exponent, F16 high byte, F8_E4M3
and F8_E5M2 bytes), the size of the field as ``codecs.choose`` codes it now, against an
rANS frame conditioned on the class of each symbol's row, column or both (K classes per
axis, quantile or Lloyd assignment), with the class maps and 28 header bytes added.
Prints per-configuration totals and the per-tensor best. Not timed, not a benchmark.
Usage: python bench/measure_lines.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from entropykit import formats
from entropykit.coding import frame, lines, tables
from entropykit.container import codecs
from entropykit.rans import static as rans_static

CASTS = Path(__file__).resolve().parent.parent / ".bench-cache" / "casts"
FIELD = {"bf16": "exponent", "f16": "byte1", "f8_e4m3": "byte0", "f8_e5m2": "byte0"}
DTYPE = {"bf16": "BF16", "f16": "F16", "f8_e4m3": "F8_E4M3", "f8_e5m2": "F8_E5M2"}


def load(path: Path) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """{name: (shape, stored bytes)} of a safetensors file (any dtype: no numpy dtype)."""
    buf = np.fromfile(path, np.uint8)
    size = int(buf[:8].view("<u8")[0])
    head = json.loads(buf[8 : 8 + size].tobytes())
    head.pop("__metadata__", None)
    return {k: (tuple(v["shape"]), buf[8 + size + v["data_offsets"][0] : 8 + size
                                       + v["data_offsets"][1]]) for k, v in head.items()}


def coded(sym, cols, kr, kc, iters, precision, max_tables):
    rcls = ccls = None
    index, magnitude = lines.buckets(tables.histogram(sym))
    hr, hc = lines.line_histograms(sym, index, magnitude.size, cols, 0)
    if kr > 1:
        rcls = lines.assign(hr, magnitude, kr, iters)
    if kc > 1:
        ccls = lines.assign(hc, magnitude, kc, iters)
    ctx = lines.context(sym.size, cols, 0, rcls, ccls, kc)
    side = 28 + (lines.map_bytes(rcls.size, kr) if kr > 1 else 0) + (
        lines.map_bytes(cols, kc) if kc > 1 else 0)
    blob = frame.encode(rans_static.CODER, sym, precision, context=ctx, threads=1,
                        max_tables=max_tables)
    return len(blob) + side


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    configs = [(k, 1, 4) for k in (4, 8, 16)] + [(1, k, 4) for k in (4, 8, 16)]
    configs += [(k, 1, 0) for k in (16,)] + [(1, k, 0) for k in (16,)]
    configs += [(4, 4, 4), (8, 4, 4), (4, 8, 4), (8, 8, 4), (16, 4, 4), (16, 16, 4)]
    for name in FIELD:
        if args.only and name != args.only:
            continue
        path = CASTS / f"minilm-l6.{name}.v1.safetensors"
        tensors = load(path)
        fsize = path.stat().st_size
        for prec, mt in ((12, 16), (14, 16), (12, 64)) if not args.quick else ((12, 16),):
            base_tot = 0
            tot = {c: 0 for c in configs}
            best_tot = 0
            for shape, raw in tensors.values():
                if len(shape) < 2 or np.prod(shape) < 4096:
                    continue
                cols = shape[-1]
                f = next(x for x in formats.split(DTYPE[name], raw) if x.name == FIELD[name])
                sym = np.ascontiguousarray(f.symbols)
                base = len(codecs.choose(sym, None).blob)
                base_tot += base
                best = base
                for c in configs:
                    kr, kc, it = c
                    size = coded(sym, cols, kr, kc, it, prec, mt)
                    tot[c] += min(size, base)
                    best = min(best, size)
                best_tot += best
            print(f"{name} precision {prec} max_tables {mt}: base {base_tot} "
                  f"(file {fsize}); saved bytes, file ratio delta (kept only where it saves):")
            for c in configs:
                d = base_tot - tot[c]
                print(f"  rows K{c[0]:<2} cols K{c[1]:<2} iters {c[2]}: {d:8d} {-d / fsize:+.5f}")
            d = base_tot - best_tot
            print(f"  best per tensor: {d} {-d / fsize:+.5f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
