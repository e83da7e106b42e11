"""Per-symbol-distribution rANS: each value coded under its own quantized distribution.

What it is: ``encode``/``decode`` of an array of float values (bf16, fp16, fp8 e4m3fn,
fp8 e5m2, given as their bit patterns) where value i is coded under the distribution
``model`` gives it around ``mu[i]`` with scale ``sigma[i]``; the value formats; the
``CoderModel`` (fixed-point shape tables) and a deterministic Gaussian(-mixture) builder;
its kind of the shared frame (``coding.frame``: header, directory, threads and CRC live
there; here the header's reading and the per-chunk kernels). What it is not: a predictor
or a calibration (that is ``entropykit.predictive``), and not the static coder
(``rans.static``).

Determinism. The decoder must see the same (mu, sigma, model) as the encoder, bit for bit.
From there on everything that decides a probability is integer arithmetic (see
``dist_kernels``): mu and sigma, taken as float32, are snapped to a grid (sigma to 9
significant bits, mu to multiples of sigma's power of two / 2**16); the CDF is a table of
integers interpolated in integers. Floats only pick where the decoder's exact search
starts. Tables built here from a density use IEEE +, -, *, / and ldexp only (no libm), so
they are identical on every machine.

Frame layout v1 (little-endian; ``coding.frame``'s header with bytes 7 and 24..28 read
for this kind):

    offset  size  field
    0       4     magic b"EKRD"
    4       1     version = 1
    5       1     precision p (12..16)
    6       1     lanes = 32
    7       1     value format code (FORMATS)
    8       8     n: number of values
    16      4     chunk_size: values per chunk (last chunk may be shorter)
    20      4     n_chunks = ceil(n / chunk_size)
    24      4     model fingerprint: CRC-32 of the model's tables and weights
    28      ...   n_chunks x u32 payload length, n_chunks x u32 CRC-32 of the chunk's decoded
                  value bits, n_chunks x u8 mode (0 coded, 1 raw), then the payloads.
    The frame ends exactly where the last payload ends.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CorruptDataError
from ..coding import frame
from . import dist_kernels as _k

MAGIC = b"EKRD"
VERSION = frame.VERSION
MODE_CODED = frame.MODE_CODED
MODE_RAW = frame.MODE_RAW
DEFAULT_PRECISION = 16
DEFAULT_CHUNK = 1 << 17
ONE = _k.ONE
STATE_BYTES = _k.STATE_BYTES  # a coded chunk: these start states, then 16-bit words
Z_MAX = _k.Z_MAX
Z_POINTS = _k.Z_POINTS
EMP_POINTS = _k.EMP_POINTS
HEADER_SIZE = frame.HEADER_SIZE
_RTAB = _k.reciprocals()


@dataclass(frozen=True)
class ValueFormat:
    """A float format as the coder sees it: key width and where its values sit."""

    name: str
    code: int
    bits: int  # 8 or 16
    mantissa: int
    bias: int
    nonfinite: int  # smallest magnitude bit pattern that is inf or NaN

    @property
    def storage(self) -> np.dtype:
        return np.dtype(np.uint16 if self.bits == 16 else np.uint8)

    @property
    def params(self) -> np.ndarray:
        return np.array([1 << self.bits, self.mantissa, self.bias, self.nonfinite,
                         self.bits - 8], np.int64)


FORMATS: dict[str, ValueFormat] = {
    f.name: f
    for f in (
        ValueFormat("bf16", 1, 16, 7, 127, 0x7F80),
        ValueFormat("fp16", 2, 16, 10, 15, 0x7C00),
        ValueFormat("fp8_e4m3", 3, 8, 3, 7, 0x7F),  # OCP e4m3fn: no inf, NaN = S.1111.111
        ValueFormat("fp8_e5m2", 4, 8, 2, 15, 0x7C),
    )
}
_BY_CODE = {f.code: f for f in FORMATS.values()}
_BY_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8_e4m3",
             "float8_e5m2": "fp8_e5m2"}


def value_format(fmt: str | ValueFormat) -> ValueFormat:
    """Look a format up by name ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")."""
    if isinstance(fmt, ValueFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except KeyError:
        raise ValueError(f"unknown value format {fmt!r}; known: {sorted(FORMATS)}") from None


def value_bits(values: Any, fmt: str | ValueFormat | None = None) -> tuple[np.ndarray, ValueFormat]:
    """Flat bit patterns of ``values`` and their format.

    ``values`` is either the format's storage integers (uint16 / uint8, ``fmt`` required)
    or a float array of a known dtype (ml_dtypes bfloat16, float8_e4m3fn, float8_e5m2;
    numpy float16), whose format is taken from the dtype.
    """
    arr = np.asarray(values)
    name = _BY_DTYPE.get(arr.dtype.name)
    if name is not None:
        if fmt is not None and value_format(fmt).name != name:
            raise ValueError(f"values are {arr.dtype.name} but fmt is {value_format(fmt).name}")
        f = FORMATS[name]
    elif fmt is None:
        raise TypeError(f"cannot infer the value format of dtype {arr.dtype}; pass fmt=")
    else:
        f = value_format(fmt)
        if arr.dtype != f.storage:
            raise TypeError(f"{f.name} bits must be {f.storage}, got {arr.dtype}")
    return np.ascontiguousarray(arr).reshape(-1).view(f.storage), f



def value_keys(bits: np.ndarray) -> np.ndarray:
    """Each value's key in the coder's value space (numeric order: -NaN payloads < -inf <
    ... < -0 < +0 < ... < +NaN payloads) from its uint8 / uint16 bit patterns."""
    width = 8 * bits.dtype.itemsize
    half = 1 << (width - 1)
    return np.where(bits & half, bits ^ ((1 << width) - 1), bits ^ half).astype(bits.dtype)


# ---- model tables -------------------------------------------------------------------


def _exp_neg(x: np.ndarray) -> np.ndarray:
    # exp(-x), x >= 0, from IEEE +,-,*,/ and ldexp only: bit-identical on every machine
    # (numpy's exp may use different SIMD code paths). Relative error < 1e-15.
    x = np.asarray(x, np.float64)
    k = np.floor(x * 1.4426950408889634)
    r = x - k * 0.6931471803691238 - k * 1.9082149292705877e-10  # in [-tiny, ln 2)
    term = np.ones_like(r)
    acc = np.ones_like(r)
    for i in range(1, 24):
        term = term * (-r) / i
        acc = acc + term
    return np.ldexp(acc, -np.minimum(k, 2000).astype(np.int64))


def z_grid() -> np.ndarray:
    """The z of each shape table entry: -Z_MAX .. Z_MAX in steps of 2**-6 (float64)."""
    return (np.arange(Z_POINTS + 1, dtype=np.float64) - Z_POINTS / 2) / (1 << _k.Z_GRID_BITS)


def shape_from_masses(masses: np.ndarray) -> np.ndarray:
    """Integer CDF table (uint32[Z_POINTS + 1], 0 .. ONE) from non-negative bin masses.

    ``masses[i]`` is the probability of z in [z_grid()[i], z_grid()[i+1]); they need not
    sum to 1. Deterministic: sequential float64 sums and round-to-nearest only.
    """
    m = np.asarray(masses, np.float64)
    if m.shape != (Z_POINTS,) or not np.all(np.isfinite(m)) or (m < 0).any() or m.sum() <= 0:
        raise ValueError(f"masses must be {Z_POINTS} finite non-negative floats, not all 0")
    cum = np.concatenate(([0.0], np.cumsum(m)))
    table = np.rint(cum * (ONE / cum[-1])).astype(np.int64)
    table = np.maximum.accumulate(np.clip(table, 0, ONE))
    table[-1] = ONE
    return table.astype(np.uint32)


def gaussian_shape(scales: Sequence[float] = (1.0,), weights: Sequence[float] = (1.0,)
                   ) -> np.ndarray:
    """Shape table of a zero-mean Gaussian mixture sum_i w_i N(0, s_i**2) in z units.

    Bin masses are the density at bin midpoints (Simpson over each bin), computed with
    ``_exp_neg`` so the table is the same on every machine.
    """
    if len(scales) != len(weights) or not scales:
        raise ValueError("scales and weights must be non-empty and of equal length")
    z = z_grid()
    h = z[1] - z[0]
    masses = np.zeros(Z_POINTS)
    for s, w in zip(scales, weights, strict=True):
        if not (s > 0 and w >= 0):
            raise ValueError(f"need scale > 0 and weight >= 0, got {s}, {w}")
        dens = _exp_neg(0.5 * (z / s) ** 2) * (w / s)
        mids = _exp_neg(0.5 * ((z[:-1] + h / 2) / s) ** 2) * (w / s)
        masses += (dens[:-1] + 4.0 * mids + dens[1:]) * (h / 6.0)
    return shape_from_masses(masses)


def empirical_table(counts: np.ndarray) -> np.ndarray:
    """Integer CDF over keys (uint32[257], 0 .. ONE) from per-key counts.

    ``counts`` has one entry per key (65,536 or 256, numeric order as in ``dist_kernels``)
    or already one per top-byte bucket (256). Within a bucket the coder interpolates
    linearly in the key.
    """
    c = np.asarray(counts, np.int64)
    if c.ndim != 1 or c.size % EMP_POINTS or (c < 0).any() or c.sum() == 0:
        raise ValueError("counts must be a non-empty 1-d multiple of 256 non-negative integers")
    buckets = c.reshape(EMP_POINTS, -1).sum(axis=1)
    cum = [0]
    for b in buckets.tolist():
        cum.append(cum[-1] + b)
    return np.array([v * ONE // cum[-1] for v in cum], np.uint32)


def _check_cdf(name: str, table: np.ndarray, width: int) -> np.ndarray:
    t = np.asarray(table)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[1] != width:
        raise ValueError(f"{name} tables must have {width} entries, got shape {t.shape}")
    t64 = t.astype(np.int64)
    if (t64[:, 0] != 0).any() or (t64[:, -1] != ONE).any() or (np.diff(t64, axis=1) < 0).any():
        raise ValueError(f"{name} tables must rise from 0 to 2**31")
    return np.ascontiguousarray(t64.astype(np.uint32))


def _inverse(shapes: np.ndarray) -> np.ndarray:
    # z at CDF fractions i / INV_POINTS: only a start for the decoder's exact search.
    q = np.arange(_k.INV_POINTS + 1, dtype=np.float64) / _k.INV_POINTS * ONE
    z = z_grid()
    out = np.empty((shapes.shape[0], q.size))
    for m, t in enumerate(shapes.astype(np.float64)):
        keep = np.concatenate(([True], np.diff(t) > 0))
        out[m] = np.interp(q, t[keep], z[keep])
    return out


class CoderModel:
    """The residual shapes the coder may use: one or more (shape, empirical, weight).

    Model ``m`` gives key k the smooth CDF
    ``S = ((2**16 - w_m) * shape_m(z(k)) + w_m * emp_m(k)) >> 16`` (``dist_kernels``).
    ``shapes``: uint32[M, Z_POINTS + 1]; ``emps``: uint32[M, 257] (default: uniform over
    keys, unused at weight 0); ``weights``: ints in [0, 2**16) per model.
    """

    def __init__(self, shapes: np.ndarray, emps: np.ndarray | None = None,
                 weights: Sequence[int] | np.ndarray | None = None) -> None:
        self.shapes = _check_cdf("shape", shapes, Z_POINTS + 1)
        count = self.shapes.shape[0]
        # The kernels' copy: one more entry (= ONE) so the table end needs no branch.
        self.padded = np.ascontiguousarray(
            np.concatenate([self.shapes, np.full((count, 1), ONE, np.uint32)], axis=1))
        if emps is None:
            emps = np.tile(np.linspace(0, ONE, EMP_POINTS + 1).astype(np.int64), (count, 1))
        self.emps = _check_cdf("empirical", emps, EMP_POINTS + 1)
        w = np.zeros(count, np.int64) if weights is None else np.asarray(weights, np.int64)
        if w.shape != (count,) or self.emps.shape[0] != count:
            raise ValueError(f"need one empirical table and weight per shape ({count})")
        if ((w < 0) | (w >= _k.WEIGHT_ONE)).any():
            raise ValueError("empirical weights must be in [0, 65536)")
        self.weights = np.ascontiguousarray(w)
        # The CPU kernels' copies: packed (point, step) pairs, one table read per lookup.
        self.shape_pairs = _k.pairs(self.padded)
        self.emp_pairs = _k.pairs(self.emps)
        self.inverse = _inverse(self.shapes)
        self.fingerprint = zlib.crc32(
            self.shapes.tobytes() + self.emps.tobytes() + self.weights.astype("<i8").tobytes()
        )

    def __len__(self) -> int:
        return self.shapes.shape[0]


def gaussian_model() -> CoderModel:
    """One standard Gaussian shape, no empirical component."""
    return CoderModel(gaussian_shape())


# ---- frame ---------------------------------------------------------------------------


def _as_params(mu: Any, sigma: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    out = []
    for name, a in (("mu", mu), ("sigma", sigma)):
        arr = np.ascontiguousarray(np.asarray(a, dtype=np.float32)).reshape(-1)
        if arr.size != n:
            raise ValueError(f"{name} has {arr.size} entries for {n} values")
        out.append(arr)
    mu_b, sg_b = out[0].view(np.uint32), out[1].view(np.uint32)
    bad = _k.first_invalid(mu_b, sg_b)
    if bad >= 0:
        raise _bad_param(bad, mu_b, sg_b)
    return mu_b, sg_b


def model_runs(model_index: Any, model: CoderModel, n: int) -> list[tuple[int, int]] | None:
    """``model_index`` given as runs: a list or tuple of (model, count) pairs, value after
    value (the offload hook's layer frame is its keys' model, then its values'), checked
    against the model and the n values; None for an int or a per-value index."""
    if not (isinstance(model_index, (list, tuple)) and model_index
            and isinstance(model_index[0], (list, tuple))):
        return None
    runs = []
    for run in model_index:
        if (len(run) != 2 or not all(isinstance(v, (int, np.integer)) for v in run)
                or run[1] < 0):
            raise ValueError(f"model_index runs must be (model, count) pairs, got {run!r}")
        if not 0 <= run[0] < len(model):
            raise ValueError(f"model_index {run[0]} out of range for a model of "
                             f"{len(model)} shapes")
        runs.append((int(run[0]), int(run[1])))
    if sum(c for _, c in runs) != n:
        raise ValueError(f"model_index runs cover {sum(c for _, c in runs)} values, not {n}")
    return runs


def _as_index(model_index: Any, model: CoderModel, n: int) -> np.ndarray:
    if model_index is None:
        model_index = 0
    runs = model_runs(model_index, model, n)
    if runs is not None:
        return np.repeat(np.array([m for m, _ in runs], np.uint16), [c for _, c in runs])
    if isinstance(model_index, (int, np.integer)):  # one model for every value
        if not 0 <= model_index < len(model):
            raise ValueError(f"model_index {model_index} out of range for a model of "
                             f"{len(model)} shapes")
        return np.array([model_index], np.uint16)
    idx = np.asarray(model_index).reshape(-1)
    if idx.size != n or idx.dtype.kind not in "iu":
        raise ValueError(f"model_index must be {n} integers")
    if n and (idx.min() < 0 or idx.max() >= len(model)):
        raise ValueError(f"model_index out of range for a model of {len(model)} shapes")
    return np.ascontiguousarray(idx, np.uint16)


def _bad_param(i: int, mu: np.ndarray, sigma: np.ndarray) -> ValueError:
    return ValueError(
        f"value {i}: mu={mu.view(np.float32)[i]!r}, sigma={sigma.view(np.float32)[i]!r}; "
        "need finite mu, finite sigma > 0 and |mu| < ~2**34 sigma"
    )


def check_precision(precision: int) -> None:
    """``ValueError`` unless ``precision`` is one the coder takes (12..16)."""
    if not 12 <= precision <= 16:
        raise ValueError(f"precision must be in 12..16, got {precision}")


def check_chunk_size(chunk_size: int) -> None:
    """``ValueError`` unless ``chunk_size`` is one a frame may declare."""
    frame.check_chunk_size(chunk_size, _k.LANES)


_check_chunk = check_chunk_size  # its earlier private name


KIND = frame.Kind("distribution-rANS", MAGIC, _k.LANES, check_precision)


def pack_header(f: ValueFormat, n: int, chunk_size: int, precision: int, fingerprint: int
                ) -> bytes:
    """A frame's 28 header bytes."""
    return frame.HEADER.pack(MAGIC, VERSION, precision, _k.LANES, f.code, n, chunk_size,
                             -(-n // chunk_size), fingerprint)


def encode(values: Any, mu: Any, sigma: Any, model: CoderModel, *,
           fmt: str | ValueFormat | None = None, model_index: Any = None,
           precision: int = DEFAULT_PRECISION, chunk_size: int = DEFAULT_CHUNK,
           threads: int | None = None) -> bytes:
    """Code ``values`` under per-value distributions into a self-describing frame.

    Value i is coded under model ``model_index[i]`` (or ``model_index`` itself when it is
    an int, default 0; or runs, ``[(model, count), ...]`` value after value: ``model_runs``)
    centred at ``mu[i]`` with scale ``sigma[i]`` (float32; finite,
    sigma > 0). ``precision`` (12..16) is the probability resolution of each 256-symbol
    rANS stage.
    """
    bits, f = value_bits(values, fmt)
    check_precision(precision)
    check_chunk_size(chunk_size)
    n = bits.size
    mu_b, sg_b = _as_params(mu, sigma, n)
    midx = _as_index(model_index, model, n)
    fp = f.params

    def chunk(i: int) -> tuple[np.ndarray, np.ndarray | None]:
        sl = slice(i * chunk_size, (i + 1) * chunk_size)
        part = bits[sl]
        out = np.empty(part.nbytes, np.uint8)  # coded must be smaller than raw to be kept
        status, start = _k.encode_chunk(
            part, mu_b[sl], sg_b[sl], midx[sl] if midx.size > 1 else midx, fp,
            model.shape_pairs, model.emp_pairs, model.weights, _RTAB, precision,
            np.empty((_k.ENC_ROWS, _k.LANES), np.int64), out)
        if status == _k.ENC_PARAM:
            raise _bad_param(i * chunk_size + start, mu_b, sg_b)
        return part, None if status == _k.ENC_RAW else out[start:]

    head = frame.Header(precision, f.code, n, chunk_size, -(-n // chunk_size),
                        model.fingerprint)
    return frame.write(KIND, head, b"", chunk, threads)


@dataclass(frozen=True)
class FrameInfo:
    """A parsed, validated frame header and chunk directory."""

    precision: int
    fmt: ValueFormat
    n: int
    chunk_size: int
    fingerprint: int
    lengths: np.ndarray
    crcs: np.ndarray
    modes: np.ndarray
    offsets: np.ndarray

    @property
    def header(self) -> FrameHeader:
        return FrameHeader(self.precision, self.fmt, self.n, self.chunk_size,
                           len(self.lengths), self.fingerprint)


@dataclass(frozen=True)
class FrameHeader:
    """A validated frame header (its 28 bytes, checked against the frame's size)."""

    precision: int
    fmt: ValueFormat
    n: int
    chunk_size: int
    n_chunks: int
    fingerprint: int

    @property
    def payload_base(self) -> int:
        """Byte where the first chunk's payload starts (after the directory)."""
        return HEADER_SIZE + 9 * self.n_chunks


def parse_header(head: bytes | memoryview | np.ndarray, size: int) -> FrameHeader:
    """Validate the header ``head`` (a frame's first bytes, at least 28 of them where the
    frame has them) of a ``size``-byte frame: ``parse``'s checks that need no directory
    byte; ``CorruptDataError`` on any mismatch."""
    h = frame.read_header(KIND, frame.as_bytes(head), size)
    if h.flag not in _BY_CODE:
        raise CorruptDataError(f"distribution-rANS frame value format {h.flag} at byte 7")
    frame.check_directory_fits(KIND, HEADER_SIZE, h.n_chunks, size)
    return FrameHeader(h.param, _BY_CODE[h.flag], h.n, h.chunk_size, h.n_chunks, h.model)


def directory_error(end: int, size: int, bad_mode: int, mode: int) -> str | None:
    """What ``parse`` says of a directory whose payloads end at byte ``end`` of a
    ``size``-byte frame and whose first chunk of unknown mode is ``bad_mode`` (its mode
    ``mode``; -1: none), or None where both are right."""
    return frame.directory_error(KIND.name, end, size, bad_mode, mode)


def parse(blob: bytes | memoryview | np.ndarray) -> FrameInfo:
    """Validate a frame's header and directory; ``CorruptDataError`` on any mismatch."""
    buf = frame.as_bytes(blob)
    h = parse_header(buf, buf.size)
    d = frame.read_directory(KIND, buf, HEADER_SIZE, h.n_chunks)
    return FrameInfo(h.precision, h.fmt, h.n, h.chunk_size, h.fingerprint, d.lengths, d.crcs,
                     d.modes, d.offsets)


def decode(blob: bytes | memoryview | np.ndarray, mu: Any, sigma: Any, model: CoderModel, *,
           model_index: Any = None, threads: int | None = None,
           out: np.ndarray | None = None, max_output: int | None = None) -> np.ndarray:
    """Decode a frame back into value bits (uint16 / uint8, flat).

    ``mu``, ``sigma``, ``model`` and ``model_index`` must be exactly the encoder's.
    ``CorruptDataError`` for a malformed frame, a model whose fingerprint differs, a frame
    that declares another count of values than ``mu`` has or more than ``max_output``
    (default: no bound beyond ``mu``'s; both checked before anything is allocated), or a
    chunk whose decoded values fail their CRC; ``ValueError`` for invalid mu / sigma.
    """
    buf = frame.as_bytes(blob)
    info = parse(buf)
    if info.fingerprint != model.fingerprint:
        raise CorruptDataError(f"frame was coded with model {info.fingerprint:#010x}, "
                               f"decoder has {model.fingerprint:#010x} (byte 24)")
    f = info.fmt
    n = info.n
    if max_output is not None and n > max_output:
        raise CorruptDataError(f"distribution-rANS frame declares {n} values (byte 8), more "
                               f"than the {max_output} its reader allows")
    given = math.prod(np.shape(mu))
    if n != given:
        raise CorruptDataError(f"distribution-rANS frame holds {n} values (byte 8), mu has "
                               f"{given}")
    mu_b, sg_b = _as_params(mu, sigma, n)
    midx = _as_index(model_index, model, n)
    if out is None:
        out = np.empty(n, f.storage)
    elif out.dtype != f.storage or out.shape != (n,):
        raise ValueError(f"out must be {f.storage} of shape ({n},)")
    elif np.may_share_memory(out, buf):  # the kernel reads the frame while it writes out
        raise ValueError("out must not overlap the frame")
    fp = f.params
    cs = info.chunk_size
    offsets, lengths = info.offsets.tolist(), info.lengths.tolist()

    def coded(chunks: list[int], lo0: int, hi0: int) -> list[int]:
        (i,) = chunks  # one chunk per task
        sl = slice(lo0, hi0)
        code = _k.decode_chunk(buf, offsets[i], lengths[i], mu_b[sl],
                               sg_b[sl], midx[sl] if midx.size > 1 else midx, fp,
                               model.shape_pairs, model.inverse, model.emp_pairs,
                               model.weights, _RTAB, info.precision,
                               np.empty((_k.LANE_ROWS, _k.LANES), np.int64),
                               np.empty((_k.FLOAT_ROWS, _k.LANES)), out[sl])
        if code < 0:
            raise _bad_param(i * cs - code - 1, mu_b, sg_b)
        return [code]

    d = frame.Directory(info.lengths, info.crcs, info.modes, info.offsets)
    frame.decode_payloads(KIND, buf, d, cs, out, coded, 1, threads)
    return out


def value_costs(values: Any, mu: Any, sigma: Any, model: CoderModel, *,
                fmt: str | ValueFormat | None = None, model_index: Any = None,
                precision: int = DEFAULT_PRECISION) -> np.ndarray:
    """-log2 P(value) of each value under the coder's own quantized distributions.

    What ``encode`` would spend on each value, stream overhead aside (float64, flat).
    """
    bits, f = value_bits(values, fmt)
    mu_b, sg_b = _as_params(mu, sigma, bits.size)
    midx = _as_index(model_index, model, bits.size)
    out = np.empty(bits.size)
    bad = _k.cost(bits, mu_b, sg_b, midx, f.params, model.shape_pairs, model.emp_pairs,
                  model.weights, _RTAB, precision, out)
    if bad >= 0:
        raise _bad_param(bad, mu_b, sg_b)
    return out


__all__ = [
    "FORMATS", "CoderModel", "FrameInfo", "ValueFormat", "decode", "empirical_table",
    "encode", "gaussian_model", "gaussian_shape", "parse", "shape_from_masses", "value_bits",
    "value_costs", "value_format", "z_grid",
]
