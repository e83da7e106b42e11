"""Hostile frames and payloads against the coders: bounded memory, CorruptDataError.

Each test builds its hostile input here. Where memory is the point the work runs in a
child process under an address-space limit (so a regression fails instead of taking the
machine's memory) and reports its peak RSS.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import entropykit
from entropykit import CorruptDataError, rans, tans
from entropykit._status import Status
from entropykit.coding import contexts, frame, lines
from entropykit.container import classed, codecs

_LIMIT = 2 << 30  # address space of a child: far above what bounded decoding needs
# The children import the entropykit this test imports.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(entropykit.__file__)))


def _child(body: str, warm: str = "", limit: int = _LIMIT, **values: object) -> dict:
    """Run ``warm`` then ``body`` in a fresh interpreter under ``limit`` of address space;
    return the JSON object ``result`` that ``body`` sets, with "grew" added: how far
    ``body`` raised the peak RSS above ``warm``'s, in bytes. ``warm`` runs the same kernels
    on a small input first, so that compiling them (a cold Numba cache) is not counted.
    ``values`` are bound as globals (their repr)."""
    head = ["import json, resource\n",
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n",
            # VmHWM after clear_refs: this process's own peak (ru_maxrss is inherited
            # from the parent across exec, which would hide the growth measured here)
            "def peak():\n    with open('/proc/self/status') as f:\n"
            "        return next(int(x.split()[1]) for x in f if x.startswith('VmHWM:')) << 10\n",
            "def reset_peak():\n    with open('/proc/self/clear_refs', 'w') as f:\n"
            "        f.write('5')\n"]
    head += [f"{k} = {v!r}\n" for k, v in values.items()]
    code = "".join(head + [textwrap.dedent(warm), "reset_peak()\nbase = peak()\n",
                           textwrap.dedent(body),
                           'result["grew"] = peak() - base\nprint(json.dumps(result))\n'])
    env = dict(os.environ, PYTHONPATH=_ROOT, NUMBA_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"child's peak RSS grew {result['grew'] >> 20} MiB")
    return result


# ---- rans2d: column counts -----------------------------------------------------------


def _row_classed(n: int, cols: int, phase: int) -> tuple[np.ndarray, bytes]:
    """(symbols, a rans2d payload of them: rows in 2 classes of different statistics,
    columns not classed; its frame has a table per row class)."""
    rng = np.random.default_rng(0)
    rows = lines.n_rows(n, cols, phase)
    row = (phase + np.arange(n)) // cols
    sym = (rng.geometric(0.3, n) + 40 * (row % 2)).clip(0, 255).astype(np.uint8)
    rcls = (np.arange(rows) % 2).astype(np.uint8)
    joint = lines.context_counts(sym, cols, phase, rcls, None, 1)
    blob = classed.encode(sym, cols, phase, classed.Plan(2, 1, rcls, None, joint, 0),
                          codecs.RANS_PRECISION)
    assert frame.parse(rans.static.CODER, blob[classed.HEADER_SIZE + 1:]).cmap is not None
    return sym, blob


@pytest.mark.parametrize("cols", [1 << 30, 1 << 40])
def test_rans2d_claimed_columns_cost_nothing(cols: int) -> None:
    # A payload of a segment across two rows, edited to claim rows of 2**30 (2**40)
    # columns: its one row now (the row map says class 1, a valid map) decodes with the
    # wrong table, so the frame rejects it, in memory that follows the symbols, not
    # the claimed row (which old code laid out: 19 GB, or a numpy allocation error).
    n = 5000
    sym, blob = _row_classed(n, 8192, 8192 - n // 2)
    assert np.array_equal(codecs.decode("rans2d", np.frombuffer(blob, np.uint8), n, None),
                          sym)
    hostile = bytearray(blob)
    struct.pack_into("<Q", hostile, 16, cols)
    hostile[classed.HEADER_SIZE] = 0b01  # one row, class 1
    got = _child("""
        data = np.frombuffer(bytes.fromhex(blob), np.uint8)
        try:
            codecs.decode("rans2d", data, n, None)
            result = {"error": None}
        except Exception as e:
            result = {"error": type(e).__name__, "message": str(e)}
    """, """
        import numpy as np
        from entropykit.container import codecs
        codecs.decode("rans2d", np.frombuffer(bytes.fromhex(good), np.uint8), n, None)
    """, blob=bytes(hostile).hex(), good=blob.hex(), n=n)
    assert got["error"] == "CorruptDataError", got
    assert got["message"].startswith("rans2d frame: rANS frame chunk 0")
    assert got["grew"] < 50 << 20


def test_rans2d_long_rows_segment_memory() -> None:
    # A segment of a [2, 37748736] tensor's exponents (8 Mi symbols, a default 16 MiB
    # bf16 segment) that crosses its row boundary: classed by rows, and both coded and
    # decoded in memory that follows the segment, never the 37.7 M-column row.
    got = _child("""
        result = roundtrip(1 << 23, 37748736)
    """, """
        import numpy as np
        from entropykit.container import codecs

        def roundtrip(n, cols):
            rng = np.random.default_rng(0)
            sym = np.concatenate([rng.geometric(0.3, n // 2) + 110, rng.geometric(0.6, n // 2)
                                  + 100]).clip(0, 255).astype(np.uint8)
            choice = codecs.choose(sym, None, grid=(cols, cols - n // 2))
            out = codecs.decode(choice.codec, np.frombuffer(choice.blob, np.uint8), n, None)
            return {"codec": choice.codec, "same": bool(np.array_equal(out, sym)),
                    "kr": choice.blob[5], "kc": choice.blob[6]}

        assert roundtrip(1 << 16, 300_000)["codec"] == "rans2d"
    """)
    assert (got["codec"], got["same"], got["kr"], got["kc"]) == ("rans2d", True, 4, 1)
    assert got["grew"] < 200 << 20


def test_rans2d_indirect_columns_roundtrip() -> None:
    # Classed columns far more than the symbols (a short segment of very long rows, as
    # only a hand-made payload has): contexts are looked up through the column classes
    # instead of laid out along the row; the same symbols come back.
    n, cols, phase = 3000, 1 << 21, (1 << 21) - 1000
    rng = np.random.default_rng(3)
    sym = rng.geometric(0.2, n).clip(0, 255).astype(np.uint8)
    rows = lines.n_rows(n, cols, phase)
    rcls = rng.integers(0, 4, rows).astype(np.uint8)
    ccls = rng.integers(0, 4, cols).astype(np.uint8)
    joint = lines.context_counts(sym, cols, phase, rcls, ccls, 4)
    assert joint.sum() == n
    blob = classed.encode(sym, cols, phase, classed.Plan(4, 4, rcls, ccls, joint, 0),
                          codecs.RANS_PRECISION)
    ctx = lines.context(n, cols, phase, rcls, ccls, 4)
    np.testing.assert_array_equal(ctx, rcls[(phase + np.arange(n)) // cols] * 4
                                  + ccls[(phase + np.arange(n)) % cols])
    np.testing.assert_array_equal(codecs.decode("rans2d", np.frombuffer(blob, np.uint8), n,
                                                None), sym)


# ---- frames: declared output -----------------------------------------------------------


def _zeros_crc(n: int) -> int:
    crc, block = 0, bytes(min(n, 1 << 20))
    while n:
        take = min(n, len(block))
        crc = zlib.crc32(block[:take], crc)
        n -= take
    return crc


def _one_symbol_frame(coder: str, n: int, chunk_size: int) -> bytes:
    """A valid frame of ``n`` zero symbols whose every chunk is coded with a table that
    gives symbol 0 every slot: such a chunk takes a fixed size (rANS: 32 start states of
    2**16; tANS: a marker and four zero states) whatever its symbol count."""
    param = 12
    table = bytes([0, 0]) + bytes([0x80, 0x20])  # one symbol, 0, of frequency 2**12
    if coder == "rans":
        magic, lanes, payload = b"EKRA", 32, struct.pack("<32I", *[1 << 16] * 32)
    else:
        magic, lanes, payload = b"EKTA", 4, bytes([0x80]) + bytes(6)  # 7 pad bits, marker
    n_chunks = -(-n // chunk_size)
    sizes = [min(chunk_size, n - i * chunk_size) for i in range(n_chunks)]
    crcs = {s: _zeros_crc(s) for s in set(sizes)}
    head = struct.pack("<4sBBBBQIII", magic, 1, param, lanes, 0, n, chunk_size, n_chunks,
                       len(table))
    return b"".join([head, table, struct.pack(f"<{n_chunks}I", *[len(payload)] * n_chunks),
                     struct.pack(f"<{n_chunks}I", *[crcs[s] for s in sizes]),
                     bytes(n_chunks)] + [payload] * n_chunks)


@pytest.mark.parametrize("coder", [rans, tans], ids=["rans", "tans"])
def test_max_output_bounds_a_valid_frame(coder) -> None:
    name = coder.__name__.rsplit(".", 1)[-1]
    n = 3 * 4096 + 100
    blob = _one_symbol_frame(name, n, 4096)
    np.testing.assert_array_equal(coder.decode(blob), np.zeros(n, np.uint8))
    np.testing.assert_array_equal(coder.decode(blob, max_output=n), np.zeros(n, np.uint8))
    with pytest.raises(CorruptDataError, match=f"declares {n} symbols .*more than the {n - 1}"):
        coder.decode(blob, max_output=n - 1)
    with pytest.raises(CorruptDataError, match=f"more than the {n - 1}"):
        coder.decode(blob, out=np.empty(n - 1, np.uint8))
    assert frame.parse(coder.static.CODER, blob, max_output=n).n == n


@pytest.mark.parametrize("name", ["rans", "tans"])
def test_small_frame_declaring_4_gib_is_refused_unallocated(name: str) -> None:
    # 8.8 KB (rANS) of valid frame that decodes to 2**32 zero symbols: beyond the default
    # bound, so refused before anything is allocated (old code allocated 4 GiB).
    blob = _one_symbol_frame(name, 1 << 32, frame.MAX_CHUNK)
    assert len(blob) < 9000
    got = _child("""
        try:
            coder.decode(bytes.fromhex(blob))
            result = {"error": None}
        except Exception as e:
            result = {"error": type(e).__name__, "message": str(e)}
    """, """
        from entropykit import rans, tans
        coder = rans if name == "rans" else tans
        coder.decode(bytes.fromhex(small))
    """, blob=blob.hex(), small=_one_symbol_frame(name, 5000, 1024).hex(), name=name)
    assert got["error"] == "CorruptDataError", got
    assert f"declares {1 << 32} symbols" in got["message"]
    assert got["grew"] < 50 << 20


def test_codecs_count_enforces_its_limit() -> None:
    # A count read from a payload is never handed back unchecked: each codec's declared
    # count against the caller's limit.
    sym = np.arange(5000, dtype=np.uint8)
    blobs = {c: np.frombuffer(codecs.encode(c, sym, None), np.uint8)
             for c in ("rans", "tans", "zstd", "raw")}
    hostile = bytearray(blobs["rans"])
    struct.pack_into("<Q", hostile, 8, 1 << 40)
    blobs["hostile"] = np.frombuffer(bytes(hostile), np.uint8)
    for codec, data in blobs.items():
        kind = "rans" if codec == "hostile" else codec
        n = codecs.count(kind, data, limit=1 << 41)
        assert n == (1 << 40 if codec == "hostile" else 5000)
        with pytest.raises(CorruptDataError, match=f"declares {n} symbols, more than the"):
            codecs.count(kind, data, limit=n - 1)
    with pytest.raises(CorruptDataError, match="holds 1099511627776 symbols, field has 5000"):
        codecs.decode("rans", blobs["hostile"], 5000, None)


def test_distribution_frame_count_checked_before_allocation() -> None:
    from entropykit.rans import distribution as dist

    rng = np.random.default_rng(0)
    n = 3000
    mu = rng.normal(size=n).astype(np.float32)
    sigma = np.full(n, 0.5, np.float32)
    bits = (mu + 0.5 * rng.normal(size=n).astype(np.float32)).astype(np.float16).view(np.uint16)
    model = dist.gaussian_model()
    blob = dist.encode(bits, mu, sigma, model, fmt="fp16", chunk_size=1024)
    np.testing.assert_array_equal(dist.decode(blob, mu, sigma, model, max_output=n), bits)
    with pytest.raises(CorruptDataError, match=f"declares {n} values .*more than the {n - 1}"):
        dist.decode(blob, mu, sigma, model, max_output=n - 1)
    with pytest.raises(CorruptDataError, match=f"holds {n} values .*mu has {n - 1}"):
        dist.decode(blob, mu[1:], sigma[1:], model)


# ---- KV blobs: validated before the predictor runs ----------------------------------


class _Counting:
    """A predictor that counts its ``predict`` calls (and otherwise is ``inner``)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def predict(self, ids):
        self.calls += 1
        return self.inner.predict(ids)


@pytest.fixture(scope="module")
def kv():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from entropykit import predictive as P
    from entropykit.warmup import tiny_kv, tiny_llama

    cache, ids, pred, cal = tiny_kv(tiny_llama(vocab=256, layers=2), seed=1, prompts=2,
                                    tokens=12)
    blob = P.compress_kv(cache, ids, pred, cal, model="gaussian")
    assert P.decompress_kv(blob, pred, cal).equal(cache)
    return P, pred, cal, blob


def _claiming(blob: bytes, seq: int, frame_n: bool = False) -> bytes:
    """``blob`` (bf16, batch 1) rewritten to claim ``seq`` tokens: new token ids, the
    header CRC recomputed; with ``frame_n`` each frame's header claims the matching count
    too (its directory still the old one)."""
    head = struct.Struct("<4sBBBBIIIIIIIIH")
    f = list(head.unpack_from(blob, 0))
    layers, batch, heads, old_seq, dim, dlen = f[5], f[6], f[7], f[8], f[9], f[13]
    assert batch == 1 and blob[5] == 1  # bf16: no scales
    f[8] = seq
    front_end = head.size + dlen + 4 * old_seq + 8 * layers
    lengths = blob[front_end - 8 * layers : front_end]
    ids = np.random.default_rng(0).integers(0, 256, seq).astype("<i4").tobytes()
    front = b"".join([head.pack(*f), blob[head.size : head.size + dlen], ids, lengths])
    frames = bytearray(blob[front_end + 4 :])
    if frame_n:
        pos = 0
        n = heads * seq * dim
        for length in np.frombuffer(lengths, "<u4").tolist():
            chunk = struct.unpack_from("<I", frames, pos + 16)[0]
            struct.pack_into("<Q", frames, pos + 8, n)
            struct.pack_into("<I", frames, pos + 20, -(-n // chunk))
            pos += length
    return front + struct.pack("<I", zlib.crc32(front)) + bytes(frames)


@pytest.mark.parametrize("frame_n", [False, True])
def test_kv_blob_claiming_many_tokens_never_runs_the_predictor(kv, frame_n: bool) -> None:
    P, pred, cal, blob = kv
    hostile = _claiming(blob, 20_000, frame_n)
    counting = _Counting(pred)
    assert tuple(P.token_ids(hostile).shape) == (1, 20_000)
    with pytest.raises(CorruptDataError) as err:
        P.decompress_kv(hostile, counting, cal)
    assert counting.calls == 0
    assert str(err.value).startswith("KV blob frame 0 holds 192 " if not frame_n else
                                     "distribution-rANS frame truncated")
    # The blob it came from still decodes, and runs the predictor once.
    P.decompress_kv(blob, counting, cal)
    assert counting.calls == 1


def test_kv_blob_caps(kv) -> None:
    P, pred, cal, blob = kv
    head = struct.Struct("<4sBBBBIIIIIIIIH")
    f = list(head.unpack_from(blob, 0))
    for field, value, what in ((8, P.codec.MAX_TOKENS + 1, "tokens"),
                               (5, P.codec.MAX_LAYERS + 1, "layers"),
                               (7, P.codec.MAX_HEADS + 1, "kv heads"),
                               (9, P.codec.MAX_HEAD_DIM + 1, "head dim")):
        g = list(f)
        g[field] = value
        counting = _Counting(pred)
        with pytest.raises(CorruptDataError, match=f"claims {value} {what}"):
            P.decompress_kv(head.pack(*g) + blob[head.size :], counting, cal)
        assert counting.calls == 0


# ---- kernels: every file-driven index checked -------------------------------------------


def _guarded(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(an output of n bytes, the array it sits in between 64 guard bytes of 0xA5)."""
    whole = np.full(n + 128, 0xA5, np.uint8)
    return whole[64:-64], whole


@pytest.mark.parametrize("name", ["rans", "tans"])
def test_kernels_refuse_extents_outside_their_buffers(name: str) -> None:
    # The chunk kernels read payloads at offsets and lengths taken from a frame and write
    # chunk ranges the driver computes: each is checked against its buffer, and a bad one
    # is an error code, never a read or write outside (the guards stay intact).
    from entropykit.rans import kernels as rk
    from entropykit.tans import kernels as tk

    coder = rans if name == "rans" else tans
    k = rk if name == "rans" else tk
    sym = np.random.default_rng(0).geometric(0.3, 4096).clip(0, 255).astype(np.uint8)
    blob = coder.encode(sym, chunk_size=4096)
    info = frame.parse(coder.static.CODER, blob)
    buf = np.frombuffer(blob, np.uint8)
    tabs = coder.static.CODER.decode_tables(info.freqs[0], info.param)
    start, length = int(info.offsets[0]), int(info.lengths[0])

    def run(starts, lengths, lo, hi, out, table=tabs, ctx=None):
        errors = np.empty(len(starts), np.int64)
        args = (buf, np.array(starts, np.int64), np.array(lengths, np.int64), table,
                info.param, out)
        if name == "rans":
            args += (ctx, None)
        k.decode_chunks(*args, np.array(lo, np.int64), np.array(hi, np.int64), errors)
        return errors.tolist()

    out, whole = _guarded(sym.size)
    assert run([start], [length], [0], [sym.size], out) == [k.OK]
    np.testing.assert_array_equal(out, sym)
    bad_extent = int(Status.ODD) if name == "rans" else tk.ERR_EMPTY
    out, whole = _guarded(sym.size)
    assert run([start, -1, start, buf.size - 8], [length, length, buf.size, 64],
               [0, 0, 0, 0], [sym.size] * 4, out) == [k.OK] + [bad_extent] * 3
    assert run([start] * 3, [length] * 3, [-1, 0, 5], [sym.size, sym.size + 1, 4], out
               ) == [k.ERR_BOUNDS] * 3
    assert run([start], [length], [0], [sym.size], out, table=tabs[..., :-1]) == [k.ERR_TABLE]
    if name == "rans":  # a context naming a table the frame does not have
        ctx = np.zeros(sym.size, np.uint8)
        ctx[-1] = 1
        assert run([start], [length], [0], [sym.size], out, ctx=ctx) == [rk.ERR_CONTEXT]
        assert run([start], [length], [0], [sym.size], out, ctx=ctx[:-1]) == [rk.ERR_CONTEXT]
    assert (whole[:64] == 0xA5).all() and (whole[-64:] == 0xA5).all()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 3000), cols=st.sampled_from([1, 2, 7, 300, 5000, (1 << 20) + 3]),
       phase=st.integers(0, 1 << 21), kr=st.integers(1, 16), kc=st.integers(1, 16),
       seed=st.integers(0, 2**32 - 1))
def test_line_contexts_match_their_definition(n, cols, phase, kr, kc, seed) -> None:
    # Every layout of the contexts (along a row, one per row class, through the column
    # classes) gives row class * kc + column class, mapped, for every symbol.
    phase %= cols
    rng = np.random.default_rng(seed)
    rows = lines.n_rows(n, cols, phase)
    rcls = rng.integers(0, kr, rows).astype(np.uint8) if kr > 1 else None
    ccls = rng.integers(0, kc, cols).astype(np.uint8) if kc > 1 else None
    cmap = rng.integers(0, 256, 256).astype(np.uint8)
    pos = phase + np.arange(n)
    want = ((0 if rcls is None else rcls[pos // cols].astype(np.int64)) * kc
            + (0 if ccls is None else ccls[pos % cols]))
    want = np.broadcast_to(want, (n,)).astype(np.uint8)
    np.testing.assert_array_equal(lines.context(n, cols, phase, rcls, ccls, kc), want)
    np.testing.assert_array_equal(lines.context(n, cols, phase, rcls, ccls, kc, cmap),
                                  cmap[want])
    sym = rng.integers(0, 256, n).astype(np.uint8)
    np.testing.assert_array_equal(lines.context_counts(sym, cols, phase, rcls, ccls, kc),
                                  contexts.joint_histogram(want, sym))


def test_long_row_tensor_round_trip_memory() -> None:
    # A whole [2, 37748736] bf16 tensor (151 MB) through the container: compress and
    # decompress stay within its copies (input, blob, output) plus segments' working
    # memory; rows laid out per segment took over 1.2 GB more.
    got = _child("""
        x = tensor(37748736)
        base = peak()
        same = torch.equal(entropykit.decompress(entropykit.compress(x, threads=1),
                                                 threads=1), x)
        result = {"same": same, "held": x.numel() * 2}
    """, """
        import numpy as np, torch
        import entropykit

        def tensor(cols):
            # Rows of different scales: exponents from a block of each row's statistics,
            # repeated (in uint16 throughout: the child's address space is limited).
            rng = np.random.default_rng(0)
            bits = rng.integers(0, 1 << 7, 2 * cols, dtype=np.uint16)
            for row, (p, low) in enumerate(((0.3, 110), (0.6, 100))):
                block = (rng.geometric(p, 1 << 16) + low).astype(np.uint16) << 7
                bits[row * cols : (row + 1) * cols] |= np.resize(block, cols)
            return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).reshape(2, cols)

        small = tensor(300_000)
        assert torch.equal(entropykit.decompress(entropykit.compress(small, threads=1)), small)
    """, limit=6 << 30)  # torch maps its libraries' address space
    assert got["same"]
    assert got["grew"] < 2.5 * got["held"]
