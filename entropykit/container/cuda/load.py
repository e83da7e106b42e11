"""Load a compressed file onto a GPU: stage, copy and decode its groups, overlapped.

What it is: the device half of ``entropykit.load_file(path, device="cuda")``. The output
tensors are allocated on the device first; then for each ``fileplan.Group`` (in data
order) its streams' bytes (as the file holds them: the host copies whole fields, not
chunks), tables, context maps and descriptors (output positions bound) are written into
one pinned host buffer (``_staging.Staging``), copied to the device on a side stream in
one transfer, moved into the decoder's aligned payload layout by ``_relayout.cu``, CRC-
checked where the host did not check them (``_crc.cu``) and decoded on the current stream
by one launch per batch. ``SLOTS`` pinned buffers, each with its device twins, rotate:
while the GPU copies and decodes one group, the fill threads (``_staging.Filler``, kept
for the whole load) read the large payloads of the next two from the file straight into
their pinned buffers and copy the rest (a group's fill is started before the one before
it is waited for, so the threads never wait for the loader's own work), and a thread of
its own plans the group after (``fileplan.ahead``: the planner's threads read small
field payloads and the heads of large ones, check what they read and decode tANS/zstd
fields ahead). The kernels' statuses are read once at the
end: ``CorruptDataError`` names the tensor, segment, field (and chunk), a failed CRC
before a failed decode. ``stream`` loads several files in a row the same way through one
stager and one planning thread (a checkpoint's shards bound for one device), each file's
launches checked before its tensors are handed out; it may plan and launch the first
group at the call and go on on another thread (all of a load on one CUDA stream).
What it is not: the decision of what goes where (``fileplan.py``), the staging layout
(``_staging.py``) or the decoder (``rans.cuda``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..._cuda import cuda_device, nvrtc
from ...rans.cuda import _runtime as rt
from ...rans.cuda.plan import WARPS, Origins
from ..reader import Compressed
from ..source import Bytes
from . import _crc, fileplan
from ._staging import Fill, Filler, Staging

SLOTS = 3  # staging buffers in rotation: two filled, one copied and decoded


def _relayout_kernel() -> Any:
    return nvrtc.kernel("relayout", lambda: nvrtc.source(__package__, "_relayout.cu"),
                        ("--std=c++17",))


def relayout(device: torch.device, rows: int, n: int, src: int, dst: int) -> None:
    """Enqueue the copy of ``n`` staged payloads (int64 rows: src offset, dst offset,
    length, at device address ``rows``) from ``src`` to ``dst`` (16-byte aligned places)."""
    if n:
        nvrtc.launch(device, _relayouts(rows, n, src, dst))


def _relayouts(rows: int, n: int, src: int, dst: int) -> list[tuple[Any, int, int, tuple, int]]:
    """``relayout``'s launch as ``nvrtc.launch`` takes it (none where ``n`` is 0)."""
    if not n:
        return []
    return [(_relayout_kernel(), min(n, 4096), 256,
             (np.uint64(rows), np.int32(n), np.uint64(src), np.uint64(dst)), 0)]


def _enqueue(device: torch.device, kernels: list[tuple[Any, int, int, tuple, int]],
             launches: list[rt.Launch]) -> None:
    """``kernels`` (as ``nvrtc.launch`` takes them, no more than 48 KiB of shared memory
    each), then ``launches``, on torch's current stream of ``device``, in one CuPy device
    context: entering one and each runtime call in it hand the GIL on, and getting it
    back costs most where other threads run Python (the planner, transformers)."""
    import cupy as cp

    with cp.cuda.Device(device.index):
        stream = nvrtc.stream()  # within the device's context: its view is per device
        with stream:  # a RawKernel launches on CuPy's current stream
            for k, grid, block, args, shared in kernels:
                k((grid,), (block,), args, shared_mem=shared)
            for launch in launches:
                launch.on(stream)


@dataclass(frozen=True)
class _Staged:
    """A group whose staging buffer is being filled (``Stager.stage``), to be sent."""

    group: fileplan.Group
    st: Staging
    slot: _Slot
    binds: list  # per batch: the tensor its outputs' base addresses are read from, or None
    fill: Fill


class _Slot:
    """A pinned host buffer, its device twin, the device buffer the decoder reads
    payloads from, and the events that guard their reuse."""

    def __init__(self, staged: int, payload: int, device: torch.device) -> None:
        self.host = _pinned(staged)
        self.dev = torch.empty(staged, dtype=torch.uint8, device=device)
        self.payload = torch.empty(payload, dtype=torch.uint8, device=device)
        self.copied = torch.cuda.Event()  # the host buffer has been read
        self.done = torch.cuda.Event()  # the device buffers' last decode has finished


