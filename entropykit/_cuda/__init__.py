"""What every CUDA backend of the package shares: the device check and the NVRTC plumbing.

What it is: ``GpuUnavailableError`` (public as ``entropykit.gpu.GpuUnavailableError``),
``require`` (torch with CUDA and CuPy present, else that error saying what is missing),
``cuda_device`` (a device as an indexed torch.device) and ``nvrtc`` (building, caching
and launching kernels). Importing it needs neither torch nor CuPy.
What it is not: any kernel or its arguments: each backend lives beside the stage it
implements (``rans.cuda``, ``container.cuda``, ``predictive.cuda``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class GpuUnavailableError(RuntimeError):
    """torch, CuPy or a CUDA device is missing for a GPU decode."""


def as_device(torch: Any, device: Any) -> torch.device:
    """``device`` as a torch.device; an int is a CUDA index (as in safetensors)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cuda", device)
    return torch.device(device)


def require(device: Any) -> None:
    """Raise unless kernels can run on ``device``: ``ValueError`` for a device that is not
    CUDA, ``GpuUnavailableError`` without torch, a CUDA device or CuPy."""
    try:
        import torch
    except ImportError:
        raise GpuUnavailableError(
            "entropykit.gpu needs torch (with CUDA) and cupy: pip install 'entropykit[gpu]'"
        ) from None
    dev = as_device(torch, device)
    if dev.type != "cuda":
        raise ValueError(f"entropykit.gpu decodes into CUDA tensors, got device {dev}")
    if not torch.cuda.is_available():
        raise GpuUnavailableError(
            f"entropykit.gpu: device {dev} asked for, but torch {torch.__version__} sees no "
            "CUDA device"
        )
    try:
        import cupy  # noqa: F401
    except ImportError:
        raise GpuUnavailableError(
            "entropykit.gpu compiles its kernel with cupy, which is missing: "
            "pip install 'entropykit[gpu]' (or the cupy-cudaXXx matching your CUDA)"
        ) from None


def cuda_device(device: Any) -> torch.device:
    """``device`` as a CUDA torch.device with its index (the current device's for "cuda")."""
    import torch

    dev = as_device(torch, device)
    if dev.type != "cuda":
        raise ValueError(f"entropykit.gpu decodes into CUDA tensors, got device {device}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())  # as tensors say
    return dev


_checked: dict[Any, Any] = {}  # checked_device's: device -> indexed torch.device


def checked_device(device: Any) -> torch.device:
    """``require(device)``, then ``cuda_device(device)``; the checks run once for an
    indexed torch.device (what tensors report), every time for "cuda" / ints / strings
    (their meaning follows the current device)."""
    got = _checked.get(device)
    if got is None:
        require(device)
        got = cuda_device(device)
        if getattr(device, "index", None) is not None:
            _checked[device] = got
    return got
