"""Resident mode on the CPU: tiny transformers models whose weights stay coded.

The CPU backend runs the same units, scratch buffers and hooks as the CUDA one, so here:
logits and generated tokens bit-identical to the plain model (Llama bf16, GPT-2 with tied
embeddings, fp16, fp8 weights with scales), the memory accounting to the byte, one
scratch buffer reused by every block (weights are fixed views into it), outputs
exact after the buffer is poisoned, weights restored bit for bit and hooks removed.
The CUDA decoder's plans (batches, places of byte planes, bound outputs) run through the
kernel emulator of test_gpu_logic.py. gpu/tests/test_cuda_resident.py runs the device.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import math
import types
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import entropykit.torch as ekt  # noqa: E402
from entropykit import gpu  # noqa: E402
from entropykit.rans import cuda as rans_cuda  # noqa: E402
from entropykit.rans.cuda import _layout as lay  # noqa: E402
from entropykit.torch import _coded, _cuda, _resident  # noqa: E402

_SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _llama(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    return model.to(dtype).eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=256, n_embd=64, n_layer=3, n_head=4,
                                  n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()


class _Fp8Linear(nn.Module):
    """An fp8 e4m3 weight with a per-row scale, as fp8 checkpoints store them."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        w = torch.randn(n_out, n_in) * 0.05
        scale = w.abs().amax(1, keepdim=True) / 448
        self.weight = nn.Parameter((w / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale = nn.Parameter(scale.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.weight.to(torch.bfloat16) * self.weight_scale).T


class _Fp8Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 64).to(torch.bfloat16)
        self.blocks = nn.ModuleList(
            nn.Sequential(_Fp8Linear(64, 128), nn.GELU(), _Fp8Linear(128, 64))
            for _ in range(3))
        self.head = _Fp8Linear(64, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return _bits(out if isinstance(out, torch.Tensor) else out.logits)


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(1))


def _coded_weights(model: nn.Module, min_elements: int = ekt.MIN_ELEMENTS) -> dict:
    """name -> parameter for what resident mode codes, found independently: 2+ dims, a
    coded dtype, enough elements, used by one module or tied between embeddings and
    Linears (named once)."""
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    return {n: p for n, p in model.named_parameters()
            if p.dim() >= 2 and p.dtype in _coded.FORMATS and p.numel() >= min_elements
            and (len(owners[id(p)]) == 1
                 or all(type(m) in (nn.Embedding, nn.Linear) for m in owners[id(p)]))}


def _llama_vocab(vocab: int, **kw) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**_SMALL, "vocab_size": vocab, **kw})
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _coded.ALIGN) * _coded.ALIGN


@pytest.mark.parametrize("make", [_llama, lambda: _llama(torch.float16), _gpt2, _Fp8Net],
                         ids=["llama-bf16", "llama-fp16", "gpt2-tied", "fp8-scales"])
def test_logits_exact_and_restore(make) -> None:
    model = make()
    ref = copy.deepcopy(model)
    before = {k: _bits(v).clone() for k, v in model.state_dict().items()}
    ids = _ids()
    want = _logits(ref, ids)
    ekt.compress_model(model)
    assert torch.equal(_logits(model, ids), want)
    assert torch.equal(_logits(model, ids), want)  # again: every block decoded anew
    ekt.decompress_model(model)
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(_bits(after[k]), before[k]) for k in before)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    assert all(p.requires_grad == q.requires_grad
               for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    assert torch.equal(_logits(model, ids), want)


def test_generate_exact() -> None:
    model, ref = _llama(), _llama()
    ids = _ids()[:1]
    ekt.compress_model(model)
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
        want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def _decoded(state) -> list:
    """The coded tensors the CPU backend's decoders decode (a launch's runs of weights,
    its tiles; a tied weight's tiles once)."""
    decoders = {id(u.decoder): u.decoder for u in state.units}
    return [c for d in decoders.values() for c in d.coded]


def _frames(state) -> int:
    """Bytes of every coded field the units decode (a tied weight's tiles once)."""
    return sum(f.data.nbytes for c in _decoded(state) for f in c.fields)


@pytest.mark.parametrize("vocab", [256, 4096], ids=["small-vocab", "large-vocab"])
def test_memory_accounting_exact(vocab) -> None:
    """Scratch is two of the largest block, whatever the embeddings' size: larger ones
    decode in row tiles no larger than a block."""
    model = _llama_vocab(vocab)
    coded = _coded_weights(model)
    assert "model.embed_tokens.weight" in coded and "lm_head.weight" in coded
    plain = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                if n not in coded) + sum(b.numel() * b.element_size() for b in model.buffers())
    block = max(sum(_aligned(p.numel() * 2) for n, p in coded.items()
                    if n.startswith(f"model.layers.{i}.")) for i in range(3))
    embed = coded["model.embed_tokens.weight"].numel() * 2
    ekt.compress_model(model)
    mem = ekt.resident_memory(model)
    state = model._entropykit_resident
    assert mem.tensors == len(coded)
    assert mem.uncompressed_bytes == sum(p.numel() * 2 for p in coded.values())
    assert mem.scratch_bytes == 2 * block
    assert mem.plain_bytes == plain
    assert mem.coded_bytes == _frames(state)
    assert 0 < mem.coded_bytes < mem.uncompressed_bytes  # random bf16 weights: exponents code
    assert mem.ratio == (mem.coded_bytes + mem.scratch_bytes) / mem.uncompressed_bytes
    tiles = [u for u in state.units if u.tiled is not None]
    if vocab == 256:  # embeddings smaller than a block decode whole
        assert tiles == [] and embed < block
    else:
        assert embed > mem.scratch_bytes  # the buffer never holds a whole embedding
        for m in (model.model.embed_tokens, model.lm_head):
            rows = [u.rows for u in tiles if u.module is m]
            assert rows[0][0] == 0 and rows[-1][1] == vocab and len(rows) > 2
            assert all(a[1] == b[0] for a, b in itertools.pairwise(rows))
        assert all(u.size <= block for u in tiles)


def test_tiled_blocks_scratch_is_two_tiles() -> None:
    """With ``tile_bytes`` below a block, blocks of Linears decode weight by weight in
    tiles: the scratch is two of the largest tile, the logits and tokens exact."""
    model, ref = _llama_vocab(4096), _llama_vocab(4096)
    ekt.compress_model(model, tile_bytes=8192)
    state = model._entropykit_resident
    assert all(u.tiled is not None for u in state.units)
    assert ekt.resident_memory(model).scratch_bytes == 2 * max(u.size for u in state.units)
    assert max(u.size for u in state.units) == 8192
    mlp = model.model.layers[1].mlp
    assert [u.rows for u in state.units if u.module is mlp.gate_proj] == [(0, 64), (64, 128)]
    assert [u.rows for u in state.units if u.module is mlp.down_proj] == [(0, 32), (32, 64)]
    ids = _ids().clamp(max=255)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))
    ekt.decompress_model(model)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)


