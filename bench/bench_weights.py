"""Per-format benchmark of whole safetensors files: entropykit beside zipnn and zstd-3.

What it is: one run over the same real weight files — MiniLM-L6 cast to BF16, F16, F32,
F8_E4M3 and F8_E5M2 (``bench/data.py``), and SmolLM2-135M's Q4_1 GGUF tensors re-saved as
a safetensors file of packed 4-bit U8 blocks — that measures, per file:

- entropykit: ``compress_file`` / ``decompress_file`` on disk, by default and with
  ``fast=True``; ratio = compressed file bytes / original file bytes; compress and
  decompress MB/s of the original size at one thread and at every available core (each
  timed run writes a new file: the previous output is removed before the clock starts);
  the restored file compared with the original byte for byte, and the compressed files of
  both thread counts compared with each other (determinism);
- entropykit in memory, one thread, on the footing of the peers' numbers: the file's bytes
  already in memory compressed into a bytes buffer (``container.writer.write``), and the
  compressed file's bytes decoded into the original file's bytes
  (``Compressed.restored``), both checked against the file-to-file results;
- zipnn and zstd-3 (one thread), measured by the peers' harness cpu_peers.py itself
  (outside this repository; imported, its timer swapped for the median used here),
  round trips checked there;
- the order-0 entropy bound of the tensor bytes (per tensor, per field: cpu_peers.py's split).

``--write`` replaces the "## Weights" section of bench/RESULTS.md with the table.
What it is not: a coder benchmark (``bench_coders.py``) or a GPU benchmark.

Timings are the median of ``--reps`` runs after one warm-up run (which also compiles the
Numba kernels, so compilation is never timed), and the best of ``--rounds`` rounds in which
the peers and entropykit take turns: this VM's speed drifts by up to ~40 % for seconds at a
time, which one pass would charge to whichever tool ran then. Every round's outputs are
checked; a size that differs between rounds marks the row not deterministic.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import filecmp
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import bench_coders  # noqa: E402 - bench/ is a folder of scripts, not a package
import data  # noqa: E402
import results as results_md  # noqa: E402

SECTION = "## Weights"
RESULTS = BENCH / "RESULTS.md"
PEERS = BENCH.parent.parent / "shared" / "peers" / "cpu_peers.py"
_Q4_VERSION = 1  # part of the cached Q4_1 file's name: bump it when its layout changes

# The project's ratio targets, by format.
RATIO_TARGETS = {"BF16": 0.660, "F16": 0.845, "F8_E4M3": 0.815}
SPEED_FACTOR = 3.0  # entropykit >= 3x zipnn's MB/s at one thread, both ways
# Our format name -> the name cpu_peers.py measures it under (it has no e5m2 or 4-bit).
PEER_FORMATS = {"BF16": "bf16", "F16": "fp16", "F32": "fp32", "F8_E4M3": "fp8"}
ALL_FORMATS = ("BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "Q4_1")


# ---------------------------------------------------------------- data


def q4_1_blocks_path() -> Path:
    """SmolLM2-135M's Q4_1 tensors as safetensors: ``<name>_blocks`` U8 + ``<name>_scales`` F16.

    A GGUF Q4_1 block is 20 bytes: f16 scale d, f16 minimum m, then 16 bytes of 32 unsigned
    4-bit codes (value = d * code + m). Each Q4_1 tensor of shape (rows, cols) becomes
    ``<name>_blocks`` (rows, cols/32, 16) U8 — the packed codes, untouched — and
    ``<name>_scales`` (rows, cols/32, 2) F16 holding (d, m). The ``_blocks``/``_scales`` names
    with 16-byte blocks are what ``entropykit.formats.layout_for`` recognizes as packed 4-bit
    (it calls the layout "mxfp4"; the split, one symbol per byte, does not depend on the
    code's meaning). Tensors of other GGUF types (the Q8_0 embedding, F32 norms) are left
    out, so the file is the model's packed 4-bit part only. Written once, then reused.
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from safetensors.numpy import save_file

    src = data.smollm2_gguf_path()
    dst = data.cache_dir() / "casts" / f"smollm2-135m.q4_1-blocks.v{_Q4_VERSION}.safetensors"
    if dst.is_file() and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    out: dict[str, np.ndarray] = {}
    for t in GGUFReader(str(src)).tensors:
        if t.tensor_type != GGMLQuantizationType.Q4_1:
            continue
        raw = np.asarray(t.data, dtype=np.uint8)  # (rows, 20 * blocks per row)
        blocks = raw.reshape(raw.shape[0], -1, 20)
        out[f"{t.name}_scales"] = np.ascontiguousarray(blocks[..., :4]).view(np.float16)
        out[f"{t.name}_blocks"] = np.ascontiguousarray(blocks[..., 4:])
    if not out:
        raise RuntimeError(f"{src} has no Q4_1 tensor")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.part")
    save_file(out, str(tmp))
    os.replace(tmp, dst)
    return dst


def _packed4_tensors(path: Path) -> int:
    """How many tensors of ``path`` entropykit's ``layout_for`` takes as packed 4-bit."""
    from safetensors import safe_open

    from entropykit.formats import layout_for

    with safe_open(str(path), framework="np") as f:
        names = set(f.keys())
        return sum(
            layout_for(k, f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()), names)
            is not None
            for k in names
        )


