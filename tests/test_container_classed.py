"""The "rans2d" codec (row / column classes + a context-conditioned rANS frame): exact round
trips on adversarial fields and geometries, the choice in ``codecs.choose``, hostile
payloads, determinism, and a whole file using it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from test_container import adversarial, roundtrip

import entropykit
from entropykit import CorruptDataError, formats
from entropykit.coding import frame, lines
from entropykit.container import classed, codecs, record
from entropykit.container.reader import Compressed


def _plan(sym: np.ndarray, cols: int, phase: int, rows: np.ndarray | None, kr: int,
          columns: np.ndarray | None, kc: int) -> classed.Plan:
    """A Plan with given class maps (what ``classed.plan`` would choose, or not)."""
    ctx = lines.context(sym.size, cols, phase, rows, columns, kc)
    joint = np.zeros((256, 256), np.int64)
    np.add.at(joint, (ctx.astype(np.int64), sym.astype(np.int64)), 1)
    return classed.Plan(kr, kc, rows, columns, joint, 0)


def _random_plan(rng: np.random.Generator, sym: np.ndarray, cols: int, phase: int,
                 kr: int, kc: int) -> classed.Plan:
    rows = rng.integers(0, kr, lines.n_rows(sym.size, cols, phase)).astype(np.uint8)
    columns = rng.integers(0, kc, cols).astype(np.uint8)
    return _plan(sym, cols, phase, rows if kr > 1 else None, kr,
                 columns if kc > 1 else None, kc)


def _roundtrip(sym: np.ndarray, cols: int, phase: int, p: classed.Plan,
               precision: int = codecs.WIDE_PRECISION) -> bytes:
    blob = classed.encode(sym, cols, phase, p, precision)
    buf = np.frombuffer(blob, np.uint8)
    assert codecs.count("rans2d", buf, limit=sym.size) == sym.size
    assert np.array_equal(codecs.decode("rans2d", buf, sym.size, None), sym)
    return blob


def _scaled_rows(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """bf16 weights whose rows have scales 10x apart (shuffled): row classes pay."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1, 0, rows)[torch.randperm(rows, generator=g)][:, None]
    return (torch.randn(rows, cols, generator=g) * scale * 0.02).to(torch.bfloat16)


def _exponents(t: torch.Tensor) -> np.ndarray:
    raw = t.contiguous().view(torch.uint8).numpy().reshape(-1)
    return next(f.symbols for f in formats.split("BF16", raw) if f.name == "exponent").copy()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2])
def test_every_bit_pattern_roundtrips(dtype: torch.dtype) -> None:
    # Every 8/16-bit pattern (NaN payloads, +-0, +-inf, subnormals) as a 2-D tensor: each
    # field of one symbol per element through rans2d with random row and column classes.
    t = adversarial(dtype)
    cols = 256
    raw = t.view(torch.uint8).numpy().reshape(-1)
    name = {torch.bfloat16: "BF16", torch.float16: "F16",
                               torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}[dtype]
    rng = np.random.default_rng(1)
    fields = {f.name: np.ascontiguousarray(f.symbols) for f in formats.split(name, raw)}
    for sym in fields.values():
        if sym.size != t.numel():
            continue
        _roundtrip(sym, cols, 0, _random_plan(rng, sym, cols, 0, 4, 4))
    assert np.array_equal(formats.join(name, fields, raw.size), raw)


@pytest.mark.parametrize("n, cols, phase", [
    (1, 1, 0), (1, 7, 3), (5, 1, 0), (64, 64, 0), (100, 3, 2), (1000, 1000, 999),
    (frame.DEFAULT_CHUNK - 1, 384, 0), (frame.DEFAULT_CHUNK, 384, 5),
    (frame.DEFAULT_CHUNK + 1, 384, 383), (2 * frame.DEFAULT_CHUNK + 7, 1 << 18, 1),
    (3 * 4096 + 3, 4096, 4095),
])
@pytest.mark.parametrize("kr, kc", [(4, 1), (1, 4), (4, 4), (16, 16), (3, 5)])
def test_geometries_roundtrip(n: int, cols: int, phase: int, kr: int, kc: int) -> None:
    # One row, one column, rows crossing chunk boundaries, a segment starting mid-row.
    rng = np.random.default_rng(n + cols)
    sym = rng.geometric(0.3, n).clip(0, 255).astype(np.uint8)
    _roundtrip(sym, cols, phase, _random_plan(rng, sym, cols, phase, kr, kc))


