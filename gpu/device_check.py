"""Device-side test and benchmark of entropykit.gpu on real bf16 weights.

What it is: the script a GPU machine runs. It encodes real bf16
weights with the CPU coder, checks the CPU decoder restores them, tiles the tensors to
>= 1 GiB of bf16 output on the device, and for each variant poisons the outputs, decodes,
checks every bit against the CPU decoder's output and the kernel's status, and times the
decode with CUDA events (median of several runs). Last it prints one table; full numbers
go to ``--out``/results.json.

Variants: frame configurations (chunk size; sign_mantissa with one table, with context
tables, or stored raw), warps per block (the warps of a block share one table set in
shared memory), the uint8 mode on the same fields, and a plain device-to-device copy; each
build's registers and resident warps per SM are printed. Corrupt frames are checked to
raise the CPU decoder's error.

What it is not: a CPU test (tests/test_gpu_logic.py) or a peer benchmark.

The data: an .npz of bf16 bit arrays (``--make-data`` writes one from a model, 36 MB), or
a compressed bf16 safetensors file (``--data x.ek.safetensors``: its tensors, decoded on
the CPU, 29 MB for MiniLM), in a git-ignored folder. There (through ``device``, carrying
that folder and .whl; the image lacks zstandard, which entropykit imports, so carry its
cp312 wheel in .whl and pip-install it to /tmp/site):
    python3 gpu/device_check.py --data .gpu-data/load/minilm_bf16.ek.safetensors --out $OUT
    ncu ... python3 gpu/device_check.py --data ... --once    (one checked launch to profile)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from entropykit import CorruptDataError, rans  # noqa: E402
from entropykit._status import Status  # noqa: E402
from entropykit.coding import frame as fr  # noqa: E402
from entropykit.gpu import decode_bf16, upload  # noqa: E402
from entropykit.rans.cuda import plan  # noqa: E402
from entropykit.rans.kernels import MESSAGES  # noqa: E402
from entropykit.rans.static import CODER  # noqa: E402

POISON_BF16 = 0x7FA5  # a NaN payload no weight here has
POISON_U8 = 0xA5


def log(*a) -> None:
    print(*a, flush=True)


def fields(bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    exp = ((bits >> 7) & 0xFF).astype(np.uint8)
    sm = (((bits >> 15) << 7) | (bits & 0x7F)).astype(np.uint8)
    return exp, sm


def specials(n: int, seed: int = 0) -> np.ndarray:
    """A synthetic tensor sprinkled with NaN payloads, +-0, +-inf and subnormals."""
    rng = np.random.default_rng(seed)
    bits = ((rng.standard_normal(n).astype(np.float32) * 0.02).view(np.uint32) >> 16)
    bits = bits.astype(np.uint16)
    sp = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F],
                  np.uint16)
    at = rng.choice(n, size=n // 50, replace=False)
    bits[at] = np.resize(sp, at.size)
    return bits


def all_raw(fb: bytes, symbols: np.ndarray) -> bytes:
    """``fb`` re-stored with every chunk raw (what a container keeping sm raw would write)."""
    info = fr.parse(CODER, fb)
    count = len(info.lengths)
    dir_at = int(info.offsets[0]) - 9 * count
    first = np.arange(count) * info.chunk_size
    lengths = np.minimum(info.chunk_size, info.n - first).astype("<u4")
    return b"".join([fb[:dir_at], lengths.tobytes(), info.crcs.tobytes(),
                     np.ones(count, np.uint8).tobytes(), symbols.tobytes()])


def encode_config(tensors, chunk: int, sm_kind: str):
    """Per tensor (exp frame, sm frame); checks the CPU decoder restores every bit."""
    efs, sfs = [], []
    for bits in tensors:
        exp, sm = fields(bits)
        ef = rans.encode(exp, chunk_size=chunk)
        if sm_kind == "ctx":
            sf = rans.encode(sm, chunk_size=chunk, context=exp)
        else:
            sf = rans.encode(sm, chunk_size=chunk)
            if sm_kind == "raw":
                sf = all_raw(sf, sm)
        de = rans.decode(ef)
        ds = rans.decode(sf, context=de)
        back = ((ds.astype(np.uint16) >> 7) << 15) | (de.astype(np.uint16) << 7) | (ds & 0x7F)
        if not np.array_equal(back, bits):
            raise SystemExit(f"CPU decoder does not restore the weights ({chunk}, {sm_kind})")
        efs.append(ef)
        sfs.append(sf)
    return efs, sfs


def timed(before, fn, reps: int, warm_s: float = 0.3) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn`` by CUDA events, ``before`` (untimed) ahead
    of each. The GPU first runs ``fn`` back to back for ``warm_s`` and nothing waits on the
    host between runs: an idle gap lets the SM clock fall, and a few ms kernel would then be
    timed at a fraction of its clock."""
    t = time.perf_counter()
    while time.perf_counter() - t < warm_s:
        for _ in range(10):
            before()
            fn()
        torch.cuda.synchronize()
    events = []
    for _ in range(reps):
        before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in events]


