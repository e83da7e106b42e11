"""The LMCache plugin through the released LMCache: real stores and loads of KV chunks.

Each round trip goes the way LMCache's multi-process mode goes: the adapter spec parsed
by LMCache's own ``--l2-adapter`` parser (a ``"plugin"`` adapter naming
``entropykit.lmcache.plugin``, with ``"serde": {"type": "entropykit"}``), the adapter built by
its factory, wrapped in its ``SerdeL2AdapterWrapper`` with its ``L1Manager`` holding the
buffers, storing into its file-system adapter. Run with ``.ci/lmcache`` (deselected by
default: it needs ``pip install lmcache``).
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import (
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import (
    add_l2_adapters_args,
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
from lmcache.v1.distributed.serde import create_serde_processor
from lmcache.v1.distributed.storage_manager import StorageManager

from entropykit import CorruptDataError
from entropykit import lmcache as ek
from entropykit.lmcache import plugin

pytestmark = pytest.mark.lmcache

TOKENS = 256  # LMCache's chunk
LAYERS, HIDDEN = 2, 64  # [2 (k, v), layers, tokens, kv heads x head dim]: its non-MLA shape
WAIT_S = 300  # the first store compiles the coder's kernels


def _chunk(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A KV-like chunk: channels of different scales, as keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.linspace(0.05, 4.0, shape[-1])
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=bytes([i]) * 16, model_name="org/model", kv_rank=0)


def _l2_config(root: Path, *, sized: bool = True):
    """The adapters' config as LMCache parses its ``--l2-adapter`` argument (README)."""
    fs = {"type": "fs", "base_path": str(root)}
    spec = {"type": "plugin", "module_path": "entropykit.lmcache.plugin",
            "class_name": "SizedL2Adapter", "adapter_params": {"inner": fs}} if sized else fs
    spec["serde"] = {"type": "entropykit", "threads": 2, "max_workers": 2}
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
        ["--l2-adapter", json.dumps(spec)])
    return parse_args_to_l2_adapters_config(args)


def _l1_config() -> L1ManagerConfig:
    return L1ManagerConfig(memory_config=L1MemoryManagerConfig(
        size_in_bytes=64 << 20, use_lazy=False, shm_name=""))


class _Lmcache:
    """LMCache's L2 path as its storage manager builds it, over a directory."""

    def __init__(self, root: Path, *, sized: bool = True) -> None:
        cfg = _l2_config(root, sized=sized).adapters[0]
        self.root = root
        self.l1 = L1Manager(_l1_config())
        self.adapter = SerdeL2AdapterWrapper(create_l2_adapter(cfg),
                                             create_serde_processor(cfg.serde_config), self.l1)

    def store(self, key: ObjectKey, groups: list[torch.Tensor]) -> bool:
        layout = MemoryLayoutDesc(shapes=[g.shape for g in groups],
                                  dtypes=[g.dtype for g in groups])
        _, obj = self.l1.reserve_write([key], [False], layout, tag="test")[key]
        for i, g in enumerate(groups):
            obj.get_tensor(i).copy_(g)
        self.l1.finish_write([key], tag="test")
        _, obj = self.l1.reserve_read([key])[key]
        task = self.adapter.submit_store_task([key], [obj])
        done = _wait(lambda: self.adapter.pop_completed_store_tasks().get(task))
        self.l1.finish_read([key])
        return done.is_successful()

    def load(self, keys: list[ObjectKey], like: list[torch.Tensor]
             ) -> tuple[list[bool], list[list[torch.Tensor]]]:
        """Which of ``keys`` loaded, and the buffers they loaded into (copies)."""
        layout = MemoryLayoutDesc(shapes=[g.shape for g in like],
                                  dtypes=[g.dtype for g in like])
        dst = [ObjectKey(chunk_hash=b"\xff" * 15 + bytes([i]), model_name="dst", kv_rank=0)
               for i in range(len(keys))]
        got = self.l1.reserve_write(dst, [True] * len(dst), layout, tag="test")
        objs = [got[k][1] for k in dst]
        for o in objs:  # so that a load that writes nothing shows
            for i in range(len(like)):
                o.get_tensor(i).view(torch.uint8).zero_()
        task = self.adapter.submit_load_task(keys, objs)
        bitmap = _wait(lambda: self.adapter.query_load_result(task))
        out = [[o.get_tensor(i).clone() for i in range(len(like))] for o in objs]
        self.l1.finish_write_and_delete(dst, tag="test")
        return [bitmap.test(i) for i in range(len(keys))], out

    def files(self) -> list[Path]:
        return sorted(self.root.glob("*.data"))

    def close(self) -> None:
        self.adapter.close()


def _wait(poll):
    end = time.monotonic() + WAIT_S
    while time.monotonic() < end:
        got = poll()
        if got is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("LMCache did not finish the task")


@pytest.fixture
def lmc(tmp_path):
    c = _Lmcache(tmp_path)
    yield c
    c.close()


