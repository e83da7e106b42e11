"""Settings of the GPU-machine suite: every test here carries the ``cuda`` marker (each
module sets it) and needs torch with a CUDA device and CuPy; without them each test skips,
saying what is missing. The device checks in gpu/ are imported from here as modules.

What it is not: the CPU suite's settings (tests/conftest.py), which the default
``python -m pytest`` run uses; that run deselects the ``cuda`` marker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_GPU = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_GPU.parent), str(_GPU)]  # the checkout's entropykit, gpu/'s scripts


def missing() -> str | None:
    """What this machine lacks for the suite, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'entropykit[gpu]')"
    return None


@pytest.fixture(scope="session", autouse=True)
def _cuda_device() -> None:
    why = missing()
    if why is not None:
        pytest.skip(f"cuda suite: {why}")

