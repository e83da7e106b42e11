"""Predictive KV-cache coding: code a model's KV cache against a cheaper model's guess.

``calibrate`` fits residual models for a (target, predictor) pair; ``compress_kv`` /
``decompress_kv`` code a cache losslessly given the same predictor and calibration on both
sides; predictors: ``NoPredictor``, ``FP8Predictor``, ``EarlyExitPredictor``. Needs torch
(and transformers for the models and the cache hook).
"""

from .calibration import Calibration, calibrate
from .codec import compress_kv, decompress_kv, token_ids
from .kvcache import KVCache, from_transformers, to_fp8, to_transformers
from .predictors import EarlyExitPredictor, FP8Predictor, NoPredictor, Predictor
from .residual import KINDS

__all__ = [
    "KINDS", "Calibration", "EarlyExitPredictor", "FP8Predictor", "KVCache", "NoPredictor",
    "Predictor", "calibrate", "compress_kv", "decompress_kv", "from_transformers", "to_fp8",
    "to_transformers", "token_ids",
]
