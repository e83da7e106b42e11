"""KV chunks as LMCache stores them, coded losslessly: the LMCache chunk blob.

What it is: ``encode_chunk`` / ``decode_chunk`` (a chunk of one or more groups, each a
(shape, dtype) tensor such as LMCache's ``[2, layers, 256 tokens, kv heads x head dim]``
in bf16, fp16, fp8 or fp32, to one blob and back, bit for bit), ``blob_length`` (the true
length a blob's first ``HEADER_BYTES`` state) and ``check_blob``. A blob is a header
stating its length and CRCs, then the groups coded by the container's static coders (each
group as a 2-D tensor whose columns are its last dimension, so that per-channel statistics
can bid), or their bytes as they are where coding would not make them smaller
(docs/format.md, "LMCache chunk blob"). What it is not: the plugin LMCache loads
(``entropykit.lmcache.plugin``, which imports LMCache; this module does not), or the
predictive KV coder (LMCache's serde sees no token ids and no model).
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from .. import dtypes as _dtypes
from .._errors import CorruptDataError
from ..api import tensor_source
from ..container.parallel import resolve
from ..container.reader import Compressed
from ..container.writer import write

MAGIC = b"EKLM"
VERSION = 1
CODED, RAW = 0, 1  # body modes: a compressed container holding the groups; their bytes
# magic, version, mode, reserved, total length, CRC-32 of the body; then the CRC-32 of those
_HEAD = struct.Struct("<4sBBHQI")
HEADER_BYTES = _HEAD.size + 4

def max_blob_bytes(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> int:
    """The most bytes a blob of groups of these shapes and dtypes takes: the header and the
    groups' bytes (a body that coding would not make smaller is stored as it is)."""
    return HEADER_BYTES + sum(math.prod(int(d) for d in s) * t.itemsize
                              for s, t in zip(shapes, dtypes, strict=True))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat uint8 view (``t`` contiguous)."""
    return t.reshape(-1).view(torch.uint8)


def _grid(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D tensor the container codes: rows x its last dimension."""
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 and t.numel() else t.reshape(-1)


def encode_chunk(groups: Sequence[torch.Tensor], *, threads: int | None = None) -> bytes:
    """One blob of a chunk's groups (host tensors of any safetensors dtype), decoded by
    ``decode_chunk`` into buffers of the same dtypes and sizes; never longer than
    ``HEADER_BYTES`` plus the groups' bytes. Deterministic."""
    host = [g.detach().to("cpu").contiguous() for g in groups]
    out = io.BytesIO()
    write(tensor_source({str(i): _grid(g) for i, g in enumerate(host)}, None), out,
          threads=resolve(threads))
    body, mode = out.getvalue(), CODED
    raw = sum(g.numel() * g.element_size() for g in host)
    if len(body) >= raw:
        body, mode = b"".join(_bytes(g).numpy().tobytes() for g in host), RAW
    head = _HEAD.pack(MAGIC, VERSION, mode, 0, HEADER_BYTES + len(body), zlib.crc32(body))
    return b"".join([head, struct.pack("<I", zlib.crc32(head)), body])


def _u8(blob: bytes | memoryview) -> memoryview:
    """``blob`` as a flat memoryview of bytes (LMCache's buffers have format ``<B``)."""
    return memoryview(np.frombuffer(blob, np.uint8))


def blob_length(blob: bytes | memoryview) -> int:
    """The true length a blob's header states (its first ``HEADER_BYTES`` suffice), every
    header check made; ``CorruptDataError`` if they fail."""
    mv = _u8(blob)
    if len(mv) < HEADER_BYTES or bytes(mv[:4]) != MAGIC:
        raise CorruptDataError(f"not an LMCache chunk blob: {len(mv)} bytes, magic "
                               f"{bytes(mv[:4])!r} (need {MAGIC!r} and {HEADER_BYTES} bytes)")
    _, version, mode, reserved, total, _ = _HEAD.unpack_from(mv, 0)
    if zlib.crc32(mv[: _HEAD.size]) != struct.unpack_from("<I", mv, _HEAD.size)[0]:
        raise CorruptDataError(f"LMCache chunk blob header CRC-32 (byte {_HEAD.size}) does "
                               f"not match")
    if version != VERSION or mode not in (CODED, RAW) or reserved or total < HEADER_BYTES:
        raise CorruptDataError(f"LMCache chunk blob header: version {version}, mode {mode}, "
                               f"reserved {reserved}, length {total} (this reader reads "
                               f"version {VERSION}, modes 0 and 1, length >= {HEADER_BYTES})")
    return total


def _checked(blob: bytes | memoryview) -> tuple[int, memoryview]:
    """(mode, body) of ``blob`` (bytes after its stated length ignored), its header and
    body CRC checked; ``CorruptDataError`` if a check fails."""
    mv = _u8(blob)
    total = blob_length(mv)
    if total > len(mv):
        raise CorruptDataError(f"LMCache chunk blob truncated: its header states {total} "
                               f"bytes, {len(mv)} given")
    _, _, mode, _, _, crc = _HEAD.unpack_from(mv, 0)
    body = mv[HEADER_BYTES:total]
    if zlib.crc32(body) != crc:
        raise CorruptDataError("LMCache chunk blob body CRC-32 does not match")
    return mode, body


def check_blob(blob: bytes | memoryview) -> int:
    """The length of ``blob`` (bytes after it ignored), its header and body CRC checked;
    ``CorruptDataError`` if a check fails."""
    return HEADER_BYTES + len(_checked(blob)[1])


def decode_chunk(blob: bytes | memoryview, into: Sequence[torch.Tensor], *,
                 threads: int | None = None) -> None:
    """Write the groups of ``blob`` (``encode_chunk``'s; bytes after its stated length are
    ignored) into ``into``: contiguous host tensors of the groups' dtypes and sizes, in
    order. ``CorruptDataError`` if the blob is damaged or holds other groups."""
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in into):
        raise ValueError("decode_chunk writes into contiguous host tensors only")
    mode, body = _checked(blob)
    want = [t.numel() * t.element_size() for t in into]
    if mode == RAW:
        if len(body) != sum(want):
            raise CorruptDataError(f"LMCache chunk blob holds {len(body)} bytes as they "
                                   f"are; the buffer's groups take {sum(want)}")
        at = 0
        for t, n in zip(into, want, strict=True):
            _bytes(t).numpy()[:] = np.frombuffer(body, np.uint8, n, at)
            at += n
        return
    try:
        c = Compressed(body)
    except CorruptDataError:
        raise
    except ValueError as e:
        raise CorruptDataError(f"LMCache chunk blob body: {e}") from None
    if len(c.keys()) != len(into) or set(c.keys()) != {str(i) for i in range(len(into))}:
        raise CorruptDataError(f"LMCache chunk blob holds groups {c.keys()}; the buffer "
                               f"has {len(into)}")
    for i, t in enumerate(into):
        e = c.entry(str(i))
        have = _dtypes.FROM_TORCH.get(str(t.dtype))
        if e.dtype != have or math.prod(e.shape) != t.numel():
            raise CorruptDataError(f"LMCache chunk blob group {i} is {e.dtype}{list(e.shape)}; "
                                   f"the buffer's is {have} of {t.numel()} values")
        _bytes(t).numpy()[:] = c.tensor(str(i), resolve(threads))


__all__ = ["CODED", "HEADER_BYTES", "MAGIC", "RAW", "VERSION", "blob_length", "check_blob",
           "decode_chunk", "encode_chunk", "max_blob_bytes"]
