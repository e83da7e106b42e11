"""How much of one thread's CPU time runs with the GIL released: the accounting behind
``bench_threads.py --gil``.

What it is: ``GilProfile``, a profiler of the calling thread only (``sys.setprofile``,
per thread on every Python version) that times, on ``time.thread_time``, the calls that
release the GIL: Numba dispatchers compiled with ``nogil`` (reached through thin timing
wrappers put in the given modules' namespaces while it runs) and the built-ins that
release it (named by ``GIL_FREE_BUILTINS``), and the own time and count of everything
else. ``Tally`` is its arithmetic alone, driven by (event, key, time) so it can be
tested with a made-up clock.

Why not cProfile: on Python 3.12 cProfile is built on ``sys.monitoring``, which (a)
reports events of every thread of the process, timed with the profiling thread's
per-thread clock (a call on a writer thread is charged the difference of two unrelated
clocks: negative or huge own times), and (b) never sees a call of a Numba dispatcher
(neither as a Python nor as a C call: its time is the caller's). A Python profile
function set with ``sys.setprofile`` sees only its own thread on 3.11 and 3.12 alike,
and the wrappers make every dispatcher call a Python frame on both.
What it is not: a general profiler; a kernel called from another Numba function is part
of its caller (as it runs, compiled in).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

# Built-ins that release the GIL beside the nogil Numba kernels: reads, writes, renames and
# syncs, zstd, zlib (matched as words of the profiler's name of the built-in; a zlib call
# of under 5 KiB keeps the GIL but is counted too: the profile does not see its size).
GIL_FREE_BUILTINS = ("preadv", "pread", "readinto", "write", "replace", "fsync",
                     "fdatasync", "truncate", "compress", "decompress", "crc32")
FREE = "<nogil kernels>"  # the key of every wrapped dispatcher call


class Tally:
    """Own time per key from nested call / return events: a call's own time is its
    elapsed time less that of the calls it made. ``free`` sums the own time of the keys
    ``is_free`` accepts; ``calls`` counts the other calls, ``releases`` the free ones."""

    def __init__(self, is_free: Callable[[str], bool]) -> None:
        self.is_free = is_free
        self.own: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.free = 0.0
        self.calls = 0
        self.releases = 0
        self._stack: list[list[Any]] = []  # [key, start, time in callees]

    def enter(self, key: str, now: float) -> None:
        self._stack.append([key, now, 0.0])

    def leave(self, now: float) -> None:
        if not self._stack:  # a return of a call made before the profile started
            return
        key, start, inner = self._stack.pop()
        elapsed = max(0.0, now - start)
        own = max(0.0, elapsed - inner)
        self.own[key] = self.own.get(key, 0.0) + own
        self.count[key] = self.count.get(key, 0) + 1
        if self.is_free(key):
            self.free += own
            self.releases += 1
        else:
            self.calls += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    def free_except(self, key: str) -> float:
        """``free`` less the own time of ``key``."""
        return self.free - (self.own.get(key, 0.0) if self.is_free(key) else 0.0)

    def held(self) -> dict[str, float]:
        """Own time of the keys that hold the GIL."""
        return {k: v for k, v in self.own.items() if not self.is_free(k)}


def _free_builtin(key: str) -> bool:
    return key == FREE or (key.startswith("~") and any(w in key for w in GIL_FREE_BUILTINS))


def nogil_dispatchers(modules: Iterable[ModuleType]) -> dict[int, Any]:
    """The Numba dispatchers compiled with ``nogil`` named in ``modules``, by id."""
    from numba.core.registry import CPUDispatcher

    found = {}
    for m in modules:
        for v in list(vars(m).values()):
            if isinstance(v, CPUDispatcher) and v.targetoptions.get("nogil"):
                found[id(v)] = v
    return found


class GilProfile:
    """Time ``fn()`` on this thread, its nogil Numba dispatchers (those named in
    ``modules``) wrapped while it runs and put back after.

    ``kernels(fn)``: (CPU seconds of the run, seconds inside the dispatchers): no profile
    function, so only the wrappers' two clock reads per call are added. ``profile(fn)``:
    the ``Tally`` of every call of the run under ``sys.setprofile`` (dispatchers under
    ``FREE``): the counts, the free built-ins' time and the held functions' own time.
    Run ``fn`` once unwrapped first: a dispatcher compiling a new signature while wrapped
    would find a wrapper among its globals."""

    def __init__(self, modules: Iterable[ModuleType],
                 clock: Callable[[], float] = time.thread_time) -> None:
        self.modules = list(modules)
        self.clock = clock
        self._inside = 0.0
        self._thread = 0

    def _wrap(self, timed: bool) -> list[tuple[ModuleType, str, Any]]:
        kernels = nogil_dispatchers(self.modules)
        # 3.11: Numba reports each call itself, with a copy of its Python code object.
        self._skip = {_where(d.py_func.__code__) for d in kernels.values()}
        wrappers: dict[int, Callable[..., Any]] = {}
        undo = []
        for m in self.modules:
            for name, v in list(vars(m).items()):
                if id(v) in kernels:
                    if id(v) not in wrappers:
                        wrappers[id(v)] = self._timed(v) if timed else _plain(v)
                    undo.append((m, name, v))
                    setattr(m, name, wrappers[id(v)])
        return undo

    def _timed(self, dispatcher: Any) -> Callable[..., Any]:
        """A Python frame around each call of ``dispatcher`` that adds its time on this
        thread to ``_inside``."""
        clock, get_ident = self.clock, threading.get_ident

        def call(*args: Any, **kwargs: Any) -> Any:
            if get_ident() != self._thread:
                return dispatcher(*args, **kwargs)
            t0 = clock()
            try:
                return dispatcher(*args, **kwargs)
            finally:
                self._inside += clock() - t0
        return call

    def _run(self, fn: Callable[[], Any], event: Any) -> float:
        undo = self._wrap(timed=event is None)
        self._inside, self._thread = 0.0, threading.get_ident()
        t0 = self.clock()
        if event is not None:
            sys.setprofile(event)
        try:
            fn()
        finally:
            if event is not None:
                sys.setprofile(None)
            cpu = self.clock() - t0
            for m, name, v in undo:
                setattr(m, name, v)
        return cpu

    def kernels(self, fn: Callable[[], Any]) -> tuple[float, float]:
        cpu = self._run(fn, None)
        return cpu, self._inside

    def profile(self, fn: Callable[[], Any]) -> Tally:
        tally = Tally(_free_builtin)
        clock = self.clock

        def event(frame: Any, what: str, arg: Any) -> None:
            if what == "call":
                code = frame.f_code
                where = _where(code)
                if where in self._skip:
                    return
                key = FREE if code is _WRAPPER_CODE else (
                    f"{where[0].rsplit('/', 1)[-1]}:{where[1]}({where[2]})")
                tally.enter(key, clock())  # read last: the callback's cost is not the call's
            elif what == "c_call":
                tally.enter(f"~{getattr(arg, '__qualname__', arg)}", clock())
            elif what in ("return", "c_return", "c_exception"):
                if what == "return" and _where(frame.f_code) in self._skip:
                    return
                tally.leave(clock())

        self._run(fn, event)
        return tally


def _where(code: Any) -> tuple[str, int, str]:
    return code.co_filename, code.co_firstlineno, code.co_name


def _plain(dispatcher: Any) -> Callable[..., Any]:
    """A Python frame around each call of ``dispatcher``, for the profile to time."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return dispatcher(*args, **kwargs)
    return call


_WRAPPER_CODE = _plain(None).__code__
