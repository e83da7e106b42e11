"""``analyze``: count every field of every tensor of an input and build the Report.

What it is: the driver from an input (file, directory, array, tensor, mapping; see
_source.py) through exact counts (counts.py) to entropies per field (this module's
arithmetic) and a ``Report``. What it is not: the report's aggregates, JSON or table
(report.py), or plots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping

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
    e.g. raw uint8 bytes; ``name``: the row's name), or a mapping of names to arrays or
    tensors. ``layouts`` overrides the packed 4-bit detection per tensor name (a layout of
    ``entropykit.formats.LAYOUTS`` or None). ``progress(done_bytes, total_bytes)`` is
    called as counting goes. For an entropykit-compressed file, the tensors are decoded
    one by one and each row's ``coded`` holds the size entropykit achieved.
    """
    listed = list(_source.items(obj, dtype=dtype, name=name, layouts=layouts))
    total = sum(i.nbytes for i in listed if isinstance(i, _source.Item))
    done = 0

    def step(nbytes: int) -> None:
        nonlocal done
        done += nbytes
        if progress is not None:
            progress(done, total)

    rows: list[TensorRow] = []
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
        row = TensorRow(it.file, it.name, it.dtype, it.layout, role_of(it.name), it.shape,
                        it.nbytes, _fields(c), log2_histogram(c), it.coded)
        seconds += time.perf_counter() - t0
        rows.append(row)
    source = str(obj) if isinstance(obj, (str, bytes)) or hasattr(obj, "__fspath__") else (
        f"<{type(obj).__name__}>")
    return Report(source, tuple(rows), tuple(skipped), seconds)
