"""A transformers cache layer that offloads its keys and values as a compressed blob.

What it is: ``PredictiveOffloadedLayer`` (a ``DynamicLayer`` whose ``offload()`` codes the
prompt's keys and values against the predictor's guess into host memory and frees them,
and whose ``prefetch()`` decodes them back, bit for bit), the ``KVOffloadCodec`` the layers
of one cache share (predictor, calibration, residual model, the prompt's guess), and
``PredictiveOffloadedCache``, a ``Cache`` of such layers that offloads each layer after
its update and prefetches the next one without CUDA streams, so it also runs on a CPU.
On a GPU, ``transformers.Cache(layers=[PredictiveOffloadedLayer(...)...],
offloading=True)`` uses the same layers. What it is not: a whole-cache codec (that is
``compress_kv``; the ``conditional`` residual model needs the whole cache, so offloaded
layers, coded one at a time, use ``gaussian`` or ``mixture``).

Positions beyond the prompt (tokens generated after ``set_prompt``) stay uncompressed in
host memory: the predictor's guess covers the prompt only. Supported transformers: 5.x
(tested with 5.23.0, whose ``Cache(offloading=True)`` needs CUDA).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..rans import distribution as dist
from .calibration import Calibration
from .codec import CHUNK, group_distribution, guess_arrays
from .predictors import Predictor

LAYER_MODELS = ("gaussian", "mixture")


class KVOffloadCodec:
    """What the offloaded layers of one cache share; call ``set_prompt`` before the model
    runs on the prompt. The guess is kept (float32, host) so that prefetches need not
    re-run the predictor: memory traded for time."""

    def __init__(self, predictor: Predictor, calibration: Calibration,
                 model: str = "mixture", threads: int | None = 1) -> None:
        if model not in LAYER_MODELS:
            raise ValueError(f"offloaded layers are coded one at a time: model must be one of "
                             f"{LAYER_MODELS}, got {model!r}")
        if predictor.describe() != calibration.predictor:
            raise ValueError("the calibration was fitted with another predictor")
        self.predictor, self.calibration, self.model = predictor, calibration, model
        self.threads = threads
        self.prompt_len = 0
        self._guesses: dict[tuple[int, int], np.ndarray] = {}
        self._shape: tuple[int, int, int, int] | None = None

    def set_prompt(self, input_ids: torch.Tensor) -> None:
        """Run the predictor on the prompt ([batch, seq]) whose cache will be offloaded."""
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        guess = self.predictor.predict(ids)
        cal = self.calibration
        shape = (ids.shape[0], cal.bias.shape[2], ids.shape[1], cal.bias.shape[3])
        self._guesses = guess_arrays(guess, cal.layers, shape)
        self._shape = shape
        self.prompt_len = ids.shape[1]

    def _distribution(self, layer: int, kv: int) -> tuple[np.ndarray, np.ndarray, int]:
        mu, sigma, index, _ = group_distribution(
            layer, kv, self._guesses, self._shape, self.predictor.exact_layers, self.model,
            self.calibration, None, {})
        return mu, sigma, index

    def encode(self, layer: int, kv: int, t: torch.Tensor) -> bytes:
        """One layer's keys (kv = 0) or values over the prompt, bf16 [batch, heads, seq,
        dim] on any device, as a distribution-rANS frame."""
        if t.dtype != torch.bfloat16 or tuple(t.shape) != self._shape:
            raise ValueError(f"expected bf16 {self._shape}, got {t.dtype} {tuple(t.shape)}")
        mu, sigma, index = self._distribution(layer, kv)
        bits = t.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
        return dist.encode(bits.reshape(-1), mu, sigma, self.calibration.coder_model(
            self.model, "bf16"), fmt="bf16", model_index=index, chunk_size=CHUNK,
            threads=self.threads)

    def decode(self, layer: int, kv: int, frame: bytes) -> torch.Tensor:
        """``encode``'s tensor back (bf16, CPU)."""
        mu, sigma, index = self._distribution(layer, kv)
        bits = dist.decode(frame, mu, sigma, self.calibration.coder_model(self.model, "bf16"),
                           model_index=index, threads=self.threads)
        return torch.from_numpy(bits).view(torch.bfloat16).reshape(self._shape)


class PredictiveOffloadedLayer(DynamicLayer):
    """A dynamic cache layer whose offloaded prompt part lives as compressed bytes."""

    def __init__(self, codec: KVOffloadCodec, layer_idx: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.codec, self.layer_idx = codec, layer_idx
        self._frames: tuple[bytes, bytes] | None = None
        self._tail: tuple[torch.Tensor, torch.Tensor] | None = None
        self._length = 0

    @property
    def offloaded(self) -> bool:
        return self._tail is not None

    def offload(self) -> None:
        """Code the prompt's keys and values (once) and keep only the bytes and the tail."""
        if not self.is_initialized or self.offloaded or self.keys is None:
            return
        n = self.codec.prompt_len
        if self.keys.shape[-2] < n or n == 0:
            return  # not the prompt's cache (yet): keep it as it is
        if self._frames is None:
            self._frames = (self.codec.encode(self.layer_idx, 0, self.keys[..., :n, :]),
                            self.codec.encode(self.layer_idx, 1, self.values[..., :n, :]))
        self._tail = (self.keys[..., n:, :].to("cpu"), self.values[..., n:, :].to("cpu"))
        self._length = self.keys.shape[-2]
        self.keys = self.values = None

    def prefetch(self) -> None:
        """Decode the prompt part back and put the whole layer on its device again."""
        if not self.offloaded:
            return
        parts = [self.codec.decode(self.layer_idx, kv, self._frames[kv]) for kv in (0, 1)]
        self.keys, self.values = (torch.cat([p, t], dim=-2).to(self.device)
                                  for p, t in zip(parts, self._tail, strict=True))
        self._tail = None

    def compressed_bytes(self) -> int:
        return 0 if self._frames is None else sum(len(f) for f in self._frames)

    def get_seq_length(self) -> int:
        return self._length if self.offloaded else super().get_seq_length()


class PredictiveOffloadedCache(Cache):
    """``Cache`` of ``PredictiveOffloadedLayer``s: each layer is offloaded after its update
    and the next one prefetched, synchronously (no CUDA streams needed)."""

    def __init__(self, codec: KVOffloadCodec, num_layers: int) -> None:
        super().__init__(layers=[PredictiveOffloadedLayer(codec, i) for i in range(num_layers)])
        self.codec = codec

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        layer.prefetch()
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        return keys, values

    def compressed_bytes(self) -> int:
        """Bytes of the offloaded prompt caches, all layers."""
        return sum(layer.compressed_bytes() for layer in self.layers)
