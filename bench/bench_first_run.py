"""First-run benchmark: what a fresh install pays to compile the kernels, and the warm-up.

What it is: three calls, each timed as a new process would run it (a subprocess, import
included): ``entropykit compress`` of MiniLM-L6 cast to bf16 (bench/data.py), ``load_file``
of its compressed file, and ``decompress_kv`` of the KV cache of a tiny random Llama
(timed alone, after ``compress_kv`` in the same process). Each is run cold (an empty Numba
cache: ``NUMBA_CACHE_DIR`` a new directory), then warm (the same cache again), then first
after ``python -m entropykit.warmup --jobs 2`` into another empty cache, then first on an
empty cache with the portable cache of ``python -m entropykit.warmup --portable --jobs 2``
(what a wheel or image built with it ships, read from the best tier this CPU runs;
background native compile off, so the run is all portable code); the warm-ups' own times
are reported too. For each: seconds, and the seconds spent compiling
(``entropykit._jit.compile_seconds``). ``--write`` replaces the "## First run" section of
bench/RESULTS.md.
What it is not: a test (tests/test_first_run.py bounds the cold start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import data  # noqa: E402
import results as results_md  # noqa: E402

from entropykit import _portable  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECTION = "## First run"

_COMPRESS = """
import json, sys, time
t0 = time.perf_counter()
from entropykit import _jit
from entropykit.cli import main
code = main(["compress", sys.argv[1], "-o", sys.argv[2], "--force"])
print(json.dumps({"seconds": time.perf_counter() - t0, "compile": _jit.compile_seconds()}))
"""

_LOAD = """
import json, sys, time
t0 = time.perf_counter()
import entropykit
from entropykit import _jit
entropykit.load_file(sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0, "compile": _jit.compile_seconds()}))
"""

_KV = """
import json, sys, time
from entropykit import _jit, predictive as P
from entropykit.warmup import tiny_kv, tiny_llama
model = tiny_llama(vocab=256, hidden=64, layers=3, heads=4, kv_heads=2, positions=256)
cache, ids, pred, cal = tiny_kv(model, seed=1, prompt_len=96, batch=2, tokens=40)
t0 = time.perf_counter()
blob = P.compress_kv(cache, ids, pred, cal)
t1 = time.perf_counter()
c1 = _jit.compile_seconds()
out = P.decompress_kv(blob, pred, cal)
t2 = time.perf_counter()
assert out.equal(cache)
print(json.dumps({"seconds": t2 - t1, "compile": _jit.compile_seconds() - c1,
                  "compress_kv": t1 - t0}))
"""


def _env(cache: Path, portable: Path | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "NUMBA_CACHE_DIR": str(cache),
            "ENTROPYKIT_PORTABLE_KERNELS": str(portable or ""),
            "ENTROPYKIT_BACKGROUND_COMPILE": "0"}


def _run(code: str, cache: Path, *args: str, portable: Path | None = None) -> dict:
    env = _env(cache, portable)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                       env=env, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"benchmark step failed:\n{r.stderr[-3000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    out["process"] = time.perf_counter() - t0
    return out


def _warmup(cache: Path, *extra: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "entropykit.warmup", "--quiet", "--jobs", "2",
                    *extra], check=True, env=_env(cache), cwd=REPO)
    return time.perf_counter() - t0


def measure(tmp: Path) -> dict:
    src = data.minilm_cast_path("BF16")
    ek = tmp / "minilm.bf16.ek.safetensors"
    steps = {"compress": (_COMPRESS, (str(src), str(ek))), "load_file": (_LOAD, (str(ek),)),
             "decompress_kv": (_KV, ())}
    res: dict = {"steps": {}}
    for name, (code, args) in steps.items():
        cache = tmp / f"cold-{name}"
        if name == "load_file":  # its input, written with a cache of its own
            _run(_COMPRESS, tmp / "prep", str(src), str(ek))
        cold = _run(code, cache, *args)
        warm = _run(code, cache, *args)
        res["steps"][name] = {"cold": cold, "warm": warm}
    res["warmup"] = _warmup(tmp / "warmup")
    res["warmup_portable"] = _warmup(tmp / "unused", "--portable", str(tmp / "portable"))
    for name, (code, args) in steps.items():
        res["steps"][name]["after_warmup"] = _run(code, tmp / "warmup", *args)
        res["steps"][name]["portable"] = _run(code, tmp / f"first-{name}", *args,
                                              portable=tmp / "portable")
    return res


def section(res: dict, load: tuple[float, float], seconds: float) -> str:
    rows = []
    for name, r in res["steps"].items():
        c, w, a, p = r["cold"], r["warm"], r["after_warmup"], r["portable"]
        timed = "call" if name == "decompress_kv" else "process"
        key = "seconds" if name == "decompress_kv" else "process"
        rows.append(f"| {name} ({timed}) | {c[key]:.1f} | {c['compile']:.1f} | {w[key]:.1f} "
                    f"| {a[key]:.1f} | {p[key]:.1f} | {p['compile']:.1f} "
                    f"| {p[key] - w[key]:+.1f} |")
    return "\n".join([
        SECTION, "",
        f"Produced by `python bench/bench_first_run.py --write` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
        f"- Machine: {results_md.cpu_model()}, {os.cpu_count()} cores available; load "
        f"average {load[0]:.2f} before and {load[1]:.2f} after (other work on the machine "
        f"makes times noisy).",
        f"- Software: entropykit (git {results_md.git_commit()}), Python "
        f"{platform.python_version()}, numpy {np.__version__}, numba {numba.__version__}.",
        f"- Run: {seconds:.0f} s. Each number is one run of a new process.", "",
        "compress: `entropykit compress` of MiniLM-L6 bf16 (45.4 MB), the whole process "
        "(import included). load_file: `load_file` of its compressed file, the whole process. "
        "decompress_kv: the call alone (after compress_kv in the same process), KV cache of a "
        "tiny random Llama (3 layers, 2 x 40 tokens), FP8 predictor, conditional model. "
        "cold: empty Numba cache; warm: the same cache again; after warm-up: first run after "
        "`python -m entropykit.warmup --jobs 2` into an empty cache; portable: first run on an "
        "empty Numba cache with the portable cache of `python -m entropykit.warmup --portable "
        f"--jobs 2`, its {_portable.host_tiers()[0].name} tier on this CPU (background native "
        "compile off); portable - warm: the first-run cost left. "
        "compiling: seconds spent compiling kernels in that run.", "",
        "| step | cold s | cold compiling s | warm s | after warm-up s | portable s "
        "| its compiling s | portable - warm s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows, "",
        f"Warm-ups (all parts, `--jobs 2`) into an empty cache: native "
        f"{res['warmup']:.1f} s, portable {res['warmup_portable']:.1f} s.", "",
    ])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="replace the RESULTS.md section")
    args = ap.parse_args()
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ek-first-run-") as tmp:
        res = measure(Path(tmp))
    text = section(res, (load0, os.getloadavg()[0]), time.perf_counter() - t0)
    print(text)
    print(json.dumps(res, indent=1), file=sys.stderr)
    if args.write:
        results_md.write_section(text, SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
