"""Calibration: fit the residual models of a (target, predictor) pair on sample prompts.

What it is: ``calibrate(target, predictor, prompts)`` runs both models on the prompts and
fits per channel (layer, k/v, kv head, dim) the residual bias and std, and for each cache
format asked for (bf16, fp16, fp32; fp8 e4m3 and e5m2 with one scale per layer and k/v,
whose coarse values need their own fit) the conditional model: per (layer, k/v) its
linear maps, conditional std and shape; plus the empirical value distributions of each
format. ``Calibration`` holds them, saves them to a safetensors file (docs/format.md,
section "KV calibration file") and builds the coder's tables. Size (``file_bytes``, capped
at ``MAX_BYTES``): the int8 maps dominate, 2 * 5 * (heads * dim)^2 bytes per layer and
format (SmolLM2-135M: ~0.37 MB per layer, ~11 MB per format).
What it is not: the codec (``codec``) or the residual models' definitions (``residual``).
"""

from __future__ import annotations

import json
import re
import sys
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._errors import CorruptDataError
from ..rans import distribution as dist
from . import residual
from .kvcache import DTYPES, FP8_MAXES, from_transformers
from .predictors import Predictor, model_device

VERSION = 1
FORMATS = ("bf16", "fp8_e4m3", "fp16", "fp32", "fp8_e5m2")
DEFAULT_FORMATS = ("bf16", "fp8_e4m3")
_SUFFIX = {"bf16": "bf16", "fp8_e4m3": "fp8", "fp16": "fp16", "fp32": "fp32",
           "fp8_e5m2": "e5m2"}
_TORCH = {name: t for t, name in DTYPES.items()}
_PER_FORMAT = ("cstd", "cond", "cscale", "shapes", "emp")
# Caps of the file (docs/format.md, "KV calibration file"): checked by the reader from the
# header before any tensor is read, and by ``calibrate`` before it fits anything.
MAX_LAYERS = 1 << 10
MAX_CHANNELS = 1 << 12  # kv heads * head dim
MAX_BYTES = 1 << 34  # of all tensors together


def file_bytes(layers: int, heads: int, dim: int, formats: int) -> int:
    """Bytes of a calibration's tensors (the file adds a header of a few kB): bias and
    std, then per format the int8 maps (which dominate: 10 (heads * dim)^2 per layer),
    their scales, the conditional std and the shape and empirical tables."""
    hd = heads * dim
    per_format = layers * (10 * hd * hd + 40 * hd + 8 * hd
                           + 8 * (dist.Z_POINTS + 1) + 8 * (dist.EMP_POINTS + 1))
    return 16 * layers * hd + formats * per_format


