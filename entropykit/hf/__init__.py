"""Hugging Face integration: compressed checkpoint directories load with ``from_pretrained``.

What it is: the mark a compressed checkpoint directory carries in its ``config.json``
(``mark`` / ``unmark``: a ``quantization_config`` entry naming ``quant_method:
"entropykit"`` and holding the original ``config.json`` text, so decompression restores
it byte for byte), and ``register()``, which registers the entropykit quantizer with
transformers (``_quantizer.py``), and ``EntropyKitConfig`` (from there, imported when
asked for: ``EntropyKitConfig(resident=True)`` passed to ``from_pretrained`` keeps the
weights coded on the device, see ``entropykit.torch``). ``import entropykit`` calls
``install()``: it registers at once if transformers is already imported, and otherwise
when transformers imports its quantizer registry, so importing entropykit never imports
transformers.
What it is not: the quantizer itself (``_quantizer.py``) or the decoding.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

QUANT_METHOD = "entropykit"
CONFIG = "config.json"
MARK_VERSION = 1
_KEY = "quantization_config"
_ORIGINAL = "original_config"  # the original config.json text, for byte-exact restore
_REGISTRY = "transformers.quantizers.auto"


def marked(raw: bytes) -> bytes | None:
    """``config.json`` bytes with the entropykit mark added, or None when they cannot
    carry it (not a UTF-8 JSON object, or one that already has a quantization config)."""
    try:
        text = raw.decode("utf-8")
        obj = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError):  # not JSON we can mark
        return None
    if not isinstance(obj, dict) or _KEY in obj:
        return None
    obj[_KEY] = {"quant_method": QUANT_METHOD, "version": MARK_VERSION, _ORIGINAL: text}
    out = (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return out if unmarked(out) == raw else None


def unmarked(raw: bytes) -> bytes | None:
    """The original ``config.json`` bytes of a marked one; None if ``raw`` has no mark."""
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # not JSON we can mark
        return None
    q = obj.get(_KEY) if isinstance(obj, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        return None
    if not isinstance(q.get(_ORIGINAL), str):
        return None
    return q[_ORIGINAL].encode("utf-8")


def mark_dir(src: Path, out: Path) -> None:
    """Mark ``out/config.json`` (copied from ``src``) as an entropykit checkpoint; left as
    it is when it cannot carry the mark."""
    del src
    cfg = out / CONFIG
    if cfg.is_file():
        new = marked(cfg.read_bytes())
        if new is not None:
            cfg.write_bytes(new)


def unmark_dir(src: Path, out: Path) -> None:
    """Restore the original ``out/config.json`` (copied from ``src``) if it is marked."""
    del src
    cfg = out / CONFIG
    if cfg.is_file():
        old = unmarked(cfg.read_bytes())
        if old is not None:
            cfg.write_bytes(old)


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
