"""The GPU loader's fill, timed alone: a compressed file's groups into staging buffers.

What it is: for one compressed file, planned once (``container.cuda.fileplan.groups``),
the wall time of writing every group into ``SLOTS`` rotating host buffers as
``load_file(device="cuda")`` does (``_staging.Staging.of`` and ``fill``: large payloads
read from the file, the rest copied), at each ``--threads`` count, in three ways:

- ``read``: only the file reads the fill makes, all groups' together, one contiguous
  share per thread, threads started before the timing: what reading the page cache
  costs (the bound);
- ``fill, threads kept``: the loader's fill, its threads kept for every group
  (``_staging.Filler``), each group waited for before the next is submitted;
- ``fill, next one submitted first``: as the loader fills, each group's fill submitted
  before the one before is waited for;
- ``fill, threads per group``: threads started and joined for each group (with ``--root``
  of an older tree: its fill).

With ``--busy`` each is timed again while another thread runs Python (the planning
thread and transformers' threads hold the GIL during a real load): a fill that is
GIL-bound slows down there, a read-bound one does not. ``--pinned`` fills page-locked
buffers (``torch``, on a CUDA host) as the loader does; otherwise ordinary memory,
written once first so that page faults are not timed. Prints a short table: best of
``--repeat`` (the ways taking turns) after a warm-up, ms and GB/s of staged bytes.
What it is not: the copy to the GPU or the decode (``gpu/hf_load_bench.py``).

    python bench/bench_fill.py --llm-layers 1 --threads 1,4,16 --busy
    python bench/bench_fill.py --file M.ek.safetensors --pinned --threads 16
"""

from __future__ import annotations

import argparse
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", help="import entropykit from this checkout")
    ap.add_argument("--file", help="a compressed file (default: the LLM-shaped one)")
    ap.add_argument("--llm-layers", type=int, default=1, help="blocks of the LLM file")
    ap.add_argument("--threads", default="1,4,16", help="comma-separated thread counts")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--busy", action="store_true", help="also with a Python thread busy")
    ap.add_argument("--pinned", action="store_true", help="page-locked buffers (CUDA host)")
    return ap.parse_args()


class _Busy:
    """A thread running Python (holding the GIL but for the interpreter's switches)
    while the block runs; a no-op when not ``on``."""

    def __init__(self, on: bool) -> None:
        self.on, self._stop = on, threading.Event()

    def __enter__(self) -> _Busy:
        if self.on:
            self._t = threading.Thread(target=self._spin, daemon=True)
            self._t.start()
        return self

    def _spin(self) -> None:
        while not self._stop.is_set():
            sum(range(1000))

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self._stop.set()
            self._t.join()


class _Readers:
    """``n`` threads, started once, that run ``fn(n, k)`` (thread k) at each call."""

    def __init__(self, n: int, fn) -> None:  # noqa: ANN001
        self._go, self._done = threading.Barrier(n + 1), threading.Barrier(n + 1)
        self._stop = False
        self._threads = [threading.Thread(target=self._serve, args=(n, k, fn), daemon=True)
                         for k in range(n)]
        for t in self._threads:
            t.start()

    def _serve(self, n: int, k: int, fn) -> None:  # noqa: ANN001
        while True:
            self._go.wait()
            if self._stop:
                return
            fn(n, k)
            self._done.wait()

    def __call__(self) -> None:
        self._go.wait()
        self._done.wait()

    def close(self) -> None:
        self._stop = True
        self._go.wait()
        for t in self._threads:
            t.join()


def _buffer(n: int, pinned: bool):  # noqa: ANN202
    """``n`` bytes of host memory, page-locked or written once (faulted in)."""
    import numpy as np

    if pinned:
        import torch

        return torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return np.ones(n, np.uint8)


