"""Checks compressed files against the "Container" section of docs/format.md: a reader
written from that section alone (it uses the coders, zstd and formats.join, never
entropykit.container) restores real files byte for byte, and the payload table is read
from the document itself."""

from __future__ import annotations

import base64
import json
import math
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import save_file
from test_container import all_dtypes

from entropykit import formats, rans, tans
from entropykit.container import files

SECTION = (Path(__file__).parent.parent / "docs" / "format.md").read_text().split(
    "## Container", 1)[1]
_FMT = {4: "I", 8: "Q"}


def _payload_rows() -> list[tuple[int, int, str]]:
    table = SECTION.split("### Tensor payload", 1)[1].split("###", 1)[0]
    # Rows of fixed size only (the "8k" lengths row is read by the test itself).
    return [(int(o), int(s), f)
            for o, s, f in re.findall(r"^\| (\d+) \| (\d+) \| ([a-z]+) \|", table, re.M)]


def _record_crc_ok(text: str) -> bool:
    """The record checksum as the "Record checksum" paragraph states it."""
    para = SECTION.split("**Record checksum**", 1)[1].split("\n\n", 1)[0]
    count = int(re.search(r"ends with the (\d+) characters", para)[1])
    template = re.search(r"`(,[^`]*h{8}[^`]*)`", para)[1]
    assert len(template) == count
    head, tail = template.split("h" * 8)
    end = text[-count:]
    if not (end.startswith(head) and end.endswith(tail)):
        return False
    digits = end[len(head) : count - len(tail)]
    return digits == digits.lower() and zlib.crc32(text[:-count].encode()) == int(digits, 16)


def test_record_checksum_catches_every_edit(tmp_path: Path) -> None:
    src = tmp_path / "m.safetensors"
    save_file(all_dtypes(), src)
    packed = tmp_path / "m.ek.safetensors"
    files.compress_file(src, packed)
    blob = packed.read_bytes()
    text = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])["__metadata__"][
        "entropykit"]
    assert _record_crc_ok(text)
    rng = np.random.default_rng(14)
    for i in rng.choice(len(text), 300, replace=False):
        for other in ("0", "a", '"'):
            if text[i] != other:
                assert not _record_crc_ok(text[:i] + other + text[i + 1 :])


def _field_payload(codec: str, data: bytes, context: np.ndarray | None) -> np.ndarray:
    if codec == "rans":
        return rans.decode(data, context=context)
    if codec == "tans":
        return tans.decode(data)
    if codec == "zstd":
        return np.frombuffer(zstandard.ZstdDecompressor().decompress(data), np.uint8)
    assert codec == "raw"
    (crc,) = struct.unpack("<I", data[:4])
    assert zlib.crc32(data[4:]) == crc
    return np.frombuffer(data[4:], np.uint8)


def _restore(blob: bytes) -> bytes:
    """The original file, from the compressed one, following docs/format.md."""
    (n,) = struct.unpack("<Q", blob[:8])
    assert n % 8 == 0
    outer = json.loads(blob[8 : 8 + n])
    data = blob[8 + n :]
    text = outer["__metadata__"]["entropykit"]
    rec = json.loads(text)
    assert (rec["format"], rec["version"]) == ("entropykit", 3)
    assert _record_crc_ok(text) and list(rec)[-1] == "record_crc32"
    header = zstandard.ZstdDecompressor().decompress(base64.b64decode(rec["header"]))
    assert len(header) == rec["header_size"] and zlib.crc32(header) == rec["header_crc32"]
    original = json.loads(header)
    original.pop("__metadata__", None)
    bits = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16,
            "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64,
            "U64": 64, "F64": 64}
    rows = _payload_rows()
    out = [struct.pack("<Q", len(header)), header]
    payloads = [k for k in outer if k != "__metadata__"]
    data_order = sorted(original, key=lambda k: original[k]["data_offsets"])
    assert sorted(payloads, key=lambda k: outer[k]["data_offsets"]) == data_order
    for name in data_order:
        entry, t = outer[name], rec["tensors"][name]
        assert entry["dtype"] == "U8" and t["dtype"] == original[name]["dtype"]
        a, b = entry["data_offsets"]
        payload = data[a:b]
        head = {f: struct.unpack_from("<" + _FMT[s], payload, o)[0] if f != "magic"
                else payload[o : o + s] for o, s, f in rows}
        assert head["magic"] == b"EKT2"
        k = head["k"]
        lengths = struct.unpack_from(f"<{k}Q", payload, 8)
        crcs = struct.unpack_from(f"<{k}I", payload, 8 + 8 * k)
        pos = 8 + 12 * k
        assert pos + sum(lengths) == len(payload)
        nbytes = original[name]["data_offsets"][1] - original[name]["data_offsets"][0]
        u = math.lcm(bits[t["dtype"]], 8) // 8
        step = max(u, rec["segment_bytes"] // u * u)
        segments = [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]
        assert k == len(segments) * len(t["fields"]) == len(t["codecs"]) * len(t["fields"])
        i = 0
        for s, ((lo, hi), codecs) in enumerate(zip(segments, t["codecs"], strict=True)):
            done: dict[str, np.ndarray] = {}
            for f, ((field, ctx), codec) in enumerate(zip(t["fields"], codecs, strict=True)):
                part = payload[pos : pos + lengths[i]]
                prefix = name.encode() + b"\0" + struct.pack("<II", s, f)
                assert zlib.crc32(part, zlib.crc32(prefix)) == crcs[i], (name, s, f)
                pos, i = pos + lengths[i], i + 1
                done[field] = _field_payload(codec, part, None if ctx is None else done[ctx])
            out.append(formats.join(t["dtype"], done, hi - lo, layout=t["layout"]).tobytes())
    return b"".join(out)


def test_payload_table_is_read_from_the_document() -> None:
    assert _payload_rows() == [(0, 4, "magic"), (4, 4, "k")]


def test_the_spec_reader_catches_swapped_payloads(tmp_path: Path) -> None:
    # Two tensors of one shape and spread: their payloads are equal-sized; swapping their
    # bytes leaves every frame valid, so only the position CRC can tell.
    src = tmp_path / "m.safetensors"
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    save_file({"a": w, "b": w * 2}, src)
    packed = tmp_path / "m.ek.safetensors"
    files.compress_file(src, packed)
    blob = packed.read_bytes()
    assert _restore(blob) == src.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    outer = json.loads(blob[8 : 8 + n])
    (a0, a1), (b0, b1) = outer["a"]["data_offsets"], outer["b"]["data_offsets"]
    assert a1 - a0 == b1 - b0 and a1 == b0
    data = blob[8 + n :]
    swapped = blob[: 8 + n] + data[b0:b1] + data[a0:a1] + data[b1:]
    with pytest.raises(AssertionError, match=r"\('a', 0, 0\)"):
        _restore(swapped)


@pytest.mark.parametrize("segment_bytes", [1 << 24, 4096])
def test_files_follow_the_spec(tmp_path: Path, segment_bytes: int) -> None:
    src = tmp_path / "m.safetensors"
    save_file(all_dtypes(), src, metadata={"format": "pt", "x": "1"})
    packed = tmp_path / "m.ek.safetensors"
    files.compress_file(src, packed, segment_bytes=segment_bytes)
    blob = packed.read_bytes()
    meta = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])["__metadata__"]
    assert {k: v for k, v in meta.items() if k != "entropykit"} == {"format": "entropykit",
                                                                    "x": "1"}
    assert _restore(blob) == src.read_bytes()
