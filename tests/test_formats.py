"""entropykit.formats: field definitions, exact round trips, input checks, layout detection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from entropykit.formats import DTYPES, LAYOUTS, Field, join, layout_for, split

ITEMSIZE = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8,
}
INT_DTYPES = ["U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"]


def as_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(-1)


def roundtrip(dtype: str, raw: np.ndarray, layout: str | None = None) -> list[Field]:
    fields = split(dtype, raw, layout=layout)
    back = join(dtype, {f.name: f.symbols for f in fields}, raw.size, layout=layout)
    assert back.dtype == np.uint8 and back.shape == (raw.size,)
    np.testing.assert_array_equal(back, raw.reshape(-1))
    return fields


def reference(dtype: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Fields by independent numpy bit arithmetic, from the definitions in the docstrings."""
    w = ITEMSIZE[dtype]
    planes = raw.reshape(-1, w)
    out = {f"byte{k}": planes[:, k] for k in range(w)}
    if dtype in ("BF16", "F32"):
        u = raw.view("<u2" if dtype == "BF16" else "<u4").astype(np.uint64)
        top = 8 * (w - 1)
        out.pop(f"byte{w - 1}")
        out.pop(f"byte{w - 2}")
        out["exponent"] = ((u >> (top - 1)) & 0xFF).astype(np.uint8)
        sign = (u >> (8 * w - 1)) << 7
        out["sign_mantissa"] = (sign | ((u >> (top - 8)) & 0x7F)).astype(np.uint8)
    return out