def rebuild(fb: bytes, chunk: int, payload: bytes) -> bytes:
    """``fb`` with chunk ``chunk``'s payload (and its directory length) replaced."""
    info = fr.parse(CODER, fb)
    count = len(info.lengths)
    dir_at = int(info.offsets[0]) - 9 * count
    lengths = info.lengths.astype("<u4")
    lengths[chunk] = len(payload)
    parts = [fb[:dir_at], lengths.tobytes(), info.crcs.tobytes(), info.modes.tobytes()]
    for c in range(count):
        a = int(info.offsets[c])
        parts.append(payload if c == chunk else fb[a : a + int(info.lengths[c])])
    return b"".join(parts)


def corruption_checks(ef: bytes, sf: bytes, n: int, dev) -> list[dict]:
    """Damaged sign_mantissa frames must raise the CPU decoder's error, naming the chunk
    (where the damage fixes it, the error of that status)."""
    info = fr.parse(CODER, sf)
    c = int(np.flatnonzero(info.modes == 0)[0])
    a, ln = int(info.offsets[c]), int(info.lengths[c])
    good = bytearray(sf[a : a + ln])
    low = bytearray(good)
    low[0:4] = (1234).to_bytes(4, "little")
    flip = bytearray(good)
    flip[200] ^= 0x08
    cases = {"start state": (bytes(low), Status.STATE), "flipped word": (bytes(flip), None),
             "words left over": (bytes(good) + b"\x00\x01", Status.TRAILING),
             "words missing": (bytes(good)[:-2], Status.TRUNCATED)}
    rows = []
    for name, (payload, status) in cases.items():
        bad = rebuild(sf, c, payload)
        try:
            rans.decode(bad, context=rans.decode(ef))
            cpu = "no error"
        except CorruptDataError as e:
            cpu = str(e).split(": ", 1)[1]
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        try:
            decode_bf16(ef, bad, out)
            got = "no error"
        except CorruptDataError as e:
            got = str(e)
        ok = (got.startswith(f"sign_mantissa frame 0 chunk {c} ") and got.endswith(cpu)
              and (status is None or cpu == MESSAGES[status]))
        rows.append({"case": name, "cpu": cpu, "gpu": got, "ok": ok})
        log(json.dumps(rows[-1]))
    return rows


def make_data(src: str, dst: str) -> None:
    """Every floating tensor of ``src`` cast to bf16, as uint16 bit arrays in an .npz."""
    import ml_dtypes
    from safetensors.numpy import load_file

    tensors = {k: v.astype(ml_dtypes.bfloat16).view(np.uint16).ravel()
               for k, v in load_file(src).items() if v.dtype.kind == "f"}
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(dst, **tensors)
    log(f"{len(tensors)} tensors, {sum(t.size for t in tensors.values())} values -> {dst}")


def read_data(path: str) -> dict[str, np.ndarray]:
    """bf16 bit arrays (uint16) by name, from an .npz or a compressed safetensors file."""
    if path.endswith(".npz"):
        data = np.load(path)
        return {k: data[k] for k in data.files}
    import entropykit

    return {k: v.view(torch.int16).numpy().view(np.uint16).ravel()
            for k, v in entropykit.load_file(path).items() if v.dtype == torch.bfloat16}