def _peers_module():
    """shared/peers/cpu_peers.py, imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_peers", PEERS)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {PEERS}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def order0_bound(path: Path, peers) -> tuple[float, int, bytes]:
    """(order-0 bound in bytes, tensor bytes, floating tensors' bytes joined) of ``path``.

    The last is what cpu_peers.py codes for this file: its floating tensors, in the order
    ``safetensors.torch.load_file`` gives them, joined.

    Per tensor, per field, as cpu_peers.py splits it (bf16 exponent / sign+mantissa, fp16
    byte planes, fp32 four fields, any other dtype its whole bytes); this is the bound of a
    coder with one static model per field and tensor, tables not counted.
    """
    import torch
    from safetensors.torch import load_file

    bits, nbytes, floats = 0.0, 0, []
    for t in load_file(str(path)).values():
        if t.numel() == 0:
            continue
        t = t.contiguous()
        if t.is_floating_point():
            floats.append(t.view(torch.uint8).numpy().tobytes())
        elif t.dtype.itemsize > 1:  # wider integers: their bytes, as cpu_peers would
            t = t.view(torch.uint8)
        bits += sum(peers.entropy_bits(x, n) for x, n in peers.fields(t))
        nbytes += t.numel() * t.dtype.itemsize
    return bits / 8, nbytes, b"".join(floats)


# ---------------------------------------------------------------- measuring


def _median_timer(reps: int, results: list, keep: Callable[[int], bool]) -> Callable:
    """A stand-in for cpu_peers.best: (median seconds of ``reps`` runs after a warm-up,
    result); the i-th result is appended to ``results`` if ``keep(i)``, else None."""

    def timed(fn: Callable[[], object], k: int = 3) -> tuple[float, object]:
        sec, out = bench_coders._timed(fn, reps)
        results.append(out if keep(len(results)) else None)
        return sec, out

    return timed


def measure_peers(reps: int, formats: list[str]) -> tuple[dict[str, dict], object]:
    """cpu_peers.py's rows for ``formats`` (ours, those it knows), keyed by our format name.

    Run in this process on the original fp32 file: it casts the floating tensors itself with
    the same arithmetic as ``data.cast_file`` (round to nearest even; fp8 scaled by max/448).
    Each row also gets ``zstd3_back``, zstd's decoded bytes (cpu_peers.py times zstd's
    decode but does not compare it): ``main`` checks them against our cast file's tensor
    bytes, which checks zstd's round trip and that both sides coded the same data.
    """
    peers = _peers_module()
    if not formats:
        return {}, peers
    results: list = []
    groups: list[list] = []
    convert = peers.convert

    def marking_convert(t, fmt):  # called per tensor; a new format starts a new group
        if not groups or groups[-1][0] != fmt:
            groups.append([fmt, len(results)])
        return convert(t, fmt)

    # Keep only zstd's decoded bytes (the second timed call of each format): the others
    # would hold several copies of the data for nothing.
    peers.best = _median_timer(reps, results, lambda i: bool(groups) and i == groups[-1][1] + 1)
    peers.convert = marking_convert
    argv = sys.argv
    sys.argv = ["cpu_peers.py", str(data.minilm_path()),
                "--formats", ",".join(PEER_FORMATS[f] for f in formats)]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            peers.main()
    finally:
        sys.argv = argv
    by_peer = {v: k for k, v in PEER_FORMATS.items()}
    rows = {by_peer[r["format"]]: r for r in
            (json.loads(ln) for ln in out.getvalue().splitlines() if ln.startswith("{"))}
    for fmt, first in groups:  # each format times zstd encode, then zstd decode, first
        rows[by_peer[fmt]]["zstd3_back"] = bytes(results[first + 1])
    return rows, peers


@dataclass
class Ours:
    """entropykit on one file: sizes, speeds (MB/s of the original) and checks."""

    original: int = 0
    compressed: int = 0
    speeds: dict[str, float] = field(default_factory=dict)  # "c1", "d1", "cN", "dN", "cm", "dm"
    exact: bool = True
    deterministic: bool = True
    error: str = ""

    @property
    def ratio(self) -> float:
        return self.compressed / self.original


def _timed_to(out: Path | None, fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` runs of ``fn`` (which writes ``out``, if not None) after a
    warm-up run; ``out`` is removed before every run, outside the timing, so no run pays
    for deleting the previous one's output (~15 ms for 45 MB here)."""
    times = []
    for i in range(reps + 1):
        if out is not None:
            out.unlink(missing_ok=True)
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_ours(path: Path, thread_counts: tuple[int, ...], reps: int, tmp: Path,
                 fast: bool = False) -> Ours:
    """Compress and restore ``path`` on disk at each thread count; check every output."""
    import entropykit

    r = Ours(original=path.stat().st_size)
    outputs = []
    try:
        for n in thread_counts:
            packed, back = tmp / f"{path.stem}.{n}.ek.safetensors", tmp / f"{path.stem}.{n}.back"
            sec = _timed_to(packed, lambda p=packed, n=n: entropykit.compress_file(
                path, p, threads=n, fast=fast), reps)
            r.speeds[f"c{n}"] = r.original / sec / 1e6
            sec = _timed_to(back, lambda p=packed, b=back, n=n: entropykit.decompress_file(
                p, b, threads=n), reps)
            r.speeds[f"d{n}"] = r.original / sec / 1e6
            r.exact &= filecmp.cmp(path, back, shallow=False)
            back.unlink()
            outputs.append(packed)
        r.compressed = outputs[0].stat().st_size
        r.deterministic = all(filecmp.cmp(outputs[0], p, shallow=False) for p in outputs[1:])
        packed = outputs[0].read_bytes()
        r.speeds["cm"], r.speeds["dm"], same = _in_memory(path, packed, reps, fast)
        r.exact &= same
    except Exception as e:  # a failure is a row of the table, not a crash of the run
        r.error = f"{type(e).__name__}: {e}"[:160]
        r.exact = False
    finally:
        for p in outputs:
            p.unlink(missing_ok=True)
    return r


