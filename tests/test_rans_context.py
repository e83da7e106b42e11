"""rANS with one table per context class (e.g. BF16 sign+mantissa given the exponent)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import entropykit
from entropykit import rans
from entropykit.coding import contexts, frame


def _conditioned(rng: np.random.Generator, n: int, k: int = 6):
    ctx = rng.integers(0, k, n).astype(np.uint8)
    # The symbol's distribution shifts with its context: conditioning pays.
    sym = ((rng.geometric(0.3, n) + 20 * ctx.astype(np.int64)) % 256).astype(np.uint8)
    return ctx, sym


def test_context_round_trip_and_gain():
    ctx, sym = _conditioned(np.random.default_rng(0), 400_000)
    plain = rans.encode(sym)
    cond = rans.encode(sym, context=ctx)
    info = frame.parse(rans.static.CODER, cond)
    assert info.cmap is not None and info.freqs.shape[0] > 1
    assert len(cond) < 0.8 * len(plain)
    np.testing.assert_array_equal(rans.decode(cond, context=ctx), sym)
    np.testing.assert_array_equal(rans.decode(cond, context=ctx, threads=1), sym)


def test_context_that_does_not_pay_gives_a_one_table_frame():
    rng = np.random.default_rng(1)
    sym = np.minimum(rng.geometric(0.3, 50_000), 255).astype(np.uint8)
    ctx = rng.integers(0, 4, sym.size).astype(np.uint8)  # independent of sym
    f = rans.encode(sym, context=ctx)
    assert f[7] == 0 and f == rans.encode(sym)
    np.testing.assert_array_equal(rans.decode(f), sym)


def test_missing_or_wrong_context():
    ctx, sym = _conditioned(np.random.default_rng(2), 100_000)
    f = rans.encode(sym, context=ctx, chunk_size=4096)
    with pytest.raises(ValueError, match="context-conditioned"):
        rans.decode(f)
    with pytest.raises(entropykit.CorruptDataError, match="context has"):
        rans.decode(f, context=ctx[:-1])
    wrong = ctx.copy()
    wrong[5000] = (wrong[5000] + 1) % 6
    with pytest.raises(entropykit.CorruptDataError, match="chunk 1"):
        rans.decode(f, context=wrong)


@pytest.mark.parametrize("n", [2000, 2048 + 31, 4096 * 3 + 17])
def test_mapped_context_decodes_like_the_map(n):
    # A caller may hand the table index of every symbol (cmap[context]) instead of the
    # context: same symbols; an index beyond the tables is refused, never read.
    ctx, sym = _conditioned(np.random.default_rng(7), n)
    f = rans.encode(sym, context=ctx, chunk_size=1024)
    info = frame.parse(rans.static.CODER, f)
    assert info.cmap is not None and info.freqs.shape[0] > 1
    mapped = info.cmap[ctx]
    for threads in (1, 2):
        got = frame.decode(rans.static.CODER, f, threads, context=mapped, mapped=True)
        np.testing.assert_array_equal(got, sym)
    for threads in (1, 2):  # contexts asked for group by group (raw chunks need none)
        asked: list[tuple[int, int]] = []

        def part(lo, hi, asked=asked):
            asked.append((lo, hi))
            return mapped[lo:hi].copy()

        got = frame.decode(rans.static.CODER, f, threads, context=part, mapped=True)
        np.testing.assert_array_equal(got, sym)
        spans = sorted(asked)
        assert spans[0][0] == 0 and spans[-1][1] <= n
        assert len(spans) <= -(-n // (1024 * frame.DECODE_GROUP))  # one per coded group
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    with pytest.raises(entropykit.CorruptDataError, match="context does not match"):
        frame.decode(rans.static.CODER, f, 1, context=lambda lo, hi: mapped[lo : hi - 1],
                     mapped=True)  # one short: refused by the kernel
    bad = mapped.copy()
    bad[n // 2] = info.freqs.shape[0]
    with pytest.raises(entropykit.CorruptDataError, match="context does not match"):
        frame.decode(rans.static.CODER, f, 1, context=bad, mapped=True)


def test_context_function_encodes_like_the_array():
    ctx, sym = _conditioned(np.random.default_rng(8), 10_000)
    joint = contexts.joint_histogram(ctx, sym)
    asked: list[tuple[int, int]] = []

    def part(lo, hi):
        asked.append((lo, hi))
        return ctx[lo:hi]

    f = frame.encode(rans.static.CODER, sym, 12, 1024, 1, part, counts=joint)
    assert f == frame.encode(rans.static.CODER, sym, 12, 1024, 1, ctx)
    assert sorted(asked) == [(lo, min(lo + 1024, sym.size)) for lo in range(0, sym.size, 1024)]
    with pytest.raises(ValueError, match="counts"):
        frame.encode(rans.static.CODER, sym, 12, 1024, 1, part)
    with pytest.raises(ValueError, match="context has"):
        frame.encode(rans.static.CODER, sym, 12, 1024, 1, lambda lo, hi: ctx[lo : hi - 1],
                     counts=joint)


def test_max_tables_is_respected():
    ctx, sym = _conditioned(np.random.default_rng(3), 200_000, k=12)
    for m in (1, 2, 5):
        info = frame.parse(rans.static.CODER, rans.encode(sym, context=ctx, max_tables=m))
        assert info.freqs.shape[0] <= m
    with pytest.raises(ValueError, match="max_tables"):
        contexts.choose(np.ones((256, 256), np.int64), 0)


@given(st.integers(0, 3000), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_context_property(n, k, seed):
    ctx, sym = _conditioned(np.random.default_rng(seed), n, k)
    f = rans.encode(sym, context=ctx, chunk_size=1024, max_tables=8)
    np.testing.assert_array_equal(rans.decode(f, context=ctx), sym)


def test_fuzz_context_frame():
    ctx, sym = _conditioned(np.random.default_rng(4), 3000)
    f = rans.encode(sym, context=ctx, chunk_size=1024)
    assert f[7] == 1
    for i in range(len(f)):
        bad = bytearray(f)
        bad[i] ^= 0x41
        try:
            out = rans.decode(bytes(bad), context=ctx)
        except entropykit.CorruptDataError:
            continue
        np.testing.assert_array_equal(out, sym)
