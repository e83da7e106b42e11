"""Hugging Face integration: compressed checkpoint directories load with ``from_pretrained``.

What it is: ``register()``, which registers the entropykit quantizer with
transformers (``_quantizer.py``), and ``EntropyKitConfig`` (from there, imported when
asked for: ``EntropyKitConfig(resident=True)`` passed to ``from_pretrained`` keeps the
weights coded on the device, see ``entropykit.torch``). ``import entropykit`` calls
``install()``: it registers at once if transformers is already imported, and otherwise
when transformers imports its quantizer registry, so importing entropykit never imports
transformers.
The ``config.json`` mark that routes a compressed directory here is re-exported from
``entropykit.container.config_mark``, where the directory writer applies it.
What it is not: the quantizer itself (``_quantizer.py``) or the decoding.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

from ..container.config_mark import (  # noqa: F401 - the mark, re-exported
    CONFIG,
    MARK_VERSION,
    QUANT_METHOD,
    mark_dir,
    marked,
    unmark_dir,
    unmarked,
)

_REGISTRY = "transformers.quantizers.auto"


def __getattr__(name: str) -> Any:
    # The config class needs transformers: imported when asked for, not with the package.
    if name == "EntropyKitConfig":
        from ._quantizer import EntropyKitConfig

        return EntropyKitConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the entropykit quantizer with transformers (imports transformers)."""
    from . import _quantizer

    _quantizer.register()


class _Hook(importlib.abc.MetaPathFinder):
    """Runs ``register`` right after transformers' quantizer registry is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if name != _REGISTRY:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Then(spec.loader)
        return spec


class _Then(importlib.abc.Loader):
    """A loader that runs ``register`` after the module it wraps has executed."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _uninstall()
        if __name__ + "._quantizer" in sys.modules:
            return  # being imported (it imported transformers): it registers at its end
        try:
            register()
        except Exception as e:  # a transformers without the registry must still import
            warnings.warn(f"entropykit: could not register with transformers ({e}); "
                          "compressed checkpoints will not load with from_pretrained",
                          stacklevel=2)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code... for tools
        return getattr(self._inner, name)


def _uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def install() -> None:
    """Register now if transformers' quantizer registry is loaded, else when it is."""
    if _REGISTRY in sys.modules:
        register()
    elif importlib.util.find_spec("transformers") is not None and \
            not any(isinstance(f, _Hook) for f in sys.meta_path):
        sys.meta_path.insert(0, _Hook())
