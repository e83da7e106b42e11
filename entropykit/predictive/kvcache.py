"""A model's KV cache as the codec sees it: per-layer key and value tensors.

What it is: ``KVCache`` (keys and values per layer, each [batch, kv_heads, seq, head_dim]
with its own heads, seq and dim: sliding-window layers hold fewer tokens, keys and values
may differ in heads or dim, and a layer without KV (a hybrid model's linear-attention
layer) holds None for both; of bf16, fp16, fp32, fp8 e4m3 or fp8 e5m2; for fp8 caches one
float32 scale per layer and k/v, real value = fp8 value * scale), ``align`` (a tensor's
last tokens, as the layers hold them), its conversion from and to a transformers
``Cache``, and ``to_fp8`` (the per-layer-scaled fp8 quantization of a cache). What it is
not: a predictor or a coder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .. import dtypes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# fp8 cache dtypes (scaled per layer and k/v) -> their largest finite value.
FP8_MAXES = {FP8: FP8_MAX, torch.float8_e5m2: 57344.0}
# The cache dtypes the KV coder takes -> their value-format names: the distribution
# coder's, and "fp32", which the codec splits into a bf16-like high half and a low half.
DTYPES = {getattr(torch, d.torch): d.value_format
          for d in (dtypes.BY_NAME[n] for n in ("BF16", "F16", "F8_E4M3", "F8_E5M2"))}
DTYPES[torch.float32] = "fp32"


Shape = tuple[int, int, int, int]  # batch, kv heads, seq, head dim
# Far above any model's: blobs and calibration files claiming more are refused.
MAX_LAYERS = 1 << 10
MAX_HEADS = 1 << 10
MAX_HEAD_DIM = 1 << 12


@dataclass
class KVCache:
    """Per-layer keys and values (None for both of a layer without KV); ``scales``
    (float32 [layers, 2]) iff the dtype is fp8."""

    keys: list[torch.Tensor | None]
    values: list[torch.Tensor | None]
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("need the same non-zero number of key and value tensors")
        for i, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            if (k is None) != (v is None):
                raise ValueError(f"layer {i} has keys or values but not both")
        present = [t for t in self.keys + self.values if t is not None]
        if not present:
            raise ValueError("the cache holds no layer with keys and values")
        dtype, batch = present[0].dtype, present[0].shape[0]
        if dtype not in DTYPES:
            raise TypeError(f"cache dtype must be one of {sorted(map(str, DTYPES))}, "
                            f"got {dtype}")
        for t in present:
            if t.dtype != dtype or t.dim() != 4 or t.shape[0] != batch or 0 in t.shape:
                raise ValueError("every key and value tensor must be 4-d, non-empty, of one "
                                 "dtype and one batch size")
        if (dtype in FP8_MAXES) != (self.scales is not None):
            raise ValueError("an fp8 cache needs scales [layers, 2]; other caches have none")
        if self.scales is not None and tuple(self.scales.shape) != (len(self.keys), 2):
            raise ValueError(f"scales must have shape ({len(self.keys)}, 2)")

    @property
    def dtype(self) -> torch.dtype:
        return next(t for t in self.keys if t is not None).dtype

    @property
    def format(self) -> str:
        """The value format name the coder uses ("bf16", "fp16", "fp32", "fp8_e4m3",
        "fp8_e5m2")."""
        return DTYPES[self.dtype]

    @property
    def shapes(self) -> list[Shape | None]:
        """Each (layer, k/v) group's (batch, kv_heads, seq, head_dim), in the order layer 0
        keys, layer 0 values, layer 1 keys, ...; None for a layer without KV."""
        return [None if t is None else tuple(t.shape)  # type: ignore[misc]
                for pair in zip(self.keys, self.values, strict=True) for t in pair]

    @property
    def shape(self) -> Shape:
        """(batch, kv_heads, seq, head_dim) of every tensor, where all have one shape
        (else ``ValueError``: see ``shapes``)."""
        shapes = set(self.shapes)
        if len(shapes) != 1 or None in shapes:
            raise ValueError("the cache's layers differ in shape (or some have no KV): "
                             "see KVCache.shapes")
        return shapes.pop()

    @property
    def batch(self) -> int:
        return next(t for t in self.keys if t is not None).shape[0]

    @property
    def device(self) -> torch.device:
        return next(t for t in self.keys if t is not None).device

    def tensor(self, layer: int, kv: int) -> torch.Tensor | None:
        """Layer ``layer``'s keys (kv = 0) or values (kv = 1); None without KV."""
        return (self.keys if kv == 0 else self.values)[layer]

    def real(self, layer: int, kv: int) -> torch.Tensor:
        """The values in real units, float32 (fp8 values times their scale)."""
        t = self.tensor(layer, kv).float()
        return t if self.scales is None else t * self.scales[layer, kv]

    def equal(self, other: KVCache) -> bool:
        """Bit-for-bit equality of every tensor and scale."""
        pairs = list(zip(self.keys + self.values, other.keys + other.values, strict=True))
        same = all(a is None and b is None or a is not None and b is not None
                   and a.shape == b.shape and a.dtype == b.dtype
                   and torch.equal(_bits(a), _bits(b)) for a, b in pairs)
        if self.scales is None or other.scales is None:
            return same and self.scales is None and other.scales is None
        return same and torch.equal(self.scales, other.scales)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def align(t: Any, seq: int) -> Any:
    """``t`` [..., s, dim] (torch or numpy) over the last ``seq`` tokens: its own last
    ones, with zeros in front where it holds fewer. A sliding-window layer holds the
    prompt's last tokens, so a group's token i and another group's token i are the same
    prompt position when both are counted from the end."""
    have = t.shape[-2]
    if have >= seq:
        return t[..., have - seq :, :]
    if isinstance(t, torch.Tensor):
        return torch.nn.functional.pad(t, (0, 0, seq - have, 0))
    pad = [(0, 0)] * (t.ndim - 2) + [(seq - have, 0), (0, 0)]
    return np.pad(t, pad)


