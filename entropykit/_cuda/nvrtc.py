"""Building and launching the package's CUDA kernels: NVRTC through CuPy, on torch's stream.

What it is: the one cache of builds (each compiled once a process, keyed by what makes it
differ), the package's kernel sources behind the status prologue
(``entropykit._status``), kernel arguments from tensors and numbers, and launches on
torch's current stream (CuPy's view of it). CuPy and torch are imported at first use, so
the host code that imports this module runs without them.
What it is not: any kernel's arguments, layout or checks (the backends' modules).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import numpy as np

from .._status import cuda_prologue

_lock = threading.Lock()
_built: dict[tuple, Any] = {}  # builds (and their functions), kept for the process
_external: dict[tuple[int, int], Any] = {}  # CuPy's views of torch's streams


def source(package: str, name: str) -> str:
    """The CUDA source file ``name`` of ``package`` (the kernel's own), after the status
    prologue."""
    return cuda_prologue() + resources.files(package).joinpath(name).read_text()


def cached(key: tuple, build: Callable[[], Any]) -> Any:
    """``build()``'s result, built once for ``key``."""
    with _lock:
        if key not in _built:
            _built[key] = build()
        return _built[key]


def kernel(name: str, code: Callable[[], str], options: tuple = ()) -> Any:
    """The RawKernel ``name`` of the CUDA source ``code()``, built once a process (the
    small kernels beside the decoders: relayout, affine, group_params)."""
    import cupy as cp

    return cached(("kernel", name), lambda: cp.RawKernel(code(), name, options=options))


def function(module: Any, name: str) -> Any:
    """Kernel ``name`` of a cached module (kept with it)."""
    return cached(("function", id(module), name), lambda: module.get_function(name))


def stream() -> Any:
    """Torch's current stream, as CuPy sees it, so launches order with torch's work."""
    import torch

    return view(torch.cuda.current_stream().cuda_stream)


def view(handle: int) -> Any:
    """CuPy's view of the stream ``handle`` (a raw ``cudaStream_t`` of the current device;
    0: the legacy default stream). The view of a (handle, device) is kept (a stream's
    handle names it until it is destroyed, and the view holds nothing else), so a launch
    does not build one each time."""
    import cupy as cp

    if not handle:
        return cp.cuda.Stream.null
    key = (handle, cp.cuda.runtime.getDevice())
    s = _external.get(key)
    if s is None:
        if len(_external) >= 256:  # streams made and dropped in a loop: start over
            _external.clear()
        s = _external[key] = cp.cuda.ExternalStream(handle)
    return s


def args(*xs: Any) -> tuple:
    """Kernel arguments: tensors by device address (None: a null pointer), ints as int64
    unless wrapped in a numpy scalar already (np.int32, np.float32)."""
    import torch

    out = []
    for x in xs:
        if x is None:
            out.append(np.uint64(0))
        elif isinstance(x, torch.Tensor):
            out.append(np.uint64(x.data_ptr()))
        elif isinstance(x, (np.integer, np.floating)):
            out.append(x)
        else:
            out.append(np.int64(x))
    return tuple(out)


def launch(device: Any, launches: Sequence[tuple[Any, int, int, tuple, int]]) -> None:
    """(kernel, grid, block, args, shared bytes) launches in order on torch's current
    stream of ``device`` (an indexed torch.device; one CuPy device and stream context for
    all)."""
    import cupy as cp

    with cp.cuda.Device(device.index), stream():
        for k, grid, block, a, shared in launches:
            if shared > 48 * 1024:
                k.max_dynamic_shared_size_bytes = shared
            k((grid,), (block,), a, shared_mem=shared)