@dataclass(eq=False)
class Calibration:
    """Fitted residual parameters of one (target, predictor) pair; see module docstring.

    ``arrays``: bias and std, and per calibrated format the conditional model's cstd,
    cond, cscale and shapes and the empirical tables emp: names, dtypes and shapes as the
    file holds them (docs/format.md, section "KV calibration file").
    """

    predictor: str
    arrays: dict[str, np.ndarray]
    tokens: int = 0
    _models: dict = field(default_factory=dict, repr=False)

    @property
    def bias(self) -> np.ndarray:
        return self.arrays["bias"]

    @property
    def std(self) -> np.ndarray:
        return self.arrays["std"]

    @property
    def layers(self) -> int:
        return self.bias.shape[0]

    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(f for f in FORMATS if f"cstd_{_SUFFIX[f]}" in self.arrays)

    def get(self, name: str, fmt: str) -> np.ndarray:
        """A per-format array ("cstd", "cond", "shapes", "emp") of cache format ``fmt``."""
        if fmt not in self.formats:
            raise ValueError(f"this calibration has no {fmt} fit (it has {self.formats}); "
                             f"calibrate with formats including {fmt!r}")
        return self.arrays[f"{name}_{_SUFFIX[fmt]}"]

    @property
    def fingerprint(self) -> int:
        """CRC-32 of every array and the predictor's name: the codec records it."""
        crc = zlib.crc32(self.predictor.encode())
        for name in sorted(self.arrays):
            crc = zlib.crc32(name.encode(), crc)
            crc = zlib.crc32(np.ascontiguousarray(self.arrays[name]).tobytes(), crc)
        return crc

    def coder_model(self, kind: str, fmt: str) -> dist.CoderModel:
        """The coder's tables for residual model ``kind`` and value format ``fmt``."""
        key = (kind, fmt)
        if key not in self._models:
            self._models[key] = residual.coder_model(kind, self.get("shapes", fmt),
                                                     self.get("emp", fmt))
        return self._models[key]

    def save(self, path: str | Path) -> None:
        from safetensors.numpy import save_file

        meta = {"entropykit_kv_calibration": json.dumps(
            {"version": VERSION, "predictor": self.predictor, "tokens": self.tokens})}
        save_file({n: np.ascontiguousarray(a) for n, a in self.arrays.items()}, str(path),
                  metadata=meta)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """Read a file ``save`` wrote; ``CorruptDataError`` for anything else or damaged
        (docs/format.md, section "KV calibration file", lists the checks)."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "numpy") as f:
                meta = _metadata(f.metadata())
                specs = {n: (f.get_slice(n).get_dtype(), tuple(f.get_slice(n).get_shape()))
                         for n in f.keys()}  # noqa: SIM118 - not a dict
                _check_specs(specs)  # before any tensor is read
                arrays = {n: f.get_tensor(n) for n in specs}
        except SafetensorError as e:
            raise CorruptDataError(f"{path} is not a valid safetensors file: {e}") from None
        cal = cls(meta["predictor"], arrays, meta["tokens"])
        for name in _FLOATS:
            for key in (name, *(f"{name}_{_SUFFIX[f]}" for f in FORMATS)):
                a = arrays.get(key)
                if a is not None and not np.isfinite(a).all():
                    raise CorruptDataError(f"calibration {key} has values that are not finite")
                if a is not None and name in ("std", "cstd") and (a < 0).any():
                    raise CorruptDataError(f"calibration {key} has negative values")
        try:
            cal.validate()
        except ValueError as e:
            raise CorruptDataError(f"calibration: {e}") from None
        return cal

    def validate(self) -> None:
        """Check every array's shape and every table (raises ``ValueError``)."""
        if "bias" not in self.arrays or "std" not in self.arrays:
            raise ValueError("a calibration needs bias and std")
        base = self.bias.shape
        if len(base) != 4 or base[1] != 2:
            raise ValueError(f"calibration bias has shape {base}")
        hd = base[2] * base[3]
        l2 = 2 * base[0]
        want = {"std": base}
        for f in self.formats:
            s = _SUFFIX[f]
            cond = (base[0], 2, residual.MAX_SOURCES, hd, hd)
            want |= {f"cstd_{s}": base, f"cond_{s}": cond, f"cscale_{s}": cond[:-1],
                     f"shapes_{s}": (l2, dist.Z_POINTS + 1), f"emp_{s}": (l2, dist.EMP_POINTS + 1)}
        for name, shape in want.items():
            if self.arrays[name].shape != shape:
                raise ValueError(f"calibration {name} has shape {self.arrays[name].shape}, "
                                 f"expected {shape}")
        for f in self.formats:  # tables rise from 0 to ONE etc.
            for kind in residual.KINDS:
                self.coder_model(kind, f)


_META_KEY = "entropykit_kv_calibration"
_MAX_META = 1 << 16
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_FLOATS = ("bias", "std", "cstd", "cscale")
_DTYPE_OF = {"bias": "F32", "std": "F32", "cstd": "F32", "cond": "I8", "cscale": "F32",
             "shapes": "U32", "emp": "U32"}


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise CorruptDataError("calibration metadata repeats a key")
    return out