@settings(max_examples=200, deadline=None)
@given(k=st.integers(1, 256), n=st.integers(0, 200), seed=st.integers(0, 2**32 - 1),
       flip=st.one_of(st.none(), st.integers(0, 10**6)))
def test_class_maps_unpack_as_packed_and_reject_damage(k: int, n: int, seed: int,
                                                       flip: int | None) -> None:
    """``lines.unpack`` inverts ``pack`` for every width; a flipped bit is caught exactly
    where it makes a class ``>= k`` or sets a padding bit (the reference: bit by bit)."""
    classes = np.random.default_rng(seed).integers(0, k, n).astype(np.uint8)
    buf = np.frombuffer(lines.pack(classes, k), np.uint8).copy()
    if flip is not None and buf.size:
        buf[flip % buf.size] ^= np.uint8(1 << (flip // buf.size) % 8)
    w = lines.width(k)
    bits = np.unpackbits(buf, bitorder="little")
    want = np.array([sum(int(bits[i * w + b]) << b for b in range(w)) for i in range(n)],
                    np.uint8)
    ok = not bits[n * w:].any() and (n == 0 or int(want.max()) < k)
    got = lines.unpack(buf, n, k)
    assert (got is not None) == ok
    if ok:
        assert got.dtype == np.uint8 and got.tolist() == want.tolist()
        assert flip is not None or got.tolist() == classes.tolist()


def test_all_rows_in_one_class_and_one_symbol() -> None:
    sym = np.full(50_000, 121, np.uint8)
    p = _plan(sym, 500, 0, np.zeros(100, np.uint8), 4, np.zeros(500, np.uint8), 4)
    _roundtrip(sym, 500, 0, p)
    sym[::7] = 3
    p = _plan(sym, 500, 0, np.full(100, 3, np.uint8), 4, None, 1)
    _roundtrip(sym, 500, 0, p)


def test_every_symbol_present() -> None:
    rng = np.random.default_rng(2)
    sym = rng.integers(0, 256, 300_000).astype(np.uint8)
    for precision in (codecs.RANS_PRECISION, codecs.WIDE_PRECISION):
        _roundtrip(sym, 300, 17, _random_plan(rng, sym, 300, 17, 8, 8), precision)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_hypothesis_roundtrip(data: st.DataObject) -> None:
    n = data.draw(st.integers(0, 5000))
    cols = data.draw(st.integers(1, 600))
    phase = data.draw(st.integers(0, cols - 1))
    kr, kc = data.draw(st.sampled_from([(1, 2), (2, 1), (4, 4), (16, 1), (7, 9), (16, 16)]))
    seed = data.draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    alphabet = data.draw(st.integers(1, 256))
    sym = rng.integers(0, alphabet, n).astype(np.uint8)
    _roundtrip(sym, cols, phase, _random_plan(rng, sym, cols, phase, kr, kc))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 300), cols=st.integers(2, 300), seed=st.integers(0, 1000),
       first=st.integers(0, 10_000))
def test_hypothesis_plan_roundtrip(rows: int, cols: int, seed: int, first: int) -> None:
    # Whatever classing plan() picks on real-looking exponents round-trips exactly.
    sym = _exponents(_scaled_rows(rows, cols, seed))
    grid = codecs.grid_of((rows, cols), first)
    assert grid is not None
    p = classed.plan(sym, *grid)
    if p is not None:
        assert p.kr * p.kc >= 2
        _roundtrip(sym, *grid, p)


def test_choose_picks_rans2d_where_rows_differ_and_it_pays() -> None:
    sym = _exponents(_scaled_rows(512, 384))
    plain = codecs.choose(sym, None)
    got = codecs.choose(sym, None, grid=(384, 0))
    assert plain.codec == "rans" and got.codec == "rans2d"
    assert len(got.blob) < 0.92 * len(plain.blob)
    assert got.entropy_bits == plain.entropy_bits
    back = codecs.decode("rans2d", np.frombuffer(got.blob, np.uint8), sym.size, None)
    assert np.array_equal(back, sym)


@pytest.mark.parametrize("kw", [{"target": "gpu"}, {"fast": True}])
def test_gpu_target_and_fast_never_use_rans2d(kw: dict[str, object]) -> None:
    sym = _exponents(_scaled_rows(512, 384))
    assert codecs.choose(sym, None, grid=(384, 0), **kw).codec != "rans2d"


