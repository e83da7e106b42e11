"""rans2d fields on the GPU path, on the CPU: the kernel's classed flavour, emulated.

The GPU loader sends a rans2d field (row / column class maps + an rANS frame whose
context is row class * kc + column class) to the kernel's classed build (CLS): the plan
lays out the maps and each chunk's grid coordinates, and the kernel keeps each lane's
(row, column) as it steps. Here ``test_gpu_logic``'s emulator replays that arithmetic on
the plan's own buffers and is compared with the CPU decoder (``classed.decode``) on
geometries that stress it: chunks starting mid-row, phase != 0, one row, one column,
rows shorter than a step, every class count; damaged maps must fail on the host before
anything is planned, damaged coded words in the kernel's status. gpu/tests/test_cuda_load.py
runs default files with rans2d fields on the device.
"""

import numpy as np
import pytest
import safetensors.torch
import torch
from test_gpu_logic import _emulate

import entropykit
from entropykit import CorruptDataError
from entropykit.coding import frame, lines
from entropykit.container import classed, codecs, files
from entropykit.container.cuda import fileplan
from entropykit.container.reader import Compressed
from entropykit.rans.cuda import plan
from entropykit.rans.static import CODER

CHUNK = frame.MIN_CHUNK  # several chunks per field, most starting mid-row


def _classes(rng, count: int, k: int) -> np.ndarray | None:
    return None if k == 1 else rng.integers(0, k, count).astype(np.uint8)


def _field(rng, n, cols, phase, kr, kc, chunk=CHUNK):
    """(payload, symbols): a rans2d payload written field by field as classed.encode lays
    it out, with symbols that depend on their class (so the classes pick tables)."""
    rcls = _classes(rng, lines.n_rows(n, cols, phase), kr)
    ccls = _classes(rng, cols, kc)
    ctx = lines.context(n, cols, phase, rcls, ccls, kc)
    sym = ((ctx.astype(np.int64) * 29 + np.minimum(rng.geometric(0.3, n) - 1, 20)) & 0xFF
           ).astype(np.uint8)
    head = classed._HEAD.pack(classed.MAGIC, classed.VERSION, kr, kc, 0, n, cols, phase)
    maps = (b"" if rcls is None else lines.pack(rcls, kr)) + (
        b"" if ccls is None else lines.pack(ccls, kc))
    body = frame.encode(CODER, sym, 12, chunk, None, ctx, max_tables=classed.MAX_TABLES)
    return np.frombuffer(head + maps + body, np.uint8), sym


def _run_u8(streams: list[plan.Stream], warps: int = 2) -> list[np.ndarray]:
    p = plan.Planner(False, warps)
    for k, s in enumerate(streams):
        p.add(s, plan.Place(k))
    b = p.finish([s.n for s in streams])
    outs, status = _emulate(b)
    assert b.error(status) is None
    return outs


GEOMETRIES = [  # n, cols, phase, kr, kc
    (5000, 37, 5, 4, 4),  # chunks and rows cut each other anywhere
    (3000, 4096, 100, 4, 3),  # one row (phase + n < cols)
    (2000, 1, 0, 4, 1),  # one column: every step crosses 32 rows
    (2000, 1, 0, 3, 2),  # one column, with its (one-entry) column map
    (4100, 3, 2, 2, 3),  # rows shorter than a step: dq = 10, dr = 2
    (4097, 32, 31, 3, 4),  # a step is exactly a row: dq = 1, dr = 0
    (3333, 33, 0, 1, 4),  # columns classed only
    (6000, 64, 63, 16, 16),  # every context value in use
    (CHUNK + 20, 7, 6, 2, 2),  # a last chunk of fewer symbols than a step
]


@pytest.mark.parametrize(("n", "cols", "phase", "kr", "kc"), GEOMETRIES)
def test_classed_stream_decodes_as_the_cpu_decoder(n, cols, phase, kr, kc):
    rng = np.random.default_rng(n + cols)
    data, sym = _field(rng, n, cols, phase, kr, kc)
    assert np.array_equal(classed.decode(data, n), sym)
    s = fileplan._stream("rans2d", data, n, None, "w: field 'exponent' (rans2d)")
    assert s.classed and s.info.cmap is not None and len(s.info.lengths) > (n > CHUNK)
    assert np.array_equal(_run_u8([s])[0], sym)


