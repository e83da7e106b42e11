"""Regression benchmarks of the coders on one thread: rANS (plain and conditioned on the
exponent), tANS, CRC-32 and the histogram, on the two fields of 4 Mi BF16 weights
(``conftest.weights``). Each benchmark's ``extra_info["MB"]`` is the symbols coded, so a
rate is ``MB / time``; every run checks its round trip."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from entropykit import formats, rans, tans
from entropykit.coding import tables
from entropykit.coding.crc32 import crc32


@pytest.fixture(scope="module")
def fields(weights: np.ndarray) -> dict[str, np.ndarray]:
    got = formats.split("BF16", weights.view(np.uint8))
    return {f.name: np.ascontiguousarray(f.symbols, np.uint8).reshape(-1) for f in got}


def _coded(benchmark, fn, size: int):
    fn()  # warm: kernels compiled or loaded from the cache, pages touched
    benchmark.extra_info["MB"] = size / 1e6
    return benchmark(fn)


@pytest.mark.parametrize("field", ["exponent", "sign_mantissa"])
def test_rans_encode(benchmark, fields, field):
    sym = fields[field]
    frame = _coded(benchmark, lambda: rans.encode(sym, threads=1), sym.size)
    assert np.array_equal(rans.decode(frame, threads=1), sym)


@pytest.mark.parametrize("field", ["exponent", "sign_mantissa"])
def test_rans_decode(benchmark, fields, field):
    sym = fields[field]
    frame = rans.encode(sym, threads=1)
    assert np.array_equal(_coded(benchmark, lambda: rans.decode(frame, threads=1), sym.size),
                          sym)


def test_rans_context_encode(benchmark, fields):
    sym, ctx = fields["sign_mantissa"], fields["exponent"]
    frame = _coded(benchmark, lambda: rans.encode(sym, context=ctx, threads=1), sym.size)
    assert np.array_equal(rans.decode(frame, context=ctx, threads=1), sym)


def test_rans_context_decode(benchmark, fields):
    sym, ctx = fields["sign_mantissa"], fields["exponent"]
    frame = rans.encode(sym, context=ctx, threads=1)
    got = _coded(benchmark, lambda: rans.decode(frame, context=ctx, threads=1), sym.size)
    assert np.array_equal(got, sym)


def test_tans_encode(benchmark, fields):
    sym = fields["exponent"]
    frame = _coded(benchmark, lambda: tans.encode(sym, threads=1), sym.size)
    assert np.array_equal(tans.decode(frame, threads=1), sym)


def test_tans_decode(benchmark, fields):
    sym = fields["exponent"]
    frame = tans.encode(sym, threads=1)
    assert np.array_equal(_coded(benchmark, lambda: tans.decode(frame, threads=1), sym.size),
                          sym)


def test_crc32(benchmark, weights):
    raw = weights.view(np.uint8)
    assert _coded(benchmark, lambda: crc32(raw), raw.size) == zlib.crc32(raw)


def test_histogram(benchmark, fields):
    sym = fields["exponent"]
    counts = _coded(benchmark, lambda: tables.histogram(sym), sym.size)
    assert np.array_equal(counts, np.bincount(sym, minlength=256))
