"""Device check of ``entropykit.load_file(path, device="cuda")`` on real MiniLM files.

What it is: the script a GPU machine runs for the loader. From
the carried compressed files (MiniLM-L6 cast to bf16 and to fp8 e4m3, and a subset of its
fp32 tensors: layer 0 and the position/type embeddings) it restores the originals
(``decompress_file``), compresses each again for the GPU (``compress_file(target="gpu")``),
and builds a bf16 file of MiniLM tiled to >= 1 GiB (compressed both ways). For every
compressed file it checks that ``load_file(..., device="cuda")`` returns the tensors of
``load_file(..., device="cpu")`` bit for bit (names, dtypes, shapes, bytes; the caching
allocator's free memory poisoned before each load), checks that damaged files raise
``CorruptDataError`` naming the place, and times end-to-end loads (file in the page
cache, wall clock until the tensors are ready on the device) against
``safetensors.torch.load_file(original, device="cuda")``. One table at the end; numbers
to ``--out``/load.json.

What it is not: the kernel's benchmark (device_check.py) or a CPU test.

    python3 gpu/load_check.py --data .gpu-data/load --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout

import entropykit  # noqa: E402
from entropykit import CorruptDataError  # noqa: E402
from entropykit.container.cuda import fileplan  # noqa: E402
from entropykit.container.reader import Compressed  # noqa: E402

DEV = "cuda:0"


def log(*a) -> None:
    print(*a, flush=True)


def poison(nbytes: int) -> None:
    """Leave ``nbytes`` of 0xA5 in the caching allocator's free memory, where the next
    load's tensors are carved from (so a byte the decoder does not write shows)."""
    p = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device=DEV)
    del p


def same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in name, dtype, shape or any byte."""
    bad = [k for k in a.keys() ^ b.keys()]
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(k)
            continue
        xb = x.detach().reshape(-1).view(torch.uint8).cpu()
        yb = y.detach().reshape(-1).view(torch.uint8).cpu()
        if not torch.equal(xb, yb):
            bad.append(k)
    return bad


def wall(fn, reps: int) -> list[float]:
    """Seconds of each call of ``fn`` until the device is idle (first call included)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
        del r
    return out