def test_context_fields_and_homogeneous_rows_stay_plain() -> None:
    sym = _exponents(_scaled_rows(512, 384))
    assert codecs.choose(sym, sym, grid=(384, 0)).codec == "rans"  # has a context
    g = torch.Generator().manual_seed(0)
    same = _exponents((torch.randn(512, 384, generator=g) * 0.02).to(torch.bfloat16))
    assert codecs.choose(same, None, grid=(384, 0)).codec == "rans"  # classes do not pay


def test_grid_of() -> None:
    assert codecs.grid_of((30, 7), 0) == (7, 0)
    assert codecs.grid_of((2, 3, 7), 10) == (7, 3)
    assert codecs.grid_of((7,), 0) is None
    assert codecs.grid_of((1, 7), 0) is None
    assert codecs.grid_of((7, 1), 0) is None


def test_deterministic() -> None:
    sym = _exponents(_scaled_rows(700, 384, seed=5))
    a = codecs.choose(sym, None, grid=(384, 100)).blob
    b = codecs.choose(sym.copy(), None, grid=(384, 100)).blob
    assert a == b and a[:4] == classed.MAGIC


@pytest.fixture(scope="module")
def coded() -> tuple[np.ndarray, bytes, classed.Plan]:
    # Symbols drawn per row class, so every class keeps a table of its own.
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 3, 200).astype(np.uint8)
    sym = (rng.geometric(0.2, (200, 100)) + 60 * rows[:, None]).clip(0, 255).astype(np.uint8)
    sym = sym.reshape(-1)
    p = _plan(sym, 100, 0, rows, 3, rng.integers(0, 5, 100).astype(np.uint8), 5)
    return sym, classed.encode(sym, 100, 0, p, 12), p


def _decode(blob: bytes, n: int) -> np.ndarray:
    return codecs.decode("rans2d", np.frombuffer(blob, np.uint8), n, None)


def _set(blob: bytes, at: int, value: bytes) -> bytes:
    return blob[:at] + value + blob[at + len(value):]


@pytest.mark.parametrize("at, value, message", [
    (0, b"EK2E", "magic"), (4, b"\x02", "version"), (7, b"\x01", "magic"),
    (5, b"\x00", "row and"), (5, b"\x11", "row and"), (5, b"\x01\x01", "row and"),
    (16, (3).to_bytes(8, "little"), "row class map"),  # 3 columns: 6667 rows to map
    (24, (100).to_bytes(8, "little"), "phase 100 not below 100"),
    (16, (1 << 62).to_bytes(8, "little"), "phase 0 not below"),
    (8, (19_999).to_bytes(8, "little"), "holds 19999"),
])
def test_hostile_header(coded: tuple[np.ndarray, bytes, classed.Plan], at: int, value: bytes,
                        message: str) -> None:
    sym, blob, _ = coded
    with pytest.raises(CorruptDataError, match=message):
        _decode(_set(blob, at, value), sym.size)


def test_class_out_of_range_and_padding_rejected(
        coded: tuple[np.ndarray, bytes, classed.Plan]) -> None:
    sym, blob, p = coded
    h = classed.HEADER_SIZE
    rows = p.rows.copy()
    rows[5] = 3  # kr == 3: class 3 does not exist
    with pytest.raises(CorruptDataError, match="row class map"):
        _decode(_set(blob, h, lines.pack(rows, 3)), sym.size)
    row_bytes = lines.map_bytes(200, 3)  # 400 bits: no padding; columns: 300 bits + 4
    cols = p.columns.copy()
    cols[99] = 7  # kc == 5
    with pytest.raises(CorruptDataError, match="column class map"):
        _decode(_set(blob, h + row_bytes, lines.pack(cols, 5)), sym.size)
    last = h + row_bytes + lines.map_bytes(100, 5) - 1
    with pytest.raises(CorruptDataError, match="padding"):
        _decode(_set(blob, last, bytes([blob[last] | 0x80])), sym.size)


def test_wrong_but_valid_class_is_detected(coded: tuple[np.ndarray, bytes, classed.Plan]
                                           ) -> None:
    # A class map damaged into other valid classes decodes with other tables: the chunk
    # CRC-32 catches it.
    sym, blob, p = coded
    rows = p.rows.copy()
    rows[:50] = (rows[:50] + 1) % 3
    with pytest.raises(CorruptDataError, match="CRC-32|rans2d frame"):
        _decode(_set(blob, classed.HEADER_SIZE, lines.pack(rows, 3)), sym.size)


