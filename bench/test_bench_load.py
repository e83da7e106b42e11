"""Regression benchmarks of loading: ``load_file`` of the compressed ~16 MB BF16 model
(``conftest.model``) on the CPU, on one thread and on every core, and ``safe_open``'s
``get_tensor`` of its largest tensor; the plain file through ``safetensors`` beside them.
``extra_info["MB"]`` is the original bytes loaded; every run checks the tensors."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import safetensors.torch  # noqa: E402

import entropykit  # noqa: E402
from entropykit.coding.parallel import default_threads  # noqa: E402

THREADS = sorted({1, default_threads()})
_BIG = "embeddings.word_embeddings.weight"


@pytest.fixture(scope="module")
def packed(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("load") / "m.ek.safetensors"
    entropykit.compress_file(model, out, threads=1)
    return out


@pytest.fixture(scope="module")
def want(model: Path) -> dict:
    return safetensors.torch.load_file(model)


def _same(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_load_plain_safetensors(benchmark, model, want):
    benchmark.extra_info["MB"] = model.stat().st_size / 1e6
    assert _same(benchmark(lambda: safetensors.torch.load_file(model)), want)


@pytest.mark.parametrize("threads", THREADS)
def test_load_file(benchmark, model, packed, want, threads):
    benchmark.extra_info["MB"] = model.stat().st_size / 1e6
    assert _same(benchmark(lambda: entropykit.load_file(packed, threads=threads)), want)


def test_safe_open_one_tensor(benchmark, packed, want):
    def get():
        with entropykit.safe_open(packed, framework="pt", threads=1) as f:
            return f.get_tensor(_BIG)

    benchmark.extra_info["MB"] = want[_BIG].numel() * 2 / 1e6
    assert torch.equal(benchmark(get), want[_BIG])
