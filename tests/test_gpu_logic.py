"""The GPU decoder's logic on the CPU: host plan, kernel algorithm, errors, API contract.

The kernel is CUDA C++ (entropykit/rans/cuda/_kernel.cu) and runs only on the device machine
(gpu/tests/test_cuda_static.py checks it bit for bit there, and on corrupt frames). Here
``_emulate`` replays the kernel's algorithm in numpy from the very buffers the kernel gets
(descriptor rows, payload buffer, split tables, context maps) and returns its outputs and
status codes, so every fact the plan encodes is checked against the CPU decoder: offsets,
alignment, pairing, tables, context classes, bf16 reassembly, error codes and messages.
"""

import re
import struct
import sys
from importlib import resources

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from entropykit import CorruptDataError, gpu, rans
from entropykit.coding import frame
from entropykit.rans import kernels
from entropykit.rans.cuda import _layout as lay
from entropykit.rans.cuda import plan
from entropykit.rans.static import CODER

CHUNK = frame.MIN_CHUNK  # small chunks: several per frame at test sizes
L = 1 << 16


def _packed_table(b: plan.Batch, row: np.ndarray) -> np.ndarray:
    """The kernel's packed table set of a row (``stage`` in TABLES=1 builds): per slot
    sym | (f - 1) << 8 | (slot - start) << 20, in uint32 arithmetic as the kernel builds it;
    asserts that every field fits its bits (so unpacking gives back sym, f and start)."""
    p = int(row[lay.D_PREC])
    slot = np.arange(1 << p, dtype=np.uint32)
    c = b.sym_tables[int(row[lay.D_SYM]) + slot].astype(np.uint32)
    inf = b.info_tables[int(row[lay.D_INFO]) + c].astype(np.uint32)
    f, start = inf & np.uint32(0xFFFF), inf >> np.uint32(16)
    word = c | (f - np.uint32(1)) << np.uint32(8) | (slot - start) << np.uint32(20)
    assert np.array_equal(word & np.uint32(0xFF), c)
    assert np.array_equal((word >> np.uint32(8)) & np.uint32(0xFFF), f - np.uint32(1))
    assert np.array_equal(word >> np.uint32(20), slot - start)
    return word


def _popc(v: int) -> int:
    return bin(v).count("1")


def _word_reads(need: np.ndarray, wp: int, lanes: int, half: int, junk: int
                ) -> tuple[np.ndarray, int]:
    """The kernel's renormalisation at LANES ``lanes`` (rans_step, group_ballot): the word
    index each lane reads (needy or not) and the stream's next wp. Thread g of the pair's
    group holds lanes g + GROUP j and sits at warp lane g (+ 16 for the second group of a
    warp at LANES 2, ``half``); its state j's step votes with the group's mask, so the
    other group's bits (``junk``) are in the ballot and must be masked off."""
    group = 32 // lanes
    pos = np.arange(group) + 16 * half * (lanes == 2)
    gm = 0xFFFFFFFF if lanes == 1 else 0xFFFF << (16 * half)
    idx = np.zeros(32, np.int64)
    for j in range(lanes):
        ballot = (junk & ~gm) | sum(1 << int(p) for p in pos[need[group * j + np.arange(group)]])
        for g in range(group):
            glt = ((1 << int(pos[g])) - 1) & gm
            idx[g + group * j] = wp + _popc(ballot & glt)
        wp += _popc(ballot if lanes == 1 else ballot & gm)
    return idx, wp


