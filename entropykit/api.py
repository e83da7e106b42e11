"""The Python API: compress and restore safetensors files, directories, tensors and bytes.

What it is: the public verbs, thin over ``entropykit.container``:

- ``compress_file`` / ``decompress_file``: a safetensors file or checkpoint directory to a
  compressed one (itself a valid safetensors file) and back, byte for byte;
- ``load_file``: the tensors of a compressed (or plain) safetensors file, as
  ``safetensors.torch.load_file`` returns them, decoding tensor by tensor;
- ``save_file``: tensors straight to a compressed file, as ``safetensors.torch.save_file``
  would have written them, compressed;
- ``compress`` / ``decompress``: one numpy array, torch tensor or bytes object to a blob
  and back, returning the same kind, dtype and shape.

What it is not: the format (docs/format.md) or the coders. torch is optional: only
``load_file`` and torch inputs need it.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from . import dtypes
from .container import _atomic, checkpoint, files
from .container import header as hdr
from .container.parallel import resolve
from .container.progress import Bar
from .container.reader import Compressed, is_compressed, read_header
from .container.stats import Summary
from .container.writer import Source, write

PathLike = str | os.PathLike[str]
ProgressArg = bool | Callable[[int, int], None]

_KIND = "entropykit.kind"  # metadata key of a compress() blob: numpy, torch or bytes
_NAME = "data"  # the one tensor of a compress() blob


def _progress(progress: ProgressArg, label: str) -> tuple[Callable | None, Bar | None]:
    if progress is True:
        bar = Bar(label)
        return bar, bar
    if progress is False or progress is None:
        return None, None
    return progress, None


def compress_file(src: PathLike, dst: PathLike | None = None, *, threads: int | None = None,
                  progress: ProgressArg = False, force: bool = False,
                  fast: bool = False, target: str = "cpu") -> Summary:
    """Compress a safetensors file (or a checkpoint directory) to ``dst``.

    ``dst`` defaults to ``<name>.ek.safetensors`` (``<dir>.ek`` for a directory). The
    output is a valid safetensors file holding each tensor's compressed payload under its
    own name; ``decompress_file`` restores the input byte for byte. ``threads`` defaults
    to every available core; ``progress`` is True for a line on stderr, or a callable
    ``(bytes done, bytes total)``. Refuses to overwrite ``dst`` unless ``force``, which
    replaces an existing file, or in an existing directory only the files this run writes
    (every other file stays); an output that is, contains or lies inside the input, or that
    is not a file (a FIFO or character device is written into), raises ``ValueError``. The
    input is only read; the output appears (renamed from a temporary name) only when
    complete.
    ``fast`` stores fields that entropy coding would shrink by under 2% raw (BF16/F32
    mantissa bytes): both ways ~1.5x faster for ~0.5% (BF16) to ~1% (F32) more bytes.
    ``target="gpu"`` codes every entropy-coded field with rANS in GPU-sized chunks, so that
    ``load_file(..., device="cuda")`` decodes all of it on the GPU (default ``"cpu"``).
    Returns the sizes, ratio and timings.
    """
    cb, bar = _progress(progress, f"compress {Path(src).name}")
    try:
        if Path(src).is_dir():
            return checkpoint.compress_dir(Path(src), _opt(dst), threads=threads, force=force,
                                           progress=cb, fast=fast, target=target)
        return files.compress_file(Path(src), _opt(dst), threads=threads, force=force,
                                   progress=cb, fast=fast, target=target)
    finally:
        if bar is not None:
            bar.close()


def decompress_file(src: PathLike, dst: PathLike | None = None, *,
                    threads: int | None = None, progress: ProgressArg = False,
                    force: bool = False) -> Summary:
    """Restore the original of a compressed file (or directory) at ``dst``, byte for byte.

    ``dst`` defaults to the name without ``.ek`` (``<name>.restored.safetensors`` if the
    name has none). Raises ``CorruptDataError`` naming the file if it is damaged; nothing
    is written then. Other arguments as for ``compress_file``.
    """
    cb, bar = _progress(progress, f"decompress {Path(src).name}")
    try:
        if Path(src).is_dir():
            return checkpoint.decompress_dir(Path(src), _opt(dst), threads=threads,
                                             force=force, progress=cb)
        return files.decompress_file(Path(src), _opt(dst), threads=threads, force=force,
                                     progress=cb)
    finally:
        if bar is not None:
            bar.close()


def _opt(p: PathLike | None) -> Path | None:
    return None if p is None else Path(p)


def _as_torch(raw: np.ndarray, e: hdr.Entry, types: dict[str, Any]) -> Any:
    import torch

    if e.dtype not in types:
        raise TypeError(f"tensor {e.name!r}: torch has no dtype for {e.dtype}")
    if raw.size == 0:  # torch cannot reinterpret an empty uint8 tensor (stride 0)
        return torch.empty(e.shape, dtype=types[e.dtype])
    return torch.from_numpy(raw).view(types[e.dtype]).reshape(e.shape)


def load_file(path: PathLike, device: str | int = "cpu", *,
              threads: int | None = None) -> dict[str, Any]:
    """The tensors of a safetensors file, compressed or not, as torch tensors on ``device``.

    ``path`` may be a checkpoint directory: the merged tensors of the shards its
    ``*.safetensors.index.json`` names (or of all its ``*.safetensors`` files).

    Same return as ``safetensors.torch.load_file`` (names in data order). A compressed file
    is decoded tensor by tensor straight into the returned tensors (no temporary file, no
    decompressed copy of the file). A plain file is handed to ``safetensors``; a file that
    says it is compressed (docs/format.md, "Reading a file as compressed") never is, and
    one that is not a valid safetensors file raises ``CorruptDataError``.

    On a CUDA device (``"cuda"``, ``"cuda:1"``, an ``int`` or a ``torch.device``) a
    compressed file is decoded by the GPU (``container.cuda``: the file's payloads go to the
    device once, the kernel writes the tensors); this needs the ``gpu`` extra (CuPy) and
    raises ``entropykit.gpu.GpuUnavailableError`` saying what is missing. The GPU checks
    coded chunks by their rANS states, and the host checks the CRC-32 of every field it
    decodes or that is copied verbatim; the per-chunk CRC-32 of coded chunks is checked
    by ``verify`` only.
    """
    import safetensors.torch

    path = Path(path)
    if path.is_dir():
        from .lazy import load_dir

        return load_dir(path, lambda p: load_file(p, device, threads=threads))
    n = resolve(threads)
    with files.named(path), files.opened(path) as f:
        # Ours or not, never handed on: safetensors accepts some headers this refuses
        # (duplicate keys), and a damaged compressed file must not load as plain.
        h = read_header(f)
        if not is_compressed(h, f):
            return safetensors.torch.load_file(path, device=device)
        out = _load_compressed(Compressed(f, outer=h), device, n)
        f.check()
        return out


def _load_compressed(c: Compressed, device: Any, threads: int,
                     names: Sequence[str] | None = None) -> dict[str, Any]:
    """Tensors ``names`` (default: all) of compressed file ``c`` on ``device``, in data
    order, all decoded in one go: one GPU plan for all of them, or one CPU thread pool."""
    types = dtypes.torch_types()
    if _is_cuda(device):
        from ._cuda import require

        require(device)  # GpuUnavailableError before any work
        from .container.cuda.load import load

        return load(c, device, types, threads, names=names)
    keep = None if names is None else frozenset(names)
    wanted = [k for k in c.keys() if keep is None or k in keep]
    out = {}
    tensors = c.tensors(wanted, threads)
    try:
        for name, raw in zip(wanted, tensors, strict=True):
            t = _as_torch(raw, c.entry(name), types)
            out[name] = t if str(device) == "cpu" else t.to(device)
    finally:
        tensors.close()  # at once on an error: cancel queued units, wait for running ones
    return out


def _load_many(jobs: Sequence[tuple[Compressed, Sequence[str] | None]], device: Any,
               threads: int, *, now: bool = False) -> Iterator[dict[str, Any]]:
    """``_load_compressed`` of each job (a compressed file, the names wanted of it or
    None), in order, made as they are asked for; on a CUDA device all through one GPU
    load (one planning thread, one set of staging buffers and fill threads), which raises
    ``GpuUnavailableError`` here, before any work, and with ``now`` plans and launches
    the first file's first group here, on the calling thread (``load.stream``)."""
    if _is_cuda(device):
        from ._cuda import require

        require(device)
        from .container.cuda.load import stream

        return stream(jobs, device, dtypes.torch_types(), threads, now=now)
    return (_load_compressed(c, device, threads, names) for c, names in jobs)


