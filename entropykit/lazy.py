"""Lazy access to a compressed safetensors file, the way ``safetensors.safe_open`` gives it.

What it is: ``safe_open(path, framework=..., device=...)``, a context manager with
``keys()``, ``metadata()``, ``get_tensor(name)`` and ``get_slice(name)[...]``. A tensor is
decoded only when asked for; a slice decodes only the segments holding the rows it selects
(all of them when it cuts inside rows). A plain safetensors file is handed to
``safetensors.safe_open``. And ``load_dir``: the merged tensors of a checkpoint directory.
What it is not: a writer, or a GPU decoder (tensors for a CUDA device are decoded on the
CPU and copied; ``load_file(..., device="cuda")`` decodes on the GPU).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import dtypes
from ._errors import CorruptDataError
from .container import files
from .container import header as hdr
from .container.checkpoint import INDEX_SUFFIX, check_shards
from .container.parallel import resolve
from .container.reader import Compressed, is_compressed
from .container.source import FileBytes

_FRAMEWORKS = ("pt", "np", "numpy")


def _compressed(path: Path) -> tuple[FileBytes, Compressed] | None:
    """``path`` opened and its header parsed once: the open file and its ``Compressed``
    if it is compressed, else None (closed; safetensors says what is wrong with a file
    that is not ours)."""
    with files.named(path):
        f = files.opened(path)
        try:
            try:
                h = hdr.parse_read(f.read, f.size)
            except CorruptDataError:
                raise  # the file changed while its header was read
            except ValueError:
                h = None
            if h is None or not is_compressed(h):
                f.close()
                return None
            return f, Compressed(f, outer=h)
        except BaseException:
            f.close()
            raise


def safe_open(path: str | Any, framework: str = "pt", device: str | int = "cpu", *,
              threads: int | None = None) -> Any:
    """Open a safetensors file, compressed or not, for lazy per-tensor access.

    ``framework`` is ``"pt"`` (torch tensors on ``device``) or ``"np"`` (numpy arrays;
    BF16 and FP8 as ``ml_dtypes`` types). ``metadata()`` is the original file's metadata.
    ``threads`` decode a tensor's segments in parallel (default: every core).
    """
    if framework not in _FRAMEWORKS:
        raise ValueError(f"framework must be one of {list(_FRAMEWORKS)}, got {framework!r}")
    path = Path(path)
    opened = _compressed(path)
    if opened is None:
        import safetensors

        return safetensors.safe_open(path, framework=framework, device=device)
    return CompressedFile(path, framework, device, resolve(threads), opened)


def parsed(f: CompressedFile) -> Compressed:
    """The container parse of an open compressed file (``ValueError`` once it is closed):
    for entropykit's own loaders, which decode many of its tensors at once."""
    return f._open()


class CompressedFile:
    """An open compressed safetensors file (see ``safe_open``), read as tensors are asked
    for (never mapped); closes it on exit."""

    def __init__(self, path: Path, framework: str, device: str | int, threads: int,
                 opened: tuple[FileBytes, Compressed]) -> None:
        """``opened``: the file and its parse (``_compressed``), closed by ``close``."""
        self._path, self._framework, self._device, self._threads = path, framework, device, threads
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(opened[0])
        self._c: Compressed | None = opened[1]

    def __enter__(self) -> CompressedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._c = None  # no reads through a closed file
        self._stack.close()

    def _open(self) -> Compressed:
        if self._c is None:
            raise ValueError(f"{self._path}: file is closed")
        return self._c

    def keys(self) -> list[str]:
        """Tensor names in data order."""
        return self._open().keys()

    def metadata(self) -> dict[str, str] | None:
        """The original file's ``__metadata__``."""
        meta = self._open().original.metadata
        return None if meta is None else dict(meta)

    def get_tensor(self, name: str) -> Any:
        """Tensor ``name``, decoded in full."""
        return self._wrap(self._array(self._open().entry(name)))

    def _array(self, e: hdr.Entry) -> np.ndarray:
        with files.named(self._path):
            raw = self._open().tensor(e.name, self._threads)
        return raw.view(_numpy_dtype(e.dtype)).reshape(e.shape)

    def get_slice(self, name: str) -> TensorSlice:
        """A handle on tensor ``name`` that decodes only what ``[...]`` selects."""
        return TensorSlice(self, self._open().entry(name))

    def _wrap(self, a: np.ndarray) -> Any:
        if self._framework != "pt":
            return a
        import torch

        name, types = dtypes.FROM_NUMPY[a.dtype], dtypes.torch_types()
        if name not in types:
            raise TypeError(f"torch has no dtype for {name}")
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if flat.size == 0:  # torch cannot reinterpret an empty uint8 tensor
            t = torch.empty(a.shape, dtype=types[name])
        else:
            t = torch.from_numpy(flat).view(types[name]).reshape(a.shape)
        return t if str(self._device) == "cpu" else t.to(self._device)


