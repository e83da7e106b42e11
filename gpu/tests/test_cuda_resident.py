"""Resident mode on the device (resident_check.py's checks).

What it is: with tiny random Llamas built on the GPU, in bf16 and with fp8 e4m3 weights
and per-row scales in the blocks: ``entropykit.torch.compress_model`` gives the plain
model's logits and greedy tokens bit for bit (whole blocks, in a ring of two or three
slots, each Linear whole before its own forward, and blocks in row tiles),
also after the scratch buffer is poisoned with NaN, and ``decompress_model`` gives every
weight back; a step captured in a CUDA graph and replayed on new inputs, the buffer
poisoned between replays, gives the plain model's logits; an embedding decoding only
the rows its ids read does so inside a captured graph, on new ids, and a tied one from the
chunks its head decodes; the same with tiles decoded
several to a launch in small chunks, and for each option set of a small sweep; the
memory accounting adds up to the device memory the weights take; a model built on the
GPU computes its rotary frequencies as one built on the CPU does; at Llama-8B's head
shape the head's tiles are checked against the whole product (retiled or kept plain
where they differ) and the logits are exact at batch 1 and 64, and a product injected
to differ by tile width keeps the head plain.
What it is not: the timings (resident_check.py prints them).
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.cuda
pytest.importorskip("transformers")

import resident_check as rc  # noqa: E402 - needs transformers

import entropykit.torch as ekt  # noqa: E402
from entropykit.torch import _resident  # noqa: E402
from entropykit.torch._cuda import GatherDecoder  # noqa: E402

DEV = "cuda:0"


OPTS = pytest.mark.parametrize("tile_bytes", rc.TINY_OPTS, ids=rc.TINY_IDS)


@OPTS
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_logits_tokens_and_restore_exact(fp8, tile_bytes):
    assert rc.exact_failures(lambda: rc.llama("tiny", DEV, fp8), DEV, tile_bytes) == []


@OPTS
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cuda_graph_replay_exact(fp8, tile_bytes):
    fails, how = rc.graph_failures(lambda: rc.llama("tiny", DEV, fp8), DEV,
                                   tile_bytes=tile_bytes)
    assert fails == [], how


@pytest.mark.parametrize("opts", [{}, rc.WEIGHT, rc.WEIGHT_AHEAD],
                         ids=["blocks", "weights", "weights-ahead-3"])
def test_memory_is_what_the_device_holds(opts):
    gc.collect()  # earlier tests' models (a resident model and its state form a cycle)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated(DEV)
    model = rc.llama("tiny", DEV)
    plain = torch.cuda.memory_allocated(DEV) - start
    tensors = len(list(model.parameters())) + len(list(model.buffers()))
    ekt.compress_model(model, **opts)
    mem = ekt.resident_memory(model)
    now = torch.cuda.memory_allocated(DEV) - start
    state = model._entropykit_resident
    decoders = {id(u.decoder): u.decoder for u in state.units}
    # and the scratch buffer, and a descriptor buffer a stream
    held = sum(len(d.held) for d in decoders.values()) + 1 + len(state.streams._rows)
    # the caching allocator rounds each tensor up to a multiple of 512 bytes
    assert 0 <= plain - (mem.plain_bytes + mem.uncompressed_bytes) < 512 * tensors
    want = mem.plain_bytes + mem.coded_bytes + mem.scratch_bytes
    assert 0 <= now - want < 512 * (tensors + held)
    assert mem.coded_bytes < mem.uncompressed_bytes


def test_compress_from_the_cpu_onto_the_device():
    """``device=``: a model on the CPU made resident on the GPU equals the plain model
    moved there, and the device never held its plain weights."""
    plain = rc.llama("tiny", "cpu").to(DEV)  # the same weights (built by the CPU's RNG)
    model = rc.llama("tiny", "cpu")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(DEV)
    base = torch.cuda.memory_allocated(DEV)
    ekt.compress_model(model, device=DEV)
    mem = ekt.resident_memory(model)
    peak = torch.cuda.max_memory_allocated(DEV) - base
    assert peak < mem.coded_bytes + mem.scratch_bytes + mem.plain_bytes + (8 << 20)
    assert all(p.device == torch.device(DEV) for p in model.parameters())
    ids = rc._ids(plain.config.vocab_size, 3, 17, DEV, 0)
    with torch.no_grad():
        assert torch.equal(rc._bits(model(ids).logits), rc._bits(plain(ids).logits))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sweep_rows_exact(fp8, capsys):
    """The sweep's option sets (chunk sizes x tiles x tiles ahead, and weights one and
    two launches ahead) each give the plain
    model's logits, eager and graph-replayed with poisoned scratch, and print a row."""
    grid = rc.sweep_grid([1 << 16, 1 << 10], [None, rc.SMALL_TILES], [1, 4], 1 << 26,
                         ("block", "weight"), (1, 2))
    assert len(grid) == 10
    assert rc.sweep("tiny", fp8, DEV, grid) == []
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("tiny")]
    assert len(rows) == 1 + len(grid) and all("| yes " in r for r in rows[1:])


