"""A model's KV cache as the codec sees it: per-layer key and value tensors.

What it is: ``KVCache`` (keys and values per layer, [batch, kv_heads, seq, head_dim], of
bf16, fp16, fp32, fp8 e4m3 or fp8 e5m2; for fp8 caches one float32 scale per layer and
k/v, real value = fp8 value * scale), its conversion from and to a transformers
``Cache``, and ``to_fp8`` (the per-layer-scaled fp8 quantization of a cache). What it is
not: a predictor or a coder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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


@dataclass
class KVCache:
    """Per-layer keys and values; ``scales`` (float32 [layers, 2]) iff the dtype is fp8."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values) or not self.keys:
            raise ValueError("need the same non-zero number of key and value tensors")
        shape, dtype = self.keys[0].shape, self.keys[0].dtype
        if dtype not in DTYPES:
            raise TypeError(f"cache dtype must be one of {sorted(map(str, DTYPES))}, "
                            f"got {dtype}")
        for t in self.keys + self.values:
            if t.shape != shape or t.dtype != dtype or t.dim() != 4:
                raise ValueError("every key and value tensor must have one 4-d shape and dtype")
        if (dtype in FP8_MAXES) != (self.scales is not None):
            raise ValueError("an fp8 cache needs scales [layers, 2]; other caches have none")
        if self.scales is not None and tuple(self.scales.shape) != (len(self.keys), 2):
            raise ValueError(f"scales must have shape ({len(self.keys)}, 2)")

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def format(self) -> str:
        """The value format name the coder uses ("bf16", "fp16", "fp32", "fp8_e4m3",
        "fp8_e5m2")."""
        return DTYPES[self.dtype]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(batch, kv_heads, seq, head_dim) of every tensor."""
        return tuple(self.keys[0].shape)  # type: ignore[return-value]

    def tensor(self, layer: int, kv: int) -> torch.Tensor:
        """Layer ``layer``'s keys (kv = 0) or values (kv = 1)."""
        return (self.keys if kv == 0 else self.values)[layer]

    def real(self, layer: int, kv: int) -> torch.Tensor:
        """The values in real units, float32 (fp8 values times their scale)."""
        t = self.tensor(layer, kv).float()
        return t if self.scales is None else t * self.scales[layer, kv]

    def equal(self, other: KVCache) -> bool:
        """Bit-for-bit equality of every tensor and scale."""
        same = all(torch.equal(_bits(a), _bits(b))
                   for a, b in zip(self.keys + self.values, other.keys + other.values,
                                   strict=True))
        if self.scales is None or other.scales is None:
            return same and self.scales is None and other.scales is None
        return same and torch.equal(self.scales, other.scales)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def from_transformers(cache: Any) -> KVCache:
    """The keys and values of a transformers ``Cache`` (one with ``.layers``), not copied."""
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if not layers:
        raise ValueError("the cache holds no initialized layers")
    return KVCache([layer.keys for layer in layers], [layer.values for layer in layers])


def to_transformers(cache: KVCache) -> Any:
    """A transformers ``DynamicCache`` holding copies of ``cache`` (not fp8 caches)."""
    from transformers import DynamicCache

    if cache.scales is not None:
        raise ValueError("transformers caches hold unscaled tensors: dequantize an fp8 "
                         "cache first")
    out = DynamicCache()
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        out.update(k.clone(), v.clone(), i)
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
            x = cache.tensor(layer, kv).float()
            amax = float(x.abs().max())
            scale = amax / top if 0 < amax < float("inf") else 1.0
            scales[layer, kv] = scale
            out[kv].append((x / scales[layer, kv]).clamp(-top, top).to(dtype))
    return KVCache(out[0], out[1], scales)
