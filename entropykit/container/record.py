"""The versioned entropykit record kept in a compressed file's ``__metadata__``.

What it is: the typed form of the JSON string stored under ``__metadata__["entropykit"]``
and its (de)serialization with validation. The record says how each tensor was coded
(original dtype and shape, format layout, field names, codec of each field in each
segment) and carries the original header JSON (zstd, base64) with its CRC-32, which is
what makes decompression byte-exact. Also here: the rule for metadata that *names* an
entropykit record without holding a valid one (a damaged file must not pass for a plain
one). What it is not: the frames (they live in the tensor payloads, see ``payload.py``)
nor the original tensor offsets (they are in the original header).

Record v3 (JSON object, keys in this order; docs/format.md is normative):
    format         "entropykit"
    version        3 (versions 1 and 2, without record_crc32, are still read)
    segment_bytes  bytes of original data per segment (tensors are coded in segments),
                   a positive multiple of 8 up to MAX_SEGMENT_BYTES
    header_crc32   CRC-32 of the original header JSON bytes (padding included)
    header_size    length of the original header JSON bytes
    header         base64 of one zstd frame holding those bytes
    tensors        {name: {"dtype", "shape", "layout", "fields", "codecs"}}: layout is the
                   format split's layout name or null; fields lists [field name, name of
                   the earlier field it is conditioned on or null] in coding order; codecs
                   has one list per segment naming the codec of each field
    record_crc32   8 lowercase hex digits: CRC-32 of the record text's UTF-8 bytes before
                   the final ``,"record_crc32":"…"}`` (the last 27 characters)

A version 3 record's tensor payloads are laid out as EKT2, older ones' as EKT1.
"""

from __future__ import annotations

import base64
import json
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass

import zstandard

from .._errors import CorruptDataError
from . import header as hdr

KEY = "entropykit"
FORMAT = "entropykit"
VERSION = 3  # the version this module writes; it reads VERSIONS
VERSIONS = (1, 2, 3)
CODECS = ("rans", "tans", "zstd", "raw", "rans2d")
_V2_CODECS = frozenset({"rans2d"})  # codecs a v1 record may not name
_LONGEST_CODEC = max(CODECS, key=len)
# The largest segment a record may declare: decoding holds a few segments per thread, so
# this bounds decode memory whatever a file claims. The writer's default is 16 MiB.
MAX_SEGMENT_BYTES = 1 << 26
_CRC_KEY = "record_crc32"
_CRC_TAIL = re.compile(r',"record_crc32":"([0-9a-f]{8})"\}\Z')
_KEYS = ("format", "version", "segment_bytes", "header_crc32", "header_size", "header",
         "tensors")
# Keys that only a record has: a metadata value holding two of them is a record.
_OWN_KEYS = frozenset({"segment_bytes", "header_crc32", "header_size", "header", "tensors",
                       _CRC_KEY})


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
    version: int = VERSION  # as read; a record is always written as VERSION

    @property
    def bound(self) -> bool:
        """Whether its tensor payloads are EKT2 (position CRCs, ``payload.py``): version 3
        on; versions 1 and 2 have EKT1."""
        return self.version >= 3

    def to_json(self) -> str:
        """The record text, version VERSION, its checksum last (fixed width: a writer can
        bound the text's length before the checksum is known)."""
        obj = {
            "format": FORMAT, "version": VERSION, "segment_bytes": self.segment_bytes,
            "header_crc32": zlib.crc32(self.header), "header_size": len(self.header),
            "header": base64.b64encode(
                zstandard.ZstdCompressor(level=10).compress(self.header)).decode("ascii"),
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
        }
        body = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)[:-1]
        return f'{body},"{_CRC_KEY}":"{zlib.crc32(body.encode("utf-8")):08x}"}}'


def _fail(what: str) -> CorruptDataError:
    return CorruptDataError(f"entropykit record: {what}")


def _fields_ok(fields: object) -> bool:
    """Each field is [name, context]: names distinct, context an earlier field or null."""
    if not isinstance(fields, list):
        return False
    seen: set[str] = set()
    for f in fields:
        if not (isinstance(f, list) and len(f) == 2 and isinstance(f[0], str)
                and f[0] not in seen
                and (f[1] is None or (isinstance(f[1], str) and f[1] in seen))):
            return False
        seen.add(f[0])
    return True


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
        and _fields_ok(fields)
        and isinstance(codecs, list)
        and all(isinstance(s, list) and len(s) == len(fields) and all(c in CODECS for c in s)
                for s in codecs)
    )
    if not ok:
        raise _fail(f"tensor {name!r} entry is malformed")
    return TensorRecord(dtype, tuple(shape), layout, tuple((f[0], f[1]) for f in fields),
                        tuple(tuple(s) for s in codecs))


