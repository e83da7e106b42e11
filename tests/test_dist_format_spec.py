"""Checks real distribution frames against the "Distribution frame" section of
docs/format.md: a parser written from that section (header and value-format tables read
from the document) walks the header, chunk directory, raw payloads and CRCs and checks the
model fingerprint and the key order. Coded payloads are decoded one chunk at a time by the
library's chunk kernel (an independent decoder would have to restate the integer CDF that
the section leaves to its reference implementation), at the offsets this parser found."""

from __future__ import annotations

import re
import struct
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from entropykit import CorruptDataError
from entropykit.rans import dist_kernels as K
from entropykit.rans import distribution as D

SECTION = (Path(__file__).parent.parent / "docs" / "format.md").read_text().split(
    "## Distribution frame", 1)[1].split("\n## ", 1)[0]
_SIZES = {1: "B", 4: "I", 8: "Q"}
_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16,
           "fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


def _header_rows() -> list[tuple[int, int, str]]:
    table = SECTION.split("### Distribution header", 1)[1].split("\n\n", 2)[1]
    return [(int(o), int(s), f.strip())
            for o, s, f in re.findall(r"^\| (\d+) \| (\d+) \| ([a-z_ ]+) \|", table, re.M)]


def _format_rows() -> dict[int, dict[str, object]]:
    rows = re.findall(r"^\| (\d) \| (\w+) \| (\d+) \| (\d+) \| (\d+) \| (0x[0-9A-F]+) \|",
                      SECTION, re.M)
    return {int(c): {"name": n, "W": int(w), "mant": int(m), "bias": int(b),
                     "nonfinite": int(x, 16)} for c, n, w, m, b, x in rows}


def _fingerprint(shapes: np.ndarray, emps: np.ndarray, weights: np.ndarray) -> int:
    return zlib.crc32(shapes.astype("<u4").tobytes() + emps.astype("<u4").tobytes()
                      + np.asarray(weights).astype("<i8").tobytes())


