"""KV-cache benchmark: the per-value-distribution coder, then predictive coding.

What it is: ``--part coder`` times entropykit's per-symbol-distribution rANS against
constriction's QuantizedGaussian on the same (symbols, mu, sigma) arrays, one thread, and
compares each coder's size with its own model's ideal code length. ``--part kv`` measures
bits per cached value of SmolLM2-135M's KV cache (bf16, and fp8 e4m3 with one scale per
layer and k/v) on natural-language prompts: byte-plane entropy, no predictor, FP8-of-target
and early exit at several k, each with the gaussian, mixture and conditional residual
models, calibrated and evaluated on disjoint text (bench/data.py's prose split).
``--write`` replaces the "## KV coder" / "## KV cache" section of
bench/RESULTS.md.
What it is not: a test; round trips are checked but correctness lives in tests/.

Data for the coder part (synthetic, seeded):
- "bf16 Gaussian": values x ~ N(mu, sigma) rounded to bf16, mu ~ N(0, 1), log sigma ~
  N(-2, 0.5): a KV-like spread (~7.6 bits/value); coded by entropykit only.
- "fp8 Gaussian": the same rounded to fp8 e4m3 (~3.6 bits/value); entropykit only.
- ", mixture model": the same values coded under the model ``compress_kv`` uses for
  "mixture" (0.95 N(s) + 0.03 N(3s) + 0.02 empirical, the empirical table being the data's
  own key histogram): every CDF evaluation then includes the empirical term.
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
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as results_md  # noqa: E402 - bench/ is a folder of scripts, not a package

SECTION = "## KV coder"
KV_SECTION = "## KV cache"
SEED = 20261122
SEQ = 512


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


def _mixture_model(values: np.ndarray):
    from entropykit.predictive import residual
    from entropykit.rans import distribution as dist

    bits, _ = dist.value_bits(values)
    keys = dist.value_keys(bits)
    emps = dist.empirical_table(np.bincount(keys, minlength=1 << (8 * bits.dtype.itemsize)))
    return residual.coder_model("mixture", None, emps[None])


def coder_rows(n: int, reps: int) -> list[dict]:
    import constriction
    import ml_dtypes

    from entropykit.rans import distribution as dist

    rng = np.random.default_rng(SEED)
    model = dist.gaussian_model()
    rows = []

    def ours(name: str, values: np.ndarray, mu: np.ndarray, sigma: np.ndarray,
             model: dist.CoderModel = model) -> None:
        te, blob = _timed(lambda: dist.encode(values, mu, sigma, model, threads=1), reps)
        td, out = _timed(lambda: dist.decode(blob, mu, sigma, model, threads=1), reps)
        bits = np.asarray(values).view(out.dtype).reshape(-1)
        ideal = dist.value_costs(values, mu, sigma, model).sum()
        rows.append(dict(data=name, coder="entropykit dist-rANS", bits=len(blob) * 8 / n,
                         ideal=ideal / n, enc=n / te / 1e6, dec=n / td / 1e6,
                         exact=np.array_equal(out, bits)))

    for name, dtype in (("bf16 Gaussian", ml_dtypes.bfloat16),
                        ("fp8 Gaussian", ml_dtypes.float8_e4m3fn)):
        data = _gaussian(n, dtype, rng)
        ours(name, *data)
        # The same values under the model the KV path codes with: the published mixture,
        # whose 2% empirical part (here the data's own key histogram) every CDF evaluates.
        ours(f"{name}, mixture model", *data, model=_mixture_model(data[0]))

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


def _best_rows(rounds: list[list[dict]]) -> list[dict]:
    """Each row's best and median speeds over rounds of every row in turn: this VM's host
    alternates between a fast phase and one ~35 % slower for seconds to minutes at a time
    (the same decode, same process: 25 then 16 M values/s), so a row measured in one
    stretch can land in a slow one. The best is the machine's speed; the median says how
    often the slow phase came."""
    best = [dict(r) for r in rounds[0]]
    for i, b in enumerate(best):
        for key in ("enc", "dec"):
            speeds = [rows[i][key] for rows in rounds]
            b[key], b[f"{key}_median"] = max(speeds), statistics.median(speeds)
        b["exact"] = all(rows[i]["exact"] for rows in rounds)
    return best


def coder_section(rows: list[dict], n: int, reps: int, load: tuple[float, float],
                  rounds: int = 1) -> str:
    from importlib.metadata import version

    import numba

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        SECTION, "",
        f"Produced by `python bench/bench_kv.py --part coder --write` on {now}.", "",
        f"- Machine: {results_md.cpu_model()}, {len(os.sched_getaffinity(0))} cores "
        f"available; load average {load[0]:.2f} before and {load[1]:.2f} after (other work "
        "on the machine makes throughput noisy).",
        f"- Software: entropykit (git {results_md.git_commit()}), numpy {np.__version__}, numba "
        f"{numba.__version__}, constriction {version('constriction')}.",
        f"- {n:,} values per row, one thread, best of {reps} timed runs after a warm-up, in "
        f"{rounds} rounds over all rows: the best round, and in parentheses the median "
        "round (this VM's host alternates between a fast phase and one ~35 % slower).",
        "- bits/value is the whole coded size (entropykit: frame with chunk directory and "
        "CRC-32s; constriction: its 32-bit words). \"ideal\" is each coder's own quantized "
        "model's code length, so bits - ideal is the coder's overhead.", "",
        "| data | coder | bits/value | ideal | overhead | enc M values/s (median) "
        "| dec M values/s (median) | exact |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        over = (r["bits"] / r["ideal"] - 1) * 100
        lines.append(f"| {r['data']} | {r['coder']} | {r['bits']:.4f} | {r['ideal']:.4f} | "
                     f"{over:+.2f}% | {r['enc']:.1f} ({r['enc_median']:.1f}) | "
                     f"{r['dec']:.1f} ({r['dec_median']:.1f}) | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- KV part


def _byte_plane_bits(caches: list) -> float:
    """Order-0 entropy of each byte plane per (layer, k/v) tensor, summed over the planes,
    in bits per value (histograms over all evaluated caches)."""
    import torch

    total, count = 0.0, 0
    for g in range(2 * len(caches[0].keys)):
        layer, kv = divmod(g, 2)
        data = np.concatenate([c.tensor(layer, kv).contiguous().view(torch.uint8).numpy()
                               .reshape(-1, c.tensor(layer, kv).element_size())
                               for c in caches])
        for plane in data.T:
            p = np.bincount(plane, minlength=256) / plane.size
            p = p[p > 0]
            total += float(-(p * np.log2(p)).sum()) * plane.size
        count += data.shape[0]
    return total / count


def _save_rows(path: Path, rows: list[dict]) -> None:
    plain = [{**r, "bits": [[f, k, v] for (f, k), v in r["bits"].items()]} for r in rows]
    path.write_text(json.dumps(plain, indent=1))


def _load_rows(path: Path | None) -> dict[str, dict]:
    if path is None or not path.exists():
        return {}
    rows = json.loads(path.read_text())
    return {r["predictor"]: {**r, "bits": {(f, k): v for f, k, v in r["bits"]}} for r in rows}


def smollm2_prose():
    """(SmolLM2-135M-Instruct in bf16, the token ids of the "calib" prose, those of the
    "eval" prose): bench/data.py's GGUF and text."""
    import data
    import torch
    import transformers

    path = data.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    return (model, tok(data.prose_text("calib"), return_tensors="pt").input_ids[0],
            tok(data.prose_text("eval"), return_tensors="pt").input_ids[0])


