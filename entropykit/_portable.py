"""Compiled kernels that need no compiling: a cache built for a portable CPU, shipped beside
the package, and the native compile it stands in for until that is cached.

What it is: Numba caches a kernel's machine code for the CPU it compiled on (its name and
features are part of every cache key), under a path derived from where the package is
installed, so a cache cannot travel from one machine or install to another. This module
adds a second, read-only cache the package's kernels fall back to when Numba's own has no
entry: ``_portable_kernels/`` in the package (``ENTROPYKIT_PORTABLE_KERNELS`` names another
directory; empty turns it off), laid out by the source file's place in the package and
keyed on the source's content, holding code for the baseline CPU of the architecture
(``generic``, plus PCLMULQDQ on x86-64: Intel since 2010, AMD since 2011). ``build`` fills it
(``python -m entropykit.warmup --portable``: before building a wheel or an image). A
process that loads a kernel from it starts, at exit, a low-priority background process that
compiles those kernels for this CPU into Numba's own cache, which later processes prefer
(``ENTROPYKIT_BACKGROUND_COMPILE=0`` turns that off). Same code, same bytes: the portable
kernels only lack the newer vector instructions.
What it is not: Numba's own cache location (``entropykit._jit``), or which kernels are
compiled ahead (``entropykit.warmup``).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import inspect
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence

import numba
from llvmlite import binding
from numba.core import caching, dispatcher

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(_PACKAGE, "_portable_kernels")
_DIR_ENV = "ENTROPYKIT_PORTABLE_KERNELS"
_BACKGROUND_ENV = "ENTROPYKIT_BACKGROUND_COMPILE"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
CPU_NAME = "generic"
CPU_FEATURES = "+pclmul" if _X86 else ""  # the CRC-32 kernel's carry-less multiply

_IndexFile = getattr(caching, "IndexDataCacheFile", None) or caching._IndexDataCacheFile
_lock = threading.Lock()
_loaded: list[tuple[str, str, tuple]] = []  # (module, qualname, argument types)


def directory() -> str | None:
    """The portable cache this process reads, or None when it is turned off."""
    return os.environ.get(_DIR_ENV, DEFAULT_DIR) or None


def loads() -> int:
    """How many kernels this process loaded from the portable cache."""
    with _lock:
        return len(_loaded)


@functools.cache
def _host_runs_it() -> bool:
    features = binding.get_host_cpu_features()
    return all(features.get(f.lstrip("+")) for f in CPU_FEATURES.split(",") if f)


@functools.cache
def _stamp(path: str, mtime: float, size: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _source_stamp(path: str) -> bytes:
    st = os.stat(path)
    return _stamp(path, st.st_mtime, st.st_size)


@functools.cache
def _package_stamp() -> bytes:
    """Digest of every Python source of the package (names and contents), once a process."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, _PACKAGE).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.digest()


def _subdir(source_dir: str) -> str:
    """Where a source directory's kernels sit in the portable cache: its place in the
    package, so that the cache holds wherever the package is installed."""
    rel = os.path.relpath(source_dir, _PACKAGE)
    return "_" if rel == os.curdir else rel.replace(os.sep, "/")


class _KernelCache(caching.FunctionCache):
    """Numba's cache; for the package's kernels, the portable cache after a miss."""

    def __init__(self, py_func) -> None:  # noqa: ANN001 (Numba's signature)
        super().__init__(py_func)
        self._source = None
        if getattr(py_func, "__module__", "").startswith("entropykit."):
            source = os.path.abspath(inspect.getfile(py_func))
            if os.path.commonpath([_PACKAGE, source]) == _PACKAGE:
                self._source = source
                # Numba stamps an entry with its own file only, but kernels inline helpers
                # from other modules of the package: an entry is fresh only for the
                # package's sources as they were when it was compiled.
                self._cache_file._source_stamp = (self._cache_file._source_stamp,
                                                  _package_stamp())

    def _load_overload(self, sig, target_context):  # noqa: ANN001, ANN202
        cres = super()._load_overload(sig, target_context)
        if cres is None and self._source is not None and self._enabled:
            cres = self._load_portable(sig, target_context)
        return cres

    def _load_portable(self, sig, target_context):  # noqa: ANN001, ANN202
        root = directory()
        if root is None or not _host_runs_it():
            return None
        codegen = target_context.codegen()
        key = self._index_key(sig, codegen)
        key = (key[0], (codegen.magic_tuple()[0], CPU_NAME, CPU_FEATURES), *key[2:])
        path = os.path.join(root, _subdir(os.path.dirname(self._source)))
        try:
            payload = _IndexFile(path, self._impl.filename_base,
                                 _source_stamp(self._source)).load(key)
            cres = None if payload is None else self._impl.rebuild(target_context, payload)
        except Exception:  # a damaged or foreign file: compile instead
            return None
        if cres is not None:
            _note(self._py_func, key[0])
        return cres