def _signed(text: object) -> bool:
    """Whether ``text`` ends with a record_crc32 (see the module docstring);
    CorruptDataError if it does and the checksum does not match."""
    m = _CRC_TAIL.search(text) if isinstance(text, str) else None
    if m is None:
        return False
    try:
        body = text[: m.start()].encode("utf-8")
    except UnicodeEncodeError:
        raise _fail("not UTF-8 text") from None
    if zlib.crc32(body) != int(m.group(1), 16):
        raise _fail(f"{_CRC_KEY} does not match: the record was altered")
    return True


def _load(text: object) -> dict:
    if not isinstance(text, str):
        raise _fail("not a JSON text")
    try:
        obj = hdr.loads(text, object_pairs_hook=hdr.unique_keys)
    except ValueError as e:
        raise _fail(f"not JSON ({e})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise _fail("format is not 'entropykit'")
    return obj


def parse(text: str) -> Record:
    """Parse and validate a record; ``CorruptDataError`` saying what is wrong."""
    signed = _signed(text)
    obj = _load(text)
    version = obj.get("version")
    if type(version) is not int or version not in VERSIONS:
        raise _fail(f"version {version!r} unsupported (this reader: {list(VERSIONS)})")
    if version >= 3 and not (signed and list(obj) == [*_KEYS, _CRC_KEY]):
        raise _fail(f"a version {version} record has exactly the keys {[*_KEYS, _CRC_KEY]}, "
                    f"{_CRC_KEY} last")
    if version < 3 and _CRC_KEY in obj:
        raise _fail(f"a version {version} record has no {_CRC_KEY}")
    seg, crc, size = obj.get("segment_bytes"), obj.get("header_crc32"), obj.get("header_size")
    if not all(type(x) is int and x >= 0 for x in (seg, crc, size)) or seg == 0 or seg % 8:
        raise _fail("segment_bytes, header_crc32 and header_size must be integers")
    if seg > MAX_SEGMENT_BYTES:
        raise _fail(f"segment_bytes {seg} exceeds the format's maximum {MAX_SEGMENT_BYTES}")
    tensors = obj.get("tensors")
    if not isinstance(tensors, dict) or not isinstance(obj.get("header"), str):
        raise _fail("tensors or header missing")
    try:
        packed = base64.b64decode(obj["header"], validate=True)
        if size > hdr.MAX_HEADER or zstandard.frame_content_size(packed) != size:
            raise ValueError(f"size is not {size}")
        header = zstandard.ZstdDecompressor().decompress(packed, max_output_size=size)
    except (ValueError, zstandard.ZstdError) as e:
        raise _fail(f"original header does not decode ({e})") from None
    if len(header) != size or zlib.crc32(header) != crc:
        raise _fail("original header fails its CRC-32 / size check")
    parsed = {k: _tensor(k, v) for k, v in tensors.items()}
    if version == 1 and any(c in _V2_CODECS for t in parsed.values() for seg in t.codecs
                            for c in seg):
        raise _fail("version 1 record names a codec of version 2")
    return Record(seg, header, parsed, version)


def names_record(metadata: Mapping[str, str] | None) -> str | None:
    """Why ``metadata`` says its file holds an entropykit record, or None: a key
    "entropykit" in any letter case, or a value that is a JSON object with "format"
    "entropykit" (any case) or two of the keys only a record has (docs/format.md)."""
    for k, v in (metadata or {}).items():
        if k.casefold() == KEY:
            return f"__metadata__ has the key {k!r}"
        if v.lstrip().startswith("{"):
            try:
                obj = hdr.loads(v)
            except ValueError:
                continue
            fmt = obj.get("format") if isinstance(obj, dict) else None
            if isinstance(obj, dict) and ((isinstance(fmt, str) and fmt.casefold() == FORMAT)
                                          or len(_OWN_KEYS & obj.keys()) >= 2):
                return f"__metadata__[{k!r}] is an entropykit record"
    return None