def test_tiled_blocks_of_other_modules_decode_module_by_module() -> None:
    """fp8 blocks (modules of their own, not stock Linears) larger than ``tile_bytes``
    decode module by module: the scratch holds two modules, not two blocks."""
    model, ref = _Fp8Net(), _Fp8Net()
    ekt.compress_model(model, tile_bytes=8192)
    state = model._entropykit_resident
    linears = [m for b in model.blocks for m in b if isinstance(m, _Fp8Linear)]
    assert [u.module for u in state.units if u.weights][:-1] == linears
    assert state.units[-1].module is model.head  # not in a block: whole, as before
    assert ekt.resident_memory(model).scratch_bytes == 2 * 8192 == 64 * 128 * 2
    assert len([u for u in state.units if u.tiled is not None]) == 4  # the embedding
    ids = _ids()
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    with pytest.raises((NotImplementedError, RuntimeError)):  # no data outside its forward
        model.embed.weight.sum().item()


def _launches(state) -> list[list[int]]:
    """The units of each launch, in order."""
    out: list[list[int]] = []
    for k, u in enumerate(state.units):
        if u.lead == k:
            out.append([])
        out[-1].append(k)
    return out


def test_tiles_ahead_decode_in_one_launch() -> None:
    """``tiles_ahead``: up to that many consecutive tiles (across Linears) decode in one
    launch, back to back in one place; the scratch is two of the largest launches, the
    outputs exact, the weights restored."""
    model, ref = _llama_vocab(4096), _llama_vocab(4096)
    one = copy.deepcopy(model)
    ekt.compress_model(one, tile_bytes=8192)
    ekt.compress_model(model, tile_bytes=8192, tiles_ahead=3)
    state = model._entropykit_resident
    assert [u.rows for u in state.units] == [u.rows for u in one._entropykit_resident.units]
    launches = _launches(state)
    assert [len(g) for g in launches] == [3] * (len(state.units) // 3) + (
        [len(state.units) % 3] if len(state.units) % 3 else [])
    mlp = model.model.layers[0].mlp  # gate's two tiles and up's first in one launch
    assert any({state.units[k].module for k in g} == {mlp.gate_proj, mlp.up_proj}
               for g in launches)
    for g in launches:
        lead = state.units[g[0]]
        assert all(state.units[k].decoder is lead.decoder for k in g)
        at = lead.place.data_ptr()
        for k in g:  # back to back in the launch's place
            assert state.units[k].region.data_ptr() == at
            at += state.units[k].size
        assert at == lead.place.data_ptr() + lead.place.numel()
    biggest = max(state.units[g[0]].place.numel() for g in launches)
    assert biggest == 3 * 8192
    assert ekt.resident_memory(model).scratch_bytes == 2 * biggest
    assert len({id(u.decoder) for u in state.units}) == len(launches)
    assert ekt.resident_memory(model).uncompressed_bytes == ekt.resident_memory(
        one).uncompressed_bytes
    ids = _ids().clamp(max=255)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    _poison(model)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))
        h = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(2))
        h = h.to(torch.bfloat16)
        _poison(model)  # a Linear whose tiles start inside a launch, called alone
        assert torch.equal(_bits(mlp.up_proj(h)), _bits(ref.model.layers[0].mlp.up_proj(h)))
    ekt.decompress_model(model)
    got, want = model.state_dict(), ref.state_dict()
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)
    with pytest.raises(ValueError, match="tiles_ahead"):
        ekt.compress_model(_llama(), tiles_ahead=0)


