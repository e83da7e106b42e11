"""Residual models: the distribution of a cached value around its predictor's guess.

What it is: for each model kind, the per-value (mu, sigma) of one (layer, k/v) tensor and
the coder's shape tables (``rans.distribution.CoderModel``), and the fitting of their
parameters from calibration residuals. What it is not: a predictor, or the loop that
collects calibration data (``calibration``).

Notation: p = the predictor's guess, c = a channel (layer, k/v, kv head, dim), base
mean m = p + bias_c, residual r = x - m.
- ``gaussian``: mu = m, sigma = std_c (residual std), a Gaussian shape.
- ``mixture``: same mu, sigma; shape 0.95 N(0, 1) + 0.03 N(0, 3^2), plus 0.02 of an
  empirical distribution of the cached values per (layer, k/v) (the published baseline).
- ``conditional`` (ours): values are coded (layer, k/v) group by group, and a group's mean
  is conditioned on what the decoder already has for the same token: the residuals of
  the keys and values of layer l-1 (and, for values, of layer l's keys) and the guesses
  for layer l's keys and values. mu = m + sum_s f_s W_s (linear maps per (layer, k/v)
  fitted by ridge regression on calibration data, the penalty chosen on held-out
  tokens: the predictor's errors propagate through the layers, so the previous layer's
  errors predict much of this one's), sigma = the conditional residual std per channel,
  and the shape of the standardized conditional residual is learned per (layer, k/v)
  (heavy tails as they are), both from out-of-fold residuals, plus 0.5% empirical. The
  maps are stored as int8 with one scale per block and output channel.
Layers the predictor reproduces exactly (early exit) get mu = p and sigma = 0; every sigma
is then raised to ``floor``.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Container, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..rans import distribution as dist
from ._linear import affine
from .kvcache import align

KINDS = ("gaussian", "mixture", "conditional")
MIXTURE_EMPIRICAL = 0.02
CONDITIONAL_EMPIRICAL = 0.005
MAX_SOURCES = 5
RIDGES = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)  # candidate penalties (``fit_conditional``)
FOLDS = 5
FOLD_BLOCK = 32  # tokens per block of a fold
MIN_FOLD = 64  # tokens per fold below which no map is fitted
TINY = np.float32(1e-30)
RESIDUAL_MAX = 2.0**64  # |a decoded residual| as a feature, at most (codec: NaN -> 0)
RELATIVE_FLOOR = np.float32(2.0**-12)  # far below the spacing of bf16 (2**-8) and fp8 values


def floor(sigma: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """sigma raised to at least |mu| 2**-12 and 1e-30.

    A value predicted exactly gets (nearly) all the mass of its own key, and the coder's
    grid stays exact (it refuses |mu| >= ~2**34 sigma; see rans.dist_kernels).
    """
    return np.maximum(np.maximum(sigma, np.abs(mu) * RELATIVE_FLOOR), TINY).astype(np.float32)


def _weight(p: float) -> int:
    return int(round(p * dist._k.WEIGHT_ONE))


def coder_model(kind: str, shapes: np.ndarray, emps: np.ndarray) -> dist.CoderModel:
    """The coder's tables for ``kind``: model index = layer * 2 + k/v, then one last model
    (a Gaussian, no empirical part) for exactly predicted layers.

    ``shapes`` (uint32[groups, Z_POINTS + 1]) are the learned shapes (conditional only);
    ``emps`` (uint32[groups, 257]) the empirical tables of the cache's value format.
    """
    groups = emps.shape[0]
    gauss = dist.gaussian_shape()
    if kind == "gaussian":
        sh, w = np.tile(gauss, (groups, 1)), [0] * groups
    elif kind == "mixture":
        mix = dist.gaussian_shape((1.0, 3.0), (0.95, 0.03))
        sh, w = np.tile(mix, (groups, 1)), [_weight(MIXTURE_EMPIRICAL)] * groups
    elif kind == "conditional":
        sh, w = shapes, [_weight(CONDITIONAL_EMPIRICAL)] * groups
    else:
        raise ValueError(f"unknown residual model {kind!r}; known: {KINDS}")
    uniform = np.linspace(0, dist.ONE, dist.EMP_POINTS + 1).astype(np.int64)[None]
    return dist.CoderModel(np.concatenate([sh, gauss[None]]),
                           np.concatenate([emps, uniform]), list(w) + [0])


def sources(layer: int, kv: int, kv_layers: Container[int] | None = None
            ) -> list[tuple[str, int, int]]:
    """What conditions group (layer, kv), in order: ("r", l, k) a decoded residual,
    ("g", l, k) the predictor's guess. The previous layer is the nearest earlier one in
    ``kv_layers`` (the layers with KV; None: every layer)."""
    prev_layer = layer - 1
    while kv_layers is not None and prev_layer >= 0 and prev_layer not in kv_layers:
        prev_layer -= 1
    prev = [("r", prev_layer, 0), ("r", prev_layer, 1)] if prev_layer >= 0 else []
    own = [("r", layer, 0)] if kv == 1 else []
    return prev + own + [("g", layer, 0), ("g", layer, 1)]


def source_arrays(residuals: dict, guesses: dict, layer: int, kv: int) -> list:
    """The arrays (numpy or torch, [batch, heads, seq, dim]) that condition group (layer,
    kv), each over the group's tokens (``kvcache.align``: its seq is the group's guess's).
    ``guesses`` holds every group with KV, so its keys say which layers have KV."""
    seq = guesses[(layer, kv)].shape[-2]
    kv_layers = {g[0] for g in guesses}
    return [align((residuals if kind == "r" else guesses)[(src_layer, src_kv)], seq)
            for kind, src_layer, src_kv in sources(layer, kv, kv_layers)]


def features(residuals: dict[tuple[int, int], np.ndarray],
             guesses: dict[tuple[int, int], np.ndarray], layer: int, kv: int) -> np.ndarray:
    """float32 [batch * seq, sum of sources' heads * dim]: each token's conditioning
    vector."""
    return _flat(source_arrays(residuals, guesses, layer, kv))


def _flat(arrays: list[np.ndarray]) -> np.ndarray:
    blocks = [a.transpose(0, 2, 1, 3).reshape(a.shape[0] * a.shape[2], -1) for a in arrays]
    return np.concatenate(blocks, axis=1).astype(np.float32)


def block_sizes(arrays: list) -> list[int]:
    """Each conditioning source's width (heads * dim): the rows of its block of a map."""
    return [a.shape[1] * a.shape[3] for a in arrays]


def dequantize(q: np.ndarray, scale: np.ndarray, sizes: list[int]) -> np.ndarray:
    """float32 [sum(sizes), hd] map from int8 rows q [sum(sizes), hd] and one scale per
    block and output channel, scale [len(sizes), hd]."""
    return q.astype(np.float32) * np.repeat(scale, sizes, axis=0)


def quantize(w: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows [sum(sizes), hd] and float32 scales [len(sizes), hd] of a map w
    [sum(sizes), hd]: one scale per block (``sizes`` rows each) and output channel."""
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)
    scale = np.maximum.reduceat(np.abs(w), starts, axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.repeat(scale, sizes, axis=0)), -127, 127).astype(np.int8)
    return q, scale


def conditional_mean(base: np.ndarray, residuals: dict, guesses: dict, layer: int, kv: int,
                     q: np.ndarray, scale: np.ndarray, threads: int | None = None
                     ) -> np.ndarray:
    """base [batch, heads, seq, dim] + the conditional shift, with the group's int8 map
    ``q`` [sum of sources' widths, hd] and ``scale`` [sources, hd] (calibration), on
    ``threads`` threads (the same bits on any number)."""
    b, h, s, d = base.shape
    arrays = source_arrays(residuals, guesses, layer, kv)
    w = dequantize(q, scale, block_sizes(arrays))
    flat = base.astype(np.float32).transpose(0, 2, 1, 3).reshape(b * s, h * d)
    out = affine(flat, _flat(arrays), w, threads)
    return out.reshape(b, s, h, d).transpose(0, 2, 1, 3)


# ---- fitting ---------------------------------------------------------------------------


def folds(tokens: int) -> np.ndarray:
    """int [tokens]: each calibration token's fold, 0..FOLDS-1, in blocks of FOLD_BLOCK
    tokens (neighbouring tokens are alike, so whole blocks)."""
    return (np.arange(tokens) // FOLD_BLOCK) % FOLDS


def fit_conditional(feats: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ridge regression of ``target`` [T, C] on ``feats`` [T, F]: (weights [F, C], float64;
    the out-of-fold prediction of every token [T, C], float32).

    Features are standardized first (residuals and guesses differ in scale by ~20x). The
    penalty, RIDGES[i] times the mean energy of the standardized features (those not zero
    throughout), or no map at all, is the one that codes the last fold best when fitted on
    the others: the smallest sum over channels of log(mean squared error), i.e. of the
    Gaussian code length. So few calibration tokens give a weak map or none, never one
    fitted to noise. The weights are then fitted on every token with that penalty; the
    out-of-fold predictions (each fold predicted by the map fitted without it, with the
    same penalty) give honest residuals for the std and shape: in-sample ones would be
    too narrow.
    """
    with one_thread():
        problem = _Ridge(feats, target)
        return problem.fit(problem.search())


class _Ridge:
    """One group's ridge problem (``fit_conditional``), prepared once.

    Its arithmetic runs on one thread of torch and BLAS (``one_thread``, held by
    ``fit_conditional``). Cost: the products over the tokens run once, in float32 (the Gram
    matrix and cross product of the last fold, which the search holds out, and of the other
    folds, summed in float64); every system is solved by one Cholesky factorization in
    float32 (float64 where rounding made it not positive definite): the weights are rounded
    to int8 anyway. The search factorizes the other folds' system once per penalty tried.
    The final fit factorizes the whole system once: that gives the weights and, through each
    fold's block of the hat matrix (``I - X_k A^-1 X_k^T`` turns the fold's in-sample errors
    into its out-of-fold ones, exactly), every fold's out-of-fold errors without a system of
    the fold's own; where a fold has so many tokens that its own system is cheaper, that is
    solved instead. Features that are zero throughout (a predictor that guesses nothing) get
    weight 0 without entering a system.
    """

    def __init__(self, feats: np.ndarray, target: np.ndarray) -> None:
        f32 = np.asarray(feats, np.float32)
        t32 = np.asarray(target, np.float32)
        self.shapes = f32.shape, t32.shape
        if not (np.isfinite(f32).all() and np.isfinite(t32).all()):
            raise ValueError("calibration values or guesses are not all finite")
        tokens = f32.shape[0]
        fold = folds(tokens)
        self.live = np.flatnonzero(np.any(f32 != 0, axis=0))
        self.ok = np.bincount(fold, minlength=FOLDS).min() >= MIN_FOLD and self.live.size > 0
        if not self.ok:  # too little data to tell a map from noise, or nothing to map
            return
        self.order = np.argsort(fold, kind="stable")  # each fold's tokens contiguous
        cuts = np.concatenate(([0], np.cumsum(np.bincount(fold, minlength=FOLDS))))
        f = f32[np.ix_(self.order, self.live)]
        self.t = t32[self.order]
        mean = f.mean(axis=0, dtype=np.float64)
        dev = f - mean.astype(np.float32)
        sd = np.sqrt(np.einsum("ij,ij->j", dev, dev) / tokens).astype(np.float64)
        del dev
        self.sd = np.where(sd > 0, sd, 1.0)
        f *= (1.0 / self.sd).astype(np.float32)
        self.f = f
        self.rows = [slice(cuts[k], cuts[k + 1]) for k in range(FOLDS)]
        # One product over the other folds' tokens and one over the last fold's: a
        # product over many rows runs faster than one per fold.
        self.rest = _products(f[: cuts[-2]], self.t[: cuts[-2]])
        last = _products(f[cuts[-2] :], self.t[cuts[-2] :])
        self.gram = self.rest[0] + last[0]
        self.cross = self.rest[1] + last[1]
        trace = float(np.trace(self.gram))
        self.ok = trace > 0
        self.unit = trace / f.shape[1]

    def search(self) -> float | None:
        """The best of RIDGES for coding the last fold with the map fitted on the others,
        or None where no map beats none. Tried from the largest down while the score
        falls: it falls and then rises as the penalty falls (too much bias, then too much
        variance), so the first rise ends the search with a full sweep's choice wherever
        the scores have that one minimum, and the small, ill-conditioned penalties are
        tried only where they may win."""
        if not self.ok:
            return None
        g, c = self.rest
        g32 = g.astype(np.float32)  # rounded once for every penalty's system
        f, t = self.f[self.rows[-1]], self.t[self.rows[-1]]
        best, best_score, previous = None, _code(t), np.inf
        for ridge in sorted(RIDGES, reverse=True):
            s = _code(t - f @ _ridge_solve(g, c, ridge * np.trace(g) / len(g), g32))
            if s < best_score:
                best, best_score = ridge, s
            if s >= previous:
                break
            previous = s
        return best

    def fit(self, ridge: float | None) -> tuple[np.ndarray, np.ndarray]:
        """(weights [F, C] float64, out-of-fold predictions [T, C] float32) of the map with
        penalty ``ridge`` (zeros for None)."""
        (tokens, n_feat), (_, outputs) = self.shapes
        weights = np.zeros((n_feat, outputs))
        oof = np.zeros((tokens, outputs), np.float32)
        if ridge is None or not self.ok:
            return weights, oof
        f, t, n = self.f, self.t, len(self.gram)
        penalty = ridge * np.trace(self.gram) / n
        chol = _cholesky(self.gram, penalty)
        w = _cholesky_solve(chol, self.cross)
        err = t - f @ w
        for r in self.rows:
            fk, tk = f[r], r.stop - r.start
            # multiply-adds of the hat block's route against the fold's own system's
            if n * tk * (n + tk) + tk**3 / 3 + 2 * tk * tk * outputs > (
                    n**3 / 3 + 2 * n * n * outputs + tk * n * outputs):
                g, c = _products(fk, t[r])
                err[r] = t[r] - fk @ _ridge_solve(self.gram - g, self.cross - c, penalty)
                continue
            # X_k L^-T, solved from the right on the fold's rows as they lie
            zt = torch.linalg.solve_triangular(chol.T, torch.from_numpy(fk).to(chol.dtype),
                                               upper=True, left=False).numpy()
            keep = -(zt @ zt.T)  # I - X_k A^-1 X_k^T: positive definite (numpy: syrk)
            keep[np.diag_indices_from(keep)] += 1.0
            err[r] = _spd_solve(torch.from_numpy(keep), err[r])
        weights[self.live] = w / self.sd[:, None]
        oof[self.order] = t - err
        return weights, oof


def _products(f: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f^T f, f^T t) of float32 rows, in float64."""
    return (f.T @ f).astype(np.float64), (f.T @ t).astype(np.float64)


def _code(err: np.ndarray) -> float:
    """Gaussian code length of errors [T, C]: sum over channels of log(mean squared error)."""
    sq = np.einsum("ij,ij->j", err, err, dtype=np.float64)
    return float(np.log(sq / len(err) + 1e-30).sum())


def _cholesky(g: np.ndarray, penalty: float, g32: np.ndarray | None = None) -> torch.Tensor:
    """Lower Cholesky factor of g + penalty I (g a Gram matrix: positive definite for
    penalty > 0) in float32, or float64 where rounding made float32's not positive
    definite. ``g32``: g rounded to float32, where the caller has it."""
    a = g.astype(np.float32) if g32 is None else g32.copy()
    # the diagonal summed in float64, then rounded: (g + penalty I) rounded, as a whole
    np.fill_diagonal(a, np.diagonal(g) + penalty)
    chol, info = torch.linalg.cholesky_ex(torch.from_numpy(a))
    if int(info) == 0:
        return chol
    a = g.copy()
    a[np.diag_indices_from(a)] += penalty
    return torch.linalg.cholesky(torch.from_numpy(a))


def _cholesky_solve(chol: torch.Tensor, b: np.ndarray) -> np.ndarray:
    """(L L^T)^-1 b for the lower factor L = ``chol``, float32. As b^T L^-T L^-1: two
    triangular solves from the right on b's transpose, which run faster than from the
    left on b."""
    bt = torch.from_numpy(np.ascontiguousarray(b.T)).to(chol.dtype)
    y = torch.linalg.solve_triangular(chol.T, bt, upper=True, left=False)
    x = torch.linalg.solve_triangular(chol, y, upper=False, left=False)
    return x.T.float().numpy()


def _ridge_solve(g: np.ndarray, c: np.ndarray, penalty: float,
                 g32: np.ndarray | None = None) -> np.ndarray:
    """(g + penalty I)^-1 c, float32 (``g32``: ``_cholesky``'s)."""
    return _cholesky_solve(_cholesky(g, penalty, g32), c)


def _spd_solve(a: torch.Tensor, b: np.ndarray) -> np.ndarray:
    """a^-1 b for a positive definite a (float32; by LU where rounding made it not so)."""
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return _cholesky_solve(chol, b)
    return torch.linalg.solve(a.double(), torch.from_numpy(b).double()).float().numpy()


_PIN = threading.Lock()
# callers inside ``one_thread``; torch's thread count and each BLAS's, to restore
_pinned: list = [0, 0, []]


@functools.cache
def _openblas_threads() -> list[tuple[Any, Any]]:
    """(get, set) of the thread count of every OpenBLAS loaded in this process (numpy's
    products run on one; torch's ``set_num_threads`` does not reach it): found by file
    name among the loaded libraries (Linux), else among numpy's bundled ones (which numpy
    has loaded); none elsewhere."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps
                     if "openblas" in line.lower() and len(line.split(None, 5)) == 6}
    except OSError:  # not Linux: numpy's wheels bundle their OpenBLAS beside the package
        here = Path(np.__file__).resolve().parent
        for folder in (here.parent / "numpy.libs", here / ".dylibs"):
            if folder.is_dir():
                paths |= {str(p) for p in folder.iterdir() if "openblas" in p.name.lower()}
    names = [(f"{prefix}_get_num_threads{suffix}", f"{prefix}_set_num_threads{suffix}")
             for prefix in ("scipy_openblas", "openblas") for suffix in ("64_", "")]
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for get_name, set_name in names:
            if hasattr(lib, get_name) and hasattr(lib, set_name):
                get, put = getattr(lib, get_name), getattr(lib, set_name)
                get.restype, get.argtypes = ctypes.c_int, []
                put.restype, put.argtypes = None, [ctypes.c_int]
                found.append((get, put))
                break
    return found


def blas_threads() -> list[int]:
    """The thread count of each OpenBLAS ``one_thread`` pins (empty where none is found)."""
    return [get() for get, _ in _openblas_threads()]


@contextmanager
def one_thread() -> Iterator[None]:
    """torch and numpy's BLAS (OpenBLAS, where found) on one thread from the first
    caller's entry to the last caller's exit (torch's count is set in the first caller's
    thread; threads started inside inherit it): the fit's rounding depends on their
    thread counts, and fits that run side by side would each start every core's threads."""
    with _PIN:
        if _pinned[0] == 0:
            _pinned[1] = torch.get_num_threads()
            _pinned[2] = [(get(), put) for get, put in _openblas_threads()]
            torch.set_num_threads(1)
            for _, put in _pinned[2]:
                put(1)
        _pinned[0] += 1
    try:
        yield
    finally:
        with _PIN:
            _pinned[0] -= 1
            if _pinned[0] == 0:
                torch.set_num_threads(_pinned[1])
                for count, put in _pinned[2]:
                    put(count)


def fit_shape(z: np.ndarray) -> np.ndarray:
    """A shape table from standardized residuals ``z``: their histogram on the coder's z
    grid, smoothed over +-4 bins and mixed with 0.1% of N(0, 4^2) so no region is empty."""
    # np.histogram on the grid's edges, by index: the grid is uniform with dyadic edges,
    # so (z - first edge) * steps is exact and floor finds z's bin (the last edge joins
    # the last bin, as in np.histogram).
    edges = dist.z_grid()
    steps = 1 << dist._k.Z_GRID_BITS
    zc = np.clip(np.asarray(z, np.float64), edges[0], edges[-1])
    index = np.minimum(np.floor((zc - edges[0]) * steps).astype(np.int64), dist.Z_POINTS - 1)
    hist = np.bincount(index, minlength=dist.Z_POINTS).astype(np.float64)
    smooth = np.convolve(hist, np.ones(9) / 9, mode="same")
    smooth /= max(smooth.sum(), 1.0)
    wide = np.diff(dist.gaussian_shape((4.0,), (1.0,)).astype(np.float64)) / dist.ONE
    return dist.shape_from_masses(0.999 * smooth + 0.001 * wide)
