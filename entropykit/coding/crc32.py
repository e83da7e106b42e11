"""CRC-32 (zlib's: reflected polynomial 0xEDB88320, pre- and post-inverted), faster.

What it is: ``crc32(data, value=0)``, equal to ``zlib.crc32(data, value)`` for every input,
computed by carry-less multiplication (x86 PCLMULQDQ, through an LLVM intrinsic) where the
CPU has it, and by zlib otherwise; and ``check_chunks``, the check of a run of chunks
against their CRCs in one call. The frame checks a CRC-32 of every decoded chunk, so the
checksum runs over every byte a file decodes to and its speed is part of decoding's.
What it is not: another checksum; the values are zlib's, bit for bit.

Method (Intel, "Fast CRC Computation for Generic Polynomials Using PCLMULQDQ", 2009, as in
Linux's crc32-pclmul_asm.S): the message is folded 64 bytes at a time into four 128-bit
accumulators (x <- x.lo * k1 xor x.hi * k2 xor next 16 bytes, carry-less, where k1, k2 are
x^(512 +- 32) mod P reflected), the four are folded into one (constants for 128 bits), then
reduced 128 -> 64 -> 32 bits and by a Barrett reduction to the raw CRC state. The head up
to 8-byte alignment (so the body is read as aligned u64 words) and the tail under 16 bytes
go through the byte-at-a-time table update; inputs under ``_SMALL`` bytes go to zlib.
"""

from __future__ import annotations

import functools
import platform
import zlib

import numpy as np
from llvmlite import binding, ir
from numba import config, njit, types
from numba.extending import intrinsic

_V2 = ir.VectorType(ir.IntType(64), 2)
_MIN_BODY = 64  # bytes: one 64-byte block fills the four accumulators


@intrinsic
def _clmul(typingctx, a, b):
    """(low, high) u64 halves of the 128-bit carry-less product of two u64."""
    sig = types.UniTuple(types.uint64, 2)(types.uint64, types.uint64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        va = builder.insert_element(ir.Constant(_V2, None), args[0], ir.Constant(i32, 0))
        vb = builder.insert_element(ir.Constant(_V2, None), args[1], ir.Constant(i32, 0))
        mod = builder.module
        fn = mod.globals.get("llvm.x86.pclmulqdq") or ir.Function(
            mod, ir.FunctionType(_V2, [_V2, _V2, ir.IntType(8)]), "llvm.x86.pclmulqdq")
        r = builder.call(fn, [va, vb, ir.Constant(ir.IntType(8), 0)])
        lo = builder.extract_element(r, ir.Constant(i32, 0))
        hi = builder.extract_element(r, ir.Constant(i32, 1))
        return context.make_tuple(builder, signature.return_type, [lo, hi])

    return sig, codegen


# Folding constants (x^k mod P, bit-reflected, shifted left by one) and the Barrett pair.
_K1, _K2 = np.uint64(0x154442BD4), np.uint64(0x1C6E41596)  # fold 512 bits
_K3, _K4 = np.uint64(0x1751997D0), np.uint64(0x0CCAA009E)  # fold 128 bits
_K5 = np.uint64(0x163CD6124)  # 64 -> 32 bits
_MU, _POLY = np.uint64(0x1F7011641), np.uint64(0x1DB710641)
_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)


_I8, _I32, _I64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
_V4 = ir.VectorType(_I64, 4)


def _wide(context) -> bool:  # noqa: ANN001 (Numba's target context)
    """Whether the target Numba compiles for has VPCLMULQDQ (two 128-bit products in one
    256-bit instruction); its features are part of the cache key, as in ``rans.simd``."""
    return "+vpclmulqdq" in getattr(context.codegen(), "_tm_features", "").split(",")


