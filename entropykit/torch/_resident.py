"""Resident mode's machinery: units, a scratch buffer, hooks that decode before each forward.

What it is: a model's weights grouped into units, in the order the modules are registered,
which is the order they run in: each block of a repeated ``nn.ModuleList`` (or, by weight,
each module of a block holding weights), every other module holding weights of its own,
and the row tiles of an embedding or Linear weight larger than the largest block (or
tied to another module: embeddings shared with the output head), which the module's
forward decodes one tile at a time (the lookup picks each tile's rows, the head writes
each tile's slice of the output; on a GPU, an embedding's lookup decodes only the chunks
holding the rows its ids read, also where the weight is tied to the head, whose tiles
then decode ranges of the same coded chunks; a Linear's tiles are checked against its whole
product first, ``exact_tiles``). Units decode in launches: a unit alone, or up to
``tiles_ahead`` consecutive tiles together (more chunks, so more warps, per launch). The
scratch buffer is a ring of ``ahead + 1`` slots, each the size of the largest launch,
taken in turn (by weight: a ring of bytes as large as the two largest consecutive
launches, each launch placed apart from the one before it). Block weights are fixed
views into their region; a launch's consecutive weights of one dtype are coded as one
tensor over their bytes there (``_runs``: one set of decode tables, chunks across them),
in chunks chosen per launch by block (``launch_chunk``) and per tensor by weight
(``chunk_for``). A
unit's forward pre-hook (a tile's: its module's forward) makes the compute stream wait for
its launch (issued then if it was not prefetched; nothing to do for a tile entered right
after the one before it in the same launch) and prefetches up to ``ahead`` launches after
it whose places are apart from every launch before them that has not computed yet, so
their decodes overlap this launch's compute (and, on ``ahead`` side streams, each
other). The hooks only enqueue work, with no host
synchronisation, so a forward can be captured in a CUDA graph. The CPU backend decodes with
the CPU decoders through the same hooks (nothing overlaps there: a prefetch decodes at
once, as early as the side stream could).
What it is not: the coding (``_coded.py``) or the CUDA launches (``_cuda.py``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..coding import parallel
from ..coding.frame import MAX_CHUNK
from ..container.codecs import GPU_CHUNK
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


def _backend(device: torch.device, units: int, sides: int
             ) -> tuple[Any, Callable[[Sequence[CodedTensor], torch.Tensor], Any]]:
    """The streams object (``sides`` side streams for prefetches) and decoder factory
    (coded tensors, region) of ``device``."""
    if device.type == "cuda":
        from ._cuda import CudaDecoder, CudaStreams

        return (CudaStreams(device, units, sides),
                lambda coded, region: CudaDecoder(coded, region, device))
    return CpuStreams(), CpuDecoder


def _gatherer(device: torch.device) -> Callable[..., Any] | None:
    """The factory of gathered decoders (coded, chunk, slots, region) of ``device``, or
    None where embeddings decode in tiles (the CPU decoders decode whole frames)."""
    if device.type == "cuda":
        from ._cuda import GatherDecoder

        return lambda coded, chunk, slots, region: GatherDecoder(coded, chunk, slots,
                                                                 region, device)
    return None


@dataclass(frozen=True)
class Weight:
    """A parameter made resident whole: where it was and how it is coded."""

    owner: nn.Module
    name: str
    requires_grad: bool
    coded: CodedTensor


@dataclass
class Tiled:
    """A weight decoded in row tiles by the forwards of the modules holding it: an
    ``nn.Embedding``'s or ``nn.Linear``'s, one weight shared by several (tied) or not."""

    owners: list[nn.Module]  # each holds it as ``weight``
    requires_grad: bool
    dtype: torch.dtype
    shape: tuple[int, ...]
    rows: list[tuple[int, int]]  # each tile's rows [a, b)
    units: list[int] = dataclasses.field(default_factory=list)  # per owner: its first unit
    # the unit of a tied embedding whose lookup decodes the rows it reads, from the same
    # coded chunks as these tiles (then the tiles' decoders are ranges of its chunks)
    lookup: int | None = None

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize


@dataclass
class Gathered:
    """An embedding weight whose lookup decodes only the chunks holding the rows it reads,
    ``span`` chunks a row (one where chunks hold whole rows), decoded ``slots`` chunks at
    a time."""

    owner: nn.Embedding
    requires_grad: bool
    dtype: torch.dtype
    shape: tuple[int, int]
    chunk: int  # symbols per chunk
    slots: int  # chunks one decode holds, a multiple of ``span``
    coded: CodedTensor | None = None
    span: int = 1  # chunks a row may touch
    tied: Tiled | None = None  # the tiles of the Linears sharing the weight

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def rows_per_chunk(self) -> int:
        return self.chunk // self.shape[1]

    @property
    def chunks(self) -> int:
        return -(-math.prod(self.shape) // self.chunk)


# Chunks of a gathered embedding: at least this many symbols (a chunk's states and
# descriptor cost coded bytes), in whole rows.
GATHER_CHUNK = 1 << 14


def _gather_chunk(m: nn.Module, name: str, p: torch.Tensor) -> int | None:
    """Symbols per chunk of ``m.weight`` if its lookup can decode just the rows it reads: a
    stock embedding's bf16 rows of a power-of-two width (chunks of whole rows)."""
    width = p.shape[-1]
    if not (isinstance(m, nn.Embedding) and _tileable(m, name) and p.dim() == 2
            and p.dtype == torch.bfloat16 and width & (width - 1) == 0):
        return None
    chunk = max(width, GATHER_CHUNK)
    return chunk if chunk <= MAX_CHUNK else None


