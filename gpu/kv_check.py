"""Device-side check and benchmark of entropykit.rans.cuda.dist (distribution rANS on the GPU).

What it is: the script a GPU machine runs. It checks the GPU
coder against the CPU coder (``entropykit.rans.distribution``, Numba, on the device's
CPUs) bit for bit both ways — GPU encode = CPU encode byte for byte (so the CPU decodes
it), CPU frame -> GPU decode, GPU -> GPU — on bf16 and fp8 e4m3 values drawn as
mu + sigma * heavy-tailed noise with NaN / inf / -0 / subnormal values mixed in, extreme
(mu, sigma), the whole value space, chunk-boundary sizes, raw chunks, per-value models and
precision 12; corrupted frames must fail exactly as on the CPU (same chunk, same message)
or decode to the CPU's output; invalid (mu, sigma) raise ValueError naming the value.
Outputs are poisoned before every decode. Then it times encode and decode (CUDA events,
median of several runs) on >= 256 MiB of cache values per format against a plain device
copy and pinned PCIe copies of the same bytes, and prints a table; results.json and
frames of the check cases (for a CPU decode back home) go to ``--out``.

What it is not: a CPU test (tests/test_gpu_dist_logic.py) or a model-quality benchmark.

There (entropykit imports zstandard, which the device image lacks; carry its cp312 wheel):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site python3 gpu/kv_check.py --out $OUT
Back here: ``python gpu/kv_check.py --verify DIR`` CPU-decodes the returned frames, and
``--write-results DIR/results.json`` writes the bench/RESULTS.md section.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

from entropykit import CorruptDataError  # noqa: E402
from entropykit.rans import distribution as D  # noqa: E402

SECTION = "## KV coder, GPU"
POISON = {16: 0x7FA5, 8: 0xA5}
SPECIALS = {  # NaN payloads, +-inf, +-0, subnormals, extremes
    "bf16": [0x7FC1, 0xFFFF, 0x7F81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x8005, 0x007F,
             0x7F7F, 0xFF7F],
    "fp8_e4m3": [0x7F, 0xFF, 0x00, 0x80, 0x01, 0x87, 0x7E, 0xFE],
    "fp16": [0x7E01, 0xFFFF, 0x7C01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x8005, 0x03FF,
             0x7BFF, 0xFBFF],
    "fp8_e5m2": [0x7F, 0xFF, 0x7D, 0x7C, 0xFC, 0x00, 0x80, 0x01, 0x83, 0x7B, 0xFB],
}


def log(*a) -> None:
    print(*a, flush=True)


def model() -> D.CoderModel:
    """The issue's mixture (0.95 N(0,1) + 0.03 N(0,9) + 0.02 empirical) and a Gaussian."""
    counts = np.ones(65536, np.int64)
    counts[0x8000 + 0x3F00 : 0x8000 + 0x4000] = 1000
    mix = D.gaussian_shape((1.0, 3.0), (0.95, 0.03))
    emp = D.empirical_table(counts)
    return D.CoderModel(np.stack([mix, D.gaussian_shape()]), np.stack([emp, emp]), [1311, 0])


def sample(torch, fmt: str, n: int, seed: int, dev, specials: float = 0.01):
    """(bits, mu, sigma) on ``dev``: values = mu + sigma * t4 noise, some specials."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda: torch.randn(n, generator=g, device=dev)  # noqa: E731
    u = lambda: torch.rand(n, generator=g, device=dev)  # noqa: E731
    if fmt in ("bf16", "fp16"):  # a 16-bit KV residual: |mu| ~ 1
        mu, sigma, bits = r(), 0.15 * torch.exp(0.5 * r()), torch.int16
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float16
    else:  # an fp8 cache in its scaled units, ~2-3 bits a value
        mu, sigma = 20 * r(), 2 * torch.exp(0.5 * r())
        dtype = torch.float8_e4m3fn if fmt == "fp8_e4m3" else torch.float8_e5m2
        bits = torch.uint8
    t4 = r() / torch.sqrt((-0.5 * torch.log(u() * u())).clamp_min(1e-12))  # Student t, 4 dof
    x = (mu + sigma * t4).to(dtype).view(bits)
    sp = torch.tensor(SPECIALS[fmt], device=dev).to(bits)
    pick = u() < specials
    x[pick] = sp[torch.randint(len(sp), (int(pick.sum()),), generator=g, device=dev)]
    return x, mu.contiguous(), sigma.contiguous()


def extreme_params(torch, mu, sigma, seed: int):
    """Extreme but valid (mu, sigma) in 1% of the places: tiny/huge/subnormal."""
    g = torch.Generator(device=mu.device).manual_seed(seed)
    n = mu.numel()
    for vals, arr in (([1e-30, 1e30, 1e-40, 3.0e-45, 1e-3], sigma),
                      ([1e30, -1e30, 1e-40, -0.0, 3.0e38], mu)):
        pick = torch.rand(n, generator=g, device=mu.device) < 0.002
        v = torch.tensor(vals, device=mu.device)
        arr[pick] = v[torch.randint(len(vals), (int(pick.sum()),), generator=g,
                                    device=mu.device)]
    # Within the coder's range (dist_kernels._invalid: |mu| < ~2**34 sigma).
    torch.maximum(sigma, mu.abs() * 2.0**-33, out=sigma)


def host(t) -> np.ndarray:
    a = t.cpu().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def timed(torch, fn, reps: int, warm: int = 2) -> list[float]:
    """Seconds of ``fn()`` per run, CUDA events (fn may synchronize itself)."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


