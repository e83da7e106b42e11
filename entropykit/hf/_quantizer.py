"""The entropykit quantizer: transformers' ``from_pretrained`` decodes compressed shards.

How transformers loads a checkpoint (5.x): it opens every shard with
``safetensors.safe_open`` and hands each tensor, lazily, to the weight conversions
(``core_model_loading``): renamings, then at most one ``WeightConverter`` whose operations
turn checkpoint tensors into parameters. A quantizer takes part through its registry
(``register_quantization_config`` / ``register_quantizer``, chosen by the
``quantization_config`` entry that ``entropykit compress DIR`` writes into config.json)
and adds converters through ``update_weight_conversions``. That is the path taken here:

- ``preprocess_model`` opens the shards (``entropykit.safe_open``);
- ``update_weight_conversions`` puts an operation (``Decode``) first in each of the
  model's converters (e.g. the merge of per-expert tensors) and appends one converter,
  with ``Decode`` alone, that matches every other name. It plans, with transformers' own
  ``rename_source_key`` and in transformers' collection order, which checkpoint tensor
  each converter receives, so ``Decode`` replaces the payload bytes transformers read
  with the tensor decoded from the shard, cast to the dtype transformers chose
  (``get_new_dtype``) and placed on the parameter's device (the device map's choice; the
  converters read payloads into host memory, so no payload byte goes to a GPU only to be
  replaced). The first tensor a shard is asked for decodes all of that shard's tensors
  bound for the same device at once, and later calls hand them out: on a CUDA device by
  the GPU, in one plan (by the CPU, with a warning, where the GPU decoder is not
  installed); elsewhere by the CPU, small tensors in one thread pool, large ones as asked.
  With a device map, the CUDA batches are decoded ahead on a side thread, in the order
  transformers asks for them, while it reads and places the tensors before them: one
  GPU load for all of a device's shards in a row (one planning thread, which plans on
  into the next shard, one set of staging buffers and fill threads), each batch made
  only once the one before it was taken (one batch ahead at most; with a map of one
  device the first starts as soon as the shards are open). The first batch's first
  group is planned and launched on the calling thread, before transformers starts its
  loading threads, whose Python would otherwise slow the plan (it holds the GIL);
- ``postprocess_model`` closes the shards and removes the quantization config: the
  loaded model holds ordinary weights and saves as an ordinary checkpoint; with
  ``resident`` (a loading attribute a config passed to ``from_pretrained`` sets) its
  weights are then made resident (``entropykit.torch.compress_model``).

What it is not: the config.json mark (``entropykit.hf``) or the decoders.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import itertools
import re
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.core_model_loading import (
    ConversionOps,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)
from transformers.quantizers import auto as _auto
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..container import files
from ..container.parallel import resolve
from ..lazy import CompressedFile, parsed, safe_open
from . import MARK_VERSION, QUANT_METHOD


class EntropyKitConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a compressed checkpoint (written by compress).

    Passed to ``from_pretrained`` (``quantization_config=EntropyKitConfig(resident=True)``)
    it sets how the checkpoint loads: ``resident`` keeps the weights coded on the device
    (``entropykit.torch.compress_model``) instead of decoding them into parameters;
    ``granularity``, ``ahead``, ``tile_bytes``, ``tiles_ahead`` and ``chunk_size`` are
    ``compress_model``'s options of the same names (None: its defaults).
    """

    def __init__(self, version: int = MARK_VERSION, original_config: str | None = None,
                 resident: bool = False, granularity: str | None = None,
                 ahead: int | None = None, tile_bytes: int | None = None,
                 tiles_ahead: int | None = None, chunk_size: int | None = None,
                 **kwargs: Any) -> None:
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.version = version
        self.original_config = original_config
        if not isinstance(resident, bool):
            raise TypeError(f"resident must be a bool, got {type(resident).__name__}")
        self.resident = resident
        for name, value in (("ahead", ahead), ("tile_bytes", tile_bytes),
                            ("tiles_ahead", tiles_ahead), ("chunk_size", chunk_size)):
            if value is not None and type(value) is not int:
                raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
        if granularity is not None and not isinstance(granularity, str):
            raise TypeError(f"granularity must be a str or None, got "
                            f"{type(granularity).__name__}")
        self.granularity, self.ahead = granularity, ahead
        self.tile_bytes, self.tiles_ahead, self.chunk_size = tile_bytes, tiles_ahead, chunk_size
        if type(version) is not int or not 1 <= version <= MARK_VERSION:
            raise ValueError(f"entropykit quantization_config version {version!r} is not "
                             f"supported (this entropykit: 1..{MARK_VERSION}); upgrade it")

    def get_loading_attributes(self) -> dict[str, Any]:
        """What a config passed to ``from_pretrained`` overrides in the checkpoint's."""
        return {"resident": self.resident, **self.resident_options()}

    def resident_options(self) -> dict[str, int | str]:
        """``compress_model``'s options this config sets."""
        options = {"granularity": self.granularity, "ahead": self.ahead,
                   "tile_bytes": self.tile_bytes, "tiles_ahead": self.tiles_ahead,
                   "chunk_size": self.chunk_size}
        return {k: v for k, v in options.items() if v is not None}


