"""The offload hook's decode step on the CPU: the tail's reused host buffers, the order in
which a prefetch's check runs (by default inside the update that returns the keys and
values; deferred: never waiting inside the cache's own update and offload),
exact keys and values through many steps (static tables, the CPU coder), and the "auto"
method's static tables for the dtypes the per-value coder does not take."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.coding import frame
from entropykit.predictive import static_kv
from entropykit.predictive.hook import KVOffloadCodec, PredictiveOffloadedLayer

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicLayer  # noqa: E402

PROMPT = 40


def _states(gen: torch.Generator, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(2, 3, tokens, 16, generator=gen).bfloat16(),
            torch.randn(2, 3, tokens, 8, generator=gen).bfloat16())


def _offloaded(gen: torch.Generator, **kw) -> tuple[PredictiveOffloadedLayer, DynamicLayer]:
    """A layer that holds a coded prompt (static tables, CPU coder; ``kw`` to the codec),
    and a plain twin."""
    codec = KVOffloadCodec(chunk_size=frame.MIN_CHUNK, **kw)
    codec.set_prompt(torch.zeros(2, PROMPT, dtype=torch.long))
    layer, ref = PredictiveOffloadedLayer(codec, 0), DynamicLayer()
    k, v = _states(gen, PROMPT)
    layer.update(k, v)
    ref.update(k, v)
    layer.offload()
    assert layer.offloaded
    return layer, ref


def test_tail_lives_in_reused_buffers_of_its_own_and_steps_stay_exact():
    """Each offload copies the generated tokens' keys and values into the layer's own
    host buffers (16 tokens at first, then doubled), not views of the whole layer: the
    decoded prompt part is freed. Every step's keys and values are the plain layer's."""
    gen = torch.Generator().manual_seed(1)
    layer, ref = _offloaded(gen)
    ptrs = []
    for step in range(20):
        layer.prefetch()
        k, v = _states(gen, 1)
        got, want = layer.update(k, v), ref.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        layer.offload()
        tail = layer._tail
        assert [t.shape[-2] for t in tail] == [step + 1, step + 1]
        for kv, t in enumerate(tail):
            assert t.is_contiguous() and t.data_ptr() == layer._bufs[kv].data_ptr()
            # only the buffer is held, never the layer's decoded prompt part
            assert t.untyped_storage().nbytes() == layer._bufs[kv].numel() * 2
            assert t.untyped_storage().nbytes() < want[kv].nbytes
        ptrs.append(layer._bufs[0].data_ptr())
    assert len(set(ptrs[:16])) == 1 and layer._bufs[0].numel() == 2 * 3 * 32 * 16
    assert layer.get_seq_length() == PROMPT + 20


class _Check:
    """A stand-in decode check that records when it runs; ``ready`` as set."""

    def __init__(self, calls: list, name: str, ready: bool, bad: bool = False) -> None:
        self.calls, self.name, self.is_ready, self.bad = calls, name, ready, bad

    def ready(self) -> bool:
        return self.is_ready

    def __call__(self) -> None:
        self.calls.append(("check", self.name))
        if self.bad:
            raise CorruptDataError(f"{self.name}: chunk 0 is bad")


def _with_checks(monkeypatch, layer: PredictiveOffloadedLayer, checks: list) -> list:
    calls: list = []
    decode = layer.codec.start_decode

    def start_decode(*a, **k):
        keys, values, _ = decode(*a, **k)
        calls.append(("decode",))
        return keys, values, checks.pop(0)(calls)

    monkeypatch.setattr(layer.codec, "start_decode", start_decode)
    return calls


def test_deferred_check_order_never_waits_inside_the_step(monkeypatch):
    """With ``check="deferred"``, a decode not yet finished is not waited for by the
    cache's update or offload; its check runs at the next prefetch, before that
    prefetch's decode is queued. A finished one is checked inside update. A read from
    outside the cache waits for it."""
    gen = torch.Generator().manual_seed(2)
    layer, _ = _offloaded(gen, check="deferred")
    calls = _with_checks(monkeypatch, layer, [
        lambda c: _Check(c, "first", ready=False), lambda c: _Check(c, "second", ready=True),
        lambda c: _Check(c, "third", ready=False)])
    layer.prefetch()
    layer.update(*_states(gen, 1))
    assert layer.get_seq_length() == PROMPT + 1
    layer.offload()
    assert calls == [("decode",)]  # unchecked through update and offload
    layer.prefetch()
    assert calls == [("decode",), ("check", "first"), ("decode",)]
    layer.update(*_states(gen, 1))
    assert calls[-1] == ("check", "second")  # finished: checked before the step goes on
    layer.offload()
    layer.prefetch()
    assert calls[-1] == ("decode",)
    layer.keys  # noqa: B018 - a read from outside waits for the check
    assert calls[-1] == ("check", "third") and layer._checks == []


def test_deferred_bad_decode_raises_at_the_next_prefetch_and_every_read(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    layer, _ = _offloaded(gen, check="deferred")
    calls = _with_checks(monkeypatch, layer, [lambda c: _Check(c, "bad", False, bad=True),
                                              lambda c: _Check(c, "never", True)])
    layer.prefetch()
    layer.update(*_states(gen, 1))  # not finished: no wait, no error inside the step
    layer.offload()
    for run in (layer.prefetch, lambda: layer.keys, lambda: layer.values):
        with pytest.raises(CorruptDataError, match="bad: chunk 0"):
            run()
    assert calls.count(("decode",)) == 1  # no decode was queued on top of a bad one


def test_default_check_runs_before_update_returns(monkeypatch):
    """By default every decode is checked inside the update that returns its keys and
    values for attention, waiting for it when it has not finished; offload and the next
    prefetch find nothing left to check. The returned values are the plain layer's."""
    gen = torch.Generator().manual_seed(5)
    layer, ref = _offloaded(gen)
    calls = _with_checks(monkeypatch, layer, [
        lambda c: _Check(c, "first", ready=False), lambda c: _Check(c, "second", ready=False)])
    for step, name in enumerate(("first", "second")):
        layer.prefetch()
        assert calls[-1] == ("decode",) and len(layer._checks) == 1
        k, v = _states(gen, 1)
        got, want = layer.update(k, v), ref.update(k, v)
        assert calls[-1] == ("check", name) and layer._checks == []
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        layer.offload()
        assert len(calls) == 2 * (step + 1)