def test_tiles_ahead_tied_owners_share_launches() -> None:
    """A tied embedding's tiles group only with their own module's: the lookup's and the
    head's launches are the same tiles, share decoders and places."""
    model, ref = _gpt2_vocab(4096), _gpt2_vocab(4096)
    ekt.compress_model(model, tiles_ahead=4)
    state = model._entropykit_resident
    wte, head = model.transformer.wte, model.lm_head
    launches = [[state.units[k] for k in g] for g in _launches(state)]
    mine = [g for g in launches if g[0].module in (wte, head)]
    assert [len(g) for g in mine] == [4, 2, 4, 2]
    assert all(len({u.module for u in g}) == 1 for g in launches)
    for e, h in zip(mine[:2], mine[2:], strict=True):
        assert e[0].decoder is h[0].decoder and e[0].place is h[0].place
    ids = torch.randint(0, 4096, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    ekt.decompress_model(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(_bits(model.lm_head.weight), _bits(ref.lm_head.weight))


def test_chunk_size_codes_smaller_chunks() -> None:
    """``chunk_size``: every coded field's frame is cut in chunks of that many symbols,
    the outputs exact; sizes outside the frame's bounds or not powers of two refused."""
    from entropykit.coding import frame
    from entropykit.rans.static import CODER

    model, ref = _llama(), _llama()
    ekt.compress_model(model, chunk_size=1024)
    state = model._entropykit_resident
    frames = [f.data for c in _decoded(state) for f in c.fields if f.coded]
    assert frames and {frame.parse(CODER, d).chunk_size for d in frames} == {1024}
    assert any(frame.parse(CODER, d).n > 1024 for d in frames)
    assert torch.equal(_logits(model, _ids()), _logits(ref, _ids()))
    for bad in (512, 1000, 3 << 10, 1 << 27):
        with pytest.raises(ValueError, match="chunk_size must be a power of two"):
            ekt.compress_model(_llama(), chunk_size=bad)


def test_entropy_bound_skips_only_encodes_that_would_be_dropped(monkeypatch) -> None:
    """A field is encoded only when its entropy bound could meet the saving asked for:
    the fields chosen (coded or plain, and their bytes) are those of encoding every
    field, and the bound is never above a frame's size."""
    from entropykit import rans

    g = torch.Generator().manual_seed(9)
    rng = np.random.default_rng(9)
    tensors = [(torch.randn(256, 96, generator=g) * 0.02).to(dt)
               for dt in (torch.bfloat16, torch.float16)]
    tensors.append((torch.randn(128, 64, generator=g) * 100).to(torch.float8_e4m3fn))
    u8 = torch.from_numpy(rng.integers(0, 256, (64, 512), dtype=np.uint8))
    tensors.append(u8.view(torch.bfloat16))  # every field near uniform: all plain
    got = [_coded.code_tensor(t, 0, 1024) for t in tensors]
    monkeypatch.setattr(_coded, "_entropy_bytes", lambda symbols: 0.0)  # encode all
    want = [_coded.code_tensor(t, 0, 1024) for t in tensors]
    for a, b in zip(got, want, strict=True):
        assert [(f.name, f.coded, f.data.tobytes()) for f in a.fields] == [
            (f.name, f.coded, f.data.tobytes()) for f in b.fields]
    assert {f.coded for c in got for f in c.fields} == {True, False}
    monkeypatch.undo()
    for n, p in ((1 << 16, None), (4096, [0.5, 0.5]), (3000, [0.9, 0.05, 0.05]), (10, None)):
        sym = rng.choice(len(p), n, p=p).astype(np.uint8) if p else rng.integers(
            0, 256, n, dtype=np.uint8)
        assert _coded._entropy_bytes(sym) <= len(rans.encode(sym, precision=12,
                                                             chunk_size=1024))


class _Nested(nn.Module):
    """A module using its own weight after a child's forward: it cannot be split."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(64, 64, bias=False)
        self.weight = nn.Parameter(torch.randn(64, 64) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) @ self.weight


@pytest.mark.parametrize("opts", [dict(tile_bytes=4096), dict(granularity="weight")],
                         ids=["tiles", "weight"])
def test_blocks_with_nested_weights_stay_whole(opts) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([_Nested(), _Nested()])).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    ekt.compress_model(model, **opts)
    units = model._entropykit_resident.units
    assert [u.module for u in units] == list(model[0]) and all(u.block for u in units)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    with torch.no_grad():
        got = model[0][1](model[0][0](x))
        want = ref[0][1](ref[0][0](x))
    assert torch.equal(_bits(got), _bits(want))


def _poison(model: nn.Module) -> None:
    s = model._entropykit_resident.scratch
    s.view(torch.bfloat16).fill_(float("nan"))


def test_scratch_reused_and_poison_proof() -> None:
    model, ref = _llama(), _llama()
    ids = _ids()
    want = _logits(ref, ids)
    ekt.compress_model(model)
    state = model._entropykit_resident
    base, end = state.scratch.data_ptr(), state.scratch.data_ptr() + state.scratch.numel()
    layers = model.model.layers
    ptr = lambda i: layers[i].self_attn.q_proj.weight.data_ptr()  # noqa: E731
    # unit 0 is the embedding (front), so layers 0 and 2 (units 1, 3) share the back
    assert ptr(0) == ptr(2) == end - state.units[1].size
    assert ptr(1) == base
    assert [u.prefetch for u in state.units] == [False, True, True, True, True]
    for k in range(len(state.units) - 1):  # neighbours decoded during each other: apart
        a, b = sorted((state.units[k].region, state.units[k + 1].region),
                      key=lambda r: r.data_ptr())
        assert a.data_ptr() + a.numel() <= b.data_ptr()
    ptrs = [ptr(i) for i in range(3)]
    for _ in range(2):
        _poison(model)
        assert torch.equal(_logits(model, ids), want)
        assert [ptr(i) for i in range(3)] == ptrs
        assert state.scratch.data_ptr() == base
    # every resident weight is a view into the buffer
    for u in state.units:
        for w in u.weights:
            assert getattr(w.owner, w.name).untyped_storage().data_ptr() == base


def _gpt2_vocab(vocab: int) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=3, n_head=4,
                                  n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()


@pytest.mark.parametrize("vocab", [256, 4096], ids=["one-tile", "tiles"])
def test_tied_embeddings_are_coded_once(vocab) -> None:
    """GPT-2's token embedding is its head's weight: coded once, decoded in tiles by the
    lookup and by the head, logits and tokens exact, restored as one parameter."""
    model, ref = _gpt2_vocab(vocab), _gpt2_vocab(vocab)
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(3))
    coded = _coded_weights(model)
    assert "transformer.wte.weight" in coded and "lm_head.weight" not in coded  # named once
    ekt.compress_model(model)
    wte = model.transformer.wte.weight
    assert model.lm_head.weight is wte and not isinstance(wte, nn.Parameter)
    assert wte.shape == (vocab, 64) and wte.dtype == torch.bfloat16
    assert "transformer.wte.weight" not in dict(model.named_parameters())
    state = model._entropykit_resident
    embed = [u for u in state.units if u.module is model.transformer.wte]
    head = [u for u in state.units if u.module is model.lm_head]
    assert len(embed) == len(head) == (1 if vocab == 256 else 6)
    assert all(e.decoder is h.decoder and e.region.data_ptr() == h.region.data_ptr()
               for e, h in zip(embed, head, strict=True))
    mem = ekt.resident_memory(model)
    assert mem.tensors == len(coded)
    assert mem.uncompressed_bytes == sum(p.numel() * 2 for p in coded.values())
    assert mem.coded_bytes == _frames(state)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    with torch.no_grad():
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids[:1], **kw), ref.generate(ids[:1], **kw))
    ekt.decompress_model(model)
    wte = model.transformer.wte.weight
    assert isinstance(wte, nn.Parameter) and model.lm_head.weight is wte
    assert torch.equal(_bits(wte), _bits(ref.transformer.wte.weight))
    assert all("forward" not in vars(m) for m in model.modules())


def test_small_weights_stay_plain() -> None:
    model = _gpt2()
    ekt.compress_model(model)
    assert isinstance(model.transformer.wpe.weight, torch.Tensor)
    assert "transformer.wpe.weight" not in dict(model.named_parameters())
    assert "transformer.h.0.ln_1.weight" in dict(model.named_parameters())
    small = _llama()
    ekt.compress_model(small, min_elements=1 << 20)
    assert ekt.resident_memory(small).tensors == 0
    assert torch.equal(_logits(small, _ids()), _logits(_llama(), _ids()))


class _BiasNet(nn.Module):
    """A vocabulary embedding, two blocks and a head with a bias, as a tiled head needs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(1000, 64, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(2))
        self.head = nn.Linear(64, 1000)
        self.to(torch.bfloat16).eval()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


@pytest.mark.parametrize("tile_bytes", [None, 1 << 14, 8000], ids=["block", "16K", "8000"])
def test_tiled_lookup_and_head_exact(tile_bytes) -> None:
    """Tiles of ``tile_bytes`` (default: the block's) at most, rows rounded to multiples
    of 64 where they fit: the lookup and the head with its bias give the plain outputs
    bit for bit at batch 1 and 64, and out-of-range ids raise as the plain lookup does."""
    model, ref = _BiasNet(), _BiasNet()
    ekt.compress_model(model, tile_bytes=tile_bytes)
    state = model._entropykit_resident
    cap = tile_bytes or _aligned(64 * 64 * 2)
    rows = [u.rows for u in state.units if u.module is model.head]
    assert rows == [u.rows for u in state.units if u.module is model.embed]
    width = {8192: 64, 1 << 14: 128, 8000: 56}[cap]  # most rows of 128 bytes that fit
    assert [b - a for a, b in rows[:-1]] == [width] * (len(rows) - 1)
    assert rows[-1][1] == 1000 and 0 < rows[-1][1] - rows[-1][0] <= width
    g = torch.Generator().manual_seed(5)
    for batch in (1, 64):
        ids = torch.randint(0, 1000, (batch, 3), generator=g)
        ids[0, 0] = 0  # the padding row is read as stored
        assert torch.equal(_logits(model, ids), _logits(ref, ids))
        with torch.no_grad():
            assert torch.equal(_bits(model.embed(ids)), _bits(ref.embed(ids)))
    for bad in (1000, -1):
        with torch.no_grad(), pytest.raises(IndexError, match="out of range"):
            ref.embed(torch.tensor([[1, bad]]))
        with torch.no_grad(), pytest.raises(IndexError, match="out of range"):
            model.embed(torch.tensor([[1, bad]]))
    with pytest.raises(ValueError, match="tile_bytes"):
        ekt.compress_model(_BiasNet(), tile_bytes=0)
    ekt.decompress_model(model)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)


def test_row_split_products_equal_the_whole_on_cpu() -> None:
    """What tiled heads rely on: splitting a product's output features (never its
    reduction) gives the whole product's bits, with tile widths as tiles are cut."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.bfloat16, torch.float16):
        for batch, k, n in ((1, 64, 4096), (64, 64, 4096), (1, 576, 3000), (17, 2048, 1500)):
            x = torch.randn(batch, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
            bias = torch.randn(n, generator=g).to(dtype)
            whole = F.linear(x, w, bias)
            for rows in _resident._tile_rows(n, k * 2, 256 * k * 2), [(0, n // 2), (n // 2, n)]:
                parts = torch.cat([F.linear(x, w[a:b], bias[a:b]) for a, b in rows], -1)
                assert torch.equal(_bits(parts), _bits(whole)), (dtype, batch, k, n)


def test_a_unit_called_alone_or_out_of_order() -> None:
    model, ref = _llama(), _llama()
    ekt.compress_model(model)
    h = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    _logits(model, _ids())  # leaves the buffers holding other blocks
    with torch.no_grad():
        assert torch.equal(_bits(model.lm_head(h)), _bits(ref.lm_head(h)))
        ids = _ids()
        assert torch.equal(_bits(model.model.embed_tokens(ids)),
                           _bits(ref.model.embed_tokens(ids)))
        assert torch.equal(_bits(model.lm_head(h)), _bits(ref.lm_head(h)))


def test_inference_only_and_misuse() -> None:
    model = _llama()
    ekt.compress_model(model)
    x = torch.randn(1, 3, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(RuntimeError, match="inference only"):
        model(inputs_embeds=x)
    with pytest.raises(ValueError, match="resident already"):
        ekt.compress_model(model)
    with pytest.raises(ValueError, match="not resident"):
        ekt.decompress_model(_llama())
    with pytest.raises(ValueError, match="min_elements"):
        ekt.compress_model(_llama(), min_elements=0)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SMALL))
    with pytest.raises(ValueError, match="weights are on meta"):
        ekt.compress_model(meta.to(torch.bfloat16))
    with pytest.raises(ValueError, match="weights are on meta"):
        ekt.compress_model(_llama(), device="meta")
    half = _llama()
    half.lm_head.to("meta")
    with pytest.raises(ValueError, match="several devices"):
        ekt.compress_model(half)


def _unit_coded(u) -> list:
    return [w.coded for w in u.weights] if u.tiled is None else [u.coded]


class _FakeRuntime:
    """rans.cuda's runtime with the kernel emulated in numpy on CPU tensors."""

    class DeviceBatch:
        def __init__(self, batch, device) -> None:
            self.batch = batch
            self.payload = torch.from_numpy(batch.payload)
            self.sym_tables = torch.from_numpy(batch.sym_tables)
            self.info_tables = torch.from_numpy(batch.info_tables.view(np.int32))
            self.cmaps = torch.from_numpy(batch.cmaps)
            self.status = torch.zeros(max(1, len(batch.desc)), dtype=torch.int32)

        def bind(self, outs):
            gpu.check_outputs(self.batch, outs)
            batch, status = self.batch, self.status

            class Bound:
                desc = torch.from_numpy(batch.desc.copy())

                def __call__(self) -> None:
                    from test_gpu_logic import emulate_into

                    views = [o.view(torch.uint8).numpy().view(np.uint16 if batch.bf16
                                                              else np.uint8) for o in outs]
                    status[: len(batch.desc)] = torch.from_numpy(emulate_into(batch, views)[1])

            return Bound()

        def bind_rows(self, desc, status, out, pairs):
            """The kernel over the first ``pairs`` descriptor pairs of ``desc`` as they are
            when it runs, padded to whole blocks as the grid's last block is."""
            import ctypes
            import dataclasses

            from test_gpu_logic import emulate_into

            batch = self.batch

            def run() -> None:
                rows = desc.reshape(-1, lay.N_COLS)[: 2 * pairs].numpy().copy()
                pad = (-pairs) % batch.warps
                if pad:
                    tail = np.tile(rows[:2], (pad, 1))
                    tail[:, lay.D_N] = 0
                    rows = np.concatenate([rows, tail])
                live = rows[:, lay.D_N] > 0
                index = np.where(live, 0, -1)
                # the memory from ``out`` on, as far as the rows write (the kernel's raw
                # pointer: the outputs of one launch lie in one region)
                ends = rows[live, lay.D_OUT] + (rows[live, lay.D_N] - 1) * rows[live, lay.D_STEP]
                span = int(ends.max(initial=-1)) + 1
                ctype = ctypes.c_uint16 if batch.bf16 else ctypes.c_uint8
                view = (np.ctypeslib.as_array((ctype * span).from_address(out.data_ptr()))
                        if span else np.zeros(0, np.uint16 if batch.bf16 else np.uint8))
                b = dataclasses.replace(batch, desc=rows, out_index=index, sizes=(span,))
                status[: 2 * pairs] = torch.from_numpy(emulate_into(b, [view])[1][: 2 * pairs])

            return run


@pytest.mark.parametrize("opts", [{}, dict(tile_bytes=8192, tiles_ahead=3, chunk_size=1024),
                                  dict(granularity="weight")],
                         ids=["default", "launches-of-tiles", "weight"])
@pytest.mark.parametrize("make", [_llama, lambda: _llama(torch.float16), _Fp8Net],
                         ids=["bf16", "fp16", "fp8"])
def test_cuda_decoder_plans_on_the_emulator(make, opts, monkeypatch) -> None:
    """The CUDA backend's batches, places and outputs, run by the kernel emulator (tiles
    of one launch at their offsets in its place, chunks as small as asked); the device
    bytes ``planned_bytes`` computes on the host are what the decoders hold."""
    monkeypatch.setattr(rans_cuda, "load_runtime", lambda device: _FakeRuntime)

    def backend(device, units, sides):
        return (_resident.CpuStreams(),
                lambda coded, region: _cuda.CudaDecoder(coded, region, device))

    monkeypatch.setattr(_resident, "_backend", backend)
    model, ref = make(), make()
    ids = _ids()
    planned = []
    real_init = _cuda.CudaDecoder.__init__

    def init(self, coded, region, device) -> None:
        planned.append(_cuda.planned_bytes(coded))
        real_init(self, coded, region, device)
        self.planned = planned[-1]

    monkeypatch.setattr(_cuda.CudaDecoder, "__init__", init)
    ekt.compress_model(model, **opts)
    state = model._entropykit_resident
    assert all(isinstance(u.decoder, _cuda.CudaDecoder) for u in state.units)
    assert all(len(u.decoder.launches) == len({c.pair for c in _unit_coded(u)})
               for u in state.units)
    # by weight, tiles are a Linear's size: the embedding is larger
    assert any(u.tiled is not None for u in state.units) == (
        make is _Fp8Net or "tile_bytes" in opts or "granularity" in opts)
    assert all(d.planned == d.nbytes for d in {id(u.decoder): u.decoder
                                                for u in state.units}.values())
    if "tiles_ahead" in opts:
        assert max(len(g) for g in _launches(state)) == 3
        rows = sum(2 * len(index) for d in {id(u.decoder): u.decoder for u in state.units
                                                 }.values() for index in d.held[6::8])
        coded = sum(c.nbytes for u in state.units for c in _unit_coded(u))
        assert rows >= coded // (2 * 1024)  # chunks of 1024 symbols, pairs in rows
    assert all(c.fields == () for u in state.units for c in _unit_coded(u))  # on the device
    state.scratch.fill_(0xFF)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    mem = ekt.resident_memory(model)
    decoders = {id(u.decoder): u.decoder for u in state.units}.values()
    assert mem.coded_bytes == sum(t.numel() * t.element_size()
                                  for d in decoders for t in d.held)
    payload = sum(d.held[0].numel() for d in decoders)
    assert payload < mem.uncompressed_bytes  # the kernel decodes frames, not only copies
    # what the device test reads off the allocator: the model's tensors are its plain
    # parameters and buffers, the decoders' buffers and the scratch, each held once
    held = [*model.parameters(), *model.buffers(), *(t for d in decoders for t in d.held),
            state.scratch]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in held if t.numel()}
    assert sum(storages.values()) == mem.plain_bytes + mem.coded_bytes + mem.scratch_bytes
    ekt.decompress_model(model)
    got, want = model.state_dict(), ref.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(_bits(got[k]), _bits(want[k])) for k in want)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_from_pretrained_resident(tmp_path, family) -> None:
    import entropykit
    from entropykit.hf import EntropyKitConfig

    model = _llama() if family == "llama" else _gpt2()
    model.save_pretrained(tmp_path / "plain")
    entropykit.compress_file(tmp_path / "plain", tmp_path / "ek")
    ids = _ids()
    load = transformers.AutoModelForCausalLM.from_pretrained
    with pytest.warns(UserWarning, match="resident"):  # transformers says what it takes
        got = load(tmp_path / "ek", quantization_config=EntropyKitConfig(resident=True))
    mem = ekt.resident_memory(got)
    assert mem.tensors == len(_coded_weights(model))
    assert mem.tensors > 0
    plain = load(tmp_path / "ek")  # the mark alone: ordinary parameters
    assert getattr(plain, "_entropykit_resident", None) is None
    # (the model saved had its buffers cast to bf16; loading builds them anew)
    assert torch.equal(_logits(got, ids), _logits(plain, ids))
    with pytest.raises(TypeError, match="resident must be a bool"):
        EntropyKitConfig(resident="yes")


