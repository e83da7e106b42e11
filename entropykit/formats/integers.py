"""Integer and boolean dtypes: byte planes, one field per byte position.

What it is: the split of U8, I8, BOOL, U16, I16, U32, I32, U64, I64 into "byte{k}" fields
(k = the byte's significance, most significant field first), with no contexts: integer
tensors are index-like (positions, token ids, packed data) and their high planes are nearly
constant, which a per-field table already captures (MiniLM's I64 position_ids: byte7..byte2
are all zero, 0 bits; byte1 1.0 bit; byte0 8.0 bits). What it is not: packed 4-bit data,
which packed4.py splits when a layout says so, or the choice of zstd for LZ-friendly data
(the container's).
"""

from __future__ import annotations

from ._planes import Planes

ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
}


def planes(dtype: str) -> Planes:
    word = ITEMSIZE[dtype]
    return Planes(word, tuple(f"byte{k}" for k in range(word - 1, -1, -1)), (None,) * word)
