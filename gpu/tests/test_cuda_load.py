"""``entropykit.load_file(path, device="cuda")`` on files built here.

What it is: MiniLM-shaped files (embeddings, two encoder layers, LayerNorms, biases, an
int64 buffer) of seeded random weights in bf16 (with a tensor of NaN / inf / zero /
subnormal values), fp8 e4m3 (scaled per tensor) and fp32, each compressed for the CPU
(the default) and for the GPU; every load on the device must equal ``load_file(cpu)`` of
the compressed file and of the original bit for bit (names, dtypes, shapes, bytes; the
caching allocator's free memory poisoned first), and a damaged rANS-coded or raw field
must raise ``CorruptDataError`` naming the tensor and field on both devices
(load_check.py's checks). What it is not: load timings (load_check.py on the carried
MiniLM files).
"""

from __future__ import annotations

import device_check as dc
import load_check as lc
import numpy as np
import pytest
import safetensors.torch
import torch

import entropykit

pytestmark = pytest.mark.cuda

HIDDEN, FFN, VOCAB, LAYERS = 384, 1536, 4096, 2
DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn, "f32": torch.float32}


def _shapes() -> dict[str, tuple[int, ...]]:
    out = {"embeddings.word_embeddings.weight": (VOCAB, HIDDEN),
           "embeddings.position_embeddings.weight": (512, HIDDEN),
           "embeddings.token_type_embeddings.weight": (2, HIDDEN),
           "embeddings.LayerNorm.weight": (HIDDEN,), "embeddings.LayerNorm.bias": (HIDDEN,)}
    for i in range(LAYERS):
        at = f"encoder.layer.{i}."
        for name in ("attention.self.query", "attention.self.key", "attention.self.value",
                     "attention.output.dense"):
            out |= {f"{at}{name}.weight": (HIDDEN, HIDDEN), f"{at}{name}.bias": (HIDDEN,)}
        out |= {f"{at}intermediate.dense.weight": (FFN, HIDDEN),
                f"{at}intermediate.dense.bias": (FFN,),
                f"{at}output.dense.weight": (HIDDEN, FFN), f"{at}output.dense.bias": (HIDDEN,)}
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            out |= {f"{at}{norm}.weight": (HIDDEN,), f"{at}{norm}.bias": (HIDDEN,)}
    return out