def read_frame(frame: bytes, mu: np.ndarray, sigma: np.ndarray, model: D.CoderModel,
               model_index: np.ndarray | int = 0) -> tuple[dict, np.ndarray]:
    """(header fields, decoded bit patterns) of a frame, every rule of the section checked."""
    h = {}
    for off, size, name in _header_rows():
        raw = frame[off : off + size]
        h[name] = raw if name == "magic" else struct.unpack("<" + _SIZES[size], raw)[0]
    fmt = _format_rows()[h["value format"]]
    assert h["magic"] == b"EKRD" and h["version"] == 1 and h["lanes"] == 32
    assert 12 <= h["precision"] <= 16
    n, cs, nc = h["n"], h["chunk_size"], h["n_chunks"]
    assert cs % 32 == 0 and 1024 <= cs <= 1 << 26 and nc == -(-n // cs)
    assert h["fingerprint"] == _fingerprint(model.shapes, model.emps, model.weights)
    width = fmt["W"] // 8
    storage = np.dtype("<u2" if width == 2 else "u1")
    off = 28
    lengths = struct.unpack_from(f"<{nc}I", frame, off)
    crcs = struct.unpack_from(f"<{nc}I", frame, off + 4 * nc)
    modes = frame[off + 8 * nc : off + 9 * nc]
    off += 9 * nc
    assert off + sum(lengths) == len(frame)
    out = np.empty(n, storage)
    mu_b = np.ascontiguousarray(mu, np.float32).view(np.uint32)
    sg_b = np.ascontiguousarray(sigma, np.float32).view(np.uint32)
    midx = np.broadcast_to(np.asarray(model_index, np.uint16), (n,))
    buf = np.frombuffer(frame, np.uint8)
    params = np.array([1 << fmt["W"], fmt["mant"], fmt["bias"], fmt["nonfinite"],
                       fmt["W"] - 8], np.int64)
    for c in range(nc):
        lo, hi = c * cs, min((c + 1) * cs, n)
        payload = frame[off : off + lengths[c]]
        if modes[c] == 1:
            assert len(payload) == (hi - lo) * width
            out[lo:hi] = np.frombuffer(payload, storage)
        else:
            assert modes[c] == 0 and len(payload) >= 128 and (len(payload) - 128) % 2 == 0
            assert min(struct.unpack_from("<32I", payload)) >= 1 << 16
            status = K.decode_chunk(
                buf, off, lengths[c], mu_b[lo:hi], sg_b[lo:hi],
                np.ascontiguousarray(midx[lo:hi]), params, model.shape_pairs, model.inverse,
                model.emp_pairs, model.weights, K.reciprocals(), h["precision"],
                np.empty((K.LANE_ROWS, 32), np.int64), np.empty((K.FLOAT_ROWS, 32)),
                out[lo:hi])
            assert status == K.OK
        assert zlib.crc32(out[lo:hi].tobytes()) == crcs[c]
        off += lengths[c]
    return h, out


def _keys(bits: np.ndarray, width: int) -> np.ndarray:
    """Keys as the section defines them: numeric order of the values."""
    half, full = 1 << (width - 1), (1 << width) - 1
    b = bits.astype(np.int64)
    return np.where(b & half, b ^ full, b ^ half)


def _model() -> D.CoderModel:
    counts = np.arange(1, 65537, dtype=np.int64)
    mix = D.gaussian_shape((1.0, 3.0), (0.95, 0.03))
    return D.CoderModel(np.stack([mix, D.gaussian_shape()]),
                        np.stack([D.empirical_table(counts)] * 2), [1311, 0])


@pytest.mark.parametrize("fmt", sorted(_DTYPES))
def test_spec_reader_decodes_frames(fmt):
    rng = np.random.default_rng(len(fmt))
    n = 5000
    mu = rng.normal(0, 1, n).astype(np.float32)
    sigma = np.exp(rng.normal(-2, 0.5, n)).astype(np.float32)
    x = (mu + sigma * rng.normal(size=n).astype(np.float32)).astype(_DTYPES[fmt])
    bits = x.view(D.FORMATS[fmt].storage)
    bits[:1024] = rng.integers(0, 1 << (8 * x.itemsize), 1024)  # chunk 0: noise, stored raw
    model = _model()
    index = rng.integers(0, 2, n).astype(np.uint16)
    frame = D.encode(bits, mu, sigma, model, fmt=fmt, model_index=index, precision=14,
                     chunk_size=1024)
    h, out = read_frame(frame, mu, sigma, model, index)
    np.testing.assert_array_equal(out, bits)
    assert _format_rows()[h["value format"]]["name"] == fmt
    assert (h["precision"], h["n"], h["chunk_size"], h["n_chunks"]) == (14, n, 1024, 5)
    assert frame[28 + 8 * 5] == 1  # the noise chunk went raw
    assert set(frame[28 + 8 * 5 : 28 + 9 * 5]) == {0, 1}


@pytest.mark.parametrize("fmt", sorted(_DTYPES))
def test_value_formats_and_key_order(fmt):
    row = next(r for r in _format_rows().values() if r["name"] == fmt)
    f = D.FORMATS[fmt]
    assert (f.bits, f.mantissa, f.bias, f.nonfinite) == (
        row["W"], row["mant"], row["bias"], row["nonfinite"])
    every = np.arange(1 << f.bits).astype(f.storage)
    keys = _keys(every, f.bits)
    np.testing.assert_array_equal(keys, D.value_keys(every))
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = every.view(_DTYPES[fmt]).astype(np.float64)
    by_key = values[np.argsort(keys)]
    finite = np.isfinite(by_key)
    assert np.all(np.diff(by_key[finite]) >= 0)  # numeric order (-0 before +0: equal)


def test_empty_frame_is_its_header():
    frame = D.encode(np.zeros(0, np.uint16), [], [], D.gaussian_model(), fmt="bf16")
    assert len(frame) == 28
    h, out = read_frame(frame, np.zeros(0), np.zeros(0), D.gaussian_model())
    assert (h["n"], h["n_chunks"], out.size) == (0, 0, 0)


def _frame() -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    mu = rng.normal(0, 1, 3000).astype(np.float32)
    sigma = np.full(3000, 0.1, np.float32)
    bits = (mu + sigma * rng.normal(size=3000)).astype(ml_dtypes.bfloat16).view(np.uint16)
    return D.encode(bits, mu, sigma, D.gaussian_model(), fmt="bf16", chunk_size=1024), mu, sigma


FRAME, MU, SIGMA = _frame()


def _patched(off: int, fmt: str, value: object) -> bytes:
    b = bytearray(FRAME)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


def _short_payload() -> bytes:
    """Chunk 0's payload cut to 100 bytes, chunk 1's grown to match: the total still fits."""
    b = bytearray(FRAME)
    first, second = struct.unpack_from("<2I", b, 28)
    struct.pack_into("<2I", b, 28, 100, second + first - 100)
    return bytes(b)


@pytest.mark.parametrize("frame", [
    FRAME[:27],                                  # shorter than the header
    _patched(0, "<4s", b"EKRA"),                 # magic
    _patched(4, "<B", 2),                        # version
    _patched(5, "<B", 11), _patched(5, "<B", 17),  # precision outside 12..16
    _patched(6, "<B", 4),                        # lanes
    _patched(7, "<B", 5), _patched(7, "<B", 0),  # value format code
    _patched(16, "<I", 1056 + 16),               # chunk_size not a multiple of 32
    _patched(16, "<I", 992),                     # chunk_size below 1024
    _patched(20, "<I", 4),                       # n_chunks != ceil(n / chunk_size)
    _patched(8, "<Q", 1 << 40),                  # n: directory no longer fits / n > mu
    _patched(24, "<I", 0),                       # fingerprint
    FRAME + b"\0",                               # trailing bytes
    FRAME[:-1],                                  # payloads end past the frame
    _patched(28 + 8 * 3, "<B", 2),               # mode
    _short_payload(),                            # a coded payload under 128 bytes
    _patched(28 + 27, "<I", 0xFFFF),             # start state of lane 0 below 2^16
    _patched(28 + 4 * 3, "<I", 0),               # CRC of chunk 0
])
def test_every_documented_check_is_applied(frame):
    with pytest.raises(CorruptDataError):
        D.decode(frame, MU, SIGMA, D.gaussian_model())


def test_max_output_is_checked_before_decoding():
    with pytest.raises(CorruptDataError, match="3000 values"):
        D.decode(FRAME, MU, SIGMA, D.gaussian_model(), max_output=2999)
