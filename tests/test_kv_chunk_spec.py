"""Checks real KV chunk blobs against the "KV chunk blob" section of docs/format.md: a
parser written from that section (its header table read from the document) reads the
chunk header of blobs made by ``compress_kv_chunk``, checks its range, prefix hash and
CRC, and hands the KV blob that follows to the "KV blob" section's reader
(``test_kv_format_spec.read_blob``) with the section's guess: the predictor's on the
prefix ids and the chunk's own."""

from __future__ import annotations

import hashlib
import re
import struct
import zlib

import numpy as np
import pytest
import torch
from test_kv_format_spec import CACHE, CALIBRATION, DOC, IDS, PREDICTOR, read_blob
from test_predictive_layouts import FAMILIES, PROMPTS, _cache
from test_predictive_layouts import IDS as LAYOUT_IDS

from entropykit import predictive as P

SECTION = DOC.split("## KV chunk blob", 1)[1].split("\n## ", 1)[0]
ROWS = [(int(o), int(s), f.strip()) for o, s, f in re.findall(
    r"^\| (\d+) \| (\d+) \| ([a-z_ ]+) \|", SECTION.split("| offset |", 1)[1], re.M)]


def _arrays(cal: P.Calibration) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in cal.arrays.items()}


class _Prefixed(P.Predictor):
    """``predictor`` run on the prefix ids followed by the ids it is given: the guess the
    section gives a chunk's KV blob."""

    def __init__(self, predictor: P.Predictor, prefix: torch.Tensor) -> None:
        self.inner, self.prefix = predictor, prefix
        self.exact_layers = predictor.exact_layers

    def predict(self, input_ids):
        return self.inner.predict(torch.cat([self.prefix, input_ids], 1))

    def describe(self) -> str:
        return self.inner.describe()


def read_chunk(blob: bytes, chunk: P.KVCache, ids: torch.Tensor, predictor: P.Predictor,
               arrays: dict[str, np.ndarray]) -> dict:
    """The chunk header's fields, every rule of the section checked; the KV blob after it
    read by the KV blob section's reader."""
    h = {}
    for off, size, name in ROWS:
        raw = blob[off : off + size]
        h[name] = raw if name in ("magic", "prefix hash") else struct.unpack(
            "<" + {1: "B", 2: "H", 4: "I", 8: "Q"}[size], raw)[0]
    head = max(o + s for o, s, _ in ROWS)
    assert head == 36 and h["magic"] == b"EKKC" and h["version"] == 1 and h["reserved"] == 0
    assert h["header crc"] == zlib.crc32(blob[: head - 4])
    start, end = h["start"], h["end"]
    assert 0 <= start < end <= 1 << 24 and ids.shape[0] * end <= 1 << 24
    prefix = ids[:, :start]
    digest = hashlib.blake2b(prefix.numpy().astype("<i8").tobytes(), digest_size=16)
    assert h["prefix hash"] == digest.digest()
    kv = read_blob(blob[head:], chunk, arrays, _Prefixed(predictor, prefix), ids[:, start:end])
    assert kv["seq"] == end - start
    return h | {"kv": kv}


@pytest.mark.parametrize("fp8", [False, True])
def test_spec_reader_reads_chunks_of_a_batch(fp8):
    cache = P.to_fp8(CACHE) if fp8 else CACHE  # batch 2, 24 tokens, 3 full layers
    for a, b in ((0, 5), (5, 6), (6, 24)):
        chunk = P.slice_kv(cache, a, b)
        blob = P.compress_kv_chunk(chunk, IDS[:, :b], PREDICTOR, CALIBRATION, start=a)
        h = read_chunk(blob, chunk, IDS, PREDICTOR, _arrays(CALIBRATION))
        assert (h["start"], h["end"], h["kv"]["batch"]) == (a, b, 2)
        assert P.decompress_kv_chunk(blob, IDS[:, :a], PREDICTOR, CALIBRATION).equal(chunk)


def test_spec_reader_reads_chunks_of_a_sliding_window_model():
    # Gemma 2: layers 0 and 1 alternate sliding (the prompt's last 7 of 24: 17..23) and full
    build, layout = FAMILIES["gemma2"]
    model = build()
    pred = P.FP8Predictor(model)
    cal = P.calibrate(model, pred, PROMPTS, formats=("bf16",), progress=False)
    cache = _cache(model)
    assert cache.shapes == layout and layout[0][2] == 7
    parts = {(0, 10): [None, None], (10, 20): [(1, 2, 3, 16)] * 2,
             (20, 24): [(1, 2, 4, 16)] * 2}
    for (a, b), sliding in parts.items():
        chunk = P.slice_kv(cache, a, b)
        blob = P.compress_kv_chunk(chunk, LAYOUT_IDS[:, :b], pred, cal, start=a)
        h = read_chunk(blob, chunk, LAYOUT_IDS, pred, _arrays(cal))
        # the sliding layer: no tokens (a layer without KV in the KV blob), then its last
        assert h["kv"]["shapes"] == sliding + [(1, 2, b - a, 16)] * 2
        assert P.decompress_kv_chunk(blob, LAYOUT_IDS[:, :a], pred, cal).equal(chunk)
