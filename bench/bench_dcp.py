"""Distributed checkpoints: entropykit's DCP storage against DCP's own writers.

What it measures, for N ranks (gloo on the CPU, ``torch.multiprocessing`` spawn), each
holding its ``Shard(0)`` part of every tensor as a DTensor (``DTensor.from_local``: no
collective moves the data):

- size: the checkpoint directory's bytes, against ``HuggingFaceStorageWriter`` (safetensors
  shards; saved once, untimed, for its size unless ``hf`` is among ``--writers``) and
  ``FileSystemWriter`` (``torch.save`` per rank);
- save and load seconds: rank 0's wall time from a barrier before ``dcp.save`` /
  ``dcp.load`` to a barrier after; one untimed round of every writer first (kernel
  compiles, caches), then ``--repeat`` rounds in which the writers take turns (each round
  saves and loads with every writer before the next round begins, so a change in the
  machine's load reaches all of them alike). Reported: the median and the spread (least
  to most) of the rounds, and the ratio of medians to ``fs``; ``save CPU`` is rank 0's
  process CPU seconds (every thread) during its save, and ``busy`` that over the save's
  wall time: how many cores the rank kept busy; ``in write_data`` / ``in read_data``:
  rank 0's seconds in the storage's own ``write_data`` / ``read_data`` (the rest of a
  save or load is DCP's planning, collectives and the coordinator's ``finish``);
- into a page-cache directory (``--dir``, tmpfs by default; it holds one checkpoint at a
  time), and with every rank's writes
  rate-limited (``--rate`` bytes/s per rank, ``0``: not run). The limit is a token bucket
  per rank (``_Bucket``), shared by every stream the rank writes, applied to the write
  calls that hand bytes to the file system, the same way for both kinds of writer: a
  write first sleeps until the rank's bytes written so far, its own included, are within
  ``rate x`` the time since the rank's first write, then writes to the page cache. DCP's
  writers get it through their ``fs`` extension point (``FileSystem.create_stream``: each
  of the writer's files), entropykit's through the writes of each shard file's
  write-behind thread (the storage's writes, not the hand-off of coded data to that
  thread). The sleep holds up the thread that writes, as a full device queue would:
  DCP's writer threads, or entropykit's write-behind threads (its coding threads go on
  until the write queue fills).

Writers: ``ek``: ``CompressedStorageWriter`` as it comes (``fast=True``); ``ek-small``:
with ``fast=False`` (every codec tried, smallest shards); ``hf``:
``HuggingFaceStorageWriter(save_distributed=True)``; ``fs``: ``FileSystemWriter`` (always
run: the ratios are to it). Threads per rank: cores / ranks, for ek's coding and fs's
``thread_count``.

States: ``model``: bf16 weights; ``optim``: fp32 AdamW state of those weights: the fp32
master weights plus ``exp_avg`` and ``exp_avg_sq`` after three AdamW steps on synthetic
gradients (the moments are synthetic). By default the weights are MiniLM-L6's (real,
trained; ``bench/data.py``); ``--synthetic``: an LLM-shaped random state instead (no
download), each rank generating only its own rows; ``--mb-per-rank M`` (with
``--synthetic``) sets its number of layers so that every rank holds about M MB of each
state (the fixed costs of a save then weigh less than with the default's 58 / 346 MB in
all).

Run: ``python bench/bench_dcp.py --synthetic --ranks 1 2 --repeat 3 --writers ek fs``
(needs torch; prints a markdown table).
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


# The synthetic state's shape: an LLM's embedding, then layers of attention and MLP.
_D, _FF, _VOCAB, _LAYERS = 512, 1536, 16384, 6
_LAYER_PARAMS = 4 * _D * _D + 3 * _FF * _D + _D


def _shapes(layers: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"embed.weight": (_VOCAB, _D)}
    for i in range(layers):
        for name, shape in (("q", (_D, _D)), ("k", (_D, _D)), ("v", (_D, _D)),
                            ("o", (_D, _D)), ("up", (_FF, _D)), ("gate", (_FF, _D)),
                            ("down", (_D, _FF)), ("norm", (_D,))):
            out[f"layers.{i}.{name}.weight"] = shape
    return out


def _layers(kind: str, mb_per_rank: float | None, n: int) -> int:
    """Layers of the synthetic state: the default's, or enough for ``mb_per_rank`` MB of
    ``kind`` per rank (2 bytes a parameter for bf16 weights, 12 for fp32 AdamW state)."""
    if mb_per_rank is None:
        return _LAYERS
    params = mb_per_rank * 1e6 * n / (2 if kind == "model" else 12)
    return max(1, round((params - _VOCAB * _D) / _LAYER_PARAMS))


def _rows(size: int, rank: int, n: int) -> tuple[int, int]:
    """The rows of a dimension of ``size`` that ``Shard(0)`` gives ``rank`` (as
    ``torch.chunk``: ceil(size / n) each, the last ranks fewer or none)."""
    step = -(-size // n)
    return min(size, rank * step), min(size, (rank + 1) * step)


def _weights(synthetic: bool, layers: int, rank: int, n: int) -> tuple[dict, dict]:
    """This rank's rows of every weight (fp32) and the weights' full shapes."""
    if not synthetic:
        import data
        from safetensors.torch import load_file

        full = load_file(data.minilm_path())
        shapes = {k: tuple(v.shape) for k, v in full.items()}
        return {k: v[slice(*_rows(v.shape[0], rank, n))].float().contiguous()
                for k, v in full.items()}, shapes
    shapes = _shapes(layers)
    out = {}
    for i, (k, shape) in enumerate(shapes.items()):
        lo, hi = _rows(shape[0], rank, n)
        g = torch.Generator().manual_seed(i * 1009 + rank)
        x = torch.randn((hi - lo, *shape[1:]), generator=g)
        out[k] = 1 + 0.05 * x if k.endswith("norm.weight") else x * 0.02
    return out, shapes


def _state(kind: str, weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """A rank's part of ``kind`` (local tensors) from its rows of the weights. AdamW is
    elementwise: its steps on a rank's rows are those rows of the steps on the whole."""
    if kind == "model":
        return {k: v.to(torch.bfloat16) for k, v in weights.items()}
    params = [torch.nn.Parameter(v.clone()) for v in weights.values()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()
    out = {}
    for k, p in zip(weights, params, strict=True):
        out[f"{k}.master"] = p.detach()
        out[f"{k}.exp_avg"] = opt.state[p]["exp_avg"]
        out[f"{k}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"]
    return out


def _dtensors(local: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], mesh
              ) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for k, t in local.items():
        shape = torch.Size(shapes[k.rsplit(".", 1)[0]] if k not in shapes else shapes[k])
        out[k] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=shape,
                                    stride=torch.empty(shape, device="meta").stride())
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


