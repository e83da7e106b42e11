"""coding/crc32.py: equal to zlib.crc32 on every input (lengths around the 16/64-byte
blocks, every alignment, chained values, every byte value, large buffers, other dtypes),
and used wherever zlib's CRC-32 is."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from entropykit.coding.crc32 import crc32

_RNG = np.random.default_rng(0)
_BIG = _RNG.integers(0, 256, (1 << 20) + 64, dtype=np.uint8)


@pytest.mark.parametrize("offset", range(9))
def test_every_length_and_alignment_up_to_600_and_around_the_zlib_cutoff(offset: int) -> None:
    for n in [*range(600), *range(1000, 1100)]:
        x = _BIG[offset : offset + n]
        assert crc32(x) == zlib.crc32(x), n
        assert crc32(x, 0xDEADBEEF) == zlib.crc32(x, 0xDEADBEEF), n


@pytest.mark.parametrize("n", [1 << 10, (1 << 16) - 1, 1 << 16, (1 << 18) + 17, 1 << 20])
def test_large_buffers_and_chaining(n: int) -> None:
    x = _BIG[3 : 3 + n]
    assert crc32(x) == zlib.crc32(x)
    half = n // 2 + 5
    assert crc32(x[half:], crc32(x[:half])) == zlib.crc32(x)


@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x80, 0x01])
def test_constant_buffers(fill: int) -> None:
    x = np.full(5000, fill, np.uint8)
    assert crc32(x) == zlib.crc32(x)


def test_bytes_memoryview_and_wider_dtypes() -> None:
    x = _BIG[:4099]
    assert crc32(x.tobytes()) == crc32(memoryview(x.tobytes())) == zlib.crc32(x)
    w = _BIG[:4096].view(np.uint32)
    assert crc32(w) == zlib.crc32(w)
    m = _BIG[: 64 * 65].reshape(64, 65)
    assert crc32(m) == zlib.crc32(m)


def test_non_contiguous_input_is_refused_like_zlib() -> None:
    x = _BIG[:4000:2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        zlib.crc32(x)
    with pytest.raises(ValueError, match="not C-contiguous"):
        crc32(x)


@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1), st.integers(0, 7))
def test_property_equals_zlib(data: bytes, value: int, offset: int) -> None:
    buf = np.frombuffer(b"\x00" * offset + data, np.uint8)[offset:]
    assert crc32(buf, value) == zlib.crc32(data, value)


@pytest.mark.parametrize("accelerated", [True, False])
@pytest.mark.parametrize("n,size", [(4 * 4096 + 77, 4096), (3000, 1024), (100, 1024)])
def test_check_chunks_finds_the_first_failing_chunk(monkeypatch: pytest.MonkeyPatch,
                                                    accelerated: bool, n: int,
                                                    size: int) -> None:
    from entropykit.coding import crc32 as mod

    if accelerated and not mod.ACCELERATED:
        pytest.skip("no PCLMULQDQ here")
    monkeypatch.setattr(mod, "ACCELERATED", accelerated)
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    k = -(-n // size)
    crcs = np.array([zlib.crc32(data[j * size : (j + 1) * size]) for j in range(k)], np.uint32)
    codes = np.zeros(k, np.int64)
    assert mod.check_chunks(data, size, crcs, codes, 9) == -1
    assert not codes.any()
    bad = crcs.copy()
    bad[k - 1] ^= 1  # the last (short) chunk
    assert mod.check_chunks(data, size, bad, codes, 9) == k - 1
    assert codes.tolist() == [0] * (k - 1) + [9]
    if k > 1:  # an earlier chunk's own code stops the check there
        codes = np.zeros(k, np.int64)
        codes[0] = 3
        assert mod.check_chunks(data, size, bad, codes, 9) == 0
        assert codes.tolist() == [3] + [0] * (k - 1)


# The kernel itself (crc32() hands inputs under 1 KiB to zlib), every length from 0 to
# 700 bytes and 8 alignments, then 8 MiB: run in this process's build and, in a
# subprocess with a cache of its own, in a build for the same CPU without VPCLMULQDQ
# (the 128-bit folding path; the host's may take the 256-bit one).
_KERNEL_CASES = r'''
import zlib
import numpy as np
from entropykit.coding import crc32
rng = np.random.default_rng(7)
a = rng.integers(0, 256, (8 << 20) + 16, dtype=np.uint8)
a.flags.writeable = False
for n in [*range(701), 8 << 20]:
    for off in range(8) if n <= 700 else (0, 3):
        b = a[off : off + n]
        for v in (0, 0xDEADBEEF):
            got = int(crc32._crc(b, np.int64(v), crc32._TABLE))
            assert got == zlib.crc32(b, v), (n, off, v)
print("ok")
'''


def test_kernel_equals_zlib_with_and_without_vpclmulqdq(tmp_path) -> None:  # noqa: ANN001
    import os
    import subprocess
    import sys
    from pathlib import Path

    import llvmlite.binding as ll

    from entropykit.coding import crc32 as module

    if not module.ACCELERATED:
        pytest.skip("no carry-less multiply on this CPU: zlib computes every CRC")
    exec(_KERNEL_CASES, {})  # noqa: S102 - the module's own constant
    features = ll.get_host_cpu_features().flatten().split(",")
    features = ["-vpclmulqdq" if f == "+vpclmulqdq" else f for f in features]
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path), NUMBA_CPU_NAME=ll.get_host_cpu_name(),
               NUMBA_CPU_FEATURES=",".join(features),
               PYTHONPATH=str(Path(module.__file__).resolve().parents[2]))
    done = subprocess.run([sys.executable, "-c", _KERNEL_CASES], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