def _metadata(meta: dict[str, str] | None) -> dict[str, Any]:
    """The calibration's metadata object, checked: a flat JSON object of exactly version
    (1), predictor (a string) and tokens (an int >= 0)."""
    text = (meta or {}).get(_META_KEY)
    if text is None:
        raise CorruptDataError(f"not an entropykit KV calibration (no {_META_KEY!r} metadata)")
    # Flat, checked before parsing: no nesting for the parser to recurse into.
    bare = _STRING.sub('""', text) if len(text) <= _MAX_META else "["
    if "[" in bare or bare.count("{") != 1:
        raise CorruptDataError(f"calibration metadata is not a flat JSON object of at most "
                               f"{_MAX_META} characters")
    try:
        obj = json.loads(text, object_pairs_hook=_unique)
    except json.JSONDecodeError as e:
        raise CorruptDataError(f"calibration metadata is not JSON: {e}") from None
    if (not isinstance(obj, dict) or list(obj) != ["version", "predictor", "tokens"]
            or type(obj["version"]) is not int or type(obj["tokens"]) is not int):
        raise CorruptDataError("calibration metadata must hold exactly version, predictor "
                               "and tokens")
    if obj["version"] != VERSION:
        raise CorruptDataError(f"calibration version {obj['version']} unsupported "
                               f"(this reader reads {VERSION})")
    if not isinstance(obj["predictor"], str) or obj["tokens"] < 0:
        raise CorruptDataError("calibration predictor must be a string and tokens >= 0")
    return obj


def _check_specs(specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every tensor's name, dtype and shape (from the file's header) as the format gives."""
    if "bias" not in specs or len(specs["bias"][1]) != 4:
        raise CorruptDataError("calibration has no bias tensor of 4 dimensions")
    layers, two, heads, dim = specs["bias"][1]
    if min(layers, heads, dim) < 1 or two != 2:
        raise CorruptDataError(f"calibration bias has shape {list(specs['bias'][1])}")
    too_big = _cap_error(layers, heads, dim, 0)
    if too_big is not None:
        raise CorruptDataError(f"calibration bias {list(specs['bias'][1])}: {too_big}")
    base, hd = (layers, 2, heads, dim), heads * dim
    want = {"bias": base, "std": base}
    for f in FORMATS:
        names = [f"{p}_{_SUFFIX[f]}" for p in _PER_FORMAT]
        if any(n in specs for n in names):
            cond = (layers, 2, residual.MAX_SOURCES, hd, hd)
            want |= dict(zip(names, (base, cond, cond[:-1], (2 * layers, dist.Z_POINTS + 1),
                                     (2 * layers, dist.EMP_POINTS + 1)), strict=True))
    if set(specs) != set(want):
        extra, missing = sorted(set(specs) - set(want)), sorted(set(want) - set(specs))
        raise CorruptDataError(f"calibration tensors: unknown {extra}, missing {missing}")
    too_big = _cap_error(layers, heads, dim, (len(want) - 2) // len(_PER_FORMAT))
    if too_big is not None:
        raise CorruptDataError(f"calibration: {too_big}")
    for name, shape in want.items():
        dtype = _DTYPE_OF[name.split("_", 1)[0]]
        if specs[name] != (dtype, shape):
            raise CorruptDataError(f"calibration {name} is {specs[name][0]}"
                                   f"{list(specs[name][1])}, expected {dtype}{list(shape)}")


def _cap_error(layers: int, heads: int, dim: int, formats: int) -> str | None:
    """What exceeds a cap of the file format for this shape and count of formats, or
    None."""
    size = file_bytes(layers, heads, dim, formats)
    for what, value, cap in (("layers", layers, MAX_LAYERS),
                             ("kv heads * head dim", heads * dim, MAX_CHANNELS),
                             ("tensor bytes", size, MAX_BYTES)):
        if value > cap:
            return f"{value} {what}, more than the format's {cap}"
    return None


def _cast(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, float]:
    """Real values ``x`` (float32) in format ``fmt`` and their scale: fp8 with one scale
    (max |x| / the format's largest value, ``to_fp8``'s), others unscaled (fp16 clamped
    to its finite range: the fit needs finite values)."""
    dtype = _TORCH[fmt]
    if dtype in FP8_MAXES:
        top = FP8_MAXES[dtype]
        amax = float(x.abs().max())
        scale = torch.tensor(amax / top if 0 < amax < float("inf") else 1.0,
                             dtype=torch.float32)
        return (x / scale).clamp(-top, top).to(dtype), float(scale)
    if dtype == torch.float16:
        x = x.clamp(-65504.0, 65504.0)
    return x.to(dtype), 1.0


def _as_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x through format ``fmt``, back in real units (float32)."""
    q, scale = _cast(x, fmt)
    return q.float() * scale if scale != 1.0 else q.float()


