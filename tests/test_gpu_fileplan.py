"""The GPU loader's host plan read in runs: the same plan as segment by segment, fewer reads.

``fileplan.groups`` reads each run of segments' field payloads together and checks their
position CRCs in one call (``Compressed.parts_of``, ``crc32_ranges``), raw bytes with the
fast CRC-32, a frame's tables split in one pass (``split_tables``). Here its output — every
descriptor, table, payload copy, stream byte and label the kernel and the stager read — is
compared with the plan made segment by segment as before (each segment read alone by
``segment_parts``, zlib CRCs, tables split row by row) on files of every dtype and codec
the GPU path takes, many tiny tensors, multi-segment tensors, old EKT1 files, and damaged
files, which must fail with the same error. A stream the plan stages from the file (a
large payload: only its head is read here) must hold there the bytes the reference read.
"""

import dataclasses
import pathlib
import struct
import zlib

import numpy as np
import pytest
import safetensors.torch
from test_gpu_load import _codecs_used, _field_at, _many_small, _model, emulated_tensors

from entropykit import CorruptDataError
from entropykit.coding import crc32 as crc_mod
from entropykit.container import codecs, files, payload, source
from entropykit.container.cuda import _staging, fileplan
from entropykit.container.reader import Compressed
from entropykit.rans.cuda import plan as gplan

DATA = pathlib.Path(__file__).parent / "data"


def _row_by_row(freqs, precision=None):
    """The tables as split before: one row at a time."""
    syms, infos = [], []
    for f in np.asarray(freqs, np.int64):
        syms.append(np.repeat(np.arange(f.size, dtype=np.uint8), f))
        infos.append(((f | (np.cumsum(f) - f) << 16)).astype(np.uint32))
    return np.concatenate(syms), np.stack(infos)


def _zlib_ranges(buf, starts, lengths, values):
    return np.array([zlib.crc32(buf[s : s + n], int(v)) for s, n, v in
                     zip(np.asarray(starts).tolist(), np.asarray(lengths).tolist(),
                         np.asarray(values).tolist(), strict=True)], np.uint32)


def _by_segment(c, run, arena=None):
    return [fileplan._plan_segment(c, j, c.segment_parts(
        j.entry.name, j.fields or c.fields(j.entry.name), j.seg)) for j in run]


def reference_groups(c, monkeypatch, *args, **kw) -> list[fileplan.Group]:
    """``fileplan.groups`` planned segment by segment, as before the runs were read
    together."""
    with monkeypatch.context() as m:
        m.setattr(fileplan, "STAGED_BYTES", 1 << 62)  # every payload read whole, as before
        m.setattr(fileplan, "_plan_run", _by_segment)
        m.setattr(fileplan, "crc32_ranges", _zlib_ranges)
        m.setattr(fileplan, "crc32", zlib.crc32)
        m.setattr(gplan, "split_tables", _row_by_row)
        return list(fileplan.groups(c, *args, **kw))


def same_error(damaged: Compressed, monkeypatch, reference=None) -> str:
    """The message ``fileplan.groups`` refuses ``damaged`` with, asserted to be the one the
    reference plan (``reference_groups`` by default) refuses it with."""
    with pytest.raises(CorruptDataError) as want:
        (reference or reference_groups)(damaged, monkeypatch, 1)
    with pytest.raises(CorruptDataError) as got:
        list(fileplan.groups(damaged, 1))
    assert str(got.value) == str(want.value)
    return str(got.value)


