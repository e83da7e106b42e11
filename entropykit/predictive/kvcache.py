"""A model's KV cache as the codec sees it: per-layer key and value tensors, bf16 or fp8.

What it is: ``KVCache`` (keys and values per layer, [batch, kv_heads, seq, head_dim]; for
fp8 e4m3 caches one float32 scale per layer and k/v, real value = fp8 value * scale), its
conversion from and to a transformers ``Cache``, and ``to_fp8`` (the per-layer-scaled e4m3
quantization of a bf16 cache). What it is not: a predictor or a coder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import dtypes

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# The cache dtypes the KV coder takes -> their value-format names.
DTYPES = {getattr(torch, d.torch): d.value_format
          for d in (dtypes.BY_NAME["BF16"], dtypes.BY_NAME["F8_E4M3"])}


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
            raise TypeError(f"cache dtype must be bfloat16 or float8_e4m3fn, got {dtype}")
        for t in self.keys + self.values:
            if t.shape != shape or t.dtype != dtype or t.dim() != 4:
                raise ValueError("every key and value tensor must have one 4-d shape and dtype")
        if (dtype == FP8) != (self.scales is not None):
            raise ValueError("an fp8 cache needs scales [layers, 2]; a bf16 cache has none")
        if self.scales is not None and tuple(self.scales.shape) != (len(self.keys), 2):
            raise ValueError(f"scales must have shape ({len(self.keys)}, 2)")

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def format(self) -> str:
        """The value format name the coder uses ("bf16" or "fp8_e4m3")."""
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
    return t.view(torch.int16 if t.element_size() == 2 else torch.uint8)


def from_transformers(cache: Any) -> KVCache:
    """The keys and values of a transformers ``Cache`` (one with ``.layers``), not copied."""
    layers = [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]
    if not layers:
        raise ValueError("the cache holds no initialized layers")
    return KVCache([layer.keys for layer in layers], [layer.values for layer in layers])


def to_transformers(cache: KVCache) -> Any:
    """A transformers ``DynamicCache`` holding copies of ``cache`` (bf16 caches only)."""
    from transformers import DynamicCache

    if cache.scales is not None:
        raise ValueError("transformers caches hold bf16 tensors: dequantize an fp8 cache first")
    out = DynamicCache()
    for i, (k, v) in enumerate(zip(cache.keys, cache.values, strict=True)):
        out.update(k.clone(), v.clone(), i)
    return out


def as_kvcache(cache: Any) -> KVCache:
    return cache if isinstance(cache, KVCache) else from_transformers(cache)


def to_fp8(cache: KVCache) -> KVCache:
    """e4m3 quantization with one scale per layer and k/v: scale = max |x| / 448."""
    if cache.scales is not None:
        return cache
    n = len(cache.keys)
    scales = torch.empty(n, 2, dtype=torch.float32)
    out: list[list[torch.Tensor]] = [[], []]
    for layer in range(n):
        for kv in (0, 1):
            x = cache.tensor(layer, kv).float()
            amax = float(x.abs().max())
            scale = amax / FP8_MAX if amax > 0 else 1.0
            scales[layer, kv] = scale
            out[kv].append((x / scales[layer, kv]).clamp(-FP8_MAX, FP8_MAX).to(FP8))
    return KVCache(out[0], out[1], scales)
