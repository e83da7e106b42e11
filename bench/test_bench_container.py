"""Regression benchmarks of the container: a ~16 MB BF16 model (``conftest.model``)
compressed and restored in memory and file to file, default and ``fast``, on one thread
and on every core. ``extra_info["MB"]`` is the original file's size; every run checks
its output (the file-to-file bytes against the in-memory ones, the restored bytes against
the original)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import entropykit
from entropykit.coding.parallel import default_threads
from entropykit.container import files, writer
from entropykit.container.reader import Compressed

THREADS = sorted({1, default_threads()})


def _packed(raw: np.ndarray, fast: bool, threads: int) -> bytes:
    out = io.BytesIO()
    writer.write(files.source(raw), out, threads=threads, fast=fast)
    return out.getvalue()


@pytest.fixture(scope="module")
def raw(model: Path) -> np.ndarray:
    return np.fromfile(model, np.uint8)


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fast", [False, True], ids=["default", "fast"])
def test_compress_in_memory(benchmark, raw, fast, threads):
    want = _packed(raw, fast, 1)
    benchmark.extra_info["MB"] = raw.size / 1e6
    assert benchmark(lambda: _packed(raw, fast, threads)) == want


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("fast", [False, True], ids=["default", "fast"])
def test_decompress_in_memory(benchmark, raw, fast, threads):
    packed = _packed(raw, fast, 1)
    benchmark.extra_info["MB"] = raw.size / 1e6
    got = benchmark(lambda: Compressed(packed).restored(threads))
    assert np.array_equal(got, raw)


@pytest.mark.parametrize("threads", THREADS)
def test_compress_file(benchmark, model, raw, tmp_path, threads):
    out = tmp_path / "m.ek.safetensors"
    benchmark.extra_info["MB"] = raw.size / 1e6
    benchmark(lambda: entropykit.compress_file(model, out, threads=threads, force=True))
    assert out.read_bytes() == _packed(raw, False, 1)


@pytest.mark.parametrize("threads", THREADS)
def test_decompress_file(benchmark, model, raw, tmp_path, threads):
    packed = tmp_path / "m.ek.safetensors"
    packed.write_bytes(_packed(raw, False, 1))
    back = tmp_path / "back.safetensors"
    benchmark.extra_info["MB"] = raw.size / 1e6
    benchmark(lambda: entropykit.decompress_file(packed, back, threads=threads, force=True))
    assert np.array_equal(np.fromfile(back, np.uint8), raw)
