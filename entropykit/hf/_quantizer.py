"""The entropykit quantizer: transformers' ``from_pretrained`` decodes compressed shards.

How transformers loads a checkpoint (5.x): it opens every shard with
``safetensors.safe_open`` and hands each tensor, lazily, to the weight conversions
(``core_model_loading``): renamings, then at most one ``WeightConverter`` whose operations
turn checkpoint tensors into parameters. A quantizer takes part through its registry
(``register_quantization_config`` / ``register_quantizer``, chosen by the
``quantization_config`` entry that ``entropykit compress DIR`` writes into config.json)
and adds converters through ``update_weight_conversions``. That is the path taken here:

- ``preprocess_model`` opens the compressed shards (``entropykit.safe_open``);
- ``update_weight_conversions`` maps every parameter name to its checkpoint name with
  transformers' own ``rename_source_key`` and appends one converter that matches every
  name; its operation (``Decode``) replaces the payload bytes transformers read with the
  tensor decoded from the shard, cast to the dtype transformers chose
  (``get_new_dtype``) and placed where it put the payload. On a CUDA device the shard is
  decoded by the GPU (``entropykit.load_file(shard, device=...)``; by the CPU, with a
  warning, where the GPU decoder is not installed); elsewhere by the CPU;
- ``postprocess_model`` closes the shards and removes the quantization config: the
  loaded model holds ordinary weights and saves as an ordinary checkpoint.

A model whose own conversions rewrite checkpoint tensors (e.g. merging experts) would
hand payload bytes to them: that is refused with an error rather than loaded wrongly.
What it is not: the config.json mark (``entropykit.hf``) or the decoders.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers.core_model_loading import (
    ConversionOps,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..lazy import CompressedFile, safe_open
from . import MARK_VERSION, QUANT_METHOD


class EntropyKitConfig(QuantizationConfigMixin):
    """The ``quantization_config`` of a compressed checkpoint (written by compress)."""

    def __init__(self, version: int = MARK_VERSION, original_config: str | None = None,
                 **kwargs: Any) -> None:
        kwargs.pop("quant_method", None)
        self.quant_method = QUANT_METHOD
        self.version = version
        self.original_config = original_config
        if type(version) is not int or not 1 <= version <= MARK_VERSION:
            raise ValueError(f"entropykit quantization_config version {version!r} is not "
                             f"supported (this entropykit: 1..{MARK_VERSION}); upgrade it")


class Decode(ConversionOps):
    """The tensor of one parameter, decoded from its compressed shard."""

    def __init__(self, quantizer: EntropyKitQuantizer) -> None:
        self.quantizer = quantizer
        self.dtype: torch.dtype | None = None  # what transformers would cast the tensor to

    def __deepcopy__(self, memo: dict) -> Decode:
        # transformers copies a converter per parameter: share the open shards, not copy them
        return Decode(self.quantizer)

    def convert(self, input_dict: dict[str, list[torch.Tensor]], *, full_layer_name: str,
                **kwargs: Any) -> dict[str, torch.Tensor]:
        (tensors,) = input_dict.values()
        (given,) = tensors
        out = self.quantizer.decode(full_layer_name, given)
        if self.dtype is not None:
            out = out.to(self.dtype)
        return {full_layer_name: out}


class EntropyKitQuantizer(HfQuantizer):
    """Loads a checkpoint directory compressed by entropykit (see the module docstring)."""

    requires_calibration = True  # only compressed checkpoints: nothing to do to a model

    def __init__(self, quantization_config: EntropyKitConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._stack = contextlib.ExitStack()
        self._files: dict[str, tuple[Path, CompressedFile]] = {}  # checkpoint name -> shard
        self._sources: dict[str, str] = {}  # parameter name -> checkpoint name
        self._gpu: dict[tuple[Path, str], dict[str, torch.Tensor]] = {}

    def _process_model_before_weight_loading(self, model: Any, checkpoint_files: list[str]
                                             | None = None, **kwargs: Any) -> Any:
        for name in checkpoint_files or []:
            path = Path(name)
            if path.suffix != ".safetensors":
                continue  # not ours (entropykit writes safetensors files only)
            f = self._stack.enter_context(safe_open(path, framework="pt"))
            if not isinstance(f, CompressedFile):
                continue  # a plain shard: transformers' tensors are the weights
            for k in f.keys():
                if k in self._files:
                    raise ValueError(f"{path}: tensor {k!r} is also in "
                                     f"{self._files[k][0]}")
                self._files[k] = (path, f)
        return model

    def update_weight_conversions(self, weight_conversions: list, model: Any) -> list:
        renamings = [w for w in weight_conversions if isinstance(w, WeightRenaming)]
        converters = [w for w in weight_conversions if isinstance(w, WeightConverter)]
        meta = model.state_dict()
        for k in self._files:
            target, claimed = rename_source_key(k, renamings, converters,
                                                model.base_model_prefix, meta)
            if claimed is not None:
                raise NotImplementedError(
                    f"{type(model).__name__} converts checkpoint tensor {k!r} while loading; "
                    "entropykit cannot load such a model from a compressed checkpoint yet: "
                    "decompress it first (entropykit decompress DIR)")
            if self._sources.setdefault(target, k) != k:
                raise ValueError(f"checkpoint tensors {self._sources[target]!r} and {k!r} "
                                 f"both load into {target!r}")
        return [*weight_conversions, WeightConverter("^(.+)$", "(.+)", [Decode(self)])]

    def get_new_dtype(self, converter: Any, param: Any, dtype: torch.dtype | None
                      ) -> torch.dtype | None:
        ops = getattr(converter, "operations", ())
        if ops and isinstance(ops[0], Decode):
            ops[0].dtype = dtype  # cast after decoding, not the payload bytes
            return None
        return super().get_new_dtype(converter, param, dtype)

    def decode(self, name: str, given: torch.Tensor) -> torch.Tensor:
        """Parameter ``name``'s tensor, on the device of ``given`` (what transformers read
        for it: the payload bytes of a compressed tensor, the tensor of a plain one)."""
        source = self._sources.get(name)
        if source is None:
            return given
        path, f = self._files[source]
        if given.device.type == "cuda":
            return self._decode_gpu(path, source, given.device)
        t = f.get_tensor(source)
        return t if given.device.type == "cpu" else t.to(given.device)

    def _decode_gpu(self, path: Path, name: str, device: torch.device) -> torch.Tensor:
        # The GPU decodes a whole shard at once; its tensors wait here until asked for.
        key = (path, str(device))
        if key not in self._gpu:
            from ..api import load_file
            from ..gpu import GpuUnavailableError

            try:
                self._gpu[key] = load_file(path, device=str(device))
            except GpuUnavailableError as e:  # same tensors, decoded by the CPU
                warnings.warn(f"entropykit: {path.name} decoded on the CPU ({e})",
                              stacklevel=2)
                self._gpu[key] = {k: v.to(device) for k, v in load_file(path).items()}
        return self._gpu[key].pop(name)

    def postprocess_model(self, model: Any, **kwargs: Any) -> Any:
        self._stack.close()
        self._files.clear()
        self._gpu.clear()
        self.remove_quantization_config(model)
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


register()  # importing this module registers it, whoever imports it first
