"""tANS-specific tests: state tables against FSE's construction, the documented payload
layout against a big-integer reference, corruptions aimed at the tANS payload, determinism.

The generic coder suite (round trips, fuzz, entropy bound over every coder) lives in
tests/test_coders.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import entropykit.tans as tans
from entropykit import CorruptDataError
from entropykit.coding import frame, tables
from entropykit.tans import kernels, static, table

LOGS = [9, 10, 11, 12]


def _freqs(rng: np.random.Generator, table_log: int, n_symbols: int) -> np.ndarray:
    counts = np.zeros(256, np.int64)
    present = rng.choice(256, n_symbols, replace=False)
    counts[present] = rng.geometric(0.05, n_symbols)
    return tables.quantize(counts, table_log)


def _table_cases() -> list[tuple[int, np.ndarray]]:
    rng = np.random.default_rng(7)
    cases = []
    for log in LOGS:
        for k in (1, 2, 3, 40, 256):
            cases.append((log, _freqs(rng, log, k)))
    one = np.ones(256, np.int64)  # all 256 symbols, all but one at frequency 1
    one[0] += (1 << 9) - 256
    cases.append((9, one))
    return cases


TABLE_CASES = _table_cases()


def _fse_reference(freqs: np.ndarray, log: int):
    """FSE's FSE_buildCTable / FSE_buildDTable, transcribed loop by loop."""
    size = 1 << log
    step = (size >> 1) + (size >> 3) + 3
    symbol = [0] * size
    pos = 0
    for s in range(256):
        for _ in range(int(freqs[s])):
            symbol[pos] = s
            pos = (pos + step) & (size - 1)
    assert pos == 0
    cumul = [0] * 257
    for s in range(256):
        cumul[s + 1] = cumul[s] + int(freqs[s])
    state_table = [0] * size
    nxt = cumul[:256]
    for u in range(size):
        state_table[nxt[symbol[u]]] = size + u
        nxt[symbol[u]] += 1
    dnb, dfs = {}, {}
    for s in range(256):
        f = int(freqs[s])
        if f == 1:
            dnb[s], dfs[s] = (log << 16) - size, cumul[s] - 1
        elif f > 1:
            max_bits = log - ((f - 1).bit_length() - 1)
            dnb[s], dfs[s] = (max_bits << 16) - (f << max_bits), cumul[s] - f
    symbol_next = [int(f) for f in freqs]
    dtable = []
    for u in range(size):
        s = symbol[u]
        y = symbol_next[s]
        symbol_next[s] += 1
        nb = log - (y.bit_length() - 1)
        dtable.append((s, nb, (y << nb) - size))
    return symbol, state_table, dnb, dfs, dtable


@pytest.mark.parametrize(("log", "freqs"), TABLE_CASES)
def test_tables_match_fse_construction(log: int, freqs: np.ndarray) -> None:
    symbol, state_table, dnb, dfs, dtable = _fse_reference(freqs, log)
    sp = table.spread(freqs, log)
    assert sp.tolist() == symbol
    assert np.array_equal(np.bincount(sp, minlength=256), freqs)  # f_s slots each
    tt, st_ = table.encode_tables(freqs, log)
    assert st_.tolist() == state_table
    for s in dnb:
        assert int(tt[s]) >> 32 == dnb[s]
        assert int(np.int32(np.uint32(int(tt[s]) & 0xFFFFFFFF))) == dfs[s]
    e = table.decode_table(freqs, log).astype(np.int64)
    fields = (e & 0xFF).tolist(), ((e >> 8) & 0xFF).tolist(), (e >> 16).tolist()
    got = list(zip(*fields, strict=True))
    assert got == dtable


@pytest.mark.parametrize(("log", "freqs"), TABLE_CASES)
def test_decode_table_inverts_encode_table(log: int, freqs: np.ndarray) -> None:
    # For every present symbol s and every encoder state X: encoding s from X emits the
    # low nb bits of X and moves to size + u; decoding from u gives back s and X - size.
    size = 1 << log
    tt, st_ = table.encode_tables(freqs, log)
    e = table.decode_table(freqs, log).astype(np.int64)
    x = np.arange(size, 2 * size, dtype=np.int64)
    for s in np.flatnonzero(freqs):
        t = int(tt[s])
        nb = (x + (t >> 32)) >> 16
        y = x >> nb
        assert ((y >= freqs[s]) & (y < 2 * freqs[s])).all()
        new = st_[y + int(np.int32(np.uint32(t & 0xFFFFFFFF)))].astype(np.int64)
        assert ((new >= size) & (new < 2 * size)).all()
        d = e[new - size]
        assert ((d & 0xFF) == s).all()
        assert np.array_equal((d >> 8) & 0xFF, nb)
        assert np.array_equal((d >> 16) + (x & ((1 << nb) - 1)), x - size)
    assert ((e >> 8) & 0xFF).max() <= log  # 4 lanes x nb fit one 64-bit refill


