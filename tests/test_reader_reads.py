"""How a compressed file is read while it is decoded: a tensor of one segment costs one
read (its payload index and field payloads together), and the bytes stay exact."""

from __future__ import annotations

import io

import numpy as np
import torch
from safetensors.torch import save_file

from entropykit.container import files
from entropykit.container.reader import Compressed
from entropykit.container.source import FileBytes


def _weights(tmp_path, count: int):
    rng = np.random.default_rng(7)
    tensors = {f"w{k}": torch.from_numpy(rng.normal(0, 0.02, (64, 256)).astype(np.float32))
               .to(torch.bfloat16) for k in range(count)}
    src = tmp_path / "m.safetensors"
    save_file(tensors, src)
    dst = tmp_path / "m.ek.safetensors"
    files.compress_file(src, dst, threads=1)
    return src, dst


def test_a_tensor_of_one_segment_is_read_once(tmp_path, monkeypatch):
    src, dst = _weights(tmp_path, 6)
    reads = []
    readinto = FileBytes.readinto

    def counted(self, offset, outs):
        reads.append(offset)
        return readinto(self, offset, outs)

    with FileBytes(dst) as f:
        c = Compressed(f)
        assert all(len(t.codecs) == 1 for t in c.record.tensors.values())
        monkeypatch.setattr(FileBytes, "readinto", counted)
        out = io.BytesIO()
        c.restore(out, threads=1)
    assert len(reads) == 6  # one per tensor: index and field payloads in one read
    assert out.getvalue() == src.read_bytes()


def test_files_of_one_segment_tensors_restore_exactly_on_threads(tmp_path):
    src, dst = _weights(tmp_path, 9)
    for threads in (1, 3):
        back = tmp_path / f"back{threads}.safetensors"
        files.decompress_file(dst, back, threads=threads)
        assert back.read_bytes() == src.read_bytes()
