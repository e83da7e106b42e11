"""pytest-benchmark set-up of the regression suites in bench/ (``test_bench_*.py``).

What it is: the per-machine baseline store (``bench/baselines/<machine>/``, where
``<machine>`` is ``$ENTROPYKIT_BENCH_MACHINE`` or the CPU model and core count, so runs
are compared only with runs of the same machine), and the synthetic inputs the suites
share (fixed seeds, written once per session under a temporary directory). The default
test suite never collects this folder (``testpaths``). Without pytest-benchmark
installed the suites are not collected.
What it is not: the side-by-side scripts (``bench_*.py``), which pytest does not collect.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import data  # noqa: E402 - bench/ is a folder of scripts, not a package

if importlib.util.find_spec("pytest_benchmark") is None:
    collect_ignore_glob = ["test_*.py"]  # install the bench extra to run them

MACHINE_ENV = "ENTROPYKIT_BENCH_MACHINE"
BASELINES = BENCH / "baselines"
_DEFAULT_STORAGE = "file://./.benchmarks"  # pytest-benchmark's own default


def machine() -> str:
    """This machine's name in ``bench/baselines``."""
    name = os.environ.get(MACHINE_ENV, "").strip()
    if not name:
        cpu = platform.processor()
        if os.path.exists("/proc/cpuinfo"):
            with open("/proc/cpuinfo") as f:
                cpu = next((ln.split(":", 1)[1] for ln in f if ln.startswith("model name")),
                           cpu)
        name = f"{cpu}-{os.cpu_count()}cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    # Before pytest-benchmark opens its storage: the per-machine folder, unless given.
    opt = config.option
    if getattr(opt, "benchmark_storage", None) == _DEFAULT_STORAGE:
        opt.benchmark_storage = f"file://{BASELINES / machine()}"


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["entropykit_machine"] = machine()


# Shapes of a small encoder (MiniLM-like: an embedding and three blocks), ~16 MB in BF16.
_HIDDEN, _FFN = 384, 1536
SHAPES = [("embeddings.word_embeddings.weight", (8192, _HIDDEN))] + [
    (f"encoder.layer.{i}.{name}", shape) for i in range(3) for name, shape in (
        ("attention.self.query.weight", (_HIDDEN, _HIDDEN)),
        ("attention.self.key.weight", (_HIDDEN, _HIDDEN)),
        ("attention.self.value.weight", (_HIDDEN, _HIDDEN)),
        ("attention.output.dense.weight", (_HIDDEN, _HIDDEN)),
        ("attention.output.LayerNorm.weight", (_HIDDEN,)),
        ("intermediate.dense.weight", (_FFN, _HIDDEN)),
        ("output.dense.weight", (_HIDDEN, _FFN)),
        ("output.LayerNorm.weight", (_HIDDEN,)))]


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic BF16 model file (``data.synthetic_bf16``)."""
    dst = tmp_path_factory.mktemp("bench") / "model.safetensors"
    return data.synthetic_bf16(dst, SHAPES, 19, "bench suite encoder")


@pytest.fixture(scope="session")
def weights() -> np.ndarray:
    """4 Mi BF16 weights (bit patterns, uint16) with per-row scales, for the coders."""
    rng = np.random.default_rng(7)
    scale = 0.02 * np.exp2(rng.uniform(-1.5, 1.5, (1024, 1))).astype(np.float32)
    return data.bf16_bits(rng.standard_normal((1024, 4096), np.float32) * scale).reshape(-1)