def _reference_payload(sym: np.ndarray, freqs: np.ndarray, log: int) -> bytes:
    """The payload exactly as kernels.py's docstring describes it, as a Python integer."""
    _, state_table, dnb, dfs, _ = _fse_reference(freqs, log)
    size = 1 << log
    b, nbits = 0, 0
    x = [size] * kernels.LANES
    for i in range(sym.size - 1, -1, -1):  # encoder: reverse order, prepend
        s, lane = int(sym[i]), i % kernels.LANES
        nb = (x[lane] + dnb[s]) >> 16
        b = (b << nb) | (x[lane] & ((1 << nb) - 1))
        nbits += nb
        x[lane] = state_table[(x[lane] >> nb) + dfs[s]]
    for lane in reversed(range(kernels.LANES)):
        b = (b << log) | (x[lane] - size)
        nbits += log
    b, nbits = (b << 1) | 1, nbits + 1
    pad = -nbits % 8
    return (b << pad).to_bytes((nbits + pad) // 8, "little")


def _kernel_payload(sym: np.ndarray, freqs: np.ndarray, log: int) -> np.ndarray | None:
    tabs = static.CODER.encode_tables(freqs, log)
    return static.CODER.encode_chunk(sym, tabs, log)


@pytest.mark.parametrize("log", LOGS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 61, 500])
def test_payload_matches_documented_layout(log: int, n: int) -> None:
    rng = np.random.default_rng(n * 100 + log)
    sym = rng.choice(np.array([3, 7, 8, 200], np.uint8), n, p=[0.6, 0.25, 0.1, 0.05])
    freqs = tables.quantize(tables.histogram(sym), log)
    ref = _reference_payload(sym, freqs, log)
    got = _kernel_payload(sym, freqs, log)
    if len(ref) >= n:
        assert got is None  # not smaller than raw: the frame stores it raw
    else:
        assert bytes(got) == ref
        out = np.empty(n, np.uint8)
        buf = np.frombuffer(ref, np.uint8)
        tabs = static.CODER.decode_tables(freqs, log)
        assert static.CODER.decode_chunk(buf, 0, len(ref), tabs, log, out) is None
        assert np.array_equal(out, sym)


@pytest.mark.parametrize(("log", "expected"), [(9, b"\x08" + bytes(4)), (12, b"\x80" + bytes(6))])
def test_single_symbol_payload_is_marker_and_zero_states(log: int, expected: bytes) -> None:
    # f = 2**log: 0 bits per symbol, so the payload is padding, marker and four 0 states
    # (9: 3 pad bits + 1 + 36 = 40 bits; 12: 7 + 1 + 48 = 56 bits).
    sym = np.full(1000, 42, np.uint8)
    freqs = tables.quantize(tables.histogram(sym), log)
    assert bytes(_kernel_payload(sym, freqs, log)) == expected


def _decode_payload(payload: bytes, freqs: np.ndarray, log: int, n: int) -> str | None:
    out = np.empty(n, np.uint8)
    buf = np.frombuffer(payload, np.uint8)
    return static.CODER.decode_chunk(
        buf, 0, len(payload), static.CODER.decode_tables(freqs, log), log, out
    )


def _skewed_chunk(n: int = 4000, log: int = 11):
    rng = np.random.default_rng(3)
    sym = np.minimum(rng.geometric(0.3, n), 255).astype(np.uint8)
    freqs = tables.quantize(tables.histogram(sym), log)
    return sym, freqs, bytes(_kernel_payload(sym, freqs, log))


