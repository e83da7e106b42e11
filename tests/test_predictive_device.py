"""compress_kv / decompress_kv on the cache's device: (mu, sigma) in torch, bit for bit the
numpy reference's, and the device path's blobs byte for byte the host path's.

The GPU coder itself is checked on a GPU (gpu/tests/test_cuda_kv*.py); here
the device path runs on the CPU with the CPU coder standing in for it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_predictive import CACHE, CALS, IDS, LAYERS, PREDICTORS

from entropykit import predictive as P
from entropykit.gpu import dist as gpu_dist
from entropykit.predictive import _torchdist as T
from entropykit.predictive import codec as C
from entropykit.rans import distribution as D


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


def check_torch_is_numpy(cache, ids, predictor, cal, kind) -> None:
    """``_torchdist.group_distribution`` on the CPU gives ``codec.group_distribution``'s
    bits for every group of ``cache`` (any layout), residuals chained as the codec does."""
    guess = predictor.predict(ids)
    shapes = cache.shapes
    ref_guess = C.guess_arrays(guess, shapes)
    dev_guess = T.guess_tensors(guess, shapes, "cpu")
    dcal = T.DeviceCalibration(cal, "cpu")
    ref_res, dev_res = {}, {}
    for g, shape in enumerate(shapes):
        if shape is None:
            continue
        layer, kv = divmod(g, 2)
        want = C.group_distribution(layer, kv, ref_guess, shape, predictor.exact_layers,
                                    kind, cal, cache.scales, ref_res)
        scale = None if cache.scales is None else cache.scales[layer, kv]
        got = T.group_distribution(layer, kv, dev_guess, shape, predictor.exact_layers,
                                   kind, dcal, scale, dev_res)
        assert got[2] == want[2]
        assert got[0].dtype == got[1].dtype == torch.float32
        assert np.array_equal(_bits(got[0]), _bits(want[0])), (layer, kv)
        assert np.array_equal(_bits(got[1]), _bits(want[1])), (layer, kv)
        assert np.array_equal(_bits(got[3]), _bits(np.broadcast_to(want[3], shape)))
        real = cache.real(layer, kv)
        ref_res[(layer, kv)] = real.numpy() - want[3]
        dev_res[(layer, kv)] = real - got[3]


CALLS = {"encode": 0, "decode": 0}


def _cpu_encode(values, mu, sigma, model, *, fmt, model_index, chunk_size):
    CALLS["encode"] += 1
    assert mu.dtype == sigma.dtype == torch.float32  # the device path's torch tensors
    bits = values.contiguous().view(torch.uint8).numpy().view(D.FORMATS[fmt].storage)
    return torch.from_numpy(np.frombuffer(
        D.encode(bits.reshape(-1), mu.numpy(), sigma.numpy(), model, fmt=fmt,
                 model_index=model_index, chunk_size=chunk_size), np.uint8).copy())


def _cpu_decode_async(frame, mu, sigma, model, *, model_index, device):
    CALLS["decode"] += 1
    assert mu.dtype == sigma.dtype == torch.float32
    assert isinstance(frame, torch.Tensor) and frame.dtype == torch.uint8  # a host slice
    out = D.decode(frame.numpy(), mu.numpy(), sigma.numpy(), model, model_index=model_index)
    out = torch.from_numpy(out.view(np.int16) if out.dtype == np.uint16 else out).to(device)
    return SimpleNamespace(out=out, result=lambda: out)


@pytest.fixture
def device_path(monkeypatch):
    """compress_kv / decompress_kv take their device path on the CPU, the CPU coder
    standing in for the GPU's (same signature, same frames)."""
    monkeypatch.setattr(T, "on_gpu", lambda coder, device: coder != "cpu")
    monkeypatch.setattr(gpu_dist, "encode", _cpu_encode)
    monkeypatch.setattr(gpu_dist, "decode_async", _cpu_decode_async)


@pytest.mark.parametrize("pred", sorted(PREDICTORS))
@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_device_path_writes_the_host_blob(device_path, pred, kind, fp8):
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
