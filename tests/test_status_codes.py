"""Status codes have one source (``entropykit._status``): every Numba kernel's ``ERR_<NAME>``
is ``Status.<NAME>``, every kernel's words are ``_status.MESSAGES``', and a chunk a kernel
rejects raises ``CorruptDataError`` carrying its status, chunk and payload offset."""

from __future__ import annotations

import numpy as np
import pytest

from entropykit import CorruptDataError, rans, tans
from entropykit._status import MESSAGES, Status
from entropykit.rans import dist_kernels, distribution
from entropykit.rans import kernels as rans_kernels
from entropykit.tans import kernels as tans_kernels

KERNELS = (rans_kernels, dist_kernels, tans_kernels)


@pytest.mark.parametrize("mod", KERNELS, ids=lambda m: m.__name__)
def test_kernel_codes_are_the_status_numbers(mod):
    names = {n[4:]: v for n, v in vars(mod).items() if n.startswith("ERR_")}
    assert names and all(Status[n] == v for n, v in names.items())
    assert mod.OK == Status.OK
    assert all(MESSAGES[Status(c)] == text for c, text in mod.MESSAGES.items())


def test_tans_codes_renumbered_to_the_enum():
    k = tans_kernels
    assert (k.ERR_EMPTY, k.ERR_MARKER, k.ERR_TRUNCATED, k.ERR_TRAILING, k.ERR_FINAL,
            k.ERR_BOUNDS, k.ERR_TABLE) == (12, 13, 2, 3, 4, 7, 8)


def test_error_attributes_default_to_none_and_leave_the_message_alone():
    e = CorruptDataError("bad frame")
    assert str(e) == "bad frame" and (e.status, e.chunk, e.offset) == (None, None, None)
    e = CorruptDataError("bad chunk", status=Status.CRC, chunk=3, offset=99)
    assert str(e) == "bad chunk" and (e.status, e.chunk, e.offset) == (Status.CRC, 3, 99)
    assert CorruptDataError("x", Status.CRC).status is None  # keyword-only


def _skewed(n: int) -> np.ndarray:
    return np.minimum(np.random.default_rng(1).geometric(0.2, n), 255).astype(np.uint8)


def _corrupt_chunk(blob: bytes, offsets: np.ndarray, chunk: int, at: int) -> bytes:
    b = bytearray(blob)
    b[int(offsets[chunk]) + at] ^= 0x5A
    return bytes(b)


@pytest.mark.parametrize("coder", [rans, tans], ids=["rans", "tans"])
def test_a_rejected_chunk_names_its_status_chunk_and_offset(coder):
    from entropykit.coding import frame

    sym = _skewed(4096)
    blob = coder.encode(sym, chunk_size=1024)
    info = frame.parse(coder.static.CODER, blob)
    bad = _corrupt_chunk(blob, info.offsets, 2, 200)
    with pytest.raises(CorruptDataError) as e:
        coder.decode(bad, threads=1)
    err = e.value
    assert (err.chunk, err.offset) == (2, int(info.offsets[2]))
    assert isinstance(err.status, Status) and err.status != Status.OK
    assert str(err).startswith(f"{coder.static.CODER.name} frame chunk 2 (payload at byte "
                               f"{int(info.offsets[2])}): {MESSAGES[err.status]}")
    # a header fault is no chunk's: no status
    with pytest.raises(CorruptDataError) as e:
        coder.decode(b"XXXX" + blob[4:])
    assert (e.value.status, e.value.chunk, e.value.offset) == (None, None, None)


def test_a_distribution_chunk_failing_its_crc_says_so():
    rng = np.random.default_rng(5)
    mu = rng.normal(0, 1, 3000).astype(np.float32)
    sigma = np.full(3000, 0.1, np.float32)
    import ml_dtypes

    bits = (mu + sigma * rng.normal(size=3000)).astype(ml_dtypes.bfloat16).view(np.uint16)
    model = distribution.gaussian_model()
    blob = distribution.encode(bits, mu, sigma, model, fmt="bf16", chunk_size=1024)
    info = distribution.parse(blob)
    # Swapping two values' mu keeps every chunk decodable, but to other values.
    mu2 = mu.copy()
    mu2[1030], mu2[1031] = mu[1031] + 5, mu[1030] - 5
    with pytest.raises(CorruptDataError) as e:
        distribution.decode(blob, mu2, sigma, model)
    assert e.value.chunk == 1 and e.value.offset == int(info.offsets[1])
    assert e.value.status in (Status.CRC, Status.FINAL, Status.TRAILING, Status.TRUNCATED)
