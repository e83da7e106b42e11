"""compress_kv / decompress_kv on the cache's device: (mu, sigma) in torch, bit for bit the
numpy reference's, and the device path's blobs byte for byte the host path's.

The GPU coder itself is checked on a GPU (gpu/tests/test_cuda_kv*.py); here
the device path runs on the CPU with the CPU coder standing in for it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _kvcheck import CALLS, check_torch_is_numpy, device_path  # noqa: F401 - a fixture
from test_predictive import CACHE, CALS, IDS, LAYERS, PREDICTORS

from entropykit import predictive as P


class _Fixed(P.Predictor):
    """A given guess: adversarial means (±0, subnormals, large, bf16-inexact)."""

    def __init__(self, name: str, exact: int = 0) -> None:
        self.name, self.exact_layers = name, exact
        gen = torch.Generator().manual_seed(7)
        self.guess = []
        for _ in range(LAYERS):
            pair = []
            for _ in range(2):
                g = torch.randn(CACHE.shapes[0], generator=gen) * 2.0
                g.view(-1)[:9] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 1e30, -1e30, 65504.0,
                                               2.0**-126, 1.0 + 2.0**-20])
                pair.append(g)
            self.guess.append(tuple(pair))

    def predict(self, input_ids):
        return self.guess


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("pred", [*sorted(PREDICTORS), "adversarial"])
@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_torch_distribution_is_numpy(pred, kind, fp8):
    """Every group in coding order, residuals chained: mu, sigma, index and base equal."""
    cache = P.to_fp8(CACHE) if fp8 else CACHE
    if pred == "adversarial":
        predictor, cal = _Fixed(CALS["fp8"].predictor, exact=1), CALS["fp8"]
    else:
        predictor, cal = PREDICTORS[pred], CALS[pred]
    check_torch_is_numpy(cache, IDS, predictor, cal, kind)


@pytest.mark.parametrize("pred", sorted(PREDICTORS))
@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_device_path_writes_the_host_blob(device_path, pred, kind, fp8):  # noqa: F811
    cache = P.to_fp8(CACHE) if fp8 else CACHE
    predictor, cal = PREDICTORS[pred], CALS[pred]
    host = P.compress_kv(cache, IDS, predictor, cal, model=kind, coder="cpu")
    calls = dict(CALLS)
    dev = P.compress_kv(cache, IDS, predictor, cal, model=kind, coder="gpu")
    assert dev == host
    out = P.decompress_kv(host, predictor, cal, coder="gpu")
    groups = 2 * len(cache.keys)
    assert CALLS == {"encode": calls["encode"] + groups, "decode": calls["decode"] + groups}
    assert out.equal(cache)
    assert out.dtype == cache.dtype and out.shapes == cache.shapes


def test_coder_argument():
    with pytest.raises(ValueError, match="coder must be one of"):
        P.compress_kv(CACHE, IDS, PREDICTORS["none"], CALS["none"], coder="tpu")
    with pytest.raises(ValueError, match="needs tensors on a CUDA device, not cpu"):
        P.compress_kv(CACHE, IDS, PREDICTORS["none"], CALS["none"], coder="gpu")
    blob = P.compress_kv(CACHE, IDS, PREDICTORS["none"], CALS["none"], coder="auto")
    with pytest.raises(ValueError, match="needs tensors on a CUDA device, not cpu"):
        P.decompress_kv(blob, PREDICTORS["none"], CALS["none"], coder="gpu")
    assert P.decompress_kv(blob, PREDICTORS["none"], CALS["none"], coder="cpu").equal(CACHE)


@pytest.mark.parametrize("rows", [0, 1, 63, 64, 65, 200, 1031])
def test_affine_is_one_order_on_any_threads(rows):
    """_linear.affine: each output summed over the features in index order, products and
    sums rounded one by one (a float32 reference loop), whatever the thread count."""
    from entropykit.predictive._linear import affine

    gen = np.random.default_rng(rows)
    base = gen.standard_normal((rows, 5)).astype(np.float32)
    feats = (gen.standard_normal((rows, 7)) * 10.0 ** gen.integers(-3, 4, (rows, 7))
             ).astype(np.float32)
    if rows:
        feats[0, :3] = [np.float32(1e-40), -0.0, np.float32(1e30)]  # subnormal, -0, large
    w = gen.standard_normal((7, 5)).astype(np.float32)
    want, base0 = base.copy(), base.copy()
    for f in range(7):  # numpy float32: one rounding per product, one per sum
        want += feats[:, f : f + 1] * w[f]
    for threads in (1, 2, 3, 8):
        got = affine(base, feats, w, threads)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), threads
        assert got.shape == (rows, 5) and got.dtype == np.float32
    assert np.array_equal(base, base0)  # base is not written
