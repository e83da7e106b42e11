"""GPU encoder of static rANS frames: the CPU encoder's bytes, coded on the device.

What it is: ``encode`` of a uint8 CUDA tensor (optionally with a context tensor) into
the frame ``rans.static.encode`` writes for the same symbols, byte for byte: the
histogram is counted on the device (torch), the tables are built on the host from it by
the CPU encoder's own functions (``table_section.build``, ``kernels.encode_tables``),
every chunk is coded by ``_encode_kernel.cu`` (one warp a chunk), its CRC-32 taken and
the payloads gathered there; only the histogram, the per-chunk starts and CRCs and the
coded frame cross to the host. ``code`` codes several fields with one transfer of their
histograms and one of their chunks' starts and CRCs, and leaves their payloads on the
device for the caller to gather where it wants them (a decoder's payload buffer). The
kernels sit behind ``Kernels`` so that the CPU suite runs this module with a numpy
emulation of their arithmetic.
What it is not: the decoder (``plan.py`` and ``_kernel.cu``), or a rans2d encoder (its
classes are chosen from the whole field on the host: ``container.classed``).
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """The device half of ``encode`` (CUDA, or the CPU suite's emulation). Device arrays
    are whatever the kernels keep (torch tensors on CUDA); only ``host`` and ``to_host``
    wait for the device."""

    def histogram(self, symbols: Any, context: Any) -> Any:
        """int64[256] counts of the symbols, or with a context int64[256, 256] counts of
        (context, symbol) pairs (a device array)."""

    def host(self, arrays: list) -> list[np.ndarray]:
        """Device arrays of integers on the host (int64), in one transfer."""

    def encode(self, symbols: Any, context: Any, cmap: np.ndarray | None, tabs: np.ndarray,
               chunk: int, precision: int) -> tuple[Any, Any, Any]:
        """(start, crc, job), queued: per chunk ``rans_encode``'s payload start in the
        chunk's slot (-1: raw) and ``chunk_crc``'s CRC-32 of its symbols (device
        arrays), and what ``gather`` reads (the symbols and their slots)."""

    def zeros(self, size: int) -> Any:
        """A device buffer of ``size`` zero bytes."""

    def gather(self, job: Any, start: np.ndarray, offset: np.ndarray, dst: Any) -> None:
        """Queue chunk c's payload (coded from its slot, or its raw symbols) into device
        buffer ``dst`` at ``offset[c]``."""

    def to_host(self, src: Any, dst: Any = None) -> np.ndarray | None:
        """Device bytes ``src`` on the host: a new array (waits), or queued into host
        tensor ``dst`` (pinned on CUDA: nothing waits)."""


@dataclass(frozen=True)
class Coded:
    """A frame coded on the device whose payload area is still there: ``head`` is the
    frame's bytes before it (header, table section, directory), chunk c's payload lies
    at ``offsets[c]`` of the area's ``size`` bytes once gathered (``Kernels.gather`` of
    ``job`` and ``start``)."""

    head: bytes
    offsets: np.ndarray
    lengths: np.ndarray
    size: int
    start: np.ndarray
    job: Any


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
    run = run or _Cuda(symbols.device)
    (c,) = code([(symbols, context)], precision=precision, chunk_size=chunk_size,
                max_tables=max_tables, run=run)
    return c.head + gather(c, run).tobytes()


def gather(c: Coded, run: Kernels) -> np.ndarray:
    """A coded frame's payload area on the host (waits for it)."""
    dst = run.zeros(max(1, c.size))
    run.gather(c.job, c.start, c.offsets, dst)
    return run.to_host(dst)[: c.size]


def code(fields: list[tuple[Any, Any]], *, precision: int = DEFAULT_PRECISION,
         chunk_size: int = frame.DEFAULT_CHUNK,
         max_tables: int = contexts.DEFAULT_MAX_TABLES, run: Kernels) -> list[Coded]:
    """Each (symbols, context or None) field (non-empty) coded on the device as
    ``encode`` codes it, its payloads left there: the fields' histograms come back in one
    transfer, their chunks' starts and CRCs in another."""
    CODER.check_param(precision)
    frame.check_chunk_size(chunk_size, CODER.lanes)
    for symbols, context in fields:
        n = int(symbols.numel())
        if n == 0:
            raise ValueError("a field to code has no symbols")
        if context is not None and int(context.numel()) != n:
            raise ValueError(f"context has {int(context.numel())} values, symbols have {n}")
    hists = run.host([run.histogram(s, c) for s, c in fields])
    built, jobs = [], []
    for (symbols, context), hist in zip(fields, hists, strict=True):
        counts, joint = ((None, hist.reshape(256, 256)) if context is not None
                         else (hist.reshape(256), None))
        freqs, cmap, section = table_section.build(counts, joint, precision, max_tables)
        tabs = kernels.encode_tables(freqs, precision)
        built.append((cmap, section))
        jobs.append(run.encode(symbols, None if cmap is None else context, cmap, tabs,
                               chunk_size, precision))
    back = run.host([j[0] for j in jobs] + [j[1] for j in jobs])
    out = []
    for k, ((symbols, _), (cmap, section), job) in enumerate(zip(fields, built, jobs,
                                                                strict=True)):
        start, crcs = back[k], back[len(fields) + k].astype(np.uint32)
        n = int(symbols.numel())
        n_chunks = start.size
        m = np.minimum(chunk_size, n - np.arange(n_chunks, dtype=np.int64) * chunk_size)
        raw = start < 0
        lengths = np.where(raw, m, m - start)
        offsets = np.cumsum(lengths) - lengths
        head = frame.HEADER.pack(CODER.magic, frame.VERSION, precision, CODER.lanes,
                                 int(cmap is not None), n, chunk_size, n_chunks, len(section))
        modes = np.where(raw, frame.MODE_RAW, frame.MODE_CODED).astype(np.uint8)
        out.append(Coded(b"".join((head, section, lengths.astype("<u4").tobytes(),
                                   crcs.astype("<u4").tobytes(), modes.tobytes())),
                         offsets, lengths, int(lengths.sum()), start, job[2]))
    return out