class TensorSlice:
    """What ``get_slice`` returns: ``get_shape()``, ``get_dtype()`` and ``[...]``."""

    def __init__(self, f: CompressedFile, e: hdr.Entry) -> None:
        self._f, self._e = f, e

    def get_shape(self) -> list[int]:
        return list(self._e.shape)

    def get_dtype(self) -> str:
        return self._e.dtype

    def __getitem__(self, key: Any) -> Any:
        e, f = self._e, self._f
        if not e.shape or math.prod(e.shape) == 0:
            # nothing to save on a scalar or an empty tensor
            return f._wrap(np.asarray(f._array(e)[key]))
        key = _expand(key, len(e.shape))
        # The rows (first-axis indices) the key selects bound the bytes to decode.
        k0 = key[0]
        rows = range(e.shape[0])[k0] if isinstance(k0, slice) else [range(e.shape[0])[k0]]
        if len(rows) == 0:
            lo = hi = 0
        else:
            lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
        dt = np.dtype(_numpy_dtype(e.dtype))
        rb = math.prod(e.shape[1:]) * dt.itemsize
        c = f._open()
        with files.named(f._path):
            start, raw = c.span(e.name, lo * rb, hi * rb, f._threads)
        block = raw[lo * rb - start : hi * rb - start].view(dt).reshape((hi - lo, *e.shape[1:]))
        if not isinstance(k0, slice):
            rel: Any = rows[0] - lo
        elif len(rows) == 0:
            rel = slice(0, 0)
        elif rows.step > 0:
            rel = slice(0, hi - lo, rows.step)
        else:
            rel = slice(hi - 1 - lo, None, rows.step)
        return f._wrap(np.array(block[(rel, *key[1:])], order="C"))


def _expand(key: Any, ndim: int) -> tuple:
    """``key`` as one int or slice per axis (``...`` expanded); IndexError or TypeError
    for what safetensors would not take either."""
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (ndim - len(key) + 1) + key[i + 1 :]
    if len(key) > ndim:
        raise IndexError(f"too many indices: {len(key)} for {ndim} dimensions")
    for k in key:
        if not (isinstance(k, slice) or (isinstance(k, (int, np.integer))
                                         and not isinstance(k, bool))):
            raise TypeError(f"unsupported index {k!r}: use ints, slices and ...")
    return tuple(k if isinstance(k, slice) else int(k) for k in key) + \
        (slice(None),) * (ndim - len(key))


def _numpy_dtype(dtype: str) -> Any:
    if dtype not in dtypes.NUMPY:
        raise TypeError(f"numpy has no dtype for {dtype}")
    return dtypes.NUMPY[dtype]


def shards(root: Path) -> list[Path]:
    """The safetensors files of checkpoint directory ``root``: those its index names (in
    order of first mention) or, without an index, every ``*.safetensors`` file in it."""
    indexes = sorted(root.glob("*" + INDEX_SUFFIX))
    if len(indexes) > 1:
        raise ValueError(f"{root}: several safetensors indexes "
                         f"({', '.join(p.name for p in indexes)}); load one file at a time")
    if indexes:
        check_shards(root)
        weight_map = json.loads(indexes[0].read_text("utf-8"))["weight_map"]
        return [root / s for s in dict.fromkeys(weight_map.values())]
    found = sorted(root.glob("*" + files.SUFFIX))
    if not found:
        raise FileNotFoundError(f"{root}: no safetensors files in it")
    return found


def load_dir(root: Path, load: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
    """The merged tensors of checkpoint directory ``root``, each shard read by ``load``;
    ValueError if two shards hold the same name or the index names a tensor its shard
    lacks."""
    out: dict[str, Any] = {}
    where: dict[str, Path] = {}
    for shard in shards(root):
        for k, v in load(shard).items():
            if k in out:
                raise ValueError(f"{root}: tensor {k!r} is in both {where[k].name} and "
                                 f"{shard.name}")
            out[k], where[k] = v, shard
    indexes = sorted(root.glob("*" + INDEX_SUFFIX))
    if indexes:
        weight_map = json.loads(indexes[0].read_text("utf-8"))["weight_map"]
        wrong = [k for k, s in weight_map.items() if k not in out or where[k].name != s]
        if wrong:
            raise ValueError(f"{indexes[0]}: names {wrong[0]!r} in a shard that does not hold "
                             "it")
    return out
