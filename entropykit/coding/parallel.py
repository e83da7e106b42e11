"""The one thread pool of the package: ordered, bounded parallel maps that nest flat.

What it is: ``imap(fn, items, threads)`` yields ``fn(item)`` in input order while at most
``2 * threads`` calls are in flight, so work overlaps but memory stays bounded (each
result is consumed before more work is started); ``run(fn, count, threads)`` is the list
of ``fn(0) .. fn(count - 1)`` the same way; ``imap_grouped`` is ``imap`` with small items
run several to a work unit. The work functions release the GIL (Numba
kernels, zstd, zlib, large numpy copies), so threads use every core.

Calls nest without nesting pools: an ``imap`` or ``run`` made inside a work function
(a segment coding its frame's chunks) hands its items to the threads already running,
and the calling thread works through its own items meanwhile; a thread waits only for
items another thread is running, so nesting cannot deadlock. Items of nested calls go
before the outer call's next items (the oldest nested call first), so an outer item
that is started finishes soon and its result is not held up. Inside a call of
``threads=1`` every nested call runs inline too: the outermost call's count is the one
used everywhere, and ``spread(threads)`` tells work that is split only to be shared (a
histogram in parts) whether more than one thread would share it. The default count is
``ENTROPYKIT_THREADS`` where set, else every core this process may use.
What it is not: a process pool, or a scheduler that reorders results.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

ENV = "ENTROPYKIT_THREADS"
# Bytes of data per work unit at least, for ``imap_grouped`` callers: below this, a unit's
# hand-offs between threads cost as much as its work.
UNIT_BYTES = 1 << 20

_here = threading.local()  # .pool: the _Pool this thread works for, or _SERIAL


def default_threads() -> int:
    """``ENTROPYKIT_THREADS`` if set (ValueError unless an integer >= 1), else every core
    this process may use."""
    env = os.environ.get(ENV, "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"{ENV} must be an integer >= 1, got {env!r}")
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def resolve(threads: int | None) -> int:
    """``threads`` or ``default_threads()``; ValueError if not >= 1."""
    n = default_threads() if threads is None else threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    return n


_ALL = -1  # a _Batch.waiter waiting for no item to be running


class _Batch:
    """The items of one call: claimed in order by any thread of the pool; ``items`` may
    grow while the call is open (the outer ``imap`` feeds it as results are taken)."""

    def __init__(self, fn: Callable[[Any], Any], items: list[Any], cond: threading.Condition
                 ) -> None:
        self.fn, self.items = fn, items
        self.next = 0  # the first item not claimed yet
        self.results: list[Any] = [None] * len(items)
        self.done: list[bool] = [False] * len(items)
        self.errors: dict[int, BaseException] = {}
        self.running = 0
        self.stopped = False  # after an error or a close: claim nothing more
        self.cond = cond  # on the pool's lock; notified as the waiter's item finishes
        # What the batch's one waiting thread waits for: an item's index, _ALL (no item
        # running), or None. Only that wakes it: each wake-up hands it the GIL.
        self.waiter: int | None = None

    def claimable(self) -> bool:
        return not self.stopped and self.next < len(self.items)


class _Pool:
    """Up to ``threads`` worker threads (started as items come: a call of few items
    costs few threads) and the open batches they take items from."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # idle workers wait here
        self._nested: deque[_Batch] = deque()  # oldest first
        self._outer: _Batch | None = None
        self._closed = False
        self._idle = 0
        self._workers: list[threading.Thread] = []

    def _wake(self, k: int) -> None:
        """Items for ``k`` more threads were added (the lock held): wake idle workers,
        start new ones for the rest."""
        woken = min(k, self._idle)
        self._idle -= woken  # counted here: a woken worker takes the lock later
        self._work.notify(woken)
        for _ in range(min(k - woken, self.threads - len(self._workers))):
            t = threading.Thread(target=self._serve, name=f"entropykit-{len(self._workers)}",
                                 daemon=True)
            self._workers.append(t)
            t.start()

    def _claim(self, only: _Batch | None = None) -> tuple[_Batch, int] | None:
        """The next item to run (the lock held): of ``only``, else of the oldest nested
        batch, else of the outer one."""
        if only is not None:
            sources: Iterable[_Batch] = (only,)
        else:
            while self._nested and not self._nested[0].claimable():
                self._nested.popleft()
            sources = (*self._nested, *((self._outer,) if self._outer else ()))
        for b in sources:
            if b.claimable():
                i = b.next
                b.next += 1
                b.running += 1
                return b, i
        return None

    def _execute(self, b: _Batch, i: int) -> None:
        """Run item ``i`` of ``b`` (the lock not held) and record how it ended."""
        try:
            value, error = b.fn(b.items[i]), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller of the batch
            value, error = None, e
        with self._lock:
            b.running -= 1
            b.done[i] = True
            if error is None:
                b.results[i] = value
            else:
                b.errors[i] = error
                b.stopped = True
            w = b.waiter
            if w is not None and (error is not None or w == i or (w == _ALL and not b.running)):
                b.cond.notify_all()

    def _serve(self) -> None:
        _here.pool = self
        while True:
            with self._lock:
                job = self._claim()
                while job is None and not self._closed:
                    self._idle += 1
                    self._work.wait()
                    job = self._claim()
                if job is None:
                    return
            self._execute(*job)

    def open(self, fn: Callable[[Any], Any], items: list[Any], outer: bool) -> _Batch:
        b = _Batch(fn, items, threading.Condition(self._lock))
        with self._lock:
            if outer:
                self._outer = b
            else:
                self._nested.append(b)
            self._wake(len(items))
        return b

    def feed(self, b: _Batch, item: Any) -> None:
        with self._lock:
            b.items.append(item)
            b.results.append(None)
            b.done.append(False)
            self._wake(1)

    def wait(self, b: _Batch, i: int) -> Any:
        """Item ``i``'s result, waiting for it (ValueError-free: its error is raised)."""
        with self._lock:
            while not b.done[i] and not (b.stopped and i >= b.next):
                self._await(b, i)
            if i in b.errors:
                raise b.errors[i]
            if not b.done[i]:  # skipped after an earlier error: that one is raised
                raise min(b.errors.items())[1]
            value, b.results[i] = b.results[i], None
            return value

    def join_batch(self, b: _Batch) -> list[Any]:
        """Run ``b``'s items on this thread and the pool's; their results in order, or
        the error of the first item that failed."""
        while True:
            with self._lock:
                job = self._claim(b)
            if job is None:
                break
            self._execute(*job)
        with self._lock:
            while b.running:
                self._await(b, _ALL)
            if b.errors:
                raise min(b.errors.items())[1]
            return b.results

    def stop(self, b: _Batch) -> None:
        """Claim nothing more of ``b``; wait for its running items."""
        with self._lock:
            b.stopped = True
            while b.running:
                self._await(b, _ALL)

    @staticmethod
    def _await(b: _Batch, what: int) -> None:
        """Wait (the lock held) until item ``what`` of ``b`` finishes, or with ``_ALL``
        until none is running, or until an item fails."""
        b.waiter = what
        try:
            b.cond.wait()
        finally:
            b.waiter = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._work.notify_all()
        for t in self._workers:
            t.join()


