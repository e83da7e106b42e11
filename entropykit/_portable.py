"""Compiled kernels that need no compiling: a cache built for portable CPUs, shipped beside
the package, and the native compile it stands in for until that is cached.

What it is: Numba caches a kernel's machine code for the CPU it compiled on (its name and
features are part of every cache key), under a path derived from where the package is
installed, so a cache cannot travel from one machine or install to another. This module
adds a second, read-only cache the package's kernels fall back to when Numba's own has no
entry: ``_portable_kernels/`` in the package (``ENTROPYKIT_PORTABLE_KERNELS`` names another
directory; empty turns it off), keyed on the package's sources by content and laid out by
*tier* (``TIERS``), then by the source file's place in the package. On x86-64 the tiers are
``x86-64-v3`` (AVX2, FMA, BMI2: Intel since 2013, AMD since 2015; it runs the AVX2 rANS
step) and ``baseline`` (x86-64 plus PCLMULQDQ: Intel since 2010, AMD since 2011); other
architectures have the baseline (``generic``) only. A process reads the best tier its CPU
runs, the others after a miss. ``manifest.json`` records the Python, Numba and llvmlite the
cache was built with: under any other, the cache is not read, and a line on stderr says so.
``build`` fills it (``python -m entropykit.warmup --portable``; the wheel's build hook runs
it). A process that loads a kernel from it starts, at exit, a low-priority background
process that compiles those kernels for this CPU into Numba's own cache, which later
processes prefer (``ENTROPYKIT_BACKGROUND_COMPILE=0`` turns that off). Same code, same
bytes: the portable kernels only lack the newer vector instructions.
What it is not: Numba's own cache location (``entropykit._jit``), or which kernels are
compiled ahead (``entropykit.warmup``).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import inspect
import json
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import llvmlite
import numba
from llvmlite import binding
from numba.core import caching, dispatcher

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_DIR = os.path.join(_PACKAGE, "_portable_kernels")
_DIR_ENV = "ENTROPYKIT_PORTABLE_KERNELS"
_BACKGROUND_ENV = "ENTROPYKIT_BACKGROUND_COMPILE"
_X86 = platform.machine().lower() in ("x86_64", "amd64")
MANIFEST = "manifest.json"


class Tier(NamedTuple):
    """A CPU the portable cache holds code for: ``name`` (its directory), and the
    ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` it is compiled with. Every feature the CPU
    name implies is listed, so that a CPU runs the tier's code exactly when it has them all
    (and the kernels that choose code by feature, such as the rANS step, see them)."""

    name: str
    cpu_name: str
    cpu_features: str


_PCLMUL = "+pclmul"  # the CRC-32 kernel's carry-less multiply
_V3 = ("+avx,+avx2,+bmi,+bmi2,+cx16,+f16c,+fma,+lzcnt,+movbe,+popcnt,+sahf,+sse3,+sse4.1,"
       "+sse4.2,+ssse3,+xsave")
TIERS: tuple[Tier, ...] = (
    (Tier("x86-64-v3", "x86-64-v3", f"{_PCLMUL},{_V3}"), Tier("baseline", "generic", _PCLMUL))
    if _X86 else (Tier("baseline", "generic", ""),))

_IndexFile = getattr(caching, "IndexDataCacheFile", None) or caching._IndexDataCacheFile
_lock = threading.Lock()
_loaded: list[tuple[str, str, tuple]] = []  # (module, qualname, argument types)
_tiers_loaded: list[str] = []


def directory() -> str | None:
    """The portable cache this process reads, or None when it is turned off."""
    return os.environ.get(_DIR_ENV, DEFAULT_DIR) or None


def loads() -> int:
    """How many kernels this process loaded from the portable cache."""
    with _lock:
        return len(_loaded)


def runnable(features: Mapping[str, bool]) -> tuple[Tier, ...]:
    """The tiers a CPU with ``features`` (LLVM's names, as ``get_host_cpu_features``) runs,
    best first."""
    return tuple(t for t in TIERS
                 if all(features.get(f.lstrip("+")) for f in t.cpu_features.split(",") if f))


@functools.cache
def host_tiers() -> tuple[Tier, ...]:
    """The tiers this CPU runs, best first: the order a kernel is looked up in."""
    return runnable(binding.get_host_cpu_features())


def _versions() -> dict[str, str]:
    """What a portable cache is valid for: the Python (its files are named after it), Numba
    (its index files) and llvmlite (the machine code's linking) it was built with."""
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "numba": numba.__version__, "llvmlite": llvmlite.__version__,
            "machine": platform.machine().lower()}


def _describe(v: Mapping[str, str]) -> str:
    return (f"Python {v.get('python')}, numba {v.get('numba')}, llvmlite {v.get('llvmlite')} "
            f"on {v.get('machine')}")


@functools.cache
def _usable(root: str) -> bool:
    """Whether the portable cache at ``root`` was built for this Python, Numba and llvmlite;
    where it was not, say so on stderr, once (a process then compiles, as without it)."""
    if not os.path.isdir(root):
        return False
    here = _versions()
    try:
        with open(os.path.join(root, MANIFEST), encoding="utf-8") as f:
            built = json.load(f)["versions"]
        if not isinstance(built, dict):
            raise TypeError("versions is not a mapping")
        ok = all(built.get(k) == v for k, v in here.items())
    except (OSError, ValueError, KeyError, TypeError):
        built, ok = {}, False
    if not ok:
        why = (f"built for {_describe(built)}" if built else "without a readable manifest")
        try:
            print(f"entropykit: the shipped kernels in {root} are {why}; this is "
                  f"{_describe(here)}: compiling kernels instead (cached after the first run)"
                  f"{_remedy(built, here)}", file=sys.stderr, flush=True)
        except (AttributeError, OSError, ValueError):  # no stderr, or a closed one
            pass
    return ok


def _remedy(built: Mapping[str, str], here: Mapping[str, str]) -> str:
    """How to use the shipped kernels after all, where only Numba and llvmlite differ:
    the package does not pin them, so that it installs beside any other that needs
    another release of them."""
    if not built or any(built.get(k) != here[k] for k in ("python", "machine")):
        return ""
    return (f"; `pip install numba=={built.get('numba')} llvmlite=={built.get('llvmlite')}` "
            f"would use them")


@functools.cache
def _stamp(path: str, mtime: float, size: int) -> bytes:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).digest()


def _source_stamp(path: str) -> bytes:
    st = os.stat(path)
    return _stamp(path, st.st_mtime, st.st_size)


def _stamp_of(source: str) -> tuple[bytes, bytes]:
    """A portable entry's stamp: its source file and, since kernels inline helpers from
    other modules, every source of the package, by content."""
    return _source_stamp(source), _package_stamp()


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
        if root is None or not _usable(root):
            return None
        codegen = target_context.codegen()
        key = self._index_key(sig, codegen)
        sub = _subdir(os.path.dirname(self._source))
        for tier in host_tiers():
            tier_key = (key[0], (codegen.magic_tuple()[0], tier.cpu_name, tier.cpu_features),
                        *key[2:])
            try:
                payload = _IndexFile(os.path.join(root, tier.name, sub),
                                     self._impl.filename_base, _stamp_of(self._source)
                                     ).load(tier_key)
                cres = None if payload is None else self._impl.rebuild(target_context, payload)
            except Exception:  # a damaged or foreign file: the next tier, or compile
                continue
            if cres is not None:
                _note(self._py_func, key[0], tier.name)
                return cres
        return None


def _note(py_func, args: tuple, tier: str) -> None:  # noqa: ANN001
    with _lock:
        if not _loaded:
            atexit.register(_compile_native_later)
        _loaded.append((py_func.__module__, py_func.__qualname__, args))
        _tiers_loaded.append(tier)


def tiers_loaded() -> list[str]:
    """The tier of each kernel this process loaded from the portable cache, in order."""
    with _lock:
        return list(_tiers_loaded)


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


def build(argv: Sequence[str], target: str | None = None,
          tiers: Sequence[Tier] | None = None) -> str:
    """Run ``python argv`` once for each of ``tiers`` (default: every tier this CPU runs,
    since ``argv`` runs the code it compiles), compiling for its CPU, then make what they
    compiled the portable cache ``target`` (default: the package's), replacing the one
    there. The new cache is assembled beside it and swapped in: an interrupted build leaves
    the old one or none, never a partial one. Returns ``target``."""
    tiers = host_tiers() if tiers is None else tiers
    target = os.path.abspath(target or DEFAULT_DIR)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".ek-portable-", dir=parent)
    try:
        new = os.path.join(staging, "portable")
        os.makedirs(new)
        for tier in tiers:
            numba_dir = os.path.join(staging, "numba", tier.name)
            env = {**os.environ, "NUMBA_CPU_NAME": tier.cpu_name,
                   "NUMBA_CPU_FEATURES": tier.cpu_features, "NUMBA_CACHE_DIR": numba_dir,
                   _DIR_ENV: "", _BACKGROUND_ENV: "0",
                   "PYTHONPATH": os.pathsep.join(
                       [os.path.dirname(_PACKAGE), *filter(None, [os.environ.get("PYTHONPATH")])])}
            subprocess.run([sys.executable, *argv], env=env, check=True)
            _relayout(numba_dir, os.path.join(new, tier.name))
        with open(os.path.join(new, MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"versions": _versions(), "tiers": [t._asdict() for t in tiers]}, f,
                      indent=1, sort_keys=True)
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
                _IndexFile(dst, base, _stamp_of(by_module[base.split(".")[0]])
                           )._save_index(overloads)


def install() -> None:
    """Make the dispatchers defined from now on use ``_KernelCache`` (which behaves as
    Numba's own for every function outside the package)."""
    if dispatcher.FunctionCache is caching.FunctionCache:
        dispatcher.FunctionCache = _KernelCache
