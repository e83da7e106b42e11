"""A plain progress line on stderr:
``label  42%  123.4/293.0 MB  250 MB/s  ETA 0:01  [file 2/5 b.safetensors 61%]``.

What it is: a ``(done, total)`` callback that redraws one line at most ten times a second
and ends it with a newline; for a directory, ``start_file`` adds the current file and its
own percentage. No dependency beyond the standard library. What it is not: a multi-bar
display, or anything that writes to stdout (scripts may parse stdout).

The rate (and so the ETA) counts from the first progress report with some work done, not
from the start, and leaves out the time spent compiling kernels since (a dtype met later
in a file or directory compiles its own): what is left approximates the steady speed.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .. import _jit


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    if s >= 3600:
        return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class Bar:
    """Call with (bytes done, bytes total); call ``close()`` when the work ends. ``unit``
    and ``scale`` name other work: ``Bar("fit", unit="steps", scale=1)`` counts steps."""

    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 0.1,
                 *, unit: str = "MB", scale: float = 1e6) -> None:
        self.label = label
        self.unit, self.scale = unit, scale
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self._last = -1.0
        self._drawn = False
        # (time, bytes, seconds compiled) at the first report with some work done
        self._first: tuple[float, int, float] | None = None
        self._file: tuple[str, int, int, int] | None = None  # name, base, size, number
        self._files = 0

    def start_file(self, name: str, size: int) -> None:
        """A directory run moves on to file ``name`` of ``size`` bytes (its own share)."""
        self._files += 1
        base = self._file[1] + self._file[2] if self._file else 0
        self._file = (name, base, size, self._files)

    def line(self, done: int, total: int, now: float) -> str:
        """The text drawn for (done, total) at time ``now``."""
        pct = 100.0 * done / total if total else 100.0
        digits = 0 if self.scale == 1 else 1
        text = (f"{self.label}  {pct:3.0f}%  {done / self.scale:.{digits}f}/"
                f"{total / self.scale:.{digits}f} {self.unit}")
        rate = self._rate(done, now)
        if rate is not None:
            text += (f"  {rate / self.scale:.{1 - digits}f} {self.unit}/s  "
                     f"ETA {_clock((total - done) / rate)}")
        if self._file is not None:
            name, base, size, k = self._file
            mine = 100.0 * min(max(done - base, 0), size) / size if size else 100.0
            text += f"  [file {k} {name} {mine:.0f}%]"
        return text

    def _rate(self, done: int, now: float) -> float | None:
        """Units a second since the first report, compiling left out; None before."""
        if self._first is None or done <= self._first[1]:
            return None
        t0, d0, c0 = self._first
        working = now - t0 - (_jit.compile_seconds() - c0)
        return (done - d0) / working if working > 0 else None

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self._first is None and done > 0:
            self._first = (now, done, _jit.compile_seconds())
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        self.stream.write(f"\r{self.line(done, total, now)} \x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
