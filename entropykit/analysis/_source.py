"""What ``analyze`` reads: tensors as (name, safetensors dtype, shape, stored bytes).

What it is: one iterator over the tensors of a safetensors file (read, never mapped; header
checked by ``container.header`` like untrusted input), an entropykit-compressed file (its
tensors decoded one at a time, with their payload sizes), a checkpoint directory (its
``*.safetensors`` files, recursively, in name order), a numpy array, a torch tensor, a
mapping of names to arrays/tensors, or a KV cache: a ``predictive.KVCache`` or a
transformers ``Cache`` (anything whose ``.layers`` have ``.keys`` and ``.values``), or an
iterable of caches (a stream, read one cache at a time). A cache gives the items
"layer.{i}.keys" and "layer.{i}.values" (and, for an fp8 ``KVCache``, its per-layer
float32 scales "layer.{i}.keys.scale", "layer.{i}.values.scale"), marked ``accumulate``:
the counts of items of one name add up over the caches of a stream. A file's tensor is
read when its item is loaded; an array's bytes are views of it, not copies.
What it is not: statistics (counts.py) or a general safetensors reader; torch and
transformers are never imported here: a torch tensor is recognized by its type's module,
a cache by its attributes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .. import dtypes, formats
from ..container import checkpoint, files
from ..container.reader import Compressed, is_compressed, read_header

# Bytes per element of the dtypes the formats split knows.
ITEMSIZE = {d: dtypes.BITS[d] // 8 for d in formats.DTYPES}
NUMPY_DTYPES: dict[str, np.dtype] = {k: np.dtype(v) for k, v in dtypes.NUMPY.items()}


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
    accumulate: bool = False  # a KV cache tensor: counts of items of this name add up


@dataclass(frozen=True)
class Skipped:
    """A tensor whose dtype the formats split does not know (e.g. C64, F4): not analyzed."""

    file: str | None
    name: str
    dtype: str
    nbytes: int


def _file_items(path: Path, layouts: Mapping[str, str | None]) -> Iterator[Item | Skipped]:
    with files.named(path):
        # Not closed here: items read it after this generator is done (closed once dropped).
        f = files.opened(path)
        h = read_header(f)
        c = Compressed(f) if is_compressed(h) else None
    if c is not None:
        for name in c.keys():
            e = c.entry(name)
            yield Item(str(path), name, e.dtype, e.shape, e.nbytes,
                       c.record.tensors[name].layout,
                       functools.partial(c.tensor, name), c.payload_size(name))
        return
    names = {e.name for e in h.entries}
    for e in h.by_offset:
        if e.dtype not in formats.DTYPES:
            yield Skipped(str(path), e.name, e.dtype, e.nbytes)
            continue
        layout = (layouts[e.name] if e.name in layouts
                  else formats.layout_for(e.name, e.dtype, e.shape, names))
        at = h.data_start + e.begin
        yield Item(str(path), e.name, e.dtype, e.shape, e.nbytes, layout,
                   functools.partial(f.read, at, e.nbytes))


def _is_torch(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] == "torch"


def _array_item(name: str, obj: object, dtype: str | None, layout: str | None,
                accumulate: bool = False) -> Item:
    if _is_torch(obj):
        import torch  # only reached when the caller already has torch

        t = obj.detach().cpu().contiguous()  # type: ignore[attr-defined]
        inferred = dtypes.FROM_TORCH.get(str(t.dtype))
        shape = tuple(t.shape)
        arr = t.reshape(-1).view(torch.uint8).numpy()
    else:
        arr = np.ascontiguousarray(obj)
        inferred = dtypes.FROM_NUMPY.get(arr.dtype)
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
    return Item(None, name, dtype, tuple(shape), raw.size, layout, lambda: raw,
                accumulate=accumulate)


def is_cache(obj: object) -> bool:
    """A KV cache: a ``predictive.KVCache`` (lists ``keys`` and ``values``) or a
    transformers ``Cache`` (a list ``layers`` of objects with ``keys`` and ``values``)."""
    if isinstance(obj, (str, bytes, Path, Mapping, np.ndarray)) or _is_torch(obj):
        return False
    if (isinstance(getattr(obj, "keys", None), (list, tuple))
            and isinstance(getattr(obj, "values", None), (list, tuple))):
        return True
    layers = getattr(obj, "layers", None)
    return isinstance(layers, (list, tuple)) and any(
        not isinstance(layer, Mapping) and hasattr(layer, "keys") and hasattr(layer, "values")
        for layer in layers)


def is_stream(obj: object) -> bool:
    """A stream of KV caches: an iterator (read once, so taken to be one without looking),
    or another iterable whose first element is a cache. Paths, mappings, arrays, tensors
    and caches themselves are not streams."""
    if isinstance(obj, (str, bytes, Path, Mapping, np.ndarray)) or _is_torch(obj):
        return False
    if is_cache(obj):
        return False
    if isinstance(obj, Iterator):
        return True
    if isinstance(obj, Iterable):
        first = next(iter(obj), None)
        return first is not None and is_cache(first)
    return False


def _cache_items(cache: object) -> Iterator[Item]:
    """The tensors of one KV cache, layer by layer, keys then values (then their scales)."""
    if isinstance(getattr(cache, "keys", None), (list, tuple)):
        pairs = [(i, pair) for i, pair in  # a layer without KV holds None
                 enumerate(zip(cache.keys, cache.values, strict=True))  # type: ignore[attr-defined]
                 if pair[0] is not None]
        scales = getattr(cache, "scales", None)
    else:
        # transformers: a layer not yet written holds None (or an empty tensor).
        pairs = [(i, (layer.keys, layer.values))
                 for i, layer in enumerate(cache.layers)  # type: ignore[attr-defined]
                 if getattr(layer, "keys", None) is not None and layer.keys.numel()]
        scales = None
    for i, pair in pairs:
        for kv, (part, tensor) in enumerate(zip(("keys", "values"), pair, strict=True)):
            yield _array_item(f"layer.{i}.{part}", tensor, None, None, accumulate=True)
            if scales is not None:  # fp8: real value = stored value * scale
                yield _array_item(f"layer.{i}.{part}.scale", scales[i, kv].reshape(1), None,
                                  None, accumulate=True)


def items(obj: object, *, dtype: str | None = None, name: str = "tensor",
          layouts: Mapping[str, str | None] | None = None) -> Iterator[Item | Skipped]:
    """The tensors of ``obj``: a path (file or directory), an array/tensor, a mapping, a KV
    cache or a stream of KV caches (see the module docstring)."""
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
    elif is_cache(obj):
        yield from _cache_items(obj)
    elif is_stream(obj):
        for n, cache in enumerate(obj):  # type: ignore[attr-defined]
            if not is_cache(cache):
                raise TypeError(f"element {n} of the stream is a {type(cache).__name__}, not "
                                "a KV cache (KVCache or transformers Cache)")
            yield from _cache_items(cache)
    else:
        yield _array_item(name, obj, dtype, layouts.get(name))
