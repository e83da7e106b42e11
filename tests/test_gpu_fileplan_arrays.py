"""The GPU loader's host plan from arrays: frames parsed a run at a time, rows gathered once.

``fileplan`` parses the rANS frames of a run of segments (small payloads and the heads of
staged ones) in one pass (``_frames.parse``), and the planner gathers a launch's rows once
(``Planner._rows``). Here: the batch parse gives exactly ``frame.parse``'s result and
never accepts a frame ``frame.parse`` refuses (every byte of the header, tables and
directory of real frames changed in turn); the plan is the one made segment by segment
with each frame parsed alone and the rows gathered as before (a reference copy of the
earlier pair and block layout below), byte for byte, on files of many small tensors,
mixed bf16/fp8/fp32, one tensor, empty tensors; damaged frames with a recomputed position
CRC fail as they failed.
"""

import struct

import numpy as np
import pytest
import safetensors.torch
import torch
from test_gpu_fileplan import _compress, _flip, assert_same_plan, reference_groups, same_error
from test_gpu_load import _field_at, _many_small

from entropykit import CorruptDataError
from entropykit.coding import frame
from entropykit.container import payload, source
from entropykit.container.cuda import _frames, fileplan
from entropykit.container.reader import Compressed
from entropykit.rans import static
from entropykit.rans.cuda import plan as gplan


def _old_pairs(self):
    """The pairs as ``Planner._pairs`` built them before: int64[k, 2, _WIDTH] rows."""
    if not self.specs:
        return np.zeros((0, 2, gplan._WIDTH), np.int64)
    rows = gplan._chunk_rows(self.streams,
                             np.array(self.specs, np.int64).reshape(-1, gplan._SPEC))
    k = np.array(self.units, np.int64)
    per_add = 2 * k if self.bf16 else k
    start = np.cumsum(per_add) - per_add
    pairs_per = k if self.bf16 else (k + 1) // 2
    unit = np.repeat(np.arange(len(k)), pairs_per)
    j = np.arange(int(pairs_per.sum()), dtype=np.int64) - (np.cumsum(pairs_per)
                                                            - pairs_per)[unit]
    if self.bf16:
        a = start[unit] + j
        return np.stack([rows[a], rows[a + k[unit]]], axis=1)
    a = start[unit] + 2 * j
    odd = a + 1 >= start[unit] + k[unit]
    second = rows[np.where(odd, a, a + 1)]
    second[odd] = gplan._padding_like(rows[a[odd]])
    return np.stack([rows[a], second], axis=1)


