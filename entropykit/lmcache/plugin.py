"""The LMCache plugin: a serde and an L2 adapter for LMCache's multi-process mode.

What it is (this module imports LMCache; ``entropykit.lmcache`` is the blob codec alone):

- the serde ``"entropykit"`` (registered with ``register_serde_factory`` when this module
  is imported): each chunk LMCache stores (a buffer of one or more (shape, dtype) groups)
  becomes one LMCache chunk blob (``encode_chunk``), stating its true length;
- ``SizedL2Adapter``: an L2 adapter that wraps another (``"inner"``) and loads each blob
  at its true length. LMCache's serde wrapper stores the bytes the serializer wrote, but
  loads into a buffer of the estimated size, and its file-system adapter counts a shorter
  file as a miss; this adapter reads a blob's header first, narrows the buffer to the
  length the header states, then reads the blob.

What it is not: an adapter that stores anything itself.

Loading the plugin: LMCache imports this module when an L2 adapter spec names it as a
``"plugin"`` adapter (README, "LMCache"); the serde then exists before LMCache builds it.
A damaged blob is a miss (LMCache reports the chunk as not loaded; the engine recomputes
it): ``SizedL2Adapter`` does not load a blob whose header or body CRC fails, and the
deserializer raises ``CorruptDataError`` on any damage, which LMCache turns into a miss of
every chunk of that load.
"""

from __future__ import annotations

import select
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from lmcache.lmcache_native import Bitmap
from lmcache.logging import init_logger
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import (
    L2AdapterConfigBase,
    get_l2_adapter_config_class,
)
from lmcache.v1.distributed.serde import (
    AsyncSerdeProcessor,
    Deserializer,
    SerdeProcessor,
    Serializer,
    get_registered_serde_types,
    register_serde_factory,
)
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import consume_fd, create_event_notifier

from .._errors import CorruptDataError
from . import HEADER_BYTES, blob_length, check_blob, decode_chunk, encode_chunk, max_blob_bytes

SERDE_NAME = "entropykit"
_POLL_MS = 200

_log = init_logger(__name__)


def _groups(obj: MemoryObj) -> list[torch.Tensor]:
    return [obj.get_tensor(i) for i in range(len(obj.get_shapes()))]


class EntropySerializer(Serializer):
    """LMCache's serializer side: a KV buffer to its chunk blob."""

    def __init__(self, *, threads: int | None = None) -> None:
        self._threads = threads

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> int:
        blob = encode_chunk(_groups(src), threads=self._threads)
        np.frombuffer(dst.byte_array, np.uint8)[: len(blob)] = np.frombuffer(blob, np.uint8)
        return len(blob)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        return max_blob_bytes(layout_desc.shapes, layout_desc.dtypes)


class EntropyDeserializer(Deserializer):
    """LMCache's deserializer side: a chunk blob back into its KV buffer, bit for bit."""

    def __init__(self, *, threads: int | None = None) -> None:
        self._threads = threads

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: ObjectKey) -> None:
        decode_chunk(src.byte_array, _groups(dst), threads=self._threads)


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """The serde LMCache builds from ``{"type": "entropykit", ...}``: ``threads`` (entropykit's
    threads per chunk, default all cores) and ``max_workers`` (LMCache's chunks coded at
    once, default 1)."""
    unknown = set(kwargs) - {"threads", "max_workers"}
    if unknown:
        raise ValueError(f"entropykit serde: unknown options {sorted(unknown)} (it takes "
                         f"threads and max_workers)")
    threads = kwargs.get("threads")
    workers = kwargs.get("max_workers", 1)
    for name, v in (("threads", threads), ("max_workers", workers)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"entropykit serde: {name} must be an integer >= 1, got {v!r}")
    return AsyncSerdeProcessor(EntropySerializer(threads=threads),
                               EntropyDeserializer(threads=threads), max_workers=workers)