def minilm_like(kind: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights of MiniLM's shapes (a smaller vocabulary, two layers) in ``kind``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, (name, shape) in enumerate(_shapes().items()):
        w = torch.randn(shape, generator=g)
        if name.endswith("LayerNorm.weight"):
            w = 1 + 0.05 * w
        else:
            w *= 0.01 if name.endswith("bias") else 0.02 + 0.01 * (k % 4)
        if kind == "e4m3":
            w = w / (w.abs().max() / 448)
        out[name] = w.to(DTYPES[kind]).contiguous()
    if kind == "bf16":
        out["specials"] = torch.from_numpy(dc.specials(100_003).view(np.int16)).view(
            torch.bfloat16)
    out["embeddings.position_ids"] = torch.arange(512, dtype=torch.int64)[None]
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """kind -> (original, {target: compressed})."""
    work = tmp_path_factory.mktemp("load")
    out = {}
    for kind in DTYPES:
        orig = work / f"{kind}.safetensors"
        safetensors.torch.save_file(minilm_like(kind), orig)
        eks = {}
        for target in ("cpu", "gpu"):
            eks[target] = work / f"{kind}.{target}.ek.safetensors"
            entropykit.compress_file(orig, eks[target], target=target)
        out[kind] = (orig, eks)
    return out


@pytest.mark.parametrize("kind", sorted(DTYPES))
def test_cuda_load_is_the_cpu_load_and_the_original(files, kind):
    orig, eks = files[kind]
    rows = lc.check_exact(kind, orig, eks)
    assert [(r["target"], r["bad"]) for r in rows if not r["exact"]] == []
    assert [r["tensors"] for r in rows] == [len(_shapes()) + 1 + (kind == "bf16")] * 2
    got = entropykit.load_file(eks["gpu"], "cuda")
    assert {t.device.type for t in got.values()} == {"cuda"}


def test_damaged_fields_raise_naming_tensor_and_field(files, tmp_path):
    rows = lc.corruption(files["bf16"][1]["gpu"], tmp_path)
    assert [r["codec"] for r in rows] == ["rans", "raw"]
    assert [(r["codec"], r["cpu"], r["gpu"]) for r in rows if not r["ok"]] == []


def _row_scaled(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Weights whose rows and columns differ in scale: the default codes their exponents
    (bf16) or bytes (fp8) as rans2d."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(1.5 * torch.randn(shape[0], 1, generator=g)) * torch.exp(
        0.7 * torch.randn(1, shape[1], generator=g))
    return (torch.randn(shape, generator=g) * scale * 0.02).to(dtype).contiguous()


@pytest.mark.parametrize("segment_bytes", [1 << 24, 3 * (1 << 14) + 8])
def test_default_file_with_rans2d_fields_decodes_on_the_device(tmp_path, segment_bytes):
    """rans2d fields go to the kernel's classed build: bit-exact with the CPU load, also
    with segments that start mid-row, and none of their fields decoded on the host."""
    from entropykit.container import files
    from entropykit.container.cuda import fileplan
    from entropykit.container.reader import Compressed

    orig = tmp_path / "rows.safetensors"
    safetensors.torch.save_file({
        "a.bf16": _row_scaled((384, 1000), torch.bfloat16, 1),
        "b.bf16": _row_scaled((1536, 384), torch.bfloat16, 2),
        "c.e4m3": _row_scaled((256, 300), torch.float32, 3).clamp(-448, 448)
        .to(torch.float8_e4m3fn),
        "d.bf16": _row_scaled((3, 50_000), torch.bfloat16, 4)}, orig)
    ek = tmp_path / "rows.ek.safetensors"
    files.compress_file(orig, ek, segment_bytes=segment_bytes)
    c = Compressed(np.fromfile(ek, np.uint8))
    used = {cd for t in c.record.tensors.values() for seg in t.codecs for cd in seg}
    assert "rans2d" in used and "tans" not in used
    assert any(p.batch.classed and p.batch.bf16 for g in fileplan.groups(c) for p in g.parts)
    rows = lc.check_exact("rows", orig, {"cpu": ek})
    assert [(r["target"], r["bad"]) for r in rows if not r["exact"]] == []

def _many_small(seed: int = 0) -> dict[str, torch.Tensor]:
    """Hundreds of tiny tensors of mixed dtypes (empty, one element, a few hundred), then
    two that span several 64 KiB segments."""
    g = torch.Generator().manual_seed(seed)
    kinds = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int64,
             torch.uint8, torch.bool]
    out = {}
    for k in range(300):
        w = torch.randn([0, 1, 2, 7, 64, 385, 1000, 3][k % 8], generator=g)
        dt = kinds[k % len(kinds)]
        out[f"layer.{k // 8}.t{k % 8}"] = (w > 0) if dt == torch.bool else (w * 5).to(dt)
    out["z.span.f32"] = torch.randn(40_000, generator=g)
    out["z.span.bf16"] = (torch.randn(70_001, generator=g) * 0.02).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_cuda_load_of_many_small_tensors_and_of_subsets(tmp_path, target):
    """Hundreds of tiny tensors in one plan, and any subset of a file's tensors (what
    from_pretrained asks for one device), equal the CPU load bit for bit; segments and
    groups cut small so that tensors span groups."""
    from entropykit import dtypes
    from entropykit.container import files as cfiles
    from entropykit.container.cuda import fileplan
    from entropykit.container.cuda.load import load
    from entropykit.container.reader import Compressed

    orig, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_many_small(), orig)
    cfiles.compress_file(orig, ek, segment_bytes=1 << 16, target=target)
    want = entropykit.load_file(ek)
    names = list(want)
    types = dtypes.torch_types()
    with cfiles.opened(ek) as f:
        c = Compressed(f)
        for group_bytes in (fileplan.GROUP_BYTES, 1 << 16):
            for subset in (names, names[::3], names[1:2], names[-5:],
                           [k for k in names if want[k].numel() == 0]):
                got = load(c, "cuda", types, 4, names=subset, group_bytes=group_bytes)
                assert list(got) == subset
                for k in subset:
                    assert got[k].device.type == "cuda" and got[k].dtype == want[k].dtype
                    assert got[k].shape == want[k].shape, k
                    assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                                       want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("target", ["cpu", "gpu"])
