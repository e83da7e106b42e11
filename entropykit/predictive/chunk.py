"""Chunked KV coding: tokens [start, end) of a cache, coded so that the chunk decodes alone.

What it is: ``compress_kv_chunk`` / ``decompress_kv_chunk`` (a chunk blob: a header naming
the chunk's token range and a hash of the ids before it, then a KV blob of the chunk's
tokens; docs/format.md, "KV chunk blob"), ``kv_chunk_info`` (a chunk blob's range and
ids), ``slice_kv`` (a cache's chunk as its layers hold it) and ``concat_kv`` (decoded
chunks back into one cache). What it is not: another coder: the chunk's values are coded
as ``compress_kv`` codes a cache's.

Why a chunk needs nothing but itself and the prefix ids: each value's (mu, sigma) depends
on its own token only: the predictor's guess there and, for the conditional model, the
same token's values in the groups decoded before it, which the chunk carries. The guess
for the chunk's tokens is the predictor's on the ids of every token up to the chunk's end
(the prefix ids and the chunk's own), so the decoder needs the prefix ids and runs the
predictor over all of them: a predictor's cost per chunk grows with its position
(``NoPredictor`` runs nothing). The prefix hash makes a decode with other prefix ids an
error, even where the predictor would not notice (``NoPredictor``).

A chunk holds, per (layer, k/v) group, its tokens among [start, end): all of them, or for a
sliding-window layer the chunk's last ones, or none (``None``; then its layer's keys and
values are both None), as ``slice_kv`` cuts them from a cache.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from .._errors import CorruptDataError
from . import codec
from .calibration import Calibration
from .kvcache import KVCache, as_kvcache
from .predictors import Predictor

MAGIC = b"EKKC"
VERSION = 1
# magic, version, reserved, start, end, prefix hash; then the CRC-32 of those bytes
_HEAD = struct.Struct("<4sHHII16s")
_FRONT = _HEAD.size + 4


@dataclass(frozen=True)
class KVChunkInfo:
    """What a chunk blob says about itself: it covers tokens [start, end) of the prompt;
    ``token_ids`` are its own ([batch, end - start], int64); ``prefix_hash`` identifies the
    ids before it (``prefix_hash``)."""

    start: int
    end: int
    token_ids: torch.Tensor
    prefix_hash: bytes


def prefix_hash(prefix_ids: torch.Tensor) -> bytes:
    """BLAKE2b-128 of ``prefix_ids`` ([batch, start]) as little-endian int64, row-major."""
    ids = torch.as_tensor(prefix_ids).to(torch.int64).contiguous().numpy()
    return hashlib.blake2b(ids.astype("<i8").tobytes(), digest_size=16).digest()


def _ids(token_ids: Any) -> torch.Tensor:
    ids = codec._host(torch.as_tensor(token_ids))
    return ids[None] if ids.dim() == 1 else ids


def compress_kv_chunk(chunk: Any, token_ids: torch.Tensor, predictor: Predictor,
                      calibration: Calibration, *, start: int, model: str = "conditional",
                      threads: int | None = None, coder: str = "auto") -> bytes:
    """Code ``chunk`` (a ``KVCache`` or transformers ``Cache``, any layout and dtype
    ``compress_kv`` takes): the cache's tokens [start, end) of the prompt whose ids up to
    the chunk's end are ``token_ids`` ([batch, end]: the prefix ids, then the chunk's
    own), each group holding its tokens among them (``slice_kv``; None for a layer that
    holds none). ``model``, ``threads`` and ``coder`` as in ``compress_kv``.

    The blob carries the range, the chunk's own ids and a hash of the prefix ids
    (``token_ids[:, :start]``), not the prefix ids themselves; it decodes with
    ``decompress_kv_chunk`` given those."""
    kv = as_kvcache(chunk)
    ids = _ids(token_ids)
    end = ids.shape[-1]
    tokens = max(sh[2] for sh in kv.shapes if sh)
    if ids.dim() != 2 or ids.shape[0] != kv.batch or not 0 <= start < end:
        raise ValueError(f"token_ids has shape {tuple(ids.shape)} and start is {start}: "
                         f"need [batch {kv.batch}, end] with 0 <= start < end")
    if tokens > end - start:
        raise ValueError(f"the chunk holds {tokens} tokens in a layer; tokens [{start}, "
                         f"{end}) are {end - start}")
    if kv.batch * end > codec.MAX_TOKENS:
        raise ValueError(f"a chunk ending at token {end} (batch {kv.batch}) exceeds the "
                         f"format's {codec.MAX_TOKENS} tokens")
    body = codec.encode(kv, ids[:, start:], predictor, calibration, model=model,
                        threads=threads, coder=coder, prefix=ids[:, :start])
    head = _HEAD.pack(MAGIC, VERSION, 0, start, end, prefix_hash(ids[:, :start]))
    return b"".join([head, struct.pack("<I", zlib.crc32(head)), body])


def _head(blob: bytes | memoryview) -> tuple[int, int, bytes]:
    """(start, end, prefix hash) of a chunk blob's header, every header check made."""
    mv = memoryview(blob)
    if len(mv) < 4 or bytes(mv[:4]) != MAGIC:
        raise CorruptDataError(f"not a KV chunk blob: magic {bytes(mv[:4])!r} at byte 0")
    if len(mv) < _FRONT:
        raise CorruptDataError(f"KV chunk blob truncated: {len(mv)} bytes, its header needs "
                               f"{_FRONT}")
    _, version, reserved, start, end, digest = _HEAD.unpack_from(mv, 0)
    if version != VERSION:
        raise CorruptDataError(f"KV chunk blob version {version} unsupported (this reader "
                               f"reads {VERSION})")
    if zlib.crc32(mv[: _HEAD.size]) != struct.unpack_from("<I", mv, _HEAD.size)[0]:
        raise CorruptDataError(f"KV chunk blob header CRC-32 (byte {_HEAD.size}) does not "
                               f"match")
    if reserved or not start < end <= codec.MAX_TOKENS:
        raise CorruptDataError(f"KV chunk blob header: reserved {reserved}, tokens [{start}, "
                               f"{end}) (need reserved 0 and start < end <= "
                               f"{codec.MAX_TOKENS})")
    return start, end, digest


