"""Launching the decoder: a host ``Batch`` uploaded once, decoded into torch tensors.

What it is: the CUDA half of ``rans.cuda``: compiling ``_kernel.cu`` through NVRTC
(CuPy) at first use, one build per kernel flavour; output binding (each output's position
as an element offset from the lowest-addressed output, so one launch writes many
separately allocated tensors); the launch on torch's current stream; ``DeviceBatch``
(upload a batch once, decode it often) and turning the kernel's per-row status into
``CorruptDataError``. Imported only when a decode is asked for, so the package imports
without torch or CuPy.
What it is not: frame parsing (``plan.py``), the kernel (``_kernel.cu``) or the file
loader's staging (``container.cuda``).
"""

from __future__ import annotations

import os
import types
from collections.abc import Sequence
from typing import NamedTuple

import cupy as cp
import numpy as np
import torch

from ..._cuda import cuda_device, nvrtc
from . import _layout, bound_desc, check_outputs
from .plan import Batch

STAGE_BYTES = 1024  # _kernel.cu's STAGE: a warp's staging bytes in builds without contexts

# Kernel variants (compile-time options of _kernel.cu; docs/gpu.md). The defaults are the
# builds every decode takes; the private environment variables below override them for
# gpu/kernel_sweep.py's comparisons (read at each launch's construction).
TABLES = 1  # shared table layout: 0 symbol bytes + per-symbol infos, 1 one word per slot
RING_WINDOWS = 8  # 128-byte windows per stream's word ring (a power of 2, >= 4)
LANES = 1  # rANS lanes of each stream a thread holds: 1 (a warp a pair) or 2 (a half-warp)
UNIFORM = 1  # 1: the warp's pair index from its lane 0, so its votes compile without fallback
RENORM = 1  # 1: a byte cursor into rings aligned to their size (a word address in 2 ops)
_ENV_TABLES = "ENTROPYKIT_RANS_TABLES"
_ENV_RING = "ENTROPYKIT_RANS_RING_WINDOWS"
_ENV_LANES = "ENTROPYKIT_RANS_LANES"
_ENV_UNIFORM = "ENTROPYKIT_RANS_UNIFORM"
_ENV_RENORM = "ENTROPYKIT_RANS_RENORM"


class Variant(NamedTuple):
    """The compile-time choices of a build that do not follow from its batch."""

    tables: int = TABLES
    ring: int = RING_WINDOWS
    lanes: int = LANES
    uniform: int = UNIFORM
    renorm: int = RENORM


DEFAULT = Variant()


def variant() -> Variant:
    """The variant of the builds launched now: the module's defaults unless the private
    environment variables name others."""
    v = Variant(int(os.environ.get(_ENV_TABLES, TABLES)),
                int(os.environ.get(_ENV_RING, RING_WINDOWS)),
                int(os.environ.get(_ENV_LANES, LANES)),
                int(os.environ.get(_ENV_UNIFORM, UNIFORM)),
                int(os.environ.get(_ENV_RENORM, RENORM)))
    if v.tables not in (0, 1):
        raise ValueError(f"{_ENV_TABLES} must be 0 or 1, got {v.tables}")
    if v.ring < 4 or v.ring & (v.ring - 1):
        raise ValueError(f"{_ENV_RING} must be a power of 2 >= 4, got {v.ring}")
    if v.lanes not in (1, 2):
        raise ValueError(f"{_ENV_LANES} must be 1 or 2, got {v.lanes}")
    for name, x in ((_ENV_UNIFORM, v.uniform), (_ENV_RENORM, v.renorm)):
        if x not in (0, 1):
            raise ValueError(f"{name} must be 0 or 1, got {x}")
    return v


def lanes_of(cls: bool, v: Variant = DEFAULT) -> int:
    """Lanes a thread of a build holds: classed builds keep one (_kernel.cu)."""
    return 1 if cls else v.lanes


def uniform_of(warps: int, cls: bool, v: Variant = DEFAULT) -> int:
    """UNIFORM of a build: at two lanes a thread it needs whole warps (even ``warps``)."""
    return v.uniform if lanes_of(cls, v) == 1 or warps % 2 == 0 else 0


