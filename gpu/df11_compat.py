"""DFloat11 0.5.0's model loader on today's environment: what it imports, provided.

What it is: device-side glue for the side-by-side with DFloat11 (pip ``dfloat11``).
``DFloat11Model.from_pretrained`` imports ``no_init_weights`` from
``transformers.modeling_utils``, which transformers 5 moved to ``transformers.initialization``
(the same context manager: torch's init functions and ``PreTrainedModel.init_weights``
do nothing inside it), and the package finds its kernel with ``pkg_resources``, which
recent setuptools no longer ship. ``install()`` puts both back where DFloat11 looks for
them, changing nothing that is already there; ``load(path, device)`` installs them and
loads a DFloat11 checkpoint as its users do. On a CPU device ``load`` gives DFloat11's
module a stand-in for its kernel launch (``cpu_kernel``: ``df11_codec.decode_reference`` on
the same buffers, into the same output), so that its loader, hooks and weight injection run
unchanged and the model can be checked against the plain one without a GPU.
What it is not: part of entropykit, or a change to DFloat11's code, format or kernel.

    python3 gpu/resident_check.py --size 8b-blocks --df11 /tmp/df11   (installs it itself)
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.resources
import importlib.util
import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any


def find_no_init_weights() -> Callable[[], AbstractContextManager]:
    """transformers' ``no_init_weights`` wherever this version keeps it."""
    import transformers.modeling_utils as mu

    found = getattr(mu, "no_init_weights", None)
    if found is None:
        from transformers.initialization import no_init_weights as found
    return found


def _pkg_resources() -> types.ModuleType:
    """A ``pkg_resources`` with the one function DFloat11 calls."""
    module = types.ModuleType("pkg_resources")

    def resource_filename(package: str, name: str) -> str:
        return str(importlib.resources.files(package).joinpath(name))

    module.resource_filename = resource_filename
    return module


def install() -> None:
    """Give DFloat11 what it imports: ``transformers.modeling_utils.no_init_weights`` and
    ``pkg_resources.resource_filename`` (each only where missing)."""
    import transformers.modeling_utils as mu

    if not hasattr(mu, "no_init_weights"):
        mu.no_init_weights = find_no_init_weights()
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        sys.modules["pkg_resources"] = _pkg_resources()


def _host_bytes(address: int, n: int) -> Any:
    import numpy as np

    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address)) if n else (
        np.zeros(0, np.uint8))


def cpu_kernel(grid: tuple, block: tuple, shared_mem: int, args: list) -> None:
    """DFloat11's ``decode`` launch, its arguments as its hook passes them (host addresses
    of CPU tensors: tables, codes, sign and mantissa bytes, positions, gaps, output; table
    count, code bytes, values), done by ``df11_codec.decode_reference``."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import df11_codec

    luts, encoded, sign_mantissa, _positions, _gaps, out, n_luts, n_bytes, n = args
    as_tensor = lambda a, size: torch.from_numpy(_host_bytes(a, size))  # noqa: E731
    bits = df11_codec.decode_reference(as_tensor(luts, 256 * int(n_luts)).view(-1, 256),
                                       as_tensor(encoded, int(n_bytes)),
                                       as_tensor(sign_mantissa, int(n)))
    as_tensor(out, 2 * int(n)).copy_(bits.view(torch.uint8))


def _cpu_cupy() -> types.ModuleType:
    """As much of CuPy as DFloat11's module uses, its kernel being ``cpu_kernel``."""
    module = types.ModuleType("cupy")

    class RawModule:
        def __init__(self, path: str) -> None:
            self.path = path

        def get_function(self, name: str) -> Callable:
            return cpu_kernel

    module.RawModule = RawModule
    module.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    return module


def use_cpu_kernel() -> None:
    """DFloat11's module, imported (with the stand-in as its CuPy where CuPy is missing)
    and then using ``cpu_kernel``: for the rest of the process, its hooks decode on the CPU."""
    stand_in = _cpu_cupy()
    if "dfloat11.dfloat11" not in sys.modules and importlib.util.find_spec("cupy") is None:
        sys.modules["cupy"] = stand_in  # for DFloat11's import only: others see no CuPy
        try:
            from dfloat11 import dfloat11
        finally:
            del sys.modules["cupy"]
    from dfloat11 import dfloat11

    dfloat11.cp = stand_in
    dfloat11._decode = cpu_kernel


