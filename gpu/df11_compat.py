"""DFloat11 0.5.0's model loader on today's environment: what it imports, provided.

What it is: device-side glue for the side-by-side with DFloat11 (pip ``dfloat11``).
``DFloat11Model.from_pretrained`` imports ``no_init_weights`` from
``transformers.modeling_utils``, which transformers 5 moved to ``transformers.initialization``
(the same context manager: torch's init functions and ``PreTrainedModel.init_weights``
do nothing inside it), and the package finds its kernel with ``pkg_resources``, which
recent setuptools no longer ship. ``install()`` puts both back where DFloat11 looks for
them, changing nothing that is already there; ``load(path, device)`` installs them and
loads a DFloat11 checkpoint as its users do.
What it is not: part of entropykit, or a change to DFloat11's code, format or kernel.

    python3 gpu/resident_check.py --size 8b-blocks --df11 /tmp/df11   (installs it itself)
"""

from __future__ import annotations

import importlib.resources
import sys
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any


def _no_init_weights() -> Callable[[], AbstractContextManager]:
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
        mu.no_init_weights = _no_init_weights()
    try:
        import pkg_resources  # noqa: F401
    except ImportError:
        sys.modules["pkg_resources"] = _pkg_resources()


def load(path: str, device: str, **kwargs: Any) -> Any:
    """``DFloat11Model.from_pretrained(path, device=device, **kwargs)`` with ``install()``
    done first: the model built from the checkpoint's config.json, its blocks decoding
    with DFloat11's kernel."""
    install()
    from dfloat11 import DFloat11Model

    return DFloat11Model.from_pretrained(path, device=device, **kwargs)