def assert_same_plan(got: list[fileplan.Group], want: list[fileplan.Group],
                     src: source.Bytes | None = None) -> None:
    """The same batches; a stream ``got`` stages from the file (``Part.files``) holds
    there the bytes of ``want``'s stream (``src``: the file)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g.parts) == len(w.parts)
        for p, q in zip(g.parts, w.parts, strict=True):
            assert p.tensors == q.tensors
            a, b = p.batch, q.batch
            assert (a.bf16, a.warps, a.slots, a.payload_size, a.sizes) == \
                (b.bf16, b.warps, b.slots, b.payload_size, b.sizes)
            for name in ("copies", "sym_tables", "info_tables", "cmaps", "desc",
                         "out_index", "origin"):
                x, y = getattr(a, name), getattr(b, name)
                assert x.dtype == y.dtype and x.shape == y.shape, name
                assert np.array_equal(x, y), name
            assert [s.label for s in a.streams] == [s.label for s in b.streams]
            staged = dict(p.files.tolist())
            datas = []
            for k, (s, t) in enumerate(zip(a.streams, b.streams, strict=True)):
                data = src.read(staged[k], s.data.size) if k in staged else s.data
                assert np.array_equal(data, t.data), s.label
                assert (s.info is None) == (t.info is None) and s.classed == t.classed
                datas.append(data)
            real = dataclasses.replace(a, streams=tuple(
                dataclasses.replace(s, data=d) for s, d in zip(a.streams, datas, strict=True)))
            assert np.array_equal(real.payload, b.payload)
        sg, sw = _staging.Staging.of(g), _staging.Staging.of(w)
        assert (sg.payload, sg.sections, sg.moves_at) == (sw.payload, sw.sections, sw.moves_at)
        assert np.array_equal(sg.moves, sw.moves)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fileplan") / "model.safetensors"
    safetensors.torch.save_file(_model(np.random.default_rng(5)), path)
    return path


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory):
    """2-D weights whose rows differ in scale (rans2d's class maps, tables per class)."""
    import torch

    rng = np.random.default_rng(6)
    scale = np.exp2(rng.uniform(-3, 3, (384, 1))).astype(np.float32) * 0.02
    w = torch.from_numpy(rng.standard_normal((384, 700)).astype(np.float32) * scale)
    path = tmp_path_factory.mktemp("fileplan") / "grid.safetensors"
    safetensors.torch.save_file({"w.bf16": w.to(torch.bfloat16), "w.f16": w.to(torch.float16),
                                 "w.e4m3": (w * 200).to(torch.float8_e4m3fn)}, path)
    return path


@pytest.fixture(scope="module")
def small_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("fileplan") / "small.safetensors"
    safetensors.torch.save_file(_many_small(np.random.default_rng(9)), path)
    return path


def _compress(src, dst, monkeypatch, codec_set: str, segment_bytes: int):
    with monkeypatch.context() as m:
        if codec_set == "tans":  # as earlier defaults wrote: tANS fields, host-decoded
            old = dataclasses.replace(codecs.CPU, candidates=("rans", "tans", "zstd", "raw",
                                                              "rans2d"))
            m.setitem(codecs.POLICIES, ("cpu", False), old)
        files.compress_file(src, dst, threads=2, segment_bytes=segment_bytes,
                            target="gpu" if codec_set == "gpu" else "cpu")
    return dst


@pytest.mark.parametrize("codec_set", ["cpu", "gpu", "tans"])
@pytest.mark.parametrize(("segment_bytes", "group_bytes", "warps", "threads"),
                         [(1 << 24, fileplan.GROUP_BYTES, gplan.WARPS, 1),
                          (1 << 16, 1 << 17, 3, 2)])
def test_plan_is_the_segment_by_segment_plan(model_file, small_file, grid_file, tmp_path,
                                             monkeypatch, codec_set, segment_bytes,
                                             group_bytes, warps, threads):
    """Every dtype (BF16 pairs, byte planes of F32/F16/F64/fp8/ints, host-split layouts),
    every codec (rans, rans2d, tans, zstd, raw), hundreds of tiny tensors, tensors of
    several segments, groups cut small: the same batches byte for byte."""
    used = set()
    for src in (model_file, small_file, grid_file):
        ek = _compress(src, tmp_path / f"{src.stem}.ek.safetensors", monkeypatch, codec_set,
                       segment_bytes)
        used |= {cd for _, cd in _codecs_used(ek)}
        c = Compressed(source.FileBytes(ek))
        kw = {"warps": warps, "group_bytes": group_bytes}
        assert_same_plan(list(fileplan.groups(c, threads, **kw)),
                         reference_groups(c, monkeypatch, threads, **kw), c.source)
        names = c.keys()[1::3]  # a subset, as from_pretrained asks for one device
        entries = [c.entry(k) for k in names]
        assert_same_plan(list(fileplan.groups(c, threads, entries=entries, **kw)),
                         reference_groups(c, monkeypatch, threads, entries=entries, **kw),
                         c.source)
    want = {"cpu": {"rans", "rans2d", "zstd", "raw"}, "gpu": {"rans", "raw", "zstd"},
            "tans": {"tans", "rans", "zstd", "raw"}}[codec_set]
    assert want <= used


@pytest.mark.parametrize("name", ["legacy_v1.ek.safetensors", "legacy_v2.ek.safetensors"])
def test_plan_of_files_without_position_crcs(monkeypatch, name):
    c = Compressed(np.fromfile(DATA / name, np.uint8))
    assert_same_plan(list(fileplan.groups(c, 1)), reference_groups(c, monkeypatch, 1),
                     c.source)


class _Counted(source.FileBytes):
    reads = 0

    def read(self, offset, n, scratch=None):
        type(self).reads += 1
        return super().read(offset, n, scratch)


@pytest.mark.parametrize("threads", [1, 2])
def test_many_small_tensors_are_read_in_runs(small_file, tmp_path, monkeypatch, threads):
    """A file of hundreds of tiny tensors: one read per run of segments (tensors of one
    segment: the index with the field payloads), not two for each tensor's index and one
    per segment; planned on one thread, runs of a group's worth (here one), on more, of
    ``RUN_BYTES`` (several)."""
    ek = _compress(small_file, tmp_path / "s.ek.safetensors", monkeypatch, "cpu", 1 << 24)
    monkeypatch.setattr(fileplan, "STAGED_BYTES", 1 << 62)  # no payload staged from the file
    monkeypatch.setattr(fileplan, "RUN_BYTES", 1 << 16)
    with _Counted(ek) as f:
        c = Compressed(f)
        runs = len(list(fileplan._jobs(c, c.original.by_offset)))  # of RUN_BYTES
        _Counted.reads = 0
        list(fileplan.groups(c, threads))
    tensors = len(c.keys())
    assert tensors > 200 and 1 < runs < 40
    assert _Counted.reads == (1 if threads == 1 else runs)


def _flip(path, out, at: int) -> pathlib.Path:
    buf = np.fromfile(path, np.uint8)
    buf[at] ^= 0x04
    buf.tofile(out)
    return out


def test_damage_fails_as_segment_by_segment(model_file, tmp_path, monkeypatch):
    """A payload byte changed (its position CRC not): the same error, naming the same
    tensor, segment and field; two damaged fields of one run: the first in data order."""
    ek = _compress(model_file, tmp_path / "m.ek.safetensors", monkeypatch, "cpu", 1 << 16)
    c = Compressed(np.fromfile(ek, np.uint8))
    order = c.keys()
    first, later = order[1], order[4]
    at1, n1, _, f1 = _field_at(ek, first, c.record.tensors[first].fields[-1][0])
    at2, n2, _, _ = _field_at(ek, later, c.record.tensors[later].fields[0][0])
    one = _flip(ek, tmp_path / "one.safetensors", at1 + n1 // 2)
    both = _flip(one, tmp_path / "both.safetensors", at2 + n2 // 2)
    for bad in (one, both):
        msg = same_error(Compressed(np.fromfile(bad, np.uint8)), monkeypatch)
        assert msg.startswith(f"tensor {first!r} segment 0: field {f1} ")
        assert "position CRC-32" in msg


def test_raw_field_damage_with_a_recomputed_position_crc(model_file, tmp_path, monkeypatch):
    """A raw field's own CRC-32 (the fast one now) still catches a changed byte."""
    ek = _compress(model_file, tmp_path / "g.ek.safetensors", monkeypatch, "gpu", 1 << 24)
    at, n, crc_at, f = _field_at(ek, "big.bf16", "sign_mantissa")
    assert ("sign_mantissa", "raw") in _codecs_used(ek)
    buf = np.fromfile(ek, np.uint8)
    buf[at + n // 3] ^= 0x10
    buf[crc_at : crc_at + 4] = np.frombuffer(
        struct.pack("<I", payload.field_crc(buf[at : at + n], "big.bf16", 0, f)), np.uint8)
    c = Compressed(buf)
    with pytest.raises(CorruptDataError, match=r"^tensor 'big\.bf16' segment 0: field "
                                               r"'sign_mantissa' \(raw\): raw field fails"):
        emulated_tensors(c, 2)  # staged from the file: checked by the device


def test_parts_of_is_segment_parts_in_any_order(model_file, tmp_path, monkeypatch):
    """Segments far apart, out of order and of several tensors: the same views."""
    ek = _compress(model_file, tmp_path / "p.ek.safetensors", monkeypatch, "cpu", 1 << 16)
    c = Compressed(source.FileBytes(ek))
    segs = [(k, c.fields(k), s) for k in c.keys() for s in range(len(c.bounds(c.entry(k))))]
    segs = segs[::-1][::2] + segs[1::5] + [(k, None, 0) for k in c.keys()[::2]
                                                     if c.bounds(c.entry(k))]
    assert any(len(c.bounds(c.entry(k))) > 1 for k, _, _ in segs)
    for got, (k, fl, s) in zip(c.parts_of(segs), segs, strict=True):
        want = c.segment_parts(k, fl or c.fields(k), s)
        assert len(got) == len(want)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert c.parts_of([]) == []


@pytest.mark.parametrize("accelerated", [True, False])
def test_crc32_ranges_is_zlib_per_range(monkeypatch, accelerated):
    monkeypatch.setattr(crc_mod, "ACCELERATED", accelerated and crc_mod.ACCELERATED)
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 300_000, dtype=np.uint8)
    starts = np.concatenate([[0, 1, 7, 100], rng.integers(0, 150_000, 60)])
    lengths = np.concatenate([[0, 1, 63, 150_001], rng.integers(0, 9_000, 60)])
    seeds = rng.integers(0, 1 << 32, starts.size, dtype=np.uint64).astype(np.uint32)
    for view in (buf, buf[5:]):
        got = crc_mod.crc32_ranges(view, starts, lengths, seeds)
        assert got.dtype == np.uint32
        assert np.array_equal(got, _zlib_ranges(view, starts, lengths, seeds))


def test_split_tables_is_split_table_per_row():
    rng = np.random.default_rng(4)
    for precision in (9, 12, 15):
        freqs = np.zeros((5, 256), np.int64)
        for row in freqs:
            k = rng.integers(1, 256)
            cuts = np.sort(rng.choice(np.arange(1, 1 << precision), k - 1, replace=False))
            row[rng.choice(256, k, replace=False)] = np.diff(np.r_[0, cuts, 1 << precision])
        sym, info = gplan.split_tables(freqs, precision)
        want_sym, want_info = _row_by_row(freqs, precision)
        assert np.array_equal(sym, want_sym) and np.array_equal(info, want_info)
        one_sym, one_info = gplan.split_table(freqs[2], precision)
        assert np.array_equal(one_sym, want_sym[2 << precision : 3 << precision])
        assert np.array_equal(one_info, want_info[2])


def test_arena_hands_out_fresh_disjoint_buffers_from_large_blocks():
    """Reads held together come from a few large allocations (huge pages where the kernel
    has them), never sharing bytes; a read of a quarter block or more gets its own."""
    arena = source.Arena(block=1 << 16)
    sizes = [1, 100, 16_000, 16_000, 16_000, 16_000, 16_000, 3, 16_384, 0]
    got = [arena.get(n) for n in sizes]
    assert [g.size for g in got] == sizes
    carved = [g for g, n in zip(got, sizes, strict=True) if 0 < n < 1 << 14]
    addr = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    for i, a in enumerate(carved):
        assert a.base is not None and a.base.size == 1 << 16
        assert (addr(a) - addr(a.base)) % 64 == 0  # each starts on a cache line
        for b in carved[i + 1:]:
            assert not np.shares_memory(a, b)
    assert len({id(g.base) for g in carved}) == 2  # the fifth 16_000 starts a new block
    assert got[8].base is None or got[8].base.size == 1 << 14  # its own array


def test_plan_threads_only_where_the_host_decodes(model_file, small_file, tmp_path,
                                                  monkeypatch):
    """The loader plans on several threads only where segments of a run's size or more
    are decoded on the host (tANS fields, as earlier defaults wrote): elsewhere the plan
    is Python, and one thread plans it (fewer GIL hand-offs); a run's size counts."""
    for codec_set in ("gpu", "cpu"):
        for src in (model_file, small_file):
            dst = _compress(src, tmp_path / f"{codec_set}-{src.name}", monkeypatch, codec_set,
                            1 << 16)
            c = Compressed(np.fromfile(dst, np.uint8))
            assert fileplan.plan_threads(c, c.original.by_offset, 4) == 1, (codec_set, src)
    dst = _compress(model_file, tmp_path / "tans.safetensors", monkeypatch, "tans", 1 << 16)
    c = Compressed(np.fromfile(dst, np.uint8))
    host = sum(hi - lo for e in c.original.by_offset
               for (lo, hi), seg in zip(c.bounds(e), c.record.tensors[e.name].codecs,
                                        strict=True)
               if set(seg) - {"rans", "rans2d", "raw"})
    assert host > 0
    monkeypatch.setattr(fileplan, "RUN_BYTES", host)
    assert fileplan.plan_threads(c, c.original.by_offset, 4) == 4
    monkeypatch.setattr(fileplan, "RUN_BYTES", host + 1)
    assert fileplan.plan_threads(c, c.original.by_offset, 4) == 1
