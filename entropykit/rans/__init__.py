"""Static interleaved rANS (32 lanes, 16-bit words, 32-bit state): ``encode`` / ``decode``."""

from . import static
from .static import DEFAULT_PRECISION, PRECISIONS, decode, encode

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "decode", "encode", "static"]
