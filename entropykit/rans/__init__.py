"""Static interleaved rANS (32 lanes, 16-bit words, 32-bit state): ``encode`` / ``decode``."""

from .static import DEFAULT_PRECISION, decode, encode

__all__ = ["DEFAULT_PRECISION", "decode", "encode"]
