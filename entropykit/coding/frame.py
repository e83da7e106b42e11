"""The one frame layer: header, model section, chunk directory, payloads, threads and CRC.

What it is: everything about a frame that does not depend on its model or its lane coder,
for every frame kind: the 28-byte header, the chunk directory (payload length, CRC-32 of
the decoded chunk, raw/coded mode), bounds and consistency checks, running chunks on the
package's thread pool (``parallel``; the kernels release the GIL), and raw fallback per
chunk. A *kind* (``Kind``) names the frame and its magic; its *model* fills the model
section (static frames: ``table_section``, one table or one per context class; distribution
frames: none, the model is named by a fingerprint in the header) and its *lane coder*
codes each chunk (``ChunkCoder`` for the static coders; ``rans.distribution`` for the
per-value distribution coder). Static frames (rANS, tANS) are driven from here by
``encode`` / ``parse`` / ``decode``.
What it is not: a coder or a model.

Frame layout v1 (little-endian; docs/format.md is the normative copy):

    offset  size  field
    0       4     magic (b"EKRA" rANS, b"EKTA" tANS, b"EKRD" distribution rANS)
    4       1     version = 1
    5       1     param: probability precision (rANS) or table log (tANS)
    6       1     lanes: interleaved states per chunk (coder-defined constant)
    7       1     static: context flag (0 one table, 1 one table per context class);
                  distribution: value format code
    8       8     n: number of symbols (values)
    16      4     chunk_size: symbols per chunk (last chunk may be shorter)
    20      4     n_chunks = ceil(n / chunk_size)
    24      4     static: table_len, bytes of the model section (0 iff n == 0);
                  distribution: model fingerprint (no model section)
    28      ...   model section (static: ``table_section``),
                  then n_chunks x u32 payload length,
                  n_chunks x u32 CRC-32 of the chunk's decoded symbols (their bytes),
                  n_chunks x u8 mode (0 coded, 1 raw), then the payloads back to back.
    The frame ends exactly where the last payload ends.

A context-conditioned frame codes symbol i with the table of class ``cmap[context[i]]``,
where ``context`` is another field the caller already has at decode time (for BF16, the
exponents when decoding sign+mantissa).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numba import njit

from .._errors import CorruptDataError
from .._status import ERR_CRC, ERR_RAW, MESSAGES, OK, Status
from . import contexts, table_section, tables
from .crc32 import check_chunks, crc32
from .parallel import default_threads, run

VERSION = 1
MODE_CODED = 0
MODE_RAW = 1
HEADER = struct.Struct("<4sBBBBQIII")
HEADER_SIZE = HEADER.size  # 28
MIN_CHUNK = 1 << 10
MAX_CHUNK = 1 << 26
DEFAULT_CHUNK = 1 << 18
# Symbols a frame may declare when its decoder is given no bound (``max_output`` / ``out``).
# A frame's size does not bound its symbols: a chunk whose table gives one symbol every
# slot codes any count in its fixed-size start states.
DEFAULT_MAX_OUTPUT = 1 << 30
# Chunks a static coder decodes in one call: their serial dependency chains overlap in the
# CPU, and four chunks of the default size stay in a core's cache for their CRC check.
DECODE_GROUP = 4

__all__ = [
    "DECODE_GROUP", "DEFAULT_CHUNK", "DEFAULT_MAX_OUTPUT", "HEADER_SIZE", "MAX_CHUNK",
    "MIN_CHUNK", "MODE_CODED", "MODE_RAW", "VERSION", "ChunkCoder", "Directory", "FrameInfo",
    "Header", "Kind", "decode", "decode_payloads", "default_threads", "directory_error",
    "encode", "parse", "read_directory", "read_header", "worded", "write",
]


# ---- what every frame kind shares --------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """A frame kind as the shared layer sees it: its name in messages, magic, lanes, and
    the check of its header's param byte (``ValueError`` if invalid)."""

    name: str
    magic: bytes
    lanes: int
    check_param: Callable[[int], None]


@dataclass(frozen=True)
class Header:
    """A header's fields; ``flag`` (byte 7) and ``model`` (bytes 24..28) mean what the kind
    says (static: context flag and model section length; distribution: value format code
    and model fingerprint)."""

    param: int
    flag: int
    n: int
    chunk_size: int
    n_chunks: int
    model: int


