"""The dtype registry agrees with numpy, torch, safetensors, the format split and the
distribution coder, and the tables derived from it say what they said before."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import safetensors.torch
import torch

from entropykit import dtypes, formats
from entropykit.container import header as hdr
from entropykit.formats import registry
from entropykit.rans import distribution


def test_bits_agree_with_numpy_and_torch() -> None:
    for d in dtypes.ALL:
        if d.numpy is not None:
            assert np.dtype(d.numpy).itemsize * 8 == d.bits, d
        if d.torch is not None:
            assert getattr(torch, d.torch).itemsize * 8 == d.bits, d
    assert hdr.DTYPE_BITS is dtypes.BITS


def test_torch_names_are_safetensors() -> None:
    # safetensors' own name -> torch dtype table, where the registry names a torch dtype.
    theirs = safetensors.torch._TYPES
    for name, t in dtypes.torch_types().items():
        assert theirs.get(name, t) == t, name
    assert {dtypes.FROM_TORCH[str(t)] for t in dtypes.torch_types().values()} == \
        set(dtypes.torch_types())


def test_numpy_round_trip() -> None:
    assert dtypes.NUMPY["BF16"] is ml_dtypes.bfloat16
    assert dtypes.NUMPY["F8_E4M3"] is ml_dtypes.float8_e4m3fn
    assert {dtypes.FROM_NUMPY[np.dtype(t)] for t in dtypes.NUMPY.values()} == set(dtypes.NUMPY)
    # The 16 dtypes the API converts; the others (F4, F6, FNUZ, C64) have no numpy type.
    assert set(dtypes.NUMPY) == {"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64",
                                 "F16", "F32", "F64", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def test_value_formats_are_the_distribution_coders() -> None:
    named = {d.value_format: d for d in dtypes.ALL if d.value_format}
    assert set(named) == set(distribution.FORMATS)
    for name, d in named.items():
        assert distribution.FORMATS[name].bits == d.bits
        assert dtypes.value_format(d.name) == name
    assert dtypes.value_format("F32") is None and dtypes.value_format("nope") is None


def test_split_words_are_one_element() -> None:
    for d in formats.DTYPES:
        assert registry._PLANES[d].word * 8 == dtypes.BITS[d], d


def test_write_order_is_safetensors() -> None:
    tensors = {f"t{i}": torch.zeros(2, dtype=t) for i, t in enumerate(
        dtypes.torch_types().values())}
    blob = safetensors.torch.save(tensors)
    header = hdr.parse_json(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    want = [e.name for e in hdr.write_order(header.entries)]
    assert [e.name for e in header.by_offset] == want