def test_from_pretrained_decodes_each_shard_in_one_gpu_batch(tmp_path, monkeypatch, target):
    """``from_pretrained(ek, device_map={"": "cuda:0"})`` of a sharded checkpoint decodes
    each shard's tensors on the GPU in one batch, every shard through one GPU load (one
    plan thread and stager, its first group planned and launched on the calling thread),
    and gives the plain load's state dict bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from entropykit import api

    batches, started = [], []
    real = api._load_many

    def spy(jobs, device, threads, now=False):
        batches.extend((str(device), len(names)) for _, names in jobs)
        started.append(now)
        return real(jobs, device, threads, now=now)

    monkeypatch.setattr(api, "_load_many", spy)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    plain_dir, ek = tmp_path / "plain", tmp_path / "ek"
    transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(
        plain_dir, max_shard_size="60KB")
    entropykit.compress_file(plain_dir, ek, target=target)
    kw = {"device_map": {"": "cuda:0"}}
    plain = transformers.AutoModelForCausalLM.from_pretrained(plain_dir, **kw)
    packed = transformers.AutoModelForCausalLM.from_pretrained(ek, **kw)
    shards = len(list(ek.glob("*.safetensors")))
    assert shards > 1 and [d for d, _ in batches] == ["cuda:0"] * shards
    assert started == [True]  # its first group launched when the shards were opened
    sa, sb = plain.state_dict(), packed.state_dict()
    assert sum(n for _, n in batches) == len(sa) and sa.keys() == sb.keys()
    for k in sa:
        assert sb[k].device == sa[k].device and sb[k].dtype == sa[k].dtype, k
        assert torch.equal(sa[k].reshape(-1).view(torch.uint8),
                           sb[k].reshape(-1).view(torch.uint8)), k


def test_moved_payload_in_a_run_of_small_tensors_fails_as_on_the_cpu(tmp_path):
    """A changed byte in a field payload of a tiny tensor (its position CRC not updated):
    the GPU load, which reads and checks a run of small tensors together, raises the CPU
    load's error, naming the same tensor, segment and field."""
    from entropykit import CorruptDataError
    from entropykit.container.reader import Compressed

    orig, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_many_small(1), orig)
    entropykit.compress_file(orig, ek)
    buf = np.fromfile(ek, np.uint8)
    c = Compressed(buf)
    name = "layer.5.t5"  # 385 float8 values
    o = next(e for e in c.outer.entries if e.name == name)
    buf[c.outer.data_start + o.end - 1] ^= 0x20  # the last byte of its last field payload
    bad = tmp_path / "bad.safetensors"
    buf.tofile(bad)
    with pytest.raises(CorruptDataError) as cpu:
        entropykit.load_file(bad)
    with pytest.raises(CorruptDataError) as gpu:
        entropykit.load_file(bad, "cuda")
    assert str(gpu.value) == str(cpu.value)
    assert f": tensor {name!r} segment 0: field " in str(gpu.value)  # after the file's path


@pytest.mark.parametrize("name", ["encoder.layer.0.attention.self.query.weight",
                                  "embeddings.word_embeddings.weight"])  # small; staged
