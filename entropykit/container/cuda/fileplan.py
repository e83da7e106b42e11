"""Plan the GPU decode of a compressed file: every field's stream and place, in groups.

What it is: the host half of ``load_file(..., device="cuda")``, with no torch and no GPU.
For each segment of each tensor it decides how every field reaches the output tensor:

- rANS frames go to the kernel as they are, and so do ``rans2d`` fields: their class
  maps are checked and unpacked here, and the kernel picks each symbol's table from its
  row's and column's class; ``raw`` fields are copied by the kernel; ``tans`` and
  ``zstd`` fields (zstd: small fields only, as entropykit writes them) are decoded here
  (their own checks run) and copied by the kernel as plain bytes.
- Where a field lands (``placement``): a byte plane ``byteK`` of W-byte elements goes
  to byte K of every element (stride W); ``exponent`` + ``sign_mantissa`` (BF16, F32,
  the sign moved below the exponent) are decoded together in bf16 mode and written as
  the element's top 16 bits; ``nibble_pair`` (packed 4-bit) is every byte. Any other
  split is decoded here (``segment.decode``) and copied.
- Which bytes the host reads and checks. A field payload of more than
  ``STAGED_BYTES`` that the kernel takes (rANS, rans2d, raw) is *staged from the file*:
  the host reads its head (frame header, class maps, chunk directory) and nothing more;
  the loader reads the rest from the file straight into the staging buffer, and the
  device checks the CRC-32s the host would have checked (``Check``: the position CRC,
  seeded with the CRC of the head the host read, so the bytes the plan used and the
  bytes the kernel reads are both covered; a raw field's and each raw chunk's own CRC).
  Smaller payloads are read and checked here: their position CRCs, a raw field's CRC
  and the CRC of every raw chunk of a frame (bytes the GPU copies verbatim); coded
  chunks are checked by the kernel's state checks.

Segments are planned in runs (small segments together, up to ``run_bytes``), each run on
one thread of a pool: the field payloads of its small segments are read in as few reads
as lie together (a tensor of one segment with its payload index) and all their position
CRCs computed in one call (``Compressed.parts_of``), the rANS frames of the run (small
payloads, and the heads of staged ones) parsed together (``_frames``; a frame that fails
there is parsed alone, raising what it raises), its host decodes run on that thread.
The pieces are gathered in data order into ``Group``s of at most ``group_bytes`` of
payload: a group is what the loader stages, copies and launches at once (one launch per
kernel flavour in it: u8 / bf16 mode, context tables, tables wider than shared memory
holds), so host work, copies and decoding overlap.
What it is not: the device side (``load.py``) or the decoder's layout (``rans.cuda.plan``).
"""

from __future__ import annotations

import functools
import queue
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from ..._errors import CorruptDataError
from ...coding import frame as _frame
from ...coding.crc32 import crc32, crc32_ranges
from ...coding.parallel import alone
from ...rans import decode as _rans_decode
from ...rans.cuda.plan import GRID_MAX_WIDTH, WARPS, Batch, Grid, Place, Planner, Stream
from ...rans.static import CODER
from .. import classed, codecs, payload, segment, source
from .. import header as hdr
from ..parallel import imap
from ..reader import Compressed
from ..source import Arena
from . import _frames

GROUP_BYTES = 64 << 20  # payload bytes staged per group
RUN_BYTES = 4 << 20  # output bytes of the small segments one thread plans in a row
# Threads the plan runs on at most: with large payloads staged from the file, what is
# left is mostly Python holding the GIL, which more threads only contend for (with the
# loader's thread, and transformers' in from_pretrained); the file reads use every thread.
PLAN_THREADS = 4
# A field payload larger than this (rANS, rans2d or raw, placed by the kernel) is staged
# straight from the file: the host reads its first ``HEAD`` bytes (header, class maps,
# directory; more if they are longer) and the device checks the rest's CRCs.
STAGED_BYTES = 64 << 10
HEAD = 16 << 10
T = TypeVar("T")
_STAGED_CODECS = frozenset({"rans", "rans2d", "raw"})
POSITION, OWN = 0, 1  # ranks of device checks: a position CRC's failure is reported first
_BYTE = re.compile(r"byte(\d+)")
_SIGN_MOVED = (("exponent", None), ("sign_mantissa", "exponent"))


