"""LMCache chunk blobs (``entropykit.lmcache``) without LMCache: exact round trips, the
header read by a parser written from docs/format.md ("LMCache chunk blob"), and damage
raising ``CorruptDataError``. The plugin itself is tested against LMCache in
tests/test_lmcache.py (``.ci/lmcache``)."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import pytest
import torch

from entropykit import CorruptDataError
from entropykit import lmcache as ek

DOC = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
SECTION = DOC.split("## LMCache chunk blob", 1)[1].split("\n## ", 1)[0]
FIELDS = {m[3]: (int(m[1]), int(m[2])) for m in re.finditer(
    r"^\| (\d+) \| (\d+) \| ([a-z ]+) \|", SECTION.split("| offset |", 1)[1], re.M)}
SHAPE = (2, 2, 256, 64)  # LMCache's [2 (k, v), layers, tokens, kv heads x head dim]


def _chunk(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * torch.linspace(0.05, 4.0, shape[-1])).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _field(blob: bytes, name: str) -> int:
    at, size = FIELDS[name]
    return int.from_bytes(blob[at : at + size], "little")


def _random_bits(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (2, 2, 256, 128), dtype=torch.uint8,
                         generator=g).view(torch.bfloat16)  # NaNs included


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.float32])
def test_round_trip_and_header_as_documented(dtype):
    groups = [_chunk(dtype, SHAPE, 1), _chunk(torch.bfloat16, (2, 256, 32), 2)]
    blob = ek.encode_chunk(groups, threads=1)
    raw = sum(g.numel() * g.element_size() for g in groups)
    assert list(FIELDS) == ["magic", "version", "mode", "reserved", "length", "body crc",
                            "header crc"]
    assert blob[:4] == b"EKLM" and _field(blob, "version") == 1 and _field(blob, "mode") == 0
    assert _field(blob, "reserved") == 0 and _field(blob, "length") == len(blob) < raw
    assert _field(blob, "body crc") == zlib.crc32(blob[24:])
    assert _field(blob, "header crc") == zlib.crc32(blob[:20]) and ek.HEADER_BYTES == 24
    assert ek.blob_length(blob[:24]) == ek.check_blob(blob + b"\0" * 9) == len(blob)
    assert ek.max_blob_bytes([g.shape for g in groups], [g.dtype for g in groups]) == raw + 24
    assert ek.encode_chunk(groups, threads=2) == blob  # deterministic
    out = [torch.empty_like(g) for g in groups]
    ek.decode_chunk(blob + b"\xff" * 7, out, threads=2)  # bytes after the blob: not read
    assert all(_same(o, g) for o, g in zip(out, groups, strict=True))


def test_incompressible_groups_are_stored_as_they_are():
    chunk = _random_bits(3)
    blob = ek.encode_chunk([chunk])
    assert _field(blob, "mode") == 1 and len(blob) == 24 + chunk.numel() * 2
    assert blob[24:] == chunk.view(torch.uint8).numpy().tobytes()
    out = torch.empty_like(chunk)
    ek.decode_chunk(blob, [out])
    assert _same(out, chunk)
    with pytest.raises(CorruptDataError, match="as they are"):
        ek.decode_chunk(blob, [out[:, :, :128].contiguous()])


@pytest.mark.parametrize("make", [lambda: _chunk(torch.bfloat16, SHAPE, 4),
                                  lambda: _random_bits(5)], ids=["coded", "as they are"])
def test_every_damage_raises_corrupt_data_error(make):
    chunk = make()
    blob = ek.encode_chunk([chunk], threads=1)
    out = torch.empty_like(chunk)
    positions = list(range(24)) + list(range(24, len(blob), max(1, len(blob) // 40)))
    for at in positions:
        bad = bytearray(blob)
        bad[at] ^= 0x20
        with pytest.raises(CorruptDataError):
            ek.decode_chunk(bytes(bad), [out], threads=1)
    for cut in (0, 3, 23, 24, len(blob) - 1):
        with pytest.raises(CorruptDataError):
            ek.decode_chunk(blob[:cut], [out], threads=1)


def test_header_fields_are_checked_with_a_valid_header_crc():
    chunk = _chunk(torch.float16, SHAPE, 6)
    blob = ek.encode_chunk([chunk], threads=1)
    out = torch.empty_like(chunk)

    def edited(fmt: str, at: int, value: int) -> bytes:
        b = bytearray(blob)
        struct.pack_into(fmt, b, at, value)
        struct.pack_into("<I", b, 20, zlib.crc32(b[:20]))
        return bytes(b)

    for fmt, at, value, says in [("<B", 4, 2, "version 2"), ("<B", 5, 2, "mode 2"),
                                 ("<H", 6, 1, "reserved 1"), ("<Q", 8, 23, "length 23"),
                                 ("<Q", 8, 1 << 62, "truncated"), ("<B", 5, 1, "as they are")]:
        with pytest.raises(CorruptDataError, match=says):
            ek.decode_chunk(edited(fmt, at, value), [out], threads=1)
    with pytest.raises(CorruptDataError, match="group 0 is F16"):
        ek.decode_chunk(blob, [torch.empty(SHAPE, dtype=torch.bfloat16)])
    with pytest.raises(CorruptDataError, match="holds groups"):
        ek.decode_chunk(blob, [out, out])
    with pytest.raises(ValueError, match="contiguous host tensors"):
        ek.decode_chunk(blob, [out.transpose(0, 1)])