def kv_rows(n_calib: int, n_eval: int, exits: list[int], threads: int,
            rows_files: list[Path] = (), only: set[str] | None = None) -> dict:
    """Measure every predictor (or those named in ``only``). Rows found in ``rows_files``
    (JSON; same arguments assumed) are taken as measured; the first file receives each row
    this run finishes, so an interrupted run resumes, and runs measuring different
    predictors in parallel each write their own file and a last run joins them."""
    import torch

    from entropykit import predictive as P

    model, calib_ids, eval_ids = smollm2_prose()
    if calib_ids.numel() < n_calib * SEQ or eval_ids.numel() < n_eval * SEQ:
        raise SystemExit("not enough prose tokens for the requested sequences")
    calib = [calib_ids[i * SEQ : (i + 1) * SEQ] for i in range(n_calib)]
    evals = [eval_ids[i * SEQ : (i + 1) * SEQ][None] for i in range(n_eval)]
    caches = []
    for ids in evals:
        with torch.inference_mode():
            caches.append(P.from_transformers(model(ids, use_cache=True).past_key_values))
    fp8_caches = [P.to_fp8(c) for c in caches]
    values = sum(int(np.prod(sh)) for sh in caches[0].shapes if sh)
    out = {"model": model, "n_calib": n_calib, "n_eval": n_eval, "values": values,
           "byte_plane": {"bf16": _byte_plane_bits(caches), "fp8": _byte_plane_bits(fp8_caches)},
           "rows": []}
    predictors = [P.FP8Predictor(model)] + [P.EarlyExitPredictor(model, k) for k in exits]
    predictors.append(P.NoPredictor())
    done: dict[str, dict] = {}
    for f in rows_files:
        done |= _load_rows(f)
    for pred in predictors:
        if pred.describe() in done:  # measured by an earlier or a parallel run
            out["rows"].append(done[pred.describe()])
            continue
        if only is not None and pred.describe() not in only:
            continue
        t = time.perf_counter()
        cal = P.calibrate(model, pred, calib)
        t_cal = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as tmp:
            cal.save(Path(tmp) / "cal.safetensors")
            cal_bytes = (Path(tmp) / "cal.safetensors").stat().st_size
        row = {"predictor": pred.describe(), "flops": pred.flops_fraction(), "cal_s": t_cal,
               "cal_bytes": cal_bytes, "bits": {}, "exact": True, "enc_s": 0.0, "dec_s": 0.0}
        for fmt, cs in (("bf16", caches), ("fp8", fp8_caches)):
            for kind in P.KINDS:
                sizes = []
                for i, (ids, cache) in enumerate(zip(evals, cs, strict=True)):
                    t = time.perf_counter()
                    blob = P.compress_kv(cache, ids, pred, cal, model=kind, threads=threads)
                    t_enc = time.perf_counter() - t
                    sizes.append(len(blob))
                    if i == 0 and kind == "conditional":  # one exact round trip per setting
                        t = time.perf_counter()
                        back = P.decompress_kv(blob, pred, cal, threads=threads)
                        row["dec_s"] += time.perf_counter() - t
                        row["enc_s"] += t_enc
                        row["exact"] &= back.equal(cache)
                row["bits"][(fmt, kind)] = 8 * sum(sizes) / (values * len(evals))
        print(row["predictor"], {f"{k[0]}/{k[1]}": round(v, 3) for k, v in row["bits"].items()},
              file=sys.stderr, flush=True)
        out["rows"].append(row)
        if rows_files:
            _save_rows(rows_files[0], [r for r in out["rows"] if r["predictor"] not in done])
    return out