def specials(dtype: str) -> np.ndarray:
    """Adversarial bit patterns of a float dtype: NaN payloads, +-0, +-inf, subnormals."""
    if dtype in ("BF16", "F16"):
        return as_bytes(np.arange(1 << 16, dtype="<u2"))  # every pattern
    if dtype.startswith("F8"):
        np_dtype = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
                    "F8_E8M0": ml_dtypes.float8_e8m0fnu}[dtype]
        info = ml_dtypes.finfo(np_dtype)
        values = np.array([0.0, -0.0, float("nan"), float("inf"), -float("inf"), info.max,
                           -info.max, info.tiny, info.smallest_subnormal, 1.0, -1.0],
                          np.float32).astype(np_dtype)
        return np.concatenate([as_bytes(values), np.arange(256, dtype=np.uint8)])
    uint, bits, mant = ("<u4", 32, 23) if dtype == "F32" else ("<u8", 64, 52)
    one = np.uint64(1)
    sign, exp_all = one << np.uint64(bits - 1), ((one << np.uint64(bits - 1 - mant)) - one)
    exp_all <<= np.uint64(mant)
    mant_all = (one << np.uint64(mant)) - one
    patterns = [0, sign, exp_all, exp_all | sign,  # +-0, +-inf
                exp_all | one, exp_all | mant_all, exp_all | sign | np.uint64(12345),  # NaNs
                exp_all | (one << np.uint64(mant - 1)),  # quiet NaN
                one, mant_all, sign | one, sign | mant_all,  # subnormals
                one << np.uint64(mant), exp_all - one, ~np.uint64(0)]  # min normal, max, all ones
    rng = np.random.default_rng(7)
    rand = rng.integers(0, 1 << 63, 1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return as_bytes(np.concatenate([np.array(patterns, np.uint64), rand]).astype(uint))


# Field definitions -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["BF16", "F32", "F16", "F64"])
def test_float_fields_match_bit_definitions(dtype):
    raw = specials(dtype)
    fields = roundtrip(dtype, raw)
    ref = reference(dtype, raw)
    assert sorted(f.name for f in fields) == sorted(ref)
    for f in fields:
        np.testing.assert_array_equal(f.symbols, ref[f.name], err_msg=f.name)


def test_bf16_field_values_of_known_numbers():
    raw = as_bytes(np.array([1.0, -2.0, 0.0, -0.0], ml_dtypes.bfloat16))
    exponent, sign_mantissa = split("BF16", raw)
    assert exponent.symbols.tolist() == [127, 128, 0, 0]
    assert sign_mantissa.symbols.tolist() == [0, 128, 0, 128]


def test_names_contexts_and_order():
    layouts = {d: [f.name for f in split(d, np.zeros(ITEMSIZE[d], np.uint8))] for d in DTYPES}
    assert layouts["BF16"] == ["exponent", "sign_mantissa"]
    assert layouts["F32"] == ["exponent", "sign_mantissa", "byte1", "byte0"]
    assert layouts["F16"] == ["byte1", "byte0"]
    assert layouts["I64"] == [f"byte{k}" for k in range(7, -1, -1)]
    for d in ("F8_E4M3", "F8_E5M2", "F8_E8M0", "U8", "I8", "BOOL"):
        assert layouts[d] == ["byte0"]
    for d in DTYPES:
        fields = split(d, np.zeros(ITEMSIZE[d], np.uint8))
        for i, f in enumerate(fields):
            assert f.context is None or f.context in [g.name for g in fields[:i]]
    contexts = {f.name: f.context for f in split("BF16", np.zeros(2, np.uint8))}
    assert contexts == {"exponent": None, "sign_mantissa": "exponent"}
    assert set(DTYPES) == set(ITEMSIZE)


def test_fields_are_uint8_one_dimensional():
    raw = np.arange(64, dtype=np.uint8).reshape(4, 16)  # any shape is read as its bytes
    for d in DTYPES:
        for f in split(d, raw):
            assert f.symbols.dtype == np.uint8
            assert f.symbols.shape == (64 // ITEMSIZE[d],)


# Exact round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_adversarial_roundtrip(dtype):
    if dtype in ("BF16", "F16", "F32", "F64") or dtype.startswith("F8"):
        raw = specials(dtype)
    elif dtype == "BOOL":
        raw = np.array([0, 1, 2, 127, 128, 255], np.uint8)  # stray bytes pass through too
    else:
        np_dtype = np.dtype(f"<{dtype[0].lower()}{ITEMSIZE[dtype]}")
        info = np.iinfo(np_dtype)
        raw = as_bytes(np.array([0, 1, info.max, info.min, info.max - 1, info.min + 1], np_dtype))
    roundtrip(dtype, raw)


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_sizes_around_vector_tails(dtype):
    rng = np.random.default_rng(1)
    w = ITEMSIZE[dtype]
    for n in [*range(0, 70), 127, 128, 129, 4095, 4096, 4097]:
        roundtrip(dtype, rng.integers(0, 256, n * w, dtype=np.uint8))


def test_all_ones_and_all_zeros_every_width():
    for d in DTYPES:
        for byte in (0x00, 0xFF, 0x80, 0x7F):
            roundtrip(d, np.full(40 * ITEMSIZE[d], byte, np.uint8))


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_empty_tensor(dtype):
    fields = split(dtype, np.zeros(0, np.uint8))
    assert fields and all(f.symbols.shape == (0,) for f in fields)
    out = join(dtype, {f.name: f.symbols for f in fields}, 0)
    assert out.dtype == np.uint8 and out.shape == (0,)


@given(dtype=st.sampled_from(sorted(ITEMSIZE)), data=st.binary(max_size=600))
@settings(max_examples=300, deadline=None)
def test_roundtrip_property(dtype, data):
    w = ITEMSIZE[dtype]
    raw = np.frombuffer(data[: len(data) - len(data) % w], np.uint8)  # read-only input
    fields = roundtrip(dtype, raw)
    ref = reference(dtype, raw)
    for f in fields:
        np.testing.assert_array_equal(f.symbols, ref[f.name])


def test_unaligned_and_strided_input():
    rng = np.random.default_rng(2)
    buf = rng.integers(0, 256, 2 * 8000 + 1, dtype=np.uint8)
    for d in ("BF16", "F32", "F64", "I16"):
        n = 8 * 1000
        aligned = buf[:n].copy()
        unaligned = buf[1 : n + 1]
        assert not unaligned.view(np.dtype(f"<u{ITEMSIZE[d]}")).flags.aligned
        np.testing.assert_array_equal(
            [f.symbols for f in roundtrip(d, unaligned)],
            [f.symbols for f in split(d, buf[1 : n + 1].copy())],
        )
        strided = buf[: 2 * n : 2]  # not contiguous: read as its elements' bytes
        np.testing.assert_array_equal(join(d, {f.name: f.symbols for f in split(d, strided)},
                                           n), strided)
        roundtrip(d, aligned)


def test_join_accepts_mixed_readonly_and_noncontiguous_fields():
    raw = np.random.default_rng(3).integers(0, 256, 4 * 500, dtype=np.uint8)
    fields = {f.name: f.symbols for f in split("F32", raw)}
    fields["exponent"] = np.frombuffer(fields["exponent"].tobytes(), np.uint8)  # read-only
    wide = np.zeros(1000, np.uint8)
    wide[::2] = fields["byte0"]
    fields["byte0"] = wide[::2]  # strided
    np.testing.assert_array_equal(join("F32", fields, raw.size), raw)


def test_one_byte_split_is_a_view_and_join_a_copy():
    raw = np.arange(10, dtype=np.uint8)
    (field,) = split("F8_E4M3", raw)
    assert np.shares_memory(field.symbols, raw)
    out = join("F8_E4M3", {"byte0": field.symbols}, 10)
    assert not np.shares_memory(out, raw)


@pytest.mark.parametrize("dtype", ["BF16", "F32", "F8_E4M3", "I64"])
def test_join_into_out_writes_that_array(dtype):
    raw = np.random.default_rng(4).integers(0, 256, 8 * 300, dtype=np.uint8)
    fields = {f.name: f.symbols.copy() for f in split(dtype, raw)}
    buf = np.zeros(raw.size + 16, np.uint8)
    got = join(dtype, fields, raw.size, out=buf[8:-8])
    assert np.shares_memory(got, buf)
    np.testing.assert_array_equal(buf[8:-8], raw)
    assert not buf[:8].any() and not buf[-8:].any()  # nothing written outside out
    for bad in (np.zeros(raw.size - 1, np.uint8), np.zeros(raw.size, np.int8),
                np.zeros(2 * raw.size, np.uint8)[::2], np.frombuffer(bytes(raw.size), np.uint8)):
        with pytest.raises(ValueError, match="out must be"):
            join(dtype, fields, raw.size, out=bad)


# Rejected input ----------------------------------------------------------------------------

def test_unknown_dtype_and_layout():
    with pytest.raises(ValueError, match="'F4'"):
        split("F4", np.zeros(2, np.uint8))
    with pytest.raises(ValueError, match="'C64'"):
        join("C64", {}, 0)
    with pytest.raises(ValueError, match="'nf4'"):
        split("U8", np.zeros(2, np.uint8), layout="nf4")
    with pytest.raises(ValueError, match="integer dtype"):
        split("BF16", np.zeros(2, np.uint8), layout="mxfp4")
    with pytest.raises(ValueError, match="integer dtype"):
        join("BOOL", {"nibble_pair": np.zeros(2, np.uint8)}, 2, layout="int4")


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32", "F64", "I16", "U32", "I64"])
def test_byte_count_must_be_whole_elements(dtype):
    w = ITEMSIZE[dtype]
    with pytest.raises(ValueError, match="multiple"):
        split(dtype, np.zeros(3 * w + 1, np.uint8))
    fields = {f.name: f.symbols for f in split(dtype, np.zeros(3 * w, np.uint8))}
    with pytest.raises(ValueError, match="cannot have"):
        join(dtype, fields, 3 * w + 1)
    with pytest.raises(ValueError, match="cannot have"):
        join(dtype, fields, -w)


@pytest.mark.parametrize("dtype", sorted(ITEMSIZE))
def test_join_rejects_wrong_field_lengths(dtype):
    w = ITEMSIZE[dtype]
    fields = {f.name: f.symbols.copy() for f in split(dtype, np.zeros(5 * w, np.uint8))}
    for name in fields:
        for bad in (np.zeros(4, np.uint8), np.zeros(6, np.uint8), np.zeros((5, 1), np.uint8)):
            with pytest.raises(ValueError, match=name):
                join(dtype, {**fields, name: bad}, 5 * w)
    assert join(dtype, fields, 5 * w).size == 5 * w


def test_join_rejects_missing_extra_and_mistyped_fields():
    fields = {f.name: f.symbols for f in split("BF16", np.zeros(8, np.uint8))}
    with pytest.raises(ValueError, match="missing \\['sign_mantissa'\\]"):
        join("BF16", {"exponent": fields["exponent"]}, 8)
    with pytest.raises(ValueError, match="unexpected \\['byte0'\\]"):
        join("BF16", {**fields, "byte0": fields["exponent"]}, 8)
    with pytest.raises(TypeError, match="exponent"):
        join("BF16", {**fields, "exponent": fields["exponent"].astype(np.int16)}, 8)
    with pytest.raises(TypeError, match="exponent"):
        join("BF16", {**fields, "exponent": [0, 0, 0, 0]}, 8)


def test_split_rejects_non_uint8_input():
    with pytest.raises(TypeError):
        split("BF16", np.zeros(4, np.uint16))
    with pytest.raises(TypeError):
        split("U8", b"\x00\x01")


# Packed 4-bit ------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_packed_layouts_split_each_byte_as_a_pair(layout):
    raw = np.arange(256, dtype=np.uint8)
    for dtype, n in (("U8", 255), ("U8", 1), ("I32", 256), ("U32", 0)):
        (field,) = roundtrip(dtype, raw[:n], layout=layout)
        assert field.name == "nibble_pair" and field.context is None
        np.testing.assert_array_equal(field.symbols, raw[:n])
    with pytest.raises(ValueError, match="multiple"):
        split("I32", raw[:6], layout=layout)


def test_layout_for_mxfp4():
    names = {"m.experts.gate_up_proj_blocks", "m.experts.gate_up_proj_scales",
             "m.experts.down_proj_blocks"}
    assert layout_for("m.experts.gate_up_proj_blocks", "U8", (32, 5760, 90, 16), names) == "mxfp4"
    # no *_scales sibling, wrong dtype, or not 16 bytes (32 codes) per block
    assert layout_for("m.experts.down_proj_blocks", "U8", (32, 2880, 90, 16), names) is None
    assert layout_for("m.experts.gate_up_proj_blocks", "I8", (32, 5760, 90, 16), names) is None
    assert layout_for("m.experts.gate_up_proj_blocks", "U8", (32, 5760, 90, 8), names) is None
    assert layout_for("m.experts.gate_up_proj_blocks", "U8", (), names) is None


def test_layout_for_nvfp4_and_int4():
    nv = ["l.0.q_proj.weight_packed", "l.0.q_proj.weight_scale", "l.0.q_proj.weight_global_scale"]
    assert layout_for("l.0.q_proj.weight_packed", "U8", (64, 32), nv) == "nvfp4"
    assert layout_for("l.0.q_proj.weight_packed", "I32", (64, 8), nv) == "int4"
    assert layout_for("l.0.q_proj.weight_packed", "BF16", (64, 32), nv) is None
    assert layout_for("l.0.k_proj.weight_packed", "U8", (64, 32), nv) is None  # no scale
    gptq = {"l.0.q_proj.qweight", "l.0.q_proj.qzeros", "l.0.q_proj.scales", "l.0.q_proj.g_idx"}
    assert layout_for("l.0.q_proj.qweight", "I32", (8, 64), gptq) == "int4"
    assert layout_for("l.0.q_proj.qweight", "I32", (8, 64), gptq - {"l.0.q_proj.qzeros"}) is None
    assert layout_for("l.0.q_proj.qweight", "F16", (8, 64), gptq) is None
    for plain in ("l.0.q_proj.weight", "l.0.q_proj.weight_scale", "l.0.q_proj.qzeros"):
        assert layout_for(plain, "U8", (8, 8), nv + sorted(gptq)) is None


@pytest.mark.parametrize("word", [2, 4, 8])
@pytest.mark.parametrize("sign_move", [False, True])
def test_small_arrays_split_and_join_in_numpy_as_the_kernels_do(word, sign_move):
    from entropykit.formats import _planes

    rng = np.random.default_rng(word)
    for n in (1, 31, 1000, _planes.SMALL - 1):
        raw = rng.integers(0, 256, n * word, dtype=np.uint8)
        raw[:word] = 0xFF  # -1, then the most negative value
        raw[word:2 * word] = ([0] * (word - 1) + [0x80])[: raw[word:2 * word].size]
        words = _planes.int_view(raw[: n * word], word)
        kernel = np.empty((word, n), np.uint8)
        small = np.empty((word, n), np.uint8)
        _planes.split_planes(words, sign_move, tuple(kernel))
        _planes.split_words(words, sign_move, tuple(small))
        assert np.array_equal(small, kernel)
        back = np.empty_like(words)
        _planes.join_words(tuple(small), sign_move, back)
        assert np.array_equal(back, words)


_SMALL_ONLY = """
import numpy as np
from entropykit.formats import _planes, join, split
for dtype in ("I64", "F32", "BF16", "U16"):
    raw = np.arange(8 * 512, dtype=np.uint8)
    fields = split(dtype, raw)
    assert np.array_equal(join(dtype, {f.name: f.symbols for f in fields}, raw.size), raw)
print(len(_planes.split_planes.signatures), len(_planes.join_planes.signatures))
"""


def test_a_small_tensor_compiles_no_plane_kernel():
    # A checkpoint's one small I64 buffer (position ids) compiled both kernels for 8-byte
    # words on a cold start; so did the empty split that only names a dtype's fields.
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", _SMALL_ONLY], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "0"]
