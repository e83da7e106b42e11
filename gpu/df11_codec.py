"""DFloat11 (pip ``dfloat11``) as a benchmark peer: its format, encoded fast, and its kernel.

What it is: a vectorized (torch, CPU or CUDA) twin of ``dfloat11_utils.encode`` - the same
bytes, gaps and output positions, for the same Huffman code table - so that DFloat11's own
decode kernel (``decode.ptx`` from the wheel, launched as ``dfloat11.py`` launches it) can be
timed on gigabytes: the package's encoder is a Python loop over every symbol (~1 us each).
``gpu/bench_gpu.py --df11-selftest`` checks the twin against the package's encoder.
``decode_reference`` reads the same buffers back on the CPU, one code after another
through the package's lookup tables, so that a DFloat11 model can be checked without a GPU.
What it is not: part of entropykit, or a fast or parallel decoder (the kernel's thread
gaps and block positions are not used).

The package is loaded from its files, without ``dfloat11/__init__.py`` (which imports
transformers, accelerate and pkg_resources for the model wrapper this benchmark does not use).
"""

from __future__ import annotations

import importlib.util
import io
import math
import os
from contextlib import redirect_stdout
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit

BYTES_PER_THREAD = 8  # dfloat11.py's constants, which its kernel assumes
THREADS_PER_BLOCK = 512


def package_dir() -> str:
    """Folder of the installed ``dfloat11`` package (found without importing it)."""
    spec = importlib.util.find_spec("dfloat11")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("dfloat11 is not installed")
    return list(spec.submodule_search_locations)[0]


def utils_module():
    """``dfloat11.dfloat11_utils`` (needs torch, numpy, dahuffman, tqdm)."""
    path = os.path.join(package_dir(), "dfloat11_utils.py")
    spec = importlib.util.spec_from_file_location("df11_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Code:
    """A Huffman code over exponent bytes, as DFloat11 builds it (lengths <= 32 bits)."""

    lengths: torch.Tensor  # int64[256]: bits of each exponent's code (0: absent)
    values: torch.Tensor  # int64[256]: the code, right-aligned
    eof: tuple[int, int]  # (bits, value) of the end-of-file code
    luts: torch.Tensor  # uint8 decode tables (get_luts)


def build_code(exponents: torch.Tensor) -> Code:
    """DFloat11's code for these exponent bytes (uint8): get_codec + get_32bit_codec + luts."""
    U = utils_module()
    counts = torch.bincount(exponents.reshape(-1), minlength=256).cpu()  # uint8: no copy
    counter = {int(v): int(c) for v, c in enumerate(counts.tolist()) if c}
    with redirect_stdout(io.StringIO()):  # get_luts prints every table
        codec, _counter, table = U.get_32bit_codec(counter)
        luts = U.get_luts(table)
    lengths = torch.zeros(256, dtype=torch.int64)
    values = torch.zeros(256, dtype=torch.int64)
    for k, (b, v) in codec._table.items():
        if isinstance(k, int):
            lengths[k], values[k] = b, v
    return Code(lengths, values, tuple(codec._table[codec._eof]), luts)


def _gaps_bits(gaps: torch.Tensor) -> torch.Tensor:
    """5 bits a gap, most significant first, packed into bytes (np.packbits' order)."""
    bits = ((gaps.to(torch.int64)[:, None] >> torch.arange(4, -1, -1, device=gaps.device)) & 1)
    bits = bits.reshape(-1).to(torch.uint8)
    pad = -bits.numel() % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=gaps.device)
    return (bits.reshape(-1, 8) * weights).sum(1, dtype=torch.int64).to(torch.uint8)