def _old_rows(self):
    """``Planner._rows`` as blocks were laid out before (pairs gathered, padded in place),
    in the form ``_rows`` gives them: rows, the launch's row of each, its padding rows
    (none to make: the old rows hold theirs)."""
    pairs = _old_pairs(self)
    if len(pairs):
        w = self.warps
        steps = np.maximum(pairs[:, 0, gplan.D_N], pairs[:, 1, gplan.D_N])
        _, group = np.unique(pairs[:, :, [gplan.D_SYM, gplan.D_INFO]].reshape(len(pairs), 4),
                             axis=0, return_inverse=True)
        group = group.reshape(-1)
        order = np.lexsort((-steps, group))
        size = np.bincount(group)
        padded = -(-size // w) * w
        start = np.cumsum(size) - size
        blocks = []
        for g in range(len(size)):
            mine = order[start[g] : start[g] + size[g]]
            rows = pairs[mine]
            if padded[g] > size[g]:
                fill = np.repeat(pairs[mine[-1:]], padded[g] - size[g], axis=0)
                fill = np.stack([gplan._padding_like(fill[:, 0]),
                                 gplan._padding_like(fill[:, 1])], axis=1)
                rows = np.concatenate([rows, fill])
            blocks += [rows[i : i + w] for i in range(0, len(rows), w)]
        longest = [int(max(b[0, 0, gplan.D_N], b[0, 1, gplan.D_N])) for b in blocks]
        pairs = np.concatenate([blocks[i] for i in np.argsort(-np.array(longest),
                                                              kind="stable")])
    flat = pairs.reshape(-1, gplan._WIDTH)
    return flat, np.arange(len(flat)), np.zeros(0, np.int64)


def reference(c, monkeypatch, *args, **kw):
    """The plan segment by segment, each frame parsed alone, rows laid out as before."""
    with monkeypatch.context() as m:
        m.setattr(gplan.Planner, "_rows", _old_rows)
        return reference_groups(c, monkeypatch, *args, **kw)


def _frames_of(rng):
    """rANS frames of every shape the loader meets: one chunk or many, raw chunks,
    context tables, several precisions, n a multiple of the chunk or not."""
    out = []
    for n, chunk, prec in [(1, 1024, 12), (700, 1024, 8), (5000, 1024, 11),
                           (70_001, 1 << 16, 12), (3000, 1024, 15)]:
        sym = rng.geometric(0.3, n).clip(0, 255).astype(np.uint8)
        out.append((static.encode(sym, precision=prec, chunk_size=chunk), n, False))
        noise = rng.integers(0, 256, n, dtype=np.uint8)  # raw chunks
        out.append((static.encode(noise, precision=prec, chunk_size=chunk), n, False))
        ctx = (sym % 5).astype(np.uint8)
        mixed = np.where(ctx > 2, sym, noise[:n] & 7).astype(np.uint8)
        out.append((static.encode(mixed, precision=prec, chunk_size=chunk, context=ctx), n,
                    True))
    return [(np.frombuffer(f, np.uint8), n, has) for f, n, has in out]


def _same_info(a: frame.FrameInfo, b: frame.FrameInfo) -> None:
    assert (a.param, a.n, a.chunk_size, a.end) == (b.param, b.n, b.chunk_size, b.end)
    assert (a.cmap is None) == (b.cmap is None)
    if a.cmap is not None:
        assert np.array_equal(a.cmap, b.cmap)
    for name in ("freqs", "lengths", "crcs", "modes", "offsets"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_batch_parse_is_frame_parse():
    """Whole frames and heads of staged ones (the frame's size given, its first bytes
    held): the same parse as ``frame.parse``, context maps included."""
    frames = _frames_of(np.random.default_rng(1))
    assert any(f.size > _frames.HEAD_BYTES for f, _, _ in frames)
    got = _frames.parse([(f, f.size, n, has) for f, n, has in frames])
    heads = _frames.parse([(f[:_frames.HEAD_BYTES + 7], f.size, n, has)
                           for f, n, has in frames])
    tables = set()
    for (f, _, _), a, b in zip(frames, got, heads, strict=True):
        want = frame.parse(static.CODER, f)
        assert a is not None and b is not None
        _same_info(a, want)
        _same_info(b, want)
        tables.add(len(want.freqs))
        assert a.modes.any() or a.modes.size
    assert len(tables) > 1  # context frames among them
    assert _frames.parse([]) == []


def test_batch_parse_refuses_what_frame_parse_refuses():
    """Each byte of every frame's header, tables and directory changed (three ways), the
    count the field expects off by one, a context frame for a field without one, the
    directory past the bytes held: the batch parse accepts only frames ``frame.parse``
    accepts, with the same result, and refuses every frame it refuses."""
    frames = _frames_of(np.random.default_rng(2))
    cases = []
    for f, n, has in frames:
        cases += [(f, n + 1, has), (f, n - 1, has), (f, n, False), (f[:40], n, has)]
        d = frame.parse(static.CODER, f).offsets[0]  # the payloads start
        for at in range(min(int(d) + 2, f.size)):
            for x in (0x01, 0x80, 0xFF):
                g = f.copy()
                g[at] ^= x
                cases.append((g, n, has))
    got = _frames.parse([(g, g.size, n, has) for g, n, has in cases])
    accepted = refused = 0
    for (g, n, has), info in zip(cases, got, strict=True):
        try:
            want = frame.parse(static.CODER, g)
            ok = want.n == n and (has or want.cmap is None) and want.n > 0
        except (CorruptDataError, ValueError):
            ok = False
        if info is None:
            refused += 1
            continue
        assert ok, (n, has)
        _same_info(info, want)
        accepted += 1
    assert accepted > 0 and refused > len(frames) * 12
    # A directory ending past the first HEAD_BYTES: left to the per-frame parse.
    many = np.frombuffer(static.encode(np.zeros(700 * 1024, np.uint8) + 3, chunk_size=1024),
                         np.uint8)
    assert frame.parse(static.CODER, many).n == 700 * 1024
    assert _frames.parse([(many, many.size, 700 * 1024, False)]) == [None]


@pytest.fixture(scope="module")
def files_dir(tmp_path_factory):
    """Plain files: many small tensors (MiniLM-like layers), bf16 + fp8 + fp32, one
    tensor, empty tensors."""
    rng = np.random.default_rng(11)
    d = tmp_path_factory.mktemp("arrays")

    def w(*shape, scale=0.02):
        return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32))

    layers = {}
    for i in range(24):
        layers[f"l.{i}.q.weight"] = w(96, 96).bfloat16()
        layers[f"l.{i}.q.bias"] = w(96).bfloat16()
        layers[f"l.{i}.ff.weight"] = w(384, 96).bfloat16()
        layers[f"l.{i}.norm.weight"] = (1 + w(96)).bfloat16()
    layers["emb.weight"] = w(3000, 96).bfloat16()  # staged: large fields
    mix = {"a.bf16": w(512, 384).bfloat16(), "b.fp8": (w(256, 300) * 100).to(
        torch.float8_e4m3fn), "c.f32": w(300, 200), "d.fp8big": (w(700, 512) * 100).to(
        torch.float8_e4m3fn), "e.f32big": w(300, 300), "f.bf16big": w(1024, 384).bfloat16(),
        "g.tiny": w(3).bfloat16()}
    empty = {"e0": torch.zeros((0, 4), dtype=torch.bfloat16), "x": w(64, 64).bfloat16(),
             "e1": torch.zeros((0,), dtype=torch.float32), "y": w(33),
             "e2": torch.zeros((3, 0), dtype=torch.float8_e4m3fn)}
    out = {}
    for name, tensors in [("layers", layers), ("mix", mix), ("one", {"w": w(384, 700)
                                                                      .bfloat16()}),
                          ("onetiny", {"w": w(5).bfloat16()}), ("empty", empty),
                          ("small", _many_small(rng))]:
        out[name] = d / f"{name}.safetensors"
        safetensors.torch.save_file(tensors, out[name])
    return out