def test_default_bad_decode_raises_in_the_update_that_would_return_it(monkeypatch):
    """A bad decode not yet finished raises ``CorruptDataError`` in the update that would
    return its keys and values, not later, and again on every read."""
    gen = torch.Generator().manual_seed(3)
    layer, _ = _offloaded(gen)
    _with_checks(monkeypatch, layer, [lambda c: _Check(c, "bad", False, bad=True)])
    layer.prefetch()
    with pytest.raises(CorruptDataError, match="bad: chunk 0"):
        layer.update(*_states(gen, 1))
    for run in (lambda: layer.keys, lambda: layer.values, layer.prefetch):
        with pytest.raises(CorruptDataError, match="bad: chunk 0"):
            run()


def test_codec_refuses_an_unknown_check_mode():
    with pytest.raises(ValueError, match="check must be one of"):
        KVOffloadCodec(check="never")


class _Guessless(P.Predictor):
    name = "guessless"

    def predict(self, input_ids):
        return None


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_auto_method_codes_non_bf16_layers_with_static_tables(dtype):
    """With a predictor, "auto" codes bf16 layers with the per-value coder and routes
    fp16 and fp8 layers, which it does not take, to static tables: exact round trip. An
    explicit "distribution" refuses them."""
    cal = SimpleNamespace(predictor="guessless", dims=[(3, 16), (3, 8)])
    codec = KVOffloadCodec(_Guessless(), cal)
    codec.set_prompt(torch.zeros(2, PROMPT, dtype=torch.long))
    assert codec.method == "distribution"
    k, v = (t.float().to(dtype) for t in _states(torch.Generator().manual_seed(4), PROMPT))
    layer = codec.encode(0, k, v)
    assert isinstance(layer, static_kv.StaticLayer) and layer.dtype == str(dtype)[6:]
    keys, values = codec.decode(0, layer)
    assert torch.equal(keys.view(torch.uint8), k.view(torch.uint8))
    assert torch.equal(values.view(torch.uint8), v.view(torch.uint8))
    strict = KVOffloadCodec(_Guessless(), cal, method="distribution")
    strict.set_prompt(torch.zeros(2, PROMPT, dtype=torch.long))
    with pytest.raises(ValueError, match="expected bf16"):
        strict.encode(0, k, v)
