"""Residual models: the distribution of a cached value around its predictor's guess.

What it is: for each model kind, the per-value (mu, sigma) and the coder's shape tables
(``rans.distribution.CoderModel``), from a prediction and calibrated parameters, and the
fitting of those parameters from calibration residuals. What it is not: a predictor, or the
loop that collects calibration data (``calibration``).

Kinds (p = the predictor's guess, r = x - p, per channel c = (layer, k/v, head, dim)):
- ``gaussian``: mu = p + bias_c, sigma = std_c, a Gaussian shape.
- ``mixture``: same mu, sigma; shape 0.95 N(0, 1) + 0.03 N(0, 3^2), plus 0.02 of an
  empirical distribution of the cached values per (layer, k/v) (the published baseline).
- ``adaptive`` (ours): mu = p + bias_c and a per-value scale
  sigma^2 = a_c + b_c p^2 + g_c n_t^2, n_t^2 = mean of p^2 over the token's head vector,
  so tokens and values the predictor sees as large get a wider distribution (the residual
  of a quantized predictor grows with the activations); the shape of r / sigma is learned
  per (layer, k/v) from calibration (heavy tails as they are), plus 0.5% empirical.
Layers the predictor reproduces exactly (early exit) get mu = p and sigma = 0; every sigma
is then raised to ``floor``.
"""

from __future__ import annotations

import numpy as np

from ..rans import distribution as dist

KINDS = ("gaussian", "mixture", "adaptive")
MIXTURE_EMPIRICAL = 0.02
ADAPTIVE_EMPIRICAL = 0.005
TINY = np.float32(1e-30)
RELATIVE_FLOOR = np.float32(2.0**-12)  # far below the spacing of bf16 (2**-8) and fp8 values


def floor(sigma: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """sigma raised to at least |mu| 2**-12 and 1e-30.

    A value predicted exactly gets (nearly) all the mass of its own key, and the coder's
    grid stays exact (it needs |mu| < 2**44 sigma; see rans.dist_kernels).
    """
    return np.maximum(np.maximum(sigma, np.abs(mu) * RELATIVE_FLOOR), TINY).astype(np.float32)


def _weight(p: float) -> int:
    return int(round(p * dist._k.WEIGHT_ONE))


def coder_model(kind: str, shapes: np.ndarray, emps: np.ndarray) -> dist.CoderModel:
    """The coder's tables for ``kind``: model index = layer * 2 + k/v, then one last model
    (a Gaussian, no empirical part) for exactly predicted layers.

    ``shapes`` (uint32[groups, Z_POINTS + 1]) are the learned shapes (adaptive only);
    ``emps`` (uint32[groups, 257]) the empirical tables of the cache's value format.
    """
    groups = emps.shape[0]
    gauss = dist.gaussian_shape()
    if kind == "gaussian":
        sh, w = np.tile(gauss, (groups, 1)), [0] * groups
    elif kind == "mixture":
        mix = dist.gaussian_shape((1.0, 3.0), (0.95, 0.03))
        sh, w = np.tile(mix, (groups, 1)), [_weight(MIXTURE_EMPIRICAL)] * groups
    elif kind == "adaptive":
        sh, w = shapes, [_weight(ADAPTIVE_EMPIRICAL)] * groups
    else:
        raise ValueError(f"unknown residual model {kind!r}; known: {KINDS}")
    uniform = np.linspace(0, dist.ONE, dist.EMP_POINTS + 1).astype(np.int64)[None]
    return dist.CoderModel(np.concatenate([sh, gauss[None]]),
                           np.concatenate([emps, uniform]), list(w) + [0])


def scales(kind: str, p: np.ndarray, std: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """sigma (float32) of every value of one (layer, k/v) tensor [batch, heads, seq, dim].

    ``p`` is the prediction (zeros without a predictor), ``std`` [heads, dim] the channel
    residual std, ``coef`` [heads, dim, 3] the adaptive model's (a, b, g).
    """
    if kind != "adaptive":
        return np.broadcast_to(std[None, :, None, :], p.shape).astype(np.float32)
    # Element-wise IEEE operations in a fixed order only (no reductions whose summation
    # order numpy may choose per CPU): encoder and decoder must get the same bits.
    p = p.astype(np.float32)
    p2 = p * p
    n2 = np.zeros(p.shape[:-1] + (1,), np.float32)
    for d in range(p.shape[-1]):
        n2 += p2[..., d : d + 1]
    n2 /= np.float32(p.shape[-1])
    c = coef.astype(np.float32)[None, :, None, :, :]
    var = c[..., 0] + c[..., 1] * p2 + c[..., 2] * n2
    return np.sqrt(np.maximum(var, 0)).astype(np.float32)


# ---- fitting ---------------------------------------------------------------------------


def fit_adaptive(r: np.ndarray, p: np.ndarray) -> np.ndarray:
    """(a, b, g) >= 0 per channel from residuals ``r`` and guesses ``p`` [N, heads, T, dim].

    Least squares of r^2 on (1, p^2, n_t^2) per channel, the best of the non-negative
    solutions over the 7 subsets of features (an exact small NNLS). r^2 is clipped at 50x
    its channel mean first so that a few outliers do not set the slope.
    """
    y = r.astype(np.float64) ** 2
    y = np.minimum(y, 50 * y.mean(axis=(0, 2), keepdims=True))
    p2 = p.astype(np.float64) ** 2
    feats = [np.ones_like(p2), p2, np.broadcast_to(p2.mean(axis=-1, keepdims=True), p2.shape)]
    heads, dim = r.shape[1], r.shape[3]
    gram = np.empty((heads, dim, 3, 3))
    rhs = np.empty((heads, dim, 3))
    for i in range(3):
        rhs[..., i] = (feats[i] * y).sum(axis=(0, 2))
        for j in range(3):
            gram[..., i, j] = (feats[i] * feats[j]).sum(axis=(0, 2))
    yy = (y * y).sum(axis=(0, 2))
    best = np.zeros((heads, dim, 3))
    best_err = yy.copy()  # the all-zero solution
    for mask in range(1, 8):
        idx = [i for i in range(3) if mask >> i & 1]
        g = gram[..., idx, :][..., :, idx] + 1e-12 * np.eye(len(idx))
        sol = np.linalg.solve(g, rhs[..., idx][..., None])[..., 0]
        full = np.zeros((heads, dim, 3))
        full[..., idx] = sol
        err = yy - 2 * (full * rhs).sum(-1) + np.einsum("hdi,hdij,hdj->hd", full, gram, full)
        ok = (sol >= 0).all(-1) & (err < best_err)
        best[ok] = full[ok]
        best_err[ok] = err[ok]
    return best.astype(np.float32)


def fit_shape(z: np.ndarray) -> np.ndarray:
    """A shape table from standardized residuals ``z``: their histogram on the coder's z
    grid, smoothed over +-4 bins and mixed with 0.1% of N(0, 4^2) so no region is empty."""
    edges = dist.z_grid()
    hist = np.histogram(np.clip(z, edges[0], edges[-1]), bins=edges)[0].astype(np.float64)
    kernel = np.ones(9) / 9
    smooth = np.convolve(hist, kernel, mode="same")
    smooth /= max(smooth.sum(), 1.0)
    wide = np.diff(dist.gaussian_shape((4.0,), (1.0,)).astype(np.float64)) / dist.ONE
    return dist.shape_from_masses(0.999 * smooth + 0.001 * wide)