@dataclass(frozen=True)
class Placement:
    """Where a segment's fields land. ``pair``: exponent/sign_mantissa written as the
    top 16 bits of each element (u16 element ``at16 + i * step16`` of the segment);
    ``planes``: field name -> (byte offset in an element, element bytes)."""

    pair: tuple[int, int] | None
    planes: dict[str, tuple[int, int]]


@functools.cache  # a file has a handful of splits; every segment asks
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


@dataclass(frozen=True)
class Check:
    """A CRC-32 the device checks: bytes ``[at, at + n)`` of ``stream`` as staged, their
    CRC started from ``seed`` must be ``want``; ``message``: the error where it is not."""

    stream: Stream
    at: int
    n: int
    seed: int
    want: int
    rank: int  # POSITION or OWN
    message: str


@dataclass
class Piece:
    """What one segment adds to a launch: bf16-mode pairs and u8-mode streams, placed in
    the bytes (u8) or 16-bit elements (pairs) of tensor ``Place.out``; ``files``: the
    streams whose bytes are staged from the file (stream, file offset of its first byte;
    their ``data`` is a stand-in of the right size), ``checks`` what the device checks of
    them."""

    pairs: list[tuple[Stream, Stream, Place]] = field(default_factory=list)
    singles: list[tuple[Stream, Place]] = field(default_factory=list)
    files: list[tuple[Stream, int]] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def drop(self, s: Stream) -> None:
        """Forget that ``s`` is staged from the file (it was replaced by a host decode)."""
        self.files = [f for f in self.files if f[0] is not s]
        self.checks = [c for c in self.checks if c.stream is not s]

    @property
    def nbytes(self) -> int:
        n = 0
        for a, b, _ in self.pairs:
            n += a.data.size + b.data.size
        for s, _ in self.singles:
            n += s.data.size
        return int(n)


def _check_raw_chunks(s: Stream) -> None:
    """CRC-32 of the raw chunks of an rANS frame (the kernel copies them unchecked)."""
    info = s.info
    if not np.count_nonzero(info.modes):  # no raw chunk (modes are 0 coded, 1 raw: checked)
        return
    raw = np.flatnonzero(info.modes == _frame.MODE_RAW)
    got = crc32_ranges(s.data, info.offsets[raw], info.lengths[raw], np.zeros(raw.size))
    bad = np.flatnonzero(got != info.crcs[raw].astype(np.uint32))
    if bad.size:
        raise CorruptDataError(f"{s.label}: chunk {int(raw[bad[0]])} (raw) fails its CRC-32")


class _Head:
    """A field payload staged from the file: the host holds its first bytes (``data``,
    read again longer by ``need``); ``whole`` reads it all, checked here."""

    def __init__(self, c: Compressed, at: int, size: int, place: tuple[str, int, int],
                 want: int | None, data: np.ndarray | None = None, head: int | None = None
                 ) -> None:
        self.c, self.at, self.size, self.place, self.want = c, at, size, place, want
        if data is None:  # the first ``head`` bytes (``HEAD``), unless the caller has them
            data = c.source.read(at, min(size, HEAD if head is None else head))
        self.data = data

    def need(self, n: int) -> np.ndarray:
        """The first ``n`` bytes (all there are, if fewer), read again if not held."""
        n = min(n, self.size)
        if n > self.data.size:
            self.data = self.c.source.read(self.at, min(self.size, max(n, 2 * self.data.size)))
        return self.data

    def whole(self) -> np.ndarray:
        """The whole payload, its position CRC checked here (a field decoded on the host)."""
        data = self.c.source.read(self.at, self.size)
        _check_position(self.c, self.place, data, self.want)
        return data

    def stage(self, piece: Piece, s: Stream, skip: int, used: int) -> None:
        """Stage ``s`` (the payload's bytes from ``skip`` on) from the file, and have the
        device check the position CRC of the bytes after the first ``used`` (those the
        host parsed, held: their CRC is the check's seed, so both are covered)."""
        piece.files.append((s, self.at + skip))
        if self.want is None:
            return
        held = min(used, self.data.size)
        name, seg, f = self.place
        seed = crc32(self.data[:held], payload.place_seed(name, seg, f))
        fields = self.c.record.tensors[name].fields
        piece.checks.append(Check(s, held - skip, self.size - held, seed, self.want, POSITION,
                                  f"tensor {name!r} segment {seg}: {_misplaced(fields, f)}"))


