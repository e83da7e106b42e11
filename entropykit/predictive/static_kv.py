"""Static-table coding of a layer's keys and values, in the GPU weight decoder's format.

What it is: one layer's keys and values (each [batch, heads, seq, dim]; bf16, fp16 or fp8)
coded with static rANS tables and no predictor, the way weights are: each tensor split
into byte fields (``split``: bf16 into its ``exponent`` and ``sign_mantissa`` bytes, fp16
into its two bytes, fp8 one byte), the high field as a rans2d frame
(``container.classed``: the tensor as rows of ``dim`` channels, rows (batch, head, token)
and columns (channels) in classes, one table per pair of classes) or a one-table rANS
frame where classes do not pay, the low field as an rANS frame (bf16: one table per
exponent class, its context the exponent). ``encode`` makes a ``StaticLayer`` on the host;
``encode_on_device`` the same layer without classes from CUDA tensors, coded there
(``rans.cuda.encode``); ``decode`` reads it back on the CPU; ``plan`` lays its frames out
as one batch of ``rans.cuda``'s decoder (keys and values in one launch into one output),
and ``GpuLayer`` keeps only that batch's buffers (pinned) and decodes it asynchronously on
a CUDA stream.
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


# The dtypes coded, by torch's name: their split into a high field (rows of channels,
# classed where that pays) and a low one (None: one byte a value), and the kernel's mode.
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8",
          "float8_e5m2": "fp8"}


def split(bits: np.ndarray, kind: str = "bf16") -> tuple[np.ndarray, np.ndarray | None]:
    """Bit patterns (uint16; uint8 for fp8) as (high, low) byte fields: bf16 s eeeeeeee
    mmmmmmm as (eeeeeeee, s mmmmmmm) (the BF16 split of ``formats``: the low field is coded
    per exponent), fp16 as its two bytes (``formats``' F16 planes), fp8 as itself."""
    if kind == "fp8":
        return bits.astype(np.uint8), None
    if kind == "fp16":
        return (bits >> 8).astype(np.uint8), (bits & 0xFF).astype(np.uint8)
    exp = ((bits >> 7) & 0xFF).astype(np.uint8)
    sm = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8)
    return exp, sm


def join(high: np.ndarray, low: np.ndarray | None, kind: str = "bf16") -> np.ndarray:
    """``split``'s inverse."""
    if kind == "fp8":
        return high.copy()
    h, m = high.astype(np.uint16), low.astype(np.uint16)
    if kind == "fp16":
        return h << 8 | m
    return (m >> 7) << 15 | h << 7 | (m & 0x7F)


@dataclass(frozen=True)
class StaticLayer:
    """One layer's coded keys and values (torch ``dtype`` name, a key of ``DTYPES``): per
    tensor (keys, then values) its shape, its high field's payload (a rans2d payload where
    ``classes`` says so, else an rANS frame) and its low field's frame (bf16: context the
    exponent; fp8: None)."""

    dtype: str
    shapes: tuple[tuple[int, ...], tuple[int, ...]]
    high: tuple[bytes, bytes]
    classes: tuple[bool, bool]
    low: tuple[bytes | None, bytes | None]

    def __len__(self) -> int:
        return sum(len(b) for b in (*self.high, *self.low) if b is not None)

    @property
    def kind(self) -> str:
        return DTYPES[self.dtype]

    @property
    def sizes(self) -> tuple[int, int]:
        return tuple(int(np.prod(s)) for s in self.shapes)  # type: ignore[return-value]


def _high_payload(high: np.ndarray, width: int, chunk: int, threads: int | None,
                  classes: bool) -> tuple[bytes, bool]:
    """The smaller of a rans2d payload (rows of ``width`` channels, in classes; only if
    ``classes``) and a one-table frame, as (bytes, classed)."""
    plain = frame.encode(rans_static.CODER, high, PRECISION, chunk, threads)
    p = classed.plan(high, width, 0) if classes else None
    if p is None or p.estimate >= len(plain) or width > gpu_plan.GRID_MAX_WIDTH:
        return plain, False
    payload = classed.encode(high, width, 0, p, PRECISION, chunk_size=chunk)
    return (payload, True) if len(payload) < len(plain) else (plain, False)


def encode_tensor(bits: np.ndarray, width: int, kind: str = "bf16", chunk: int = CHUNK,
                  threads: int | None = 1, classes: bool = True
                  ) -> tuple[bytes, bool, bytes | None]:
    """One tensor's bit patterns (rows of ``width``) as (high payload, classed, low
    frame)."""
    high, low = split(np.ascontiguousarray(bits).reshape(-1), kind)
    payload, is_classed = _high_payload(high, width, chunk, threads, classes)
    ctx = high if kind == "bf16" else None
    low_frame = None if low is None else frame.encode(rans_static.CODER, low, PRECISION,
                                                      chunk, threads, context=ctx)
    return payload, is_classed, low_frame


