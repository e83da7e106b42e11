"""How a compressed file is read while it is decoded: a tensor of one segment costs one
read (its payload index and field payloads together), the small tensors of one work unit
one read together, and the bytes stay exact."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import entropykit
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


def _counted(monkeypatch) -> list[int]:
    reads: list[int] = []
    readinto = FileBytes.readinto

    def counted(self, offset, outs):
        reads.append(offset)
        return readinto(self, offset, outs)

    monkeypatch.setattr(FileBytes, "readinto", counted)
    return reads


def test_the_small_tensors_of_a_work_unit_are_read_once(tmp_path, monkeypatch):
    src, dst = _weights(tmp_path, 6)  # 6 x 32 KiB: one work unit
    with FileBytes(dst) as f:
        c = Compressed(f)
        assert all(len(t.codecs) == 1 for t in c.record.tensors.values())
        reads = _counted(monkeypatch)
        out = io.BytesIO()
        c.restore(out, threads=1)
        assert len(reads) == 1  # every payload (index and fields) in one read
        assert out.getvalue() == src.read_bytes()
        reads.clear()
        got = list(c.tensors(c.keys(), threads=2))
        assert len(reads) == 1
    want = load_file(src)
    for name, raw in zip(c.keys(), got, strict=True):
        assert raw.tobytes() == want[name].view(torch.uint8).numpy().tobytes()


def test_load_file_reads_each_work_unit_once(tmp_path, monkeypatch):
    src, dst = _weights(tmp_path, 6)
    reads = _counted(monkeypatch)
    got = entropykit.load_file(dst, threads=3)
    # The outer header's reads, then one for the unit's payloads (one per tensor before).
    header_reads = len(reads) - 1
    want = load_file(src)
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    reads.clear()
    with FileBytes(dst) as f:
        Compressed(f)
    assert len(reads) == header_reads


def test_a_damaged_payload_in_a_unit_read_together_names_its_tensor(tmp_path):
    src, dst = _weights(tmp_path, 6)
    with FileBytes(dst) as f:
        c = Compressed(f)
        at = c.payload_at("w3") + c.payload_size("w3") // 2
    data = bytearray(dst.read_bytes())
    data[at] ^= 0x40
    dst.write_bytes(bytes(data))
    for threads in (1, 3):
        with pytest.raises(entropykit.CorruptDataError, match="'w3'"):
            entropykit.load_file(dst, threads=threads)
        with pytest.raises(entropykit.CorruptDataError, match="'w3'"):
            files.decompress_file(dst, tmp_path / f"back{threads}.safetensors",
                                  threads=threads)


def test_files_of_one_segment_tensors_restore_exactly_on_threads(tmp_path):
    src, dst = _weights(tmp_path, 9)
    for threads in (1, 3):
        back = tmp_path / f"back{threads}.safetensors"
        files.decompress_file(dst, back, threads=threads)
        assert back.read_bytes() == src.read_bytes()