class _Serial:
    """The mark of a thread running a call of one thread: nested calls run inline."""


_SERIAL = _Serial()


def _inline(fn: Callable[[T], R], item: T) -> R:
    before = getattr(_here, "pool", None)
    _here.pool = _SERIAL
    try:
        return fn(item)
    finally:
        _here.pool = before


def alone(fn: Callable[[T], R], item: T) -> R:
    """``fn(item)`` on this thread, with the calls of this module it makes run inline: for
    work units that are already spread over threads, where a nested hand-off per small
    piece of work would cost more than the piece."""
    return _inline(fn, item)


def imap(fn: Callable[[T], R], items: Iterable[T], threads: int) -> Iterator[R]:
    """``fn`` over ``items``, results in order; the first exception (in item order)
    propagates. Inside a call of this module, the enclosing call's threads run it."""
    pool = getattr(_here, "pool", None)
    if isinstance(pool, _Pool):
        window = 2 * pool.threads
        it = iter(items)
        while True:  # nested: windows of items run flat on the enclosing pool
            part = [x for _, x in zip(range(window), it, strict=False)]
            if not part:
                return
            if len(part) == 1:  # nothing to share: no batch, no lock, no hand-off
                yield fn(part[0])
                continue
            yield from pool.join_batch(pool.open(fn, part, outer=False))
    if threads == 1 or pool is _SERIAL:
        for item in items:
            yield _inline(fn, item)
        return
    pool = _Pool(threads)
    b = pool.open(fn, [], outer=True)
    taken = 0
    try:
        for item in items:
            pool.feed(b, item)
            if len(b.items) - taken >= 2 * threads:
                yield pool.wait(b, taken)
                taken += 1
        while taken < len(b.items):
            yield pool.wait(b, taken)
            taken += 1
    finally:
        pool.stop(b)  # on error or close: cancel queued items, wait for running ones
        pool.close()


