"""Chunked KV coding: chunks of a cache cut at many boundaries (1-token chunks, a
sliding-window layer's first token, the end) decode alone given the prefix ids and
concatenate bit for bit to the cache and to compress_kv's round trip, for every layout,
dtype, residual model and predictor; a wrong prefix, damaged or hostile chunk blobs are
``CorruptDataError``; a hypothesis property over random boundaries."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from _kvcheck import device_path  # noqa: F401 - a fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_predictive_layouts import (  # noqa: F401 - syn_new_cal: a fixture
    FAMILIES,
    IDS,
    PROMPTS,
    SYN_CACHE,
    SYN_CAL,
    SYN_IDS,
    _as_dtype,
    _assert_exact,
    _cache,
    syn_new_cal,
)

from entropykit import CorruptDataError
from entropykit import predictive as P
from entropykit.predictive import chunk as C

NONE = P.NoPredictor()
# SYN_CACHE: 40 tokens, batch 2; layer 1 has no KV, layer 2 slides (its last 19: 21..39).
BOUNDS = [0, 1, 17, 21, 22, 39, 40]


def _chunked(cache, ids, pred, cal, bounds, **kw) -> tuple[list[bytes], list[P.KVCache]]:
    """Each chunk [a, b) coded and decoded alone (with ids[:, :a] only)."""
    blobs, outs = [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        part = P.slice_kv(cache, a, b)
        blob = P.compress_kv_chunk(part, ids[:, :b], pred, cal, start=a, threads=1, **kw)
        info = P.kv_chunk_info(blob)
        assert (info.start, info.end) == (a, b) and torch.equal(info.token_ids, ids[:, a:b])
        out = P.decompress_kv_chunk(blob, ids[:, :a], pred, cal, threads=1)
        _assert_exact(out, part)
        blobs.append(blob)
        outs.append(out)
    return blobs, outs


def _check_concatenates(cache, ids, pred, cal, bounds=BOUNDS, **kw) -> list[P.KVCache]:
    _, outs = _chunked(cache, ids, pred, cal, bounds, **kw)
    whole = P.decompress_kv(P.compress_kv(cache, ids, pred, cal, threads=1, **kw), pred, cal,
                            threads=1)
    _assert_exact(P.concat_kv(outs), cache)
    _assert_exact(P.concat_kv(outs), whole)
    return outs


@pytest.mark.parametrize("kind", P.KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16,
                                   torch.float32, torch.float8_e5m2],
                         ids=["bf16", "fp8_e4m3", "fp16", "fp32", "fp8_e5m2"])
def test_chunks_of_a_mixed_layout_concatenate_to_the_cache(kind, dtype, syn_new_cal):  # noqa: F811
    # keys and values of other shapes, a layer without KV, a sliding-window layer
    cache = (P.to_fp8(SYN_CACHE) if dtype == torch.float8_e4m3fn else SYN_CACHE
             if dtype == torch.bfloat16 else _as_dtype(SYN_CACHE, dtype))
    cal = SYN_CAL if dtype in (torch.bfloat16, torch.float8_e4m3fn) else syn_new_cal
    outs = _check_concatenates(cache, SYN_IDS, NONE, cal, model=kind)
    # the sliding layer holds none of the chunks before token 21, all of those after
    assert [o.tensor(2, 0) is None for o in outs] == [True, True, True, False, False, False]
    assert all(o.tensor(1, 0) is None for o in outs)  # the layer without KV


@pytest.mark.parametrize("family", ["gemma2", "qwen3-next"])
def test_chunks_with_predictors_concatenate_to_the_cache(family):
    build, _ = FAMILIES[family]
    model = build()
    cache = _cache(model)  # 24 tokens; gemma2's sliding layer holds the last 7 (17..23)
    for pred in (P.FP8Predictor(model), P.EarlyExitPredictor(model, 1), NONE):
        cal = P.calibrate(model, pred, PROMPTS, formats=("bf16",), progress=False)
        for kind in ("conditional", "gaussian"):
            _check_concatenates(cache, IDS, pred, cal, [0, 1, 2, 16, 17, 23, 24], model=kind)


def test_a_whole_prompt_chunk_holds_compress_kvs_blob():
    # From token 0 the predictor sees what compress_kv's sees: the same KV blob follows
    # the chunk header.
    blob = P.compress_kv_chunk(SYN_CACHE, SYN_IDS, NONE, SYN_CAL, start=0, threads=1)
    assert blob[C._FRONT:] == P.compress_kv(SYN_CACHE, SYN_IDS, NONE, SYN_CAL, threads=1)
    _assert_exact(P.decompress_kv_chunk(blob, None, NONE, SYN_CAL), SYN_CACHE)
    _assert_exact(P.decompress_kv_chunk(blob, torch.zeros(0), NONE, SYN_CAL), SYN_CACHE)


@pytest.mark.parametrize("kind", P.KINDS)
def test_device_path_writes_the_host_chunk(device_path, kind):  # noqa: F811
    for a, b in ((0, 17), (17, 22)):  # the sliding layer: none of the tokens, then some
        part = P.slice_kv(SYN_CACHE, a, b)
        args = (part, SYN_IDS[:, :b], NONE, SYN_CAL)
        host = P.compress_kv_chunk(*args, start=a, model=kind, coder="cpu")
        assert P.compress_kv_chunk(*args, start=a, model=kind, coder="gpu") == host
        _assert_exact(P.decompress_kv_chunk(host, SYN_IDS[:, :a], NONE, SYN_CAL,
                                            coder="gpu"), part)


# ---- the prefix ----------------------------------------------------------------------------

def test_a_wrong_prefix_is_refused():
    model = FAMILIES["llama"][0]()
    cache = _cache(model)
    for pred in (NONE, P.EarlyExitPredictor(model, 1)):  # NoPredictor would not notice
        cal = P.calibrate(model, pred, PROMPTS, formats=("bf16",), progress=False)
        blob = P.compress_kv_chunk(P.slice_kv(cache, 10, 14), IDS[:, :14], pred, cal,
                                   start=10)
        wrong = IDS[:, :10].clone()
        wrong[0, 3] = (wrong[0, 3] + 1) % 64
        with pytest.raises(CorruptDataError, match="prefix ids differ"):
            P.decompress_kv_chunk(blob, wrong, pred, cal)
        for n in (9, 11, 14):
            with pytest.raises(CorruptDataError, match=r"prefix ids are \[1, 10\]"):
                P.decompress_kv_chunk(blob, IDS[:, :n], pred, cal)
        with pytest.raises(CorruptDataError, match="prefix ids are"):
            P.decompress_kv_chunk(blob, None, pred, cal)
        _assert_exact(P.decompress_kv_chunk(blob, IDS[0, :10], pred, cal),  # 1-d: batch 1
                      P.slice_kv(cache, 10, 14))


def test_chunk_hash_is_blake2b_of_int64_ids():
    import hashlib

    ids = torch.tensor([[1, 2**40], [3, -4]])
    assert C.prefix_hash(ids) == hashlib.blake2b(
        struct.pack("<4q", 1, 2**40, 3, -4), digest_size=16).digest()


# ---- damaged and hostile blobs -------------------------------------------------------------

PART = P.slice_kv(SYN_CACHE, 17, 22)
BLOB = P.compress_kv_chunk(PART, SYN_IDS[:, :22], NONE, SYN_CAL, start=17, threads=1)
PREFIX = SYN_IDS[:, :17]


def _header(**fields: int) -> bytes:
    """BLOB with chunk header fields replaced and its CRC recomputed."""
    b = bytearray(BLOB)
    _, version, reserved, start, end, digest = C._HEAD.unpack_from(b)
    values = {"version": version, "reserved": reserved, "start": start, "end": end} | fields
    C._HEAD.pack_into(b, 0, C.MAGIC, values["version"], values["reserved"], values["start"],
                      values["end"], digest)
    struct.pack_into("<I", b, C._HEAD.size, zlib.crc32(b[: C._HEAD.size]))
    return bytes(b)


@pytest.mark.parametrize("fields, match", [
    ({"version": 2}, "version 2"), ({"reserved": 1}, "reserved 1"),
    ({"start": 22}, r"tokens \[22, 22\)"), ({"start": 23}, r"tokens \[23, 22\)"),
    ({"end": (1 << 24) + 1}, "<= 16777216"),
    ({"start": 16}, "its KV blob 5 tokens"), ({"end": 23}, "its KV blob 5 tokens"),
    ({"start": (1 << 23) - 4, "end": (1 << 23) + 1}, "batch 2: more than"),  # B * end
])
def test_documented_chunk_header_checks(fields, match):
    with pytest.raises(CorruptDataError, match=match):
        P.kv_chunk_info(_header(**fields))
    with pytest.raises(CorruptDataError, match=match):
        P.decompress_kv_chunk(_header(**fields), PREFIX, NONE, SYN_CAL)


def test_damaged_chunks_are_refused():
    for n in [*range(0, 80), *range(80, len(BLOB), 37)]:  # truncated
        with pytest.raises(CorruptDataError):
            P.decompress_kv_chunk(BLOB[:n], PREFIX, NONE, SYN_CAL)
    with pytest.raises(CorruptDataError, match="magic"):
        P.kv_chunk_info(b"EKKV" + BLOB[4:])
    with pytest.raises(CorruptDataError, match="header CRC"):
        P.kv_chunk_info(BLOB[:8] + b"\1" + BLOB[9:])
    with pytest.raises(CorruptDataError, match="frames end"):
        P.decompress_kv_chunk(BLOB + b"\0", PREFIX, NONE, SYN_CAL)
    for i in range(0, len(BLOB), 11):  # one bit flipped anywhere: refused, never wrong
        b = bytearray(BLOB)
        b[i] ^= 1 << (i % 8)
        with pytest.raises(CorruptDataError):
            P.decompress_kv_chunk(bytes(b), PREFIX, NONE, SYN_CAL)
    # a chunk with another calibration: refused as a KV blob is
    with pytest.raises(CorruptDataError, match="calibration"):
        P.decompress_kv_chunk(BLOB, PREFIX, P.EarlyExitPredictor(FAMILIES["llama"][0](), 1),
                              SYN_CAL)


def test_hostile_ranges_allocate_nothing():
    # A header claiming the most tokens the caps allow is refused on its range, before
    # the prefix (which such a blob would need) or any tensor is sized.
    import subprocess
    import sys

    code = (
        "import sys, resource\n"
        "from entropykit import CorruptDataError, predictive as P\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    P.decompress_kv_chunk(bytes.fromhex(sys.argv[1]), None, P.NoPredictor(), None)\n"
        "except CorruptDataError as e:\n"
        "    print(e)\n"
        "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)\n")
    hostile = _header(start=(1 << 24) - 5, end=1 << 24)
    out = subprocess.run([sys.executable, "-c", code, hostile.hex()], capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert "more than the format's 16777216 tokens" in out[0] and int(out[1]) < 16  # MiB


# ---- errors of the encoder and of slicing ----------------------------------------------------

def test_encoder_and_slicing_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="0 <= start < end"):
        P.compress_kv_chunk(PART, SYN_IDS[:, :22], NONE, SYN_CAL, start=22)
    with pytest.raises(ValueError, match="0 <= start < end"):
        P.compress_kv_chunk(PART, SYN_IDS[:1, :22], NONE, SYN_CAL, start=17)  # batch 1
    with pytest.raises(ValueError, match=r"holds 5 tokens in a layer; tokens \[18, 22\)"):
        P.compress_kv_chunk(PART, SYN_IDS[:, :22], NONE, SYN_CAL, start=18)
    with pytest.raises(ValueError, match="another model shape"):  # a layer's dims changed
        P.compress_kv_chunk(P.KVCache(PART.keys[:3], PART.values[:3]), SYN_IDS[:, :22],
                            NONE, SYN_CAL, start=17)
    with pytest.raises(ValueError, match=r"0 <= start < end <= 40"):
        P.slice_kv(SYN_CACHE, 30, 41)
    only_sliding = P.KVCache([None, None, SYN_CACHE.keys[2], None],
                             [None, None, SYN_CACHE.values[2], None])
    with pytest.raises(ValueError, match=r"no layer holds any of tokens \[0, 10\)"):
        P.slice_kv(only_sliding, 0, 10, tokens=40)
    a, b = P.slice_kv(SYN_CACHE, 0, 30), P.slice_kv(SYN_CACHE, 30, 40)
    with pytest.raises(ValueError, match="layer 2 holds tokens in a chunk but none"):
        P.concat_kv([a, P.slice_kv(SYN_CACHE, 0, 10), b])
    with pytest.raises(ValueError, match="fp8 scales"):
        P.concat_kv([P.to_fp8(a), P.to_fp8(b)])  # each chunk scaled on its own
    with pytest.raises(ValueError, match="no chunks"):
        P.concat_kv([])


# ---- a property ----------------------------------------------------------------------------

@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.sets(st.integers(1, 39), max_size=6), kind=st.sampled_from(P.KINDS),
       fp8=st.booleans())
def test_any_boundaries_concatenate_to_the_cache(cuts, kind, fp8):
    cache = P.to_fp8(SYN_CACHE) if fp8 else SYN_CACHE
    _, outs = _chunked(cache, SYN_IDS, NONE, SYN_CAL, [0, *sorted(cuts), 40], model=kind)
    _assert_exact(P.concat_kv(outs), cache)
