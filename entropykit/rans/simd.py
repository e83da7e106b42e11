"""Whole 32-lane rANS steps as LLVM vector code (Numba intrinsics), decode and encode.

What it is: the fast paths of ``kernels.decode_chunk`` and ``kernels.encode_chunk``. Decode:
for all 32 lanes at once, gather the packed table entries, write the 32 symbols, advance
the states, and renormalize with one *expand-load*: lanes whose state fell below 2**16
take the next words of the stream in lane order, exactly the order the format prescribes
(``kernels`` docstring). Encode mirrors it with a *compress-store* of the emitted words.
On AVX-512 VBMI2 these are ``vpexpandw`` / ``vpcompressw``; elsewhere LLVM lowers the same
intrinsics to scalar code, so results are identical on every machine. An x86 target with
AVX2 but without that expand (``NUMBA_CPU_FEATURES`` / the host's, chosen as a kernel
compiles) decodes in groups of 8 lanes instead, with a branchless refill of the same
lane order (``_decode_step_avx2``).
What it is not: bounds checking. The callers guarantee 32 symbols at ``base``, table
indices in range (``cmap`` of 256 entries, each a table), and 64 bytes of stream room at
``ptr`` / below ``pos``.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I1, _I8, _I16, _I32, _I64 = (ir.IntType(b) for b in (1, 8, 16, 32, 64))
_W = 32  # lanes


def _vec(t: ir.Type) -> ir.VectorType:
    return ir.VectorType(t, _W)


def _splat_const(t: ir.Type, v: int) -> ir.Constant:
    return ir.Constant(_vec(t), [v] * _W)


def _splat(builder: ir.IRBuilder, value: ir.Value, t: ir.Type) -> ir.Value:
    one = builder.insert_element(ir.Constant(_vec(t), None), value, ir.Constant(_I32, 0))
    zeros = ir.Constant(_vec(_I32), [0] * _W)
    return builder.shuffle_vector(one, ir.Constant(_vec(t), None), zeros)


def _gather(builder: ir.IRBuilder, addr: ir.Value) -> ir.Value:
    """Load the i64 at each of 32 byte addresses."""
    ptrs = builder.inttoptr(addr, ir.VectorType(_I64.as_pointer(), _W))
    fn = _declare(builder.module, "llvm.masked.gather.v32i64.v32p0i64", _vec(_I64),
                  [ptrs.type, _I32, _vec(_I1), _vec(_I64)])
    return builder.call(fn, [ptrs, ir.Constant(_I32, 8), _splat_const(_I1, 1),
                             ir.Constant(_vec(_I64), None)])


def _declare(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args), name)


def _avx2_only(context) -> bool:  # noqa: ANN001 (Numba's target context)
    """Whether the code is compiled for x86 with AVX2 but without AVX-512 VBMI2's expand.

    The features are those of the target machine Numba compiles for (``NUMBA_CPU_FEATURES``
    when set), which are part of its cache key, so a cached kernel always matches them.
    """
    features = getattr(context.codegen(), "_tm_features", "").split(",")
    return "+avx2" in features and "+avx512vbmi2" not in features


_G = 8  # lanes of one AVX2 group: 8 x i32 in a ymm register


def _prefix_lut(module: ir.Module) -> ir.Value:
    """[256 x i32]: for an 8-bit mask m, nibble i is popcount(m & (2**i - 1)), the word of
    the lane-ordered refill that lane i takes when its bit is set."""
    lut = module.globals.get("entropykit_rans_refill_lut")
    if lut is None:
        values = [sum(bin(m & ((1 << i) - 1)).count("1") << (4 * i) for i in range(_G))
                  for m in range(256)]
        ty = ir.ArrayType(_I32, 256)
        lut = ir.GlobalVariable(module, ty, "entropykit_rans_refill_lut")
        lut.initializer = ir.Constant(ty, values)
        lut.global_constant = True
        lut.linkage = "internal"
    return lut


def _lanes(builder: ir.IRBuilder, row0: ir.Value, idx: ir.Value, ty: ir.Type = _I64
           ) -> ir.Value:
    """<8 x ty>: ``row0[idx[i]]`` for each lane i, as eight scalar loads.

    Scalar loads rather than ``vpgatherdd``: AVX2 CPUs issue two or more loads a cycle,
    while their gathers are long micro-op sequences; here the gathers were never faster
    (bench/RESULTS.md).
    """
    v = ir.Constant(ir.VectorType(ty, _G), None)
    for i in range(_G):
        lane = ir.Constant(_I32, i)
        at = builder.gep(row0, [builder.zext(builder.extract_element(idx, lane), _I64)])
        v = builder.insert_element(v, builder.load(at, align=ty.width // 8), lane)
    return v


def _decode_step_avx2(builder, x, table, prec, ctx, cmap, base, out, buf, ptr,  # noqa: ANN001
                      byte_map=False):
    """``decode_step`` as four groups of 8 lanes in AVX2 instructions.

    The refill emulates the expand-load without a branch: each group loads the next 8
    words, and ``vpermd`` moves word popcount(need & (2**i - 1)) to lane i (indices from
    a 256-entry table of nibbles), so the lanes that need a word take them in lane order.
    A group reads 16 bytes at its position, at most 48 bytes past ``ptr``: inside the 64
    bytes the caller guarantees.
    """
    mod = builder.module
    v8 = ir.VectorType(_I32, _G)

    def splat8(value):
        return ir.Constant(v8, [value] * _G)

    permd = _declare(mod, "llvm.x86.avx2.permd", v8, [v8, v8])
    popcnt = _declare(mod, "llvm.ctpop.i32", _I32, [_I32])
    zeros = ir.Constant(v8, [0] * _G)
    p = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, None),
                                                      builder.trunc(prec, _I32),
                                                      ir.Constant(_I32, 0)),
                               ir.Constant(v8, None), zeros)
    mask = builder.sub(builder.shl(splat8(1), p), splat8(1))
    row0 = builder.bitcast(table, _I64.as_pointer())
    lut = _prefix_lut(mod)
    shifts = ir.Constant(v8, [4 * i for i in range(_G)])
    states = builder.bitcast(x, v8.as_pointer())
    for g in range(_G // 2):
        at = builder.add(base, ir.Constant(_I64, g * _G))
        state_ptr = builder.gep(states, [ir.Constant(_I64, g)])
        xs = builder.load(state_ptr, align=4)
        slot = builder.and_(xs, mask)
        if ctx is not None:  # row k = cmap[ctx] of the table: slot += k << precision
            c_ptr = builder.bitcast(builder.gep(ctx, [at]), ir.VectorType(_I8, _G).as_pointer())
            k = builder.zext(builder.load(c_ptr, align=1), v8)
            if cmap is not None and byte_map:  # (compiled, not run: see decode_step)
                k = builder.zext(_lanes(builder, builder.bitcast(cmap, _I8.as_pointer()), k,
                                        _I8), v8)
            elif cmap is not None:
                k = builder.trunc(_lanes(builder, builder.bitcast(cmap, _I64.as_pointer()), k),
                                  v8)
            slot = builder.add(slot, builder.shl(k, p))
        # entry = bias | freq << 16 | sym << 32
        e = _lanes(builder, row0, slot)
        lo = builder.trunc(e, v8)
        sym = builder.trunc(builder.lshr(e, ir.Constant(e.type, [32] * _G)),
                            ir.VectorType(_I8, _G))
        o_ptr = builder.bitcast(builder.gep(out, [at]), ir.VectorType(_I8, _G).as_pointer())
        builder.store(sym, o_ptr, align=1)
        xs = builder.add(builder.mul(builder.lshr(lo, splat8(16)), builder.lshr(xs, p)),
                         builder.and_(lo, splat8(0xFFFF)))
        need = builder.icmp_unsigned("<", xs, splat8(1 << 16))
        bits = builder.zext(builder.bitcast(need, _I8), _I32)
        w_ptr = builder.bitcast(builder.gep(buf, [ptr]), ir.VectorType(_I16, _G).as_pointer())
        words = builder.zext(builder.load(w_ptr, align=1), v8)
        nib = builder.load(builder.gep(lut, [ir.Constant(_I32, 0), bits]), align=4)
        nib = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, None), nib,
                                                            ir.Constant(_I32, 0)),
                                     ir.Constant(v8, None), zeros)
        # vpermd reads the low 3 bits of each index: no mask after the shift.
        words = builder.call(permd, [words, builder.lshr(nib, shifts)])
        refilled = builder.or_(builder.shl(xs, splat8(16)), words)
        builder.store(builder.select(need, refilled, xs), state_ptr, align=4)
        taken = builder.zext(builder.call(popcnt, [bits]), _I64)
        ptr = builder.add(ptr, builder.shl(taken, ir.Constant(_I64, 1)))
    return ptr


def _byte_lut(context) -> bool:  # noqa: ANN001 (Numba's target context)
    """Whether ``decode_step`` takes a uint8 context map as a 256-byte table looked up by
    byte permutes (AVX-512 VBMI), where its AVX-512 step is the one compiled."""
    features = getattr(context.codegen(), "_tm_features", "").split(",")
    return "+avx512vbmi" in features and not _avx2_only(context)


@intrinsic
def byte_lut(typingctx):
    """Whether a uint8 context map makes ``decode_step`` faster on this target (a
    compile-time constant): where it does not, callers pass the int64 map."""
    sig = types.boolean()

    def codegen(context, builder, signature, args):
        return ir.Constant(ir.IntType(1), int(_byte_lut(context)))

    return sig, codegen


def _lut_lookup(builder: ir.IRBuilder, lut: ir.Value, k: ir.Value) -> ir.Value:
    """<32 x i8>: ``lut[k[i]]`` for the 32 context bytes ``k``, ``lut`` 256 bytes: two
    ``vpermi2b`` over its halves' 128 bytes each, chosen by each index's top bit."""
    v64 = ir.VectorType(_I8, 64)
    rows = builder.bitcast(lut, v64.as_pointer())
    t = [builder.load(builder.gep(rows, [ir.Constant(_I32, i)]), align=1) for i in range(4)]
    idx = builder.shuffle_vector(k, ir.Constant(_vec(_I8), None),
                                 ir.Constant(ir.VectorType(_I32, 64), list(range(_W)) * 2))
    perm = _declare(builder.module, "llvm.x86.avx512.vpermi2var.qi.512", v64, [v64, v64, v64])
    low, high = builder.call(perm, [t[0], idx, t[1]]), builder.call(perm, [t[2], idx, t[3]])
    r = builder.select(builder.icmp_signed("<", idx, ir.Constant(v64, [0] * 64)), high, low)
    return builder.shuffle_vector(r, ir.Constant(v64, None),
                                  ir.Constant(ir.VectorType(_I32, _W), list(range(_W))))


@intrinsic
def decode_step(typingctx, x, table, precision, ctx, cmap, base, out, buf, ptr):
    """Decode lanes 0..31 of one step; return the stream position after its words.

    With a context, symbol i uses table ``cmap[ctx[i]]`` (``cmap`` int64[256], each value
    < the number of tables): the table index of each lane is gathered from ``cmap``, so no
    separate pass maps the context to table indices; a uint8 ``cmap`` (where ``byte_lut()``)
    is looked up by byte permutes instead of a gather. With ``cmap`` None the context
    values are the table indices themselves (a caller that makes the contexts maps them
    as it goes: no gather).
    """
    sig = types.intp(x, table, precision, ctx, cmap, base, out, buf, ptr)
    conditional = not isinstance(ctx, types.NoneType)
    direct = isinstance(cmap, types.NoneType)
    byte_map = not direct and cmap.dtype == types.uint8

    def codegen(context, builder, signature, args):
        x_v, table_v, prec_v, ctx_v, cmap_v, base_v, out_v, buf_v, ptr_v = args

        def data(k, v):
            return context.make_array(signature.args[k])(context, builder, v).data

        if _avx2_only(context):
            return _decode_step_avx2(builder, data(0, x_v), data(1, table_v), prec_v,
                                     data(3, ctx_v) if conditional else None,
                                     None if direct else data(4, cmap_v), base_v,
                                     data(6, out_v), data(7, buf_v), ptr_v, byte_map)
        mod = builder.module
        state_ptr = builder.bitcast(data(0, x_v), _vec(_I32).as_pointer())
        xs = builder.load(state_ptr, align=4)
        p = _splat(builder, builder.trunc(prec_v, _I32), _I32)
        mask = builder.sub(builder.shl(_splat_const(_I32, 1), p), _splat_const(_I32, 1))
        slot = builder.zext(builder.and_(xs, mask), _vec(_I64))
        if conditional:  # row k = cmap[ctx] of the table: slot += k << precision
            c_ptr = builder.bitcast(builder.gep(data(3, ctx_v), [base_v]), _vec(_I8).as_pointer())
            c = builder.load(c_ptr, align=1)
            k = builder.zext(c, _vec(_I64))
            if byte_map and _byte_lut(context):
                k = builder.zext(_lut_lookup(builder, data(4, cmap_v), c), _vec(_I64))
            elif byte_map:  # lanes' bytes (compiled, not run: callers check byte_lut())
                cmap0 = _splat(builder, builder.ptrtoint(data(4, cmap_v), _I64), _I64)
                ptrs = builder.inttoptr(builder.add(cmap0, k), ir.VectorType(_I8.as_pointer(), _W))
                fn = _declare(mod, "llvm.masked.gather.v32i8.v32p0i8", _vec(_I8),
                              [ptrs.type, _I32, _vec(_I1), _vec(_I8)])
                k = builder.zext(builder.call(fn, [ptrs, ir.Constant(_I32, 1), _splat_const(_I1, 1),
                                                   ir.Constant(_vec(_I8), None)]), _vec(_I64))
            elif not direct:
                cmap0 = _splat(builder, builder.ptrtoint(data(4, cmap_v), _I64), _I64)
                k = _gather(builder, builder.add(cmap0, builder.shl(k, _splat_const(_I64, 3))))
            slot = builder.add(slot, builder.shl(k, builder.zext(p, _vec(_I64))))
        row0 = _splat(builder, builder.ptrtoint(data(1, table_v), _I64), _I64)
        e = _gather(builder, builder.add(row0, builder.shl(slot, _splat_const(_I64, 3))))
        # entry = bias | freq << 16 | sym << 32
        sym = builder.trunc(builder.lshr(e, _splat_const(_I64, 32)), _vec(_I8))
        out_ptr = builder.bitcast(builder.gep(data(6, out_v), [base_v]), _vec(_I8).as_pointer())
        builder.store(sym, out_ptr, align=1)
        lo16 = _splat_const(_I64, 0xFFFF)
        freq = builder.lshr(e, _splat_const(_I64, 16))
        freq = builder.trunc(builder.and_(freq, lo16), _vec(_I32))
        bias = builder.trunc(builder.and_(e, lo16), _vec(_I32))
        xs = builder.add(builder.mul(freq, builder.lshr(xs, p)), bias)
        # Renormalize: x < 2**16 takes the next word; the words are consecutive in lane order.
        need = builder.icmp_unsigned("<", xs, _splat_const(_I32, 1 << 16))
        src = builder.bitcast(builder.gep(data(7, buf_v), [ptr_v]), _I16.as_pointer())
        expand = _declare(mod, "llvm.masked.expandload.v32i16", _vec(_I16),
                          [_I16.as_pointer(), _vec(_I1), _vec(_I16)])
        words = builder.call(expand, [src, need, _splat_const(_I16, 0)])
        refilled = builder.or_(builder.shl(xs, _splat_const(_I32, 16)),
                               builder.zext(words, _vec(_I32)))
        builder.store(builder.select(need, refilled, xs), state_ptr, align=4)
        popcnt = _declare(mod, "llvm.ctpop.i32", _I32, [_I32])
        taken = builder.zext(builder.call(popcnt, [builder.bitcast(need, _I32)]), _I64)
        return builder.add(ptr_v, builder.shl(taken, ir.Constant(_I64, 1)))

    return sig, codegen


@intrinsic
def encode_step(typingctx, x, tab, precision, ctx, cmap, base, sym, out, pos):
    """Encode symbols base..base+31 (all lanes of one step); return the new write position.

    ``tab`` is uint64[n_tables, 256, 2]: rcp | (xmax - 1) << 32, freq | start << 16 |
    shift << 32. With a context, symbol i uses table ``cmap[ctx[i]]`` (gathered, as in
    ``decode_step``). Emitted words are stored just below ``pos`` in lane order.
    """
    sig = types.intp(x, tab, precision, ctx, cmap, base, sym, out, pos)
    conditional = not isinstance(ctx, types.NoneType)

    def codegen(context, builder, signature, args):
        x_v, tab_v, prec_v, ctx_v, cmap_v, base_v, sym_v, out_v, pos_v = args

        def data(k, v):
            return context.make_array(signature.args[k])(context, builder, v).data

        def load8(k, v):
            ptr = builder.bitcast(builder.gep(data(k, v), [base_v]), _vec(_I8).as_pointer())
            return builder.zext(builder.load(ptr, align=1), _vec(_I64))

        mod = builder.module
        idx = load8(6, sym_v)
        if conditional:  # record of table k = cmap[ctx]: idx += k << 8
            cmap0 = _splat(builder, builder.ptrtoint(data(4, cmap_v), _I64), _I64)
            k = _gather(builder, builder.add(cmap0, builder.shl(load8(3, ctx_v),
                                                               _splat_const(_I64, 3))))
            idx = builder.add(idx, builder.shl(k, _splat_const(_I64, 8)))
        rec = builder.add(_splat(builder, builder.ptrtoint(data(1, tab_v), _I64), _I64),
                          builder.shl(idx, _splat_const(_I64, 4)))
        r0 = _gather(builder, rec)
        r1 = _gather(builder, builder.add(rec, _splat_const(_I64, 8)))
        lo32 = _splat_const(_I64, 0xFFFFFFFF)
        lo16 = _splat_const(_I64, 0xFFFF)
        rcp = builder.and_(r0, lo32)
        xmax_m1 = builder.lshr(r0, _splat_const(_I64, 32))
        freq = builder.and_(r1, lo16)
        start = builder.and_(builder.lshr(r1, _splat_const(_I64, 16)), lo16)
        shift = builder.lshr(r1, _splat_const(_I64, 32))
        state_ptr = builder.bitcast(data(0, x_v), _vec(_I32).as_pointer())
        xs = builder.zext(builder.load(state_ptr, align=4), _vec(_I64))
        # Renormalize: x >= xmax emits its low word; the words go below pos in lane order.
        need = builder.icmp_unsigned(">", xs, xmax_m1)
        popcnt = _declare(mod, "llvm.ctpop.i32", _I32, [_I32])
        taken = builder.zext(builder.call(popcnt, [builder.bitcast(need, _I32)]), _I64)
        new_pos = builder.sub(pos_v, builder.shl(taken, ir.Constant(_I64, 1)))
        dst = builder.bitcast(builder.gep(data(7, out_v), [new_pos]), _I16.as_pointer())
        compress = _declare(mod, "llvm.masked.compressstore.v32i16", ir.VoidType(),
                            [_vec(_I16), _I16.as_pointer(), _vec(_I1)])
        builder.call(compress, [builder.trunc(xs, _vec(_I16)), dst, need])
        xs = builder.select(need, builder.lshr(xs, _splat_const(_I64, 16)), xs)
        # x = (x // f) << p | x % f + start, x // f through the reciprocal (kernels docstring)
        q = builder.lshr(builder.mul(xs, rcp), _splat_const(_I64, 32))
        q = builder.lshr(builder.add(xs, q), shift)
        p = _splat(builder, prec_v, _I64)
        xs = builder.add(builder.add(builder.shl(q, p), builder.sub(xs, builder.mul(q, freq))),
                         start)
        builder.store(builder.trunc(xs, _vec(_I32)), state_ptr, align=4)
        return new_pos

    return sig, codegen
