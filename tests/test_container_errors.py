"""Bad input to the container: truncated or corrupted compressed files, files that are not
safetensors, unsupported dtypes, compressing twice, existing outputs. Each must raise the
right error naming the file and leave no output behind; corruption is never silent."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_container import write_raw

from entropykit import CorruptDataError
from entropykit.container import files, record
from entropykit.container.reader import Compressed


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("pair")
    g = torch.Generator().manual_seed(3)
    src = d / "m.safetensors"
    save_file({"w": (torch.randn(40, 64, generator=g) * 0.02).to(torch.bfloat16),
               "ids": torch.arange(300), "b": torch.randn(17, generator=g),
               "u": torch.randint(0, 3, (900,), generator=g, dtype=torch.uint8)}, src)
    packed = d / "m.ek.safetensors"
    files.compress_file(src, packed, segment_bytes=2048)
    return src, packed


def _restore(buf: bytes) -> bytes:
    out = io.BytesIO()
    Compressed(np.frombuffer(buf, np.uint8)).restore(out)
    return out.getvalue()


def _listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_truncated_file_is_named_and_leaves_no_output(pair: tuple[Path, Path],
                                                       tmp_path: Path) -> None:
    src, packed = pair
    blob = packed.read_bytes()
    for cut in (0, 5, 8, 100, len(blob) // 2, len(blob) - 1):
        bad = tmp_path / "cut.safetensors"
        bad.write_bytes(blob[:cut])
        with pytest.raises(CorruptDataError, match=f"^{bad}: "):
            files.decompress_file(bad, tmp_path / "out.safetensors")
        assert _listing(tmp_path) == ["cut.safetensors"]


def test_every_corruption_is_detected_or_harmless(pair: tuple[Path, Path]) -> None:
    """Flip bits all over the file: decoding either raises CorruptDataError (or ValueError
    "not an entropykit-compressed file" when the record's key is hit) or gives the
    original bytes exactly (a flip in unused bits, e.g. the input's own metadata copy)."""
    src, packed = pair
    blob, want = packed.read_bytes(), src.read_bytes()
    detected = 0
    positions = list(range(0, len(blob), 7)) + list(range(len(blob) - 64, len(blob)))
    for pos in positions:
        for mask in (0x01, 0x80):
            bad = bytearray(blob)
            bad[pos] ^= mask
            try:
                got = _restore(bytes(bad))
            except CorruptDataError:
                detected += 1
                continue
            except ValueError as e:
                assert "not an entropykit-compressed file" in str(e)
                detected += 1
                continue
            assert got == want, f"silent wrong output after flipping byte {pos}"
    assert detected > 0.9 * 2 * len(positions)


def _sign(rec: dict) -> str:
    """A version 3 record's text with its record_crc32, as docs/format.md defines it."""
    body = json.dumps(rec, separators=(",", ":"), ensure_ascii=False)[:-1]
    return f'{body},"record_crc32":"{zlib.crc32(body.encode()):08x}"}}'


def _rewrite_record(blob: bytes, edit, sign: bool = True) -> bytes:
    """``blob`` with its record edited; a version 3 record signed again unless ``sign``
    is False (so the edit reaches the checks behind the checksum)."""
    n = struct.unpack("<Q", blob[:8])[0]
    head = json.loads(blob[8 : 8 + n])
    rec = json.loads(head["__metadata__"][record.KEY])
    crc = rec.pop("record_crc32")
    edit(rec)
    if rec.get("version") == 3 and sign:
        text = _sign(rec)
    else:
        if rec.get("version") == 3:
            rec["record_crc32"] = crc
        text = json.dumps(rec, separators=(",", ":"), ensure_ascii=False)
    head["__metadata__"][record.KEY] = text
    raw = json.dumps(head).encode()
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n :]


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(version=4), "version 4 unsupported"),
    (lambda r: r.update(version=True), "version True unsupported"),
    (lambda r: (r.update(version=1), r["tensors"]["w"]["codecs"][0].__setitem__(0, "rans2d")),
     "version 1 record names a codec of version 2"),
    (lambda r: r["tensors"]["w"]["codecs"][0].__setitem__(0, "rans2d"), "rans2d"),
    (lambda r: r.update(version=2), r"payload magic b'EKT2', expected b'EKT1'"),
    (lambda r: r.update(segment_bytes=1 << 27), "exceeds the format's maximum"),
    (lambda r: r.update(header_crc32=r["header_crc32"] ^ 1), "CRC-32"),
    (lambda r: r.update(header="!!"), "does not decode"),
    (lambda r: r["tensors"]["w"].update(dtype="F16"), "record says F16"),
    (lambda r: r["tensors"]["w"]["codecs"].pop(), "segments"),
    (lambda r: r["tensors"]["w"]["codecs"][0].__setitem__(0, "zstd"), "zstd"),
    (lambda r: r["tensors"]["w"]["codecs"][0].__setitem__(0, "lz4"), "malformed"),
    (lambda r: r["tensors"]["w"]["fields"].reverse(), "malformed"),
    (lambda r: r["tensors"].pop("b"), "names differ"),
])
def test_hostile_record(pair: tuple[Path, Path], edit, message: str) -> None:
    bad = _rewrite_record(pair[1].read_bytes(), edit)
    with pytest.raises(CorruptDataError, match=message):
        _restore(bad)


