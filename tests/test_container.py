"""The compressed safetensors container: byte-exact round trips of real safetensors files
(every dtype entropykit.formats splits, adversarial bit patterns, odd headers, many segments,
1 and 2 threads), the compressed file as a valid safetensors file, and atomic output.

The builders here (``all_dtypes``, ``write_raw``) are shared with test_api.py/test_cli.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from entropykit.container import codecs, files, record, writer
from entropykit.container import header as hdr
from entropykit.container.reader import Compressed


def _bits(dtype: torch.dtype, words: np.ndarray) -> torch.Tensor:
    """A tensor of ``dtype`` with exactly the given bit patterns."""
    return torch.from_numpy(words.copy()).view(dtype)


def adversarial(dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern for 8- and 16-bit floats; for F32/F64 NaN payloads, +-0, +-inf,
    subnormals, extremes, and random words."""
    size = torch.empty(0, dtype=dtype).element_size()
    rng = np.random.default_rng(size)
    if size == 1:
        return _bits(dtype, np.arange(256, dtype=np.uint8))
    if size == 2:
        return _bits(dtype, np.arange(1 << 16, dtype=np.uint32).astype(np.uint16))
    if size == 4:
        special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF,
                   0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x00800000, 0x7FA5A5A5]
        words = np.concatenate([np.array(special, np.uint32),
                                rng.integers(0, 1 << 32, 5000, dtype=np.uint32)])
        return _bits(dtype, words)
    special = [0, 1 << 63, 0x7FF0 << 48, 0xFFF0 << 48, (0x7FF8 << 48) | 12345, 1, (1 << 64) - 1]
    words = np.concatenate([np.array(special, np.uint64),
                            rng.integers(0, 1 << 63, 3000, dtype=np.uint64)])
    return _bits(dtype, words)