def _in_memory(path: Path, packed: bytes, reps: int, fast: bool) -> tuple[float, float, bool]:
    """(compress MB/s, decompress MB/s, both outputs right) at one thread, data in memory:
    the original file's bytes coded into a bytes buffer, and ``packed`` (the file-to-file
    result, which the buffer must equal) decoded into the original file's bytes."""
    from entropykit.container import files
    from entropykit.container.reader import Compressed
    from entropykit.container.writer import write

    original = np.fromfile(path, np.uint8)
    blob = np.frombuffer(packed, np.uint8)
    coded: list[bytes] = []

    def compress() -> None:
        out = io.BytesIO()
        write(files.source(original), out, threads=1, fast=fast)
        coded[:] = [out]  # its bytes are read after the clock stops

    def decompress() -> None:
        coded[:] = [Compressed(blob).restored(1)]

    c = _timed_to(None, compress, reps)
    same = coded[0].getbuffer() == packed
    d = _timed_to(None, decompress, reps)
    same &= np.array_equal(coded[0], original)
    return original.size / c / 1e6, original.size / d / 1e6, same


def _best_peer(a: dict, b: dict) -> dict:
    """Two rounds' cpu_peers.py row of one format: the faster speed of each, both checks."""
    out = dict(a)
    for k, v in b.items():
        if k.endswith("_MBps"):
            out[k] = max(a.get(k, 0.0), v)
        elif k.endswith("_exact"):
            out[k] = a.get(k, False) and v
    return out


