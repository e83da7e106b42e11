"""The one-call order-0 policy (``container.order0``) chooses and codes every field as the
Python policy does: same codec, same payload bytes, same entropy bits."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit.coding import contexts, crc32, frame, tables
from entropykit.container import classed, codecs, order0
from entropykit.rans import static as rans_static
from entropykit.tans import static as tans_static


def _fields() -> list[tuple[str, np.ndarray, bool]]:
    """(what, symbols, with a context) for each decision the policies make: empty, tiny,
    constant, skewed (rANS and tANS sizes), near-uniform (the screen, and not paying),
    wide skewed alphabets, LZ-friendly repeats (zstd), chunks stored raw, a context."""
    rng = np.random.default_rng(7)
    skewed = lambda n: np.clip(rng.normal(0, 3, n), -60, 60).astype(np.int64).astype(np.uint8)
    wide = lambda n: np.clip(rng.laplace(128, 18, n), 0, 255).astype(np.uint8)
    mixed = np.concatenate([rng.integers(0, 256, 1 << 18), np.zeros(1 << 18, np.int64)])
    return [
        ("one", np.array([3], np.uint8), False),
        ("tiny", skewed(100), False),
        ("constant", np.full(5000, 9, np.uint8), False),
        ("skewed small", skewed(20_000), False),
        ("skewed mid", skewed(65_536), False),
        ("skewed large", skewed(700_001), False),
        ("uniform small", rng.integers(0, 256, 30_000).astype(np.uint8), False),
        ("uniform large", rng.integers(0, 256, 300_000).astype(np.uint8), False),
        ("wide", wide(200_000), False),
        ("repeats", np.tile(rng.integers(0, 256, 700).astype(np.uint8), 40), False),
        ("raw chunk", mixed.astype(np.uint8), False),
        ("skewed, context", skewed(100_000), True),
        ("uniform, context", rng.integers(0, 256, 100_000).astype(np.uint8), True),
    ]


@pytest.mark.skipif(not crc32.ACCELERATED, reason="the kernel needs the carry-less CRC-32")
@pytest.mark.parametrize("target,fast", [("cpu", True), ("gpu", False), ("gpu", True)])
def test_one_call_policy_chooses_and_codes_as_the_python_policy(monkeypatch, target, fast):
    assert codecs._ORDER0[codecs.POLICIES[target, fast].name] is not None
    ctx = np.random.default_rng(8).integers(0, 4, 1 << 20).astype(np.uint8)
    calls = []
    real = order0.code
    monkeypatch.setattr(order0, "code", lambda *a: calls.append(1) or real(*a))
    got = [codecs.choose(sym, ctx[: sym.size] if c else None, target, fast=fast)
           for _, sym, c in _fields()]
    assert len(calls) == len(_fields())  # one call each
    monkeypatch.setattr(codecs, "_ORDER0", dict.fromkeys(codecs._ORDER0))  # Python alone
    for (what, sym, c), new in zip(_fields(), got, strict=True):
        old = codecs.choose(sym, ctx[: sym.size] if c else None, target, fast=fast)
        assert (new.codec, new.blob, new.entropy_bits) == (old.codec, old.blob,
                                                          old.entropy_bits), what


@pytest.mark.parametrize("group", [order0.GROUP, 1])  # one call, or a call a chunk
@pytest.mark.parametrize("tans,conditioned", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("n,chunk", [(1, 1 << 10), (5000, 1 << 10), (70_000, 1 << 14)])
def test_frame_in_few_calls_is_the_frame_layers_frame(monkeypatch, tans, conditioned, n,
                                                      chunk, group):
    # Context classes (four contexts of different spread) and none (one context), chunks
    # coded and stored raw (a run of random bytes), tANS never conditioned; the chunks in
    # one group, or a group each on the threads.
    monkeypatch.setattr(order0, "GROUP", group)
    rng = np.random.default_rng(n)
    ctx = rng.integers(0, 4 if n > 1 else 1, n).astype(np.uint8)
    sym = (rng.normal(0, 1 + 6.0 * ctx, n).astype(np.int64) & 0xFF).astype(np.uint8)
    sym[n // 2 : n // 2 + 2 * chunk] = rng.integers(0, 256, min(2 * chunk, n - n // 2))
    coder = (tans_static if tans else rans_static).CODER
    param = 12 if tans else 11
    if conditioned:
        counts = contexts.joint_histogram(ctx, sym)
        want = frame.encode(coder, sym, param, chunk, 1, ctx, counts=counts)
    else:
        counts = tables.histogram(sym)
        want = frame.encode(coder, sym, param, chunk, 1, counts=counts)
    got = order0.encode(sym, ctx if conditioned else None, counts, param, chunk, tans)
    assert got == want
    if conditioned and n > 10_000:
        assert got[7] == 1  # the context flag: this field's contexts have classes


def test_classed_frame_in_few_calls_is_the_frame_layers_frame(monkeypatch):
    # Rows of three scales: the row classes pay, and the frame's contexts are the classes.
    rng = np.random.default_rng(3)
    rows, cols = 300, 700
    x = rng.normal(0, 1, (rows, cols)) * np.array([1, 8, 40])[np.arange(rows) % 3, None]
    sym = (x.astype(np.int64) & 0xFF).astype(np.uint8).reshape(-1)
    plan = classed.plan(sym, cols, 0)
    assert plan is not None and plan.kr > 1
    got = classed.encode(sym, cols, 0, plan, 12, 1 << 14)
    monkeypatch.setattr(classed.crc32, "ACCELERATED", False)  # the frame layer's frame
    assert got == classed.encode(sym, cols, 0, plan, 12, 1 << 14)
    assert np.array_equal(classed.decode(np.frombuffer(got, np.uint8), sym.size), sym)


@pytest.mark.parametrize("conditioned", [False, True])
def test_frame_refuses_counts_that_are_not_the_symbols(conditioned):
    sym = np.arange(1000).astype(np.uint8)
    ctx = sym // 64 if conditioned else None
    counts = contexts.joint_histogram(ctx, sym) if conditioned else tables.histogram(sym)
    for bad in (counts[..., :128], counts * 2):
        with pytest.raises(ValueError, match="counts must be"):
            order0.encode(sym, ctx, bad, 12, 1 << 10, False)
