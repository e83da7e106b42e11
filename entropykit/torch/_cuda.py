"""The CUDA backend of resident mode: coded weights on the device, decodes as bound launches.

What it is: ``CudaDecoder``, a block's coded tensors uploaded once (``rans.cuda``'s
planner and ``DeviceBatch``: payload, decode tables, descriptors) with one bound launch
per kernel mode and scratch buffer, fixed at compress time, so a decode only enqueues
kernels on torch's current stream: no allocation, no copy, no host synchronisation, and
it can be captured in a CUDA graph. ``CudaStreams`` orders decodes with the forward: a
prefetch runs on a side stream (one of ``ahead``, in turn) after an event recorded on
the compute stream, and the compute stream waits for its own event before the block runs.
What it is not: the coding (``_coded.py``) or the hooks (``_resident.py``). Imported only
for a model on a CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rans import cuda as rans_cuda
from ..rans.cuda.plan import Batch, Place, Planner, Stream
from ._coded import CodedTensor


def _streams(c: CodedTensor, k: int) -> list[Stream]:
    return [Stream.frame(f.data, f"tensor {k} {f.name}") if f.coded
            else Stream.plain(f.data, f"tensor {k} {f.name}") for f in c.fields]


def plan(coded: Sequence[CodedTensor]) -> list[tuple[list[CodedTensor], Batch]]:
    """The launches of ``coded`` (host side): the bf16 tensors' batch, then the others'."""
    out = []
    for bf16 in (True, False):
        group = [c for c in coded if c.pair == bf16]
        if not group:
            continue
        p = Planner(bf16)
        for k, c in enumerate(group):
            s = _streams(c, k)
            if bf16:
                p.add_pair(s[0], s[1], Place(k))
            else:
                for f, st in zip(c.fields, s, strict=True):
                    p.add(st, Place(k, f.byte, c.itemsize))
        out.append((group, p.finish([c.nbytes // (2 if bf16 else 1) for c in group])))
    return out


def planned_bytes(coded: Sequence[CodedTensor]) -> int:
    """Device bytes ``CudaDecoder(coded, ...)`` holds, computed on the host: payload,
    decode tables, context maps, statuses and descriptors of each launch."""
    return sum(b.payload_size + b.sym_tables.nbytes + b.info_tables.nbytes + b.cmaps.nbytes
               + 4 * max(1, len(b.desc)) + b.desc.nbytes for _, b in plan(coded))


class CudaDecoder:
    """Coded tensors on one CUDA device, decoding into ``region`` (uint8) in one launch
    per kernel mode."""

    reads_fields = False  # uploaded at construction; the host copies may go

    def __init__(self, coded: Sequence[CodedTensor], region: torch.Tensor,
                 device: torch.device) -> None:
        rt = rans_cuda.load_runtime(device)
        self.device = device
        self.launches: list = []
        self.held: list[torch.Tensor] = []  # every device buffer the launches read
        self._checks = []  # (origins, status) of each batch, for check()
        for group, batch in plan(coded):
            db = rt.DeviceBatch(batch, device)
            self.held += [db.payload, db.sym_tables, db.info_tables, db.cmaps, db.status]
            self._checks.append((batch.origins, db.status[: len(batch.desc)]))
            bound = db.bind([c.view(region).reshape(-1) if batch.bf16 else c.bytes_in(region)
                             for c in group])
            self.held.append(bound.desc)
            self.launches.append(bound)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.held)

    def run(self) -> None:
        """Enqueue the decode on the current stream."""
        for launch in self.launches:
            launch()

    def check(self) -> None:
        """Raise ``CorruptDataError`` if a decode met corrupt data (synchronizes)."""
        for origins, status in self._checks:
            err = origins.error(status.cpu().numpy())
            if err is not None:
                raise err


class CudaStreams:
    """Decodes ordered with the compute stream: now, or prefetched on one of ``sides``
    side streams, taken in turn, so that up to ``sides`` prefetched decodes (each into a
    place apart from the others') run at once, more warps than one small decode fills."""

    def __init__(self, device: torch.device, units: int, sides: int = 1) -> None:
        self.device = device
        self.sides = [torch.cuda.Stream(device) for _ in range(sides)]
        self.turn = 0
        self.free = [torch.cuda.Event() for _ in range(units)]
        self.ready = [torch.cuda.Event() for _ in range(units)]

    def now(self, decoder: CudaDecoder) -> None:
        with torch.cuda.device(self.device):
            decoder.run()

    def prefetch(self, u: int, decoder: CudaDecoder) -> None:
        # The side stream starts once the compute stream has done everything enqueued so
        # far: every block before the one about to run, which may share unit u's place.
        side = self.sides[self.turn]
        self.turn = (self.turn + 1) % len(self.sides)
        with torch.cuda.device(self.device):
            self.free[u].record(torch.cuda.current_stream(self.device))
            side.wait_event(self.free[u])
            with torch.cuda.stream(side):
                decoder.run()
            self.ready[u].record(side)

    def join(self, u: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready[u])

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
