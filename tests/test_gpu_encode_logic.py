"""The GPU static-frame encoder, on the CPU: its kernels' arithmetic emulated in numpy.

``rans.cuda.encode`` runs its host half (tables from the device histogram with the CPU
encoder's functions, the directory, the frame) for real and its three kernels
(``_encode_kernel.cu``: rans_encode, one warp a chunk with a ballot placing each step's
words; chunk_crc; gather) through ``_Emulator``, which replays each kernel's arithmetic
on the same buffers. Every frame must be the CPU encoder's byte for byte: short last
steps and chunks, chunks stored raw (coded not smaller), contexts with one and several
tables, every precision. gpu/tests/test_cuda_kv_static.py runs the kernels themselves.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from entropykit.coding import frame
from entropykit.predictive import static_kv
from entropykit.rans import static as rans_static
from entropykit.rans.cuda import encode as gpu_encode
from entropykit.rans.lanes import LANES, STATE_BYTES, L


class _Emulator:
    """``gpu_encode.Kernels`` in numpy, step for step as the CUDA kernels compute."""

    def histogram(self, symbols, context):
        s = symbols.numpy().astype(np.int64)
        if context is None:
            return np.bincount(s, minlength=256)
        pairs = context.numpy().astype(np.int64) * 256 + s
        return np.bincount(pairs, minlength=1 << 16).reshape(256, 256)

    def host(self, arrays):
        return [np.asarray(a).astype(np.int64) for a in arrays]

    def encode(self, symbols, context, cmap, tabs, chunk, precision):
        sym = symbols.numpy()
        ctx = None if context is None else context.numpy()
        n = sym.size
        n_chunks = -(-n // chunk)
        slots = np.full(n, 0xA5, np.uint8)  # poison: only written bytes may be read
        start = np.array([self._warp(sym, ctx, cmap, tabs.reshape(-1, 256, 2), c, chunk,
                                     precision, slots) for c in range(n_chunks)], np.int64)
        return start, self._crc(sym, chunk, n_chunks), (sym, slots, chunk)

    def _warp(self, sym, ctx, cmap, tab, c, chunk, precision, slots):
        lane = np.arange(LANES)
        first = c * chunk
        m = min(chunk, sym.size - first)
        out = slots[first : first + m]
        x = np.full(LANES, L, np.uint64)
        words = 0
        full = m - m % LANES
        base = full if m % LANES else full - LANES
        while base >= 0:
            i = base + lane
            live = i < m
            k = np.zeros(LANES, np.int64)
            s = np.zeros(LANES, np.int64)
            s[live] = sym[first + i[live]]
            if ctx is not None:
                k[live] = cmap.astype(np.int64)[ctx[first + i[live]]]
            r0 = np.where(live, tab[k, s, 0], np.uint64(0))
            r1 = np.where(live, tab[k, s, 1], np.uint64(0))
            xs = x.copy()
            emit = live & (xs > (r0 >> np.uint64(32)))
            above = np.cumsum(emit[::-1])[::-1] - emit  # emitting lanes above each lane
            pos = m - 2 * (words + above + 1)
            w = emit & (pos >= STATE_BYTES)
            out[pos[w]] = (xs[w] & np.uint64(0xFF)).astype(np.uint8)
            out[pos[w] + 1] = ((xs[w] >> np.uint64(8)) & np.uint64(0xFF)).astype(np.uint8)
            xs = np.where(emit, xs >> np.uint64(16), xs)
            words += int(emit.sum())
            f = r1 & np.uint64(0xFFFF)
            q = (xs + ((xs * (r0 & np.uint64(0xFFFFFFFF))) >> np.uint64(32))) >> (
                r1 >> np.uint64(32))
            s0 = (r1 >> np.uint64(16)) & np.uint64(0xFFFF)
            new = ((q << np.uint64(precision)) + (xs - q * f) + s0) & np.uint64(0xFFFFFFFF)
            x = np.where(live, new, x)
            base -= LANES
        at = m - 2 * words - STATE_BYTES
        if at < 0:
            return -1
        out[at : at + STATE_BYTES] = x.astype("<u4").view(np.uint8)
        return at

    @staticmethod
    def _crc(sym, chunk, n_chunks):
        table = gpu_encode._CRC_TABLE
        crc = np.full(n_chunks, 0xFFFFFFFF, np.uint32)
        first = np.arange(n_chunks) * chunk
        last = np.minimum(first + chunk, sym.size)
        for j in range(chunk):  # byte j of every chunk that has one, as chunk_crc's threads
            on = first + j < last
            b = sym[(first + j)[on]].astype(np.uint32)
            crc[on] = table[(crc[on] ^ b) & 0xFF] ^ (crc[on] >> np.uint32(8))
        return ~crc

    def zeros(self, size):
        return np.zeros(size, np.uint8)

    def gather(self, job, start, offset, dst):
        sym, slots, chunk = job
        for c, (s, o) in enumerate(zip(start.tolist(), offset.tolist(), strict=True)):
            first = c * chunk
            m = min(chunk, sym.size - first)
            src = sym[first : first + m] if s < 0 else slots[first + s : first + m]
            dst[o : o + src.size] = src

    def to_host(self, src, dst=None):
        if dst is None:
            return src.copy()
        dst.numpy()[:] = src[: dst.numel()]
        return None


def _skewed(rng, n, spread):
    return np.minimum(rng.geometric(spread, n) - 1, 255).astype(np.uint8)


@pytest.mark.parametrize("n, chunk, precision, spread, with_context", [
    (5000, 1024, 12, 0.3, False),  # a short last chunk, a short last step
    (4096, 1024, 12, 0.3, True),
    (1024 + 17, 1024, 8, 0.3, True),  # a last chunk of 17 symbols: one partial step
    (3000, 1056, 15, 0.5, False),
    (31, 1024, 12, 0.3, False),  # fewer symbols than lanes
    (2048, 1024, 11, None, True),  # uniform bytes: coded chunks are not smaller, kept raw
])
def test_frame_is_the_cpu_encoders(n, chunk, precision, spread, with_context):
    rng = np.random.default_rng(n + chunk)
    sym = (rng.integers(0, 256, n).astype(np.uint8) if spread is None
           else _skewed(rng, n, spread))
    ctx = None
    if with_context:  # symbols that depend on their context: a table per context class
        ctx = rng.integers(0, 6, n).astype(np.uint8)
        sym = (sym + 40 * ctx).astype(np.uint8)
    want = rans_static.encode(sym, precision=precision, chunk_size=chunk, threads=1,
                              context=ctx)
    got = gpu_encode.encode(torch.from_numpy(sym), precision=precision, chunk_size=chunk,
                            context=None if ctx is None else torch.from_numpy(ctx),
                            run=_Emulator())
    assert got == want
    info = frame.parse(rans_static.CODER, got)
    if spread is not None:
        assert (info.cmap is not None and info.freqs.shape[0] > 1) == with_context
    if spread is None:  # the emulated kernel found the chunks that do not pay
        assert (frame.parse(rans_static.CODER, got).modes == frame.MODE_RAW).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_a_layers_fields_coded_on_the_device_are_the_cpu_layer(dtype):
    """``static_kv.encode_on_device`` (fields split by torch, frames by the GPU encoder)
    writes ``static_kv.encode(..., classes=False)``'s layer, byte for byte."""
    gen = torch.Generator().manual_seed(6)
    k = (torch.randn(1, 2, 300, 32, generator=gen) * torch.logspace(-2, 1, 32)).to(dtype)
    v = torch.randn(1, 1, 300, 16, generator=gen).to(dtype)
    if dtype == torch.float8_e5m2:
        bits = [t.view(torch.uint8).numpy() for t in (k, v)]
    else:
        bits = [t.view(torch.int16).numpy().view(np.uint16) for t in (k, v)]
    name = str(dtype).removeprefix("torch.")
    want = static_kv.encode(*bits, 1024, classes=False, dtype=name)
    got = static_kv.encode_on_device(k, v, 1024, run=_Emulator())
    assert got == want
    back = static_kv.decode(got)
    assert np.array_equal(back[0], bits[0]) and np.array_equal(back[1], bits[1])