@pytest.mark.parametrize("codec_set", ["cpu", "gpu"])
@pytest.mark.parametrize(("segment_bytes", "group_bytes", "warps", "threads"),
                         [(1 << 24, fileplan.GROUP_BYTES, gplan.WARPS, 1),
                          (1 << 16, 1 << 17, 3, 2)])
def test_plan_is_the_frame_by_frame_plan(files_dir, tmp_path, monkeypatch, codec_set,
                                         segment_bytes, group_bytes, warps, threads):
    """Every batch, stream, staged file offset, device check and staging layout the same
    as the plan made segment by segment, each frame parsed alone, with the rows laid
    out as before."""
    for name, src in files_dir.items():
        ek = _compress(src, tmp_path / f"{name}.ek.safetensors", monkeypatch, codec_set,
                       segment_bytes)
        c = Compressed(source.FileBytes(ek))
        kw = {"warps": warps, "group_bytes": group_bytes}
        got = list(fileplan.groups(c, threads, **kw))
        want = reference(c, monkeypatch, threads, **kw)
        assert_same_plan(got, want, c.source)
        with monkeypatch.context() as m:  # staged as before: the same heads and checks
            m.setattr(gplan.Planner, "_rows", _old_rows)
            old = list(fileplan.groups(c, threads, **kw))
        for g, o in zip(got, old, strict=True):
            for p, q in zip(g.parts, o.parts, strict=True):
                assert np.array_equal(p.files, q.files) and np.array_equal(p.checks, q.checks)
                assert p.messages == q.messages


def _recrc(buf, name, at, n, crc_at, f):
    crc = payload.field_crc(buf[at : at + n], name, 0, f)
    buf[crc_at : crc_at + 4] = np.frombuffer(struct.pack("<I", crc), np.uint8)


@pytest.mark.parametrize("tensor", ["l.3.ff.weight", "emb.weight"])  # small; staged
@pytest.mark.parametrize("at", [0, 4, 5, 6, 8, 16, 20, 24, 28, "directory"])
def test_damaged_frame_fails_as_frame_by_frame(files_dir, tmp_path, monkeypatch, tensor, at):
    """A byte of an rANS frame's header, tables or directory changed, its position CRC
    recomputed: the error the frame parsed alone raises, word for word."""
    ek = _compress(files_dir["layers"], tmp_path / "l.ek.safetensors", monkeypatch, "gpu",
                   1 << 24)
    start, n, crc_at, f = _field_at(ek, tensor, "exponent")
    assert Compressed(np.fromfile(ek, np.uint8)).record.tensors[tensor].codecs[0][f] == "rans"
    assert (n > fileplan.STAGED_BYTES) == (tensor == "emb.weight")
    if at == "directory":  # a chunk's payload length
        head = np.fromfile(ek, np.uint8)[start : start + min(n, 1 << 16)]
        at = 28 + int(head[24:28].view("<u4")[0])
    bad = _flip(ek, tmp_path / "bad.safetensors", start + at)
    buf = np.fromfile(bad, np.uint8)
    _recrc(buf, tensor, start, n, crc_at, f)
    msg = same_error(Compressed(buf), monkeypatch, reference)
    assert msg.startswith(f"tensor {tensor!r} segment 0: field 'exponent' (rans)")


def test_counts_follow_the_split():
    assert fileplan._counts("BF16", None, (("exponent", None), ("sign_mantissa", "exponent")),
                            10) == (5, 5)
    assert fileplan._counts("BF16", None, (("byte0", None), ("byte1", None)), 10) is None
