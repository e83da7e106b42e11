"""Atomic output: write under a temporary name next to the target, rename on success.

What it is: context managers that hand out a temporary file (or directory) in the target's
own directory and, when the block succeeds, flush it to disk and rename it over the
target; on any error (KeyboardInterrupt included) the temporary is removed, so no partial
output is ever left under the target's name. What it is not: a lock; two writers racing
for one target each write whole files and the last rename wins.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def check_target(dst: Path, force: bool) -> None:
    """FileExistsError if ``dst`` exists and ``force`` is not set; FileNotFoundError if its
    directory does not exist."""
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"{dst}: output directory {dst.parent} does not exist")
    if (dst.exists() or dst.is_symlink()) and not force:
        raise FileExistsError(f"{dst}: output exists (use --force / force=True to overwrite)")


def _temp_name(dst: Path) -> tuple[str, str]:
    return f".{dst.name}.", ".ek-tmp"


def _umask() -> int:
    mask = os.umask(0o22)
    os.umask(mask)
    return mask


@contextmanager
def output_file(dst: Path, force: bool = False) -> Iterator[BinaryIO]:
    """A binary file to write ``dst`` through; renamed over ``dst`` when the block exits."""
    check_target(dst, force)
    pre, suf = _temp_name(dst)
    fd, tmp = tempfile.mkstemp(prefix=pre, suffix=suf, dir=dst.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual mode
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        check_target(dst, force)  # someone may have created it meanwhile
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def output_dir(dst: Path, force: bool = False) -> Iterator[Path]:
    """A directory to fill in place of ``dst``; swapped in when the block exits.

    With ``force`` an existing ``dst`` is moved aside first and deleted after the swap.
    """
    check_target(dst, force)
    pre, suf = _temp_name(dst)
    tmp = Path(tempfile.mkdtemp(prefix=pre, suffix=suf, dir=dst.parent))
    try:
        tmp.chmod(0o777 & ~_umask())
        yield tmp
        old = None
        if dst.exists() or dst.is_symlink():
            check_target(dst, force)
            old = Path(tempfile.mkdtemp(prefix=pre, suffix=".ek-old", dir=dst.parent))
            os.replace(dst, old / "x")
        os.replace(tmp, dst)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