@intrinsic
def _fold_blocks(typingctx, w, state):
    """(low, high) u64 halves of a 128-bit value with the same CRC remainder as ``w`` (u64
    words, an even count >= 8) with ``state`` xored into its first word: four 128-bit accumulators
    folded over every 64-byte block, then into one, then over the 16-byte units left.

    In LLVM vector code, so the accumulators stay in registers and each fold is two
    carry-less multiplications of a register (no moves through general registers); with
    VPCLMULQDQ two accumulators share a 256-bit register, halving the multiplications.
    """
    sig = types.UniTuple(types.uint64, 2)(w, state)

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        units = builder.lshr(builder.extract_value(arr.shape, 0), ir.Constant(_I64, 1))
        mod = builder.module

        def clmul(vt: ir.VectorType, name: str):
            return mod.globals.get(name) or ir.Function(
                mod, ir.FunctionType(vt, [vt, vt, _I8]), name)

        def at(vt: ir.VectorType, i: ir.Value) -> ir.Value:  # the i-th vt of w
            return builder.load(builder.gep(builder.bitcast(arr.data, vt.as_pointer()), [i]),
                                align=8)

        def fold(fn, x, k):  # x.lo * k.lo xor x.hi * k.hi, per 128-bit lane
            return builder.xor(builder.call(fn, [x, k, ir.Constant(_I8, 0x00)]),
                               builder.call(fn, [x, k, ir.Constant(_I8, 0x11)]))

        def const(vt: ir.VectorType, a, b) -> ir.Constant:
            return ir.Constant(vt, [int(a), int(b)] * (vt.count // 2))

        def loop(start, values, more, step):
            # for (i = start; more(i); ) values = step(i, values): phis, blocks; returns
            # (i, values) after the loop.
            pre = builder.block
            head = builder.append_basic_block("fold.head")
            body = builder.append_basic_block("fold.body")
            after = builder.append_basic_block("fold.after")
            builder.branch(head)
            builder.position_at_end(head)
            i = builder.phi(_I64)
            i.add_incoming(start, pre)
            phis = []
            for v in values:
                ph = builder.phi(v.type)
                ph.add_incoming(v, pre)
                phis.append(ph)
            builder.cbranch(more(i), body, after)
            builder.position_at_end(body)
            ni, nv = step(i, phis)
            for ph, v in zip(phis, nv, strict=True):
                ph.add_incoming(v, builder.block)
            i.add_incoming(ni, builder.block)
            builder.branch(head)
            builder.position_at_end(after)
            return i, phis

        four = ir.Constant(_I64, 4)
        blocks_left = lambda i: builder.icmp_unsigned("<=", builder.add(i, four), units)  # noqa: E731
        if _wide(context):
            fn = clmul(_V4, "llvm.x86.pclmulqdq.256")
            k = const(_V4, _K1, _K2)
            first = builder.insert_element(ir.Constant(_V4, [0] * 4), args[1],
                                           ir.Constant(_I32, 0))

            def step(i, x):
                h = builder.lshr(i, ir.Constant(_I64, 1))  # in 32-byte units
                return builder.add(i, four), [
                    builder.xor(fold(fn, x[0], k), at(_V4, h)),
                    builder.xor(fold(fn, x[1], k), at(_V4, builder.add(h, ir.Constant(_I64, 1))))]

            i, (a, b) = loop(four, [builder.xor(at(_V4, ir.Constant(_I64, 0)), first),
                                    at(_V4, ir.Constant(_I64, 1))], blocks_left, step)
            x = [builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 2), [h, h + 1]))
                 for v in (a, b) for h in (0, 2)]
        else:
            fn = clmul(_V2, "llvm.x86.pclmulqdq")
            k = const(_V2, _K1, _K2)
            first = builder.insert_element(ir.Constant(_V2, [0, 0]), args[1],
                                           ir.Constant(_I32, 0))

            def step(i, x):
                return builder.add(i, four), [
                    builder.xor(fold(fn, x[j], k), at(_V2, builder.add(i, ir.Constant(_I64, j))))
                    for j in range(4)]

            i, x = loop(four, [builder.xor(at(_V2, ir.Constant(_I64, 0)), first)]
                        + [at(_V2, ir.Constant(_I64, j)) for j in (1, 2, 3)], blocks_left, step)
        fn = clmul(_V2, "llvm.x86.pclmulqdq")
        k = const(_V2, _K3, _K4)
        y = x[0]
        for v in x[1:]:
            y = builder.xor(fold(fn, y, k), v)
        _, (y,) = loop(i, [y], lambda i: builder.icmp_unsigned("<", i, units),
                       lambda i, y: (builder.add(i, ir.Constant(_I64, 1)),
                                     [builder.xor(fold(fn, y[0], k), at(_V2, i))]))
        return context.make_tuple(builder, signature.return_type, [
            builder.extract_element(y, ir.Constant(_I32, j)) for j in (0, 1)])

    return sig, codegen