@pytest.mark.parametrize("options", [
    {"tile_bytes": 4096, "tiles_ahead": 2, "chunk_size": 1024},
    {"granularity": "weight", "ahead": 3, "chunk_size": 1024}], ids=["tiles", "weight"])
def test_from_pretrained_resident_options_reach_compress_model(tmp_path, options) -> None:
    """granularity, ahead, tile_bytes, tiles_ahead and chunk_size of the config are
    compress_model's: the loaded model's units, launches, ring and frames are those of
    compress_model called with them, and its logits the plain model's."""
    import entropykit
    from entropykit.hf import EntropyKitConfig

    model = _llama()
    model.save_pretrained(tmp_path / "plain")
    entropykit.compress_file(tmp_path / "plain", tmp_path / "ek")
    load = transformers.AutoModelForCausalLM.from_pretrained
    with pytest.warns(UserWarning, match="resident"):
        got = load(tmp_path / "ek", quantization_config=EntropyKitConfig(resident=True,
                                                                          **options))
    plain = load(tmp_path / "ek")
    direct = ekt.compress_model(load(tmp_path / "ek"), **options)
    default = ekt.compress_model(load(tmp_path / "ek"))
    state = got._entropykit_resident
    assert state.chunk_size == 1024
    assert state.ahead == options.get("ahead", 1)
    assert len(state.units) == len(direct._entropykit_resident.units) \
        > len(default._entropykit_resident.units)
    assert state.leads == direct._entropykit_resident.leads
    assert ekt.resident_memory(got) == ekt.resident_memory(direct)
    assert torch.equal(_logits(got, _ids()), _logits(plain, _ids()))
    with pytest.raises(TypeError, match="tiles_ahead must be an int or None"):
        EntropyKitConfig(resident=True, tiles_ahead=2.0)


