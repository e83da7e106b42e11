"""Tests of bench/gil.py, the GIL-held accounting of ``bench_threads.py --gil``: its
arithmetic on made-up events and clocks, and on a real nogil Numba kernel, that calls on
other threads are not counted and that the dispatchers are seen (as on 3.12, where
profilers never see them) and put back."""

from __future__ import annotations

import importlib.util
import threading
import types
import zlib
from pathlib import Path

import numpy as np
from numba import njit

_SPEC = importlib.util.spec_from_file_location(
    "bench_gil", Path(__file__).resolve().parent.parent / "bench" / "gil.py")
gil = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gil)


def _is_free(key: str) -> bool:
    return key in (gil.FREE, "~write")


def test_tally_own_times_of_nested_calls():
    t = gil.Tally(_is_free)
    t.enter("a", 0.0)
    t.enter("~write", 1.0)
    t.leave(4.0)  # write: 3
    t.enter(gil.FREE, 5.0)
    t.enter("b", 6.0)  # a held call inside a free one counts for itself
    t.leave(7.0)
    t.leave(9.0)  # FREE: 4 - 1
    t.leave(10.0)  # a: 10 - 3 - 4
    assert t.own == {"a": 3.0, "~write": 3.0, gil.FREE: 3.0, "b": 1.0}
    assert t.count == {"a": 1, "~write": 1, gil.FREE: 1, "b": 1}
    assert t.free == 6.0
    assert t.free_except(gil.FREE) == 3.0
    assert (t.calls, t.releases) == (2, 2)
    assert t.held() == {"a": 3.0, "b": 1.0}


def test_tally_never_negative():
    t = gil.Tally(_is_free)
    t.leave(1.0)  # the return of a call made before the profile started: ignored
    t.enter("~write", 5.0)
    t.leave(2.0)  # a clock that went back (another thread's clock): 0, not negative
    t.enter("a", 0.0)
    t.enter("b", 0.0)
    t.leave(3.0)
    t.leave(1.0)  # a: elapsed 1 less 3 in callees: 0
    assert min(t.own.values()) == 0.0
    assert t.free == 0.0 and t.own["b"] == 3.0


@njit(nogil=True)
def _square_sum(a):
    s = 0.0
    for i in range(a.size):
        s += a[i] * a[i]
    return s


def _module() -> types.ModuleType:
    m = types.ModuleType("gil_test_kernels")
    m.kernel = _square_sum

    def work(a):
        return sum(m.kernel(a) for _ in range(20))

    m.work = work
    return m


def test_kernels_time_is_inside_the_run():
    m, a = _module(), np.ones(1 << 20)
    m.work(a)  # compiled before it is wrapped
    cpu, inside = gil.GilProfile([m]).kernels(lambda: m.work(a))
    assert 0.0 < inside <= cpu
    assert inside > 0.5 * cpu  # the loop around 20 kernel calls is tiny beside them
    assert m.kernel is _square_sum  # put back


def test_profile_counts_this_thread_only():
    m, a = _module(), np.ones(1 << 18)
    m.work(a)
    stop = threading.Event()

    def other():  # free built-ins on another thread: cProfile on 3.12 counts them
        data = b"x" * (1 << 16)
        while not stop.is_set():
            zlib.crc32(data)

    t = threading.Thread(target=other)
    t.start()
    try:
        tally = gil.GilProfile([m]).profile(lambda: m.work(a))
    finally:
        stop.set()
        t.join()
    assert tally.releases == 20  # the kernel calls, and no crc32 of the other thread
    assert not any("crc32" in k for k in tally.own)
    assert tally.own[gil.FREE] > 0.0
    assert tally.free <= sum(tally.own.values())
    assert "work" in " ".join(tally.held())
    assert m.kernel is _square_sum
