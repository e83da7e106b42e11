"""The table-building and counting kernels: histograms and rANS coder tables, checked
against their definitions (not against stored results)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entropykit.coding import tables
from entropykit.rans import kernels


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1000, (1 << 16) + 5])
@pytest.mark.parametrize("offset", [0, 1, 3, 7])
def test_histogram_counts_every_byte_at_any_alignment(n, offset):
    rng = np.random.default_rng(n * 8 + offset)
    sym = rng.integers(0, 256, n + offset, dtype=np.uint8)[offset:]  # unaligned start
    assert np.array_equal(tables.histogram(sym), np.bincount(sym, minlength=256))


def test_histogram_of_one_repeated_symbol():
    sym = np.full((1 << 20) + 3, 200, np.uint8)
    h = tables.histogram(sym)
    assert h[200] == sym.size and h.sum() == sym.size


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=300))
def test_histogram_property(data):
    sym = np.frombuffer(data, np.uint8)
    assert np.array_equal(tables.histogram(sym), np.bincount(sym, minlength=256))


def _freq_rows(rng, precision, rows):
    out = []
    for _ in range(rows):
        k = int(rng.integers(1, min(256, 1 << precision) + 1))
        counts = np.zeros(256, np.int64)
        present = rng.choice(256, k, replace=False)
        counts[present] = rng.integers(1, 10 ** int(rng.integers(1, 7)), k)
        out.append(tables.quantize(counts, precision))
    return np.stack(out)


def _cases():
    rng = np.random.default_rng(7)
    for precision in (8, 12, 14, 15):
        yield precision, _freq_rows(rng, precision, 16)
        single = np.zeros((1, 256), np.int64)
        single[0, 255] = 1 << precision  # one symbol holds every slot
        yield precision, single
        yield precision, tables.quantize(np.ones(256, np.int64), precision)[None, :]


@pytest.mark.parametrize(("precision", "freqs"), list(_cases()))
def test_rans_decode_table_matches_its_definition(precision, freqs):
    table = kernels.decode_table(freqs, precision)
    assert table.shape == (freqs.shape[0], 1 << precision) and table.dtype == np.uint64
    for k, f in enumerate(freqs):
        start = np.cumsum(f) - f
        sym = np.repeat(np.arange(256), f)  # the symbol of each slot
        slots = np.arange(1 << precision)
        assert np.array_equal(table[k] >> np.uint64(32), sym)
        assert np.array_equal((table[k] >> np.uint64(16)) & np.uint64(0xFFFF), f[sym])
        assert np.array_equal(table[k] & np.uint64(0xFFFF), slots - start[sym])


@pytest.mark.parametrize(("precision", "freqs"), list(_cases()))
def test_rans_encode_tables_divide_exactly(precision, freqs):
    tab = kernels.encode_tables(freqs, precision)
    assert tab.shape == freqs.shape + (2,) and tab.dtype == np.uint64
    m32 = (1 << 32) - 1
    for k, f in enumerate(freqs):
        start = np.cumsum(f) - f
        for s in range(256):
            r0, r1 = int(tab[k, s, 0]), int(tab[k, s, 1])
            if f[s] == 0:
                assert r0 == r1 == 0
                continue
            assert r1 & 0xFFFF == f[s] and (r1 >> 16) & 0xFFFF == start[s]
            assert (r0 >> 32) == (int(f[s]) << (32 - precision)) - 1
            rcp, shift = r0 & m32, r1 >> 32
            # The reciprocal division is exact at the ends and around multiples of f.
            for x in (0, 1, int(f[s]) - 1, int(f[s]), 65535, 65536, m32 - 1, m32,
                      int(f[s]) * 12345 - 1, int(f[s]) * 12345):
                x &= m32
                assert (x + (x * rcp >> 32)) >> shift == x // int(f[s])


@pytest.mark.parametrize("build", [kernels.encode_tables, kernels.decode_table])
def test_rans_tables_refuse_bad_frequencies(build):
    good = tables.quantize(np.arange(256, dtype=np.int64) + 1, 12)
    bad_sum = good.copy()
    bad_sum[0] += 1
    negative = good.copy()
    negative[0] -= good[0] + 1
    negative[1] += good[0] + 1
    for freqs, precision in ((bad_sum, 12), (negative, 12), (good[:255], 12), (good, 16),
                             (good, 11)):
        with pytest.raises(ValueError, match="summing to"):
            build(freqs, precision)


def test_rans_tables_whose_counts_wrap_int64_are_refused() -> None:
    # Rows whose int64 sum wraps round to 2**precision: a numpy sum took them for valid
    # and the table builder wrote past its table. In a child process: a crash is a failure.
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from entropykit.rans import kernels\n"
            "f = np.zeros(256, np.int64)\n"
            "f[:4] = 1 << 62\n"
            "f[4] = 1 << 12\n"
            "for build in (kernels.decode_table, kernels.encode_tables):\n"
            "    try:\n"
            "        build(f, 12)\n"
            "    except ValueError:\n"
            "        print('refused')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["refused", "refused"]


@pytest.mark.parametrize("precision", [8, 12, 14])
def test_quantize_rows_is_quantize_and_serialize_of_each_row(precision):
    rng = np.random.default_rng(precision)
    rows = np.zeros((5, 256), np.int64)
    for r, k in enumerate([1, 2, 31, 33, 256]):  # symbol list and bitmap tables
        sym = rng.choice(256, k, replace=False)
        rows[r, sym] = rng.integers(1, 10_000, k)
    freqs, section = tables.quantize_rows(rows, precision)
    want = [tables.quantize(row, precision) for row in rows]
    assert np.array_equal(freqs, np.stack(want))
    assert section == b"".join(tables.serialize(f) for f in want)


@pytest.mark.parametrize("bad, match", [(np.zeros(256, np.int64), "empty input"),
                                        (-np.ones(256, np.int64), "non-negative")])
def test_quantize_rows_refuses_a_row_as_quantize_does(bad, match):
    rows = np.ones((3, 256), np.int64)
    rows[1] = bad
    with pytest.raises(ValueError, match=match):
        tables.quantize_rows(rows, 12)
    with pytest.raises(ValueError, match=match):
        tables.quantize(bad, 12)


def test_rows_bits_is_the_sum_of_each_rows_entropy_and_table():
    from entropykit.coding import contexts

    rng = np.random.default_rng(5)
    rows = rng.integers(0, 50, (4, 256)) * (rng.random((4, 256)) < 0.3)
    want = 8.0 * 257
    for row in rows:
        want += tables.entropy_bits(row) + contexts.table_bits(row)
    assert contexts.rows_bits(rows.astype(np.int64), 8.0 * 257) == want