def _stream(b: plan.Batch, row: np.ndarray, ctx: np.ndarray | None, packed: bool = False,
            lanes: int = 0, half: int = 0) -> tuple[np.ndarray, int]:
    """One descriptor row as the kernel decodes it: (symbols, status code); ``packed``:
    its table set is the packed one (TABLES=1, shared memory); ``lanes`` > 0: each step's
    word reads through the kernel's ballots at LANES ``lanes`` (``_word_reads``; 0: the
    reads in lane order, the format's definition)."""
    n, off, length, p = (int(row[c]) for c in (lay.D_N, lay.D_OFF, lay.D_LEN, lay.D_PREC))
    if n == 0:
        return np.zeros(0, np.uint8), 0
    if row[lay.D_MODE] == frame.MODE_RAW:
        return b.payload[off : off + n].copy(), 0
    x0 = b.payload[off : off + 128].view("<u4").astype(np.uint64)
    words = b.payload[off + 128 : off + length].view("<u2").astype(np.uint64)
    x, wp, mask = x0.copy(), 0, np.uint64((1 << p) - 1)
    table = _packed_table(b, row) if packed else None
    out = np.zeros(n, np.uint8)
    junk = np.random.default_rng(n).integers(0, 1 << 32, -(-n // 32), dtype=np.uint64)
    lane = np.arange(32)
    # A classed stream's lanes keep their symbol's column and row as the kernel does:
    # one division at the start, then 32 symbols on per step (dq rows, dr columns).
    width = int(row[lay.D_WIDTH])
    col, rw = np.divmod(int(row[lay.D_COL]) + lane, width)[::-1]
    dq, dr = divmod(32, width)
    for s in range(-(-n // 32)):
        i = s * 32 + lane
        live = i < n
        cls = np.zeros(32, np.int64)
        if row[lay.D_CMAP] >= 0:
            cls[live] = b.cmaps[int(row[lay.D_CMAP]) + ctx[i[live]].astype(np.int64)]
        if row[lay.D_GRID] >= 0:
            cls[live] = _grid_table(b, row, rw[live], col[live])
        col, rw = col + dr, rw + dq
        wrap = col >= width
        col, rw = np.where(wrap, col - width, col), rw + wrap
        slot = (x & mask).astype(np.int64)
        if table is not None:  # (f - 1) * q + q + (slot - start), in 32 bits
            e = table[slot].astype(np.uint64)
            q = x >> np.uint64(p)
            c = (e & np.uint64(0xFF)).astype(np.int64)
            y = (((e >> np.uint64(8)) & np.uint64(0xFFF)) * q + q
                 + (e >> np.uint64(20))) & np.uint64(0xFFFFFFFF)
        else:
            c = b.sym_tables[int(row[lay.D_SYM]) + (cls << p) + slot].astype(np.int64)
            inf = b.info_tables[int(row[lay.D_INFO]) + cls * 256 + c].astype(np.uint64)
            y = ((inf & np.uint64(0xFFFF)) * (x >> np.uint64(p)) + slot.astype(np.uint64)
                 - (inf >> np.uint64(16))) & np.uint64(0xFFFFFFFF)
        need = live & (y < L)
        if lanes:
            idx, wp_next = _word_reads(need, wp, lanes, half, int(junk[s]))
        else:
            idx, wp_next = wp + np.cumsum(need) - need, wp + int(need.sum())
        w = np.where(idx < words.size, words[np.minimum(idx, max(words.size - 1, 0))]
                     if words.size else 0, 0).astype(np.uint64)
        y = np.where(need, ((y << np.uint64(16)) | w) & np.uint64(0xFFFFFFFF), y)
        x = np.where(live, y, x)
        wp = wp_next
        out[i[live]] = c[live]
    code = (1 if (x0 < L).any() else 2 if wp > words.size else 3 if wp < words.size
            else 4 if (x != L).any() else 0)
    return out, code


def _grid_table(b: plan.Batch, row: np.ndarray, rw: np.ndarray, col: np.ndarray
                ) -> np.ndarray:
    """The kernel's table of classed symbols at rows ``rw`` (from the chunk's first row)
    and columns ``col``; asserts every read lies in the maps the plan laid out."""
    ctx = np.zeros(rw.size, np.int64)
    for at, where in ((int(row[lay.D_RMAP]), rw), (int(row[lay.D_KMAP]), col)):
        if at >= 0:
            assert where.size == 0 or 0 <= at + int(where.max()) < b.cmaps.size
            ctx += b.cmaps[at + where]
    g = int(row[lay.D_GRID])
    assert ctx.size == 0 or (0 <= g and g + int(ctx.max()) < b.cmaps.size)
    return b.cmaps[g + ctx].astype(np.int64)


def _emulate(b: plan.Batch, tables: int = 0, lanes: int = 0
             ) -> tuple[list[np.ndarray], np.ndarray]:
    """The kernel's outputs (poisoned where it writes nothing) and status, from ``b``."""
    outs = [np.full(n, 0xA5A5 if b.bf16 else 0xA5, np.uint16 if b.bf16 else np.uint8)
            for n in b.sizes]
    return outs, emulate_into(b, outs, tables, lanes)[1]


def emulate_into(b: plan.Batch, outs: list[np.ndarray], tables: int = 0, lanes: int = 0
                 ) -> tuple[list[np.ndarray], np.ndarray]:
    """Run ``b`` as the kernel does into ``outs`` (uint8 / uint16 arrays), its build with
    table layout ``tables`` (_runtime.TABLES) and, ``lanes`` > 0, its word reads through
    the ballots of LANES ``lanes`` (_runtime.LANES; ``_word_reads``); also checks the block
    rule the kernel's shared tables rest on."""
    status = np.zeros(len(b.desc), np.int32)
    # TABLES=1 packs the shared-memory sets (SMEM builds): a's always, b's unless b reads
    # its class tables through L1 (a context batch).
    smem = tables == 1 and b.narrow and not b.classed
    packed_a, packed_b = smem, smem and not b.context
    assert len(b.desc) % (2 * b.warps) == 0
    for blk in b.desc.reshape(-1, b.warps, 2, lay.N_COLS):
        assert (blk[:, :, [lay.D_SYM, lay.D_INFO]] == blk[0, :, [lay.D_SYM, lay.D_INFO]].T).all()
    for r in range(0, len(b.desc), 2):
        # the pair's group: threads (pair % warps) * GROUP on of its block (a block: warps
        # pairs), so at LANES 2 the pairs of a warp alternate halves
        half = ((r // 2) % b.warps * (32 // max(lanes, 1)) & 31) >> 4
        sa, status[r] = _stream(b, b.desc[r], None, packed_a, lanes, half)
        sb, status[r + 1] = _stream(b, b.desc[r + 1], sa if b.bf16 else None, packed_b,
                                    lanes, half)
        for row, k, sym in ((r, b.out_index[r], sa), (r + 1, b.out_index[r + 1], sb)):
            at, step = int(b.desc[row, lay.D_OUT]), int(b.desc[row, lay.D_STEP])
            if k < 0 or (b.bf16 and row % 2):
                continue
            if b.bf16:
                e, m = sa.astype(np.uint16), sb.astype(np.uint16)
                sym = (m >> 7) << 15 | e << 7 | (m & 0x7F)
            outs[k][at : at + (sym.size - 1) * step + 1 : step] = sym
    return outs, status


def _skewed(rng, n, k, p=0.35):
    return np.minimum(rng.geometric(p, n) - 1, k - 1).astype(np.uint8)


def _bf16_fields(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    exp = ((bits >> 7) & 0xFF).astype(np.uint8)
    sm = (((bits >> 15) << 7) | (bits & 0x7F)).astype(np.uint8)
    return exp, sm


def _special_bf16(rng, n):
    """Weight-like bf16 patterns with NaN payloads, +-0, +-inf and subnormals sprinkled in."""
    bits = ((rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32) >> 16)
    bits = bits.astype(np.uint16)
    specials = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001,
                         0x807F, 0x0080, 0x7F7F, 0xFF7F], np.uint16)
    at = rng.choice(n, size=min(n, 3 * specials.size), replace=False)
    bits[at] = np.resize(specials, at.size)
    return bits


def _context_bits(rng, n):
    """bf16 patterns whose sign+mantissa depends on the exponent, so context tables win."""
    exp = (120 + _skewed(rng, n, 6, 0.45)).astype(np.uint16)
    sm = ((exp * 37 + _skewed(rng, n, 4, 0.6)) & 0xFF).astype(np.uint16)
    return ((sm >> 7) << 15 | exp << 7 | (sm & 0x7F)).astype(np.uint16)


def test_split_table_matches_cpu_decode_table():
    rng = np.random.default_rng(3)
    for precision in (8, 12, 15):
        sym = _skewed(rng, 5000, 40)
        info = frame.parse(CODER, rans.encode(sym, precision=precision, chunk_size=CHUNK))
        syms, infos = plan.split_table(info.freqs[0], precision)
        cpu = kernels.decode_table(info.freqs[0], precision)[0]  # bias | f << 16 | sym << 32
        slot = np.arange(1 << precision)
        assert syms.dtype == np.uint8 and infos.dtype == np.uint32 and infos.size == 256
        assert np.array_equal(syms, cpu >> np.uint64(32))
        picked = infos[syms].astype(np.int64)
        assert np.array_equal(picked & 0xFFFF, (cpu >> np.uint64(16)) & np.uint64(0xFFFF))
        assert np.array_equal(slot - (picked >> 16), cpu & np.uint64(0xFFFF))


@pytest.mark.parametrize("warps", [1, 4])
def test_layout_alignment_pairing_blocks_and_padding(warps):
    rng = np.random.default_rng(1)
    arrays = [_skewed(rng, n, 9) for n in (3 * CHUNK + 5, 40, CHUNK)]
    arrays.append(rng.integers(0, 256, 700).astype(np.uint8))  # a raw chunk of 700 bytes
    arrays.append(_skewed(rng, 5 * CHUNK, 30))  # a frame, its table: their own blocks
    b = plan.prepare_u8([rans.encode(a, chunk_size=CHUNK) for a in arrays], warps)
    live = b.desc[:, lay.D_N] > 0
    assert len(b.desc) % (2 * warps) == 0 and live.sum() == 4 + 1 + 1 + 1 + 5
    assert (b.desc[live, lay.D_OFF] % plan.ALIGN == 0).all()
    ends = b.desc[live, lay.D_OFF] + b.desc[live, lay.D_LEN]
    assert b.payload.size >= ends.max() + plan.ALIGN  # spare bytes past the last payload
    pad = b.desc[~live]
    assert (pad[:, lay.D_MODE] == frame.MODE_RAW).all() and (b.out_index[~live] == -1).all()
    # u8 mode: a warp decodes two neighbouring chunks of one frame (the odd one alone).
    a, bb = b.origin[0::2], b.origin[1::2]
    both = live[0::2] & live[1::2]
    assert (a[both, 0] == bb[both, 0]).all() and (bb[both, 1] == a[both, 1] + 1).all()
    assert live[0::2].sum() == 2 + 1 + 1 + 1 + 3  # frames of 4, 1, 1, 1 and 5 chunks
    # Blocks: one table set each, ordered by their longest pair.
    steps = np.maximum(b.desc[0::2, lay.D_N], b.desc[1::2, lay.D_N]).reshape(-1, warps)
    assert (np.diff(steps[:, 0]) <= 0).all() and (np.diff(steps, axis=1) <= 0).all()
    sets = b.desc[0::2, lay.D_SYM].reshape(-1, warps)
    assert (sets == sets[:, :1]).all() and len(np.unique(sets)) == len(arrays)
    assert b.slots == 1  # both chunks of a warp share one table set
    outs, status = _emulate(b)
    assert not status.any() and all(np.array_equal(o, x) for o, x in zip(outs, arrays,
                                                                          strict=True))
    bits = _special_bf16(rng, 2 * CHUNK + 7)
    e, m = _bf16_fields(bits)
    bb = plan.prepare_bf16([rans.encode(e, chunk_size=CHUNK)], [rans.encode(m, chunk_size=CHUNK)],
                           warps)
    assert np.array_equal(bb.desc[0::2, lay.D_OUT], bb.desc[1::2, lay.D_OUT])
    assert np.array_equal(bb.desc[0::2, lay.D_N], bb.desc[1::2, lay.D_N])
    assert np.array_equal(bb.origin[0::2, 1], bb.origin[1::2, 1])  # same chunk index
    assert bb.slots == 2  # exponent and sign_mantissa tables


def test_equal_tables_are_stored_once():
    a = _skewed(np.random.default_rng(4), 3000, 9)
    f = rans.encode(a, chunk_size=CHUNK)
    one, three = plan.prepare_u8([f]), plan.prepare_u8([f, f, f])
    assert one.sym_tables.size == 1 << 12 and three.sym_tables.size == 1 << 12
    assert np.array_equal(three.info_tables, one.info_tables)
    outs, status = _emulate(three)
    assert not status.any() and all(np.array_equal(o, a) for o in outs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-1, 0, 3, 1 << 40]), st.integers(-1, 2)),
                min_size=1, max_size=40))
def test_table_set_ids_are_np_unique_rows(rows):
    """Blocks group pairs by table set, numbered as ``np.unique(axis=0)`` numbers them
    (their order decides the launch's layout): signed keys, ties, one row."""
    keys = np.array(rows, np.int64)
    _, want = np.unique(keys, axis=0, return_inverse=True)
    assert plan._row_ids(keys).tolist() == want.reshape(-1).tolist()


def test_u8_batch_adversarial_sizes():
    rng = np.random.default_rng(0)
    arrays = [
        np.zeros(0, np.uint8),
        np.array([7], np.uint8),
        np.full(33, 200, np.uint8),  # one symbol only
        np.arange(256, dtype=np.uint8),  # all 256 symbols (stored raw)
        rng.integers(0, 256, CHUNK + 31).astype(np.uint8),  # incompressible: raw chunks
        _skewed(rng, 31, 5),
        _skewed(rng, 32, 5),
        _skewed(rng, CHUNK - 1, 9),
        _skewed(rng, CHUNK, 9),
        _skewed(rng, 2 * CHUNK + 33, 12),
    ]
    frames = [rans.encode(a, chunk_size=CHUNK) for a in arrays]
    outs, status = _emulate(plan.prepare_u8(frames))
    assert not status.any()
    for a, f, got in zip(arrays, frames, outs, strict=True):
        assert np.array_equal(got, a) and np.array_equal(got, rans.decode(f))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 3000),
    k=st.integers(1, 256),
    precision=st.sampled_from([8, 11, 12, 13, 15]),
    seed=st.integers(0, 2**32 - 1),
)
def test_u8_property_matches_cpu_decoder(n, k, precision, seed):
    rng = np.random.default_rng(seed)
    a = _skewed(rng, n, k, rng.uniform(0.05, 0.9))
    f = rans.encode(a, precision=precision, chunk_size=CHUNK)
    (got,), status = _emulate(plan.prepare_u8([f]))
    assert not status.any() and np.array_equal(got, rans.decode(f))


