"""Distributed checkpoints: entropykit's DCP storage against DCP's own writers.

What it measures, for N ranks (gloo on the CPU, ``torch.multiprocessing`` spawn), each
holding its ``Shard(0)`` part of every tensor as a DTensor (``DTensor.from_local``: no
collective moves the data):

- size: the checkpoint directory's bytes, against ``HuggingFaceStorageWriter`` (safetensors
  shards) and ``FileSystemWriter`` (``torch.save`` per rank);
- save and load seconds: rank 0's wall time from a barrier before ``dcp.save`` /
  ``dcp.load`` to a barrier after, median of ``--repeat`` after one untimed round per
  writer (kernel compiles, caches), into a page-cache directory
  (``--dir``, tmpfs by default) and with every rank's writes rate-limited (``--rate``
  bytes/s per rank): every stream a rank writes to sleeps in ``write`` until the rank's
  bytes written, this one included, are within ``rate x`` the time since its first write
  (DCP's writers through their ``fs`` extension point, entropykit's through the writes of
  each shard file's write-behind thread). Writes land in the
  page cache after the sleep, so the rate is the storage's. The sleep holds up the
  thread that writes, as a full device queue would: DCP's writer threads, or entropykit's
  write-behind thread (its coding threads go on until the writes queued and the segments
  in flight fill up).

Writers: ``ek``: ``CompressedStorageWriter`` as it comes (``fast=True``); ``ek-small``:
with ``fast=False`` (every codec tried, smallest shards); ``hf``:
``HuggingFaceStorageWriter(save_distributed=True)``; ``fs``: ``FileSystemWriter``.

States: ``model``: the MiniLM-L6 weights (real, trained; ``bench/data.py``) cast to bf16;
``optim``: fp32 AdamW state of those weights: the fp32 master weights plus ``exp_avg`` and
``exp_avg_sq`` after three AdamW steps on synthetic gradients (the moments are
synthetic). ``--synthetic`` uses an LLM-shaped random state instead (no download).

Run: ``python bench/bench_dcp.py --ranks 1 2`` (needs torch; prints a markdown table;
``--writers`` picks a subset, ``fs`` always runs: the ratios are to it).
What it is not: a test; nothing here checks values (tests/test_dcp.py does).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.filesystem import FileSystem

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import cpu_model  # noqa: E402

from entropykit.dcp import CompressedStorageReader, CompressedStorageWriter  # noqa: E402

WRITERS = ("ek", "ek-small", "hf", "fs")


class _Bucket:
    """One rank's write budget: ``rate`` bytes/s from its first write on, shared by every
    stream the rank writes (DCP's writer may write several files at once)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.sent, self.start = rate, 0, None
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            now = time.perf_counter()
            if self.start is None:
                self.start = now
            self.sent += n
            ahead = self.sent / self.rate - (now - self.start)
        if ahead > 0:
            time.sleep(ahead)


class _Throttled:
    """A write stream that sleeps before each write until ``bucket`` allows it."""

    def __init__(self, raw, bucket: _Bucket) -> None:
        self._raw, self._bucket = raw, bucket

    def write(self, b) -> int:
        self._bucket.take(memoryview(b).nbytes)
        return self._raw.write(b)

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class _ThrottledFS(FileSystem):
    def __init__(self, rate: float) -> None:
        super().__init__()
        self.bucket = _Bucket(rate)

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as s:
            yield _Throttled(s, self.bucket) if "w" in mode else s


class _ThrottledEK(CompressedStorageWriter):
    def __init__(self, path, rate: float, **kw) -> None:
        super().__init__(path, **kw)
        self.bucket = _Bucket(rate)

    @contextmanager
    def _shard_output(self, path):
        with super()._shard_output(path) as out:
            # Its write-behind thread's writes: the storage is what is slow, not the
            # hand-off of coded segments to that thread.
            real = getattr(out, "_write_all", None)
            if real is None:  # an older tree's writer thread writes through the file
                out._f = _Throttled(out._f, self.bucket)
                yield out
                return

            def throttled(bufs):
                self.bucket.take(sum(memoryview(b).nbytes for b in bufs))
                real(bufs)

            out._write_all = throttled
            yield out


def _state(kind: str, synthetic: bool) -> dict[str, torch.Tensor]:
    """The full state, the same on every rank."""
    if synthetic:
        g = torch.Generator().manual_seed(0)
        d, ff, layers, vocab = 512, 1536, 6, 16384
        weights = {"embed.weight": torch.randn(vocab, d, generator=g) * 0.02}
        for i in range(layers):
            for name, shape in (("q", (d, d)), ("k", (d, d)), ("v", (d, d)), ("o", (d, d)),
                                ("up", (ff, d)), ("gate", (ff, d)), ("down", (d, ff))):
                weights[f"layers.{i}.{name}.weight"] = torch.randn(shape, generator=g) * 0.02
            weights[f"layers.{i}.norm.weight"] = 1 + 0.05 * torch.randn(d, generator=g)
    else:
        import data
        from safetensors.torch import load_file

        weights = load_file(data.minilm_path())
    if kind == "model":
        return {k: v.to(torch.bfloat16) for k, v in weights.items()}
    params = [torch.nn.Parameter(v.float().clone()) for v in weights.values()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    out = {}
    for (k, _), p in zip(weights.items(), params, strict=True):
        out[f"{k}.master"] = p.detach()
        out[f"{k}.exp_avg"] = opt.state[p]["exp_avg"]
        out[f"{k}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"]
    return out


def _sharded(full: dict[str, torch.Tensor], mesh, rank: int, n: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for k, t in full.items():
        parts = torch.chunk(t, n, 0)
        local = parts[rank].contiguous() if rank < len(parts) else t.new_empty(
            (0, *t.shape[1:]))
        out[k] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                    shape=t.shape, stride=t.stride())
    return out


def _writer(name: str, path: Path, rate: float | None, threads: int):
    if name in ("ek", "ek-small"):
        kw = {"threads": threads, "fast": name == "ek"}
        return _ThrottledEK(path, rate, **kw) if rate else CompressedStorageWriter(path, **kw)
    if name == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        w = HuggingFaceStorageWriter(str(path), save_distributed=True)
    else:
        w = dcp.FileSystemWriter(path, thread_count=threads)
    if rate:
        w.fs = _ThrottledFS(rate)
    return w


def _reader(name: str, path: Path, threads: int):
    if name in ("ek", "ek-small"):
        return CompressedStorageReader(path, threads=threads)
    if name == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(str(path), thread_count=threads)
    return dcp.FileSystemReader(path)


def _timed(fn, *args, **kwargs) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t


def _worker(rank: int, n: int, args: argparse.Namespace, store: str, out: dict) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(1)
    threads = max(1, (os.cpu_count() or 1) // n)
    mesh = DeviceMesh("cpu", list(range(n)))
    warm: set[str] = set()
    for kind in args.states:
        full = _state(kind, args.synthetic)
        sd = _sharded(full, mesh, rank, n)
        target = _sharded({k: torch.zeros_like(v) for k, v in full.items()}, mesh, rank, n)
        del full
        for rate in (None, *([args.rate] if args.rate else [])):
            for name in args.writers:
                path = Path(args.dir) / f"{kind}-{name}-{n}"
                saves, loads = [], []
                # One untimed round per writer first: kernel compiles and cache loads.
                for _ in range(args.repeat + (name not in warm)):
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                    dist.barrier()
                    saves.append(_timed(dcp.save, sd,
                                        storage_writer=_writer(name, path, rate, threads)))
                    if rate is None:
                        loads.append(_timed(dcp.load, target,
                                            storage_reader=_reader(name, path, threads)))
                    if name not in warm:
                        warm.add(name)
                        saves, loads = [], []
                if rank == 0:
                    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
                    out[(kind, name, n, rate)] = (size, statistics.median(saves),
                                                  statistics.median(loads) if loads else None)
                    shutil.rmtree(path, ignore_errors=True)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--states", nargs="+", default=["model", "optim"],
                    choices=["model", "optim"])
    ap.add_argument("--rate", type=float, default=1e9, help="bytes/s per rank; 0: none")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--writers", nargs="+", default=list(WRITERS), choices=WRITERS)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--synthetic", action="store_true")
    args = ap.parse_args(argv)
    args.writers = [w for w in WRITERS if w in {*args.writers, "hf", "fs"}]
    args.dir = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    results: dict = mp.Manager().dict()
    try:
        for n in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(n, args, str(Path(tmp) / "store"), results),
                         nprocs=n, join=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, "
          f"{'synthetic' if args.synthetic else 'MiniLM-L6'} state, rate "
          f"{args.rate / 1e9:g} GB/s per rank, median of {args.repeat}")
    print("| state | ranks | writer | size MB | size / hf | save s | save / fs | load s | "
          f"load / fs | save s at {args.rate / 1e9:g} GB/s | / fs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kind in args.states:
        for n in args.ranks:
            hf = results[(kind, "hf", n, None)][0]
            fs = results[(kind, "fs", n, None)]
            slow_fs = results.get((kind, "fs", n, args.rate or None))
            for name in args.writers:
                size, save, load = results[(kind, name, n, None)]
                slow = results.get((kind, name, n, args.rate or None))
                slow_cells = (f"{slow[1]:.2f} | {slow[1] / slow_fs[1]:.2f}x" if slow
                              else "- | -")
                print(f"| {kind} | {n} | {name} | {size / 1e6:.1f} | {size / hf:.3f} | "
                      f"{save:.2f} | {save / fs[1]:.2f}x | {load:.2f} | "
                      f"{load / fs[2]:.2f}x | {slow_cells} |")


if __name__ == "__main__":
    main()
