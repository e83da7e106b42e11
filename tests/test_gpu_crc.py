"""The device's CRC-32 checks of staged bytes (``container/cuda/_crc.cu``), on the CPU.

The kernels cut each row (staged offset, length, seed, wanted CRC) into pieces of
``_crc.PIECE`` bytes, compute each piece's raw register with the byte table, shift it
past the row's later bytes by multiplication with x^(8n) mod P (the table ``X2N`` of the
source), XOR the pieces into the row's accumulator and add the seed's term at the end.
``emulate_crc`` does exactly that in numpy, on the kernel's own buffers and with the
constants read from the source, and is compared here with zlib; the GPU loader's CPU
tests (test_gpu_load.py) run it on what the loader stages. The device runs the kernels
in gpu/tests/test_cuda_load.py.
"""

import re
import zlib
from importlib import resources

import numpy as np
import pytest

from entropykit.container.cuda import _crc

POLY = 0xEDB88320


def _source() -> str:
    return resources.files("entropykit.container.cuda").joinpath("_crc.cu").read_text()


def _x2n() -> list[int]:
    body = re.search(r"X2N\[32\] = \{(.*?)\};", _source(), re.S).group(1)
    return [int(v.strip().rstrip("u"), 16) for v in body.split(",")]


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _shift(r: int, n: int, x2n: list[int]) -> int:
    k = 3
    while n:
        if n & 1:
            r = _multmodp(x2n[k & 31], r)
        n >>= 1
        k += 1
    return r


def _table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(POLY), t >> 1).astype(np.uint32)
    return t


def _raw_registers(staged: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Each piece's register from 0 (the kernel's byte step, all pieces at once)."""
    t = _table()
    r = np.zeros(len(starts), np.uint32)
    for j in range(int(lens.max(initial=0))):
        live = j < lens
        b = staged[np.where(live, starts + j, 0)].astype(np.uint32)
        step = t[(r ^ b) & 0xFF] ^ (r >> 8)
        r = np.where(live, step, r)
    return r


def emulate_crc(rows: np.ndarray, staged: np.ndarray, piece: int = _crc.PIECE,
                fast: bool = False) -> np.ndarray:
    """The status the two kernels leave for ``rows`` (int64[k, 4]) over ``staged``;
    ``fast``: each piece's register by zlib (the same value) instead of the byte step."""
    x2n = _x2n()
    lens = rows[:, 1]
    counts = -(-lens // piece)
    row_of = np.repeat(np.arange(len(rows)), counts)
    at = (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)) * piece
    n = np.minimum(piece, lens[row_of] - at)
    starts = rows[row_of, 0] + at
    if fast:
        regs = [zlib.crc32(staged[a : a + k].tobytes(), 0xFFFFFFFF) ^ 0xFFFFFFFF
                for a, k in zip(starts.tolist(), n.tolist(), strict=True)]
    else:
        regs = _raw_registers(staged, starts, n).tolist()
    acc = [0] * len(rows)
    for row, r, a, k in zip(row_of.tolist(), regs, at.tolist(), n.tolist(), strict=True):
        acc[row] ^= _shift(int(r), int(lens[row]) - a - k, x2n)  # atomicXor
    status = np.zeros(len(rows), np.int32)
    for i, (_, length, seed, want) in enumerate(rows.tolist()):
        crc = ~(acc[i] ^ _shift(~seed & 0xFFFFFFFF, length, x2n)) & 0xFFFFFFFF
        status[i] = crc != (want & 0xFFFFFFFF)
    return status


def test_x2n_is_x_to_the_power_of_two_to_the_k():
    x2n, p = _x2n(), 1 << 30  # x^1 in reflected order
    for k in range(32):
        assert x2n[k] == p, k
        p = _multmodp(p, p)


@pytest.mark.parametrize("piece", [16, 64, 4096])
def test_emulated_kernels_are_zlib_per_row(piece):
    rng = np.random.default_rng(4)
    staged = rng.integers(0, 256, 9_000, dtype=np.uint8)
    rows = []
    for a, n in [(0, 0), (3, 1), (5, 15), (7, 16), (1, 17), (100, 1000), (13, 4097),
                 (0, 9_000), (8_999, 1)]:
        seed = int(rng.integers(0, 1 << 32))
        want = zlib.crc32(staged[a : a + n].tobytes(), seed)
        rows += [(a, n, seed, want), (a, n, seed, want ^ (1 << int(rng.integers(32))))]
    rows = np.array(rows, np.int64)
    assert emulate_crc(rows, staged, piece).tolist() == [0, 1] * (len(rows) // 2)
    assert emulate_crc(rows, staged, piece, fast=True).tolist() == [0, 1] * (len(rows) // 2)


def test_first_pieces_and_the_piece_the_loads_assume():
    assert _crc.PIECE % 16 == 0  # the kernel's aligned 16-byte loads stay in one piece
    lens = np.array([0, 1, _crc.PIECE, _crc.PIECE + 1, 5 * _crc.PIECE])
    assert _crc.first_pieces(lens).tolist() == [0, 0, 1, 2, 4, 9]
