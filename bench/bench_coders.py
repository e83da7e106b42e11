"""Side-by-side benchmark of the order-0 byte coders on the same symbols.

What it is: one run that codes the same uint8 symbol streams with entropykit's rANS and
tANS (its rows are skipped while it is not importable), zstd levels 3 and 19, and
constriction's ANS coder with a categorical model, verifies every round trip, and prints a
markdown table of size, bits/symbol, overhead over the empirical order-0 entropy and
1-/2-thread throughput. ``--write`` replaces the "## Coders" section of
bench/RESULTS.md with it.
What it is not: a container or per-format benchmark (the streams are raw symbol arrays).

Data: the exponent bytes and the sign+mantissa bytes of MiniLM-L6 cast to bf16 (all
floating tensors concatenated), and 16 MiB of synthetic discretized-Laplace symbols.
Timings are the median of ``--reps`` runs after one warm-up run, except for coders marked
slow (zstd-19 encode), which are timed by their single run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402 - bench/ is a folder of scripts, not a package
import results as results_md  # noqa: E402

SECTION = "## Coders"
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SYNTH_SIZE = 16 << 20
SYNTH_SEED = 20261121
SYNTH_LAPLACE_SCALE = 1.0  # ~2.48 bits/symbol of order-0 entropy


# ---------------------------------------------------------------- data


def minilm_bf16_fields() -> tuple[np.ndarray, np.ndarray]:
    """Exponent bytes and sign+mantissa bytes of every floating tensor of MiniLM in bf16."""
    import ml_dtypes
    from safetensors.numpy import load_file

    tensors = load_file(str(data.minilm_cast_path("BF16")))
    bits = np.concatenate([t.reshape(-1).view(np.uint16) for t in tensors.values()
                           if t.dtype == ml_dtypes.bfloat16])
    exponent = ((bits >> 7) & 0xFF).astype(np.uint8)
    sign_mantissa = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exponent, sign_mantissa


def synthetic_laplace(n: int = SYNTH_SIZE, seed: int = SYNTH_SEED) -> np.ndarray:
    """Discretized Laplace(0, 1) values, zigzag-mapped to 0, 1, 2, ... (clipped at 255)."""
    q = np.rint(np.random.default_rng(seed).laplace(0.0, SYNTH_LAPLACE_SCALE, n)).astype(np.int64)
    return np.minimum(np.where(q >= 0, 2 * q, -2 * q - 1), 255).astype(np.uint8)


def order0_entropy(symbols: np.ndarray) -> float:
    """Empirical order-0 entropy in bits per symbol."""
    counts = np.bincount(symbols, minlength=256)
    p = counts[counts > 0] / symbols.size
    return float(-(p * np.log2(p)).sum())


# ---------------------------------------------------------------- coders


@dataclass
class Coder:
    """One row of the table: encode(symbols, threads) -> blob, decode(blob, n, threads)."""

    name: str
    encode: Callable[[np.ndarray, int], object]
    decode: Callable[[object, int, int], np.ndarray]
    size: Callable[[object], int] = len
    thread_counts: tuple[int, ...] = (1,)
    slow_encode: bool = False


def _entropykit_coders(rans_precisions: list[int], tans_precisions: list[int]) -> list[Coder]:
    from entropykit import rans

    coders = [
        Coder(f"entropykit.rans p{p}",
              lambda s, t, p=p: rans.encode(s, precision=p, threads=t),
              lambda b, n, t: rans.decode(b, threads=t),
              thread_counts=(1, 2))
        for p in rans_precisions
    ]
    try:
        from entropykit import tans
        tans_encode, tans_decode = tans.encode, tans.decode
    except (ImportError, AttributeError) as e:
        print(f"entropykit.tans not available ({e!r}); skipping its rows", file=sys.stderr)
        return coders
    coders += [
        Coder(f"entropykit.tans p{p}",
              lambda s, t, p=p: tans_encode(s, precision=p, threads=t),
              lambda b, n, t: tans_decode(b, threads=t),
              thread_counts=(1, 2))
        for p in tans_precisions
    ]
    return coders


def _zstd_coders() -> list[Coder]:
    import zstandard

    def make(level: int) -> Coder:
        compressor = zstandard.ZstdCompressor(level=level)  # threads=0: one thread
        decompressor = zstandard.ZstdDecompressor()
        return Coder(f"zstd-{level}",
                     lambda s, t: compressor.compress(s.data),
                     lambda b, n, t: np.frombuffer(decompressor.decompress(b), np.uint8),
                     slow_encode=level >= 10)

    return [make(3), make(19)]


def _constriction_coder() -> Coder:
    """constriction's stack ANS (32-bit words) with one categorical model for the array.

    Encode = histogram + model + coding; decode = model from the same probabilities +
    decoding. The probabilities travel beside the compressed words and are not counted in
    the size (a file format would have to store them: up to 256 numbers).
    """
    import constriction

    model, stack = constriction.stream.model, constriction.stream.stack

    def encode(symbols: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        counts = np.bincount(symbols, minlength=1)
        p = counts / counts.sum()
        coder = stack.AnsCoder()
        coder.encode_reverse(symbols.astype(np.int32), model.Categorical(p, perfect=False))
        return coder.get_compressed(), p

    def decode(blob: tuple[np.ndarray, np.ndarray], n: int, threads: int) -> np.ndarray:
        words, p = blob
        return stack.AnsCoder(words).decode(model.Categorical(p, perfect=False), n)

    return Coder("constriction AnsCoder", encode, decode, size=lambda b: b[0].nbytes)


# ---------------------------------------------------------------- measuring


@dataclass
class Row:
    coder: str
    size: int = 0
    exact: bool = True
    speeds: dict[str, float] = field(default_factory=dict)  # "enc1" -> M symbols/s
    error: str = ""


def _timed(fn: Callable[[], object], reps: int) -> tuple[float, object]:
    """(median seconds of ``reps`` runs after a warm-up, warm-up result); reps=0: one run."""
    t0 = time.perf_counter()
    first = fn()
    if reps == 0:
        return time.perf_counter() - t0, first
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


def measure(coder: Coder, symbols: np.ndarray, reps: int) -> Row:
    """Size, round-trip exactness and throughput of one coder on one symbol array."""
    row = Row(coder.name)
    n = symbols.size
    try:
        blobs = []
        for threads in coder.thread_counts:
            enc_reps = 0 if coder.slow_encode else reps
            sec, blob = _timed(lambda t=threads: coder.encode(symbols, t), enc_reps)
            row.speeds[f"enc{threads}"] = n / sec / 1e6
            sec, back = _timed(lambda t=threads, b=blob: coder.decode(b, n, t), reps)
            row.speeds[f"dec{threads}"] = n / sec / 1e6
            row.exact &= bool(np.array_equal(np.asarray(back), symbols))
            blobs.append(blob)
        row.size = coder.size(blobs[0])
        # Same input and options must give the same bytes whatever the thread count.
        if any(b != blobs[0] for b in blobs[1:]):
            row.exact = False
            row.error = "output differs between thread counts"
    except Exception as e:  # a broken peer or a coder in progress is a row, not a crash
        row.error = f"{type(e).__name__}: {e}"[:120]
        row.exact = False
    return row


# ---------------------------------------------------------------- report


def _versions() -> str:
    import constriction
    import numba
    import zstandard

    import entropykit

    def dist(name: str) -> str:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version(name)
        except PackageNotFoundError:
            return getattr(sys.modules.get(name), "__version__", "?")

    commit = results_md.git_commit()
    parts = [f"entropykit {entropykit.__version__} (git {commit})",
             f"Python {platform.python_version()}", f"numpy {np.__version__}",
             f"numba {numba.__version__}", f"zstandard {zstandard.__version__}",
             f"constriction {dist(constriction.__name__)}"]
    return ", ".join(parts)


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def table(results: list[tuple[str, np.ndarray, float, list[Row]]]) -> str:
    """The markdown table of all rows, grouped by data set."""
    head = ("| data | coder | size (bytes) | bits/sym | vs H0 | enc M/s | dec M/s "
            "| enc 2T M/s | dec 2T M/s | exact |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for label, symbols, h0, rows in results:
        n = symbols.size
        for r in rows:
            if r.error and not r.size:
                lines.append(f"| {label} | {r.coder} | | | | | | | | error: {r.error} |")
                continue
            bps = 8 * r.size / n
            over = (bps / h0 - 1) * 100 if h0 > 0 else float("nan")
            sp = r.speeds
            exact = "yes" if r.exact else f"**NO** {r.error}".strip()
            lines.append(
                f"| {label} | {r.coder} | {r.size:,} | {bps:.4f} | {over:+.2f}% "
                f"| {_fmt(sp.get('enc1'))} | {_fmt(sp.get('dec1'))} | {_fmt(sp.get('enc2'))} "
                f"| {_fmt(sp.get('dec2'))} | {exact} |"
            )
    return "\n".join(lines)


def section(results: list, reps: int, load: tuple[float, float], elapsed: float) -> str:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    datasets = "\n".join(
        f"- **{label}**: {sym.size:,} symbols, order-0 entropy H0 = {h0:.4f} bits/symbol"
        for label, sym, h0, _ in results
    )
    return f"""{SECTION}

