"""Calibration: fit the residual models of a (target, predictor) pair on sample prompts.

What it is: ``calibrate(target, predictor, prompts)`` runs both models on the prompts and
fits per channel (layer, k/v, kv head, dim) the residual bias and std, and for each cache
format asked for (bf16, fp16, fp32; fp8 e4m3 and e5m2 with one scale per layer and k/v,
whose coarse values need their own fit) the conditional model: per (layer, k/v) its
linear maps, conditional std and shape; plus the empirical value distributions of each
format. ``Calibration`` holds them, saves them to a safetensors file (docs/format.md,
section "KV calibration file") and builds the coder's tables. Each (layer, k/v) group has
its own kv heads and head dim, or none (a layer without KV); version 1 files (one shape
for every group) still load. Size (``file_bytes``, capped at ``MAX_BYTES``): the int8
maps dominate, about 2 * 4.5 * (heads * dim)^2 bytes per layer and format (SmolLM2-135M:
~0.37 MB per layer, ~11 MB per format).
What it is not: the codec (``codec``) or the residual models' definitions (``residual``).
"""

from __future__ import annotations

import inspect
import json
import math
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
from ..coding.parallel import imap, resolve
from ..rans import distribution as dist
from . import residual
from .kvcache import (
    DTYPES,
    FP8_MAXES,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_LAYERS,
    aligned_guess,
    from_transformers,
)
from .predictors import Predictor, model_device, output_cache

VERSION = 2  # written; version 1 (one [layers, 2, heads, dim] shape) is read too
FORMATS = ("bf16", "fp8_e4m3", "fp16", "fp32", "fp8_e5m2")
DEFAULT_FORMATS = ("bf16", "fp8_e4m3")
_SUFFIX = {"bf16": "bf16", "fp8_e4m3": "fp8", "fp16": "fp16", "fp32": "fp32",
           "fp8_e5m2": "e5m2"}
_TORCH = {name: t for t, name in DTYPES.items()}
_PER_FORMAT = ("cstd", "cond", "cscale", "shapes", "emp")
# Caps of the file (docs/format.md, "KV calibration file"), besides the layout's (layers,
# kv heads, head dim): checked by the reader from the header before any tensor but the
# layout is read, and by ``calibrate`` before it fits anything.
MAX_CHANNELS = 1 << 12  # kv heads * head dim of a group
MAX_BYTES = 1 << 34  # of all tensors together
_ITEMSIZE = {"F32": 4, "I32": 4, "U32": 4, "I8": 1}


