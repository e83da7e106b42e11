"""Resident mode: a PyTorch model whose weights stay coded in device memory.

``compress_model(model)`` codes the model's weight matrices (Linear, embedding and any
other parameter of two or more dimensions in bf16, fp16 or fp8) losslessly and keeps only
the coded bytes on the model's device. Each block of the model (each module of a repeated
``nn.ModuleList``, such as ``model.model.layers``; every other module holding weights is a
block of its own) decodes just before its forward into a slot of a small ring of scratch
slots, the next ones' decodes overlapping its compute on a side stream; with
``granularity="weight"`` each module of a block (each Linear) decodes on its own, whole,
before its own forward, into a ring of two of the largest Linears' bytes. On a GPU, an
embedding used by itself alone (bf16, rows of a power-of-two width) is coded in chunks
of whole rows and its lookup decodes only the chunks holding the rows it reads (the
chunk list made on the device from the ids, its length fixed by their shape). Other
embeddings and Linear heads larger than a slot (such as the vocabulary's, or an
embedding tied to the head) decode in row tiles no larger than a slot: the lookup takes
each tile's rows, the head computes each tile's slice of the logits, so the buffer
never holds a whole embedding. With
``tile_bytes`` and block granularity the blocks' Linears decode in row tiles too,
``tiles_ahead`` of them in one launch, for a buffer of a few tiles. The forward only
enqueues work on the GPU, so it can be captured in a CUDA graph, and its outputs are
bit-identical to the uncompressed model's: a Linear in row tiles computes its product
tile by tile, which a matrix library may sum in another order than the whole product,
so ``compress_model`` checks each such weight's tiles on the device at decode batches
(1 to 256 rows) and grows them, or keeps the weight plain, where they differ. On the
CPU the same hooks decode with the CPU decoders.

What it is not: a training mode (the scratch buffer is overwritten block after block,
so a resident model runs under ``torch.no_grad()``), or a file format: the coded weights
live in memory only. Weights shared by several modules stay as they are unless they are
embedding and Linear weights (tied embeddings: coded once, tiled for both); other
parameters (norms, biases, scales of fp8 weights) stay as they are. A weight is valid only
inside its unit's forward (its block's, or by weight its module's), and a tiled weight
never is (its modules' ``weight`` is a meta tensor of its shape and dtype): code that
reads a module's weight from outside it (rather than calling the module) must decompress
the model first.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from ..coding.frame import MAX_CHUNK, MIN_CHUNK
from . import _resident
from ._resident import Resident, ResidentMemory, _units

__all__ = ["ResidentMemory", "compress_model", "decompress_model", "resident_memory"]

_ATTR = "_entropykit_resident"
MIN_ELEMENTS = 1 << 12


_GRANULARITIES = ("block", "weight")
_Granularity = Literal["block", "weight"]


def compress_model(model: nn.Module, *, device: torch.device | str | None = None,
                   min_elements: int = MIN_ELEMENTS, granularity: _Granularity = "block",
                   ahead: int | None = None, tile_bytes: int | None = None,
                   tiles_ahead: int = 1, chunk_size: int | None = None,
                   verify: bool = True) -> nn.Module:
    """Make ``model``'s weights resident (in place; returns ``model``).

    Weights of two or more dimensions in bfloat16, float16, float8_e4m3fn or float8_e5m2
    with at least ``min_elements`` elements are coded; they must all be on one device (a
    CUDA device: decoded by ``rans.cuda``, needing CuPy; the CPU: by the CPU
    decoders). ``device`` (a CUDA device, for a model on the CPU) puts the coded weights
    there and moves the rest of the model after them, so the device never holds the
    plain weights.

    ``granularity`` is what decodes at once into the scratch buffer: ``"block"``, each
    block of the model whole, into a ring of ``ahead + 1`` slots each the size of the
    largest block (``ahead``, launches decoded in advance: default 1); ``"weight"``, each
    module of a block holding weights (a Linear, an expert, ...) its weights whole, just
    before its own forward, into a ring of bytes as large as the two largest consecutive
    launches (``ahead``, default 2, launches decoded in advance where the ring has room
    for them), at the cost of more, smaller decodes; each module's weights must then be
    read only by its own forward (a block whose weights sit in modules with children
    stays whole). Both keep every product of a block in its plain shape. ``ahead=0``
    decodes each launch only when it is entered, on the compute stream, into a buffer
    of one launch's bytes (the largest): the least memory, no decode overlapping
    compute.

    An embedding or Linear weight outside the blocks larger than ``tile_bytes`` (default:
    the largest launch of a block: a block, or by weight the largest module's weights)
    decodes in row tiles of at most that size: the lookup takes each tile's rows, the
    head each tile's slice of the logits. Given with ``"block"``, a block larger than
    ``tile_bytes`` decodes module by module with ``nn.Linear`` weights in row tiles too,
    so that a slot holds a tile.

    A Linear in row tiles (bf16 or fp16) computes its product tile by tile (the tiles
    split the output features), the whole product's bits only where the matrix library
    sums a narrow product as it sums those columns of the whole one (a GPU's picks its
    algorithm per shape: a split reduction for few outputs at a small batch sums in
    another order). So each such weight is checked once, on the model's device while it
    is still whole (with ``device``, a copy of it there for the check's time): for
    inputs of seeded random values of 1, 2, 4, ..., 256 rows (decode batches), each
    tile's product (with its bias) against the whole product's columns, bit for bit.
    Where one differs, the tiles grow (their bytes doubled, past ``tile_bytes`` if
    given) to the first tiling whose products are all exact, as long as the scratch
    buffer, sized for the largest launches (by block, slots of the largest tile; by
    weight, two consecutive tiles), grows by at most a quarter of the weight's bytes;
    where none is, the weight stays a plain parameter (``resident_memory`` counts it as
    plain) and a ``RuntimeWarning`` names it. Not checked: inputs of other row counts
    (a prompt's batch x length) or strides; the check costs a few whole products per
    tiled weight.

    Memory against speed: ``tiles_ahead`` consecutive tiles (of one Linear or of the
    next ones) decode in one launch, so a slot holds ``tiles_ahead`` tiles; ``chunk_size``
    (symbols per rANS chunk, a power of two in [1024, 2**26]) sets how many GPU warps share
    a decode: smaller chunks decode a tile sooner and cost a little more coded size (a
    chunk's states and descriptor). By default, by block, each launch takes the largest
    power of two up to 65536 that still cuts it into 128 chunks (at least 16384); by
    weight, each tensor the largest power of two up to 16384 that still cuts it into 512
    chunks (at least 4096): a launch takes at least one chunk's decode, and small blocks
    and weights still fill a GPU. A launch's consecutive weights of one dtype are coded
    as one tensor (one set of decode tables for a block).
    ``verify`` decodes every launch once and compares it with the weights, bit for bit,
    before they are freed. Undo with ``decompress_model``.
    """
    if getattr(model, _ATTR, None) is not None:
        raise ValueError("entropykit: this model is resident already")
    if min_elements < 1:
        raise ValueError(f"min_elements must be >= 1, got {min_elements}")
    if tile_bytes is not None and tile_bytes < 1:
        raise ValueError(f"tile_bytes must be >= 1, got {tile_bytes}")
    if granularity not in _GRANULARITIES:
        raise ValueError(f"granularity must be one of {_GRANULARITIES}, got {granularity!r}")
    if ahead is None:
        ahead = 2 if granularity == "weight" else 1
    if ahead < 0:
        raise ValueError(f"ahead must be >= 0, got {ahead}")
    if tiles_ahead < 1:
        raise ValueError(f"tiles_ahead must be >= 1, got {tiles_ahead}")
    if chunk_size is not None and not (MIN_CHUNK <= chunk_size <= MAX_CHUNK
                                       and chunk_size & (chunk_size - 1) == 0):
        raise ValueError(f"chunk_size must be a power of two in [{MIN_CHUNK}, {MAX_CHUNK}], "
                         f"got {chunk_size}")
    units = _units(model, min_elements, tile_bytes, granularity == "weight")
    devices = {getattr(w.owner, w.name).device for u in units for w in u.weights}
    devices |= {u.tiled.owners[0].weight.device for u in units if u.tiled is not None}
    if len(devices) > 1:
        raise ValueError(f"entropykit: the weights to make resident are on several "
                         f"devices ({sorted(map(str, devices))}); resident mode needs one")
    here = devices.pop() if devices else torch.device("cpu")
    target = here if device is None else torch.device(device)
    for d in (here, target):
        if d.type not in ("cpu", "cuda"):
            raise ValueError(f"entropykit: the weights are on {d}; resident mode runs "
                             "on a CUDA device or the CPU")
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    if here != target and here.type != "cpu":
        raise ValueError(f"entropykit: weights on {here} cannot be made resident on "
                         f"{target} (only weights on the CPU move)")
    by_weight = granularity == "weight"
    gather = _resident._gatherer(target) is not None  # lookups decode the rows they read
    units, check = _resident.exact_tiles(
        model, lambda plan: _units(model, min_elements, tile_bytes, by_weight, gather, plan),
        target, tiles_ahead, ahead, by_weight)
    state = Resident(model, units, target, chunk_size, tiles_ahead, ahead, by_weight)
    state.tile_check = check
    with torch.no_grad():
        state.build(verify)
    if here != target:
        model.to(target)  # the rest: norms, biases, buffers (resident weights are there)
    object.__setattr__(model, _ATTR, state)
    return model


def _state(model: nn.Module) -> Resident:
    state = getattr(model, _ATTR, None)
    if state is None:
        raise ValueError("entropykit: this model is not resident (see compress_model)")
    return state


def resident_memory(model: nn.Module) -> ResidentMemory:
    """Bytes a resident model holds: coded weights, scratch buffer, what the coded weights
    take decoded, and everything left plain."""
    return _state(model).memory()


def decompress_model(model: nn.Module) -> nn.Module:
    """Undo ``compress_model``: every weight decoded back into a parameter of its own, the
    hooks and scratch buffer removed (in place; returns ``model``)."""
    state = _state(model)
    with torch.no_grad():
        state.restore()
    object.__delattr__(model, _ATTR)
    return model
