"""Many rANS frames of the GPU plan parsed in one pass: headers, tables, directories.

What it is: ``parse``, the checks of ``coding.frame.parse`` (and of the symbol count
the field expects) over every frame of a run of segments at once, in two nogil Numba
calls over their first bytes, and the ``FrameInfo`` of each frame that passes, its
arrays slices of a few run-wide arrays. A frame that fails any check is only reported
as failing (``None``): the caller plans it the per-frame way, whose checks raise the
error they always raised, so this pass decides nothing about damaged bytes.
What it is not: the decoder, the per-frame parse (``coding.frame``) or the CRC checks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from ...coding import frame as _frame
from ...coding import tables as _tables
from ...rans.lanes import LANES

_MAGIC = np.frombuffer(b"EKRA", np.uint8)
_HEADER, _VERSION, _RAW = _frame.HEADER_SIZE, _frame.VERSION, _frame.MODE_RAW
_CONTEXT_MAP = 257  # a context frame's model section first: n_tables - 1, a class a value
# Columns of a frame's row: outcome (0 parsed), param, flag, n, chunk size, chunks, model
# section bytes, tables, first table row, first chunk row.
_OK_, _PARAM, _FLAG, _N, _CHUNK, _COUNT, _MODEL, _TABLES, _T0, _C0 = range(10)
_W = 10


@njit(nogil=True, cache=True)
def _u32(buf, at):
    return (np.int64(buf[at]) | np.int64(buf[at + 1]) << 8 | np.int64(buf[at + 2]) << 16
            | np.int64(buf[at + 3]) << 24)


@njit(nogil=True, cache=True)
def _heads(buf, starts, held, sizes, want, contexts, magic, lanes, min_chunk, max_chunk,
           meta):
    """Header checks of each frame ``buf[starts[i]:][:sizes[i]]`` (``held[i]`` of its bytes
    in ``buf``): the row of ``meta``, outcome 1 where any check fails or the header,
    tables and directory are not all held (the caller's per-frame path decides)."""
    for i in range(starts.size):
        m = meta[i]
        m[_OK_] = 1
        at, size, h = starts[i], sizes[i], held[i]
        if size < _HEADER or h < _HEADER:
            continue
        if (buf[at] != magic[0] or buf[at + 1] != magic[1] or buf[at + 2] != magic[2]
                or buf[at + 3] != magic[3] or buf[at + 4] != _VERSION):
            continue
        param, lane, flag = np.int64(buf[at + 5]), np.int64(buf[at + 6]), np.int64(buf[at + 7])
        n = _u32(buf, at + 8) | _u32(buf, at + 12) << 32  # a u64 above 2**63 is negative
        chunk, count, model = _u32(buf, at + 16), _u32(buf, at + 20), _u32(buf, at + 24)
        if n != want[i] or n <= 0 or not 8 <= param <= 15 or lane != lanes:
            continue  # an empty frame's special form is left to the per-frame path
        if not min_chunk <= chunk <= max_chunk or chunk % lanes or count != -(-n // chunk):
            continue
        if flag > 1 or (flag == 1 and not contexts[i]):
            continue
        end = _HEADER + model  # the model section ends, the directory starts
        if end + 9 * count > size or end + 9 * count > h:
            continue
        tabs = 1
        if flag == 1:
            if model < _CONTEXT_MAP:
                continue
            tabs = np.int64(buf[at + _HEADER]) + 1
            top = 0
            for v in range(1, _CONTEXT_MAP):
                top = max(top, np.int64(buf[at + _HEADER + v]))
            if top >= tabs:
                continue
        m[_OK_], m[_PARAM], m[_FLAG], m[_N] = 0, param, flag, n
        m[_CHUNK], m[_COUNT], m[_MODEL], m[_TABLES] = chunk, count, model, tabs


@njit(nogil=True, cache=True)
def _bodies(buf, starts, sizes, meta, freqs, lengths, offsets):
    """Tables and directories of the frames ``_heads`` passed, into their rows of
    ``freqs``, ``lengths`` and ``offsets`` (payload starts in the frame); a frame whose
    tables or directory fail gets outcome 1."""
    for i in range(starts.size):
        m = meta[i]
        if m[_OK_]:
            continue
        at, param, model = starts[i], m[_PARAM], m[_MODEL]
        t = at + _HEADER + (_CONTEXT_MAP if m[_FLAG] else 0)
        end = at + _HEADER + model
        ok = True
        for r in range(m[_T0], m[_T0] + m[_TABLES]):
            code, t, _, _ = _tables._parse(buf, t, end, param, freqs[r])
            if code != _tables._OK:
                ok = False
                break
        if not ok or t != end:
            m[_OK_] = 1
            continue
        count, c0 = m[_COUNT], m[_C0]
        pos = _HEADER + model + 9 * count
        for k in range(count):
            length = _u32(buf, end + 4 * k)
            lengths[c0 + k] = length
            offsets[c0 + k] = pos
            pos += length
            if buf[end + 8 * count + k] > _RAW:
                ok = False
        if not ok or pos != sizes[i]:
            m[_OK_] = 1


# Bytes of each frame copied for the parse: header, tables and directory of the frames
# entropykit writes without contexts; a frame whose directory ends later is parsed alone.
HEAD_BYTES = 4 << 10


def parse(frames: Sequence[tuple[np.ndarray, int, int, bool]]
          ) -> list[_frame.FrameInfo | None]:
    """The ``FrameInfo`` of each frame (its first bytes held, at least its first
    ``HEAD_BYTES`` or all of it; the frame's size; the symbols its field expects;
    whether the field has a context), as ``frame.parse`` makes it; None where the
    frame is not one of ``n >= 1`` symbols passing every check of ``frame.parse`` and
    holding that count (and, for a field without a context, one table), or its
    directory ends past its first ``HEAD_BYTES``. The frames' first bytes are copied
    into one buffer and parsed in two calls."""
    if not frames:
        return []
    heads = [data[:HEAD_BYTES] for data, _, _, _ in frames]
    held = np.fromiter((h.size for h in heads), np.int64, len(heads))
    starts = np.cumsum(held) - held
    buf = np.concatenate(heads)
    buf.flags.writeable = False  # one compile: the kernels take read-only bytes
    sizes = np.fromiter((f[1] for f in frames), np.int64, len(frames))
    want = np.fromiter((f[2] for f in frames), np.int64, len(frames))
    ctx = np.fromiter((f[3] for f in frames), np.bool_, len(frames))
    meta = np.zeros((len(frames), _W), np.int64)
    _heads(buf, starts, held, sizes, want, ctx, _MAGIC, LANES, _frame.MIN_CHUNK,
           _frame.MAX_CHUNK, meta)
    live = meta[:, _OK_] == 0
    tabs = np.where(live, meta[:, _TABLES], 0)
    counts = np.where(live, meta[:, _COUNT], 0)
    meta[:, _T0] = np.cumsum(tabs) - tabs
    meta[:, _C0] = np.cumsum(counts) - counts
    freqs = np.empty((int(tabs.sum()), 256), np.int64)
    lengths = np.empty(int(counts.sum()), np.int64)
    offsets = np.empty_like(lengths)
    _bodies(buf, starts, sizes, meta, freqs, lengths, offsets)
    out: list[_frame.FrameInfo | None] = [None] * len(frames)
    for k, row in enumerate(meta.tolist()):
        if row[_OK_]:
            continue
        data = frames[k][0]
        count, t0, c0 = row[_COUNT], row[_T0], row[_C0]
        d = _HEADER + row[_MODEL]  # the directory
        out[k] = _frame.FrameInfo(
            row[_PARAM], row[_N], row[_CHUNK], freqs[t0 : t0 + row[_TABLES]],
            data[_HEADER + 1 : _HEADER + _CONTEXT_MAP] if row[_FLAG] else None,
            lengths[c0 : c0 + count],
            data[d + 4 * count : d + 8 * count].view("<u4"), data[d + 8 * count : d + 9 * count],
            offsets[c0 : c0 + count], frames[k][1])
    return out
