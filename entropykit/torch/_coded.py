"""Weights coded for resident decoding: a tensor's fields as rANS frames or plain bytes.

What it is: the host half of resident mode, with no GPU. ``code_tensor`` splits a tensor
(``entropykit.formats``) and codes each field as the GPU decoder reads fastest: static
rANS at 12-bit precision (tables fit shared memory) in chunks of ``GPU_CHUNK`` symbols
by default (smaller chunks: more warps decode a tensor at once, for a little more
payload), without context tables, a field kept plain where coding saves less than
``GPU_MIN_SAVING`` (the choices ``target="gpu"`` files make). ``decode_into`` is the CPU
decoder of one tensor.
What it is not: where tensors live or when they are decoded (``_resident.py``), or the
GPU launches (``_cuda.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import formats, rans
from ..container.codecs import GPU_CHUNK, GPU_MIN_SAVING, RANS_PRECISION

# torch dtype -> the format name ``entropykit.formats`` splits it by. BF16 goes to the
# GPU decoder's bf16 mode (exponent and sign_mantissa fields); the others are byte planes.
FORMATS = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
ALIGN = 512  # scratch offsets: the caching allocator's alignment, so kernels see the same


@dataclass(frozen=True, eq=False)
class Field:
    """One field of a coded tensor: an rANS frame (``coded``) or its symbols as they are."""

    name: str  # the split's field name: "exponent", "sign_mantissa", "byte0", ...
    data: np.ndarray  # uint8: the frame, or the symbols
    coded: bool

    @property
    def byte(self) -> int:
        """The byte of an element a byte-plane field lands in (``byteK``: K)."""
        return int(self.name[4:])


@dataclass(frozen=True, eq=False)
class CodedTensor:
    """A weight as it stays on the device: its fields, and where it decodes to."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes into its unit's scratch region (a multiple of ALIGN)
    fields: tuple[Field, ...]

    @property
    def format(self) -> str:
        return FORMATS[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.itemsize

    @property
    def pair(self) -> bool:
        """Decoded in the GPU decoder's bf16 mode (exponent + sign_mantissa)."""
        return self.dtype == torch.bfloat16

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def view(self, region: torch.Tensor) -> torch.Tensor:
        """The tensor's place in its unit's scratch region (uint8), as its dtype and shape."""
        return region[self.offset : self.end].view(self.dtype).view(self.shape)

    def bytes_in(self, region: torch.Tensor) -> torch.Tensor:
        return region[self.offset : self.end]


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (on its device)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def code_tensor(t: torch.Tensor, offset: int, chunk_size: int = GPU_CHUNK,
                chunked: bool = False) -> CodedTensor:
    """``t`` (a dtype of ``FORMATS``) coded in chunks of ``chunk_size`` symbols, to decode
    at ``offset`` of a scratch region. ``chunked``: the first field is a frame even where
    coding saves nothing, so that the GPU decoder cuts every field in ``chunk_size``
    chunks (it cuts plain fields like their frame's partner)."""
    raw = raw_bytes(t).cpu().numpy()
    fields = []
    for k, f in enumerate(formats.split(FORMATS[t.dtype], raw)):
        frame = None
        must = chunked and k == 0
        if must or _entropy_bytes(f.symbols) <= (1 - GPU_MIN_SAVING) * f.symbols.size:
            frame = np.frombuffer(rans.encode(f.symbols, precision=RANS_PRECISION,
                                              chunk_size=chunk_size), np.uint8)
        if frame is not None and (must or frame.size
                                  <= (1 - GPU_MIN_SAVING) * f.symbols.size):
            fields.append(Field(f.name, frame, True))
        else:  # a copy: one-byte planes share memory with the tensor
            fields.append(Field(f.name, np.array(f.symbols, np.uint8), False))
    return CodedTensor(t.dtype, tuple(t.shape), offset, tuple(fields))


def _entropy_bytes(symbols: np.ndarray) -> float:
    """A lower bound of any rANS frame of ``symbols``: their empirical order-0 entropy
    (no static code is shorter; a frame adds its states and tables), less a rounding
    margin. A field whose bound misses the saving asked for is not worth encoding."""
    counts = np.bincount(symbols.reshape(-1), minlength=256)
    p = counts[counts > 0] / max(1, symbols.size)
    return float(-(p * np.log2(p)).sum()) * symbols.size / 8 * (1 - 1e-9) - 1


def decode_into(c: CodedTensor, out: np.ndarray) -> None:
    """CPU decode of ``c`` into ``out`` (uint8, ``c.nbytes`` bytes)."""
    n = c.nbytes // c.itemsize  # symbols of every field (BF16 too: two fields of n)
    fields = {f.name: rans.decode(f.data, max_output=n) if f.coded else f.data
              for f in c.fields}
    formats.join(c.format, fields, c.nbytes, out=out)
