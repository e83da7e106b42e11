"""Conditional-model fit time on SmolLM2-135M's real KV residuals, this tree against another.

What it is: builds the calibration features of a few (layer, k/v) groups (FP8-of-target and
no predictor, ``--seqs`` x 512 tokens of bench/data.py's "calib" prose) and times
``residual.fit_conditional`` of this tree and of ``--old``'s ``residual.py`` on the same
arrays, twice each in turn, as CPU seconds of this process (run it with one BLAS and torch
thread: ``OPENBLAS_NUM_THREADS=1``; the default), with the out-of-fold errors' Gaussian
code length per value (what the conditional std encodes) for each.
What it is not: a whole ``calibrate`` run, or a test.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402 - bench/ is a folder of scripts, not a package


def _old_fit(path: Path, namespace: dict):
    src = path.read_text()
    ns = dict(namespace)
    exec(src[src.index("def fit_conditional("):src.index("def fit_shape(")], ns)  # noqa: S102
    return ns["fit_conditional"]


def main(argv: list[str] | None = None) -> None:
    import transformers

    from entropykit import predictive as P
    from entropykit.predictive import residual

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, required=True, help="another tree's residual.py")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--groups", default="1:0,1:1,15:1,29:1", help="layer:kv,...")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fits = {"old": _old_fit(args.old, vars(residual)), "new": residual.fit_conditional}
    path = data.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    ids = tok(data.prose_text("calib"), return_tensors="pt").input_ids[0]
    prompts = [ids[i * 512 : (i + 1) * 512][None] for i in range(args.seqs)]
    groups = [tuple(map(int, g.split(":"))) for g in args.groups.split(",")]
    for name, pred in (("fp8-of-target", P.FP8Predictor(model)), ("none", P.NoPredictor())):
        xs: dict = {}
        ps: dict = {}
        for prompt in prompts:
            with torch.inference_mode():
                cache = P.from_transformers(model(prompt, use_cache=True).past_key_values)
            guess = pred.predict(prompt)
            for layer in range(len(cache.keys)):
                for kv in (0, 1):
                    x = cache.real(layer, kv).numpy()
                    p = (np.zeros(x.shape, np.float32) if guess is None
                         else guess[layer][kv].numpy())
                    xs.setdefault((layer, kv), []).append(x)
                    ps.setdefault((layer, kv), []).append(p)
        guesses = {k: np.concatenate(v, axis=2) for k, v in ps.items()}
        res = {}
        for k, v in xs.items():
            r = np.concatenate(v, axis=2) - guesses[k]
            res[k] = r - r.mean(axis=(0, 2))[None, :, None, :]
        for layer, kv in groups:
            feats = residual.features(res, guesses, layer, kv)
            r = res[(layer, kv)]
            target = r.transpose(0, 2, 1, 3).reshape(-1, r.shape[1] * r.shape[3])
            row = {"F": feats.shape[1], "T": feats.shape[0]}
            for run in ("old", "new", "old", "new"):
                t = time.process_time()
                _, oof = fits[run](feats, target)
                row.setdefault(f"{run}_cpu_s", []).append(round(time.process_time() - t, 3))
                err = (target - oof.astype(np.float32)).astype(np.float64)
                row[f"{run}_bits"] = round(float(
                    0.5 * np.log2((err**2).mean(axis=0) + 1e-30).mean()), 4)
            print(name, f"layer {layer} kv {kv}", json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
