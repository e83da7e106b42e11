"""The versioned entropykit record kept in a compressed file's ``__metadata__``.

What it is: the typed form of the JSON string stored under ``__metadata__["entropykit"]``
and its (de)serialization with validation. The record says how each tensor was coded
(original dtype and shape, format layout, field names, codec of each field in each
segment) and carries the original header JSON (zstd, base64) with its CRC-32, which is
what makes decompression byte-exact. What it is not: the frames (they live in the
tensor payloads, see ``payload.py``) nor the original tensor offsets (they are in the
original header).

Record v2 (JSON object, keys in this order):
    format         "entropykit"
    version        2 when a codec is "rans2d", else 1 (so files without it stay readable
                   by v1 readers); v1 records may not name "rans2d"
    segment_bytes  bytes of original data per segment (tensors are coded in segments)
    header_crc32   CRC-32 of the original header JSON bytes (padding included)
    header_size    length of the original header JSON bytes
    header         base64 of one zstd frame holding those bytes
    tensors        {name: {"dtype", "shape", "layout", "fields", "codecs"}}: layout is the
                   format split's layout name or null; fields lists [field name, name of
                   the earlier field it is conditioned on or null] in coding order; codecs
                   has one list per segment naming the codec of each field
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass

import zstandard

from .._errors import CorruptDataError
from .header import MAX_HEADER

KEY = "entropykit"
FORMAT = "entropykit"
VERSION = 2  # the newest this module reads and writes
VERSIONS = (1, 2)
CODECS = ("rans", "tans", "zstd", "raw", "rans2d")
_V2_CODECS = frozenset({"rans2d"})  # codecs a v1 record may not name
_LONGEST_CODEC = max(CODECS, key=len)


@dataclass(frozen=True)
class TensorRecord:
    """How one tensor was coded."""

    dtype: str
    shape: tuple[int, ...]
    layout: str | None
    fields: tuple[tuple[str, str | None], ...]  # (name, context field name)
    codecs: tuple[tuple[str, ...], ...]  # [segment][field]

    def to_json(self) -> dict[str, object]:
        return {"dtype": self.dtype, "shape": list(self.shape), "layout": self.layout,
                "fields": [list(f) for f in self.fields], "codecs": [list(c) for c in self.codecs]}

    def widest(self) -> TensorRecord:
        """The same record with every codec name at maximal length (for size bounds)."""
        codecs = tuple((_LONGEST_CODEC,) * len(self.fields) for _ in self.codecs)
        return TensorRecord(self.dtype, self.shape, self.layout, self.fields, codecs)


@dataclass(frozen=True)
class Record:
    """The whole record: coding parameters, original header and one entry per tensor."""

    segment_bytes: int
    header: bytes  # original header JSON, exactly as in the original file
    tensors: dict[str, TensorRecord]

    @property
    def version(self) -> int:
        """The oldest record version that can describe these tensors."""
        used = {c for t in self.tensors.values() for seg in t.codecs for c in seg}
        return 2 if used & _V2_CODECS else 1

    def to_json(self) -> str:
        obj = {
            "format": FORMAT, "version": self.version, "segment_bytes": self.segment_bytes,
            "header_crc32": zlib.crc32(self.header), "header_size": len(self.header),
            "header": base64.b64encode(
                zstandard.ZstdCompressor(level=10).compress(self.header)).decode("ascii"),
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
        }
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def _fail(what: str) -> CorruptDataError:
    return CorruptDataError(f"entropykit record: {what}")


def _field_ok(f: object, earlier: list[list[object]]) -> bool:
    """A field is [name, context]: context names an earlier field or is null."""
    return (isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
            and all(f[0] != g[0] for g in earlier)
            and (f[1] is None or any(f[1] == g[0] for g in earlier)))


def _tensor(name: str, obj: object) -> TensorRecord:
    keys = {"dtype", "shape", "layout", "fields", "codecs"}
    if not isinstance(obj, dict) or set(obj) != keys:
        raise _fail(f"tensor {name!r} entry must have exactly {sorted(keys)}")
    dtype, shape, layout = obj["dtype"], obj["shape"], obj["layout"]
    fields, codecs = obj["fields"], obj["codecs"]
    ok = (
        isinstance(dtype, str)
        and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
        and (layout is None or isinstance(layout, str))
        and isinstance(fields, list) and all(_field_ok(f, fields[:i]) for i, f in enumerate(fields))
        and isinstance(codecs, list)
        and all(isinstance(s, list) and len(s) == len(fields) and all(c in CODECS for c in s)
                for s in codecs)
    )
    if not ok:
        raise _fail(f"tensor {name!r} entry is malformed")
    return TensorRecord(dtype, tuple(shape), layout, tuple((f[0], f[1]) for f in fields),
                        tuple(tuple(s) for s in codecs))


def parse(text: str) -> Record:
    """Parse and validate a record; ``CorruptDataError`` saying what is wrong."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(f"not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _fail("format is not 'entropykit'")
    version = obj.get("version")
    if type(version) is not int or version not in VERSIONS:
        raise _fail(f"version {version!r} unsupported (this reader: {list(VERSIONS)})")
    seg, crc, size = obj.get("segment_bytes"), obj.get("header_crc32"), obj.get("header_size")
    if not all(type(x) is int and x >= 0 for x in (seg, crc, size)) or seg == 0 or seg % 8:
        raise _fail("segment_bytes, header_crc32 and header_size must be integers")
    tensors = obj.get("tensors")
    if not isinstance(tensors, dict) or not isinstance(obj.get("header"), str):
        raise _fail("tensors or header missing")
    try:
        packed = base64.b64decode(obj["header"], validate=True)
        if size > MAX_HEADER or zstandard.frame_content_size(packed) != size:
            raise ValueError(f"size is not {size}")
        header = zstandard.ZstdDecompressor().decompress(packed, max_output_size=size)
    except (ValueError, zstandard.ZstdError) as e:
        raise _fail(f"original header does not decode ({e})") from None
    if len(header) != size or zlib.crc32(header) != crc:
        raise _fail("original header fails its CRC-32 / size check")
    rec = Record(seg, header, {k: _tensor(k, v) for k, v in tensors.items()})
    if rec.version > version:
        raise _fail(f"version {version} record names a codec of version {rec.version}")
    return rec