class Decode(ConversionOps):
    """The first operation of a converter: the checkpoint tensors it collected, decoded.

    ``last``: the converter has no other operation (the one entropykit appends), so the
    result is the parameter itself; otherwise the decoded tensors go on to the model's own
    operations (e.g. a merge of experts) as transformers would have read them.
    """

    def __init__(self, quantizer: EntropyKitQuantizer, last: bool) -> None:
        self.quantizer, self.last = quantizer, last
        self.dtype: torch.dtype | None = None  # what transformers would cast the tensors to

    def __deepcopy__(self, memo: dict) -> Decode:
        # transformers copies a converter per parameter: share the open shards, not copy them
        return Decode(self.quantizer, self.last)

    def convert(self, input_dict: dict[str, list[torch.Tensor]], *, full_layer_name: str,
                **kwargs: Any) -> dict[str, Any]:
        plan = self.quantizer.plan.get(full_layer_name, {})
        out = {}
        for pattern, tensors in input_dict.items():
            names = plan.get(pattern, [])
            if len(names) != len(tensors):  # transformers collected otherwise than planned
                raise RuntimeError(f"entropykit: {len(tensors)} tensors for {full_layer_name} "
                                   f"({pattern}), expected {len(names)}: {names}")
            out[pattern] = [self.quantizer.decode(n, t, self.dtype, full_layer_name)
                            for n, t in zip(names, tensors, strict=True)]
        if self.last:
            ((tensor,),) = out.values()
            return {full_layer_name: tensor}
        return out


class _Every(WeightConverter):
    """The converter entropykit appends (``Decode`` alone, every name). transformers
    deep-copies a converter for each parameter it loads; this one is copied attribute by
    attribute, not through the generic protocol (``__reduce_ex__``, then transformers'
    own ``__setattr__`` per attribute), which cost several times as much a parameter."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> _Every:
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name in _attributes(self):
            if hasattr(self, name):
                object.__setattr__(new, name, _copied(getattr(self, name), memo))
        return new


_ATOMS = (str, int, float, type(None), re.Pattern)


def _copied(value: Any, memo: dict) -> Any:
    """``copy.deepcopy(value, memo)``, short-cut for what a converter holds before it
    collects tensors: atoms, lists of strings, empty (default) dicts."""
    if isinstance(value, _ATOMS):
        return value
    if type(value) is list and all(isinstance(v, str) for v in value):
        return list(value)
    if type(value) is defaultdict and not value:
        return defaultdict(value.default_factory)
    return copy.deepcopy(value, memo)


def _attributes(obj: object) -> tuple[str, ...]:
    """The names of ``obj``'s attributes: its classes' slots and its ``__dict__``'s."""
    slots = _slots(type(obj))
    return slots + tuple(k for k in getattr(obj, "__dict__", {}) if k not in slots)