@dataclass(frozen=True)
class Directory:
    """A validated chunk directory: per chunk its payload length, CRC-32, mode and where
    its payload starts in the frame."""

    lengths: np.ndarray  # int64
    crcs: np.ndarray  # <u4
    modes: np.ndarray  # uint8
    offsets: np.ndarray  # int64


def check_chunk_size(chunk_size: int, lanes: int) -> None:
    """``ValueError`` unless ``chunk_size`` is a multiple of ``lanes`` within the caps."""
    if not MIN_CHUNK <= chunk_size <= MAX_CHUNK or chunk_size % lanes:
        raise ValueError(
            f"chunk_size must be a multiple of {lanes} in [{MIN_CHUNK}, {MAX_CHUNK}], "
            f"got {chunk_size}"
        )


def as_bytes(frame: bytes | memoryview | np.ndarray) -> np.ndarray:
    """A frame as flat, read-only uint8 (no copy): read-only whatever it came as, since
    Numba compiles a kernel apart for read-only and writable arrays."""
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 1:
            raise TypeError(f"a frame array must be 1-D uint8, got {frame.dtype}{frame.shape}")
        if not frame.flags.writeable:
            return frame
        frame = frame.view()
        frame.flags.writeable = False
        return frame
    return np.frombuffer(memoryview(frame).cast("B"), np.uint8)


