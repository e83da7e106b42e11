"""``base + feats @ weights`` on a CUDA device, bit for bit ``predictive._linear.affine``.

What it is: the conditional residual model's one matrix product as a CUDA kernel (NVRTC
through CuPy, on torch's current stream) that sums every output over the features in
index order, each product and each sum rounded on its own (``__fmul_rn`` / ``__fadd_rn``:
no FMA contraction) from the base value up, exactly as the Numba loop does, so a
``compress_kv`` blob coded on a GPU decodes on a CPU and back. What it is not: fast
linear algebra (one thread an output, the features read in order).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._cuda import checked_device, nvrtc

_SRC = r"""
extern "C" __global__ void affine_in_order(const float* feats, const float* w, float* out,
                                           long long rows, int n_feats, int n_out) {
    const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i >= rows * n_out) return;
    const long long t = i / n_out;
    const int c = (int)(i - t * n_out);
    const float* row = feats + t * n_feats;
    float acc = out[i];
    for (int f = 0; f < n_feats; ++f)
        acc = __fadd_rn(acc, __fmul_rn(row[f], w[(long long)f * n_out + c]));
    out[i] = acc;
}
"""
_BLOCK = 256


def _function() -> Any:
    return nvrtc.kernel("affine_in_order", lambda: _SRC)


def affine(base: Any, feats: Any, weights: Any) -> Any:
    """float32 CUDA tensors base [T, C], feats [T, F], weights [F, C] -> a new [T, C]."""
    import torch

    out = base.to(torch.float32).contiguous().clone()
    f = feats.to(torch.float32).contiguous()
    w = weights.to(torch.float32).contiguous()
    if f.shape != (out.shape[0], w.shape[0]) or w.shape[1] != out.shape[1]:
        raise ValueError(f"shapes {tuple(f.shape)} @ {tuple(w.shape)} do not give "
                         f"{tuple(out.shape)}")
    if out.numel():
        dev = checked_device(out.device)
        nvrtc.launch(dev, [(_function(), -(-out.numel() // _BLOCK), _BLOCK,
                            nvrtc.args(f, w, out, out.shape[0], np.int32(f.shape[1]),
                                       np.int32(w.shape[1])), 0)])
    return out
