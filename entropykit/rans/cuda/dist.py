"""Per-symbol-distribution rANS on a CUDA device: the frames of ``rans.distribution``.

What it is: ``encode`` and ``decode`` with values, mu and sigma as CUDA tensors (as a
predictor on the GPU gives them), producing and reading exactly the bytes of the CPU coder
(``entropykit.rans.distribution``: same frame, same payloads, same CRC-32s). The kernels
(``_dist_kernel.cu``, CUDA C++ compiled by NVRTC through CuPy at first use, one build per
value format) run one warp per chunk, every chunk of a frame in one launch, with the CPU
kernels' integer CDF. The encoder codes each chunk into a scratch copy as large as the raw
values (a payload is kept only if it fits, the CPU rule), reads the payload lengths back
(one small device-to-host copy, which also sizes the frame), then one launch packs payloads
and chunk directory into the frame. The decoder parses the header and directory on the host
(``distribution.parse``; a frame on the device sends only those bytes back) and checks each
chunk's CRC-32 on the GPU. Errors come back per chunk: ``CorruptDataError`` naming the chunk,
``ValueError`` naming the first invalid (mu, sigma), as on the CPU.

What it is not: a model builder, a predictor or a CPU fallback (``rans.distribution`` is
the CPU coder; this module's host half, which tests import without a GPU, is plain numpy).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ... import dtypes
from ..._cuda import checked_device, nvrtc
from ..._errors import CorruptDataError
from ..._status import Status, by_status
from .. import dist_kernels as _k
from .. import distribution as D

DIST_CHUNK = 1 << 14  # values a chunk of a frame coded here: a warp each
HEADER_SIZE = D.HEADER_SIZE
# the kernels' chunk statuses, worded as the CPU coder words them (dist_kernels' codes are
# Status numbers), then the GPU path's own
MESSAGES = {**by_status(_k.MESSAGES),
            Status.CRC: "CRC-32 of decoded values does not match",
            Status.RAW: "raw payload length differs from the chunk's values"}
_CRC_POLY = 0xEDB88320
_TORCH_FORMATS = {f"torch.{d.torch}": d.value_format for d in dtypes.ALL if d.value_format}
_SMEM_LIMIT = 96 * 1024  # model tables in shared memory up to this (else through L1)
TAIL_FROM = 12  # tail inverse: from mass 2**-12 (the uniform inverse's end interval) ...
TAIL_STEPS = 8  # ... in steps of 2**(-1/8) ...
TAIL_POINTS = 20 * TAIL_STEPS  # ... down to 2**-32 (S is in units of 2**-31)
WARPS = 8  # warps (chunks) a block
# a 16-bit format's decoder: inverse rows in shared memory for launches of this many shapes
_ZINV_MODELS = 1


# ---- host logic (no GPU needed) ------------------------------------------------------


def format_of(dtype: Any, fmt: str | D.ValueFormat | None) -> D.ValueFormat:
    """The value format of a tensor of ``dtype`` (``value_bits``'s rules): a float dtype
    names its format; integer bits of the format's width need ``fmt``."""
    name = _TORCH_FORMATS.get(str(dtype))
    if name is not None:
        if fmt is not None and D.value_format(fmt).name != name:
            raise ValueError(f"values are {dtype} but fmt is {D.value_format(fmt).name}")
        return D.FORMATS[name]
    if fmt is None:
        raise TypeError(f"cannot infer the value format of dtype {dtype}; pass fmt=")
    f = D.value_format(fmt)
    want = ("torch.int16", "torch.uint16") if f.bits == 16 else ("torch.uint8", "torch.int8")
    if str(dtype) not in want:
        raise TypeError(f"{f.name} bits must be one of {want}, got {dtype}")
    return f


def x_powers() -> np.ndarray:
    """uint32[32]: x^(2^i) modulo the CRC-32 polynomial, bit-reflected (zlib's x2n_table)."""
    def mul(a: int, b: int) -> int:
        p = 0
        for i in range(31, -1, -1):
            if a >> i & 1:
                p ^= b
            b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1
        return p

    out, p = [], 1 << 30  # x^1 (bit 31 is x^0)
    for _ in range(32):
        out.append(p)
        p = mul(p, p)
    return np.array(out, np.uint32)


def header(f: D.ValueFormat, n: int, chunk_size: int, precision: int, fingerprint: int) -> bytes:
    """The frame's 28 header bytes (``distribution``'s layout v1)."""
    return D.pack_header(f, n, chunk_size, precision, fingerprint)


def check_encode_args(f: D.ValueFormat, n: int, precision: int, chunk_size: int) -> int:
    """Validate the coding options as ``distribution.encode`` does; the chunk count."""
    D.check_precision(precision)
    D.check_chunk_size(chunk_size)
    return -(-n // chunk_size)


def chunk_error(codes: np.ndarray, offsets: np.ndarray) -> tuple[int, str] | None:
    """(chunk, message) of the first chunk that failed, or None. ``codes`` are the
    kernel's per-chunk ``Status`` codes (PARAM handled by the caller first)."""
    bad = np.flatnonzero(codes)
    if not bad.size:
        return None
    c = int(bad[0])
    code = int(codes[c])
    msg = MESSAGES.get(code, f"unknown status {code}")  # (a Status's hash is its number)
    return c, (f"distribution-rANS frame chunk {c} (payload at byte {int(offsets[c])}): "
               f"{msg}")


def first_bad_param(codes: np.ndarray, where: np.ndarray, chunk_size: int) -> int:
    """Global index of the first invalid (mu, sigma) from per-chunk (code, index), or -1."""
    bad = np.flatnonzero(codes == Status.PARAM)
    return -1 if not bad.size else int(bad[0]) * chunk_size + int(where[bad[0]])


def tail_inverse(model: D.CoderModel) -> np.ndarray:
    """z at tail masses 2**(-TAIL_FROM - i / TAIL_STEPS), i = 0..TAIL_POINTS, below (row 0)
    and above (row 1) each shape: float32[M, 2, TAIL_POINTS + 1], guesses only.

    The uniform inverse (``model.inverse``) has end intervals [0, 2**-12) and
    (1 - 2**-12, 1] that span z from its clamp (+-32) to its first inner point (-+3.5 for a
    Gaussian, further out for heavy-tailed shapes): a value in a t-distributed tail guessed
    there lands tens of keys off. These points are even in log2 of the tail mass."""
    q = 2.0 ** -(TAIL_FROM + np.arange(TAIL_POINTS + 1) / TAIL_STEPS) * D.ONE
    z = D.z_grid()
    out = np.empty((len(model), 2, q.size))
    for m, t in enumerate(model.shapes.astype(np.float64)):
        # Where the CDF is flat, the run's end nearer the centre: below, the last point of
        # a run (np.interp needs rising points), above, the first.
        last = np.concatenate((np.diff(t) > 0, [True]))
        first = np.concatenate(([True], np.diff(t) > 0))
        out[m, 0] = np.interp(q, t[last], z[last])
        out[m, 1] = np.interp(D.ONE - q, t[first], z[first])
    return out.astype(np.float32)


def model_arrays(model: D.CoderModel) -> dict[str, np.ndarray]:
    """The model as the kernels read it: padded shapes and empirical CDFs (uint32), weights
    (int32), inverse shapes (float32, guesses only: a row is the uniform inverse's
    INV_POINTS + 1 points, then ``tail_inverse``'s two rows), sigma reciprocals
    (int64[2, 256])."""
    inv = np.concatenate([np.asarray(model.inverse, np.float64),
                          tail_inverse(model).reshape(len(model), -1)], axis=1)
    return {"shapes": np.ascontiguousarray(model.padded, np.uint32).reshape(-1),
            "emps": np.ascontiguousarray(model.emps, np.uint32).reshape(-1),
            "weights": model.weights.astype(np.int32),
            "zinv": np.ascontiguousarray(inv, np.float32).reshape(-1),
            "rtab": np.ascontiguousarray(D._RTAB, np.int64).reshape(-1)}


def smem_bytes(model: D.CoderModel, models: int | None = None, *, zinv: bool = False) -> int:
    """Dynamic shared memory of a launch: the model tables (of ``models`` shapes, default
    all), if they fit ``_SMEM_LIMIT``, then, with ``zinv`` (a 16-bit format's decoder),
    their inverse shapes for a launch of at most ``_ZINV_MODELS`` shapes where they fit too
    (the decoder reads them there when the launch's size holds them)."""
    models = len(model) if models is None else models
    size = models * (model.padded.shape[1] + model.emps.shape[1]) * 4
    if size > _SMEM_LIMIT:
        return 0
    rows = models * (np.shape(model.inverse)[1] + 2 * (TAIL_POINTS + 1)) * 4  # ZROW floats
    fits = zinv and models <= _ZINV_MODELS and size + rows <= _SMEM_LIMIT
    return size + rows if fits else size


# ---- device ----------------------------------------------------------------------------

_lock = threading.Lock()
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_targs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # _table_args'
_checked: dict[int, tuple] = {}  # _index's checked tensors: id -> (weak ref, version, key)


def _build_options(f: D.ValueFormat, smem: bool) -> tuple[str, ...]:
    """NVRTC options of the format's build: the format's constants, whether the model
    tables are in shared memory, and the constants shared with this module."""
    return ("--std=c++17", f"-DNKEYS={1 << f.bits}", f"-DMANT={f.mantissa}",
            f"-DBIAS={f.bias}", f"-DNONFINITE={f.nonfinite}", f"-DES={f.bits - 8}",
            f"-DSMEM={int(smem)}", f"-DWARPS={WARPS}", f"-DTAIL_FROM={TAIL_FROM}",
            f"-DTAIL_STEPS={TAIL_STEPS}", f"-DTAIL_POINTS={TAIL_POINTS}")


def _kernels(f: D.ValueFormat, smem: bool) -> Any:
    import cupy as cp

    return nvrtc.cached(("dist", f.name, smem), lambda: cp.RawModule(
        code=nvrtc.source(__package__, "_dist_kernel.cu"), options=_build_options(f, smem)))


def _device_tables(model: D.CoderModel, device: Any) -> dict[str, Any]:
    import torch

    with _lock:
        per = _tables.setdefault(model, {})
        if device not in per:
            arrs = model_arrays(model)
            arrs["xpow"] = x_powers()
            per[device] = {k: torch.from_numpy(v.view(np.int32) if v.dtype == np.uint32 else v)
                           .to(device) for k, v in arrs.items()}
        return per[device]


def _table_args(model: D.CoderModel, device: Any, first: int = 0,
                models: int | None = None) -> tuple:
    """The kernel arguments (shapes, emps, models, weights, zinv, rtab, xpow) of the model's
    shapes first .. first + models - 1 (default all), built once per model, device and
    range (the tensors stay alive in ``_tables``). A launch that uses one shape gets its
    rows alone, as a model of one shape (index 0): the kernel indexes every per-shape table
    by the index, so the rows read are the same, and one shape's tables fit in shared
    memory where a calibration's 61 do not."""
    models = len(model) - first if models is None else models
    key = (device, first, models)
    with _lock:
        got = _targs.get(model, {}).get(key)
    if got is None:
        tb = _device_tables(model, device)
        rows = {k: tb[k].numel() // len(model) * tb[k].element_size()
                for k in ("shapes", "emps", "weights", "zinv")}
        at = {k: np.uint64(tb[k].data_ptr() + first * r) for k, r in rows.items()}
        got = (at["shapes"], at["emps"], np.int32(models), at["weights"], at["zinv"],
               *nvrtc.args(tb["rtab"], tb["xpow"]))
        with _lock:
            _targs.setdefault(model, {})[key] = got
    return got


def _flat(t: Any, name: str, n: int, device: Any) -> Any:
    import torch

    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(np.asarray(t, np.float32))
    t = t.to(device=device, dtype=torch.float32).reshape(-1)
    if t.numel() != n:
        raise ValueError(f"{name} has {t.numel()} entries for {n} values")
    return t.contiguous()


def _index(model_index: Any, model: D.CoderModel, n: int, device: Any) -> tuple[Any, int]:
    """(per-value uint16 index tensor or None, the one model index).

    A per-value index is range-checked once per contents: a CUDA tensor's check waits for
    its stream (the min / max come back to the host), so an index tensor already checked,
    unchanged since (its version counter) and used as given (flat int16 on ``device``) is
    not checked again: a caller that reuses one (the offload hook, per layer) keeps its
    decodes asynchronous."""
    import torch

    if model_index is None or isinstance(model_index, (int, np.integer)):
        m = int(model_index or 0)
        if not 0 <= m < len(model):
            raise ValueError(f"model_index {m} out of range for a model of {len(model)} shapes")
        return None, m
    key = (n, len(model), str(device))
    direct = (isinstance(model_index, torch.Tensor) and model_index.dim() == 1
              and model_index.dtype == torch.int16 and model_index.is_contiguous()
              and model_index.device == torch.device(device))
    if direct:
        seen = _checked.get(id(model_index))
        if seen and seen[0]() is model_index and seen[1:] == (model_index._version, *key):
            return model_index, 0
    idx = torch.as_tensor(model_index).reshape(-1)
    if idx.numel() != n or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        raise ValueError(f"model_index must be {n} integers")
    if n:
        lo_hi = torch.stack([idx.min(), idx.max()]).to(torch.int64).cpu()
        if lo_hi[0] < 0 or lo_hi[1] >= len(model):
            raise ValueError(f"model_index out of range for a model of {len(model)} shapes")
    if direct:
        i = id(model_index)
        _checked[i] = (weakref.ref(model_index, lambda _: _checked.pop(i, None)),
                       model_index._version, *key)
        return model_index, 0
    return idx.to(device=device, dtype=torch.int16).contiguous(), 0  # < 2**15 models


@dataclass(frozen=True)
class _Models:
    """Which model each value of a launch uses, as the kernels take it: value i's is
    midx[i >> shift] (an int16 tensor; one entry per value at shift 0), or m0 where midx is
    None; and the rows of the model the launch gets (shapes first .. first + count - 1, the
    indices relative to first; count None: every shape), so that a launch of one or two
    adjacent shapes has their tables in shared memory."""

    midx: Any
    shift: int
    m0: int
    first: int
    count: int | None

    def args(self) -> tuple:
        return nvrtc.args(self.midx, np.int32(self.shift), np.int32(self.m0))


_run_index: dict[tuple, Any] = {}  # _models' run index tensors, by layout and device


def _models(model_index: Any, model: D.CoderModel, n: int, device: Any) -> _Models:
    """``model_index`` (an int, one integer per value, or ``distribution.model_runs``'
    runs) for a launch of n values. Runs become one index entry per 2^shift values, 2^shift
    the largest power of two dividing every run boundary (the offload hook's keys then
    values: a few entries a layer), relative to the runs' lowest model; the tensor is kept
    per (relative runs, device): its upload waits for the stream once, later launches of
    that layout (every layer of a cache) wait for nothing."""
    import torch

    runs = D.model_runs(model_index, model, n)
    if runs is None:
        midx, m0 = _index(model_index, model, n, device)
        return _Models(None, 0, 0, m0, 1) if midx is None else _Models(midx, 0, 0, 0, None)
    runs = [r for r in runs if r[1]]
    models = {m for m, _ in runs}
    if len(models) <= 1:
        return _Models(None, 0, 0, models.pop() if models else 0, 1)
    lo, hi = min(models), max(models)
    ends = np.cumsum([c for _, c in runs])
    shift = min(int(b & -b).bit_length() - 1 for b in ends[:-1].tolist())
    key = (tuple((m - lo, c) for m, c in runs), str(device))
    got = _run_index.get(key)
    if got is None:
        starts = np.concatenate(([0], ends[:-1])) >> shift
        sizes = np.diff(np.append(starts, -(-n >> shift)))
        rel = np.repeat(np.array([m - lo for m, _ in runs], np.int16), sizes)
        if len(_run_index) >= 256:
            _run_index.clear()
        # a blocking upload, once per layout: any stream may then read it
        got = _run_index[key] = torch.from_numpy(rel).to(device)
    return _Models(got, shift, 0, lo, hi - lo + 1)


def _aligned(t: Any) -> Any:
    # The kernels read chunks as 32-bit words (CRC): start on a 16-byte boundary.
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _bad_param(i: int, mu: Any, sigma: Any) -> ValueError:
    return ValueError(f"value {i}: mu={float(mu[i])!r}, sigma={float(sigma[i])!r}; "
                      "need finite mu, finite sigma > 0 and |mu| < ~2**34 sigma")


def _launch(kernel: Any, device: Any, grid: int, block: int, args: tuple, shared: int) -> None:
    nvrtc.launch(device, [(kernel, grid, block, args, shared)])


def encode(values: Any, mu: Any, sigma: Any, model: D.CoderModel, *,
           fmt: str | D.ValueFormat | None = None, model_index: Any = None,
           precision: int = D.DEFAULT_PRECISION, chunk_size: int = DIST_CHUNK) -> Any:
    """Code ``values`` (a CUDA tensor) into a frame: a CUDA uint8 tensor holding exactly
    ``distribution.encode(values, mu, sigma, model, ...)``'s bytes.

    ``values``: bfloat16 / float16 / float8 tensor, or int16/uint16/uint8 bits with
    ``fmt``. ``mu``, ``sigma``: float32 with one entry per value (moved to the device if
    not there). ``model_index``: an int, one integer per value, or runs ``[(model, count),
    ...]`` (``distribution.model_runs``; no per-value tensor needed). Synchronizes once (the
    frame's size); ``ValueError`` for an invalid (mu, sigma), as on the CPU.
    """
    import torch

    dev = checked_device(values.device)
    f = format_of(values.dtype, fmt)
    flat = _aligned(values.reshape(-1).contiguous())
    n = flat.numel()
    nc = check_encode_args(f, n, precision, chunk_size)
    mu_t, sg_t = _flat(mu, "mu", n, dev), _flat(sigma, "sigma", n, dev)
    ms = _models(model_index, model, n, dev)
    head = header(f, n, chunk_size, precision, model.fingerprint)
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    if nc == 0:
        return head_t.to(dev)
    raw = flat.view(torch.uint8)
    smem = smem_bytes(model, ms.count)  # (no inverse rows: the encoder makes no guesses)
    mod = _kernels(f, smem > 0)
    scratch = torch.empty_like(raw)
    res = torch.empty((nc, 4), dtype=torch.int64, device=dev)
    _launch(nvrtc.function(mod, "dist_encode"), dev, -(-nc // WARPS), 32 * WARPS,
            (*nvrtc.args(raw, mu_t, sg_t), *ms.args(),
             *nvrtc.args(n, np.int32(chunk_size), np.int32(nc), np.int32(precision)),
             *_table_args(model, dev, ms.first, ms.count), *nvrtc.args(scratch, res)), smem)
    lengths = res[:, 2]
    dst = torch.cumsum(lengths, 0) - lengths
    chunks = torch.arange(nc, device=dev)
    first_bad = torch.where(res[:, 0] == Status.PARAM, chunks, nc).min()
    total, bad = (int(v) for v in torch.stack([lengths.sum(), first_bad]).cpu())
    if bad < nc:
        raise _bad_param(bad * chunk_size + int(res[bad, 1]), mu_t, sg_t)
    base = HEADER_SIZE + 9 * nc
    frame = torch.empty(base + total, dtype=torch.uint8, device=dev)
    frame[:HEADER_SIZE].copy_(head_t)
    _launch(nvrtc.function(mod, "dist_gather"), dev, min(nc, 65535), 256,
            nvrtc.args(scratch, raw, res, dst, chunk_size * (f.bits // 8), np.int32(nc), base,
                       frame), 0)
    return frame


DIR_THREADS = 1024  # _dist_kernel.cu's dist_directory block


def _frame_info(frame: Any) -> tuple[D.FrameHeader, Any]:
    """(validated header, the frame as a uint8 tensor where it lies). Only the 28-byte
    header is read here (from host memory, or one read of a CUDA frame's); the directory is
    read and checked on the device (``dist_directory``) wherever the frame lies, so a host
    frame's is not parsed on the host too."""
    import torch

    if isinstance(frame, torch.Tensor):
        if frame.dtype != torch.uint8 or frame.dim() != 1:
            raise TypeError(f"a frame tensor must be flat uint8, got {frame.dtype} "
                            f"{tuple(frame.shape)}")
        frame = frame.contiguous()
        size = frame.numel()
        head = frame[: min(size, HEADER_SIZE)]
        return D.parse_header((head if frame.device.type == "cpu" else head.cpu()).numpy(),
                              size), frame
    buf = frame if isinstance(frame, np.ndarray) else np.frombuffer(frame, np.uint8)
    buf = buf.reshape(-1).view(np.uint8)
    head = D.parse_header(buf[:HEADER_SIZE], buf.size)
    with warnings.catch_warnings():  # read-only bytes: the tensor is only read (uploaded)
        warnings.simplefilter("ignore", UserWarning)
        return head, torch.from_numpy(buf)


def decode(frame: Any, mu: Any, sigma: Any, model: D.CoderModel, *, model_index: Any = None,
           out: Any = None, device: Any = None) -> Any:
    """Decode a frame into value bits on a CUDA device (flat; int16 for 16-bit formats,
    view it as bfloat16 / float16; uint8 for fp8), one launch for every chunk.

    ``frame``: bytes / numpy (uploaded once), or a uint8 torch tensor (CPU: pinned memory
    uploads asynchronously; CUDA: used in place). ``mu``, ``sigma``, ``model``,
    ``model_index`` must be the encoder's. ``out``: a contiguous CUDA tensor of n elements
    of the format's width. ``device``: default ``out``'s, else mu's if on CUDA, else
    "cuda". ``CorruptDataError`` names the first bad chunk; ``ValueError`` an invalid
    (mu, sigma) or arguments that do not fit.
    """
    return decode_async(frame, mu, sigma, model, model_index=model_index, out=out,
                        device=device).result()


class PendingDecode:
    """A decode launched on the current CUDA stream: ``result()`` waits for it, checks the
    frame's directory (read on the device) and every chunk's status and
    returns the values, or raises what ``decode`` raises. Until then the output must not
    be trusted: it holds whatever a corrupt frame decoded to."""

    def __init__(self, out: Any, work: Any, nc: int, check_dir: bool, keep: tuple,
                 header: D.FrameHeader, size: int, mu: Any, sigma: Any) -> None:
        import torch

        self.out = out
        # the directory's facts and the chunks' status (``_work``'s tail), copied to pinned
        # memory behind the launch on its stream
        tail = work[4 * nc :]
        self._tail = torch.empty(tail.shape, dtype=tail.dtype, pin_memory=True)
        self._done = torch.cuda.Event()
        if tail.device.index == torch.cuda.current_device():
            self._tail.copy_(tail, non_blocking=True)
            self._done.record()
        else:
            with torch.cuda.device(tail.device):
                self._tail.copy_(tail, non_blocking=True)
                self._done.record()
        self._work, self._nc, self._check_dir = work, nc, check_dir
        self._keep = keep  # the launch's inputs stay alive until it has run
        self._header, self._size = header, size
        self._mu, self._sigma = mu, sigma
        self._checked = False

    def done(self) -> bool:
        """Whether the decode has finished (``result`` would not wait)."""
        return self._done.query()

    def result(self) -> Any:
        """The decoded values, once every chunk is known to be right."""
        if not self._checked:
            self._done.synchronize()
            tail = self._tail.numpy()
            if self._check_dir:  # as parse would have, before any chunk's error
                end, bad, mode = (int(v) for v in tail[:3])
                err = D.directory_error(end, self._size, bad, mode)
                if err is not None:
                    raise CorruptDataError(err)
            nc = self._nc
            st = tail[3:].view(np.int32)[: 2 * nc].reshape(nc, 2)
            if st[:, 0].any():
                bad = first_bad_param(st[:, 0], st[:, 1], self._header.chunk_size)
                if bad >= 0:
                    raise _bad_param(bad, self._mu, self._sigma)
                offsets = self._work[: 4 * nc].view(nc, 4)[:, 0]  # the chunks' payloads
                err = chunk_error(st[:, 0], offsets)
                if err is not None:
                    raise CorruptDataError(err[1])
            self._checked, self._keep, self._work = True, (), None
        return self.out


def decode_async(frame: Any, mu: Any, sigma: Any, model: D.CoderModel, *,
                 model_index: Any = None, out: Any = None,
                 device: Any = None) -> PendingDecode:
    """``decode``, launched on the current stream without waiting for it: the host goes on
    (e.g. to queue compute that overlaps the decode) and reads the result later with
    ``PendingDecode.result()``. Argument and header errors raise here, directory and
    chunk errors from ``result()`` (the directory is read on the device wherever the frame
    lies, so that nothing waits for it here)."""
    import torch

    if device is None:
        device = out.device if out is not None else (
            mu.device if isinstance(mu, torch.Tensor) and mu.is_cuda else "cuda")
    dev = checked_device(device)
    head, ft = _frame_info(frame)
    if head.fingerprint != model.fingerprint:
        raise CorruptDataError(f"frame was coded with model {head.fingerprint:#010x}, "
                               f"decoder has {model.fingerprint:#010x} (byte 24)")
    f, n, cs, nc = head.fmt, head.n, head.chunk_size, head.n_chunks
    mu_t, sg_t = _flat(mu, "mu", n, dev), _flat(sigma, "sigma", n, dev)
    ms = _models(model_index, model, n, dev)
    width = f.bits // 8
    if out is None:
        out = torch.empty(n, dtype=torch.int16 if width == 2 else torch.uint8, device=dev)
    elif (not isinstance(out, torch.Tensor) or out.device != dev or out.numel() != n
          or out.element_size() != width or not out.is_contiguous()
          or out.data_ptr() % 16):
        raise ValueError(f"out must be a contiguous, 16-byte aligned tensor of {n} "
                         f"{width}-byte elements on {dev}")
    size = ft.numel()
    work, table, facts, status = _work(nc, dev)
    if nc == 0:  # no directory: the frame is its header
        err = D.directory_error(HEADER_SIZE, size, -1, 0)
        if err is not None:
            raise CorruptDataError(err)
        work.zero_()
        return PendingDecode(out, work, nc, False, (), head, size, mu_t, sg_t)
    if ft.device != dev:
        ft = ft.to(dev, non_blocking=ft.is_pinned())
    smem = smem_bytes(model, ms.count, zinv=f.bits == 16)
    mod = _kernels(f, smem > 0)
    nvrtc.launch(dev, [  # dist_directory also zeroes the status
        (nvrtc.function(mod, "dist_directory"), 1, DIR_THREADS,
         nvrtc.args(ft, size, np.int32(nc), table, facts, status), 0),
        (nvrtc.function(mod, "dist_decode"), -(-nc // WARPS), 32 * WARPS,
         (*nvrtc.args(ft, table, mu_t, sg_t), *ms.args(),
          *nvrtc.args(n, np.int32(cs), np.int32(nc), np.int32(head.precision)),
          *_table_args(model, dev, ms.first, ms.count), *nvrtc.args(out, status)), smem)])
    return PendingDecode(out, work, nc, True, (ft, mu_t, sg_t, ms.midx), head, size,
                         mu_t, sg_t)


def _work(nc: int, dev: Any) -> tuple[Any, np.uint64, np.uint64, np.uint64]:
    """One device buffer (int64) for a decode: the chunk table ([nc, 4]), then its tail,
    read back in one copy: the directory's facts ([3]) and the status (int32 [2 nc + 1]:
    per chunk code and index, then DYN_CHUNKS' counter). (buffer, then the device
    addresses of table, facts and status as kernel arguments)"""
    import torch

    buf = torch.empty(4 * nc + 3 + nc + 1, dtype=torch.int64, device=dev)
    at = buf.data_ptr()
    return buf, np.uint64(at), np.uint64(at + 32 * nc), np.uint64(at + 32 * nc + 24)


__all__ = ["DIST_CHUNK", "PendingDecode", "decode", "decode_async", "encode"]
