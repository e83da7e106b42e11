"""The payload of one compressed tensor: a small index, then its field payloads.

What it is: packing and validated unpacking of the bytes stored as the U8 tensor that
replaces an original tensor, and the check that binds each field payload to its place.
Layout ``EKT2`` (written with record version 3; little-endian):

    offset  size   field
    0       4      magic b"EKT2"
    4       4      k: number of field payloads (segments x fields, segment-major)
    8       8k     u64 length of each field payload
    8+8k    4k     u32 position CRC of each field payload (``field_crc``)
    8+12k   ...    the field payloads back to back; the tensor ends where the last ends

Layout ``EKT1`` (record versions 1 and 2) is the same without the CRCs. A field payload's
own checks (chunk CRCs) cannot tell it from an equal-sized one of another tensor, segment
or field; the position CRC covers its bytes *and* that place, so a moved payload fails.
What it is not: the codecs of the field payloads (the record names them) or their checks.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .._errors import CorruptDataError
from ..coding.crc32 import crc32

MAGIC = b"EKT2"  # what writers write
MAGIC_V1 = b"EKT1"  # read with record versions 1 and 2
_HEAD = struct.Struct("<4sI")
_PLACE = struct.Struct("<II")


def index_size(count: int, bound: bool = True) -> int:
    """Bytes of the index of a payload with ``count`` field payloads (``bound``: EKT2)."""
    return _HEAD.size + (12 if bound else 8) * count


class _Pieces(Protocol):
    """A payload that knows its CRC-32 without being read (``codecs.Stored``)."""

    def crc32(self, value: int = 0) -> int: ...


def field_crc(part: np.ndarray | bytes | memoryview | _Pieces, name: str, seg: int,
              field: int) -> int:
    """The position CRC of field payload ``part``, field ``field`` of segment ``seg`` of
    tensor ``name``: CRC-32 of the tensor name's UTF-8 bytes, a NUL, u32 seg, u32 field,
    then the payload (one pass: the payload's CRC seeded with the prefix's; none for a
    payload that has its own)."""
    seed = place_seed(name, seg, field)
    if isinstance(part, (bytes, bytearray, memoryview, np.ndarray)):
        return crc32(part, seed)
    return part.crc32(seed)


def place_seed(name: str, seg: int, field: int) -> int:
    """The CRC-32 of the place prefix of ``field_crc`` (the seed of the payload's CRC)."""
    return zlib.crc32(_PLACE.pack(seg, field), _name_crc(name))


def place_seeds(name: str, seg: int, fields: int) -> list[int]:
    """``place_seed`` of fields ``0 .. fields - 1`` of segment ``seg``."""
    named = _name_crc(name)
    return [zlib.crc32(_PLACE.pack(seg, f), named) for f in range(fields)]


@functools.lru_cache(maxsize=4096)
def _name_crc(name: str) -> int:
    # surrogatepass: a name no writer can write still gets a value (a mismatch), no error.
    return zlib.crc32(name.encode("utf-8", "surrogatepass") + b"\0")


def index(lengths: Sequence[int], crcs: Sequence[int]) -> bytes:
    """The EKT2 index of field payloads of these lengths and position CRCs."""
    return (_HEAD.pack(MAGIC, len(lengths)) + np.array(lengths, "<u8").tobytes()
            + np.array(crcs, "<u4").tobytes())


@dataclass(frozen=True)
class Fields:
    """Where a tensor's field payloads lie in its payload (segment-major: ``offsets``
    from the payload's start, ``lengths``) and, for EKT2, their position CRCs."""

    offsets: list[int]
    lengths: list[int]
    crcs: list[int] | None

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """Where field payloads ``lo`` to ``hi`` (exclusive) lie in the payload: one range,
        as they lie back to back."""
        if hi <= lo:
            return 0, 0
        return self.offsets[lo], self.offsets[hi - 1] + self.lengths[hi - 1]

    def split(self, block: np.ndarray, lo: int, hi: int) -> list[np.ndarray]:
        """Field payloads ``lo`` to ``hi`` (views) out of ``block``, the bytes ``span``
        gives."""
        a = self.span(lo, hi)[0]
        return [block[o - a : o - a + n]
                for o, n in zip(self.offsets[lo:hi], self.lengths[lo:hi], strict=True)]


class Sliceable(Protocol):
    """A payload's bytes: an array, or what reads them when sliced (``source.Window``)."""

    size: int

    def __getitem__(self, s: slice) -> np.ndarray: ...


def unpack(buf: Sliceable, count: int | None, bound: bool | None) -> Fields:
    """Where the field payloads in ``buf`` are, and their position CRCs (checked by
    ``check``, segment by segment), reading only the index; CorruptDataError if the
    index is damaged, is not EKT2 if ``bound``, EKT1 if not (either if None), lists
    other than ``count`` field payloads (when given) or does not account for every
    byte."""
    size = buf.size
    if size < _HEAD.size:
        raise CorruptDataError(f"payload truncated: {size} bytes")
    # With the count known, the head and the index it should have come in one read.
    head = buf[: min(size, _HEAD.size if count is None else index_size(count, bound is not False))]
    magic, k = _HEAD.unpack(head[: _HEAD.size].tobytes())
    want = {True: (MAGIC,), False: (MAGIC_V1,), None: (MAGIC, MAGIC_V1)}[bound]
    if magic not in want:
        raise CorruptDataError(f"payload magic {magic!r}, expected "
                               f"{' or '.join(map(repr, want))}")
    if count is not None and k != count:
        raise CorruptDataError(f"payload holds {k} field payloads, record says {count}")
    is_bound = magic == MAGIC
    start = index_size(k, is_bound)
    if size < start:
        raise CorruptDataError(f"payload index truncated: {size} bytes, index needs {start}")
    idx = head[_HEAD.size : start] if start <= head.size else buf[_HEAD.size : start]
    # Python ints: a hostile index must not wrap an int64 sum into a plausible total.
    lengths = idx[: 8 * k].view("<u8").tolist()
    if sum(lengths) != size - start:
        raise CorruptDataError(
            f"payload index lists {sum(lengths)} bytes of field payloads, "
            f"{size - start} follow it"
        )
    crcs = idx[8 * k :].view("<u4").tolist() if is_bound else None
    offsets = []
    for n in lengths:
        offsets.append(start)
        start += n
    return Fields(offsets, lengths, crcs)


def check(name: str, seg: int, fields: Sequence[tuple[str, str | None]],
          parts: Sequence[np.ndarray], crcs: Sequence[int] | None) -> None:
    """CorruptDataError unless each of segment ``seg``'s field payloads ``parts`` (of
    tensor ``name``, with ``fields`` named as in the record) has its position CRC (no
    check for EKT1: ``crcs`` None)."""
    if crcs is None:
        return
    for f, (part, want) in enumerate(zip(parts, crcs, strict=True)):
        if field_crc(part, name, seg, f) != want:
            raise misplaced(fields, f)


def misplaced(fields: Sequence[tuple[str, str | None]], f: int) -> CorruptDataError:
    """The error of field payload ``f`` failing its position CRC."""
    return CorruptDataError(f"field {f} ({fields[f][0]!r}): payload fails its position "
                            "CRC-32 (damaged, or moved from another tensor, segment or field)")


def well_formed(buf: Sliceable) -> bool:
    """Whether ``buf`` is laid out as a payload (EKT1 or EKT2): magic, index, every byte
    listed (only the index is read)."""
    try:
        unpack(buf, None, None)
    except CorruptDataError:
        return False
    return True
