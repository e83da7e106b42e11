"""Checks real KV blobs and calibration files against the "KV blob" and "KV calibration
file" sections of docs/format.md: parsers written from those sections (header and tensor
tables read from the document) walk blobs produced by ``compress_kv`` and files written by
``Calibration.save``, and cross-check every field against what went in: the front and its
CRC, token ids, scales, each frame's header, model fingerprint (built from the document's
model table) and its chunk CRCs against the true cache values in the documented order,
the guess CRC, and the calibration's tensors and fingerprint."""

from __future__ import annotations

import json
import math
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from test_dist_format_spec import _header_rows as _frame_rows

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.predictive import kvcache, residual
from entropykit.rans import distribution as D

DOC = (Path(__file__).parent.parent / "docs" / "format.md").read_text()
KV = DOC.split("## KV blob", 1)[1].split("\n## ", 1)[0]
CAL = DOC.split("## KV calibration file", 1)[1].split("\n## ", 1)[0]
_SIZES = {1: "B", 2: "H", 4: "I", 8: "Q"}
_DTYPES = {"F32": np.dtype("<f4"), "I8": np.dtype("i1"), "U32": np.dtype("<u4"),
           "I32": np.dtype("<i4")}


def _model() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


MODEL = _model()
GEN = torch.Generator().manual_seed(2)
PREDICTOR = P.EarlyExitPredictor(MODEL, 1)  # layer 0 exact: both kinds of model index
CALIBRATION = P.calibrate(MODEL, PREDICTOR, [torch.randint(0, 128, (64,), generator=GEN)])
IDS = torch.randint(0, 128, (2, 24), generator=GEN)
with torch.inference_mode():
    CACHE = P.from_transformers(MODEL(IDS, use_cache=True).past_key_values)


def _fields(buf: bytes, rows: list[tuple[int, int, str]]) -> dict[str, object]:
    out = {}
    for off, size, name in rows:
        raw = buf[off : off + size]
        out[name] = raw if name == "magic" else struct.unpack("<" + _SIZES[size], raw)[0]
    return out


def _kv_rows(version: int = 2) -> list[tuple[int, int, str]]:
    """The header table of ``version``: the section's first (2) or the "Version 1" one."""
    part = KV.split("### KV header", 1)[1]
    if version == 1:
        part = part.split("**Version 1**", 1)[1]
    table = part.split("| offset |", 1)[1].split("\n\n", 1)[0]
    return [(int(o), int(s), f.strip())
            for o, s, f in re.findall(r"^\| (\d+) \| (\d+) \| ([a-z_ ]+) \|", table, re.M)]


def _codes(field: str) -> dict[int, str]:
    """The codes a header row lists ("1 bf16 or 3 fp8_e4m3", "0 gaussian, 1 mixture")."""
    row = re.search(rf"^\| \d+ \| \d+ \| {field} \| (.*) \|$", KV, re.M)[1]
    return {int(c): n for c, n in re.findall(r"(\d) (\w+)", row)}


# the calibration's suffix `<f>` of each cache format ("KV frames")
_SUFFIX = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp8_e4m3": "fp8",
           "fp8_e5m2": "e5m2"}


def _model_table(kind: str, fmt: str, arrays: dict[str, np.ndarray]) -> tuple:
    """(shapes, emps, weights) of a blob's coder model as the "KV frames" table gives it."""
    suffix = _SUFFIX[fmt]
    row = re.search(r"^\| 2 \* layer \+ kv .*\| ([^|]*) \|$", KV, re.M)[1]
    weights = {k: int(w) for k, w in re.findall(r"(\w+) (?:round\([^)]*\) = )?(\d+)", row)}
    groups = arrays[f"emp_{suffix}"].shape[0]
    gauss = D.gaussian_shape()
    shape = {"gaussian": np.tile(gauss, (groups, 1)),
             "mixture": np.tile(D.gaussian_shape((1.0, 3.0), (0.95, 0.03)), (groups, 1)),
             "conditional": arrays[f"shapes_{suffix}"]}[kind]
    uniform = np.arange(257, dtype=np.int64) << 23
    return (np.concatenate([shape, gauss[None]]),
            np.concatenate([arrays[f"emp_{suffix}"], uniform[None]]),
            [weights[kind]] * groups + [0])


