"""safe_open / get_slice on compressed files, and load_file on a checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch

import entropykit
from entropykit.container import files


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "bf16": (rng.standard_normal((37, 24)) * 0.05).astype(ml_dtypes.bfloat16),
        "f32": rng.standard_normal((11, 3, 9)).astype(np.float32),
        "f16": rng.standard_normal(301).astype(np.float16),
        "i64": rng.integers(-5, 5, (13, 7)).astype(np.int64),
        "fp8": rng.standard_normal((16, 16)).astype(ml_dtypes.float8_e4m3fn),
        "scalar": np.array(3.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def _np(t: np.ndarray | torch.Tensor, dtype: np.dtype) -> np.ndarray:
    """A torch result as numpy (bit for bit; torch has no numpy view of BF16 / FP8)."""
    if isinstance(t, np.ndarray):
        return t
    flat = t.reshape(-1).contiguous().view(torch.uint8).numpy()
    return flat.view(dtype).reshape(tuple(t.shape))


def _write(tmp_path: Path, tensors: dict[str, np.ndarray], name: str = "m") -> tuple[Path, Path]:
    plain = tmp_path / f"{name}.safetensors"
    entropykit.save_file(tensors, tmp_path / "tmp.ek.safetensors", {"format": "pt"})
    entropykit.decompress_file(tmp_path / "tmp.ek.safetensors", plain)
    ek = tmp_path / f"{name}.ek.safetensors"
    # 64-byte segments: every tensor above spans several, so slices cross their bounds
    files.compress_file(plain, ek, segment_bytes=64)
    return plain, ek


KEYS = [(), (...,), 0, -1, slice(2, 9), slice(None, None, 3), slice(9, 2, -2),
        (slice(1, 4), 2), (..., 1), (5, slice(2, 6)), (slice(3, 3),), (slice(-5, None), ...)]


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_get_slice_matches_numpy(tmp_path: Path, framework: str) -> None:
    tensors = _tensors()
    _, ek = _write(tmp_path, tensors)
    with entropykit.safe_open(ek, framework=framework) as f:
        assert sorted(f.keys()) == sorted(tensors)
        assert f.metadata() == {"format": "pt"}
        for name, want in tensors.items():
            got = _np(f.get_tensor(name), want.dtype)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert got.tobytes() == want.tobytes()
            s = f.get_slice(name)
            assert s.get_shape() == list(want.shape)
            for key in KEYS if want.ndim else [(), ...]:
                try:
                    ref = np.asarray(want[key])
                except IndexError:
                    with pytest.raises(IndexError):
                        s[key]
                    continue
                out = _np(s[key], ref.dtype)
                assert out.shape == ref.shape and out.tobytes() == ref.tobytes(), (name, key)


def test_slice_decodes_only_covering_segments(tmp_path: Path) -> None:
    """A one-row slice of a 37-row BF16 tensor decodes the segment(s) of that row only."""
    _, ek = _write(tmp_path, _tensors())
    with entropykit.safe_open(ek, framework="np") as f:
        c = f._open()
        calls = []
        span = c.span
        c.span = lambda *a: calls.append(a[1:3]) or span(*a)
        f.get_slice("bf16")[20]
        (lo, hi), = calls
        assert (lo, hi) == (20 * 48, 21 * 48)
        start, raw = span("bf16", lo, hi)
        assert start <= lo and start + raw.size >= hi and raw.size <= 2 * 64


def test_plain_file_is_delegated(tmp_path: Path) -> None:
    plain, _ = _write(tmp_path, _tensors())
    with entropykit.safe_open(plain, framework="np") as f:
        assert f.get_tensor("f32").tobytes() == _tensors()["f32"].tobytes()


def test_closed_file_refuses(tmp_path: Path) -> None:
    from entropykit.lazy import parsed

    _, ek = _write(tmp_path, _tensors())
    with entropykit.safe_open(ek, framework="np") as f:
        c = parsed(f)  # the parse the Hugging Face quantizer decodes batches from
        assert c.keys() == f.keys() and c.tensor("f32").tobytes() == \
            _tensors()["f32"].tobytes()
    with pytest.raises(ValueError, match="closed"):
        f.get_tensor("f32")
    with pytest.raises(ValueError, match="closed"):
        parsed(f)


def test_bad_framework(tmp_path: Path) -> None:
    _, ek = _write(tmp_path, _tensors())
    with pytest.raises(ValueError, match="framework"):
        entropykit.safe_open(ek, framework="tf")


def _dir(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path / "ckpt"
    d.mkdir()
    a = {"a.w": torch.randn(8, 4), "a.b": torch.randn(4)}
    b = {"b.w": torch.randn(3, 5).to(torch.bfloat16)}
    safetensors.torch.save_file(a, d / "model-00001-of-00002.safetensors")
    safetensors.torch.save_file(b, d / "model-00002-of-00002.safetensors")
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return d, {**a, **b}


def test_load_file_directory(tmp_path: Path) -> None:
    d, want = _dir(tmp_path)
    ek = tmp_path / "ckpt.ek"
    entropykit.compress_file(d, ek)
    for src in (d, ek):
        got = entropykit.load_file(src)
        assert set(got) == set(want)
        for k, v in want.items():
            assert torch.equal(got[k], v) and got[k].dtype == v.dtype


def test_load_file_directory_without_index(tmp_path: Path) -> None:
    d, want = _dir(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    assert set(entropykit.load_file(d)) == set(want)


def test_load_file_directory_index_mismatch(tmp_path: Path) -> None:
    d, _ = _dir(tmp_path)
    idx = d / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    obj["weight_map"]["a.w"] = "model-00002-of-00002.safetensors"
    idx.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match="does not hold"):
        entropykit.load_file(d)


def test_load_file_directory_duplicate(tmp_path: Path) -> None:
    d, _ = _dir(tmp_path)
    (d / "model.safetensors.index.json").unlink()
    safetensors.torch.save_file({"a.w": torch.zeros(1)}, d / "extra.safetensors")
    with pytest.raises(ValueError, match="in both"):
        entropykit.load_file(d)


def test_outer_format_refuses_plain_loaders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """The compressed file's own format is "entropykit"; the original's comes back on
    restore and from safe_open; a file with the input's format kept (older writers)
    reads the same."""
    from safetensors import safe_open as plain_open

    from entropykit.container import writer

    plain, ek = _write(tmp_path, _tensors())
    with plain_open(ek, "np") as f:
        assert f.metadata()["format"] == "entropykit"
    with entropykit.safe_open(ek, framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    entropykit.decompress_file(ek, tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == plain.read_bytes()
    monkeypatch.setattr(writer, "FORMAT", "pt")
    old = tmp_path / "old.ek.safetensors"
    files.compress_file(plain, old, segment_bytes=64)
    with plain_open(old, "np") as f:
        assert f.metadata()["format"] == "pt"
    with entropykit.safe_open(old, framework="np") as f:
        assert f.get_slice("bf16")[3:5].tobytes() == _tensors()["bf16"][3:5].tobytes()
    entropykit.decompress_file(old, tmp_path / "back2.safetensors")
    assert (tmp_path / "back2.safetensors").read_bytes() == plain.read_bytes()


def test_a_compressed_file_is_opened_and_its_header_parsed_once(tmp_path: Path,
                                                                monkeypatch) -> None:
    """``safe_open`` of a compressed file (as the Hugging Face quantizer opens each shard)
    opens it once and parses its header once; a plain one is handed to safetensors."""
    from entropykit.container import header as hdr

    src, ek = _write(tmp_path, _tensors())
    parsed, opened = [], []
    real_parse, real_open = hdr.parse_read, files.opened
    monkeypatch.setattr(hdr, "parse_read", lambda *a: parsed.append(1) or real_parse(*a))
    monkeypatch.setattr(files, "opened", lambda p: opened.append(p) or real_open(p))
    with entropykit.safe_open(ek, framework="np") as f:
        assert f.keys() and (len(parsed), opened) == (1, [ek])
        got = {k: f.get_tensor(k).tobytes() for k in f.keys()}
    assert got == {k: v.reshape(-1).view(torch.uint8).numpy().tobytes()
                   for k, v in safetensors.torch.load_file(src).items()}
    with entropykit.safe_open(src, framework="np") as f:
        assert type(f) is type(safetensors.safe_open(src, framework="np"))
