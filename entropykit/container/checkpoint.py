"""Checkpoint directories: compress, decompress or verify every safetensors file in one.

What it is: the directory versions of ``files.py``. Every ``*.safetensors`` file (in
subdirectories too) is compressed under the same relative name and every other file is
copied unchanged (the top-level ``config.json`` gets the mark that lets transformers load
the output, ``config_mark``), so a sharded checkpoint's ``*.safetensors.index.json``
stays valid as it is (its file names do not change) and decompressing gives back the
directory file for file, byte for byte. A new output directory is filled under a
temporary name and renamed when complete; into an existing one (``force``) only the files
the run writes are replaced (``_atomic.output_dir``). What it is not: a model loader; it
never interprets the tensors.

What is read (``scan``), so that nothing outside the directory is ever read or written
and nothing is left out silently:

- regular files: ``*.safetensors`` are coded (compress copies one that is already
  compressed, with a warning), the rest copied;
- symbolic links (to files or directories, dangling, or loops) are kept as links, never
  followed, if they are relative and resolve inside the directory (so that the copy's
  links resolve inside the copy); an absolute one, or one resolving outside, is refused;
- anything else (a FIFO, socket or device, whatever its name) is refused, never opened;
- entropykit temporaries (``.*.ek-tmp``) are skipped, with a warning naming them;
- an index's ``weight_map`` must name shards inside the directory (no absolute paths, no
  ``..`` leading out), all present; a directory without any safetensors file is refused.

Refusals are ``ValueError`` (``CorruptDataError`` for verify), raised before any output.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .. import _jit
from .._errors import CorruptDataError
from . import _atomic, config_mark, files
from .reader import Progress
from .stats import Summary

INDEX_SUFFIX = ".safetensors.index.json"


@dataclass
class Tree:
    """What a checkpoint directory holds, as sorted relative paths."""

    safetensors: list[Path] = field(default_factory=list)  # regular *.safetensors files
    other: list[Path] = field(default_factory=list)  # other regular files
    links: list[Path] = field(default_factory=list)  # symbolic links, kept as links
    skipped: list[Path] = field(default_factory=list)  # entropykit temporaries

    def names(self) -> list[Path]:
        return sorted(self.safetensors + self.other + self.links)


def scan(root: Path) -> Tree:
    """The files under ``root`` by the module's rules; ValueError for anything refused."""
    root = Path(root)
    real = os.path.realpath(root)
    tree = Tree()

    def visit(d: Path, rel: Path) -> None:
        with os.scandir(d) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            r = rel / e.name
            if _atomic.is_temp(e.name):
                tree.skipped.append(r)
                continue
            mode = e.stat(follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                text = os.readlink(e.path)
                target = os.path.realpath(e.path)
                if os.path.isabs(text) or os.path.commonpath([real, target]) != real:
                    raise ValueError(f"{root / r}: symbolic link to {text}, outside {root} "
                                     f"or absolute; refusing to follow or copy it")
                tree.links.append(r)
            elif stat.S_ISDIR(mode):
                visit(Path(e.path), r)
            elif stat.S_ISREG(mode):
                (tree.safetensors if e.name.endswith(files.SUFFIX) else tree.other).append(r)
            else:
                raise ValueError(f"{root / r}: not a regular file, directory or link; "
                                 f"refusing to read it")

    visit(root, Path())
    return tree


def walk(root: Path) -> tuple[list[Path], list[Path]]:
    """(safetensors files, other regular files) under ``root`` (``scan``'s rules)."""
    tree = scan(root)
    return tree.safetensors, tree.other


def check_shards(root: Path, tree: Tree | None = None) -> None:
    """ValueError if an index is not a JSON object with a ``weight_map`` or names a shard
    outside ``root``; FileNotFoundError naming the index and shard if a shard is missing.
    Shard names are checked against ``tree`` (``scan(root)``), never looked up on disk."""
    tree = scan(root) if tree is None else tree
    present = set(tree.names())
    for rel in tree.other:
        if not rel.name.endswith(INDEX_SUFFIX):
            continue
        index = root / rel
        try:
            weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no weight_map: {e})") from None
        for shard in shards:
            if not isinstance(shard, str):
                raise ValueError(f"{index}: shard name {shard!r} is not a string")
            name = os.path.normpath(PurePosixPath(rel.parent, shard).as_posix())
            if os.path.isabs(shard) or name == ".." or name.startswith("../"):
                raise ValueError(f"{index}: shard {shard} lies outside {root}; refused")
            if Path(name) not in present:
                raise FileNotFoundError(f"{index}: shard {shard} is missing")


def inputs(root: Path) -> Tree:
    """``scan`` plus the checks every verb makes on an input directory: its shards,
    something to do (ValueError if no safetensors file), a warning naming what is
    skipped."""
    tree = scan(root)
    check_shards(root, tree)
    if not tree.safetensors:
        raise ValueError(f"{root}: no *.safetensors files in this directory; nothing to do")
    if tree.skipped:
        names = ", ".join(str(p) for p in tree.skipped)
        warnings.warn(f"{root}: skipped entropykit temporaries: {names}", stacklevel=3)
    return tree