class Checker:
    def __init__(self, torch, dist, dev, out_dir: Path) -> None:
        self.torch, self.dist, self.dev, self.out_dir = torch, dist, dev, out_dir
        self.model = model()
        self.failures: list[str] = []
        self.count = 0
        self.saved: dict[str, np.ndarray] = {}

    def expect(self, ok: bool, what: str) -> None:
        self.count += 1
        if not ok:
            self.failures.append(what)
            log("FAIL", what)

    def poisoned(self, n: int, bits: int):
        t = self.torch
        out = t.empty(n, dtype=t.int16 if bits == 16 else t.uint8, device=self.dev)
        return out.fill_(POISON[bits])

    def roundtrip(self, name: str, fmt: str, x, mu, sigma, *, midx=None, save=False, **kw):
        """GPU frame == CPU frame; CPU frame -> GPU decode; GPU -> GPU; GPU -> CPU."""
        t, dist, m = self.torch, self.dist, self.model
        f = D.FORMATS[fmt]
        xb, mub, sgb = host(x), mu.cpu().numpy(), sigma.cpu().numpy()
        mi = None if midx is None else midx.cpu().numpy()
        cs = kw.get("chunk_size", dist.DIST_CHUNK)
        cpu = D.encode(xb, mub, sgb, m, fmt=fmt, model_index=mi, chunk_size=cs,
                       precision=kw.get("precision", D.DEFAULT_PRECISION))
        gpu = dist.encode(x, mu, sigma, m, fmt=fmt, model_index=midx, **kw)
        gb = gpu.cpu().numpy().tobytes()
        self.expect(gb == cpu, f"{name}: GPU frame == CPU frame ({len(gb)} vs {len(cpu)} B)")
        for label, frame in (("CPU frame", cpu), ("GPU frame", gpu)):
            out = self.poisoned(x.numel(), f.bits)
            dist.decode(frame, mu, sigma, m, model_index=midx, out=out)
            self.expect(bool(t.equal(out.view(x.dtype), x)), f"{name}: {label} -> GPU decode")
        back = D.decode(gb, mub, sgb, m, model_index=mi)
        self.expect(np.array_equal(back, xb), f"{name}: GPU frame -> CPU decode")
        if save:
            self.saved[f"{name}.frame"] = np.frombuffer(gb, np.uint8)
            self.saved[f"{name}.bits"] = xb
            self.saved[f"{name}.mu"] = mub
            self.saved[f"{name}.sigma"] = sgb
            if mi is not None:
                self.saved[f"{name}.midx"] = mi
        return cpu, len(gb) / max(1, xb.nbytes)

    def run_exactness(self, formats=("bf16", "fp8_e4m3"), n: int = 3_000_017) -> dict:
        t, dev = self.torch, self.dev
        ratios = {}
        for fmt in formats:
            f = D.FORMATS[fmt]
            x, mu, sigma = sample(t, fmt, n, 1, dev)
            extreme_params(t, mu, sigma, 2)
            midx = t.randint(0, 2, (n,), device=dev, dtype=t.int32)
            cpu, ratios[fmt] = self.roundtrip(f"{fmt} realistic+specials", fmt, x, mu, sigma)
            modes = D.parse(cpu).modes
            self.expect(ratios[fmt] < 0.9 and (modes == D.MODE_CODED).mean() > 0.99,
                        f"{fmt} realistic data is coded (ratio {ratios[fmt]:.4f})")
            log(f"{fmt} realistic+specials: ratio {ratios[fmt]:.4f}, "
                f"{(modes == D.MODE_RAW).sum()} raw chunks of {modes.size}")
            self.roundtrip(f"{fmt} per-value models", fmt, x, mu, sigma, midx=midx)
            small = 200_003
            self.roundtrip(f"{fmt} small", fmt, x[:small].clone(), mu[:small].clone(),
                           sigma[:small].clone(), midx=midx[:small].clone(), save=True,
                           chunk_size=4096)
            self.roundtrip(f"{fmt} p12 chunk 2^15", fmt, x, mu, sigma, precision=12,
                           chunk_size=1 << 15)
            keys = t.arange(1 << f.bits, device=dev)
            allv = (keys.to(t.int16) if f.bits == 16 else keys.to(t.uint8)).repeat(3)
            nn = allv.numel()
            for mu0, s0 in [(1.0, 1e-3), (0.0, 1e4), (-3.0, 0.5)]:
                self.roundtrip(f"{fmt} all values mu={mu0} sigma={s0}", fmt, allv,
                               t.full((nn,), mu0, device=dev), t.full((nn,), s0, device=dev),
                               midx=(t.arange(nn, device=dev) % 2).to(t.int32), chunk_size=1024)
            for size in (1, 31, 32, 33, 1023, 1024, 1025, 4097, 16385):
                self.roundtrip(f"{fmt} n={size}", fmt, x[:size].clone(), mu[:size].clone(),
                               sigma[:size].clone(), chunk_size=1024)
            rb = t.randint(0, 1 << f.bits, (5000,), device=dev)
            rb = rb.to(t.int16) if f.bits == 16 else rb.to(t.uint8)
            cpu, _ = self.roundtrip(f"{fmt} incompressible (raw chunks)", fmt, rb,
                                    t.zeros(5000, device=dev), t.full((5000,), 1e-6, device=dev),
                                    chunk_size=1024)
            self.expect(set(D.parse(cpu).modes.tolist()) == {D.MODE_RAW},
                        f"{fmt} incompressible chunks stored raw")
        return ratios

    def run_errors(self) -> None:
        t, dist, m, dev = self.torch, self.dist, self.model, self.dev
        n = 65_536 + 77
        x, mu, sigma = sample(t, "bf16", n, 5, dev)
        mub, sgb = mu.cpu().numpy(), sigma.cpu().numpy()
        frame = dist.encode(x, mu, sigma, m, fmt="bf16", chunk_size=1024).cpu().numpy().tobytes()
        xb = host(x)
        rng = np.random.default_rng(0)

        def both(blob: bytes, label: str, on_device: bool, mu_t=mu, mub_=mub) -> None:
            try:
                want = ("ok", D.decode(blob, mub_, sgb, m))
            except CorruptDataError as e:
                want = ("corrupt", str(e))
            src = t.frombuffer(bytearray(blob), dtype=t.uint8).to(dev) if on_device else blob
            out = self.poisoned(n, 16)
            try:
                dist.decode(src, mu_t, sigma, m, out=out)
                got = ("ok", host(out))
            except CorruptDataError as e:
                got = ("corrupt", str(e))
            same = got[0] == want[0] and (np.array_equal(got[1], want[1]) if got[0] == "ok"
                                          else got[1] == want[1])
            self.expect(same, f"{label}: GPU {got[0]} {str(got[1])[:90]!r} vs CPU "
                              f"{want[0]} {str(want[1])[:90]!r}")
            if got[0] == "ok":
                self.expect(np.array_equal(got[1], xb), f"{label}: decoded output exact")

        head = D.HEADER_SIZE + 9 * len(D.parse(frame).lengths)
        for k in range(300):  # one flipped byte in the payloads or directory
            b = bytearray(frame)
            pos = int(rng.integers(D.HEADER_SIZE, len(b)))
            b[pos] ^= int(rng.integers(1, 256))
            both(bytes(b), f"flip byte {pos}", on_device=k % 2 == 0)
        for k in range(24):  # the chunk directory itself, read on the device from a CUDA frame
            b = bytearray(frame)
            pos = int(rng.integers(D.HEADER_SIZE, head))
            b[pos] ^= int(rng.integers(1, 256))
            both(bytes(b), f"flip directory byte {pos}", on_device=k % 3 != 0)
        for k in range(40):  # a run of garbage in one chunk's payload
            b = bytearray(frame)
            pos = int(rng.integers(head, len(b) - 64))
            b[pos : pos + 64] = rng.integers(0, 256, 64, np.uint8).tobytes()
            both(bytes(b), f"garbage at {pos}", on_device=k % 2 == 1)
        k_dev = lambda c: c % 2 == 1  # noqa: E731 - odd cuts from the device, even from bytes
        for cut in (0, 5, 27, 28, 40, head + 3, len(frame) - 1, len(frame) - 2):
            both(frame[:cut], f"truncated to {cut}", on_device=cut > 0 and k_dev(cut))
        both(frame + b"\0", "trailing byte", on_device=True)
        both(frame + b"\0", "trailing byte, host frame", on_device=False)
        z = np.zeros(0, np.float32)  # an empty frame: its header alone, then a stray byte
        empty = D.encode(np.zeros(0, np.uint16), z, z, m, fmt="bf16")
        for blob, label in ((empty, "empty frame"), (empty + b"\0", "empty frame + 1 byte")):
            try:
                want = ("ok", 0, "")
                D.decode(blob, z, z, m)
            except CorruptDataError as e:
                want = ("corrupt", 0, str(e))
            for on_device in (False, True):
                src = t.frombuffer(bytearray(blob), dtype=t.uint8).to(dev) if on_device else blob
                try:
                    got = ("ok", dist.decode(src, t.zeros(0, device=dev), t.zeros(0, device=dev),
                                             m).numel(), "")
                except CorruptDataError as e:
                    got = ("corrupt", 0, str(e))
                self.expect(got == want, f"{label} (device {on_device}): GPU {got} vs CPU {want}")
        both(frame, "wrong mu", on_device=True, mu_t=mu + 0.25, mub_=mub + np.float32(0.25))
        for where in (57, 5000, n - 1):  # invalid (mu, sigma): ValueError naming the value
            for arr, bad in ((mu, float("nan")), (sigma, 0.0), (sigma, -1.0),
                             (mu, float("inf")), (sigma, 2.0**-45)):
                a = arr.clone()
                a[where] = bad
                args = (a, sigma) if arr is mu else (mu, a)
                if bad == 2.0**-45:  # with mu = 1: beyond the coder's range
                    far = mu.clone()
                    far[where] = 1.0
                    args = (far, a)
                for what, fn in (("encode", partial(dist.encode, x, *args, m, fmt="bf16",
                                                     chunk_size=1024)),
                                 ("decode", partial(dist.decode, frame, *args, m))):
                    try:
                        fn()
                        ok = False
                    except CorruptDataError:
                        ok = False
                    except ValueError as e:
                        ok = f"value {where}:" in str(e)
                    self.expect(ok, f"{what} with {bad} at {where}: ValueError naming it")
        try:
            dist.decode(frame, mu, sigma, D.gaussian_model())
            self.expect(False, "model fingerprint mismatch raises")
        except CorruptDataError as e:
            self.expect("model" in str(e), "model fingerprint mismatch raises")


