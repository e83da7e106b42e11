"""Numeric formats: how each safetensors dtype splits into uint8 symbol fields, and back.

What it is: ``split`` (a tensor's stored bytes -> a list of ``Field``), its exact inverse
``join``, and ``layout_for`` (packed 4-bit detection by tensor names). Every bit pattern
passes through untouched. What it is not: a coder or a container; a field knows nothing of
how it will be coded, only which other field a coder may condition it on.

Splits (measurements in floats.py and packed4.py):

    BF16            exponent, sign_mantissa (context exponent)
    F32             exponent, sign_mantissa (context exponent), byte1, byte0
    F16, F64        byte planes, most significant first
    F8_*, U8, I8, BOOL   byte0 (the whole byte)
    I16..U64        byte planes
    packed 4-bit    nibble_pair (the whole byte), by layout "mxfp4", "nvfp4" or "int4"
"""

from .packed4 import layout_for
from .registry import DTYPES, LAYOUTS, Field, join, planes, split

__all__ = ["DTYPES", "LAYOUTS", "Field", "join", "layout_for", "planes", "split"]
