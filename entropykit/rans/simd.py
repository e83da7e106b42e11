"""One whole 32-lane rANS decode step as LLVM vector code (a Numba intrinsic).

What it is: the fast path of ``kernels.decode_chunk``: for all 32 lanes at once, gather the
packed table entries, write the 32 symbols, advance the states, and renormalize with one
*expand-load*: lanes whose state fell below 2**16 take the next words of the stream in lane
order, exactly the order the format prescribes (``kernels`` docstring). On AVX-512 VBMI2
that is one ``vpexpandw``; elsewhere LLVM lowers the same intrinsics to scalar code, so the
result is identical on every machine. What it is not: bounds checking. The caller
guarantees 32 symbols of output, ``table`` rows of ``2**precision`` entries, table indices
below the row count, and at least 64 readable bytes at ``ptr``.
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


def _declare(module: ir.Module, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(ret, args), name)


@intrinsic
def decode_step(typingctx, x, table, precision, tidx, base, out, buf, ptr):
    """Decode lanes 0..31 of one step; return the stream position after its words."""
    sig = types.intp(x, table, precision, tidx, base, out, buf, ptr)
    conditional = not isinstance(tidx, types.NoneType)

    def codegen(context, builder, signature, args):
        x_v, table_v, prec_v, tidx_v, base_v, out_v, buf_v, ptr_v = args

        def data(k, v):
            return context.make_array(signature.args[k])(context, builder, v).data

        mod = builder.module
        state_ptr = builder.bitcast(data(0, x_v), _vec(_I32).as_pointer())
        xs = builder.load(state_ptr, align=4)
        p = _splat(builder, builder.trunc(prec_v, _I32), _I32)
        mask = builder.sub(builder.shl(_splat_const(_I32, 1), p), _splat_const(_I32, 1))
        slot = builder.zext(builder.and_(xs, mask), _vec(_I64))
        if conditional:  # row k of the table: slot += k << precision
            k_ptr = builder.bitcast(builder.gep(data(3, tidx_v), [base_v]), _vec(_I8).as_pointer())
            k = builder.zext(builder.load(k_ptr, align=1), _vec(_I64))
            slot = builder.add(slot, builder.shl(k, builder.zext(p, _vec(_I64))))
        row0 = _splat(builder, builder.ptrtoint(data(1, table_v), _I64), _I64)
        addr = builder.add(row0, builder.shl(slot, _splat_const(_I64, 3)))
        ptrs = builder.inttoptr(addr, ir.VectorType(_I64.as_pointer(), _W))
        gather = _declare(mod, "llvm.masked.gather.v32i64.v32p0i64", _vec(_I64),
                          [ptrs.type, _I32, _vec(_I1), _vec(_I64)])
        e = builder.call(gather, [ptrs, ir.Constant(_I32, 8), _splat_const(_I1, 1),
                                  ir.Constant(_vec(_I64), None)])
        # entry = bias | freq << 16 | sym << 32
        sym = builder.trunc(builder.lshr(e, _splat_const(_I64, 32)), _vec(_I8))
        out_ptr = builder.bitcast(builder.gep(data(5, out_v), [base_v]), _vec(_I8).as_pointer())
        builder.store(sym, out_ptr, align=1)
        lo16 = _splat_const(_I64, 0xFFFF)
        freq = builder.lshr(e, _splat_const(_I64, 16))
        freq = builder.trunc(builder.and_(freq, lo16), _vec(_I32))
        bias = builder.trunc(builder.and_(e, lo16), _vec(_I32))
        xs = builder.add(builder.mul(freq, builder.lshr(xs, p)), bias)
        # Renormalize: x < 2**16 takes the next word; the words are consecutive in lane order.
        need = builder.icmp_unsigned("<", xs, _splat_const(_I32, 1 << 16))
        src = builder.bitcast(builder.gep(data(6, buf_v), [ptr_v]), _I16.as_pointer())
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
