"""Compress, decompress and verify single safetensors files on disk.

What it is: the file-level operations: read the input (``source.FileBytes``: read with
``pread`` in the pieces needed, a segment at a time, never mapped, so files larger than
RAM stream through), write through ``_atomic`` (temporary name, rename; nothing left
behind on error; the input is never written; standard output as an ``_atomic.Stream``),
default output names, and errors that name the file (``shown``: a spooled standard input
is named ``<stdin>``). Inputs must be regular files; one that is shorter than its header
says when a piece is read, or that changes size or modification time before the output
is renamed, fails the run with one line and no output. What it is not: the coding
(``writer``/``reader``) or directories (``checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .. import _jit
from .._errors import CorruptDataError
from . import _atomic
from . import header as hdr
from .parallel import resolve
from .reader import Compressed, Progress, claim, read_header
from .source import FileBytes, Window
from .stats import Summary
from .writer import SEGMENT_BYTES, Source, write

OutputRefused = _atomic.OutputRefused

SUFFIX = ".safetensors"
MARK = ".ek"


# Extensions a safetensors file is sometimes saved under; ``NAME.ek.safetensors`` of such a
# NAME decompresses back to NAME rather than to NAME.safetensors.
KEPT_EXTENSIONS = (".bin", ".pt", ".pth", ".ckpt", ".dat", ".raw", ".weights")


def default_output(src: Path, compress: bool) -> Path:
    """The name compress or decompress writes when none is given.

    Files: ``a.safetensors`` <-> ``a.ek.safetensors``; any other NAME compresses to
    ``NAME.ek.safetensors``, which decompresses to NAME when NAME ends in one of
    ``KEPT_EXTENSIONS`` (``weights.bin`` round-trips), else to ``NAME.safetensors``. A
    file without the ``.ek`` mark decompresses to ``NAME.restored.safetensors``.
    Directories: ``d`` <-> ``d.ek`` (``d.restored`` without the mark).
    """
    name = src.name
    if src.is_dir():
        if compress:
            return src.with_name(name + MARK)
        return src.with_name(name[: -len(MARK)] if name.endswith(MARK) else name + ".restored")
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    if compress:
        return src.with_name(stem + MARK + SUFFIX)
    if stem.endswith(MARK) and len(stem) > len(MARK):
        base = stem[: -len(MARK)]
        kept = Path(base).suffix.lower() in KEPT_EXTENSIONS
        return src.with_name(base if kept else base + SUFFIX)
    return src.with_name(stem + ".restored" + SUFFIX)


@contextmanager
def named(path: Path | str) -> Iterator[None]:
    """Re-raise data errors with the file's name in front (type kept)."""
    try:
        yield
    except _atomic.OutputRefused:
        raise  # names the output already
    except CorruptDataError as e:
        raise CorruptDataError(f"{path}: {e}") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def opened(path: Path | str) -> FileBytes:
    """Input ``path`` opened for reading (a context manager); ValueError if it is not a
    regular file."""
    return FileBytes(path)


def source(buf: np.ndarray) -> Source:
    """A ``writer.Source`` over a whole safetensors file held in ``buf``."""
    h = hdr.parse_file(memoryview(buf))
    start = h.data_start
    return Source(h, lambda e: buf[start + e.begin : start + e.end])


def _read_source(f: FileBytes) -> Source:
    """A ``writer.Source`` over input file ``f``, read segment by segment."""
    h = read_header(f)
    start = h.data_start
    return Source(h, lambda e: Window(f, start + e.begin, e.nbytes))


Output = Path | _atomic.Stream


def _target(src: Path, dst: Path | str | _atomic.Stream | None, compress: bool) -> Output:
    """``dst`` as a Path (``default_output`` if None) or a Stream, checked apart from ``src``."""
    if isinstance(dst, _atomic.Stream):
        return dst
    dst = default_output(src, compress) if dst is None else Path(dst)
    _atomic.check_distinct(src, dst)
    return dst


def compress_file(src: Path, dst: Path | None = None, *, threads: int | None = None,
                  force: bool = False, progress: Progress | None = None,
                  segment_bytes: int = SEGMENT_BYTES, fast: bool = False,
                  target: str = "cpu") -> Summary:
    """Compress safetensors file ``src`` to ``dst`` (default ``default_output``); ``fast``
    stores near-incompressible fields raw (``codecs.FAST_MIN_SAVING``); ``target="gpu"``
    writes what ``entropykit.gpu`` decodes fastest (``codecs.choose``)."""
    return compress_as(Path(src), dst, Path(src), threads=threads, force=force,
                       progress=progress, segment_bytes=segment_bytes, fast=fast,
                       target=target)


