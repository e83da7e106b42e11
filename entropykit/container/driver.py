"""One kernel call per part of a segment: its field payloads checked, decoded and joined.

What it is: ``decode``, which does in one nogil call what ``segment.decode`` and
``payload.check`` do through a few hundred Python calls: the position CRC of every field
payload, each rANS and tANS frame's header, table section and chunk directory (the same checks and
caps), every chunk decoded and checked against its CRC, a "rans2d" payload's class maps,
a raw field's CRC, then the fields joined into the caller's output (with the fields of
the codec it cannot run, zstd, decoded by the caller beforehand). It calls the frame,
table, CRC, context and plane kernels those layers call (both coders' ``decode_chunks``,
``crc32._check_chunks``, ``lines._context``, ``_planes.join_planes`` ...), with the
argument types they are compiled for, so no kernel gets another specialization. A
segment larger than ``SPAN`` symbols per field goes in parts of whole chunks, one call
each, on the pool's threads.
What it is not: the source of error messages. A part it rejects comes back as a
``Status`` and the field it was in; the caller then decodes the segment the layered way,
which raises the one ``CorruptDataError`` each fault has always raised. Fields it cannot
code (packed layouts; a segment of zstd fields alone) are left to that way too
(``plan`` says None).

Arrays the kernels read as read-only (frames, contexts, a context map, decoded planes
checked by CRC) cannot be made read-only inside Numba: the caller passes each scratch
buffer twice, writable and as a read-only view of the same memory.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
from numba import njit

from .. import formats
from .._status import (
    ERR_CRC,
    ERR_RAW,
    OK,
    Status,
)
from ..coding import crc32, frame, lines, tables
from ..formats import _planes
from ..rans import kernels
from ..rans.lanes import LANES
from ..tans import kernels as tans_kernels
from ..tans import static as tans_static
from ..tans import table as tans_table
from . import header as hdr

# Codecs the kernel codes: their numbers in ``decode``'s ``codec`` argument.
RANS, RANS2D, RAW, GIVEN, TANS = 0, 1, 2, 3, 4
# GIVEN: a field of a codec the kernel cannot run and that takes no context (zstd):
# the caller decodes it (``given``) and the kernel checks its place and joins it.
_CODECS = {"rans": RANS, "rans2d": RANS2D, "raw": RAW, "zstd": GIVEN, "tans": TANS}
SPAN = 1 << 20  # symbols per field in one call: a multiple of every writer's chunk size
UNALIGNED = -1  # a part's edge cuts a chunk (a frame of another chunk size): not driven

_PLACE = int(Status.PLACE)
_HEADER = int(Status.HEADER)
_MODEL = int(Status.MODEL)
_DIRECTORY = int(Status.DIRECTORY)
_FRAME_MAGIC = np.frombuffer(b"EKRA", np.uint8)
_TANS_MAGIC = np.frombuffer(b"EKTA", np.uint8)
_TANS_LOGS = (tans_static.PRECISIONS[0], tans_static.PRECISIONS[-1])
_2D_MAGIC = np.frombuffer(b"EK2D", np.uint8)


@dataclass(frozen=True)
class Plan:
    """How a segment's fields go through the kernel: codec numbers, the field each is
    conditioned on (-1: none), element bytes and the sign move of the join."""

    codecs: np.ndarray  # int64 per field
    given: tuple[int, ...]  # the fields of GIVEN codecs
    context: np.ndarray  # int64 per field
    word: int
    sign_move: bool


@functools.lru_cache(maxsize=1024)
def plan(dtype: str, layout: str | None, fields: tuple[tuple[str, str | None], ...],
         codecs: tuple[str, ...]) -> Plan | None:
    """The plan of a segment of ``dtype`` whose fields are coded with ``codecs``; None
    where the kernel does not code it (another codec, a packed layout, no CRC kernel)."""
    if not crc32.ACCELERATED or layout is not None or dtype not in formats.DTYPES:
        return None
    if any(c not in _CODECS for c in codecs):
        return None
    p = formats.registry._plan(dtype, None)
    word = hdr.DTYPE_BITS[dtype] // 8
    names = [n for n, _ in fields]
    if tuple(names) != p.names or word != p.word or word not in (1, 2, 4, 8):
        return None
    ctx = np.array([-1 if c is None else names.index(c) for _, c in fields], np.int64)
    codes = np.array([_CODECS[c] for c in codecs], np.int64)
    if (codes == GIVEN).all():
        return None  # nothing for the kernel to decode
    given = tuple(int(f) for f in np.flatnonzero(codes == GIVEN))
    return Plan(codes, given, ctx, word, p.sign_move)


class _Scratch:
    """Per-thread buffers, each with its read-only twin (module docstring)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, planes: int, ctx: int) -> tuple[np.ndarray, ...]:
        got = getattr(self._local, "bufs", None)
        if got is None or got[0].size < planes or got[2].size < ctx:
            bufs = [np.empty(max(planes, 0 if got is None else got[0].size), np.uint8),
                    None, np.empty(max(ctx, 0 if got is None else got[2].size), np.uint8),
                    None, np.empty(256, np.int64), None]
            for k in (1, 3, 5):
                bufs[k] = kernels.read_only(bufs[k - 1].view())
            got = self._local.bufs = tuple(bufs)
        return got