def test_bf16_fused_batch_with_specials_raw_context_and_precisions():
    rng = np.random.default_rng(7)
    tensors = [_special_bf16(rng, 2 * CHUNK + 5), _context_bits(rng, CHUNK + 40),
               _special_bf16(rng, 1), np.zeros(0, np.uint16), _context_bits(rng, 95),
               _context_bits(rng, CHUNK + 3)]
    efs, sfs = [], []
    for t, bits in enumerate(tensors):
        exp, sm = _bf16_fields(bits)
        p = 15 if t == 5 else 12
        efs.append(rans.encode(exp, precision=p, chunk_size=CHUNK))
        sfs.append(rans.encode(sm, precision=p, chunk_size=CHUNK,
                               context=None if t == 5 else exp))
    b = plan.prepare_bf16(efs, sfs)
    live = b.desc[:, lay.D_N] > 0
    assert b.context and set(b.desc[live, lay.D_MODE].tolist()) == {0, 1}  # all paths run
    assert (b.desc[1::2, lay.D_CMAP] >= 0).any() and (b.desc[1::2, lay.D_CMAP] < 0).any()
    outs, status = _emulate(b)
    assert not status.any()
    for bits, got in zip(tensors, outs, strict=True):
        assert np.array_equal(got, bits)


def _rebuild(fb: bytes, chunk: int, payload: bytes, mode: int | None = None) -> bytes:
    """``fb`` with chunk ``chunk``'s payload (and directory entry) replaced."""
    info = frame.parse(CODER, fb)
    count = len(info.lengths)
    dir_at = int(info.offsets[0]) - 9 * count
    lengths = info.lengths.copy()
    lengths[chunk] = len(payload)
    modes = info.modes.copy()
    if mode is not None:
        modes[chunk] = mode
    parts = [fb[:dir_at], lengths.astype("<u4").tobytes(), info.crcs.tobytes(),
             modes.astype(np.uint8).tobytes()]
    for c in range(count):
        a = int(info.offsets[c])
        parts.append(payload if c == chunk else fb[a : a + int(info.lengths[c])])
    return b"".join(parts)