def _clocked(storage, method: str, into: list[float]):
    """``storage`` with its ``method`` (``write_data`` / ``read_data``: the rank's own data,
    without DCP's planning and collectives) timed into ``into``."""
    real = getattr(storage, method)

    def clocked(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)  # both writers' futures are done on return
        finally:
            into.append(time.perf_counter() - t)

    setattr(storage, method, clocked)
    return storage


def _timed(fn, *args, **kwargs) -> tuple[float, float]:
    """Wall seconds between barriers around ``fn``, and this process's CPU seconds."""
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    fn(*args, **kwargs)
    c = time.process_time() - c
    dist.barrier()
    return time.perf_counter() - t, c


def _worker(rank: int, n: int, args: argparse.Namespace, store: str, out: dict) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n,
                            timeout=datetime.timedelta(minutes=30))
    torch.set_num_threads(1)
    threads = max(1, (os.cpu_count() or 1) // n)
    mesh = DeviceMesh("cpu", list(range(n)))
    rates = (None, *([args.rate] if args.rate else []))
    for kind in args.states:
        weights, shapes = _weights(args.synthetic, _layers(kind, args.mb_per_rank, n), rank, n)
        local = _state(kind, weights, rank)
        del weights
        sd = _dtensors(local, shapes, mesh)
        target = _dtensors({k: torch.zeros_like(v) for k, v in local.items()}, shapes, mesh)
        del local
        times: dict = {}
        sizes: dict = {}
        for r in range(args.repeat + 1):  # round 0: untimed (compiles, caches)
            for rate in rates:
                for name in args.writers:
                    path = Path(args.dir) / f"{kind}-{name}-{n}"
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                    dist.barrier()
                    inner: list[float] = []
                    save = _timed(dcp.save, sd, storage_writer=_clocked(
                        _writer(name, path, rate, threads), "write_data", inner))
                    load = None if rate else _timed(dcp.load, target, storage_reader=_clocked(
                        _reader(name, path, threads), "read_data", inner))[0]
                    if rank == 0:  # every rank is past the barrier after its load
                        if rate is None:
                            sizes[name] = sum(p.stat().st_size for p in path.rglob("*")
                                              if p.is_file())
                        shutil.rmtree(path)  # one checkpoint in --dir at a time
                    if r:
                        times.setdefault((name, rate), []).append((*save, load, *inner))
        if "hf" not in args.writers:  # the size reference, untimed
            path = Path(args.dir) / f"{kind}-hf-{n}"
            dcp.save(sd, storage_writer=_writer("hf", path, None, threads))
            dist.barrier()
            if rank == 0:
                sizes["hf"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        if rank == 0:
            shutil.rmtree(Path(args.dir), ignore_errors=True)
            Path(args.dir).mkdir()
            per_rank = sum(v.to_local().numel() * v.to_local().element_size()
                           for v in sd.values())
            for (name, rate), rows in times.items():
                out[(kind, name, n, rate)] = (sizes[name], sizes["hf"], per_rank, rows)
        dist.barrier()
    dist.destroy_process_group()


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


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
    ap.add_argument("--mb-per-rank", type=float, default=None,
                    help="with --synthetic: about this many MB of each state per rank")
    args = ap.parse_args(argv)
    if args.mb_per_rank is not None and not args.synthetic:
        ap.error("--mb-per-rank needs --synthetic")
    args.writers = [w for w in WRITERS if w in {*args.writers, "fs"}]
    args.dir = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    results: dict = mp.Manager().dict()
    try:
        for n in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(n, args, str(Path(tmp) / "store"), results),
                         nprocs=n, join=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    rate = args.rate or None
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, "
          f"{'synthetic' if args.synthetic else 'MiniLM-L6'} state, writers taking turns "
          f"in each of {args.repeat} rounds: median [least-most] seconds"
          + (f"; rate-limited: {args.rate / 1e9:g} GB/s per rank (token bucket in the "
             f"write path of every writer)" if rate else ""))
    print("| state | ranks | writer | MB per rank | size / hf | save s | save / fs | "
          "save CPU s | busy | in write_data | load s | load / fs | in read_data |"
          + (f" save s at {args.rate / 1e9:g} GB/s | / fs |" if rate else ""))
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
          + ("---:|---:|" if rate else ""))
    for kind in args.states:
        for n in args.ranks:
            fs = results[(kind, "fs", n, None)][3]
            fs_save = statistics.median(x[0] for x in fs)
            fs_load = statistics.median(x[2] for x in fs)
            for name in args.writers:
                size, hf, per_rank, rows = results[(kind, name, n, None)]
                save = [x[0] for x in rows]
                cpu = statistics.median(x[1] for x in rows)
                load = [x[2] for x in rows]
                writes = statistics.median(x[3] for x in rows)
                reads = statistics.median(x[4] for x in rows)
                line = (f"| {kind} | {n} | {name} | {per_rank / 1e6:.0f} | {size / hf:.3f} | "
                        f"{_spread(save)} | {statistics.median(save) / fs_save:.2f}x | "
                        f"{cpu:.2f} | {cpu / statistics.median(save):.1f} | {writes:.3f} | "
                        f"{_spread(load)} | {statistics.median(load) / fs_load:.2f}x | "
                        f"{reads:.3f} |")
                if rate:
                    slow = [x[0] for x in results[(kind, name, n, rate)][3]]
                    slow_fs = statistics.median(x[0] for x in results[(kind, "fs", n, rate)][3])
                    line += f" {_spread(slow)} | {statistics.median(slow) / slow_fs:.2f}x |"
                print(line)


if __name__ == "__main__":
    main()