def kv_section(res: dict, load: tuple[float, float], elapsed: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cfg = res["model"].config
    lines = [
        KV_SECTION, "",
        f"Produced by `python bench/bench_kv.py --part kv --write` on {now} in "
        f"{elapsed / 60:.0f} min.", "",
        f"- Target: SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16; {cfg.num_hidden_layers} "
        f"layers, {cfg.num_key_value_heads} KV heads of {cfg.head_dim}), CPU.",
        f"- Prompts: {res['n_eval']} evaluation sequences of {SEQ} tokens from bench/data.py's "
        f"\"eval\" prose; calibration on {res['n_calib']} sequences of {SEQ} tokens of the "
        "disjoint \"calib\" prose.",
        f"- {res['values']:,} cached values per sequence. Sizes are whole `compress_kv` blobs "
        "(header, token ids, 60 frames with CRC-32s), in bits per cached value.",
        "- fp8 caches: e4m3 with one scale per layer and k/v (max |x| / 448), coded as e4m3 "
        "values (8 bits raw).",
        "- Residual models: gaussian (per-channel std), mixture (0.95 N(s) + 0.03 N(3s) + 0.02 "
        "empirical: the published baseline), conditional (ours: mean conditioned on the "
        "previous layer's decoded residuals and this layer's guesses, learned shape; "
        "`entropykit/predictive/residual.py`).",
        "- Predictor FLOPs: Linear-layer FLOPs per token over the target's (FP8-of-target "
        "runs the same matmuls on fp8-rounded weights).",
        f"- Load average {load[0]:.2f} before, {load[1]:.2f} after.", "",
        f"Byte-plane entropy (order-0 per byte plane and tensor): bf16 "
        f"{res['byte_plane']['bf16']:.3f}, fp8 {res['byte_plane']['fp8']:.3f} bits/value.", "",
        "| predictor | FLOPs | bf16 gaussian | bf16 mixture | bf16 conditional | "
        "conditional - mixture | fp8 gaussian | fp8 mixture | fp8 conditional | "
        "conditional - mixture | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["rows"]:
        b = r["bits"]
        cells = [r["predictor"], f"{r['flops']:.2f}"]
        for fmt in ("bf16", "fp8"):
            cells += [f"{b[(fmt, k)]:.3f}" for k in ("gaussian", "mixture", "conditional")]
            cells.append(f"{b[(fmt, 'conditional')] - b[(fmt, 'mixture')]:+.3f}")
        cells.append("yes" if r["exact"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Calibration and whole-cache codec time (one thread for the coder; the "
              "predictor and target use torch's threads):", "",
              "| predictor | calibrate s | calibration file MB | compress_kv s/seq | "
              "decompress_kv s/seq |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['predictor']} | {r['cal_s']:.0f} | {r['cal_bytes'] / 1e6:.1f} | "
                     f"{r['enc_s'] / 2:.2f} | {r['dec_s'] / 2:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["coder", "kv"], default="coder")
    ap.add_argument("--n", type=int, default=1 << 20, help="values per coder row")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3,
                    help="coder part: measure every row this many times, in turn; keep the best")
    ap.add_argument("--calib", type=int, default=32, help="calibration sequences (kv part)")
    ap.add_argument("--eval", type=int, default=16, help="evaluation sequences (kv part)")
    ap.add_argument("--exits", type=str, default="4,10,20", help="early-exit layers k")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=Path, nargs="*",
                    help="kv part: JSON files of finished rows (the first receives new ones)")
    ap.add_argument("--predictors", help="kv part: measure only these (e.g. none,early-exit-20)")
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    if args.part == "coder":
        rows = _best_rows([coder_rows(args.n, args.reps) for _ in range(args.rounds)])
        text = coder_section(rows, args.n, args.reps, (load0, os.getloadavg()[0]),
                             args.rounds)
        section = SECTION
    else:
        res = kv_rows(args.calib, args.eval, [int(k) for k in args.exits.split(",") if k],
                      args.threads, args.rows or [],
                      set(args.predictors.split(",")) if args.predictors else None)
        text = kv_section(res, (load0, os.getloadavg()[0]), time.perf_counter() - t0)
        section = KV_SECTION
    print(text)
    if args.write:
        results_md.write_section(text, section)


if __name__ == "__main__":
    main()
