"""Packed 4-bit tensors: recognizing them by name, and their one field.

What it is: ``layout_for``, which names the packing of an integer tensor from its name, dtype,
shape and sibling tensor names, and the split of such a tensor: every byte (a pair of 4-bit
codes) is one symbol of the field "nibble_pair". What it is not: unpacking or dequantizing
(the bytes pass through untouched), nor the split of the scale tensors, which have dtypes of
their own (F8_E8M0, F8_E4M3, BF16, U8) and split as such.

Layouts recognized:

- "mxfp4": OCP MX FP4 (gpt-oss): U8 ``<x>_blocks`` of 16 bytes (32 E2M1 codes) per block,
  with a ``<x>_scales`` sibling (E8M0 stored as F8_E8M0 or U8).
- "nvfp4": compressed-tensors NVFP4: U8 ``<x>weight_packed`` with a ``<x>weight_scale``.
- "int4": compressed-tensors pack-quantized (I32/U32 ``weight_packed`` + ``weight_scale``)
  and GPTQ/AWQ (I32/U32 ``qweight`` with ``qzeros`` and ``scales``). GPTQ may pack 2, 3 or
  8 bits as well; names cannot tell, and the split is lossless whatever the packing.

Why the byte and not each nibble: the joint entropy of a pair never exceeds the sum of its
nibbles' and half as many symbols are coded. Measured on MiniLM-L6 quantized here (bits per
byte, order-0 per tensor; [t] with serialized 12-bit tables): MXFP4 (E8M0 per 32, E2M1)
byte 7.858 [7.872] vs lo + hi nibble 3.933 + 3.933 [7.872], hi given lo 3.925 [3.960];
int4 (symmetric, groups of 128) byte 6.665 [6.676] vs 3.333 + 3.334 [6.672], hi given lo
3.332 [3.356]. The nibble split only wins by its smaller tables, by < 0.1%.
"""

from __future__ import annotations

from collections.abc import Collection

from ._planes import Planes

LAYOUTS = frozenset({"mxfp4", "nvfp4", "int4"})
PLANES = Planes(1, ("nibble_pair",), (None,))

_MX_BLOCK_BYTES = 16  # 32 four-bit codes per OCP MX block


def layout_for(
    name: str, dtype: str, shape: tuple[int, ...], names: Collection[str]
) -> str | None:
    """The packed 4-bit layout of tensor ``name``, or None; ``names``: all tensors of the file.

    ``names`` is searched with ``in``: pass a set when the file has many tensors.
    """
    if name.endswith("_blocks"):
        stem = name[: -len("_blocks")]
        if (dtype == "U8" and len(shape) >= 1 and shape[-1] == _MX_BLOCK_BYTES
                and stem + "_scales" in names):
            return "mxfp4"
        return None
    if name.endswith("weight_packed"):
        if name[: -len("packed")] + "scale" not in names:
            return None
        return {"U8": "nvfp4", "I32": "int4", "U32": "int4"}.get(dtype)
    if name.endswith("qweight") and dtype in ("I32", "U32"):
        stem = name[: -len("qweight")]
        if stem + "qzeros" in names and stem + "scales" in names:
            return "int4"
    return None