@njit(nogil=True, cache=True)
def _crc_words(w, state):
    """Raw (not inverted) CRC state after ``w``: u64 words, an even count >= 8."""
    x0l, x0h = _fold_blocks(w, np.uint64(state))
    tl, th = _clmul(x0l, _K4)  # 128 -> 64 bits
    tl ^= x0h
    ul, uh = _clmul(tl & _M32, _K5)  # 64 -> 32 bits, with 32 zero bits appended
    ul ^= (tl >> _S32) | (th << _S32)
    v, _ = _clmul(ul & _M32, _MU)  # Barrett: quotient estimate, then the remainder
    r, _ = _clmul(v & _M32, _POLY)
    return ((r ^ ul) >> _S32) & _M32


def _byte_table() -> np.ndarray:
    t = np.arange(256, dtype=np.uint64)
    for _ in range(8):
        t = np.where(t & 1, (t >> np.uint64(1)) ^ np.uint64(0xEDB88320), t >> np.uint64(1))
    return t


_TABLE = _byte_table()


@njit(nogil=True, cache=True)
def _crc_bytes(a, start, end, state, table):
    # The classic byte-at-a-time update of the raw state.
    for i in range(start, end):
        state = table[(state ^ np.uint64(a[i])) & np.uint64(0xFF)] ^ (state >> np.uint64(8))
    return state


@njit(nogil=True, cache=True)
def _crc(a, value, table):
    # zlib's value is the inverted raw state. The head up to 8-byte alignment and the tail
    # under 16 bytes go byte by byte, the body through the folding kernel.
    state = ~np.uint64(value) & _M32
    n = a.size
    head = min(n, (-a.ctypes.data) % 8)
    state = _crc_bytes(a, np.int64(0), head, state, table)
    body = (n - head) // 16 * 16
    if body >= _MIN_BODY:
        state = _crc_words(a[head : head + body].view(np.uint64), state)
    else:
        body = 0
    state = _crc_bytes(a, head + body, n, state, table)
    return ~state & _M32


def _available() -> bool:
    # Only where the CPU Numba compiles for has PCLMULQDQ (this one, or the one named by
    # CPU_NAME/CPU_FEATURES, as for the portable cache); LLVM cannot lower the intrinsic
    # otherwise.
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    if config.CPU_NAME is not None or config.CPU_FEATURES is not None:
        return "+pclmul" in (config.CPU_FEATURES or "").split(",")
    return bool(binding.get_host_cpu_features().get("pclmul"))


ACCELERATED = _available()
_SMALL = 1024  # bytes: zlib is as fast below this (no call overhead)