def test_damaged_frame_header_with_its_position_crc_recomputed(files, tmp_path, name):
    """The magic of a tensor's exponent frame changed and its position CRC recomputed (a
    run's frames are parsed together, small payloads and staged heads): the GPU load
    raises the frame's own error, naming tensor, segment and field."""
    import struct

    from entropykit import CorruptDataError
    from entropykit.container import payload
    from entropykit.container.reader import Compressed

    ek = files["bf16"][1]["gpu"]
    buf = np.fromfile(ek, np.uint8)
    c = Compressed(buf)
    t = c.record.tensors[name]
    f = [x[0] for x in t.fields].index("exponent")
    assert t.codecs[0][f] == "rans"
    o = next(e for e in c.outer.entries if e.name == name)
    head = c.outer.data_start + o.begin
    k = len(t.codecs) * len(t.fields)
    lengths = buf[head + 8 : head + 8 + 8 * k].view("<u8").astype(np.int64)
    at, n = head + 8 + 12 * k + int(lengths[:f].sum()), int(lengths[f])
    buf[at] ^= 0x04  # "EKRA" no more
    crc = payload.field_crc(buf[at : at + n], name, 0, f)
    buf[head + 8 + 8 * k + 4 * f : head + 12 + 8 * k + 4 * f] = np.frombuffer(
        struct.pack("<I", crc), np.uint8)
    bad = tmp_path / "bad.safetensors"
    buf.tofile(bad)
    with pytest.raises(CorruptDataError, match="not a rANS frame: magic") as gpu:
        entropykit.load_file(bad, "cuda")
    assert f"tensor {name!r} segment 0: field 'exponent' (rans)" in str(gpu.value)


def test_crc_kernels_are_zlib_per_row():
    """``_crc.cu`` on the device: rows at every alignment, shorter than, equal to and
    longer than a piece, empty, with seeds; a wrong wanted CRC fails exactly its row."""
    import zlib

    from entropykit.container.cuda import _crc

    rng = np.random.default_rng(8)
    host = rng.integers(0, 256, 3 * _crc.PIECE + 999, dtype=np.uint8)
    rows = []
    for a, n in [(0, 0), (1, 1), (3, 15), (5, 16), (7, 17), (16, _crc.PIECE),
                 (9, _crc.PIECE + 1), (0, host.size), (host.size - 1, 1), (100, 2 * _crc.PIECE)]:
        seed = int(rng.integers(0, 1 << 32))
        want = zlib.crc32(host[a : a + n].tobytes(), seed)
        rows += [(a, n, seed, want), (a, n, seed, want ^ 1 << int(rng.integers(32)))]
    rows = np.array(rows, np.int64)
    first = _crc.first_pieces(rows[:, 1])
    dev = torch.device("cuda", torch.cuda.current_device())
    staged = torch.from_numpy(host).to(dev)
    r, f = torch.from_numpy(rows).to(dev), torch.from_numpy(first).to(dev)
    out = torch.zeros(2 * len(rows), dtype=torch.int32, device=dev)
    _crc.launch(dev, r.data_ptr(), f.data_ptr(), len(rows), int(first[-1]), staged.data_ptr(),
                out.data_ptr() + 4 * len(rows), out.data_ptr())
    assert out[: len(rows)].cpu().tolist() == [0, 1] * (len(rows) // 2)


def _staged_model(seed: int) -> dict[str, torch.Tensor]:
    """Tensors whose field payloads are large enough to be staged from the file, of
    bf16, fp8, fp32 and integer dtypes, and bytes half skewed, half noise (raw chunks)."""
    g = torch.Generator().manual_seed(seed)
    w = _row_scaled((512, 1100), torch.float32, seed)
    rng = np.random.default_rng(seed)
    half = torch.from_numpy(np.concatenate([np.minimum(rng.geometric(0.3, 200_000), 255),
                                            rng.integers(0, 256, 200_000)]).astype(np.uint8))
    return {"w.bf16": w.to(torch.bfloat16), "w.e4m3": (w * 300).to(torch.float8_e4m3fn),
            "w.f32": w[:200].contiguous(), "ids": torch.randint(0, 30_000, (70_000,),
                                                                 generator=g),
            "half": half, "noise": torch.randint(0, 256, (200_000,), generator=g,
                                                 dtype=torch.uint8)}


@pytest.mark.parametrize("target", ["cpu", "gpu"])
@pytest.mark.parametrize("segment_bytes", [1 << 24, 1 << 18])
def test_exact_loads_of_files_staged_from_the_file(tmp_path, target, segment_bytes):
    """bf16, fp8, fp32 and int64 tensors whose large payloads go from the file straight
    into the staging buffer and are CRC-checked on the device: the CPU load bit for bit
    (one and several segments a tensor)."""
    from entropykit.container import files, source
    from entropykit.container.cuda import fileplan
    from entropykit.container.reader import Compressed

    orig, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_staged_model(2), orig)
    files.compress_file(orig, ek, target=target, segment_bytes=segment_bytes)
    with source.FileBytes(ek) as f:
        staged = sum(len(p.files) for g in fileplan.groups(Compressed(f)) for p in g.parts)
    assert staged >= 6
    want = entropykit.load_file(ek)
    got = entropykit.load_file(ek, "cuda")
    plain = safetensors.torch.load_file(orig)
    assert list(got) == list(want)
    for k in want:
        for ref in (want[k], plain[k]):
            assert got[k].dtype == ref.dtype and got[k].shape == ref.shape, k
            assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                               ref.reshape(-1).view(torch.uint8)), k


