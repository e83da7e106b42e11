"""The segment driver (``container/driver.py``): every segment whose fields it codes is
decoded by it, byte for byte as the layered path decodes it; every fault it can find is
reported as its status and then raises the same ``CorruptDataError`` message as before."""

from __future__ import annotations

import io
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entropykit import CorruptDataError, api
from entropykit._status import Status
from entropykit.container import codecs, driver, payload, writer
from entropykit.container.reader import Compressed

if not driver.crc32.ACCELERATED:
    pytest.skip("the driver needs the CRC kernel", allow_module_level=True)

DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32,
          "fp8": ml_dtypes.float8_e4m3fn, "int8": np.int8}


def _blob(arr: np.ndarray, **kw) -> bytes:
    out = io.BytesIO()
    writer.write(api.tensor_source({"t": arr}, None), out, threads=1, **kw)
    return out.getvalue()


class _Spy:
    """``driver.decode`` recording each call's (status, field, chunk)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, int, int]] = []
        real = driver.decode

        def spy(*args, **kw):
            got = real(*args, **kw)
            self.calls.append(tuple(int(v) for v in got))
            return got

        monkeypatch.setattr(driver, "decode", spy)


def _decode(blob: bytes, threads: int = 1) -> np.ndarray:
    return Compressed(np.frombuffer(blob, np.uint8)).tensor("t", threads)


def _layered(blob: bytes, monkeypatch: pytest.MonkeyPatch) -> np.ndarray | str:
    """What the layered path makes of ``blob``: the bytes, or its error message."""
    with monkeypatch.context() as m:
        m.setattr(driver, "plan", lambda *a: None)
        try:
            return _decode(blob)
        except CorruptDataError as e:
            return str(e)


def _values(kind: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 0.02, shape) * rng.uniform(0.1, 3, shape[:1] + (1,) * (len(shape) - 1))
    if kind == "int8":
        return np.clip(np.round(x * 2000), -128, 127).astype(np.int8)
    return x.astype(DTYPES[kind])


@settings(max_examples=10, deadline=None)
@given(kind=st.sampled_from(sorted(DTYPES)), chunks=st.integers(1, 3),
       delta=st.sampled_from([-33, -1, 0, 1, 31]), target=st.sampled_from(["cpu", "gpu"]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 3))
def test_round_trip_through_the_driver_at_chunk_and_part_edges(kind, chunks, delta, target,
                                                                threads, seed):
    # Parts of one chunk each (SPAN = the target's chunk), so a few chunks cross part
    # edges; the segment size cuts the tensor near a chunk edge too.
    chunk = codecs.POLICIES[target, False].chunk
    cols = 96
    n = chunks * chunk + delta
    x = _values(kind, (n // cols, cols), seed).reshape(-1)[: n - n % 2]
    blob = _blob(x, target=target, segment_bytes=chunk * x.itemsize * 2)
    with pytest.MonkeyPatch.context() as m:
        spy = _Spy(m)
        m.setattr(driver, "SPAN", chunk)
        got = _decode(blob, threads)
    assert got.tobytes() == x.tobytes()
    assert len(spy.calls) >= _driven(blob) and all(c[0] == Status.OK for c in spy.calls)


def _driven(blob: bytes) -> int:
    """Segments the driver codes (zstd fields are the layered path's)."""
    t = Compressed(np.frombuffer(blob, np.uint8)).record.tensors["t"]
    return sum(driver.plan(t.dtype, t.layout, t.fields, c) is not None for c in t.codecs)


@pytest.mark.parametrize("kind", sorted(DTYPES))
def test_every_segment_goes_through_the_driver_as_one_call(kind, monkeypatch):
    x = _values(kind, (512, 640), 1)
    blob = _blob(x, segment_bytes=1 << 18)
    spy = _Spy(monkeypatch)
    assert _decode(blob).tobytes() == x.tobytes()
    t = Compressed(np.frombuffer(blob, np.uint8)).record.tensors["t"]
    segs = _driven(blob)
    assert segs >= len(t.codecs) - 1 and len(t.codecs) == -(-x.nbytes // (1 << 18))
    assert spy.calls == [(Status.OK, -1, -1)] * segs


def test_a_chunk_size_that_cuts_a_part_is_left_to_the_layered_path(monkeypatch):
    x = _values("bf16", (1024, 320), 2)
    blob = _blob(x, target="gpu")
    spy = _Spy(monkeypatch)
    monkeypatch.setattr(driver, "SPAN", 3 << 14)  # not a multiple of the 64 Ki chunks
    assert _decode(blob, 2).tobytes() == x.tobytes()
    assert (driver.UNALIGNED, 0, -1) in spy.calls


# ---- damaged inputs: every status the driver returns, the same message as before ----------


def _quantized(shape: tuple[int, int]) -> np.ndarray:
    """BF16 of few mantissas per exponent: a sign_mantissa field conditioned on it."""
    rng = np.random.default_rng(3)
    q = rng.integers(-12, 13, shape) * 2.0 ** rng.integers(-20, -4, shape)
    return q.astype(ml_dtypes.bfloat16)


def _tans_values() -> np.ndarray:
    """BF16 whose exponent a fast file codes with tANS."""
    return np.random.default_rng(4).normal(0, 0.02, (48, 64)).astype(ml_dtypes.bfloat16)


def _files() -> dict[str, tuple[bytes, tuple[str, ...]]]:
    made = {}
    for name, arr, kw in (("bf16", _values("bf16", (256, 256), 0), {}),
                          ("bf16-gpu", _values("bf16", (256, 256), 0), {"target": "gpu"}),
                          ("quantized", _quantized((256, 320)), {"target": "gpu"}),
                          ("fp32", _values("fp32", (128, 256), 0), {"target": "gpu"}),
                          ("tans", _tans_values(), {"fast": True})):
        blob = _blob(arr, **kw)
        made[name] = blob, Compressed(np.frombuffer(blob, np.uint8)).record.tensors["t"].codecs[0]
    return made


FILES = _files()


def _edit(blob: bytes, field: int, edit, rebind: bool = True) -> bytes:
    """``blob`` with field payload ``field`` of segment 0 changed in place by
    ``edit(bytearray)`` and, with ``rebind``, its position CRC made right again."""
    c = Compressed(np.frombuffer(blob, np.uint8))
    fields = c.fields("t")
    base = c.outer.data_start + c._outer["t"].begin
    at, size = base + fields.offsets[field], fields.lengths[field]
    part = bytearray(blob[at : at + size])
    edit(part)
    assert len(part) == size
    out = bytearray(blob)
    out[at : at + size] = part
    if rebind:
        k = len(fields.lengths)
        struct.pack_into("<I", out, base + 8 + 8 * k + 4 * field,
                         payload.field_crc(bytes(part), "t", 0, field))
    return bytes(out)


def _frame_at(codec: str, part: bytearray) -> int:
    """Where a field payload's rANS frame starts."""
    if codec == "rans":
        return 0
    kr, kc, n, cols, phase = struct.unpack_from("<BBxQQQ", part, 5)
    rows = (phase + n + cols - 1) // cols
    return 32 + (rows * (kr - 1).bit_length() + 7) // 8 + (cols * (kc - 1).bit_length() + 7) // 8


def _directory(part: bytearray, at: int) -> tuple[int, int]:
    """(where the directory starts, chunks) of the frame at ``part[at:]``."""
    n_chunks, model = struct.unpack_from("<II", part, at + 20)
    return at + 28 + model, n_chunks


def _set(at_of, value: int):
    def edit(p: bytearray) -> None:
        p[at_of(p)] = value
    return edit


def _flip(at_of):
    def edit(p: bytearray) -> None:
        p[at_of(p)] ^= 0x40
    return edit


def _frame_edit(codec: str, what: str):
    def at(p: bytearray) -> int:
        f = _frame_at(codec, p)
        d, n = _directory(p, f)
        return {"version": f + 4, "lanes": f + 6, "table": f + 28, "mode": d + 8 * n,
                "crc": d + 4 * n, "words": len(p) - 3}[what]
    return at


def _state_below_l(p: bytearray) -> None:
    d, n = _directory(p, 0)
    p[d + 9 * n + 2 : d + 9 * n + 4] = b"\0\0"  # lane 0's start state < 2**16


def _huge_rows(p: bytearray) -> None:
    # One column class (no column map to bound the columns) and a phase and row length
    # near 2**62: (phase + n + cols - 1) // cols would wrap an int64.
    p[6] = 1
    struct.pack_into("<QQ", p, 16, (1 << 62) - 1, (1 << 62) - 2)


CASES = [
    # (file, field, edit, rebind, status)
    ("bf16", 0, _flip(lambda p: len(p) // 2), False, Status.PLACE),
    ("bf16", 1, _flip(lambda p: len(p) - 1), False, Status.PLACE),
    ("bf16", 1, _flip(lambda p: 2), True, Status.CRC),  # a raw field's own CRC
    # its stored CRC: the position CRC's part before the symbols, then the CRC itself
    ("bf16", 1, _flip(lambda p: 1), False, Status.PLACE),
    ("bf16", 1, _flip(lambda p: 3), True, Status.CRC),
    ("bf16", 0, _set(lambda p: 4, 2), True, Status.HEADER),  # rans2d version
    ("bf16", 0, _set(lambda p: 5, 0), True, Status.HEADER),  # rans2d row classes
    ("bf16", 0, _set(lambda p: 23, 1), True, Status.MODEL),  # columns past the class maps
    ("bf16", 0, _huge_rows, True, Status.HEADER),
    ("bf16", 0, _set(_frame_edit("rans2d", "version"), 9), True, Status.HEADER),
    ("bf16", 0, _set(_frame_edit("rans2d", "table"), 0), True, Status.MODEL),
    ("bf16", 0, _set(_frame_edit("rans2d", "mode"), 5), True, Status.DIRECTORY),
    ("bf16", 0, _flip(_frame_edit("rans2d", "crc")), True, Status.CRC),
    ("bf16-gpu", 0, _set(_frame_edit("rans", "lanes"), 16), True, Status.HEADER),
    ("bf16-gpu", 0, _set(_frame_edit("rans", "table"), 0), True, Status.MODEL),
    ("bf16-gpu", 0, _set(_frame_edit("rans", "mode"), 1), True, Status.RAW),
    ("bf16-gpu", 0, _state_below_l, True, Status.STATE),
    ("bf16-gpu", 0, _flip(_frame_edit("rans", "words")), True, None),  # a chunk's status
    ("quantized", 1, _set(_frame_edit("rans", "version"), 0), True, Status.HEADER),
    ("quantized", 1, _flip(_frame_edit("rans", "crc")), True, Status.CRC),
    ("bf16-gpu", 0, _set(lambda p: 7, 1), True, Status.HEADER),  # a context it lacks
    ("fp32", 3, _flip(lambda p: 100), True, Status.CRC),
    # a tANS frame, decoded by the kernel like an rANS one
    ("tans", 0, _flip(lambda p: len(p) // 2), False, Status.PLACE),
    ("tans", 0, _set(_frame_edit("rans", "version"), 9), True, Status.HEADER),
    ("tans", 0, _set(_frame_edit("rans", "lanes"), 32), True, Status.HEADER),
    ("tans", 0, _set(lambda p: 5, 13), True, Status.HEADER),  # table log past tANS's
    ("tans", 0, _set(lambda p: 7, 1), True, Status.HEADER),  # a context flag: tANS has none
    ("tans", 0, _set(_frame_edit("rans", "table"), 0), True, Status.MODEL),
    ("tans", 0, _set(_frame_edit("rans", "mode"), 5), True, Status.DIRECTORY),
    ("tans", 0, _flip(_frame_edit("rans", "crc")), True, Status.CRC),
    ("tans", 0, _flip(_frame_edit("rans", "words")), True, None),  # a chunk's status
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_fault_has_its_status_and_the_old_message(case, monkeypatch):
    name, field, edit, rebind, status = CASES[case]
    blob, codecs = FILES[name]
    bad = _edit(blob, field, edit, rebind)
    old = _layered(bad, monkeypatch)
    assert isinstance(old, str), "the damage must be one the layered path rejects"
    spy = _Spy(monkeypatch)
    with pytest.raises(CorruptDataError) as e:
        _decode(bad)
    assert str(e.value) == old
    assert spy.calls and spy.calls[0][1] == field
    got = Status(spy.calls[0][0])
    if status is None:
        assert got != Status.OK
    else:
        assert got == status


def test_the_damaged_files_are_the_codecs_meant():
    assert FILES["bf16"][1] == ("rans2d", "raw")
    assert FILES["bf16-gpu"][1][0] == "rans"
    assert FILES["quantized"][1] == ("rans", "rans")
    assert FILES["fp32"][1][3] == "raw"
    assert FILES["tans"][1] == ("tans", "raw")


def test_an_undamaged_file_of_each_case_decodes(monkeypatch):
    for blob, _ in FILES.values():
        spy = _Spy(monkeypatch)
        assert np.array_equal(_decode(blob), _layered(blob, monkeypatch))
        assert spy.calls == [(Status.OK, -1, -1)]


# ---- fields of codecs the kernel cannot run: decoded first, checked and joined by it -----


def _given_file(fast: bool) -> bytes:
    """A BF16 tensor whose exponent is zstd-coded (or in fast mode tANS-coded) beside a
    field the kernel decodes."""
    rng = np.random.default_rng(4)
    x = (rng.normal(0, 0.02, (48, 64)) if fast else _quantized((48, 64)).astype(np.float32))
    return _blob(x.astype(ml_dtypes.bfloat16), fast=fast)


def test_a_tans_field_is_decoded_by_the_kernel(monkeypatch):
    # No Python decode of the tANS frame (once ~0.1 ms a segment of small tensors): the
    # kernel parses, decodes and checks it.
    blob = FILES["tans"][0]
    want = _layered(blob, monkeypatch)
    real = codecs.decode

    def no_tans(codec, *a, **kw):
        assert codec != "tans", "a tANS field was decoded outside the kernel"
        return real(codec, *a, **kw)

    monkeypatch.setattr(codecs, "decode", no_tans)
    spy = _Spy(monkeypatch)
    assert np.array_equal(_decode(blob), want)
    assert spy.calls == [(Status.OK, -1, -1)]


@pytest.mark.parametrize("fast", [False, True], ids=["zstd", "tans"])
def test_a_field_the_kernel_cannot_run_is_decoded_beside_it(fast, monkeypatch):
    blob = _given_file(fast)
    codecs_ = Compressed(np.frombuffer(blob, np.uint8)).record.tensors["t"].codecs[0]
    assert codecs_[0] == ("tans" if fast else "zstd") and codecs_[1] != codecs_[0]
    spy = _Spy(monkeypatch)
    assert np.array_equal(_decode(blob), _layered(blob, monkeypatch))
    assert spy.calls == [(Status.OK, -1, -1)]


@pytest.mark.parametrize("rebind", [True, False])
def test_a_damaged_given_field_says_what_the_layered_path_says(rebind, monkeypatch):
    blob = _given_file(False)
    bad = _edit(blob, 0, _flip(lambda p: len(p) // 2), rebind)
    old = _layered(bad, monkeypatch)
    assert isinstance(old, str)
    assert ("position CRC" in old) != rebind
    with pytest.raises(CorruptDataError) as e:
        _decode(bad)
    assert str(e.value) == old


def _raw_context_file() -> bytes:
    """BF16 whose exponent is uniform (stored raw) and whose sign and mantissa are a
    function of its top two bits (coded conditioned on the raw exponent)."""
    e = np.random.default_rng(9).integers(0, 256, 1 << 15).astype(np.uint16)
    sm = ((e >> 6) * 61 + 7) & 0xFF
    words = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return _blob(words.astype(np.uint16).view(ml_dtypes.bfloat16))


def test_a_raw_field_that_is_another_fields_context_still_decodes(monkeypatch):
    # A raw field is joined from its payload without a copy unless a field is conditioned
    # on it: then its plane is the other field's context and must hold it.
    blob = _raw_context_file()
    t = Compressed(np.frombuffer(blob, np.uint8)).record.tensors["t"]
    assert t.codecs[0] == ("raw", "rans") and t.fields[1][1] == "exponent"
    spy = _Spy(monkeypatch)
    got = _decode(blob)
    assert spy.calls == [(Status.OK, -1, -1)]
    assert np.array_equal(got, _layered(blob, monkeypatch))