@functools.lru_cache(maxsize=1024)
def _misplaced(fields: tuple[tuple[str, str | None], ...], f: int) -> str:
    """``payload.misplaced``'s words (one error object a split and field, not a check)."""
    return str(payload.misplaced(fields, f))


def _check_position(c: Compressed, place: tuple[str, int, int], data: np.ndarray,
                    want: int | None) -> None:
    name, seg, f = place
    if want is not None and payload.field_crc(data, name, seg, f) != want:
        err = payload.misplaced(c.record.tensors[name].fields, f)
        raise CorruptDataError(f"tensor {name!r} segment {seg}: {err}")


def _whole(part: np.ndarray | _Head) -> np.ndarray:
    return part.whole() if isinstance(part, _Head) else part


def _stand_in(n: int) -> np.ndarray:
    """``n`` bytes that are not there (a staged stream's ``data``: only its size is used;
    read-only, every element the one byte of an immutable buffer)."""
    return np.ndarray((n,), np.uint8, b"\0", 0, (0,))


def _frame_end(head: np.ndarray, at: int) -> int:
    """Where the frame at ``head[at:]`` ends its directory, as its header says (checked
    by the parse that follows)."""
    if head.size < at + _frame.HEADER_SIZE:
        return at + _frame.HEADER_SIZE
    n_chunks, model = (int(v) for v in head[at + 20 : at + 28].view("<u4"))
    return at + _frame.HEADER_SIZE + model + 9 * n_chunks


def _staged_frame(piece: Piece, part: _Head, skip: int, label: str,
                  info: _frame.FrameInfo | None = None) -> Stream:
    """The rANS frame at byte ``skip`` of a staged payload: parsed from its head (unless
    ``info``, its parse, is given), its raw chunks' CRCs left to the device."""
    if info is None:
        head = part.need(skip + _frame.HEADER_SIZE)
        while (grown := part.need(_frame_end(head, skip))) is not head:
            head = grown  # read again longer: parse what one read gave, header to directory
        try:
            info = _frame.parse(CODER, head[skip:], size=part.size - skip)
        except CorruptDataError as e:
            raise CorruptDataError(f"{label}: {e}") from None
    s = Stream(_stand_in(part.size - skip), info, label)
    for k in np.flatnonzero(info.modes).tolist() if np.count_nonzero(info.modes) else ():
        piece.checks.append(Check(s, int(info.offsets[k]), int(info.lengths[k]), 0,
                                  int(info.crcs[k]), OWN,
                                  f"{label}: chunk {k} (raw) fails its CRC-32"))
    return s


