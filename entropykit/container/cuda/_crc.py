"""CRC-32 checks of staged bytes on the device: the pieces of the rows, and the launches.

What it is: the host half of ``_crc.cu``. A row is a staged byte range, the seed its CRC
starts from and the CRC it must have (int64[k, 4]: offset, length, seed, wanted CRC);
``first_pieces`` cuts rows into the kernel's pieces and ``launch`` enqueues the two
kernels, which leave 1 in a row's status where its CRC differs. The loader reads the
statuses once, with the decoders'.
What it is not: the choice of rows (``fileplan``: what the host did not check) or their
place in the staging buffer (``_staging``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._cuda import nvrtc

PIECE = 1024  # bytes a thread checks: a multiple of the kernel's 16-byte loads
BLOCK = 256
MAX_BLOCKS = 8192


def first_pieces(lengths: np.ndarray) -> np.ndarray:
    """int64[k + 1]: the first piece of each row of these lengths, and (last) all pieces."""
    out = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(-(-np.asarray(lengths, np.int64) // PIECE), out=out[1:])
    return out


def _kernel(name: str) -> Any:
    import cupy as cp

    module = nvrtc.cached(("crc", PIECE), lambda: cp.RawModule(
        code=nvrtc.source(__package__, "_crc.cu"),
        options=("--std=c++17", f"-DPIECE={PIECE}")))
    return nvrtc.function(module, name)


def launch(device: Any, rows: int, first: int, n: int, pieces: int, staged: int,
           acc: int, status: int) -> None:
    """Enqueue the check of ``n`` rows (device addresses: ``rows`` int64[n, 4], ``first``
    int64[n + 1] with ``pieces`` in all, the ``staged`` bytes, ``acc`` u32[n] zeroed,
    ``status`` int32[n])."""
    if n:
        nvrtc.launch(device, launches(rows, first, n, pieces, staged, acc, status))


def launches(rows: int, first: int, n: int, pieces: int, staged: int, acc: int,
             status: int) -> list[tuple[Any, int, int, tuple, int]]:
    """``launch``'s kernels as ``nvrtc.launch`` takes them (none where ``n`` is 0), to
    enqueue with others."""
    if not n:
        return []
    grid = int(min(max(-(-pieces // BLOCK), 1), MAX_BLOCKS))
    return [(_kernel("crc_pieces"), grid, BLOCK,
             (np.uint64(rows), np.uint64(first), np.int32(n), np.uint64(staged),
              np.uint64(acc)), 0),
            (_kernel("crc_finish"), -(-n // BLOCK), BLOCK,
             (np.uint64(rows), np.int32(n), np.uint64(acc), np.uint64(status)), 0)]
