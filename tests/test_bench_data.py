"""Offline tests of bench/data.py: format casts of a tiny safetensors file, the cache
directory override, and the prose splits. Nothing here downloads anything."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file as load_torch
from safetensors.torch import save_file

_SPEC = importlib.util.spec_from_file_location(
    "bench_data", Path(__file__).resolve().parent.parent / "bench" / "data.py"
)
data = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(data)

_SPECIAL_F32 = np.array(
    [0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 1e-40, 3.4e38, -3.4e38, 1.0, -1.0,
     1.00390625, 1.0039062, 1.0117188, 0.1, -2.5e-3],
    np.float32,
)
_NAN_PAYLOADS = np.array([0x7FC00000, 0x7F800001, 0xFFC12345, 0x7FFFFFFF], np.uint32)


def _tiny_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A small safetensors file with awkward floats, non-float tensors and metadata."""
    rng = np.random.default_rng(7)
    tensors = {
        "z.weight": torch.from_numpy(rng.normal(0, 0.05, (33, 17)).astype(np.float32)),
        "a.special": torch.from_numpy(_SPECIAL_F32.copy()),
        "m.nan": torch.from_numpy(_NAN_PAYLOADS.view(np.float32).copy()),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([1, 0, 1], dtype=torch.uint8),
        "half": torch.from_numpy(rng.normal(0, 1, 9).astype(np.float16)),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
    }
    save_file(tensors, str(path), metadata={"format": "pt", "note": "tiny"})
    return tensors


def _header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    return json.loads(raw[8 : 8 + n])


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    src = tmp_path / "tiny.safetensors"
    return src, _tiny_checkpoint(src)


@pytest.mark.parametrize("fmt", ["BF16", "F16", "F32"])
def test_plain_cast_is_torch_cast_bit_for_bit(tiny, tmp_path, fmt):
    src, tensors = tiny
    out = data.cast_file(src, tmp_path / "out.safetensors", fmt)
    target = getattr(torch, data.CAST_FORMATS[fmt])
    got = load_numpy(str(out))  # read back through a different path than the writer's
    assert set(_header(out)) == set(_header(src))  # same names
    for name, t in tensors.items():
        if t.is_floating_point():
            want = t.to(target).contiguous().view(torch.uint8).numpy()
            assert _header(out)[name]["dtype"] == fmt
        else:
            want = t.contiguous().view(torch.uint8).numpy()
            assert _header(out)[name]["dtype"] == _header(src)[name]["dtype"]
        assert got[name].shape == tuple(t.shape)
        assert got[name].reshape(-1).view(np.uint8).tobytes() == want.tobytes(), name


def test_bf16_cast_matches_ml_dtypes_rounding(tiny, tmp_path):
    """An independent implementation agrees on round-to-nearest-even (NaNs aside)."""
    src, tensors = tiny
    got = load_numpy(str(data.cast_file(src, tmp_path / "b.safetensors", "BF16")))
    for name in ("z.weight", "a.special"):
        want = tensors[name].numpy().astype(ml_dtypes.bfloat16)
        assert got[name].view(np.uint16).tobytes() == want.view(np.uint16).tobytes()
    assert np.isnan(got["m.nan"].astype(np.float32)).all()


def test_metadata_kept(tiny, tmp_path):
    src, _ = tiny
    out = data.cast_file(src, tmp_path / "o.safetensors", "F16")
    assert _header(out)["__metadata__"] == {"format": "pt", "note": "tiny"}


@pytest.mark.parametrize("fmt", ["F8_E4M3", "F8_E5M2"])
def test_fp8_cast_is_scaled_per_tensor(tiny, tmp_path, fmt):
    src, tensors = tiny
    out = data.cast_file(src, tmp_path / "f8.safetensors", fmt)
    target = getattr(torch, data.CAST_FORMATS[fmt])
    header = _header(out)
    scales = json.loads(header["__metadata__"][data.FP8_SCALES_KEY])
    assert header["__metadata__"]["note"] == "tiny"
    assert set(scales) == {n for n, t in tensors.items() if t.is_floating_point()}
    got = load_torch(str(out))  # safetensors.numpy has no fp8
    w = tensors["z.weight"]
    assert scales["z.weight"] == pytest.approx(float(w.abs().max()) / torch.finfo(target).max)
    want = (w / torch.tensor(scales["z.weight"], dtype=torch.float32)).to(target)
    assert torch.equal(got["z.weight"].view(torch.uint8), want.view(torch.uint8))
    # The largest magnitude lands on the format's largest finite value, never on NaN/inf.
    deq = got["z.weight"].float().numpy()
    assert np.isfinite(deq).all()
    assert np.abs(deq).max() == torch.finfo(target).max
    np.testing.assert_allclose(deq * scales["z.weight"], w.numpy(), rtol=0.13, atol=1e-6)
    assert header["ids"]["dtype"] == "I64" and got["ids"].tolist() == list(range(11))
    # Non-finite values stay out of the scale: the finite ones still use the full range.
    special = tensors["a.special"]
    finite_max = float(special[torch.isfinite(special)].abs().max())
    assert scales["a.special"] == pytest.approx(finite_max / torch.finfo(target).max)
    assert header["empty"]["dtype"] == fmt and got["empty"].shape == (0, 4)


def test_unknown_format_rejected(tiny, tmp_path):
    src, _ = tiny
    with pytest.raises(ValueError, match="unknown format 'F4'"):
        data.cast_file(src, tmp_path / "x.safetensors", "F4")
    assert not (tmp_path / "x.safetensors").exists()


def test_cached_cast_is_written_once(tiny, tmp_path, monkeypatch):
    src, _ = tiny
    monkeypatch.setenv(data.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(data, "minilm_path", lambda: src)
    assert data.minilm_cast_path("F32") == src
    first = data.minilm_cast_path("F8_E4M3")
    assert first.parent.parent == tmp_path / "cache" and first.is_file()
    stamp = first.stat().st_mtime_ns
    assert data.minilm_cast_path("F8_E4M3") == first
    assert first.stat().st_mtime_ns == stamp
    assert not list(first.parent.glob("*.part"))
    with pytest.raises(ValueError, match="unknown format"):
        data.minilm_cast_path("bf16")


def test_cache_dir_env_override(tmp_path, monkeypatch):
    target = tmp_path / "nested" / "cache"
    monkeypatch.setenv(data.CACHE_ENV, str(target))
    assert data.cache_dir() == target and target.is_dir()


def test_prose_splits_partition_the_documents():
    docs = data.prose_documents()
    names = [name for name, _ in docs]
    assert len(set(names)) == len(names) >= 50
    calib = data.prose_documents("calib")
    evaluation = data.prose_documents("eval")
    assert {n for n, _ in calib}.isdisjoint(n for n, _ in evaluation)
    assert sorted(calib + evaluation) == sorted(docs)
    assert len(calib) < len(evaluation) and calib
    text = data.prose_text("calib")
    assert text == "\n\n".join(t for _, t in calib) and len(text) > 50_000
    for bad in ("train", ""):
        with pytest.raises(ValueError, match="split must be"):
            data.prose_text(bad)