def test_classed_and_plain_streams_share_a_launch():
    """Rows of a classed build without D_GRID use table 0, as the other builds do."""
    rng = np.random.default_rng(1)
    data, sym = _field(rng, 9000, 100, 17, 4, 4)
    classed_s = fileplan._stream("rans2d", data, sym.size, None, "a")
    other = rng.geometric(0.2, 7000).clip(0, 255).astype(np.uint8)
    plain_s = plan.Stream.frame(codecs.encode("rans", other, None, chunk_size=CHUNK), "b")
    p = plan.Planner(False, 3)
    p.add(classed_s, plan.Place(0))
    p.add(plain_s, plan.Place(1))
    b = p.finish([sym.size, other.size])
    assert b.classed and not b.context
    outs, status = _emulate(b)
    assert b.error(status) is None
    assert np.array_equal(outs[0], sym) and np.array_equal(outs[1], other)


def test_bf16_pair_of_a_classed_exponent_and_a_conditioned_sign_mantissa():
    rng = np.random.default_rng(2)
    data, exp = _field(rng, 7777, 300, 299, 4, 4)
    sm = ((exp.astype(np.int64) * 37 + rng.geometric(0.5, exp.size)) & 0xFF).astype(np.uint8)
    e = fileplan._stream("rans2d", data, exp.size, None, "exponent")
    m = plan.Stream.frame(codecs.encode("rans", sm, exp, chunk_size=CHUNK), "sign_mantissa")
    assert e.classed and m.context
    p = plan.Planner(True, 2)
    p.add_pair(e, m, plan.Place(0))
    b = p.finish([exp.size])
    outs, status = _emulate(b)
    assert b.error(status) is None
    e16, m16 = exp.astype(np.uint16), sm.astype(np.uint16)
    assert np.array_equal(outs[0], (m16 >> 7) << 15 | e16 << 7 | (m16 & 0x7F))


def test_one_table_frame_is_a_plain_rans_stream():
    sym = np.zeros(5000, np.uint8)
    sym[::7] = 1
    head = classed._HEAD.pack(classed.MAGIC, classed.VERSION, 2, 1, 0, sym.size, 50, 0)
    maps = lines.pack(np.zeros(100, np.uint8), 2)
    body = frame.encode(CODER, sym, 12, CHUNK)
    s = fileplan._stream("rans2d", np.frombuffer(head + maps + body, np.uint8), sym.size,
                         None, "one")
    assert not s.classed and not s.context
    assert np.array_equal(_run_u8([s])[0], sym)


def _damaged(case: str) -> tuple[np.ndarray, int]:
    data, sym = _field(np.random.default_rng(3), 5000, 39, 5, 3, 4)
    buf = data.copy()
    at = classed.HEADER_SIZE
    rows = lines.n_rows(sym.size, 39, 5)
    if case == "row class >= kr":  # 2 bits a row, classes 0..2: 3 is out of range
        buf[at] |= 0x03
    elif case == "padding bits":
        buf[at + lines.map_bytes(rows, 3) - 1] |= 0x80
    elif case == "column class map cut":
        buf = buf[: at + lines.map_bytes(rows, 3) + 2]
    elif case == "phase >= cols":
        buf[24:32] = np.frombuffer(np.uint64(39).tobytes(), np.uint8)
    elif case == "frame of other count":
        sub, _ = _field(np.random.default_rng(3), 4999, 39, 5, 3, 4)
        body = sub[at + lines.map_bytes(lines.n_rows(4999, 39, 5), 3) + lines.map_bytes(39, 4):]
        buf = np.concatenate([data[: at + lines.map_bytes(rows, 3) + lines.map_bytes(39, 4)],
                              body])
    return buf, sym.size


@pytest.mark.parametrize(("case", "says"), [
    ("row class >= kr", "row class map"), ("padding bits", "row class map"),
    ("column class map cut", "truncated in its class maps"),
    ("phase >= cols", "phase 39 not below 39"), ("frame of other count", "holds 4999")])
