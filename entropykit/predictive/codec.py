"""compress_kv / decompress_kv: a KV cache coded against its predictor's guess.

What it is: the blob format and the two calls. Both sides run the predictor on the token
ids (which travel in the blob) and turn its guess into per-value (mu, sigma) with the
calibrated residual model; the encoder codes the true cache under them with the
per-symbol-distribution rANS, the decoder reproduces it bit for bit. What it is not: the
predictors, residual models or the coder themselves.

Blob v1 (little-endian):

    offset  size  field
    0       4     magic b"EKKV"
    4       1     version = 1
    5       1     value format code (rans.distribution.FORMATS: bf16 1, fp8_e4m3 3)
    6       1     residual model (0 gaussian, 1 mixture, 2 adaptive)
    7       1     reserved = 0
    8       20    layers, batch, kv heads, seq, head dim (u32 each)
    28      4     exact layers (coded with mu = guess, sigma -> 0)
    32      4     calibration fingerprint (CRC-32)
    36      4     CRC-32 of the mu and sigma arrays the encoder coded under
    40      2     n: length of the predictor's description, then n bytes of UTF-8
    ...           batch * seq token ids (i32), then for fp8 layers * 2 scales (f32)
    ...           CRC-32 (u32) of every byte above
    ...           the distribution-rANS frame (to the end of the blob)

Determinism: the decoder must compute the same (mu, sigma) bits as the encoder (see
``predictors``); when it does not, decompress_kv raises ``CorruptDataError`` saying so
instead of returning a wrong cache.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import CorruptDataError
from ..rans import distribution as dist
from . import residual
from .calibration import Calibration
from .kvcache import FP8, KVCache, as_kvcache
from .predictors import Predictor

MAGIC = b"EKKV"
VERSION = 1
_HEAD = struct.Struct("<4sBBBBIIIIIIIIH")
_FORMATS = {"bf16": torch.bfloat16, "fp8_e4m3": FP8}


def _distribution(cache_shape: tuple[int, ...], layers: int, fmt: str, kind: str,
                  guess: list | None, exact: int, scales: torch.Tensor | None,
                  cal: Calibration) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mu, sigma, model index) of every value, in blob order: layer, k/v, then the
    tensor's own [batch, heads, seq, dim] order."""
    per = int(np.prod(cache_shape))
    mu = np.empty(2 * layers * per, np.float32)
    sigma = np.empty_like(mu)
    index = np.empty(mu.size, np.uint16)
    exact_model = 2 * layers  # residual.coder_model's last model
    for layer in range(layers):
        for kv in (0, 1):
            sl = slice((2 * layer + kv) * per, (2 * layer + kv + 1) * per)
            p = (np.zeros(cache_shape, np.float32) if guess is None
                 else guess[layer][kv].numpy().astype(np.float32, copy=False))
            if layer < exact:
                m = p
                s = np.zeros(cache_shape, np.float32)
                index[sl] = exact_model
            else:
                m = p + cal.bias[layer, kv][None, :, None, :]
                s = residual.scales(kind, p, cal.std[layer, kv], cal.coef[layer, kv])
                index[sl] = 2 * layer + kv
            if scales is not None:
                sc = np.float32(scales[layer, kv])
                m, s = m / sc, s / sc
            mu[sl] = m.reshape(-1)
            sigma[sl] = residual.floor(s, m).reshape(-1)
    return mu, sigma, index


def _param_crc(mu: np.ndarray, sigma: np.ndarray) -> int:
    return zlib.crc32(sigma.view(np.uint8), zlib.crc32(mu.view(np.uint8)))


def compress_kv(cache: Any, input_ids: torch.Tensor, predictor: Predictor,
                calibration: Calibration, *, model: str = "adaptive",
                threads: int | None = None) -> bytes:
    """Code ``cache`` (a ``KVCache`` or transformers ``Cache``; bf16, or fp8 ``KVCache``)
    of the prompt ``input_ids`` ([batch, seq]) against ``predictor``'s guess."""
    kv = as_kvcache(cache)
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    batch, heads, seq, dim = kv.shape
    layers = len(kv.keys)
    if tuple(ids.shape) != (batch, seq):
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}, the cache ({batch}, {seq})")
    if calibration.bias.shape != (layers, 2, heads, dim):
        raise ValueError("the calibration was fitted for another model shape")
    if predictor.describe() != calibration.predictor:
        raise ValueError(f"the calibration was fitted with predictor {calibration.predictor!r}, "
                         f"not {predictor.describe()!r}")
    kinds = residual.KINDS
    if model not in kinds:
        raise ValueError(f"unknown residual model {model!r}; known: {kinds}")
    guess = predictor.predict(ids)
    mu, sigma, index = _distribution(kv.shape, layers, kv.format, model, guess,
                                     predictor.exact_layers, kv.scales, calibration)
    storage = np.uint16 if kv.format == "bf16" else np.uint8
    bits = np.concatenate([kv.tensor(layer, k).contiguous().view(
        torch.int16 if storage is np.uint16 else torch.uint8).numpy().view(storage).reshape(-1)
        for layer in range(layers) for k in (0, 1)])
    frame = dist.encode(bits, mu, sigma, calibration.coder_model(model, kv.format),
                        fmt=kv.format, model_index=index, threads=threads)
    desc = predictor.describe().encode()
    head = _HEAD.pack(MAGIC, VERSION, dist.FORMATS[kv.format].code, kinds.index(model), 0,
                      layers, batch, heads, seq, dim, predictor.exact_layers,
                      calibration.fingerprint, _param_crc(mu, sigma), len(desc))
    parts = [head, desc, ids.to(torch.int32).numpy().astype("<i4").tobytes()]
    if kv.scales is not None:
        parts.append(kv.scales.numpy().astype("<f4").tobytes())
    front = b"".join(parts)
    return front + struct.pack("<I", zlib.crc32(front)) + frame


