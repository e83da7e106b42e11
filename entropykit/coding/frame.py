"""The self-describing coder frame, and the chunk-parallel driver that fills and reads it.

What it is: everything about a frame that does not depend on the coder: header, frequency
tables (one, or one per context class), chunk directory (payload length, CRC-32 of the
decoded chunk, raw/coded mode), bounds and consistency checks, and running chunks on a
thread pool (the kernels release the GIL). What it is not: a coder. A ``ChunkCoder`` plugs
in the per-chunk kernels.

Frame layout v1 (little-endian; docs/format.md is the normative copy):

    offset  size  field
    0       4     magic (b"EKRA" rANS, b"EKTA" tANS)
    4       1     version = 1
    5       1     param: probability precision (rANS) or table log (tANS)
    6       1     lanes: interleaved states per chunk (coder-defined constant)
    7       1     context flag: 0 one table, 1 one table per context class
    8       8     n: number of symbols
    16      4     chunk_size: symbols per chunk (last chunk may be shorter)
    20      4     n_chunks = ceil(n / chunk_size)
    24      4     table_len: bytes of the table section (0 iff n == 0)
    28      ...   table section:
                    flag 0: one serialized table (coding/tables.py)
                    flag 1: u8 n_tables - 1, u8[256] class of each context value
                            (< n_tables), n_tables serialized tables
                  then n_chunks x u32 payload length,
                  n_chunks x u32 CRC-32 of the chunk's decoded symbols,
                  n_chunks x u8 mode (0 coded, 1 raw), then the payloads back to back.
    The frame ends exactly where the last payload ends.

A context-conditioned frame codes symbol i with the table of class ``cmap[context[i]]``,
where ``context`` is another field the caller already has at decode time (for BF16, the
exponents when decoding sign+mantissa).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numba import njit

from .._errors import CorruptDataError
from . import contexts, tables
from .crc32 import crc32

VERSION = 1
MODE_CODED = 0
MODE_RAW = 1
_HEADER = struct.Struct("<4sBBBBQIII")
HEADER_SIZE = _HEADER.size  # 28
MIN_CHUNK = 1 << 10
MAX_CHUNK = 1 << 26
DEFAULT_CHUNK = 1 << 18
# Symbols a frame may declare when its decoder is given no bound (``max_output`` / ``out``).
# A frame's size does not bound its symbols: a chunk whose table gives one symbol every
# slot codes any count in its fixed-size start states.
DEFAULT_MAX_OUTPUT = 1 << 30
# Chunks a coder decodes in one call: their serial dependency chains overlap in the CPU
# (rANS ~1.5-1.8x, tANS ~1.3x faster than one chunk at a time) and four chunks of the
# default size stay in a core's cache for their CRC check.
DECODE_GROUP = 4


class ChunkCoder(Protocol):
    """The per-chunk half of a coder, as the frame driver sees it."""

    magic: bytes
    lanes: int
    name: str
    supports_context: bool

    def check_param(self, param: int) -> None: ...

    def encode_tables(self, freqs: np.ndarray, param: int) -> Any:
        """Coder tables from int64[256] freqs, or int64[n_tables, 256] if supports_context."""

    def decode_tables(self, freqs: np.ndarray, param: int) -> Any:
        """As encode_tables, for the decoder."""

    def encode_chunk(
        self, symbols: np.ndarray, tabs: Any, param: int, ctx: np.ndarray | None,
        cmap: np.ndarray | None,
    ) -> np.ndarray | None:
        """Coded payload as uint8, or None when it would not be smaller than raw.

        ``ctx`` is None for a one-table frame, else the chunk's context value per symbol
        (uint8, same length as ``symbols``), and symbol i then uses table
        ``cmap[ctx[i]]`` (uint8[256]); only coders with ``supports_context`` get one.
        """

    def decode_chunks(
        self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tabs: Any,
        param: int, out: np.ndarray, ctx: np.ndarray | None, cmap: np.ndarray | None,
        lo: np.ndarray, hi: np.ndarray,
    ) -> list[str | None]:
        """Decode payload j (``buf[starts[j]:starts[j]+lengths[j]]``) into ``out[lo[j]:hi[j]]``
        for every j (int64 arrays); error text or None per payload. ``ctx`` is None or the
        context value of every symbol of ``out`` (only if ``supports_context``), and then
        a symbol's table is ``cmap[its context value]`` (uint8[256]), or with ``cmap``
        None the context value itself (``decode``'s ``mapped``)."""


@dataclass(frozen=True)
class FrameInfo:
    """A parsed, validated frame header and directory."""

    param: int
    n: int
    chunk_size: int
    freqs: np.ndarray  # int64[n_tables, 256]
    cmap: np.ndarray | None  # uint8[256] context value -> table, None for one table
    lengths: np.ndarray
    crcs: np.ndarray
    modes: np.ndarray
    offsets: np.ndarray  # start of each payload in the frame
    end: int


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _run(fn: Callable[[int], Any], count: int, threads: int | None) -> list[Any]:
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if count <= 1 or threads == 1:
        return [fn(i) for i in range(count)]
    with ThreadPoolExecutor(max_workers=min(threads, count)) as pool:
        return list(pool.map(fn, range(count)))


def _as_symbols(symbols: Any) -> np.ndarray:
    if isinstance(symbols, (bytes, bytearray, memoryview)):
        return np.frombuffer(symbols, dtype=np.uint8)
    arr = np.asarray(symbols)
    if arr.dtype != np.uint8:
        raise TypeError(f"symbols must be uint8, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1)


def _as_bytes(frame: bytes | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 1:
            raise TypeError(f"a frame array must be 1-D uint8, got {frame.dtype}{frame.shape}")
        return frame
    return np.frombuffer(memoryview(frame).cast("B"), np.uint8)


def _check_chunk_size(chunk_size: int, lanes: int) -> None:
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK or chunk_size % lanes:
        raise ValueError(
            f"chunk_size must be a multiple of {lanes} in [{MIN_CHUNK}, {MAX_CHUNK}], "
            f"got {chunk_size}"
        )


def _check_counts(counts: np.ndarray, shape: tuple[int, ...], n: int) -> None:
    if counts.shape != shape or int(counts.sum()) != n:
        raise ValueError(f"counts must be int64{list(shape)} summing to the {n} symbols")


def _as_context(context: Any, n: int) -> np.ndarray:
    ctx = _as_symbols(context)
    if ctx.size != n:
        raise ValueError(f"context has {ctx.size} values, symbols have {n}")
    return ctx


def encode(
    coder: ChunkCoder,
    symbols: Any,
    param: int,
    chunk_size: int = DEFAULT_CHUNK,
    threads: int | None = None,
    context: Any = None,
    max_tables: int = contexts.DEFAULT_MAX_TABLES,
    counts: np.ndarray | None = None,
) -> bytes:
    """Encode uint8 ``symbols`` into a frame with ``coder``.

    With ``context`` (uint8, one value per symbol) the coder may use one table per context
    class; the same context must then be given to ``decode``. ``context`` may also be a
    function of (lo, hi) giving the contexts of symbols lo..hi-1, asked chunk by chunk
    (then ``counts`` is required). ``counts``, when the caller
    already has it, saves a pass over the data: the histogram of ``symbols``
    (``tables.histogram``, int64[256]), or with a context their joint histogram
    (``contexts.joint_histogram(context, symbols)``, int64[256, 256]). It must be exact:
    a symbol counted 0 cannot be coded (the frame's CRCs would reject the result).
    """
    coder.check_param(param)
    _check_chunk_size(chunk_size, coder.lanes)
    sym = _as_symbols(symbols)
    n = sym.size
    if n == 0:
        return _HEADER.pack(coder.magic, VERSION, param, coder.lanes, 0, 0, chunk_size, 0, 0)
    cmap = None
    if context is not None:
        if not coder.supports_context:
            raise ValueError(f"{coder.name} does not support context-conditioned coding")
        if callable(context):
            if counts is None:
                raise ValueError("a context function needs the joint counts (counts=)")
            ctx = context
        else:
            ctx = _as_context(context, n)
        joint = contexts.joint_histogram(ctx, sym) if counts is None else counts
        _check_counts(joint, (256, 256), n)
        cmap = contexts.choose(joint, max_tables)
        if cmap is None:
            counts = joint.sum(axis=0)
    elif counts is None:
        counts = tables.histogram(sym)
    else:
        _check_counts(counts, (256,), n)
    if cmap is None:
        freqs = tables.quantize(counts, param)[None, :]
        table = tables.serialize(freqs[0])
    else:
        n_tables = int(cmap.max()) + 1
        class_counts = contexts.class_counts(joint, cmap)
        freqs = np.stack([tables.quantize(c, param) for c in class_counts])
        table = b"".join([bytes([n_tables - 1]), cmap.tobytes()]
                         + [tables.serialize(f) for f in freqs])
    tabs = coder.encode_tables(freqs if coder.supports_context else freqs[0], param)
    n_chunks = -(-n // chunk_size)

    def one(i: int) -> tuple[int, int, np.ndarray]:
        lo, hi = i * chunk_size, min(n, (i + 1) * chunk_size)
        part = sym[lo:hi]
        crc = crc32(part)
        part_ctx = None
        if cmap is not None:
            part_ctx = _as_context(ctx(lo, hi), hi - lo) if callable(ctx) else ctx[lo:hi]
        payload = coder.encode_chunk(part, tabs, param, part_ctx, cmap)
        if payload is None:
            return MODE_RAW, crc, part
        return MODE_CODED, crc, payload

    results = _run(one, n_chunks, threads)
    modes = np.array([r[0] for r in results], np.uint8)
    crcs = np.array([r[1] for r in results], "<u4")
    lengths = np.array([r[2].size for r in results], "<u4")
    head = _HEADER.pack(coder.magic, VERSION, param, coder.lanes, int(cmap is not None), n,
                        chunk_size, n_chunks, len(table))
    parts = [head, table, lengths.tobytes(), crcs.tobytes(), modes.tobytes()]
    parts += [memoryview(r[2]) for r in results]
    return b"".join(parts)


def _parse_tables(coder: ChunkCoder, buf: np.ndarray, off: int, end: int, param: int,
                  flag: int) -> tuple[np.ndarray, np.ndarray | None]:
    if flag == 0:
        freqs = np.empty((1, 256), np.int64)
        t_end = tables.parse_into(buf, off, end, param, freqs[0])
        cmap = None
    else:
        if off + 257 > end:
            raise CorruptDataError(f"{coder.name} frame context map truncated at byte {off}")
        n_tables = int(buf[off]) + 1
        cmap = buf[off + 1 : off + 257].copy()
        if int(cmap.max()) >= n_tables:
            raise CorruptDataError(
                f"{coder.name} frame context map at byte {off + 1} names table "
                f"{int(cmap.max())} of {n_tables}"
            )
        t_end = off + 257
        freqs = np.empty((n_tables, 256), np.int64)
        for t in range(n_tables):
            t_end = tables.parse_into(buf, t_end, end, param, freqs[t])
    if t_end != end:
        raise CorruptDataError(
            f"{coder.name} frame tables end at byte {t_end}, header says {end}"
        )
    return freqs, cmap


def parse(coder: ChunkCoder, frame: bytes | memoryview | np.ndarray, *,
          max_output: int | None = None) -> FrameInfo:
    """Validate a frame's header and directory; raise ``CorruptDataError`` on any mismatch,
    and where it declares more than ``max_output`` symbols (None: no bound; parsing
    itself allocates in proportion to the frame)."""
    buf = _as_bytes(frame)
    mv = buf.data
    size = buf.size
    if size < HEADER_SIZE:
        raise CorruptDataError(
            f"{coder.name} frame truncated: {size} bytes, header needs {HEADER_SIZE}"
        )
    magic, version, param, lanes, flag, n, chunk_size, n_chunks, table_len = (
        _HEADER.unpack_from(mv, 0)
    )
    if magic != coder.magic:
        raise CorruptDataError(
            f"not a {coder.name} frame: magic {bytes(magic)!r} at byte 0, "
            f"expected {coder.magic!r}"
        )
    if version != VERSION:
        raise CorruptDataError(f"{coder.name} frame version {version} unsupported (byte 4)")
    if max_output is not None and n > max_output:
        raise CorruptDataError(
            f"{coder.name} frame declares {n} symbols (byte 8), more than the {max_output} "
            "its reader allows"
        )
    try:
        coder.check_param(param)
    except ValueError as e:
        raise CorruptDataError(f"{coder.name} frame param at byte 5: {e}") from None
    if lanes != coder.lanes:
        raise CorruptDataError(
            f"{coder.name} frame lanes {lanes} at byte 6, expected {coder.lanes}"
        )
    if flag > 1 or (flag and not coder.supports_context):
        raise CorruptDataError(f"{coder.name} frame context flag {flag} at byte 7 invalid")
    try:
        _check_chunk_size(chunk_size, lanes)
    except ValueError as e:
        raise CorruptDataError(f"{coder.name} frame chunk size at byte 16: {e}") from None
    if n_chunks != -(-n // chunk_size):
        raise CorruptDataError(
            f"{coder.name} frame: {n_chunks} chunks (byte 20) do not cover {n} symbols "
            f"of {chunk_size}"
        )
    off = HEADER_SIZE
    if n == 0:
        if table_len != 0 or flag != 0 or size != off:
            raise CorruptDataError(f"{coder.name} frame of 0 symbols has {size - off} extra bytes")
        empty = np.zeros(0, np.int64)
        return FrameInfo(param, 0, chunk_size, np.zeros((1, 256), np.int64), None, empty, empty,
                         empty, empty, off)
    if off + table_len > size:
        raise CorruptDataError(
            f"{coder.name} frame truncated in tables: {table_len} bytes from byte {off}, "
            f"frame has {size}"
        )
    freqs, cmap = _parse_tables(coder, buf, off, off + table_len, param, flag)
    off += table_len
    dir_size = 9 * n_chunks
    if off + dir_size > size:
        raise CorruptDataError(
            f"{coder.name} frame truncated in chunk directory at byte {off} "
            f"({n_chunks} chunks need {dir_size} bytes, {size - off} left)"
        )
    lengths = np.empty(n_chunks, np.int64)
    offsets = np.empty(n_chunks, np.int64)
    end, bad = _directory(buf, off, lengths, offsets)
    crcs = buf[off + 4 * n_chunks : off + 8 * n_chunks].view("<u4")
    modes = buf[off + 8 * n_chunks : off + 9 * n_chunks]
    if end != size:
        what = "truncated" if end > size else "followed by trailing bytes"
        raise CorruptDataError(
            f"{coder.name} frame {what}: payloads end at byte {end}, frame has {size} bytes"
        )
    if bad >= 0:
        raise CorruptDataError(f"{coder.name} frame chunk {bad}: unknown mode {modes[bad]}")
    return FrameInfo(param, n, chunk_size, freqs, cmap, lengths, crcs, modes, offsets, end)


@njit(nogil=True, cache=True)
def _directory(buf, off, lengths, offsets):
    """Read the chunk directory at ``buf[off:]`` (the caller checked that its 9 bytes per
    chunk are inside ``buf``): fill ``lengths`` and payload ``offsets``; return where the
    payloads end and the first chunk with an unknown mode (-1 if none)."""
    n = lengths.size
    pos = off + 9 * n  # the first payload starts right after the directory
    bad = -1
    for i in range(n):
        o = off + 4 * i
        length = (np.int64(buf[o]) | np.int64(buf[o + 1]) << 8 | np.int64(buf[o + 2]) << 16
                  | np.int64(buf[o + 3]) << 24)
        lengths[i] = length
        offsets[i] = pos
        pos += length
        if bad < 0 and buf[off + 8 * n + i] > MODE_RAW:
            bad = i
    return pos, bad


def decode(coder: ChunkCoder, frame: bytes | memoryview | np.ndarray,
           threads: int | None = None, out: np.ndarray | None = None,
           context: Any = None, *, info: FrameInfo | None = None,
           mapped: bool = False, max_output: int | None = None) -> np.ndarray:
    """Decode a frame into uint8 symbols (into ``out`` when given, which must fit exactly).

    ``max_output``: the most symbols the frame may declare (``CorruptDataError`` beyond,
    checked before anything is allocated); None: ``out``'s size, or without ``out``
    ``DEFAULT_MAX_OUTPUT``.

    A context-conditioned frame needs the ``context`` it was encoded with (ValueError if
    missing); a one-table frame ignores it. ``context`` may also be a function of (lo, hi)
    giving the contexts of symbols lo..hi-1 (uint8): they are then asked for group by
    group, as the chunks decode, and never all held at once. ``mapped``: the context
    already holds each
    symbol's table index, ``info.cmap[context value]`` (a caller that makes its contexts
    can map them as it goes, sparing the kernel a lookup per symbol; every index is
    checked against the tables). ``info``: this frame's ``parse``, if the caller has it.
    """
    buf = _as_bytes(frame)
    if max_output is None:
        max_output = DEFAULT_MAX_OUTPUT if out is None else out.size
    info = parse(coder, buf, max_output=max_output) if info is None else info
    if info.n > max_output:
        raise CorruptDataError(f"{coder.name} frame declares {info.n} symbols (byte 8), more "
                               f"than the {max_output} its reader allows")
    if out is None:
        out = np.empty(info.n, np.uint8)
    elif out.dtype != np.uint8 or out.shape != (info.n,):
        raise ValueError(f"out must be uint8 of shape ({info.n},)")
    if info.n == 0:
        return out
    ctx = None
    if info.cmap is not None:
        if context is None:
            raise ValueError(f"this {coder.name} frame is context-conditioned: pass context=")
        ctx = context if callable(context) else _as_symbols(context)
        if not callable(ctx) and ctx.size != info.n:
            raise CorruptDataError(
                f"{coder.name} frame holds {info.n} symbols (byte 8), context has {ctx.size}"
            )
    freqs = info.freqs if coder.supports_context else info.freqs[0]
    tabs = coder.decode_tables(freqs, info.param)
    cs = info.chunk_size
    n_chunks = len(info.lengths)

    def group(g: int) -> tuple[int, str] | None:
        # Chunks first..last-1: raw ones copied, coded ones decoded together (their
        # dependency chains overlap), then every chunk's CRC checked while it is in cache.
        first, last = g * DECODE_GROUP, min(n_chunks, (g + 1) * DECODE_GROUP)
        lo0, hi0 = first * cs, min(info.n, last * cs)
        errors: list[str | None] = [None] * (last - first)
        coded = []
        for i in range(first, last):
            start, length = int(info.offsets[i]), int(info.lengths[i])
            lo, hi = i * cs, min(info.n, (i + 1) * cs)
            if info.modes[i] == MODE_RAW:
                if length != hi - lo:
                    errors[i - first] = (f"raw payload is {length} bytes, chunk has "
                                         f"{hi - lo} symbols")
                else:
                    out[lo:hi] = buf[start : start + length]
            else:
                coded.append(i)
        if coded:
            idx = np.array(coded, np.int64)
            lo = idx * cs - lo0
            part = None  # the group's contexts: the kernel checks their count
            if ctx is not None:
                part = _as_symbols(ctx(lo0, hi0)) if callable(ctx) else ctx[lo0:hi0]
            found = coder.decode_chunks(buf, info.offsets[idx], info.lengths[idx], tabs,
                                        info.param, out[lo0:hi0], part,
                                        None if mapped else info.cmap, lo,
                                        np.minimum(lo + cs, hi0 - lo0))
            for i, err in zip(coded, found, strict=True):
                errors[i - first] = err
        for i in range(first, last):
            if errors[i - first] is None and crc32(out[i * cs : (i + 1) * cs]) != int(info.crcs[i]):
                errors[i - first] = "CRC-32 of decoded symbols does not match"
            if errors[i - first] is not None:
                return i, errors[i - first]
        return None

    for failed in _run(group, -(-n_chunks // DECODE_GROUP), threads):
        if failed is not None:
            i, err = failed
            raise CorruptDataError(
                f"{coder.name} frame chunk {i} (payload at byte {int(info.offsets[i])}): {err}"
            )
    return out
