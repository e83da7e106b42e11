"""KV-cache benchmark (issue 6): the per-value-distribution coder, then predictive coding.

What it is: ``--part coder`` times entropykit's per-symbol-distribution rANS against
constriction's QuantizedGaussian on the same (symbols, mu, sigma) arrays, one thread, and
compares each coder's size with its own model's ideal code length. ``--part kv`` (added with
the predictive package) measures bits per cached value on SmolLM2-135M.
``--write`` replaces the "## KV coder (issue 6)" section of bench/RESULTS.md.
What it is not: a test; round trips are checked but correctness lives in tests/.

Data for the coder part (synthetic, seeded):
- "bf16 Gaussian": values x ~ N(mu, sigma) rounded to bf16, mu ~ N(0, 1), log sigma ~
  N(-2, 0.5): a KV-like spread (~7.6 bits/value); coded by entropykit only.
- "fp8 Gaussian": the same rounded to fp8 e4m3 (~3.6 bits/value); entropykit only.
- "integers": x = round(N(mu, sigma)) clipped to [-128, 127], mu ~ N(0, 20), log sigma ~
  N(1, 0.5). constriction codes the integers with QuantizedGaussian(-128, 127); entropykit
  codes the same numbers as bf16 (exact) under the same (mu, sigma). The two models differ:
  constriction's alphabet is the 256 integers (each integer owns [x-1/2, x+1/2)), entropykit's
  is every bf16 value (an integer owns only the gap to its bf16 neighbours), so entropykit
  pays for not knowing the values are integers. Sizes are therefore compared with each
  coder's own ideal (sum of -log2 P under its quantized model), speed on identical inputs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as results_md  # noqa: E402 - bench/ is a folder of scripts, not a package

SECTION = "## KV coder (issue 6)"
SEED = 20261122


def _timed(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    """Best wall time of ``reps`` runs after one warm-up (the machine is shared: the best
    run is the least disturbed one)."""
    out = fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _gaussian(n: int, dtype, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mu = rng.normal(0, 1, n).astype(np.float32)
    sigma = np.exp(rng.normal(-2, 0.5, n)).astype(np.float32)
    x = (mu + sigma * rng.normal(size=n).astype(np.float32)).astype(dtype)
    return x, mu, sigma


def _integers(n: int, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    mu = rng.normal(0, 20, n).astype(np.float32)
    sigma = np.exp(rng.normal(1, 0.5, n)).astype(np.float32)
    x = np.clip(np.rint(mu + sigma * rng.normal(size=n)), -128, 127).astype(np.int32)
    return x, mu, sigma


def coder_rows(n: int, reps: int) -> list[dict]:
    import constriction
    import ml_dtypes

    from entropykit.rans import distribution as dist

    rng = np.random.default_rng(SEED)
    model = dist.gaussian_model()
    rows = []

    def ours(name: str, values: np.ndarray, mu: np.ndarray, sigma: np.ndarray) -> None:
        te, blob = _timed(lambda: dist.encode(values, mu, sigma, model, threads=1), reps)
        td, out = _timed(lambda: dist.decode(blob, mu, sigma, model, threads=1), reps)
        bits = np.asarray(values).view(out.dtype).reshape(-1)
        ideal = dist.value_costs(values, mu, sigma, model).sum()
        rows.append(dict(data=name, coder="entropykit dist-rANS", bits=len(blob) * 8 / n,
                         ideal=ideal / n, enc=n / te / 1e6, dec=n / td / 1e6,
                         exact=np.array_equal(out, bits)))

    for name, dtype in (("bf16 Gaussian", ml_dtypes.bfloat16),
                        ("fp8 Gaussian", ml_dtypes.float8_e4m3fn)):
        ours(name, *_gaussian(n, dtype, rng))

    x, mu, sigma = _integers(n, rng)
    ours("integers", x.astype(ml_dtypes.bfloat16), mu, sigma)
    qg = constriction.stream.model.QuantizedGaussian(-128, 127)
    mu64, sg64 = mu.astype(np.float64), sigma.astype(np.float64)

    def c_encode() -> np.ndarray:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(x, qg, mu64, sg64)
        return coder.get_compressed()

    te, words = _timed(c_encode, reps)
    td, out = _timed(lambda: constriction.stream.stack.AnsCoder(words).decode(qg, mu64, sg64),
                     reps)
    # constriction's own quantized model, for its ideal: P(x) = F(x + 1/2) - F(x - 1/2) with
    # the tails folded into the end symbols (what QuantizedGaussian codes, up to its
    # fixed-point rounding).
    from math import erf, sqrt

    cdf = np.vectorize(lambda t, m, s: 0.5 * (1 + erf((t - m) / (s * sqrt(2)))))
    lo = np.where(x == -128, -np.inf, x - 0.5)
    hi = np.where(x == 127, np.inf, x + 0.5)
    p = cdf(hi, mu64, sg64) - cdf(lo, mu64, sg64)
    rows.append(dict(data="integers", coder="constriction QuantizedGaussian",
                     bits=words.size * 32 / n, ideal=float(-np.log2(p).sum()) / n,
                     enc=n / te / 1e6, dec=n / td / 1e6, exact=np.array_equal(out, x)))
    return rows


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "entropykit"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def coder_section(rows: list[dict], n: int, reps: int, load: tuple[float, float]) -> str:
    from importlib.metadata import version

    import numba

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"Produced by `python bench/bench_kv.py --part coder --write` on {now}.", "",
        f"- Machine: {_cpu_model()}, {len(os.sched_getaffinity(0))} cores available; load "
        f"average {load[0]:.2f} before and {load[1]:.2f} after (other work on the machine "
        "makes throughput noisy).",
        f"- Software: entropykit (git {_git()}), numpy {np.__version__}, numba "
        f"{numba.__version__}, constriction {version('constriction')}.",
        f"- {n:,} values per row, one thread, best of {reps} timed runs after a warm-up.",
        "- bits/value is the whole coded size (entropykit: frame with chunk directory and "
        "CRC-32s; constriction: its 32-bit words). \"ideal\" is each coder's own quantized "
        "model's code length, so bits - ideal is the coder's overhead.", "",
        "| data | coder | bits/value | ideal | overhead | enc M values/s | dec M values/s "
        "| exact |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        over = (r["bits"] / r["ideal"] - 1) * 100
        lines.append(f"| {r['data']} | {r['coder']} | {r['bits']:.4f} | {r['ideal']:.4f} | "
                     f"{over:+.2f}% | {r['enc']:.1f} | {r['dec']:.1f} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["coder"], default="coder")
    ap.add_argument("--n", type=int, default=1 << 20, help="values per coder row")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    rows = coder_rows(args.n, args.reps)
    text = coder_section(rows, args.n, args.reps, (load0, os.getloadavg()[0]))
    print(text)
    if args.write:
        results_md.write_section(text, SECTION)


if __name__ == "__main__":
    main()
