"""``entropykit.dcp``: DCP saves from N gloo ranks load bit-exact into M != N ranks; failed
or killed saves leave nothing that loads (and a previous checkpoint whole); damage raises
``CorruptDataError``; consolidation gives a compressed Hugging Face checkpoint.

Ranks are ``torch.multiprocessing`` processes on the CPU (gloo, a FileStore in tmp_path).
One spawn of three processes does the multi-rank work: ranks 0 and 1 save (DTensors, and an
FSDP2 model with its optimizer; larger bf16 / fp32 / fp8 tensors with each codec policy),
all three load.
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.api import CheckpointException  # noqa: E402

import entropykit  # noqa: E402
from entropykit import CorruptDataError  # noqa: E402
from entropykit.dcp import (  # noqa: E402
    INDEX,
    METADATA,
    CompressedStorageReader,
    CompressedStorageWriter,
    consolidate,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# name -> (dtype, shape, shard dim when saved, shard dim when loaded); None: a plain tensor
SPEC = {
    "model.embed": (torch.bfloat16, (10, 6), 0, 1),
    "model.proj": (torch.float32, (6, 7), 1, 0),
    "model.fp8": (torch.float8_e4m3fn, (9, 4), 0, 0),
    "model.norm": (torch.bfloat16, (6,), None, None),
    "optim.exp_avg": (torch.float32, (10, 6), 0, 0),
    "optim.step": (torch.float32, (), None, None),
}


# Tensors large enough that the writer's two codec policies (``fast``) code them
# differently: name -> (dtype, shape), saved Shard(0) from two ranks.
BIG = {
    "w.bf16": (torch.bfloat16, (512, 512)),
    "w.fp32": (torch.float32, (128, 512)),
    "w.fp8": (torch.float8_e4m3fn, (256, 512)),
}


# The specials' segments (the writer's are 4 MiB): 64 Ki fp32 values, the most a field
# is coded without the sample screen, so the rows around it cross a segment's edge with
# each path of the policy.
_SEGMENT_BYTES = 1 << 18
_SEG = _SEGMENT_BYTES // 4


def _specials() -> dict[str, torch.Tensor]:
    """Tensors of two rows (saved Shard(0): a row a rank) of every fp32 bit pattern the
    coders must keep (NaN payloads, +-0, +-inf, subnormals, extremes) among trained-like
    values; rows of one segment and one value less, exactly one, one more; small rows
    (judged whole, zstd tried: periodic, so that it wins), mid-size rows (entropy coded,
    no zstd trial), empty rows; positive rows (a sign-free mantissa byte, which the
    writer codes); wide exponents; and bf16 rows around its segment size."""
    g = torch.Generator().manual_seed(11)
    bits = torch.tensor([0x7FC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0xFFC00001,
                         0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001,
                         0x807FFFFF, 0x00400000, 0x7F7FFFFF, 0xFF7FFFFF, 0x00800000],
                        dtype=torch.int64).to(torch.int32)  # wraps to the bit patterns
    special = bits.view(torch.float32)

    def rows(n: int, dtype: torch.dtype = torch.float32, kind: str = "weights"
             ) -> torch.Tensor:
        x = torch.randn(2, n, generator=g) * 0.02
        if kind == "squares":
            x = x * x
        elif kind == "periodic":
            x = x[:, :16].repeat(1, -(-n // 16))[:, :n]
        elif kind == "wide":
            x = torch.exp(torch.randn(2, n, generator=g) * 30)
        x = x.to(dtype)
        if dtype == torch.float32 and n:
            at = torch.randint(0, n, (2, min(n, 64)), generator=g)
            x[0, at[0]] = special[torch.arange(at.shape[1]) % special.numel()]
            x[1, at[1]] = special[torch.arange(at.shape[1]) % special.numel()]
        return x

    return {"f32.below": rows(_SEG - 1), "f32.segment": rows(_SEG),
            "f32.above": rows(_SEG + 1, kind="squares"), "f32.small": rows(1000, kind="periodic"),
            "f32.mid": rows(20_000, kind="squares"), "f32.empty": rows(0),
            "f32.wide": rows(3 * _SEG, kind="wide"), "f32.nan": rows(5000) * float("nan"),
            "bf16.above": rows(2 * _SEG + 1, torch.bfloat16),
            "bf16.below": rows(2 * _SEG - 1, torch.bfloat16)}


def _big() -> dict[str, torch.Tensor]:
    """Weights whose rows differ in scale, as trained weights' do (what the default
    policy's row classes code smaller than the fast policy)."""
    g = torch.Generator().manual_seed(7)
    return {k: (torch.randn(shape, generator=g) * 0.02
                * torch.exp(torch.randn(shape[0], 1, generator=g))).to(dt)
            for k, (dt, shape) in BIG.items()}