def _front(blob: bytes | memoryview) -> tuple[int, int, bytes, codec._Front]:
    """The chunk header and its KV blob's front, checked against each other."""
    start, end, digest = _head(blob)
    h = codec._front(memoryview(blob)[_FRONT:])
    batch, seq = h.ids.shape
    if seq != end - start:
        raise CorruptDataError(f"KV chunk blob covers tokens [{start}, {end}), its KV blob "
                               f"{seq} tokens")
    if batch * end > codec.MAX_TOKENS:
        raise CorruptDataError(f"KV chunk blob ends at token {end} with batch {batch}: more "
                               f"than the format's {codec.MAX_TOKENS} tokens")
    return start, end, digest, h


def kv_chunk_info(blob: bytes) -> KVChunkInfo:
    """The token range, own ids and prefix hash a ``compress_kv_chunk`` blob carries."""
    start, end, digest, h = _front(blob)
    return KVChunkInfo(start, end, h.ids, digest)


def decompress_kv_chunk(blob: bytes, prefix_ids: torch.Tensor | None,
                        predictor: Predictor, calibration: Calibration, *,
                        threads: int | None = None, device: str | torch.device = "cpu",
                        coder: str = "auto") -> KVCache:
    """The chunk back from a ``compress_kv_chunk`` blob, bit for bit, given the ids of the
    tokens before it (``prefix_ids``, [batch, start]; None or empty for a chunk at token
    0) and the predictor and calibration that coded it; groups that hold no tokens of the
    chunk are None. ``threads``, ``device`` and ``coder`` as in ``decompress_kv``;
    ``kv_chunk_info`` gives the chunk's own ids, which extend the prefix of the next.

    ``CorruptDataError`` if the blob is malformed, the prefix ids are not those the chunk
    was coded after, or ``decompress_kv`` would raise it.
    """
    start, end, digest, h = _front(blob)
    batch = h.ids.shape[0]
    prefix = torch.zeros(batch, 0, dtype=torch.int64) if prefix_ids is None else _ids(
        prefix_ids).to(torch.int64)
    if prefix.numel() == 0 and start == 0:
        prefix = prefix.reshape(batch, 0)
    if tuple(prefix.shape) != (batch, start):
        raise CorruptDataError(f"KV chunk blob covers tokens [{start}, {end}) of batch "
                               f"{batch}: its prefix ids are [{batch}, {start}], given "
                               f"{list(prefix.shape)}")
    if prefix_hash(prefix) != digest:
        raise CorruptDataError("the prefix ids differ from those the KV chunk was coded "
                               "after (prefix hash at byte 16)")
    return codec.decode(h, memoryview(blob)[_FRONT:], predictor, calibration,
                        threads=threads, device=device, coder=coder, prefix=prefix)