class _Cuda:
    """``Kernels`` on a CUDA device, on torch's current stream."""

    def __init__(self, device: Any) -> None:
        from . import load_runtime

        load_runtime(device)  # GpuUnavailableError saying what is missing
        import torch

        self.torch = torch
        self.device = device

    def _kernel(self, name: str, ctx: bool) -> Any:
        from ..._cuda import nvrtc

        def build() -> Any:
            import cupy as cp

            return cp.RawKernel(nvrtc.source(__package__, "_encode_kernel.cu"), name,
                                options=("--std=c++17", f"-DCTX={int(ctx)}"))

        return nvrtc.cached(("rans_encode", name, ctx), build)

    def histogram(self, symbols: Any, context: Any) -> Any:
        torch = self.torch
        s = symbols.reshape(-1).to(torch.int32)
        if context is None:
            return torch.bincount(s, minlength=256)
        pairs = context.reshape(-1).to(torch.int32) * 256 + s
        return torch.bincount(pairs, minlength=1 << 16)

    def host(self, arrays: list) -> list[np.ndarray]:
        torch = self.torch
        flat = torch.cat([a.reshape(-1).to(torch.int64) for a in arrays]).cpu().numpy()
        ends = np.cumsum([a.numel() for a in arrays])
        return np.split(flat, ends[:-1])

    def encode(self, symbols: Any, context: Any, cmap: np.ndarray | None, tabs: np.ndarray,
               chunk: int, precision: int) -> tuple[Any, Any, Any]:
        from ..._cuda import nvrtc

        torch, dev = self.torch, symbols.device
        n = symbols.numel()
        n_chunks = -(-n // chunk)
        up = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)
        sym = symbols.reshape(-1)
        slots = torch.empty(n, dtype=torch.uint8, device=dev)
        start = torch.empty(n_chunks, dtype=torch.int64, device=dev)
        crcs = torch.empty(n_chunks, dtype=torch.int32, device=dev)
        ctx = cmap is not None
        t = up(tabs.reshape(-1))
        cm = up(cmap.astype(np.int64)) if ctx else None
        c = context.reshape(-1) if ctx else None
        nvrtc.launch(dev, [
            (self._kernel("rans_encode", ctx), -(-n_chunks // WARPS), 32 * WARPS,
             nvrtc.args(sym, c, cm, t, n, np.int32(chunk), np.int32(n_chunks),
                        np.int32(precision), slots, start), 0),
            (self._kernel("chunk_crc", False), -(-n_chunks // 128), 128,
             nvrtc.args(sym, up(_CRC_TABLE), n, np.int32(chunk), np.int32(n_chunks),
                        crcs), 0)])
        return start, crcs, (sym, slots, chunk)

    def zeros(self, size: int) -> Any:
        return self.torch.zeros(size, dtype=self.torch.uint8, device=self.device)

    def gather(self, job: Any, start: np.ndarray, offset: np.ndarray, dst: Any) -> None:
        from ..._cuda import nvrtc

        torch = self.torch
        sym, slots, chunk = job
        dev = sym.device
        nvrtc.launch(dev, [(self._kernel("gather", False), start.size, GATHER_THREADS,
                            nvrtc.args(sym, slots, torch.from_numpy(start).to(dev),
                                       torch.from_numpy(offset).to(dev), sym.numel(),
                                       np.int32(chunk), dst), 0)])

    def to_host(self, src: Any, dst: Any = None) -> np.ndarray | None:
        if dst is not None:
            dst.copy_(src[: dst.numel()], non_blocking=True)
            return None
        host = self.torch.empty(src.numel(), dtype=self.torch.uint8, pin_memory=True)
        host.copy_(src)
        return host.numpy()
