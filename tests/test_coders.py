"""Properties every static coder must have: exact round trips, bounds, errors, determinism.

Parametrized over the coder modules; each exposes ``encode``, ``decode``, ``PRECISIONS``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import entropykit
from entropykit import rans
from entropykit.coding import frame, tables

CODERS = [rans]
try:  # the tANS coder registers itself here once it exists
    from entropykit import tans

    CODERS.append(tans)
except ImportError:  # pragma: no cover
    pass

SMALL_CHUNK = 1024


def _skewed(rng: np.random.Generator, n: int, p: float = 0.3) -> np.ndarray:
    return np.minimum(rng.geometric(p, size=n) - 1, 255).astype(np.uint8)


@pytest.fixture(scope="module", params=CODERS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def coder(request):
    return request.param


@st.composite
def _symbol_arrays(draw):
    k = draw(st.integers(1, 256))
    weights = np.array(draw(st.lists(st.floats(0.001, 1000), min_size=k, max_size=k)))
    n = draw(st.integers(0, 6000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    alphabet = rng.permutation(256)[:k].astype(np.uint8)
    return alphabet[rng.choice(k, size=n, p=weights / weights.sum())]


@given(data=st.data())
def test_round_trip_property(coder, data):
    sym = data.draw(_symbol_arrays())
    precision = data.draw(st.sampled_from(coder.PRECISIONS))
    k = len(np.unique(sym))
    if k > (1 << precision):
        with pytest.raises(ValueError, match="distinct symbols"):
            coder.encode(sym, precision=precision, chunk_size=SMALL_CHUNK)
        return
    f = coder.encode(sym, precision=precision, chunk_size=SMALL_CHUNK)
    out = coder.decode(f)
    assert out.dtype == np.uint8
    np.testing.assert_array_equal(out, sym)


_BOUNDARY_LENGTHS = sorted(
    {0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 129}
    | {m * SMALL_CHUNK + d for m in (1, 2, 3) for d in (-33, -32, -1, 0, 1, 31, 32, 33)}
)


@pytest.mark.parametrize("n", _BOUNDARY_LENGTHS)
def test_lengths_around_lane_and_chunk_boundaries(coder, n):
    sym = _skewed(np.random.default_rng(n), n)
    f = coder.encode(sym, chunk_size=SMALL_CHUNK)
    np.testing.assert_array_equal(coder.decode(f), sym)
    info = frame.parse(coder.static.CODER, f)
    assert info.n == n and len(info.lengths) == -(-n // SMALL_CHUNK)


def test_empty_frame_is_the_bare_header(coder):
    f = coder.encode(np.zeros(0, np.uint8))
    assert len(f) == frame.HEADER_SIZE
    assert coder.decode(f).shape == (0,)


@pytest.mark.parametrize("n", [1, 32, 5000, 300_000])
def test_single_symbol_alphabet(coder, n):
    sym = np.full(n, 77, np.uint8)
    f = coder.encode(sym, chunk_size=SMALL_CHUNK * 64)
    np.testing.assert_array_equal(coder.decode(f), sym)
    if n >= 5000:  # a certain symbol costs no bits: the frame is tables + states only
        assert len(f) < 400 * (-(-n // (SMALL_CHUNK * 64)))


def test_all_256_symbols_uniform_fall_back_to_raw(coder):
    sym = np.random.default_rng(1).integers(0, 256, 100_000).astype(np.uint8)
    f = coder.encode(sym, chunk_size=SMALL_CHUNK * 16)
    info = frame.parse(coder.static.CODER, f)
    assert (info.modes == frame.MODE_RAW).all()
    np.testing.assert_array_equal(coder.decode(f), sym)


def test_all_256_symbols_present_and_skewed(coder):
    rng = np.random.default_rng(2)
    sym = np.concatenate([np.arange(256, dtype=np.uint8), _skewed(rng, 50_000, 0.05)])
    f = coder.encode(sym, chunk_size=SMALL_CHUNK * 16)
    info = frame.parse(coder.static.CODER, f)
    assert np.count_nonzero(info.freqs[0]) == 256
    assert (info.modes == frame.MODE_CODED).all()
    np.testing.assert_array_equal(coder.decode(f), sym)


def test_very_skewed(coder):
    rng = np.random.default_rng(3)
    sym = np.zeros(200_000, np.uint8)
    sym[rng.choice(sym.size, 20, replace=False)] = rng.integers(1, 256, 20)
    f = coder.encode(sym)
    np.testing.assert_array_equal(coder.decode(f), sym)
    assert len(f) < 2000


def test_every_precision(coder):
    sym = _skewed(np.random.default_rng(4), 20_000, 0.2)
    for p in coder.PRECISIONS:
        f = coder.encode(sym, precision=p, chunk_size=SMALL_CHUNK * 4)
        assert f[5] == p
        np.testing.assert_array_equal(coder.decode(f), sym)


def test_size_within_half_percent_of_entropy(coder):
    sym = _skewed(np.random.default_rng(5), 1 << 21, 0.25)
    bound = tables.entropy_bits(tables.histogram(sym)) / 8
    f = coder.encode(sym)
    info = frame.parse(coder.static.CODER, f)
    header = int(info.offsets[0])  # fixed header + tables + chunk directory
    assert len(f) - header <= bound * 1.005, (len(f) - header) / bound


def test_deterministic_across_runs_and_thread_counts(coder):
    sym = _skewed(np.random.default_rng(6), 600_000)
    a = coder.encode(sym, threads=1, chunk_size=SMALL_CHUNK * 64)
    b = coder.encode(sym, threads=2, chunk_size=SMALL_CHUNK * 64)
    assert a == b == coder.encode(sym, threads=2, chunk_size=SMALL_CHUNK * 64)
    np.testing.assert_array_equal(coder.decode(a, threads=2), coder.decode(a, threads=1))


def test_accepts_bytes_and_decodes_into_out(coder):
    sym = _skewed(np.random.default_rng(7), 4000)
    f = coder.encode(sym.tobytes())
    out = np.empty(sym.size, np.uint8)
    assert coder.decode(f, out=out) is out
    np.testing.assert_array_equal(out, sym)
    with pytest.raises(ValueError, match="out must be"):
        coder.decode(f, out=np.empty(sym.size + 1, np.uint8))


def test_bad_arguments(coder):
    with pytest.raises(TypeError, match="uint8"):
        coder.encode(np.zeros(10, np.uint16))
    with pytest.raises(ValueError, match="precision|table log"):
        coder.encode(np.zeros(10, np.uint8), precision=99)
    with pytest.raises(ValueError, match="chunk_size"):
        coder.encode(np.zeros(10, np.uint8), chunk_size=1000)
    with pytest.raises(ValueError, match="threads"):
        coder.encode(np.zeros(10, np.uint8), threads=0)


def _frames(coder):
    rng = np.random.default_rng(8)
    return [
        (coder.encode(s, chunk_size=SMALL_CHUNK), s)
        for s in (
            _skewed(rng, 3000),
            np.full(100, 9, np.uint8),
            rng.integers(0, 256, 2000).astype(np.uint8),
            _skewed(rng, 40, 0.5),
        )
    ]


def _decodes_or_raises(coder, data: bytes, original: np.ndarray) -> None:
    try:
        out = coder.decode(data)
    except entropykit.CorruptDataError:
        return
    # Anything that decodes passed every check, including each chunk's CRC-32.
    np.testing.assert_array_equal(out, original)


def test_fuzz_flip_every_byte(coder):
    for f, sym in _frames(coder):
        for i in range(len(f)):
            for mask in (0x01, 0x80, 0xFF):
                bad = bytearray(f)
                bad[i] ^= mask
                _decodes_or_raises(coder, bytes(bad), sym)


def test_fuzz_truncate_and_extend(coder):
    for f, _sym in _frames(coder):
        for cut in range(len(f)):
            with pytest.raises(entropykit.CorruptDataError):
                coder.decode(f[:cut])
        for tail in (b"\x00", b"\xff" * 7, bytes(range(64))):
            with pytest.raises(entropykit.CorruptDataError, match="trailing"):
                coder.decode(f + tail)


@given(st.binary(max_size=400))
def test_fuzz_random_bytes_after_a_valid_header(coder, junk):
    f, sym = _frames(coder)[0]
    _decodes_or_raises(coder, f[: frame.HEADER_SIZE] + junk, sym)


def test_wrong_magic_and_version_are_named(coder):
    f, _ = _frames(coder)[0]
    with pytest.raises(entropykit.CorruptDataError, match="magic"):
        coder.decode(b"XXXX" + f[4:])
    with pytest.raises(entropykit.CorruptDataError, match="version"):
        coder.decode(f[:4] + b"\x07" + f[5:])


def test_corrupt_data_error_is_a_value_error():
    assert issubclass(entropykit.CorruptDataError, ValueError)


def test_precomputed_counts_give_the_same_frame(coder):
    rng = np.random.default_rng(9)
    sym = _skewed(rng, 50_000, 0.1)
    plain = coder.encode(sym, chunk_size=SMALL_CHUNK * 8)
    counts = tables.histogram(sym)
    given = frame.encode(coder.static.CODER, sym, coder.DEFAULT_PRECISION, SMALL_CHUNK * 8,
                         counts=counts)
    assert given == plain
    with pytest.raises(ValueError, match="counts must be"):
        frame.encode(coder.static.CODER, sym, coder.DEFAULT_PRECISION, counts=counts[:255])
    counts[3] += 1  # no longer the histogram of sym: refused, not coded wrongly
    with pytest.raises(ValueError, match="counts must be"):
        frame.encode(coder.static.CODER, sym, coder.DEFAULT_PRECISION, counts=counts)


def test_precomputed_joint_counts_give_the_same_context_frame():
    from entropykit.coding import contexts

    rng = np.random.default_rng(10)
    ctx = _skewed(rng, 80_000, 0.4)
    sym = (ctx * 7 + _skewed(rng, 80_000, 0.2)).astype(np.uint8)
    plain = rans.encode(sym, context=ctx, chunk_size=SMALL_CHUNK * 8)
    joint = contexts.joint_histogram(ctx, sym)
    given = frame.encode(rans.static.CODER, sym, rans.DEFAULT_PRECISION, SMALL_CHUNK * 8,
                         context=ctx, counts=joint)
    assert given == plain and frame.parse(rans.static.CODER, given).cmap is not None
    np.testing.assert_array_equal(rans.decode(given, context=ctx), sym)
    with pytest.raises(ValueError, match="counts must be"):
        frame.encode(rans.static.CODER, sym, rans.DEFAULT_PRECISION, context=ctx,
                     counts=joint.sum(axis=0))
