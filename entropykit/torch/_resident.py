"""Resident mode's machinery: blocks, a scratch buffer, hooks that decode before each forward.

What it is: a model's weights grouped into units (each block of a repeated
``nn.ModuleList``, and every other module holding weights of its own, such as embeddings
and the output head), in the order the modules are registered, which is the order they
run in. Each unit's coded weights always decode to the same region of one scratch buffer:
even units at its front, odd units at its back, so a unit and the next are apart where
both fit; the modules' weights are fixed views into the region. A unit's forward pre-hook
makes the compute stream wait for the unit's decode (issued then if it was not
prefetched) and prefetches the next unit where their regions are apart, so the next
decode overlaps this unit's compute. The hooks only enqueue work: no allocation or host
synchronisation, so a forward can be captured in a CUDA graph. The CPU backend decodes
with the CPU decoders through the same hooks (nothing overlaps there).
What it is not: the coding (``_coded.py``) or the CUDA launches (``_cuda.py``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._coded import ALIGN, FORMATS, CodedTensor, code_tensor, decode_into, raw_bytes


class CpuDecoder:
    """A unit's coded tensors in host memory, decoded by the CPU decoders."""

    reads_fields = True  # decodes from the coded tensors' fields

    def __init__(self, coded: Sequence[CodedTensor], region: torch.Tensor) -> None:
        self.coded = tuple(coded)
        self.region = region.numpy()

    @property
    def nbytes(self) -> int:
        return sum(f.data.nbytes for c in self.coded for f in c.fields)

    def run(self) -> None:
        for c in self.coded:
            decode_into(c, self.region[c.offset : c.end])

    def check(self) -> None:
        """Nothing to check: the CPU decoders raise as they decode."""


class CpuStreams:
    """The CPU's order: every decode runs when it is asked for."""

    def now(self, decoder: CpuDecoder) -> None:
        decoder.run()

    def prefetch(self, u: int, decoder: CpuDecoder) -> None:
        decoder.run()

    def join(self, u: int) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _backend(device: torch.device, units: int
             ) -> tuple[Any, Callable[[Sequence[CodedTensor], torch.Tensor], Any]]:
    """The streams object and decoder factory (coded tensors, region) of ``device``."""
    if device.type == "cuda":
        from ._cuda import CudaDecoder, CudaStreams

        return (CudaStreams(device, units),
                lambda coded, region: CudaDecoder(coded, region, device))
    return CpuStreams(), CpuDecoder


@dataclass(frozen=True)
class Weight:
    """A parameter made resident: where it was and how it is coded."""

    owner: nn.Module
    name: str
    requires_grad: bool
    coded: CodedTensor


@dataclass
class Unit:
    module: nn.Module
    weights: list[Weight]
    block: bool = False  # one of a repeated ModuleList's modules
    size: int = 0  # bytes of its place in the scratch buffer
    region: torch.Tensor | None = None  # that place
    prefetch: bool = False  # decoded while the unit before runs (their places are apart)
    decoder: Any = None
    hook: Any = None


def _blocks(model: nn.Module) -> list[nn.Module]:
    """Children of the outermost ``nn.ModuleList``s of two or more modules of one class."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList):
            continue
        kids = list(m)
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1:
            found += kids
            inside |= {id(x) for k in kids for x in k.modules()}
    return found


def _units(model: nn.Module, min_elements: int) -> list[Unit]:
    """The model's units in registration order, each with the weights it makes resident:
    parameters of two or more dimensions, a dtype of ``FORMATS``, at least
    ``min_elements`` elements, and used by one module only (tied weights stay plain)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1

    def weights(m: nn.Module, recurse: bool) -> list[Weight]:
        out = []
        for owner in (m.modules() if recurse else [m]):
            for name, p in owner.named_parameters(recurse=False):
                if (p.dim() >= 2 and p.dtype in FORMATS and p.numel() >= min_elements
                        and uses[id(p)] == 1):
                    out.append(Weight(owner, name, p.requires_grad, None))
        return out

    blocks = {id(b) for b in _blocks(model)}
    inside = {id(x) for m in model.modules() if id(m) in blocks for x in m.modules()}
    units = []
    for m in model.modules():
        if id(m) in blocks:
            ws = weights(m, True)
        elif id(m) in inside:
            continue
        else:
            ws = weights(m, False)
        if ws:
            units.append(Unit(m, ws, block=id(m) in blocks))
    return units


@dataclass(frozen=True)
class ResidentMemory:
    """Device memory of a resident model's weights, in bytes."""

    coded_bytes: int  # coded weights: payload, decode tables, descriptors, statuses
    scratch_bytes: int  # the buffer weights decode into
    uncompressed_bytes: int  # the resident weights decoded (what they took before)
    plain_bytes: int  # parameters and buffers left as they were
    tensors: int  # resident weights

    @property
    def ratio(self) -> float:
        """(coded + scratch) / uncompressed: resident weights' memory against plain."""
        return (self.coded_bytes + self.scratch_bytes) / max(1, self.uncompressed_bytes)