if SERDE_NAME not in get_registered_serde_types():
    register_serde_factory(SERDE_NAME, create_serde)


class SizedL2AdapterConfig(L2AdapterConfigBase):
    """``{"inner": {"type": ..., ...}}``: the spec of the adapter that stores the blobs."""

    def __init__(self, inner: L2AdapterConfigBase) -> None:
        self.inner = inner

    @classmethod
    def from_dict(cls, d: dict) -> SizedL2AdapterConfig:
        inner = d.get("inner")
        if not isinstance(inner, dict) or not isinstance(inner.get("type"), str):
            raise ValueError("SizedL2Adapter needs 'inner': an L2 adapter spec with a 'type'")
        if "serde" in inner:
            raise ValueError("put 'serde' on the plugin adapter's spec, not on 'inner'")
        return cls(get_l2_adapter_config_class(inner["type"]).from_dict(inner))

    @classmethod
    def help(cls) -> str:
        return ("entropykit SizedL2Adapter config fields:\n"
                "- inner (dict): the L2 adapter spec that stores the blobs, e.g. "
                '{"type": "fs", "base_path": "/cache"}')


@dataclass
class _Load:
    keys: list[ObjectKey]
    objects: list[MemoryObj]
    picked: list[int] = field(default_factory=list)  # the keys of the body read


