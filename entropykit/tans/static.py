"""Static-model 4-state tANS: frames of chunks sharing one FSE state table.

What it is: the public ``encode``/``decode`` of uint8 symbol arrays (alphabet <= 256) and
the ``ChunkCoder`` that plugs the kernels into the shared frame driver.
What it is not: a context-mixing coder (one table per frame; ``supports_context`` is
False) nor the table construction (``table.py``) or the bit-level format (``kernels.py``).
"""

from __future__ import annotations

import numpy as np

from ..coding import frame
from . import kernels, table

DEFAULT_PRECISION = 12
PRECISIONS = range(9, 13)  # table logs: 4 lanes x 12 bits fit one 64-bit refill


class _TansCoder:
    magic = b"EKTA"
    lanes = kernels.LANES
    name = "tANS"
    supports_context = False

    def check_param(self, param: int) -> None:
        if param not in PRECISIONS:
            raise ValueError(
                f"tANS table log must be in {PRECISIONS[0]}..{PRECISIONS[-1]}, got {param}"
            )

    def encode_tables(self, freqs: np.ndarray, param: int) -> tuple[np.ndarray, np.ndarray]:
        return table.encode_tables(freqs, param)

    def decode_tables(self, freqs: np.ndarray, param: int) -> np.ndarray:
        return table.decode_table(freqs, param)

    def encode_chunk(
        self, symbols: np.ndarray, tabs: tuple[np.ndarray, np.ndarray], param: int,
        ctx: np.ndarray | None = None, cmap: np.ndarray | None = None,
    ) -> np.ndarray | None:
        _no_context(ctx)
        symbol_tt, state_table = tabs
        # 8 bytes of scratch below the payload; kept only if shorter than raw.
        out = np.empty(symbols.size + 8, np.uint8)
        start = kernels.encode_chunk(symbols, symbol_tt, state_table, param, out)
        return None if start < 0 else out[start:]

    def decode_status(
        self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tabs: np.ndarray,
        param: int, out: np.ndarray, ctx: np.ndarray | None, cmap: np.ndarray | None,
        lo: np.ndarray, hi: np.ndarray,
    ) -> list[int]:
        _no_context(ctx)
        errors = np.empty(len(starts), np.int64)
        kernels.decode_chunks(buf, starts, lengths, tabs, param, out, lo, hi, errors)
        return errors.tolist()

    def decode_chunks(self, *args) -> list[str | None]:
        """``decode_status`` with each code as its message (None for OK)."""
        return frame.worded(self.decode_status(*args))

    def decode_chunk(
        self, buf: np.ndarray, start: int, length: int, tabs: np.ndarray, param: int,
        out: np.ndarray, ctx: np.ndarray | None = None,
    ) -> str | None:
        _no_context(ctx)
        code = kernels.decode_chunk(buf, start, length, tabs, param, out)
        return frame.worded([code])[0]


def _no_context(ctx: np.ndarray | None) -> None:
    if ctx is not None:
        raise ValueError("tANS frames have one table: the driver must not pass a context")


CODER = _TansCoder()


def encode(
    symbols: np.ndarray | bytes,
    *,
    precision: int = DEFAULT_PRECISION,
    chunk_size: int = frame.DEFAULT_CHUNK,
    threads: int | None = None,
) -> bytes:
    """Encode uint8 symbols into a self-describing tANS frame.

    ``precision`` is the table log (9..12: the state table has ``2**precision`` slots and
    frequencies are quantized to sum to it); ``chunk_size`` the symbols per independently
    decodable chunk (a multiple of 4); ``threads`` the worker threads (default: all cores
    available to this process).
    """
    return frame.encode(CODER, symbols, precision, chunk_size, threads)


def decode(frame_bytes: bytes | memoryview | np.ndarray, *, threads: int | None = None,
           out: np.ndarray | None = None, max_output: int | None = None) -> np.ndarray:
    """Decode a tANS frame into a uint8 array; ``CorruptDataError`` if it is malformed.

    ``max_output``: the most symbols the frame may declare, checked before anything is
    allocated (``CorruptDataError`` beyond); by default ``out``'s size, or without ``out``
    ``frame.DEFAULT_MAX_OUTPUT`` (2**30): a larger frame needs an explicit bound.
    """
    return frame.decode(CODER, frame_bytes, threads, out, max_output=max_output)
