"""rANS decode against a plain 32-lane loop, compiled for AVX-512 and for AVX2, in one run.

What it is: a micro-benchmark of the static rANS decode kernel (``rans.kernels``) on the
same payloads as a plain Numba loop that decodes the same format lane by lane (the scalar
path every lane-interleaved rANS decoder starts from). Each ISA runs in its own process
with its own Numba cache: the host's, an AVX2-only target (``NUMBA_CPU_NAME`` =
``--avx2-cpu``, ``NUMBA_CPU_FEATURES`` = the host's with every AVX-512 feature off) and,
on request, the host's without AVX-512 VBMI2; each reports what the decode kernel's
assembly holds (``zmm`` and mask-register operands, gathers, expands), so the emulation
can be checked. ``--write`` replaces the "## rANS decode, AVX2 and AVX-512" section of
bench/RESULTS.md.
What it is not: a frame or file benchmark (``bench_coders.py``, ``bench_weights.py``).

    python bench/rans_isa.py [--mib 4] [--precision 12] [--reps 7] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results as results_md  # noqa: E402 - bench/ is a folder of scripts, not a package

SECTION = "## rANS decode, AVX2 and AVX-512"
CACHE = Path(os.environ.get("ENTROPYKIT_BENCH_CACHE",
                            Path(__file__).resolve().parent.parent / ".bench-cache"))
_AVX512 = re.compile(r"^\+(avx512|avx10|amx)")


# ---------------------------------------------------------------- data


def _bf16_bits(n: int, seed: int) -> np.ndarray:
    import ml_dtypes

    w = np.random.default_rng(seed).normal(0.0, 0.02, n).astype(ml_dtypes.bfloat16)
    return w.view(np.uint16)


def _laplace(n: int, seed: int) -> np.ndarray:
    q = np.rint(np.random.default_rng(seed).laplace(0.0, 1.0, n)).astype(np.int64)
    return np.minimum(np.where(q >= 0, 2 * q, -2 * q - 1), 255).astype(np.uint8)


def _fp8(n: int, seed: int) -> np.ndarray:
    import ml_dtypes

    w = np.random.default_rng(seed).normal(0.0, 30.0, n).astype(ml_dtypes.float8_e4m3fn)
    return w.view(np.uint8)


DATA = {
    "bf16 exponent": lambda n, s: ((_bf16_bits(n, s) >> 7) & 0xFF).astype(np.uint8),
    "bf16 sign+mantissa": lambda n, s: (((_bf16_bits(n, s) >> 8) & 0x80)
                                        | (_bf16_bits(n, s) & 0x7F)).astype(np.uint8),
    "fp8 e4m3": _fp8,
    "Laplace(1)": _laplace,
}


# ---------------------------------------------------------------- the plain loop


def _plain():
    from numba import njit

    from entropykit.rans.kernels import LANES, STATE_BYTES, L

    @njit(nogil=True, cache=True)
    def plain_decode(buf, start, length, table, precision, out):
        """One chunk, lane by lane: the format's definition as a loop (kernels docstring)."""
        x = np.empty(LANES, np.uint32)
        for lane in range(LANES):
            o = start + 4 * lane
            x[lane] = (np.uint32(buf[o]) | (np.uint32(buf[o + 1]) << 8)
                       | (np.uint32(buf[o + 2]) << 16) | (np.uint32(buf[o + 3]) << 24))
        ptr = start + STATE_BYTES
        end = start + length
        mask = (1 << precision) - 1
        n = out.size
        for base in range(0, n, LANES):
            for lane in range(min(LANES, n - base)):
                xs = x[lane]
                e = table[0, xs & mask]
                out[base + lane] = np.uint8(e >> 32)
                xs = np.uint32((e >> 16) & 0xFFFF) * (xs >> precision) + np.uint32(e & 0xFFFF)
                if xs < L:
                    if ptr + 2 > end:
                        return -1
                    xs = (xs << 16) | np.uint32(buf[ptr]) | (np.uint32(buf[ptr + 1]) << 8)
                    ptr += 2
                x[lane] = xs
        return 0 if ptr == end else -1

    return plain_decode


# ---------------------------------------------------------------- one ISA (child process)


def _best(fn, reps: int) -> float:
    """Least CPU time of this thread over ``reps`` runs (other processes' slices excluded)."""
    times = []
    for _ in range(reps):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return min(times)


def _asm_check(args: tuple) -> dict:
    """What the decode kernel compiles to for ``args``: a fresh, uncached build (Numba
    cannot show the assembly of a kernel it loaded from its cache)."""
    from numba import njit

    from entropykit.rans import kernels

    fresh = njit(nogil=True)(kernels.decode_chunks.py_func)
    fresh(*args)
    asm = "\n".join(fresh.inspect_asm().values())
    return {"zmm": len(re.findall(r"%zmm\d", asm)),
            "kmask": len(re.findall(r"%k[1-7]\b", asm)),
            "gathers": len(re.findall(r"\bvp?gather", asm)),
            "expands": len(re.findall(r"\bvp?expand", asm))}