def test_damaged_maps_fail_on_the_host_before_planning(case, says):
    buf, n = _damaged(case)
    with pytest.raises(CorruptDataError, match=says):
        classed.decode(buf, n) if case != "frame of other count" else None
        fileplan._stream("rans2d", buf, n, None, "t: field 'exponent' (rans2d)")
    with pytest.raises(CorruptDataError, match=r"^t: field 'exponent' \(rans2d\)"):
        fileplan._stream("rans2d", buf, n, None, "t: field 'exponent' (rans2d)")


def test_damaged_coded_word_is_reported_by_the_kernel_status():
    data, sym = _field(np.random.default_rng(4), 6000, 61, 9, 4, 4)
    s = fileplan._stream("rans2d", data, sym.size, None, "w: field 'exponent' (rans2d)")
    info = s.info
    c = int(np.flatnonzero(info.modes == frame.MODE_CODED)[1])
    bad = data.copy()
    bad[data.size - s.data.size + int(info.offsets[c]) + 130] ^= 0x5A  # a word, not a state
    with pytest.raises(CorruptDataError):
        classed.decode(bad, sym.size)
    s = fileplan._stream("rans2d", bad, sym.size, None, "w: field 'exponent' (rans2d)")
    p = plan.Planner(False, 2)
    p.add(s, plan.Place(0))
    b = p.finish([sym.size])
    _, status = _emulate(b)
    err = b.error(status)
    assert err is not None and str(err).startswith(
        f"w: field 'exponent' (rans2d) frame chunk {c} ")


def _row_scaled(rng, rows, cols, dtype):
    scale = np.exp(rng.normal(0, 1.5, (rows, 1))) * np.exp(rng.normal(0, 0.7, (1, cols)))
    w = (rng.standard_normal((rows, cols)) * scale * 0.02).astype(np.float32)
    return torch.from_numpy(w).to(dtype)


@pytest.mark.parametrize("segment_bytes", [1 << 24, 3 * (1 << 14) + 8])
def test_default_file_with_rans2d_fields_loads_through_the_kernel(tmp_path, segment_bytes):
    """A default file's rans2d fields reach the kernel (none decoded on the host) and
    the emulated GPU load is the CPU load; small segments start mid-row."""
    from test_gpu_load import _cpu_bytes, _emulated_load

    rng = np.random.default_rng(6)
    src = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w.bf16": _row_scaled(rng, 96, 1000, torch.bfloat16),
                                 "w.e4m3": _row_scaled(rng, 128, 300, torch.float8_e4m3fn)},
                                src)
    ek = tmp_path / "m.ek.safetensors"
    files.compress_file(src, ek, threads=2, segment_bytes=segment_bytes)
    c = Compressed(np.fromfile(ek, np.uint8))
    used = {(t, f[0], cd) for t, r in c.record.tensors.items() for seg in r.codecs
            for f, cd in zip(r.fields, seg, strict=True)}
    assert {("w.bf16", "exponent", "rans2d"), ("w.e4m3", "byte0", "rans2d")} <= used
    kinds = [(p.batch.bf16, p.batch.classed) for g in fileplan.groups(c) for p in g.parts]
    assert (True, True) in kinds and (False, True) in kinds
    got, want = _emulated_load(ek), _cpu_bytes(ek)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    restored = entropykit.load_file(src)
    assert all(np.array_equal(want[k], restored[k].reshape(-1).view(torch.uint8).numpy())
               for k in want)


def test_a_classed_sign_mantissa_is_refused_in_bf16_mode():
    """bf16 builds keep a class grid for the exponent stream only (registers): a classed
    sign_mantissa, which entropykit never writes, is the loader's to decode on the host."""
    rng = np.random.default_rng(7)
    data, sym = _field(rng, 5000, 50, 0, 4, 4)
    e = plan.Stream.frame(codecs.encode("rans", sym, None, chunk_size=CHUNK), "exponent")
    m = fileplan._stream("rans2d", data, sym.size, None, "sign_mantissa")
    with pytest.raises(ValueError, match="sign_mantissa frame is classed"):
        plan.Planner(True).add_pair(e, m, plan.Place(0))