class Resident:
    """A model's resident state: units, scratch buffer, hooks (``model._entropykit_resident``)."""

    def __init__(self, model: nn.Module, units: list[Unit], device: torch.device) -> None:
        self.model = model
        self.units = units
        self.device = device
        self.pending: int | None = None  # the unit prefetched and not yet waited for
        self.scratch: torch.Tensor | None = None
        self.streams: Any = None
        self.hooks: list[Any] = []

    def build(self, verify: bool) -> None:
        """Code every unit's weights, allocate the scratch buffer, point the weights at it
        and install the hooks. With ``verify``, each unit is decoded once and compared with
        its weights, bit for bit, before they are dropped. Unit by unit, so the host holds
        one unit's coded weights at a time; on an error the model is left as it was."""
        places = []
        for u in self.units:  # each weight's offset in its unit's region, ALIGNed
            at, offsets = 0, []
            for w in u.weights:
                p = getattr(w.owner, w.name)
                offsets.append(at)
                at += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
            places.append(offsets)
            u.size = at
        # Even units decode to the front of the buffer, odd ones to its back, so a unit and
        # the next are apart where both fit: the buffer holds the largest unit, and two
        # neighbouring blocks. A unit that does not fit beside the one before (embeddings
        # and heads, larger than blocks) decodes after it instead of during it.
        size = max([u.size for u in self.units] + [0] + [
            a.size + b.size for a, b in itertools.pairwise(self.units) if a.block and b.block])
        for a, b in itertools.pairwise(self.units):
            b.prefetch = a.size + b.size <= size
        self.scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.streams, make = _backend(self.device, len(self.units))
        done: list[Unit] = []
        try:
            for k, (u, offsets) in enumerate(zip(self.units, places, strict=True)):
                u.weights = [Weight(w.owner, w.name, w.requires_grad,
                                    code_tensor(getattr(w.owner, w.name), at))
                             for w, at in zip(u.weights, offsets, strict=True)]
                base = 0 if k % 2 == 0 else size - u.size
                u.region = self.scratch[base : base + u.size]
                u.decoder = make([w.coded for w in u.weights], u.region)
                if verify:
                    self._verify(u)
                if not u.decoder.reads_fields:  # the device holds them now, not the host
                    u.weights = [Weight(w.owner, w.name, w.requires_grad,
                                        dataclasses.replace(w.coded, fields=()))
                                 for w in u.weights]
                for w in u.weights:
                    del w.owner._parameters[w.name]
                    setattr(w.owner, w.name, w.coded.view(u.region))
                done.append(u)
        except BaseException:
            self._decode_back(done)
            raise
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights just freed
        for k, u in enumerate(self.units):
            u.hook = u.module.register_forward_pre_hook(
                lambda m, args, kwargs, k=k: self.before(k, args, kwargs), with_kwargs=True)
        self.hooks = [u.hook for u in self.units]
        self.hooks.append(self.model.register_forward_hook(lambda m, a, out: self.join()))

    def _verify(self, u: Unit) -> None:
        u.decoder.run()
        self.streams.synchronize()
        u.decoder.check()
        for w in u.weights:
            weight = raw_bytes(getattr(w.owner, w.name)).to(u.region.device)
            if not torch.equal(w.coded.bytes_in(u.region), weight):
                raise RuntimeError(f"entropykit: {type(w.owner).__name__}.{w.name} did not "
                                   "decode to its weight")

    def before(self, k: int, args: tuple, kwargs: dict) -> None:
        """Unit ``k``'s pre-hook: its weights are decoded, the next unit's on the way."""
        if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad
                for a in (*args, *kwargs.values())):
            raise RuntimeError("entropykit: a resident model runs inference only (its "
                               "weights are overwritten by the next blocks): use "
                               "torch.no_grad() or decompress_model first")
        hit = self.pending == k
        self.join()
        if not hit:
            self.streams.now(self.units[k].decoder)
        if k + 1 < len(self.units) and self.units[k + 1].prefetch:
            self.streams.prefetch(k + 1, self.units[k + 1].decoder)
            self.pending = k + 1

    def join(self) -> None:
        """The compute stream waits for the prefetched unit (if any)."""
        if self.pending is not None:
            self.streams.join(self.pending)
            self.pending = None

    def memory(self) -> ResidentMemory:
        plain = sum(t.numel() * t.element_size()
                    for t in (*self.model.parameters(), *self.model.buffers()))
        return ResidentMemory(
            coded_bytes=sum(u.decoder.nbytes for u in self.units),
            scratch_bytes=self.scratch.numel(),
            uncompressed_bytes=sum(w.coded.nbytes for u in self.units for w in u.weights),
            plain_bytes=plain,
            tensors=sum(len(u.weights) for u in self.units),
        )

    def restore(self) -> None:
        """Decode every weight back into a parameter of its own and remove the hooks."""
        for h in self.hooks:
            h.remove()
        self.join()
        self._decode_back(self.units)
        self.units = []
        self.scratch = None

    def _decode_back(self, units: list[Unit]) -> None:
        for u in units:
            self.streams.now(u.decoder)
            for w in u.weights:
                t = w.coded.view(u.region).clone()
                delattr(w.owner, w.name)
                w.owner.register_parameter(w.name, nn.Parameter(t, w.requires_grad))
        self.streams.synchronize()