def test_launches_of_tiles_hold_what_they_plan():
    """Launches of several tiles in small chunks: one decoder (one kernel launch) per
    launch of tiles, the accounting its buffers, the scratch two of the largest
    launches."""
    model = rc.llama("tiny", DEV)
    ekt.compress_model(model, **rc.AHEAD)
    state = model._entropykit_resident
    decoders = {id(u.decoder): u.decoder for u in state.units}.values()
    assert len(decoders) == len(state.leads) < len(state.units)
    mem = ekt.resident_memory(model)
    assert mem.coded_bytes == sum(d.nbytes for d in decoders) + state.streams.nbytes
    assert len(state.streams._rows) == 2  # the compute stream's and the side stream's
    assert mem.scratch_bytes == 2 * max(state.units[g].place.numel() for g in state.leads)
    # bf16 only: one kernel mode (an embedding's row lookup binds a launch per input size)
    assert all(len(d.launches) == 1 for d in decoders if not isinstance(d, GatherDecoder))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_weight_ring_is_two_consecutive_launches(fp8):
    """Weight granularity on the device: the launches take a ring of bytes as large as
    the two largest consecutive ones, each placed apart from the one before it and each
    but the first prefetched on one of two side streams; the head in row tiles of the
    largest Linear's bytes; the decode step's logits the plain model's at batch 1 and
    64, also graph-replayed with the ring poisoned."""
    plain, model = rc.llama("tiny", DEV, fp8), rc.llama("tiny", DEV, fp8)
    ekt.compress_model(model, **rc.WEIGHT)
    state = model._entropykit_resident
    sizes = [state.units[g].place.numel() for g in state.leads]
    assert ekt.resident_memory(model).scratch_bytes == max(
        [a + b for a, b in zip(sizes, sizes[1:], strict=False)] + sizes)
    leads = [state.units[g] for g in state.leads]
    assert all(a.place.data_ptr() + a.place.numel() <= b.place.data_ptr()
               or b.place.data_ptr() + b.place.numel() <= a.place.data_ptr()
               for a, b in zip(leads, leads[1:], strict=False))
    assert all(u.prefetch for u in leads[1:] if u.gathered is None)
    assert len(state.streams.sides) == 2
    with torch.no_grad():
        for batch in (1, 64):
            ids = rc._ids(plain.config.vocab_size, batch, 1, DEV, batch)
            want = rc._bits(rc._full_step(plain, ids))
            assert torch.equal(rc._bits(rc._full_step(model, ids)), want)
            _, out = rc._graph_ms(model, ids, DEV, poison=True)
            _, want_graph = rc._graph_ms(plain, ids, DEV, poison=False)
            assert torch.equal(rc._bits(out), rc._bits(want_graph))


EDGES = [0, 127, 128, 129, 4095, 3968, 3967, 128, 128, 0, 2047, 2048]


@pytest.mark.parametrize("opts", [{}, rc.WEIGHT,
                                  dict(granularity="weight", tile_bytes=1 << 15)],
                         ids=["blocks", "weights", "one-chunk-a-launch"])
