"""Side-by-side GPU decode benchmark: entropykit, nvCOMP ANS, DFloat11, plain copy.

What it is: the script a GPU machine runs to decode the same
data with every tool in one run and print one table: decoded output GB/s, compression
ratio and whether the round trip is exact. Data sets:
  minilm-bf16  MiniLM-L6 cast to bf16 (the carried compressed file, decoded on the host),
               tiled to >= ``--gib`` GiB of output;
  synth-bf16   ``--synth-gib`` GiB of seeded Gaussian weights in 4096 x 8192 tensors, each
               row with its own scale (lognormal) and each tensor its own spread, cast to
               bf16, so that exponents spread over binades as in real weights;
  minilm-e4m3  the MiniLM bf16 values scaled per tensor onto e4m3's range (bench/data.py's
               rule, applied to the bf16 values) and cast to fp8 e4m3, tiled likewise;
  minilm-e4m3-pairs, minilm-e4m3-ranked (not run by default)  the speed of an fp8 pair
               layout the kernel has no mode for yet, measured with its bf16 build: those
               e4m3 bytes split into one coded byte a pair of values (both 4-bit exponents;
               ranked: both values' groups of eight magnitudes ranked by count in the
               tensor) and one raw byte a pair (both sign + mantissa, or sign + rank in
               the group, nibbles), packed into bf16 words whose exponent field is the
               coded byte and whose sign_mantissa field the raw one, so that one coded
               step writes two output bytes. The output is those words, not the e4m3
               bytes (a pair mode would combine them into two fp8 bytes, the ranked one
               through a 128-byte map), the same number of bytes; an odd last value is
               left out. bench/fp8_pair_ratio.py measures these layouts' ratios.
Tools: entropykit's kernel (exponents rANS-coded, 2^16-symbol chunks; sign_mantissa stored
raw unless coding saves 1 %, as ``compress_file(target="gpu")`` decides, and, on MiniLM,
coded too; staged 16-byte output on and off), nvCOMP's ANS codec through its Python API
(byte mode, and its float16 mode on bf16: the mode nvCOMP names for half-precision data),
DFloat11's decode kernel (its wheel's ``decode.ptx``; data encoded by ``df11_codec.py``,
the vectorized twin of its encoder) and a device-to-device copy of the output.
Timing: entropykit, DFloat11 and copy with CUDA events around each launch (outputs
poisoned before each, untimed), after keeping the GPU busy for ~0.3 s; nvCOMP with the
host clock around ``decode`` + synchronize (its API allocates the output and picks its
stream). Median of ``--reps``. Exact = the last output equals the data bit for bit (and
entropykit's per-chunk status is clean).
What it is not: the kernel's correctness test (device_check.py) or the loader's
(load_check.py).

    python3 gpu/bench_gpu.py --data .gpu-data/load/minilm_bf16.ek.safetensors --out $OUT
    python3 gpu/bench_gpu.py --data ... --profile    (three launches for ncu: staged, not
                                                      staged, other ring-check spacing)
    python3 gpu/bench_gpu.py --df11-selftest         (CPU: df11_codec vs DFloat11's encoder)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import df11_codec  # noqa: E402
from device_check import timed  # noqa: E402 - CUDA-event timing, shared

from entropykit import rans  # noqa: E402
from entropykit.coding import tables  # noqa: E402
from entropykit.rans.cuda import plan  # noqa: E402

DEV = torch.device(os.environ.get("EK_BENCH_DEVICE", "cuda:0"))  # cpu: dry runs of the data
CHUNK = 1 << 16
GPU_MIN_SAVING = 0.01  # container/codecs.py's rule for target="gpu"
POISON = {2: 0x7FA5, 1: 0xA5}


def log(*a) -> None:
    print(*a, flush=True)


# ---------------------------------------------------------------- data


class DataSet:
    """Tensors (host bit arrays: uint16 for bf16 and the fp8 pair sets, uint8 for fp8)
    tiled ``reps`` times."""

    def __init__(self, name: str, tensors: list[np.ndarray], reps: int, what: str) -> None:
        self.name, self.tensors, self.reps, self.what = name, tensors, reps, what
        self.width = tensors[0].dtype.itemsize
        self.values = sum(t.size for t in tensors)
        flat = torch.from_numpy(np.concatenate(tensors).view(
            np.int16 if self.width == 2 else np.uint8))
        self.data = flat.to(DEV).repeat(reps)  # the whole output, as decoders must write it

    @property
    def out_bytes(self) -> int:
        return self.values * self.reps * self.width


def minilm_bf16(path: str) -> list[np.ndarray]:
    import entropykit

    return [v.view(torch.int16).numpy().view(np.uint16).ravel()
            for _, v in sorted(entropykit.load_file(path).items())
            if v.dtype == torch.bfloat16]


def fp8_of(tensors: list[np.ndarray], dtype: torch.dtype) -> list[np.ndarray]:
    """bf16 bit arrays -> fp8 bytes: divide by max|t| / the format's largest finite value
    (finite values), cast."""
    top = float(torch.finfo(dtype).max)
    out = []
    for bits in tensors:
        t = torch.from_numpy(bits.view(np.int16)).to(DEV).view(torch.bfloat16).float()
        fin = t[torch.isfinite(t)]
        s = (fin.abs().max() / top).clamp(min=1e-12) if fin.numel() else torch.tensor(1.0)
        out.append((t / s).to(dtype).view(torch.uint8).cpu().numpy())
    return out


def e4m3_of(tensors: list[np.ndarray]) -> list[np.ndarray]:
    """bf16 bit arrays -> fp8 e4m3 bytes (max |t| onto 448)."""
    return fp8_of(tensors, torch.float8_e4m3fn)


def pair_split(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp8 e4m3 bytes -> (one byte a pair of values: both 4-bit exponents, ``e_a << 4 |
    e_b``; one byte a pair: both sign + mantissa nibbles); an odd last value is left out."""
    n2 = b.size // 2
    exp = (b >> 3) & 0xF
    sm = ((b >> 4) & 0x8) | (b & 0x7)
    return (((exp[0:2 * n2:2] << 4) | exp[1:2 * n2:2]).astype(np.uint8),
            ((sm[0:2 * n2:2] << 4) | sm[1:2 * n2:2]).astype(np.uint8))


