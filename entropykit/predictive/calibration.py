"""Calibration: fit the residual models of a (target, predictor) pair on sample prompts.

What it is: ``calibrate(target, predictor, prompts)`` runs both models on the prompts and
fits, per channel (layer, k/v, kv head, dim), the residual bias and std and the adaptive
model's scale coefficients, per (layer, k/v) the adaptive model's shape and the empirical
value distributions (bf16 keys, and fp8 e4m3 keys under per-layer scaling); ``Calibration``
holds them, saves them to a small safetensors file and builds the coder's tables.
What it is not: the codec (``codec``) or the residual models' definitions (``residual``).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..rans import distribution as dist
from . import residual
from .kvcache import FP8_MAX, from_transformers
from .predictors import Predictor

VERSION = 1
_ARRAYS = ("bias", "std", "coef", "shapes", "emp_bf16", "emp_fp8")


@dataclass(eq=False)
class Calibration:
    """Fitted residual parameters of one (target, predictor) pair; see module docstring.

    bias, std: float32 [layers, 2, heads, dim]; coef: float32 [layers, 2, heads, dim, 3];
    shapes: uint32 [2 layers, Z_POINTS + 1]; emp_bf16, emp_fp8: uint32 [2 layers, 257].
    """

    predictor: str
    bias: np.ndarray
    std: np.ndarray
    coef: np.ndarray
    shapes: np.ndarray
    emp_bf16: np.ndarray
    emp_fp8: np.ndarray
    tokens: int = 0
    _models: dict = field(default_factory=dict, repr=False)

    @property
    def layers(self) -> int:
        return self.bias.shape[0]

    @property
    def fingerprint(self) -> int:
        """CRC-32 of every array and the predictor's name: the codec records it."""
        crc = zlib.crc32(self.predictor.encode())
        for name in _ARRAYS:
            crc = zlib.crc32(np.ascontiguousarray(getattr(self, name)).tobytes(), crc)
        return crc

    def coder_model(self, kind: str, fmt: str) -> dist.CoderModel:
        """The coder's tables for residual model ``kind`` and value format ``fmt``."""
        key = (kind, fmt)
        if key not in self._models:
            emps = self.emp_bf16 if fmt == "bf16" else self.emp_fp8
            self._models[key] = residual.coder_model(kind, self.shapes, emps)
        return self._models[key]

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        meta = {"entropykit_kv_calibration": json.dumps(
            {"version": VERSION, "predictor": self.predictor, "tokens": self.tokens})}
        save_file({n: np.ascontiguousarray(getattr(self, n)) for n in _ARRAYS}, str(path),
                  metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        from safetensors import safe_open

        with safe_open(str(path), "numpy") as f:
            meta = json.loads((f.metadata() or {}).get("entropykit_kv_calibration", "null"))
            if not meta or meta.get("version") != VERSION:
                raise ValueError(f"{path} is not an entropykit KV calibration (version "
                                 f"{VERSION})")
            arrays = {n: f.get_tensor(n) for n in _ARRAYS}
        cal = cls(meta["predictor"], tokens=meta["tokens"], **arrays)
        cal.validate()
        return cal

    def validate(self) -> None:
        l2 = 2 * self.layers
        shapes = {"std": self.bias.shape, "coef": self.bias.shape + (3,),
                  "shapes": (l2, dist.Z_POINTS + 1), "emp_bf16": (l2, dist.EMP_POINTS + 1),
                  "emp_fp8": (l2, dist.EMP_POINTS + 1)}
        for name, shape in shapes.items():
            if getattr(self, name).shape != shape:
                raise ValueError(f"calibration {name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape}")
        for kind in residual.KINDS:  # tables rise from 0 to ONE etc.
            self.coder_model(kind, "bf16")
            self.coder_model(kind, "fp8_e4m3")


def _keys16(x: torch.Tensor) -> np.ndarray:
    bits = x.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    return np.where(bits & 0x8000, bits ^ 0xFFFF, bits ^ 0x8000).reshape(-1)


def _keys8(x: torch.Tensor) -> np.ndarray:
    amax = float(x.abs().max())
    scale = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)
    q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    bits = q.contiguous().view(torch.uint8).numpy()
    return np.where(bits & 0x80, bits ^ 0xFF, bits ^ 0x80).reshape(-1)


def calibrate(target: torch.nn.Module, predictor: Predictor,
              prompts: Iterable[Any]) -> Calibration:
    """Fit every residual model of (``target``, ``predictor``) on ``prompts``.

    ``prompts`` are token-id sequences (1-d tensors, lists, or [1, seq] tensors). Layers the
    predictor reproduces exactly are not fitted (they are coded as exact).
    """
    xs: list[list[torch.Tensor]] = []
    ps: list[list[torch.Tensor]] = []
    counts16: list[np.ndarray] = []
    counts8: list[np.ndarray] = []
    tokens = 0
    for prompt in prompts:
        ids = torch.as_tensor(prompt).reshape(1, -1)
        tokens += ids.shape[1]
        with torch.inference_mode():
            cache = from_transformers(target(ids, use_cache=True).past_key_values)
        guess = predictor.predict(ids)
        n = len(cache.keys)
        if not counts16:
            counts16 = [np.zeros(1 << 16, np.int64) for _ in range(2 * n)]
            counts8 = [np.zeros(1 << 8, np.int64) for _ in range(2 * n)]
            xs = [[] for _ in range(2 * n)]
            ps = [[] for _ in range(2 * n)]
        for layer in range(n):
            for kv in (0, 1):
                g = 2 * layer + kv
                x = cache.real(layer, kv)
                counts16[g] += np.bincount(_keys16(x), minlength=1 << 16)
                counts8[g] += np.bincount(_keys8(x), minlength=1 << 8)
                xs[g].append(x)
                ps[g].append(torch.zeros_like(x) if guess is None else guess[layer][kv])
    if not xs:
        raise ValueError("calibrate needs at least one prompt")
    n = len(xs) // 2
    heads, dim = xs[0][0].shape[1], xs[0][0].shape[3]
    bias = np.zeros((n, 2, heads, dim), np.float32)
    std = np.ones((n, 2, heads, dim), np.float32)
    coef = np.zeros((n, 2, heads, dim, 3), np.float32)
    coef[..., 0] = 1.0
    shapes = np.tile(dist.gaussian_shape(), (2 * n, 1))
    for g in range(2 * n):
        layer, kv = divmod(g, 2)
        if layer < predictor.exact_layers:
            continue
        x = torch.cat(xs[g], dim=2).numpy()
        p = torch.cat(ps[g], dim=2).numpy()
        r = x - p
        b = r.mean(axis=(0, 2))
        r -= b[None, :, None, :]
        bias[layer, kv] = b
        std[layer, kv] = np.sqrt((r.astype(np.float64) ** 2).mean(axis=(0, 2)))
        coef[layer, kv] = residual.fit_adaptive(r, p)
        sigma = residual.floor(residual.scales("adaptive", p, std[layer, kv], coef[layer, kv]),
                               p + b[None, :, None, :])
        shapes[g] = residual.fit_shape((r / sigma).reshape(-1))
    emp16 = np.stack([dist.empirical_table(c) for c in counts16])
    emp8 = np.stack([dist.empirical_table(c) for c in counts8])
    return Calibration(predictor.describe(), bias, std, coef, shapes, emp16, emp8, tokens)
