"""A plain progress line on stderr: ``label  42%  123.4/293.0 MB  250 MB/s``.

What it is: a ``(done, total)`` callback that redraws one line at most ten times a second
and ends it with a newline; no dependency beyond the standard library. What it is not: a
multi-bar display, or anything that writes to stdout (scripts may parse stdout).
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .. import _jit


class Bar:
    """Call with (bytes done, bytes total); call ``close()`` when the work ends."""

    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 0.1) -> None:
        self.label = label
        self.stream = sys.stderr if stream is None else stream
        self.interval = interval
        self._elapsed = _jit.stopwatch()  # the rate leaves compiling kernels out
        self._last = -1.0
        self._drawn = False

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        rate = done / 1e6 / max(self._elapsed(), 1e-9)
        self.stream.write(f"\r{self.label}  {pct:3.0f}%  {done / 1e6:.1f}/{total / 1e6:.1f} MB"
                          f"  {rate:.0f} MB/s ")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
