"""Field payloads bound to their place: a payload moved to another field, segment or
tensor (equal-sized, so every own check still holds) is refused by every reader through
its position CRC (EKT2, docs/format.md "Tensor payload"), and a payload layout that is
not its record version's is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from test_safety_container import DATA, _resign

import entropykit
from entropykit import CorruptDataError
from entropykit.container import files
from entropykit.container.cuda import fileplan
from entropykit.container.reader import Compressed

SEGMENT = 4096  # bytes: each 64 x 64 BF16 tensor is two segments of two fields


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two BF16 tensors of random bits: fast mode stores every field raw, so all eight
    field payloads have one size (2048 symbols + the raw CRC) and differ in content."""
    d = tmp_path_factory.mktemp("bind")
    g = torch.Generator().manual_seed(5)
    bits = {k: torch.randint(-(1 << 15), 1 << 15, (64, 64), dtype=torch.int16, generator=g)
            for k in ("a", "b")}
    safetensors.torch.save_file({k: v.view(torch.bfloat16) for k, v in bits.items()},
                                d / "m.safetensors")
    files.compress_file(d / "m.safetensors", d / "m.ek.safetensors", segment_bytes=SEGMENT,
                        fast=True, threads=1)
    return d / "m.ek.safetensors"


def _split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _join(outer: dict, data: bytes) -> bytes:
    raw = json.dumps(outer, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def _field_spans(outer: dict, name: str, data: bytes) -> list[tuple[int, int]]:
    """(start, end) in the data section of each field payload of tensor ``name`` (EKT1 or
    EKT2, so the same test runs against a reader of either)."""
    base = outer[name]["data_offsets"][0]
    magic, k = struct.unpack_from("<4sI", data, base)
    lengths = struct.unpack_from(f"<{k}Q", data, base + 8)
    at = base + 8 + (12 if magic == b"EKT2" else 8) * k
    spans = []
    for n in lengths:
        spans.append((at, at + n))
        at += n
    return spans


def _swapped(blob: bytes, x: tuple[str, int], y: tuple[str, int]) -> bytes:
    """``blob`` with field payloads x and y ((tensor, index in its payload)) exchanged."""
    outer, data = _split(blob)
    a0, a1 = _field_spans(outer, x[0], data)[x[1]]
    b0, b1 = _field_spans(outer, y[0], data)[y[1]]
    assert a1 - a0 == b1 - b0 and data[a0:a1] != data[b0:b1] and a1 <= b0
    return _join(outer, data[:a0] + data[b0:b1] + data[a1:b0] + data[a0:a1] + data[b1:])


def _offsets_swapped(blob: bytes) -> bytes:
    """``blob`` with tensors a and b pointing at each other's payload (the header only)."""
    outer, data = _split(blob)
    assert outer["a"]["shape"] == outer["b"]["shape"]
    outer["a"]["data_offsets"], outer["b"]["data_offsets"] = (outer["b"]["data_offsets"],
                                                              outer["a"]["data_offsets"])
    return _join(outer, data)


# (edit, the place the error names): payload index = segment * 2 + field.
EDITS = {
    "fields": (lambda b: _swapped(b, ("a", 0), ("a", 1)),
               r"'a' segment 0: field 0 \('exponent'\)"),
    "segments": (lambda b: _swapped(b, ("a", 1), ("a", 3)),
                 r"'a' segment 0: field 1 \('sign_mantissa'\)"),
    "tensors": (lambda b: _swapped(b, ("a", 0), ("b", 0)),
                r"'a' segment 0: field 0 \('exponent'\)"),
    "offsets": (_offsets_swapped, r"'a' segment 0: field 0 \('exponent'\)"),
}


def _read(how: str, path: Path) -> None:
    if how == "verify":
        files.verify_file(path, threads=2)
    elif how == "decompress":
        files.decompress_file(path, path.with_suffix(".out"), threads=2)
    elif how == "load_file":
        entropykit.load_file(path)
    elif how == "get_slice":
        with entropykit.safe_open(path, "pt") as f:
            f.get_slice("a")[:8]  # rows 0-7: segment 0 only
    else:  # the GPU loader's host planner
        buf = np.fromfile(path, np.uint8)
        list(fileplan.groups(Compressed(buf), 2))


@pytest.mark.parametrize("edit", list(EDITS))
@pytest.mark.parametrize("how", ["verify", "decompress", "load_file", "get_slice",
                                 "gpu_planner"])
def test_a_moved_field_payload_is_refused(packed: Path, tmp_path: Path, edit: str,
                                          how: str) -> None:
    fn, where = EDITS[edit]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(fn(packed.read_bytes()))
    with pytest.raises(CorruptDataError,
                       match=rf"tensor {where}: payload fails its position CRC-32"):
        _read(how, bad)


def test_a_lazy_slice_checks_only_the_segments_it_decodes(packed: Path,
                                                          tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(EDITS["fields"][0](packed.read_bytes()))  # segment 0 of a
    want = entropykit.load_file(packed)
    with entropykit.safe_open(bad, "pt") as f:
        got = f.get_slice("a")[32:]  # segment 1
        assert torch.equal(got.view(torch.int16), want["a"][32:].view(torch.int16))
        assert torch.equal(f.get_tensor("b").view(torch.int16), want["b"].view(torch.int16))


def test_version_3_refuses_ekt1_payloads_and_older_versions_ekt2(packed: Path) -> None:
    legacy = (DATA / "legacy_v2.ek.safetensors").read_bytes()
    as_v3 = _resign(legacy, lambda r: r.update(version=3))
    with pytest.raises(CorruptDataError, match=r"payload magic b'EKT1', expected b'EKT2'"):
        Compressed(as_v3).verify()
    as_v2 = _resign(packed.read_bytes(), lambda r: r.update(version=2))
    with pytest.raises(CorruptDataError, match=r"payload magic b'EKT2', expected b'EKT1'"):
        Compressed(as_v2).verify()