def test_misuse():
    sym = torch.zeros(100, dtype=torch.uint8)
    with pytest.raises(ValueError, match="context has 99 values"):
        gpu_encode.encode(sym, context=sym[:99], run=_Emulator())
    with pytest.raises(ValueError, match="chunk_size"):
        gpu_encode.encode(sym, chunk_size=1000, run=_Emulator())
    empty = gpu_encode.encode(sym[:0], chunk_size=1024, run=_Emulator())
    assert empty == rans_static.encode(np.zeros(0, np.uint8), chunk_size=1024)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_layer_coded_into_the_decoders_buffers_is_the_hosts_gpu_layer(dtype):
    """``static_kv.encode_gpu_layer`` (payloads gathered on the device straight into the
    decode batch's payload buffer, the frames never made) packs exactly the buffers of
    ``GpuLayer(encode_on_device(...))``: descriptors, payload (zeros between payloads),
    tables and maps, byte for byte; its payload decodes (emulated kernel) to the layer."""
    from test_gpu_logic import _emulate

    gen = torch.Generator().manual_seed(7)
    k = (torch.randn(2, 2, 700, 32, generator=gen) * torch.logspace(-2, 1, 32)).to(dtype)
    v = torch.randn(2, 1, 700, 16, generator=gen).to(dtype)
    v.view(-1)[:3000] = 0  # some chunks of one symbol, some raw (fp8's uniform bytes)
    want = static_kv.GpuLayer(static_kv.encode_on_device(k, v, 1024, run=_Emulator()), 2)
    got = static_kv.encode_gpu_layer(k, v, 1024, run=_Emulator(), warps=2)
    assert torch.equal(got.packed, want.packed) and got._parts == want._parts
    assert (got.shapes, got.dtype) == (want.shapes, want.dtype)
    assert np.array_equal(got.batch.desc, want.batch.desc)
    assert np.array_equal(got.origins.origin, want.origins.origin)
    b = dataclasses.replace(got.batch, _cache={"payload": got.payload.numpy()})
    outs, status = _emulate(b)
    assert not status.any()
    flat = torch.cat([k.reshape(-1), v.reshape(-1)])
    assert np.array_equal(outs[0], flat.view(torch.uint8).numpy().view(outs[0].dtype))