def _sizes(layout: np.ndarray) -> dict[str, int]:
    """C, M and N of the "KV calibration file" section from a layout [L, 2, 2]."""
    hd = [int(h) * int(d) for h, d in layout.reshape(-1, 2)]
    kv_layers = {g // 2 for g, w in enumerate(hd) if w}
    c = m = n = 0
    for g, w in enumerate(hd):
        if w:
            srcs = residual.sources(g // 2, g % 2, kv_layers)
            c += w
            m += sum(hd[2 * layer + kv] for _, layer, kv in srcs) * w
            n += len(srcs) * w
    return {"C": c, "M": m, "N": n}


def read_calibration(path: Path) -> tuple[dict, dict[str, np.ndarray], int]:
    """(metadata object, tensors, fingerprint) of a calibration file, every rule checked."""
    blob = path.read_bytes()
    (hlen,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8 : 8 + hlen])
    meta = json.loads(header.pop("__metadata__")["entropykit_kv_calibration"])
    assert list(meta) == ["version", "predictor", "tokens"] and meta["version"] == 2
    assert isinstance(meta["predictor"], str) and type(meta["tokens"]) is int
    arrays = {}
    for name, e in header.items():
        a, b = e["data_offsets"]
        arrays[name] = np.frombuffer(blob, _DTYPES[e["dtype"]], offset=8 + hlen + a,
                                     count=(b - a) // _DTYPES[e["dtype"]].itemsize
                                     ).reshape(e["shape"])
    layout = arrays["layout"]
    none = layout[..., 0] == 0
    assert (none == (layout[..., 1] == 0)).all() and (none[:, 0] == none[:, 1]).all()
    dims = {"L": layout.shape[0]} | _sizes(layout)
    table = re.findall(r"^\| (\w+)(_<f>)? \| (\w+) \| \[([^\]]+)\] \|", CAL, re.M)
    want = {}
    for name, per_format, dtype, shape in table:
        size = tuple(math.prod(dims[t] if t in dims else int(t) for t in s.split())
                     for s in shape.split(", "))  # "2 L": a product
        for suffix in _SUFFIX.values() if per_format else ("",):
            if not per_format or f"cstd_{suffix}" in arrays:
                want[f"{name}_{suffix}" if per_format else name] = (dtype, size)
    assert {n: (e["dtype"], tuple(e["shape"])) for n, e in header.items()} == want
    crc = zlib.crc32(meta["predictor"].encode())
    for name in sorted(arrays):
        crc = zlib.crc32(arrays[name].tobytes(), zlib.crc32(name.encode(), crc))
    return meta, arrays, crc


def read_blob(blob: bytes, cache: P.KVCache, arrays: dict[str, np.ndarray],
              predictor: P.Predictor = PREDICTOR, ids_want: torch.Tensor = IDS) -> dict:
    """The blob's header fields; every rule of the section checked against ``cache``."""
    version = blob[4]
    rows = _kv_rows(version)
    h = _fields(blob, rows)
    assert h["magic"] == b"EKKV" and h["version"] == version and h["reserved"] == 0
    fmt = _codes("value format")[h["value format"]]
    kind = _codes("residual model")[h["residual model"]]
    L, B, S = h["layers"], h["batch"], h["seq"]
    off = max(o + n for o, n, _ in rows)
    desc = blob[off : off + h["desc_len"]].decode()
    off += h["desc_len"]
    if version == 1:  # one shape for every group, no table
        shapes = [(B, h["heads"], S, h["head_dim"])] * (2 * L)
    else:
        table = np.frombuffer(blob, "<u4", 6 * L, off).reshape(2 * L, 3)
        off += 24 * L
        shapes = [None if hh == 0 else (B, int(hh), int(ss), int(dd)) for hh, ss, dd in table]
    assert shapes == cache.shapes and all(s is None or s[2] <= S for s in shapes)
    ids = np.frombuffer(blob, "<i4", B * S, off).reshape(B, S)
    off += 4 * B * S
    scales = None
    if fmt in ("fp8_e4m3", "fp8_e5m2"):
        scales = np.frombuffer(blob, "<f4", 2 * L, off).reshape(L, 2)
        off += 8 * L
    per = 2 if fmt == "fp32" else 1  # frames a group: fp32's high and low halves
    lengths = struct.unpack_from(f"<{2 * L * per}I", blob, off)
    off += 8 * L * per
    assert struct.unpack_from("<I", blob, off)[0] == zlib.crc32(blob[:off])
    off += 4
    assert off + sum(lengths) == len(blob)
    assert all((shapes[f // per] is None) == (n == 0) for f, n in enumerate(lengths))
    assert desc == predictor.describe() and h["exact"] == predictor.exact_layers
    np.testing.assert_array_equal(ids, ids_want.numpy())
    if scales is not None:
        np.testing.assert_array_equal(scales, cache.scales.numpy())
    model_shapes, emps, weights = _model_table(kind, fmt, arrays)
    fingerprint = zlib.crc32(model_shapes.astype("<u4").tobytes()
                             + emps.astype("<u4").tobytes()
                             + np.asarray(weights, "<i8").tobytes())
    width = 1 if fmt.startswith("fp8") else 2
    for i, length in enumerate(lengths):
        g = i // per
        if shapes[g] is None:
            continue
        frame = blob[off : off + length]
        off += length
        layer, kv = divmod(g, 2)
        t = cache.tensor(layer, kv).contiguous()
        n = math.prod(shapes[g])
        if fmt == "fp32":  # y = bits + 2^15 mod 2^32: high halves, then low halves
            y = t.view(torch.int32).numpy().view(np.uint32).reshape(-1) + np.uint32(1 << 15)
            if i % 2:
                f = _fields(frame, _frame_rows()[:1])
                assert f["magic"] == b"EKRA" and frame[7] in (0, 1)  # one table or per byte
                assert struct.unpack_from("<Q", frame, 8)[0] == 2 * n
                continue
            truth = (y >> 16).astype("<u2").tobytes()
        else:
            truth = (t.view(torch.int16) if width == 2 else t.view(torch.uint8)).numpy().tobytes()
        f = _fields(frame, _frame_rows())
        code = 1 if fmt == "fp32" else h["value format"]  # fp32's high halves: bf16
        assert f["magic"] == b"EKRD" and f["value format"] == code
        assert f["n"] == n and f["fingerprint"] == fingerprint
        # The true tensor, [B, H_g, S_g, D_g] row-major: each chunk's CRC is of its values.
        cs, nc = f["chunk_size"], f["n_chunks"]
        crcs = struct.unpack_from(f"<{nc}I", frame, 28 + 4 * nc)
        for c in range(nc):
            assert crcs[c] == zlib.crc32(truth[c * cs * width : (c + 1) * cs * width])
    guess = predictor.predict(torch.from_numpy(ids.astype(np.int64)))
    crc = 0
    for g, shape in enumerate(shapes):
        if guess is not None and shape is not None:
            t = guess[g // 2][g % 2].float()  # its last S_g tokens, zeros in front if fewer
            t = t[..., -shape[2]:, :] if t.shape[2] >= shape[2] else torch.nn.functional.pad(
                t, (0, 0, shape[2] - t.shape[2], 0))
            crc = zlib.crc32(t.contiguous().numpy().tobytes(), crc)
    assert h["guess_crc"] == crc
    return h | {"fmt": fmt, "kind": kind, "shapes": shapes}


@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("fp8", [False, True])
def test_spec_reader_reads_blobs(kind, fp8, tmp_path):
    cache = P.to_fp8(CACHE) if fp8 else CACHE
    path = tmp_path / "cal.safetensors"
    CALIBRATION.save(path)
    meta, arrays, fingerprint = read_calibration(path)
    assert fingerprint == CALIBRATION.fingerprint and meta["predictor"] == PREDICTOR.describe()
    blob = P.compress_kv(cache, IDS, PREDICTOR, CALIBRATION, model=kind)
    h = read_blob(blob, cache, arrays)
    assert (h["fmt"], h["kind"]) == ("fp8_e4m3" if fp8 else "bf16", kind)
    assert (h["version"], h["layers"], h["batch"], h["seq"]) == (1, 3, 2, 24)
    assert h["shapes"] == [(2, 2, 24, 8)] * 6
    assert h["calibration"] == fingerprint
    assert P.decompress_kv(blob, PREDICTOR, P.Calibration.load(path)).equal(cache)


NEW_CALIBRATION = P.calibrate(MODEL, PREDICTOR, [torch.randint(0, 128, (64,), generator=GEN)],
                              ("fp16", "fp32", "fp8_e5m2"), progress=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e5m2])
@pytest.mark.parametrize("tokens", [24, 20])  # 20: the groups hold the last 20, version 2
def test_spec_reader_reads_blobs_of_the_other_dtypes(dtype, tokens, tmp_path):
    cache = P.KVCache([k[:, :, -tokens:].float() for k in CACHE.keys],
                      [v[:, :, -tokens:].float() for v in CACHE.values])
    gen = torch.Generator().manual_seed(1)
    cache = P.KVCache(*[[t * (1 + 2.0**-10 * torch.randn(t.shape, generator=gen)) for t in ts]
                        for ts in (cache.keys, cache.values)])  # low halves not all alike
    cache = (P.to_fp8(cache, dtype) if dtype == torch.float8_e5m2 else
             P.KVCache([k.to(dtype) for k in cache.keys], [v.to(dtype) for v in cache.values]))
    path = tmp_path / "cal.safetensors"
    NEW_CALIBRATION.save(path)
    _, arrays, fingerprint = read_calibration(path)
    blob = P.compress_kv(cache, IDS, PREDICTOR, NEW_CALIBRATION)
    h = read_blob(blob, cache, arrays)
    assert h["fmt"] == kvcache.DTYPES[dtype] and h["calibration"] == fingerprint
    assert h["version"] == (1 if tokens == 24 else 2)
    assert P.decompress_kv(blob, PREDICTOR, P.Calibration.load(path)).equal(cache)


def test_residual_model_codes_are_the_codes_kinds():
    assert _codes("residual model") == dict(enumerate(P.KINDS))
    codes = _codes("value format")
    assert set(codes.values()) == {"bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "fp32"}
    assert {c: D.FORMATS[n].code for c, n in codes.items() if n != "fp32"} == {
        1: 1, 2: 2, 3: 3, 4: 4}
    assert set(codes.values()) == set(kvcache.DTYPES.values())


BLOB = P.compress_kv(CACHE, IDS, PREDICTOR, CALIBRATION)


def _with_header(**fields: int) -> bytes:
    """BLOB with header fields replaced and the front CRC recomputed (so the field's own
    check is what fails)."""
    b = bytearray(BLOB)
    rows = {name: (off, size) for off, size, name in _kv_rows(1)}
    for name, value in fields.items():
        off, size = rows[name.replace("_", " ") if name not in rows else name]
        struct.pack_into("<" + _SIZES[size], b, off, value)
    h = _fields(BLOB, _kv_rows(1))
    end = 42 + h["desc_len"] + 4 * h["batch"] * h["seq"] + 8 * h["layers"]
    struct.pack_into("<I", b, end, zlib.crc32(b[:end]))
    return bytes(b)


@pytest.mark.parametrize("fields, match", [
    ({"version": 3}, "version"), ({"reserved": 1}, "reserved"),
    ({"value_format": 6}, "value format"), ({"value_format": 2}, "no fp16 fit"),
    ({"residual_model": 3}, "model 3"),
    ({"exact": 4}, "shape fields"), ({"heads": 0}, "shape fields"),
    ({"head_dim": (1 << 12) + 1}, "head dim"), ({"heads": (1 << 10) + 1}, "kv heads"),
    ({"calibration": 1}, "calibration"), ({"guess_crc": 1}, "guess"),
])
def test_documented_header_checks(fields, match):
    with pytest.raises(CorruptDataError, match=match):
        P.decompress_kv(_with_header(**fields), PREDICTOR, CALIBRATION)


def test_caps_are_checked_before_the_front_is_read():
    # A header alone claiming more layers or tokens than the caps: refused on the caps,
    # before the front (which such a blob cannot hold) is sized.
    head = bytearray(BLOB[:42])
    struct.pack_into("<I", head, 8, (1 << 10) + 1)
    with pytest.raises(CorruptDataError, match="layers"):
        P.token_ids(bytes(head))
    head = bytearray(BLOB[:42])
    struct.pack_into("<I", head, 12, 1 << 12)  # batch
    struct.pack_into("<I", head, 20, (1 << 12) + 1)  # seq
    with pytest.raises(CorruptDataError, match="tokens"):
        P.token_ids(bytes(head))


def _write(path: Path, arrays: dict[str, np.ndarray] | None = None,
           meta: str | None = None) -> Path:
    from safetensors.numpy import save_file

    good = json.dumps({"version": 2, "predictor": PREDICTOR.describe(), "tokens": 64})
    save_file(dict(CALIBRATION.arrays) if arrays is None else arrays, str(path),
              metadata={"entropykit_kv_calibration": good if meta is None else meta})
    return path


def _changed(**arrays: np.ndarray | None) -> dict[str, np.ndarray]:
    out = dict(CALIBRATION.arrays)
    for name, a in arrays.items():
        if a is None:
            del out[name]
        else:
            out[name] = a
    return out


_NAN_BIAS = CALIBRATION.arrays["bias"].copy()
_NAN_BIAS[17] = np.nan
_BAD_LAYOUT = CALIBRATION.arrays["layout"].copy()
_BAD_LAYOUT[1, 1, 0] = 0  # values without heads but with a head dim
_NO_KV = CALIBRATION.arrays["layout"].copy()
_NO_KV[1, 0] = 0  # layer 1's keys without KV, its values with
_FLAT_SHAPE = CALIBRATION.arrays["shapes_bf16"].copy()
_FLAT_SHAPE[2, 3000] = 0  # no longer rises from 0 to 2^31 without falling


@pytest.mark.parametrize("arrays, meta, match", [
    (None, "[" * 100_000 + "]" * 100_000, "flat JSON"),          # nesting: RecursionError
    (None, '{"version": 1, "predictor": "x", "tokens": {}}', "flat JSON"),
    (None, '{"version": 1, "predictor": "x"}', "exactly"),          # tokens missing
    (None, '{"version": 1, "version": 1, "predictor": "x", "tokens": 1}', "repeats"),
    (None, '{"version": 3, "predictor": "x", "tokens": 1}', "version 3"),
    (None, '{"version": 1, "predictor": 7, "tokens": 1}', "string"),
    (None, '{"version": true, "predictor": "x", "tokens": 1}', "exactly"),
    (None, "not json {", "not JSON"),
    (_changed(emp_fp8=None), None, "missing"),
    (_changed(extra=np.zeros(3, np.float32)), None, "unknown"),
    (_changed(cond_bf16=CALIBRATION.arrays["cond_bf16"].astype(np.float32)), None, "I8"),
    (_changed(std=CALIBRATION.arrays["std"][:-1]), None, "std"),
    (_changed(layout=None), None, "layout"),
    (_changed(layout=CALIBRATION.arrays["layout"].astype(np.float32)), None, "layout"),
    (_changed(layout=_BAD_LAYOUT), None, "layout"),
    (_changed(layout=_NO_KV), None, "layout"),
    (_changed(layout=CALIBRATION.arrays["layout"][:2]), None, "bias"),
    (_changed(bias=_NAN_BIAS), None, "not finite"),
    (_changed(cstd_fp8=-CALIBRATION.arrays["cstd_fp8"]), None, "negative"),
    (_changed(shapes_bf16=_FLAT_SHAPE), None, "rise"),
])
def test_calibration_load_checks(arrays, meta, match, tmp_path):
    path = _write(tmp_path / "cal.safetensors", arrays, meta)
    with pytest.raises(CorruptDataError, match=match):
        P.Calibration.load(path)


def test_calibration_load_refuses_non_safetensors_files(tmp_path):
    good = _write(tmp_path / "good.safetensors")
    assert P.Calibration.load(good).fingerprint == CALIBRATION.fingerprint
    for name, data in [("zeros", b"\0" * 16), ("cut", good.read_bytes()[:-1]),
                       ("huge", struct.pack("<Q", 1 << 40) + b"{}")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(CorruptDataError, match="safetensors"):
            P.Calibration.load(tmp_path / name)
    from safetensors.numpy import save_file

    save_file({"bias": CALIBRATION.arrays["bias"]}, str(tmp_path / "plain"))
    with pytest.raises(CorruptDataError, match="not an entropykit KV calibration"):
        P.Calibration.load(tmp_path / "plain")


def test_spec_reader_reads_a_sliding_window_blob(tmp_path):
    # Gemma 2: layer 0 slides (the prompt's last 7 tokens), layer 1 holds all 24.
    cfg = transformers.Gemma2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(cfg).to(torch.bfloat16).eval()
    pred = P.FP8Predictor(model)
    cal = P.calibrate(model, pred, [torch.randint(0, 128, (40,), generator=GEN)],
                      formats=("bf16",))
    path = tmp_path / "cal.safetensors"
    cal.save(path)
    _, arrays, fingerprint = read_calibration(path)
    assert fingerprint == cal.fingerprint
    ids = torch.randint(0, 128, (1, 24), generator=GEN)
    with torch.inference_mode():
        cache = P.from_transformers(model(ids, use_cache=True).past_key_values)
    blob = P.compress_kv(cache, ids, pred, cal, model="conditional")
    h = read_blob(blob, cache, arrays, pred, ids)
    assert h["version"] == 2 and h["shapes"] == [(1, 2, 7, 8)] * 2 + [(1, 2, 24, 8)] * 2
    assert P.decompress_kv(blob, pred, cal).equal(cache)
