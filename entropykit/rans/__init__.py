"""Static interleaved rANS (32 lanes, 16-bit words, 32-bit state): ``encode`` / ``decode``.

Beside it: ``distribution`` (rANS under one distribution per value), ``lanes`` (the 32-lane
stream layout both write) and ``cuda`` (their CUDA twins, imported only when asked for).
"""

from . import static
from .static import DEFAULT_PRECISION, PRECISIONS, decode, encode

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "decode", "encode", "static"]
