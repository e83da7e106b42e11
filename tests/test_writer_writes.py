"""The container writer's writes: a tensor of one segment goes out with its index in one
write and tensors written in order need no seek between them; a payload stored raw because
it would be mistakable for the tensor (``writer._mistakable``) is still written in place,
for tensors of one segment and of several."""

from __future__ import annotations

import io

import ml_dtypes
import numpy as np
import pytest

from entropykit.api import tensor_source
from entropykit.container import writer
from entropykit.container.reader import Compressed


class _Counted(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.seeks = 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.seeks += 1
        return super().seek(pos, whence)


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    return {f"t{i}": (rng.standard_normal((64, 96)) * 0.02).astype(ml_dtypes.bfloat16)
            for i in range(6)}


def test_tensors_of_one_segment_are_written_without_seeks_between_them():
    out = _Counted()
    writer.write(tensor_source(_tensors(), None), out, threads=1)
    # The first tensor's place, then the header's and the end's: none per tensor.
    assert out.seeks == 3
    got = Compressed(out.getvalue())
    for name, x in _tensors().items():
        assert np.array_equal(got.tensor(name).view(x.dtype).reshape(x.shape), x)


@pytest.mark.parametrize("segment_bytes", [1 << 24, 4096])  # one segment, three
def test_a_mistakable_payload_is_stored_raw_in_place(monkeypatch, segment_bytes):
    tensors = _tensors()
    monkeypatch.setattr(writer, "_mistakable", lambda e, size: e.name == "t2")
    out = io.BytesIO()
    writer.write(tensor_source(tensors, None), out, threads=1, segment_bytes=segment_bytes)
    got = Compressed(out.getvalue())
    assert {c for seg in got.record.tensors["t2"].codecs for c in seg} == {"raw"}
    assert {c for seg in got.record.tensors["t1"].codecs for c in seg} != {"raw"}
    for name, x in tensors.items():
        assert np.array_equal(got.tensor(name).view(x.dtype).reshape(x.shape), x)
