"""What ``analyze`` reads: tensors as (name, safetensors dtype, shape, stored bytes).

What it is: one iterator over the tensors of a safetensors file (memory-mapped, header
checked by ``container.header`` like untrusted input), an entropykit-compressed file (its
tensors decoded one at a time, with their payload sizes), a checkpoint directory (its
``*.safetensors`` files, recursively, in name order), a numpy array, a torch tensor, or a
mapping of names to arrays/tensors (a stream of KV tensors). Plain tensors are not copied:
their bytes are views of the file mapping or of the array.
What it is not: statistics (counts.py) or a general safetensors reader; torch is never
imported here, a torch tensor is recognized by its type's module.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import formats
from .._errors import CorruptDataError
from ..container import checkpoint, files
from ..container import header as hdr
from ..container.reader import Compressed, is_compressed

# Bytes per element of the dtypes the formats split knows.
ITEMSIZE = {d: hdr.DTYPE_BITS[d] // 8 for d in formats.DTYPES}
# safetensors dtype -> numpy dtype (ml_dtypes for the formats numpy lacks).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
_FROM_NUMPY = {v: k for k, v in NUMPY_DTYPES.items()}
_FROM_TORCH = {
    "torch.bool": "BOOL", "torch.uint8": "U8", "torch.int8": "I8", "torch.uint16": "U16",
    "torch.int16": "I16", "torch.uint32": "U32", "torch.int32": "I32", "torch.uint64": "U64",
    "torch.int64": "I64", "torch.float16": "F16", "torch.bfloat16": "BF16",
    "torch.float32": "F32", "torch.float64": "F64", "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2", "torch.float8_e8m0fnu": "F8_E8M0",
}


@dataclass(frozen=True)
class Item:
    """One tensor to analyze; ``load()`` gives its stored bytes (uint8, 1-D, little-endian)."""

    file: str | None  # the safetensors file it came from, or None for in-memory input
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    nbytes: int
    layout: str | None  # packed 4-bit layout (formats.layout_for), or None
    load: Callable[[], np.ndarray] = field(compare=False)
    coded: int | None = None  # its payload's size in an entropykit container, if it is one


@dataclass(frozen=True)
class Skipped:
    """A tensor whose dtype the formats split does not know (e.g. C64, F4): not analyzed."""

    file: str | None
    name: str
    dtype: str
    nbytes: int


def _file_items(path: Path, layouts: Mapping[str, str | None]) -> Iterator[Item | Skipped]:
    # np.memmap, not a closed-on-exit mmap: items are views that outlive this generator.
    buf = (np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size
           else np.zeros(0, np.uint8))
    try:
        h = hdr.parse_file(memoryview(buf))
    except ValueError as e:
        raise CorruptDataError(f"{path}: not a valid safetensors file: {e}") from None
    if is_compressed(h):
        with files.named(path):
            c = Compressed(buf)
        for name in c.keys():
            e = c.entry(name)
            yield Item(str(path), name, e.dtype, e.shape, e.nbytes,
                       c.record.tensors[name].layout,
                       functools.partial(c.tensor, name), c.payload_size(name))
        return
    names = {e.name for e in h.entries}
    data = buf[h.data_start:]
    for e in h.by_offset:
        if e.dtype not in formats.DTYPES:
            yield Skipped(str(path), e.name, e.dtype, e.nbytes)
            continue
        layout = (layouts[e.name] if e.name in layouts
                  else formats.layout_for(e.name, e.dtype, e.shape, names))
        view = data[e.begin:e.end]
        yield Item(str(path), e.name, e.dtype, e.shape, e.nbytes, layout, lambda v=view: v)


def _array_item(name: str, obj: object, dtype: str | None, layout: str | None) -> Item:
    if type(obj).__module__.split(".")[0] == "torch":
        import torch  # only reached when the caller already has torch

        t = obj.detach().cpu().contiguous()  # type: ignore[attr-defined]
        inferred = _FROM_TORCH.get(str(t.dtype))
        shape = tuple(t.shape)
        arr = t.reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(obj)
        inferred = _FROM_NUMPY.get(arr.dtype)
        shape = arr.shape
    dtype = dtype or inferred
    if dtype is None:
        raise ValueError(f"{name!r}: cannot tell the safetensors dtype of {type(obj).__name__} "
                         f"{getattr(obj, 'dtype', '')}; pass dtype=")
    if dtype not in formats.DTYPES:
        raise ValueError(f"unknown safetensors dtype {dtype!r}; known: {sorted(formats.DTYPES)}")
    raw = arr.reshape(-1).view(np.uint8)
    if raw.size % ITEMSIZE[dtype]:
        raise ValueError(f"{name!r}: {raw.size} bytes is not a whole number of {dtype} values")
    if math.prod(shape) * ITEMSIZE[dtype] != raw.size:
        shape = (raw.size // ITEMSIZE[dtype],)  # bytes reinterpreted as another dtype
    return Item(None, name, dtype, tuple(shape), raw.size, layout, lambda: raw)


def items(obj: object, *, dtype: str | None = None, name: str = "tensor",
          layouts: Mapping[str, str | None] | None = None) -> Iterator[Item | Skipped]:
    """The tensors of ``obj``: a path (file or directory), an array/tensor, or a mapping."""
    layouts = layouts or {}
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if path.is_dir():
            found = checkpoint.walk(path)[0]
            if not found:
                raise FileNotFoundError(f"{path}: no *.safetensors file in this directory")
            for rel in found:
                yield from _file_items(path / rel, layouts)
        else:
            yield from _file_items(path, layouts)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield _array_item(str(k), v, dtype, layouts.get(str(k)))
    else:
        yield _array_item(name, obj, dtype, layouts.get(name))