def table_set_bytes(tables: int) -> int:
    """Bytes of one shared-memory table set (_kernel.cu's SMEM_STREAM)."""
    return 4 * 4096 if tables else 4096 + 1024


def warp_smem(ctx: bool, cls: bool = False, v: Variant = DEFAULT) -> int:
    """Shared-memory bytes a pair of a build uses (a warp's at LANES 1, a half-warp's at 2):
    two word rings of ``v.ring`` windows (+ staging, in builds without contexts or classes,
    _kernel.cu's VEC); RENORM rounds it up to a multiple of a ring (_kernel.cu's
    WARP_SMEM)."""
    n = 256 * v.ring + (0 if ctx or cls else STAGE_BYTES)
    return -(-n // ring_bytes(v)) * ring_bytes(v) if v.renorm else n


def ring_bytes(v: Variant = DEFAULT) -> int:
    """Bytes of one stream's word ring."""
    return 128 * v.ring


def pairs_smem(warps: int, ctx: bool, cls: bool = False, v: Variant = DEFAULT) -> int:
    """Shared-memory bytes of a block's pairs (RENORM: with room to align their area to a
    ring's size)."""
    return warps * warp_smem(ctx, cls, v) + (ring_bytes(v) if v.renorm else 0)


def build_options(bf16: bool, ctx: bool, smem: bool, warps: int, cls: bool = False,
                  v: Variant = DEFAULT) -> tuple[str, ...]:
    """NVRTC options of one build of _kernel.cu."""
    cols = [f"-D{k}={getattr(_layout, k)}" for k in dir(_layout) if k.isupper()]
    return ("--std=c++17", f"-DBF16={int(bf16)}", f"-DCTX={int(ctx)}", f"-DCLS={int(cls)}",
            f"-DSMEM={int(smem)}", f"-DWARPS={warps}", f"-DRING_WINDOWS={v.ring}",
            f"-DTABLES={v.tables}", f"-DLANES={lanes_of(cls, v)}",
            f"-DUNIFORM={uniform_of(warps, cls, v)}", f"-DRENORM={v.renorm}", *cols)


def _kernel(bf16: bool, ctx: bool, smem: bool, warps: int, cls: bool = False,
            v: Variant = DEFAULT) -> cp.RawKernel:
    """The build of a batch's kind (warps per block are the batch's: plan.py lays the rows
    out for them)."""
    def build() -> cp.RawKernel:
        opts = build_options(bf16, ctx, smem, warps, cls, v)
        k = cp.RawKernel(nvrtc.source(__package__, "_kernel.cu"), "rans_decode", options=opts)
        # The most a block of this build may ask for: two table sets and the warps'.
        k.max_dynamic_shared_size_bytes = (2 * table_set_bytes(v.tables)
                                           + pairs_smem(warps, ctx, cls, v))
        return k

    return nvrtc.cached(("rans", bf16, ctx, cls, smem, warps, *v), build)


class Launch:
    """One launch of a batch's kernel with its buffers' device addresses fixed."""

    def __init__(self, b: Batch, device: torch.device, ptrs: Sequence[int]) -> None:
        """``ptrs``: device addresses of desc, status, payload, sym, info, cmaps, output."""
        self.device = device
        self.pairs = len(b.desc) // 2
        # Tables in shared memory: batches with every p <= 12, unless classed (their
        # frames' table sets are read through L1: _kernel.cu).
        smem = b.narrow and not b.classed
        v = variant()
        self.kernel = (_kernel(b.bf16, b.context, smem, b.warps, b.classed, v)
                       if self.pairs else None)
        self.grid = (-(-self.pairs // b.warps),)
        self.block = (32 * b.warps // lanes_of(b.classed, v),)  # b.warps pairs a block
        self.shared = ((b.slots * table_set_bytes(v.tables) if smem else 0)
                       + pairs_smem(b.warps, b.context, b.classed, v))
        self.args = (*(np.uint64(p) for p in ptrs), np.int32(self.pairs), np.int32(b.slots))
        self._fn = None  # the build's function on this device, fetched at the first launch

    def __call__(self) -> None:
        """Enqueue the launch on torch's current stream of its device."""
        with cp.cuda.Device(self.device.index):
            self.on(nvrtc.stream())

    def on(self, stream: cp.cuda.Stream) -> None:
        """Enqueue the launch on ``stream`` (CuPy's view of a stream of this launch's
        device, which must be the current device): one driver call, its arguments bound."""
        if self.kernel is None:
            return
        fn = self._fn
        if fn is None:
            fn = self._fn = self.kernel.kernel
        fn(self.grid, self.block, self.args, shared_mem=self.shared, stream=stream)


class DeviceBatch:
    """A ``Batch`` whose buffers live on a CUDA device; ``decode`` may run many times."""

    def __init__(self, batch: Batch, device: torch.device | str) -> None:
        self.batch = batch
        self.device = cuda_device(device)
        up = lambda a: torch.from_numpy(a).to(self.device)
        self.payload = up(batch.payload)
        self.sym_tables = up(batch.sym_tables)
        self.info_tables = up(batch.info_tables.view(np.int32))
        self.cmaps = up(batch.cmaps)
        self.status = torch.zeros(max(1, len(batch.desc)), dtype=torch.int32,
                                  device=self.device)

    def bind(self, outs: Sequence[torch.Tensor]) -> BoundDecode:
        """Check ``outs`` and fix the launch that decodes into them (call it to run)."""
        check_outputs(self.batch, outs)
        if outs and outs[0].device != self.device:
            raise ValueError(f"outputs are on {outs[0].device}, the batch on {self.device}")
        desc, base = bound_desc(self.batch, outs)
        return BoundDecode(self, torch.from_numpy(desc).to(self.device),
                           self.status if base is None else base)

    def bind_rows(self, desc: torch.Tensor, status: torch.Tensor, out: torch.Tensor,
                  pairs: int) -> Launch:
        """A launch over the first ``pairs`` descriptor pairs of ``desc`` (int64 on the
        device, rows of this batch's with D_OUT relative to ``out``, written there by the
        caller between launches; every block's first pair a live one with the batch's
        tables), ``status`` (int32, ``2 * pairs`` or more) taking their statuses."""
        room = min(desc.numel() // (2 * _layout.N_COLS), status.numel() // 2)
        if not 0 <= pairs <= room:
            raise ValueError(f"{pairs} pairs do not fit the descriptor or status buffer")
        rows = types.SimpleNamespace(
            desc=np.zeros((2 * pairs, 0)), bf16=self.batch.bf16, warps=self.batch.warps,
            slots=self.batch.slots, narrow=self.batch.narrow, classed=self.batch.classed,
            context=self.batch.context)
        launch = Launch(rows, self.device, [x.data_ptr() for x in (
            desc, status, self.payload, self.sym_tables, self.info_tables, self.cmaps, out)])
        launch.held = (desc, status, out)  # alive while the launch may run
        return launch

    def decode(self, outs: Sequence[torch.Tensor], *, check: bool = True) -> None:
        """Decode into ``outs`` (one launch); with ``check``, wait and raise on corrupt data."""
        self.bind(outs)()
        if check:
            self.check()

    def check(self) -> None:
        """Raise ``CorruptDataError`` if the last decode met corrupt data (synchronizes)."""
        err = self.batch.error(self.status[: len(self.batch.desc)].cpu().numpy())
        if err is not None:
            raise err


class BoundDecode(Launch):
    """One decode launch with its outputs fixed: calling it only enqueues the kernel."""

    def __init__(self, db: DeviceBatch, desc: torch.Tensor, base: torch.Tensor) -> None:
        self.desc = desc  # keeps the device descriptor alive while launches use it
        self.outs_alive = base  # the outputs must outlive the launch
        ptrs = [x.data_ptr() for x in (desc, db.status, db.payload, db.sym_tables,
                                       db.info_tables, db.cmaps, base)]
        super().__init__(db.batch, db.device, ptrs)
