"""Checkpoint directories: compress, decompress or verify every safetensors file in one.

What it is: the directory versions of ``files.py``. Every ``*.safetensors`` file (in
subdirectories too) is compressed under the same relative name and every other file is
copied unchanged (the top-level ``config.json`` gets the mark that lets transformers load
the output, ``entropykit.hf``), so a sharded checkpoint's ``*.safetensors.index.json``
stays valid as it is (its file names do not change) and decompressing gives back the
directory file for file, byte for byte. Shards named by an index must all be present.
The output directory is filled under a temporary name and renamed when complete. What it
is not: a model loader; it never interprets the tensors.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from .. import hf
from .._errors import CorruptDataError
from . import _atomic, files
from .reader import Progress
from .stats import Summary

INDEX_SUFFIX = ".safetensors.index.json"


def walk(root: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, other files) under ``root``, as sorted relative paths."""
    st, other = [], []
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            continue
        rel = p.relative_to(root)
        (st if p.name.endswith(files.SUFFIX) else other).append(rel)
    return st, other


def check_shards(root: Path) -> None:
    """FileNotFoundError naming the index and shard if an index names a missing shard;
    ValueError if an index is not a JSON object with a ``weight_map``."""
    for index in sorted(root.rglob("*" + INDEX_SUFFIX)):
        try:
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        for shard in shards:
            if not isinstance(shard, str) or not (index.parent / shard).is_file():
                raise FileNotFoundError(f"{index}: shard {shard} is missing")


def _offset(progress: Progress | None, base: int, size: int, total: int
            ) -> Progress | None:
    """One file's progress as part of a directory's: the file weighs its size on disk."""
    if progress is None:
        return None
    return lambda done, of: progress(base + (size * done // of if of else size), total)


def _each(src: Path, dst: Path | None, default: Path, force: bool,
          one: Callable[[Path, Path, Progress | None], Summary],
          progress: Progress | None,
          finish: Callable[[Path, Path], None] | None = None) -> Summary:
    """Run ``one(src_file, dst_file, progress)`` on every safetensors file, copy the rest,
    then ``finish(src, output)`` before the output gets its name."""
    dst = default if dst is None else Path(dst)
    if dst.resolve() == src.resolve() or src.resolve() in dst.resolve().parents:
        raise ValueError(f"{dst}: output directory would be inside or equal to the input")
    check_shards(src)
    st, other = walk(src)
    total = sum((src / r).stat().st_size for r in st)
    summary = Summary()
    t0 = time.perf_counter()
    with _atomic.output_dir(dst, force) as tmp:
        base = 0
        for rel in st:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            size = (src / rel).stat().st_size
            summary.merge(one(src / rel, tmp / rel, _offset(progress, base, size, total)))
            base += size
        for rel in other:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, tmp / rel)
        if finish is not None:
            finish(src, tmp)
    summary.seconds = time.perf_counter() - t0
    return summary


def compress_dir(src: Path, dst: Path | None = None, *, threads: int | None = None,
                 force: bool = False, progress: Progress | None = None,
                 fast: bool = False, target: str = "cpu") -> Summary:
    """Compress checkpoint directory ``src`` into ``dst`` (default ``<src>.ek``); ``fast``
    and ``target`` as for ``files.compress_file``."""
    src = Path(src)
    return _each(src, dst, files.default_output(src, True), force,
                 lambda s, d, p: files.compress_file(s, d, threads=threads, progress=p,
                                                     fast=fast, target=target),
                 progress, hf.mark_dir)


def decompress_dir(src: Path, dst: Path | None = None, *, threads: int | None = None,
                   force: bool = False, progress: Progress | None = None) -> Summary:
    """Restore the original of compressed directory ``src`` in ``dst``."""
    src = Path(src)
    return _each(src, dst, files.default_output(src, False), force,
                 lambda s, d, p: files.decompress_file(s, d, threads=threads, progress=p),
                 progress, hf.unmark_dir)


def verify_dir(path: Path, against: Path | None = None, *, threads: int | None = None,
               progress: Progress | None = None) -> Summary:
    """Verify every compressed file in ``path``; with ``against`` also check that the
    directories hold the same files and every file restores to its original exactly."""
    path = Path(path)
    check_shards(path)
    st, other = walk(path)
    if against is not None:
        against = Path(against)
        theirs = walk(against)
        if (st, other) != theirs:
            diff = sorted(set(st + other) ^ set(theirs[0] + theirs[1]))
            raise CorruptDataError(f"{path}: files differ from {against}: {diff[:5]}")
        for rel in other:
            mine = (path / rel).read_bytes()
            if rel == Path(hf.CONFIG):  # the marked config.json restores to its original
                mine = hf.unmarked(mine) or mine
            if mine != (against / rel).read_bytes():
                raise CorruptDataError(f"{path / rel}: differs from {against / rel}")
    total = sum((path / r).stat().st_size for r in st)
    summary = Summary()
    t0 = time.perf_counter()
    base = 0
    for rel in st:
        ref = None if against is None else against / rel
        size = (path / rel).stat().st_size
        summary.merge(files.verify_file(path / rel, ref, threads=threads,
                                        progress=_offset(progress, base, size, total)))
        base += size
    summary.seconds = time.perf_counter() - t0
    return summary