Produced by `python bench/bench_coders.py --write` on {date}.

- Machine: {results_md.cpu_model()}, {cores} cores available; load average {load[0]:.2f} before
  and {load[1]:.2f} after (other work on the machine makes throughput noisy).
- Software: {_versions()}.
- Run: {elapsed:.0f} s, median of {reps} timed runs after one warm-up run per measurement,
  except zstd-19 encode (timed by its single run).

{datasets}

Throughput is in millions of symbols per second, one thread unless the column says 2T.
"vs H0" is the coded size over n·H0/8 bytes: an order-0 coder cannot go below 0%, zstd can
where the data has repeats or context. entropykit sizes are whole frames (header, table,
chunk directory with CRC-32s); constriction's excludes its probability table; zstd's is its
frame. "exact" means the decoded array equals the input (and, for entropykit, that 1- and
2-thread encodes gave identical bytes).

{table(results)}
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5, help="timed runs per measurement (>= 1)")
    ap.add_argument("--precisions", default="11,12,14", help="rANS precisions, comma-separated")
    ap.add_argument("--tans-precisions", default="11,12", help="tANS table logs, comma-separated")
    ap.add_argument("--no-zstd19", action="store_true", help="skip zstd-19 (slow: ~1 min)")
    ap.add_argument("--write", action="store_true", help=f"replace {SECTION!r} in {RESULTS}")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    exponent, sign_mantissa = minilm_bf16_fields()
    datasets = [("MiniLM bf16 exponent", exponent),
                ("MiniLM bf16 sign+mantissa", sign_mantissa),
                ("Laplace(1) synthetic", synthetic_laplace())]
    coders = _entropykit_coders([int(p) for p in args.precisions.split(",")],
                                [int(p) for p in args.tans_precisions.split(",")])
    coders += [c for c in _zstd_coders() if not (args.no_zstd19 and c.name == "zstd-19")]
    coders.append(_constriction_coder())

    results = []
    for label, symbols in datasets:
        h0 = order0_entropy(symbols)
        rows = []
        for coder in coders:
            rows.append(measure(coder, symbols, args.reps))
            print(f"  {label}: {coder.name} done", file=sys.stderr, flush=True)
        results.append((label, symbols, h0, rows))

    text = section(results, args.reps, (load_before, os.getloadavg()[0]),
                   time.perf_counter() - t_start)
    print(text)
    if args.write:
        results_md.write_section(text, SECTION, RESULTS)
        print(f"wrote {SECTION!r} to {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