def test_a_failed_compress_leaves_the_model_as_it_was(monkeypatch) -> None:
    model, ref = _llama(), _llama()
    want = {k: _bits(v).clone() for k, v in ref.state_dict().items()}
    real, calls = _resident.code_tensor, []

    def fail_late(t, offset, chunk_size):
        calls.append(1)
        if len(calls) == 3:  # units 0 and 1 are converted by then (a block: one run)
            raise OSError("disk on fire")
        return real(t, offset, chunk_size)

    monkeypatch.setattr(_resident, "code_tensor", fail_late)
    with pytest.raises(OSError, match="disk on fire"):
        ekt.compress_model(model)
    monkeypatch.undo()

    def same() -> None:
        got = model.state_dict()
        assert set(got) == set(want)
        assert all(torch.equal(_bits(got[k]), want[k]) for k in want)
        assert all(isinstance(p, nn.Parameter) for _, p in model.named_parameters())
        assert getattr(model, "_entropykit_resident", None) is None
        assert all(not m._forward_pre_hooks for m in model.modules())

    same()
    # a decoder that gets it wrong is caught by verify, before any weight is dropped
    def flip(c, out):
        _coded.decode_into(c, out)
        out[0] ^= 1

    monkeypatch.setattr(_resident, "decode_into", flip)
    with pytest.raises(RuntimeError, match="did not decode to its weight"):
        ekt.compress_model(model)
    monkeypatch.undo()
    same()
    ekt.compress_model(model)  # and it still compresses
    assert torch.equal(_logits(model, _ids()), _logits(ref, _ids()))


class _Log:
    """Streams that log what the hooks asked for and decode at once (as the CPU's), or,
    ``lazy``, as late as a side stream could: a prefetch poisons its place at once (the
    side stream may write it any time) and decodes when it is joined."""

    def __init__(self, lazy: bool = False) -> None:
        self.ops: list[tuple[str, int]] = []
        self.entered: int | None = None  # the launch of the unit whose hook runs
        self.lazy = lazy
        self.queued: dict[int, object] = {}

    def now(self, decoder) -> None:
        self.ops.append(("now", self.entered))
        decoder.run()

    def prefetch(self, u, decoder) -> None:
        self.ops.append(("prefetch", u))
        if self.lazy:
            decoder.region[:] = 0xFF  # NaN in every coded float format
            self.queued[u] = decoder
        else:
            decoder.run()

    def join(self, u) -> None:
        self.ops.append(("join", u))
        if self.lazy:
            self.queued.pop(u).run()

    def synchronize(self) -> None:
        pass


def _logged(monkeypatch, lazy: bool = False) -> _Log:
    """A ``_Log`` as the streams of every model made resident from now on, told which
    launch each hook enters and logging each unit's compute once its hook returns."""
    log = _Log(lazy)
    monkeypatch.setattr(_resident, "_backend",
                        lambda device, units, sides: (log, _resident.CpuDecoder))
    real = _resident.Resident.before

    def before(self, k, args, kwargs) -> None:
        log.entered = self.units[k].lead
        real(self, k, args, kwargs)
        log.ops.append(("compute", k))

    monkeypatch.setattr(_resident.Resident, "before", before)
    return log