def _note(py_func, args: tuple) -> None:  # noqa: ANN001
    with _lock:
        if not _loaded:
            atexit.register(_compile_native_later)
        _loaded.append((py_func.__module__, py_func.__qualname__, args))


def _compile_native_later() -> None:
    """Start the background process that compiles what came from the portable cache."""
    if os.environ.get(_BACKGROUND_ENV, "1") == "0":
        return
    with _lock:
        todo = list(_loaded)
    try:
        fd, path = tempfile.mkstemp(prefix="entropykit-native-", suffix=".pickle")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(todo, f)
        env = {**os.environ, _DIR_ENV: "",
               "PYTHONPATH": os.pathsep.join(
                   [os.path.dirname(_PACKAGE), *filter(None, [os.environ.get("PYTHONPATH")])])}
        subprocess.Popen(
            [sys.executable, "-c", "import sys; from entropykit import _portable; "
             "_portable._compile_native(sys.argv[1])", path],
            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        pass  # later runs load the portable code again


def _compile_native(path: str) -> None:
    """In the background process: compile the kernels listed in ``path`` for this CPU
    (Numba saves each in its cache as it goes: an interrupted run leaves whole entries)."""
    import importlib

    try:
        os.nice(10)  # behind whatever the user runs next
    except (AttributeError, OSError):
        pass
    try:
        with open(path, "rb") as f:
            todo = pickle.load(f)
    finally:
        os.unlink(path)
    for module, qualname, args in todo:
        try:
            obj = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
            obj.compile(args)
        except Exception:  # noqa: S112 - a kernel that moved or changed: the next run says
            continue


def build(argv: Sequence[str], target: str | None = None) -> str:
    """Run ``python argv`` compiling for the portable CPU, then make what it compiled the
    portable cache ``target`` (default: the package's), replacing the one there. The new
    cache is assembled beside it and swapped in: an interrupted build leaves the old one or
    none, never a partial one. Returns ``target``."""
    target = os.path.abspath(target or DEFAULT_DIR)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".ek-portable-", dir=parent)
    try:
        numba_dir = os.path.join(staging, "numba")
        env = {**os.environ, "NUMBA_CPU_NAME": CPU_NAME, "NUMBA_CPU_FEATURES": CPU_FEATURES,
               "NUMBA_CACHE_DIR": numba_dir, _DIR_ENV: "", _BACKGROUND_ENV: "0",
               "PYTHONPATH": os.pathsep.join(
                   [os.path.dirname(_PACKAGE), *filter(None, [os.environ.get("PYTHONPATH")])])}
        subprocess.run([sys.executable, *argv], env=env, check=True)
        new = os.path.join(staging, "portable")
        _relayout(numba_dir, new)
        old = os.path.join(staging, "old")
        if os.path.exists(target):
            os.rename(target, old)
        os.rename(new, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _relayout(numba_dir: str, out: str) -> None:
    """Numba's cache of the package's kernels (``numba_dir``, laid out by absolute source
    directory, stamped as this Numba stamps) as the portable layout, stamped by content."""
    os.makedirs(out)
    for source_dir, _, names in os.walk(_PACKAGE):
        sources = [n for n in names if n.endswith(".py")]
        if not sources:
            continue
        sub = caching._CacheLocator.get_suitable_cache_subpath(
            os.path.join(source_dir, sources[0]))
        src = os.path.join(numba_dir, sub)
        if not os.path.isdir(src) or not os.listdir(src):
            continue
        dst = os.path.join(out, _subdir(source_dir))
        os.makedirs(dst)
        by_module = {os.path.splitext(n)[0]: os.path.join(source_dir, n) for n in sources}
        for name in sorted(os.listdir(src)):
            if name.endswith(".nbc"):
                shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
            elif name.endswith(".nbi"):
                with open(os.path.join(src, name), "rb") as f:
                    if pickle.load(f) != numba.__version__:
                        continue
                    _, overloads = pickle.loads(f.read())
                base = name[: -len(".nbi")]
                _IndexFile(dst, base, _source_stamp(by_module[base.split(".")[0]])
                           )._save_index(overloads)


def install() -> None:
    """Make the dispatchers defined from now on use ``_KernelCache`` (which behaves as
    Numba's own for every function outside the package)."""
    if dispatcher.FunctionCache is caching.FunctionCache:
        dispatcher.FunctionCache = _KernelCache
