"""``analyze``: count every field of every tensor of an input and build the Report.

What it is: the driver from an input (file, directory, array, tensor, mapping, KV cache
or stream of KV caches; see _source.py) through exact counts (counts.py) to entropies per
field (this module's arithmetic) and a ``Report``. A stream is read one cache at a time:
only the counts per (layer, k/v) stay in memory. What it is not: the report's aggregates,
JSON or table (report.py), or plots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from ..coding import contexts
from ..coding.tables import entropy_bits
from . import _source
from .counts import Counts, count
from .magnitude import log2_histogram
from .report import FieldRow, Report, Skipped, TensorRow
from .roles import role_of


@njit(nogil=True, cache=True)
def conditional_bits(joint: np.ndarray) -> float:
    """Total bits of H(X | C) for a joint histogram ``joint[c, x]`` (one table per c)."""
    bits = 0.0
    for c in range(joint.shape[0]):
        n = 0
        for x in range(joint.shape[1]):
            n += joint[c, x]
        for x in range(joint.shape[1]):
            if joint[c, x]:
                bits += joint[c, x] * math.log2(n / joint[c, x])
    return bits


def _coder_bits(joint: np.ndarray) -> float:
    """Total bits of H(X | class(C)) with the classes the coder would choose."""
    cmap = contexts.choose(joint)
    if cmap is None:
        return entropy_bits(joint.sum(axis=0))
    # classes[t] = sum of joint[c] over c with cmap[c] == t, as a 0/1 matrix product
    # (float64 is exact for counts below 2**53).
    onehot = (cmap[None, :] == np.arange(int(cmap.max()) + 1)[:, None]).astype(np.float64)
    classes = np.rint(onehot @ joint.astype(np.float64)).astype(np.int64)
    return conditional_bits(classes)


def _fields(c: Counts) -> tuple[FieldRow, ...]:
    out = []
    n = c.symbols
    for f, (name, ctx) in enumerate(zip(c.names, c.contexts, strict=True)):
        hist = c.hists[f]
        cond = coder = None
        if ctx is not None:
            joint = c.joint(c.names.index(ctx), f)
            cond = conditional_bits(joint) / n if n else 0.0
            coder = _coder_bits(joint) / n if n else 0.0
        out.append(FieldRow(name, ctx, n, int(np.count_nonzero(hist)),
                            entropy_bits(hist) / n + 0.0 if n else 0.0, cond, coder,
                            tuple(hist.tolist())))
    return tuple(out)


def _joined_shape(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the tensors of ``shapes`` concatenated along their sequence axis
    (-2 of a [batch, heads, seq, dim] cache tensor; 0 of a 1-d one), or flat when the
    other axes differ."""
    first = shapes[0]
    axis = max(len(first) - 2, 0)
    if first and all(len(s) == len(first) and s[:axis] == first[:axis]
                     and s[axis + 1:] == first[axis + 1:] for s in shapes):
        return first[:axis] + (sum(s[axis] for s in shapes),) + first[axis + 1:]
    return (sum(math.prod(s) for s in shapes),)


@dataclass
class _Accumulated:
    """The counts of one KV-cache tensor name over the caches of a stream so far."""

    first: _source.Item
    counts: Counts
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    nbytes: int = 0

    def add(self, it: _source.Item, c: Counts) -> None:
        if it.dtype != self.first.dtype:
            raise ValueError(f"{it.name}: a stream of KV caches mixes {self.first.dtype} and "
                             f"{it.dtype} tensors; analyze each format on its own")
        if self.shapes:  # the first item's counts are self.counts already
            self.counts.add(c)
        self.shapes.append(it.shape)
        self.nbytes += it.nbytes

    def row(self) -> TensorRow:
        it, c = self.first, self.counts
        return TensorRow(None, it.name, it.dtype, it.layout, role_of(it.name),
                         _joined_shape(self.shapes), self.nbytes, _fields(c),
                         log2_histogram(c), None)


def analyze(
    obj: object,
    *,
    dtype: str | None = None,
    name: str = "tensor",
    layouts: Mapping[str, str | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Per tensor and field entropies of ``obj``.

    ``obj``: a safetensors file or a checkpoint directory (path), a numpy array or torch
    tensor (``dtype``: its safetensors dtype name when the array's own dtype does not say,
    e.g. raw uint8 bytes; ``name``: the row's name), a mapping of names to arrays or
    tensors, or a KV cache: a ``predictive.KVCache`` (bf16, or fp8 e4m3 with its scales), a
    transformers ``Cache``, or an iterable of those (a stream: the counts of each (layer,
    k/v) tensor add up over the caches, so its row is that of the caches' concatenation
    along the sequence axis). A cache's rows are "layer.{i}.keys" / "layer.{i}.values"
    (roles "kv-keys" / "kv-values"), an fp8 cache's scales "layer.{i}.keys.scale" etc.
    ``layouts`` overrides the packed 4-bit detection per tensor name (a layout of
    ``entropykit.formats.LAYOUTS`` or None). ``progress(done_bytes, total_bytes)`` is
    called as counting goes (for a stream, whose size is not known ahead, total_bytes is
    what has been read so far). For an entropykit-compressed file, the tensors are decoded
    one by one and each row's ``coded`` holds the size entropykit achieved.
    """
    stream = _source.is_stream(obj)
    found = _source.items(obj, dtype=dtype, name=name, layouts=layouts)
    # A stream is not listed ahead: its caches are read, counted and dropped one by one.
    listed = found if stream else list(found)
    total = 0 if stream else sum(i.nbytes for i in listed if isinstance(i, _source.Item))
    done = 0

    def step(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, max(total, done))

    rows: list[TensorRow | str] = []  # a str: the name of an accumulated row, built last
    accumulated: dict[str, _Accumulated] = {}
    skipped: list[Skipped] = []
    seconds = 0.0
    warm: set[tuple[str, str | None]] = set()
    for it in listed:
        if isinstance(it, _source.Skipped):
            skipped.append(Skipped(it.file, it.name, it.dtype, it.nbytes,
                                   "dtype not split by entropykit.formats"))
            continue
        raw = it.load()  # outside the timed part: for a compressed file this decodes
        if (it.dtype, it.layout) not in warm and raw.size:
            # The kernels' one-time JIT (or cache load) on one element, not timed either.
            count(it.dtype, raw[:_source.ITEMSIZE[it.dtype]], layout=it.layout)
            warm.add((it.dtype, it.layout))
        t0 = time.perf_counter()
        c = count(it.dtype, raw, layout=it.layout, progress=step)
        if not it.accumulate:
            rows.append(TensorRow(it.file, it.name, it.dtype, it.layout, role_of(it.name),
                                  it.shape, it.nbytes, _fields(c), log2_histogram(c),
                                  it.coded))
        else:
            if it.name not in accumulated:
                accumulated[it.name] = _Accumulated(it, c)
                rows.append(it.name)
            accumulated[it.name].add(it, c)
        seconds += time.perf_counter() - t0
    t0 = time.perf_counter()
    done_rows = tuple(accumulated[r].row() if isinstance(r, str) else r for r in rows)
    seconds += time.perf_counter() - t0
    if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__"):
        source = str(obj)
    elif stream:
        caches = len(next(iter(accumulated.values())).shapes) if accumulated else 0
        source = f"<stream of {caches} KV caches>"
    else:
        source = f"<{type(obj).__name__}>"
    return Report(source, done_rows, tuple(skipped), seconds)