def all_dtypes(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small realistic tensors of every dtype entropykit.formats splits, plus packed
    4-bit tensors under the names that select their layouts, plus edge shapes."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(64, 96, generator=g) * 0.02
    t: dict[str, torch.Tensor] = {}
    for name, dt in [("bf16", torch.bfloat16), ("f16", torch.float16), ("f32", torch.float32),
                     ("f64", torch.float64), ("e4m3", torch.float8_e4m3fn),
                     ("e5m2", torch.float8_e5m2)]:
        t[f"w.{name}"] = (w * (100 if dt in (torch.float8_e4m3fn, torch.float8_e5m2) else 1)
                          ).to(dt)
        t[f"adv.{name}"] = adversarial(dt)
    e8m0 = torch.randint(118, 131, (512,), generator=g, dtype=torch.uint8)
    t["scales.e8m0"] = _bits(torch.float8_e8m0fnu, e8m0.numpy())
    t["adv.e8m0"] = adversarial(torch.float8_e8m0fnu)
    t["mlp.experts.down_proj_blocks"] = torch.randint(0, 256, (8, 4, 16), generator=g,
                                                      dtype=torch.uint8)
    t["mlp.experts.down_proj_scales"] = torch.randint(118, 131, (8, 4), generator=g,
                                                      dtype=torch.uint8)
    t["q.weight_packed"] = torch.randint(0, 256, (32, 16), generator=g, dtype=torch.uint8)
    t["q.weight_scale"] = torch.randn(32, 1, generator=g).to(torch.float8_e4m3fn)
    t["g.qweight"] = torch.randint(-(1 << 31), 1 << 31, (16, 8), generator=g, dtype=torch.int32)
    t["g.qzeros"] = torch.randint(0, 1 << 16, (1, 8), generator=g, dtype=torch.int32)
    t["g.scales"] = torch.randn(1, 64, generator=g).to(torch.float16)
    for dt in (torch.int8, torch.uint8, torch.int16, torch.uint16, torch.int32, torch.uint32,
               torch.int64, torch.uint64):
        info = torch.iinfo(dt)
        t[f"int.{dt}".replace("torch.", "")] = torch.randint(
            max(info.min, -1000), min(info.max, 1000), (777,), generator=g).to(dt)
    t["position_ids"] = torch.arange(4096, dtype=torch.int64)[None]
    t["mask"] = torch.rand(333, generator=g) > 0.3
    t["empty"] = torch.zeros(0, 5, dtype=torch.bfloat16)
    t["scalar"] = torch.tensor(3.5, dtype=torch.float32)
    t["one"] = torch.tensor([-0.0], dtype=torch.bfloat16)
    t["const"] = torch.full((5000,), 0.125, dtype=torch.float16)
    return t


def write_raw(path: Path, header_text: bytes, data: bytes) -> Path:
    """A safetensors file with exactly this header text (no padding added) and data."""
    path.write_bytes(struct.pack("<Q", len(header_text)) + header_text + data)
    return path


def roundtrip(src: Path, tmp: Path, **kw: object) -> Path:
    """Compress ``src``, check it decompresses to the same bytes; returns the compressed."""
    packed = tmp / (src.name + ".ek")
    files.compress_file(src, packed, **kw)
    back = tmp / (src.name + ".back")
    files.decompress_file(packed, back, threads=kw.get("threads"))
    assert back.read_bytes() == src.read_bytes()
    return packed


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "model.safetensors"
    save_file(all_dtypes(), path, metadata={"format": "pt", "note": "caf\u00e9 \u2603"})
    return path


@pytest.mark.parametrize("threads", [1, 2])
def test_every_dtype_roundtrips_byte_exact(model: Path, tmp_path: Path, threads: int) -> None:
    roundtrip(model, tmp_path, threads=threads)


def test_many_segments_and_threads_give_identical_files(model: Path, tmp_path: Path) -> None:
    a = roundtrip(model, tmp_path, threads=1, segment_bytes=1024)
    b = tmp_path / "b.ek"
    files.compress_file(model, b, threads=2, segment_bytes=1024)
    assert a.read_bytes() == b.read_bytes()
    c = Compressed(np.fromfile(a, np.uint8))
    assert len(c.record.tensors["adv.bf16"].codecs) == (1 << 17) // 1024
    # Segments of a dtype whose size does not divide the segment: F64 of 3007 words.
    assert len(c.record.tensors["adv.f64"].codecs) == -(-3007 * 8 // 1024)


def test_deterministic(model: Path, tmp_path: Path) -> None:
    files.compress_file(model, tmp_path / "1")
    files.compress_file(model, tmp_path / "2")
    assert (tmp_path / "1").read_bytes() == (tmp_path / "2").read_bytes()


def test_compressed_file_is_valid_safetensors(model: Path, tmp_path: Path) -> None:
    packed = roundtrip(model, tmp_path)
    original = all_dtypes()
    with safe_open(packed, "np") as f:
        assert sorted(f.keys()) == sorted(original)
        meta = f.metadata()
        for name in original:
            payload = f.get_tensor(name)
            assert payload.dtype == np.uint8 and payload.ndim == 1
    # format: one that plain loaders refuse; the original "pt" is restored from the record
    assert meta["format"] == "entropykit" and meta["note"] == "caf\u00e9 \u2603"
    assert set(meta) == {"format", "note", record.KEY}
    rec = json.loads(meta[record.KEY])
    assert rec["format"] == "entropykit" and rec["version"] == 3
    assert list(rec) == ["format", "version", "segment_bytes", "header_crc32", "header_size",
                         "header", "tensors", "record_crc32"]
    bf16 = rec["tensors"]["w.bf16"]
    assert bf16["dtype"] == "BF16" and bf16["shape"] == [64, 96] and bf16["layout"] is None
    assert bf16["fields"] == [["exponent", None], ["sign_mantissa", "exponent"]]
    assert len(bf16["codecs"]) == 1 and all(c in record.CODECS for c in bf16["codecs"][0])
    layouts = {k: v["layout"] for k, v in rec["tensors"].items() if v["layout"]}
    assert layouts == {"mlp.experts.down_proj_blocks": "mxfp4", "q.weight_packed": "nvfp4",
                       "g.qweight": "int4"}
    assert rec["tensors"]["empty"]["codecs"] == []


def test_compression_pays_on_real_weights(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    src = tmp_path / "w.safetensors"
    save_file({"w": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16)}, src)
    summary = files.compress_file(src, tmp_path / "w.ek")
    row = summary.rows["BF16"]
    # Gaussian bf16: ~2.6 bits of exponent + 8 of sign/mantissa; the coder gets within 1%
    # of the order-0 bound of the fields.
    assert 10.0 < row.bits_per_value < 11.0
    assert row.bits_per_value < row.bound_per_value * 1.01
    assert summary.compressed_bytes == (tmp_path / "w.ek").stat().st_size
    assert summary.original_bytes == src.stat().st_size
    c = Compressed(np.fromfile(tmp_path / "w.ek", np.uint8))
    # Exponent: rANS (the default writes what the GPU kernel decodes); sign+mantissa
    # given the exponent: rANS (the only context coder).
    assert c.record.tensors["w"].codecs == (("rans", "rans"),)


def _codecs_by_field(packed: Path, name: str) -> dict[str, set[str]]:
    c = Compressed(np.fromfile(packed, np.uint8))
    t = c.record.tensors[name]
    return {f: {seg[i] for seg in t.codecs} for i, (f, _) in enumerate(t.fields)}


@pytest.mark.parametrize("threads", [1, 2])
def test_fast_mode_roundtrips_every_dtype(model: Path, tmp_path: Path, threads: int) -> None:
    roundtrip(model, tmp_path, threads=threads, fast=True, segment_bytes=4096)


def test_fast_mode_stores_near_incompressible_fields_raw(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    src = tmp_path / "w.safetensors"
    save_file({"w": (torch.randn(512, 512, generator=g) * 0.02).to(torch.bfloat16),
               "b": (torch.randn(2000, generator=g) * 0.02).to(torch.bfloat16)}, src)
    slow, fast = roundtrip(src, tmp_path), tmp_path / "fast.ek"
    files.compress_file(src, fast, fast=True)
    assert _codecs_by_field(slow, "w") == {"exponent": {"rans"}, "sign_mantissa": {"rans"}}
    # sign+mantissa saves ~0.4% (under codecs.FAST_MIN_SAVING): stored raw; the
    # exponent (2.6 of 8 bits) is still coded, so the file stays small, by rANS (faster;
    # its lane states cost under codecs.FAST_TANS_GAIN here), but by tANS in a field
    # of 2000 symbols, where 128 bytes of states would cost ~20%.
    assert _codecs_by_field(fast, "w") == {"exponent": {"rans"}, "sign_mantissa": {"raw"}}
    assert _codecs_by_field(fast, "b")["exponent"] == {"tans"}
    n = 512 * 512
    assert slow.stat().st_size < fast.stat().st_size < slow.stat().st_size + 0.01 * n
    assert fast.stat().st_size < 0.7 * src.stat().st_size
    files.compress_file(src, tmp_path / "fast2.ek", fast=True, threads=2)
    assert (tmp_path / "fast2.ek").read_bytes() == fast.read_bytes()  # deterministic


def test_zstd_wins_large_fields_where_lz_matching_pays() -> None:
    # A large periodic field (an integer table's low byte plane): its middle probe beats the
    # entropy estimate, so the sample is tried and zstd chosen; a skewed i.i.d. field of the
    # same size never gets past the probe.
    n = 5 * codecs.EXACT_LIMIT
    periodic = np.tile(np.random.default_rng(5).integers(0, 256, 1000, dtype=np.uint8),
                       n // 1000 + 1)[:n]
    assert codecs.choose(periodic, None).codec == "zstd"
    iid = np.random.default_rng(6).geometric(0.3, n).clip(0, 255).astype(np.uint8)
    assert codecs.choose(iid, None).codec == "rans"
    # LZ matching only in the field's first third (an embedding's untrained rows), order-0
    # uniform throughout: the probe must look where the sample looks, not only mid-field.
    part = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    part[: n // 3] = np.tile(np.arange(256, dtype=np.uint8), n // 768 + 1)[: n // 3]
    got = codecs.choose(part, None)
    assert got.codec == "zstd" and len(got.blob) < 0.8 * n


def test_field_saving_under_min_saving_is_stored_raw(tmp_path: Path) -> None:
    # Bytes that are uniform but for a little extra weight on 0: an entropy coder would save
    # ~0.06% of them (under codecs.MIN_SAVING), not worth a coded field's decode time, so
    # they stay raw; with twice the skew (~0.25%) they are coded.
    rng = np.random.default_rng(3)
    n = 1 << 21
    out = {}
    for name, extra in (("slight", 0.008), ("more", 0.016)):
        p = np.full(256, 1.0)
        p[0] += extra * 256
        out[name] = torch.from_numpy(rng.choice(256, size=n, p=p / p.sum()).astype(np.uint8))
    src = tmp_path / "u.safetensors"
    save_file(out, src)
    packed = roundtrip(src, tmp_path)
    assert _codecs_by_field(packed, "slight") == {"byte0": {"raw"}}
    assert _codecs_by_field(packed, "more") == {"byte0": {"rans"}}


@pytest.mark.parametrize("header", [
    # Not what safetensors writes: spaces, key order, metadata last, padding of newlines,
    # tensors listed out of data order, a zero-size tensor between others, non-ASCII names.
    b'{ "b" : {"shape":[2],"dtype":"F32","data_offsets":[8,16]},\n'
    b' "a":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},'
    b' "z\\u00e9":{"dtype":"I8","shape":[0],"data_offsets":[16,16]},'
    b' "__metadata__":{"k":"v\\n\\"q\\""}}\n\n\n',
    b'{}',
    b'{"__metadata__":{}}        ',
])
def test_odd_headers_restore_exactly(tmp_path: Path, header: bytes) -> None:
    n = max((e.end for e in hdr.parse_json(header).entries), default=0)
    src = write_raw(tmp_path / "odd.safetensors", header, bytes(range(n)))
    roundtrip(src, tmp_path)


def test_input_untouched_and_no_temporaries(model: Path, tmp_path: Path) -> None:
    before = (model.read_bytes(), os.stat(model).st_mtime_ns)
    roundtrip(model, tmp_path)
    assert (model.read_bytes(), os.stat(model).st_mtime_ns) == before
    assert not [p for p in tmp_path.iterdir() if "ek-tmp" in p.name]
    assert not [p for p in model.parent.iterdir() if "ek-tmp" in p.name]


def test_default_names(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    f.touch()
    assert files.default_output(f, True).name == "m.ek.safetensors"
    assert files.default_output(tmp_path / "m.ek.safetensors", False).name == "m.safetensors"
    assert files.default_output(f, False).name == "m.restored.safetensors"
    assert files.default_output(tmp_path, True).name == tmp_path.name + ".ek"


def test_lazy_single_tensor(model: Path, tmp_path: Path) -> None:
    packed = roundtrip(model, tmp_path, segment_bytes=4096)
    c = Compressed(np.fromfile(packed, np.uint8))
    original = np.fromfile(model, np.uint8)
    h = hdr.parse_file(memoryview(original))
    for e in h.entries:
        want = original[h.data_start + e.begin : h.data_start + e.end]
        assert np.array_equal(c.tensor(e.name, threads=2), want)
    assert c.keys() == [e.name for e in h.by_offset]


_DTYPES = sorted(d for d in hdr.DTYPE_BITS if hdr.DTYPE_BITS[d] % 8 == 0
                 and d not in ("C64", "F8_E4M3FNUZ", "F8_E5M2FNUZ"))


@st.composite
def _files(draw: st.DrawFn) -> bytes:
    """A safetensors file of 0-4 tensors with random dtypes, shapes, bytes and key order."""
    n = draw(st.integers(0, 4))
    specs, pos = {}, 0
    chunks = []
    for i in range(n):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 12), max_size=3))
        size = math.prod(shape) * hdr.DTYPE_BITS[dtype] // 8
        alphabet = draw(st.sampled_from([[7], [0, 1, 0x80, 0xFF], list(range(256))]))
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        data = rng.choice(np.array(alphabet, np.uint8), size).tobytes()
        specs[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        chunks.append(data)
        pos += size
    items = draw(st.permutations(list(specs.items())))
    head = dict(items)
    if draw(st.booleans()):
        head = {"__metadata__": {"k": draw(st.text(max_size=5))}, **head}
    text = json.dumps(head).encode() + b" " * draw(st.integers(0, 9))
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


@given(blob=_files(), segment=st.sampled_from([8, 64, 1024, 1 << 20]),
       threads=st.sampled_from([1, 2]))
def test_property_roundtrip(blob: bytes, segment: int, threads: int) -> None:
    buf = np.frombuffer(blob, np.uint8)
    out = io.BytesIO()
    writer.write(files.source(buf), out, threads=threads, segment_bytes=segment)
    c = Compressed(np.frombuffer(out.getvalue(), np.uint8))
    back = io.BytesIO()
    c.restore(back, threads=threads)
    assert back.getvalue() == blob
    whole = c.restored(threads)  # in memory, segments decoded in place
    assert whole.tobytes() == blob and whole.flags.writeable