def test_not_safetensors(tmp_path: Path) -> None:
    for name, content in [("empty", b""), ("text", b"hello world, not a model\n" * 10),
                          ("json", struct.pack("<Q", 4) + b"[1]x"),
                          ("short", struct.pack("<Q", 10**6) + b"{}")]:
        bad = tmp_path / f"{name}.safetensors"
        bad.write_bytes(content)
        with pytest.raises(ValueError, match=f"^{bad}: not a valid safetensors file"):
            files.compress_file(bad, tmp_path / "out")
        with pytest.raises(CorruptDataError, match=f"^{bad}: not a valid safetensors file"):
            files.decompress_file(bad, tmp_path / "out")
    assert "out" not in _listing(tmp_path)


def test_tensors_must_tile_the_data(tmp_path: Path) -> None:
    gap = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},' \
          b'"b":{"dtype":"U8","shape":[2],"data_offsets":[3,5]}}'
    bad = write_raw(tmp_path / "gap.safetensors", gap, b"12345")
    with pytest.raises(ValueError, match="'b' starts at data byte 3, expected 2"):
        files.compress_file(bad, tmp_path / "out")
    extra = write_raw(tmp_path / "extra.safetensors", gap.replace(b"3,5", b"2,4"), b"12345")
    with pytest.raises(ValueError, match="tensors end at byte"):
        files.compress_file(extra, tmp_path / "out")


@pytest.mark.parametrize("dtype, nbytes", [("C64", 16), ("F4", 1), ("F8_E4M3FNUZ", 2)])
def test_unsupported_dtype(tmp_path: Path, dtype: str, nbytes: int) -> None:
    head = json.dumps({"ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                       "bad": {"dtype": dtype, "shape": [2], "data_offsets": [4, 4 + nbytes]}})
    src = write_raw(tmp_path / "x.safetensors", head.encode(), bytes(4 + nbytes))
    with pytest.raises(ValueError, match=f"^{src}: tensor 'bad': unsupported dtype {dtype}"):
        files.compress_file(src, tmp_path / "out")
    assert _listing(tmp_path) == ["x.safetensors"]


def test_compress_twice_and_decompress_plain(pair: tuple[Path, Path], tmp_path: Path) -> None:
    src, packed = pair
    with pytest.raises(ValueError, match="already entropykit-compressed"):
        files.compress_file(packed, tmp_path / "out")
    with pytest.raises(ValueError, match="not an entropykit-compressed file"):
        files.decompress_file(src, tmp_path / "out")
    assert _listing(tmp_path) == []


def test_existing_output_needs_force(pair: tuple[Path, Path], tmp_path: Path) -> None:
    src, _ = pair
    out = tmp_path / "out"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="output exists"):
        files.compress_file(src, out)
    assert out.read_bytes() == b"keep me"
    files.compress_file(src, out, force=True)
    assert out.read_bytes()[:8] != b"keep me"
    with pytest.raises(ValueError, match="would overwrite the input"):
        files.compress_file(src, src, force=True)


def test_error_mid_write_leaves_nothing(pair: tuple[Path, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from entropykit.container import segment

    real = segment.encode
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) > 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(segment, "encode", failing)
    with pytest.raises(KeyboardInterrupt):
        files.compress_file(pair[0], tmp_path / "out", threads=2, segment_bytes=1024)
    assert _listing(tmp_path) == []