def _coded_frame():
    f = rans.encode(_skewed(np.random.default_rng(11), 3 * CHUNK, 10), chunk_size=CHUNK)
    info = frame.parse(CODER, f)
    assert (info.modes == 0).all()
    return f, info


def _payload(fb, info, c):
    a = int(info.offsets[c])
    return bytearray(fb[a : a + int(info.lengths[c])])


def _corrupt(case: str) -> tuple[bytes, int]:
    f, info = _coded_frame()
    if case == "start state":
        p = _payload(f, info, 1)
        p[4 * 7 : 4 * 8] = struct.pack("<I", 0x1234)  # lane 7 starts below 2**16
        return _rebuild(f, 1, bytes(p)), 1
    if case == "flipped word":
        p = _payload(f, info, 1)
        p[kernels.STATE_BYTES + 40] ^= 0x10
        return _rebuild(f, 1, bytes(p)), 1
    if case == "words left over":
        return _rebuild(f, 2, bytes(_payload(f, info, 2)) + b"\x01\x02"), 2
    return _rebuild(f, 2, bytes(_payload(f, info, 2))[:-2]), 2


@pytest.mark.parametrize("case", ["start state", "flipped word", "words left over",
                                  "words missing"])
def test_corrupt_payload_status_names_the_cpu_decoders_error(case):
    bad, chunk = _corrupt(case)
    with pytest.raises(CorruptDataError) as cpu_err:
        rans.decode(bad)
    b = plan.prepare_u8([rans.encode(np.arange(50, dtype=np.uint8)), bad])
    _, status = _emulate(b)
    err = b.error(status)
    cpu_what = str(cpu_err.value).split(": ", 1)[1]
    assert cpu_what in kernels.MESSAGES.values()
    assert isinstance(err, CorruptDataError)
    assert str(err).startswith(f"rANS frame 1 chunk {chunk} (payload at byte ")
    assert str(err).endswith(cpu_what)
    assert plan.prepare_u8([bad]).error(np.zeros(len(b.desc), np.int32)) is None


