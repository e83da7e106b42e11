"""GPU-batched rANS decoding: many frames, one kernel launch, straight into torch tensors.

What it is: the device decoder of ``entropykit.rans`` static frames (same bits as the CPU
decoder). ``decode_batch`` decodes uint8 fields; ``decode_bf16`` / ``decode_bf16_batch``
decode a BF16 tensor's ``exponent`` and ``sign_mantissa`` frames together and write the
bf16 values themselves. For repeated decodes of one set of frames, ``prepare_u8`` /
``prepare_bf16`` build the host plan once and ``upload`` it. Whole compressed files go
through ``entropykit.load_file(path, device="cuda")`` (``container.cuda``). The per-value
distribution coder's CUDA twin is ``dist.py`` here.
What it is not: an encoder, or a CRC check: the kernel checks what the CPU decoder's rANS
kernel checks (start states, exact word count, final states); the per-chunk CRC-32 stays
with the CPU ``verify`` path.

The kernel is CUDA C++ (``_kernel.cu``) compiled by NVRTC through CuPy at first use;
docs/gpu.md says why. Needs torch with CUDA and CuPy
(``pip install 'entropykit[gpu]'``); importing this module does not, calling it does
(``GpuUnavailableError`` says what is missing). The public name of this API is
``entropykit.gpu``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..._cuda import GpuUnavailableError, require
from ._layout import D_OUT
from .plan import Batch, prepare_bf16, prepare_u8

if TYPE_CHECKING:
    import torch

    from ._runtime import DeviceBatch

FrameBytes = bytes | memoryview | np.ndarray

__all__ = [
    "Batch",
    "GpuUnavailableError",
    "check_outputs",
    "decode_batch",
    "decode_bf16",
    "decode_bf16_batch",
    "prepare_bf16",
    "prepare_u8",
    "upload",
]


def load_runtime(device: Any) -> Any:
    """The launcher module (``_runtime``), once ``device`` is known to run kernels
    (``GpuUnavailableError`` saying what is missing otherwise)."""
    require(device)
    from . import _runtime

    return _runtime


def upload(batch: Batch, device: Any = "cuda") -> DeviceBatch:
    """Copy a prepared batch's buffers to ``device``; ``.decode(outs)`` then runs it, and
    ``.bind(outs)`` returns a launch to call repeatedly without re-checking the outputs."""
    return load_runtime(device).DeviceBatch(batch, device)


def check_outputs(batch: Batch, outs: Sequence[torch.Tensor]) -> None:
    """Raise unless ``outs`` fit ``batch``: one contiguous tensor per frame (per tensor in
    bf16 mode) of its element count and dtype, all on one device. Runs without a GPU."""
    import torch

    if len(outs) != len(batch.sizes):
        raise ValueError(f"{len(outs)} outputs for {len(batch.sizes)} frames")
    dtypes = (torch.bfloat16, torch.int16, torch.uint16) if batch.bf16 else (torch.uint8,)
    for k, (t, n) in enumerate(zip(outs, batch.sizes, strict=True)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"output {k} is not a torch tensor")
        if t.dtype not in dtypes:
            want = "bfloat16 (or int16/uint16)" if batch.bf16 else "uint8"
            raise TypeError(f"output {k} is {t.dtype}, expected {want}")
        if t.numel() != n or not t.is_contiguous():
            raise ValueError(
                f"output {k} must be a contiguous tensor of {n} elements, got shape "
                f"{tuple(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}"
            )
        if t.device != outs[0].device:
            raise ValueError(f"output {k} is on {t.device}, output 0 on {outs[0].device}")


def bound_desc(b: Batch, outs: Sequence[torch.Tensor]
               ) -> tuple[np.ndarray, torch.Tensor | None]:
    """``b``'s descriptors with every output's position added to D_OUT, as an element
    offset from the lowest-addressed output, which is returned with them (None if every
    output is empty). Runs without a GPU."""
    used = [t for t in outs if t.numel()]
    if not used:
        return b.desc.copy(), None
    base = min(used, key=lambda t: t.data_ptr())
    size = 2 if b.bf16 else 1
    delta = np.array([(t.data_ptr() - base.data_ptr()) // size for t in outs] + [0])
    desc = b.desc.copy()
    desc[:, D_OUT] += delta[b.out_index]  # padding rows (-1) write nothing
    return desc, base


def _run(batch: Batch, outs: Sequence[torch.Tensor], device: Any) -> None:
    check_outputs(batch, outs)
    dev = device if device is not None else (outs[0].device if outs else "cuda")
    upload(batch, dev).decode(outs)


def decode_batch(frames: Sequence[FrameBytes], outs: Sequence[torch.Tensor], *,
                 device: Any = None) -> None:
    """Decode rANS frame k into ``outs[k]`` (contiguous uint8, ``n`` elements), one launch.

    ``device`` defaults to the outputs' device. Raises ``CorruptDataError`` naming the
    frame and chunk of malformed input (outputs are then partly written), ``ValueError`` /
    ``TypeError`` for outputs that do not fit, ``GpuUnavailableError`` without CUDA/CuPy.
    """
    _run(prepare_u8(frames), outs, device)


def decode_bf16_batch(exp_frames: Sequence[FrameBytes], sm_frames: Sequence[FrameBytes],
                      outs: Sequence[torch.Tensor], *, device: Any = None) -> None:
    """Write bf16 tensor k (``outs[k]``: contiguous bfloat16, int16 or uint16) from its
    ``exponent`` and ``sign_mantissa`` frames, all tensors in one launch."""
    _run(prepare_bf16(exp_frames, sm_frames), outs, device)


def decode_bf16(exp_frame: FrameBytes, sm_frame: FrameBytes, out: torch.Tensor) -> None:
    """Write one bf16 tensor from its ``exponent`` and ``sign_mantissa`` frames."""
    decode_bf16_batch([exp_frame], [sm_frame], [out])