def _layer(dtype: str, shapes: list[tuple[int, ...]],
           coded: list[tuple[bytes, bool, bytes | None]]) -> StaticLayer:
    return StaticLayer(dtype, (shapes[0], shapes[1]), (coded[0][0], coded[1][0]),
                       (coded[0][1], coded[1][1]), (coded[0][2], coded[1][2]))


def _check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise TypeError(f"static tables code {sorted(DTYPES)} caches, got {dtype}")
    return DTYPES[dtype]


def encode(keys: np.ndarray, values: np.ndarray, chunk: int = CHUNK,
           threads: int | None = 1, classes: bool = True, dtype: str = "bfloat16"
           ) -> StaticLayer:
    """A layer's keys and values (bit patterns of torch dtype ``dtype``: uint16 arrays,
    uint8 for fp8, of any shape whose last axis is the channels) as a ``StaticLayer``;
    ``classes``: high fields may be classed (else one table each, as ``encode_on_device``
    codes them)."""
    kind = _check_dtype(dtype)
    return _layer(dtype, [tuple(keys.shape), tuple(values.shape)],
                  [encode_tensor(t, t.shape[-1], kind, chunk, threads, classes)
                   for t in (keys, values)])


def _device_fields(keys, values) -> tuple[str, list[tuple[object, object]]]:
    """(dtype name, fields): the byte fields of a layer's torch tensors, split where they
    lie, as (symbols, context or None), keys' then values', high field then low field
    (``split``'s, by torch ops)."""
    import torch

    dtype = str(keys.dtype).removeprefix("torch.")
    kind = _check_dtype(dtype)
    if values.dtype != keys.dtype:
        raise TypeError(f"keys are {keys.dtype}, values {values.dtype}")
    fields = []
    for t in (keys, values):
        flat = t.detach().contiguous().reshape(-1)
        if kind == "fp8":
            fields.append((flat.view(torch.uint8), None))
            continue
        w = flat.view(torch.int16).to(torch.int32) & 0xFFFF
        if kind == "fp16":
            fields += [((w >> 8).to(torch.uint8), None), ((w & 0xFF).to(torch.uint8), None)]
            continue
        exp = ((w >> 7) & 0xFF).to(torch.uint8)
        fields += [(exp, None), ((((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8), exp)]
    return dtype, fields


def _device_layer(keys, values, frames: list) -> StaticLayer:
    """The ``StaticLayer`` of ``_device_fields``' fields coded as ``frames`` (bytes, or
    arrays of a frame's size: their order)."""
    dtype = str(keys.dtype).removeprefix("torch.")
    per = 1 if DTYPES[dtype] == "fp8" else 2
    coded = [(frames[per * kv], False, frames[per * kv + 1] if per == 2 else None)
             for kv in (0, 1)]
    return _layer(dtype, [tuple(keys.shape), tuple(values.shape)], coded)


def _coded(keys, values, chunk: int, run):
    from ..rans.cuda import encode as gpu_encode

    dtype, fields = _device_fields(keys, values)
    run = run or gpu_encode._Cuda(keys.device)
    return run, gpu_encode.code(fields, precision=PRECISION, chunk_size=chunk, run=run)


def encode_on_device(keys, values, chunk: int = CHUNK, run=None) -> StaticLayer:
    """``encode(..., classes=False)``'s layer, byte for byte, of torch tensors coded where
    they are (a CUDA device: ``rans.cuda.encode``; ``run``: its kernels): only the
    frames cross to the host."""
    from ..rans.cuda import encode as gpu_encode

    run, coded = _coded(keys, values, chunk, run)
    return _device_layer(keys, values,
                         [c.head + gpu_encode.gather(c, run).tobytes() for c in coded])


def encode_gpu_layer(keys, values, chunk: int = CHUNK, run=None,
                     warps: int = gpu_plan.WARPS) -> GpuLayer:
    """``GpuLayer(encode_on_device(keys, values, chunk))``, byte for byte, without its
    frames ever being made: the fields are coded on the device, the decode batch is
    planned from their headers and directories alone, and the chunks' payloads are
    gathered on the device straight into the batch's payload buffer, which is queued to
    the layer's pinned host buffer (nothing waits for that copy: work queued after it on
    the stream, such as a prefetch's upload, sees it done)."""
    run, coded = _coded(keys, values, chunk, run)
    # each frame's bytes before its payload, then room for the payload that is never read
    skeletons = []
    for c in coded:
        sk = np.empty(len(c.head) + c.size, np.uint8)
        sk[: len(c.head)] = np.frombuffer(c.head, np.uint8)
        skeletons.append(sk)
    layer = _device_layer(keys, values, skeletons)
    b = plan(layer, warps)
    g = GpuLayer._of(b, layer.shapes, layer.dtype)
    dst = run.zeros(b.payload_size)
    for f, c in enumerate(coded):
        s = next(i for i, st in enumerate(b.streams)
                 if st.data.ctypes.data == skeletons[f].ctypes.data)
        rows = b.copies[b.copies[:, 0] == s]
        chunk_of = np.searchsorted(c.offsets, rows[:, 1] - len(c.head))
        if (len(rows) != len(c.offsets) or not np.array_equal(np.sort(chunk_of),
                                                              np.arange(len(c.offsets)))
                or not np.array_equal(c.lengths[chunk_of], rows[:, 3])):
            raise AssertionError("the plan's payload copies are not the coded chunks")
        at = np.empty(len(c.offsets), np.int64)
        at[chunk_of] = rows[:, 2]
        run.gather(c.job, c.start, at, dst)
    run.to_host(dst, g.payload)
    return g


def _high(layer: StaticLayer, kv: int) -> np.ndarray:
    n = layer.sizes[kv]
    data = np.frombuffer(layer.high[kv], np.uint8)
    if layer.classes[kv]:
        return classed.decode(data, n)
    return rans_static.decode(data, threads=1, out=np.empty(n, np.uint8))


def decode(layer: StaticLayer) -> tuple[np.ndarray, np.ndarray]:
    """The (keys, values) bit patterns (uint16, uint8 for fp8; their shapes) on the CPU;
    ``CorruptDataError`` for damaged frames."""
    out = []
    kind = layer.kind
    for kv in (0, 1):
        high = _high(layer, kv)
        low = None
        if kind != "fp8":
            if layer.low[kv] is None:
                raise CorruptDataError(f"a {layer.dtype} layer without its low field")
            low = rans_static.decode(layer.low[kv], threads=1,
                                     out=np.empty(high.size, np.uint8),
                                     context=high if kind == "bf16" else None)
        out.append(join(high, low, kind).reshape(layer.shapes[kv]))
    return out[0], out[1]


def _high_stream(layer: StaticLayer, kv: int, label: str) -> gpu_plan.Stream:
    data = np.frombuffer(layer.high[kv], np.uint8)
    n = layer.sizes[kv]
    if not layer.classes[kv]:
        s = gpu_plan.Stream.frame(data, label)
    else:
        p = classed.parse(data, n)
        s = gpu_plan.Stream.on_grid(data[p.body:], gpu_plan.Grid(p.cols, p.phase, p.kc,
                                                                 p.rows, p.columns), label)
    if s.n != n:
        raise CorruptDataError(f"{label}: frame holds {s.n} symbols, the tensor has {n}")
    return s


def _low_stream(layer: StaticLayer, kv: int, label: str) -> gpu_plan.Stream:
    if layer.low[kv] is None:
        raise CorruptDataError(f"{label}: missing")
    s = gpu_plan.Stream.frame(layer.low[kv], label)
    if s.n != layer.sizes[kv]:
        raise CorruptDataError(f"{label}: frame holds {s.n} symbols, the tensor has "
                               f"{layer.sizes[kv]}")
    if s.context and layer.kind != "bf16":
        raise CorruptDataError(f"{label}: context-conditioned, the {layer.dtype} split "
                               "has no context")
    return s


def plan(layer: StaticLayer, warps: int = gpu_plan.WARPS) -> gpu_plan.Batch:
    """The decode batch of a layer, one output: keys then values, flat (bf16 mode for
    bf16; else bytes, fp16's two fields interleaved into its 16-bit values)."""
    kind = layer.kind
    p = gpu_plan.Planner(kind == "bf16", warps)
    at = 0
    for kv, name in enumerate(("keys", "values")):
        what = "exponent" if kind == "bf16" else "high byte"
        high = _high_stream(layer, kv, f"{name} {what}")
        if kind == "bf16":
            p.add_pair(high, _low_stream(layer, kv, f"{name} sign_mantissa"),
                       gpu_plan.Place(0, at))
        elif kind == "fp16":
            p.add(high, gpu_plan.Place(0, 2 * at + 1, 2))
            p.add(_low_stream(layer, kv, f"{name} low byte"), gpu_plan.Place(0, 2 * at, 2))
        else:
            p.add(high, gpu_plan.Place(0, at))
        at += layer.sizes[kv]
    return p.finish([2 * at if kind == "fp16" else at])


class DecodeCheck:
    """A queued decode's check: ``ready()`` says without waiting whether the decode has
    run; calling it waits for the decode and raises ``CorruptDataError`` for a bad chunk."""

    def __init__(self, ready: Callable[[], bool], wait: Callable[[], object]) -> None:
        self.ready, self._wait = ready, wait

    def __call__(self) -> None:
        self._wait()


_ALIGN = 256  # bytes: each buffer's offset in the packed upload (any dtype's alignment)


class GpuLayer:
    """A layer's decode batch without its frames: the buffers the kernel reads, packed
    into one host buffer (pinned where CUDA is) so that a decode uploads them in one
    copy. ``start(device)`` queues that copy and the decode on the current CUDA stream."""

    def __init__(self, layer: StaticLayer, warps: int = gpu_plan.WARPS) -> None:
        b = plan(layer, warps)
        self._pack(b, layer.shapes, layer.dtype)
        self.payload.zero_()
        b.fill(self.payload.numpy())

    @classmethod
    def _of(cls, b: gpu_plan.Batch, shapes, dtype: str) -> GpuLayer:
        """A layer of batch ``b`` whose payload buffer (every byte of it, zeros between
        payloads) the caller writes."""
        g = cls.__new__(cls)
        g._pack(b, shapes, dtype)
        return g

    def _pack(self, b: gpu_plan.Batch, shapes, dtype: str) -> None:
        import torch

        parts = [np.ascontiguousarray(a).view(np.uint8).reshape(-1)
                 for a in (b.desc, b.sym_tables, b.info_tables.view(np.int32), b.cmaps)]
        parts.insert(1, None)  # the payload: filled by the caller
        sizes = np.array([b.payload_size if p is None else p.size for p in parts], np.int64)
        padded = -(-sizes // _ALIGN) * _ALIGN
        starts = np.cumsum(padded) - padded
        packed = torch.empty(int(padded.sum()), dtype=torch.uint8,
                             pin_memory=torch.cuda.is_available())
        view = packed.numpy()
        for p, at, n, room in zip(parts, starts, sizes, padded, strict=True):
            if p is not None:
                view[at : at + n] = p
            view[at + n : at + room] = 0  # deterministic bytes throughout
        self.packed = packed
        # (offset, bytes, dtype) of desc, payload, sym, info, cmaps in ``packed``
        self._parts = [(int(at), int(n), d) for at, n, d in zip(
            starts, sizes, (torch.int64, torch.uint8, torch.uint8, torch.int32, torch.uint8),
            strict=True)]
        self.payload = self.buffers(packed)[1]  # a view: where the coded bytes lie
        self.origins = b.origins
        # One output, keys then values: the descriptors' output offsets need no binding.
        self.batch = dataclasses.replace(b, streams=(), copies=np.zeros((0, 4), np.int64),
                                         _cache={})
        self.shapes, self.dtype = shapes, dtype

    def __len__(self) -> int:
        """Host bytes kept: the packed buffers and what names the rows in errors."""
        return self.packed.numel() + self.origins.origin.nbytes

    def buffers(self, packed):
        """(desc, payload, sym, info, cmaps): views of ``packed`` (this layer's packed
        buffer, wherever it lies) as the kernel's typed buffers."""
        return [packed[at : at + n].view(d) for at, n, d in self._parts]

    def start(self, device) -> tuple[object, object, DecodeCheck]:
        """(keys, values, check): tensors of the layer's dtype on ``device`` queued on the
        current stream behind one upload of the packed buffers; ``check()`` waits for the
        decode and raises ``CorruptDataError`` for a bad chunk (``check.ready()`` asks
        without waiting)."""
        import torch

        from ..rans.cuda import load_runtime

        rt = load_runtime(device)
        dev = cuda_device(device)
        packed = self.packed.to(dev, non_blocking=True)
        desc, payload, sym, info, cmaps = self.buffers(packed)
        out = torch.empty(self.batch.sizes[0], device=dev,
                          dtype=torch.bfloat16 if self.batch.bf16 else torch.uint8)
        status = torch.zeros(max(1, len(self.batch.desc)), dtype=torch.int32, device=dev)
        rt.Launch(self.batch, dev, [x.data_ptr() for x in (desc, status, payload, sym, info,
                                                           cmaps, out)])()
        # The statuses come back behind the launch on its stream. The inputs are not kept:
        # they were allocated on this stream, so memory they free is reused only by work
        # queued after the launch on it (a check that waits long keeps nothing on the GPU).
        host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
        done = torch.cuda.Event()
        with torch.cuda.device(dev):
            host.copy_(status, non_blocking=True)
            done.record()

        def wait() -> None:
            done.synchronize()
            err = self.origins.error(host[: len(self.batch.desc)].numpy())
            if err is not None:
                raise err

        out = out.view(getattr(torch, self.dtype))
        nk = int(np.prod(self.shapes[0]))
        return (out[:nk].view(self.shapes[0]), out[nk:].view(self.shapes[1]),
                DecodeCheck(done.query, wait))
