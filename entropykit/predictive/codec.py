"""compress_kv / decompress_kv: a KV cache coded against its predictor's guess.

What it is: the blob format and the two calls. Both sides run the predictor on the token
ids (which travel in the blob) and turn its guess into per-value (mu, sigma) with the
calibrated residual model; the encoder codes the true cache under them with the
per-symbol-distribution rANS, the decoder reproduces it bit for bit. Either side codes on
the host (the CPU coder) or, for a CUDA cache, on its device (the GPU coder, with (mu,
sigma) from ``_torchdist``): the same blob either way. ``encode`` / ``decode`` also code
a chunk's blob for ``chunk`` (the predictor then runs on the prefix ids before the blob's
own). What it is not: the predictors, residual models or the coder themselves.

The blob's layout, the coder model of each frame and every check a reader makes (all of
the blob's before the predictor runs, whose cost grows with the tokens a blob claims) are
specified in docs/format.md, section "KV blob". Each (layer, k/v) tensor is its own
frame because with the conditional residual model its (mu, sigma) depend on the groups
decoded before it. Each group has its own shape (kv heads, seq, head dim; sliding-window
layers hold the prompt's last tokens) or none (a layer without KV); blobs of version 1
(one shape for every group) still decode.

fp32 caches: each value's 32 bits, plus 2**15 (mod 2**32), split into a high half, a bf16
bit pattern (the value rounded to bf16), coded under (mu, sigma) like a bf16 cache, and
a low half (where the value sits in that bf16 value's bin), coded with the static rANS
coder (one table per byte): two frames per group. The distribution coder has no 32-bit
format, and below bf16's resolution the guess says little about a value.

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
from ..coding import frame as _frame
from ..rans import distribution as dist
from ..rans import static
from . import _torchdist as T
from . import residual
from .calibration import Calibration
from .kvcache import (
    DTYPES,
    FP8_MAXES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    KVCache,
    Shape,
    aligned_guess,
    as_kvcache,
)
from .predictors import Prediction, Predictor

MAGIC = b"EKKV"
VERSION = 2  # per-group shapes; version 1 (one shape for every group) is written where
# every group has that one shape, so such blobs stay byte for byte those of earlier writers
_HEAD1 = struct.Struct("<4sBBBBIIIIIIIIH")
_HEAD = struct.Struct("<4sBBBBIIIIIIH")
_SHAPE = np.dtype("<u4")  # per group: kv heads, seq, head dim
CHUNK = 1 << 16  # values per chunk: a layer's tensor splits across threads
_FORMATS = {name: t for t, name in DTYPES.items()}  # value-format name -> cache dtype
# The blob's value format codes: the distribution frame's, and 5 for fp32 (split).
_CODES = {name: dist.FORMATS[name].code for name in _FORMATS if name in dist.FORMATS}
_CODES["fp32"] = 5
_SCALED = {DTYPES[t] for t in FP8_MAXES}  # formats whose blobs carry per-layer scales
MAX_TOKENS = 1 << 24  # far above any prompt's; a blob claiming more is refused first


def _cap_error(layers: int, batch: int, seq: int, shapes: list[Shape | None]) -> str | None:
    """What exceeds a cap of the blob format (docs/format.md, "KV header"), or None."""
    heads = max((sh[1] for sh in shapes if sh), default=0)
    dim = max((sh[3] for sh in shapes if sh), default=0)
    for what, value, cap in (("layers", layers, MAX_LAYERS), ("kv heads", heads, MAX_HEADS),
                             ("head dim", dim, MAX_HEAD_DIM),
                             ("tokens (batch * seq)", batch * seq, MAX_TOKENS)):
        if value > cap:
            return f"{value} {what}, more than the format's {cap}"
    return None


def guess_arrays(guess: Prediction | None, shapes: list[Shape | None]
                 ) -> dict[tuple[int, int], np.ndarray]:
    """The predictor's guess per (layer, k/v) group with KV as float32 arrays of the
    group's shape (``kvcache.aligned_guess``; zeros without a guess)."""
    return {divmod(g, 2): np.zeros(sh, np.float32) if guess is None
            else _host(aligned_guess(guess, g // 2, g % 2, sh)).numpy()
            for g, sh in enumerate(shapes) if sh is not None}


def group_distribution(layer: int, kv: int, guesses: dict, shape: tuple, exact: int,
                        kind: str, cal: Calibration, scales: torch.Tensor | None,
                        residuals: dict, threads: int | None = None, fmt: str | None = None
                        ) -> tuple[np.ndarray, np.ndarray, int, np.ndarray]:
    """(mu, sigma, model index, base mean in real units) of one (layer, k/v) tensor of
    ``shape`` and format ``fmt`` (None: bf16, or fp8_e4m3 where there are ``scales``).

    mu and sigma are flat in the tensor's order and in the cache's units (fp8: divided by
    the scale); ``residuals`` holds the real-unit residuals of the groups already coded.
    """
    p = guesses[(layer, kv)]
    if layer < exact:
        base, mean = p, p
        sigma = np.zeros(shape, np.float32)
        index = 2 * cal.layers  # residual.coder_model's last model
    else:
        base = p + cal.channels("bias", layer, kv)[None, :, None, :]
        if kind == "conditional":
            fmt = fmt or ("bf16" if scales is None else "fp8_e4m3")
            mean = residual.conditional_mean(base, residuals, guesses, layer, kv,
                                             *cal.cond(layer, kv, fmt), threads)
            sd = cal.channels("cstd", layer, kv, fmt)
        else:
            mean, sd = base, cal.channels("std", layer, kv)
        sigma = np.broadcast_to(sd[None, :, None, :], shape)
        index = 2 * layer + kv
    if scales is not None:
        sc = np.float32(scales[layer, kv])
        mean, sigma = mean / sc, sigma / sc
    return mean.reshape(-1), residual.floor(sigma, mean).reshape(-1), index, base


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory (the coder runs on the CPU; a CUDA tensor is copied)."""
    return t.detach().cpu()


def _guess_crc(guess: Prediction | None, shapes: list[Shape | None]) -> int:
    """CRC-32 of the guess as coded: each group's, over its tokens, in the frames' order."""
    crc = 0
    for g, sh in enumerate(shapes):
        if guess is not None and sh is not None:
            t = _host(aligned_guess(guess, g // 2, g % 2, sh)).numpy()
            crc = zlib.crc32(np.ascontiguousarray(t, np.float32).view(np.uint8), crc)
    return crc


def _storage(fmt: str) -> tuple[np.dtype, torch.dtype]:
    return (np.dtype(np.uint16), torch.int16) if dist.FORMATS[fmt].bits == 16 else (
        np.dtype(np.uint8), torch.uint8)


def _on_gpu(coder: str, device: torch.device, fmt: str) -> bool:
    """``T.on_gpu``: every format codes on the GPU (fp32's low halves with the static
    GPU encoder, decoded on the host)."""
    return T.on_gpu(coder, device)


def _split32(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """An fp32 tensor's high halves (bf16 bits, the values rounded to bf16) and low halves
    (bytes, two a value) of its bits + 2**15 (module docstring)."""
    y = _host(t).contiguous().view(torch.int32).numpy().view(np.uint32).reshape(-1)
    y = y + np.uint32(0x8000)  # wraps mod 2**32: the split is a bijection
    return (y >> 16).astype(np.uint16), (y & 0xFFFF).astype("<u2").view(np.uint8)


def _split32_torch(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_split32`` where ``t`` lies (torch ops): (high halves as int16 bf16 bits, low
    halves as uint8 bytes, their ``_low_context``)."""
    y = (t.contiguous().view(torch.int32).reshape(-1).to(torch.int64) & 0xFFFFFFFF) + 0x8000
    h = (y >> 16) & 0xFFFF
    high = torch.where(h >= 1 << 15, h - (1 << 16), h).to(torch.int16)  # the same 16 bits
    low16 = (y & 0xFFFF).to(torch.int32)
    low = torch.stack([low16 & 0xFF, low16 >> 8], dim=1).to(torch.uint8).reshape(-1)
    ctx = torch.arange(2, dtype=torch.uint8, device=t.device).repeat(high.numel())
    return high, low, ctx


def _join32_torch(high: torch.Tensor, low: np.ndarray) -> torch.Tensor:
    """``_join32`` of int16 high halves on a device and host low-half bytes: float32 there."""
    lo = torch.from_numpy(np.ascontiguousarray(low).view("<u2").astype(np.int32)).to(
        high.device, non_blocking=True)
    y = ((high.to(torch.int32) & 0xFFFF).to(torch.int64) << 16 | lo) - 0x8000
    y = torch.where(y < 0, y + (1 << 32), y)
    return torch.where(y >= 1 << 31, y - (1 << 32), y).to(torch.int32).view(torch.float32)


def _join32(high: np.ndarray, low: np.ndarray) -> np.ndarray:
    """``_split32``'s inverse: float32 values from their halves."""
    y = (high.astype(np.uint32) << 16) | low.view("<u2").astype(np.uint32)
    return (y - np.uint32(0x8000)).view(np.float32)


def _low_context(n: int) -> np.ndarray:
    """The low halves' contexts: which byte of its value each of ``n`` bytes is."""
    return np.tile(np.arange(2, dtype=np.uint8), n // 2)


def _per_group(fmt: str) -> int:
    """Frames a (layer, k/v) group takes: 2 for fp32 (high, low halves), else 1."""
    return 2 if fmt == "fp32" else 1


def compress_kv(cache: Any, input_ids: torch.Tensor, predictor: Predictor,
                calibration: Calibration, *, model: str = "conditional",
                threads: int | None = None, coder: str = "auto") -> bytes:
    """Code ``cache`` (a ``KVCache`` or transformers ``Cache``; bf16, fp16 or fp32, or an
    fp8 e4m3 / e5m2 ``KVCache``) of the prompt ``input_ids`` ([batch, seq]) against
    ``predictor``'s guess. The calibration must have a fit of the cache's format.

    ``coder``: "gpu" codes a CUDA cache on its device (``entropykit.rans.cuda.dist``, needs
    CuPy; (mu, sigma) computed there too; every format, fp32's low halves with the static
    GPU encoder), "cpu" on the host with ``threads`` threads, "auto" (default) the GPU
    where the cache is on CUDA and the GPU coder runs. The blob is the same bytes either
    way."""
    return encode(cache, input_ids, predictor, calibration, model=model, threads=threads,
                  coder=coder)


def encode(cache: Any, input_ids: torch.Tensor, predictor: Predictor,
           calibration: Calibration, *, model: str, threads: int | None, coder: str,
           prefix: torch.Tensor | None = None) -> bytes:
    """``compress_kv``'s blob; with ``prefix`` (the [batch, p] ids before ``input_ids``:
    a chunk, ``chunk``) the predictor runs on prefix + input_ids, and a group that the
    calibration gives KV but the cache holds None for is a group of no tokens
    (``chunk_shapes``)."""
    kv = as_kvcache(cache)
    ids = _host(torch.as_tensor(input_ids))
    if ids.dim() == 1:
        ids = ids[None]
    shapes, layers = kv.shapes, len(kv.keys)
    seq = max(sh[2] for sh in shapes if sh)
    if ids.dim() != 2 or ids.shape[0] != kv.batch or ids.shape[1] < seq:
        raise ValueError(f"input_ids has shape {tuple(ids.shape)}; the cache has batch "
                         f"{kv.batch} and up to {seq} tokens a layer")
    too_big = _cap_error(layers, kv.batch, ids.shape[1], shapes)
    if too_big is not None:
        raise ValueError(f"cannot code a KV cache of {too_big}")
    if prefix is not None:
        shapes = chunk_shapes(shapes, calibration.dims)
    if calibration.dims != _dims(shapes):
        raise ValueError("the calibration was fitted for another model shape (kv heads or "
                         "head dim of some layer, or its layers)")
    if predictor.describe() != calibration.predictor:
        raise ValueError(f"the calibration was fitted with predictor {calibration.predictor!r}, "
                         f"not {predictor.describe()!r}")
    kinds = residual.KINDS
    if model not in kinds:
        raise ValueError(f"unknown residual model {model!r}; known: {kinds}")
    device = kv.device
    model_tables = calibration.coder_model(model, kv.format)
    groups = _Groups(calibration, predictor, model, shapes, kv.scales,
                     device if _on_gpu(coder, device, kv.format) else None, threads,
                     kv.format)
    guess = predictor.predict(ids if prefix is None else torch.cat([prefix, ids], 1))
    groups.set_guess(guess)
    frames = []
    for g, sh in enumerate(shapes):
        layer, k = divmod(g, 2)
        if sh is None or not sh[2]:
            frames.extend([b""] * _per_group(kv.format))
            groups.skip(layer, k)
            continue
        mu, sigma, index = groups.distribution(layer, k)
        t = kv.tensor(layer, k)
        if groups.device is not None and kv.format == "fp32":
            from ..rans.cuda import dist as gpu_dist
            from ..rans.cuda import encode as gpu_encode

            high, low, ctx = _split32_torch(t.detach())
            frame = gpu_dist.encode(high, mu, sigma, model_tables, fmt="bf16",
                                    model_index=index, chunk_size=CHUNK)
            frames.append(frame.cpu().numpy().tobytes())
            frames.append(gpu_encode.encode(low, chunk_size=2 * CHUNK, context=ctx))
        elif groups.device is not None:
            from ..rans.cuda import dist as gpu_dist

            frame = gpu_dist.encode(t.detach().contiguous(), mu, sigma, model_tables,
                                    fmt=kv.format, model_index=index, chunk_size=CHUNK)
            frames.append(frame.cpu().numpy().tobytes())
        elif kv.format == "fp32":
            high, low = _split32(t)
            frames.append(dist.encode(high, mu, sigma, model_tables, fmt="bf16",
                                      model_index=index, chunk_size=CHUNK, threads=threads))
            frames.append(static.encode(low, chunk_size=2 * CHUNK, threads=threads,
                                        context=_low_context(low.size)))
        else:
            np_dtype, view = _storage(kv.format)
            bits = _host(t).contiguous().view(view).numpy().view(np_dtype).reshape(-1)
            frames.append(dist.encode(bits, mu, sigma, model_tables, fmt=kv.format,
                                      model_index=index, chunk_size=CHUNK,
                                      threads=threads))
        if groups.conditional:
            groups.decoded(layer, k, kv.real(layer, k))
    desc = predictor.describe().encode()
    codes = (_CODES[kv.format], kinds.index(model), 0, layers, kv.batch)
    tail = (predictor.exact_layers, calibration.fingerprint, _guess_crc(guess, shapes),
            len(desc))
    one = shapes[0]
    if all(sh == one for sh in shapes) and one[2] == ids.shape[1]:
        # one shape throughout: version 1, byte for byte what earlier writers wrote
        parts = [_HEAD1.pack(MAGIC, 1, *codes, one[1], one[2], one[3], *tail), desc]
    else:
        table = np.array([(sh[1], sh[2], sh[3]) if sh and sh[2] else (0, 0, 0)
                          for sh in shapes], _SHAPE)
        parts = [_HEAD.pack(MAGIC, VERSION, *codes, ids.shape[1], *tail), desc,
                 table.tobytes()]
    parts.append(ids.to(torch.int32).numpy().astype("<i4").tobytes())
    if kv.scales is not None:
        parts.append(_host(kv.scales).numpy().astype("<f4").tobytes())
    parts.append(np.array([len(f) for f in frames], "<u4").tobytes())
    front = b"".join(parts)
    return b"".join([front, struct.pack("<I", zlib.crc32(front))] + frames)


def _dims(shapes: list[Shape | None]) -> list[tuple[int, int] | None]:
    """Each group's (kv heads, head dim): what a calibration's layout must match."""
    return [None if sh is None else (sh[1], sh[3]) for sh in shapes]


def chunk_shapes(shapes: list[Shape | None], dims: list[tuple[int, int] | None]
                 ) -> list[Shape | None]:
    """A chunk's group shapes, where a group without KV that the calibration's layout
    (``dims``) gives KV is a group of no tokens, (batch, heads, 0, head dim): a
    sliding-window layer before its window. Such a group is coded as one without KV, and
    is zeros where the conditional model uses its residuals (``kvcache.align``)."""
    if len(dims) != len(shapes):
        return shapes  # the layout check refuses it
    batch = next(sh[0] for sh in shapes if sh)
    return [(batch, d[0], 0, d[1]) if sh is None and d else sh
            for sh, d in zip(shapes, dims, strict=True)]


class _Groups:
    """The (mu, sigma) of each (layer, k/v) group in coding order: numpy on the host
    (``group_distribution``), or torch on ``device`` for the GPU coder (``_torchdist``,
    the same bits); ``decoded`` hands over each group's true values for the conditional
    model's residuals (``conditional``: it needs them)."""

    def __init__(self, cal: Calibration, predictor: Predictor, kind: str,
                 shapes: list[Shape | None], scales: torch.Tensor | None,
                 device: torch.device | None, threads: int | None,
                 fmt: str | None = None) -> None:
        self.cal, self.kind, self.shapes = cal, kind, shapes
        self.fmt = fmt or ("bf16" if scales is None else "fp8_e4m3")
        self.conditional = kind == "conditional"
        self.exact, self.scales, self.device = predictor.exact_layers, scales, device
        self.threads = threads
        self.dcal = None if device is None else T.DeviceCalibration(cal, device)
        self.residuals: dict = {}
        self.bases: dict = {}
        self.guesses: dict = {}

    def set_guess(self, guess: Prediction | None) -> None:
        self.guesses = (guess_arrays(guess, self.shapes) if self.device is None
                        else T.guess_tensors(guess, self.shapes, self.device))

    def distribution(self, layer: int, kv: int) -> tuple[Any, Any, int]:
        if self.device is None:
            mu, sigma, index, base = group_distribution(
                layer, kv, self.guesses, self.shapes[2 * layer + kv], self.exact, self.kind,
                self.cal, self.scales, self.residuals, self.threads, self.fmt)
        else:
            scale = None if self.scales is None else self.scales[layer, kv].to(self.device)
            mu, sigma, index, base = T.group_distribution(
                layer, kv, self.guesses, self.shapes[2 * layer + kv], self.exact, self.kind,
                self.dcal, scale, self.residuals, fmt=self.fmt)
        if self.conditional:
            self.bases[(layer, kv)] = base
        return mu, sigma, index

    def skip(self, layer: int, kv: int) -> None:
        """Group (layer, kv) holds no values here (no KV, or a chunk's group of no
        tokens): a group of no tokens is zeros as a later group's source."""
        sh = self.shapes[2 * layer + kv]
        if self.conditional and sh is not None:
            self.residuals[(layer, kv)] = (np.zeros(sh, np.float32) if self.device is None
                                           else torch.zeros(sh, device=self.device))

    def decoded(self, layer: int, kv: int, real: torch.Tensor) -> None:
        """Group (layer, kv)'s values in real units (float32), coded or decoded."""
        base = self.bases.pop((layer, kv))
        # As features of later groups, residuals are finite and bounded (NaN -> 0, others
        # clamped): a cache may hold NaN, inf or huge values, whose raw residuals would
        # make the next groups' mu non-finite. The same on host and device.
        top = residual.RESIDUAL_MAX
        if self.device is None:
            with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, then 0
                r = np.clip(np.nan_to_num(_host(real).numpy() - base, nan=0.0), -top, top)
        else:
            r = torch.nan_to_num(real.to(self.device) - base, nan=0.0).clamp(-top, top)
        self.residuals[(layer, kv)] = r


@dataclass(frozen=True)
class _Front:
    """The validated part of a blob before its frame."""

    fmt: str
    kind: str
    layers: int
    shapes: list[Shape | None]  # per (layer, k/v) group; None without KV
    exact: int
    calibration: int
    params: int
    predictor: str
    ids: torch.Tensor
    scales: torch.Tensor | None
    frames: list[tuple[int, int]]  # (offset, length) of each frame, in the blob's order

    @property
    def per_group(self) -> int:
        """Frames a (layer, k/v) group takes: 2 for fp32 (high, low halves), else 1."""
        return _per_group(self.fmt)


def _front(blob: bytes | memoryview) -> _Front:
    mv = memoryview(blob)
    if len(mv) < 5 or bytes(mv[:4]) != MAGIC:
        raise CorruptDataError(f"not a KV blob: magic {bytes(mv[:4])!r} at byte 0")
    version = mv[4]
    head = {1: _HEAD1, VERSION: _HEAD}.get(version)
    if head is None:
        raise CorruptDataError(f"KV blob version {version} unsupported (this reader reads 1 "
                               f"and {VERSION})")
    if len(mv) < head.size:
        raise CorruptDataError(f"KV blob truncated: {len(mv)} bytes, header needs {head.size}")
    if version == 1:
        (_, _, fcode, kcode, reserved, layers, batch, heads, seq, dim, exact, cal_crc,
         par_crc, dlen) = head.unpack_from(mv, 0)
        one: list[Shape | None] = [(batch, heads, seq, dim)]
    else:
        heads = dim = 1
        (_, _, fcode, kcode, reserved, layers, batch, seq, exact, cal_crc, par_crc,
         dlen) = head.unpack_from(mv, 0)
        one = []
    if reserved:
        raise CorruptDataError(f"KV blob reserved byte is {reserved}, not 0")
    fmt = next((n for n, c in _CODES.items() if c == fcode), None)
    if fmt is None or kcode >= len(residual.KINDS):
        raise CorruptDataError(f"KV blob value format {fcode} / model {kcode} (bytes 5-6)")
    if min(layers, batch, seq, heads, dim) < 1 or exact > layers:
        raise CorruptDataError("KV blob shape fields (layers, batch, seq, exact; version 1: "
                               "heads, head dim) are invalid")
    too_big = _cap_error(layers, batch, seq, one)
    if too_big is not None:
        raise CorruptDataError(f"KV blob claims {too_big}")
    shapes = one * (2 * layers)  # version 1; version 2's come from its table below
    off = head.size
    n_ids = batch * seq
    table_bytes = 0 if version == 1 else 2 * layers * 3 * _SHAPE.itemsize
    scale_bytes = 8 * layers if fmt in _SCALED else 0
    per_group = _per_group(fmt)
    n_frames = 2 * layers * per_group
    end = off + dlen + table_bytes + 4 * n_ids + scale_bytes + 4 * n_frames
    if end + 4 > len(mv):
        raise CorruptDataError("KV blob truncated before its coded values")
    if zlib.crc32(mv[:end]) != struct.unpack_from("<I", mv, end)[0]:
        raise CorruptDataError(f"KV blob header CRC-32 (byte {end}) does not match")
    desc = bytes(mv[off : off + dlen]).decode("utf-8", "replace")
    off += dlen
    if version != 1:
        table = np.frombuffer(mv, _SHAPE, 6 * layers, off).reshape(2 * layers, 3)
        shapes = _table_shapes(table.astype(np.int64), batch, seq)
        off += table_bytes
    ids = torch.from_numpy(np.frombuffer(mv, "<i4", n_ids, off).astype(np.int64)).reshape(
        batch, seq)
    off += 4 * n_ids
    scales = None
    if scale_bytes:
        scales = torch.from_numpy(np.frombuffer(mv, "<f4", 2 * layers, off).copy()).reshape(
            layers, 2)
        if not torch.isfinite(scales).all() or (scales <= 0).any():
            raise CorruptDataError("KV blob fp8 scales are not finite positive numbers")
        off += scale_bytes
    lengths = np.frombuffer(mv, "<u4", n_frames, off).astype(np.int64)
    starts = end + 4 + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if end + 4 + int(lengths.sum()) != len(mv):
        raise CorruptDataError(f"KV blob frames end at byte {end + 4 + int(lengths.sum())}, "
                               f"the blob has {len(mv)} bytes")
    empty = [f for f in range(n_frames)
             if (shapes[f // per_group] is None) != (lengths[f] == 0)]
    if empty:
        raise CorruptDataError(f"KV blob frame {empty[0]}: a frame is empty exactly where its "
                               f"group has no KV")
    return _Front(fmt, residual.KINDS[kcode], layers, shapes, exact, cal_crc, par_crc, desc,
                  ids, scales, [(int(a), int(n)) for a, n in zip(starts, lengths, strict=True)])


def _table_shapes(table: np.ndarray, batch: int, seq: int) -> list[Shape | None]:
    """The groups' shapes from a version-2 shape table (kv heads, seq, head dim per
    group), each checked: within the caps, seq at most the blob's, all three 0 exactly for
    both groups of a layer without KV, and some layer with KV."""
    heads, tokens, dim = table.T
    none = heads == 0
    bad = ((heads > MAX_HEADS) | (dim > MAX_HEAD_DIM) | (tokens > seq)
           | (none != (tokens == 0)) | (none != (dim == 0)))
    pairs = none.reshape(-1, 2)
    if bad.any() or (pairs[:, 0] != pairs[:, 1]).any() or none.all():
        g = int(np.flatnonzero(bad)[0]) if bad.any() else 0
        raise CorruptDataError(f"KV blob shape table: group {g} has {table[g].tolist()} "
                               f"(kv heads <= {MAX_HEADS}, seq <= {seq}, head dim <= "
                               f"{MAX_HEAD_DIM}; all 0 for both groups of a layer without "
                               f"KV; some layer with KV)")
    return [None if h == 0 else (batch, int(h), int(s), int(d))
            for h, s, d in table.tolist()]


def _check_frames(h: _Front, buf: np.ndarray, model: dist.CoderModel) -> None:
    """Every frame's header and directory against the blob's header and ``model``
    (docs/format.md, "KV blob checks"); ``CorruptDataError`` naming the first frame that
    fails."""
    fmt = "bf16" if h.fmt == "fp32" else h.fmt  # the distribution frames' format
    width = dist.FORMATS[fmt].storage.itemsize
    for g, (start, length) in enumerate(h.frames):
        shape = h.shapes[g // h.per_group]
        if shape is None:
            continue
        n = int(np.prod(shape))
        frame = buf[start : start + length]
        if g % h.per_group:  # an fp32 low half: a static frame of 2 bytes a value
            info = _frame.parse(static.CODER, frame, max_output=2 * n)
            if info.n != 2 * n:
                raise CorruptDataError(f"KV blob frame {g} holds {info.n} low-half bytes, "
                                       f"the header says {n} fp32 values")
            continue
        info = dist.parse(frame)
        if info.fmt.name != fmt or info.n != n:
            raise CorruptDataError(f"KV blob frame {g} holds {info.n} {info.fmt.name} values, "
                                   f"the header says {n} {h.fmt}")
        if info.fingerprint != model.fingerprint:
            raise CorruptDataError(f"KV blob frame {g} was coded with model "
                                   f"{info.fingerprint:#010x}, the calibration's is "
                                   f"{model.fingerprint:#010x}")
        values = np.minimum(info.chunk_size, n - info.chunk_size * np.arange(len(info.lengths)))
        raw = info.modes == dist.MODE_RAW
        bad = np.flatnonzero(np.where(raw, info.lengths != values * width,
                                      (info.lengths < dist.STATE_BYTES)
                                      | ((info.lengths - dist.STATE_BYTES) & 1 == 1)))
        if bad.size:
            c = int(bad[0])
            raise CorruptDataError(f"KV blob frame {g} chunk {c}: a {'raw' if raw[c] else 'coded'}"
                                   f" payload of {int(info.lengths[c])} bytes for "
                                   f"{int(values[c])} values")


def token_ids(blob: bytes) -> torch.Tensor:
    """The prompt's token ids ([batch, seq], int64) that a ``compress_kv`` blob carries."""
    return _front(blob).ids


def decompress_kv(blob: bytes, predictor: Predictor, calibration: Calibration, *,
                  threads: int | None = None, device: str | torch.device = "cpu",
                  coder: str = "auto") -> KVCache:
    """The cache back from a ``compress_kv`` blob, bit for bit, its tensors on ``device``
    (``token_ids`` reads the prompt the blob carries). ``coder`` as in ``compress_kv``:
    "auto" decodes on ``device`` where it is CUDA and the GPU coder runs.

    ``CorruptDataError`` if the blob is malformed, or was coded with another calibration
    or predictor, or the predictor's guess here differs from the encoder's.
    """
    return decode(_front(blob), blob, predictor, calibration, threads=threads,
                  device=device, coder=coder)


def decode(h: _Front, blob: bytes | memoryview, predictor: Predictor,
           calibration: Calibration, *, threads: int | None, device: str | torch.device,
           coder: str, prefix: torch.Tensor | None = None) -> KVCache:
    """``decompress_kv`` of a blob whose front ``_front`` read as ``h``; with ``prefix``
    as in ``encode`` (a chunk: None for its groups of no tokens)."""
    dev = torch.device(device)
    on_device = _on_gpu(coder, dev, h.fmt)
    if (h.calibration != calibration.fingerprint or h.predictor != predictor.describe()
            or h.exact != predictor.exact_layers):
        raise CorruptDataError(
            f"KV blob was coded with predictor {h.predictor!r} (exact layers {h.exact}) and "
            f"calibration {h.calibration:#010x}; given {predictor.describe()!r} "
            f"({predictor.exact_layers}) and {calibration.fingerprint:#010x}")
    shapes = h.shapes if prefix is None else chunk_shapes(h.shapes, calibration.dims)
    if calibration.dims != _dims(shapes):
        raise CorruptDataError("KV blob shape does not match the calibration's model")
    if h.fmt not in calibration.formats:
        raise CorruptDataError(f"KV blob holds {h.fmt} values; the calibration has no "
                               f"{h.fmt} fit (it has {', '.join(calibration.formats)})")
    buf = np.frombuffer(memoryview(blob), np.uint8)
    model_tables = calibration.coder_model(h.kind, h.fmt)
    _check_frames(h, buf, model_tables)  # all of the blob, before the predictor runs
    try:
        guess = predictor.predict(h.ids if prefix is None else torch.cat([prefix, h.ids], 1))
        crc = _guess_crc(guess, shapes)
    except (IndexError, RuntimeError, ValueError) as e:
        raise CorruptDataError(f"the predictor cannot run on the blob's token ids: {e}") from e
    if crc != h.params:
        raise CorruptDataError(
            "the predictor's guess here differs from the encoder's (the header's guess_crc): "
            "decoding needs the same weights, torch build, device type and thread count")
    groups = _Groups(calibration, predictor, h.kind, shapes, h.scales,
                     dev if on_device else None, threads, h.fmt)
    groups.set_guess(guess)
    dtype = _FORMATS[h.fmt]
    tensors = []
    pending = []  # the GPU's decodes, checked in order once all are queued
    if groups.device is not None:
        from ..rans.cuda import dist as gpu_dist

        # frames upload asynchronously from pinned memory; each group's decode, and the
        # conditional model's use of its values, queue on the stream behind the last one
        host = torch.empty(buf.size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        host.numpy()[:] = buf
    for g, shape in enumerate(shapes):
        layer, k = divmod(g, 2)
        if shape is None or not shape[2]:
            tensors.append(None)
            groups.skip(layer, k)
            continue
        mu, sigma, index = groups.distribution(layer, k)
        start, length = h.frames[g * h.per_group]
        frame = buf[start : start + length]
        if h.fmt == "fp32":
            n = int(np.prod(shape))
            lo_start, lo_length = h.frames[g * h.per_group + 1]
            low = static.decode(buf[lo_start : lo_start + lo_length], threads=threads,
                                context=_low_context(2 * n), max_output=2 * n)
            if groups.device is not None:  # the high halves on the GPU, joined there
                p = gpu_dist.decode_async(host[start : start + length], mu, sigma,
                                          model_tables, model_index=index,
                                          device=groups.device)
                pending.append(p)
                t = _join32_torch(p.out.view(torch.int16), low).reshape(shape)
            else:
                high = dist.decode(frame, mu, sigma, model_tables, model_index=index,
                                   threads=threads)
                t = torch.from_numpy(_join32(high, low)).reshape(shape)
        elif groups.device is not None:
            pending.append(gpu_dist.decode_async(host[start : start + length], mu, sigma,
                                                 model_tables, model_index=index,
                                                 device=groups.device))
            t = pending[-1].out.view(dtype).reshape(shape)
        else:
            bits = dist.decode(frame, mu, sigma, model_tables, model_index=index,
                               threads=threads)
            t = torch.from_numpy(bits).view(dtype).reshape(shape)
        tensors.append(t)
        if groups.conditional:
            real = t.float()
            groups.decoded(layer, k, real if h.scales is None
                           else real * h.scales[layer, k].to(real.device))
    for p in pending:  # the first bad frame's error; later groups may rest on its values
        p.result()
    tensors = [None if t is None else t.to(dev) for t in tensors]
    return KVCache(tensors[0::2], tensors[1::2], h.scales)
