"""The public GPU namespace: ``GpuUnavailableError`` and the batched rANS frame decoder.

What it is: names only, kept where users import them: the decoder of ``rans.cuda``
(``decode_batch``, ``decode_bf16``, ``decode_bf16_batch``, ``prepare_u8`` /
``prepare_bf16`` with ``upload``, ``check_outputs``) and the error every GPU path raises
when torch with CUDA or CuPy is missing.
What it is not: the implementations, which live beside the stages they implement:
``rans.cuda`` (static and per-value-distribution rANS), ``container.cuda`` (whole files,
``load_file(path, device="cuda")``), ``predictive.cuda`` (predictor arithmetic).
"""

from __future__ import annotations

# The decoder's own list (GpuUnavailableError among it), so the two cannot drift apart.
from .rans.cuda import *  # noqa: F403
from .rans.cuda import __all__  # noqa: F401
