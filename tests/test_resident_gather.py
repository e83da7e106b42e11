"""Resident mode's gathered embeddings on the CPU: a lookup decodes only the chunks
holding the rows it reads, through the CUDA backend's descriptors and the kernel
emulator (tests/test_gpu_logic.py), exact against the plain embedding."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_torch_resident import _bits, _FakeRuntime, _llama_vocab, _logits  # noqa: E402
from torch import nn  # noqa: E402

import entropykit.torch as ekt  # noqa: E402
from entropykit.rans import cuda as rans_cuda  # noqa: E402
from entropykit.rans.cuda import _layout as lay  # noqa: E402
from entropykit.torch import _coded, _cuda, _resident  # noqa: E402

VOCAB = 1000  # 62 chunks of 16 rows and a last one of 8


@pytest.fixture
def emulated(monkeypatch):
    """The CUDA backend on the CPU: its decoders and gathered lookups, kernels emulated;
    chunks of 16 rows of 64 (1024 symbols)."""
    monkeypatch.setattr(rans_cuda, "load_runtime", lambda device: _FakeRuntime)
    monkeypatch.setattr(_resident, "GATHER_CHUNK", 1024)

    def backend(device, units, sides):
        return (_resident.CpuStreams(),
                lambda coded, region: _cuda.CudaDecoder(coded, region, device))

    def gatherer(device):
        return lambda coded, chunk, slots, region: _cuda.GatherDecoder(
            coded, chunk, slots, region, device)

    monkeypatch.setattr(_resident, "_backend", backend)
    monkeypatch.setattr(_resident, "_gatherer", gatherer)


def _gathered(model: nn.Module):
    state = model._entropykit_resident
    (u,) = [u for u in state.units if u.gathered is not None]
    return state, u


EDGES = [0, 15, 16, 17, 31, 32, 991, 992, 999, 500, 500, 15, 0, 999]


@pytest.mark.parametrize("shape", [(1, 1), (1, 14), (2, 7), (14, 1), (2, 0)])
@pytest.mark.parametrize("opts", [{}, {"granularity": "weight"},
                                  {"granularity": "weight", "tile_bytes": 4096}],
                         ids=["block", "weight", "two-slots"])
def test_gathered_lookup_exact(emulated, opts, shape) -> None:
    """Ids at chunk edges, repeated, the first and last rows, in batch x seq shapes
    (empty too), with 32, 8 or 2 slots a launch (one launch or several):
    the lookup is the plain embedding's bit for bit, and so are the logits."""
    model, ref = _llama_vocab(VOCAB), _llama_vocab(VOCAB)
    ekt.compress_model(model, **opts)
    state, u = _gathered(model)
    g = u.gathered
    assert (g.chunk, g.rows_per_chunk, g.chunks) == (1024, 16, 63)
    # a tile's bytes of chunks: a block's (64 KiB), a Linear's (16 KiB), or 4 KiB
    assert g.slots == (2 if "tile_bytes" in opts else 8 if opts else 32)
    assert model.model.embed_tokens.weight.device.type == "meta"
    ids = torch.tensor(EDGES[: shape[0] * shape[1]], dtype=torch.long).view(shape)
    with torch.no_grad():
        state.scratch.fill_(0xFF)
        got = model.model.embed_tokens(ids)
        want = ref.model.embed_tokens(ids)
    assert got.shape == want.shape and torch.equal(_bits(got), _bits(want))
    if ids.numel():
        assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_gathered_padding_id_and_bounds(emulated) -> None:
    """An embedding with a padding id looks it up as the plain one does; ids out of range
    raise the plain lookup's IndexError."""
    model, ref = _llama_vocab(VOCAB, pad_token_id=992), _llama_vocab(VOCAB, pad_token_id=992)
    assert model.model.embed_tokens.padding_idx == 992
    ekt.compress_model(model)
    ids = torch.tensor([[992, 991, 992, 0]])
    with torch.no_grad():
        assert torch.equal(_bits(model.model.embed_tokens(ids)),
                           _bits(ref.model.embed_tokens(ids)))
        for bad in (VOCAB, -1):
            with pytest.raises(IndexError, match="index out of range"):
                model.model.embed_tokens(torch.tensor([[3, bad]]))


