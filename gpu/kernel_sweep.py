"""Static rANS decoder variants side by side: decode speed per build, bf16 and fp8 e4m3.

What it is: the script a GPU machine runs to choose the decoder's build. Every variant is
one build of the one kernel (``_kernel.cu``'s compile-time options: table layout
``TABLES``, ring windows ``RING_WINDOWS``, lanes a thread ``LANES``, warp-uniform control
``UNIFORM``, byte ring cursor ``RENORM``) at some pairs per block (warps at one lane a
thread), selected the way a user's decode selects it (``rans.cuda._runtime.variant``: the
private environment variables set here) and bound to the same uploaded batch. Data:
MiniLM-L6's bf16 tensors (the carried compressed file) and their fp8 e4m3 cast
(``bench_gpu.e4m3_of``), coded as ``bench_gpu.py`` codes them, decoded by the CPU decoder
and tiled to ``--gib`` GiB of output. Each variant decodes into a poisoned arena, is
checked byte for byte against the CPU decoder's output (and its status), and is timed
with CUDA events (median of ``--reps``); the first variant is timed again last, to show
the run's drift. Prints one table: GB/s of output per variant and data set, beside a
device-to-device copy of the output and the read+write bound (the copy's rate scaled to
the bytes a decode moves: compressed in, output out).
What it is not: the peer benchmark (``bench_gpu.py``) or the correctness suite
(``gpu/tests``, which also runs every variant here).

    python3 gpu/kernel_sweep.py --data .gpu-bench/minilm_bf16.ek.safetensors --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu as bg  # noqa: E402 - data sets and coding, shared
from device_check import occupancy, timed  # noqa: E402

from entropykit import rans  # noqa: E402
from entropykit.gpu import upload  # noqa: E402
from entropykit.rans.cuda import plan  # noqa: E402


class Variant(NamedTuple):
    """A build and its pairs per block; None: the default (``_runtime.TABLES``,
    ``_runtime.RING_WINDOWS``, ``_runtime.LANES``, ``_runtime.UNIFORM``, ``_runtime.RENORM``,
    ``plan.WARPS``)."""

    name: str
    tables: int | None = None
    ring: int | None = None
    warps: int | None = None
    lanes: int | None = None
    uniform: int | None = None
    renorm: int | None = None


# The first is the default build, as a decode takes it; each other changes some of
# today's choices (tables 1, ring 8, warps 16, lanes 1, uniform 1, renorm 1). Grouped by
# warps: a change of warps plans and uploads the batch again.
_NEW = {"tables": 1, "ring": 8, "warps": 16}
VARIANTS = (
    Variant("default"),
    Variant("u0r0", **_NEW, lanes=1, uniform=0, renorm=0),
    Variant("u0", **_NEW, lanes=1, uniform=0, renorm=1),
    Variant("r0", **_NEW, lanes=1, uniform=1, renorm=0),
    Variant("l2", **_NEW, lanes=2, uniform=0, renorm=0),
    Variant("l2u1r1", **_NEW, lanes=2, uniform=1, renorm=1),
    Variant("w8", tables=1, ring=8, warps=8, lanes=1, uniform=1, renorm=1),
)


def env(v: Variant) -> dict[str, str | None]:
    """The environment that makes ``v``'s build the one the next bound launch takes
    (None: unset)."""
    from entropykit.rans.cuda import _runtime  # CuPy's: only where a decode runs

    return {_runtime._ENV_TABLES: None if v.tables is None else str(v.tables),
            _runtime._ENV_LANES: None if v.lanes is None else str(v.lanes),
            _runtime._ENV_UNIFORM: None if v.uniform is None else str(v.uniform),
            _runtime._ENV_RENORM: None if v.renorm is None else str(v.renorm),
            _runtime._ENV_RING: None if v.ring is None else str(v.ring)}


def select(v: Variant) -> None:
    for k, val in env(v).items():
        if val is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = val


def cpu_reference(per: list, width: int) -> list[np.ndarray]:
    """Each tensor as the CPU decoder decodes its streams (bit arrays, as DataSet holds)."""
    def dec(s: plan.Stream, ctx: np.ndarray | None = None) -> np.ndarray:
        if s.info is None:
            return np.asarray(s.data, np.uint8)
        return rans.decode(s.data, context=ctx if s.context else None)

    out = []
    for streams in per:
        if width == 1:
            out.append(dec(streams[0]))
            continue
        e = dec(streams[0])
        m = dec(streams[1], e).astype(np.uint16)
        e = e.astype(np.uint16)
        out.append(((m >> 7) << 15 | e << 7 | (m & 0x7F)).astype(np.uint16))
    return out


def copy_gbps(data: torch.Tensor, reps: int) -> float:
    """GB/s of a device-to-device copy of ``data`` (its bytes per second)."""
    dst = torch.empty_like(data)
    t = statistics.median(timed(lambda: None, lambda: dst.copy_(data), reps))
    return data.numel() * data.element_size() / t / 1e9


def sweep(name: str, tensors: list[np.ndarray], reps_tile: int, variants, reps: int,
          sm_rule: str) -> list[dict]:
    from entropykit.rans.cuda import _runtime

    width = tensors[0].dtype.itemsize
    # ek_streams reads only these of a DataSet (whose constructor uploads the tiled data)
    per, stored, note = bg.ek_streams(SimpleNamespace(name=name, tensors=tensors, width=width),
                                      sm_rule)
    ref = cpu_reference(per, width)
    lossless = all(np.array_equal(a, b) for a, b in zip(ref, tensors, strict=True))
    ds = bg.DataSet(name, ref, reps_tile, "")  # the CPU decoder's output, tiled
    ratio = stored / (ds.values * width)
    rows: list[dict] = []
    copy = copy_gbps(ds.data, reps)
    bound = copy * 2 / (1 + ratio)  # decode moves ratio + 1 output sizes, a copy 2
    bg.log(f"== {name}: {ds.out_bytes / 2**30:.2f} GiB, ratio {ratio:.4f}, {note} "
           f"CPU round trip exact: {lossless}; copy {copy:.0f} GB/s")
    arena = torch.empty_like(ds.data)
    sizes = [t.size for t in ds.tensors] * ds.reps
    outs = list(torch.split(arena, sizes))
    uploaded: dict[int, object] = {}
    for v in (*variants, variants[0]):
        warps = v.warps or plan.WARPS
        if warps not in uploaded:
            uploaded.clear()  # one batch on the device at a time
            torch.cuda.empty_cache()
            uploaded[warps] = upload(bg.batch_of(per, ds, warps), bg.DEV)
        db = uploaded[warps]
        select(v)
        built = _runtime.variant()
        row = {"set": name, "variant": v.name, **built._asdict(), "warps": warps,
               "ratio": round(ratio, 4)}
        try:
            t0 = time.perf_counter()
            launch = db.bind(outs)
            launch()  # the build compiles here, untimed
            torch.cuda.synchronize()
            row["build_s"] = round(time.perf_counter() - t0, 1)
            ts = timed(lambda: arena.fill_(bg.POISON[width]), launch, reps)
            db.check()
            row["exact"] = bool(torch.equal(arena, ds.data)) and lossless
            med = statistics.median(ts)
            row.update(gbps=round(ds.out_bytes / med / 1e9, 1),
                       spread_pct=round(100 * (max(ts) - min(ts)) / med, 1),
                       of_copy=round(ds.out_bytes / med / 1e9 / copy, 3),
                       of_bound=round(ds.out_bytes / med / 1e9 / bound, 3),
                       **occupancy(launch))
        except Exception as e:  # a failing build is a row, not the end of the sweep
            row.update(exact=False, error=f"{type(e).__name__}: {str(e)[:200]}")
        rows.append(row)
        bg.log(json.dumps(row))
    rows.append({"set": name, "variant": "device-to-device copy", "gbps": round(copy, 1),
                 "bound_gbps": round(bound, 1), "exact": True})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| set | variant | tables | ring | lanes | uniform | renorm | pairs a block | GB/s "
            "| x copy | of bound | regs | warps/SM | exact |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        cells = [r["set"], r["variant"], *(r.get(k, "") for k in (
                     "tables", "ring", "lanes", "uniform", "renorm", "warps")),
                 r.get("gbps", r.get("error", "")), r.get("of_copy", ""),
                 r.get("of_bound", r.get("bound_gbps", "")), r.get("regs", ""),
                 r.get("warps_sm", ""), r.get("exact", "")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=".gpu-bench/minilm_bf16.ek.safetensors")
    ap.add_argument("--gib", type=float, default=1.0, help="output of each set, tiled")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sets", default="bf16,e4m3",
                    help="bf16, bf16-coded (sm coded), e4m3, e4m3-pairs, e4m3-ranked "
                    "(bench_gpu.py's fp8 pair layouts)")
    ap.add_argument("--variants", default="", help="names to run (default: all)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants.split(",")]
    if not chosen:
        raise SystemExit(f"no variant named in {args.variants!r}")
    if any(os.environ.get(k) is not None for k in env(VARIANTS[0])):
        raise SystemExit(f"unset {', '.join(env(VARIANTS[0]))}: the sweep sets them")
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name(bg.DEV)
    bg.log(f"device {name}, torch {torch.__version__}")
    base = bg.minilm_bf16(args.data)
    n = sum(t.size for t in base)
    tile = math.ceil(args.gib * 2**30 / n)  # fp8 tiles; bf16 half as many
    sets = {"bf16": lambda: ("minilm-bf16", base, -(-tile // 2), "gpu"),
            "bf16-coded": lambda: ("minilm-bf16 sm coded", base, -(-tile // 2), "coded"),
            "e4m3": lambda: ("minilm-e4m3", bg.e4m3_of(base), tile, "gpu"),
            # bench_gpu.py's fp8 pair layouts, decoded by the bf16 build (same output bytes)
            "e4m3-pairs": lambda: ("minilm-e4m3-pairs", bg.pairs_as_bf16(
                bg.e4m3_of(base), bg.pair_split), tile, "raw"),
            "e4m3-ranked": lambda: ("minilm-e4m3-ranked", bg.pairs_as_bf16(
                bg.e4m3_of(base), bg.ranked_split), tile, "raw")}
    rows = []
    try:
        for s in args.sets.split(","):
            set_name, tensors, reps_tile, rule = sets[s]()
            rows += sweep(set_name, tensors, reps_tile, chosen, args.reps, rule)
    finally:
        select(VARIANTS[0])
    md = f"{name}, {time.perf_counter() - t0:.0f} s\n\n" + table(rows)
    bg.log("\n" + md)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "kernel_sweep.json").write_text(json.dumps(rows, indent=1))
        (Path(args.out) / "kernel_sweep.md").write_text(md + "\n")
    bad = [r for r in rows if not r.get("exact")]
    if bad:
        raise SystemExit(f"{len(bad)} row(s) not exact: "
                         + ", ".join(f"{r['set']}/{r['variant']}" for r in bad))


if __name__ == "__main__":
    main()