def _best_ours(a: Ours, b: Ours) -> Ours:
    """Two rounds of ``measure_ours`` on one file: the faster speed of each, both checks."""
    speeds = {k: max(a.speeds.get(k, 0.0), v) for k, v in b.speeds.items()}
    return Ours(original=a.original, compressed=a.compressed, speeds=speeds,
                exact=a.exact and b.exact,
                deterministic=a.deterministic and b.deterministic
                and a.compressed == b.compressed,
                error=a.error or b.error)


# ---------------------------------------------------------------- report


def _mb(x: float | None) -> str:
    return "" if x is None else f"{x:,.0f}"


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def _targets(fmt: str, ours: Ours, peer: dict | None) -> str:
    """The project targets that apply to this format, each met or not met."""
    notes = []
    if fmt in RATIO_TARGETS:
        goal = RATIO_TARGETS[fmt]
        notes.append(f"ratio ≤ {goal:.3f}: {_verdict(ours.ratio <= goal)}")
    if peer and "zipnn_c_MBps" in peer:
        # Against a zipnn whose output is wrong the verdict stands, but says so.
        inexact = "" if peer["zipnn_exact"] else ", zipnn inexact"
        for key, what in (("c", "compress"), ("d", "decompress")):
            # Same footing as zipnn's figure: one thread, data in memory.
            times = ours.speeds.get(f"{key}m", 0.0) / peer[f"zipnn_{key}_MBps"]
            notes.append(f"{what} ≥ {SPEED_FACTOR:.0f}× zipnn 1T: "
                         f"{_verdict(times >= SPEED_FACTOR)} ({times:.1f}×{inexact})")
    return "; ".join(notes)


def table(cases: list[dict], n_all: int) -> str:
    head = (f"| format | tool | ratio | compress MB/s 1T memory | decompress MB/s 1T memory "
            f"| compress MB/s 1T file | decompress MB/s 1T file "
            f"| compress MB/s {n_all}T file | decompress MB/s {n_all}T file | exact "
            f"| targets |")
    lines = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    blank = "| | | |"  # the file columns, which peers do not have
    for c in cases:
        fmt, peer = c["label"], c["peer"]
        for tool, o in (("entropykit", c["ours"]), ("entropykit --fast", c["fast"])):
            lines.append(_our_row(fmt, tool, o, n_all, _targets(c["fmt"], o, peer)))
        if peer is None:
            lines.append(f"| {fmt} | zipnn, zstd-3 | | | {blank} | | not measured: "
                         "cpu_peers.py has no such format |")
        else:
            if "zipnn_error" in peer:
                lines.append(f"| {fmt} | zipnn | | | {blank} | | error: {peer['zipnn_error']} | |")
            else:
                ok = peer["zipnn_exact"]
                speeds = (f"{_mb(peer['zipnn_c_MBps'])} | {_mb(peer['zipnn_d_MBps'])}" if ok else
                          f"({_mb(peer['zipnn_c_MBps'])}) | ({_mb(peer['zipnn_d_MBps'])})")
                lines.append(f"| {fmt} | zipnn | {peer['zipnn_ratio']:.4f} | {speeds} {blank} "
                             f"| {'yes' if ok else '**NO: output differs from input**'} | |")
            lines.append(f"| {fmt} | zstd-3 | {peer['zstd3_ratio']:.4f} "
                         f"| {_mb(peer['zstd3_c_MBps'])} | {_mb(peer['zstd3_d_MBps'])} {blank} "
                         f"| {'yes' if peer['zstd3_exact'] else '**NO** (or other data)'} | |")
        lines.append(f"| {fmt} | order-0 bound | {c['bound']:.4f} | | {blank} | | | |")
    return "\n".join(lines)


