"""The one-call order-0 policy (``container.order0``) chooses and codes every field as the
Python policy does: same codec, same payload bytes, same entropy bits."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit.coding import crc32
from entropykit.container import codecs, order0


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