def load(path: str, device: str, **kwargs: Any) -> Any:
    """``DFloat11Model.from_pretrained(path, device=device, **kwargs)`` with ``install()``
    done first: the model built from the checkpoint's config.json, its blocks decoding
    with DFloat11's kernel (on a CPU device, with ``cpu_kernel`` in its place)."""
    install()
    if str(device).startswith("cpu"):
        use_cpu_kernel()
    from dfloat11 import DFloat11Model

    return DFloat11Model.from_pretrained(path, device=device, **kwargs)


def coded_modules(model: Any) -> list[tuple[str, Any]]:
    """The modules of a DFloat11 model that hold coded weights (name, module)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "encoded_exponent")]


def computed_buffers(model: Any) -> dict[str, Any]:
    """The non-persistent buffers of ``model`` by name: what its code computes when it is
    built (the rotary frequencies), which no checkpoint stores."""
    return {f"{prefix}.{name}".removeprefix("."): buf
            for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name in module._non_persistent_buffers_set}


def _raw(t: Any) -> Any:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _differs(name: str, got: Any, ref: Any | None) -> str | None:
    """Why ``got`` is not ``ref`` bit for bit (None where it is)."""
    import torch

    if ref is None:
        return f"{name}: not in the plain model"
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return (f"{name}: {got.dtype} {tuple(got.shape)}, the plain model's {ref.dtype} "
                f"{tuple(ref.shape)}")
    if not torch.equal(_raw(got), _raw(ref).to(got.device)):
        return f"{name}: other values"
    return None


def weight_mismatches(model: Any, plain: Any) -> list[str]:
    """What a checkpoint stores of the DFloat11 ``model`` that is not ``plain``'s, bit for
    bit, by name: each coded unit decoded by its own hook (the weights it injects, under
    their modules' names) and every other state-dict entry (persistent parameters and
    buffers); empty where the checkpoint is of the same model. Computed buffers are
    ``computed_mismatches``' concern."""
    import torch

    want = {k: v for k, v in plain.state_dict().items()
            if k.rsplit(".", 1)[-1] not in _CODED_BUFFERS}
    found: list[str] = []
    seen: set[str] = set()

    def check(name: str, got: torch.Tensor) -> None:
        seen.add(name)
        why = _differs(name, got, want.get(name))
        if why:
            found.append(why)

    names = {id(m): n for n, m in model.named_modules()}
    with torch.no_grad():
        for _name, module in coded_modules(model):
            for hook in module._forward_pre_hooks.values():
                hook(module, ())  # DFloat11's decode, injecting the weights
            # checked now: the next unit decodes over the same buffer
            for sub in getattr(module, "weight_injection_modules", [module]):
                check(f"{names[id(sub)]}.weight".removeprefix("."), sub.weight)
        for name, value in model.state_dict().items():
            if name.rsplit(".", 1)[-1] not in _CODED_BUFFERS:
                check(name, value)
    return found + [f"{name}: missing" for name in want if name not in seen]


def computed_mismatches(model: Any, plain: Any) -> list[str]:
    """The computed buffers (``computed_buffers``) of ``model`` that are not ``plain``'s
    bit for bit, by name: where the two models' code ran on other devices (float32 on a CPU
    and a GPU rounds differently), not a difference of checkpoints."""
    got, want = computed_buffers(model), computed_buffers(plain)
    found = [_differs(name, value, want.get(name)) for name, value in got.items()]
    return [f for f in found if f] + [f"{name}: missing" for name in want if name not in got]


def copy_computed(model: Any, plain: Any) -> list[str]:
    """``plain``'s computed buffers copied into ``model`` where their values differ (each
    stays on its device; other names, dtypes or shapes raise ValueError); the names
    copied."""
    import torch

    got, want = computed_buffers(model), computed_buffers(plain)
    names = [m.split(":")[0] for m in computed_mismatches(model, plain)]
    with torch.no_grad():
        for name in names:
            ref = want.get(name)
            if ref is None or name not in got or (got[name].dtype, got[name].shape) != (
                    ref.dtype, ref.shape):
                raise ValueError(f"{name}: the two models' computed buffers do not match")
            got[name].copy_(ref)
    return names


# DFloat11's buffers of a coded unit: its code, not weights of the model
_CODED_BUFFERS = frozenset({"luts", "encoded_exponent", "sign_mantissa", "output_positions",
                            "gaps", "split_positions"})
