"""What ``analyze`` reads: tensors as (name, safetensors dtype, shape, stored bytes).

What it is: one iterator over the tensors of a safetensors file (memory-mapped, header
checked like untrusted input), a checkpoint directory (its ``*.safetensors`` files in name
order), a numpy array, a torch tensor, or a mapping of names to arrays/tensors (a stream of
KV tensors). No tensor is copied: each item's bytes are a view of the mapping or array.
What it is not: statistics (counts.py) or a general safetensors reader; torch is never
imported here, a torch tensor is recognized by its type's module.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from .. import formats
from .._errors import CorruptDataError

# Bytes per element of the dtypes the formats split knows.
ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}
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
METADATA_KEY = "__metadata__"
_MAX_HEADER = 100_000_000  # safetensors' own limit: a hostile length cannot allocate more


@dataclass(frozen=True)
class Item:
    """One tensor to analyze."""

    file: str | None  # the safetensors file it came from, or None for in-memory input
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8, 1-D: the stored (little-endian) bytes
    layout: str | None  # packed 4-bit layout (formats.layout_for), or None


@dataclass(frozen=True)
class Skipped:
    """A tensor whose dtype the formats split does not know (e.g. C64, F4): not analyzed."""

    file: str | None
    name: str
    dtype: str
    nbytes: int


def _bad(path: Path, what: str) -> CorruptDataError:
    return CorruptDataError(f"{path}: not a valid safetensors file: {what}")


def _entries(path: Path, buf: np.ndarray) -> tuple[dict, int]:
    """The header's tensor entries (name -> spec) and where the data section starts."""
    if buf.size < 8:
        raise _bad(path, f"{buf.size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", buf[:8].tobytes())
    if n > _MAX_HEADER or 8 + n > buf.size:
        raise _bad(path, f"header length {n} at byte 0 exceeds the file ({buf.size} bytes)")
    try:
        header = json.loads(buf[8:8 + n].tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(path, f"header JSON at bytes 8..{8 + n}: {e}") from None
    if not isinstance(header, dict):
        raise _bad(path, "header JSON is not an object")
    header.pop(METADATA_KEY, None)
    return header, 8 + n


def _checked(path: Path, name: str, spec: object, data_size: int) -> tuple[str, tuple, int, int]:
    if not isinstance(spec, dict):
        raise _bad(path, f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    ints = lambda v, k: (isinstance(v, list) and len(v) in k
                         and all(type(x) is int and x >= 0 for x in v))
    if not isinstance(dtype, str) or not ints(shape, range(65)) or not ints(offsets, (2,)):
        raise _bad(path, f"tensor {name!r}: malformed dtype, shape or data_offsets")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise _bad(path, f"tensor {name!r}: data_offsets {offsets} outside the data "
                         f"section of {data_size} bytes")
    if dtype in ITEMSIZE and end - begin != math.prod(shape) * ITEMSIZE[dtype]:
        raise _bad(path, f"tensor {name!r}: {end - begin} bytes for {dtype} of shape {shape}")
    return dtype, tuple(shape), begin, end


def _file_items(path: Path, layouts: Mapping[str, str | None]) -> Iterator[Item | Skipped]:
    if path.stat().st_size == 0:
        raise _bad(path, "empty file")
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    header, start = _entries(path, buf)
    data = buf[start:]
    names = set(header)
    # Data order, so a file is read front to back.
    specs = sorted(((*_checked(path, k, v, data.size), k) for k, v in header.items()),
                   key=lambda t: (t[2], t[4]))
    for dtype, shape, begin, end, name in specs:
        if dtype not in formats.DTYPES:
            yield Skipped(str(path), name, dtype, end - begin)
            continue
        layout = (layouts[name] if name in layouts
                  else formats.layout_for(name, dtype, shape, names))
        yield Item(str(path), name, dtype, shape, data[begin:end], layout)


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
    return Item(None, name, dtype, tuple(shape), raw, layout)


def items(obj: object, *, dtype: str | None = None, name: str = "tensor",
          layouts: Mapping[str, str | None] | None = None) -> Iterator[Item | Skipped]:
    """The tensors of ``obj``: a path (file or directory), an array/tensor, or a mapping."""
    layouts = layouts or {}
    if isinstance(obj, (str, Path)):
        path = Path(obj)
        if path.is_dir():
            files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors file in this directory")
            for f in files:
                yield from _file_items(f, layouts)
        else:
            yield from _file_items(path, layouts)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield _array_item(str(k), v, dtype, layouts.get(str(k)))
    else:
        yield _array_item(name, obj, dtype, layouts.get(name))
