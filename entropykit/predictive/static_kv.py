"""Static-table coding of a layer's keys and values, in the GPU weight decoder's format.

What it is: one layer's bf16 keys and values (each [batch, heads, seq, dim]) coded with
static rANS tables and no predictor, the way bf16 weights are: each tensor split into its
``exponent`` byte and its ``sign_mantissa`` byte (``formats``' BF16 split), the exponents
as a rans2d frame (``container.classed``: the tensor as rows of ``dim`` channels, rows
(batch, head, token) and columns (channels) in classes, one table per pair of classes) or
a one-table rANS frame where classes do not pay, the sign+mantissa bytes as an rANS frame
with one table per exponent class (context: the exponent). ``encode`` makes a
``StaticLayer`` on the host; ``encode_on_device`` the same layer without exponent classes
from CUDA tensors, coded there (``rans.cuda.encode``); ``decode`` reads it back on the
CPU; ``plan`` lays its four frames out as one batch of ``rans.cuda``'s decoder (keys and
values in one launch into one bf16 output), and ``GpuLayer`` keeps only that batch's
buffers (the payload pinned) and decodes it asynchronously on a CUDA stream.
What it is not: a file format (the frames live in memory while a layer is offloaded; each
is a standard frame, docs/format.md) or a per-value coder (``rans.distribution``, which
codes against a predictor's guess).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._cuda import cuda_device
from .._errors import CorruptDataError
from ..coding import frame
from ..container import classed
from ..rans import static as rans_static
from ..rans.cuda import plan as gpu_plan

PRECISION = 12  # tables fit the GPU kernel's shared-memory table sets (<= 12 bits)
# Symbols a chunk: a chunk is one warp's serial work on the GPU, so a layer needs many of
# them to fill it; each costs its 128 bytes of lane states.
CHUNK = 1 << 14


def split(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """bf16 bit patterns (uint16) as (exponent, sign_mantissa) bytes: s eeeeeeee mmmmmmm
    -> eeeeeeee, s mmmmmmm (the BF16 split of ``formats``)."""
    exp = ((bits >> 7) & 0xFF).astype(np.uint8)
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exp, sm


def join(exp: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """``split``'s inverse: uint16 bit patterns."""
    e, m = exp.astype(np.uint16), sm.astype(np.uint16)
    return (m >> 7) << 15 | e << 7 | (m & 0x7F)


@dataclass(frozen=True)
class StaticLayer:
    """One layer's coded keys and values: per tensor (keys, then values) its shape, its
    exponent payload (a rans2d payload where ``classes`` says so, else an rANS frame) and
    its sign_mantissa frame (context: the exponent)."""

    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    exponents: tuple[bytes, bytes]
    classes: tuple[bool, bool]
    sign_mantissas: tuple[bytes, bytes]

    def __len__(self) -> int:
        return sum(len(b) for b in (*self.exponents, *self.sign_mantissas))

    @property
    def sizes(self) -> tuple[int, int]:
        return tuple(int(np.prod(s)) for s in self.shapes)  # type: ignore[return-value]


def _exponent_payload(exp: np.ndarray, width: int, chunk: int, threads: int | None,
                      classes: bool) -> tuple[bytes, bool]:
    """The smaller of a rans2d payload (rows of ``width`` channels, in classes; only if
    ``classes``) and a one-table frame, as (bytes, classed)."""
    plain = frame.encode(rans_static.CODER, exp, PRECISION, chunk, threads)
    p = classed.plan(exp, width, 0) if classes else None
    if p is None or p.estimate >= len(plain) or width > gpu_plan.GRID_MAX_WIDTH:
        return plain, False
    payload = classed.encode(exp, width, 0, p, PRECISION, chunk_size=chunk)
    return (payload, True) if len(payload) < len(plain) else (plain, False)


def encode_tensor(bits: np.ndarray, width: int, chunk: int = CHUNK,
                  threads: int | None = 1, classes: bool = True) -> tuple[bytes, bool, bytes]:
    """One tensor's bf16 bit patterns (uint16, rows of ``width``) as (exponent payload,
    classed, sign_mantissa frame)."""
    exp, sm = split(np.ascontiguousarray(bits).reshape(-1))
    payload, is_classed = _exponent_payload(exp, width, chunk, threads, classes)
    sm_frame = frame.encode(rans_static.CODER, sm, PRECISION, chunk, threads, context=exp)
    return payload, is_classed, sm_frame


def _layer(shapes: list[tuple[int, ...]], coded: list[tuple[bytes, bool, bytes]]
           ) -> StaticLayer:
    return StaticLayer((shapes[0], shapes[1]), (coded[0][0], coded[1][0]),
                       (coded[0][1], coded[1][1]), (coded[0][2], coded[1][2]))


def encode(keys: np.ndarray, values: np.ndarray, chunk: int = CHUNK,
           threads: int | None = 1, classes: bool = True) -> StaticLayer:
    """A layer's keys and values (bf16 bit patterns, uint16 arrays of any shape whose last
    axis is the channels) as a ``StaticLayer``; ``classes``: exponents may be classed
    (else one table each, as ``encode_on_device`` codes them)."""
    return _layer([tuple(keys.shape), tuple(values.shape)],
                  [encode_tensor(t, t.shape[-1], chunk, threads, classes)
                   for t in (keys, values)])