def test_bf16_status_rows_are_named_by_field():
    f, info = _coded_frame()
    bad, _ = _corrupt("flipped word")
    b = plan.prepare_bf16([f], [bad])
    _, status = _emulate(b)
    assert str(b.error(status)).startswith("sign_mantissa frame 0 chunk 1 ")
    b = plan.prepare_bf16([bad], [f])
    _, status = _emulate(b)
    assert str(b.error(status)).startswith("exponent frame 0 chunk 1 ")


def test_structural_damage_is_caught_on_the_host():
    f, info = _coded_frame()
    odd = _rebuild(f, 0, bytes(_payload(f, info, 0))[:-1])
    raw_short = _rebuild(f, 0, bytes(CHUNK - 1), mode=1)
    with pytest.raises(CorruptDataError, match=r"rANS frame 0 chunk 0 .*whole 16-bit words"):
        plan.prepare_u8([odd])
    with pytest.raises(CorruptDataError, match=r"raw payload is 1023 bytes, chunk has 1024"):
        plan.prepare_u8([raw_short])
    with pytest.raises(CorruptDataError, match=r"^rANS frame 1: .*truncated"):
        plan.prepare_u8([f, f[:-3]])
    with pytest.raises(CorruptDataError, match=r"^exponent frame 0: not a rANS frame"):
        plan.prepare_bf16([b"XXXX" + f[4:]], [f])