def _staged_stream(piece: Piece, codec: str, part: _Head, n: int, ctx: str | None,
                   label: str, info: _frame.FrameInfo | None = None) -> Stream:
    """``_stream`` of a payload staged from the file (rans, rans2d or raw)."""
    if codec == "raw":
        if part.size != n + codecs.RAW_OVERHEAD:
            raise CorruptDataError(f"{label}: raw field is {part.size} bytes, expected "
                                   f"{n + codecs.RAW_OVERHEAD}")
        s = Stream.plain(_stand_in(n), label)
        want = int(part.need(codecs.RAW_OVERHEAD)[:4].view("<u4")[0])
        piece.checks.append(Check(s, 0, n, 0, want, OWN, f"{label}: raw field fails its CRC-32"))
        part.stage(piece, s, codecs.RAW_OVERHEAD, codecs.RAW_OVERHEAD)
        return s
    if codec == "rans":
        if info is None:
            try:
                got = codecs.count(codec, part.need(_frame.HEADER_SIZE), limit=n)
            except CorruptDataError as e:
                raise CorruptDataError(f"{label}: {e}") from None
            if got != n:
                raise CorruptDataError(f"{label}: holds {got} symbols, the segment has {n}")
        s = _staged_frame(piece, part, 0, label, info)
        if s.context and ctx is None:
            raise CorruptDataError(f"{label}: frame is context-conditioned, the field has "
                                   "no context")
        part.stage(piece, s, 0, _frame_end(part.data, 0))
        return s
    while True:  # rans2d: its class maps, however long, and its frame's head, in one read
        data = part.data
        try:
            p = classed.parse(data, n)
        except CorruptDataError as e:
            if data.size >= part.size:
                raise CorruptDataError(f"{label}: {e}") from None
            part.need(2 * data.size)
            continue
        if part.need(_frame_end(part.need(p.body + _frame.HEADER_SIZE), p.body)) is data:
            break
    if p.cols > GRID_MAX_WIDTH:
        return Stream.plain(classed.decode(part.whole(), n), label)
    s = _staged_frame(piece, part, p.body, f"{label} frame")
    s = s.with_grid(Grid(p.cols, p.phase, p.kc, p.rows, p.columns))
    if s.n != n:
        raise CorruptDataError(f"{label}: frame holds {s.n} symbols, the field has {n}")
    part.stage(piece, s, p.body, _frame_end(part.data, p.body))
    return s


def _stream(codec: str, part: np.ndarray | _Head, n: int, ctx: str | None, label: str,
            piece: Piece | None = None, info: _frame.FrameInfo | None = None) -> Stream:
    """One field's stream: as the kernel will read it, checked as far as the host can
    (staged from the file for a ``_Head``, its checks then added to ``piece``). ``info``:
    an rANS frame's parse, its checks made (``_frames.parse``)."""
    if isinstance(part, _Head):
        assert piece is not None
        return _staged_stream(piece, codec, part, n, ctx, label, info)
    if info is not None:
        s = Stream(part, info, label)
        _check_raw_chunks(s)
        return s
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


