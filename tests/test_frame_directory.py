"""The frame's chunk directory as ``frame.parse`` reads it: offsets, lengths, modes, and the
errors a damaged directory gives."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit import CorruptDataError
from entropykit.coding import frame
from entropykit.rans import static as rans_static
from entropykit.tans import static as tans_static

CHUNK = 1 << 10
CODERS = [rans_static.CODER, tans_static.CODER]


def _frame(coder, n_chunks: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    sym = rng.integers(0, 8, n_chunks * CHUNK - 7).astype(np.uint8)
    sym[CHUNK : 2 * CHUNK] = rng.integers(0, 256, CHUNK)  # this chunk is stored raw
    blob = frame.encode(coder, sym, 12, CHUNK, threads=1)
    return np.frombuffer(blob, np.uint8).copy(), sym


def _directory_start(buf: np.ndarray) -> int:
    return frame.HEADER_SIZE + int(buf[24:28].view("<u4")[0])


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_directory_gives_contiguous_payloads(coder):
    buf, sym = _frame(coder)
    info = frame.parse(coder, buf)
    d = _directory_start(buf)
    assert info.offsets[0] == d + 9 * 5
    assert np.array_equal(info.offsets[1:], info.offsets[:-1] + info.lengths[:-1])
    assert info.end == buf.size == info.offsets[-1] + info.lengths[-1]
    assert list(info.modes) == [frame.MODE_CODED, frame.MODE_RAW] + [frame.MODE_CODED] * 3
    assert info.lengths[1] == CHUNK
    assert np.array_equal(frame.decode(coder, buf, threads=1), sym)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
def test_unknown_mode_is_named_with_its_chunk(coder):
    buf, _ = _frame(coder)
    buf[_directory_start(buf) + 8 * 5 + 3] = 2
    with pytest.raises(CorruptDataError, match="chunk 3: unknown mode 2"):
        frame.parse(coder, buf)


@pytest.mark.parametrize("coder", CODERS, ids=lambda c: c.name)
@pytest.mark.parametrize(("delta", "what"), [(1, "truncated"), (-1, "trailing bytes"),
                                             (1 << 31, "truncated")])
def test_lengths_that_miss_the_frame_end(coder, delta, what):
    buf, _ = _frame(coder)
    at = _directory_start(buf) + 4 * 2
    lengths = buf[at : at + 4].view("<u4")
    lengths[0] = (int(lengths[0]) + delta) % (1 << 32)
    with pytest.raises(CorruptDataError, match=f"{what}: payloads end at byte"):
        frame.parse(coder, buf)