def encode_on_device(keys, values, chunk: int = CHUNK, run=None) -> StaticLayer:
    """``encode(..., classes=False)``'s layer, byte for byte, of bf16 tensors coded where
    they are (a CUDA device: ``rans.cuda.encode``; ``run``: its kernels): only the
    frames cross to the host."""
    import torch

    from ..rans.cuda import encode as gpu_encode

    coded = []
    for t in (keys, values):
        w = t.detach().contiguous().reshape(-1).view(torch.int16).to(torch.int32) & 0xFFFF
        exp = ((w >> 7) & 0xFF).to(torch.uint8)
        sm = (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)
        coded.append((gpu_encode.encode(exp, precision=PRECISION, chunk_size=chunk, run=run),
                      False,
                      gpu_encode.encode(sm, precision=PRECISION, chunk_size=chunk,
                                        context=exp, run=run)))
    return _layer([tuple(keys.shape), tuple(values.shape)], coded)


def _exponents(layer: StaticLayer, kv: int) -> np.ndarray:
    n = layer.sizes[kv]
    data = np.frombuffer(layer.exponents[kv], np.uint8)
    if layer.classes[kv]:
        return classed.decode(data, n)
    return rans_static.decode(data, threads=1, out=np.empty(n, np.uint8))


def decode(layer: StaticLayer) -> tuple[np.ndarray, np.ndarray]:
    """The (keys, values) bit patterns (uint16, their shapes) on the CPU;
    ``CorruptDataError`` for damaged frames."""
    out = []
    for kv in (0, 1):
        exp = _exponents(layer, kv)
        sm = rans_static.decode(layer.sign_mantissas[kv], threads=1,
                                out=np.empty(exp.size, np.uint8), context=exp)
        out.append(join(exp, sm).reshape(layer.shapes[kv]))
    return out[0], out[1]


def _exponent_stream(layer: StaticLayer, kv: int, label: str) -> gpu_plan.Stream:
    data = np.frombuffer(layer.exponents[kv], np.uint8)
    if not layer.classes[kv]:
        return gpu_plan.Stream.frame(data, label)
    n = layer.sizes[kv]
    p = classed.parse(data, n)
    s = gpu_plan.Stream.on_grid(data[p.body:], gpu_plan.Grid(p.cols, p.phase, p.kc, p.rows,
                                                             p.columns), label)
    if s.n != n:
        raise CorruptDataError(f"{label}: frame holds {s.n} symbols, the tensor has {n}")
    return s


def plan(layer: StaticLayer, warps: int = gpu_plan.WARPS) -> gpu_plan.Batch:
    """The decode batch of a layer (bf16 mode, one output: keys then values, flat)."""
    p = gpu_plan.Planner(True, warps)
    at = 0
    for kv, name in enumerate(("keys", "values")):
        exp = _exponent_stream(layer, kv, f"{name} exponent")
        sm = gpu_plan.Stream.frame(layer.sign_mantissas[kv], f"{name} sign_mantissa")
        p.add_pair(exp, sm, gpu_plan.Place(0, at))
        at += layer.sizes[kv]
    return p.finish([at])


class GpuLayer:
    """A layer's decode batch without its frames: the buffers the kernel reads, in pinned
    host memory where CUDA is. ``start(device)`` queues their upload and the decode on
    the current CUDA stream."""

    def __init__(self, layer: StaticLayer, warps: int = gpu_plan.WARPS) -> None:
        import torch

        b = plan(layer, warps)
        pin = torch.cuda.is_available()
        host = lambda a: (torch.from_numpy(a).pin_memory() if pin else torch.from_numpy(a))
        # One output, keys then values: the descriptors' output offsets need no binding.
        self.payload, self.desc, self.sym, self.info, self.cmaps = (
            host(a) for a in (b.payload, b.desc, b.sym_tables, b.info_tables.view(np.int32),
                              b.cmaps))
        self.origins = b.origins
        self.batch = dataclasses.replace(b, streams=(), copies=np.zeros((0, 4), np.int64),
                                         _cache={})
        self.shapes = layer.shapes

    def __len__(self) -> int:
        """Host bytes kept: the buffers and what names the rows in errors."""
        return (sum(t.numel() * t.element_size() for t in (self.payload, self.desc, self.sym,
                                                            self.info, self.cmaps))
                + self.origins.origin.nbytes)

    def start(self, device) -> tuple[object, object, Callable[[], None]]:
        """(keys, values, check): bf16 tensors on ``device`` queued on the current stream;
        ``check()`` waits for the decode and raises ``CorruptDataError`` for a bad chunk."""
        import torch

        from ..rans.cuda import load_runtime

        rt = load_runtime(device)
        dev = cuda_device(device)
        bufs = [t.to(dev, non_blocking=True) for t in (self.desc, self.payload, self.sym,
                                                      self.info, self.cmaps)]
        out = torch.empty(self.batch.sizes[0], dtype=torch.bfloat16, device=dev)
        status = torch.zeros(max(1, len(self.batch.desc)), dtype=torch.int32, device=dev)
        desc, payload, sym, info, cmaps = bufs
        rt.Launch(self.batch, dev, [x.data_ptr() for x in (desc, status, payload, sym, info,
                                                           cmaps, out)])()
        # The statuses come back behind the launch on its stream; the inputs stay alive
        # (and out of the allocator's reach) until the check has seen it finish.
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        done = torch.cuda.Event()
        with torch.cuda.device(dev):
            host.copy_(status, non_blocking=True)
            done.record()
        held = [bufs, status]

        def check() -> None:
            done.synchronize()
            held.clear()
            err = self.origins.error(host[: len(self.batch.desc)].numpy())
            if err is not None:
                raise err

        nk = int(np.prod(self.shapes[0]))
        return out[:nk].view(self.shapes[0]), out[nk:].view(self.shapes[1]), check
