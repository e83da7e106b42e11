"""The bytes a reader reads: a file read on demand with ``pread``, or bytes in memory.

What it is: ``FileBytes``, a regular file opened read-only and read in the pieces asked
for (``read(offset, n)``, a new array each time; ``os.pread`` releases the GIL, so
threads read while others decode). Files are read, never mapped: a mapped file that
shrinks kills the process with SIGBUS, while a read past the end here is a short read,
raised as ``CorruptDataError`` and never used as data. The file is remembered as it was
when opened (size, modification time) so that a change can be detected (``check``).
``ArrayBytes`` gives the same interface over bytes in memory (views, no copy),
``Window`` a slice of either that is read when sliced, ``Scratch`` a read buffer
reused per thread, and ``Arena`` fresh read buffers carved from large blocks.
What it is not: parsing or decoding (``header``, ``reader``).
"""

from __future__ import annotations

import os
import stat
import threading
import weakref
from pathlib import Path
from typing import Protocol

import numpy as np

from .._errors import CorruptDataError

_IOV_MAX = 1024  # buffers one preadv takes (Linux's IOV_MAX)


class Bytes(Protocol):
    """What readers read: ``size`` bytes, ``read(offset, n)`` of them at a time."""

    size: int

    def read(self, offset: int, n: int, scratch: Scratch | Arena | None = None
             ) -> np.ndarray: ...

    def readinto(self, offset: int, outs: list[np.ndarray]) -> None: ...


def _past_end(offset: int, n: int, size: int) -> CorruptDataError | None:
    if offset < 0 or n < 0 or offset + n > size:
        return CorruptDataError(f"read of {n} bytes at byte {offset} is outside the "
                                f"{size} bytes there are")
    return None


class ArrayBytes:
    """Bytes in memory; ``read`` gives views."""

    def __init__(self, buf: bytes | bytearray | memoryview | np.ndarray) -> None:
        self._buf = buf if isinstance(buf, np.ndarray) else \
            np.frombuffer(memoryview(buf).cast("B"), np.uint8)
        self.size = int(self._buf.size)

    def read(self, offset: int, n: int, scratch: Scratch | Arena | None = None
             ) -> np.ndarray:
        """A view (``scratch`` is not needed: nothing is copied)."""
        err = _past_end(offset, n, self.size)
        if err is not None:
            raise err
        return self._buf[offset : offset + n]

    def readinto(self, offset: int, outs: list[np.ndarray]) -> None:
        """Bytes from ``offset`` on into the uint8 arrays ``outs``, one after another."""
        for out in outs:
            out[:] = self.read(offset, out.size)
            offset += out.size


class FileBytes:
    """A regular file opened read-only (ValueError otherwise), read with ``pread``; a
    context manager that closes it (so does garbage collection)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block here
        self._closer = weakref.finalize(self, os.close, fd)
        try:
            self._st = os.fstat(fd)
            if not stat.S_ISREG(self._st.st_mode):
                raise ValueError("not a regular file")
        except BaseException:
            self._closer()
            raise
        self.fd = fd
        self.size = self._st.st_size

    def __enter__(self) -> FileBytes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closer()

    def check(self) -> None:
        """CorruptDataError if the file changed (size or modification time) since it was
        opened."""
        now = os.fstat(self.fd)
        if (now.st_size, now.st_mtime_ns) != (self.size, self._st.st_mtime_ns):
            raise CorruptDataError(f"file changed while being read ({self.size} bytes when "
                                   f"opened, now {now.st_size})")

    def read(self, offset: int, n: int, scratch: Scratch | Arena | None = None
             ) -> np.ndarray:
        """``n`` bytes at ``offset``: a new array, or with ``scratch`` its buffer (a
        ``Scratch``: this thread's, valid until its next use; an ``Arena``: a fresh one);
        CorruptDataError if the file is shorter now than when opened."""
        out = np.empty(n, np.uint8) if scratch is None else scratch.get(n)[:n]
        self.readinto(offset, [out])
        return out

    def readinto(self, offset: int, outs: list[np.ndarray]) -> None:
        """Bytes from ``offset`` on into the uint8 arrays ``outs``, one after another
        (one ``preadv``: adjacent ranges of the file cost one call, and the bytes go
        straight where they are wanted); CorruptDataError as ``read``."""
        n = sum(out.size for out in outs)
        err = _past_end(offset, n, self.size)
        if err is not None:
            raise err
        views = [memoryview(out) for out in outs if out.size]
        got = i = 0
        while i < len(views):
            k = os.preadv(self.fd, views[i : i + _IOV_MAX], offset + got)
            if k == 0:
                raise CorruptDataError(f"file changed or truncated while being read: it "
                                       f"ends at byte {offset + got}, it had {self.size} "
                                       "bytes when opened")
            got += k
            while i < len(views) and k >= views[i].nbytes:
                k -= views[i].nbytes
                i += 1
            if k:
                views[i] = views[i][k:]


class Window:
    """Bytes ``[begin, begin + size)`` of ``src``, read when sliced (``w[lo:hi]``, a
    contiguous slice); ``size`` and ``len`` as for an array."""

    def __init__(self, src: Bytes, begin: int, size: int) -> None:
        self._src, self._begin, self.size = src, begin, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, step = s.indices(self.size)
        if step != 1:
            raise ValueError("only contiguous slices are read")
        return self._src.read(self._begin + lo, max(hi - lo, 0))


class Scratch:
    """A read buffer per thread, grown as needed (``get(n)``): for reads that are dead once
    the reading thread is done with them (a segment's field payloads, once decoded), so
    that each read does not pay a fresh allocation's page faults. A pool thread's buffer
    goes with the thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, n: int) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.size < n:
            buf = self._local.buf = np.empty(n, np.uint8)
        return buf


class Arena:
    """Fresh read buffers (``get(n)``, never handed out twice) carved from blocks of
    ``block`` bytes, for many small reads that stay alive together (a GPU load's plan
    holds a group's field payloads until the group is staged): one large allocation
    takes the kernel's transparent huge pages where it has them, where reads into buffers
    of a megabyte each fault their memory in 4 KiB page by page. A block is freed when
    no buffer of it is left; reads of a quarter block or more get their own array."""

    def __init__(self, block: int = 32 << 20) -> None:
        self._block = block
        self._lock = threading.Lock()
        self._buf = np.empty(0, np.uint8)
        self._at = 0

    def get(self, n: int) -> np.ndarray:
        if 4 * n >= self._block:
            return np.empty(n, np.uint8)
        with self._lock:
            if self._at + n > self._buf.size:
                self._buf, self._at = np.empty(self._block, np.uint8), 0
            out = self._buf[self._at : self._at + n]
            self._at += -(-n // 64) * 64  # the next buffer starts on a cache line
        return out