_SCRATCH = _Scratch()
_NO_CRCS = np.zeros(0, np.int64)


def decode(p: Plan, block: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
           seeds: np.ndarray | None, crcs: np.ndarray | None, m: int, out: np.ndarray,
           lo: int, hi: int, given: dict[int, np.ndarray] | None = None
           ) -> tuple[int, int, int]:
    """Symbols ``[lo, hi)`` of every field of a segment of ``m`` symbols per field, joined
    into ``out`` (uint8, the segment's bytes ``[lo * word, hi * word)``): the field payloads
    are ``block[starts[f] : starts[f] + lengths[f]]`` (``block`` read-only); with
    ``crcs``, each is first checked against its position CRC (seeded ``seeds[f]``), and a
    raw field against its own CRC, where ``lo == 0``. ``given``: the ``m`` symbols of each
    field of ``p.given``, decoded by the caller. Returns (``Status`` or
    ``UNALIGNED``, field, chunk), (OK, -1, -1) when the part is decoded and checked."""
    n = hi - lo
    pw, pr, cw, cr, mw, mr = _SCRATCH.get(p.word * n, n)
    for f, sym in (given or {}).items():
        pw[f * n : (f + 1) * n] = sym[lo:hi]
    return _drive(block, starts, lengths, p.codecs, p.context,
                  _NO_CRCS if crcs is None else seeds, _NO_CRCS if crcs is None else crcs,
                  m, lo, hi, pw, pr, cw, cr, mw, mr, p.sign_move, out, crc32._TABLE)


@njit(nogil=True, cache=True)
def _u(buf, at, size):
    # The little-endian unsigned integer of ``size`` bytes at ``buf[at]`` (in bounds).
    v = np.uint64(0)
    for k in range(size):
        v |= np.uint64(buf[at + k]) << np.uint64(8 * k)
    return v