@pytest.mark.parametrize("damaged", [False, True])
def test_storage_manager_stores_evicts_and_prefetches_exactly(tmp_path, damaged):
    # LMCache's own store and prefetch controllers: chunks written to L1 go to L2 by
    # themselves; once L1 forgets them, a prefetch loads them back from the files
    sm = StorageManager(StorageManagerConfig(
        l1_manager_config=_l1_config(), eviction_config=EvictionConfig("LRU"),
        l2_adapter_config=_l2_config(tmp_path)))
    try:
        shape = (2, LAYERS, TOKENS, HIDDEN)
        layout = MemoryLayoutDesc([torch.Size(shape)], [torch.bfloat16])
        keys = [_key(i) for i in range(3)]
        chunks = [_chunk(torch.bfloat16, shape, seed=10 + i) for i in range(3)]
        objs = sm.reserve_write(keys, layout)
        for k, c in zip(keys, chunks, strict=True):
            objs[k].tensor.copy_(c)
        sm.finish_write(keys)
        end = time.monotonic() + WAIT_S
        while len(list(tmp_path.glob("*.data"))) < 3 and time.monotonic() < end:
            time.sleep(0.01)
        files = {p.read_bytes(): p for p in tmp_path.glob("*.data")}
        assert sorted(files) == sorted(ek.encode_chunk([c], threads=2) for c in chunks)
        sm.delete_l1_keys(keys)
        if damaged:  # the last chunk's file: that chunk alone is not loaded
            path = files[ek.encode_chunk([chunks[2]], threads=2)]
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0x04
            path.write_bytes(bytes(data))
        handle = sm.submit_prefetch_task(PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]))
        assert sm.wait_prefetch_status(handle, WAIT_S)
        result = sm.query_prefetch_status(handle)
        hits = result.hit_cells[0].get_indices_list()
        assert hits == ([0, 1] if damaged else [0, 1, 2])
        assert result.l2_hit_cells[0].get_indices_list() == hits
        with sm.read_prefetched_results(keys[: len(hits)], result.l1_owners) as got:
            assert all(_same(o.tensor, c) for o, c in zip(got, chunks, strict=False))
    finally:
        sm.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                   torch.float32])
def test_round_trip_is_exact_and_the_file_holds_the_true_length(lmc, dtype):
    chunk = _chunk(dtype, (2, LAYERS, TOKENS, HIDDEN), seed=1)
    assert lmc.store(_key(1), [chunk])
    (path,) = lmc.files()
    blob = ek.encode_chunk([chunk], threads=2)
    raw = chunk.numel() * chunk.element_size()
    # on disk: exactly the blob (deterministic), coded, smaller than the values and than
    # the buffer LMCache sized from the estimate
    assert path.read_bytes() == blob
    assert blob[5] == ek.CODED and len(blob) < raw
    assert plugin.EntropySerializer().estimate_serialized_size(
        MemoryLayoutDesc([chunk.shape], [dtype])) == raw + 24
    loaded, (out,) = lmc.load([_key(1)], [chunk])
    assert loaded == [True] and _same(out[0], chunk)