def test_gathered_descriptors_and_bytes(emulated) -> None:
    """A lookup's launch runs over one descriptor pair per id: the pair of the chunk
    holding its row (the batch's row but for its output, slot i at symbol i * chunk),
    and decodes ids x chunk symbols, not the embedding; memory counts the embedding
    once, its descriptors in chunk order and its decode buffers among the coded bytes;
    decompress_model gives the weight back."""
    model, ref = _llama_vocab(VOCAB), _llama_vocab(VOCAB)
    ekt.compress_model(model)
    state, u = _gathered(model)
    d = u.decoder
    table = _cuda.chunk_pairs(d._batch, 1024)
    assert table.shape == (63, 2, lay.N_COLS)
    assert (table[:, :, lay.D_OUT] == np.arange(63)[:, None] * 1024).all()
    ids = torch.tensor([[17, 999, 17, 0, 640]])
    with torch.no_grad():
        model.model.embed_tokens(ids)
    assert d.count == 5
    got = d.desc[:5].numpy()
    chunks = [1, 62, 1, 0, 40]
    assert (got[:, :, lay.D_OUT] == np.arange(5)[:, None] * 1024).all()
    same = np.arange(lay.N_COLS) != lay.D_OUT
    assert (got[:, :, same] == table[chunks][:, :, same]).all()
    mem = ekt.resident_memory(model)
    whole = VOCAB * 64 * 2
    assert mem.uncompressed_bytes == ekt.resident_memory(
        ekt.compress_model(_llama_vocab(VOCAB))).uncompressed_bytes
    assert d.nbytes == sum(t.numel() * t.element_size() for t in d.held)
    assert u.size == 32 * 1024 * 2 < whole  # 32 slots of a chunk: a block's bytes
    ekt.decompress_model(model)
    assert torch.equal(_bits(model.model.embed_tokens.weight),
                       _bits(ref.model.embed_tokens.weight))
    assert isinstance(model.model.embed_tokens.weight, nn.Parameter)


def test_tied_lookup_gathers_and_other_embeddings_keep_tiles(emulated) -> None:
    """A tied embedding (GPT-2's, read by the head too) gathers its lookup's rows, the
    head decoding tiles of the same chunks; an untied one of rows whose width is not a
    power of two decodes in tiles; an fp16 embedding whole or in tiles."""
    cfg = transformers.GPT2Config(vocab_size=4096, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=64)
    torch.manual_seed(0)
    tied = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()
    ekt.compress_model(tied)
    units = tied._entropykit_resident.units
    assert [(type(u.module).__name__, u.gathered.tied is not None) for u in units
            if u.gathered is not None] == [("Embedding", True), ("Embedding", False)]
    assert {type(u.module).__name__ for u in units if u.tiled is not None} == {"Linear"}
    odd = _llama_vocab(VOCAB, hidden_size=48, intermediate_size=96)
    ekt.compress_model(odd)
    assert not any(u.gathered is not None for u in odd._entropykit_resident.units)
    half = _llama_vocab(VOCAB).to(torch.float16)
    ekt.compress_model(half)
    assert not any(u.gathered is not None for u in half._entropykit_resident.units)


def test_gathered_chunk_sizes(emulated, monkeypatch) -> None:
    """Chunks of whole rows: at least GATHER_CHUNK symbols, a row if wider."""
    monkeypatch.setattr(_resident, "GATHER_CHUNK", 1 << 14)
    emb = nn.Embedding(8, 4096, dtype=torch.bfloat16)
    assert _resident._gather_chunk(emb, "weight", emb.weight) == 1 << 14
    emb = nn.Embedding(8, 1 << 15, dtype=torch.bfloat16)
    assert _resident._gather_chunk(emb, "weight", emb.weight) == 1 << 15
    emb = nn.Embedding(8, 576, dtype=torch.bfloat16)
    assert _resident._gather_chunk(emb, "weight", emb.weight) is None
    emb = nn.Embedding(8, 64, dtype=torch.bfloat16, max_norm=1.0)
    assert _resident._gather_chunk(emb, "weight", emb.weight) is None


