"""The public API: compress/decompress of arrays, tensors and bytes; save_file and
load_file against safetensors' own; compress_file/decompress_file with progress."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
from test_container import adversarial, all_dtypes

import entropykit as ek


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.contiguous().reshape(-1).view(torch.uint8).tolist() == \
        b.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("name", sorted(all_dtypes()))
def test_torch_roundtrip(name: str) -> None:
    t = all_dtypes()[name]
    back = ek.decompress(ek.compress(t))
    assert isinstance(back, torch.Tensor)
    _same_tensor(back, t)


def test_torch_noncontiguous_and_grad() -> None:
    t = torch.randn(8, 6, requires_grad=True)
    _same_tensor(ek.decompress(ek.compress(t.T)), t.detach().T.contiguous())


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16,
                                   ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
                                   ml_dtypes.float8_e8m0fnu, np.int8, np.uint8, np.int16,
                                   np.uint16, np.int32, np.uint32, np.int64, np.uint64,
                                   np.bool_])
def test_numpy_roundtrip(dtype: type) -> None:
    rng = np.random.default_rng(0)
    size = np.dtype(dtype).itemsize
    a = rng.integers(0, 256, 1000 * size, dtype=np.uint8).view(dtype).reshape(10, -1, 2)
    if dtype is np.bool_:
        a = a.view(np.uint8) % 2 == 1
    back = ek.decompress(ek.compress(a))
    assert isinstance(back, np.ndarray) and back.dtype == a.dtype and back.shape == a.shape
    assert back.tobytes() == a.tobytes()


def test_numpy_edge_shapes_and_byte_order() -> None:
    for a in [np.zeros((0, 3), np.float32), np.array(7, np.int64), np.float32([1, 2, 3])[::2],
              np.arange(5, dtype=">i4")]:
        back = ek.decompress(ek.compress(a))
        assert back.shape == a.shape and np.array_equal(back, a)
        assert back.dtype == a.dtype.newbyteorder("<")


@pytest.mark.parametrize("data", [b"", b"x", bytes(range(256)) * 300, bytearray(b"abc" * 999),
                                  memoryview(b"0123456789" * 10)])
def test_bytes_roundtrip(data: bytes) -> None:
    back = ek.decompress(ek.compress(data))
    assert type(back) is bytes and back == bytes(data)


def test_compress_rejects_what_has_no_safetensors_dtype() -> None:
    for bad in [np.zeros(3, np.complex128), torch.zeros(2, dtype=torch.complex64), [1, 2],
                "text", np.array(["a"])]:
        with pytest.raises(TypeError):
            ek.compress(bad)


def test_decompress_rejects_garbage_and_files() -> None:
    with pytest.raises(ek.CorruptDataError):
        ek.decompress(b"not a blob")
    blob = ek.compress(np.arange(100))
    with pytest.raises(ek.CorruptDataError):
        ek.decompress(blob[:-3])
    other = safetensors.torch.save({"a": torch.zeros(2)})
    with pytest.raises(ValueError, match="not an entropykit-compressed file"):
        ek.decompress(other)


def test_compression_helps_real_values() -> None:
    w = (torch.randn(256, 256) * 0.02).to(torch.bfloat16)
    assert len(ek.compress(w)) < 0.7 * w.numel() * 2


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"b": "1", "a": "\u00e9\n"}])
def test_save_file_decompresses_to_what_safetensors_writes(tmp_path: Path,
                                                           metadata: dict | None) -> None:
    tensors = all_dtypes()
    ek.save_file(tensors, tmp_path / "c.safetensors", metadata=metadata)
    safetensors.torch.save_file(tensors, tmp_path / "ref.safetensors", metadata=metadata)
    ek.decompress_file(tmp_path / "c.safetensors", tmp_path / "back.safetensors")
    got = (tmp_path / "back.safetensors").read_bytes()
    want = (tmp_path / "ref.safetensors").read_bytes()
    if metadata is None or len(metadata) < 2:
        assert got == want
    else:  # safetensors orders metadata keys by a randomly seeded hash: compare as JSON
        n = int.from_bytes(want[:8], "little")
        assert got[:8] == want[:8] and got[8 + n :] == want[8 + n :]
        assert json.loads(got[8 : 8 + n]) == json.loads(want[8 : 8 + n])
        assert list(json.loads(got[8 : 8 + n])["__metadata__"]) == list(metadata)


def test_load_file_matches_safetensors(tmp_path: Path) -> None:
    tensors = all_dtypes()
    ref = tmp_path / "ref.safetensors"
    safetensors.torch.save_file(tensors, ref)
    ek.compress_file(ref, tmp_path / "c.safetensors")
    want = safetensors.torch.load_file(ref)
    got = ek.load_file(tmp_path / "c.safetensors")
    assert list(got) == list(want)
    for k in want:
        _same_tensor(got[k], want[k])
    plain = ek.load_file(ref)  # an uncompressed file is read by safetensors itself
    assert list(plain) == list(want)


def test_save_then_load(tmp_path: Path) -> None:
    tensors = {"a": adversarial(torch.bfloat16), "b": torch.arange(10)}
    ek.save_file(tensors, tmp_path / "x.safetensors")
    ek.save_file(tensors, tmp_path / "x.safetensors", force=True)  # replaces it
    got = ek.load_file(tmp_path / "x.safetensors", threads=1)
    for k in tensors:
        _same_tensor(got[k], tensors[k])


def test_compress_file_progress_and_summary(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    safetensors.torch.save_file(all_dtypes(), src)
    calls: list[tuple[int, int]] = []
    summary = ek.compress_file(src, progress=lambda d, t: calls.append((d, t)))
    out = tmp_path / "m.ek.safetensors"
    assert summary.compressed_bytes == out.stat().st_size
    assert summary.original_bytes == src.stat().st_size
    assert calls and calls[-1][0] == calls[-1][1] == summary.total.bytes_in
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    summary = ek.decompress_file(out, tmp_path / "back.safetensors", progress=True)
    assert (tmp_path / "back.safetensors").read_bytes() == src.read_bytes()
    assert summary.original_bytes == src.stat().st_size
    assert summary.compressed_bytes == out.stat().st_size
