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
  time), and with every rank's writes rate-limited (``--rate``: one or more rates in
  bytes/s per rank; ``0``: not run). The limit (``_Bucket``) models one storage device
  per rank that moves ``rate`` bytes/s, shared by every stream the rank writes, charged
  in the calls that hand bytes to the file system, the same way for both kinds of
  writer: a write of n bytes queues behind the bytes already handed to the device and
  sleeps until the device would be done with it (n / rate after the device is free),
  then writes to the page cache. Idle time is not banked (a device with nothing to do
  while the writer codes cannot catch up later). DCP's writers get it through their
  ``fs`` extension point (``FileSystem.create_stream``: each of the writer's files),
  entropykit's through the ``writev`` calls of each shard file's write-behind thread
  (the storage's writes, not the hand-off of coded data to that thread). The sleep holds
  up the thread that writes, as a full device queue would: DCP's writer threads, or
  entropykit's write-behind threads (its coding threads go on until the write queue
  fills). Both writers always write through the bucket (unlimited in the page-cache
  runs), so the two modes run the same code. Before the runs the script prints the
  least time the rate-limited saves can take (their bytes at the rates), and after each
  state's untimed round what that round took, so a run's length is known early;
- ``--phases``: rank 0's save time by phase (seconds summed over the threads that spend
  them): planning and collectives (the save less ``write_data`` and ``finish``), and of
  those the part before rank 0's ``write_data`` and rank 0's wait for the last rank's
  ``write_data`` to end (from every rank's start and end on the host's clock; with the
  slowest rank's ``write_data``), the planner's data resolution, entropykit's coding
  (wall with a file open, and the coding threads' CPU), the coding threads' waits for a
  full write queue, the writes themselves, the bucket's sleeps, a file's close
  (entropykit: the writer thread's tail, fsync, rename), fsync, ``finish`` (metadata).
- ``--gil`` (instead of the above): one rank's save on one coding thread under
  ``gil.GilProfile``, the share of its CPU that holds the GIL and where.
- ``--small-files N`` (instead of the above): N small files written one after another
  through ``output_file`` (as a rank's shard files: no sweep, into ``--dir``), each of a
  few bytes and of 64 kB: wall and process CPU (every thread) per file, the least of
  ``--repeat`` runs, and the threads started during them.

Writers: ``ek``: ``CompressedStorageWriter`` as it comes (``fast=True``); ``ek-fast``:
the same with the container's ``fast`` codec policy instead of its checkpoint policy
(rANS, contexts, zstd trials: the writer's coding before that policy); ``ek-small``:
with ``fast=False`` (every codec tried, smallest shards); ``hf``:
``HuggingFaceStorageWriter(save_distributed=True)``; ``fs``: ``FileSystemWriter`` (always
run: the ratios are to it). Threads per rank: cores / ranks, for ek's coding and fs's
``thread_count`` (``--ek-threads N``: ek's coding threads instead, e.g. to find where a
rank's coding stops scaling: its threads share one GIL).

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
import math
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

WRITERS = ("ek", "ek-fast", "ek-small", "hf", "fs")
_EK = ("ek", "ek-fast", "ek-small")  # entropykit's writers


class _Bucket:
    """One rank's storage: a device that moves ``rate`` bytes/s, shared by every stream
    the rank writes (DCP's writer writes several files at once, entropykit a write-behind
    thread per file). A write of n bytes queues behind the bytes already handed to the
    device and takes n / rate: the caller sleeps until ``free``, the time the device is
    done with everything handed to it so far, its own bytes included. Idle time is not
    banked: a device that had nothing to do while the writer was busy (coding, or
    serializing) cannot make up for it later, so a writer that writes in bursts gets no
    credit a steady one does not. ``rate`` None: no limit (the counts are kept)."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.sent, self.free, self.slept = rate, 0, 0.0, 0.0
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        with self.lock:
            self.sent += n
            if not self.rate:
                return
            now = time.perf_counter()
            self.free = max(self.free, now) + n / self.rate
            ahead = self.free - now
            self.slept += ahead
        _PHASES.add("rate-limit sleep", ahead)
        time.sleep(ahead)


class _Phases:
    """Seconds per phase of this process's saves (``--phases``): summed over the threads
    that spend them, so phases that overlap can add up to more than the wall time."""

    def __init__(self) -> None:
        self.on = False
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        if self.on:
            with self.lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        with self.lock:
            out, self.seconds = self.seconds, {}
        return out

    def timing(self, phase: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(phase, time.perf_counter() - t)
        return timed


_PHASES = _Phases()


class _Throttled:
    """A write stream whose writes go through ``bucket`` first."""

    def __init__(self, raw, bucket: _Bucket) -> None:
        self._raw, self._bucket = raw, bucket

    def write(self, b) -> int:
        self._bucket.take(memoryview(b).nbytes)
        t = time.perf_counter()
        n = self._raw.write(b)
        _PHASES.add("writes", time.perf_counter() - t)
        return n

    def __getattr__(self, name: str):
        return getattr(self._raw, name)


class _ThrottledFS(FileSystem):
    """DCP's file system with every written stream through a ``_Bucket``."""

    def __init__(self, rate: float | None) -> None:
        super().__init__()
        self.bucket = _Bucket(rate)

    @contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as s:
            yield _Throttled(s, self.bucket) if "w" in mode else s


class _ThrottledEK(CompressedStorageWriter):
    """entropykit's writer with every shard file's storage writes through a ``_Bucket``."""

    def __init__(self, path, rate: float | None, **kw) -> None:
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
                t = time.perf_counter()
                real(bufs)
                _PHASES.add("writes", time.perf_counter() - t)

            out._write_all = throttled
            t = time.perf_counter()
            yield out
            _PHASES.add("coding (file open)", time.perf_counter() - t)
            t = time.perf_counter()
        # The block's exit: the writer thread's tail, fsync, rename.
        _PHASES.add("close: drain + fsync + rename", time.perf_counter() - t)


class _ThrottledEKFast(_ThrottledEK):
    """``ek`` with the container's ``fast`` policy in place of the checkpoint policy (the
    writer's codecs before it had a policy of its own), to compare the two in one run:
    the writers take turns, so the swap during ``write_data`` reaches no other save."""

    def write_data(self, plan, planner):
        from entropykit.container import codecs

        policy = codecs.CHECKPOINT
        codecs.CHECKPOINT = codecs.FAST
        try:
            return super().write_data(plan, planner)
        finally:
            codecs.CHECKPOINT = policy


def _instrument() -> None:
    """Clock the phases of a save that both writers share or that entropykit's own
    functions mark (``--phases``): the planner's data resolution, fsync, the storage's
    ``finish`` (metadata), the coding threads' CPU and their waits for the writer thread."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    import entropykit.dcp as ekdcp
    from entropykit.container import _atomic

    _PHASES.on = True
    DefaultSavePlanner.resolve_data = _PHASES.timing("resolve data",
                                                     DefaultSavePlanner.resolve_data)
    os.fsync = _PHASES.timing("fsync", os.fsync)
    os.fdatasync = _PHASES.timing("writeback fdatasync (background)", os.fdatasync)
    _atomic._OutputFile._wait = _PHASES.timing("coding waits for writer",
                                               _atomic._OutputFile._wait)
    real = ekdcp.write

    def write(*args, **kwargs):
        c = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            _PHASES.add("coding CPU (coding threads)", time.thread_time() - c)

    ekdcp.write = write
    for cls in (CompressedStorageWriter, dcp.FileSystemWriter):
        cls.finish = _PHASES.timing("finish (metadata)", cls.finish)


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


def _writer(name: str, path: Path, rate: float | None, threads: int,
            ek_threads: int | None = None):
    """Writer ``name``; its storage writes always go through a ``_Bucket`` (of ``rate``,
    or unlimited), so that both kinds of writer run the same write path in both modes.
    ``ek_threads``: entropykit's coding threads, where not ``threads``."""
    if name in _EK:
        cls = _ThrottledEKFast if name == "ek-fast" else _ThrottledEK
        return cls(path, rate, threads=ek_threads or threads, fast=name != "ek-small")
    if name == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        w = HuggingFaceStorageWriter(str(path), save_distributed=True)
    else:
        w = dcp.FileSystemWriter(path, thread_count=threads)
    w.fs = _ThrottledFS(rate)
    return w


def _reader(name: str, path: Path, threads: int):
    if name in _EK:
        return CompressedStorageReader(path, threads=threads)
    if name == "hf":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(str(path), thread_count=threads)
    return dcp.FileSystemReader(path)


def _clocked(storage, method: str, into: list[float], spans: list | None = None):
    """``storage`` with its ``method`` (``write_data`` / ``read_data``: the rank's own data,
    without DCP's planning and collectives) timed into ``into``; its start and end on the
    host's clock (comparable between the ranks of one host) into ``spans``."""
    real = getattr(storage, method)

    def clocked(*args, **kwargs):
        t, w = time.perf_counter(), time.time()
        try:
            return real(*args, **kwargs)  # both writers' futures are done on return
        finally:
            into.append(time.perf_counter() - t)
            if spans is not None:
                spans.append((w, time.time()))

    setattr(storage, method, clocked)
    return storage


def _timed(fn, *args, began: list | None = None, **kwargs) -> tuple[float, float]:
    """Wall seconds between barriers around ``fn``, and this process's CPU seconds; the
    start on the host's clock into ``began``."""
    dist.barrier()
    if began is not None:
        began.append(time.time())
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
    if args.phases:
        _instrument()
    threads = max(1, (os.cpu_count() or 1) // n)
    mesh = DeviceMesh("cpu", list(range(n)))
    rates = (None, *args.rates)
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
            began = time.perf_counter()
            for rate in rates:
                for name in args.writers:
                    path = Path(args.dir) / f"{kind}-{name}-{n}"
                    if rank == 0:
                        shutil.rmtree(path, ignore_errors=True)
                    dist.barrier()
                    _PHASES.take()
                    inner: list[float] = []
                    spans: list = []
                    started: list[float] = []
                    save = _timed(dcp.save, sd, storage_writer=_clocked(
                        _writer(name, path, rate, threads, args.ek_threads), "write_data",
                        inner, spans), began=started)
                    phases = _PHASES.take()
                    if args.phases:
                        phases.update(_rank_waits(started[0], spans[0], n))
                    load = None if rate else _timed(dcp.load, target, storage_reader=_clocked(
                        _reader(name, path, threads), "read_data", inner))[0]
                    if rank == 0:  # every rank is past the barrier after its load
                        if rate is None:
                            sizes[name] = sum(p.stat().st_size for p in path.rglob("*")
                                              if p.is_file())
                        shutil.rmtree(path)  # one checkpoint in --dir at a time
                    if r:
                        times.setdefault((name, rate), []).append(
                            {"save": save[0], "cpu": save[1], "load": load,
                             "write_data": inner[0], "read_data": inner[-1],
                             "phases": phases})
            if r == 0 and rank == 0:
                took = time.perf_counter() - began
                print(f"# {kind}, {n} ranks: the untimed round took {took:.1f} s; "
                      f"{args.repeat} more: about {args.repeat * took:.0f} s", flush=True)
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


def _rank_waits(began: float, span: tuple[float, float], n: int) -> dict[str, float]:
    """What of rank 0's "planning and collectives" is waiting (``--phases``), from every
    rank's ``write_data`` start and end (``span``, host clock; a collective, after the
    timed save): the time from the save's start to rank 0's ``write_data`` (its planning
    and the plan's collectives), and how much later than rank 0's the last rank's
    ``write_data`` ended (rank 0 waits that long for the others' results before
    ``finish``); also the slowest rank's ``write_data``."""
    spans = [span] * n
    if n > 1:
        dist.all_gather_object(spans, span)
    if dist.get_rank():
        return {}
    return {"before write_data": span[0] - began,
            "waits for the last rank's write_data": max(0.0, max(e for _, e in spans) - span[1]),
            "slowest rank's write_data": max(e - b for b, e in spans)}


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"


def _state_bytes(args: argparse.Namespace, kind: str, n: int) -> float:
    """Bytes of ``kind`` a rank holds (about: rows split evenly)."""
    if not args.synthetic:
        return (45.4e6 if kind == "model" else 272.6e6) / n
    params = sum(math.prod(s) for s in _shapes(_layers(kind, args.mb_per_rank, n)).values())
    return params * (2 if kind == "model" else 12) / n


# Output over input, about, for the floor of a rate-limited save's time (``_plan``).
_RATIO = {w: {"model": 0.66, "optim": 0.82} for w in _EK}


def _plan(args: argparse.Namespace) -> float:
    """The least time the rate-limited saves can take: every round's bytes through the
    bucket (everything else a run does comes on top: startup, states, page-cache saves
    and loads; each state's untimed round prints what it took)."""
    return sum((args.repeat + 1) * _state_bytes(args, kind, n) * _RATIO.get(w, {}).get(kind, 1)
               / rate for n in args.ranks for kind in args.states for w in args.writers
               for rate in args.rates)


def _warm_kernels(args: argparse.Namespace) -> float:
    """Save and load a small state of each kind once in this process, so that the
    kernels the ranks need are compiled into Numba's cache before they start (on a cold
    cache every spawned rank would otherwise compile them at once, in its untimed round).
    Returns the seconds it took."""
    t = time.perf_counter()
    weights, _ = _weights(True, 1, 0, 64)
    for kind in args.states:
        sd = _state(kind, weights, 0)
        for name in _EK:
            if name in args.writers:
                with tempfile.TemporaryDirectory(dir=args.dir) as d, warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    dcp.save(sd, storage_writer=_writer(name, Path(d), None, 1), no_dist=True)
                    dcp.load({k: torch.zeros_like(v) for k, v in sd.items()},
                             storage_reader=_reader(name, Path(d), 1), no_dist=True)
    return time.perf_counter() - t


def _print_head(args: argparse.Namespace) -> None:
    print("| state | ranks | writer | MB per rank | size / hf | save s | save / fs | "
          "save CPU s | busy | in write_data | load s | load / fs | in read_data |"
          + "".join(f" save s at {r / 1e9:g} GB/s | / fs |" for r in args.rates))
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
          + "---:|---:|" * len(args.rates), flush=True)


def _print_rows(args: argparse.Namespace, results: dict, n: int) -> None:
    """The table's rows for ``n`` ranks, printed as soon as they are measured (a run cut
    short keeps what it did)."""
    for kind in args.states:
        fs = results[(kind, "fs", n, None)][3]
        fs_save = statistics.median(x["save"] for x in fs)
        fs_load = statistics.median(x["load"] for x in fs)
        for name in args.writers:
            size, hf, per_rank, rows = results[(kind, name, n, None)]
            save = [x["save"] for x in rows]
            cpu = statistics.median(x["cpu"] for x in rows)
            load = [x["load"] for x in rows]
            writes = statistics.median(x["write_data"] for x in rows)
            reads = statistics.median(x["read_data"] for x in rows)
            line = (f"| {kind} | {n} | {name} | {per_rank / 1e6:.0f} | {size / hf:.3f} | "
                    f"{_spread(save)} | {statistics.median(save) / fs_save:.2f}x | "
                    f"{cpu:.2f} | {cpu / statistics.median(save):.1f} | {writes:.3f} | "
                    f"{_spread(load)} | {statistics.median(load) / fs_load:.2f}x | "
                    f"{reads:.3f} |")
            for rate in args.rates:
                slow = [x["save"] for x in results[(kind, name, n, rate)][3]]
                slow_fs = statistics.median(
                    x["save"] for x in results[(kind, "fs", n, rate)][3])
                line += f" {_spread(slow)} | {statistics.median(slow) / slow_fs:.2f}x |"
            print(line, flush=True)


def _print_phases(args: argparse.Namespace, results: dict) -> None:
    """Rank 0's median seconds per phase of a save (``--phases``)."""
    names = sorted({p for v in results.values() for x in v[3] for p in x["phases"]})
    print("\nRank 0's save by phase, median seconds (thread-seconds where threads overlap); "
          "planning and collectives = save - in write_data - finish:")
    print("| state | ranks | writer | rate | save | in write_data | planning and "
          "collectives | " + " | ".join(names) + " |")
    print("|---|---:|---|---|" + "---:|" * (3 + len(names)))
    for (kind, name, n, rate), (_, _, _, rows) in sorted(
            results.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3] or 0, kv[0][1])):
        med = {p: statistics.median(x["phases"].get(p, 0.0) for x in rows) for p in names}
        save = statistics.median(x["save"] for x in rows)
        inside = statistics.median(x["write_data"] for x in rows)
        rest = save - inside - med.get("finish (metadata)", 0.0)
        print(f"| {kind} | {n} | {name} | {f'{rate / 1e9:g} GB/s' if rate else 'none'} | "
              f"{save:.3f} | {inside:.3f} | {rest:.3f} | "
              + " | ".join(f"{med[p]:.3f}" for p in names) + " |")


def _gil(args: argparse.Namespace) -> None:
    """``--gil``: one rank's save (``no_dist``, one coding thread: every file coded on
    the calling thread, the closes on the closing thread) under ``gil.GilProfile``:
    the calling thread's CPU, its time in nogil kernels and GIL-releasing built-ins,
    the rest (the GIL held), its Python calls, and the functions that hold it longest.
    The least of ``--repeat`` runs."""
    import gil as gil_profile

    def modules() -> list:
        return [m for k, m in sorted(sys.modules.items())
                if (k == "entropykit" or k.startswith("entropykit.")) and m is not None]

    print("| state | MB | files | CPU s | GIL-free s | GIL held s | share held | bound at 16 "
          "threads | Python calls | calls / file |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    top = []
    for kind in args.states:
        weights, _ = _weights(True, _layers(kind, args.mb_per_rank, 1), 0, 1)
        sd = _state(kind, weights, 0)
        del weights
        paths: list[Path] = []

        def save(sd=sd, paths=paths, kind=kind) -> None:
            # A new directory each time, as the bench's saves (no earlier shards to
            # remove); removed after the profile.
            paths.append(Path(args.dir) / f"gil-{kind}-{len(paths)}")
            dcp.save(sd, storage_writer=CompressedStorageWriter(paths[-1], threads=1),
                     no_dist=True)

        save()
        files = sum(1 for p in paths[0].iterdir() if p.name.startswith("shard-"))
        runs, tallies = [], []
        for _ in range(args.repeat):
            prof = gil_profile.GilProfile(modules())
            runs.append(prof.kernels(save))
            tallies.append(prof.profile(save))
            for p in paths:
                shutil.rmtree(p, ignore_errors=True)
        cpu, inside = min(runs, key=lambda r: r[0] - r[1])
        t = min(tallies, key=lambda r: r.free_except(gil_profile.FREE))
        held = min(max(0.0, cpu - inside - t.free_except(gil_profile.FREE)), cpu)
        share = held / max(cpu, 1e-9)
        mb = sum(v.numel() * v.element_size() for v in sd.values()
                 if isinstance(v, torch.Tensor)) / 1e6
        print(f"| {kind} | {mb:.0f} | {files} | {cpu:.3f} | {cpu - held:.3f} | {held:.3f} | "
              f"{share:.0%} | {1 / (share + (1 - share) / 16):.1f}x | {t.calls:,} | "
              f"{t.calls // max(files, 1):,} |", flush=True)
        longest = sorted(t.held().items(), key=lambda kv: -kv[1])[:args.top]
        top.append(f"- {kind}: " + ", ".join(f"{k.lstrip('~')} {v * 1e3:.1f} ms"
                                            for k, v in longest))
    print("\nLongest GIL-held (own time under the profiler, its cost included):\n\n"
          + "\n".join(top))


def _small_files(args: argparse.Namespace) -> None:
    """``--small-files N``: the per-file cost of ``output_file`` outside any coding."""
    from entropykit.container._atomic import output_file

    started = 0
    real_start = threading.Thread.start

    def counted(self) -> None:
        nonlocal started
        started += 1
        real_start(self)

    threading.Thread.start = counted  # type: ignore[method-assign]
    try:
        print("| file | files | wall µs / file | CPU µs / file | threads started (all runs) |")
        print("|---|---:|---:|---:|---:|")
        for size in (3, 64 << 10):
            data = os.urandom(size)
            best = (math.inf, math.inf)
            started = 0
            for r in range(args.repeat):
                wall, cpu = time.perf_counter(), time.process_time()
                for i in range(args.small_files):
                    with output_file(Path(args.dir) / f"f{r}-{i}", sweep=False) as out:
                        out.write(data)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                best = min(best, (cpu, wall))
                for i in range(args.small_files):
                    os.unlink(Path(args.dir) / f"f{r}-{i}")
            cpu, wall = best
            print(f"| {size:,} B | {args.small_files} | {wall / args.small_files * 1e6:.0f} | "
                  f"{cpu / args.small_files * 1e6:.0f} | {started} |", flush=True)
    finally:
        threading.Thread.start = real_start  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--states", nargs="+", default=["model", "optim"],
                    choices=["model", "optim"])
    ap.add_argument("--rate", type=float, nargs="+", default=[1e9],
                    help="bytes/s per rank, one or more; 0: no rate-limited saves")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--writers", nargs="+", default=list(WRITERS), choices=WRITERS)
    ap.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    ap.add_argument("--synthetic", action="store_true")
    ap.add_argument("--mb-per-rank", type=float, default=None,
                    help="with --synthetic: about this many MB of each state per rank")
    ap.add_argument("--ek-threads", type=int, default=None,
                    help="entropykit's coding threads per rank (default: as fs's, cores / "
                         "ranks)")
    ap.add_argument("--phases", action="store_true",
                    help="also print rank 0's save time by phase")
    ap.add_argument("--gil", action="store_true",
                    help="instead: the GIL-held share of one rank's save on one coding "
                         "thread (the synthetic states, one process)")
    ap.add_argument("--top", type=int, default=8,
                    help="with --gil: how many of the longest GIL-held functions to name")
    ap.add_argument("--small-files", type=int, default=0, metavar="N",
                    help="instead: the cost of N small files through output_file, one "
                         "after another")
    args = ap.parse_args(argv)
    if args.mb_per_rank is not None and not args.synthetic:
        ap.error("--mb-per-rank needs --synthetic")
    if args.gil or args.small_files:
        args.dir = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
        try:
            _small_files(args) if args.small_files else _gil(args)
        finally:
            shutil.rmtree(args.dir, ignore_errors=True)
        return
    args.rates = sorted({r for r in args.rate if r > 0}, reverse=True)
    args.writers = [w for w in WRITERS if w in {*args.writers, "fs"}]
    if args.rates:
        print(f"# rate-limited saves: at least {_plan(args):.0f} s of storage time in all "
              f"(the rounds' bytes at {', '.join(f'{r / 1e9:g}' for r in args.rates)} GB/s "
              f"per rank), on top of the page-cache saves and loads", flush=True)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_model()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, "
          f"{'synthetic' if args.synthetic else 'MiniLM-L6'} state, writers taking turns "
          f"in each of {args.repeat} rounds: median [least-most] seconds"
          + (f"; rate-limited: {', '.join(f'{r / 1e9:g}' for r in args.rates)} GB/s per rank "
             f"(one device model per rank in the storage writes of every writer)"
             if args.rates else ""), flush=True)
    args.dir = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    print(f"# kernels compiled or loaded from the cache in {_warm_kernels(args):.1f} s",
          flush=True)
    shared: dict = mp.Manager().dict()
    try:
        for n in args.ranks:
            with tempfile.TemporaryDirectory() as tmp:
                mp.spawn(_worker, args=(n, args, str(Path(tmp) / "store"), shared),
                         nprocs=n, join=True)
            if n == args.ranks[0]:
                _print_head(args)
            _print_rows(args, dict(shared), n)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    if args.phases:
        _print_phases(args, dict(shared))


if __name__ == "__main__":
    main()
