"""An ordered, bounded parallel map over threads.

What it is: ``imap(fn, items, threads)`` yields ``fn(item)`` in input order while at most
``2 * threads`` calls are in flight, so work overlaps but memory stays bounded (each
result is consumed before more work is started). The work functions release the GIL
(Numba kernels, zstd, zlib, large numpy copies), so threads use every core.
What it is not: a process pool, or a scheduler that reorders work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from ..coding.frame import default_threads

T = TypeVar("T")
R = TypeVar("R")


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