def tile(src: Path, dst: Path, gib: float) -> int:
    """A bf16 safetensors file of ``src``'s tensors repeated (renamed) to >= ``gib``."""
    t = safetensors.torch.load_file(src)
    size = sum(v.numel() * v.element_size() for v in t.values())
    reps = max(1, -(-int(gib * 2**30) // size))
    big = {f"t{r}.{k}": v.clone() for r in range(reps) for k, v in t.items()}
    safetensors.torch.save_file(big, dst)
    return reps


def llm_shaped(src: Path, dst: Path, gib: float, side: int = 4096) -> int:
    """A bf16 file of ``side`` x ``side`` tensors (LLM-sized) filled with ``src``'s weight
    values (every tensor of >= 64 Ki values, concatenated), each from its own offset."""
    t = safetensors.torch.load_file(src)
    vals = torch.cat([v.reshape(-1) for v in t.values() if v.numel() >= 1 << 16])
    per = side * side
    n = max(1, -(-int(gib * 2**30) // (2 * per)))
    big = {}
    for k in range(n):
        idx = (torch.arange(per) + k * 1_000_003) % vals.numel()
        big[f"layers.{k}.weight"] = vals[idx].reshape(side, side).clone()
    safetensors.torch.save_file(big, dst)
    return n


def damage(src: Path, dst: Path, codec: str) -> tuple[str, str]:
    """Copy ``src`` with one byte flipped inside the first large field coded ``codec``;
    returns (tensor, field) damaged."""
    buf = np.fromfile(src, np.uint8)
    c = Compressed(buf)
    outer = {o.name: o for o in c.outer.entries}
    for e in c.original.by_offset:
        t = c.record.tensors[e.name]
        if e.nbytes < 1 << 20:
            continue
        for f, cd in enumerate(t.codecs[0]):
            if cd != codec:
                continue
            o = outer[e.name]
            head = c.outer.data_start + o.begin
            k = len(t.codecs) * len(t.fields)
            lengths = buf[head + 8 : head + 8 + 8 * k].view("<u8").astype(np.int64)
            at = head + 8 + 8 * k + int(lengths[:f].sum())
            bad = buf.copy()
            bad[at + int(lengths[f]) * 2 // 3] ^= 0x10  # well inside its chunks' payloads
            bad.tofile(dst)
            return e.name, t.fields[f][0]
    raise SystemExit(f"{src}: no large field coded {codec}")


def corruption(src: Path, work: Path) -> list[dict]:
    rows = []
    for codec in ("rans", "raw"):
        bad = work / f"bad_{codec}.ek.safetensors"
        name, fld = damage(src, bad, codec)
        res = {}
        for dev in ("cpu", DEV):
            try:
                entropykit.load_file(bad, dev)
                res[dev] = "no error"
            except CorruptDataError as e:
                res[dev] = str(e)
        ok = all(name in m and fld in m for m in res.values())
        rows.append({"codec": codec, "tensor": name, "field": fld, "cpu": res["cpu"],
                     "gpu": res[DEV], "ok": ok})
        log(json.dumps(rows[-1]))
    return rows


def check_exact(stem: str, orig: Path, eks: dict) -> list[dict]:
    """One row per compressed version of ``orig``: whether ``load_file(cuda)`` (free
    device memory poisoned first) equals ``load_file(cpu)`` of it and of the original."""
    raw_bytes = orig.stat().st_size
    rows = []
    for target, ek in eks.items():
        ratio = ek.stat().st_size / raw_bytes
        ref = entropykit.load_file(ek, "cpu")
        plain = entropykit.load_file(orig, "cpu")
        poison(2 * raw_bytes)
        got = entropykit.load_file(ek, DEV)
        bad = same(ref, got) + same(ref, plain)
        codecs_used = sorted({c for t in Compressed(np.fromfile(ek, np.uint8))
                              .record.tensors.values() for seg in t.codecs for c in seg})
        rows.append({"file": stem, "target": target, "ratio": ratio, "tensors": len(ref),
                     "exact": not bad, "bad": bad[:5], "codecs": codecs_used})
        log(json.dumps(rows[-1]))
        del ref, plain, got
    return rows


def check_and_time(stem: str, orig: Path, eks: dict, res: dict, reps: int) -> None:
    """Bit-exactness of every compressed version of ``orig``, then load timings (page
    cache warm: each file was read by the checks; median of the runs after the first)."""
    raw_bytes = orig.stat().st_size
    res["files"] += check_exact(stem, orig, eks)
    cases = [("safetensors -> cuda", orig,
              lambda f=orig: safetensors.torch.load_file(f, device=DEV))]
    for target, ek in eks.items():
        cases.append((f"entropykit {target}-target -> cuda", ek,
                      lambda f=ek: entropykit.load_file(f, DEV)))
    if raw_bytes > 2**29:
        cases.append(("entropykit cpu-target -> cpu (reference)", eks["cpu"],
                      lambda f=eks["cpu"]: entropykit.load_file(f, "cpu")))
    for label, f, fn in cases:
        ts = wall(fn, reps)
        med = statistics.median(ts[1:]) if len(ts) > 1 else ts[0]
        row = {"file": stem, "case": label, "first_s": ts[0], "median_s": med,
               "gbps": raw_bytes / med / 1e9, "file_mb": f.stat().st_size / 1e6}
        res["timings"].append(row)
        log(json.dumps(row))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="folder of compressed MiniLM files")
    ap.add_argument("--gib", type=float, default=1.0, help="size of the tiled bf16 file")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--work", default="/tmp/ek_load")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    p = torch.cuda.get_device_properties(0)
    res: dict = {"date": _dt.date.today().isoformat(), "gpu": p.name, "torch": torch.__version__,
                 "cpus": len(os.sched_getaffinity(0)), "files": [], "timings": []}
    log(json.dumps({k: res[k] for k in ("date", "gpu", "torch", "cpus")}))

    # Originals, and each compressed for the CPU (carried) and for the GPU.
    sets = []
    for ek in sorted(Path(args.data).glob("*.ek.safetensors")):
        stem = ek.name[: -len(".ek.safetensors")]
        orig = work / f"{stem}.safetensors"
        entropykit.decompress_file(ek, orig, force=True)
        gpu_ek = work / f"{stem}.gpu.ek.safetensors"
        entropykit.compress_file(orig, gpu_ek, force=True, target="gpu")
        sets.append((stem, orig, {"cpu": ek, "gpu": gpu_ek}))
    for stem, orig, eks in sets:
        check_and_time(stem, orig, eks, res, args.reps)
    bf16 = next(o for s, o, _ in sets if "bf16" in s)
    bigs = []
    for kind in ("tiled", "llm-shaped"):
        big = work / f"{kind}_bf16.safetensors"
        t = time.perf_counter()
        n = tile(bf16, big, args.gib) if kind == "tiled" else llm_shaped(bf16, big, args.gib)
        stem = f"minilm_bf16 {kind} x{n}"
        log(f"{stem}: {big.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
        comp = {}
        for target in ("cpu", "gpu"):
            t = time.perf_counter()
            dst = work / f"{kind}_bf16.{target}.ek.safetensors"
            s = entropykit.compress_file(big, dst, force=True, target=target)
            comp[target] = dst
            log(f"  compress for {target}: {time.perf_counter() - t:.1f} s, ratio "
                f"{s.compressed_bytes / s.original_bytes:.4f}")
        sets.append((stem, big, comp))
        check_and_time(*sets[-1], res, args.reps)
        bigs.append((stem, comp["gpu"]))

    # Where the time goes on the big GPU-target files: host planning alone, then the rest.
    from entropykit.container.cuda import load as gload

    dtypes = entropykit.api._torch_dtypes()
    threads = len(os.sched_getaffinity(0))
    res["breakdown"] = []
    for stem, ek in bigs:
        buf = np.fromfile(ek, np.uint8)
        c = Compressed(buf)
        for gb, th in ((64 << 20, 1), (64 << 20, 4), (64 << 20, threads), (16 << 20, threads),
                       (256 << 20, threads)):
            t = time.perf_counter()
            groups = list(fileplan.groups(c, th, group_bytes=gb))
            plan_s = time.perf_counter() - t
            del groups
            secs: dict = {}
            ts = wall(functools.partial(gload.load, c, DEV, dtypes, th, group_bytes=gb,
                                        seconds=secs), 4)
            row = {"file": stem, "group_mib": gb >> 20, "threads": th, "plan_only_s": plan_s,
                   "load_median_s": statistics.median(ts[1:]), "from": "memory (np.fromfile)",
                   "last_load_host_s": {k: round(v, 4) for k, v in secs.items()}}
            res["breakdown"].append(row)
            log(json.dumps(row))

    res["corruption"] = corruption(next(e["gpu"] for s, _, e in sets if s == "minilm_bf16"),
                                   work)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "load.json").write_text(json.dumps(res, indent=1))

    log(f"\n{res['gpu']}  {res['date']}  {res['cpus']} CPUs")
    log(f"{'file':28s} {'target':6s} {'ratio':>7s} {'tensors':>7s} exact")
    for r in res["files"]:
        log(f"{r['file']:28s} {r['target']:6s} {r['ratio']:7.4f} {r['tensors']:7d} {r['exact']}")
    log(f"{'file':28s} {'load':42s} {'first s':>8s} {'med s':>8s} {'GB/s':>6s}")
    for r in res["timings"]:
        log(f"{r['file']:28s} {r['case']:42s} {r['first_s']:8.3f} {r['median_s']:8.3f} "
            f"{r['gbps']:6.2f}")
    for r in res["corruption"]:
        log(f"damaged {r['codec']} field: {'ok' if r['ok'] else 'WRONG'} ({r['gpu']})")
    if not all(r["exact"] for r in res["files"]) or not all(r["ok"] for r in res["corruption"]):
        raise SystemExit("a load was not bit-exact or a damaged file was not caught")


if __name__ == "__main__":
    main()