def file_bytes(dims: Sequence[tuple[int, int] | None], formats: int) -> int:
    """Bytes of the tensors (the file adds a header of a few kB) of a calibration of
    ``formats`` cache formats for the layout ``dims`` (each (layer, k/v) group's (kv
    heads, head dim), None for a layer without KV: ``Calibration.dims``), as ``calibrate``
    writes it (version 2). The int8 maps dominate: per group its channels times the
    channels of the groups it is conditioned on (``residual.sources``)."""
    return _bytes(_expected(len(dims) // 2, list(dims), (), FORMATS[:formats]))


def _bytes(want: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """Bytes of the tensors ``_expected`` gives."""
    return sum(_ITEMSIZE[dtype] * math.prod(shape) for dtype, shape in want.values())


def _cap_error(layers: int, channels: int,
               want: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> str | None:
    """What exceeds a cap of the file format: its layers, a group's kv heads * head dim
    (``channels``: the most of any group's) or, given ``want`` (``_expected``'s), the
    tensors' bytes; None if nothing does."""
    checks = [("layers", layers, MAX_LAYERS), ("kv heads * head dim", channels, MAX_CHANNELS)]
    if want is not None:
        checks.append(("tensor bytes", _bytes(want), MAX_BYTES))
    for what, value, cap in checks:
        if value > cap:
            return f"{value} {what}, more than the format's {cap}"
    return None


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
    def version(self) -> int:
        """2 for the per-group layout (a ``layout`` tensor), 1 for the one-shape layout."""
        return 2 if "layout" in self.arrays else 1

    @property
    def layers(self) -> int:
        return (self.arrays["layout"] if self.version == 2 else self.arrays["bias"]).shape[0]

    @property
    def dims(self) -> list[tuple[int, int] | None]:
        """Each (layer, k/v) group's (kv heads, head dim), layer 0 keys first; None for a
        layer without KV."""
        if self.version == 1:
            return [tuple(self.arrays["bias"].shape[2:])] * (2 * self.layers)
        return [None if h == 0 else (int(h), int(d))
                for h, d in self.arrays["layout"].reshape(-1, 2)]

    def channels(self, name: str, layer: int, kv: int, fmt: str | None = None) -> np.ndarray:
        """Group (layer, kv)'s [heads, dim] slice of ``bias`` / ``std`` (fmt None) or of a
        per-format ``cstd``."""
        a = self.arrays[name] if fmt is None else self.get(name, fmt)
        if self.version == 1:
            return a[layer, kv]
        start, (h, d) = self._offsets.chan[2 * layer + kv]
        return a[start : start + h * d].reshape(h, d)

    def cond(self, layer: int, kv: int, fmt: str) -> tuple[np.ndarray, np.ndarray]:
        """Group (layer, kv)'s conditional map of format ``fmt``: int8 rows [sum of its
        sources' widths, hd] and scales [sources, hd] (``residual.dequantize``)."""
        q, scale = self.get("cond", fmt), self.get("cscale", fmt)
        n = len(residual.sources(layer, kv, self._offsets.kv_layers))
        if self.version == 1:
            hd = q.shape[-1]
            return q[layer, kv, :n].reshape(n * hd, hd), scale[layer, kv, :n]
        (qa, rows, hd), sa = self._offsets.cond[2 * layer + kv], self._offsets.scale[2 * layer + kv]
        return q[qa : qa + rows * hd].reshape(rows, hd), scale[sa : sa + n * hd].reshape(n, hd)

    @property
    def _offsets(self) -> _Offsets:
        if "offsets" not in self._models:
            self._models["offsets"] = _Offsets(self.dims)
        return self._models["offsets"]

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
            {"version": self.version, "predictor": self.predictor, "tokens": self.tokens})}
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
                layout = None
                if meta["version"] == 2:  # the small layout first: it sizes the others
                    _check_layout_spec(specs)
                    layout = _checked_layout(f.get_tensor("layout"))
                _check_specs(specs, layout)  # before any other tensor is read
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
        if self.version == 2:
            _checked_layout(self.arrays["layout"], ValueError)
        elif self.arrays["bias"].ndim != 4 or self.arrays["bias"].shape[1] != 2:
            raise ValueError(f"calibration bias has shape {self.arrays['bias'].shape}")
        want = _expected(self.layers, self.dims if self.version == 2 else None,
                         self.arrays["bias"].shape, self.formats)
        for name, (_, shape) in want.items():
            if name not in self.arrays or self.arrays[name].shape != shape:
                got = self.arrays[name].shape if name in self.arrays else None
                raise ValueError(f"calibration {name} has shape {got}, expected {shape}")
        for f in self.formats:  # tables rise from 0 to ONE etc.
            for kind in residual.KINDS:
                self.coder_model(kind, f)


class _Offsets:
    """Where each group's slice of a version-2 file's flat tensors starts: channels
    (bias, std, cstd), map rows (cond) and map scales (cscale), groups in order."""

    def __init__(self, dims: list[tuple[int, int] | None]) -> None:
        self.kv_layers = {g // 2 for g, d in enumerate(dims) if d is not None}
        self.chan: dict[int, tuple[int, tuple[int, int]]] = {}
        self.cond: dict[int, tuple[int, int, int]] = {}
        self.scale: dict[int, int] = {}
        c = m = n = 0
        for g, hdim in enumerate(dims):
            if hdim is None:
                continue
            hd = hdim[0] * hdim[1]
            srcs = residual.sources(g // 2, g % 2, self.kv_layers)
            rows = sum(_width(dims[2 * layer + kv]) for _, layer, kv in srcs)
            self.chan[g], self.cond[g], self.scale[g] = (c, hdim), (m, rows, hd), n
            c, m, n = c + hd, m + rows * hd, n + len(srcs) * hd
        self.sizes = (c, m, n)


def _width(dims: tuple[int, int] | None) -> int:
    return 0 if dims is None else dims[0] * dims[1]


def _expected(layers: int, dims: list[tuple[int, int] | None] | None,
              bias: tuple[int, ...], formats: Iterable[str]) -> dict[str, tuple[str, tuple]]:
    """Every tensor's (dtype, shape) by the format's tables: version 2 when ``dims`` (the
    per-group layout) is given, else version 1 with ``bias``'s shape [L, 2, H, D]."""
    if dims is not None:
        c, m, n = _Offsets(dims).sizes
        base, cond, cscale = (c,), (m,), (n,)
        want = {"layout": ("I32", (layers, 2, 2))}
    else:
        hd = bias[2] * bias[3]
        base = (layers, 2, bias[2], bias[3])
        cond = (layers, 2, residual.MAX_SOURCES, hd, hd)
        cscale = cond[:-1]
        want = {}
    want |= {"bias": ("F32", base), "std": ("F32", base)}
    for f in formats:
        s = _SUFFIX[f]
        want |= {f"cstd_{s}": ("F32", base), f"cond_{s}": ("I8", cond),
                 f"cscale_{s}": ("F32", cscale),
                 f"shapes_{s}": ("U32", (2 * layers, dist.Z_POINTS + 1)),
                 f"emp_{s}": ("U32", (2 * layers, dist.EMP_POINTS + 1))}
    return want


def _checked_layout(layout: np.ndarray, error: type[Exception] = CorruptDataError
                    ) -> np.ndarray:
    """A version-2 layout [L, 2, 2] (kv heads, head dim per group): each within the caps,
    both 0 exactly for the two groups of a layer without KV, at least one layer with."""
    heads, dim = layout[..., 0].astype(np.int64), layout[..., 1].astype(np.int64)
    none = heads == 0
    if ((heads < 0) | (heads > MAX_HEADS) | (dim < 0) | (dim > MAX_HEAD_DIM)).any() or (
            none != (dim == 0)).any() or (none[:, 0] != none[:, 1]).any() or none.all():
        raise error("calibration layout: heads in 0..2^10 and head dim in 0..2^12, both 0 "
                    "exactly for the keys and values of a layer without KV, and some layer "
                    "with KV")
    return layout


_META_KEY = "entropykit_kv_calibration"
_MAX_META = 1 << 16
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_FLOATS = ("bias", "std", "cstd", "cscale")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise CorruptDataError("calibration metadata repeats a key")
    return out


def _metadata(meta: dict[str, str] | None) -> dict[str, Any]:
    """The calibration's metadata object, checked: a flat JSON object of exactly version
    (1 or 2), predictor (a string) and tokens (an int >= 0)."""
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
    if obj["version"] not in (1, VERSION):
        raise CorruptDataError(f"calibration version {obj['version']} unsupported "
                               f"(this reader reads 1 and {VERSION})")
    if not isinstance(obj["predictor"], str) or obj["tokens"] < 0:
        raise CorruptDataError("calibration predictor must be a string and tokens >= 0")
    return obj


def _check_layout_spec(specs: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    shape = specs.get("layout", ("", ()))[1]
    if specs.get("layout", ("",))[0] != "I32" or len(shape) != 3 or shape[1:] != (2, 2) or (
            not 1 <= shape[0] <= MAX_LAYERS):
        raise CorruptDataError(f"calibration has no I32 layout tensor [L, 2, 2] with L in "
                               f"1..{MAX_LAYERS}")


def _check_specs(specs: dict[str, tuple[str, tuple[int, ...]]],
                 layout: np.ndarray | None) -> None:
    """Every tensor's name, dtype and shape (from the file's header) as the format gives:
    version 2 with ``layout``, else version 1."""
    if layout is not None:
        dims = [None if h == 0 else (int(h), int(d)) for h, d in layout.reshape(-1, 2)]
        layers, bias = layout.shape[0], ()
    else:
        if "bias" not in specs or len(specs["bias"][1]) != 4:
            raise CorruptDataError("calibration has no bias tensor of 4 dimensions")
        layers, two, heads, dim = bias = specs["bias"][1]
        if min(layers, heads, dim) < 1 or two != 2:
            raise CorruptDataError(f"calibration bias has shape {list(specs['bias'][1])}")
        dims = None
    channels = max(_width(d) for d in dims) if dims is not None else bias[2] * bias[3]
    too_big = _cap_error(layers, channels)  # first: the sizes below grow with these
    if too_big is not None:
        raise CorruptDataError(f"calibration: {too_big}")
    formats = [f for f in FORMATS
               if any(f"{p}_{_SUFFIX[f]}" in specs for p in _PER_FORMAT)]
    want = _expected(layers, dims, bias, formats)
    too_big = _cap_error(layers, channels, want)
    if too_big is not None:
        raise CorruptDataError(f"calibration: {too_big}")
    if set(specs) != set(want):
        extra, missing = sorted(set(specs) - set(want)), sorted(set(want) - set(specs))
        raise CorruptDataError(f"calibration tensors: unknown {extra}, missing {missing}")
    for name, (dtype, shape) in want.items():
        if specs[name] != (dtype, shape):
            raise CorruptDataError(f"calibration {name} is {specs[name][0]}"
                                   f"{list(specs[name][1])}, expected {dtype}{list(shape)}")


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


def _cache_only(model: torch.nn.Module) -> dict[str, int]:
    """Keyword arguments that spare ``model``'s forward pass the logits of every token
    (``logits_to_keep=1`` where its forward takes it): calibration needs only the cache,
    and the head's product over the vocabulary is a large part of a small model's pass."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(
        model.forward).parameters else {}


Groups = dict[int, list[np.ndarray]]  # group 2 * layer + kv -> per prompt [1, h, s, d]


def _fit_conditional(values: dict[str, Groups], ps: Groups, bias: dict[int, np.ndarray],
                     exact: int, layers: int, tick: Callable[[], None], threads: int
                     ) -> dict[str, dict[str, np.ndarray]]:
    """Fit the conditional model of each format (its ``_SUFFIX``: its values per group
    with KV, per prompt, real units, in ``values``) from the guesses ``ps``: per format,
    its arrays (version-2 layout); ``tick`` after each (group, format). The fits are
    independent (a group's features are the base residuals of earlier groups, not their
    fits), so ``threads`` run them side by side, every format's in one pass (one format's
    groups alone leave threads idle at its end); each fit runs on one thread of torch and
    BLAS with its own arithmetic, so the result does not depend on the count."""
    dims = [None] * (2 * layers)
    for g, a in ps.items():
        dims[g] = (a[0].shape[1], a[0].shape[3])
    offsets = _Offsets(dims)
    prompts = len(next(iter(ps.values())))
    guesses = [{(g // 2, g % 2): ps[g][i] for g in ps} for i in range(prompts)]
    kv_layers = {g // 2 for g in ps}

    def base(g: int, i: int) -> np.ndarray:
        return ps[g][i] if g // 2 < exact else ps[g][i] + bias[g][None, :, None, :]

    def fit(job: tuple[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        suffix, g = job
        layer, kv = divmod(g, 2)
        hd = dims[g][0] * dims[g][1]
        # per prompt: the residuals this fit reads (its sources' and its own), made here
        # rather than kept for every group and format (features align tokens in a prompt)
        need = {(layer, kv)} | {(src_layer, src_kv) for kind, src_layer, src_kv
                                in residual.sources(layer, kv, kv_layers) if kind == "r"}
        res = [{key: values[suffix][2 * key[0] + key[1]][i] - base(2 * key[0] + key[1], i)
                for key in need} for i in range(prompts)]
        target = np.concatenate([r[(layer, kv)].transpose(0, 2, 1, 3).reshape(-1, hd)
                                 for r in res])
        feats = np.concatenate([residual.features(res[i], guesses[i], layer, kv)
                                for i in range(prompts)])
        sizes = residual.block_sizes(residual.source_arrays(res[0], guesses[0], layer, kv))
        del res
        weights, oof = residual.fit_conditional(feats, target)
        del feats
        q, scale = residual.quantize(weights, sizes)
        # What remains, for the std and shape: out-of-fold, as new text will see it.
        err = target - oof.astype(np.float32)
        sd = np.sqrt((err.astype(np.float64) ** 2).mean(axis=0)).astype(np.float32)
        mean = np.concatenate([base(g, i).transpose(0, 2, 1, 3).reshape(-1, hd)
                               for i in range(prompts)])
        sigma = residual.floor(np.broadcast_to(sd, err.shape), mean)
        return q, scale, sd, residual.fit_shape((err / sigma).reshape(-1))

    c, m, n = offsets.sizes
    arrays = {suffix: (np.ones(c, np.float32), np.zeros(m, np.int8), np.ones(n, np.float32),
                       np.tile(dist.gaussian_shape(), (2 * layers, 1))) for suffix in values}
    todo = [(suffix, g) for suffix in values for g in sorted(ps) if g // 2 >= exact]
    for _ in range(len(values) * len(ps) - len(todo)):  # exact layers: nothing to fit
        tick()
    with residual.one_thread():  # pinned once here: the fits run side by side
        for (suffix, g), (q, scale, sd, shape) in zip(todo, imap(fit, todo, threads),
                                                      strict=True):
            cstd, cond, cscale, shapes = arrays[suffix]
            (ca, _), (qa, rows, hd), sa = offsets.chan[g], offsets.cond[g], offsets.scale[g]
            cond[qa : qa + rows * hd] = q.reshape(-1)
            cscale[sa : sa + scale.size] = scale.reshape(-1)
            cstd[ca : ca + hd], shapes[g] = sd, shape
            tick()
    return {suffix: {f"cstd_{suffix}": cstd, f"cond_{suffix}": cond,
                     f"cscale_{suffix}": cscale, f"shapes_{suffix}": shapes}
            for suffix, (cstd, cond, cscale, shapes) in arrays.items()}


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
              progress: bool | Progress | None = None,
              threads: int | None = None) -> Calibration:
    """Fit every residual model of (``target``, ``predictor``) on ``prompts``.

    ``prompts`` are token-id sequences (1-d tensors, lists, or [1, seq] tensors);
    ``formats`` the cache formats to fit the conditional model for (a subset of
    ``FORMATS``; a cache is coded only with a calibration of its format). Layers the
    predictor reproduces exactly are not fitted (they are coded as exact). Every prompt
    must give the same cache layout (kv heads and head dim per layer and k/v).
    ``progress``: a progress line on stderr (None: where stderr is a terminal; True:
    always; False: never) or a callable given (steps done, steps in all): one step a
    prompt, then one a (layer, k/v, format) fit of each group with KV. ``ValueError``
    before any prompt's forward pass runs (the layout comes from a pass of one token)
    where the calibration file would exceed the format's caps (``file_bytes``).
    ``threads``: the prompts' forward passes (target and predictor; of a model on the
    CPU), then the (layer, k/v) fits, run side by side on this many threads (None:
    ``ENTROPYKIT_THREADS`` or every core), each on one thread of torch and of numpy's
    BLAS: the file is the same for any count of these threads and of torch's.
    """
    if not formats or any(f not in FORMATS for f in formats):
        raise ValueError(f"formats must be a non-empty subset of {FORMATS}")
    prompts = list(prompts)
    report, bar = _progress(progress)
    try:
        return _calibrate(target, predictor, prompts, formats, report, resolve(threads))
    finally:
        if bar is not None:
            bar.close()


_Pass = tuple[int, list, dict, dict, dict]


def _forward(target: torch.nn.Module, predictor: Predictor, prompt: Any,
             formats: Sequence[str]) -> _Pass:
    """One prompt's forward passes (target and predictor) and what calibration keeps of
    them: (tokens, the cache's shapes, per format ("bf16" and ``formats``) its values per
    group with KV, the guesses per group, per format its key counts per group)."""
    ids = torch.as_tensor(prompt).reshape(1, -1)
    with torch.inference_mode():
        out = target(ids.to(model_device(target)), use_cache=True, **_cache_only(target))
        cache = from_transformers(output_cache(out))
    guess = predictor.predict(ids)
    shapes = cache.shapes
    live = [g for g, sh in enumerate(shapes) if sh is not None]
    values: dict[str, dict[int, np.ndarray]] = {f: {} for f in ("bf16", *formats)}
    guesses: dict[int, np.ndarray] = {}
    keys: dict[str, dict[int, np.ndarray]] = {f: {} for f in formats}
    for g in live:
        layer, kv = divmod(g, 2)
        x = cache.real(layer, kv).cpu()
        guesses[g] = (np.zeros(x.shape, np.float32) if guess is None
                      else aligned_guess(guess, layer, kv, shapes[g]).cpu().numpy())
        for f in values:
            values[f][g] = (x if f == "bf16" else _as_format(x, f)).numpy()
        for f in formats:
            keys[f][g] = _key_counts(x, f)
    return ids.shape[1], shapes, values, guesses, keys


def _calibrate(target: torch.nn.Module, predictor: Predictor, prompts: list[Any],
               formats: Sequence[str], report: Progress | None, threads: int) -> Calibration:
    if not prompts:
        raise ValueError("calibrate needs at least one prompt")
    # The layout from one token of the first prompt: a model over the caps is refused
    # before any pass of the prompts runs.
    with residual.one_thread(), torch.inference_mode():
        ids = torch.as_tensor(prompts[0]).reshape(1, -1)[:, :1]
        shapes = from_transformers(output_cache(target(
            ids.to(model_device(target)), use_cache=True, **_cache_only(target)))).shapes
    dims = [None if sh is None else (sh[1], sh[3]) for sh in shapes]
    too_big = _cap_error(len(dims) // 2, max(map(_width, dims)),
                         _expected(len(dims) // 2, dims, (), formats))
    if too_big is not None:
        raise ValueError(f"a calibration of this model would hold {too_big}")
    live = [g for g, d in enumerate(dims) if d is not None]
    steps = [0, len(prompts) + len(live) * len(formats)]
    ps: Groups = {g: [] for g in live}
    xs: dict[str, Groups] = {f: {g: [] for g in live} for f in ("bf16", *formats)}
    counts: dict[str, dict[int, np.ndarray]] = {f: dict.fromkeys(live, 0) for f in formats}
    tokens = 0

    def tick() -> None:
        steps[0] += 1
        if report is not None:
            report(*steps)

    def run(prompt: Any) -> _Pass:
        return _forward(target, predictor, prompt, formats)

    # Each prompt's passes on one torch thread (their floats would otherwise depend on
    # torch's thread count), prompts side by side; on an accelerator, one at a time.
    side = threads if model_device(target).type == "cpu" else 1
    with residual.one_thread():
        for size, shapes, values, guesses, keys in imap(run, prompts, side):
            if [None if sh is None else (sh[1], sh[3]) for sh in shapes] != dims:
                raise ValueError("the prompts' caches differ in layout (kv heads or head "
                                 "dim of some layer)")
            tokens += size
            for g in live:
                ps[g].append(guesses[g])
                for f in xs:
                    xs[f][g].append(values[f][g])
                for f in formats:
                    counts[f][g] = counts[f][g] + keys[f][g]
            tick()
    layers = len(dims) // 2
    layout = np.array([d or (0, 0) for d in dims], np.int32).reshape(layers, 2, 2)
    x16 = {g: np.concatenate(a, axis=2) for g, a in xs["bf16"].items()}
    bias: dict[int, np.ndarray] = {}
    std: dict[int, np.ndarray] = {}
    for g in sorted(ps):
        p = np.concatenate(ps[g], axis=2)
        heads, dim = dims[g]
        bias[g] = np.zeros((heads, dim), np.float32)
        std[g] = np.ones((heads, dim), np.float32)
        if g // 2 >= predictor.exact_layers:
            r = x16[g] - p
            bias[g] = r.mean(axis=(0, 2))
            r -= bias[g][None, :, None, :]
            std[g] = np.sqrt((r.astype(np.float64) ** 2).mean(axis=(0, 2))).astype(np.float32)
    arrays: dict[str, np.ndarray] = {
        "layout": layout,
        "bias": np.concatenate([bias[g].reshape(-1) for g in sorted(bias)]),
        "std": np.concatenate([std[g].reshape(-1) for g in sorted(std)])}
    uniform = np.linspace(0, dist.ONE, dist.EMP_POINTS + 1).astype(np.uint32)
    fitted = _fit_conditional({_SUFFIX[f]: xs[f] for f in formats}, ps, bias,
                              predictor.exact_layers, layers, tick, threads)
    for f in formats:
        arrays |= fitted[_SUFFIX[f]]
        arrays[f"emp_{_SUFFIX[f]}"] = np.stack([
            dist.empirical_table(counts[f][g]) if g in counts[f] else uniform
            for g in range(2 * layers)])
    cal = Calibration(predictor.describe(), arrays, tokens)
    cal.validate()
    return cal
