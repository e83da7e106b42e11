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

Any decoder-only transformers model whose decoder (``get_decoder()``) holds its layers
in one ``ModuleList`` and returns its cache works: the predictors run the model's own
layers (so their rotary embeddings, key norms, sliding windows and fused projections are
the model's), never its attention internals. ``FP8Predictor`` rounds ``nn.Linear`` and
transformers' ``Conv1D`` (GPT-2) weights.
"""

from __future__ import annotations

import copy
import threading
from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import nn

Prediction = list[tuple[torch.Tensor, torch.Tensor] | None]  # None: a layer without KV


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


def output_cache(out: Any) -> Any:
    """The cache a transformers model's output holds (``cache``; ``past_key_values`` in
    older releases)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


def _cache_tensors(cache: Any) -> Prediction:
    out: Prediction = []
    for layer in cache.layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        out.append(None if k is None or v is None or not k.numel()
                   else (k.float(), v.float()))
    return out


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s weights live: the device its inputs must be on."""
    return next(model.parameters()).device


def decoder_layers(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """(``model``'s decoder, its ``ModuleList`` of decoder layers): the decoder is
    ``get_decoder()`` (else ``base_model``, else the model), the layers its one
    ``ModuleList`` with as many entries as the config's ``num_hidden_layers``.
    ``ValueError`` naming the model class where either is missing."""
    name = type(model).__name__
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(
        model, "base_model", model)
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config(decoder=True)
    n = getattr(cfg, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ValueError(f"{name}: unsupported model: its config has no num_hidden_layers")
    lists = [m for m in body.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if len(lists) != 1:
        raise ValueError(f"{name}: unsupported model: its decoder {type(body).__name__} "
                         f"has {len(lists)} ModuleLists of {n} layers, not one")
    return body, lists[0]


_FUSED_QKV = ("c_attn", "qkv_proj", "query_key_value", "Wqkv")
_KV_PROJ = ("k_proj", "v_proj", "key", "value", "kv_a_proj_with_mqa", "kv_b_proj")


def _linear_weights(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, weight) of every Linear-like module (nn.Linear, transformers' Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    return [(n, m.weight) for n, m in module.named_modules()
            if isinstance(m, (nn.Linear, Conv1D))]


def _kv_weights(layer: nn.Module, cfg: Any) -> float:
    """Weights of ``layer``'s key and value projections: k_proj / v_proj (key / value;
    multi-head latent attention's kv_a / kv_b), or their share of a fused qkv projection
    (GPT-2's ``c_attn``)."""
    heads = getattr(cfg, "num_attention_heads", 1)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    total = 0.0
    for name, w in _linear_weights(layer):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in _KV_PROJ:
            total += w.numel()
        elif leaf in _FUSED_QKV:
            total += w.numel() * 2 * kv_heads / (heads + 2 * kv_heads)
    return total


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
        from transformers.pytorch_utils import Conv1D

        self.model = copy.deepcopy(target).eval()
        self.body, _ = decoder_layers(self.model)
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, nn.Linear):
                    module.weight.copy_(quantize_fp8_rows(module.weight))
                elif isinstance(module, Conv1D):  # weight [in, out]: a column per output
                    module.weight.copy_(quantize_fp8_rows(module.weight.T).T)

    def predict(self, input_ids: torch.Tensor) -> Prediction:
        with torch.inference_mode():
            out = self.body(input_ids.to(model_device(self.model)), use_cache=True)
        return _cache_tensors(output_cache(out))

    def flops_fraction(self) -> float:
        return 1.0


class EarlyExitPredictor(Predictor):
    """The target's first ``k`` layers exactly; layer l >= k from the hidden state after k.

    Layer l's guess is what layer l writes to the cache when its input is the hidden state
    that leaves layer k-1 (instead of the one entering l): its own input norm, k/v
    projections, key norm and rotary embedding, as the model computes them. For l = k that
    hidden state is the one entering layer k, so layer k's cache is exact: ``exact_layers``
    is k + 1 (k for k = n). The deeper layers run whole on that hidden state (their
    outputs are discarded), so the guess costs a full forward pass of the target;
    ``flops_fraction`` counts only what the guess needs.
    """

    name = "early-exit"

    def __init__(self, target: nn.Module, k: int) -> None:
        self.body, self.layers = decoder_layers(target)
        n = len(self.layers)
        if not 1 <= k <= n:
            raise ValueError(f"k must be in 1..{n}, got {k}")
        self.target, self.k, self.n_layers = target, k, n
        self.exact_layers = min(k + 1, n)

    def describe(self) -> str:
        return f"{self.name}-{self.k}"

    def predict(self, input_ids: torch.Tensor) -> Prediction:
        layers = self.layers
        captured: dict[str, torch.Tensor] = {}
        # The hooks are the shared layers': passes of the target (or other guesses) that
        # run side by side on other threads must go through them untouched.
        mine = threading.get_ident()

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if threading.get_ident() == mine:
                captured["h"] = output[0] if isinstance(output, tuple) else output

        def replace(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if threading.get_ident() != mine:
                return args, kwargs
            if args:
                return (captured["h"], *args[1:]), kwargs
            if "hidden_states" not in kwargs:
                raise ValueError(f"{type(module).__name__}: unsupported decoder layer: its "
                                 f"hidden state is not its first argument")
            return args, kwargs | {"hidden_states": captured["h"]}

        hooks = [layers[self.k - 1].register_forward_hook(keep)]
        hooks += [layer.register_forward_pre_hook(replace, with_kwargs=True)
                  for layer in list(layers)[self.k + 1 :]]
        try:
            with torch.inference_mode():
                out = self.body(input_ids.to(model_device(self.body)), use_cache=True)
        finally:
            for hook in hooks:
                hook.remove()
        return _cache_tensors(output_cache(out))

    def flops_fraction(self) -> float:
        cfg = self.target.config
        cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        full = [sum(w.numel() for _, w in _linear_weights(layer)) for layer in self.layers]
        kv = [_kv_weights(layer, cfg) for layer in self.layers]
        if not any(kv):
            raise ValueError(f"{type(self.target).__name__}: no key/value projection "
                             f"({', '.join(_KV_PROJ + _FUSED_QKV)}) in its decoder layers")
        return (sum(full[: self.k]) + sum(kv[self.k :])) / sum(full)