def _tied_lookup(m: nn.Module, p: torch.Tensor, users: list[nn.Module], cap: int,
                 tiled: Tiled) -> Gathered | None:
    """The gathered lookup of ``m``, a stock bf16 embedding whose weight the stock Linears
    after it share (their forwards decode ``tiled``'s tiles), if chunks of one size cut
    every tile at its first row: the largest power of two up to ``GATHER_CHUNK`` that
    does, at least ``SMALLEST_CHUNK`` (or ``GATHER_CHUNK`` if smaller). The weight is
    coded once in those chunks; a row touches ``span`` of them."""
    if not (isinstance(m, nn.Embedding) and p.dim() == 2 and p.dtype == torch.bfloat16
            and users[0] is m and all(isinstance(u, nn.Linear) for u in users[1:])):
        return None
    width = p.shape[1]
    chunk = GATHER_CHUNK
    while chunk > 1 and any(a * width % chunk for a, _ in tiled.rows):
        chunk //= 2
    if chunk < min(GATHER_CHUNK, SMALLEST_CHUNK):
        return None
    span = 1 if chunk % width == 0 else -(-width // chunk) + 1
    n = -(-p.numel() // chunk)
    slots = max(span, min(n, cap // (chunk * p.element_size()))) // span * span
    return Gathered(m, p.requires_grad, p.dtype, tuple(p.shape), chunk, slots,
                    span=span, tied=tiled)


@dataclass
class Unit:
    module: nn.Module
    weights: list[Weight]  # weights decoded whole (none for a tile)
    block: bool = False  # a repeated ModuleList's module, or a module of one (tile_bytes)
    tiled: Tiled | None = None  # a tile of this weight ...
    gathered: Gathered | None = None  # an embedding decoding the rows it reads
    tile: int = 0  # ... this one
    size: int = 0  # bytes of its place in the scratch buffer
    region: torch.Tensor | None = None  # that place
    prefetch: bool = False  # a lead's: decoded while a launch before it runs (places apart)
    decoder: Any = None
    coded: CodedTensor | None = None  # a tile's, as it decodes into ``region``
    hook: Any = None
    lead: int = 0  # the first unit of the launch this unit decodes in (tiles_ahead)
    after: int | None = None  # a lead's: the next launch's lead
    place: torch.Tensor | None = None  # a lead's: its launch's region (its units' regions)

    @property
    def rows(self) -> tuple[int, int]:
        return self.tiled.rows[self.tile]

    @property
    def shared(self) -> bool:
        """A tile of a tied weight met again: coded and placed by its first owner."""
        return self.tiled is not None and self.tiled.owners[0] is not self.module


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


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _tileable(m: nn.Module, name: str) -> bool:
    """Whether ``m``'s forward is the stock lookup or product of ``m.weight``, which a tiled
    forward reproduces bit for bit (``max_norm`` would rewrite the weight)."""
    if name != "weight":
        return False
    if type(m).forward is nn.Linear.forward:
        return True
    return type(m).forward is nn.Embedding.forward and m.max_norm is None


# Tile rows are a multiple of the first of these the cap allows, so that tiles keep the
# shapes matrix kernels are blocked for (the CPU's narrow products round differently).
_ROW_MULTIPLES = (256, 64, 8)


def _tile_rows(n_rows: int, row_bytes: int, cap: int) -> list[tuple[int, int]]:
    """Row ranges of near-equal tiles of at most ``cap`` bytes (at least one row each)."""
    most = max(1, cap // row_bytes)
    rows = -(-n_rows // -(-n_rows // most))
    for q in _ROW_MULTIPLES:
        if q <= most:
            rows = min(-(-rows // q) * q, most // q * q)
            break
    return [(a, min(a + rows, n_rows)) for a in range(0, n_rows, rows)]


def _units(model: nn.Module, min_elements: int, tile_bytes: int | None = None,
           by_weight: bool = False, gather: bool = False,
           plan: dict[int, list[tuple[int, int]] | None] | None = None) -> list[Unit]:
    """The model's units in running order. Resident weights: parameters of two or more
    dimensions, a dtype of ``FORMATS``, at least ``min_elements`` elements, and used by one
    module only, or by several stock embeddings or Linears (tied). With ``by_weight``, a
    block decodes module by module, each module's weights whole. An embedding's or
    Linear's weight larger than ``tile_bytes`` (default: the largest block's), or
    tied, decodes in row tiles; with ``tile_bytes`` given and not ``by_weight``, a block
    larger than that decodes module by module (stock Linears in tiles). Blocks whose
    weights sit in modules with children of their own stay whole. ``tile_bytes`` is
    checked by the caller. With ``gather``, an embedding's weight used by it alone
    (bf16, rows of a power-of-two width) decodes only the chunks of the rows each lookup
    reads, up to a tile's bytes of chunks at a time. ``plan`` (by the weight's ``id``):
    a tiled weight's rows instead of its tiles of ``tile_bytes``, or None to leave it
    plain (``exact_tiles``)."""
    plan = {} if plan is None else plan
    owners: dict[int, list[nn.Module]] = {}
    names: dict[int, set[str]] = {}
    for m in model.modules():
        for name, p in m.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
            names.setdefault(id(p), set()).add(name)

    def coded(p: torch.Tensor) -> bool:
        return p.dim() >= 2 and p.dtype in FORMATS and p.numel() >= min_elements

    def whole(m: nn.Module, recurse: bool) -> list[Weight]:
        return [Weight(owner, name, p.requires_grad, None)
                for owner in (m.modules() if recurse else [m])
                for name, p in owner.named_parameters(recurse=False)
                if coded(p) and len(owners[id(p)]) == 1]

    blocks = {id(b) for b in _blocks(model)}
    inside = {id(x) for m in model.modules() if id(m) in blocks for x in m.modules()}

    def size(ws: list[Weight]) -> int:
        return sum(_aligned(getattr(w.owner, w.name).numel()
                            * getattr(w.owner, w.name).element_size()) for w in ws)

    def split(ws: list[Weight]) -> bool:
        # modules without children only, so that no unit's module runs inside another's
        return bool(ws) and not any(next(w.owner.children(), None) for w in ws)

    def by_module(ws: list[Weight]) -> list[list[Weight]]:
        return [[w for w in ws if w.owner is o] for o in dict.fromkeys(w.owner for w in ws)]

    # Tiles are the largest launch of a block's weights: a whole block, or by weight a
    # module's weights (a block whose weights sit in nested modules stays whole), so that
    # the scratch buffer holds two tiles, or a tile and a block's launch, and no more.
    block_size = max([max([size(mine) for mine in by_module(ws)] if by_weight and split(ws)
                          else [size(ws)])
                      for ws in (whole(m, True) for m in model.modules() if id(m) in blocks)]
                     + [0])
    cap = tile_bytes if tile_bytes is not None else block_size or _DEFAULT_TILE
    tiled: dict[int, Tiled] = {}
    units: list[Unit] = []

    def tile(t: Tiled, m: nn.Module) -> None:
        t.units.append(len(units))
        units.extend(Unit(m, [], tiled=t, tile=i) for i in range(len(t.rows)))

    def new_tiled(p: torch.Tensor, users: list[nn.Module]) -> Tiled:
        rows = plan.get(id(p)) or _tile_rows(p.shape[0], p[0].numel() * p.element_size(),
                                             cap)
        return Tiled(users, p.requires_grad, p.dtype, tuple(p.shape), rows)

    for m in model.modules():
        if id(m) in blocks:
            ws = whole(m, True)
            if by_weight and split(ws):
                units.extend(Unit(mine[0].owner, mine, block=True) for mine in by_module(ws))
            elif tile_bytes is not None and size(ws) > cap and split(ws):
                # a block larger than the tiles asked for decodes module by module: a
                # stock Linear's weight in tiles, another module's weights whole
                for mine in by_module(ws):
                    owner = mine[0].owner
                    if len(mine) == 1 and _tileable(owner, mine[0].name):
                        p = getattr(owner, mine[0].name)
                        if plan.get(id(p), ()) is not None:  # (else it stays plain)
                            tile(new_tiled(p, [owner]), owner)
                    else:
                        units.append(Unit(owner, mine, block=True))
            elif ws:
                units.append(Unit(m, ws, block=True))
            continue
        if id(m) in inside:
            continue
        ws = []
        for name, p in m.named_parameters(recurse=False):
            if not coded(p):
                continue
            users = owners[id(p)]
            if not (len(names[id(p)]) == 1 and all(_tileable(u, name) and id(u) not in inside
                                                   for u in users)):
                if len(users) == 1:
                    ws.append(Weight(m, name, p.requires_grad, None))
                continue  # tied to a module that reads it its own way: stays plain
            if plan.get(id(p), ()) is None:
                continue  # its products in row tiles are not the whole's: stays plain
            chunk = _gather_chunk(m, name, p) if gather and len(users) == 1 else None
            if chunk is not None:
                n = -(-p.numel() // chunk)
                slots = max(1, min(n, cap // (chunk * p.element_size())))
                units.append(Unit(m, [], gathered=Gathered(m, p.requires_grad, p.dtype,
                                                           tuple(p.shape), chunk, slots)))
                continue
            if len(users) == 1 and _aligned(p.numel() * p.element_size()) <= cap:
                ws.append(Weight(m, name, p.requires_grad, None))
                continue
            if gather and len(users) > 1 and id(p) not in tiled:
                t = new_tiled(p, users[1:])
                g = _tied_lookup(m, p, users, cap, t)
                if g is not None:  # the head's tiles, and a lookup of the rows it reads
                    t.lookup = len(units)
                    tiled[id(p)] = t
                    units.append(Unit(m, [], gathered=g))
                    continue
            if id(p) not in tiled:
                tiled[id(p)] = new_tiled(p, users)
            tile(tiled[id(p)], m)
        if ws:
            units.append(Unit(m, ws))
    return units


_DEFAULT_TILE = 1 << 25  # tile bytes of a model without repeated blocks
# By weight, a tensor decodes in a launch of its own, which takes at least one chunk's
# time (a warp decodes a chunk alone): chunks of at most WEIGHT_CHUNK symbols, and at
# least FILL_CHUNKS of them (one GPU warp each) where SMALLEST_CHUNK symbols or more allow.
WEIGHT_CHUNK = 1 << 14
FILL_CHUNKS = 512
SMALLEST_CHUNK = 1 << 12


def chunk_for(n: int) -> int:
    """Symbols per chunk of a tensor of ``n`` elements decoded on its own: the largest
    power of two up to ``WEIGHT_CHUNK`` that cuts it into ``FILL_CHUNKS`` chunks, at least
    ``SMALLEST_CHUNK``. Large weights take ``WEIGHT_CHUNK`` (each chunk's states and
    descriptor cost coded bytes, a chunk's length the launch's time); small ones get
    enough chunks to fill a GPU."""
    c = WEIGHT_CHUNK
    while c > SMALLEST_CHUNK and n < FILL_CHUNKS * c:
        c //= 2
    return c


# By block, a launch's chunks: at most GPU_CHUNK symbols, and at least LAUNCH_CHUNKS of
# them (one GPU warp each) where WEIGHT_CHUNK symbols or more allow.
LAUNCH_CHUNKS = 128


def launch_chunk(n: int) -> int:
    """Symbols per chunk of a block's launch of ``n`` elements: the largest power of two
    up to ``GPU_CHUNK`` that cuts it into ``LAUNCH_CHUNKS`` chunks, at least
    ``WEIGHT_CHUNK``. A launch of fewer chunks than the GPU runs warps at once takes one
    chunk's decode (a warp decodes a chunk alone), so small blocks get shorter chunks;
    large ones keep ``GPU_CHUNK`` (each chunk's states and descriptor cost coded
    bytes)."""
    c = GPU_CHUNK
    while c > WEIGHT_CHUNK and n < LAUNCH_CHUNKS * c:
        c //= 2
    return c


def _runs(ts: Sequence[torch.Tensor]) -> list[list[int]]:
    """A launch's weights (in their order in its region) in runs coded as one tensor
    each: consecutive weights of one dtype, each run one frame per field (one set of
    decode tables, chunks across the weights) over its bytes in the region, the
    alignment gaps between them zero (``_joined``)."""
    runs: list[list[int]] = []
    for i, t in enumerate(ts):
        if runs and ts[runs[-1][-1]].dtype == t.dtype:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def _joined(ts: Sequence[torch.Tensor], offsets: Sequence[int]) -> torch.Tensor:
    """Weights of one dtype at ``offsets`` as one flat tensor of that dtype on the host,
    from the first's offset to the last's end, zeros between them."""
    base = offsets[0]
    if len(ts) == 1:
        return ts[0]
    end = offsets[-1] + ts[-1].numel() * ts[-1].element_size()
    buf = torch.zeros(end - base, dtype=torch.uint8)
    for t, at in zip(ts, offsets, strict=True):
        raw = raw_bytes(t).cpu()
        buf[at - base : at - base + raw.numel()] = raw
    return buf.view(ts[0].dtype)


def _launches(units: list[Unit], ahead: int) -> None:
    """Group the units into launches: up to ``ahead`` consecutive tiles decode in one
    (more chunks, so more warps, per launch); any other unit in one of its own. A tied
    weight's tiles group only with their own module's, so that every owner's tiles form
    the same launches (they share them)."""
    k = 0
    while k < len(units):
        n = 1
        while (units[k].tiled is not None and n < ahead and k + n < len(units)
               and _together(units[k + n - 1], units[k + n])):
            n += 1
        for u in units[k : k + n]:
            u.lead = k
        units[k].after = k + n if k + n < len(units) else None
        k += n


def _together(a: Unit, b: Unit) -> bool:
    if b.tiled is None:
        return False
    if (len(a.tiled.owners) > 1 or len(b.tiled.owners) > 1 or a.tiled.lookup is not None
            or b.tiled.lookup is not None):  # (a range of one weight's chunks)
        return a.tiled is b.tiled and a.module is b.module
    return True


def _offsets(u: Unit) -> list[int]:
    """The offsets of ``u``'s weights in its region, ALIGNed (a tile's or a gathered
    lookup's: 0); sets ``u.size``, the region's bytes."""
    if u.gathered is not None:
        g = u.gathered
        u.size = _aligned(g.slots * g.chunk * g.dtype.itemsize)
        return [0]
    if u.tiled is not None:
        a, b = u.rows
        u.size = _aligned((b - a) * u.tiled.row_bytes)
        return [0]
    at, offsets = 0, []
    for w in u.weights:
        p = getattr(w.owner, w.name)
        offsets.append(at)
        at += _aligned(p.numel() * p.element_size())
    u.size = at
    return offsets


def _members(units: list[Unit], g: int) -> list[Unit]:
    """The units of the launch led by unit ``g``."""
    end = units[g].after
    return units[g : len(units) if end is None else end]


def _slot(units: list[Unit], sizes: dict[int, int]) -> int:
    """Block mode's slot: the largest launch (``sizes``: bytes by lead) of blocks, tiles or
    a gathered lookup."""
    return max([n for g, n in sizes.items() if units[g].block or units[g].tiled is not None
                or units[g].gathered is not None] + [0])


def _scratch_need(units: list[Unit], sizes: dict[int, int], ahead: int, by_weight: bool
                  ) -> int:
    """The scratch buffer's bytes for launches of ``sizes`` (bytes by lead, in running
    order): by block ``ahead + 1`` slots, by weight the two largest consecutive launches
    (with no launch ahead, the largest), and never less than the largest launch."""
    if by_weight:
        order = list(sizes)
        pairs = zip(order, order[1:], strict=False) if ahead else ()
        return max([sizes[a] + sizes[b] for a, b in pairs] + list(sizes.values()) + [0])
    return max([(ahead + 1) * _slot(units, sizes)] + list(sizes.values()) + [0])


def scratch_bytes(units: list[Unit], tiles_ahead: int, ahead: int, by_weight: bool) -> int:
    """The bytes of the scratch buffer ``Resident`` would allocate for ``units`` (grouped
    into launches here as it groups them)."""
    _launches(units, tiles_ahead)
    for u in units:
        _offsets(u)
    sizes = {k: sum(x.size for x in _members(units, k))
             for k, u in enumerate(units) if u.lead == k}
    return _scratch_need(units, sizes, ahead, by_weight)


# Row counts of the inputs a tiled Linear's products are checked at: decode steps'
# batches (a matrix library picks its algorithm, and so its order of summing, by shape).
CHECKED_ROWS = tuple(1 << i for i in range(9))
# A tiled Linear's tiles grow while the scratch buffer grows by at most this share of the
# weight's bytes: beyond it, the weight left plain costs about as much device memory.
GROWTH = 4


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _tiles_exact(w: torch.Tensor, biases: list[torch.Tensor | None],
                 rows: list[tuple[int, int]]) -> bool:
    """Whether ``F.linear`` with ``w``'s row tiles (each at an ``ALIGN``ed address, as
    in the scratch buffer) gives the whole product's bits, with each of ``biases``, for
    inputs of each of ``CHECKED_ROWS`` rows of seeded random values (not zeros: sums in
    another order then round differently)."""
    g = torch.Generator(device=w.device).manual_seed(0)
    for m in CHECKED_ROWS:
        x = torch.randn(m, w.shape[1], generator=g, device=w.device).to(w.dtype)
        for bias in biases:
            whole = F.linear(x, w, bias)
            for a, b in rows:
                t = w[a:b]
                if t.data_ptr() % ALIGN or not t.is_contiguous():
                    t = t.clone(memory_format=torch.contiguous_format)
                part = F.linear(x, t, None if bias is None else bias[a:b])
                if not _same_bits(part, whole[:, a:b]):
                    return False
    return True


@dataclass
class TileCheck:
    """What ``exact_tiles`` found: tiled Linear weights (by name) retiled, with their
    tile rows before and after, and left plain."""

    retiled: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    kept_plain: list[str] = dataclasses.field(default_factory=list)
    checked: int = 0  # tiled weights checked
    seconds: float = 0.0  # the check's time


def exact_tiles(model: nn.Module, make: Callable[[dict], list[Unit]], device: torch.device,
                tiles_ahead: int, ahead: int, by_weight: bool
                ) -> tuple[list[Unit], TileCheck]:
    """The units ``make(plan)`` gives (``_units``' ``plan``) once every weight tiled for
    an ``nn.Linear`` (bf16 or fp16, two tiles or more) computes in tiles, on ``device``,
    the whole product's bits (``_tiles_exact``): else its tiles grow (tile bytes doubled,
    while the scratch buffer grows by at most ``1 / GROWTH`` of the weight's bytes) to
    the first tiling that does, or none, and it stays plain, with a warning naming it."""
    start = time.perf_counter()
    plan: dict[int, list[tuple[int, int]] | None] = {}
    units = make(plan)
    scratch = scratch_bytes(units, tiles_ahead, ahead, by_weight)
    names = {id(m): name for name, m in model.named_modules()}
    found = TileCheck()
    seen: set[int] = set()
    for t in [u.tiled for u in units if u.tiled is not None]:
        p = t.owners[0].weight
        linears = [m for m in t.owners if isinstance(m, nn.Linear)]
        if (id(p) in seen or not linears or len(t.rows) < 2
                or t.dtype not in (torch.bfloat16, torch.float16)):
            continue
        seen.add(id(p))
        found.checked += 1
        w = p.detach().to(device)
        biases = [None if b is None else b.detach().to(device) for b in
                  {id(m.bias): m.bias for m in linears}.values()]
        if _tiles_exact(w, biases, t.rows):
            continue
        rows, good = t.rows, None
        cap = max(b - a for a, b in rows) * t.row_bytes
        while len(rows) > 1:
            cap *= 2
            wider = _tile_rows(t.shape[0], t.row_bytes, cap)
            if wider == rows:
                continue
            rows = wider
            need = scratch_bytes(make({**plan, id(p): rows}), tiles_ahead, ahead, by_weight)
            if need - scratch > t.nbytes // GROWTH:
                break
            if _tiles_exact(w, biases, rows):
                good, scratch = rows, need
                break
        plan[id(p)] = good
        name = f"{names[id(linears[0])]}.weight"
        if good is not None:
            found.retiled[name] = (t.rows[0][1], good[0][1])
        else:
            found.kept_plain.append(name)
            warnings.warn(f"entropykit: {name} stays plain: its product in row tiles is "
                          f"not the whole product's on {device}", RuntimeWarning,
                          stacklevel=3)
        del w
    found.seconds = time.perf_counter() - start
    return (make(plan) if plan else units), found


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


def _apart(a: Unit, b: Unit) -> bool:
    """Whether the launches led by ``a`` and ``b`` decode to places apart."""
    pa, pb = a.place.data_ptr(), b.place.data_ptr()
    return pa + a.place.numel() <= pb or pb + b.place.numel() <= pa


class Resident:
    """A model's resident state: units, scratch buffer, hooks (``model._entropykit_resident``)."""

    def __init__(self, model: nn.Module, units: list[Unit], device: torch.device,
                 chunk_size: int | None, tiles_ahead: int = 1, ahead: int = 1,
                 by_weight: bool = False) -> None:
        self.model = model
        self.by_weight = by_weight
        self.units = units
        self.device = device
        self.chunk_size = chunk_size
        self.ahead = ahead
        _launches(units, tiles_ahead)
        self.leads = [k for k, u in enumerate(units) if u.lead == k]
        self.window: dict[int, list[int]] = {}  # per lead: the launches it prefetches
        # launches prefetched and not yet waited for, in order: the ones right after the
        # launch entered last
        self.pending: list[int] = []
        self.current: int | None = None  # the launch whose units were entered last
        self.last: int | None = None  # the unit entered last
        self.scratch: torch.Tensor | None = None
        self.streams: Any = None
        self.hooks: list[Any] = []
        self.tiled: list[Tiled] = []  # tiled weights, in the order they were made resident
        self.tile_check = TileCheck()  # what compress_model's check of tiled products found

    def build(self, verify: bool) -> None:
        """Code every unit's weights, allocate the scratch buffer, point the weights at it
        and install the hooks. With ``verify``, each launch is decoded once and compared
        with its weights, bit for bit, before they are dropped. Launch by launch, so the
        host holds one launch's coded weights at a time; on an error the model is left as
        it was."""
        places = [_offsets(u) for u in self.units]
        sizes = {g: sum(u.size for u in self._members(g)) for g in self.leads}
        if self.by_weight:
            self._ring(sizes)
        else:
            self._slots(sizes)
        for g in self.leads:
            at = 0
            for u in self._members(g):
                u.region = self.units[g].place[at : at + u.size]
                at += u.size
        # Entering a launch prefetches the next ``ahead`` launches while their places are
        # apart from every launch from this one up to them (those decoded or computing
        # before them); the launches before this one have been enqueued on the compute
        # stream, which a prefetch waits for.
        for j, g in enumerate(self.leads):
            self.window[g] = []
            for i in range(j + 1, min(j + 1 + self.ahead, len(self.leads))):
                m = self.units[self.leads[i]]
                if m.gathered is not None or not all(_apart(m, self.units[x])
                                                     for x in self.leads[j:i]):
                    break  # (a gathered lookup's chunks are known when it runs)
                self.window[g].append(self.leads[i])
                m.prefetch = True
        self.streams, make = _backend(self.device, len(self.units), self.ahead)
        self.gatherer = _gatherer(self.device)
        done: list[Unit] = []
        # Tensors are coded on the package's threads, a bounded window ahead of the launch
        # being built, in the order the launches take them.
        coded = parallel.imap(lambda job: code_tensor(*job), self._jobs(places),
                              parallel.resolve(None))
        try:
            for g in self.leads:
                u = self.units[g]
                if u.tiled is not None:
                    self._build_tiles(self._members(g), make, verify, coded)
                    continue
                if u.gathered is not None:
                    self._build_gathered(u, verify, next(coded))
                    done.append(u)
                    continue
                ts = [getattr(w.owner, w.name) for w in u.weights]
                runs = [next(coded) for _ in _runs(ts)]
                # each weight's place in the region; its bytes are coded in its run's
                u.weights = [Weight(w.owner, w.name, w.requires_grad,
                                    CodedTensor(t.dtype, tuple(t.shape), at, ()))
                             for w, t, at in zip(u.weights, ts, places[g], strict=True)]
                u.decoder = make(runs, u.region)
                if verify:
                    self._verify(u, [(w.coded, u, t) for w, t in zip(u.weights, ts,
                                                                     strict=True)])
                for w in u.weights:
                    del w.owner._parameters[w.name]
                    setattr(w.owner, w.name, w.coded.view(u.region))
                done.append(u)
        except BaseException:
            coded.close()
            self._decode_back(done)
            raise
        if hasattr(self.streams, "reserve"):  # descriptor buffers, before any forward
            self.streams.reserve(max([getattr(u.decoder, "pairs", 0) for u in self.units]
                                     + [0]))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the weights just freed
        for k, u in enumerate(self.units):
            if u.tiled is None and u.gathered is None:
                u.hook = u.module.register_forward_pre_hook(
                    lambda m, args, kwargs, k=k: self.before(k, args, kwargs),
                    with_kwargs=True)
                self.hooks.append(u.hook)
        self.hooks.append(self.model.register_forward_hook(lambda m, a, out: self.end()))

    def _slots(self, sizes: dict[int, int]) -> None:
        """Block mode's buffer: a ring of ``ahead + 1`` slots, each the size of the largest
        launch of blocks or tiles; launches take the slots in turn (a tile of a tied weight
        met again: its first owner's place), so up to ``ahead`` launches decode while the
        one before them computes. A launch larger than a slot takes the buffer's start."""
        slot, slots = _slot(self.units, sizes), self.ahead + 1
        size = _scratch_need(self.units, sizes, self.ahead, False)
        self.scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        base, turn = self.scratch.data_ptr(), -1  # the slot the launch before took
        for g in self.leads:
            lead = self.units[g]
            if lead.shared:
                lead.place = self.units[lead.tiled.units[0] + lead.tile].place
                turn = (lead.place.data_ptr() - base) // slot
            elif 0 < sizes[g] <= slot:
                turn = (turn + 1) % slots
                lead.place = self.scratch[turn * slot : turn * slot + sizes[g]]
            else:
                lead.place = self.scratch[: sizes[g]]
                turn = (sizes[g] - 1) // slot if slot else -1

    def _ring(self, sizes: dict[int, int]) -> None:
        """By weight, the buffer is a ring of bytes as large as the largest two consecutive
        launches (or the largest launch; with no launch ahead, that): each launch takes
        the bytes right after the one before it, or the ring's start where they run out,
        or its end where the launch after it would otherwise find no room apart from it
        (a tile of a tied weight met again: its first owner's place). So every launch
        decodes while the one before it computes, and several small ones ahead where the
        ring has room."""
        order = list(self.leads)
        need = _scratch_need(self.units, sizes, self.ahead, True)
        self.scratch = torch.empty(need, dtype=torch.uint8, device=self.device)
        base, at = self.scratch.data_ptr(), 0  # where the launch before ended
        for j, g in enumerate(order):
            lead, n = self.units[g], sizes[g]
            if lead.shared:
                lead.place = self.units[lead.tiled.units[0] + lead.tile].place
                at = lead.place.data_ptr() - base + n
                continue
            start = at if at + n <= need else 0
            nxt = sizes[order[j + 1]] if j + 1 < len(order) else 0
            if start and start + n + nxt > need and nxt > start:
                start = need - n  # the next launch then fits at the ring's start
            lead.place = self.scratch[start : start + n]
            at = start + n

    def _jobs(self, places: list[list[int]]) -> Iterator[tuple]:
        """``code_tensor``'s arguments for everything to code, in building order: each
        launch's runs of weights (``_runs``) or its tiles' rows (a tied owner's tiles are
        its first owner's), or a gathered embedding's weight (in chunks whatever its
        fields)."""
        for g in self.leads:
            u = self.units[g]
            if u.gathered is not None:
                yield u.module.weight, 0, u.gathered.chunk, True
            elif u.tiled is None:
                ts = [getattr(w.owner, w.name) for w in u.weights]
                chunk = self._chunk(sum(t.numel() for t in ts))
                for run in _runs(ts):
                    yield _joined([ts[i] for i in run], [places[g][i] for i in run]), \
                        places[g][run[0]], chunk
            elif not u.shared and u.tiled.lookup is None:  # (else its lookup's chunks)
                rows = [t.tiled.owners[0].weight[t.rows[0] : t.rows[1]]
                        for t in self._members(g)]
                chunk = self._chunk(sum(w.numel() for w in rows))
                for w in rows:
                    yield w, 0, chunk

    def _chunk(self, n: int) -> int:
        """Symbols per chunk of a launch of ``n`` elements (``chunk_size`` if given): by
        weight ``chunk_for``'s, else ``launch_chunk``'s."""
        if self.chunk_size is not None:
            return self.chunk_size
        return chunk_for(n) if self.by_weight else launch_chunk(n)

    def _members(self, g: int) -> list[Unit]:
        """The units of the launch led by unit ``g``."""
        return _members(self.units, g)

    def _build_tiles(self, tiles: list[Unit], make: Callable, verify: bool,
                     coded: Iterator[CodedTensor]) -> None:
        """Code one launch of tiles (its first owner's) or share it (a tied owner's);
        after the last tile of an owner, the owner's weight goes and its forward decodes
        tiles."""
        lead = tiles[0]
        if lead.shared:
            for u in tiles:
                first = self.units[u.tiled.units[0] + u.tile]
                u.decoder, u.coded = first.decoder, first.coded
        elif lead.tiled.lookup is not None:
            self._build_range(tiles, verify)
        else:
            wants = []
            for u in tiles:
                a, b = u.rows
                wants.append(u.tiled.owners[0].weight[a:b])
                u.coded = next(coded)
            base = lead.place.data_ptr()
            decoder = make([dataclasses.replace(u.coded, offset=u.region.data_ptr() - base)
                            for u in tiles], lead.place)
            for u in tiles:
                u.decoder = decoder
            if verify:
                self._verify(lead, [(u.coded, u, w) for u, w in zip(tiles, wants,
                                                                  strict=True)])
            if not decoder.reads_fields:
                for u in tiles:
                    u.coded = dataclasses.replace(u.coded, fields=())
        for u in tiles:
            t = u.tiled
            if u.tile == len(t.rows) - 1 and u.module is t.owners[-1]:
                self._swap_forwards(t)

    def _build_range(self, tiles: list[Unit], verify: bool) -> None:
        """One launch of tiles of a weight tied to a gathered lookup: the range of the
        lookup's chunks holding the tiles' rows (each tile starts a chunk), decoded into
        the launch's place, where the tiles' regions follow each other."""
        lead, t = tiles[0], tiles[0].tiled
        g = self.units[t.lookup].gathered
        a, b = tiles[0].rows[0], tiles[-1].rows[1]
        width = math.prod(t.shape[1:])
        first, n = a * width // g.chunk, -(-(b - a) * width // g.chunk)
        decoder = self.units[t.lookup].decoder.range(first, n, lead.place)
        for u in tiles:
            ra, rb = u.rows
            u.decoder = decoder
            u.coded = CodedTensor(t.dtype, (rb - ra, *t.shape[1:]), 0, ())
        if verify:
            w = t.owners[0].weight
            self._verify(lead, [(u.coded, u, w[u.rows[0] : u.rows[1]]) for u in tiles])

    def _build_gathered(self, u: Unit, verify: bool, coded: CodedTensor) -> None:
        """A gathered embedding's decoder; with ``verify``, every chunk decoded once and
        compared with the weight. Its forward decodes the rows it reads from now on (a
        tied one's once the tiles of the weight's other owners are built)."""
        g, m = u.gathered, u.module
        g.coded = coded
        u.decoder = self.gatherer(coded, g.chunk, g.slots, u.region)
        if verify:
            self.streams.synchronize()
            whole = self._gathered_whole(u, check=True)
            if not torch.equal(raw_bytes(whole), raw_bytes(m.weight).to(whole.device)):
                raise RuntimeError(f"entropykit: {type(m).__name__} weight did not decode "
                                   "to its weight")
        g.coded = dataclasses.replace(coded, fields=())
        if g.tied is None:
            self._swap_lookup(u)

    def _swap_lookup(self, u: Unit) -> None:
        """A gathered embedding's forward decodes the rows it reads from now on."""
        g, m = u.gathered, u.module
        del m._parameters["weight"]
        m.weight = torch.empty(g.shape, dtype=g.dtype, device="meta")
        k = self.units.index(u)
        m.forward = types.MethodType(lambda m, x, k=k: _gathered_embedding(self, m, k, x), m)

    def _gathered_whole(self, u: Unit, check: bool = False) -> torch.Tensor:
        """A gathered embedding's weight, decoded ``slots`` chunks at a time."""
        g = u.gathered
        flat = torch.empty(math.prod(g.shape), dtype=g.dtype, device=self.device)
        for a in range(0, g.chunks, g.slots):
            b = min(a + g.slots, g.chunks)
            u.decoder.want(torch.arange(a, b, device=self.device))
            self.streams.now(u.decoder)
            n = min(flat.numel(), b * g.chunk) - a * g.chunk
            flat[a * g.chunk : a * g.chunk + n] = u.decoder.out[:n]
            if check:
                self.streams.synchronize()
                u.decoder.check()
        return flat.view(g.shape)

    def _swap_forwards(self, t: Tiled) -> None:
        """Every owner's forward decodes ``t``'s tiles from now on; what the modules show
        as their weight: its shape and dtype, and no data, so that reading it outside
        their forwards fails rather than reads stale bytes."""
        stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta")
        for m, first in zip(t.owners, t.units, strict=True):
            del m._parameters["weight"]
            m.weight = stand_in
            ks = list(range(first, first + len(t.rows)))
            forward = _tiled_linear if isinstance(m, nn.Linear) else _tiled_embedding
            m.forward = types.MethodType(
                lambda m, x, f=forward, ks=ks: f(self, m, ks, x), m)
        if t.lookup is not None:
            self._swap_lookup(self.units[t.lookup])
        self.tiled.append(t)

    def _verify(self, lead: Unit, checks: list[tuple[CodedTensor, Unit, torch.Tensor]]
                ) -> None:
        """Run ``lead``'s decoder; each (coded, unit, weight) must come out as the weight."""
        lead.decoder.run()
        self.streams.synchronize()
        lead.decoder.check()
        getattr(lead.decoder, "release", lambda: None)()  # runs take a stream's buffer
        for coded, u, want in checks:
            if not torch.equal(coded.bytes_in(u.region), raw_bytes(want).to(u.region.device)):
                raise RuntimeError(f"entropykit: {type(u.module).__name__} weight did not "
                                   "decode to its weight")

    def before(self, k: int, args: tuple, kwargs: dict) -> None:
        """Unit ``k``'s pre-hook: its launch is decoded, the next launch's on the way."""
        if torch.is_grad_enabled() and any(
                isinstance(a, torch.Tensor) and a.requires_grad
                for a in (*args, *kwargs.values())):
            raise RuntimeError("entropykit: a resident model runs inference only (its "
                               "weights are overwritten by the next blocks): use "
                               "torch.no_grad() or decompress_model first")
        g = self.units[k].lead
        entered = g != k and self.current == g and self.last == k - 1
        self.last = k
        if entered:  # decoded with the unit before it, in one launch
            return
        pending, streams = self.pending, self.streams
        if pending and pending[0] == g:  # the launch prefetched first: wait for it alone
            streams.join(pending.pop(0))
        else:  # out of the expected order: nothing pending stays in flight
            hit = g in pending
            self.join()
            pending = self.pending
            if not hit:
                streams.now(self.units[g].decoder)
        self.current = g
        for n in self.window[g]:
            if n not in pending:
                streams.prefetch(n, self.units[n].decoder)
                pending.append(n)

    def end(self) -> None:
        """The model's forward returned: nothing left pending, nothing taken as decoded."""
        self.join()
        self.current = self.last = None

    def join(self) -> None:
        """The compute stream waits for every prefetched launch."""
        for n in self.pending:
            self.streams.join(n)
        self.pending = []

    def memory(self) -> ResidentMemory:
        plain = sum(t.numel() * t.element_size()
                    for t in (*self.model.parameters(), *self.model.buffers()))
        decoders = {id(u.decoder): u.decoder for u in self.units}
        return ResidentMemory(
            coded_bytes=sum(d.nbytes for d in decoders.values())
            + getattr(self.streams, "nbytes", 0),
            scratch_bytes=self.scratch.numel(),
            uncompressed_bytes=sum(w.coded.nbytes for u in self.units for w in u.weights)
            + sum(t.nbytes for t in self.tiled)  # a tied lookup's weight: with its tiles
            + sum(u.gathered.nbytes for u in self.units
                  if u.gathered is not None and u.gathered.tied is None),
            plain_bytes=plain,
            tensors=sum(len(u.weights) + (u.gathered is not None and u.gathered.tied is None)
                        for u in self.units) + len(self.tiled),
        )

    def restore(self) -> None:
        """Decode every weight back into a parameter of its own and remove the hooks."""
        for h in self.hooks:
            h.remove()
        self.join()
        self._decode_back([u for u in self.units if u.tiled is None], self.tiled)
        self.units = []
        self.tiled = []
        self.scratch = None

    def _decode_back(self, units: list[Unit], tiled: list[Tiled] | None = None) -> None:
        for u in units:
            if u.gathered is not None and u.gathered.tied is not None:
                continue  # given back with its tiles, or not yet taken from the module
            if u.gathered is not None:
                whole = self._gathered_whole(u)
                m = u.module
                del m.forward, m.weight
                m.register_parameter("weight", nn.Parameter(whole, u.gathered.requires_grad))
                continue
            self.streams.now(u.decoder)
            for w in u.weights:
                t = w.coded.view(u.region).clone()
                delattr(w.owner, w.name)
                w.owner.register_parameter(w.name, nn.Parameter(t, w.requires_grad))
        for t in tiled if tiled is not None else self.tiled:
            whole = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            ran = None
            for i, (a, b) in enumerate(t.rows):
                u = self.units[t.units[0] + i]
                if u.decoder is not ran:  # once per launch
                    self.streams.now(u.decoder)
                    ran = u.decoder
                whole[a:b] = u.coded.view(u.region)
            p = nn.Parameter(whole, t.requires_grad)
            lookup = [] if t.lookup is None else [self.units[t.lookup].module]
            for m in (*lookup, *t.owners):
                del m.forward, m.weight
                m.register_parameter("weight", p)
        self.streams.synchronize()


def _tiled_linear(state: Resident, m: nn.Linear, ks: list[int], x: torch.Tensor
                  ) -> torch.Tensor:
    """``m(x)`` with its weight decoded tile by tile, the tiles' products joined along the
    output features (one copy for all tiles): the output's features split, each
    element's sum is the plain product's where the matrix library sums a tile's product
    as that block of the whole (``exact_tiles`` checked it)."""
    ys = []
    for k in ks:
        state.before(k, (x,), {})
        u = state.units[k]
        a, b = u.rows
        ys.append(F.linear(x, u.coded.view(u.region),
                           None if m.bias is None else m.bias[a:b]))
    return ys[0] if len(ys) == 1 else torch.cat(ys, -1)


def _check_ids(ids: torch.Tensor, n: int) -> None:
    """Refuse ids outside ``[0, n)`` as the plain lookup does: an IndexError on the CPU, an
    assertion on the device (no host synchronisation)."""
    if ids.device.type == "cpu":
        if ids.numel() and not bool(((ids >= 0) & (ids < n)).all()):
            raise IndexError("index out of range in self")
    else:
        torch._assert_async(((ids >= 0) & (ids < n)).all())


def _tiled_embedding(state: Resident, m: nn.Embedding, ks: list[int], ids: torch.Tensor
                     ) -> torch.Tensor:
    """``m(ids)`` with its weight decoded tile by tile, each tile giving the rows of the
    ids that fall in it."""
    n = m.num_embeddings
    _check_ids(ids, n)
    out = None
    for k in ks:
        state.before(k, (ids,), {})
        u = state.units[k]
        a, b = u.rows
        local = ids - a
        rows = F.embedding(local.clamp(0, b - a - 1), u.coded.view(u.region))
        if out is None:
            out = rows
        else:
            out = torch.where(((local >= 0) & (local < b - a)).unsqueeze(-1), rows, out)
    return out


def _gathered_embedding(state: Resident, m: nn.Embedding, k: int, ids: torch.Tensor
                        ) -> torch.Tensor:
    """``m(ids)`` decoding only the chunks holding the rows of ``ids``: id i's ``span``
    chunks into slots ``i * span`` on, ``slots / span`` ids at a time (as many launches
    as the input's shape needs), each row then read from its slots."""
    u = state.units[k]
    g = u.gathered
    n = m.num_embeddings
    _check_ids(ids, n)
    flat = ids.reshape(-1).clamp(0, n - 1)
    width, span = g.shape[1], g.span
    out = u.decoder.out
    rows = out.view(-1, width) if span == 1 else None
    step = g.slots // span
    parts = []
    for a in range(0, max(1, flat.numel()), step):
        part = flat[a : a + step]
        start = part * width  # the row's first symbol
        first = torch.div(start, g.chunk, rounding_mode="floor")
        if span == 1:
            u.decoder.want(first)
        else:  # a row's chunks; past the last, the last again (the row ends before)
            over = first[:, None] + torch.arange(span, device=part.device)
            u.decoder.want(over.clamp_(max=g.chunks - 1).reshape(-1))
        if a == 0:
            state.before(k, (ids,), {})
        else:  # the same place again, after the rows before were read
            state.streams.now(u.decoder)
        at = torch.arange(part.numel(), device=part.device) * (span * g.chunk) + (
            start - first * g.chunk)  # where the row starts among the slots
        if rows is not None:
            parts.append(F.embedding(torch.div(at, width, rounding_mode="floor"), rows))
        else:
            parts.append(out[at[:, None] + torch.arange(width, device=part.device)])
    got = parts[0] if len(parts) == 1 else torch.cat(parts)
    return got.view(*ids.shape, width)
