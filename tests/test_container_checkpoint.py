"""Sharded checkpoint directories: every shard compressed under its own name, other files
(index, config, tokenizer, subdirectories) copied, byte-exact restore of the whole tree,
verify against the original, and a missing shard reported by name with no output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_container import all_dtypes

from entropykit import CorruptDataError, hf
from entropykit.container import checkpoint


def _tree(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    tensors = all_dtypes()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, shard))
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}, indent=2))
    (d / "config.json").write_text('{"model_type": "llama"}\n')
    (d / "1_Pooling").mkdir()
    (d / "1_Pooling" / "config.json").write_text("{}")
    save_file({"p": torch.ones(3)}, d / "1_Pooling" / "extra.safetensors")
    return d


def test_directory_roundtrip(ckpt: Path, tmp_path: Path) -> None:
    before = _tree(ckpt)
    summary = checkpoint.compress_dir(ckpt, threads=2)
    packed = tmp_path / "ckpt.ek"
    assert summary.files == 3
    tree = _tree(packed)
    assert sorted(tree) == sorted(before)  # same names: the index stays valid as it is
    for rel in ("model.safetensors.index.json", "1_Pooling/config.json"):
        assert tree[rel] == before[rel]
    # the top-level config.json carries the mark transformers loads it by (entropykit.hf)
    assert hf.unmarked(tree["config.json"]) == before["config.json"]
    for rel in ("model-00001-of-00002.safetensors", "1_Pooling/extra.safetensors"):
        assert tree[rel] != before[rel]
    checkpoint.verify_dir(packed, ckpt)
    checkpoint.decompress_dir(packed, tmp_path / "back")
    assert _tree(tmp_path / "back") == before == _tree(ckpt)


def test_fast_directory_is_each_file_compressed_fast(ckpt: Path, tmp_path: Path) -> None:
    from entropykit.container import files

    checkpoint.compress_dir(ckpt, tmp_path / "fast.ek", fast=True)
    shard = "model-00001-of-00002.safetensors"
    files.compress_file(ckpt / shard, tmp_path / "one.ek", fast=True)
    assert (tmp_path / "fast.ek" / shard).read_bytes() == (tmp_path / "one.ek").read_bytes()
    files.compress_file(ckpt / shard, tmp_path / "slow.ek")
    assert (tmp_path / "slow.ek").read_bytes() != (tmp_path / "one.ek").read_bytes()
    checkpoint.decompress_dir(tmp_path / "fast.ek", tmp_path / "back")
    assert _tree(tmp_path / "back") == _tree(ckpt)


def test_verify_dir_finds_differences(ckpt: Path, tmp_path: Path) -> None:
    checkpoint.compress_dir(ckpt, tmp_path / "c")
    (ckpt / "config.json").write_text("{}")
    with pytest.raises(CorruptDataError, match="config.json: differs"):
        checkpoint.verify_dir(tmp_path / "c", ckpt)
    (ckpt / "new.txt").write_text("x")
    with pytest.raises(CorruptDataError, match="files differ .*new.txt"):
        checkpoint.verify_dir(tmp_path / "c", ckpt)


def test_missing_shard(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError,
                       match="model.safetensors.index.json: shard "
                             "model-00002-of-00002.safetensors is missing"):
        checkpoint.compress_dir(ckpt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bad_shard_leaves_no_output(ckpt: Path, tmp_path: Path) -> None:
    (ckpt / "model-00002-of-00002.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors: not a valid"):
        checkpoint.compress_dir(ckpt, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_existing_output_dir(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(FileExistsError):
        checkpoint.compress_dir(ckpt, out)
    checkpoint.compress_dir(ckpt, out, force=True)
    assert (out / "old").read_text() == "x"  # --force replaces only what the run writes
    assert (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]
    with pytest.raises(ValueError, match="lie inside the input"):
        checkpoint.compress_dir(ckpt, ckpt / "sub")
