"""``load_file(..., device="cuda")`` on the CPU: the file plan, run through the kernel emulator.

The GPU loader (entropykit/container/cuda/fileplan.py + load.py) decides for every field of every
segment how it reaches the output tensor (kernel-decoded rANS, kernel-copied raw bytes,
host-decoded tANS/zstd) and where it lands (byte planes at a stride, exponent+sign_mantissa
pairs as the top 16 bits). Here the planned batches are run by ``test_gpu_logic``'s
emulator of the kernel into numpy byte arrays and compared with the CPU loader, on files
of every dtype, both codec targets (``codecs.choose(target=...)``), several segment and
group sizes, and on damaged files. The device runs gpu/tests/test_cuda_load.py.
"""

import contextlib
import dataclasses
import struct
import sys
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from test_gpu_crc import emulate_crc
from test_gpu_logic import emulate_into

import entropykit
from entropykit import CorruptDataError, formats, gpu
from entropykit.container import codecs, files, payload, segment, source
from entropykit.container import header as hdr
from entropykit.container.cuda import _staging, fileplan
from entropykit.container.reader import Compressed
from entropykit.rans.cuda import plan as gplan


def _emulated_load(path, threads=1, names=None, **kw) -> dict[str, np.ndarray]:
    """Every tensor's bytes (only ``names``' if given) as the GPU loader would write them
    (0xA5 where it wrote none)."""
    return emulated_tensors(Compressed(np.fromfile(path, np.uint8)), threads, names, **kw)


def emulated_tensors(c, threads=1, names=None, **kw) -> dict[str, np.ndarray]:
    """``_emulated_load`` of an open file: ``container.cuda.load.load``'s plan and subset,
    staged as it stages them (streams read from the file into the staging buffer),
    moved as ``_relayout.cu`` moves them, CRC-checked by the emulated ``_crc.cu`` and
    decoded by the kernel emulator; errors in the order ``load.Stager.check`` raises
    them (a failed CRC first, position CRCs before the others)."""
    entries = c.original.by_offset
    if names is not None:
        entries = [e for e in entries if e.name in set(names)]
    outs = [np.full(e.nbytes, 0xA5, np.uint8) for e in entries]
    crc_errors, decode_errors = [], []
    for group in fileplan.groups(c, threads, entries=entries, **kw):
        crc, decode = emulated_group(group, c.source, threads, lambda t, bf16:
                                     outs[t].view(np.uint16) if bf16 else outs[t])
        crc_errors += [crc] if crc is not None else []
        decode_errors += decode
    if crc_errors:
        raise min(crc_errors, key=lambda e: e[0])[1]
    if decode_errors:
        raise decode_errors[0]
    return {e.name: o for e, o in zip(entries, outs, strict=True)}


def emulated_group(group, src, threads, views) -> tuple:
    """One group staged (``src``: the file), moved, CRC-checked and decoded into
    ``views(tensor, bf16)`` (its flat uint8, or uint16 for bf16 mode, array) as the device
    would: (the CRC error as ``Staging.crc_error`` gives it, or None; the batches' decode
    errors)."""
    st = _staging.Staging.of(group)
    host = np.full(st.size, 0xEE, np.uint8)
    st.fill(group, host, [p.batch.desc for p in group.parts], threads, src)
    payload = np.zeros(st.payload, np.uint8)
    for s, d, k in st.moves.tolist():
        payload[d : d + k] = host[s : s + k]
    decode_errors = []
    for part, sec in zip(group.parts, st.sections, strict=True):
        b = part.batch
        b._cache["payload"] = payload[sec["payload"] : sec["payload"] + b.payload_size]
        _, status = emulate_into(b, [views(t, b.bf16) for t in part.tensors])
        err = b.error(status)
        if err is not None:
            decode_errors.append(err)
    return st.crc_error(emulate_crc(st.crcs, host, fast=True)), decode_errors


def _cpu_bytes(path) -> dict[str, np.ndarray]:
    return {k: v.reshape(-1).view(torch.uint8).numpy()
            for k, v in entropykit.load_file(path, threads=1).items()}