def _check_order(state, ops: list[tuple[str, int]], leads: list[int]) -> list[int]:
    """Replay streams ops against the rules that make the CUDA backend's overlap safe (a
    prefetch may write its place at any moment until it is joined): a unit computes only
    while its launch's decode, issued on the compute stream ("now") or prefetched and
    joined, is the last write to its place; a decode never races an un-joined prefetch
    into the same bytes; nothing is left un-joined at the end (graph capture). The units
    computed, in order."""
    span = {g: (state.units[g].place.data_ptr(),
                state.units[g].place.data_ptr() + state.units[g].place.numel())
            for g in leads}
    apart = lambda a, b: span[a][1] <= span[b][0] or span[b][1] <= span[a][0]  # noqa: E731
    pending: set[int] = set()
    ready: set[int] = set()  # launches whose place holds their decode, on the compute stream
    computed = []
    for i, (op, k) in enumerate(ops):
        if op == "compute":
            g = state.units[k].lead
            assert g in ready and g not in pending, ops[: i + 1]
            computed.append(k)
        elif op == "prefetch":
            assert all(apart(k, j) for j in pending), ops[: i + 1]
            pending.add(k)
            ready = {g for g in ready if apart(g, k)}
        elif op == "join":
            pending.discard(k)
            ready = {g for g in ready if apart(g, k)} | {k}
        elif op == "now":
            assert all(apart(k, j) for j in pending), ops[: i + 1]
            ready = {g for g in ready if apart(g, k)} | {k}
    assert not pending
    return computed


@pytest.mark.parametrize(("vocab", "tile_bytes", "ahead"),
                         [(256, None, 1), (4096, None, 1), (4096, 8192, 1), (4096, 8192, 3),
                          (4096, None, 4)],
                         ids=["small-vocab", "large-vocab", "tiled-blocks", "tiled-blocks-ahead",
                              "tiles-ahead"])
def test_decode_order_is_safe_on_two_streams(vocab, tile_bytes, ahead, monkeypatch) -> None:
    """What the hooks ask of the streams, replayed against the rules that make the CUDA
    backend's overlap safe: a unit computes only while its launch's decode, issued on the
    compute stream ("now") or prefetched and joined, is the last write to its place; a
    prefetch never targets the place of the launch about to compute; a decode on the
    compute stream never races an un-joined prefetch into the same bytes; nothing is left
    un-joined when the forward returns (graph capture); each launch decodes once."""
    log = _logged(monkeypatch)
    model = _llama_vocab(vocab)
    ref = copy.deepcopy(model)
    ekt.compress_model(model, tile_bytes=tile_bytes, tiles_ahead=ahead)
    state = model._entropykit_resident
    # large embeddings decode in tiles, each beside the one before like the blocks; with
    # tiles smaller than a block, the blocks' Linears too (q and o in one tile each, gate,
    # up and down in two; k and v are too small to code)
    if tile_bytes is None:
        assert len(state.units) == (5 if vocab == 256 else 3 + 2 * 8)
    else:
        assert len(state.units) == 2 * 64 + 3 * 8 and not any(u.block for u in state.units)
    leads = [g[0] for g in _launches(state)]
    # launches of tiles_ahead tiles (the embedding's 8 in two, then the blocks, the head's)
    assert len(leads) == {1: len(state.units), 3: -(-len(state.units) // 3), 4: 7}[ahead]
    want = [False] + [True] * (len(leads) - 1)
    assert [state.units[g].prefetch for g in leads] == want
    log.ops.clear()
    ids = _ids().clamp(max=255)
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    computed = _check_order(state, log.ops, leads)
    assert computed == list(range(len(state.units)))
    assert [k for op, k in log.ops if op == "now"] == [g for g, p in zip(leads, want,
                                                                          strict=True)
                                                        if not p]
    assert sorted(k for op, k in log.ops if op in ("now", "prefetch")) == leads



def _resident_check() -> types.ModuleType:
    """gpu/resident_check.py, imported from its file."""
    path = Path(__file__).resolve().parents[1] / "gpu" / "resident_check.py"
    spec = importlib.util.spec_from_file_location("resident_check", path)
    rc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rc)
    return rc


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["bf16", "fp8"])
def test_device_check_logic_on_the_cpu(fp8, monkeypatch) -> None:
    """gpu/resident_check.py's exactness checks, run on the CPU backend (the GPU machine
    runs them once; here they must pass and must catch a wrong weight)."""
    rc = _resident_check()
    make = lambda: rc.llama("tiny", "cpu", fp8)  # noqa: E731
    assert rc.exact_failures(make, "cpu") == []
    assert rc.exact_failures(make, "cpu", rc.SMALL_TILES) == []
    real = _resident.CpuDecoder.run

    def wrong(self) -> None:  # a decoder that flips a bit after its verification
        real(self)
        if getattr(self, "verified", False):
            self.region[0] ^= 0x40
        self.verified = True

    monkeypatch.setattr(_resident.CpuDecoder, "run", wrong)
    fails = rc.exact_failures(make, "cpu")
    assert fails and all("differ" in f or "give the weights back" in f for f in fails)


@pytest.mark.slow
def test_device_sweep_logic_on_the_cpu(capsys) -> None:
    """gpu/resident_check.py's sweep on the CPU backend (no graphs there): one row per
    option set (blocks in tiles, weights in rings of two and three), every one exact, the
    coding shared between option sets that cut the same tiles and the memo left as it
    was."""
    rc = _resident_check()
    grid = rc.sweep_grid([1 << 16, 1 << 12], [None, 1 << 16], [1, 3], 1 << 17)
    assert [(g["chunk_size"], g["tile_bytes"], g["tiles_ahead"]) for g in grid] == [
        (c, t, a) for c in (1 << 16, 1 << 12) for t, a in ((None, 1), (1 << 16, 1))]
    grid = rc.sweep_grid([1 << 12], [1 << 16], [1, 3], 1 << 26, ("block", "weight"), (1, 2))
    assert [(g["granularity"], g["tiles_ahead"], g["ahead"]) for g in grid] == [
        ("block", 1, 1), ("block", 3, 1), ("weight", 1, 1), ("weight", 1, 2)]
    calls = []
    real = _resident.code_tensor

    def counted(t, offset, chunk_size):
        calls.append(1)
        return real(t, offset, chunk_size)

    _resident.code_tensor = counted
    try:
        assert rc.sweep("tiny", False, "cpu", grid) == []
    finally:
        _resident.code_tensor = real
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("tiny bf16 ")]
    assert len(rows) == 5 and all("| yes " in r for r in rows[1:])
    # tiny's tiles of 64 KiB, coded once for both tiles_ahead values; then its 21 Linear
    # weights whole and the embedding's and head's 4 tiles each (a block's, as block
    # mode cuts them), coded once for both rings
    assert len(calls) == 53 + 21 + 2 * 4


