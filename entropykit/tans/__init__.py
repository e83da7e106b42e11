"""FSE-style tANS (table log 9..12, 4 interleaved states, one bit-stream): ``encode`` /
``decode``."""

from .static import DEFAULT_PRECISION, PRECISIONS, decode, encode

__all__ = ["DEFAULT_PRECISION", "PRECISIONS", "decode", "encode"]