def slice_kv(cache: Any, start: int, end: int, *, tokens: int | None = None) -> KVCache:
    """Tokens [start, end) of ``cache`` (a ``KVCache`` or transformers ``Cache``) as a chunk
    holds them (views, not copies): a group of s tokens holds the prompt's last s of
    ``tokens`` (default: the most any group holds), so its part is its tokens among
    [start, end), and None where it has none. ``ValueError`` where no group has any."""
    kv = as_kvcache(cache)
    tokens = max(sh[2] for sh in kv.shapes if sh) if tokens is None else tokens
    if not 0 <= start < end <= tokens:
        raise ValueError(f"need 0 <= start < end <= {tokens} tokens, got [{start}, {end})")
    out: list[list[torch.Tensor | None]] = [[], []]
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values, strict=True)):
        for i, t in enumerate((k, v)):
            first = None if t is None else tokens - t.shape[2]  # its first token's position
            lo = None if first is None else max(start, first)
            out[i].append(None if lo is None or lo >= end
                          else t[:, :, lo - first : end - first])
        if (out[0][-1] is None) != (out[1][-1] is None):
            raise ValueError(f"layer {layer}'s keys and values hold different tokens")
    if all(t is None for t in out[0]):
        raise ValueError(f"no layer holds any of tokens [{start}, {end})")
    return KVCache(out[0], out[1], kv.scales)


def concat_kv(chunks: list[KVCache]) -> KVCache:
    """Consecutive chunks of one cache (``slice_kv``'s or ``decompress_kv_chunk``'s) as one
    cache: each group's tokens concatenated in order. ``ValueError`` where they differ in
    layers or scales, or a group holds tokens in one chunk but none in a later one (a
    group holds the prompt's last tokens)."""
    if not chunks:
        raise ValueError("no chunks to concatenate")
    layers = len(chunks[0].keys)
    first = chunks[0].scales
    for c in chunks:
        if len(c.keys) != layers or (c.scales is None) != (first is None) or (
                first is not None and not torch.equal(c.scales, first)):
            raise ValueError("the chunks differ in their layers or fp8 scales")
    out: list[list[torch.Tensor | None]] = [[], []]
    for layer in range(layers):
        for kv in (0, 1):
            parts = [c.tensor(layer, kv) for c in chunks]
            held = [p is not None for p in parts]
            if held != sorted(held):
                raise ValueError(f"layer {layer} holds tokens in a chunk but none in a "
                                 f"later one")
            present = [p for p in parts if p is not None]
            out[kv].append(torch.cat(present, dim=2) if present else None)
    return KVCache(out[0], out[1], first)