def _groups(items: Iterable[T], size: Callable[[T], int], unit: int) -> Iterator[list[T]]:
    """Consecutive ``items`` in lists of at least ``unit`` in total ``size`` (the last may
    be less); an item of ``unit`` or more is a list of its own."""
    group: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if n >= unit:
            if group:
                yield group
                group, total = [], 0
            yield [item]
            continue
        group.append(item)
        total += n
        if total >= unit:
            yield group
            group, total = [], 0
    if group:
        yield group


def imap_grouped(fn: Callable[[T], R], items: Iterable[T], threads: int,
                 size: Callable[[T], int], unit: int,
                 prepare: Callable[[list[T]], None] | None = None) -> Iterator[R]:
    """``imap(fn, items, threads)``, same results in the same order, with consecutive
    items smaller than ``unit`` run as one work unit of at least ``unit`` in total
    ``size``: a unit's hand-offs (a worker woken, its result waited for) and its share of
    the pool's lock cost the same for a tensor of a few hundred bytes as for one of
    megabytes, so many small items would spend more time handed between threads (with
    the GIL) than in work. ``prepare(group)``: called on the unit's thread before ``fn``
    runs on the items of a unit of several (to do once what each item would do: one read
    for all of them)."""
    def unit_of(group: list[T]) -> list[R]:
        if prepare is not None and len(group) > 1:
            prepare(group)
        return [fn(x) for x in group]

    results = imap(unit_of, _groups(items, size, unit), threads)
    try:
        for group in results:
            yield from group
    finally:
        results.close()  # at once, not when collected: cancel queued units, wait for running


def run(fn: Callable[[int], R], count: int, threads: int | None) -> list[R]:
    """``[fn(0), ..., fn(count - 1)]`` on ``threads`` threads (None: ``default_threads``);
    inside a call of this module, on the enclosing call's threads."""
    pool = getattr(_here, "pool", None)
    if isinstance(pool, _Pool):
        if count <= 1:  # nothing to share: no batch, no lock
            return [fn(i) for i in range(count)]
        return pool.join_batch(pool.open(fn, list(range(count)), outer=False))
    if pool is _SERIAL:
        return [fn(i) for i in range(count)]
    return list(imap(fn, range(count), resolve(threads)))


def spread(threads: int | None) -> int:
    """How many threads a ``run(.., threads)`` made here would use: the enclosing call's
    count inside a call of this module (1 inside a call of one thread), else
    ``resolve(threads)``. Work that is split only to share it out asks this first, so
    that one thread does it whole, as cheaply as unsplit code."""
    pool = getattr(_here, "pool", None)
    if isinstance(pool, _Pool):
        return pool.threads
    return 1 if pool is _SERIAL else resolve(threads)
