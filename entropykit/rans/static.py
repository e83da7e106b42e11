"""Static-model interleaved rANS: frames of 32-lane chunks sharing one frequency table.

What it is: the public ``encode``/``decode`` of uint8 symbol arrays (alphabet <= 256) and
the ``ChunkCoder`` that plugs the kernels into the shared frame driver.
What it is not: per-symbol-distribution (predictive) rANS.
"""

from __future__ import annotations

import numpy as np

from ..coding import contexts, frame
from . import kernels

DEFAULT_PRECISION = 12
PRECISIONS = range(8, 16)


class _RansCoder:
    magic = b"EKRA"
    lanes = kernels.LANES
    name = "rANS"
    supports_context = True

    def check_param(self, param: int) -> None:
        if not 8 <= param <= 15:
            raise ValueError(f"rANS precision must be in 8..15, got {param}")

    def encode_tables(self, freqs: np.ndarray, param: int) -> np.ndarray:
        return kernels.encode_tables(freqs, param)

    def decode_tables(self, freqs: np.ndarray, param: int) -> np.ndarray:
        return kernels.decode_table(freqs, param)

    def encode_chunk(self, symbols, tabs, param, ctx, cmap=None) -> np.ndarray | None:
        out = np.empty(symbols.size, np.uint8)  # coded must be smaller than raw to be kept
        start = kernels.encode_chunk(symbols, tabs, param, out, ctx, _int_map(ctx, cmap))
        return None if start < 0 else out[start:]

    def decode_status(self, buf, starts, lengths, tabs, param, out, ctx, cmap, lo, hi
                      ) -> list[int]:
        # A context without a map holds table indices (frame.decode's ``mapped``).
        errors = np.empty(len(starts), np.int64)
        # Numba compiles the kernel for each case of a context (none, table indices,
        # mapped), each of them once: the context and its map are always read-only.
        kernels.decode_chunks(buf, starts, lengths, tabs, param, out, kernels.read_only(ctx),
                              None if cmap is None else kernels.read_only(_int_map(ctx, cmap)),
                              lo, hi, errors)
        return errors.tolist()

    def decode_chunks(self, *args) -> list[str | None]:
        """``decode_status`` with each code as its message (None for OK)."""
        return frame.worded(self.decode_status(*args))

    def decode_chunk(self, buf, start, length, tabs, param, out, ctx, cmap=None
                     ) -> str | None:
        code = kernels.decode_chunk(buf, start, length, tabs, param, out, ctx,
                                    _int_map(ctx, cmap))
        return frame.worded([code])[0]


def _int_map(ctx: np.ndarray | None, cmap: np.ndarray | None) -> np.ndarray | None:
    """The kernels' form of a context map (int64[256], gathered as 64-bit lanes)."""
    if ctx is None:
        return None
    if cmap is None:
        raise ValueError("a context needs its context map (cmap)")
    return np.asarray(cmap, np.int64)


CODER = _RansCoder()


def encode(
    symbols: np.ndarray | bytes,
    *,
    precision: int = DEFAULT_PRECISION,
    chunk_size: int = frame.DEFAULT_CHUNK,
    threads: int | None = None,
    context: np.ndarray | bytes | None = None,
    max_tables: int = contexts.DEFAULT_MAX_TABLES,
) -> bytes:
    """Encode uint8 symbols into a self-describing rANS frame.

    ``precision`` is the probability resolution in bits (8..15); ``chunk_size`` the symbols
    per independently decodable chunk (a multiple of 32); ``threads`` the worker threads
    (default: all cores available to this process). ``context`` (uint8, one per symbol)
    lets the coder use up to ``max_tables`` tables, one per context class, where that
    is smaller; decoding then needs the same context.
    """
    return frame.encode(CODER, symbols, precision, chunk_size, threads, context, max_tables)


def decode(
    frame_bytes: bytes | memoryview | np.ndarray,
    *,
    threads: int | None = None,
    out: np.ndarray | None = None,
    context: np.ndarray | bytes | None = None,
    max_output: int | None = None,
) -> np.ndarray:
    """Decode an rANS frame into a uint8 array; ``CorruptDataError`` if it is malformed.

    A frame coded with a ``context`` needs the same one. ``max_output``: the most symbols
    the frame may declare, checked before anything is allocated (``CorruptDataError``
    beyond); by default ``out``'s size, or without ``out`` ``frame.DEFAULT_MAX_OUTPUT``
    (2**30): a larger frame needs an explicit bound.
    """
    return frame.decode(CODER, frame_bytes, threads, out, context, max_output=max_output)
