"""Tests of entropykit.analysis on KV caches: the caches of a tiny random Llama.

The reference never uses entropykit.formats: it takes bf16 words apart with its own bit
arithmetic (exponent = bits 7..14; sign_mantissa = sign << 7 | the 7 mantissa bits), and
counts with np.bincount.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import transformers  # the kv extra; .ci/run installs it
from _entropy import h as _h  # tests/ is on sys.path under pytest
from _entropy import h_given as _h_given

from entropykit import predictive as P
from entropykit.analysis import Report, analyze
from entropykit.analysis.roles import role_of

LAYERS = 3
CFG = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
torch.manual_seed(0)
MODEL = transformers.LlamaForCausalLM(CFG).to(torch.bfloat16).eval()
GEN = torch.Generator().manual_seed(7)
IDS = [torch.randint(0, 256, (1, n), generator=GEN) for n in (40, 24, 9)]


def _transformers_cache(ids: torch.Tensor):
    with torch.inference_mode():
        return MODEL(ids, use_cache=True).past_key_values


CACHES = [P.from_transformers(_transformers_cache(ids)) for ids in IDS]


# --- the independent reference ----------------------------------------------------------




def _bf16_fields(t: torch.Tensor) -> dict[str, np.ndarray]:
    u = t.contiguous().view(torch.int16).numpy().view(np.uint16).reshape(-1).astype(np.int64)
    return {"exponent": (u >> 7) & 0xFF, "sign_mantissa": ((u >> 8) & 0x80) | (u & 0x7F)}


def _check_bf16(row, tensors: list[torch.Tensor]) -> None:
    """``row`` against the fields of ``tensors`` (one tensor, or a stream's), pooled."""
    ref = {k: np.concatenate([_bf16_fields(t)[k] for t in tensors])
           for k in ("exponent", "sign_mantissa")}
    assert row.dtype == "BF16" and [f.name for f in row.fields] == list(ref)
    exp, sm = row.fields
    assert exp.hist == tuple(np.bincount(ref["exponent"], minlength=256))
    assert sm.hist == tuple(np.bincount(ref["sign_mantissa"], minlength=256))
    assert exp.symbols == sm.symbols == ref["exponent"].size == row.elements
    assert exp.entropy == pytest.approx(_h(ref["exponent"]), rel=1e-12, abs=1e-12)
    assert sm.entropy == pytest.approx(_h(ref["sign_mantissa"]), rel=1e-12, abs=1e-12)
    assert exp.conditional is None and sm.context == "exponent"
    cond = _h_given(ref["exponent"], ref["sign_mantissa"])
    assert sm.conditional == pytest.approx(cond, rel=1e-9, abs=1e-9)
    assert row.carried_bits == pytest.approx((_h(ref["exponent"]) + cond) * exp.symbols,
                                             rel=1e-9)
    assert row.allocated_bits == 16 * row.elements


# --- single caches ----------------------------------------------------------------------


def test_kvcache_rows_match_independent_computation():
    cache = CACHES[0]
    rep = analyze(cache)
    assert rep.source == "<KVCache>" and not rep.skipped
    names = [f"layer.{i}.{kv}" for i in range(LAYERS) for kv in ("keys", "values")]
    assert [r.name for r in rep.rows] == names
    for r in rep.rows:
        layer, kv = int(r.name.split(".")[1]), int(r.name.endswith("values"))
        t = cache.tensor(layer, kv)
        assert r.role == ("kv-values" if kv else "kv-keys") and r.file is None
        assert r.shape == tuple(t.shape) == (1, 2, 40, 16)
        assert r.nbytes == 2 * t.numel()
        _check_bf16(r, [t])
        values = t.float().abs().numpy()
        assert r.log2.zeros == int((values == 0).sum())
    assert {g.key for g in rep.groups("role")} == {"kv-keys", "kv-values"}


def test_transformers_cache_gives_the_same_rows():
    dyn = _transformers_cache(IDS[0])
    rep = analyze(dyn)
    assert rep.source == f"<{type(dyn).__name__}>"
    assert rep.rows == analyze(CACHES[0]).rows


def test_uninitialized_transformers_layers_are_left_out():
    dyn = transformers.DynamicCache(config=CFG)
    assert len(dyn.layers) == LAYERS and dyn.layers[1].keys is None
    k, v = CACHES[0].keys[0], CACHES[0].values[0]
    dyn.update(k.clone(), v.clone(), 0)
    rep = analyze(dyn)
    assert [r.name for r in rep.rows] == ["layer.0.keys", "layer.0.values"]
    _check_bf16(rep.rows[0], [k])


def test_fp8_cache_values_and_scales():
    fp8 = P.to_fp8(CACHES[0])
    rep = analyze(fp8)
    names = [f"layer.{i}.{kv}{s}" for i in range(LAYERS) for kv in ("keys", "values")
             for s in ("", ".scale")]
    assert [r.name for r in rep.rows] == names
    for r in rep.rows:
        layer, kv = int(r.name.split(".")[1]), int(".values" in r.name)
        if r.name.endswith(".scale"):
            assert (r.dtype, r.role, r.shape, r.nbytes) == ("F32", "scales", (1,), 4)
            word = np.float32(fp8.scales[layer, kv]).view(np.uint32)
            assert r.fields[0].hist[int(word >> 23) & 0xFF] == 1  # its exponent byte
            continue
        t = fp8.tensor(layer, kv)
        assert (r.dtype, r.role, r.shape) == ("F8_E4M3", ("kv-keys", "kv-values")[kv],
                                              tuple(t.shape))
        raw = t.contiguous().view(torch.uint8).numpy().reshape(-1).astype(np.int64)
        (byte0,) = r.fields
        assert byte0.hist == tuple(np.bincount(raw, minlength=256))
        assert byte0.entropy == pytest.approx(_h(raw), rel=1e-12, abs=1e-12)
        assert r.carried_bits == pytest.approx(_h(raw) * raw.size, rel=1e-12)
        # Every fp8 value has an exponent: the octaves plus zeros cover all of them.
        assert sum(r.log2.octaves().values()) + r.log2.zeros == t.numel()
        assert r.log2.nonfinite == 0
    fp8_groups = {g.key: g for g in rep.groups("dtype")}
    assert set(fp8_groups) == {"F8_E4M3", "F32"}
    assert fp8_groups["F32"].nbytes == 4 * 2 * LAYERS


# --- streams ----------------------------------------------------------------------------


def _concatenated(caches: list[P.KVCache]) -> P.KVCache:
    return P.KVCache([torch.cat([c.keys[i] for c in caches], dim=2) for i in range(LAYERS)],
                     [torch.cat([c.values[i] for c in caches], dim=2) for i in range(LAYERS)])


def test_stream_of_two_caches_equals_their_concatenation():
    two = CACHES[:2]
    joined = analyze(_concatenated(two))
    for stream in (two, tuple(two), iter(two), (c for c in two)):
        rep = analyze(stream)
        assert rep.source == "<stream of 2 KV caches>"
        assert rep.rows == joined.rows  # every count, entropy, shape and log2 bin
    assert joined.rows[0].shape == (1, 2, 40 + 24, 16)
    rows = analyze(two).rows
    for r in rows:
        layer, kv = int(r.name.split(".")[1]), int(r.name.endswith("values"))
        _check_bf16(r, [c.tensor(layer, kv) for c in two])


def test_stream_mixes_cache_kinds_and_counts_add_up():
    dyn = _transformers_cache(IDS[2])
    rep = analyze([CACHES[0], dyn, CACHES[1]])
    assert rep.rows == analyze(_concatenated([CACHES[0], CACHES[2], CACHES[1]])).rows
    assert rep.nbytes == sum(analyze(c).nbytes for c in (CACHES[0], dyn, CACHES[1]))


def test_stream_of_fp8_caches():
    fp8 = [P.to_fp8(c) for c in CACHES]
    rep = analyze(fp8)
    by = {r.name: r for r in rep.rows}
    k0 = by["layer.0.keys"]
    assert k0.shape == (1, 2, 40 + 24 + 9, 16)
    raw = np.concatenate([c.keys[0].view(torch.uint8).numpy().reshape(-1) for c in fp8])
    assert k0.fields[0].hist == tuple(np.bincount(raw, minlength=256))
    # The scales of the three caches, one row per (layer, k/v): 3 float32 values each.
    s0 = by["layer.0.keys.scale"]
    assert s0.shape == (3,) and s0.nbytes == 12
    words = np.array([float(c.scales[0, 0]) for c in fp8], np.float32).view(np.uint32)
    assert s0.fields[0].hist == tuple(np.bincount((words >> 23) & 0xFF, minlength=256))


def test_stream_progress_reports_bytes_so_far():
    seen = []
    rep = analyze(iter(CACHES), progress=lambda done, total: seen.append((done, total)))
    assert seen and all(d == t for d, t in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == rep.nbytes


def test_stream_errors():
    with pytest.raises(ValueError, match="mixes BF16 and F8_E4M3"):
        analyze([CACHES[0], P.to_fp8(CACHES[1])])
    with pytest.raises(TypeError, match="element 1 of the stream is a int"):
        analyze(iter([CACHES[0], 3]))
    assert analyze(iter([])).rows == ()
    # A list of numbers is still an array, not a stream.
    rep = analyze([1.0, 2.0, 2.0])
    assert (rep.rows[0].dtype, rep.rows[0].shape) == ("F64", (3,))


# --- report, roles, plots ---------------------------------------------------------------


@pytest.mark.parametrize("name, role", [
    ("layer.3.keys", "kv-keys"), ("layer.12.values", "kv-values"), ("keys", "kv-keys"),
    ("layer.3.keys.scale", "scales"), ("layer.0.values.scale", "scales"),
    ("model.layers.0.self_attn.k_proj.weight", "attention"), ("monkeys", "other"),
])
def test_kv_roles(name, role):
    assert role_of(name) == role


def test_kv_report_json_table_and_plot():
    rep = analyze([P.to_fp8(c) for c in CACHES[:2]])
    assert Report.from_json(rep.to_json()) == rep
    table = rep.to_table(top=4)
    assert "<stream of 2 KV caches>" in table and "kv-keys" in table and "kv-values" in table
    from entropykit.analysis.plots import png_bytes

    assert png_bytes(rep, dpi=40)[:8] == b"\x89PNG\r\n\x1a\n"
    total = rep.total
    values = sum(2 * LAYERS * math.prod(c.shape) for c in CACHES[:2])
    assert total.elements == values + 2 * 2 * LAYERS  # values and one scale per cache