def test_old_files_load_on_the_device():
    """Files of earlier record versions (EKT1 payloads, no position CRCs) still load."""
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "tests" / "data"
    for name in ("legacy_v1.ek.safetensors", "legacy_v2.ek.safetensors"):
        want = entropykit.load_file(data / name)
        got = entropykit.load_file(data / name, "cuda")
        assert list(got) == list(want)
        for k in want:
            assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                               want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("kind", ["position", "head", "raw chunk", "raw field"])
def test_damage_in_each_kind_of_staged_range_is_caught_by_the_crc_kernel(tmp_path, kind):
    """A changed byte in each kind of range ``_crc.cu`` checks: a staged payload's body
    (its position CRC), a byte of the head the host read and parsed without checking it
    (a coded chunk's CRC in the frame's directory: the seed differs), a raw chunk of a
    staged frame and a raw field (their position CRCs recomputed: their own CRCs catch
    it): CorruptDataError naming the file, tensor, segment and field, as the plan names
    the check."""
    import struct

    from entropykit import CorruptDataError
    from entropykit.container import payload, source
    from entropykit.container.cuda import fileplan
    from entropykit.container.reader import Compressed

    orig, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_staged_model(3), orig)
    entropykit.compress_file(orig, ek)
    checks = []
    c = Compressed(source.FileBytes(ek))
    for group in fileplan.groups(c):
        for part in group.parts:
            at = dict(part.files.tolist())
            for (k, off, n, *_), msg in zip(part.checks.tolist(), part.messages, strict=True):
                checks.append((msg, at[k] + off, n, at[k]))
    want = {"position": "position CRC-32", "head": "position CRC-32",
            "raw chunk": "(raw) fails its CRC-32", "raw field": "raw field fails its CRC-32"}
    msg, at, n, frame = next(x for x in checks if want[kind] in x[0])
    buf = np.fromfile(ek, np.uint8)
    # The device checks from the end of the frame's directory (chunk CRCs, then modes) on.
    chunks = int(buf[frame + 20 : frame + 24].view("<u4")[0])
    where = at - chunks - 1 if kind == "head" else at + n // 2
    buf[where] ^= 0x08
    if kind in ("raw chunk", "raw field"):  # recompute the field's position CRC
        name = msg.split("'")[1]
        t = c.record.tensors[name]
        o = next(e for e in c.outer.entries if e.name == name)
        head = c.outer.data_start + o.begin
        fields = c.fields(name)
        f = next(i for i, off in enumerate(fields.offsets)
                 if head + off <= where < head + off + fields.lengths[i])
        a = head + fields.offsets[f]
        crc = payload.field_crc(buf[a : a + fields.lengths[f]], name, f // len(t.fields),
                                f % len(t.fields))
        k = len(fields.lengths)
        buf[head + 8 + 8 * k + 4 * f : head + 12 + 8 * k + 4 * f] = np.frombuffer(
            struct.pack("<I", crc), np.uint8)
    bad = tmp_path / "bad.safetensors"
    buf.tofile(bad)
    with pytest.raises(CorruptDataError) as got:
        entropykit.load_file(bad, "cuda")
    assert str(got.value).endswith(msg) and str(bad) in str(got.value)
    with pytest.raises(CorruptDataError):
        entropykit.load_file(bad)  # the CPU load fails too


