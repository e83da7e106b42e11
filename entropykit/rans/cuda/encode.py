"""GPU encoder of static rANS frames: the CPU encoder's bytes, coded on the device.

What it is: ``encode`` of a uint8 CUDA tensor (optionally with a context tensor) into
the frame ``rans.static.encode`` writes for the same symbols, byte for byte: the
histogram is counted on the device (torch), the tables are built on the host from it by
the CPU encoder's own functions (``table_section.build``, ``kernels.encode_tables``),
every chunk is coded by ``_encode_kernel.cu`` (one warp a chunk), its CRC-32 taken and
the payloads gathered there; only the histogram, the per-chunk starts and CRCs and the
coded frame cross to the host. The kernels sit behind ``Kernels`` so that the CPU suite
runs this module with a numpy emulation of their arithmetic.
What it is not: the decoder (``plan.py`` and ``_kernel.cu``), or a rans2d encoder (its
classes are chosen from the whole field on the host: ``container.classed``).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ...coding import contexts, frame, table_section
from .. import kernels
from ..static import CODER, DEFAULT_PRECISION

WARPS = 8  # chunks a block of rans_encode codes
GATHER_THREADS = 256

# zlib's CRC-32 table (reflected 0xEDB88320), for the device's byte-at-a-time CRC.
_CRC_TABLE = np.array([
    (lambda c: [c := (c >> 1) ^ (0xEDB88320 if c & 1 else 0) for _ in range(8)][-1])(i)
    for i in range(256)], np.uint32)


class Kernels(Protocol):
    """The device half of ``encode`` (CUDA, or the CPU suite's emulation)."""

    def histogram(self, symbols: Any, context: Any) -> np.ndarray:
        """int64[256] counts of the symbols, or with a context int64[256, 256] counts of
        (context, symbol) pairs."""

    def encode(self, symbols: Any, context: Any, cmap: np.ndarray | None, tabs: np.ndarray,
               chunk: int, precision: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, crc) per chunk: ``rans_encode``'s payload start in the chunk's slot
        (-1: raw) and ``chunk_crc``'s CRC-32 of its symbols."""

    def gather(self, start: np.ndarray, offset: np.ndarray, size: int) -> np.ndarray:
        """The payload area (uint8[size], host): chunk c's payload at ``offset[c]``."""


def encode(symbols: Any, *, precision: int = DEFAULT_PRECISION,
           chunk_size: int = frame.DEFAULT_CHUNK, context: Any = None,
           max_tables: int = contexts.DEFAULT_MAX_TABLES, run: Kernels | None = None
           ) -> bytes:
    """``rans.static.encode(symbols, precision=, chunk_size=, context=, max_tables=)``'s
    frame, coded where ``symbols`` (a 1-D uint8 CUDA tensor; ``context`` one like it, or
    None) live. ``run``: the kernels (default: CUDA on the symbols' device)."""
    CODER.check_param(precision)
    frame.check_chunk_size(chunk_size, CODER.lanes)
    n = int(symbols.numel())
    if context is not None and int(context.numel()) != n:
        raise ValueError(f"context has {int(context.numel())} values, symbols have {n}")
    if n == 0:
        return frame.encode(CODER, np.zeros(0, np.uint8), precision, chunk_size)
    if run is None:
        run = _Cuda(symbols.device)
    hist = run.histogram(symbols, context)
    counts, joint = (None, hist) if context is not None else (hist, None)
    freqs, cmap, section = table_section.build(counts, joint, precision, max_tables)
    tabs = kernels.encode_tables(freqs, precision)
    start, crcs = run.encode(symbols, None if cmap is None else context, cmap, tabs,
                             chunk_size, precision)
    n_chunks = start.size
    m = np.minimum(chunk_size, n - np.arange(n_chunks, dtype=np.int64) * chunk_size)
    raw = start < 0
    lengths = np.where(raw, m, m - start)
    offsets = np.cumsum(lengths) - lengths
    payload = run.gather(start, offsets, int(lengths.sum()))
    head = frame.HEADER.pack(CODER.magic, frame.VERSION, precision, CODER.lanes,
                             int(cmap is not None), n, chunk_size, n_chunks, len(section))
    modes = np.where(raw, frame.MODE_RAW, frame.MODE_CODED).astype(np.uint8)
    return b"".join((head, section, lengths.astype("<u4").tobytes(),
                     crcs.astype("<u4").tobytes(), modes.tobytes(), memoryview(payload)))


class _Cuda:
    """``Kernels`` on a CUDA device, on torch's current stream."""

    def __init__(self, device: Any) -> None:
        from . import load_runtime

        load_runtime(device)  # GpuUnavailableError saying what is missing
        import torch

        self.torch = torch
        self.device = device
        self.slots = self.symbols = None

    def _kernel(self, name: str, ctx: bool) -> Any:
        from ..._cuda import nvrtc

        def build() -> Any:
            import cupy as cp

            return cp.RawKernel(nvrtc.source(__package__, "_encode_kernel.cu"), name,
                                options=("--std=c++17", f"-DCTX={int(ctx)}"))

        return nvrtc.cached(("rans_encode", name, ctx), build)

    def histogram(self, symbols: Any, context: Any) -> np.ndarray:
        torch = self.torch
        s = symbols.reshape(-1).to(torch.int32)
        if context is None:
            return torch.bincount(s, minlength=256).cpu().numpy().astype(np.int64)
        pairs = context.reshape(-1).to(torch.int32) * 256 + s
        return torch.bincount(pairs, minlength=1 << 16).cpu().numpy().astype(
            np.int64).reshape(256, 256)

    def encode(self, symbols: Any, context: Any, cmap: np.ndarray | None, tabs: np.ndarray,
               chunk: int, precision: int) -> tuple[np.ndarray, np.ndarray]:
        from ..._cuda import nvrtc

        torch, dev = self.torch, symbols.device
        n = symbols.numel()
        n_chunks = -(-n // chunk)
        up = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
        self.symbols = symbols.reshape(-1)
        self.slots = torch.empty(n, dtype=torch.uint8, device=dev)
        self.chunk, self.n = chunk, n
        start = torch.empty(n_chunks, dtype=torch.int64, device=dev)
        crcs = torch.empty(n_chunks, dtype=torch.int32, device=dev)
        ctx = cmap is not None
        t = up(tabs.reshape(-1))
        cm = up(cmap.astype(np.int64)) if ctx else None
        c = context.reshape(-1) if ctx else None
        nvrtc.launch(dev, [
            (self._kernel("rans_encode", ctx), -(-n_chunks // WARPS), 32 * WARPS,
             nvrtc.args(self.symbols, c, cm, t, n, np.int32(chunk), np.int32(n_chunks),
                        np.int32(precision), self.slots, start), 0),
            (self._kernel("chunk_crc", False), -(-n_chunks // 128), 128,
             nvrtc.args(self.symbols, up(_CRC_TABLE), n, np.int32(chunk),
                        np.int32(n_chunks), crcs), 0)])
        return start.cpu().numpy(), crcs.cpu().numpy().view(np.uint32)

    def gather(self, start: np.ndarray, offset: np.ndarray, size: int) -> np.ndarray:
        from ..._cuda import nvrtc

        torch, dev = self.torch, self.symbols.device
        dst = torch.empty(max(1, size), dtype=torch.uint8, device=dev)
        nvrtc.launch(dev, [(self._kernel("gather", False), start.size, GATHER_THREADS,
                            nvrtc.args(self.symbols, self.slots,
                                       torch.from_numpy(start).to(dev),
                                       torch.from_numpy(offset).to(dev), self.n,
                                       np.int32(self.chunk), dst), 0)])
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host.copy_(dst[:size])
        self.slots = self.symbols = None
        return host.numpy()