@dataclass(frozen=True)
class _Front:
    """The validated part of a blob before its frame."""

    fmt: str
    kind: str
    layers: int
    shape: tuple[int, int, int, int]
    exact: int
    calibration: int
    params: int
    predictor: str
    ids: torch.Tensor
    scales: torch.Tensor | None
    frame: int  # offset of the frame


def _front(blob: bytes | memoryview) -> _Front:
    mv = memoryview(blob)
    if len(mv) < _HEAD.size:
        raise CorruptDataError(f"KV blob truncated: {len(mv)} bytes, header needs {_HEAD.size}")
    (magic, version, fcode, kcode, reserved, layers, batch, heads, seq, dim, exact, cal_crc,
     par_crc, dlen) = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CorruptDataError(f"not a KV blob: magic {bytes(magic)!r} at byte 0")
    if version != VERSION or reserved:
        raise CorruptDataError(f"KV blob version {version} / reserved byte unsupported")
    fmt = next((n for n, f in dist.FORMATS.items() if f.code == fcode), None)
    if fmt not in _FORMATS or kcode >= len(residual.KINDS):
        raise CorruptDataError(f"KV blob value format {fcode} / model {kcode} (bytes 5-6)")
    if min(layers, batch, heads, seq, dim) < 1 or exact > layers:
        raise CorruptDataError("KV blob shape fields (bytes 8-31) are invalid")
    off = _HEAD.size
    n_ids = batch * seq
    scale_bytes = 8 * layers if fmt == "fp8_e4m3" else 0
    end = off + dlen + 4 * n_ids + scale_bytes
    if end + 4 > len(mv):
        raise CorruptDataError("KV blob truncated before its coded values")
    if zlib.crc32(mv[:end]) != struct.unpack_from("<I", mv, end)[0]:
        raise CorruptDataError(f"KV blob header CRC-32 (byte {end}) does not match")
    desc = bytes(mv[off : off + dlen]).decode("utf-8", "replace")
    off += dlen
    ids = torch.from_numpy(np.frombuffer(mv, "<i4", n_ids, off).astype(np.int64)).reshape(
        batch, seq)
    off += 4 * n_ids
    scales = None
    if scale_bytes:
        scales = torch.from_numpy(np.frombuffer(mv, "<f4", 2 * layers, off).copy()).reshape(
            layers, 2)
        if not torch.isfinite(scales).all() or (scales <= 0).any():
            raise CorruptDataError("KV blob fp8 scales are not finite positive numbers")
    return _Front(fmt, residual.KINDS[kcode], layers, (batch, heads, seq, dim), exact,
                  cal_crc, par_crc, desc, ids, scales, end + 4)


def token_ids(blob: bytes) -> torch.Tensor:
    """The prompt's token ids ([batch, seq], int64) that a ``compress_kv`` blob carries."""
    return _front(blob).ids


def decompress_kv(blob: bytes, predictor: Predictor, calibration: Calibration, *,
                  threads: int | None = None) -> KVCache:
    """The cache back from a ``compress_kv`` blob, bit for bit (``token_ids`` reads the
    prompt the blob carries).

    ``CorruptDataError`` if the blob is malformed, or was coded with another calibration
    or predictor, or the predictor's guess here differs from the encoder's.
    """
    h = _front(blob)
    if (h.calibration != calibration.fingerprint or h.predictor != predictor.describe()
            or h.exact != predictor.exact_layers):
        raise CorruptDataError(
            f"KV blob was coded with predictor {h.predictor!r} (exact layers {h.exact}) and "
            f"calibration {h.calibration:#010x}; given {predictor.describe()!r} "
            f"({predictor.exact_layers}) and {calibration.fingerprint:#010x}")
    if calibration.bias.shape != (h.layers, 2, h.shape[1], h.shape[3]):
        raise CorruptDataError("KV blob shape does not match the calibration's model")
    try:
        guess = predictor.predict(h.ids)
    except (IndexError, RuntimeError, ValueError) as e:
        raise CorruptDataError(f"the predictor cannot run on the blob's token ids: {e}") from e
    mu, sigma, index = _distribution(h.shape, h.layers, h.fmt, h.kind, guess, h.exact,
                                     h.scales, calibration)
    if _param_crc(mu, sigma) != h.params:
        raise CorruptDataError(
            "the predictor's guess here differs from the encoder's (CRC of mu/sigma): "
            "decoding needs the same weights, torch build, device type and thread count")
    mv = memoryview(blob)
    frame = np.frombuffer(mv, np.uint8, len(mv) - h.frame, h.frame)
    info = dist.parse(frame)
    if info.fmt.name != h.fmt or info.n != mu.size:
        raise CorruptDataError(f"KV blob frame holds {info.n} {info.fmt.name} values, header "
                               f"says {mu.size} {h.fmt}")
    bits = dist.decode(frame, mu, sigma, calibration.coder_model(h.kind, h.fmt),
                       model_index=index, threads=threads)
    dtype = _FORMATS[h.fmt]
    per = int(np.prod(h.shape))
    tensors = [torch.from_numpy(bits[g * per : (g + 1) * per].copy()).view(dtype).reshape(
        h.shape) for g in range(2 * h.layers)]
    return KVCache(tensors[0::2], tensors[1::2], h.scales)