def test_device_sweep_compares_the_granularities_defaults() -> None:
    """The short sweep's grid holds each granularity's defaults once (block: chunks per
    launch, one launch ahead; weight: chunks per tensor, two ahead), and its closing line
    names the one no worse in memory and in both steps (within 5%), only where both rows
    are exact."""
    rc = _resident_check()
    grid = (rc.sweep_grid([rc.BLOCK_CHUNK], [None], [], 0, ("block",))
            + rc.sweep_grid([1 << 16], [None], [1], 0, ("block", "weight"), (1,))
            + rc.sweep_grid([rc.WEIGHT_CHUNK], [], [], 0, ("weight",), (1, 2)))
    assert [rc._default_kind(o) for o in grid] == ["block", None, None, None, "weight"]
    for opts in (grid[0], grid[-1]):
        m = _llama_vocab(256)
        ekt.compress_model(m, **opts)
        ref = _llama_vocab(256)
        ekt.compress_model(ref, granularity=opts["granularity"])
        a, b = m._entropykit_resident, ref._entropykit_resident
        sizes = (1 << 12, 1 << 20, 1 << 26)
        assert ([a._chunk(n) for n in sizes], a.ahead) == ([b._chunk(n) for n in sizes],
                                                           b.ahead)  # the defaults indeed
    line = rc._granularity_verdict("m", (0.889, 3.9, 3.4, True), (0.762, 3.8, 3.45, True))
    assert line.endswith("weight is no worse in every column (steps within 5%)")
    line = rc._granularity_verdict("m", (0.889, 1.9, 3.4, True), (0.762, 3.8, 3.4, True))
    assert line.endswith("neither is no worse in every column")
    line = rc._granularity_verdict("m", (0.762, 3.8, 3.4, True), (0.889, 3.9, 3.4, False))
    assert line.endswith("not both exact")


def test_device_memory_of_a_row_ignores_an_earlier_rows_garbage(monkeypatch) -> None:
    """The device bytes a row prints for the model, plain and resident, are the model's
    own, though an earlier row's resident model is still held by the cycle its hooks form
    and Python's collector frees it while this row compresses (the allocator's live bytes
    on a stand-in device: blocks that count themselves while alive)."""
    import gc
    import weakref

    rc = _resident_check()
    live = [0]

    class Block:  # device bytes, counted while alive
        def __init__(self, n: int) -> None:
            self.n = n
            live[0] += n
            weakref.finalize(self, lambda: live.__setitem__(0, live[0] - n))

        def __deepcopy__(self, memo: dict) -> Block:
            return Block(self.n)

    def make() -> nn.Module:
        model = nn.Linear(2, 2)
        model.held = Block(3000)
        return model

    def compress(model: nn.Module, **opts) -> None:
        model.held = Block(1000)  # the plain weights go, coded ones come
        model.hooks = [model]  # a cycle, as resident mode's hooks form
        gc.collect()  # the collector runs meanwhile: the earlier row's model goes

    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: live[0])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: None)
    monkeypatch.setattr(rc.ekt, "compress_model", compress)
    gc.disable()  # the collector runs only where the row, or the stand-in, runs it
    try:
        earlier = make()
        earlier.hooks = [earlier]
        del earlier  # 3000 bytes of garbage, held by its cycle
        model, plain, _took, before, after = rc._built(make, {}, "cuda:0")
        assert (before, after) == (3000, 1000)
        assert (model.held.n, plain.held.n, live[0]) == (1000, 3000, 4000)
    finally:
        gc.enable()


def _family(name: str, vocab: int = 256) -> nn.Module:
    """Tiny models of the families resident mode meets (random weights, bf16)."""
    if name == "gpt2":
        return _gpt2_vocab(vocab)
    torch.manual_seed(0)
    kw = {**_SMALL, "vocab_size": vocab}
    if name == "llama-tied":
        return _llama_vocab(vocab, tie_word_embeddings=True)
    model, config = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                     "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
                     "qwen3": (transformers.Qwen3ForCausalLM, transformers.Qwen3Config)
                     }[name]
    if name == "qwen3":
        kw["head_dim"] = 16
    return model(config(**kw)).to(torch.bfloat16).eval()


_WEIGHT_MODELS = {
    "llama": lambda: _family("llama"),
    "llama-tied-tiles": lambda: _family("llama-tied", 4096),
    "qwen2": lambda: _family("qwen2"),
    "qwen3": lambda: _family("qwen3"),
    "gpt2-tied-tiles": lambda: _family("gpt2", 4096),
    "llama-fp16": lambda: _llama(torch.float16),
    "fp8-scales": _Fp8Net,
}


@pytest.mark.parametrize("make", list(_WEIGHT_MODELS.values()), ids=list(_WEIGHT_MODELS))
def test_weight_granularity_exact(make) -> None:
    """``granularity="weight"``: every block unit is one module's own weights, hooked on
    that module; logits bit-identical to the plain model's, again after the ring is
    poisoned, and every weight restored bit for bit."""
    model = make()
    ref = copy.deepcopy(model)
    before = {k: _bits(v).clone() for k, v in model.state_dict().items()}
    ids = _ids()
    want = _logits(ref, ids)
    ekt.compress_model(model, granularity="weight")
    state = model._entropykit_resident
    blocks = [u for u in state.units if u.block]
    assert len(blocks) > 3  # more than one unit per block
    for u in blocks:
        assert {w.owner for w in u.weights} == {u.module}
        assert next(u.module.children(), None) is None
    mem = ekt.resident_memory(model)
    assert mem.tensors == len(_coded_weights(ref))
    for _ in range(2):
        _poison(model)
        assert torch.equal(_logits(model, ids), want)
    ekt.decompress_model(model)
    after = model.state_dict()
    assert set(after) == set(before)
    assert all(torch.equal(_bits(after[k]), v) for k, v in before.items())


@pytest.mark.parametrize("ahead", [1, 2, 3])
@pytest.mark.parametrize("vocab", [256, 4096], ids=["small-vocab", "large-vocab"])
def test_weight_ring_is_two_consecutive_launches(vocab, ahead) -> None:
    """By weight, the buffer is a ring of bytes as large as the largest two consecutive
    launches (a Llama's gate and up Linears, 128 x 64 bf16 each), whatever ``ahead``:
    the embedding and head decode in row tiles of one Linear's size, every launch's
    place is apart from the one before it, so every launch after the first is decoded
    while the one before it computes, and the logits are block mode's."""
    model, block = _llama_vocab(vocab), _llama_vocab(vocab)
    ekt.compress_model(model, granularity="weight", ahead=ahead)
    ekt.compress_model(block)
    state = model._entropykit_resident
    slot = _aligned(128 * 64 * 2)
    mem = ekt.resident_memory(model)
    assert mem.scratch_bytes == 2 * slot
    assert mem.uncompressed_bytes == ekt.resident_memory(block).uncompressed_bytes
    assert mem.ratio == (mem.coded_bytes + mem.scratch_bytes) / mem.uncompressed_bytes
    # the embedding and head in tiles of 128 rows (a slot)
    assert [t.rows[0] for t in state.tiled] == [(0, 128)] * 2
    # q, o, gate, up, down of each layer (k and v are too small to code)
    blocks = [g for g in state.leads if state.units[g].block]
    assert [type(state.units[g].module).__name__ for g in blocks] == ["Linear"] * 5 * 3
    leads = [state.units[g] for g in state.leads]
    assert all(_resident._apart(a, b) for a, b in zip(leads, leads[1:], strict=False))
    assert [u.prefetch for u in leads] == [False] + [True] * (len(leads) - 1)
    assert all(u.place.numel() and state.scratch.data_ptr() <= u.place.data_ptr()
               and u.place.data_ptr() + u.place.numel()
               <= state.scratch.data_ptr() + mem.scratch_bytes for u in leads)
    ids = _ids().clamp(max=vocab - 1)
    assert torch.equal(_logits(model, ids), _logits(block, ids))