def occupancy(launch) -> dict:
    """Registers a thread and resident warps per SM of a bound launch's kernel build."""
    k = launch.kernel
    row = {"regs": k.num_regs, "smem_block": launch.shared, "warps_block": launch.block[0] // 32}
    try:
        from cupy.cuda import driver

        blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(
            k.kernel.ptr, launch.block[0], launch.shared)
        row["warps_sm"] = blocks * launch.block[0] // 32
    except Exception as e:  # an older CuPy: the registers still say most of it
        row["warps_sm"] = f"n/a ({type(e).__name__})"
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True,
                    help=".npz of uint16 bf16 bit arrays, one a tensor, or a compressed "
                         "bf16 .safetensors file")
    ap.add_argument("--warps", type=int, default=plan.WARPS, help="warps per block")
    ap.add_argument("--all", action="store_true",
                    help="also chunks of 2^18 and 1 warp a block (tables per warp)")
    ap.add_argument("--gib", type=float, default=1.0, help="bf16 output to tile up to")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--limit", type=int, default=0, help="use only the N smallest tensors")
    ap.add_argument("--make-data", metavar="SAFETENSORS",
                    help="write --data from this model's floating tensors and exit (CPU)")
    ap.add_argument("--once", action="store_true",
                    help="one checked launch (chunk 2^16), for a profiler")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.make_data:
        make_data(args.make_data, args.data)
        return
    dev = torch.device("cuda", 0)
    import cupy

    p = torch.cuda.get_device_properties(dev)
    res: dict = {"date": _dt.date.today().isoformat(), "torch": torch.__version__,
                 "cupy": cupy.__version__, "gpu": p.name, "sms": p.multi_processor_count,
                 "l2_mb": getattr(p, "L2_cache_size", 0) / 2**20}
    log(json.dumps(res))

    data = read_data(args.data)
    names = sorted(data)
    if args.limit:
        names = sorted(names, key=lambda k: (data[k].size, k))[: args.limit]
    tensors = [data[k].ravel() for k in names] + [specials(100_003)]
    n_vals = sum(t.size for t in tensors)
    reps = max(1, math.ceil(args.gib * 2**30 / (2 * n_vals)))
    res.update(tensors=len(tensors), values=n_vals, tiles=reps, out_bytes=2 * n_vals * reps)
    log(f"{len(tensors)} tensors, {n_vals} values, x{reps} tiles = "
        f"{2 * n_vals * reps / 2**30:.3f} GiB bf16 output")
    bits_all = np.concatenate(tensors)
    expect16 = torch.from_numpy(bits_all.view(np.int16)).to(dev).repeat(reps)
    arena = torch.empty_like(expect16)
    rows = []

    def bench(label: str, fn, arena_t, expect_t, poison, status=None) -> None:
        bad = []

        def check() -> None:
            if status is not None:
                status()
            if not torch.equal(arena_t, expect_t):
                wrong = int((arena_t != expect_t).sum())
                bad.append(wrong)

        try:
            fn()  # compiles
            torch.cuda.synchronize()
            times = timed(lambda: arena_t.fill_(poison), fn, args.reps)
            clock = torch.cuda.clock_rate(dev)  # MHz, read right after the timed runs
            check()  # the last run's output, poisoned before it ran
        except Exception as e:  # a variant that fails is reported, not fatal
            log(f"{label}: FAILED {type(e).__name__}: {e}")
            rows.append({"variant": label, "error": f"{type(e).__name__}: {e}"})
            return
        med = statistics.median(times)
        out_bytes = arena_t.numel() * arena_t.element_size()
        row = {"variant": label, "ms": med * 1e3, "gbps": out_bytes / med / 1e9,
               "spread_ms": (max(times) - min(times)) * 1e3, "exact": not bad,
               "wrong_values": bad[:3], "sm_mhz": clock}
        rows.append(row)
        log(json.dumps(row))

    if args.once:
        efs, sfs = encode_config(tensors, 1 << 16, "one")
        dbatch = upload(plan.prepare_bf16(efs * reps, sfs * reps, args.warps), dev)
        arena.fill_(POISON_BF16)
        dbatch.decode(list(torch.split(arena, [t.size for t in tensors] * reps)))
        log(f"one launch, bit-exact: {torch.equal(arena, expect16)}")
        return
    copy_dst = torch.empty_like(expect16)
    bench("device-to-device copy", partial(copy_dst.copy_, expect16), copy_dst, expect16,
          POISON_BF16)
    del copy_dst

    w0 = args.warps
    configs = [(1 << 16, "one", sorted({4, w0, 16})), (1 << 16, "ctx", [w0]),
               (1 << 16, "raw", sorted({w0, 16}))]
    if args.all:
        configs = [(1 << 18, "one", [w0]), (1 << 16, "one", sorted({1, 4, w0, 16})),
                   *configs[1:]]
    for chunk, sm_kind, warps_list in configs:
        t = time.perf_counter()
        efs, sfs = encode_config(tensors, chunk, sm_kind)
        comp = sum(map(len, efs)) + sum(map(len, sfs))
        ratio = comp / (2 * n_vals)
        tag = f"chunk 2^{chunk.bit_length() - 1}, sm {sm_kind}, ratio {ratio:.4f}"
        log(f"{tag}: encoded + CPU-checked in {time.perf_counter() - t:.1f} s")
        outs = list(torch.split(arena, [t.size for t in tensors] * reps))
        for w in warps_list:
            t = time.perf_counter()
            batch = plan.prepare_bf16(efs * reps, sfs * reps, w)
            dbatch = upload(batch, dev)
            log(f"  warps {w}: host plan + upload {time.perf_counter() - t:.1f} s, "
                f"{len(batch.desc) // 2} warps ({int((batch.desc[:, 3] > 0).sum()) // 2} "
                f"live), payload {batch.payload_size / 2**20:.0f} MiB")
            t = time.perf_counter()
            launch = dbatch.bind(outs)
            res.setdefault("bind_ms", (time.perf_counter() - t) * 1e3)
            occ = occupancy(launch)
            bench(f"w {w} | {tag}", launch, arena, expect16, POISON_BF16, dbatch.check)
            rows[-1].update(occ)
            log(f"    {occ}")
            del dbatch, batch
        if chunk == 1 << 16 and sm_kind == "one":
            u8_frames = efs * reps + sfs * reps
            ub = upload(plan.prepare_u8(u8_frames, w0), dev)
            exp_all, sm_all = fields(bits_all)
            expect8 = torch.cat([torch.from_numpy(exp_all).to(dev).repeat(reps),
                                 torch.from_numpy(sm_all).to(dev).repeat(reps)])
            arena8 = torch.empty_like(expect8)
            outs8 = list(torch.split(arena8, [t.size for t in tensors] * reps * 2))
            bench(f"u8 mode w {w0} | {tag}", ub.bind(outs8), arena8, expect8, POISON_U8,
                  ub.check)
            del ub, arena8, expect8
            big = int(np.argmax([t.size for t in tensors]))
            res["corruption"] = corruption_checks(efs[big], sfs[big], tensors[big].size, dev)
    res["rows"] = rows
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(res, indent=1))
    copy = next((r for r in rows if r["variant"].startswith("device-to-device")), None)
    log(f"\n{res['gpu']}  {res['date']}  output {res['out_bytes'] / 2**30:.2f} GiB; "
        f"binding {res['tiles'] * len(tensors)} outputs took {res['bind_ms']:.1f} ms (host)")
    log(f"{'variant':72s} {'ms':>8s} {'GB/s':>8s} {'x copy':>7s} {'MHz':>5s} {'regs':>4s} "
        f"{'w/SM':>4s} exact")
    for r in rows:
        if "error" in r:
            log(f"{r['variant']:72s} FAILED")
            continue
        vs = r["gbps"] / copy["gbps"] if copy else float("nan")
        log(f"{r['variant']:72s} {r['ms']:8.3f} {r['gbps']:8.1f} {vs:7.2f} {r['sm_mhz']:5d} "
            f"{r.get('regs', ''):>4} {r.get('warps_sm', ''):>4} {r['exact']}")
    for r in res.get("corruption", []):
        log(f"corrupt sign_mantissa, {r['case']}: {'ok' if r['ok'] else 'WRONG'} ({r['gpu']})")
    if any(not r.get("exact", False) for r in rows) or not all(
            r["ok"] for r in res.get("corruption", [{"ok": False}])):
        raise SystemExit("some variant was not bit-exact, failed, or missed corruption")


if __name__ == "__main__":
    main()
