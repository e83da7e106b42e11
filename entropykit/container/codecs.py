"""Field codecs: a registry of the codecs a field's uint8 symbols may be coded with, and
policies that choose among them.

What it is: one ``Codec`` object per codec name (rans, tans, zstd, raw here; rans2d in
``classed.py``), registered once in ``CODECS``, each with its ``estimate`` (a ``Bid``: the
expected payload size and how to make the payload, or None where it cannot or should not
code the field), ``encode``, ``decode`` and ``count``; and ``Policy`` objects (``CPU``,
``FAST``, ``GPU``, ``GPU_FAST``), plain data naming their candidates and thresholds.
``choose`` analyses a field once (``Field``) and codes it with the candidate of smallest
estimate, never larger than raw. Every decoder checks its bytes (rANS/tANS frames carry a
CRC-32 per chunk, zstd frames their content checksum, raw a CRC-32 prefix). What it is
not: the split of a dtype into fields (``formats``), the frames (``coding.frame``) or the
container layout.

Codec payloads:
    rans    an rANS frame (``entropykit.rans``), conditioned on the field's context if any
    tans    a tANS frame (``entropykit.tans``); never conditioned
    rans2d  row / column class maps, then an rANS frame conditioned on each symbol's class
            (``classed.py``); only for a field of one symbol per element of a 2-D tensor
    zstd    one zstd frame (level 3) with content size and content checksum
    raw     u32 CRC-32 of the symbols, then the symbols
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import numpy as np
import zstandard

from .. import rans, tans
from .._errors import CorruptDataError
from ..coding import contexts, frame, tables
from ..coding import crc32 as _crc32
from ..coding.crc32 import crc32, crc32_combine
from ..rans import static as rans_static
from ..tans import static as tans_static
from . import classed, order0

ZSTD_LEVEL = 3
TANS_LOG = 12  # the largest tANS table: least quantization loss
RANS_PRECISION = 12  # smaller tables than 14 bits at no loss on context-conditioned fields
# Wide, skewed alphabets lose to a 4096-slot table's quantization; 14 bits resolve their
# rare symbols.
WIDE_PRECISION = 14
_WIDE_SYMBOLS = 128  # a wide alphabet: more symbols present than this ...
_WIDE_MAX_BITS = 7.5  # ... at fewer bits each than this (else near-uniform)
# zstd is judged on a field up to EXACT_LIMIT symbols by coding it whole, on a larger one by
# a sample of _BLOCKS spread blocks of _BLOCK symbols: LZ matches come in runs of rows
# (untrained embedding rows, integer tables), which a single block may miss. A cheaper probe
# (_PROBE symbols from the same blocks) goes first: the sample is coded only where the probe
# beats the best other estimate, which on float weights it almost never does.
_BLOCK = 1 << 14
_BLOCKS = 4
EXACT_LIMIT = _BLOCK * _BLOCKS
_PROBE = 1 << 12
_CRC = struct.Struct("<I")
RAW_OVERHEAD = _CRC.size  # a raw payload is the symbols plus this; no codec is larger
TARGETS = ("cpu", "gpu")
# target="gpu" (files for entropykit.gpu, docs/gpu.md): the GPU decodes rANS only, fastest
# in chunks of GPU_CHUNK with tables of at most 12 bits and no contexts.
GPU_CHUNK = 1 << 16
# Copying a raw field costs the GPU half of decoding one: code only what saves this share.
GPU_MIN_SAVING = 0.01
# Decoding costs ~3x copying raw bytes: a context-free field is entropy-coded only where its
# order-0 estimate saves this share (with a context the estimate understates the saving).
MIN_SAVING = 0.001
# fast: fields saving less (mantissa bytes) are stored raw, without coding or trials.
FAST_MIN_SAVING = 0.02
# fast: rANS codes and decodes faster than tANS; tANS only where its fewer state bytes per
# chunk save this share of the rANS estimate (small fields).
FAST_TANS_GAIN = 0.005
# Row / column classes pay for their maps, tables and slower context decode only where
# their estimate saves this share of the plain entropy coder's.
CLASSED_MIN_SAVING = 0.005


@dataclass(frozen=True)
class Policy:
    """How a field's codec is chosen: data only, read by ``choose`` and the estimates.

    ``candidates`` in order of preference where estimates tie (the entropy coders first;
    rANS and tANS never both bid). ``min_saving`` / ``conditioned_min_saving``: share of
    the raw size an order-0 entropy estimate must save for a field without / with a
    context. ``raw_unless_pays``: a field whose entropy estimate does not pay is stored raw
    without other trials. ``screen``: a field over ``EXACT_LIMIT`` symbols is first judged
    on a spread sample, and stored raw without a pass where that says entropy coding
    cannot pay (and, unless ``raw_unless_pays``, zstd's probe agrees).
    """

    name: str
    candidates: tuple[str, ...]
    contexts: bool  # fields are conditioned on their format's context
    min_saving: float
    conditioned_min_saving: float
    raw_unless_pays: bool
    screen: bool
    tans_gain: float  # tANS only where its state bytes save this share of rANS's estimate
    precision: int  # rANS table bits
    wide_precision: int  # rANS table bits for a wide alphabet without a context
    chunk: int  # symbols per rANS chunk
    cost: float = 0.0  # entropy-coded estimates count as size / (1 - cost)
    zstd_limit: int | None = None  # zstd judged only on fields up to this size
    classed_min_saving: float = CLASSED_MIN_SAVING


# The default codes with what the GPU kernel decodes too (rANS, rans2d, raw), so one file
# loads at full speed on both: tANS's fewer state bytes per chunk save a few bytes of a
# mid-size field only. zstd stays for small fields, decoded on the host (tiny).
CPU = Policy("cpu", ("rans", "zstd", "raw", "rans2d"), contexts=True,
             min_saving=MIN_SAVING, conditioned_min_saving=0.0, raw_unless_pays=False,
             screen=True, tans_gain=0.0, precision=RANS_PRECISION,
             wide_precision=WIDE_PRECISION, chunk=frame.DEFAULT_CHUNK)
FAST = Policy("fast", ("rans", "tans", "zstd", "raw"), contexts=True,
              min_saving=FAST_MIN_SAVING, conditioned_min_saving=FAST_MIN_SAVING,
              raw_unless_pays=True, screen=True, tans_gain=FAST_TANS_GAIN,
              precision=RANS_PRECISION, wide_precision=RANS_PRECISION,
              chunk=frame.DEFAULT_CHUNK, zstd_limit=EXACT_LIMIT)
# The host decodes zstd fields of GPU files: only those small enough to judge whole.
GPU = Policy("gpu", ("rans", "zstd", "raw"), contexts=False, min_saving=MIN_SAVING,
             conditioned_min_saving=0.0, raw_unless_pays=False, screen=False, tans_gain=0.0,
             precision=RANS_PRECISION, wide_precision=RANS_PRECISION, chunk=GPU_CHUNK,
             cost=GPU_MIN_SAVING, zstd_limit=EXACT_LIMIT)
GPU_FAST = Policy("gpu_fast", GPU.candidates, contexts=False, min_saving=FAST_MIN_SAVING,
                  conditioned_min_saving=FAST_MIN_SAVING, raw_unless_pays=True, screen=True,
                  tans_gain=0.0, precision=RANS_PRECISION, wide_precision=RANS_PRECISION,
                  chunk=GPU_CHUNK, cost=GPU_MIN_SAVING, zstd_limit=EXACT_LIMIT)
# A checkpoint writer's (``entropykit.dcp``): saves are on a training job's critical path
# and read back once, so coding time counts over decoding time. tANS codes every order-0
# field it can (it encodes faster than rANS and its tables are no larger; it decodes
# slower); fields are coded without contexts (a conditioned mantissa byte costs a joint
# histogram and class tables for the order-0 coder's size, within 0.1 %); zstd is tried
# on small fields only, where a trial costs about what the entropy coder does (larger
# float fields never go to zstd, and its trial costs several times their coding).
CHECKPOINT = Policy("checkpoint", ("rans", "tans", "zstd", "raw"), contexts=False,
                    min_saving=FAST_MIN_SAVING, conditioned_min_saving=FAST_MIN_SAVING,
                    raw_unless_pays=True, screen=True, tans_gain=0.0,
                    precision=RANS_PRECISION, wide_precision=RANS_PRECISION,
                    chunk=frame.DEFAULT_CHUNK, zstd_limit=_PROBE)
POLICIES = {("cpu", False): CPU, ("cpu", True): FAST, ("gpu", False): GPU,
            ("gpu", True): GPU_FAST}


@dataclass
class Field:
    """One field as the estimates see it, analysed once by ``choose``: its symbols, the
    context it is coded with (None where the policy drops it), its histogram (and joint
    histogram with the context), order-0 entropy ``bits``, the order-0 frame estimate,
    whether that pays, and which order-0 entropy coder (rANS or tANS) codes it."""

    symbols: np.ndarray
    context: np.ndarray | None
    policy: Policy
    grid: tuple[int, int] | None
    counts: np.ndarray
    joint: np.ndarray | None
    bits: float
    estimate: int
    pays: bool
    wide: bool
    coder: Codec = field(init=False)

    @property
    def n(self) -> int:
        return self.symbols.size

    @property
    def plain(self) -> int:
        """The entropy coder's expected payload with its lane states: what another model
        of the same symbols must beat."""
        return self.estimate + self.coder.states * -(-self.n // frame.DEFAULT_CHUNK)


@dataclass(frozen=True)
class Bid:
    """A codec's estimate for a field: expected payload bytes, and the payload's maker."""

    size: int
    make: Callable[[], bytes]


class Codec(Protocol):
    """One codec of ``CODECS``: how big it expects a field to code, and its payloads."""

    name: str
    states: int  # bytes of coder state per chunk (entropy coders)

    def estimate(self, f: Field, rival: int) -> Bid | None:
        """A bid for ``f``, None where this codec is not a candidate; ``rival``: the
        smallest bid so far (raw's size at most)."""

    def encode(self, symbols: np.ndarray, context: np.ndarray | None, precision: int,
               chunk_size: int, counts: np.ndarray | None) -> bytes: ...

    def count(self, data: np.ndarray) -> int:
        """Symbols the payload says it holds; CorruptDataError if it is unreadable."""

    def decode(self, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray: ...


class _Entropy:
    """rANS or tANS frames of a static model: ``states`` bytes of lane states per chunk;
    only rANS conditions on a context."""

    def __init__(self, name: str, module: ModuleType, coder: frame.ChunkCoder,
                 states: int) -> None:
        self.name, self._module, self._coder, self.states = name, module, coder, states
        self._conditions = coder.supports_context

    def estimate(self, f: Field, rival: int) -> Bid | None:
        if f.coder is not self or not f.pays:
            return None
        wide = f.context is None and f.wide
        precision = f.policy.wide_precision if wide else f.policy.precision
        return Bid(int(f.estimate / (1 - f.policy.cost)),
                   lambda: self.encode(f.symbols, f.context, precision, f.policy.chunk,
                                       f.counts if f.joint is None else f.joint))

    def encode(self, symbols: np.ndarray, context: np.ndarray | None, precision: int,
               chunk_size: int, counts: np.ndarray | None) -> bytes:
        if not self._conditions:  # tANS: one table size and chunk size, no context
            precision, chunk_size, context = TANS_LOG, frame.DEFAULT_CHUNK, None
        n = symbols.size
        if _crc32.ACCELERATED and counts is not None and n:  # a few calls, not a few a chunk
            ctx = None if context is None else tables._flat(context, np.uint8)
            return order0.encode(tables._flat(symbols, np.uint8), ctx, counts, precision,
                                 chunk_size, not self._conditions)
        if not self._conditions:
            return frame.encode(self._coder, symbols, TANS_LOG, frame.DEFAULT_CHUNK, None,
                                counts=counts)
        return frame.encode(self._coder, symbols, precision, chunk_size, None, context,
                            counts=counts)

    def count(self, data: np.ndarray) -> int:
        # The header's symbol count (byte 8, docs/format.md) alone: parsing the whole frame
        # is decode's work, and this count is checked against the caller's limit first.
        if data.size < frame.HEADER_SIZE:
            raise CorruptDataError(f"{self.name} frame truncated: {data.size} bytes")
        return int(data[8:16].view("<u8")[0])

    def decode(self, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
        got = self.count(data)
        if got != n:
            raise CorruptDataError(f"{self.name} frame holds {got} symbols, field has {n}")
        kw = {"context": context} if self._conditions else {}
        try:
            return self._module.decode(data, threads=None, out=np.empty(n, np.uint8),
                                       max_output=n, **kw)
        except CorruptDataError:
            raise
        except ValueError as e:  # e.g. a context flag on a field that has no context
            raise CorruptDataError(f"{self.name} frame: {e}") from None


RANS = _Entropy("rans", rans, rans_static.CODER, 4 * rans_static.CODER.lanes)
TANS = _Entropy("tans", tans, tans_static.CODER, 7)  # states and end marker, at most


def _coder(f: Field) -> Codec:
    """The order-0 entropy coder of ``f``: tANS (fewer state bytes per chunk) where the
    policy has it and it can code the field (no context, not a wide alphabet its 12-bit
    table would quantize), and its state bytes save ``tans_gain`` of rANS's estimate."""
    if f.context is not None or f.wide or "tans" not in f.policy.candidates:
        return RANS
    chunks = -(-f.n // frame.DEFAULT_CHUNK)
    gain = (RANS.states - TANS.states) * chunks
    return TANS if gain >= f.policy.tans_gain * (f.estimate + RANS.states * chunks) else RANS


_LOCAL = threading.local()  # one zstd (de)compressor per thread: making one per call is slow


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


def _sample(a: np.ndarray, width: int = _BLOCK) -> np.ndarray:
    """The first ``width`` symbols of each of the _BLOCKS spread blocks, joined."""
    step = (a.size - _BLOCK) // (_BLOCKS - 1)
    return np.concatenate([a[i * step : i * step + width] for i in range(_BLOCKS)])


class _Zstd:
    name = "zstd"
    states = 0

    def estimate(self, f: Field, rival: int) -> Bid | None:
        if f.policy.zstd_limit is not None and f.n > f.policy.zstd_limit:
            return None
        size, whole = self.trial(f.symbols, rival)
        return Bid(size, (lambda: whole) if whole is not None else
                   lambda: self.encode(f.symbols, None, 0, 0, None))

    def trial(self, symbols: np.ndarray, rival: int) -> tuple[int, bytes | None]:
        """(estimated size, the payload itself when the field was coded whole). A large
        field whose probe's estimate does not beat ``rival`` gets that estimate, without
        the spread sample's."""
        n = symbols.size
        if n <= EXACT_LIMIT:
            blob = self.encode(symbols, None, 0, 0, None)
            return len(blob), blob
        probe = _sample(symbols, _PROBE // _BLOCKS)
        probe_size = len(self.encode(probe, None, 0, 0, None)) * n // probe.size
        if probe_size >= rival:
            return probe_size, None
        sample = _sample(symbols)
        return len(self.encode(sample, None, 0, 0, None)) * n // sample.size, None

    def encode(self, symbols: np.ndarray, context: np.ndarray | None, precision: int,
               chunk_size: int, counts: np.ndarray | None) -> bytes:
        return _zstd().compress(symbols.data)

    def count(self, data: np.ndarray) -> int:
        try:
            n = zstandard.frame_content_size(data.data)
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd frame: {e}") from None
        if n < 0:
            raise CorruptDataError("zstd frame does not record its size")
        return n

    def decode(self, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
        try:
            head = zstandard.get_frame_parameters(data.data)
            if head.content_size != n:
                raise CorruptDataError(f"zstd frame does not hold {n} bytes")
            if not head.has_checksum:  # the checksum is this codec's only content check
                raise CorruptDataError("zstd frame has no content checksum")
            # One frame and nothing after it: a streaming object reports what is left.
            d = _unzstd().decompressobj()
            out = d.decompress(data.data)
            if not d.eof or d.unused_data or len(out) != n:
                raise CorruptDataError("zstd payload is not exactly one whole frame")
        except zstandard.ZstdError as e:
            raise CorruptDataError(f"zstd frame: {e}") from None
        return np.frombuffer(out, np.uint8)


class _Raw:
    name = "raw"
    states = 0

    def estimate(self, f: Field, rival: int) -> Bid | None:
        return Bid(f.n + RAW_OVERHEAD, lambda: self.encode(f.symbols, None, 0, 0, None))

    def encode(self, symbols: np.ndarray, context: np.ndarray | None, precision: int,
               chunk_size: int, counts: np.ndarray | None) -> bytes:
        return self.stored(symbols).joined()

    def stored(self, symbols: np.ndarray) -> Stored:
        """The payload of ``symbols`` in its two pieces, not joined."""
        return Stored(crc32(symbols), symbols)

    def count(self, data: np.ndarray) -> int:
        if data.size < _CRC.size:
            raise CorruptDataError(f"raw field truncated: {data.size} bytes")
        return data.size - _CRC.size

    def decode(self, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
        if data.size != n + _CRC.size:
            raise CorruptDataError(f"raw field is {data.size} bytes, expected {n + _CRC.size}")
        out = data[_CRC.size:]  # a view: the caller only reads the symbols
        if crc32(out) != _CRC.unpack(data[:_CRC.size].tobytes())[0]:
            raise CorruptDataError("raw field fails its CRC-32")
        return out


ZSTD = _Zstd()
RAW = _Raw()

CODECS: dict[str, Codec] = {c.name: c for c in (RANS, TANS, classed.CODEC, ZSTD, RAW)}


def encode(codec: str, symbols: np.ndarray, context: np.ndarray | None,
           precision: int = RANS_PRECISION, chunk_size: int = frame.DEFAULT_CHUNK,
           counts: np.ndarray | None = None) -> bytes:
    """``symbols`` (uint8, 1-D) coded with ``codec``; ``context``, ``precision`` and
    ``chunk_size`` are used by rans only (the frame records them; decoding needs no
    choice). ``counts``, the histogram the caller already took (rans/tans; with a context
    the joint histogram), saves the coder a pass: see ``frame.encode``."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}")
    return CODECS[codec].encode(symbols, context, precision, chunk_size, counts)


def _codec(name: str) -> Codec:
    if name not in CODECS:
        raise CorruptDataError(f"unknown codec {name!r}")
    return CODECS[name]


def count(codec: str, data: np.ndarray, *, limit: int) -> int:
    """How many symbols the payload ``data`` says it holds; CorruptDataError if unreadable
    or more than ``limit`` (what the caller's segment can hold): a count read here may
    size an allocation, so it is never returned unchecked."""
    n = _codec(codec).count(data)
    if n > limit:
        raise CorruptDataError(f"{codec} payload declares {n} symbols, more than the {limit} "
                               "its field can hold")
    return n


def decode(codec: str, data: np.ndarray, n: int, context: np.ndarray | None) -> np.ndarray:
    """Decode ``data`` (uint8 view of one payload) into ``n`` symbols; CorruptDataError if
    it is malformed, holds another count, or fails its checksum. ``n`` bounds what is
    allocated: the payload's own count is checked against it first (``count``'s
    ``limit`` bounds ``n`` where it came from the payload). The result may be read-only
    and share memory with ``data`` (raw, zstd): read it, do not write it."""
    return _codec(codec).decode(data, n, context)


def _sample_bits(symbols: np.ndarray) -> float:
    """Order-0 entropy of the spread sample, bits per symbol (for 64 Ki symbols the plug-in
    estimate is low by < 0.003 bit)."""
    sample = _sample(symbols)
    return tables.entropy_bits(tables.histogram(sample)) / sample.size


def _entropy_estimate(present: int, bits: float, n: int) -> int:
    """Bytes an entropy-coded frame of ``n`` symbols of ``present`` distinct values
    (order-0 entropy ``bits``) is expected to take: the entropy, the table (estimated as
    in coding/contexts.py) and the frame header and directory."""
    table = 1 + min(present, 32) + 2 * present
    chunks = -(-n // frame.DEFAULT_CHUNK)
    return int(bits / 8) + table + frame.HEADER_SIZE + 9 * chunks


@dataclass(frozen=True)
class Stored:
    """A raw payload kept in its two pieces, the CRC-32 of the symbols and the symbols
    (read, not copied): a writer writes them one after the other and binds the payload
    to its place from ``crc`` (``crc32``), so the symbols are neither joined to their CRC
    (a copy) nor read again."""

    crc: int
    symbols: np.ndarray  # uint8, 1-D, contiguous; not changed while the payload is used

    def pieces(self) -> tuple[bytes, memoryview]:
        return _CRC.pack(self.crc), memoryview(self.symbols).cast("B")

    def joined(self) -> bytes:
        return b"".join(self.pieces())

    def crc32(self, value: int = 0) -> int:
        """``crc32(payload, value)``, from the CRC of the symbols: no pass over them."""
        return crc32_combine(crc32(_CRC.pack(self.crc), value), self.crc, self.symbols.size)

    def __len__(self) -> int:
        return _CRC.size + self.symbols.size


@dataclass(frozen=True)
class Choice:
    """A coded field: its codec, payload (bytes, or for raw its ``Stored`` pieces), and
    order-0 entropy in bits (for a large field stored raw by the sample screen,
    estimated from the spread sample)."""

    codec: str
    payload: bytes | Stored
    entropy_bits: float

    @property
    def blob(self) -> bytes:
        """The payload as one bytes object (raw pieces joined: a copy)."""
        return self.payload if isinstance(self.payload, bytes) else self.payload.joined()


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


def _raw(symbols: np.ndarray, bits: float, crc: int | None = None) -> Choice:
    """``symbols`` stored raw (``crc``: their CRC-32, where the caller has it)."""
    return Choice("raw", RAW.stored(symbols) if crc is None else Stored(crc, symbols), bits)


def _screened(symbols: np.ndarray, p: Policy) -> float | None:
    """Order-0 bits of a large field the sample screen stores raw, else None.

    The sample's plug-in entropy is low (by ~0.003 bit for near-uniform bytes), so where it
    says entropy coding cannot save ``min_saving`` the whole field's count agrees."""
    h = _sample_bits(symbols)
    if h <= 8 * (1 - p.min_saving):
        return None
    raw = symbols.size + RAW_OVERHEAD
    if not p.raw_unless_pays and ZSTD.trial(symbols, raw)[0] <= raw:
        return None
    return h * symbols.size


def _analyse(symbols: np.ndarray, context: np.ndarray | None, p: Policy,
             grid: tuple[int, int] | None, counts: np.ndarray | None) -> Field:
    """The shared statistics of a field. A field with a context gets its joint histogram
    (whose column sums are the counts) up front unless the policy may store it raw before
    needing it."""
    n = symbols.size
    joint = None
    if context is not None and not p.raw_unless_pays:
        joint = contexts.joint_histogram(context, symbols) if counts is None else counts
        # A pass over a small field costs less than summing the 256 x 256 joint.
        counts = tables.histogram(symbols) if n < 1 << 15 else joint.sum(axis=0)
    elif counts is None:
        counts = tables.histogram(symbols)
    bits = tables.entropy_bits(counts)
    present = int(np.count_nonzero(counts))
    estimate = _entropy_estimate(present, bits, n)
    saving = p.min_saving if context is None else p.conditioned_min_saving
    wide = present > _WIDE_SYMBOLS and bits < _WIDE_MAX_BITS * n
    return Field(symbols, context, p, grid, counts, joint, bits, estimate,
                 estimate <= (1 - saving) * (n + RAW_OVERHEAD), wide)


def choose(symbols: np.ndarray, context: np.ndarray | None, target: str = "cpu", *,
           fast: bool = False, grid: tuple[int, int] | None = None,
           counts: np.ndarray | None = None, policy: Policy | None = None) -> Choice:
    """Code a field with the codec expected to be smallest, never larger than raw.

    The policy is ``POLICIES[target, fast]``: ``target="gpu"`` writes what
    ``entropykit.gpu`` decodes fastest, ``fast`` trades size for speed both ways. Each of
    its candidates bids (``Codec.estimate``) on the field's shared statistics (``Field``;
    the histogram, or with a context the joint histogram, taken once); the smallest bid is
    coded (ties: the earlier candidate), and replaced by raw if it is not smaller. Only
    one coder runs over the whole field, once, and a field small enough to be judged
    whole by zstd keeps that trial as its payload.
    ``grid`` (``grid_of``): the field has one symbol per element of a 2-D tensor, which
    lets "rans2d" bid. ``counts``, when the caller has it, saves a pass: the symbols'
    histogram (int64[256]), or for a field with a context (target "cpu", not fast) the
    joint histogram ``contexts.joint_histogram(context, symbols)``. It must be exact.
    ``policy``, where given, is used instead of ``POLICIES[target, fast]`` (``CHECKPOINT``).
    Deterministic: the same symbols and options always give the same choice.
    """
    p = POLICIES.get((target, bool(fast))) if policy is None else policy
    if p is None:
        check_target(target)
    n = symbols.size
    raw = n + RAW_OVERHEAD
    if n == 0:
        return _raw(symbols, 0.0)
    context = context if p.contexts else None
    k = knobs(p) if counts is None else None
    if k is not None:
        choice = _order0(symbols, context, p, k)
        if choice is not None:
            return choice
    # The screen saves a pass where none was paid yet; by default, only context-free
    # fields (a context's saving is not in the order-0 sample).
    if (n > EXACT_LIMIT and p.screen
            and (p.raw_unless_pays or (context is None and counts is None))):
        bits = _screened(symbols, p)
        if bits is not None:
            return _raw(symbols, bits)
    f = _analyse(symbols, context, p, grid, counts)
    if p.raw_unless_pays and not f.pays:
        return _raw(symbols, f.bits)
    if f.context is not None and f.joint is None:
        f.joint = contexts.joint_histogram(f.context, symbols)
    f.coder = _coder(f)
    best: Bid | None = None
    codec = ""
    rival = raw  # the smallest bid so far
    for name in p.candidates:
        bid = CODECS[name].estimate(f, rival)
        if bid is not None and (best is None or bid.size < best.size):  # ties: the first
            best, codec = bid, name
            rival = bid.size if bid.size < rival else rival
    if best is None or codec == "raw":
        return _raw(symbols, f.bits)
    blob = best.make()
    if len(blob) >= raw:
        return _raw(symbols, f.bits)
    return Choice(codec, blob, f.bits)


def knobs(p: Policy) -> order0.Knobs | None:
    """``p``'s numbers for ``order0.code``, or None where ``choose`` does not use it
    (worked out once per policy name)."""
    if p.name not in _ORDER0:
        _ORDER0[p.name] = _knobs(p)
    return _ORDER0[p.name]


def _knobs(p: Policy) -> order0.Knobs | None:
    """``p``'s numbers for ``order0.code``, or None where the kernel does not do its
    choice: a policy whose zstd bids on large fields too (by probes), or with rans2d (a
    class plan), or a screen that asks zstd; or where the kernel's CRC-32 does not
    compile (no carry-less multiply)."""
    entropy = p.candidates[:-2]
    if (not _crc32.ACCELERATED or p.candidates[-2:] != ("zstd", "raw")
            or not set(entropy) <= {"rans", "tans"} or "rans" not in entropy
            or p.zstd_limit is None or p.zstd_limit > EXACT_LIMIT
            or (p.screen and not p.raw_unless_pays)):
        return None
    return order0.Knobs(
        raw_unless_pays=p.raw_unless_pays, screen=p.screen, screen_limit=EXACT_LIMIT, block=_BLOCK,
        screen_bits=8 * (1 - p.min_saving), keep=1 - p.min_saving,
        keep_conditioned=1 - p.conditioned_min_saving, tans="tans" in entropy,
        tans_gain=p.tans_gain, rans_states=RANS.states, tans_states=TANS.states,
        wide_symbols=_WIDE_SYMBOLS, wide_max_bits=_WIDE_MAX_BITS, priced=1 - p.cost,
        precision=p.precision, wide_precision=p.wide_precision, tans_log=TANS_LOG,
        raw_overhead=RAW_OVERHEAD)


def _order0(symbols: np.ndarray, context: np.ndarray | None, p: Policy, k: order0.Knobs
            ) -> Choice | None:
    """``choose`` for a policy ``_knobs`` has numbers for: the kernel's bid against
    zstd's and raw's, compared as ``choose`` compares them (the entropy coder first; ties
    to the earlier), the winner's payload made once; None for a field to code with its
    context."""
    sym = tables._flat(symbols, np.uint8)
    found, bits, bid, param, crc, counts = order0.code(sym, context is not None, k)
    if found == order0.CONDITIONED:
        return None
    return settle(sym, p, int(found), float(bits), int(bid), int(param), int(crc), counts[0])


def settle(symbols: np.ndarray, p: Policy, found: int, bits: float, bid: int, param: int,
           crc: int, counts: np.ndarray) -> Choice:
    """The choice ``choose`` makes from ``order0.code``'s results for a field without a
    context (uint8, 1-D, contiguous; ``counts``: its histogram): the kernel's bid against
    zstd's and raw's."""
    n = symbols.size
    raw = n + RAW_OVERHEAD
    sym = symbols
    if found == order0.RAW or (found == order0.NO_BID and p.raw_unless_pays):
        return _raw(sym, bits, crc)
    best: int | None = None
    codec, payload = "", b""
    if found != order0.NO_BID:
        best, codec = bid, (TANS if found == order0.TANS else RANS).name
    if n <= p.zstd_limit:  # judged whole: its trial is its payload
        whole = ZSTD.encode(symbols, None, 0, 0, None)
        if best is None or len(whole) < best:
            best, codec, payload = len(whole), ZSTD.name, whole
    if best is None or raw < best:
        return _raw(symbols, bits)
    if codec != ZSTD.name:
        payload = CODECS[codec].encode(sym, None, param, p.chunk, counts)
    if len(payload) >= raw:
        return _raw(symbols, bits)
    return Choice(codec, payload, bits)


# By name: no dataclass hash a call.
_ORDER0 = {p.name: _knobs(p) for p in (*POLICIES.values(), CHECKPOINT)}
