"""Checks the KV tests share: the torch (device) distribution against the numpy one, and
the device path of compress_kv / decompress_kv run on the CPU (the CPU coder standing in
for the GPU's, same signature, same frames)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from entropykit.predictive import _torchdist as T
from entropykit.predictive import codec as C
from entropykit.rans import distribution as D
from entropykit.rans.cuda import dist as gpu_dist
from entropykit.rans.cuda import encode as gpu_encode


def _bits(a) -> np.ndarray:
    a = a.numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


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
    standing in for the GPU's per-value coder (same signature, same frames) and the
    static GPU encoder running its host half with its kernels emulated."""
    from test_gpu_encode_logic import _Emulator

    encode = gpu_encode.encode
    monkeypatch.setattr(T, "on_gpu", lambda coder, device: coder != "cpu")
    monkeypatch.setattr(gpu_dist, "encode", _cpu_encode)
    monkeypatch.setattr(gpu_dist, "decode_async", _cpu_decode_async)
    monkeypatch.setattr(gpu_encode, "encode", lambda *a, **k: encode(*a, **k, run=_Emulator()))


