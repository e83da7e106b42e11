"""The one thread pool of the package: an ordered, bounded parallel map.

What it is: ``imap(fn, items, threads)`` yields ``fn(item)`` in input order while at most
``2 * threads`` calls are in flight, so work overlaps but memory stays bounded (each
result is consumed before more work is started); ``run(fn, count, threads)`` is the list
of ``fn(0) .. fn(count - 1)`` the same way. The work functions release the GIL (Numba
kernels, zstd, zlib, large numpy copies), so threads use every core. Frames run their
chunks here, the container its segments.
What it is not: a process pool, or a scheduler that reorders work.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_threads() -> int:
    """Every core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def resolve(threads: int | None) -> int:
    """``threads`` or every core this process may use; ValueError if not >= 1."""
    n = default_threads() if threads is None else threads
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
    return n


def imap(fn: Callable[[T], R], items: Iterable[T], threads: int) -> Iterator[R]:
    """``fn`` over ``items``, results in order; the first exception propagates."""
    if threads == 1:
        for item in items:
            yield fn(item)
        return
    pool = ThreadPoolExecutor(max_workers=threads)
    pending: deque[Future[R]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()
        pool.shutdown(wait=True)


def run(fn: Callable[[int], R], count: int, threads: int | None) -> list[R]:
    """``[fn(0), ..., fn(count - 1)]`` on ``threads`` threads (None: every core)."""
    return list(imap(fn, range(count), min(resolve(threads), max(count, 1))))