def test_compact_descriptors_expand_to_the_bound_rows(emulated) -> None:
    """A decoder's descriptors kept compact (distinct shared columns, an index a pair,
    the four varying columns) expand to the bound rows bit for bit, into any buffer of
    enough pairs; values beyond int32 keep int64."""
    torch.manual_seed(0)
    weights = [torch.randn(64, 128).to(torch.bfloat16) for _ in range(2)]
    ((group, batch),) = _cuda.plan([_coded.code_tensor(w, 0, 1024) for w in weights])
    for desc in (batch.desc, batch.desc + np.int64(1 << 40) * (
            np.arange(lay.N_COLS) == lay.D_OFF)):
        kinds, index, vary = _cuda.compact(desc)
        assert vary.dtype == (np.int32 if desc is batch.desc else np.int64)
        assert len(kinds) < len(index) == len(desc) // 2
        rows = kinds[index].copy()
        rows[:, :, :4] = vary
        assert np.array_equal(rows.reshape(-1, lay.N_COLS), desc)
    model = _llama_vocab(VOCAB)
    ekt.compress_model(model, granularity="weight")
    d = next(u.decoder for u in model._entropykit_resident.units
             if isinstance(u.decoder, _cuda.CudaDecoder))
    rows = torch.full((d.pairs + 3, 2, lay.N_COLS), -7, dtype=torch.int64)
    d.run(rows)
    kinds, index, vary = d._batches[0][1:4]
    want = kinds[index.long()].clone()
    want[:, :, :4] = vary
    assert torch.equal(rows[: d.pairs], want) and (rows[d.pairs :] == -7).all()


def test_streams_share_descriptor_buffers(emulated) -> None:
    """The CUDA streams' descriptor buffers: one a stream (compute and each side), sized
    once for the largest launch before any forward, counted among the coded bytes; a
    decoder's own buffer (its check run at build) freed after."""
    streams = object.__new__(_cuda.CudaStreams)
    streams.device, streams.sides, streams._rows = torch.device("cpu"), [0, 1], []
    streams.reserve(10)
    assert [r.shape for r in streams._rows] == [(10, 2, lay.N_COLS)] * 3
    first = streams._rows[0]
    streams.reserve(4)
    assert streams._rows[0] is first
    assert streams.nbytes == 3 * 10 * 2 * lay.N_COLS * 8
    model = _llama_vocab(VOCAB)
    ekt.compress_model(model)
    d = next(u.decoder for u in model._entropykit_resident.units
             if isinstance(u.decoder, _cuda.CudaDecoder))
    assert d._own is None and not d._bound  # released after its check
    streams.reserve(d.pairs)  # as the build does, for its largest launch
    before = streams._rows[2].clone()
    d.run(streams.rows(2))
    assert not torch.equal(streams._rows[2], before)
    assert id(streams._rows[2]) in d._bound