def test_misuse_raises_before_any_device_work():
    a = np.arange(100, dtype=np.uint8)
    f = rans.encode(a)
    b = plan.prepare_u8([f])
    with pytest.raises(ValueError, match="1 outputs for 2 frames"):
        gpu.decode_batch([f, f], [torch.zeros(100, dtype=torch.uint8)])
    with pytest.raises(TypeError, match="output 0 is torch.int16, expected uint8"):
        gpu.check_outputs(b, [torch.zeros(100, dtype=torch.int16)])
    with pytest.raises(ValueError, match="contiguous tensor of 100 elements, got shape"):
        gpu.check_outputs(b, [torch.zeros(101, dtype=torch.uint8)])
    with pytest.raises(ValueError, match=r"\(not contiguous\)"):
        gpu.check_outputs(b, [torch.zeros(200, dtype=torch.uint8)[::2]])
    with pytest.raises(ValueError, match="decodes into CUDA tensors, got device cpu"):
        gpu.decode_batch([f], [torch.zeros(100, dtype=torch.uint8)])
    bits = _context_bits(np.random.default_rng(2), 500)
    exp, sm = _bf16_fields(bits)
    sf = rans.encode(sm, context=exp)
    assert frame.parse(CODER, sf).cmap is not None
    with pytest.raises(ValueError, match="context-conditioned"):
        gpu.decode_batch([sf], [torch.zeros(500, dtype=torch.uint8)])
    with pytest.raises(ValueError, match="exponent frame 0 is context-conditioned"):
        gpu.decode_bf16(sf, sf, torch.zeros(500, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tensor 0: exponent frame 0 has 500 symbols in chunks"):
        gpu.decode_bf16(rans.encode(exp), rans.encode(sm[:499]),
                        torch.zeros(500, dtype=torch.bfloat16))


def test_missing_torch_cuda_or_cupy_is_a_clear_error_at_call_time(monkeypatch):
    f = rans.encode(np.arange(10, dtype=np.uint8))
    out = [torch.zeros(10, dtype=torch.uint8)]
    if not torch.cuda.is_available():
        with pytest.raises(gpu.GpuUnavailableError, match="sees no CUDA device"):
            gpu.decode_batch([f], out, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(gpu.GpuUnavailableError, match="compiles its kernel with cupy"):
        gpu.decode_batch([f], out, device="cuda")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(gpu.GpuUnavailableError, match="needs torch"):
        gpu.upload(plan.prepare_u8([f]))


def test_kernel_source_ships_and_uses_only_the_layout_columns():
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    used = set(re.findall(r"\bD_[A-Z]+\b", src))
    assert used and used <= {k for k in dir(lay) if k.startswith("D_")}
    assert "N_COLS" in src and "rans_decode" in src
    relayout = resources.files("entropykit.container.cuda").joinpath("_relayout.cu")
    assert "relayout" in relayout.read_text()


def _byte_perm(x: np.ndarray, y: int, sel: int) -> np.ndarray:
    """CUDA's __byte_perm: byte n of the result is byte (sel >> 4 n) & 7 of y:x."""
    both = x.astype(np.uint64) | (np.uint64(y) << np.uint64(32))
    out = np.zeros_like(x, dtype=np.uint64)
    for n in range(4):
        k = (sel >> (4 * n)) & 7
        out |= ((both >> np.uint64(8 * k)) & np.uint64(0xFF)) << np.uint64(8 * n)
    return out.astype(np.uint32)


def test_staged_output_packing_is_the_scalar_bf16_formula():
    """The kernel's staged path (VEC: bf16x2 / bf16x8) packs two values a 32-bit word with
    byte permutes and masks; for every exponent and sign_mantissa byte at either byte pair
    of the word it must give the scalar path's (sm >> 7) << 15 | exp << 7 | (sm & 0x7f)."""
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    assert "(e2 << 7) | ((m2 << 8) & 0x80008000u) | (m2 & 0x007f007fu)" in src
    e, m = (a.ravel().astype(np.uint32) for a in np.meshgrid(np.arange(256), np.arange(256)))
    rng = np.random.default_rng(7)
    e_next, m_next = rng.permutation(e), rng.permutation(m)  # the other value of the pair
    scalar = ((m >> 7) << 15) | (e << 7) | (m & 0x7F)
    scalar_next = ((m_next >> 7) << 15) | (e_next << 7) | (m_next & 0x7F)
    for sel, shift in ((0x4140, 0), (0x4342, 16)):
        # the two symbols sit at bytes (0, 1) or (2, 3) of the staged word; junk elsewhere
        junk = rng.integers(0, 1 << 16, e.size, dtype=np.uint32) << np.uint32(16 - shift)
        ew = ((e | e_next << 8) << shift) | junk
        mw = ((m | m_next << 8) << shift) | junk
        e2, m2 = _byte_perm(ew, 0, sel), _byte_perm(mw, 0, sel)
        word = (e2 << 7) | ((m2 << 8) & 0x80008000) | (m2 & 0x007F007F)
        assert np.array_equal(word & 0xFFFF, scalar)
        assert np.array_equal(word >> 16, scalar_next)


def test_packed_tables_are_the_kernels_arithmetic():
    """The emulator's TABLES=1 step and staging are the kernel's own expressions."""
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    assert "y = ((e >> 8) & 0xfffu) * q + q + (e >> 20);" in src
    assert "d32[j] = c | ((inf & 0xffffu) - 1u) << 8 | (j - (inf >> 16)) << 20;" in src
    assert "#define PACKED_B (PACKED && !CTX)" in src


@pytest.mark.parametrize("precision", [8, 11, 12])
def test_packed_tables_decode_u8_as_the_cpu(precision):
    """Every slot word of a table (one symbol of f = 2^p, all 256 symbols, skewed) unpacks
    to its symbol, f and start, and the packed step decodes the CPU's bytes."""
    rng = np.random.default_rng(precision)
    arrays = [np.full(3 * CHUNK + 9, 7, np.uint8),  # one symbol: f - 1 = 2^p - 1
              rng.integers(0, 256, 2 * CHUNK + 100).astype(np.uint8),
              _skewed(rng, 5 * CHUNK + 31, 60, 0.2), _skewed(rng, 70, 3)]
    frames = [rans.encode(a, precision=precision, chunk_size=CHUNK) for a in arrays]
    b = plan.prepare_u8(frames, 4)
    assert b.narrow and not b.context
    assert (b.desc[b.desc[:, lay.D_N] > 0, lay.D_MODE] == 0).any()  # coded rows run packed
    outs, status = _emulate(b, tables=1)
    assert not status.any()
    for f, a, got in zip(frames, arrays, outs, strict=True):
        assert np.array_equal(got, a) and np.array_equal(got, rans.decode(f))


def test_packed_tables_decode_bf16_with_raw_and_context_fields():
    """bf16 mode, TABLES=1: exponents packed; sign_mantissa packed, raw, or (context batch)
    read with layout 0; every value as the CPU decodes it."""
    rng = np.random.default_rng(5)
    tensors = [_special_bf16(rng, 2 * CHUNK + 5), _context_bits(rng, CHUNK + 40),
               _special_bf16(rng, 600)]
    for context in (False, True):
        efs, sfs = [], []
        for t, bits in enumerate(tensors):
            exp, sm = _bf16_fields(bits)
            efs.append(rans.encode(exp, precision=11 + t % 2, chunk_size=CHUNK))
            sm_ctx = exp if context and t == 1 else None
            sfs.append(rans.encode(sm, chunk_size=CHUNK, context=sm_ctx))
        b = plan.prepare_bf16(efs, sfs, 2)
        live = b.desc[:, lay.D_N] > 0
        assert b.context == context and b.narrow and b.slots == (1 if context else 2)
        assert set(b.desc[live, lay.D_MODE].tolist()) == {0, 1}  # coded and raw chunks
        packed, status = _emulate(b, tables=1)
        plain, status0 = _emulate(b, tables=0)
        assert not status.any() and not status0.any()
        for bits, got, ref in zip(tensors, packed, plain, strict=True):
            assert np.array_equal(got, bits) and np.array_equal(got, ref)


@pytest.mark.parametrize("case", ["start state", "flipped word", "words left over",
                                  "words missing"])
@pytest.mark.parametrize("build, other", [
    (dict(tables=0), dict(tables=1)),  # packed tables
    (dict(tables=1), dict(tables=1, lanes=2)),  # two lanes a thread
], ids=["packed tables", "two lanes"])
def test_build_options_give_the_same_status_on_corrupt_chunks(case, build, other):
    f, bad = _corrupt(case)
    b = plan.prepare_u8([f])
    out0, status0 = _emulate(b, **build)
    out1, status1 = _emulate(b, **other)
    assert status1.any() and np.array_equal(status0, status1)
    assert all(np.array_equal(x, y) for x, y in zip(out0, out1, strict=True))


def test_lane_groups_are_the_kernels_expressions():
    """The emulator's LANES arithmetic (``_word_reads``, the pair's half of a warp) is the
    kernel's own, and at UNIFORM with two lanes a step with no live lane (a half past its
    own end, a raw stream's coded step in a mixed warp) votes no bit: the other half's
    words are unaffected (``_word_reads`` with any other-half bits)."""
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    for line in ("const unsigned w = ring_word(s, __popc(b & me.glt));",
                 "s.wp += WU * __popc(LANES == 1 ? b : b & me.gm);",
                 "vote.sync.ballot.b32 %0, q, %2;",
                 "? __shfl_sync(FULL_MASK, (int)(threadIdx.x >> 5), 0) : (int)(threadIdx.x / GROUP",
                 "me.gm = LANES == 1 ? FULL_MASK : 0xffffu << (lane & 16);",
                 "me.glt = lt & me.gm;",
                 "lane_step<FULL, RAW_A, RAW_B>(a, b, q, j, i0 + GROUP * j, me);",
                 "reinterpret_cast<const unsigned*>(buf + off)[me.g + GROUP * j]",
                 "const bool live = (FULL || i < s.n) && coded;",
                 "const bool need = live && y < LB;",
                 "const unsigned c = rans_step<FULL, PK>(s, j, i, me, sym, info, !s.is_raw);"):
        assert line in src


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 32) - 1), st.integers(0, 1 << 20), st.integers(0, (1 << 32) - 1),
       st.sampled_from([(1, 0), (2, 0), (2, 1)]))
