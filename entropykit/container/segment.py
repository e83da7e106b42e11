"""One segment of one tensor: format split -> coded fields, and coded fields -> bytes.

What it is: the step between raw tensor bytes and field payloads. A tensor's bytes are
coded in segments of at most ``segment_bytes`` so memory stays bounded and segments run
in parallel; each segment is split into fields by ``entropykit.formats`` and every field
gets the smallest codec (``codecs.choose``), conditioned on an earlier field where the
format says so. What it is not: the payload or file layout, or the choice of layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import formats
from .._errors import CorruptDataError
from . import codecs


@dataclass(frozen=True)
class Coded:
    """A coded segment: its fields (name, context field), codec and payload per field, and
    the order-0 entropy of its fields in bits."""

    fields: tuple[tuple[str, str | None], ...]
    codecs: tuple[str, ...]
    parts: tuple[bytes, ...]
    entropy_bits: float


def _context_name(ctx: object, earlier: dict[str, np.ndarray], name: str) -> str | None:
    """The name of the earlier field a field is conditioned on (formats gives a name or the
    context array itself)."""
    if ctx is None:
        return None
    if isinstance(ctx, str):
        if ctx not in earlier:
            raise ValueError(f"field {name!r} is conditioned on {ctx!r}, not an earlier field")
        return ctx
    for other, sym in earlier.items():
        if ctx is sym or (sym.shape == np.shape(ctx) and np.array_equal(sym, ctx)):
            return other
    raise ValueError(f"field {name!r} is conditioned on data that is not an earlier field")


def encode(dtype: str, layout: str | None, raw: np.ndarray) -> Coded:
    """Split ``raw`` (uint8 bytes of whole elements) and code every field."""
    done: dict[str, np.ndarray] = {}
    fields, names, parts = [], [], []
    bits = 0.0
    for f in formats.split(dtype, raw, layout=layout):
        sym = np.ascontiguousarray(f.symbols, dtype=np.uint8).reshape(-1)
        ctx = _context_name(f.context, done, f.name)
        choice = codecs.choose(sym, None if ctx is None else done[ctx])
        done[f.name] = sym
        fields.append((f.name, ctx))
        names.append(choice.codec)
        parts.append(choice.blob)
        bits += choice.entropy_bits
    return Coded(tuple(fields), tuple(names), tuple(parts), bits)


def decode(dtype: str, layout: str | None, fields: tuple[tuple[str, str | None], ...],
           codec_names: tuple[str, ...], parts: list[np.ndarray], nbytes: int) -> np.ndarray:
    """The ``nbytes`` original bytes of a segment from its field payloads."""
    done: dict[str, np.ndarray] = {}
    for (name, ctx), codec, part in zip(fields, codec_names, parts, strict=True):
        n = codecs.count(codec, part)
        if n > 8 * nbytes:  # a field has at most one symbol per bit of the segment
            raise CorruptDataError(f"field {name!r} claims {n} symbols in {nbytes} bytes")
        try:
            done[name] = codecs.decode(codec, part, n, None if ctx is None else done[ctx])
        except CorruptDataError as e:
            raise CorruptDataError(f"field {name!r} ({codec}): {e}") from None
    try:
        out = formats.join(dtype, done, nbytes, layout=layout)
    except CorruptDataError:
        raise
    except (ValueError, KeyError) as e:
        raise CorruptDataError(f"fields do not join into {nbytes} bytes of {dtype}: {e}") from None
    out = np.asarray(out)
    if out.dtype != np.uint8 or out.size != nbytes:
        raise CorruptDataError(f"fields join into {out.size} bytes, expected {nbytes}")
    return out.reshape(-1)


def bounds(nbytes: int, dtype_bits: int, segment_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of a tensor's segments: ``segment_bytes`` rounded down to whole elements
    (at least one element group), the last one shorter; none for an empty tensor."""
    unit = math.lcm(dtype_bits, 8) // 8  # bytes holding a whole number of elements
    step = max(unit, segment_bytes // unit * unit)
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]