def rows(path: Path, threads: list[int], busy: bool, pinned: bool, repeat: int
         ) -> Iterator[str]:
    """The table's lines for compressed file ``path`` (header first, a summary last)."""
    import numpy as np

    from entropykit.container import source
    from entropykit.container.cuda import _staging, fileplan
    from entropykit.container.reader import Compressed

    slots = 3  # as the loader rotates them
    filler = getattr(_staging, "Filler", None)  # None: a tree before it
    yield "| threads | busy | way | ms | GB/s |"
    yield "| ---: | --- | --- | ---: | ---: |"
    with source.FileBytes(path) as f:
        c = Compressed(f)
        groups = list(fileplan.groups(c, 4))
        stagings = [_staging.Staging.of(g) for g in groups]
        hosts = [_buffer(max(st.size for st in stagings), pinned) for _ in range(slots)]
        staged = sum(st.size for st in stagings)
        ranges = sorted((int(at), int(part.batch.streams[k].data.size))
                        for g in groups for part in g.parts for k, at in part.files.tolist())
        starts = np.cumsum([0] + [n for _, n in ranges])
        read_total = int(starts[-1])
        dest = _buffer(read_total, pinned)

        def read_share(n: int, k: int) -> None:
            # Share k of n: contiguous ranges, into one buffer, no groups.
            cuts = np.searchsorted(starts[1:-1], np.arange(1, n) * read_total / n)
            for i in np.split(np.arange(len(ranges)), cuts)[k].tolist():
                at, size = ranges[i]
                for a in range(0, size, 64 << 20):
                    m = min(64 << 20, size - a)
                    f.readinto(at + a, [dest[starts[i] + a : starts[i] + a + m]])

        def fill(n: int, way: str) -> None:
            own = filler(n) if way != "per group" else None
            pending = None
            try:
                for k, (g, st) in enumerate(zip(groups, stagings, strict=True)):
                    got = st.fill(g, hosts[k % slots], [p.batch.desc for p in g.parts],
                                  own if own is not None else n, c.source)
                    if own is not None and way == "kept":
                        got.wait()
                    elif own is not None:  # as the loader: the next fill submitted first
                        if pending is not None:
                            pending.wait()
                        pending = got
                if pending is not None:
                    pending.wait()
            finally:
                if own is not None:
                    own.close()

        readers: dict[int, _Readers] = {}

        def read(n: int) -> None:
            if n not in readers:
                readers[n] = _Readers(n, read_share)
            readers[n]()

        ways = [("read", read, read_total)]
        if filler is not None:
            ways += [("fill, threads kept", lambda n: fill(n, "kept"), staged),
                     ("fill, next one submitted first", lambda n: fill(n, "ahead"), staged)]
        ways.append(("fill, threads per group", lambda n: fill(n, "per group"), staged))
        for n in threads:
            for hog in (False, True) if busy else (False,):
                best = [float("inf")] * len(ways)
                for _, fn, _ in ways:
                    fn(n)  # warm-up: the file in the page cache
                with _Busy(hog):
                    for _ in range(repeat):  # the ways in turn: the machine's drift shared
                        for k, (_, fn, _) in enumerate(ways):
                            t = time.perf_counter()
                            fn(n)
                            best[k] = min(best[k], time.perf_counter() - t)
                for (name, _, nbytes), b in zip(ways, best, strict=True):
                    yield (f"| {n} | {'yes' if hog else 'no'} | {name} | {b * 1e3:.1f} | "
                           f"{nbytes / b / 1e9:.2f} |")
        for r in readers.values():
            r.close()
    yield (f"{len(groups)} groups, {staged / 1e6:.0f} MB staged, {read_total / 1e6:.0f} MB "
           "of it read from the file")


def main() -> int:
    args = _args()
    sys.path[:0] = [str(Path(args.root).resolve() if args.root else _HERE.parent), str(_HERE)]
    import entropykit

    if args.file:
        path = Path(args.file)
    else:
        import bench_plan
        import bench_threads

        path = bench_plan._compressed(bench_threads.llm_path(args.llm_layers))
    print(f"entropykit from {Path(entropykit.__file__).parent}; {platform.processor() or ''}"
          f" python {platform.python_version()}; {path.name}")
    for line in rows(path, [int(t) for t in args.threads.split(",")], args.busy, args.pinned,
                     args.repeat):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
