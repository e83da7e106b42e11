"""Device check of the GPU loader's speed on LLM-shaped blocks, and of its fill alone.

What it is: the Llama-8B-shaped bf16 blocks of ``bench/bench_threads.py`` (random weights;
``--layers``, default 2: 872 MB) compressed with the default options and for the GPU
(into the benchmark cache), loaded with ``entropykit.load_file(ek, device)`` and
``safetensors.torch.load_file(original, device)`` alternately, ``--repeat`` times (best
of each; every compressed load checked bit for bit against the original once); the
loader's host accounting of its best load (``container.cuda.load.load``'s ``seconds``);
then ``bench/bench_fill.py``'s table on page-locked buffers (the fill alone at 1, 4 and
16 threads, with and without another thread running Python): a fill near the ``read``
row is bound by reading the page cache, one that slows down with the busy thread by the
GIL. ``--root DIR`` imports entropykit from another checkout (the tree before a change),
on the same files. Short, grep-able output.
What it is not: ``from_pretrained`` (``hf_load_bench.py``) or a test.

    python3 gpu/fill_check.py [--root OLD_CHECKOUT] [--layers 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="import entropykit from this checkout")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", default="1,4,16", help="the fill table's thread counts")
    ap.add_argument("--no-fill", action="store_true", help="leave the fill table out")
    args = ap.parse_args()
    sys.path[:0] = [str(Path(args.root).resolve() if args.root else _ROOT), str(_ROOT / "bench")]
    import bench_fill
    import bench_threads
    import data
    import safetensors.torch
    import torch

    import entropykit
    from entropykit.coding.parallel import resolve
    from entropykit.container import source
    from entropykit.container.cuda import load
    from entropykit.container.reader import Compressed
    from entropykit.dtypes import torch_types

    dev = args.device
    orig = bench_threads.llm_path(args.layers)
    files = {}
    for target in ("cpu", "gpu"):
        files[target] = data.cache_dir() / "fill" / f"{orig.stem}.{target}.ek.safetensors"
        if not files[target].is_file():
            files[target].parent.mkdir(parents=True, exist_ok=True)
            entropykit.compress_file(orig, files[target], target=target)
    print(f"entropykit from {Path(entropykit.__file__).parent}; {torch.cuda.get_device_name(dev)}"
          f"; {platform.processor() or ''} python {platform.python_version()}; threads "
          f"{resolve(None)}; {orig.name} {orig.stat().st_size / 1e6:.0f} MB, compressed "
          + ", ".join(f"{t} {p.stat().st_size / 1e6:.0f} MB" for t, p in files.items()))

    def timed(fn):  # noqa: ANN001, ANN202
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t, out

    plain = safetensors.torch.load_file(orig)  # the reference, on the host
    for ek in files.values():
        got = entropykit.load_file(ek, device=dev)
        if list(got) != list(plain) or not all(
                torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                            plain[k].reshape(-1).view(torch.uint8)) for k in plain):
            raise SystemExit(f"{ek.name}: the GPU load differs from the original")
        del got
    best = {"plain": float("inf"), **{t: float("inf") for t in files}}
    for _ in range(args.repeat):
        dt, out = timed(lambda: safetensors.torch.load_file(orig, device=dev))
        best["plain"] = min(best["plain"], dt)
        del out
        for target, ek in files.items():
            dt, out = timed(lambda ek=ek: entropykit.load_file(ek, device=dev))
            best[target] = min(best[target], dt)
            del out
    print("| load onto the GPU | s | plain / this |")
    print("| --- | ---: | ---: |")
    print(f"| safetensors.torch.load_file | {best['plain']:.3f} | 1.00x |")
    for target in files:
        print(f"| entropykit.load_file, {target} file | {best[target]:.3f} | "
              f"{best['plain'] / best[target]:.2f}x |")
    for target, ek in files.items():
        runs = []
        for _ in range(3):
            seconds: dict[str, float] = {}
            with source.FileBytes(ek) as f:
                dt, out = timed(lambda f=f, seconds=seconds: load.load(
                    Compressed(f), dev, torch_types(), resolve(None), seconds=seconds))
            del out
            runs.append(dict(seconds, total=dt))
        host = min(runs, key=lambda r: r["total"])
        print(f"loader host ms, {target} file: "
              + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in host.items()))
    if not args.no_fill:
        for line in bench_fill.rows(files["cpu"], [int(t) for t in args.threads.split(",")],
                                    True, True, 3):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