@pytest.mark.parametrize("threads", [1, 4, 16])
def test_fills_submitted_ahead_in_small_groups_are_exact_and_stop(tmp_path, threads):
    """Payloads staged from the file in many small groups (each group's fill submitted
    before the one before is sent, the staging buffers rotated and grown): the CPU load
    bit for bit, with the loader's accounting of the fill; a file cut short after it was
    opened raises the fill's CorruptDataError on the device too; the fill threads are
    stopped after either."""
    import threading

    from entropykit import CorruptDataError, dtypes
    from entropykit.container import files as cfiles
    from entropykit.container import source
    from entropykit.container.cuda.load import load
    from entropykit.container.reader import Compressed

    orig, ek = tmp_path / "m.safetensors", tmp_path / "m.ek.safetensors"
    safetensors.torch.save_file(_staged_model(4), orig)
    cfiles.compress_file(orig, ek, segment_bytes=1 << 18)
    want = entropykit.load_file(ek)
    types = dtypes.torch_types()

    def fill_threads() -> list:
        return [t for t in threading.enumerate() if t.name.startswith("entropykit-fill")]

    for group_bytes in (1 << 17, 1 << 20):
        seconds: dict[str, float] = {}
        with source.FileBytes(ek) as f:
            got = load(Compressed(f), "cuda", types, threads, group_bytes=group_bytes,
                       seconds=seconds)
        assert list(got) == list(want) and not fill_threads()
        assert {"fill", "fill_wait", "plan_wait", "slot_wait"} <= set(seconds)
        for k in want:
            assert torch.equal(got[k].cpu().reshape(-1).view(torch.uint8),
                               want[k].reshape(-1).view(torch.uint8)), k
    whole = ek.read_bytes()
    try:
        with source.FileBytes(ek) as f:
            c = Compressed(f)
            with open(ek, "r+b") as w:
                w.truncate(f.size // 2)
            with pytest.raises(CorruptDataError, match="file changed or truncated"):
                load(c, "cuda", types, threads, group_bytes=1 << 17)
        assert not fill_threads()
    finally:
        ek.write_bytes(whole)


def test_a_load_started_under_a_side_stream_goes_on_on_another_thread(tmp_path):
    """``stream(now=True)`` called under ``torch.cuda.stream(s)`` (the first group
    launched there) and iterated on another thread (whose current stream is the default
    one): every group decoded and checked on ``s``, each file exact."""
    import threading

    from entropykit import dtypes
    from entropykit.container import files as cfiles
    from entropykit.container import source
    from entropykit.container.cuda.load import stream
    from entropykit.container.reader import Compressed

    paths = []
    for k, model in enumerate((_many_small(), _staged_model(2))):
        orig, ek = tmp_path / f"m{k}.safetensors", tmp_path / f"m{k}.ek.safetensors"
        safetensors.torch.save_file(model, orig)
        cfiles.compress_file(orig, ek, segment_bytes=1 << 16, target="gpu")
        paths.append(ek)
    wants = [entropykit.load_file(p) for p in paths]
    side = torch.cuda.Stream()
    got: list = []
    with source.FileBytes(paths[0]) as a, source.FileBytes(paths[1]) as b:
        with torch.cuda.stream(side):
            made = stream([(Compressed(a), None), (Compressed(b), None)], "cuda",
                          dtypes.torch_types(), 4, group_bytes=1 << 16, now=True)
        t = threading.Thread(target=lambda: got.extend(made))
        t.start()
        t.join()
    assert len(got) == 2
    for want, out in zip(wants, got, strict=True):
        assert list(out) == list(want)
        for k in out:
            assert torch.equal(out[k].cpu().reshape(-1).view(torch.uint8),
                               want[k].reshape(-1).view(torch.uint8)), k


@pytest.mark.parametrize("now", [False, True])
def test_one_stream_of_several_files_is_each_files_load(tmp_path, now):
    """Several files (and subsets) through one ``load.stream`` (one stager, one planning
    thread that plans on into the next file), in groups cut small: each is its CPU load
    bit for bit, the fill threads are the stager's few for every file; a damaged file
    later in the stream raises its error after the ones before it were yielded, and the
    threads stop; the same with ``now`` (the first group launched at the call)."""
    import threading

    from entropykit import CorruptDataError, dtypes
    from entropykit.container import files as cfiles
    from entropykit.container import source
    from entropykit.container.cuda.load import stream
    from entropykit.container.reader import Compressed

    paths = []
    for k, model in enumerate((_many_small(), _staged_model(2), _many_small())):
        orig, ek = tmp_path / f"m{k}.safetensors", tmp_path / f"m{k}.ek.safetensors"
        safetensors.torch.save_file(model, orig)
        cfiles.compress_file(orig, ek, segment_bytes=1 << 16, target="gpu" if k else "cpu")
        paths.append(ek)
    wants = [entropykit.load_file(p) for p in paths]
    types = dtypes.torch_types()

    def threads_named(prefix: str) -> list:
        return [t for t in threading.enumerate() if t.name.startswith(prefix)]

    with source.FileBytes(paths[0]) as a, source.FileBytes(paths[1]) as b, \
            source.FileBytes(paths[2]) as c:
        files = [Compressed(a), Compressed(b), Compressed(c)]
        names = [list(w) for w in wants]
        jobs = [(files[0], None), (files[1], names[1][::2]), (files[2], names[2][1::3]),
                (files[1], None)]
        seconds: dict[str, float] = {}
        got = []
        made = stream(jobs, "cuda", types, 4, group_bytes=1 << 16, seconds=seconds, now=now)
        for out in made:
            assert len(threads_named("entropykit-fill")) <= 4
            got.append(out)
        assert not threads_named("entropykit-fill") and not threads_named("entropykit-plan")
        assert {"plan_wait", "launch", "busy"} <= set(seconds)
        for (f, subset), out in zip(jobs, got, strict=True):
            want = wants[files.index(f)]
            assert list(out) == (list(want) if subset is None else subset)
            for k in out:
                assert torch.equal(out[k].cpu().reshape(-1).view(torch.uint8),
                                   want[k].reshape(-1).view(torch.uint8)), k
    bad = tmp_path / "bad.ek.safetensors"
    buf = bytearray(paths[1].read_bytes())
    buf[len(buf) // 2] ^= 0x55  # a byte in the data of the staged model
    bad.write_bytes(bytes(buf))
    with pytest.raises(CorruptDataError):
        entropykit.load_file(bad)  # the CPU load fails too
    with source.FileBytes(paths[0]) as a, source.FileBytes(bad) as b:
        made = stream([(Compressed(a), None), (Compressed(b), None)], "cuda", types, 4,
                      group_bytes=1 << 16, now=now)
        first = next(made)
        assert list(first) == list(wants[0])
        with pytest.raises(CorruptDataError):
            next(made)
    assert not threads_named("entropykit-fill") and not threads_named("entropykit-plan")
