"""Calibration time on SmolLM2-135M, this tree against another: the fits, or whole runs.

What it is, by default: builds the calibration features of a few (layer, k/v) groups
(FP8-of-target and no predictor, ``--seqs`` x 512 tokens of bench/data.py's "calib" prose) and times
``residual.fit_conditional`` of this tree and of ``--old``'s ``residual.py`` on the same
arrays, twice each in turn, as CPU seconds of this process (run it with one BLAS and torch
thread: ``OPENBLAS_NUM_THREADS=1``; the default), with the out-of-fold errors' Gaussian
code length per value (what the conditional std encodes) for each.
``--whole``: whole ``calibrate`` runs with the FP8-of-target predictor (bf16 and fp8 e4m3
fits, ``--seqs`` x ``--tokens`` calibration tokens), one per tree in a child process with
that tree first on its path (``--old``: the other tree's ``residual.py``, as above, its
``entropykit`` folder or the folder holding that: the package is all it needs; a failed
child's stderr is printed), timed as the child's CPU and wall seconds (split where the
forward passes end, for a tree whose ``calibrate`` reports its steps), for each of
``--whole-threads``' settings (N: BLAS, torch and the fits on N threads; ``default``: the
settings as they are, i.e. every core), with each file's bytes, and tabled with old / new
per setting; then this tree's codec
codes the first ``--eval`` x 512 tokens of the "eval" prose (bf16 cache and fp8 e4m3 with
one scale per layer and k/v, conditional model) with each tree's file of the first setting
and prints bits per value. ``--scaling``: ``fit_conditional`` CPU seconds on random
features of F columns and T tokens (F / 5 outputs, as a values group: 5 sources of kv
heads x head dim), the measured scaling behind the README's calibration-time guidance.
What it is not: a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
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


def _smollm2(split: str, seqs: int, tokens: int):
    """(model, [1, tokens] prompts of the split's prose)."""
    import transformers

    path = data.smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    ids = tok(data.prose_text(split), return_tensors="pt").input_ids[0]
    return model, [ids[i * tokens : (i + 1) * tokens][None] for i in range(seqs)]


def _predictor(model, name: str):
    """The predictor of a ``--predictor`` name: fp8-of-target, none or early-exit-K."""
    from entropykit import predictive as P

    if name == "none":
        return P.NoPredictor()
    if name.startswith("early-exit-"):
        return P.EarlyExitPredictor(model, int(name.rsplit("-", 1)[1]))
    return P.FP8Predictor(model)


def _calibrate_child(out: str, seqs: int, tokens: int, predictor: str) -> None:
    """Calibrate with the entropykit on the path; print its CPU seconds as JSON."""
    from entropykit import predictive as P

    model, prompts = _smollm2("calib", seqs, tokens)
    pred = _predictor(model, predictor)
    marks: dict[str, tuple[float, float]] = {}

    def progress(done: int, total: int) -> None:  # the forward passes end at len(prompts)
        if done == len(prompts):
            marks["forwards"] = time.process_time(), time.perf_counter()

    kw = {"progress": progress} if "progress" in P.calibrate.__code__.co_varnames else {}
    try:
        from entropykit.coding.parallel import resolve
        fit_threads = resolve(None) if "threads" in P.calibrate.__code__.co_varnames else 1
    except ImportError:  # a tree without the thread pool fits on one thread
        fit_threads = 1
    t, wall = time.process_time(), time.perf_counter()
    cal = P.calibrate(model, pred, prompts, **kw)
    end = time.process_time(), time.perf_counter()
    cpu, wall = end[0] - t, end[1] - wall
    cal.save(out)
    phases = {}
    if "forwards" in marks:  # a tree whose calibrate reports its steps
        fwd = marks["forwards"]
        phases = {"forwards_cpu_s": round(fwd[0] - t, 2),
                  "forwards_wall_s": round(wall - (end[1] - fwd[1]), 2),
                  "fits_cpu_s": round(end[0] - fwd[0], 2),
                  "fits_wall_s": round(end[1] - fwd[1], 2)}
    print(json.dumps({"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), **phases,
                      "fingerprint": hex(cal.fingerprint), "file_bytes": os.path.getsize(out),
                      "torch_threads": torch.get_num_threads(), "fit_threads": fit_threads,
                      "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                      "package": str(Path(P.__file__).resolve().parent.parent)}))


def _tree(old: Path) -> Path:
    """The folder to put on a child's path for ``--old``: given its ``residual.py``, its
    ``entropykit`` package or the folder holding that package (nothing else is needed:
    no bench/ or pyproject)."""
    old = old.resolve()
    if old.is_file():  # .../entropykit/predictive/residual.py
        return old.parent.parent.parent
    return old.parent if old.name == "entropykit" else old


def _run_child(name: str, tree: Path, threads: str, path: str,
               args: argparse.Namespace) -> dict | None:
    """One tree's whole ``calibrate`` in a child process: its JSON row, or None after
    printing why the child failed (its exit status and the tail of its stderr)."""
    # The tree first, ahead of whatever the caller's path holds (another entropykit too).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tree), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    if threads != "default":
        env |= {"OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
                "MKL_NUM_THREADS": threads, "ENTROPYKIT_THREADS": threads}
    cmd = [sys.executable, __file__, "--child", path, "--seqs", str(args.seqs),
           "--tokens", str(args.tokens), "--predictor", args.predictor,
           "--threads", "0" if threads == "default" else threads]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines()
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = "\n".join(out.stderr.strip().splitlines()[-40:])
    print(f"{name} threads {threads}: the child exited with status {out.returncode} "
          f"(PYTHONPATH={env['PYTHONPATH']}); its stderr ends:\n{tail}", flush=True)
    return None


def _whole(args: argparse.Namespace) -> None:
    from entropykit import predictive as P

    trees = {"new": Path(__file__).resolve().parent.parent, "old": _tree(args.old)}
    if not (trees["old"] / "entropykit" / "predictive" / "calibration.py").is_file():
        raise SystemExit(f"--old: no entropykit/predictive/calibration.py under {trees['old']}")
    files: dict[str, str] = {}
    rows: list[tuple[str, str, dict]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in args.whole_threads.split(","):
            for run, name in enumerate(("old", "new", "old", "new")[: 2 * args.runs]):
                path = str(Path(tmp) / f"{name}-{threads}-{run}.safetensors")
                row = _run_child(name, trees[name], threads, path, args)
                if row is None:
                    continue
                files.setdefault(name, path)  # the first good setting's file is coded below
                rows.append((name, threads, row))
                print(name, f"threads {threads}", json.dumps(row), flush=True)
        _table(rows)
        if len(files) < 2:
            raise SystemExit(f"no file of {sorted({'old', 'new'} - set(files))}: no bits")
        model, prompts = _smollm2("eval", args.eval, 512)
        pred = _predictor(model, args.predictor)
        cals = {name: P.Calibration.load(files[name]) for name in ("old", "new")}
        # What the fit does not touch (bias, std, empirical tables, layout) must be equal:
        # then the gaussian and mixture models code every cache to the same bytes.
        same = sorted(n for n in cals["old"].arrays if not n.startswith(("cstd", "cond",
                                                                          "cscale", "shapes")))
        # Flattened: a version-1 file holds them as [layers, 2, heads, dim], version 2 flat,
        # in the same order.
        differ = [n for n in same if not np.array_equal(cals["old"].arrays[n].reshape(-1),
                                                        cals["new"].arrays[n].reshape(-1))]
        print("fit-independent arrays", same, "differ:", differ, flush=True)
        bits: dict[str, dict[str, float]] = {}
        for name in ("old", "new"):
            size = {"bf16": 0, "fp8_e4m3": 0}
            values = 0
            for ids in prompts:
                with torch.inference_mode():
                    cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
                values += sum(t.numel() for t in cache.keys + cache.values)
                for fmt, c in (("bf16", cache), ("fp8_e4m3", P.to_fp8(cache))):
                    blob = P.compress_kv(c, ids, pred, cals[name])
                    assert P.decompress_kv(blob, pred, cals[name]).equal(c)
                    size[fmt] += len(blob)
            bits[name] = {f: round(8 * n / values, 4) for f, n in size.items()}
            print(name, "bits per value", json.dumps(bits[name]), "bytes", json.dumps(size),
                  flush=True)
        print("\n| tree | bf16 bits/value | fp8 e4m3 bits/value |\n|---|---:|---:|")
        for name, b in bits.items():
            print(f"| {name} | {b['bf16']:.4f} | {b['fp8_e4m3']:.4f} |", flush=True)


def _table(rows: list[tuple[str, str, dict]]) -> None:
    """The whole runs as a table: CPU and wall seconds per tree and thread setting, and
    old / new at each setting (the means of its runs)."""
    print("\n| tree | threads | fit threads | torch threads | CPU s | wall s | forwards "
          "CPU / wall s | fits CPU / wall s | file bytes | fingerprint |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for name, threads, r in rows:
        fwd, fits = (f"{r[f'{p}_cpu_s']:.2f} / {r[f'{p}_wall_s']:.2f}"
                     if f"{p}_cpu_s" in r else "" for p in ("forwards", "fits"))
        print(f"| {name} | {threads} | {r.get('fit_threads', '')} | {r['torch_threads']} "
              f"| {r['cpu_s']:.2f} | {r['wall_s']:.2f} | {fwd} | {fits} "
              f"| {r['file_bytes']:,} | {r['fingerprint']} |")
    for threads in dict.fromkeys(t for _, t, _ in rows):
        got = {name: [r for n, t, r in rows if n == name and t == threads]
               for name in ("old", "new")}
        mean = {name: [np.mean([r[k] for r in got[name]]) for k in ("cpu_s", "wall_s")]
                for name in got if got[name]}
        if len(mean) == 2:
            print(f"| old / new | {threads} | | | {mean['old'][0] / mean['new'][0]:.2f}x "
                  f"| {mean['old'][1] / mean['new'][1]:.2f}x | | | | |")
    print(flush=True)


def _scaling(args: argparse.Namespace) -> None:
    from entropykit.predictive import residual

    rng = np.random.default_rng(0)
    for spec in args.scaling.split(","):
        n_feat, tokens = map(int, spec.split("x"))
        feats = rng.standard_normal((tokens, n_feat)).astype(np.float32)
        feats[:, : n_feat // 2] += feats[:, n_feat // 2 :]  # correlated, as sources are
        target = (feats[:, : n_feat // 5] @ rng.standard_normal((n_feat // 5, n_feat // 5))
                  + 3 * rng.standard_normal((tokens, n_feat // 5))).astype(np.float32)
        t = time.process_time()
        residual.fit_conditional(feats, target)
        print(json.dumps({"F": n_feat, "T": tokens,
                          "cpu_s": round(time.process_time() - t, 3)}), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="another tree's residual.py (--whole: or its "
                    "entropykit folder, or the folder holding it)")
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="per sequence (--whole)")
    ap.add_argument("--groups", default="1:0,1:1,15:1,29:1", help="layer:kv,...")
    ap.add_argument("--threads", type=int, default=1, help="torch threads; 0: its default")
    ap.add_argument("--whole", action="store_true", help="whole calibrate runs, and bits")
    ap.add_argument("--runs", type=int, default=1, help="whole runs per tree (--whole)")
    ap.add_argument("--whole-threads", default="1",
                    help="--whole: thread settings, e.g. 1,default: N pins BLAS, torch and "
                         "the fits to N threads; default leaves every setting as it is")
    ap.add_argument("--predictor", default="fp8-of-target",
                    help="--whole: fp8-of-target, none or early-exit-K")
    ap.add_argument("--eval", type=int, default=2, help="--whole: 512-token eval sequences")
    ap.add_argument("--scaling", help="FxT,... fit times on random features")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.threads > 0:  # 0: torch's own default (the machine's cores)
        torch.set_num_threads(args.threads)
    if args.child:
        return _calibrate_child(args.child, args.seqs, args.tokens, args.predictor)
    if args.scaling:
        return _scaling(args)
    if args.old is None:
        ap.error("--old is required")
    if args.whole:
        return _whole(args)
    from entropykit import predictive as P
    from entropykit.predictive import residual

    fits = {"old": _old_fit(args.old, vars(residual)), "new": residual.fit_conditional}
    model, prompts = _smollm2("calib", args.seqs, 512)
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
