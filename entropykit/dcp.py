"""``torch.distributed.checkpoint`` storage that writes entropykit-compressed shards.

What it is: ``CompressedStorageWriter`` / ``CompressedStorageReader``, a StorageWriter /
StorageReader pair for ``torch.distributed.checkpoint`` (DCP), built on DCP's
``FileSystemWriter`` / ``FileSystemReader`` (directory handling, overwrite rule, ids,
async staging), and ``consolidate``:

- every rank writes the items DCP's planner gives it (tensor chunks: DTensor / FSDP2
  shards or whole tensors; non-tensor items as the bytes DCP serializes them to) as
  compressed safetensors files (one; or, where they pass a segment, about
  ``FILES_PER_RANK`` written at once, a coding thread each), each tensor coded by the
  container's dtype-aware codecs; a file's coded segments are written by its own
  write-behind thread while the next ones code, and a coded file is closed (its last
  writes, fsync, rename) while its coding thread goes on to the next file; ranks write
  in parallel;
- loading decodes a rank's pieces on the thread pool, across its files, straight into
  the planner's tensors where a piece is one run of the saved chunk's bytes and the
  tensor a contiguous CPU tensor of its dtype;
- the coordinator writes the checkpoint's metadata (``METADATA``: JSON, nothing to
  unpickle) last, in ``finish``, by atomic rename. A save that fails on any rank never gets
  there, so it leaves nothing that loads. Shard names carry a token new with every save,
  so re-saving into a directory leaves the previous checkpoint whole and loadable until
  the new metadata replaces it; the previous shards are removed after that;
- loading reshards to any world size: the reader decodes, of each saved chunk, only the
  segments that hold the piece DCP's planner asks for;
- ``consolidate`` (or ``consolidate=True`` on the writer): the full tensors as a
  compressed Hugging Face checkpoint (``model-0000k-of-0000n.safetensors`` shards and
  ``model.safetensors.index.json``), which ``entropykit.load_file`` and, with a marked
  ``config.json``, ``from_pretrained`` read.

Every size, count, name and offset in the metadata is checked (docs/format.md,
"Distributed checkpoints"); damaged metadata or shards raise ``CorruptDataError``. DCP
wraps what a storage reader raises in its ``CheckpointException``. Non-tensor items are
handed back as the bytes DCP stored, and DCP's load planner unpickles them
(``torch.load(weights_only=False)``): load such items only from checkpoints you trust.
What it is not: a launcher or scheduler (DCP and the caller's process group are), or a
reader of DCP's own ``.metadata`` pickle.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import json
import math
import operator
import os
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import dtypes
from ._errors import CorruptDataError
from .api import tensor_source
from .container import _atomic, codecs, config_mark, files
from .container.parallel import ENV, default_threads, imap, resolve
from .container.reader import Compressed
from .container.writer import write

METADATA = ".metadata.ek.json"  # the checkpoint's metadata, written last
FORMAT = "entropykit-dcp"
VERSION = 1
INDEX = "model.safetensors.index.json"  # the Hugging Face index of a consolidated output
MAX_METADATA_BYTES = 1 << 30
MAX_DIMS = 64
MAX_GRID_CELLS = 1 << 24  # cells of one tensor's chunk grid (``_check_tiling``)
SHARD_BYTES = 5 << 30  # a consolidated shard's original bytes at most (Hugging Face's size)
SHARDING_KEY = "DCP_SHARDING_INFO"  # a shard's own record of its chunks, as torch's HF writer
# A rank's shard is coded in segments of this many original bytes. A segment is coded by
# one thread (only its frame's chunks spread), so with the container's larger default a
# rank's largest tensor (an embedding, a large FSDP shard) is the long pole of its save;
# segments this size spread it over the threads at little coding cost, and a resharding
# load decodes less.
SEGMENT_BYTES = 4 << 20
# A rank's items go into about FILES_PER_RANK files (``_part_bytes``), of SEGMENT_BYTES
# to PART_BYTES of original bytes each, written at once, one coding thread each
# (``_write_files``), as DCP's own writer writes a file per thread: one file's writes are
# serial in the kernel, and a file coded by one thread needs no hand-offs between threads.
FILES_PER_RANK = 16
PART_BYTES = 32 << 20

_SHARD = re.compile(r"shard-[0-9a-f]{12}-[0-9]{5}(-[0-9]{4,})?\.safetensors")
_MODEL = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


@dataclass(frozen=True)
class _Stored:
    """Where one saved item is: the shard file (a name in the checkpoint directory) and
    its tensor's name in it."""

    file: str
    key: str


@dataclass(frozen=True)
class _Prefix:
    """A rank's shard name stem, chosen by the coordinator."""

    stem: str


@dataclass
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    stored: _Stored


@dataclass
class _Tensor:
    dtype: str  # safetensors name
    size: tuple[int, ...]
    requires_grad: bool = False
    chunks: list[_Chunk] = field(default_factory=list)