def test_weight_ring_places_a_launch_at_its_end_for_the_next() -> None:
    """A launch that would leave the next one no room apart from it (neither after it nor
    before it at the ring's start) takes the ring's end instead."""
    state = types.SimpleNamespace(units=[types.SimpleNamespace(shared=False)
                                         for _ in range(3)],
                                  leads=[0, 1, 2], device=torch.device("cpu"), ahead=2)
    _resident.Resident._ring(state, {0: 10, 1: 100, 2: 100})
    assert state.scratch.numel() == 200
    base = state.scratch.data_ptr()
    assert [(u.place.data_ptr() - base, u.place.numel()) for u in state.units] == [
        (0, 10), (100, 100), (0, 100)]


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_weight_granularity_head_tiles_of_the_device_check(fp8) -> None:
    """The device check's Llama-8B-shaped blocks (on the meta device: shapes only): by
    weight, the embedding and head decode in row tiles of at most the largest Linear's
    bytes (an MLP weight), multiples of 256 rows; in block mode, of a block's."""
    model = _resident_check().llama("8b-blocks", "meta", fp8)
    rows = {}
    for by_weight in (False, True):
        units = _resident._units(model, ekt.MIN_ELEMENTS, None, by_weight)
        rows[by_weight] = [t.rows for t in {id(u.tiled): u.tiled for u in units
                                            if u.tiled is not None}.values()]
    assert [r[0] for r in rows[False]] == [(0, 25856 if fp8 else 42752)] * 2
    assert [r[0] for r in rows[True]] == [(0, 7168 if fp8 else 14336)] * 2
    assert [len(r) for r in rows[True]] == [18 if fp8 else 9] * 2


def test_weight_chunk_sizes() -> None:
    """By weight (and no ``chunk_size``), each tensor's chunks are the largest power of
    two up to 16384 cutting it into 512 chunks, at least 4096 symbols: the Llama-8B
    shapes' q/o and MLP 16384, k/v 8192; by block, a launch's chunks are the largest
    power of two up to 65536 cutting it into 128 chunks, at least 16384 (Llama-8B's
    blocks 65536, SmolLM2's 16384); ``chunk_size`` sets both."""
    choose, per_launch = _resident.chunk_for, _resident.launch_chunk
    assert [choose(n) for n in (4096 * 4096, 1024 * 4096, 14336 * 4096, 512 << 14,
                                (512 << 14) - 1, 512 << 12, 1, 100_000)] == [
        1 << 14, 1 << 13, 1 << 14, 1 << 14, 1 << 13, 1 << 12, 1 << 12, 1 << 12]
    smol = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576  # SmolLM2-135M's block
    assert [per_launch(n) for n in (218_103_808, 128 << 16, (128 << 16) - 1, 128 << 15,
                                    smol, 1, 100_000)] == [
        1 << 16, 1 << 16, 1 << 15, 1 << 15, 1 << 14, 1 << 14, 1 << 14]
    from entropykit.coding import frame
    from entropykit.rans.static import CODER

    for opts, want in (({"granularity": "weight"}, choose), ({}, per_launch),
                       ({"granularity": "weight", "chunk_size": 2048}, lambda n: 2048),
                       ({"chunk_size": 2048}, lambda n: 2048)):
        model = _llama_vocab(4096)
        ekt.compress_model(model, **opts)
        state = model._entropykit_resident
        got = set()
        for g in state.leads:  # each launch's symbols and its frames' chunk size
            members = state._members(g)
            n = sum(math.prod(c.shape) for u in members for c in _unit_coded(u))
            got |= {(n, frame.parse(CODER, f.data).chunk_size)
                    for c in members[0].decoder.coded for f in c.fields if f.coded}
        assert got and got == {(n, want(n)) for n, _ in got}


def _alone(model: nn.Module, opts: dict) -> list[nn.Module]:
    """Modules of ``model`` a caller may run on their own (units, or holding whole units),
    taking a batch of hidden states: its head, and a block's MLP by weight."""
    if isinstance(model, _Fp8Net):
        return [model.head, model.blocks[1]]
    inner = model.model.layers[1] if hasattr(model, "model") else model.transformer.h[1]
    return [model.lm_head] + ([inner.mlp] if opts.get("granularity") == "weight" else [])


@pytest.mark.parametrize(("make", "opts"), [
    (lambda: _llama_vocab(4096), dict(granularity="weight")),
    (lambda: _llama_vocab(4096), dict(granularity="weight", ahead=3, tiles_ahead=2)),
    (lambda: _llama_vocab(4096), dict(granularity="weight", ahead=1)),
    (lambda: _gpt2_vocab(4096), dict(granularity="weight")),
    (lambda: _gpt2_vocab(4096), dict(ahead=2)),
    (_Fp8Net, dict(granularity="weight", ahead=2)),
    (lambda: _llama_vocab(4096), dict(tile_bytes=8192, ahead=3)),
], ids=["weight", "weight-ahead3-tiles2", "weight-ahead1", "gpt2-tied-weight",
        "gpt2-tied-blocks-ahead2", "fp8-weight", "tiles-ahead3"])
def test_ring_order_when_prefetches_land_late(make, opts, monkeypatch) -> None:
    """The ring's ordering on streams that write a prefetched place as early and decode
    it as late as a side stream could (poisoned at the prefetch, decoded at the join): the
    logits stay exact only if no unit reads its slot after a later launch took it and
    every prefetch is joined before its unit computes; the replay checks the same rules
    op by op, over two forwards and a unit called on its own between them."""
    log = _logged(monkeypatch, lazy=True)
    model = make()
    ref = copy.deepcopy(model)
    ekt.compress_model(model, **opts)
    state = model._entropykit_resident
    assert sum(bool(w) for w in state.window.values()) > len(state.leads) // 3
    log.ops.clear()
    for seed in range(2):
        ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(_logits(model, ids), _logits(ref, ids))
        assert _check_order(state, log.ops, state.leads) == list(range(len(state.units)))
        log.ops.clear()
        _poison(model)
        x = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(seed)).to(
            torch.bfloat16)
        with torch.no_grad():  # units called on their own, out of the forward's order
            for m, r in zip(_alone(model, opts), _alone(ref, opts), strict=True):
                assert torch.equal(_bits(m(x)), _bits(r(x)))
        state.end()
        _check_order(state, log.ops, state.leads)
        log.ops.clear()


def test_granularity_and_ahead_checked() -> None:
    with pytest.raises(ValueError, match="granularity must be one of"):
        ekt.compress_model(_llama(), granularity="tile")
    with pytest.raises(ValueError, match="ahead must be >= 0"):
        ekt.compress_model(_llama(), ahead=-1)
    from entropykit.hf import EntropyKitConfig

    with pytest.raises(TypeError, match="granularity must be a str or None"):
        EntropyKitConfig(resident=True, granularity=1)
    with pytest.raises(TypeError, match="ahead must be an int or None"):
        EntropyKitConfig(resident=True, ahead="2")
    config = EntropyKitConfig(resident=True, granularity="weight", ahead=3)
    assert config.resident_options() == {"granularity": "weight", "ahead": 3}