def _bf16_weights(rng, n):
    bits = (rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16
    bits = bits.astype(np.uint16)
    specials = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F]
    bits[rng.choice(n, 40, replace=False)] = np.resize(np.array(specials, np.uint16), 40)
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def _model(rng) -> dict[str, torch.Tensor]:
    """Tensors of every kind the loader places differently, weight-like where it matters."""
    w32 = torch.from_numpy(rng.standard_normal(70_001).astype(np.float32) * 0.05)
    w32[:4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-40])
    ctx = rng.geometric(0.4, 150_000).clip(1, 8)  # sign+mantissa depends on the exponent
    ctx_bits = ((120 + ctx) << 7 | (ctx * 37 + rng.geometric(0.6, ctx.size)) & 0x7F)
    return {
        "big.bf16": _bf16_weights(rng, 300_007),  # several 2**16 chunks, a ragged end
        "ctx.bf16": torch.from_numpy(ctx_bits.astype(np.int16)).view(torch.bfloat16),
        "w.f32": w32,
        "w.f16": torch.from_numpy(rng.standard_normal(20_000).astype(np.float16)),
        "w.f64": torch.from_numpy(rng.standard_normal(3_000) * 0.1),
        "w.e4m3": (torch.from_numpy(rng.standard_normal(90_000).astype(np.float32)) * 30)
        .to(torch.float8_e4m3fn),
        "w.e5m2": torch.from_numpy(rng.standard_normal(5_000).astype(np.float32))
        .to(torch.float8_e5m2),
        "x_blocks": torch.from_numpy(rng.integers(0, 256, (64, 16), dtype=np.uint8)),
        "x_scales": torch.from_numpy(rng.integers(118, 130, (64,), dtype=np.uint8)),
        "ids": torch.arange(512, dtype=torch.int64),
        "i32": torch.from_numpy(rng.integers(-5, 5, 4_000).astype(np.int32)),
        "mask": torch.from_numpy(rng.random(100) > 0.5),
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "one": torch.tensor([3.0], dtype=torch.float32),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "const.bf16": torch.full((5_000,), 0.25, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu_load") / "model.safetensors"
    safetensors.torch.save_file(_model(np.random.default_rng(5)), path)
    return path


def _codecs_used(path) -> set[tuple[str, str]]:
    c = Compressed(np.fromfile(path, np.uint8))
    return {(f[0], cd) for t in c.record.tensors.values() for seg in t.codecs
            for f, cd in zip(t.fields, seg, strict=True)}


def test_placement_matches_formats_split_for_every_split():
    rng = np.random.default_rng(0)
    cases = [(d, None) for d in sorted(formats.DTYPES)]
    cases += [("U8", "mxfp4"), ("I32", "int4")]
    for dtype, layout in cases:
        bits = hdr.DTYPE_BITS[dtype]
        raw = rng.integers(0, 256, 96 * bits // 8, dtype=np.uint8)
        fields = formats.split(dtype, raw, layout=layout)
        split = segment.Split.of(dtype, layout, bits)
        place = fileplan.placement(dtype, layout, split.fields)
        assert place is not None, dtype
        out = np.full(raw.size, 0xA5, np.uint8)
        sym = {f.name: f.symbols for f in fields}
        if place.pair is not None:
            at, step = place.pair
            e = sym["exponent"].astype(np.uint16)
            m = sym["sign_mantissa"].astype(np.uint16)
            out.view(np.uint16)[at::step] = (m >> 7) << 15 | e << 7 | (m & 0x7F)
        for name, (k, word) in place.planes.items():
            out[k::word] = sym[name]
        assert np.array_equal(out, raw), (dtype, layout)


def test_placement_refuses_splits_it_does_not_know():
    assert fileplan.placement("F32", None, (("exponent", None), ("byte9", None))) is None
    assert fileplan.placement("F64", None, fileplan._SIGN_MOVED) is None
    assert fileplan.placement("F16", None, (("byte1", "byte0"), ("byte0", None))) is None
    assert fileplan.placement("U8", "mxfp4", (("byte0", None),)) is None
    assert fileplan.placement("F4", None, (("byte0", None),)) is None


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize(("segment_bytes", "group_bytes", "warps"),
                         [(1 << 24, fileplan.GROUP_BYTES, gplan.WARPS), (1 << 16, 1 << 17, 3)])
def test_emulated_gpu_load_is_the_cpu_load(model_file, tmp_path, target,
                                           segment_bytes, group_bytes, warps):
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(model_file, ek, threads=2, segment_bytes=segment_bytes, target=target)
    used = _codecs_used(ek)
    if target == "cpu":  # every path of the plan runs: kernel, copies, host decodes
        assert {("exponent", "rans"), ("sign_mantissa", "rans"), ("byte0", "zstd"),
                ("byte0", "raw")} <= used
    else:
        assert {c for _, c in used} <= {"rans", "raw", "zstd"} and ("exponent", "rans") in used
    c = Compressed(np.fromfile(ek, np.uint8))
    groups = list(fileplan.groups(c, 2, warps=warps,
                                  group_bytes=group_bytes))
    assert len(groups) > (1 if group_bytes < fileplan.GROUP_BYTES else 0)
    got = _emulated_load(ek, 2, warps=warps, group_bytes=group_bytes)
    want = _cpu_bytes(ek)
    assert list(got) == list(want)  # data order, as safetensors lists them
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def _many_small(rng) -> dict[str, torch.Tensor]:
    """Hundreds of tiny tensors of mixed dtypes (empty, one element, a few, a few hundred),
    then two of several 64 KiB segments."""
    kinds = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int64,
             torch.uint8, torch.bool]
    sizes = [0, 1, 2, 7, 64, 385, 1000, 3]
    out = {}
    for k in range(200):
        w = torch.from_numpy(rng.standard_normal(sizes[k % 8]).astype(np.float32) * 0.05)
        dt = kinds[k % len(kinds)]
        out[f"layer.{k // 8}.t{k % 8}"] = (w > 0) if dt == torch.bool else (w * 100).to(dt)
    out["z.span.f32"] = torch.from_numpy(rng.standard_normal(40_000).astype(np.float32))
    out["z.span.bf16"] = _bf16_weights(rng, 70_001)
    return out


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize(("segment_bytes", "group_bytes"),
                         [(1 << 24, fileplan.GROUP_BYTES), (1 << 16, 1 << 16)])
def test_emulated_gpu_load_of_many_small_tensors_and_of_subsets(tmp_path, target,
                                                                segment_bytes, group_bytes):
    """Hundreds of tiny tensors plan into one group (one launch per kernel flavour) when
    they fit it, and any subset of a file's tensors (``load(..., names=...)``, what
    from_pretrained asks for one device) decodes exactly, touching nothing else, also
    with segments and groups cut small (tensors spanning groups)."""
    src, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_many_small(np.random.default_rng(9)), src)
    files.compress_file(src, ek, threads=2, segment_bytes=segment_bytes, target=target)
    want = _cpu_bytes(ek)
    c = Compressed(np.fromfile(ek, np.uint8))
    planned = list(fileplan.groups(c, 2, group_bytes=group_bytes))
    if group_bytes == fileplan.GROUP_BYTES:
        assert len(planned) == 1 and len(planned[0].parts) <= 3  # u8, bf16, bf16 wide
    else:
        assert len(planned) > 3
    names = list(want)
    for subset in (names[::3], names[1:2], [n for n in names if want[n].size == 0],
                   names[-5:]):
        got = _emulated_load(ek, 2, subset, group_bytes=group_bytes)
        assert list(got) == subset
        for name in subset:
            assert np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("segment_bytes", [1 << 16, 1 << 24])
def test_staging_moves_every_payload_to_the_decoders_layout(model_file, tmp_path, target,
                                                            segment_bytes, monkeypatch):
    """What the loader stages (large payloads read from the file into the buffer) and
    ``_relayout.cu`` moves is exactly each batch's payload buffer (plan.py's aligned
    layout, as a plan that reads every payload whole makes it), tables and descriptors,
    within bounds; the CRC rows cover what the host did not check."""
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(model_file, ek, threads=2, segment_bytes=segment_bytes, target=target)
    c = Compressed(source.FileBytes(ek))
    planned = list(fileplan.groups(c, 2, group_bytes=1 << 18))
    staged = sum(len(p.files) for g in planned for p in g.parts)
    assert (staged > 0) == (segment_bytes > fileplan.STAGED_BYTES * 4)
    monkeypatch.setattr(fileplan, "STAGED_BYTES", 1 << 62)
    whole = list(fileplan.groups(c, 2, group_bytes=1 << 18))
    for group, ref in zip(planned, whole, strict=True):
        st = _staging.Staging.of(group)
        host = np.full(st.size, 0xEE, np.uint8)
        st.fill(group, host, [p.batch.desc for p in group.parts], 3, c.source)
        assert st.crcs_at + st.crcs.nbytes + st.first.nbytes <= st.size
        assert emulate_crc(st.crcs, host, fast=True).tolist() == [0] * len(st.crcs)
        assert (st.ranks == fileplan.POSITION).sum() == sum(
            len(p.files) for p in group.parts)
        src, dst, n = st.moves.T
        assert st.moves_at + st.moves.nbytes <= st.size
        assert (src + n + _staging.SPARE <= st.moves_at).all()  # the kernel's read-ahead
        assert (dst % gplan.ALIGN == 0).all() and (dst + (n + 3) // 4 * 4 <= st.payload).all()
        payload = np.zeros(st.payload, np.uint8)
        for s, d, k in st.moves.tolist():  # what _relayout.cu does
            payload[d : d + k] = host[s : s + k]
        for part, want, sec in zip(group.parts, ref.parts, st.sections, strict=True):
            b = part.batch
            at = sec["payload"]
            assert np.array_equal(payload[at : at + b.payload_size], want.batch.payload)
            for name, arr in (("sym", b.sym_tables), ("info", b.info_tables),
                              ("cmaps", b.cmaps), ("desc", b.desc)):
                got = host[sec[name] : sec[name] + arr.nbytes]
                assert sec[name] % _staging.ALIGN == 0
                assert np.array_equal(got, arr.reshape(-1).view(np.uint8)), name


def test_gpu_target_codec_choice():
    rng = np.random.default_rng(1)
    exp = (120 + rng.geometric(0.4, 200_000).clip(1, 20)).astype(np.uint8)
    noise = rng.integers(0, 256, 200_000).astype(np.uint8)
    nearly = noise.copy()
    nearly[: 2_000] = 0  # coding it would save < 1%: stored raw for the GPU
    got = codecs.choose(exp, None, target="gpu")
    assert got.codec == "rans"
    info = entropykit.coding.frame.parse(entropykit.rans.static.CODER, got.blob)
    assert info.chunk_size == codecs.GPU_CHUNK and info.param == codecs.RANS_PRECISION
    assert info.cmap is None
    sm = codecs.choose(exp ^ 0x55, exp, target="gpu")  # a context is ignored for the GPU
    assert sm.codec == "rans"
    assert entropykit.coding.frame.parse(entropykit.rans.static.CODER, sm.blob).cmap is None
    assert codecs.choose(nearly, None, target="gpu").codec == "raw"
    assert codecs.choose(exp, None).codec == "rans"  # the default: rANS, which the kernel decodes
    with pytest.raises(ValueError, match="target must be one of"):
        codecs.choose(exp, None, target="tpu")


def _field_at(path, name: str, field: str) -> tuple[int, int, int, int]:
    """File offset and length of field ``field`` of segment 0 of tensor ``name``, the file
    offset of its position CRC and its field index (an EKT2 payload)."""
    buf = np.fromfile(path, np.uint8)
    c = Compressed(buf)
    t = c.record.tensors[name]
    o = next(e for e in c.outer.entries if e.name == name)
    head = c.outer.data_start + o.begin
    k = len(t.codecs) * len(t.fields)
    lengths = buf[head + 8 : head + 8 + 8 * k].view("<u8").astype(np.int64)
    f = [x[0] for x in t.fields].index(field)
    return head + 8 + 12 * k + int(lengths[:f].sum()), int(lengths[f]), head + 8 + 8 * k + 4 * f, f


def _damaged(path, out, name, field, where: float, codec: str):
    """A copy of ``path`` with one bit flipped at ``where`` (0..1) of a field coded ``codec``,
    its position CRC recomputed (so the field's own checks are what catch it)."""
    at, n, crc_at, f = _field_at(path, name, field)
    assert (field, codec) in _codecs_used(path)
    buf = np.fromfile(path, np.uint8)
    buf[at + int(n * where)] ^= 0x10
    crc = payload.field_crc(buf[at : at + n], name, 0, f)
    buf[crc_at : crc_at + 4] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    buf.tofile(out)
    return out


def test_damaged_files_are_caught_where_the_gpu_loader_checks(model_file, tmp_path):
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(model_file, ek, threads=2, target="gpu")
    # A coded chunk: the kernel's state checks (emulated) name tensor, field and chunk.
    bad = _damaged(ek, tmp_path / "a.safetensors", "big.bf16", "exponent", 0.6, "rans")
    with pytest.raises(CorruptDataError, match=r"^tensor 'big\.bf16' segment 0: field "
                                               r"'exponent' \(rans\) chunk \d+ \(payload at"):
        _emulated_load(bad)
    with pytest.raises(CorruptDataError, match="big.bf16"):
        entropykit.load_file(bad)
    # Verbatim bytes of a large field: staged from the file, their CRC-32 checked by the
    # device (the host plan reads only their head), reported before any decode error.
    bad = _damaged(ek, tmp_path / "b.safetensors", "big.bf16", "sign_mantissa", 0.5, "raw")
    list(fileplan.groups(Compressed(np.fromfile(bad, np.uint8))))
    with pytest.raises(CorruptDataError, match=r"'big\.bf16' segment 0: field "
                                               r"'sign_mantissa' \(raw\): raw field fails"):
        _emulated_load(bad)


def test_host_decoded_and_raw_chunk_damage(model_file, tmp_path, monkeypatch):
    ek = tmp_path / "m.ek.safetensors"
    # A file as earlier defaults wrote it, with tANS exponents (decoded on the host).
    old = dataclasses.replace(codecs.CPU, candidates=("rans", "tans", "zstd", "raw", "rans2d"))
    monkeypatch.setitem(codecs.POLICIES, ("cpu", False), old)
    files.compress_file(model_file, ek, threads=2)
    bad = _damaged(ek, tmp_path / "a.safetensors", "big.bf16", "exponent", 0.7, "tans")
    with pytest.raises(CorruptDataError, match=r"'big\.bf16' segment 0: field 'exponent' "
                                               r"\(tans\): "):
        _emulated_load(bad)
    # A raw chunk inside an rANS frame: checked against the frame's CRC on the host.
    rng = np.random.default_rng(2)
    sym = np.concatenate([np.zeros(4096, np.uint8), rng.integers(0, 256, 8000, np.uint8)])
    fb = bytearray(entropykit.rans.encode(sym, chunk_size=4096))
    s = gplan.Stream.frame(bytes(fb), "f")
    assert list(s.info.modes) == [0, 1, 1]
    fileplan._check_raw_chunks(s)
    a = int(s.info.offsets[2])
    fb[a + 7] ^= 1
    with pytest.raises(CorruptDataError, match="f: chunk 2 \\(raw\\) fails its CRC-32"):
        fileplan._check_raw_chunks(gplan.Stream.frame(bytes(fb), "f"))
    assert zlib.crc32(sym[8192:]) == int(s.info.crcs[2])


def test_load_file_cuda_without_a_gpu_is_a_clear_error(model_file, tmp_path, monkeypatch):
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(model_file, ek, threads=2)
    if not torch.cuda.is_available():
        for dev in ("cuda", "cuda:0", 0, torch.device("cuda", 0)):
            with pytest.raises(gpu.GpuUnavailableError, match="sees no CUDA device"):
                entropykit.load_file(ek, device=dev)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(gpu.GpuUnavailableError, match="compiles its kernel with cupy"):
        entropykit.load_file(ek, device="cuda")
    # The CPU path is untouched by the device argument's other spellings.
    assert all(v.device.type == "cpu" for v in entropykit.load_file(ek, device="cpu").values())


def _staged_file(tmp_path) -> tuple:
    """A file whose large fields are staged from the file: a BF16 weight (rans2d
    exponents, rANS sign_mantissa), an fp8 one, and bytes half skewed, half noise (an
    rANS frame with raw chunks); and its plan."""
    rng = np.random.default_rng(12)
    half = np.concatenate([np.minimum(rng.geometric(0.3, 200_000), 255),
                           rng.integers(0, 256, 200_000)]).astype(np.uint8)
    w = torch.from_numpy(rng.standard_normal((256, 1200)).astype(np.float32) * 0.02)
    src, ek = tmp_path / "s.safetensors", tmp_path / "s.ek.safetensors"
    safetensors.torch.save_file({"w": w.to(torch.bfloat16), "half": torch.from_numpy(half),
                                 "e4m3": (w * 100).to(torch.float8_e4m3fn)}, src)
    files.compress_file(src, ek, threads=2)
    return ek, Compressed(source.FileBytes(ek))


def _staged_checks(c) -> list[tuple[str, int, int, int, int]]:
    """(message, file offset, length, rank, file offset of its stream) of every range the
    device checks."""
    out = []
    for group in fileplan.groups(c, 1):
        for part in group.parts:
            at = dict(part.files.tolist())
            for (k, off, n, _, _, rank), msg in zip(part.checks.tolist(), part.messages,
                                                    strict=True):
                out.append((msg, at[k] + off, n, rank, at[k]))
    return out


def test_the_host_plan_reads_only_the_heads_of_large_payloads(tmp_path):
    """The planner reads each large payload's header and directory, not its bytes: they
    go from the file to the staging buffer once (``Staging.fill``)."""
    ek, c = _staged_file(tmp_path)
    read = []

    class Counted(source.FileBytes):
        def read(self, offset, n, scratch=None):
            read.append(n)
            return super().read(offset, n, scratch)

    with Counted(ek) as f:
        planned = list(fileplan.groups(Compressed(f), 1))
    payloads = sum(c.payload_size(k) for k in c.keys())
    staged = sum(int(p.batch.streams[k].data.size) for g in planned for p in g.parts
                 for k in p.files[:, 0].tolist())
    assert staged > 0.9 * payloads and sum(read) < 0.1 * payloads
    checked = {(m.split("'")[1], m.split("'")[3]) for m, *_ in _staged_checks(c)}
    assert checked == {("w", "exponent"), ("w", "sign_mantissa"), ("half", "byte0"),
                       ("e4m3", "byte0")}


def _noise_file(tmp_path) -> tuple:
    """A file of one tensor of random bytes (a raw field, staged from the file)."""
    rng = np.random.default_rng(3)
    src, ek = tmp_path / "r.safetensors", tmp_path / "r.ek.safetensors"
    safetensors.torch.save_file({"noise": torch.from_numpy(
        rng.integers(0, 256, 300_000).astype(np.uint8))}, src)
    files.compress_file(src, ek, threads=2)
    return ek, Compressed(source.FileBytes(ek))


def test_the_device_checks_every_staged_byte_the_host_did_not_parse(tmp_path):
    """A staged payload's position CRC: the host's seed covers the bytes it parsed (an
    rANS frame's header, tables and directory; a raw field's CRC word) and no more, the
    device every byte after them, to the payload's end."""
    seen = set()
    for ek, c in (_staged_file(tmp_path), _noise_file(tmp_path)):
        buf = np.fromfile(ek, np.uint8)
        for msg, at, n, rank, stream in _staged_checks(c):
            if rank != fileplan.POSITION:
                continue
            name, field = msg.split("'")[1], msg.split("'")[3]
            t = c.record.tensors[name]
            f = [k for k, _ in t.fields].index(field)
            codec = t.codecs[0][f]
            if codec == "raw":
                parsed = stream  # the field's symbols start after its CRC word
            else:  # the frame's 28-byte header, its model section and 9 bytes a chunk
                chunks, model = (int(v) for v in buf[stream + 20 : stream + 28].view("<u4"))
                parsed = stream + 28 + model + 9 * chunks
            assert at == parsed, (msg, codec)
            fields = c.fields(name)
            assert at + n == c.payload_at(name) + fields.offsets[f] + fields.lengths[f]
            seen.add((name, codec))
    assert seen == {("w", "rans"), ("e4m3", "rans"), ("half", "rans"), ("noise", "raw")}


@pytest.mark.parametrize("kind", ["position", "head", "raw chunk", "raw field"])
def test_damage_in_each_kind_of_staged_range(tmp_path, kind):
    """A changed byte in each kind of range the device checks: the body of a staged
    payload (its position CRC), a byte of the head the host read and parsed without
    checking it (a coded chunk's CRC in the frame's directory: the seed it hands the
    device differs), a raw chunk of a staged frame and a raw field (both with the
    position CRC recomputed: their own CRC catches it) — CorruptDataError naming tensor,
    segment and field, while the host plan passes."""
    ek, c = _noise_file(tmp_path) if kind == "raw field" else _staged_file(tmp_path)
    checks = _staged_checks(c)
    buf = np.fromfile(ek, np.uint8)
    want = {"position": "position CRC-32", "head": "position CRC-32",
            "raw chunk": "(raw) fails its CRC-32", "raw field": "raw field fails its CRC-32"}
    msg, at, n, rank, frame = next(x for x in checks if want[kind] in x[0])
    # The device checks from the end of the frame's directory (chunk CRCs, then modes) on.
    chunks = int(buf[frame + 20 : frame + 24].view("<u4")[0])
    where = at - chunks - 1 if kind == "head" else at + n // 2
    buf[where] ^= 0x08
    if kind in ("raw chunk", "raw field"):  # the position CRC recomputed
        name = msg.split("'")[1]
        f_at, f_n, crc_at, f = _field_at(ek, name, msg.split("field '")[1].split("'")[0])
        assert f_at <= where < f_at + f_n
        crc = payload.field_crc(buf[f_at : f_at + f_n], name, 0, f)
        buf[crc_at : crc_at + 4] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    bad = tmp_path / "bad.safetensors"
    buf.tofile(bad)
    damaged = Compressed(source.FileBytes(bad))
    list(fileplan.groups(damaged, 1))  # the host sees nothing wrong
    with pytest.raises(CorruptDataError) as got:
        emulated_tensors(damaged)
    assert str(got.value) == msg and str(got.value).startswith("tensor '")
    assert " segment 0: field " in msg


@pytest.mark.parametrize("head", [8, 40, 1000])
def test_heads_longer_than_the_first_read(tmp_path, monkeypatch, head):
    """Frame headers, class maps and directories longer than the head first read: read
    again longer (what is parsed comes from one read), and the load is exact."""
    ek, _ = _staged_file(tmp_path)
    monkeypatch.setattr(fileplan, "HEAD", head)
    c = Compressed(source.FileBytes(ek))
    assert sum(len(p.files) for g in fileplan.groups(c, 2) for p in g.parts) == 4
    got, want = emulated_tensors(c, 2), _cpu_bytes(ek)
    assert list(got) == list(want)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def _staged_bytes(c, threads, ahead=False) -> list[np.ndarray]:
    """Every group's staging buffer as ``Staging.fill`` writes it on ``threads``; with
    ``ahead``, on a ``Filler`` of that many threads, in the loader's order (a group's
    fill submitted before the one before is waited for)."""
    out, pending = [], None
    with _staging.Filler(threads) as filler:
        for group in fileplan.groups(c, 1):
            st = _staging.Staging.of(group)
            host = np.full(st.size, 0xEE, np.uint8)
            fill = st.fill(group, host, [p.batch.desc for p in group.parts],
                           filler if ahead else threads, c.source)
            if pending is not None:
                pending.wait()
            pending = fill if ahead else None
            out.append(host)
        if pending is not None:
            pending.wait()
    return out


@pytest.mark.parametrize("staged", [True, False])
def test_parallel_fill_is_the_serial_fill(tmp_path, monkeypatch, model_file, staged):
    """The fill cut into a share per thread (file reads and copies, down to tiny slabs)
    writes the staging buffer byte for byte as one thread does; at 4 threads a payload
    staged from the file is read in a share per thread."""
    if staged:
        ek, c = _staged_file(tmp_path)
    else:
        ek = tmp_path / "m.ek.safetensors"
        files.compress_file(model_file, ek, threads=2)
        c = Compressed(source.FileBytes(ek))
    serial = _staged_bytes(c, 1)
    reads = []

    class Counted(source.FileBytes):
        def readinto(self, offset, outs):
            reads.append(offset)
            super().readinto(offset, outs)

    with Counted(ek) as f:
        assert all(np.array_equal(a, b) for a, b in
                   zip(_staged_bytes(Compressed(f), 4), serial, strict=True))
    if staged:
        assert len(reads) >= 4
    with source.FileBytes(ek) as f:
        assert all(np.array_equal(a, b) for a, b in
                   zip(_staged_bytes(Compressed(f), 4, ahead=True), serial, strict=True))
    # One payload of 2 MiB staged at 4 threads: four reads of 512 KiB.
    one = [(0, np.empty(2 << 20, np.uint8))]
    assert [sum(b.size for b in bufs) for _, bufs in
            _staging._reads(one, _staging._slab([], one, 4))] == [512 << 10] * 4
    monkeypatch.setattr(_staging, "MIN_SLAB", 4096)
    for threads, ahead in ((1, False), (4, False), (4, True)):
        got = _staged_bytes(c, threads, ahead)
        assert all(np.array_equal(a, b) for a, b in zip(got, serial, strict=True))


def test_a_groups_reads_are_one_share_per_thread():
    """The file reads of a group: its bytes cut into one read per thread, adjacent
    payloads joined into a read and a payload split between two (each read a hand-off
    of the GIL), bytes between payloads read and dropped; the buffers get the file's
    bytes."""
    mib = 1 << 20
    data = np.random.default_rng(0).integers(0, 256, 8 * mib, dtype=np.uint8)
    bufs = [np.zeros(mib, np.uint8) for _ in range(3)]
    jobs = [(0, bufs[0]), (mib, bufs[1]), (2 * mib + 100, bufs[2])]  # 100 bytes apart
    reads = _staging._reads(jobs, _staging._slab([], jobs, 2))
    assert [at for at, _ in reads] == [0, 3 * mib // 2, 3 * mib]
    assert [sum(b.size for b in r) for _, r in reads] == [3 * mib // 2] * 2 + [100]
    src = source.ArrayBytes(data)
    for at, r in reads:
        src.readinto(at, r)
    assert all(np.array_equal(b, data[at : at + mib]) for (at, _), b in zip(jobs, bufs,
                                                                             strict=True))
    # A group's 64 MiB at one thread is one read; at 16 threads, 16 reads of 4 MiB.
    one = [(0, np.empty(64 * mib, np.uint8))]
    for threads, want in ((1, [64 * mib]), (16, [4 * mib] * 16)):
        reads = _staging._reads(one, _staging._slab([], one, threads))
        assert [sum(b.size for b in r) for _, r in reads] == want


def test_a_filler_keeps_its_threads_and_raises_the_first_failure():
    """``Filler``: every group's shares on the same threads (started once, stopped by
    ``close``); fills submitted one after another run in order and each is waited for
    on its own; a failure raises the first failing task's error, as one thread would
    (later tasks of its share not run), at any thread count."""
    import threading

    seen = set()

    class Src:
        def readinto(self, at, outs):
            seen.add(threading.current_thread().name)
            if at in (9, 10):
                raise CorruptDataError(f"bad read at {at}")
            for out in outs:
                out[:] = at

    outs = [np.zeros(8, np.uint8) for _ in range(12)]
    with _staging.Filler(4) as filler:
        first = filler.submit([(k, [outs[k]], Src()) for k in range(4)])
        second = filler.submit([(k, [outs[k]], Src()) for k in range(4, 8)] +
                               [(np.full(8, 7, np.uint8), outs[8])])
        second.wait()
        first.wait()
        assert [int(o[0]) for o in outs[:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 7]
        for _ in range(3):
            filler.run([(k, [outs[k]], Src()) for k in range(4)])
        workers = [t for t in threading.enumerate() if t.name.startswith("entropykit-fill")]
        assert seen == {f"entropykit-fill-{k}" for k in range(4)} and len(workers) == 4
    assert not any(t.is_alive() for t in workers)
    errors = []
    for threads in (1, 3, 8):
        outs[10][:] = 0
        with _staging.Filler(threads) as filler, pytest.raises(CorruptDataError) as got:
            filler.run([(k, [outs[k]], Src()) for k in range(4, 12)])
        errors.append(str(got.value))
    assert errors == ["bad read at 9"] * 3


def test_parallel_fill_of_a_truncated_file_raises_the_serial_error(tmp_path, monkeypatch):
    """A file cut short after it was opened: the fill's short read raises the same
    CorruptDataError at 1 and 4 threads (the first failing read's), named by the file."""
    ek, _ = _staged_file(tmp_path)
    whole = ek.read_bytes()
    monkeypatch.setattr(_staging, "MIN_SLAB", 4096)
    errors = []
    for threads in (1, 4):
        with source.FileBytes(ek) as f:
            c = Compressed(f)
            planned = list(fileplan.groups(c, 1))
            with open(ek, "r+b") as w:
                w.truncate(f.size // 2)
            with pytest.raises(CorruptDataError) as got, files.named(ek):
                for group in planned:
                    st = _staging.Staging.of(group)
                    st.fill(group, np.zeros(st.size, np.uint8),
                            [p.batch.desc for p in group.parts], threads, c.source)
            errors.append(str(got.value))
        ek.write_bytes(whole)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"{ek}: file changed or truncated while being read")


def test_groups_planned_ahead_are_the_groups_in_order():
    """``fileplan.ahead``: the same items in the same order, made on another thread
    while the consumer holds the one before; an error where the items raised it; closed
    early, its thread stops and the items are closed."""
    import threading

    made, closed = [], threading.Event()
    second = threading.Event()

    def items(n, fail_at=None):
        try:
            for k in range(n):
                if k == fail_at:
                    raise CorruptDataError(f"item {k}")
                if k == 1:
                    second.set()
                made.append((k, threading.current_thread().name))
                yield k
        finally:
            closed.set()

    it = fileplan.ahead(items(5))
    assert next(it) == 0
    assert second.wait(5)  # the next one is being made while item 0 is in use
    assert list(it) == [1, 2, 3, 4]
    assert {name for _, name in made} == {"entropykit-plan"} and closed.is_set()
    got = []
    with pytest.raises(CorruptDataError, match="^item 3$"):
        for x in fileplan.ahead(items(6, fail_at=3)):
            got.append(x)
    assert got == [0, 1, 2]
    closed.clear()
    made.clear()
    it = fileplan.ahead(items(1000))
    assert next(it) == 0
    it.close()
    assert closed.is_set() and len(made) < 10


@contextlib.contextmanager
def _emulated_stager(monkeypatch) -> Iterator[tuple[Any, list, list]]:
    """``container.cuda.load`` with its ``Stager`` emulated on the CPU (``emulated_group``;
    imported against a stand-in CuPy): the module, the stagers made, and the events
    ``(step, thread name)`` of stage, send and check."""
    import types

    before = set(sys.modules)
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # imports only
    try:
        from entropykit.container.cuda import load

        stagers, events = [], []

        class Emulated:
            def __init__(self, device, threads):
                self.device, self.filler = device, _staging.Filler(threads)
                self.stream = None
                self.seconds = {"launch": 0.0}
                self.errors = []
                stagers.append(self)

            def stage(self, group, views, src):
                events.append(("stage", threading.current_thread().name))
                return group, views, src

            def send(self, staged):
                group, views, src = staged
                crc, decode = emulated_group(group, src, 2, lambda t, bf16: views(t, bf16)
                                             .numpy().view(np.uint16 if bf16 else np.uint8))
                self.errors += ([crc[1]] if crc is not None else []) + decode
                events.append(("send", threading.current_thread().name))

            def check(self):
                events.append(("check", threading.current_thread().name))
                errors, self.errors = self.errors, []
                if errors:
                    raise errors[0]

        monkeypatch.setattr(load, "Stager", Emulated)
        monkeypatch.setattr(load, "cuda_device", lambda d: torch.device("cpu"))
        monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        yield load, stagers, events
    finally:
        for m in set(sys.modules) - before:
            if m.startswith("entropykit."):  # imported against the stand-in
                del sys.modules[m]
                parent, _, name = m.rpartition(".")
                if hasattr(sys.modules.get(parent), name):
                    delattr(sys.modules[parent], name)


def _two_files(tmp_path) -> list:
    paths = []
    for k, model in enumerate((_model(np.random.default_rng(5)),
                               _many_small(np.random.default_rng(7)))):
        src = tmp_path / f"m{k}.safetensors"
        safetensors.torch.save_file(model, src)
        paths.append(tmp_path / f"m{k}.ek.safetensors")
        files.compress_file(src, paths[-1], segment_bytes=1 << 16, target="gpu")
    return paths


def _threads_left() -> list:
    return [t for t in threading.enumerate()
            if t.name.startswith(("entropykit-plan", "entropykit-fill"))]


def test_a_stream_of_files_goes_through_one_stager_in_order(model_file, tmp_path,
                                                            monkeypatch):
    """``load.stream``'s host side (the device's part emulated): every file, or subset of
    one, through one stager, their groups in order; each file's tensors the CPU load's bit
    for bit, yielded once its groups are sent and checked, the next file's not begun
    before it is asked for; a damaged file raises its error after the files before it
    were yielded; the planning and fill threads stop."""
    with _emulated_stager(monkeypatch) as (load, stagers, events):
        paths = _two_files(tmp_path)
        wants = [entropykit.load_file(p, threads=1) for p in paths]
        cs = [Compressed(np.fromfile(p, np.uint8)) for p in paths]
        subset = list(wants[1])[1::3]
        jobs = [(cs[0], None), (cs[1], subset), (cs[1], None)]
        seconds = {}
        made = load.stream(jobs, "cuda", entropykit.dtypes.torch_types(), 2,
                           group_bytes=1 << 17, seconds=seconds)
        got = []
        for out in made:
            assert events[-1][0] == "check"  # yielded once its groups are sent and checked
            events.append(("yielded", ""))
            got.append(out)
        steps = [e for e, _ in events]
        assert len(stagers) == 1 and steps.count("check") == 3
        assert steps.count("stage") == steps.count("send") > 3
        assert {"plan_wait", "busy", "launch"} <= set(seconds)
        for (c, names), out in zip(jobs, got, strict=True):
            want = wants[cs.index(c)]
            assert list(out) == (list(want) if names is None else names)
            for k, t in out.items():
                assert torch.equal(_bits(t), _bits(want[k])), k
        bad = np.fromfile(paths[0], np.uint8)
        e = next(e for e in cs[0].outer.entries if e.nbytes > 20_000)
        bad[cs[0].outer.data_start + e.begin + e.nbytes // 2] ^= 0x20
        events.clear()
        made = load.stream([(cs[1], subset), (Compressed(bad), None), (cs[1], None)],
                           "cuda", entropykit.dtypes.torch_types(), 2, group_bytes=1 << 17)
        assert list(next(made)) == subset
        steps = [e for e, _ in events]
        assert "check" in steps and steps.count("check") == 1  # the next not begun
        with pytest.raises(CorruptDataError):
            next(made)
        assert not _threads_left()


def test_a_stream_started_now_launches_its_first_group_on_the_calling_thread(
        tmp_path, monkeypatch):
    """``load.stream(..., now=True)``: the first file's first group is planned, staged and
    sent before the call returns, on the calling thread, and nothing is checked yet; the
    rest, iterated on another thread, gives every file exact, as without ``now``. A
    first file that fails to plan raises when it is asked for, not at the call; a stream
    closed before it is iterated stops its threads."""
    with _emulated_stager(monkeypatch) as (load, _, events):
        paths = _two_files(tmp_path)
        wants = [entropykit.load_file(p, threads=1) for p in paths]
        cs = [Compressed(np.fromfile(p, np.uint8)) for p in paths]
        types = entropykit.dtypes.torch_types()
        made = load.stream([(cs[0], None), (cs[1], None)], "cuda", types, 2,
                           group_bytes=1 << 17, now=True)
        me = threading.current_thread().name
        assert [e for e, _ in events] == ["stage", "stage", "send"]  # the first sent
        assert {name for _, name in events} == {me}
        got: list = []
        side = threading.Thread(target=lambda: got.extend(made), name="side")
        side.start()
        side.join()
        assert len(got) == 2 and all(name == "side" for _, name in events[3:])
        for want, out in zip(wants, got, strict=True):
            assert list(out) == list(want)
            for k, t in out.items():
                assert torch.equal(_bits(t), _bits(want[k])), k
        assert not _threads_left()
        # a file with no group before its end: the pause comes before its check
        events.clear()
        made = load.stream([(cs[1], [])], "cuda", types, 2, now=True)
        assert events == [] and list(made) == [{}]
        events.clear()
        bad = np.fromfile(paths[1], np.uint8)
        e = cs[1].outer.entries[0]
        bad[cs[1].outer.data_start + e.begin: cs[1].outer.data_start + e.end] = 0xA5
        made = load.stream([(Compressed(bad), None)], "cuda", types, 2, now=True)
        assert events == []
        with pytest.raises(CorruptDataError):
            next(made)
        assert not _threads_left()
        made = load.stream([(cs[0], None), (cs[1], None)], "cuda", types, 2,
                           group_bytes=1 << 17, now=True)
        made.close()
        assert not _threads_left()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
