"""Every decoder build gpu/kernel_sweep.py compares is exact and fails as the CPU does.

What it is: each variant of ``kernel_sweep.VARIANTS`` (table layout, ring windows, lanes
a thread, warp-uniform control, pairs per block; selected through the private environment
variables a decode reads) runs
stress_check.py's adversarial bf16 batches (sign_mantissa coded, plain, raw frames,
context-conditioned), its u8 batch (skewed, one symbol, uniform, plain, byte planes at a
stride), weight-like tensors with specials in bf16 and u8 mode at the variant's warps,
and damaged exponent chunks, each into poisoned arenas against the data; two lanes a
thread also at odd pairs a block (a block's last warp half full; UNIFORM falls back). What
it is not:
the default build's full suite (test_cuda_static.py) or a benchmark (kernel_sweep.py).
"""

from __future__ import annotations

import functools

import device_check as dc
import kernel_sweep as ks
import numpy as np
import pytest
import stress_check as sc

from entropykit.rans.cuda import plan

pytestmark = pytest.mark.cuda

SIZES = (384 * 384, 1536 * 384, 384, 65_537, 100_003)


@pytest.fixture(params=ks.VARIANTS, ids=[v.name for v in ks.VARIANTS])
def variant(request, monkeypatch) -> ks.Variant:
    for k, val in ks.env(request.param).items():
        if val is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, val)
    return request.param


@functools.cache
def _weights() -> tuple[np.ndarray, ...]:
    return tuple(dc.specials(n, seed=k) for k, n in enumerate(SIZES))


@functools.cache
def _frames(sm_kind: str) -> tuple[list[bytes], list[bytes]]:
    return dc.encode_config(list(_weights()), 1 << 16, sm_kind)


@pytest.mark.parametrize("ctx", [False, True], ids=["plain-coded-raw", "context"])
@pytest.mark.parametrize("chunk", [1024, 1 << 16])
def test_bf16_adversarial_batch_is_exact(variant, chunk, ctx):
    rng = np.random.default_rng(chunk + ctx)
    assert sc.run_batch(f"{variant.name} bf16 {chunk}", *sc.bf16_cases(rng, chunk, ctx),
                        2) == []


@pytest.mark.parametrize("chunk", [1024, 1 << 16])
def test_u8_adversarial_batch_is_exact(variant, chunk):
    rng = np.random.default_rng(chunk)
    assert sc.run_batch(f"{variant.name} u8 {chunk}", *sc.u8_cases(rng, chunk), 1) == []


@pytest.mark.parametrize("sm_kind", ["one", "ctx", "raw"])
def test_weights_decode_exactly_at_the_variants_warps(variant, sm_kind):
    warps = variant.warps or plan.WARPS
    efs, sfs = _frames(sm_kind)
    bf16 = plan.prepare_bf16(efs, sfs, warps)
    assert sc.run_batch(f"{variant.name} weights {sm_kind}", bf16, list(_weights()), 2) == []
    if sm_kind == "one":
        expect = [dc.fields(w)[0] for w in _weights()] + [dc.fields(w)[1] for w in _weights()]
        u8 = plan.prepare_u8(efs + sfs, warps)
        assert sc.run_batch(f"{variant.name} u8 fields", u8, expect, 1) == []


def test_damaged_exponent_chunks_raise_the_cpu_decoders_errors(variant):
    assert sc.corruption() == []


@pytest.mark.parametrize("uniform", ["0", "1"])
@pytest.mark.parametrize("warps", [1, 3])
def test_two_lanes_at_odd_pairs_a_block_are_exact(monkeypatch, warps, uniform):
    from entropykit.rans.cuda import _runtime

    monkeypatch.setenv(_runtime._ENV_LANES, "2")
    monkeypatch.setenv(_runtime._ENV_UNIFORM, uniform)
    efs, sfs = _frames("raw")
    bf16 = plan.prepare_bf16(efs, sfs, warps)
    assert sc.run_batch(f"lanes 2 w{warps} bf16", bf16, list(_weights()), 2) == []
    expect = [dc.fields(w)[0] for w in _weights()]
    u8 = plan.prepare_u8(efs, warps)
    assert sc.run_batch(f"lanes 2 w{warps} u8", u8, expect, 1) == []
