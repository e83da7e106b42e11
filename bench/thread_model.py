"""A model of one operation's speed at many threads, from one run on few: ``bench_threads.py
--model``.

What it is: ``record`` runs an operation once on the package's pool and times every work
unit (pool item) on its own thread's CPU clock, exclusive of the nested items it ran: its
CPU time, the part of it inside nogil Numba kernels and ``os``'s reads and writes (thin
wrappers put around them for the run, as ``gil.GilProfile`` does), how many such calls it
made (each a GIL release), and which unit opened the nested call it belongs to. The
calling thread (which runs no unit on more than one thread: it opens the file, plans,
feeds the units and takes their results in order) is timed the same way. ``predict``
turns that into a bound on the wall time at ``n`` threads, three ways:

- work: all CPU time over ``n`` threads;
- critical path: the longest chain of a unit and, below it, the longest chain of the
  nested units it opened (what stays serial however many threads run: the largest
  segment's own work and its longest part);
- GIL: every unit's held time (CPU less kernel time) and the calling thread's held time
  run one at a time, whatever the count;

and ``simulate``: the units in the order they ran, each as its held bursts alternating
with its kernel calls, on ``n`` worker threads and the calling thread (its own held and
free work spread evenly over the run), with one GIL taken first come first served and,
per hand-off of the GIL to another waiting thread, ``handoff`` seconds during which no
thread holds it (a sleeping thread's wake-up). Its makespan, or the critical path where
that is longer, is the prediction. ``handoff`` measures that idle time per hand-off on the
host it runs on (threads alternating short Python with short kernels).

What it is not: a measurement of many cores. Memory bandwidth, the page cache's locks and
the OS's scheduling are outside the model (held time also counts zstd, zlib and numpy
calls that do release the GIL: an upper bound on it), and so are threads other than the
pool's and the caller's (the output file's writer).
"""

from __future__ import annotations

import heapq
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import gil as gil_profile

# The ``os`` calls of the package's readers and writers, each a GIL release (timed as a
# kernel call; zstd's and zlib's own releases are not seen: held time is an upper bound).
_SYSCALLS = ("preadv", "pread", "writev", "write")


@dataclass
class Unit:
    """One pool item's own work (nested items excluded), seconds of its thread's CPU."""

    cpu: float = 0.0
    calls: list[float] = field(default_factory=list)  # each nogil kernel call's seconds
    parent: int = -1  # index of the unit whose nested call this one is an item of
    children: list[int] = field(default_factory=list)

    @property
    def kernel(self) -> float:
        return sum(self.calls)

    @property
    def releases(self) -> int:
        return len(self.calls)

    @property
    def held(self) -> float:
        return max(0.0, self.cpu - self.kernel)

    def holding(self, below: float) -> Unit:
        """This unit with its kernel calls shorter than ``below`` seconds keeping the GIL
        (what they would do compiled without ``nogil``)."""
        return Unit(self.cpu, [c for c in self.calls if c >= below], self.parent,
                    self.children)


@dataclass
class Record:
    units: list[Unit]
    caller: Unit  # the calling thread's whole run (it runs no unit on >= 2 threads)
    threads: int