class SizedL2Adapter(L2AdapterInterface):
    """An L2 adapter loading LMCache chunk blobs at their true length from ``inner``.

    Store, lookup, delete and the rest go to the inner adapter. A load reads each key's
    header (the buffer narrowed to ``HEADER_BYTES``), then the blob (the buffer narrowed
    to the length its header states); a key whose header is damaged or states more than
    the buffer holds, or whose body fails its CRC, is not loaded. The buffers are
    LMCache's L1 byte buffers of the serde, which can be narrowed (``set_used_size``);
    a load into other buffers (a spec without the serde) is the inner adapter's alone.
    """

    def __init__(self, config: SizedL2AdapterConfig, l1_memory_desc: Any = None) -> None:
        super().__init__()
        self._inner = create_l2_adapter(config.inner, l1_memory_desc)
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()
        self._next_id: L2TaskId = 0
        self._heads: dict[L2TaskId, tuple[L2TaskId, _Load]] = {}  # inner id -> ours
        self._bodies: dict[L2TaskId, tuple[L2TaskId, _Load]] = {}
        self._plain: dict[L2TaskId, tuple[L2TaskId, _Load]] = {}
        self._done: dict[L2TaskId, Bitmap] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="entropykit-sized-l2",
                                        daemon=True)
        self._thread.start()

    # Everything but loads is the inner adapter's.
    def get_store_event_fd(self) -> int:
        return self._inner.get_store_event_fd()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._inner.get_lookup_and_lock_event_fd()

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._inner.submit_store_task(keys, objects)

    def pop_completed_store_tasks(self) -> dict:
        return self._inner.pop_completed_store_tasks()

    def submit_lookup_and_lock_task(self, keys: list[ObjectKey],
                                    group_layout_descs: dict[int, MemoryLayoutDesc]
                                    ) -> L2TaskId:
        return self._inner.submit_lookup_and_lock_task(keys, group_layout_descs)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._inner.query_lookup_and_lock_result(task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        self._inner.submit_unlock(keys)

    def register_listener(self, listener: Any) -> None:
        self._inner.register_listener(listener)

    def set_backend_identity(self, name: str, shared: bool = False) -> None:
        self._inner.set_backend_identity(name, shared)

    @property
    def supports_global_eviction(self) -> bool:
        return self._inner.supports_global_eviction

    def delete(self, keys: list[ObjectKey]) -> None:
        self._inner.delete(keys)

    def list_l2_keys(self, model_name: str | None = None, page_size: int = 500,
                     cursor: str | None = None) -> Any:
        return self._inner.list_l2_keys(model_name=model_name, page_size=page_size,
                                        cursor=cursor)

    def get_usage(self) -> Any:
        return self._inner.get_usage()

    def report_status(self) -> dict:
        return {**self._inner.report_status(), "entropykit_sized": True}

    @property
    def inner_adapter(self) -> L2AdapterInterface:
        return self._inner

    # Loads: header, then body.
    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        # Blobs arrive in the serde's byte buffers; any other buffer (a spec without the
        # serde) is the inner adapter's to load as it is, never narrowed.
        blobs = all(o.get_dtypes() == [torch.uint8] and len(o.get_shapes()) == 1
                    for o in objects)
        if blobs:
            for obj in objects:
                obj.set_used_size(HEADER_BYTES)
        state = _Load(list(keys), list(objects))
        with self._lock:  # held until the inner id is mapped: its completion looks it up
            ours = self._next_id
            self._next_id += 1
            table = self._heads if blobs else self._plain
            table[self._inner.submit_load_task(keys, objects)] = (ours, state)
        return ours

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._done.pop(task_id, None)

    def _finish(self, ours: L2TaskId, bitmap: Bitmap) -> None:
        with self._lock:
            self._done[ours] = bitmap
        self._load_efd.notify()

    def _headers_read(self, ours: L2TaskId, state: _Load, bitmap: Bitmap) -> None:
        for i in bitmap.get_indices_list():
            obj = state.objects[i]
            try:
                n = blob_length(obj.byte_array)
            except CorruptDataError as e:
                _log.warning("entropykit: %s not loaded: %s", state.keys[i], e)
                continue
            if n > obj.get_physical_size():
                _log.warning("entropykit: %s not loaded: its blob states %d bytes, the "
                             "buffer holds %d", state.keys[i], n, obj.get_physical_size())
                continue
            obj.set_used_size(n)
            state.picked.append(i)
        if not state.picked:
            self._finish(ours, Bitmap(len(state.keys)))
            return
        with self._lock:
            inner = self._inner.submit_load_task([state.keys[i] for i in state.picked],
                                                 [state.objects[i] for i in state.picked])
            self._bodies[inner] = (ours, state)

    def _bodies_read(self, ours: L2TaskId, state: _Load, bitmap: Bitmap) -> None:
        # A damaged blob is a miss of its key alone: LMCache fails every key of a
        # deserialize batch where one fails.
        out = Bitmap(len(state.keys))
        for j in bitmap.get_indices_list():
            i = state.picked[j]
            try:
                check_blob(state.objects[i].byte_array)
            except CorruptDataError as e:
                _log.warning("entropykit: %s not loaded: %s", state.keys[i], e)
                continue
            out.set(i)
        self._finish(ours, out)

    def _drain(self) -> None:
        for table, then in ((self._heads, self._headers_read),
                            (self._bodies, self._bodies_read),
                            (self._plain, lambda ours, _, bitmap: self._finish(ours, bitmap))):
            with self._lock:
                pending = list(table)
            for inner in pending:
                bitmap = self._inner.query_load_result(inner)
                if bitmap is None:
                    continue
                with self._lock:
                    ours, state = table.pop(inner)
                try:
                    then(ours, state, bitmap)
                except Exception:
                    _log.exception("entropykit: load task %d failed", ours)
                    self._finish(ours, Bitmap(len(state.keys)))

    def _loop(self) -> None:
        poller = select.poll()
        fd = self._inner.get_load_event_fd()
        poller.register(fd, select.POLLIN)
        while not self._stop.is_set():
            if poller.poll(_POLL_MS):
                try:
                    consume_fd(fd)
                except OSError:
                    pass
                self._drain()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._inner.close()
        self._load_efd.close()


__all__ = ["SERDE_NAME", "EntropyDeserializer", "EntropySerializer", "SizedL2Adapter",
           "SizedL2AdapterConfig", "create_serde"]
