"""A distribution-rANS frame's chunk directory read where the frame lies (torch).

What it is: from a frame tensor and its validated header, the int64 [chunks, 4] table the
decoder kernel reads (payload offset, length, mode, CRC-32), built with a few torch ops on
the frame's device, and the two facts ``distribution.parse`` checks in the directory (the
byte where the payloads end, the first chunk of unknown mode and that mode), which the host
reads back with the chunks' status. So a frame already on the GPU is decoded after one
28-byte read of its header, not two blocking reads of its directory and an upload of the
table (~1 ms of host time for 256 MiB, while the GPU waited). A directory that fails the
checks gives a table of empty coded chunks: the kernel reads no payload byte, and the host
raises ``parse``'s error (``distribution.directory_error``) before any chunk's.
What it is not: the header's parse (``distribution.parse_header``, on the host).
"""

from __future__ import annotations

import torch

from .._errors import CorruptDataError
from ..rans import distribution as D

_LE = (1, 1 << 8, 1 << 16, 1 << 24)  # little-endian u32 from 4 bytes


def directory(frame: torch.Tensor, header: D.FrameHeader) -> tuple[torch.Tensor, torch.Tensor]:
    """(table int64 [n_chunks, 4], facts int64 [3]: payload end, first chunk of unknown
    mode or -1, its mode or 0) of a flat uint8 ``frame`` whose header is ``header``
    (``parse_header`` of it: so its directory lies inside it)."""
    nc, base = header.n_chunks, header.payload_base
    d = frame[D.HEADER_SIZE : base].to(torch.int64)
    le = torch.tensor(_LE, dtype=torch.int64, device=frame.device)
    lengths = (d[: 4 * nc].view(nc, 4) * le).sum(1)
    crcs = (d[4 * nc : 8 * nc].view(nc, 4) * le).sum(1)
    modes = d[8 * nc :]
    ends = torch.cumsum(lengths, 0) + base
    chunk = torch.arange(nc, dtype=torch.int64, device=frame.device)
    bad = torch.where(modes > D.MODE_RAW, chunk, nc).min()
    ok = (ends[-1] == frame.numel()) & (bad == nc)
    table = torch.stack([ends - lengths, lengths, modes, crcs], 1) * ok
    found = bad < nc
    facts = torch.stack([ends[-1], torch.where(found, bad, -1),
                         torch.where(found, modes[bad.clamp(max=nc - 1)], 0)])
    return table, facts


def check(facts: list[int], size: int) -> None:
    """Raise ``parse``'s ``CorruptDataError`` for a directory's facts (host ints)."""
    err = D.directory_error(facts[0], size, facts[1], facts[2])
    if err is not None:
        raise CorruptDataError(err)