def _is_cuda(device: Any) -> bool:
    """Whether ``device`` names a CUDA device (an int is a CUDA index, as in safetensors)."""
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return str(device).split(":", 1)[0] == "cuda"


def _tensor_bytes(name: str, t: Any) -> tuple[str, tuple[int, ...], np.ndarray]:
    """(safetensors dtype, shape, little-endian bytes) of a torch tensor or numpy array."""
    if isinstance(t, np.ndarray):
        a = t
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype not in dtypes.FROM_NUMPY:
            raise TypeError(f"tensor {name!r}: numpy dtype {a.dtype} has no safetensors dtype")
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        return dtypes.FROM_NUMPY[a.dtype], a.shape, flat
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"tensor {name!r}: expected a torch tensor or numpy array, "
                        f"got {type(t).__name__}")
    names = dtypes.torch_names()
    if t.dtype not in names:
        raise TypeError(f"tensor {name!r}: torch dtype {t.dtype} has no safetensors dtype")
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return names[t.dtype], tuple(t.shape), flat.view(torch.uint8).numpy()


def tensor_source(tensors: Mapping[str, Any], metadata: Mapping[str, str] | None) -> Source:
    """An in-memory original file (torch tensors or numpy arrays): the header
    ``safetensors`` would write, and the bytes, read by the container writer."""
    data = {k: _tensor_bytes(k, v) for k, v in tensors.items()}
    entries, pos = [], 0
    for e in hdr.write_order([hdr.Entry(k, d[0], d[1], 0, 0) for k, d in data.items()]):
        n = data[e.name][2].size
        entries.append(hdr.Entry(e.name, e.dtype, e.shape, pos, pos + n))
        pos += n
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in metadata.items()):
        raise TypeError("metadata must map str to str")
    raw = hdr.render(metadata, entries)
    return Source(hdr.parse_json(raw), lambda e: data[e.name][2])


