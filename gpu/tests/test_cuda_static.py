"""The static rANS decoder on the device: bit-exact against the data, failing as the CPU does.

What it is: stress_check.py's adversarial batches (symbol counts around the kernel's
32-symbol step, its 512-symbol staged round and the chunk; outputs aligned and off by
2 .. 14 bytes; sign_mantissa coded, plain, stored raw or context-conditioned; u8 streams
skewed, of one symbol, incompressible or plain; byte planes at a stride of 2) decoded
into poisoned arenas; weight-like bf16 tensors with NaN / inf / zero / subnormal values in
every frame configuration and block size device_check.py runs, and in u8 mode; damaged
exponent and sign_mantissa chunks raising the CPU decoder's error of the status the
damage gives, naming the chunk. What it is not: a benchmark (device_check.py's timings,
bench_gpu.py) or the CPU suite's emulator tests (tests/test_gpu_logic.py).
"""

from __future__ import annotations

import functools

import device_check as dc
import numpy as np
import pytest
import stress_check as sc

from entropykit.rans.cuda import plan

pytestmark = pytest.mark.cuda

# Weight-like tensors: square and wide matrices, a vector, an odd size past a chunk.
SIZES = (384 * 384, 1536 * 384, 384, 65_537, 100_003)


@functools.cache
def _weights() -> tuple[np.ndarray, ...]:
    return tuple(dc.specials(n, seed=k) for k, n in enumerate(SIZES))


@functools.cache
def _frames(chunk: int, sm_kind: str) -> tuple[list[bytes], list[bytes]]:
    """Exponent and sign_mantissa frames of the weights (the CPU decoder checked first)."""
    return dc.encode_config(list(_weights()), chunk, sm_kind)


@pytest.mark.parametrize("ctx", [False, True], ids=["plain-coded-raw", "context"])
@pytest.mark.parametrize("chunk", [1024, 1 << 16])
def test_bf16_adversarial_batch_is_exact(chunk, ctx):
    rng = np.random.default_rng(chunk + ctx)
    assert sc.run_batch(f"bf16 chunk {chunk}", *sc.bf16_cases(rng, chunk, ctx), 2) == []


@pytest.mark.parametrize("chunk", [1024, 1 << 16])
def test_u8_adversarial_batch_is_exact(chunk):
    rng = np.random.default_rng(chunk)
    assert sc.run_batch(f"u8 chunk {chunk}", *sc.u8_cases(rng, chunk), 1) == []


@pytest.mark.parametrize("warps", sorted({1, 4, plan.WARPS, 16}))
@pytest.mark.parametrize("chunk,sm_kind", [(1 << 16, "one"), (1 << 16, "ctx"),
                                           (1 << 16, "raw"), (1 << 18, "one")])
def test_weights_decode_exactly_in_every_configuration(chunk, sm_kind, warps):
    efs, sfs = _frames(chunk, sm_kind)
    batch = plan.prepare_bf16(efs, sfs, warps)
    assert sc.run_batch(f"weights {chunk} {sm_kind} w{warps}", batch, list(_weights()), 2) == []


def test_u8_mode_decodes_the_fields():
    efs, sfs = _frames(1 << 16, "one")
    expect = [dc.fields(w)[0] for w in _weights()] + [dc.fields(w)[1] for w in _weights()]
    batch = plan.prepare_u8(efs + sfs, plan.WARPS)
    assert sc.run_batch("u8 mode", batch, expect, 1) == []


def test_damaged_exponent_chunk_of_a_staged_pair():
    assert sc.corruption() == []


def test_damaged_sign_mantissa_chunk():
    efs, sfs = _frames(1 << 16, "one")
    big = int(np.argmax(SIZES))
    rows = dc.corruption_checks(efs[big], sfs[big], SIZES[big], sc.DEV)
    assert [r["case"] for r in rows if not r["ok"]] == []
    assert len(rows) == 4