def _offset(progress: Progress | None, base: int, size: int, total: int
            ) -> Progress | None:
    """One file's progress as part of a directory's: the file weighs its size on disk."""
    if progress is None:
        return None
    return lambda done, of: progress(base + (size * done // of if of else size), total)


def _each(src: Path, dst: Path | None, default: Path, force: bool,
          one: Callable[[Path, Path, Progress | None], Summary],
          progress: Progress | None,
          finish: Callable[[Path, Path], None] | None = None,
          copied: Callable[[Path], bool] | None = None) -> Summary:
    """Run ``one(src_file, dst_file, progress)`` on every safetensors file (those for
    which ``copied(src_file)`` holds are copied instead, with a warning), copy the other
    files, recreate the links, then ``finish(src, output)`` before the output is in
    place. A ``progress`` with a ``start_file(name, size)`` method is told of each file."""
    dst = default if dst is None else Path(dst)
    _atomic.check_distinct(src, dst)
    tree = inputs(src)
    if copied is not None:
        kept = [r for r in tree.safetensors if copied(src / r)]
        if kept:
            tree.safetensors = [r for r in tree.safetensors if r not in kept]
            tree.other = sorted(tree.other + kept)
            warnings.warn(f"{src}: already entropykit-compressed, copied unchanged: "
                          f"{', '.join(str(r) for r in kept)}", stacklevel=3)
    total = sum((src / r).stat().st_size for r in tree.safetensors)
    summary = Summary()
    elapsed = _jit.stopwatch()
    start_file = getattr(progress, "start_file", None)
    with _atomic.output_dir(dst, force, tree.names()) as tmp:
        base = 0
        for rel in tree.safetensors:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            size = (src / rel).stat().st_size
            if start_file is not None:
                start_file(str(rel), size)
            summary.merge(one(src / rel, tmp / rel, _offset(progress, base, size, total)))
            base += size
        for rel in tree.other:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, tmp / rel, follow_symlinks=False)
        for rel in tree.links:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src / rel), tmp / rel)
        if finish is not None:
            finish(src, tmp)
    summary.seconds = elapsed()
    return summary


def compress_dir(src: Path, dst: Path | None = None, *, threads: int | None = None,
                 force: bool = False, progress: Progress | None = None,
                 fast: bool = False, target: str = "cpu") -> Summary:
    """Compress checkpoint directory ``src`` into ``dst`` (default ``<src>.ek``); ``fast``
    and ``target`` as for ``files.compress_file``. A safetensors file that is already
    entropykit-compressed is copied unchanged, with a warning (decompressing the output
    then restores it too)."""
    src = Path(src)
    return _each(src, dst, files.default_output(src, True), force,
                 lambda s, d, p: files.compress_file(s, d, threads=threads, progress=p,
                                                     fast=fast, target=target),
                 progress, config_mark.mark_dir, files.is_compressed_file)


def decompress_dir(src: Path, dst: Path | None = None, *, threads: int | None = None,
                   force: bool = False, progress: Progress | None = None) -> Summary:
    """Restore the original of compressed directory ``src`` in ``dst``."""
    src = Path(src)
    return _each(src, dst, files.default_output(src, False), force,
                 lambda s, d, p: files.decompress_file(s, d, threads=threads, progress=p),
                 progress, config_mark.unmark_dir)


def verify_dir(path: Path, against: Path | None = None, *, threads: int | None = None,
               progress: Progress | None = None) -> Summary:
    """Verify every compressed file in ``path``; with ``against`` also check that the
    directories hold the same files and links and every file restores to its original
    exactly."""
    path = Path(path)
    tree = inputs(path)
    if against is not None:
        against = Path(against)
        theirs = scan(against)
        if tree.names() != theirs.names() or tree.links != theirs.links:
            diff = sorted(set(tree.names()) ^ set(theirs.names())) or sorted(
                set(tree.links) ^ set(theirs.links))
            raise CorruptDataError(f"{path}: files differ from {against}: {diff[:5]}")
        for rel in tree.other:
            mine = (path / rel).read_bytes()
            if rel == Path(config_mark.CONFIG):  # the marked config.json restores to its original
                mine = config_mark.unmarked(mine) or mine
            if mine != (against / rel).read_bytes():
                raise CorruptDataError(f"{path / rel}: differs from {against / rel}")
        for rel in tree.links:
            if os.readlink(path / rel) != os.readlink(against / rel):
                raise CorruptDataError(f"{path / rel}: link differs from {against / rel}")
    total = sum((path / r).stat().st_size for r in tree.safetensors)
    summary = Summary()
    elapsed = _jit.stopwatch()
    base = 0
    for rel in tree.safetensors:
        ref = None if against is None else against / rel
        size = (path / rel).stat().st_size
        summary.merge(files.verify_file(path / rel, ref, threads=threads,
                                        progress=_offset(progress, base, size, total)))
        base += size
    summary.seconds = elapsed()
    return summary
