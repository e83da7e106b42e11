"""The dtype registry: every safetensors dtype, named in each vocabulary entropykit meets.

What it is: one row per safetensors dtype name ("BF16", "F8_E4M3", ...): its bits per
element and, where they exist, its numpy type (ml_dtypes for the formats numpy lacks), its
torch dtype (by attribute name: torch is imported only when asked for) and the name of its
value format in the distribution coder ("bf16", "fp8_e4m3", ...); rows in the order
safetensors sorts tensors when it writes a file. Every other dtype table is derived from
this one. What it is not: how a dtype is split into fields (``formats``) or coded.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class DType:
    """One safetensors dtype; None where a vocabulary has no name for it."""

    name: str  # safetensors
    bits: int  # per element
    numpy: Any = None  # numpy scalar type
    torch: str | None = None  # torch attribute name ("bfloat16")
    value_format: str | None = None  # entropykit.rans.distribution format name ("bf16")


ALL: tuple[DType, ...] = (
    DType("BOOL", 8, np.bool_, "bool"),
    DType("F4", 4),
    DType("F6_E2M3", 6),
    DType("F6_E3M2", 6),
    DType("U8", 8, np.uint8, "uint8"),
    DType("I8", 8, np.int8, "int8"),
    DType("F8_E5M2", 8, ml_dtypes.float8_e5m2, "float8_e5m2", "fp8_e5m2"),
    DType("F8_E4M3", 8, ml_dtypes.float8_e4m3fn, "float8_e4m3fn", "fp8_e4m3"),
    DType("F8_E8M0", 8, ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu"),
    DType("F8_E4M3FNUZ", 8),
    DType("F8_E5M2FNUZ", 8),
    DType("I16", 16, np.int16, "int16"),
    DType("U16", 16, np.uint16, "uint16"),
    DType("F16", 16, np.float16, "float16", "fp16"),
    DType("BF16", 16, ml_dtypes.bfloat16, "bfloat16", "bf16"),
    DType("I32", 32, np.int32, "int32"),
    DType("U32", 32, np.uint32, "uint32"),
    DType("F32", 32, np.float32, "float32"),
    DType("C64", 64),
    DType("F64", 64, np.float64, "float64"),
    DType("I64", 64, np.int64, "int64"),
    DType("U64", 64, np.uint64, "uint64"),
)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
BITS: dict[str, int] = {d.name: d.bits for d in ALL}
# The rank safetensors sorts a file's tensors by (descending), then by name.
WRITE_RANK: dict[str, int] = {d.name: i for i, d in enumerate(ALL)}
NUMPY: dict[str, Any] = {d.name: d.numpy for d in ALL if d.numpy is not None}
FROM_NUMPY: dict[np.dtype, str] = {np.dtype(t): name for name, t in NUMPY.items()}
# Keyed by ``str(torch_dtype)``, so that a dtype is looked up without importing torch.
FROM_TORCH: dict[str, str] = {f"torch.{d.torch}": d.name for d in ALL if d.torch}


@functools.cache
def torch_types() -> Mapping[str, Any]:
    """safetensors name -> torch dtype, for those this torch has (imports torch). Built
    once: callers ask for it per tensor, and a build looks up every row in torch."""
    import torch

    return MappingProxyType({d.name: getattr(torch, d.torch) for d in ALL
                             if d.torch and hasattr(torch, d.torch)})


@functools.cache
def torch_names() -> Mapping[Any, str]:
    """torch dtype -> safetensors name: ``torch_types`` inverted (imports torch)."""
    return MappingProxyType({v: k for k, v in torch_types().items()})


def value_format(name: str) -> str | None:
    """The distribution coder's format name of safetensors dtype ``name``, None if none."""
    d = BY_NAME.get(name)
    return None if d is None else d.value_format


__all__ = ["ALL", "BITS", "BY_NAME", "DType", "FROM_NUMPY", "FROM_TORCH", "NUMPY",
           "WRITE_RANK", "torch_names", "torch_types", "value_format"]