def compress_as(src: Path, dst: Path | _atomic.Stream | None, shown: Path | str, *,
                threads: int | None = None, force: bool = False,
                progress: Progress | None = None, segment_bytes: int = SEGMENT_BYTES,
                fast: bool = False, target: str = "cpu") -> Summary:
    """``compress_file`` with errors naming the input ``shown`` (a spooled standard input
    is named ``<stdin>``, never by its temporary file), and ``dst`` possibly a Stream."""
    out_path = _target(src, dst, True)
    n = resolve(threads)
    elapsed = _jit.stopwatch()
    with named(shown), opened(src) as f:
        s = _read_source(f)
        with _atomic.output_file(out_path, force) as out:
            summary = write(s, out, threads=n, progress=progress,
                            segment_bytes=segment_bytes, fast=fast, target=target)
            f.check()
    summary.seconds = elapsed()
    return summary


def decompress_file(src: Path, dst: Path | None = None, *, threads: int | None = None,
                    force: bool = False, progress: Progress | None = None) -> Summary:
    """Restore the original of compressed file ``src`` at ``dst``, byte for byte."""
    return decompress_as(Path(src), dst, Path(src), threads=threads, force=force,
                         progress=progress)


def decompress_as(src: Path, dst: Path | _atomic.Stream | None, shown: Path | str, *,
                  threads: int | None = None, force: bool = False,
                  progress: Progress | None = None) -> Summary:
    """``decompress_file`` with errors naming the input ``shown`` and ``dst`` possibly a
    Stream (as for ``compress_as``)."""
    out_path = _target(src, dst, False)
    n = resolve(threads)
    elapsed = _jit.stopwatch()
    with named(shown), opened(src) as f:
        c = Compressed(f)
        with _atomic.output_file(out_path, force) as out:
            size = c.restore(out, n, progress)
            f.check()
        summary = _decoded_summary(c, f.size, size)
    summary.seconds = elapsed()
    return summary


def is_compressed_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file that claims to be entropykit-compressed
    (``reader.claim``); False for anything unreadable (compressing it reports why)."""
    try:
        with opened(Path(path)) as f:
            s = _read_source(f)
            return claim(s.header, s.read) is not None
    except (OSError, ValueError):
        return False


def _decoded_summary(c: Compressed, compressed: int, original: int) -> Summary:
    """Rows as for compression (original bytes in, payload bytes out), for reporting."""
    summary = Summary(original_bytes=original, compressed_bytes=compressed, files=1)
    for e in c.original.entries:
        row = summary.row(e.dtype)
        row.tensors += 1
        row.values += e.numel
        row.bytes_in += e.nbytes
        row.bytes_out += c.payload_size(e.name)
    return summary


def verify_file(path: Path, against: Path | None = None, *, threads: int | None = None,
                progress: Progress | None = None) -> Summary:
    """Decode all of compressed ``path`` checking every checksum, and if ``against`` is
    given compare the restored file with it byte for byte; CorruptDataError on failure."""
    path = Path(path)
    n = resolve(threads)
    elapsed = _jit.stopwatch()
    with named(path), opened(path) as f:
        c = Compressed(f)
        if against is None:
            c.verify(n, progress)
        else:
            _compare(c, Path(against), n, progress)
        f.check()
        summary = _decoded_summary(c, f.size, c.original.file_size())
    summary.seconds = elapsed()
    return summary


def _compare(c: Compressed, original: Path, threads: int, progress: Progress | None) -> None:
    """CorruptDataError unless ``c`` restores ``original`` byte for byte (read a decoded
    piece at a time, never mapped; its own errors name it)."""
    with named(original):
        ref = opened(original)
    with ref:
        head = hdr.prefix(c.record.header) + c.record.header
        if ref.size != c.original.file_size():
            raise CorruptDataError(
                f"restores to {c.original.file_size()} bytes, {original} has {ref.size}"
            )

        def read(offset: int, n: int) -> np.ndarray:
            with named(original):
                return ref.read(offset, n)

        if read(0, len(head)).tobytes() != head:
            raise CorruptDataError(f"restored header differs from {original}'s")
        start = len(head)

        def check(offset: int, data: np.ndarray) -> None:
            mine = read(start + offset, data.size)
            if not np.array_equal(mine, data):
                at = start + offset + int(np.flatnonzero(mine != data)[0])
                raise CorruptDataError(f"restored file differs from {original} at byte {at}")

        c.verify(threads, progress, check)
        with named(original):
            ref.check()
