"""Byte/field entropy analysis: how much could a checkpoint shrink, and where is the slack?

What it is: ``analyze(path_or_tensor_or_kv_cache)`` -> ``Report``: for every tensor (a
KV cache's per-layer keys and values; for a stream of caches, counted together per layer
and k/v) and every field of the formats split (the very streams the coders see), exact
order-0 entropy, the conditional entropies the coders use, bits allocated against bits
carried, the achievable ratio, and aggregates per dtype and per tensor role; JSON and a
terminal table (``Report.to_json``, ``Report.to_table``), PNG plots (``plots.plot``, needs
matplotlib) and the ``entropykit analyze`` command (``cli.main``). What it is not: a
coder; nothing here compresses.

Modules: ``_source`` (inputs), ``counts`` (Numba histograms), ``magnitude`` (log2|w|),
``roles`` (tensor roles by name), ``analyze`` (the driver), ``report`` (data model, JSON,
table), ``plots``, ``cli``.
"""

from .analyze import analyze
from .report import FieldRow, Group, GroupField, Report, Skipped, TensorRow

__all__ = ["FieldRow", "Group", "GroupField", "Report", "Skipped", "TensorRow", "analyze"]
