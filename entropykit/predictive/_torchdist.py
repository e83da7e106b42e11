"""``codec.group_distribution`` in torch: a group's (mu, sigma) on the cache's own device.

What it is: the numpy reference's float32 sums, products, maxima and divisions, and the
conditional model's fixed-order affine (``cuda.affine`` on CUDA, ``_linear.affine`` on a
CPU), done on torch tensors wherever the cache lives, so the GPU coder gets (mu, sigma)
without a round trip through host memory; bit for bit the numpy ones, so frames coded
either way are the same bytes (tests compare every model kind on the CPU here, and
gpu/kv_hook_check.py on CUDA). Also where the GPU coder may run (``on_gpu``).
What it is not: a second model: each formula is ``codec`` / ``residual``'s.
"""

from __future__ import annotations

import numpy as np
import torch

from . import residual
from ._linear import affine as _host_affine
from .calibration import Calibration
from .kvcache import aligned_guess

CODERS = ("auto", "cpu", "gpu")
Guesses = dict[tuple[int, int], torch.Tensor | None]


def on_gpu(coder: str, device: torch.device | str) -> bool:
    """Whether ``coder`` ("auto", "cpu" or "gpu") codes tensors on ``device`` with the GPU
    coder: "gpu" needs a CUDA device (else ``ValueError``); "auto" takes it where it runs
    (torch with CUDA and CuPy)."""
    if coder not in CODERS:
        raise ValueError(f"coder must be one of {CODERS}, got {coder!r}")
    device = torch.device(device)
    if coder == "cpu" or device.type != "cuda":
        if coder == "gpu":
            raise ValueError(f"coder 'gpu' needs tensors on a CUDA device, not {device}")
        return False
    if coder == "gpu":
        return True
    from .._cuda import GpuUnavailableError, require

    try:
        require(device)
    except GpuUnavailableError:
        return False
    return True


class DeviceCalibration:
    """A calibration's arrays as tensors on one device, each uploaded at first use."""

    def __init__(self, calibration: Calibration, device: torch.device | str) -> None:
        self.calibration, self.device = calibration, torch.device(device)
        self._arrays: dict[tuple[str, str | None], torch.Tensor] = {}

    def _upload(self, key: tuple, a: np.ndarray) -> torch.Tensor:
        if key not in self._arrays:
            self._arrays[key] = torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        return self._arrays[key]

    def channels(self, name: str, layer: int, kv: int, fmt: str | None = None
                 ) -> torch.Tensor:
        """``Calibration.channels`` on the device."""
        return self._upload((name, layer, kv, fmt),
                            self.calibration.channels(name, layer, kv, fmt))

    def cond(self, layer: int, kv: int, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``Calibration.cond`` on the device."""
        q, scale = self.calibration.cond(layer, kv, fmt)
        return (self._upload(("cond", layer, kv, fmt), q),
                self._upload(("cscale", layer, kv, fmt), scale))


def guess_tensors(guess: list | None, shapes: list, device: torch.device | str) -> Guesses:
    """``codec.guess_arrays`` on ``device``: float32 tensors of each group with KV; without
    a guess a zero expanded to the group's shape (no memory; ``_has_guess``)."""
    zero = torch.zeros((), dtype=torch.float32, device=device)
    return {divmod(g, 2): zero.expand(sh) if guess is None
            else aligned_guess(guess, g // 2, g % 2, sh).to(device)
            for g, sh in enumerate(shapes) if sh is not None}


def _has_guess(g: torch.Tensor) -> bool:
    return g.dim() == 0 or g.stride()[-1] != 0  # guess_tensors' zeros have stride 0


def _affine(base: torch.Tensor, feats: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    if base.device.type == "cuda":
        from .cuda.affine import affine

        return affine(base, feats, weights)
    out = _host_affine(base.numpy(), feats.numpy(), weights.numpy())
    return torch.from_numpy(out)


def _conditional_mean(base: torch.Tensor, residuals: dict, guesses: Guesses, layer: int,
                      kv: int, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``residual.conditional_mean`` (features, dequantized map, affine) in torch."""
    b, h, s, d = base.shape
    arrays = residual.source_arrays(residuals, guesses, layer, kv)
    sizes = torch.tensor(residual.block_sizes(arrays), device=q.device)
    w = q.float() * scale.repeat_interleave(sizes, dim=0)  # residual.dequantize
    feats = torch.cat([a.permute(0, 2, 1, 3).reshape(b * s, -1) for a in arrays],
                      dim=1).float()
    flat = base.float().permute(0, 2, 1, 3).reshape(b * s, h * d)
    return _affine(flat, feats, w).reshape(b, s, h, d).permute(0, 2, 1, 3)


def group_distribution(layer: int, kv: int, guesses: Guesses, shape: tuple, exact: int,
                       kind: str, cal: DeviceCalibration, scale: torch.Tensor | None,
                       residuals: dict, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                       fmt: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """``codec.group_distribution`` on ``cal.device``: (mu, sigma) flat float32, the model
    index, and the base mean [batch, heads, seq, dim] (None where the model does not use
    it: not the conditional one); ``scale`` (fp8 caches) a 0-d float32 tensor on the
    device, ``residuals`` the real-unit residuals of the groups coded before (tensors on
    the device). ``out``: flat float32 tensors (mu, sigma) to write them into. ``fmt``:
    the cache's format, whose conditional fit is used (None: bf16, or fp8_e4m3 where
    there is a ``scale``)."""
    dev = cal.device
    if kind != "conditional" and layer >= exact and dev.type == "cuda":
        from .cuda.groupparams import group_params  # one kernel for ~6 launches

        n = int(np.prod(shape))
        mu, sg = out or (torch.empty(n, dtype=torch.float32, device=dev),
                         torch.empty(n, dtype=torch.float32, device=dev))
        g = guesses[(layer, kv)]
        group_params(g.contiguous() if _has_guess(g) else None,
                     cal.channels("bias", layer, kv), cal.channels("std", layer, kv), shape,
                     scale, float(residual.RELATIVE_FLOOR), float(residual.TINY), mu, sg)
        return mu, sg, 2 * layer + kv, None
    p = guesses[(layer, kv)].expand(shape)
    if layer < exact:
        base = mean = p
        sigma = torch.zeros((), dtype=torch.float32, device=dev).expand(shape)
        index = 2 * cal.calibration.layers  # residual.coder_model's last model
    else:
        base = p + cal.channels("bias", layer, kv)[None, :, None, :]
        if kind == "conditional":
            fmt = fmt or ("bf16" if scale is None else "fp8_e4m3")
            mean = _conditional_mean(base, residuals, guesses, layer, kv,
                                     *cal.cond(layer, kv, fmt))
            sd = cal.channels("cstd", layer, kv, fmt)
        else:
            mean, sd = base, cal.channels("std", layer, kv)
        sigma = sd[None, :, None, :].expand(shape)
        index = 2 * layer + kv
    if scale is not None:  # a 0-d tensor: true division (a CPU scalar would be a reciprocal)
        mean, sigma = mean / scale, sigma / scale
    floor = torch.maximum(sigma, mean.abs() * float(residual.RELATIVE_FLOOR)).clamp_min(
        float(residual.TINY))  # residual.floor; both float32 constants, exact as floats
    mu, sg = mean.float().reshape(-1), floor.float().reshape(-1)
    if out is not None:
        out[0].copy_(mu)
        out[1].copy_(sg)
        return out[0], out[1], index, base
    return mu.contiguous(), sg.contiguous(), index, base