@njit(nogil=True, cache=True)
def _drive(block, starts, lengths, codecs, ctx_of, seeds, crcs, m, lo, hi, pw, pr, cw, cr,
           mw, mr, sign_move, out, table):
    nf = starts.size
    n = hi - lo
    planes = pw[: nf * n].reshape((nf, n))
    planes_r = pr[: nf * n].reshape((nf, n))
    # A raw field's own CRC (of its symbols, after its 4-byte CRC) is computed once, where
    # lo == 0: its position CRC is had from it by combining, not by reading it again.
    own = np.full(nf, -1, np.int64)
    if lo == 0:
        for f in range(nf):
            part = block[starts[f] : starts[f] + lengths[f]]
            if codecs[f] == RAW and part.size >= 4:
                own[f] = crc32._crc(part[4:], np.int64(0), table)
                if crcs.size:
                    head = crc32._crc(part[:4], seeds[f], table)
                    if np.int64(crc32._combine(head, own[f], part.size - 4,
                                               crc32._X2N_ARRAY)) != crcs[f]:
                        return _PLACE, f, -1
            elif crcs.size and np.int64(crc32._crc(part, seeds[f], table)) != crcs[f]:
                return _PLACE, f, -1
    for f in range(nf):
        part = block[starts[f] : starts[f] + lengths[f]]
        c = codecs[f]
        chunk = -1
        if c == RAW:
            status = _raw(part, m, lo, hi, planes[f], own[f], not _direct(codecs, ctx_of, f))
        elif c == RANS or c == TANS:  # (a tANS field takes no context: plan's fields)
            status, chunk = _frame(part, m, lo, hi, planes[f], planes_r[f],
                                   planes_r[max(ctx_of[f], 0)], ctx_of[f] >= 0, False, 0, 0,
                                   np.zeros(0, np.int64), np.zeros((0, 0), np.uint8),
                                   np.zeros(0, np.uint8), cw, cr, mw, mr, table, c == TANS)
        elif c == RANS2D:
            status, chunk = _classed(part, m, lo, hi, planes[f], planes_r[f], cw, cr, mw, mr,
                                     table)
        else:  # GIVEN: already in its plane
            status = OK
        if status != OK:
            return status, f, chunk
    if nf == 2:
        hi_plane, lo_plane = planes_r[0], planes_r[1]
        if _direct(codecs, ctx_of, 0):
            hi_plane = block[starts[0] + 4 + lo : starts[0] + 4 + hi]
        if _direct(codecs, ctx_of, 1):
            lo_plane = block[starts[1] + 4 + lo : starts[1] + 4 + hi]
        _planes.join_planes((hi_plane, lo_plane), sign_move, out[: n * nf].view(np.int16))
    else:
        _join(planes_r, sign_move, out[: n * nf])
    return OK, -1, -1


@njit(nogil=True, cache=True)
def _direct(codecs, ctx_of, f):
    # Whether raw field f of a two-field segment is joined straight from its payload: no
    # copy into its plane, which only a field conditioned on it would read.
    return codecs.size == 2 and codecs[f] == RAW and ctx_of[1 - f] != f


@njit(nogil=True, cache=True)
def _raw(part, m, lo, hi, dst, own, copy):
    # u32 CRC-32 of the symbols, then (``copy``) the symbols (checked whole by the first
    # part, whose ``own`` is their CRC-32).
    if part.size != m + 4:
        return _HEADER
    if lo == 0 and own != np.int64(_u(part, 0, 4)):
        return ERR_CRC
    if copy:
        dst[:] = part[4 + lo : 4 + hi]
    return OK


@njit(nogil=True, cache=True)
def _join(planes_r, sign_move, out):
    # formats.join of the planes (one per field, most significant first).
    # (two fields: in _drive, from a raw field's payload where it can)
    w = planes_r.shape[0]
    if w == 1:
        out[:] = planes_r[0]
    elif w == 4:
        _planes.join_planes((planes_r[0], planes_r[1], planes_r[2], planes_r[3]), sign_move,
                            out.view(np.int32))
    else:
        _planes.join_planes((planes_r[0], planes_r[1], planes_r[2], planes_r[3],
                             planes_r[4], planes_r[5], planes_r[6], planes_r[7]),
                            sign_move, out.view(np.int64))


