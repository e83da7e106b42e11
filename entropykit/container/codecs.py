"""Field codecs: code one field's uint8 symbols with rANS, tANS, zstd or raw, and pick one.

What it is: one ``encode``/``decode`` pair over the four codecs a field may use, each of
which checks its decoded bytes (rANS/tANS frames carry a CRC-32 per chunk, zstd frames
their content checksum, raw a CRC-32 prefix), and ``choose``: the smallest codec for a
field, measured on the field itself when it is small and on a fixed, spread sample when
it is large. What it is not: the split of a dtype into fields (``formats``) or the
container layout.

Codec payloads:
    rans  an rANS frame (``entropykit.rans``), conditioned on the field's context if any
    tans  a tANS frame (``entropykit.tans``); never conditioned
    rans2d  row / column class maps, then an rANS frame conditioned on each symbol's class
          (``classed.py``); only for a field of one symbol per element of a 2-D tensor
    zstd  one zstd frame (level 3) with content size and content checksum
    raw   u32 CRC-32 of the symbols, then the symbols
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from .. import rans, tans
from .._errors import CorruptDataError
from ..coding import contexts, frame, tables
from ..coding.crc32 import crc32
from ..rans import static as rans_static
from ..tans import static as tans_static
from . import classed

ZSTD_LEVEL = 3
TANS_LOG = 12  # the largest tANS table: least quantization loss (0.16% on MiniLM exponents)
RANS_PRECISION = 12  # context-conditioned fields: 12 beats 14 (smaller tables, BF16 +0.01%)
# Wide, skewed alphabets (fp8 weights: > 128 symbols present at < 7.5 bits each) lose
# 0.2-0.3% to a 4096-slot table; rANS at 14 bits resolves their rare symbols (measured
# on MiniLM: e4m3 +0.18%, e5m2 +0.31%; near-uniform mantissa bytes: tANS stays 0.1% ahead).
WIDE_PRECISION = 14
_WIDE_SYMBOLS = 128
_WIDE_MAX_BITS = 7.5
# zstd is judged on fields up to this many symbols whole, on larger ones by a sample of
# _BLOCKS blocks of _BLOCK symbols spread evenly. On a larger field a probe is tried
# first, the first _PROBE / _BLOCKS symbols of each of those blocks (~30 us; the sample
# of exponent-like bytes costs ~500 us), and the sample only where the probe beats the
# best other codec's estimate: on most weights LZ matching never wins (zstd's sample
# estimate was never below the best other on any large MiniLM bf16 to e5m2 field, but its
# trials were ~15% of compress time; near-incompressible fields come within 0.1% of raw,
# so a looser test would let them all through), and where it does (integer tables, F32
# word embeddings' low mantissa bytes, whose untrained rows sit in one block) the probe
# tracks the sample within ~3% (one block from the middle missed the latter).
_BLOCK = 1 << 14
_BLOCKS = 4
EXACT_LIMIT = _BLOCK * _BLOCKS
_PROBE = 1 << 12
_CRC = struct.Struct("<I")
RAW_OVERHEAD = _CRC.size  # a raw payload is the symbols plus this; no codec is larger
# target="gpu" (files for entropykit.gpu, measured in gpu/README.md): the GPU kernel decodes
# rANS only, with tables in shared memory up to 12 bits, fastest at chunks of 2**16 and
# without context tables; copying a raw field costs half of decoding one, so a field is
# entropy-coded only where that saves at least GPU_MIN_SAVING of its raw size.
TARGETS = ("cpu", "gpu")
GPU_CHUNK = 1 << 16
GPU_MIN_SAVING = 0.01
# Decoding an entropy-coded field costs ~3x copying a raw one, so a field without a context
# is entropy-coded only where its order-0 estimate saves MIN_SAVING of its raw size (F16 low
# bytes save ~0.05%: MiniLM F16 loses 1 KB of 23 MB and decodes ~1.6x faster). With a
# context the order-0 estimate understates the saving, so there it must only beat raw.
# fast=True: a field saving less than FAST_MIN_SAVING is stored raw without coding or trials
# (BF16/F32 mantissa bytes save 0.3-2%), and zstd is judged only on fields small enough to
# be coded whole.
MIN_SAVING = 0.001
FAST_MIN_SAVING = 0.02
# rANS (32 lanes, AVX-512) codes and decodes ~1.4-1.5x faster than tANS (4 scalar states)
# on this CPU (MiniLM BF16 exponents: 380-450 vs 260-370 M/s encode, 590-690 vs 360-530
# M/s decode) but its 128 bytes of start states per chunk cost 0.12% of those fields
# (MiniLM BF16 file ratio +0.0002). By default tANS codes every context-free field; fast
# mode keeps tANS only where it saves FAST_TANS_GAIN of the rANS estimate (small fields,
# where the states are a large share), and codes wide alphabets at 12 bits too (fp8:
# decode ~15% faster, ratio +0.0017 e4m3, +0.0025 e5m2 on MiniLM).
FAST_TANS_GAIN = 0.005
# Row / column classes (classed.py) pay for their maps, tables and the slower context
# decode only where their estimate saves CLASSED_MIN_SAVING of the plain entropy coder's;
# they code wide alphabets at WIDE_PRECISION (MiniLM fp8 bytes: 14 bits beat 12 by 0.1%
# of the field with 16 tables), others at RANS_PRECISION (BF16 exponents, F16 high
# bytes: 14 bits gain < 0.03% but make 4x larger decode tables).
CLASSED_MIN_SAVING = 0.005
_RANS_STATES = 4 * 32  # bytes of lane states per rANS chunk (rans/kernels.py)
_TANS_STATES = 7  # bytes of states and marker per tANS chunk, at most


def encode(codec: str, symbols: np.ndarray, context: np.ndarray | None,
           precision: int = RANS_PRECISION, chunk_size: int = frame.DEFAULT_CHUNK,
           counts: np.ndarray | None = None) -> bytes:
    """``symbols`` (uint8, 1-D) coded with ``codec``; ``context``, ``precision`` and
    ``chunk_size`` are used by rans only (the frame records them; decoding needs no
    choice). ``counts``, the histogram the caller already took (rans/tans; with a context
    the joint histogram), saves the coder a pass: see ``frame.encode``."""
    if codec == "rans":
        return frame.encode(rans_static.CODER, symbols, precision, chunk_size, 1, context,
                            counts=counts)
    if codec == "tans":
        return frame.encode(tans_static.CODER, symbols, TANS_LOG, frame.DEFAULT_CHUNK, 1,
                            counts=counts)
    if codec == "rans2d":
        raise ValueError("rans2d payloads are made by choose() (they need the tensor's grid)")
    if codec == "zstd":
        return _zstd().compress(symbols.data)
    if codec == "raw":
        return b"".join((_CRC.pack(crc32(symbols)), symbols.data))  # one copy
    raise ValueError(f"unknown codec {codec!r}")


_LOCAL = threading.local()  # one zstd (de)compressor per thread: making one costs ~8 us


def _zstd() -> zstandard.ZstdCompressor:
    cctx = getattr(_LOCAL, "cctx", None)
    if cctx is None:
        cctx = _LOCAL.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True,
                                                      write_content_size=True)
    return cctx


def _unzstd() -> zstandard.ZstdDecompressor:
    dctx = getattr(_LOCAL, "dctx", None)
    if dctx is None:
        dctx = _LOCAL.dctx = zstandard.ZstdDecompressor()
    return dctx


def count(codec: str, data: np.ndarray, *, limit: int) -> int:
    """How many symbols the payload ``data`` says it holds; CorruptDataError if unreadable
    or more than ``limit`` (what the caller's segment can hold): a count read here may
    size an allocation, so it is never returned unchecked."""
    n = _declared(codec, data)
    if n > limit:
        raise CorruptDataError(f"{codec} payload declares {n} symbols, more than the {limit} "
                               "its field can hold")
    return n


def _declared(codec: str, data: np.ndarray) -> int:
    if codec in ("rans", "tans"):
        if data.size < frame.HEADER_SIZE:
            raise CorruptDataError(f"{codec} frame truncated: {data.size} bytes")
        return int(data[8:16].view("<u8")[0])
    if codec == "rans2d":
        return classed.count(data)
    if codec == "zstd":
        try:
            n = zstandard.frame_content_size(data.data)
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd frame: {e}") from None
        if n < 0:
            raise CorruptDataError("zstd frame does not record its size")
        return n
    if codec == "raw":
        if data.size < _CRC.size:
            raise CorruptDataError(f"raw field truncated: {data.size} bytes")
        return data.size - _CRC.size
    raise CorruptDataError(f"unknown codec {codec!r}")


def decode(codec: str, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
    """Decode ``data`` (uint8 view of one payload) into ``n`` symbols; CorruptDataError if
    it is malformed, holds another count, or fails its checksum. ``n`` bounds what is
    allocated: the payload's own count is checked against it first (``count``'s
    ``limit`` bounds ``n`` where it came from the payload). The result may be read-only
    and share memory with ``data`` (raw, zstd): read it, do not write it."""
    if codec in ("rans", "tans"):
        mod = rans if codec == "rans" else tans
        got = _declared(codec, data)
        if got != n:
            raise CorruptDataError(f"{codec} frame holds {got} symbols, field has {n}")
        kw = {"context": context} if codec == "rans" else {}
        try:
            return mod.decode(data, threads=1, out=np.empty(n, np.uint8), max_output=n, **kw)
        except CorruptDataError:
            raise
        except ValueError as e:  # e.g. a context flag on a field that has no context
            raise CorruptDataError(f"{codec} frame: {e}") from None
    if codec == "rans2d":  # self-contained: its context is in its own payload
        return classed.decode(data, n)
    if codec == "zstd":
        try:
            if zstandard.frame_content_size(data.data) != n:
                raise CorruptDataError(f"zstd frame does not hold {n} bytes")
            out = _unzstd().decompress(data.data, max_output_size=n)
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd frame: {e}") from None
        return np.frombuffer(out, np.uint8)
    if codec == "raw":
        if data.size != n + _CRC.size:
            raise CorruptDataError(f"raw field is {data.size} bytes, expected {n + _CRC.size}")
        out = data[_CRC.size:]  # a view: the caller only reads the symbols
        if crc32(out) != _CRC.unpack(data[:_CRC.size].tobytes())[0]:
            raise CorruptDataError("raw field fails its CRC-32")
        return out
    raise CorruptDataError(f"unknown codec {codec!r}")


def _sample(a: np.ndarray, width: int = _BLOCK) -> np.ndarray:
    """The first ``width`` symbols of each of the _BLOCKS spread blocks, joined."""
    step = (a.size - _BLOCK) // (_BLOCKS - 1)
    return np.concatenate([a[i * step : i * step + width] for i in range(_BLOCKS)])


def _zstd_estimate(symbols: np.ndarray, rival: int) -> tuple[int, bytes | None]:
    """(estimated size, the payload itself when the field was coded whole). ``rival``: the
    best other codec's estimate; a large field whose probe's estimate does not beat it
    gets that estimate, without the spread sample's."""
    n = symbols.size
    if n <= EXACT_LIMIT:
        blob = encode("zstd", symbols, None)
        return len(blob), blob
    probe = _sample(symbols, _PROBE // _BLOCKS)
    probe_size = len(encode("zstd", probe, None)) * n // probe.size
    if probe_size >= rival:
        return probe_size, None
    sample = _sample(symbols)
    return len(encode("zstd", sample, None)) * n // sample.size, None


def _sample_bits(symbols: np.ndarray) -> float:
    """Order-0 entropy of the spread sample, bits per symbol (for 64 Ki symbols the plug-in
    estimate is low by < 0.003 bit)."""
    sample = _sample(symbols)
    return tables.entropy_bits(tables.histogram(sample)) / sample.size


def _entropy_estimate(counts: np.ndarray, bits: float, n: int) -> int:
    """Bytes an entropy-coded frame of ``n`` symbols with these counts (order-0 entropy
    ``bits``) is expected to take: the entropy, the table (estimated as in
    coding/contexts.py) and the frame header and directory."""
    present = int(np.count_nonzero(counts))
    table = 1 + min(present, 32) + 2 * present
    chunks = -(-n // frame.DEFAULT_CHUNK)
    return int(bits / 8) + table + frame.HEADER_SIZE + 9 * chunks


@dataclass(frozen=True)
class Choice:
    """A coded field: its codec, payload, and order-0 entropy in bits (for a large field
    that fast mode stores raw, estimated from the spread sample)."""

    codec: str
    blob: bytes
    entropy_bits: float


def check_target(target: str) -> None:
    """ValueError unless ``target`` is one of ``TARGETS``."""
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")


def grid_of(shape: tuple[int, ...], first: int) -> tuple[int, int] | None:
    """``choose``'s ``grid`` for a field of one symbol per element of a tensor of ``shape``
    whose first symbol is element ``first``: (symbols per row, column of the first), the
    tensor taken as rows of its last dimension; None for fewer than 2 rows or columns."""
    if len(shape) < 2 or shape[-1] < 2 or math.prod(shape[:-1]) < 2:
        return None
    return shape[-1], first % shape[-1]


def choose(symbols: np.ndarray, context: np.ndarray | None, target: str = "cpu", *,
           fast: bool = False, grid: tuple[int, int] | None = None,
           counts: np.ndarray | None = None) -> Choice:
    """Code a field with the codec expected to be smallest, never larger than raw.

    The entropy coder is rANS for a field with a context (only rANS conditions on one), rANS
    at ``WIDE_PRECISION`` for a wide skewed alphabet, and tANS otherwise (smaller than rANS
    on real weights: fewer state bytes per chunk). Its size is estimated from the order-0
    entropy (a candidate only where that saves ``MIN_SAVING``), zstd's by coding the field
    (or a spread sample of it), raw's is exact; the smallest estimate is coded, and the
    result replaced by raw if it is not smaller. Only one coder runs over the whole field,
    once: the histogram (with a context, the joint histogram) is taken once and handed to
    the coder, and a field small enough to be judged whole keeps its zstd trial as its
    payload.
    ``target="gpu"`` writes what ``entropykit.gpu`` decodes fastest (see ``GPU_CHUNK``):
    rANS at ``RANS_PRECISION`` in chunks of ``GPU_CHUNK``, no context, zstd only for
    fields small enough to be judged whole (the host decodes those), and raw unless the
    estimate saves ``GPU_MIN_SAVING``.
    ``fast`` trades size for speed both ways (``FAST_MIN_SAVING``, ``FAST_TANS_GAIN``).
    ``grid`` (``grid_of``): the field has one symbol per element of a 2-D tensor; then a
    field without a context may be coded "rans2d" (target "cpu", not fast) where that
    saves ``CLASSED_MIN_SAVING``.
    ``counts``, when the caller has it, saves a pass: the symbols' histogram
    (int64[256]), or for a field with a context (target "cpu", not fast) the joint
    histogram ``contexts.joint_histogram(context, symbols)``. It must be exact.
    Deterministic: the same symbols and options always give the same choice.
    """
    check_target(target)
    n = symbols.size
    raw = n + _CRC.size
    if n == 0:
        return Choice("raw", encode("raw", symbols, None), 0.0)
    gpu = target == "gpu"
    context = None if gpu else context
    if n > EXACT_LIMIT and (fast or (context is None and not gpu and counts is None)):
        # A sample says whether a pass over the field can pay. Its plug-in entropy is low
        # (by ~0.003 bit for near-uniform bytes, with a spread of ~0.0001), so where it
        # says entropy coding cannot save MIN_SAVING the whole field's count agrees; by
        # default raw is then taken without that pass unless zstd's probe beats it
        # (F16 low bytes, F32 low mantissa bytes).
        h = _sample_bits(symbols)
        if fast and h > 8 * (1 - FAST_MIN_SAVING):
            return Choice("raw", encode("raw", symbols, None), h * n)
        if not fast and h > 8 * (1 - MIN_SAVING) and _zstd_estimate(symbols, raw)[0] > raw:
            return Choice("raw", encode("raw", symbols, None), h * n)
    joint = None
    if context is not None and not fast:
        # The joint histogram's column sums are the counts; a pass over a small field
        # costs less than summing the 256 x 256 joint.
        joint = contexts.joint_histogram(context, symbols) if counts is None else counts
        counts = tables.histogram(symbols) if n < 1 << 15 else joint.sum(axis=0)
    elif counts is None:
        counts = tables.histogram(symbols)
    bits = tables.entropy_bits(counts)
    estimate = _entropy_estimate(counts, bits, n)
    min_saving = FAST_MIN_SAVING if fast else 0.0 if context is not None else MIN_SAVING
    entropy_pays = estimate <= (1 - min_saving) * raw
    if fast and not entropy_pays:
        return Choice("raw", encode("raw", symbols, None), bits)
    if context is not None and joint is None:
        joint = contexts.joint_histogram(context, symbols)
    wide = int(np.count_nonzero(counts)) > _WIDE_SYMBOLS and bits < _WIDE_MAX_BITS * n
    entropy_codec = "rans"
    if context is None and not wide and not gpu:
        chunks = -(-n // frame.DEFAULT_CHUNK)
        gain = (_RANS_STATES - _TANS_STATES) * chunks
        if not fast or gain >= FAST_TANS_GAIN * (estimate + _RANS_STATES * chunks):
            entropy_codec = "tans"
    precision = WIDE_PRECISION if context is None and wide and not (gpu or fast) else RANS_PRECISION
    chunk = GPU_CHUNK if gpu else frame.DEFAULT_CHUNK
    estimates = {}
    if entropy_pays:
        estimates[entropy_codec] = int(estimate / (1 - GPU_MIN_SAVING)) if gpu else estimate
    whole = None  # zstd's payload, when it was judged on the whole field
    if not (gpu or fast) or n <= EXACT_LIMIT:
        estimates["zstd"], whole = _zstd_estimate(symbols, min([raw, *estimates.values()]))
    estimates["raw"] = raw
    plan = None
    # Near-uniform fields (mantissa bytes) gain nothing from classes: no plan is tried.
    if (grid is not None and context is None and entropy_pays and not (gpu or fast)
            and bits < _WIDE_MAX_BITS * n):
        plan = classed.plan(symbols, *grid, counts)
        states = _RANS_STATES if entropy_codec == "rans" else _TANS_STATES
        plain = estimate + states * -(-n // frame.DEFAULT_CHUNK)
        if plan is not None and plan.estimate <= (1 - CLASSED_MIN_SAVING) * plain:
            estimates["rans2d"] = plan.estimate
    codec = min(estimates, key=lambda c: (estimates[c], c != entropy_codec))
    if codec == "zstd" and whole is not None:
        blob = whole
    elif codec == "rans2d":
        assert grid is not None and plan is not None
        blob = classed.encode(symbols, *grid, plan, WIDE_PRECISION if wide else RANS_PRECISION)
    else:
        blob = encode(codec, symbols, context, precision, chunk,
                      counts=counts if joint is None else joint)
    if len(blob) >= raw:
        return Choice("raw", encode("raw", symbols, None), bits)
    return Choice(codec, blob, bits)
