"""Chunks decoded together (``decode_chunks`` of both coders, ``frame.DECODE_GROUP``): the
same symbols as one chunk at a time, errors on the right chunk, bounds refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entropykit import CorruptDataError
from entropykit.coding import frame, tables
from entropykit.rans import kernels
from entropykit.rans import static as rans_static
from entropykit.tans import static as tans_static

CHUNK = 1 << 10
CODERS = [rans_static.CODER, tans_static.CODER]


def _symbols(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)


def _parts(coder, sym, ctx=None):
    buf = np.frombuffer(frame.encode(coder, sym, 12, CHUNK, threads=1, context=ctx), np.uint8)
    info = frame.parse(coder, buf)
    tabs = coder.decode_tables(info.freqs if coder.supports_context else info.freqs[0], 12)
    return buf, info, tabs, (None if info.cmap is None else ctx)


def _decode_group(coder, buf, info, tabs, ctx, chunks, n):
    idx = np.array(chunks, np.int64)
    lo = idx * CHUNK
    hi = np.minimum(lo + CHUNK, n)
    out = np.zeros(n, np.uint8)
    errs = coder.decode_chunks(buf, info.offsets[idx], info.lengths[idx], tabs, 12, out,
                               ctx, info.cmap, lo, hi)
    return out, errs


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
@pytest.mark.parametrize("n", [CHUNK * 5, CHUNK * 5 - 1, CHUNK * 4 + 3, CHUNK * 4 + 40])
@pytest.mark.parametrize("group", [[0, 1], [0, 1, 2], [0, 1, 2, 3, 4], [4, 0, 2], [3]])
def test_group_gives_the_symbols_of_each_chunk(coder, n, group):
    sym = _symbols(n, n)
    buf, info, tabs, ctx = _parts(coder, sym)
    group = [i for i in group if info.modes[i] == frame.MODE_CODED]  # a short tail is raw
    assert group
    out, errs = _decode_group(coder, buf, info, tabs, ctx, group, n)
    assert errs == [None] * len(group)
    for i in group:
        assert np.array_equal(out[i * CHUNK : (i + 1) * CHUNK], sym[i * CHUNK : (i + 1) * CHUNK])
    untouched = np.ones(n, bool)
    for i in group:
        untouched[i * CHUNK : (i + 1) * CHUNK] = False
    assert not out[untouched].any()  # nothing written outside the group's chunks


def test_rans_group_with_context_tables():
    n = CHUNK * 4 + 700
    rng = np.random.default_rng(5)
    ctx = rng.integers(0, 3, n).astype(np.uint8)
    sym = (_symbols(n, 1) + 40 * ctx).astype(np.uint8)
    coder = rans_static.CODER
    buf, info, tabs, ctx = _parts(coder, sym, ctx)
    assert info.cmap is not None and not info.modes.any()  # all five chunks coded
    out, errs = _decode_group(coder, buf, info, tabs, ctx, [0, 1, 2, 3, 4], n)
    assert errs == [None] * 5 and np.array_equal(out, sym)


def test_rans_group_with_every_context_byte():
    # Context values over all 256 bytes, each mapped to one of 5 tables (both halves of
    # the map used): the step's context-map lookup (a byte table where the CPU has byte
    # permutes, a gather elsewhere) at every index.
    n = CHUNK * 4
    rng = np.random.default_rng(6)
    ctx = rng.integers(0, 256, n).astype(np.uint8)
    cmap = rng.integers(0, 5, 256).astype(np.int64)
    k = cmap[ctx]
    sym = (_symbols(n, 3) + 50 * k).astype(np.uint8)
    freqs = np.stack([tables.quantize(np.bincount(sym[k == t], minlength=256) + 1, 12)
                      for t in range(5)])
    enc = kernels.encode_tables(freqs, 12)
    parts = []
    for c in range(4):
        out = np.empty(2 * CHUNK + 256, np.uint8)
        part = slice(c * CHUNK, (c + 1) * CHUNK)
        start = kernels.encode_chunk(sym[part], enc, 12, out, ctx[part], cmap)
        assert start >= 0
        parts.append(out[start:])
    lengths = np.array([p.size for p in parts], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    got = np.zeros(n, np.uint8)
    errors = np.empty(4, np.int64)
    lo = np.arange(4, dtype=np.int64) * CHUNK
    kernels.decode_chunks(np.concatenate(parts), starts, lengths,
                          kernels.decode_table(freqs, 12), 12, got, kernels.read_only(ctx),
                          kernels.read_only(cmap), lo, lo + CHUNK, errors)
    assert not errors.any() and np.array_equal(got, sym)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_corrupt_chunk_is_reported_alone(coder):
    n = CHUNK * 4
    sym = _symbols(n, 2)
    buf, info, tabs, ctx = _parts(coder, sym)
    bad = buf.copy()
    at = int(info.offsets[2]) + int(info.lengths[2]) // 2
    bad[at] ^= 0xFF
    out, errs = _decode_group(coder, bad, info, tabs, ctx, [0, 1, 2, 3], n)
    assert errs[0] is None and errs[1] is None and errs[3] is None
    if errs[2] is None:  # decoded without a structural error: the frame's CRC must catch it
        assert not np.array_equal(out[2 * CHUNK : 3 * CHUNK], sym[2 * CHUNK : 3 * CHUNK])
    for i in (0, 1, 3):
        assert np.array_equal(out[i * CHUNK : (i + 1) * CHUNK], sym[i * CHUNK : (i + 1) * CHUNK])


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_chunks_outside_the_output_are_refused(coder):
    n = CHUNK * 2
    buf, info, tabs, ctx = _parts(coder, _symbols(n, 3))
    starts, lengths = info.offsets[:2], info.lengths[:2]
    out = np.zeros(n, np.uint8)
    for lo, hi in (([0, CHUNK], [CHUNK, n + 1]), ([-1, CHUNK], [CHUNK, n]),
                   ([0, CHUNK + 1], [CHUNK, CHUNK])):
        errs = coder.decode_chunks(buf, starts, lengths, tabs, 12, out, ctx, None,
                                   np.array(lo, np.int64), np.array(hi, np.int64))
        assert "outside the output" in " ".join(e for e in errs if e)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_payload_outside_the_buffer_is_refused(coder):
    n = CHUNK * 2
    buf, info, tabs, ctx = _parts(coder, _symbols(n, 4))
    starts = info.offsets[:2].copy()
    starts[1] = buf.size - 3  # its payload would run past the end of buf
    errs = coder.decode_chunks(buf, starts, info.lengths[:2], tabs, 12, np.zeros(n, np.uint8),
                               ctx, None, np.array([0, CHUNK]), np.array([CHUNK, n]))
    assert errs[0] is None and errs[1] is not None


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
@pytest.mark.parametrize("bad_chunk", [0, 3, 4, 5, 9])
def test_frame_names_the_failing_chunk_across_groups(coder, bad_chunk):
    n = CHUNK * 10 - 5
    sym = _symbols(n, 6)
    sym[CHUNK * 7 : CHUNK * 8] = np.arange(CHUNK) % 256  # a raw chunk inside a group
    buf = np.frombuffer(frame.encode(coder, sym, 12, CHUNK, threads=1), np.uint8).copy()
    info = frame.parse(coder, buf)
    assert info.modes[7] == frame.MODE_RAW
    for threads in (1, 2):
        assert np.array_equal(frame.decode(coder, buf, threads=threads), sym)
    directory = int(info.offsets[0]) - 9 * 10  # 10 chunks: lengths, CRCs, modes
    crcs = buf[directory + 4 * 10 : directory + 8 * 10].view("<u4")
    crcs[bad_chunk] ^= 1
    with pytest.raises(CorruptDataError, match=f"chunk {bad_chunk} .*CRC-32"):
        frame.decode(coder, buf, threads=1)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6 * CHUNK), st.integers(0, 2**32 - 1),
       st.sampled_from(CODERS), st.integers(1, 2))
def test_frame_round_trip_property(n, seed, coder, threads):
    sym = _symbols(n, seed)
    blob = frame.encode(coder, sym, 12, CHUNK, threads=1)
    assert np.array_equal(frame.decode(coder, blob, threads=threads), sym)


def test_rans_context_map_outside_the_tables_is_refused():
    n = CHUNK * 2
    rng = np.random.default_rng(8)
    ctx = rng.integers(0, 3, n).astype(np.uint8)
    sym = (_symbols(n, 9) + 40 * ctx).astype(np.uint8)
    coder = rans_static.CODER
    buf, info, tabs, ctx_used = _parts(coder, sym, ctx)
    n_tables = tabs.shape[0]
    lo, hi = np.array([0, CHUNK]), np.array([CHUNK, n])
    for cmap, short in ((np.full(256, n_tables, np.uint8), ctx_used),
                        (info.cmap[:255], ctx_used), (info.cmap, ctx_used[:-1])):
        out = np.zeros(n, np.uint8)
        errs = coder.decode_chunks(buf, info.offsets[:2], info.lengths[:2], tabs, 12, out,
                                   short, cmap, lo, hi)
        assert errs == ["context does not match the chunk's symbols or the frame's tables"] * 2
        assert not out.any()


def test_rans_chunk_coded_with_a_context_map_round_trips_and_refuses_bad_maps():
    n = CHUNK
    rng = np.random.default_rng(10)
    ctx = rng.integers(0, 4, n).astype(np.uint8)
    sym = (_symbols(n, 11) + 30 * ctx).astype(np.uint8)
    coder = rans_static.CODER
    cmap = np.zeros(256, np.uint8)
    cmap[:4] = [0, 1, 1, 0]  # two tables shared by four context values
    freqs = np.stack([np.bincount(sym[np.isin(ctx, vals)], minlength=256)
                      for vals in ([0, 3], [1, 2])])
    freqs = np.stack([tables.quantize(f, 12) for f in freqs])
    payload = coder.encode_chunk(sym, coder.encode_tables(freqs, 12), 12, ctx, cmap)
    assert payload is not None and payload.size < n
    buf = payload.copy()
    out = np.zeros(n, np.uint8)
    tabs = coder.decode_tables(freqs, 12)
    assert coder.decode_chunk(buf, 0, buf.size, tabs, 12, out, ctx, cmap) is None
    assert np.array_equal(out, sym)
    too_far = cmap.copy()
    too_far[7] = 2  # names a third table: refused, nothing coded or decoded with it
    assert coder.encode_chunk(sym, coder.encode_tables(freqs, 12), 12, ctx, too_far) is None
    assert coder.decode_chunk(buf, 0, buf.size, tabs, 12, out, ctx, too_far) is not None
    with pytest.raises(ValueError, match="context map"):
        coder.encode_chunk(sym, coder.encode_tables(freqs, 12), 12, ctx)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_table_of_another_precision_is_refused(coder):
    n = CHUNK * 2
    buf, info, tabs, _ = _parts(coder, _symbols(n, 12))
    small = coder.decode_tables(tables.quantize(np.ones(256, np.int64), 10)[None, :]
                                if coder.supports_context
                                else tables.quantize(np.ones(256, np.int64), 10), 10)
    out = np.zeros(n, np.uint8)
    errs = coder.decode_chunks(buf, info.offsets[:2], info.lengths[:2], small, 12, out, None,
                               None, np.array([0, CHUNK]), np.array([CHUNK, n]))
    assert all(e is not None and "slots" in e for e in errs) and not out.any()
