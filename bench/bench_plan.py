"""The GPU loader's host side, timed alone: no GPU, no torch.

What it is: for each compressed file, the time of ``container.cuda.fileplan.groups`` (the
host plan: reading and checking small field payloads and the heads of large ones, host
decodes, the kernel's descriptors and tables) and of the staging that follows it in
``load_file(device="cuda")`` (``_staging.Staging.of`` and ``fill`` into a host buffer,
which reads large payloads from the file; the loader fills pinned memory): their sum is
the host's part of a GPU load,
at each ``--threads`` count: best wall time and best process CPU time of ``--repeat`` runs
after one warm-up, the best CPU time until the first group is planned (where the device
can start), and the original MB/s. Files: MiniLM-L6 in BF16 compressed with the
default options (``--minilm``: a compressed file, or a plain one compressed here) and a
synthetic LLM-shaped BF16 file (``bench_threads.llm_path``: Llama-8B-shaped blocks, random
weights; ``--llm-layers``), compressed with the default options into the benchmark cache.
``--root DIR`` imports entropykit from another checkout (the plan before a change); the
compressed files are the same for both.
What it is not: a GPU benchmark (``gpu/hf_load_bench.py``, ``gpu/bench_gpu.py``).

    python bench/bench_plan.py --minilm M.ek.safetensors --llm-layers 1 --threads 1,2
    python bench/bench_plan.py --root /path/to/old/checkout --minilm M.ek.safetensors
"""

from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="import entropykit from this checkout")
    ap.add_argument("--minilm", help="MiniLM BF16 file, compressed or plain")
    ap.add_argument("--file", action="append", default=[], help="another compressed file")
    ap.add_argument("--llm-layers", type=int, default=1, help="blocks of the LLM file (0: none)")
    ap.add_argument("--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=5)
    return ap.parse_args()


def _compressed(src: Path) -> Path:
    """``src`` if compressed, else its default compression in the benchmark cache."""
    import entropykit
    from entropykit.container import reader, source

    with source.FileBytes(src) as f:
        if reader.is_compressed(reader.read_header(f), f):
            return src
    import data  # bench/data.py

    dst = data.cache_dir() / "plan" / f"{src.stem}.ek.safetensors"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        entropykit.compress_file(src, dst)
    return dst


def _time(fn, repeat: int) -> tuple[float, float]:  # noqa: ANN001
    fn()  # warm-up: Numba kernels loaded, file in the page cache
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return min(wall), min(cpu)


def main() -> int:
    args = _args()
    sys.path[:0] = [str(Path(args.root).resolve() if args.root else _HERE.parent), str(_HERE)]
    import numpy as np

    import entropykit
    from entropykit.container import source
    from entropykit.container.cuda import _staging, fileplan
    from entropykit.container.reader import Compressed

    paths = [Path(p) for p in args.file]
    if args.minilm:
        paths.insert(0, _compressed(Path(args.minilm)))
    if args.llm_layers:
        import bench_threads

        paths.append(_compressed(bench_threads.llm_path(args.llm_layers)))
    print(f"entropykit from {Path(entropykit.__file__).parent}; {platform.processor() or ''}"
          f" python {platform.python_version()}")
    print("| file | MB | tensors | threads | plan ms (wall / cpu) | first group ms (cpu) | "
          "plan MB/s | staging ms | groups |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for path in paths:
        for threads in [int(t) for t in args.threads.split(",")]:
            with source.FileBytes(path) as f:
                c = Compressed(f)
                mb = c.original.data_size / 1e6
                def plan(c: Compressed = c, threads: int = threads) -> list:
                    return list(fileplan.groups(c, threads))

                wall, cpu = _time(plan, args.repeat)

                def first(c: Compressed = c, threads: int = threads) -> None:
                    planned = fileplan.groups(c, threads)
                    next(planned)
                    planned.close()

                _, cpu1 = _time(first, args.repeat)
                gs = plan()
                hosts = []

                # Payloads staged from the file are read by ``fill`` (older trees: none).
                kw = {"src": c.source} if "src" in inspect.signature(
                    _staging.Staging.fill).parameters else {}

                def stage(gs: list = gs, hosts: list = hosts, threads: int = threads,
                          kw: dict = kw) -> None:
                    for k, g in enumerate(gs):
                        st = _staging.Staging.of(g)
                        if len(hosts) <= k or hosts[k].size < st.size:
                            hosts[k:k + 1] = [np.empty(st.size, np.uint8)]
                        st.fill(g, hosts[k], [p.batch.desc for p in g.parts], threads, **kw)

                swall, _ = _time(stage, args.repeat)
            print(f"| {path.name} | {mb:.0f} | {len(c.keys())} | {threads} | "
                  f"{wall * 1e3:.1f} / {cpu * 1e3:.1f} | {cpu1 * 1e3:.1f} | {mb / wall:.0f} | "
                  f"{swall * 1e3:.1f} | {len(gs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