def test_corrupt_initial_state_is_caught_by_final_state_check() -> None:
    # One symbol: every state decodes to it with 0 bits and stays put, so a nonzero
    # initial state survives to the end and only the final-state check can see it.
    log = 9
    sym = np.full(1000, 5, np.uint8)
    freqs = tables.quantize(tables.histogram(sym), log)
    payload = bytearray(_kernel_payload(sym, freqs, log))
    assert _decode_payload(bytes(payload), freqs, log, sym.size) is None
    for bit in range(4, 4 + 4 * log):  # the state bits, after 3 pad bits and the marker
        bad = bytearray(payload)
        bad[bit // 8] ^= 1 << (bit % 8)
        assert _decode_payload(bytes(bad), freqs, log, sym.size) == kernels.MESSAGES[
            kernels.ERR_FINAL
        ]


def test_missing_marker() -> None:
    sym, freqs, payload = _skewed_chunk()
    bad = b"\x00" + payload[1:]
    assert _decode_payload(bad, freqs, 11, sym.size) == kernels.MESSAGES[kernels.ERR_MARKER]
    assert _decode_payload(b"", freqs, 11, sym.size) == kernels.MESSAGES[kernels.ERR_EMPTY]


def test_exhausted_bit_stream() -> None:
    sym, freqs, payload = _skewed_chunk()
    truncated = kernels.MESSAGES[kernels.ERR_TRUNCATED]
    # Fewer bytes than the header needs, then every shorter tail of a real payload.
    assert _decode_payload(payload[:3], freqs, 11, sym.size) == truncated
    for cut in range(1, 40):
        assert _decode_payload(payload[:-cut], freqs, 11, sym.size) == truncated
    # The whole payload, but asked for more symbols than it holds.
    assert _decode_payload(payload, freqs, 11, sym.size + 4 * 200) == truncated


def test_trailing_bits() -> None:
    sym, freqs, payload = _skewed_chunk()
    trailing = kernels.MESSAGES[kernels.ERR_TRAILING]
    for extra in (b"\x00", b"\xff", bytes(9)):
        assert _decode_payload(payload + extra, freqs, 11, sym.size) == trailing
    # Asked for fewer symbols than it holds (a whole step fewer).
    assert _decode_payload(payload, freqs, 11, sym.size - 4) == trailing


def test_frame_reports_kernel_errors_as_corrupt_data() -> None:
    sym = np.full(5000, 9, np.uint8)
    blob = bytearray(tans.encode(sym, precision=9))
    info = frame.parse(static.CODER, bytes(blob))
    assert info.modes.tolist() == [frame.MODE_CODED]
    blob[int(info.offsets[0])] = 0
    with pytest.raises(CorruptDataError, match="chunk 0.*no start marker"):
        tans.decode(bytes(blob))
    blob[int(info.offsets[0])] = 0x08
    blob[int(info.offsets[0]) + 2] = 1  # lane 1's initial state
    with pytest.raises(CorruptDataError, match="did not end at 0"):
        tans.decode(bytes(blob))


def test_incompressible_chunk_is_stored_raw() -> None:
    sym = np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8)
    freqs = tables.quantize(tables.histogram(sym), 9)
    assert _kernel_payload(sym, freqs, 9) is None
    blob = tans.encode(sym, precision=9, chunk_size=4096)
    assert frame.parse(static.CODER, blob).modes.tolist() == [frame.MODE_RAW] * 2
    assert np.array_equal(tans.decode(blob), sym)


def test_deterministic_across_runs_and_threads() -> None:
    rng = np.random.default_rng(11)
    sym = np.minimum(rng.geometric(0.2, 70_001), 255).astype(np.uint8)
    one = tans.encode(sym, chunk_size=4096, threads=1)
    assert tans.encode(sym, chunk_size=4096, threads=1) == one
    assert tans.encode(sym, chunk_size=4096, threads=3) == one
    assert np.array_equal(tans.decode(one, threads=3), sym)


def test_parameters_and_context_are_checked() -> None:
    assert tans.DEFAULT_PRECISION in tans.PRECISIONS
    for bad in (8, 13):
        with pytest.raises(ValueError, match="table log"):
            tans.encode(b"abc", precision=bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        tans.encode(b"abc", chunk_size=1026)
    assert static.CODER.supports_context is False
    sym = np.frombuffer(b"ab", np.uint8)
    freqs = tables.quantize(tables.histogram(sym), 9)
    ctx = np.zeros(2, np.uint8)
    with pytest.raises(ValueError, match="context"):
        static.CODER.encode_chunk(sym, static.CODER.encode_tables(freqs, 9), 9, ctx)
    with pytest.raises(ValueError, match="context"):
        static.CODER.decode_chunk(np.zeros(8, np.uint8), 0, 8,
                                  static.CODER.decode_tables(freqs, 9), 9, sym.copy(), ctx)


@settings(max_examples=60, deadline=None)
@given(
    data=st.lists(st.integers(0, 255), max_size=40).flatmap(
        lambda alphabet: st.lists(
            st.sampled_from(alphabet) if alphabet else st.integers(0, 255), max_size=6000
        )
    ),
    log=st.sampled_from(LOGS),
    chunk_size=st.sampled_from([1024, 1028, 4096]),
)
def test_round_trip_every_table_log(data: list[int], log: int, chunk_size: int) -> None:
    sym = np.array(data, np.uint8)
    blob = tans.encode(sym, precision=log, chunk_size=chunk_size)
    assert np.array_equal(tans.decode(blob), sym)