@njit(nogil=True, cache=True)
def _classed(part, m, lo, hi, dst, dst_r, cw, cr, mw, mr, table):
    # A "rans2d" payload (container/classed.py): header, class maps, then its frame
    # decoded with each symbol's table index made from the maps.
    size = part.size
    if size < 32:
        return _HEADER, -1
    for k in range(4):
        if part[k] != _2D_MAGIC[k]:
            return _HEADER, -1
    kr, kc = np.int64(part[5]), np.int64(part[6])
    if (part[4] != 1 or part[7] != 0 or _u(part, 8, 8) != np.uint64(m)
            or not (1 <= kr <= lines.MAX_CLASSES and 1 <= kc <= lines.MAX_CLASSES)
            or kr * kc < 2):
        return _HEADER, -1
    cols_u, phase_u = _u(part, 16, 8), _u(part, 24, 8)
    # Stricter than the format's 2**62 (the layered path reads those): below 2**61, row
    # counts and map sizes stay far inside int64.
    if not phase_u < cols_u < np.uint64(1) << np.uint64(61):
        return _HEADER, -1
    cols, phase = np.int64(cols_u), np.int64(phase_u)
    wr, wc = _width(kr), _width(kc)
    if wc and cols > 8 * size:  # its map cannot fit (and cols * wc cannot wrap)
        return _MODEL, -1
    rows = (phase + m + cols - 1) // cols
    row_bytes, col_bytes = (rows * wr + 7) // 8, (cols * wc + 7) // 8
    body = 32 + row_bytes + col_bytes
    if body > size:
        return _MODEL, -1
    rcls = np.zeros(max(1, rows), np.int64)
    if kr > 1 and not _unpack(part, 32, rows, wr, kr, rcls):
        return _MODEL, -1
    ccls = np.zeros(cols if kc > 1 else 0, np.int64)
    if kc > 1 and not _unpack(part, 32 + row_bytes, cols, wc, kc, ccls):
        return _MODEL, -1
    # lines._context_args: contexts along a row per row class where that stays small,
    # else through each column's class.
    kr_used = rcls.max() + 1
    wide = kc > 1 and kr_used * cols > 16 * m + (1 << 20)
    along = kc if wide else (cols if kc > 1 else 1)
    pattern = np.empty((kr_used, along), np.uint8)
    for r in range(kr_used):
        for j in range(along):
            pattern[r, j] = r * kc + (j if wide else (ccls[j] if kc > 1 else 0))
    indirect = np.empty(cols if wide else 0, np.uint8)
    for j in range(indirect.size):
        indirect[j] = ccls[j]
    return _frame(part[body:], m, lo, hi, dst, dst_r, dst_r, False, True, cols, phase, rcls,
                  pattern, indirect, cw, cr, mw, mr, table, False)


@njit(nogil=True, cache=True)
def _width(k):
    w = 0
    while (k - 1) >> w:
        w += 1
    return w


@njit(nogil=True, cache=True)
def _unpack(buf, at, count, w, k, out):
    # lines.unpack: classes of ``w`` bits, least significant first; False where one is
    # >= k or a padding bit is set.
    nbits = count * w
    for i in range(count):
        v = 0
        for b in range(w):
            bit = i * w + b
            v |= ((np.int64(buf[at + (bit >> 3)]) >> (bit & 7)) & 1) << b
        if v >= k:
            return False
        out[i] = v
    end = (nbits + 7) // 8
    for bit in range(nbits, 8 * end):
        if (buf[at + (bit >> 3)] >> (bit & 7)) & 1:
            return False
    return True