def aligned_guess(guess: Any, layer: int, kv: int, shape: Shape) -> torch.Tensor:
    """A predictor's guess (per layer (keys, values)) for group (layer, kv) of ``shape``,
    float32 over the group's tokens (``align``); ``ValueError`` where the guess has no
    such layer or another batch, heads or head dim."""
    pair = guess[layer] if layer < len(guess) else None
    t = None if pair is None else pair[kv]
    if t is None or t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != (
            shape[0], shape[1], shape[3]):
        got = None if t is None else tuple(t.shape)
        raise ValueError(f"the predictor's guess for layer {layer} {('keys', 'values')[kv]} "
                         f"has shape {got}, the cache {tuple(shape)}")
    return align(t.float(), shape[2])


def from_transformers(cache: Any) -> KVCache:
    """The keys and values of a transformers ``Cache`` (one with ``.layers``), not copied;
    a layer that holds none (linear attention, or not yet filled) is a layer without KV."""
    layers = list(cache.layers)
    keys = [getattr(layer, "keys", None) for layer in layers]
    values = [getattr(layer, "values", None) for layer in layers]
    keys = [k if k is not None and v is not None and k.numel() else None
            for k, v in zip(keys, values, strict=True)]
    values = [v if k is not None else None for k, v in zip(keys, values, strict=True)]
    if all(k is None for k in keys):
        raise ValueError("the cache holds no initialized layers")
    return KVCache(keys, values)


def to_transformers(cache: KVCache, config: Any = None, tokens: int | None = None) -> Any:
    """A transformers ``DynamicCache`` holding copies of ``cache`` (not fp8 caches).

    Without ``config`` its layers are plain dynamic layers (empty for layers without KV).
    With the model's ``config`` they are the kinds the model uses (sliding-window layers
    among them), so that generation can go on from it; ``tokens``: the tokens the cache
    covers (default: the most any layer holds), which a sliding-window layer holding
    fewer needs to know."""
    from transformers import DynamicCache

    if cache.scales is not None:
        raise ValueError("transformers caches hold unscaled tensors: dequantize an fp8 "
                         "cache first")
    out = DynamicCache() if config is None else DynamicCache(config=config)
    seen = tokens if tokens is not None else max(k.shape[-2] for k in cache.keys if k is not None)
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        if k is not None:
            out.update(k.clone(), v.clone(), i)
            if hasattr(out.layers[i], "cumulative_length"):  # a sliding-window layer
                out.layers[i].cumulative_length = seen
    return out


def as_kvcache(cache: Any) -> KVCache:
    return cache if isinstance(cache, KVCache) else from_transformers(cache)


def to_fp8(cache: KVCache, dtype: torch.dtype = FP8) -> KVCache:
    """fp8 quantization (``dtype``: float8_e4m3fn or float8_e5m2) with one scale per layer
    and k/v: scale = max |x| / the format's largest value (448 or 57344). An fp8 cache is
    returned as it is."""
    if dtype not in FP8_MAXES:
        raise TypeError(f"dtype must be one of {sorted(map(str, FP8_MAXES))}, got {dtype}")
    if cache.scales is not None:
        return cache
    top = FP8_MAXES[dtype]
    n = len(cache.keys)
    scales = torch.empty(n, 2, dtype=torch.float32)
    out: list[list[torch.Tensor]] = [[], []]
    for layer in range(n):
        for kv in (0, 1):
            t = cache.tensor(layer, kv)
            if t is None:
                scales[layer, kv] = 1.0
                out[kv].append(None)
                continue
            x = t.float()
            amax = float(x.abs().max())
            scale = amax / top if 0 < amax < float("inf") else 1.0
            scales[layer, kv] = scale
            out[kv].append((x / scales[layer, kv]).clamp(-top, top).to(dtype))
    return KVCache(out[0], out[1], scales)
