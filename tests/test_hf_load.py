"""Compressed checkpoint directories load with transformers' from_pretrained, exactly.

Tiny random models of several families (dense, tied embeddings, mixtures of experts whose
per-expert tensors transformers merges while loading) are saved with ``save_pretrained``,
compressed, and loaded back: the state dict must equal the saved one bit for bit, the
logits those of the plain checkpoint; decompression restores config.json byte for byte;
transformers without entropykit refuses the compressed directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import entropykit  # noqa: E402
from entropykit import api, dtypes, hf  # noqa: E402
from entropykit.container import checkpoint  # noqa: E402
from entropykit.container.reader import Compressed  # noqa: E402
from entropykit.hf import _quantizer  # noqa: E402
from entropykit.lazy import CompressedFile  # noqa: E402

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _config(family: str) -> transformers.PretrainedConfig:
    if family == "gpt2":  # tied embeddings
        return transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                       n_positions=64)
    if family == "gemma":  # tied embeddings
        return transformers.GemmaConfig(head_dim=16, **_SMALL)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, **_SMALL)
    if family == "qwen2":
        return transformers.Qwen2Config(**_SMALL)
    if family == "mixtral":  # per-expert checkpoint tensors merged while loading
        return transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **_SMALL)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32,
                                           shared_expert_intermediate_size=64, **_SMALL)
    return transformers.LlamaConfig(**_SMALL)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits (so NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _save(tmp_path: Path, family: str, dtype: torch.dtype, shard: str | None = None
          ) -> tuple[Path, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).to(dtype)
    d = tmp_path / family
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(d, **kwargs)
    return d, {k: v.clone() for k, v in model.state_dict().items()}


def _load(d: Path, **kwargs: object) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(d, **kwargs)


def _same_model(a: transformers.PreTrainedModel, b: transformers.PreTrainedModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(_bits(sa[k]), _bits(sb[k])), k
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(_bits(a(x).logits), _bits(b(x).logits))


CASES = [("llama", torch.bfloat16, "40KB"), ("qwen2", torch.float16, None),
         ("qwen3", torch.bfloat16, None), ("gemma", torch.bfloat16, None),
         ("gpt2", torch.float32, "100KB"), ("mixtral", torch.bfloat16, "60KB"),
         ("qwen2_moe", torch.float32, None)]


@pytest.mark.parametrize(("family", "dtype", "shard"), CASES, ids=[c[0] for c in CASES])
def test_from_pretrained_exact(tmp_path: Path, family: str, dtype: torch.dtype,
                               shard: str | None) -> None:
    d, saved = _save(tmp_path, family, dtype, shard)
    if shard is not None:
        assert (d / "model.safetensors.index.json").is_file()
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    assert json.loads((ek / "config.json").read_text())["quantization_config"][
        "quant_method"] == "entropykit"
    plain, packed = _load(d), _load(ek)
    _same_model(plain, packed)
    for k, v in saved.items():  # what save_pretrained wrote is what loads
        assert torch.equal(_bits(packed.state_dict()[k]), _bits(v)), k
    # an ordinary model afterwards: no quantizer, no quantization config
    assert getattr(packed, "hf_quantizer", None) is None
    assert getattr(packed.config, "quantization_config", None) is None
    assert not getattr(packed, "is_quantized", False)
    if packed.config.tie_word_embeddings:
        assert packed.lm_head.weight.data_ptr() == \
            packed.get_input_embeddings().weight.data_ptr()
    # load_file on the directory: the checkpoint's tensors, merged
    got = entropykit.load_file(ek)
    want = entropykit.load_file(d)
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(_bits(got[k]), _bits(want[k])), k


def test_from_pretrained_dtype_and_device_map(tmp_path: Path) -> None:
    d, _ = _save(tmp_path, "llama", torch.bfloat16)
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    options: list[dict] = [{"dtype": torch.float32}]
    if importlib.util.find_spec("accelerate") is not None:  # device_map needs it
        options.append({"device_map": "cpu"})
    for kwargs in options:
        _same_model(_load(d, **kwargs), _load(ek, **kwargs))
    assert _load(ek, dtype=torch.float32).model.norm.weight.dtype == torch.float32


class _Calls(list):
    runs: list
    # per GPU load: (whether its first group was launched at once, thread, the device
    # torch's factory functions default to there)
    started: list


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[str], dict, str]]:
    """Every batch the quantizer decodes: (device, names, the tensors it returned, the
    thread that decoded it). A CUDA
    device's batch goes through the GPU loader's plan of those tensors and the kernel's
    emulator (tests/test_gpu_load.py), giving CPU tensors."""
    from test_gpu_load import emulated_tensors

    calls, real = _Calls(), api._load_compressed

    def spy(c: Any, device: Any, threads: int, names: list[str] | None = None) -> dict:
        if names is None:  # load_file, not the quantizer
            return real(c, device, threads, names)
        if str(device).startswith("cuda"):
            types = dtypes.torch_types()
            got = {k: api._as_torch(v, c.entry(k), types)
                   for k, v in emulated_tensors(c, 2, names).items()}
        else:
            got = real(c, device, threads, names)
        calls.append((str(device), list(names), got, threading.current_thread().name))
        return got

    def spy_many(jobs: list, device: Any, threads: int, now: bool = False) -> Any:
        if not str(device).startswith("cuda"):
            return real_many(jobs, device, threads, now=now)
        runs.append([names for _, names in jobs])
        calls.started.append((now, threading.current_thread().name,
                              torch.empty(0).device.type))
        return (spy(c, device, threads, names) for c, names in jobs)

    runs: list[list[list[str]]] = []
    real_many = api._load_many
    monkeypatch.setattr(api, "_load_compressed", spy)
    monkeypatch.setattr(api, "_load_many", spy_many)
    calls.runs = runs  # per GPU load of several shards: each shard's names
    calls.started = []
    return calls


def _checkpoint(d: Path) -> dict[str, tuple[Path, int]]:
    """Checkpoint name -> (its shard's name, its bytes)."""
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        for k, v in entropykit.load_file(p).items():
            out[k] = (p.name, v.numel() * v.element_size())
    return out


def test_shard_tensors_decode_together_and_are_handed_out(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """On the CPU the first tensor asked of a shard decodes all of its small tensors in
    one call (one thread pool, no per-tensor setup); each is then handed out (nothing
    left held), large ones are decoded when asked; the model is bit-identical."""
    d, saved = _save(tmp_path, "llama", torch.bfloat16, "40KB")
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    monkeypatch.setattr(_quantizer, "SMALL", 20_000)  # embedding and head (32 KB): large
    asked: list[str] = []
    get_tensor = CompressedFile.get_tensor
    monkeypatch.setattr(CompressedFile, "get_tensor",
                        lambda self, name: asked.append(name) or get_tensor(self, name))
    calls = _spy(monkeypatch)
    _same_model(_load(d), _load(ek))
    ckpt = _checkpoint(ek)
    assert sorted(asked) == sorted(k for k, (_, n) in ckpt.items() if n > 20_000)
    assert asked  # the threshold split this checkpoint
    small = {}
    for k, (shard, n) in ckpt.items():
        if n <= 20_000:
            small.setdefault(shard, set()).add(k)
    assert len(calls) == len(small) > 1  # one batch per shard
    assert {frozenset(c[1]) for c in calls} == \
        {frozenset(v) for v in small.values()}
    assert {c[0] for c in calls} == {"cpu"}
    assert [c[2] for c in calls] == [{}] * len(calls)  # all handed out


def test_batches_follow_the_device_map(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    """A shard split by the device map decodes one batch per device, each holding only
    the tensors bound there: a CUDA device's every tensor (large too), through the GPU
    plan (emulated here), the CPU's and meta's small ones; every tensor arrives exact."""
    d, _ = _save(tmp_path, "llama", torch.bfloat16, "40KB")
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    monkeypatch.setattr(_quantizer, "SMALL", 12_000)
    calls = _spy(monkeypatch)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    q = _quantizer.EntropyKitQuantizer(_quantizer.EntropyKitConfig())
    device_map = {"model.layers.1": "meta", "model.layers.0.mlp": "cuda:0",
                  "lm_head": "cuda:0", "": "cpu"}
    q._process_model_before_weight_loading(
        model, checkpoint_files=[str(p) for p in sorted(ek.glob("*.safetensors"))],
        device_map=device_map)
    q.update_weight_conversions([], model)
    assert q._ahead is not None  # the CUDA batch is under way before any tensor is read
    want = entropykit.load_file(d)
    ckpt = _checkpoint(ek)

    def bound(k: str) -> str:
        if k.startswith("model.layers.1."):
            return "meta"
        return "cuda:0" if k.startswith(("model.layers.0.mlp.", "lm_head.")) else "cpu"

    try:
        for k in sorted(want, key=lambda k: k.startswith("lm_head"), reverse=True):
            got = q.decode(k, torch.empty(0, dtype=torch.uint8), None, q._targets[k])
            assert got.dtype == want[k].dtype and got.shape == want[k].shape, k
            if bound(k) == "meta":
                assert got.device.type == "meta", k
            else:  # the emulated GPU batch stays on the CPU
                assert got.device.type == "cpu" and torch.equal(_bits(got), _bits(want[k])), k
        assert [dict(v) for v in q._batches.values()] == [{}] * len(q._batches)  # handed out
    finally:
        q.postprocess_model(model)
    expect: dict[tuple[str, str], set[str]] = {}  # (shard, device) -> its batch
    for k, (shard, n) in ckpt.items():
        if bound(k) == "cuda:0" or n <= 12_000:
            expect.setdefault((shard, bound(k)), set()).add(k)
    # meta's batch is decoded on the CPU, then moved
    assert sorted((c[0], sorted(c[1])) for c in calls) == \
        sorted(("cpu" if dev == "meta" else dev, sorted(v)) for (_, dev), v in expect.items())
    assert any(ckpt[k][1] > 12_000 for (_, dev), v in expect.items() if dev == "cuda:0"
               for k in v)  # a large tensor went with the CUDA batch
    assert {dev for _, dev in expect} == {"cuda:0", "cpu", "meta"}
    # CUDA batches are decoded ahead, on a side thread; the others when first asked for
    assert {c[3].startswith("entropykit-decode") for c in calls if c[0] == "cuda:0"} == {True}
    assert {c[3] for c in calls if c[0] == "cpu"} == {threading.current_thread().name}


def test_damage_in_a_batch_decoded_ahead_is_raised_when_asked_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard decoded ahead on the side thread (CUDA, emulated) that turns out damaged
    raises CorruptDataError naming the shard when its first tensor is asked for."""
    d, _ = _save(tmp_path, "llama", torch.bfloat16, "40KB")
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    shard = next(p for p in ek.glob("*.safetensors") if "lm_head.weight" in _keys(p))
    c = Compressed(np.fromfile(shard, np.uint8))
    o = next(e for e in c.outer.entries if e.name == "lm_head.weight")
    buf = np.fromfile(shard, np.uint8)
    buf[c.outer.data_start + o.begin + o.nbytes // 2] ^= 0x40
    buf.tofile(shard)
    _spy(monkeypatch)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    q = _quantizer.EntropyKitQuantizer(_quantizer.EntropyKitConfig())
    q._process_model_before_weight_loading(
        model, checkpoint_files=[str(p) for p in sorted(ek.glob("*.safetensors"))],
        device_map={"lm_head": "cuda:0", "": "cpu"})
    try:
        q.update_weight_conversions([], model)
        assert q._ahead.keys == {(shard, "cuda:0")}
        with pytest.raises(entropykit.CorruptDataError, match=f"^{shard}: "):
            q.decode("lm_head.weight", torch.empty(0, dtype=torch.uint8), None,
                     "lm_head.weight")
    finally:
        q.postprocess_model(model)


def test_one_device_map_starts_the_first_batch_when_the_shards_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``device_map={"": "cuda:0"}`` the first shard's GPU batch (emulated) starts as
    soon as the shards are open, before transformers plans its conversions; each shard is
    one batch on the side thread, and every tensor arrives exact."""
    d, _ = _save(tmp_path, "llama", torch.bfloat16, "40KB")
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    calls = _spy(monkeypatch)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    q = _quantizer.EntropyKitQuantizer(_quantizer.EntropyKitConfig())
    shards = sorted(ek.glob("*.safetensors"))
    with torch.device("meta"):  # as transformers calls it: the model is built on meta
        q._process_model_before_weight_loading(
            model, checkpoint_files=[str(p) for p in shards], device_map={"": "cuda:0"})
    try:
        assert q._ahead is not None
        q.update_weight_conversions([], model)
        want = entropykit.load_file(d)
        q_order = list(q._order)
        for k in q._order:
            got = q.decode(k, torch.empty(0, dtype=torch.uint8), None, q._targets[k])
            assert torch.equal(_bits(got), _bits(want[k])), k
    finally:
        q.postprocess_model(model)
    assert sorted(len(c[1]) for c in calls) == sorted(len(_keys(p)) for p in shards)
    assert {c[0] for c in calls} == {"cuda:0"}
    assert {c[3].startswith("entropykit-decode") for c in calls} == {True}
    # every shard through one GPU load, in the order transformers asks for them, started
    # on the thread that opened the shards (before transformers starts its own threads)
    first_asked = sorted(shards, key=lambda p: min(q_order.index(k) for k in _keys(p)))
    assert calls.runs == [[_keys(p) for p in first_asked]]
    # ... with the loader's own buffers real (host memory), not on transformers' meta
    assert calls.started == [(True, threading.current_thread().name, "cpu")]


def test_cuda_batches_fall_back_to_the_cpu_with_a_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GPU decoder cannot run (here: no CUDA device), a one-device CUDA map's
    batches, started when the shards open, are decoded by the CPU on the side thread,
    each shard with a warning naming it, and every tensor arrives exact (moved to the
    device: a stand-in here)."""
    d, _ = _save(tmp_path, "llama", torch.bfloat16, "40KB")
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    to = torch.Tensor.to

    def moved(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and str(args[0]).startswith("cuda"):
            return self  # no CUDA device here: the CPU tensor stands in
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", moved)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(_config("llama"))
    q = _quantizer.EntropyKitQuantizer(_quantizer.EntropyKitConfig())
    shards = sorted(ek.glob("*.safetensors"))
    with pytest.warns(UserWarning, match="decoded on the CPU") as caught:
        q._process_model_before_weight_loading(
            model, checkpoint_files=[str(p) for p in shards], device_map={"": "cuda:0"})
        try:
            q.update_weight_conversions([], model)
            want = entropykit.load_file(d)
            for k in q._order:
                got = q.decode(k, torch.empty(0, dtype=torch.uint8), None, q._targets[k])
                assert torch.equal(_bits(got), _bits(want[k])), k
        finally:
            q.postprocess_model(model)
    named = sorted(str(w.message).split(" ")[1] for w in caught
                   if "decoded on the CPU" in str(w.message))
    assert named == sorted(p.name for p in shards) and len(shards) > 1


def test_batches_ahead_are_made_one_at_a_time_in_order() -> None:
    """The side thread makes a batch only once the one before it was taken (so at most
    two are held), hands them out in order, raises a failure where it happened, and
    stops when closed while a batch is waiting to be taken."""
    states: list[bool] = []
    made: list[_quantizer._Ahead] = []  # the _Ahead making these (batch 0 is made first)

    def items(n: int, fail_at: int | None = None) -> Any:
        for k in range(n):
            if k:
                states.append(made[-1]._item is None)  # nothing made is left untaken
            if k == fail_at:
                raise entropykit.CorruptDataError(f"batch {k} is damaged")
            yield (Path(f"s{k}"), "cuda:0"), {"k": k}

    ahead = _quantizer._Ahead([(Path(f"s{k}"), "cuda:0") for k in range(4)], items(4))
    made.append(ahead)
    got = [ahead.take() for _ in range(5)]
    ahead.close()
    assert [g[1]["k"] for g in got[:4]] == [0, 1, 2, 3] and got[4] is None
    assert states == [True] * 3
    ahead = _quantizer._Ahead([], items(4, fail_at=2))
    made.append(ahead)
    assert [ahead.take()[1]["k"] for _ in range(2)] == [0, 1]
    with pytest.raises(entropykit.CorruptDataError, match="^batch 2 is damaged$"):
        ahead.take()
    ahead.close()
    ahead = _quantizer._Ahead([], items(4))
    made.append(ahead)
    assert ahead.take()[1]["k"] == 0
    ahead.close()  # batch 1 made and never taken: the thread stops
    assert not ahead._thread.is_alive()


def test_every_converter_copies_as_deepcopy_does() -> None:
    """The converter entropykit appends is copied per parameter (transformers deep-copies
    it) by its own ``__deepcopy__``: every attribute equal to what the generic copy of
    the same converter gives, no container shared with the original or another copy, a
    new ``Decode`` sharing the quantizer; what a copy collects stays its own."""
    import copy

    from transformers.core_model_loading import WeightConverter

    q = _quantizer.EntropyKitQuantizer(_quantizer.EntropyKitConfig())
    ours = _quantizer._Every(_quantizer._ALL, "(.+)", [_quantizer.Decode(q, True)],
                             **_quantizer._ON_CPU)
    plain = WeightConverter(_quantizer._ALL, "(.+)", [_quantizer.Decode(q, True)],
                            **_quantizer._ON_CPU)
    assert type(ours).__deepcopy__ is not WeightConverter.__dict__.get("__deepcopy__")
    a, b, want = copy.deepcopy(ours), copy.deepcopy(ours), copy.deepcopy(plain)
    names = _quantizer._attributes(plain)
    assert len(names) >= 10 and set(names) <= set(_quantizer._attributes(a))
    for name in names:
        got, expect = getattr(a, name), getattr(want, name)
        if name == "operations":
            assert [type(o) for o in got] == [_quantizer.Decode]
            assert got[0] is not ours.operations[0] and got[0].quantizer is q
            assert got[0].last is True
        else:
            assert type(got) is type(expect) and got == expect, name
        if isinstance(got, (list, dict, set)):
            assert got is not getattr(ours, name) and got is not getattr(b, name), name
    a.add_tensor("x", "y", _quantizer._ALL, "future")
    assert dict(b.collected_tensors) == {} and dict(ours.layer_targets) == {}
    assert type(a) is _quantizer._Every


def _keys(p: Path) -> list[str]:
    with entropykit.safe_open(p, framework="pt") as f:
        return list(f.keys())


def test_cli_compress_then_decompress_restores_config(tmp_path: Path) -> None:
    d, _ = _save(tmp_path, "qwen2", torch.bfloat16, "40KB")
    ek, back = tmp_path / "ek", tmp_path / "back"
    env = {**os.environ, "PYTHONPATH": str(Path(entropykit.__file__).parents[1])}
    for args in (["compress", str(d), "-o", str(ek)], ["decompress", str(ek), "-o", str(back)]):
        subprocess.run([sys.executable, "-m", "entropykit.cli", *args, "-q"], check=True,
                       env=env)
    assert (ek / "config.json").read_bytes() != (d / "config.json").read_bytes()
    for p in sorted(d.iterdir()):
        assert (back / p.name).read_bytes() == p.read_bytes(), p.name
    checkpoint.verify_dir(ek, d)  # the marked config.json counts as its original
    _same_model(_load(d), _load(ek))


def test_plain_transformers_refuses(tmp_path: Path) -> None:
    """Without entropykit imported, from_pretrained of a compressed directory raises."""
    d, _ = _save(tmp_path, "llama", torch.bfloat16)
    ek = tmp_path / "ek"
    entropykit.compress_file(d, ek)
    code = ("import sys, transformers\n"
            f"transformers.AutoModelForCausalLM.from_pretrained({str(ek)!r})\n"
            "assert 'entropykit' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode != 0
    assert "RuntimeError" in r.stderr and "MISMATCH" in r.stderr


FIRST = {
    "entropykit": "import sys, entropykit\nassert 'transformers' not in sys.modules\n",
    "transformers": "import transformers, entropykit\n",
    # the quantizer module imports transformers' registry, which runs the import hook
    "quantizer": "import entropykit.hf._quantizer\n",
}


@pytest.mark.parametrize("first", sorted(FIRST))
def test_registered_whichever_is_imported_first(first: str) -> None:
    """Registered in any import order; importing entropykit does not import transformers."""
    code = FIRST[first]
    code += ("from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as m\n"
             "assert m['entropykit'].__name__ == 'EntropyKitQuantizer', m.get('entropykit')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("raw", [
    b'{"a": 1}',
    b'{\n  "model_type": "llama",\n  "x": [1, 2.50, "\\u00e9t\\u00e9"]\n}\n',
    '{"name": "été ☃", "n": 1e3}  \n\n'.encode(),
])
def test_mark_restores_bytes(raw: bytes) -> None:
    m = hf.marked(raw)
    assert m is not None and json.loads(m)["quantization_config"]["quant_method"] == "entropykit"
    assert hf.unmarked(m) == raw
    assert hf.unmarked(raw) is None


@pytest.mark.parametrize("raw", [b"[1, 2]", b"not json", b"\xff\xfe", b"[" * 100_000,
                                 b'{"quantization_config": {"quant_method": "fp8"}}'])
def test_unmarkable_config_left_alone(raw: bytes) -> None:
    assert hf.marked(raw) is None and hf.unmarked(raw) is None


def test_quantizer_needs_a_compressed_checkpoint(tmp_path: Path) -> None:
    from entropykit.hf._quantizer import EntropyKitConfig

    d, _ = _save(tmp_path, "llama", torch.bfloat16)
    with pytest.raises(ValueError, match="pre-quantized"):
        _load(d, quantization_config=EntropyKitConfig())


def test_linked_config_is_not_marked_through_its_link(tmp_path: Path) -> None:
    # A config.json kept as a link inside the checkpoint: marking it would write into the
    # link's target, a file of its own in the copy.
    import safetensors.torch

    src = tmp_path / "ck"
    src.mkdir()
    raw = b'{"model_type": "llama"}\n'
    (src / "base_config.json").write_bytes(raw)
    (src / "config.json").symlink_to("base_config.json")
    safetensors.torch.save_file({"w": torch.arange(64, dtype=torch.bfloat16)},
                                src / "model.safetensors")
    entropykit.compress_file(src, tmp_path / "ck.ek")
    assert (tmp_path / "ck.ek" / "config.json").is_symlink()
    assert (tmp_path / "ck.ek" / "base_config.json").read_bytes() == raw
    checkpoint.verify_dir(tmp_path / "ck.ek", src)
    entropykit.decompress_file(tmp_path / "ck.ek", tmp_path / "back")
    assert (tmp_path / "back" / "base_config.json").read_bytes() == raw