@njit(nogil=True, cache=True)
def _frame(fb, m, lo, hi, dst, dst_r, ctx_r, has_ctx, mapped, cols, phase, rcls, pattern,
           indirect, cw, cr, mw, mr, table, tans):
    # coding.frame.parse and decode of an rANS frame (a tANS frame with ``tans``) of ``m``
    # symbols, symbols [lo, hi) into dst. Context (rANS): ``has_ctx`` (another field's
    # symbols ctx_r, mapped through the frame's map), or ``mapped`` (a rans2d field: table
    # indices made from its classes).
    size = fb.size
    if size < frame.HEADER_SIZE:
        return _HEADER, -1
    for k in range(4):
        if fb[k] != (_TANS_MAGIC[k] if tans else _FRAME_MAGIC[k]):
            return _HEADER, -1
    param, flag = np.int64(fb[5]), np.int64(fb[7])
    cs, n_chunks, model = np.int64(_u(fb, 16, 4)), np.int64(_u(fb, 20, 4)), np.int64(_u(fb, 24, 4))
    lanes = tans_kernels.LANES if tans else LANES
    if (fb[4] != frame.VERSION or _u(fb, 8, 8) != np.uint64(m)
            or not (_TANS_LOGS[0] <= param <= _TANS_LOGS[1] if tans else 8 <= param <= 15)
            or fb[6] != lanes or not frame.MIN_CHUNK <= cs <= frame.MAX_CHUNK or cs % lanes
            or n_chunks != (m + cs - 1) // cs or flag > 1
            or (flag and (tans or not (has_ctx or mapped)))):
        return _HEADER, -1
    if lo % cs or (hi % cs and hi != m):
        return UNALIGNED, -1
    off = frame.HEADER_SIZE
    end = off + model
    if end > size:
        return _MODEL, -1
    # table_section.parse
    n_tables = 1
    if flag:
        if off + 257 > end:
            return _MODEL, -1
        n_tables = np.int64(fb[off]) + 1
        for v in range(256):
            mw[v] = fb[off + 1 + v]
            if mw[v] >= n_tables:
                return _MODEL, -1
        off += 257
    freqs = np.empty((n_tables, 256), np.int64)
    code, t_end, _, _ = tables._parse_rows(fb, off, end, param, freqs)
    if code != 0 or t_end != end:
        return _MODEL, -1
    tab = np.empty((0 if tans else n_tables, np.int64(1) << param), np.uint64)
    dtab = np.empty(np.int64(1) << param if tans else 0, np.uint32)
    if tans:
        tans_table._decode_table(freqs[0], param, dtab)
    else:
        kernels._decode_table(freqs, tab)
    # frame.read_directory
    if end + 9 * n_chunks > size:
        return _DIRECTORY, -1
    offsets = np.empty(n_chunks, np.int64)
    lengths = np.empty(n_chunks, np.int64)
    stop, bad = frame._directory(fb, end, lengths, offsets)
    if stop != size or bad >= 0:
        return _DIRECTORY, -1
    crcs = np.empty(n_chunks, np.uint32)
    for i in range(n_chunks):
        crcs[i] = np.uint32(_u(fb, end + 4 * n_chunks + 4 * i, 4))
    if mapped and flag:
        for r in range(pattern.shape[0]):  # classes to table indices, as classed.decode
            for j in range(pattern.shape[1]):
                pattern[r, j] = mw[pattern[r, j]]
    # frame.decode_payloads: groups of chunks, raw ones copied, then the group's CRCs
    g = frame.DECODE_GROUP
    codes = np.zeros(g, np.int64)
    starts = np.empty(g, np.int64)
    sizes = np.empty(g, np.int64)
    los = np.empty(g, np.int64)
    his = np.empty(g, np.int64)
    errors = np.empty(g, np.int64)
    which = np.empty(g, np.int64)
    for first in range(lo // cs, (hi + cs - 1) // cs, g):
        last = min((hi + cs - 1) // cs, first + g)
        a, b = first * cs, min(m, last * cs)  # symbols of the group
        k = 0
        for i in range(first, last):
            codes[i - first] = OK
            c0, c1 = i * cs, min(m, (i + 1) * cs)
            if fb[end + 8 * n_chunks + i] == frame.MODE_RAW:
                if lengths[i] != c1 - c0:
                    codes[i - first] = ERR_RAW
                else:
                    dst[c0 - lo : c1 - lo] = fb[offsets[i] : offsets[i] + lengths[i]]
                continue
            starts[k], sizes[k], los[k], his[k], which[k] = (offsets[i], lengths[i], c0 - a,
                                                            c1 - a, i - first)
            k += 1
        out, rel = dst[a - lo : b - lo], slice(a - lo, b - lo)
        if k and tans:
            tans_kernels.decode_chunks(fb, starts[:k], sizes[:k], dtab, param, out, los[:k],
                                       his[:k], errors[:k])
        elif k and flag and has_ctx:
            kernels.decode_chunks(fb, starts[:k], sizes[:k], tab, param, out, ctx_r[rel], mr,
                                  los[:k], his[:k], errors[:k])
        elif k and flag:  # mapped: each symbol's table index from its classes
            lines._context(a, b, cols, phase, rcls, pattern, indirect, cw[rel])
            kernels.decode_chunks(fb, starts[:k], sizes[:k], tab, param, out, cr[rel], None,
                                  los[:k], his[:k], errors[:k])
        elif k:
            kernels.decode_chunks(fb, starts[:k], sizes[:k], tab, param, out, None, None,
                                  los[:k], his[:k], errors[:k])
        for j in range(k):
            codes[which[j]] = errors[j]
        bad = crc32._check_chunks(dst_r[a - lo : b - lo], cs, crcs[first:last],
                                  codes[: last - first], np.int64(ERR_CRC), table)
        if bad >= 0:
            return codes[bad], first + bad
    return OK, -1
