"""Calibration: the ridge fit, progress reporting, the file's size formula and caps."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import torch
import transformers  # noqa: F401 - the kv extra; .ci/run installs it

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.container.progress import Bar
from entropykit.predictive import calibration, residual
from entropykit.warmup import tiny_llama

MODEL = tiny_llama(layers=2, hidden=32, heads=2, kv_heads=2, vocab=64, positions=128)
GEN = torch.Generator().manual_seed(4)
PROMPTS = [torch.randint(0, 64, (80,), generator=GEN) for _ in range(4)]


def test_zero_features_get_zero_weight_and_the_fit_is_repeatable():
    rng = np.random.default_rng(7)
    feats = rng.standard_normal((640, 30)).astype(np.float32)
    feats[:, 10:20] = 0  # a predictor that guesses nothing: its features are all zero
    target = (feats @ rng.standard_normal((30, 4)) + 0.1 * rng.standard_normal((640, 4))
              ).astype(np.float32)
    w, oof = residual.fit_conditional(feats, target)
    assert not w[10:20].any() and w[:10].any() and w[20:].any()
    w2, oof2 = residual.fit_conditional(feats, target)
    assert w.tobytes() == w2.tobytes() and oof.tobytes() == oof2.tobytes()
    assert oof.dtype == np.float32 and np.abs(target - oof).std() < 0.15


def test_calibration_bytes_are_deterministic_and_file_bytes_is_their_size(tmp_path):
    a = P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False)
    b = P.calibrate(MODEL, P.FP8Predictor(MODEL), PROMPTS, progress=False)
    assert a.fingerprint == b.fingerprint
    assert a.version == 2
    assert sum(x.nbytes for x in a.arrays.values()) == calibration.file_bytes(
        a.dims, len(a.formats))
    a.save(tmp_path / "c.safetensors")
    assert P.Calibration.load(tmp_path / "c.safetensors").fingerprint == a.fingerprint


def test_progress_reports_every_step():
    seen = []
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS, ("bf16",),
                progress=lambda d, t: seen.append((d, t)))
    total = len(PROMPTS) + 2 * 2  # prompts, then one (layer, k/v) fit each
    assert seen == [(i, total) for i in range(1, total + 1)]


def test_progress_line_only_where_asked(capsys):
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS[:1], ("bf16",))  # stderr is not a terminal
    assert capsys.readouterr().err == ""
    P.calibrate(MODEL, P.NoPredictor(), PROMPTS[:1], ("bf16",), progress=True)
    err = capsys.readouterr().err
    assert "calibrate  100%  5/5 steps" in err and err.endswith("\n")


def test_bar_counts_steps():
    bar = Bar("fit", stream=io.StringIO(), unit="steps", scale=1)
    bar._first = (0.0, 1)
    assert bar.line(3, 10, 1.0) == "fit   30%  3/10 steps  2.0 steps/s  ETA 0:04"


def test_calibrate_refuses_a_file_over_the_cap(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_BYTES", 1000)
    seen = []
    with pytest.raises(ValueError, match="tensor bytes, more than the format's 1000"):
        P.calibrate(MODEL, P.NoPredictor(), PROMPTS, progress=lambda d, t: seen.append(d))
    assert seen == []  # refused after the first prompt's forward pass, before any step


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    meta = {"entropykit_kv_calibration": json.dumps(
        {"version": 1, "predictor": "none", "tokens": 0})}
    header, data, off = {"__metadata__": meta}, b"", 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        data += a.tobytes()
        off += a.nbytes
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_load_refuses_a_shape_over_the_channel_cap(tmp_path):
    # kv heads * head dim above 2**12: refused from the header, whatever else is missing.
    big = np.zeros((1, 2, 1, calibration.MAX_CHANNELS + 1), np.float32)
    path = tmp_path / "big.safetensors"
    path.write_bytes(_safetensors({"bias": big, "std": big}))
    with pytest.raises(CorruptDataError, match="kv heads \\* head dim, more than"):
        P.Calibration.load(path)
    ok = np.zeros((1, 2, 1, calibration.MAX_CHANNELS), np.float32)
    path.write_bytes(_safetensors({"bias": ok, "std": ok}))
    assert P.Calibration.load(path).arrays["bias"].shape == ok.shape


def test_load_checks_the_caps_on_a_version_2_layout(tmp_path, monkeypatch):
    cal = P.calibrate(MODEL, P.NoPredictor(), PROMPTS, ("bf16",), progress=False)
    path = tmp_path / "c.safetensors"
    cal.save(path)
    size = calibration.file_bytes(cal.dims, 1)
    monkeypatch.setattr(calibration, "MAX_BYTES", size - 1)
    with pytest.raises(CorruptDataError, match=f"{size} tensor bytes, more than"):
        P.Calibration.load(path)
    monkeypatch.setattr(calibration, "MAX_BYTES", size)
    assert P.Calibration.load(path).fingerprint == cal.fingerprint
    # One group of 2 heads of 2**12 in the layout: over the channel cap, refused from the
    # layout before the other tensors (not of its sizes) are compared or read.
    layout = cal.arrays["layout"].copy()
    layout[0, 0] = (2, calibration.MAX_CHANNELS)
    P.Calibration(cal.predictor, dict(cal.arrays, layout=layout), cal.tokens).save(path)
    with pytest.raises(CorruptDataError, match="8192 kv heads \\* head dim, more than"):
        P.Calibration.load(path)


def test_calibrate_refuses_a_group_over_the_channel_cap(monkeypatch):
    monkeypatch.setattr(calibration, "MAX_CHANNELS", 31)  # MODEL's groups: 2 heads of 16
    with pytest.raises(ValueError, match="32 kv heads \\* head dim, more than"):
        P.calibrate(MODEL, P.NoPredictor(), PROMPTS, progress=False)