def _our_row(fmt: str, tool: str, o: Ours, n_all: int, targets: str) -> str:
    if o.error:
        return f"| {fmt} | {tool} | | | | | | | | error: {o.error} | |"
    exact = "yes" if o.exact else "**NO**"
    if not o.deterministic:
        exact += f" (**1T and {n_all}T outputs differ**)"
    sp = o.speeds
    return (f"| {fmt} | {tool} | {o.ratio:.4f} | {_mb(sp.get('cm'))} | {_mb(sp.get('dm'))} "
            f"| {_mb(sp.get('c1'))} | {_mb(sp.get('d1'))} | {_mb(sp.get(f'c{n_all}'))} "
            f"| {_mb(sp.get(f'd{n_all}'))} | {exact} | {targets} |")


def section(cases: list[dict], reps: int, rounds: int, n_all: int,
            load: tuple[float, float], elapsed: float) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from importlib.metadata import version

    busy = ("other work shared the cores during this run, so MB/s are lower and noisier "
            "than on a quiet machine" if load[0] >= 0.5 else "the machine was quiet before "
            "the run")
    files = "\n".join(
        f"- **{c['label']}**: `{c['path'].name}`, {c['ours'].original:,} bytes"
        + (f"; {c['packed4']} tensors taken as packed 4-bit by `layout_for`" if c.get("packed4")
           else "")
        for c in cases)
    return f"""{SECTION}

Produced by `python bench/bench_weights.py --write` on {date}.

- Machine: {results_md.cpu_model()}, {n_all} cores available; load average
  {load[0]:.2f} before and {load[1]:.2f} after: {busy}.
- Software: {bench_coders._versions()}, zipnn {version('zipnn')}, torch {version('torch')}.
- Run: {elapsed:.0f} s; every timing is the median of {reps} runs after one warm-up run
  (Numba compilation excluded), peers included (cpu_peers.py's timer replaced by the same),
  and the best of {rounds} rounds in which the peers and entropykit take turns (this VM's
  speed drifts for seconds at a time); every round's outputs are checked.

{files}

entropykit: ratio = compressed file bytes / original file bytes; MB/s = original bytes per
second. "memory": one thread, the file's bytes already in memory coded into a bytes buffer
(`container.writer.write`) and the compressed bytes decoded into the original file's bytes
(`Compressed.restored`), the footing of the peers' figures (the §9 speed verdicts use
these); "file": `entropykit.compress_file` / `decompress_file`, file to file on disk (page
cache, fsync'd output; each timed run writes a new file), at 1 thread and {n_all} threads.
"exact" = the restored file equals the original (`filecmp`, byte for byte), the in-memory
results equal the file results, and the 1- and {n_all}-thread compressed files are
identical. `--fast` (`compress_file(..., fast=True)`)
stores fields that entropy coding would shrink by under 2% raw (BF16/F32 mantissa bytes),
codes the rest with rANS at 12 bits (tANS only where it saves 0.5%: small fields), and
tries zstd on small fields only; decompression needs no option. One thread's time is now
mostly the coder kernels (## Coders) and the format split/join; their speed, not the
container, bounds MB/s.
zipnn and zstd-3: the peers' harness cpu_peers.py, kept outside this repository (one
thread, data in memory), which casts the fp32 file itself; ratio over the concatenated
floating tensor bytes. zipnn's "exact": its decoded bytes equal its input (checked by
cpu_peers.py); zstd-3's: its decoded bytes equal the floating tensor bytes of the cast
file entropykit coded (checked here, which also shows both sides coded the same data). A
peer whose output is wrong has its MB/s in parentheses: not to be quoted. cpu_peers.py has
no e5m2 or 4-bit format, so those files have no peers.
Order-0 bound: the per-tensor, per-field entropy of the tensor bytes (cpu_peers.py's
split; tables and headers not counted); entropykit conditions the bf16/f32 mantissa on the
exponent, so it may go below it. SmolLM2 Q4_1: only the Q4_1 tensors (Q8_0 embedding and
F32 norms left out), codes as `<name>_blocks` U8 (…, 16) and (d, m) as `<name>_scales` F16.

{table(cases, n_all)}
"""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3, help="timed runs per measurement (>= 3)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of peers then entropykit; the best of each timing is kept")
    ap.add_argument("--no-q4", action="store_true", help="skip the SmolLM2 Q4_1 file")
    ap.add_argument("--formats", default=",".join(ALL_FORMATS),
                    help=f"comma-separated subset of {','.join(ALL_FORMATS)} (quick runs: "
                    "e.g. --formats BF16; peers are measured for those only)")
    ap.add_argument("--write", action="store_true", help=f"replace {SECTION!r} in {RESULTS}")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.rounds < 1:
        ap.error("--reps and --rounds must be >= 1")

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    n_all = len(os.sched_getaffinity(0))
    thread_counts = (1,) if n_all == 1 else (1, n_all)
    chosen = [f for f in args.formats.split(",") if f]
    if not chosen or set(chosen) - set(ALL_FORMATS):
        ap.error(f"--formats: choose from {','.join(ALL_FORMATS)}")
    plan = [(fmt, f"MiniLM {fmt}", data.minilm_cast_path(fmt))
            for fmt in ALL_FORMATS[:-1] if fmt in chosen]
    if "Q4_1" in chosen and not args.no_q4:
        plan.append(("Q4_1", "SmolLM2 Q4_1 blocks", q4_1_blocks_path()))

    cases: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ek-bench-", dir=data.cache_dir()) as tmp:
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}: peers (cpu_peers.py) ...", file=sys.stderr,
                  flush=True)
            peer_rows, peers = measure_peers(args.reps, [f for f in chosen if f in PEER_FORMATS])
            for i, (fmt, label, path) in enumerate(plan):
                print(f"round {rnd + 1}/{args.rounds}: {label} ...", file=sys.stderr, flush=True)
                if not rnd:
                    bound_bytes, tensor_bytes, float_bytes = order0_bound(path, peers)
                    cases.append(dict(fmt=fmt, label=label, path=path, peer=None,
                                      bound=bound_bytes / tensor_bytes, float_bytes=float_bytes,
                                      packed4=_packed4_tensors(path) if fmt == "Q4_1" else 0))
                case = cases[i]
                peer = peer_rows.get(fmt)
                if peer is not None:
                    float_bytes = case["float_bytes"]
                    peer["zstd3_exact"] = peer.pop("zstd3_back") == float_bytes
                    if not peer["zstd3_exact"] and peer["bytes"] != len(float_bytes):
                        raise RuntimeError(f"{label}: cpu_peers.py coded {peer['bytes']} bytes, "
                                           f"the file holds {len(float_bytes)} floating bytes")
                    case["peer"] = peer if rnd == 0 else _best_peer(case["peer"], peer)
                for key, fast in (("ours", False), ("fast", True)):
                    o = measure_ours(path, thread_counts, args.reps, Path(tmp), fast=fast)
                    case[key] = o if rnd == 0 else _best_ours(case[key], o)

    text = section(cases, args.reps, args.rounds, n_all, (load_before, os.getloadavg()[0]),
                   time.perf_counter() - t_start)
    print(text)
    if args.write:
        results_md.write_section(text, SECTION, RESULTS)
        print(f"wrote {SECTION!r} to {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
