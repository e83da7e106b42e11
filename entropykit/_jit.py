"""Numba's compile cache and first-run compilation, for the package's kernels.

What it is: (1) a last-resort cache location for the package's kernels: where neither
the package's ``__pycache__`` nor the user's cache directory (``~/.cache/numba``) is
writable (an install owned by another user or in a read-only image, run with no writable
home), Numba would refuse to import them; they are cached under the temporary directory
instead, in a directory only this user may write (``NUMBA_CACHE_DIR``, when set, comes
first as always); (2) the time this process spent compiling them, which the summaries'
rates leave out; (3) one line on stderr, when it is a terminal, as they start compiling,
which only happens on a cache miss (the first run of an install, or after an upgrade).
What it is not: the kernels, compiling them ahead (``entropykit.warmup``), or the cache of
kernels compiled for a portable CPU (``entropykit._portable``, installed here too).
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from numba.core import caching
from numba.core import event as _event

from . import _portable

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
# Order of magnitude of a cold compress or load on a small machine: compiling is
# single-threaded, so more cores barely change it.
_NOTICE = ("entropykit: compiling kernels (first run, ~{} s; they are cached for later "
           "runs; `python -m entropykit.warmup` compiles them ahead)")
_TYPICAL_SECONDS = 30

_lock = threading.Lock()
_local = threading.local()
_compiling = 0.0  # seconds spent in top-level compiles of the package's kernels
_announce: bool | None = None  # None: when stderr is a terminal
_installed = False


def compile_seconds() -> float:
    """Seconds this process has spent compiling the package's kernels (all threads)."""
    with _lock:
        return _compiling


def stopwatch() -> Callable[[], float]:
    """A clock started now: seconds elapsed since, less the time spent compiling meanwhile.

    Compiles hold Numba's global lock, so threads that need a kernel wait on the one
    compiling it: the time it took is what the run lost to it.
    """
    t0, c0 = time.perf_counter(), compile_seconds()
    return lambda: max(0.0, time.perf_counter() - t0 - (compile_seconds() - c0))


def set_notice(enabled: bool | None) -> None:
    """Whether the first compile of the process says so on stderr (None, the default:
    when stderr is a terminal, so that logs and captured output stay as they were)."""
    global _announce
    _announce = enabled


def _ours(dispatcher: object) -> bool:
    py_func = getattr(dispatcher, "py_func", None)
    return getattr(py_func, "__module__", "").startswith("entropykit.")


class _Compiles(_event.Listener):
    """Times top-level compiles of the package's kernels (their callees compile inside)."""

    def on_start(self, event: _event.Event) -> None:
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0:
            _local.top = _ours(event.data["dispatcher"])
            _local.t0 = time.perf_counter()
            if _local.top:
                _say_once()

    def on_end(self, event: _event.Event) -> None:
        _local.depth -= 1
        if _local.depth == 0 and _local.top:
            global _compiling
            with _lock:
                _compiling += time.perf_counter() - _local.t0


def _say_once() -> None:
    global _announce
    with _lock:
        say, _announce = _announce, False
    try:
        if say or (say is None and sys.stderr.isatty()):
            print(_NOTICE.format(_TYPICAL_SECONDS), file=sys.stderr, flush=True)
    except (AttributeError, OSError, ValueError):  # no stderr, closed, or a broken pipe
        pass


def _private_dir(path: str) -> bool:
    """Whether ``path`` is (or now is) a real directory of this user that no one else may
    write: a shared temporary directory must not take cache files planted by another."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    owner = getattr(os, "geteuid", lambda: st.st_uid)()
    return (stat.S_ISDIR(st.st_mode) and st.st_uid == owner
            and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


_fallback: str | None = None


def _fallback_dir() -> str:
    """The temporary-directory cache of this user, or one of this process (removed at
    exit) when that one is not safe to use."""
    global _fallback
    if _fallback is None:
        user = getattr(os, "geteuid", lambda: os.getpid())()
        shared = os.path.join(tempfile.gettempdir(), f"entropykit-numba-cache-{user}")
        if _private_dir(shared):
            _fallback = shared
        else:
            _fallback = tempfile.mkdtemp(prefix="entropykit-numba-cache-")
            atexit.register(shutil.rmtree, _fallback, ignore_errors=True)
    return _fallback


class _TempDirLocator(caching._SourceFileBackedLocatorMixin, caching._CacheLocator):
    """Numba cache locator tried after its own: the package's kernels only."""

    def __init__(self, py_func, py_file):  # noqa: ANN001 (Numba's signature)
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = os.path.join(_fallback_dir(), self.get_suitable_cache_subpath(py_file))

    def get_cache_path(self) -> str:
        return self._cache_path

    @classmethod
    def from_function(cls, py_func, py_file):  # noqa: ANN001, ANN206
        if os.path.commonpath([_PACKAGE, os.path.abspath(py_file)]) != _PACKAGE:
            return None
        return super().from_function(py_func, py_file)


def install() -> None:
    """Add the fallback cache location and the compile timer (once; before any kernel
    module is imported, since Numba picks a kernel's cache location as it is defined)."""
    global _installed
    if _installed:
        return
    _installed = True
    # Numba before 0.61 names the class _CacheImpl.
    impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl
    if _TempDirLocator not in impl._locator_classes:
        impl._locator_classes.append(_TempDirLocator)
    _event.register("numba:compile", _Compiles())
    _portable.install()


install()  # at import: Numba picks a kernel's cache location as its module defines it