def test_the_spec_alone_loads_the_plugin(tmp_path):
    # a fresh LMCache process that never imports entropykit itself: building the storage
    # manager from the README's spec imports the plugin, which registers the serde first
    spec = {"type": "plugin", "module_path": "entropykit.lmcache.plugin",
            "class_name": "SizedL2Adapter",
            "adapter_params": {"inner": {"type": "fs", "base_path": str(tmp_path)}},
            "serde": {"type": "entropykit"}}
    code = f"""
import argparse, sys
from lmcache.v1.distributed.config import (EvictionConfig, L1ManagerConfig,
    L1MemoryManagerConfig, StorageManagerConfig)
from lmcache.v1.distributed.l2_adapters.config import (add_l2_adapters_args,
    parse_args_to_l2_adapters_config)
from lmcache.v1.distributed.storage_manager import StorageManager
assert not any(m.startswith("entropykit") for m in sys.modules)
args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
    ["--l2-adapter", {json.dumps(spec)!r}])
l1 = L1ManagerConfig(memory_config=L1MemoryManagerConfig(
    size_in_bytes=1 << 24, use_lazy=False, shm_name=""))
sm = StorageManager(StorageManagerConfig(l1_manager_config=l1,
    eviction_config=EvictionConfig("LRU"),
    l2_adapter_config=parse_args_to_l2_adapters_config(args)))
(desc, adapter), = sm.l2_adapters()
print(type(adapter).__name__, type(adapter.inner_adapter).__name__,
      type(adapter.inner_adapter.inner_adapter).__name__)
sm.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=WAIT_S)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SerdeL2AdapterWrapper", "SizedL2Adapter", "FSL2Adapter"]


def test_without_the_serde_the_adapter_is_its_inner_one(tmp_path):
    # a spec that leaves out "serde": KV buffers are stored and loaded as they are
    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(["--l2-adapter", json.dumps(
        {"type": "plugin", "module_path": "entropykit.lmcache.plugin",
         "class_name": "SizedL2Adapter",
         "adapter_params": {"inner": {"type": "fs", "base_path": str(tmp_path)}}})])
    cfg = parse_args_to_l2_adapters_config(args).adapters[0]
    assert cfg.serde_config is None
    l1, adapter = L1Manager(_l1_config()), create_l2_adapter(cfg)
    try:
        chunk = _chunk(torch.bfloat16, (2, LAYERS, TOKENS, HIDDEN), seed=8)
        layout = MemoryLayoutDesc([chunk.shape], [chunk.dtype])
        src, dst = _key(6), _key(7)
        got = l1.reserve_write([src, dst], [True, True], layout, tag="test")
        obj, out = got[src][1], got[dst][1]
        obj.tensor.copy_(chunk)
        out.tensor.zero_()
        task = adapter.submit_store_task([src], [obj])
        assert _wait(lambda: adapter.pop_completed_store_tasks().get(task)).is_successful()
        (path,) = tmp_path.glob("*.data")
        assert path.read_bytes() == chunk.view(torch.uint8).numpy().tobytes()
        task = adapter.submit_load_task([src], [out])
        assert _wait(lambda: adapter.query_load_result(task)).test(0)
        assert _same(out.tensor, chunk)
    finally:
        adapter.close()


def test_lmcache_alone_stores_the_true_length_but_cannot_load_it(tmp_path):
    # why SizedL2Adapter exists: LMCache's serde wrapper stores the bytes the serializer
    # wrote, then loads into a buffer of the estimated size, and its file-system adapter
    # counts the shorter file as a miss
    import entropykit.lmcache.plugin  # noqa: F401  (registers the serde, as the spec does)

    c = _Lmcache(tmp_path, sized=False)
    try:
        chunk = _chunk(torch.bfloat16, (2, LAYERS, TOKENS, HIDDEN), seed=7)
        assert c.store(_key(5), [chunk])
        (path,) = c.files()
        assert path.read_bytes() == ek.encode_chunk([chunk], threads=2)
        loaded, _ = c.load([_key(5)], [chunk])
        assert loaded == [False]
    finally:
        c.close()


def test_groups_of_several_dtypes_and_a_missing_key(lmc):
    # one buffer of two groups (LMCache's object groups hold one per kernel group)
    groups = [_chunk(torch.bfloat16, (2, LAYERS, TOKENS, HIDDEN), seed=2),
              _chunk(torch.float8_e5m2, (LAYERS, TOKENS, 32), seed=3)]
    assert lmc.store(_key(2), groups)
    loaded, outs = lmc.load([_key(9), _key(2)], groups)
    assert loaded == [False, True]
    assert all(_same(o, g) for o, g in zip(outs[1], groups, strict=True))


def test_incompressible_chunk_is_stored_as_it_is(lmc):
    g = torch.Generator().manual_seed(4)
    chunk = torch.randint(0, 256, (2, LAYERS, TOKENS, HIDDEN * 2), dtype=torch.uint8,
                          generator=g).view(torch.bfloat16)  # random bits, NaNs included
    assert lmc.store(_key(3), [chunk])
    (path,) = lmc.files()
    data = path.read_bytes()
    assert data[5] == ek.RAW and len(data) == 24 + chunk.numel() * 2
    loaded, (out,) = lmc.load([_key(3)], [chunk])
    assert loaded == [True] and _same(out[0], chunk)


@pytest.mark.parametrize("damage", ["body byte", "header byte", "claims more", "truncated",
                                    "extended"])
def test_damaged_file_is_a_miss(lmc, damage):
    chunk = _chunk(torch.bfloat16, (2, LAYERS, TOKENS, HIDDEN), seed=5)
    assert lmc.store(_key(4), [chunk])
    (path,) = lmc.files()
    data = bytearray(path.read_bytes())
    if damage == "body byte":
        data[len(data) // 2] ^= 0x10
    elif damage == "header byte":
        data[9] ^= 0x01  # the stated length
    elif damage == "claims more":  # a valid header stating more than the buffer holds
        struct.pack_into("<Q", data, 8, 1 << 40)
        struct.pack_into("<I", data, 20, zlib.crc32(data[:20]))
    elif damage == "truncated":
        del data[-100:]
    else:
        data += b"\0" * 100  # bytes after the blob are not read: still a hit
    path.write_bytes(bytes(data))
    loaded, (out,) = lmc.load([_key(4)], [chunk])
    if damage == "extended":
        assert loaded == [True] and _same(out[0], chunk)
    else:
        assert loaded == [False]
        with pytest.raises(CorruptDataError):
            ek.decode_chunk(bytes(data), [torch.empty_like(chunk)])


def test_serde_options_are_checked():
    with pytest.raises(ValueError, match="unknown options"):
        plugin.create_serde({"thread": 2})
    with pytest.raises(ValueError, match="threads must be"):
        plugin.create_serde({"threads": 0})
    plugin.create_serde({"threads": 1, "max_workers": 2}).close()