def test_group_ballots_give_each_needy_lane_its_word_in_lane_order(bits, wp, junk, layout):
    """Whatever the other half of the warp votes, the words of a step go to the needy lanes
    in lane order (the format's order: one stream layout for CPU and GPU) and wp moves on
    by their number, at one lane a thread and at two."""
    need = (bits >> np.arange(32) & 1).astype(bool)
    idx, nxt = _word_reads(need, wp, *layout, junk)
    assert np.array_equal(idx[need], wp + np.arange(need.sum()))
    assert nxt == wp + need.sum()


def test_lane_groups_copy_stage_and_write_every_byte_once():
    """At LANES 1 and 2 (GROUP, HALF, COPY as _kernel.cu defines them): a stream's copying
    threads fill each 128-byte ring window exactly once with aligned copies; a round's
    staging places 32 k + g + GROUP j are symbol (i - 512 r)'s, each once; the lanes
    g + GROUP j that read a round back and write it are 0..31, each once."""
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    for line in ("#define GROUP (32 / LANES)", "#define HALF (GROUP / 2)",
                 "#define COPY (128 / HALF)",
                 "const int at = 128 * j + COPY * (me.g & (HALF - 1));",
                 "if ((me.g & HALF) == s.owner) {",
                 "const int at = 32 * k + me.g + GROUP * j;"):
        assert line in src
    for lanes in (1, 2):
        group = 32 // lanes
        half, copy = group // 2, 128 // (group // 2)
        for owner in (0, half):
            got = np.zeros(128, int)
            for g in range(group):
                if g & half == owner:
                    at = copy * (g & (half - 1))
                    assert at % copy == 0
                    got[at : at + copy] += 1
            assert (got == 1).all()
        seen = np.zeros(512, int)
        for k in range(16):
            for g in range(group):
                for j in range(lanes):
                    i = g + 32 * (16 * 3 + k) + group * j  # symbol i of round 3
                    at = 32 * k + g + group * j
                    assert at == i - 512 * 3
                    seen[at] += 1
        assert (seen == 1).all()
        assert sorted(g + group * j for g in range(group) for j in range(lanes)) == list(range(32))