def test_truncation_anywhere_is_detected(coded: tuple[np.ndarray, bytes, classed.Plan]
                                         ) -> None:
    sym, blob, _ = coded
    for cut in list(range(0, 200, 3)) + [len(blob) - 1]:
        with pytest.raises(CorruptDataError):
            _decode(blob[:cut], sym.size)
    with pytest.raises(CorruptDataError, match="truncated in its class maps"):
        _decode(blob[:40], sym.size)
    with pytest.raises(CorruptDataError, match="trailing"):
        _decode(blob + b"\0", sym.size)


def test_records_are_version_3_and_older_versions_read() -> None:
    t = record.TensorRecord("BF16", (4, 4), None, (("exponent", None),), (("tans",),))
    t2 = record.TensorRecord("BF16", (4, 4), None, (("exponent", None),), (("rans2d",),))
    new = record.Record(8, b"{}", {"a": t, "b": t2})
    assert json.loads(new.to_json())["version"] == 3
    assert record.parse(new.to_json()).tensors == new.tensors
    # As versions 1 and 2 were written: no checksum; version 1 never names rans2d.
    old = json.loads(new.to_json())
    del old["record_crc32"]
    old["version"] = 2
    assert record.parse(json.dumps(old)).tensors == new.tensors
    old["version"] = 1
    with pytest.raises(CorruptDataError, match="version 1 record names a codec of version 2"):
        record.parse(json.dumps(old))


def test_file_with_rans2d_roundtrips(tmp_path) -> None:
    # The writer passes each tensor's grid to codecs.choose: the 2-D tensor gets classes.
    w = _scaled_rows(600, 384)
    src = tmp_path / "m.safetensors"
    save_file({"w": w, "b": torch.randn(384).to(torch.bfloat16)}, src)
    packed = roundtrip(src, tmp_path, threads=2)
    again = tmp_path / "again.ek"
    entropykit.compress_file(src, again, threads=1)
    assert again.read_bytes() == packed.read_bytes()  # deterministic, any thread count
    c = Compressed(np.fromfile(packed, np.uint8))
    assert c.record.version == 3
    assert c.record.tensors["w"].codecs == (("rans2d", "rans"),)
    assert torch.equal(entropykit.load_file(packed)["w"], w)
    assert np.array_equal(c.tensor("w"), w.view(torch.uint8).numpy().reshape(-1))
    # The GPU loader's plan (emulated on the CPU) decodes rans2d fields on the host.
    from test_gpu_load import _cpu_bytes, _emulated_load
    got, want = _emulated_load(packed, 2), _cpu_bytes(packed)
    assert list(got) == list(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_fp8_bytes_are_classed_on_coarse_buckets() -> None:
    # More than 64 symbols present: the line histograms count the top 6 bits; the frame
    # codes the whole bytes, at 14 bits (a wide alphabet).
    w = (_scaled_rows(600, 384, seed=2).float() * 2000).to(torch.float8_e4m3fn)
    sym = w.view(torch.uint8).numpy().reshape(-1).copy()
    index, magnitude = lines.buckets(np.bincount(sym, minlength=256))
    assert np.count_nonzero(np.bincount(sym)) > 64 and magnitude.size <= 64
    got = codecs.choose(sym, None, grid=(384, 0))
    assert got.codec == "rans2d" and len(got.blob) < len(codecs.choose(sym, None).blob)
    p = classed.plan(sym, 384, 0)
    frame_at = classed.HEADER_SIZE + (lines.map_bytes(600, p.kr) if p.kr > 1 else 0) + (
        lines.map_bytes(384, p.kc) if p.kc > 1 else 0)
    assert got.blob[frame_at + 5] == codecs.WIDE_PRECISION
    assert np.array_equal(codecs.decode("rans2d", np.frombuffer(got.blob, np.uint8),
                                        sym.size, None), sym)


def test_short_lines_are_not_classed() -> None:
    # A line must hold at least as many symbols as its histogram has buckets: rows of 2
    # are not classed (their 2 long columns may be).
    sym = _exponents(_scaled_rows(20_000, 2))
    p = classed.plan(sym, 2, 0)
    assert p is None or p.kr == 1
    width = lines.buckets(np.bincount(sym, minlength=256))[1].size
    tall = _exponents(_scaled_rows(width - 1, 3000))  # columns of width - 1 symbols
    p = classed.plan(tall, 3000, 0)
    assert p is None or p.kc == 1
