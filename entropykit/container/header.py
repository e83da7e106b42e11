"""The safetensors header: parse and validate one, and render one.

What it is: reading the 8-byte length + JSON header of a safetensors file into typed
entries (checked the way ``safetensors`` checks them: dtype known, byte count matching the
shape, tensors tiling the data section exactly), keeping the raw JSON text for byte-exact
restore; and rendering a header the way ``safetensors`` writes one (compact JSON, padded
with spaces to a multiple of 8). What it is not: tensor data access or compression.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .. import dtypes

METADATA_KEY = "__metadata__"
# safetensors refuses headers over 100 MB; so do we (a hostile length cannot allocate more).
MAX_HEADER = 100_000_000
_LEN = struct.Struct("<Q")
# Deepest JSON nesting any header or record needs is 5 levels; refusing more before parsing
# keeps a hostile file from reaching the parser's recursion limit (or, where a program has
# raised that limit, the C stack).
MAX_JSON_DEPTH = 64
_NOT_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")

DTYPE_BITS = dtypes.BITS  # bits per element of every dtype safetensors knows


@dataclass(frozen=True)
class Entry:
    """One tensor of a header: its name, dtype, shape and byte range in the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A parsed header: the raw JSON bytes (padding included), metadata and entries.

    ``entries`` keep the JSON order; ``by_offset`` is the same entries in data order.
    ``data_start`` is where the data section begins in the file (8 + len(raw)).
    """

    raw: bytes
    metadata: dict[str, str] | None
    entries: tuple[Entry, ...]

    @property
    def data_start(self) -> int:
        return _LEN.size + len(self.raw)

    @property
    def data_size(self) -> int:
        return max((e.end for e in self.entries), default=0)

    @functools.cached_property
    def by_offset(self) -> list[Entry]:
        return sorted(self.entries, key=lambda e: (e.begin, e.end))

    def file_size(self) -> int:
        return self.data_start + self.data_size


def _outside_strings(text: bytes) -> bytes:
    """``text`` without its JSON strings, in a few passes of bytes methods (quicker than a
    regular expression over a record-sized header). A backslash pairs with the
    byte after it, from the start of a run (as the JSON lexer pairs escapes): pairs of
    backslashes go first, then escaped quotes, and every quote left opens or closes a
    string. An unterminated string runs to the end: its brackets are not counted (the
    parser stops at it without nesting deeper)."""
    if b"\\" in text:
        text = text.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(text.split(b'"')[::2])


def _nesting_ok(text: bytes) -> bool:
    """Whether JSON ``text`` nests at most MAX_JSON_DEPTH deep: the most brackets open at
    once outside strings (malformed text is left to the parser, which stops at its first
    error, so never deeper than this counts)."""
    marks = np.frombuffer(_outside_strings(text).translate(None, _NOT_BRACKET), np.uint8)
    level = 0
    for i in range(0, marks.size, 1 << 20):  # in pieces: a few MB of work memory at most
        # "[" and "{" have bit 1 set, "]" and "}" do not: +1 opens, -1 closes.
        depth = level + np.cumsum((marks[i : i + (1 << 20)] & 2).astype(np.int32) - 1)
        if depth.max() > MAX_JSON_DEPTH:
            return False
        level = int(depth[-1])
    return True


def loads(text: str | bytes, **kwargs: object) -> object:
    """``json.loads`` for untrusted text: ValueError if it is not JSON or nests deeper than
    MAX_JSON_DEPTH (checked before parsing)."""
    if not _nesting_ok(text.encode("utf-8", "surrogatepass") if isinstance(text, str)
                       else text):
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return json.loads(text, **kwargs)


def unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """An ``object_pairs_hook`` refusing duplicate keys (which one wins is ambiguous)."""
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _naturals(values: list) -> bool:
    # Every value a plain int >= 0 (bool is not: JSON true/false must not pass as 1/0).
    for x in values:
        if type(x) is not int or x < 0:
            return False
    return True


def _entry(name: str, spec: object) -> Entry:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"tensor {name!r}: entry must have dtype, shape and data_offsets")
    dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not (type(shape) is list and type(offsets) is list and _naturals(shape)
            and _naturals(offsets)):
        raise ValueError(f"tensor {name!r}: shape and data_offsets must be non-negative ints")
    if len(offsets) != 2 or offsets[0] > offsets[1]:
        raise ValueError(f"tensor {name!r}: bad data_offsets {offsets}")
    entry = Entry(name, dtype, tuple(shape), offsets[0], offsets[1])
    bits = entry.numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != entry.nbytes:
        raise ValueError(
            f"tensor {name!r}: {dtype}{list(shape)} needs {bits / 8:g} bytes, "
            f"data_offsets give {entry.nbytes}"
        )
    return entry


def parse_json(raw: bytes) -> Header:
    """Parse header JSON bytes (as stored after the 8-byte length); ValueError if invalid."""
    try:
        obj = loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header is not UTF-8 JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError("header is not a JSON object")
    metadata = obj.pop(METADATA_KEY, None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError("__metadata__ must map strings to strings")
    entries = tuple(_entry(k, v) for k, v in obj.items())
    pos = 0
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            raise ValueError(
                f"tensor {e.name!r} starts at data byte {e.begin}, expected {pos} "
                "(tensors must tile the data section)"
            )
        pos = e.end
    return Header(bytes(raw), metadata, entries)


def read_prefix(buf: memoryview | bytes, file_size: int) -> int:
    """The header length from a file's first 8 bytes; ValueError if it cannot be right."""
    if file_size < _LEN.size:
        raise ValueError(f"{file_size} bytes, too short for a safetensors header")
    (n,) = _LEN.unpack_from(buf, 0)
    if n > MAX_HEADER or _LEN.size + n > file_size:
        raise ValueError(f"header length {n} does not fit in a file of {file_size} bytes")
    return n


def parse_file(buf: memoryview | bytes) -> Header:
    """Parse and validate the header of a whole safetensors file held in ``buf``."""
    return parse_read(lambda offset, n: buf[offset : offset + n], len(buf))


def parse_read(read: Callable[[int, int], object], size: int) -> Header:
    """Parse and validate the header of a safetensors file of ``size`` bytes, reading
    only its header through ``read(offset, n)`` (bytes-like)."""
    n = read_prefix(bytes(read(0, min(_LEN.size, size))), size)
    header = parse_json(bytes(read(_LEN.size, n)))
    if header.file_size() != size:
        raise ValueError(f"tensors end at byte {header.file_size()}, file has {size} bytes")
    return header


def render(metadata: Mapping[str, str] | None, entries: Sequence[Entry],
           reserve: int = 0) -> bytes:
    """Header JSON as safetensors writes it, padded with spaces to a multiple of 8 and to
    at least ``reserve`` bytes (so a header of unknown final size can be written later)."""
    obj: dict[str, object] = {}
    if metadata is not None:
        obj[METADATA_KEY] = dict(metadata)
    for e in entries:
        obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape),
                       "data_offsets": [e.begin, e.end]}
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    size = max(len(text), reserve)
    size += -size % 8
    return text + b" " * (size - len(text))


def prefix(raw: bytes) -> bytes:
    """The 8-byte little-endian length that precedes header JSON ``raw`` in a file."""
    return _LEN.pack(len(raw))


def write_order(entries: Sequence[Entry]) -> list[Entry]:
    """``entries`` in the order safetensors lays tensors out (dtype rank desc, then name)."""
    return sorted(entries, key=lambda e: (-dtypes.WRITE_RANK[e.dtype], e.name))
