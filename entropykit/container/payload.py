"""The payload of one compressed tensor: a small index, then its field payloads.

What it is: packing and validated unpacking of the bytes stored as the U8 tensor that
replaces an original tensor. Layout (little-endian):

    offset  size   field
    0       4      magic b"EKT1"
    4       4      k: number of field payloads (segments x fields, segment-major)
    8       8k     u64 length of each field payload
    8+8k    ...    the field payloads back to back; the tensor ends where the last ends

What it is not: the codecs of the field payloads (the record names them) or their checks.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from .._errors import CorruptDataError

MAGIC = b"EKT1"
_HEAD = struct.Struct("<4sI")


def index_size(count: int) -> int:
    """Bytes of the index of a payload with ``count`` field payloads."""
    return _HEAD.size + 8 * count


def index(lengths: Sequence[int]) -> bytes:
    """The index of a payload whose field payloads have these lengths."""
    return _HEAD.pack(MAGIC, len(lengths)) + np.array(lengths, "<u8").tobytes()


def _lengths(buf: np.ndarray, count: int | None) -> list[int]:
    """The field payload lengths listed by the index in ``buf``; CorruptDataError if the
    index is damaged, lists other than ``count`` (when given) or leaves bytes over."""
    if buf.size < _HEAD.size:
        raise CorruptDataError(f"payload truncated: {buf.size} bytes")
    magic, k = _HEAD.unpack(buf[: _HEAD.size].tobytes())
    if magic != MAGIC:
        raise CorruptDataError(f"payload magic {magic!r}, expected {MAGIC!r}")
    if count is not None and k != count:
        raise CorruptDataError(f"payload holds {k} field payloads, record says {count}")
    start = index_size(k)
    if buf.size < start:
        raise CorruptDataError(f"payload index truncated: {buf.size} bytes, index needs {start}")
    # Python ints: a hostile index must not wrap an int64 sum into a plausible total.
    lengths = buf[_HEAD.size : start].view("<u8").tolist()
    if sum(lengths) != buf.size - start:
        raise CorruptDataError(
            f"payload index lists {sum(lengths)} bytes of field payloads, "
            f"{buf.size - start} follow it"
        )
    return lengths


def unpack(buf: np.ndarray, count: int) -> list[np.ndarray]:
    """Views of the ``count`` field payloads in ``buf`` (uint8); CorruptDataError if the
    index is damaged or does not account for every byte."""
    start = index_size(count)
    parts = []
    for n in _lengths(buf, count):
        parts.append(buf[start : start + n])
        start += n
    return parts


def well_formed(buf: np.ndarray) -> bool:
    """Whether ``buf`` (uint8) is laid out as a payload: magic, index, every byte listed."""
    try:
        _lengths(buf, None)
    except CorruptDataError:
        return False
    return True
