"""The fp8 pair layouts gpu/bench_gpu.py times: each split keeps every byte, and the bf16
words it packs them into are, field for field, the streams the bf16 build decodes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from entropykit.formats import registry

pytest.importorskip("torch")

_GPU = Path(__file__).resolve().parents[1] / "gpu"


@pytest.fixture(scope="module")
def bg():
    """gpu/bench_gpu.py on the CPU (its device is read at import; gpu/ on the path for its
    imports)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EK_BENCH_DEVICE", "cpu")
        mp.syspath_prepend(str(_GPU))
        spec = importlib.util.spec_from_file_location("bench_gpu", _GPU / "bench_gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


# Every ordered pair of byte values: NaN (0x7f, 0xff), +-0, subnormals, +-448, all at once.
_A, _B = (g.ravel().astype(np.uint8) for g in np.meshgrid(np.arange(256), np.arange(256)))
ALL_PAIRS = np.stack([_A, _B], axis=1).ravel()


def _at(a: int, b: int) -> int:
    """The pair index of values (a, b) in ``ALL_PAIRS``."""
    return b * 256 + a


def _join(coded: np.ndarray, raw: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """The fp8 bytes of a split: nibble k of the coded byte picks the group (exponent),
    nibble k of the raw byte the sign and place; ``magnitude`` maps group << 3 | place."""
    out = np.empty(2 * coded.size, np.uint8)
    for k, shift in ((0, 4), (1, 0)):
        g = (coded.astype(np.int64) >> shift) & 0xF
        r = (raw.astype(np.int64) >> shift) & 0xF
        out[k::2] = ((r >> 3) << 7) | magnitude[(g << 3) | (r & 7)]
    return out


def test_exponent_pairs_keep_every_byte_pair(bg) -> None:
    coded, raw = bg.pair_split(ALL_PAIRS)
    assert coded.size == raw.size == 65536
    assert np.array_equal(_join(coded, raw, np.arange(128)), ALL_PAIRS)
    # e4m3 is s eeee mmm; the first value's nibbles are the high ones. NaN 0x7f and +0:
    # exponents 15 and 0, sign + mantissa 0111 and 0000; NaN 0xff and -0: 1111 and 1000.
    assert (coded[_at(0x7F, 0x00)], raw[_at(0x7F, 0x00)]) == (0xF0, 0x70)
    assert (coded[_at(0xFF, 0x80)], raw[_at(0xFF, 0x80)]) == (0xF0, 0xF8)
    assert (coded[_at(0x01, 0x3B)], raw[_at(0x01, 0x3B)]) == (0x07, 0x13)  # subnormal, 1.375


@pytest.mark.parametrize("n", [0, 1, 2, 3, 65537])
def test_odd_and_tiny_lengths_leave_out_only_the_last_value(bg, n) -> None:
    rng = np.random.default_rng(n)
    b = rng.integers(0, 256, n, dtype=np.uint8)
    for split in (bg.pair_split, bg.ranked_split):
        coded, raw = split(b)
        assert coded.dtype == raw.dtype == np.uint8 and coded.size == raw.size == n // 2
    coded, raw = bg.pair_split(b)
    assert np.array_equal(_join(coded, raw, np.arange(128)), b[: 2 * (n // 2)])


def test_ranked_groups_keep_every_byte_and_hold_eight_magnitudes(bg) -> None:
    rng = np.random.default_rng(7)
    values = np.round(rng.laplace(0, 20, 200_001)).clip(-126, 126).astype(np.int64)
    b = np.concatenate([((values < 0) << 7 | np.abs(values)).astype(np.uint8),
                        np.array([0x7F, 0xFF, 0x00, 0x80], np.uint8)])
    coded, raw = bg.ranked_split(b)
    counts = np.bincount(b & 0x7F, minlength=128)
    order = np.argsort(-counts, kind="stable")  # rank -> magnitude
    assert np.array_equal(_join(coded, raw, order), b[: 2 * (b.size // 2)])
    # The most frequent magnitudes are group 0: the coded byte's most common value is 0x00.
    assert np.bincount(coded, minlength=256).argmax() == 0


def test_bf16_words_carry_the_pair_streams_as_the_bf16_fields(bg) -> None:
    rng = np.random.default_rng(3)
    tensors = [ALL_PAIRS, rng.integers(0, 256, 4097, dtype=np.uint8)]
    for split in (bg.pair_split, bg.ranked_split):
        for b, words in zip(tensors, bg.pairs_as_bf16(tensors, split), strict=True):
            coded, raw = split(b)
            assert words.dtype == np.uint16 and words.size == b.size // 2
            fields = {f.name: f.symbols for f in registry.split("BF16", words.view(np.uint8))}
            assert np.array_equal(fields["exponent"], coded)
            assert np.array_equal(fields["sign_mantissa"], raw)