def test_gathered_embedding_in_a_cuda_graph(opts):
    """The tiny Llama's embedding (4096 rows of 128) decodes only the chunks (128 rows
    each) of the rows its ids read: a lookup captured in a CUDA graph and replayed on
    new ids (chunk edges, repeats, first and last rows, random), the scratch poisoned
    with NaN before each replay, gives the plain lookup bit for bit, as does the whole
    decode step; with one chunk a launch, twelve launches in the graph."""
    plain, model = rc.llama("tiny", DEV), rc.llama("tiny", DEV)
    ekt.compress_model(model, **opts)
    state = model._entropykit_resident
    (u,) = [u for u in state.units if u.gathered is not None]
    g = u.gathered
    assert (g.rows_per_chunk, g.chunks) == (128, 32)
    # a tile's bytes of chunks: a block's (288 KiB), an MLP Linear's (64 KiB), 32 KiB
    assert g.slots == (1 if "tile_bytes" in opts else 2 if opts else 9)
    emb, ref = model.model.embed_tokens, plain.model.embed_tokens
    static = torch.tensor(EDGES, device=DEV).view(3, 4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture (the launch per count)
            emb(static)
            state.end()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = emb(static)
            state.end()
        for k in range(4):
            ids = (torch.tensor(EDGES) if k == 0
                   else torch.randint(0, 4096, (12,), generator=gen))
            static.copy_(ids.view(3, 4).to(DEV))
            state.scratch.view(torch.bfloat16).fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(rc._bits(out), rc._bits(ref(static)))
        for batch in (1, 64):
            ids = rc._ids(plain.config.vocab_size, batch, 1, DEV, batch)
            _, got = rc._graph_ms(model, ids, DEV, poison=True)
            _, want = rc._graph_ms(plain, ids, DEV, poison=False)
            assert torch.equal(rc._bits(got), rc._bits(want))


def test_gathered_embedding_decodes_only_its_chunks():
    """A lookup of 5 ids decodes 5 chunks: the decoder's status and descriptors name
    those, and the rest of its place keeps what was there (poison)."""
    model = rc.llama("tiny", DEV)
    ekt.compress_model(model)
    state = model._entropykit_resident
    (u,) = [u for u in state.units if u.gathered is not None]
    ids = torch.tensor([[5, 4095, 5, 130, 0]], device=DEV)
    with torch.no_grad():
        state.scratch.view(torch.bfloat16).fill_(float("nan"))
        model.model.embed_tokens(ids)
        state.end()
        torch.cuda.synchronize()
    u.decoder.check()
    assert u.decoder.count == 5
    chunk = u.gathered.chunk
    decoded = u.decoder.out[: 5 * chunk]
    assert not decoded.isnan().any()
    assert u.decoder.out[5 * chunk :].isnan().all()


TIED_OPTS = pytest.mark.parametrize("opts", [None, rc.WEIGHT, rc.AHEAD],
                                   ids=["blocks", "weights", "tiles-ahead"])


def _tied():
    return rc.llama("tiny-tied", DEV)


@TIED_OPTS
def test_tied_lookup_exact_and_in_a_cuda_graph(opts):
    """A tied embedding (rows of 96 crossing chunks) gathers its lookup's rows from the
    chunks its head's tiles decode: logits and greedy tokens exact, with the scratch
    poisoned, decompress_model giving one weight back; a captured step replayed on new
    inputs exact."""
    model = _tied()
    ekt.compress_model(model, **rc._opts(opts))
    (u,) = [u for u in model._entropykit_resident.units if u.gathered is not None]
    assert u.gathered.tied is not None and u.gathered.span == 2
    del model
    assert rc.exact_failures(_tied, DEV, opts) == []
    fails, how = rc.graph_failures(_tied, DEV, tile_bytes=opts)
    assert fails == [], how


def test_tied_lookup_decodes_two_chunks_an_id():
    """A lookup of 3 ids decodes 6 chunks (a row's two) and nothing else of its place."""
    model = _tied()
    ekt.compress_model(model)
    state = model._entropykit_resident
    (u,) = [u for u in state.units if u.gathered is not None]
    ids = torch.tensor([[5, 4095, 2000]], device=DEV)
    with torch.no_grad():
        state.scratch.view(torch.bfloat16).fill_(float("nan"))
        got = model.model.embed_tokens(ids)
        state.end()
        torch.cuda.synchronize()
    u.decoder.check()
    assert u.decoder.count == 6
    chunk = u.gathered.chunk
    assert not u.decoder.out[: 6 * chunk].isnan().any()
    assert u.decoder.out[6 * chunk :].isnan().all()
    ekt.decompress_model(model)
    assert torch.equal(rc._bits(got), rc._bits(model.model.embed_tokens(ids)))


def test_expansion_kernel_is_the_cpu_expansion():
    """The expansion kernel writes what the CPU's torch ops write: every pair, chunks
    asked for with slot outputs, a range of chunks; int32 and int64 varying columns."""
    import numpy as np

    from entropykit.rans.cuda._layout import N_COLS
    from entropykit.torch import _cuda

    gen = np.random.default_rng(0)
    for wide in (False, True):
        kinds = torch.from_numpy(gen.integers(-5, 1 << 20, (7, 2, N_COLS)))
        index = torch.from_numpy(gen.integers(0, 7, 50).astype(np.int32))
        vary = torch.from_numpy(gen.integers(0, 1 << 30, (50, 2, 4)))
        vary = vary + (1 << 40) if wide else vary.to(torch.int32)
        chunks = torch.tensor([3, 49, 0, 3, 17])
        for args in ((50,), (5, chunks, 0, 1024), (9, None, 30, 4096)):
            want = torch.full((52, 2, N_COLS), -7, dtype=torch.int64)
            _cuda.Expand(want, kinds, index, vary, *args)()
            got = want.new_full(want.shape, -7).to(DEV)
            dev = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
            with torch.cuda.stream(torch.cuda.Stream()):  # on a stream by its handle
                _cuda.Expand(got, kinds.to(DEV), index.to(DEV), vary.to(DEV), *dev)()
            torch.cuda.synchronize()
            assert torch.equal(got.cpu(), want), (wide, args[0])


def test_forward_on_another_stream_exact():
    """A forward on a stream of the caller's (not the default one) orders the decodes
    with it, by block and by weight, after steps on the default stream: exact."""
    plain = _tied()
    ids = rc._ids(plain.config.vocab_size, 2, 3, DEV, 0)
    with torch.no_grad():
        want = rc._bits(rc._full_step(plain, ids))
        for opts in ({}, rc.WEIGHT):
            model = ekt.compress_model(rc._sharing(plain), **opts)
            assert torch.equal(rc._bits(rc._full_step(model, ids)), want)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                model._entropykit_resident.scratch.view(torch.bfloat16).fill_(float("nan"))
                got = rc._bits(rc._full_step(model, ids))
            torch.cuda.current_stream().wait_stream(s)
            assert torch.equal(got, want)
            assert torch.equal(rc._bits(rc._full_step(model, ids)), want)


def test_computed_buffers_are_the_cpu_ones():
    """A model built on the GPU holds the rotary frequencies of the same model built on
    the CPU (where DFloat11's loader and ``from_pretrained`` build one) bit for bit, with
    Llama-8B's head size, whose float32 frequencies the GPU rounds otherwise."""
    import transformers

    compat = rc._df11_compat()
    model = rc.llama("8b-blocks", DEV, layers=1)
    with compat.find_no_init_weights()(), torch.device("cpu"):
        ref = transformers.AutoModelForCausalLM.from_config(model.config, dtype=torch.bfloat16)
    assert compat.computed_mismatches(model, ref) == []
    assert sorted(compat.computed_buffers(model)) == [
        "model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
    del model
    gc.collect()
    torch.cuda.empty_cache()


class _GapBlock(torch.nn.Module):
    """bf16 Linears around an fp8 one with its bf16 scale, sizes not multiples of 512
    bytes: its launch decodes runs of two dtypes across alignment gaps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(60, 100, bias=False, dtype=torch.bfloat16)
        self.b = torch.nn.Linear(100, 60, bias=False, dtype=torch.bfloat16)
        self.c = rc.Fp8Linear(torch.nn.Linear(60, 70, bias=False, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))[..., :60]


class _Gaps(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with torch.device(DEV):
            self.blocks = torch.nn.ModuleList(_GapBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def test_runs_across_gaps_and_dtypes_in_a_cuda_graph():
    """Runs of weights across alignment gaps and of two dtypes (two kernel modes a
    launch) decode on the device to the plain outputs, eager and in a captured graph
    replayed on new inputs with the scratch poisoned between replays."""
    plain, model = _Gaps(), _Gaps()
    ekt.compress_model(model, min_elements=1)
    state = model._entropykit_resident
    assert len(state.leads) == 3
    assert all(len(state.units[g].decoder.launches) == 2 for g in state.leads)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 60, generator=gen).to(DEV, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(rc._bits(model(x)), rc._bits(plain(x)))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(x)
        for _ in range(3):
            x.copy_(torch.randn(4, 60, generator=gen).to(DEV, torch.bfloat16))
            state.scratch.fill_(0xFF)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(rc._bits(out), rc._bits(plain(x)))


@pytest.mark.parametrize("opts", [{}, rc.WEIGHT], ids=["blocks", "weights"])
def test_host_account_is_what_the_device_holds(opts):
    """``account``'s device bytes, computed on the host, are the resident model's coded
    and scratch bytes on the device (tied embedding: lookup and head tiles included)."""
    acc = rc.account(rc.llama("tiny-tied", "cpu"), dict(opts))
    model = rc.llama("tiny-tied", "cpu")
    ekt.compress_model(model, device=DEV, **opts)
    mem = ekt.resident_memory(model)
    check = model._entropykit_resident.tile_check
    if check.retiled or check.kept_plain:  # the account cuts tiles as before the check
        pytest.skip("the device's check changed the head's tiles: "
                    + rc.tile_check_line(model._entropykit_resident))
    assert acc["total"] == mem.coded_bytes + mem.scratch_bytes
    assert acc["parts"]["stream descriptor buffers"] == (
        model._entropykit_resident.streams.nbytes)


@pytest.mark.parametrize("opts", [dict(ahead=0), dict(granularity="weight", ahead=0)],
                         ids=["blocks", "weights"])
@pytest.mark.parametrize("size", ["tiny", "tiny-tied"])
def test_nothing_ahead_exact_in_a_cuda_graph(size, opts):
    """``ahead=0`` (no side stream, a buffer of the largest launch): logits and tokens
    exact, also with the scratch poisoned and in a replayed CUDA graph."""
    make = lambda: rc.llama(size, DEV)  # noqa: E731
    assert rc.exact_failures(make, DEV, opts) == []
    fails, how = rc.graph_failures(make, DEV, tile_bytes=opts)
    assert fails == [], how
    model = make()
    ekt.compress_model(model, **opts)
    state = model._entropykit_resident
    assert state.streams.sides == [] and len(state.streams._rows) == 1
    assert ekt.resident_memory(model).scratch_bytes == max(
        state.units[g].place.numel() for g in state.leads)


@pytest.mark.parametrize("granularity", ["block", "weight"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_llama_8b_head_tiles_exact(fp8, granularity, capsys):
    """Llama-8B's embedding and head (128256 x 4096 bf16) over two of its blocks (fp8:
    head tiles of an fp8 MLP weight's bytes by weight, 7168 rows): every tiled Linear's
    final tiles compute the whole product's bits at the checked batches, and the
    decode-step logits are the plain model's at batch 1 and 64, eager and in a replayed
    CUDA graph with the scratch poisoned."""
    plain = rc.llama("8b-blocks", DEV, fp8, layers=2)
    model = rc._sharing(plain)
    ekt.compress_model(model, granularity=granularity)
    state = model._entropykit_resident
    with capsys.disabled():
        print(f"\n{'fp8' if fp8 else 'bf16'} {granularity}: {rc.tile_check_line(state)}")
    assert state.tile_check.checked >= 1
    with torch.no_grad():
        for t in state.tiled:  # the head's (its plain weight shared with the plain model)
            if model.lm_head in t.owners:
                assert _resident._tiles_exact(plain.lm_head.weight.detach(), [None], t.rows)
        for batch in (1, 64):
            ids = rc._ids(plain.config.vocab_size, batch, 1, DEV, 1)
            want = rc._bits(rc._full_step(plain, ids))
            assert torch.equal(rc._bits(rc._full_step(model, ids)), want), batch
            _, out = rc._graph_ms(model, ids, DEV, poison=True)
            _, graph = rc._graph_ms(plain, ids, DEV, poison=False)
            assert torch.equal(rc._bits(out), rc._bits(graph)), batch
    del model, state
    gc.collect()


def test_a_product_differing_by_tile_width_keeps_the_head_plain(monkeypatch):
    """A product that sums narrower outputs another way (injected): the head stays a
    plain parameter, with a warning, and the logits are the plain model's."""
    real = torch.nn.functional.linear

    def linear(x, w, bias=None):
        if w.shape[0] >= 4096:  # tiny's vocabulary: only the whole head is exact
            return real(x, w, bias)
        k = w.shape[1] // 2
        out = real(x[..., :k], w[:, :k]) + real(x[..., k:], w[:, k:])
        return out if bias is None else out + bias

    monkeypatch.setattr(torch.nn.functional, "linear", linear)
    plain, model = rc.llama("tiny", DEV), rc.llama("tiny", DEV)
    with pytest.warns(RuntimeWarning, match="lm_head.weight stays plain"):
        ekt.compress_model(model)
    state = model._entropykit_resident
    assert state.tile_check.kept_plain == ["lm_head.weight"]
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
    ids = rc._ids(plain.config.vocab_size, 1, 1, DEV, 0)
    with torch.no_grad():
        assert torch.equal(rc._bits(model(ids).logits), rc._bits(plain(ids).logits))