def _pinned(n: int) -> torch.Tensor:
    """A pinned buffer of ``n`` bytes and a quarter more: groups differ in size by up to a
    segment, and a larger one would need a new buffer (page-locking a fresh one costs
    more than filling it)."""
    return torch.empty(n + n // 4, dtype=torch.uint8, device="cpu", pin_memory=True)


class Stager:
    """Runs groups through ``SLOTS`` rotating staging buffers (see module docstring).

    A group's streams (frames and plain bytes, as the file or the host decoder holds
    them) are copied back to back into the pinned buffer with the batches' tables,
    descriptors and relayout rows, sent in one transfer, moved into the decoders' aligned
    payload layout on the device (``_relayout.cu``), and decoded, one launch per batch.
    """

    def __init__(self, device: torch.device, threads: int) -> None:
        self.device = device
        self.filler = Filler(threads)  # its threads fill every group; ``close`` stops them
        self.slots: list[_Slot] = []
        self.turn = 0
        self.copy_stream = torch.cuda.Stream(device)
        # Every step runs on the stream current where the load was started (``_one``), not
        # on that of whichever thread takes it (``stream(now=True)`` starts a load on one
        # thread and goes on on another; torch's current stream is per thread)
        self.stream = torch.cuda.current_stream(device)
        self.checks: list[tuple[torch.Tensor, list[tuple[Origins, int, int]]]] = []
        self.crcs: list[tuple[torch.Tensor, Staging]] = []  # status (and accumulators)
        self.seconds = {"slot_wait": 0.0, "fill": 0.0, "fill_wait": 0.0, "launch": 0.0,
                        "check": 0.0}

    def _slot(self, staged: int, payload: int) -> _Slot:
        if len(self.slots) < SLOTS:
            self.slots.append(_Slot(staged, payload, self.device))
            return self.slots[-1]
        slot = self.slots[self.turn % SLOTS]
        self.turn += 1
        slot.copied.synchronize()  # its last copy has read the host buffer
        if slot.host.numel() < staged:
            slot.host = _pinned(staged)
        if slot.dev.numel() < staged:
            # The old device buffers were allocated on the current stream, which orders
            # their reuse after the decodes; the copy stream's use must be recorded.
            slot.dev.record_stream(self.copy_stream)
            slot.dev = torch.empty(staged, dtype=torch.uint8, device=self.device)
        if slot.payload.numel() < payload:
            slot.payload = torch.empty(payload, dtype=torch.uint8, device=self.device)
        return slot

    def stage(self, group: fileplan.Group, views: Callable[[int, bool], torch.Tensor],
              src: Bytes | None = None) -> _Staged:
        """Start filling a staging buffer with one group: its tables and descriptors
        written here, its streams by the ``Filler``'s threads (``views(tensor, bf16)`` is
        that tensor's flat uint8, or int16 for bf16 mode, view; ``src``: the file, for the
        streams staged from it)."""
        t0 = time.perf_counter()
        st = Staging.of(group)
        slot = self._slot(st.size, st.payload)
        t1 = time.perf_counter()
        descs, binds = [], []
        for part in group.parts:
            desc, base = rt.bound_desc(part.batch, [views(t, part.batch.bf16)
                                                    for t in part.tensors])
            descs.append(desc)
            binds.append(base)
        fill = st.fill(group, slot.host.numpy(), descs, self.filler, src)
        self.seconds["slot_wait"] += t1 - t0
        self.seconds["fill"] += time.perf_counter() - t1
        return _Staged(group, st, slot, binds, fill)

    def send(self, staged: _Staged) -> None:
        """Wait for a staged group's fill; copy, relayout and launch it."""
        group, st, slot = staged.group, staged.st, staged.slot
        t1 = time.perf_counter()
        staged.fill.wait()
        t2 = time.perf_counter()
        self.copy_stream.wait_event(slot.done)
        with torch.cuda.stream(self.copy_stream):
            slot.dev[: st.size].copy_(slot.host[: st.size], non_blocking=True)
        slot.copied.record(self.copy_stream)
        cur = self.stream
        cur.wait_event(slot.copied)
        dev0, pay0 = slot.dev.data_ptr(), slot.payload.data_ptr()
        kernels = _relayouts(dev0 + st.moves_at, len(st.moves), dev0, pay0)
        k = len(st.crcs)
        rows = sum(len(part.batch.desc) for part in group.parts)
        # one buffer zeroed for the CRCs' statuses and accumulators and the decode status
        zeros = torch.zeros(2 * k + max(rows, 1), dtype=torch.int32, device=self.device)
        z0 = zeros.data_ptr()
        status = zeros[2 * k :]
        if k:
            kernels += _crc.launches(dev0 + st.crcs_at, dev0 + st.crcs_at + st.crcs.nbytes, k,
                                     int(st.first[-1]), dev0, z0 + 4 * k, z0)
            self.crcs.append((zeros[:k], st))
        row = 0
        named, launches = [], []
        for part, sec, base in zip(group.parts, st.sections, staged.binds, strict=True):
            b = part.batch
            ptrs = [dev0 + sec["desc"], status.data_ptr() + 4 * row, pay0 + sec["payload"],
                    dev0 + sec["sym"], dev0 + sec["info"], dev0 + sec["cmaps"],
                    (base if base is not None else status).data_ptr()]
            launches.append(rt.Launch(b, self.device, ptrs))
            named.append((b.origins, row, len(b.desc)))
            row += len(b.desc)
        _enqueue(self.device, kernels, launches)
        slot.done.record(cur)
        self.checks.append((status, named))
        self.seconds["fill"] += t2 - t1
        self.seconds["fill_wait"] += t2 - t1
        self.seconds["launch"] += time.perf_counter() - t2

    def check(self) -> None:
        """Wait for every launch since the last check; raise ``CorruptDataError`` for the
        first failing CRC (position CRCs first), else the first failing decode row."""
        if not self.checks and not self.crcs:
            return
        t = time.perf_counter()
        crcs, checks = self.crcs, self.checks
        self.crcs, self.checks = [], []
        everything = torch.cat([s for s, _ in crcs] + [s for s, _ in checks]).cpu().numpy()
        self.seconds["check"] += time.perf_counter() - t
        at, failed = 0, []
        for status, st in crcs:
            err = st.crc_error(everything[at : at + status.numel()])
            if err is not None:
                failed.append(err)
            at += status.numel()
        if failed:
            raise min(failed, key=lambda e: e[0])[1]  # the first of the lowest rank
        for status, named in checks:
            for origins, row, n in named:
                err = origins.error(everything[at + row : at + row + n])
                if err is not None:
                    raise err
            at += status.numel()


def load(c: Compressed, device: Any, dtypes: Mapping[str, torch.dtype],
         threads: int, *, names: Collection[str] | None = None, warps: int = WARPS,
         group_bytes: int = fileplan.GROUP_BYTES,
         seconds: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of ``c`` (a compressed file; only ``names`` if given) decoded on
    ``device``, in data order, as ``dtypes`` (safetensors dtype -> torch dtype) says.
    ``seconds``, if given, receives where the host's time went (waiting for the planner,
    for a staging buffer, filling them, launching, the final wait)."""
    loads = stream([(c, names)], device, dtypes, threads, warps=warps,
                   group_bytes=group_bytes, seconds=seconds)
    try:
        return next(loads)
    finally:
        loads.close()  # the planning and fill threads stop


def stream(jobs: Iterable[tuple[Compressed, Collection[str] | None]], device: Any,
           dtypes: Mapping[str, torch.dtype], threads: int, *, warps: int = WARPS,
           group_bytes: int = fileplan.GROUP_BYTES,
           seconds: dict[str, float] | None = None,
           now: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """``load`` of each job (a compressed file, and the names wanted of it or None for
    all), one after another through one ``Stager`` (its fill threads and staging
    buffers) and one planning thread, which plans on into the next file while this one's
    last groups are filled and decoded: a file's tensors are allocated when its turn
    comes (after the one before is handed out) and yielded once its launches are
    checked. ``seconds`` holds the running totals (``load``'s, and ``busy``: the host
    time spent in the steps). ``now``: the first file's first group is planned, staged
    and launched before this returns, on the calling thread, and the rest on the thread
    that asks for the files (a caller about to start threads of its own that run Python
    gets the plan done before they compete with it for the GIL); an error doing so is
    raised when the first file is asked for."""
    loads = _stream(jobs, device, dtypes, threads, warps, group_bytes, seconds, now)
    if now:
        try:
            next(loads)  # the pause after the first group's launch
        except Exception as e:  # noqa: BLE001 -- raised where the file is asked for
            return _raising(e)
    return loads


def _raising(e: Exception) -> Iterator[dict[str, torch.Tensor]]:
    raise e
    yield  # a generator: raises when first asked


_PAUSE = None  # what ``_stream`` yields once, when ``now``, after the first launch


def _stream(jobs: Iterable[tuple[Compressed, Collection[str] | None]], device: Any,
            dtypes: Mapping[str, torch.dtype], threads: int, warps: int, group_bytes: int,
            seconds: dict[str, float] | None, now: bool
            ) -> Iterator[dict[str, torch.Tensor] | None]:
    """``stream``'s files, after one ``_PAUSE`` where ``now``."""
    dev = cuda_device(device)
    picked: list[tuple[Compressed, list]] = []  # each job's entries, as the planner takes them

    def plans() -> Iterator[tuple[int, fileplan.Group | None]]:
        for j, (c, names) in enumerate(jobs):
            entries = c.original.by_offset
            if names is not None:
                keep = frozenset(names)
                entries = [e for e in entries if e.name in keep]
            for e in entries:  # raised in turn, before the file's plan
                if e.dtype not in dtypes:
                    raise TypeError(f"tensor {e.name!r}: torch has no dtype for {e.dtype}")
            picked.append((c, entries))
            for group in fileplan.groups(c, fileplan.plan_threads(c, entries, threads),
                                         entries=entries, warps=warps,
                                         group_bytes=group_bytes):
                yield j, group
            yield j, None  # the job's last group

    with torch.cuda.device(dev):
        stager = Stager(dev, threads)
    planned = fileplan.ahead(plans())
    wait = busy = 0.0
    try:
        j = 0
        while True:
            t0 = time.perf_counter()
            first = next(planned, None)  # the job's entries are picked before it is made
            wait += time.perf_counter() - t0
            if first is None:
                return
            c, entries = picked[j]
            steps = _one(stager, planned, first, j, c, entries, dtypes, now and j == 0)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    out, w = done.value
                    break
                busy += time.perf_counter() - t0
                yield _PAUSE
                t0 = time.perf_counter()
            wait += w
            j += 1
            busy += time.perf_counter() - t0
            if seconds is not None:
                seconds.update(stager.seconds, plan_wait=wait, busy=busy)
            yield out
    finally:
        planned.close()  # the planning thread stops
        stager.filler.close()  # after the fills submitted (their buffers are alive)


def _one(stager: Stager, planned: Iterator[tuple[int, fileplan.Group | None]],
         first: tuple[int, fileplan.Group | None], j: int, c: Compressed, entries: list,
         dtypes: Mapping[str, torch.dtype], pause: bool
         ) -> Generator[None, None, tuple[dict[str, torch.Tensor], float]]:
    """Job ``j``'s tensors (file ``c``, ``entries`` of it): its groups from ``planned``
    (``first`` already taken) staged, sent and checked; returned with the seconds spent
    waiting for the planner. ``pause``: yields once, after its first group's launch
    (before its check if it has none), outside any device context, so that the rest
    may run on another thread."""
    dev = stager.device

    def on() -> contextlib.ExitStack:
        """The load's device and stream current (see ``Stager.stream``)."""
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.cuda.device(dev))
        ctx.enter_context(torch.cuda.stream(stager.stream))
        return ctx

    with on():
        out = {e.name: torch.empty(e.shape, dtype=dtypes[e.dtype], device=dev)
               for e in entries}
    flat = [out[e.name].reshape(-1) for e in entries]

    def views(k: int, bf16: bool) -> torch.Tensor:
        return flat[k].view(torch.int16 if bf16 else torch.uint8)

    wait = 0.0
    item: tuple[int, fileplan.Group | None] | None = first
    pending: _Staged | None = None
    while True:
        if item is None or item[0] != j:  # the planner ended early
            raise RuntimeError("entropykit: the GPU load's plan lost its place")
        group = item[1]
        with on():
            staged = None if group is None else stager.stage(group, views, c.source)
            if pending is not None:
                stager.send(pending)  # its fill done while this one's starts
        if pending is not None and pause:
            pause = False
            yield
        if staged is None:
            break
        pending = staged
        t = time.perf_counter()
        item = next(planned, None)  # planned while the last group is filled
        wait += time.perf_counter() - t
    if pause:
        yield
    with on():
        stager.check()
    return out, wait