def bench(torch, dist, dev, fmt: str, mib: int, variants, reps: int) -> dict:
    """Encode/decode GB/s of ``mib`` MiB of cache values for each (chunk, model index)."""
    f = D.FORMATS[fmt]
    n = (mib << 20) // (f.bits // 8)
    x, mu, sigma = sample(torch, fmt, n, 11, dev)
    m = model()
    nbytes = x.numel() * x.element_size()

    def one(chunk: int, mi: int) -> dict:
        kw = {"model_index": mi}
        enc = partial(dist.encode, x, mu, sigma, m, fmt=fmt, chunk_size=chunk, **kw)
        frame = enc()
        out = torch.empty_like(x).fill_(POISON[f.bits])
        dist.decode(frame, mu, sigma, m, out=out, **kw)
        exact = bool(torch.equal(out, x)) and frame.numel() < 0.9 * nbytes  # and coded
        te = timed(torch, enc, reps)
        td = timed(torch, partial(dist.decode, frame, mu, sigma, m, out=out, **kw), reps)
        pinned = torch.empty(frame.numel(), dtype=torch.uint8, pin_memory=True)
        pinned.copy_(frame)
        tdh = timed(torch, partial(dist.decode, pinned, mu, sigma, m, out=out, **kw), reps)
        row = {"fmt": fmt, "chunk": chunk, "warps": dist.WARPS, "smem": True,
               "model": ["mixture+empirical", "gaussian"][mi],
               "mib": nbytes / 2**20, "ratio": frame.numel() / nbytes, "exact": exact,
               "enc_s": statistics.median(te), "dec_s": statistics.median(td),
               "dec_host_s": statistics.median(tdh), "enc_all": te, "dec_all": td}
        row["enc_gbs"] = nbytes / row["enc_s"] / 1e9
        row["dec_gbs"] = nbytes / row["dec_s"] / 1e9
        row["dec_host_gbs"] = nbytes / row["dec_host_s"] / 1e9
        log(f"{fmt} {row['model']} chunk {chunk}: ratio {row['ratio']:.4f} exact {exact} "
            f"enc {row['enc_gbs']:.1f} GB/s dec {row['dec_gbs']:.1f} GB/s (from pinned host "
            f"{row['dec_host_gbs']:.1f})")
        return row

    # the GPU's clocks up before the first row (it times ~10% slow from an idle GPU)
    warm = partial(dist.encode, x, mu, sigma, m, fmt=fmt)
    t_end = time.time() + 1.0
    while time.time() < t_end:
        warm()
    torch.cuda.synchronize()
    rows = [one(*v) for v in variants]
    # The same bytes moved plainly: device copy, pinned PCIe both ways.
    flat = x.view(torch.uint8)
    dst = torch.empty_like(flat)
    hbuf = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
    copies = {
        "d2d_s": statistics.median(timed(torch, lambda: dst.copy_(flat), reps)),
        "h2d_s": statistics.median(timed(torch, lambda: dst.copy_(hbuf, non_blocking=True),
                                         reps)),
        "d2h_s": statistics.median(timed(torch, lambda: hbuf.copy_(flat, non_blocking=True),
                                         reps)),
    }
    for k in list(copies):
        copies[k.replace("_s", "_gbs")] = nbytes / copies[k] / 1e9
    log(f"{fmt} copies of {nbytes / 2**20:.0f} MiB: device {copies['d2d_gbs']:.0f} GB/s, "
        f"H2D pinned {copies['h2d_gbs']:.1f}, D2H pinned {copies['d2h_gbs']:.1f}")
    return {"rows": rows, "copies": copies, "bytes": nbytes}


