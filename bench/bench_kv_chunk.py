"""KV chunk benchmark: bits per value of chunked blobs against whole-prompt blobs.

What it is: a cache coded as chunks of ``--chunk`` tokens (``compress_kv_chunk``, each
decoded alone given the prefix ids, the chunks concatenated and compared bit for bit
with the cache) against the same cache as one ``compress_kv`` blob, in bits per cached
value, bf16 and fp8 e4m3. ``--model smollm2``: SmolLM2-135M-Instruct (bench/data.py's
GGUF) on the "eval" prose, calibrated on the disjoint "calib" prose; ``--model tiny``: a
tiny random Llama (no download) on random ids. Prints a Markdown section; ``--write``
puts it in bench/RESULTS.md ("## KV chunked coding, <model>").
What it is not: a test; correctness lives in tests/test_kv_chunk.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as results_md  # noqa: E402 - bench/ is a folder of scripts, not a package

SECTION = "## KV chunked coding, {model}"


def _smollm2(n_calib: int, n_eval: int, seq: int):
    from bench_kv import smollm2_prose

    model, calib_ids, eval_ids = smollm2_prose()
    calib = [calib_ids[i * 512 : (i + 1) * 512] for i in range(n_calib)]
    evals = [eval_ids[i * seq : (i + 1) * seq][None] for i in range(n_eval)]
    if any(e.shape[1] < seq for e in evals):
        raise SystemExit("not enough prose tokens for the requested sequences")
    return model, calib, evals


def _tiny(n_calib: int, n_eval: int, seq: int):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * seq)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    calib = [torch.randint(0, 256, (512,), generator=gen) for _ in range(n_calib)]
    evals = [torch.randint(0, 256, (1, seq), generator=gen) for _ in range(n_eval)]
    return model, calib, evals


def rows(model, calib, evals, predictors: list[str], chunk: int, threads: int) -> list[dict]:
    import torch

    from entropykit import predictive as P

    make = {"none": P.NoPredictor, "fp8-of-target": lambda: P.FP8Predictor(model)}
    out = []
    for name in predictors:
        pred = (P.EarlyExitPredictor(model, int(name.rsplit("-", 1)[1]))
                if name.startswith("early-exit-") else make[name]())
        t = time.perf_counter()
        cal = P.calibrate(model, pred, calib, progress=False)
        row = {"predictor": pred.describe(), "cal_s": time.perf_counter() - t, "bits": {},
               "exact": True, "chunk_s": 0.0, "whole_s": 0.0}
        for fmt in ("bf16", "fp8"):
            whole = chunked = values = 0
            for ids in evals:
                with torch.inference_mode():
                    cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
                cache = P.to_fp8(cache) if fmt == "fp8" else cache
                values += sum(int(torch.tensor(sh).prod()) for sh in cache.shapes if sh)
                t = time.perf_counter()
                whole += len(P.compress_kv(cache, ids, pred, cal, threads=threads))
                row["whole_s"] += time.perf_counter() - t
                bounds = [*range(0, ids.shape[1], chunk), ids.shape[1]]
                parts = []
                t = time.perf_counter()
                for a, b in zip(bounds[:-1], bounds[1:], strict=True):
                    blob = P.compress_kv_chunk(P.slice_kv(cache, a, b), ids[:, :b], pred, cal,
                                               start=a, threads=threads)
                    chunked += len(blob)
                    parts.append(P.decompress_kv_chunk(blob, ids[:, :a], pred, cal,
                                                       threads=threads))
                row["chunk_s"] += time.perf_counter() - t
                row["exact"] &= P.concat_kv(parts).equal(cache)
            row["bits"][fmt] = (8 * whole / values, 8 * chunked / values)
        print(row, file=sys.stderr, flush=True)
        out.append(row)
    return out


def section(args, res: list[dict], values: int, load: tuple[float, float],
            elapsed: float) -> str:
    import numpy
    import torch

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    target = ("SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16; 30 layers, 3 KV heads "
              "of 64) on bench/data.py's \"eval\" prose, calibrated on "
              f"{args.calib} x 512 tokens of the disjoint \"calib\" prose"
              if args.model == "smollm2" else
              f"a tiny random Llama (4 layers, 2 KV heads of 16) on random ids, calibrated on "
              f"{args.calib} x 512 random tokens")
    lines = [
        SECTION.format(model=args.model), "",
        f"`python bench/bench_kv_chunk.py --model {args.model} --calib {args.calib} --eval "
        f"{args.eval} --seq {args.seq} --chunk {args.chunk} --predictors "
        f"{','.join(args.predictors)}` on {now}, {elapsed / 60:.0f} min; "
        f"{platform.machine()}, {results_md.cpu_model()}, {os.cpu_count()} CPUs (shared: "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after); torch {torch.__version__}, "
        f"numpy {numpy.__version__}; commit {results_md.git_commit()}.", "",
        f"Target: {target}. {args.eval} sequences of {args.seq} tokens ({values:,} cached "
        f"values each), conditional residual model. Whole: one `compress_kv` blob a "
        f"sequence. Chunked: `compress_kv_chunk` blobs of tokens [0, {args.chunk}), "
        f"[{args.chunk}, {2 * args.chunk}), ..., each decoded alone by "
        "`decompress_kv_chunk` given the prefix ids; exact: the decoded chunks concatenated "
        "equal the cache bit for bit. Bits per cached value, all bytes of the blobs "
        "counted.", "",
        "| predictor | bf16 whole | bf16 chunked | chunked - whole | fp8 whole | fp8 chunked "
        "| chunked - whole | exact |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res:
        cells = [r["predictor"]]
        for fmt in ("bf16", "fp8"):
            w, c = r["bits"][fmt]
            cells += [f"{w:.3f}", f"{c:.3f}", f"{c - w:+.3f}"]
        cells.append("yes" if r["exact"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="tiny")
    ap.add_argument("--calib", type=int, default=2, help="calibration sequences of 512")
    ap.add_argument("--eval", type=int, default=2, help="evaluation sequences")
    ap.add_argument("--seq", type=int, default=1024, help="tokens an evaluation sequence")
    ap.add_argument("--chunk", type=int, default=256, help="tokens a chunk")
    ap.add_argument("--predictors", type=lambda s: s.split(","), default=["none"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    model, calib, evals = (_smollm2 if args.model == "smollm2" else _tiny)(
        args.calib, args.eval, args.seq)
    cfg = model.config
    values = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.hidden_size // cfg.num_attention_heads) * args.seq
    res = rows(model, calib, evals, args.predictors, args.chunk, args.threads)
    text = section(args, res, values, (load0, os.getloadavg()[0]), time.perf_counter() - t0)
    print(text)
    if args.write:
        results_md.write_section(text, SECTION.format(model=args.model))


if __name__ == "__main__":
    main()
