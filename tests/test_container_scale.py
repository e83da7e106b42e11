"""Scale: bounded memory (the file streams through segment by segment), thousands of
tensors, and (slow) a tensor over 4 GiB."""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from entropykit.container import _atomic, files


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_by_segments_not_file_size(tmp_path: Path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    src = tmp_path / "big.safetensors"
    save_file({"w": (torch.randn(8192, 2048, generator=g) * 0.02).to(torch.bfloat16),
               "f": torch.randn(1024, 2048, generator=g)}, src)
    size = src.stat().st_size  # 40 MiB
    seg = 1 << 20
    # Written data may wait for the writer thread up to the queue's cap (a constant, not a
    # share of the file): small here, so that the bound below holds however far a busy
    # machine's writer thread lags.
    monkeypatch.setattr(_atomic, "QUEUE_BYTES", seg)
    packed, back = tmp_path / "p", tmp_path / "b"
    # Warm up first: loading compiled kernels allocates, once per process.
    files.compress_file(src, packed, threads=2, segment_bytes=seg)
    files.decompress_file(packed, back, threads=2)
    packed.unlink()
    back.unlink()
    peak_c = _peak(lambda: files.compress_file(src, packed, threads=2, segment_bytes=seg))
    peak_d = _peak(lambda: files.decompress_file(packed, back, threads=2))
    assert back.read_bytes() == src.read_bytes()
    # At most 2 x threads segments in flight, each holding at most its input bytes (read,
    # not mapped), its fields and its frames: 12 segments at 2 threads, whatever the file
    # size (how many peak together depends on the threads' timing); the writer's queue:
    # its cap and the one write that may pass it; and each decoding thread's scratch of
    # the driver (a segment's symbols, once per byte of a value and once more: bf16's 1.5
    # segments), the 2 workers' and the caller's.
    bound = 12 * seg + 2 * seg + 3 * 3 * seg // 2
    assert peak_c < bound < size / 2
    assert peak_d < bound


def test_thousands_of_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {f"model.layers.{i}.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16)
               for i in range(3000)}
    src = tmp_path / "many.safetensors"
    save_file(tensors, src)
    packed = tmp_path / "many.ek"
    files.compress_file(src, packed)
    files.decompress_file(packed, tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == src.read_bytes()
    # A tensor too small to compress costs its record entry, header entry and payload
    # index (measured: ~230 bytes), not more.
    assert packed.stat().st_size - src.stat().st_size < 256 * len(tensors)


@pytest.mark.slow
def test_tensor_over_4_gib(tmp_path: Path) -> None:
    n = (1 << 32) + 4099  # bytes: crosses every 32-bit boundary
    header = json.dumps({"__metadata__": {"k": "v"},
                         "small": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "huge": {"dtype": "U8", "shape": [n], "data_offsets": [8, 8 + n]}})
    text = header.encode() + b" " * (-len(header) % 8)
    src = tmp_path / "huge.safetensors"
    marks = {0: b"\x01\x02", (1 << 32) - 1: b"\xff\xee\xdd", n - 3: b"end"}
    with open(src, "wb") as f:  # sparse: zeros except the marks
        f.write(struct.pack("<Q", len(text)) + text + np.float32([1.5, -2]).tobytes())
        for at, b in marks.items():
            f.seek(8 + len(text) + 8 + at)
            f.write(b)
    packed = tmp_path / "huge.ek"
    files.compress_file(src, packed)
    assert packed.stat().st_size < 1 << 24
    files.verify_file(packed, src)
