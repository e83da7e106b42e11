"""Launching the decoder: a host ``Batch`` uploaded once, decoded into torch tensors.

What it is: the CUDA half of ``entropykit.gpu``: compiling ``_kernel.cu`` through NVRTC
(CuPy) at first use, one build per kernel flavour; upload; output binding (each output's
position as an element offset from the lowest-addressed output, so one launch writes many
separately allocated tensors); the launch on torch's current stream; and turning the
kernel's per-row status into ``CorruptDataError``. Imported only when a decode is asked
for, so the package imports without torch or CuPy.
What it is not: frame parsing (``plan.py``) or the kernel (``_kernel.cu``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources

import cupy as cp
import numpy as np
import torch

from . import _layout, check_outputs
from .plan import Batch

SMEM_MAX_PRECISION = 12  # the shared-memory tables hold 2**12 slots per stream


def _warp_smem(tables: bool, t: Tuning) -> int:
    """Shared memory of one warp (_kernel.cu's WARP_SMEM): two word rings, maybe tables."""
    return 2 * 128 * t.ring_windows + (2 * (4096 + 1024) if tables else 0)


@dataclass(frozen=True)
class Tuning:
    """Kernel build knobs; the defaults are what gpu/README.md measured best."""

    warps: int = 4  # warps (= chunk pairs) per block
    smem: bool = True  # tables in shared memory (batches with every p <= 12)
    ring_windows: int = 8  # 128-byte windows per stream's word ring (a power of 2, >= 4)


_lock = threading.Lock()
_kernels: dict[tuple, cp.RawKernel] = {}


def _kernel(bf16: bool, ctx: bool, smem: bool, t: Tuning) -> cp.RawKernel:
    key = (bf16, ctx, smem, t)
    with _lock:
        if key not in _kernels:
            src = resources.files(__package__).joinpath("_kernel.cu").read_text()
            cols = [f"-D{k}={getattr(_layout, k)}" for k in dir(_layout) if k.isupper()]
            opts = ("--std=c++17", f"-DBF16={int(bf16)}", f"-DCTX={int(ctx)}",
                    f"-DSMEM={int(smem)}", f"-DWARPS={t.warps}",
                    f"-DRING_WINDOWS={t.ring_windows}", *cols)
            k = cp.RawKernel(src, "rans_decode", options=opts)
            k.max_dynamic_shared_size_bytes = t.warps * _warp_smem(smem, t)
            _kernels[key] = k
        return _kernels[key]


def _stream() -> cp.cuda.Stream:
    """Torch's current stream, as CuPy sees it, so launches order with torch's work."""
    handle = torch.cuda.current_stream().cuda_stream
    return cp.cuda.ExternalStream(handle) if handle else cp.cuda.Stream.null


class DeviceBatch:
    """A ``Batch`` whose buffers live on a CUDA device; ``decode`` may run many times."""

    def __init__(self, batch: Batch, device: torch.device | str) -> None:
        self.batch = batch
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"entropykit.gpu decodes into CUDA tensors, got device {device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # as tensors say
        up = lambda a: torch.from_numpy(a).to(self.device)
        self.payload = up(batch.payload)
        self.sym_tables = up(batch.sym_tables)
        self.info_tables = up(batch.info_tables.view(np.int32))
        self.cmaps = up(batch.cmaps)
        self.status = torch.zeros(max(1, len(batch.desc)), dtype=torch.int32,
                                  device=self.device)
        self._narrow = int(batch.desc[:, _layout.D_PREC].max(initial=0)) <= SMEM_MAX_PRECISION
        self._context = batch.context

    def bind(self, outs: Sequence[torch.Tensor], tuning: Tuning | None = None) -> BoundDecode:
        """Check ``outs`` and fix the launch that decodes into them (call it to run)."""
        b = self.batch
        check_outputs(b, outs)
        if outs and outs[0].device != self.device:
            raise ValueError(f"outputs are on {outs[0].device}, the batch on {self.device}")
        used = [t for t in outs if t.numel()]
        base = min(used, key=lambda t: t.data_ptr()) if used else self.status
        size = 2 if b.bf16 else 1
        delta = np.array([(t.data_ptr() - base.data_ptr()) // size for t in outs] + [0])
        desc = b.desc.copy()
        desc[:, _layout.D_OUT] += delta[b.out_index]  # padding rows (-1) write nothing
        return BoundDecode(self, torch.from_numpy(desc).to(self.device), base,
                           tuning or Tuning())

    def decode(self, outs: Sequence[torch.Tensor], *, check: bool = True,
               tuning: Tuning | None = None) -> None:
        """Decode into ``outs`` (one launch); with ``check``, wait and raise on corrupt data.

        ``tuning`` changes the kernel build (for measurements; results are the same).
        """
        self.bind(outs, tuning)()
        if check:
            self.check()

    def check(self) -> None:
        """Raise ``CorruptDataError`` if the last decode met corrupt data (synchronizes)."""
        err = self.batch.error(self.status[: len(self.batch.desc)].cpu().numpy())
        if err is not None:
            raise err


class BoundDecode:
    """One decode launch with its outputs fixed: calling it only enqueues the kernel."""

    def __init__(self, db: DeviceBatch, desc: torch.Tensor, base: torch.Tensor,
                 t: Tuning) -> None:
        self.db = db
        self.desc = desc  # keeps the device descriptor alive while launches use it
        self.pairs = len(desc) // 2
        self.smem = t.smem and db._narrow
        self.kernel = _kernel(db.batch.bf16, db._context, self.smem, t) if self.pairs else None
        self.grid = (-(-self.pairs // t.warps),)
        self.block = (32 * t.warps,)
        self.shared = t.warps * _warp_smem(self.smem, t)
        ptr = lambda x: np.uint64(x.data_ptr())
        self.args = (ptr(desc), ptr(db.status), ptr(db.payload), ptr(db.sym_tables),
                     ptr(db.info_tables), ptr(db.cmaps), ptr(base), np.int32(self.pairs))
        self.outs_alive = base  # the outputs must outlive the launch

    def __call__(self) -> None:
        if self.kernel is None:
            return
        with cp.cuda.Device(self.db.device.index), _stream():
            self.kernel(self.grid, self.block, self.args, shared_mem=self.shared)
