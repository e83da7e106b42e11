"""Checks real frames against docs/format.md: the header table is read from the document,
and a pure-Python reference decoder written from the document's prose decodes them."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from entropykit import CorruptDataError, rans

SPEC = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
_SIZES = {1: "B", 2: "H", 4: "I", 8: "Q"}


def _header_rows() -> list[tuple[int, int, str]]:
    section = SPEC.split("### Header", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([a-z_ ]+) \|", section, re.M)
    return [(int(o), int(s), f.strip()) for o, s, f in rows]


def _read_header(frame: bytes) -> dict[str, object]:
    fields = {}
    for off, size, name in _header_rows():
        raw = frame[off : off + size]
        fields[name] = raw if name == "magic" else struct.unpack("<" + _SIZES[size], raw)[0]
    return fields


def _parse_table(buf: bytes, off: int) -> tuple[dict[int, int], int]:
    n_present = buf[off] + 1
    off += 1
    if n_present <= 32:
        present = list(buf[off : off + n_present])
        off += n_present
    else:
        present = [s for s in range(256) if buf[off + s // 8] >> (s % 8) & 1]
        off += 32
    freqs = {}
    for s in present:
        v, shift = 0, 0
        while True:
            b = buf[off]
            off += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        freqs[s] = v
    return freqs, off


def _reference_decode(frame: bytes, context: np.ndarray | None = None) -> np.ndarray:
    h = _read_header(frame)
    p, n, cs, n_chunks = h["param"], h["n"], h["chunk_size"], h["n_chunks"]
    off = 28
    if n == 0:
        assert len(frame) == 28 and h["table_len"] == 0 and n_chunks == 0
        return np.zeros(0, np.uint8)
    if h["context flag"] == 0:
        freqs, off = _parse_table(frame, off)
        tables, cmap = [freqs], [0] * 256
    else:
        n_tables = frame[off] + 1
        cmap = list(frame[off + 1 : off + 257])
        off += 257
        tables = []
        for _ in range(n_tables):
            freqs, off = _parse_table(frame, off)
            tables.append(freqs)
    assert off == 28 + h["table_len"]
    lengths = struct.unpack_from(f"<{n_chunks}I", frame, off)
    crcs = struct.unpack_from(f"<{n_chunks}I", frame, off + 4 * n_chunks)
    modes = frame[off + 8 * n_chunks : off + 9 * n_chunks]
    off += 9 * n_chunks
    assert off + sum(lengths) == len(frame)
    out = bytearray()
    for c in range(n_chunks):
        count = min(cs, n - c * cs)
        payload = frame[off : off + lengths[c]]
        off += lengths[c]
        if modes[c] == 1:
            chunk = bytes(payload)
        else:
            x = list(struct.unpack_from("<32I", payload, 0))
            words = struct.unpack_from(f"<{(len(payload) - 128) // 2}H", payload, 128)
            w = 0
            chunk = bytearray()
            for i in range(count):
                lane = i % 32
                t = tables[cmap[context[c * cs + i]]] if context is not None else tables[0]
                slot = x[lane] & ((1 << p) - 1)
                cum = 0
                for s in sorted(t):
                    if cum <= slot < cum + t[s]:
                        break
                    cum += t[s]
                chunk.append(s)
                x[lane] = t[s] * (x[lane] >> p) + slot - cum
                if x[lane] < 1 << 16:
                    x[lane] = (x[lane] << 16) | words[w]
                    w += 1
            assert w == len(words) and all(v == 1 << 16 for v in x)
        assert zlib.crc32(chunk) == crcs[c]
        out += chunk
    return np.frombuffer(bytes(out), np.uint8)


def test_header_table_is_what_the_code_writes():
    sym = np.minimum(np.random.default_rng(0).geometric(0.3, 5000), 255).astype(np.uint8)
    f = rans.encode(sym, precision=11, chunk_size=2048)
    h = _read_header(f)
    assert [r[0] for r in _header_rows()] == [0, 4, 5, 6, 7, 8, 16, 20, 24]
    assert h["magic"] == b"EKRA" and h["version"] == 1 and h["param"] == 11
    assert h["lanes"] == 32 and h["context flag"] == 0
    assert (h["n"], h["chunk_size"], h["n_chunks"]) == (5000, 2048, 3)


@pytest.mark.parametrize("n", [0, 1, 33, 5000])
def test_reference_decoder_from_the_spec(n):
    rng = np.random.default_rng(n)
    sym = np.minimum(rng.geometric(0.2, n), 255).astype(np.uint8)
    f = rans.encode(sym, chunk_size=2048)
    np.testing.assert_array_equal(_reference_decode(f), sym)


def test_reference_decoder_context_frame_and_raw_chunks():
    rng = np.random.default_rng(1)
    ctx = rng.integers(0, 3, 4096).astype(np.uint8)
    sym = (rng.geometric(0.4, 4096) + 50 * ctx).astype(np.uint8)
    f = rans.encode(sym, context=ctx, chunk_size=1024)
    assert f[7] == 1
    np.testing.assert_array_equal(_reference_decode(f, ctx), sym)
    noise = rng.integers(0, 256, 3000).astype(np.uint8)
    g = rans.encode(noise, chunk_size=1024)
    np.testing.assert_array_equal(_reference_decode(g), noise)


def _rans2d_rows() -> list[tuple[int, int, str]]:
    section = SPEC.split("#### rans2d payload", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([a-z]+) \|", section, re.M)
    return [(int(o), int(s), f) for o, s, f in rows]


def _reference_rans2d(payload: bytes) -> np.ndarray:
    """Decode a rans2d payload as the docs/format.md prose says."""
    h = {}
    for off, size, name in _rans2d_rows():
        raw = payload[off : off + size]
        h[name] = raw if name == "magic" else struct.unpack("<" + _SIZES[size], raw)[0]
    assert h["magic"] == b"EK2D" and h["version"] == 1 and h["reserved"] == 0
    n, cols, phase, kr, kc = h["n"], h["cols"], h["phase"], h["kr"], h["kc"]
    rows = -(-(phase + n) // cols)
    off = 32

    def classes(count: int, k: int) -> list[int]:
        nonlocal off
        w = (k - 1).bit_length()
        size = -(-count * w // 8)
        bits = int.from_bytes(payload[off : off + size], "little")
        off += size
        out = [(bits >> (j * w)) & ((1 << w) - 1) for j in range(count)]
        assert all(c < k for c in out) and bits >> (count * w) == 0
        return out

    rmap = classes(rows, kr) if kr > 1 else [0] * rows
    cmap = classes(cols, kc) if kc > 1 else [0] * cols
    ctx = np.array([rmap[(phase + i) // cols] * kc + cmap[(phase + i) % cols]
                    for i in range(n)], np.uint8)
    return _reference_decode(payload[off:], ctx)


@pytest.mark.parametrize("cols, phase, kr, kc", [(64, 0, 4, 1), (50, 17, 3, 4), (7, 6, 1, 5)])
def test_reference_rans2d_decoder_from_the_spec(cols, phase, kr, kc):
    from entropykit.coding import lines
    from entropykit.container import classed

    rng = np.random.default_rng(cols)
    n = 3000
    rows = rng.integers(0, kr, lines.n_rows(n, cols, phase)).astype(np.uint8)
    columns = rng.integers(0, kc, cols).astype(np.uint8)
    ctx = lines.context(n, cols, phase, rows if kr > 1 else None,
                        columns if kc > 1 else None, kc)
    sym = (rng.geometric(0.4, n) + 40 * (ctx % 5)).astype(np.uint8)
    joint = np.zeros((256, 256), np.int64)
    np.add.at(joint, (ctx.astype(np.int64), sym.astype(np.int64)), 1)
    p = classed.Plan(kr, kc, rows if kr > 1 else None, columns if kc > 1 else None, joint, 0)
    payload = classed.encode(sym, cols, phase, p, 12)
    assert [r[0] for r in _rans2d_rows()] == [0, 4, 5, 6, 7, 8, 16, 24]
    assert payload[32 + (lines.map_bytes(len(rows), kr) if kr > 1 else 0)
                   + (lines.map_bytes(cols, kc) if kc > 1 else 0) + 7] == 1  # context flag
    np.testing.assert_array_equal(_reference_rans2d(payload), sym)


def _with_table(frame: bytes, table: bytes) -> bytes:
    """``frame`` (one table) with its table section replaced and table_len set to match."""
    old = struct.unpack_from("<I", frame, 24)[0]
    head = bytearray(frame[:28])
    struct.pack_into("<I", head, 24, len(table))
    return bytes(head) + table + frame[28 + old :]


def test_table_checks_stated_in_the_spec():
    sym = np.tile(np.arange(2, dtype=np.uint8), 1024)
    f = rans.encode(sym, precision=12, chunk_size=2048)
    assert f[28:28 + 7] == bytes([1, 0, 1, 0x80, 0x10, 0x80, 0x10])  # 2 x 2048 as varints
    # The same table with one frequency as a 4-byte varint still reads; 5 bytes do not.
    long4 = bytes([1, 0, 1, 0x80, 0x90, 0x80, 0x00, 0x80, 0x10])
    np.testing.assert_array_equal(rans.decode(_with_table(f, long4)), sym)
    long5 = bytes([1, 0, 1, 0x80, 0x90, 0x80, 0x80, 0x00, 0x80, 0x10])
    with pytest.raises(CorruptDataError, match="varint"):
        rans.decode(_with_table(f, long5))
    # A bitmap (n_present > 32) must have exactly n_present bits set.
    wide = np.arange(4096, dtype=np.int64) % 40
    g = rans.encode(wide.astype(np.uint8), precision=12, chunk_size=4096)
    table_len = struct.unpack_from("<I", g, 24)[0]
    bad = bytearray(g[28 : 28 + table_len])
    bad[1 + 5] |= 0x80  # symbol 47 marked present as well
    with pytest.raises(CorruptDataError, match="bitmap"):
        rans.decode(_with_table(g, bytes(bad)))
    with pytest.raises(CorruptDataError, match="tables end"):
        rans.decode(_with_table(f, f[28:35] + b"\0"))