@functools.cache
def _slots(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for c in cls.__mro__:
        slots = getattr(c, "__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


_Key = tuple[Path, str]  # (compressed shard, device): a batch


class _Ahead:
    """Batches (key, tensors) made on a side thread in order (``items``), each only once
    the one before it was taken (``take``): at most the batch being handed out and the
    next one are held. ``close`` stops the thread (after the batch it is making)."""

    def __init__(self, keys: list[_Key], items: Iterator[tuple[_Key, dict]]) -> None:
        self.keys = frozenset(keys)
        self._cv = threading.Condition()
        self._item: tuple[_Key, dict] | None = None
        self._error: BaseException | None = None
        self._done = self._stop = False
        self._thread = threading.Thread(target=self._run, args=(items,), daemon=True,
                                        name="entropykit-decode")
        self._thread.start()

    def _run(self, items: Iterator[tuple[_Key, dict]]) -> None:
        try:
            for item in items:
                with self._cv:
                    self._item = item
                    self._cv.notify_all()
                    self._cv.wait_for(lambda: self._item is None or self._stop)
                    if self._stop:
                        return
        except BaseException as e:  # noqa: BLE001 -- raised by ``take``
            with self._cv:
                self._error = e
        finally:
            items.close()  # on this thread: the GPU load's threads stop
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def take(self) -> tuple[_Key, dict] | None:
        """The next batch (waiting for it), None after the last; raises what making it
        raised."""
        with self._cv:
            self._cv.wait_for(lambda: self._item is not None or self._done)
            if self._item is not None:
                item, self._item = self._item, None
                self._cv.notify_all()
                return item
            if self._error is not None:
                raise self._error
            return None

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._item = None  # a batch made and never asked for
            self._cv.notify_all()
        self._thread.join()


SMALL = 4 << 20  # bytes: CPU-bound tensors up to this size are decoded a shard at a time
_ALL = "^(.+)$"  # matches every name and keeps it (the captured group is the target)
# Converters that read their checkpoint tensors on the CPU: transformers then reads a
# payload into host memory only, and the decoded tensor is made on the parameter's device
# (older releases lack the option and read payloads onto that device).
_ON_CPU = ({"force_cpu": True}
           if "force_cpu" in inspect.signature(WeightConverter.__init__).parameters else {})


class EntropyKitQuantizer(HfQuantizer):
    """Loads a checkpoint directory compressed by entropykit (see the module docstring)."""

    requires_calibration = True  # only compressed checkpoints: nothing to do to a model

    def __init__(self, quantization_config: EntropyKitConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._stack = contextlib.ExitStack()
        # checkpoint name -> (shard, open compressed shard or None for a plain one)
        self._files: dict[str, tuple[Path, CompressedFile | None]] = {}
        # parameter name -> converter source pattern -> checkpoint names, in loading order
        self.plan: dict[str, dict[str, list[str]]] = {}
        self._targets: dict[str, str] = {}  # checkpoint name -> the parameter it loads into
        self._where: dict[str, torch.device] = {}  # parameter -> its device-map device
        # (shard, device) -> its tensors bound there, decoded together, until handed out
        self._batches: dict[_Key, dict[str, torch.Tensor]] = {}
        self._shards: dict[Path, list[str]] = {}  # compressed shard -> its tensors
        self._order: list[str] = []  # checkpoint names in the order transformers asks
        self._ahead: _Ahead | None = None  # the CUDA batches decoded ahead
        self._model: Any = None
        self._device_map: dict | None = None

    def _process_model_before_weight_loading(self, model: Any, checkpoint_files: list[str]
                                             | None = None, **kwargs: Any) -> Any:
        self._model = model  # for update_weight_conversions where it is not passed
        self._device_map = kwargs.get("device_map")
        for name in checkpoint_files or []:
            path = Path(name)
            if path.suffix != ".safetensors":
                continue  # not ours (entropykit writes safetensors files only)
            f = self._stack.enter_context(safe_open(path, framework="pt"))
            for k in f.keys():
                if k in self._files:
                    raise ValueError(f"{path}: tensor {k!r} is also in "
                                     f"{self._files[k][0]}")
                # a plain shard's tensors are the weights as transformers reads them
                self._files[k] = (path, f if isinstance(f, CompressedFile) else None)
                if isinstance(f, CompressedFile):
                    self._shards.setdefault(path, []).append(k)
        self._order = sorted(self._files, key=dot_natural_key)
        self._start_next()  # a one-device map places every tensor already
        return model

    def update_weight_conversions(self, weight_conversions: list, model: Any = None) -> list:
        # Older transformers releases call this without the model: the one preprocessed.
        model = self._model if model is None else model
        # The model's converters get Decode first (copies: the mapping may be shared).
        ours = [w.copy(list(w._original_source_patterns), list(w._original_target_patterns),
                       operations=[Decode(self, False), *w.operations], **_ON_CPU)
                if isinstance(w, WeightConverter) else w for w in weight_conversions]
        every = _Every(_ALL, "(.+)", [Decode(self, True)], **_ON_CPU)
        renamings = [w for w in ours if isinstance(w, WeightRenaming)]
        converters = [w for w in ours if isinstance(w, WeightConverter)] + [every]
        meta = model.state_dict()
        # The order transformers collects tensors in, so the n-th one a converter gets is
        # the n-th name planned for it.
        for k in self._order:
            target, pattern = rename_source_key(k, renamings, converters,
                                                model.base_model_prefix, meta)
            if target not in meta and k in meta and self._files[k][1] is not None:
                # transformers would then load k under its own name with no converter
                raise NotImplementedError(f"entropykit: renaming {k!r} to {target!r} "
                                          "(not a parameter) is not supported")
            if target in meta:
                self._targets[k] = target
            names = self.plan.setdefault(target, {}).setdefault(pattern, [])
            names.append(k)
            if pattern == every.source_patterns[0] and len(names) > 1:
                raise ValueError(f"checkpoint tensors {names[0]!r} and {k!r} both load "
                                 f"into {target!r}")
        self._start_next()
        return [*ours, every]

    def get_new_dtype(self, converter: Any, param: Any, dtype: torch.dtype | None
                      ) -> torch.dtype | None:
        ops = getattr(converter, "operations", ())
        if ops and isinstance(ops[0], Decode):
            ops[0].dtype = dtype  # cast after decoding, not the payload bytes
            return None
        return super().get_new_dtype(converter, param, dtype)

    def decode(self, name: str, given: torch.Tensor, dtype: torch.dtype | None,
               target: str) -> torch.Tensor:
        """Checkpoint tensor ``name`` (``given``: what transformers read for it, the payload
        bytes of a compressed tensor, the tensor of a plain one) on the device of parameter
        ``target``, cast to ``dtype`` if not None."""
        path, f = self._files[name]
        if f is None:
            out = given
        else:
            device = self._device(target, given)
            out = self._batch(path, f, device, given).pop(name, None)
            if out is None:  # left out of the batch (e.g. asked for twice): on its own
                out = f.get_tensor(name)
                out = out if device.type == "cpu" else out.to(device)
        return out if dtype is None or out.dtype == dtype else out.to(dtype)

    def _device(self, target: str, given: torch.Tensor | None) -> torch.device:
        """Where transformers puts parameter ``target``: its device map's choice, else
        where it read the payload."""
        if not self._device_map:
            return given.device
        if target not in self._where:
            from transformers.integrations.accelerate import get_device

            self._where[target] = torch.device(get_device(self._device_map, target,
                                                          valid_torch_device=True))
        return self._where[target]

    def _batch(self, path: Path, f: CompressedFile, device: torch.device,
               given: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tensors of shard ``path`` bound for ``device``, decoded together on the
        first call (one GPU plan and launch per kernel flavour, or one CPU thread pool:
        no per-tensor setup) and handed out one by one (``pop``), so the memory held is
        at most the shard's. On the CPU only tensors up to ``SMALL`` bytes are batched:
        a large one is decoded when asked for, on every thread, as before. CUDA batches
        may be decoded ahead (``_ahead``): those it makes before this one are kept."""
        key = (path, str(device))
        ahead = self._ahead
        while key not in self._batches and ahead is not None and key in ahead.keys:
            item = ahead.take()
            if item is None:
                break
            self._batches[item[0]] = item[1]
        if key not in self._batches:
            self._batches[key] = self._decode_batch(path, f, device,
                                                    self._names(path, device, given))
        return self._batches[key]

    def _names(self, path: Path, device: torch.device, given: torch.Tensor | None
               ) -> list[str]:
        """The tensors of compressed shard ``path`` that a batch for ``device`` holds
        (``given``: where a tensor was read, for loads without a device map)."""
        small = device.type != "cuda"
        c = parsed(self._files[self._shards[path][0]][1])
        return [k for k in self._shards[path] if self._bound(k, given) == device
                and (not small or c.entry(k).nbytes <= SMALL)]

    def _bound(self, k: str, given: torch.Tensor | None) -> torch.device | None:
        """Where checkpoint tensor ``k`` goes: its parameter's device, or with a device
        map of one device, that device (even before the parameters are known); None
        where that is not known."""
        if k in self._targets:
            return self._device(self._targets[k], given)
        if self._one_device():
            return self._device("", None)
        return None

    def _one_device(self) -> bool:
        return isinstance(self._device_map, dict) and set(self._device_map) == {""}

    def _decode_batch(self, path: Path, f: CompressedFile, device: torch.device,
                      names: list[str]) -> dict[str, torch.Tensor]:
        if not names:  # e.g. the shard's tensors for this device are all large
            return {}
        from .._cuda import GpuUnavailableError
        from ..api import _load_compressed

        c = parsed(f)  # the shard as opened by preprocess_model: parsed once
        threads = resolve(None)
        on = device if device.type == "cuda" else torch.device("cpu")
        with files.named(path):
            try:
                got = _load_compressed(c, on, threads, names)
            except GpuUnavailableError as e:  # same tensors, decoded by the CPU
                warnings.warn(f"entropykit: {path.name} decoded on the CPU ({e})",
                              stacklevel=2)
                on = torch.device("cpu")
                got = _load_compressed(c, on, threads, names)
        if on != device:
            got = {k: v.to(device) for k, v in got.items()}
        return got

    def _start_next(self) -> None:
        """Start decoding, on a side thread, the CUDA batches transformers will ask for
        (known only from a device map), in that order, so that the GPU decodes each while
        transformers reads and places the tensors before it (``_Ahead``, ``_decoded``)."""
        if self._ahead is not None or not self._device_map \
                or not (self._targets or self._one_device()):
            return  # started, or where tensors go is not known (yet)
        keys: dict[_Key, None] = {}
        for k in self._order:
            path, f = self._files[k]
            device = self._bound(k, None)
            if f is not None and device is not None and device.type == "cuda":
                keys.setdefault((path, str(device)), None)
        if keys:
            self._ahead = _Ahead(list(keys), self._decoded(list(keys)))

    def _decoded(self, keys: list[_Key]) -> Iterator[tuple[_Key, dict[str, torch.Tensor]]]:
        """The batches of ``keys`` (CUDA devices), in order: a device's run of them
        through one GPU load (``api._load_many``), by the CPU where the GPU decoder is
        not installed (``_decode_batch``'s warning). The first run's load plans and
        launches its first group here, on the calling thread: transformers' loading
        threads have not started yet, so the plan (Python holding the GIL) runs at its
        own speed and the GPU decodes while transformers reads; the rest goes on on the
        thread iterating the result."""
        runs = []
        for device, keyed in itertools.groupby(keys, key=lambda key: key[1]):
            dev = torch.device(device)
            runs.append((device, [(path, self._files[self._shards[path][0]][1],
                                   self._names(path, dev, None)) for path, _ in keyed]))
        first = None
        if runs:
            # transformers calls this under its meta device context: the loader's buffers
            # made here must be real
            with torch.device("cpu"):
                first = self._loads(*runs[0], now=True)
        return self._yielded(runs, first)

    def _loads(self, device: str, run: list[tuple[Path, CompressedFile, list[str]]],
               now: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """The batches of ``run`` (shards of one CUDA device) as they are asked for."""
        from .._cuda import GpuUnavailableError
        from ..api import _load_many

        dev = torch.device(device)
        try:
            return _load_many([(parsed(f), names) for _, f, names in run], dev,
                              resolve(None), now=now)
        except GpuUnavailableError:
            return (self._decode_batch(path, f, dev, names) for path, f, names in run)

    def _yielded(self, runs: list, first: Iterator[dict[str, torch.Tensor]] | None
                 ) -> Iterator[tuple[_Key, dict[str, torch.Tensor]]]:
        """``_decoded``'s batches, each named by its shard; ``first``: the first run's,
        under way."""
        for k, (device, run) in enumerate(runs):
            outs = first if k == 0 and first is not None else self._loads(device, run)
            try:
                for path, _, _ in run:
                    with files.named(path):
                        got = next(outs)
                    yield (path, device), got
            finally:
                close = getattr(outs, "close", None)
                if close is not None:
                    close()

    def postprocess_model(self, model: Any, **kwargs: Any) -> Any:
        if self._ahead is not None:  # batches decoded ahead and never asked for
            self._ahead.close()
            self._ahead = None
        self._stack.close()
        self._files.clear()
        self.plan.clear()
        self._targets.clear()
        self._where.clear()
        self._batches.clear()
        self._shards.clear()
        self._order.clear()
        resident = self.quantization_config.resident
        options = self.quantization_config.resident_options()
        self.remove_quantization_config(model)
        if resident:
            from ..torch import compress_model

            compress_model(model, **options)
        return model

    def is_serializable(self) -> bool:
        return False  # never reached: postprocess_model leaves an ordinary model

    @property
    def is_trainable(self) -> bool:
        return True


def register() -> None:
    """Register config and quantizer under ``quant_method: "entropykit"`` (once)."""
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(EntropyKitConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(EntropyKitQuantizer)
    # transformers lets a config passed to from_pretrained override the loading
    # attributes (get_loading_attributes) only of the config types listed here
    if EntropyKitConfig not in _auto.LOADING_ATTRIBUTES_CONFIG_TYPES:
        _auto.LOADING_ATTRIBUTES_CONFIG_TYPES = (*_auto.LOADING_ATTRIBUTES_CONFIG_TYPES,
                                                 EntropyKitConfig)


register()  # importing this module registers it, whoever imports it first
