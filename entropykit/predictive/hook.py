"""A transformers cache layer that offloads its keys and values as a compressed blob.

What it is: ``PredictiveOffloadedLayer`` (a ``DynamicLayer`` whose ``offload()`` codes the
prompt's keys and values against the predictor's guess into host memory and frees them,
and whose ``prefetch()`` decodes them back, bit for bit), the ``KVOffloadCodec`` the layers
of one cache share (its method: static tables, or predictor, calibration, residual model
and the prompt's guess for the per-value coder), and
``PredictiveOffloadedCache``, a ``Cache`` of such layers that offloads each layer after
its update and prefetches the next one without CUDA streams, so it also runs on a CPU.
On a GPU, ``transformers.Cache(layers=[PredictiveOffloadedLayer(...)...],
offloading=True)`` uses the same layers, and the frames are coded on the device where the
GPU coder can run (``KVOffloadCodec``'s ``coder``). What it is not: a whole-cache codec (that is
``compress_kv``; the ``conditional`` residual model needs the whole cache, so offloaded
layers, coded one at a time, use ``gaussian`` or ``mixture``).

Positions beyond the prompt (tokens generated after ``set_prompt``) stay uncompressed in
host memory: the predictor's guess covers the prompt only. Every cache layout works:
``PredictiveOffloadedSlidingLayer`` is the sliding-window layer (it codes the prompt's
last tokens it holds), each layer has the calibration's kv heads and head dim (keys and
values may differ), and ``PredictiveOffloadedCache(config=...)`` builds the layers the
model's config asks for, keeping layers without KV (linear attention) as transformers
makes them. Supported transformers: 5.x
(the README lists the versions tested; ``Cache(offloading=True)`` needs CUDA).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..coding import frame as _frame
from ..rans import distribution as dist
from ..rans import static as rans_static
from . import static_kv
from ._torchdist import CODERS, DeviceCalibration, group_distribution, on_gpu
from .calibration import Calibration
from .codec import CHUNK
from .kvcache import align
from .predictors import NoPredictor, Predictor

LAYER_MODELS = ("gaussian", "mixture")
METHODS = ("auto", "static", "distribution")
CHECKS = ("before_use", "deferred")
Check = Literal["before_use", "deferred"]


class KVOffloadCodec:
    """What the offloaded layers of one cache share; call ``set_prompt`` before the model
    runs on the prompt.

    ``method``: how a layer is coded. "static": static rANS tables of the layer's own
    values (``static_kv``: no predictor, no calibration). With the GPU coder a layer is
    coded on its device (``rans.cuda.encode``) and decoded there in one launch of the
    weight decoder's kernel, which decodes far faster than the per-value coder; with the
    CPU coder on the host, exponents in classes of rows and channels where that pays.
    "distribution": the per-value coder against the predictor's guess and the
    calibration's residual model (fewer bits where a predictor guesses well; bf16 layers
    only). "auto" (default): "static" without a predictor (None or ``NoPredictor``), else
    "distribution" for bf16 layers and "static" for fp16 and fp8 ones. What follows is
    the per-value coder's; of it, the static method uses ``coder`` (where it codes and
    decodes), ``threads`` and ``chunk_size`` (values a chunk; default
    ``static_kv.CHUNK``).

    ``coder``: where the frames are coded. "gpu" runs the coder on the layer's CUDA device
    (``entropykit.rans.cuda.dist``, needs CuPy): only the frame crosses PCIe, into pinned host
    memory, and back. "cpu" copies the layer to the host and codes it there with
    ``threads`` threads. "auto" (default): "gpu" for CUDA tensors where the GPU coder can
    run, else "cpu". Both write the same frame format, so either decodes the other's.
    ``chunk_size``: values a frame chunk (None: 2^16 on the CPU; on the GPU by the layer's
    size, ``gpu_chunk``). On the GPU a chunk is one warp's serial work, so a layer's decode
    takes at least one chunk's time however few chunks there are: smaller chunks cut that
    latency until the chunks fill the GPU, at ~137 bytes a chunk (its lanes' final states
    and its directory entry).

    ``check``: when an offloaded layer's decode is checked (a bad chunk raises
    ``CorruptDataError``). "before_use" (default): before the cache returns the layer's
    keys and values for attention, in the layer's ``update``; that waits for the layer's
    decode, one host synchronisation a layer and step, so no step ever attends to values
    that were not checked. "deferred": a static-table layer's check never makes the
    cache's own step wait: inside ``update`` and ``offload`` it runs only if the decode
    has already finished, else at the next read of the layer's ``keys`` or ``values``
    from outside the cache or at its next ``prefetch``. What that trades: a corrupt frame
    may feed one step's attention (that step's output may be wrong) before
    ``CorruptDataError`` is raised, and the last step's check runs only if the cache is
    read afterwards, so its error may go unreported. The per-value coder's check runs in
    ``update`` in either mode (its inputs stay on the GPU until it is checked).

    The predictor's guess is kept in host memory (bfloat16 where that holds it exactly,
    else float32), so prefetches need not re-run the predictor. The guess is as large as
    the prompt's cache: with a predictor, offloaded layers cost the guess plus the frames,
    and pay off only where the guess is needed anyway. With ``NoPredictor`` nothing is
    kept per value (the distribution is the calibration's per-channel statistics), so
    host memory and, with the GPU coder, PCIe traffic shrink to the frames' size.
    """

    def __init__(self, predictor: Predictor | None = None,
                 calibration: Calibration | None = None, model: str = "mixture",
                 threads: int | None = 1, coder: str = "auto", chunk_size: int | None = None,
                 *, method: str = "auto", check: Check = "before_use") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS}, got {check!r}")
        self._auto = method == "auto"
        if method == "auto":
            method = ("static" if predictor is None or isinstance(predictor, NoPredictor)
                      else "distribution")
        if model not in LAYER_MODELS:
            raise ValueError(f"offloaded layers are coded one at a time: model must be one of "
                             f"{LAYER_MODELS}, got {model!r}")
        if coder not in CODERS:
            raise ValueError(f"coder must be one of {CODERS}, got {coder!r}")
        if method == "distribution" and (predictor is None or calibration is None):
            raise ValueError("the per-value coder (method 'distribution') needs a "
                             "predictor and its calibration")
        if (predictor is not None and calibration is not None
                and predictor.describe() != calibration.predictor):
            raise ValueError("the calibration was fitted with another predictor")
        if chunk_size is not None:
            if method == "static":
                _frame.check_chunk_size(chunk_size, rans_static.CODER.lanes)
            else:
                dist.check_chunk_size(chunk_size)  # refused here, not at the first offload
        self.predictor, self.calibration, self.model = predictor, calibration, model
        self.threads, self.coder, self.chunk_size = threads, coder, chunk_size
        self.method, self.check = method, check
        self.prompt_len = self._batch = 0
        self._guesses: dict[tuple[int, int], torch.Tensor] = {}
        self._dcal: dict[torch.device, DeviceCalibration] = {}

    def set_prompt(self, input_ids: torch.Tensor) -> None:
        """Run the predictor on the prompt ([batch, seq]) whose cache will be offloaded."""
        ids = torch.as_tensor(input_ids)
        ids = ids[None] if ids.dim() == 1 else ids
        self._batch = ids.shape[0]
        self.prompt_len = ids.shape[1]
        if self.method == "static":
            return  # the static tables are the data's own: no guess
        guess = self.predictor.predict(ids)
        dims = self.calibration.dims
        self._guesses = {} if guess is None else {
            divmod(g, 2): _compact(guess[g // 2][g % 2]) for g, d in enumerate(dims)
            if d is not None and g // 2 < len(guess) and guess[g // 2] is not None}

    def shape(self, layer: int, kv: int, seq: int) -> tuple[int, int, int, int]:
        """Group (layer, kv)'s shape over ``seq`` of the prompt's tokens."""
        dims = self.calibration.dims
        if not 0 <= layer < len(dims) // 2 or dims[2 * layer + kv] is None:
            raise ValueError(f"the calibration has no keys and values for layer {layer}")
        heads, dim = dims[2 * layer + kv]
        return (self._batch, heads, seq, dim)

    def guess_bytes(self) -> int:
        """Host memory the kept guess takes (0 without a predictor)."""
        return sum(g.numel() * g.element_size() for g in self._guesses.values())

    def distribution(self, layer: int, kv: int, device: torch.device | str = "cpu",
                     out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(mu, sigma, model index) of one layer's keys (kv = 0) or values over the
        prompt's last ``seq`` tokens (default: all): flat float32 tensors on ``device``
        (``out``'s, if given), bit for bit
        ``codec.group_distribution``'s (``_torchdist``: the same float32 operations, on
        any device)."""
        device = torch.device(device)
        if device not in self._dcal:
            self._dcal[device] = DeviceCalibration(self.calibration, device)
        shape = self.shape(layer, kv, self.prompt_len if seq is None else seq)
        g = self._guesses.get((layer, kv))
        g = (torch.zeros((), dtype=torch.float32, device=device).expand(shape) if g is None
             else align(g.to(device, non_blocking=g.is_pinned()).float(), shape[2]))
        mu, sigma, index, _ = group_distribution(
            layer, kv, {(layer, kv): g}, shape, self.predictor.exact_layers, self.model,
            self._dcal[device], None, {}, out)
        return mu, sigma, index

    def layer_distribution(self, layer: int, device: torch.device | str = "cpu",
                           seq: int | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor, int | list[tuple[int, int]]]:
        """(mu, sigma, model index) of one layer's keys then values over the prompt's
        last ``seq`` tokens, as ``encode`` codes them in one frame: the two
        ``distribution``s joined; the index an int where keys and values use one model,
        else runs [(keys' model, n keys), (values' model, n values)]
        (``rans.distribution.model_runs``: no per-value index is made or kept)."""
        seq = self.prompt_len if seq is None else seq
        nk, nv = (int(np.prod(self.shape(layer, kv, seq))) for kv in (0, 1))
        mu = torch.empty(nk + nv, dtype=torch.float32, device=device)
        sigma = torch.empty_like(mu)
        ik = self.distribution(layer, 0, device, (mu[:nk], sigma[:nk]), seq)[2]
        iv = self.distribution(layer, 1, device, (mu[nk:], sigma[nk:]), seq)[2]
        return mu, sigma, ik if ik == iv else [(ik, nk), (iv, nv)]

    def encode(self, layer: int, keys: torch.Tensor, values: torch.Tensor
               ) -> bytes | torch.Tensor | static_kv.StaticLayer | static_kv.GpuLayer:
        """One layer's keys and values over the prompt's last seq tokens (seq at most the
        prompt's: all of them, or a sliding window's), bf16 [batch, heads, seq, dim] on
        any device, as one distribution-rANS frame (keys, then values: one launch and one
        directory a layer): bytes (CPU coder), or a uint8 tensor in pinned host memory
        (GPU coder). With the static method (bf16, fp16 or fp8): a
        ``static_kv.StaticLayer`` (CPU coder) or ``static_kv.GpuLayer`` (GPU coder)."""
        seq = keys.shape[-2] if keys.dim() == 4 else -1
        if not 1 <= seq <= self.prompt_len:
            raise ValueError(f"expected 1..{self.prompt_len} of the prompt's tokens, got "
                             f"keys of shape {tuple(keys.shape)}")
        routed = (self._auto and keys.dtype != torch.bfloat16
                  and str(keys.dtype).removeprefix("torch.") in static_kv.DTYPES)
        if self.method == "static" or routed:
            return self._encode_static(keys, values)
        for kv, t in enumerate((keys, values)):
            want = self.shape(layer, kv, seq)
            if t.dtype != torch.bfloat16 or tuple(t.shape) != want:
                raise ValueError(f"expected bf16 {want}, got {t.dtype} {tuple(t.shape)}")
        model = self.calibration.coder_model(self.model, "bf16")
        if keys.device != values.device:
            raise ValueError(f"keys on {keys.device}, values on {values.device}")
        both = torch.cat([keys.detach().reshape(-1), values.detach().reshape(-1)])
        if on_gpu(self.coder, both.device):
            from ..rans.cuda import dist as gpu_dist

            mu, sigma, index = self.layer_distribution(layer, both.device, seq)
            frame = gpu_dist.encode(both, mu, sigma, model, model_index=index,
                                    chunk_size=self.chunk_size or gpu_chunk(both.numel()))
            host = torch.empty(frame.numel(), dtype=torch.uint8, pin_memory=True)
            return host.copy_(frame)
        mu, sigma, index = self.layer_distribution(layer, seq=seq)
        bits = both.cpu().view(torch.int16).numpy().view(np.uint16)
        return dist.encode(bits, mu.numpy(), sigma.numpy(), model, fmt="bf16",
                           model_index=index, chunk_size=self.chunk_size or CHUNK,
                           threads=self.threads)

    def decode(self, layer: int, frame: Any, device: torch.device | str = "cpu",
               seq: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``encode``'s keys and values back (``seq``: the tokens it coded; default the
        prompt's), bf16 on ``device`` (decoded there when the GPU coder runs, else on the
        CPU and moved)."""
        keys, values, check = self.start_decode(layer, frame, device, seq)
        check()
        return keys, values

    def start_decode(self, layer: int, frame: Any,
                     device: torch.device | str = "cpu", seq: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """``decode`` without waiting where the GPU coder runs: (keys, values, a check).
        The tensors are queued on the current CUDA stream, so work queued after them may
        use them, but their values are right only once ``check()`` has returned (it waits
        for the decode and raises ``CorruptDataError`` for a bad chunk); a check with a
        ``ready()`` method says without waiting whether calling it would wait."""
        device = torch.device(device)
        if isinstance(frame, static_kv.StaticLayer | static_kv.GpuLayer):
            return _start_static(frame, device)
        if self.method == "static":
            raise TypeError(f"a static-table codec decodes its own layers, got {type(frame)}")
        seq = self.prompt_len if seq is None else seq
        model = self.calibration.coder_model(self.model, "bf16")
        if on_gpu(self.coder, device):
            from ..rans.cuda import dist as gpu_dist

            mu, sigma, index = self.layer_distribution(layer, device, seq)
            pending = gpu_dist.decode_async(frame, mu, sigma, model, model_index=index,
                                            device=device)
            keys, values = self._split(layer, pending.out.view(torch.bfloat16), seq)
            # no ``ready``: its inputs (mu and sigma, larger than the layer) stay on the
            # GPU until it is checked, so a layer's update waits for it
            return keys, values, pending.result
        mu, sigma, index = self.layer_distribution(layer, seq=seq)
        if isinstance(frame, torch.Tensor):
            frame = frame.numpy()
        bits = dist.decode(frame, mu.numpy(), sigma.numpy(), model,
                           model_index=index, threads=self.threads)
        keys, values = self._split(layer, torch.from_numpy(bits).view(torch.bfloat16), seq)
        return keys.to(device), values.to(device), lambda: None

    def _encode_static(self, keys: torch.Tensor, values: torch.Tensor
                       ) -> static_kv.StaticLayer | static_kv.GpuLayer:
        """``encode`` with static tables: any [batch, heads, seq, dim] shapes of one batch
        and seq (keys and values may differ in heads and dim). Where the GPU coder runs,
        coded on the layer's device (one table per exponent field: the GPU encoder's) and
        kept as the GPU decoder's batch; else coded on the host, exponents classed by rows
        and channels where that pays."""
        dtype = str(keys.dtype).removeprefix("torch.")
        for name, t in (("keys", keys), ("values", values)):
            if t.dtype != keys.dtype or dtype not in static_kv.DTYPES or t.dim() != 4 \
                    or 0 in t.shape:
                raise ValueError(f"expected [batch, heads, seq, dim] {name} of one of "
                                 f"{sorted(static_kv.DTYPES)}, got {t.dtype} "
                                 f"{tuple(t.shape)}")
        if keys.shape[0] != values.shape[0] or keys.shape[2] != values.shape[2]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                             "differ in batch or tokens")
        if keys.device != values.device:
            raise ValueError(f"keys on {keys.device}, values on {values.device}")
        chunk = self.chunk_size or static_kv.CHUNK
        if on_gpu(self.coder, keys.device):
            return static_kv.encode_gpu_layer(keys, values, chunk)
        host = [_bits(t.detach().to("cpu").contiguous()) for t in (keys, values)]
        return static_kv.encode(*host, chunk=chunk, threads=self.threads, dtype=dtype)

    def _split(self, layer: int, flat: torch.Tensor, seq: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer frame's values as (keys, values) of their shapes."""
        shapes = [self.shape(layer, kv, seq) for kv in (0, 1)]
        n = int(np.prod(shapes[0]))
        return flat[:n].reshape(shapes[0]), flat[n:].reshape(shapes[1])