def _full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(shape, generator=g) * 3).to(dt)
            for k, (dt, shape, _, _) in SPEC.items()}


def _extras(seed: int) -> dict:
    return {"step": 1000 + seed, "rng": torch.Generator().manual_seed(seed).get_state(),
            "sched": {"lr": 1e-3 * seed, "betas": (0.9, 0.95), "name": f"cosine-{seed}"}}


def _nest(flat: dict) -> dict:
    out: dict = {}
    for k, v in flat.items():
        top, rest = k.split(".", 1)
        out.setdefault(top, {})[rest] = v
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact: same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _local(full: torch.Tensor, dim: int | None, rank: int, n: int) -> torch.Tensor:
    """A rank's part of ``full`` as DTensor's Shard(dim) places it (torch.chunk)."""
    if dim is None:
        return full
    parts = torch.chunk(full, n, dim)
    if rank < len(parts):
        return parts[rank].contiguous()
    shape = list(full.shape)
    shape[dim] = 0
    return full.new_empty(shape)


def _dtensors(flat: dict, mesh, rank: int, n: int, which: int) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    out = {}
    for k, t in flat.items():
        dim = SPEC[k][which]
        if dim is None:
            out[k] = t.clone()
        else:  # from_local: no collective, so every dtype works on gloo
            out[k] = DTensor.from_local(_local(t, dim, rank, n), mesh, [Shard(dim)],
                                        run_check=False, shape=t.shape, stride=t.stride())
    return out


def _blank_extras() -> dict:
    return {"step": 0, "rng": torch.zeros_like(torch.Generator().get_state()),
            "sched": {"lr": 0.0, "betas": (0.0, 0.0), "name": ""}}


def _check_extras(got: dict, seed: int) -> None:
    want = _extras(seed)
    assert got["step"] == want["step"]
    assert got["sched"] == want["sched"]
    assert _same(got["rng"], want["rng"])


class _Failing(CompressedStorageWriter):
    """Writes its shard, then fails on rank ``bad``: raises, or dies (``kill``)."""

    def __init__(self, path, bad: int, kill: bool = False) -> None:
        super().__init__(path, threads=1)
        self.bad, self.kill = bad, kill

    def write_data(self, plan, planner):
        fut = super().write_data(plan, planner)
        if dist.get_rank() == self.bad:
            if self.kill:
                os._exit(3)
            raise RuntimeError("injected failure after writing the shard")
        return fut


def _init(tmp: Path, rank: int, world: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))


def _worker(rank: int, world: int, tmp: str) -> None:
    """Ranks 0 and 1 save checkpoint ``a`` (seed 1); all three load it (resharded) and
    check every value; then a three-rank re-save into ``a`` fails on rank 2 and a fresh
    save into ``fresh`` fails on rank 1: ``a`` still loads as seed 1."""
    from torch.distributed.device_mesh import DeviceMesh

    warnings.simplefilter("ignore")
    tmp = Path(tmp)
    _init(tmp, rank, world)
    sub = dist.new_group([0, 1])
    full = _full(1)
    if rank < 2:
        mesh2 = DeviceMesh.from_group(sub, "cpu")
        sd = _nest(_dtensors(full, mesh2, rank, 2, 2)) | _extras(1)
        dcp.save(sd, storage_writer=CompressedStorageWriter(tmp / "a", threads=1),
                 process_group=sub)
        _save_fsdp(tmp, rank, mesh2, sub)
        _save_big(tmp, rank, mesh2, sub)
        _save_specials(tmp, rank, mesh2, sub)
    dist.barrier()
    mesh3 = DeviceMesh("cpu", list(range(world)))

    def load_and_check(seed: int) -> None:
        target = _dtensors({k: torch.zeros_like(v) for k, v in full.items()}, mesh3, rank,
                           world, 3)
        sd = _nest(target) | _blank_extras()
        dcp.load(sd, storage_reader=CompressedStorageReader(tmp / "a", threads=1))
        want = _full(seed)
        for k, v in target.items():
            got = v.to_local() if hasattr(v, "to_local") else v
            assert _same(got, _local(want[k], SPEC[k][3], rank, world)), k
        _check_extras(sd, seed)

    load_and_check(1)
    _load_big(tmp, rank, world, mesh3)
    sd = _nest(_dtensors(_full(2), mesh3, rank, world, 3)) | _extras(2)
    with pytest.raises(CheckpointException):
        dcp.save(sd, storage_writer=_Failing(tmp / "a", bad=2))
    load_and_check(1)
    with pytest.raises(CheckpointException):
        dcp.save(sd, storage_writer=_Failing(tmp / "fresh", bad=1))
    dist.barrier()
    dist.destroy_process_group()


