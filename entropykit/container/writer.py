"""Write a compressed safetensors file from an original one, streaming.

What it is: ``write(source, out)``: every original tensor becomes a U8 tensor of the same
name holding its payload (``payload.py``), coded segment by segment on a bounded thread
pool, and ``__metadata__`` gets the record (``record.py``) next to the input's own
metadata. Memory stays bounded by a few segments: the header is written last into space
reserved up front (its size is bounded before any data is coded: every codec name and
number is taken at its widest), and each payload index (lengths and position CRCs) is
filled in after its segments.
What it is not: file handling (temp names, reads: ``files.py``) or decoding (``reader.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from .. import formats
from . import codecs, payload, record, segment
from . import header as hdr
from .parallel import UNIT_BYTES, imap_grouped
from .reader import claim
from .stats import Summary

SEGMENT_BYTES = 1 << 24  # 16 MiB of original bytes per segment
FORMAT = "entropykit"  # the output's __metadata__["format"]

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True)
class Source:
    """An original safetensors file: its parsed header and a way to read a tensor's bytes
    (sliced like a uint8 array: an array in memory, or for files a ``source.Window``
    that reads only the slices asked for)."""

    header: hdr.Header
    read: Callable[[hdr.Entry], np.ndarray]


@dataclass(frozen=True)
class _Plan:
    entry: hdr.Entry
    layout: str | None
    split: segment.Split
    bounds: list[tuple[int, int]]
    max_size: int  # payload bytes at most: every field raw (codecs never exceed raw)


def _plan(source: Source, segment_bytes: int) -> list[_Plan]:
    """Layout and fields of every tensor, in data order; ValueError for an unsupported one."""
    names = {e.name for e in source.header.entries}
    plans = []
    for e in source.header.by_offset:
        try:
            layout = formats.layout_for(e.name, e.dtype, e.shape, names)
            split = segment.Split.of(e.dtype, layout, hdr.DTYPE_BITS[e.dtype])
        except (ValueError, KeyError, NotImplementedError) as err:
            raise ValueError(f"tensor {e.name!r}: unsupported dtype {e.dtype} ({err})") from None
        bounds = segment.bounds(e.nbytes, hdr.DTYPE_BITS[e.dtype], segment_bytes)
        k = len(bounds) * len(split.fields)
        raw = sum(sum(split.symbols(hi - lo)) + codecs.RAW_OVERHEAD * len(split.fields)
                  for lo, hi in bounds)
        plans.append(_Plan(e, layout, split, bounds, payload.index_size(k) + raw))
    return plans


def _records(plans: list[_Plan], chosen: dict[str, list[tuple[str, ...]]] | None
             ) -> dict[str, record.TensorRecord]:
    """Tensor records in data order; with ``chosen`` None, every codec at its widest."""
    out = {}
    for p in plans:
        e = p.entry
        rec = record.TensorRecord(e.dtype, e.shape, p.layout, p.split.fields,
                                  tuple(chosen[e.name]) if chosen else ((),) * len(p.bounds))
        out[e.name] = rec if chosen else rec.widest()
    return out


def _metadata(source: Source, rec: record.Record) -> dict[str, str]:
    """The output's ``__metadata__``: the input's, ``format`` set to one that loaders of
    plain safetensors checkpoints refuse (so none loads payload bytes as weights; the
    original value is in the record's header), and the record."""
    meta = dict(source.header.metadata or {})
    meta["format"] = FORMAT
    meta[record.KEY] = rec.to_json()
    return meta


def _header(source: Source, rec: record.Record, sizes: dict[str, int],
            reserve: int = 0) -> bytes:
    """The output header JSON for payloads of these sizes, in data order."""
    meta = _metadata(source, rec)
    entries, pos = {}, 0
    for e in source.header.by_offset:
        n = sizes[e.name]
        entries[e.name] = hdr.Entry(e.name, "U8", (n,), pos, pos + n)
        pos += n
    ordered = [entries[e.name] for e in source.header.entries]
    return hdr.render(meta, ordered, reserve)


def _widest_header(source: Source, plans: list[_Plan], segment_bytes: int) -> bytes:
    """A header at least as long as the final one: every codec name at its longest, every
    payload at its largest size and every offset at the largest end (no more digits)."""
    rec = record.Record(segment_bytes, source.header.raw, _records(plans, None))
    end = sum(p.max_size for p in plans)
    meta = _metadata(source, rec)
    widest = {p.entry.name: hdr.Entry(p.entry.name, "U8", (p.max_size,), end, end)
              for p in plans}
    return hdr.render(meta, [widest[e.name] for e in source.header.entries])


def check_input(source: Source) -> None:
    """Refuse input that says it is entropykit-compressed (``reader.claim``): compressing
    it again would hide a record, and its restored copy would not read as plain."""
    why = claim(source.header, source.read)
    if why is not None:
        raise ValueError(f"already entropykit-compressed ({why})")


def write(source: Source, out: BinaryIO, *, threads: int, segment_bytes: int = SEGMENT_BYTES,
          progress: Progress | None = None, fast: bool = False,
          target: str = "cpu", policy: codecs.Policy | None = None) -> Summary:
    """Compress ``source`` into the seekable binary stream ``out`` (from its position 0);
    ``fast``, ``target`` and ``policy`` as for ``codecs.choose``."""
    codecs.check_target(target)
    check_input(source)
    if not 8 <= segment_bytes <= record.MAX_SEGMENT_BYTES or segment_bytes % 8:
        raise ValueError(f"segment_bytes must be a multiple of 8 from 8 to "
                         f"{record.MAX_SEGMENT_BYTES}, got {segment_bytes}")
    plans = _plan(source, segment_bytes)
    reserve = len(_widest_header(source, plans, segment_bytes))

    def jobs() -> Iterator[tuple[_Plan, int, int, int]]:
        for p in plans:
            for s, (lo, hi) in enumerate(p.bounds):
                yield p, s, lo, hi

    def work(job: tuple[_Plan, int, int, int]) -> tuple[segment.Coded, list[int]]:
        p, s, lo, hi = job
        grid = None if p.layout else codecs.grid_of(
            p.entry.shape, lo * 8 // hdr.DTYPE_BITS[p.entry.dtype])
        coded = segment.encode(p.entry.dtype, p.layout, source.read(p.entry)[lo:hi], p.split,
                               fast=fast, target=target, grid=grid, policy=policy)
        # Position CRCs here, in the worker: they run in parallel with the coding.
        return coded, [payload.field_crc(part, p.entry.name, s, f)
                       for f, part in enumerate(coded.parts)]

    summary = Summary(original_bytes=source.header.file_size(), files=1)
    chosen: dict[str, list[tuple[str, ...]]] = {p.entry.name: [] for p in plans}
    sizes: dict[str, int] = {}
    total = sum(p.entry.nbytes for p in plans)
    pos, done = 8 + reserve, 0
    at = -1  # where the stream is, where known: a write that starts there needs no seek
    results = imap_grouped(work, jobs(), threads, lambda j: j[3] - j[2], UNIT_BYTES)
    try:
        for p in plans:
            # Payload: index (filled in once the lengths are known), then field payloads.
            # A tensor of one segment goes out in one write, index first; a larger one
            # segment by segment after room for its index (the segments are not held).
            k = len(p.bounds) * len(p.split.fields)
            first = pos + payload.index_size(k)
            whole = len(p.bounds) == 1
            lengths: list[int] = []
            crcs: list[int] = []
            held: list[bytes | memoryview] = []
            bits = 0.0
            if not whole:
                out.seek(first)
            for lo, hi in p.bounds:
                coded, part_crcs = next(results)
                crcs += part_crcs
                chosen[p.entry.name].append(coded.codecs)
                if whole:
                    held = _pieces(coded.parts)
                else:
                    out.writelines(_pieces(coded.parts))
                lengths += [len(part) for part in coded.parts]
                bits += coded.entropy_bits
                done += hi - lo
                if progress is not None:
                    progress(done, total)
            if _mistakable(p.entry, payload.index_size(k) + sum(lengths)):
                lengths, crcs = _store(p, source, out, first)
                chosen[p.entry.name] = [(codecs.RAW.name,) * len(p.split.fields)] * len(p.bounds)
                whole, at = False, -1
            sizes[p.entry.name] = payload.index_size(k) + sum(lengths)
            if whole:
                if at != pos:
                    out.seek(pos)
                out.writelines([payload.index(lengths, crcs), *held])
                at = pos + sizes[p.entry.name]
            else:
                out.seek(pos)
                out.write(payload.index(lengths, crcs))
                at = first
            pos += sizes[p.entry.name]
            _count(summary, p.entry, sizes[p.entry.name], bits)
    finally:
        results.close()  # on error: cancel queued segments and wait for running ones
    rec = record.Record(segment_bytes, source.header.raw, _records(plans, chosen))
    head = _header(source, rec, sizes, reserve)
    if len(head) != reserve:  # cannot happen: the reserve is computed from an upper bound
        raise RuntimeError(f"header of {len(head)} bytes outgrew its reserve of {reserve}")
    out.seek(0)
    out.write(hdr.prefix(head) + head)
    out.seek(pos)
    out.truncate()
    summary.compressed_bytes = pos
    return summary


def _mistakable(e: hdr.Entry, size: int) -> bool:
    """Whether a payload of ``size`` bytes has the tensor's own shape: a plain loader
    (transformers, which reads no safetensors metadata) would then take the payload bytes
    for the tensor's values instead of failing on the shape."""
    return list(e.shape) == [size]


def _store(p: _Plan, source: Source, out: BinaryIO, at: int) -> tuple[list[int], list[int]]:
    """Write tensor ``p``'s fields raw from ``at``: its payload is then larger than the
    tensor has elements (at least one byte per element, plus each field's CRC), so
    never mistakable. Returns the field lengths and position CRCs."""
    out.seek(at)
    lengths, crcs = [], []
    for s, (lo, hi) in enumerate(p.bounds):
        coded = segment.encode(p.entry.dtype, p.layout, source.read(p.entry)[lo:hi], p.split,
                               stored=True)
        out.writelines(_pieces(coded.parts))
        for f, part in enumerate(coded.parts):
            lengths.append(len(part))
            crcs.append(payload.field_crc(part, p.entry.name, s, f))
    return lengths, crcs


def _pieces(parts: tuple[bytes | codecs.Stored, ...]) -> list[bytes | memoryview]:
    """A segment's field payloads as the buffers to write, a raw one as its pieces (no
    join): one ``writelines`` for the segment."""
    out: list[bytes | memoryview] = []
    for part in parts:
        if isinstance(part, bytes):
            out.append(part)
        else:
            out += part.pieces()
    return out


def _count(summary: Summary, e: hdr.Entry, size: int, bits: float) -> None:
    row = summary.row(e.dtype)
    row.tensors += 1
    row.values += e.numel
    row.bytes_in += e.nbytes
    row.bytes_out += size
    row.entropy_bits += bits
