"""Tests of entropykit.analysis: numbers against an independent numpy computation.

The reference here never uses entropykit.formats: it takes the fields apart with its own
bit arithmetic on the dtype's integer view, counts with np.bincount and takes log2.
"""

from __future__ import annotations

import json
import math
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from _entropy import h as _h  # tests/ is on sys.path under pytest
from _entropy import h_given as _h_given
from safetensors.torch import save_file

from entropykit import CorruptDataError
from entropykit.analysis import Report, analyze, counts
from entropykit.analysis.roles import role_of

# --- the independent reference ----------------------------------------------------------


def _fields_ref(dtype: str, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Field name -> symbols, from the dtype's bit layout (entropykit.formats)."""
    if dtype in ("BF16", "F16"):
        u = raw.view("<u2").astype(np.int64)
        if dtype == "F16":
            return {"byte1": u >> 8, "byte0": u & 0xFF}
        return {"exponent": (u >> 7) & 0xFF, "sign_mantissa": ((u >> 8) & 0x80) | (u & 0x7F)}
    if dtype == "F32":
        u = raw.view("<u4").astype(np.int64)
        return {"exponent": (u >> 23) & 0xFF,
                "sign_mantissa": ((u >> 24) & 0x80) | ((u >> 16) & 0x7F),
                "byte1": (u >> 8) & 0xFF, "byte0": u & 0xFF}
    if dtype == "I64":
        u = raw.view("<u8")
        return {f"byte{k}": ((u >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.int64)
                for k in range(7, -1, -1)}
    return {"byte0": raw.astype(np.int64)}  # one-byte dtypes




_CONTEXT = {"sign_mantissa": "exponent"}
_NP = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
       "F8_E5M2": ml_dtypes.float8_e5m2}


def _check_row(row, raw: np.ndarray) -> None:
    ref = _fields_ref(row.dtype, raw)
    assert [f.name for f in row.fields] == list(ref)
    carried = 0.0
    for f in row.fields:
        sym = ref[f.name]
        assert f.symbols == sym.size
        assert f.hist == tuple(np.bincount(sym, minlength=256).tolist())
        assert f.distinct == np.unique(sym).size
        assert f.entropy == pytest.approx(_h(sym), abs=1e-9)
        if f.name in _CONTEXT:
            ctx = ref[_CONTEXT[f.name]]
            assert f.context == _CONTEXT[f.name]
            assert f.conditional == pytest.approx(_h_given(ctx, sym), abs=1e-9)
            # The coder's classes sit between the full conditional and no context.
            assert f.conditional - 1e-9 <= f.coder <= f.entropy + 1e-9
            carried += f.conditional * sym.size
        else:
            assert f.conditional is None and f.coder is None
            carried += f.entropy * sym.size
    assert row.carried_bits == pytest.approx(carried, rel=1e-12, abs=1e-6)
    assert row.allocated_bits == 8 * raw.size
    if raw.size:
        assert row.ratio == pytest.approx(carried / (8 * raw.size), rel=1e-12, abs=1e-12)


def _log2_ref(dtype: str, raw: np.ndarray) -> tuple[dict[int, int], int, int]:
    with np.errstate(invalid="ignore"):
        v = np.abs(raw.view(_NP[dtype]).astype(np.float64))
    finite = np.isfinite(v)
    nz = finite & (v > 0)
    k = np.floor(4 * np.log2(v[nz])).astype(np.int64)
    bins, c = np.unique(k, return_counts=True)
    zeros, nonfinite = int((v == 0).sum()), int((~finite).sum())
    return dict(zip(bins.tolist(), c.tolist(), strict=True)), zeros, nonfinite


# --- test inputs -----------------------------------------------------------------------


def _model_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A tiny transformer-shaped state dict, torch default init, cast to ``dtype``."""
    torch.manual_seed(0)
    out = {}
    emb = torch.nn.Embedding(300, 64)
    out["model.embed_tokens.weight"] = emb.weight
    for i in range(2):
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"model.layers.{i}.self_attn.{p}.weight"] = torch.nn.Linear(64, 64).weight
        out[f"model.layers.{i}.mlp.up_proj.weight"] = torch.nn.Linear(64, 160).weight
        out[f"model.layers.{i}.mlp.down_proj.weight"] = torch.nn.Linear(160, 64).weight
        out[f"model.layers.{i}.input_layernorm.weight"] = 1 + 0.02 * torch.randn(64)
    out = {k: v.detach() for k, v in out.items()}
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        fmax = torch.finfo(dtype).max
        out = {k: v / v.abs().max() * fmax for k, v in out.items()}
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("analysis")
    out = {}
    for name, dt in _TORCH.items():
        tensors = _model_tensors(dt)
        tensors["position_ids"] = torch.arange(512, dtype=torch.int64)[None]
        path = root / f"{name.lower()}.safetensors"
        save_file(tensors, str(path))
        out[name] = (path, tensors)
    return out


# --- numbers against the reference ---------------------------------------------------


@pytest.mark.parametrize("dtype", list(_TORCH))
def test_file_numbers_match_independent_computation(files, dtype):
    path, tensors = files[dtype]
    rep = analyze(path)
    assert {r.name for r in rep.rows} == set(tensors)
    assert not rep.skipped
    for row in rep.rows:
        t = tensors[row.name]
        assert row.dtype == ("I64" if row.name == "position_ids" else dtype)
        assert row.shape == tuple(t.shape) and row.file == str(path)
        _check_row(row, _raw(t))
    total_bits = sum(r.carried_bits for r in rep.rows)
    assert rep.total.carried_bits == pytest.approx(total_bits, rel=1e-12)
    assert rep.total.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F8_E4M3", "F8_E5M2"])
def test_log2_histogram_matches_values(files, dtype):
    path, tensors = files[dtype]
    for row in analyze(path).rows:
        if row.dtype == "I64":
            assert row.log2 is None
            continue
        bins, zeros, nonfinite = _log2_ref(dtype, _raw(tensors[row.name]))
        assert dict(row.log2.bins) == bins
        assert (row.log2.zeros, row.log2.nonfinite) == (zeros, nonfinite)
        assert sum(row.log2.octaves().values()) + zeros + nonfinite == row.elements


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F8_E4M3", "F8_E5M2"])
def test_special_values(dtype):
    """+-0, +-inf, NaN payloads, subnormals and the extremes, every bit pattern once."""
    bits = 16 if dtype in ("BF16", "F16") else 8
    raw = np.arange(1 << bits, dtype=f"<u{bits // 8}").view(np.uint8)
    row = analyze(raw, dtype=dtype, name="all_patterns").rows[0]
    _check_row(row, raw)
    bins, zeros, nonfinite = _log2_ref(dtype, raw)
    assert (dict(row.log2.bins), row.log2.zeros, row.log2.nonfinite) == (bins, zeros, nonfinite)
    assert zeros == 2 and nonfinite > 0


def test_pooled_group_entropy(files):
    path, tensors = files["BF16"]
    groups = {g.key: g for g in analyze(path).groups("dtype")}
    bf16 = groups["BF16"]
    raws = [_raw(t) for t in tensors.values() if t.dtype == torch.bfloat16]
    ref = _fields_ref("BF16", np.concatenate(raws))
    assert bf16.tensors == len(raws)
    for gf in bf16.fields:
        sym = ref[gf.name]
        assert gf.symbols == sym.size
        assert gf.pooled_bits == pytest.approx(_h(sym) * sym.size, rel=1e-12)
        # Per-tensor tables never lose to one pooled table in entropy terms.
        assert gf.entropy_bits <= gf.pooled_bits + 1e-6


def test_roles_group_every_tensor(files):
    path, tensors = files["F32"]
    rep = analyze(path)
    groups = {g.key: g for g in rep.groups("role")}
    assert set(groups) == {"embeddings", "attention", "mlp", "norms", "other"}
    assert groups["attention"].tensors == 8 and groups["mlp"].tensors == 4
    assert groups["norms"].tensors == 2
    assert groups["embeddings"].tensors == 1
    assert groups["other"].tensors == 1  # position_ids
    assert sum(g.nbytes for g in groups.values()) == rep.nbytes


@pytest.mark.parametrize(("name", "role"), [
    ("model.layers.3.self_attn.k_proj.weight", "attention"),
    ("encoder.layer.0.attention.output.LayerNorm.bias", "norms"),
    ("encoder.layer.0.output.dense.weight", "mlp"),
    ("encoder.layer.0.attention.output.dense.weight", "attention"),
    ("model.layers.0.mlp.experts.gate_up_proj_scales", "scales"),
    ("model.layers.0.self_attn.q_proj.weight_scale", "scales"),
    ("transformer.h.0.ln_1.weight", "norms"),
    ("lm_head.weight", "embeddings"),
    ("pooler.dense.weight", "other"),
])
def test_role_of(name, role):
    assert role_of(name) == role


def test_inputs_agree(files):
    """A file, a torch tensor, a numpy array, raw bytes with a dtype name and a mapping."""
    path, tensors = files["BF16"]
    name = "model.layers.0.mlp.up_proj.weight"
    t = tensors[name]
    want = next(r for r in analyze(path).rows if r.name == name)
    arr = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    got = [analyze(t, name=name).rows[0], analyze(arr, name=name).rows[0],
           analyze(_raw(t), dtype="BF16", name=name).rows[0],
           analyze({name: t}).rows[0]]
    for g in got:
        assert g.fields == want.fields and g.log2 == want.log2 and g.role == "mlp"
        assert g.file is None
    assert got[0].shape == got[1].shape == want.shape == (160, 64)
    assert got[2].shape == (160 * 64,)


def test_slices_do_not_change_counts(files, monkeypatch):
    path, _ = files["F32"]
    whole = analyze(path)
    monkeypatch.setattr(counts, "SLICE_BYTES", 24)  # many slices, ragged last one
    assert analyze(path).rows == whole.rows


@pytest.mark.parametrize("n", [0, 1, 3])
def test_tiny_tensors(n):
    raw = np.arange(2 * n, dtype=np.uint8)
    row = analyze(raw, dtype="BF16").rows[0]
    assert row.elements == n and all(f.symbols == n for f in row.fields)
    if n <= 1:
        assert row.carried_bits == 0.0 and row.ratio == (1.0 if n == 0 else 0.0)
    _check_row(row, raw)


def test_bad_inputs():
    with pytest.raises(ValueError, match="dtype"):
        analyze(np.zeros(3, np.complex64))
    with pytest.raises(ValueError, match="whole number"):
        analyze(np.zeros(3, np.uint8), dtype="BF16")
    with pytest.raises(ValueError, match="unknown safetensors dtype"):
        analyze(np.zeros(4, np.uint8), dtype="Q4")


def _safetensors(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize(("blob", "what"), [
    (b"", "0 bytes, too short"),
    (b"\x10\x00\x00", "3 bytes, too short"),
    (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776 does not fit"),
    (struct.pack("<Q", 4) + b"{]}x", "not UTF-8 JSON"),
    (struct.pack("<Q", 2) + b"[]", "header is not a JSON object"),
    (_safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4),
     "tensors end at byte 77, file has 73 bytes"),
    (_safetensors({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
     "F32\\[3\\] needs 12 bytes"),
    (_safetensors({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8),
     "non-negative"),
    (_safetensors({"a": [1]}, b""), "entry must have"),
])
def test_corrupt_files(tmp_path, blob, what):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(blob)
    with pytest.raises(CorruptDataError, match=f"^{p}: not a valid safetensors file: .*{what}"):
        analyze(p)


def test_unknown_dtype_is_skipped(tmp_path):
    p = tmp_path / "c.safetensors"
    p.write_bytes(_safetensors({"z": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]},
                                "a": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]}},
                               b"\1" * 10))
    rep = analyze(p)
    assert [r.name for r in rep.rows] == ["a"]
    assert [(s.name, s.dtype, s.nbytes) for s in rep.skipped] == [("z", "C64", 8)]


def test_directory(files, tmp_path):
    for name in ("BF16", "F16"):
        (tmp_path / files[name][0].name).write_bytes(files[name][0].read_bytes())
    rep = analyze(tmp_path)
    assert len(rep.rows) == 2 * len(files["BF16"][1])
    assert {r.file for r in rep.rows} == {str(tmp_path / "bf16.safetensors"),
                                          str(tmp_path / "f16.safetensors")}
    with pytest.raises(FileNotFoundError):
        analyze(tmp_path / "bf16.safetensors.missing")


def test_packed_layout_detected_and_overridden(tmp_path):
    rng = np.random.default_rng(1)
    blocks = torch.from_numpy(rng.integers(0, 256, (4, 8, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(118, 130, (4, 8), dtype=np.uint8))
    p = tmp_path / "mx.safetensors"
    save_file({"mlp.experts.w_blocks": blocks, "mlp.experts.w_scales": scales}, str(p))
    rows = {r.name: r for r in analyze(p).rows}
    b = rows["mlp.experts.w_blocks"]
    assert (b.layout, b.kind, [f.name for f in b.fields]) == ("mxfp4", "U8:mxfp4",
                                                               ["nibble_pair"])
    assert b.fields[0].entropy == pytest.approx(_h(_raw(blocks).astype(np.int64)), abs=1e-9)
    assert rows["mlp.experts.w_scales"].role == "scales"
    over = analyze(p, layouts={"mlp.experts.w_blocks": None}).rows
    assert {r.name: r.layout for r in over}["mlp.experts.w_blocks"] is None


# --- JSON and table ------------------------------------------------------------------


def test_json_round_trip(files):
    rep = analyze(files["F32"][0])
    text = rep.to_json()
    back = Report.from_json(text)
    assert back == rep
    assert back.to_json() == text
    d = json.loads(text)
    assert d["schema"] == "entropykit.analysis/1"
    t0 = d["tensors"][0]
    assert set(t0) >= {"name", "dtype", "role", "fields", "ratio", "carried_bits", "log2"}
    assert math.isclose(d["total"]["ratio"], rep.total.ratio)
    with pytest.raises(ValueError, match="schema"):
        Report.from_json(json.dumps({**d, "schema": "other/1"}))


def test_table_lists_tensors_and_groups(files):
    path, tensors = files["BF16"]
    rep = analyze(path)
    full = rep.to_table(top=None)
    for name in tensors:
        assert name in full
    for key in ("BF16", "I64", "attention", "mlp", "norms", "total"):
        assert key in full
    top2 = rep.to_table(top=2)
    largest = sorted(rep.rows, key=lambda r: (-r.nbytes, r.name))
    assert largest[0].name in top2 and largest[1].name in top2
    assert largest[2].name not in top2


# --- a compressed file: what entropykit achieved against the bound -------------------


def test_compressed_file_shows_achieved(files, tmp_path):
    from safetensors import safe_open

    from entropykit.container import compress_file

    src = files["BF16"][0]
    dst = tmp_path / "bf16.ek.safetensors"
    compress_file(src, dst, threads=1)
    plain, packed = analyze(src), analyze(dst)
    by_name = {r.name: r for r in plain.rows}
    with safe_open(str(dst), framework="np") as f:
        payload = {k: f.get_slice(k).get_shape()[0] for k in f.keys()}  # U8 payloads
    for r in packed.rows:
        p = by_name[r.name]
        assert (r.dtype, r.shape, r.fields, r.log2) == (p.dtype, p.shape, p.fields, p.log2)
        assert p.coded is None and r.coded == payload[r.name]
    assert packed.total.coded == sum(payload.values())
    assert plain.total.coded is None
    table = packed.to_table(None)
    assert "coded" in table and "vs bound" in table
    assert f"{packed.total.coded / packed.total.nbytes:.4f}" in table
    assert Report.from_json(packed.to_json()) == packed


# --- plots and the command line ------------------------------------------------------


def test_plot_png_and_html(files, tmp_path):
    from entropykit.analysis.plots import plot

    rep = analyze(files["F8_E4M3"][0])
    png = plot(rep, tmp_path / "a.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    page = plot(rep, tmp_path / "a.html", top=None).read_text()
    assert page.count("data:image/png;base64,") == 1
    assert "model.layers.1.mlp.down_proj.weight" in page
    with pytest.raises(ValueError, match=r"\.png or \.html"):
        plot(rep, tmp_path / "a.jpg")


def test_cli(files, tmp_path, capsys):
    from entropykit.analysis.cli import main

    path, tensors = files["BF16"]
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    assert main([str(path), "--json", str(out_json), "--plot", str(out_png), "--top", "0"]) == 0
    stdout = capsys.readouterr().out
    for name in tensors:
        assert name in stdout
    rep = Report.from_json(out_json.read_text())
    assert rep.rows == analyze(path).rows
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    assert main([str(path), "--top", "2"]) == 0
    stdout = capsys.readouterr().out
    assert len([n for n in tensors if n in stdout]) == 2
    assert main([str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main([str(path), "--plot", str(tmp_path / "x.svg")]) == 2
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x01" * 12)
    assert main([str(bad)]) == 1
    assert "not a valid safetensors file" in capsys.readouterr().err