def read_header(kind: Kind, head: np.ndarray, size: int, *, max_output: int | None = None
                ) -> Header:
    """The header at the start of ``head`` (at least its 28 bytes where the ``size``-byte
    frame has them), with every check that needs no byte past it; ``CorruptDataError`` on
    any mismatch, and where it declares more than ``max_output`` symbols."""
    name = kind.name
    if size < HEADER_SIZE or head.size < HEADER_SIZE:
        raise CorruptDataError(f"{name} frame truncated: {size} bytes, header needs {HEADER_SIZE}")
    magic, version, param, lanes, flag, n, chunk_size, n_chunks, model = (
        HEADER.unpack_from(head.data, 0))
    if magic != kind.magic:
        raise CorruptDataError(
            f"not a {name} frame: magic {bytes(magic)!r} at byte 0, expected {kind.magic!r}")
    if version != VERSION:
        raise CorruptDataError(f"{name} frame version {version} unsupported (byte 4)")
    if max_output is not None and n > max_output:
        raise CorruptDataError(
            f"{name} frame declares {n} symbols (byte 8), more than the {max_output} "
            "its reader allows"
        )
    try:
        kind.check_param(param)
    except ValueError as e:
        raise CorruptDataError(f"{name} frame param at byte 5: {e}") from None
    if lanes != kind.lanes:
        raise CorruptDataError(f"{name} frame lanes {lanes} at byte 6, expected {kind.lanes}")
    try:
        check_chunk_size(chunk_size, lanes)
    except ValueError as e:
        raise CorruptDataError(f"{name} frame chunk size at byte 16: {e}") from None
    if n_chunks != -(-n // chunk_size):
        raise CorruptDataError(
            f"{name} frame: {n_chunks} chunks (byte 20) do not cover {n} symbols of {chunk_size}"
        )
    return Header(param, flag, n, chunk_size, n_chunks, model)


def check_directory_fits(kind: Kind, off: int, n_chunks: int, size: int) -> None:
    """``CorruptDataError`` unless a directory of ``n_chunks`` at ``off`` fits the frame."""
    if off + 9 * n_chunks > size:
        raise CorruptDataError(
            f"{kind.name} frame truncated in chunk directory at byte {off} "
            f"({n_chunks} chunks need {9 * n_chunks} bytes, {size - off} left)"
        )


def directory_error(name: str, end: int, size: int, bad_mode: int, mode: int) -> str | None:
    """What ``read_directory`` says of a directory whose payloads end at byte ``end`` of a
    ``size``-byte ``name`` frame and whose first chunk of unknown mode is ``bad_mode`` (its
    mode ``mode``; -1: none), or None where both are right."""
    if end != size:
        what = "truncated" if end > size else "followed by trailing bytes"
        return f"{name} frame {what}: payloads end at byte {end}, frame has {size} bytes"
    if bad_mode >= 0:
        return f"{name} frame chunk {bad_mode}: unknown mode {mode}"
    return None


def read_directory(kind: Kind, buf: np.ndarray, off: int, n_chunks: int,
                   size: int | None = None) -> Directory:
    """The chunk directory at ``buf[off:]``, checked to fit and to end the frame exactly
    with its payloads; ``CorruptDataError`` otherwise. ``size``: the frame's bytes where
    ``buf`` holds only its first ones (through the directory)."""
    size = buf.size if size is None else size
    check_directory_fits(kind, off, n_chunks, size)
    if off + 9 * n_chunks > buf.size:
        raise ValueError(f"the directory ends at byte {off + 9 * n_chunks}, past the "
                         f"{buf.size} bytes given")
    lengths = np.empty(n_chunks, np.int64)
    offsets = np.empty(n_chunks, np.int64)
    end, bad = _directory(buf, off, lengths, offsets)
    crcs = buf[off + 4 * n_chunks : off + 8 * n_chunks].view("<u4")
    modes = buf[off + 8 * n_chunks : off + 9 * n_chunks]
    err = directory_error(kind.name, end, size, bad, int(modes[bad]) if bad >= 0 else 0)
    if err is not None:
        raise CorruptDataError(err)
    return Directory(lengths, crcs, modes, offsets)


@njit(cache=True)  # keeps the GIL: 9 bytes a chunk cost less than a hand-off of the GIL
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


def write(kind: Kind, head: Header, section: bytes,
          chunk: Callable[[int], tuple[np.ndarray, np.ndarray | None]],
          threads: int | None, prefix: bytes = b"") -> bytes:
    """The frame of header ``head`` (its ``n_chunks`` are coded here), model section
    ``section`` and chunks ``chunk(i)`` = (the chunk's symbols, its coded payload as uint8
    or None to store it raw), run on ``threads`` threads; after ``prefix`` (a caller's
    own header, joined in the same copy)."""
    def one(i: int) -> tuple[int, int, np.ndarray]:
        raw, coded = chunk(i)
        crc = crc32(raw)
        return (MODE_RAW, crc, raw.view(np.uint8)) if coded is None else (MODE_CODED, crc, coded)

    results = run(one, head.n_chunks, threads)
    modes = np.array([r[0] for r in results], np.uint8)
    crcs = np.array([r[1] for r in results], "<u4")
    lengths = np.array([r[2].size for r in results], "<u4")
    parts = [prefix, HEADER.pack(kind.magic, VERSION, head.param, kind.lanes, head.flag, head.n,
                         head.chunk_size, head.n_chunks, head.model),
             section, lengths.tobytes(), crcs.tobytes(), modes.tobytes()]
    return b"".join(parts + [memoryview(r[2]) for r in results])


def decode_payloads(
    kind: Kind, buf: np.ndarray, d: Directory, chunk_size: int, out: np.ndarray,
    decode_coded: Callable[[list[int], int, int], list[int]], group: int,
    threads: int | None,
) -> None:
    """Fill ``out`` (one element per symbol) from the payloads of directory ``d``, ``group``
    chunks per task on ``threads`` threads; ``CorruptDataError`` (with ``.status``,
    ``.chunk`` and ``.offset``) for the first chunk that fails.

    ``decode_coded(idx, lo0, hi0)`` decodes the coded chunks ``idx`` (ascending) of
    the group whose symbols are ``out[lo0:hi0]`` and gives a ``Status`` per chunk. Raw
    chunks are copied here, and every chunk's CRC is checked while it is in cache.
    """
    n, n_chunks, cs = out.size, len(d.lengths), chunk_size
    # Python ints, read once: the per-chunk bookkeeping stays small beside a chunk's decode.
    offsets, lengths = d.offsets.tolist(), d.lengths.tolist()
    raw = {i for i, m in enumerate(d.modes.tobytes()) if m == MODE_RAW}  # mostly none
    crcs = np.array(d.crcs, np.uint32)  # aligned, native: one kernel type
    data = out.reshape(-1).view(np.uint8)
    cs_bytes = cs * out.itemsize

    def task(g: int) -> tuple[int, int] | None:
        first, last = g * group, min(n_chunks, (g + 1) * group)
        codes = np.zeros(last - first, np.int64)  # OK
        coded = list(range(first, last))
        if raw:
            coded = [i for i in coded if i not in raw]
            for i in range(first, last):
                if i in raw:
                    dst = out[i * cs : (i + 1) * cs].view(np.uint8)
                    if lengths[i] != dst.size:
                        codes[i - first] = ERR_RAW
                    else:
                        dst[:] = buf[offsets[i] : offsets[i] + lengths[i]]
        if coded:
            found = decode_coded(coded, first * cs, min(n, last * cs))
            if raw:
                codes[np.array(coded, np.int64) - first] = found
            else:
                codes[:] = found
        # Every chunk's CRC in one call, while the group is in cache.
        bad = check_chunks(data[first * cs_bytes : min(n, last * cs) * out.itemsize],
                           cs_bytes, crcs[first:last], codes, ERR_CRC)
        return None if bad < 0 else (first + bad, int(codes[bad]))

    for failed in run(task, -(-n_chunks // group), threads):
        if failed is not None:
            i, code = failed
            status, start = Status(code), offsets[i]
            what = MESSAGES[status]
            if status == Status.RAW:
                what += (f" ({lengths[i]} bytes, chunk holds "
                         f"{out[i * cs : (i + 1) * cs].nbytes})")
            raise CorruptDataError(
                f"{kind.name} frame chunk {i} (payload at byte {start}): {what}",
                status=status, chunk=i, offset=start)


def worded(codes: Any) -> list[str | None]:
    """Kernel status codes as messages (None for OK)."""
    return [None if c == OK else MESSAGES[Status(c)] for c in codes]


# ---- static frames: a table model section and a ChunkCoder --------------------------------


class ChunkCoder(Protocol):
    """The per-chunk half of a static coder (the lane coder), as the frame sees it."""

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

    def decode_status(
        self, buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray, tabs: Any,
        param: int, out: np.ndarray, ctx: np.ndarray | None, cmap: np.ndarray | None,
        lo: np.ndarray, hi: np.ndarray,
    ) -> list[int]:
        """Decode payload j (``buf[starts[j]:starts[j]+lengths[j]]``) into ``out[lo[j]:hi[j]]``
        for every j (int64 arrays); a ``Status`` per payload. ``ctx`` is None or the
        context value of every symbol of ``out`` (only if ``supports_context``), and then
        a symbol's table is ``cmap[its context value]`` (uint8[256]), or with ``cmap``
        None the context value itself (``decode``'s ``mapped``). ``decode_chunks`` is the
        same with the codes worded (``worded``)."""


@dataclass(frozen=True)
class FrameInfo:
    """A parsed, validated static frame header and directory."""

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


@functools.cache  # coders are module singletons: one Kind each, not one per frame
def _kind(coder: ChunkCoder) -> Kind:
    return Kind(coder.name, coder.magic, coder.lanes, coder.check_param)


def _as_symbols(symbols: Any) -> np.ndarray:
    if isinstance(symbols, (bytes, bytearray, memoryview)):
        return np.frombuffer(symbols, dtype=np.uint8)
    arr = np.asarray(symbols)
    if arr.dtype != np.uint8:
        raise TypeError(f"symbols must be uint8, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1)


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
    prefix: bytes = b"",
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
    ``prefix``: bytes returned before the frame (``write``).
    """
    coder.check_param(param)
    check_chunk_size(chunk_size, coder.lanes)
    sym = _as_symbols(symbols)
    n = sym.size
    kind = _kind(coder)
    if n == 0:
        return write(kind, Header(param, 0, 0, chunk_size, 0, 0), b"", None, threads, prefix)
    joint = None
    if context is not None:
        if not coder.supports_context:
            raise ValueError(f"{coder.name} does not support context-conditioned coding")
        if callable(context):
            if counts is None:
                raise ValueError("a context function needs the joint counts (counts=)")
            ctx = context
        else:
            ctx = _as_context(context, n)
        joint = contexts.joint_histogram(ctx, sym, threads) if counts is None else counts
        _check_counts(joint, (256, 256), n)
    elif counts is None:
        counts = tables.histogram(sym)
    else:
        _check_counts(counts, (256,), n)
    freqs, cmap, section = table_section.build(counts, joint, param, max_tables)
    tabs = coder.encode_tables(freqs if coder.supports_context else freqs[0], param)

    def chunk(i: int) -> tuple[np.ndarray, np.ndarray | None]:
        lo, hi = i * chunk_size, min(n, (i + 1) * chunk_size)
        part_ctx = None
        if cmap is not None:
            part_ctx = _as_context(ctx(lo, hi), hi - lo) if callable(ctx) else ctx[lo:hi]
        return sym[lo:hi], coder.encode_chunk(sym[lo:hi], tabs, param, part_ctx, cmap)

    head = Header(param, int(cmap is not None), n, chunk_size, -(-n // chunk_size), len(section))
    return write(kind, head, section, chunk, threads, prefix)


def parse(coder: ChunkCoder, frame: bytes | memoryview | np.ndarray, *,
          max_output: int | None = None, size: int | None = None) -> FrameInfo:
    """Validate a frame's header and directory; raise ``CorruptDataError`` on any mismatch,
    and where it declares more than ``max_output`` symbols (None: no bound; parsing
    itself allocates in proportion to the frame). ``size``: the frame's bytes where
    ``frame`` holds only its first ones, through its directory (``ValueError`` if fewer)."""
    buf = as_bytes(frame)
    size = buf.size if size is None else size
    kind, name = _kind(coder), coder.name
    h = read_header(kind, buf, size, max_output=max_output)
    if h.flag > 1 or (h.flag and not coder.supports_context):
        raise CorruptDataError(f"{name} frame context flag {h.flag} at byte 7 invalid")
    off = HEADER_SIZE
    if h.n == 0:
        if h.model != 0 or h.flag != 0 or size != off:
            raise CorruptDataError(f"{name} frame of 0 symbols has {size - off} extra bytes")
        empty = np.zeros(0, np.int64)
        return FrameInfo(h.param, 0, h.chunk_size, np.zeros((1, 256), np.int64), None, empty,
                         empty, empty, empty, off)
    if off + h.model > size:
        raise CorruptDataError(
            f"{name} frame truncated in tables: {h.model} bytes from byte {off}, "
            f"frame has {size}"
        )
    if off + h.model > buf.size:
        raise ValueError(f"the tables end at byte {off + h.model}, past the {buf.size} "
                         "bytes given")
    freqs, cmap = table_section.parse(name, buf, off, off + h.model, h.param, h.flag)
    d = read_directory(kind, buf, off + h.model, h.n_chunks, size)
    return FrameInfo(h.param, h.n, h.chunk_size, freqs, cmap, d.lengths, d.crcs, d.modes,
                     d.offsets, size)


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
    buf = as_bytes(frame)
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
    tabs = coder.decode_tables(info.freqs if coder.supports_context else info.freqs[0],
                               info.param)
    cs = info.chunk_size

    los = np.arange(len(info.lengths), dtype=np.int64) * cs  # each chunk's first symbol
    his = np.minimum(los + cs, info.n)

    def coded(chunks: list[int], lo0: int, hi0: int) -> list[int]:
        # The group's coded chunks together: their dependency chains overlap.
        a, b = chunks[0], chunks[-1] + 1
        idx: slice | np.ndarray = (slice(a, b) if b - a == len(chunks)  # mostly: views
                                   else np.array(chunks, np.int64))
        part = None  # the group's contexts: the kernel checks their count
        if ctx is not None:
            part = _as_symbols(ctx(lo0, hi0)) if callable(ctx) else ctx[lo0:hi0]
        return coder.decode_status(buf, info.offsets[idx], info.lengths[idx], tabs,
                                   info.param, out[lo0:hi0], part,
                                   None if mapped else info.cmap, los[idx] - lo0,
                                   his[idx] - lo0)

    d = Directory(info.lengths, info.crcs, info.modes, info.offsets)
    decode_payloads(_kind(coder), buf, d, cs, out, coded, DECODE_GROUP, threads)
    return out