def ranked_split(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``pair_split`` with each value's magnitude's count rank in the tensor in place of its
    exponent and mantissa: rank // 8 (a group of eight magnitudes) in the coded nibble,
    sign + rank % 8 in the raw one."""
    counts = np.bincount(b & 0x7F, minlength=128)
    rank = np.empty(128, np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(128)
    return pair_split((((b >> 7) << 7) | rank[b & 0x7F]).astype(np.uint8))


def pairs_as_bf16(fp8: list[np.ndarray], split) -> list[np.ndarray]:
    """Each tensor's ``split`` as bf16 bit words: exponent field the coded byte,
    sign_mantissa field (sign moved below the exponent, as the bf16 build stores it) the raw
    one."""
    out = []
    for b in fp8:
        coded, raw = (a.astype(np.uint16) for a in split(b))
        out.append(((raw >> 7) << 15) | (coded << 7) | (raw & 0x7F))
    return out


def synthetic_bf16(gib: float, seed: int = 0, rows: int = 4096, cols: int = 8192
                   ) -> list[np.ndarray]:
    """Gaussian weights, per-row lognormal scales (sigma 0.3), per-tensor std 0.01-0.04
    (exponent entropy ~2.64 bits a value within a tensor; MiniLM-L6 bf16: 2.66)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    count = max(1, round(gib * 2**30 / (2 * rows * cols)))
    stds = torch.logspace(math.log10(0.01), math.log10(0.04), count)
    out = []
    for k in range(count):
        row = torch.exp(0.3 * torch.randn(rows, 1, device=DEV, generator=g))
        w = torch.randn(rows, cols, device=DEV, generator=g) * row * float(stds[k])
        out.append(w.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16).ravel())
    return out


