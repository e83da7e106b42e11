"""Plan the GPU decode of a compressed file: every field's stream and place, in groups.

What it is: the host half of ``load_file(..., device="cuda")``, with no torch and no GPU.
For each segment of each tensor it checks every field payload's position CRC (the
payload is where the record says, as ``payload.check`` checks it), then decides how every
field reaches the output tensor:

- rANS frames go to the kernel as they are, and so do ``rans2d`` fields: their class
  maps are checked and unpacked here, and the kernel picks each symbol's table from its
  row's and column's class; ``raw`` fields are copied by the kernel (their CRC-32 is
  checked here, and the CRC-32 of every raw chunk inside an rANS frame: bytes the GPU
  copies verbatim are checked on the host, coded chunks by the kernel's state checks);
  ``tans`` and ``zstd`` fields (zstd: small fields only, as entropykit writes them) are
  decoded here (their own checks run) and copied by the kernel as plain bytes.
- Where a field lands (``placement``): a byte plane ``byteK`` of W-byte elements goes
  to byte K of every element (stride W); ``exponent`` + ``sign_mantissa`` (BF16, F32,
  the sign moved below the exponent) are decoded together in bf16 mode and written as
  the element's top 16 bits; ``nibble_pair`` (packed 4-bit) is every byte. Any other
  split is decoded here (``segment.decode``) and copied.

Segments are planned in runs (small segments together, up to ``RUN_BYTES``), each run on
one thread of a pool: its field payloads are read in as few reads as lie together (a
tensor of one segment with its payload index), all their position CRCs computed in one
call (``Compressed.parts_of``), and its host decodes run on that thread. The pieces are
gathered in data order into ``Group``s of at
most ``group_bytes`` of payload: a group is what the loader stages, copies and launches
at once (one launch per kernel flavour in it: u8 / bf16 mode, context tables, tables
wider than shared memory holds), so host work, copies and decoding overlap.
What it is not: the device side (``load.py``) or the decoder's layout (``rans.cuda.plan``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..._errors import CorruptDataError
from ...coding import frame as _frame
from ...coding.crc32 import crc32, crc32_ranges
from ...coding.parallel import alone
from ...rans import decode as _rans_decode
from ...rans.cuda.plan import GRID_MAX_WIDTH, WARPS, Batch, Grid, Place, Planner, Stream
from .. import classed, codecs, payload, segment
from .. import header as hdr
from ..parallel import imap
from ..reader import Compressed
from ..source import Arena

GROUP_BYTES = 64 << 20  # payload bytes staged per group
RUN_BYTES = 1 << 20  # output bytes of the small segments one thread plans in a row
_BYTE = re.compile(r"byte(\d+)")
_SIGN_MOVED = (("exponent", None), ("sign_mantissa", "exponent"))


@dataclass(frozen=True)
class Placement:
    """Where a segment's fields land. ``pair``: exponent/sign_mantissa written as the
    top 16 bits of each element (u16 element ``at16 + i * step16`` of the segment);
    ``planes``: field name -> (byte offset in an element, element bytes)."""

    pair: tuple[int, int] | None
    planes: dict[str, tuple[int, int]]


def placement(dtype: str, layout: str | None,
              fields: tuple[tuple[str, str | None], ...]) -> Placement | None:
    """The placement of a split (``formats``' field names), or None for a split this
    module does not know (the loader then decodes those segments on the host)."""
    if layout is not None:
        return Placement(None, {"nibble_pair": (0, 1)}) if fields == (("nibble_pair", None),) \
            else None
    bits = hdr.DTYPE_BITS.get(dtype, 0)
    if bits < 8 or bits % 8:
        return None
    word = bits // 8
    pair = None
    rest = fields
    if fields[:2] == _SIGN_MOVED:
        if word not in (2, 4):
            return None
        pair, rest = (word // 2 - 1, word // 2), fields[2:]
    planes = {}
    for name, ctx in rest:
        m = _BYTE.fullmatch(name)
        k = int(m.group(1)) if m else -1
        if ctx is not None or not 0 <= k < (word - 2 if pair else word) or name in planes:
            return None
        planes[name] = (k, word)
    return Placement(pair, planes)


@dataclass
class Piece:
    """What one segment adds to a launch: bf16-mode pairs and u8-mode streams, placed in
    the bytes (u8) or 16-bit elements (pairs) of tensor ``Place.out``."""

    pairs: list[tuple[Stream, Stream, Place]] = field(default_factory=list)
    singles: list[tuple[Stream, Place]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        streams = [s for a, b, _ in self.pairs for s in (a, b)] + [s for s, _ in self.singles]
        return sum(int(s.data.size) for s in streams)


def _check_raw_chunks(s: Stream) -> None:
    """CRC-32 of the raw chunks of an rANS frame (the kernel copies them unchecked)."""
    info = s.info
    raw = np.flatnonzero(info.modes == _frame.MODE_RAW)
    if raw.size == 0:
        return
    got = crc32_ranges(s.data, info.offsets[raw], info.lengths[raw], np.zeros(raw.size))
    bad = np.flatnonzero(got != info.crcs[raw].astype(np.uint32))
    if bad.size:
        raise CorruptDataError(f"{s.label}: chunk {int(raw[bad[0]])} (raw) fails its CRC-32")


def _stream(codec: str, part: np.ndarray, n: int, ctx: str | None, label: str) -> Stream:
    """One field's stream: as the kernel will read it, checked as far as the host can."""
    try:
        got = codecs.count(codec, part, limit=n)
    except CorruptDataError as e:
        raise CorruptDataError(f"{label}: {e}") from None
    if got != n:
        raise CorruptDataError(f"{label}: holds {got} symbols, the segment has {n}")
    if codec == "rans":
        s = Stream.frame(part, label)
        if s.context and ctx is None:
            raise CorruptDataError(f"{label}: frame is context-conditioned, the field has "
                                   "no context")
        _check_raw_chunks(s)
        return s
    if codec == "raw":
        if part.size != n + codecs.RAW_OVERHEAD:
            raise CorruptDataError(f"{label}: raw field is {part.size} bytes, expected "
                                   f"{n + codecs.RAW_OVERHEAD}")
        if crc32(part[codecs.RAW_OVERHEAD:]) != int(part[:4].view("<u4")[0]):
            raise CorruptDataError(f"{label}: raw field fails its CRC-32")
        return Stream.plain(part[codecs.RAW_OVERHEAD:], label)
    if codec == "rans2d":
        return _classed(part, n, label)
    try:
        return Stream.plain(codecs.decode(codec, part, n, None), label)  # tans, zstd
    except CorruptDataError as e:
        raise CorruptDataError(f"{label}: {e}") from None


def _classed(part: np.ndarray, n: int, label: str) -> Stream:
    """A rans2d field as a classed stream (rows wider than the kernel's grid coordinates:
    decoded here)."""
    try:
        p = classed.parse(part, n)
        if p.cols > GRID_MAX_WIDTH:
            return Stream.plain(classed.decode(part, n), label)
    except CorruptDataError as e:
        raise CorruptDataError(f"{label}: {e}") from None
    s = Stream.on_grid(part[p.body:], Grid(p.cols, p.phase, p.kc, p.rows, p.columns),
                       f"{label} frame")
    if s.n != n:
        raise CorruptDataError(f"{label}: frame holds {s.n} symbols, the field has {n}")
    _check_raw_chunks(s)
    return s


@dataclass(frozen=True)
class _Job:
    tensor: int  # index in data order
    entry: hdr.Entry
    seg: int
    lo: int
    hi: int
    # The tensor's (this segment's parts are checked as they are read); None for a tensor
    # of one segment, whose index is read with its field payloads (``parts_of``).
    fields: payload.Fields | None


def _plan_segment(c: Compressed, job: _Job, parts: list[np.ndarray]) -> Piece:
    """The piece of one segment, whose field payloads ``parts`` are read and checked."""
    e, s = job.entry, job.seg
    t = c.record.tensors[e.name]
    codec_names = t.codecs[s]
    where = f"tensor {e.name!r} segment {s}"
    piece = Piece()
    place = placement(e.dtype, t.layout, t.fields)
    if place is None:  # a split the kernel cannot place: decode here, copy there
        try:
            raw = segment.decode(e.dtype, t.layout, t.fields, codec_names, parts,
                                 job.hi - job.lo)
        except CorruptDataError as err:
            raise CorruptDataError(f"{where}: {err}") from None
        piece.singles.append((Stream.plain(raw, where), Place(job.tensor, job.lo, 1)))
        return piece
    try:
        split = segment.Split.of(e.dtype, t.layout, hdr.DTYPE_BITS[e.dtype])
    except (ValueError, KeyError) as err:
        raise CorruptDataError(f"{where}: {e.dtype} with layout {t.layout!r}: {err}") from None
    if split.fields != t.fields:
        raise CorruptDataError(f"{where}: record lists fields {t.fields}, {e.dtype} splits "
                               f"into {split.fields}")
    counts = split.symbols(job.hi - job.lo)
    streams, coded = {}, {}
    for (name, ctx), codec, part, n in zip(t.fields, codec_names, parts, counts,
                                           strict=True):
        streams[name] = _stream(codec, part, n, ctx, f"{where}: field {name!r} ({codec})")
        coded[name] = (codec, part, n)
    if place.pair is not None:
        exp, sm = streams["exponent"], streams["sign_mantissa"]
        if exp.info is not None and sm.info is not None \
                and exp.info.chunk_size != sm.info.chunk_size:
            # Valid for the CPU decoder, never written by ours: decode the context here.
            codec, part, n = coded["exponent"]
            exp = Stream.plain(_rans_decode(exp.data, threads=1) if codec == "rans" else
                               codecs.decode(codec, part, n, None), exp.label)
        if sm.classed:  # never written by ours (the field has a context): decode it here
            codec, part, n = coded["sign_mantissa"]
            sm = Stream.plain(codecs.decode(codec, part, n, None), sm.label)
        off, step = place.pair
        piece.pairs.append((exp, sm, Place(job.tensor, job.lo // 2 + off, step)))
    for name, (k, word) in place.planes.items():
        piece.singles.append((streams[name], Place(job.tensor, job.lo + k, word)))
    return piece


@dataclass(frozen=True)
class Part:
    """One batch of a group and the tensors its outputs are: output k is tensor
    ``tensors[k]``, viewed as bytes (u8 mode) or 16-bit elements (bf16 mode)."""

    batch: Batch
    tensors: tuple[int, ...]


@dataclass(frozen=True)
class Group:
    """Batches staged and launched together (one per kernel flavour)."""

    parts: tuple[Part, ...]


def _group(pieces: Sequence[Piece], entries: Sequence[hdr.Entry], warps: int) -> Group:
    """The launches of some pieces: one per kernel flavour (mode, context, narrow,
    classed)."""
    planners: dict[tuple[bool, bool, bool, bool], tuple[Planner, dict[int, int]]] = {}

    def planner(bf16: bool, ctx: bool, narrow: bool, cls: bool = False
                ) -> tuple[Planner, dict[int, int]]:
        key = (bf16, ctx, narrow, cls)
        if key not in planners:
            planners[key] = (Planner(bf16, warps), {})
        return planners[key]

    def local(outs: dict[int, int], p: Place) -> Place:
        k = outs.setdefault(p.out, len(outs))
        return Place(k, p.at, p.step)

    for piece in pieces:
        for exp, sm, p in piece.pairs:
            pl, outs = planner(True, sm.context, exp.narrow and sm.narrow,
                               exp.classed or sm.classed)
            try:
                pl.add_pair(exp, sm, local(outs, p))
            except ValueError as err:  # fields of different lengths: a damaged file
                raise CorruptDataError(str(err)) from None
        for s, p in piece.singles:
            pl, outs = planner(False, False, s.narrow, s.classed)
            pl.add(s, local(outs, p))
    parts = []
    for key in sorted(planners):
        pl, outs = planners[key]
        tensors = tuple(outs)  # local index order
        unit = 2 if key[0] else 1
        sizes = [entries[t].nbytes // unit for t in tensors]
        parts.append(Part(pl.finish(sizes), tensors))
    return Group(tuple(parts))


def _jobs(c: Compressed, entries: Sequence[hdr.Entry]) -> Iterator[list[_Job]]:
    """Every segment's job, in data order, in runs a thread plans in a row: a segment of
    ``RUN_BYTES`` or more alone, smaller ones together up to that size (a thread pool's
    hand-off per segment would cost more than planning a tiny one)."""
    run: list[_Job] = []
    size = 0
    for k, e in enumerate(entries):
        bounds = c.bounds(e)
        fields = c.fields(e.name) if len(bounds) > 1 else None
        for s, (lo, hi) in enumerate(bounds):
            if run and size + hi - lo > RUN_BYTES:
                yield run
                run, size = [], 0
            run.append(_Job(k, e, s, lo, hi, fields))
            size += hi - lo
    if run:
        yield run


def _plan_run(c: Compressed, run: list[_Job], arena: Arena | None = None) -> list[Piece]:
    """The pieces of a run of segments: their field payloads read together (into
    ``arena``) and their position CRCs checked in one pass (``Compressed.parts_of``), in
    this thread."""
    parts = c.parts_of([(j.entry.name, j.fields, j.seg) for j in run], arena)
    # Host decodes (tANS, zstd) of a run stay on its thread: runs are what is shared out.
    return alone(lambda _: [_plan_segment(c, j, p) for j, p in zip(run, parts, strict=True)],
                 None)


def groups(c: Compressed, threads: int = 1, *, entries: Sequence[hdr.Entry] | None = None,
           warps: int = WARPS, group_bytes: int = GROUP_BYTES) -> Iterator[Group]:
    """The groups decoding every tensor of ``c`` (or only ``entries``, some of its
    ``original`` entries), tensors numbered in data order (``c.keys()``, or as
    ``entries`` lists them); segments are planned ``threads`` at a time, ahead of use,
    each run of them reading its own field payloads (``Compressed.parts_of``)."""
    entries = c.original.by_offset if entries is None else entries
    pending: list[Piece] = []
    size = 0
    arena = Arena()  # the reads of runs held together until their group is staged
    results = imap(lambda run: _plan_run(c, run, arena), _jobs(c, entries), threads)
    try:
        for pieces in results:
            for piece in pieces:
                pending.append(piece)
                size += piece.nbytes
                if size >= group_bytes:
                    yield _group(pending, entries, warps)
                    pending, size = [], 0
        if pending:
            yield _group(pending, entries, warps)
    finally:
        results.close()
