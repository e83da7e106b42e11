"""The codec registry: every codec a record may name is registered, each round-trips its
own payloads and counts them, unknown names are refused, and ``choose`` codes a field with
its policy's smallest bid."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit import CorruptDataError
from entropykit.container import codecs, record


def test_registry_is_the_record_vocabulary() -> None:
    assert set(codecs.CODECS) == set(record.CODECS)
    assert all(c.name == name for name, c in codecs.CODECS.items())
    for p in codecs.POLICIES.values():
        assert set(p.candidates) <= set(codecs.CODECS) and "raw" in p.candidates


@pytest.mark.parametrize("name", ["rans", "tans", "zstd", "raw"])
def test_each_codec_round_trips(name: str) -> None:
    sym = (np.arange(9000) % 7 * (np.arange(9000) % 3)).astype(np.uint8)
    blob = np.frombuffer(codecs.encode(name, sym, None), np.uint8)
    assert codecs.count(name, blob, limit=sym.size) == sym.size
    assert np.array_equal(codecs.decode(name, blob, sym.size, None), sym)


def test_unknown_codec_is_refused() -> None:
    data = np.zeros(64, np.uint8)
    with pytest.raises(CorruptDataError, match="unknown codec 'lz4'"):
        codecs.decode("lz4", data, 60, None)
    with pytest.raises(CorruptDataError, match="unknown codec 'lz4'"):
        codecs.count("lz4", data, limit=60)
    with pytest.raises(ValueError, match="unknown codec 'lz4'"):
        codecs.encode("lz4", data, None)
    with pytest.raises(ValueError, match="rans2d payloads are made by its bid"):
        codecs.encode("rans2d", data, None)


def _fields() -> list[tuple[np.ndarray, tuple[int, int] | None]]:
    i = np.arange(1 << 15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = i * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(32)
    skewed = np.log2((h & np.uint64(0xFFFF)).astype(np.float64) + 1).astype(np.int64)
    rows = (i.astype(np.int64) // 256) % 8  # rows of 256 in 8 scales: classes pay
    return [
        ((h >> np.uint64(7) & np.uint64(255)).astype(np.uint8), None),  # uniform: raw
        ((np.arange(1 << 15) % 5 * 40).astype(np.uint8), None),  # periodic: zstd
        ((100 + skewed).astype(np.uint8), None),  # skewed: an entropy coder
        ((100 + skewed + 3 * rows).astype(np.uint8), (256, 0)),  # rans2d where it bids
        (np.zeros(3, np.uint8), None),
    ]


@pytest.mark.parametrize(("target", "fast"), sorted(codecs.POLICIES))
def test_choice_is_the_smallest_bid(target: str, fast: bool) -> None:
    policy = codecs.POLICIES[target, fast]
    seen = set()
    for sym, grid in _fields():
        got = codecs.choose(sym, None, target, fast=fast, grid=grid)
        f = codecs._analyse(sym, None, policy, grid, None)
        f.coder = codecs._coder(f)
        raw = sym.size + codecs.RAW_OVERHEAD
        bids = {}
        for name in policy.candidates:
            bid = codecs.CODECS[name].estimate(f, min([raw, *(b.size for b in bids.values())]))
            if bid is not None:
                bids[name] = bid
        best = min(b.size for b in bids.values())
        assert bids[got.codec].size == best, (got.codec, {k: b.size for k, b in bids.items()})
        assert got.codec == next(n for n in policy.candidates if n in bids
                                 and bids[n].size == best)
        assert len(got.blob) <= raw
        seen.add(got.codec)
    assert {"raw", "zstd", "tans" if "tans" in policy.candidates else "rans"} <= seen
    assert ("rans2d" in seen) == (policy is codecs.CPU)


@pytest.mark.parametrize("damage", ["trailing byte", "second frame", "no checksum"])
def test_zstd_payload_is_exactly_one_checksummed_frame(damage: str) -> None:
    # Bytes after the frame, or a frame without its content checksum, would pass unchecked
    # in files whose payloads carry no position CRC (record versions 1 and 2).
    import zstandard

    sym = (np.arange(5000) % 7).astype(np.uint8)
    blob = codecs.ZSTD.encode(sym, None, 0, 0, None)
    assert np.array_equal(codecs.ZSTD.decode(np.frombuffer(blob, np.uint8), 5000, None), sym)
    bad = {"trailing byte": blob + b"x", "second frame": blob + blob,
           "no checksum": zstandard.ZstdCompressor(write_checksum=False).compress(
               sym.tobytes())}[damage]
    with pytest.raises(CorruptDataError, match="zstd"):
        codecs.ZSTD.decode(np.frombuffer(bad, np.uint8), 5000, None)
