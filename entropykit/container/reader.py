"""Read a compressed safetensors file: check it, decode one tensor, or restore the original.

What it is: ``Compressed``, a validated view of a compressed file, in memory or read
from disk on demand (``source.FileBytes``, never mapped): the outer safetensors header,
the record, the original header, and cross-checks between the three (names, dtypes,
shapes, payload sizes, segment counts); ``tensor(name)`` decodes one tensor's original
bytes, reading only its payload; ``restore(out)`` writes the original file byte for
byte, segments decoded on a bounded thread pool. Opening reads the header only; a
tensor's payload index is read when the tensor is, and each segment's field payloads
inside the worker that decodes the segment (memory O(segment x threads), reads
overlapping decoding), checked against their position CRCs (``payload.check``).
Every inconsistency raises ``CorruptDataError`` saying what and where.
What it is not: file handling (``files.py``) or encoding (``writer.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO

import numpy as np

from .._errors import CorruptDataError
from ..coding.crc32 import crc32_ranges
from . import codecs, driver, payload, record, segment
from . import header as hdr
from .parallel import UNIT_BYTES, imap, imap_grouped, run
from .source import Arena, ArrayBytes, Bytes, Scratch, Window

Progress = Callable[[int, int], None]
GAP = 64 << 10  # bytes between field payloads read in one read anyway (``parts_of``)


def is_compressed(h: hdr.Header, src: Bytes | None = None) -> bool:
    """Whether a parsed safetensors header says its file is entropykit-compressed: it has
    the record, or its metadata names one, or (given the file's bytes ``src``) every
    tensor is a payload (``claim``). Such a file is read as compressed, never as plain:
    a damaged record is an error, not a plain file."""
    return claim(h, None if src is None else _tensors(h, src)) is not None


def read_header(src: Bytes) -> hdr.Header:
    """The safetensors header of ``src``, reading only it; CorruptDataError if it is not
    valid (or if the file was cut while it was read)."""
    try:
        return hdr.parse_read(src.read, src.size)
    except CorruptDataError:
        raise  # a short read: the file changed while its header was read
    except ValueError as e:
        raise CorruptDataError(f"not a valid safetensors file: {e}") from None


def _tensors(h: hdr.Header, src: Bytes) -> Callable[[hdr.Entry], Window]:
    """A tensor's bytes in ``src`` (a file with header ``h``), read when sliced."""
    return lambda e: Window(src, h.data_start + e.begin, e.nbytes)


def claim(h: hdr.Header, read: Callable[[hdr.Entry], payload.Sliceable] | None = None
          ) -> str | None:
    """Why a file with header ``h`` says it is an entropykit file, or None
    (docs/format.md, "Reading a file as compressed"); ``read(entry)`` gives a tensor's
    bytes (an array, or read when sliced), for the payload rule (skipped without it)."""
    if record.KEY in (h.metadata or {}):
        return f"__metadata__ has {record.KEY!r}"
    why = record.names_record(h.metadata)
    if why is None and read is not None and h.entries and all(
            e.dtype == "U8" and len(e.shape) == 1 and payload.well_formed(read(e))
            for e in h.entries):
        why = "every tensor is an entropykit payload"
    return why


class _Once:
    """A value made by the first caller of ``get`` (the others wait for it and share it):
    a tensor's payload index, read and checked on the worker that runs the tensor's first
    segment instead of on the thread handing out the jobs, whose work stays serial at
    any thread count. A failed attempt is repeated by the next caller, failing the same.
    ``whole``: the tensor's whole payload, where ``make`` read it with its index (a tensor
    of one segment: one read instead of two; in that thread's scratch buffer, so valid
    only for the one job that reads it, until that thread's next read). ``read``: that
    payload where it was read already, with the other small tensors of its work unit
    (``Compressed._read_group``), for ``make`` to use instead of reading it."""

    def __init__(self, make: Callable[[_Once], payload.Fields]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._value: payload.Fields | None = None
        self.whole: np.ndarray | None = None
        self.read: np.ndarray | None = None

    def get(self) -> payload.Fields:
        with self._lock:
            if self._value is None:
                self._value = self._make(self)
            return self._value


_Job = tuple[hdr.Entry, int, int, _Once, np.ndarray | None]


class Compressed:
    """A compressed file: bytes in memory, or a ``source.FileBytes`` read on demand;
    raises CorruptDataError if inconsistent.

    Attributes: ``outer`` (the file's own header), ``record``, ``original`` (the
    original file's header, parsed). Every size and count the file states is checked
    against the file and the format's caps before anything is sized by it.
    """

    def __init__(self, buf: bytes | bytearray | memoryview | np.ndarray | Bytes, *,
                 outer: hdr.Header | None = None) -> None:
        """``outer``: the header ``read_header(buf)`` gave, when the caller has it already
        (parsing it again is work no thread can share)."""
        in_memory = isinstance(buf, (bytes, bytearray, memoryview, np.ndarray))
        self._src: Bytes = ArrayBytes(buf) if in_memory else buf
        self._scratch = Scratch()
        self._group_scratch = Scratch()  # a work unit's small payloads, read together
        self.outer = read_header(self._src) if outer is None else outer
        if record.KEY not in (self.outer.metadata or {}):
            why = claim(self.outer, _tensors(self.outer, self._src))
            if why is not None:
                raise CorruptDataError(f"damaged entropykit file: {why}, but no "
                                       f"{record.KEY!r} record")
            raise ValueError("not an entropykit-compressed file (no entropykit record)")
        self.record = record.parse(self.outer.metadata[record.KEY])
        try:
            self.original = hdr.parse_json(self.record.header)
        except ValueError as e:
            raise CorruptDataError(f"original header in the record: {e}") from None
        self._outer = {e.name: e for e in self.outer.entries}
        self._entries = {e.name: e for e in self.original.entries}
        self._check()

    def _check(self) -> None:
        if not self._entries.keys() == self._outer.keys() == self.record.tensors.keys():
            raise CorruptDataError("tensor names differ between file, record and original "
                                   "header")
        for e in self.original.entries:
            t, o = self.record.tensors[e.name], self._outer[e.name]
            if (t.dtype, t.shape) != (e.dtype, e.shape):
                raise CorruptDataError(
                    f"tensor {e.name!r}: record says {t.dtype}{list(t.shape)}, original "
                    f"header {e.dtype}{list(e.shape)}"
                )
            if o.dtype != "U8" or len(o.shape) != 1:
                raise CorruptDataError(f"tensor {e.name!r}: payload is not a 1-D U8 tensor")
            try:
                segment.expect(e.dtype, t.layout, t.fields)
            except CorruptDataError as err:
                raise CorruptDataError(f"tensor {e.name!r}: {err}") from None
            # Counted, not listed: a claimed size must not cost memory before it is checked.
            n = segment.count(e.nbytes, hdr.DTYPE_BITS[e.dtype], self.record.segment_bytes)
            if len(t.codecs) != n:
                raise CorruptDataError(
                    f"tensor {e.name!r}: record lists {len(t.codecs)} segments, "
                    f"{e.nbytes} bytes make {n}"
                )
            if o.nbytes < payload.index_size(n * len(t.fields), self.record.bound):
                raise CorruptDataError(
                    f"tensor {e.name!r}: a payload of {o.nbytes} bytes cannot index "
                    f"{n} segments of {len(t.fields)} fields"
                )

    @property
    def source(self) -> Bytes:
        """The file's bytes (read on demand, or in memory)."""
        return self._src

    def payload_at(self, name: str) -> int:
        """Where tensor ``name``'s payload starts in the file."""
        return self.outer.data_start + self._outer[name].begin

    def bounds(self, e: hdr.Entry) -> list[tuple[int, int]]:
        return segment.bounds(e.nbytes, hdr.DTYPE_BITS[e.dtype], self.record.segment_bytes)

    def keys(self) -> list[str]:
        """Tensor names in the original data order (as ``safetensors`` lists them)."""
        return [e.name for e in self.original.by_offset]

    def entry(self, name: str) -> hdr.Entry:
        """The original header's entry of tensor ``name`` (KeyError if absent)."""
        return self._entries[name]

    def payload_size(self, name: str) -> int:
        return self._outer[name].nbytes

    def _payload(self, name: str) -> Window:
        o = self._outer[name]
        return Window(self._src, self.outer.data_start + o.begin, o.nbytes)

    def fields(self, name: str, buf: np.ndarray | None = None) -> payload.Fields:
        """Where the field payloads of tensor ``name`` are and their position CRCs, from
        its payload index (read and checked; the CRCs are checked by ``segment_parts``);
        ``buf``: the tensor's whole payload, when the caller has read it."""
        t = self.record.tensors[name]
        try:
            return payload.unpack(self._payload(name) if buf is None else buf,
                                  len(t.codecs) * len(t.fields), self.record.bound)
        except CorruptDataError as err:
            raise CorruptDataError(f"tensor {name!r}: {err}") from None

    def segment_parts(self, name: str, fields: payload.Fields, seg: int,
                      scratch: Scratch | None = None) -> list[np.ndarray]:
        """Segment ``seg``'s field payloads of tensor ``name`` (placed by ``fields``), read
        and each checked against its position CRC; CorruptDataError naming the place if
        one fails. Runs where the segment is decoded, so the read and the check are
        parallel with the decoding. With ``scratch``, they are read into this thread's
        buffer there, valid until this thread's next read."""
        t = self.record.tensors[name]
        nf = len(t.fields)
        a, b = fields.span(seg * nf, (seg + 1) * nf)
        at = self.outer.data_start + self._outer[name].begin + a
        block = self._src.read(at, b - a, scratch)
        parts = fields.split(block, seg * nf, (seg + 1) * nf)
        crcs = None if fields.crcs is None else fields.crcs[seg * nf : (seg + 1) * nf]
        try:
            payload.check(name, seg, t.fields, parts, crcs)
        except CorruptDataError as err:
            raise CorruptDataError(f"tensor {name!r} segment {seg}: {err}") from None
        return parts

    def parts_of(self, segs: Sequence[tuple[str, payload.Fields | None, int]],
                 arena: Arena | None = None) -> list[list[np.ndarray]]:
        """``segment_parts`` of several segments (tensor name, its ``fields``, segment):
        their field payloads read in as few reads as lie within ``GAP`` bytes of each other
        (the parts are views of those reads), all their position CRCs computed in one call
        per read (``crc32_ranges``, no Python per field), each checked as
        ``segment_parts`` checks it; the first failure in ``segs`` order raises its error.
        ``fields`` None: the tensor's whole payload is read with the rest and its index
        unpacked from it (``fields(name, buf)``; for a tensor of one segment, it saves the
        index's own reads). ``arena``: where the reads go (``source.Arena``)."""
        spans = []
        for name, fields, seg in segs:
            at = self.outer.data_start + self._outer[name].begin
            if fields is None:
                spans.append((at, at + self._outer[name].nbytes))
                continue
            nf = len(self.record.tensors[name].fields)
            a, b = fields.span(seg * nf, (seg + 1) * nf)
            spans.append((at + a, at + b))
        block_of = [0] * len(spans)
        blocks: list[list[int]] = []  # [start, end] of each read
        for k in sorted(range(len(spans)), key=lambda k: spans[k]):
            a, b = spans[k]
            if blocks and a - blocks[-1][1] <= GAP:
                blocks[-1][1] = max(blocks[-1][1], b)
            else:
                blocks.append([a, b])
            block_of[k] = len(blocks) - 1
        bufs = [self._src.read(a, b - a, arena) for a, b in blocks]
        out = []
        # per read: starts, lengths, seeds, wanted CRCs, and (segment, field) of each
        checks: list[tuple[list[int], list[int], list[int], list[int], list[tuple[int, int]]]]
        checks = [([], [], [], [], []) for _ in blocks]
        for k, ((name, fields, seg), (a, b)) in enumerate(zip(segs, spans, strict=True)):
            nf = len(self.record.tensors[name].fields)
            lo, hi = seg * nf, (seg + 1) * nf
            at = a - blocks[block_of[k]][0]
            view = bufs[block_of[k]][at : at + b - a]
            if fields is None:  # the whole payload: its index first
                fields = self.fields(name, view)
                first, end = fields.span(lo, hi)
                view, at = view[first:end], at + first
            out.append(fields.split(view, lo, hi))
            if fields.crcs is None:
                continue  # EKT1: no position CRCs
            starts, lengths, seeds, want, where = checks[block_of[k]]
            for f in range(nf):
                starts.append(at + fields.offsets[lo + f] - fields.offsets[lo])
                lengths.append(fields.lengths[lo + f])
                seeds.append(payload.place_seed(name, seg, f))
                want.append(fields.crcs[lo + f])
                where.append((k, f))
        bad = []
        for buf, (starts, lengths, seeds, want, where) in zip(bufs, checks, strict=True):
            if starts:
                got = crc32_ranges(buf, np.array(starts, np.int64),
                                   np.array(lengths, np.int64), np.array(seeds, np.uint32))
                bad += [where[i] for i in np.flatnonzero(got != np.array(want, np.uint32))]
        if bad:
            k, f = min(bad)
            name, _, seg = segs[k]
            err = payload.misplaced(self.record.tensors[name].fields, f)
            raise CorruptDataError(f"tensor {name!r} segment {seg}: {err}")
        return out

    def _jobs(self, entries: list[hdr.Entry], into: np.ndarray | None = None, at: int = 0
              ) -> Iterator[_Job]:
        """One job per segment of ``entries``; with ``into``, each job's destination is its
        slice of ``into``, where the data section starts at ``at``."""
        for e in entries:
            if len(self.record.tensors[e.name].codecs) == 1:
                fields = _Once(lambda once, name=e.name: self._whole(name, once))
            else:
                fields = _Once(lambda _, name=e.name: self.fields(name))
            base = at + e.begin
            for s, (lo, hi) in enumerate(self.bounds(e)):
                dest = None if into is None else into[base + lo : base + hi]
                yield e, s, hi - lo, fields, dest

    def _whole(self, name: str, once: _Once) -> payload.Fields:
        """The payload index of tensor ``name``, its whole payload read with it into this
        thread's scratch buffer (unless ``once.read`` has it already) and kept as
        ``once.whole``."""
        if once.read is not None:
            once.whole, once.read = once.read, None
        else:
            once.whole = self._src.read(self.payload_at(name), self.payload_size(name),
                                        self._scratch)
        return self.fields(name, once.whole)

    def _read_group(self, jobs: list[_Job]) -> None:
        """The whole payloads of a work unit's tensors of one segment, read in one read
        into this thread's group buffer (each job's ``_Once.read``) where they lie back to
        back in the file (within ``GAP`` bytes of each other): one read and one GIL
        release for the unit instead of one per tensor. Their indexes are still parsed,
        and every payload checked, by the job that decodes it."""
        ones = [(self.payload_at(j[0].name), self.payload_size(j[0].name), j[3])
                for j in jobs if j[3].read is None and j[3].whole is None
                and len(self.record.tensors[j[0].name].codecs) == 1]
        if len(ones) < 2:
            return
        ones.sort(key=lambda o: o[0])
        start = end = ones[0][0]
        for at, n, _ in ones:
            if at < end or at - end > GAP:
                return  # overlapping or far apart: each job reads its own
            end = at + n
        buf = self._src.read(start, end - start, self._group_scratch)
        for at, n, once in ones:
            once.read = buf[at - start : at - start + n]

    def _decoded(self, jobs: Iterator[_Job], threads: int) -> Iterator[np.ndarray]:
        """``_decode`` of every job in order, the segments of small tensors several to a
        work unit (their payloads read together)."""
        return imap_grouped(self._decode, jobs, threads, lambda j: j[2], UNIT_BYTES,
                            self._read_group)

    def _decode(self, job: _Job) -> np.ndarray:
        e, s, nbytes, fields, dest = job
        t = self.record.tensors[e.name]
        plan = driver.plan(e.dtype, t.layout, t.fields, t.codecs[s])
        if plan is not None and (dest is None or (dest.flags.c_contiguous
                                                  and dest.flags.writeable)):
            out = self._drive(e.name, s, nbytes, fields.get(), plan, dest, fields.whole)
            if out is not None:
                return out
        # Fields the driver does not code, or a segment it rejected: decoded field by
        # field, which raises the error that says what is wrong.
        # The parts are dead once decoded (the output never shares their memory), so
        # they are read into a buffer this thread reuses.
        parts = self.segment_parts(e.name, fields.get(), s, self._scratch)
        try:
            return segment.decode(e.dtype, t.layout, t.fields, t.codecs[s], parts, nbytes,
                                  out=dest)
        except CorruptDataError as err:
            raise CorruptDataError(f"tensor {e.name!r} segment {s}: {err}") from None

    def _drive(self, name: str, s: int, nbytes: int, fields: payload.Fields,
               plan: driver.Plan, dest: np.ndarray | None, whole: np.ndarray | None = None
               ) -> np.ndarray | None:
        """Segment ``s`` of tensor ``name`` decoded by ``driver.decode`` (a large one in
        parts on the pool's threads); None where it rejects a part. ``whole``: the
        tensor's payload, already read (else the segment's field payloads are read)."""
        nf = len(plan.codecs)
        lo, hi = s * nf, (s + 1) * nf
        a, b = fields.span(lo, hi)
        if whole is None:
            block = self._src.read(self.payload_at(name) + a, b - a, self._scratch)
        else:
            block = whole[a:b]
        block = block.view()
        block.flags.writeable = False  # the kernels' one type of frame
        where = np.array((fields.offsets[lo:hi], fields.lengths[lo:hi]), np.int64)
        starts, lengths = where[0] - a, where[1]
        seeds = crcs = None
        if fields.crcs is not None:
            seeds, crcs = np.array((payload.place_seeds(name, s, nf), fields.crcs[lo:hi]),
                                   np.int64)
        m = nbytes // plan.word
        given = {}
        for f in plan.given:  # checked in place by the kernel, as every field
            data = block[starts[f] : starts[f] + lengths[f]]
            codec = self.record.tensors[name].codecs[s][f]
            try:
                if codecs.count(codec, data, limit=m) != m:
                    return None
                given[f] = codecs.decode(codec, data, m, None)
            except CorruptDataError:
                return None  # the layered path says what is wrong, in its order
        out = np.empty(nbytes, np.uint8) if dest is None else dest
        w = plan.word

        def part(k: int) -> int:
            x, y = k * driver.SPAN, min(m, (k + 1) * driver.SPAN)
            return driver.decode(plan, block, starts, lengths, seeds, crcs, m,
                                 out[x * w : y * w], x, y, given)[0]

        count = -(-m // driver.SPAN)
        codes = run(part, count, 1) if count > 1 else [part(0)]
        return out if not any(codes) else None

    def tensor(self, name: str, threads: int = 1) -> np.ndarray:
        """The original bytes of tensor ``name`` (uint8, writable, freshly allocated)."""
        e = self.entry(name)
        out = np.empty(e.nbytes, np.uint8)
        for _ in imap(self._decode, self._jobs([e], out, -e.begin), threads):
            pass  # each segment is decoded straight into its slice of out
        return out

    def tensors(self, names: Sequence[str], threads: int = 1) -> Iterator[np.ndarray]:
        """``tensor(name)`` of each of ``names`` in turn, all decoded on one pool: the
        segments of large tensors side by side, small tensors several to a work unit."""
        entries = [self.entry(k) for k in names]
        outs: list[np.ndarray | None] = []  # each tensor's array, made as its jobs are

        def jobs() -> Iterator[_Job]:
            for e in entries:
                outs.append(np.empty(e.nbytes, np.uint8))
                yield from self._jobs([e], outs[-1], -e.begin)

        results = self._decoded(jobs(), threads)
        try:
            for k, e in enumerate(entries):
                if not e.nbytes:  # no segment, no job: its array may not be made yet
                    yield np.empty(0, np.uint8)
                    continue
                for _ in range(len(self.record.tensors[e.name].codecs)):
                    next(results)
                out, outs[k] = outs[k], None  # handed over, not held here
                yield out
        finally:
            results.close()

    def span(self, name: str, lo: int, hi: int, threads: int = 1) -> tuple[int, np.ndarray]:
        """``(start, bytes)``: the original bytes of tensor ``name`` from ``start`` on,
        decoding only the segments that overlap bytes ``[lo, hi)`` (whole segments, so
        ``start <= lo`` and the bytes reach at least ``hi``)."""
        e = self.entry(name)
        bounds = self.bounds(e)
        hit = [s for s, (a, b) in enumerate(bounds) if a < hi and b > lo]
        if not hit:
            return 0, np.empty(0, np.uint8)
        start, end = bounds[hit[0]][0], bounds[hit[-1]][1]
        out = np.empty(end - start, np.uint8)
        # Jobs of other segments are made (nothing read) but never run.
        jobs = (j for j in self._jobs([e], out, -e.begin - start) if hit[0] <= j[1] <= hit[-1])
        for _ in imap(self._decode, jobs, threads):
            pass
        return start, out

    def span_into(self, name: str, lo: int, hi: int, out: np.ndarray, threads: int = 1
                  ) -> None:
        """The original bytes ``[lo, hi)`` of tensor ``name`` into ``out`` (uint8, 1-D,
        ``hi - lo`` bytes, writable): the segments inside the range decoded straight into
        their place, the one or two it cuts decoded apart and their part copied."""
        e = self.entry(name)
        if not 0 <= lo <= hi <= e.nbytes or out.shape != (hi - lo,) or out.dtype != np.uint8:
            raise ValueError(f"tensor {name!r}: bytes [{lo}, {hi}) of {e.nbytes} into "
                             f"{out.dtype}{list(out.shape)}")
        bounds = self.bounds(e)
        fields = _Once(lambda _: self.fields(name))

        def one(s: int) -> None:
            a, b = bounds[s]
            if lo <= a and b <= hi:
                self._decode((e, s, b - a, fields, out[a - lo : b - lo]))
                return
            got = self._decode((e, s, b - a, fields, None))
            x, y = max(a, lo), min(b, hi)
            out[x - lo : y - lo] = got[x - a : y - a]

        for _ in imap(one, [s for s, (a, b) in enumerate(bounds) if a < hi and b > lo],
                      threads):
            pass

    def restored(self, threads: int = 1) -> np.ndarray:
        """The whole original file in memory (uint8, writable): every segment decoded
        straight into its place, no copy."""
        head = hdr.prefix(self.record.header) + self.record.header
        out = np.empty(self.original.file_size(), np.uint8)
        out[: len(head)] = np.frombuffer(head, np.uint8)
        for _ in self._decoded(self._jobs(self.original.by_offset, out, len(head)), threads):
            pass
        return out

    def restore(self, out: BinaryIO, threads: int = 1, progress: Progress | None = None,
                ) -> int:
        """Write the original file to ``out``; returns its size."""
        out.write(hdr.prefix(self.record.header) + self.record.header)
        entries = self.original.by_offset
        total = self.original.data_size
        done = 0
        results = self._decoded(self._jobs(entries), threads)
        try:
            for seg in results:
                out.write(seg.data)
                done += seg.size
                if progress is not None:
                    progress(done, total)
        finally:
            results.close()
        return self.original.file_size()

    def verify(self, threads: int = 1, progress: Progress | None = None,
               against: Callable[[int, np.ndarray], None] | None = None) -> None:
        """Decode everything, checking every checksum; ``against(offset, bytes)`` is called
        with each decoded piece's data-section offset (to compare with an original)."""
        total = self.original.data_size
        done = 0
        results = self._decoded(self._jobs(self.original.by_offset), threads)
        try:
            for seg in results:
                if against is not None:
                    against(done, seg)
                done += seg.size
                if progress is not None:
                    progress(done, total)
        finally:
            results.close()
