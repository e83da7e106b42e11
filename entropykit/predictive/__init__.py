"""Predictive KV-cache coding: code a model's KV cache against a cheaper model's guess.

``calibrate`` fits residual models for a (target, predictor) pair; ``compress_kv`` /
``decompress_kv`` code a cache losslessly given the same predictor and calibration on both
sides; ``compress_kv_chunk`` / ``decompress_kv_chunk`` code tokens [start, end) of a cache
so that each chunk decodes alone given the ids before it (``slice_kv`` / ``concat_kv`` cut
a cache into chunks and join them); predictors: ``NoPredictor``, ``FP8Predictor``,
``EarlyExitPredictor``. Needs torch (and transformers for the models and the cache hook).
"""

from .calibration import Calibration, calibrate
from .chunk import (
    KVChunkInfo,
    compress_kv_chunk,
    concat_kv,
    decompress_kv_chunk,
    kv_chunk_info,
    slice_kv,
)
from .codec import compress_kv, decompress_kv, token_ids
from .kvcache import KVCache, from_transformers, to_fp8, to_transformers
from .predictors import EarlyExitPredictor, FP8Predictor, NoPredictor, Predictor
from .residual import KINDS

__all__ = [
    "KINDS", "Calibration", "EarlyExitPredictor", "FP8Predictor", "KVCache", "KVChunkInfo",
    "NoPredictor", "Predictor", "calibrate", "compress_kv", "compress_kv_chunk", "concat_kv",
    "decompress_kv", "decompress_kv_chunk", "from_transformers", "kv_chunk_info", "slice_kv",
    "to_fp8", "to_transformers", "token_ids",
]