def test_bind_rows_launches_over_a_buffers_first_pairs(monkeypatch) -> None:
    """``DeviceBatch.bind_rows`` (the runtime, CuPy stood in for): a launch over the first
    ``pairs`` pairs of any descriptor buffer holding at least that many, with the batch's
    kernel build, a block of ``warps`` pairs per ``warps`` pairs and the buffers' addresses
    in the kernel's order; more pairs than the buffer or the status hold refused."""
    import importlib
    import sys
    import types as _types

    name = "entropykit.rans.cuda._runtime"
    monkeypatch.setitem(sys.modules, "cupy", _types.ModuleType("cupy"))
    monkeypatch.delitem(sys.modules, name, raising=False)
    # the module imported against the stand-in goes with the test
    monkeypatch.delattr(rans_cuda, "_runtime", raising=False)
    _runtime = importlib.import_module(name)
    monkeypatch.setitem(sys.modules, name, _runtime)
    monkeypatch.setattr(rans_cuda, "_runtime", _runtime, raising=False)

    built = []
    monkeypatch.setattr(_runtime, "_kernel", lambda *a: built.append(a) or "kernel")
    torch.manual_seed(0)
    weight = torch.randn(64, 256).to(torch.bfloat16)
    ((group, batch),) = _cuda.plan([_coded.code_tensor(weight, 0, 1024)])
    db = object.__new__(_runtime.DeviceBatch)
    db.batch, db.device = batch, torch.device("cpu")
    db.payload, db.sym_tables, db.info_tables, db.cmaps = (
        torch.zeros(8, dtype=torch.uint8) for _ in range(4))
    rows = torch.zeros((40, 2, lay.N_COLS), dtype=torch.int64)
    status = torch.zeros(60, dtype=torch.int32)
    out = torch.zeros(64 * 256, dtype=torch.bfloat16)
    launch = db.bind_rows(rows, status, out, 17)
    assert launch.pairs == 17 and launch.grid == (-(-17 // batch.warps),)
    assert launch.kernel == "kernel" and built[0][:2] == (True, batch.context)
    assert [int(a) for a in launch.args[:7]] == [
        t.data_ptr() for t in (rows, status, db.payload, db.sym_tables, db.info_tables,
                               db.cmaps, out)]
    assert int(launch.args[7]) == 17
    assert db.bind_rows(rows, status, out, 0).kernel is None  # nothing to launch
    for pairs in (31, 41, -1):
        with pytest.raises(ValueError, match="do not fit"):
            db.bind_rows(rows, status, out, pairs)
    assert db.bind_rows(rows, status, out, 30).pairs == 30


def test_gathered_embedding_of_fields_not_worth_coding(emulated, monkeypatch) -> None:
    """Where no field of the embedding is worth coding, its first field is framed all the
    same, so its chunks are still whole rows: the lookup stays exact."""
    monkeypatch.setattr(_coded, "_entropy_bytes", lambda symbols: float(symbols.size))
    model, ref = _llama_vocab(VOCAB), _llama_vocab(VOCAB)
    ekt.compress_model(model)
    _, u = _gathered(model)
    ids = torch.tensor([[0, 15, 16, 999, 640]])
    with torch.no_grad():
        assert torch.equal(_bits(model.model.embed_tokens(ids)),
                           _bits(ref.model.embed_tokens(ids)))
    coded = [w.coded for v in model._entropykit_resident.units for w in v.weights]
    assert all(not f.coded for c in coded for f in c.fields)  # the others stay plain


def _emulate_expand(rows, kinds, index, vary, chunks, first, chunk, n) -> None:
    """``expand_pairs`` (torch/_cuda.py's kernel) thread by thread in numpy, on the
    kernel's own flat buffers."""
    flat, kinds_f, vary_f = rows.reshape(-1), kinds.reshape(-1), vary.reshape(-1)
    for t in range(n * 2 * lay.N_COLS):
        col, row = t % lay.N_COLS, t // lay.N_COLS
        i = row >> 1
        c = int(chunks[i]) if chunks is not None else first + i
        cell = c * 2 + (row & 1)
        if chunk > 0 and col == lay.D_OUT:
            flat[t] = i * chunk
        elif col < _cuda._VARY:
            flat[t] = vary_f[cell * _cuda._VARY + col]
        else:
            flat[t] = kinds_f[(int(index[c]) * 2 + (row & 1)) * lay.N_COLS + col]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("how", ["all", "chunks", "range"])
def test_expansion_kernel_arithmetic(how, wide) -> None:
    """The expansion kernel's arithmetic (emulated in numpy) writes what ``Expand`` writes
    on the CPU and what the two torch ops it replaces wrote: every pair of a launch
    (``CudaDecoder``), the pairs of the chunks asked for with slot outputs (a lookup), or
    a range of chunks with slot outputs (a tied head's tiles); int32 and int64 varying
    columns; pairs past ``n`` untouched."""
    torch.manual_seed(0)
    weights = [torch.randn(48, 128).to(torch.bfloat16) for _ in range(2)]
    ((group, batch),) = _cuda.plan([_coded.code_tensor(w, 0, 1024, True) for w in weights])
    desc = batch.desc + (np.int64(1 << 40) * (np.arange(lay.N_COLS) == lay.D_OFF)
                         if wide else 0)
    kinds, index, vary = (torch.from_numpy(a) for a in _cuda.compact(desc))
    assert (vary.dtype == torch.int64) == wide
    total = len(index)
    chunks, first, chunk = None, 0, 0
    if how == "chunks":
        chunks = torch.tensor([3, 0, total - 1, 3, 5], dtype=torch.int64)
        n, chunk = len(chunks), 1024
    elif how == "range":
        n, first, chunk = 4, 2, 1024
    else:
        n = total
    sel = chunks if chunks is not None else torch.arange(first, first + n)
    want = torch.full((n + 2, 2, lay.N_COLS), -7, dtype=torch.int64)
    torch.index_select(kinds, 0, index[sel], out=want[:n])  # the torch ops of before
    want[:n, :, :4] = vary[sel]
    if chunk:
        want[:n, :, lay.D_OUT] = torch.arange(n)[:, None] * chunk
    if how == "all":
        assert np.array_equal(want[:n].reshape(-1, lay.N_COLS).numpy(), desc)
    got = torch.full_like(want, -7)
    _cuda.Expand(got, kinds, index, vary, n, chunks, first, chunk)()
    assert torch.equal(got, want)
    emulated = np.full(want.shape, -7, np.int64)
    _emulate_expand(emulated, kinds.numpy(), index.numpy(), vary.numpy(),
                    None if chunks is None else chunks.numpy(), first, chunk, n)
    assert np.array_equal(emulated, want.numpy())


def _tied(hidden: int, vocab: int = VOCAB) -> nn.Module:
    return _llama_vocab(vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                        tie_word_embeddings=True)


@pytest.mark.parametrize("hidden", [64, 48], ids=["whole-rows", "rows-across-chunks"])
@pytest.mark.parametrize("opts", [{}, {"granularity": "weight"},
                                  {"tile_bytes": 1 << 14, "tiles_ahead": 2}],
                         ids=["block", "weight", "small-tiles-ahead"])
def test_tied_lookup_decodes_its_rows_from_the_heads_chunks(emulated, opts, hidden) -> None:
    """A tied embedding (Llama's with ``tie_word_embeddings``) is coded once, in chunks
    that start every head tile: the lookup decodes only the chunks of its ids' rows (two
    a row where rows cross chunks), the head's tile launches ranges of the same chunks
    (no device bytes of their own); lookup, logits and greedy tokens are the plain
    model's bit for bit, memory counts the weight once, and decompress_model gives one
    weight back to both modules."""
    model, ref = _tied(hidden), _tied(hidden)
    ekt.compress_model(model, **opts)
    state, u = _gathered(model)
    g = u.gathered
    span = 1 if hidden == 64 else 2
    assert g.tied is not None and g.span == span and g.chunk == 1024
    heads = [v for v in state.units if v.tiled is g.tied]
    assert {v.module for v in heads} == {model.lm_head} and len(heads) == len(g.tied.rows)
    assert all(a * hidden % g.chunk == 0 for a, _ in g.tied.rows)
    ranges = {id(v.decoder): v.decoder for v in heads}
    assert all(d.nbytes == 0 for d in ranges.values())
    covered = sorted(c for d in ranges.values() for first, _, n in d._spans
                     for c in range(first, first + n))
    assert covered == list(range(-(-VOCAB * hidden // g.chunk)))  # each chunk once
    ids = torch.tensor([EDGES[:7], EDGES[7:]])
    with torch.no_grad():
        state.scratch.fill_(0xFF)
        got = model.model.embed_tokens(ids)
        step = g.slots // span  # ids a launch; the last launch's chunks:
        assert u.decoder.count == span * (ids.numel() - (ids.numel() - 1) // step * step)
        assert torch.equal(_bits(got), _bits(ref.model.embed_tokens(ids)))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))
    mem = ekt.resident_memory(model)
    untied = _llama_vocab(VOCAB, hidden_size=hidden, intermediate_size=2 * hidden)
    ekt.compress_model(untied, **opts)
    head = VOCAB * hidden * 2
    assert mem.uncompressed_bytes == ekt.resident_memory(untied).uncompressed_bytes - head
    assert mem.tensors == ekt.resident_memory(untied).tensors - 1
    ekt.decompress_model(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.lm_head.weight, nn.Parameter)
    assert torch.equal(_bits(model.lm_head.weight), _bits(ref.lm_head.weight))
    assert torch.equal(_logits(model, ids), _logits(ref, ids))


def test_tied_lookup_needs_chunks_at_tile_starts(emulated, monkeypatch) -> None:
    """Where no chunk of at least the smallest size starts every head tile, the tied
    weight keeps tiles for the lookup too (decoded whole, as before)."""
    monkeypatch.setattr(_resident, "SMALLEST_CHUNK", 1024)
    monkeypatch.setattr(_resident, "GATHER_CHUNK", 1 << 14)
    model, ref = _tied(40), _tied(40)  # tiles of 8 rows: 320 symbols, chunks of 64
    ekt.compress_model(model, tile_bytes=8 * 40 * 2)
    state = model._entropykit_resident
    assert not any(u.gathered is not None for u in state.units)
    assert {u.module for u in state.units if u.tiled is not None} == {
        model.lm_head, model.model.embed_tokens}
    ids = torch.tensor([[0, 999, 17]])
    with torch.no_grad():  # (narrow tiles' products round differently on the CPU)
        assert torch.equal(_bits(model.model.embed_tokens(ids)),
                           _bits(ref.model.embed_tokens(ids)))