def encode(exponents: torch.Tensor, code: Code, slice_len: int = 1 << 25
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dfloat11_utils.encode(exponents.tolist(), codec, 8, 512)``, vectorized: returns
    (encoded uint8, packed gaps uint8, output positions uint32), on ``exponents``' device.

    The bit stream is the codes back to back, most significant bit first; if it does not
    end on a byte, the end-of-file code follows and one last byte (zero-padded) is kept.
    Thread k (64 bits) gets the gap from bit 64 k to the first code starting in it; block j
    (512 threads) the index of its first code; both as the package's loop appends them.
    """
    dev = exponents.device
    sym = exponents.reshape(-1).to(torch.int64)
    n = sym.numel()
    blen = code.lengths.to(dev)[sym]
    if bool((blen == 0).any()):
        raise ValueError("an exponent has no code")
    start = torch.cumsum(blen, 0) - blen  # first bit of each code
    total = int(start[-1] + blen[-1])
    rem = total % 8
    n_words = (total + 64) // 32 + 2  # 32-bit big-endian words, room for the EOF code
    words = torch.zeros(n_words, dtype=torch.int64, device=dev)
    vals = code.values.to(dev)

    def place(p: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> None:
        # A code of <= 32 bits at bit p spans word p >> 5 and maybe the next; the pieces
        # never overlap another code's, so adding them is OR-ing them.
        w, o = p >> 5, p & 31
        over = o + b - 32  # bits that spill into the next word (<= 0: none)
        hi = torch.where(over > 0, v >> over.clamp(min=0), v << (-over).clamp(min=0))
        words.index_add_(0, w, hi)
        spill = over > 0
        if bool(spill.any()):
            ov = over[spill]
            lo = (v[spill] & ((1 << ov) - 1)) << (32 - ov)
            words.index_add_(0, w[spill] + 1, lo)

    for a in range(0, n, slice_len):
        s = slice(a, min(n, a + slice_len))
        place(start[s], blen[s], vals[sym[s]])
    if rem:
        eb, ev = code.eof
        one = torch.ones(1, dtype=torch.int64, device=dev)
        place(one * total, one * eb, one * ev)
    be = torch.stack([(words >> sh) & 0xFF for sh in (24, 16, 8, 0)], 1).reshape(-1)
    encoded = be[: total // 8 + (1 if rem else 0)].to(torch.uint8)

    def firsts(unit: int) -> torch.Tensor:
        # Per unit of ``unit`` bits up to the last code's: index of its first code.
        k = torch.arange(int(start[-1]) // unit + 1, dtype=torch.int64, device=dev) * unit
        return torch.searchsorted(start, k)

    t_first = firsts(8 * BYTES_PER_THREAD)
    gaps = start[t_first] - torch.arange(t_first.numel(), device=dev) * 64
    positions = firsts(8 * BYTES_PER_THREAD * THREADS_PER_BLOCK)
    if rem:  # the package's last append, for the unit the stream's end falls in
        if total // 64 + 1 > gaps.numel():
            gaps = torch.cat([gaps, gaps.new_full((1,), total % 64)])
        if total // (64 * THREADS_PER_BLOCK) + 1 > positions.numel():
            positions = torch.cat([positions, positions.new_full((1,), n)])
    positions = torch.cat([positions, positions.new_full((1,), n)])
    blocks = math.ceil(encoded.numel() / (THREADS_PER_BLOCK * BYTES_PER_THREAD))
    gaps = torch.cat([gaps, gaps.new_zeros(max(0, THREADS_PER_BLOCK * blocks - gaps.numel()))])
    return encoded, _gaps_bits(gaps), positions.to(torch.int32)


def other_bits(bf16_bits: torch.Tensor) -> torch.Tensor:
    """DFloat11's uncoded byte: sign bit | 7 mantissa bits, per value (uint8)."""
    w = bf16_bits.to(torch.int32)
    return (((w >> 8) & 0x80) | (w & 0x7F)).to(torch.uint8)


@njit(cache=True)
def _walk(luts: np.ndarray, encoded: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` exponents of ``encoded``: each code's bytes looked up in ``luts``
    (a value of 256 - k points to table k for the next byte; any other is the exponent),
    then the code's length (the last row) skipped. -1 where the stream runs out."""
    tables = luts.shape[0] - 1
    out = np.empty(n, np.int16)
    nbits = encoded.size * 8
    pos = 0
    for i in range(n):
        t = 0
        level = 0
        while True:
            at = pos + 8 * level
            byte = 0
            for k in range(8):  # the 8 bits from ``at``, most significant first; 0 past the end
                b = at + k
                bit = (encoded[b >> 3] >> (7 - (b & 7))) & 1 if b < nbits else 0
                byte = (byte << 1) | bit
            v = int(luts[t, byte])
            if tables > 1 and v > 256 - tables:
                t = 256 - v
                level += 1
                continue
            break
        length = int(luts[tables, v])
        if length == 0 or pos + length > nbits:
            out[i:] = -1
            return out
        out[i] = v
        pos += length
    return out


def decode_reference(luts: torch.Tensor, encoded: torch.Tensor, sign_mantissa: torch.Tensor
                     ) -> torch.Tensor:
    """bf16 values (as int16 bits) of DFloat11's buffers, decoded on the CPU: what its kernel
    writes. ``luts`` as ``get_luts`` returns them, ``encoded`` the code bytes, one
    ``sign_mantissa`` byte a value. Raises ValueError where the codes do not cover every
    value."""
    n = sign_mantissa.numel()
    exp = _walk(luts.cpu().numpy().astype(np.uint8), encoded.cpu().numpy().view(np.uint8), n)
    if n and exp[-1] < 0:
        raise ValueError("DFloat11 codes end before every value is decoded")
    sm = sign_mantissa.cpu().numpy().view(np.uint8).astype(np.int32)
    bits = ((sm & 0x80) << 8) | (exp.astype(np.int32) << 7) | (sm & 0x7F)
    return torch.from_numpy(bits.astype(np.uint16).view(np.int16))


class Kernel:
    """DFloat11's decode kernel on one encoded part (``decode.ptx``, through CuPy)."""

    def __init__(self, code: Code, encoded, gaps, positions, other, out) -> None:
        import cupy as cp

        mod = cp.RawModule(path=os.path.join(package_dir(), "decode.ptx"))
        self.fn = mod.get_function("decode")
        op = positions.cpu().numpy().astype(np.int64)
        self.shared = THREADS_PER_BLOCK * 4 + 4 + int((op[1:] - op[:-1]).max()) * 2
        if self.shared > 48 * 1024:
            self.fn.max_dynamic_shared_size_bytes = self.shared
        self.keep = [code.luts.to(out.device), encoded, other, positions, gaps, out]
        luts = self.keep[0]
        self.grid = (math.ceil(encoded.numel() / (THREADS_PER_BLOCK * BYTES_PER_THREAD)),)
        self.args = (luts.data_ptr(), encoded.data_ptr(), other.data_ptr(),
                     positions.data_ptr(), gaps.data_ptr(), out.data_ptr(),
                     np.uint32(luts.shape[0]), np.uint32(encoded.numel()),
                     np.uint32(out.numel()))
        self.stored = (encoded.numel() + other.numel() + positions.numel() * 4 + gaps.numel()
                       + luts.numel())

    def __call__(self) -> None:
        import cupy as cp

        handle = torch.cuda.current_stream().cuda_stream
        stream = cp.cuda.ExternalStream(handle) if handle else cp.cuda.Stream.null
        with stream:
            self.fn(self.grid, (THREADS_PER_BLOCK,), self.args, shared_mem=self.shared)