def _memory(value: Any) -> tuple[int, int, int] | None:
    """(storage address, first byte, end byte) of a torch tensor's bytes in its storage,
    or None for an empty tensor or anything else (safetensors checks torch tensors only)."""
    storage = getattr(value, "untyped_storage", None)
    if storage is None or not callable(getattr(value, "numel", None)) or value.numel() == 0:
        return None
    size = value.element_size()
    lo = value.storage_offset() * size
    span = sum((n - 1) * st for n, st in zip(value.shape, value.stride(), strict=True))
    return storage().data_ptr(), lo, lo + (span + 1) * size


def _refuse_shared(tensors: Mapping[str, Any]) -> None:
    """ValueError naming tensors whose memory overlaps (tied weights), as safetensors
    refuses them: saved twice they would load as two tensors, no longer tied."""
    spans = sorted((m, k) for k, v in tensors.items() if (m := _memory(v)) is not None)
    shared: list[str] = []
    where, end, last = None, 0, ""
    for (ptr, lo, hi), k in spans:
        if ptr == where and lo < end:
            shared += [x for x in (last, k) if x not in shared]
        if ptr != where or hi > end:
            where, end, last = ptr, hi, k
    if shared:
        raise ValueError(f"tensors share memory (tied weights?): {', '.join(shared)}; save "
                         f"one of them, or a .clone() of each")


def save_file(tensors: Mapping[str, Any], path: PathLike,
              metadata: Mapping[str, str] | None = None, *, threads: int | None = None,
              force: bool = False, fast: bool = False, target: str = "cpu") -> None:
    """Write ``tensors`` (torch tensors or numpy arrays) as a compressed safetensors file.

    Decompressing ``path`` gives the file ``safetensors.torch.save_file(tensors, ...,
    metadata)`` writes; ``load_file(path)`` gives the tensors back. An existing ``path``
    is replaced only with ``force=True`` (FileExistsError otherwise), atomically, as by
    ``compress_file``; ``fast`` and ``target`` as there. Tensors that share memory (tied
    weights) are refused with a ValueError, as safetensors refuses them.
    """
    _refuse_shared(tensors)
    src = tensor_source(tensors, metadata)
    path = Path(path)
    with files.named(path), _atomic.output_file(path, force=force) as out:
        write(src, out, threads=resolve(threads), fast=fast, target=target)


def compress(obj: Any, *, threads: int | None = None) -> bytes:
    """One numpy array, torch tensor or bytes-like object as a compressed blob.

    The blob is a compressed safetensors file in memory; ``decompress`` returns an object of
    the same kind (numpy / torch / bytes), dtype and shape.
    """
    if isinstance(obj, (bytes, bytearray, memoryview)):
        kind, value = "bytes", np.frombuffer(memoryview(obj).cast("B"), np.uint8)
    elif isinstance(obj, np.ndarray):
        kind, value = "numpy", obj
    else:
        kind, value = "torch", obj  # _tensor_bytes says so if it is not a tensor
    src = tensor_source({_NAME: value}, {_KIND: kind})
    out = io.BytesIO()
    write(src, out, threads=resolve(threads))
    return out.getvalue()


def decompress(blob: bytes | bytearray | memoryview, *, threads: int | None = None) -> Any:
    """The object ``compress`` was given, from its blob; CorruptDataError if damaged."""
    c = Compressed(np.frombuffer(memoryview(blob).cast("B"), np.uint8))
    kind = (c.original.metadata or {}).get(_KIND)
    if kind not in ("numpy", "torch", "bytes") or c.keys() != [_NAME]:
        raise ValueError("not a blob made by entropykit.compress (use decompress_file for "
                         "compressed files)")
    e = c.entry(_NAME)
    raw = c.tensor(_NAME, resolve(threads))
    if kind == "bytes":
        return raw.tobytes()
    if kind == "numpy":
        return raw.view(dtypes.NUMPY[e.dtype]).reshape(e.shape)
    return _as_torch(raw, e, dtypes.torch_types())