def _plan_segment(c: Compressed, job: _Job, parts: list[np.ndarray | _Head],
                  infos: dict[int, _frame.FrameInfo] | None = None) -> Piece:
    """The piece of one segment, whose field payloads ``parts`` are read and checked, or
    to be staged from the file (``_Head``); ``infos``: the parse of some of its rANS
    frames, by field (``_parsed``)."""
    e, s = job.entry, job.seg
    t = c.record.tensors[e.name]
    codec_names = t.codecs[s]
    where = f"tensor {e.name!r} segment {s}"
    piece = Piece()
    place = placement(e.dtype, t.layout, t.fields)
    if place is None:  # a split the kernel cannot place: decode here, copy there
        try:
            raw = segment.decode(e.dtype, t.layout, t.fields, codec_names,
                                 [_whole(p) for p in parts], job.hi - job.lo)
        except CorruptDataError as err:
            raise CorruptDataError(f"{where}: {err}") from None
        piece.singles.append((Stream.plain(raw, where), Place(job.tensor, job.lo, 1)))
        return piece
    counts = _counts(e.dtype, t.layout, t.fields, job.hi - job.lo)
    if counts is None:  # the split's error
        try:
            split = segment.Split.of(e.dtype, t.layout, hdr.DTYPE_BITS[e.dtype])
        except (ValueError, KeyError) as err:
            raise CorruptDataError(f"{where}: {e.dtype} with layout {t.layout!r}: {err}") \
                from None
        raise CorruptDataError(f"{where}: record lists fields {t.fields}, {e.dtype} splits "
                               f"into {split.fields}")
    streams, coded = {}, {}
    infos = infos or {}
    for f, ((name, ctx), codec, part, n) in enumerate(zip(t.fields, codec_names, parts, counts,
                                                          strict=True)):
        streams[name] = _stream(codec, part, n, ctx, f"{where}: field {name!r} ({codec})",
                                piece, infos.get(f))
        coded[name] = (codec, part, n)
    if place.pair is not None:
        exp, sm = streams["exponent"], streams["sign_mantissa"]
        if exp.info is not None and sm.info is not None \
                and exp.info.chunk_size != sm.info.chunk_size:
            # Valid for the CPU decoder, never written by ours: decode the context here.
            codec, part, n = coded["exponent"]
            piece.drop(exp)
            data = _whole(part)
            exp = Stream.plain(_rans_decode(data, threads=1) if codec == "rans" else
                               codecs.decode(codec, data, n, None), exp.label)
        if sm.classed:  # never written by ours (the field has a context): decode it here
            codec, part, n = coded["sign_mantissa"]
            piece.drop(sm)
            sm = Stream.plain(codecs.decode(codec, _whole(part), n, None), sm.label)
        off, step = place.pair
        piece.pairs.append((exp, sm, Place(job.tensor, job.lo // 2 + off, step)))
    for name, (k, word) in place.planes.items():
        piece.singles.append((streams[name], Place(job.tensor, job.lo + k, word)))
    return piece


_NO_FILES = np.zeros((0, 2), np.int64)
_NO_CHECKS = np.zeros((0, 6), np.int64)


@dataclass(frozen=True)
class Part:
    """One batch of a group and the tensors its outputs are: output k is tensor
    ``tensors[k]``, viewed as bytes (u8 mode) or 16-bit elements (bf16 mode).
    ``files``: int64[k, 2], the batch's streams staged from the file (stream, file
    offset); ``checks``: int64[k, 6], the CRCs the device checks (stream, offset in it,
    length, seed, wanted CRC, rank), ``messages`` their errors."""

    batch: Batch
    tensors: tuple[int, ...]
    files: np.ndarray = field(default_factory=lambda: _NO_FILES)
    checks: np.ndarray = field(default_factory=lambda: _NO_CHECKS)
    messages: tuple[str, ...] = ()


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
        got = planners.get(key)
        if got is None:
            got = planners[key] = (Planner(bf16, warps), {})
        return got

    def local(outs: dict[int, int], p: Place) -> Place:
        k = outs.setdefault(p.out, len(outs))
        return Place(k, p.at, p.step)

    files: dict[int, int] = {}  # id(stream) -> file offset, for the staged ones
    checks: dict[int, list[Check]] = {}
    for piece in pieces:
        for s, at in piece.files:
            files[id(s)] = at
        for ch in piece.checks:
            checks.setdefault(id(ch.stream), []).append(ch)
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
        batch = pl.finish(sizes)
        staged, rows, messages = [], [], []
        for k, s in enumerate(batch.streams):
            if id(s) in files:
                staged.append((k, files[id(s)]))
            for ch in checks.get(id(s), ()):
                rows.append((k, ch.at, ch.n, ch.seed, ch.want, ch.rank))
                messages.append(ch.message)
        parts.append(Part(batch, tensors,
                          np.array(staged, np.int64).reshape(-1, 2),
                          np.array(rows, np.int64).reshape(-1, 6), tuple(messages)))
    return Group(tuple(parts))


def _jobs(c: Compressed, entries: Sequence[hdr.Entry], run_bytes: int | None = None
          ) -> Iterator[list[_Job]]:
    """Every segment's job, in data order, in runs a thread plans in a row: a segment of
    ``run_bytes`` (``RUN_BYTES``) or more alone, smaller ones together up to that size
    (a thread pool's hand-off per segment would cost more than planning a tiny one)."""
    run_bytes = RUN_BYTES if run_bytes is None else run_bytes
    run: list[_Job] = []
    size = 0
    for k, e in enumerate(entries):
        bounds = c.bounds(e)
        fields = c.fields(e.name) if len(bounds) > 1 else None
        for s, (lo, hi) in enumerate(bounds):
            if run and size + hi - lo > run_bytes:
                yield run
                run, size = [], 0
            run.append(_Job(k, e, s, lo, hi, fields))
            size += hi - lo
    if run:
        yield run


def run_bytes(threads: int, group_bytes: int) -> int:
    """Output bytes of the runs ``groups`` plans on ``threads``: ``RUN_BYTES`` where runs
    are shared out among threads; on one, a group's worth (a run has a fixed cost, its
    reads and its frames' parse, which a file of many small tensors would pay every few
    MB; a run's payload is about its output or less, so a group still comes after a run
    or two)."""
    return RUN_BYTES if threads > 1 else max(RUN_BYTES, group_bytes)


def _is_staged(c: Compressed, job: _Job) -> bool:
    """Whether some field payload of the job's segment may be staged from the file."""
    if job.fields is None:
        return c.payload_size(job.entry.name) > STAGED_BYTES
    nf = len(c.record.tensors[job.entry.name].fields)
    return max(job.fields.lengths[job.seg * nf : (job.seg + 1) * nf], default=0) > STAGED_BYTES


class _Prefix:
    """A payload (``window``) whose first bytes (``first``) are read: slices within
    them are views, others are read (``payload.unpack`` reads the index through it)."""

    def __init__(self, first: np.ndarray, window: source.Window) -> None:
        self.first, self.window, self.size = first, window, window.size

    def __getitem__(self, s: slice) -> np.ndarray:
        lo, hi, _ = s.indices(self.size)
        return self.first[lo:hi] if hi <= self.first.size else self.window[lo:hi]


def _read_staged(c: Compressed, job: _Job) -> list[np.ndarray | _Head]:
    """The field payloads of a segment of large ones: each large one the kernel places
    and decodes as a ``_Head``, the others read and checked here."""
    name = job.entry.name
    t = c.record.tensors[name]
    nf = len(t.fields)
    base = c.payload_at(name)
    first = np.zeros(0, np.uint8)  # the payload's first bytes, where they were read
    if job.fields is None:
        # A tensor of one segment: its index and its first field's head in one read.
        size = c.payload_size(name)
        first = c.source.read(base, min(size, payload.index_size(len(t.codecs) * nf,
                                                                 c.record.bound) + HEAD))
        fields = c.fields(name, _Prefix(first, source.Window(c.source, base, size)))
    else:
        fields = job.fields
    kernel = placement(job.entry.dtype, t.layout, t.fields) is not None
    parts: list[np.ndarray | _Head] = []
    for f, codec in enumerate(t.codecs[job.seg]):
        i = job.seg * nf + f
        off, n = fields.offsets[i], fields.lengths[i]
        at = base + off
        want = None if fields.crcs is None else fields.crcs[i]
        if kernel and codec in _STAGED_CODECS and n > STAGED_BYTES:
            held = off + min(n, HEAD) <= first.size
            parts.append(_Head(c, at, n, (name, job.seg, f), want,
                               first[off : off + min(n, HEAD)] if held else None,
                               codecs.RAW_OVERHEAD if codec == "raw" else HEAD))
            continue
        data = first[off : off + n] if off + n <= first.size else c.source.read(at, n)
        _check_position(c, (name, job.seg, f), data, want)
        parts.append(data)
    return parts


@functools.lru_cache(maxsize=1024)
def _counts(dtype: str, layout: str | None, fields: tuple[tuple[str, str | None], ...],
            nbytes: int) -> tuple[int, ...] | None:
    """Symbols of each field of a segment of ``nbytes`` the kernel places, or None where
    ``_plan_segment`` does not plan its fields one by one (or will raise)."""
    if placement(dtype, layout, fields) is None:
        return None
    try:
        split = segment.Split.of(dtype, layout, hdr.DTYPE_BITS[dtype])
    except (ValueError, KeyError):
        return None
    return tuple(split.symbols(nbytes)) if split.fields == fields else None


def _parsed(c: Compressed, run: Sequence[_Job], parts: Sequence[list[np.ndarray | _Head]]
            ) -> list[dict[int, _frame.FrameInfo]]:
    """The rANS frames of a run's segments (read, or the heads of staged payloads)
    parsed together (``_frames.parse``): per segment, field -> its parse. A frame left
    out (another codec, or a check failed) is parsed where it is planned, whose checks
    raise what they always raised."""
    frames, where = [], []
    for k, (job, p) in enumerate(zip(run, parts, strict=True)):
        t = c.record.tensors[job.entry.name]
        names = t.codecs[job.seg]
        if "rans" not in names:
            continue
        counts = _counts(job.entry.dtype, t.layout, t.fields, job.hi - job.lo)
        if counts is None or len(p) != len(counts):
            continue
        for f, codec in enumerate(names):
            if codec == "rans":
                part = p[f]
                data = part.data if isinstance(part, _Head) else part
                frames.append((data, part.size, counts[f], t.fields[f][1] is not None))
                where.append((k, f))
    out: list[dict[int, _frame.FrameInfo]] = [{} for _ in run]
    for (k, f), info in zip(where, _frames.parse(frames), strict=True):
        if info is not None:
            out[k][f] = info
    return out


def _plan_run(c: Compressed, run: list[_Job], arena: Arena | None = None) -> list[Piece]:
    """The pieces of a run of segments, in this thread: small segments' field payloads
    read together (into ``arena``) and their position CRCs checked in one pass
    (``Compressed.parts_of``); large ones' heads read (``_read_staged``)."""
    staged = [_is_staged(c, j) for j in run]
    small = iter(c.parts_of([(j.entry.name, j.fields, j.seg)
                             for j, big in zip(run, staged, strict=True) if not big], arena))
    parts = [_read_staged(c, j) if big else next(small)
             for j, big in zip(run, staged, strict=True)]
    infos = _parsed(c, run, parts)
    # Host decodes (tANS, zstd) of a run stay on its thread: runs are what is shared out.
    return alone(lambda _: [_plan_segment(c, j, p, i)
                            for j, p, i in zip(run, parts, infos, strict=True)], None)


def plan_threads(c: Compressed, entries: Sequence[hdr.Entry], threads: int) -> int:
    """The threads worth planning ``entries`` of ``c`` with: ``threads`` where segments
    of ``RUN_BYTES`` or more (output bytes) are decoded on the host (tANS, zstd, a split
    the kernel cannot place: Numba and codecs without the GIL, so runs planned side by
    side overlap), else one (what is left is Python holding the GIL, which more threads
    only hand back and forth, taking it from the loader's thread between its launches)."""
    host = 0
    for e in entries:
        t = c.record.tensors.get(e.name)
        if t is None:
            continue
        whole = placement(e.dtype, t.layout, t.fields) is None
        for (lo, hi), seg in zip(c.bounds(e), t.codecs, strict=False):
            if whole or not _STAGED_CODECS.issuperset(seg):
                host += hi - lo
                if host >= RUN_BYTES:
                    return threads
    return 1


def groups(c: Compressed, threads: int = 1, *, entries: Sequence[hdr.Entry] | None = None,
           warps: int = WARPS, group_bytes: int = GROUP_BYTES) -> Iterator[Group]:
    """The groups decoding every tensor of ``c`` (or only ``entries``, some of its
    ``original`` entries), tensors numbered in data order (``c.keys()``, or as
    ``entries`` lists them); segments are planned ``threads`` (at most
    ``PLAN_THREADS``) at a time, ahead of use,
    each run of them reading its own field payloads (``Compressed.parts_of``)."""
    entries = c.original.by_offset if entries is None else entries
    pending: list[Piece] = []
    size = 0
    arena = Arena()  # the reads of runs held together until their group is staged
    threads = min(threads, PLAN_THREADS)
    results = imap(lambda run: _plan_run(c, run, arena),
                   _jobs(c, entries, run_bytes(threads, group_bytes)), threads)
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


def ahead(items: Iterator[T], depth: int = 1) -> Iterator[T]:
    """``items`` made on a thread of their own, at most ``depth`` ahead of their use (the
    loader fills and launches one group while the next is planned and grouped): the same
    items in the same order, an exception raised where ``items`` raised it. Closing the
    iterator stops the thread (after the item it is making) and closes ``items``."""
    made: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def put(x: object) -> bool:
        while not stop.is_set():
            try:
                made.put(x, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def make() -> None:
        try:
            for x in items:
                if not put((x, None)):
                    return
            put((end, None))
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer
            put((end, e))
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=make, name="entropykit-plan", daemon=True)
    thread.start()
    try:
        while True:
            x, err = made.get()
            if x is end:
                if err is not None:
                    raise err
                return
            yield x
    finally:
        stop.set()
        thread.join()
