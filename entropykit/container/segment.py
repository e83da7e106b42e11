"""One segment of one tensor: format split -> coded fields, and coded fields -> bytes.

What it is: the step between raw tensor bytes and field payloads. A tensor's bytes are
coded in segments of at most ``segment_bytes`` so memory stays bounded and segments run
in parallel; each segment is split into fields by ``entropykit.formats`` and every field
gets the smallest codec (``codecs.choose``), conditioned on an earlier field where the
format says so. What it is not: the payload or file layout, or the choice of layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import formats
from .._errors import CorruptDataError
from ..coding import contexts, tables
from ..coding.parallel import run, spread
from ..formats._planes import Planes, int_view
from . import codecs, order0
from . import header as hdr


@dataclass(frozen=True)
class Coded:
    """A coded segment: its fields (name, context field), codec and payload per field
    (bytes, or a raw field's ``codecs.Stored`` pieces), and the order-0 entropy of its
    fields in bits."""

    fields: tuple[tuple[str, str | None], ...]
    codecs: tuple[str, ...]
    parts: tuple[bytes | codecs.Stored, ...]
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


@dataclass(frozen=True)
class Split:
    """What ``formats.split`` makes of a (dtype, layout): the fields (name, context field)
    and how many symbols each field gets per ``unit`` bytes (the smallest whole number of
    bytes holding whole elements). Known before any data is seen, so the container can
    bound the size of its header and payloads."""

    fields: tuple[tuple[str, str | None], ...]
    per_unit: tuple[int, ...]
    unit: int

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def of(dtype: str, layout: str | None, dtype_bits: int) -> Split:
        """Probe the split with one unit of zeros; ValueError if the dtype is unsupported.
        Cached: a file of thousands of tensors has a handful of (dtype, layout) pairs."""
        unit = math.lcm(dtype_bits, 8) // 8
        done: dict[str, np.ndarray] = {}
        fields, counts = [], []
        for f in formats.split(dtype, np.zeros(unit, np.uint8), layout=layout):
            fields.append((f.name, _context_name(f.context, done, f.name)))
            counts.append(int(np.size(f.symbols)))
            done[f.name] = np.asarray(f.symbols)
        return Split(tuple(fields), tuple(counts), unit)

    def symbols(self, nbytes: int) -> list[int]:
        """Symbols of each field for a segment of ``nbytes`` (a multiple of ``unit``)."""
        return [nbytes // self.unit * c for c in self.per_unit]


def encode(dtype: str, layout: str | None, raw: np.ndarray, split: Split, *,
           fast: bool = False, target: str = "cpu",
           grid: tuple[int, int] | None = None, stored: bool = False,
           policy: codecs.Policy | None = None) -> Coded:
    """Split ``raw`` (uint8 bytes of whole elements) and code every field (``fast``,
    ``target`` and ``policy``: see ``codecs.choose``); with ``stored``, every field raw.

    RuntimeError if ``formats`` splits it otherwise than ``split`` says (the container's
    size bounds rest on it).
    """
    k = None if policy is None or policy.contexts or stored else codecs.knobs(policy)
    if k is not None and raw.size:
        plan = formats.planes(dtype, layout)
        if plan.word > 1:
            return _encode_planes(raw, plan, split, policy, k)
    done: dict[str, np.ndarray] = {}
    names, parts = [], []
    bits = 0.0
    got = formats.split(dtype, raw, layout=layout)
    want = split.symbols(raw.size)
    if len(got) != len(want):
        raise RuntimeError(f"formats split {dtype} into {len(got)} fields, probed {len(want)}")
    elements = raw.size * 8 // hdr.DTYPE_BITS[dtype]  # grid applies to one symbol each
    syms = []
    for f, field, n in zip(got, split.fields, want, strict=True):
        sym = tables._flat(f.symbols, np.uint8)
        ctx = None if f.context is None else _context_name(f.context, done, f.name)
        if (f.name, ctx) != field or sym.size != n:
            raise RuntimeError(f"formats split {raw.size} bytes of {dtype} otherwise than "
                               f"probed: field {f.name!r} of {sym.size} symbols")
        done[f.name] = sym
        syms.append(sym)
    # Sharing a pass pays on large segments only: for a few hundred symbols the 256 x 256
    # joint's bookkeeping costs more than the histograms it spares.
    shared = (target == "cpu" and not fast and policy is None and not stored
              and min(want, default=0) >= _SHARE_MIN)
    counts = _counts(split.fields, syms) if shared else {}
    for sym, field, n in zip(syms, split.fields, want, strict=True):
        if stored:
            names.append(codecs.RAW.name)
            parts.append(codecs.RAW.stored(sym))
            continue
        choice = codecs.choose(sym, None if field[1] is None else done[field[1]], target,
                               fast=fast, grid=grid if n == elements else None,
                               counts=_expand(counts.pop(field[0], None)) if shared else None,
                               policy=policy)
        names.append(choice.codec)
        parts.append(choice.payload)
        bits += choice.entropy_bits
    return Coded(split.fields, tuple(names), tuple(parts), bits)


_SHARE_MIN = 1 << 16  # symbols per field from which _counts is taken


def _encode_planes(raw: np.ndarray, plan: Planes, split: Split, policy: codecs.Policy,
                   k: order0.Knobs) -> Coded:
    """``encode`` of a multi-byte dtype under a policy that codes every field without its
    context by ``order0``'s numbers: the planes made and judged in one kernel call (one
    hand-off of the GIL, not one per plane and one for the split), then each settled as
    ``codecs.choose`` settles a field: the same choices and payloads."""
    data = np.ascontiguousarray(raw).reshape(-1)
    n = data.size // plan.word
    if data.size % plan.word or split.symbols(data.size) != [n] * plan.word:
        raise RuntimeError(f"{data.size} bytes do not split into {plan.word} planes as "
                           "probed")
    rows = np.empty((plan.word, n), np.uint8)
    found, bits, bid, param, crc, counts = order0.code_planes(
        int_view(data, plan.word), plan.sign_move, rows, k)
    choices = [codecs.settle(rows[p], policy, int(found[p]), float(bits[p]), int(bid[p]),
                             int(param[p]), int(crc[p]), counts[p])
               for p in range(plan.word)]
    total = 0.0
    for c in choices:  # summed as encode sums them
        total += c.entropy_bits
    return Coded(split.fields, tuple(c.codec for c in choices),
                 tuple(c.payload for c in choices), total)


def _counts(fields: tuple[tuple[str, str | None], ...], syms: list[np.ndarray]
            ) -> dict[str, np.ndarray | tuple[np.ndarray, np.ndarray]]:
    """Histograms that ``codecs.choose`` would take, from one pass per context pair: a
    conditioned field's joint histogram with its context, whose row sums are the context
    field's own histogram (BF16, F32: the exponent is counted with its sign_mantissa).
    A joint is kept as (present context values, their rows) until its field is coded
    (``_expand``): the full 512 KiB would otherwise be held through the context field's
    coding, a fixed cost that is a large share of small segments."""
    by_name = dict(zip((name for name, _ in fields), syms, strict=True))
    out: dict[str, np.ndarray | tuple[np.ndarray, np.ndarray]] = {}
    for name, ctx in fields:
        if ctx is not None:
            joint = contexts.joint_histogram(by_name[ctx], by_name[name])
            per = joint.sum(axis=1)
            present = np.flatnonzero(per)
            out[name] = (present, joint[present])
            out.setdefault(ctx, per)
    return out


def _expand(counts: np.ndarray | tuple[np.ndarray, np.ndarray] | None) -> np.ndarray | None:
    """A histogram as ``_counts`` keeps it, in the form ``codecs.choose`` takes."""
    if not isinstance(counts, tuple):
        return counts
    return _scatter(*counts)


@njit(nogil=True, cache=True)
def _scatter(present, rows):
    # The full joint from its present rows, allocated where contexts.joint_histogram
    # allocates it (the Numba runtime): the memory it took before it was kept compact.
    joint = np.zeros((256, 256), np.int64)
    for i in range(present.size):
        joint[present[i]] = rows[i]
    return joint


def decode(dtype: str, layout: str | None, fields: tuple[tuple[str, str | None], ...],
           codec_names: tuple[str, ...], parts: list[np.ndarray], nbytes: int,
           out: np.ndarray | None = None) -> np.ndarray:
    """The ``nbytes`` original bytes of a segment from its field payloads; written into
    ``out`` when given (see ``formats.join``) and returned."""
    want = expect(dtype, layout, fields).symbols(nbytes)
    done: dict[str, np.ndarray] = {}
    for (name, ctx), codec, part, m in zip(fields, codec_names, parts, want, strict=True):
        try:
            n = codecs.count(codec, part, limit=m)
            if n != m:  # so no coder is asked for more than the segment holds
                raise CorruptDataError(f"claims {n} symbols, {nbytes} bytes of {dtype} make {m}")
            done[name] = codecs.decode(codec, part, n, None if ctx is None else done[ctx])
        except CorruptDataError as e:
            raise CorruptDataError(f"field {name!r} ({codec}): {e}") from None
    try:
        out = _join(dtype, layout, done, want, nbytes, out)
    except CorruptDataError:
        raise
    except (ValueError, KeyError) as e:
        raise CorruptDataError(f"fields do not join into {nbytes} bytes of {dtype}: {e}") from None
    out = np.asarray(out)
    if out.dtype != np.uint8 or out.size != nbytes:
        raise CorruptDataError(f"fields join into {out.size} bytes, expected {nbytes}")
    return out.reshape(-1)


JOIN_PART = 1 << 20  # output bytes per part of a large segment's join


def _join(dtype: str, layout: str | None, done: dict[str, np.ndarray], want: list[int],
          nbytes: int, out: np.ndarray | None) -> np.ndarray:
    """``formats.join`` of a segment; a large one in parts of whole elements on the pool's
    threads (``run(.., 1)``: serial, or inside a running call on its threads), where every
    field has one symbol per element, as every split has: writing a fresh output is as
    much of a segment's decode as its chunks are."""
    m = want[0] if want else 0
    if (nbytes <= JOIN_PART or m == 0 or any(k != m for k in want) or nbytes % m
            or spread(1) == 1):
        return formats.join(dtype, done, nbytes, layout=layout, out=out)
    if out is None:
        out = np.empty(nbytes, np.uint8)
    word = nbytes // m
    cuts = list(range(0, m, max(1, JOIN_PART // word))) + [m]

    def part(k: int) -> np.ndarray:
        a, b = cuts[k], cuts[k + 1]
        return formats.join(dtype, {f: sym[a:b] for f, sym in done.items()}, (b - a) * word,
                            layout=layout, out=out[a * word : b * word])

    run(part, len(cuts) - 1, 1)
    return out


def expect(dtype: str, layout: str | None, fields: tuple[tuple[str, str | None], ...]
           ) -> Split:
    """The split of (``dtype``, ``layout``), which a record's ``fields`` must equal;
    CorruptDataError otherwise (a reader never trusts a field list it cannot check)."""
    try:
        split = Split.of(dtype, layout, hdr.DTYPE_BITS[dtype])
    except (ValueError, KeyError, TypeError, NotImplementedError) as e:
        raise CorruptDataError(f"{dtype} with layout {layout!r} is not coded by entropykit "
                               f"({e})") from None
    if split.fields != fields:
        raise CorruptDataError(f"fields {list(fields)} are not those of {dtype} with layout "
                               f"{layout!r}: {list(split.fields)}")
    return split


def _step(dtype_bits: int, segment_bytes: int) -> int:
    unit = math.lcm(dtype_bits, 8) // 8  # bytes holding a whole number of elements
    return max(unit, segment_bytes // unit * unit)


def count(nbytes: int, dtype_bits: int, segment_bytes: int) -> int:
    """How many segments ``bounds`` gives, without listing them."""
    return -(-nbytes // _step(dtype_bits, segment_bytes))


def bounds(nbytes: int, dtype_bits: int, segment_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of a tensor's segments: ``segment_bytes`` rounded down to whole elements
    (at least one element group), the last one shorter; none for an empty tensor."""
    step = _step(dtype_bits, segment_bytes)
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]