@pytest.mark.parametrize("warps", [1, 2, 3])
def test_two_lanes_a_thread_decode_as_the_cpu(warps):
    """LANES 2 (a half-warp a pair, two lanes a thread), packed and plain tables: u8 frames
    (skewed, all symbols, one symbol, short) and bf16 with raw and context fields decode
    the CPU's bytes, with pairs in both halves of a warp (odd warps: the halves alternate
    across blocks)."""
    rng = np.random.default_rng(warps)
    arrays = [_skewed(rng, 5 * CHUNK + 31, 60, 0.2), rng.integers(0, 256, 2 * CHUNK + 100
                                                                  ).astype(np.uint8),
              np.full(CHUNK + 9, 7, np.uint8), _skewed(rng, 70, 3)]
    frames = [rans.encode(a, precision=11 + k % 2, chunk_size=CHUNK)
              for k, a in enumerate(arrays)]
    u8 = plan.prepare_u8(frames, warps)
    tensors = [_special_bf16(rng, 2 * CHUNK + 5), _context_bits(rng, CHUNK + 40)]
    efs, sfs = [], []
    for t, bits in enumerate(tensors):
        exp, sm = _bf16_fields(bits)
        efs.append(rans.encode(exp, chunk_size=CHUNK))
        sfs.append(rans.encode(sm, chunk_size=CHUNK, context=exp if t == 1 else None))
    bf16 = plan.prepare_bf16(efs, sfs, warps)
    assert bf16.context
    for b, want in ((u8, arrays), (bf16, tensors)):
        for tables in (0, 1):
            outs, status = _emulate(b, tables, lanes=2)
            assert not status.any()
            for got, a in zip(outs, want, strict=True):
                assert np.array_equal(got, a)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1 << 24), st.integers(0, 32), st.sampled_from([4, 8, 16]),
       st.integers(0, (227 << 10) // 16), st.integers(0, 15), st.booleans())
def test_byte_cursor_reads_the_word_cursors_ring_word(wp, k, windows, at, slot, staged):
    """RENORM: wp counts bytes and each ring starts at a multiple of its size (the pairs'
    area padded up to one, every pair's share a multiple of one), so the word address
    (wp + 2 k) & (size - 2) | ring is the word cursor's ring + 2 ((wp / 2 + k) % RING),
    and the padding and shares stay inside what the runtime reserves."""
    src = resources.files("entropykit.rans.cuda").joinpath("_kernel.cu").read_text()
    for line in (': "r"(((s.wp + 2 * k) & (2 * RING - 2)) | s.ring_addr));',
                 "return s.ring[(s.wp + k) & (RING - 1)];",
                 "pairs += (0u - (unsigned)__cvta_generic_to_shared(pairs)) & (2 * RING - 1);",
                 "#define WARP_SMEM ((4 * RING + STAGE + (RENORM ? 2 * RING - 1 : 0)) / "
                 "(RENORM ? 2 * RING : 1) \\",
                 "if (s.wp / WU > s.n_words) return ERR_TRUNCATED;"):
        assert line in src
    ring = 64 * windows  # words
    size = 2 * ring
    pairs = 16 * at  # the pairs' area in shared memory: 16-byte aligned, anywhere
    pad = (-pairs) & (size - 1)
    assert (pairs + pad) % size == 0 and pad < size  # within the runtime's slack of a ring
    share = -(-(4 * ring + 1024 * staged) // size) * size  # WARP_SMEM
    base = pairs + pad + slot * share
    for ring_addr in (base, base + size):  # stream a's ring, stream b's
        assert ring_addr % size == 0 and ring_addr + size <= base + share
        got = ((2 * wp + 2 * k) & (size - 2)) | ring_addr
        assert got == ring_addr + 2 * ((wp + k) % ring)


@pytest.fixture
def runtime(monkeypatch):
    """``rans.cuda._runtime`` imported against a stand-in CuPy (only its pure helpers are
    used), removed again afterwards."""
    import importlib
    import types

    from entropykit.rans import cuda as pkg

    name = "entropykit.rans.cuda._runtime"
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, name, None)
    del sys.modules[name]
    monkeypatch.setattr(pkg, "_runtime", None, raising=False)
    return importlib.import_module(name)


def test_runtime_variant_options_and_shared_memory(runtime, monkeypatch):
    """The private variables select LANES, UNIFORM and RENORM (bad values name the
    variable); classed builds get one lane, UNIFORM at two lanes needs an even number of
    pairs a block; each pair's shared memory is the kernel's WARP_SMEM and a block's
    leaves room to align its pairs to a ring (RENORM)."""
    r = runtime
    assert r.variant() == r.DEFAULT == r.Variant(1, 8, 1, 1, 1)
    for env, val in ((r._ENV_LANES, "2"), (r._ENV_UNIFORM, "0"), (r._ENV_RENORM, "0")):
        monkeypatch.setenv(env, val)
    assert r.variant() == r.Variant(1, 8, 2, 0, 0)
    for env, bad in ((r._ENV_LANES, "4"), (r._ENV_UNIFORM, "2"), (r._ENV_RENORM, "-1")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            r.variant()
        monkeypatch.setenv(env, "1")

    def opts(warps, cls, v):
        return dict(o[2:].split("=") for o in r.build_options(False, False, True, warps, cls, v)
                    if o.startswith("-D"))

    v = r.Variant(1, 8, 2, 1, 1)
    assert opts(16, False, v)["LANES"] == "2" and opts(16, False, v)["UNIFORM"] == "1"
    assert opts(3, False, v)["UNIFORM"] == "0" and opts(16, True, v)["LANES"] == "1"
    assert opts(3, False, v._replace(lanes=1))["UNIFORM"] == "1"
    for ring in (4, 8, 16):
        for renorm in (0, 1):
            for ctx in (False, True):
                v = r.Variant(1, ring, 1, 0, renorm)
                size, stage = 128 * ring, 0 if ctx else 1024
                share = 4 * 64 * ring + stage  # two rings of RING = 64 * ring words
                if renorm:
                    share = -(-share // size) * size
                assert r.warp_smem(ctx, False, v) == share
                # RENORM: room for the alignment padding, under one ring
                assert r.pairs_smem(16, ctx, False, v) == 16 * share + size * renorm
