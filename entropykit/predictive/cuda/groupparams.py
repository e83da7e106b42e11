"""A Gaussian / mixture group's (mu, sigma) on a CUDA device in one kernel, bit for bit
``predictive.codec.group_distribution``.

What it is: for a (layer, k/v) group whose model is not the conditional one, mu = guess +
bias[head, dim] and sigma = std[head, dim], both divided by the fp8 scale where there is
one, then sigma floored at |mu| 2^-12 and 1e-30 (``residual.floor``), in one pass over the
group with the reference's float32 operations, each rounded on its own (``__fadd_rn``,
``__fdiv_rn``, ``__fmul_rn``: no contraction) and NaN-propagating maxima as numpy's and
torch's, so frames coded from it are the CPU's bytes. The torch twin
(``predictive._torchdist``) takes ~6 launches a group for the same values; the offload
hook pays them on the host at every layer's offload and prefetch.
What it is not: the conditional model's mean (``affine``) or its exact layers (the twin).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._cuda import checked_device, nvrtc

_SRC = r"""
__device__ __forceinline__ float nan_max(float a, float b) {  // numpy / torch maximum
    return a != a ? a : b != b ? b : fmaxf(a, b);
}

extern "C" __global__ void group_params(const float* guess, const float* bias,
        const float* sd, long long n, int heads, int seq, int dim, const float* scale,
        float rf, float tiny, float* mu, float* sg) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const long long row = i / dim;  // [batch, heads, seq, dim]: channel (head, dim)
    const int c = (int)((row / seq) % heads) * dim + (int)(i - row * dim);
    float m = __fadd_rn(guess ? guess[i] : 0.0f, bias[c]);
    float s = sd[c];
    if (scale) {
        m = __fdiv_rn(m, *scale);
        s = __fdiv_rn(s, *scale);
    }
    mu[i] = m;
    sg[i] = nan_max(nan_max(s, __fmul_rn(fabsf(m), rf)), tiny);
}
"""
_BLOCK = 256


def _function() -> Any:
    return nvrtc.kernel("group_params", lambda: _SRC)


def group_params(guess: Any, bias: Any, std: Any, shape: tuple, scale: Any, rf: float,
                 tiny: float, mu: Any, sigma: Any) -> None:
    """Write the group's flat (mu, sigma) into float32 CUDA tensors ``mu`` and ``sigma``
    (prod(shape) elements each). ``guess``: float32 [batch, heads, seq, dim] or None (no
    predictor: 0); ``bias``, ``std``: float32 [heads, dim]; ``scale``: a 0-d float32 tensor
    (fp8 caches) or None; ``rf``, ``tiny``: the floor's constants (float32 values)."""
    import torch

    n = int(np.prod(shape))
    dev = mu.device
    parts = [mu, sigma, bias, std] + [t for t in (guess, scale) if t is not None]
    for t in parts:
        if t.dtype != torch.float32 or t.device != dev or not t.is_contiguous():
            raise ValueError("group_params takes contiguous float32 tensors on one device")
    if mu.numel() != n or sigma.numel() != n or (guess is not None and guess.numel() != n):
        raise ValueError(f"group_params: tensors of {n} values expected")
    if bias.numel() != shape[1] * shape[3] or std.numel() != bias.numel():
        raise ValueError("group_params: bias and std must be [heads, dim]")
    if n:
        nvrtc.launch(checked_device(dev), [(
            _function(), -(-n // _BLOCK), _BLOCK,
            nvrtc.args(guess, bias, std, n, np.int32(shape[1]), np.int32(shape[2]),
                       np.int32(shape[3]), scale, np.float32(rf), np.float32(tiny), mu,
                       sigma), 0)])