def record(fn: Callable[[int], Any], threads: int, modules: Iterable[ModuleType]) -> Record:
    """Run ``fn(threads)`` (``threads`` >= 2, so the calling thread runs no unit) with the
    pool's items and the nogil kernels timed. Run ``fn`` once before: a kernel compiling
    a new signature while wrapped would find a wrapper among its globals."""
    from entropykit.coding import parallel

    units: list[Unit] = []
    lock = threading.Lock()
    here = threading.local()  # .stack: [unit index, clock at start, nested CPU]
    caller = Unit()
    caller_id = threading.get_ident()
    clock = time.thread_time
    execute, open_ = parallel._Pool._execute, parallel._Pool.open
    opener: dict[int, int] = {}  # id(batch) -> unit index that opened it

    def current() -> Unit | None:
        stack = getattr(here, "stack", None)
        if stack:
            return units[stack[-1][0]]
        return caller if threading.get_ident() == caller_id else None

    def timed_execute(self: Any, b: Any, i: int) -> None:
        stack = here.__dict__.setdefault("stack", [])
        with lock:
            k = len(units)
            parent = opener.get(id(b), -1)
            units.append(Unit(parent=parent))
            if parent >= 0:
                units[parent].children.append(k)
        stack.append([k, clock(), 0.0])
        try:
            execute(self, b, i)
        finally:
            _, t0, inner = stack.pop()
            took = clock() - t0
            units[k].cpu = took - inner
            if stack:
                stack[-1][2] += took

    def timed_open(self: Any, fn_: Any, items: list[Any], outer: bool) -> Any:
        b = open_(self, fn_, items, outer)
        stack = getattr(here, "stack", None)
        if not outer and stack:
            with lock:
                opener[id(b)] = stack[-1][0]
        return b

    def wrap(dispatcher: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            u = current()
            if u is None:
                return dispatcher(*args, **kwargs)
            t0 = clock()
            try:
                return dispatcher(*args, **kwargs)
            finally:
                u.calls.append(clock() - t0)
        return call

    kernels = gil_profile.nogil_dispatchers(modules)
    undo, wrappers = [], {}
    for m in modules:
        for name, v in list(vars(m).items()):
            if id(v) in kernels:
                wrappers.setdefault(id(v), wrap(v))
                undo.append((m, name, v))
                setattr(m, name, wrappers[id(v)])
    for name in _SYSCALLS:  # reads and writes let the GIL go too
        if hasattr(os, name):
            undo.append((os, name, getattr(os, name)))
            setattr(os, name, wrap(getattr(os, name)))
    parallel._Pool._execute, parallel._Pool.open = timed_execute, timed_open
    try:
        t0 = clock()
        fn(threads)
        caller.cpu = clock() - t0
    finally:
        parallel._Pool._execute, parallel._Pool.open = execute, open_
        for m, name, v in undo:
            setattr(m, name, v)
    return Record(units, caller, threads)


def critical_path(units: list[Unit]) -> float:
    """The longest chain: a unit's CPU time plus the longest chain among the nested units
    it opened (they run side by side at best)."""
    memo: dict[int, float] = {}
    for k in reversed(range(len(units))):  # children come after their parent
        u = units[k]
        memo[k] = u.cpu + max((memo[c] for c in u.children), default=0.0)
    return max((memo[k] for k, u in enumerate(units) if u.parent < 0), default=0.0)


def _bursts(u: Unit) -> list[tuple[bool, float]]:
    """A unit as (holds the GIL, seconds) bursts: its held time in ``releases + 1`` equal
    parts, between them its kernel calls in the order they ran."""
    part = u.held / (u.releases + 1)
    out: list[tuple[bool, float]] = [(True, part)]
    for c in u.calls:
        out += [(False, c), (True, part)]
    return [b for b in out if b[1] > 0]  # work of no length takes no GIL


def simulate(rec: Record, n: int, handoff: float = 0.0) -> float:
    """The makespan of ``rec``'s units on ``n`` workers and the calling thread, one GIL
    (first come, first served; ``handoff`` seconds idle per hand-off to a waiting
    thread). Units are claimed in the order they ran; nesting is not modelled here
    (``critical_path`` bounds it)."""
    queue = [_bursts(u) for u in rec.units]
    pieces = max(1, sum(1 for u in rec.units if u.parent < 0))
    c = rec.caller
    per = Unit(c.cpu / pieces, c.calls[::pieces])  # its calls spread over the run
    per.cpu = per.kernel + c.held / pieces
    caller_work = [b for _ in range(pieces) for b in _bursts(per)]
    # Threads: 0 is the caller; each holds a list of bursts still to run.
    todo: list[list[tuple[bool, float]]] = [caller_work] + [[] for _ in range(n)]
    nxt = 0
    events: list[tuple[float, int, int]] = []  # (time, seq, thread) a thread wants to go on
    seq = 0
    gil_free_at = 0.0
    last_holder = -1
    for t in range(n + 1):
        heapq.heappush(events, (0.0, seq, t))
        seq += 1
    end = 0.0
    while events:
        now, _, t = heapq.heappop(events)
        if not todo[t]:
            if t == 0 or nxt >= len(queue):
                end = max(end, now)
                continue
            todo[t] = list(queue[nxt])
            nxt += 1
        held, dur = todo[t].pop(0)
        if held:
            start = max(now, gil_free_at)
            if start > now and last_holder != t:
                start += handoff  # it slept on the GIL: woken by the holder's release
            gil_free_at = start + dur
            last_holder = t
            done = gil_free_at
        else:
            done = now + dur
        heapq.heappush(events, (done, seq, t))
        seq += 1
    return end


def holding(rec: Record, below: float) -> Record:
    """``rec`` with every kernel call shorter than ``below`` seconds keeping the GIL."""
    return Record([u.holding(below) for u in rec.units], rec.caller.holding(below),
                  rec.threads)


def predict(rec: Record, counts: list[int], handoffs: list[float]) -> str:
    """A table of the bounds and the simulated rates at ``counts`` threads, as speed-ups
    over the same model's one thread (all work on one thread, no hand-off)."""
    units = rec.units
    work = sum(u.cpu for u in units) + rec.caller.cpu
    held = sum(u.held for u in units) + rec.caller.held
    cp = critical_path(units)
    top = sorted(units, key=lambda u: -u.cpu)[:3]
    lines = [f"{len(units)} units ({sum(1 for u in units if u.parent < 0)} outer); work "
             f"{work * 1e3:.1f} ms CPU, of it held {held * 1e3:.1f} ms ({held / work:.0%}), "
             f"calling thread {rec.caller.cpu * 1e3:.1f} ms (held "
             f"{rec.caller.held * 1e3:.1f}); GIL releases "
             f"{sum(u.releases for u in units) + rec.caller.releases:,}; largest units "
             + ", ".join(f"{u.cpu * 1e3:.1f}" for u in top)
             + f" ms; critical path {cp * 1e3:.1f} ms (bound {work / max(cp, 1e-9):.1f}x); "
             f"GIL bound {work / max(held, 1e-9):.1f}x\n",
             "| threads | work bound | Amdahl (held share) | "
             + " | ".join(f"simulated, {h * 1e6:.3g} us hand-off" for h in handoffs) + " |",
             "| ---: | ---: | ---: | " + " | ".join("---:" for _ in handoffs) + " |"]
    share = held / work
    for n in counts:
        sims = [work / max(simulate(rec, n, h), cp) for h in handoffs]
        lines.append(f"| {n} | {n}x | {1 / (share + (1 - share) / n):.1f}x | "
                     + " | ".join(f"{s:.1f}x" for s in sims) + " |")
    return "\n".join(lines) + "\n"


def handoff(n: int, rounds: int = 500, held: float = 20e-6, free: float = 2e-6) -> float:
    """The idle time per GIL hand-off on this host at ``n`` threads, measured: each thread
    runs ``rounds`` times ``held`` seconds of Python and a nogil kernel of ``free``
    seconds (a unit's pattern: short Python between kernel calls). With ``n`` >= 2 the
    GIL is wanted all the time, so the wall time over the held time is idle GIL: what
    each release and re-acquire costs, divided by their number. 0.0 at one thread."""
    import numpy as np
    from numba import njit

    @njit(nogil=True, cache=False)
    def spin(x):  # ~``free`` seconds of work without the GIL
        s = 0
        for i in range(x.size):
            s += x[i] * i
        return s

    x = np.arange(1 << 12, dtype=np.int64)
    spin(x)
    t0 = time.perf_counter()
    for _ in range(50):
        spin(x)
    size = max(16, int(x.size * free / max((time.perf_counter() - t0) / 50, 1e-9)))
    x = np.arange(size, dtype=np.int64)

    def python(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def worker() -> None:
        for _ in range(rounds):
            python(held)
            spin(x)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if n < 2:
        return 0.0
    return max(0.0, wall - n * rounds * held) / (n * rounds)


def package_modules() -> list[ModuleType]:
    return [m for k, m in sorted(sys.modules.items())
            if (k == "entropykit" or k.startswith("entropykit.")) and m is not None]
