"""How a rank's shard is written and read: raw fields checksummed once and written
without a join copy, a rank's items spread over files written in parallel, loads decoded
straight into the planner's tensors. (Round trips and failure behaviour: test_dcp.py.)"""

from __future__ import annotations

import io

import numpy as np
import pytest

from entropykit.api import tensor_source
from entropykit.container import codecs, payload
from entropykit.container.reader import Compressed
from entropykit.container.writer import write


def test_raw_fields_are_read_once_by_the_crcs_and_never_joined(monkeypatch):
    # Random bytes: every field is stored raw. Its CRC is taken once (the field's own);
    # the position CRC comes from it, and the payload is written in pieces.
    data = np.random.default_rng(1).integers(0, 256, 3 << 20).astype(np.uint8)
    crcd = []

    def counting(real):
        def crc(buf, value=0):
            crcd.append(memoryview(buf).nbytes)
            return real(buf, value)
        return crc

    monkeypatch.setattr(codecs, "crc32", counting(codecs.crc32))
    monkeypatch.setattr(payload, "crc32", counting(payload.crc32))
    joins = []

    class Out(io.BytesIO):
        def write(self, b):
            joins.append(memoryview(b).nbytes)
            return super().write(b)

    out = Out()
    write(tensor_source({"x": data}, None), out, threads=1, fast=True, segment_bytes=1 << 20)
    # Each byte once (old: twice), and each field's 4-byte CRC in its position CRC.
    assert data.size <= sum(crcd) <= data.size + 4 * 3
    assert max(joins) == 1 << 20  # the symbols as they are, not joined to their CRC
    got = Compressed(out.getvalue()).tensor("x")
    assert np.array_equal(got, data)


def test_stored_payload_crc_equals_the_joined_bytes_crc():
    from entropykit.coding.crc32 import crc32

    sym = np.random.default_rng(2).integers(0, 256, 100_003).astype(np.uint8)
    s = codecs.RAW.stored(sym)
    joined = codecs.RAW.encode(sym, None, 0, 0, None)
    assert s.joined() == joined and len(s) == len(joined)
    for seed in (0, 1, 0xFFFFFFFF, 0x12345678):
        assert s.crc32(seed) == crc32(joined, seed)
    assert payload.field_crc(s, "t", 3, 1) == payload.field_crc(joined, "t", 3, 1)


@pytest.mark.parametrize("n", [0, 1, 7, 4096, 1 << 20])
def test_crc32_combine_is_zlibs(n):
    import zlib

    from entropykit.coding.crc32 import crc32_combine

    g = np.random.default_rng(n)
    a, b = g.bytes(13), g.bytes(n)
    for seed in (0, 0xDEADBEEF):
        assert crc32_combine(zlib.crc32(a, seed), zlib.crc32(b), n) == zlib.crc32(a + b, seed)