def _fsdp_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _save_fsdp(tmp: Path, rank: int, mesh, group) -> None:
    """An FSDP2 (``fully_shard``) model and AdamW state after one step, saved from two
    ranks; rank 0 also writes the full tensors (gathered) for the test to compare."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _fsdp_model()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(1))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, storage_writer=CompressedStorageWriter(tmp / "fsdp", threads=1),
             process_group=group)
    flat = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    flat |= {f"optim.{p}.{k}": v.full_tensor() if hasattr(v, "full_tensor") else v
             for p, st in osd["state"].items() for k, v in st.items()}
    if rank == 0:
        torch.save(flat, tmp / "fsdp-full.pt")


def _save_big(tmp: Path, rank: int, mesh, group) -> None:
    """``_big()`` saved from two ranks (Shard(0)) with each ``fast`` setting."""
    from torch.distributed.tensor import DTensor, Shard

    sd = {k: DTensor.from_local(_local(t, 0, rank, 2), mesh, [Shard(0)], run_check=False,
                                shape=t.shape, stride=t.stride())
          for k, t in _big().items()}
    for fast in (True, False):
        dcp.save(sd, storage_writer=CompressedStorageWriter(tmp / f"big-{fast}", threads=1,
                                                            fast=fast),
                 process_group=group)


def _save_specials(tmp: Path, rank: int, mesh, group) -> None:
    """``_specials()`` saved from two ranks (Shard(0): a row each) by the default writer,
    in segments of ``_SEGMENT_BYTES``."""
    from torch.distributed.tensor import DTensor, Shard

    sd = {k: DTensor.from_local(_local(t, 0, rank, 2), mesh, [Shard(0)], run_check=False,
                                shape=t.shape, stride=t.stride())
          for k, t in _specials().items()}
    import entropykit.dcp as ekdcp

    ekdcp.SEGMENT_BYTES, before = _SEGMENT_BYTES, ekdcp.SEGMENT_BYTES
    try:
        dcp.save(sd, storage_writer=CompressedStorageWriter(tmp / "specials", threads=2),
                 process_group=group)
    finally:
        ekdcp.SEGMENT_BYTES = before


def _load_big(tmp: Path, rank: int, world: int, mesh) -> None:
    """Both ``_save_big`` checkpoints (two ranks, Shard(0)) into ``world`` ranks as
    Shard(1), bit-exact."""
    from torch.distributed.tensor import DTensor, Shard

    want = _big()
    for fast in (True, False):
        got = {k: DTensor.from_local(torch.zeros_like(_local(t, 1, rank, world)), mesh,
                                     [Shard(1)], run_check=False, shape=t.shape,
                                     stride=t.stride())
               for k, t in want.items()}
        dcp.load(got, storage_reader=CompressedStorageReader(tmp / f"big-{fast}", threads=1))
        for k, t in want.items():
            assert _same(got[k].to_local(), _local(t, 1, rank, world)), (fast, k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dcp")
    mp.spawn(_worker, args=(3, str(tmp)), nprocs=3, join=True)
    return tmp


def test_two_ranks_save_three_ranks_load_bit_exact(saved: Path) -> None:
    # The spawned ranks checked every local shard bit for bit (DTensor Shard(0)/Shard(1),
    # resharded to other dims and an uneven split; bf16, fp32, fp8; plain tensors and
    # non-tensor items); here: what the save left on disk.
    doc = json.loads((saved / "a" / METADATA).read_text())
    shards = sorted({c["file"] for t in doc["tensors"].values() for c in t["chunks"]})
    assert len(shards) == 2 and all(n.startswith("shard-") for n in shards)
    for n in shards:  # each shard is an entropykit file, its chunks under their names
        with entropykit.safe_open(saved / "a" / n) as f:
            assert "model.embed" in f.keys()


def test_two_ranks_load_into_one_process_bit_exact(saved: Path) -> None:
    full = _full(1)
    flat = {k: torch.zeros_like(v) for k, v in full.items()}
    sd = _nest(flat) | _blank_extras()
    dcp.load(sd, storage_reader=CompressedStorageReader(saved / "a"))
    for k, v in flat.items():
        assert _same(v, full[k]), k
    _check_extras(sd, 1)


def test_failed_resave_leaves_previous_checkpoint_and_failed_save_nothing(saved: Path
                                                                          ) -> None:
    # The failed three-rank re-save wrote shards of its own: they are there, unlisted.
    listed = json.loads((saved / "a" / METADATA).read_text())["save_id"]
    assert len([n for n in os.listdir(saved / "a") if n.startswith("shard-")]) > 2
    assert listed
    # The failed fresh save: shards, no metadata, nothing loads.
    fresh = saved / "fresh"
    assert any(n.startswith("shard-") for n in os.listdir(fresh))
    assert not (fresh / METADATA).exists()
    with pytest.raises(FileNotFoundError):
        CompressedStorageReader(fresh).read_metadata()
    with pytest.raises(CheckpointException):
        dcp.load(_nest({k: torch.zeros_like(v) for k, v in _full(1).items()}),
                 storage_reader=CompressedStorageReader(fresh))


def test_fsdp2_state_dict_loads_into_one_process_bit_exact(saved: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.zeros(1, 8)).sum().backward()
    opt.step()  # creates the state tensors the load fills in
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    msd, osd = get_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd},
             storage_reader=CompressedStorageReader(saved / "fsdp"))
    want = torch.load(saved / "fsdp-full.pt")
    got = {f"model.{k}": v for k, v in msd.items()}
    got |= {f"optim.{p}.{k}": v for p, st in osd["state"].items() for k, v in st.items()}
    assert sorted(got) == sorted(want) and all(_same(got[k], want[k]) for k in want)
    assert osd["param_groups"][0]["lr"] == 0.1


def _kill_worker(rank: int, world: int, tmp: str) -> None:
    warnings.simplefilter("ignore")
    _init(Path(tmp), rank, world)
    sd = _nest(_full(5)) | _extras(5)
    dcp.save(sd, storage_writer=_Failing(Path(tmp) / "ckpt", bad=1, kill=True))


def test_killed_rank_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    dcp.save(_nest(_full(4)) | _extras(4), storage_writer=CompressedStorageWriter(ckpt))
    with pytest.raises(mp.ProcessExitedException):
        mp.spawn(_kill_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    flat = {k: torch.zeros_like(v) for k, v in _full(4).items()}
    sd = _nest(flat) | _blank_extras()
    dcp.load(sd, storage_reader=CompressedStorageReader(ckpt))
    assert all(_same(flat[k], v) for k, v in _full(4).items())
    _check_extras(sd, 4)


def _save_plain(path: Path, seed: int, **options) -> None:
    dcp.save(_nest(_full(seed)) | _extras(seed),
             storage_writer=CompressedStorageWriter(path, **options))


def test_resave_replaces_and_removes_old_shards(tmp_path: Path) -> None:
    _save_plain(tmp_path, 1)
    old = {n for n in os.listdir(tmp_path) if n.startswith("shard-")}
    _save_plain(tmp_path, 2)
    new = {n for n in os.listdir(tmp_path) if n.startswith("shard-")}
    assert len(new) == 1 and not new & old
    flat = {k: torch.zeros_like(v) for k, v in _full(1).items()}
    sd = _nest(flat) | _blank_extras()
    dcp.load(sd, storage_reader=CompressedStorageReader(tmp_path))
    assert all(_same(flat[k], v) for k, v in _full(2).items())
    _check_extras(sd, 2)
    with pytest.raises(CheckpointException, match="overwrite=False"):
        _save_plain(tmp_path, 3, overwrite=False)


def test_shards_are_smaller_than_the_tensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=g) * 0.02).bfloat16()
    dcp.save({"w": w}, storage_writer=CompressedStorageWriter(tmp_path))
    (shard,) = [n for n in os.listdir(tmp_path) if n.startswith("shard-")]
    assert (tmp_path / shard).stat().st_size < 0.8 * w.numel() * 2


def _damage(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(bytes(raw))


def _load_error(path: Path, seed: int = 1) -> BaseException:
    flat = {k: torch.zeros_like(v) for k, v in _full(seed).items()}
    with pytest.raises(CheckpointException) as e:
        dcp.load(_nest(flat) | _blank_extras(), storage_reader=CompressedStorageReader(path))
    (exc, _), = e.value.failures.values()
    return exc


def test_damaged_shard_raises_corrupt_data_error(tmp_path: Path) -> None:
    _save_plain(tmp_path, 1)
    (shard,) = [p for p in tmp_path.iterdir() if p.name.startswith("shard-")]
    _damage(shard, shard.stat().st_size - 3)  # in the last tensor's payload
    exc = _load_error(tmp_path)
    assert isinstance(exc, CorruptDataError) and shard.name in str(exc)


@pytest.mark.parametrize("edit, what", [
    (lambda d: d["tensors"]["model.proj"]["chunks"][0].update(file="../x.safetensors"),
     "not a shard file"),
    (lambda d: d["tensors"]["model.proj"]["chunks"][0].update(sizes=[7, 7]), "outside"),
    (lambda d: d["tensors"]["model.proj"].update(size=[1 << 62]), "integers"),
    (lambda d: d["tensors"]["model.proj"]["chunks"][0].update(offsets=[True, 0]),
     "chunk offsets is not a list"),
    (lambda d: d["tensors"]["model.proj"]["chunks"][0].update(sizes=[4.0, 4]),
     "chunk sizes is not a list"),
    (lambda d: d["tensors"]["model.proj"]["chunks"].__setitem__(0, [0]), "not an object"),
    (lambda d: d["tensors"]["model.proj"]["chunks"][0].pop("key"), "no file and key"),
    (lambda d: d["tensors"]["model.proj"].update(dtype="F128"), "dtype"),
    (lambda d: d.update(version=99), "version"),
    (lambda d: d["tensors"]["model.proj"]["chunks"].clear(), "exactly once"),
    (lambda d: d["tensors"]["model.proj"]["chunks"].append(
        d["tensors"]["model.proj"]["chunks"][0]), "exactly once"),
    (lambda d: d["bytes"].update({"model.proj": d["bytes"]["step"]}), "both"),
])
def test_damaged_metadata_raises_corrupt_data_error(tmp_path: Path, edit, what) -> None:
    _save_plain(tmp_path, 1)
    path = tmp_path / METADATA
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(CorruptDataError, match=what):
        CompressedStorageReader(tmp_path).read_metadata()
    # DCP reports a failed metadata read in an error of its own, with ours in its text.
    assert what in str(_load_error(tmp_path))


@pytest.mark.parametrize("size, chunks, rows, ok", [
    ((10, 4), [((6, 0), (4, 4)), ((0, 0), (3, 4)), ((3, 0), (3, 4))], True, True),
    ((10, 4), [((0, 0), (3, 4)), ((0, 0), (0, 4)), ((3, 0), (7, 4))], True, True),
    ((10, 4), [((0, 0), (3, 4)), ((4, 0), (6, 4))], False, False),  # a gap
    ((10, 4), [((0, 0), (4, 4)), ((3, 0), (7, 4))], False, False),  # an overlap
    ((10, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4)), ((3, 0), (4, 4))], False, False),
    ((10, 4), [((0, 0), (10, 2)), ((0, 2), (10, 2))], False, True),  # columns
    ((10, 4), [((0, 0), (10, 2)), ((0, 1), (10, 3))], False, False),
    ((), [((), ())], False, True),
])
def test_chunk_tiling_by_rows_or_by_the_grid(size, chunks, rows, ok) -> None:
    # Chunks of whole rows (Shard(0), FSDP) are told in one sort; any other layout, and
    # any row layout that is not exact, is left to the grid count, which decides.
    from entropykit import dcp as ekdcp

    t = ekdcp._Tensor("F32", size, chunks=[
        ekdcp._Chunk(o, n, ekdcp._Stored("f", "k")) for o, n in chunks])
    assert ekdcp._rows_tile(t) is rows
    if ok:
        ekdcp._check_tiling("t", t)
    else:
        with pytest.raises(CorruptDataError, match="exactly once"):
            ekdcp._check_tiling("t", t)


def test_truncated_metadata_and_shard_with_wrong_shape(tmp_path: Path) -> None:
    _save_plain(tmp_path, 1)
    path = tmp_path / METADATA
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptDataError, match="not JSON"):
        CompressedStorageReader(tmp_path).read_metadata()
    # Consistent metadata that disagrees with the shard: the shard's header decides.
    doc = json.loads(good)
    t = doc["tensors"]["model.proj"]
    t["size"] = t["chunks"][0]["sizes"] = [7, 6]
    path.write_text(json.dumps(doc))
    flat = {k: torch.zeros_like(v) for k, v in _full(1).items()}
    flat["model.proj"] = torch.zeros(7, 6)
    with pytest.raises(CheckpointException) as e:
        dcp.load(_nest(flat) | _blank_extras(), storage_reader=CompressedStorageReader(tmp_path))
    (exc, _), = e.value.failures.values()
    assert isinstance(exc, CorruptDataError) and "in the metadata" in str(exc)


def test_consolidate_gives_a_compressed_hugging_face_checkpoint(tmp_path: Path) -> None:
    ckpt, hf = tmp_path / "ckpt", tmp_path / "hf"
    _save_plain(ckpt, 1)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}\n')
    consolidate(ckpt, hf, prefix="model.", config=tmp_path / "config.json",
                shard_bytes=200)
    index = json.loads((hf / INDEX).read_text())
    full = _full(1)
    want = {k[len("model."):]: v for k, v in full.items() if k.startswith("model.")}
    assert sorted(index["weight_map"]) == sorted(want)
    assert len(set(index["weight_map"].values())) > 1
    got = entropykit.load_file(hf)
    assert sorted(got) == sorted(want) and all(_same(got[k], v) for k, v in want.items())
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "entropykit"
    # The writer's own consolidation: the HF files next to the DCP shards.
    _save_plain(tmp_path / "both", 2, consolidate=True)
    got = entropykit.load_file(tmp_path / "both")
    assert all(_same(got[k], v) for k, v in _full(2).items())


def test_consolidated_checkpoint_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from entropykit.warmup import tiny_llama

    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path / "plain")  # for its config.json
    sd = {"model": model.state_dict(), "step": 3}
    dcp.save(sd, storage_writer=CompressedStorageWriter(tmp_path / "ckpt"))
    consolidate(tmp_path / "ckpt", tmp_path / "hf", prefix="model.",
                config=tmp_path / "plain" / "config.json")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="auto")
    want = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want) and all(_same(got[k], want[k]) for k in want)


def _shards(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.startswith("shard-"))


@pytest.mark.parametrize("fast", [True, False])
def test_either_policy_two_ranks_save_one_process_loads_bit_exact(saved: Path, fast: bool
                                                                  ) -> None:
    path = saved / f"big-{fast}"
    want = _big()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=CompressedStorageReader(path, threads=2))
    assert all(_same(got[k], v) for k, v in want.items())
    # Each shard is a compressed file of its rank's chunks, as entropykit reads any.
    for rank, shard in enumerate(_shards(path)):
        chunks = entropykit.load_file(shard)
        assert sorted(chunks) == sorted(want)
        assert all(_same(chunks[k], _local(v, 0, rank, 2)) for k, v in want.items())
    hf = consolidate(path, saved / f"big-{fast}-hf")
    merged = entropykit.load_file(hf)
    assert all(_same(merged[k], v) for k, v in want.items())


def test_every_fp32_bit_pattern_and_segment_edge_loads_back_exactly(saved: Path) -> None:
    want = _specials()
    got = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(got, storage_reader=CompressedStorageReader(saved / "specials", threads=2))
    assert all(_same(got[k], v) for k, v in want.items())
    from entropykit.container.reader import Compressed

    records = [Compressed(p.read_bytes()).record for p in _shards(saved / "specials")]
    assert {r.segment_bytes for r in records} == {_SEGMENT_BYTES}
    used = {c for r in records for t in r.tensors.values() for seg in t.codecs for c in seg}
    # Every path of the writer's policy: tANS, rANS (a wide alphabet), zstd (a small
    # periodic field), raw.
    assert used == {"tans", "rans", "zstd", "raw"}


def test_fast_policy_trades_a_little_size(saved: Path) -> None:
    raw = sum(t.numel() * t.element_size() for t in _big().values())
    size = {fast: sum(p.stat().st_size for p in _shards(saved / f"big-{fast}"))
            for fast in (True, False)}
    assert size[False] < size[True] < 0.9 * raw


def _shard_bytes(path: Path, state: dict, **options) -> list[bytes]:
    dcp.save(state, storage_writer=CompressedStorageWriter(path, **options))
    return [p.read_bytes() for p in _shards(path)]


def test_default_is_fast_and_bytes_do_not_depend_on_threads(tmp_path: Path) -> None:
    state = _big()
    default = _shard_bytes(tmp_path / "default", state)
    assert _shard_bytes(tmp_path / "fast", state, fast=True, threads=1) == default
    small = _shard_bytes(tmp_path / "small", state, fast=False, threads=2)
    assert _shard_bytes(tmp_path / "small1", state, fast=False, threads=1) == small
    assert small != default
    # Segments of 4 MiB (the container's default is 16): a rank's large chunk is coded on
    # several threads at once.
    from entropykit.container.reader import Compressed

    assert {Compressed(b).record.segment_bytes for b in default + small} == {4 << 20}


def test_threads_default_to_this_rank_share_of_the_cores(monkeypatch) -> None:
    from entropykit.coding.parallel import ENV, default_threads

    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    share = max(1, default_threads() // 2)
    assert CompressedStorageWriter("unused").threads == share
    assert CompressedStorageReader("unused").threads == share
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(1 << 20))
    assert CompressedStorageWriter("unused").threads == 1
    monkeypatch.setenv(ENV, "3")  # set by the user: taken as is
    assert CompressedStorageWriter("unused").threads == 3
    assert CompressedStorageWriter("unused", threads=5).threads == 5


def _no_idle_io_thread_at_exit() -> None:
    """Registered with ``atexit`` in a spawned rank: those hooks run after the interpreter
    has joined its threads and before it tears down. A thread of the output pool still
    alive here would meet the teardown: the rank exits with 7 instead."""
    import threading

    if any(t.name == "entropykit-io" and t.is_alive() for t in threading.enumerate()):
        os._exit(7)


def _exit_worker(rank: int, world: int, tmp: str) -> None:
    """Two saves and a load through the writer's thread pool, then a normal exit."""
    import atexit

    from entropykit.container import _atomic

    warnings.simplefilter("ignore")
    tmp = Path(tmp)
    _init(tmp, rank, world)
    sd = _nest(_full(rank)) | _extras(rank)
    for i in range(2):
        dcp.save(sd, storage_writer=CompressedStorageWriter(tmp / f"c{i}", threads=2))
    dcp.load(_nest({k: torch.zeros_like(v) for k, v in _full(0).items()}) | _blank_extras(),
             storage_reader=CompressedStorageReader(tmp / "c1", threads=2))
    assert _atomic._POOL._idle  # the pool holds idle threads when the rank ends
    atexit.register(_no_idle_io_thread_at_exit)
    dist.barrier()
    dist.destroy_process_group()


def test_spawned_ranks_exit_cleanly_with_the_output_pool(tmp_path: Path) -> None:
    """Ranks that wrote their shards through the output pool end with status 0, spawn
    after spawn: the pool's idle threads are stopped and joined before the interpreter's
    teardown (a rank aborting at exit, or one with a pool thread left, fails the spawn)."""
    for round_ in range(3):
        tmp = tmp_path / str(round_)
        tmp.mkdir()
        mp.spawn(_exit_worker, args=(2, str(tmp)), nprocs=2, join=True)
        assert (tmp / "c1" / METADATA).is_file()