def _key_counts(x: torch.Tensor, fmt: str) -> np.ndarray:
    """Counts of each key (numeric order, as the coder's) of ``x`` in format ``fmt``
    (fp32: of its high halves, bf16 keys, as the codec splits it)."""
    q, _ = _cast(x, fmt)
    if fmt == "fp32":
        y = q.contiguous().view(torch.int32).numpy().view(np.uint32) + np.uint32(0x8000)
        bits = (y >> 16).astype(np.uint16)
    else:
        view = torch.int16 if q.element_size() == 2 else torch.uint8
        bits = q.contiguous().view(view).numpy().view(np.uint16 if view == torch.int16
                                                       else np.uint8)
    return np.bincount(dist.value_keys(bits).reshape(-1), minlength=1 << (8 * bits.itemsize))


def _fit_conditional(xs: list[np.ndarray], ps: list[np.ndarray], bias: np.ndarray,
                     exact: int, out: dict[str, np.ndarray], suffix: str,
                     tick: Callable[[], None]) -> None:
    """Fit the conditional model of one format from its values ``xs`` and guesses ``ps``
    (per group, real units, [1, heads, tokens, dim]) into ``out``; ``tick`` after each
    group."""
    n = len(xs) // 2
    heads, dim = xs[0].shape[1], xs[0].shape[3]
    hd = heads * dim
    cstd = np.ones((n, 2, heads, dim), np.float32)
    cond = np.zeros((n, 2, residual.MAX_SOURCES, hd, hd), np.int8)
    cscale = np.ones((n, 2, residual.MAX_SOURCES, hd), np.float32)
    shapes = np.tile(dist.gaussian_shape(), (2 * n, 1))
    residuals: dict[tuple[int, int], np.ndarray] = {}
    guesses = {(g // 2, g % 2): p for g, p in enumerate(ps)}
    for g in range(2 * n):
        layer, kv = divmod(g, 2)
        base = ps[g] if layer < exact else ps[g] + bias[layer, kv][None, :, None, :]
        r = xs[g] - base
        residuals[(layer, kv)] = r
        tick()
        if layer < exact:
            continue  # coded as exact: nothing to fit
        target = r.transpose(0, 2, 1, 3).reshape(-1, hd)
        feats = residual.features(residuals, guesses, layer, kv)
        k = len(residual.sources(layer, kv))
        weights, oof = residual.fit_conditional(feats, target)
        cond[layer, kv], cscale[layer, kv] = residual.quantize(weights, k, hd)
        # What remains, for the std and shape: out-of-fold, as new text will see it.
        err = target - oof.astype(np.float32)
        cstd[layer, kv] = np.sqrt((err.astype(np.float64) ** 2).mean(axis=0)).reshape(
            heads, dim)
        mean = base.transpose(0, 2, 1, 3).reshape(-1, hd)
        sigma = residual.floor(np.broadcast_to(cstd[layer, kv].reshape(hd), err.shape), mean)
        shapes[g] = residual.fit_shape((err / sigma).reshape(-1))
    out |= {f"cstd_{suffix}": cstd, f"cond_{suffix}": cond, f"cscale_{suffix}": cscale,
            f"shapes_{suffix}": shapes}


Progress = Callable[[int, int], None]


def _progress(progress: bool | Progress | None) -> tuple[Progress | None, Any]:
    """(the callback, the bar to close) for ``calibrate``'s ``progress``: None draws a bar
    on stderr where it is a terminal, True always, False never; a callable is called."""
    if callable(progress):
        return progress, None
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None, None
    from ..container.progress import Bar

    bar = Bar("calibrate", unit="steps", scale=1)
    return bar, bar


def calibrate(target: torch.nn.Module, predictor: Predictor, prompts: Iterable[Any],
              formats: Sequence[str] = DEFAULT_FORMATS, *,
              progress: bool | Progress | None = None) -> Calibration:
    """Fit every residual model of (``target``, ``predictor``) on ``prompts``.

    ``prompts`` are token-id sequences (1-d tensors, lists, or [1, seq] tensors);
    ``formats`` the cache formats to fit the conditional model for (a subset of
    ``FORMATS``; a cache is coded only with a calibration of its format). Layers the
    predictor reproduces exactly are not fitted (they are coded as exact). ``progress``: a
    progress line on stderr (None: where stderr is a terminal; True: always; False: never)
    or a callable given (steps done, steps in all): one step a prompt, then one a
    (layer, k/v, format) fit. ``ValueError`` before anything runs past the first prompt
    where the calibration file would exceed the format's caps (``file_bytes``).
    """
    if not formats or any(f not in FORMATS for f in formats):
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}")
    prompts = list(prompts)
    report, bar = _progress(progress)
    try:
        return _calibrate(target, predictor, prompts, formats, report)
    finally:
        if bar is not None:
            bar.close()


def _calibrate(target: torch.nn.Module, predictor: Predictor, prompts: list[Any],
               formats: Sequence[str], report: Progress | None) -> Calibration:
    xs: dict[str, list[list[np.ndarray]]] = {}
    ps: list[list[np.ndarray]] = []
    counts: dict[str, list[np.ndarray]] = {}
    tokens = 0
    steps = [0, len(prompts)]

    def tick() -> None:
        steps[0] += 1
        if report is not None:
            report(*steps)

    for prompt in prompts:
        ids = torch.as_tensor(prompt).reshape(1, -1)
        tokens += ids.shape[1]
        with torch.inference_mode():
            out = target(ids.to(model_device(target)), use_cache=True)
            cache = from_transformers(out.past_key_values)
        guess = predictor.predict(ids)
        groups = 2 * len(cache.keys)
        if not ps:
            _, heads, _, dim = cache.shape
            too_big = _cap_error(len(cache.keys), heads, dim, len(formats))
            if too_big is not None:
                raise ValueError(f"a calibration of this model would hold {too_big}")
            steps[1] += groups * len(formats)
            ps = [[] for _ in range(groups)]
            xs = {f: [[] for _ in range(groups)] for f in ("bf16", *formats)}
            counts = {f: [0] * groups for f in formats}
        for g in range(groups):
            layer, kv = divmod(g, 2)
            x = cache.real(layer, kv).cpu()
            ps[g].append(np.zeros(x.shape, np.float32) if guess is None
                         else guess[layer][kv].cpu().numpy())
            for f in xs:
                xs[f][g].append((x if f == "bf16" else _as_format(x, f)).numpy())
            for f in formats:
                counts[f][g] = counts[f][g] + _key_counts(x, f)
        tick()
    if not ps:
        raise ValueError("calibrate needs at least one prompt")
    p = [np.concatenate(a, axis=2) for a in ps]
    x16 = [np.concatenate(a, axis=2) for a in xs["bf16"]]
    n = len(p) // 2
    heads, dim = p[0].shape[1], p[0].shape[3]
    bias = np.zeros((n, 2, heads, dim), np.float32)
    std = np.ones((n, 2, heads, dim), np.float32)
    for g in range(2 * n):
        layer, kv = divmod(g, 2)
        if layer >= predictor.exact_layers:
            r = x16[g] - p[g]
            bias[layer, kv] = r.mean(axis=(0, 2))
            r -= bias[layer, kv][None, :, None, :]
            std[layer, kv] = np.sqrt((r.astype(np.float64) ** 2).mean(axis=(0, 2)))
    arrays: dict[str, np.ndarray] = {"bias": bias, "std": std}
    for f in formats:
        vals = x16 if f == "bf16" else [np.concatenate(a, axis=2) for a in xs[f]]
        _fit_conditional(vals, p, bias, predictor.exact_layers, arrays, _SUFFIX[f], tick)
        arrays[f"emp_{_SUFFIX[f]}"] = np.stack([dist.empirical_table(c) for c in counts[f]])
    cal = Calibration(predictor.describe(), arrays, tokens)
    cal.validate()
    return cal