def crc32(data: np.ndarray | bytes | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, computed faster for large inputs (module docstring).

    ``data`` is a contiguous buffer (a numpy array of any dtype counts as its bytes).
    """
    if not ACCELERATED:
        return zlib.crc32(data, value)
    a = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    if a.nbytes < _SMALL or not a.flags.c_contiguous:
        return zlib.crc32(a, value)  # small: no call overhead; strided: zlib's error
    if a.dtype != np.uint8 or a.ndim != 1:
        a = a.reshape(-1).view(np.uint8)
    if a.flags.writeable:
        # Numba compiles read-only and writable arrays apart: one of them, one compile.
        a = a.view()
        a.flags.writeable = False
    return int(_crc(a, value & 0xFFFFFFFF, _TABLE))


@njit(nogil=True, cache=True)
def _crc_ranges(buf, starts, lengths, values, table, out):
    for j in range(starts.size):
        out[j] = _crc(buf[starts[j] : starts[j] + lengths[j]], values[j], table)


def crc32_ranges(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 values: np.ndarray) -> np.ndarray:
    """``crc32(buf[s : s + n], v)`` of every range (``starts``, ``lengths``, seeds
    ``values``), uint32, in one call: many small ranges cost no Python per range. The
    ranges must lie inside ``buf`` (uint8, 1-D; the caller checked them)."""
    starts = np.asarray(starts, np.int64)
    lengths = np.asarray(lengths, np.int64)
    values = np.asarray(values, np.uint32)
    if not ACCELERATED:
        return np.array([zlib.crc32(buf[s : s + n], v) for s, n, v in
                         zip(starts.tolist(), lengths.tolist(), values.tolist(), strict=True)],
                        np.uint32)
    a = buf.view()
    a.flags.writeable = False  # one compile of _crc (see crc32): read-only, int64 seed
    out = np.empty(starts.size, np.uint64)
    _crc_ranges(a, starts, lengths, values.astype(np.int64), _TABLE, out)
    return out.astype(np.uint32)


@njit(nogil=True, cache=True)
def _check_chunks(a, size, crcs, codes, fail, table):
    # One call for a group of chunks: the per-chunk Python of ``crc32`` held the GIL.
    for j in range(codes.size):
        if codes[j] == 0:
            lo = j * size
            if _crc(a[lo : min(a.size, lo + size)], np.int64(0), table) != crcs[j]:
                codes[j] = fail
        if codes[j] != 0:
            return j
    return -1


def check_chunks(data: np.ndarray, size: int, crcs: np.ndarray, codes: np.ndarray,
                 fail: int) -> int:
    """Check consecutive ``size``-byte chunks of ``data`` (1-D contiguous uint8; the last
    chunk may be shorter) against ``crcs`` (uint32, one per chunk): in chunk order, a
    chunk whose ``codes`` entry (int64) is 0 gets ``fail`` there where its CRC-32
    differs; returns the first chunk whose code is then not 0, or -1. Chunks after that
    one are not checked."""
    if ACCELERATED:
        a = data.view()
        a.flags.writeable = False  # one compile of _crc (see crc32)
        return int(_check_chunks(a, size, crcs, codes, fail, _TABLE))
    for j in range(codes.size):
        if codes[j] == 0 and zlib.crc32(data[j * size : (j + 1) * size]) != crcs[j]:
            codes[j] = fail
        if codes[j] != 0:
            return j
    return -1


# crc32_combine: zlib's method (multiplication modulo the polynomial, reflected), so that
# the CRC of a concatenation is had from its parts' CRCs without reading the bytes again.
_REFLECTED = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """a x b modulo the CRC polynomial (bit-reflected, as zlib's ``multmodp``); a != 0."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _REFLECTED if b & 1 else b >> 1


def _powers() -> list[int]:
    out = [1 << 30]  # x^1
    for _ in range(31):
        out.append(_multmodp(out[-1], out[-1]))  # x^(2^k)
    return out


_X2N = _powers()


@functools.lru_cache(maxsize=64)
def _shift(n: int) -> tuple[int, ...]:
    """Appending ``n`` zero bytes to a CRC state, as the images of its 32 bits: x^(8n)
    times each power of x modulo the polynomial (cached: a writer's field lengths
    repeat, and then a combine is a few XORs)."""
    p, k = 1 << 31, 3  # x^0; x^(8n) is x^(2^3) to the power n
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    out = []
    for _ in range(32):  # p x^i for i = 0..31, bit 31 - i of a state
        out.append(p)
        p = (p >> 1) ^ _REFLECTED if p & 1 else p >> 1
    return tuple(out)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len(B)``
    (zlib's ``crc32_combine``): no byte read again."""
    images = _shift(len2)
    out, a = crc2 & 0xFFFFFFFF, crc1 & 0xFFFFFFFF
    j = 31  # bit i of a selects images[31 - i]; no call per bit (a writer does this per field)
    while a:
        if a & 1:
            out ^= images[j]
        a >>= 1
        j -= 1
    return out


_X2N_ARRAY = np.array(_X2N, np.int64)
# _multmodp itself in a kernel: on int64 (the values are under 2**32), no second copy.
_mult = njit(nogil=True, cache=True)(_multmodp)


@njit(nogil=True, cache=True)
def _combine(crc1, crc2, len2, x2n):
    """``crc32_combine`` in a kernel (``x2n``: ``_X2N_ARRAY``): the CRC of ``A + B``."""
    p, k, n = np.int64(1) << 31, 3, len2
    while n:
        if n & 1:
            p = _mult(x2n[k & 31], p)
        n >>= 1
        k += 1
    return _mult(p, np.int64(crc1)) ^ np.int64(crc2)