# ---------------------------------------------------------------- timing


def host_timed(fn, reps: int, warm: int = 2) -> list[float]:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return ts


ROWS: list[dict] = []


def row(ds: DataSet, tool: str, ratio: float | None, times: list[float] | None,
        exact: bool | None, **extra) -> None:
    r = {"set": ds.name, "tool": tool, "ratio": ratio, "exact": exact, **extra}
    if times:
        med = statistics.median(times)
        r.update(ms=med * 1e3, gbps=ds.out_bytes / med / 1e9,
                 spread_ms=(max(times) - min(times)) * 1e3)
    ROWS.append(r)
    log(json.dumps(r))


def attempt(ds: DataSet, tool: str, fn, *args) -> None:
    """``fn(*args)``; a failure becomes a row of the table, not the end of the run (so one
    peer's trouble leaves the others' numbers)."""
    try:
        fn(*args)
    except Exception as e:  # reported in the table
        import traceback

        traceback.print_exc()
        row(ds, tool, None, None, None, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- tools


def bench_copy(ds: DataSet, reps: int) -> None:
    dst = torch.empty_like(ds.data)
    ts = timed(lambda: None, lambda: dst.copy_(ds.data), reps)
    row(ds, "device-to-device copy", None, ts, bool(torch.equal(dst, ds.data)))


def _coded_pays(sym: np.ndarray) -> bool:
    """container/codecs.py's GPU rule on the order-0 estimate: code if it saves 1 %."""
    bits = tables.entropy_bits(np.bincount(sym, minlength=256))
    return bits / 8 + 128 * -(-sym.size // CHUNK) <= (1 - GPU_MIN_SAVING) * sym.size



def batch_of(per: list, ds: DataSet, warps: int = plan.WARPS) -> plan.Batch:
    """One launch's plan of a data set's streams (``ek_streams``), tiled ``ds.reps`` times."""
    p = plan.Planner(ds.width == 2, warps)
    for r in range(ds.reps):
        for k, streams in enumerate(per):
            place = plan.Place(r * len(per) + k)
            if ds.width == 2:
                p.add_pair(*streams, place)
            else:
                p.add(streams[0], place)
    return p.finish([t.size for t in ds.tensors] * ds.reps)

def ek_streams(ds: DataSet, sm_rule: str) -> tuple[list, int, str]:
    """Per tensor the streams entropykit's kernel decodes, their stored bytes, a note.
    ``sm_rule`` for two-byte sets' sign_mantissa: "gpu" (coded where that saves 1 %),
    "coded" or "raw"."""
    t0 = time.perf_counter()
    per, stored, coded_sm = [], 0, 0
    for k, bits in enumerate(ds.tensors):
        if ds.width == 1:
            f = rans.encode(bits, chunk_size=CHUNK)
            if len(f) > 0.99 * bits.size:
                s = plan.Stream.plain(bits, f"tensor {k}")
                stored += bits.size
            else:
                s = plan.Stream.frame(f, f"tensor {k}")
                stored += len(f)
            per.append((s,))
            continue
        exp = ((bits >> 7) & 0xFF).astype(np.uint8)
        sm = (((bits >> 15) << 7) | (bits & 0x7F)).astype(np.uint8)
        ef = rans.encode(exp, chunk_size=CHUNK)
        es = plan.Stream.frame(ef, f"exponent {k}")
        stored += len(ef)
        if sm_rule == "coded" or (sm_rule == "gpu" and _coded_pays(sm)):
            sf = rans.encode(sm, chunk_size=CHUNK)
            ss = plan.Stream.frame(sf, f"sign_mantissa {k}")
            stored += len(sf)
            coded_sm += 1
        else:
            ss = plan.Stream.plain(sm, f"sign_mantissa {k}")
            stored += sm.size
        per.append((es, ss))
    note = (f"sm coded in {coded_sm}/{len(ds.tensors)} tensors" if ds.width == 2 else "")
    log(f"  {ds.name} {sm_rule}: encoded in {time.perf_counter() - t0:.1f} s, {note}")
    return per, stored, note


def bench_entropykit(ds: DataSet, sm_rule: str, reps: int) -> None:
    from entropykit.gpu import upload

    per, stored, note = ek_streams(ds, sm_rule)
    ratio = stored / (ds.values * ds.width)
    t0 = time.perf_counter()
    batch = batch_of(per, ds)
    db = upload(batch, DEV)
    t_plan = time.perf_counter() - t0
    arena = torch.empty_like(ds.data)
    outs = list(torch.split(arena, [t.size for t in ds.tensors] * ds.reps))
    poison = POISON[ds.width]

    def fill() -> None:
        arena.fill_(poison)

    launch = db.bind(outs)
    ts = timed(fill, launch, reps)
    db.check()  # raises on a bad chunk status
    exact = bool(torch.equal(arena, ds.data))
    k = launch.kernel
    label = "entropykit" if ds.width == 1 else f"entropykit (sm {sm_rule})"
    row(ds, label, ratio, ts, exact, note=note, regs=getattr(k, "num_regs", None),
        plan_upload_s=round(t_plan, 2), pairs=len(batch.desc) // 2)


def bench_nvcomp(ds: DataSet, reps: int) -> None:
    from nvidia import nvcomp

    raw = ds.data.view(torch.uint8)
    arr = nvcomp.as_array(raw)
    modes = [("ANS", {})] + ([("ANS", {"data_type": "<f2"})] if ds.width == 2 else [])

    def one(algo: str, opts: dict, label: str) -> None:
        codec = nvcomp.Codec(algorithm=algo, **opts)
        comp = codec.encode(arr)
        torch.cuda.synchronize()
        ratio = comp.buffer_size / raw.numel()
        dec = codec.decode(comp)
        torch.cuda.synchronize()
        back = torch.from_dlpack(dec).view(torch.uint8).reshape(-1)
        exact = back.numel() == raw.numel() and bool(torch.equal(back, raw))
        del back, dec
        ts = host_timed(lambda: codec.decode(comp), reps)
        row(ds, label, ratio, ts, exact)

    for algo, opts in modes:
        label = f"nvCOMP {algo}" + (" (float16 mode)" if opts else " (byte mode)")
        attempt(ds, label, one, algo, opts, label)


def bench_df11(ds: DataSet, reps: int, part_values: int = 1 << 29) -> None:
    """DFloat11 on the same bf16 values: one code over the set, parts of <= 2^29 values
    (its kernel counts in 32 bits), each part one launch of its kernel, all timed together."""
    data = ds.data
    exp = ((data >> 7) & 0xFF).to(torch.uint8)
    t0 = time.perf_counter()
    code = df11_codec.build_code(exp)
    other = df11_codec.other_bits(data)
    out = torch.empty_like(data)
    kernels = []
    n = data.numel()
    parts = -(-n // part_values)
    cut = -(-n // parts)
    for a in range(0, n, cut):
        b = min(n, a + cut)
        enc, gaps, pos = df11_codec.encode(exp[a:b], code)
        kernels.append(df11_codec.Kernel(code, enc, gaps, pos, other[a:b], out[a:b]))
    torch.cuda.synchronize()
    log(f"  {ds.name} DFloat11: encoded {parts} part(s) in {time.perf_counter() - t0:.1f} s")
    del exp
    stored = sum(k.stored for k in kernels) - (len(kernels) - 1) * code.luts.numel()

    def run() -> None:
        for k in kernels:
            k()

    def fill() -> None:
        out.fill_(POISON[2])

    ts = timed(fill, run, reps)
    row(ds, "DFloat11 kernel", stored / (2 * n), ts, bool(torch.equal(out, data)),
        parts=parts)


# ---------------------------------------------------------------- main


def versions() -> dict:
    out = {"date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M")}
    for name in ("torch", "cupy", "nvidia.nvcomp", "numpy"):
        try:
            m = __import__(name, fromlist=["x"])
            out[name] = getattr(m, "__version__", "?")
        except Exception as e:
            out[name] = f"missing ({type(e).__name__})"
    p = torch.cuda.get_device_properties(DEV)
    out.update(gpu=p.name, sms=p.multi_processor_count,
               l2_mb=getattr(p, "L2_cache_size", 0) / 2**20,
               cuda_runtime=torch.version.cuda)
    return out


def table(meta: dict) -> str:
    lines = [f"{meta['gpu']}, {meta['date_utc']} UTC, torch {meta['torch']}, "
             f"cupy {meta['cupy']}, nvcomp {meta['nvidia.nvcomp']}", "",
             "| data | tool | ratio | ms | GB/s | × copy | of bound | exact |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    copies = {r["set"]: r.get("gbps") for r in ROWS if r["tool"].startswith("device")}
    for r in ROWS:
        if "error" in r:
            lines.append(f"| {r['set']} | {r['tool']} | | | | | FAILED: {r['error'][:80]} |")
            continue
        ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "—"
        copy = copies.get(r["set"]) or float("nan")
        # A decoder reads ratio x output and writes the output: at the copy's read+write
        # bandwidth (2 x copy GB/s of output) it cannot beat 2 copy / (1 + ratio).
        bound = f"{r['gbps'] / (2 * copy / (1 + r['ratio'])):.2f}" if r["ratio"] else ""
        lines.append(f"| {r['set']} | {r['tool']} | {ratio} | {r['ms']:.3f} | "
                     f"{r['gbps']:,.0f} | {r['gbps'] / copy:.2f} | {bound} | "
                     f"{'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)


def selftest() -> None:
    """CPU: df11_codec.encode equals DFloat11's own encoder on small seeded inputs."""
    U = df11_codec.utils_module()
    import contextlib
    import io

    for seed, n in [(0, 200_003), (1, 5000), (2, 70_001)]:
        g = torch.Generator().manual_seed(seed)
        w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        exp = ((w.view(torch.int16) >> 7) & 0xFF).to(torch.uint8)
        code = df11_codec.build_code(exp)
        codec, counter = U.get_codec(w)
        codec, _, _ = U.get_32bit_codec(counter)
        with contextlib.redirect_stderr(io.StringIO()):
            ref = U.encode(exp.tolist(), codec, 8, 512)
        got = df11_codec.encode(exp, code, slice_len=1 << 14)
        same = [np.array_equal(np.asarray(a).astype(np.int64), b.numpy().astype(np.int64))
                for a, b in zip(ref, got, strict=True)]
        log(f"n={n}: encoded, gaps, positions equal: {same}")
        if not all(same):
            raise SystemExit("df11_codec differs from DFloat11's encoder")


def profile(args) -> None:
    """A checked launch of the MiniLM batch, for ncu."""
    from entropykit.gpu import upload

    ds = DataSet("minilm-bf16", minilm_bf16(args.data), args.profile_reps, "")
    per, _, _ = ek_streams(ds, "gpu")
    sizes = [t.size for t in ds.tensors] * ds.reps
    db = upload(batch_of(per, ds), DEV)
    arena = torch.empty_like(ds.data)
    arena.fill_(POISON[2])
    db.bind(list(torch.split(arena, sizes)))()
    db.check()
    log(f"exact {bool(torch.equal(arena, ds.data))}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", help="compressed MiniLM bf16 .safetensors (entropykit); "
                    "without it only the synthetic set runs")
    ap.add_argument("--gib", type=float, default=1.0, help="MiniLM sets tiled to this")
    ap.add_argument("--synth-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sets", default="minilm-bf16,synth-bf16,minilm-e4m3")
    ap.add_argument("--tools", default="copy,entropykit,nvcomp,df11")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-reps", type=int, default=24)
    ap.add_argument("--df11-selftest", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.df11_selftest:
        selftest()
        return
    if args.profile:
        profile(args)
        return
    meta = versions()
    log(json.dumps(meta))
    tools = set(args.tools.split(","))
    names = args.sets.split(",")
    if not args.data:  # the MiniLM sets need the carried file; the synthetic set does not
        log("no --data: MiniLM sets left out")
        names = [n for n in names if not n.startswith("minilm")]
    base = minilm_bf16(args.data) if args.data else []
    n_base = sum(t.size for t in base)
    tile = math.ceil(args.gib * 2**30 / max(1, n_base))  # fp8 tiles; bf16 half as many
    builders = {
        "minilm-bf16": lambda: DataSet("minilm-bf16", base, -(-tile // 2),
                                       "MiniLM-L6 bf16, tiled"),
        "synth-bf16": lambda: DataSet("synth-bf16", synthetic_bf16(args.synth_gib), 1,
                                      "synthetic Gaussian bf16, per-row scales"),
        "minilm-e4m3": lambda: DataSet("minilm-e4m3", e4m3_of(base), tile,
                                       "MiniLM-L6 e4m3 (scaled per tensor), tiled"),
        "minilm-e4m3-pairs": lambda: DataSet(
            "minilm-e4m3-pairs", pairs_as_bf16(e4m3_of(base), pair_split), tile,
            "MiniLM-L6 e4m3 as exponent pairs + raw nibble pairs (bf16 build), tiled"),
        "minilm-e4m3-ranked": lambda: DataSet(
            "minilm-e4m3-ranked", pairs_as_bf16(e4m3_of(base), ranked_split), tile,
            "MiniLM-L6 e4m3 as ranked-group pairs + raw nibble pairs (bf16 build), tiled"),
    }
    sets_meta = {}
    for name in names:
        t0 = time.perf_counter()
        ds = builders[name]()
        sets_meta[name] = dict(tensors=len(ds.tensors), values=ds.values, reps=ds.reps,
                               out_gib=ds.out_bytes / 2**30, what=ds.what)
        log(f"== {name}: {len(ds.tensors)} tensors x{ds.reps} = {ds.out_bytes / 2**30:.2f} GiB "
            f"({time.perf_counter() - t0:.1f} s to build)")
        if "copy" in tools:
            attempt(ds, "device-to-device copy", bench_copy, ds, args.reps)
        if "entropykit" in tools:
            # The pair sets' raw bytes stay raw (their layout), whatever they would save.
            sm_rule = "raw" if name.startswith("minilm-e4m3-") else "gpu"
            attempt(ds, "entropykit", bench_entropykit, ds, sm_rule, args.reps)
            if name == "minilm-bf16":
                attempt(ds, "entropykit", bench_entropykit, ds, "coded", args.reps)
        if "nvcomp" in tools:
            attempt(ds, "nvCOMP", bench_nvcomp, ds, args.reps)
        if "df11" in tools and ds.width == 2 and "e4m3" not in name:
            attempt(ds, "DFloat11 kernel", bench_df11, ds, args.reps)
        del ds
        gc.collect()
        torch.cuda.empty_cache()
    res = {"meta": meta, "sets": sets_meta, "rows": ROWS}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_gpu.json").write_text(json.dumps(res, indent=1))
    md = table(meta)
    (Path(args.out) / "bench_gpu.md").write_text(md + "\n")
    log("\n" + md)
    bad = [r for r in ROWS if r.get("exact") is False or "error" in r]
    if bad:
        log(f"\n{len(bad)} row(s) not exact or failed: " + "; ".join(
            f"{r['set']}/{r['tool']}" for r in bad))


if __name__ == "__main__":
    main()
