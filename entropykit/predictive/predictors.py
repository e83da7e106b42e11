"""Predictors: cheap models that guess a target model's KV cache from the same tokens.

What it is: one small interface (``Predictor.predict(input_ids)`` -> per layer (keys,
values) guesses in real units, float32, the cache's shape, on the target's device; or None
for "no guess") and three predictors: ``NoPredictor`` (no model: the calibrated
per-channel means are the whole guess), ``FP8Predictor`` (the target with every Linear
weight quantized to float8 e4m3, one scale per output channel, run in the target's dtype)
and ``EarlyExitPredictor`` (the target's first k layers run exactly; every deeper layer's
keys and values are its own projections of the hidden state after layer k). What it is
not: a residual model (how far the truth lands from the guess is ``residual``'s business).

Determinism: encoder and decoder run the same predictor and must get bit-identical
guesses: same weights, torch build, device type and ``torch.get_num_threads()``. The
codec records a CRC of what the predictor produced and says so when they differ.
Only Llama-style decoder models (``model.model.layers[i].self_attn.{k,v}_proj``,
``input_layernorm``, rotary embeddings) are supported by the early-exit predictor.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

Prediction = list[tuple[torch.Tensor, torch.Tensor]]


class Predictor(ABC):
    """Guesses a target's KV cache. ``exact_layers``: leading layers guessed exactly."""

    name: str = "predictor"
    exact_layers: int = 0

    @abstractmethod
    def predict(self, input_ids: torch.Tensor) -> Prediction | None:
        """Per layer (keys, values), float32 in real units, or None (guess zero)."""

    def flops_fraction(self) -> float:
        """The predictor's Linear-layer FLOPs per token over the target's (0 = free)."""
        return 0.0

    def describe(self) -> str:
        """What the codec records to say which predictor coded a blob."""
        return self.name


def _cache_tensors(cache: Any, n_layers: int) -> Prediction:
    return [(layer.keys.float(), layer.values.float()) for layer in cache.layers[:n_layers]]


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s weights live: the device its inputs must be on."""
    return next(model.parameters()).device


def _layer_flops(cfg: Any) -> tuple[float, float]:
    """(all Linear FLOPs of one decoder layer, those of its k_proj + v_proj), per token."""
    h = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q = h * cfg.num_attention_heads * hd
    kv = 2 * h * cfg.num_key_value_heads * hd
    mlp = 3 * h * cfg.intermediate_size
    return 2.0 * (2 * q + kv + mlp), 2.0 * kv


class NoPredictor(Predictor):
    """No model at all: the guess is zero, so the calibrated channel means are the guess."""

    name = "none"

    def predict(self, input_ids: torch.Tensor) -> Prediction | None:
        return None


def quantize_fp8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` through float8 e4m3 with one scale per output channel (row), back in w's dtype."""
    wf = w.float()
    scale = wf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / 448.0
    return ((wf / scale).to(torch.float8_e4m3fn).float() * scale).to(w.dtype)


class FP8Predictor(Predictor):
    """The target with its Linear weights quantized to fp8 e4m3 (per output channel)."""

    name = "fp8-of-target"

    def __init__(self, target: nn.Module) -> None:
        self.model = copy.deepcopy(target).eval()
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(quantize_fp8_rows(module.weight))
        self.n_layers = self.model.config.num_hidden_layers

    def predict(self, input_ids: torch.Tensor) -> Prediction:
        with torch.inference_mode():
            out = self.model.model(input_ids.to(model_device(self.model)), use_cache=True)
        return _cache_tensors(out.past_key_values, self.n_layers)

    def flops_fraction(self) -> float:
        return 1.0


class EarlyExitPredictor(Predictor):
    """The target's first ``k`` layers exactly; layer l >= k from the hidden state after k.

    Layer l's guess is layer l's own input norm, k/v projections and rotary embedding
    applied to the hidden state that leaves layer k-1 (instead of the one entering l).
    For l = k that hidden state is the one entering layer k, and the same operations give
    layer k's cache bit for bit: ``exact_layers`` is k + 1 (k for k = n).
    """

    name = "early-exit"

    def __init__(self, target: nn.Module, k: int) -> None:
        n = target.config.num_hidden_layers
        if not 1 <= k <= n:
            raise ValueError(f"k must be in 1..{n}, got {k}")
        self.target, self.k, self.n_layers = target, k, n
        self.exact_layers = min(k + 1, n)

    def describe(self) -> str:
        return f"{self.name}-{self.k}"

    def predict(self, input_ids: torch.Tensor) -> Prediction:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        body = self.target.model
        layers = body.layers
        captured: dict[str, torch.Tensor] = {}

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            captured["h"] = output[0] if isinstance(output, tuple) else output

        hook = layers[self.k - 1].register_forward_hook(keep)
        body.layers = nn.ModuleList(list(layers)[: self.k])
        try:
            with torch.inference_mode():
                out = body(input_ids.to(model_device(body)), use_cache=True)
        finally:
            body.layers = layers
            hook.remove()
        guess = _cache_tensors(out.past_key_values, self.k)
        h = captured["h"]
        b, s = input_ids.shape
        with torch.inference_mode():
            positions = torch.arange(s, device=h.device).unsqueeze(0).expand(b, s)
            cos, sin = body.rotary_emb(h, positions)
            for layer in layers[self.k :]:
                attn = layer.self_attn
                x = layer.input_layernorm(h)
                shape = (b, s, -1, attn.head_dim)
                keys = attn.k_proj(x).view(shape).transpose(1, 2)
                values = attn.v_proj(x).view(shape).transpose(1, 2)
                _, keys = apply_rotary_pos_emb(keys, keys, cos, sin)
                guess.append((keys.float(), values.float()))
        return guess

    def flops_fraction(self) -> float:
        full, kv = _layer_flops(self.target.config)
        return (self.k * full + (self.n_layers - self.k) * kv) / (self.n_layers * full)