@dataclass
class _Layout:
    """A checkpoint's metadata as this module writes and checks it."""

    tensors: dict[str, _Tensor]
    blobs: dict[str, _Stored]  # non-tensor items, stored as DCP's serialized bytes
    planner_data: dict[str, list[str | int]] | None
    save_id: str | None = None

    def files(self) -> set[str]:
        return ({c.stored.file for t in self.tensors.values() for c in t.chunks}
                | {b.file for b in self.blobs.values()})


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    name = dtypes.FROM_TORCH.get(str(dtype))
    if name is None:
        raise TypeError(f"{fqn!r}: torch dtype {dtype} has no safetensors dtype")
    return name


class CompressedStorageWriter(FileSystemWriter):
    """DCP storage writer: each rank's items as entropykit-compressed safetensors files.

    ``dcp.save(state_dict, storage_writer=CompressedStorageWriter(path))`` on every rank.

    ``fast`` trades size for speed. ``True`` (the default) entropy codes the fields that
    pay (float exponents, a mantissa byte without its sign) with the checkpoint policy
    (``codecs.CHECKPOINT``: order-0 tANS, the coder that encodes fastest, though it
    decodes slower than rANS; zstd tried on small fields only) and stores the rest (most
    mantissa bytes) raw on a sample's say-so, without trials; ``False`` tries every
    codec on every field (contexts, row / column classes, zstd) for the smallest shards.
    A save is on the training job's critical path and comes again every few hundred
    steps, so the default is the policy whose coding keeps up with the storage:
    ``False`` makes float shards slightly smaller for several times the coding time,
    which pays only where storage is much slower than a rank's coding (archives).
    Either way the shards are ordinary compressed files, read by the reader,
    ``consolidate`` and ``entropykit.load_file``, and the same state and options give the
    same shard bytes (their names carry each save's token).

    ``threads``: coding threads per rank (default: ``ENTROPYKIT_THREADS`` where set, else
    the cores this process may use divided among the ranks of its host, as ``torchrun``
    counts them in ``LOCAL_WORLD_SIZE``). ``overwrite=False`` refuses a directory that
    holds a checkpoint already (RuntimeError, as DCP's writer). ``consolidate`` also
    writes the full tensors as a compressed Hugging Face checkpoint into ``path``
    (``consolidate``, by the coordinator, before the metadata; coded with this ``fast``).
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int | None = None,
                 fast: bool = True, overwrite: bool = True,
                 consolidate: bool = False) -> None:
        # Every file is on disk (fsync) before it is renamed into place: no sync_files.
        super().__init__(path, single_file_per_rank=True, overwrite=overwrite)
        self.threads = _rank_threads(threads)
        self.fast = fast
        self.consolidate = consolidate

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any
                              ) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not kwargs.get("use_collectives", True):
            raise ValueError("CompressedStorageWriter needs DCP's collectives (the "
                             "coordinator writes the one metadata file)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        Path(self.path).mkdir(parents=True, exist_ok=True)
        if not self.overwrite and (Path(self.path) / METADATA).exists():
            raise RuntimeError(f"{self.path}: a checkpoint exists and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = self.save_id.replace("-", "")[:12]
        return [dataclasses.replace(p, storage_data=_Prefix(f"shard-{token}-{i:05d}"))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner
                   ) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(_write_rank(Path(self.path), plan, planner, self.threads, self.fast,
                                   self._shard_output))
        return fut

    def _shard_output(self, path: Path) -> AbstractContextManager[BinaryIO]:
        """The stream a rank's shard is written to: a temporary file renamed to ``path``
        when complete (a subclass may wrap it, e.g. to model slower storage). Its name is
        new with this save, so no killed run left a temporary of it to sweep here:
        ``finish`` clears those of earlier saves in one listing."""
        return _atomic.output_file(path, force=True, sweep=False)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        root = Path(self.path)
        layout = _layout_of(metadata, results, self.save_id)
        if self.consolidate:
            _consolidate(root, layout, root, threads=self.threads, fast=self.fast)
        with _atomic.output_file(root / METADATA, force=True) as out:
            out.write(_dumps(layout))
        _remove_unlisted(root, layout.files(), _SHARD)
        _remove_stale_temporaries(root)

    @property
    def metadata_path(self) -> str:
        return METADATA


def _rank_threads(threads: int | None) -> int:
    """``threads``, else ``ENTROPYKIT_THREADS`` where set, else this rank's share of the
    cores this process may use: ranks of one host that each ran a thread per core would
    contend for the cores and each hold a segment in flight per thread."""
    if threads is not None or os.environ.get(ENV, "").strip():
        return resolve(threads)
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    ranks = int(local) if local.isdigit() and int(local) >= 1 else 1
    return max(1, default_threads() // ranks)


def _write_rank(root: Path, plan: SavePlan, planner: SavePlanner, threads: int,
                fast: bool, output: Callable[[Path], AbstractContextManager[BinaryIO]]
                ) -> list[WriteResult]:
    """Write this rank's items as compressed files (``_parts``); the results name where
    each is."""
    if not plan.items:
        return []
    if not isinstance(plan.storage_data, _Prefix):
        raise ValueError("save plan without a shard name: the coordinator's global plan "
                         "did not run")
    keys: list[str] = []
    tensors: dict[str, Any] = {}
    offsets: dict[str, list[int]] = {}
    for item in plan.items:
        data = planner.resolve_data(item)
        key = _key(item.index.fqn, item.index.offset, tensors)
        if item.type == WriteItemType.BYTE_IO:
            tensors[key] = np.frombuffer(data.getbuffer(), np.uint8).copy()
        else:
            t = data.detach()
            _dtype_name(t.dtype, item.index.fqn)
            tensors[key] = t
            offsets[key] = list(item.tensor_data.chunk.offsets)
        keys.append(key)
    sizes = [_nbytes(tensors[k]) for k in keys]
    parts = _parts(sizes, _part_bytes(sum(sizes)))
    stem = plan.storage_data.stem
    names = ([stem + files.SUFFIX] if len(parts) == 1 else
             [f"{stem}-{p:04d}{files.SUFFIX}" for p in range(len(parts))])
    jobs, where = [], {}
    for name, part in zip(names, parts, strict=True):
        chosen = {keys[i]: tensors[keys[i]] for i in part}
        sharding = {k: {"saved_offsets": offsets[k]} for k in chosen if k in offsets}
        jobs.append((root / name, chosen, {SHARDING_KEY: json.dumps(sharding), "format": "pt"}))
        where.update({i: name for i in part})
    _write_files(jobs, threads, fast, output)
    return [WriteResult(index=item.index, size_in_bytes=sizes[i],
                        storage_data=_Stored(where[i], keys[i]))
            for i, item in enumerate(plan.items)]


def _nbytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    return value.numel() * value.element_size()


def _parts(sizes: list[int], part_bytes: int) -> list[list[int]]:
    """The items (indices, in order) of each file of a group of files (a rank's shards,
    a consolidated checkpoint): consecutive items, a new file begun before one would pass
    ``part_bytes`` (an item larger than that has a file of its own). From the sizes
    alone, so the same state gives the same files whatever the thread count."""
    parts: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if parts[-1] and used + n > part_bytes:
            parts.append([])
            used = 0
        parts[-1].append(i)
        used += n
    return parts


def _part_bytes(total: int) -> int:
    """Original bytes per file for a rank's ``total``: a share of ``FILES_PER_RANK``,
    within ``SEGMENT_BYTES`` (smaller files cost their fixed costs for no more
    parallelism than a segment's) and ``PART_BYTES``. From the total alone, so the same
    state gives the same files whatever the thread count."""
    return min(PART_BYTES, max(SEGMENT_BYTES, -(-total // FILES_PER_RANK)))


def _write_files(jobs: list[tuple[Path, dict[str, Any], dict[str, str]]], threads: int,
                 fast: bool, output: Callable[[Path], AbstractContextManager[BinaryIO]]
                 ) -> None:
    """Write each (path, tensors, metadata) as a compressed file, up to ``threads`` coded
    at once, the largest first; a file gets coding threads in proportion to its share of
    the bytes (one, unless one item outweighs the rest). One file's writes run one at a
    time in the kernel (a file's write lock), so one file per rank would cap a rank's
    write bandwidth at one thread's.

    A coded file is closed (the tail of its writes, fsync, rename) by a closing thread
    while its coding thread goes on to the next file: otherwise each file's last writes
    and fsync would leave a coding thread idle, and where storage is slow a rank's coding
    would stop for as long as its writes take. At most ``threads`` coded files wait to be
    closed, so what is held for the storage stays a few files' queues."""
    sizes = [sum(_nbytes(t) for t in tensors.values()) for _, tensors, _ in jobs]
    total = max(1, sum(sizes))
    at_once = min(len(jobs), threads)
    room = threading.BoundedSemaphore(2 * at_once)  # files coding or waiting to close

    def close(path: Path, cm: AbstractContextManager[BinaryIO],
              error: BaseException | None = None) -> None:
        try:
            with files.named(path):
                if error is None:
                    cm.__exit__(None, None, None)
                else:  # the temporary is removed; the error is the caller's to raise
                    cm.__exit__(type(error), error, error.__traceback__)
        finally:
            room.release()

    def one(i: int) -> concurrent.futures.Future[None]:
        path, tensors, meta = jobs[i]
        share = max(1, min(threads, threads * sizes[i] // total))
        room.acquire()
        try:
            cm = output(path)
            with files.named(path):
                out = cm.__enter__()
        except BaseException:
            room.release()
            raise
        try:
            with files.named(path):
                write(tensor_source(tensors, meta), out, threads=share, fast=fast,
                      segment_bytes=SEGMENT_BYTES, policy=codecs.CHECKPOINT if fast else None)
        except BaseException as e:
            close(path, cm, e)
            raise
        return _atomic.submit(lambda: close(path, cm))

    # The calling thread and at_once - 1 threads of the output pool (threads started
    # once per process, not per save) each code the largest file left until none is
    # left or one has failed.
    left = collections.deque(sorted(range(len(jobs)), key=lambda i: -sizes[i]))
    closes: list[concurrent.futures.Future[None]] = []
    failed = threading.Event()

    def coder() -> None:
        while not failed.is_set():
            try:
                i = left.popleft()
            except IndexError:
                return
            try:
                closes.append(one(i))
            except BaseException:
                failed.set()
                raise

    helpers = [_atomic.submit(coder) for _ in range(at_once - 1)]
    errors = []
    try:
        coder()
    except BaseException as e:  # noqa: BLE001 - raised once every thread is done
        errors.append(e)
    try:
        errors += [e for f in helpers if (e := f.exception()) is not None]
        errors += [e for f in closes if (e := f.exception()) is not None]
    except BaseException:  # interrupted while waiting: start no more files
        failed.set()
        raise
    if errors:
        raise errors[0]


def _key(fqn: str, offset: Any, taken: dict[str, Any]) -> str:
    """The name of an item in its shard: its fqn, or with its offsets when one rank saves
    two chunks of one tensor."""
    if fqn not in taken:
        return fqn
    return f"{fqn}@{','.join(str(int(o)) for o in (offset or ()))}"


def _layout_of(metadata: Metadata, results: list[list[WriteResult]],
               save_id: str | None) -> _Layout:
    where = {}
    for rs in results:
        for r in rs:
            where[(r.index.fqn, tuple(r.index.offset or ()))] = r.storage_data
    tensors, blobs = {}, {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            blobs[fqn] = where[(fqn, ())]
            continue
        t = _Tensor(_dtype_name(md.properties.dtype, fqn), tuple(md.size),
                    bool(md.properties.requires_grad))
        for c in md.chunks:
            offsets = tuple(int(o) for o in c.offsets)
            t.chunks.append(_Chunk(offsets, tuple(int(s) for s in c.sizes),
                                   where[(fqn, offsets)]))
        tensors[fqn] = t
    planner = metadata.planner_data
    if planner is not None:
        if not isinstance(planner, dict):
            raise TypeError(f"the planner's data is a {type(planner).__name__}; this "
                            f"writer stores a map of paths (DCP's default planners')")
        planner = {k: list(v) for k, v in planner.items()}
    return _Layout(tensors, blobs, planner, save_id)


def _dumps(layout: _Layout) -> bytes:
    def stored(s: _Stored) -> dict[str, str]:
        return {"file": s.file, "key": s.key}

    doc = {
        "format": FORMAT,
        "version": VERSION,
        "save_id": layout.save_id,
        "tensors": {fqn: {"dtype": t.dtype, "size": list(t.size),
                          "requires_grad": t.requires_grad,
                          "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                                      **stored(c.stored)} for c in t.chunks]}
                    for fqn, t in layout.tensors.items()},
        "bytes": {fqn: stored(s) for fqn, s in layout.blobs.items()},
        "planner_data": layout.planner_data,
    }
    try:
        return (json.dumps(doc, separators=(",", ":"), ensure_ascii=False) + "\n").encode(
            "utf-8")
    except TypeError as e:
        raise TypeError(f"the planner's data cannot be stored as JSON: {e}") from None


# -- reading the metadata: every field checked ------------------------------------------

def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise CorruptDataError(f"{METADATA}: {what}")


_INT = frozenset({int})


def _ints(v: Any, what: str, part: str = "") -> tuple[int, ...]:
    """``v`` as a tuple of sizes or offsets; the error names it ``what`` + ``part``
    (joined only then: this runs twice per chunk of every tensor, on every rank of a
    load)."""
    # Every element's type at once (C loops).
    if type(v) is list and len(v) <= MAX_DIMS and (not v or (
            set(map(type, v)) <= _INT and min(v) >= 0 and max(v) < 1 << 62)):
        return tuple(v)
    raise CorruptDataError(f"{METADATA}: {what}{part} is not a list of at most {MAX_DIMS} "
                           f"non-negative integers")


def _stored(v: Any, what: str, present: set[str]) -> _Stored:
    file, key = (v.get("file"), v.get("key")) if isinstance(v, dict) else (None, None)
    if type(file) is not str or type(key) is not str:
        raise CorruptDataError(f"{METADATA}: {what}: no file and key")
    if file not in present:
        raise CorruptDataError(f"{METADATA}: {what}: shard {file!r} is not a shard file of "
                               f"this directory")
    return _Stored(file, key)


def _check_tiling(what: str, t: _Tensor) -> None:
    """The chunks of ``t`` cover it exactly once (else a load would leave part of the
    destination as it was): on the grid cut by every chunk boundary, each cell is in one
    chunk. Chunks are checked inside the tensor before this."""
    if math.prod(t.size) == 0:
        return
    if _rows_tile(t):
        return
    cuts = [sorted({0, n, *(c.offsets[d] for c in t.chunks),
                    *(c.offsets[d] + c.sizes[d] for c in t.chunks)})
            for d, n in enumerate(t.size)]
    cells = math.prod(len(b) - 1 for b in cuts)
    _expect(cells <= MAX_GRID_CELLS, f"{what}: chunk boundaries cut it into {cells} cells, "
                                     f"more than the cap of {MAX_GRID_CELLS}")
    where = [{x: i for i, x in enumerate(b)} for b in cuts]
    count = np.zeros([len(b) - 1 for b in cuts], np.int64)
    for c in t.chunks:
        if math.prod(c.sizes):
            count[tuple(slice(w[o], w[o + n]) for w, o, n
                        in zip(where, c.offsets, c.sizes, strict=True))] += 1
    _expect(bool((count == 1).all()), f"{what}: its chunks do not cover it exactly once")


def _rows_tile(t: _Tensor) -> bool:
    """Whether the chunks of ``t`` (non-empty) are whole in every dimension but the first
    and, taken in order of their first offset, follow one another from 0 to its end: the
    tiling of ``Shard(0)`` / FSDP states, told in one sort. False leaves the question to
    the grid count (other tilings, and overlaps or gaps, which it reports)."""
    if not t.size:
        return False
    rest = t.size[1:]
    spans = []
    for c in t.chunks:
        if c.sizes[0]:
            if c.sizes[1:] != rest or any(c.offsets[1:]):
                return False
            spans.append((c.offsets[0], c.sizes[0]))
    at = 0
    for o, n in sorted(spans):
        if o != at:
            return False
        at += n
    return at == t.size[0]


def _parse(raw: bytes, present: set[str]) -> _Layout:
    """The layout in metadata bytes ``raw``; shard names must be among ``present`` (plain
    file names of the directory, so none leads outside it)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptDataError(f"{METADATA}: not JSON ({e})") from None
    _expect(isinstance(doc, dict) and doc.get("format") == FORMAT, f"not {FORMAT} metadata")
    _expect(doc.get("version") == VERSION, f"version {doc.get('version')!r}, this reads "
                                           f"{VERSION}")
    tensors, blobs = doc.get("tensors"), doc.get("bytes")
    _expect(isinstance(tensors, dict) and isinstance(blobs, dict), "no tensors or bytes")
    out = _Layout({}, {}, None, doc.get("save_id") if isinstance(doc.get("save_id"), str)
                  else None)
    for fqn, t in tensors.items():
        what = f"tensor {fqn!r}"
        _expect(isinstance(t, dict) and isinstance(t.get("chunks"), list),
                f"{what}: no chunks")
        _expect(t.get("dtype") in dtypes.FROM_TORCH.values(), f"{what}: dtype "
                                                              f"{t.get('dtype')!r}")
        size = _ints(t.get("size"), f"{what} size")
        rec = _Tensor(t["dtype"], size, t.get("requires_grad") is True)
        # Per chunk, the checks only: an error's message is built when it is raised.
        for c in t["chunks"]:
            if type(c) is not dict:
                raise CorruptDataError(f"{METADATA}: {what}: a chunk is not an object")
            offsets = _ints(c.get("offsets"), what, " chunk offsets")
            sizes = _ints(c.get("sizes"), what, " chunk sizes")
            if not (len(offsets) == len(sizes) == len(size) and not any(
                    map(operator.gt, map(operator.add, offsets, sizes), size))):
                raise CorruptDataError(f"{METADATA}: {what}: chunk at {list(offsets)} of "
                                       f"{list(sizes)} lies outside {list(size)}")
            rec.chunks.append(_Chunk(offsets, sizes, _stored(c, what, present)))
        _check_tiling(what, rec)
        out.tensors[fqn] = rec
    for fqn, b in blobs.items():
        _expect(fqn not in out.tensors, f"{fqn!r} is both a tensor and bytes")
        out.blobs[fqn] = _stored(b, f"item {fqn!r}", present)
    planner = doc.get("planner_data")
    if planner is not None:
        _expect(isinstance(planner, dict) and all(
            isinstance(v, list) and all(isinstance(x, (str, int)) for x in v)
            for v in planner.values()), "planner_data is not a map of paths")
        out.planner_data = planner
    return out


def _read_layout(root: Path) -> _Layout:
    path = root / METADATA
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no checkpoint metadata (the save did not finish, "
                                f"or this is not an entropykit DCP checkpoint)")
    with files.named(path), files.opened(path) as f:
        _expect(f.size <= MAX_METADATA_BYTES, f"{f.size} bytes, more than the cap of "
                                              f"{MAX_METADATA_BYTES}")
        raw = f.read(0, f.size).tobytes()
        f.check()
    present = {e.name for e in os.scandir(root) if e.is_file(follow_symlinks=False)}
    with files.named(root):
        return _parse(raw, present)


def _metadata(layout: _Layout) -> Metadata:
    types = dtypes.torch_types()
    sd: dict[str, Any] = {}
    storage: dict[MetadataIndex, _Stored] = {}
    for fqn, t in layout.tensors.items():
        if t.dtype not in types:
            raise CorruptDataError(f"tensor {fqn!r}: this torch has no {t.dtype}")
        chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes))
                  for c in t.chunks]
        sd[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=types[t.dtype], requires_grad=t.requires_grad),
            torch.Size(t.size), chunks)
        for c in t.chunks:
            storage[MetadataIndex(fqn, c.offsets)] = c.stored
    for fqn, s in layout.blobs.items():
        sd[fqn] = BytesStorageMetadata()
        storage[MetadataIndex(fqn)] = s
    planner = None if layout.planner_data is None else {
        k: tuple(v) for k, v in layout.planner_data.items()}
    return Metadata(state_dict_metadata=sd, planner_data=planner, storage_data=storage,
                    storage_meta=StorageMeta(save_id=layout.save_id))


# -- reading shards --------------------------------------------------------------------

def _strides(sizes: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(sizes):
        out.append(acc)
        acc *= n
    return out[::-1]


def _check_piece(c: Compressed, key: str, dtype: str, sizes: tuple[int, ...],
                 offsets: tuple[int, ...], lengths: tuple[int, ...]) -> None:
    try:
        e = c.entry(key)
    except KeyError:
        raise CorruptDataError(f"no tensor {key!r} in this shard") from None
    if (e.dtype, tuple(e.shape)) != (dtype, sizes):
        raise CorruptDataError(f"tensor {key!r}: {e.dtype}{list(e.shape)} in the shard, "
                               f"{dtype}{list(sizes)} in the metadata")
    if len(offsets) != len(sizes) or len(lengths) != len(sizes) or any(
            o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, lengths, sizes,
                                                           strict=True)):
        raise ValueError(f"tensor {key!r}: piece {list(offsets)} + {list(lengths)} lies "
                         f"outside {list(sizes)}")


def _bounds(sizes: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]
            ) -> tuple[int, int, list[int]]:
    """The first and last element (flat) of a non-empty piece of a chunk, and the
    chunk's strides in elements."""
    strides = _strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides, strict=True))
    return first, last, strides


def _piece(c: Compressed, key: str, dtype: str, sizes: tuple[int, ...],
           offsets: tuple[int, ...], lengths: tuple[int, ...], threads: int
           ) -> torch.Tensor:
    """The part ``offsets`` / ``lengths`` of saved chunk ``key`` (shape ``sizes``),
    decoding only the segments that hold it."""
    _check_piece(c, key, dtype, sizes, offsets, lengths)
    tdtype = dtypes.torch_types()[dtype]
    if math.prod(lengths) == 0:
        return torch.empty(lengths, dtype=tdtype)
    size = dtypes.BITS[dtype] // 8
    first, last, strides = _bounds(sizes, offsets, lengths)
    start, raw = c.span(key, first * size, (last + 1) * size, threads)
    flat = torch.from_numpy(raw).view(tdtype)
    return flat.as_strided(lengths, strides, (first * size - start) // size)


def _runs_on(sizes: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether a piece of these ``lengths`` of a chunk of ``sizes`` is one run of the
    chunk's bytes (row-major): after its first dimension longer than one, whole."""
    k = next((d for d, n in enumerate(lengths) if n != 1), len(lengths))
    return all(n == s for n, s in zip(lengths[k + 1:], sizes[k + 1:], strict=True))


def _into(c: Compressed, key: str, dtype: str, sizes: tuple[int, ...],
          offsets: tuple[int, ...], lengths: tuple[int, ...], target: torch.Tensor,
          threads: int) -> None:
    """The piece ``offsets`` / ``lengths`` of saved chunk ``key`` into ``target``:
    decoded straight into it where it can be (no copy), else by ``_piece`` and a copy."""
    if tuple(target.size()) != lengths:
        raise ValueError(f"{key}: the planner wants {list(target.size())}, the piece is "
                         f"{list(lengths)}")
    _check_piece(c, key, dtype, sizes, offsets, lengths)
    direct = (target.device.type == "cpu" and target.is_contiguous()
              and target.dtype == dtypes.torch_types()[dtype] and _runs_on(sizes, lengths))
    if not direct or target.numel() == 0:
        target.copy_(_piece(c, key, dtype, sizes, offsets, lengths, threads))
        return
    size = dtypes.BITS[dtype] // 8
    first, last, _ = _bounds(sizes, offsets, lengths)
    out = target.reshape(-1).view(torch.uint8).numpy()
    c.span_into(key, first * size, (last + 1) * size, out, threads)


class CompressedStorageReader(FileSystemReader):
    """DCP storage reader of ``CompressedStorageWriter``'s checkpoints, resharding to
    any world size: ``dcp.load(state_dict, storage_reader=CompressedStorageReader(path))``.
    ``threads``: decoding threads per rank (default: as the writer's)."""

    def __init__(self, path: str | os.PathLike[str], *, threads: int | None = None) -> None:
        super().__init__(path)
        self.threads = _rank_threads(threads)
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[str, tuple[int, ...]]] = {}
        self._read: tuple[Metadata, _Layout] | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        layout = _read_layout(Path(self.path))
        md = _metadata(layout)
        md.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        self._read = (md, layout)
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        # Each chunk's dtype and shape, which its shard must match: from the layout this
        # rank read where the metadata is that one (DCP has every rank read it), else
        # from the metadata given.
        if self._read is not None and self._read[0] is metadata:
            self._chunks = {(fqn, c.offsets): (t.dtype, c.sizes)
                            for fqn, t in self._read[1].tensors.items() for c in t.chunks}
        else:
            self._chunks = {
                (fqn, tuple(c.offsets)): (_dtype_name(md.properties.dtype, fqn),
                                          tuple(c.sizes))
                for fqn, md in metadata.state_dict_metadata.items()
                if isinstance(md, TensorStorageMetadata) for c in md.chunks}
        self._read = None

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        jobs = [_ReadJob(Path(self.path) / name, item,
                         None if item.type == LoadItemType.BYTE_IO
                         else planner.resolve_tensor(item).detach())
                for name, items in sorted(per_file.items()) for item in items]
        with ExitStack() as stack:
            shards = _Shards(stack)
            # Every file's items on one pool: a file's opening, reads and decodes overlap
            # the files' before it instead of waiting for their last item.
            for job, value in zip(jobs, self._pieces(jobs, shards), strict=True):
                if job.target is None:
                    planner.load_bytes(job.item, io.BytesIO(value))
                else:
                    planner.commit_tensor(job.item, job.target)
            shards.check()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _pieces(self, jobs: list[_ReadJob], shards: _Shards) -> Iterator[Any]:
        """Each job's item decoded, in order, on the thread pool (small items in
        parallel, a large one's segments in parallel): a tensor piece into its target
        (straight into it where it is one run of bytes of the saved chunk and the target
        a contiguous CPU tensor of its dtype; else decoded, then copied), a byte item's
        bytes returned."""
        inner = 1 if len(jobs) >= self.threads else self.threads

        def one(job: _ReadJob) -> Any:
            item = job.item
            key = self.storage_data[item.storage_index].key
            with files.named(job.path):
                c = shards.get(job.path)
                if job.target is None:
                    try:
                        e = c.entry(key)
                    except KeyError:
                        raise CorruptDataError(f"no item {key!r} in this shard") from None
                    if e.dtype != "U8" or len(e.shape) != 1:
                        raise CorruptDataError(f"item {key!r} is not a byte string")
                    return c.tensor(key, inner).tobytes()
                index = item.storage_index
                dtype, sizes = self._chunks[(index.fqn, tuple(index.offset))]
                _into(c, key, dtype, sizes, tuple(item.storage_offsets),
                      tuple(item.lengths), job.target, inner)
                return None

        return imap(one, jobs, min(self.threads, max(1, len(jobs))))


@dataclass(frozen=True)
class _ReadJob:
    """One item a rank loads: its shard file, and the tensor it goes into (None for a
    byte item)."""

    path: Path
    item: ReadItem
    target: torch.Tensor | None


class _Shards:
    """The shard files of one load, each opened and its header parsed by the first pool
    thread that needs it (the others wait for that file only), so that opening a file
    overlaps decoding the ones before it; ``stack`` closes them. ``check`` checks each
    opened file, in name order, once every item is read."""

    def __init__(self, stack: ExitStack) -> None:
        self._stack = stack
        self._lock = threading.Lock()
        self._slots: dict[Path, list[Any]] = {}  # path -> [lock, file, Compressed]

    def get(self, path: Path) -> Compressed:
        with self._lock:
            slot = self._slots.setdefault(path, [threading.Lock(), None, None])
        with slot[0]:
            if slot[2] is None:
                f = files.opened(path)
                with self._lock:
                    slot[1] = self._stack.enter_context(f)
                slot[2] = Compressed(f)
            return slot[2]

    def check(self) -> None:
        for path, slot in sorted(self._slots.items()):
            if slot[1] is not None:
                with files.named(path):
                    slot[1].check()


# -- consolidation into a Hugging Face checkpoint --------------------------------------

def _consolidate(root: Path, layout: _Layout, output: Path, *, prefix: str = "",
                 shard_bytes: int = SHARD_BYTES, threads: int | None = None,
                 fast: bool = False) -> list[str]:
    """Write the full tensors of ``layout`` (those named with ``prefix``, without it) as
    compressed Hugging Face shards and index into ``output``; returns the shard names."""
    n = resolve(threads)
    types = dtypes.torch_types()
    chosen = [(fqn, fqn[len(prefix):], t) for fqn, t in layout.tensors.items()
              if fqn.startswith(prefix) and len(fqn) > len(prefix)]
    if not chosen:
        raise ValueError(f"no tensors named {prefix!r}... in this checkpoint")
    sizes = [math.prod(t.size) * dtypes.BITS[t.dtype] // 8 for _, _, t in chosen]
    groups = [[chosen[i] for i in part] for part in _parts(sizes, shard_bytes)]
    output.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}{files.SUFFIX}"
             for i in range(len(groups))]
    ours = {*names, INDEX}
    _atomic.remove_stale_in(output, ours.__contains__)  # once, not a listing per shard
    weight_map, total = {}, 0
    for name, group in zip(names, groups, strict=True):
        full = {}
        for fqn, hf_name, t in group:
            full[hf_name] = _assemble(root, fqn, t, types[t.dtype], n)
            total += full[hf_name].numel() * full[hf_name].element_size()
            weight_map[hf_name] = name
        path = output / name
        with files.named(path), _atomic.output_file(path, force=True, sweep=False) as out:
            write(tensor_source(full, {"format": "pt"}), out, threads=n, fast=fast)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with _atomic.output_file(output / INDEX, force=True, sweep=False) as out:
        out.write((json.dumps(index, indent=2) + "\n").encode("utf-8"))
    _remove_unlisted(output, set(names), _MODEL)
    return names


def _assemble(root: Path, fqn: str, t: _Tensor, dtype: torch.dtype, threads: int
              ) -> torch.Tensor:
    """Tensor ``fqn`` whole, from its chunks."""
    full = torch.empty(t.size, dtype=dtype)
    for c in t.chunks:  # they tile the tensor: checked when read, made so by DCP's planner
        path = root / c.stored.file
        with files.named(path), files.opened(path) as f:
            piece = _piece(Compressed(f), c.stored.key, t.dtype, c.sizes,
                           (0,) * len(c.sizes), c.sizes, threads)
            f.check()
        full[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = piece
    return full


def consolidate(path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None,
                *, prefix: str = "", config: str | os.PathLike[str] | None = None,
                shard_bytes: int = SHARD_BYTES, threads: int | None = None,
                fast: bool = False) -> Path:
    """Write the full tensors of checkpoint ``path`` as a compressed Hugging Face
    checkpoint in ``output`` (default ``path``): ``model-0000k-of-0000n.safetensors``
    shards of at most ``shard_bytes`` original bytes each and ``model.safetensors.index.json``
    (written last). Only tensors named ``prefix...`` are taken, named without the prefix
    (``prefix="model."`` for a state dict ``{"model": ..., "optim": ...}``); non-tensor
    items are left out. ``config`` (a ``config.json``) is copied in with the mark that
    makes ``from_pretrained`` load the checkpoint. Each shard's tensors are held whole in
    memory while it is written. ``fast`` as for ``entropykit.compress_file`` (default
    False, the smallest files: consolidation runs once, off the training job's path).
    Returns the output directory."""
    root = Path(path)
    out = root if output is None else Path(output)
    _consolidate(root, _read_layout(root), out, prefix=prefix, shard_bytes=shard_bytes,
                 threads=threads, fast=fast)
    if config is not None:
        raw = Path(config).read_bytes()
        with _atomic.output_file(out / config_mark.CONFIG, force=True) as f:
            f.write(config_mark.marked(raw) or raw)
    return out


def _remove_stale_temporaries(root: Path) -> None:
    """Remove the temporaries of shard files that a killed save left in ``root``, those
    that ``_atomic`` proves stale (a save still writing keeps its own), in one listing.
    Every save's shards have names of their own, so no later save writes one of those
    names again and clears its temporary on the way, as a file written to a fixed name
    does."""
    _atomic.remove_stale_in(root, lambda name: _SHARD.fullmatch(name) is not None)


def _remove_unlisted(root: Path, keep: set[str], pattern: re.Pattern[str]) -> None:
    """Remove the files of ``root`` named by ``pattern`` that are not in ``keep``: shards
    of an earlier save into the same directory."""
    for e in os.scandir(root):
        if pattern.fullmatch(e.name) and e.name not in keep and e.is_file(
                follow_symlinks=False):
            os.unlink(e.path)


__all__ = ["METADATA", "CompressedStorageReader", "CompressedStorageWriter", "consolidate"]