def _one(sym: np.ndarray, precision: int, reps: int, plain) -> dict:
    """Encode ``sym`` in frame-sized chunks; time the kernel and the plain loop on them."""
    from entropykit.coding import frame, tables
    from entropykit.rans import kernels

    n, chunk, g = sym.size, frame.DEFAULT_CHUNK, frame.DECODE_GROUP
    freqs = tables.quantize(tables.histogram(sym), precision)
    enc = kernels.encode_tables(freqs, precision)
    dec = kernels.decode_table(freqs, precision)
    payloads = []
    for lo in range(0, n, chunk):
        out = np.empty(chunk + 4096, np.uint8)
        s = kernels.encode_chunk(sym[lo:lo + chunk], enc, precision, out, None, None)
        assert s >= 0
        payloads.append(out[s:])
    buf = np.concatenate(payloads)
    lengths = np.array([p.size for p in payloads], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    lo = np.arange(0, n, chunk, dtype=np.int64)
    hi = np.minimum(lo + chunk, n)
    got = np.empty(n, np.uint8)
    errors = np.empty(g, np.int64)

    def kernel():
        for j in range(0, lo.size, g):
            kernels.decode_chunks(buf, starts[j:j + g], lengths[j:j + g], dec, precision,
                                  got, None, None, lo[j:j + g], hi[j:j + g], errors)
            assert not errors[:min(g, lo.size - j)].any()

    def loop():
        for j in range(lo.size):
            assert plain(buf, starts[j], lengths[j], dec, precision, got[lo[j]:hi[j]]) == 0

    for fn in (kernel, loop):
        got[:] = 0
        fn()
        assert np.array_equal(got, sym)
    return {"bits": 8 * buf.size / n, "kernel": n / _best(kernel, reps) / 1e6,
            "plain": n / _best(loop, reps) / 1e6,
            "args": (buf, starts[:g], lengths[:g], dec, precision, got, None, None, lo[:g],
                     hi[:g], errors)}


def measure(mib: float, precision: int, reps: int) -> dict:
    plain = _plain()
    n = int(mib * (1 << 20))
    rows = {name: _one(make(n, 20261126), precision, reps, plain)
            for name, make in DATA.items()}
    asm = _asm_check(next(iter(rows.values())).pop("args"))
    for row in rows.values():
        row.pop("args", None)
    return {"rows": rows, "asm": asm}


# ---------------------------------------------------------------- both ISAs (parent)


def avx2_features(off: re.Pattern = _AVX512) -> str:
    """The host's Numba CPU features with every AVX-512 (and AVX10 / AMX) feature off, or
    those ``off`` matches."""
    import llvmlite.binding as ll

    return ",".join("-" + f[1:] if off.match(f) else f
                    for f in ll.get_host_cpu_features().flatten().split(","))


def run_isa(isa: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(CACHE / f"numba-{isa}"))
    if isa == "avx2":
        env.update(NUMBA_CPU_NAME=args.avx2_cpu, NUMBA_CPU_FEATURES=avx2_features())
    elif isa == "avx512-no-vbmi2":  # AVX-512 without the expand (Skylake-SP, Cascade Lake)
        env.update(NUMBA_CPU_FEATURES=avx2_features(re.compile(r"^\+avx512vbmi2")))
    elif isa != "avx512":
        raise SystemExit(f"unknown ISA {isa!r}")
    cmd = [sys.executable, __file__, "--child", "--mib", str(args.mib), "--precision",
           str(args.precision), "--reps", str(args.reps)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{isa} run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(res: dict[str, dict], args: argparse.Namespace) -> str:
    lines = ["| data | bits/sym | ISA | kernel M sym/s | plain loop M sym/s | kernel / plain |",
             "| --- | ---: | --- | ---: | ---: | ---: |"]
    for name in DATA:
        for isa, r in res.items():
            row = r["rows"][name]
            lines.append(f"| {name} | {row['bits']:.3f} | {isa} | {row['kernel']:,.0f} | "
                         f"{row['plain']:,.0f} | {row['kernel'] / row['plain']:.2f}x |")
    asm = "; ".join(f"{isa}: {r['asm']['zmm']} zmm operands, {r['asm']['kmask']} mask-register "
                    f"operands, {r['asm']['gathers']} gathers, {r['asm']['expands']} expands"
                    for isa, r in res.items())
    return "\n".join(lines) + f"\n\nDecode kernel assembly: {asm}.\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=float, default=4)
    ap.add_argument("--precision", type=int, default=12)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--avx2-cpu", default="znver3",
                    help="LLVM CPU name of the AVX2 target (default znver3)")
    ap.add_argument("--isa", default="avx512,avx2",
                    help="comma-separated: avx512 (the host), avx2, avx512-no-vbmi2")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.mib, args.precision, args.reps)))
        return
    load0 = os.getloadavg()[0]
    res = {isa: run_isa(isa, args) for isa in args.isa.split(",")}
    load1 = os.getloadavg()[0]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = (f"Produced by `python bench/rans_isa.py{' --write' if args.write else ''}` on "
            f"{now} (git {results_md.git_commit()}).\n\n"
            f"- Machine: {results_md.cpu_model()}, {os.cpu_count()} cores; load average "
            f"{load0:.2f} before and {load1:.2f} after. ISA avx512: the host's target; avx2: "
            f"`NUMBA_CPU_NAME={args.avx2_cpu}` with every AVX-512 feature off; "
            f"avx512-no-vbmi2: the host's without VBMI2.\n"
            f"- {args.mib:g} MiB of each data kind, precision {args.precision}, chunks of "
            f"the frame's default size decoded in the frame's groups (kernel) or one by one "
            f"(plain loop); one thread, best CPU time of {args.reps} runs.\n\n")
    text = f"{SECTION}\n\n{head}{table(res, args)}"
    print(text)
    if args.write:
        results_md.write_section(text, SECTION)


if __name__ == "__main__":
    main()
