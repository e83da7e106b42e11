"""Compress, decompress and verify single safetensors files on disk.

What it is: the file-level operations: read the input (compress reads each segment with
``pread``; the other verbs map a compressed file read-only: only touched pages are read,
so files larger than RAM stream through), write through ``_atomic`` (temporary name,
rename; nothing left behind on error; the input is never written; standard output as an
``_atomic.Stream``), default output names, and errors that name the file (``shown``: a
spooled standard input is named ``<stdin>``). Inputs must be regular files, and one that
changes size or modification time while it is read fails the run with no output (compress
reads rather than maps: a mapped file that shrinks kills the process with SIGBUS). What
it is not: the coding (``writer``/``reader``) or directories (``checkpoint.py``).
"""

from __future__ import annotations

import mmap
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .. import _jit
from .._errors import CorruptDataError
from . import _atomic
from . import header as hdr
from .parallel import resolve
from .reader import Compressed, Progress, claim
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


class _Input:
    """An input file opened read-only: a regular file, remembered as it was when opened,
    so that a change while it is read can be detected (``check``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block here
        try:
            self._st = os.fstat(self.fd)
            if not stat.S_ISREG(self._st.st_mode):
                raise ValueError("not a regular file")
        except BaseException:
            os.close(self.fd)
            raise
        self.size = self._st.st_size

    def check(self) -> None:
        """ValueError if the file changed (size or modification time) since it was opened."""
        now = os.fstat(self.fd)
        if (now.st_size, now.st_mtime_ns) != (self.size, self._st.st_mtime_ns):
            raise ValueError(f"input changed while being read ({self.size} bytes, now "
                             f"{now.st_size}); nothing written")

    def pread(self, offset: int, n: int) -> np.ndarray:
        """``n`` bytes at ``offset`` (a new array); ValueError if the file is shorter now."""
        out = np.empty(n, np.uint8)
        got = 0
        while got < n:
            k = os.preadv(self.fd, [memoryview(out)[got:]], offset + got)
            if k == 0:
                self.check()
                raise ValueError(f"input changed while being read (ends at byte "
                                 f"{offset + got}); nothing written")
            got += k
        return out

    def close(self) -> None:
        os.close(self.fd)


@contextmanager
def _opened(path: Path) -> Iterator[_Input]:
    f = _Input(path)
    try:
        yield f
    finally:
        f.close()


@contextmanager
def _map(f: _Input) -> Iterator[np.ndarray]:
    """Input ``f``'s bytes as a read-only uint8 array backed by an mmap."""
    if f.size == 0:
        yield np.zeros(0, np.uint8)
        return
    mm = mmap.mmap(f.fd, 0, access=mmap.ACCESS_READ)
    try:
        yield np.frombuffer(mm, np.uint8)
    finally:
        try:
            mm.close()
        except BufferError:  # views still alive (e.g. in a traceback): the GC closes it
            pass


@contextmanager
def mapped(path: Path) -> Iterator[np.ndarray]:
    """The file's bytes as a read-only uint8 array backed by an mmap; ValueError if it is
    not a regular file, or if it changed by the time the block exits."""
    with _opened(path) as f, _map(f) as buf:
        yield buf
        f.check()


def source(buf: np.ndarray) -> Source:
    """A ``writer.Source`` over a whole safetensors file held in ``buf``."""
    h = hdr.parse_file(memoryview(buf))
    start = h.data_start
    return Source(h, lambda e: buf[start + e.begin : start + e.end])


class _Span:
    """A tensor's bytes in an input file, read when sliced (``span[lo:hi]`` is a new uint8
    array); ``size`` as for an array. Only the slices asked for are read."""

    def __init__(self, f: _Input, begin: int, size: int) -> None:
        self._f, self._begin, self._size = f, begin, size

    @property
    def size(self) -> int:
        return self._size

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, step = s.indices(self._size)
        if step != 1:
            raise ValueError("only contiguous slices are read")
        return self._f.pread(self._begin + lo, max(hi - lo, 0))


def _read_source(f: _Input) -> Source:
    """A ``writer.Source`` over input file ``f``, read segment by segment with ``pread``."""
    n = hdr.read_prefix(f.pread(0, min(8, f.size)).tobytes(), f.size)
    h = hdr.parse_json(f.pread(8, n).tobytes())
    if h.file_size() != f.size:
        raise ValueError(f"tensors end at byte {h.file_size()}, file has {f.size} bytes")
    start = h.data_start
    return Source(h, lambda e: _Span(f, start + e.begin, e.nbytes))


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
    with named(shown), _opened(src) as f:
        try:
            s = _read_source(f)
        except ValueError as e:
            raise ValueError(f"not a valid safetensors file: {e}") from None
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
    with named(shown), _opened(src) as f, _map(f) as buf:
        c = Compressed(buf)
        with _atomic.output_file(out_path, force) as out:
            size = c.restore(out, n, progress)
            f.check()
        summary = _decoded_summary(c, buf.size, size)
    summary.seconds = elapsed()
    return summary


def is_compressed_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file that claims to be entropykit-compressed
    (``reader.claim``); False for anything unreadable (compressing it reports why)."""
    try:
        with _opened(Path(path)) as f:
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
    with named(path), mapped(path) as buf:
        c = Compressed(buf)
        if against is None:
            c.verify(n, progress)
        else:
            _compare(c, Path(against), n, progress)
        summary = _decoded_summary(c, buf.size, c.original.file_size())
    summary.seconds = elapsed()
    return summary


def _compare(c: Compressed, original: Path, threads: int, progress: Progress | None) -> None:
    with mapped(original) as ref:
        head = hdr.prefix(c.record.header) + c.record.header
        if ref.size != c.original.file_size():
            raise CorruptDataError(
                f"restores to {c.original.file_size()} bytes, {original} has {ref.size}"
            )
        if bytes(ref[: len(head)]) != head:
            raise CorruptDataError(f"restored header differs from {original}'s")
        start = len(head)

        def check(offset: int, data: np.ndarray) -> None:
            mine = ref[start + offset : start + offset + data.size]
            if not np.array_equal(mine, data):
                at = start + offset + int(np.flatnonzero(mine != data)[0])
                raise CorruptDataError(f"restored file differs from {original} at byte {at}")

        c.verify(threads, progress, check)