def _start_static(frame: Any, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
    """``start_decode`` of a static-table layer: queued on the GPU for a ``GpuLayer``,
    else decoded on the host and moved."""
    if isinstance(frame, static_kv.GpuLayer):
        return frame.start(device)
    dtype = getattr(torch, frame.dtype)
    keys, values = (torch.from_numpy(t.view(np.int16 if t.itemsize == 2 else np.uint8)
                                     ).view(dtype).to(device)
                    for t in static_kv.decode(frame))
    return keys, values, lambda: None


def _bits(t: torch.Tensor) -> np.ndarray:
    """A host tensor's bit patterns: uint16 for 16-bit dtypes, uint8 for fp8."""
    if t.element_size() == 1:
        return t.view(torch.uint8).numpy()
    return t.view(torch.int16).numpy().view(np.uint16)


GPU_MIN_CHUNK, GPU_MAX_CHUNK = 1 << 11, 1 << 14
GPU_TARGET_CHUNKS = 1 << 13  # about two chunks per warp slot of a large GPU


def gpu_chunk(n: int) -> int:
    """The GPU coder's chunk for a layer frame of ``n`` values: the largest power of two in
    [2^11, 2^14] that still makes ~GPU_TARGET_CHUNKS chunks. A prefetch waits for one
    chunk's serial decode until the chunks fill the GPU, so a small layer takes small
    chunks (a few percent more bytes for a much shorter prefetch; measured in
    bench/RESULTS.md) and a large one the coder's default (fewer bytes, and as fast once the GPU is
    full). Depends on ``n`` alone, so the frames are the same on any machine."""
    c = GPU_MIN_CHUNK
    while c < GPU_MAX_CHUNK and n >= 2 * c * GPU_TARGET_CHUNKS:
        c *= 2
    return c


def _compact(t: torch.Tensor) -> torch.Tensor:
    """A guess in host memory: bfloat16 where that holds every value exactly (a bf16
    predictor's cache, read as float32), else float32; pinned where CUDA is, for uploads."""
    host = t.detach().to("cpu", torch.float32)
    small = host.to(torch.bfloat16)
    if torch.equal(small.float().view(torch.int32), host.view(torch.int32)):
        host = small
    return host.pin_memory() if torch.cuda.is_available() else host


class PredictiveOffloadedLayer(DynamicLayer):
    """A dynamic cache layer whose offloaded prompt part lives as compressed bytes.

    ``prefetch()`` only queues the decode on the current stream (transformers' prefetch
    stream, with the GPU coder), so it overlaps the compute queued after it. The decode's
    check (a bad chunk raises ``CorruptDataError``, and then on every read) runs where
    the codec's ``check`` says: by default in ``update``, before the keys and values are
    returned, waiting for the decode; with ``check="deferred"`` a static-table layer's
    never makes the cache's own step wait: inside ``update`` and ``offload`` it runs only
    if the decode has already finished, else at the next read of ``keys`` or ``values``
    from outside the cache, or at the layer's next ``prefetch`` (the decode long done by
    then), whichever comes first; either waits for the decode.

    The generated tokens' keys and values (the tail) go to host buffers of their own,
    pinned on a GPU and reused from step to step (grown by doubling), with asynchronous
    copies both ways: no step waits for a copy."""

    def __init__(self, codec: KVOffloadCodec, layer_idx: int, **kwargs: Any) -> None:
        self._checks: list[Callable[[], None]] = []
        self._hot = False  # inside the cache's own update / offload: reads never wait
        super().__init__(**kwargs)
        self.codec, self.layer_idx = codec, layer_idx
        self._frame: bytes | torch.Tensor | None = None  # keys and values of the prompt
        self._frame_seq = 0  # the prompt's tokens the frame holds (its last ones)
        self._drop = 0  # of those, the ones a sliding window has since let go
        self._tail: tuple[torch.Tensor, torch.Tensor] | None = None
        self._bufs: list[torch.Tensor | None] = [None, None]  # the tail's host buffers
        self._read: Any = None  # a CUDA event: the last upload of the buffers has run
        self._length = 0

    def _settle(self, wait: bool) -> None:
        """Run the pending decode checks: all of them if ``wait``, else only if none
        would wait."""
        if self._checks and (wait or all(_ready(c) for c in self._checks)):
            for check in self._checks:
                check()  # raises, and again on the next read: the tensors stay unchecked
            self._checks = []

    def _settled(self, name: str) -> torch.Tensor | None:
        self._settle(not self._hot)
        return self.__dict__.get(name)  # None before the first update, as DynamicLayer

    # transformers reads and assigns ``keys`` / ``values`` as plain attributes
    keys = property(lambda self: self._settled("_keys"),
                    lambda self, v: self.__dict__.__setitem__("_keys", v))
    values = property(lambda self: self._settled("_values"),
                      lambda self, v: self.__dict__.__setitem__("_values", v))

    def _quietly(self, run: Callable[[], Any]) -> Any:
        """``run()`` with reads that do not wait for an unfinished decode's check."""
        hot, self._hot = self._hot, True
        try:
            return run()
        finally:
            self._hot = hot

    @property
    def offloaded(self) -> bool:
        return self._tail is not None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._quietly(lambda: super(PredictiveOffloadedLayer, self).update(
            key_states, value_states, *args, **kwargs))
        if self.codec.check == "before_use":
            # after the concatenation is queued, so the device has it ready behind the decode
            self._settle(wait=True)
        return out

    def offload(self) -> None:
        """Code the prompt's keys and values (once) and keep only the bytes and the tail."""
        self._quietly(self._offload)

    def _offload(self) -> None:
        if not self.is_initialized or self.offloaded or self.keys is None:
            return
        n, seen, held = self.codec.prompt_len, self.get_seq_length(), self.keys.shape[-2]
        prompt_held = n - (seen - held)  # the held tokens before the prompt's end
        if seen < n or n == 0 or prompt_held <= 0:
            return  # not the prompt's cache (yet), or none of it left: keep it as it is
        if self._frame is None:
            self._frame = self.codec.encode(self.layer_idx, self.keys[..., :prompt_held, :],
                                            self.values[..., :prompt_held, :])
            self._frame_seq = prompt_held
        self._drop = self._frame_seq - prompt_held
        if self._read is not None:  # the buffers' last upload must be done before reuse
            torch.cuda.current_stream(self.keys.device).wait_event(self._read)
            self._read = None
        self._tail = tuple(self._stash(kv, t[..., prompt_held:, :])
                           for kv, t in enumerate((self.keys, self.values)))
        self._length = seen
        self.keys = self.values = None

    def _stash(self, kv: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` copied (queued, where it is on a GPU) into the start of host buffer
        ``kv``, grown by doubling: a contiguous host tensor of its shape."""
        n, buf = t.numel(), self._bufs[kv]
        if buf is None or buf.numel() < n or buf.dtype != t.dtype:
            least = 16 * t.shape[0] * t.shape[1] * t.shape[3]  # 16 tokens
            size = max(n, least, 0 if buf is None else 2 * buf.numel())
            buf = self._bufs[kv] = torch.empty(size, dtype=t.dtype, pin_memory=t.is_cuda)
        return buf[:n].view(t.shape).copy_(t, non_blocking=t.is_cuda)

    def prefetch(self) -> None:
        """Queue the prompt part's decode and the whole layer's return to its device."""
        self._settle(wait=True)  # the last decode's check, if it has not run
        if not self.offloaded:
            return
        if torch.device(self.device).type == "cuda":
            # The decode's new tensors may take memory the default stream still reads (the
            # layer before's, freed while its compute runs); some transformers releases
            # queue prefetches on their own stream without waiting for the default one.
            torch.cuda.current_stream(self.device).wait_stream(
                torch.cuda.default_stream(self.device))
        keys, values, check = self.codec.start_decode(self.layer_idx, self._frame, self.device,
                                                      self._frame_seq)
        tail = [t.to(self.device, non_blocking=True) for t in self._tail]
        if tail[0].is_cuda:
            self._read = torch.cuda.Event()
            self._read.record()
        self.keys, self.values = (torch.cat([p[..., self._drop :, :], t], dim=-2)
                                  for p, t in zip((keys, values), tail, strict=True))
        self._checks = [check]
        self._tail = None

    def compressed_bytes(self) -> int:
        return 0 if self._frame is None else len(self._frame)

    def get_seq_length(self) -> int:
        if self.offloaded:
            return self._length
        return self._quietly(super().get_seq_length)  # shapes need no check


def _ready(check: Callable[[], None]) -> bool:
    """Whether ``check()`` would run without waiting (checks without ``ready``: always)."""
    ready = getattr(check, "ready", None)
    return ready is None or bool(ready())


class PredictiveOffloadedSlidingLayer(PredictiveOffloadedLayer, DynamicSlidingWindowLayer):
    """``PredictiveOffloadedLayer`` of a sliding-window attention layer: it holds (and
    codes) the prompt's last ``sliding_window - 1`` tokens."""

    def __init__(self, codec: KVOffloadCodec, layer_idx: int, sliding_window: int) -> None:
        super().__init__(codec, layer_idx, sliding_window=sliding_window)


class PredictiveOffloadedCache(Cache):
    """``Cache`` of ``PredictiveOffloadedLayer``s: each layer is offloaded after its update
    and the next one prefetched, synchronously (no CUDA streams needed).

    ``num_layers`` plain (full attention) layers, or, given the model's ``config``, the
    layers its ``layer_types`` ask for (transformers 5's ``DynamicCache(config=...)``
    choice): full and sliding-window attention offloaded, any other kind (linear
    attention: no KV) as transformers makes it."""

    def __init__(self, codec: KVOffloadCodec, num_layers: int | None = None, *,
                 config: Any = None) -> None:
        if (num_layers is None) == (config is None):
            raise ValueError("give num_layers or config, not both")
        if config is None:
            layers = [PredictiveOffloadedLayer(codec, i) for i in range(num_layers)]
        else:
            layers = _layers_for(codec, config)
        super().__init__(layers=layers)
        self.codec = codec

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        if not isinstance(layer, PredictiveOffloadedLayer):
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer.prefetch()
        keys, values = layer.update(key_states, value_states, *args, **kwargs)
        layer.offload()
        return keys, values

    def compressed_bytes(self) -> int:
        """Bytes of the offloaded prompt caches, all layers."""
        return sum(layer.compressed_bytes() for layer in self.layers
                   if isinstance(layer, PredictiveOffloadedLayer))


def _layers_for(codec: KVOffloadCodec, config: Any) -> list:
    """The cache layers of a model's config: transformers' own choice per layer type, with
    its full and sliding-window dynamic layers replaced by offloaded ones."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    layers = []
    for i, (kind, kwargs) in enumerate(zip(*get_layer_types_and_kwargs(text), strict=True)):
        cls = DYNAMIC_LAYER_TYPE_MAPPING[kind]
        if cls is DynamicLayer:
            layers.append(PredictiveOffloadedLayer(codec, i))
        elif cls is DynamicSlidingWindowLayer:
            layers.append(PredictiveOffloadedSlidingLayer(codec, i, **kwargs))
        else:
            layers.append(cls(**kwargs))
    return layers
