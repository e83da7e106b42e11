"""The static-table KV offload path on the device.

What it is: the GPU encoder (``rans.cuda.encode``) writes the CPU encoder's frames byte
for byte (contexts, raw chunks, short last chunks) and a layer coded on the device is the
host's one-table layer; a layer coded with static tables (``predictive.static_kv``)
decodes on the GPU in one launch of the weight decoder's kernel to exactly its keys and
values (classed and one-table exponents, keys and values of different shapes), also when
coded on the device straight into the decoder's buffers; a damaged
payload raises ``CorruptDataError`` at the check; ``generate`` through
``transformers.Cache( offloading=True)`` of static-coded ``PredictiveOffloadedLayer``s
gives the tokens and logits of a ``DynamicCache``; its decode steps keep a GPU-resident
cache's keys and values, checked in every update by default (a damaged layer raises in
the update that would return it) and with no host synchronisation with deferred checks;
gpu/kv_offload_bench.py's smoke run finds identical tokens.
What it is not: the benchmark's numbers (run gpu/kv_offload_bench.py with its defaults).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.cuda
transformers = pytest.importorskip("transformers")

import kv_hook_check as kh  # noqa: E402 - needs transformers
import kv_offload_bench  # noqa: E402

from entropykit import CorruptDataError  # noqa: E402
from entropykit.predictive import static_kv  # noqa: E402
from entropykit.predictive.hook import KVOffloadCodec, PredictiveOffloadedLayer  # noqa: E402


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous().cpu()
    if t.element_size() == 1:
        return t.view(torch.uint8).numpy()
    return t.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("scale", [1.0, "channels"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_gpu_layer_decodes_exactly(scale, dtype):
    gen = torch.Generator().manual_seed(2)
    s = torch.logspace(-3, 2, 64) if scale == "channels" else 1.0
    k = (torch.randn(2, 4, 3000, 64, generator=gen) * s).to(dtype)
    v = torch.randn(2, 2, 3000, 32, generator=gen).to(dtype)
    name = str(dtype).removeprefix("torch.")
    layer = static_kv.encode(_bits(k), _bits(v), 1 << 12, dtype=name)
    if dtype == torch.bfloat16:
        assert layer.classes[0] == (scale == "channels")
    g = static_kv.GpuLayer(layer)
    assert g.payload.is_pinned()
    keys, values, check = g.start(kh.DEV)
    check()
    assert keys.dtype == values.dtype == dtype
    assert np.array_equal(_bits(keys), _bits(k)) and np.array_equal(_bits(values), _bits(v))
    on_device = static_kv.encode_on_device(k.to(kh.DEV), v.to(kh.DEV), 1 << 12)
    assert on_device == static_kv.encode(_bits(k), _bits(v), 1 << 12, classes=False,
                                         dtype=name)


@pytest.mark.parametrize("n, chunk, with_context", [(1 << 20, 1 << 14, False),
                                                    (300_017, 1 << 12, True),
                                                    (5000, 1024, True)])
def test_gpu_encoder_writes_the_cpu_frame(n, chunk, with_context):
    from entropykit.rans import static as rans_static
    from entropykit.rans.cuda import encode as gpu_encode

    rng = np.random.default_rng(n)
    sym = np.minimum(rng.geometric(0.2, n) - 1, 255).astype(np.uint8)
    sym[: n // 10] = rng.integers(0, 256, n // 10)  # uniform bytes: the first chunks raw
    ctx = None
    if with_context:
        ctx = rng.integers(0, 6, n).astype(np.uint8)
        sym = (sym + 40 * ctx).astype(np.uint8)
    want = rans_static.encode(sym, chunk_size=chunk, context=ctx)
    got = gpu_encode.encode(torch.from_numpy(sym).to(kh.DEV), chunk_size=chunk,
                            context=None if ctx is None else torch.from_numpy(ctx).to(kh.DEV))
    assert got == want


def test_layer_coded_on_the_device_is_the_hosts():
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(2, 4, 2000, 64, generator=gen) * torch.logspace(-2, 1, 64)).bfloat16()
    v = torch.randn(2, 4, 2000, 64, generator=gen).bfloat16()
    want = static_kv.encode(_bits(k), _bits(v), classes=False)
    got = static_kv.encode_on_device(k.to(kh.DEV), v.to(kh.DEV))
    assert got == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e5m2])
def test_layer_coded_into_the_decoders_buffers_is_the_hosts_gpu_layer(dtype):
    """``encode_gpu_layer`` (payloads gathered on the device into the batch's buffer,
    queued to pinned memory) packs ``GpuLayer(encode_on_device(...))``'s bytes exactly,
    and decodes to the layer."""
    gen = torch.Generator().manual_seed(8)
    k = (torch.randn(2, 4, 3000, 64, generator=gen) * torch.logspace(-2, 1, 64)).to(dtype)
    v = torch.randn(2, 2, 3000, 32, generator=gen).to(dtype)
    kd, vd = k.to(kh.DEV), v.to(kh.DEV)
    want = static_kv.GpuLayer(static_kv.encode_on_device(kd, vd, 1 << 12))
    got = static_kv.encode_gpu_layer(kd, vd, 1 << 12)
    torch.cuda.synchronize()
    assert got.packed.is_pinned() and torch.equal(got.packed, want.packed)
    keys, values, check = got.start(kh.DEV)
    check()
    assert np.array_equal(_bits(keys), _bits(k)) and np.array_equal(_bits(values), _bits(v))


def test_gpu_layer_damaged_payload_raises_at_check():
    k = torch.randn(1, 2, 4096, 64, generator=torch.Generator().manual_seed(3))
    g = static_kv.GpuLayer(static_kv.encode(_bits(k.bfloat16()), _bits(k.bfloat16()), 1 << 12))
    from entropykit.rans.cuda import _layout as lay

    d = g.batch.desc
    row = np.flatnonzero((d[:, lay.D_MODE] == 0) & (d[:, lay.D_N] > 0))[0]  # a coded chunk
    g.payload[int(d[row, lay.D_OFF]) + 130] ^= 0x10  # its first word after the states
    *_, check = g.start(kh.DEV)
    with pytest.raises(CorruptDataError, match="chunk"):
        check()


def test_generate_through_static_offloading_is_unchanged():
    model = kh.tiny_model()
    prompt = torch.randint(0, 512, (2, 300), generator=torch.Generator().manual_seed(4))
    prompt = prompt.to(kh.DEV)
    layers = model.config.num_hidden_layers

    def generate(cache):
        return model.generate(prompt, max_new_tokens=8, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, past_key_values=cache)

    ref = generate(transformers.DynamicCache())
    codec = KVOffloadCodec(coder="gpu")
    codec.set_prompt(prompt)
    cache = transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i)
                                       for i in range(layers)], offloading=True)
    out = generate(cache)
    assert torch.equal(out.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))
    assert all(isinstance(layer._frame, static_kv.GpuLayer) for layer in cache.layers)


def test_offload_bench_smoke_run_is_identical():
    assert kv_offload_bench.main(["--layers", "2", "--prompt", "1024", "--batch", "1",
                                  "--new-tokens", "4", "--reps", "1"]) == 0


def _offloaded_cache(layers: int, prompt: list, check: str) -> transformers.Cache:
    """``transformers.Cache(offloading=True)`` of static-coded layers after a prefill of
    ``prompt`` (one (keys, values) a layer)."""
    codec = KVOffloadCodec(coder="gpu", method="static", check=check)
    codec.set_prompt(torch.zeros(prompt[0][0].shape[0], prompt[0][0].shape[2],
                                 dtype=torch.long))
    cache = transformers.Cache(layers=[PredictiveOffloadedLayer(codec, i)
                                       for i in range(layers)], offloading=True)
    for i, (k, v) in enumerate(prompt):
        cache.update(k, v, i)
    torch.cuda.synchronize()
    return cache


def _step_through(layers: int, prompt: list, steps: list, check: str | None) -> list:
    """Every layer's (keys, values) as ``update`` returns them at each decode step, after
    a prefill of ``prompt``: a GPU-resident cache's (``check`` None), else offloaded with
    that check mode; the deferred mode's steps run under torch's sync debug mode (a host
    synchronisation raises), the default mode's returns checked tensors from every
    update."""
    offloaded = check is not None
    if offloaded:
        cache = _offloaded_cache(layers, prompt, check)
    else:
        cache = transformers.Cache(layers=[transformers.cache_utils.DynamicLayer()
                                           for _ in range(layers)])
        for i, (k, v) in enumerate(prompt):
            cache.update(k, v, i)
        torch.cuda.synchronize()
    outs = []
    if check == "deferred":
        torch.cuda.set_sync_debug_mode("error")
    try:
        for step in steps:
            for i, (k, v) in enumerate(step):
                outs.append(tuple(t.clone() for t in cache.update(k, v, i)))
                if check == "before_use":
                    assert cache.layers[i]._checks == []  # checked before it returned
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    if offloaded:
        for layer in cache.layers:
            assert isinstance(layer._frame, static_kv.GpuLayer)
            assert all(b.is_pinned() for b in layer._bufs) and layer._frame.packed.is_pinned()
            layer.prefetch()
            layer.keys  # noqa: B018 - every decode's check passes
    return outs


def _step_states(layers: int, steps: int) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(6)
    scale = torch.logspace(-2, 1, 64)

    def states(tokens):
        return ((torch.randn(2, 4, tokens, 64, generator=gen) * scale).bfloat16().to(kh.DEV),
                torch.randn(2, 4, tokens, 64, generator=gen).bfloat16().to(kh.DEV))

    return ([states(3000) for _ in range(layers)],
            [[states(1) for _ in range(layers)] for _ in range(steps)])


def _assert_same(got: list, ref: list) -> None:
    assert len(got) == len(ref)
    for (gk, gv), (rk, rv) in zip(got, ref, strict=True):
        assert torch.equal(gk.view(torch.int16), rk.view(torch.int16))
        assert torch.equal(gv.view(torch.int16), rv.view(torch.int16))


@pytest.mark.parametrize("check", ["deferred", "before_use"])
def test_offloaded_steps_are_exact_and_repeatable(check):
    """Decode steps through ``transformers.Cache(offloading=True)`` of static-coded
    layers, after the prompt's encode, give the keys and values of a cache kept on the
    GPU, the same on a repeat. With ``check="deferred"`` they queue everything without
    one host synchronisation (no ``.item()``, ``.cpu()``, pageable copy or stream sync:
    torch's sync debug mode raises on any); in the default mode every update returns
    keys and values already checked."""
    layers = 3
    prompt, steps = _step_states(layers, 20)
    ref = _step_through(layers, prompt, steps, None)
    for _ in range(2):
        _assert_same(_step_through(layers, prompt, steps, check), ref)


def test_default_mode_raises_in_the_update_that_would_use_a_damaged_layer():
    """A layer whose coded bytes are damaged after the prefill raises
    ``CorruptDataError`` in the update that would return its keys and values; the layer
    before it steps normally."""
    from entropykit.rans.cuda import _layout as lay

    layers = 2
    prompt, steps = _step_states(layers, 1)
    cache = _offloaded_cache(layers, prompt, "before_use")
    g = cache.layers[1]._frame
    d = g.batch.desc
    row = np.flatnonzero((d[:, lay.D_MODE] == 0) & (d[:, lay.D_N] > 0))[0]  # a coded chunk
    g.payload[int(d[row, lay.D_OFF]) + 130] ^= 0x10  # its first word after the states
    cache.update(*steps[0][0], 0)
    with pytest.raises(CorruptDataError, match="chunk"):
        cache.update(*steps[0][1], 1)
