"""One thread's decode, side by side with zstd-3: in memory and file to file, two trees.

What it is: for each file — MiniLM-L6 BF16 (``--minilm``: plain or compressed, 45 MB) and
the synthetic LLM-shaped BF16 file of ``bench_threads.py`` (``--llm-layers`` blocks) —
the MB/s of the original size, at ``--threads`` (1 by default), of

- zstd level 3 decompress, one thread, in memory, tensor by tensor;
- entropykit's default and ``--fast`` files decoded in memory (``Compressed.restored``:
  every segment decoded into one buffer, no file), ``load_file`` on the CPU (the tensors,
  needs torch) and ``decompress_file`` (file to file, page cache);

best wall time and best process CPU time of ``--reps`` runs after one warm-up. Each tree
of ``--root`` (default: this checkout) is measured in its own process, the trees taking
turns for ``--rounds`` rounds, so a before / after comparison shares the machine's state;
every restored file is compared with the original. The compressed files are made once,
by the first tree, and decoded by every tree.
What it is not: a thread-scaling curve (``bench_threads.py``) or a peer comparison.

    python bench/bench_decode.py --minilm M.ek.safetensors --llm-layers 1
    python bench/bench_decode.py --minilm M --root OLD,. --rounds 3   # before / after
    python bench/bench_decode.py --minilm M --threads 1,16
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

_HERE = Path(__file__).resolve().parent
MB = 1e6


def _best(fn, reps: int, before=None) -> tuple[float, float]:  # noqa: ANN001
    """(best wall s, best process CPU s) of ``reps`` runs after one warm-up."""
    walls, cpus = [], []
    for _ in range(reps + 1):
        if before is not None:
            before()
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(walls[1:]), min(cpus[1:])


def measure(files: dict, threads: list[int], reps: int, tmp: Path) -> dict:
    """One tree's rates (this process's entropykit): {file: {op: {threads: (wall, cpu)}}}."""
    import filecmp

    import bench_threads
    import numpy as np
    import zstandard

    import entropykit
    from entropykit.container.reader import Compressed

    try:
        import torch  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    out: dict = {}
    back = tmp / f"back.{os.getpid()}.safetensors"
    for name, (plain, default, fast) in files.items():
        size = Path(plain).stat().st_size
        rows: dict = {}
        parts = bench_threads._tensors(Path(plain))
        dctx = zstandard.ZstdDecompressor()
        packed = [zstandard.ZstdCompressor(level=3).compress(p) for p in parts]
        rows["zstd-3 decompress, in memory"] = {1: _best(
            lambda dctx=dctx, packed=packed: [dctx.decompress(p) for p in packed], reps)}
        del packed, parts
        for mode, path in (("default", default), ("--fast", fast)):
            buf = np.fromfile(path, np.uint8)
            mem, load, dec = {}, {}, {}
            for n in threads:
                mem[n] = _best(lambda n=n, buf=buf: Compressed(buf).restored(n), reps)
                if has_torch:
                    load[n] = _best(lambda n=n, path=path: entropykit.load_file(path, threads=n),
                                    reps)
                dec[n] = _best(lambda n=n, path=path: entropykit.decompress_file(path, back,
                                                                                 threads=n),
                               reps, lambda: back.unlink(missing_ok=True))
                if not filecmp.cmp(back, plain, shallow=False):
                    raise SystemExit(f"{name} {mode}: restored file differs")
                back.unlink()
            ref = np.fromfile(plain, np.uint8)
            if not np.array_equal(Compressed(buf).restored(1), ref):
                raise SystemExit(f"{name} {mode}: decoded bytes differ")
            del ref, buf
            rows[f"{mode}: decode in memory"] = mem
            if has_torch:
                rows[f"{mode}: load_file (CPU)"] = load
            rows[f"{mode}: decompress_file"] = dec
        out[name] = {"size": size, "rows": rows}
    return out


def _child(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(Path(args.child).resolve()), str(_HERE)]
    res = measure(json.loads(args.files), [int(t) for t in args.threads.split(",")],
                  args.reps, Path(args.tmp))
    import entropykit

    res["_tree"] = {"root": args.child, "module": entropykit.__file__}
    print(json.dumps(res))


def _prepare(args: argparse.Namespace, root: Path, tmp: Path) -> dict:
    """{name: (plain, default, fast)}: the plain files, and both compressed by ``root``."""
    sys.path[:0] = [str(root), str(_HERE)]
    import bench_threads

    import entropykit

    files = {}
    if args.minilm:
        src = Path(args.minilm)
        with open(src, "rb") as f:
            head = f.read(int.from_bytes(f.read(8), "little"))
        if b"entropykit" in head:
            plain = tmp / "minilm_bf16.safetensors"
            entropykit.decompress_file(src, plain, threads=1)
        else:
            plain = src
        files["MiniLM-L6 BF16"] = plain
    if args.llm_layers:
        files[f"LLM-shaped BF16 ({args.llm_layers} Llama-8B-shaped blocks)"] = \
            bench_threads.llm_path(args.llm_layers)
    made = {}
    for i, (name, plain) in enumerate(files.items()):
        paths = [str(plain)]
        for fast in (False, True):
            dst = tmp / f"f{i}.{'fast' if fast else 'default'}.ek.safetensors"
            entropykit.compress_file(plain, dst, fast=fast, threads=os.cpu_count() or 1)
            paths.append(str(dst))
        made[name] = paths
    return made


def _table(results: list[dict], roots: list[str], threads: list[int]) -> str:
    lines = []
    names = [k for k in results[0] if not k.startswith("_")]
    for name in names:
        size = results[0][name]["size"]
        lines.append(f"\n{name}, {size / MB:.1f} MB: MB/s of the original size, best wall "
                     "(best process CPU) of each round, rounds in order")
        head = "| operation | threads | " + " | ".join(roots) + " |"
        lines += [head, "| --- | ---: |" + " --- |" * len(roots)]
        for op in results[0][name]["rows"]:
            for n in (threads if "zstd" not in op else [1]):
                cells = []
                for root in roots:
                    got = [r[name]["rows"][op][str(n)] for r in results
                           if r["_tree"]["root"] == root]
                    cells.append(", ".join(f"{size / w / MB:,.0f} ({size / c / MB:,.0f})"
                                           for w, c in got))
                lines.append(f"| {op} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minilm", help="MiniLM BF16 safetensors, plain or compressed")
    ap.add_argument("--llm-layers", type=int, default=0, help="blocks of the LLM-shaped "
                    "file (0: none)")
    ap.add_argument("--threads", default="1", help="comma-separated counts")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per cell (best)")
    ap.add_argument("--rounds", type=int, default=1, help="turns of every tree")
    ap.add_argument("--root", default=str(_HERE.parent),
                    help="comma-separated checkouts to import entropykit from, in turn")
    ap.add_argument("--tmp", help="directory for the files (default: a temporary one)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--files", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args)
        return 0
    roots = [str(Path(r).resolve()) for r in args.root.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), "") if os.path.exists("/proc/cpuinfo") \
        else platform.processor()
    print(f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs; Python "
          f"{platform.python_version()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
          f"; load before {os.getloadavg()[0]:.2f}; NUMBA_CPU_NAME="
          f"{os.environ.get('NUMBA_CPU_NAME', '')} NUMBA_CPU_FEATURES="
          f"{os.environ.get('NUMBA_CPU_FEATURES', '')}")
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        files = _prepare(args, Path(roots[0]), Path(tmp))
        results = []
        for _ in range(args.rounds):
            for root in roots:
                # the tree first, then whatever the caller's path held (site folders)
                path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
                got = subprocess.run(
                    [sys.executable, __file__, "--child", root, "--files", json.dumps(files),
                     "--threads", args.threads, "--reps", str(args.reps), "--tmp", tmp],
                    env=dict(os.environ, PYTHONPATH=path), capture_output=True, text=True)
                if got.returncode:
                    sys.stderr.write(got.stderr)
                    raise SystemExit(f"the run of {root} failed (exit {got.returncode})")
                results.append(json.loads(got.stdout.strip().splitlines()[-1]))
        print(_table(results, roots, threads))
    print(f"\nload after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