def profile_main(args) -> None:
    """One encode and one decode of ``--mib`` MiB per format, for a profiler (ncu -k)."""
    import torch

    import entropykit.rans.cuda.dist as dist

    dev = torch.device("cuda", 0)
    for fmt in args.profile.split(","):
        f = D.FORMATS[fmt]
        x, mu, sigma = sample(torch, fmt, (args.mib << 20) // (f.bits // 8), 11, dev)
        frame = dist.encode(x, mu, sigma, model(), fmt=fmt)
        out = torch.empty_like(x)
        dist.decode(frame, mu, sigma, model(), out=out)
        torch.cuda.synchronize()
        ratio = frame.numel() / (x.numel() * x.element_size())
        log(f"{fmt}: exact {bool(torch.equal(out, x))}, ratio {ratio:.4f}")


def ab_variants(spec: str, dist) -> list[tuple[str, object]]:
    """``--ab``'s variants after the library's kernel: (name, build) where build(f, smem)
    is ``dist._kernels`` or a CuPy module of another .cu source, compiled as the library's
    (the status prologue, then the source, with ``dist._build_options``)."""
    import cupy as cp

    from entropykit._status import cuda_prologue

    out = [("lib", dist._kernels)]
    for item in spec.split(","):
        src, built = cuda_prologue() + Path(item).read_text(), {}

        def build(f, smem, src=src, built=built):
            key = (f.name, smem)
            if key not in built:
                built[key] = cp.RawModule(code=src, options=dist._build_options(f, smem))
            return built[key]

        out.append((Path(item).stem, build))
    return out


def with_build(dist, build, fn):
    """``fn`` run with the decoder's kernels from ``build`` (an --ab variant)."""
    def run(**kw):
        lib, dist._kernels = dist._kernels, build
        try:
            return fn(**kw)
        finally:
            dist._kernels = lib
    return run


def ab_cases(torch, dist, dev, args):
    """(label, values, decode(out)) of the A/B: kv_check's rows (one shape a launch),
    then with ``--ab-real DIR`` kv_real's layers 10 and 20 framed as the hook frames them
    (keys then values: two shapes a launch)."""
    m = model()
    for fmt in ("bf16", "fp8_e4m3"):
        f = D.FORMATS[fmt]
        x, mu, sigma = sample(torch, fmt, (args.mib << 20) // (f.bits // 8), 11, dev)
        for mi in (0, 1):
            frame = dist.encode(x, mu, sigma, m, fmt=fmt, model_index=mi)
            yield (f"{fmt} | {['mixture', 'gaussian'][mi]}", x,
                   partial(dist.decode, frame, mu, sigma, m, model_index=mi))
    if not args.ab_real:
        return
    import kv_real

    st, _ = kv_real.streams(Path(args.ab_real), dev)
    for (fmt, kind), (groups, rm) in st.items():
        if kind == "conditional":
            continue
        for layer in (10, 20):
            (xk, mk, sk, ik), (xv, mv, sv, iv) = (g[2:] for g in groups[2 * layer:2 * layer + 2])
            copies = max(1, (args.mib << 20) // ((xk.numel() + xv.numel()) * xk.element_size()))
            xs, mus, sgs = (torch.cat([a.repeat(copies), b.repeat(copies)])
                            for a, b in ((xk, xv), (mk, mv), (sk, sv)))
            index = ik if ik == iv else [(ik, copies * xk.numel()), (iv, copies * xv.numel())]
            frame = dist.encode(xs, mus, sgs, rm, fmt=fmt, model_index=index)
            yield (f"{fmt} | real {kind} L{layer}", xs,
                   partial(dist.decode, frame, mus, sgs, rm, model_index=index))


def ab_main(args) -> None:
    """Decode GB/s of the library's kernel and of each ``--ab`` variant, the variants taking
    turns ``--rounds`` times (the GPU's clocks drift between runs), each variant's decode of
    every case checked exact first (poisoned output); the encoder is the library's.
    Timings only: a variant's numbers count once a full run passes with it."""
    import torch

    import entropykit.rans.cuda.dist as dist

    dev = torch.device("cuda", 0)
    variants = ab_variants(args.ab, dist)
    res: dict = {}
    for label, x, dec in ab_cases(torch, dist, dev, args):
        out = torch.empty_like(x)
        runs = []
        for name, build in variants:
            out.fill_(POISON[x.element_size() * 8])
            with_build(dist, build, dec)(out=out)
            if not torch.equal(out, x):
                sys.exit(f"{name} is not exact on {label}")
            runs.append(partial(with_build(dist, build, dec), out=out))
        times: list[list[float]] = [[] for _ in variants]
        for _ in range(args.rounds):
            for i, fn in enumerate(runs):
                times[i] += timed(torch, fn, 3, warm=1)
        base = statistics.median(times[0])
        for (name, _), ts in zip(variants, times, strict=True):
            gbs = sorted(x.numel() * x.element_size() / t / 1e9 for t in ts)
            res[f"{label} | {name}"] = gbs
            log(f"| {label} | {name} | {statistics.median(gbs):.1f} | {gbs[0]:.1f}-"
                f"{gbs[-1]:.1f} | {100 * (base / statistics.median(ts) - 1):+.1f}% |")
        del out, runs
        torch.cuda.empty_cache()
    for name, build in variants:
        for fmt in ("bf16", "fp8_e4m3"):
            k = build(D.FORMATS[fmt], True).get_function("dist_decode")
            log(f"{name} {fmt}: {k.num_regs} registers, {k.local_size_bytes} B local")
    (Path(args.out) / "ab.json").write_text(json.dumps(res, indent=1))


def device_main(args) -> None:
    import torch

    import entropykit.rans.cuda.dist as dist

    dev = torch.device("cuda", 0)
    p = torch.cuda.get_device_properties(dev)
    res = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "gpu": p.name,
           "sms": p.multi_processor_count, "torch": torch.__version__,
           "command": "python3 gpu/kv_check.py --out $OUT" + (f" --mib {args.mib}"
                                                               if args.mib != 256 else "")}
    log(f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ck = Checker(torch, dist, dev, out)
    if args.occupancy:  # timings only (each row still checks its own round trip)
        occ = [(1 << 14, mi) for mi in (0, 1)]
        res["checks"], res["failures"] = 0, []
        res["bench"] = {fmt: bench(torch, dist, dev, fmt, args.mib, occ, args.reps)
                        for fmt in ("bf16", "fp8_e4m3")}
        log(table(res))
        return
    t0 = time.time()
    res["ratios_check"] = ck.run_exactness()
    log(f"exactness: {ck.count} checks, {len(ck.failures)} failed ({time.time() - t0:.1f} s)")
    t0 = time.time()
    ck.run_errors()
    log(f"with errors: {ck.count} checks, {len(ck.failures)} failed ({time.time() - t0:.1f} s)")
    res["checks"], res["failures"] = ck.count, ck.failures[:50]
    np.savez(out / "frames.npz", **ck.saved)
    if ck.failures and not args.force:
        (out / "results.json").write_text(json.dumps(res, indent=1))
        sys.exit("failures: no timings")
    # (chunk, model index: 0 mixture + empirical, 1 Gaussian)
    variants = {fmt: [(1 << 14, 0), (1 << 14, 1)] for fmt in ("bf16", "fp8_e4m3")}
    res["bench"] = {fmt: bench(torch, dist, dev, fmt, args.mib, v, args.reps)
                    for fmt, v in variants.items()}
    (out / "results.json").write_text(json.dumps(res, indent=1))
    log(table(res))


def guess(r: dict) -> str:
    """The decoder's guess of a row: refinement rounds, tail points, Newton step, and how
    it searches a missed guess (rows of earlier kernels with build knobs; else the
    library's one build per format)."""
    if "guess_rounds" not in r:
        return "library"
    rounds, pure = r.get("guess_rounds", 1), r.get("pure_rounds", r.get("guess_rounds", 1))
    low = r.get("low_rounds")
    low = f" ({low} low)" if low is not None and r["fmt"] == "bf16" and low != rounds else ""
    out = (f"{rounds} rounds{low}" + (f" ({pure} at w = 0)" if pure != rounds else "")
           + (" + E start (low)" if r.get("low_e_start") and r["fmt"] == "bf16" else "")
           + (" + tails" if r.get("tail_inverse") else "")
           + (" + Newton" if r.get("guess_newton") else "")
           + (f" + {r['fwd_steps']} fwd" if r.get("fwd_steps") else "")
           + (" + flat bounds" if r.get("low_bound") and r["fmt"] == "bf16" else ""))
    if "warp_search" in r:
        name = {True: "warp search", False: "lane search"}
        top = r.get("warp_search_top", r["warp_search"])
        out += (f"; {name[r['warp_search']]}" if r["fmt"] != "bf16" or top == r["warp_search"]
                else f"; {name[top]} (top), {name[r['warp_search']]} (low)")
    return out


def miss(r: dict) -> str:
    if "miss_low" not in r:
        return "-"
    low = f"{100 * r['miss_low']:.2f}%"
    return f"{100 * r['miss_top']:.2f}% / {low}" if r["fmt"] == "bf16" else low


def table(res: dict) -> str:
    lines = [f"GPU: {res['gpu']} ({res['sms']} SMs), torch {res['torch']}, {res['date']}",
             f"command: `{res['command']}`",
             f"exactness and error checks: {res['checks']} run, {len(res['failures'])} failed",
             "",
             "| format | model | chunk | warps/block | tables | guess | ratio | "
             "encode GB/s | decode GB/s | decode from pinned host GB/s | "
             "offload via PCIe GB/s | missed guesses per value (top / low) |",
             "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: |"]
    for fmt, b in res["bench"].items():
        d2h = b["copies"]["d2h_gbs"]
        for r in b["rows"]:
            # encode, then the coded bytes over PCIe (serial; raw D2H is the baseline column
            # below): GB/s of cache moved off the GPU this way
            off = 1 / (1 / r["enc_gbs"] + r["ratio"] / d2h)
            mb = r.get("min_blocks", 1)
            warps = f"{r['warps']}" + (f" (>= {mb} blocks/SM)" if mb > 1 else "")
            lines.append(f"| {fmt} | {r.get('model', 'mixture+empirical')} | {r['chunk']} | "
                         f"{warps} | {'smem' if r['smem'] else 'L1'} | "
                         f"{guess(r)} | {r['ratio']:.4f} | "
                         f"{r['enc_gbs']:.1f} | {r['dec_gbs']:.1f} | {r['dec_host_gbs']:.1f} | "
                         f"{off:.1f} | {miss(r)} |")
    lines += ["", "| format | MiB of cache | device copy GB/s | PCIe H2D pinned GB/s | "
              "PCIe D2H pinned GB/s |", "| --- | ---: | ---: | ---: | ---: |"]
    for fmt, b in res["bench"].items():
        c = b["copies"]
        lines.append(f"| {fmt} | {b['bytes'] / 2**20:.0f} | {c['d2d_gbs']:.0f} | "
                     f"{c['h2d_gbs']:.1f} | {c['d2h_gbs']:.1f} |")
    return "\n".join(lines)


NOTES = """\
What the rows are: `entropykit.rans.cuda.dist.encode` / `decode` (CUDA C++ through NVRTC, one warp
per chunk, all chunks in one launch; fp8's decoder warps take chunks from a counter) on 256
MiB of cache values drawn as mu + sigma * t(4) noise with 1% NaN / inf / -0 / subnormal
values (bf16: |mu| ~ 1, sigma ~ 0.15; fp8 e4m3 in scaled units: |mu| ~ 20, sigma ~ 2), mu
and sigma float32 on the device. GB/s = cache bytes per second of the whole call (CUDA
events, median of 7 after 2 warm-ups and a second of warm-up encodes per format): encode
includes the one device-to-host read of the chunk lengths that sizes the frame and the
gather launch; decode includes the read of the frame's 28-byte header, the directory
kernel (the chunk table, on the device) and the status read; "from pinned host" decodes a
frame in pinned host memory (its directory read on the device too), its upload included.
CRC-32 (zlib's, the frame's) is computed on the GPU in both directions, inside these
times. "Offload via PCIe" = cache bytes / (encode time + coded bytes over the
measured D2H link), serial. Outputs are poisoned before each checked decode; every row was
bit-exact, and the frames equal the CPU coder's byte for byte (checks above: GPU frame ==
CPU frame, CPU frame -> GPU decode, GPU -> GPU, GPU frame -> CPU decode; corrupt frames fail
with the CPU's chunk and message). The same row moves by up to ~8% between runs (fresh
machines); A/B decisions below come from interleaved repeats in one run.

Guess and search (the "guess" column): the decoder guesses each symbol in float32 (1
refinement round; tail points; one Newton step; bf16's low byte then 2 forward Newton steps
on the shape's own CDF points), checks it with two exact CDFs, and on a miss either the lane
searches alone ("lane search", bf16's low byte) or tries the neighbour, then the whole warp
searches each remaining miss with two ballots over cdf(8 i) and then 9 symbols ("warp
search": bf16's top byte, 8-bit formats). Misses per value are counted by a separate
counting build (same guesses).

State against the target (>= 50 GB/s of cache both ways): encode meets it (57-67 GB/s);
decode does not: bf16 36.2 (mixture) / 41.1 (Gaussian), fp8 e4m3 35.7 / 38.5 GB/s (the same
fp8 kernel 37.4 / 40.9 on another machine minutes before), from 29.1 / 36.2 and 35.6 / 39.6
at the start of this round (08:07; fresh machines differ by up to ~8% on the same kernel, so
each lever was decided by an interleaved A/B in one run, `kv_check.py --ab`). This round cut
instructions, which bound the kernel (ncu: the ALU pipe at 70% and throttling): warp
instructions per 32 values (mixture, 128 MiB) bf16 1507 -> 1117, fp8 594 -> 538. By lever
(bf16; A/B GB/s mixture / Gaussian): S specialized by stage (top stage: E at bucket starts
and, bf16's top-byte step being two binades, a key offset with a constant mid; low stage: E
linear in its one bucket), stage_cdf's remainder in 32 bits from a rounded float quotient,
branch-free key offset and S ends, 64 registers for 16-bit formats (67 uncapped leave 24
warps an SM): 1507 -> 1372, 28.5 -> 31.0 / 36.3 -> 39.8; guess_key's rounding from its float
magnitude 1340; the low byte's guesses with the stage's E 1281 (32.2 / 40.2); the top-stage
offset 1258; the low byte with 1 round + 2 forward steps 1190 (+5% / +2.5%; low-byte misses
2.06% -> 0.73%: before this round's cuts the steps did not pay); the 64-bit offset of big mu
out of line (3920 -> 3552 SASS instructions, 1214 executed, within noise); the warp's search
for the top byte 1147 (+5% / +2%); 1 top-byte round in place of 2 1117 (+1.7%, +2.2%, +2.4%
in three runs). Each exactness argument is a comment in the kernel and a CPU test
(tests/test_gpu_dist_logic.py). Measured and not kept: 40 warps an SM by a 48-register cap
(spills; -6..8%), 16-bit word reads (+2.5% instructions), mu_u in 32 bits in params (+1%),
the warp's search for both bf16 bytes (same speed, +2% instructions), the key offset's float
built from the key's bits (more SASS); earlier rounds: two chunks a warp interleaved (halved
speed), 3 guess rounds (misses rise: the rounds oscillate). Where the rest goes (ncu source
counters, bf16): float guesses ~40% (6 inversions a value), exact S and stage CDFs ~30%,
searches ~5%, state, words, parameters and output ~20%; the ALU pipe no longer throttles
(math-pipe stall 1.69 -> 0.93 cycles an instruction), dependency latency does (stall "wait"
2.1, long scoreboard 1.6; ~2 eligible of ~6.6 warps a scheduler). Misses (per value, top /
low byte): bf16 mixture 1.42% / 0.73%, Gaussian 0.49% / 0.88%; fp8 mixture 1.10%, Gaussian
1.67%.

Latency round (the next helper, 09:40-10:00): the decoder loads each group's (mu, sigma,
model index) a group ahead, and fp8's warps take chunks from a
launch-wide counter until none is left (bf16 keeps one chunk a warp:
at its 64-register cap the chunk loop spills), 64 registers for every format. Interleaved
H200 A/B in one run against the previous kernel (GB/s, mixture / Gaussian): bf16 38.6 ->
39.2 / 43.2 -> 44.4, fp8 e4m3 38.3 -> 39.3 / 41.9 -> 43.3; an earlier run by part (vs the
previous kernel 36.8 / 42.5 and 35.8 / 39.2): prefetch alone bf16 38.3 / 42.5, fp8 (capped)
36.0 / 39.3; both on fp8 37.2 / 40.2; the chunk counter on bf16 34.0 / 39.8 (spills). ncu,
256 MiB, previous -> now, cycles an issued instruction: long-scoreboard stall bf16 1.39 ->
0.82, fp8 2.13 -> 0.90; warps eligible a scheduler bf16 2.27 -> 2.48 (of 6.8 active), fp8
2.18 -> 2.71 (active 7.32 -> 7.48); "wait" unchanged (2.1-2.2), math-pipe throttle back up
(bf16 1.05 -> 1.14, fp8 1.08 -> 1.29), issue slots busy bf16 0.75 -> 0.76, fp8 0.75 -> 0.80;
warp instructions per 32 values bf16 1117 -> 1123, fp8 538 -> 563 (the counter and the
cap). Not kept: the payload's words read a step ahead into a per-lane window (bf16 -4%, fp8
even: the extra registers spill the prefetched parameters). Left: the fixed-latency chain
(stall "wait") and the instruction count again (the ALU pipe is back near its limit);
occupancy is capped by 64 registers and by shared memory alike (4 blocks of 8 warps).
Full runs at this state (521 checks pass): 09:53 decode bf16 38.0 / 40.1, fp8 37.1 / 40.6,
encode 61-66 GB/s; 09:48 (another machine) 39.3 / 41.5, 39.6 / 43.5, encode 62-69.
Shared-address round (10:05-10:12): the decoder's model-table reads go through shape_w /
emp_w; for 8-bit formats (SMEM_ADDR) they are ld.shared from a 32-bit address held in a
register: through the C++ pointer, Hopper rebuilt the shared window's base (S2UR of the
CTA's cluster id + 3 uniform instructions) before most reads (bf16 keeps pointer reads: the
extra register spills in its group loop, 12 B). Warp instructions per 32 values (ncu,
mixture, 128 MiB): fp8 563.4 -> 549.1, bf16 1122.8 -> 1110.8 (the reads' index form).
Interleaved H200 A/B vs the previous kernel, three runs (mixture / Gaussian): fp8 +3.9 /
+0.5, +4.4 / +1.7, +1.9 / +1.2 %; bf16 +0.8 / +0.5, +0.8 / +0.7, +1.3 / +0.5 %. Not kept:
MUFU.RCP alone (rcp.approx.ftz) in place of __fdividef in the float guesses and stage_rq
(3-4 SASS instructions fewer a division, 72 static in bf16's kernel, but executed bf16
1122.8 -> 1126.6, fp8 563.4 -> 560.3; A/B -1.8..+2.4 %, i.e. noise, in three runs). Full
run at this state (H200 10:10, 521 checks pass, frames CPU-decode here): decode bf16 37.9 /
41.0, fp8 38.5 / 42.3 GB/s, encode 63-67 (the same machine 5 minutes before, this kernel
with the reciprocals: 39.4 / 44.3, 40.8 / 42.6: its runs drift by ~4%).
Instruction round (10:24-11:07): ncu showed no pipe saturated (ALU, the busiest, ~55% of
its peak; issue slots ~71-75% busy), so the cuts went where the instructions were. Warp
instructions per 32 values bf16 1110.8 -> 1031.5, fp8 549.1 -> 486.4: params' mu_u in 32-bit
words, the payload word's bytes from one address (bf16 +1.5 / +1.1%, fp8 +1.0 / +2.1%);
bf16's low stage with E in its first guess and no round (+1.2 / 0.0%); bf16's top stage
without a round for models with an empirical term (mixture +1.7..2.4%; the Gaussian keeps
its round: without, -1.4..2.8%); bf16's table reads from a 32-bit shared address (+2.0 /
+1.6%); 8-bit formats' key offsets from a shared table of key boundaries times a per-value
power of two (fp8 +5.5 / +5.4%, then +2.3 / +2.5%). Not kept: 3 forward steps (-1.1 /
-1.4%), the warp's search for bf16's low byte (-1.0 / -0.2%). Full run at this state (H200
11:06, 521 checks pass, frames CPU-decode here): decode bf16 42.8 / 44.9, fp8 44.1 / 48.7
GB/s, encode 65-71.
Decode-kernel round (12:00-12:50): the default precision as a compile-time build of the
chunk decoder, one shared-memory block a model, w and the sigma reciprocals from shared
memory (bf16), the top stage's key offset from float bits, bf16's guesses clamped into the
bounds of flat stretches ("flat bounds": misses bf16 mixture 2.62% / 0.92% -> 2.12% /
0.61%, Gaussian low byte 1.31% -> 1.05%). Warp instructions per 32 values bf16 1031.3 ->
950.7, fp8 486.3 -> 462.2; interleaved H200 A/B vs the previous kernel (mixture /
Gaussian): bf16 +8.4 / +7.2%, fp8 +3.3 / +4.1%. Full run (H200 12:36, 545 checks pass,
frames CPU-decode here): decode bf16 49.5 / 51.4, fp8 50.7 / 56.2 GB/s, encode 69-73.
Shared-memory round (helper-32, 12:50-13:10): the inverse shapes in shared memory for
one-shape launches (bf16 +0.6..1.5%, three runs). Host side (lead, 12:00-13:15): less glue
per call (the GPU waits ~0.09 ms before the launches and ~0.06 ms after the kernel, from
0.17-0.24 and 0.13-0.24), only the model shapes a launch uses go to the kernel (one for an
int model index, as here; a real calibration's 61 shapes had sent every real launch to the
L1 build), model runs for the hook's layers. Full runs at the session's end (545 checks
pass, frames CPU-decode here): 13:02 decode bf16 49.1 / 53.2, fp8 50.3 / 56.3; 13:15 49.7 /
53.6, 50.5 / 56.2 (with two decoder entry points, not kept: +1.4% vs the rows through L1,
as the one build); 13:17 (96c776e, the table above) 49.1 / 52.7, 48.2 / 54.1; encode 66-74.
The same code on a real SmolLM2-135M cache: the section "KV coder, GPU, real caches".
"""


def verify(folder: str) -> None:
    """CPU-decode the GPU frames a device run returned (GPU encode -> CPU decode here)."""
    z = np.load(Path(folder) / "frames.npz")
    m = model()
    names = sorted({k.rsplit(".", 1)[0] for k in z.files})
    for name in names:
        mi = z[f"{name}.midx"] if f"{name}.midx" in z.files else None
        back = D.decode(z[f"{name}.frame"], z[f"{name}.mu"], z[f"{name}.sigma"], m,
                        model_index=mi)
        ok = np.array_equal(back, z[f"{name}.bits"])
        print(f"{name}: GPU frame -> CPU decode here: {'exact' if ok else 'MISMATCH'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kv_out")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--force", action="store_true", help="time even after failed checks")
    ap.add_argument("--verify", metavar="DIR")
    ap.add_argument("--profile", metavar="FMTS", help="one encode + decode per format (ncu)")
    ap.add_argument("--occupancy", action="store_true",
                    help="timings only: the library's kernel, both models (each row still "
                         "checks its own round trip)")
    ap.add_argument("--write-results", metavar="JSON")
    ap.add_argument("--ab", metavar="SOURCES", help="decode timings only: the library's "
                    "kernel against these .cu sources built with the library's options "
                    "(comma-separated), interleaved")
    ap.add_argument("--rounds", type=int, default=4, help="--ab: turns of each variant")
    ap.add_argument("--ab-real", metavar="DIR", help="--ab: kv_real's two-shape layers too "
                    "(a kv_real.py --prepare folder)")
    args = ap.parse_args()
    if args.verify:
        verify(args.verify)
    elif args.profile:
        profile_main(args)
    elif args.ab:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        ab_main(args)
    elif args.write_results:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
        from results import write_section

        res = json.loads(Path(args.write_results).read_text())
        write_section(f"{SECTION}\n\n{table(res)}\n\n{NOTES}", SECTION)
    else:
        device_main(args)


if __name__ == "__main__":
    main()
